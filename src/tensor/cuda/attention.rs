//! Host side of `kernels/attention.cu`: mask upload, which kernel version serves a shape (head
//! dim, GPU, grid size, softcap), shared-memory sizing, and the forward and backward launches.
use super::*;

/// Masks kept on the device after their upload, most recent first. A pass attends under one
/// mask in every layer, forward and backward (two or three masks where a preference pair runs
/// as separate sequences), so a few entries serve it; a mask is recognised by its contents
/// (ranges, positions and window, compared in full, before its upload bytes are built), so that
/// a mask changed in place is never mistaken for the one uploaded. Entries are small: a mask
/// whose device buffer passes `MASK_CACHE_ENTRY_MAX` (its tile table grows with the square of
/// the length) is uploaded at each call instead.
#[derive(Default)]
pub(super) struct MaskCache {
    entries: Vec<(AttnMask, Arc<CudaStorage>, MaskArg)>,
}

const MASK_CACHE_ENTRIES: usize = 4;
const MASK_CACHE_ENTRY_MAX: usize = 4 << 20;

impl MaskCache {
    fn find(&mut self, mask: &AttnMask) -> Option<(Arc<CudaStorage>, MaskArg)> {
        let i = self.entries.iter().position(|(m, ..)| m == mask)?;
        let e = self.entries.remove(i);
        let hit = (e.1.clone(), e.2);
        self.entries.insert(0, e);
        Some(hit)
    }

    fn insert(&mut self, mask: &AttnMask, s: Arc<CudaStorage>, arg: MaskArg) {
        if s.bytes > MASK_CACHE_ENTRY_MAX {
            return;
        }
        // An evicted buffer is freed in stream order, after the kernels that read it.
        self.entries.truncate(MASK_CACHE_ENTRIES - 1);
        self.entries.insert(0, (mask.clone(), s, arg));
    }
}

#[allow(clippy::too_many_arguments)]
impl CudaBackend {
    /// The mask on the device as one buffer: ranges (16 B per query), positions, then
    /// per-64-key-tile min and max positions, then the per-tile visibility table (filled on the
    /// device, lf_attn_tile_flags). A mask uploaded by an earlier call with the same contents
    /// is reused (`MaskCache`): every layer of a pass attends under one mask.
    fn upload_mask(&self, mask: &AttnMask) -> Result<(Arc<CudaStorage>, MaskArg)> {
        if let Some(hit) = self.masks.lock().unwrap().find(mask) {
            return Ok(hit);
        }
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
        let window = match mask.window {
            None => -1,
            Some(w) => w.min(i32::MAX as u32) as i32,
        };
        let s = Arc::new(self.alloc(off_flags + tiles * tiles)?);
        self.htod(&s, &buf)?;
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
        self.masks.lock().unwrap().insert(mask, s.clone(), arg);
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
            // Version 7 (forward, dQ, dK/dV) only.
            512 => 512,
            d => bail!("cuda attention supports head_dim up to 128, 256 and 512, got {d}"),
        };
        Ok(hdp)
    }

    /// The dynamic shared memory an attention kernel may use (the limit `function` sets).
    pub(super) fn attn_smem_limit(&self) -> u32 {
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
            "lf_attn7_fwd_512",
            "lf_attn7_dq_512",
            "lf_attn7_dkdv_512",
        )
    }

    pub(super) fn attn_smem(kind: &str, hdp: usize) -> u32 {
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
    /// 128, version 1 the rest; forward or backward version 1 (`set_attention_forward_version`,
    /// `set_attention_backward_version`) forces version 1 there (for comparison).
    fn attn2(&self, kind: &str, s: &AttnShape, t: usize) -> Option<AttnKernel> {
        // The forward's two-m-tile kernel (4 warps per 128 rows, two blocks per SM) is faster once
        // the grid fills the device several times over (32 heads at 4K: 16% faster, at 16K:
        // 19%); with few blocks the 8-warp kernel's finer waves win (12 heads at 4.6K: 23%).
        let wide = match self.inner.attn_fwd_version.load(Ordering::Relaxed) {
            2 => false,
            3 => true,
            _ => t.div_ceil(128) * s.n_heads >= 4 * self.inner.sm_count as usize,
        };
        let v1 = match kind {
            "fwd" => self.inner.attn_fwd_version.load(Ordering::Relaxed) == 1,
            _ => self.inner.attn_bwd_version.load(Ordering::Relaxed) == 1,
        };
        if v1 {
            return None;
        }
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
        // dK/dV at head_dim 256 and the forward at 512: one block per head-dim half.
        let z = match name {
            "lf_attn2_dkdv_256" | "lf_attn7_fwd_512" => 2,
            _ => 1,
        };
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
        Some(match (kind, s.head_dim) {
            ("fwd", 64) if !wide => ("lf_attn2_fwd_64", 256, 128),
            ("fwd", 128) if !wide => ("lf_attn2_fwd_128", 256, 128),
            ("fwd", 256) => ("lf_attn2_fwd_256", 256, 128),
            ("dq", 256) => ("lf_attn2_dq_256", 128, 64),
            ("dkdv", 256) => ("lf_attn2_dkdv_256", 128, 64),
            ("bwd", 256) => ("lf_attn6_bwd_256", 256, 64),
            // Head_dim 512: version 7's forward, dQ and dK/dV (no one-pass backward).
            ("fwd", 512) => ("lf_attn7_fwd_512", 256, 128),
            ("dq", 512) => ("lf_attn7_dq_512", 256, 64),
            ("dkdv", 512) => ("lf_attn7_dkdv_512", 256, 32),
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
        let flags = t.div_ceil(64).next_multiple_of(16);
        let b = match kind {
            // Version 7 (head_dim 512), laid out as its kernels' headers list. Forward: Q (128
            // rows), two K buffers (32 rows), the block's half of V (32 rows of 256 + 8).
            "fwd" if hd == 512 => 128 * row + 2 * 32 * row + 32 * (256 + 8) * 2 + flags,
            // dQ: Q and dO (64 rows), two buffers of K and V (16 rows), P (f32, 64 x 20), dS
            // (bf16, 64 x 24).
            "dq" if hd == 512 => (2 * 64 + 4 * 16) * row + 64 * 20 * 4 + 64 * 24 * 2 + flags,
            // dK/dV: K and V (32 rows), two buffers of Q and dO (32 rows), P^T and dS^T (bf16,
            // 32 x 40), P^T (f32, 32 x 36), two buffers of lse and D (32 each).
            "dkdv" if hd == 512 => {
                (2 * 32 + 4 * 32) * row + 2 * 32 * 40 * 2 + 32 * 36 * 4 + 4 * 32 * 4 + flags
            }
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

    /// Why no kernel serves `kind` ("fwd", "dq", "dkdv") at a head dim above 128, which version 1
    /// does not cover: version 1 forced (`set_attention_forward_version` /
    /// `set_attention_backward_version`), or more shared memory than the device has.
    fn attn_no_kernel(&self, kind: &str, s: &AttnShape, t: usize) -> anyhow::Error {
        let version = match kind {
            "fwd" => self.inner.attn_fwd_version.load(Ordering::Relaxed),
            _ => self.inner.attn_bwd_version.load(Ordering::Relaxed),
        };
        if version == 1 {
            return anyhow!(
                "cuda attention {kind}: version 1 is forced and has no kernel for head_dim {}",
                s.head_dim
            );
        }
        anyhow!(
            "cuda attention {kind}: the head_dim {} kernel needs {} bytes of shared memory per \
             block at T = {t}; this device allows {}",
            s.head_dim,
            Self::attn2_smem(kind, s.head_dim, t),
            self.attn_smem_limit()
        )
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
        if hdp > 128 {
            return Err(self.attn_no_kernel("fwd", &s, t));
        }
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
        if hdp > 128 && one_pass.is_none() {
            if dq2.is_none() {
                return Err(self.attn_no_kernel("dq", &s, t));
            }
            if dkdv2.is_none() {
                return Err(self.attn_no_kernel("dkdv", &s, t));
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::CudaBackend;

    /// Version 7's shared memory (head_dim 512), from its kernels' layouts: padded rows of 520
    /// bf16 (1040 bytes) plus each kernel's small tiles and one visibility byte per 64 rows
    /// (rounded up to 16). All three fit an H200's 227 KB opt-in limit (less the 1 KB the attention
    /// kernels leave) far past the lengths Gemma 4 trains at.
    #[test]
    fn head_dim_512_shared_memory() {
        let (row, t) = (1040, 16384);
        let flags = 256;
        let fwd = 128 * row + 2 * 32 * row + 32 * 264 * 2 + flags;
        let dq = 64 * row * 2 + 4 * 16 * row + 64 * 20 * 4 + 64 * 24 * 2 + flags;
        let dkdv = 2 * 32 * row + 4 * 32 * row + 2 * 32 * 40 * 2 + 32 * 36 * 4 + 4 * 32 * 4 + flags;
        assert_eq!((fwd, dq, dkdv), (216_832, 208_128, 210_176));
        for (kind, want) in [("fwd", fwd), ("dq", dq), ("dkdv", dkdv)] {
            assert_eq!(CudaBackend::attn2_smem(kind, 512, t), want as u32, "{kind}");
        }
        let h200_limit = 232_448 - 1024;
        for kind in ["fwd", "dq", "dkdv"] {
            let at_256k = CudaBackend::attn2_smem(kind, 512, 262_144);
            assert!(at_256k <= h200_limit, "{kind}: {at_256k} bytes at T = 256K");
        }
    }

    /// Head_dim 512 is served by version 7 alone: its forward (one block per output half), dQ
    /// and dK/dV, no one-pass backward; each has its capped form.
    #[test]
    fn head_dim_512_kernels() {
        let s = crate::tensor::AttnShape {
            n_heads: 8,
            n_kv_heads: 2,
            head_dim: 512,
            scale: 1.0,
            softcap: None,
        };
        let names: Vec<_> = ["fwd", "dq", "dkdv", "bwd"]
            .iter()
            .map(|k| CudaBackend::attn2_fn(k, &s, false))
            .collect();
        assert_eq!(
            names,
            [
                Some(("lf_attn7_fwd_512", 256, 128)),
                Some(("lf_attn7_dq_512", 256, 64)),
                Some(("lf_attn7_dkdv_512", 256, 32)),
                None
            ]
        );
        let capped = crate::tensor::AttnShape {
            softcap: Some(50.0),
            ..s
        };
        for (name, _, _) in names.into_iter().flatten() {
            assert_eq!(
                CudaBackend::attn_cap_name(name, &capped),
                format!("{name}_cap")
            );
        }
    }
}
