// FlashAttention-2 style attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate).
// Never materialises [T, T]: query tiles x key tiles in shared memory with an online softmax; the
// per-row log-sum-exp is saved ([n_heads, T] f32) and the backward recomputes probabilities tile
// by tile. Three backward kernels: D = rowsum(dO * O), dQ per query tile (loop over key tiles),
// dK/dV per key tile (loop over the group's query heads and query tiles); no atomics.
//
// Visibility per (query, key): key in [a0, a1) or [b0, b1) of the query's ranges, and, with a
// window, pos[q] - pos[k] < window. Whole tiles with no visible element are skipped; tiles that
// are fully visible skip the per-element test. Head dims are padded to HDP (a multiple of 16) with
// zeros in shared memory, so any head_dim up to 128 works.
//
// mma.m16n8k16 fragment layouts (g = lane / 4, t = lane % 4):
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8 f32):         c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)

#define BQ 64
#define BK 64
#define NTHREADS 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(u32*)&v;
}

__device__ __forceinline__ u32 lds32(const bf16* p) { return *(const u32*)p; }

struct Mask {
    const uint4* ranges;  // [T] of (a0, a1, b0, b1)
    const int* pos;       // [T]
    const int* kt_min;    // [ceil(T/64)] min position of each 64-key tile
    const int* kt_max;    // [ceil(T/64)] max position
    int window;           // < 0: none
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
template <int HDP>
__device__ void attn_fwd(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         bf16* __restrict__ o, float* __restrict__ lse, Mask mk, int t, int nh, int nkv, int hd,
                         float scale) {
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
                float x = s[nt][e] * sl2;
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

// ------------------------------------------------------------------------------------------------
// dQ. grid (ceil(T/64), n_heads); warp w owns query rows 16w.. of the tile.
template <int HDP>
__device__ void attn_bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            const bf16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dd,
                            bf16* __restrict__ dq, Mask mk, int t, int nh, int nkv, int hd, float scale) {
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
                float p = exp2f(s[nt][e] * sl2 - (top ? la : lb));
                if (!tile_all) {
                    int kl = nt * 8 + 2 * tq + (e & 1);
                    bool vis = top ? visible(rga, pa, k0 + kl, kpos[kl], mk.window)
                                   : visible(rgb, pb, k0 + kl, kpos[kl], mk.window);
                    if (!vis) p = 0.f;
                }
                s[nt][e] = p * (dp[nt][e] - (top ? da : db));
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
template <int HDP>
__device__ void attn_bwd_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                              const bf16* __restrict__ d_o, const float* __restrict__ lse,
                              const float* __restrict__ dd, bf16* __restrict__ dk, bf16* __restrict__ dv,
                              float* __restrict__ dk_part, float* __restrict__ dv_part, Mask mk, int t, int nh,
                              int nkv, int hd, float scale) {
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
    #pragma unroll
    for (int i = 0; i < HDP / 8; i++) {
        adk[i][0] = adk[i][1] = adk[i][2] = adk[i][3] = 0.f;
        adv[i][0] = adv[i][1] = adv[i][2] = adv[i][3] = 0.f;
    }
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
                    float p = exp2f(s[nt][e] * sl2 - lse_s[ql]);
                    if (!tile_all) {
                        const bool top = e < 2;
                        bool vis = visible(qr_s[ql], qpos_s[ql], top ? ka : kb, top ? kpa : kpb, mk.window);
                        if (!vis) p = 0.f;
                    }
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - d_s[ql]);
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

#define INSTANTIATE(HDP)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_fwd_##HDP(                                  \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, Mask mk, int t, int nh, int nkv,     \
        int hd, float scale) {                                                                                 \
        attn_fwd<HDP>(q, k, v, o, lse, mk, t, nh, nkv, hd, scale);                                             \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_bwd_dq_##HDP(                               \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dq, Mask mk, int t, int nh, int nkv, int hd, float scale) {                                      \
        attn_bwd_dq<HDP>(q, k, v, d_o, lse, dd, dq, mk, t, nh, nkv, hd, scale);                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(NTHREADS) lf_attn_bwd_dkdv_##HDP(                             \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* dd,       \
        bf16* dk, bf16* dv, float* dk_part, float* dv_part, Mask mk, int t, int nh, int nkv, int hd,           \
        float scale) {                                                                                         \
        attn_bwd_dkdv<HDP>(q, k, v, d_o, lse, dd, dk, dv, dk_part, dv_part, mk, t, nh, nkv, hd, scale);        \
    }

INSTANTIATE(16)
INSTANTIATE(32)
INSTANTIATE(64)
INSTANTIATE(96)
INSTANTIATE(128)
