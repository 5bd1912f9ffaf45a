// Fused linear cross-entropy (cut cross-entropy) on tensor cores: mma.sync m16n8k16, bf16 h and W,
// f32 accumulation. Never materialises [N, V]. Structurally the forward is attention-forward
// without V (rows = queries, vocabulary rows = keys, online log-sum-exp) and the backward's
// dh = coeff . W is attention-backward's dQ = dS . K.
//
// Grid (ceil(N/64), nsplit): a block owns 64 rows (warp w: rows 16w..16w+15) and a contiguous
// range of `tps` vocabulary tiles of 128 rows, so that a handful of rows still fills the GPU.
//   lf_cce_fwd*:     per (row, split) partial (max, sum) in the log2 domain + the target logit
//                    (written by the one block whose range holds the target).
//   lf_cce_combine:  merges the splits' partials: lse, logp = target logit - lse.
//   lf_cce_bwd*:     recomputes each 64x128 logit tile (K-loop over H in chunks of 64), forms
//                    coeff = dlogp (onehot - softmax) (x softcap derivative) in registers, drops
//                    elements whose |(onehot - softmax) x softcap'| < eps, skips the tile when
//                    none is left, else packs coeff as bf16 A fragments
//                    and accumulates coeff . W chunk by chunk of 64 hidden columns with f32
//                    atomics into dh32 [N, H] (contention only between the vocabulary splits of
//                    one row tile; the host casts dh32 to bf16).
//
// mma.m16n8k16 fragment layouts (g = lane / 4, t = lane % 4):
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8 f32):         c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)

#define CBM 64            // rows per block
#define CBV 128           // vocabulary rows per tile
#define CKC 64            // hidden columns per shared-memory chunk
#define CNT 128           // threads per block
#define CSP (CKC + 8)     // row stride (bf16) of the h and W chunks
#define CST (CBV + 8)     // row stride (bf16) of the transposed W chunk
#define IGNORE 0xffffffffu

// Rows [r0, r0 + nrows) x columns [c0, c0 + CKC) of a row-major [nr, ncols] bf16 matrix into
// dst (row stride CSP), zero-filled past either edge. TRANS stores dst[c * CST + r] instead.
template <bool TRANS>
__device__ __forceinline__ void cce_load(bf16* dst, const bf16* __restrict__ src, int r0, int nrows, int nr, int c0,
                                         int ncols) {
    if ((ncols & 7) == 0) {
        const int cpr = CKC / 8;
        for (int idx = threadIdx.x; idx < nrows * cpr; idx += CNT) {
            const int r = idx / cpr, c = (idx % cpr) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r0 + r < nr && c0 + c < ncols) v = *(const uint4*)(src + (i64)(r0 + r) * ncols + c0 + c);
            if (TRANS) {
                const bf16* e = (const bf16*)&v;
                #pragma unroll
                for (int j = 0; j < 8; j++) dst[(c + j) * CST + r] = e[j];
            } else {
                *(uint4*)(dst + r * CSP + c) = v;
            }
        }
    } else {
        const bf16 zero = __float2bfloat16(0.f);
        for (int idx = threadIdx.x; idx < nrows * CKC; idx += CNT) {
            const int r = idx / CKC, c = idx % CKC;
            bf16 v = zero;
            if (r0 + r < nr && c0 + c < ncols) v = src[(i64)(r0 + r) * ncols + c0 + c];
            if (TRANS) dst[c * CST + r] = v;
            else dst[r * CSP + c] = v;
        }
    }
}

// s[16 rows of warp w][128 vocabulary rows from v0] = h . W^T, K-loop over the hidden size.
__device__ __forceinline__ void cce_logits(float (*s)[4], bf16* hs, bf16* ws, const bf16* __restrict__ h,
                                           const bf16* __restrict__ w, int r0, int v0, int n, int v, int hd) {
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    #pragma unroll
    for (int nt = 0; nt < CBV / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    for (int c0 = 0; c0 < hd; c0 += CKC) {
        __syncthreads();
        cce_load<false>(hs, h, r0, CBM, n, c0, hd);
        cce_load<false>(ws, w, v0, CBV, v, c0, hd);
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < CKC / 16; kk++) {
            u32 a[4];
            const bf16* base = hs + (16 * wp + g) * CSP + kk * 16 + 2 * tq;
            a[0] = lds32(base);
            a[1] = lds32(base + 8 * CSP);
            a[2] = lds32(base + 8);
            a[3] = lds32(base + 8 * CSP + 8);
            #pragma unroll
            for (int nt = 0; nt < CBV / 8; nt++) {
                const bf16* wb = ws + (nt * 8 + g) * CSP + kk * 16 + 2 * tq;
                mma16816(s[nt], a, lds32(wb), lds32(wb + 8));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Forward: partial (max, sum) per (split, row), log2 domain; the target's (capped) logit.
template <bool CAP>
__device__ void cce_fwd(const bf16* __restrict__ h, const bf16* __restrict__ w, const u32* __restrict__ tgt,
                        float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ tlogit, int n, int v,
                        int hd, int tps, float cap) {
    __shared__ __align__(16) bf16 hs[CBM * CSP];
    __shared__ __align__(16) bf16 ws[CBV * CSP];
    const int r0 = blockIdx.x * CBM, split = blockIdx.y;
    const int ntiles = (v + CBV - 1) / CBV;
    const int vt0 = split * tps, vt1 = min(vt0 + tps, ntiles);
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int ra = r0 + 16 * wp + g, rb = ra + 8;
    const u32 ta = ra < n ? tgt[ra] : IGNORE, tb = rb < n ? tgt[rb] : IGNORE;
    float m_a = -LF_INF, m_b = -LF_INF, l_a = 0.f, l_b = 0.f;
    float s[CBV / 8][4];
    for (int vt = vt0; vt < vt1; vt++) {
        const int v0 = vt * CBV;
        cce_logits(s, hs, ws, h, w, r0, v0, n, v, hd);
        float mx_a = -LF_INF, mx_b = -LF_INF;
        #pragma unroll
        for (int nt = 0; nt < CBV / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = v0 + nt * 8 + 2 * tq + (e & 1);
                float x = s[nt][e];
                if (CAP) x = cap * tanhf(x / cap);
                if (col >= v) {
                    x = -LF_INF;
                } else if ((u32)col == (e < 2 ? ta : tb)) {
                    tlogit[e < 2 ? ra : rb] = x;
                }
                s[nt][e] = x * LOG2E;
            }
            mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float mu_a = mn_a == -LF_INF ? 0.f : mn_a, mu_b = mn_b == -LF_INF ? 0.f : mn_b;
        float ps_a = 0.f, ps_b = 0.f;
        #pragma unroll
        for (int nt = 0; nt < CBV / 8; nt++) {
            ps_a += exp2f(s[nt][0] - mu_a) + exp2f(s[nt][1] - mu_a);
            ps_b += exp2f(s[nt][2] - mu_b) + exp2f(s[nt][3] - mu_b);
        }
        l_a = l_a * exp2f(m_a - mu_a) + ps_a;
        l_b = l_b * exp2f(m_b - mu_b) + ps_b;
        m_a = mn_a;
        m_b = mn_b;
    }
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (tq == 0) {
        if (ra < n) {
            pm[(i64)split * n + ra] = m_a;
            pl[(i64)split * n + ra] = l_a;
        }
        if (rb < n) {
            pm[(i64)split * n + rb] = m_b;
            pl[(i64)split * n + rb] = l_b;
        }
    }
}

extern "C" __global__ void __launch_bounds__(CNT) lf_cce_fwd(const bf16* h, const bf16* w, const u32* tgt, float* pm,
                                                             float* pl, float* tlogit, int n, int v, int hd, int tps,
                                                             float cap) {
    cce_fwd<false>(h, w, tgt, pm, pl, tlogit, n, v, hd, tps, cap);
}
extern "C" __global__ void __launch_bounds__(CNT) lf_cce_fwd_cap(const bf16* h, const bf16* w, const u32* tgt,
                                                                 float* pm, float* pl, float* tlogit, int n, int v,
                                                                 int hd, int tps, float cap) {
    cce_fwd<true>(h, w, tgt, pm, pl, tlogit, n, v, hd, tps, cap);
}

// One thread per row: merge the splits' (max, sum) pairs.
extern "C" __global__ void lf_cce_combine(const float* pm, const float* pl, const float* tlogit, const u32* tgt,
                                          float* logp, float* lse, int n, int nsplit) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float m = -LF_INF;
    for (int s = 0; s < nsplit; s++) m = fmaxf(m, pm[(i64)s * n + i]);
    float l = 0.f;
    for (int s = 0; s < nsplit; s++) l += pl[(i64)s * n + i] * exp2f(pm[(i64)s * n + i] - m);
    const float L = (m + log2f(l)) * LN2;
    lse[i] = L;
    logp[i] = tgt[i] == IGNORE ? 0.f : tlogit[i] - L;
}

// ------------------------------------------------------------------------------------------------
// Backward: dh32[N, H] += coeff . W over this block's vocabulary range (f32 atomics).
template <bool CAP, bool FILTER>
__device__ void cce_bwd(const bf16* __restrict__ h, const bf16* __restrict__ w, const u32* __restrict__ tgt,
                        const float* __restrict__ dlogp, const float* __restrict__ lse, float* __restrict__ dh,
                        int n, int v, int hd, int tps, float cap, float eps) {
    __shared__ __align__(16) bf16 hs[CBM * CSP];
    __shared__ __align__(16) bf16 ws[CBV * CSP];
    __shared__ __align__(16) bf16 wt[CKC * CST];
    const int r0 = blockIdx.x * CBM, split = blockIdx.y;
    const int ntiles = (v + CBV - 1) / CBV;
    const int vt0 = split * tps, vt1 = min(vt0 + tps, ntiles);
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int ra = r0 + 16 * wp + g, rb = ra + 8;
    const u32 ta = ra < n ? tgt[ra] : IGNORE, tb = rb < n ? tgt[rb] : IGNORE;
    const float ga = ta == IGNORE ? 0.f : dlogp[ra], gb = tb == IGNORE ? 0.f : dlogp[rb];
    // An ignored row's lse is +inf, so that its p is 0 rather than exp(logit), which overflows for
    // logits above 88 and makes 0 * inf = NaN coefficients.
    const float la = ta == IGNORE ? LF_INF : lse[ra] * LOG2E, lb = tb == IGNORE ? LF_INF : lse[rb] * LOG2E;
    // A row tile without gradient contributes nothing.
    if (!__syncthreads_or(ga != 0.f || gb != 0.f)) return;
    float s[CBV / 8][4];
    for (int vt = vt0; vt < vt1; vt++) {
        const int v0 = vt * CBV;
        cce_logits(s, hs, ws, h, w, r0, v0, n, v, hd);
        bool any = false;
        #pragma unroll
        for (int nt = 0; nt < CBV / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = v0 + nt * 8 + 2 * tq + (e & 1);
                float x = s[nt][e], d = 1.f;
                if (CAP) {
                    const float th = tanhf(x / cap);
                    x = cap * th;
                    d = 1.f - th * th;
                }
                const bool lo = e < 2;
                const float p = exp2f(x * LOG2E - (lo ? la : lb));
                const float oh = (u32)col == (lo ? ta : tb) ? 1.f : 0.f;
                // The filter tests the softmax gradient before the row's dlogp scale.
                float u = (oh - p) * d;
                if (col >= v || (FILTER && fabsf(u) < eps)) u = 0.f;
                const float c = (lo ? ga : gb) * u;
                any |= c != 0.f;
                s[nt][e] = c;
            }
        }
        // Skip the tile when every coefficient of the 64 x 128 block was filtered (or is zero).
        if (!__syncthreads_or(any)) continue;
        u32 pf[CBV / 16][4];
        #pragma unroll
        for (int j = 0; j < CBV / 16; j++) {
            pf[j][0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
            pf[j][1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
            pf[j][2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
            pf[j][3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
        }
        for (int c0 = 0; c0 < hd; c0 += CKC) {
            __syncthreads();
            cce_load<true>(wt, w, v0, CBV, v, c0, hd);
            __syncthreads();
            float acc[CKC / 8][4];
            #pragma unroll
            for (int nd = 0; nd < CKC / 8; nd++) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;
            #pragma unroll
            for (int j = 0; j < CBV / 16; j++) {
                #pragma unroll
                for (int nd = 0; nd < CKC / 8; nd++) {
                    const bf16* wb = wt + (nd * 8 + g) * CST + j * 16 + 2 * tq;
                    mma16816(acc[nd], pf[j], lds32(wb), lds32(wb + 8));
                }
            }
            #pragma unroll
            for (int nd = 0; nd < CKC / 8; nd++) {
                const int col = c0 + nd * 8 + 2 * tq;
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (col + e < hd) {
                        if (ra < n) atomicAdd(dh + (i64)ra * hd + col + e, acc[nd][e]);
                        if (rb < n) atomicAdd(dh + (i64)rb * hd + col + e, acc[nd][2 + e]);
                    }
                }
            }
        }
    }
}

#define CCE_BWD(name, CAP, FILTER)                                                                            \
    extern "C" __global__ void __launch_bounds__(CNT)                                                         \
        name(const bf16* h, const bf16* w, const u32* tgt, const float* dlogp, const float* lse, float* dh,  \
             int n, int v, int hd, int tps, float cap, float eps) {                                           \
        cce_bwd<CAP, FILTER>(h, w, tgt, dlogp, lse, dh, n, v, hd, tps, cap, eps);                            \
    }
CCE_BWD(lf_cce_bwd, false, true)
CCE_BWD(lf_cce_bwd_cap, true, true)
CCE_BWD(lf_cce_bwd_nofilt, false, false)
CCE_BWD(lf_cce_bwd_cap_nofilt, true, false)
