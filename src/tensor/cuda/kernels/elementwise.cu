// Elementwise and row-wise ops of the tensor layer (see src/tensor/cpu.rs for the reference
// semantics of each). Grid-stride loops; dtype flags select bf16 or f32 per operand.

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void lf_cast(const void* x, int xdt, void* y, int ydt, i64 n) {
    GRID_STRIDE(i, n) stf(y, ydt, i, ldf(x, xdt, i));
}

extern "C" __global__ void lf_fill_zero_f32(float* y, i64 n) {
    GRID_STRIDE(i, n) y[i] = 0.f;
}

// One block per row.
// y may be stored in another dtype than x (ydt): an f32 residual stream feeding bf16 projections.
// With r (may be null), the row is first summed: sum = x + r is stored in x's dtype (the residual
// add) and normalised as stored. Each thread reads back only the elements it wrote.
extern "C" __global__ void lf_rms_norm(const void* x, int xdt, const void* r, int rdt, void* sum,
                                       const void* w, int wdt, void* y, int ydt, float* rstd, int h,
                                       float eps) {
    i64 row = blockIdx.x;
    const i64 base = row * h;
    const void* src = x;
    if (r) {
        for (int i = threadIdx.x; i < h; i += blockDim.x)
            stf(sum, xdt, base + i, ldf(x, xdt, base + i) + ldf(r, rdt, base + i));
        src = sum;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = ldf(src, xdt, base + i);
        ss += v * v;
    }
    ss = block_sum(ss);
    float s = 1.0f / sqrtf(ss / (float)h + eps);
    if (threadIdx.x == 0) rstd[row] = s;
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        stf(y, ydt, base + i, ldf(src, xdt, base + i) * s * ldf(w, wdt, i));
}

// Four consecutive elements of a dtype-flagged buffer (index in units of 4; 8- or 16-byte aligned).
__device__ __forceinline__ float4 ld4(const void* p, int dt, i64 i4) {
    if (dt) {
        const uint2 u = ((const uint2*)p)[i4];
        const float2 a = __bfloat1622float2(*(const __nv_bfloat162*)&u.x);
        const float2 b = __bfloat1622float2(*(const __nv_bfloat162*)&u.y);
        return make_float4(a.x, a.y, b.x, b.y);
    }
    return ((const float4*)p)[i4];
}
__device__ __forceinline__ void st4(void* p, int dt, i64 i4, float4 v) {
    if (dt) {
        __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
        ((uint2*)p)[i4] = make_uint2(*(u32*)&a, *(u32*)&b);
    } else {
        ((float4*)p)[i4] = v;
    }
}

// lf_rms_norm for rows of h % 4 == 0 and h <= 4 * V * blockDim: 4-wide loads, and the row
// (after the residual add) kept in registers between the sum of squares and the output, where the
// scalar kernel reads it twice. The same arithmetic per element, including the sum rounded to x's
// dtype before it is normalised. V (groups of 4 per thread) is a template constant so that rows
// of h <= 4096 (V = 4) hold only the registers they use.
template <int V>
__device__ __forceinline__ void rms_norm_x4(const void* x, int xdt, const void* r, int rdt, void* sum,
                                            const void* w, int wdt, void* y, int ydt, float* rstd, int h,
                                            float eps) {
    const i64 row = blockIdx.x, n4 = h / 4, base = row * n4;
    float4 v[V];
    float ss = 0.f;
    #pragma unroll
    for (int k = 0; k < V; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = ld4(x, xdt, base + i);
            if (r) {
                const float4 b = ld4(r, rdt, base + i);
                a = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
                st4(sum, xdt, base + i, a);
                if (xdt) a = ld4(sum, xdt, base + i);
            }
            v[k] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    ss = block_sum(ss);
    const float s = 1.0f / sqrtf(ss / (float)h + eps);
    if (threadIdx.x == 0) rstd[row] = s;
    #pragma unroll
    for (int k = 0; k < V; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            const float4 a = v[k], g = ld4(w, wdt, i);
            st4(y, ydt, base + i, make_float4(a.x * s * g.x, a.y * s * g.y, a.z * s * g.z, a.w * s * g.w));
        }
    }
}
#define RMS_NORM_X4(NAME, V)                                                                          \
    extern "C" __global__ void NAME(const void* x, int xdt, const void* r, int rdt, void* sum,        \
                                    const void* w, int wdt, void* y, int ydt, float* rstd, int h,     \
                                    float eps) {                                                      \
        rms_norm_x4<V>(x, xdt, r, rdt, sum, w, wdt, y, ydt, rstd, h, eps);                            \
    }
RMS_NORM_X4(lf_rms_norm_x4, 8)
RMS_NORM_X4(lf_rms_norm_x4v4, 4)

// lf_rms_norm_bwd for the rows rms_norm_x4 serves: dy, x and the added gradient are all loaded
// before the row's reduction, so that the reduction's latency hides the loads of all three.
template <int V>
__device__ __forceinline__ void rms_norm_bwd_x4(const void* dy, int ddt, const void* x, int xdt,
                                                const void* w, int wdt, const float* rstd, const void* add,
                                                int adt, void* dx, void* dxc, int cdt, int h) {
    const i64 row = blockIdx.x, n4 = h / 4, base = row * n4;
    float4 d[V], xv[V], e[V];
    float dot = 0.f;
    #pragma unroll
    for (int k = 0; k < V; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            d[k] = ld4(dy, ddt, base + i);
            xv[k] = ld4(x, xdt, base + i);
            e[k] = add ? ld4(add, adt, base + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            const float4 g = ld4(w, wdt, i);
            dot += d[k].x * g.x * xv[k].x + d[k].y * g.y * xv[k].y + d[k].z * g.z * xv[k].z + d[k].w * g.w * xv[k].w;
        }
    }
    dot = block_sum(dot);
    const float s = rstd[row];
    const float c = s * s * s * dot / (float)h;
    #pragma unroll
    for (int k = 0; k < V; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            const float4 g = ld4(w, wdt, i), a = d[k], b = xv[k], p = e[k];
            // Adding zero when there is no `add` leaves the value unchanged (x + 0 == x).
            const float4 o = make_float4(s * a.x * g.x - c * b.x + p.x, s * a.y * g.y - c * b.y + p.y,
                                         s * a.z * g.z - c * b.z + p.z, s * a.w * g.w - c * b.w + p.w);
            st4(dx, xdt, base + i, o);
            if (dxc) st4(dxc, cdt, base + i, o);
        }
    }
}
#define RMS_NORM_BWD_X4(NAME, V)                                                                      \
    extern "C" __global__ void NAME(const void* dy, int ddt, const void* x, int xdt, const void* w,   \
                                    int wdt, const float* rstd, const void* add, int adt, void* dx,   \
                                    void* dxc, int cdt, int h) {                                      \
        rms_norm_bwd_x4<V>(dy, ddt, x, xdt, w, wdt, rstd, add, adt, dx, dxc, cdt, h);                 \
    }
RMS_NORM_BWD_X4(lf_rms_norm_bwd_x4, 8)
RMS_NORM_BWD_X4(lf_rms_norm_bwd_x4v4, 4)

// dx = s*(dy*w) - s^3/h * x * sum(dy*w*x), plus add (may be null: the residual gradient). dxc
// (may be null): a copy of dx in dtype cdt, the compute-dtype operand of the next projection.
extern "C" __global__ void lf_rms_norm_bwd(const void* dy, int ddt, const void* x, int xdt,
                                           const void* w, int wdt, const float* rstd, const void* add,
                                           int adt, void* dx, void* dxc, int cdt, int h) {
    i64 row = blockIdx.x;
    const i64 base = row * h;
    float dot = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        dot += ldf(dy, ddt, base + i) * ldf(w, wdt, i) * ldf(x, xdt, base + i);
    dot = block_sum(dot);
    float s = rstd[row];
    float c = s * s * s * dot / (float)h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = s * ldf(dy, ddt, base + i) * ldf(w, wdt, i) - c * ldf(x, xdt, base + i);
        if (add) v += ldf(add, adt, base + i);
        stf(dx, xdt, base + i, v);
        if (dxc) stf(dxc, cdt, base + i, v);
    }
}

// Rotate-half RoPE; one thread per (token, head, pair). sign = -1 applies the inverse.
extern "C" __global__ void lf_rope(const void* x, int dt, const float* cosv, const float* sinv, void* y,
                                   i64 t, int nh, int hd, float sign) {
    int half = hd / 2;
    GRID_STRIDE(j, t * nh * half) {
        i64 r = j / (nh * half);
        int rem = (int)(j % (nh * half));
        int h = rem / half, i = rem % half;
        float c = cosv[r * half + i], s = sign * sinv[r * half + i];
        i64 base = r * (i64)nh * hd + (i64)h * hd;
        float a = ldf(x, dt, base + i), b = ldf(x, dt, base + i + half);
        stf(y, dt, base + i, a * c - b * s);
        stf(y, dt, base + i + half, b * c + a * s);
    }
}

// lf_rope on bf16 with an even half: two neighbouring pairs per thread through 4-byte loads.
extern "C" __global__ void lf_rope_bf16x2(const bf16* x, const float* cosv, const float* sinv, bf16* y, i64 t,
                                          int nh, int hd, float sign) {
    const int half = hd / 2, hp = half / 2;
    GRID_STRIDE(j, t * nh * hp) {
        const i64 r = j / (nh * hp);
        const int rem = (int)(j % (nh * hp));
        const int h = rem / hp, i = 2 * (rem % hp);
        const float2 c = *(const float2*)(cosv + r * half + i), sn = *(const float2*)(sinv + r * half + i);
        const float s0 = sign * sn.x, s1 = sign * sn.y;
        const i64 base = r * (i64)nh * hd + (i64)h * hd;
        const float2 a = __bfloat1622float2(*(const __nv_bfloat162*)(x + base + i));
        const float2 b = __bfloat1622float2(*(const __nv_bfloat162*)(x + base + i + half));
        *(__nv_bfloat162*)(y + base + i) = __floats2bfloat162_rn(a.x * c.x - b.x * s0, a.y * c.y - b.y * s1);
        *(__nv_bfloat162*)(y + base + i + half) = __floats2bfloat162_rn(b.x * c.x + a.x * s0, b.y * c.y + a.y * s1);
    }
}

// lf_rope_bf16x2 with 16-byte loads: eight neighbouring pairs per thread (half % 8 == 0, x and
// y 16-byte aligned) and 32-bit index arithmetic (n = t * nh * half / 8 < 2^31). The x2 kernel
// spends three 64-bit divisions on every two pairs. The same arithmetic per element.
extern "C" __global__ void lf_rope_bf16x8(const bf16* x, const float* cosv, const float* sinv, bf16* y, int n,
                                          int nh, int hd, float sign) {
    const int half = hd / 2, hp = half / 8;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        const int r = j / (nh * hp), rem = j - r * (nh * hp);
        const int h = rem / hp, i = 8 * (rem - h * hp);
        const float4* cp = (const float4*)(cosv + (i64)r * half + i);
        const float4* sp = (const float4*)(sinv + (i64)r * half + i);
        const float4 c0 = cp[0], c1 = cp[1], n0 = sp[0], n1 = sp[1];
        const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        const float sn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
        const i64 base = (i64)r * nh * hd + (i64)h * hd;
        const uint4 ua = *(const uint4*)(x + base + i), ub = *(const uint4*)(x + base + i + half);
        const u32 wa[4] = {ua.x, ua.y, ua.z, ua.w}, wb[4] = {ub.x, ub.y, ub.z, ub.w};
        u32 oa[4], ob[4];
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const float2 a = __bfloat1622float2(*(const __nv_bfloat162*)&wa[k]);
            const float2 b = __bfloat1622float2(*(const __nv_bfloat162*)&wb[k]);
            const float s0 = sign * sn[2 * k], s1 = sign * sn[2 * k + 1];
            const float ca = c[2 * k], cb = c[2 * k + 1];
            __nv_bfloat162 ya = __floats2bfloat162_rn(a.x * ca - b.x * s0, a.y * cb - b.y * s1);
            __nv_bfloat162 yb = __floats2bfloat162_rn(b.x * ca + a.x * s0, b.y * cb + a.y * s1);
            oa[k] = *(u32*)&ya;
            ob[k] = *(u32*)&yb;
        }
        *(uint4*)(y + base + i) = make_uint4(oa[0], oa[1], oa[2], oa[3]);
        *(uint4*)(y + base + i + half) = make_uint4(ob[0], ob[1], ob[2], ob[3]);
    }
}

// The gated MLP activations act(gate) * up and their backwards: one generic kernel (any dtypes)
// and one bf16 fast path (8 elements per thread through 16-byte loads; n % 8 == 0, allocations
// are 16-byte aligned) per activation, from one template each. An activation (common.cuh: Silu,
// GeluTanh) gives `fwd(g)` and `grad(d, g, u)`, the (d gate, d up) of one element.
template <class A>
__device__ void gated_mul(const void* g, int gdt, const void* u, int udt, void* y, i64 n) {
    GRID_STRIDE(i, n) stf(y, gdt, i, A::fwd(ldf(g, gdt, i)) * ldf(u, udt, i));
}

template <class A>
__device__ void gated_mul_bwd(const void* dh, int ddt, const void* g, int gdt, const void* u, int udt, void* dg,
                              void* du, i64 n) {
    GRID_STRIDE(i, n) {
        const float2 r = A::grad(ldf(dh, ddt, i), ldf(g, gdt, i), ldf(u, udt, i));
        stf(dg, gdt, i, r.x);
        stf(du, udt, i, r.y);
    }
}

template <class A>
__device__ void gated_mul_bf16x8(const uint4* g, const uint4* u, uint4* y, i64 n8) {
    GRID_STRIDE(i, n8) {
        uint4 gv = g[i], uv = u[i], out;
        const __nv_bfloat162* gp = (const __nv_bfloat162*)&gv;
        const __nv_bfloat162* up = (const __nv_bfloat162*)&uv;
        __nv_bfloat162* op = (__nv_bfloat162*)&out;
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 gf = __bfloat1622float2(gp[j]), uf = __bfloat1622float2(up[j]);
            op[j] = __floats2bfloat162_rn(A::fwd(gf.x) * uf.x, A::fwd(gf.y) * uf.y);
        }
        y[i] = out;
    }
}

template <class A>
__device__ void gated_mul_bwd_bf16x8(const uint4* dh, const uint4* g, const uint4* u, uint4* dg, uint4* du,
                                     i64 n8) {
    GRID_STRIDE(i, n8) {
        uint4 dv = dh[i], gv = g[i], uv = u[i], dgo, duo;
        const __nv_bfloat162* dp = (const __nv_bfloat162*)&dv;
        const __nv_bfloat162* gp = (const __nv_bfloat162*)&gv;
        const __nv_bfloat162* up = (const __nv_bfloat162*)&uv;
        __nv_bfloat162* dgp = (__nv_bfloat162*)&dgo;
        __nv_bfloat162* dup = (__nv_bfloat162*)&duo;
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 d = __bfloat1622float2(dp[j]), gf = __bfloat1622float2(gp[j]),
                         uf = __bfloat1622float2(up[j]);
            const float2 rx = A::grad(d.x, gf.x, uf.x), ry = A::grad(d.y, gf.y, uf.y);
            dgp[j] = __floats2bfloat162_rn(rx.x, ry.x);
            dup[j] = __floats2bfloat162_rn(rx.y, ry.y);
        }
        dg[i] = dgo;
        du[i] = duo;
    }
}

#define GATED_KERNELS(NAME, A)                                                                            \
    extern "C" __global__ void lf_##NAME(const void* g, int gdt, const void* u, int udt, void* y, i64 n) {   \
        gated_mul<A>(g, gdt, u, udt, y, n);                                                                  \
    }                                                                                                        \
    extern "C" __global__ void lf_##NAME##_bwd(const void* dh, int ddt, const void* g, int gdt, const void* u, \
                                               int udt, void* dg, void* du, i64 n) {                          \
        gated_mul_bwd<A>(dh, ddt, g, gdt, u, udt, dg, du, n);                                                 \
    }                                                                                                        \
    extern "C" __global__ void lf_##NAME##_bf16x8(const uint4* g, const uint4* u, uint4* y, i64 n8) {        \
        gated_mul_bf16x8<A>(g, u, y, n8);                                                                    \
    }                                                                                                        \
    extern "C" __global__ void lf_##NAME##_bwd_bf16x8(const uint4* dh, const uint4* g, const uint4* u,        \
                                                      uint4* dg, uint4* du, i64 n8) {                        \
        gated_mul_bwd_bf16x8<A>(dh, g, u, dg, du, n8);                                                       \
    }

GATED_KERNELS(silu_mul, Silu)
GATED_KERNELS(gelu_tanh_mul, GeluTanh)

// act(gate) * up fused with the down projection's LoRA input xa = h Aᵀ (A [r, I], r <= 16):
// h as gated_mul_bf16x8 writes it, bit for bit, and xa from those bf16 h on tensor cores, so
// that h is not read back from memory by a separate product. Block (x, y) of 8 warps takes 16
// rows and the columns of slice y (`slice` wide, a multiple of 32; the last may be narrower):
// warp w takes the slice's 32-column chunks w, w + 8, ... and multiplies them into f32
// accumulators, and the block sums its 8 warps' partials in a fixed order. With one slice that
// sum is xa. With several, each block stores its sum in `part` ([slices][row groups][16 x 16]
// f32), and the last of a row group's blocks to finish (counted in `count`, zero on entry and
// left zero) adds the slices' sums in slice order: the result does not depend on scheduling.
// With h null, only xa is written (a recomputed layer whose h its backward does not read).
// Slices give the card many short blocks, where 16-row blocks over all of I were too few to
// fill it evenly. I % 32 == 0, all bf16.
//
// The product's k order within a 32-column chunk is free (xa is a sum over k), so each thread
// loads 8 contiguous columns of its two rows (16-byte loads) and the B fragments read A in the
// same order: lane (g = lane/4, q = lane%4) holds columns 8q .. 8q+7 of rows g and g + 8; in
// mma step s (0, 1), its k pairs (2q, 2q+1) and (8+2q, 9+2q) are columns 8q+4s+{0,1} and
// 8q+4s+{2,3}, a bijection of the chunk's 32 columns onto the two steps' k.
template <class A>
__device__ void gated_mul_xa(const bf16* g, const bf16* u, const bf16* a, bf16* h, bf16* xa, i64 t, int n,
                             int r, int slice, float* part, unsigned* count) {
    __shared__ float wpart[8][16][16];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, q = lane & 3;
    const i64 row0 = (i64)blockIdx.x * 16;
    const i64 ra = row0 + gq, rb = ra + 8;
    const bool va = ra < t, vb = rb < t;
    const int c_end = min(n, (int)(blockIdx.y + 1) * slice);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = blockIdx.y * slice + warp * 32; c < c_end; c += 8 * 32) {
        const int col = c + 8 * q;
        uint4 hv[2];
        #pragma unroll
        for (int side = 0; side < 2; side++) {
            const bool ok = side ? vb : va;
            const i64 at = (side ? rb : ra) * n + col;
            const uint4 gv = ok ? *(const uint4*)(g + at) : zero, uv = ok ? *(const uint4*)(u + at) : zero;
            const __nv_bfloat162* gp = (const __nv_bfloat162*)&gv;
            const __nv_bfloat162* up = (const __nv_bfloat162*)&uv;
            __nv_bfloat162* op = (__nv_bfloat162*)&hv[side];
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 gf = __bfloat1622float2(gp[j]), uf = __bfloat1622float2(up[j]);
                op[j] = __floats2bfloat162_rn(A::fwd(gf.x) * uf.x, A::fwd(gf.y) * uf.y);
            }
            if (ok && h) *(uint4*)(h + at) = hv[side];
        }
        // B fragments: rank gq (tile 0) and gq + 8 (tile 1), the same 8 columns.
        uint4 bv[2];
        #pragma unroll
        for (int tile = 0; tile < 2; tile++) {
            const int rank = gq + 8 * tile;
            bv[tile] = rank < r ? *(const uint4*)(a + (i64)rank * n + col) : zero;
        }
        #pragma unroll
        for (int s = 0; s < 2; s++) {
            // a0, a2: row ra's k pairs; a1, a3: row rb's (mma.m16n8k16's A fragment order).
            const u32 fa[4] = {s ? hv[0].z : hv[0].x, s ? hv[1].z : hv[1].x, s ? hv[0].w : hv[0].y,
                               s ? hv[1].w : hv[1].y};
            #pragma unroll
            for (int tile = 0; tile < 2; tile++) {
                const u32 b0 = s ? bv[tile].z : bv[tile].x, b1 = s ? bv[tile].w : bv[tile].y;
                mma16816(acc[tile], fa, b0, b1);
            }
        }
    }
    // Accumulator fragment: c0, c1 at (row gq, rank 2q + {0, 1}), c2, c3 at row gq + 8.
    #pragma unroll
    for (int tile = 0; tile < 2; tile++) {
        const int rank = 8 * tile + 2 * q;
        wpart[warp][gq][rank] = acc[tile][0];
        wpart[warp][gq][rank + 1] = acc[tile][1];
        wpart[warp][gq + 8][rank] = acc[tile][2];
        wpart[warp][gq + 8][rank + 1] = acc[tile][3];
    }
    __syncthreads();
    const int rr = threadIdx.x >> 4, rank = threadIdx.x & 15;
    float sum = 0.f;
    #pragma unroll
    for (int w = 0; w < 8; w++) sum += wpart[w][rr][rank];
    const bool out = row0 + rr < t && rank < r;
    const int slices = gridDim.y;
    if (slices == 1) {
        if (out) xa[(row0 + rr) * r + rank] = __float2bfloat16(sum);
        return;
    }
    const i64 groups = gridDim.x;
    part[((i64)blockIdx.y * groups + blockIdx.x) * 256 + threadIdx.x] = sum;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&count[blockIdx.x], 1u) == (unsigned)slices - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    float total = 0.f;
    for (int s = 0; s < slices; s++) total += __ldcg(&part[((i64)s * groups + blockIdx.x) * 256 + threadIdx.x]);
    if (out) xa[(row0 + rr) * r + rank] = __float2bfloat16(total);
    if (threadIdx.x == 0) count[blockIdx.x] = 0;
}

// Backward of act(gate) * up where the down projection's adapter adds its term to d(h):
// d = d_base + dxa A (dxa [T, r], A [r, I], r <= 16) in f32, then (d gate, d up) written over
// gate and up, as gated_mul_bwd_bf16x8 writes them from d. d_base is d(h) through the frozen
// down weight, so that d(h) is never stored with the adapter's term. A block takes 1024
// columns (4 a thread, A's 16 x 4 held in registers) of 32 rows (their dxa in shared memory).
// I % 8 == 0, all bf16.
template <class A>
__device__ void gated_mul_bwd_lora(const bf16* d, const bf16* dxa, const bf16* a, bf16* g, bf16* u, i64 t, int n,
                                   int r) {
    __shared__ float sx[32][16];
    const int col = blockIdx.x * 1024 + threadIdx.x * 4;
    const i64 row0 = (i64)blockIdx.y * 32;
    for (int i = threadIdx.x; i < 32 * 16; i += blockDim.x) {
        const int rr = i >> 4, k = i & 15;
        const i64 row = row0 + rr;
        sx[rr][k] = row < t && k < r ? __bfloat162float(dxa[row * r + k]) : 0.f;
    }
    const bool ok = col < n;
    float av[16][4];
    #pragma unroll
    for (int k = 0; k < 16; k++) {
        float2 lo = make_float2(0.f, 0.f), hi = lo;
        if (ok && k < r) {
            const uint2 w = *(const uint2*)(a + (i64)k * n + col);
            lo = __bfloat1622float2(*(const __nv_bfloat162*)&w.x);
            hi = __bfloat1622float2(*(const __nv_bfloat162*)&w.y);
        }
        av[k][0] = lo.x, av[k][1] = lo.y, av[k][2] = hi.x, av[k][3] = hi.y;
    }
    __syncthreads();
    if (!ok) return;
    // Four rows a step, their loads issued before their arithmetic (memory latency bound).
    for (int r0 = 0; r0 < 32; r0 += 4) {
        uint2 dv[4], gv[4], uv[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const i64 row = row0 + r0 + j, at = row * n + col;
            const bool in = row < t;
            dv[j] = in ? *(const uint2*)(d + at) : make_uint2(0, 0);
            gv[j] = in ? *(const uint2*)(g + at) : make_uint2(0, 0);
            uv[j] = in ? *(const uint2*)(u + at) : make_uint2(0, 0);
        }
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const int rr = r0 + j;
            const i64 row = row0 + rr, at = row * n + col;
            if (row >= t) break;
            float lora[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int k = 0; k < 16; k++) {
                const float x = sx[rr][k];
                #pragma unroll
                for (int e = 0; e < 4; e++) lora[e] = fmaf(x, av[k][e], lora[e]);
            }
            const float2 d0 = __bfloat1622float2(*(const __nv_bfloat162*)&dv[j].x),
                         d1 = __bfloat1622float2(*(const __nv_bfloat162*)&dv[j].y),
                         g0 = __bfloat1622float2(*(const __nv_bfloat162*)&gv[j].x),
                         g1 = __bfloat1622float2(*(const __nv_bfloat162*)&gv[j].y),
                         u0 = __bfloat1622float2(*(const __nv_bfloat162*)&uv[j].x),
                         u1 = __bfloat1622float2(*(const __nv_bfloat162*)&uv[j].y);
            const float2 e0 = A::grad(d0.x + lora[0], g0.x, u0.x), e1 = A::grad(d0.y + lora[1], g0.y, u0.y),
                         e2 = A::grad(d1.x + lora[2], g1.x, u1.x), e3 = A::grad(d1.y + lora[3], g1.y, u1.y);
            *(uint2*)(g + at) = make_uint2(pack_bf16(e0.x, e1.x), pack_bf16(e2.x, e3.x));
            *(uint2*)(u + at) = make_uint2(pack_bf16(e0.y, e1.y), pack_bf16(e2.y, e3.y));
        }
    }
}

extern "C" __global__ void lf_silu_mul_bwd_lora(const bf16* d, const bf16* dxa, const bf16* a, bf16* g, bf16* u,
                                                i64 t, int n, int r) {
    gated_mul_bwd_lora<Silu>(d, dxa, a, g, u, t, n, r);
}
extern "C" __global__ void lf_gelu_tanh_mul_bwd_lora(const bf16* d, const bf16* dxa, const bf16* a, bf16* g,
                                                     bf16* u, i64 t, int n, int r) {
    gated_mul_bwd_lora<GeluTanh>(d, dxa, a, g, u, t, n, r);
}

extern "C" __global__ void lf_silu_mul_xa(const bf16* g, const bf16* u, const bf16* a, bf16* h, bf16* xa, i64 t,
                                          int n, int r, int slice, float* part, unsigned* count) {
    gated_mul_xa<Silu>(g, u, a, h, xa, t, n, r, slice, part, count);
}
extern "C" __global__ void lf_gelu_tanh_mul_xa(const bf16* g, const bf16* u, const bf16* a, bf16* h, bf16* xa,
                                               i64 t, int n, int r, int slice, float* part, unsigned* count) {
    gated_mul_xa<GeluTanh>(g, u, a, h, xa, t, n, r, slice, part, count);
}

// A frozen weight's adapter columns (src/tensor/cuda/gemm.rs, `write_adapter_cols`):
// dst[r, j] = scale · b[r, j - at] for at <= j < at + kb, else 0, over rows x width elements (n);
// rows of dst lie ldd elements apart (dst points at the first adapter column), rows of b ldb.
// scale · b is rounded to dt as lf_pack_k rounds it.
extern "C" __global__ void lf_write_adapter_cols(const void* b, i64 ldb, i64 kb, i64 at, float scale, void* dst,
                                                 i64 ldd, i64 width, i64 n, int dt) {
    GRID_STRIDE(i, n) {
        const i64 r = i / width, j = i % width;
        const bool in_b = j >= at && j < at + kb;
        stf(dst, dt, r * ldd + j, in_b ? __fmul_rn(scale, ldf(b, dt, r * ldb + j - at)) : 0.f);
    }
}

// lf_copy_cols in 16-byte units: every count below is in them (the host checked that the
// columns, starts and row lengths in bytes, and both pointers, are multiples of 16).
extern "C" __global__ void lf_copy_cols_v16(const uint4* src, i64 src_cols, i64 sc0, uint4* dst, i64 dst_cols,
                                            i64 dc0, i64 width, i64 n) {
    GRID_STRIDE(i, n) {
        const i64 r = i / width, j = i % width;
        dst[r * dst_cols + dc0 + j] = src[r * src_cols + sc0 + j];
    }
}

// dst[r, dc0 + j] = src[r, sc0 + j] over rows x width elements (n); one dtype.
extern "C" __global__ void lf_copy_cols(const void* src, i64 src_cols, i64 sc0, void* dst, i64 dst_cols, i64 dc0,
                                        i64 width, i64 n, int dt) {
    GRID_STRIDE(i, n) {
        const i64 r = i / width, j = i % width;
        stf(dst, dt, r * dst_cols + dc0 + j, ldf(src, dt, r * src_cols + sc0 + j));
    }
}

// A K-extended GEMM operand, one row a block (src/tensor/cuda/gemm.rs, `lora_linear_folded`:
// a LoRA projection whose adapter joins the base product's K dimension):
// dst[r, :] = [a[r, 0:ka] | scale · b[r, 0:kb] | 0 …] over kd >= ka + kb columns, one dtype (dt),
// with 1 in column one_at where that is past ka + kb (a bias's column; -1: none); rows of a lie
// lda elements apart, rows of b ldb. a's part moves 16 bytes a thread when vec is set (the host
// checked the pointers, ka, lda and kd for it). scale · b is rounded to dt (exact for scale 1 and
// for the default LoRA scale 2). Grid (rows), any block size.
extern "C" __global__ void lf_pack_k(const void* a, i64 lda, i64 ka, const void* b, i64 ldb, i64 kb,
                                     float scale, void* dst, i64 kd, i64 one_at, int dt, int vec) {
    const i64 row = blockIdx.x;
    if (vec) {
        const i64 es = dt ? 2 : 4;
        const uint4* s = (const uint4*)((const char*)a + row * lda * es);
        uint4* d = (uint4*)((char*)dst + row * kd * es);
        for (i64 i = threadIdx.x; i < ka * es / 16; i += blockDim.x) d[i] = s[i];
    } else {
        for (i64 i = threadIdx.x; i < ka; i += blockDim.x)
            stf(dst, dt, row * kd + i, ldf(a, dt, row * lda + i));
    }
    for (i64 j = threadIdx.x; j < kd - ka; j += blockDim.x) {
        const float v = j < kb ? __fmul_rn(scale, ldf(b, dt, row * ldb + j)) : (ka + j == one_at ? 1.f : 0.f);
        stf(dst, dt, row * kd + ka + j, v);
    }
}

// c = a + alpha * b; c may be a (add_assign).
extern "C" __global__ void lf_add(const void* a, int adt, const void* b, int bdt, void* c, int cdt, float alpha,
                                  i64 n) {
    GRID_STRIDE(i, n) stf(c, cdt, i, ldf(a, adt, i) + alpha * ldf(b, bdt, i));
}

extern "C" __global__ void lf_add_bias(void* x, int xdt, const void* b, int bdt, i64 n, i64 cols) {
    GRID_STRIDE(i, n) stf(x, xdt, i, ldf(x, xdt, i) + ldf(b, bdt, i % cols));
}

extern "C" __global__ void lf_scale_rows(void* x, int dt, const float* s, i64 n, i64 cols) {
    GRID_STRIDE(i, n) stf(x, dt, i, ldf(x, dt, i) * s[i / cols]);
}

extern "C" __global__ void lf_scale(void* x, int dt, float s, i64 n) {
    GRID_STRIDE(i, n) stf(x, dt, i, ldf(x, dt, i) * s);
}

extern "C" __global__ void lf_gather_rows(const void* x, int dt, const u32* idx, void* y, i64 rows, i64 cols) {
    GRID_STRIDE(i, rows * cols) {
        i64 r = i / cols, c = i % cols;
        stf(y, dt, i, ldf(x, dt, (i64)idx[r] * cols + c));
    }
}

// dst[idx[r], :] += src[r, :] (atomics: indices may repeat).
extern "C" __global__ void lf_scatter_add_rows(void* dst, int ddt, const u32* idx, const void* src, int sdt,
                                               i64 rows, i64 cols) {
    GRID_STRIDE(i, rows * cols) {
        i64 r = i / cols, c = i % cols;
        i64 o = (i64)idx[r] * cols + c;
        float v = ldf(src, sdt, i);
        if (ddt) atomicAdd(&((bf16*)dst)[o], __float2bfloat16(v));
        else atomicAdd(&((float*)dst)[o], v);
    }
}

// Bit-for-bit the host's `tensor::dropout_keep`.
__device__ __forceinline__ bool dropout_keep(u64 seed, u64 index, float p) {
    u64 h = seed ^ (index * 0x9E3779B97F4A7C15ull);
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return ((float)(h >> 40)) * (1.0f / 16777216.0f) >= p;
}

extern "C" __global__ void lf_dropout(const void* x, int dt, void* y, i64 n, float p, u64 seed, float keep_scale) {
    GRID_STRIDE(i, n) stf(y, dt, i, dropout_keep(seed, (u64)i, p) ? ldf(x, dt, i) * keep_scale : 0.f);
}

// Writes the sum of the block's per-thread f64 partials to partials[blockIdx.x]; lf_sum_in_order
// then adds the blocks' sums in block order. No atomics: the same inputs give the same bits on
// every run, so a resumed run recomputes the same grad norm (and the same clip).
__device__ void block_sum_partial(double acc, double* partials) {
    __shared__ double red[32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) red[w] = acc;
    __syncthreads();
    if (w == 0) {
        acc = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) partials[blockIdx.x] = acc;
    }
}

// out[0] = Σ partials[0..n), added in order by one thread (n is at most a few thousand blocks).
extern "C" __global__ void lf_sum_in_order(const double* partials, int n, double* out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        double s = 0.0;
        for (int i = 0; i < n; ++i) s += partials[i];
        out[0] = s;
    }
}

// Sums of squares in f64, one partial per block (added in order by lf_sum_in_order).
extern "C" __global__ void lf_sum_sq(const void* x, int dt, i64 n, double* partials) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)ldf(x, dt, i);
        acc += v * v;
    }
    block_sum_partial(acc, partials);
}

// AdamW on f32 masters, mirroring the CPU reference's f32/f64 mix exactly.
extern "C" __global__ void lf_adamw(float* p, const void* g, int gdt, float* m, float* v, i64 n, float lr,
                                    float b1, float b2, float eps, float wd, float grad_scale, double bc1,
                                    double bc2) {
    GRID_STRIDE(i, n) {
        float gi = ldf(g, gdt, i) * grad_scale;
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        double mhat = (double)mi / bc1, vhat = (double)vi / bc2;
        float pi = p[i] * (1.f - lr * wd);
        pi -= (float)((double)lr * mhat / (sqrt(vhat) + (double)eps));
        p[i] = pi;
    }
}

// The online (max, sum of exp) of one element into a thread's running pair.
__device__ __forceinline__ void lse_push(float x, float& m, float& s) {
    if (x > m) {
        s = s * expf(m - x) + 1.f;
        m = x;
    } else {
        s += expf(x - m);
    }
}

// The online pair over four elements: one rescale for their max, then four exps.
__device__ __forceinline__ void lse_push4(float4 x, float& m, float& s) {
    const float mx = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
    if (mx > m) {
        s *= expf(m - mx);
        m = mx;
    }
    s += expf(x.x - m) + expf(x.y - m) + expf(x.z - m) + expf(x.w - m);
}

// One block per row: the online max and sum over the vocabulary, then log p(target) and the
// row's log-sum-exp. With `vec` (v % 4 == 0 and the
// logits 16-byte aligned) every thread keeps two 4-wide loads in flight: one scalar load a
// thread left the kernel bound by load latency at about 40% of the H100's bandwidth.
extern "C" __global__ void lf_logsoftmax_gather(const void* logits, int dt, const u32* targets, float* logp,
                                                float* lse_out, i64 v, int vec) {
    i64 row = blockIdx.x;
    const i64 base = row * v;
    float m = -LF_INF, s = 0.f;
    if (vec) {
        const i64 n4 = v >> 2, b4 = base >> 2, step = blockDim.x;
        i64 j = threadIdx.x;
        for (; j + step < n4; j += 2 * step) {
            const float4 a = ld4(logits, dt, b4 + j), b = ld4(logits, dt, b4 + j + step);
            lse_push4(a, m, s);
            lse_push4(b, m, s);
        }
        if (j < n4) lse_push4(ld4(logits, dt, b4 + j), m, s);
    } else {
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) lse_push(ldf(logits, dt, base + j), m, s);
    }
    // Combine (m, s) pairs across the warp, then across warps.
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        float mm = fmaxf(m, m2);
        s = (mm == -LF_INF) ? 0.f : s * expf(m - mm) + s2 * expf(m2 - mm);
        m = mm;
    }
    __shared__ float sm[32], ss[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sm[w] = m; ss[w] = s; }
    __syncthreads();
    if (w == 0) {
        m = lane < nw ? sm[lane] : -LF_INF;
        s = lane < nw ? ss[lane] : 0.f;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            float mm = fmaxf(m, m2);
            s = (mm == -LF_INF) ? 0.f : s * expf(m - mm) + s2 * expf(m2 - mm);
            m = mm;
        }
        if (lane == 0) {
            float lse = m + logf(s);
            lse_out[row] = lse;
            u32 t = targets[row];
            logp[row] = (t == 0xffffffffu) ? 0.f : ldf(logits, dt, base + t) - lse;
        }
    }
}

// dlogits = dlogp * (onehot(target) - softmax); zero for ignored rows. grid.x = row, grid.y
// splits the vocabulary. With `vec` (v % 4 == 0, logits and output aligned for 4-wide access)
// each thread moves four elements a load.
extern "C" __global__ void lf_logsoftmax_gather_bwd(const float* dlogp, const void* logits, int dt,
                                                    const float* lse, const u32* targets, void* dl, int odt,
                                                    i64 v, int vec) {
    i64 row = blockIdx.x;
    u32 t = targets[row];
    float g = dlogp[row], l = lse[row];
    const i64 base = row * v;
    if (vec) {
        const i64 n4 = v >> 2, b4 = base >> 2;
        for (i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x; j < n4; j += (i64)gridDim.y * blockDim.x) {
            float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t != 0xffffffffu) {
                const float4 x = ld4(logits, dt, b4 + j);
                d = make_float4(-g * expf(x.x - l), -g * expf(x.y - l), -g * expf(x.z - l), -g * expf(x.w - l));
                const i64 k = (i64)t - 4 * j;
                if (k == 0) d.x += g;
                if (k == 1) d.y += g;
                if (k == 2) d.z += g;
                if (k == 3) d.w += g;
            }
            st4(dl, odt, b4 + j, d);
        }
        return;
    }
    for (i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x; j < v; j += (i64)gridDim.y * blockDim.x) {
        float d = 0.f;
        if (t != 0xffffffffu) {
            d = -g * expf(ldf(logits, dt, base + j) - l);
            if (j == (i64)t) d += g;
        }
        stf(dl, odt, base + j, d);
    }
}

// Softcap in place: x = cap * tanh(x / cap).
extern "C" __global__ void lf_softcap(void* x, int dt, float cap, i64 n) {
    const float inv = 1.f / cap;
    GRID_STRIDE(i, n) stf(x, dt, i, cap * tanhf(ldf(x, dt, i) * inv));
}

// lf_logsoftmax_gather_bwd through a softcap: logits hold y = cap * tanh(z / cap) and
// dz = dlogp * (onehot(target) - softmax(y)) * (1 - (y / cap)^2); zero for ignored rows. Same grid.
extern "C" __global__ void lf_logsoftmax_gather_softcap_bwd(const float* dlogp, const void* logits, int dt,
                                                            const float* lse, const u32* targets, void* dl,
                                                            int odt, float cap, i64 v) {
    i64 row = blockIdx.x;
    u32 t = targets[row];
    float g = dlogp[row], l = lse[row];
    const float inv = 1.f / cap;
    const i64 base = row * v;
    for (i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x; j < v; j += (i64)gridDim.y * blockDim.x) {
        float d = 0.f;
        if (t != 0xffffffffu) {
            const float y = ldf(logits, dt, base + j), th = y * inv;
            d = g * ((j == (i64)t ? 1.f : 0.f) - expf(y - l)) * ((1.f - th) * (1.f + th));
        }
        stf(dl, odt, base + j, d);
    }
}

// ------------------------------------------------------------------------------------------------
// Multi-tensor ops: one launch over every element of a list of tensors (the optimiser step runs
// over hundreds of small LoRA matrices). The host uploads a table with one entry per non-empty
// tensor; each tensor is cut into chunks of `chunk` elements, entry k owning the chunks
// [chunk0[k], chunk0[k+1]). Blocks stride over the chunks and find a chunk's tensor by binary
// search over chunk0 (a few cached, warp-uniform loads per chunk of a few thousand elements), so
// any mix of sizes keeps every block busy and no block straddles two tensors.

// The layouts mirror the host's tables in src/tensor/cuda/mod.rs (8-byte words, little-endian).
struct SqSeg {
    const void* x;
    i64 n, chunk0;
    int dt, pad;
};
static_assert(sizeof(SqSeg) == 32, "SqSeg layout");

struct AdamwSeg {
    float* p;
    void* g;       // zeroed after the update
    float* m;
    float* v;
    void* pc;      // compute-dtype copy of p, written after the update; null for none
    i64 n, chunk0;
    float lr;
    int gdt, pcdt, pad;
};
static_assert(sizeof(AdamwSeg) == 72, "AdamwSeg layout");

struct CastSeg {
    const void* x;
    void* y;
    i64 n, chunk0;
    int xdt, ydt;
};
static_assert(sizeof(CastSeg) == 40, "CastSeg layout");

// The entry owning chunk c: the last k with segs[k].chunk0 <= c (entries are non-empty, so
// chunk0 is strictly increasing).
template <typename S>
__device__ __forceinline__ int seg_of(const S* segs, int ns, i64 c) {
    int lo = 0, hi = ns - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (segs[mid].chunk0 <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Sum of squares of every tensor, one f64 partial per block, as lf_sum_sq.
extern "C" __global__ void lf_sum_sq_multi(const SqSeg* segs, int ns, i64 n_chunks, int chunk,
                                           double* partials) {
    double acc = 0.0;
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const SqSeg s = segs[seg_of(segs, ns, c)];
        const i64 begin = (c - s.chunk0) * chunk, end = min(begin + chunk, s.n);
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            double v = (double)ldf(s.x, s.dt, i);
            acc += v * v;
        }
    }
    block_sum_partial(acc, partials);
}

// AdamW over every tensor with its own lr and shared hyperparameters: per element exactly
// lf_adamw's arithmetic; then, in the same pass, the updated parameter goes to its compute copy
// (bf16 for the forward) and the gradient is zeroed for the next accumulation.
// With `sum_sq` (the gradients' squared norm on the device), the multiplier is clip_scale's:
// average · min(1, max_norm / norm), norm = sqrt(sum_sq) · average, in f64 as on the host.
extern "C" __global__ void lf_adamw_multi(const AdamwSeg* segs, int ns, i64 n_chunks, int chunk,
                                          float b1, float b2, float eps, float wd, float grad_scale,
                                          double bc1, double bc2, const double* sum_sq, double average,
                                          double max_norm) {
    if (sum_sq) {
        const double norm = sqrt(*sum_sq) * average;
        const double clip = (max_norm > 0.0 && norm > max_norm) ? max_norm / norm : 1.0;
        grad_scale = (float)(average * clip);
    }
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const AdamwSeg s = segs[seg_of(segs, ns, c)];
        const i64 begin = (c - s.chunk0) * chunk, end = min(begin + chunk, s.n);
        const float lr = s.lr;
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            float gi = ldf(s.g, s.gdt, i) * grad_scale;
            float mi = b1 * s.m[i] + (1.f - b1) * gi;
            float vi = b2 * s.v[i] + (1.f - b2) * gi * gi;
            s.m[i] = mi;
            s.v[i] = vi;
            double mhat = (double)mi / bc1, vhat = (double)vi / bc2;
            float pi = s.p[i] * (1.f - lr * wd);
            pi -= (float)((double)lr * mhat / (sqrt(vhat) + (double)eps));
            s.p[i] = pi;
            if (s.pc) stf(s.pc, s.pcdt, i, pi);
            stf(s.g, s.gdt, i, 0.f);
        }
    }
}

struct AdapterColsSeg {
    const void* b;
    void* dst;
    i64 ldd, r, at, width, n, chunk0;
    float scale;
    int dt;
};
static_assert(sizeof(AdapterColsSeg) == 72, "AdapterColsSeg layout");

// lf_write_adapter_cols for every entry in one launch (the adapters of a whole model after an
// optimiser step): dst[row, j] = scale · b[row, j - at] for at <= j < at + r, else 0, over
// rows x width elements (n); dst points at the weight's first adapter column.
extern "C" __global__ void lf_write_adapter_cols_multi(const AdapterColsSeg* segs, int ns, i64 n_chunks,
                                                       int chunk) {
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const AdapterColsSeg s = segs[seg_of(segs, ns, c)];
        const i64 begin = (c - s.chunk0) * chunk, end = min(begin + chunk, s.n);
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const i64 row = i / s.width, j = i % s.width;
            const bool in_b = j >= s.at && j < s.at + s.r;
            const float v = in_b ? __fmul_rn(s.scale, ldf(s.b, s.dt, row * s.r + j - s.at)) : 0.f;
            stf(s.dst, s.dt, row * s.ldd + j, v);
        }
    }
}

// y_k = x_k converted to y_k's dtype, for every pair (refreshing compute copies in place).
extern "C" __global__ void lf_cast_multi(const CastSeg* segs, int ns, i64 n_chunks, int chunk) {
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const CastSeg s = segs[seg_of(segs, ns, c)];
        const i64 begin = (c - s.chunk0) * chunk, end = min(begin + chunk, s.n);
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x)
            stf(s.y, s.ydt, i, ldf(s.x, s.xdt, i));
    }
}

// Random normal values, the draws of `model::weights::random_normal` (the CPU's): element i is
// draw i mod 2^16 of chunk i >> 16, whose SplitMix64 generator starts at seed ^ chunk * K. A
// SplitMix64 state only ever adds its increment, so draw j reads the outputs of states
// start + (2j + 1) G and start + (2j + 2) G; Box-Muller in f64, as the CPU's `Rng::normal`.
__device__ __forceinline__ u64 lf_splitmix_out(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
extern "C" __global__ void lf_random_normal(void* y, int ydt, i64 n, u64 seed, float std_dev) {
    const u64 G = 0x9E3779B97F4A7C15ull;
    GRID_STRIDE(i, n) {
        u64 chunk = (u64)i >> 16, j = (u64)i & 0xffffull;
        u64 start = seed ^ (chunk * 0xA24BAED4963EE407ull);
        u64 a = lf_splitmix_out(start + (2 * j + 1) * G);
        u64 b = lf_splitmix_out(start + (2 * j + 2) * G);
        double u1 = fmax((double)(a >> 11) * (1.0 / 9007199254740992.0), 1e-300);
        double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
        double r = sqrt(-2.0 * log(u1)) * cos(2.0 * 3.141592653589793 * u2);
        stf(y, ydt, i, (float)r * std_dev);
    }
}

// The tail of a LoRA projection whose two products are summed in f32 and rounded once
// (src/model/layer.rs, linear_fwd): y = base + scale · xa bᵀ, stored in ydt. base is the base
// GEMM's f32 output [rows, out]; xa [rows, r] (ldxa elements between rows) and b [out, r] are the
// adapter's input product and B. r = 0 stores base alone (cuBLAS has already added the term).
// The rank-r dot is an f32 sum of exact bf16 × bf16 products; the scale multiplies it and the
// sum is then added, each rounded to f32 (no fused multiply-add), the order of cuBLAS's
// alpha · acc + beta · C. 256 threads, one output column each, LR_ROWS rows a block; grid
// (ceil(out / 256), ceil(rows / LR_ROWS)). Each thread's B column sits in shared memory as
// bs[k][thread] (conflict-free), xa's rows are read as broadcasts, four ranks a load (one
// shared-memory load per 32 multiply-adds would otherwise bound the kernel, not the bytes).
// The kernel moves 6 bytes an element (f32 in, bf16 out): its LR_ROWS loads of base are issued
// first, all at once, so that they are in flight while B and xa are staged and the dots run.
// Loaded in the store loop, one at a time (32 rows a block), they kept about one load a warp in
// flight and the kernel ran at about a fifth of the card's bandwidth (17 ms of a 115 ms qwen1.5b
// step). 16 rows a block keep the registers at 72, without spills: three blocks an SM.
#define LR_COLS 256
#define LR_ROWS 16  // LORA_ROUND_ROWS in gemm.rs
#define LR_K 32
extern "C" __global__ void __launch_bounds__(LR_COLS)
lf_lora_round_once(const float* base, const void* xa, int xadt, i64 ldxa, const void* b, int bdt,
                   float scale, void* y, int ydt, i64 rows, i64 out, int r) {
    __shared__ float bs[LR_K][LR_COLS];
    __shared__ __align__(16) float xs[LR_ROWS][LR_K];
    const int t = threadIdx.x;
    const i64 col = (i64)blockIdx.x * LR_COLS + t, r0 = (i64)blockIdx.y * LR_ROWS;
    float acc[LR_ROWS], bv[LR_ROWS];
    #pragma unroll
    for (int i = 0; i < LR_ROWS; i++) {
        acc[i] = 0.f;
        bv[i] = col < out && r0 + i < rows ? base[(r0 + i) * out + col] : 0.f;
    }
    for (int k0 = 0; k0 < r; k0 += LR_K) {
        // A chunk of kc ranks, zero-padded to kc4 (a multiple of 4) so that xa's rows are read
        // four ranks at a time (one broadcast 16-byte load); the zeros add exact zeros.
        const int kc = min(LR_K, r - k0), kc4 = (kc + 3) & ~3;
        __syncthreads();  // the previous chunk's reads are done
        for (int k = 0; k < kc4; k++)
            bs[k][t] = k < kc && col < out ? ldf(b, bdt, col * r + k0 + k) : 0.f;
        for (int j = t; j < LR_ROWS * kc4; j += LR_COLS) {
            const int i = j / kc4, k = j % kc4;
            xs[i][k] = k < kc && r0 + i < rows ? ldf(xa, xadt, (r0 + i) * ldxa + k0 + k) : 0.f;
        }
        __syncthreads();
        for (int k = 0; k < kc4; k += 4) {
            const float b0 = bs[k][t], b1 = bs[k + 1][t], b2 = bs[k + 2][t], b3 = bs[k + 3][t];
            #pragma unroll
            for (int i = 0; i < LR_ROWS; i++) {
                const float4 a = *(const float4*)&xs[i][k];
                acc[i] = fmaf(a.x, b0, acc[i]);
                acc[i] = fmaf(a.y, b1, acc[i]);
                acc[i] = fmaf(a.z, b2, acc[i]);
                acc[i] = fmaf(a.w, b3, acc[i]);
            }
        }
    }
    if (col >= out) return;
    #pragma unroll
    for (int i = 0; i < LR_ROWS; i++) {
        const i64 row = r0 + i;
        if (row < rows) {
            const i64 at = row * out + col;
            stf(y, ydt, at, r ? __fadd_rn(bv[i], __fmul_rn(scale, acc[i])) : bv[i]);
        }
    }
}
