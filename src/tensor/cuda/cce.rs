//! Host side of the fused linear cross-entropy kernels (`kernels/cce.cu`): grid sizing (the
//! vocabulary is split across blocks so that a few rows still fill the GPU), the partial buffers,
//! and the launches. Nothing here allocates `[N, V]`: the forward holds `[nsplit, N]` partial
//! (max, sum) pairs, the backward one f32 `[N, H]` accumulator that the vocabulary splits add into
//! atomically and that is cast to bf16 at the end.

use super::{cuda_ptr, Arg, CudaBackend};
use crate::tensor::{DType, Tensor};
use anyhow::{ensure, Result};

/// Rows per block and vocabulary rows per tile (must match `CBM`/`CBV` in cce.cu).
const BM: usize = 64;
const BV: usize = 128;

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// `(row tiles, vocabulary splits, tiles per split)`: about four blocks per SM in all.
    fn cce_grid(&self, n: usize, v: usize) -> (u32, u32, i32) {
        let row_tiles = n.div_ceil(BM).max(1);
        let ntiles = v.div_ceil(BV).max(1);
        let want = (self.inner.sm_count as usize * 4)
            .div_ceil(row_tiles)
            .clamp(1, ntiles);
        let tps = ntiles.div_ceil(want);
        let nsplit = ntiles.div_ceil(tps);
        (row_tiles as u32, nsplit as u32, tps as i32)
    }

    fn cce_check(&self, h: &Tensor, w: &Tensor) -> Result<()> {
        ensure!(
            h.dtype() == DType::BF16 && w.dtype() == DType::BF16,
            "cuda cce: h and W must be bf16 (got {:?} and {:?})",
            h.dtype(),
            w.dtype()
        );
        ensure!(
            w.dim(0) < i32::MAX as usize && h.rows_cols().0 < i32::MAX as usize,
            "cuda cce: too many rows"
        );
        Ok(())
    }

    /// See `tensor::cce::cce_forward`.
    pub fn cce_forward(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &[u32],
        softcap: Option<f32>,
    ) -> Result<(Tensor, Tensor)> {
        self.cce_check(h, w)?;
        let (n, hd) = h.rows_cols();
        let v = w.dim(0);
        let logp = self.empty(&[n], DType::F32)?;
        let lse = self.empty(&[n], DType::F32)?;
        if n == 0 {
            return Ok((logp, lse));
        }
        let (rt, ns, tps) = self.cce_grid(n, v);
        let tb = self.upload_u32(targets)?;
        let pm = self.empty(&[ns as usize, n], DType::F32)?;
        let pl = self.empty(&[ns as usize, n], DType::F32)?;
        let tl = self.empty(&[n], DType::F32)?;
        self.launch(
            if softcap.is_some() {
                "lf_cce_fwd_cap"
            } else {
                "lf_cce_fwd"
            },
            (rt, ns, 1),
            128,
            0,
            &[
                Arg::P(cuda_ptr(h)?),
                Arg::P(cuda_ptr(w)?),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(&pm)?),
                Arg::P(cuda_ptr(&pl)?),
                Arg::P(cuda_ptr(&tl)?),
                Arg::I32(n as i32),
                Arg::I32(v as i32),
                Arg::I32(hd as i32),
                Arg::I32(tps),
                Arg::F32(softcap.unwrap_or(1.0)),
            ],
        )?;
        self.launch(
            "lf_cce_combine",
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(&pm)?),
                Arg::P(cuda_ptr(&pl)?),
                Arg::P(cuda_ptr(&tl)?),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(&logp)?),
                Arg::P(cuda_ptr(&lse)?),
                Arg::I32(n as i32),
                Arg::I32(ns as i32),
            ],
        )?;
        Ok((logp, lse))
    }

    /// See `tensor::cce::cce_backward`. `filter_eps == 0` selects the kernels without the filter.
    pub fn cce_backward(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &[u32],
        dlogp: &Tensor,
        lse: &Tensor,
        softcap: Option<f32>,
        filter_eps: f32,
    ) -> Result<Tensor> {
        self.cce_check(h, w)?;
        let (n, hd) = h.rows_cols();
        let v = w.dim(0);
        let dh32 = self.zeros(&[n, hd], DType::F32)?;
        if n == 0 {
            return dh32.to_dtype(h.dtype());
        }
        let (rt, ns, tps) = self.cce_grid(n, v);
        let tb = self.upload_u32(targets)?;
        let name = match (softcap.is_some(), filter_eps > 0.0) {
            (false, true) => "lf_cce_bwd",
            (true, true) => "lf_cce_bwd_cap",
            (false, false) => "lf_cce_bwd_nofilt",
            (true, false) => "lf_cce_bwd_cap_nofilt",
        };
        self.launch(
            name,
            (rt, ns, 1),
            128,
            0,
            &[
                Arg::P(cuda_ptr(h)?),
                Arg::P(cuda_ptr(w)?),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(dlogp)?),
                Arg::P(cuda_ptr(lse)?),
                Arg::P(cuda_ptr(&dh32)?),
                Arg::I32(n as i32),
                Arg::I32(v as i32),
                Arg::I32(hd as i32),
                Arg::I32(tps),
                Arg::F32(softcap.unwrap_or(1.0)),
                Arg::F32(filter_eps),
            ],
        )?;
        if h.dtype() == DType::F32 {
            Ok(dh32)
        } else {
            self.cast(&dh32, h.dtype())
        }
    }
}
