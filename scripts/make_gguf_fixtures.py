#!/usr/bin/env python3
"""Generates the GGUF test fixtures used by lorafit's GGUF reader tests.

Why: the Rust dequantizers must match ggml bit-for-bit, and the GGUF-built
tokenizer must match the Hugging Face tokenizer. The references come from
gguf-py (`gguf.quants.dequantize`, which mirrors ggml-quants.c) and from the
Python `tokenizers` package, never from a hub download.

Requires: pip install gguf numpy tokenizers   (transformers optional)

Outputs (under tests/fixtures/gguf/ unless --out is given):
  quant_ref.gguf
      For each supported type T in F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q6_K:
        "q.T"   raw tensor of type T, GGUF dims [512, 2] (2 rows x 512),
                random bytes whose f16 scale fields are replaced by sane
                finite values;
        "ref.T" F32 tensor, same dims, = gguf.quants.dequantize(q.T).
      "unsupported.Q5_0" (a Q5_0 tensor, for the error-path test) and
      metadata of every value type (keys "test.*") for accessor tests.
      Written with general.alignment = 64.
  smollm2_ref.json      (only if the SmolLM2 GGUF is given)
      Bit patterns (u32) of gguf-py-dequantized values for a few slices of
      token_embd.weight (Q8_0), blk.0.attn_q.weight and blk.0.ffn_down.weight
      (Q4_1) and output_norm.weight (F32).
  smollm2_tokenizer_ref.json  (only if the SmolLM2 GGUF is given)
      Reference ids for a list of strings, produced by a Python `tokenizers`
      tokenizer assembled from the GGUF vocab/merges exactly as the HF
      tokenizer.json of SmolLM2 is configured (Digits(individual) +
      ByteLevel pre-tokenizer, which is also llama.cpp's "smollm" regex).

Usage:
  python3 scripts/make_gguf_fixtures.py [--smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf] [--out DIR]
"""

import argparse
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

ROWS, COLS = 2, 512

# (type, byte offsets of f16 scale fields inside one block)
TYPES = [
    (QT.F32, None),
    (QT.F16, None),
    (QT.BF16, None),
    (QT.Q8_0, [0]),
    (QT.Q4_0, [0]),
    (QT.Q4_1, [0, 2]),
    (QT.Q4_K, [0, 2]),
    (QT.Q6_K, [208]),
]


def random_f16(rng, n):
    mag = rng.uniform(1e-3, 2.0, size=n)
    sign = rng.choice([-1.0, 1.0], size=n)
    return (mag * sign).astype(np.float16)


def make_raw(rng, qtype, scale_offsets):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == QT.F32:
        vals = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 3
        vals[0, :4] = [0.0, -0.0, 1e-40, 65504.0]  # zero, -zero, subnormal, big
        return vals.view(np.uint8)
    if qtype == QT.F16:
        vals = rng.standard_normal((ROWS, COLS)).astype(np.float16)
        vals[0, :3] = np.array([0.0, -0.0, 6e-8], dtype=np.float16)  # incl. f16 subnormal
        return vals.view(np.uint8)
    if qtype == QT.BF16:
        bits = rng.integers(0, 1 << 16, size=(ROWS, COLS), dtype=np.uint16)
        # keep it finite: exponent field != 0xff
        exp = (bits >> 7) & 0xFF
        bits = np.where(exp == 0xFF, bits & np.uint16(0xBFFF), bits).astype(np.uint16)
        return bits.view(np.uint8)
    n_blocks_row = COLS // block_size
    raw = rng.integers(0, 256, size=(ROWS, n_blocks_row, type_size), dtype=np.uint8)
    for off in scale_offsets:
        sc = random_f16(rng, ROWS * n_blocks_row).reshape(ROWS, n_blocks_row)
        raw[:, :, off:off + 2] = sc.view(np.uint8).reshape(ROWS, n_blocks_row, 2)
    return raw.reshape(ROWS, n_blocks_row * type_size)


def make_quant_fixture(out_dir):
    rng = np.random.default_rng(20240611)
    path = os.path.join(out_dir, "quant_ref.gguf")
    w = gguf.GGUFWriter(path, arch="lorafit-test")
    w.add_custom_alignment(64)
    # metadata of every value type
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 1 << 40)
    w.add_int64("test.i64", -(1 << 40))
    w.add_float32("test.f32", 1.5)
    w.add_float64("test.f64", 2.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.str_array", ["a", "bc", "<|im_start|>"])
    w.add_key_value("test.i32_array", [1, -2, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    w.add_key_value("test.f32_array", [0.5, -1.25], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    for qtype, offs in TYPES:
        raw = make_raw(rng, qtype, offs)
        ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        assert ref.shape == (ROWS, COLS), (qtype, ref.shape)
        assert np.isfinite(ref).all(), qtype
        w.add_tensor(f"q.{qtype.name}", raw, raw_dtype=qtype)
        w.add_tensor(f"ref.{qtype.name}", ref)
    # a Q5_0 tensor for the "unsupported type" error path (1 row of 32)
    bs, ts = gguf.GGML_QUANT_SIZES[QT.Q5_0]
    w.add_tensor("unsupported.Q5_0", np.zeros((1, ts), dtype=np.uint8), raw_dtype=QT.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def make_smollm2_refs(model_path, out_dir):
    r = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in r.tensors}
    refs = []
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output_norm.weight"]:
        t = tensors[name]
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(-1)
        n = deq.size
        for start in sorted({0, n // 2 + 7 * 32 if n > 1024 else 0, n - 256}):
            vals = deq[start:start + 256]
            refs.append({
                "tensor": name,
                "type": t.tensor_type.name,
                "shape": [int(x) for x in t.shape],
                "start": int(start),
                "bits": [int(b) for b in vals.view(np.uint32)],
            })
    path = os.path.join(out_dir, "smollm2_ref.json")
    with open(path, "w") as f:
        json.dump({"model": os.path.basename(model_path), "slices": refs}, f)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — “quotes” and ‘apostrophes’",
    "日本語のテキストと中文混合",
    "emoji 🦀🚀 and 👩‍👩‍👧 family",
    "line one\nline two\n\n\nline five\r\nwindows",
    "multiple    spaces   here  and\ttabs\t\tend   ",
    "   leading spaces",
    "numbers 12345 and 3.14159 and 1,000,000",
    "a  1 x   42",
    "don't can't I'm we'll they've she'd it's",
    "def foo(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos<|endoftext|>",
    "",
]


def build_reference_tokenizer(model_path):
    """HF tokenizer mirroring SmolLM2's tokenizer.json, from GGUF metadata."""
    from tokenizers import Tokenizer, AddedToken, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    r = gguf.GGUFReader(model_path)
    f = r.fields
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "smollm"
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i in range(len(tokens)) if types[i] == 3]
    tok.add_special_tokens(specials)
    for i in range(len(tokens)):
        if types[i] == 3:
            assert tok.token_to_id(tokens[i]) == i
    return tok


def transformers_ids(model_path, strings):
    """Optional cross-check through transformers' GGUF tokenizer converter
    (which uses a plain ByteLevel pre-tokenizer without the Digits split)."""
    try:
        from transformers import AutoTokenizer
    except Exception:
        return None
    t = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    return [t.encode(s, add_special_tokens=False) for s in strings]


def make_tokenizer_refs(model_path, out_dir):
    tok = build_reference_tokenizer(model_path)
    cases = []
    tf = transformers_ids(model_path, TOKENIZER_STRINGS)
    for i, s in enumerate(TOKENIZER_STRINGS):
        enc = tok.encode(s, add_special_tokens=False)
        case = {"text": s, "ids": enc.ids, "decoded": tok.decode(enc.ids, skip_special_tokens=False)}
        if tf is not None and tf[i] != enc.ids:
            case["transformers_gguf_ids"] = tf[i]
            print(f"note: transformers' GGUF tokenizer differs on {s!r}: {tf[i]} vs {enc.ids}")
        cases.append(case)
    path = os.path.join(out_dir, "smollm2_tokenizer_ref.json")
    with open(path, "w") as f:
        json.dump({"model": os.path.basename(model_path), "cases": cases}, f, ensure_ascii=False, indent=1)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf"))
    ap.add_argument("--smollm2", default=os.environ.get("LORAFIT_SMOLLM2_GGUF"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    make_quant_fixture(a.out)
    if a.smollm2:
        make_smollm2_refs(a.smollm2, a.out)
        make_tokenizer_refs(a.smollm2, a.out)
    else:
        print("no SmolLM2 GGUF given (--smollm2 or LORAFIT_SMOLLM2_GGUF): skipped its references")


if __name__ == "__main__":
    main()
