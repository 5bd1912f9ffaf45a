// Shared prelude of every lorafit kernel module: bf16/f32 loads and stores selected by a runtime
// dtype flag (0 = f32, 1 = bf16), and warp/block reductions. Prepended to each module's source.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef __nv_bfloat16 bf16;

#define LF_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float ldf(const void* p, int dt, i64 i) {
    return dt ? __bfloat162float(((const bf16*)p)[i]) : ((const float*)p)[i];
}
__device__ __forceinline__ void stf(void* p, int dt, i64 i, float v) {
    if (dt) ((bf16*)p)[i] = __float2bfloat16(v);
    else ((float*)p)[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.f;
    return warp_sum(r);
}

// Tensor-core helpers shared by the attention and fused cross-entropy kernels.
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// D = A (16x16 bf16, row) x B (16x8 bf16, col) + D, f32 accumulators.
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

// The gated MLP activations act(gate) * up of elementwise.cu and mlp_grads.cu: `fwd(g)` and
// `grad(d, g, u)`, the (d gate, d up) of one element.
struct Silu {
    static __device__ __forceinline__ float fwd(float g) { return g / (1.f + expf(-g)); }
    static __device__ __forceinline__ float2 grad(float d, float g, float u) {
        const float sig = 1.f / (1.f + expf(-g));
        return make_float2(d * u * (sig * (1.f + g * (1.f - sig))), d * g * sig);
    }
};

// transformers' gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#define LF_GELU_K 0.7978845608028654f
#define LF_GELU_A 0.044715f
struct GeluTanh {
    static __device__ __forceinline__ float fwd(float x) {
        return 0.5f * x * (1.f + tanhf(LF_GELU_K * x * (1.f + LF_GELU_A * x * x)));
    }
    static __device__ __forceinline__ float2 grad(float d, float x, float u) {
        const float x2 = x * x, t = tanhf(LF_GELU_K * x * (1.f + LF_GELU_A * x2));
        const float y = 0.5f * x * (1.f + t);
        const float dy = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * LF_GELU_K * (1.f + 3.f * LF_GELU_A * x2);
        return make_float2(d * u * dy, d * y);
    }
};
