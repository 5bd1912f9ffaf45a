// The MLP backward with the LoRA gradients that read its (T, I) tensors (src/tensor/cuda/
// elementwise.rs, `gated_mul_bwd_lora_grads`): lf_mlpg_silu and lf_mlpg_gelu_tanh, and
// lf_mlpg_finish, which adds their row groups' sums into the gradients. The activations (Silu,
// GeluTanh) and the mma helpers come from common.cuh.

// An 8x8 b16 matrix held as mma fragments (lane g = lane/4, q = lane%4: row g, columns 2q, 2q+1)
// turned into its transpose in the same layout: the lane then holds (rows 2q, 2q+1; column g).
__device__ __forceinline__ u32 transpose8x8(u32 v) {
    u32 t;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(t) : "r"(v));
    return t;
}

// Rows row0 .. row0 + 15 and ranks 0 .. 15 of a row-major bf16 matrix of `r` ranks (row length
// ld; ranks >= r and rows >= t read as 0) as an mma A fragment (m = row, k = rank). r is even.
__device__ __forceinline__ void rank_rows_fragment(const bf16* v, int ld, int r, i64 row0, i64 t, int gq, int q,
                                                   u32* f) {
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        const i64 row = row0 + gq + (i & 1) * 8;
        const int k = 2 * q + (i >> 1) * 8;
        f[i] = row < t && k < r ? *(const u32*)(v + row * ld + k) : 0u;
    }
}

// The backward of act(gate) * up (as elementwise.cu's gated_mul_bwd_lora: d = d_base + dxa A in
// f32, (d gate, d up) written over gate and up) with the three LoRA gradients that read its (T, I)
// tensors, summed on tensor cores from the values in registers instead of by products that read
// them again from memory:
//   dA_down += dxaᵀ h      (h = act(gate) * up rounded to bf16 as the forward stored it)
//   dB_gate += s_g (d gate)ᵀ xa_gate     dB_up += s_u (d up)ᵀ xa_up   (the bf16 values written)
// so the forward's h need not be kept for the backward. Warp w of block (x, y) takes columns
// [32 (4x + w), +32) over row group y's 16-row steps. Lane (g = lane/4, q = lane%4) loads
// columns 8q .. 8q + 7 of the warp's 32 in rows g and g + 8 of a step (one 16-byte load a row and
// tensor); as mma fragments they are n-tiles j = 0..3, tile j's columns 2q, 2q + 1 being the lane's
// columns 8q + 2j, 8q + 2j + 1 (a column's sums are its own, so their order inside a warp is
// free). The lora term comes from an mma of dxa's rows with A's columns; each 8x8 block of
// results is transposed in registers (movmatrix) into the B fragment (k = row, n = column) of
// the sums, whose A fragment is a vector's 16 rows transposed (m = rank, k = row). Each block
// writes its row group's sums to `part` ([groups][3][16][I] f32: dA_down, dB_gate, dB_up by rank
// and column); lf_mlpg_finish adds the groups in order. I % 32 == 0, ranks even and at
// most 16, all bf16.
template <class A>
__device__ void gated_mul_bwd_lora_grads(const bf16* d, const bf16* dxa, int ldx, int rd, const bf16* a,
                                         bf16* g, bf16* u, const bf16* xg, int ldg, int rg, const bf16* xu,
                                         int ldu, int ru, float* part, i64 t, int n, int steps_per_group) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, q = lane & 3;
    const int col0 = (blockIdx.x * 4 + warp) * 32;
    if (col0 >= n) return;
    const int mycol = col0 + 8 * q;
    // A's B fragments (k = rank, n = column) for the lora term: tile j's column gq is the warp's
    // column 8 (gq / 2) + 2j + gq % 2.
    u32 bl[4][2];
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        const int c = col0 + 8 * (gq >> 1) + 2 * j + (gq & 1);
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const int k = 2 * q + 8 * h;
            const bf16 lo = k < rd ? a[(i64)k * n + c] : __float2bfloat16(0.f);
            const bf16 hi = k + 1 < rd ? a[(i64)(k + 1) * n + c] : __float2bfloat16(0.f);
            __nv_bfloat162 v = __halves2bfloat162(lo, hi);
            bl[j][h] = *(u32*)&v;
        }
    }
    float acc[3][4][4];
    #pragma unroll
    for (int x = 0; x < 3; x++)
        #pragma unroll
        for (int j = 0; j < 4; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) acc[x][j][e] = 0.f;
    const i64 steps = (t + 15) / 16;
    const i64 s0 = (i64)blockIdx.y * steps_per_group, s1 = min(steps, s0 + steps_per_group);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (i64 s = s0; s < s1; s++) {
        const i64 row0 = s * 16;
        uint4 dv[2], gv[2], uv[2];
        #pragma unroll
        for (int side = 0; side < 2; side++) {
            const i64 row = row0 + gq + 8 * side, at = row * n + mycol;
            const bool in = row < t;
            dv[side] = in ? *(const uint4*)(d + at) : zero;
            gv[side] = in ? *(const uint4*)(g + at) : zero;
            uv[side] = in ? *(const uint4*)(u + at) : zero;
        }
        u32 fx[4], fg[4], fu[4];
        rank_rows_fragment(dxa, ldx, rd, row0, t, gq, q, fx);
        rank_rows_fragment(xg, ldg, rg, row0, t, gq, q, fg);
        rank_rows_fragment(xu, ldu, ru, row0, t, gq, q, fu);
        // lora[j]: (row gq, columns 2q, 2q + 1 of tile j) in 0, 1 and row gq + 8 in 2, 3.
        float lora[4][4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            lora[j][0] = lora[j][1] = lora[j][2] = lora[j][3] = 0.f;
            mma16816(lora[j], fx, bl[j][0], bl[j][1]);
        }
        // (h, d gate, d up) as bf16 pairs by side and tile: the lane's columns 8q + 2j, + 1.
        u32 hp[2][4], dgp[2][4], dup[2][4];
        #pragma unroll
        for (int side = 0; side < 2; side++) {
            const u32* dw = (const u32*)&dv[side];
            const u32* gw = (const u32*)&gv[side];
            const u32* uw = (const u32*)&uv[side];
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 df = __bfloat1622float2(*(const __nv_bfloat162*)&dw[j]),
                             gf = __bfloat1622float2(*(const __nv_bfloat162*)&gw[j]),
                             uf = __bfloat1622float2(*(const __nv_bfloat162*)&uw[j]);
                const float2 e0 = A::grad(df.x + lora[j][2 * side], gf.x, uf.x),
                             e1 = A::grad(df.y + lora[j][2 * side + 1], gf.y, uf.y);
                dgp[side][j] = pack_bf16(e0.x, e1.x);
                dup[side][j] = pack_bf16(e0.y, e1.y);
                hp[side][j] = pack_bf16(A::fwd(gf.x) * uf.x, A::fwd(gf.y) * uf.y);
            }
            const i64 row = row0 + gq + 8 * side, at = row * n + mycol;
            if (row < t) {
                *(uint4*)(g + at) = make_uint4(dgp[side][0], dgp[side][1], dgp[side][2], dgp[side][3]);
                *(uint4*)(u + at) = make_uint4(dup[side][0], dup[side][1], dup[side][2], dup[side][3]);
            }
        }
        // The vectors' transposes (m = rank, k = row): blocks (rows 0-7 | 8-15) x (ranks 0-7 | 8-15).
        const u32 tx[4] = {transpose8x8(fx[0]), transpose8x8(fx[2]), transpose8x8(fx[1]), transpose8x8(fx[3])};
        const u32 tg[4] = {transpose8x8(fg[0]), transpose8x8(fg[2]), transpose8x8(fg[1]), transpose8x8(fg[3])};
        const u32 tu[4] = {transpose8x8(fu[0]), transpose8x8(fu[2]), transpose8x8(fu[1]), transpose8x8(fu[3])};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            mma16816(acc[0][j], tx, transpose8x8(hp[0][j]), transpose8x8(hp[1][j]));
            mma16816(acc[1][j], tg, transpose8x8(dgp[0][j]), transpose8x8(dgp[1][j]));
            mma16816(acc[2][j], tu, transpose8x8(dup[0][j]), transpose8x8(dup[1][j]));
        }
    }
    // acc[x][j]: (rank gq, tile j's columns 2q, 2q + 1) in 0, 1 and rank gq + 8 in 2, 3.
    #pragma unroll
    for (int x = 0; x < 3; x++) {
        float* px = part + ((i64)blockIdx.y * 3 + x) * 16 * n;
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = mycol + 2 * j;
            *(float2*)(px + (i64)gq * n + c) = make_float2(acc[x][j][0], acc[x][j][1]);
            *(float2*)(px + (i64)(gq + 8) * n + c) = make_float2(acc[x][j][2], acc[x][j][3]);
        }
    }
}

// The row groups' sums of gated_mul_bwd_lora_grads added in group order into the gradients:
// dA_down [rd, I] += sum, dB_gate [I, rg] += s_g sum, dB_up [I, ru] += s_u sum. One thread per
// (sum, rank, column).
extern "C" __global__ void lf_mlpg_finish(const float* part, int groups, int n, float* dad, int rd, float* dbg,
                                          int rg, float sg, float* dbu, int ru, float su) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)3 * 16 * n) return;
    const int x = (int)(i / (16 * (i64)n)), k = (int)((i / n) % 16), c = (int)(i % n);
    const int r = x == 0 ? rd : x == 1 ? rg : ru;
    if (k >= r) return;
    float sum = 0.f;
    for (int grp = 0; grp < groups; grp++) sum += part[(((i64)grp * 3 + x) * 16 + k) * n + c];
    if (x == 0) dad[(i64)k * n + c] += sum;
    else if (x == 1) dbg[(i64)c * rg + k] += sg * sum;
    else dbu[(i64)c * ru + k] += su * sum;
}

extern "C" __global__ void lf_mlpg_silu(const bf16* d, const bf16* dxa, int ldx, int rd, const bf16* a, bf16* g,
                                        bf16* u, const bf16* xg, int ldg, int rg, const bf16* xu, int ldu, int ru,
                                        float* part, i64 t, int n, int steps_per_group) {
    gated_mul_bwd_lora_grads<Silu>(d, dxa, ldx, rd, a, g, u, xg, ldg, rg, xu, ldu, ru, part, t, n, steps_per_group);
}
extern "C" __global__ void lf_mlpg_gelu_tanh(const bf16* d, const bf16* dxa, int ldx, int rd, const bf16* a,
                                             bf16* g, bf16* u, const bf16* xg, int ldg, int rg, const bf16* xu,
                                             int ldu, int ru, float* part, i64 t, int n, int steps_per_group) {
    gated_mul_bwd_lora_grads<GeluTanh>(d, dxa, ldx, rd, a, g, u, xg, ldg, rg, xu, ldu, ru, part, t, n,
                                       steps_per_group);
}
