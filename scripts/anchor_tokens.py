"""The word-level tokenizer the TRL-based anchors hand random token ids through, and the check
that it hands them through unchanged.

TRL's ORPOTrainer takes text, so the anchors write each random id `i` as the word `t{i}` and give
TRL a tokenizer that maps the word back to `i`. Its special tokens must not be words that occur
inside other words: Hugging Face's fast tokenizers match special tokens anywhere in the text
before the pre-tokenizer runs, so with `t1` as BOS (the first form of this tokenizer) every word
that begins `t1` or `t2` (`t1234`) split into the special token and an unknown word. On Llama's
vocabulary that made 39% of the words two tokens: a prompt of 14336 ids became 19979 tokens, filled
TRL's `max_length` (P + R + 4) on its own, and TRL then cut the responses to nothing; the timed
steps ran 1.22x the intended tokens with no response token labelled (1.30x on Qwen's vocabulary).
Here the special tokens are `<pad>`, `<bos>` and `<eos>` (ids 0, 1, 2), which no `t{i}` contains,
and the random ids start at 3.

    python3 scripts/anchor_tokens.py 151936     # the round trip on random rows; exit 1 if broken
    python3 scripts/anchor_tokens.py --fix .gpu/anchors   # the copied shared anchors use it

`--fix DIR` rewrites the copies of `../shared/anchors`' TRL and Unsloth scripts in DIR (git-ignored)
to build their tokenizer here, and copies this file beside them; the shared originals still build
the first form, so a copy that is not fixed measures TRL and Unsloth on the wrong rows.
"""
import sys


def anchor_tokenizer(vocab_size):
    """A fast tokenizer that maps the word `t{i}` to id `i` for 3 <= i < vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                     eos_token="<eos>", unk_token="<pad>")
    # Words that begin like other words and like the old special tokens, and the last id.
    probe = [i for i in (3, 10, 19, 100, 123, 2000, 29999, vocab_size - 1) if i < vocab_size]
    trl_rows(hf_tok, [(probe, probe, probe)])
    return hf_tok


def as_text(ids):
    """The words of `ids`, as the anchors write a prompt (a response gets a leading space)."""
    return " ".join(f"t{int(i)}" for i in ids)


def trl_rows(tok, pairs):
    """TRL's preference rows (`prompt`, `chosen`, `rejected` text) of `(prompt, chosen, rejected)`
    id lists; exits unless every text tokenizes back to its ids under `tok`."""
    rows = []
    for n, pair in enumerate(pairs):
        row = dict(prompt=as_text(pair[0]), chosen=" " + as_text(pair[1]), rejected=" " + as_text(pair[2]))
        for what, ids in zip(("prompt", "chosen", "rejected"), pair):
            want = [int(i) for i in ids]
            got = tok(row[what], add_special_tokens=False)["input_ids"]
            if got != want:
                raise SystemExit(f"anchor tokenizer: pair {n} {what}: {len(want)} ids came back as "
                                 f"{len(got)} tokens (first difference at {first_difference(got, want)})")
        rows.append(row)
    return rows


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# The first form's three lines, as the shared anchor scripts wrote them (any indentation).
OLD_FORM = (r'(?P<i>[ \t]*)tok = Tokenizer\(models\.WordLevel\(\{f"t\{i\}": i for i in range\(V\)\}, unk_token="t0"\)\)\n'
            r'[ \t]*tok\.pre_tokenizer = pre_tokenizers\.WhitespaceSplit\(\)\n'
            r'[ \t]*hf_tok = PreTrainedTokenizerFast\([^)]*bos_token="t1"[^)]*\)\n')


def fix_copies(folder):
    """Rewrites the anchor scripts in `folder` to build `anchor_tokenizer(V)`; exit 1 where a
    script builds a tokenizer in neither form."""
    import os, re, shutil
    shutil.copy(__file__, os.path.join(folder, "anchor_tokens.py"))
    for name in ("torch_orpo_bench.py", "unsloth_orpo_bench.py"):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        if "anchor_tokenizer(V)" in text:
            print(f"{path}: already fixed")
            continue
        fixed, n = re.subn(OLD_FORM, lambda m: f"{m['i']}from anchor_tokens import anchor_tokenizer\n"
                                               f"{m['i']}hf_tok = anchor_tokenizer(V)\n", text)
        if n != 1:
            raise SystemExit(f"{path}: its tokenizer is in neither the first nor the fixed form; "
                             "fix it by hand (scripts/anchor_tokens.py says how)")
        os.chmod(path, 0o644)
        open(path, "w").write(fixed)
        print(f"{path}: tokenizer fixed")


if __name__ == "__main__" and sys.argv[1:2] == ["--fix"]:
    fix_copies(sys.argv[2])
elif __name__ == "__main__":
    import random
    V = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    rng = random.Random(0)
    pairs = [tuple([rng.randrange(3, V) for _ in range(n)] for n in (600, 300, 300)) for _ in range(4)]
    trl_rows(anchor_tokenizer(V), pairs)
    print(f"anchor tokenizer: {len(pairs)} random pairs over a vocabulary of {V} come back id for id")
