//! Per-module LoRA ranks set from the base model (`rank_scaling`), so that an adapter can spend
//! its parameters where the base model asks for them rather than the same `rank` everywhere.
//!
//! - `by_bits`: module rank = `rank × bits / 4`, rounded half up, clamped to
//!   `[1, MAX_FACTOR × rank]`, where `bits` is the nominal width of the GGUF storage type of
//!   that module's base weight (`bits_per_weight`: the number in the type's name, not counting
//!   block scales; F16/BF16 16, F32 32). A Q4 module keeps `rank`, a Q8 one gets twice it. It
//!   needs a GGUF base: a Hugging Face folder has no per-tensor storage type to read.
//! - `by_kl`: every module of layer `l` gets `rank × clip(kl_l / median(kl), 0.5, 2)`, rounded,
//!   at least 1, from the per-layer KL file `lorafit kl` writes (`eval::kl`; read and checked by
//!   `read_kl_file`).
//!
//! The scale: without rsLoRA every module keeps the scale the base rank has, `alpha / rank`,
//! by an `alpha_pattern` entry `alpha × r / rank` beside each `rank_pattern` entry; with rsLoRA
//! the scale is rsLoRA's own `alpha / √r` with the one `alpha` (rsLoRA's rule is what makes
//! one alpha right at every rank), so no `alpha_pattern` is written. The ranks go into the PEFT
//! adapter's `rank_pattern` / `alpha_pattern`, keyed by full module name, so that every reader
//! of the adapter (`Lora::load_peft`: inference, eval, export, merge) applies the same scale.

use crate::config::{RankScaling, TrainConfig};
use crate::model::gguf::GgmlType;
use crate::model::gguf_model::{gguf_name, GgufSource};
use crate::model::lora::module_name;
use crate::model::{LoraConfig, ModelSpec, Target};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// `by_bits` ranks are at most this many times `rank` (F32 and F64 bases would ask 8× and 16×).
pub const MAX_FACTOR: usize = 4;
/// `by_kl`'s clip of `kl / median(kl)`.
pub const KL_RATIO_MIN: f64 = 0.5;
pub const KL_RATIO_MAX: f64 = 2.0;

/// The nominal bits per weight of a GGUF storage type: the width of one weight's code as the
/// type's name gives it (Q4_K → 4, Q6_K → 6, IQ2_XS → 2, TQ1_0 → 1, MXFP4 → 4), without the
/// block scales and minimums that make its effective size larger (Q4_0 stores 4.5 bits per
/// weight, Q6_K 6.56). Float types are their width. `None` for the integer types, which hold
/// no model weights.
pub fn bits_per_weight(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F64 => 64,
        F32 => 32,
        F16 | BF16 => 16,
        Q8_0 | Q8_1 | Q8_K => 8,
        Q6_K => 6,
        Q5_0 | Q5_1 | Q5_K => 5,
        Q4_0 | Q4_1 | Q4_K | IQ4_NL | IQ4_XS | MXFP4 => 4,
        Q3_K | IQ3_XXS | IQ3_S => 3,
        Q2_K | IQ2_XXS | IQ2_XS | IQ2_S | TQ2_0 => 2,
        IQ1_S | IQ1_M | TQ1_0 => 1,
        I8 | I16 | I32 | I64 => return None,
    })
}

/// `by_bits`: `rank × bits / 4` rounded half up, in `[1, MAX_FACTOR × rank]`.
pub fn rank_for_bits(rank: usize, bits: u32) -> usize {
    ((rank * bits as usize + 2) / 4).clamp(1, MAX_FACTOR * rank)
}

/// The median of `values` (the mean of the two middle ones for an even count); `values` must
/// not be empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// `clip(kl / median, 0.5, 2)`. A median of 0 (half the layers or more lose nothing to
/// quantization) makes the ratio 1 for a layer at 0 (0 / 0: no evidence either way) and the
/// upper clip for a layer above it.
pub fn kl_ratio(kl: f64, median: f64) -> f64 {
    if median > 0.0 {
        (kl / median).clamp(KL_RATIO_MIN, KL_RATIO_MAX)
    } else if kl > 0.0 {
        KL_RATIO_MAX
    } else {
        1.0
    }
}

/// `by_kl`: each layer's rank, `rank × kl_ratio(kl_l, median(kl))` rounded (half away from
/// zero), at least 1.
pub fn ranks_for_kl(rank: usize, kl: &[f64]) -> Vec<usize> {
    let m = median(kl);
    kl.iter()
        .map(|&k| ((rank as f64 * kl_ratio(k, m)).round() as usize).max(1))
        .collect()
}

/// The per-layer KL file `lorafit kl` writes (`eval::kl`) and `rank_scaling = "by_kl"` reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlFile {
    /// The quantized model, as given.
    pub model: String,
    /// The reference model, as given.
    pub reference: String,
    /// Calibration rows and the tokens (next-token distributions) the means are over.
    pub rows: usize,
    pub tokens: usize,
    pub layers: Vec<LayerKl>,
}

/// One layer's mean KL (nats per token).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerKl {
    pub layer: usize,
    pub kl: f64,
}

/// The KL per layer `0..n_layers` of a `KlFile`. Refused, naming the file and the layer: a
/// missing, repeated or out-of-range layer, a `kl` that is not a finite number ≥ 0, and a
/// layer count other than the model's.
pub fn read_kl_file(path: &Path, n_layers: usize) -> Result<Vec<f64>> {
    let p = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {p}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{p}: not a JSON file"))?;
    let Some(entries) = v.get("layers").and_then(|l| l.as_array()) else {
        bail!("{p}: field \"layers\" must be a list of {{\"layer\": N, \"kl\": X}} (as `lorafit kl` writes it)");
    };
    let mut kl: Vec<Option<f64>> = vec![None; n_layers];
    for (i, e) in entries.iter().enumerate() {
        let Some(layer) = e.get("layer").and_then(|x| x.as_u64()) else {
            bail!("{p}: layers[{i}]: field \"layer\" must be a layer index (a whole number ≥ 0)");
        };
        let layer = layer as usize;
        if layer >= n_layers {
            bail!(
                "{p}: layer {layer} is beyond the model's {n_layers} layers (the file has {} layers: it was measured on another model)",
                entries.len()
            );
        }
        let value = match e.get("kl") {
            Some(serde_json::Value::Number(n)) => n.as_f64().filter(|x| x.is_finite()),
            _ => None,
        };
        let Some(value) = value else {
            bail!(
                "{p}: layer {layer}: kl is {}, expected a finite number ≥ 0",
                e.get("kl").map_or("missing".to_string(), |x| x.to_string())
            );
        };
        if value < 0.0 {
            bail!("{p}: layer {layer}: kl = {value} is negative (a KL divergence is ≥ 0)");
        }
        if kl[layer].replace(value).is_some() {
            bail!("{p}: layer {layer} appears twice");
        }
    }
    kl.iter()
        .enumerate()
        .map(|(l, k)| {
            k.with_context(|| {
                format!(
                    "{p}: layer {l} is missing (the file has {} layers, the model {n_layers})",
                    entries.len()
                )
            })
        })
        .collect()
}

/// Per layer and target (`[l][target.index()]`), the rank `cfg.rank_scaling` gives each module
/// of `spec` that carries an adapter; `None` with `rank_scaling = "none"`. `model_path` is the
/// base model's file or folder.
pub fn module_ranks(
    cfg: &TrainConfig,
    spec: &ModelSpec,
    targets: &[Target],
    model_path: &Path,
) -> Result<Option<Vec<[Option<usize>; 7]>>> {
    let modules = |rank_of: &mut dyn FnMut(usize, Target) -> Result<usize>| {
        let mut out = vec![[None; 7]; spec.n_layers];
        for (l, row) in out.iter_mut().enumerate() {
            for &t in targets {
                if t.dims(spec, l).is_some() {
                    row[t.index()] = Some(rank_of(l, t)?);
                }
            }
        }
        Ok::<_, anyhow::Error>(out)
    };
    match cfg.rank_scaling {
        RankScaling::None => Ok(None),
        RankScaling::ByBits => {
            let is_gguf =
                model_path.is_file() && model_path.extension().is_some_and(|e| e == "gguf");
            if !is_gguf {
                bail!(
                    "rank_scaling = \"by_bits\" needs a GGUF base: each module's rank comes from the GGUF storage type of its base weight, and {} is not a .gguf file (a Hugging Face folder has no per-tensor type; use rank_scaling = \"none\" or \"by_kl\")",
                    model_path.display()
                );
            }
            let src = GgufSource::open(model_path)?;
            let ranks = modules(&mut |l, t| {
                let hf = format!("{}.weight", module_name(l, t));
                let g = gguf_name(src.arch, &hf).with_context(|| {
                    format!("rank_scaling = \"by_bits\": no GGUF name for {hf}")
                })?;
                let ty = src.file.tensor_info(&g)?.ggml_type;
                let bits = bits_per_weight(ty).with_context(|| {
                    format!(
                        "rank_scaling = \"by_bits\": {}: tensor {g} is stored as {ty}, which is not a weight type",
                        model_path.display()
                    )
                })?;
                Ok(rank_for_bits(cfg.rank, bits))
            })?;
            Ok(Some(ranks))
        }
        RankScaling::ByKl => {
            let file = cfg
                .rank_kl_file
                .as_deref()
                .context("rank_scaling = \"by_kl\" needs rank_kl_file")?;
            let kl = read_kl_file(Path::new(file), spec.n_layers)
                .context("rank_scaling = \"by_kl\" (rank_kl_file)")?;
            let per_layer = ranks_for_kl(cfg.rank, &kl);
            Ok(Some(modules(&mut |l, _| Ok(per_layer[l]))?))
        }
    }
}

/// `base` with the per-module `ranks` as its `rank_pattern` (an entry for each module whose
/// rank is not `base.rank`, keyed by full module name) and, without rsLoRA, the `alpha_pattern`
/// that keeps each such module's scale at `alpha / rank`.
pub fn with_module_ranks(mut base: LoraConfig, ranks: &[[Option<usize>; 7]]) -> LoraConfig {
    for (l, row) in ranks.iter().enumerate() {
        for t in Target::ALL {
            let Some(r) = row[t.index()].filter(|&r| r != base.rank) else {
                continue;
            };
            let name = module_name(l, t);
            if !base.rslora {
                base.alpha_pattern
                    .insert(name.clone(), base.alpha * r as f64 / base.rank as f64);
            }
            base.rank_pattern.insert(name, r);
        }
    }
    base
}

/// The adapter settings of a run: `cfg.lora_config()` with the ranks of `cfg.rank_scaling` on
/// `spec`'s modules (`model_path`: the base model's file or folder).
///
/// A `rank_pattern` key that names none of the adapted modules is refused (it would change
/// nothing), and so is an adapter with more parameters than the modules it adapts (a rank above
/// `in·out / (in + out)` on average adds parameters, not expressiveness; a huge rank would
/// otherwise end in an allocation failure).
pub fn lora_config(cfg: &TrainConfig, spec: &ModelSpec, model_path: &Path) -> Result<LoraConfig> {
    let base = cfg.lora_config()?;
    let modules: Vec<(usize, Target)> = (0..spec.n_layers)
        .flat_map(|l| base.targets.iter().map(move |&t| (l, t)))
        .filter(|&(l, t)| t.dims(spec, l).is_some())
        .collect();
    for key in cfg.rank_pattern.keys() {
        let matches = |name: &str| name == key || name.ends_with(&format!(".{key}"));
        if !modules.iter().any(|&(l, t)| matches(&module_name(l, t))) {
            let example = modules.first().map(|&(l, t)| module_name(l, t));
            bail!(
                "rank_pattern key {key:?} names none of the adapted modules (a key is a module's \
                 name or a dot-separated end of it, as PEFT matches it, e.g. {:?} or {:?})",
                example.as_deref().unwrap_or("q_proj"),
                base.targets.first().map_or("q_proj", |t| t.module())
            );
        }
    }
    let config = match module_ranks(cfg, spec, &base.targets, model_path)? {
        Some(ranks) => with_module_ranks(base, &ranks),
        None => base,
    };
    let (mut adapter, mut adapted) = (0u128, 0u128);
    for &(l, t) in &modules {
        let (i, o) = t.dims(spec, l).unwrap_or_default();
        adapter += config.resolve(l, t).0 as u128 * (i + o) as u128;
        adapted += (i * o) as u128;
    }
    if adapter > adapted {
        bail!(
            "rank {}: the adapter would hold {adapter} parameters, more than the {adapted} of the \
             modules it adapts; a rank above in·out / (in + out) of a module adds parameters \
             and nothing it can express (ranks of 8 to 256 are usual)",
            cfg.rank
        );
    }
    Ok(config)
}

/// plan.toml's comment lines on the resolved ranks (none with `rank_scaling = "none"`): one
/// line per target, its rank in each layer (`-` where the layer has no such projection).
pub fn summary(cfg: &TrainConfig, lora: &LoraConfig, spec: &ModelSpec) -> Vec<String> {
    if cfg.rank_scaling == RankScaling::None {
        return Vec::new();
    }
    let scale = if lora.rslora {
        "rsLoRA scale alpha / sqrt(r) per module".to_string()
    } else {
        format!(
            "scale alpha / rank = {} on every module",
            lora.alpha / lora.rank as f64
        )
    };
    let mut lines = vec![format!(
        "rank_scaling {}: LoRA rank per layer 0..{} ({scale})",
        cfg.rank_scaling.name(),
        spec.n_layers.saturating_sub(1)
    )];
    for &t in &lora.targets {
        let ranks: Vec<String> = (0..spec.n_layers)
            .map(|l| match t.dims(spec, l) {
                Some(_) => lora.resolve(l, t).0.to_string(),
                None => "-".to_string(),
            })
            .collect();
        lines.push(format!("  {}: {}", t.module(), ranks.join(" ")));
    }
    lines
}

/// The modules of `spec` whose rank or scale differ between two adapter settings (`have`: an
/// adapter on disk, `want`: the run's settings), each named with both; at most `limit` named,
/// then a count of the rest.
pub fn module_differences(
    have: &LoraConfig,
    want: &LoraConfig,
    spec: &ModelSpec,
    limit: usize,
) -> Vec<String> {
    let mut diffs = Vec::new();
    let mut more = 0;
    for l in 0..spec.n_layers {
        for t in Target::ALL {
            let carried = |c: &LoraConfig| c.targets.contains(&t) && t.dims(spec, l).is_some();
            if !carried(have) || !carried(want) {
                continue;
            }
            let (a, b) = (have.resolve(l, t), want.resolve(l, t));
            if a == b {
                continue;
            }
            if diffs.len() < limit {
                diffs.push(format!(
                    "{}: adapter rank {} (scale {}), settings rank {} (scale {})",
                    module_name(l, t),
                    a.0,
                    a.1,
                    b.0,
                    b.1
                ));
            } else {
                more += 1;
            }
        }
    }
    if more > 0 {
        diffs.push(format!("… and {more} more modules"));
    }
    diffs
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn pattern_summary<T: std::fmt::Display>(map: &BTreeMap<String, T>) -> String {
        map.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    #[test]
    fn bits_give_ranks_in_proportion_clamped() {
        let bits = |t| bits_per_weight(t).unwrap();
        assert_eq!(bits(GgmlType::Q4_0), 4);
        assert_eq!(bits(GgmlType::Q4_1), 4);
        assert_eq!(bits(GgmlType::Q4_K), 4);
        assert_eq!(bits(GgmlType::Q5_K), 5);
        assert_eq!(bits(GgmlType::Q6_K), 6);
        assert_eq!(bits(GgmlType::Q8_0), 8);
        assert_eq!(bits(GgmlType::F16), 16);
        assert_eq!(bits(GgmlType::BF16), 16);
        assert_eq!(bits(GgmlType::F32), 32);
        assert_eq!(bits_per_weight(GgmlType::I32), None);
        assert_eq!(rank_for_bits(8, 4), 8);
        assert_eq!(rank_for_bits(8, 5), 10);
        assert_eq!(rank_for_bits(8, 6), 12);
        assert_eq!(rank_for_bits(8, 8), 16);
        assert_eq!(rank_for_bits(8, 16), 32);
        // F32 would be 8 × rank: clamped to 4 ×.
        assert_eq!(rank_for_bits(8, 32), 32);
        // Rounded half up, never below 1.
        assert_eq!(rank_for_bits(3, 5), 4); // 3.75
        assert_eq!(rank_for_bits(2, 3), 2); // 1.5
        assert_eq!(rank_for_bits(1, 2), 1); // 0.5
        assert_eq!(rank_for_bits(1, 1), 1); // 0.25
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[5.0]), 5.0);
        assert_eq!(median(&[0.0, 0.0, 1.0, 7.0]), 0.5);
    }

    #[test]
    fn kl_ranks_follow_the_clipped_ratio_to_the_median() {
        // Even count: median (0.2 + 0.4) / 2 = 0.3; ratios 1/3 → 0.5, 2/3, 4/3, 10/3 → 2.
        assert_eq!(ranks_for_kl(6, &[0.1, 0.2, 0.4, 1.0]), vec![3, 4, 8, 12]);
        // Odd count: median 0.2; ratios 0.5, 1, 1.5.
        assert_eq!(ranks_for_kl(8, &[0.1, 0.2, 0.3]), vec![4, 8, 12]);
        // All equal: every layer keeps the rank.
        assert_eq!(ranks_for_kl(16, &[0.7; 5]), vec![16; 5]);
        // All zero (a model against itself): the rank everywhere.
        assert_eq!(ranks_for_kl(16, &[0.0; 4]), vec![16; 4]);
        // A zero median: layers at 0 keep the rank, layers above it get the upper clip.
        assert_eq!(ranks_for_kl(4, &[0.0, 0.0, 0.0, 0.5]), vec![4, 4, 4, 8]);
        // A zero layer beside a positive median gets the lower clip.
        assert_eq!(ranks_for_kl(4, &[0.0, 1.0, 1.0]), vec![2, 4, 4]);
        // Never below 1: rank 1 × 0.5 rounds to 1.
        assert_eq!(ranks_for_kl(1, &[0.01, 1.0, 1.0]), vec![1, 1, 1]);
        assert_eq!(kl_ratio(3.0, 1.0), 2.0);
        assert_eq!(kl_ratio(0.1, 1.0), 0.5);
        assert_eq!(kl_ratio(1.5, 1.0), 1.5);
    }

    fn kl_file(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn bad_kl_files_are_refused_naming_file_and_layer() {
        let dir = std::env::temp_dir().join(format!("lorafit-klfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = KlFile {
            model: "q.gguf".into(),
            reference: "f".into(),
            rows: 2,
            tokens: 10,
            layers: vec![LayerKl { layer: 0, kl: 0.5 }, LayerKl { layer: 1, kl: 0.0 }],
        };
        let p = kl_file(&dir, "good.json", &serde_json::to_string(&good).unwrap());
        assert_eq!(read_kl_file(&p, 2).unwrap(), vec![0.5, 0.0]);
        let cases = [
            (
                "missing.json",
                r#"{"layers":[{"layer":0,"kl":0.1},{"layer":2,"kl":0.1},{"layer":3,"kl":0.1}]}"#,
                4,
                "layer 1 is missing",
            ),
            (
                "short.json",
                r#"{"layers":[{"layer":0,"kl":0.1}]}"#,
                2,
                "layer 1 is missing",
            ),
            (
                "long.json",
                r#"{"layers":[{"layer":0,"kl":0.1},{"layer":1,"kl":0.1},{"layer":2,"kl":0.1}]}"#,
                2,
                "layer 2 is beyond the model's 2 layers",
            ),
            (
                "null.json",
                r#"{"layers":[{"layer":0,"kl":0.1},{"layer":1,"kl":null}]}"#,
                2,
                "layer 1: kl is null",
            ),
            (
                "text.json",
                r#"{"layers":[{"layer":0,"kl":"NaN"},{"layer":1,"kl":0.1}]}"#,
                2,
                "layer 0: kl is \"NaN\"",
            ),
            (
                "negative.json",
                r#"{"layers":[{"layer":0,"kl":0.1},{"layer":1,"kl":-0.25}]}"#,
                2,
                "layer 1: kl = -0.25 is negative",
            ),
            (
                "twice.json",
                r#"{"layers":[{"layer":1,"kl":0.1},{"layer":1,"kl":0.2}]}"#,
                2,
                "layer 1 appears twice",
            ),
            ("no_layers.json", r#"{"model":"q"}"#, 2, "field \"layers\""),
        ];
        for (name, body, n, want) in cases {
            let p = kl_file(&dir, name, body);
            let e = format!("{:#}", read_kl_file(&p, n).unwrap_err());
            assert!(e.contains(name) && e.contains(want), "{name}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn module_ranks_keep_the_scale_or_follow_rslora() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}"#,
        )
        .unwrap();
        let mut ranks = vec![[Some(8); 7]; 2];
        ranks[0][Target::Q.index()] = Some(16);
        ranks[1][Target::Down.index()] = Some(4);
        let base = LoraConfig {
            rank: 8,
            alpha: 16.0,
            ..LoraConfig::default()
        };
        let c = with_module_ranks(base.clone(), &ranks);
        assert_eq!(
            pattern_summary(&c.rank_pattern),
            "model.layers.0.self_attn.q_proj=16, model.layers.1.mlp.down_proj=4"
        );
        assert_eq!(
            pattern_summary(&c.alpha_pattern),
            "model.layers.0.self_attn.q_proj=32, model.layers.1.mlp.down_proj=8"
        );
        for (l, row) in ranks.iter().enumerate() {
            for t in Target::ALL {
                let (r, scale) = c.resolve(l, t);
                assert_eq!(Some(r), row[t.index()]);
                assert_eq!(scale, 2.0, "layer {l} {t:?}");
            }
        }
        // rsLoRA: the one alpha, the scale alpha / sqrt(r).
        let rs = with_module_ranks(
            LoraConfig {
                rslora: true,
                ..base.clone()
            },
            &ranks,
        );
        assert!(rs.alpha_pattern.is_empty());
        assert_eq!(rs.resolve(0, Target::Q), (16, 4.0));
        assert_eq!(rs.resolve(1, Target::Down), (4, 8.0));
        let diffs = module_differences(&base, &c, &spec, 1);
        assert_eq!(diffs.len(), 2, "{diffs:?}");
        assert!(
            diffs[0].contains("model.layers.0.self_attn.q_proj")
                && diffs[0].contains("adapter rank 8")
                && diffs[0].contains("settings rank 16"),
            "{diffs:?}"
        );
        assert_eq!(diffs[1], "… and 1 more modules");
        assert!(module_differences(&c, &c, &spec, 5).is_empty());
    }
}
