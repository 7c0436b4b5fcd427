// What every kvtier kernel file shares: integer types and the fp16/bf16 <-> fp32 conversions.
//
// NVRTC compiles each kernel file as one string with no include path, so nothing here is
// #included: the loader (python/kvtier/_cuda.py, kernel_source) puts this text before
// each kernel file's, and the extension ships it beside them (crates/kvtier-py embeds it with
// include_str!). No CUDA header is used, so fp16 and bf16 are converted by hand: the PTX cvt
// instructions for fp16, bit shifts for bf16 (rounding to nearest even, NaN as torch writes it).

typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ u16 float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as torch writes it
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
    return (u16)(u >> 16);
}

// A kernel templated on its I/O dtype reads and writes elements through one of these.
struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return half_to_float(v); }
    static __device__ __forceinline__ T store(float f) { return float_to_half(f); }
    // Decoded values saturate at fp16's largest rather than overflow to inf (as the reference).
    static __device__ __forceinline__ T store_finite(float f) {
        return float_to_half(fminf(fmaxf(f, -65504.0f), 65504.0f));
    }
};
struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T v) { return bf16_to_float(v); }
    static __device__ __forceinline__ T store(float f) { return float_to_bf16(f); }
    static __device__ __forceinline__ T store_finite(float f) { return store(f); }
};
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float f) { return f; }
    static __device__ __forceinline__ T store_finite(float f) { return f; }
};

// ---- the rotation of rotated formats -----------------------------------------------------
// H = S diag(signs), S Sylvester's D x D matrix (D a power of two): a rotated format stores each
// head vector x as x @ H / D and decodes y @ H^T, in the order python/kvtier/codecs/quant.py and
// crates/kvtier-attend/src/rotation.rs take (butterflies h = 1, 2, 4 ... apart, then the signs;
// zeros +0), each step one IEEE fp32 operation. Rows of shared memory, every thread of the CTA
// calling.

// Sylvester's transform of `rows` rows of D floats, `stride` floats apart.
__device__ void walsh_hadamard_rows(float* x, int rows, int stride, int D) {
    const int half = D >> 1;
    for (int h = 1; h < D; h <<= 1) {
        for (int e = threadIdx.x; e < rows * half; e += blockDim.x) {
            const int t = e / half, p = e % half;
            float* pair = x + t * stride + (p / h) * 2 * h + p % h;
            const float a = pair[0], b = pair[h];
            pair[0] = __fadd_rn(a, b);
            pair[h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
}

// x <- x @ H / D: a value as a rotated format stores it.
__device__ void rotate_rows(float* x, int rows, int stride, int D, const float* signs) {
    walsh_hadamard_rows(x, rows, stride, D);
    const float over_d = 1.0f / (float)D;  // exact: D is a power of two
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
        float* v = x + (e / D) * stride + e % D;
        *v = __fadd_rn(__fmul_rn(*v, __fmul_rn(signs[e % D], over_d)), 0.0f);
    }
    __syncthreads();
}

// x <- x @ H^T, clamped to fp16's range: a stored value back, as the codecs decode it.
__device__ void unrotate_rows(float* x, int rows, int stride, int D, const float* signs) {
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
        float* v = x + (e / D) * stride + e % D;
        *v = __fmul_rn(*v, signs[e % D]);
    }
    __syncthreads();
    walsh_hadamard_rows(x, rows, stride, D);
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
        float* v = x + (e / D) * stride + e % D;
        *v = __fadd_rn(fminf(fmaxf(*v, -65504.0f), 65504.0f), 0.0f);
    }
    __syncthreads();
}
