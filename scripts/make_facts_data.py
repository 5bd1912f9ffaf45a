#!/usr/bin/env python3
"""Writes data/facts/train.jsonl and data/facts/valid.jsonl: the experiments' second
preference task, factual correctness, beside the demo's style task.

The demo's pairs differ only in style (capitals against ordinary case). Here both sides share
the style and differ in what they claim: chosen is the correct fact, rejected a plausible wrong
one ("Sure! 7 times 8 is 56." against "Sure! 7 times 8 is 58."), from the same templated facts
as scripts/make_demo_data.py (arithmetic, capitals, opposites, unit conversions, plurals, animal
sounds, days and months). A 135M model knows some of them already, so held-out accuracy starts
above zero and training has to move the rest: a different skill from the demo's, and one where
pushing the rejected answer down can also drag the chosen one (displacement).

Prompts in valid.jsonl never occur in train.jsonl. Standard library only; the output is
identical for a given --seed.

    python3 scripts/make_facts_data.py [--out data/facts] [--seed 77] [--train 360] [--valid 60]
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_demo_data as facts  # noqa: E402  (the shared fact generators)

# Share of each category among the rows (arithmetic has far more distinct facts than the rest).
QUOTA = {"add": 110, "sub": 70, "mul": 70, "capital": 40, "opposite": 40,
         "convert": 40, "plural": 20, "animal": 12, "next": 18}


def row(prompt, right, wrong):
    wrong = wrong[0].upper() + wrong[1:]
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": f"Sure! {right}."}],
        "rejected": [{"role": "assistant", "content": f"Sure! {wrong}."}],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "data", "facts")))
    ap.add_argument("--seed", type=int, default=77)
    ap.add_argument("--valid", type=int, default=60)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pool = (facts.arithmetic(rng) + facts.capitals(rng) + facts.opposites(rng)
            + facts.conversions(rng) + facts.words(rng))
    by_cat = {}
    for cat, f in pool:
        if f[1].lower() != f[2].lower():  # a wrong answer equal to the right one is no pair
            by_cat.setdefault(cat, []).append(f)
    rows = []
    for cat in sorted(QUOTA):
        got = by_cat[cat]
        rng.shuffle(got)
        assert len(got) >= QUOTA[cat], f"{cat}: {len(got)} facts, {QUOTA[cat]} wanted"
        rows += [(cat, f) for f in got[:QUOTA[cat]]]
    assert len({f[0] for _, f in rows}) == len(rows), "duplicate prompts"
    rng.shuffle(rows)
    train, valid = facts.stratified_split(rows, QUOTA, args.valid)
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("train.jsonl", train), ("valid.jsonl", valid)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as fh:
            for prompt, right, wrong in part:
                fh.write(json.dumps(row(prompt, right, wrong), ensure_ascii=False) + "\n")
        print(f"wrote {len(part)} rows to {os.path.join(args.out, name)}")
    assert not {f[0] for f in train} & {f[0] for f in valid}


if __name__ == "__main__":
    main()
