"""TRL 1.16's split of preference rows whose prompt is implicit in two whole texts (no `prompt`
field: the Anthropic HH layout), written to tests/fixtures/data/implicit_text_trl.json for
tests/data_formats.rs, which asserts that lorafit splits every such row where TRL does and
refuses the rows where the texts never differ or share no leading text.

The rows are HH-style conversations plus random texts over a small alphabet (spaces, newlines,
a two-byte and a four-byte character), so that the first difference falls after spaces, at the
start, at multi-byte characters, and nowhere. Each goes through `trl.data_utils.maybe_extract_prompt`.

    python3 -m venv /tmp/vtrl && /tmp/vtrl/bin/pip install trl==1.16.0 --no-deps && \
        /tmp/vtrl/bin/pip install datasets transformers
    /tmp/vtrl/bin/python scripts/make_implicit_prompt_fixture.py
"""

import json
import os
import random

import trl
from trl.data_utils import maybe_extract_prompt

assert trl.__version__ == "1.16.0", trl.__version__

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "data", "implicit_text_trl.json")

HH = [
    ("\n\nHuman: What is 2+2?\n\nAssistant: It is 4.", "\n\nHuman: What is 2+2?\n\nAssistant: It is 5."),
    ("\n\nHuman: Hi\n\nAssistant: Hello! How can I help?", "\n\nHuman: Hi\n\nAssistant: Go away."),
    ("\n\nHuman: Hi\n\nAssistant: I think so", "\n\nHuman: Hi\n\nAssistant: I don't"),
    ("\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d", "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: e"),
]


def main():
    rng = random.Random(7)
    alphabet = ["a", "b", " ", " ", "\n", "é", "😀"]
    pairs = list(HH)
    for _ in range(500):
        common = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        tails = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(2)]
        pairs.append((common + tails[0], common + tails[1]))
    cases = []
    for chosen, rejected in pairs:
        if not chosen or not rejected:
            continue
        row = maybe_extract_prompt({"chosen": chosen, "rejected": rejected})
        cases.append(
            {"chosen": chosen, "rejected": rejected,
             "trl": [row["prompt"], row["chosen"], row["rejected"]]}
        )
    with open(OUT, "w") as f:
        json.dump({"trl": trl.__version__, "cases": cases}, f, ensure_ascii=False, indent=0)
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
