// Incremental decoding over a KV cache: attention of a few query rows, each over its own range of
// cached key rows, and the row writes that put new keys and values into the cache. Host side:
// ../decode.rs; CPU reference: cpu::decode_attention and cpu::copy_rows_into.

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

#define DEC_WARPS 4

// One block per (query row, head), DEC_WARPS warps splitting the query's keys; each warp keeps
// an online softmax over its keys (a lane holds dims lane, lane+32, ..., MAXD of them: head_dim
// up to 32 * MAXD), then the warps merge. q [nq, nh*hd], k and v [nk, nkv*hd] in dtype `dt`;
// ranges [nq][2]: the query's keys [start, end); o [nq, nh*hd] in dtype `odt` (zero for an empty
// range). softcap <= 0: none.
template <int MAXD>
__device__ void dec_attention(const void* q, const void* k, const void* v, int dt,
                              const u32* ranges, void* o, int odt, int nh, int nkv, int hd,
                              float scale, float softcap) {
    int qi = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int kvh = h / (nh / nkv);
    i64 qw = (i64)nh * hd, kw = (i64)nkv * hd;
    float qr[MAXD];
    #pragma unroll
    for (int i = 0; i < MAXD; i++) {
        int d = lane + 32 * i;
        qr[i] = d < hd ? ldf(q, dt, qi * qw + (i64)h * hd + d) : 0.f;
    }
    u32 start = ranges[2 * qi], end = ranges[2 * qi + 1];
    float m = -LF_INF, l = 0.f;
    float acc[MAXD];
    #pragma unroll
    for (int i = 0; i < MAXD; i++) acc[i] = 0.f;
    for (u32 j = start + w; j < end; j += DEC_WARPS) {
        i64 base = (i64)j * kw + (i64)kvh * hd;
        float s = 0.f;
        #pragma unroll
        for (int i = 0; i < MAXD; i++) {
            int d = lane + 32 * i;
            if (d < hd) s += qr[i] * ldf(k, dt, base + d);
        }
        s = warp_sum(s) * scale;
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        // s is finite, so mn is too and the first key's correction exp(-inf) is 0.
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        #pragma unroll
        for (int i = 0; i < MAXD; i++) {
            int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * corr + p * ldf(v, dt, base + d);
        }
        m = mn;
    }
    __shared__ float sm[DEC_WARPS], sl[DEC_WARPS];
    __shared__ float sacc[DEC_WARPS][32 * MAXD];
    if (lane == 0) {
        sm[w] = m;
        sl[w] = l;
    }
    #pragma unroll
    for (int i = 0; i < MAXD; i++) sacc[w][lane + 32 * i] = acc[i];
    __syncthreads();
    float mx = -LF_INF;
    for (int ww = 0; ww < DEC_WARPS; ww++) mx = fmaxf(mx, sm[ww]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float ls = 0.f, a = 0.f;
        for (int ww = 0; ww < DEC_WARPS; ww++) {
            if (sl[ww] > 0.f) {
                float c = expf(sm[ww] - mx);
                ls += sl[ww] * c;
                a += sacc[ww][d] * c;
            }
        }
        stf(o, odt, qi * qw + (i64)h * hd + d, ls > 0.f ? a / ls : 0.f);
    }
}

// head_dim up to 256.
extern "C" __global__ void lf_dec_attention(const void* q, const void* k, const void* v, int dt,
                                            const u32* ranges, void* o, int odt, int nh, int nkv,
                                            int hd, float scale, float softcap) {
    dec_attention<8>(q, k, v, dt, ranges, o, odt, nh, nkv, hd, scale, softcap);
}

// head_dim up to 512 (Gemma 4's full layers).
extern "C" __global__ void lf_dec_attention_512(const void* q, const void* k, const void* v,
                                                int dt, const u32* ranges, void* o, int odt,
                                                int nh, int nkv, int hd, float scale,
                                                float softcap) {
    dec_attention<16>(q, k, v, dt, ranges, o, odt, nh, nkv, hd, scale, softcap);
}

// dst[idx[r], :] = src[r, :] (distinct indices).
extern "C" __global__ void lf_dec_copy_rows(void* dst, int ddt, const u32* idx, const void* src,
                                            int sdt, i64 rows, i64 cols) {
    GRID_STRIDE(i, rows * cols) {
        i64 r = i / cols, c = i % cols;
        stf(dst, ddt, (i64)idx[r] * cols + c, ldf(src, sdt, i));
    }
}
