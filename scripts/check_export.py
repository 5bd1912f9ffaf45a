#!/usr/bin/env python3
"""Checks `lorafit export` with the tools its artefacts are for: transformers loads the merged
folder and reproduces lorafit's logits; the `gguf` package parses the GGUF adapter and its
tensors equal the PEFT adapter's (re-permuted where llama.cpp permutes, rsLoRA's scale folded
into B); the merged GGUF of a quantized base equals gguf-py's own quantization of
dequant(base) + delta, block for block.

    python3 -m venv /tmp/venv-export
    /tmp/venv-export/bin/pip install torch transformers peft gguf safetensors
    cargo build --release
    /tmp/venv-export/bin/python scripts/check_export.py --lorafit target/release/lorafit

Everything runs on the CPU in a temporary folder; the exit status is 1 when a bound is missed.

Bounds:
* transformers on the bf16 merged folder against lorafit's trainer (base + adapter in f32):
  the bound `lorafit export --check` states for that folder in check.json,
  max(4·√n·2⁻⁹, 1e-5)·max|logit| for n tensors each rounded once to bf16 (unit roundoff 2⁻⁹,
  src/export/check.rs); on the f32 folder 1e-4·max|logit|, the
  tolerance of lorafit's PyTorch parity tests (tests/model_parity.rs), since there the two
  implementations are compared and no weight is rounded;
* the adapter's tensors: exactly equal (f32 storage, the same arithmetic for the folded scale);
* the merged GGUF: the blocks lorafit wrote against gguf-py's quantization of the same f32
  values; block bytes may differ where the f32 merged value differs in its last bit (lorafit's
  GEMM and numpy sum the rank-r product in different orders), so the check requires 99% of the
  blocks identical and the dequantized values within one quantization step of the block.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

import gguf
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "models"
# Fixture families transformers implements itself (MiniCPM 1-4 needs remote code).
HF_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
PERMUTED = {"llama", "mistral"}
LEAF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}

failures: list[str] = []
rows: list[tuple] = []


def record(what: str, value: float, bound: float, note: str = "") -> None:
    ok = bool(value <= bound)
    rows.append((what, value, bound, "ok" if ok else "FAILED", note))
    if not ok:
        failures.append(what)


def export(lorafit: str, *args: str) -> None:
    cmd = [lorafit, "export", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference(out: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    ref = load_file(str(out / "check.safetensors"))
    n = len([k for k in ref if k.endswith(".ids")])
    return [(ref[f"prompt.{i}.ids"].astype(np.int64), ref[f"prompt.{i}.logits"]) for i in range(n)]


def stated_bound(out: Path, artefact: str) -> float:
    """The bound `lorafit export --check` wrote for one artefact."""
    for r in json.loads((out / "check.json").read_text()):
        if Path(r["artefact"]).name == artefact:
            return float(r["bound"])
    sys.exit(f"{out}/check.json has no row for {artefact}")


def check_merged_folder(name: str, out: Path, bound_rel: float | None, label: str) -> None:
    """transformers' logits of out/merged-hf against lorafit's trainer; `None`: the stated bound."""
    from transformers import AutoModelForCausalLM
    if bound_rel is None:
        bound_rel = stated_bound(out, "merged-hf")
    model = AutoModelForCausalLM.from_pretrained(out / "merged-hf", dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    worst, ref_max = 0.0, 0.0
    for ids, want in reference(out):
        with torch.no_grad():
            got = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        ref_max = max(ref_max, float(np.abs(want).max()))
    record(f"{name}: transformers on merged-hf ({label}) vs lorafit, rel", worst / ref_max, bound_rel,
           f"max|Δ| {worst:.3e}")


def lora_scales(cfg: dict, keys: list[str]) -> dict[str, float]:
    """PEFT's scale per module: alpha / r, or alpha / sqrt(r) with rsLoRA, with the patterns."""
    def lookup(pattern: dict, module: str):
        for k, v in pattern.items():
            if module == k or module.endswith("." + k):
                return v
        return None
    out = {}
    for key in keys:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        r = lookup(cfg.get("rank_pattern") or {}, module) or cfg["r"]
        alpha = lookup(cfg.get("alpha_pattern") or {}, module) or cfg["lora_alpha"]
        out[module] = alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
    return out


def check_gguf_adapter(name: str, adapter_dir: Path, gguf_path: Path, n_heads: int, n_kv: int,
                       permutes: bool, arch: str) -> None:
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    peft = load_file(str(adapter_dir / "adapter_model.safetensors"))
    reader = GGUFReader(str(gguf_path))
    field = lambda k: reader.fields[k]
    text = lambda k: bytes(field(k).parts[field(k).data[0]]).decode()
    assert text("general.type") == "adapter", name
    assert text("general.architecture") == arch, (name, text("general.architecture"))
    assert text("adapter.type") == "lora", name
    alpha = float(field("adapter.lora.alpha").parts[-1][0])
    assert field("adapter.lora.alpha").types[0] == gguf.GGUFValueType.FLOAT32
    assert alpha == float(cfg["lora_alpha"]), (alpha, cfg["lora_alpha"])
    tensors = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    a_keys = [k for k in peft if k.endswith("lora_A.weight")]
    scales = lora_scales(cfg, a_keys)
    worst = 0.0
    for ka in a_keys:
        module = ka.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        layer = int(module.split(".")[2])
        proj = module.split(".")[-1]
        a = peft[ka].astype(np.float32)
        b = peft[ka.replace("lora_A", "lora_B")].astype(np.float32)
        r = a.shape[0]
        b = (b * np.float32(scales[module] / (alpha / r))).astype(np.float32)
        if permutes and proj in ("q_proj", "k_proj"):
            b = permute(b, n_heads if proj == "q_proj" else n_kv)
        base = f"blk.{layer}.{LEAF[proj]}.weight"
        ga, gb = tensors[f"{base}.lora_a"], tensors[f"{base}.lora_b"]
        assert ga.shape == a.shape and gb.shape == b.shape, (base, ga.shape, gb.shape)
        worst = max(worst, float(np.abs(ga - a).max()), float(np.abs(gb - b).max()))
    assert len(tensors) == 2 * len(a_keys), (len(tensors), len(a_keys))
    record(f"{name}: gguf adapter tensors vs PEFT (max |Δ|)", worst, 0.0,
           f"{len(a_keys)} pairs, alpha {alpha:g}{', q/k permuted' if permutes else ''}")


def build_quantized_gguf(path: Path, qtype: GGMLQuantizationType) -> None:
    """The Llama fixture as llama.cpp's converter would write it, projections in `qtype`."""
    cfg = json.loads((FIXTURES / "llama" / "config.json").read_text())
    st = load_file(str(FIXTURES / "llama" / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(64)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])

    def add(name: str, data: np.ndarray, q) -> None:
        data = data.astype(np.float32)
        if q == GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, q), raw_shape=quantize(data, q).shape, raw_dtype=q)

    add("token_embd.weight", st["model.embed_tokens.weight"], GGMLQuantizationType.Q8_0)
    add("output_norm.weight", st["model.norm.weight"], GGMLQuantizationType.F32)
    add("output.weight", st["lm_head.weight"], GGMLQuantizationType.Q8_0)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        add(f"blk.{l}.attn_norm.weight", st[p + "input_layernorm.weight"], GGMLQuantizationType.F32)
        add(f"blk.{l}.ffn_norm.weight", st[p + "post_attention_layernorm.weight"], GGMLQuantizationType.F32)
        add(f"blk.{l}.attn_q.weight", permute(st[p + "self_attn.q_proj.weight"], nh), qtype)
        add(f"blk.{l}.attn_k.weight", permute(st[p + "self_attn.k_proj.weight"], nkv), qtype)
        add(f"blk.{l}.attn_v.weight", st[p + "self_attn.v_proj.weight"], qtype)
        add(f"blk.{l}.attn_output.weight", st[p + "self_attn.o_proj.weight"], qtype)
        add(f"blk.{l}.ffn_gate.weight", st[p + "mlp.gate_proj.weight"], qtype)
        add(f"blk.{l}.ffn_up.weight", st[p + "mlp.up_proj.weight"], qtype)
        add(f"blk.{l}.ffn_down.weight", st[p + "mlp.down_proj.weight"], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_merged_gguf(tmp: Path, lorafit: str, qtype: GGMLQuantizationType) -> None:
    name = f"llama {qtype.name} GGUF base"
    base = tmp / f"llama-{qtype.name}.gguf"
    build_quantized_gguf(base, qtype)
    adapter = FIXTURES / "llama" / "adapter"
    out = tmp / f"gguf-{qtype.name}"
    export(lorafit, "--model", str(base), "--adapter", str(adapter), "--output", str(out), "--check")
    check_merged_folder(name, out, None, "from GGUF, bf16")
    cfg = json.loads((FIXTURES / "llama" / "config.json").read_text())
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    peft = load_file(str(adapter / "adapter_model.safetensors"))
    src = {t.name: t for t in GGUFReader(str(base)).tensors}
    merged = {t.name: t for t in GGUFReader(str(out / "merged.gguf")).tensors}
    scale = acfg["lora_alpha"] / acfg["r"]
    same_blocks, blocks, worst_steps = 0, 0, 0.0
    block = gguf.GGML_QUANT_SIZES[qtype][0]  # values per block ([1] is bytes per block)
    for key in [k for k in peft if k.endswith("lora_A.weight")]:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        layer, proj = int(module.split(".")[2]), module.split(".")[-1]
        delta = scale * (peft[key.replace("lora_A", "lora_B")].astype(np.float32) @ peft[key].astype(np.float32))
        if proj in ("q_proj", "k_proj"):
            delta = permute(delta, cfg["num_attention_heads"] if proj == "q_proj" else cfg["num_key_value_heads"])
        tname = f"blk.{layer}.{LEAF[proj]}.weight"
        t = src[tname]
        values = dequantize(t.data, t.tensor_type).reshape(delta.shape) + delta.astype(np.float32)
        want = quantize(values.astype(np.float32), t.tensor_type)
        got = np.asarray(merged[tname].data)
        assert merged[tname].tensor_type == t.tensor_type, tname
        bw = want.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
        bg = got.reshape(bw.shape)
        same_blocks += int((bw == bg).all(axis=1).sum())
        blocks += bw.shape[0]
        dv = dequantize(got, t.tensor_type).reshape(values.shape)
        step = np.abs(values).reshape(-1, block).max(axis=1) / {GGMLQuantizationType.Q8_0: 127,
                                                                 GGMLQuantizationType.Q4_0: 8,
                                                                 GGMLQuantizationType.Q4_1: 7.5}[qtype]
        err = np.abs(dv - values).reshape(-1, block).max(axis=1)
        worst_steps = max(worst_steps, float((err / np.maximum(step, 1e-30)).max()))
    record(f"{name}: merged GGUF blocks differing from gguf-py's quantize (share)",
           1 - same_blocks / blocks, 0.01, f"{blocks - same_blocks} of {blocks} blocks")
    record(f"{name}: merged GGUF dequantized error in quantization steps", worst_steps, 1.0)
    check_gguf_adapter(name, adapter, out / "adapter.gguf", cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], True, "llama")
    lines = json.loads((out / "check.json").read_text())
    for r in lines:
        record(f"{name}: lorafit --check {Path(r['artefact']).name}, rel", r["rel"], r["bound"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lorafit", default=str(ROOT / "target" / "release" / "lorafit"))
    ap.add_argument("--out", help="keep the artefacts here instead of a temporary folder")
    ap.add_argument("--also", action="append", default=[], metavar="DIR",
                    help="an output folder of `lorafit export --check` (e.g. of SmolLM2) whose "
                         "merged-hf/ transformers also loads and checks against the stated bound")
    args = ap.parse_args()
    import transformers
    from importlib.metadata import version
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gguf {version('gguf')}, peft {version('peft')}")
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(args.out) if args.out else Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in HF_FAMILIES:
            base = FIXTURES / name
            cfg = json.loads((base / "config.json").read_text())
            for dtype, bound in (("bf16", None), ("f32", 1e-4)):
                out = tmp / f"{name}-{dtype}"
                export(args.lorafit, "--model", str(base), "--adapter", str(base / "adapter"),
                       "--output", str(out), "--dtype", dtype, "--check")
                check_merged_folder(name, out, bound, dtype)
            arch = {"mistral": "llama"}.get(name, name)
            check_gguf_adapter(name, base / "adapter", tmp / f"{name}-f32" / "adapter.gguf",
                               cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                               name in PERMUTED, arch)
        for q in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            check_merged_gguf(tmp, args.lorafit, q)
        for extra in args.also:
            check_merged_folder(Path(extra).name, Path(extra), None, "given")
    width = max(len(r[0]) for r in rows)
    for what, value, bound, verdict, note in rows:
        print(f"{what:<{width}}  {value:10.3e}  <= {bound:9.3e}  {verdict}  {note}")
    if failures:
        print(f"{len(failures)} checks failed", file=sys.stderr)
        sys.exit(1)
    print(f"all {len(rows)} checks passed")


if __name__ == "__main__":
    main()
