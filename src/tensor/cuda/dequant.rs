//! Host side of `kernels/dequant.cu`: ggml quantized blocks to a bf16 matrix.
use super::*;

impl CudaBackend {
    /// Dequantises `rows x cols` elements stored in `kind`'s layout to a bf16 `[rows, cols]`.
    pub fn dequantize(
        &self,
        q: &DeviceBytes,
        kind: QuantKind,
        rows: usize,
        cols: usize,
    ) -> Result<Tensor> {
        let n = rows * cols;
        let (be, bb) = kind.block();
        ensure!(
            n.is_multiple_of(be),
            "dequantize: {n} elements are not whole {kind:?} blocks of {be}"
        );
        ensure!(
            q.len >= n / be * bb,
            "dequantize: {kind:?} [{rows}, {cols}] needs {} bytes, got {}",
            n / be * bb,
            q.len
        );
        let y = self.empty(&[rows, cols], DType::BF16)?;
        self.launch_n(
            kind.kernel(),
            n,
            &[Arg::P(q.buf.ptr), Arg::P(cuda_ptr(&y)?), Arg::I64(n as i64)],
        )?;
        Ok(y)
    }
}
