//! f32 → ggml block encodings, the inverse of `model::gguf::dequantize`, for writing merged
//! GGUF tensors back in the type they came in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K).
//!
//! Each quantizer follows ggml-quants.c's reference `quantize_row_*_ref` step for step (the
//! scale search of `make_qkx2_quants` for Q4_K and `make_qx_quants` for Q6_K included), so a
//! merged file carries the same kind of rounding error llama.cpp's own `llama-quantize` would
//! give it. Round-to-nearest is ggml's `nearest_int` (ties to even). Whole rows are whole
//! blocks, so a row-major `[rows, cols]` matrix is quantized as one flat run of values.

use crate::model::gguf::GgmlType;
use anyhow::{bail, Result};
use half::{bf16, f16};

/// Encodes `x` as `ty`. `x.len()` must be a multiple of the type's block size.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let bs = ty.block_size();
    if !x.len().is_multiple_of(bs) {
        bail!(
            "{} values is not a whole number of {ty} blocks of {bs}",
            x.len()
        );
    }
    let mut out = Vec::with_capacity(x.len() / bs * ty.type_size());
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => x
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => x.chunks_exact(32).for_each(|b| q8_0(b, &mut out)),
        GgmlType::Q4_0 => x.chunks_exact(32).for_each(|b| q4_0(b, &mut out)),
        GgmlType::Q4_1 => x.chunks_exact(32).for_each(|b| q4_1(b, &mut out)),
        GgmlType::Q4_K => x.chunks_exact(256).for_each(|b| q4_k(b, &mut out)),
        GgmlType::Q6_K => x.chunks_exact(256).for_each(|b| q6_k(b, &mut out)),
        other => bail!(
            "no quantizer for ggml type {other} (lorafit writes F32, F16, BF16, Q8_0, Q4_0, \
             Q4_1, Q4_K and Q6_K); export with --merged-type f16 instead"
        ),
    }
    Ok(out)
}

/// Whether [`quantize`] can write `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4_K | Q6_K)
}

/// ggml's `nearest_int`: round to nearest, ties to even.
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend(f16::from_f32(v).to_le_bytes());
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    // The value of largest magnitude, with its sign, maps to -8.
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    for j in 0..16 {
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        out.push(q0 | (q1 << 4));
    }
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    push_f16(out, min);
    for j in 0..16 {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        out.push(q0 | (q1 << 4));
    }
}

/// ggml's `make_qkx2_quants`: a scale and a (non-positive) offset for `x` on `0..=nmax`,
/// searched over `nstep` candidate scales by weighted least squares. Returns `(scale, -min)`.
fn make_qkx2_quants(x: &[f32], weights: &[f32], nmax: i32, l_out: &mut [u8]) -> (f32, f32) {
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * diff * diff;
    }
    let mut aux = vec![0u8; n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * diff * diff;
            }
            if cur_error < best_error {
                l_out.copy_from_slice(&aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let mut levels = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut weights = [0f32; 32];
    for j in 0..8 {
        let sub = &x[32 * j..32 * j + 32];
        let av_x = (sub.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(sub) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(sub, &weights, 15, &mut levels[32 * j..32 * j + 32]);
        scales[j] = s;
        mins[j] = m;
    }
    let max_scale = scales.iter().fold(0f32, |a, &b| a.max(b));
    let max_min = mins.iter().fold(0f32, |a, &b| a.max(b));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = d.to_f32() * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dj).clamp(0, 15) as u8;
        }
    }
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(packed);
    for g in 0..4 {
        for l in 0..32 {
            out.push(levels[64 * g + l] | (levels[64 * g + l + 32] << 4));
        }
    }
}

/// ggml's `get_scale_min_k4` (the same unpacking `model::gguf` dequantizes with).
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's `GROUP_MAX_EPS`: below this a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qx_quants` with `rmse_type = 1` (weights x²): the scale of a symmetric
/// quantization on `-nmax..nmax-1`, refined over 18 nearby candidate scales.
fn make_qx_quants(x: &[f32], nmax: i32) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let sums = |iscale: f32| -> (f32, f32) {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let (sumlx, suml2) = sums(-(nmax as f32) / max);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        let (sumlx, suml2) = sums(-(nmax as f32 + 0.1 * is as f32) / max);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = make_qx_quants(&x[16 * ib..16 * ib + 16], 32);
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = *s;
        }
    }
    let mut block = [0u8; 210];
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend(block);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * v).min(127) as i8;
    }
    let mut levels = [32u8; 256];
    for j in 0..16 {
        let dj = d.to_f32() * sc[j] as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * j + i] = (nearest_int(x[16 * j + i] / dj).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, rest) = block.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    for n in 0..2 {
        let lv = &levels[128 * n..128 * n + 128];
        let ql = &mut ql[64 * n..64 * n + 64];
        let qh = &mut qh[32 * n..32 * n + 32];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (lv[l], lv[l + 32], lv[l + 64], lv[l + 96]);
            ql[l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    for (dst, s) in rest[..16].iter_mut().zip(sc) {
        *dst = s as u8;
    }
    rest[16..18].copy_from_slice(&d.to_le_bytes());
    out.extend(block);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::dequantize;

    fn wavy(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::tensor::Rng(seed);
        (0..n).map(|_| rng.normal() as f32 * 0.05).collect()
    }

    /// Quantize then dequantize with the project's reader: the format matches (the values
    /// come back within the type's step) and, for the 16-bit types, exactly as rounded.
    #[test]
    fn round_trip_through_the_dequantizer() {
        let x = wavy(4 * 256, 7);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Worst-case error per value: half a quantization step of the block's range.
        // Q8_0: amax/127/2; Q4_0: amax/8/2 (16 levels over 2·amax); Q4_1: range/15/2;
        // Q4_K: range/15/2 plus the 6-bit scale's rounding; Q6_K: amax/32/2 plus the 8-bit
        // scale's rounding. The bounds below are those with a margin for the f16 block scales.
        for (ty, bound) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, amax * 1e-3),
            (GgmlType::BF16, amax * 4e-3),
            (GgmlType::Q8_0, amax / 127.0),
            (GgmlType::Q4_0, amax / 8.0),
            (GgmlType::Q4_1, 2.0 * amax / 15.0),
            (GgmlType::Q4_K, 2.0 * amax / 15.0),
            (GgmlType::Q6_K, amax / 20.0),
        ] {
            let bytes = quantize(ty, &x).unwrap();
            assert_eq!(bytes.len(), ty.bytes_for(x.len()).unwrap(), "{ty}");
            let mut back = vec![0f32; x.len()];
            dequantize(ty, &bytes, x.len(), &mut back).unwrap();
            let worst = x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= bound, "{ty}: max error {worst} > {bound}");
            let rms = (x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                / x.len() as f32)
                .sqrt();
            // The 4-bit types must still carry the signal: RMS error well under the values'.
            if ty != GgmlType::F32 {
                assert!(rms > 0.0 && rms < 0.2 * 0.05, "{ty}: rms {rms}");
            }
        }
    }

    /// Hand-checked blocks: Q8_0 of a ramp, Q4_0's sign convention, Q4_1's offset.
    #[test]
    fn known_blocks() {
        let ramp: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
        let b = quantize(GgmlType::Q8_0, &ramp).unwrap();
        // d = 16/127, q = round(x·127/16): -16 -> -127, 8 -> 64 (63.5 rounds away from 0).
        assert_eq!(
            f16::from_le_bytes([b[0], b[1]]),
            f16::from_f32(16.0 / 127.0)
        );
        assert_eq!(b[2] as i8, -127);
        assert_eq!(b[2 + 24] as i8, 64);
        let b = quantize(GgmlType::Q4_0, &ramp).unwrap();
        // max = -16 (largest magnitude): d = 2, and x = -16 -> q = 0, x = 15 -> 15 (clamped).
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 2.0);
        assert_eq!(b[2] & 0xF, 0);
        assert_eq!(b[2 + 15] >> 4, 15);
        let b = quantize(GgmlType::Q4_1, &ramp).unwrap();
        // d = (15 − (−16))/15, stored as f16.
        assert_eq!(
            f16::from_le_bytes([b[0], b[1]]),
            f16::from_f32(31.0f32 / 15.0)
        );
        assert_eq!(f16::from_le_bytes([b[2], b[3]]).to_f32(), -16.0);
        let zeros = vec![0f32; 256];
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let mut back = vec![1f32; 256];
            dequantize(ty, &quantize(ty, &zeros).unwrap(), 256, &mut back).unwrap();
            assert!(back.iter().all(|&v| v == 0.0), "{ty}");
        }
        assert!(quantize(GgmlType::Q5_0, &ramp).is_err());
        assert!(quantize(GgmlType::Q8_0, &ramp[..31]).is_err());
    }
}
