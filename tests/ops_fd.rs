//! Finite-difference checks of every hand-written backward on the CPU reference backend, and of
//! the whole model's LoRA gradients.
//!
//! Why this file exists: `model_parity.rs` compares against PyTorch fixtures, which only covers
//! the shapes and masks the fixtures happen to use, and the CUDA kernels are tested against the
//! CPU ops, so a wrong CPU backward would silently become the "reference". Here every op's
//! backward is checked against the definition of a derivative instead: for a non-uniform random
//! cotangent `c` the scalar `L(x) = Σ c ∘ f(x)` (summed in f64 from the f32 forward) has gradient
//! `∂L/∂x = f'(x)ᵀ c`, which is exactly what the backward is given `c` as the upstream gradient;
//! the test perturbs input elements with central differences `(L(x+h) − L(x−h)) / 2h` and
//! compares.
//!
//! Error budget (f32 forward, f64 loss accumulation): the forward's rounding noise in `L` is about
//! `√N · 6e-8 · |y|` for N outputs, i.e. 1e-7..1e-6 here; divided by `2h = 2e-2` that is an
//! absolute FD error of ~1e-5..5e-5 against gradients of order 0.1..3, so ~1e-4 relative. The
//! central-difference truncation error is `h²/6 · f'''`, ~2e-5·|f'''| with h = 1e-2, zero for
//! the linear ops. Unless stated otherwise: linear ops use rel-norm ≤ 1e-3, smooth nonlinear ops
//! rel-norm ≤ 2e-3 — an order of magnitude above the budget, yet a wrong term in a backward (a
//! missing factor, a sign, a dropped mask or head) gives errors of order 1e-1..1. Every check also
//! bounds the worst single element (max |diff| ≤ 5·tol·max|grad|) and asserts the gradient is not
//! trivially small, so no check passes vacuously. Observed op errors are 1e-8..1.3e-4 rel-norm.
//!
//! The whole-model checks (tiny random 2-layer Llama, Qwen3, Qwen2 and Mistral models with LoRA on
//! all seven projections, T = 9) use Richardson-extrapolated central differences because the
//! model is strongly curved in some LoRA parameters; their step and tolerances are justified at
//! `MODEL_H`. Two meta-tests show the checks have teeth: a subtly wrong silu' (and a 0.5% scale
//! error) is rejected at the op tolerance, and LoRA gradients of a different dropout mask are
//! rejected at the model tolerance.

mod common;
use common::*;
use lorafit::model::config::{RopeScaling, RopeSpec};
use lorafit::model::weights::{load_weights, RandomSource, Weight};
use lorafit::model::{ForwardPlan, Lora, LoraConfig, Model, ModelSpec, PassCtx, Target};
use lorafit::tensor::Rng;
use lorafit::tensor::{self as ops, AttnMask, AttnShape, DType, Device, RopeTable, Tensor};

// ------------------------------------------------------------------------------------------------
// Helpers

/// Step for the central differences of the op checks (inputs are O(1)).
const H: f32 = 1e-2;
/// Tolerance (rel-norm) for ops that are linear in the perturbed input: FD is exact up to
/// rounding (~1e-5 relative, see the module doc).
const TOL_LINEAR: f64 = 1e-3;
/// Tolerance (rel-norm) for smooth nonlinear ops: rounding ~1e-4 plus truncation ~1e-4.
const TOL_SMOOTH: f64 = 2e-3;

fn t(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::cpu(data.to_vec(), shape).unwrap()
}

/// `rand_vec` scaled by `s`.
fn rv(n: usize, seed: u64, s: f32) -> Vec<f32> {
    rand_vec(n, seed).into_iter().map(|x| x * s).collect()
}

/// `Σ c ∘ y` in f64.
fn dotc(c: &[f32], y: &Tensor) -> f64 {
    let y = y.as_cpu().unwrap();
    assert_eq!(c.len(), y.len(), "cotangent / output size mismatch");
    c.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// All indices when `n ≤ k`, else `k` distinct indices drawn deterministically from `seed`.
fn sample(n: usize, k: usize, seed: u64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..n).collect();
    if n <= k {
        return idx;
    }
    let mut r = Rng(seed);
    for i in 0..k {
        let j = i + (r.next_u64() % (n - i) as u64) as usize;
        idx.swap(i, j);
    }
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// Central-difference derivative of `loss` with respect to `x[i]` for each `i` in `idx`. The
/// denominator is the step actually taken after f32 rounding of `x ± h`.
fn fd_grad(x: &[f32], idx: &[usize], h: f32, mut loss: impl FnMut(&[f32]) -> f64) -> Vec<f32> {
    let mut xv = x.to_vec();
    idx.iter()
        .map(|&i| {
            let x0 = xv[i];
            let (xp, xm) = (x0 + h, x0 - h);
            xv[i] = xp;
            let lp = loss(&xv);
            xv[i] = xm;
            let lm = loss(&xv);
            xv[i] = x0;
            ((lp - lm) / (xp as f64 - xm as f64)) as f32
        })
        .collect()
}

/// Richardson-extrapolated central differences, `(4·D(h/2) − D(h)) / 3`: the `h²` truncation
/// terms cancel, leaving `O(h⁴)`, at ~1.5× the rounding noise of `D(h/2)`. Used for the
/// whole-model checks, where the loss is strongly curved in some parameters (see `MODEL_H`).
fn fd_grad_richardson(
    x: &[f32],
    idx: &[usize],
    h: f32,
    mut loss: impl FnMut(&[f32]) -> f64,
) -> Vec<f32> {
    let d1 = fd_grad(x, idx, h, &mut loss);
    let d2 = fd_grad(x, idx, h / 2.0, &mut loss);
    d1.iter()
        .zip(&d2)
        .map(|(&a, &b)| ((4.0 * b as f64 - a as f64) / 3.0) as f32)
        .collect()
}

/// Compares the analytic gradient (at `idx`) with the FD one: rel-norm ≤ `tol`, worst element
/// ≤ 5·tol·max|fd|, and the gradient must not be negligible. Returns the rel-norm error.
fn fd_compare(
    what: &str,
    analytic: &[f32],
    idx: &[usize],
    fd: &[f32],
    tol: f64,
) -> Result<f64, String> {
    let an: Vec<f32> = idx.iter().map(|&i| analytic[i]).collect();
    let scale = max_abs(fd);
    if scale < 1e-3 {
        return Err(format!(
            "{what}: FD gradient is negligible (max {scale:.2e}); the check would be vacuous"
        ));
    }
    let rn = rel_norm(&an, fd);
    let (md, i) = max_diff(&an, fd);
    eprintln!(
        "{what}: {} entries, max|grad| {scale:.3e}, rel-norm {rn:.2e}, max|diff| {md:.2e} (tol {tol:.0e})",
        idx.len()
    );
    if rn > tol || md > 5.0 * tol * scale {
        return Err(format!(
            "{what}: analytic backward disagrees with finite differences: rel-norm {rn:.3e} \
             (tol {tol:.1e}), max|diff| {md:.3e} at element {} (analytic {} vs FD {}), \
             max|FD grad| {scale:.3e}",
            idx[i], an[i], fd[i]
        ));
    }
    Ok(rn)
}

fn check(what: &str, analytic: &[f32], idx: &[usize], fd: &[f32], tol: f64) {
    if let Err(e) = fd_compare(what, analytic, idx, fd, tol) {
        panic!("{e}");
    }
}

/// FD of `loss` at every element of `x` (or a deterministic sample of 400 for larger inputs; every
/// op input below is ≤ 400 elements, so all are checked) against `analytic`.
fn check_all(what: &str, x: &[f32], analytic: &[f32], tol: f64, loss: impl FnMut(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{what}: gradient shape");
    let idx = sample(x.len(), 400, 0xFD ^ x.len() as u64);
    let fd = fd_grad(x, &idx, H, loss);
    check(what, analytic, &idx, &fd, tol);
}

// ------------------------------------------------------------------------------------------------
// Meta-test: the checker must reject a subtly wrong backward.

#[test]
fn fd_checker_rejects_a_wrong_backward() {
    let n = 60;
    let g = rv(n, 1, 3.0);
    let u = rv(n, 2, 1.0);
    let c = rand_vec(n, 3);
    // A plausible bug: silu'(g) taken as sigmoid(g) (dropping the g·σ(1−σ) term).
    let wrong: Vec<f32> = (0..n)
        .map(|i| {
            let sig = 1.0 / (1.0 + (-g[i]).exp());
            c[i] * u[i] * sig
        })
        .collect();
    let idx = sample(n, n, 0);
    let fd = fd_grad(&g, &idx, H, |x| {
        dotc(&c, &ops::silu_mul(&t(x, &[n]), &t(&u, &[n])).unwrap())
    });
    assert!(fd_compare("wrong silu'", &wrong, &idx, &fd, TOL_SMOOTH).is_err());
    // And a right one within a 0.5% scale error is also caught at the smooth tolerance.
    let (dg, _) = ops::silu_mul_bwd(&t(&c, &[n]), &t(&g, &[n]), &t(&u, &[n])).unwrap();
    let scaled: Vec<f32> = dg.as_cpu().unwrap().iter().map(|x| x * 1.005).collect();
    assert!(fd_compare("scaled silu'", &scaled, &idx, &fd, TOL_SMOOTH).is_err());
    assert!(fd_compare("right silu'", dg.as_cpu().unwrap(), &idx, &fd, TOL_SMOOTH).is_ok());
}

// ------------------------------------------------------------------------------------------------
// Op checks

#[test]
fn embedding_bwd_matches_fd_with_repeated_ids() {
    let (v, h) = (7, 5);
    // Id 3 three times, 1 twice; rows 2, 4, 5 unused (their gradient must be exactly zero).
    let ids = [3u32, 1, 3, 0, 6, 3, 1];
    let table = rv(v * h, 10, 1.0);
    let c = rand_vec(ids.len() * h, 11);
    let g = ops::embedding_bwd(&t(&c, &[ids.len(), h]), &ids, v).unwrap();
    assert_eq!(g.shape(), &[v, h]);
    let g = g.as_cpu().unwrap();
    for row in [2, 4, 5] {
        assert!(g[row * h..(row + 1) * h].iter().all(|&x| x == 0.0));
    }
    // Linear in the table: TOL_LINEAR.
    check_all("embedding d(table)", &table, g, TOL_LINEAR, |x| {
        dotc(&c, &ops::embedding(&t(x, &[v, h]), &ids).unwrap())
    });
}

#[test]
fn rms_norm_bwd_matches_fd() {
    let (rows, h) = (6, 16);
    // Rows of very different scale (0.3 .. 3) and a non-uniform weight.
    let mut x = rv(rows * h, 20, 1.0);
    for r in 0..rows {
        let s = 0.3 + 0.54 * r as f32;
        x[r * h..(r + 1) * h].iter_mut().for_each(|v| *v *= s);
    }
    let w: Vec<f32> = rv(h, 21, 0.5).into_iter().map(|v| 1.0 + v).collect();
    let c = rand_vec(rows * h, 22);
    let eps = 1e-6;
    let wt = t(&w, &[h]);
    let (_, rstd) = ops::rms_norm(&t(&x, &[rows, h]), &wt, eps).unwrap();
    let dx = ops::rms_norm_bwd(&t(&c, &[rows, h]), &t(&x, &[rows, h]), &wt, &rstd).unwrap();
    // Smooth nonlinear; the smallest row has ‖x‖ ≈ 0.7, so h = 1e-2 moves rstd by < 2%:
    // truncation ~(h/‖x‖)²/6 ≈ 3e-5 relative. TOL_SMOOTH.
    check_all("rms_norm dx", &x, dx.as_cpu().unwrap(), TOL_SMOOTH, |xv| {
        dotc(&c, &ops::rms_norm(&t(xv, &[rows, h]), &wt, eps).unwrap().0)
    });
}

fn rope_case(what: &str, inv_freq: &[f32]) {
    let positions = [5i32, 0, 3, 3, 100, 7];
    let (nh, hd) = (2, 2 * inv_freq.len());
    let tt = positions.len();
    let width = nh * hd;
    let table = RopeTable::new(&positions, inv_freq, &Device::Cpu).unwrap();
    let x = rv(tt * width, 30, 1.0);
    let c = rand_vec(tt * width, 31);
    // The backward of rope w.r.t. x is the inverse rotation applied to the upstream gradient.
    let dx = ops::rope(&t(&c, &[tt, width]), &table, nh, true).unwrap();
    // Linear (a rotation): TOL_LINEAR.
    check_all(what, &x, dx.as_cpu().unwrap(), TOL_LINEAR, |xv| {
        dotc(
            &c,
            &ops::rope(&t(xv, &[tt, width]), &table, nh, false).unwrap(),
        )
    });
    // The rotation is not the identity at these positions (otherwise the check above would not
    // distinguish forward from inverse), and inverse ∘ forward is the identity.
    let y = ops::rope(&t(&x, &[tt, width]), &table, nh, false).unwrap();
    assert!(
        max_diff(y.as_cpu().unwrap(), &x).0 > 0.1,
        "{what}: rope did nothing"
    );
    let back = ops::rope(&y, &table, nh, true).unwrap();
    assert_close(
        &format!("{what} inverse∘rope"),
        back.as_cpu().unwrap(),
        &x,
        1e-6,
    );
}

#[test]
fn rope_inverse_is_the_backward_plain_freqs() {
    let hd = 8;
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| (1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64)) as f32)
        .collect();
    rope_case("rope dx (plain inv_freq)", &inv);
}

#[test]
fn rope_inverse_is_the_backward_scaled_freqs() {
    let hd = 8;
    // Linear scaling by 4.
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| (0.25 / 10000f64.powf(2.0 * i as f64 / hd as f64)) as f32)
        .collect();
    rope_case("rope dx (linear-scaled inv_freq)", &inv);
    // Llama 3.1 piecewise scaling via the spec (head_dim 8 with theta 5e5 puts one frequency in
    // each of the three regimes).
    let spec = ModelSpec::from_config_json(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":48,
            "num_hidden_layers":1,"num_attention_heads":4,"vocab_size":16,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
    )
    .unwrap();
    rope_case("rope dx (llama3-scaled inv_freq)", &spec.inv_freq());
}

#[test]
fn rope_inverse_is_the_backward_proportional_freqs() {
    // Gemma 4's proportional RoPE: the first 2 of 6 pairs rotate, the others have frequency 0.
    let spec = RopeSpec {
        theta: 1e6,
        scaling: RopeScaling::Proportional {
            rotated_pairs: 2,
            factor: 1.0,
        },
        dims: 12,
    };
    let inv = spec.inv_freq(0);
    assert_eq!(inv.len(), 6);
    assert!(inv[..2].iter().all(|&f| f > 0.0) && inv[2..].iter().all(|&f| f == 0.0));
    assert_eq!(inv[1], (1.0 / 1e6f64.powf(2.0 / 12.0)) as f32);
    rope_case("rope dx (proportional inv_freq)", &inv);
    // The pairs that do not rotate pass through unchanged.
    let positions = [5i32, 9];
    let table = RopeTable::new(&positions, &inv, &Device::Cpu).unwrap();
    let x = rv(2 * 12, 40, 1.0);
    let y = ops::rope(&t(&x, &[2, 12]), &table, 1, false).unwrap();
    let y = y.as_cpu().unwrap();
    for row in 0..2 {
        for i in (2..6).chain(8..12) {
            assert_eq!(
                y[row * 12 + i],
                x[row * 12 + i],
                "dim {i} of row {row} moved"
            );
        }
    }
}

fn attention_case(what: &str, mask: &AttnMask, nh: usize, nkv: usize) {
    attention_case_capped(what, mask, nh, nkv, None, 1.5);
}

/// `attention_case` with a logit softcap and q, k drawn at scale `qk` (scores of order ±qk²).
fn attention_case_capped(
    what: &str,
    mask: &AttnMask,
    nh: usize,
    nkv: usize,
    softcap: Option<f32>,
    qk: f32,
) {
    let (tt, hd) = (mask.len(), 8);
    let s = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        softcap,
    };
    let (qw, kw) = (nh * hd, nkv * hd);
    // Scores of order ±3 at qk = 1.5: a far-from-uniform softmax.
    let q = rv(tt * qw, 40, qk);
    let k = rv(tt * kw, 41, qk);
    let v = rv(tt * kw, 42, 1.0);
    let c = rand_vec(tt * qw, 43);
    let attn = |q: &[f32], k: &[f32], v: &[f32]| -> Tensor {
        ops::attention(
            &t(q, &[tt, qw]),
            &t(k, &[tt, kw]),
            &t(v, &[tt, kw]),
            mask,
            s,
        )
        .unwrap()
        .0
    };
    let (o, lse) = ops::attention(
        &t(&q, &[tt, qw]),
        &t(&k, &[tt, kw]),
        &t(&v, &[tt, kw]),
        mask,
        s,
    )
    .unwrap();
    let (dq, dk, dv) = ops::attention_bwd(
        &t(&c, &[tt, qw]),
        &t(&q, &[tt, qw]),
        &t(&k, &[tt, kw]),
        &t(&v, &[tt, kw]),
        &o,
        &lse,
        mask,
        s,
    )
    .unwrap();
    // Smooth (softmax of bilinear scores) in q and k: TOL_SMOOTH. Linear in v: TOL_LINEAR.
    check_all(
        &format!("{what} dq"),
        &q,
        dq.as_cpu().unwrap(),
        TOL_SMOOTH,
        |x| dotc(&c, &attn(x, &k, &v)),
    );
    check_all(
        &format!("{what} dk"),
        &k,
        dk.as_cpu().unwrap(),
        TOL_SMOOTH,
        |x| dotc(&c, &attn(&q, x, &v)),
    );
    check_all(
        &format!("{what} dv"),
        &v,
        dv.as_cpu().unwrap(),
        TOL_LINEAR,
        |x| dotc(&c, &attn(&q, &k, x)),
    );
}

#[test]
fn attention_bwd_matches_fd_causal() {
    attention_case("attention causal", &AttnMask::causal(10), 2, 2);
}

#[test]
fn attention_bwd_matches_fd_gqa() {
    attention_case("attention causal GQA 4/2", &AttnMask::causal(10), 4, 2);
}

#[test]
fn attention_bwd_matches_fd_prefix_shared() {
    let mask = AttnMask::prefix_shared(4, 3, 3);
    assert_eq!(mask.positions, vec![0, 1, 2, 3, 4, 5, 6, 4, 5, 6]);
    attention_case("attention prefix-shared(4,3,3) GQA", &mask, 4, 2);

    // Rejected queries must not depend on chosen keys/values: with a cotangent only on the
    // rejected rows, dk and dv of the chosen rows are exactly zero.
    let (tt, hd, nh, nkv) = (10, 8, 4, 2);
    let s = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        softcap: None,
    };
    let q = t(&rv(tt * nh * hd, 40, 1.5), &[tt, nh * hd]);
    let k = t(&rv(tt * nkv * hd, 41, 1.5), &[tt, nkv * hd]);
    let v = t(&rv(tt * nkv * hd, 42, 1.0), &[tt, nkv * hd]);
    let mut c = rand_vec(tt * nh * hd, 43);
    c[..7 * nh * hd].iter_mut().for_each(|x| *x = 0.0);
    let (o, lse) = ops::attention(&q, &k, &v, &mask, s).unwrap();
    let (_, dk, dv) =
        ops::attention_bwd(&t(&c, &[tt, nh * hd]), &q, &k, &v, &o, &lse, &mask, s).unwrap();
    let (dk, dv) = (dk.as_cpu().unwrap(), dv.as_cpu().unwrap());
    let chosen = 4 * nkv * hd..7 * nkv * hd;
    assert!(dk[chosen.clone()].iter().all(|&x| x == 0.0));
    assert!(dv[chosen].iter().all(|&x| x == 0.0));
    // ... while the prompt rows do get gradient from the rejected queries.
    assert!(max_abs(&dv[..4 * nkv * hd]) > 1e-3);
}

#[test]
fn attention_bwd_matches_fd_sliding_window() {
    let mask = AttnMask::causal(10).with_window(Some(3));
    attention_case("attention causal window 3 GQA", &mask, 4, 2);
    // The window really cuts: query 9 does not see key 0.
    assert!(!mask.visible(9, 0) && mask.visible(9, 7) && !mask.visible(9, 6));
    let mask = AttnMask::prefix_shared(4, 3, 3).with_window(Some(3));
    attention_case("attention prefix-shared window 3", &mask, 2, 1);
}

#[test]
fn attention_bwd_matches_fd_softcap() {
    // Scores of standard deviation 1.6 (up to about ±5) against a cap of 1.5: a third of them
    // reach the cap (|s/c| > 1, where the tanh's derivative is below 0.42).
    let (tt, hd) = (10, 8);
    let q = rv(tt * 4 * hd, 40, 2.2);
    let k = rv(tt * 2 * hd, 41, 2.2);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut capped = 0;
    for i in 0..tt {
        for j in 0..tt {
            let raw = scale
                * (0..hd)
                    .map(|d| q[i * 4 * hd + d] * k[j * 2 * hd + d])
                    .sum::<f32>();
            capped += (raw.abs() > 1.5) as usize;
        }
    }
    assert!(capped > tt * tt / 4, "only {capped} scores reach the cap");
    let cap = Some(1.5);
    let causal = AttnMask::causal(tt);
    attention_case_capped(
        "attention softcap 1.5 causal GQA 4/2",
        &causal,
        4,
        2,
        cap,
        2.2,
    );
    let mask = AttnMask::causal(tt).with_window(Some(3));
    attention_case_capped("attention softcap window 3 GQA 4/2", &mask, 4, 2, cap, 2.2);
    let mask = AttnMask::prefix_shared(4, 3, 3).with_window(Some(4));
    attention_case_capped(
        "attention softcap prefix-shared window 4",
        &mask,
        4,
        1,
        cap,
        2.2,
    );
    let mask = AttnMask::prefix_shared(4, 3, 3);
    attention_case_capped("attention softcap prefix-shared", &mask, 2, 2, cap, 2.2);
    // The cap really applies: the forward differs from the uncapped one.
    let s = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: hd,
        scale,
        softcap: cap,
    };
    let (qt, kt) = (t(&q, &[tt, 4 * hd]), t(&k, &[tt, 2 * hd]));
    let v = t(&rv(tt * 2 * hd, 42, 1.0), &[tt, 2 * hd]);
    let (o1, l1) = ops::attention(&qt, &kt, &v, &causal, s).unwrap();
    let uncapped = AttnShape { softcap: None, ..s };
    let (o2, l2) = ops::attention(&qt, &kt, &v, &causal, uncapped).unwrap();
    assert!(rel_norm(o1.as_cpu().unwrap(), o2.as_cpu().unwrap()) > 1e-2);
    let bound = 1.5 + 10f64.ln();
    assert!(max_abs(l1.as_cpu().unwrap()) <= bound + 1e-4);
    assert!(max_abs(l2.as_cpu().unwrap()) > bound);
}

#[test]
fn silu_mul_bwd_matches_fd() {
    let (r, c_) = (5, 12);
    let n = r * c_;
    let g = rv(n, 50, 4.0);
    let u = rv(n, 51, 1.5);
    let c = rand_vec(n, 52);
    let (dg, du) = ops::silu_mul_bwd(&t(&c, &[r, c_]), &t(&g, &[r, c_]), &t(&u, &[r, c_])).unwrap();
    let f = |g: &[f32], u: &[f32]| ops::silu_mul(&t(g, &[r, c_]), &t(u, &[r, c_])).unwrap();
    // Smooth in gate (|silu'''| ≤ ~0.5): TOL_SMOOTH. Linear in up: TOL_LINEAR.
    check_all(
        "silu_mul dgate",
        &g,
        dg.as_cpu().unwrap(),
        TOL_SMOOTH,
        |x| dotc(&c, &f(x, &u)),
    );
    check_all("silu_mul dup", &u, du.as_cpu().unwrap(), TOL_LINEAR, |x| {
        dotc(&c, &f(&g, x))
    });
    // The in-place form (the layer backward's) writes the same gradients over gate and up.
    let (mut gi, mut ui) = (t(&g, &[r, c_]), t(&u, &[r, c_]));
    ops::silu_mul_bwd_in_place(&t(&c, &[r, c_]), &mut gi, &mut ui).unwrap();
    assert_eq!(gi.as_cpu().unwrap(), dg.as_cpu().unwrap());
    assert_eq!(ui.as_cpu().unwrap(), du.as_cpu().unwrap());
}

/// `gelu_tanh` (transformers' `gelu_pytorch_tanh`) in f64, from its definition.
fn gelu_tanh_f64(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

#[test]
fn gelu_tanh_mul_matches_definition_and_fd() {
    let (r, c_) = (5, 12);
    let n = r * c_;
    // Gates over ±4 (the tails and the curved middle), and a few exact points.
    let mut g = rv(n, 53, 4.0);
    g[..5].copy_from_slice(&[0.0, 1.0, -1.0, 3.0, -3.0]);
    let u = rv(n, 54, 1.5);
    let c = rand_vec(n, 55);
    let f = |g: &[f32], u: &[f32]| ops::gelu_tanh_mul(&t(g, &[r, c_]), &t(u, &[r, c_])).unwrap();
    // The forward against the f64 definition (a wrong constant shows at ~1e-3).
    let y = f(&g, &u);
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| (gelu_tanh_f64(g as f64) * u as f64) as f32)
        .collect();
    let (md, i) = max_diff(y.as_cpu().unwrap(), &want);
    assert!(
        md < 1e-6,
        "gelu_tanh_mul forward: max|diff| {md:.2e} at {i}"
    );
    let (dg, du) =
        ops::gelu_tanh_mul_bwd(&t(&c, &[r, c_]), &t(&g, &[r, c_]), &t(&u, &[r, c_])).unwrap();
    // Smooth in gate (its third derivative is below ~1 on ±4): TOL_SMOOTH. Linear in up:
    // TOL_LINEAR.
    check_all(
        "gelu_tanh_mul dgate",
        &g,
        dg.as_cpu().unwrap(),
        TOL_SMOOTH,
        |x| dotc(&c, &f(x, &u)),
    );
    check_all(
        "gelu_tanh_mul dup",
        &u,
        du.as_cpu().unwrap(),
        TOL_LINEAR,
        |x| dotc(&c, &f(&g, x)),
    );
    // The in-place form writes the same gradients over gate and up.
    let (mut gi, mut ui) = (t(&g, &[r, c_]), t(&u, &[r, c_]));
    ops::gelu_tanh_mul_bwd_in_place(&t(&c, &[r, c_]), &mut gi, &mut ui).unwrap();
    assert_eq!(gi.as_cpu().unwrap(), dg.as_cpu().unwrap());
    assert_eq!(ui.as_cpu().unwrap(), du.as_cpu().unwrap());
}

/// One gated MLP with adapters on gate, up and down, in f64 from its definition:
/// `Σ c ∘ (h Wdᵀ + sd (h Adᵀ) Bdᵀ)`, `h = act(gate) up`, `gate = g0 + sg xa_g Bgᵀ`,
/// `up = u0 + su xa_u Buᵀ` (rows `t`, width `i`, outputs `h_out`; `xa` is `[xa_g | xa_u]`).
struct AdaptedMlp {
    t: usize,
    i: usize,
    h_out: usize,
    ranks: (usize, usize, usize),
    scales: (f64, f64, f64),
    xa: Vec<f32>,
    bd: Vec<f32>,
    wd: Vec<f32>,
    c: Vec<f32>,
    act: fn(f64) -> f64,
}

impl AdaptedMlp {
    fn loss(&self, g0: &[f32], u0: &[f32], bg: &[f32], bu: &[f32], ad: &[f32]) -> f64 {
        let (rd, rg, ru) = self.ranks;
        let (sg, su, sd) = self.scales;
        let w = rg + ru;
        let mut total = 0.0;
        for r in 0..self.t {
            let xa = &self.xa[r * w..(r + 1) * w];
            let h: Vec<f64> = (0..self.i)
                .map(|j| {
                    let lg: f64 = (0..rg).map(|k| xa[k] as f64 * bg[j * rg + k] as f64).sum();
                    let lu: f64 = (0..ru)
                        .map(|k| xa[rg + k] as f64 * bu[j * ru + k] as f64)
                        .sum();
                    let gate = g0[r * self.i + j] as f64 + sg * lg;
                    let up = u0[r * self.i + j] as f64 + su * lu;
                    (self.act)(gate) * up
                })
                .collect();
            let ha: Vec<f64> = (0..rd)
                .map(|k| (0..self.i).map(|j| h[j] * ad[k * self.i + j] as f64).sum())
                .collect();
            for o in 0..self.h_out {
                let base: f64 = (0..self.i)
                    .map(|j| h[j] * self.wd[o * self.i + j] as f64)
                    .sum();
                let lora: f64 = (0..rd).map(|k| ha[k] * self.bd[o * rd + k] as f64).sum();
                total += self.c[r * self.h_out + o] as f64 * (base + sd * lora);
            }
        }
        total
    }
}

#[test]
fn gated_mul_bwd_lora_grads_matches_fd() {
    // The MLP backward that takes the three LoRA gradients reading its (T, I) tensors with the
    // activation's backward (dA_down from h made again, dB_gate and dB_up from the gradients
    // it writes): its CPU form, the reference of its CUDA kernel's parity rows, against finite
    // differences of the whole MLP. Three ranks, xa_gate and xa_up as columns of one matrix, and
    // gradients that start from nonzero values (they are added onto).
    let silu = |x: f64| x / (1.0 + (-x).exp());
    for (name, act, kind) in [
        ("silu", silu as fn(f64) -> f64, ops::GatedAct::Silu),
        (
            "gelu_tanh",
            gelu_tanh_f64 as fn(f64) -> f64,
            ops::GatedAct::GeluTanh,
        ),
    ] {
        let (tt, i, h_out, rd, rg, ru) = (5, 8, 6, 2, 2, 3);
        let (sg, su, sd) = (2.0f32, 0.5f32, 1.5f32);
        let mlp = AdaptedMlp {
            t: tt,
            i,
            h_out,
            ranks: (rd, rg, ru),
            scales: (sg as f64, su as f64, sd as f64),
            xa: rv(tt * (rg + ru), 70, 1.0),
            bd: rv(h_out * rd, 71, 0.5),
            wd: rv(h_out * i, 72, 0.5),
            c: rand_vec(tt * h_out, 73),
            act,
        };
        let (g0, u0) = (rv(tt * i, 74, 2.0), rv(tt * i, 75, 1.0));
        let (bg, bu, ad) = (
            rv(i * rg, 76, 0.5),
            rv(i * ru, 77, 0.5),
            rv(rd * i, 78, 0.5),
        );
        let (ga0, gbg0, gbu0) = (
            rv(rd * i, 79, 0.1),
            rv(i * rg, 80, 0.1),
            rv(i * ru, 81, 0.1),
        );
        // The forward's gate and up, and the backward's inputs, as the layer makes them.
        let lin = |x0: &[f32], b: &[f32], r: usize, off: usize, s: f32| -> Vec<f32> {
            (0..tt * i)
                .map(|e| {
                    let (row, j) = (e / i, e % i);
                    let xa = &mlp.xa[row * (rg + ru) + off..];
                    x0[e] + s * (0..r).map(|k| xa[k] * b[j * r + k]).sum::<f32>()
                })
                .collect()
        };
        let (mut gate, mut up) = (
            t(&lin(&g0, &bg, rg, 0, sg), &[tt, i]),
            t(&lin(&u0, &bu, ru, rg, su), &[tt, i]),
        );
        let c = t(&mlp.c, &[tt, h_out]);
        let mut d_base =
            ops::matmul(&c, false, &t(&mlp.wd, &[h_out, i]), false, 1.0, DType::F32).unwrap();
        let dxa = ops::matmul(&c, false, &t(&mlp.bd, &[h_out, rd]), false, sd, DType::F32).unwrap();
        let xa = t(&mlp.xa, &[tt, rg + ru]);
        let (mut ga, mut gbg, mut gbu) =
            (t(&ga0, &[rd, i]), t(&gbg0, &[i, rg]), t(&gbu0, &[i, ru]));
        let grads = ops::GatedLoraGrads {
            xa_gate: ops::Cols {
                t: &xa,
                start: 0,
                end: rg,
            },
            scale_gate: sg,
            grad_b_gate: &mut gbg,
            xa_up: ops::Cols {
                t: &xa,
                start: rg,
                end: rg + ru,
            },
            scale_up: su,
            grad_b_up: &mut gbu,
            grad_a_down: &mut ga,
        };
        let ad_t = t(&ad, &[rd, i]);
        ops::gated_mul_bwd_lora_grads(kind, &mut d_base, &dxa, &ad_t, &mut gate, &mut up, grads)
            .unwrap();
        let added = |g: &Tensor, g0: &[f32]| -> Vec<f32> {
            g.as_cpu()
                .unwrap()
                .iter()
                .zip(g0)
                .map(|(a, b)| a - b)
                .collect()
        };
        check_all(
            &format!("{name} mlp d gate"),
            &g0,
            gate.as_cpu().unwrap(),
            TOL_SMOOTH,
            |x| mlp.loss(x, &u0, &bg, &bu, &ad),
        );
        check_all(
            &format!("{name} mlp d up"),
            &u0,
            up.as_cpu().unwrap(),
            TOL_SMOOTH,
            |x| mlp.loss(&g0, x, &bg, &bu, &ad),
        );
        check_all(
            &format!("{name} mlp dB_gate"),
            &bg,
            &added(&gbg, &gbg0),
            TOL_SMOOTH,
            |x| mlp.loss(&g0, &u0, x, &bu, &ad),
        );
        check_all(
            &format!("{name} mlp dB_up"),
            &bu,
            &added(&gbu, &gbu0),
            TOL_SMOOTH,
            |x| mlp.loss(&g0, &u0, &bg, x, &ad),
        );
        check_all(
            &format!("{name} mlp dA_down"),
            &ad,
            &added(&ga, &ga0),
            TOL_LINEAR,
            |x| mlp.loss(&g0, &u0, &bg, &bu, x),
        );
    }
}

#[test]
fn softcap_logsoftmax_gather_bwd_matches_fd() {
    let (rows, v) = (6, 11);
    let targets = [3u32, 0, u32::MAX, 10, 3, 7];
    // Raw logits of spread ±8 against a cap of 4: well into tanh's saturation.
    let cap = 4.0f32;
    let raw = rv(rows * v, 82, 8.0);
    let c = rand_vec(rows, 83);
    let capped = |x: &[f32]| {
        let mut l = t(x, &[rows, v]);
        ops::softcap(&mut l, cap).unwrap();
        l
    };
    let l = capped(&raw);
    for (&y, &z) in l.as_cpu().unwrap().iter().zip(&raw) {
        let want = cap as f64 * (z as f64 / cap as f64).tanh();
        assert!(
            (y as f64 - want).abs() < 1e-6,
            "softcap({z}) = {y}, want {want}"
        );
    }
    let (_, lse) = ops::logsoftmax_gather(&l, &targets).unwrap();
    let d = ops::logsoftmax_gather_softcap_bwd_to(
        &t(&c, &[rows]),
        &l,
        &lse,
        &targets,
        Some(cap),
        DType::F32,
    )
    .unwrap();
    let d = d.as_cpu().unwrap();
    assert!(d[2 * v..3 * v].iter().all(|&x| x == 0.0), "ignored row");
    // Smooth, and the cap only flattens the curvature: TOL_SMOOTH.
    check_all("softcap + logsoftmax_gather dz", &raw, d, TOL_SMOOTH, |x| {
        dotc(&c, &ops::logsoftmax_gather(&capped(x), &targets).unwrap().0)
    });
    // Without a cap it is logsoftmax_gather_bwd.
    let lt = t(&raw, &[rows, v]);
    let (_, lse) = ops::logsoftmax_gather(&lt, &targets).unwrap();
    let g = t(&c, &[rows]);
    let a = ops::logsoftmax_gather_softcap_bwd_to(&g, &lt, &lse, &targets, None, DType::F32);
    let b = ops::logsoftmax_gather_bwd(&g, &lt, &lse, &targets).unwrap();
    assert_eq!(a.unwrap().as_cpu().unwrap(), b.as_cpu().unwrap());
}

#[test]
fn matmul_all_transpose_combos_match_fd() {
    let (m, k, n) = (5, 7, 6);
    let alpha = 0.7f32;
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let a_shape = if ta { [k, m] } else { [m, k] };
        let b_shape = if tb { [n, k] } else { [k, n] };
        let a = rv(m * k, 60, 1.0);
        let b = rv(k * n, 61, 1.0);
        let c = rand_vec(m * n, 62);
        let ct = t(&c, &[m, n]);
        let (at, bt) = (t(&a, &a_shape), t(&b, &b_shape));
        // By hand: d op(A) = α dC op(B)ᵀ, d op(B) = α op(A)ᵀ dC, transposed back where stored
        // transposed.
        let da = if ta {
            ops::matmul(&bt, tb, &ct, true, alpha, DType::F32).unwrap()
        } else {
            ops::matmul(&ct, false, &bt, !tb, alpha, DType::F32).unwrap()
        };
        let db = if tb {
            ops::matmul(&ct, true, &at, ta, alpha, DType::F32).unwrap()
        } else {
            ops::matmul(&at, !ta, &ct, false, alpha, DType::F32).unwrap()
        };
        assert_eq!(da.shape(), &a_shape);
        assert_eq!(db.shape(), &b_shape);
        let f = |a: &[f32], b: &[f32]| {
            ops::matmul(&t(a, &a_shape), ta, &t(b, &b_shape), tb, alpha, DType::F32).unwrap()
        };
        // Linear in each operand: TOL_LINEAR.
        check_all(
            &format!("matmul ta={ta} tb={tb} dA"),
            &a,
            da.as_cpu().unwrap(),
            TOL_LINEAR,
            |x| dotc(&c, &f(x, &b)),
        );
        check_all(
            &format!("matmul ta={ta} tb={tb} dB"),
            &b,
            db.as_cpu().unwrap(),
            TOL_LINEAR,
            |x| dotc(&c, &f(&a, x)),
        );
        // matmul_acc: c0·β + α op(A) op(B) has the same gradients w.r.t. A and B.
        let c0 = rv(m * n, 63, 1.0);
        let mut acc = t(&c0, &[m, n]);
        ops::matmul_acc(&mut acc, &at, ta, &bt, tb, alpha, 0.5).unwrap();
        let want: Vec<f32> = f(&a, &b)
            .as_cpu()
            .unwrap()
            .iter()
            .zip(&c0)
            .map(|(y, z)| y + 0.5 * z)
            .collect();
        assert_close("matmul_acc", acc.as_cpu().unwrap(), &want, 1e-6);
    }
}

#[test]
fn gather_rows_and_scatter_add_rows_are_adjoint_by_fd() {
    let (rows, cols) = (8, 5);
    let idx = [2u32, 7, 2, 0, 5, 2];
    let x = rv(rows * cols, 70, 1.0);
    let c = rand_vec(idx.len() * cols, 71);
    // d/dx Σ c ∘ gather(x) = scatter_add(0, c).
    let mut dx = Tensor::zeros(&[rows, cols], DType::F32, &Device::Cpu).unwrap();
    ops::scatter_add_rows(&mut dx, &idx, &t(&c, &[idx.len(), cols])).unwrap();
    check_all(
        "gather_rows dx (via scatter_add_rows)",
        &x,
        dx.as_cpu().unwrap(),
        TOL_LINEAR,
        |xv| dotc(&c, &ops::gather_rows(&t(xv, &[rows, cols]), &idx).unwrap()),
    );
    // d/dsrc Σ c' ∘ scatter_add(dst0, src) = gather(c').
    let src = rv(idx.len() * cols, 72, 1.0);
    let dst0 = rv(rows * cols, 73, 1.0);
    let c2 = rand_vec(rows * cols, 74);
    let dsrc = ops::gather_rows(&t(&c2, &[rows, cols]), &idx).unwrap();
    check_all(
        "scatter_add_rows dsrc (via gather_rows)",
        &src,
        dsrc.as_cpu().unwrap(),
        TOL_LINEAR,
        |s| {
            let mut d = t(&dst0, &[rows, cols]);
            ops::scatter_add_rows(&mut d, &idx, &t(s, &[idx.len(), cols])).unwrap();
            dotc(&c2, &d)
        },
    );
}

#[test]
fn logsoftmax_gather_bwd_matches_fd_with_ignored_target() {
    let (rows, v) = (6, 11);
    let targets = [3u32, 0, u32::MAX, 10, 3, 7];
    // Logits of spread ±3: a peaked softmax.
    let logits = rv(rows * v, 80, 3.0);
    let c = rand_vec(rows, 81);
    let lt = t(&logits, &[rows, v]);
    let (logp, lse) = ops::logsoftmax_gather(&lt, &targets).unwrap();
    assert_eq!(logp.as_cpu().unwrap()[2], 0.0, "ignored row gives logp 0");
    let d = ops::logsoftmax_gather_bwd(&t(&c, &[rows]), &lt, &lse, &targets).unwrap();
    let d = d.as_cpu().unwrap();
    assert!(
        d[2 * v..3 * v].iter().all(|&x| x == 0.0),
        "ignored row must get zero gradient"
    );
    // Smooth; |∂³ log-softmax| ≤ ~1: truncation ≲ 2e-5. TOL_SMOOTH.
    check_all("logsoftmax_gather dlogits", &logits, d, TOL_SMOOTH, |x| {
        dotc(
            &c,
            &ops::logsoftmax_gather(&t(x, &[rows, v]), &targets)
                .unwrap()
                .0,
        )
    });
}

#[test]
fn dropout_backward_is_the_same_mask_by_fd() {
    let (r, cols) = (7, 13);
    let n = r * cols;
    let (p, seed) = (0.3f32, 0xD80u64);
    let x = rv(n, 90, 1.0);
    let c = rand_vec(n, 91);
    let y = ops::dropout(&t(&x, &[r, cols]), p, seed).unwrap();
    // The mask is non-trivial: some dropped, most kept and scaled by 1/(1-p).
    let dropped = y.as_cpu().unwrap().iter().filter(|&&v| v == 0.0).count();
    assert!(
        dropped > n / 8 && dropped < n / 2,
        "{dropped} of {n} dropped"
    );
    let dx = ops::dropout(&t(&c, &[r, cols]), p, seed).unwrap();
    // Linear: TOL_LINEAR.
    check_all("dropout dx", &x, dx.as_cpu().unwrap(), TOL_LINEAR, |xv| {
        dotc(&c, &ops::dropout(&t(xv, &[r, cols]), p, seed).unwrap())
    });
}

#[test]
fn add_bias_add_assign_scale_match_fd() {
    let (r, cols) = (4, 6);
    let x = rv(r * cols, 100, 1.0);
    let bias = rv(cols, 101, 1.0);
    let c = rand_vec(r * cols, 102);
    // d bias = column sums of c.
    let dbias: Vec<f32> = (0..cols)
        .map(|j| (0..r).map(|i| c[i * cols + j]).sum())
        .collect();
    check_all("add_bias dbias", &bias, &dbias, TOL_LINEAR, |b| {
        let mut y = t(&x, &[r, cols]);
        ops::add_bias(&mut y, &t(b, &[cols])).unwrap();
        dotc(&c, &y)
    });
    // a += α b: d b = α c.
    let alpha = -0.6f32;
    let db: Vec<f32> = c.iter().map(|v| alpha * v).collect();
    check_all("add_assign db", &bias.repeat(r), &db, TOL_LINEAR, |b| {
        let mut y = t(&x, &[r, cols]);
        ops::add_assign(&mut y, &t(b, &[r, cols]), alpha).unwrap();
        dotc(&c, &y)
    });
    // x · s: d x = s c.
    let s = 1.7f32;
    let dx: Vec<f32> = c.iter().map(|v| s * v).collect();
    check_all("scale dx", &x, &dx, TOL_LINEAR, |xv| {
        let mut y = t(xv, &[r, cols]);
        ops::scale(&mut y, s).unwrap();
        dotc(&c, &y)
    });
}

// ------------------------------------------------------------------------------------------------
// Whole-model checks: LoRA gradients of a tiny random 2-layer model by FD.

const LLAMA: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":64,"rms_norm_eps":1e-6,"rope_theta":10000.0,
    "tie_word_embeddings":false,"max_position_embeddings":128}"#;
const QWEN3: &str = r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"rms_norm_eps":1e-6,
    "rope_theta":1000000.0,"tie_word_embeddings":false,"max_position_embeddings":128}"#;
const QWEN2: &str = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":64,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
    "tie_word_embeddings":true,"max_position_embeddings":128}"#;
const MISTRAL: &str = r#"{"architectures":["MistralForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":64,"rms_norm_eps":1e-5,"rope_theta":10000.0,
    "sliding_window":4,"tie_word_embeddings":false,"max_position_embeddings":128}"#;

/// MiniCPM: μP scales (embeddings × 12, residual branches × 1.4/√2, the head reading h/2) and
/// LongRoPE past 4 positions (T = 9 takes the long factors and the attention factor).
const MINICPM: &str = r#"{"architectures":["MiniCPMForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":64,"rms_norm_eps":1e-5,"rope_theta":10000.0,
    "scale_emb":12,"scale_depth":1.4,"dim_model_base":16,"tie_word_embeddings":true,
    "max_position_embeddings":16,"rope_scaling":{"rope_type":"longrope",
    "short_factor":[1.0,1.3,2.1,3.0],"long_factor":[1.1,1.9,2.7,3.9],
    "original_max_position_embeddings":4}}"#;

/// Gemma 2: sandwich norms, GELU-tanh gate, √hidden embeddings, attention and final softcaps
/// small enough to act on a random model's scores and logits, a window of 4 on layer 0.
const GEMMA2: &str = r#"{"architectures":["Gemma2ForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"rms_norm_eps":1e-6,
    "query_pre_attn_scalar":12,"attn_logit_softcapping":0.02,"final_logit_softcapping":0.05,
    "sliding_window":4,"tie_word_embeddings":true,"max_position_embeddings":128}"#;
/// Gemma 3: q/k norms, a local layer (window 4, base 1e4) and a global one (1e6, linear × 8).
const GEMMA3: &str = r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":32,
    "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"rms_norm_eps":1e-6,
    "query_pre_attn_scalar":8,"sliding_window":4,
    "layer_types":["sliding_attention","full_attention"],"rope_theta":1000000.0,
    "rope_local_base_freq":10000.0,"rope_scaling":{"rope_type":"linear","factor":8.0},
    "tie_word_embeddings":true,"max_position_embeddings":128}"#;

/// Gemma 4: layers [sliding, full, sliding, full] with the last two sharing the k/v of layers 0
/// and 1 (the donors' dK/dV sum over their sharer), head_dim 8 and global 16 with proportional
/// RoPE (2 of 8 pairs rotate), q/k/v norms, scale 1, per-layer inputs of width 4, a double-wide
/// MLP on the sharers, layer scalars, a small final softcap.
const GEMMA4: &str = r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text",
    "hidden_size":32,"intermediate_size":24,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"global_head_dim":16,"vocab_size":64,
    "rms_norm_eps":1e-6,"sliding_window":4,
    "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],
    "num_kv_shared_layers":2,"hidden_size_per_layer_input":4,"vocab_size_per_layer_input":64,
    "use_double_wide_mlp":true,"final_logit_softcapping":0.05,
    "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},
    "full_attention":{"rope_type":"proportional","partial_rotary_factor":0.25,
    "rope_theta":1000000.0}},"tie_word_embeddings":true,"max_position_embeddings":128}"#;
/// Gemma 4 with `attention_k_eq_v` (v from the k projection on full layers) and one global kv
/// head, without KV sharing.
const GEMMA4_KEQV: &str = r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text",
    "hidden_size":32,"intermediate_size":24,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"global_head_dim":16,"vocab_size":64,
    "rms_norm_eps":1e-6,"sliding_window":4,"attention_k_eq_v":true,
    "num_global_key_value_heads":1,"layer_types":["sliding_attention","full_attention"],
    "hidden_size_per_layer_input":4,"final_logit_softcapping":0.05,
    "tie_word_embeddings":true,"max_position_embeddings":128}"#;

/// Token ids of the T = 9 sequence (with repeats).
const IDS: [u32; 9] = [1, 17, 5, 63, 17, 0, 42, 5, 9];

struct Tiny {
    model: Model,
    lora: Lora,
    c: Vec<f32>,
    /// The FD step of the LoRA checks (`MODEL_H` unless a family needs a finer one).
    fd_step: f32,
}

fn tiny(config: &str, seed: u64) -> Tiny {
    tiny_with(
        config,
        seed,
        LoraConfig {
            rank: 4,
            alpha: 8.0,
            ..Default::default()
        },
    )
}

fn tiny_with(config: &str, seed: u64, lora_config: LoraConfig) -> Tiny {
    let spec = ModelSpec::from_config_json(config).unwrap();
    let dev = Device::Cpu;
    let src = RandomSource {
        spec: spec.clone(),
        seed,
    };
    let weights = load_weights(&spec, &src, &dev).unwrap();
    let model = Model::new(spec.clone(), weights, dev.clone());
    let mut lora = Lora::new(&spec, lora_config, &dev).unwrap();
    // PEFT initialises B = 0, which would make every dA zero; use random non-zero B.
    for (i, (_, _, p)) in lora.pairs_mut().enumerate() {
        let n = p.b.numel();
        p.b.as_cpu_mut()
            .unwrap()
            .copy_from_slice(&rv(n, seed * 1000 + i as u64, 0.2));
    }
    lora.refresh_compute_copies().unwrap();
    let c = rand_vec(IDS.len() * spec.vocab, seed + 7);
    Tiny {
        model,
        lora,
        c,
        fd_step: MODEL_H,
    }
}

fn ctx_parts(m: &Model) -> (AttnMask, RopeTable) {
    let mask = m.causal_mask(IDS.len());
    let rope = m.rope_table(&mask.positions).unwrap();
    (mask, rope)
}

/// `L = Σ c ∘ logits`.
fn model_loss(m: &Model, lora: &Lora, ctx: &PassCtx, c: &[f32]) -> f64 {
    let (hidden, _) = m.forward(&IDS, Some(lora), ctx, 0).unwrap();
    dotc(c, &m.logits(&hidden, DType::F32).unwrap())
}

/// Analytic LoRA gradients (and d(embeddings)) of `L = Σ c ∘ logits`.
fn model_grads(m: &Model, lora: &mut Lora, ctx: &PassCtx, c: &[f32], plan: ForwardPlan) -> Tensor {
    lora.zero_grads().unwrap();
    let (hidden, state) = m.forward_keeping(&IDS, Some(&*lora), ctx, plan).unwrap();
    let logits = m.logits(&hidden, DType::F32).unwrap();
    let dl = t(c, logits.shape());
    let dh = m.logits_bwd_capped(&dl, &logits).unwrap();
    m.backward(dh, state, Some(lora), ctx).unwrap()
}

/// Model-level FD step, with Richardson extrapolation (steps 1e-2 and 5e-3). The LoRA parameters
/// are O(0.1..0.2) (A ~ U(±1/√in), B ~ U(±0.2)), but the model is strongly curved in some of
/// them: the random residual stream is tiny (embeddings ~ N(0, 0.02)), so a LoRA delta on
/// layer 0's v_proj dominates the next RMSNorm's input. Plain central differences at h = 1e-2
/// showed an O(h²) truncation error of 1.4% there (analytic −7.435, FD −7.329 at h = 1e-2,
/// −7.408 at 5e-3, −7.4255 at 3e-3, −7.4339 at 1e-3: converging on the analytic value);
/// extrapolation removes that term. What remains is rounding noise: L ~ O(1) from a deep f32
/// computation carries ~1e-6 of noise, i.e. ~1e-4 absolute in the derivative at h/2 = 5e-3
/// (observed max |diff| 1e-4..3e-4 against gradients up to 7.5).
const MODEL_H: f32 = 1e-2;
/// Gemma 4's step. Its attention scale is 1 over q and k that the q/k norms make unit-rms
/// (the random model's norm weights are 1), so scores reach ±head_dim and the softmax is sharp:
/// the loss is far more curved in the k and v adapters than in the other families', and the
/// extrapolated difference at `MODEL_H` was measured 5% off the analytic value on layer 0's k
/// and v (where the same backward matches PyTorch's autograd to 1e-4 on the gemma4 fixtures).
/// A 2.5× finer step shrinks the O(h⁴) remainder by ~40× and keeps the O(1e-6/h) rounding noise
/// under `MODEL_ABS`.
const GEMMA4_H: f32 = 4e-3;
/// The `k_eq_v` model's layer-0 v adapter is curved more still: its unscaled v norm divides by the
/// rms of an 8-wide v dominated by the random adapter's own term; at `GEMMA4_H` the extrapolated
/// difference was 1.6% off (the same backward matches autograd to 1e-4 on `gemma4_keqv`).
const GEMMA4_KEQV_H: f32 = 2e-3;

/// Rel-norm over the whole sample of one model (224 entries): observed 3e-5..1e-4, so 1e-3 is
/// a 10× margin while a wrong term in any large gradient would give ≳1e-2.
const MODEL_TOL: f64 = 1e-3;
/// Per element: |analytic − FD| ≤ MODEL_REL·|FD| + MODEL_ABS. MODEL_ABS is 5× the observed FD
/// noise floor (1e-4), MODEL_REL 1% (observed relative errors after extrapolation are ≤ 1e-4 on
/// entries above the floor). This catches a wrong gradient in a matrix whose gradients are small
/// (q/k of Qwen2, ~1e-2) and could hide behind the large ones in the global rel-norm.
const MODEL_REL: f64 = 1e-2;
const MODEL_ABS: f64 = 5e-4;

/// Per-element check of one matrix's sample (see `MODEL_REL`, `MODEL_ABS`); `analytic` and `fd`
/// are aligned. Returns the worst `|diff| / bound` (≤ 1 passes).
fn elementwise(what: &str, analytic: &[f32], fd: &[f32]) -> Result<f64, String> {
    let scale = max_abs(fd);
    if scale <= 10.0 * MODEL_ABS {
        return Err(format!(
            "{what}: FD gradient is negligible (max {scale:.2e}); the check would be vacuous"
        ));
    }
    let mut worst = (0.0f64, 0usize);
    for (k, (&a, &f)) in analytic.iter().zip(fd).enumerate() {
        let (a, f) = (a as f64, f as f64);
        let r = (a - f).abs() / (MODEL_REL * f.abs() + MODEL_ABS);
        if r > worst.0 {
            worst = (r, k);
        }
    }
    let (r, k) = worst;
    if r > 1.0 {
        return Err(format!(
            "{what}: sample #{k}: analytic {:.6e} vs FD {:.6e}: |diff| is {r:.2}× the bound \
             {MODEL_REL:.0e}·|FD| + {MODEL_ABS:.0e}",
            analytic[k], fd[k]
        ));
    }
    Ok(r)
}

/// One LoRA matrix's sampled analytic and FD gradients.
struct Sampled {
    what: String,
    analytic: Vec<f32>,
    fd: Vec<f32>,
}

/// Analytic gradients (computed with `analytic_dropout`) and Richardson FD gradients (of the
/// loss with `fd_dropout`) at 8 sampled entries of A and of B of every target in both layers.
fn lora_samples(
    name: &str,
    tiny: &mut Tiny,
    analytic_dropout: Option<(f32, u64)>,
    fd_dropout: Option<(f32, u64)>,
) -> Vec<Sampled> {
    let Tiny {
        model,
        lora,
        c,
        fd_step,
    } = tiny;
    let fd_step = *fd_step;
    let (mask, rope) = ctx_parts(model);
    let ctx = |dropout| PassCtx {
        mask: &mask,
        rope: &rope,
        dropout,
    };
    model_grads(
        model,
        lora,
        &ctx(analytic_dropout),
        c,
        ForwardPlan::default(),
    );
    let fd_ctx = ctx(fd_dropout);
    let mut out = Vec::new();
    for l in 0..model.spec.n_layers {
        for (ti, tg) in Target::ALL.into_iter().enumerate() {
            if lora.get(l, tg).is_none() {
                continue;
            }
            for is_b in [false, true] {
                let p = lora.get(l, tg).unwrap();
                let (x0, g) = if is_b {
                    (p.b.to_vec().unwrap(), p.grad_b.to_vec().unwrap())
                } else {
                    (p.a.to_vec().unwrap(), p.grad_a.to_vec().unwrap())
                };
                let idx = sample(x0.len(), 8, (l * 16 + ti * 2 + is_b as usize) as u64);
                let fd = fd_grad_richardson(&x0, &idx, fd_step, |x| {
                    let p = lora.get_mut(l, tg).unwrap();
                    let dst = if is_b { &mut p.b } else { &mut p.a };
                    dst.as_cpu_mut().unwrap().copy_from_slice(x);
                    lora.refresh_compute_copies().unwrap();
                    model_loss(model, lora, &fd_ctx, c)
                });
                // Restore the unperturbed value.
                let p = lora.get_mut(l, tg).unwrap();
                let dst = if is_b { &mut p.b } else { &mut p.a };
                dst.as_cpu_mut().unwrap().copy_from_slice(&x0);
                lora.refresh_compute_copies().unwrap();
                out.push(Sampled {
                    what: format!(
                        "{name} layer {l} {} {}",
                        tg.module(),
                        if is_b { "B" } else { "A" }
                    ),
                    analytic: idx.iter().map(|&i| g[i]).collect(),
                    fd,
                });
            }
        }
    }
    assert_eq!(
        out.len(),
        2 * lora.pairs().count(),
        "every adapter's A and B"
    );
    out
}

/// FD-checks a sample of A and B entries of every target in both layers: per element within
/// `MODEL_REL·|FD| + MODEL_ABS` for every matrix, and rel-norm ≤ `MODEL_TOL` over all 224.
fn check_lora_grads(name: &str, tiny: &mut Tiny, dropout: Option<(f32, u64)>) {
    let samples = lora_samples(name, tiny, dropout, dropout);
    let (mut analytic, mut fd) = (Vec::new(), Vec::new());
    for s in &samples {
        match elementwise(&s.what, &s.analytic, &s.fd) {
            Ok(r) => eprintln!(
                "{}: max|grad| {:.3e}, worst |diff|/bound {r:.2}",
                s.what,
                max_abs(&s.fd)
            ),
            Err(e) => panic!("analytic backward disagrees with finite differences: {e}"),
        }
        analytic.extend_from_slice(&s.analytic);
        fd.extend_from_slice(&s.fd);
    }
    let all: Vec<usize> = (0..fd.len()).collect();
    check(
        &format!("{name} all LoRA samples"),
        &analytic,
        &all,
        &fd,
        MODEL_TOL,
    );
}

#[test]
fn model_lora_grads_match_fd_llama() {
    check_lora_grads("llama", &mut tiny(LLAMA, 1), None);
}

/// Adapters on part of each shared-input group, with unequal ranks inside one: q (rank 4) and v
/// (rank 2) share a stacked A, up is alone in its group, o and down stand apart.
#[test]
fn model_lora_grads_match_fd_partial_groups() {
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: vec![Target::Q, Target::V, Target::O, Target::Up, Target::Down],
        rank_pattern: [("v_proj".to_string(), 2)].into_iter().collect(),
        ..Default::default()
    };
    let mut m = tiny_with(LLAMA, 5, config);
    assert_eq!(
        m.lora.stacked(0, 0).map(|s| s.members.clone()),
        Some(vec![(Target::Q, 4), (Target::V, 2)])
    );
    assert!(m.lora.stacked(0, 1).is_none());
    check_lora_grads("llama partial groups", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_qwen3_qk_norm() {
    let mut m = tiny(QWEN3, 2);
    assert!(m.model.spec.qk_norm);
    check_lora_grads("qwen3", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_qwen2_qkv_bias_tied() {
    let mut m = tiny(QWEN2, 3);
    assert!(m.model.spec.qkv_bias && m.model.spec.tie_embeddings);
    check_lora_grads("qwen2", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_mistral_sliding_window() {
    let mut m = tiny(MISTRAL, 4);
    assert_eq!(m.model.spec.sliding_window, Some(4));
    check_lora_grads("mistral", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_minicpm_mup_longrope() {
    let mut m = tiny(MINICPM, 6);
    let spec = &m.model.spec;
    assert_eq!(spec.embed_scale, Some(12.0));
    assert!((spec.layers[0].residual_scale - 1.4 / 2f32.sqrt()).abs() < 1e-6);
    assert_eq!(spec.head_input_scale, Some(0.5));
    assert!(spec.ropes[0].attention_factor() > 1.0);
    check_lora_grads("minicpm", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_gemma2_sandwich_softcaps() {
    let mut m = tiny(GEMMA2, 7);
    let spec = &m.model.spec;
    assert!(spec.layers.iter().all(|l| l.sandwich_norms));
    assert_eq!(spec.layers[0].window, Some(4));
    assert_eq!(spec.layers[1].window, None);
    assert_eq!(spec.final_logit_softcap, Some(0.05));
    check_lora_grads("gemma2", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_gemma3_local_global() {
    let mut m = tiny(GEMMA3, 8);
    let spec = &m.model.spec;
    assert!(spec.qk_norm && spec.ropes.len() == 2);
    assert_eq!((spec.layers[0].rope, spec.layers[1].rope), (1, 0));
    check_lora_grads("gemma3", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_gemma4_kv_sharing_per_layer_inputs() {
    let mut m = tiny(GEMMA4, 9);
    m.fd_step = GEMMA4_H;
    let spec = &m.model.spec;
    assert_eq!(
        spec.layers.iter().map(|l| l.kv_source).collect::<Vec<_>>(),
        [None, None, Some(0), Some(1)]
    );
    assert_eq!((spec.layers[1].head_dim, spec.layers[0].head_dim), (16, 8));
    assert!(matches!(
        spec.ropes[1].scaling,
        RopeScaling::Proportional {
            rotated_pairs: 2,
            ..
        }
    ));
    assert_eq!(spec.layers[3].intermediate, 48);
    assert!(m.model.weights.layers[2].k.is_none() && m.model.weights.layers[0].v_norm.is_some());
    assert!(m.model.weights.layers.iter().all(|w| w.layer_scalar != 1.0));
    // No adapters on the sharers' absent k and v.
    assert!(m.lora.get(2, Target::K).is_none() && m.lora.get(3, Target::V).is_none());
    check_lora_grads("gemma4", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_gemma4_k_eq_v() {
    let mut m = tiny(GEMMA4_KEQV, 10);
    m.fd_step = GEMMA4_KEQV_H;
    let spec = &m.model.spec;
    assert!(spec.layers[1].k_eq_v && !spec.layers[0].k_eq_v);
    assert_eq!(
        (spec.layers[0].n_kv_heads, spec.layers[1].n_kv_heads),
        (2, 1)
    );
    assert!(m.model.weights.layers[1].v.is_none());
    assert!(m.lora.get(1, Target::V).is_none() && m.lora.get(1, Target::K).is_some());
    check_lora_grads("gemma4_keqv", &mut m, None);
}

#[test]
fn model_lora_grads_match_fd_with_dropout() {
    let mut m = tiny(LLAMA, 5);
    // Dropout must actually change the output, or this would re-test the plain path.
    {
        let (mask, rope) = ctx_parts(&m.model);
        let plain = PassCtx {
            mask: &mask,
            rope: &rope,
            dropout: None,
        };
        let drop = PassCtx {
            mask: &mask,
            rope: &rope,
            dropout: Some((0.3, 1234)),
        };
        let (a, b) = (
            model_loss(&m.model, &m.lora, &plain, &m.c),
            model_loss(&m.model, &m.lora, &drop, &m.c),
        );
        assert!(
            (a - b).abs() > 1e-3 * a.abs().max(1e-3),
            "dropout had no effect: {a} vs {b}"
        );
    }
    check_lora_grads("llama+dropout", &mut m, Some((0.3, 1234)));
}

/// Sensitivity of the dropout check: gradients computed *without* dropout must be rejected
/// against FD of the loss *with* dropout (as they would be if the backward replayed a different
/// mask from the forward), so `model_lora_grads_match_fd_with_dropout` is not vacuous.
#[test]
fn model_fd_rejects_gradients_of_a_different_dropout_mask() {
    let mut m = tiny(LLAMA, 5);
    let samples = lora_samples("llama", &mut m, None, Some((0.3, 1234)));
    let rejected = samples
        .iter()
        .filter(|s| elementwise(&s.what, &s.analytic, &s.fd).is_err())
        .count();
    eprintln!("no-dropout grads vs dropout FD: {rejected} of 28 matrices rejected");
    assert!(
        rejected >= 20,
        "only {rejected} of 28 matrices rejected a mismatched dropout mask"
    );
    // The same with the mask seed changed (a replay keyed on the wrong seed).
    let samples = lora_samples("llama", &mut m, Some((0.3, 1235)), Some((0.3, 1234)));
    let rejected = samples
        .iter()
        .filter(|s| elementwise(&s.what, &s.analytic, &s.fd).is_err())
        .count();
    eprintln!("seed-1235 grads vs seed-1234 FD: {rejected} of 28 matrices rejected");
    assert!(
        rejected >= 20,
        "only {rejected} of 28 matrices rejected a different dropout seed"
    );
}

#[test]
fn model_qwen3_with_dropout_matches_fd() {
    check_lora_grads("qwen3+dropout", &mut tiny(QWEN3, 6), Some((0.3, 1234)));
}

/// d(embeddings) returned by `backward` (frozen path: norms, attention, RoPE, residuals) against
/// FD on the embedding table rows of the tokens used.
fn check_embedding_grad(name: &str, tiny: &mut Tiny) {
    let Tiny { model, lora, c, .. } = tiny;
    assert!(
        !model.spec.tie_embeddings,
        "FD on a tied table also moves the head"
    );
    let (mask, rope) = ctx_parts(model);
    let ctx = PassCtx {
        mask: &mask,
        rope: &rope,
        dropout: None,
    };
    let dx = model_grads(model, lora, &ctx, c, ForwardPlan::default());
    let (v, h) = (model.spec.vocab, model.spec.hidden);
    let dtable = ops::embedding_bwd(&dx, &IDS, v).unwrap();
    let table0 = model.weights.embed.dense().unwrap().to_vec().unwrap();
    // Entries of rows 17 and 5 (each used twice), 63 and 0.
    let idx: Vec<usize> = [17usize, 5, 63, 0]
        .iter()
        .flat_map(|&r| (0..h).step_by(2).map(move |j| r * h + j))
        .collect();
    let set = |m: &mut Model, x: &[f32]| match &mut m.weights.embed {
        Weight::Dense(tt) => tt.as_cpu_mut().unwrap().copy_from_slice(x),
        #[allow(unreachable_patterns)]
        _ => panic!("{name}: the random model's embedding should be dense"),
    };
    // The embeddings are N(0, 0.02) and the gradients large (up to ~40: RMSNorm divides by the
    // tiny residual rms), so the step is 2e-3 (and 1e-3), with Richardson extrapolation as for
    // the LoRA entries; observed rel-norm 3e-5..7e-5, tolerance MODEL_TOL.
    let f = fd_grad_richardson(&table0, &idx, 2e-3, |x| {
        set(model, x);
        model_loss(model, lora, &ctx, c)
    });
    set(model, &table0);
    check(
        &format!("{name} d(embedding table)"),
        dtable.as_cpu().unwrap(),
        &idx,
        &f,
        MODEL_TOL,
    );
}

#[test]
fn model_embedding_grad_matches_fd() {
    check_embedding_grad("llama", &mut tiny(LLAMA, 1));
    check_embedding_grad("qwen3", &mut tiny(QWEN3, 2));
}

#[test]
fn segmented_backward_is_bit_identical() {
    for (name, cfg, dropout) in [
        ("llama", LLAMA, None),
        ("llama+dropout", LLAMA, Some((0.3f32, 1234u64))),
        ("qwen3", QWEN3, None),
        ("qwen2", QWEN2, Some((0.3, 99))),
        ("gemma4", GEMMA4, None),
        ("gemma4+dropout", GEMMA4, Some((0.3, 7))),
        ("gemma4_keqv", GEMMA4_KEQV, None),
    ] {
        let mut m = tiny(cfg, 11);
        let (mask, rope) = ctx_parts(&m.model);
        let ctx = PassCtx {
            mask: &mask,
            rope: &rope,
            dropout,
        };
        let grads = |lora: &Lora| -> Vec<Vec<f32>> {
            lora.pairs()
                .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
                .collect()
        };
        let d0 = model_grads(&m.model, &mut m.lora, &ctx, &m.c, ForwardPlan::default());
        let g0 = grads(&m.lora);
        assert_eq!(g0.len(), 2 * m.lora.pairs().count());
        assert!(
            g0.iter().all(|g| max_abs(g) > 0.0),
            "{name}: some LoRA gradient is all zero"
        );
        // Segments recompute the layers (with and without the kept attention outputs; the last
        // layer of each segment skips its down projection; the top layer's MLP kept or
        // recomputed; k and v of the lowest layers kept or recomputed; the boundaries in the
        // host-side store or on the device; segments recomputed whole or layer by layer).
        // Offloaded, the top `resident` layers below the top keep theirs on the device.
        for (seg, keep, top_mlp, kv, offload, nested, resident, full) in [
            (1usize, false, true, 0, false, false, 0, 0usize),
            (1, false, true, 0, true, false, 0, 0),
            (2, false, false, 1, false, false, 0, 0),
            (2, false, false, 1, false, true, 0, 0),
            (1, true, false, 2, true, false, 0, 0),
            (1, true, false, 2, true, false, 2, 0),
            (2, true, true, 0, false, false, 0, 0),
            (2, true, true, 2, true, true, 0, 0),
            (2, true, true, 2, true, true, 1, 0),
            // Segments of three: a donor and its sharer in one segment, the other apart.
            (3, false, true, 0, false, false, 0, 0),
            (3, false, true, 0, true, false, 0, 0),
            (3, true, false, 1, true, false, 2, 0),
            (3, true, true, 1, false, true, 0, 0),
            // The `full` layers below the top keep every activation; the segments lie below.
            (1, true, true, 2, false, false, 0, 1),
            (1, false, false, 0, false, false, 0, 2),
            (2, true, true, 1, false, true, 0, 1),
            (1, true, false, 2, true, false, 1, 1),
            (3, true, true, 1, false, false, 0, 1),
        ] {
            let plan = ForwardPlan {
                segment_size: seg,
                keep_attention: keep,
                keep_top_mlp: top_mlp,
                read_from: 0,
                keep_kv_layers: kv,
                mlp_chunk: 0,
                offload,
                nested,
                resident_layers: resident,
                full_layers: full,
            };
            let d1 = model_grads(&m.model, &mut m.lora, &ctx, &m.c, plan);
            let g1 = grads(&m.lora);
            for (i, (a, b)) in g0.iter().zip(&g1).enumerate() {
                assert!(
                    a == b,
                    "{name}: segment_size {seg} (keep attention {keep}, top MLP {top_mlp}, \
                     offload {offload}, resident {resident}, nested {nested}, full {full}) gradient #{i} differs from segment_size 0 (max|diff| {:.3e})",
                    max_diff(a, b).0
                );
            }
            assert!(
                d0.as_cpu().unwrap() == d1.as_cpu().unwrap(),
                "{name}: segment_size {seg} (keep attention {keep}) d(embeddings) differs"
            );
        }
    }
}

/// Column slices, writes into columns and row concatenation are plain copies; a product over
/// column windows equals the product of the windows' copies.
#[test]
fn column_and_row_copies() {
    let x = t(&(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[3, 4]);
    let s = ops::slice_cols(&x, 1, 3).unwrap();
    assert_eq!(s.shape(), &[3, 2]);
    assert_eq!(s.to_vec().unwrap(), [1., 2., 5., 6., 9., 10.]);
    let mut c = x.try_clone().unwrap();
    ops::write_cols(&mut c, 2, &s).unwrap();
    assert_eq!(
        c.to_vec().unwrap(),
        [0., 1., 1., 2., 4., 5., 5., 6., 8., 9., 9., 10.]
    );
    assert!(
        ops::write_cols(&mut c, 3, &s).is_err(),
        "past the last column"
    );
    // [3, 2] window of x times [2, 2] window of a [2, 3] matrix, into columns 1..3 of a [3, 4].
    let b = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let mut y = t(&[1.0; 12], &[3, 4]);
    let (xw, bw) = (
        ops::Cols {
            t: &x,
            start: 1,
            end: 3,
        },
        ops::Cols {
            t: &b,
            start: 1,
            end: 3,
        },
    );
    ops::matmul_acc_cols(&mut y, 1..3, xw, false, bw, false, 1.0, 1.0).unwrap();
    let want = ops::matmul(
        &s,
        false,
        &ops::slice_cols(&b, 1, 3).unwrap(),
        false,
        1.0,
        ops::DType::F32,
    )
    .unwrap();
    let (y, want) = (y.to_vec().unwrap(), want.to_vec().unwrap());
    for i in 0..3 {
        assert_eq!(
            [y[i * 4], y[i * 4 + 3]],
            [1., 1.],
            "row {i}: columns outside the window"
        );
        assert_eq!(
            [y[i * 4 + 1] - 1., y[i * 4 + 2] - 1.],
            [want[i * 2], want[i * 2 + 1]]
        );
    }
    let r = ops::concat_rows(&[&s, &s]).unwrap();
    assert_eq!(r.shape(), &[6, 2]);
    assert_eq!(r.to_vec().unwrap()[6..], s.to_vec().unwrap());
    assert!(ops::concat_rows(&[&s, &x]).is_err(), "column counts differ");
    assert!(ops::slice_cols(&x, 2, 5).is_err(), "past the last column");
}
