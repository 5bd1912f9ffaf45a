#!/usr/bin/env python3
"""GGUF fixtures of the Gemma 2, Gemma 3, Gemma 4 and MiniCPM test models, and a small
SentencePiece vocabulary with reference token ids.

    pip install gguf numpy safetensors sentencepiece
    python3 scripts/make_gguf_family_fixtures.py            # writes tests/fixtures/gguf/

Models: each Hugging Face folder
tests/fixtures/models/{gemma2,gemma3,gemma4,gemma4_keqv,minicpm,minicpm_untied} (config.json +
model.safetensors, made by scripts/make_model_fixtures.py) becomes
tests/fixtures/gguf/<name>.gguf, written the way llama.cpp's convert_hf_to_gguf.py writes that
architecture (Gemma2Model, Gemma3Model, Gemma4Model, MiniCPMModel):

* metadata keys and values as the converter derives them (`gemma2`: no rope.freq_base, the
  softcaps and sliding_window; `gemma3`: the full-attention rope theta and linear scaling,
  rope.freq_base_swa, no attention softcap; `minicpm`: embedding_scale = scale_emb,
  residual_scale = scale_depth/sqrt(L), logit_scale = hidden/dim_model_base,
  rope.scaling.type longrope);
* tensor names from gguf-py's name map for the architecture;
* Gemma: every `*norm.weight` stored as 1 + w, no lm_head (tied); Gemma 3's token_embd trimmed
  to the tokenizer's size (250 of 256 rows here);
* MiniCPM: q/k rows permuted as LlamaModel.permute does, LongRoPE factors as the tensors
  rope_factors_long/short;
* Gemma 4: `gemma4` keys as Gemma4Model.set_gguf_parameters leaves them (key_length = the full
  layers' head_dim, key_length_swa the sliding ones', sliding_window_pattern one flag per
  layer, shared_kv_layers, embedding_length_per_layer_input, feed_forward_length per layer
  with use_double_wide_mlp, head_count_kv per layer with num_global_key_value_heads,
  rope.dimension_count[_swa], both rope thetas); norms as stored (no 1 + w); layer_scalar as
  blk.N.layer_output_scale.weight; the full layers' proportional RoPE as the tensor rope_freqs
  (1 for the rotated pairs, 1e30 for the others). The folders' config.json (as save_pretrained
  writes it) has per_layer_config where Google's has global_head_dim and
  num_global_key_value_heads: those are read from it;
* F32 files, except minicpm_untied and gemma4_keqv: F16 for matrices, F32 for vectors
  (--outtype f16).

Where the converter would lose something these small models need, the file carries one more
key, named here so nobody mistakes it for converter output:
* gemma2/gemma3 `attention.scale` = query_pre_attn_scalar^-1/2: llama.cpp infers head_dim^-1/2
  (these fixtures use 24 and 32 with head_dim 16);
* gemma3 `attention.sliding_window_pattern` (one flag per layer): llama.cpp's default period 6
  would make all three layers of this fixture sliding;
* minicpm (LongRoPE) `rope.scaling.original_context_length` and `rope.scaling.attn_factor`, as
  the converter writes them for Phi-3's LongRoPE: MiniCPMModel writes neither.

Each model file carries a synthetic 256-entry (Gemma 3: 250) SentencePiece-style vocabulary:
the converter requires one, and the models' ids index it. (For Gemma 4 the converter writes its
tokenizer.json as tokenizer.ggml.model "gemma4"; these files carry the same SentencePiece-style
vocab as the Gemma 2/3 ones.)

Tokenizer: two SentencePiece BPE models trained here on a fixed corpus (byte fallback,
identity normalization, whitespace kept), one with the dummy-prefix space (Llama/MiniCPM
style) and one without (Gemma style), are written as vocab-only GGUFs spm_prefix.gguf and
spm_noprefix.gguf the way _set_vocab_sentencepiece writes a vocab (tokens, scores, token types,
special ids, add_space_prefix false for Gemma). spm_ref.json holds sentencepiece's own ids for a
list of texts, cross-checked against a Python port of llama.cpp's SPM tokenizer (a score-driven
merge of adjacent symbols with byte fallback).

The output is deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests/fixtures/models"
SP = "\u2581"

T_NORMAL, T_UNKNOWN, T_CONTROL, T_USER, T_UNUSED, T_BYTE = 1, 2, 3, 4, 5, 6


# ---------------------------------------------------------------------------------------------
# Synthetic model vocabularies


def model_vocab(n: int, gemma: bool):
    """(tokens, scores, types, special ids) of an n-entry SentencePiece-style vocabulary."""
    if gemma:
        specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
        ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    else:
        specials = ["<unk>", "<s>", "</s>"]
        ids = {"unk": 0, "bos": 1, "eos": 2}
    tokens = list(specials)
    types = [T_UNKNOWN if t == "<unk>" else T_CONTROL for t in specials]
    for b in range(128):
        tokens.append(f"<0x{b:02X}>")
        types.append(T_BYTE)
    pieces = [SP] + [chr(c) for c in range(0x21, 0x7F)]
    words = ["the", "and", "of", "to", "in", "is", "it", "at", "on", "he", "an", "er", "re",
             "ing", "ed", "es", "st", "ou", "ar", "al", "or", "le", "se"]
    pieces += [SP + w for w in words] + words
    for p in pieces:
        if len(tokens) == n:
            break
        tokens.append(p)
        types.append(T_NORMAL)
    assert len(tokens) == n, len(tokens)
    scores = [0.0 if t != T_NORMAL else -float(i) for i, t in enumerate(types)]
    return tokens, scores, types, ids


def add_vocab(w: gguf.GGUFWriter, tokens, scores, types, ids, add_space_prefix: bool | None):
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if "bos" in ids:
        w.add_bos_token_id(ids["bos"])
    if "eos" in ids:
        w.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)


# ---------------------------------------------------------------------------------------------
# Models


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for ggml's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tensors(w: gguf.GGUFWriter, arch, n_layers: int, tensors: dict, f16: bool):
    names = gguf.get_tensor_name_map(arch, n_layers)
    for hf in sorted(tensors):
        data = tensors[hf]
        # Model-level tensors the converter names itself (MiniCPM's LongRoPE factors, Gemma 4's
        # rope_freqs).
        if hf.startswith(("rope_factors", "rope_freqs")):
            name = hf
        else:
            name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SystemExit(f"no GGUF name for {hf}")
        data = np.ascontiguousarray(data.astype(np.float16 if f16 and data.ndim >= 2 else np.float32))
        w.add_tensor(name, data)


def finish(w: gguf.GGUFWriter):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def common(w: gguf.GGUFWriter, c: dict, name: str, f16: bool):
    w.add_name(f"lorafit fixture {name}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads", c["num_attention_heads"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def gemma(name: str, out: Path, gen: int):
    d = MODELS / name
    c = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    arch = gguf.MODEL_ARCH.GEMMA2 if gen == 2 else gguf.MODEL_ARCH.GEMMA3
    w = gguf.GGUFWriter(str(out / f"{name}.gguf"), gguf.MODEL_ARCH_NAMES[arch])
    common(w, c, name, False)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    n_layers = c["num_hidden_layers"]
    if gen == 2:
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
        inferred = c["head_dim"] if n_layers != 46 else c["hidden_size"] // c["num_attention_heads"]
    else:
        rp = c["rope_parameters"]
        full, local = rp["full_attention"], rp["sliding_attention"]
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        assert c.get("attn_logit_softcapping") is None
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
        # Addition: llama.cpp's default is a period of 6.
        w.add_sliding_window_pattern([lt == "sliding_attention" for lt in c["layer_types"]])
        inferred = c["head_dim"] if n_layers != 62 else c["hidden_size"] // c["num_attention_heads"]
    if c["query_pre_attn_scalar"] != inferred:
        # Addition: the score scale llama.cpp would not infer.
        w.add_attention_scale(1.0 / math.sqrt(c["query_pre_attn_scalar"]))
    n_vocab = c["vocab_size"] if gen == 2 else c["vocab_size"] - 6
    tokens, scores, types, ids = model_vocab(n_vocab, gemma=True)
    add_vocab(w, tokens, scores, types, ids, add_space_prefix=False)
    tensors = {}
    for k, v in t.items():
        if k == "lm_head.weight":
            continue
        if k.endswith("norm.weight"):
            v = v + 1
        if k == "model.embed_tokens.weight":
            v = v[:n_vocab]
        tensors[k] = v
    write_tensors(w, arch, n_layers, tensors, False)
    finish(w)


def minicpm(name: str, out: Path, f16: bool):
    d = MODELS / name
    c = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    arch = gguf.MODEL_ARCH.MINICPM
    w = gguf.GGUFWriter(str(out / f"{name}.gguf"), gguf.MODEL_ARCH_NAMES[arch])
    common(w, c, name, f16)
    w.add_rope_freq_base(c["rope_theta"])
    n_layers = c["num_hidden_layers"]
    w.add_embedding_scale(float(c["scale_emb"]))
    w.add_residual_scale(c["scale_depth"] / n_layers**0.5)
    w.add_logit_scale(c["hidden_size"] / c["dim_model_base"])
    rs = c.get("rope_scaling") or {}
    tensors = {}
    if rs.get("rope_type", rs.get("type")) == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        # Addition (as for Phi-3): the original context and the cos/sin factor.
        orig = rs["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        half = c["hidden_size"] // c["num_attention_heads"] // 2
        assert len(rs["long_factor"]) == len(rs["short_factor"]) == half
        tensors["rope_factors_long.weight"] = np.array(rs["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rs["short_factor"], dtype=np.float32)
    tokens, scores, types, ids = model_vocab(c["vocab_size"], gemma=False)
    add_vocab(w, tokens, scores, types, ids, add_space_prefix=None)
    n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    for k, v in t.items():
        if k.endswith("q_proj.weight"):
            v = permute(v, n_head)
        elif k.endswith("k_proj.weight"):
            v = permute(v, n_kv)
        tensors[k] = v
    write_tensors(w, arch, n_layers, tensors, f16)
    finish(w)


def gemma4(name: str, out: Path, f16: bool):
    """Gemma4Model (on top of Gemma3Model and TextModel): the keys as set_gguf_parameters leaves
    them (a key written twice keeps its last value), the tensors as modify_tensors and
    generate_extra_tensors yield them."""
    d = MODELS / name
    c = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    arch = gguf.MODEL_ARCH.GEMMA4
    w = gguf.GGUFWriter(str(out / f"{name}.gguf"), gguf.MODEL_ARCH_NAMES[arch])
    n_layers = c["num_hidden_layers"]
    types = c["layer_types"]
    swa = [lt == "sliding_attention" for lt in types]
    # save_pretrained writes the full layers' geometry as per_layer_config; Google's
    # config.json (what the converter reads) has global_head_dim and, with attention_k_eq_v,
    # num_global_key_value_heads.
    plc = c.get("per_layer_config") or {}
    full = [str(l) for l in range(n_layers) if not swa[l]]
    head_dim_full = c.get("global_head_dim") or plc[full[0]]["head_dim"]
    n_kv_full = c.get("num_global_key_value_heads") or plc[full[0]].get("num_key_value_heads")
    head_dim_swa = c["head_dim"]
    common(w, c, name, f16)
    rp = c["rope_parameters"]
    # TextModel: rope_parameters["full_attention"] has rope_type "proportional", which it does
    # not know (no scaling keys); both thetas.
    w.add_rope_freq_base(rp["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
    # Gemma3Model.
    assert c.get("attn_logit_softcapping") is None
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    # Gemma4Model.
    shared = c["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(head_dim_full)
    w.add_value_length(head_dim_full)
    w.add_key_length_swa(head_dim_swa)
    w.add_value_length_swa(head_dim_swa)
    first_shared = n_layers - shared
    if c.get("use_double_wide_mlp"):
        n_ff = c["intermediate_size"]
        w.add_feed_forward_length([n_ff if l < first_shared else 2 * n_ff for l in range(n_layers)])
    if n_kv_full is not None:
        n_kv_swa = c["num_key_value_heads"]
        w.add_head_count_kv([n_kv_swa if s else n_kv_full for s in swa])
    w.add_rope_dimension_count(head_dim_full)
    w.add_rope_dimension_count_swa(int(head_dim_swa * c.get("partial_rotary_factor", 1.0)))
    tokens, scores, types_, ids = model_vocab(c["vocab_size"], gemma=True)
    add_vocab(w, tokens, scores, types_, ids, add_space_prefix=False)
    tensors = {}
    for k, v in t.items():
        if k == "lm_head.weight":
            continue
        # filter_tensors: the scalar buffer becomes a weight; norm_shift 0 (plain w norms).
        if k.endswith("layer_scalar"):
            k += ".weight"
        tensors[k] = v
    # generate_extra_tensors: proportional RoPE as frequency divisors of the full layers.
    full_rp = rp["full_attention"]
    assert full_rp["rope_type"] == "proportional"
    n_rot = int(head_dim_full * full_rp["partial_rotary_factor"] / 2)
    tensors["rope_freqs.weight"] = np.array(
        [1.0] * n_rot + [1e30] * (head_dim_full // 2 - n_rot), dtype=np.float32
    )
    write_tensors(w, arch, n_layers, tensors, f16)
    finish(w)


# ---------------------------------------------------------------------------------------------
# SentencePiece vocabulary and reference ids

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. In the morning the birds sing; in the evening the wind blows over the hills.
A tokenizer splits text into pieces: words, parts of words, and single characters.
Training a language model needs a lot of text, a good tokenizer and patience.
She said: "It is not what you say, it is how you say it." He answered that he agreed.
Numbers like 12, 345 and 6789 appear in tables, dates such as 2024-05-17 and prices ($3.50).
Preference training compares a chosen answer with a rejected one for the same prompt.
The chosen answer is helpful and honest; the rejected answer is vague or wrong.
Whitespace matters:  two spaces,   three spaces, a tab\tand a newline
are all kept by the tokenizer. Caf\u00e9, na\u00efve and r\u00e9sum\u00e9 have accents.
Low-rank adapters train small matrices beside the frozen weights of a large model.
The learning rate, the batch size and the number of steps decide how long training takes.
""" * 3

CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "two  spaces and   three",
    "tabs\tand\nnewlines\n\nhere",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001f642 and \u00fc\u00df",
    "Numbers 12345 and 3.14159, prices $7.99",
    "preference training with adapters",
    "unbelievably tokenizable antidisestablishmentarianism",
    "a",
    "",
]


def spm_llama_cpp(text: str, pieces: dict[str, int], scores: list[float], add_prefix: bool) -> list[int]:
    """A port of llama.cpp's SPM tokenizer (llm_tokenizer_spm_session) for one text fragment."""
    if not text:
        return []
    if add_prefix:
        text = " " + text
    text = text.replace(" ", SP)
    syms = [{"text": ch, "prev": i - 1, "next": i + 1} for i, ch in enumerate(text)]
    syms[-1]["next"] = -1
    heap: list = []

    def add(left: int, right: int):
        if left == -1 or right == -1:
            return
        s = syms[left]["text"] + syms[right]["text"]
        tid = pieces.get(s)
        if tid is None:
            return
        # Highest score first, then leftmost.
        heapq.heappush(heap, (-scores[tid], left, right, len(s)))

    for i in range(1, len(syms)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        l, r = syms[left], syms[right]
        if not l["text"] or not r["text"] or len(l["text"]) + len(r["text"]) != size:
            continue
        l["text"] += r["text"]
        r["text"] = ""
        l["next"] = r["next"]
        if r["next"] != -1:
            syms[r["next"]]["prev"] = left
        add(l["prev"], left)
        add(left, l["next"])
    out = []
    i = 0
    while i != -1:
        s = syms[i]["text"]
        if s in pieces:
            out.append(pieces[s])
        else:
            # Every merged symbol is a piece, so only single characters land here.
            for b in s.encode("utf-8"):
                out.append(pieces[f"<0x{b:02X}>"])
        i = syms[i]["next"]
    return out


def spm_fixtures(out: Path):
    import sentencepiece as spm

    refs = {"note": "ids from sentencepiece " + spm.__version__ + " (add_bos off), equal to a port of "
            "llama.cpp's SPM tokenizer; made by scripts/make_gguf_family_fixtures.py", "vocabs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(CORPUS)
        for tag, prefix in [("spm_prefix", True), ("spm_noprefix", False)]:
            prefix_path = Path(tmp) / tag
            spm.SentencePieceTrainer.train(
                input=str(corpus), model_prefix=str(prefix_path), model_type="bpe", vocab_size=400,
                byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                remove_extra_whitespaces=False, add_dummy_prefix=prefix, split_digits=False,
                control_symbols=["<ctrl>"], num_threads=1, seed_sentencepiece_size=10000,
                minloglevel=2,
            )
            sp = spm.SentencePieceProcessor(model_file=str(prefix_path) + ".model")
            n = sp.get_piece_size()
            tokens, scores, types = [], [], []
            for i in range(n):
                tokens.append(sp.id_to_piece(i))
                scores.append(float(sp.get_score(i)))
                if sp.is_unknown(i):
                    types.append(T_UNKNOWN)
                elif sp.is_control(i):
                    types.append(T_CONTROL)
                elif sp.is_unused(i):
                    types.append(T_UNUSED)
                elif sp.is_byte(i):
                    types.append(T_BYTE)
                else:
                    types.append(T_NORMAL)
            ids = {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
            w = gguf.GGUFWriter(str(out / f"{tag}.gguf"), "llama")
            w.add_name(f"lorafit tokenizer fixture {tag}")
            add_vocab(w, tokens, scores, types, ids, add_space_prefix=prefix)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.close()
            pieces = {}
            for i, t in enumerate(tokens):
                pieces.setdefault(t, i)
            cases = []
            for text in CASES:
                want = sp.encode(text)
                mine = spm_llama_cpp(text, pieces, scores, prefix)
                if mine != want:
                    raise SystemExit(f"{tag}: llama.cpp port and sentencepiece differ on {text!r}: {mine} vs {want}")
                cases.append({"text": text, "ids": want})
            refs["vocabs"][tag] = {
                "add_space_prefix": prefix,
                "n_tokens": n,
                "ctrl_id": sp.piece_to_id("<ctrl>"),
                "bos_id": ids["bos"],
                "cases": cases,
            }
    (out / "spm_ref.json").write_text(json.dumps(refs, indent=1, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/gguf"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gemma("gemma2", out, 2)
    gemma("gemma3", out, 3)
    minicpm("minicpm", out, f16=False)
    minicpm("minicpm_untied", out, f16=True)
    gemma4("gemma4", out, f16=False)
    gemma4("gemma4_keqv", out, f16=True)
    spm_fixtures(out)
    for f in sorted(out.glob("*")):
        if f.name.startswith(("gemma", "minicpm", "spm")):
            shown = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
            print(f"{shown}  {os.path.getsize(f)} bytes")


if __name__ == "__main__":
    main()
