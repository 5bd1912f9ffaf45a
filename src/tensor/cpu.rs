//! The CPU backend: f32 reference implementations of every op, parallel with rayon, matrix
//! products through the `gemm` crate. These are the definitions the CUDA kernels are tested
//! against, so they favour plain loops over cleverness; only the GEMMs are optimised.

use super::{
    clip_scale, AdamW, AdamWItem, AttnMask, AttnShape, DeviceValues, NormClip, RopeTable, Tensor,
};
use anyhow::Result;
use rayon::prelude::*;

fn out(data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::cpu(data, shape)
}

/// Strides (row, col) of `op(x)` for a row-major `[r, c]` matrix.
fn op_dims(x: &Tensor, t: bool) -> (usize, usize, isize, isize) {
    let (r, c) = x.rows_cols();
    if t {
        (c, r, 1, c as isize)
    } else {
        (r, c, c as isize, 1)
    }
}

pub fn matmul(a: &Tensor, ta: bool, b: &Tensor, tb: bool, alpha: f32) -> Result<Tensor> {
    let (m, _, _, _) = op_dims(a, ta);
    let (_, n, _, _) = op_dims(b, tb);
    let mut c = Tensor::cpu(vec![0.0; m * n], &[m, n])?;
    matmul_acc(&mut c, a, ta, b, tb, alpha, 0.0)?;
    Ok(c)
}

pub fn matmul_acc(
    c: &mut Tensor,
    a: &Tensor,
    ta: bool,
    b: &Tensor,
    tb: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let (m, k, n) = super::matmul_dims(c, a, ta, b, tb)?;
    let (_, _, a_rs, a_cs) = op_dims(a, ta);
    let (_, _, b_rs, b_cs) = op_dims(b, tb);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (a, b) = (a.as_cpu()?, b.as_cpu()?);
    let c = c.as_cpu_mut()?;
    if k == 0 {
        c.iter_mut().for_each(|x| *x *= beta);
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    let par = if m * n * k < 64 * 64 * 64 || threads == 1 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(threads)
    };
    // SAFETY: the strides describe exactly the buffers' extents (checked above: a is m*k, b is
    // k*n, c is m*n elements), and c does not alias a or b (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            beta != 0.0,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            beta,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let (rows, h) = x.rows_cols();
    let (xs, ws) = (x.as_cpu()?, w.as_cpu()?);
    let mut y = vec![0f32; rows * h];
    let mut rstd = vec![0f32; rows];
    y.par_chunks_mut(h)
        .zip(rstd.par_iter_mut())
        .enumerate()
        .for_each(|(r, (yr, rs))| {
            let xr = &xs[r * h..(r + 1) * h];
            let ms = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / h as f64;
            let s = (1.0 / (ms + eps as f64).sqrt()) as f32;
            *rs = s;
            for i in 0..h {
                yr[i] = xr[i] * s * ws[i];
            }
        });
    Ok((out(y, x.shape())?, out(rstd, &[rows])?))
}

pub fn rms_norm_bwd(dy: &Tensor, x: &Tensor, w: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    let (rows, h) = x.rows_cols();
    let (xs, ws, ds, rs) = (x.as_cpu()?, w.as_cpu()?, dy.as_cpu()?, rstd.as_cpu()?);
    let mut dx = vec![0f32; rows * h];
    dx.par_chunks_mut(h).enumerate().for_each(|(r, dxr)| {
        let xr = &xs[r * h..(r + 1) * h];
        let dr = &ds[r * h..(r + 1) * h];
        let s = rs[r] as f64;
        // y = x*s*w; dx = s*(dy*w) - s^3/h * x * sum(dy*w*x)
        let dot: f64 = (0..h)
            .map(|i| dr[i] as f64 * ws[i] as f64 * xr[i] as f64)
            .sum();
        let c = s * s * s * dot / h as f64;
        for i in 0..h {
            dxr[i] = (s * dr[i] as f64 * ws[i] as f64 - c * xr[i] as f64) as f32;
        }
    });
    out(dx, x.shape())
}

pub fn rope(x: &Tensor, table: &RopeTable, n_heads: usize, inverse: bool) -> Result<Tensor> {
    let hd = table.head_dim;
    let half = hd / 2;
    let (t, width) = x.rows_cols();
    let (xs, cos, sin) = (x.as_cpu()?, table.cos.as_cpu()?, table.sin.as_cpu()?);
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut y = vec![0f32; t * width];
    y.par_chunks_mut(width).enumerate().for_each(|(r, yr)| {
        for h in 0..n_heads {
            let base = h * hd;
            for i in 0..half {
                let (c, s) = (cos[r * half + i], sign * sin[r * half + i]);
                let (a, b) = (xs[r * width + base + i], xs[r * width + base + i + half]);
                yr[base + i] = a * c - b * s;
                yr[base + i + half] = b * c + a * s;
            }
        }
    });
    out(y, x.shape())
}

pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    s: AttnShape,
) -> Result<(Tensor, Tensor)> {
    let t = q.dim(0);
    let (nh, nkv, hd) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let group = nh / nkv;
    let (qs, ks, vs) = (q.as_cpu()?, k.as_cpu()?, v.as_cpu()?);
    let (qw, kw) = (nh * hd, nkv * hd);
    // One task per (head, query).
    let results: Vec<(Vec<f32>, f32)> = (0..nh * t)
        .into_par_iter()
        .map(|job| {
            let (h, i) = (job / t, job % t);
            let kvh = h / group;
            let qi = &qs[i * qw + h * hd..i * qw + (h + 1) * hd];
            let mut scores = Vec::new();
            let mut m = f32::NEG_INFINITY;
            for j in 0..t {
                if mask.visible(i, j) {
                    let kj = &ks[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
                    let sc = s.cap(s.scale * dot(qi, kj)).0;
                    m = m.max(sc);
                    scores.push((j, sc));
                }
            }
            let mut o = vec![0f32; hd];
            if scores.is_empty() {
                return (o, f32::NEG_INFINITY);
            }
            let mut l = 0f64;
            for &(_, sc) in &scores {
                l += ((sc - m) as f64).exp();
            }
            let lse = m + l.ln() as f32;
            for &(j, sc) in &scores {
                let p = (sc - lse).exp();
                let vj = &vs[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
                for d in 0..hd {
                    o[d] += p * vj[d];
                }
            }
            (o, lse)
        })
        .collect();
    let mut o = vec![0f32; t * qw];
    let mut lse = vec![0f32; nh * t];
    for (job, (oi, l)) in results.into_iter().enumerate() {
        let (h, i) = (job / t, job % t);
        o[i * qw + h * hd..i * qw + (h + 1) * hd].copy_from_slice(&oi);
        lse[h * t + i] = l;
    }
    Ok((out(o, q.shape())?, out(lse, &[nh, t])?))
}

/// `tensor::decode_attention`: per (query, head), the arithmetic of `attention` over the keys of
/// the query's range, in order (max, f64 sum of exponentials, lse, then the weighted values).
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &[[u32; 2]],
    s: AttnShape,
) -> Result<Tensor> {
    let n = q.dim(0);
    let (nh, nkv, hd) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let group = nh / nkv;
    let (qs, ks, vs) = (q.as_cpu()?, k.as_cpu()?, v.as_cpu()?);
    let (qw, kw) = (nh * hd, nkv * hd);
    let mut o = vec![0f32; n * qw];
    o.par_chunks_mut(hd).enumerate().for_each(|(job, oi)| {
        let (i, h) = (job / nh, job % nh);
        let kvh = h / group;
        let qi = &qs[i * qw + h * hd..i * qw + (h + 1) * hd];
        let [start, end] = ranges[i];
        let keys = start as usize..end as usize;
        if keys.is_empty() {
            return;
        }
        let scores: Vec<f32> = keys
            .clone()
            .map(|j| {
                s.cap(s.scale * dot(qi, &ks[j * kw + kvh * hd..j * kw + (kvh + 1) * hd]))
                    .0
            })
            .collect();
        let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let l: f64 = scores.iter().map(|&sc| ((sc - m) as f64).exp()).sum();
        let lse = m + l.ln() as f32;
        for (j, &sc) in keys.zip(&scores) {
            let p = (sc - lse).exp();
            let vj = &vs[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
            for d in 0..hd {
                oi[d] += p * vj[d];
            }
        }
    });
    out(o, &[n, qw])
}

#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    mask: &AttnMask,
    s: AttnShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t = q.dim(0);
    let (nh, nkv, hd) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let group = nh / nkv;
    let (qs, ks, vs, os, dos, ls) = (
        q.as_cpu()?,
        k.as_cpu()?,
        v.as_cpu()?,
        o.as_cpu()?,
        d_o.as_cpu()?,
        lse.as_cpu()?,
    );
    let (qw, kw) = (nh * hd, nkv * hd);
    // D_i = do_i · o_i per (head, query).
    let big_d: Vec<f32> = (0..nh * t)
        .into_par_iter()
        .map(|job| {
            let (h, i) = (job / t, job % t);
            dot(
                &dos[i * qw + h * hd..i * qw + (h + 1) * hd],
                &os[i * qw + h * hd..i * qw + (h + 1) * hd],
            )
        })
        .collect();
    // dS_ij = P_ij (dP_ij - D_i) with dP_ij = do_i · v_j, times the softcap's derivative
    // 1 - tanh² (d score / d scaled logit); recomputed in both passes.
    let ds = |h: usize, i: usize, j: usize| -> (f32, f32) {
        let kvh = h / group;
        let qi = &qs[i * qw + h * hd..i * qw + (h + 1) * hd];
        let kj = &ks[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
        let vj = &vs[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
        let (sc, dcap) = s.cap(s.scale * dot(qi, kj));
        let p = (sc - ls[h * t + i]).exp();
        let dp = dot(&dos[i * qw + h * hd..i * qw + (h + 1) * hd], vj);
        (p, p * (dp - big_d[h * t + i]) * dcap)
    };
    // Pass 1: dq per (head, query).
    let dq_parts: Vec<Vec<f32>> = (0..nh * t)
        .into_par_iter()
        .map(|job| {
            let (h, i) = (job / t, job % t);
            let kvh = h / group;
            let mut acc = vec![0f32; hd];
            for j in 0..t {
                if mask.visible(i, j) {
                    let (_, d) = ds(h, i, j);
                    let kj = &ks[j * kw + kvh * hd..j * kw + (kvh + 1) * hd];
                    for x in 0..hd {
                        acc[x] += s.scale * d * kj[x];
                    }
                }
            }
            acc
        })
        .collect();
    // Pass 2: dk, dv per (kv head, key), summing over the query heads of the group.
    let dkv_parts: Vec<(Vec<f32>, Vec<f32>)> = (0..nkv * t)
        .into_par_iter()
        .map(|job| {
            let (kvh, j) = (job / t, job % t);
            let mut dk = vec![0f32; hd];
            let mut dv = vec![0f32; hd];
            for h in kvh * group..(kvh + 1) * group {
                for i in 0..t {
                    if mask.visible(i, j) {
                        let (p, d) = ds(h, i, j);
                        let qi = &qs[i * qw + h * hd..i * qw + (h + 1) * hd];
                        let doi = &dos[i * qw + h * hd..i * qw + (h + 1) * hd];
                        for x in 0..hd {
                            dk[x] += s.scale * d * qi[x];
                            dv[x] += p * doi[x];
                        }
                    }
                }
            }
            (dk, dv)
        })
        .collect();
    let mut dq = vec![0f32; t * qw];
    for (job, part) in dq_parts.into_iter().enumerate() {
        let (h, i) = (job / t, job % t);
        dq[i * qw + h * hd..i * qw + (h + 1) * hd].copy_from_slice(&part);
    }
    let mut dk = vec![0f32; t * kw];
    let mut dv = vec![0f32; t * kw];
    for (job, (pk, pv)) in dkv_parts.into_iter().enumerate() {
        let (kvh, j) = (job / t, job % t);
        dk[j * kw + kvh * hd..j * kw + (kvh + 1) * hd].copy_from_slice(&pk);
        dv[j * kw + kvh * hd..j * kw + (kvh + 1) * hd].copy_from_slice(&pv);
    }
    Ok((
        out(dq, q.shape())?,
        out(dk, k.shape())?,
        out(dv, v.shape())?,
    ))
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `act(gate) * up`, elementwise, with `f(g, u)` the product.
fn gated(gate: &Tensor, up: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<Tensor> {
    let (g, u) = (gate.as_cpu()?, up.as_cpu()?);
    let y: Vec<f32> = g
        .par_iter()
        .zip(u.par_iter())
        .map(|(&g, &u)| f(g, u))
        .collect();
    out(y, gate.shape())
}

/// Backward of a gated activation: `f(d, g, u)` is `(d gate, d up)` of one element.
fn gated_bwd(
    dh: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    f: impl Fn(f32, f32, f32) -> (f32, f32) + Sync,
) -> Result<(Tensor, Tensor)> {
    let (d, g, u) = (dh.as_cpu()?, gate.as_cpu()?, up.as_cpu()?);
    let (dg, du): (Vec<f32>, Vec<f32>) = d
        .par_iter()
        .zip(g.par_iter().zip(u.par_iter()))
        .map(|(&d, (&g, &u))| f(d, g, u))
        .unzip();
    Ok((out(dg, gate.shape())?, out(du, up.shape())?))
}

/// `gated_bwd` writing d(gate) over `gate` and d(up) over `up`.
fn gated_bwd_in_place(
    dh: &Tensor,
    gate: &mut Tensor,
    up: &mut Tensor,
    f: impl Fn(f32, f32, f32) -> (f32, f32) + Sync,
) -> Result<()> {
    let d = dh.as_cpu()?;
    let u = up.as_cpu_mut()?;
    gate.as_cpu_mut()?
        .par_iter_mut()
        .zip(u.par_iter_mut().zip(d.par_iter()))
        .for_each(|(g, (u, &d))| (*g, *u) = f(d, *g, *u));
    Ok(())
}

/// `(d gate, d up)` of `silu(g) * u` under upstream `d`.
fn silu_mul_grad(d: f32, g: f32, u: f32) -> (f32, f32) {
    let sig = 1.0 / (1.0 + (-g).exp());
    let dsilu = sig * (1.0 + g * (1.0 - sig));
    (d * u * dsilu, d * g * sig)
}

pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated(gate, up, |g, u| silu(g) * u)
}

pub fn silu_mul_bwd(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    gated_bwd(dh, gate, up, silu_mul_grad)
}

pub fn silu_mul_bwd_in_place(dh: &Tensor, gate: &mut Tensor, up: &mut Tensor) -> Result<()> {
    gated_bwd_in_place(dh, gate, up, silu_mul_grad)
}

/// `√(2/π)` and the cubic coefficient of the tanh approximation of GELU.
const GELU_K: f32 = std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
const GELU_A: f32 = 0.044_715;

/// `gelu_tanh(x)` and its derivative.
#[inline]
fn gelu_tanh_d(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let t = (GELU_K * x * (1.0 + GELU_A * x2)).tanh();
    let y = 0.5 * x * (1.0 + t);
    let dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_A * x2);
    (y, dy)
}

/// `(d gate, d up)` of `gelu_tanh(g) * u` under upstream `d`.
fn gelu_tanh_mul_grad(d: f32, g: f32, u: f32) -> (f32, f32) {
    let (y, dy) = gelu_tanh_d(g);
    (d * u * dy, d * y)
}

pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated(gate, up, |g, u| {
        let t = (GELU_K * g * (1.0 + GELU_A * g * g)).tanh();
        0.5 * g * (1.0 + t) * u
    })
}

pub fn gelu_tanh_mul_bwd(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    gated_bwd(dh, gate, up, gelu_tanh_mul_grad)
}

pub fn gelu_tanh_mul_bwd_in_place(dh: &Tensor, gate: &mut Tensor, up: &mut Tensor) -> Result<()> {
    gated_bwd_in_place(dh, gate, up, gelu_tanh_mul_grad)
}

pub fn softcap(x: &mut Tensor, cap: f32) -> Result<()> {
    let inv = 1.0 / cap;
    x.as_cpu_mut()?
        .par_iter_mut()
        .for_each(|v| *v = cap * (*v * inv).tanh());
    Ok(())
}

pub fn add_assign(a: &mut Tensor, b: &Tensor, alpha: f32) -> Result<()> {
    let b = b.as_cpu()?;
    a.as_cpu_mut()?
        .par_iter_mut()
        .zip(b.par_iter())
        .for_each(|(x, y)| *x += alpha * y);
    Ok(())
}

pub fn add_bias(x: &mut Tensor, bias: &Tensor) -> Result<()> {
    let b = bias.as_cpu()?;
    let n = b.len();
    x.as_cpu_mut()?
        .par_chunks_mut(n)
        .for_each(|r| r.iter_mut().zip(b).for_each(|(x, y)| *x += y));
    Ok(())
}

pub fn scale_rows(x: &mut Tensor, s: &Tensor) -> Result<()> {
    let cols = x.rows_cols().1.max(1);
    let s = s.as_cpu()?;
    x.as_cpu_mut()?
        .par_chunks_mut(cols)
        .zip(s)
        .for_each(|(r, f)| r.iter_mut().for_each(|v| *v *= f));
    Ok(())
}

pub fn scale(x: &mut Tensor, s: f32) -> Result<()> {
    x.as_cpu_mut()?.par_iter_mut().for_each(|v| *v *= s);
    Ok(())
}

pub fn slice_cols(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (r, c) = x.rows_cols();
    let v = x.as_cpu()?;
    let mut y = Vec::with_capacity(r * (end - start));
    for row in v.chunks(c.max(1)).take(r) {
        y.extend_from_slice(&row[start..end]);
    }
    out(y, &[r, end - start])
}

pub fn concat_rows(xs: &[&Tensor], rows: usize, cols: usize) -> Result<Tensor> {
    let mut y = Vec::with_capacity(rows * cols);
    for x in xs {
        y.extend_from_slice(x.as_cpu()?);
    }
    out(y, &[rows, cols])
}

pub fn slice_rows(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (_, c) = x.rows_cols();
    let mut shape = x.shape().to_vec();
    if shape.len() == 1 {
        shape[0] = end - start;
    } else {
        let lead: usize = shape[..shape.len() - 1].iter().product();
        debug_assert!(lead * c == x.numel());
        shape = vec![end - start, c];
    }
    let c = if x.shape().len() == 1 { 1 } else { c };
    out(x.as_cpu()?[start * c..end * c].to_vec(), &shape)
}

pub fn gather_rows(x: &Tensor, idx: &[u32]) -> Result<Tensor> {
    let (_, c) = x.rows_cols();
    let xs = x.as_cpu()?;
    let mut y = vec![0f32; idx.len() * c];
    for (row, &i) in y.chunks_mut(c).zip(idx) {
        row.copy_from_slice(&xs[i as usize * c..(i as usize + 1) * c]);
    }
    out(y, &[idx.len(), c])
}

pub fn copy_rows_into(dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
    let (_, c) = dst.rows_cols();
    let s = src.as_cpu()?;
    let d = dst.as_cpu_mut()?;
    for (k, &i) in idx.iter().enumerate() {
        d[i as usize * c..(i as usize + 1) * c].copy_from_slice(&s[k * c..(k + 1) * c]);
    }
    Ok(())
}

pub fn scatter_add_rows(dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
    let (_, c) = dst.rows_cols();
    let s = src.as_cpu()?;
    let d = dst.as_cpu_mut()?;
    for (k, &i) in idx.iter().enumerate() {
        for (a, b) in d[i as usize * c..(i as usize + 1) * c]
            .iter_mut()
            .zip(&s[k * c..(k + 1) * c])
        {
            *a += b;
        }
    }
    Ok(())
}

pub fn logsoftmax_gather(logits: &Tensor, targets: &[u32]) -> Result<(Tensor, Tensor)> {
    let (rows, v) = logits.rows_cols();
    let l = logits.as_cpu()?;
    let (logp, lse): (Vec<f32>, Vec<f32>) = (0..rows)
        .into_par_iter()
        .map(|r| {
            let row = &l[r * v..(r + 1) * v];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let s: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
            let lse = m + s.ln() as f32;
            let t = targets[r];
            (
                if t == u32::MAX {
                    0.0
                } else {
                    row[t as usize] - lse
                },
                lse,
            )
        })
        .unzip();
    Ok((out(logp, &[rows])?, out(lse, &[rows])?))
}

pub fn logsoftmax_gather_bwd(
    dlogp: &Tensor,
    logits: &Tensor,
    lse: &Tensor,
    targets: &[u32],
) -> Result<Tensor> {
    let (rows, v) = logits.rows_cols();
    let (l, ls, dl) = (logits.as_cpu()?, lse.as_cpu()?, dlogp.as_cpu()?);
    let mut d = vec![0f32; rows * v];
    d.par_chunks_mut(v).enumerate().for_each(|(r, dr)| {
        let t = targets[r];
        if t == u32::MAX {
            return;
        }
        let g = dl[r];
        for (j, x) in dr.iter_mut().enumerate() {
            *x = -g * (l[r * v + j] - ls[r]).exp();
        }
        dr[t as usize] += g;
    });
    out(d, logits.shape())
}

/// `logsoftmax_gather_bwd` through a softcap: `logits` hold the capped `y = cap·tanh(z/cap)`, and
/// the gradient is with respect to `z`: `dlogp · (onehot − softmax(y)) · (1 − (y/cap)²)`.
pub fn logsoftmax_gather_softcap_bwd(
    dlogp: &Tensor,
    logits: &Tensor,
    lse: &Tensor,
    targets: &[u32],
    cap: f32,
) -> Result<Tensor> {
    let (rows, v) = logits.rows_cols();
    let (l, ls, dl) = (logits.as_cpu()?, lse.as_cpu()?, dlogp.as_cpu()?);
    let inv = 1.0 / cap;
    let mut d = vec![0f32; rows * v];
    d.par_chunks_mut(v).enumerate().for_each(|(r, dr)| {
        let t = targets[r];
        if t == u32::MAX {
            return;
        }
        let g = dl[r];
        let lr = &l[r * v..(r + 1) * v];
        for (j, (x, &y)) in dr.iter_mut().zip(lr).enumerate() {
            let onehot = if j == t as usize { 1.0 } else { 0.0 };
            let th = y * inv;
            *x = g * (onehot - (y - ls[r]).exp()) * ((1.0 - th) * (1.0 + th));
        }
    });
    out(d, logits.shape())
}

pub fn dropout(x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
    let keep_scale = 1.0 / (1.0 - p);
    let y: Vec<f32> = x
        .as_cpu()?
        .par_iter()
        .enumerate()
        .map(|(i, &v)| {
            if super::dropout_keep(seed, i as u64, p) {
                v * keep_scale
            } else {
                0.0
            }
        })
        .collect();
    out(y, x.shape())
}

/// Σ x² in f64, the same bits on every run: rayon's own `sum` adds in a tree whose shape
/// depends on which tasks were stolen, so the grad norm (and a clip it decides) would move in
/// the last bits between a run and its resume. Fixed chunks are summed in parallel, then their
/// partial sums in order.
pub fn sum_sq(x: &[f32]) -> f64 {
    const CHUNK: usize = 1 << 14;
    let partial: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>())
        .collect();
    partial.iter().sum()
}

pub fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: AdamW,
) -> Result<()> {
    let g = grad.as_cpu()?;
    let (ms, vs) = (m.as_cpu_mut()?, v.as_cpu_mut()?);
    let p = param.as_cpu_mut()?;
    let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
    let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
    for i in 0..p.len() {
        let gi = g[i] * h.grad_scale;
        ms[i] = h.beta1 * ms[i] + (1.0 - h.beta1) * gi;
        vs[i] = h.beta2 * vs[i] + (1.0 - h.beta2) * gi * gi;
        let mhat = ms[i] as f64 / bc1;
        let vhat = vs[i] as f64 / bc2;
        p[i] *= 1.0 - h.lr * h.weight_decay;
        p[i] -= (h.lr as f64 * mhat / (vhat.sqrt() + h.eps as f64)) as f32;
    }
    Ok(())
}

/// The tensors' sums of squares (each `sum_sq`) added in order.
pub fn sum_sq_multi(xs: &[&Tensor]) -> Result<DeviceValues> {
    let mut total = 0.0;
    for x in xs {
        total += sum_sq(x.as_cpu()?);
    }
    Ok(DeviceValues::cpu(vec![total]))
}

/// `adamw_step` on each item with its own lr, then its compute copy (f32 here) set to the new
/// parameter and its gradient zeroed.
pub fn adamw_multi(items: &mut [AdamWItem], h: AdamW, clip: Option<NormClip>) -> Result<()> {
    let grad_scale = match clip {
        Some(c) => clip_scale(c.sum_sq.as_cpu()?[0], c.average, c.max_norm) as f32,
        None => h.grad_scale,
    };
    for it in items.iter_mut() {
        let h = AdamW {
            lr: it.lr,
            grad_scale,
            ..h
        };
        adamw_step(it.param, it.grad, it.m, it.v, h)?;
        if let Some(c) = it.compute.as_deref_mut() {
            c.as_cpu_mut()?.copy_from_slice(it.param.as_cpu()?);
        }
        it.grad.as_cpu_mut()?.fill(0.0);
    }
    Ok(())
}

/// Copies every source into its destination (CPU tensors are all f32).
pub fn cast_multi(pairs: &mut [(&Tensor, &mut Tensor)]) -> Result<()> {
    for (src, dst) in pairs.iter_mut() {
        dst.as_cpu_mut()?.copy_from_slice(src.as_cpu()?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The parallel sum must equal the same chunks added one after the other, bit for bit, on
    /// every call (a resumed run recomputes the grad norm and must get the same one).
    #[test]
    fn sum_sq_is_the_in_order_sum_of_fixed_chunks() {
        let x: Vec<f32> = (0..100_003)
            .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32))
            .collect();
        let want: f64 = x
            .chunks(1 << 14)
            .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>())
            .fold(0.0, |a, b| a + b);
        for _ in 0..20 {
            assert_eq!(super::sum_sq(&x).to_bits(), want.to_bits());
        }
    }
}
