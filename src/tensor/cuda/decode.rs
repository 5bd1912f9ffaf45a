//! Host side of `kernels/decode.cu`: attention of a few query rows over their ranges of a KV
//! cache, and the row writes that fill the cache (incremental decoding, `infer::decode`).
use super::*;

impl CudaBackend {
    pub fn decode_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        ranges: &[[u32; 2]],
        s: AttnShape,
    ) -> Result<Tensor> {
        ensure!(
            q.dtype() == k.dtype() && k.dtype() == v.dtype(),
            "decode_attention: q, k and v must share a dtype ({:?}, {:?}, {:?})",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
        // The kernel keeps 8 dims per lane up to head_dim 256, 16 up to 512.
        ensure!(
            s.head_dim > 0 && s.head_dim <= 512,
            "decode_attention: head_dim {} (supported: up to 512)",
            s.head_dim
        );
        let kernel = if s.head_dim <= 256 {
            "lf_dec_attention"
        } else {
            "lf_dec_attention_512"
        };
        ensure!(
            s.softcap.is_none_or(|c| c.is_finite() && c > 0.0),
            "decode_attention: softcap {:?} must be positive",
            s.softcap
        );
        let n = q.dim(0);
        let o = self.empty(&[n, s.n_heads * s.head_dim], q.dtype())?;
        if n == 0 {
            return Ok(o);
        }
        let flat: Vec<u32> = ranges.iter().flatten().copied().collect();
        let rb = self.upload_u32(&flat)?;
        self.launch(
            kernel,
            (n as u32, s.n_heads as u32, 1),
            128,
            0,
            &[
                Arg::P(cuda_ptr(q)?),
                Arg::P(cuda_ptr(k)?),
                Arg::P(cuda_ptr(v)?),
                dt(q.dtype()),
                Arg::P(rb.ptr),
                Arg::P(cuda_ptr(&o)?),
                dt(o.dtype()),
                Arg::I32(s.n_heads as i32),
                Arg::I32(s.n_kv_heads as i32),
                Arg::I32(s.head_dim as i32),
                Arg::F32(s.scale),
                Arg::F32(s.softcap.unwrap_or(0.0)),
            ],
        )?;
        Ok(o)
    }

    pub fn copy_rows_into(&self, dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
        let (_, c) = dst.rows_cols();
        if idx.is_empty() || c == 0 {
            return Ok(());
        }
        let ib = self.upload_u32(idx)?;
        self.launch_n(
            "lf_dec_copy_rows",
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
}
