// FlashAttention-2 style attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate).
// Never materialises [T, T]: query tiles x key tiles in shared memory with an online softmax; the
// per-row log-sum-exp is saved ([n_heads, T] f32) and the backward recomputes probabilities tile
// by tile. Backward: D = rowsum(dO * O), then either one pass per key tile (version 4: dK/dV in
// registers, dQ added into an f32 accumulator with atomics) or, deterministic, dQ per query tile
// and dK/dV per key tile (versions 1 and 2, no atomics).
//
// Visibility per (query, key): key in [a0, a1) or [b0, b1) of the query's ranges, and, with a
// window, pos[q] - pos[k] < window. Whole tiles with no visible element are skipped; tiles that
// are fully visible skip the per-element test. Head dims are padded to HDP (a multiple of 16) with
// zeros in shared memory, so any head_dim up to 128 works.
//
// Versions: 1 (below, any head_dim up to 128); 2, 3 and 4 (after it: head_dim 64 and 128 only,
// mma.sync with ldmatrix and cp.async, about 3x faster; version 2's forward, dQ and dK/dV also at
// head_dim 256); 6 (head_dim 256, the one-pass backward on mma.sync); 5 (head_dim 128 on sm_90a,
// warpgroup MMAs, compiled only where the module targets sm_90a); 7 (at the end: head_dim 512,
// forward, dQ and dK/dV on mma.sync, no atomics). The host picks the newest that applies. All
// keep these semantics, and every kernel has a softcapped form (`_cap`, see cap_scores).
//
// mma.m16n8k16 fragment layouts (g = lane / 4, t = lane % 4):
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8 f32):         c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)

// NVRTC compiles this file as three modules, one part of the kernels each, so that they compile
// in parallel (compile.rs: attention_v1, version 1 and the small shared kernels; attention_v234;
// attention_v567). Each is the whole file with LF_ATTN_PART set; unset (0), every kernel.
#ifndef LF_ATTN_PART
#define LF_ATTN_PART 0
#endif
#define LF_PART(n) (LF_ATTN_PART == 0 || LF_ATTN_PART == (n))

#define BQ 64
#define BK 64
#define NTHREADS 128

// Zeroes a warp's dK and dV accumulators (the one-pass and dK/dV kernels' key rows).
template <int N>
__device__ __forceinline__ void zero_key_acc(float (&adk)[N][4], float (&adv)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; i++) {
        adk[i][0] = adk[i][1] = adk[i][2] = adk[i][3] = 0.f;
        adv[i][0] = adv[i][1] = adv[i][2] = adv[i][3] = 0.f;
    }
}

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; results below 2^-126 flush to
// zero, which no softmax weight notices). exp2f adds a denormal-range fix-up of three
// instructions per call, a sixth of a forward tile's instructions. Versions 2-5 use this.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh(y) = 1 - 2 / (1 + e^(2y)) from one exp2: absolute error about 1e-7 over the whole range
// (tanh.approx's relative 2^-11 would put errors of 0.02 on scores near a cap of 50); y is clamped
// at 15, where tanh is 1 in f32, so that e stays finite.
__device__ __forceinline__ float cap_tanh(float y) {
    const float e = fast_exp2(fminf(y, 15.f) * (2.f * LOG2E));
    return 1.f - __fdividef(2.f, 1.f + e);
}

// Logit softcap (Gemma 2): raw dot products x become the scores cap * tanh(x * sc) with sc =
// scale / cap, in natural-log units (so that the softmax then scales by LOG2E alone). Kernels take
// it as a template flag CAP: the uncapped ones compile exactly as before. The backward recomputes
// tanh and multiplies dS by the cap's derivative 1 - tanh^2.
template <int NB>
__device__ __forceinline__ void cap_scores(float (&s)[NB][4], float sc, float cap) {
    #pragma unroll
    for (int nt = 0; nt < NB; nt++)
        #pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = cap * cap_tanh(s[nt][e] * sc);
}

struct Mask {
    const uint4* ranges;                // [T] of (a0, a1, b0, b1)
    const int* pos;                     // [T]
    const int* kt_min;                  // [ceil(T/64)] min position of each 64-key tile
    const int* kt_max;                  // [ceil(T/64)] max position
    const unsigned char* tile_flags;    // [n][n], n = ceil(T/64): lf_attn_tile_flags (versions 2+)
    int window;                         // < 0: none
};

__device__ __forceinline__ bool visible(uint4 r, int qpos, int k, int kpos, int window) {
    u32 ku = (u32)k;
    bool in = (ku >= r.x && ku < r.y) || (ku >= r.z && ku < r.w);
    return in && (window < 0 || qpos - kpos < window);
}

// Whether query row (ranges r, position qpos) sees any key of [k0, k1) and whether it sees all.
__device__ __forceinline__ void row_vs_tile(uint4 r, int qpos, u32 k0, u32 k1, int kmin, int kmax, int window,
                                            bool& any, bool& all) {
    bool hit = (r.x < k1 && r.y > k0 && r.y > r.x) || (r.z < k1 && r.w > k0 && r.w > r.z);
    bool cover = (r.x <= k0 && k1 <= r.y) || (r.z <= k0 && k1 <= r.w);
    bool wany = window < 0 || qpos - kmax < window;
    bool wall = window < 0 || qpos - kmin < window;
    any = hit && wany;
    all = cover && wall;
}

// Copies rows [row0, row0 + nrows) x cols [col0, col0 + hd) of a row-major bf16 matrix (row
// stride `stride`) into shared memory, zero-filling rows >= t and columns >= hd up to HDP.
// TRANS stores dst[d * dstride + r], else dst[r * dstride + d].
template <int HDP, bool TRANS>
__device__ __forceinline__ void load_tile(bf16* dst, int dstride, const bf16* src, i64 stride, i64 col0,
                                          int row0, int nrows, int t, int hd) {
    const bf16 zero = __float2bfloat16(0.f);
    if ((hd & 7) == 0 && (stride & 7) == 0 && (col0 & 7) == 0) {
        const int cpr = HDP / 8;
        for (int idx = threadIdx.x; idx < nrows * cpr; idx += NTHREADS) {
            int r = idx / cpr, c = (idx % cpr) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (row0 + r < t && c < hd) v = *(const uint4*)(src + (i64)(row0 + r) * stride + col0 + c);
            if (TRANS) {
                const bf16* e = (const bf16*)&v;
                #pragma unroll
                for (int j = 0; j < 8; j++) dst[(c + j) * dstride + r] = e[j];
            } else {
                *(uint4*)(dst + r * dstride + c) = v;
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < nrows * HDP; idx += NTHREADS) {
            int r = idx / HDP, c = idx % HDP;
            bf16 v = zero;
            if (row0 + r < t && c < hd) v = src[(i64)(row0 + r) * stride + col0 + c];
            if (TRANS) dst[c * dstride + r] = v;
            else dst[r * dstride + c] = v;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Forward. grid (ceil(T/64), n_heads), 128 threads; warp w owns query rows 16w..16w+15 of the tile.
template <int HDP, bool CAP>
__device__ void attn_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv, int hd,
                         float scale, float cap) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int SQ = HDP + 8, SV = BK + 8;
    bf16* qs = (bf16*)smem;
    bf16* ks = qs + BQ * SQ;
    bf16* vt = ks + BK * SQ;
    int* kpos = (int*)(vt + HDP * SV);

    const int h = blockIdx.y, kvh = h / (nh / nkv);
    // Late query tiles see the most keys under a causal mask: schedule them first.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * hd, kstride = (i64)nkv * hd;
    const float sl2 = scale * LOG2E;

    load_tile<HDP, false>(qs, SQ, q, qstride, (i64)h * hd, q0, BQ, t, hd);

    const int ra = q0 + 16 * w + g, rb = ra + 8;
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const uint4 rga = ra < t ? mk.ranges[ra] : empty, rgb = rb < t ? mk.ranges[rb] : empty;
    const int pa = ra < t ? mk.pos[ra] : 0, pb = rb < t ? mk.pos[rb] : 0;
    // Row tested for tile skipping by this thread (threads 0..63).
    const int rt = q0 + threadIdx.x;
    const uint4 rgt = (threadIdx.x < BQ && rt < t) ? mk.ranges[rt] : empty;
    const int pt = (threadIdx.x < BQ && rt < t) ? mk.pos[rt] : 0;
    __syncthreads();

    u32 qf[HDP / 16][4];
    #pragma unroll
    for (int kk = 0; kk < HDP / 16; kk++) {
        const bf16* base = qs + (16 * w + g) * SQ + kk * 16 + 2 * tq;
        qf[kk][0] = lds32(base);
        qf[kk][1] = lds32(base + 8 * SQ);
        qf[kk][2] = lds32(base + 8);
        qf[kk][3] = lds32(base + 8 * SQ + 8);
    }

    float acc[HDP / 8][4];
    #pragma unroll
    for (int i = 0; i < HDP / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_a = -LF_INF, m_b = -LF_INF, l_a = 0.f, l_b = 0.f;

    const int ntiles = (t + BK - 1) / BK;
    for (int kt = 0; kt < ntiles; kt++) {
        const int k0 = kt * BK;
        const u32 k1 = (u32)min(k0 + BK, t);
        bool any = false, all = true;
        if (threadIdx.x < BQ) {
            if (rt < t) row_vs_tile(rgt, pt, (u32)k0, k1, mk.kt_min[kt], mk.kt_max[kt], mk.window, any, all);
        }
        const bool tile_any = __syncthreads_or(any);
        if (!tile_any) continue;
        const bool tile_all = __syncthreads_and(all) && (k0 + BK <= t) && (q0 + BQ <= t);

        load_tile<HDP, false>(ks, SQ, k, kstride, (i64)kvh * hd, k0, BK, t, hd);
        load_tile<HDP, true>(vt, SV, v, kstride, (i64)kvh * hd, k0, BK, t, hd);
        if (threadIdx.x < BK) kpos[threadIdx.x] = (k0 + (int)threadIdx.x < t) ? mk.pos[k0 + threadIdx.x] : 0;
        __syncthreads();

        float s[BK / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < HDP / 16; kk++) {
                const bf16* kb = ks + (nt * 8 + g) * SQ + kk * 16 + 2 * tq;
                mma16816(s[nt], qf[kk], lds32(kb), lds32(kb + 8));
            }
        }
        float mx_a = -LF_INF, mx_b = -LF_INF;
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = CAP ? cap * cap_tanh(s[nt][e] * (scale / cap)) * LOG2E : s[nt][e] * sl2;
                if (!tile_all) {
                    int kl = nt * 8 + 2 * tq + (e & 1);
                    bool vis = e < 2 ? visible(rga, pa, k0 + kl, kpos[kl], mk.window)
                                     : visible(rgb, pb, k0 + kl, kpos[kl], mk.window);
                    if (!vis) x = -LF_INF;
                }
                s[nt][e] = x;
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
        const float al_a = exp2f(m_a - mu_a), al_b = exp2f(m_b - mu_b);
        m_a = mn_a;
        m_b = mn_b;
        float ps_a = 0.f, ps_b = 0.f;
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - mu_a);
            s[nt][1] = exp2f(s[nt][1] - mu_a);
            s[nt][2] = exp2f(s[nt][2] - mu_b);
            s[nt][3] = exp2f(s[nt][3] - mu_b);
            ps_a += s[nt][0] + s[nt][1];
            ps_b += s[nt][2] + s[nt][3];
        }
        l_a = l_a * al_a + ps_a;
        l_b = l_b * al_b + ps_b;
        #pragma unroll
        for (int i = 0; i < HDP / 8; i++) {
            acc[i][0] *= al_a;
            acc[i][1] *= al_a;
            acc[i][2] *= al_b;
            acc[i][3] *= al_b;
        }
        #pragma unroll
        for (int j = 0; j < BK / 16; j++) {
            u32 pf[4];
            pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
            pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
            pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
            pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
            #pragma unroll
            for (int nd = 0; nd < HDP / 8; nd++) {
                const bf16* vb = vt + (nd * 8 + g) * SV + j * 16 + 2 * tq;
                mma16816(acc[nd], pf, lds32(vb), lds32(vb + 8));
            }
        }
        __syncthreads();
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    #pragma unroll
    for (int nd = 0; nd < HDP / 8; nd++) {
        const int d = nd * 8 + 2 * tq;
        #pragma unroll
        for (int e = 0; e < 2; e++) {
            if (d + e < hd) {
                if (ra < t) o[(i64)ra * qstride + (i64)h * hd + d + e] = __float2bfloat16(acc[nd][e] * inv_a);
                if (rb < t) o[(i64)rb * qstride + (i64)h * hd + d + e] = __float2bfloat16(acc[nd][2 + e] * inv_b);
            }
        }
    }
    if (tq == 0) {
        if (ra < t) lse[(i64)h * t + ra] = l_a > 0.f ? (m_a + log2f(l_a)) * LN2 : -LF_INF;
        if (rb < t) lse[(i64)h * t + rb] = l_b > 0.f ? (m_b + log2f(l_b)) * LN2 : -LF_INF;
    }
}

// ------------------------------------------------------------------------------------------------
// D[h, q] = sum_d dO[q, h, d] * O[q, h, d]; one warp per (q, h).
#if LF_PART(1)
extern "C" __global__ void lf_attn_bwd_dot(const bf16* d_o, const bf16* o, float* dd, int t, int nh, int hd) {
    i64 wid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (wid >= (i64)t * nh) return;
    int qi = (int)(wid / nh), h = (int)(wid % nh);
    const i64 base = (i64)qi * nh * hd + (i64)h * hd;
    float acc = 0.f;
    for (int d = lane; d < hd; d += 32) acc += __bfloat162float(d_o[base + d]) * __bfloat162float(o[base + d]);
    acc = warp_sum(acc);
    if (lane == 0) dd[(i64)h * t + qi] = acc;
}
#endif

// ------------------------------------------------------------------------------------------------
// dQ. grid (ceil(T/64), n_heads); warp w owns query rows 16w.. of the tile.
template <int HDP, bool CAP>
__device__ void attn_bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            const bf16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dd,
                            bf16* __restrict__ dq, Mask mk, int t, int nh, int nkv, int hd, float scale, float cap) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int SQ = HDP + 8, SK = BK + 8;
    bf16* qs = (bf16*)smem;
    bf16* dos = qs + BQ * SQ;
    bf16* ks = dos + BQ * SQ;
    bf16* vs = ks + BK * SQ;
    bf16* kt_s = vs + BK * SQ;
    int* kpos = (int*)(kt_s + HDP * SK);

    const int h = blockIdx.y, kvh = h / (nh / nkv);
    // Late query tiles see the most keys under a causal mask: schedule them first.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * hd, kstride = (i64)nkv * hd;
    const float sl2 = scale * LOG2E;

    load_tile<HDP, false>(qs, SQ, q, qstride, (i64)h * hd, q0, BQ, t, hd);
    load_tile<HDP, false>(dos, SQ, d_o, qstride, (i64)h * hd, q0, BQ, t, hd);

    const int ra = q0 + 16 * w + g, rb = ra + 8;
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const uint4 rga = ra < t ? mk.ranges[ra] : empty, rgb = rb < t ? mk.ranges[rb] : empty;
    const int pa = ra < t ? mk.pos[ra] : 0, pb = rb < t ? mk.pos[rb] : 0;
    const float la = ra < t ? lse[(i64)h * t + ra] * LOG2E : 0.f, lb = rb < t ? lse[(i64)h * t + rb] * LOG2E : 0.f;
    const float da = ra < t ? dd[(i64)h * t + ra] : 0.f, db = rb < t ? dd[(i64)h * t + rb] : 0.f;
    const int rt = q0 + threadIdx.x;
    const uint4 rgt = (threadIdx.x < BQ && rt < t) ? mk.ranges[rt] : empty;
    const int pt = (threadIdx.x < BQ && rt < t) ? mk.pos[rt] : 0;
    __syncthreads();

    float acc[HDP / 8][4];
    #pragma unroll
    for (int i = 0; i < HDP / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    const int ntiles = (t + BK - 1) / BK;
    for (int kt = 0; kt < ntiles; kt++) {
        const int k0 = kt * BK;
        const u32 k1 = (u32)min(k0 + BK, t);
        bool any = false, all = true;
        if (threadIdx.x < BQ) {
            if (rt < t) row_vs_tile(rgt, pt, (u32)k0, k1, mk.kt_min[kt], mk.kt_max[kt], mk.window, any, all);
        }
        const bool tile_any = __syncthreads_or(any);
        if (!tile_any) continue;
        const bool tile_all = __syncthreads_and(all) && (k0 + BK <= t) && (q0 + BQ <= t);

        load_tile<HDP, false>(ks, SQ, k, kstride, (i64)kvh * hd, k0, BK, t, hd);
        load_tile<HDP, true>(kt_s, SK, k, kstride, (i64)kvh * hd, k0, BK, t, hd);
        load_tile<HDP, false>(vs, SQ, v, kstride, (i64)kvh * hd, k0, BK, t, hd);
        if (threadIdx.x < BK) kpos[threadIdx.x] = (k0 + (int)threadIdx.x < t) ? mk.pos[k0 + threadIdx.x] : 0;
        __syncthreads();

        float s[BK / 8][4], dp[BK / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
        }
        #pragma unroll
        for (int kk = 0; kk < HDP / 16; kk++) {
            u32 af[4], bf[4];
            const bf16* qb = qs + (16 * w + g) * SQ + kk * 16 + 2 * tq;
            af[0] = lds32(qb);
            af[1] = lds32(qb + 8 * SQ);
            af[2] = lds32(qb + 8);
            af[3] = lds32(qb + 8 * SQ + 8);
            const bf16* ob = dos + (16 * w + g) * SQ + kk * 16 + 2 * tq;
            bf[0] = lds32(ob);
            bf[1] = lds32(ob + 8 * SQ);
            bf[2] = lds32(ob + 8);
            bf[3] = lds32(ob + 8 * SQ + 8);
            #pragma unroll
            for (int nt = 0; nt < BK / 8; nt++) {
                const bf16* kb = ks + (nt * 8 + g) * SQ + kk * 16 + 2 * tq;
                mma16816(s[nt], af, lds32(kb), lds32(kb + 8));
                const bf16* vb = vs + (nt * 8 + g) * SQ + kk * 16 + 2 * tq;
                mma16816(dp[nt], bf, lds32(vb), lds32(vb + 8));
            }
        }
        #pragma unroll
        for (int nt = 0; nt < BK / 8; nt++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool top = e < 2;
                float p, dcap = 1.f;
                if (CAP) {
                    const float th = cap_tanh(s[nt][e] * (scale / cap));
                    p = exp2f(cap * th * LOG2E - (top ? la : lb));
                    dcap = 1.f - th * th;
                } else {
                    p = exp2f(s[nt][e] * sl2 - (top ? la : lb));
                }
                if (!tile_all) {
                    int kl = nt * 8 + 2 * tq + (e & 1);
                    bool vis = top ? visible(rga, pa, k0 + kl, kpos[kl], mk.window)
                                   : visible(rgb, pb, k0 + kl, kpos[kl], mk.window);
                    if (!vis) p = 0.f;
                }
                s[nt][e] = p * (dp[nt][e] - (top ? da : db)) * dcap;
            }
        }
        #pragma unroll
        for (int j = 0; j < BK / 16; j++) {
            u32 pf[4];
            pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
            pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
            pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
            pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
            #pragma unroll
            for (int nd = 0; nd < HDP / 8; nd++) {
                const bf16* kb = kt_s + (nd * 8 + g) * SK + j * 16 + 2 * tq;
                mma16816(acc[nd], pf, lds32(kb), lds32(kb + 8));
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int nd = 0; nd < HDP / 8; nd++) {
        const int d = nd * 8 + 2 * tq;
        #pragma unroll
        for (int e = 0; e < 2; e++) {
            if (d + e < hd) {
                if (ra < t) dq[(i64)ra * qstride + (i64)h * hd + d + e] = __float2bfloat16(acc[nd][e] * scale);
                if (rb < t) dq[(i64)rb * qstride + (i64)h * hd + d + e] = __float2bfloat16(acc[nd][2 + e] * scale);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// dK, dV. grid (ceil(T/64), n_heads); warp w owns keys 16w.. of the 64-key tile; loops over the
// 32-query tiles of query head blockIdx.y. Matrices are transposed (keys are the M dimension).
// With GQA (group > 1) each query head writes f32 partials [n_heads, T, hd] that
// lf_attn_dkdv_reduce sums over the group; with group 1 it writes bf16 dK/dV directly.
#define BQ2 32
template <int HDP, bool CAP>
__device__ void attn_bwd_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                              const bf16* __restrict__ d_o, const float* __restrict__ lse,
                              const float* __restrict__ dd, bf16* __restrict__ dk, bf16* __restrict__ dv,
                              float* __restrict__ dk_part, float* __restrict__ dv_part, Mask mk, int t, int nh,
                              int nkv, int hd, float scale, float cap) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int SQ = HDP + 8, ST = BQ2 + 8;
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + BK * SQ;
    bf16* qs = vs + BK * SQ;
    bf16* dos = qs + BQ2 * SQ;
    bf16* qt = dos + BQ2 * SQ;
    bf16* dot_s = qt + HDP * ST;
    float* lse_s = (float*)(dot_s + HDP * ST);
    float* d_s = lse_s + BQ2;
    uint4* qr_s = (uint4*)(d_s + BQ2);
    int* qpos_s = (int*)(qr_s + BQ2);

    const int h = blockIdx.y, group = nh / nkv, kvh = h / group;
    const int k0 = blockIdx.x * BK;
    const u32 k1 = (u32)min(k0 + BK, t);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * hd, kstride = (i64)nkv * hd;
    const float sl2 = scale * LOG2E;
    const int kmin = mk.kt_min[blockIdx.x], kmax = mk.kt_max[blockIdx.x];

    load_tile<HDP, false>(ks, SQ, k, kstride, (i64)kvh * hd, k0, BK, t, hd);
    load_tile<HDP, false>(vs, SQ, v, kstride, (i64)kvh * hd, k0, BK, t, hd);
    const int ka = k0 + 16 * w + g, kb = ka + 8;
    const int kpa = ka < t ? mk.pos[ka] : 0, kpb = kb < t ? mk.pos[kb] : 0;

    float adk[HDP / 8][4], adv[HDP / 8][4];
    zero_key_acc(adk, adv);
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const int nqt = (t + BQ2 - 1) / BQ2;
    {
        for (int it = 0; it < nqt; it++) {
            const int q0 = it * BQ2;
            bool any = false, all = true;
            if (threadIdx.x < BQ2) {
                const int qi = q0 + threadIdx.x;
                if (qi < t) {
                    uint4 r = mk.ranges[qi];
                    int p = mk.pos[qi];
                    row_vs_tile(r, p, (u32)k0, k1, kmin, kmax, mk.window, any, all);
                    qr_s[threadIdx.x] = r;
                    qpos_s[threadIdx.x] = p;
                    lse_s[threadIdx.x] = any ? lse[(i64)h * t + qi] * LOG2E : 0.f;
                    d_s[threadIdx.x] = dd[(i64)h * t + qi];
                } else {
                    qr_s[threadIdx.x] = empty;
                    qpos_s[threadIdx.x] = 0;
                    lse_s[threadIdx.x] = 0.f;
                    d_s[threadIdx.x] = 0.f;
                }
            }
            const bool tile_any = __syncthreads_or(any);
            if (!tile_any) continue;
            const bool tile_all = __syncthreads_and(all) && (k0 + BK <= t) && (q0 + BQ2 <= t);
            load_tile<HDP, false>(qs, SQ, q, qstride, (i64)h * hd, q0, BQ2, t, hd);
            load_tile<HDP, true>(qt, ST, q, qstride, (i64)h * hd, q0, BQ2, t, hd);
            load_tile<HDP, false>(dos, SQ, d_o, qstride, (i64)h * hd, q0, BQ2, t, hd);
            load_tile<HDP, true>(dot_s, ST, d_o, qstride, (i64)h * hd, q0, BQ2, t, hd);
            __syncthreads();

            float s[BQ2 / 8][4], dp[BQ2 / 8][4];
            #pragma unroll
            for (int nt = 0; nt < BQ2 / 8; nt++) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
                dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
            }
            #pragma unroll
            for (int kk = 0; kk < HDP / 16; kk++) {
                u32 af[4], vf[4];
                const bf16* kp = ks + (16 * w + g) * SQ + kk * 16 + 2 * tq;
                af[0] = lds32(kp);
                af[1] = lds32(kp + 8 * SQ);
                af[2] = lds32(kp + 8);
                af[3] = lds32(kp + 8 * SQ + 8);
                const bf16* vp = vs + (16 * w + g) * SQ + kk * 16 + 2 * tq;
                vf[0] = lds32(vp);
                vf[1] = lds32(vp + 8 * SQ);
                vf[2] = lds32(vp + 8);
                vf[3] = lds32(vp + 8 * SQ + 8);
                #pragma unroll
                for (int nt = 0; nt < BQ2 / 8; nt++) {
                    const bf16* qb = qs + (nt * 8 + g) * SQ + kk * 16 + 2 * tq;
                    mma16816(s[nt], af, lds32(qb), lds32(qb + 8));
                    const bf16* ob = dos + (nt * 8 + g) * SQ + kk * 16 + 2 * tq;
                    mma16816(dp[nt], vf, lds32(ob), lds32(ob + 8));
                }
            }
            // s -> P^T, dp -> dS^T. Element e: key row (e < 2 ? ka : kb), query col 2tq + (e & 1).
            #pragma unroll
            for (int nt = 0; nt < BQ2 / 8; nt++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = nt * 8 + 2 * tq + (e & 1);
                    float p, dcap = 1.f;
                    if (CAP) {
                        const float th = cap_tanh(s[nt][e] * (scale / cap));
                        p = exp2f(cap * th * LOG2E - lse_s[ql]);
                        dcap = 1.f - th * th;
                    } else {
                        p = exp2f(s[nt][e] * sl2 - lse_s[ql]);
                    }
                    if (!tile_all) {
                        const bool top = e < 2;
                        bool vis = visible(qr_s[ql], qpos_s[ql], top ? ka : kb, top ? kpa : kpb, mk.window);
                        if (!vis) p = 0.f;
                    }
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - d_s[ql]) * dcap;
                }
            }
            #pragma unroll
            for (int j = 0; j < BQ2 / 16; j++) {
                u32 pf[4], sf[4];
                pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
                pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
                pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
                pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
                sf[0] = pack_bf16(dp[2 * j][0], dp[2 * j][1]);
                sf[1] = pack_bf16(dp[2 * j][2], dp[2 * j][3]);
                sf[2] = pack_bf16(dp[2 * j + 1][0], dp[2 * j + 1][1]);
                sf[3] = pack_bf16(dp[2 * j + 1][2], dp[2 * j + 1][3]);
                #pragma unroll
                for (int nd = 0; nd < HDP / 8; nd++) {
                    const bf16* ob = dot_s + (nd * 8 + g) * ST + j * 16 + 2 * tq;
                    mma16816(adv[nd], pf, lds32(ob), lds32(ob + 8));
                    const bf16* qb = qt + (nd * 8 + g) * ST + j * 16 + 2 * tq;
                    mma16816(adk[nd], sf, lds32(qb), lds32(qb + 8));
                }
            }
            __syncthreads();
        }
    }
    #pragma unroll
    for (int nd = 0; nd < HDP / 8; nd++) {
        const int d = nd * 8 + 2 * tq;
        #pragma unroll
        for (int e = 0; e < 2; e++) {
            if (d + e < hd && group > 1) {
                if (ka < t) {
                    dk_part[((i64)h * t + ka) * hd + d + e] = adk[nd][e] * scale;
                    dv_part[((i64)h * t + ka) * hd + d + e] = adv[nd][e];
                }
                if (kb < t) {
                    dk_part[((i64)h * t + kb) * hd + d + e] = adk[nd][2 + e] * scale;
                    dv_part[((i64)h * t + kb) * hd + d + e] = adv[nd][2 + e];
                }
            } else if (d + e < hd) {
                const i64 col = (i64)kvh * hd + d + e;
                if (ka < t) {
                    dk[(i64)ka * kstride + col] = __float2bfloat16(adk[nd][e] * scale);
                    dv[(i64)ka * kstride + col] = __float2bfloat16(adv[nd][e]);
                }
                if (kb < t) {
                    dk[(i64)kb * kstride + col] = __float2bfloat16(adk[nd][2 + e] * scale);
                    dv[(i64)kb * kstride + col] = __float2bfloat16(adv[nd][2 + e]);
                }
            }
        }
    }
}

// dK[key, kvh, :] = sum over the group's query heads of the f32 partials; likewise dV.
#if LF_PART(1)
extern "C" __global__ void lf_attn_dkdv_reduce(const float* dkp, const float* dvp, bf16* dk, bf16* dv, int t,
                                               int nkv, int group, int hd) {
    const i64 n = (i64)t * nkv * hd;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 key = i / ((i64)nkv * hd);
        const int rem = (int)(i % ((i64)nkv * hd)), kvh = rem / hd, d = rem % hd;
        float a = 0.f, b = 0.f;
        for (int g = 0; g < group; g++) {
            const i64 o = ((i64)(kvh * group + g) * t + key) * hd + d;
            a += dkp[o];
            b += dvp[o];
        }
        dk[i] = __float2bfloat16(a);
        dv[i] = __float2bfloat16(b);
    }
}
#endif

// Every attention kernel takes the softcap as its last argument; only the `_cap` instances
// (CAP = true) read it.
#define INSTANTIATE(HDP, CAP, SFX)                                                                             \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_fwd_##HDP##SFX(                             \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        int hd, float scale, float cap) {                                                                      \
        attn_fwd<HDP, CAP>(q, k, v, o, lse, mk, t, nh, nkv, hd, scale, cap);                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_bwd_dq_##HDP##SFX(                          \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dq, Mask mk, int t, int nh, int nkv, int hd, float scale, float cap) {                           \
        attn_bwd_dq<HDP, CAP>(q, k, v, d_o, lse, dd, dq, mk, t, nh, nkv, hd, scale, cap);                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_bwd_dkdv_##HDP##SFX(                        \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv, int hd,           \
        float scale, float cap) {                                                                              \
        attn_bwd_dkdv<HDP, CAP>(q, k, v, d_o, lse, dd, dk, dv, dk_part, dv_part, mk, t, nh, nkv, hd, scale,    \
                                cap);                                                                          \
    }

#if LF_PART(1)
INSTANTIATE(16, false, )
INSTANTIATE(32, false, )
INSTANTIATE(64, false, )
INSTANTIATE(96, false, )
INSTANTIATE(128, false, )
INSTANTIATE(16, true, _cap)
INSTANTIATE(32, true, _cap)
INSTANTIATE(64, true, _cap)
INSTANTIATE(96, true, _cap)
INSTANTIATE(128, true, _cap)
#endif

// ================================================================================================
// Version 2 (head_dim 64 and 128, 16-byte aligned rows): operands staged by cp.async into padded
// row-major shared tiles (row stride HD + 8, so ldmatrix rows hit distinct banks), two buffers deep;
// fragments read with ldmatrix (.trans where the tile is the k-major B operand, so nothing is
// transposed on the way in); the probabilities stay in registers as the A operand of the second
// product. Tile visibility (0 none, 1 partial, 2 full) is decided once per block, a warp per tile,
// into shared memory, so the main loops know the next visible tile before they need it.
// Same masking semantics, LSE and backward contract as version 1.

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// Lane offsets (in elements, row stride SS) for ldmatrix.x4:
//  A fragment of a 16x16 tile at (row, col):             rows lane%16, cols (lane/16)*8
//  B fragments of two 8-wide n-tiles, tile stored [n][k]: rows (lane/16)*8 + lane%8, cols ((lane/8)%2)*8
//    -> r0,r1 = b0,b1 of n-tile 0; r2,r3 = b0,b1 of n-tile 1
//  B fragments of two 8-wide n-tiles, tile stored [k][n] (.trans): rows ((lane/8)%2)*8 + lane%8,
//    cols (lane/16)*8 -> same register order
template <int SS>
__device__ __forceinline__ int lo_a(int lane) { return (lane & 15) * SS + (lane >> 4) * 8; }
template <int SS>
__device__ __forceinline__ int lo_bn(int lane) { return ((lane >> 4) * 8 + (lane & 7)) * SS + ((lane >> 3) & 1) * 8; }
template <int SS>
__device__ __forceinline__ int lo_bt(int lane) { return (((lane >> 3) & 1) * 8 + (lane & 7)) * SS + (lane >> 4) * 8; }
// A fragment of a 16x16 tile stored transposed ([k][m], .trans): rows (k) (lane%8) + (lane/16)*8,
//    cols (m) ((lane/8)%2)*8 -> a0..a3 in register order
template <int SS>
__device__ __forceinline__ int lo_at(int lane) { return ((lane & 7) + (lane >> 4) * 8) * SS + ((lane >> 3) & 1) * 8; }

// p[0] += a, p[1] += b (p 8-byte aligned, global memory): one vector reduction on sm_90.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    atomicAdd((float2*)p, make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Rows [row0, row0 + NR) x HD columns of a row-major matrix (row stride `stride`, `src` already at
// the head's column) into a padded shared tile; rows >= t are zero-filled.
template <int HD, int NR, int NT>
__device__ __forceinline__ void cp_tile(bf16* dst, const bf16* src, i64 stride, int row0, int t) {
    constexpr int CPR = HD / 8, SS = HD + 8;
    #pragma unroll
    for (int idx = threadIdx.x; idx < NR * CPR; idx += NT) {
        const int r = idx / CPR, c = (idx % CPR) * 8, gr = row0 + r;
        const bool ok = gr < t;
        cp_async16(dst + r * SS + c, src + (i64)(ok ? gr : 0) * stride + c, ok);
    }
}

// Visibility of key tile kt (64 keys) for query rows [q0, q0 + NR), decided by one warp.
template <int NR>
__device__ __forceinline__ unsigned char warp_tile_flag(const Mask& mk, int q0, int kt, int t, int lane) {
    const int k0 = kt * 64;
    const u32 k1 = (u32)min(k0 + 64, t);
    const int kmin = mk.kt_min[kt], kmax = mk.kt_max[kt];
    bool any = false, all = true;
    #pragma unroll
    for (int j = 0; j < (NR + 31) / 32; j++) {
        const int rl = lane + 32 * j, qi = q0 + rl;
        if (rl < NR && qi < t) {
            bool a, l;
            row_vs_tile(mk.ranges[qi], qi < t ? mk.pos[qi] : 0, (u32)k0, k1, kmin, kmax, mk.window, a, l);
            any |= a;
            all &= l;
        }
    }
    any = __any_sync(0xffffffffu, any);
    all = __all_sync(0xffffffffu, all);
    if (!any) return 0;
    return (all && k0 + 64 <= t && q0 + NR <= t) ? 2 : 1;
}

// The visibility table of every (64-query tile, 64-key tile): one warp per entry, computed once
// per mask (each attention call) instead of by every block of every head. grid (n, ceil(n / 4)),
// 128 threads.
#if LF_PART(1)
extern "C" __global__ void lf_attn_tile_flags(Mask mk, int t, unsigned char* flags) {
    const int n = (t + 63) / 64, qt = blockIdx.x, kt = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (kt >= n) return;
    const unsigned char f = warp_tile_flag<64>(mk, qt * 64, kt, t, threadIdx.x & 31);
    if ((threadIdx.x & 31) == 0) flags[(i64)qt * n + kt] = f;
}
#endif

// Visibility (0 none, 1 partial, 2 full) of the tile made of query tiles [qt0, qt0 + nq) and key
// tiles [kt0, kt0 + nk) (64 each) from the table: full only if every part is; parts past T count
// as unseen, which makes a tile reaching past T partial.
__device__ __forceinline__ unsigned char tile_flag(const Mask& mk, int t, int qt0, int nq, int kt0, int nk) {
    const int n = (t + 63) / 64;
    bool any = false, all = true;
    for (int i = qt0; i < qt0 + nq; i++) {
        for (int j = kt0; j < kt0 + nk; j++) {
            const unsigned char f = i < n && j < n ? mk.tile_flags[(i64)i * n + j] : 0;
            any |= f != 0;
            all &= f == 2;
        }
    }
    return any ? (all ? 2 : 1) : 0;
}

__device__ __forceinline__ bool vis2(const Mask& mk, uint4 r, int qpos, bool qok, int k, int t) {
    if (!qok || k >= t) return false;
    return visible(r, qpos, k, mk.pos[k], mk.window);
}

// K and V rows of 64-key tile `tile` into padded shared tiles (cp.async, not yet committed).
template <int HD, int NT>
__device__ __forceinline__ void cp_kv_tile(bf16* ks, bf16* vs, const bf16* kg, const bf16* vg, i64 kstride,
                                           int tile, int t) {
    cp_tile<HD, 64, NT>(ks, kg, kstride, tile * 64, t);
    cp_tile<HD, 64, NT>(vs, vg, kstride, tile * 64, t);
}

// The first visible tile at or after `i` of `n` (visibility bytes `fl`); n when none.
__device__ __forceinline__ int next_visible(const unsigned char* fl, int i, int n) {
    while (i < n && fl[i] == 0) i++;
    return i;
}

// Prologue of the forward kernels (128 query rows from q0, 64-key tiles, NT threads): the Q tile
// and the key tiles' visibility into shared memory, then the loads of the first visible key
// tile's K and V started (double buffer 0). Returns that tile (ntiles when none).
template <int HD, int NT>
__device__ __forceinline__ int fwd_prologue(bf16* qs, bf16* ks, bf16* vs, unsigned char* fl, const bf16* qg,
                                            const bf16* kg, const bf16* vg, i64 qstride, i64 kstride,
                                            const Mask& mk, int q0, int t, int ntiles) {
    cp_tile<HD, 128, NT>(qs, qg, qstride, q0, t);
    cp_async_commit();
    for (int kt = threadIdx.x; kt < ntiles; kt += NT) fl[kt] = tile_flag(mk, t, q0 / 64, 2, kt, 1);
    __syncthreads();
    const int cur = next_visible(fl, 0, ntiles);
    if (cur < ntiles) cp_kv_tile<HD, NT>(ks, vs, kg, vg, kstride, cur, t);
    cp_async_commit();
    return cur;
}

// Masks a warp's 16-row x 64-key score tile (rows ra and ra + 8 = rb, C-fragment layout, keys
// from k0) to -inf where a key is not visible. The rows' ranges are read here only (partial
// tiles are few), to spare registers.
template <int NB>
__device__ __forceinline__ void mask_scores(float (&s)[NB][4], const Mask& mk, int ra, int rb, int k0, int t,
                                            int tq) {
    const bool oka = ra < t, okb = rb < t;
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const uint4 rga = oka ? mk.ranges[ra] : empty, rgb = okb ? mk.ranges[rb] : empty;
    const int pa = oka ? mk.pos[ra] : 0, pb = okb ? mk.pos[rb] : 0;
    #pragma unroll
    for (int nt = 0; nt < NB; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int kx = k0 + nt * 8 + 2 * tq + (e & 1);
            const bool vis = e < 2 ? vis2(mk, rga, pa, oka, kx, t) : vis2(mk, rgb, pb, okb, kx, t);
            if (!vis) s[nt][e] = -LF_INF;
        }
    }
}

// One key tile (NB blocks of 8 keys) of the online softmax for a warp's 16 rows (a: row g, b: row
// g + 8): raw scores s become the tile's unnormalised probabilities, the running maxima m (scaled
// log2 units; raw scores are scaled inside the FMA) and sums l are updated, and al_a / al_b are
// set to the factors the output accumulators must be rescaled by.
template <int NB>
__device__ __forceinline__ void softmax_tile(float (&s)[NB][4], float& m_a, float& m_b, float& l_a, float& l_b,
                                             float& al_a, float& al_b, float sl2) {
    float mx_a = -LF_INF, mx_b = -LF_INF;
    #pragma unroll
    for (int nt = 0; nt < NB; nt++) {
        mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float mn_a = fmaxf(m_a, mx_a * sl2), mn_b = fmaxf(m_b, mx_b * sl2);
    const float mu_a = mn_a == -LF_INF ? 0.f : mn_a, mu_b = mn_b == -LF_INF ? 0.f : mn_b;
    al_a = fast_exp2(m_a - mu_a);
    al_b = fast_exp2(m_b - mu_b);
    m_a = mn_a;
    m_b = mn_b;
    float ps_a = 0.f, ps_b = 0.f;
    #pragma unroll
    for (int nt = 0; nt < NB; nt++) {
        s[nt][0] = fast_exp2(fmaf(s[nt][0], sl2, -mu_a));
        s[nt][1] = fast_exp2(fmaf(s[nt][1], sl2, -mu_a));
        s[nt][2] = fast_exp2(fmaf(s[nt][2], sl2, -mu_b));
        s[nt][3] = fast_exp2(fmaf(s[nt][3], sl2, -mu_b));
        ps_a += s[nt][0] + s[nt][1];
        ps_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * al_a + ps_a;
    l_b = l_b * al_b + ps_b;
}

// Output accumulators of rows a and b times al_a and al_b.
template <int ND>
__device__ __forceinline__ void rescale_rows(float (&acc)[ND][4], float al_a, float al_b) {
    #pragma unroll
    for (int i = 0; i < ND; i++) {
        acc[i][0] *= al_a;
        acc[i][1] *= al_a;
        acc[i][2] *= al_b;
        acc[i][3] *= al_b;
    }
}

// One 64-key tile of the online softmax (see softmax_tile), the accumulators rescaled at once.
template <int HD>
__device__ __forceinline__ void online_softmax(float (&s)[8][4], float& m_a, float& m_b, float& l_a, float& l_b,
                                               float (&acc)[HD / 8][4], float sl2) {
    float al_a, al_b;
    softmax_tile<8>(s, m_a, m_b, l_a, l_b, al_a, al_b, sl2);
    rescale_rows<HD / 8>(acc, al_a, al_b);
}

// s = A1 B1^T and dp = A2 B2^T over HD for a warp's 16 rows (a1, a2: those rows of the A tiles)
// against an N-row pair of B tiles (b1, b2), all padded row-major (stride HD + 8): the first two
// products of both backward kernel families (queries x keys in dQ, keys x queries in dK/dV).
template <int HD, int N>
__device__ __forceinline__ void dual_scores(float (&s)[N / 8][4], float (&dp)[N / 8][4], const bf16* a1,
                                            const bf16* a2, const bf16* b1, const bf16* b2, int lane) {
    constexpr int SS = HD + 8;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
    }
    #pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        u32 f1[4], f2[4];
        ldsm_x4(f1, a1 + kk * 16 + lo_a<SS>(lane));
        ldsm_x4(f2, a2 + kk * 16 + lo_a<SS>(lane));
        #pragma unroll
        for (int np = 0; np < N / 16; np++) {
            u32 b[4];
            ldsm_x4(b, b1 + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
            mma16816(s[2 * np], f1, b[0], b[1]);
            mma16816(s[2 * np + 1], f1, b[2], b[3]);
            ldsm_x4(b, b2 + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
            mma16816(dp[2 * np], f2, b[0], b[1]);
            mma16816(dp[2 * np + 1], f2, b[2], b[3]);
        }
    }
}

// A (tile, head) grid (gridDim.x tiles of gridDim.y heads) read in rank-major order: the block
// launched n-th takes head n % heads and the (n / heads)-th tile, so that every head's first
// tiles run before any head's later ones. Each block's work is unchanged; only which block
// does it.
__device__ __forceinline__ int rank_major_head() {
    return (int)(((i64)blockIdx.y * gridDim.x + blockIdx.x) % gridDim.y);
}
__device__ __forceinline__ int rank_major_rank() {
    return (int)(((i64)blockIdx.y * gridDim.x + blockIdx.x) / gridDim.y);
}

// ------------------------------------------------------------------------------------------------
// Forward v2. grid (ceil(T/128), n_heads), 256 threads; warp w owns query rows 16w.. of the tile.
// The warp's Q fragments stay in registers (about 206 registers at head_dim 128: one block of 8
// warps per SM). Re-reading them from shared memory every key tile to fit two blocks per SM
// (128 registers, small spills) measured 30% slower at T=16K. At head_dim 256 the output
// accumulators alone take 128 registers, so the Q fragments are read from shared memory per k16
// step (QREG false); its shared memory is then Q (128 rows) and two K and two V buffers of 64 rows,
// 198 KB of padded rows.
template <int HD, bool CAP>
__device__ void attn2_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv,
                          float scale, float cap) {
    constexpr bool QREG = HD <= 128;
    constexpr int BQ_ = 128, BK_ = 64, NT = 256, SS = HD + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* ks = qs + BQ_ * SS;
    bf16* vs = ks + 2 * BK_ * SS;
    unsigned char* fl = (unsigned char*)(vs + 2 * BK_ * SS);

    const int h = rank_major_head(), kvh = h / (nh / nkv);
    const int q0 = (gridDim.x - 1 - rank_major_rank()) * BQ_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E;
    const int ntiles = (t + BK_ - 1) / BK_;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD;

    int cur = fwd_prologue<HD, NT>(qs, ks, vs, fl, q + (i64)h * HD, kg, vg, qstride, kstride, mk, q0, t, ntiles);

    const int ra = q0 + 16 * w + g, rb = ra + 8;
    const bool oka = ra < t, okb = rb < t;

    cp_async_wait<1>();
    __syncthreads();
    u32 qf[QREG ? HD / 16 : 1][4];
    if constexpr (QREG) {
        #pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) ldsm_x4(qf[kk], qs + (16 * w) * SS + kk * 16 + lo_a<SS>(lane));
    }

    float acc[HD / 8][4];
    #pragma unroll
    for (int i = 0; i < HD / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_a = -LF_INF, m_b = -LF_INF, l_a = 0.f, l_b = 0.f;

    int buf = 0;
    while (cur < ntiles) {
        const int nxt = next_visible(fl, cur + 1, ntiles);
        if (nxt < ntiles) cp_kv_tile<HD, NT>(ks + (buf ^ 1) * BK_ * SS, vs + (buf ^ 1) * BK_ * SS, kg, vg, kstride, nxt, t);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* kb = ks + buf * BK_ * SS;
        const bf16* vb = vs + buf * BK_ * SS;
        const int k0 = cur * BK_;
        const bool tile_all = fl[cur] == 2;

        float s[BK_ / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BK_ / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 qs_f[4];
            const u32* af = qs_f;
            if constexpr (QREG) af = qf[kk];
            else ldsm_x4(qs_f, qs + (16 * w) * SS + kk * 16 + lo_a<SS>(lane));
            #pragma unroll
            for (int np = 0; np < BK_ / 16; np++) {
                u32 b[4];
                ldsm_x4(b, kb + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
                mma16816(s[2 * np], af, b[0], b[1]);
                mma16816(s[2 * np + 1], af, b[2], b[3]);
            }
        }
        if constexpr (CAP) cap_scores(s, scale / cap, cap);
        if (!tile_all) mask_scores(s, mk, ra, rb, k0, t, tq);
        online_softmax<HD>(s, m_a, m_b, l_a, l_b, acc, sl2);
        #pragma unroll
        for (int j = 0; j < BK_ / 16; j++) {
            u32 pf[4];
            pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
            pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
            pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
            pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
            #pragma unroll
            for (int dp = 0; dp < HD / 16; dp++) {
                u32 b[4];
                ldsm_x4_t(b, vb + j * 16 * SS + dp * 16 + lo_bt<SS>(lane));
                mma16816(acc[2 * dp], pf, b[0], b[1]);
                mma16816(acc[2 * dp + 1], pf, b[2], b[3]);
            }
        }
        __syncthreads();
        cur = nxt;
        buf ^= 1;
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    #pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) {
        const int d = nd * 8 + 2 * tq;
        if (oka) *(u32*)(o + (i64)ra * qstride + (i64)h * HD + d) = pack_bf16(acc[nd][0] * inv_a, acc[nd][1] * inv_a);
        if (okb) *(u32*)(o + (i64)rb * qstride + (i64)h * HD + d) = pack_bf16(acc[nd][2] * inv_b, acc[nd][3] * inv_b);
    }
    if (tq == 0) {
        if (oka) lse[(i64)h * t + ra] = l_a > 0.f ? (m_a + log2f(l_a)) * LN2 : -LF_INF;
        if (okb) lse[(i64)h * t + rb] = l_b > 0.f ? (m_b + log2f(l_b)) * LN2 : -LF_INF;
    }
}

// ------------------------------------------------------------------------------------------------
// dQ v2. grid (ceil(T/64), n_heads), 128 threads; warp w owns query rows 16w.. of the tile. At
// head_dim 256 (dQ accumulators: 128 registers) each 64-key tile is taken as two 32-key halves, so
// that S and dP of a step need 32 registers, not 64.
template <int HD, bool CAP>
__device__ void attn2_dq(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         const bf16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dd,
                         bf16* __restrict__ dq, Mask mk, int t, int nh, int nkv, float scale, float cap) {
    constexpr int BQ_ = 64, BK_ = 64, NT = 128, SS = HD + 8, KH = HD <= 128 ? 64 : 32;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* dos = qs + BQ_ * SS;
    bf16* ks = dos + BQ_ * SS;
    bf16* vs = ks + 2 * BK_ * SS;
    unsigned char* fl = (unsigned char*)(vs + 2 * BK_ * SS);

    const int h = rank_major_head(), kvh = h / (nh / nkv);
    const int q0 = (gridDim.x - 1 - rank_major_rank()) * BQ_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = scale * LOG2E;
    const int ntiles = (t + BK_ - 1) / BK_;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD;

    cp_tile<HD, BQ_, NT>(qs, q + (i64)h * HD, qstride, q0, t);
    cp_tile<HD, BQ_, NT>(dos, d_o + (i64)h * HD, qstride, q0, t);
    for (int kt = threadIdx.x; kt < ntiles; kt += NT) fl[kt] = tile_flag(mk, t, q0 / 64, BQ_ / 64, kt, 1);
    __syncthreads();
    int cur = next_visible(fl, 0, ntiles);
    if (cur < ntiles) cp_kv_tile<HD, NT>(ks, vs, kg, vg, kstride, cur, t);
    cp_async_commit();

    const int ra = q0 + 16 * w + g, rb = ra + 8;
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const bool oka = ra < t, okb = rb < t;
    const uint4 rga = oka ? mk.ranges[ra] : empty, rgb = okb ? mk.ranges[rb] : empty;
    const int pa = oka ? mk.pos[ra] : 0, pb = okb ? mk.pos[rb] : 0;
    const float la = oka ? lse[(i64)h * t + ra] * LOG2E : 0.f, lb = okb ? lse[(i64)h * t + rb] * LOG2E : 0.f;
    const float da = oka ? dd[(i64)h * t + ra] : 0.f, db = okb ? dd[(i64)h * t + rb] : 0.f;

    float acc[HD / 8][4];
    #pragma unroll
    for (int i = 0; i < HD / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    int buf = 0;
    while (cur < ntiles) {
        const int nxt = next_visible(fl, cur + 1, ntiles);
        if (nxt < ntiles) cp_kv_tile<HD, NT>(ks + (buf ^ 1) * BK_ * SS, vs + (buf ^ 1) * BK_ * SS, kg, vg, kstride, nxt, t);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* kb = ks + buf * BK_ * SS;
        const bf16* vb = vs + buf * BK_ * SS;
        const int k0 = cur * BK_;
        const bool tile_all = fl[cur] == 2;

        #pragma unroll
        for (int kh = 0; kh < BK_; kh += KH) {
            float s[KH / 8][4], dp[KH / 8][4];
            dual_scores<HD, KH>(s, dp, qs + (16 * w) * SS, dos + (16 * w) * SS, kb + kh * SS, vb + kh * SS, lane);
            #pragma unroll
            for (int nt = 0; nt < KH / 8; nt++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const bool top = e < 2;
                    float p, dcap = 1.f;
                    if constexpr (CAP) {
                        const float th = cap_tanh(s[nt][e] * (scale / cap));
                        p = fast_exp2(cap * th * LOG2E - (top ? la : lb));
                        dcap = 1.f - th * th;
                    } else {
                        p = fast_exp2(s[nt][e] * sl2 - (top ? la : lb));
                    }
                    if (!tile_all) {
                        const int kx = k0 + kh + nt * 8 + 2 * tq + (e & 1);
                        const bool vis = top ? vis2(mk, rga, pa, oka, kx, t) : vis2(mk, rgb, pb, okb, kx, t);
                        if (!vis) p = 0.f;
                    }
                    s[nt][e] = p * (dp[nt][e] - (top ? da : db)) * dcap;
                }
            }
            #pragma unroll
            for (int j = 0; j < KH / 16; j++) {
                u32 pf[4];
                pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
                pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
                pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
                pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
                #pragma unroll
                for (int dpi = 0; dpi < HD / 16; dpi++) {
                    u32 b[4];
                    ldsm_x4_t(b, kb + (kh + j * 16) * SS + dpi * 16 + lo_bt<SS>(lane));
                    mma16816(acc[2 * dpi], pf, b[0], b[1]);
                    mma16816(acc[2 * dpi + 1], pf, b[2], b[3]);
                }
            }
        }
        __syncthreads();
        cur = nxt;
        buf ^= 1;
    }
    #pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) {
        const int d = nd * 8 + 2 * tq;
        if (oka) *(u32*)(dq + (i64)ra * qstride + (i64)h * HD + d) = pack_bf16(acc[nd][0] * scale, acc[nd][1] * scale);
        if (okb) *(u32*)(dq + (i64)rb * qstride + (i64)h * HD + d) = pack_bf16(acc[nd][2] * scale, acc[nd][3] * scale);
    }
}

// ------------------------------------------------------------------------------------------------
// Per-warp pieces of the key-major backward (versions 2 and 4): a warp owns 16 keys of the key tile
// (rows ka = k0 + 16w + g and kb = ka + 8 of its fragments) and meets one BQ-query tile at a time.

// The lse and D of query rows [q0, q0 + BQ_) (cp.async, not committed; rows >= t read as 0).
template <int BQ_, int NT>
__device__ __forceinline__ void cp_query_stats(float* ls, float* dsum, const float* lg, const float* dg, int q0,
                                               int t) {
    static_assert(NT >= 2 * BQ_, "one thread per lse and D element");
    if (threadIdx.x < BQ_) {
        const int qi = q0 + threadIdx.x;
        cp_async4(ls + threadIdx.x, lg + (qi < t ? qi : 0), qi < t);
    } else if (threadIdx.x < 2 * BQ_) {
        const int qi = q0 + threadIdx.x - BQ_;
        cp_async4(dsum + threadIdx.x - BQ_, dg + (qi < t ? qi : 0), qi < t);
    }
}

// Query tile [q0, q0 + BQ_) of one head for the key-major backward: Q and dO rows (cp.async into
// padded tiles) and the rows' lse and D.
template <int HD, int BQ_, int NT>
__device__ __forceinline__ void load_query_tile(bf16* qs, bf16* dos, float* ls, float* dsum, const bf16* qg,
                                                const bf16* og, const float* lg, const float* dg, i64 qstride,
                                                int q0, int t) {
    cp_tile<HD, BQ_, NT>(qs, qg, qstride, q0, t);
    cp_tile<HD, BQ_, NT>(dos, og, qstride, q0, t);
    cp_query_stats<BQ_, NT>(ls, dsum, lg, dg, q0, t);
}

// S^T = K_w Q^T and dP^T = V_w dO^T (kw, vw: the warp's 16 rows of the K and V tiles), then in
// place P^T = exp(S^T * scale - lse) (masked) and dS^T = P^T * (dP^T - D). Element e of n-tile nt:
// key row (e < 2 ? ka : kb), query column nt * 8 + 2tq + (e & 1) of the tile. With CAP the
// scores are cap * tanh(S^T * sc) (sl2 then LOG2E) and dS^T carries the factor 1 - tanh^2.
template <int HD, int BQ_, bool CAP>
__device__ __forceinline__ void key_tile_probs(float (&s)[BQ_ / 8][4], float (&dp)[BQ_ / 8][4], const bf16* kw,
                                               const bf16* vw, const bf16* qb, const bf16* ob, const float* lb,
                                               const float* db, const Mask& mk, int q0, int ka, int kb, int kpa,
                                               int kpb, bool tile_all, int t, float sl2, float sc, float cap,
                                               int lane) {
    const int tq = lane & 3;
    dual_scores<HD, BQ_>(s, dp, kw, vw, qb, ob, lane);
    #pragma unroll
    for (int nt = 0; nt < BQ_ / 8; nt++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int ql = nt * 8 + 2 * tq + (e & 1);
            float p, dcap = 1.f;
            if constexpr (CAP) {
                const float th = cap_tanh(s[nt][e] * sc);
                p = fast_exp2((cap * th - lb[ql]) * LOG2E);
                dcap = 1.f - th * th;
            } else {
                p = fast_exp2(s[nt][e] * sl2 - lb[ql] * LOG2E);
            }
            if (!tile_all) {
                const int qi = q0 + ql, kx = e < 2 ? ka : kb;
                bool vis = false;
                if (qi < t && kx < t) vis = visible(mk.ranges[qi], mk.pos[qi], kx, e < 2 ? kpa : kpb, mk.window);
                if (!vis) p = 0.f;
            }
            s[nt][e] = p;
            dp[nt][e] = p * (dp[nt][e] - db[ql]) * dcap;
        }
    }
}

// dV_w += P^T dO and dK_w += dS^T Q, with P^T (s) and dS^T (dp) as bf16 A operands straight from
// registers. With `ds_out`, dS^T (as rounded for the product) is also stored to the warp's 16 rows
// of a [key][query] shared tile of row stride `ds_stride`, for version 4's dQ product.
// DW: the width of the accumulated head-dim slice (all HD, or a part from column dh of qb / ob,
// which the caller's pointers already include).
template <int HD, int BQ_, int DW = HD>
__device__ __forceinline__ void key_tile_accumulate(float (&adv)[DW / 8][4], float (&adk)[DW / 8][4],
                                                    const float (&s)[BQ_ / 8][4], const float (&dp)[BQ_ / 8][4],
                                                    const bf16* qb, const bf16* ob, bf16* ds_out, int ds_stride,
                                                    int lane) {
    constexpr int SS = HD + 8;
    const int g = lane >> 2, tq = lane & 3;
    #pragma unroll
    for (int j = 0; j < BQ_ / 16; j++) {
        u32 pf[4], sf[4];
        pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
        pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
        pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
        pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
        sf[0] = pack_bf16(dp[2 * j][0], dp[2 * j][1]);
        sf[1] = pack_bf16(dp[2 * j][2], dp[2 * j][3]);
        sf[2] = pack_bf16(dp[2 * j + 1][0], dp[2 * j + 1][1]);
        sf[3] = pack_bf16(dp[2 * j + 1][2], dp[2 * j + 1][3]);
        if (ds_out) {
            // sf[0]: (row g, cols 16j + 2tq..), sf[1]: row g + 8, sf[2]/sf[3]: cols + 8.
            bf16* r = ds_out + g * ds_stride + 16 * j + 2 * tq;
            *(u32*)r = sf[0];
            *(u32*)(r + 8 * ds_stride) = sf[1];
            *(u32*)(r + 8) = sf[2];
            *(u32*)(r + 8 * ds_stride + 8) = sf[3];
        }
        #pragma unroll
        for (int dpi = 0; dpi < DW / 16; dpi++) {
            u32 b[4];
            ldsm_x4_t(b, ob + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
            mma16816(adv[2 * dpi], pf, b[0], b[1]);
            mma16816(adv[2 * dpi + 1], pf, b[2], b[3]);
            ldsm_x4_t(b, qb + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
            mma16816(adk[2 * dpi], sf, b[0], b[1]);
            mma16816(adk[2 * dpi + 1], sf, b[2], b[3]);
        }
    }
}

// The warp's dK (times scale) and dV rows: f32 partials per query head with GQA (summed by
// lf_attn_dkdv_reduce), bf16 directly without. DW columns from head dim dh.
template <int HD, int DW = HD>
__device__ __forceinline__ void key_tile_store(const float (&adk)[DW / 8][4], const float (&adv)[DW / 8][4],
                                               bf16* __restrict__ dk, bf16* __restrict__ dv,
                                               float* __restrict__ dk_part, float* __restrict__ dv_part, int h,
                                               int kvh, int group, int ka, int kb, int t, int nkv, float scale,
                                               int tq, int dh = 0) {
    const i64 kstride = (i64)nkv * HD;
    #pragma unroll
    for (int nd = 0; nd < DW / 8; nd++) {
        const int d = dh + nd * 8 + 2 * tq;
        if (group > 1) {
            if (ka < t) {
                *(float2*)(dk_part + ((i64)h * t + ka) * HD + d) = make_float2(adk[nd][0] * scale, adk[nd][1] * scale);
                *(float2*)(dv_part + ((i64)h * t + ka) * HD + d) = make_float2(adv[nd][0], adv[nd][1]);
            }
            if (kb < t) {
                *(float2*)(dk_part + ((i64)h * t + kb) * HD + d) = make_float2(adk[nd][2] * scale, adk[nd][3] * scale);
                *(float2*)(dv_part + ((i64)h * t + kb) * HD + d) = make_float2(adv[nd][2], adv[nd][3]);
            }
        } else {
            const i64 col = (i64)kvh * HD + d;
            if (ka < t) {
                *(u32*)(dk + (i64)ka * kstride + col) = pack_bf16(adk[nd][0] * scale, adk[nd][1] * scale);
                *(u32*)(dv + (i64)ka * kstride + col) = pack_bf16(adv[nd][0], adv[nd][1]);
            }
            if (kb < t) {
                *(u32*)(dk + (i64)kb * kstride + col) = pack_bf16(adk[nd][2] * scale, adk[nd][3] * scale);
                *(u32*)(dv + (i64)kb * kstride + col) = pack_bf16(adv[nd][2], adv[nd][3]);
            }
        }
    }
}

// Version 4's dQ step for one warp: rows qr.. x head dims dh.. (HD/2 wide) of the tile's
// dQ = dS K, A = dS (rows: queries) read transposed from dS^T, B = the K tile (k-major), added to
// dq_acc rows q0 + qr.. with vector atomics.
template <int HD, int BK_, int DS>
__device__ __forceinline__ void tile_dq_add(float* __restrict__ dq_acc, const bf16* dst, const bf16* ks, int q0,
                                            int qr, int dh, int h, i64 qstride, int t, int lane) {
    constexpr int SS = HD + 8;
    const int g = lane >> 2, tq = lane & 3;
    float aq[HD / 16][4];
    #pragma unroll
    for (int i = 0; i < HD / 16; i++) aq[i][0] = aq[i][1] = aq[i][2] = aq[i][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < BK_ / 16; kk++) {
        u32 af[4];
        ldsm_x4_t(af, dst + (16 * kk) * DS + qr + lo_at<DS>(lane));
        #pragma unroll
        for (int np = 0; np < HD / 32; np++) {
            u32 b[4];
            ldsm_x4_t(b, ks + (16 * kk) * SS + dh + 16 * np + lo_bt<SS>(lane));
            mma16816(aq[2 * np], af, b[0], b[1]);
            mma16816(aq[2 * np + 1], af, b[2], b[3]);
        }
    }
    const int ra = q0 + qr + g, rb = ra + 8;
    #pragma unroll
    for (int nd = 0; nd < HD / 16; nd++) {
        const i64 col = (i64)h * HD + dh + nd * 8 + 2 * tq;
        if (ra < t) red_add2(dq_acc + (i64)ra * qstride + col, aq[nd][0], aq[nd][1]);
        if (rb < t) red_add2(dq_acc + (i64)rb * qstride + col, aq[nd][2], aq[nd][3]);
    }
}

// ------------------------------------------------------------------------------------------------
// Key-major backward: the block owns BK_ keys (warp w: keys 16w.., the M dimension of S^T and
// dP^T) and loops over the visible 64-query tiles of its query head (rank_major_head); grid
// (ceil(T/BK_), n_heads), 2 * BK_ threads. P^T and dS^T stay in registers as the A operands of
// dV += P^T dO and dK += dS^T Q; dK/dV go out as key_tile_store writes them.
//   dK/dV v2 (BK_ 64, no WITH_DQ): dQ comes from its own kernel (attn2_dq), no atomics.
//   Backward v4 (BK_ 128, WITH_DQ), one pass: dS^T also goes to shared memory, from which the
//   tile's dQ = dS K is computed (warp w: query rows 16(w % 4).., head dims (w / 4) * HD/2..) and
//   added to an f32 accumulator [T, n_heads * HD] with vector atomics (lf_attn_dq_finish scales
//   and rounds it). S and dP are computed once per tile pair: 5 products, not version 2's 7.
//   dK/dV at head_dim 256 (BK_ 64, DSPLIT 2, grid z 2): block z accumulates head dims 128z..
//   only (128 accumulator registers, not 256), recomputing S and dP over all 256.
template <int HD, int BK_, bool WITH_DQ, bool CAP, int DSPLIT = 1>
__device__ void attn_keys_bwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                              const bf16* __restrict__ d_o, const float* __restrict__ lse,
                              const float* __restrict__ dd, float* __restrict__ dq_acc, bf16* __restrict__ dk,
                              bf16* __restrict__ dv, float* __restrict__ dk_part, float* __restrict__ dv_part,
                              Mask mk, int t, int nh, int nkv, float scale, float cap) {
    constexpr int BQ_ = 64, NT = 2 * BK_, NW = NT / 32, SS = HD + 8, DS = BQ_ + 8, DW = HD / DSPLIT;
    static_assert(!WITH_DQ || NW == 8, "the dQ product splits the tile over 8 warps");
    static_assert(!WITH_DQ || DSPLIT == 1, "the one-pass kernel accumulates all head dims");
    const int dh = DSPLIT > 1 ? (int)blockIdx.z * DW : 0;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + BK_ * SS;
    bf16* qs = vs + BK_ * SS;
    bf16* dos = qs + 2 * BQ_ * SS;
    bf16* dst = dos + 2 * BQ_ * SS;  // with WITH_DQ: dS^T of the current tile pair, [key][query]
    float* ls = (float*)(dst + (WITH_DQ ? BK_ * DS : 0));
    float* dsum = ls + 2 * BQ_;
    unsigned char* fl = (unsigned char*)(dsum + 2 * BQ_);

    const int h = rank_major_head(), group = nh / nkv, kvh = h / group;
    const int ktile = rank_major_rank(), k0 = ktile * BK_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E;
    const int nqt = (t + BQ_ - 1) / BQ_;
    const bf16* qg = q + (i64)h * HD;
    const bf16* og = d_o + (i64)h * HD;
    const float* lg = lse + (i64)h * t;
    const float* dg = dd + (i64)h * t;

    cp_tile<HD, BK_, NT>(ks, k + (i64)kvh * HD, kstride, k0, t);
    cp_tile<HD, BK_, NT>(vs, v + (i64)kvh * HD, kstride, k0, t);
    cp_async_commit();
    // Visibility per query tile from the block's 64-key tiles; a tail tile past T makes the block
    // partial (so keys >= T always take the per-element test).
    for (int it = threadIdx.x; it < nqt; it += NT) fl[it] = tile_flag(mk, t, it, 1, ktile * (BK_ / 64), BK_ / 64);
    __syncthreads();
    auto load_q = [&](int it, int b) {
        load_query_tile<HD, BQ_, NT>(qs + b * BQ_ * SS, dos + b * BQ_ * SS, ls + b * BQ_, dsum + b * BQ_, qg, og, lg,
                                     dg, qstride, it * BQ_, t);
    };
    int cur = next_visible(fl, 0, nqt);
    if (cur < nqt) load_q(cur, 0);
    cp_async_commit();

    const int ka = k0 + 16 * w + g, kb = ka + 8;
    const int kpa = ka < t ? mk.pos[ka] : 0, kpb = kb < t ? mk.pos[kb] : 0;
    float adk[DW / 8][4], adv[DW / 8][4];
    zero_key_acc(adk, adv);

    int buf = 0;
    while (cur < nqt) {
        const int nxt = next_visible(fl, cur + 1, nqt);
        if (nxt < nqt) load_q(nxt, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* qb = qs + buf * BQ_ * SS;
        const bf16* ob = dos + buf * BQ_ * SS;
        const int q0 = cur * BQ_;
        {
            float s[BQ_ / 8][4], dp[BQ_ / 8][4];
            key_tile_probs<HD, BQ_, CAP>(s, dp, ks + (16 * w) * SS, vs + (16 * w) * SS, qb, ob, ls + buf * BQ_,
                                         dsum + buf * BQ_, mk, q0, ka, kb, kpa, kpb, fl[cur] == 2, t, sl2,
                                         scale / cap, cap, lane);
            key_tile_accumulate<HD, BQ_, DW>(adv, adk, s, dp, qb + dh, ob + dh,
                                             WITH_DQ ? dst + (16 * w) * DS : nullptr, DS, lane);
        }
        if constexpr (WITH_DQ) {
            __syncthreads();
            tile_dq_add<HD, BK_, DS>(dq_acc, dst, ks, q0, 16 * (w & 3), (w >> 2) * (HD / 2), h, qstride, t, lane);
        }
        __syncthreads();
        cur = nxt;
        buf ^= 1;
    }
    key_tile_store<HD, DW>(adk, adv, dk, dv, dk_part, dv_part, h, kvh, group, ka, kb, t, nkv, scale, tq, dh);
}

#define INSTANTIATE2(HD, CAP, SFX, DSPLIT)                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn2_fwd_##HD##SFX(                               \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        float scale, float cap) {                                                                              \
        attn2_fwd<HD, CAP>(q, k, v, o, lse, mk, t, nh, nkv, scale, cap);                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) lf_attn2_dq_##HD##SFX(                                   \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dq, Mask mk, int t, int nh, int nkv, float scale, float cap) {                                   \
        attn2_dq<HD, CAP>(q, k, v, d_o, lse, dd, dq, mk, t, nh, nkv, scale, cap);                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) lf_attn2_dkdv_##HD##SFX(                                 \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv, float scale,      \
        float cap) {                                                                                           \
        attn_keys_bwd<HD, 64, false, CAP, DSPLIT>(q, k, v, d_o, lse, dd, nullptr, dk, dv, dk_part, dv_part, mk, \
                                                  t, nh, nkv, scale, cap);                                     \
    }

// 64-query tiles in dK/dV (255 registers at head_dim 128, a few bytes spilled); 32-query tiles (242
// registers, no spill) measured the same end to end and 4-8% slower in the selftest's backward timings.
// Head_dim 256: the forward, and dQ and dK/dV (two head-dim halves per key tile, grid z = 2).
#if LF_PART(2)
INSTANTIATE2(64, false, , 1)
INSTANTIATE2(128, false, , 1)
INSTANTIATE2(256, false, , 2)
INSTANTIATE2(64, true, _cap, 1)
INSTANTIATE2(128, true, _cap, 1)
INSTANTIATE2(256, true, _cap, 2)
#endif

// ------------------------------------------------------------------------------------------------
// Forward v3. grid (ceil(T/128), n_heads), 128 threads; warp w owns query rows 32w..32w+31 as two
// 16-row m-tiles. Each K / V fragment read from shared memory feeds both m-tiles, which halves the
// shared-memory traffic per tensor-core op of version 2 (16 rows per warp); Q fragments are
// re-read from shared memory each key tile so that two blocks fit one SM.
template <int HD, bool CAP>
__device__ void attn3_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv,
                          float scale, float cap) {
    constexpr int BQ_ = 128, BK_ = 64, NT = 128, SS = HD + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* ks = qs + BQ_ * SS;
    bf16* vs = ks + 2 * BK_ * SS;
    unsigned char* fl = (unsigned char*)(vs + 2 * BK_ * SS);

    const int h = rank_major_head(), kvh = h / (nh / nkv);
    const int q0 = (gridDim.x - 1 - rank_major_rank()) * BQ_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E;
    const int ntiles = (t + BK_ - 1) / BK_;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD;

    int cur = fwd_prologue<HD, NT>(qs, ks, vs, fl, q + (i64)h * HD, kg, vg, qstride, kstride, mk, q0, t, ntiles);

    // Rows of m-tile i: r[i][0] = q0 + 32w + 16i + g, r[i][1] = r[i][0] + 8.
    int r[2][2];
    bool ok[2][2];
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        r[i][0] = q0 + 32 * w + 16 * i + g;
        r[i][1] = r[i][0] + 8;
        ok[i][0] = r[i][0] < t;
        ok[i][1] = r[i][1] < t;
    }
    const bf16* qw = qs + (32 * w) * SS + lo_a<SS>(lane);

    float acc[2][HD / 8][4];
    #pragma unroll
    for (int i = 0; i < 2; i++)
        #pragma unroll
        for (int n = 0; n < HD / 8; n++) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;
    float m[2][2], l[2][2];
    #pragma unroll
    for (int i = 0; i < 2; i++) m[i][0] = m[i][1] = -LF_INF, l[i][0] = l[i][1] = 0.f;

    int buf = 0;
    while (cur < ntiles) {
        const int nxt = next_visible(fl, cur + 1, ntiles);
        if (nxt < ntiles) cp_kv_tile<HD, NT>(ks + (buf ^ 1) * BK_ * SS, vs + (buf ^ 1) * BK_ * SS, kg, vg, kstride, nxt, t);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* kb = ks + buf * BK_ * SS;
        const bf16* vb = vs + buf * BK_ * SS;
        const int k0 = cur * BK_;
        const bool tile_all = fl[cur] == 2;

        float s[2][BK_ / 8][4];
        #pragma unroll
        for (int i = 0; i < 2; i++)
            #pragma unroll
            for (int nt = 0; nt < BK_ / 8; nt++) s[i][nt][0] = s[i][nt][1] = s[i][nt][2] = s[i][nt][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 a0[4], a1[4];
            ldsm_x4(a0, qw + kk * 16);
            ldsm_x4(a1, qw + 16 * SS + kk * 16);
            #pragma unroll
            for (int np = 0; np < BK_ / 16; np++) {
                u32 b[4];
                ldsm_x4(b, kb + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
                mma16816(s[0][2 * np], a0, b[0], b[1]);
                mma16816(s[0][2 * np + 1], a0, b[2], b[3]);
                mma16816(s[1][2 * np], a1, b[0], b[1]);
                mma16816(s[1][2 * np + 1], a1, b[2], b[3]);
            }
        }
        if constexpr (CAP) {
            #pragma unroll
            for (int i = 0; i < 2; i++) cap_scores(s[i], scale / cap, cap);
        }
        if (!tile_all) {
            #pragma unroll
            for (int i = 0; i < 2; i++) mask_scores(s[i], mk, r[i][0], r[i][1], k0, t, tq);
        }
        #pragma unroll
        for (int i = 0; i < 2; i++) online_softmax<HD>(s[i], m[i][0], m[i][1], l[i][0], l[i][1], acc[i], sl2);
        #pragma unroll
        for (int j = 0; j < BK_ / 16; j++) {
            u32 p0[4], p1[4];
            p0[0] = pack_bf16(s[0][2 * j][0], s[0][2 * j][1]);
            p0[1] = pack_bf16(s[0][2 * j][2], s[0][2 * j][3]);
            p0[2] = pack_bf16(s[0][2 * j + 1][0], s[0][2 * j + 1][1]);
            p0[3] = pack_bf16(s[0][2 * j + 1][2], s[0][2 * j + 1][3]);
            p1[0] = pack_bf16(s[1][2 * j][0], s[1][2 * j][1]);
            p1[1] = pack_bf16(s[1][2 * j][2], s[1][2 * j][3]);
            p1[2] = pack_bf16(s[1][2 * j + 1][0], s[1][2 * j + 1][1]);
            p1[3] = pack_bf16(s[1][2 * j + 1][2], s[1][2 * j + 1][3]);
            #pragma unroll
            for (int dp = 0; dp < HD / 16; dp++) {
                u32 b[4];
                ldsm_x4_t(b, vb + j * 16 * SS + dp * 16 + lo_bt<SS>(lane));
                mma16816(acc[0][2 * dp], p0, b[0], b[1]);
                mma16816(acc[0][2 * dp + 1], p0, b[2], b[3]);
                mma16816(acc[1][2 * dp], p1, b[0], b[1]);
                mma16816(acc[1][2 * dp + 1], p1, b[2], b[3]);
            }
        }
        __syncthreads();
        cur = nxt;
        buf ^= 1;
    }

    #pragma unroll
    for (int i = 0; i < 2; i++) {
        #pragma unroll
        for (int hb = 0; hb < 2; hb++) {
            float li = l[i][hb];
            li += __shfl_xor_sync(0xffffffffu, li, 1);
            li += __shfl_xor_sync(0xffffffffu, li, 2);
            const float inv = li > 0.f ? 1.f / li : 0.f;
            const int row = r[i][hb];
            if (ok[i][hb]) {
                #pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    const int d = nd * 8 + 2 * tq;
                    *(u32*)(o + (i64)row * qstride + (i64)h * HD + d) =
                        pack_bf16(acc[i][nd][2 * hb] * inv, acc[i][nd][2 * hb + 1] * inv);
                }
                if (tq == 0) lse[(i64)h * t + row] = li > 0.f ? (m[i][hb] + log2f(li)) * LN2 : -LF_INF;
            }
        }
    }
}

#define INSTANTIATE3(HD, CAP, SFX)                                                                             \
    extern "C" __global__ void __launch_bounds__(128, 2) lf_attn3_fwd_##HD##SFX(                               \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        float scale, float cap) {                                                                              \
        attn3_fwd<HD, CAP>(q, k, v, o, lse, mk, t, nh, nkv, scale, cap);                                       \
    }
#if LF_PART(2)
INSTANTIATE3(64, false, )
INSTANTIATE3(128, false, )
INSTANTIATE3(64, true, _cap)
INSTANTIATE3(128, true, _cap)
#endif

// dq = scale * dq_acc, rounded to bf16.
#if LF_PART(1)
extern "C" __global__ void lf_attn_dq_finish(const float* acc, bf16* dq, i64 n, float scale) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dq[i] = __float2bfloat16(acc[i] * scale);
}
#endif

#define INSTANTIATE4(HD, CAP, SFX)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn4_bwd_##HD##SFX(                               \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        float* dq_acc, bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv,    \
        float scale, float cap) {                                                                              \
        attn_keys_bwd<HD, 128, true, CAP>(q, k, v, d_o, lse, dd, dq_acc, dk, dv, dk_part, dv_part, mk, t, nh,  \
                                          nkv, scale, cap);                                                    \
    }
#if LF_PART(2)
INSTANTIATE4(64, false, )
INSTANTIATE4(128, false, )
INSTANTIATE4(64, true, _cap)
INSTANTIATE4(128, true, _cap)
#endif

// ------------------------------------------------------------------------------------------------
// Backward v6 (head_dim 256), one pass like version 4: the block owns 64 keys and loops over the
// visible 64-query tiles of its query head (rank_major_head); grid (ceil(T/64), n_heads), 256
// threads.
// At head_dim 256 a warp cannot hold dK and dV of 16 keys over all head dims (256 registers), so
// warp w owns keys 16(w % 4).. and head dims 128(w / 4).. of dK and dV (128 registers), and the
// two warps of a key-row group share the elementwise work of the tile pair:
//   warps 0-3: S^T = K_w Q^T over all 256 dims, P^T (masked, with the softcap) to shared memory
//              as bf16, twice: the A operand of dV (pt_s) and P^T * (1 - tanh^2) in dst;
//   warps 4-7: dP^T = V_w dO^T, then dS^T = dst * (dP^T - D) in place in dst (each warp reads and
//              writes the same 16 rows of dst);
//   all:       dV_w += P^T dO[:, half], dK_w += dS^T Q[:, half] (A operands from shared memory),
//              then dQ rows 16(w % 4).., head dims 128(w / 4).. of dS K added to the f32 accumulator
//              with vector atomics (lf_attn_dq_finish scales and rounds it).
// Five products per tile pair, none repeated. Shared memory: K, V (64 padded rows each), two
// buffers of Q and dO, pt_s and dst (64 x 72 bf16), lse and D: 217 KB. Same arguments and outputs as
// lf_attn4_bwd_128.
template <bool CAP>
__device__ void attn6_bwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          const bf16* __restrict__ d_o, const float* __restrict__ lse,
                          const float* __restrict__ dd, float* __restrict__ dq_acc, bf16* __restrict__ dk,
                          bf16* __restrict__ dv, float* __restrict__ dk_part, float* __restrict__ dv_part, Mask mk,
                          int t, int nh, int nkv, float scale, float cap) {
    constexpr int HD = 256, BK_ = 64, BQ_ = 64, NT = 256, SS = HD + 8, DS = BQ_ + 8, DW = HD / 2;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + BK_ * SS;
    bf16* qs = vs + BK_ * SS;
    bf16* dos = qs + 2 * BQ_ * SS;
    bf16* pt_s = dos + 2 * BQ_ * SS;  // P^T [key][query]
    bf16* dst = pt_s + BK_ * DS;      // P^T * (1 - tanh^2), then dS^T
    float* ls = (float*)(dst + BK_ * DS);
    float* dsum = ls + 2 * BQ_;
    unsigned char* fl = (unsigned char*)(dsum + 2 * BQ_);

    const int h = rank_major_head(), group = nh / nkv, kvh = h / group;
    const int ktile = rank_major_rank(), k0 = ktile * BK_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int wr = w & 3, role = __shfl_sync(0xffffffffu, w >> 2, 0), dh = role * DW;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E, sc = scale / cap;
    const int nqt = (t + BQ_ - 1) / BQ_;
    const bf16* qg = q + (i64)h * HD;
    const bf16* og = d_o + (i64)h * HD;
    const float* lg = lse + (i64)h * t;
    const float* dg = dd + (i64)h * t;

    cp_tile<HD, BK_, NT>(ks, k + (i64)kvh * HD, kstride, k0, t);
    cp_tile<HD, BK_, NT>(vs, v + (i64)kvh * HD, kstride, k0, t);
    cp_async_commit();
    for (int it = threadIdx.x; it < nqt; it += NT) fl[it] = tile_flag(mk, t, it, 1, ktile, 1);
    __syncthreads();
    auto load_q = [&](int it, int b) {
        load_query_tile<HD, BQ_, NT>(qs + b * BQ_ * SS, dos + b * BQ_ * SS, ls + b * BQ_, dsum + b * BQ_, qg, og, lg,
                                     dg, qstride, it * BQ_, t);
    };
    int cur = next_visible(fl, 0, nqt);
    if (cur < nqt) load_q(cur, 0);
    cp_async_commit();

    const int ka = k0 + 16 * wr + g, kb = ka + 8;
    const int kpa = ka < t ? mk.pos[ka] : 0, kpb = kb < t ? mk.pos[kb] : 0;
    float adk[DW / 8][4], adv[DW / 8][4];
    zero_key_acc(adk, adv);
    // This warp's rows of the A operand of its score product: K for S^T, V for dP^T.
    const bf16* aw = (role == 0 ? ks : vs) + (16 * wr) * SS;

    int buf = 0;
    while (cur < nqt) {
        const int nxt = next_visible(fl, cur + 1, nqt);
        // Past this barrier the current buffers have landed and every warp has finished the
        // previous tile pair, so the other buffers, pt_s and dst may be overwritten.
        cp_async_wait<0>();
        __syncthreads();
        if (nxt < nqt) load_q(nxt, buf ^ 1);
        cp_async_commit();
        const bf16* qb = qs + buf * BQ_ * SS;
        const bf16* ob = dos + buf * BQ_ * SS;
        const float* lb = ls + buf * BQ_;
        const float* db = dsum + buf * BQ_;
        const int q0 = cur * BQ_;
        {
            // S^T (role 0) or dP^T (role 1) for the warp's 16 keys x 64 queries.
            float x[BQ_ / 8][4];
            #pragma unroll
            for (int nt = 0; nt < BQ_ / 8; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.f;
            const bf16* bw = role == 0 ? qb : ob;
            #pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 af[4];
                ldsm_x4(af, aw + kk * 16 + lo_a<SS>(lane));
                #pragma unroll
                for (int np = 0; np < BQ_ / 16; np++) {
                    u32 b[4];
                    ldsm_x4(b, bw + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
                    mma16816(x[2 * np], af, b[0], b[1]);
                    mma16816(x[2 * np + 1], af, b[2], b[3]);
                }
            }
            // Element e of n-tile nt: key row (e < 2 ? ka : kb), query column nt * 8 + 2tq + (e & 1),
            // stored as bf16 pairs at row 16wr + g (+ 8), column nt * 8 + 2tq.
            bf16* pw = pt_s + (16 * wr + g) * DS + 2 * tq;
            bf16* dw = dst + (16 * wr + g) * DS + 2 * tq;
            if (role == 0) {
                const bool tile_all = fl[cur] == 2;
                #pragma unroll
                for (int nt = 0; nt < BQ_ / 8; nt++) {
                    float p[4], pm[4];
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int ql = nt * 8 + 2 * tq + (e & 1);
                        float dcap = 1.f;
                        if constexpr (CAP) {
                            const float th = cap_tanh(x[nt][e] * sc);
                            p[e] = fast_exp2((cap * th - lb[ql]) * LOG2E);
                            dcap = 1.f - th * th;
                        } else {
                            p[e] = fast_exp2(x[nt][e] * sl2 - lb[ql] * LOG2E);
                        }
                        if (!tile_all) {
                            const int qi = q0 + ql, kx = e < 2 ? ka : kb;
                            bool vis = false;
                            if (qi < t && kx < t)
                                vis = visible(mk.ranges[qi], mk.pos[qi], kx, e < 2 ? kpa : kpb, mk.window);
                            if (!vis) p[e] = 0.f;
                        }
                        pm[e] = p[e] * dcap;
                    }
                    *(u32*)(pw + nt * 8) = pack_bf16(p[0], p[1]);
                    *(u32*)(pw + 8 * DS + nt * 8) = pack_bf16(p[2], p[3]);
                    *(u32*)(dw + nt * 8) = pack_bf16(pm[0], pm[1]);
                    *(u32*)(dw + 8 * DS + nt * 8) = pack_bf16(pm[2], pm[3]);
                }
            }
            __syncthreads();
            if (role == 1) {
                #pragma unroll
                for (int nt = 0; nt < BQ_ / 8; nt++) {
                    const float d0 = db[nt * 8 + 2 * tq], d1 = db[nt * 8 + 2 * tq + 1];
                    const u32 top = *(const u32*)(dw + nt * 8), bot = *(const u32*)(dw + 8 * DS + nt * 8);
                    const float2 pt = __bfloat1622float2(*(const __nv_bfloat162*)&top);
                    const float2 pb = __bfloat1622float2(*(const __nv_bfloat162*)&bot);
                    *(u32*)(dw + nt * 8) = pack_bf16(pt.x * (x[nt][0] - d0), pt.y * (x[nt][1] - d1));
                    *(u32*)(dw + 8 * DS + nt * 8) = pack_bf16(pb.x * (x[nt][2] - d0), pb.y * (x[nt][3] - d1));
                }
            }
        }
        __syncthreads();
        // dV_w += P^T dO[:, dh..], dK_w += dS^T Q[:, dh..] (A operands: the warp's 16 key rows).
        #pragma unroll
        for (int j = 0; j < BQ_ / 16; j++) {
            u32 pf[4], sf[4];
            ldsm_x4(pf, pt_s + (16 * wr) * DS + j * 16 + lo_a<DS>(lane));
            ldsm_x4(sf, dst + (16 * wr) * DS + j * 16 + lo_a<DS>(lane));
            #pragma unroll
            for (int dpi = 0; dpi < DW / 16; dpi++) {
                u32 b[4];
                ldsm_x4_t(b, ob + dh + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
                mma16816(adv[2 * dpi], pf, b[0], b[1]);
                mma16816(adv[2 * dpi + 1], pf, b[2], b[3]);
                ldsm_x4_t(b, qb + dh + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
                mma16816(adk[2 * dpi], sf, b[0], b[1]);
                mma16816(adk[2 * dpi + 1], sf, b[2], b[3]);
            }
        }
        tile_dq_add<HD, BK_, DS>(dq_acc, dst, ks, q0, 16 * wr, dh, h, qstride, t, lane);
        cur = nxt;
        buf ^= 1;
    }
    key_tile_store<HD, DW>(adk, adv, dk, dv, dk_part, dv_part, h, kvh, group, ka, kb, t, nkv, scale, tq, dh);
}

#define INSTANTIATE6(CAP, SFX)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn6_bwd_256##SFX(                                \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        float* dq_acc, bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv,    \
        float scale, float cap) {                                                                              \
        attn6_bwd<CAP>(q, k, v, d_o, lse, dd, dq_acc, dk, dv, dk_part, dv_part, mk, t, nh, nkv, scale, cap);   \
    }
#if LF_PART(3)
INSTANTIATE6(false, )
INSTANTIATE6(true, _cap)
#endif

// ================================================================================================
// Backward v5 (head_dim 128, sm_90a only): version 4's one-pass algorithm on warpgroup MMAs
// (wgmma.mma_async), which issue from shared memory at about twice the rate of mma.sync.
// Block: 128 keys, two warpgroups (warpgroup wg owns keys 64wg.., warp w keys 16w..), one
// 64-query tile at a time, double-buffered by cp.async. Per tile pair:
//   S^T = K Q^T, dP^T = V dO^T           (A and B K-major in shared memory)
//   P^T, dS^T in registers                (version 4's elementwise step)
//   dV += P^T dO, dK += dS^T Q            (A from registers, B = dO / Q read N-major)
//   dS^T to shared memory; dQ = dS K      (A = dS^T read M-major, B = K read N-major; warpgroup wg
//                                          computes head dims 64wg..) added with vector atomics.
// Same arguments, outputs and contract as lf_attn4_bwd_128.
//
// Shared tiles use the 128-byte swizzle that wgmma descriptors describe: a tile of R rows x 128
// bf16 is two column halves of R rows x 128 bytes, and 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) of its row. Every half starts on a 1024-byte boundary (descriptor base offset 0).
// K-major descriptors step 32 bytes per k16 inside a half (leading offset unused) with 1024 bytes
// between 8-row groups; MN-major ones step 16 rows (2048 bytes) per k16, with the leading offset
// the distance between the two column halves.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ u64 wg_desc(const void* p, u32 lead, u32 stride) {
    const u32 a = smem_u32(p);
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)((lead & 0x3FFFF) >> 4) << 16) |
           ((u64)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// The descriptor of the operand `elems` bf16 further on: the start address is the low field, in
// 16-byte units, and shared addresses never carry out of it, so one add (against building each
// k-step's descriptor afresh: about a dozen instructions per wgmma).
__device__ __forceinline__ u64 wg_at(u64 desc, int elems) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (u32)(elems >> 3));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to wgmma's reads.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Shared-memory barriers (mbarrier) for a pipeline without block-wide barriers: a buffer's "full"
// barrier completes when every thread's cp.async copies into it have landed (each thread arrives
// through cp.async.mbarrier.arrive.noinc, so the count is the block's threads), its "empty"
// barrier when every thread has finished the products that read it. Waits name the phase parity.
__device__ __forceinline__ void mbar_init(u64* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_copies(u64* b) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(b)),
        "r"(parity)
        : "memory");
}
// Pins accumulator registers at this point of the program (no reads or writes moved across).
template <int N>
__device__ __forceinline__ void wg_pin(float* d) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma wrappers (generated operand lists). D = A B (ACC 0) or D += A B (ACC 1) over k16; A and B
// from shared memory (ss) or A from registers (rs). TA / TB: 1 when the shared operand is MN-major
// (transposed) rather than K-major.
template <int ACC, int TA, int TB>
__device__ __forceinline__ void wg_ss_n64(float* d, u64 da, u64 db) {
    if (ACC) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, %34, %35;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    } else {
        // Write-only accumulators: the first k16 step of a product reads nothing from them.
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 0, 1, 1, %34, %35;\n"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    }
}
template <int ACC, int TA, int TB>
__device__ __forceinline__ void wg_ss_n128(float* d, u64 da, u64 db) {
    if (ACC) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, 1, 1, 1, %66, %67;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    } else {
        // Write-only accumulators: the first k16 step of a product reads nothing from them.
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, 0, 1, 1, %66, %67;\n"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    }
}
__device__ __forceinline__ void wg_rs_n128_tb(float* d, const u32* a, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Rows [row0, row0 + NR) of a row-major [*, 128] bf16 matrix (row stride `stride`, `src` at the
// head's column) into the swizzled layout above (cp.async, not committed); rows >= t are zeros.
// Each thread copies the same 16-byte column chunk c of rows r0, r0 + NT/16, ...: with NT/16 a
// multiple of 8 the swizzle is the same for all of them, so a copy is a pointer step and a
// cp.async (a loop over idx < NR*16 from threadIdx.x compiled to ~20 instructions per copy).
template <int NR, int NT>
__device__ __forceinline__ void cp_tile_sw(bf16* dst, const bf16* src, i64 stride, int row0, int t) {
    static_assert((NR * 16) % NT == 0 && (NT / 16) % 8 == 0, "cp_tile_sw: NT threads must cover whole row groups");
    const int c = threadIdx.x & 15, r0 = threadIdx.x >> 4;
    unsigned char* d = (unsigned char*)dst + (c >> 3) * (NR * 128) + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
    const bf16* sg = src + (i64)(row0 + r0) * stride + c * 8;
    const i64 step = (i64)(NT / 16) * stride;
    #pragma unroll
    for (int i = 0; i < NR * 16 / NT; i++) {
        const bool ok = row0 + r0 + i * (NT / 16) < t;
        cp_async16(d + i * (NT / 16) * 128, ok ? sg : src, ok);  // rows past t: zeros, nothing read
        sg += step;
    }
}

// Forward v5 (head_dim 128, sm_90a): 128 query rows per block (warpgroup wg: rows 64wg.., warp w:
// rows 16w..), 128-key tiles. S = Q K^T (both K-major) and O += P V (P from registers, V read
// N-major) on wgmma, software-pipelined within each warpgroup: the scores of the next key tile
// are computed while this tile's P V runs, and O is rescaled once that product has landed.
// K and V have two buffers each, loaded one tile apart (K_{i+2} and V_{i+1} during tile i) by all
// threads; mbarriers say when a buffer is full and when it may be refilled, so there is no
// block-wide barrier in the loop. Same masking, LSE and outputs as versions 2 and 3.
template <bool CAP>
__device__ __forceinline__ void fwd5_softmax(float (&s)[16][4], u32 (&pn)[8][4], float& m_a, float& m_b,
                                             float& l_a, float& l_b, float& al_a, float& al_b, const Mask& mk,
                                             bool tile_all, int ra, int rb, int k0, int t, float sl2, float sc,
                                             float cap, int tq) {
    if constexpr (CAP) cap_scores<16>(s, sc, cap);
    if (!tile_all) mask_scores<16>(s, mk, ra, rb, k0, t, tq);
    softmax_tile<16>(s, m_a, m_b, l_a, l_b, al_a, al_b, sl2);
    #pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        pn[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
        pn[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
        pn[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pn[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// S = Q_wg K^T for one 128-key tile (qw: the warpgroup's 64 rows of the Q tile; kb: the K buffer).
__device__ __forceinline__ void fwd5_scores(float* s, const bf16* qw, const bf16* kb) {
    const u64 dq = wg_desc(qw, 16, 1024), dk = wg_desc(kb, 16, 1024);
    wg_ss_n128<0, 0, 0>(s, dq, dk);
    #pragma unroll
    for (int kk = 1; kk < 8; kk++) {
        const int hf = kk >> 2, o = (kk & 3) * 16;
        wg_ss_n128<1, 0, 0>(s, wg_at(dq, hf * (128 * 64) + o), wg_at(dk, hf * (128 * 64) + o));
    }
}

// A use of A-operand registers after the wait for their product: keeps the compiler from
// reusing them for values computed while that product is in flight.
__device__ __forceinline__ void wg_keep(const u32 (&a)[8][4]) {
    #pragma unroll
    for (int i = 0; i < 8; i++)
        #pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" ::"r"(a[i][e]));
}

// O += P V for one 128-key tile (P: the warpgroup's bf16 probabilities, A fragments per k16 step).
__device__ __forceinline__ void fwd5_pv(float* acc, const u32 (&pf)[8][4], const bf16* vb) {
    const u64 dv = wg_desc(vb, 128 * 128, 1024);
    #pragma unroll
    for (int kk = 0; kk < 8; kk++) wg_rs_n128_tb(acc, pf[kk], wg_at(dv, kk * 16 * 64));
}

template <bool CAP>
__device__ void attn5_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv,
                          float scale, float cap) {
    constexpr int HD = 128, BQ_ = 128, BK_ = 128, NT = 256;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    bf16* qs = (bf16*)smem;         // [2 halves][128 rows][64]
    bf16* ks = qs + BQ_ * HD;       // 2 buffers, same layout
    bf16* vs = ks + 2 * BK_ * HD;   // 2 buffers
    u64* bars = (u64*)(vs + 2 * BK_ * HD);
    u64 *full_k = bars, *full_v = bars + 2, *empty_k = bars + 4, *empty_v = bars + 6;
    unsigned char* fl = (unsigned char*)(bars + 8);

    // Blocks take their (query tile, head) in launch order heaviest tile first across all heads:
    // the last query tiles (most keys visible) of every head, then the next. Taken head by head,
    // a grid of a few waves (12 heads at T = 4608: 432 blocks on 132 SMs) ends with one head's
    // heavy tiles still running on a few SMs.
    const int h = rank_major_head(), kvh = h / (nh / nkv);
    const int q0 = (gridDim.x - 1 - rank_major_rank()) * BQ_;
    // wg through a shuffle from lane 0: the compiler then knows it is warp-uniform and keeps the
    // operand descriptors that depend on it in uniform registers.
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, w >> 2, 0);
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E, sc = scale / cap;
    const int n = (t + BK_ - 1) / BK_;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD;
    const int ra = q0 + 16 * w + g, rb = ra + 8;

    if (threadIdx.x == 0) {
        #pragma unroll
        for (int i = 0; i < 8; i++) mbar_init(bars + i, NT);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cp_tile_sw<BQ_, NT>(qs, q + (i64)h * HD, qstride, q0, t);
    cp_async_commit();
    for (int kt = threadIdx.x; kt < n; kt += NT) fl[kt] = tile_flag(mk, t, q0 / 64, 2, kt * 2, 2);
    __syncthreads();
    // Visible tile j (the j-th, counting only visible ones) has its K and V in buffer j & 1, the
    // (j >> 1)-th fill of that buffer: consumers wait for full phase (j >> 1) & 1, and the fill
    // f of a buffer first waits for empty phase (f & 1) ^ 1 (the release of fill f - 1; for f = 0
    // that parity passes at once).
    auto load_k = [&](int tile, int j) {
        const int b = j & 1;
        mbar_wait(empty_k + b, ((j >> 1) & 1) ^ 1);
        cp_tile_sw<BK_, NT>(ks + b * BK_ * HD, kg, kstride, tile * BK_, t);
        mbar_arrive_copies(full_k + b);
    };
    auto load_v = [&](int tile, int j) {
        const int b = j & 1;
        mbar_wait(empty_v + b, ((j >> 1) & 1) ^ 1);
        cp_tile_sw<BK_, NT>(vs + b * BK_ * HD, vg, kstride, tile * BK_, t);
        mbar_arrive_copies(full_v + b);
    };
    int cur = next_visible(fl, 0, n);
    int nxt = cur < n ? next_visible(fl, cur + 1, n) : n;
    if (cur < n) {
        load_k(cur, 0);
        load_v(cur, 0);
    }
    if (nxt < n) load_k(nxt, 1);
    cp_async_wait<0>();  // Q (the first tiles too: their latency is exposed once)
    fence_async_smem();
    __syncthreads();

    float acc[16][4];
    #pragma unroll
    for (int i = 0; i < 16; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_a = -LF_INF, m_b = -LF_INF, l_a = 0.f, l_b = 0.f, al_a, al_b;
    const bf16* qw = qs + (64 * wg) * 64;
    float s[16][4];
    // P of the current tile and of the next one, in two register sets used alternately (the loop
    // body runs twice per pass with the sets swapped): a copy between them would put register
    // moves that define the P V product's operands next to it, and ptxas then serialises every
    // wgmma of the kernel (C7513).
    u32 pa[8][4], pb[8][4];
    if (cur < n) {
        mbar_wait(full_k, 0);
        fence_async_smem();
        wg_fence();
        fwd5_scores(&s[0][0], qw, ks);
        wg_commit();
        wg_wait<0>();
        wg_pin<64>(&s[0][0]);
        mbar_arrive(empty_k);
        fwd5_softmax<CAP>(s, pa, m_a, m_b, l_a, l_b, al_a, al_b, mk, fl[cur] == 2, ra, rb, cur * BK_, t, sl2, sc,
                          cap, tq);
    }
    int j = 0;  // cur is visible tile j
    // One step: P_cur V_cur and the scores (then probabilities, into pn) of the next tile. No
    // block-wide barrier: the two warpgroups meet only at the buffers' barriers, so one may run
    // its softmax while the other's products hold the tensor cores.
    auto step = [&](const u32(&pc)[8][4], u32(&pn)[8][4]) {
        const int nxt2 = next_visible(fl, nxt + 1, n);
        const int b = j & 1;
        if (nxt2 < n) load_k(nxt2, j + 2);
        load_v(nxt, j + 1);
        mbar_wait(full_k + (b ^ 1), ((j + 1) >> 1) & 1);
        mbar_wait(full_v + b, (j >> 1) & 1);
        fence_async_smem();
        wg_fence();
        fwd5_scores(&s[0][0], qw, ks + (b ^ 1) * BK_ * HD);
        wg_commit();
        fwd5_pv(&acc[0][0], pc, vs + b * BK_ * HD);
        wg_commit();
        wg_wait<1>();
        wg_pin<64>(&s[0][0]);
        mbar_arrive(empty_k + (b ^ 1));
        fwd5_softmax<CAP>(s, pn, m_a, m_b, l_a, l_b, al_a, al_b, mk, fl[nxt] == 2, ra, rb, nxt * BK_, t, sl2, sc,
                          cap, tq);
        wg_wait<0>();
        wg_pin<64>(&acc[0][0]);
        wg_keep(pc);  // P_cur stays in its registers until its product has landed
        mbar_arrive(empty_v + b);
        rescale_rows<16>(acc, al_a, al_b);
        cur = nxt;
        nxt = nxt2;
        j++;
    };
    // The last tile's P V, from whichever set holds it.
    auto last = [&](const u32(&pc)[8][4]) {
        const int b = j & 1;
        mbar_wait(full_v + b, (j >> 1) & 1);
        fence_async_smem();
        wg_fence();
        fwd5_pv(&acc[0][0], pc, vs + b * BK_ * HD);
        wg_commit();
        wg_wait<0>();
        wg_pin<64>(&acc[0][0]);
    };
    if (cur < n) {
        for (;;) {
            if (nxt >= n) {
                last(pa);
                break;
            }
            step(pa, pb);
            if (nxt >= n) {
                last(pb);
                break;
            }
            step(pb, pa);
        }
    }

    #pragma unroll
    for (int hb = 0; hb < 2; hb++) {
        float li = hb ? l_b : l_a;
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        const float inv = li > 0.f ? 1.f / li : 0.f;
        const int row = hb ? rb : ra;
        if (row < t) {
            #pragma unroll
            for (int j = 0; j < 16; j++) {
                const int d = j * 8 + 2 * tq;
                *(u32*)(o + (i64)row * qstride + (i64)h * HD + d) =
                    pack_bf16(acc[j][2 * hb] * inv, acc[j][2 * hb + 1] * inv);
            }
            if (tq == 0) lse[(i64)h * t + row] = li > 0.f ? ((hb ? m_b : m_a) + log2f(li)) * LN2 : -LF_INF;
        }
    }
}

// dQ leaves the block through shared memory: each tile pair's dQ is staged there (rows padded to
// 136 floats) and added to the f32 accumulator by the bulk-copy unit, one cp.reduce.async.bulk
// per query row, issued one tile pair later. Measured against per-element vector atomics from
// registers: 23.0 against 24.5 ms at T=18432, 32/8 heads.
__device__ __forceinline__ void bulk_add_f32(float* dst, const float* src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(smem_u32(src)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// A 64-column block of wgmma accumulators (32 floats: column pairs 8kk + 2tq..) as the bf16
// register A operand of four k16 steps.
__device__ __forceinline__ void pack_k16_frags(u32 (&f)[4][4], const float (&v)[32]) {
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        f[kk][0] = pack_bf16(v[8 * kk + 0], v[8 * kk + 1]);
        f[kk][1] = pack_bf16(v[8 * kk + 2], v[8 * kk + 3]);
        f[kk][2] = pack_bf16(v[8 * kk + 4], v[8 * kk + 5]);
        f[kk][3] = pack_bf16(v[8 * kk + 6], v[8 * kk + 7]);
    }
}

// The version 5 backward's (64 key rows x 64 queries) product over head_dim 128 of a K or V tile
// (descriptor dk, 128 keys) and a Q or dO tile (descriptor dq, 64 queries): S^T or dP^T. Both
// tiles are two swizzled 64-column halves; the first k16 step overwrites the accumulators.
__device__ __forceinline__ void bwd5_key_rows_product(float* acc, u64 dk, u64 dq) {
    constexpr int HD = 128, BK_ = 128, BQ_ = 64;
    wg_ss_n64<0, 0, 0>(acc, dk, dq);
    #pragma unroll
    for (int kk = 1; kk < HD / 16; kk++) {
        const int off_k = (kk >> 2) * (BK_ * 64) + (kk & 3) * 16, off_q = (kk >> 2) * (BQ_ * 64) + (kk & 3) * 16;
        wg_ss_n64<1, 0, 0>(acc, wg_at(dk, off_k), wg_at(dq, off_q));
    }
}

template <bool CAP>
__device__ void attn5_bwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          const bf16* __restrict__ d_o, const float* __restrict__ lse,
                          const float* __restrict__ dd, float* __restrict__ dq_acc, bf16* __restrict__ dk,
                          bf16* __restrict__ dv, float* __restrict__ dk_part, float* __restrict__ dv_part, Mask mk,
                          int t, int nh, int nkv, float scale, int head_loop, float cap) {
    constexpr int HD = 128, BK_ = 128, BQ_ = 64, NT = 256;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    bf16* ks = (bf16*)smem;              // [2 halves][128 keys][64]
    bf16* vs = ks + BK_ * HD;            // same
    bf16* qs = vs + BK_ * HD;            // 2 buffers of [2 halves][64 queries][64]
    bf16* dos = qs + 2 * BQ_ * HD;       // same
    bf16* dst = dos + 2 * BQ_ * HD;      // dS^T [128 keys][64 queries]
    float* ls = (float*)(dst + BK_ * BQ_);
    float* dsum = ls + 2 * BQ_;
    constexpr int DQS = HD + 8;          // f32 row stride of the staged dQ tile
    float* dqs = dsum + 2 * BQ_;
    unsigned char* fl = (unsigned char*)(dqs + BQ_ * DQS);

    // Without head_loop: one block per (key tile x, query head y); with GQA its dK and dV are f32
    // partials that a second kernel sums per kv head. With head_loop: one block per (kv head x, key
    // tile y), which runs the kv head's query heads one after another into the same dK and dV
    // accumulators and stores them once (no partials). The key tile's flags are the same for every
    // head, so its visible query tiles repeat per head.
    const int group = nh / nkv, heads = head_loop ? group : 1;
    // Both grids give key tiles in launch order heaviest first across all heads (tile 0: every
    // query visible under a causal mask), as the forward does: the head loop's grid is (kv head,
    // key tile), and per-head blocks take theirs in the forward's rank-major order.
    const int h0 = head_loop ? blockIdx.x * group : rank_major_head(), kvh = h0 / group;
    const int ktile = head_loop ? blockIdx.y : rank_major_rank(), k0 = ktile * BK_;
    // wg through a shuffle from lane 0: the compiler then knows it is warp-uniform and keeps the
    // operand descriptors that depend on it in uniform registers.
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, w >> 2, 0);
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E, sc = scale / cap;
    const int nqt = (t + BQ_ - 1) / BQ_;

    cp_tile_sw<BK_, NT>(ks, k + (i64)kvh * HD, kstride, k0, t);
    cp_tile_sw<BK_, NT>(vs, v + (i64)kvh * HD, kstride, k0, t);
    cp_async_commit();
    for (int it = threadIdx.x; it < nqt; it += NT) fl[it] = tile_flag(mk, t, it, 1, ktile * 2, 2);
    __syncthreads();
    // Query tile `it` of head h into buffer b.
    auto load_q = [&](int it, int h, int b) {
        const int q0 = it * BQ_;
        cp_tile_sw<BQ_, NT>(qs + b * BQ_ * HD, q + (i64)h * HD, qstride, q0, t);
        cp_tile_sw<BQ_, NT>(dos + b * BQ_ * HD, d_o + (i64)h * HD, qstride, q0, t);
        cp_query_stats<BQ_, NT>(ls + b * BQ_, dsum + b * BQ_, lse + (i64)h * t, dd + (i64)h * t, q0, t);
    };
    // The work is the visible query tiles of heads h0 .. h0 + heads - 1, head by head.
    const int first = next_visible(fl, 0, nqt);
    int cur = first, cur_h = h0;
    if (cur < nqt) load_q(cur, cur_h, 0);
    cp_async_commit();

    const int ka = k0 + 16 * w + g, kb = ka + 8;
    const int kpa = ka < t ? mk.pos[ka] : 0, kpb = kb < t ? mk.pos[kb] : 0;
    float adk[HD / 8][4], adv[HD / 8][4];
    zero_key_acc(adk, adv);
    // This warpgroup's 64 rows of the K and V tiles (K-major A operands).
    const bf16* kw = ks + (64 * wg) * 64;
    const bf16* vw = vs + (64 * wg) * 64;

    // One barrier per tile pair: past it, every warp has finished the previous pair (its MMAs
    // waited for), so the next tile's loads may overwrite that pair's buffer and dS^T.
    // Thread r < 64 sends row r of the staged dQ tile of query tile `pend`.
    auto send_dq = [&](int pend, int h) {
        const int row = pend * BQ_ + threadIdx.x;
        if (threadIdx.x < BQ_ && row < t)
            bulk_add_f32(dq_acc + (i64)row * qstride + (i64)h * HD, dqs + threadIdx.x * DQS, HD * 4);
    };
    int buf = 0, pend = -1, pend_h = h0;
    while (cur < nqt) {
        int nxt = next_visible(fl, cur + 1, nqt), nxt_h = cur_h;
        if (nxt >= nqt && cur_h + 1 < h0 + heads) nxt = first, nxt_h = cur_h + 1;
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (pend >= 0) send_dq(pend, pend_h);
        if (nxt < nqt) load_q(nxt, nxt_h, buf ^ 1);
        cp_async_commit();
        const bf16* qb = qs + buf * BQ_ * HD;
        const bf16* ob = dos + buf * BQ_ * HD;
        const float* lb = ls + buf * BQ_;
        const float* db = dsum + buf * BQ_;
        const int q0 = cur * BQ_;

        // The first k16 step of each product overwrites the accumulators (no zeroing pass).
        float s[32], dp[32];
        wg_fence();
        const u64 d_kw = wg_desc(kw, 16, 1024), d_qb = wg_desc(qb, 16, 1024), d_vw = wg_desc(vw, 16, 1024),
                  d_ob = wg_desc(ob, 16, 1024), d_obn = wg_desc(ob, BQ_ * 128, 1024),
                  d_qbn = wg_desc(qb, BQ_ * 128, 1024);
        bwd5_key_rows_product(s, d_kw, d_qb);
        wg_commit();
        bwd5_key_rows_product(dp, d_vw, d_ob);
        wg_commit();
        // S^T and dP^T are two commit groups: P^T is computed while dP^T's MMAs run, and dS^T while
        // dV's run. Element e of column block j is key (e < 2 ? ka : kb), query 8j + 2tq + (e & 1).
        wg_wait<1>();
        wg_pin<32>(s);
        // Fully visible tiles (most) take a branch-free loop; the compiler would otherwise test
        // the flag per element and serialise the exponentials. With CAP, dc keeps each element's
        // 1 - tanh^2 for dS^T.
        float dc[CAP ? 32 : 1];
        if constexpr (CAP) {
            const bool all = fl[cur] == 2;
            #pragma unroll
            for (int j = 0; j < 8; j++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = j * 8 + 2 * tq + (e & 1), qi = q0 + ql, kx = e < 2 ? ka : kb;
                    const bool vis = all || (qi < t && kx < t &&
                                             visible(mk.ranges[qi], mk.pos[qi], kx, e < 2 ? kpa : kpb, mk.window));
                    const float th = cap_tanh(s[4 * j + e] * sc);
                    dc[4 * j + e] = 1.f - th * th;
                    s[4 * j + e] = vis ? fast_exp2((cap * th - lb[ql]) * LOG2E) : 0.f;
                }
            }
        } else if (fl[cur] == 2) {
            #pragma unroll
            for (int j = 0; j < 8; j++)
                #pragma unroll
                for (int e = 0; e < 4; e++)
                    s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], sl2, -lb[j * 8 + 2 * tq + (e & 1)] * LOG2E));
        } else {
            #pragma unroll
            for (int j = 0; j < 8; j++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = j * 8 + 2 * tq + (e & 1), qi = q0 + ql, kx = e < 2 ? ka : kb;
                    const bool vis = qi < t && kx < t &&
                                     visible(mk.ranges[qi], mk.pos[qi], kx, e < 2 ? kpa : kpb, mk.window);
                    s[4 * j + e] = vis ? fast_exp2(fmaf(s[4 * j + e], sl2, -lb[ql] * LOG2E)) : 0.f;
                }
            }
        }
        u32 pf[4][4], sf[4][4];
        pack_k16_frags(pf, s);
        wg_fence();
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_rs_n128_tb(&adv[0][0], pf[kk], wg_at(d_obn, kk * 16 * 64));
        wg_commit();
        wg_wait<1>();
        wg_pin<32>(dp);
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - db[j * 8 + 2 * tq + (e & 1)]);
                if constexpr (CAP) dp[4 * j + e] *= dc[4 * j + e];
            }
        }
        pack_k16_frags(sf, dp);
        wg_fence();
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) wg_rs_n128_tb(&adk[0][0], sf[kk], wg_at(d_qbn, kk * 16 * 64));
        wg_commit();
        // dS^T rows 16w + g and 16w + g + 8 to shared memory (query pairs: one 4-byte store each).
        {
            const int ra = 16 * w + g, rb = ra + 8;
            unsigned char* base = (unsigned char*)dst;
            #pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                #pragma unroll
                for (int hj = 0; hj < 2; hj++) {
                    const int j = 2 * kk + hj;
                    *(u32*)(base + ra * 128 + ((j ^ (ra & 7)) << 4) + 4 * tq) = sf[kk][2 * hj];
                    *(u32*)(base + rb * 128 + ((j ^ (rb & 7)) << 4) + 4 * tq) = sf[kk][2 * hj + 1];
                }
            }
        }
        bulk_wait_read();  // the previous tile's dQ rows have left dqs
        fence_async_smem();
        __syncthreads();
        float aq[32];
        const bf16* kh = ks + wg * (BK_ * 64);
        wg_fence();
        const u64 d_ds = wg_desc(dst, 8192, 1024), d_kh = wg_desc(kh, 8192, 1024);
        wg_ss_n64<0, 1, 1>(aq, d_ds, d_kh);
        #pragma unroll
        for (int kk = 1; kk < BK_ / 16; kk++)
            wg_ss_n64<1, 1, 1>(aq, wg_at(d_ds, kk * 16 * 64), wg_at(d_kh, kk * 16 * 64));
        wg_commit();
        wg_wait<0>();
        wg_pin<32>(aq);
        wg_pin<64>(&adv[0][0]);
        wg_pin<64>(&adk[0][0]);
        {
            const int ra = 16 * (w & 3) + g, rb = ra + 8;
            #pragma unroll
            for (int j = 0; j < 8; j++) {
                const int col = 64 * wg + 8 * j + 2 * tq;
                *(float2*)(dqs + ra * DQS + col) = make_float2(aq[4 * j], aq[4 * j + 1]);
                *(float2*)(dqs + rb * DQS + col) = make_float2(aq[4 * j + 2], aq[4 * j + 3]);
            }
            fence_async_smem();
            pend = cur, pend_h = cur_h;
        }
        cur = nxt, cur_h = nxt_h;
        buf ^= 1;
    }
    __syncthreads();
    if (pend >= 0) send_dq(pend, pend_h);
    bulk_wait();
    key_tile_store<HD>(adk, adv, dk, dv, dk_part, dv_part, h0, kvh, group / heads, ka, kb, t, nkv, scale, tq);
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN5_BODY(x) x
#else
#define ATTN5_BODY(x)
#endif
#define INSTANTIATE5(CAP, SFX)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn5_fwd_128##SFX(                                \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        float scale, float cap) {                                                                              \
        ATTN5_BODY((attn5_fwd<CAP>(q, k, v, o, lse, mk, t, nh, nkv, scale, cap)));                             \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn5_bwd_128##SFX(                                \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        float* dq_acc, bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv,    \
        float scale, int head_loop, float cap) {                                                               \
        ATTN5_BODY((attn5_bwd<CAP>(q, k, v, d_o, lse, dd, dq_acc, dk, dv, dk_part, dv_part, mk, t, nh, nkv,    \
                                   scale, head_loop, cap)));                                                   \
    }
#if LF_PART(3)
INSTANTIATE5(false, )
INSTANTIATE5(true, _cap)
#endif

// ================================================================================================
// Version 7: head_dim 512 (Gemma 4's global layers) on mma.sync, forward, dQ and dK/dV, no
// atomics. A warp owns 16 rows; at head_dim 512 its accumulators over all head dims would be 256
// f32 registers (per output, dK or dV), so each kernel splits the accumulated head dims across
// blocks or warps, and the tiles shrink to fit shared memory (rows of 520 bf16, padded as in
// version 2). Key and query steps of 16 or 32 rows walk the 64-row tiles of the visibility table:
// a step takes its 64-tile's flag (none: skipped, full: no per-element test, else tested), and
// steps that start at or past T are skipped.
//
//   forward  grid (ceil(T/128), n_heads, 2), 256 threads. Block z computes output dims 256z..:
//            S = Q K^T over all 512 dims (Q read from shared memory per k16 step), the online
//            softmax, O[:, 256z..] += P V[:, 256z..]. Both blocks of a query tile compute the same
//            S, maxima and sums (same instructions on the same data), so their halves of O agree;
//            block 0 writes the lse. 32-key steps; K double-buffered, V (its half) single, its
//            load overlapping the next step's S. Shared memory 217 KB.
//   dQ       grid (ceil(T/64), n_heads), 256 threads; 16-key steps, K and V double-buffered, Q and
//            dO resident. Warps 0-3 compute S (query rows 16w..), warps 4-7 dP = dO V^T for the
//            same rows; the probabilities P * (1 - tanh^2) go through shared memory (f32) to the
//            dP warps, which write dS (bf16) for dQ = dS K: warp w accumulates query rows
//            16(w % 4).., head dims 256(w / 4).. (128 registers). 208 KB.
//   dK/dV    grid (ceil(T/32), n_heads), 256 threads: 32 keys per block (K and V resident) meet
//            the visible queries in 32-row steps (Q, dO, lse and D double-buffered). Warp w computes
//            S^T (w < 4) or dP^T (w >= 4) for keys 16(w % 2).., queries 16((w / 2) % 2).. of the
//            step; P^T and dS^T (bf16) go to shared memory as in version 6; then warp w
//            accumulates dV += P^T dO and dK += dS^T Q for keys 16(w % 2).., head dims
//            128(w / 2).. (64 + 64 registers). Output as key_tile_store writes it (f32 partials per
//            query head with GQA, summed by lf_attn_dkdv_reduce). 210 KB.
// Every product is computed once per (query, key) pair except S in the forward (twice, one per
// output half).

// The step after `st` (steps of BS rows inside 64-row tiles; fl: the tiles' visibility bytes, n
// tiles): the next step of the same tile while it starts below t, else the first step of the next
// visible tile; n * (64 / BS) when none is left.
template <int BS>
__device__ __forceinline__ int next_step(const unsigned char* fl, int st, int n, int t) {
    constexpr int SUB = 64 / BS;
    if (st % SUB + 1 < SUB && (st + 1) * BS < t) return st + 1;
    return next_visible(fl, st / SUB + 1, n) * SUB;
}

template <bool CAP>
__device__ void attn7_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                          bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv,
                          float scale, float cap) {
    constexpr int HD = 512, DW = 256, BQ_ = 128, BK_ = 32, NT = 256, SS = HD + 8, SV = DW + 8, SUB = 64 / BK_;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = (bf16*)smem;                    // [BQ_][SS]
    bf16* ks = qs + BQ_ * SS;                  // two buffers of [BK_][SS]
    bf16* vs = ks + 2 * BK_ * SS;              // [BK_][SV]: this block's DW columns of V
    unsigned char* fl = (unsigned char*)(vs + BK_ * SV);

    const int h = blockIdx.y, kvh = h / (nh / nkv), dh = blockIdx.z * DW;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ_;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E;
    const int ntiles = (t + 63) / 64, nsteps = ntiles * SUB;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD + dh;

    cp_tile<HD, BQ_, NT>(qs, q + (i64)h * HD, qstride, q0, t);
    cp_async_commit();
    for (int kt = threadIdx.x; kt < ntiles; kt += NT) fl[kt] = tile_flag(mk, t, q0 / 64, BQ_ / 64, kt, 1);
    __syncthreads();
    int cur = next_visible(fl, 0, ntiles) * SUB;
    // cp.async groups, oldest first: Q, then per step its K and its V (empty groups where there is
    // nothing to load, so that the counts below hold).
    if (cur < nsteps) cp_tile<HD, BK_, NT>(ks, kg, kstride, cur * BK_, t);
    cp_async_commit();
    if (cur < nsteps) cp_tile<DW, BK_, NT>(vs, vg, kstride, cur * BK_, t);
    cp_async_commit();

    const int ra = q0 + 16 * w + g, rb = ra + 8;
    const bool oka = ra < t, okb = rb < t;
    float acc[DW / 8][4];
    #pragma unroll
    for (int i = 0; i < DW / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_a = -LF_INF, m_b = -LF_INF, l_a = 0.f, l_b = 0.f;

    int buf = 0;
    while (cur < nsteps) {
        const int nxt = next_step<BK_>(fl, cur, ntiles, t);
        // Q and this step's K have landed (its V may be in flight); past the barrier every warp
        // is done with the other K buffer (the previous step's S).
        cp_async_wait<1>();
        __syncthreads();
        if (nxt < nsteps) cp_tile<HD, BK_, NT>(ks + (buf ^ 1) * BK_ * SS, kg, kstride, nxt * BK_, t);
        cp_async_commit();
        const bf16* kb = ks + buf * BK_ * SS;
        const int k0 = cur * BK_;
        const bool tile_all = fl[cur / SUB] == 2;

        float s[BK_ / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BK_ / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        #pragma unroll 4
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 af[4];
            ldsm_x4(af, qs + (16 * w) * SS + kk * 16 + lo_a<SS>(lane));
            #pragma unroll
            for (int np = 0; np < BK_ / 16; np++) {
                u32 b[4];
                ldsm_x4(b, kb + np * 16 * SS + kk * 16 + lo_bn<SS>(lane));
                mma16816(s[2 * np], af, b[0], b[1]);
                mma16816(s[2 * np + 1], af, b[2], b[3]);
            }
        }
        if constexpr (CAP) cap_scores(s, scale / cap, cap);
        if (!tile_all) mask_scores(s, mk, ra, rb, k0, t, tq);
        float al_a, al_b;
        softmax_tile<BK_ / 8>(s, m_a, m_b, l_a, l_b, al_a, al_b, sl2);
        rescale_rows<DW / 8>(acc, al_a, al_b);

        // This step's V has landed (the next K may be in flight).
        cp_async_wait<1>();
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < BK_ / 16; j++) {
            u32 pf[4];
            pf[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
            pf[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
            pf[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
            pf[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
            #pragma unroll
            for (int dp = 0; dp < DW / 16; dp++) {
                u32 b[4];
                ldsm_x4_t(b, vs + j * 16 * SV + dp * 16 + lo_bt<SV>(lane));
                mma16816(acc[2 * dp], pf, b[0], b[1]);
                mma16816(acc[2 * dp + 1], pf, b[2], b[3]);
            }
        }
        // Every warp is done with V: the next step's V may overwrite it.
        __syncthreads();
        if (nxt < nsteps) cp_tile<DW, BK_, NT>(vs, vg, kstride, nxt * BK_, t);
        cp_async_commit();
        cur = nxt;
        buf ^= 1;
    }
    cp_async_wait<0>();

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    #pragma unroll
    for (int nd = 0; nd < DW / 8; nd++) {
        const i64 col = (i64)h * HD + dh + nd * 8 + 2 * tq;
        if (oka) *(u32*)(o + (i64)ra * qstride + col) = pack_bf16(acc[nd][0] * inv_a, acc[nd][1] * inv_a);
        if (okb) *(u32*)(o + (i64)rb * qstride + col) = pack_bf16(acc[nd][2] * inv_b, acc[nd][3] * inv_b);
    }
    if (tq == 0 && blockIdx.z == 0) {
        if (oka) lse[(i64)h * t + ra] = l_a > 0.f ? (m_a + log2f(l_a)) * LN2 : -LF_INF;
        if (okb) lse[(i64)h * t + rb] = l_b > 0.f ? (m_b + log2f(l_b)) * LN2 : -LF_INF;
    }
}

template <bool CAP>
__device__ void attn7_dq(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         const bf16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dd,
                         bf16* __restrict__ dq, Mask mk, int t, int nh, int nkv, float scale, float cap) {
    constexpr int HD = 512, DW = 256, BQ_ = 64, BK_ = 16, NT = 256, SS = HD + 8, SUB = 64 / BK_;
    constexpr int PS = BK_ + 4, DSS = BK_ + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = (bf16*)smem;                     // [BQ_][SS]
    bf16* dos = qs + BQ_ * SS;                  // [BQ_][SS]
    bf16* ks = dos + BQ_ * SS;                  // two buffers of [BK_][SS]
    bf16* vs = ks + 2 * BK_ * SS;               // two buffers of [BK_][SS]
    float* pm = (float*)(vs + 2 * BK_ * SS);    // [BQ_][PS]: P * (1 - tanh^2), f32
    bf16* dss = (bf16*)(pm + BQ_ * PS);         // [BQ_][DSS]: dS
    unsigned char* fl = (unsigned char*)(dss + BQ_ * DSS);

    const int h = rank_major_head(), kvh = h / (nh / nkv);
    const int q0 = (gridDim.x - 1 - rank_major_rank()) * BQ_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int qg = w & 3, role = w >> 2, dh = role * DW;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = scale * LOG2E;
    const int ntiles = (t + 63) / 64, nsteps = ntiles * SUB;
    const bf16* kg = k + (i64)kvh * HD;
    const bf16* vg = v + (i64)kvh * HD;

    cp_tile<HD, BQ_, NT>(qs, q + (i64)h * HD, qstride, q0, t);
    cp_tile<HD, BQ_, NT>(dos, d_o + (i64)h * HD, qstride, q0, t);
    for (int kt = threadIdx.x; kt < ntiles; kt += NT) fl[kt] = tile_flag(mk, t, q0 / 64, BQ_ / 64, kt, 1);
    __syncthreads();
    auto load_kv = [&](int st, int b) {
        cp_tile<HD, BK_, NT>(ks + b * BK_ * SS, kg, kstride, st * BK_, t);
        cp_tile<HD, BK_, NT>(vs + b * BK_ * SS, vg, kstride, st * BK_, t);
    };
    int cur = next_visible(fl, 0, ntiles) * SUB;
    if (cur < nsteps) load_kv(cur, 0);
    cp_async_commit();

    // The warp's score rows (query rows ra, rb of its C fragments).
    const int ra = q0 + 16 * qg + g, rb = ra + 8;
    const uint4 empty = make_uint4(0, 0, 0, 0);
    const bool oka = ra < t, okb = rb < t;
    const uint4 rga = oka ? mk.ranges[ra] : empty, rgb = okb ? mk.ranges[rb] : empty;
    const int pa = oka ? mk.pos[ra] : 0, pb = okb ? mk.pos[rb] : 0;
    const float la = oka ? lse[(i64)h * t + ra] * LOG2E : 0.f, lb = okb ? lse[(i64)h * t + rb] * LOG2E : 0.f;
    const float da = oka ? dd[(i64)h * t + ra] : 0.f, db = okb ? dd[(i64)h * t + rb] : 0.f;
    // This warp's rows of its score product's A operand (Q for S, dO for dP).
    const bf16* aw = (role == 0 ? qs : dos) + (16 * qg) * SS;
    float* pw = pm + (16 * qg + g) * PS + 2 * tq;
    bf16* dw = dss + (16 * qg + g) * DSS + 2 * tq;

    float acc[DW / 8][4];
    #pragma unroll
    for (int i = 0; i < DW / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    int buf = 0;
    while (cur < nsteps) {
        const int nxt = next_step<BK_>(fl, cur, ntiles, t);
        // This step's K and V have landed; every warp is done with the previous step (the other
        // buffers, pm and dss may be overwritten).
        cp_async_wait<0>();
        __syncthreads();
        if (nxt < nsteps) load_kv(nxt, buf ^ 1);
        cp_async_commit();
        const bf16* kb = ks + buf * BK_ * SS;
        const int k0 = cur * BK_;
        {
            // S (role 0) or dP (role 1): 16 query rows x 16 keys over all 512 dims. Element e of
            // n-tile nt: row (e < 2 ? ra : rb), key k0 + nt * 8 + 2tq + (e & 1).
            const bf16* bw = (role == 0 ? kb : vs + buf * BK_ * SS);
            float x[BK_ / 8][4];
            #pragma unroll
            for (int nt = 0; nt < BK_ / 8; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.f;
            #pragma unroll 8
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 af[4], b[4];
                ldsm_x4(af, aw + kk * 16 + lo_a<SS>(lane));
                ldsm_x4(b, bw + kk * 16 + lo_bn<SS>(lane));
                mma16816(x[0], af, b[0], b[1]);
                mma16816(x[1], af, b[2], b[3]);
            }
            if (role == 0) {
                const bool tile_all = fl[cur / SUB] == 2;
                #pragma unroll
                for (int nt = 0; nt < BK_ / 8; nt++) {
                    float pmv[4];
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const bool top = e < 2;
                        float p, dcap = 1.f;
                        if constexpr (CAP) {
                            const float th = cap_tanh(x[nt][e] * (scale / cap));
                            p = fast_exp2(cap * th * LOG2E - (top ? la : lb));
                            dcap = 1.f - th * th;
                        } else {
                            p = fast_exp2(x[nt][e] * sl2 - (top ? la : lb));
                        }
                        if (!tile_all) {
                            const int kx = k0 + nt * 8 + 2 * tq + (e & 1);
                            const bool vis = top ? vis2(mk, rga, pa, oka, kx, t) : vis2(mk, rgb, pb, okb, kx, t);
                            if (!vis) p = 0.f;
                        }
                        pmv[e] = p * dcap;
                    }
                    *(float2*)(pw + nt * 8) = make_float2(pmv[0], pmv[1]);
                    *(float2*)(pw + 8 * PS + nt * 8) = make_float2(pmv[2], pmv[3]);
                }
            }
            __syncthreads();
            if (role == 1) {
                #pragma unroll
                for (int nt = 0; nt < BK_ / 8; nt++) {
                    const float2 top = *(const float2*)(pw + nt * 8), bot = *(const float2*)(pw + 8 * PS + nt * 8);
                    *(u32*)(dw + nt * 8) = pack_bf16(top.x * (x[nt][0] - da), top.y * (x[nt][1] - da));
                    *(u32*)(dw + 8 * DSS + nt * 8) = pack_bf16(bot.x * (x[nt][2] - db), bot.y * (x[nt][3] - db));
                }
            }
        }
        __syncthreads();
        // dQ rows 16qg.., head dims dh..: A = dS (16 rows x 16 keys), B = K (keys x dims).
        u32 af[4];
        ldsm_x4(af, dss + (16 * qg) * DSS + lo_a<DSS>(lane));
        #pragma unroll
        for (int dpi = 0; dpi < DW / 16; dpi++) {
            u32 b[4];
            ldsm_x4_t(b, kb + dh + dpi * 16 + lo_bt<SS>(lane));
            mma16816(acc[2 * dpi], af, b[0], b[1]);
            mma16816(acc[2 * dpi + 1], af, b[2], b[3]);
        }
        cur = nxt;
        buf ^= 1;
    }
    cp_async_wait<0>();
    #pragma unroll
    for (int nd = 0; nd < DW / 8; nd++) {
        const i64 col = (i64)h * HD + dh + nd * 8 + 2 * tq;
        if (oka) *(u32*)(dq + (i64)ra * qstride + col) = pack_bf16(acc[nd][0] * scale, acc[nd][1] * scale);
        if (okb) *(u32*)(dq + (i64)rb * qstride + col) = pack_bf16(acc[nd][2] * scale, acc[nd][3] * scale);
    }
}

template <bool CAP>
__device__ void attn7_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                           const bf16* __restrict__ d_o, const float* __restrict__ lse,
                           const float* __restrict__ dd, bf16* __restrict__ dk, bf16* __restrict__ dv,
                           float* __restrict__ dk_part, float* __restrict__ dv_part, Mask mk, int t, int nh,
                           int nkv, float scale, float cap) {
    constexpr int HD = 512, DW = 128, BK_ = 32, BQ_ = 32, NT = 256, SS = HD + 8, SUB = 64 / BQ_;
    constexpr int DS = BQ_ + 8, PS = BQ_ + 4;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* ks = (bf16*)smem;                     // [BK_][SS]
    bf16* vs = ks + BK_ * SS;                   // [BK_][SS]
    bf16* qs = vs + BK_ * SS;                   // two buffers of [BQ_][SS]
    bf16* dos = qs + 2 * BQ_ * SS;              // two buffers of [BQ_][SS]
    bf16* pt_s = dos + 2 * BQ_ * SS;            // [BK_][DS]: P^T
    bf16* dst = pt_s + BK_ * DS;                // [BK_][DS]: dS^T
    float* pm = (float*)(dst + BK_ * DS);       // [BK_][PS]: P^T * (1 - tanh^2), f32
    float* ls = pm + BK_ * PS;                  // two buffers of BQ_ lse
    float* dsum = ls + 2 * BQ_;                 // two buffers of BQ_ D
    unsigned char* fl = (unsigned char*)(dsum + 2 * BQ_);

    const int h = rank_major_head(), group = nh / nkv, kvh = h / group;
    const int ktile = rank_major_rank(), k0 = ktile * BK_;  // heaviest first (rank_major_head)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    // Scores: keys 16kr.., queries 16qc.. of the step, S^T (role 0) or dP^T (role 1).
    // Accumulators: keys 16kr.., head dims dh...
    const int kr = w & 1, qc = (w >> 1) & 1, role = w >> 2, dh = (w >> 1) * DW;
    const i64 qstride = (i64)nh * HD, kstride = (i64)nkv * HD;
    const float sl2 = CAP ? LOG2E : scale * LOG2E, sc = scale / cap;
    const int nqt = (t + 63) / 64, nsteps = nqt * SUB;
    const bf16* qg = q + (i64)h * HD;
    const bf16* og = d_o + (i64)h * HD;
    const float* lg = lse + (i64)h * t;
    const float* dg = dd + (i64)h * t;

    cp_tile<HD, BK_, NT>(ks, k + (i64)kvh * HD, kstride, k0, t);
    cp_tile<HD, BK_, NT>(vs, v + (i64)kvh * HD, kstride, k0, t);
    cp_async_commit();
    // Visibility per 64-query tile from the 64-key tile holding the block's keys.
    for (int it = threadIdx.x; it < nqt; it += NT) fl[it] = tile_flag(mk, t, it, 1, k0 / 64, 1);
    __syncthreads();
    auto load_q = [&](int st, int b) {
        load_query_tile<HD, BQ_, NT>(qs + b * BQ_ * SS, dos + b * BQ_ * SS, ls + b * BQ_, dsum + b * BQ_, qg, og, lg,
                                     dg, qstride, st * BQ_, t);
    };
    int cur = next_visible(fl, 0, nqt) * SUB;
    if (cur < nsteps) load_q(cur, 0);
    cp_async_commit();

    const int ka = k0 + 16 * kr + g, kb = ka + 8;
    const int kpa = ka < t ? mk.pos[ka] : 0, kpb = kb < t ? mk.pos[kb] : 0;
    float adk[DW / 8][4], adv[DW / 8][4];
    zero_key_acc(adk, adv);
    // This warp's rows of its score product's A operand (K for S^T, V for dP^T).
    const bf16* aw = (role == 0 ? ks : vs) + (16 * kr) * SS;
    // Its elements of the P^T / dS^T tiles: key row 16kr + g (+ 8), query column 16qc + 2tq (+ nt * 8).
    bf16* pw = pt_s + (16 * kr + g) * DS + 16 * qc + 2 * tq;
    bf16* dw = dst + (16 * kr + g) * DS + 16 * qc + 2 * tq;
    float* mw = pm + (16 * kr + g) * PS + 16 * qc + 2 * tq;

    int buf = 0;
    while (cur < nsteps) {
        const int nxt = next_step<BQ_>(fl, cur, nqt, t);
        // This step's Q, dO, lse and D have landed; every warp is done with the previous step.
        cp_async_wait<0>();
        __syncthreads();
        if (nxt < nsteps) load_q(nxt, buf ^ 1);
        cp_async_commit();
        const bf16* qb = qs + buf * BQ_ * SS;
        const bf16* ob = dos + buf * BQ_ * SS;
        const int q0 = cur * BQ_;
        {
            float x[2][4];
            #pragma unroll
            for (int nt = 0; nt < 2; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.f;
            const bf16* bw = (role == 0 ? qb : ob) + (16 * qc) * SS;
            #pragma unroll 8
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 af[4], b[4];
                ldsm_x4(af, aw + kk * 16 + lo_a<SS>(lane));
                ldsm_x4(b, bw + kk * 16 + lo_bn<SS>(lane));
                mma16816(x[0], af, b[0], b[1]);
                mma16816(x[1], af, b[2], b[3]);
            }
            // Element e of n-tile nt: key (e < 2 ? ka : kb), query column ql of the step.
            if (role == 0) {
                const float* lb = ls + buf * BQ_;
                const bool tile_all = fl[cur / SUB] == 2;
                #pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    float p[4], pmv[4];
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int ql = 16 * qc + nt * 8 + 2 * tq + (e & 1);
                        float dcap = 1.f;
                        if constexpr (CAP) {
                            const float th = cap_tanh(x[nt][e] * sc);
                            p[e] = fast_exp2((cap * th - lb[ql]) * LOG2E);
                            dcap = 1.f - th * th;
                        } else {
                            p[e] = fast_exp2(x[nt][e] * sl2 - lb[ql] * LOG2E);
                        }
                        if (!tile_all) {
                            const int qi = q0 + ql, kx = e < 2 ? ka : kb;
                            bool vis = false;
                            if (qi < t && kx < t)
                                vis = visible(mk.ranges[qi], mk.pos[qi], kx, e < 2 ? kpa : kpb, mk.window);
                            if (!vis) p[e] = 0.f;
                        }
                        pmv[e] = p[e] * dcap;
                    }
                    *(u32*)(pw + nt * 8) = pack_bf16(p[0], p[1]);
                    *(u32*)(pw + 8 * DS + nt * 8) = pack_bf16(p[2], p[3]);
                    *(float2*)(mw + nt * 8) = make_float2(pmv[0], pmv[1]);
                    *(float2*)(mw + 8 * PS + nt * 8) = make_float2(pmv[2], pmv[3]);
                }
            }
            __syncthreads();
            if (role == 1) {
                const float* db = dsum + buf * BQ_;
                #pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const int ql = 16 * qc + nt * 8 + 2 * tq;
                    const float d0 = db[ql], d1 = db[ql + 1];
                    const float2 top = *(const float2*)(mw + nt * 8), bot = *(const float2*)(mw + 8 * PS + nt * 8);
                    *(u32*)(dw + nt * 8) = pack_bf16(top.x * (x[nt][0] - d0), top.y * (x[nt][1] - d1));
                    *(u32*)(dw + 8 * DS + nt * 8) = pack_bf16(bot.x * (x[nt][2] - d0), bot.y * (x[nt][3] - d1));
                }
            }
        }
        __syncthreads();
        // dV_w += P^T dO[:, dh..], dK_w += dS^T Q[:, dh..] (A operands: keys 16kr.. of the tiles).
        #pragma unroll
        for (int j = 0; j < BQ_ / 16; j++) {
            u32 pf[4], sf[4];
            ldsm_x4(pf, pt_s + (16 * kr) * DS + j * 16 + lo_a<DS>(lane));
            ldsm_x4(sf, dst + (16 * kr) * DS + j * 16 + lo_a<DS>(lane));
            #pragma unroll
            for (int dpi = 0; dpi < DW / 16; dpi++) {
                u32 b[4];
                ldsm_x4_t(b, ob + dh + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
                mma16816(adv[2 * dpi], pf, b[0], b[1]);
                mma16816(adv[2 * dpi + 1], pf, b[2], b[3]);
                ldsm_x4_t(b, qb + dh + j * 16 * SS + dpi * 16 + lo_bt<SS>(lane));
                mma16816(adk[2 * dpi], sf, b[0], b[1]);
                mma16816(adk[2 * dpi + 1], sf, b[2], b[3]);
            }
        }
        cur = nxt;
        buf ^= 1;
    }
    cp_async_wait<0>();
    key_tile_store<HD, DW>(adk, adv, dk, dv, dk_part, dv_part, h, kvh, group, ka, kb, t, nkv, scale, tq, dh);
}

// Same arguments as version 2's kernels (lf_attn2_fwd / _dq / _dkdv).
#define INSTANTIATE7(CAP, SFX)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn7_fwd_512##SFX(                                \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        float scale, float cap) {                                                                              \
        attn7_fwd<CAP>(q, k, v, o, lse, mk, t, nh, nkv, scale, cap);                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn7_dq_512##SFX(                                 \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dq, Mask mk, int t, int nh, int nkv, float scale, float cap) {                                   \
        attn7_dq<CAP>(q, k, v, d_o, lse, dd, dq, mk, t, nh, nkv, scale, cap);                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) lf_attn7_dkdv_512##SFX(                               \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv, float scale,      \
        float cap) {                                                                                           \
        attn7_dkdv<CAP>(q, k, v, d_o, lse, dd, dk, dv, dk_part, dv_part, mk, t, nh, nkv, scale, cap);          \
    }
#if LF_PART(3)
INSTANTIATE7(false, )
INSTANTIATE7(true, _cap)
#endif
