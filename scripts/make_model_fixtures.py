#!/usr/bin/env python3
"""Generate tiny reference fixtures (HF model + PEFT LoRA adapter + forward/backward
reference tensors) used by lorafit's Rust tests to check that its CPU forward/backward
matches PyTorch (transformers + peft).

Usage:
    python3 scripts/make_model_fixtures.py [--out tests/fixtures/models] [--only llama,qwen2]

Families: llama, llama_linear, qwen2, qwen3, mistral (Llama-like), gemma2, gemma3 (Gemma 2/3 text),
gemma4 and gemma4_keqv (Gemma 4 text: KV sharing, per-layer inputs, proportional RoPE, 2x-wide
global heads; the second with attention_k_eq_v and one global kv head),
minicpm, minicpm_untied (MiniCPM 1/2/4 with muP scales; a plain-torch reference model, see
MiniCPMForCausalLM below) and minicpm5 (a LlamaForCausalLM with MiniCPM5's explicit head_dim).

Each family gets a folder <out>/<name>/ containing
    config.json, model.safetensors            (model.save_pretrained; MiniCPM: minicpm_save)
    adapter/adapter_config.json,
    adapter/adapter_model.safetensors         (peft_model.save_pretrained)
    reference.safetensors                     (see README.md next to the fixtures)

Everything is float32 on CPU, eager attention, fully seeded.
"""

import argparse
import copy
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
from types import SimpleNamespace

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


def gemma3_rope_kwargs(local_theta, global_theta, global_scaling):
    """Gemma 3 RoPE config kwargs: sliding (local) layers use `local_theta` unscaled, full (global)
    layers use `global_theta` with `global_scaling`. transformers v5 keeps one rope_parameters dict
    per layer type; v4 has rope_theta / rope_local_base_freq / rope_scaling."""
    if TF_MAJOR >= 5:
        full = {"rope_type": "default", "rope_theta": float(global_theta)}
        full.update(global_scaling)
        return {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
                "full_attention": full,
            }
        }
    return {
        "rope_theta": float(global_theta),
        "rope_local_base_freq": float(local_theta),
        "rope_scaling": dict(global_scaling),
    }


# Gemma 2/3 share this geometry (head_dim 16 = hidden/heads). Norm weights w are stored as
# such and applied as (1 + w), so init_weights draws them around 0 (see norm_init="gemma").
GEMMA_COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    attention_bias=False,
    attention_dropout=0.0,
    sliding_window=6,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


# --------------------------------------------------------------------------------------
# MiniCPM (1 / 2 / 4): transformers has no MiniCPMForCausalLM of its own (only MiniCPM3, which
# is MLA), checkpoints ship modeling_minicpm.py as remote code. This is a plain-torch
# reimplementation of that published model (eager attention path), with the same module and
# parameter names, so that PEFT targets q_proj ... down_proj and the state dict has the
# checkpoint's key names. It reads a config.json dict in the checkpoints' own layout
# (transformers v4 style: rope_theta + rope_scaling at the top level).
# --------------------------------------------------------------------------------------

MINICPM_AUTO_MAP = {
    "AutoConfig": "configuration_minicpm.MiniCPMConfig",
    "AutoModel": "modeling_minicpm.MiniCPMModel",
    "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
    "AutoModelForSeq2SeqLM": "modeling_minicpm.MiniCPMForCausalLM",
    "AutoModelForSequenceClassification": "modeling_minicpm.MiniCPMForSequenceClassification",
}


def minicpm_config(tie, rope_scaling, rope_theta=10000.0):
    return {
        "architectures": ["MiniCPMForCausalLM"],
        "auto_map": dict(MINICPM_AUTO_MAP),
        "model_type": "minicpm",
        "vocab_size": V,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        # LongRoPE's attention factor uses max_position_embeddings / original (32 / 8 = 4):
        # sqrt(1 + ln 4 / ln 8) = 1.2910 (not 1 + ..., and not ln 8 / ln 4).
        "max_position_embeddings": 32,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        # muP: embeddings x scale_emb; each residual branch x scale_depth / sqrt(num_hidden_layers);
        # logits = lm_head(h / (hidden_size / dim_model_base)).
        # (scale_depth 0.7 rather than a real checkpoint's 1.4: with 2 layers 1.4/sqrt(2) = 0.99
        # would hide a missing residual scale; 0.7/sqrt(2) = 0.495)
        "scale_emb": 12,
        "scale_depth": 0.7,
        "dim_model_base": 16,
        "initializer_range": 0.1,
        "tie_word_embeddings": bool(tie),
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def longrope_factors(seed, n):
    """Two sets of n distinct factors in [1, 4] (rounded to 4 decimals so config.json is exact)."""
    g = torch.Generator().manual_seed(seed)
    vals = (1.0 + 3.0 * torch.rand(2 * n, generator=g, dtype=torch.float64)).tolist()
    vals = [round(v, 4) for v in vals]
    assert len(set(vals)) == 2 * n
    return vals[:n], vals[n:]


class MiniCPMConfigView:
    """Attribute (and dict) view of a MiniCPM config.json dict, as the remote-code model reads it."""

    def __init__(self, d):
        self.__dict__.update(copy.deepcopy(d))

    def to_dict(self):
        return copy.deepcopy(self.__dict__)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)


class MiniCPMRMSNorm(torch.nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class MiniCPMRotary(torch.nn.Module):
    """RoPE tables as the published MiniCPMRotaryEmbedding / MiniCPMLongRoPE build them.

    Default: inv = 1 / theta^(2i/d); angles t * inv.
    LongRoPE: the table is built for n = max(max_position_embeddings, seq_len) positions (built once
    at init for max_position_embeddings, rebuilt longer only when a sequence exceeds it); the factor
    set is long_factor if n > original_max_position_embeddings, else short_factor; angles are
    outer(t, 1 / ext) * inv; cos and sin are multiplied by sqrt(1 + ln(s) / ln(orig)) with
    s = max_position_embeddings / orig."""

    def __init__(self, cfg):
        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        self.max_pos = cfg.max_position_embeddings
        rs = cfg.rope_scaling
        self.longrope = None
        self.attention_factor = 1.0
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type"))
            assert rtype == "longrope", rtype
            self.longrope = rs
            orig = rs["original_max_position_embeddings"]
            scale = self.max_pos / orig
            self.attention_factor = math.sqrt(1 + math.log(scale) / math.log(orig))

    def tables(self, seq_len):
        n = max(self.max_pos, seq_len)
        t = torch.arange(n, dtype=torch.float32)
        if self.longrope is None:
            freqs = torch.outer(t, self.inv_freq)
            applied = self.inv_freq.clone()
        else:
            orig = self.longrope["original_max_position_embeddings"]
            factors = self.longrope["long_factor"] if n > orig else self.longrope["short_factor"]
            ext = torch.tensor(factors, dtype=torch.float32)
            freqs = torch.mul(torch.outer(t, 1.0 / ext), self.inv_freq)
            applied = torch.mul(1.0 / ext, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.longrope is not None:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos[:seq_len], sin[:seq_len], applied


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class MiniCPMAttention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh  # MiniCPM has no head_dim key: hidden / heads
        H, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = torch.nn.Linear(H, self.nh * self.hd, bias=b)
        self.k_proj = torch.nn.Linear(H, self.nkv * self.hd, bias=b)
        self.v_proj = torch.nn.Linear(H, self.nkv * self.hd, bias=b)
        self.o_proj = torch.nn.Linear(self.nh * self.hd, H, bias=b)

    def forward(self, x, cos, sin, mask):
        B, Tn, _ = x.shape
        q = self.q_proj(x).view(B, Tn, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, Tn, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, Tn, self.nkv, self.hd).transpose(1, 2)
        c, s = cos[None, None], sin[None, None]  # [1, 1, T, hd]
        dt = k.dtype
        q = (q.float() * c + _rotate_half(q.float()) * s).to(dt)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(dt)
        rep = self.nh // self.nkv  # query head h uses kv head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd) + mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(B, Tn, self.nh * self.hd)
        return self.o_proj(o)


class MiniCPMMLP(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        assert cfg.hidden_act == "silu"
        self.gate_proj = torch.nn.Linear(H, I, bias=False)
        self.up_proj = torch.nn.Linear(H, I, bias=False)
        self.down_proj = torch.nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniCPMDecoderLayer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MiniCPMAttention(cfg)
        self.mlp = MiniCPMMLP(cfg)
        self.input_layernorm = MiniCPMRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_scale = cfg.scale_depth / math.sqrt(cfg.num_hidden_layers)

    def forward(self, h, cos, sin, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask) * self.residual_scale
        h = h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale
        return h


class MiniCPMModel(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList([MiniCPMDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = MiniCPMRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MiniCPMRotary(cfg)

    def forward(self, input_ids):
        Tn = input_ids.shape[1]
        h = self.embed_tokens(input_ids) * self.config.scale_emb
        cos, sin, _ = self.rotary_emb.tables(Tn)
        mask = torch.full((Tn, Tn), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)[None, None]
        states = [h]
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
            states.append(h)
        h = self.norm(h)
        states[-1] = h  # like transformers: hidden_states[-1] is the post-norm state
        return h, tuple(states)


class MiniCPMForCausalLM(torch.nn.Module):
    is_gradient_checkpointing = False

    def __init__(self, cfg_dict):
        super().__init__()
        self.config = MiniCPMConfigView(cfg_dict)
        self.model = MiniCPMModel(self.config)
        self.lm_head = torch.nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, use_cache=None, **kw):
        assert attention_mask is None and inputs_embeds is None and labels is None
        h, states = self.model(input_ids)
        c = self.config
        logits = self.lm_head(h / (c.hidden_size / c.dim_model_base)).float()
        return SimpleNamespace(logits=logits, hidden_states=states)

    def prepare_inputs_for_generation(self, *a, **kw):  # PEFT's CausalLM wrapper looks it up
        raise NotImplementedError


def minicpm_save(model, d):
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del sd["lm_head.weight"]  # tied: like HF checkpoints, only model.embed_tokens.weight
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def minicpm_load(d):
    with open(os.path.join(d, "config.json")) as f:
        m = MiniCPMForCausalLM(json.load(f))
    missing, unexpected = m.load_state_dict(load_file(os.path.join(d, "model.safetensors")), strict=False)
    assert not unexpected, unexpected
    assert missing == (["lm_head.weight"] if m.config.tie_word_embeddings else []), missing
    return m.to(torch.float32)


def native_minicpm_available():
    try:
        return importlib.util.find_spec("transformers.models.minicpm") is not None
    except Exception:
        return False


# --------------------------------------------------------------------------------------
# Family definitions
# --------------------------------------------------------------------------------------


# Gemma 2 softcaps, small enough to bite on this tiny model (checked in generate(): some scaled
# attention scores and some raw logits exceed half the cap).
GEMMA2_ATTN_CAP = 1.0
GEMMA2_FINAL_CAP = 2.0
GEMMA2_LINEAR_STD = 0.08

# MiniCPM: larger projections than the 0.08 default so that attention is peaked enough for the
# RoPE details (factor set, attention factor) to move the logits by O(0.1).
MINICPM_LINEAR_STD = 0.15

# LongRoPE factor sets of the `minicpm` fixture (head_dim 16 -> 8 each), distinct, in [1, 4].
MINICPM_LONG, MINICPM_SHORT = longrope_factors(2024, 8)


def softcap(x, cap):
    return cap * torch.tanh(x / cap)


def gemma_head(hidden, lm_w, cfg):
    logits = hidden @ lm_w.T
    cap = cfg.get("final_logit_softcapping")
    return softcap(logits, cap) if cap is not None else logits


def minicpm_head(hidden, lm_w, cfg):
    return (hidden / (cfg["hidden_size"] / cfg["dim_model_base"])) @ lm_w.T


def gemma_embed_scale(base):
    emb = base.model.embed_tokens
    # Gemma*TextScaledWordEmbedding: E[ids] * embed_scale.to(weight dtype); embed_scale is a float32
    # tensor of hidden_size**0.5 (8.0 here; in bf16 checkpoints the cast rounds it, 55.4256 -> 55.5).
    return emb.embed_scale.to(emb.weight.dtype).reshape(1).clone().contiguous()


def gemma2_ref_extra(base):
    return {
        "rope_inv_freq": base.model.rotary_emb.inv_freq.detach().to(torch.float32).clone().contiguous(),
        "embed_scale": gemma_embed_scale(base),
    }


def gemma3_ref_extra(base):
    rot = base.model.rotary_emb
    return {
        # global (full_attention) layers, after the linear scaling (/ 8)
        "rope_inv_freq": rot.full_attention_inv_freq.detach().to(torch.float32).clone().contiguous(),
        # local (sliding_attention) layers, unscaled
        "rope_inv_freq_local": rot.sliding_attention_inv_freq.detach().to(torch.float32).clone().contiguous(),
        "embed_scale": gemma_embed_scale(base),
    }


def gemma4_ref_extra(base):
    rot = base.model.rotary_emb
    return {
        # sliding layers (lorafit's main table), then full layers (proportional: zeros past the
        # rotated pairs)
        "rope_inv_freq": rot.sliding_attention_inv_freq.detach().to(torch.float32).clone().contiguous(),
        "rope_inv_freq_global": rot.full_attention_inv_freq.detach().to(torch.float32).clone().contiguous(),
        "embed_scale": gemma_embed_scale(base),
    }


def gemma4_config_kwargs(**over):
    kw = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        sliding_window=6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        # layers 5, 6 (sliding) and 7 (full) share k/v: donors 3 (sliding) and 4 (full)
        layer_types=[
            "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
            "full_attention", "sliding_attention", "sliding_attention", "full_attention",
        ],
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V,
        use_double_wide_mlp=True,
        final_logit_softcapping=2.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            # global head_dim 32: 0.25 * 32 // 2 = 4 of 16 frequency pairs rotate
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
    )
    kw.update(over)
    return kw


def minicpm_ref_extra(base):
    rot = base.model.rotary_emb
    _, _, applied = rot.tables(T)
    out = {
        # what multiplies the position: inv_freq / ext with the factor set used at T (long here)
        "rope_inv_freq": applied.to(torch.float32).clone().contiguous(),
        # the cos/sin multiplier (1.0 without LongRoPE)
        "rope_attention_factor": torch.tensor([rot.attention_factor], dtype=torch.float32),
    }
    if rot.longrope is not None:
        ext = torch.tensor(rot.longrope["short_factor"], dtype=torch.float32)
        out["rope_inv_freq_short"] = torch.mul(1.0 / ext, rot.inv_freq).contiguous()
    return out


def families():
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
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
        "gemma2": dict(
            seed=1006,
            config_cls=Gemma2Config,
            model_cls=Gemma2ForCausalLM,
            config_kwargs=dict(
                GEMMA_COMMON,
                # default layer_types: even layers sliding, odd layers full -> [sliding, full, sliding]
                query_pre_attn_scalar=24,  # score scale 24^-0.5, != head_dim^-0.5
                attn_logit_softcapping=GEMMA2_ATTN_CAP,
                final_logit_softcapping=GEMMA2_FINAL_CAP,
                **rope_kwargs(10000.0),
            ),
            lora_extra={},
            norm_init="gemma",
            linear_std=GEMMA2_LINEAR_STD,
            check_sliding_window=True,
            no_window=dict(sliding_window=64),  # >= T: the sliding layers see every earlier key
            check_softcap=True,
            head=gemma_head,
            ref_extra=gemma2_ref_extra,
        ),
        "gemma3": dict(
            seed=1007,
            config_cls=Gemma3TextConfig,
            model_cls=Gemma3ForCausalLM,
            config_kwargs=dict(
                GEMMA_COMMON,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                query_pre_attn_scalar=32,
                # softcaps: the Gemma 3 default (None) for both
                **gemma3_rope_kwargs(10000.0, 1_000_000.0, {"rope_type": "linear", "factor": 8.0}),
            ),
            lora_extra={},
            norm_init="gemma",
            check_sliding_window=True,
            no_window=dict(sliding_window=64),
            head=gemma_head,
            ref_extra=gemma3_ref_extra,
        ),
        "gemma4": dict(
            seed=1011,
            config_cls=Gemma4TextConfig,
            model_cls=Gemma4ForCausalLM,
            config_kwargs=gemma4_config_kwargs(),
            lora_extra={},
            linear_std=0.15,
            random_buffers=True,
            check_sliding_window=True,
            no_window=dict(sliding_window=64),
            head=gemma_head,
            ref_extra=gemma4_ref_extra,
            # transformers itself is the oracle: spec_forward does not reimplement Gemma 4
            skip_spec=True,
        ),
        "gemma4_keqv": dict(
            seed=1012,
            config_cls=Gemma4TextConfig,
            model_cls=Gemma4ForCausalLM,
            config_kwargs=gemma4_config_kwargs(
                attention_k_eq_v=True,
                num_global_key_value_heads=1,
                use_double_wide_mlp=False,
            ),
            lora_extra={},
            linear_std=0.15,
            random_buffers=True,
            head=gemma_head,
            ref_extra=gemma4_ref_extra,
            skip_spec=True,
        ),
        "minicpm": dict(
            seed=1008,
            custom=True,
            config_dict=minicpm_config(
                tie=True,
                rope_scaling=dict(
                    rope_type="longrope",
                    # head_dim 16 -> 8 factors each; T = 16 > 8, so the long factors apply
                    long_factor=MINICPM_LONG,
                    short_factor=MINICPM_SHORT,
                    original_max_position_embeddings=8,
                ),
            ),
            lora_extra={},
            linear_std=MINICPM_LINEAR_STD,
            check_longrope=True,
            head=minicpm_head,
            ref_extra=minicpm_ref_extra,
        ),
        "minicpm_untied": dict(
            seed=1009,
            custom=True,
            config_dict=minicpm_config(tie=False, rope_scaling=None),
            lora_extra={},
            linear_std=MINICPM_LINEAR_STD,
            head=minicpm_head,
            ref_extra=minicpm_ref_extra,
        ),
        "minicpm5": dict(
            seed=1010,
            config_cls=LlamaConfig,
            model_cls=LlamaForCausalLM,
            config_kwargs=dict(
                COMMON,
                head_dim=32,  # explicit, != hidden/heads = 16: q_proj 64 -> 128, o_proj 128 -> 64
                tie_word_embeddings=False,
                **rope_kwargs(1_000_000.0),
            ),
            lora_extra={},
        ),
    }


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def make_config(fam, **override):
    if fam.get("custom"):  # MiniCPM: the config.json dict itself, as the checkpoints carry it
        d = copy.deepcopy(fam["config_dict"])
        d.update(copy.deepcopy(override))
        return MiniCPMConfigView(d)
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
    if fam.get("custom"):
        return MiniCPMForCausalLM(cfg.to_dict()).to(torch.float32)
    try:
        model = fam["model_cls"](cfg, attn_implementation="eager")
    except TypeError:
        model = fam["model_cls"](cfg)
    model = model.to(torch.float32)
    model.config._attn_implementation = "eager"
    return model


@torch.no_grad()
def init_weights(model, seed, norm_init="llama", linear_std=0.08):
    """Non-trivial deterministic init: norm weights ~ 1 + 0.1*N (Gemma, whose norms apply (1 + w):
    w ~ 0.3*N), biases 0.1*N, embeddings / lm_head 0.1*N, other linear weights 0.08*N."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in model.named_parameters():  # tied params are yielded once
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            if norm_init == "gemma":
                p.copy_(0.3 * noise)
            else:
                p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(0.1 * noise)
        else:
            p.copy_(linear_std * noise)


def save_model(model, path):
    if isinstance(model, MiniCPMForCausalLM):
        minicpm_save(model, path)
        return
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

    if fam.get("custom"):
        m = minicpm_load(d)
    else:
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


def spec_rope_params(cfg, layer_type=None):
    """The RoPE parameters dict for a layer type: v5 `rope_parameters` (flat, or nested by layer
    type as in Gemma 3), or the v4 / remote-code layout (`rope_theta` + `rope_scaling`)."""
    rp = cfg.get("rope_parameters") or {}
    if rp and layer_type is not None and layer_type in rp:
        return dict(rp[layer_type])
    if not rp:  # transformers v4 style (and MiniCPM checkpoints)
        rp = dict(cfg.get("rope_scaling") or {})
        rp.setdefault("rope_type", rp.get("type", "default"))
        rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    return dict(rp)


def spec_inv_freq(cfg, rp=None, seq_len=None):
    """(inv_freq, attention_factor) for one layer's RoPE parameters `rp`."""
    if rp is None:
        rp = spec_rope_params(cfg)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rp["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    attn = 1.0
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
    elif t == "longrope":
        # long factors when the sequence (max position + 1) is longer than the pretraining length
        orig = rp["original_max_position_embeddings"]
        ext = torch.tensor(rp["long_factor"] if seq_len > orig else rp["short_factor"], dtype=torch.float32)
        inv = 1.0 / (ext * base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        s = rp.get("factor") or cfg["max_position_embeddings"] / orig
        attn = rp.get("attention_factor") or (math.sqrt(1 + math.log(s) / math.log(orig)) if s > 1 else 1.0)
    else:
        assert t == "default", t
    return inv, attn


@torch.no_grad()
def spec_forward(d, input_ids):
    """Returns logits, hidden, {reference key: inv_freq}, and stats used by the checks."""
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "adapter", "adapter_config.json")) as f:
        acfg = json.load(f)
    W = load_file(os.path.join(d, "model.safetensors"))
    A = load_file(os.path.join(d, "adapter", "adapter_model.safetensors"))
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    L = cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    mt = cfg["model_type"]
    gemma = mt in ("gemma2", "gemma3_text")
    minicpm = mt == "minicpm"
    Tn = input_ids.shape[0]

    # per-layer attention window (None = plain causal)
    if mt == "mistral":
        windows = [cfg.get("sliding_window")] * L
    elif gemma:
        windows = [cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]]
    else:
        windows = [None] * L
        if mt in ("qwen2", "qwen3"):
            # sliding only if use_sliding_window and layer_types says so (not the case here)
            assert all(t == "full_attention" for t in cfg["layer_types"])

    # per-layer RoPE: Gemma 3 has one parameter set per layer type, the others one for all layers
    ropes = {}
    inv_out = {}
    if mt == "gemma3_text":
        for lt in sorted(set(cfg["layer_types"])):
            ropes[lt] = spec_inv_freq(cfg, spec_rope_params(cfg, lt), Tn)
        layer_rope = [ropes[t] for t in cfg["layer_types"]]
        inv_out["rope_inv_freq"] = ropes["full_attention"][0]
        inv_out["rope_inv_freq_local"] = ropes["sliding_attention"][0]
    else:
        r = spec_inv_freq(cfg, spec_rope_params(cfg), Tn)
        layer_rope = [r] * L
        inv_out["rope_inv_freq"] = r[0]

    if gemma:
        def norm(x, w):  # Gemma: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w)
    else:
        def norm(x, w):
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

    def rope(x, inv, attn):  # x [T, heads, hd]; rotate_half convention (not interleaved)
        ang = torch.arange(Tn).float()[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], -1)
        cos, sin = (emb.cos() * attn)[:, None, :], (emb.sin() * attn)[:, None, :]  # [T,1,hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    i = torch.arange(Tn)[:, None]
    j = torch.arange(Tn)[None, :]

    score_scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else hd**-0.5
    attn_cap = cfg.get("attn_logit_softcapping") if gemma else None
    final_cap = cfg.get("final_logit_softcapping") if gemma else None
    residual_scale = cfg["scale_depth"] / math.sqrt(L) if minicpm else 1.0
    stats = {"max_abs_score": 0.0}

    x = W["model.embed_tokens.weight"][input_ids]
    if gemma:  # sqrt(hidden) as a float32 tensor, cast to the weight dtype (float32 here)
        x = x * torch.tensor(H**0.5, dtype=torch.float32).to(x.dtype)
    elif minicpm:
        x = x * cfg["scale_emb"]
    for l in range(L):
        p = f"model.layers.{l}"
        allowed = j <= i
        if windows[l] is not None:
            allowed = allowed & (j > i - windows[l])  # query i sees keys i-window+1 ..= i
        n = norm(x, W[f"{p}.input_layernorm.weight"])
        q = lin(n, f"{p}.self_attn.q_proj").view(Tn, nh, hd)
        k = lin(n, f"{p}.self_attn.k_proj").view(Tn, nkv, hd)
        v = lin(n, f"{p}.self_attn.v_proj").view(Tn, nkv, hd)
        if f"{p}.self_attn.q_norm.weight" in W:  # qwen3/gemma3: per-head RMSNorm over head_dim, before RoPE
            q = norm(q, W[f"{p}.self_attn.q_norm.weight"])
            k = norm(k, W[f"{p}.self_attn.k_norm.weight"])
        q, k = rope(q, *layer_rope[l]), rope(k, *layer_rope[l])
        rep = nh // nkv  # query head h uses kv head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = torch.einsum("ihd,jhd->hij", q, k) * score_scale
        stats["max_abs_score"] = max(stats["max_abs_score"], s.masked_fill(~allowed[None], 0).abs().max().item())
        if attn_cap is not None:  # Gemma 2: cap the scaled scores, before the mask
            s = softcap(s, attn_cap)
        s = s.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(Tn, nh * hd)
        o = lin(o, f"{p}.self_attn.o_proj")
        if gemma:  # sandwich norms: post_attention_layernorm normalises the attention output
            x = x + norm(o, W[f"{p}.post_attention_layernorm.weight"])
            n = norm(x, W[f"{p}.pre_feedforward_layernorm.weight"])
            g = lin(n, f"{p}.mlp.gate_proj")
            u = lin(n, f"{p}.mlp.up_proj")
            m = lin(torch.nn.functional.gelu(g, approximate="tanh") * u, f"{p}.mlp.down_proj")
            x = x + norm(m, W[f"{p}.post_feedforward_layernorm.weight"])
        else:
            x = x + o * residual_scale
            n = norm(x, W[f"{p}.post_attention_layernorm.weight"])
            g = lin(n, f"{p}.mlp.gate_proj")
            u = lin(n, f"{p}.mlp.up_proj")
            x = x + lin(torch.nn.functional.silu(g) * u, f"{p}.mlp.down_proj") * residual_scale
    hidden = norm(x, W["model.norm.weight"])
    lm = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    h = hidden / (H / cfg["dim_model_base"]) if minicpm else hidden
    logits = h @ lm.T
    stats["max_abs_raw_logit"] = logits.abs().max().item()
    if final_cap is not None:
        logits = softcap(logits, final_cap)
    stats["layer_rope_attention_factors"] = [r[1] for r in layer_rope]
    return logits, hidden, inv_out, stats


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
    init_weights(model, seed + 1, fam.get("norm_init", "llama"), fam.get("linear_std", 0.08))
    if fam.get("random_buffers"):
        # Gemma 4's layer_scalar buffers (ones at init): values in [0.5, 1.5) so that they matter.
        gbuf = torch.Generator().manual_seed(seed + 6)
        with torch.no_grad():
            for bname, b in model.named_buffers():
                if bname.endswith("layer_scalar"):
                    b.copy_(0.5 + torch.rand(b.shape, generator=gbuf))
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

    def variant_logits(**override):
        """Base logits of the same weights under a modified config."""
        m2 = build_model(fam, make_config(fam, **override))
        m2.load_state_dict(model.state_dict(), strict=True)
        m2.eval()
        with torch.no_grad():
            l2, _ = forward(m2, input_ids)
        return l2.clone()

    # Sliding window check (mistral, gemma): same weights, window disabled, logits must differ.
    if fam.get("check_sliding_window"):
        l2 = variant_logits(**fam.get("no_window", dict(sliding_window=None)))
        diff = (l2 - base_logits).abs().max().item()
        # The first `window` positions see the same keys either way.
        w = cfg.sliding_window
        same_prefix = (l2[:w] - base_logits[:w]).abs().max().item()
        print(f"  sliding_window={w}: max|logits(window) - logits(no window)| = {diff:.4e} "
              f"(first {w} positions: {same_prefix:.2e})")
        assert diff > 1e-3, "sliding window NOT applied by this transformers version in eager mode"
        assert same_prefix < 1e-5

    # Softcap check (gemma2): the caps change the logits.
    if fam.get("check_softcap"):
        l2 = variant_logits(attn_logit_softcapping=None, final_logit_softcapping=None)
        l3 = variant_logits(attn_logit_softcapping=None)
        d_all = (l2 - base_logits).abs().max().item()
        d_attn = (l3 - base_logits).abs().max().item()
        print(f"  softcaps attn={cfg.attn_logit_softcapping} final={cfg.final_logit_softcapping}: "
              f"max|logits - logits(no caps)| = {d_all:.4e}, max|logits - logits(no attn cap)| = {d_attn:.4e}")
        assert d_all > 1e-1 and d_attn > 1e-2, (d_all, d_attn)

    # LongRoPE check (minicpm): the long factors (used at T > original_max_position_embeddings)
    # matter, so do the short ones when they are swapped in.
    if fam.get("check_longrope"):
        rs = copy.deepcopy(cfg.rope_scaling)
        rs["long_factor"] = list(rs["short_factor"])
        l2 = variant_logits(rope_scaling=rs)
        diff = (l2 - base_logits).abs().max().item()
        print(f"  longrope: max|logits(long factors) - logits(short factors)| = {diff:.4e}")
        assert diff > 1e-2, diff

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
    # Every target of every layer, less the k/v projections KV-sharing layers do not have (and
    # the v projections attention_k_eq_v's full layers do not have).
    n_modules = sum(
        1 for n, m in pm.named_modules() if n.rsplit(".", 1)[-1] in TARGETS and hasattr(m, "lora_A")
    )
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
    # hidden is post-final-norm: logits == head(hidden), head = hidden @ lm_head^T, followed by the
    # final softcap (gemma2), or preceded by the muP division by hidden/dim_model_base (minicpm)
    lm_w = pm.get_base_model().lm_head.weight.detach()
    head = fam.get("head", lambda h, w, c: h @ w.T)
    recon = head(hidden, lm_w, cfg.to_dict())
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
    }
    if "ref_extra" in fam:
        ref.update(fam["ref_extra"](pm.get_base_model()))
    else:
        ref["rope_inv_freq"] = pm.get_base_model().model.rotary_emb.inv_freq.detach().to(torch.float32).clone().contiguous()
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
                **(
                    {"minicpm_model": "plain-torch reference of the published modeling_minicpm.py",
                     "transformers_has_minicpm": native_minicpm_available()}
                    if fam.get("custom") else {}
                ),
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

    if fam.get("custom"):
        check_native_minicpm(d, input_ids, logits)

    if fam.get("skip_spec"):
        report(name, logits, hidden, adapter_effect, ref, g_logits, g_hidden, d, adir)
        return

    # ---- independent spec forward from the files on disk ----
    s_logits, s_hidden, s_inv, stats = spec_forward(d, input_ids)
    sd_l = (s_logits - logits).abs().max().item()
    sd_h = (s_hidden - hidden).abs().max().item()
    # relative: LongRoPE's 1/(ext*theta^x) and (1/ext)*(1/theta^x) differ in the last bit
    sd_f = max(((s_inv[k] - ref[k]).abs() / ref[k].abs()).max().item() for k in s_inv)
    print(f"  spec forward: max|dlogits| = {sd_l:.2e}  max|dhidden| = {sd_h:.2e}  "
          f"max rel|dinv_freq| = {sd_f:.2e} ({', '.join(sorted(s_inv))})")
    assert sd_l < 1e-4 and sd_h < 1e-4 and sd_f < 1e-6, (sd_l, sd_h, sd_f)
    if "rope_attention_factor" in ref:
        fa = stats["layer_rope_attention_factors"]
        print(f"  rope attention factor = {ref['rope_attention_factor'].item():.6f} (spec {fa[0]:.6f})")
        assert all(abs(x - ref["rope_attention_factor"].item()) < 1e-6 for x in fa)
    if fam.get("check_softcap"):
        ac, fc = cfg.attn_logit_softcapping, cfg.final_logit_softcapping
        n_big = int((logits.abs() > 0.5 * fc).sum())
        print(f"  softcap bite: max|scaled score| = {stats['max_abs_score']:.3f} (cap {ac}), "
              f"max|raw logit| = {stats['max_abs_raw_logit']:.3f} (cap {fc}), "
              f"{n_big} of {logits.numel()} capped logits above cap/2")
        assert stats["max_abs_score"] > 0.5 * ac, "attention softcap does not bite"
        assert stats["max_abs_raw_logit"] > 0.5 * fc and n_big > 0, "final softcap does not bite"

    report(name, logits, hidden, adapter_effect, ref, g_logits, g_hidden, d, adir)


def report(name, logits, hidden, adapter_effect, ref, g_logits, g_hidden, d, adir):
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


def check_native_minicpm(d, input_ids, logits):
    """If this transformers has a MiniCPM of its own, it must read the files the same way."""
    if not native_minicpm_available():
        print("  transformers has no native MiniCPM (transformers.models.minicpm): the reference model "
              "here is the only implementation checked")
        return
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        pm = PeftModel.from_pretrained(m, os.path.join(d, "adapter")).eval()
        with torch.no_grad():
            l2, _ = forward(pm, input_ids)
        print(f"  native transformers MiniCPM: max|logits - reference model logits| = "
              f"{(l2 - logits).abs().max().item():.3e}")
    except Exception as e:  # report, do not fail: the reference model is the published code
        print(f"  native transformers MiniCPM exists but could not be compared: {type(e).__name__}: {e}")


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
