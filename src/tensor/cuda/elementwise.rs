//! Host side of `kernels/elementwise.cu`: RMSNorm (with the residual add and its backward),
//! RoPE, the gated activations, adds and scales, row slices and gathers, the log-softmax gather
//! and softcap of the head, dropout, sums of squares, AdamW and the multi-tensor casts.
use super::gemm::Mat;
use super::*;

/// The kernels of one gated MLP activation `act(gate) * up`: any dtype, and bf16 eight at a time.
struct GateKernels {
    fwd: &'static str,
    fwd8: &'static str,
    bwd: &'static str,
    bwd8: &'static str,
    /// Fused with the down projection's LoRA input (`gated_mul_xa`).
    xa: &'static str,
    /// The backward with the down adapter's term added to d(h) (`gated_mul_bwd_lora_in_place`).
    bwd_lora: &'static str,
    /// That backward with the LoRA gradients that read its tensors (`gated_mul_bwd_lora_grads`).
    bwd_lora_grads: &'static str,
}

const SILU: GateKernels = GateKernels {
    fwd: "lf_silu_mul",
    fwd8: "lf_silu_mul_bf16x8",
    bwd: "lf_silu_mul_bwd",
    bwd8: "lf_silu_mul_bwd_bf16x8",
    xa: "lf_silu_mul_xa",
    bwd_lora: "lf_silu_mul_bwd_lora",
    bwd_lora_grads: "lf_mlpg_silu",
};

const GELU_TANH: GateKernels = GateKernels {
    fwd: "lf_gelu_tanh_mul",
    fwd8: "lf_gelu_tanh_mul_bf16x8",
    bwd: "lf_gelu_tanh_mul_bwd",
    bwd8: "lf_gelu_tanh_mul_bwd_bf16x8",
    xa: "lf_gelu_tanh_mul_xa",
    bwd_lora: "lf_gelu_tanh_mul_bwd_lora",
    bwd_lora_grads: "lf_mlpg_gelu_tanh",
};

/// Columns of one slice of the fused forward's blocks (`gated_mul_xa` in
/// `kernels/elementwise.cu`, a multiple of 32). 512 and 2048 measured the same step at qwen1.5b.
const GATED_XA_SLICE: usize = 1024;

/// Whether every tensor is bf16 and starts on 16 bytes (the fused gated kernels' vector loads).
fn bf16_aligned(ts: &[&Tensor]) -> Result<bool> {
    for t in ts {
        if t.dtype() != DType::BF16 || !cuda_ptr(t)?.is_multiple_of(16) {
            return Ok(false);
        }
    }
    Ok(true)
}

fn gate_kernels(act: crate::tensor::GatedAct) -> &'static GateKernels {
    match act {
        crate::tensor::GatedAct::Silu => &SILU,
        crate::tensor::GatedAct::GeluTanh => &GELU_TANH,
    }
}

impl CudaBackend {
    pub fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        self.rms_norm_to(x, w, eps, x.dtype())
    }

    /// RMSNorm with the output stored in `out_dtype`.
    pub fn rms_norm_to(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out_dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let (y, rstd, _) = self.rms_norm_launch(x, None, w, eps, out_dtype)?;
        Ok((y, rstd))
    }

    pub fn add_rms_norm_to(
        &self,
        x: &Tensor,
        r: &Tensor,
        w: &Tensor,
        eps: f32,
        out_dtype: DType,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (y, rstd, sum) = self.rms_norm_launch(x, Some(r), w, eps, out_dtype)?;
        Ok((sum.context("add_rms_norm: no sum")?, y, rstd))
    }

    /// RMSNorm of `x` (or of `x + r`, also returned, in `x`'s dtype) with the output in
    /// `out_dtype`; one block per row.
    fn rms_norm_launch(
        &self,
        x: &Tensor,
        r: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
        out_dtype: DType,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (rows, h) = x.rows_cols();
        let y = self.empty(x.shape(), out_dtype)?;
        let rstd = self.empty(&[rows], DType::F32)?;
        let sum = match r {
            Some(_) => Some(self.empty(x.shape(), x.dtype())?),
            None => None,
        };
        self.launch(
            rms_kernel("lf_rms_norm", h),
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(r.map(cuda_ptr).transpose()?.unwrap_or(0)),
                dt(r.map_or(DType::F32, |t| t.dtype())),
                Arg::P(sum.as_ref().map(cuda_ptr).transpose()?.unwrap_or(0)),
                Arg::P(cuda_ptr(w)?),
                dt(w.dtype()),
                Arg::P(cuda_ptr(&y)?),
                dt(out_dtype),
                Arg::P(cuda_ptr(&rstd)?),
                Arg::I32(h as i32),
                Arg::F32(eps),
            ],
        )?;
        Ok((y, rstd, sum))
    }

    /// dx of RMSNorm, plus `add` when given (the residual gradient), in one pass; with `copy` a
    /// second output: dx in that dtype, written by the same kernel (the compute-dtype operand of
    /// the projection that reads the gradient next).
    pub fn rms_norm_bwd_add(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        add: Option<&Tensor>,
        copy: Option<DType>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (rows, h) = x.rows_cols();
        ensure!(rstd.dtype() == DType::F32, "rms_norm_bwd: rstd must be f32");
        let dx = self.empty(x.shape(), x.dtype())?;
        let dxc = copy.map(|c| self.empty(x.shape(), c)).transpose()?;
        self.launch(
            rms_kernel("lf_rms_norm_bwd", h),
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(dy)?),
                dt(dy.dtype()),
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(cuda_ptr(w)?),
                dt(w.dtype()),
                Arg::P(cuda_ptr(rstd)?),
                Arg::P(add.map(cuda_ptr).transpose()?.unwrap_or(0)),
                dt(add.map_or(DType::F32, |t| t.dtype())),
                Arg::P(cuda_ptr(&dx)?),
                Arg::P(dxc.as_ref().map(cuda_ptr).transpose()?.unwrap_or(0)),
                dt(copy.unwrap_or(DType::F32)),
                Arg::I32(h as i32),
            ],
        )?;
        Ok((dx, dxc))
    }

    pub fn rope(
        &self,
        x: &Tensor,
        table: &RopeTable,
        n_heads: usize,
        inverse: bool,
    ) -> Result<Tensor> {
        ensure!(
            table.cos.dtype() == DType::F32 && table.sin.dtype() == DType::F32,
            "rope: tables must be f32"
        );
        let (t, _) = x.rows_cols();
        let y = self.empty(x.shape(), x.dtype())?;
        let half = table.head_dim / 2;
        let mut args = vec![
            Arg::P(cuda_ptr(x)?),
            dt(x.dtype()),
            Arg::P(cuda_ptr(&table.cos)?),
            Arg::P(cuda_ptr(&table.sin)?),
            Arg::P(cuda_ptr(&y)?),
            Arg::I64(t as i64),
            Arg::I32(n_heads as i32),
            Arg::I32(table.head_dim as i32),
            Arg::F32(if inverse { -1.0 } else { 1.0 }),
        ];
        // bf16 with a half of whole 16-byte chunks, aligned: eight pairs per thread through
        // 16-byte loads and 32-bit indices; with an even half: two pairs per thread (neither
        // kernel takes a dtype flag).
        let chunks = t * n_heads * half / 8;
        let x8 = half.is_multiple_of(8)
            && chunks < i32::MAX as usize
            && cuda_ptr(x)?.is_multiple_of(16)
            && cuda_ptr(&y)?.is_multiple_of(16);
        if x.dtype() == DType::BF16 && x8 {
            args.remove(1);
            args[4] = Arg::I32(chunks as i32);
            self.launch_n("lf_rope_bf16x8", chunks, &args)?;
        } else if x.dtype() == DType::BF16 && half.is_multiple_of(2) {
            args.remove(1);
            self.launch_n("lf_rope_bf16x2", t * n_heads * half / 2, &args)?;
        } else {
            self.launch_n("lf_rope", t * n_heads * half, &args)?;
        }
        Ok(y)
    }

    pub fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.gated_mul(&SILU, gate, up)
    }

    pub fn silu_mul_bwd(
        &self,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.gated_mul_bwd(&SILU, dh, gate, up)
    }

    pub fn silu_mul_bwd_in_place(
        &self,
        dh: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<()> {
        self.gated_mul_bwd_in_place(&SILU, dh, gate, up)
    }

    pub fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.gated_mul(&GELU_TANH, gate, up)
    }

    pub fn gelu_tanh_mul_bwd(
        &self,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.gated_mul_bwd(&GELU_TANH, dh, gate, up)
    }

    pub fn gelu_tanh_mul_bwd_in_place(
        &self,
        dh: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<()> {
        self.gated_mul_bwd_in_place(&GELU_TANH, dh, gate, up)
    }

    /// The backward of `act(gate) * up` from `d_base + dxa A`, written over `gate` and `up`,
    /// where the fused kernel serves the shapes (all bf16, `I % 8 == 0`, rank up to 16, 16-byte
    /// aligned): false, with nothing written, otherwise.
    pub fn gated_mul_bwd_lora_in_place(
        &self,
        act: crate::tensor::GatedAct,
        d_base: &Tensor,
        dxa: &Tensor,
        a: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<bool> {
        let k = gate_kernels(act);
        let ((t, n), (r, an), (xt, xr)) = (gate.rows_cols(), a.rows_cols(), dxa.rows_cols());
        let serves = bf16_aligned(&[d_base, dxa, a, gate, up])?
            && gate.shape() == up.shape()
            && d_base.shape() == gate.shape()
            && gate.shape().len() == 2
            && an == n
            && (xt, xr) == (t, r)
            && n.is_multiple_of(8)
            && (1..=16).contains(&r)
            && t > 0;
        if !serves {
            return Ok(false);
        }
        self.launch(
            k.bwd_lora,
            (n.div_ceil(1024) as u32, t.div_ceil(32) as u32, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(d_base)?),
                Arg::P(cuda_ptr(dxa)?),
                Arg::P(cuda_ptr(a)?),
                Arg::P(cuda_ptr(gate)?),
                Arg::P(cuda_ptr(up)?),
                Arg::I64(t as i64),
                Arg::I32(n as i32),
                Arg::I32(r as i32),
            ],
        )?;
        Ok(true)
    }

    /// `gated_mul_bwd_lora_in_place` with the LoRA gradients that read its tensors
    /// (`tensor::GatedLoraGrads`) summed inside the same pass, where the fused kernel serves the
    /// shapes (all bf16, `I % 32 == 0`, even ranks up to 16, 16-byte aligned (T, I) tensors and
    /// 4-byte aligned rank rows, f32 gradients): false, with nothing written, otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_mul_bwd_lora_grads(
        &self,
        act: crate::tensor::GatedAct,
        d_base: &Tensor,
        dxa: &Tensor,
        a: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
        grads: &mut crate::tensor::GatedLoraGrads,
    ) -> Result<bool> {
        let k = gate_kernels(act);
        let ((t, n), (rd, an), (xt, xr)) = (gate.rows_cols(), a.rows_cols(), dxa.rows_cols());
        let width = |c: &crate::tensor::Cols| c.end - c.start;
        let (rg, ru) = (width(&grads.xa_gate), width(&grads.xa_up));
        let rank_ok = |r: usize| (2..=16).contains(&r) && r.is_multiple_of(2);
        let (xg, xu) = (Mat::cols(grads.xa_gate)?, Mat::cols(grads.xa_up)?);
        let rows = |c: &crate::tensor::Cols, m: &Mat| {
            c.t.dtype() == DType::BF16
                && c.t.rows_cols().0 == t
                && m.ptr.is_multiple_of(4)
                && m.ld.is_multiple_of(2)
        };
        let f32_shaped = |g: &Tensor, shape: [usize; 2]| {
            g.dtype() == DType::F32 && g.shape() == shape.as_slice()
        };
        let serves = bf16_aligned(&[d_base, dxa, a, gate, up])?
            && gate.shape() == up.shape()
            && d_base.shape() == gate.shape()
            && gate.shape().len() == 2
            && an == n
            && (xt, xr) == (t, rd)
            && n.is_multiple_of(32)
            && rank_ok(rd)
            && rank_ok(rg)
            && rank_ok(ru)
            && rows(&grads.xa_gate, &xg)
            && rows(&grads.xa_up, &xu)
            && f32_shaped(grads.grad_a_down, [rd, n])
            && f32_shaped(grads.grad_b_gate, [n, rg])
            && f32_shaped(grads.grad_b_up, [n, ru])
            && t > 0;
        if !serves {
            return Ok(false);
        }
        // Row groups enough for about four blocks of four warps a multiprocessor.
        let (col_blocks, steps) = (n.div_ceil(128), t.div_ceil(16));
        let want = (4 * self.inner.sm_count as usize).div_ceil(col_blocks);
        let groups = want.clamp(1, steps);
        let steps_per_group = steps.div_ceil(groups);
        let groups = steps.div_ceil(steps_per_group);
        // Each row group's sums; freed after the launches are queued (stream-ordered reuse).
        let part = self.empty(&[groups * 3 * 16 * n], DType::F32)?;
        self.launch(
            k.bwd_lora_grads,
            (col_blocks as u32, groups as u32, 1),
            128,
            0,
            &[
                Arg::P(cuda_ptr(d_base)?),
                Arg::P(cuda_ptr(dxa)?),
                Arg::I32(xr as i32), // dxa's row length
                Arg::I32(rd as i32),
                Arg::P(cuda_ptr(a)?),
                Arg::P(cuda_ptr(gate)?),
                Arg::P(cuda_ptr(up)?),
                Arg::P(xg.ptr),
                Arg::I32(xg.ld as i32),
                Arg::I32(rg as i32),
                Arg::P(xu.ptr),
                Arg::I32(xu.ld as i32),
                Arg::I32(ru as i32),
                Arg::P(cuda_ptr(&part)?),
                Arg::I64(t as i64),
                Arg::I32(n as i32),
                Arg::I32(steps_per_group as i32),
            ],
        )?;
        self.launch(
            "lf_mlpg_finish",
            ((3 * 16 * n).div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(&part)?),
                Arg::I32(groups as i32),
                Arg::I32(n as i32),
                Arg::P(cuda_ptr(grads.grad_a_down)?),
                Arg::I32(rd as i32),
                Arg::P(cuda_ptr(grads.grad_b_gate)?),
                Arg::I32(rg as i32),
                Arg::F32(grads.scale_gate),
                Arg::P(cuda_ptr(grads.grad_b_up)?),
                Arg::I32(ru as i32),
                Arg::F32(grads.scale_up),
            ],
        )?;
        Ok(true)
    }

    /// `(act(gate) * up, (act(gate) * up) Aᵀ)` in one pass where the fused kernel serves the
    /// shapes (all bf16, `I % 32 == 0`, rank up to 16, 16-byte aligned): `None` otherwise.
    /// With `keep_h` false, only xa is written and h is `None`.
    pub fn gated_mul_xa(
        &self,
        act: crate::tensor::GatedAct,
        gate: &Tensor,
        up: &Tensor,
        a: &Tensor,
        keep_h: bool,
    ) -> Result<Option<(Option<Tensor>, Tensor)>> {
        let k = gate_kernels(act);
        let ((t, n), (r, an)) = (gate.rows_cols(), a.rows_cols());
        let serves = bf16_aligned(&[gate, up, a])?
            && gate.shape() == up.shape()
            && gate.shape().len() == 2
            && an == n
            && n.is_multiple_of(32)
            && (1..=16).contains(&r)
            && t > 0;
        if !serves {
            return Ok(None);
        }
        let h = match keep_h {
            true => Some(self.empty(gate.shape(), DType::BF16)?),
            false => None,
        };
        let xa = self.empty(&[t, r], DType::BF16)?;
        let (groups, slices) = (t.div_ceil(16), n.div_ceil(GATED_XA_SLICE));
        // Each block's 16 x 16 f32 sum, and the row groups' counts of finished blocks.
        // (Freed after the launch is queued: the allocator reuses it in stream order.)
        let part = match slices {
            1 => None,
            _ => Some(self.empty(&[slices * groups * 256], DType::F32)?),
        };
        let (part, count) = match &part {
            Some(p) => (cuda_ptr(p)?, self.slice_counts(groups)?),
            None => (0, 0),
        };
        self.launch(
            k.xa,
            (groups as u32, slices as u32, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(gate)?),
                Arg::P(cuda_ptr(up)?),
                Arg::P(cuda_ptr(a)?),
                Arg::P(h.as_ref().map(cuda_ptr).transpose()?.unwrap_or(0)),
                Arg::P(cuda_ptr(&xa)?),
                Arg::I64(t as i64),
                Arg::I32(n as i32),
                Arg::I32(r as i32),
                Arg::I32(GATED_XA_SLICE as i32),
                Arg::P(part),
                Arg::P(count),
            ],
        )?;
        Ok(Some((h, xa)))
    }

    /// `act(gate) * up` with `k`'s kernels.
    fn gated_mul(&self, k: &GateKernels, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.empty(gate.shape(), gate.dtype())?;
        let n = gate.numel();
        if bf16x8(&[gate, up], n) {
            let [a, b, c] = [gate, up, &y].map(|t| cuda_ptr(t).map(Arg::P));
            let args = [a?, b?, c?, Arg::I64(n as i64 / 8)];
            self.launch_n(k.fwd8, n / 8, &args)?;
            return Ok(y);
        }
        self.launch_n(
            k.fwd,
            n,
            &[
                Arg::P(cuda_ptr(gate)?),
                dt(gate.dtype()),
                Arg::P(cuda_ptr(up)?),
                dt(up.dtype()),
                Arg::P(cuda_ptr(&y)?),
                Arg::I64(n as i64),
            ],
        )?;
        Ok(y)
    }

    fn gated_mul_bwd(
        &self,
        k: &GateKernels,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let dg = self.empty(gate.shape(), gate.dtype())?;
        let du = self.empty(up.shape(), up.dtype())?;
        self.launch_gated_mul_bwd(k, dh, gate, up, cuda_ptr(&dg)?, cuda_ptr(&du)?)?;
        Ok((dg, du))
    }

    fn gated_mul_bwd_in_place(
        &self,
        k: &GateKernels,
        dh: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<()> {
        // Each thread reads its elements of gate and up before writing the same elements.
        self.launch_gated_mul_bwd(k, dh, gate, up, cuda_ptr(gate)?, cuda_ptr(up)?)
    }

    /// The gated activation's backward into `dg` / `du` (of `gate`'s / `up`'s dtype and size;
    /// they may be `gate` and `up` themselves).
    fn launch_gated_mul_bwd(
        &self,
        k: &GateKernels,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        dg: u64,
        du: u64,
    ) -> Result<()> {
        let n = gate.numel();
        if bf16x8(&[dh, gate, up], n) {
            let [a, b, c] = [dh, gate, up].map(|t| cuda_ptr(t).map(Arg::P));
            return self.launch_n(
                k.bwd8,
                n / 8,
                &[a?, b?, c?, Arg::P(dg), Arg::P(du), Arg::I64(n as i64 / 8)],
            );
        }
        self.launch_n(
            k.bwd,
            n,
            &[
                Arg::P(cuda_ptr(dh)?),
                dt(dh.dtype()),
                Arg::P(cuda_ptr(gate)?),
                dt(gate.dtype()),
                Arg::P(cuda_ptr(up)?),
                dt(up.dtype()),
                Arg::P(dg),
                Arg::P(du),
                Arg::I64(n as i64),
            ],
        )
    }

    pub fn add_assign(&self, a: &mut Tensor, b: &Tensor, alpha: f32) -> Result<()> {
        self.add_into(cuda_ptr(a)?, a, b, alpha)
    }

    pub fn add(&self, a: &Tensor, b: &Tensor, alpha: f32) -> Result<Tensor> {
        let c = self.empty(a.shape(), a.dtype())?;
        self.add_into(cuda_ptr(&c)?, a, b, alpha)?;
        Ok(c)
    }

    /// `c = a + alpha * b` into `c` (a's dtype and size; may be a itself).
    fn add_into(&self, c: u64, a: &Tensor, b: &Tensor, alpha: f32) -> Result<()> {
        let n = a.numel();
        self.launch_n(
            "lf_add",
            n,
            &[
                Arg::P(cuda_ptr(a)?),
                dt(a.dtype()),
                Arg::P(cuda_ptr(b)?),
                dt(b.dtype()),
                Arg::P(c),
                dt(a.dtype()),
                Arg::F32(alpha),
                Arg::I64(n as i64),
            ],
        )
    }

    pub fn add_bias(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        let n = x.numel();
        self.launch_n(
            "lf_add_bias",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(cuda_ptr(bias)?),
                dt(bias.dtype()),
                Arg::I64(n as i64),
                Arg::I64(bias.numel() as i64),
            ],
        )
    }

    pub fn scale_rows(&self, x: &mut Tensor, s: &Tensor) -> Result<()> {
        let n = x.numel();
        self.launch_n(
            "lf_scale_rows",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(cuda_ptr(s)?),
                Arg::I64(n as i64),
                Arg::I64(x.rows_cols().1.max(1) as i64),
            ],
        )
    }

    /// A tensor of `model::weights::random_normal`'s draws (seed `seed`, spread `std`) made on
    /// the device: a random model's weights without their host generation and upload.
    pub fn random_normal(
        &self,
        shape: &[usize],
        dtype: DType,
        seed: u64,
        std: f32,
    ) -> Result<Tensor> {
        let y = self.empty(shape, dtype)?;
        let n = y.numel();
        self.launch_n(
            "lf_random_normal",
            n,
            &[
                Arg::P(cuda_ptr(&y)?),
                dt(dtype),
                Arg::I64(n as i64),
                Arg::U64(seed),
                Arg::F32(std),
            ],
        )?;
        Ok(y)
    }

    pub fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        let n = x.numel();
        self.launch_n(
            "lf_scale",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::F32(s),
                Arg::I64(n as i64),
            ],
        )
    }

    pub fn slice_cols(&self, x: &Tensor, rows: usize, start: usize, end: usize) -> Result<Tensor> {
        let y = self.empty(&[rows, end - start], x.dtype())?;
        self.copy_cols(x, start, &y, 0, end - start)?;
        Ok(y)
    }

    /// `dst[:, start..start + src.cols] = src` (`ops::write_cols`, which checked the shapes).
    pub fn write_cols(&self, src: &Tensor, dst: &Tensor, start: usize) -> Result<()> {
        self.copy_cols(src, 0, dst, start, src.rows_cols().1)
    }

    /// `dst[:, dst_col0 + j] = src[:, src_col0 + j]` for `j < width` (same dtype and rows).
    fn copy_cols(
        &self,
        src: &Tensor,
        src_col0: usize,
        dst: &Tensor,
        dst_col0: usize,
        width: usize,
    ) -> Result<()> {
        let ((rows, sc), (dr, dc)) = (src.rows_cols(), dst.rows_cols());
        ensure!(
            rows == dr && src.dtype() == dst.dtype(),
            "copy_cols: {:?} {:?} into {:?} {:?}",
            src.shape(),
            src.dtype(),
            dst.shape(),
            dst.dtype()
        );
        ensure!(
            src_col0 + width <= sc && dst_col0 + width <= dc,
            "copy_cols: columns {src_col0}+{width} of {sc} into {dst_col0}+{width} of {dc}"
        );
        // 16 bytes a thread where every offset and both pointers allow it (the dx of a
        // shared-input group copied out of its wider product, `model::layer`).
        let es = src.dtype().size();
        let unit = 16 / es;
        let (sp, dp) = (cuda_ptr(src)?, cuda_ptr(dst)?);
        if [sc, src_col0, dc, dst_col0, width]
            .iter()
            .all(|c| c % unit == 0)
            && sp.is_multiple_of(16)
            && dp.is_multiple_of(16)
        {
            let (w16, n16) = (width / unit, rows * width / unit);
            return self.launch_n(
                "lf_copy_cols_v16",
                n16,
                &[
                    Arg::P(sp),
                    Arg::I64((sc / unit) as i64),
                    Arg::I64((src_col0 / unit) as i64),
                    Arg::P(dp),
                    Arg::I64((dc / unit) as i64),
                    Arg::I64((dst_col0 / unit) as i64),
                    Arg::I64(w16 as i64),
                    Arg::I64(n16 as i64),
                ],
            );
        }
        self.launch_n(
            "lf_copy_cols",
            rows * width,
            &[
                Arg::P(cuda_ptr(src)?),
                Arg::I64(sc as i64),
                Arg::I64(src_col0 as i64),
                Arg::P(cuda_ptr(dst)?),
                Arg::I64(dc as i64),
                Arg::I64(dst_col0 as i64),
                Arg::I64(width as i64),
                Arg::I64((rows * width) as i64),
                dt(src.dtype()),
            ],
        )
    }

    /// Row-stacked copies of `xs` (equal columns and dtype, checked by the caller).
    pub fn concat_rows(&self, xs: &[&Tensor], rows: usize, cols: usize) -> Result<Tensor> {
        let dtype = xs[0].dtype();
        let y = self.empty(&[rows, cols], dtype)?;
        let mut off = 0;
        for x in xs {
            let bytes = x.numel() * dtype.size();
            self.dtod(cuda_ptr(&y)? + off as u64, cuda_ptr(x)?, bytes)?;
            off += bytes;
        }
        Ok(y)
    }

    pub fn slice_rows(&self, x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
        let (_, c) = x.rows_cols();
        let (shape, c) = if x.shape().len() == 1 {
            (vec![end - start], 1)
        } else {
            (vec![end - start, c], c)
        };
        let y = self.empty(&shape, x.dtype())?;
        let es = x.dtype().size();
        self.dtod(
            cuda_ptr(&y)?,
            cuda_ptr(x)? + (start * c * es) as u64,
            (end - start) * c * es,
        )?;
        Ok(y)
    }

    pub fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Result<Tensor> {
        let (_, c) = x.rows_cols();
        let y = self.empty(&[idx.len(), c], x.dtype())?;
        let ib = self.upload_u32(idx)?;
        self.launch_n(
            "lf_gather_rows",
            idx.len() * c,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(ib.ptr),
                Arg::P(cuda_ptr(&y)?),
                Arg::I64(idx.len() as i64),
                Arg::I64(c as i64),
            ],
        )?;
        Ok(y)
    }

    pub fn scatter_add_rows(&self, dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
        let (_, c) = dst.rows_cols();
        ensure!(
            src.numel() == idx.len() * c,
            "scatter_add_rows: src {:?} vs {} rows of {c}",
            src.shape(),
            idx.len()
        );
        let ib = self.upload_u32(idx)?;
        self.launch_n(
            "lf_scatter_add_rows",
            idx.len() * c,
            &[
                Arg::P(cuda_ptr(dst)?),
                dt(dst.dtype()),
                Arg::P(ib.ptr),
                Arg::P(cuda_ptr(src)?),
                dt(src.dtype()),
                Arg::I64(idx.len() as i64),
                Arg::I64(c as i64),
            ],
        )
    }

    pub fn logsoftmax_gather(&self, logits: &Tensor, targets: &[u32]) -> Result<(Tensor, Tensor)> {
        let (rows, v) = logits.rows_cols();
        let logp = self.empty(&[rows], DType::F32)?;
        let lse = self.empty(&[rows], DType::F32)?;
        let tb = self.upload_u32(targets)?;
        self.launch(
            "lf_logsoftmax_gather",
            (rows as u32, 1, 1),
            1024,
            0,
            &[
                Arg::P(cuda_ptr(logits)?),
                dt(logits.dtype()),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(&logp)?),
                Arg::P(cuda_ptr(&lse)?),
                Arg::I64(v as i64),
                Arg::I32(vec4(&[logits], v)? as i32),
            ],
        )?;
        Ok((logp, lse))
    }

    pub fn logsoftmax_gather_bwd(
        &self,
        dlogp: &Tensor,
        logits: &Tensor,
        lse: &Tensor,
        targets: &[u32],
        out_dtype: DType,
    ) -> Result<Tensor> {
        self.logsoftmax_gather_bwd_capped(dlogp, logits, lse, targets, None, out_dtype)
    }

    pub fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        let n = x.numel();
        self.launch_n(
            "lf_softcap",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::F32(cap),
                Arg::I64(n as i64),
            ],
        )
    }

    /// See `tensor::logsoftmax_gather_softcap_bwd_to`.
    pub fn logsoftmax_gather_softcap_bwd(
        &self,
        dlogp: &Tensor,
        logits: &Tensor,
        lse: &Tensor,
        targets: &[u32],
        cap: f32,
        out_dtype: DType,
    ) -> Result<Tensor> {
        self.logsoftmax_gather_bwd_capped(dlogp, logits, lse, targets, Some(cap), out_dtype)
    }

    /// The log-softmax gather's backward, times the softcap's derivative with `cap`.
    fn logsoftmax_gather_bwd_capped(
        &self,
        dlogp: &Tensor,
        logits: &Tensor,
        lse: &Tensor,
        targets: &[u32],
        cap: Option<f32>,
        out_dtype: DType,
    ) -> Result<Tensor> {
        ensure!(
            dlogp.dtype() == DType::F32 && lse.dtype() == DType::F32,
            "logsoftmax_gather_bwd: dlogp and lse must be f32"
        );
        let (rows, v) = logits.rows_cols();
        let d = self.empty(logits.shape(), out_dtype)?;
        let tb = self.upload_u32(targets)?;
        let bx = v.div_ceil(256).min(64) as u32;
        let mut args = vec![
            Arg::P(cuda_ptr(dlogp)?),
            Arg::P(cuda_ptr(logits)?),
            dt(logits.dtype()),
            Arg::P(cuda_ptr(lse)?),
            Arg::P(tb.ptr),
            Arg::P(cuda_ptr(&d)?),
            dt(out_dtype),
        ];
        args.extend(cap.map(Arg::F32));
        args.push(Arg::I64(v as i64));
        if cap.is_none() {
            args.push(Arg::I32(vec4(&[logits, &d], v)? as i32));
        }
        let name = if cap.is_some() {
            "lf_logsoftmax_gather_softcap_bwd"
        } else {
            "lf_logsoftmax_gather_bwd"
        };
        self.launch(name, (rows as u32, bx, 1), 256, 0, &args)?;
        Ok(d)
    }

    pub fn dropout(&self, x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
        let y = self.empty(x.shape(), x.dtype())?;
        let n = x.numel();
        self.launch_n(
            "lf_dropout",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(cuda_ptr(&y)?),
                Arg::I64(n as i64),
                Arg::F32(p),
                Arg::U64(seed),
                Arg::F32(1.0 / (1.0 - p)),
            ],
        )?;
        Ok(y)
    }

    /// Sum of squares (f64 partials per block, added in order; a sync point).
    pub fn sum_sq(&self, x: &Tensor) -> Result<f64> {
        let n = x.numel();
        let blocks = self.grid_blocks(n.div_ceil(256));
        let out = self.alloc(8 * (1 + blocks))?;
        self.memset0(&out)?;
        self.launch_n(
            "lf_sum_sq",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::I64(n as i64),
                Arg::P(out.ptr + 8),
            ],
        )?;
        self.sum_partials_in_order(&out, blocks)?;
        let mut v = [0f64; 1];
        self.inner.bind()?;
        out.dtoh(&mut v)?;
        Ok(v[0])
    }

    pub fn adamw_step(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        h: AdamW,
    ) -> Result<()> {
        ensure!(
            param.dtype() == DType::F32 && m.dtype() == DType::F32 && v.dtype() == DType::F32,
            "adamw: parameters and moments must be f32"
        );
        let n = param.numel();
        ensure!(
            grad.numel() == n && m.numel() == n && v.numel() == n,
            "adamw: sizes differ"
        );
        let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
        let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
        self.launch_n(
            "lf_adamw",
            n,
            &[
                Arg::P(cuda_ptr(param)?),
                Arg::P(cuda_ptr(grad)?),
                dt(grad.dtype()),
                Arg::P(cuda_ptr(m)?),
                Arg::P(cuda_ptr(v)?),
                Arg::I64(n as i64),
                Arg::F32(h.lr),
                Arg::F32(h.beta1),
                Arg::F32(h.beta2),
                Arg::F32(h.eps),
                Arg::F32(h.weight_decay),
                Arg::F32(h.grad_scale),
                Arg::F64(bc1),
                Arg::F64(bc2),
            ],
        )
    }

    // --------------------------------------------------------------------------------------------
    // Multi-tensor ops: one launch over a table of tensors (see the end of elementwise.cu). Each
    // table entry is a fixed number of 8-byte words mirroring a struct there; empty tensors get
    // no entry, so every entry owns at least one chunk.

    /// Uploads `words` (`entries` table entries covering `n_chunks` chunks of `MULTI_CHUNK`
    /// elements) and launches `name` with the table arguments followed by `extra`. The table is
    /// freed in stream order after the kernel; the upload goes through pinned staging (no sync).
    fn launch_multi(
        &self,
        name: &'static str,
        words: &[u64],
        entries: usize,
        n_chunks: u64,
        extra: Vec<Arg>,
    ) -> Result<()> {
        if entries == 0 {
            return Ok(());
        }
        ensure!(
            entries <= i32::MAX as usize,
            "{name}: {entries} tensors in one call"
        );
        let table = self.alloc(words.len() * 8)?;
        self.htod(&table, bytemuck::cast_slice(words))?;
        let blocks = self.grid_blocks(n_chunks as usize) as u32;
        let mut args = vec![
            Arg::P(table.ptr),
            Arg::I32(entries as i32),
            Arg::I64(n_chunks as i64),
            Arg::I32(MULTI_CHUNK as i32),
        ];
        args.extend(extra);
        self.launch(name, (blocks, 1, 1), MULTI_THREADS, 0, &args)
    }

    /// Sum of squares of every tensor: one launch, the result left on the device.
    pub fn sum_sq_multi(&self, xs: &[&Tensor]) -> Result<DeviceValues> {
        // SqSeg: x, n, chunk0, (dt, pad).
        let mut words = Vec::with_capacity(xs.len() * 4);
        let (mut entries, mut chunks) = (0, 0u64);
        for x in xs {
            let n = x.numel();
            if n == 0 {
                continue;
            }
            words.extend([cuda_ptr(x)?, n as u64, chunks, pack(dt_code(x.dtype()), 0)]);
            entries += 1;
            chunks += n.div_ceil(MULTI_CHUNK) as u64;
        }
        // out[0] is the sum; out[1..] the blocks' partials that lf_sum_in_order adds up.
        let blocks = self.grid_blocks(chunks as usize);
        let out = self.alloc(8 * (1 + blocks))?;
        self.memset0(&out)?;
        if entries > 0 {
            self.launch_multi(
                "lf_sum_sq_multi",
                &words,
                entries,
                chunks,
                vec![Arg::P(out.ptr + 8)],
            )?;
            self.sum_partials_in_order(&out, blocks)?;
        }
        Ok(DeviceValues::cuda(out, 1))
    }

    /// `out[0] = Σ out[1..=blocks]` in order, on the device.
    fn sum_partials_in_order(&self, out: &CudaStorage, blocks: usize) -> Result<()> {
        if blocks == 0 {
            return Ok(());
        }
        self.launch(
            "lf_sum_in_order",
            (1, 1, 1),
            32,
            0,
            &[
                Arg::P(out.ptr + 8),
                Arg::I32(blocks as i32),
                Arg::P(out.ptr),
            ],
        )
    }

    /// AdamW on every item, each compute copy refreshed and each gradient zeroed in the same
    /// kernel (shapes and dtypes checked by `tensor::adamw_multi`). No sync.
    pub fn adamw_multi(
        &self,
        items: &mut [AdamWItem],
        h: AdamW,
        clip: Option<NormClip>,
    ) -> Result<()> {
        // AdamwSeg: p, g, m, v, pc, n, chunk0, (lr, gdt), (pcdt, pad).
        let mut words = Vec::with_capacity(items.len() * 9);
        let (mut entries, mut chunks) = (0, 0u64);
        for it in items.iter() {
            let n = it.param.numel();
            if n == 0 {
                continue;
            }
            let (pc, pcdt) = match it.compute.as_deref() {
                Some(c) => (cuda_ptr(c)?, dt_code(c.dtype())),
                None => (0, 0),
            };
            words.extend([
                cuda_ptr(it.param)?,
                cuda_ptr(it.grad)?,
                cuda_ptr(it.m)?,
                cuda_ptr(it.v)?,
                pc,
                n as u64,
                chunks,
                pack(it.lr.to_bits(), dt_code(it.grad.dtype())),
                pack(pcdt, 0),
            ]);
            entries += 1;
            chunks += n.div_ceil(MULTI_CHUNK) as u64;
        }
        // Bias corrections exactly as `adamw_step` computes them.
        let bc1 = 1.0 - (h.beta1 as f64).powi(h.step as i32);
        let bc2 = 1.0 - (h.beta2 as f64).powi(h.step as i32);
        self.launch_multi(
            "lf_adamw_multi",
            &words,
            entries,
            chunks,
            vec![
                Arg::F32(h.beta1),
                Arg::F32(h.beta2),
                Arg::F32(h.eps),
                Arg::F32(h.weight_decay),
                Arg::F32(h.grad_scale),
                Arg::F64(bc1),
                Arg::F64(bc2),
                Arg::P(match clip {
                    Some(c) => c.sum_sq.cuda_ptr()?,
                    None => 0,
                }),
                Arg::F64(clip.map_or(1.0, |c| c.average)),
                Arg::F64(clip.map_or(0.0, |c| c.max_norm)),
            ],
        )
    }

    /// `write_adapter_cols` for every entry, in one launch.
    pub fn write_adapter_cols_multi(&self, items: &[crate::tensor::AdapterCols]) -> Result<()> {
        // AdapterColsSeg: b, dst, ldd, r, at, width, n, chunk0, (scale, dt).
        let mut words = Vec::with_capacity(items.len() * 9);
        let (mut entries, mut chunks) = (0, 0u64);
        for it in items {
            super::gemm::check_adapter_cols(it.w_ext, &it.cols, it.at, it.b)?;
            let ((out, kd), r) = (it.w_ext.rows_cols(), it.b.rows_cols().1);
            let width = it.cols.len();
            let n = out * width;
            if n == 0 {
                continue;
            }
            let es = it.w_ext.dtype().size();
            words.extend([
                cuda_ptr(it.b)?,
                cuda_ptr(it.w_ext)? + (it.cols.start * es) as u64,
                kd as u64,
                r as u64,
                it.at as u64,
                width as u64,
                n as u64,
                chunks,
                pack(it.scale.to_bits(), dt_code(it.w_ext.dtype())),
            ]);
            entries += 1;
            chunks += n.div_ceil(MULTI_CHUNK) as u64;
        }
        self.launch_multi(
            "lf_write_adapter_cols_multi",
            &words,
            entries,
            chunks,
            vec![],
        )
    }

    /// Every source converted into its (existing) destination: one launch, no allocation.
    pub fn cast_multi(&self, pairs: &mut [(&Tensor, &mut Tensor)]) -> Result<()> {
        // CastSeg: x, y, n, chunk0, (xdt, ydt).
        let mut words = Vec::with_capacity(pairs.len() * 5);
        let (mut entries, mut chunks) = (0, 0u64);
        for (src, dst) in pairs.iter() {
            let n = src.numel();
            if n == 0 {
                continue;
            }
            words.extend([
                cuda_ptr(src)?,
                cuda_ptr(dst)?,
                n as u64,
                chunks,
                pack(dt_code(src.dtype()), dt_code(dst.dtype())),
            ]);
            entries += 1;
            chunks += n.div_ceil(MULTI_CHUNK) as u64;
        }
        self.launch_multi("lf_cast_multi", &words, entries, chunks, vec![])
    }
}

/// Whether rows of `v` elements of every tensor in `ts` can be read and written 4 at a time
/// (`ld4`/`st4`: 16 bytes for f32, 8 for bf16): `v % 4 == 0` and each start aligned to it.
fn vec4(ts: &[&Tensor], v: usize) -> Result<bool> {
    let mut ok = v.is_multiple_of(4);
    for t in ts {
        ok &= cuda_ptr(t)?.is_multiple_of(4 * t.dtype().size() as u64);
    }
    Ok(ok)
}
