//! Matrix products through cuBLASLt, with each shape's algorithm chosen by timing.
//!
//! cuBLAS's own choice for a shape (`cublasGemmEx`, or cuBLASLt's first heuristic answer) is
//! often not its fastest: at the long-context shapes of a Llama step (18432 tokens) another of
//! the heuristic's candidates runs the 4096×4096 projections 10-11% faster, the 4096×1024 ones
//! 7-19%, and the rank-16 LoRA products 4-12%. So the first product of each shape (dimensions,
//! transposes, leading dimensions, dtypes, whether C is read, pointer alignment) times up to
//! `CANDIDATES` of the heuristic's algorithms on the call's own operands and keeps the fastest;
//! later products of that shape reuse it without any host synchronisation. Tuning happens during
//! the first step, which is a warm-up step in `lorafit bench`. Shapes whose dimensions round to
//! the same values (eight steps an octave, `Key::bucket`) share the algorithm tuned for the first
//! of them, once cuBLASLt confirms it supports the new one: a run over rows of many lengths
//! (packs, mixed pairs) then times candidates once per bucket instead of at every new length,
//! each of which would cost a host synchronisation and the candidates' runs.
//!
//! When C is read (beta ≠ 0) the candidates write into a scratch output, so the call's C is
//! untouched until the chosen algorithm runs. Products too small to be worth timing take the
//! heuristic's first answer, as does every product with tuning off (`set_gemm_tuning(false)`,
//! `TrainConfig::gemm_tuning`: the choice then does not depend on timing noise, so runs are
//! reproducible across processes);
//! `LORAFIT_GEMM_TUNE=log` prints each shape's timings.

use super::{catch, cuda_ptr, dt, eighth_octave_up, Arg, CudaBackend, HostCall};
use crate::tensor::{Cols, DType, Tensor};
use anyhow::{anyhow, ensure, Result};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{result as drv, sys};
use std::collections::HashMap;
use std::ffi::c_void;

/// Rows a block of `lf_lora_round_once` writes (its `LR_ROWS`).
const LORA_ROUND_ROWS: usize = 16;

/// Heuristic candidates timed per shape.
const CANDIDATES: usize = 8;
/// Workspace offered to the algorithms (split-K reductions); NVIDIA recommends 32 MiB on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Products below this many flops take the heuristic's first algorithm without timing.
const TUNE_MIN_FLOPS: f64 = 2e8;

/// What makes two products the same problem for cuBLASLt, in its column-major terms.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    m: u64,
    n: u64,
    k: u64,
    trans_a: bool,
    trans_b: bool,
    lda: i64,
    ldb: i64,
    ldc: i64,
    /// The output's leading dimension: `ldc` where the product writes over C, else D's own
    /// (`gemm_into`: C read from one place, D written to another).
    ldd: i64,
    a_f32: bool,
    c_f32: bool,
    reads_c: bool,
    /// log2 of the smallest alignment (bytes, at most 256) of the A, B and C pointers.
    align_log2: u32,
}

impl Key {
    /// The key of this shape's bucket: dimensions and leading dimensions rounded up
    /// (`eighth_octave_up`), the rest as is.
    fn bucket(&self) -> Key {
        let g = |d: i64| eighth_octave_up(d as u64) as i64;
        Key {
            m: eighth_octave_up(self.m),
            n: eighth_octave_up(self.n),
            k: eighth_octave_up(self.k),
            lda: g(self.lda),
            ldb: g(self.ldb),
            ldc: g(self.ldc),
            ldd: g(self.ldd),
            ..*self
        }
    }
}

/// The descriptors and the chosen algorithm of one `Key`.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Gemms::plan` and not used after this.
        unsafe {
            let _ = lt::cublasLtMatrixLayoutDestroy(self.a);
            let _ = lt::cublasLtMatrixLayoutDestroy(self.b);
            let _ = lt::cublasLtMatrixLayoutDestroy(self.c);
            let _ = lt::cublasLtMatrixLayoutDestroy(self.d);
            let _ = lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// The cuBLASLt handle, its workspace and the plans met so far (owned by `CudaBackend`).
pub(super) struct Gemms {
    handle: lt::cublasLtHandle_t,
    workspace: Tensor,
    plans: HashMap<Key, Plan>,
    /// Per bucket (`Key::bucket`), the algorithm timed fastest for its first shape.
    tuned: HashMap<Key, lt::cublasLtMatmulAlgo_t>,
    tune: bool,
    log: bool,
}

// SAFETY: the handle and descriptors are used only under the backend's Mutex, on its stream.
unsafe impl Send for Gemms {}

impl Drop for Gemms {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `Gemms::new`; no product is queued that uses it after this (the
        // stream is synchronised when the backend drops).
        let _ = unsafe { lt::cublasLtDestroy(self.handle) };
    }
}

fn check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    match s {
        lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        e => Err(anyhow!("{what}: {e:?}")),
    }
}

fn data_type(f32: bool) -> lt::cudaDataType {
    if f32 {
        lt::cudaDataType::CUDA_R_32F
    } else {
        lt::cudaDataType::CUDA_R_16BF
    }
}

/// `cublasOperation_t` as the descriptor stores it (an `int32_t`): `CUBLAS_OP_N` 0, `CUBLAS_OP_T` 1.
fn op(t: bool) -> i32 {
    i32::from(t)
}

/// Creates a layout: `rows × cols` column-major with leading dimension `ld`.
fn layout(f32: bool, rows: u64, cols: u64, ld: i64) -> Result<lt::cublasLtMatrixLayout_t> {
    let mut l = std::ptr::null_mut();
    // SAFETY: an out pointer for a fresh descriptor.
    check(
        unsafe { lt::cublasLtMatrixLayoutCreate(&mut l, data_type(f32), rows, cols, ld) },
        "cublasLtMatrixLayoutCreate",
    )?;
    Ok(l)
}

impl Key {
    /// Descriptors for this key, without an algorithm yet.
    fn descriptors(&self) -> Result<Plan> {
        let mut desc = std::ptr::null_mut();
        // SAFETY: out pointer for a fresh descriptor; attributes are read from live locals.
        unsafe {
            check(
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                ),
                "cublasLtMatmulDescCreate",
            )?;
            for (attr, t) in [
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    self.trans_a,
                ),
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    self.trans_b,
                ),
            ] {
                let o = op(t);
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        desc,
                        attr,
                        &o as *const _ as *const c_void,
                        std::mem::size_of_val(&o),
                    ),
                    "cublasLtMatmulDescSetAttribute",
                )?;
            }
        }
        // Stored shapes: op(A) is m×k, op(B) is k×n.
        let (ar, ac) = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        Ok(Plan {
            desc,
            a: layout(self.a_f32, ar, ac, self.lda)?,
            b: layout(self.a_f32, br, bc, self.ldb)?,
            c: layout(self.c_f32, self.m, self.n, self.ldc)?,
            d: layout(self.c_f32, self.m, self.n, self.ldd)?,
            // SAFETY: plain data; replaced before any use.
            algo: unsafe { std::mem::zeroed() },
        })
    }
}

/// One column-major product `D = alpha op(A) op(B) + beta C` on device pointers.
struct Operands {
    a: u64,
    b: u64,
    c: u64,
    d: u64,
    alpha: f32,
    beta: f32,
}

impl CudaBackend {
    /// The GEMM state, created on first use.
    fn gemms_guard(&self) -> Result<std::sync::MutexGuard<'_, Option<Gemms>>> {
        let mut guard = self.gemms.lock().unwrap();
        if guard.is_none() {
            *guard = Some(Gemms::new(self)?);
        }
        Ok(guard)
    }

    /// Whether each product shape's first call times cuBLASLt's candidates and keeps the fastest
    /// (the default), or takes the heuristic's first choice (reproducible across processes).
    /// Shapes already planned keep their algorithm.
    pub fn set_gemm_tuning(&self, on: bool) -> Result<()> {
        self.gemms_guard()?.as_mut().expect("created").tune = on;
        Ok(())
    }
}

impl Gemms {
    fn new(backend: &CudaBackend) -> Result<Gemms> {
        let handle = catch("cuBLASLt could not be loaded (libcublasLt.so.13)", || {
            let mut h = std::ptr::null_mut();
            // SAFETY: out pointer for a fresh handle.
            check(unsafe { lt::cublasLtCreate(&mut h) }, "cublasLtCreate")?;
            Ok(h)
        })?;
        Ok(Gemms {
            handle,
            workspace: backend.empty(&[WORKSPACE_BYTES / DType::BF16.size()], DType::BF16)?,
            plans: HashMap::new(),
            tuned: HashMap::new(),
            tune: true,
            log: std::env::var("LORAFIT_GEMM_TUNE").is_ok_and(|v| v == "log"),
        })
    }

    /// Queues the product with `plan`'s descriptors and `algo`.
    fn run(
        &self,
        plan: &Plan,
        algo: &lt::cublasLtMatmulAlgo_t,
        o: &Operands,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: live descriptors and buffers of the sizes the layouts state; host scalars.
        check(
            unsafe {
                lt::cublasLtMatmul(
                    self.handle,
                    plan.desc,
                    &o.alpha as *const f32 as *const c_void,
                    o.a as *const c_void,
                    plan.a,
                    o.b as *const c_void,
                    plan.b,
                    &o.beta as *const f32 as *const c_void,
                    o.c as *const c_void,
                    plan.c,
                    o.d as *mut c_void,
                    plan.d,
                    algo,
                    cuda_ptr(&self.workspace)? as *mut c_void,
                    WORKSPACE_BYTES,
                    stream as _,
                )
            },
            "cublasLtMatmul",
        )
    }

    /// A plan for `key` with the algorithm tuned for its bucket, where there is one (tuning on)
    /// and cuBLASLt supports it for this shape within the workspace.
    fn tuned_for(&self, key: &Key) -> Result<Option<Plan>> {
        let Some(algo) = self.tuned.get(&key.bucket()).filter(|_| self.tune) else {
            return Ok(None);
        };
        let mut plan = key.descriptors()?;
        // SAFETY: plain data, filled by the check.
        let mut result: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live handle and descriptors; `algo` and `result` are live locals.
        let status = unsafe {
            lt::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.d,
                algo,
                &mut result,
            )
        };
        if status != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            || result.workspaceSize > WORKSPACE_BYTES
        {
            return Ok(None);
        }
        plan.algo = *algo;
        Ok(Some(plan))
    }

    /// Up to `CANDIDATES` algorithms for `plan`, best first by cuBLASLt's estimate.
    fn candidates(&self, key: &Key, plan: &Plan) -> Result<Vec<lt::cublasLtMatmulAlgo_t>> {
        let mut pref = std::ptr::null_mut();
        let align = 1u32 << key.align_log2;
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            // SAFETY: plain data, filled by the heuristic call below.
            vec![unsafe { std::mem::zeroed() }; CANDIDATES];
        let mut count = 0;
        // SAFETY: fresh preference descriptor; attributes read from live locals; the results
        // array holds CANDIDATES entries.
        unsafe {
            check(
                lt::cublasLtMatmulPreferenceCreate(&mut pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let ws = WORKSPACE_BYTES as u64;
            let mut r = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            );
            use lt::cublasLtMatmulPreferenceAttributes_t as P;
            for attr in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    r = lt::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        attr,
                        &align as *const u32 as *const c_void,
                        4,
                    );
                }
            }
            if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                r = lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.d,
                    pref,
                    results.len() as i32,
                    results.as_mut_ptr(),
                    &mut count,
                );
            }
            let _ = lt::cublasLtMatmulPreferenceDestroy(pref);
            check(r, "cublasLtMatmulAlgoGetHeuristic")?;
        }
        let algos: Vec<_> = results[..count.max(0) as usize]
            .iter()
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if algos.is_empty() {
            return Err(anyhow!("cuBLASLt has no algorithm for {key:?}"));
        }
        Ok(algos)
    }
}

/// Milliseconds between two recorded events, after waiting for the second.
fn elapsed_ms(e0: sys::CUevent, e1: sys::CUevent) -> Result<f32> {
    // SAFETY: both events were recorded on the backend's stream.
    unsafe {
        drv::event::synchronize(e1).map_err(|e| anyhow!("{e:?}"))?;
        drv::event::elapsed(e0, e1).map_err(|e| anyhow!("{e:?}"))
    }
}

/// A row-major matrix operand by address: its first element, dtype, and `ld` elements between
/// rows. A tensor is one (`Mat::of`); so is a block of its rows, which needs no copy.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub ptr: u64,
    pub dtype: DType,
    pub ld: usize,
}

impl Mat {
    /// The whole of `t`, viewed as a matrix.
    pub fn of(t: &Tensor) -> Result<Mat> {
        Ok(Mat {
            ptr: cuda_ptr(t)?,
            dtype: t.dtype(),
            ld: t.rows_cols().1,
        })
    }

    /// The columns of a window, in place: its first element and the whole matrix's row length.
    pub fn cols(w: Cols) -> Result<Mat> {
        let m = Mat::of(w.t)?;
        Ok(Mat {
            ptr: m.ptr + (w.start * m.dtype.size()) as u64,
            ..m
        })
    }

    /// Rows `[from, ..)` of this matrix.
    pub fn rows_from(self, from: usize) -> Mat {
        Mat {
            ptr: self.ptr + (from * self.ld * self.dtype.size()) as u64,
            ..self
        }
    }
}

impl CudaBackend {
    /// Row-major `c = alpha op(a) op(b) + beta c` for bf16 × bf16 → bf16 | f32 and
    /// f32 × f32 → f32, the operands given as `(matrix, transposed)` (the caller checked shapes
    /// `(m, k, n)` and dtypes).
    pub(super) fn gemm(
        &self,
        c: &mut Tensor,
        (a, ta): (&Tensor, bool),
        (b, tb): (&Tensor, bool),
        (m, k, n): (usize, usize, usize),
        (alpha, beta): (f32, f32),
    ) -> Result<()> {
        let c = Mat {
            ld: n,
            ..Mat::of(c)?
        };
        self.gemm_at(
            c,
            (Mat::of(a)?, ta),
            (Mat::of(b)?, tb),
            (m, k, n),
            (alpha, beta),
        )
    }

    /// `gemm` on operands by address (blocks of rows of larger tensors).
    pub(super) fn gemm_at(
        &self,
        c: Mat,
        a: (Mat, bool),
        b: (Mat, bool),
        mkn: (usize, usize, usize),
        ab: (f32, f32),
    ) -> Result<()> {
        self.gemm_into(c, c, a, b, mkn, ab)
    }

    /// `d = alpha op(a) op(b) + beta c` with C read from one place and D written to another
    /// (each with its own leading dimension, one dtype): a copy of C into D before the product
    /// is not needed. `gemm_at` is the case `d == c`.
    pub(super) fn gemm_into(
        &self,
        d: Mat,
        c: Mat,
        (a, ta): (Mat, bool),
        (b, tb): (Mat, bool),
        (m, k, n): (usize, usize, usize),
        (alpha, beta): (f32, f32),
    ) -> Result<()> {
        ensure!(
            d.dtype == c.dtype,
            "gemm_into: C is {:?}, D {:?}",
            c.dtype,
            d.dtype
        );
        let (pa, pb, pc, pd) = (a.ptr, b.ptr, c.ptr, d.ptr);
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's A is our
        // b, its B our a, and its (m, n) our (n, m).
        let align = [pa, pb, pc, pd]
            .iter()
            .map(|p| p.trailing_zeros().min(8))
            .min()
            .unwrap_or(0);
        let key = Key {
            m: n as u64,
            n: m as u64,
            k: k as u64,
            trans_a: tb,
            trans_b: ta,
            lda: b.ld as i64,
            ldb: a.ld as i64,
            ldc: c.ld as i64,
            ldd: d.ld as i64,
            a_f32: a.dtype == DType::F32,
            c_f32: c.dtype == DType::F32,
            reads_c: beta != 0.0,
            align_log2: align,
        };
        let ops = Operands {
            a: pb,
            b: pa,
            c: pc,
            d: pd,
            alpha,
            beta,
        };
        let mut guard = self.gemms_guard()?;
        let g = guard.as_mut().expect("created by gemms_guard");
        if !g.plans.contains_key(&key) {
            let plan = match g.tuned_for(&key)? {
                Some(plan) => plan,
                None => {
                    let (plan, timed) = self.tune_plan(g, &key, &ops, c.dtype)?;
                    if timed {
                        g.tuned.insert(key.bucket(), plan.algo);
                    }
                    plan
                }
            };
            g.plans.insert(key, plan);
        }
        let plan = &g.plans[&key];
        let stream = self.inner.cu_stream();
        self.inner
            .host_timed(HostCall::Gemm, || g.run(plan, &plan.algo, &ops, stream))
            .map_err(|e| anyhow!("{e} ([{m}x{k}]x[{k}x{n}])"))
    }

    /// A plan for `key` with the fastest of the heuristic's candidates on these operands (the
    /// first candidate when tuning is off, the product is small, or scratch memory is short),
    /// and whether the candidates were timed.
    fn tune_plan(
        &self,
        g: &Gemms,
        key: &Key,
        ops: &Operands,
        c_dtype: DType,
    ) -> Result<(Plan, bool)> {
        let mut plan = key.descriptors()?;
        let algos = g.candidates(key, &plan)?;
        plan.algo = algos[0];
        let flops = 2.0 * key.m as f64 * key.n as f64 * key.k as f64;
        if !g.tune || algos.len() == 1 || flops < TUNE_MIN_FLOPS {
            return Ok((plan, false));
        }
        // Candidates write into scratch when they would overwrite the C they read, leaving the
        // call's C as it was (column-major: `n` columns `ldd` apart).
        let scratch = if key.reads_c && ops.d == ops.c {
            match self.empty(&[key.ldd as usize * key.n as usize], c_dtype) {
                Ok(t) => Some(t),
                Err(_) => return Ok((plan, false)),
            }
        } else {
            None
        };
        let trial = Operands {
            d: match &scratch {
                Some(s) => cuda_ptr(s)?,
                None => ops.d,
            },
            ..*ops
        };
        let stream = self.inner.cu_stream();
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let e0 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
        let e1 = drv::event::create(flags).map_err(|e| anyhow!("{e:?}"))?;
        let mut times = Vec::with_capacity(algos.len());
        for algo in &algos {
            // A candidate that fails to launch is skipped (its time stays infinite).
            let mut ms = f32::INFINITY;
            if g.run(&plan, algo, &trial, stream).is_ok() {
                // SAFETY: live events recorded on our stream.
                unsafe { drv::event::record(e0, stream) }.map_err(|e| anyhow!("{e:?}"))?;
                for _ in 0..3 {
                    g.run(&plan, algo, &trial, stream)?;
                }
                // SAFETY: as above.
                unsafe { drv::event::record(e1, stream) }.map_err(|e| anyhow!("{e:?}"))?;
                ms = elapsed_ms(e0, e1)? / 3.0;
            }
            times.push(ms);
        }
        // SAFETY: the events are idle (waited on above).
        unsafe {
            let _ = drv::event::destroy(e0);
            let _ = drv::event::destroy(e1);
        }
        let best = (0..times.len())
            .min_by(|&i, &j| times[i].total_cmp(&times[j]))
            .unwrap_or(0);
        if g.log {
            eprintln!(
                "gemm tune {}x{}x{} {}{} c_f32 {} reads_c {}: heuristic first {:.4} ms, chosen #{best} {:.4} ms ({} candidates: {:?})",
                key.n,
                key.m,
                key.k,
                if key.trans_b { "T" } else { "N" },
                if key.trans_a { "T" } else { "N" },
                key.c_f32,
                key.reads_c,
                times[0],
                times[best],
                times.len(),
                times.iter().map(|t| (t * 1e4).round() / 1e4).collect::<Vec<_>>()
            );
        }
        plan.algo = algos[best];
        Ok((plan, true))
    }
}

/// The products the ops call: shapes checked once, the cuBLASLt path timed per call when
/// profiling.
#[allow(clippy::too_many_arguments)]
impl CudaBackend {
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
        let (m, k, n) = crate::tensor::matmul_dims(c, a, ta, b, tb)?;
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
        let (a_dtype, c_dtype) = (a.dtype(), c.dtype());
        let pname = || product_name(a_dtype, c_dtype, ta, tb, (m, n, k), "");
        self.profiled(pname, || {
            self.gemm(c, (a, ta), (b, tb), (m, k, n), (alpha, beta))
        })
    }
}

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// `ops::matmul_acc_cols` in place, where cuBLASLt takes the windows as they lie: operands
    /// both bf16 (output bf16 or f32) or all f32, and every window's first element and row
    /// length on 16 bytes. Returns false, having done nothing, for any other case.
    pub fn matmul_acc_cols(
        &self,
        c: &mut Tensor,
        cc: std::ops::Range<usize>,
        a: Cols,
        ta: bool,
        b: Cols,
        tb: bool,
        alpha: f32,
        beta: f32,
    ) -> Result<bool> {
        let cw = Cols {
            t: c,
            start: cc.start,
            end: cc.end,
        };
        let Some(([am, bm, cm], (m, k, n))) =
            in_place_operands("matmul_acc_cols", cw, a, ta, b, tb)?
        else {
            return Ok(false);
        };
        self.inner.bind()?;
        let pname = || product_name(a.t.dtype(), cw.t.dtype(), ta, tb, (m, n, k), " (cols)");
        self.profiled(pname, || {
            self.gemm_at(cm, (am, ta), (bm, tb), (m, k, n), (alpha, beta))
        })?;
        Ok(true)
    }
}

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// `ops::matmul_onto`: a new `[m, n]` tensor `beta · c + alpha · op(a) op(b)`, the window `c`
    /// read in place as the product's C and the output its D, where cuBLASLt takes the windows as
    /// they lie (as `matmul_acc_cols`). `None`, having done nothing, for any other case.
    pub fn matmul_onto(
        &self,
        c: Cols,
        a: Cols,
        ta: bool,
        b: Cols,
        tb: bool,
        alpha: f32,
        beta: f32,
    ) -> Result<Option<Tensor>> {
        let Some(([am, bm, cm], (m, k, n))) = in_place_operands("matmul_onto", c, a, ta, b, tb)?
        else {
            return Ok(None);
        };
        if !(n * c.t.dtype().size()).is_multiple_of(16) {
            // D's rows must stay on 16 bytes too.
            return Ok(None);
        }
        self.inner.bind()?;
        let d = self.empty(&[m, n], c.t.dtype())?;
        let pname = || product_name(a.t.dtype(), c.t.dtype(), ta, tb, (m, n, k), " (onto)");
        let dm = Mat::of(&d)?;
        self.profiled(pname, || {
            self.gemm_into(dm, cm, (am, ta), (bm, tb), (m, k, n), (alpha, beta))
        })?;
        Ok(Some(d))
    }
}

/// A product's row in the profile: `gemm bf16->f32 NT 4608x1536x16` and a tag.
fn product_name(
    a: DType,
    c: DType,
    ta: bool,
    tb: bool,
    (m, n, k): (usize, usize, usize),
    tag: &str,
) -> String {
    let name = |d: DType| match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    };
    let t = |x: bool| if x { "T" } else { "N" };
    format!(
        "gemm {}->{} {}{} {m}x{n}x{k}{tag}",
        name(a),
        name(c),
        t(ta),
        t(tb)
    )
}

/// A product's operands `[a, b, c]` and its `(m, k, n)` (`in_place_operands`).
type InPlace = ([Mat; 3], (usize, usize, usize));

/// The operands of a product over column windows as cuBLASLt takes them in place, and its
/// `(m, k, n)`: `None` where it cannot (operands neither both bf16 nor all f32, a window's first
/// element or row length off 16 bytes, an empty product, which cuBLASLt refuses), for the caller's
/// copying path. Mismatched shapes are refused, naming `op`.
fn in_place_operands(
    op: &str,
    c: Cols,
    a: Cols,
    ta: bool,
    b: Cols,
    tb: bool,
) -> Result<Option<InPlace>> {
    let direct = matches!(
        (a.t.dtype(), b.t.dtype(), c.t.dtype()),
        (DType::BF16, DType::BF16, _) | (DType::F32, DType::F32, DType::F32)
    );
    let mats = [Mat::cols(a)?, Mat::cols(b)?, Mat::cols(c)?];
    let aligned = |m: &Mat| m.ptr.is_multiple_of(16) && (m.ld * m.dtype.size()).is_multiple_of(16);
    if !direct || !mats.iter().all(aligned) {
        return Ok(None);
    }
    let ((ar, ac), (br, bc), (cr, cn)) = (a.rows_cols(), b.rows_cols(), c.rows_cols());
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    ensure!(
        k == k2 && (cr, cn) == (m, n),
        "{op}: [{ar}x{ac}]{} x [{br}x{bc}]{} into [{cr}x{cn}]",
        if ta { "ᵀ" } else { "" },
        if tb { "ᵀ" } else { "" }
    );
    if m == 0 || n == 0 || k == 0 {
        return Ok(None);
    }
    Ok(Some((mats, (m, k, n))))
}

/// Ranks up to which `lora_linear_rounded` adds the adapter's product in its rounding kernel
/// (an f32 dot of `r` terms per output on the CUDA cores, cheap beside the output's bytes at small
/// r); above it cuBLAS accumulates the product onto the base output first.
const FUSED_LORA_RANK_MAX: usize = 64;

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// `x Wᵀ + scale · xa Bᵀ` summed in f32 and rounded once to `out_dtype`, `block` rows at a
    /// time: the base GEMM writes a block's f32 sum into a scratch of `block` rows, and
    /// `lf_lora_round_once` adds the rank-r term and stores the block's rows of `y`. Every block
    /// reads its rows of `x` and `xa` in place. The caller checked shapes; x and W are both bf16
    /// or both f32.
    pub fn lora_linear_rounded(
        &self,
        x: &Tensor,
        w: Cols,
        xa: Cols,
        b: &Tensor,
        scale: f32,
        out_dtype: DType,
        block: usize,
    ) -> Result<Tensor> {
        let (t, k) = x.rows_cols();
        let (out, r) = (w.rows_cols().0, b.dim(1));
        let y = self.empty(&[t, out], out_dtype)?;
        // At most 65535 · LORA_ROUND_ROWS rows a block: the kernel's grid has a y dimension of
        // rows / LORA_ROUND_ROWS.
        let block = block.clamp(1, t.clamp(1, 65_535 * LORA_ROUND_ROWS));
        let scratch = self.empty(&[block, out], DType::F32)?;
        let fused = r <= FUSED_LORA_RANK_MAX;
        // cuBLAS's term takes operands of one dtype: mixed ones are widened to f32 (lossless;
        // both are `r` columns wide).
        let widened = if !fused && xa.t.dtype() != b.dtype() {
            Some((
                xa.to_tensor()?.to_dtype(DType::F32)?,
                b.to_dtype(DType::F32)?,
            ))
        } else {
            None
        };
        let (xam, b) = match &widened {
            Some((xa, b)) => (Mat::of(xa)?, b),
            None => (Mat::cols(xa)?, b),
        };
        let (xm, sm) = (Mat::of(x)?, Mat::of(&scratch)?);
        let (wm, bm) = (Mat::cols(w)?, Mat::of(b)?);
        for a in (0..t).step_by(block) {
            let rows = block.min(t - a);
            let name = || format!("gemm lora sum {rows}x{out}x{k} r{r}");
            self.profiled(name, || {
                self.gemm_at(
                    sm,
                    (xm.rows_from(a), false),
                    (wm, true),
                    (rows, k, out),
                    (1.0, 0.0),
                )
            })?;
            if !fused {
                let name = || format!("gemm lora term {rows}x{out}x{r}");
                self.profiled(name, || {
                    self.gemm_at(
                        sm,
                        (xam.rows_from(a), false),
                        (bm, true),
                        (rows, r, out),
                        (scale, 1.0),
                    )
                })?;
            }
            let grid = (
                out.div_ceil(256) as u32,
                rows.div_ceil(LORA_ROUND_ROWS) as u32,
                1,
            );
            self.launch(
                "lf_lora_round_once",
                grid,
                256,
                0,
                &[
                    Arg::P(sm.ptr),
                    Arg::P(xam.rows_from(a).ptr),
                    dt(xam.dtype),
                    Arg::I64(xam.ld as i64),
                    Arg::P(bm.ptr),
                    dt(b.dtype()),
                    Arg::F32(scale),
                    Arg::P(Mat::of(&y)?.rows_from(a).ptr),
                    dt(out_dtype),
                    Arg::I64(rows as i64),
                    Arg::I64(out as i64),
                    Arg::I32(if fused { r as i32 } else { 0 }),
                ],
            )?;
        }
        Ok(y)
    }
}

/// Whether `lora_linear_folded` moves fewer bytes than `lora_linear_rounded` for a `(t, k)` input,
/// `out` outputs and rank `r`. Folding writes each output once in its own dtype where the f32
/// sum's path writes and reads it as f32 first, 8 bytes an output more (bf16 output: an f32 base
/// product, read back by the rounding kernel; f32 output: the rank-r product, read back by the
/// base GEMM's epilogue); it pays for copying the input and the weight into their K-extended
/// operands (about 4 bytes an element each: a read and a write of bf16) and for the `r`
/// (rounded up to 8) extra columns of the product (at about 200 flops a byte of the H200's
/// GEMM rate against its bandwidth). So q, gate, up and o fold on every long sequence; k, v (few
/// outputs) and down (a wide input) do not, nor does decoding's one row.
pub(crate) fn adapter_fold_pays(t: usize, k: usize, out: usize, r: usize) -> bool {
    let (t, k, out) = (t as f64, k as f64, out as f64);
    let extra_k = r.next_multiple_of(8) as f64;
    let saved = 8.0 * t * out;
    let spent = 4.0 * k * (t + out) + 2.0 * t * out * extra_k / 200.0;
    saved > spent
}

/// Whether a projection of `k` inputs and `out` outputs whose frozen weight is stored with room
/// for `cols` adapter columns (`model::weights::ExtendedWeight`) folds its adapter into the base
/// product at any row count: `adapter_fold_pays` without the weight's copy, which such a weight
/// does not need, so that only the input's copy is weighed against the f32 sum.
pub(crate) fn extended_fold_pays(k: usize, out: usize, cols: usize) -> bool {
    let (k, out) = (k as f64, out as f64);
    8.0 * out > 4.0 * k + 2.0 * out * cols as f64 / 200.0
}

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// `x Wᵀ + scale · xa Bᵀ` as one product over a K-extended operand pair,
    /// `[x | xa | 0] · [W | scale · B | 0]ᵀ`: cuBLASLt accumulates both terms in f32 and rounds
    /// the sum once into `out_dtype`, with no f32 sum in memory (`adapter_fold_pays` weighs the
    /// copies against it). `[W | scale · B]` is built once a call (`lora_linear_extended` reads
    /// a weight stored that way), the input's side for at most `budget` bytes of rows at a time
    /// (less the weight's copy). All operands bf16 (the caller checked dtypes and shapes).
    /// `scale · B` is rounded to bf16, exact for a power of two (the default scale is 2); the f32
    /// sum's path multiplies in f32.
    pub fn lora_linear_folded(
        &self,
        x: &Tensor,
        w: Cols,
        xa: Cols,
        b: &Tensor,
        scale: f32,
        out_dtype: DType,
        budget: usize,
    ) -> Result<Tensor> {
        let k = x.rows_cols().1;
        let (out, r) = (w.rows_cols().0, b.dim(1));
        // The adapter's columns padded to 16 bytes, so that rows of both operands stay aligned
        // for cuBLASLt and the packing kernel's vector copies.
        let kd = k + r.next_multiple_of(8);
        let w_ext = self.empty(&[out, kd], DType::BF16)?;
        self.pack_k(Mat::cols(w)?, k, Mat::of(b)?, r, scale, &w_ext, out, None)?;
        let budget = budget.saturating_sub(out * kd * 2);
        self.lora_linear_extended(x, xa, &w_ext, out_dtype, budget)
    }

    /// `lora_linear_folded` with the weight already stored as `[W | scale · B | 0]`
    /// (`w_ext` `[out, kd]`, `kd` at least `k` plus xa's width): only the input's side is
    /// copied, for at most `budget` bytes of rows at a time (at least 2048 rows, which keep the
    /// product efficient).
    pub fn lora_linear_extended(
        &self,
        x: &Tensor,
        xa: Cols,
        w_ext: &Tensor,
        out_dtype: DType,
        budget: usize,
    ) -> Result<Tensor> {
        let (t, k) = x.rows_cols();
        let (out, kd) = w_ext.rows_cols();
        let r = xa.rows_cols().1;
        ensure!(
            k + r <= kd,
            "lora_linear_extended: {k} inputs and {r} adapter columns in a weight {kd} wide"
        );
        let bf = DType::BF16;
        let y = self.empty(&[t, out], out_dtype)?;
        let rows = (budget / (kd * 2)).max(2048).min(t);
        let x_ext = self.empty(&[rows, kd], bf)?;
        let (xm, xam, xem, wem, ym) = (
            Mat::of(x)?,
            Mat::cols(xa)?,
            Mat::of(&x_ext)?,
            Mat::of(w_ext)?,
            Mat::of(&y)?,
        );
        for a in (0..t).step_by(rows) {
            let n = rows.min(t - a);
            self.pack_k(
                xm.rows_from(a),
                k,
                xam.rows_from(a),
                r,
                1.0,
                &x_ext,
                n,
                None,
            )?;
            let name = || format!("gemm lora folded {n}x{out}x{kd} r{r}");
            self.profiled(name, || {
                self.gemm_at(
                    ym.rows_from(a),
                    (xem, false),
                    (wem, true),
                    (n, kd, out),
                    (1.0, 0.0),
                )
            })?;
        }
        Ok(y)
    }

    /// `ops::write_adapter_cols`: written in place through a shared reference; the weight's
    /// other columns are not touched.
    pub fn write_adapter_cols(
        &self,
        w_ext: &Tensor,
        cols: std::ops::Range<usize>,
        at: usize,
        b: &Tensor,
        scale: f32,
    ) -> Result<()> {
        check_adapter_cols(w_ext, &cols, at, b)?;
        let ((out, kd), r) = (w_ext.rows_cols(), b.rows_cols().1);
        let width = cols.len();
        let dst = cuda_ptr(w_ext)? + (cols.start * w_ext.dtype().size()) as u64;
        self.launch_n(
            "lf_write_adapter_cols",
            out * width,
            &[
                Arg::P(cuda_ptr(b)?),
                Arg::I64(r as i64),
                Arg::I64(r as i64),
                Arg::I64(at as i64),
                Arg::F32(scale),
                Arg::P(dst),
                Arg::I64(kd as i64),
                Arg::I64(width as i64),
                Arg::I64((out * width) as i64),
                dt(w_ext.dtype()),
            ],
        )
    }

    /// `[x | xa | 0]`, `[T, kd]`, with 1 in column `one_at`: the K-extended input that every
    /// projection of a shared-input group reads (`ops::pack_input`), all bf16.
    pub fn pack_input(
        &self,
        x: &Tensor,
        xa: Cols,
        kd: usize,
        one_at: Option<usize>,
    ) -> Result<Tensor> {
        let ((t, k), r) = (x.rows_cols(), xa.rows_cols().1);
        let x_ext = self.empty(&[t, kd], DType::BF16)?;
        self.pack_k(Mat::of(x)?, k, Mat::cols(xa)?, r, 1.0, &x_ext, t, one_at)?;
        Ok(x_ext)
    }

    /// Rows `[0, rows)` of `dst` `[·, kd]` = `[a | scale · b | 0]` (`lf_pack_k`), `a` `k` and
    /// `b` `r` columns wide (each with its own row length), all bf16, with 1 in column `one_at`
    /// (past `k + r`).
    fn pack_k(
        &self,
        a: Mat,
        k: usize,
        b: Mat,
        r: usize,
        scale: f32,
        dst: &Tensor,
        rows: usize,
        one_at: Option<usize>,
    ) -> Result<()> {
        let kd = dst.rows_cols().1;
        // 16-byte copies: both rows' starts and a's width on 16 bytes (8 bf16).
        let vec = a.ptr.is_multiple_of(16)
            && cuda_ptr(dst)?.is_multiple_of(16)
            && [k, a.ld, kd].iter().all(|e| e.is_multiple_of(8));
        self.launch(
            "lf_pack_k",
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(a.ptr),
                Arg::I64(a.ld as i64),
                Arg::I64(k as i64),
                Arg::P(b.ptr),
                Arg::I64(b.ld as i64),
                Arg::I64(r as i64),
                Arg::F32(scale),
                Arg::P(cuda_ptr(dst)?),
                Arg::I64(kd as i64),
                Arg::I64(one_at.map_or(-1, |c| c as i64)),
                dt(DType::BF16),
                Arg::I32(vec as i32),
            ],
        )
    }
}

/// That `b` fits columns `cols` of `w_ext` from column `at` of them, row for row and in the
/// weight's dtype (`write_adapter_cols` and its multi-tensor form).
pub(super) fn check_adapter_cols(
    w_ext: &Tensor,
    cols: &std::ops::Range<usize>,
    at: usize,
    b: &Tensor,
) -> Result<()> {
    let ((out, kd), (bo, r)) = (w_ext.rows_cols(), b.rows_cols());
    ensure!(
        bo == out && cols.start <= cols.end && cols.end <= kd && at + r <= cols.len(),
        "write_adapter_cols: b {:?} at {at} into columns {cols:?} of {:?}",
        b.shape(),
        w_ext.shape()
    );
    ensure!(
        w_ext.dtype() == b.dtype(),
        "write_adapter_cols: b {:?} into a {:?} weight",
        b.dtype(),
        w_ext.dtype()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The projections that fold their adapter into the base product: q, gate, up and o on a
    /// training pass of llama8b (hidden 4096, 8 kv heads of 128, MLP 14336) and qwen1.5b
    /// (1536, 2 kv heads of 128, 8960); not k and v (few outputs), down (a wide input) or one
    /// row of decoding; a rank of 256 still folds the gate (its extra columns cost less than the
    /// f32 sum's bytes).
    #[test]
    fn the_adapter_folds_where_its_copies_cost_less_than_the_f32_sum() {
        for (t, hidden, kv, mlp) in [(16_384, 4096, 1024, 14_336), (4608, 1536, 256, 8960)] {
            let folds = |k: usize, out: usize| adapter_fold_pays(t, k, out, 16);
            assert!(folds(hidden, hidden), "q and o at {t} rows");
            assert!(folds(hidden, mlp), "gate and up at {t} rows");
            assert!(!folds(hidden, kv), "k and v at {t} rows");
            assert!(!folds(mlp, hidden), "down at {t} rows");
            assert!(!adapter_fold_pays(1, hidden, mlp, 16), "one row");
        }
        assert!(adapter_fold_pays(4608, 1536, 8960, 256));
    }

    /// A weight stored with its adapter's columns folds where the input's copy costs less than
    /// the f32 sum, at any row count: q, o, gate and up, not k, v or down, the same choice as a
    /// training pass makes with the weight's copy counted.
    #[test]
    fn an_extended_weight_folds_where_the_input_copy_pays() {
        for (hidden, kv, mlp) in [(4096, 1024, 14_336), (1536, 256, 8960), (2304, 1024, 9216)] {
            assert!(extended_fold_pays(hidden, hidden, 16), "q and o");
            assert!(extended_fold_pays(hidden, mlp, 16), "gate and up");
            assert!(!extended_fold_pays(hidden, kv, 16), "k and v");
            assert!(!extended_fold_pays(mlp, hidden, 16), "down");
        }
    }

    #[test]
    fn buckets_round_up_by_an_eighth_of_an_octave() {
        // The token counts of packs near 16K share one bucket; round widths keep their own.
        for d in [15_365, 15_646, 15_946, 16_206, 16_384] {
            assert_eq!(eighth_octave_up(d), 16_384);
        }
        let key = Key {
            m: 4096,
            n: 15_646,
            k: 1536,
            trans_a: false,
            trans_b: true,
            lda: 4096,
            ldb: 15_646,
            ldc: 4096,
            ldd: 4096,
            a_f32: false,
            c_f32: true,
            reads_c: false,
            align_log2: 8,
        };
        let b = key.bucket();
        assert_eq!((b.m, b.n, b.k, b.ldb), (4096, 16_384, 1536, 16_384));
        assert_eq!((b.trans_b, b.c_f32, b.align_log2), (true, true, 8));
        assert_eq!(
            Key {
                n: 16_206,
                ldb: 16_206,
                ..key
            }
            .bucket(),
            b
        );
    }
}
