//! LoRA adapters: which projections get one, their rank and scale, PEFT's initialisation, and the
//! PEFT on-disk format (`adapter_config.json` + `adapter_model.safetensors`) in both directions.
//!
//! A LoRA pair adds `scale · B A x` to a frozen projection `W x`: A is `[r, in]`, B is `[out, r]`,
//! `scale = alpha / r` (or `alpha / sqrt(r)` with rsLoRA). Masters and gradients are f32 on every
//! device; the CUDA forward reads bf16 copies refreshed after each optimiser step.

use crate::tensor::{DType, Device, Tensor};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use super::config::ModelSpec;

/// The seven projections of a Llama-family layer that can carry an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    pub fn index(self) -> usize {
        self as usize
    }
    /// Hugging Face module name, e.g. `q_proj`.
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }
    /// Path inside a decoder layer, e.g. `self_attn.q_proj`.
    pub fn path(self) -> String {
        let parent = match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            _ => "mlp",
        };
        format!("{parent}.{}", self.module())
    }
    pub fn parse(s: &str) -> Result<Target> {
        let s = s.trim();
        let s = s.strip_suffix("_proj").unwrap_or(s);
        Ok(match s {
            "q" => Target::Q,
            "k" => Target::K,
            "v" => Target::V,
            "o" => Target::O,
            "gate" => Target::Gate,
            "up" => Target::Up,
            "down" => Target::Down,
            _ => bail!("unknown LoRA target {s:?}: expected q, k, v, o, gate, up or down (with or without _proj)"),
        })
    }
    /// `(out_features, in_features)` of this projection in layer `l`; `None` where the layer
    /// has no such projection (a KV-sharing layer's k and v, v under `k_eq_v`), which then
    /// carries no adapter, as PEFT finds no module to wrap there.
    pub fn dims(self, spec: &ModelSpec, l: usize) -> Option<(usize, usize)> {
        let ls = &spec.layers[l];
        let (q, kv) = (spec.q_dim_of(l), spec.kv_dim_of(l));
        Some(match self {
            Target::Q => (q, spec.hidden),
            Target::K if ls.owns_kv() => (kv, spec.hidden),
            Target::V if ls.owns_kv() && !ls.k_eq_v => (kv, spec.hidden),
            Target::K | Target::V => return None,
            Target::O => (spec.hidden, q),
            Target::Gate | Target::Up => (ls.intermediate, spec.hidden),
            Target::Down => (spec.hidden, ls.intermediate),
        })
    }
}

/// Adapter hyperparameters, saved as PEFT's `adapter_config.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<Target>,
    pub rslora: bool,
    /// Per-module rank overrides keyed by a module name or a suffix of it (PEFT's `rank_pattern`),
    /// e.g. `model.layers.3.mlp.down_proj` or `down_proj`.
    pub rank_pattern: BTreeMap<String, usize>,
    pub alpha_pattern: BTreeMap<String, f64>,
    pub dropout: f32,
    pub seed: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 16,
            alpha: 32.0,
            targets: Target::ALL.to_vec(),
            rslora: false,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            dropout: 0.0,
            seed: 0,
        }
    }
}

fn pattern_lookup<T: Copy>(map: &BTreeMap<String, T>, name: &str) -> Option<T> {
    map.iter()
        .find(|(k, _)| pattern_matches(k, name))
        .map(|(_, v)| *v)
}

/// Whether a `rank_pattern` / `alpha_pattern` key applies to module `name`, as PEFT decides it
/// (`re.match(rf"(.*\.)?({key})$", name)`): the key, a regular expression, matches the whole
/// name or a part of it after a dot. A key that is not an expression the `regex` crate reads
/// (look-arounds, back-references; `load_peft` refuses those) is taken as a plain name.
pub fn pattern_matches(key: &str, name: &str) -> bool {
    match pattern_regex(key) {
        Ok(re) => re.is_match(name),
        Err(_) => name == key || name.ends_with(&format!(".{key}")),
    }
}

/// PEFT's full-name expression for a pattern key.
fn pattern_regex(key: &str) -> Result<regex::Regex, regex::Error> {
    regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
}

impl LoraConfig {
    /// Rank and scale of one module.
    pub fn resolve(&self, layer: usize, t: Target) -> (usize, f32) {
        let name = module_name(layer, t);
        let r = pattern_lookup(&self.rank_pattern, &name).unwrap_or(self.rank);
        let alpha = pattern_lookup(&self.alpha_pattern, &name).unwrap_or(self.alpha);
        let scale = if self.rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        };
        (r, scale as f32)
    }
}

pub fn module_name(layer: usize, t: Target) -> String {
    format!("model.layers.{layer}.{}", t.path())
}

/// PEFT's safetensors key of one LoRA matrix.
pub fn peft_key(layer: usize, t: Target, b: bool) -> String {
    format!(
        "base_model.model.{}.lora_{}.weight",
        module_name(layer, t),
        if b { "B" } else { "A" }
    )
}

/// One adapter: A `[r, in]`, B `[out, r]`, their gradients and the compute-dtype copies.
pub struct LoraPair {
    pub rank: usize,
    pub scale: f32,
    pub a: Tensor,
    pub b: Tensor,
    pub grad_a: Tensor,
    pub grad_b: Tensor,
    a_compute: Option<Tensor>,
    b_compute: Option<Tensor>,
    /// Which values A and B hold, unique in the process: drawn anew by
    /// `Lora::refresh_stacked`, which runs after every change of them, so that a weight holding
    /// a copy of `scale · B` (`weights::ExtendedWeight`) knows whether it is current.
    generation: u64,
}

/// The last `LoraPair::generation` drawn.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn next_generation() -> u64 {
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

impl LoraPair {
    /// Which values A and B hold (a new number after every change, `Lora::refresh_stacked`).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// A and B in the device's compute dtype (the f32 masters on the CPU).
    pub fn a(&self) -> &Tensor {
        self.a_compute.as_ref().unwrap_or(&self.a)
    }
    pub fn b(&self) -> &Tensor {
        self.b_compute.as_ref().unwrap_or(&self.b)
    }

    /// `a()` beside A's gradient, mutable: for a kernel that reads one and adds into the other.
    pub fn a_with_grad(&mut self) -> (&Tensor, &mut Tensor) {
        (self.a_compute.as_ref().unwrap_or(&self.a), &mut self.grad_a)
    }

    /// (master, gradient, compute copy) of A and of B, for an optimiser that updates all three
    /// in one pass.
    pub fn update_parts(&mut self) -> [(&mut Tensor, &mut Tensor, Option<&mut Tensor>); 2] {
        [
            (&mut self.a, &mut self.grad_a, self.a_compute.as_mut()),
            (&mut self.b, &mut self.grad_b, self.b_compute.as_mut()),
        ]
    }
}

/// Projections of a layer that read the same input. Their A matrices are also kept stacked
/// (`Lora::stacked`), so that the forward's `x Aᵀ` and the backward's `dxa A` of the whole group
/// run as one GEMM each, reading the input once.
pub const SHARED_INPUT: [&[Target]; 2] = [
    &[Target::Q, Target::K, Target::V],
    &[Target::Gate, Target::Up],
];
/// Indices into `SHARED_INPUT`.
pub const GROUP_QKV: usize = 0;
pub const GROUP_GATE_UP: usize = 1;

/// The A matrices of one `SHARED_INPUT` group stacked in its order, `[Σ r, in]`, in the compute
/// dtype, with the (target, rank) of each block of rows.
pub struct StackedA {
    pub a: Tensor,
    pub members: Vec<(Target, usize)>,
}

/// Each member's columns in a stacked product: the members' ranks laid end to end, in order.
pub fn stacked_columns(
    members: &[(Target, usize)],
) -> impl Iterator<Item = (Target, std::ops::Range<usize>)> + '_ {
    members.iter().scan(0, |c0, &(t, r)| {
        let cols = *c0..*c0 + r;
        *c0 += r;
        Some((t, cols))
    })
}

/// All adapters of a model: `layers[l][target.index()]`.
pub struct Lora {
    pub config: LoraConfig,
    pub layers: Vec<[Option<LoraPair>; 7]>,
    pub device: Device,
    /// Per layer and `SHARED_INPUT` group with two or more adapters: their stacked A.
    stacked: Vec<[Option<StackedA>; 2]>,
}

impl Lora {
    /// Fresh adapters with PEFT's initialisation: B = 0, A ~ Kaiming-uniform with a = √5, i.e.
    /// U(−1/√in, 1/√in).
    pub fn new(spec: &ModelSpec, config: LoraConfig, device: &Device) -> Result<Lora> {
        ensure!(config.rank > 0, "LoRA rank must be positive");
        let mut rng = crate::tensor::Rng(config.seed ^ 0x5EED_1077_AF17_0000);
        let mut layers = Vec::with_capacity(spec.n_layers);
        for l in 0..spec.n_layers {
            let mut row: [Option<LoraPair>; 7] = Default::default();
            for &t in &config.targets {
                let (r, scale) = config.resolve(l, t);
                let Some((out, inp)) = t.dims(spec, l) else {
                    continue;
                };
                let bound = 1.0 / (inp as f64).sqrt();
                let a: Vec<f32> = (0..r * inp)
                    .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                    .collect();
                let b = vec![0f32; out * r];
                row[t.index()] = Some(LoraPair::from_host(&a, &b, r, out, inp, scale, device)?);
            }
            layers.push(row);
        }
        let mut lora = Lora {
            config,
            layers,
            device: device.clone(),
            stacked: Vec::new(),
        };
        lora.refresh_compute_copies()?;
        Ok(lora)
    }

    pub fn pairs(&self) -> impl Iterator<Item = (usize, Target, &LoraPair)> {
        self.layers.iter().enumerate().flat_map(|(l, row)| {
            Target::ALL
                .iter()
                .filter_map(move |&t| row[t.index()].as_ref().map(|p| (l, t, p)))
        })
    }
    pub fn pairs_mut(&mut self) -> impl Iterator<Item = (usize, Target, &mut LoraPair)> {
        self.layers.iter_mut().enumerate().flat_map(|(l, row)| {
            row.iter_mut()
                .enumerate()
                .filter_map(move |(i, p)| p.as_mut().map(|p| (l, Target::ALL[i], p)))
        })
    }
    pub fn get(&self, layer: usize, t: Target) -> Option<&LoraPair> {
        self.layers[layer][t.index()].as_ref()
    }
    pub fn get_mut(&mut self, layer: usize, t: Target) -> Option<&mut LoraPair> {
        self.layers[layer][t.index()].as_mut()
    }
    /// The stacked A of `SHARED_INPUT[group]` in `layer`, when two or more of its projections
    /// carry adapters.
    pub fn stacked(&self, layer: usize, group: usize) -> Option<&StackedA> {
        self.stacked.get(layer).and_then(|g| g[group].as_ref())
    }

    /// Re-stacks every group's A from the compute copies (after an update or any change of A
    /// or B), and marks every pair's values as new (`LoraPair::generation`).
    pub fn refresh_stacked(&mut self) -> Result<()> {
        let generation = next_generation();
        for (_, _, p) in self.pairs_mut() {
            p.generation = generation;
        }
        let mut stacked = Vec::with_capacity(self.layers.len());
        for row in &self.layers {
            let mut groups: [Option<StackedA>; 2] = Default::default();
            for (g, targets) in SHARED_INPUT.iter().enumerate() {
                let pairs: Vec<(Target, &LoraPair)> = targets
                    .iter()
                    .filter_map(|&t| row[t.index()].as_ref().map(|p| (t, p)))
                    .collect();
                if pairs.len() < 2 {
                    continue;
                }
                let blocks: Vec<&Tensor> = pairs.iter().map(|(_, p)| p.a()).collect();
                groups[g] = Some(StackedA {
                    a: crate::tensor::concat_rows(&blocks)?,
                    members: pairs.iter().map(|(t, p)| (*t, p.rank)).collect(),
                });
            }
            stacked.push(groups);
        }
        self.stacked = stacked;
        Ok(())
    }

    /// Number of trainable parameters.
    pub fn num_params(&self) -> usize {
        self.pairs()
            .map(|(_, _, p)| p.a.numel() + p.b.numel())
            .sum()
    }

    pub fn zero_grads(&mut self) -> Result<()> {
        for (_, _, p) in self.pairs_mut() {
            crate::tensor::scale(&mut p.grad_a, 0.0)?;
            crate::tensor::scale(&mut p.grad_b, 0.0)?;
        }
        Ok(())
    }

    /// Re-derives the compute-dtype copies of A and B from the f32 masters (after an update, or
    /// after A or B were changed directly). A copy is allocated once, when missing or when its
    /// master changed shape (`new` and `load_peft` create them); later calls overwrite every
    /// copy in place, in one launch on CUDA. The CPU computes with the masters: nothing to do.
    pub fn refresh_compute_copies(&mut self) -> Result<()> {
        let dt = self.device.compute_dtype();
        if dt == DType::F32 {
            return self.refresh_stacked();
        }
        let mut stale: Vec<(&Tensor, &mut Tensor)> = Vec::new();
        for (_, _, p) in self.pairs_mut() {
            let LoraPair {
                a,
                b,
                a_compute,
                b_compute,
                ..
            } = p;
            for (master, copy) in [(&*a, a_compute), (&*b, b_compute)] {
                let fits = copy
                    .as_ref()
                    .is_some_and(|c| c.shape() == master.shape() && c.dtype() == dt);
                if !fits {
                    *copy = Some(master.to_dtype(dt)?);
                } else if let Some(c) = copy {
                    stale.push((master, c));
                }
            }
        }
        crate::tensor::cast_multi(&mut stale)?;
        self.refresh_stacked()
    }

    /// Writes a PEFT adapter folder.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut host: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for (l, t, p) in self.pairs() {
            host.push((peft_key(l, t, false), p.a.shape().to_vec(), p.a.to_vec()?));
            host.push((peft_key(l, t, true), p.b.shape().to_vec(), p.b.to_vec()?));
        }
        crate::atomic_file::write_with(&dir.join("adapter_model.safetensors"), |tmp| {
            super::weights::write_f32_safetensors(tmp, &host)
        })?;
        let c = &self.config;
        let mut rank_pattern = serde_json::Map::new();
        for (k, v) in &c.rank_pattern {
            rank_pattern.insert(k.clone(), (*v).into());
        }
        let mut alpha_pattern = serde_json::Map::new();
        for (k, v) in &c.alpha_pattern {
            alpha_pattern.insert(k.clone(), (*v).into());
        }
        let cfg = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": c.rank,
            "lora_alpha": c.alpha,
            "lora_dropout": c.dropout,
            "target_modules": c.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
            "use_rslora": c.rslora,
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "use_dora": false,
        });
        std::fs::write(
            dir.join("adapter_config.json"),
            serde_json::to_string_pretty(&cfg)?,
        )?;
        Ok(())
    }

    /// Reads a PEFT adapter folder onto `spec`'s layers; shapes are checked against the model.
    pub fn load_peft(dir: &Path, spec: &ModelSpec, device: &Device) -> Result<Lora> {
        let cfg_path = dir.join("adapter_config.json");
        if !cfg_path.exists() && dir.join("adapter").join("adapter_config.json").is_file() {
            let best = dir.join("best");
            bail!(
                "{} is a run folder, not an adapter: its adapter is {}{}",
                dir.display(),
                dir.join("adapter").display(),
                if best.join("adapter_config.json").is_file() {
                    format!(" ({} holds the best validation margin's)", best.display())
                } else {
                    String::new()
                }
            );
        }
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", cfg_path.display()))?;
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        let rank = match field("r") {
            None => bail!("{}: field \"r\" missing", cfg_path.display()),
            Some(x) => x.as_u64().filter(|&r| r > 0).with_context(|| {
                format!(
                    "{}: field \"r\": {x}, where a whole number of at least 1 is expected",
                    cfg_path.display()
                )
            })? as usize,
        };
        let alpha = match field("lora_alpha") {
            // PEFT's LoraConfig default.
            None => PEFT_DEFAULT_ALPHA,
            Some(x) => x.as_f64().filter(|a| a.is_finite()).with_context(|| {
                format!(
                    "{}: field \"lora_alpha\": {x}, where a number is expected",
                    cfg_path.display()
                )
            })?,
        };
        check_plain_lora(&v).with_context(|| format!("{}", cfg_path.display()))?;
        let targets: Vec<Target> = match field("target_modules") {
            Some(serde_json::Value::Array(a)) => {
                let mut targets = Vec::new();
                for x in a {
                    let t = peft_target(x).with_context(|| {
                        format!("{}: field \"target_modules\"", cfg_path.display())
                    })?;
                    if !targets.contains(&t) {
                        targets.push(t);
                    }
                }
                targets
            }
            Some(serde_json::Value::String(re)) => bail!(
                "{}: field \"target_modules\" is the string {re:?}, which PEFT reads as a regular \
                 expression over module names; lorafit does not read those: list the module \
                 names instead, e.g. [\"q_proj\", \"v_proj\"]",
                cfg_path.display()
            ),
            _ => bail!(
                "{}: field \"target_modules\" must be a list of module names",
                cfg_path.display()
            ),
        };
        let rank_pattern = pattern_field(&v, "rank_pattern", |x| {
            x.as_u64().filter(|&r| r > 0).map(|r| r as usize)
        })
        .with_context(|| format!("{}", cfg_path.display()))?;
        let alpha_pattern = pattern_field(&v, "alpha_pattern", |x| {
            x.as_f64().filter(|a| a.is_finite())
        })
        .with_context(|| format!("{}", cfg_path.display()))?;
        let config = LoraConfig {
            rank,
            alpha,
            targets,
            rslora: field("use_rslora")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            rank_pattern,
            alpha_pattern,
            dropout: field("lora_dropout")
                .and_then(|x| x.as_f64())
                .unwrap_or(0.0) as f32,
            seed: 0,
        };
        check_patterns(&config, spec).with_context(|| format!("{}", cfg_path.display()))?;
        let st_path = dir.join("adapter_model.safetensors");
        if !st_path.exists() && dir.join("adapter_model.bin").exists() {
            bail!(
                "{}: the adapter's weights are in adapter_model.bin (a pickled PyTorch file), \
                 which lorafit does not read; save the adapter with safetensors \
                 (save_pretrained(..., safe_serialization=True), PEFT's default) to get \
                 adapter_model.safetensors",
                dir.display()
            );
        }
        let bytes =
            std::fs::read(&st_path).with_context(|| format!("reading {}", st_path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .with_context(|| format!("parsing {}", st_path.display()))?;
        let mut layers = Vec::with_capacity(spec.n_layers);
        // Every tensor of the file is taken, or the adapter is not this model's (or its
        // config names fewer targets than it holds): none is dropped without a word.
        let mut untaken: std::collections::BTreeSet<String> =
            st.names().into_iter().map(|n| n.to_string()).collect();
        for l in 0..spec.n_layers {
            let mut row: [Option<LoraPair>; 7] = Default::default();
            for &t in &config.targets {
                let (r, scale) = config.resolve(l, t);
                let Some((out, inp)) = t.dims(spec, l) else {
                    continue;
                };
                untaken.remove(&peft_key(l, t, false));
                untaken.remove(&peft_key(l, t, true));
                let read = |b: bool, want: [usize; 2]| -> Result<Vec<f32>> {
                    let key = peft_key(l, t, b);
                    let view = st.tensor(&key).with_context(|| {
                        format!("{}: tensor {key} is missing", st_path.display())
                    })?;
                    ensure!(
                        view.shape() == want,
                        "{}: tensor {key} has shape {:?}, the model needs {:?}",
                        st_path.display(),
                        view.shape(),
                        want
                    );
                    let data = super::weights::view_to_f32(&view)
                        .with_context(|| format!("{}: tensor {key}", st_path.display()))?;
                    super::weights::check_finite(&data, &key, &st_path.display().to_string())?;
                    Ok(data)
                };
                let a = read(false, [r, inp])?;
                let b = read(true, [out, r])?;
                row[t.index()] = Some(LoraPair::from_host(&a, &b, r, out, inp, scale, device)?);
            }
            layers.push(row);
        }
        if let Some(first) = untaken.iter().next() {
            bail!(
                "{}: {} tensors that this model's {} layers and the config's target_modules do \
                 not take (the first: {first}); is it an adapter of another model, or was its \
                 adapter_config.json edited?",
                st_path.display(),
                untaken.len(),
                spec.n_layers
            );
        }
        let mut lora = Lora {
            config,
            layers,
            device: device.clone(),
            stacked: Vec::new(),
        };
        lora.refresh_compute_copies()?;
        Ok(lora)
    }
}

/// `lora_alpha` where an adapter_config.json has none: PEFT's `LoraConfig` default.
pub const PEFT_DEFAULT_ALPHA: f64 = 8.0;

/// One `target_modules` entry: a module name (`q_proj`) or a dotted end of a module's path
/// (`self_attn.q_proj`), which PEFT matches as the end of each module's full name.
fn peft_target(x: &serde_json::Value) -> Result<Target> {
    let Some(name) = x.as_str() else {
        bail!("{x} is not a module name");
    };
    let Some((_, last)) = name.rsplit_once('.') else {
        return Target::parse(name);
    };
    let t = Target::parse(last).with_context(|| format!("{name:?}"))?;
    ensure!(
        t.path() == name || t.path().ends_with(&format!(".{name}")),
        "{name:?} names {} by a path that is not the end of every layer's {} (the module's \
         path in a layer is {}; a path naming some layers only is not read): list module names \
         such as {:?} or {:?}",
        t.module(),
        t.module(),
        t.path(),
        t.module(),
        t.path()
    );
    Ok(t)
}

/// `rank_pattern` or `alpha_pattern` of an adapter_config.json: each value read by `value`
/// (an error naming the key where it is not one), each key an expression lorafit can match.
fn pattern_field<T>(
    config: &serde_json::Value,
    field: &str,
    value: impl Fn(&serde_json::Value) -> Option<T>,
) -> Result<BTreeMap<String, T>> {
    let mut out = BTreeMap::new();
    let Some(x) = config.get(field).filter(|x| !x.is_null()) else {
        return Ok(out);
    };
    let Some(map) = x.as_object() else {
        bail!("field \"{field}\": {x}, where an object of module names is expected");
    };
    for (k, v) in map {
        let Some(v) = value(v) else {
            bail!(
                "field \"{field}\": key {k:?}: {v}, where {} is expected",
                if field == "rank_pattern" {
                    "a whole number of at least 1"
                } else {
                    "a number"
                }
            );
        };
        if let Err(e) = pattern_regex(k) {
            bail!(
                "field \"{field}\": key {k:?} is a regular expression lorafit does not read \
                 ({e}); name the modules (e.g. \"down_proj\" or \"model.layers.3.mlp.down_proj\")"
            );
        }
        out.insert(k.clone(), v);
    }
    Ok(out)
}

/// Every pattern key applies to some adapted module of `spec`, and no module is matched by
/// two keys of different values: PEFT takes the first key in the file's order, which the
/// parsed JSON no longer holds.
fn check_patterns(config: &LoraConfig, spec: &ModelSpec) -> Result<()> {
    let modules: Vec<String> = (0..spec.n_layers)
        .flat_map(|l| {
            config
                .targets
                .iter()
                .filter(move |t| t.dims(spec, l).is_some())
                .map(move |&t| module_name(l, t))
        })
        .collect();
    fn check<T: PartialEq + std::fmt::Display>(
        field: &str,
        map: &BTreeMap<String, T>,
        modules: &[String],
    ) -> Result<()> {
        for key in map.keys() {
            ensure!(
                modules.iter().any(|m| pattern_matches(key, m)),
                "field \"{field}\": key {key:?} matches none of the adapted modules of this \
                 model (such as {:?}): is the adapter another model's?",
                modules.first().map_or("", |m| m.as_str())
            );
        }
        for m in modules {
            let hits: Vec<(&String, &T)> =
                map.iter().filter(|(k, _)| pattern_matches(k, m)).collect();
            if let Some(((k1, v1), (k2, v2))) = hits
                .iter()
                .flat_map(|a| hits.iter().map(move |b| (*a, *b)))
                .find(|(a, b)| a.1 != b.1)
            {
                bail!(
                    "field \"{field}\": keys {k1:?} ({v1}) and {k2:?} ({v2}) both match {m}; \
                     PEFT takes the first in the file, an order lorafit does not keep: give \
                     one key per module"
                );
            }
        }
        Ok(())
    }
    check("rank_pattern", &config.rank_pattern, &modules)?;
    check("alpha_pattern", &config.alpha_pattern, &modules)
}

/// PEFT settings that would make the adapter something other than plain LoRA on the listed
/// modules: refused, since reading it as plain LoRA would give other numbers than PEFT's.
fn check_plain_lora(config: &serde_json::Value) -> Result<()> {
    let field = |k: &str| config.get(k).filter(|x| !x.is_null());
    if let Some(t) = field("peft_type") {
        ensure!(
            t.as_str() == Some("LORA"),
            "peft_type {t}: lorafit reads LoRA adapters only"
        );
    }
    let refused = [
        (
            "use_dora",
            field("use_dora").is_some_and(|x| x != &serde_json::json!(false)),
            "a DoRA adapter (use_dora) has a magnitude vector that lorafit does not apply",
        ),
        (
            "bias",
            field("bias").is_some_and(|x| x.as_str() != Some("none")),
            "trained biases (bias other than \"none\") are not applied by lorafit",
        ),
        (
            "fan_in_fan_out",
            field("fan_in_fan_out").is_some_and(|x| x != &serde_json::json!(false)),
            "fan_in_fan_out (Conv1D weights) is not a layout lorafit reads",
        ),
        (
            "layers_to_transform",
            field("layers_to_transform").is_some(),
            "an adapter on some layers only (layers_to_transform) is not read by lorafit",
        ),
        (
            "modules_to_save",
            field("modules_to_save").is_some_and(|x| x.as_array().is_none_or(|a| !a.is_empty())),
            "fully trained modules (modules_to_save) are not applied by lorafit",
        ),
        (
            "alora_invocation_tokens",
            field("alora_invocation_tokens").is_some(),
            "an activated LoRA (alora_invocation_tokens) applies the adapter from its \
             invocation tokens on, which lorafit does not do",
        ),
        (
            "layer_replication",
            field("layer_replication").is_some(),
            "an adapter over replicated layers (layer_replication) is not read by lorafit",
        ),
        (
            "exclude_modules",
            field("exclude_modules").is_some_and(|x| x.as_array().is_none_or(|a| !a.is_empty())),
            "an adapter that leaves out some of its target modules (exclude_modules) is not \
             read by lorafit",
        ),
        (
            "lora_bias",
            field("lora_bias").is_some_and(|x| x != &serde_json::json!(false)),
            "a bias on lora_B (lora_bias) is not applied by lorafit",
        ),
        (
            "target_parameters",
            field("target_parameters").is_some_and(|x| x.as_array().is_none_or(|a| !a.is_empty())),
            "adapters on parameters (target_parameters) are not read by lorafit",
        ),
        (
            "trainable_token_indices",
            field("trainable_token_indices").is_some(),
            "trained token embeddings (trainable_token_indices) are not applied by lorafit",
        ),
        (
            "use_qalora",
            field("use_qalora").is_some_and(|x| x != &serde_json::json!(false)),
            "a QA-LoRA adapter (use_qalora) pools its input, which lorafit does not do",
        ),
    ];
    if let Some((name, _, why)) = refused.iter().find(|(_, hit, _)| *hit) {
        bail!("field \"{name}\": {why}");
    }
    Ok(())
}

impl LoraPair {
    pub fn from_host(
        a: &[f32],
        b: &[f32],
        r: usize,
        out: usize,
        inp: usize,
        scale: f32,
        device: &Device,
    ) -> Result<LoraPair> {
        Ok(LoraPair {
            rank: r,
            scale,
            a: Tensor::from_f32(a, &[r, inp], DType::F32, device)?,
            b: Tensor::from_f32(b, &[out, r], DType::F32, device)?,
            grad_a: Tensor::zeros(&[r, inp], DType::F32, device)?,
            grad_b: Tensor::zeros(&[out, r], DType::F32, device)?,
            a_compute: None,
            b_compute: None,
            generation: next_generation(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An adapter is read as PEFT would apply it, or refused: a config edited to fewer targets
    /// than its tensors, an adapter of a deeper model, a non-numeric alpha, a fractional rank,
    /// DoRA and PEFT's other variants each name the field or the tensor.
    #[test]
    fn adapters_that_are_not_plain_lora_on_this_model_are_refused() {
        let config = |name: &str| {
            ModelSpec::from_config_json(
                &std::fs::read_to_string(
                    Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("tests/fixtures/models")
                        .join(name)
                        .join("config.json"),
                )
                .unwrap(),
            )
            .unwrap()
        };
        let spec = config("llama");
        let dir = std::env::temp_dir().join(format!("lorafit-peft-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let lora = Lora::new(&spec, LoraConfig::default(), &Device::Cpu).unwrap();
        lora.save_peft(&dir, "base").unwrap();
        Lora::load_peft(&dir, &spec, &Device::Cpu).unwrap();
        let path = dir.join("adapter_config.json");
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let edited = |key: &str, value: serde_json::Value| {
            let mut v = saved.clone();
            v[key] = value.clone();
            std::fs::write(&path, v.to_string()).unwrap();
            match Lora::load_peft(&dir, &spec, &Device::Cpu) {
                Ok(_) => panic!("{key} = {value}: read"),
                Err(e) => format!("{e:#}"),
            }
        };
        let e = edited("target_modules", serde_json::json!(["q_proj", "v_proj"]));
        assert!(e.contains("20 tensors that this model's 2 layers"), "{e}");
        let e = edited("lora_alpha", serde_json::json!("8"));
        assert!(e.contains("field \"lora_alpha\""), "{e}");
        let e = edited("r", serde_json::json!(4.0));
        assert!(e.contains("field \"r\": 4.0"), "{e}");
        let e = edited("use_dora", serde_json::json!(true));
        assert!(e.contains("DoRA"), "{e}");
        let e = edited("peft_type", serde_json::json!("LOHA"));
        assert!(e.contains("LoRA adapters only"), "{e}");
        let e = edited("layers_to_transform", serde_json::json!([0]));
        assert!(e.contains("layers_to_transform"), "{e}");
        std::fs::write(&path, saved.to_string()).unwrap();
        // A model with fewer layers than the adapter's.
        let mut shallow = spec.clone();
        shallow.n_layers -= 1;
        shallow.layers.pop();
        let e = match Lora::load_peft(&dir, &shallow, &Device::Cpu) {
            Ok(_) => panic!("an adapter of more layers was read"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains("adapter of another model"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn llama_spec() -> ModelSpec {
        ModelSpec::from_config_json(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/models/llama/config.json"),
            )
            .unwrap(),
        )
        .unwrap()
    }

    /// PEFT's pattern keys are regular expressions matched against the whole module name or
    /// its end after a dot.
    #[test]
    fn pattern_keys_match_as_peft_matches_them() {
        let name = "model.layers.3.mlp.down_proj";
        for key in [
            "down_proj",
            "mlp.down_proj",
            name,
            ".*_proj",
            ".*\\.down_proj",
            "layers\\.[0-9]+\\.mlp\\.(up|down)_proj",
            "(?:gate|down)_proj",
            "d{1}own_pr?oj",
            "^model.*",
        ] {
            assert!(pattern_matches(key, name), "{key}");
        }
        for key in [
            "own_proj",
            "up_proj",
            "layers.1.mlp.down_proj",
            "q_proj|k_proj",
            "^mlp.down_proj",
            "down",
        ] {
            assert!(!pattern_matches(key, name), "{key}");
        }
        for bad in ["(?=down)_proj", "down_proj\\1", "*_proj", "(down_proj"] {
            assert!(pattern_regex(bad).is_err(), "{bad}");
        }
    }

    /// What PEFT reads, lorafit reads the same way or refuses naming the field: a regex
    /// `alpha_pattern` applies to every module it matches, a missing `lora_alpha` is PEFT's 8,
    /// dotted `target_modules` are module names, a regex string there is refused with what to
    /// write, and options that change the maths (aLoRA, layer replication) are refused.
    #[test]
    fn peft_configs_are_read_as_peft_reads_them() {
        let spec = llama_spec();
        let dir = std::env::temp_dir().join(format!("lorafit-peft-forms-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = LoraConfig {
            rank: 4,
            alpha: 4.0,
            ..LoraConfig::default()
        };
        Lora::new(&spec, config, &Device::Cpu)
            .unwrap()
            .save_peft(&dir, "base")
            .unwrap();
        let path = dir.join("adapter_config.json");
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let load = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = saved.clone();
            edit(&mut v);
            std::fs::write(&path, v.to_string()).unwrap();
            Lora::load_peft(&dir, &spec, &Device::Cpu).map_err(|e| format!("{e:#}"))
        };
        let l = load(&|v| v["alpha_pattern"] = serde_json::json!({".*_proj": 64})).unwrap();
        assert!(l.pairs().all(|(_, _, p)| p.scale == 16.0));
        let l = load(&|v| v["alpha_pattern"] = serde_json::json!({"mlp\\..*": 8})).unwrap();
        for (_, t, p) in l.pairs() {
            let want = if t.path().starts_with("mlp.") {
                2.0
            } else {
                1.0
            };
            assert_eq!(p.scale, want, "{t:?}");
        }
        let e = load(&|v| v["alpha_pattern"] = serde_json::json!({"q_proj": 8, ".*": 16}))
            .err()
            .unwrap();
        assert!(e.contains("both match") && e.contains("q_proj"), "{e}");
        let e = load(&|v| v["alpha_pattern"] = serde_json::json!({"(?=q)": 8}))
            .err()
            .unwrap();
        assert!(e.contains("alpha_pattern") && e.contains("(?=q)"), "{e}");
        let e = load(&|v| v["rank_pattern"] = serde_json::json!({"q_proj": "4"}))
            .err()
            .unwrap();
        assert!(e.contains("rank_pattern") && e.contains("q_proj"), "{e}");
        let l = load(&|v| {
            v.as_object_mut().unwrap().remove("lora_alpha");
        })
        .unwrap();
        assert_eq!(l.config.alpha, PEFT_DEFAULT_ALPHA);
        assert!(l.pairs().all(|(_, _, p)| p.scale == 2.0));
        let all: Vec<String> = Target::ALL.iter().map(|t| t.path()).collect();
        let l = load(&|v| v["target_modules"] = serde_json::json!(all)).unwrap();
        assert_eq!(l.config.targets, Target::ALL.to_vec());
        let e = load(&|v| v["target_modules"] = serde_json::json!(".*q_proj"))
            .err()
            .unwrap();
        assert!(
            e.contains("target_modules") && e.contains("regular expression") && e.contains("list"),
            "{e}"
        );
        let e = load(&|v| v["target_modules"] = serde_json::json!(["layers.0.self_attn.q_proj"]))
            .err()
            .unwrap();
        assert!(e.contains("layers.0.self_attn.q_proj"), "{e}");
        for (field, value) in [
            ("alora_invocation_tokens", serde_json::json!([1, 2])),
            ("layer_replication", serde_json::json!([[0, 1]])),
        ] {
            let e = load(&|v| v[field] = value.clone()).err().unwrap();
            assert!(e.contains(&format!("field \"{field}\"")), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A non-finite value in an adapter is refused naming the file, the tensor and its index;
    /// a folder holding only `adapter_model.bin` is told to save with safetensors.
    #[test]
    fn non_finite_and_pickled_adapters_are_refused() {
        let spec = llama_spec();
        let dir = std::env::temp_dir().join(format!("lorafit-peft-nan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut lora = Lora::new(&spec, LoraConfig::default(), &Device::Cpu).unwrap();
        let p = lora.get_mut(1, Target::V).unwrap();
        let mut a = p.a.to_vec().unwrap();
        a[5] = f32::INFINITY;
        p.a = Tensor::from_f32(&a, p.a.shape(), DType::F32, &Device::Cpu).unwrap();
        lora.save_peft(&dir, "base").unwrap();
        let e = format!(
            "{:#}",
            Lora::load_peft(&dir, &spec, &Device::Cpu).err().unwrap()
        );
        assert!(
            e.contains("adapter_model.safetensors")
                && e.contains(&peft_key(1, Target::V, false))
                && e.contains("inf at index 5"),
            "{e}"
        );
        std::fs::rename(
            dir.join("adapter_model.safetensors"),
            dir.join("adapter_model.bin"),
        )
        .unwrap();
        let e = format!(
            "{:#}",
            Lora::load_peft(&dir, &spec, &Device::Cpu).err().unwrap()
        );
        assert!(
            e.contains("adapter_model.bin") && e.contains("safetensors"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
