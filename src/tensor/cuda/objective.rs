//! Host side of `kernels/objective.cu`: the preference objectives evaluated on the device from
//! per-part logp sums.
use super::*;

impl CudaBackend {
    /// One preference objective on the device (`lf_obj_pair`, the CUDA form of the `*_sums`
    /// functions of `train::objectives`): reduces the three parts of `logp` (`(start, len)` of the
    /// chosen prompt, chosen response and rejected response), evaluates objective `kind` with
    /// `params`, and writes `d loss / d logp · weight` for every token of a part (0 elsewhere).
    /// `stats` layout: part sums [0..3], first bad token index or -1 [3], its value [4], the
    /// per-part coefficients [5..8], 1 if the loss was clipped [8]. `reference`: DPO's reference
    /// stats (its sums at [1], [2]). `clip`: `loss_clip`, a loss above it has zero gradient
    /// (`SumsOut::clip`); `None`: no clip. `weight`: the step's weight times the example's.
    /// No sync.
    #[allow(clippy::too_many_arguments)]
    pub fn pair_objective(
        &self,
        logp: &Tensor,
        parts: [(usize, usize); 3],
        kind: i32,
        params: [f64; 2],
        reference: Option<&DeviceValues>,
        clip: Option<f64>,
        weight: f32,
    ) -> Result<(DeviceValues, Tensor)> {
        ensure!(
            logp.dtype() == DType::F32,
            "pair_objective: logps must be f32"
        );
        let n = logp.numel();
        for (s, l) in parts {
            ensure!(s + l <= n, "pair_objective: part {s}+{l} past {n} logps");
        }
        ensure!(n < i32::MAX as usize, "pair_objective: {n} logps");
        let stats = self.alloc(8 * OBJ_STATS)?;
        let dlogp = self.zeros(&[n], DType::F32)?;
        let ref_ptr = match reference {
            Some(r) => r.cuda_ptr()?,
            None => 0,
        };
        let mut args = Vec::with_capacity(15);
        args.push(Arg::P(cuda_ptr(logp)?));
        for (s, l) in parts {
            args.extend([Arg::I32(s as i32), Arg::I32(l as i32)]);
        }
        args.extend([
            Arg::I32(kind),
            Arg::F64(params[0]),
            Arg::F64(params[1]),
            Arg::P(ref_ptr),
            Arg::F64(clip.unwrap_or(-1.0)),
            Arg::F32(weight),
            Arg::P(stats.ptr),
            Arg::P(cuda_ptr(&dlogp)?),
        ]);
        self.launch("lf_obj_pair", (1, 1, 1), 1024, 0, &args)?;
        Ok((DeviceValues::cuda(stats, OBJ_STATS), dlogp))
    }
}
