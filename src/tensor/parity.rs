//! Op-by-op parity of a device backend against the CPU reference: every op (forward and
//! backward) on the same random inputs, rounded to bf16 first so that only the op's own error is
//! measured, with a stated bound per row. Attention is checked at several shapes and masks; the
//! largest shapes compare a sample of query rows computed directly on the host. Timing rows (CUDA
//! events) are information only. Run on a GPU machine with
//! `cargo test --release -- --ignored --nocapture cuda_parity_suite`.

use super::cuda::gemm::adapter_fold_pays;
use super::cuda::QuantKind;
use super::*;
use anyhow::Result;

/// Bounds, as relative-norm errors ||cuda - cpu|| / ||cpu||.
pub const BF16_FWD: f64 = 1e-2;
pub const BF16_GRAD: f64 = 2e-2;
/// f32 outputs computed from f32 (or bf16-exact) inputs: statistics, optimiser, f32 GEMM.
pub const F32_TIGHT: f64 = 1e-5;
/// f32 statistics of bf16 math (rstd, lse, logp): f32 accumulation in a different order.
pub const F32_STAT: f64 = 1e-4;

#[derive(Clone, Debug)]
pub struct ParityRow {
    pub op: String,
    pub max_abs: f64,
    pub rel: f64,
    pub worst: usize,
    pub bound: f64,
    pub pass: bool,
    /// Milliseconds per call, for timing rows.
    pub ms: Option<f64>,
    pub note: String,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / 16_777_216.0
    }
    fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
    fn normals(&mut self, n: usize, s: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * s).collect()
    }
    /// bf16-rounded normals.
    fn bnormals(&mut self, n: usize, s: f32) -> Vec<f32> {
        rb(&self.normals(n, s))
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn rb(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// One row: max |got - want| (and where), relative-norm error `|got - want| / |want|`, and whether
/// it is within `bound` (NaN or a length mismatch never is).
pub fn compare(op: &str, got: &[f32], want: &[f32], bound: f64) -> ParityRow {
    let mut max_abs = 0f64;
    let mut worst = 0;
    let (mut dn, mut bn) = (0f64, 0f64);
    let mut bad = got.len() != want.len();
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let d = if a == b {
            0.0
        } else {
            (a as f64 - b as f64).abs()
        };
        if d.is_nan() {
            bad = true;
        }
        if d > max_abs || (d.is_nan() && !max_abs.is_nan()) {
            max_abs = d;
            worst = i;
        }
        if b.is_finite() {
            bn += (b as f64) * (b as f64);
        }
        if d.is_finite() {
            dn += d * d;
        } else {
            bad = true;
        }
    }
    let rel = if bn > 0.0 {
        (dn / bn).sqrt()
    } else {
        dn.sqrt()
    };
    ParityRow {
        op: op.to_string(),
        max_abs,
        rel,
        worst,
        bound,
        pass: !bad && rel <= bound,
        ms: None,
        note: if got.len() != want.len() {
            format!("length {} vs {}", got.len(), want.len())
        } else {
            String::new()
        },
    }
}

fn cmp_t(op: &str, got: &Tensor, want: &Tensor, bound: f64) -> Result<ParityRow> {
    Ok(compare(op, &got.to_vec()?, &want.to_vec()?, bound))
}

fn timing(op: &str, ms: f64, note: String) -> ParityRow {
    ParityRow {
        op: op.to_string(),
        max_abs: 0.0,
        rel: 0.0,
        worst: 0,
        bound: 0.0,
        pass: true,
        ms: Some(ms),
        note,
    }
}

struct Ctx<'a> {
    dev: &'a Device,
    rows: Vec<ParityRow>,
}

impl Ctx<'_> {
    fn c(&self, v: &[f32], shape: &[usize]) -> Result<Tensor> {
        Tensor::cpu(v.to_vec(), shape)
    }
    fn g(&self, v: &[f32], shape: &[usize], dt: DType) -> Result<Tensor> {
        Tensor::from_f32(v, shape, dt, self.dev)
    }
    /// `g` on the device under test, `c` (f32, on the CPU) for the reference run.
    fn on(&self, on_gpu: bool, v: &[f32], shape: &[usize], dt: DType) -> Result<Tensor> {
        if on_gpu {
            self.g(v, shape, dt)
        } else {
            self.c(v, shape)
        }
    }
    fn push(&mut self, r: ParityRow) {
        // LORAFIT_PARITY_VERBOSE=1 prints each row as it is measured (to see how far a run got).
        if std::env::var_os("LORAFIT_PARITY_VERBOSE").is_some() {
            eprintln!(
                "  {:<58} rel {:.3e} max {:.3e} {}{}",
                r.op,
                r.rel,
                r.max_abs,
                if r.pass { "ok" } else { "FAIL" },
                r.ms.map(|m| format!(" {m:.3} ms")).unwrap_or_default()
            );
        }
        self.rows.push(r)
    }
    fn time(&self, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
        match self.dev {
            Device::Cuda(c) => Ok(c.time_ms(iters, f)? as f64),
            Device::Cpu => {
                let mut f = f;
                let t0 = std::time::Instant::now();
                for _ in 0..iters {
                    f()?;
                }
                Ok(t0.elapsed().as_secs_f64() * 1e3 / iters as f64)
            }
        }
    }
}

/// Whether a parity group runs: `LORAFIT_PARITY_ONLY=cce,attention` runs only the named groups (a
/// short GPU session); unset, all do.
pub fn group_wanted(group: &str) -> bool {
    std::env::var("LORAFIT_PARITY_ONLY")
        .ok()
        .is_none_or(|o| o.split(',').any(|x| x == group))
}

/// Runs every op on `device` and on the CPU with the same inputs and reports the differences.
pub fn run_op_parity(device: &Device, seed: u64) -> Result<Vec<ParityRow>> {
    let mut cx = Ctx {
        dev: device,
        rows: Vec::new(),
    };
    let mut r = Rng(seed);
    let want = group_wanted;
    if want("elementwise") {
        elementwise(&mut cx, &mut r)?;
    }
    if want("gemm") {
        gemm(&mut cx, &mut r)?;
    }
    if want("gemm_epilogue") {
        gemm_epilogue(&mut cx, &mut r)?;
    }
    if want("dequant") {
        dequant(&mut cx, &mut r)?;
    }
    if want("attention") {
        attention_suite(&mut cx, &mut r)?;
    } else if want("attention_long") {
        attention_long(&mut cx, &mut r)?;
    }
    if want("cce") {
        cce_suite(&mut cx)?;
    }
    if want("decode") {
        decode_suite(&mut cx, &mut r)?;
    }
    Ok(cx.rows)
}

fn elementwise(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let bf = DType::BF16;
    // cast round trip (exact on bf16-representable values)
    {
        let x = r.bnormals(1000, 1.0);
        let g = cx
            .g(&x, &[1000], DType::F32)?
            .to_dtype(bf)?
            .to_dtype(DType::F32)?;
        cx.push(compare("cast f32->bf16->f32", &g.to_vec()?, &x, 0.0));
    }
    // A random model's normal draws made on the device against the host's, over several of
    // their 2^16-value chunks. The bound is f32 rounding: CUDA's f64 log and cos are within an
    // ulp of the host's, so an f32 value differs, rarely, in its last bit. In bf16 such a
    // difference shows only where it crosses a rounding point.
    if let Device::Cuda(c) = cx.dev {
        let (n, seed) = (3 * 65536 + 77, 0x5eed_u64);
        let want = crate::model::weights::random_normal(n, seed, 0.02);
        let got = c.random_normal(&[n], DType::F32, seed, 0.02)?;
        cx.push(compare(
            "random normal draws (f32)",
            &got.to_vec()?,
            &want,
            1e-7,
        ));
        let got = c.random_normal(&[n], bf, seed, 0.02)?;
        cx.push(compare(
            "random normal draws (bf16)",
            &got.to_vec()?,
            &rb(&want),
            1e-7,
        ));
    }
    // embedding
    {
        let (v, h, t) = (300, 96, 57);
        let table = r.bnormals(v * h, 1.0);
        let ids: Vec<u32> = (0..t)
            .map(|i| (r.below(v) as u32 + i as u32 % 3) % v as u32)
            .collect();
        let mut ids2 = ids.clone();
        ids2[5] = ids2[3]; // a repeated id in the backward
        let want = embedding(&cx.c(&table, &[v, h])?, &ids)?;
        let got = embedding(&cx.g(&table, &[v, h], bf)?, &ids)?;
        let row = cmp_t("embedding fwd", &got, &want, 0.0)?;
        cx.push(row);
        let dy = r.bnormals(t * h, 1.0);
        let want = embedding_bwd(&cx.c(&dy, &[t, h])?, &ids2, v)?;
        let got = embedding_bwd(&cx.g(&dy, &[t, h], bf)?, &ids2, v)?;
        let row = cmp_t("embedding bwd (f32)", &got, &want, F32_TIGHT)?;
        cx.push(row);
    }
    // rms_norm: rows the 4-wide kernels take (h 576, 1536, 2048 and 4096: up to 4 groups per
    // thread, some threads idle; h 6144: up to 8), and rows they do not (h % 4 != 0)
    rms_norm_rows(cx, r, 5, 90, " (h 90, scalar)")?;
    for (rows, h, label) in [
        (37, 1536, ""),
        (21, 576, " (h 576)"),
        (13, 2048, " (h 2048)"),
        (11, 4096, " (h 4096)"),
        (9, 6144, " (h 6144)"),
    ] {
        let (w, dy) = rms_norm_rows(cx, r, rows, h, label)?;
        let wg = cx.g(&w, &[h], bf)?;
        // The fused residual forms, as the layer uses them: an f32 stream plus a bf16 branch
        // output, normalised into bf16; the backward adds an f32 residual gradient.
        let f = DType::F32;
        let (xs, o) = (r.normals(rows * h, 2.0), r.bnormals(rows * h, 1.0));
        let (sum_c, yc, sc) = add_rms_norm_to(
            &cx.c(&xs, &[rows, h])?,
            &cx.c(&o, &[rows, h])?,
            &cx.c(&w, &[h])?,
            1e-6,
            f,
        )?;
        let (sum_g, yg, sg) = add_rms_norm_to(
            &cx.g(&xs, &[rows, h], f)?,
            &cx.g(&o, &[rows, h], bf)?,
            &wg,
            1e-6,
            bf,
        )?;
        let row = cmp_t(
            &format!("add_rms_norm sum (f32){label}"),
            &sum_g,
            &sum_c,
            F32_TIGHT,
        )?;
        cx.push(row);
        let row = cmp_t(
            &format!("add_rms_norm y (-> bf16){label}"),
            &yg,
            &yc,
            BF16_FWD,
        )?;
        cx.push(row);
        let row = cmp_t(
            &format!("add_rms_norm rstd (f32){label}"),
            &sg,
            &sc,
            F32_STAT,
        )?;
        cx.push(row);
        let add = r.normals(rows * h, 1.0);
        let want = rms_norm_bwd_add(
            &cx.c(&dy, &[rows, h])?,
            &sum_c,
            &cx.c(&w, &[h])?,
            &sc,
            &cx.c(&add, &[rows, h])?,
        )?;
        let got = rms_norm_bwd_add(
            &cx.g(&dy, &[rows, h], bf)?,
            &sum_g,
            &wg,
            &cx.g(&sc.to_vec()?, &[rows], f)?,
            &cx.g(&add, &[rows, h], f)?,
        )?;
        let row = cmp_t(
            &format!("rms_norm_bwd_add dx (f32){label}"),
            &got,
            &want,
            F32_STAT,
        )?;
        cx.push(row);
        // The same with the bf16 copy written beside it (the layer backward's form).
        let (got, copy) = rms_norm_bwd_add_copy(
            &cx.g(&dy, &[rows, h], bf)?,
            &sum_g,
            &wg,
            &cx.g(&sc.to_vec()?, &[rows], f)?,
            &cx.g(&add, &[rows, h], f)?,
            bf,
        )?;
        let copy = copy.ok_or_else(|| anyhow::anyhow!("rms_norm_bwd_add_copy: no bf16 copy"))?;
        let row = cmp_t(
            &format!("rms_norm_bwd_add_copy dx (f32){label}"),
            &got,
            &want,
            F32_STAT,
        )?;
        cx.push(row);
        let row = cmp_t(
            &format!("rms_norm_bwd_add_copy dx (bf16 copy){label}"),
            &copy,
            &want,
            BF16_GRAD,
        )?;
        cx.push(row);
    }
    // rope: bf16 eight pairs a thread (head_dim 64 and 128: a half of whole 16-byte chunks),
    // pairs of pairs (head_dim 20: an even half of 10), and the scalar kernel (head_dim 6: odd
    // half)
    for (t, nh, hd) in [(29, 3, 64), (37, 12, 128), (13, 2, 20), (11, 2, 6)] {
        let pos: Vec<i32> = (0..t as i32).map(|p| p * 7 + 3).collect();
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / hd as f32))
            .collect();
        let tc = RopeTable::new(&pos, &inv, &Device::Cpu)?;
        let tg = RopeTable::new(&pos, &inv, cx.dev)?;
        let x = r.bnormals(t * nh * hd, 1.0);
        for inverse in [false, true] {
            let want = rope(&cx.c(&x, &[t, nh * hd])?, &tc, nh, inverse)?;
            let got = rope(&cx.g(&x, &[t, nh * hd], bf)?, &tg, nh, inverse)?;
            let name = format!(
                "rope {} (head_dim {hd})",
                if inverse { "inverse (bwd)" } else { "fwd" }
            );
            let row = cmp_t(
                &name,
                &got,
                &want,
                if inverse { BF16_GRAD } else { BF16_FWD },
            )?;
            cx.push(row);
        }
    }
    // The gated activations: n = 4099 takes the generic kernels, n = 4096 the 8-wide bf16 ones;
    // f32 operands take the generic kernels at f32 agreement.
    type GateFwd = fn(&Tensor, &Tensor) -> Result<Tensor>;
    type GateBwd = fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>;
    type GateBwdInPlace = fn(&Tensor, &mut Tensor, &mut Tensor) -> Result<()>;
    let gates: [(&str, GateFwd, GateBwd, GateBwdInPlace); 2] = [
        ("silu_mul", silu_mul, silu_mul_bwd, silu_mul_bwd_in_place),
        (
            "gelu_tanh_mul",
            gelu_tanh_mul,
            gelu_tanh_mul_bwd,
            gelu_tanh_mul_bwd_in_place,
        ),
    ];
    for (name, fwd, bwd, bwd_in_place) in gates {
        for n in [4099, 4096] {
            let (g, u, d) = (r.bnormals(n, 2.0), r.bnormals(n, 1.0), r.bnormals(n, 1.0));
            let want = fwd(&cx.c(&g, &[n])?, &cx.c(&u, &[n])?)?;
            let got = fwd(&cx.g(&g, &[n], bf)?, &cx.g(&u, &[n], bf)?)?;
            let row = cmp_t(&format!("{name} fwd n={n}"), &got, &want, BF16_FWD)?;
            cx.push(row);
            let (dgc, duc) = bwd(&cx.c(&d, &[n])?, &cx.c(&g, &[n])?, &cx.c(&u, &[n])?)?;
            let (dgg, dug) = bwd(
                &cx.g(&d, &[n], bf)?,
                &cx.g(&g, &[n], bf)?,
                &cx.g(&u, &[n], bf)?,
            )?;
            let row = cmp_t(&format!("{name} bwd dgate n={n}"), &dgg, &dgc, BF16_GRAD)?;
            cx.push(row);
            let row = cmp_t(&format!("{name} bwd dup n={n}"), &dug, &duc, BF16_GRAD)?;
            cx.push(row);
            let (mut gi, mut ui) = (cx.g(&g, &[n], bf)?, cx.g(&u, &[n], bf)?);
            bwd_in_place(&cx.g(&d, &[n], bf)?, &mut gi, &mut ui)?;
            let what = format!("{name} bwd in place dgate n={n}");
            let row = cmp_t(&what, &gi, &dgc, BF16_GRAD)?;
            cx.push(row);
            let what = format!("{name} bwd in place dup n={n}");
            let row = cmp_t(&what, &ui, &duc, BF16_GRAD)?;
            cx.push(row);
            let f32_got = fwd(&cx.g(&g, &[n], DType::F32)?, &cx.g(&u, &[n], DType::F32)?)?;
            let row = cmp_t(
                &format!("{name} fwd n={n} (f32)"),
                &f32_got,
                &want,
                F32_TIGHT,
            )?;
            cx.push(row);
        }
    }
    // The activation fused with the down adapter's input (gated_mul_xa): h bit for bit what
    // the activation alone writes, xa against the CPU's f32 and against the GPU's own product
    // from the same bf16 h (one rounding apart: summation order). Widths not a multiple of 32
    // and ranks past 16 take the unfused ops.
    // (T, I, rank): rows past a block's 16, one at I = 8960 (9 column slices), three slices
    // with a last one 32 wide, I % 32 != 0, a rank past 16.
    const GATED_SHAPES: [(usize, usize, usize); 7] = [
        (333, 1024, 16),
        (64, 512, 3),
        (17, 8960, 16),
        (200, 2080, 8),
        (40, 1000, 8),
        (9, 256, 20),
        (45, 1004, 4),
    ];
    for act in [GatedAct::Silu, GatedAct::GeluTanh] {
        for (t, n, rank) in GATED_SHAPES {
            let (g, u, a) = (
                r.bnormals(t * n, 2.0),
                r.bnormals(t * n, 1.0),
                r.bnormals(rank * n, 0.05),
            );
            let (hc, xac) = gated_mul_xa(
                act,
                &cx.c(&g, &[t, n])?,
                &cx.c(&u, &[t, n])?,
                &cx.c(&a, &[rank, n])?,
            )?;
            let (gg, ug, ag) = (
                cx.g(&g, &[t, n], bf)?,
                cx.g(&u, &[t, n], bf)?,
                cx.g(&a, &[rank, n], bf)?,
            );
            let (hg, xag) = gated_mul_xa(act, &gg, &ug, &ag)?;
            let tag = format!("gated_mul_xa {act:?} {t}x{n} r{rank}");
            let row = cmp_t(&format!("{tag} h"), &hg, &hc, BF16_FWD)?;
            cx.push(row);
            let row = cmp_t(&format!("{tag} xa"), &xag, &xac, BF16_FWD)?;
            cx.push(row);
            let alone = gated_mul(act, &gg, &ug)?;
            let row = cmp_t(&format!("{tag} h = the activation's own"), &hg, &alone, 0.0)?;
            cx.push(row);
            let xa_alone = matmul(&alone, false, &ag, true, 1.0, bf)?;
            // One bf16 rounding of the same f32 sum taken in another order: 2^-8 relative.
            let row = cmp_t(
                &format!("{tag} xa = the product's own"),
                &xag,
                &xa_alone,
                4e-3,
            )?;
            cx.push(row);
            // The slices' sums are added in a fixed order, and the counters are left at zero
            // for the next call: a second call gives the same bits.
            let (_, again) = gated_mul_xa(act, &gg, &ug, &ag)?;
            let row = cmp_t(&format!("{tag} xa the same again"), &again, &xag, 0.0)?;
            cx.push(row);
            // Without h stored (a recomputed layer's): the same xa.
            let only = gated_mul_xa_only(act, &gg, &ug, &ag)?;
            let row = cmp_t(&format!("{tag} xa without h"), &only, &xag, 0.0)?;
            cx.push(row);
        }
    }
    // Its backward with the adapter's dxa A added to d(h) (gated_mul_bwd_lora_in_place),
    // against the CPU's f32; I % 8 != 0 and the rank past 16 take the unfused ops.
    for act in [GatedAct::Silu, GatedAct::GeluTanh] {
        for (t, n, rank) in GATED_SHAPES {
            let (g, u, d) = (
                r.bnormals(t * n, 2.0),
                r.bnormals(t * n, 1.0),
                r.bnormals(t * n, 1.0),
            );
            let (dxa, a) = (r.bnormals(t * rank, 1.0), r.bnormals(rank * n, 0.3));
            // On the CPU in f32 (gpu false) or on the device in bf16.
            let run = |gpu: bool| -> Result<(Tensor, Tensor)> {
                let on = |v: &[f32], sh: &[usize]| if gpu { cx.g(v, sh, bf) } else { cx.c(v, sh) };
                let (mut gt, mut ut, mut dt) =
                    (on(&g, &[t, n])?, on(&u, &[t, n])?, on(&d, &[t, n])?);
                let (xt, at) = (on(&dxa, &[t, rank])?, on(&a, &[rank, n])?);
                gated_mul_bwd_lora_in_place(act, &mut dt, &xt, &at, &mut gt, &mut ut)?;
                Ok((gt, ut))
            };
            let (dgc, duc) = run(false)?;
            let (dgg, dug) = run(true)?;
            let tag = format!("gated_mul_bwd_lora {act:?} {t}x{n} r{rank}");
            let row = cmp_t(&format!("{tag} dgate"), &dgg, &dgc, BF16_GRAD)?;
            cx.push(row);
            let row = cmp_t(&format!("{tag} dup"), &dug, &duc, BF16_GRAD)?;
            cx.push(row);
        }
    }
    // The backward with the three LoRA gradients that read its tensors summed inside it
    // (gated_mul_bwd_lora_grads): gate's and up's xa are columns of one stacked product, and the
    // gradients start from values the sums are added onto. Against the CPU's f32, and against
    // the GPU's own ops apart (activation again, products, the unfused backward).
    // (T, I, rank down, gate, up): rows past a 16-row step, I = 8960, column blocks past I,
    // three different ranks; then an odd rank and I % 32 != 0, which take the ops apart.
    const GRAD_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
        (333, 1024, 16, 16, 16),
        (17, 8960, 16, 16, 16),
        (200, 2080, 4, 8, 16),
        (64, 512, 3, 16, 16),
        (40, 1000, 8, 8, 8),
    ];
    for act in [GatedAct::Silu, GatedAct::GeluTanh] {
        for (t, n, rd, rg, ru) in GRAD_SHAPES {
            let (g, u, d) = (
                r.bnormals(t * n, 2.0),
                r.bnormals(t * n, 1.0),
                r.bnormals(t * n, 1.0),
            );
            let (dxa, a) = (r.bnormals(t * rd, 1.0), r.bnormals(rd * n, 0.3));
            let xa = r.bnormals(t * (rg + ru), 1.0);
            let (ga, gbg, gbu) = (
                r.normals(rd * n, 0.1),
                r.normals(n * rg, 0.1),
                r.normals(n * ru, 0.1),
            );
            // (d gate, d up, dA_down, dB_gate, dB_up): on the CPU in f32, on the device in
            // bf16 fused (or apart, with `apart`).
            let run = |gpu: bool, apart: bool| -> Result<[Tensor; 5]> {
                let on = |v: &[f32], sh: &[usize]| if gpu { cx.g(v, sh, bf) } else { cx.c(v, sh) };
                let f32s = |v: &[f32], sh: &[usize]| {
                    if gpu {
                        cx.g(v, sh, DType::F32)
                    } else {
                        cx.c(v, sh)
                    }
                };
                let (mut gt, mut ut, mut dt) =
                    (on(&g, &[t, n])?, on(&u, &[t, n])?, on(&d, &[t, n])?);
                let (xt, at, xat) = (
                    on(&dxa, &[t, rd])?,
                    on(&a, &[rd, n])?,
                    on(&xa, &[t, rg + ru])?,
                );
                let (mut gat, mut gbgt, mut gbut) = (
                    f32s(&ga, &[rd, n])?,
                    f32s(&gbg, &[n, rg])?,
                    f32s(&gbu, &[n, ru])?,
                );
                let (xg, xu) = (
                    Cols {
                        t: &xat,
                        start: 0,
                        end: rg,
                    },
                    Cols {
                        t: &xat,
                        start: rg,
                        end: rg + ru,
                    },
                );
                if apart {
                    let h = gated_mul(act, &gt, &ut)?;
                    matmul_acc(&mut gat, &xt, true, &h, false, 1.0, 1.0)?;
                    gated_mul_bwd_lora_in_place(act, &mut dt, &xt, &at, &mut gt, &mut ut)?;
                    matmul_acc_cols(&mut gbgt, 0..rg, Cols::all(&gt), true, xg, false, 2.0, 1.0)?;
                    matmul_acc_cols(&mut gbut, 0..ru, Cols::all(&ut), true, xu, false, 0.5, 1.0)?;
                } else {
                    let grads = GatedLoraGrads {
                        xa_gate: xg,
                        scale_gate: 2.0,
                        grad_b_gate: &mut gbgt,
                        xa_up: xu,
                        scale_up: 0.5,
                        grad_b_up: &mut gbut,
                        grad_a_down: &mut gat,
                    };
                    gated_mul_bwd_lora_grads(act, &mut dt, &xt, &at, &mut gt, &mut ut, grads)?;
                }
                Ok([gt, ut, gat, gbgt, gbut])
            };
            let tag = format!("gated_mul_bwd_lora_grads {act:?} {t}x{n} r{rd}/{rg}/{ru}");
            let want = run(false, false)?;
            let got = run(true, false)?;
            let apart = run(true, true)?;
            for (i, what) in ["dgate", "dup", "dA_down", "dB_gate", "dB_up"]
                .iter()
                .enumerate()
            {
                let row = cmp_t(&format!("{tag} {what}"), &got[i], &want[i], BF16_GRAD)?;
                cx.push(row);
                // The same bf16 inputs: f32 sums in another order, one bf16 rounding apart
                // where the result is bf16.
                let row = cmp_t(
                    &format!("{tag} {what} = the ops apart"),
                    &got[i],
                    &apart[i],
                    4e-3,
                )?;
                cx.push(row);
            }
        }
    }
    // The fused pair's times beside the ops they replace, at qwen1.5b's MLP over a 3584 / 512
    // pair (T = 4608, I = 8960, rank 16), with the bandwidth each fused kernel reaches over the
    // bytes it must move (forward: gate and up read, h written; backward: d, gate and up read,
    // gate and up written).
    if cx.dev.is_cuda() {
        let (t, n, rank) = (4608, 8960, 16);
        let big = |r: &mut Rng, s: f32| cx.g(&r.bnormals(t * n, s), &[t, n], bf);
        let (g, u, d) = (big(r, 2.0)?, big(r, 1.0)?, big(r, 1.0)?);
        let a = cx.g(&r.bnormals(rank * n, 0.05), &[rank, n], bf)?;
        let dxa = cx.g(&r.bnormals(t * rank, 1.0), &[t, rank], bf)?;
        let moved = |tensors: f64, ms: f64| tensors * (t * n * 2) as f64 / (ms * 1e-3) / 1e12;
        let fused = cx.time(5, || gated_mul_xa(GatedAct::Silu, &g, &u, &a).map(|_| ()))?;
        let apart = cx.time(5, || {
            let h = gated_mul(GatedAct::Silu, &g, &u)?;
            matmul(&h, false, &a, true, 1.0, bf).map(|_| ())
        })?;
        cx.push(timing(
            &format!("gated_mul_xa {t}x{n} r{rank} (fused)"),
            fused,
            format!(
                "{:.2} TB/s; activation and product apart {apart:.3} ms",
                moved(3.0, fused)
            ),
        ));
        let (mut gi, mut ui, mut di) = (g.try_clone()?, u.try_clone()?, d.try_clone()?);
        let fused = cx.time(5, || {
            gated_mul_bwd_lora_in_place(GatedAct::Silu, &mut di, &dxa, &a, &mut gi, &mut ui)
        })?;
        let apart = cx.time(5, || {
            matmul_acc(&mut di, &dxa, false, &a, false, 1.0, 1.0)?;
            gated_mul_bwd_in_place(GatedAct::Silu, &di, &mut gi, &mut ui)
        })?;
        cx.push(timing(
            &format!("gated_mul_bwd_lora {t}x{n} r{rank} (fused)"),
            fused,
            format!(
                "{:.2} TB/s; product and backward apart {apart:.3} ms",
                moved(5.0, fused)
            ),
        ));
        // With the three LoRA gradients summed inside, against that backward and the three
        // products it replaces (dA_down from the activation as kept, dB_gate and dB_up).
        let h = gated_mul(GatedAct::Silu, &g, &u)?;
        let xa = cx.g(&r.bnormals(t * 2 * rank, 1.0), &[t, 2 * rank], bf)?;
        let zeros = |sh: &[usize]| cx.g(&vec![0.0; sh[0] * sh[1]], sh, DType::F32);
        let (mut ga, mut gbg, mut gbu) =
            (zeros(&[rank, n])?, zeros(&[n, rank])?, zeros(&[n, rank])?);
        let (xg, xu) = (
            Cols {
                t: &xa,
                start: 0,
                end: rank,
            },
            Cols {
                t: &xa,
                start: rank,
                end: 2 * rank,
            },
        );
        let with_grads = cx.time(5, || {
            let grads = GatedLoraGrads {
                xa_gate: xg,
                scale_gate: 2.0,
                grad_b_gate: &mut gbg,
                xa_up: xu,
                scale_up: 2.0,
                grad_b_up: &mut gbu,
                grad_a_down: &mut ga,
            };
            gated_mul_bwd_lora_grads(GatedAct::Silu, &mut di, &dxa, &a, &mut gi, &mut ui, grads)
        })?;
        let apart = cx.time(5, || {
            matmul_acc(&mut ga, &dxa, true, &h, false, 1.0, 1.0)?;
            gated_mul_bwd_lora_in_place(GatedAct::Silu, &mut di, &dxa, &a, &mut gi, &mut ui)?;
            let (g, u) = (Cols::all(&gi), Cols::all(&ui));
            matmul_acc_cols(&mut gbg, 0..rank, g, true, xg, false, 2.0, 1.0)?;
            matmul_acc_cols(&mut gbu, 0..rank, u, true, xu, false, 2.0, 1.0)
        })?;
        let note = format!(
            "{:.2} TB/s; backward and the three products apart {apart:.3} ms",
            moved(5.0, with_grads)
        );
        let op = format!("gated_mul_bwd_lora_grads {t}x{n} r{rank} (fused)");
        cx.push(timing(&op, with_grads, note));
    }
    // The forward norm's time at the layer's rows of a 3584 / 512 pair (T = 4608; f32 residual
    // in, bf16 out) for qwen1.5b's width and llama8b's, and rope's, each with the bandwidth over
    // the bytes it must move (x read, y written). Short kernels: an allocation and a launch on
    // the host per call may take longer than the kernel, so the times are upper bounds.
    if cx.dev.is_cuda() {
        let t = 4608;
        for h in [1536, 4096] {
            let x = cx.g(&r.normals(t * h, 1.0), &[t, h], DType::F32)?;
            let w = cx.g(&r.bnormals(h, 1.0), &[h], bf)?;
            let ms = cx.time(10, || rms_norm_to(&x, &w, 1e-6, bf).map(|_| ()))?;
            let tbs = (t * h * 6) as f64 / (ms * 1e-3) / 1e12;
            cx.push(timing(
                &format!("rms_norm {t}x{h} f32 -> bf16"),
                ms,
                format!("{tbs:.2} TB/s"),
            ));
        }
        // rope of qwen1.5b's q (12 heads of 128) over the same rows.
        let (nh, hd) = (12, 128);
        let pos: Vec<i32> = (0..t as i32).collect();
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / hd as f32))
            .collect();
        let table = RopeTable::new(&pos, &inv, cx.dev)?;
        let x = cx.g(&r.bnormals(t * nh * hd, 1.0), &[t, nh * hd], bf)?;
        let ms = cx.time(10, || rope(&x, &table, nh, false).map(|_| ()))?;
        let tbs = (t * nh * hd * 4) as f64 / (ms * 1e-3) / 1e12;
        cx.push(timing(
            &format!("rope {t}x{nh}x{hd} bf16"),
            ms,
            format!("{tbs:.2} TB/s"),
        ));
    }
    // add_assign / add_bias / scale
    {
        let n = 3001;
        let (a, b) = (r.bnormals(n, 1.0), r.normals(n, 1.0));
        for (name, adt, bdt, bound) in [
            ("add_assign bf16 += f32", bf, DType::F32, BF16_FWD),
            ("add_assign bf16 += bf16", bf, bf, BF16_FWD),
            ("add_assign f32 += f32", DType::F32, DType::F32, F32_TIGHT),
        ] {
            let bv = if bdt == bf { rb(&b) } else { b.clone() };
            let mut want = cx.c(&a, &[n])?;
            add_assign(&mut want, &cx.c(&bv, &[n])?, 0.7)?;
            let mut got = cx.g(&a, &[n], adt)?;
            add_assign(&mut got, &cx.g(&bv, &[n], bdt)?, 0.7)?;
            let row = cmp_t(name, &got, &want, bound)?;
            cx.push(row);
            let got = add(&cx.g(&a, &[n], adt)?, &cx.g(&bv, &[n], bdt)?, 0.7)?;
            let row = cmp_t(&name.replace("add_assign", "add"), &got, &want, bound)?;
            cx.push(row);
        }
        let (rows, c) = (13, 96);
        let x = r.bnormals(rows * c, 1.0);
        let bias = r.bnormals(c, 1.0);
        let mut want = cx.c(&x, &[rows, c])?;
        add_bias(&mut want, &cx.c(&bias, &[c])?)?;
        let mut got = cx.g(&x, &[rows, c], bf)?;
        add_bias(&mut got, &cx.g(&bias, &[c], bf)?)?;
        let row = cmp_t("add_bias", &got, &want, BF16_FWD)?;
        cx.push(row);
        let mut want = cx.c(&x, &[rows, c])?;
        scale(&mut want, -1.7)?;
        let mut got = cx.g(&x, &[rows, c], bf)?;
        scale(&mut got, -1.7)?;
        let row = cmp_t("scale", &got, &want, BF16_FWD)?;
        cx.push(row);
        let f = r.normals(rows, 1.0);
        let mut want = cx.c(&x, &[rows, c])?;
        scale_rows(&mut want, &cx.c(&f, &[rows])?)?;
        let mut got = cx.g(&x, &[rows, c], bf)?;
        scale_rows(&mut got, &cx.g(&f, &[rows], DType::F32)?)?;
        let row = cmp_t("scale_rows", &got, &want, BF16_FWD)?;
        cx.push(row);
    }
    // rows
    {
        let (rows, c) = (41, 72);
        let x = r.bnormals(rows * c, 1.0);
        let want = slice_rows(&cx.c(&x, &[rows, c])?, 5, 30)?;
        let got = slice_rows(&cx.g(&x, &[rows, c], bf)?, 5, 30)?;
        let row = cmp_t("slice_rows", &got, &want, 0.0)?;
        cx.push(row);
        let want = slice_cols(&cx.c(&x, &[rows, c])?, 7, 23)?;
        let got = slice_cols(&cx.g(&x, &[rows, c], bf)?, 7, 23)?;
        let row = cmp_t("slice_cols", &got, &want, 0.0)?;
        cx.push(row);
        let (xc, xg) = (cx.c(&x, &[rows, c])?, cx.g(&x, &[rows, c], bf)?);
        let (wc, wg) = (slice_cols(&xc, 0, 5)?, slice_cols(&xg, 0, 5)?);
        let (mut want, mut got) = (xc.try_clone()?, xg.try_clone()?);
        write_cols(&mut want, 11, &wc)?;
        write_cols(&mut got, 11, &wg)?;
        let row = cmp_t("write_cols", &got, &want, 0.0)?;
        cx.push(row);
        // The same at columns that are multiples of 16 bytes (lf_copy_cols_v16).
        let want = slice_cols(&xc, 8, 40)?;
        let got = slice_cols(&xg, 8, 40)?;
        let row = cmp_t("slice_cols (16-byte columns)", &got, &want, 0.0)?;
        cx.push(row);
        let (mut want, mut got) = (xc.try_clone()?, xg.try_clone()?);
        write_cols(&mut want, 16, &slice_cols(&xc, 0, 24)?)?;
        write_cols(&mut got, 16, &slice_cols(&xg, 0, 24)?)?;
        let row = cmp_t("write_cols (16-byte columns)", &got, &want, 0.0)?;
        cx.push(row);
        let (wc, wg) = (slice_rows(&xc, 3, 9)?, slice_rows(&xg, 3, 9)?);
        let want = concat_rows(&[&xc, &wc])?;
        let got = concat_rows(&[&xg, &wg])?;
        let row = cmp_t("concat_rows", &got, &want, 0.0)?;
        cx.push(row);
        let idx: Vec<u32> = (0..23).map(|_| r.below(rows) as u32).collect();
        let want = gather_rows(&cx.c(&x, &[rows, c])?, &idx)?;
        let got = gather_rows(&cx.g(&x, &[rows, c], bf)?, &idx)?;
        let row = cmp_t("gather_rows", &got, &want, 0.0)?;
        cx.push(row);
        let src = r.bnormals(idx.len() * c, 1.0);
        let mut want = cx.c(&x, &[rows, c])?;
        scatter_add_rows(&mut want, &idx, &cx.c(&src, &[idx.len(), c])?)?;
        let mut got = cx.g(&x, &[rows, c], DType::F32)?;
        scatter_add_rows(&mut got, &idx, &cx.g(&src, &[idx.len(), c], bf)?)?;
        let row = cmp_t("scatter_add_rows (f32 dst)", &got, &want, F32_TIGHT)?;
        cx.push(row);
    }
    // logsoftmax_gather: bf16 and f32 logits (the chunked head's), rows of a multiple of 4 (the
    // kernels' 4-wide path) and not; targets at both ends of a row and one ignored row.
    for (rows, v, ldt) in [
        (19usize, 50_000usize, bf),
        (3, 262_144, bf),
        (7, 151_936, DType::F32),
        (5, 50_001, DType::F32),
    ] {
        let l = r.bnormals(rows * v, 3.0);
        let mut targets: Vec<u32> = (0..rows).map(|_| r.below(v) as u32).collect();
        targets[1] = u32::MAX;
        targets[0] = v as u32 - 1;
        targets[2] = 0;
        let (lpc, lsc) = logsoftmax_gather(&cx.c(&l, &[rows, v])?, &targets)?;
        let lg = cx.g(&l, &[rows, v], ldt)?;
        let (lpg, lsg) = logsoftmax_gather(&lg, &targets)?;
        let row = cmp_t(
            &format!("logsoftmax_gather logp V={v}"),
            &lpg,
            &lpc,
            F32_STAT,
        )?;
        cx.push(row);
        let row = cmp_t(
            &format!("logsoftmax_gather lse V={v}"),
            &lsg,
            &lsc,
            F32_STAT,
        )?;
        cx.push(row);
        let dl = r.normals(rows, 1.0);
        let want =
            logsoftmax_gather_bwd(&cx.c(&dl, &[rows])?, &cx.c(&l, &[rows, v])?, &lsc, &targets)?;
        let got = logsoftmax_gather_bwd(
            &cx.g(&dl, &[rows], DType::F32)?,
            &lg,
            &cx.g(&lsc.to_vec()?, &[rows], DType::F32)?,
            &targets,
        )?;
        let row = cmp_t(
            &format!("logsoftmax_gather bwd V={v}"),
            &got,
            &want,
            BF16_GRAD,
        )?;
        cx.push(row);
        let got = logsoftmax_gather_bwd_to(
            &cx.g(&dl, &[rows], DType::F32)?,
            &lg,
            &cx.g(&lsc.to_vec()?, &[rows], DType::F32)?,
            &targets,
            bf,
        )?;
        let row = cmp_t(
            &format!("logsoftmax_gather bwd V={v} -> BF16"),
            &got,
            &want,
            BF16_GRAD,
        )?;
        cx.push(row);
    }
    // softcap (Gemma 2's final logits, cap 30, raw logits of spread ±60) in place, and the
    // softcapped logsoftmax_gather backward on the capped logits
    {
        let (rows, v, cap) = (19usize, 50_000usize, 30.0f32);
        let l = r.bnormals(rows * v, 20.0);
        let mut targets: Vec<u32> = (0..rows).map(|_| r.below(v) as u32).collect();
        targets[2] = u32::MAX;
        let mut lc = cx.c(&l, &[rows, v])?;
        softcap(&mut lc, cap)?;
        let mut lg32 = cx.g(&l, &[rows, v], DType::F32)?;
        softcap(&mut lg32, cap)?;
        let row = cmp_t("softcap cap30 (f32)", &lg32, &lc, F32_TIGHT)?;
        cx.push(row);
        let mut lgb = cx.g(&l, &[rows, v], bf)?;
        softcap(&mut lgb, cap)?;
        let row = cmp_t("softcap cap30 (bf16)", &lgb, &lc, BF16_FWD)?;
        cx.push(row);
        let (_, lsc) = logsoftmax_gather(&lc, &targets)?;
        let dl = r.normals(rows, 1.0);
        let want = logsoftmax_gather_softcap_bwd_to(
            &cx.c(&dl, &[rows])?,
            &lc,
            &lsc,
            &targets,
            Some(cap),
            DType::F32,
        )?;
        for odt in [DType::F32, bf] {
            let got = logsoftmax_gather_softcap_bwd_to(
                &cx.g(&dl, &[rows], DType::F32)?,
                &lg32,
                &cx.g(&lsc.to_vec()?, &[rows], DType::F32)?,
                &targets,
                Some(cap),
                odt,
            )?;
            let row = cmp_t(
                &format!("logsoftmax_gather softcap bwd V={v} -> {odt:?}"),
                &got,
                &want,
                if odt == bf { BF16_GRAD } else { F32_STAT },
            )?;
            cx.push(row);
        }
    }
    // dropout: the same keep pattern bit for bit
    {
        let n = 100_003;
        let x = r.bnormals(n, 1.0);
        let want = dropout(&cx.c(&x, &[n])?, 0.1, 1234567)?.to_vec()?;
        let got = dropout(&cx.g(&x, &[n], bf)?, 0.1, 1234567)?.to_vec()?;
        let mismatched = want
            .iter()
            .zip(&got)
            .filter(|(a, b)| (**a == 0.0) != (**b == 0.0))
            .count();
        let mut row = compare("dropout p=0.1", &got, &want, BF16_FWD);
        row.pass &= mismatched == 0;
        row.note = format!("{mismatched} keep decisions differ");
        cx.push(row);
    }
    // sum_sq
    {
        let n = 1_000_003;
        let x = r.bnormals(n, 1.0);
        let want = sum_sq(&cx.c(&x, &[n])?)?;
        let got = sum_sq(&cx.g(&x, &[n], bf)?)?;
        cx.push(compare("sum_sq", &[got as f32], &[want as f32], F32_TIGHT));
    }
    // adamw
    {
        let n = 5000;
        let (p, g, m) = (r.normals(n, 0.1), r.normals(n, 0.01), r.normals(n, 0.001));
        let v: Vec<f32> = r.normals(n, 1e-4).iter().map(|x| x.abs()).collect();
        let h = AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 7,
            grad_scale: 0.5,
        };
        let (mut pc, mut mc, mut vc) = (cx.c(&p, &[n])?, cx.c(&m, &[n])?, cx.c(&v, &[n])?);
        adamw_step(&mut pc, &cx.c(&g, &[n])?, &mut mc, &mut vc, h)?;
        let f = DType::F32;
        let (mut pg, mut mg, mut vg) = (cx.g(&p, &[n], f)?, cx.g(&m, &[n], f)?, cx.g(&v, &[n], f)?);
        adamw_step(&mut pg, &cx.g(&g, &[n], f)?, &mut mg, &mut vg, h)?;
        let row = cmp_t("adamw param (f32)", &pg, &pc, F32_TIGHT)?;
        cx.push(row);
        let row = cmp_t("adamw m (f32)", &mg, &mc, F32_TIGHT)?;
        cx.push(row);
        let row = cmp_t("adamw v (f32)", &vg, &vc, F32_TIGHT)?;
        cx.push(row);
    }
    // Multi-tensor ops: sizes around the kernels' chunk (2048) and block (256) sizes, an empty
    // tensor, one larger than many chunks.
    let sizes = [1, 255, 257, 2047, 2048, 2049, 0, 6151, 100_003];
    // sum_sq_multi (bf16 inputs)
    {
        let xs: Vec<Vec<f32>> = sizes.iter().map(|&n| r.bnormals(n, 1.0)).collect();
        let cs = xs
            .iter()
            .map(|x| cx.c(x, &[x.len()]))
            .collect::<Result<Vec<_>>>()?;
        let gs = xs
            .iter()
            .map(|x| cx.g(x, &[x.len()], bf))
            .collect::<Result<Vec<_>>>()?;
        let want = sum_sq_multi(&cs.iter().collect::<Vec<_>>())?.to_host()?[0];
        let got = sum_sq_multi(&gs.iter().collect::<Vec<_>>())?.to_host()?[0];
        let mut row = compare(
            "sum_sq_multi (9 tensors, bf16)",
            &[got as f32],
            &[want as f32],
            F32_TIGHT,
        );
        row.note = format!("{} elements", sizes.iter().sum::<usize>());
        cx.push(row);
        // The same inputs give the same bits every time (no atomics in the reduction): a resumed
        // run must recompute the grad norm, and a clip decided by it, exactly.
        let gr = gs.iter().collect::<Vec<_>>();
        let (mut multi, mut single) = (
            std::collections::BTreeSet::new(),
            std::collections::BTreeSet::new(),
        );
        for _ in 0..20 {
            multi.insert(sum_sq_multi(&gr)?.to_host()?[0].to_bits());
            single.insert(sum_sq(&gs[8])?.to_bits());
        }
        let mut row = compare(
            "sum_sq_multi / sum_sq: 20 repeats",
            &[got as f32],
            &[got as f32],
            0.0,
        );
        row.pass &= multi.len() == 1 && single.len() == 1;
        row.note = format!(
            "{} and {} distinct results (1 = deterministic)",
            multi.len(),
            single.len()
        );
        cx.push(row);
    }
    // adamw_multi: bf16 gradients, a per-tensor lr, bf16 compute copies written and gradients
    // zeroed by the same kernel; also against the single-tensor adamw_step on the same device.
    {
        let f = DType::F32;
        let h = AdamW {
            lr: 0.0, // per tensor below
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 7,
            grad_scale: 0.5,
        };
        let lrs: Vec<f32> = (0..sizes.len()).map(|i| 1e-3 * (1 + i) as f32).collect();
        struct Set {
            p: Vec<Tensor>,
            g: Vec<Tensor>,
            m: Vec<Tensor>,
            v: Vec<Tensor>,
            c: Vec<Tensor>,
        }
        let mut host = Vec::new();
        for &n in &sizes {
            let (p, g, m) = (r.normals(n, 0.1), r.bnormals(n, 0.01), r.normals(n, 0.001));
            let v: Vec<f32> = r.normals(n, 1e-4).iter().map(|x| x.abs()).collect();
            host.push((p, g, m, v));
        }
        let make = |cpu: bool| -> Result<Set> {
            let mut s = Set {
                p: vec![],
                g: vec![],
                m: vec![],
                v: vec![],
                c: vec![],
            };
            for (p, g, m, v) in &host {
                let sh = [p.len()];
                let t = |x: &[f32], dt: DType| if cpu { cx.c(x, &sh) } else { cx.g(x, &sh, dt) };
                s.p.push(t(p, f)?);
                s.g.push(t(g, bf)?);
                s.m.push(t(m, f)?);
                s.v.push(t(v, f)?);
                s.c.push(t(&vec![0.0; p.len()], bf)?);
            }
            Ok(s)
        };
        // With `clip`, the multiplier comes from the gradients' squared norm on the device, with a
        // bound the norm exceeds (so the clip applies).
        let run = |s: &mut Set, clip: bool| -> Result<()> {
            let sum_sq = sum_sq_multi(&s.g.iter().collect::<Vec<_>>())?;
            let Set { p, g, m, v, c } = s;
            let mut items: Vec<AdamWItem> = p
                .iter_mut()
                .zip(g.iter_mut())
                .zip(m.iter_mut().zip(v.iter_mut()))
                .zip(c.iter_mut())
                .zip(&lrs)
                .map(|((((param, grad), (m, v)), c), &lr)| AdamWItem {
                    param,
                    grad,
                    m,
                    v,
                    compute: Some(c),
                    lr,
                })
                .collect();
            let clip = clip.then_some(NormClip {
                sum_sq: &sum_sq,
                average: 0.5,
                max_norm: 0.05,
            });
            adamw_multi(&mut items, h, clip)
        };
        let (mut want, mut got, mut single) = (make(true)?, make(false)?, make(false)?);
        run(&mut want, false)?;
        run(&mut got, false)?;
        let (mut want_clip, mut got_clip) = (make(true)?, make(false)?);
        run(&mut want_clip, true)?;
        run(&mut got_clip, true)?;
        let cat = |ts: &[Tensor]| -> Result<Vec<f32>> {
            let mut out = Vec::new();
            for t in ts {
                out.extend(t.to_vec()?);
            }
            Ok(out)
        };
        let gp = cat(&got.p)?;
        cx.push(compare(
            "adamw_multi param (f32)",
            &gp,
            &cat(&want.p)?,
            F32_TIGHT,
        ));
        let mut row = compare(
            "adamw_multi param, norm clip on the device (f32)",
            &cat(&got_clip.p)?,
            &cat(&want_clip.p)?,
            F32_TIGHT,
        );
        let sq: f64 = host
            .iter()
            .flat_map(|(_, g, _, _)| g)
            .map(|&x| x as f64 * x as f64)
            .sum();
        row.note = format!("clip factor {:.4}", clip_scale(sq, 0.5, 0.05) / 0.5);
        cx.push(row);
        cx.push(compare(
            "adamw_multi m (f32)",
            &cat(&got.m)?,
            &cat(&want.m)?,
            F32_TIGHT,
        ));
        cx.push(compare(
            "adamw_multi v (f32)",
            &cat(&got.v)?,
            &cat(&want.v)?,
            F32_TIGHT,
        ));
        // The compute copy is the device's own updated parameter in the copy's dtype, exactly.
        let own = if got.c[0].dtype() == bf {
            rb(&gp)
        } else {
            gp.clone()
        };
        cx.push(compare(
            "adamw_multi compute copy = param",
            &cat(&got.c)?,
            &own,
            0.0,
        ));
        let zeros = vec![0f32; gp.len()];
        cx.push(compare(
            "adamw_multi zeroes the gradients",
            &cat(&got.g)?,
            &zeros,
            0.0,
        ));
        // Single-tensor steps on the same device with the same inputs: the same arithmetic.
        for (i, lr) in lrs.iter().enumerate() {
            let (p, g) = (&mut single.p[i], &single.g[i]);
            adamw_step(
                p,
                g,
                &mut single.m[i],
                &mut single.v[i],
                AdamW { lr: *lr, ..h },
            )?;
        }
        let sp = cat(&single.p)?;
        let differ = gp
            .iter()
            .zip(&sp)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let mut row = compare(
            "adamw_multi vs adamw_step (same device)",
            &gp,
            &sp,
            F32_TIGHT,
        );
        row.note = format!("{differ} of {} params differ bitwise", gp.len());
        cx.push(row);
    }
    Ok(())
}

/// How much of a C far below half a bf16 ulp of the product survives an accumulate, on
/// average: the way a young LoRA term (C) meets the base product. With C = ulp/8 of each element's
/// rounded product, a sum rounded once moves an eighth of the elements one ulp up (share ~1); a
/// product rounded before C is added keeps none (share 0), and the LoRA update vanishes from the
/// forward. Two rows per shape (the layer's, a large one, a split-K one):
/// - cuBLASLt's bf16 epilogue (`matmul_acc` into a bf16 C), for information: on the H200 it kept
///   0.000 on every shape but the split-K one (0.98), 2026-12-02;
/// - `matmul_acc` into an f32 C, then one cast to bf16: must keep a share within [0.8, 1.2];
/// - `linear_fwd`'s sum (`lora_linear_rounded`, three row blocks) with a positive rank-8 term of
///   about ulp/8: the same bound on the share of the term kept.
fn gemm_epilogue(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let bf = DType::BF16;
    for (m, k, n) in [
        (512, 576, 576),
        (512, 576, 1536),
        (512, 1536, 576),
        (2048, 4096, 4096),
        (64, 14336, 1024),
    ] {
        let a = r.bnormals(m * k, 1.0);
        let b = r.bnormals(n * k, 0.05);
        let (ag, bg) = (cx.g(&a, &[m, k], bf)?, cx.g(&b, &[n, k], bf)?);
        let plain = matmul(&ag, false, &bg, true, 1.0, bf)?.to_vec()?;
        // An eighth of a bf16 ulp of each rounded product, itself exact in bf16 (a power of 2).
        let ulp = |v: f32| -> f32 {
            let e = ((v.to_bits() >> 23) & 0xff) as i32 - 127;
            2f32.powi(e - 7)
        };
        let c: Vec<f32> = plain.iter().map(|&v| ulp(v) / 8.0).collect();
        let share = |got: &[f32]| -> f64 {
            let (mut moved, mut total) = (0.0f64, 0.0f64);
            for ((&d, &p0), &ci) in got.iter().zip(&plain).zip(&c) {
                if p0 != 0.0 && p0.is_finite() {
                    moved += ((d - p0) / ci) as f64;
                    total += 1.0;
                }
            }
            moved / total
        };
        let mut epilogue = cx.g(&c, &[m, n], bf)?;
        matmul_acc(&mut epilogue, &ag, false, &bg, true, 1.0, 1.0)?;
        let mut once = cx.g(&c, &[m, n], DType::F32)?;
        matmul_acc(&mut once, &ag, false, &bg, true, 1.0, 1.0)?;
        let once = once.to_dtype(bf)?;
        for (what, got, gated) in [
            ("bf16 C (cuBLASLt epilogue, info)", epilogue, false),
            ("f32 C, one cast", once, true),
        ] {
            let s = share(&got.to_vec()?);
            let op = format!("matmul_acc {m}x{k}x{n} {what}: share of C kept");
            cx.push(share_row(op, s, gated, "a C of ulp/8"));
        }
        // linear_fwd's own sum: a positive rank-8 term of about an eighth of an ulp on average.
        // Rounding once moves each output by its term in expectation (where the f32 sum falls
        // within a bf16 interval is uniform), so the share Σ(y - plain) / Σ term is near 1.
        let rank = 8;
        let xa: Vec<f32> = r.bnormals(m * rank, 1.0).iter().map(|v| v.abs()).collect();
        let mean_c = c.iter().map(|&v| v as f64).sum::<f64>() / c.len() as f64;
        let lb: Vec<f32> = rb(&r
            .normals(n * rank, 1.0)
            .iter()
            .map(|v| v.abs() * (mean_c / (2.0 * rank as f64 * 0.8)) as f32)
            .collect::<Vec<_>>());
        let term = matmul(
            &cx.c(&xa, &[m, rank])?,
            false,
            &cx.c(&lb, &[n, rank])?,
            true,
            2.0,
            DType::F32,
        )?
        .to_vec()?;
        let got = lora_linear_rounded(
            &ag,
            Cols::all(&bg),
            Cols::all(&cx.g(&xa, &[m, rank], bf)?),
            &cx.g(&lb, &[n, rank], bf)?,
            2.0,
            bf,
            m.div_ceil(3),
            true,
        )?
        .to_vec()?;
        let (mut moved, mut total) = (0.0f64, 0.0f64);
        for ((&y, &p0), &ti) in got.iter().zip(&plain).zip(&term) {
            if p0 != 0.0 && p0.is_finite() {
                moved += (y - p0) as f64;
                total += ti as f64;
            }
        }
        let s = moved / total;
        let how = if adapter_fold_pays(m, k, n, rank) {
            "folded"
        } else {
            "f32 sum"
        };
        let op = format!(
            "lora_linear_rounded {m}x{k}x{n} r{rank} (linear_fwd, {how}): share of term kept"
        );
        cx.push(share_row(op, s, true, "a term of about ulp/8"));
    }
    Ok(())
}

/// A `gemm_epilogue` row: the share `s` of `what` that survived the rounding, within [0.8, 1.2]
/// when `gated` (else for information).
fn share_row(op: String, s: f64, gated: bool, what: &str) -> ParityRow {
    ParityRow {
        op,
        max_abs: s,
        rel: (s - 1.0).abs(),
        worst: 0,
        bound: 0.2,
        pass: (0.8..=1.2).contains(&s) || !gated,
        ms: None,
        note: format!("{s:.3} of {what} kept (1: rounded once, 0: rounded away)"),
    }
}

fn gemm(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let bf = DType::BF16;
    let (m, k, n) = (67, 96, 80);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let a = r.bnormals(m * k, 1.0);
        let b = r.bnormals(k * n, 1.0);
        let ash = if ta { [k, m] } else { [m, k] };
        let bsh = if tb { [n, k] } else { [k, n] };
        let want = matmul(&cx.c(&a, &ash)?, ta, &cx.c(&b, &bsh)?, tb, 0.5, DType::F32)?;
        let (ag, bg) = (cx.g(&a, &ash, bf)?, cx.g(&b, &bsh, bf)?);
        for odt in [bf, DType::F32] {
            let got = matmul(&ag, ta, &bg, tb, 0.5, odt)?;
            let bound = if odt == bf { BF16_FWD } else { F32_STAT };
            let row = cmp_t(
                &format!("matmul bf16 ta={ta} tb={tb} -> {odt:?}"),
                &got,
                &want,
                bound,
            )?;
            cx.push(row);
        }
        let got = matmul(
            &cx.g(&a, &ash, DType::F32)?,
            ta,
            &cx.g(&b, &bsh, DType::F32)?,
            tb,
            0.5,
            DType::F32,
        )?;
        let row = cmp_t(
            &format!("matmul f32 ta={ta} tb={tb}"),
            &got,
            &want,
            F32_TIGHT,
        )?;
        cx.push(row);
    }
    // matmul_acc with beta into f32, and a mixed bf16 x f32 product
    {
        let a = r.bnormals(m * k, 1.0);
        let b = r.normals(k * n, 1.0);
        let c0 = r.normals(m * n, 1.0);
        let mut want = cx.c(&c0, &[m, n])?;
        matmul_acc(
            &mut want,
            &cx.c(&a, &[m, k])?,
            false,
            &cx.c(&b, &[k, n])?,
            false,
            1.5,
            0.25,
        )?;
        let mut got = cx.g(&c0, &[m, n], DType::F32)?;
        matmul_acc(
            &mut got,
            &cx.g(&a, &[m, k], bf)?,
            false,
            &cx.g(&b, &[k, n], DType::F32)?,
            false,
            1.5,
            0.25,
        )?;
        let row = cmp_t(
            "matmul_acc bf16 x f32 += f32 (beta)",
            &got,
            &want,
            F32_TIGHT,
        )?;
        cx.push(row);
    }
    // linear_fwd's LoRA sum rounded once against the f32 reference: a rank the rounding kernel
    // adds itself and one above FUSED_LORA_RANK_MAX (cuBLAS adds it), both in several row
    // blocks, with rows and columns off the kernel's tiles; xa in f32 beside a bf16 B too, at a
    // small rank and above the fused ones (there both are widened for cuBLAS). Then the same
    // sums with the adapter folded into the base product (`lora_linear_folded`, bf16 operands),
    // in row blocks, a width off 16 bytes (the packing kernel's scalar path) and into f32 (o and
    // down's output). A scale of 0.75 is rounded into B there (bf16: within the bf16 bound); the
    // f32 row takes 2, exact in B, so that only the order of the f32 sums differs.
    // Rows marked `win` read xa in place as columns [8, 8 + rank) of a wider product, as the
    // projections of a shared-input group do.
    for (t, k, n, rank, block, xa_dt, fold, out_dt, scale, win) in [
        (333, 96, 300, 16, 100, bf, false, bf, 0.75, false),
        (333, 96, 300, 80, 128, bf, false, bf, 0.75, false),
        (70, 64, 520, 3, 70, DType::F32, false, bf, 0.75, false),
        (90, 64, 200, 72, 40, DType::F32, false, bf, 0.75, false),
        (333, 96, 300, 16, 100, bf, true, bf, 0.75, false),
        (333, 96, 300, 80, 700, bf, true, bf, 0.75, false),
        (301, 92, 500, 3, 301, bf, true, bf, 0.75, false),
        (333, 96, 300, 16, 100, bf, true, DType::F32, 2.0, false),
        (333, 96, 300, 16, 100, bf, false, bf, 0.75, true),
        (333, 96, 300, 16, 100, bf, true, bf, 0.75, true),
        (70, 64, 520, 3, 70, DType::F32, false, bf, 0.75, true),
    ] {
        let x = r.bnormals(t * k, 1.0);
        let w = r.bnormals(n * k, 0.1);
        let xa = r.bnormals(t * rank, 1.0);
        let lb = r.bnormals(n * rank, 0.1);
        let want = lora_linear_rounded(
            &cx.c(&x, &[t, k])?,
            Cols::all(&cx.c(&w, &[n, k])?),
            Cols::all(&cx.c(&xa, &[t, rank])?),
            &cx.c(&lb, &[n, rank])?,
            scale,
            DType::F32,
            t,
            false,
        )?;
        let (xa_g, cols) = if win {
            let wide = rank + 24;
            let mut v = r.bnormals(t * wide, 1.0);
            for (i, row) in xa.chunks(rank).enumerate() {
                v[i * wide + 8..i * wide + 8 + rank].copy_from_slice(row);
            }
            (cx.g(&v, &[t, wide], xa_dt)?, 8..8 + rank)
        } else {
            (cx.g(&xa, &[t, rank], xa_dt)?, 0..rank)
        };
        let got = lora_linear_rounded(
            &cx.g(&x, &[t, k], bf)?,
            Cols::all(&cx.g(&w, &[n, k], bf)?),
            Cols {
                t: &xa_g,
                start: cols.start,
                end: cols.end,
            },
            &cx.g(&lb, &[n, rank], bf)?,
            scale,
            out_dt,
            block,
            fold,
        )?;
        ensure!(
            !fold || adapter_fold_pays(t, k, n, rank),
            "parity row {t}x{k}x{n} r{rank}: folding would not pay, so the row would not fold"
        );
        let how = if fold { "folded" } else { "f32 sum" };
        let bound = if out_dt == bf { BF16_FWD } else { F32_STAT };
        let row = cmp_t(
            &format!(
                "lora_linear_rounded {t}x{k}x{n} r{rank} {how} blocks of {block} xa {xa_dt:?}{} -> {out_dt:?}",
                if win { " (columns of a wider product)" } else { "" }
            ),
            &got,
            &want,
            bound,
        )?;
        cx.push(row);
        if !fold || xa_dt != bf {
            continue;
        }
        // The same sum from a weight stored with room for its adapter (`extend_cols`,
        // `write_adapter_cols`, `lora_linear_extended`: no copy of W), those columns first
        // holding another adapter's B, which the write must replace whole.
        let pad = (rank + 5).next_multiple_of(8);
        let w_ext = extend_cols(&cx.g(&w, &[n, k], bf)?, pad)?;
        let (lb_g, wk) = (cx.g(&lb, &[n, rank], bf)?, k..k + pad);
        let other = cx.g(&r.bnormals(n * rank, 0.1), &[n, rank], bf)?;
        write_adapter_cols(&w_ext, wk.clone(), 2, &other, 3.0)?;
        write_adapter_cols(&w_ext, wk, 0, &lb_g, scale)?;
        let xa_win = Cols {
            t: &xa_g,
            start: cols.start,
            end: cols.end,
        };
        let x_g = cx.g(&x, &[t, k], bf)?;
        let got = lora_linear_extended(&x_g, &w_ext, xa_win, out_dt, block)?;
        let row = cmp_t(
            &format!(
                "lora_linear_extended {t}x{k}x{n} r{rank} in {pad} columns blocks of {block}{} -> {out_dt:?}",
                if win { " (xa columns of a wider product)" } else { "" }
            ),
            &got,
            &want,
            bound,
        )?;
        cx.push(row);
        if win {
            // A shared-input group's form: the whole wider product packed after x once
            // (`pack_input`), this adapter's B at its columns' place in the weight, one GEMM.
            let wide = xa_g.rows_cols().1;
            let kd = k + wide.next_multiple_of(8);
            let w_grp = extend_cols(&cx.g(&w, &[n, k], bf)?, kd - k)?;
            write_adapter_cols(&w_grp, k..kd, cols.start, &lb_g, scale)?;
            let x_ext = pack_input(&x_g, Cols::all(&xa_g), kd, None)?;
            let got = matmul(&x_ext, false, &w_grp, true, 1.0, out_dt)?;
            let row = cmp_t(
                &format!("pack_input and the group's product {t}x{k}x{n} r{rank} at column {} of {wide} -> {out_dt:?}", cols.start),
                &got,
                &want,
                bound,
            )?;
            cx.push(row);
            // With a bias in the weight's column after the adapters' and 1 in the input's:
            // the product adds it in its f32 sum.
            let bias = r.bnormals(n, 0.5);
            let kd = kd + 8;
            let w_grp = extend_cols(&cx.g(&w, &[n, k], bf)?, kd - k)?;
            write_adapter_cols(&w_grp, k..kd - 8, cols.start, &lb_g, scale)?;
            let bias_col = cx.g(&bias, &[n, 1], bf)?;
            write_adapter_cols(&w_grp, kd - 8..kd - 7, 0, &bias_col, 1.0)?;
            let x_ext = pack_input(&x_g, Cols::all(&xa_g), kd, Some(kd - 8))?;
            let got = matmul(&x_ext, false, &w_grp, true, 1.0, out_dt)?;
            let mut want_b = want.try_clone()?;
            add_bias(&mut want_b, &cx.c(&bias, &[n])?)?;
            let row = cmp_t(
                &format!("pack_input and the group's product {t}x{k}x{n} r{rank} with its bias -> {out_dt:?}"),
                &got,
                &want_b,
                bound,
            )?;
            cx.push(row);
        }
    }
    // An adapter of a rank past a stored weight's adapter columns: the sum with W read as the
    // first columns of the wider matrix, folded (its copy made from the window) and not.
    for fold in [false, true] {
        let (t, k, n, rank) = (333, 96, 300, 24);
        let (x, w) = (r.bnormals(t * k, 1.0), r.bnormals(n * k, 0.1));
        let (xa, lb) = (r.bnormals(t * rank, 1.0), r.bnormals(n * rank, 0.1));
        let want = lora_linear_rounded(
            &cx.c(&x, &[t, k])?,
            Cols::all(&cx.c(&w, &[n, k])?),
            Cols::all(&cx.c(&xa, &[t, rank])?),
            &cx.c(&lb, &[n, rank])?,
            0.75,
            DType::F32,
            t,
            false,
        )?;
        let w_ext = extend_cols(&cx.g(&w, &[n, k], bf)?, 16)?;
        let got = lora_linear_rounded(
            &cx.g(&x, &[t, k], bf)?,
            Cols {
                t: &w_ext,
                start: 0,
                end: k,
            },
            Cols::all(&cx.g(&xa, &[t, rank], bf)?),
            &cx.g(&lb, &[n, rank], bf)?,
            0.75,
            bf,
            100,
            fold,
        )?;
        let how = if fold { "folded" } else { "f32 sum" };
        let row = cmp_t(
            &format!(
                "lora_linear_rounded {t}x{k}x{n} r{rank} {how}, W the columns of a wider matrix"
            ),
            &got,
            &want,
            BF16_FWD,
        )?;
        cx.push(row);
    }
    // write_adapter_cols: W's columns untouched, the adapter's `scale · b` rounded as the
    // packing kernel rounds it at its place, zeros around it (what an earlier write left there
    // included); pack_input against the CPU's copies, a width off 16 bytes (the scalar path).
    for (n, k, rank, pad, at, scale) in [
        (40usize, 24usize, 3usize, 8usize, 0usize, 0.75f32),
        (33, 16, 16, 16, 0, 2.0),
        (37, 24, 5, 16, 9, 0.75),
    ] {
        let w = r.bnormals(n * k, 0.5);
        let lb = r.bnormals(n * rank, 0.5);
        let mut want = vec![0f32; n * (k + pad)];
        for i in 0..n {
            want[i * (k + pad)..i * (k + pad) + k].copy_from_slice(&w[i * k..(i + 1) * k]);
            for j in 0..rank {
                let v = half::bf16::from_f32(scale * lb[i * rank + j]).to_f32();
                want[i * (k + pad) + k + at + j] = v;
            }
        }
        let w_ext = extend_cols(&cx.g(&w, &[n, k], bf)?, pad)?;
        let first = cx.g(&r.bnormals(n * pad, 1.0), &[n, pad], bf)?;
        write_adapter_cols(&w_ext, k..k + pad, 0, &first, 1.0)?;
        write_adapter_cols(&w_ext, k..k + pad, at, &cx.g(&lb, &[n, rank], bf)?, scale)?;
        let row = cmp_t(
            &format!("write_adapter_cols {n}x{k} r{rank} at {at} of {pad} columns"),
            &w_ext,
            &cx.c(&want, &[n, k + pad])?,
            0.0,
        )?;
        cx.push(row);
        // The same write among others in one launch (write_adapter_cols_multi).
        let (w_ext, other) = (
            extend_cols(&cx.g(&w, &[n, k], bf)?, pad)?,
            cx.g(&w, &[n, k], bf)?,
        );
        let other_ext = extend_cols(&other, pad)?;
        let lb_g = cx.g(&lb, &[n, rank], bf)?;
        let first = cx.g(&r.bnormals(n * pad, 1.0), &[n, pad], bf)?;
        write_adapter_cols(&w_ext, k..k + pad, 0, &first, 1.0)?;
        let item = |w_ext, at, b, scale| AdapterCols {
            w_ext,
            cols: k..k + pad,
            at,
            b,
            scale,
        };
        write_adapter_cols_multi(&[
            item(&other_ext, 0, &first, 0.5),
            item(&w_ext, at, &lb_g, scale),
        ])?;
        let row = cmp_t(
            &format!("write_adapter_cols_multi {n}x{k} r{rank} at {at} of {pad} columns"),
            &w_ext,
            &cx.c(&want, &[n, k + pad])?,
            0.0,
        )?;
        cx.push(row);
        let (xa, kd) = (r.bnormals(n * rank, 1.0), k + pad + 3);
        let one_at = (at > 0).then_some(kd - 2);
        let want = pack_input(
            &cx.c(&w, &[n, k])?,
            Cols::all(&cx.c(&xa, &[n, rank])?),
            kd,
            one_at,
        )?;
        let got = pack_input(
            &cx.g(&w, &[n, k], bf)?,
            Cols::all(&cx.g(&xa, &[n, rank], bf)?),
            kd,
            one_at,
        )?;
        let row = cmp_t(
            &format!("pack_input {n}x{k} + {rank} into {kd}, 1 at {one_at:?}"),
            &got,
            &want,
            0.0,
        )?;
        cx.push(row);
    }
    // matmul_acc_cols: operands and output as column windows of wider matrices (in place on the
    // GPU), transposed or not, into bf16 and f32 with and without beta, against the CPU's copies;
    // the columns outside the output's window must come back as they were. The last row's
    // window starts off 16 bytes (the copying path).
    for (m, k, n, ta, tb, cdt, beta, c0) in [
        (
            300usize, 64usize, 48usize, false, false, bf, 0.0f32, 16usize,
        ),
        (48, 300, 64, true, false, DType::F32, 1.0, 16),
        (300, 48, 16, false, true, bf, 1.0, 8),
        (300, 40, 16, false, false, bf, 0.0, 3),
    ] {
        let a_st = if ta { (k, m) } else { (m, k) };
        let b_st = if tb { (n, k) } else { (k, n) };
        let (aw, bw, cw) = (a_st.1 + 16, b_st.1 + 24, n + 40);
        let av = r.bnormals(a_st.0 * aw, 1.0);
        let bv = r.bnormals(b_st.0 * bw, 1.0);
        let cv = r.bnormals(m * cw, 1.0);
        let run = |on_gpu: bool| -> Result<Tensor> {
            let mk = |v: &[f32], shape: &[usize], dt: DType| cx.on(on_gpu, v, shape, dt);
            let a = mk(&av, &[a_st.0, aw], bf)?;
            let b = mk(&bv, &[b_st.0, bw], bf)?;
            let mut c = mk(&cv, &[m, cw], cdt)?;
            let (a, b) = (
                Cols {
                    t: &a,
                    start: 8,
                    end: 8 + a_st.1,
                },
                Cols {
                    t: &b,
                    start: 16,
                    end: 16 + b_st.1,
                },
            );
            matmul_acc_cols(&mut c, c0..c0 + n, a, ta, b, tb, 0.5, beta)?;
            Ok(c)
        };
        let (got, want) = (run(true)?, run(false)?);
        let row = cmp_t(
            &format!(
                "matmul_acc_cols {m}x{k}x{n} {}{} -> {cdt:?} beta {beta} at column {c0}",
                if ta { "T" } else { "N" },
                if tb { "T" } else { "N" }
            ),
            &got,
            &want,
            if cdt == bf { BF16_FWD } else { F32_STAT },
        )?;
        cx.push(row);
    }
    // matmul_onto: the output a new tensor, C a column window of a wider matrix read in place
    // (cuBLASLt's C apart from its D on the GPU), against the CPU's copy and accumulation; the
    // last row's window starts off 16 bytes (the copying path).
    for (m, k, n, cdt, beta, c0) in [
        (300usize, 48usize, 64usize, bf, 1.0f32, 16usize),
        (200, 32, 96, DType::F32, 1.0, 8),
        (300, 48, 64, bf, 0.0, 40),
        (300, 40, 16, bf, 1.0, 3),
    ] {
        let (aw, cw) = (k + 16, n + 40);
        let av = r.bnormals(m * aw, 1.0);
        let bv = r.bnormals(k * n, 1.0);
        let cv = r.bnormals(m * cw, 1.0);
        let run = |on_gpu: bool| -> Result<Tensor> {
            let mk = |v: &[f32], shape: &[usize], dt: DType| cx.on(on_gpu, v, shape, dt);
            let (a, b, c) = (
                mk(&av, &[m, aw], bf)?,
                mk(&bv, &[k, n], bf)?,
                mk(&cv, &[m, cw], cdt)?,
            );
            let (a, c) = (
                Cols {
                    t: &a,
                    start: 8,
                    end: 8 + k,
                },
                Cols {
                    t: &c,
                    start: c0,
                    end: c0 + n,
                },
            );
            matmul_onto(c, a, false, Cols::all(&b), false, 0.5, beta)
        };
        let (got, want) = (run(true)?, run(false)?);
        let row = cmp_t(
            &format!("matmul_onto {m}x{k}x{n} -> {cdt:?} beta {beta}, C at column {c0}"),
            &got,
            &want,
            if cdt == bf { BF16_FWD } else { F32_STAT },
        )?;
        cx.push(row);
    }
    // lora_linear_onto: the down projection with the f32 residual added inside its products
    // (and residual scales 1 and 0.25), against the CPU's sum then add.
    for (t, k, n, rank, rs) in [
        (333usize, 384usize, 64usize, 16usize, 1.0f32),
        (200, 192, 64, 8, 0.25),
    ] {
        let x = r.bnormals(t * k, 1.0);
        let w = r.bnormals(n * k, 0.1);
        let xa = r.bnormals(t * rank, 1.0);
        let lb = r.bnormals(n * rank, 0.1);
        let res = r.normals(t * n, 1.0);
        ensure!(
            !adapter_fold_pays(t, k, n, rank),
            "parity row {t}x{k}x{n} r{rank}: the adapter would fold, so the residual would not join the products"
        );
        let run = |on_gpu: bool| -> Result<Tensor> {
            let mk = |v: &[f32], shape: &[usize], dt: DType| cx.on(on_gpu, v, shape, dt);
            let (xt, wt, xat, bt) = (
                mk(&x, &[t, k], bf)?,
                mk(&w, &[n, k], bf)?,
                mk(&xa, &[t, rank], bf)?,
                mk(&lb, &[n, rank], bf)?,
            );
            let rest = mk(&res, &[t, n], DType::F32)?;
            lora_linear_onto(&rest, rs, &xt, Cols::all(&wt), Cols::all(&xat), &bt, 2.0, t)
        };
        let (got, want) = (run(true)?, run(false)?);
        let row = cmp_t(
            &format!("lora_linear_onto {t}x{k}x{n} r{rank} residual scale {rs} (f32)"),
            &got,
            &want,
            F32_STAT,
        )?;
        cx.push(row);
    }
    // and its throughput at a long sequence's gate (two blocks, as linear_fwd sizes them at
    // 18432 rows would be four), beside the base product alone, at ranks 16 and 64 (the kernel's
    // dot) and 128 (cuBLAS adds the term): what FUSED_LORA_RANK_MAX weighs
    {
        let (t, k, n) = (8192, 4096, 14336);
        let x = cx.g(&r.bnormals(t * k, 1.0), &[t, k], bf)?;
        let w = cx.g(&r.bnormals(n * k, 0.02), &[n, k], bf)?;
        let base_ms = cx.time(5, || matmul(&x, false, &w, true, 1.0, bf).map(|_| ()))?;
        for rank in [16, 64, 128] {
            let xa = cx.g(&r.bnormals(t * rank, 1.0), &[t, rank], bf)?;
            let lb = cx.g(&r.bnormals(n * rank, 0.02), &[n, rank], bf)?;
            for fold in [false, true] {
                let ms = cx.time(5, || {
                    lora_linear_rounded(
                        &x,
                        Cols::all(&w),
                        Cols::all(&xa),
                        &lb,
                        2.0,
                        bf,
                        t / 2,
                        fold,
                    )
                    .map(|_| ())
                })?;
                let how = if fold {
                    "folded"
                } else {
                    "f32 sum in 2 blocks"
                };
                cx.push(timing(
                    &format!("lora_linear_rounded 8192x4096x14336 r{rank} ({how})"),
                    ms,
                    format!(
                        "base product alone {base_ms:.3} ms: {:+.3} ms",
                        ms - base_ms
                    ),
                ));
            }
        }
    }
    // a big shape: sampled rows of C compared, and the throughput
    {
        let (m, k, n) = (4096, 1536, 8960);
        let a = r.bnormals(m * k, 1.0);
        let b = r.bnormals(n * k, 1.0);
        let (ag, bg) = (cx.g(&a, &[m, k], bf)?, cx.g(&b, &[n, k], bf)?);
        let got = matmul(&ag, false, &bg, true, 1.0, bf)?.to_vec()?;
        let rows: Vec<usize> = (0..48).map(|_| r.below(m)).collect();
        let mut asub = Vec::with_capacity(rows.len() * k);
        let mut gsub = Vec::with_capacity(rows.len() * n);
        for &i in &rows {
            asub.extend_from_slice(&a[i * k..(i + 1) * k]);
            gsub.extend_from_slice(&got[i * n..(i + 1) * n]);
        }
        let want = matmul(
            &cx.c(&asub, &[rows.len(), k])?,
            false,
            &cx.c(&b, &[n, k])?,
            true,
            1.0,
            DType::F32,
        )?;
        let mut row = compare(
            "matmul 4096x1536x8960 bf16 (48 rows)",
            &gsub,
            &want.to_vec()?,
            BF16_FWD,
        );
        let ms = cx.time(10, || matmul(&ag, false, &bg, true, 1.0, bf).map(|_| ()))?;
        row.ms = Some(ms);
        row.note = format!("{:.0} TFLOP/s", 2.0 * (m * k * n) as f64 / ms / 1e9);
        cx.push(row);
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Dequantisation: a minimal host decoder of each ggml layout, for this check only.

fn f16b(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

fn host_dequant(kind: QuantKind, q: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    let (be, bb) = kind.block();
    for blk in 0..n / be {
        let b = &q[blk * bb..(blk + 1) * bb];
        let out = &mut y[blk * be..(blk + 1) * be];
        match kind {
            QuantKind::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            QuantKind::F16 => out[0] = f16b(b),
            QuantKind::BF16 => {
                out[0] = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }
            QuantKind::Q8_0 => {
                for j in 0..32 {
                    out[j] = f16b(b) * (b[2 + j] as i8) as f32;
                }
            }
            QuantKind::Q4_0 => {
                for j in 0..16 {
                    out[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * f16b(b);
                    out[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * f16b(b);
                }
            }
            QuantKind::Q4_1 => {
                for j in 0..16 {
                    out[j] = (b[4 + j] & 0xF) as f32 * f16b(b) + f16b(&b[2..]);
                    out[j + 16] = (b[4 + j] >> 4) as f32 * f16b(b) + f16b(&b[2..]);
                }
            }
            QuantKind::Q4_K => {
                let (d, dmin) = (f16b(b), f16b(&b[2..]));
                let sc = &b[4..16];
                let scale_min = |j: usize| -> (u8, u8) {
                    if j < 4 {
                        (sc[j] & 63, sc[j + 4] & 63)
                    } else {
                        (
                            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
                            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
                        )
                    }
                };
                let qs = &b[16..];
                for c in 0..4 {
                    let (s1, m1) = scale_min(2 * c);
                    let (s2, m2) = scale_min(2 * c + 1);
                    for l in 0..32 {
                        out[64 * c + l] =
                            d * s1 as f32 * (qs[32 * c + l] & 0xF) as f32 - dmin * m1 as f32;
                        out[64 * c + 32 + l] =
                            d * s2 as f32 * (qs[32 * c + l] >> 4) as f32 - dmin * m2 as f32;
                    }
                }
            }
            QuantKind::Q6_K => {
                let d = f16b(&b[208..]);
                for half in 0..2 {
                    let ql = &b[64 * half..];
                    let qh = &b[128 + 32 * half..];
                    let sc = &b[192 + 8 * half..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let o = &mut out[128 * half..];
                        o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
    y
}

fn dequant(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let Device::Cuda(be) = cx.dev else {
        return Ok(());
    };
    let (rows, cols) = (24, 512);
    let n = rows * cols;
    for kind in [
        QuantKind::F32,
        QuantKind::F16,
        QuantKind::BF16,
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q4_K,
        QuantKind::Q6_K,
    ] {
        let (bel, bb) = kind.block();
        let mut bytes: Vec<u8> = (0..n / bel * bb).map(|_| r.next() as u8).collect();
        // Keep the f16/f32 scale fields finite and moderate.
        for blk in 0..n / bel {
            let b = &mut bytes[blk * bb..(blk + 1) * bb];
            let mut put16 = |off: usize, v: f32| {
                b[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes())
            };
            match kind {
                QuantKind::F16 => put16(0, r.normal()),
                QuantKind::Q8_0 | QuantKind::Q4_0 => put16(0, 0.01 * r.normal()),
                QuantKind::Q4_1 => {
                    put16(0, 0.01 * r.normal());
                    put16(2, 0.01 * r.normal());
                }
                QuantKind::Q4_K => {
                    put16(0, 0.001 * r.normal());
                    put16(2, 0.001 * r.normal());
                }
                QuantKind::Q6_K => put16(208, 0.001 * r.normal()),
                QuantKind::F32 => b.copy_from_slice(&r.normal().to_le_bytes()),
                QuantKind::BF16 => {
                    b.copy_from_slice(&half::bf16::from_f32(r.normal()).to_bits().to_le_bytes())
                }
            }
        }
        let want = rb(&host_dequant(kind, &bytes, n));
        let dq = be.upload_bytes(&bytes)?;
        let got = be.dequantize(&dq, kind, rows, cols)?.to_vec()?;
        cx.push(compare(
            &format!("dequantize {kind:?} -> bf16"),
            &got,
            &want,
            1e-6,
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Attention

/// Reference rows for the largest shapes: o, lse and dq of query `i`, head `h`, computed directly
/// from the visible keys (the backward uses the given `o` and `lse`, as the op does).
#[allow(clippy::too_many_arguments)]
fn ref_rows(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
    o_in: &[f32],
    lse_in: &[f32],
    mask: &AttnMask,
    s: AttnShape,
    h: usize,
    i: usize,
) -> (Vec<f32>, f32, Vec<f32>) {
    let t = mask.len();
    let hd = s.head_dim;
    let (qw, kw) = (s.n_heads * hd, s.n_kv_heads * hd);
    let kvh = h / (s.n_heads / s.n_kv_heads);
    let qi = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
    let doi = &d_o[i * qw + h * hd..i * qw + (h + 1) * hd];
    let oi = &o_in[i * qw + h * hd..i * qw + (h + 1) * hd];
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum::<f64>()
    };
    let vis: Vec<usize> = (0..t).filter(|&j| mask.visible(i, j)).collect();
    // Scores c·tanh(x/c) with a softcap, and their derivative (1 - tanh²) for dS.
    let cap = |x: f64| match s.softcap {
        Some(c) => {
            let th = (x / c as f64).tanh();
            (c as f64 * th, 1.0 - th * th)
        }
        None => (x, 1.0),
    };
    let raw: Vec<f64> = vis
        .iter()
        .map(|&j| s.scale as f64 * dot(qi, &k[j * kw + kvh * hd..j * kw + (kvh + 1) * hd]))
        .collect();
    let sc: Vec<f64> = raw.iter().map(|&x| cap(x).0).collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let l: f64 = sc.iter().map(|x| (x - m).exp()).sum();
    let lse = m + l.ln();
    let mut o = vec![0f64; hd];
    for (&j, &x) in vis.iter().zip(&sc) {
        let p = (x - lse).exp();
        for d in 0..hd {
            o[d] += p * v[j * kw + kvh * hd + d] as f64;
        }
    }
    let big_d = dot(doi, oi);
    let lse_g = lse_in[h * t + i] as f64;
    let mut dq = vec![0f64; hd];
    for ((&j, &x), &r) in vis.iter().zip(&sc).zip(&raw) {
        let p = (x - lse_g).exp();
        let dp = dot(doi, &v[j * kw + kvh * hd..j * kw + (kvh + 1) * hd]);
        let ds = p * (dp - big_d) * cap(r).1;
        for d in 0..hd {
            dq[d] += s.scale as f64 * ds * k[j * kw + kvh * hd + d] as f64;
        }
    }
    (
        o.iter().map(|&x| x as f32).collect(),
        lse as f32,
        dq.iter().map(|&x| x as f32).collect(),
    )
}

/// RMSNorm forward (y, rstd) and backward rows on bf16 `[rows, h]`; returns the weight and the
/// upstream gradient it drew, for the fused forms.
fn rms_norm_rows(
    cx: &mut Ctx,
    r: &mut Rng,
    rows: usize,
    h: usize,
    label: &str,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let bf = DType::BF16;
    let x = r.bnormals(rows * h, 2.0);
    let w = rb(&(0..h).map(|_| 1.0 + 0.3 * r.normal()).collect::<Vec<_>>());
    let (yc, sc) = rms_norm(&cx.c(&x, &[rows, h])?, &cx.c(&w, &[h])?, 1e-6)?;
    let (xg, wg) = (cx.g(&x, &[rows, h], bf)?, cx.g(&w, &[h], bf)?);
    let (yg, sg) = rms_norm(&xg, &wg, 1e-6)?;
    let row = cmp_t(&format!("rms_norm fwd y{label}"), &yg, &yc, BF16_FWD)?;
    cx.push(row);
    let row = cmp_t(
        &format!("rms_norm fwd rstd (f32){label}"),
        &sg,
        &sc,
        F32_STAT,
    )?;
    cx.push(row);
    let dy = r.bnormals(rows * h, 1.0);
    let want = rms_norm_bwd(
        &cx.c(&dy, &[rows, h])?,
        &cx.c(&x, &[rows, h])?,
        &cx.c(&w, &[h])?,
        &sc,
    )?;
    let got = rms_norm_bwd(
        &cx.g(&dy, &[rows, h], bf)?,
        &xg,
        &wg,
        &cx.g(&sc.to_vec()?, &[rows], DType::F32)?,
    )?;
    let row = cmp_t(&format!("rms_norm bwd dx{label}"), &got, &want, BF16_GRAD)?;
    cx.push(row);
    Ok((w, dy))
}

fn visible_pairs(mask: &AttnMask) -> f64 {
    (0..mask.len()).map(|i| mask.visible_count(i) as f64).sum()
}

fn attention_suite(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    // (T, heads, kv heads, head_dim, mask, label); the softcap cases follow.
    let mut cases: Vec<(usize, usize, usize, usize, AttnMask, &str)> = vec![
        (1, 4, 4, 16, AttnMask::causal(1), "causal"),
        (17, 4, 1, 24, AttnMask::causal(17), "causal"),
        (17, 2, 2, 16, AttnMask::prefix_shared(5, 7, 5), "prefix"),
        (128, 4, 4, 64, AttnMask::causal(128), "causal"),
        (
            128,
            8,
            2,
            128,
            AttnMask::prefix_shared(40, 50, 38),
            "prefix",
        ),
        (1000, 4, 1, 64, AttnMask::causal(1000), "causal"),
        (
            1000,
            4,
            4,
            128,
            AttnMask::prefix_shared(300, 400, 300),
            "prefix",
        ),
        (
            1000,
            4,
            1,
            128,
            AttnMask::causal(1000).with_window(Some(256)),
            "window256",
        ),
        (
            1000,
            2,
            2,
            16,
            AttnMask::prefix_shared(200, 500, 300).with_window(Some(100)),
            "prefix+window100",
        ),
        (1000, 3, 3, 96, AttnMask::causal(1000), "causal"),
        (4096, 4, 1, 128, AttnMask::causal(4096), "causal"),
        // Head_dim 256 (Gemma): GQA 8/4, prefix-shared, a window shorter than T.
        (1000, 8, 4, 256, AttnMask::causal(1000), "causal"),
        (
            1000,
            8,
            4,
            256,
            AttnMask::prefix_shared(300, 400, 300).with_window(Some(256)),
            "prefix+window256",
        ),
        // Head_dim 512 (Gemma 4's global layers, version 7): GQA 8/2; T = 17 (one partial tile
        // of every kind), causal, prefix-shared with a window shorter than T, and a full CPU
        // check at T = 4096 (prompt 1024, responses 1536).
        (17, 8, 2, 512, AttnMask::causal(17), "causal"),
        (1000, 8, 2, 512, AttnMask::causal(1000), "causal"),
        (
            1000,
            8,
            2,
            512,
            AttnMask::prefix_shared(300, 400, 300).with_window(Some(256)),
            "prefix+window256",
        ),
        (
            4096,
            8,
            2,
            512,
            AttnMask::prefix_shared(1024, 1536, 1536),
            "prefix",
        ),
    ];
    // Softcapped: (…, softcap, query scale). Cap 5 with queries drawn at 3 (scores of standard
    // deviation 3: a third of them past the tanh's knee, |s| > c/2) puts the cap to work; cap 50
    // with plain scores is Gemma 2's setting. Every kernel family and head dim: version 1 (d 24,
    // 16), the mma.sync ones at 64 and 128 (each forced version below), version 5 at 128, 256.
    type Capped = (usize, usize, usize, usize, AttnMask, &'static str, f32, f32);
    let capped: Vec<Capped> = vec![
        (17, 4, 1, 24, AttnMask::causal(17), "causal", 5.0, 3.0),
        (
            1000,
            2,
            2,
            16,
            AttnMask::prefix_shared(200, 500, 300).with_window(Some(100)),
            "prefix+window100",
            5.0,
            3.0,
        ),
        (128, 4, 4, 64, AttnMask::causal(128), "causal", 5.0, 3.0),
        (
            1000,
            8,
            2,
            128,
            AttnMask::prefix_shared(300, 400, 300),
            "prefix",
            5.0,
            3.0,
        ),
        (
            1000,
            4,
            1,
            128,
            AttnMask::causal(1000).with_window(Some(256)),
            "window256",
            50.0,
            1.0,
        ),
        (
            1000,
            8,
            4,
            256,
            AttnMask::prefix_shared(300, 400, 300).with_window(Some(256)),
            "prefix+window256",
            5.0,
            3.0,
        ),
        (1000, 4, 2, 256, AttnMask::causal(1000), "causal", 50.0, 1.0),
        // Version 7's capped forms (Gemma 4 has no softcap; the kernels keep the family's
        // contract), with scores past the cap.
        (
            1000,
            8,
            2,
            512,
            AttnMask::prefix_shared(300, 400, 300).with_window(Some(256)),
            "prefix+window256",
            5.0,
            3.0,
        ),
    ];
    let mut all: Vec<_> = cases
        .drain(..)
        .map(|(t, nh, nkv, hd, m, l)| (t, nh, nkv, hd, m, l.to_string(), None, 1.0))
        .collect();
    for (t, nh, nkv, hd, m, l, c, qs) in capped {
        all.push((t, nh, nkv, hd, m, format!("{l} softcap{c}"), Some(c), qs));
    }
    for (t, nh, nkv, hd, mask, label, softcap, qscale) in all {
        let s = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
        };
        let tag = format!("attn T={t} h={nh}/{nkv} d={hd} {label}");
        let (qw, kw) = (nh * hd, nkv * hd);
        let q = r.bnormals(t * qw, qscale);
        let k = r.bnormals(t * kw, 1.0);
        let v = r.bnormals(t * kw, 1.0);
        let d_o = r.bnormals(t * qw, 1.0);
        let (oc, lc) = attention(
            &cx.c(&q, &[t, qw])?,
            &cx.c(&k, &[t, kw])?,
            &cx.c(&v, &[t, kw])?,
            &mask,
            s,
        )?;
        let bf = DType::BF16;
        let (qg, kg, vg) = (
            cx.g(&q, &[t, qw], bf)?,
            cx.g(&k, &[t, kw], bf)?,
            cx.g(&v, &[t, kw], bf)?,
        );
        let (og, lg) = attention(&qg, &kg, &vg, &mask, s)?;
        let row = cmp_t(&format!("{tag} fwd o"), &og, &oc, BF16_FWD)?;
        cx.push(row);
        let row = cmp_t(&format!("{tag} fwd lse"), &lg, &lc, F32_STAT)?;
        cx.push(row);
        if let (Device::Cuda(c), 64 | 128) = (cx.dev, hd) {
            // Both forward kernels of these head dims (the default picks one by grid size).
            for version in [2u8, 3] {
                c.set_attention_forward_version(version);
                let (o, l) = attention(&qg, &kg, &vg, &mask, s)?;
                c.set_attention_forward_version(0);
                let row = cmp_t(&format!("{tag} fwd v{version} o"), &o, &oc, BF16_FWD)?;
                cx.push(row);
                let row = cmp_t(&format!("{tag} fwd v{version} lse"), &l, &lc, F32_STAT)?;
                cx.push(row);
            }
        }
        // Shared backward inputs: the CPU forward's o (rounded) and lse.
        let o_in = rb(&oc.to_vec()?);
        let lse_in = lc.to_vec()?;
        let (dqc, dkc, dvc) = attention_bwd(
            &cx.c(&d_o, &[t, qw])?,
            &cx.c(&q, &[t, qw])?,
            &cx.c(&k, &[t, kw])?,
            &cx.c(&v, &[t, kw])?,
            &cx.c(&o_in, &[t, qw])?,
            &lc,
            &mask,
            s,
        )?;
        let dog = cx.g(&d_o, &[t, qw], bf)?;
        let oig = cx.g(&o_in, &[t, qw], bf)?;
        let lig = cx.g(&lse_in, &[nh, t], DType::F32)?;
        let (dqg, dkg, dvg) = attention_bwd(&dog, &qg, &kg, &vg, &oig, &lig, &mask, s)?;
        for (name, g, c) in [("dq", &dqg, &dqc), ("dk", &dkg, &dkc), ("dv", &dvg, &dvc)] {
            let row = cmp_t(&format!("{tag} bwd {name}"), g, c, BF16_GRAD)?;
            cx.push(row);
        }
        if let (Device::Cuda(c), 64 | 128 | 256) = (cx.dev, hd) {
            // The default above is the one-pass backward (its wgmma form on sm_90 at head_dim
            // 128, version 6 at 256); the mma.sync one-pass and the two-kernel versions too, and
            // version 5's two GQA forms (per-head blocks, kv-head loop) where they apply. Head_dim
            // 256 has the two-kernel form besides.
            let versions: &[u8] = if hd == 256 { &[2] } else { &[4, 2, 5, 6] };
            for &version in versions {
                c.set_attention_backward_version(version);
                let got = attention_bwd(&dog, &qg, &kg, &vg, &oig, &lig, &mask, s);
                c.set_attention_backward_version(0);
                let (dq2, dk2, dv2) = got?;
                for (name, g, c) in [("dq", &dq2, &dqc), ("dk", &dk2, &dkc), ("dv", &dv2, &dvc)] {
                    let row = cmp_t(&format!("{tag} bwd v{version} {name}"), g, c, BF16_GRAD)?;
                    cx.push(row);
                }
            }
        }
        if t >= 1000 && cx.dev.is_cuda() {
            attn_timing(cx, &tag, &qg, &kg, &vg, &dog, &mask, s)?;
        }
    }
    attention_long(cx, r)
}

/// Long sequences: sampled query rows against direct host references, and the timings. Its own
/// group (`attention_long`) for kernel work; `LORAFIT_PARITY_T=18432` keeps one length (e.g. for
/// a profiler that takes the first launch of a kernel).
fn attention_long(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let only_t: Option<usize> = std::env::var("LORAFIT_PARITY_T")
        .ok()
        .and_then(|v| v.parse().ok());
    let gemma_w = Some(4096);
    // (T, heads, kv heads, head_dim, mask, label, softcap, query scale)
    for (t, nh, nkv, hd, mask, label, softcap, qscale) in [
        (
            4096usize,
            8usize,
            2usize,
            128usize,
            AttnMask::prefix_shared(1024, 1536, 1536),
            "prefix",
            None,
            1.0f32,
        ),
        (
            16384,
            4,
            1,
            128,
            AttnMask::causal(16384),
            "causal",
            None,
            1.0,
        ),
        // The softcap's cost at head_dim 128 (version 5's capped kernels).
        (
            16384,
            4,
            1,
            128,
            AttnMask::causal(16384),
            "causal softcap50",
            Some(50.0),
            1.0,
        ),
        (
            16384,
            4,
            2,
            128,
            AttnMask::prefix_shared(4096, 6144, 6144),
            "prefix",
            None,
            1.0,
        ),
        // llama8b's heads on the bench's two pair shapes (prompt 3584 / 14336, responses 512 / 2048).
        (
            4608,
            32,
            8,
            128,
            AttnMask::prefix_shared(3584, 512, 512),
            "prefix",
            None,
            1.0,
        ),
        (
            18432,
            32,
            8,
            128,
            AttnMask::prefix_shared(14336, 2048, 2048),
            "prefix",
            None,
            1.0,
        ),
        // Gemma 2 9B's attention (8/4 heads of 256, softcap 50, every other layer a 4096 window)
        // on the same pair shapes and at 16K; one capped row with scores past the cap.
        (
            4608,
            8,
            4,
            256,
            AttnMask::prefix_shared(3584, 512, 512),
            "prefix",
            None,
            1.0,
        ),
        (
            4608,
            8,
            4,
            256,
            AttnMask::prefix_shared(3584, 512, 512).with_window(gemma_w),
            "prefix+window4096 softcap5",
            Some(5.0),
            3.0,
        ),
        (
            16384,
            8,
            4,
            256,
            AttnMask::causal(16384),
            "causal",
            None,
            1.0,
        ),
        (
            16384,
            8,
            4,
            256,
            AttnMask::causal(16384),
            "causal softcap50",
            Some(50.0),
            1.0,
        ),
        (
            16384,
            8,
            4,
            256,
            AttnMask::causal(16384).with_window(gemma_w),
            "window4096 softcap50",
            Some(50.0),
            1.0,
        ),
        (
            16384,
            8,
            4,
            256,
            AttnMask::prefix_shared(4096, 6144, 6144).with_window(gemma_w),
            "prefix+window4096 softcap50",
            Some(50.0),
            1.0,
        ),
        (
            18432,
            8,
            4,
            256,
            AttnMask::prefix_shared(14336, 2048, 2048).with_window(gemma_w),
            "prefix+window4096 softcap50",
            Some(50.0),
            1.0,
        ),
        // Gemma 4 E4B's global layers (8/2 heads of 512, no window) at 16K, causal and
        // prefix-shared (the model's scale is 1 on normed q and k; here 1/sqrt(d), as above).
        (
            16384,
            8,
            2,
            512,
            AttnMask::causal(16384),
            "causal",
            None,
            1.0,
        ),
        (
            16384,
            8,
            2,
            512,
            AttnMask::prefix_shared(4096, 6144, 6144),
            "prefix",
            None,
            1.0,
        ),
    ] {
        if only_t.is_some_and(|o| o != t) {
            continue;
        }
        let s = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
        };
        let tag = format!("attn T={t} h={nh}/{nkv} d={hd} {label}");
        let (qw, kw) = (nh * hd, nkv * hd);
        let q = r.bnormals(t * qw, qscale);
        let k = r.bnormals(t * kw, 1.0);
        let v = r.bnormals(t * kw, 1.0);
        let d_o = r.bnormals(t * qw, 1.0);
        let bf = DType::BF16;
        let (qg, kg, vg) = (
            cx.g(&q, &[t, qw], bf)?,
            cx.g(&k, &[t, kw], bf)?,
            cx.g(&v, &[t, kw], bf)?,
        );
        let (og, lg) = attention(&qg, &kg, &vg, &mask, s)?;
        let o_all = og.to_vec()?;
        let l_all = lg.to_vec()?;
        let dog = cx.g(&d_o, &[t, qw], bf)?;
        let (dqg, _, _) = attention_bwd(&dog, &qg, &kg, &vg, &og, &lg, &mask, s)?;
        let dq_all = dqg.to_vec()?;
        if let (Device::Cuda(c), 128) = (cx.dev, hd) {
            // dK and dV at this length: version 5's kv-head loop against its per-head blocks and
            // partials (the short cases check both against the CPU).
            let mut outs = Vec::new();
            for version in [5u8, 6] {
                c.set_attention_backward_version(version);
                let got = attention_bwd(&dog, &qg, &kg, &vg, &og, &lg, &mask, s);
                c.set_attention_backward_version(0);
                outs.push(got?);
            }
            let (per_head, looped) = (&outs[0], &outs[1]);
            for (name, got, want) in [
                ("dk", &looped.1, &per_head.1),
                ("dv", &looped.2, &per_head.2),
            ] {
                let row = cmp_t(
                    &format!("{tag} bwd {name} head-loop vs per-head"),
                    got,
                    want,
                    BF16_GRAD,
                )?;
                cx.push(row);
            }
        }
        let samples: Vec<(usize, usize)> = (0..48)
            .map(|i| {
                (
                    r.below(nh),
                    if i < 4 {
                        [0, 1, t - 1, t / 2][i]
                    } else {
                        r.below(t)
                    },
                )
            })
            .collect();
        let (mut go, mut wo, mut gl, mut wl, mut gq, mut wq) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for &(h, i) in &samples {
            let (o, l, dq) = ref_rows(&q, &k, &v, &d_o, &o_all, &l_all, &mask, s, h, i);
            let sl = i * qw + h * hd..i * qw + (h + 1) * hd;
            go.extend_from_slice(&o_all[sl.clone()]);
            wo.extend(o);
            gl.push(l_all[h * t + i]);
            wl.push(l);
            gq.extend_from_slice(&dq_all[sl]);
            wq.extend(dq);
        }
        cx.push(compare(
            &format!("{tag} fwd o (48 rows)"),
            &go,
            &wo,
            BF16_FWD,
        ));
        cx.push(compare(
            &format!("{tag} fwd lse (48 rows)"),
            &gl,
            &wl,
            F32_STAT,
        ));
        cx.push(compare(
            &format!("{tag} bwd dq (48 rows)"),
            &gq,
            &wq,
            BF16_GRAD,
        ));
        if cx.dev.is_cuda() {
            attn_timing(cx, &tag, &qg, &kg, &vg, &dog, &mask, s)?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn attn_timing(
    cx: &mut Ctx,
    tag: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    mask: &AttnMask,
    s: AttnShape,
) -> Result<()> {
    let (o, lse) = attention(q, k, v, mask, s)?;
    let iters = if q.dim(0) >= 8192 { 3 } else { 10 };
    let fwd = cx.time(iters, || attention(q, k, v, mask, s).map(|_| ()))?;
    let pairs = visible_pairs(mask) * s.n_heads as f64;
    let fl = 4.0 * pairs * s.head_dim as f64;
    cx.push(timing(
        &format!("{tag} time fwd"),
        fwd,
        format!("{:.0} TFLOP/s (4*pairs*d)", fl / fwd / 1e9),
    ));
    // The default backward (one pass where the head dim allows), then the mma.sync one-pass and
    // the two-kernel versions.
    let Device::Cuda(c) = cx.dev else {
        return Ok(());
    };
    let c = c.clone();
    // Head_dim 256: the one-pass kernel (version 6) and the two-kernel one; 512: version 7's
    // two kernels only.
    let versions: &[(u8, &str)] = if s.head_dim == 512 {
        &[(0, "bwd")]
    } else if s.head_dim == 256 {
        &[(0, "bwd"), (2, "bwd v2")]
    } else {
        &[
            (0, "bwd"),
            (5, "bwd v5 per-head"),
            (6, "bwd v5 head-loop"),
            (4, "bwd v4"),
            (2, "bwd v2"),
        ]
    };
    for &(version, label) in versions {
        c.set_attention_backward_version(version);
        let bwd = cx.time(iters, || {
            attention_bwd(d_o, q, k, v, &o, &lse, mask, s).map(|_| ())
        });
        c.set_attention_backward_version(0);
        let bwd = bwd?;
        cx.push(timing(
            &format!("{tag} time {label}"),
            bwd,
            format!("{:.0} TFLOP/s (10*pairs*d)", 2.5 * fl / bwd / 1e9),
        ));
    }
    Ok(())
}

/// Largest `|got - want| / max(1, |want|)`: the bound of per-token statistics (logp, lse) whose
/// magnitude varies from near 0 to tens.
pub fn compare_abs_rel(op: &str, got: &[f32], want: &[f32], bound: f64) -> ParityRow {
    let mut row = compare(op, got, want, bound);
    let mut worst = 0f64;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let d = (a as f64 - b as f64).abs() / (b as f64).abs().max(1.0);
        if d > worst || d.is_nan() {
            worst = d;
            row.worst = i;
        }
    }
    row.rel = worst;
    row.pass = got.len() == want.len() && worst <= bound;
    row.note = "max abs-rel".into();
    row
}

/// Fused linear cross-entropy against the CPU reference on the same bf16-rounded inputs. The
/// large shapes compare a sample of rows (every op is row-independent), computed on the host.
fn cce_suite(cx: &mut Ctx) -> Result<()> {
    use super::cce::{cce_backward, cce_forward, IGNORE};
    use rayon::prelude::*;
    // (N, H, V, softcap, filter_eps)
    let cases: &[(usize, usize, usize, Option<f32>, f32)] = &[
        (5, 90, 333, None, 0.0),
        (37, 200, 1000, Some(20.0), 1e-5),
        (7, 576, 49152, None, 0.0),
        (1000, 576, 49152, Some(30.0), 0.0),
        (7, 1536, 151936, None, 1e-5),
        (1000, 1536, 151936, None, 1e-5),
        (4096, 1536, 151936, None, 0.0),
    ];
    let mut heads: Vec<((usize, usize), Vec<f32>, Tensor)> = Vec::new();
    for (ci, &(n, hd, v, cap, eps)) in cases.iter().enumerate() {
        if !cx.dev.is_cuda() && v > 2000 {
            continue; // the host reference against itself: only the small shapes
        }
        let seed = 0xCCE0 + ci as u64;
        if !heads.iter().any(|(k, _, _)| *k == (v, hd)) {
            let mut w = crate::model::weights::random_normal(v * hd, seed ^ 0x77, 0.05);
            w.par_iter_mut()
                .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
            let wg = cx.g(&w, &[v, hd], DType::BF16)?;
            heads.push(((v, hd), w, wg));
        }
        let (_, w, wg) = heads.iter().find(|(k, _, _)| *k == (v, hd)).unwrap();
        let mut r = Rng(seed);
        let h = r.bnormals(n * hd, 1.0);
        let targets: Vec<u32> = (0..n)
            .map(|i| {
                if i % 5 == 3 {
                    IGNORE
                } else {
                    r.below(v) as u32
                }
            })
            .collect();
        let dl = r.normals(n, 1.0);
        let hg = cx.g(&h, &[n, hd], DType::BF16)?;
        let dlg = cx.g(&dl, &[n], DType::F32)?;
        let (lpg, lseg) = cce_forward(&hg, wg, &targets, cap)?;
        let dhg = cce_backward(&hg, wg, &targets, &dlg, &lseg, cap, eps)?;
        // Host reference on a sample of rows.
        let rows: Vec<usize> = if n <= 64 {
            (0..n).collect()
        } else {
            let k = if v > 100_000 { 8 } else { 16 };
            (0..k).map(|i| i * (n - 1) / (k - 1)).collect()
        };
        let hs: Vec<f32> = rows
            .iter()
            .flat_map(|&i| h[i * hd..(i + 1) * hd].iter().copied())
            .collect();
        let ts: Vec<u32> = rows.iter().map(|&i| targets[i]).collect();
        let ds: Vec<f32> = rows.iter().map(|&i| dl[i]).collect();
        let wc = Tensor::cpu(w.clone(), &[v, hd])?;
        let hc = cx.c(&hs, &[rows.len(), hd])?;
        let (lpc, lsec) = cce_forward(&hc, &wc, &ts, cap)?;
        let dhc = cce_backward(&hc, &wc, &ts, &cx.c(&ds, &[rows.len()])?, &lsec, cap, eps)?;
        let pick = |t: &Tensor, width: usize| -> Result<Vec<f32>> {
            let all = t.to_vec()?;
            Ok(rows
                .iter()
                .flat_map(|&i| all[i * width..(i + 1) * width].to_vec())
                .collect())
        };
        let tag = format!(
            "cce N={n} H={hd} V={v}{}{}",
            cap.map(|c| format!(" cap{c}")).unwrap_or_default(),
            if eps > 0.0 { " eps1e-5" } else { "" }
        );
        let sample = if rows.len() < n {
            format!(" ({} rows)", rows.len())
        } else {
            String::new()
        };
        let row = compare_abs_rel(
            &format!("{tag} logp{sample}"),
            &pick(&lpg, 1)?,
            &lpc.to_vec()?,
            1e-3,
        );
        cx.push(row);
        let row = compare_abs_rel(
            &format!("{tag} lse{sample}"),
            &pick(&lseg, 1)?,
            &lsec.to_vec()?,
            1e-3,
        );
        cx.push(row);
        let row = compare(
            &format!("{tag} dh{sample}"),
            &pick(&dhg, hd)?,
            &dhc.to_vec()?,
            BF16_GRAD,
        );
        cx.push(row);
        drop((lpg, lseg, dhg));
        if n == 4096 && cx.dev.is_cuda() {
            // Allocator peak of forward + backward, against the [N, V] f32 logits it avoids.
            cx.dev.synchronize()?;
            let base = cx.dev.memory().live_bytes;
            cx.dev.reset_peak();
            let (_, lse) = cce_forward(&hg, wg, &targets, cap)?;
            let dh = cce_backward(&hg, wg, &targets, &dlg, &lse, cap, eps)?;
            drop((lse, dh));
            let extra = cx.dev.memory().peak_bytes.saturating_sub(base) as f64;
            let nv4 = (n * v * 4) as f64;
            cx.push(ParityRow {
                op: format!("{tag} peak extra / (N*V*4)"),
                max_abs: extra,
                rel: extra / nv4,
                worst: 0,
                bound: 0.1,
                pass: extra / nv4 < 0.1,
                ms: None,
                note: format!("{:.1} MB vs {:.0} MB", extra / 1e6, nv4 / 1e6),
            });
            let (_, lse) = cce_forward(&hg, wg, &targets, cap)?;
            let fwd = cx.time(3, || cce_forward(&hg, wg, &targets, cap).map(|_| ()))?;
            let bwd = cx.time(3, || {
                cce_backward(&hg, wg, &targets, &dlg, &lse, cap, eps).map(|_| ())
            })?;
            let bwdf = cx.time(3, || {
                cce_backward(&hg, wg, &targets, &dlg, &lse, cap, 1e-5).map(|_| ())
            })?;
            let fl = 2.0 * (n * v * hd) as f64;
            cx.push(timing(
                &format!("{tag} time fwd"),
                fwd,
                format!("{:.0} TFLOP/s (2NVH)", fl / fwd / 1e9),
            ));
            cx.push(timing(
                &format!("{tag} time bwd"),
                bwd,
                format!("{:.0} TFLOP/s (4NVH)", 2.0 * fl / bwd / 1e9),
            ));
            cx.push(timing(
                &format!("{tag} time bwd eps1e-5"),
                bwdf,
                "random inputs: few blocks skip".into(),
            ));
        }
    }
    Ok(())
}

/// Prints the parity table and a summary line.
pub fn print_parity(rows: &[ParityRow]) {
    print!("{}", format_parity(rows));
}

/// The parity table, one line per row, and a summary line.
pub fn format_parity(rows: &[ParityRow]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<58} {:>10} {:>10} {:>9} {:>8} {:>5}  note",
        "op", "max|diff|", "rel-norm", "worst@", "bound", "ok"
    );
    for r in rows {
        if let Some(ms) = r.ms {
            if r.bound == 0.0 && r.rel == 0.0 && r.max_abs == 0.0 {
                let _ = writeln!(s, "{:<58} {:>10} {:>10.3} ms  {}", r.op, "", ms, r.note);
                continue;
            }
        }
        let ms = r.ms.map(|m| format!(" [{m:.3} ms]")).unwrap_or_default();
        let _ = writeln!(
            s,
            "{:<58} {:>10.3e} {:>10.3e} {:>9} {:>8.0e} {:>5}  {}{}",
            r.op,
            r.max_abs,
            r.rel,
            r.worst,
            r.bound,
            if r.pass { "ok" } else { "FAIL" },
            r.note,
            ms
        );
    }
    let fails = rows.iter().filter(|r| !r.pass).count();
    let _ = writeln!(s, "parity: {} rows, {} failed", rows.len(), fails);
    s
}

/// Incremental decoding's ops: `decode_attention` (query rows over ranges of a KV cache: one
/// query per sequence slot of a batched cache, a window, a chat turn's several queries, softcap,
/// head dims 64 to 512 (Gemma 4's full layers), an empty range) and `copy_rows_into` (exact).
fn decode_suite(cx: &mut Ctx, r: &mut Rng) -> Result<()> {
    let bf = DType::BF16;
    // (label, heads, kv heads, head_dim, key rows, ranges, softcap)
    type Case = (
        &'static str,
        usize,
        usize,
        usize,
        usize,
        Vec<[u32; 2]>,
        Option<f32>,
    );
    let slots = |n: u32, cap: u32, len: u32| -> Vec<[u32; 2]> {
        (0..n).map(|b| [b * cap, b * cap + len - b * 7]).collect()
    };
    let cases: Vec<Case> = vec![
        ("1 query", 32, 8, 128, 1000, vec![[0, 1000]], None),
        ("8 slots", 32, 8, 128, 8 * 512, slots(8, 512, 500), None),
        (
            "window 64",
            8,
            2,
            64,
            700,
            vec![[636, 700], [300, 364]],
            None,
        ),
        (
            "turn of 5 queries",
            4,
            4,
            96,
            300,
            (0..5).map(|i| [0, 296 + i]).collect(),
            None,
        ),
        (
            "softcap 5",
            8,
            4,
            256,
            900,
            vec![[0, 900], [100, 800]],
            Some(5.0),
        ),
        ("empty range", 4, 2, 64, 50, vec![[0, 50], [20, 20]], None),
        (
            "head_dim 512",
            8,
            2,
            512,
            600,
            vec![[0, 600], [50, 550], [599, 600]],
            None,
        ),
        (
            "head_dim 320, 1 kv head",
            4,
            1,
            320,
            200,
            vec![[0, 200]],
            None,
        ),
    ];
    for (label, nh, nkv, hd, m, ranges, softcap) in cases {
        let n = ranges.len();
        let q = r.bnormals(n * nh * hd, if softcap.is_some() { 3.0 } else { 1.0 });
        let k = r.bnormals(m * nkv * hd, 1.0);
        let v = r.bnormals(m * nkv * hd, 1.0);
        let s = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
        };
        let want = decode_attention(
            &cx.c(&q, &[n, nh * hd])?,
            &cx.c(&k, &[m, nkv * hd])?,
            &cx.c(&v, &[m, nkv * hd])?,
            &ranges,
            s,
        )?;
        let (gq, gk, gv) = (
            cx.g(&q, &[n, nh * hd], bf)?,
            cx.g(&k, &[m, nkv * hd], bf)?,
            cx.g(&v, &[m, nkv * hd], bf)?,
        );
        let got = decode_attention(&gq, &gk, &gv, &ranges, s)?;
        let row = cmp_t(
            &format!("decode_attention {label} ({nh}/{nkv} heads, d {hd})"),
            &got,
            &want,
            BF16_FWD,
        )?;
        cx.push(row);
    }
    // Writes into a cache: rows scattered, the rest untouched.
    let (rows, cols) = (40, 48);
    let base = r.bnormals(rows * cols, 1.0);
    let src = r.bnormals(5 * cols, 1.0);
    let idx = [3u32, 17, 4, 39, 0];
    let mut want = cx.c(&base, &[rows, cols])?;
    copy_rows_into(&mut want, &idx, &cx.c(&src, &[5, cols])?)?;
    let mut got = cx.g(&base, &[rows, cols], bf)?;
    copy_rows_into(&mut got, &idx, &cx.g(&src, &[5, cols], bf)?)?;
    let row = cmp_t("copy_rows_into (bf16, exact)", &got, &want, 0.0)?;
    cx.push(row);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full CUDA parity suite (needs a GPU): `--ignored --nocapture cuda_parity_suite`.
    #[test]
    #[ignore]
    fn cuda_parity_suite() {
        let dev = Device::cuda(0).expect("a CUDA device");
        println!("device: {}", dev.name());
        let rows = run_op_parity(&dev, 42).expect("parity run");
        print_parity(&rows);
        let m = dev.memory();
        println!("memory: live {} B, peak {} B", m.live_bytes, m.peak_bytes);
        assert!(rows.iter().all(|r| r.pass), "parity failures");
    }

    /// The decode ops' group with the CPU as the device: every row passes (the bf16 rounding of
    /// the inputs is the same on both sides there, so only a broken row could fail).
    #[test]
    fn decode_suite_cpu_self_check() {
        let mut cx = Ctx {
            dev: &Device::Cpu,
            rows: Vec::new(),
        };
        decode_suite(&mut cx, &mut Rng(3)).unwrap();
        assert_eq!(cx.rows.len(), 9);
        assert!(
            cx.rows.iter().all(|r| r.pass && r.rel == 0.0),
            "{:?}",
            cx.rows
        );
    }

    /// The harness itself: a difference planted in one element of a real op's output is
    /// reported at its index with its size, fails its bound and is counted in the table; the
    /// same difference ten times smaller passes; NaN and a length mismatch never pass. Then the
    /// elementwise group runs with the CPU as the device (every row passes).
    #[test]
    fn parity_harness_cpu_self_check() {
        let mut cx = Ctx {
            dev: &Device::Cpu,
            rows: Vec::new(),
        };
        let mut r = Rng(1);
        let (rows, h) = (16, 64);
        let x = r.bnormals(rows * h, 1.0);
        let w = r.bnormals(h, 1.0);
        let (want, _) = rms_norm(
            &cx.c(&x, &[rows, h]).unwrap(),
            &cx.c(&w, &[h]).unwrap(),
            1e-6,
        )
        .unwrap();
        let want = want.to_vec().unwrap();
        let norm = want.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let at = 617;
        for (scale, pass) in [(1.0, false), (0.1, true)] {
            // A difference of 2x the bound (relative norm), or a fifth of it.
            let delta = scale * 2.0 * BF16_FWD * norm;
            let mut got = want.clone();
            got[at] += delta as f32;
            let d = (got[at] as f64 - want[at] as f64).abs();
            let row = cmp_t(
                "planted",
                &cx.c(&got, &[rows, h]).unwrap(),
                &cx.c(&want, &[rows, h]).unwrap(),
                BF16_FWD,
            )
            .unwrap();
            assert_eq!(row.worst, at, "{row:?}");
            assert_eq!(row.max_abs, d, "{row:?}");
            assert!((row.rel - d / norm).abs() <= 1e-9 * row.rel, "{row:?}");
            assert_eq!(row.pass, pass, "{row:?}");
            cx.push(row);
        }
        let table = format_parity(&cx.rows);
        let line = table.lines().nth(1).unwrap();
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            (fields[0], fields[3], fields[5]),
            ("planted", "617", "FAIL"),
            "{table}"
        );
        assert!(table.ends_with("parity: 2 rows, 1 failed\n"), "{table}");

        let mut nan = want.clone();
        nan[3] = f32::NAN;
        let row = compare("nan", &nan, &want, f64::INFINITY);
        assert!(!row.pass && row.worst == 3, "{row:?}");
        let row = compare("short", &want[1..], &want, f64::INFINITY);
        assert!(!row.pass && row.note == "length 1023 vs 1024", "{row:?}");

        cx.rows.clear();
        elementwise(&mut cx, &mut r).unwrap();
        assert!(cx.rows.iter().all(|r| r.pass), "{:?}", cx.rows);
    }
}
