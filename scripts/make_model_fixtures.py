#!/usr/bin/env python3
"""Generate tiny reference fixtures (HF model + PEFT LoRA adapter + forward/backward
reference tensors) used by lorafit's Rust tests to check that its CPU forward/backward
matches PyTorch (transformers + peft).

Usage:
    python3 scripts/make_model_fixtures.py [--out tests/fixtures/models] [--only llama,qwen2]

Each family gets a folder <out>/<name>/ containing
    config.json, model.safetensors            (model.save_pretrained)
    adapter/adapter_config.json,
    adapter/adapter_model.safetensors         (peft_model.save_pretrained)
    reference.safetensors                     (see README.md next to the fixtures)

Everything is float32 on CPU, eager attention, fully seeded.
"""

import argparse
import inspect
import json
import math
import os
import shutil
import sys

import torch
import transformers
import peft
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

T = 16  # sequence length
V = 256  # vocab size
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

TF_MAJOR = int(transformers.__version__.split(".")[0])

COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    hidden_act="silu",
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def rope_kwargs(theta, scaling=None):
    """Config kwargs for RoPE, for transformers v4 (rope_theta + rope_scaling) or
    v5 (rope_parameters)."""
    if TF_MAJOR >= 5:
        params = {"rope_type": "default", "rope_theta": float(theta)}
        if scaling is not None:
            params.update(scaling)
        return {"rope_parameters": params}
    kw = {"rope_theta": float(theta)}
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return kw


# --------------------------------------------------------------------------------------
# Family definitions
# --------------------------------------------------------------------------------------


def families():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama": dict(
            seed=1001,
            config_cls=LlamaConfig,
            model_cls=LlamaForCausalLM,
            config_kwargs=dict(
                COMMON,
                tie_word_embeddings=False,
                # head_dim 16 -> wavelengths 2*pi*1e4^(2i/16) = 6.3, 19.9, 62.8, 199, ...
                # with original_max_position_embeddings 32, low/high freq factor 1/4:
                #   low_freq_wavelen 32, high_freq_wavelen 8
                #   -> i=0 unchanged (6.3 < 8), i=1 smoothed (8 <= 19.9 <= 32),
                #      i>=2 divided by factor (> 32). All three branches are exercised.
                **rope_kwargs(
                    10000.0,
                    {
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32,
                    },
                ),
            ),
            lora_extra={},
        ),
        "llama_linear": dict(
            seed=1002,
            config_cls=LlamaConfig,
            model_cls=LlamaForCausalLM,
            config_kwargs=dict(
                COMMON,
                tie_word_embeddings=True,
                **rope_kwargs(10000.0, {"rope_type": "linear", "factor": 2.0}),
            ),
            lora_extra={},
        ),
        "qwen2": dict(
            seed=1003,
            config_cls=Qwen2Config,
            model_cls=Qwen2ForCausalLM,
            config_kwargs=dict(
                COMMON,
                tie_word_embeddings=True,
                use_sliding_window=False,
                **rope_kwargs(1_000_000.0),
            ),
            lora_extra=dict(
                use_rslora=True,
                # PEFT matches rank_pattern keys with re.match(rf"(.*\.)?({key})$", module_name)
                # where module_name is relative to the *base* model (LlamaForCausalLM-level),
                # e.g. "model.layers.1.mlp.down_proj".
                rank_pattern={"model.layers.1.mlp.down_proj": 2},
            ),
            expect_rank={"model.layers.1.mlp.down_proj": 2},
        ),
        "qwen3": dict(
            seed=1004,
            config_cls=Qwen3Config,
            model_cls=Qwen3ForCausalLM,
            config_kwargs=dict(
                COMMON,
                head_dim=24,  # != hidden/heads = 16
                tie_word_embeddings=False,
                attention_bias=False,
                use_sliding_window=False,
                **rope_kwargs(1_000_000.0),
            ),
            lora_extra={},
        ),
        "mistral": dict(
            seed=1005,
            config_cls=MistralConfig,
            model_cls=MistralForCausalLM,
            config_kwargs=dict(
                COMMON,
                tie_word_embeddings=False,
                sliding_window=6,
                **rope_kwargs(10000.0),
            ),
            lora_extra={},
            check_sliding_window=True,
        ),
    }


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def make_config(fam, **override):
    kw = dict(fam["config_kwargs"])
    kw.update(override)
    cfg = fam["config_cls"](**kw)
    cfg._attn_implementation = "eager"
    try:
        cfg.dtype = torch.float32
    except Exception:
        pass
    return cfg


def build_model(fam, cfg):
    torch.manual_seed(fam["seed"])
    try:
        model = fam["model_cls"](cfg, attn_implementation="eager")
    except TypeError:
        model = fam["model_cls"](cfg)
    model = model.to(torch.float32)
    model.config._attn_implementation = "eager"
    return model


@torch.no_grad()
def init_weights(model, seed):
    """Non-trivial deterministic init: norm weights ~ 1 + 0.1*N, biases 0.1*N,
    embeddings / lm_head 0.1*N, other linear weights 0.08*N."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in model.named_parameters():  # tied params are yielded once
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.08 * noise)


def save_model(model, path):
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(path, **kwargs)


def forward(model, input_ids):
    out = model(input_ids=input_ids[None, :], output_hidden_states=True, use_cache=False)
    logits = out.logits[0]
    hidden = out.hidden_states[-1][0]
    return logits, hidden


def lora_params(peft_model, adapter_name="default"):
    """Map saved-adapter key -> live LoRA parameter."""
    res = {}
    for name, p in peft_model.named_parameters():
        if not p.requires_grad:
            continue
        assert ".lora_A." in name or ".lora_B." in name, f"unexpected trainable param {name}"
        key = name.replace(f".{adapter_name}.", ".")
        assert key not in res, key
        res[key] = p
    return res


def grads_for(peft_model, params, loss_fn, input_ids):
    peft_model.zero_grad(set_to_none=True)
    logits, hidden = forward(peft_model, input_ids)
    loss = loss_fn(logits, hidden)
    loss.backward()
    out = {}
    for k, p in params.items():
        assert p.grad is not None, f"no grad for {k}"
        out[k] = p.grad.detach().clone().contiguous()
    peft_model.zero_grad(set_to_none=True)
    return out


@torch.no_grad()
def reload_and_forward(fam, d, input_ids):
    from peft import PeftModel

    kw = dict(attn_implementation="eager")
    try:
        m = fam["model_cls"].from_pretrained(d, dtype=torch.float32, **kw)
    except TypeError:
        m = fam["model_cls"].from_pretrained(d, torch_dtype=torch.float32, **kw)
    pm = PeftModel.from_pretrained(m, os.path.join(d, "adapter"))
    pm.eval()
    logits, _ = forward(pm, input_ids)
    return logits.clone()


# --------------------------------------------------------------------------------------
# Independent "spec" forward: re-implements the math from the files on disk only
# (config.json, model.safetensors, adapter/*), without transformers/peft. It documents
# the exact semantics the Rust implementation must follow and is checked against the
# reference logits/hidden.
# --------------------------------------------------------------------------------------


def spec_inv_freq(cfg):
    rp = cfg.get("rope_parameters") or {}
    if not rp:  # transformers v4 style
        rp = dict(cfg.get("rope_scaling") or {})
        rp.setdefault("rope_type", rp.get("type", "default"))
        rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    t = rp.get("rope_type", "default")
    if t == "linear":
        inv = inv / rp["factor"]
    elif t == "llama3":
        f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = torch.where(wl > lo_wl, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = (wl >= hi_wl) & (wl <= lo_wl)
        inv = torch.where(medium, smoothed, out)
    else:
        assert t == "default", t
    return inv


@torch.no_grad()
def spec_forward(d, input_ids):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "adapter", "adapter_config.json")) as f:
        acfg = json.load(f)
    W = load_file(os.path.join(d, "model.safetensors"))
    A = load_file(os.path.join(d, "adapter", "adapter_model.safetensors"))
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    mt = cfg["model_type"]
    window = None
    if mt == "mistral":
        window = cfg.get("sliding_window")
    elif mt in ("qwen2", "qwen3"):
        # sliding only if use_sliding_window and layer_types says so (not the case here)
        assert all(t == "full_attention" for t in cfg["layer_types"])

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def lin(x, prefix):
        y = x @ W[prefix + ".weight"].T
        if prefix + ".bias" in W:
            y = y + W[prefix + ".bias"]
        ka = f"base_model.model.{prefix}.lora_A.weight"
        if ka in A:
            a, b = A[ka], A[f"base_model.model.{prefix}.lora_B.weight"]
            r = a.shape[0]
            alpha = acfg["lora_alpha"]  # (alpha_pattern is empty in these fixtures)
            assert not acfg.get("alpha_pattern")
            scale = alpha / math.sqrt(r) if acfg.get("use_rslora") else alpha / r
            y = y + (x @ a.T) @ b.T * scale
        return y

    Tn = input_ids.shape[0]
    inv = spec_inv_freq(cfg)
    ang = torch.arange(Tn).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T,1,hd]

    def rope(x):  # x [T, heads, hd]; rotate_half convention (not interleaved)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    i = torch.arange(Tn)[:, None]
    j = torch.arange(Tn)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)  # query i sees keys i-window+1 ..= i

    x = W["model.embed_tokens.weight"][input_ids]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        n = rms(x, W[f"{p}.input_layernorm.weight"])
        q = lin(n, f"{p}.self_attn.q_proj").view(Tn, nh, hd)
        k = lin(n, f"{p}.self_attn.k_proj").view(Tn, nkv, hd)
        v = lin(n, f"{p}.self_attn.v_proj").view(Tn, nkv, hd)
        if f"{p}.self_attn.q_norm.weight" in W:  # qwen3: per-head RMSNorm over head_dim, before RoPE
            q = rms(q, W[f"{p}.self_attn.q_norm.weight"])
            k = rms(k, W[f"{p}.self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        rep = nh // nkv  # query head h uses kv head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = torch.einsum("ihd,jhd->hij", q, k) * hd**-0.5
        s = s.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(Tn, nh * hd)
        x = x + lin(o, f"{p}.self_attn.o_proj")
        n = rms(x, W[f"{p}.post_attention_layernorm.weight"])
        g = lin(n, f"{p}.mlp.gate_proj")
        u = lin(n, f"{p}.mlp.up_proj")
        x = x + lin(torch.nn.functional.silu(g) * u, f"{p}.mlp.down_proj")
    hidden = rms(x, W["model.norm.weight"])
    lm = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    return hidden @ lm.T, hidden, inv


# --------------------------------------------------------------------------------------
# Main per-family generation
# --------------------------------------------------------------------------------------


def generate(name, fam, out_root):
    print(f"=== {name} ===")
    d = os.path.join(out_root, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    seed = fam["seed"]

    cfg = make_config(fam)
    model = build_model(fam, cfg)
    init_weights(model, seed + 1)
    model.eval()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie failed"
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()

    g = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, V, (T,), generator=g, dtype=torch.int64)
    positions = torch.arange(T, dtype=torch.int64)
    H = cfg.hidden_size

    # Base model (no adapter) logits, before PEFT wraps it.
    with torch.no_grad():
        base_logits, _ = forward(model, input_ids)
        base_logits = base_logits.clone()

    # Sliding window check (mistral): same weights, window disabled, logits must differ.
    if fam.get("check_sliding_window"):
        cfg2 = make_config(fam, sliding_window=None)
        m2 = build_model(fam, cfg2)
        m2.load_state_dict(model.state_dict())
        m2.eval()
        with torch.no_grad():
            l2, _ = forward(m2, input_ids)
        diff = (l2 - base_logits).abs().max().item()
        # The first `window` positions see the same keys either way.
        w = cfg.sliding_window
        same_prefix = (l2[:w] - base_logits[:w]).abs().max().item()
        print(f"  sliding_window={w}: max|logits(window) - logits(no window)| = {diff:.4e} "
              f"(first {w} positions: {same_prefix:.2e})")
        assert diff > 1e-3, "sliding window NOT applied by this transformers version in eager mode"
        assert same_prefix < 1e-5
        del m2

    save_model(model, d)
    # Sanity: what was saved round-trips.
    saved = load_file(os.path.join(d, "model.safetensors"))
    sd = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(v, sd[k]), k
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in saved

    # ---- PEFT ----
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
        **fam["lora_extra"],
    )
    torch.manual_seed(seed + 3)  # PEFT's own lora_A init (kaiming_uniform) draws from the global RNG
    pm = get_peft_model(model, lcfg)
    pm.eval()  # dropout is 0 anyway

    # lora_B := non-zero random
    gb = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gb, dtype=torch.float32))

    params = lora_params(pm)
    # expected ranks
    for k, p in params.items():
        mod = k.split(".lora_")[0].replace("base_model.model.", "", 1)
        r = fam.get("expect_rank", {}).get(mod, 4)
        if ".lora_A." in k:
            assert p.shape[0] == r, (k, p.shape, r)
        else:
            assert p.shape[1] == r, (k, p.shape, r)
    n_modules = cfg.num_hidden_layers * len(TARGETS)
    assert len(params) == 2 * n_modules, (len(params), n_modules)

    adir = os.path.join(d, "adapter")
    pm.save_pretrained(adir)
    adapter_sd = load_file(os.path.join(adir, "adapter_model.safetensors"))
    assert set(adapter_sd.keys()) == set(params.keys()), (
        sorted(set(adapter_sd) ^ set(params))
    )
    for k, v in adapter_sd.items():
        assert torch.equal(v, params[k].detach()), f"saved value mismatch for {k}"

    # PEFT also writes a model-card README.md; it is boilerplate, drop it.
    if os.path.exists(os.path.join(adir, "README.md")):
        os.remove(os.path.join(adir, "README.md"))

    # PEFT stores target_modules from a Python set, so its order depends on the hash seed;
    # sort it so the fixture is reproducible byte-for-byte (semantics unchanged).
    acfg_path = os.path.join(adir, "adapter_config.json")
    with open(acfg_path) as f:
        acfg = json.load(f)
    if isinstance(acfg.get("target_modules"), list):
        acfg["target_modules"] = sorted(acfg["target_modules"])
    with open(acfg_path, "w") as f:
        f.write(json.dumps(acfg, indent=2, sort_keys=True))

    # print scalings
    scalings = {}
    for n, m in pm.named_modules():
        if hasattr(m, "scaling") and isinstance(getattr(m, "scaling"), dict) and "default" in m.scaling:
            scalings[n.replace("base_model.model.", "", 1)] = m.scaling["default"]
    distinct = sorted(set(round(s, 6) for s in scalings.values()))
    print(f"  LoRA scalings (distinct): {distinct}")
    if fam["lora_extra"].get("use_rslora"):
        assert abs(scalings["model.layers.1.mlp.down_proj"] - 8 / math.sqrt(2)) < 1e-9
        assert abs(scalings["model.layers.0.mlp.down_proj"] - 8 / math.sqrt(4)) < 1e-9
    else:
        assert distinct == [2.0], distinct

    # ---- forward with adapter ----
    with torch.no_grad():
        logits, hidden = forward(pm, input_ids)
        logits = logits.clone()
        hidden = hidden.clone()
    assert logits.shape == (T, V) and hidden.shape == (T, H)
    # hidden is post-final-norm: logits == hidden @ lm_head^T
    lm_w = pm.get_base_model().lm_head.weight.detach()
    recon = hidden @ lm_w.T
    assert (recon - logits).abs().max().item() < 1e-4, "hidden[-1] is not the post-norm hidden state"
    adapter_effect = (logits - base_logits).abs().max().item()
    assert adapter_effect > 1e-2, adapter_effect

    # ---- backward ----
    gd = torch.Generator().manual_seed(seed + 5)
    dlogits = torch.randn(T, V, generator=gd, dtype=torch.float32)
    dhidden = torch.randn(T, H, generator=gd, dtype=torch.float32)

    pm.train()  # dropout p=0 -> identical numerics; mirrors training mode
    g_logits = grads_for(pm, params, lambda l, h: (l * dlogits).sum(), input_ids)
    g_hidden = grads_for(pm, params, lambda l, h: (h * dhidden).sum(), input_ids)
    pm.eval()

    for tag, gr in (("grad_logits", g_logits), ("grad_hidden", g_hidden)):
        for k, v in gr.items():
            assert torch.isfinite(v).all(), (tag, k)
            assert v.abs().max().item() > 0, f"all-zero gradient {tag}.{k}"

    ref = {
        "input_ids": input_ids.contiguous(),
        "positions": positions.contiguous(),
        "logits": logits.contiguous(),
        "hidden": hidden.contiguous(),
        "base_logits": base_logits.contiguous(),
        "dlogits": dlogits.contiguous(),
        "dhidden": dhidden.contiguous(),
        "rope_inv_freq": pm.get_base_model().model.rotary_emb.inv_freq.detach().to(torch.float32).clone().contiguous(),
    }
    for k, v in g_logits.items():
        ref[f"grad_logits.{k}"] = v
    for k, v in g_hidden.items():
        ref[f"grad_hidden.{k}"] = v
    # One metadata key (a JSON string) so the file is byte-for-byte reproducible
    # (safetensors does not preserve metadata key order).
    meta = {
        "info": json.dumps(
            {
                "family": name,
                "T": T,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
            },
            sort_keys=True,
        )
    }
    save_file(ref, os.path.join(d, "reference.safetensors"), metadata=meta)

    # ---- reload check: the files on disk alone reproduce the reference logits ----
    reload_logits = reload_and_forward(fam, d, input_ids)
    rdiff = (reload_logits - logits).abs().max().item()
    assert rdiff < 1e-5, f"reloaded model+adapter logits differ by {rdiff}"
    print(f"  reload from disk: max|logits diff| = {rdiff:.2e}")

    # ---- independent spec forward from the files on disk ----
    s_logits, s_hidden, s_inv = spec_forward(d, input_ids)
    sd_l = (s_logits - logits).abs().max().item()
    sd_h = (s_hidden - hidden).abs().max().item()
    sd_f = (s_inv - ref["rope_inv_freq"]).abs().max().item()
    print(f"  spec forward: max|dlogits| = {sd_l:.2e}  max|dhidden| = {sd_h:.2e}  max|dinv_freq| = {sd_f:.2e}")
    assert sd_l < 1e-4 and sd_h < 1e-4 and sd_f < 1e-7, (sd_l, sd_h, sd_f)

    # ---- report ----
    print(f"  max|logits| = {logits.abs().max().item():.4f}  std(logits) = {logits.std().item():.4f}")
    print(f"  max|hidden| = {hidden.abs().max().item():.4f}")
    print(f"  max|logits - base_logits| (adapter effect) = {adapter_effect:.4f}")
    print(f"  rope_inv_freq = {[round(x, 6) for x in ref['rope_inv_freq'].tolist()]}")
    for tag, gr in (("grad_logits", g_logits), ("grad_hidden", g_hidden)):
        groups = {}
        for k, v in gr.items():
            proj = k.split(".lora_")[0].rsplit(".", 1)[1]
            ab = "A" if ".lora_A." in k else "B"
            groups.setdefault(f"{proj}.{ab}", []).append(v)
        s = "  ".join(
            f"{gname}={math.sqrt(sum(float((x * x).sum()) for x in vs)):.3e}" for gname, vs in sorted(groups.items())
        )
        print(f"  |{tag}| by group: {s}")
    for f in sorted(os.listdir(d)) + [os.path.join("adapter", x) for x in sorted(os.listdir(adir))]:
        p = os.path.join(d, f)
        if os.path.isfile(p):
            print(f"  {f}: {os.path.getsize(p)} bytes")
    assert os.path.getsize(os.path.join(d, "reference.safetensors")) < 1_000_000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/models")
    ap.add_argument("--only", default=None, help="comma-separated subset of families")
    args = ap.parse_args()

    torch.set_num_threads(1)  # deterministic reductions
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  peft {peft.__version__}")
    fams = families()
    names = list(fams) if args.only is None else args.only.split(",")
    os.makedirs(args.out, exist_ok=True)
    for n in names:
        generate(n, fams[n], args.out)
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
