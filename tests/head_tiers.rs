//! The three head tiers (Full, Chunked, Fused) agree on the CPU; the fused linear cross-entropy
//! ops match a materialised-logits reference with and without a softcap, their backward matches
//! finite differences, the coefficient filter's error is bounded, and on real SmolLM2 hidden
//! states (teacher-forced) the filtered fused gradient matches the full one.
//!
//! Bounds (f32 CPU arithmetic; the reference materialises f32 logits, the fused op keeps an f64
//! log-sum-exp and f64 `dh` accumulation): logp within 2e-5·max(1, |logp|), dh relative norm
//! within 1e-5 with the filter off; with the default filter (1e-5) dh within 1e-2 relative norm.

mod common;
use common::*;
use lorafit::bench::named_shape;
use lorafit::model::weights::{load_weights, RandomSource};
use lorafit::model::Model;
use lorafit::tensor::cce::{cce_backward, cce_forward, DEFAULT_FILTER_EPS, IGNORE};
use lorafit::tensor::{self as ops, DType, Device, Tensor};
use lorafit::train::head::{
    logp_backward, logp_backward_saved, logp_forward, logp_forward_saved, HeadTier,
};

fn tiny_model(tied: bool) -> Model {
    let mut spec = named_shape("tiny").unwrap();
    spec.tie_embeddings = tied;
    let w = load_weights(
        &spec,
        &RandomSource {
            spec: spec.clone(),
            seed: 3,
        },
        &Device::Cpu,
    )
    .unwrap();
    Model::new(spec, w, Device::Cpu)
}

fn targets(n: usize, v: usize, seed: u64) -> Vec<u32> {
    let r = rand_vec(n, seed);
    (0..n)
        .map(|i| {
            if i % 7 == 2 {
                IGNORE
            } else {
                ((r[i].abs() * 7919.0) as usize % v) as u32
            }
        })
        .collect()
}

fn logp_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let tol = 2e-5 * (b.abs() as f64).max(1.0);
        assert!(
            (a as f64 - b as f64).abs() <= tol,
            "{what}: row {i}: {a} vs {b}"
        );
    }
}

/// Materialised reference: logits (capped), log-softmax gather and its backward, then `dL · W`.
fn reference(
    h: &Tensor,
    w: &Tensor,
    t: &[u32],
    dlogp: &[f32],
    cap: Option<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let raw = ops::matmul(h, false, w, true, 1.0, DType::F32).unwrap();
    let shape = raw.shape().to_vec();
    let raw = raw.to_vec().unwrap();
    let capped: Vec<f32> = raw
        .iter()
        .map(|&x| cap.map_or(x, |c| c * (x / c).tanh()))
        .collect();
    let logits = Tensor::cpu(capped.clone(), &shape).unwrap();
    let (logp, lse) = ops::logsoftmax_gather(&logits, t).unwrap();
    let g = Tensor::cpu(dlogp.to_vec(), &[t.len()]).unwrap();
    let d = ops::logsoftmax_gather_bwd(&g, &logits, &lse, t).unwrap();
    let mut d = d.to_vec().unwrap();
    for (i, x) in d.iter_mut().enumerate() {
        if t[i / shape[1]] == IGNORE {
            *x = 0.0;
        }
        if let Some(c) = cap {
            let th = capped[i] / c;
            *x *= 1.0 - th * th;
        }
    }
    let d = Tensor::cpu(d, &shape).unwrap();
    let dh = ops::matmul(&d, false, w, false, 1.0, DType::F32).unwrap();
    (logp.to_vec().unwrap(), dh.to_vec().unwrap())
}

#[test]
fn tiers_agree_on_random_hidden_states() {
    for tied in [true, false] {
        let model = tiny_model(tied);
        let (n, hd, v) = (50, model.spec.hidden, model.spec.vocab);
        let h: Vec<f32> = rand_vec(n * hd, 11).iter().map(|x| x * 20.0).collect();
        let h = Tensor::cpu(h, &[n, hd]).unwrap();
        let t = targets(n, v, 12);
        let dl = rand_vec(n, 13);
        let full = logp_forward(&model, &h, &t, HeadTier::Full, 0).unwrap();
        let chunked = logp_forward(&model, &h, &t, HeadTier::Chunked, 7).unwrap();
        let fused = logp_forward(&model, &h, &t, HeadTier::Fused, 0).unwrap();
        assert!(full.iter().any(|&x| x < -1.0), "logits not spread");
        logp_close("chunked vs full logp", &chunked, &full);
        logp_close("fused vs full logp", &fused, &full);
        for (i, &ti) in t.iter().enumerate() {
            if ti == IGNORE {
                assert_eq!(fused[i], 0.0, "ignored row {i} logp");
            }
        }
        let dfull = logp_backward(&model, &h, &t, &dl, HeadTier::Full, 0).unwrap();
        let dchunk = logp_backward(&model, &h, &t, &dl, HeadTier::Chunked, 7).unwrap();
        let dfused = logp_backward(&model, &h, &t, &dl, HeadTier::Fused, 0).unwrap();
        let (dfull, dchunk, dfused) = (
            dfull.to_vec().unwrap(),
            dchunk.to_vec().unwrap(),
            dfused.to_vec().unwrap(),
        );
        assert!(rel_norm(&dchunk, &dfull) < 1e-5, "chunked dh");
        // A training forward keeps d h / d logp; the backward then only scales rows. Same
        // gradient up to f32 rounding (the product is associated differently).
        for (tier, c) in [(HeadTier::Full, 0), (HeadTier::Chunked, 7)] {
            let (lp, saved) = logp_forward_saved(&model, &h, &t, tier, c, true).unwrap();
            logp_close("saved-forward logp", &lp.to_vec().unwrap(), &full);
            let g = Tensor::from_f32(&dl, &[dl.len()], DType::F32, h.device()).unwrap();
            let d = logp_backward_saved(&model, &h, &t, &g, tier, c, saved).unwrap();
            let r = rel_norm(&d.to_vec().unwrap(), &dfull);
            assert!(r < 1e-5, "{tier:?} dh from the saved forward: rel-norm {r}");
        }
        // The tier runs with the default filter: bounded difference.
        let rf = rel_norm(&dfused, &dfull);
        assert!(rf < 1e-2, "fused (filtered) dh rel-norm {rf}");
        // Filter off: f32 agreement.
        let w = model.weights.head().dense().unwrap();
        let (_, lse) = cce_forward(&h, &w, &t, None).unwrap();
        let g = Tensor::cpu(dl.clone(), &[n]).unwrap();
        let exact = cce_backward(&h, &w, &t, &g, &lse, None, 0.0).unwrap();
        let exact = exact.to_vec().unwrap();
        let re = rel_norm(&exact, &dfull);
        assert!(
            re < 1e-5,
            "fused (filter off) dh rel-norm {re} (tied {tied})"
        );
        for (i, &ti) in t.iter().enumerate() {
            if ti == IGNORE {
                assert!(exact[i * hd..(i + 1) * hd].iter().all(|&x| x == 0.0));
            }
        }
        eprintln!("tied {tied}: dh rel-norm filter-off {re:.2e}, filter 1e-5 {rf:.2e}");
    }
}

#[test]
fn fused_ops_match_reference_with_and_without_softcap() {
    let (n, hd, v) = (33, 40, 5000);
    let h = Tensor::cpu(rand_vec(n * hd, 21), &[n, hd]).unwrap();
    let w: Vec<f32> = rand_vec(v * hd, 22).iter().map(|x| x * 3.0).collect();
    let w = Tensor::cpu(w, &[v, hd]).unwrap();
    let t = targets(n, v, 23);
    let dl = rand_vec(n, 24);
    let g = Tensor::cpu(dl.clone(), &[n]).unwrap();
    for cap in [None, Some(5.0f32)] {
        let (lp_ref, dh_ref) = reference(&h, &w, &t, &dl, cap);
        let (lp, lse) = cce_forward(&h, &w, &t, cap).unwrap();
        logp_close(&format!("logp cap {cap:?}"), &lp.to_vec().unwrap(), &lp_ref);
        let dh0 = cce_backward(&h, &w, &t, &g, &lse, cap, 0.0)
            .unwrap()
            .to_vec()
            .unwrap();
        let r0 = rel_norm(&dh0, &dh_ref);
        assert!(r0 < 1e-5, "dh cap {cap:?} filter off: {r0}");
        let dh1 = cce_backward(&h, &w, &t, &g, &lse, cap, DEFAULT_FILTER_EPS)
            .unwrap()
            .to_vec()
            .unwrap();
        let r1 = rel_norm(&dh1, &dh_ref);
        assert!(r1 < 1e-2, "dh cap {cap:?} filter 1e-5: {r1}");
        eprintln!("cap {cap:?}: dh rel-norm filter-off {r0:.2e}, filter 1e-5 {r1:.2e}");
    }
}

#[test]
fn cce_backward_matches_finite_differences() {
    let (n, hd, v) = (3, 12, 37);
    let h0 = rand_vec(n * hd, 31);
    let w = Tensor::cpu(rand_vec(v * hd, 32), &[v, hd]).unwrap();
    let t = vec![5u32, IGNORE, 36];
    let dl = vec![0.7f32, 1.3, -0.4];
    for cap in [None, Some(2.0f32)] {
        let loss = |hv: &[f32]| -> f64 {
            let h = Tensor::cpu(hv.to_vec(), &[n, hd]).unwrap();
            let (lp, _) = cce_forward(&h, &w, &t, cap).unwrap();
            lp.to_vec()
                .unwrap()
                .iter()
                .zip(&dl)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        };
        let h = Tensor::cpu(h0.clone(), &[n, hd]).unwrap();
        let (_, lse) = cce_forward(&h, &w, &t, cap).unwrap();
        let g = Tensor::cpu(dl.clone(), &[n]).unwrap();
        let dh = cce_backward(&h, &w, &t, &g, &lse, cap, 0.0)
            .unwrap()
            .to_vec()
            .unwrap();
        let eps = 1e-2f32;
        for i in 0..n * hd {
            let mut hp = h0.clone();
            hp[i] += eps;
            let mut hm = h0.clone();
            hm[i] -= eps;
            let fd = (loss(&hp) - loss(&hm)) / (2.0 * eps as f64);
            let err = (fd - dh[i] as f64).abs();
            assert!(
                err < 2e-3 * (1.0 + fd.abs()),
                "cap {cap:?} coord {i}: fd {fd} vs analytic {}",
                dh[i]
            );
        }
    }
}

/// Teacher-forced fidelity on real hidden states: SmolLM2's final hidden states over a real
/// sentence, fused (filter 1e-5) against the full tier.
#[test]
fn fused_matches_full_on_smollm2_hidden_states() {
    let Some(path) = smollm2_or_skip("fused_matches_full_on_smollm2_hidden_states") else {
        return;
    };
    let model = lorafit::model::load(&path, &Device::Cpu).unwrap();
    let g = lorafit::model::gguf::GgufFile::open(&path).unwrap();
    let (tok, _) = lorafit::data::gguf_tokenizer::load_gguf_tokenizer(&g).unwrap();
    let text = "The capital of France is Paris, a city on the Seine known for its museums, its \
                cafes and the tower Gustave Eiffel built for the World's Fair of 1889. Each year \
                millions of visitors climb its stairs to look out over the rooftops of the old \
                city and the river below.";
    let mut ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    ids.truncate(65);
    assert!(ids.len() >= 48, "sentence gave {} tokens", ids.len());
    let hidden = model.hidden_states(&ids, None).unwrap();
    let n = ids.len() - 1;
    let h = ops::slice_rows(&hidden, 0, n).unwrap();
    let t: Vec<u32> = ids[1..].to_vec();
    let dl = vec![-1.0 / n as f32; n];
    let full = logp_forward(&model, &h, &t, HeadTier::Full, 0).unwrap();
    let fused = logp_forward(&model, &h, &t, HeadTier::Fused, 0).unwrap();
    let (dlp, _) = max_diff(&fused, &full);
    assert!(dlp < 1e-4, "logp max diff {dlp}");
    let dfull = logp_backward(&model, &h, &t, &dl, HeadTier::Full, 0)
        .unwrap()
        .to_vec()
        .unwrap();
    let w = model.weights.head().dense().unwrap();
    let (_, lse) = cce_forward(&h, &w, &t, None).unwrap();
    let gt = Tensor::cpu(dl.clone(), &[n]).unwrap();
    let dfused = cce_backward(&h, &w, &t, &gt, &lse, None, 1e-5)
        .unwrap()
        .to_vec()
        .unwrap();
    let dot: f64 = dfused
        .iter()
        .zip(&dfull)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum();
    let na: f64 = dfused
        .iter()
        .map(|&a| (a as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let nb: f64 = dfull
        .iter()
        .map(|&a| (a as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let cos = dot / (na * nb);
    let rn = rel_norm(&dfused, &dfull);
    let mean_nll = -full.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    eprintln!(
        "smollm2 teacher-forced ({n} tokens, mean NLL {mean_nll:.3}): logp max diff {dlp:.2e}, dh cos {cos:.7}, rel-norm {rn:.2e} (filter 1e-5)"
    );
    assert!(cos > 0.999, "dh cosine {cos}");
    assert!(rn < 1e-2, "dh rel-norm {rn}");
}

fn capped_model(tied: bool, cap: f32) -> Model {
    let mut spec = named_shape("tiny").unwrap();
    spec.tie_embeddings = tied;
    spec.final_logit_softcap = Some(cap);
    let w = load_weights(
        &spec,
        &RandomSource {
            spec: spec.clone(),
            seed: 3,
        },
        &Device::Cpu,
    )
    .unwrap();
    Model::new(spec, w, Device::Cpu)
}

/// `Σ dl · logp` of one tier, in f64.
fn head_loss(model: &Model, h: &[f32], t: &[u32], dl: &[f32], tier: HeadTier, c: usize) -> f64 {
    let ht = Tensor::cpu(h.to_vec(), &[t.len(), model.spec.hidden]).unwrap();
    logp_forward(model, &ht, t, tier, c)
        .unwrap()
        .iter()
        .zip(dl)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

/// With a final logit softcap (cap 2 against raw logits of spread ~±10), every tier, saved or
/// recomputed, gives the materialised capped reference's logp and dh, and the cap really acts.
#[test]
fn softcapped_tiers_agree_with_reference() {
    let cap = 2.0f32;
    for tied in [true, false] {
        let model = capped_model(tied, cap);
        let (n, hd, v) = (50, model.spec.hidden, model.spec.vocab);
        let hv: Vec<f32> = rand_vec(n * hd, 11).iter().map(|x| x * 20.0).collect();
        let h = Tensor::cpu(hv, &[n, hd]).unwrap();
        let t = targets(n, v, 12);
        let dl = rand_vec(n, 13);
        let w = model.weights.head().dense().unwrap();
        let raw = model.raw_logits(&h, DType::F32).unwrap().to_vec().unwrap();
        let zmax = max_abs(&raw);
        assert!(zmax > 3.0 * cap as f64, "raw logits reach only {zmax}");
        let (lp_ref, dh_ref) = reference(&h, &w, &t, &dl, Some(cap));
        let (lp_raw, _) = reference(&h, &w, &t, &dl, None);
        let (moved, _) = max_diff(&lp_ref, &lp_raw);
        assert!(moved > 1.0, "the cap changed logp by only {moved}");
        let g = Tensor::cpu(dl.clone(), &[n]).unwrap();
        for (tier, c) in [
            (HeadTier::Full, 0),
            (HeadTier::Chunked, 7),
            (HeadTier::Fused, 0),
        ] {
            let lp = logp_forward(&model, &h, &t, tier, c).unwrap();
            logp_close(&format!("{tier:?} capped logp"), &lp, &lp_ref);
            let d = logp_backward(&model, &h, &t, &dl, tier, c).unwrap();
            let r = rel_norm(&d.to_vec().unwrap(), &dh_ref);
            let (lp2, saved) = logp_forward_saved(&model, &h, &t, tier, c, true).unwrap();
            logp_close("saved-forward capped logp", &lp2.to_vec().unwrap(), &lp_ref);
            let ds = logp_backward_saved(&model, &h, &t, &g, tier, c, saved).unwrap();
            let rs = rel_norm(&ds.to_vec().unwrap(), &dh_ref);
            // The fused tier runs with the default coefficient filter.
            let tol = if tier == HeadTier::Fused { 1e-2 } else { 1e-5 };
            assert!(
                r < tol && rs < tol,
                "{tier:?} capped dh rel-norm {r:.2e} / saved {rs:.2e}"
            );
            eprintln!("tied {tied} {tier:?}: capped dh rel-norm {r:.2e}, from saved {rs:.2e}");
        }
        // The fused kernels with the filter off: f32 agreement.
        let (_, lse) = cce_forward(&h, &w, &t, Some(cap)).unwrap();
        let exact = cce_backward(&h, &w, &t, &g, &lse, Some(cap), 0.0).unwrap();
        let re = rel_norm(&exact.to_vec().unwrap(), &dh_ref);
        assert!(re < 1e-5, "fused (filter off) capped dh rel-norm {re}");
    }
}

/// The softcapped head of every tier against central differences of `Σ dl · logp` in `h`
/// (non-uniform `dl`, an ignored row, chunks that do not divide the rows).
#[test]
fn softcapped_head_matches_finite_differences() {
    let cap = 2.0f32;
    let model = capped_model(false, cap);
    let (n, hd, v) = (10, model.spec.hidden, model.spec.vocab);
    let h0: Vec<f32> = rand_vec(n * hd, 41).iter().map(|x| x * 20.0).collect();
    let mut t = targets(n, v, 42);
    t[4] = IGNORE;
    let dl: Vec<f32> = rand_vec(n, 43).iter().map(|x| x + 0.3).collect();
    let idx: Vec<usize> = (0..n * hd).step_by(7).collect();
    // Step: a head weight is ~0.02, so a step of 0.5 in h moves a logit by ~1e-2 (against a cap
    // of 2: truncation ~(1e-2)²/6, 1e-5 relative) and the loss by ~1e-2, far above the f32
    // rounding of the forward (~4e-6 over 10 rows of |logp| ~ 6).
    let eps = 0.5f32;
    for (tier, c) in [
        (HeadTier::Full, 0),
        (HeadTier::Chunked, 3),
        (HeadTier::Fused, 0),
    ] {
        let h = Tensor::cpu(h0.clone(), &[n, hd]).unwrap();
        let dh = logp_backward(&model, &h, &t, &dl, tier, c)
            .unwrap()
            .to_vec()
            .unwrap();
        assert!(dh[4 * hd..5 * hd].iter().all(|&x| x == 0.0), "ignored row");
        let (mut an, mut fd) = (Vec::new(), Vec::new());
        for &i in &idx {
            let mut hp = h0.clone();
            hp[i] += eps;
            let mut hm = h0.clone();
            hm[i] -= eps;
            let lp = head_loss(&model, &hp, &t, &dl, tier, c);
            let lm = head_loss(&model, &hm, &t, &dl, tier, c);
            fd.push(((lp - lm) / (hp[i] as f64 - hm[i] as f64)) as f32);
            an.push(dh[i]);
        }
        let r = rel_norm(&an, &fd);
        let scale = max_abs(&fd);
        assert!(
            scale > 1e-3,
            "{tier:?}: FD gradient negligible ({scale:.2e})"
        );
        // Full and Chunked are exact; the fused tier keeps the default coefficient filter.
        let tol = if tier == HeadTier::Fused { 1e-2 } else { 2e-3 };
        eprintln!(
            "{tier:?} capped head: {} entries, max|grad| {scale:.3e}, FD rel-norm {r:.2e}",
            idx.len()
        );
        assert!(r < tol, "{tier:?} capped dh vs FD: rel-norm {r:.3e}");
    }
}
