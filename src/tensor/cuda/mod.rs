//! The CUDA backend (contract stub; kernels land in this folder).

use super::{AdamW, AttnMask, AttnShape, DType, MemoryStats, RopeTable, Tensor};
use anyhow::{bail, Result};
use std::sync::Arc;

pub struct CudaBackend {}
pub struct CudaStorage {}

impl CudaStorage {
    pub fn download_f32(&self, _n: usize, _dtype: DType) -> Result<Vec<f32>> {
        bail!("cuda: todo")
    }
}

#[allow(unused_variables, clippy::too_many_arguments)]
impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<Arc<CudaBackend>> {
        bail!("cuda: todo")
    }
    pub fn name(&self) -> String {
        "cuda".into()
    }
    pub fn memory(&self) -> MemoryStats {
        MemoryStats::default()
    }
    pub fn reset_peak(&self) {}
    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    pub fn upload(&self, data: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn copy(&self, x: &Tensor) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn matmul(
        &self,
        a: &Tensor,
        ta: bool,
        b: &Tensor,
        tb: bool,
        alpha: f32,
        out_dtype: DType,
    ) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn matmul_acc(
        &self,
        c: &mut Tensor,
        a: &Tensor,
        ta: bool,
        b: &Tensor,
        tb: bool,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        bail!("cuda: todo")
    }
    pub fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn embedding_bwd(&self, dy: &Tensor, ids: &[u32], vocab: usize) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        bail!("cuda: todo")
    }
    pub fn rms_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
    ) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn rope(
        &self,
        x: &Tensor,
        table: &RopeTable,
        n_heads: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        s: AttnShape,
    ) -> Result<(Tensor, Tensor)> {
        bail!("cuda: todo")
    }
    pub fn attention_bwd(
        &self,
        d_o: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        mask: &AttnMask,
        s: AttnShape,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        bail!("cuda: todo")
    }
    pub fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn silu_mul_bwd(
        &self,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        bail!("cuda: todo")
    }
    pub fn add_assign(&self, a: &mut Tensor, b: &Tensor, alpha: f32) -> Result<()> {
        bail!("cuda: todo")
    }
    pub fn add_bias(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        bail!("cuda: todo")
    }
    pub fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        bail!("cuda: todo")
    }
    pub fn slice_rows(&self, x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn scatter_add_rows(&self, dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
        bail!("cuda: todo")
    }
    pub fn logsoftmax_gather(&self, logits: &Tensor, targets: &[u32]) -> Result<(Tensor, Tensor)> {
        bail!("cuda: todo")
    }
    pub fn logsoftmax_gather_bwd(
        &self,
        dlogp: &Tensor,
        logits: &Tensor,
        lse: &Tensor,
        targets: &[u32],
    ) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn dropout(&self, x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
        bail!("cuda: todo")
    }
    pub fn sum_sq(&self, x: &Tensor) -> Result<f64> {
        bail!("cuda: todo")
    }
    pub fn adamw_step(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        h: AdamW,
    ) -> Result<()> {
        bail!("cuda: todo")
    }
}
