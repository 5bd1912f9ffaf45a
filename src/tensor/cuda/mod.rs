//! The CUDA backend: one context and one compute stream on one GPU (and a copy stream for host
//! offload, `offload`), bf16 storage with fp32 accumulation,
//! kernels compiled by NVRTC when the GPU is opened (see `compile`), matrix products through cuBLASLt
//! (fp32 compute, each shape's algorithm chosen by timing: see `gemm`). Memory is stream-ordered (`cuMemAllocAsync`) and counted
//! (live and peak bytes); small host-to-device copies (token ids, masks) go through pinned staging
//! buffers so no op waits for the GPU. Downloads (`to_vec`, the sums of squares) are the only sync
//! points.
//!
//! This file owns setup, the allocator, uploads and downloads, launches and the profiler; each
//! kernel family's host side is its own file (`attention`, `elementwise`, `cce`, `objective`,
//! `dequant`, and `gemm` for cuBLASLt).
//!
//! Everything here talks to the driver through cudarc's thin `result`/`sys` layers, so memory,
//! launches and lifetimes are explicit. cudarc loads the driver with `dlopen` and panics when the
//! library is missing; `CudaBackend::new` turns that into an error.

mod attention;
mod cce;
pub mod compile;
mod decode;
mod dequant;
mod elementwise;
pub(crate) mod gemm;
mod objective;
mod offload;
pub use offload::{Fetched, HostCopy};

use super::{
    AdamW, AdamWItem, AttnMask, AttnShape, DType, Device, DeviceValues, MemoryStats, NormClip,
    RopeTable, Storage, Tensor,
};
use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{result as drv, sys, CudaContext, CudaStream};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Storage formats the frozen base weights may arrive in (ggml block layouts for the quantized
/// ones); `CudaBackend::dequantize` turns any of them into a bf16 matrix.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
}

impl QuantKind {
    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            QuantKind::F32 => (1, 4),
            QuantKind::F16 | QuantKind::BF16 => (1, 2),
            QuantKind::Q8_0 => (32, 34),
            QuantKind::Q4_0 => (32, 18),
            QuantKind::Q4_1 => (32, 20),
            QuantKind::Q4_K => (256, 144),
            QuantKind::Q6_K => (256, 210),
        }
    }
    fn kernel(self) -> &'static str {
        match self {
            QuantKind::F32 => "lf_deq_f32",
            QuantKind::F16 => "lf_deq_f16",
            QuantKind::BF16 => "lf_deq_bf16",
            QuantKind::Q8_0 => "lf_deq_q8_0",
            QuantKind::Q4_0 => "lf_deq_q4_0",
            QuantKind::Q4_1 => "lf_deq_q4_1",
            QuantKind::Q4_K => "lf_deq_q4_k",
            QuantKind::Q6_K => "lf_deq_q6_k",
        }
    }
}

#[derive(Clone, Copy)]
struct Func(sys::CUfunction);
// SAFETY: a CUfunction is a handle valid in the backend's context from any thread.
unsafe impl Send for Func {}
// SAFETY: as above; launching does not mutate the handle.
unsafe impl Sync for Func {}

#[derive(Clone, Copy)]
struct Module(sys::CUmodule);
// SAFETY: a CUmodule handle is usable from any thread bound to its context.
unsafe impl Send for Module {}

/// One pinned host buffer for small uploads, reusable once its event has completed.
struct Staging {
    ptr: *mut u8,
    cap: usize,
    event: sys::CUevent,
    pending: bool,
}
// SAFETY: the pointer is pinned host memory owned by this struct; access is under a Mutex.
unsafe impl Send for Staging {}

/// Freed buffers of up to `BLOCK_CACHE_MAX` bytes, by rounded size, reused by the next allocation
/// of the same size without a driver call. A step makes about a thousand small allocations (LoRA
/// intermediates, row indices, statistics), and a driver allocation and free cost the host about
/// 2 µs each. Reuse is safe because every buffer lives on the one stream: work queued after the
/// reuse runs after all work queued before the free. At most `BLOCK_CACHE_TOTAL` bytes wait here;
/// they are not counted as live.
#[derive(Default)]
struct BlockCache {
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    bytes: usize,
}

const BLOCK_CACHE_MAX: usize = 4 << 20;
const BLOCK_CACHE_TOTAL: usize = 256 << 20;

/// The size the driver is asked for (and the cache's key) for a buffer of `bytes`.
fn block_size(bytes: usize) -> usize {
    bytes.max(1).next_multiple_of(16)
}

/// `d` rounded up to a grain of an eighth of its octave (`d` itself up to 64): at most 12.5% more,
/// and nearby values share one rounded value (GEMM tuning buckets, pinned buffer sizes).
fn eighth_octave_up(d: u64) -> u64 {
    if d <= 64 {
        return d;
    }
    let grain = 1u64 << (63 - d.leading_zeros() - 3);
    d.div_ceil(grain) * grain
}

/// Uploads up to this size go through pinned staging (no host sync); larger ones are plain copies.
const STAGING_MAX: usize = 4 << 20;

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    name: String,
    sm_count: u32,
    smem_optin: i32,
    modules: Mutex<HashMap<&'static str, Module>>,
    funcs: Mutex<HashMap<&'static str, Func>>,
    staging: Mutex<Vec<Staging>>,
    /// Freed small buffers kept for reuse (see `BlockCache`).
    blocks: Mutex<BlockCache>,
    live: AtomicUsize,
    peak: AtomicUsize,
    /// `memory_limit` as a cap on the live bytes (0: none; `set_memory_cap`).
    cap: AtomicUsize,
    /// Which attention forward kernel serves head_dim 64 / 128: 0 chooses by grid size, 2 or 3
    /// forces that version (the parity suite checks both).
    attn_fwd_version: std::sync::atomic::AtomicU8,
    /// Which attention backward serves head_dim 64 / 128: 0 or 4 the one-pass kernel (dQ by f32
    /// atomics, so not bit-reproducible run to run), 2 the two deterministic kernels (dQ, dK/dV).
    /// Set to 2 by `Device::set_numerics` for `TrainConfig::deterministic_attention`.
    attn_bwd_version: std::sync::atomic::AtomicU8,
    /// `LORAFIT_PROFILE`: per-kernel and per-GEMM times (see `profiled`).
    prof: Option<Mutex<Profile>>,
    /// Kernel launches and library calls so far (every `profiled` call).
    launches: AtomicU64,
    /// With `LORAFIT_PROFILE=timeline`: host nanoseconds spent in each `HostCall` class.
    host_ns: Option<[AtomicU64; HOST_CALLS]>,
    /// The host-offload copy stream and its pinned buffers (`offload`).
    offload: offload::Lane,
}

/// Classes of host work timed with `LORAFIT_PROFILE=timeline` (`Inner::host_timed`).
#[derive(Clone, Copy)]
enum HostCall {
    Launch = 0,
    Gemm = 1,
    Alloc = 2,
    Free = 3,
    Upload = 4,
}
const HOST_CALLS: usize = 5;
const HOST_CALL_NAMES: [&str; HOST_CALLS] = ["launch", "gemm", "alloc", "free", "upload"];

/// Accumulated device time per kernel or GEMM class, timed with a pair of events around each
/// launch. `LORAFIT_PROFILE=1` synchronises after every launch (`e0`, `e1`);
/// `LORAFIT_PROFILE=timeline` records a fresh pair per launch (from `pool`) without waiting, so
/// the device runs as it would unprofiled, and `take_timeline` reads them once the work is done:
/// the device's busy time against the span of the whole sequence.
struct Profile {
    e0: sys::CUevent,
    e1: sys::CUevent,
    rows: HashMap<String, (u64, f64)>,
    timeline: bool,
    pool: Vec<(sys::CUevent, sys::CUevent)>,
    /// Names of the launches recorded since the last `take_timeline`, in order (pair i of `pool`).
    marks: Vec<String>,
}

/// Device time of the launches recorded since the last `take_timeline`, and the host's time in
/// driver and library calls over the same stretch.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub launches: usize,
    /// `(class, ms)`: kernel launches, GEMM calls, allocations, frees, uploads.
    pub host_ms: Vec<(&'static str, f64)>,
    /// Sum of the launches' own times.
    pub busy_ms: f64,
    /// From the first launch's start to the last one's end.
    pub span_ms: f64,
}
// SAFETY: the events belong to the backend's context and are used under the Mutex.
unsafe impl Send for Profile {}

/// Timeline launches recorded before they are folded into the table even without a
/// `take_timeline` (a run that never asks, such as training, keeps a bounded event pool).
const TIMELINE_MAX: usize = 1 << 16;

impl Profile {
    /// Adds the recorded timeline launches to `rows` and forgets them; returns their count, busy
    /// time and span (ms). The stream must be idle.
    fn fold_marks(&mut self) -> Result<(usize, f64, f64)> {
        let marks = std::mem::take(&mut self.marks);
        let n = marks.len();
        let mut busy = 0.0;
        for (i, name) in marks.into_iter().enumerate() {
            let (e0, e1) = self.pool[i];
            // SAFETY: both events were recorded and the stream is idle.
            let ms = unsafe { drv::event::elapsed(e0, e1) }.map_err(|e| anyhow!("{e:?}"))? as f64;
            busy += ms;
            // The device's idle time between the previous launch's end and this one's start,
            // a row of its own per launch class, so that the table accounts for the whole span.
            if i > 0 {
                // SAFETY: as above.
                let idle = unsafe { drv::event::elapsed(self.pool[i - 1].1, e0) }
                    .map_err(|e| anyhow!("{e:?}"))? as f64;
                let row = self
                    .rows
                    .entry(format!("(idle before) {name}"))
                    .or_insert((0, 0.0));
                row.0 += 1;
                row.1 += idle.max(0.0);
            }
            let row = self.rows.entry(name).or_insert((0, 0.0));
            row.0 += 1;
            row.1 += ms;
        }
        let span = match n {
            0 => 0.0,
            // SAFETY: as above.
            n => unsafe { drv::event::elapsed(self.pool[0].0, self.pool[n - 1].1) }
                .map_err(|e| anyhow!("{e:?}"))? as f64,
        };
        Ok((n, busy, span))
    }
}
// SAFETY: every driver call binds the context first and uses the backend's stream; the mutable
// state is behind Mutexes and atomics.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Inner {
    /// Runs `f`, adding its host time to `class` when host timing is on.
    fn host_timed<T>(&self, class: HostCall, f: impl FnOnce() -> T) -> T {
        let Some(ns) = &self.host_ns else {
            return f();
        };
        let t = std::time::Instant::now();
        let r = f();
        ns[class as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("cuda: binding the context: {e:?}"))
    }
    fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.bind();
        self.offload.shut_down();
        let _ = self.stream.synchronize();
        for (_, ptrs) in self.blocks.lock().unwrap().free.drain() {
            for p in ptrs {
                // SAFETY: buffers of this stream that nothing references; the stream is idle.
                let _ = unsafe { drv::free_async(p, self.cu_stream()) };
            }
        }
        let _ = self.stream.synchronize();

        for s in self.staging.lock().unwrap().drain(..) {
            // SAFETY: pinned buffer and event created by this backend; the stream is idle.
            unsafe {
                let _ = drv::free_host(s.ptr as *mut c_void);
                let _ = drv::event::destroy(s.event);
            }
        }
        if let Some(p) = &self.prof {
            let p = p.lock().unwrap();
            // SAFETY: events created in `new`; the stream is idle.
            unsafe {
                let _ = drv::event::destroy(p.e0);
                let _ = drv::event::destroy(p.e1);
                for &(e0, e1) in &p.pool {
                    let _ = drv::event::destroy(e0);
                    let _ = drv::event::destroy(e1);
                }
            }
        }
        for (_, m) in self.modules.lock().unwrap().drain() {
            // SAFETY: no kernel of the module is running (stream synchronised above).
            let _ = unsafe { drv::module::unload(m.0) };
        }
    }
}

/// The CUDA device: context, stream, cuBLASLt plans, kernel cache, allocator counters.
pub struct CudaBackend {
    me: Weak<CudaBackend>,
    inner: Arc<Inner>,
    /// cuBLASLt and the per-shape GEMM plans, created by the first product (see `gemm`).
    gemms: Mutex<Option<gemm::Gemms>>,
    /// Masks already on the device, most recent first (`attention::MaskCache`): every layer of
    /// a pass attends under the same mask, uploaded once.
    masks: Mutex<attention::MaskCache>,
    /// Zeroed counters that kernels summing a row group's slices in one pass count their
    /// finished blocks in, and leave at zero (`slice_counts`).
    slice_counts: Mutex<Option<Tensor>>,
}

/// A device buffer (stream-ordered allocation, freed on drop, counted in `MemoryStats`).
pub struct CudaStorage {
    pub(crate) ptr: sys::CUdeviceptr,
    bytes: usize,
    inner: Arc<Inner>,
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        self.inner.live.fetch_sub(self.bytes, Ordering::Relaxed);
        let n = block_size(self.bytes);
        if n <= BLOCK_CACHE_MAX {
            let mut cache = self.inner.blocks.lock().unwrap();
            if cache.bytes + n <= BLOCK_CACHE_TOTAL {
                cache.bytes += n;
                cache.free.entry(n).or_default().push(self.ptr);
                return;
            }
        }
        if self.inner.bind().is_ok() {
            // SAFETY: `ptr` was allocated on this stream and is freed once, in stream order.
            let _ = self.inner.host_timed(HostCall::Free, || unsafe {
                drv::free_async(self.ptr, self.inner.cu_stream())
            });
        }
    }
}

impl CudaStorage {
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Copies `n` elements to the host as f32 (a sync point).
    pub fn download_f32(&self, n: usize, dtype: DType) -> Result<Vec<f32>> {
        ensure!(n * dtype.size() <= self.bytes, "download past the buffer");
        self.inner.bind()?;
        Ok(match dtype {
            DType::F32 => {
                let mut v = vec![0f32; n];
                self.dtoh(&mut v)?;
                v
            }
            DType::BF16 => {
                let mut v = vec![half::bf16::ZERO; n];
                self.dtoh(&mut v)?;
                v.into_iter().map(f32::from).collect()
            }
        })
    }

    /// Copies `n` f64 values to the host (a sync point).
    pub fn download_f64(&self, n: usize) -> Result<Vec<f64>> {
        ensure!(n * 8 <= self.bytes, "download past the buffer");
        self.inner.bind()?;
        let mut v = vec![0f64; n];
        self.dtoh(&mut v)?;
        Ok(v)
    }

    fn dtoh<T>(&self, out: &mut [T]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: `out` is a host buffer of the copied size, within this allocation (checked by
        // callers); the stream is synchronised before `out` is read.
        unsafe {
            drv::memcpy_dtoh_async(out, self.ptr, self.inner.cu_stream())
                .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
        }
        self.inner
            .stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: stream sync: {e:?}"))
    }
}

/// Raw bytes on the device (quantized weights before dequantisation).
pub struct DeviceBytes {
    buf: CudaStorage,
    len: usize,
}

impl DeviceBytes {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A kernel argument.
enum Arg {
    P(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Mask(MaskArg),
}

/// Mirrors `struct Mask` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct MaskArg {
    ranges: u64,
    pos: u64,
    kt_min: u64,
    kt_max: u64,
    tile_flags: u64,
    window: i32,
}

const KEY_TILE: usize = 64;

/// A dtype as the kernels' flag argument (`dt_code`).
fn dt(d: DType) -> Arg {
    Arg::I32(dt_code(d) as i32)
}

/// Whether the 8-wide bf16 kernels apply: every operand bf16 and `n` a multiple of 8 (tensors
/// own their allocations, which are 16-byte aligned).
fn bf16x8(ts: &[&Tensor], n: usize) -> bool {
    n.is_multiple_of(8) && ts.iter().all(|t| t.dtype() == DType::BF16)
}

/// Elements per chunk of the multi-tensor kernels (a block's unit of work: 8 per thread), and
/// their block size.
const MULTI_CHUNK: usize = 2048;
/// Values in `pair_objective`'s stats.
pub const OBJ_STATS: usize = 9;
const MULTI_THREADS: u32 = 256;

/// The kernels' dtype flag (`ldf`/`stf` in common.cuh): 0 f32, 1 bf16; also written into the
/// multi-tensor tables.
fn dt_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
    }
}

/// Two 4-byte fields of a table entry in one 8-byte word (`lo` first, little-endian).
fn pack(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

/// The RMSNorm kernel for rows of `h` (forward or backward, by `stem`): the 4-wide kernels at 256
/// threads, with at most 4 groups of 4 per thread (`…_x4v4`, h ≤ 4096) or 8 (`…_x4`), and the
/// scalar kernel otherwise.
fn rms_kernel(stem: &'static str, h: usize) -> &'static str {
    let x4 = h.is_multiple_of(4);
    match (stem, x4 && h <= 4 * 4 * 256, x4 && h <= 4 * 8 * 256) {
        ("lf_rms_norm", true, _) => "lf_rms_norm_x4v4",
        ("lf_rms_norm", false, true) => "lf_rms_norm_x4",
        ("lf_rms_norm_bwd", true, _) => "lf_rms_norm_bwd_x4v4",
        ("lf_rms_norm_bwd", false, true) => "lf_rms_norm_bwd_x4",
        _ => stem,
    }
}

/// A version 2+ attention kernel chosen for a shape: its launch configuration.
struct AttnKernel {
    name: &'static str,
    threads: u32,
    grid: (u32, u32, u32),
    smem: u32,
}

/// The device's default stream-ordered memory pool (what `cuMemAllocAsync` draws from).
fn default_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` receives the handle; `device` is a valid device ordinal handle.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, device).result() }
        .map_err(|e| anyhow!("cuda: default memory pool: {e:?}"))?;
    Ok(pool)
}

fn cuda_ptr(t: &Tensor) -> Result<u64> {
    match t.storage() {
        Storage::Cuda(s) => Ok(s.ptr),
        Storage::Cpu(_) => bail!("expected a CUDA tensor, got a CPU one"),
    }
}

fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(anyhow!("{what}: {msg}"))
        }
    }
}

/// The error where the NVIDIA driver library is missing: what is missing, and what to do.
const NO_DRIVER: &str = "CUDA is not available: the NVIDIA driver library (libcuda.so.1) was not \
    found; install the NVIDIA driver on a machine with an NVIDIA GPU, or run on the CPU \
    (--device cpu)";

/// The error where the driver is present but GPU `ordinal` cannot be opened (`detail`: the
/// driver's own error).
fn no_device(ordinal: usize, detail: &str) -> String {
    format!(
        "CUDA device {ordinal} could not be opened ({detail}); check that a GPU is present and \
         visible to this process (nvidia-smi, CUDA_VISIBLE_DEVICES), or run on the CPU \
         (--device cpu)"
    )
}

/// Whether GPU `ordinal` is there, without opening it: the driver is loaded and asked how many
/// devices it sees (no context is created and no kernel compiled, so a server can check a job's
/// device while another job trains on it).
pub fn probe(ordinal: usize) -> Result<()> {
    // SAFETY: probing only opens the library.
    if !unsafe { sys::is_culib_present() } {
        bail!(NO_DRIVER);
    }
    let count = catch("CUDA initialisation failed", || {
        CudaContext::device_count().map_err(|e| anyhow!(no_device(ordinal, &format!("{e:?}"))))
    })?;
    if ordinal >= count.max(0) as usize {
        bail!(no_device(
            ordinal,
            &format!("the driver sees {count} device(s)")
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// `LORAFIT_DEVICE_CAP_GIB`: the allocator refuses, as the driver would when out of memory, any
/// allocation that takes the live bytes past this many GiB, while the free memory the planner
/// reads stays the device's. It makes a smaller card's out-of-memory failures reproducible on a
/// large one (the trainer's retry on a smaller plan is checked with it).
fn device_cap() -> Option<usize> {
    static CAP: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("LORAFIT_DEVICE_CAP_GIB")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .map(|g| (g * (1u64 << 30) as f64) as usize)
    })
}

/// Why an allocation of `bytes` with `live` bytes live is refused, as the driver refuses one out of
/// memory: past `LORAFIT_DEVICE_CAP_GIB` (`env_cap`) or past `memory_limit` (`limit`,
/// `CudaBackend::set_memory_cap`). None where it may go ahead.
fn cap_refusal(
    live: usize,
    bytes: usize,
    env_cap: Option<usize>,
    limit: Option<usize>,
) -> Option<String> {
    let past = |cap: usize| live + bytes > cap;
    if let Some(cap) = env_cap.filter(|&c| past(c)) {
        return Some(format!(
            "LORAFIT_DEVICE_CAP_GIB: {live} bytes live of a {cap}-byte cap"
        ));
    }
    limit
        .filter(|&c| past(c))
        .map(|cap| format!("memory_limit: {live} bytes live of {cap}"))
}

impl CudaBackend {
    /// Holds the live bytes to `bytes` (`memory_limit`; None lifts it): an allocation past it is
    /// refused as one past the device's memory, so a step whose plan was estimated too low fails
    /// as out of memory, and the trainer runs it again on a smaller plan, instead of the process
    /// taking more than its share of a shared GPU.
    pub fn set_memory_cap(&self, bytes: Option<usize>) {
        self.inner.cap.store(bytes.unwrap_or(0), Ordering::Relaxed);
    }

    /// Opens GPU `ordinal`: an error (not a panic) where the driver library or the GPU is missing.
    pub fn new(ordinal: usize) -> Result<Arc<CudaBackend>> {
        // SAFETY: probing only opens the library.
        if !unsafe { sys::is_culib_present() } {
            bail!(NO_DRIVER);
        }
        let inner = catch("CUDA initialisation failed", || {
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| anyhow!(no_device(ordinal, &format!("{e:?}"))))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| anyhow!("cuda: creating a stream: {e:?}"))?;
            let (maj, min) = ctx
                .compute_capability()
                .map_err(|e| anyhow!("cuda: compute capability: {e:?}"))?;
            let name = ctx.name().unwrap_or_else(|_| "cuda".into());
            let attr = |a| ctx.attribute(a).unwrap_or(0);
            let sm_count =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32;
            let smem_optin = attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            );
            if ctx.has_async_alloc() {
                // Keep freed memory in the stream-ordered pool across synchronisations (the
                // default threshold of 0 hands it back to the driver at every sync, and the next
                // step maps it again). `live`/`peak` below count what is allocated, not cached.
                let pool = default_mem_pool(ctx.cu_device())?;
                let keep = u64::MAX;
                // SAFETY: a live pool; `keep` outlives the call.
                unsafe {
                    sys::cuMemPoolSetAttribute(
                        pool,
                        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                        &keep as *const u64 as *mut c_void,
                    )
                    .result()
                }
                .map_err(|e| anyhow!("cuda: memory pool threshold: {e:?}"))?;
            }
            Ok(Inner {
                ctx,
                stream,
                arch: format!("sm_{maj}{min}"),
                name: format!("cuda:{ordinal} ({name})"),
                sm_count: sm_count.max(1),
                smem_optin,
                modules: Mutex::new(HashMap::new()),
                funcs: Mutex::new(HashMap::new()),
                staging: Mutex::new(Vec::new()),
                blocks: Mutex::new(BlockCache::default()),
                live: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
                cap: AtomicUsize::new(0),
                attn_fwd_version: std::sync::atomic::AtomicU8::new(0),
                attn_bwd_version: std::sync::atomic::AtomicU8::new(0),
                prof: if std::env::var_os("LORAFIT_PROFILE").is_some_and(|v| v != "0") {
                    let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
                    let e0 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
                    let e1 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
                    Some(Mutex::new(Profile {
                        e0,
                        e1,
                        rows: HashMap::new(),
                        timeline: std::env::var("LORAFIT_PROFILE").is_ok_and(|v| v == "timeline"),
                        pool: Vec::new(),
                        marks: Vec::new(),
                    }))
                } else {
                    None
                },
                launches: AtomicU64::new(0),
                host_ns: std::env::var("LORAFIT_PROFILE")
                    .is_ok_and(|v| v == "timeline")
                    .then(|| std::array::from_fn(|_| AtomicU64::new(0))),
                offload: offload::Lane::default(),
            })
        })?;
        // A machine that has not run this build compiles the kernels here, all at once, rather
        // than one module at a time inside the first step.
        compile::prepare_modules(&inner.arch)?;
        Ok(Arc::new_cyclic(|me| CudaBackend {
            me: me.clone(),
            inner: Arc::new(inner),
            gemms: Mutex::new(None),
            masks: Mutex::new(attention::MaskCache::default()),
            slice_counts: Mutex::new(None),
        }))
    }

    pub fn name(&self) -> String {
        self.inner.name.clone()
    }
    /// The compute architecture kernels are compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }
    pub fn memory(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: self.inner.live.load(Ordering::Relaxed),
            peak_bytes: self.inner.peak.load(Ordering::Relaxed),
        }
    }
    /// `(free, total)` bytes of device memory as the driver reports them, after handing the
    /// pool's cached but unused memory back (so that it counts as free).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.inner.bind()?;
        self.synchronize()?;
        if self.inner.ctx.has_async_alloc() {
            let pool = default_mem_pool(self.inner.ctx.cu_device())?;
            // SAFETY: a live pool; trimming only releases unused memory.
            unsafe { sys::cuMemPoolTrimTo(pool, 0).result() }
                .map_err(|e| anyhow!("cuda: memory pool trim: {e:?}"))?;
        }
        drv::mem_get_info().map_err(|e| anyhow!("cuda: cuMemGetInfo: {e:?}"))
    }
    /// Forces the attention forward kernel version for head_dim 64 / 128 (2 or 3; 0, the
    /// default: version 5 (wgmma) at head_dim 128 on sm_90, else by grid size). For the parity
    /// suite, which checks each.
    pub fn set_attention_forward_version(&self, v: u8) {
        self.inner.attn_fwd_version.store(v, Ordering::Relaxed);
    }
    /// Forces the attention backward for head_dim 64 / 128: 0 (the default) the one-pass kernel
    /// (on sm_90 at head_dim 128 its wgmma form, version 5), 4 the one-pass mma.sync kernel, 2
    /// the two-kernel version; 5 and 6 version 5 with per-head blocks or with the kv-head loop
    /// (see `attn5_head_loop`). At head_dim 256, 2 is the two-kernel version and any other the
    /// one-pass version 6. For the parity suite, which checks each.
    pub fn set_attention_backward_version(&self, v: u8) {
        self.inner.attn_bwd_version.store(v, Ordering::Relaxed);
    }
    pub fn reset_peak(&self) {
        self.inner
            .peak
            .store(self.inner.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    /// Runs `f` (which enqueues work on the stream); with `LORAFIT_PROFILE` set, times it with
    /// events (synchronising) and adds the time to the row `name()`.
    fn profiled<T>(
        &self,
        name: impl FnOnce() -> String,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        self.inner.launches.fetch_add(1, Ordering::Relaxed);
        let Some(prof) = &self.inner.prof else {
            return f();
        };
        let mut p = prof.lock().unwrap();
        let stream = self.inner.cu_stream();
        if p.timeline {
            if p.marks.len() == TIMELINE_MAX {
                self.inner
                    .stream
                    .synchronize()
                    .map_err(|e| anyhow!("cuda: stream sync: {e:?}"))?;
                p.fold_marks()?;
            }
            let i = p.marks.len();
            if i == p.pool.len() {
                let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
                let e0 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
                let e1 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
                p.pool.push((e0, e1));
            }
            let (e0, e1) = p.pool[i];
            // SAFETY: live events of this context recorded on our stream; read in take_timeline.
            unsafe { drv::event::record(e0, stream) }.map_err(|e| anyhow!("{e:?}"))?;
            let r = f()?;
            // SAFETY: as above.
            unsafe { drv::event::record(e1, stream) }.map_err(|e| anyhow!("{e:?}"))?;
            p.marks.push(name());
            return Ok(r);
        }
        // SAFETY: live events of this context recorded on our stream.
        unsafe { drv::event::record(p.e0, stream) }.map_err(|e| anyhow!("{e:?}"))?;
        let r = f()?;
        // SAFETY: as above; the second event completes after the work `f` enqueued.
        let ms = unsafe {
            drv::event::record(p.e1, stream).map_err(|e| anyhow!("{e:?}"))?;
            drv::event::synchronize(p.e1).map_err(|e| anyhow!("{e:?}"))?;
            drv::event::elapsed(p.e0, p.e1).map_err(|e| anyhow!("{e:?}"))?
        };
        let row = p.rows.entry(name()).or_insert((0, 0.0));
        row.0 += 1;
        row.1 += ms as f64;
        Ok(r)
    }

    /// Kernel launches and library calls made so far.
    pub fn launches(&self) -> u64 {
        self.inner.launches.load(Ordering::Relaxed)
    }

    /// With `LORAFIT_PROFILE=timeline`: waits for the device, then reads the launches recorded
    /// since the last call (at most `TIMELINE_MAX`; their times also go to `profile_report`'s
    /// table); `None` in the other modes.
    pub fn take_timeline(&self) -> Result<Option<Timeline>> {
        let Some(prof) = &self.inner.prof else {
            return Ok(None);
        };
        let mut p = prof.lock().unwrap();
        if !p.timeline {
            return Ok(None);
        }
        self.synchronize()?;
        let (launches, busy, span) = p.fold_marks()?;
        let host_ms = match &self.inner.host_ns {
            Some(ns) => HOST_CALL_NAMES
                .iter()
                .zip(ns)
                .map(|(n, v)| (*n, v.swap(0, Ordering::Relaxed) as f64 / 1e6))
                .collect(),
            None => Vec::new(),
        };
        Ok(Some(Timeline {
            launches,
            host_ms,
            busy_ms: busy,
            span_ms: span,
        }))
    }

    /// With `LORAFIT_PROFILE` set: the table of device time per kernel / GEMM class (name, calls,
    /// total ms, share), largest first; `None` otherwise.
    /// Forgets the per-kernel times recorded so far (`LORAFIT_PROFILE`).
    pub fn profile_reset(&self) {
        if let Some(prof) = self.inner.prof.as_ref() {
            prof.lock().unwrap().rows.clear();
        }
    }

    pub fn profile_report(&self) -> Option<String> {
        let prof = self.inner.prof.as_ref()?;
        let p = prof.lock().unwrap();
        let mut rows: Vec<(&String, &(u64, f64))> = p.rows.iter().collect();
        rows.sort_by(|a, b| b.1 .1.partial_cmp(&a.1 .1).unwrap());
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut out = format!(
            "profile (LORAFIT_PROFILE, {}): {:.1} ms in {} launches\n{:<56} {:>8} {:>11} {:>7}\n",
            if p.timeline {
                "timeline: not synchronised"
            } else {
                "synchronised per launch"
            },
            total,
            rows.iter().map(|r| r.1 .0).sum::<u64>(),
            "kernel",
            "calls",
            "total ms",
            "share"
        );
        for (name, (calls, ms)) in rows {
            out += &format!(
                "{name:<56} {calls:>8} {ms:>11.3} {:>6.1}%\n",
                100.0 * ms / total.max(1e-9)
            );
        }
        Some(out)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.inner.bind()?;
        self.inner
            .stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: stream sync: {e:?}"))
    }

    fn device(&self) -> Device {
        Device::Cuda(self.me.upgrade().expect("backend alive while in use"))
    }

    // --------------------------------------------------------------------------------------------
    // Memory

    fn alloc(&self, bytes: usize) -> Result<CudaStorage> {
        self.inner.bind()?;
        let live = self.inner.live.load(Ordering::Relaxed);
        let limit = self.inner.cap.load(Ordering::Relaxed);
        if let Some(refusal) = cap_refusal(live, bytes, device_cap(), (limit > 0).then_some(limit))
        {
            bail!("cuda: allocating {bytes} bytes: CUDA_ERROR_OUT_OF_MEMORY ({refusal})");
        }
        let n = block_size(bytes);
        let cached = if n <= BLOCK_CACHE_MAX {
            let mut cache = self.inner.blocks.lock().unwrap();
            let ptr = cache.free.get_mut(&n).and_then(|v| v.pop());
            if ptr.is_some() {
                cache.bytes -= n;
            }
            ptr
        } else {
            None
        };
        let ptr = match cached {
            Some(p) => p,
            None => match self.driver_alloc(n) {
                Ok(p) => Ok(p),
                // Out of memory with buffers parked in the cache: hand them back and retry.
                Err(_) if self.release_cached_blocks() > 0 => self.driver_alloc(n),
                Err(e) => Err(e),
            }
            .map_err(|e| anyhow!("cuda: allocating {bytes} bytes: {e:?}"))?,
        };
        let live = self.inner.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.inner.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CudaStorage {
            ptr,
            bytes,
            inner: self.inner.clone(),
        })
    }

    fn driver_alloc(&self, n: usize) -> Result<sys::CUdeviceptr, drv::DriverError> {
        // SAFETY: a live stream; the memory is only used on it and freed in Drop (or parked in
        // the block cache and freed by `release_cached_blocks`).
        self.inner.host_timed(HostCall::Alloc, || unsafe {
            if self.inner.ctx.has_async_alloc() {
                drv::malloc_async(self.inner.cu_stream(), n)
            } else {
                drv::malloc_sync(n)
            }
        })
    }

    /// Frees every buffer waiting in the block cache; returns how many bytes that was.
    fn release_cached_blocks(&self) -> usize {
        let mut cache = self.inner.blocks.lock().unwrap();
        let stream = self.inner.cu_stream();
        for (_, ptrs) in cache.free.drain() {
            for p in ptrs {
                // SAFETY: a buffer of this stream that nothing references any more.
                let _ = unsafe { drv::free_async(p, stream) };
            }
        }
        std::mem::take(&mut cache.bytes)
    }

    /// `ops::scratch`: a tensor left unwritten.
    pub fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.empty(shape, dtype)
    }

    fn empty(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let s = self.alloc(n * dtype.size())?;
        Ok(Tensor::from_parts(
            shape.to_vec(),
            dtype,
            self.device(),
            Storage::Cuda(s),
        ))
    }

    fn memset0(&self, s: &CudaStorage) -> Result<()> {
        if s.bytes == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside the allocation; stream-ordered.
        unsafe { drv::memset_d8_async(s.ptr, 0, s.bytes, self.inner.cu_stream()) }
            .map_err(|e| anyhow!("cuda: memset: {e:?}"))
    }

    /// Host-to-device copy without a host sync for small buffers (pinned staging ring).
    fn htod(&self, dst: &CudaStorage, bytes: &[u8]) -> Result<()> {
        self.inner
            .host_timed(HostCall::Upload, || self.htod_untimed(dst, bytes))
    }

    fn htod_untimed(&self, dst: &CudaStorage, bytes: &[u8]) -> Result<()> {
        ensure!(bytes.len() <= dst.bytes, "upload past the buffer");
        if bytes.is_empty() {
            return Ok(());
        }
        self.inner.bind()?;
        let stream = self.inner.cu_stream();
        if bytes.len() > STAGING_MAX {
            // SAFETY: `bytes` lives across the call; pageable copies are staged by the driver
            // before this returns.
            return unsafe { drv::memcpy_htod_async(dst.ptr, bytes, stream) }
                .map_err(|e| anyhow!("cuda: upload: {e:?}"));
        }
        let mut pool = self.inner.staging.lock().unwrap();
        let mut slot = None;
        for (i, s) in pool.iter_mut().enumerate() {
            if s.cap < bytes.len() {
                continue;
            }
            // SAFETY: a live event of this backend.
            if !s.pending || unsafe { drv::event::query(s.event) }.is_ok() {
                s.pending = false;
                slot = Some(i);
                break;
            }
        }
        let i = match slot {
            Some(i) => i,
            None if pool.len() >= 64 => {
                // Bounded pool: wait for the oldest copy (only under a flood of uploads).
                let i = pool.iter().position(|s| s.cap >= bytes.len()).unwrap_or(0);
                // SAFETY: a live event.
                unsafe { drv::event::synchronize(pool[i].event) }
                    .map_err(|e| anyhow!("cuda: event sync: {e:?}"))?;
                if pool[i].cap < bytes.len() {
                    let old = pool.remove(i);
                    // SAFETY: its copy has completed.
                    unsafe {
                        let _ = drv::free_host(old.ptr as *mut c_void);
                        let _ = drv::event::destroy(old.event);
                    }
                    pool.push(self.new_staging(bytes.len())?);
                    pool.len() - 1
                } else {
                    pool[i].pending = false;
                    i
                }
            }
            None => {
                pool.push(self.new_staging(bytes.len())?);
                pool.len() - 1
            }
        };
        let s = &mut pool[i];
        // SAFETY: `s.ptr` is pinned memory of `s.cap >= len` bytes not used by any pending copy;
        // the event marks when the copy has read it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.ptr, bytes.len());
            sys::cuMemcpyHtoDAsync_v2(dst.ptr, s.ptr as *const c_void, bytes.len(), stream)
                .result()
                .map_err(|e| anyhow!("cuda: upload: {e:?}"))?;
            drv::event::record(s.event, stream).map_err(|e| anyhow!("cuda: event: {e:?}"))?;
        }
        s.pending = true;
        Ok(())
    }

    fn new_staging(&self, len: usize) -> Result<Staging> {
        let cap = len.next_power_of_two().max(64 << 10);
        // SAFETY: plain pinned allocation, freed in Inner::drop.
        let ptr = unsafe { drv::malloc_host(cap, 0) }
            .map_err(|e| anyhow!("cuda: pinned alloc: {e:?}"))? as *mut u8;
        let event = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| anyhow!("cuda: event: {e:?}"))?;
        Ok(Staging {
            ptr,
            cap,
            event,
            pending: false,
        })
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaStorage> {
        let s = self.alloc(v.len() * 4)?;
        self.htod(&s, bytemuck::cast_slice(v))?;
        Ok(s)
    }

    pub fn upload(&self, data: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = self.empty(shape, dtype)?;
        if let Storage::Cuda(s) = t.storage() {
            match dtype {
                DType::F32 => self.htod(s, bytemuck::cast_slice(data))?,
                DType::BF16 => {
                    let v: Vec<half::bf16> =
                        data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    self.htod(s, bytemuck::cast_slice(&v))?
                }
            }
        }
        Ok(t)
    }

    /// Raw bytes to the device (quantized weights).
    pub fn upload_bytes(&self, bytes: &[u8]) -> Result<DeviceBytes> {
        let buf = self.alloc(bytes.len())?;
        self.htod(&buf, bytes)?;
        Ok(DeviceBytes {
            buf,
            len: bytes.len(),
        })
    }

    /// The address of at least `n` zeroed u32 counters (grown as needed; a kernel that counts
    /// in them sets each back to zero before it ends, and kernels run one at a time on the
    /// stream).
    pub(crate) fn slice_counts(&self, n: usize) -> Result<u64> {
        let mut held = self
            .slice_counts
            .lock()
            .map_err(|_| anyhow!("slice counters poisoned"))?;
        if held.as_ref().is_none_or(|c| c.numel() < n) {
            // f32 zeros are u32 zeros: the same 4 bytes.
            *held = Some(self.zeros(&[n.next_power_of_two().max(1024)], DType::F32)?);
        }
        cuda_ptr(held.as_ref().expect("just set"))
    }

    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = self.empty(shape, dtype)?;
        if let Storage::Cuda(s) = t.storage() {
            self.memset0(s)?;
        }
        Ok(t)
    }

    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside live allocations of this context; stream-ordered.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.inner.cu_stream()) }
            .map_err(|e| anyhow!("cuda: copy: {e:?}"))
    }

    pub fn copy(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.empty(x.shape(), x.dtype())?;
        self.dtod(cuda_ptr(&y)?, cuda_ptr(x)?, x.numel() * x.dtype().size())?;
        Ok(y)
    }

    pub fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        if x.dtype() == dtype {
            return self.copy(x);
        }
        let y = self.empty(x.shape(), dtype)?;
        let n = x.numel();
        self.launch_n(
            "lf_cast",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::P(cuda_ptr(&y)?),
                dt(dtype),
                Arg::I64(n as i64),
            ],
        )?;
        Ok(y)
    }

    // --------------------------------------------------------------------------------------------
    // Kernels

    fn function(&self, name: &'static str) -> Result<sys::CUfunction> {
        if let Some(f) = self.inner.funcs.lock().unwrap().get(name) {
            return Ok(f.0);
        }
        self.inner.bind()?;
        let mname = compile::module_of(name);
        let module = {
            let mut mods = self.inner.modules.lock().unwrap();
            match mods.get(mname) {
                Some(m) => m.0,
                None => {
                    let src = compile::module_source(mname)?;
                    let arch = compile::module_arch(mname, &self.inner.arch);
                    let bin = compile::compile(mname, &src, &arch, true)
                        .with_context(|| format!("compiling kernel module {mname}"))?;
                    // SAFETY: `bin` is a complete CUBIN image for this device's architecture.
                    let m = unsafe { drv::module::load_data(bin.as_ptr() as *const c_void) }
                        .map_err(|e| anyhow!("cuda: loading module {mname}: {e:?}"))?;
                    mods.insert(mname, Module(m));
                    m
                }
            }
        };
        let cname = CString::new(name)?;
        // SAFETY: a loaded module and a NUL-terminated name.
        let f = unsafe { drv::module::get_function(module, cname) }
            .map_err(|e| anyhow!("cuda: kernel {name} not found: {e:?}"))?;
        if compile::attention_part(mname).is_some() {
            // Version 1 needs about 88 KB (head_dim 128); the head_dim 256 kernels about 200 KB.
            let want = self.attn_smem_limit() as i32;
            ensure!(
                want >= Self::attn_smem("dq", 128) as i32,
                "cuda: the device allows only {} bytes of shared memory per block",
                self.inner.smem_optin
            );
            // SAFETY: a valid function; the value is the device's opt-in limit.
            unsafe {
                drv::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    want,
                )
            }
            .map_err(|e| anyhow!("cuda: shared-memory limit of {name}: {e:?}"))?;
        }
        self.inner.funcs.lock().unwrap().insert(name, Func(f));
        Ok(f)
    }

    fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        // Each argument's bytes in an 8-byte aligned box; the driver copies them at launch.
        let mut boxes: Vec<Box<[u64]>> = Vec::with_capacity(args.len());
        for a in args {
            let b: Box<[u64]> = match a {
                Arg::P(v) | Arg::U64(v) => Box::new([*v]),
                Arg::I64(v) => Box::new([*v as u64]),
                Arg::F64(v) => Box::new([v.to_bits()]),
                Arg::I32(v) => Box::new([*v as u32 as u64]),
                Arg::F32(v) => Box::new([v.to_bits() as u64]),
                Arg::Mask(m) => Box::new([
                    m.ranges,
                    m.pos,
                    m.kt_min,
                    m.kt_max,
                    m.tile_flags,
                    m.window as u32 as u64,
                ]),
            };
            boxes.push(b);
        }
        let mut ptrs: Vec<*mut c_void> = boxes
            .iter_mut()
            .map(|b| b.as_mut_ptr() as *mut c_void)
            .collect();
        self.inner.bind()?;
        self.profiled(
            || name.to_string(),
            || {
                // SAFETY: `f` is a kernel of this context whose parameter list matches `args`
                // (each call site mirrors the kernel's signature; 4-byte scalars sit in the low
                // bytes of their box, little-endian); the pointers are live device buffers.
                self.inner
                    .host_timed(HostCall::Launch, || unsafe {
                        drv::launch_kernel(
                            f,
                            grid,
                            (block, 1, 1),
                            smem,
                            self.inner.cu_stream(),
                            &mut ptrs,
                        )
                    })
                    .map_err(|e| anyhow!("cuda: launching {name}: {e:?}"))
            },
        )
    }

    /// Grid-stride launch over `n` elements.
    fn launch_n(&self, name: &'static str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = self.grid_blocks(n.div_ceil(256)) as u32;
        self.launch(name, (blocks, 1, 1), 256, 0, args)
    }

    /// Blocks of a grid-stride launch over `work` blocks' worth of work (`launch_n` and
    /// `launch_multi` size their grids so; the in-order sums size their partials by it).
    fn grid_blocks(&self, work: usize) -> usize {
        work.min(self.inner.sm_count as usize * 16)
    }

    /// Runs `f` `iters` times between two events and returns the mean milliseconds per run
    /// (a sync point; for benchmarks and the parity report).
    pub fn time_ms(&self, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f32> {
        self.inner.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let e0 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
        let e1 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
        let stream = self.inner.cu_stream();
        // SAFETY: live events recorded on our stream and destroyed after use.
        let r = (|| unsafe {
            drv::event::record(e0, stream).map_err(|e| anyhow!("{e:?}"))?;
            for _ in 0..iters.max(1) {
                f()?;
            }
            drv::event::record(e1, stream).map_err(|e| anyhow!("{e:?}"))?;
            drv::event::synchronize(e1).map_err(|e| anyhow!("{e:?}"))?;
            drv::event::elapsed(e0, e1).map_err(|e| anyhow!("{e:?}"))
        })();
        // SAFETY: the events are complete.
        unsafe {
            let _ = drv::event::destroy(e0);
            let _ = drv::event::destroy(e1);
        }
        Ok(r? / iters.max(1) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::{cap_refusal, eighth_octave_up};

    /// An allocation that would take the live bytes past either cap is refused, naming the cap
    /// and its figures; one that lands exactly on a cap, or with no cap, goes ahead. The text is
    /// what `is_out_of_memory` recognises once `alloc` wraps it.
    #[test]
    fn allocations_past_a_cap_are_refused_as_out_of_memory() {
        assert_eq!(cap_refusal(90, 10, None, Some(100)), None);
        assert_eq!(cap_refusal(90, 11, None, None), None);
        let limit = cap_refusal(90, 11, None, Some(100)).unwrap();
        assert_eq!(limit, "memory_limit: 90 bytes live of 100");
        let env = cap_refusal(90, 11, Some(95), Some(200)).unwrap();
        assert!(env.starts_with("LORAFIT_DEVICE_CAP_GIB"), "{env}");
        let err = anyhow::anyhow!("cuda: allocating 11 bytes: CUDA_ERROR_OUT_OF_MEMORY ({limit})");
        assert!(crate::tensor::is_out_of_memory(&err));
    }

    #[test]
    fn eighth_octave_rounding_is_within_an_eighth_and_idempotent() {
        for d in [1, 16, 64, 1536, 4096, 14336] {
            assert_eq!(eighth_octave_up(d), d);
        }
        assert_eq!(eighth_octave_up(8960), 9216);
        assert_eq!(eighth_octave_up(65), 72);
        assert_eq!(eighth_octave_up(151_936), 163_840);
        for d in 1..5000u64 {
            let b = eighth_octave_up(d);
            assert!(b >= d && (b - d) * 8 < d.max(64), "{d} -> {b}");
            assert_eq!(eighth_octave_up(b), b, "a rounded value rounds to itself");
        }
    }
    /// Whether this process should see an NVIDIA GPU, judged without the code under test: the
    /// kernel driver exposes a device node (`/dev/nvidiaN`; a container gets only its own) and
    /// `CUDA_VISIBLE_DEVICES` does not hide every device.
    fn gpu_present() -> bool {
        let node = std::fs::read_dir("/dev").is_ok_and(|d| {
            d.flatten().any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
        });
        let hidden = std::env::var("CUDA_VISIBLE_DEVICES")
            .is_ok_and(|v| matches!(v.trim(), "" | "-1" | "NoDevFiles"));
        node && !hidden
    }

    /// With a GPU, opening CUDA succeeds. Without one, it is an error (not a panic) whose whole
    /// message says what is missing and what to do.
    #[test]
    fn cuda_errors_cleanly_without_gpu() {
        let opened = crate::tensor::Device::cuda(0);
        if gpu_present() {
            if let Err(e) = &opened {
                panic!("this machine has a GPU, but Device::cuda(0) failed: {e:#}");
            }
            return;
        }
        let msg = match opened {
            // A GPU this check does not know how to see (nothing to assert about errors).
            Ok(_) => return,
            Err(e) => format!("{e:#}"),
        };
        // SAFETY: probing only opens the library.
        if !unsafe { super::sys::is_culib_present() } {
            assert_eq!(
                msg,
                "CUDA is not available: the NVIDIA driver library (libcuda.so.1) was not found; \
                 install the NVIDIA driver on a machine with an NVIDIA GPU, or run on the CPU \
                 (--device cpu)"
            );
        } else {
            // A driver without a GPU: the driver's own error sits between fixed words.
            let (head, tail) = (
                "CUDA device 0 could not be opened (",
                "); check that a GPU is present and visible to this process (nvidia-smi, \
                 CUDA_VISIBLE_DEVICES), or run on the CPU (--device cpu)",
            );
            assert!(
                msg.starts_with(head) && msg.ends_with(tail) && msg.len() > head.len() + tail.len(),
                "{msg}"
            );
        }
    }
}
