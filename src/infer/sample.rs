//! Choosing the next token from a row of logits: greedy, or sampled after Hugging Face's logits
//! processors in their order — repetition penalty, then temperature, top-k, top-p and min-p — from
//! a seeded generator per sequence, so that a run is reproducible from its seed and a sequence's
//! tokens do not depend on what else is in its batch.

use crate::tensor::Rng;
use anyhow::{bail, ensure, Result};

/// How the next token is chosen. The default is greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy), and the filters below then
    /// have no effect.
    pub temperature: f32,
    /// Keep the k most likely tokens (ties at the k-th logit kept too); 0: off.
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to at least p; 1: off.
    pub top_p: f32,
    /// Keep the tokens at least `min_p` times as likely as the most likely one; 0: off.
    pub min_p: f32,
    /// CTRL's penalty on every token already in the sequence (prompt included), as transformers
    /// applies it: a positive logit divided by it, a negative one multiplied; 1: off.
    pub repetition_penalty: f32,
    /// Seed of the per-sequence generators.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Every setting within its range, each error naming the setting.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.temperature.is_finite() && self.temperature >= 0.0,
            "temperature {} must be a finite number ≥ 0 (0: greedy)",
            self.temperature
        );
        ensure!(
            self.top_p > 0.0 && self.top_p <= 1.0,
            "top_p {} must be in (0, 1]",
            self.top_p
        );
        ensure!(
            (0.0..=1.0).contains(&self.min_p),
            "min_p {} must be in [0, 1]",
            self.min_p
        );
        ensure!(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "repetition_penalty {} must be a finite number > 0 (1: off)",
            self.repetition_penalty
        );
        Ok(())
    }
}

/// Applies the repetition penalty to the logits of every token in `seen` (each once).
pub fn apply_repetition_penalty(logits: &mut [f32], seen: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut done = std::collections::HashSet::new();
    for &id in seen {
        let Some(z) = logits.get_mut(id as usize) else {
            continue;
        };
        if done.insert(id) {
            *z = if *z < 0.0 { *z * penalty } else { *z / penalty };
        }
    }
}

/// The most likely token (the first of equal maxima, as `argmax` takes it).
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
            if v > b.1 {
                (i, v)
            } else {
                b
            }
        })
        .0 as u32
}

/// The tokens a sampled step may draw and their probabilities (summing to 1, most likely first):
/// the softmax of `logits / temperature`, cut by top-k, then top-p, then min-p (each filter
/// renormalises what is left, as transformers' processors do on the logits), never empty.
pub fn candidates(logits: &[f32], s: &Sampling) -> Vec<(u32, f64)> {
    let t = s.temperature.max(f32::MIN_POSITIVE) as f64;
    let mut c: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i as u32, z as f64 / t))
        .collect();
    // Most likely first; equal logits keep the lower id first.
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if s.top_k > 0 && s.top_k < c.len() {
        let kth = c[s.top_k - 1].1;
        let keep = c.iter().take_while(|x| x.1 >= kth).count();
        c.truncate(keep);
    }
    let probs = |c: &mut Vec<(u32, f64)>| {
        let m = c.first().map_or(0.0, |x| x.1);
        let z: f64 = c.iter().map(|x| (x.1 - m).exp()).sum();
        c.iter().map(|x| (x.1 - m).exp() / z).collect::<Vec<f64>>()
    };
    if s.top_p < 1.0 {
        let p = probs(&mut c);
        // Keep each token whose more likely predecessors sum to less than top_p.
        let mut before = 0.0;
        let keep = p
            .iter()
            .take_while(|&&pi| {
                let k = before < s.top_p as f64;
                before += pi;
                k
            })
            .count();
        c.truncate(keep.max(1));
    }
    if s.min_p > 0.0 {
        let p = probs(&mut c);
        let bar = s.min_p as f64 * p[0];
        let keep = p.iter().take_while(|&&pi| pi >= bar).count();
        c.truncate(keep.max(1));
    }
    let p = probs(&mut c);
    c.iter().zip(p).map(|(x, pi)| (x.0, pi)).collect()
}

/// Draws the next tokens of a batch's sequences, one seeded generator per sequence.
pub struct Sampler {
    cfg: Sampling,
    rngs: Vec<Rng>,
}

impl Sampler {
    pub fn new(cfg: &Sampling, seqs: usize) -> Result<Sampler> {
        cfg.validate()?;
        let rngs = (0..seqs as u64)
            .map(|b| Rng(cfg.seed ^ (b + 1).wrapping_mul(0xD1B5_4A32_D192_ED03)))
            .collect();
        Ok(Sampler {
            cfg: cfg.clone(),
            rngs,
        })
    }

    /// The next token of sequence `seq` from its logits (changed in place by the penalty);
    /// `history` is every token of the sequence so far, prompt included.
    pub fn next(&mut self, seq: usize, logits: &mut [f32], history: &[u32]) -> Result<u32> {
        if let Some((i, v)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!("logit {i} is {v}; the base weights or the adapter hold non-finite values");
        }
        apply_repetition_penalty(logits, history, self.cfg.repetition_penalty);
        if self.cfg.is_greedy() {
            return Ok(argmax(logits));
        }
        let c = candidates(logits, &self.cfg);
        let u = self.rngs[seq].uniform();
        let mut acc = 0.0;
        for &(id, p) in &c {
            acc += p;
            if u < acc {
                return Ok(id);
            }
        }
        // Rounding left the sum a hair under u: the least likely candidate.
        Ok(c.last().map_or(0, |x| x.0))
    }
}
