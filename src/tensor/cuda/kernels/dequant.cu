// Dequantisation of frozen base weights from ggml block layouts to bf16, one thread per output
// element. Layouts follow ggml-quants.c (dequantize_row_*): blocks of 32 for Q8_0/Q4_0/Q4_1,
// 256-element super-blocks for Q4_K (144 bytes) and Q6_K (210 bytes).

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

__device__ __forceinline__ float ld_f16(const unsigned char* p) {
    unsigned short b = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(b));
}

extern "C" __global__ void lf_deq_f32(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) y[i] = __float2bfloat16(((const float*)q)[i]);
}
extern "C" __global__ void lf_deq_f16(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) y[i] = __float2bfloat16(ld_f16(q + 2 * i));
}
extern "C" __global__ void lf_deq_bf16(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) y[i] = ((const bf16*)q)[i];
}

// Q8_0: f16 d, 32 x i8.
extern "C" __global__ void lf_deq_q8_0(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) {
        const unsigned char* b = q + (i / 32) * 34;
        y[i] = __float2bfloat16(ld_f16(b) * (float)(signed char)b[2 + i % 32]);
    }
}

// Q4_0: f16 d, 16 bytes; low nibbles are elements 0..15, high nibbles 16..31; (q - 8) * d.
extern "C" __global__ void lf_deq_q4_0(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) {
        const unsigned char* b = q + (i / 32) * 18;
        int j = (int)(i % 32);
        int v = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
        y[i] = __float2bfloat16((float)(v - 8) * ld_f16(b));
    }
}

// Q4_1: f16 d, f16 m, 16 bytes; q * d + m.
extern "C" __global__ void lf_deq_q4_1(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) {
        const unsigned char* b = q + (i / 32) * 20;
        int j = (int)(i % 32);
        int v = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
        y[i] = __float2bfloat16((float)v * ld_f16(b) + ld_f16(b + 2));
    }
}

// Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
extern "C" __global__ void lf_deq_q4_k(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) {
        const unsigned char* b = q + (i / 256) * 144;
        const unsigned char* sc = b + 4;
        const unsigned char* qs = b + 16;
        int e = (int)(i % 256);
        int c = e / 64, w = e % 64, l = w % 32, hi = w / 32;
        int j = 2 * c + hi;
        int s, m;
        if (j < 4) {
            s = sc[j] & 63;
            m = sc[j + 4] & 63;
        } else {
            s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        unsigned char byte = qs[32 * c + l];
        int v = hi ? (byte >> 4) : (byte & 0xF);
        float d = ld_f16(b) * (float)s, mn = ld_f16(b + 2) * (float)m;
        y[i] = __float2bfloat16(d * (float)v - mn);
    }
}

// Q6_K: 128 bytes ql, 64 bytes qh, 16 i8 scales, f16 d.
extern "C" __global__ void lf_deq_q6_k(const unsigned char* q, bf16* y, i64 n) {
    GRID_STRIDE(i, n) {
        const unsigned char* b = q + (i / 256) * 210;
        int e = (int)(i % 256);
        int half = e / 128, w = e % 128, quarter = w / 32, l = w % 32;
        const unsigned char* ql = b + 64 * half;
        const unsigned char* qh = b + 128 + 32 * half;
        const signed char* sc = (const signed char*)(b + 192) + 8 * half;
        unsigned char lo = ql[l + 32 * (quarter & 1)];
        int lov = quarter >= 2 ? (lo >> 4) : (lo & 0xF);
        int hiv = (qh[l] >> (2 * quarter)) & 3;
        int v = (lov | (hiv << 4)) - 32;
        float d = ld_f16(b + 208);
        y[i] = __float2bfloat16(d * (float)sc[l / 16 + 2 * quarter] * (float)v);
    }
}
