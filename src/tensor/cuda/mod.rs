//! The CUDA backend: one context and one stream on one GPU, bf16 storage with fp32 accumulation,
//! kernels compiled by NVRTC on first use (see `compile`), matrix products through cuBLASLt
//! (fp32 compute, each shape's algorithm chosen by timing: see `gemm`). Memory is stream-ordered (`cuMemAllocAsync`) and counted
//! (live and peak bytes); small host-to-device copies (token ids, masks) go through pinned staging
//! buffers so no op waits for the GPU. Downloads (`to_vec`, the sums of squares) are the only sync
//! points.
//!
//! Everything here talks to the driver through cudarc's thin `result`/`sys` layers, so memory,
//! launches and lifetimes are explicit. cudarc loads the driver with `dlopen` and panics when the
//! library is missing; `CudaBackend::new` turns that into an error.

mod cce;
pub mod compile;
mod gemm;

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
}

/// A device buffer (stream-ordered allocation, freed on drop, counted in `MemoryStats`).
pub struct CudaStorage {
    ptr: sys::CUdeviceptr,
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
pub const OBJ_STATS: usize = 8;
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

fn module_of(func: &str) -> &'static str {
    if func.starts_with("lf_attn") {
        "attention"
    } else if func.starts_with("lf_cce") {
        "cce"
    } else if func.starts_with("lf_deq") {
        "dequant"
    } else if func.starts_with("lf_obj") {
        "objective"
    } else {
        "elementwise"
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

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
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
            })
        })?;
        Ok(Arc::new_cyclic(|me| CudaBackend {
            me: me.clone(),
            inner: Arc::new(inner),
            gemms: Mutex::new(None),
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
        let mname = module_of(name);
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
        if mname == "attention" {
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
        let blocks = n.div_ceil(256).min(self.inner.sm_count as usize * 16) as u32;
        self.launch(name, (blocks, 1, 1), 256, 0, args)
    }

    // --------------------------------------------------------------------------------------------
    // GEMM

    pub fn matmul(
        &self,
        a: &Tensor,
        ta: bool,
        b: &Tensor,
        tb: bool,
        alpha: f32,
        out_dtype: DType,
    ) -> Result<Tensor> {
        let (ar, ac) = a.rows_cols();
        let (br, bc) = b.rows_cols();
        let m = if ta { ac } else { ar };
        let n = if tb { br } else { bc };
        let mut c = self.empty(&[m, n], out_dtype)?;
        self.matmul_acc(&mut c, a, ta, b, tb, alpha, 0.0)?;
        Ok(c)
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
        let (m, k, n) = super::matmul_dims(c, a, ta, b, tb)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.scale(c, beta);
        }
        // Supported directly: bf16 x bf16 -> bf16 | f32, and f32 x f32 -> f32.
        let direct = matches!(
            (a.dtype(), b.dtype(), c.dtype()),
            (DType::BF16, DType::BF16, _) | (DType::F32, DType::F32, DType::F32)
        );
        if !direct {
            // Mixed operands: widen to f32 (lossless), then accumulate into c.
            let a32 = a.to_dtype(DType::F32)?;
            let b32 = b.to_dtype(DType::F32)?;
            if c.dtype() == DType::F32 {
                return self.matmul_acc(c, &a32, ta, &b32, tb, alpha, beta);
            }
            let mut tmp = self.empty(&[m, n], DType::F32)?;
            self.matmul_acc(&mut tmp, &a32, ta, &b32, tb, alpha, 0.0)?;
            if beta != 1.0 {
                self.scale(c, beta)?;
            }
            return self.add_assign(c, &tmp, 1.0);
        }
        self.inner.bind()?;
        let dname = |d: DType| match d {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
        };
        let c_dtype = c.dtype();
        let pname = || {
            format!(
                "gemm {}->{} {}{} {m}x{n}x{k}",
                dname(a.dtype()),
                dname(c_dtype),
                if ta { "T" } else { "N" },
                if tb { "T" } else { "N" }
            )
        };
        self.profiled(pname, || {
            self.gemm(c, (a, ta), (b, tb), (m, k, n), (alpha, beta))
        })
    }

    // --------------------------------------------------------------------------------------------
    // Ops

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
        // bf16 with an even half: two pairs per thread (that kernel takes no dtype flag).
        if x.dtype() == DType::BF16 && half.is_multiple_of(2) {
            args.remove(1);
            self.launch_n("lf_rope_bf16x2", t * n_heads * half / 2, &args)?;
        } else {
            self.launch_n("lf_rope", t * n_heads * half, &args)?;
        }
        Ok(y)
    }

    /// Uploads the mask as one buffer: ranges (16 B per query), positions, then per-64-key-tile
    /// min and max positions; returns the buffer and the kernel argument pointing into it.
    fn upload_mask(&self, mask: &AttnMask) -> Result<(CudaStorage, MaskArg)> {
        let t = mask.len();
        let tiles = t.div_ceil(KEY_TILE).max(1);
        let off_pos = t * 16;
        let off_min = (off_pos + t * 4).next_multiple_of(16);
        let off_max = (off_min + tiles * 4).next_multiple_of(16);
        let off_flags = (off_max + tiles * 4).next_multiple_of(16);
        let total = off_max + tiles * 4;
        let mut buf = vec![0u8; total];
        for (i, r) in mask.ranges.iter().enumerate() {
            buf[i * 16..i * 16 + 16].copy_from_slice(bytemuck::cast_slice(r));
        }
        buf[off_pos..off_pos + t * 4].copy_from_slice(bytemuck::cast_slice(&mask.positions));
        for tile in 0..tiles {
            let ps = &mask.positions[(tile * KEY_TILE).min(t)..((tile + 1) * KEY_TILE).min(t)];
            let mn = ps.iter().copied().min().unwrap_or(0);
            let mx = ps.iter().copied().max().unwrap_or(0);
            buf[off_min + tile * 4..off_min + tile * 4 + 4].copy_from_slice(&mn.to_ne_bytes());
            buf[off_max + tile * 4..off_max + tile * 4 + 4].copy_from_slice(&mx.to_ne_bytes());
        }
        // The per-tile visibility table follows, filled on the device (lf_attn_tile_flags).
        let s = self.alloc(off_flags + tiles * tiles)?;
        self.htod(&s, &buf)?;
        let window = match mask.window {
            None => -1,
            Some(w) => w.min(i32::MAX as u32) as i32,
        };
        let arg = MaskArg {
            ranges: s.ptr,
            pos: s.ptr + off_pos as u64,
            kt_min: s.ptr + off_min as u64,
            kt_max: s.ptr + off_max as u64,
            tile_flags: s.ptr + off_flags as u64,
            window,
        };
        if t > 0 {
            self.launch(
                "lf_attn_tile_flags",
                (tiles as u32, tiles.div_ceil(4) as u32, 1),
                128,
                0,
                &[Arg::Mask(arg), Arg::I32(t as i32), Arg::P(arg.tile_flags)],
            )?;
        }
        Ok((s, arg))
    }

    fn attn_check(&self, q: &Tensor, k: &Tensor, v: &Tensor, s: &AttnShape) -> Result<usize> {
        ensure!(
            q.dtype() == DType::BF16 && k.dtype() == DType::BF16 && v.dtype() == DType::BF16,
            "cuda attention takes bf16 q, k, v"
        );
        ensure!(
            q.dim(-1) == s.n_heads * s.head_dim && k.dim(-1) == s.n_kv_heads * s.head_dim,
            "attention: q {:?} / k {:?} do not match {s:?}",
            q.shape(),
            k.shape()
        );
        ensure!(k.shape() == v.shape(), "attention: k and v differ");
        ensure!(
            s.softcap.is_none_or(|c| c.is_finite() && c > 0.0),
            "attention: softcap {:?} must be positive",
            s.softcap
        );
        let hdp = match s.head_dim {
            0 => bail!("attention: head_dim 0"),
            1..=16 => 16,
            17..=32 => 32,
            33..=64 => 64,
            65..=96 => 96,
            97..=128 => 128,
            // Versions 2 (forward, dQ, dK/dV) only; `attn2` says where they do not apply.
            256 => 256,
            d => bail!("cuda attention supports head_dim up to 128 and 256, got {d}"),
        };
        Ok(hdp)
    }

    /// The dynamic shared memory an attention kernel may use (the limit `function` sets).
    fn attn_smem_limit(&self) -> u32 {
        (self.inner.smem_optin - 1024).max(0) as u32
    }

    /// The kernel's capped form (`…_cap`: scores `c·tanh(s/c)`) where the shape has a softcap.
    fn attn_cap_name(name: &'static str, s: &AttnShape) -> &'static str {
        if s.softcap.is_none() {
            return name;
        }
        macro_rules! caps {
            ($($n:literal),* $(,)?) => {
                match name {
                    $($n => concat!($n, "_cap"),)*
                    other => panic!("attention kernel {other} has no capped form"),
                }
            };
        }
        caps!(
            "lf_attn_fwd_16",
            "lf_attn_fwd_32",
            "lf_attn_fwd_64",
            "lf_attn_fwd_96",
            "lf_attn_fwd_128",
            "lf_attn_bwd_dq_16",
            "lf_attn_bwd_dq_32",
            "lf_attn_bwd_dq_64",
            "lf_attn_bwd_dq_96",
            "lf_attn_bwd_dq_128",
            "lf_attn_bwd_dkdv_16",
            "lf_attn_bwd_dkdv_32",
            "lf_attn_bwd_dkdv_64",
            "lf_attn_bwd_dkdv_96",
            "lf_attn_bwd_dkdv_128",
            "lf_attn2_fwd_64",
            "lf_attn2_fwd_128",
            "lf_attn2_fwd_256",
            "lf_attn2_dq_64",
            "lf_attn2_dq_128",
            "lf_attn2_dq_256",
            "lf_attn2_dkdv_64",
            "lf_attn2_dkdv_128",
            "lf_attn2_dkdv_256",
            "lf_attn3_fwd_64",
            "lf_attn3_fwd_128",
            "lf_attn4_bwd_64",
            "lf_attn4_bwd_128",
            "lf_attn5_fwd_128",
            "lf_attn5_bwd_128",
            "lf_attn6_bwd_256",
        )
    }

    fn attn_smem(kind: &str, hdp: usize) -> u32 {
        let sq = hdp + 8;
        let b = match kind {
            "fwd" => (64 * sq + 64 * sq + hdp * (64 + 8)) * 2 + 64 * 4,
            "dq" => (2 * 64 * sq + 2 * 64 * sq + hdp * (64 + 8)) * 2 + 64 * 4,
            _ => (2 * 64 * sq + 2 * 32 * sq + 2 * hdp * (32 + 8)) * 2 + 32 * (4 + 4 + 16 + 4),
        };
        b as u32
    }

    /// The version 2+ kernel for `kind` ("fwd", "dq", "dkdv" or the one-pass "bwd") and its launch,
    /// where one serves this shape and its shared memory fits the device (the attention kernels'
    /// limit set in `function`). These (ldmatrix, cp.async double buffering) serve head_dim 64 and
    /// 128, version 1 the rest; `LORAFIT_ATTN_V1=1` forces version 1 everywhere (for comparison).
    fn attn2(&self, kind: &str, s: &AttnShape, t: usize) -> Option<AttnKernel> {
        // The forward's two-m-tile kernel (4 warps per 128 rows, two blocks per SM) is faster once
        // the grid fills the device several times over (32 heads at 4K: 16% faster, at 16K:
        // 19%); with few blocks the 8-warp kernel's finer waves win (12 heads at 4.6K: 23%).
        let wide = match self.inner.attn_fwd_version.load(Ordering::Relaxed) {
            2 => false,
            3 => true,
            _ => t.div_ceil(128) * s.n_heads >= 4 * self.inner.sm_count as usize,
        };
        let (name, threads, rows) = Self::attn2_fn(kind, s, wide)?;
        let limit = self.attn_smem_limit();
        // Version 5 forward: Q and two K and two V tiles (128 x 128 bf16 each), eight mbarriers
        // (64 bytes), the tile flags, and room to align to 1024 bytes.
        let fwd5_smem =
            (128 * 128 * 2 * 5 + 64 + t.div_ceil(128).next_multiple_of(16) + 1024) as u32;
        if kind == "fwd"
            && s.head_dim == 128
            && self.inner.arch == "sm_90"
            && !matches!(self.inner.attn_fwd_version.load(Ordering::Relaxed), 2 | 3)
            && fwd5_smem as i64 <= limit as i64
        {
            // Version 5: wgmma, 128 query rows per block, two 128-key K and V buffers each.
            return Some(AttnKernel {
                name: "lf_attn5_fwd_128",
                threads: 256,
                grid: (t.div_ceil(128) as u32, s.n_heads as u32, 1),
                smem: fwd5_smem,
            });
        }
        if name == "lf_attn4_bwd_128"
            && self.wgmma_backward()
            && Self::attn5_smem(t) as i64 <= limit as i64
        {
            return Some(AttnKernel {
                name: "lf_attn5_bwd_128",
                threads: 256,
                grid: (t.div_ceil(128) as u32, s.n_heads as u32, 1),
                smem: Self::attn5_smem(t),
            });
        }
        let smem = Self::attn2_smem(kind, s.head_dim, t);
        // dK/dV at head_dim 256: one block per head-dim half.
        let z = if name == "lf_attn2_dkdv_256" { 2 } else { 1 };
        (smem as i64 <= limit as i64).then_some(AttnKernel {
            name,
            threads,
            grid: (t.div_ceil(rows) as u32, s.n_heads as u32, z),
            smem,
        })
    }

    /// (kernel, threads per block, rows per block: queries for the forward and dQ, keys for
    /// dK/dV and the one-pass backward).
    fn attn2_fn(kind: &str, s: &AttnShape, wide: bool) -> Option<(&'static str, u32, usize)> {
        static V1: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *V1.get_or_init(|| std::env::var_os("LORAFIT_ATTN_V1").is_some_and(|v| v != "0")) {
            return None;
        }
        Some(match (kind, s.head_dim) {
            ("fwd", 64) if !wide => ("lf_attn2_fwd_64", 256, 128),
            ("fwd", 128) if !wide => ("lf_attn2_fwd_128", 256, 128),
            ("fwd", 256) => ("lf_attn2_fwd_256", 256, 128),
            ("dq", 256) => ("lf_attn2_dq_256", 128, 64),
            ("dkdv", 256) => ("lf_attn2_dkdv_256", 128, 64),
            ("bwd", 256) => ("lf_attn6_bwd_256", 256, 64),
            ("fwd", 64) => ("lf_attn3_fwd_64", 128, 128),
            ("fwd", 128) => ("lf_attn3_fwd_128", 128, 128),
            ("dq", 64) => ("lf_attn2_dq_64", 128, 64),
            ("dq", 128) => ("lf_attn2_dq_128", 128, 64),
            ("dkdv", 64) => ("lf_attn2_dkdv_64", 128, 64),
            ("dkdv", 128) => ("lf_attn2_dkdv_128", 128, 64),
            ("bwd", 64) => ("lf_attn4_bwd_64", 256, 128),
            ("bwd", 128) => ("lf_attn4_bwd_128", 256, 128),
            _ => return None,
        })
    }

    /// Whether version 5's backward (`one_pass`) runs each kv head's query heads in one block:
    /// with GQA, when the (key tile, kv head) grid is at least two waves of the device. Measured
    /// on an H200 (132 SMs), head loop against per-head blocks with partials: 32/8 heads at
    /// T=18432 (1152 blocks) 15.3 against 15.7 ms, at T=4608 (288 blocks) 1.11 against 1.28 ms;
    /// 4/2 heads at T=16384 (256 blocks) even; 8/2 at T=4096 (64 blocks) 0.80 against 0.33 ms.
    /// `set_attention_backward_version` 5 forces per-head blocks, 6 the head loop.
    fn attn5_head_loop(&self, one_pass: Option<&AttnKernel>, s: &AttnShape, t: usize) -> bool {
        if one_pass.is_none_or(|k| k.name != "lf_attn5_bwd_128") || s.n_heads == s.n_kv_heads {
            return false;
        }
        match self.inner.attn_bwd_version.load(Ordering::Relaxed) {
            5 => false,
            6 => true,
            _ => t.div_ceil(128) * s.n_kv_heads >= 2 * self.inner.sm_count as usize,
        }
    }

    /// Whether the one-pass backward at head_dim 128 runs on warpgroup MMAs (version 5): on
    /// sm_90, unless version 4 is forced (`set_attention_backward_version(4)`).
    fn wgmma_backward(&self) -> bool {
        self.inner.arch == "sm_90" && self.inner.attn_bwd_version.load(Ordering::Relaxed) != 4
    }

    /// Dynamic shared memory of version 5's backward: swizzled K and V tiles (128 keys), two
    /// buffers of Q and dO (64 queries), the dS^T tile, lse and D, the staged f32 dQ tile (rows
    /// of 136), the visibility bytes, and 1 KB to align the tiles to 1024 bytes.
    fn attn5_smem(t: usize) -> u32 {
        let tile = 128 * 2;
        ((2 * 128 + 4 * 64) * tile
            + 128 * 64 * 2
            + 4 * 64 * 4
            + 64 * 136 * 4
            + t.div_ceil(64).next_multiple_of(16)
            + 1024) as u32
    }

    /// Dynamic shared memory of a version 2 kernel: padded tiles (row stride hd + 8) plus one
    /// visibility byte per tile.
    fn attn2_smem(kind: &str, hd: usize, t: usize) -> u32 {
        let row = (hd + 8) * 2;
        let b = match kind {
            "fwd" => (128 + 4 * 64) * row + t.div_ceil(64).next_multiple_of(16),
            "dq" => (2 * 64 + 4 * 64) * row + t.div_ceil(64).next_multiple_of(16),
            // Version 6 (head_dim 256): 64-key K and V tiles, two buffers of Q and dO, the P^T and
            // dS^T tiles, lse and D.
            "bwd" if hd == 256 => {
                (2 * 64 + 4 * 64) * row
                    + 2 * 64 * (64 + 8) * 2
                    + 4 * 64 * 4
                    + t.div_ceil(64).next_multiple_of(16)
            }
            // 128-key K and V tiles, two buffers of Q and dO, the dS^T tile, lse and D.
            "bwd" => {
                (2 * 128 + 4 * 64) * row
                    + 128 * (64 + 8) * 2
                    + 4 * 64 * 4
                    + t.div_ceil(64).next_multiple_of(16)
            }
            _ => (2 * 64 + 4 * 64) * row + 4 * 64 * 4 + t.div_ceil(64).next_multiple_of(16),
        };
        b as u32
    }

    fn attn_fn(kind: &str, hdp: usize) -> &'static str {
        macro_rules! pick {
            ($k:literal) => {
                match hdp {
                    16 => concat!("lf_attn_", $k, "_16"),
                    32 => concat!("lf_attn_", $k, "_32"),
                    64 => concat!("lf_attn_", $k, "_64"),
                    96 => concat!("lf_attn_", $k, "_96"),
                    _ => concat!("lf_attn_", $k, "_128"),
                }
            };
        }
        match kind {
            "fwd" => pick!("fwd"),
            "dq" => pick!("bwd_dq"),
            _ => pick!("bwd_dkdv"),
        }
    }

    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        s: AttnShape,
    ) -> Result<(Tensor, Tensor)> {
        let hdp = self.attn_check(q, k, v, &s)?;
        let t = q.dim(0);
        let o = self.empty(q.shape(), q.dtype())?;
        let lse = self.empty(&[s.n_heads, t], DType::F32)?;
        let (_mbuf, marg) = self.upload_mask(mask)?;
        let cap = s.softcap.unwrap_or(1.0);
        if let Some(kn) = self.attn2("fwd", &s, t) {
            return self
                .launch(
                    Self::attn_cap_name(kn.name, &s),
                    kn.grid,
                    kn.threads,
                    kn.smem,
                    &[
                        Arg::P(cuda_ptr(q)?),
                        Arg::P(cuda_ptr(k)?),
                        Arg::P(cuda_ptr(v)?),
                        Arg::P(cuda_ptr(&o)?),
                        Arg::P(cuda_ptr(&lse)?),
                        Arg::Mask(marg),
                        Arg::I32(t as i32),
                        Arg::I32(s.n_heads as i32),
                        Arg::I32(s.n_kv_heads as i32),
                        Arg::F32(s.scale),
                        Arg::F32(cap),
                    ],
                )
                .map(|_| (o, lse));
        }
        ensure!(
            hdp <= 128,
            "cuda attention: no kernel for head_dim {}",
            s.head_dim
        );
        self.launch(
            Self::attn_cap_name(Self::attn_fn("fwd", hdp), &s),
            (t.div_ceil(64) as u32, s.n_heads as u32, 1),
            128,
            Self::attn_smem("fwd", hdp),
            &[
                Arg::P(cuda_ptr(q)?),
                Arg::P(cuda_ptr(k)?),
                Arg::P(cuda_ptr(v)?),
                Arg::P(cuda_ptr(&o)?),
                Arg::P(cuda_ptr(&lse)?),
                Arg::Mask(marg),
                Arg::I32(t as i32),
                Arg::I32(s.n_heads as i32),
                Arg::I32(s.n_kv_heads as i32),
                Arg::I32(s.head_dim as i32),
                Arg::F32(s.scale),
                Arg::F32(cap),
            ],
        )?;
        Ok((o, lse))
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
        let hdp = self.attn_check(q, k, v, &s)?;
        ensure!(
            d_o.dtype() == DType::BF16 && o.dtype() == DType::BF16 && lse.dtype() == DType::F32,
            "attention_bwd: do/o bf16 and lse f32 expected"
        );
        let t = q.dim(0);
        let dq = self.empty(q.shape(), DType::BF16)?;
        let dk = self.empty(k.shape(), DType::BF16)?;
        let dv = self.empty(v.shape(), DType::BF16)?;
        let dd = self.empty(&[s.n_heads, t], DType::F32)?;
        let (_mbuf, marg) = self.upload_mask(mask)?;
        let rows = t * s.n_heads;
        self.launch(
            "lf_attn_bwd_dot",
            ((rows * 32).div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(d_o)?),
                Arg::P(cuda_ptr(o)?),
                Arg::P(cuda_ptr(&dd)?),
                Arg::I32(t as i32),
                Arg::I32(s.n_heads as i32),
                Arg::I32(s.head_dim as i32),
            ],
        )?;
        let common = |out: Vec<Arg>| -> Result<Vec<Arg>> {
            let mut a = vec![
                Arg::P(cuda_ptr(q)?),
                Arg::P(cuda_ptr(k)?),
                Arg::P(cuda_ptr(v)?),
                Arg::P(cuda_ptr(d_o)?),
                Arg::P(cuda_ptr(lse)?),
                Arg::P(cuda_ptr(&dd)?),
            ];
            a.extend(out);
            a.extend([
                Arg::Mask(marg),
                Arg::I32(t as i32),
                Arg::I32(s.n_heads as i32),
                Arg::I32(s.n_kv_heads as i32),
                Arg::I32(s.head_dim as i32),
                Arg::F32(s.scale),
                Arg::F32(s.softcap.unwrap_or(1.0)),
            ]);
            Ok(a)
        };
        let one_pass = match self.inner.attn_bwd_version.load(Ordering::Relaxed) {
            2 => None,
            _ => self.attn2("bwd", &s, t),
        };
        let (dq2, dkdv2) = match &one_pass {
            Some(_) => (None, None),
            None => (self.attn2("dq", &s, t), self.attn2("dkdv", &s, t)),
        };
        ensure!(
            hdp <= 128 || one_pass.is_some() || (dq2.is_some() && dkdv2.is_some()),
            "cuda attention backward: no kernel for head_dim {}",
            s.head_dim
        );
        let cap = |name| Self::attn_cap_name(name, &s);
        // Version 2 takes no head_dim argument (it is the template's).
        let common2 = |out: Vec<Arg>| -> Result<Vec<Arg>> {
            let mut a = common(out)?;
            a.remove(a.len() - 3);
            Ok(a)
        };
        let dq_acc = match &one_pass {
            Some(_) => Some(self.zeros(q.shape(), DType::F32)?),
            None => None,
        };
        if one_pass.is_some() {
            // The one-pass kernel below writes dQ into dq_acc.
        } else if let Some(kn) = dq2 {
            self.launch(
                cap(kn.name),
                kn.grid,
                kn.threads,
                kn.smem,
                &common2(vec![Arg::P(cuda_ptr(&dq)?)])?,
            )?;
        } else {
            self.launch(
                cap(Self::attn_fn("dq", hdp)),
                (t.div_ceil(64) as u32, s.n_heads as u32, 1),
                128,
                Self::attn_smem("dq", hdp),
                &common(vec![Arg::P(cuda_ptr(&dq)?)])?,
            )?;
        }
        // One block per (key tile, query head); with GQA the heads' f32 partials are then summed
        // per kv head (keeps every SM busy when there are few kv heads). Version 5 instead runs a
        // kv head's query heads in one block (no partials, no sum) once its grid of (key tile, kv
        // head) blocks fills the device twice (`attn5_head_loop`).
        let group = s.n_heads / s.n_kv_heads;
        let head_loop = self.attn5_head_loop(one_pass.as_ref(), &s, t);
        let parts = if group > 1 && !head_loop {
            Some((
                self.empty(&[s.n_heads, t, s.head_dim], DType::F32)?,
                self.empty(&[s.n_heads, t, s.head_dim], DType::F32)?,
            ))
        } else {
            None
        };
        let (pk, pv) = match &parts {
            Some((a, b)) => (cuda_ptr(a)?, cuda_ptr(b)?),
            None => (0, 0),
        };
        let outs = vec![
            Arg::P(cuda_ptr(&dk)?),
            Arg::P(cuda_ptr(&dv)?),
            Arg::P(pk),
            Arg::P(pv),
        ];
        if let (Some(kn), Some(acc)) = (&one_pass, &dq_acc) {
            let mut args = common2(outs)?;
            args.insert(6, Arg::P(cuda_ptr(acc)?));
            let mut grid = kn.grid;
            if kn.name == "lf_attn5_bwd_128" {
                // head_loop comes before the softcap.
                args.insert(args.len() - 1, Arg::I32(head_loop as i32));
                if head_loop {
                    grid = (s.n_kv_heads as u32, t.div_ceil(128) as u32, 1);
                }
            }
            self.launch(cap(kn.name), grid, kn.threads, kn.smem, &args)?;
            self.launch_n(
                "lf_attn_dq_finish",
                dq.numel(),
                &[
                    Arg::P(cuda_ptr(acc)?),
                    Arg::P(cuda_ptr(&dq)?),
                    Arg::I64(dq.numel() as i64),
                    Arg::F32(s.scale),
                ],
            )?;
        } else if let Some(kn) = dkdv2 {
            self.launch(cap(kn.name), kn.grid, kn.threads, kn.smem, &common2(outs)?)?;
        } else {
            self.launch(
                cap(Self::attn_fn("dkdv", hdp)),
                (t.div_ceil(64) as u32, s.n_heads as u32, 1),
                128,
                Self::attn_smem("dkdv", hdp),
                &common(outs)?,
            )?;
        }
        if parts.is_some() {
            self.launch_n(
                "lf_attn_dkdv_reduce",
                t * s.n_kv_heads * s.head_dim,
                &[
                    Arg::P(pk),
                    Arg::P(pv),
                    Arg::P(cuda_ptr(&dk)?),
                    Arg::P(cuda_ptr(&dv)?),
                    Arg::I32(t as i32),
                    Arg::I32(s.n_kv_heads as i32),
                    Arg::I32(group as i32),
                    Arg::I32(s.head_dim as i32),
                ],
            )?;
        }
        Ok((dq, dk, dv))
    }

    pub fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.empty(gate.shape(), gate.dtype())?;
        let n = gate.numel();
        if bf16x8(&[gate, up], n) {
            let [a, b, c] = [gate, up, &y].map(|t| cuda_ptr(t).map(Arg::P));
            let args = [a?, b?, c?, Arg::I64(n as i64 / 8)];
            self.launch_n("lf_silu_mul_bf16x8", n / 8, &args)?;
            return Ok(y);
        }
        self.launch_n(
            "lf_silu_mul",
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

    pub fn silu_mul_bwd(
        &self,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let dg = self.empty(gate.shape(), gate.dtype())?;
        let du = self.empty(up.shape(), up.dtype())?;
        self.launch_silu_mul_bwd(dh, gate, up, cuda_ptr(&dg)?, cuda_ptr(&du)?)?;
        Ok((dg, du))
    }

    pub fn silu_mul_bwd_in_place(
        &self,
        dh: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<()> {
        // Each thread reads its elements of gate and up before writing the same elements.
        self.launch_silu_mul_bwd(dh, gate, up, cuda_ptr(gate)?, cuda_ptr(up)?)
    }

    /// The SiLU-gate backward into `dg` / `du` (of `gate`'s / `up`'s dtype and size; they may be
    /// `gate` and `up` themselves).
    fn launch_silu_mul_bwd(
        &self,
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
                "lf_silu_mul_bwd_bf16x8",
                n / 8,
                &[a?, b?, c?, Arg::P(dg), Arg::P(du), Arg::I64(n as i64 / 8)],
            );
        }
        self.launch_n(
            "lf_silu_mul_bwd",
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

    pub fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.empty(gate.shape(), gate.dtype())?;
        let n = gate.numel();
        if bf16x8(&[gate, up], n) {
            let [a, b, c] = [gate, up, &y].map(|t| cuda_ptr(t).map(Arg::P));
            let args = [a?, b?, c?, Arg::I64(n as i64 / 8)];
            self.launch_n("lf_gelu_tanh_mul_bf16x8", n / 8, &args)?;
            return Ok(y);
        }
        self.launch_n(
            "lf_gelu_tanh_mul",
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

    pub fn gelu_tanh_mul_bwd(
        &self,
        dh: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let dg = self.empty(gate.shape(), gate.dtype())?;
        let du = self.empty(up.shape(), up.dtype())?;
        self.launch_gelu_tanh_mul_bwd(dh, gate, up, cuda_ptr(&dg)?, cuda_ptr(&du)?)?;
        Ok((dg, du))
    }

    pub fn gelu_tanh_mul_bwd_in_place(
        &self,
        dh: &Tensor,
        gate: &mut Tensor,
        up: &mut Tensor,
    ) -> Result<()> {
        // Each thread reads its elements of gate and up before writing the same elements.
        self.launch_gelu_tanh_mul_bwd(dh, gate, up, cuda_ptr(gate)?, cuda_ptr(up)?)
    }

    /// The GELU-gate backward into `dg` / `du` (of `gate`'s / `up`'s dtype and size; they may be
    /// `gate` and `up` themselves).
    fn launch_gelu_tanh_mul_bwd(
        &self,
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
                "lf_gelu_tanh_mul_bwd_bf16x8",
                n / 8,
                &[a?, b?, c?, Arg::P(dg), Arg::P(du), Arg::I64(n as i64 / 8)],
            );
        }
        self.launch_n(
            "lf_gelu_tanh_mul_bwd",
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

    /// Side-by-side copies of `xs` (equal rows and dtype, checked by the caller).
    pub fn concat_cols(&self, xs: &[&Tensor], rows: usize, cols: usize) -> Result<Tensor> {
        let y = self.empty(&[rows, cols], xs[0].dtype())?;
        let mut c0 = 0;
        for x in xs {
            let w = x.rows_cols().1;
            self.copy_cols(x, 0, &y, c0, w)?;
            c0 += w;
        }
        Ok(y)
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
        ensure!(
            dlogp.dtype() == DType::F32 && lse.dtype() == DType::F32,
            "logsoftmax_gather_bwd: dlogp and lse must be f32"
        );
        let (rows, v) = logits.rows_cols();
        let d = self.empty(logits.shape(), out_dtype)?;
        let tb = self.upload_u32(targets)?;
        let bx = v.div_ceil(256).min(64) as u32;
        self.launch(
            "lf_logsoftmax_gather_bwd",
            (rows as u32, bx, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(dlogp)?),
                Arg::P(cuda_ptr(logits)?),
                dt(logits.dtype()),
                Arg::P(cuda_ptr(lse)?),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(&d)?),
                dt(out_dtype),
                Arg::I64(v as i64),
            ],
        )?;
        Ok(d)
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
        ensure!(
            dlogp.dtype() == DType::F32 && lse.dtype() == DType::F32,
            "logsoftmax_gather_softcap_bwd: dlogp and lse must be f32"
        );
        let (rows, v) = logits.rows_cols();
        let d = self.empty(logits.shape(), out_dtype)?;
        let tb = self.upload_u32(targets)?;
        let bx = v.div_ceil(256).min(64) as u32;
        self.launch(
            "lf_logsoftmax_gather_softcap_bwd",
            (rows as u32, bx, 1),
            256,
            0,
            &[
                Arg::P(cuda_ptr(dlogp)?),
                Arg::P(cuda_ptr(logits)?),
                dt(logits.dtype()),
                Arg::P(cuda_ptr(lse)?),
                Arg::P(tb.ptr),
                Arg::P(cuda_ptr(&d)?),
                dt(out_dtype),
                Arg::F32(cap),
                Arg::I64(v as i64),
            ],
        )?;
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

    /// Sum of squares (f64 partials; a sync point).
    pub fn sum_sq(&self, x: &Tensor) -> Result<f64> {
        let out = self.alloc(8)?;
        self.memset0(&out)?;
        let n = x.numel();
        self.launch_n(
            "lf_sum_sq",
            n,
            &[
                Arg::P(cuda_ptr(x)?),
                dt(x.dtype()),
                Arg::I64(n as i64),
                Arg::P(out.ptr),
            ],
        )?;
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
        let blocks = n_chunks.min(self.inner.sm_count as u64 * 16) as u32;
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
        let out = self.alloc(8)?;
        self.memset0(&out)?;
        if entries > 0 {
            self.launch_multi(
                "lf_sum_sq_multi",
                &words,
                entries,
                chunks,
                vec![Arg::P(out.ptr)],
            )?;
        }
        Ok(DeviceValues::cuda(out, 1))
    }

    /// One preference objective on the device (`lf_obj_pair`, the CUDA form of the `*_sums`
    /// functions of `train::objectives`): reduces the three parts of `logp` (`(start, len)` of the
    /// chosen prompt, chosen response and rejected response), evaluates objective `kind` with
    /// `params`, and writes `d loss / d logp · weight` for every token of a part (0 elsewhere).
    /// `stats` layout: part sums [0..3], first bad token index or -1 [3], its value [4], the
    /// per-part coefficients [5..8]. `reference`: DPO's reference stats (its sums at [1], [2]).
    /// No sync.
    pub fn pair_objective(
        &self,
        logp: &Tensor,
        parts: [(usize, usize); 3],
        kind: i32,
        params: [f64; 2],
        reference: Option<&DeviceValues>,
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
        let mut args = Vec::with_capacity(14);
        args.push(Arg::P(cuda_ptr(logp)?));
        for (s, l) in parts {
            args.extend([Arg::I32(s as i32), Arg::I32(l as i32)]);
        }
        args.extend([
            Arg::I32(kind),
            Arg::F64(params[0]),
            Arg::F64(params[1]),
            Arg::P(ref_ptr),
            Arg::F32(weight),
            Arg::P(stats.ptr),
            Arg::P(cuda_ptr(&dlogp)?),
        ]);
        self.launch("lf_obj_pair", (1, 1, 1), 1024, 0, &args)?;
        Ok((DeviceValues::cuda(stats, OBJ_STATS), dlogp))
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
