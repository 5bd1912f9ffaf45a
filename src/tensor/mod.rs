//! The tensor layer: a contiguous, row-major buffer with a shape and a dtype on one device, and the
//! ops the model needs, each a plain function with a forward and (where training needs it) a
//! backward that receives what the forward saved.
//!
//! Every op here dispatches on the device of its first operand: `cpu` holds the f32 reference
//! implementation every CUDA kernel is tested against, `cuda` the GPU backend (bf16 storage, fp32
//! accumulation). Transposes are GEMM flags, not views; reshapes are free because tensors are
//! always contiguous.

pub mod cce;
pub mod rng;
pub use rng::Rng;
pub mod cpu;
pub mod cuda;
pub mod offload;
pub use offload::{Offloaded, Prefetched};
pub mod parity;

use anyhow::{bail, ensure, Context, Result};
use std::sync::Arc;

/// Element type of a tensor's storage. CPU tensors are always `F32`; CUDA tensors hold
/// activations and frozen weights in `BF16` and LoRA masters, optimiser state and statistics in
/// `F32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
}

/// Where a tensor lives.
#[derive(Clone)]
pub enum Device {
    Cpu,
    Cuda(Arc<cuda::CudaBackend>),
}

impl Device {
    /// The run's numerics choices (`TrainConfig`, recorded in plan.toml): on CUDA, the
    /// bit-reproducible two-kernel attention backward instead of the one-pass one, and whether
    /// GEMM algorithms are chosen by timing. The CPU computes each op one way.
    pub fn set_numerics(&self, deterministic_attention: bool, gemm_tuning: bool) -> Result<()> {
        if let Device::Cuda(c) = self {
            c.set_attention_backward_version(if deterministic_attention { 2 } else { 0 });
            c.set_gemm_tuning(gemm_tuning)?;
        }
        Ok(())
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Opens CUDA device `ordinal`; a clear error where no driver or GPU exists.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Ok(Device::Cuda(cuda::CudaBackend::new(ordinal)?))
    }

    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Device> {
        match Device::ordinal(s)? {
            None => Ok(Device::Cpu),
            Some(n) => Device::cuda(n),
        }
    }

    /// Checks that [`Device::parse`] would find the device `s` names, without opening it.
    pub fn check(s: &str) -> Result<()> {
        match Device::ordinal(s)? {
            None => Ok(()),
            Some(n) => cuda::probe(n),
        }
    }

    /// The GPU a device name names (None: the CPU).
    fn ordinal(s: &str) -> Result<Option<usize>> {
        match s {
            "cpu" => Ok(None),
            "cuda" | "gpu" => Ok(Some(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Some(n)),
                _ => bail!("unknown device {s:?}: expected cpu, cuda or cuda:N"),
            },
        }
    }

    /// The dtype activations and frozen weights use on this device.
    pub fn compute_dtype(&self) -> DType {
        match self {
            Device::Cpu => DType::F32,
            Device::Cuda(_) => DType::BF16,
        }
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(c) => c.name(),
        }
    }

    /// Live and peak bytes of device memory held by tensors (CUDA allocator counters); zero on
    /// the CPU.
    pub fn memory(&self) -> MemoryStats {
        match self {
            Device::Cpu => MemoryStats::default(),
            Device::Cuda(c) => c.memory(),
        }
    }

    /// With `LORAFIT_MEMTRACE=1`, prints the live and peak bytes at `label` to stderr (host
    /// counters: no sync), to find where a step's peak falls; on the CPU, this thread's tensor
    /// counts (`cpu_memory`).
    pub fn memtrace(&self, label: impl FnOnce() -> String) {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !*ON.get_or_init(|| std::env::var_os("LORAFIT_MEMTRACE").is_some_and(|v| v != "0")) {
            return;
        }
        // GiB on a GPU; MiB on the CPU, whose tests trace models of a few MiB.
        let (m, unit, shift) = match self {
            Device::Cpu => (cpu_memory(), "MiB", 20),
            Device::Cuda(c) => (c.memory(), "GiB", 30),
        };
        let at = |b: usize| b as f64 / (1u64 << shift) as f64;
        eprintln!(
            "memtrace {:<28} live {:7.3} {unit}  peak {:7.3} {unit}",
            label(),
            at(m.live_bytes),
            at(m.peak_bytes)
        );
    }

    pub fn reset_peak(&self) {
        if let Device::Cuda(c) = self {
            c.reset_peak()
        }
    }

    /// `memory_limit` in GiB as a cap on the live device bytes (`CudaBackend::set_memory_cap`;
    /// None lifts it). Nothing on the CPU, whose limit only plans.
    pub fn set_memory_limit(&self, gib: Option<f64>) {
        if let Device::Cuda(c) = self {
            c.set_memory_cap(gib.map(|g| (g * (1u64 << 30) as f64) as usize))
        }
    }

    /// Waits for queued device work (a host sync point; only at step or benchmark boundaries).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(c) => c.synchronize(),
        }
    }
}

/// A few f64 values that live on a device (an objective's sums, a gradient's squared norm):
/// written and read by kernels without a host round trip, downloaded only when the host needs them.
pub struct DeviceValues {
    len: usize,
    storage: ValuesStorage,
}

enum ValuesStorage {
    Cpu(Vec<f64>),
    Cuda(cuda::CudaStorage),
}

impl DeviceValues {
    pub fn cpu(values: Vec<f64>) -> DeviceValues {
        DeviceValues {
            len: values.len(),
            storage: ValuesStorage::Cpu(values),
        }
    }

    pub(crate) fn cuda(storage: cuda::CudaStorage, len: usize) -> DeviceValues {
        DeviceValues {
            len,
            storage: ValuesStorage::Cuda(storage),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values on the host (a sync point on CUDA).
    pub fn to_host(&self) -> Result<Vec<f64>> {
        match &self.storage {
            ValuesStorage::Cpu(v) => Ok(v.clone()),
            ValuesStorage::Cuda(s) => s.download_f64(self.len),
        }
    }

    /// The host values of a CPU instance (errors on a device instance).
    pub fn as_cpu(&self) -> Result<&[f64]> {
        match &self.storage {
            ValuesStorage::Cpu(v) => Ok(v),
            ValuesStorage::Cuda(_) => bail!("device values are on CUDA, not the CPU"),
        }
    }

    pub(crate) fn cuda_ptr(&self) -> Result<u64> {
        match &self.storage {
            ValuesStorage::Cuda(s) => Ok(s.device_ptr()),
            ValuesStorage::Cpu(_) => bail!("device values are on the CPU, not CUDA"),
        }
    }
}

/// Whether `e` is the device running out of memory (an allocation the driver or cuBLAS refused),
/// as opposed to any other failure: the trainer retries such a step on a smaller plan.
pub fn is_out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let text = format!("{c:?}");
        text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
    })
}

#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryStats {
    pub live_bytes: usize,
    pub peak_bytes: usize,
}

pub enum Storage {
    Cpu(Vec<f32>),
    Cuda(cuda::CudaStorage),
}

/// An identity of `t`'s elements while `t` lives: their address on the device or in host
/// memory (for telling buffers apart, not for reading them).
pub fn address(t: &Tensor) -> u64 {
    match t.storage() {
        Storage::Cuda(s) => s.ptr,
        Storage::Cpu(v) => v.as_ptr() as u64,
    }
}

/// Bytes of CPU tensors live on this thread, and their peak: the CPU's counterpart of the CUDA
/// allocator's counters, read by the tests that hold the memory planner's estimates against
/// what a CPU step holds (`cpu_memory`). Per thread, so that tests running side by side do not
/// count each other's tensors; `Device::memory` stays zero on the CPU (its planning budget is a
/// fixed figure, not these counts).
mod cpu_count {
    use std::cell::Cell;
    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    pub(super) fn add(bytes: usize) {
        let live = LIVE.get() + bytes as isize;
        LIVE.set(live);
        PEAK.set(PEAK.get().max(live));
    }

    pub(super) fn sub(bytes: usize) {
        LIVE.set(LIVE.get() - bytes as isize);
    }

    pub(super) fn stats() -> (isize, isize) {
        (LIVE.get(), PEAK.get())
    }

    pub(super) fn reset_peak() {
        PEAK.set(LIVE.get());
    }
}

/// Live and peak bytes of the CPU tensors of this thread (`cpu_count`; a tensor dropped on
/// another thread than its own is counted off there, so a count can be off by what crosses).
pub fn cpu_memory() -> MemoryStats {
    let (live, peak) = cpu_count::stats();
    MemoryStats {
        live_bytes: live.max(0) as usize,
        peak_bytes: peak.max(0) as usize,
    }
}

/// Starts this thread's CPU peak again from its live bytes.
pub fn reset_cpu_peak() {
    cpu_count::reset_peak()
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Storage::Cpu(v) = &self.storage {
            cpu_count::sub(v.len() * 4);
        }
    }
}

/// A contiguous row-major tensor.
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    storage: Storage,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {:?}, {})",
            self.shape,
            self.dtype,
            self.device.name()
        )
    }
}

impl Tensor {
    pub fn from_parts(shape: Vec<usize>, dtype: DType, device: Device, storage: Storage) -> Tensor {
        if let Storage::Cpu(v) = &storage {
            cpu_count::add(v.len() * 4);
        }
        Tensor {
            shape,
            dtype,
            device,
            storage,
        }
    }

    /// A CPU f32 tensor owning `data`.
    pub fn cpu(data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        ensure!(
            data.len() == n,
            "tensor data has {} elements but shape {shape:?} needs {n}",
            data.len()
        );
        cpu_count::add(data.len() * 4);
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype: DType::F32,
            device: Device::Cpu,
            storage: Storage::Cpu(data),
        })
    }

    /// Places host f32 data on `device` in `dtype` (CPU tensors are always f32).
    pub fn from_f32(
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        ensure!(
            data.len() == n,
            "tensor data has {} elements but shape {shape:?} needs {n}",
            data.len()
        );
        match device {
            Device::Cpu => Tensor::cpu(data.to_vec(), shape),
            Device::Cuda(c) => c.upload(data, shape, dtype),
        }
    }

    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Tensor::cpu(vec![0.0; shape.iter().product()], shape),
            Device::Cuda(c) => c.zeros(shape, dtype),
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size of dimension `i` (negative counts from the end).
    pub fn dim(&self, i: isize) -> usize {
        let i = if i < 0 {
            self.shape.len() as isize + i
        } else {
            i
        };
        self.shape[i as usize]
    }
    /// Rows and columns when viewed as a matrix whose columns are the last dimension.
    pub fn rows_cols(&self) -> (usize, usize) {
        let c = *self.shape.last().unwrap_or(&1);
        (self.numel().checked_div(c).unwrap_or(0), c)
    }

    /// Same data, new shape (free: tensors are contiguous).
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        ensure!(
            n == self.numel(),
            "cannot reshape {:?} to {shape:?}",
            self.shape
        );
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The CPU f32 data (errors on a device tensor: use `to_vec` to copy it back).
    pub fn as_cpu(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(v) => Ok(v),
            Storage::Cuda(_) => bail!("tensor lives on {}, not the CPU", self.device.name()),
        }
    }
    pub fn as_cpu_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Cpu(v) => Ok(v),
            Storage::Cuda(_) => bail!("tensor is not on the CPU"),
        }
    }

    /// Copies the values to the host as f32 (a sync point on CUDA).
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::Cpu(v) => Ok(v.clone()),
            Storage::Cuda(s) => s.download_f32(self.numel(), self.dtype),
        }
    }

    pub fn try_clone(&self) -> Result<Tensor> {
        match &self.device {
            Device::Cpu => Tensor::cpu(self.as_cpu()?.to_vec(), &self.shape),
            Device::Cuda(c) => c.copy(self),
        }
    }

    /// Converts to `dtype` on the same device (a copy).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        match &self.device {
            Device::Cpu => self.try_clone(),
            Device::Cuda(c) => c.cast(self, dtype),
        }
    }
}

fn same_device(a: &Tensor, b: &Tensor, op: &str) -> Result<()> {
    ensure!(
        std::mem::discriminant(&a.device) == std::mem::discriminant(&b.device),
        "{op}: operands on different devices ({} and {})",
        a.device.name(),
        b.device.name()
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Attention masks

/// Which keys each query may see: the union of two half-open key-index ranges per query, further
/// cut by an optional sliding window over *logical* positions (key k is visible to query q only if
/// `pos[q] - pos[k] < window`). Plain causal attention is `[0, q+1) ∪ ∅`; the prefix-shared layout
/// [prompt P; chosen C; rejected R] gives a rejected query `[0, P) ∪ [P+C, q+1)`.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnMask {
    /// Per query: `[start0, end0, start1, end1]`.
    pub ranges: Vec<[u32; 4]>,
    /// Logical position of every token (also the RoPE positions).
    pub positions: Vec<i32>,
    pub window: Option<u32>,
}

impl AttnMask {
    pub fn causal(t: usize) -> AttnMask {
        AttnMask {
            ranges: (0..t as u32).map(|q| [0, q + 1, 0, 0]).collect(),
            positions: (0..t as i32).collect(),
            window: None,
        }
    }

    /// The prefix-shared layout `[prompt; chosen; rejected]`: both responses start at logical
    /// position `p`, and rejected tokens never see chosen ones.
    pub fn prefix_shared(p: usize, c: usize, r: usize) -> AttnMask {
        let (p32, c32) = (p as u32, c as u32);
        let mut ranges = Vec::with_capacity(p + c + r);
        let mut positions = Vec::with_capacity(p + c + r);
        for q in 0..(p + c) as u32 {
            ranges.push([0, q + 1, 0, 0]);
            positions.push(q as i32);
        }
        for k in 0..r as u32 {
            let q = p32 + c32 + k;
            ranges.push([0, p32, p32 + c32, q + 1]);
            positions.push((p32 + k) as i32);
        }
        AttnMask {
            ranges,
            positions,
            window: None,
        }
    }

    pub fn with_window(mut self, window: Option<u32>) -> AttnMask {
        self.window = window;
        self
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// How many keys query `q` sees (positions are consecutive within each range, as every
    /// layout built here has them).
    pub fn visible_count(&self, q: usize) -> usize {
        let [a0, a1, b0, b1] = self.ranges[q];
        let count = |s: u32, e: u32| -> usize {
            if e <= s {
                return 0;
            }
            match self.window {
                None => (e - s) as usize,
                Some(w) => {
                    // Keys k with pos[q] - pos[k] < w, i.e. pos[k] >= pos[q] - w + 1.
                    let first = self.positions[q] as i64 - w as i64 + 1;
                    let skip = (first - self.positions[s as usize] as i64).clamp(0, (e - s) as i64);
                    (e - s) as usize - skip as usize
                }
            }
        };
        count(a0, a1) + count(b0, b1)
    }

    /// Whether query `q` may attend to key `k`.
    #[inline]
    pub fn visible(&self, q: usize, k: usize) -> bool {
        let [a0, a1, b0, b1] = self.ranges[q];
        let k32 = k as u32;
        let in_range = (k32 >= a0 && k32 < a1) || (k32 >= b0 && k32 < b1);
        in_range
            && match self.window {
                Some(w) => (self.positions[q] - self.positions[k]) < w as i32,
                None => true,
            }
    }
}

/// Attention geometry shared by the forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attention logit softcap `c`: scores `s = scale·q·k` become `c·tanh(s/c)` before the mask
    /// and softmax (Gemma 2). `None`: no cap.
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// The score of a scaled logit `s = scale·q·k` and its derivative: `(c·tanh(s/c),
    /// 1 − tanh²(s/c))` with a softcap `c`, else `(s, 1)`.
    #[inline]
    pub fn cap(&self, s: f32) -> (f32, f32) {
        match self.softcap {
            Some(c) => {
                let th = (s / c).tanh();
                (c * th, 1.0 - th * th)
            }
            None => (s, 1.0),
        }
    }
}

/// RoPE cos/sin tables for one sequence of positions: `[T, head_dim/2]` each, f32, built once per
/// step and shared by every layer.
pub struct RopeTable {
    pub cos: Tensor,
    pub sin: Tensor,
    pub head_dim: usize,
}

impl RopeTable {
    pub fn new(positions: &[i32], inv_freq: &[f32], device: &Device) -> Result<RopeTable> {
        RopeTable::scaled(positions, inv_freq, 1.0, device)
    }

    /// `new` with cos and sin multiplied by `factor` (LongRoPE's attention factor; the inverse
    /// rotation then carries the same factor, which is the transposed Jacobian).
    pub fn scaled(
        positions: &[i32],
        inv_freq: &[f32],
        factor: f32,
        device: &Device,
    ) -> Result<RopeTable> {
        let half = inv_freq.len();
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        for (t, &p) in positions.iter().enumerate() {
            for (i, &f) in inv_freq.iter().enumerate() {
                // Angles in f64 so long positions keep their precision before the f32 cos/sin.
                let a = p as f64 * f as f64;
                cos[t * half + i] = a.cos() as f32 * factor;
                sin[t * half + i] = a.sin() as f32 * factor;
            }
        }
        let shape = [positions.len(), half];
        Ok(RopeTable {
            cos: Tensor::from_f32(&cos, &shape, DType::F32, device)?,
            sin: Tensor::from_f32(&sin, &shape, DType::F32, device)?,
            head_dim: 2 * half,
        })
    }
}

// ------------------------------------------------------------------------------------------------
// Ops. Each dispatches to the CPU reference or the CUDA backend.

macro_rules! dispatch {
    ($dev:expr, $cpu:expr, $c:ident => $cuda:expr) => {
        match $dev {
            Device::Cpu => $cpu,
            Device::Cuda($c) => $cuda,
        }
    };
}

/// `(m, k, n)` of `op(a) @ op(b)` into `c`, checked once here for both backends.
pub(crate) fn matmul_dims(
    c: &Tensor,
    a: &Tensor,
    ta: bool,
    b: &Tensor,
    tb: bool,
) -> Result<(usize, usize, usize)> {
    let (ar, ac) = a.rows_cols();
    let (br, bc) = b.rows_cols();
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    let t = |x: bool| if x { "ᵀ" } else { "" };
    ensure!(
        k == k2,
        "matmul: inner dims differ: {:?}{} x {:?}{}",
        a.shape(),
        t(ta),
        b.shape(),
        t(tb)
    );
    ensure!(
        c.numel() == m * n,
        "matmul: output {:?} is not [{m}, {n}]",
        c.shape()
    );
    Ok((m, k, n))
}

/// `alpha * op(a) @ op(b)` where `op` transposes when the flag is set; a is `[M,K]` (or `[K,M]`),
/// b is `[K,N]` (or `[N,K]`). Leading dims of `a` fold into M. Output dtype is `out_dtype`.
pub fn matmul(
    a: &Tensor,
    ta: bool,
    b: &Tensor,
    tb: bool,
    alpha: f32,
    out_dtype: DType,
) -> Result<Tensor> {
    same_device(a, b, "matmul")?;
    dispatch!(a.device(), cpu::matmul(a, ta, b, tb, alpha), c => c.matmul(a, ta, b, tb, alpha, out_dtype))
}

/// `c = beta * c + alpha * op(a) @ op(b)`, accumulating into an existing tensor.
pub fn matmul_acc(
    c: &mut Tensor,
    a: &Tensor,
    ta: bool,
    b: &Tensor,
    tb: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    same_device(a, b, "matmul_acc")?;
    let dev = a.device().clone();
    dispatch!(&dev, cpu::matmul_acc(c, a, ta, b, tb, alpha, beta), cu => cu.matmul_acc(c, a, ta, b, tb, alpha, beta))
}

/// Columns `[start, end)` of a row-major matrix: an operand of `matmul_acc_cols` (and of
/// `lora_linear_rounded`'s adapter input), read in place on a GPU, whose products take a leading
/// dimension. The LoRA inputs of projections that share their input are one product's columns
/// (`model::layer::stacked_lora_inputs`); read through a window, none of them is copied out.
#[derive(Clone, Copy)]
pub struct Cols<'a> {
    pub t: &'a Tensor,
    pub start: usize,
    pub end: usize,
}

impl<'a> Cols<'a> {
    /// Every column of `t`.
    pub fn all(t: &'a Tensor) -> Cols<'a> {
        Cols {
            t,
            start: 0,
            end: t.rows_cols().1,
        }
    }
    pub fn rows_cols(&self) -> (usize, usize) {
        (self.t.rows_cols().0, self.end - self.start)
    }
    fn is_all(&self) -> bool {
        self.start == 0 && self.end == self.t.rows_cols().1
    }
    /// The window as a tensor of its own: `t` itself when it spans every column, else a copy.
    pub fn to_tensor(&self) -> Result<TensorRef<'a>> {
        Ok(if self.is_all() {
            TensorRef::Borrowed(self.t)
        } else {
            TensorRef::Owned(slice_cols(self.t, self.start, self.end)?)
        })
    }
}

/// A tensor borrowed as it is, or made for the occasion: a window's copy (`Cols::to_tensor`),
/// a dequantized weight (`Weight::dense`), a conversion.
pub enum TensorRef<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl std::ops::Deref for TensorRef<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            TensorRef::Borrowed(t) => t,
            TensorRef::Owned(t) => t,
        }
    }
}

/// `c[:, cc] = beta · c[:, cc] + alpha · op(a) @ op(b)` over column windows: `matmul_acc` with
/// each operand and the output a block of columns of a wider matrix. On a GPU every window is
/// read and written in place where cuBLASLt can address it (both operands bf16 or all f32, rows
/// aligned to 16 bytes); elsewhere (the CPU, odd widths) through copies, with the same result.
#[allow(clippy::too_many_arguments)]
pub fn matmul_acc_cols(
    c: &mut Tensor,
    cc: std::ops::Range<usize>,
    a: Cols,
    ta: bool,
    b: Cols,
    tb: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let ccols = c.rows_cols().1;
    for (w, name, cols) in [
        (a.start..a.end, "a", a.t.rows_cols().1),
        (b.start..b.end, "b", b.t.rows_cols().1),
        (cc.clone(), "c", ccols),
    ] {
        ensure!(
            w.start <= w.end && w.end <= cols,
            "matmul_acc_cols: {name}'s columns {w:?} of {cols}"
        );
    }
    same_device(a.t, b.t, "matmul_acc_cols")?;
    same_device(a.t, c, "matmul_acc_cols")?;
    if let Device::Cuda(cu) = c.device().clone() {
        if cu.matmul_acc_cols(c, cc.clone(), a, ta, b, tb, alpha, beta)? {
            return Ok(());
        }
    }
    let (a, b) = (a.to_tensor()?, b.to_tensor()?);
    if cc.start == 0 && cc.end == ccols {
        return matmul_acc(c, &a, ta, &b, tb, alpha, beta);
    }
    let mut part = slice_cols(c, cc.start, cc.end)?;
    matmul_acc(&mut part, &a, ta, &b, tb, alpha, beta)?;
    write_cols(c, cc.start, &part)
}

/// `beta · c + alpha · op(a) @ op(b)` as a new tensor in `c`'s dtype, `c` a column window: the
/// sum a copy of the window followed by `matmul_acc_cols` gives, the same numbers. On a GPU,
/// where cuBLASLt can address the windows, one product reads the window as its C and writes
/// the new tensor as its D, and the copy is never made.
#[allow(clippy::too_many_arguments)]
pub fn matmul_onto(
    c: Cols,
    a: Cols,
    ta: bool,
    b: Cols,
    tb: bool,
    alpha: f32,
    beta: f32,
) -> Result<Tensor> {
    let ccols = c.t.rows_cols().1;
    ensure!(
        c.start <= c.end && c.end <= ccols,
        "matmul_onto: c's columns {}..{} of {ccols}",
        c.start,
        c.end
    );
    same_device(a.t, c.t, "matmul_onto")?;
    if let Device::Cuda(cu) = c.t.device().clone() {
        if let Some(d) = cu.matmul_onto(c, a, ta, b, tb, alpha, beta)? {
            return Ok(d);
        }
    }
    let mut d = slice_cols(c.t, c.start, c.end)?;
    let n = d.rows_cols().1;
    matmul_acc_cols(&mut d, 0..n, a, ta, b, tb, alpha, beta)?;
    Ok(d)
}

/// `dst[:, start..start + src.cols] = src` (same rows and dtype).
pub fn write_cols(dst: &mut Tensor, start: usize, src: &Tensor) -> Result<()> {
    let ((r, w), (dr, dc)) = (src.rows_cols(), dst.rows_cols());
    ensure!(
        r == dr && start + w <= dc && src.dtype() == dst.dtype(),
        "write_cols: {:?} {:?} at column {start} of {:?} {:?}",
        src.shape(),
        src.dtype(),
        dst.shape(),
        dst.dtype()
    );
    same_device(src, dst, "write_cols")?;
    match dst.device().clone() {
        Device::Cpu => {
            let s = src.as_cpu()?.to_vec();
            let d = dst.as_cpu_mut()?;
            for (i, row) in s.chunks(w.max(1)).take(r).enumerate() {
                d[i * dc + start..i * dc + start + w].copy_from_slice(row);
            }
            Ok(())
        }
        Device::Cuda(cu) => cu.write_cols(src, dst, start),
    }
}

/// A tensor whose every element the caller overwrites before reading (zeros on the CPU; left
/// unwritten on a GPU, which saves a launch).
pub fn scratch(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    match device {
        Device::Cpu => Tensor::zeros(shape, dtype, device),
        Device::Cuda(c) => c.scratch(shape, dtype),
    }
}

/// The least bytes a folded projection into f32 may give its operands' copies
/// (`lora_linear_rounded`).
const FOLD_F32_FLOOR_BYTES: usize = 32 << 20;

/// A LoRA projection's output `x Wᵀ + scale · xa Bᵀ`, both products summed in f32 and the sum
/// rounded once to `out_dtype` (`model::layer::linear_fwd` says why), `block` rows at a time: the
/// f32 sum of at most `block` rows exists at once. x `[T,K]`, w `[N,K]`, xa `[T,r]` (a window of
/// a wider product, read in place on a GPU), b `[N,r]`.
/// On a GPU, where `may_fold` (false where `w` is itself a temporary, a dequantized base, which
/// would then be held twice) and the copies pay (`cuda::gemm::adapter_fold_pays`), the adapter
/// joins the base product's K dimension instead and no f32 sum is held (`lora_linear_folded`).
/// On the CPU, which is f32 throughout, neither changes anything.
#[allow(clippy::too_many_arguments)]
pub fn lora_linear_rounded(
    x: &Tensor,
    w: Cols,
    xa: Cols,
    b: &Tensor,
    scale: f32,
    out_dtype: DType,
    block: usize,
    may_fold: bool,
) -> Result<Tensor> {
    let ((t, k), (n, r)) = (x.rows_cols(), b.rows_cols());
    ensure!(
        w.rows_cols() == (n, k) && xa.rows_cols() == (t, r),
        "lora_linear_rounded: x {:?}, w {:?}, xa {:?}, b {:?}",
        x.shape(),
        [w.rows_cols().0, w.rows_cols().1],
        [xa.rows_cols().0, xa.rows_cols().1],
        b.shape()
    );
    for o in [w.t, xa.t, b] {
        same_device(x, o, "lora_linear_rounded")?;
    }
    // The rank-r product writes y first and the base GEMM accumulates onto it: the base GEMM
    // reads y in its epilogue almost for free, where the skinny product would read and write the
    // whole (T, N) output a second time.
    let generic = || -> Result<Tensor> {
        let mut y = matmul(&*xa.to_tensor()?, false, b, true, scale, DType::F32)?;
        matmul_acc_cols(&mut y, 0..n, Cols::all(x), false, w, true, 1.0, 1.0)?;
        if y.dtype() == out_dtype {
            return Ok(y);
        }
        y.to_dtype(out_dtype)
    };
    // (An empty product, which cuBLASLt refuses, takes the generic path.)
    let nonempty = t * k * n * r > 0;
    let all_bf16 = [x, w.t, xa.t, b].iter().all(|o| o.dtype() == DType::BF16);
    match x.device() {
        Device::Cuda(c)
            if nonempty && may_fold && all_bf16 && cuda::gemm::adapter_fold_pays(t, k, n, r) =>
        {
            let budget = fold_budget(block, t, n, out_dtype);
            c.lora_linear_folded(x, w, xa, b, scale, out_dtype, budget)
        }
        Device::Cuda(c) if nonempty && x.dtype() == w.t.dtype() && out_dtype != DType::F32 => {
            c.lora_linear_rounded(x, w, xa, b, scale, out_dtype, block)
        }
        _ => generic(),
    }
}

/// `residual + rs · (x Wᵀ + scale · xa Bᵀ)` in the residual's dtype: a LoRA projection whose
/// output joins a residual stream (the MLP's down projection, giving the layer's output). It is
/// `lora_linear_rounded` into that dtype followed by `add`, and on the CPU, and wherever a GPU
/// would fold the adapter or round the sum, that is what runs. On a GPU with an f32 residual and
/// bf16 operands, the rank-r product reads the residual as its C and writes the new output, and
/// the base product accumulates onto it: the same terms summed in f32, with no pass over the
/// residual and the projection's output (the f32 sums differ in order, not in what they add).
#[allow(clippy::too_many_arguments)]
pub fn lora_linear_onto(
    residual: &Tensor,
    rs: f32,
    x: &Tensor,
    w: Cols,
    xa: Cols,
    b: &Tensor,
    scale: f32,
    block: usize,
) -> Result<Tensor> {
    let ((t, k), (n, r)) = (x.rows_cols(), b.rows_cols());
    ensure!(
        residual.rows_cols() == (t, n),
        "lora_linear_onto: residual {:?} for a [{t}x{n}] output",
        residual.shape()
    );
    same_device(x, residual, "lora_linear_onto")?;
    let all_bf16 = [x, w.t, xa.t, b].iter().all(|o| o.dtype() == DType::BF16);
    let fused = matches!(x.device(), Device::Cuda(_))
        && residual.dtype() == DType::F32
        && all_bf16
        && t * k * n * r > 0
        && !cuda::gemm::adapter_fold_pays(t, k, n, r);
    if !fused {
        let y = lora_linear_rounded(x, w, xa, b, scale, residual.dtype(), block, true)?;
        return add(residual, &y, rs);
    }
    let mut y = matmul_onto(
        Cols::all(residual),
        xa,
        false,
        Cols::all(b),
        true,
        scale * rs,
        1.0,
    )?;
    matmul_acc_cols(&mut y, 0..n, Cols::all(x), false, w, true, rs, 1.0)?;
    Ok(y)
}

/// The bytes a folded product's operand copies may take (`lora_linear_rounded`,
/// `lora_linear_extended`): at most those of the f32 sum they replace; for an f32 output, which
/// holds no f32 sum beside itself, a quarter of them, or FOLD_F32_FLOOR_BYTES where that is more:
/// qwen1.5b's o at 4608 rows then runs as one product instead of three row blocks (1.2 ms a step
/// at 4.20 GiB on an H100, no change in the peak).
fn fold_budget(block: usize, t: usize, n: usize, out_dtype: DType) -> usize {
    let sum_bytes = block.min(t) * n * 4;
    if out_dtype == DType::F32 {
        (sum_bytes / 4).max(FOLD_F32_FLOOR_BYTES)
    } else {
        sum_bytes
    }
}

/// `w` `[N, K]` stored with `cols` more columns, zero: `[W | 0]`, `[N, K + cols]`, the storage
/// of a frozen weight whose adapter folds into its product without a copy of W
/// (`lora_linear_extended`; `write_adapter_cols` fills the new columns).
pub fn extend_cols(w: &Tensor, cols: usize) -> Result<Tensor> {
    let (n, k) = w.rows_cols();
    let mut ext = Tensor::zeros(&[n, k + cols], w.dtype(), w.device())?;
    write_cols(&mut ext, 0, w)?;
    Ok(ext)
}

/// Columns `cols` of every row of `w_ext` = `[0 | scale · b | 0]`, b's first column at
/// `cols.start + at`, rounded to w_ext's dtype: a weight stored by `extend_cols` takes an
/// adapter's current B where the adapter's xa sits in the input it is multiplied with
/// (`pack_input`). It writes through a shared reference, as a device's kernels do, so only a
/// GPU tensor can take it (the CPU keeps W and B apart).
pub fn write_adapter_cols(
    w_ext: &Tensor,
    cols: std::ops::Range<usize>,
    at: usize,
    b: &Tensor,
    scale: f32,
) -> Result<()> {
    same_device(w_ext, b, "write_adapter_cols")?;
    match w_ext.device() {
        Device::Cuda(c) => c.write_adapter_cols(w_ext, cols, at, b, scale),
        Device::Cpu => bail!("write_adapter_cols: a CPU tensor cannot be written in place here"),
    }
}

/// One `write_adapter_cols` of `write_adapter_cols_multi`.
pub struct AdapterCols<'a> {
    pub w_ext: &'a Tensor,
    pub cols: std::ops::Range<usize>,
    pub at: usize,
    pub b: &'a Tensor,
    pub scale: f32,
}

/// `write_adapter_cols` for every item, in one launch on a GPU (a model's adapters after an
/// optimiser step: `model::Model::hold_adapters`).
pub fn write_adapter_cols_multi(items: &[AdapterCols]) -> Result<()> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    for (i, it) in items.iter().enumerate() {
        same_device(first.w_ext, it.w_ext, "write_adapter_cols_multi")
            .and_then(|_| same_device(first.w_ext, it.b, "write_adapter_cols_multi"))
            .with_context(|| format!("item {i}"))?;
    }
    match first.w_ext.device() {
        Device::Cuda(c) => c.write_adapter_cols_multi(items),
        Device::Cpu => {
            bail!("write_adapter_cols_multi: a CPU tensor cannot be written in place here")
        }
    }
}

/// `[x | xa | 0]`, `[T, kd]` (kd at least x's and xa's widths together), with 1 in column
/// `one_at` (past them) where a product should add a bias held in the weight's column there:
/// the K-extended input that the projections of a shared-input group, each stored as
/// `[W | adapter columns | bias]`, read with no further copy (`model::layer`).
pub fn pack_input(x: &Tensor, xa: Cols, kd: usize, one_at: Option<usize>) -> Result<Tensor> {
    let ((t, k), (ta, r)) = (x.rows_cols(), xa.rows_cols());
    ensure!(
        ta == t && k + r <= kd && one_at.is_none_or(|c| c >= k + r && c < kd),
        "pack_input: x {:?}, xa {ta}x{r}, into {kd} columns, 1 at {one_at:?}",
        x.shape()
    );
    same_device(x, xa.t, "pack_input")?;
    match x.device() {
        Device::Cuda(c) if x.dtype() == DType::BF16 && xa.t.dtype() == DType::BF16 => {
            c.pack_input(x, xa, kd, one_at)
        }
        _ => {
            let mut out = Tensor::zeros(&[t, kd], x.dtype(), x.device())?;
            write_cols(&mut out, 0, x)?;
            write_cols(&mut out, k, &*xa.to_tensor()?)?;
            if let Some(c) = one_at {
                let ones = Tensor::from_f32(&vec![1.0; t], &[t, 1], x.dtype(), x.device())?;
                write_cols(&mut out, c, &ones)?;
            }
            Ok(out)
        }
    }
}

/// `lora_linear_rounded` for a weight stored as `[W | scale · B | 0]` (`extend_cols`, then
/// `write_adapter_cols`): x `[T,K]`, w_ext `[N, K + cols]` with xa's `r <= cols`. The adapter's
/// product joins the base product's K dimension with no copy of W, only of x's rows and xa
/// (`CudaBackend::lora_linear_extended`), and the f32 sum is rounded once into `out_dtype`.
/// The CPU sums both products in f32 from the weight's column windows (the same numbers as
/// `lora_linear_rounded` with B scaled and rounded into the weight).
pub fn lora_linear_extended(
    x: &Tensor,
    w_ext: &Tensor,
    xa: Cols,
    out_dtype: DType,
    block: usize,
) -> Result<Tensor> {
    let ((t, k), (n, kd), r) = (x.rows_cols(), w_ext.rows_cols(), xa.rows_cols().1);
    ensure!(
        xa.rows_cols().0 == t && k + r <= kd,
        "lora_linear_extended: x {:?}, w_ext {:?}, xa {r} columns",
        x.shape(),
        w_ext.shape()
    );
    same_device(x, w_ext, "lora_linear_extended")?;
    same_device(x, xa.t, "lora_linear_extended")?;
    let all_bf16 = [x, w_ext, xa.t].iter().all(|o| o.dtype() == DType::BF16);
    match x.device() {
        Device::Cuda(c) if all_bf16 && t * n > 0 => {
            let budget = fold_budget(block, t, n, out_dtype);
            c.lora_linear_extended(x, xa, w_ext, out_dtype, budget)
        }
        _ => {
            let window = |cols: std::ops::Range<usize>| Cols {
                t: w_ext,
                start: cols.start,
                end: cols.end,
            };
            let mut y = Tensor::zeros(&[t, n], DType::F32, x.device())?;
            matmul_acc_cols(&mut y, 0..n, xa, false, window(k..k + r), true, 1.0, 0.0)?;
            matmul_acc_cols(
                &mut y,
                0..n,
                Cols::all(x),
                false,
                window(0..k),
                true,
                1.0,
                1.0,
            )?;
            if out_dtype == DType::F32 {
                return Ok(y);
            }
            y.to_dtype(out_dtype)
        }
    }
}

/// Rows of `table` `[V,H]` picked by `ids` -> `[T,H]`: a row gather with the ids checked
/// against the vocabulary.
pub fn embedding(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let v = table.dim(0);
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
        bail!("token id {bad} is outside the vocabulary of {v}");
    }
    gather_rows(table, ids)
}

/// Gradient of `embedding` with respect to the table: the rows of `dy` scatter-added into an f32
/// `[V,H]`.
pub fn embedding_bwd(dy: &Tensor, ids: &[u32], vocab: usize) -> Result<Tensor> {
    let mut g = Tensor::zeros(&[vocab, dy.dim(-1)], DType::F32, dy.device())?;
    scatter_add_rows(&mut g, ids, dy)?;
    Ok(g)
}

/// RMSNorm over the last dim: `y = x * rstd * w`, `rstd = 1/sqrt(mean(x²) + eps)`.
/// Returns `(y, rstd)` with rstd f32 `[rows]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    ensure!(
        x.dim(-1) == w.numel(),
        "rms_norm: x {:?} vs weight {:?}",
        x.shape(),
        w.shape()
    );
    dispatch!(x.device(), cpu::rms_norm(x, w, eps), c => c.rms_norm(x, w, eps))
}

/// RMSNorm whose output is stored in `out_dtype` (an f32 residual stream feeding bf16
/// projections on CUDA; the CPU is f32 throughout).
pub fn rms_norm_to(x: &Tensor, w: &Tensor, eps: f32, out_dtype: DType) -> Result<(Tensor, Tensor)> {
    ensure!(
        x.dim(-1) == w.numel(),
        "rms_norm: x {:?} vs weight {:?}",
        x.shape(),
        w.shape()
    );
    dispatch!(x.device(), cpu::rms_norm(x, w, eps), c => c.rms_norm_to(x, w, eps, out_dtype))
}

/// dx of RMSNorm (the weight is frozen).
pub fn rms_norm_bwd(dy: &Tensor, x: &Tensor, w: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    dispatch!(x.device(), cpu::rms_norm_bwd(dy, x, w, rstd), c => Ok(c.rms_norm_bwd_add(dy, x, w, rstd, None, None)?.0))
}

/// The residual add and the RMSNorm that reads it, in one pass: returns `(x + r, RMSNorm(x + r)
/// in out_dtype, rstd)`, the sum stored in `x`'s dtype. The same arithmetic as `add_assign`
/// followed by `rms_norm_to`.
pub fn add_rms_norm_to(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
    out_dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    ensure!(
        x.shape() == r.shape() && x.dim(-1) == w.numel(),
        "add_rms_norm: x {:?}, r {:?}, weight {:?}",
        x.shape(),
        r.shape(),
        w.shape()
    );
    dispatch!(
        x.device(),
        {
            let mut sum = x.try_clone()?;
            cpu::add_assign(&mut sum, r, 1.0)?;
            let (y, rstd) = cpu::rms_norm(&sum, w, eps)?;
            Ok((sum, y, rstd))
        },
        c => c.add_rms_norm_to(x, r, w, eps, out_dtype)
    )
}

/// `rms_norm_bwd(dy, x, w, rstd) + add` in one pass: where the residual branch's gradient joins
/// the normalised branch's.
pub fn rms_norm_bwd_add(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    add: &Tensor,
) -> Result<Tensor> {
    Ok(rms_norm_bwd_add_copy(dy, x, w, rstd, add, x.dtype())?.0)
}

/// `rms_norm_bwd_add`, plus dx in `copy` when that differs from x's dtype (None otherwise):
/// the f32 residual gradient and its compute-dtype copy from one pass.
pub fn rms_norm_bwd_add_copy(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    add: &Tensor,
    copy: DType,
) -> Result<(Tensor, Option<Tensor>)> {
    ensure!(
        add.shape() == x.shape(),
        "rms_norm_bwd_add: x {:?} vs add {:?}",
        x.shape(),
        add.shape()
    );
    let copy = (copy != x.dtype()).then_some(copy);
    dispatch!(
        x.device(),
        {
            let mut dx = cpu::rms_norm_bwd(dy, x, w, rstd)?;
            cpu::add_assign(&mut dx, add, 1.0)?;
            let c = copy.map(|c| dx.to_dtype(c)).transpose()?;
            Ok((dx, c))
        },
        c => c.rms_norm_bwd_add(dy, x, w, rstd, Some(add), copy)
    )
}

/// Rotary embedding (Hugging Face's rotate-half layout) of `x` `[T, n_heads*head_dim]`.
/// `inverse` applies the transposed rotation, which is the backward.
pub fn rope(x: &Tensor, table: &RopeTable, n_heads: usize, inverse: bool) -> Result<Tensor> {
    ensure!(
        x.dim(-1) == n_heads * table.head_dim,
        "rope: x {:?} vs {n_heads} heads of {}",
        x.shape(),
        table.head_dim
    );
    ensure!(
        x.dim(0) == table.cos.dim(0),
        "rope: {} tokens vs a table of {}",
        x.dim(0),
        table.cos.dim(0)
    );
    dispatch!(x.device(), cpu::rope(x, table, n_heads, inverse), c => c.rope(x, table, n_heads, inverse))
}

/// Scaled dot-product attention with GQA and a per-query visibility mask. q `[T, nh*hd]`,
/// k and v `[T, nkv*hd]`. Returns `(o [T, nh*hd], lse [nh, T] f32)`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    s: AttnShape,
) -> Result<(Tensor, Tensor)> {
    ensure!(
        q.dim(0) == mask.len() && k.dim(0) == mask.len(),
        "attention: mask covers {} tokens, q has {}",
        mask.len(),
        q.dim(0)
    );
    ensure!(
        s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: {} heads not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    dispatch!(q.device(), cpu::attention(q, k, v, mask, s), c => c.attention(q, k, v, mask, s))
}

/// Backward of `attention`: `(dq, dk, dv)` from `do`, recomputing probabilities from `lse`.
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
    dispatch!(q.device(), cpu::attention_bwd(d_o, q, k, v, o, lse, mask, s), c => c.attention_bwd(d_o, q, k, v, o, lse, mask, s))
}

/// A gated MLP activation `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedAct {
    /// `silu_mul`.
    Silu,
    /// `gelu_tanh_mul`.
    GeluTanh,
}

/// `act(gate) * up`.
pub fn gated_mul(act: GatedAct, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    match act {
        GatedAct::Silu => silu_mul(gate, up),
        GatedAct::GeluTanh => gelu_tanh_mul(gate, up),
    }
}

/// `h = act(gate) * up` with `h Aᵀ` (`a` `[r, I]`), the LoRA input of the projection that reads
/// `h`, in `h`'s dtype: one pass over the `(T, I)` tensors on a GPU where the fused kernel
/// serves the shapes (the product from the bf16 `h` as stored, in f32), else `gated_mul` and
/// `matmul`.
pub fn gated_mul_xa(
    act: GatedAct,
    gate: &Tensor,
    up: &Tensor,
    a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if let Device::Cuda(c) = gate.device() {
        same_device(gate, a, "gated_mul_xa")?;
        if let Some((Some(h), xa)) = c.gated_mul_xa(act, gate, up, a, true)? {
            return Ok((h, xa));
        }
    }
    let h = gated_mul(act, gate, up)?;
    let xa = matmul(&h, false, a, true, 1.0, h.dtype())?;
    Ok((h, xa))
}

/// `gated_mul_xa`'s `h Aᵀ` alone: on a GPU where the fused kernel serves the shapes, `h` is
/// never written (a recomputed layer whose backward takes `h` from gate and up,
/// `gated_mul_bwd_lora_grads`).
pub fn gated_mul_xa_only(act: GatedAct, gate: &Tensor, up: &Tensor, a: &Tensor) -> Result<Tensor> {
    if let Device::Cuda(c) = gate.device() {
        same_device(gate, a, "gated_mul_xa_only")?;
        if let Some((_, xa)) = c.gated_mul_xa(act, gate, up, a, false)? {
            return Ok(xa);
        }
    }
    Ok(gated_mul_xa(act, gate, up, a)?.1)
}

/// The backward of `act(gate) * up` from `d(h) = d_base + dxa A` (the gradient through a frozen
/// projection and its adapter's term, `dxa` `[T, r]`, `a` `[r, I]`), written over `gate` and
/// `up`. On a GPU where the fused kernel serves the shapes, `d(h)` is summed in f32 inside it and
/// never stored; elsewhere the term is added into `d_base` first.
pub fn gated_mul_bwd_lora_in_place(
    act: GatedAct,
    d_base: &mut Tensor,
    dxa: &Tensor,
    a: &Tensor,
    gate: &mut Tensor,
    up: &mut Tensor,
) -> Result<()> {
    if let Device::Cuda(c) = gate.device().clone() {
        same_device(gate, a, "gated_mul_bwd_lora_in_place")?;
        if c.gated_mul_bwd_lora_in_place(act, d_base, dxa, a, gate, up)? {
            return Ok(());
        }
    }
    matmul_acc(d_base, dxa, false, a, false, 1.0, 1.0)?;
    gated_mul_bwd_in_place(act, d_base, gate, up)
}

/// The LoRA gradients that read a gated MLP's `(T, I)` tensors, for
/// `gated_mul_bwd_lora_grads`: the gate and up projections' `dB += s · dyᵀ xa` (their `xa`
/// where their forward left it) and the down projection's `dA += dxaᵀ h`.
pub struct GatedLoraGrads<'a> {
    pub xa_gate: Cols<'a>,
    pub scale_gate: f32,
    pub grad_b_gate: &'a mut Tensor,
    pub xa_up: Cols<'a>,
    pub scale_up: f32,
    pub grad_b_up: &'a mut Tensor,
    pub grad_a_down: &'a mut Tensor,
}

/// `gated_mul_bwd_lora_in_place` with `grads` accumulated: `dA_down += dxaᵀ h`, `h` the
/// activation as the forward rounded it, and the gate and up adapters' `dB` from the gradients
/// written over `gate` and `up`. On a GPU where the fused kernel serves the shapes, the sums are
/// taken from the values in registers inside the one pass over the `(T, I)` tensors (so `h` need
/// not be kept); elsewhere `h` is made again and the products run apart.
pub fn gated_mul_bwd_lora_grads(
    act: GatedAct,
    d_base: &mut Tensor,
    dxa: &Tensor,
    a: &Tensor,
    gate: &mut Tensor,
    up: &mut Tensor,
    mut grads: GatedLoraGrads,
) -> Result<()> {
    if let Device::Cuda(c) = gate.device().clone() {
        same_device(gate, a, "gated_mul_bwd_lora_grads")?;
        if c.gated_mul_bwd_lora_grads(act, d_base, dxa, a, gate, up, &mut grads)? {
            return Ok(());
        }
    }
    let h = gated_mul(act, gate, up)?;
    matmul_acc(grads.grad_a_down, dxa, true, &h, false, 1.0, 1.0)?;
    drop(h);
    gated_mul_bwd_lora_in_place(act, d_base, dxa, a, gate, up)?;
    for (dy, xa, scale, grad_b) in [
        (&*gate, grads.xa_gate, grads.scale_gate, grads.grad_b_gate),
        (&*up, grads.xa_up, grads.scale_up, grads.grad_b_up),
    ] {
        let n = grad_b.rows_cols().1;
        matmul_acc_cols(grad_b, 0..n, Cols::all(dy), true, xa, false, scale, 1.0)?;
    }
    Ok(())
}

/// The backward of `act(gate) * up` from `dh`, written over `gate` and `up`.
pub fn gated_mul_bwd_in_place(
    act: GatedAct,
    dh: &Tensor,
    gate: &mut Tensor,
    up: &mut Tensor,
) -> Result<()> {
    match act {
        GatedAct::Silu => silu_mul_bwd_in_place(dh, gate, up),
        GatedAct::GeluTanh => gelu_tanh_mul_bwd_in_place(dh, gate, up),
    }
}

/// The gated MLP activation: `silu(gate) * up`.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    ensure!(
        gate.shape() == up.shape(),
        "silu_mul: {:?} vs {:?}",
        gate.shape(),
        up.shape()
    );
    dispatch!(gate.device(), cpu::silu_mul(gate, up), c => c.silu_mul(gate, up))
}

/// Backward of `silu_mul`: `(dgate, dup)`.
pub fn silu_mul_bwd(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    dispatch!(gate.device(), cpu::silu_mul_bwd(dh, gate, up), c => c.silu_mul_bwd(dh, gate, up))
}

/// `silu_mul_bwd` writing `dgate` over `gate` and `dup` over `up` (the layer backward's last use
/// of them: two `(T, I)` buffers fewer at its peak).
pub fn silu_mul_bwd_in_place(dh: &Tensor, gate: &mut Tensor, up: &mut Tensor) -> Result<()> {
    ensure!(
        gate.shape() == up.shape() && dh.shape() == gate.shape(),
        "silu_mul_bwd: shapes {:?}, {:?}, {:?} differ",
        dh.shape(),
        gate.shape(),
        up.shape()
    );
    let dev = gate.device().clone();
    dispatch!(&dev, cpu::silu_mul_bwd_in_place(dh, gate, up), c => c.silu_mul_bwd_in_place(dh, gate, up))
}

/// The gated MLP activation of Gemma: `gelu_tanh(gate) * up`, with transformers'
/// `gelu_pytorch_tanh`: `gelu_tanh(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    ensure!(
        gate.shape() == up.shape(),
        "gelu_tanh_mul: {:?} vs {:?}",
        gate.shape(),
        up.shape()
    );
    dispatch!(gate.device(), cpu::gelu_tanh_mul(gate, up), c => c.gelu_tanh_mul(gate, up))
}

/// Backward of `gelu_tanh_mul`: `(dgate, dup)`.
pub fn gelu_tanh_mul_bwd(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    ensure!(
        gate.shape() == up.shape() && dh.shape() == gate.shape(),
        "gelu_tanh_mul_bwd: shapes {:?}, {:?}, {:?} differ",
        dh.shape(),
        gate.shape(),
        up.shape()
    );
    dispatch!(gate.device(), cpu::gelu_tanh_mul_bwd(dh, gate, up), c => c.gelu_tanh_mul_bwd(dh, gate, up))
}

/// `gelu_tanh_mul_bwd` writing `dgate` over `gate` and `dup` over `up`.
pub fn gelu_tanh_mul_bwd_in_place(dh: &Tensor, gate: &mut Tensor, up: &mut Tensor) -> Result<()> {
    ensure!(
        gate.shape() == up.shape() && dh.shape() == gate.shape(),
        "gelu_tanh_mul_bwd: shapes {:?}, {:?}, {:?} differ",
        dh.shape(),
        gate.shape(),
        up.shape()
    );
    let dev = gate.device().clone();
    dispatch!(&dev, cpu::gelu_tanh_mul_bwd_in_place(dh, gate, up), c => c.gelu_tanh_mul_bwd_in_place(dh, gate, up))
}

/// Softcap in place: `x ← cap·tanh(x/cap)` (Gemma 2's final logits; `cap > 0`). Its derivative
/// in terms of the output `y` is `1 − (y/cap)²`.
pub fn softcap(x: &mut Tensor, cap: f32) -> Result<()> {
    ensure!(cap > 0.0, "softcap: cap {cap} must be positive");
    let dev = x.device().clone();
    dispatch!(&dev, cpu::softcap(x, cap), c => c.softcap(x, cap))
}

/// `a += alpha * b` (residual adds and gradient accumulation; b may be f32 or a's dtype).
/// `a + alpha * b` as a new tensor of a's dtype (one pass, where a copy then `add_assign` is
/// two).
pub fn add(a: &Tensor, b: &Tensor, alpha: f32) -> Result<Tensor> {
    ensure!(
        a.numel() == b.numel(),
        "add: {:?} vs {:?}",
        a.shape(),
        b.shape()
    );
    same_device(a, b, "add")?;
    dispatch!(
        a.device(),
        {
            let mut c = a.try_clone()?;
            cpu::add_assign(&mut c, b, alpha)?;
            Ok(c)
        },
        c => c.add(a, b, alpha)
    )
}

pub fn add_assign(a: &mut Tensor, b: &Tensor, alpha: f32) -> Result<()> {
    ensure!(
        a.numel() == b.numel(),
        "add: {:?} vs {:?}",
        a.shape(),
        b.shape()
    );
    let dev = a.device().clone();
    dispatch!(&dev, cpu::add_assign(a, b, alpha), c => c.add_assign(a, b, alpha))
}

/// `x[t, :] += bias` for every row (Qwen2's q/k/v bias).
pub fn add_bias(x: &mut Tensor, bias: &Tensor) -> Result<()> {
    ensure!(
        x.dim(-1) == bias.numel(),
        "add_bias: {:?} vs {:?}",
        x.shape(),
        bias.shape()
    );
    let dev = x.device().clone();
    dispatch!(&dev, cpu::add_bias(x, bias), c => c.add_bias(x, bias))
}

/// `x[t, :] *= s[t]` for every row, in place (`s` f32, one entry per row).
pub fn scale_rows(x: &mut Tensor, s: &Tensor) -> Result<()> {
    ensure!(
        s.dtype() == DType::F32 && s.numel() == x.rows_cols().0,
        "scale_rows: {:?} rows vs {:?} {:?} scales",
        x.shape(),
        s.shape(),
        s.dtype()
    );
    let dev = x.device().clone();
    dispatch!(&dev, cpu::scale_rows(x, s), c => c.scale_rows(x, s))
}

/// `x * scale` in place.
pub fn scale(x: &mut Tensor, s: f32) -> Result<()> {
    let dev = x.device().clone();
    dispatch!(&dev, cpu::scale(x, s), c => c.scale(x, s))
}

/// Columns `[start, end)` of a matrix `[rows, cols]` (a copy).
pub fn slice_cols(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (r, c) = x.rows_cols();
    ensure!(
        start <= end && end <= c,
        "slice_cols {start}..{end} of {c} columns"
    );
    dispatch!(x.device(), cpu::slice_cols(x, start, end), cu => cu.slice_cols(x, r, start, end))
}

/// The first of `xs` after checking that all share its device, dtype and `kept` extent (the
/// dimension a concatenation does not grow).
fn check_concat<'a>(xs: &[&'a Tensor], op: &str, kept: fn(&Tensor) -> usize) -> Result<&'a Tensor> {
    let first = *xs.first().with_context(|| format!("{op} of nothing"))?;
    for (i, x) in xs.iter().enumerate() {
        ensure!(
            kept(x) == kept(first) && x.dtype() == first.dtype(),
            "{op}: item {i} is {:?} {:?}, item 0 {:?} {:?}",
            x.shape(),
            x.dtype(),
            first.shape(),
            first.dtype()
        );
        same_device(first, x, op).with_context(|| format!("item {i}"))?;
    }
    Ok(first)
}

/// Matrices with equal column counts and dtypes stacked: `[Σ rows, cols]`.
pub fn concat_rows(xs: &[&Tensor]) -> Result<Tensor> {
    let first = check_concat(xs, "concat_rows", |x| x.rows_cols().1)?;
    let cols = first.rows_cols().1;
    let rows: usize = xs.iter().map(|x| x.rows_cols().0).sum();
    dispatch!(first.device(), cpu::concat_rows(xs, rows, cols), cu => cu.concat_rows(xs, rows, cols))
}

/// Rows `[start, end)` of a tensor viewed as a matrix (a copy).
pub fn slice_rows(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (r, _) = x.rows_cols();
    ensure!(
        start <= end && end <= r,
        "slice_rows {start}..{end} of {r} rows"
    );
    dispatch!(x.device(), cpu::slice_rows(x, start, end), c => c.slice_rows(x, start, end))
}

/// `out[i] = x[idx[i]]` over rows.
pub fn gather_rows(x: &Tensor, idx: &[u32]) -> Result<Tensor> {
    let (r, _) = x.rows_cols();
    ensure!(
        idx.iter().all(|&i| (i as usize) < r),
        "gather_rows: index out of {r} rows"
    );
    dispatch!(x.device(), cpu::gather_rows(x, idx), c => c.gather_rows(x, idx))
}

/// `dst[idx[i]] += src[i]` over rows (the backward of `gather_rows`; indices may repeat).
pub fn scatter_add_rows(dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
    let (r, _) = dst.rows_cols();
    ensure!(
        idx.iter().all(|&i| (i as usize) < r),
        "scatter_add_rows: index out of {r} rows"
    );
    let dev = dst.device().clone();
    dispatch!(&dev, cpu::scatter_add_rows(dst, idx, src), c => c.scatter_add_rows(dst, idx, src))
}

/// `dst[idx[i]] = src[i]` over rows: new keys and values written into a KV cache. The indices
/// must be distinct (a repeated one would leave which write wins unspecified on the device).
pub fn copy_rows_into(dst: &mut Tensor, idx: &[u32], src: &Tensor) -> Result<()> {
    let (r, c) = dst.rows_cols();
    ensure!(
        idx.iter().all(|&i| (i as usize) < r),
        "copy_rows_into: index out of {r} rows"
    );
    ensure!(
        src.numel() == idx.len() * c,
        "copy_rows_into: src {:?} is not {} rows of {c}",
        src.shape(),
        idx.len()
    );
    same_device(dst, src, "copy_rows_into")?;
    let dev = dst.device().clone();
    dispatch!(&dev, cpu::copy_rows_into(dst, idx, src), cu => cu.copy_rows_into(dst, idx, src))
}

/// Attention of each query row over its own contiguous range of key rows (incremental decoding
/// over a KV cache): query `i` sees the keys `[ranges[i][0], ranges[i][1])` of `k` and `v`, so a
/// sliding window or a sequence's slot in a batched cache is just a narrower range. q
/// `[n, nh*hd]`, k and v `[m, nkv*hd]`; returns o `[n, nh*hd]` in q's dtype (zero for an empty
/// range). Per (query, head) the CPU computes exactly what `attention` computes for the same
/// visible keys, in the same order.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &[[u32; 2]],
    s: AttnShape,
) -> Result<Tensor> {
    ensure!(
        ranges.len() == q.dim(0),
        "decode_attention: {} key ranges for {} query rows",
        ranges.len(),
        q.dim(0)
    );
    ensure!(
        s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads),
        "decode_attention: {} heads not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    ensure!(
        q.dim(-1) == s.n_heads * s.head_dim && k.dim(-1) == s.n_kv_heads * s.head_dim,
        "decode_attention: q {:?} / k {:?} do not match {s:?}",
        q.shape(),
        k.shape()
    );
    ensure!(
        k.shape() == v.shape(),
        "decode_attention: k {:?} and v {:?} differ",
        k.shape(),
        v.shape()
    );
    let m = k.rows_cols().0 as u32;
    if let Some(r) = ranges.iter().find(|r| r[0] > r[1] || r[1] > m) {
        bail!("decode_attention: key range {r:?} is not within the {m} key rows");
    }
    same_device(q, k, "decode_attention")?;
    same_device(q, v, "decode_attention")?;
    dispatch!(q.device(), cpu::decode_attention(q, k, v, ranges, s), c => c.decode_attention(q, k, v, ranges, s))
}

/// Row-wise log-softmax gathered at `targets`: returns `(logp [T], lse [T])`, both f32. Rows whose
/// target is `u32::MAX` give logp 0 (ignored positions).
pub fn logsoftmax_gather(logits: &Tensor, targets: &[u32]) -> Result<(Tensor, Tensor)> {
    ensure!(
        logits.rows_cols().0 == targets.len(),
        "logsoftmax_gather: {} rows vs {} targets",
        logits.rows_cols().0,
        targets.len()
    );
    dispatch!(logits.device(), cpu::logsoftmax_gather(logits, targets), c => c.logsoftmax_gather(logits, targets))
}

/// Backward of `logsoftmax_gather`: `dlogits = dlogp * (onehot(target) - softmax)`.
pub fn logsoftmax_gather_bwd(
    dlogp: &Tensor,
    logits: &Tensor,
    lse: &Tensor,
    targets: &[u32],
) -> Result<Tensor> {
    logsoftmax_gather_bwd_to(dlogp, logits, lse, targets, logits.dtype())
}

/// `logsoftmax_gather_bwd` with `dlogits` stored in `out_dtype` (the compute dtype of the head
/// GEMM that consumes it, without an extra conversion pass over `[rows, vocab]`).
pub fn logsoftmax_gather_bwd_to(
    dlogp: &Tensor,
    logits: &Tensor,
    lse: &Tensor,
    targets: &[u32],
    out_dtype: DType,
) -> Result<Tensor> {
    dispatch!(
        logits.device(),
        {
            let d = cpu::logsoftmax_gather_bwd(dlogp, logits, lse, targets)?;
            if d.dtype() == out_dtype {
                Ok(d)
            } else {
                d.to_dtype(out_dtype)
            }
        },
        c => c.logsoftmax_gather_bwd(dlogp, logits, lse, targets, out_dtype)
    )
}

/// The backward of `softcap` then `logsoftmax_gather`, in one pass: `logits` are the capped
/// logits `y = cap·tanh(z/cap)` (as `softcap` left them, with `lse` from `logsoftmax_gather` of
/// them) and `dz = dlogp · (onehot(target) − softmax(y)) · (1 − (y/cap)²)`, stored in
/// `out_dtype`. `softcap: None` is `logsoftmax_gather_bwd_to`.
pub fn logsoftmax_gather_softcap_bwd_to(
    dlogp: &Tensor,
    logits: &Tensor,
    lse: &Tensor,
    targets: &[u32],
    softcap: Option<f32>,
    out_dtype: DType,
) -> Result<Tensor> {
    let Some(cap) = softcap else {
        return logsoftmax_gather_bwd_to(dlogp, logits, lse, targets, out_dtype);
    };
    ensure!(cap > 0.0, "softcap: cap {cap} must be positive");
    ensure!(
        logits.rows_cols().0 == targets.len() && dlogp.numel() == targets.len(),
        "logsoftmax_gather_softcap_bwd: {} rows, {} targets, {} gradients",
        logits.rows_cols().0,
        targets.len(),
        dlogp.numel()
    );
    dispatch!(
        logits.device(),
        {
            let d = cpu::logsoftmax_gather_softcap_bwd(dlogp, logits, lse, targets, cap)?;
            if d.dtype() == out_dtype {
                Ok(d)
            } else {
                d.to_dtype(out_dtype)
            }
        },
        c => c.logsoftmax_gather_softcap_bwd(dlogp, logits, lse, targets, cap, out_dtype)
    )
}

/// LoRA-input dropout with a mask that is a pure function of `(seed, element index)`, so that a
/// recomputation replays it: kept elements are scaled by `1/(1-p)`. The backward is the same call
/// on the upstream gradient.
pub fn dropout(x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
    dispatch!(x.device(), cpu::dropout(x, p, seed), c => c.dropout(x, p, seed))
}

/// Sum of squares of all elements (f64 on the host; a sync point on CUDA).
pub fn sum_sq(x: &Tensor) -> Result<f64> {
    dispatch!(x.device(), Ok(cpu::sum_sq(x.as_cpu()?)), c => c.sum_sq(x))
}

/// Hyperparameters of one AdamW update.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count for bias correction.
    pub step: u64,
    /// Gradient multiplier applied before the update (clipping and accumulation averaging).
    pub grad_scale: f32,
}

/// Decoupled-weight-decay Adam on f32 parameters, in place.
pub fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: AdamW,
) -> Result<()> {
    let dev = param.device().clone();
    dispatch!(&dev, cpu::adamw_step(param, grad, m, v, h), c => c.adamw_step(param, grad, m, v, h))
}

/// Sum of squares over every element of every tensor, left on the device (one value): one
/// launch on CUDA whatever the number of tensors, and no sync.
pub fn sum_sq_multi(xs: &[&Tensor]) -> Result<DeviceValues> {
    let Some(first) = xs.first() else {
        return Ok(DeviceValues::cpu(vec![0.0]));
    };
    for (i, x) in xs.iter().enumerate() {
        same_device(first, x, "sum_sq_multi").with_context(|| format!("item {i}"))?;
    }
    dispatch!(first.device(), cpu::sum_sq_multi(xs), c => c.sum_sq_multi(xs))
}

/// Global-norm clipping decided where the gradients live: with `norm = sqrt(sum_sq) · average`,
/// the gradients are multiplied by `average · max_norm / norm` when `0 < max_norm < norm`, else by
/// `average`. Given to `adamw_multi`, it replaces `AdamW::grad_scale`, so the update needs no
/// read-back of the norm.
#[derive(Clone, Copy)]
pub struct NormClip<'a> {
    /// `sum_sq_multi` of the gradients, on their device.
    pub sum_sq: &'a DeviceValues,
    /// Averaging factor of accumulated micro-steps.
    pub average: f64,
    /// No clipping when `<= 0`.
    pub max_norm: f64,
}

/// `NormClip`'s gradient multiplier for a known sum of squares (the CUDA kernel does the same
/// arithmetic in f64).
pub fn clip_scale(sum_sq: f64, average: f64, max_norm: f64) -> f64 {
    let norm = sum_sq.sqrt() * average;
    let clip = if max_norm > 0.0 && norm > max_norm {
        max_norm / norm
    } else {
        1.0
    };
    average * clip
}

/// One tensor of a multi-tensor AdamW update (`adamw_multi`).
pub struct AdamWItem<'a> {
    /// f32 master, updated in place.
    pub param: &'a mut Tensor,
    /// Its gradient (f32 or bf16), set to zero once read.
    pub grad: &'a mut Tensor,
    /// f32 moments.
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
    /// Receives the updated parameter in its own dtype (the device's compute copy), if given.
    pub compute: Option<&'a mut Tensor>,
    /// Learning rate of this tensor; replaces the shared `AdamW::lr`.
    pub lr: f32,
}

/// `adamw_step` on every item (each with its own lr, the other hyperparameters shared), then the
/// item's compute copy refreshed from the new parameter and its gradient zeroed: one launch on
/// CUDA whatever the number of tensors. Per element the arithmetic is `adamw_step`'s. With `clip`,
/// the gradient multiplier comes from it instead of `h.grad_scale`.
pub fn adamw_multi(items: &mut [AdamWItem], h: AdamW, clip: Option<NormClip>) -> Result<()> {
    let Some(dev) = items.first().map(|it| it.param.device().clone()) else {
        return Ok(());
    };
    for (i, it) in items.iter().enumerate() {
        let n = it.param.numel();
        let f32s = [&*it.param, &*it.m, &*it.v].map(|t| t.dtype() == DType::F32);
        ensure!(
            f32s.iter().all(|&x| x),
            "adamw_multi: tensor {i}: parameter and moments must be f32, got {:?}, {:?}, {:?}",
            it.param.dtype(),
            it.m.dtype(),
            it.v.dtype()
        );
        ensure!(
            it.grad.numel() == n && it.m.numel() == n && it.v.numel() == n,
            "adamw_multi: tensor {i}: param {:?}, grad {:?}, m {:?}, v {:?} differ in size",
            it.param.shape(),
            it.grad.shape(),
            it.m.shape(),
            it.v.shape()
        );
        let first = &*items[0].param;
        for t in [&*it.param, &*it.grad, &*it.m, &*it.v] {
            same_device(first, t, "adamw_multi").with_context(|| format!("item {i}"))?;
        }
        if let Some(c) = &it.compute {
            ensure!(
                c.numel() == n,
                "adamw_multi: tensor {i}: compute copy {:?} vs param {:?}",
                c.shape(),
                it.param.shape()
            );
            same_device(first, c, "adamw_multi").with_context(|| format!("item {i}"))?;
        }
    }
    dispatch!(&dev, cpu::adamw_multi(items, h, clip), c => c.adamw_multi(items, h, clip))
}

/// `dst = src` converted to `dst`'s dtype, for every pair, in place (no allocation): one launch
/// on CUDA whatever the number of pairs.
pub fn cast_multi(pairs: &mut [(&Tensor, &mut Tensor)]) -> Result<()> {
    let Some(dev) = pairs.first().map(|(s, _)| s.device().clone()) else {
        return Ok(());
    };
    for (i, (src, dst)) in pairs.iter().enumerate() {
        ensure!(
            src.numel() == dst.numel(),
            "cast_multi: pair {i}: source {:?} vs destination {:?}",
            src.shape(),
            dst.shape()
        );
        same_device(pairs[0].0, src, "cast_multi").with_context(|| format!("item {i}"))?;
        same_device(pairs[0].0, dst, "cast_multi").with_context(|| format!("item {i}"))?;
    }
    dispatch!(&dev, cpu::cast_multi(pairs), c => c.cast_multi(pairs))
}

/// The dropout keep-decision shared bit-for-bit by the CPU and CUDA backends.
#[inline]
pub fn dropout_keep(seed: u64, index: u64, p: f32) -> bool {
    let mut h = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^= h >> 33;
    // Top 24 bits as a uniform in [0, 1).
    ((h >> 40) as f32) * (1.0 / 16_777_216.0) >= p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lora_linear_rounded` on the CPU is `x Wᵀ + scale · xa Bᵀ` (summed in f64 here), and its
    /// row blocks and `may_fold` change nothing; mismatched shapes are refused with every shape
    /// named.
    #[test]
    fn lora_linear_rounded_is_the_sum_of_both_products() {
        let (t, k, n, r) = (7, 5, 6, 2);
        let v = |len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|i| ((i * 37 % 11) as f32 - 5.0) * s).collect()
        };
        let (x, w, xa, b) = (v(t * k, 0.3), v(n * k, 0.2), v(t * r, 0.7), v(n * r, 0.05));
        let tx = |d: &[f32], shape: &[usize]| Tensor::cpu(d.to_vec(), shape).unwrap();
        let (xt, wt, xat, bt) = (
            tx(&x, &[t, k]),
            tx(&w, &[n, k]),
            tx(&xa, &[t, r]),
            tx(&b, &[n, r]),
        );
        let sum = |block: usize, may_fold: bool| {
            let (w, xa) = (Cols::all(&wt), Cols::all(&xat));
            lora_linear_rounded(&xt, w, xa, &bt, 1.5, DType::BF16, block, may_fold).unwrap()
        };
        let (whole, blocked, may_fold) = (sum(t, false), sum(3, false), sum(t, true));
        assert_eq!(whole.shape(), &[t, n]);
        for i in 0..t {
            for j in 0..n {
                let base: f64 = (0..k).map(|c| (x[i * k + c] * w[j * k + c]) as f64).sum();
                let term: f64 = (0..r).map(|c| (xa[i * r + c] * b[j * r + c]) as f64).sum();
                let got = whole.as_cpu().unwrap()[i * n + j] as f64;
                assert!(
                    (got - (base + 1.5 * term)).abs() < 1e-5,
                    "({i}, {j}): {got}"
                );
            }
        }
        assert_eq!(whole.to_vec().unwrap(), blocked.to_vec().unwrap());
        assert_eq!(whole.to_vec().unwrap(), may_fold.to_vec().unwrap());
        let err = lora_linear_rounded(
            &xt,
            Cols::all(&wt),
            Cols::all(&tx(&xa, &[r, t])),
            &bt,
            1.5,
            DType::BF16,
            t,
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("xa [2, 7]"), "{err}");

        // The same sum from a weight stored as [W | 1.5 B | 0] (`extend_cols` and the columns
        // written by hand: the CPU refuses `write_adapter_cols`, which writes through a shared
        // reference).
        let pad = r + 3;
        let mut ext = extend_cols(&wt, pad).unwrap();
        assert_eq!(ext.shape(), &[n, k + pad]);
        let err = write_adapter_cols(&ext, k..k + pad, 0, &bt, 1.5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("CPU"), "{err}");
        for j in 0..n {
            let row = &mut ext.as_cpu_mut().unwrap()[j * (k + pad)..(j + 1) * (k + pad)];
            assert_eq!(&row[..k], &w[j * k..(j + 1) * k]);
            assert!(row[k..].iter().all(|&e| e == 0.0));
            for c in 0..r {
                row[k + c] = 1.5 * b[j * r + c];
            }
        }
        let extended = lora_linear_extended(&xt, &ext, Cols::all(&xat), DType::BF16, t).unwrap();
        for (g, e) in extended
            .to_vec()
            .unwrap()
            .iter()
            .zip(whole.to_vec().unwrap())
        {
            assert!((g - e).abs() < 1e-5, "{g} vs {e}");
        }
        let wide = tx(&v(t * (pad + 1), 0.1), &[t, pad + 1]);
        let err = lora_linear_extended(&xt, &ext, Cols::all(&wide), DType::BF16, t)
            .unwrap_err()
            .to_string();
        assert!(err.contains("6 columns"), "{err}");
    }

    /// `matmul_onto` is a new tensor `beta · c + alpha · a b` that leaves the window it reads as
    /// it was, and `lora_linear_onto` on the CPU is `lora_linear_rounded` then `add`, bit for
    /// bit; a residual of the wrong shape is refused naming it.
    #[test]
    fn onto_products_leave_their_c_and_add_the_residual() {
        let v = |len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|i| ((i * 29 % 13) as f32 - 6.0) * s).collect()
        };
        let tx = |d: Vec<f32>, shape: &[usize]| Tensor::cpu(d, shape).unwrap();
        let (m, k, n) = (5, 4, 3);
        let (a, b, c) = (
            tx(v(m * k, 0.5), &[m, k]),
            tx(v(k * n, 0.25), &[k, n]),
            tx(v(m * 7, 1.0), &[m, 7]),
        );
        let before = c.to_vec().unwrap();
        let window = Cols {
            t: &c,
            start: 2,
            end: 2 + n,
        };
        let d = matmul_onto(window, Cols::all(&a), false, Cols::all(&b), false, 0.5, 2.0).unwrap();
        assert_eq!(c.to_vec().unwrap(), before);
        let (av, bv) = (a.to_vec().unwrap(), b.to_vec().unwrap());
        for i in 0..m {
            for j in 0..n {
                let ab: f32 = (0..k).map(|q| av[i * k + q] * bv[q * n + j]).sum();
                let want = 2.0 * before[i * 7 + 2 + j] + 0.5 * ab;
                let got = d.as_cpu().unwrap()[i * n + j];
                assert!((got - want).abs() < 1e-5, "({i}, {j}): {got} vs {want}");
            }
        }

        let (t, r) = (6, 2);
        let (x, w, xa, lb) = (
            tx(v(t * k, 0.3), &[t, k]),
            tx(v(n * k, 0.2), &[n, k]),
            tx(v(t * r, 0.7), &[t, r]),
            tx(v(n * r, 0.05), &[n, r]),
        );
        let res = tx(v(t * n, 0.9), &[t, n]);
        let (wc, xac) = (Cols::all(&w), Cols::all(&xa));
        let got = lora_linear_onto(&res, 0.25, &x, wc, xac, &lb, 1.5, t).unwrap();
        let y = lora_linear_rounded(&x, wc, xac, &lb, 1.5, DType::F32, t, true).unwrap();
        let want = add(&res, &y, 0.25).unwrap();
        assert_eq!(got.to_vec().unwrap(), want.to_vec().unwrap());
        let err = lora_linear_onto(&xa, 1.0, &x, wc, xac, &lb, 1.5, t)
            .unwrap_err()
            .to_string();
        assert!(err.contains("residual [6, 2]"), "{err}");
    }

    #[test]
    fn clip_scale_clips_only_above_the_bound() {
        // norm = sqrt(16) * 0.5 = 2.
        assert_eq!(clip_scale(16.0, 0.5, 4.0), 0.5);
        assert_eq!(clip_scale(16.0, 0.5, 0.0), 0.5);
        assert!((clip_scale(16.0, 0.5, 1.0) - 0.25).abs() < 1e-15);
    }

    /// `adamw_multi` with a `NormClip` is `adamw_multi` with the clip's multiplier as
    /// `grad_scale`, bit for bit.
    #[test]
    fn norm_clip_is_the_grad_scale_it_computes() {
        let g: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.01).collect();
        let run = |clip: bool| -> Vec<f32> {
            let mut p = Tensor::cpu(vec![0.5; 37], &[37]).unwrap();
            let mut grad = Tensor::cpu(g.clone(), &[37]).unwrap();
            let mut m = Tensor::cpu(vec![0.0; 37], &[37]).unwrap();
            let mut v = Tensor::cpu(vec![0.0; 37], &[37]).unwrap();
            let sum_sq = sum_sq_multi(&[&grad]).unwrap();
            let h = AdamW {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                step: 1,
                grad_scale: clip_scale(sum_sq.as_cpu().unwrap()[0], 0.5, 0.05) as f32,
            };
            let mut items = vec![AdamWItem {
                param: &mut p,
                grad: &mut grad,
                m: &mut m,
                v: &mut v,
                compute: None,
                lr: 1e-2,
            }];
            let norm_clip = clip.then_some(NormClip {
                sum_sq: &sum_sq,
                average: 0.5,
                max_norm: 0.05,
            });
            adamw_multi(&mut items, h, norm_clip).unwrap();
            // The first moment holds (1 - beta1) * g * multiplier: the clip applied.
            m.to_vec().unwrap()
        };
        let (with_clip, explicit) = (run(true), run(false));
        assert_eq!(with_clip, explicit);
        let norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt() * 0.5;
        assert!(norm > 0.05, "the case must clip (norm {norm})");
        let want = 0.1 * g[0] as f64 * 0.5 * 0.05 / norm;
        assert!(
            (with_clip[0] as f64 - want).abs() < 1e-7,
            "{} vs {want}",
            with_clip[0]
        );
    }
}
