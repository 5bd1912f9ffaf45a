//! `lorafit kl`: how much each layer's quantized weights change a model's next-token
//! distributions, measured against a reference model on calibration text. Its output file is
//! what `rank_scaling = "by_kl"` reads (`train::rank_scaling`), to give the layers that lose
//! most to quantization more LoRA rank.
//!
//! The definition: for layer `l`,
//!
//! ```text
//! KL_l = mean over tokens t of KL( p_ref(· | x≤t) ‖ p_l(· | x≤t) )
//! ```
//!
//! where `p_ref` is the reference model's next-token distribution and `p_l` the reference model
//! with layer `l`'s weights (projections, norms, biases) taken from the quantized model, every
//! other layer, the embeddings, the final norm and the head staying the reference's. The mean is
//! over every position of every row (each predicts the next token), in nats.
//!
//! Why this one: it charges each layer its own quantization error as the output sees it, so
//! the layers compare with one another, where taking the quantized model's hidden state after
//! layer `l` would charge layer `l` with the error of every layer below it too (a number that
//! grows with depth whatever the layer). It needs only the ordinary forward, a layer's weights
//! swapped between the two loaded models: `L + 1` forwards per row.

use crate::data::{self, DatasetKind, RowTokens, TokenizeOptions};
use crate::model::{self, Model, ModelSpec};
use crate::tensor::{DType, Device};
use crate::train::rank_scaling::{KlFile, LayerKl};
use crate::train::trainer::{load_with_template, resolve_model_path, Loaded};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// The settings of one `lorafit kl` run.
#[derive(Clone, Debug)]
pub struct KlOptions {
    /// The quantized model (a GGUF file, or any model lorafit loads); its tokenizer and chat
    /// template read the data, as training reads it.
    pub model: String,
    /// The reference (unquantized) model: the same architecture.
    pub reference: String,
    /// Calibration rows: a preference or SFT data file (any format `data::rows` reads), or plain
    /// text with one row per line (a `.txt` file).
    pub data: PathBuf,
    pub output: PathBuf,
    /// The first this many rows (0: all).
    pub max_rows: usize,
    /// The first this many tokens of each row.
    pub max_len: usize,
    pub device: String,
    /// A Jinja chat template file (or a tokenizer_config.json) instead of the model's, for
    /// message rows on a model without one.
    pub chat_template: Option<String>,
}

/// An error naming the first architectural quantity in which `model` and `reference` differ
/// (layers, hidden size, vocabulary, heads, each layer's widths), when they do.
pub fn check_same_architecture(model: &ModelSpec, reference: &ModelSpec) -> Result<()> {
    let differ = |what: &str, a: String, b: String| -> Result<()> {
        if a != b {
            bail!("the models differ in {what}: model {a}, reference {b} (lorafit kl compares two copies of one architecture)");
        }
        Ok(())
    };
    differ(
        "family",
        format!("{:?}", model.family),
        format!("{:?}", reference.family),
    )?;
    let sizes = [
        ("number of layers", model.n_layers, reference.n_layers),
        ("hidden size", model.hidden, reference.hidden),
        ("vocabulary size", model.vocab, reference.vocab),
        ("attention heads", model.n_heads, reference.n_heads),
        ("key/value heads", model.n_kv_heads, reference.n_kv_heads),
        ("head size", model.head_dim, reference.head_dim),
        (
            "per-layer input width",
            model.per_layer_input,
            reference.per_layer_input,
        ),
    ];
    for (what, a, b) in sizes {
        differ(what, a.to_string(), b.to_string())?;
    }
    let flags = [
        ("q/k/v biases", model.qkv_bias, reference.qkv_bias),
        ("q/k norms", model.qk_norm, reference.qk_norm),
    ];
    for (what, a, b) in flags {
        differ(what, a.to_string(), b.to_string())?;
    }
    for (l, (a, b)) in model.layers.iter().zip(&reference.layers).enumerate() {
        let per_layer = [
            ("MLP width", a.intermediate, b.intermediate),
            ("head size", a.head_dim, b.head_dim),
            ("key/value heads", a.n_kv_heads, b.n_kv_heads),
        ];
        for (what, x, y) in per_layer {
            differ(&format!("layer {l}'s {what}"), x.to_string(), y.to_string())?;
        }
        let layout = |s: &model::config::LayerSpec| {
            format!(
                "kv source {:?}, k_eq_v {}, v norm {}, sandwich norms {}",
                s.kv_source, s.k_eq_v, s.v_norm, s.sandwich_norms
            )
        };
        differ(&format!("layer {l}'s layout"), layout(a), layout(b))?;
    }
    Ok(())
}

/// The calibration rows of `path` as token ids, each cut to its first `max_len` tokens, at
/// most `max_rows` of them (0: all). A `.txt` file is plain text, one row per non-blank line
/// (BOS first where the tokenizer adds one); any other file is read by the data loader as
/// preference rows (prompt + chosen) or, failing that, SFT rows (prompt + completion), with the
/// model's chat template for chat rows.
pub fn calibration_rows(
    path: &Path,
    loaded: &Loaded,
    max_rows: usize,
    max_len: usize,
) -> Result<Vec<Vec<u32>>> {
    if max_len == 0 {
        bail!("--max-len 0: expected a whole number of tokens, at least 1");
    }
    let name = path.display().to_string();
    let vocab = loaded.model.spec.vocab;
    let take = if max_rows == 0 { usize::MAX } else { max_rows };
    let mut rows: Vec<Vec<u32>> = Vec::new();
    if path.extension().is_some_and(|e| e == "txt") {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {name}"))?;
        let tok = &loaded.tokenizer;
        for (i, line) in text.lines().enumerate() {
            if rows.len() == take {
                break;
            }
            if line.trim().is_empty() {
                continue;
            }
            let mut ids: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos()).into_iter().collect();
            ids.extend(
                tok.encode(line)
                    .with_context(|| format!("{name}:{}", i + 1))?,
            );
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                bail!("{name}:{}: token id {bad} is outside the model's vocabulary ({vocab} rows): the tokenizer does not match the model", i + 1);
            }
            rows.push(ids);
        }
    } else {
        // Lengths no row reaches: the rows are cut below, from the start.
        let tokenize = TokenizeOptions::new(usize::MAX / 2, usize::MAX / 4);
        let read = |kind| {
            let opts = data::CheckOptions {
                kind,
                skip_bad: false,
                tokenize,
                compare: None,
                model_vocab: vocab,
            };
            data::load_and_check(
                &name,
                None,
                &loaded.tokenizer,
                loaded.template.as_ref(),
                &opts,
            )
        };
        let checked = match read(DatasetKind::Preference) {
            Ok((rows, _)) => rows,
            Err(pref) => match read(DatasetKind::Sft) {
                Ok((rows, _)) => rows,
                // The same failure both ways is the file's, not its rows' (a file that is not
                // there, or cannot be read): said alone, as `train` says it.
                Err(sft) if format!("{pref:#}") == format!("{sft:#}") => return Err(pref),
                Err(sft) => bail!(
                    "{name}: neither preference nor SFT rows (nor plain text: that is a .txt file)\n  as preference rows: {pref:#}\n  as SFT rows: {sft:#}"
                ),
            },
        };
        for row in checked.into_iter().take(take) {
            rows.push(match row.tokens {
                RowTokens::Pair(p) => p.chosen_sequence(),
                RowTokens::Sft(s) => s.sequence(),
            });
        }
    }
    rows.retain(|r| !r.is_empty());
    for r in &mut rows {
        r.truncate(max_len);
    }
    if rows.is_empty() {
        bail!("{name}: no calibration rows with any tokens");
    }
    Ok(rows)
}

/// Per position of `logits` (`[T, V]`, row-major), its log-sum-exp in f64.
fn log_sum_exp(logits: &[f32], vocab: usize) -> Vec<f64> {
    logits
        .par_chunks(vocab)
        .map(|z| {
            let m = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            m + z.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        })
        .collect()
}

/// Σ over positions of `KL(p ‖ q)`, `p` and `q` given by their logits and log-sum-exps. Each
/// position's value is clamped at 0 (a rounding below it is no information).
fn kl_sum(p: &[f32], p_lse: &[f64], q: &[f32], vocab: usize) -> f64 {
    let q_lse = log_sum_exp(q, vocab);
    p.par_chunks(vocab)
        .zip(q.par_chunks(vocab))
        .zip(p_lse.par_iter().zip(q_lse.par_iter()))
        .map(|((zp, zq), (&lp, &lq))| {
            let kl: f64 = zp
                .iter()
                .zip(zq)
                .map(|(&a, &b)| {
                    let log_p = a as f64 - lp;
                    log_p.exp() * (log_p - (b as f64 - lq))
                })
                .sum();
            kl.max(0.0)
        })
        .sum()
}

/// The reference's logits `[T, V]` on the host.
fn host_logits(m: &Model, ids: &[u32]) -> Result<Vec<f32>> {
    let h = m.hidden_states(ids, None)?;
    m.logits(&h, DType::F32)?.to_vec()
}

/// The per-layer KL (the module doc's definition) of `model` against `reference` over `rows`,
/// and the number of tokens it is averaged over. Each layer's weights are swapped into
/// `reference` for its forward and swapped back, so both models are as they were on return,
/// an error included. `tick` is called after each row.
pub fn layer_kl(
    model: &mut Model,
    reference: &mut Model,
    rows: &[Vec<u32>],
    tick: &mut dyn FnMut(),
) -> Result<(Vec<f64>, usize)> {
    check_same_architecture(&model.spec, &reference.spec)?;
    let (n_layers, vocab) = (reference.spec.n_layers, reference.spec.vocab);
    let mut sums = vec![0f64; n_layers];
    let mut tokens = 0;
    for (i, ids) in rows.iter().enumerate() {
        let at = || format!("calibration row {}", i + 1);
        let p = host_logits(reference, ids).with_context(at)?;
        let p_lse = log_sum_exp(&p, vocab);
        for (l, sum) in sums.iter_mut().enumerate() {
            std::mem::swap(
                &mut reference.weights.layers[l],
                &mut model.weights.layers[l],
            );
            let q = host_logits(reference, ids);
            std::mem::swap(
                &mut reference.weights.layers[l],
                &mut model.weights.layers[l],
            );
            let q = q.with_context(|| format!("{}, layer {l} quantized", at()))?;
            *sum += kl_sum(&p, &p_lse, &q, vocab);
        }
        tokens += ids.len();
        tick();
    }
    let kl = sums.iter().map(|s| s / tokens.max(1) as f64).collect();
    Ok((kl, tokens))
}

/// One `lorafit kl` run: loads both models on the device, reads the rows, measures every
/// layer with a progress bar over the rows, and writes `opts.output`.
pub fn run(opts: &KlOptions) -> Result<KlFile> {
    let mut inputs: Vec<(String, PathBuf)> =
        crate::data::rows::dataset_files(&opts.data.display().to_string())
            .unwrap_or_else(|_| vec![opts.data.clone()])
            .into_iter()
            .map(|f| ("--data".to_string(), f))
            .collect();
    inputs.push(("--model".to_string(), PathBuf::from(&opts.model)));
    inputs.push(("--reference".to_string(), PathBuf::from(&opts.reference)));
    if let Some(t) = &opts.chat_template {
        inputs.push(("--chat-template".to_string(), PathBuf::from(t)));
    }
    super::refuse_clashing_paths(&[("--output".to_string(), opts.output.clone())], &inputs)?;
    // Where the table goes is checked before the forward passes, not after them.
    crate::atomic_file::check_writable(&opts.output, "--output")?;
    let device = Device::parse(&opts.device)?;
    let mut loaded = load_with_template(
        &opts.model,
        &device,
        crate::model::BaseQuant::None,
        opts.chat_template.as_deref(),
    )
    .with_context(|| format!("loading --model {}", opts.model))?;
    let ref_path = resolve_model_path(&opts.reference)?;
    let mut reference = model::load(&ref_path, &device)
        .with_context(|| format!("loading --reference {}", opts.reference))?;
    check_same_architecture(&loaded.model.spec, &reference.spec)?;
    let rows = calibration_rows(&opts.data, &loaded, opts.max_rows, opts.max_len)?;
    let bar = indicatif::ProgressBar::new(rows.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "kl {bar:30} {pos}/{len} rows [{elapsed_precise} < {eta_precise}]",
        )
        .context("progress bar template")?,
    );
    let measured = layer_kl(&mut loaded.model, &mut reference, &rows, &mut || bar.inc(1));
    bar.finish_and_clear();
    let (kl, tokens) = measured?;
    let file = KlFile {
        model: opts.model.clone(),
        reference: opts.reference.clone(),
        rows: rows.len(),
        tokens,
        layers: kl
            .iter()
            .enumerate()
            .map(|(layer, &kl)| LayerKl { layer, kl })
            .collect(),
    };
    std::fs::write(&opts.output, serde_json::to_string_pretty(&file)? + "\n")
        .with_context(|| format!("writing {}", opts.output.display()))?;
    Ok(file)
}

/// The per-layer table `lorafit kl` prints.
pub fn format_table(f: &KlFile) -> String {
    let mut s = format!(
        "KL(reference ‖ reference with one layer quantized), nats per token, over {} rows / {} tokens\nlayer  kl\n",
        f.rows, f.tokens
    );
    for l in &f.layers {
        s.push_str(&format!("{:>5}  {:.6e}\n", l.layer, l.kl));
    }
    if f.layers.iter().all(|l| l.kl == 0.0) {
        s.push_str(
            "note: every layer's KL is 0: the two models hold the same weights (is --model the \
             quantized one, and --reference its unquantized source?)\n",
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of zeros (the same weights on both sides) says so.
    #[test]
    fn an_all_zero_table_says_the_models_are_the_same() {
        let file = |kl: f64| KlFile {
            model: "m".into(),
            reference: "r".into(),
            rows: 1,
            tokens: 4,
            layers: vec![LayerKl { layer: 0, kl: 0.0 }, LayerKl { layer: 1, kl }],
        };
        assert!(format_table(&file(0.0)).contains("hold the same weights"));
        assert!(!format_table(&file(1e-3)).contains("note:"));
    }

    #[test]
    fn kl_of_logits_matches_the_definition() {
        let v = 3;
        let p = [1.0f32, 2.0, 0.5, 0.0, 0.0, 0.0];
        let q = [1.5f32, 1.0, 0.5, 0.0, 0.0, 3.0];
        let softmax = |z: &[f32]| {
            let e: Vec<f64> = z.iter().map(|&x| (x as f64).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect::<Vec<_>>()
        };
        let mut want = 0.0;
        for t in 0..2 {
            let (a, b) = (softmax(&p[t * v..][..v]), softmax(&q[t * v..][..v]));
            want += a.iter().zip(&b).map(|(x, y)| x * (x / y).ln()).sum::<f64>();
        }
        let got = kl_sum(&p, &log_sum_exp(&p, v), &q, v);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        assert_eq!(kl_sum(&p, &log_sum_exp(&p, v), &p, v), 0.0);
    }
}
