//! GGUF artefacts: the LoRA adapter in llama.cpp's adapter format, its reader (so that
//! `--check` and the tests read the file back through lorafit's own GGUF reader), and the
//! merged GGUF of a GGUF base.
//!
//! llama.cpp's adapter format (`convert_lora_to_gguf.py` writes it, `llama-adapter.cpp` reads
//! it): `general.type = "adapter"`, `general.architecture` equal to the base model's,
//! `adapter.type = "lora"`, `adapter.lora.alpha` (f32); for each adapted base tensor `NAME`
//! (e.g. `blk.3.attn_q.weight`) the pair `NAME.lora_a` with GGUF dims `[in, r]` (PyTorch
//! `[r, in]`, PEFT's A as stored) and `NAME.lora_b` with dims `[r, out]` (PEFT's B). llama.cpp
//! checks `a.ne[0] == W.ne[0]`, `b.ne[1] == W.ne[1]`, `a.ne[1] == b.ne[0]`, and scales each
//! pair by `alpha / r` with `r = a.ne[1]`. For architectures whose converter permutes q and k
//! rows (`llama`, `minicpm`), the converter applies the same permutation to B's rows (A is
//! untouched: `LoraTorchTensor.permute` moves B only), so this writer does too.
//!
//! A lorafit adapter whose scale is not `alpha / r` (rsLoRA, `alpha_pattern`) is written with
//! the ratio folded into B, so that llama.cpp's `alpha / r` gives the trained scale exactly.

use super::gguf_writer::{GgufTensor, GgufWriter};
use super::merge::{gguf_delta, permuted_heads};
use super::quantize::{can_quantize, quantize};
use crate::model::gguf::{unpermute_qk_rows, GgmlType, GgufFile, MetaValue};
use crate::model::gguf_model::{gguf_name, GgufArch, GgufSource};
use crate::model::lora::{module_name, LoraPair};
use crate::model::{Family, Lora, LoraConfig, ModelSpec, Target};
use crate::tensor::Device;
use anyhow::{bail, ensure, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Element type of the adapter's tensors (`convert_lora_to_gguf.py --outtype`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterType {
    F32,
    F16,
}

impl AdapterType {
    fn ggml(self) -> GgmlType {
        match self {
            AdapterType::F32 => GgmlType::F32,
            AdapterType::F16 => GgmlType::F16,
        }
    }
}

/// How the merged GGUF stores the tensors the adapter changed.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum MergedType {
    /// Requantized to each tensor's own type.
    Keep,
    /// Written as f16.
    F16,
}

/// llama.cpp's architecture name for a model of `spec`, and whether its converter permutes
/// q/k rows (`LlamaModel.permute`). Mistral and SmolLM are `llama` to llama.cpp; Qwen 2/3 and
/// Gemma rotate NeoX-style and are not permuted. Gemma 4 is refused: its llama.cpp tensor
/// layout (KV-sharing layers, per-layer inputs) has not been checked here.
pub fn llama_cpp_arch(spec: &ModelSpec) -> Result<(&'static str, bool)> {
    Ok(match spec.family {
        Family::Llama | Family::Mistral => ("llama", true),
        Family::MiniCpm => ("minicpm", true),
        Family::Qwen2 => ("qwen2", false),
        Family::Qwen3 => ("qwen3", false),
        Family::Gemma2 => ("gemma2", false),
        Family::Gemma3 => ("gemma3", false),
        Family::Gemma4 => bail!(
            "a GGUF adapter for Gemma 4 is not written: its llama.cpp layout is not checked \
             here (export --format hf writes the merged folder)"
        ),
    })
}

/// GGUF name of a projection's weight (the same in every architecture lorafit reads).
pub fn projection_name(layer: usize, t: Target) -> String {
    gguf_name(
        GgufArch::Llama,
        &format!("model.layers.{layer}.{}.weight", t.path()),
    )
    .expect("every projection has a GGUF name")
}

fn encode(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    quantize(ty, x)
}

/// Writes `lora` as a llama.cpp LoRA adapter for a base of architecture `arch`.
pub fn write_adapter(
    lora: &Lora,
    spec: &ModelSpec,
    arch: &str,
    permutes: bool,
    ty: AdapterType,
    path: &Path,
) -> Result<usize> {
    let alpha = lora.config.alpha as f32;
    ensure!(
        alpha > 0.0,
        "adapter alpha {alpha} must be positive for llama.cpp's alpha / r scale"
    );
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", arch);
    w.set_str("general.type", "adapter");
    w.set_str("general.name", "lorafit LoRA adapter");
    w.set_str("adapter.type", "lora");
    w.set("adapter.lora.alpha", MetaValue::F32(alpha));
    let mut n = 0;
    for (l, t, pair) in lora.pairs() {
        let (out, inp) = (pair.b.shape()[0], pair.a.shape()[1]);
        let r = pair.rank;
        let a = pair.a.to_vec()?;
        let mut b = pair.b.to_vec()?;
        // llama.cpp scales by alpha / r: fold any other trained scale into B.
        let ratio = pair.scale / (alpha / r as f32);
        if ratio != 1.0 {
            b.iter_mut().for_each(|x| *x *= ratio);
        }
        if let (true, Some(n_head)) = (permutes, permuted_heads(spec, t)) {
            super::super::model::gguf::permute_qk_rows(&mut b, out, r, n_head)
                .with_context(|| format!("{}: permuting B", module_name(l, t)))?;
        }
        let name = projection_name(l, t);
        w.add_tensor(GgufTensor {
            name: format!("{name}.lora_a"),
            dims: vec![inp, r],
            ggml_type: ty.ggml(),
            data: encode(ty.ggml(), &a)?,
        })?;
        w.add_tensor(GgufTensor {
            name: format!("{name}.lora_b"),
            dims: vec![r, out],
            ggml_type: ty.ggml(),
            data: encode(ty.ggml(), &b)?,
        })?;
        n += 1;
    }
    ensure!(n > 0, "the adapter has no LoRA pairs to write");
    w.write(path)?;
    Ok(n)
}

/// The target and layer of a GGUF projection name (`blk.N.attn_q.weight`).
fn parse_projection(name: &str) -> Option<(usize, Target)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, _) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    Target::ALL
        .into_iter()
        .find(|&t| projection_name(layer, t) == name)
        .map(|t| (layer, t))
}

/// Reads a llama.cpp LoRA adapter back as a lorafit `Lora` on `spec`'s layers, with llama.cpp's
/// semantics: scale `alpha / r` per pair, B's q/k rows un-permuted when `permutes`. Errors name
/// the file and tensor.
pub fn read_adapter(path: &Path, spec: &ModelSpec, permutes: bool) -> Result<Lora> {
    let g = GgufFile::open(path)?;
    let p = path.display();
    ensure!(
        g.get_str("general.type")? == "adapter",
        "{p}: general.type is not \"adapter\""
    );
    ensure!(
        g.get_str("adapter.type")? == "lora",
        "{p}: adapter.type is not \"lora\""
    );
    let alpha = match g.get("adapter.lora.alpha") {
        Some(MetaValue::F32(a)) => *a as f64,
        Some(v) => bail!(
            "{p}: adapter.lora.alpha is {}, llama.cpp reads an f32",
            v.type_name()
        ),
        None => bail!("{p}: adapter.lora.alpha is missing"),
    };
    // (A, B, rank) per adapted projection, as the file stores them.
    type FilePair = (Vec<f32>, Vec<f32>, usize);
    let mut pairs: BTreeMap<(usize, Target), FilePair> = BTreeMap::new();
    for info in g.tensor_infos() {
        let (base, is_a) = if let Some(b) = info.name.strip_suffix(".lora_a") {
            (b, true)
        } else if let Some(b) = info.name.strip_suffix(".lora_b") {
            (b, false)
        } else {
            bail!("{p}: tensor {} is neither .lora_a nor .lora_b", info.name);
        };
        let Some((l, t)) = parse_projection(base).filter(|(l, _)| *l < spec.n_layers) else {
            bail!(
                "{p}: tensor {} adapts no projection of this model",
                info.name
            );
        };
        ensure!(
            info.shape.len() == 2,
            "{p}: tensor {} has dims {:?}, expected 2",
            info.name,
            info.shape
        );
        let Some((out, inp)) = t.dims(spec, l) else {
            bail!(
                "{p}: tensor {}: layer {l} of this model has no {} projection",
                info.name,
                t.module()
            );
        };
        let data = g.tensor_f32(&info.name)?;
        let entry = pairs.entry((l, t)).or_insert((Vec::new(), Vec::new(), 0));
        if is_a {
            ensure!(
                info.shape[0] == inp,
                "{p}: tensor {} has dims {:?}, its base tensor has {inp} inputs",
                info.name,
                info.shape
            );
            entry.0 = data;
            entry.2 = info.shape[1];
        } else {
            ensure!(
                info.shape[1] == out,
                "{p}: tensor {} has dims {:?}, its base tensor has {out} outputs",
                info.name,
                info.shape
            );
            entry.1 = data;
        }
    }
    ensure!(!pairs.is_empty(), "{p}: no LoRA tensors");
    let mut rank_pattern = BTreeMap::new();
    let mut targets: Vec<Target> = Vec::new();
    for (&(l, t), (a, b, r)) in &pairs {
        ensure!(
            !a.is_empty() && !b.is_empty(),
            "{p}: {} has only one of lora_a and lora_b",
            projection_name(l, t)
        );
        ensure!(
            *r > 0 && Some(b.len()) == t.dims(spec, l).map(|d| d.0 * r),
            "{p}: {}: lora_a's rank {r} does not match lora_b (llama.cpp: \"lora_a tensor is \
             not transposed\")",
            projection_name(l, t)
        );
        rank_pattern.insert(module_name(l, t), *r);
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    targets.sort();
    let config = LoraConfig {
        rank: pairs.values().next().map(|v| v.2).unwrap_or(1),
        alpha,
        targets,
        rank_pattern,
        ..LoraConfig::default()
    };
    // Start from a fresh adapter of the right shapes, then put the file's pairs in; a layer the
    // file does not adapt keeps B = 0 (no change), as in llama.cpp.
    let mut lora = Lora::new(spec, config, &Device::Cpu)?;
    for l in 0..spec.n_layers {
        for t in Target::ALL {
            let Some(slot) = lora.get_mut(l, t) else {
                continue;
            };
            let Some((out, inp)) = t.dims(spec, l) else {
                continue;
            };
            let (r, scale) = (slot.rank, slot.scale);
            let (a, mut b) = match pairs.get(&(l, t)) {
                Some((a, b, _)) => (a.clone(), b.clone()),
                None => (vec![0.0; r * inp], vec![0.0; out * r]),
            };
            if let (true, Some(n_head)) = (permutes, permuted_heads(spec, t)) {
                unpermute_qk_rows(&mut b, out, r, n_head)
                    .with_context(|| format!("{p}: {}", projection_name(l, t)))?;
            }
            *slot = LoraPair::from_host(&a, &b, r, out, inp, scale, &Device::Cpu)?;
        }
    }
    lora.refresh_compute_copies()?;
    Ok(lora)
}

/// llama.cpp's `general.file_type` of a file whose weights are mostly f16.
pub const LLAMA_FTYPE_MOSTLY_F16: u32 = 1;

/// What the merged GGUF changed: per merged tensor, its name, stored type and the relative
/// RMS error its encoding added to the merged f32 values.
pub struct MergedGgufSummary {
    pub merged: Vec<(String, GgmlType, f64)>,
    pub tensors: usize,
    /// How many of `merged` are stored with other bytes than the base's: fewer where
    /// requantizing rounded the merged weights back to the base's values.
    pub changed: usize,
}

/// Writes the merged GGUF of a GGUF base: every metadata key and untouched tensor copied as
/// they are (but `tokenizer.chat_template`, which `chat_template` replaces when given), each
/// adapted projection dequantized, merged in the file's own row order, and requantized to its
/// type (or f16).
pub fn write_merged_gguf(
    base: &Path,
    lora: &Lora,
    merged_type: MergedType,
    chat_template: Option<&str>,
    path: &Path,
) -> Result<MergedGgufSummary> {
    ensure!(
        base != path,
        "the output {} is the base model",
        path.display()
    );
    let src = GgufSource::open(base)?;
    let spec = &src.spec;
    let permutes = src.arch.permutes_qk();
    let mut targets: HashMap<String, (usize, Target)> = HashMap::new();
    for (l, t, _) in lora.pairs() {
        targets.insert(projection_name(l, t), (l, t));
    }
    let mut w = GgufWriter::new();
    for (k, v) in src.file.metadata() {
        w.set(k, v.clone());
    }
    if let Some(t) = chat_template {
        w.set_str("tokenizer.chat_template", t);
    }
    let mut merged = Vec::new();
    let mut changed = 0;
    for info in src.file.tensor_infos() {
        let raw = src.file.tensor_bytes(&info.name)?;
        let change = match targets.get(&info.name) {
            Some(&(l, t)) => {
                let pair = lora.get(l, t).expect("named from the adapter's pairs");
                let delta = gguf_delta(pair, spec, t, permutes)?;
                // A pair whose product is zero (a fresh adapter's B) changes nothing: keep the
                // stored bytes rather than requantize them.
                delta.iter().any(|&d| d != 0.0).then_some(delta)
            }
            None => None,
        };
        let Some(delta) = change else {
            w.add_tensor(GgufTensor {
                name: info.name.clone(),
                dims: info.shape.clone(),
                ggml_type: info.ggml_type,
                data: raw.to_vec(),
            })?;
            continue;
        };
        let mut values = src.file.tensor_f32(&info.name)?;
        super::merge::add_delta(&mut values, &delta, &info.name)?;
        let ty = match merged_type {
            MergedType::F16 => GgmlType::F16,
            MergedType::Keep if can_quantize(info.ggml_type) => info.ggml_type,
            MergedType::Keep => bail!(
                "{}: tensor {} is {}, which lorafit cannot requantize; export with \
                 --merged-type f16",
                base.display(),
                info.name,
                info.ggml_type
            ),
        };
        let bytes = quantize(ty, &values)?;
        let mut back = vec![0f32; values.len()];
        crate::model::gguf::dequantize(ty, &bytes, values.len(), &mut back)?;
        let (num, den) = values
            .iter()
            .zip(&back)
            .fold((0f64, 0f64), |(n, d), (v, b)| {
                let e = (*v - *b) as f64;
                (n + e * e, d + (*v as f64) * (*v as f64))
            });
        merged.push((
            info.name.clone(),
            ty,
            if den > 0.0 { (num / den).sqrt() } else { 0.0 },
        ));
        if ty != info.ggml_type || bytes != raw {
            changed += 1;
        }
        w.add_tensor(GgufTensor {
            name: info.name.clone(),
            dims: info.shape.clone(),
            ggml_type: ty,
            data: bytes,
        })?;
    }
    // The projections are most of the weights: with them in f16 the file is "mostly F16"
    // (llama_ftype 1), not the base's type, whatever the embeddings and norms keep.
    if merged_type == MergedType::F16 && !merged.is_empty() {
        let ftype = match src.file.get("general.file_type") {
            Some(MetaValue::I32(_)) => MetaValue::I32(LLAMA_FTYPE_MOSTLY_F16 as i32),
            _ => MetaValue::U32(LLAMA_FTYPE_MOSTLY_F16),
        };
        w.set("general.file_type", ftype);
    }
    let tensors = src.file.tensor_infos().len();
    w.write(path)?;
    Ok(MergedGgufSummary {
        merged,
        tensors,
        changed,
    })
}
