// kvtier's codec kernels: quantize, dequantize and transcode batches of KV blocks that live in
// pool tensors, addressed by slot indices (gather from source slots, write destination slots).
// One launch handles a whole batch, never one block.
//
// Compiled at run time by NVRTC through CuPy (python/kvtier/_cuda.py); the source ships
// inside the extension module (crates/kvtier-py embeds it with include_str!). The loader puts
// kernels/kvtier_common.cuh (the integer types, the fp16/bf16 conversions and the F16/BF16/F32
// element types) before this file's text, so NVRTC needs no include path.
//
// A float pool is [slots, L, 2, H, B, D] in the model dtype (K then V, per layer). A packed
// pool is [slots, row_bytes] uint8; every quantized codec writes the same sections, at byte
// offsets the host computes from python/kvtier/codecs/quant.py (one source of truth):
//   codes    [L, 2, H, B, D * bits / 8]  two's complement (symmetric) or unsigned codes
//                                       (asymmetric) of 8, 4 or 2 bits; 8 / bits codes a byte
//                                       along D, low bits first: element per*i + j at bits
//                                       bits*j .. bits*j + bits-1 of byte i (4-bit: even d in
//                                       the low nibble; 2-bit: d = 4i + j at bits 2j, 2j + 1)
//   k_scale  [L, H, Gk] fp16, k_zero (asymmetric only), v_scale [L, H, Gv], v_zero
// Keys are grouped per channel along the block's tokens (Gk = D) or per token like values
// (groups of `group` values along D: Gv = B * D / group).
//
// Rounding rule, the same in the torch reference (python/kvtier/codecs/quant.py) so that codes
// are bit-exact and scales equal after fp16 rounding. Every step is one IEEE fp32 operation
// (the __f*_rn intrinsics are never contracted into FMAs):
//   symmetric:  s = fp16(amax * (1/qmax));            q = rint(x / s'),       clamp [-qmax, qmax]
//   asymmetric: s = fp16((max - min) * (1/levels));  z = fp16(min);
//                                                     q = rint((x - z) / s'), clamp [0, levels]
//   qmax 127, 7, 1 and levels 255, 15, 3 for 8, 4, 2 bits; 1/qmax and 1/levels are fp32 constants.
//   s' = s where s > 0, else 1; fp16() rounds to nearest even after clamping to +-65504.
//   decode: x = q * s (+ z), then rounded to the output dtype (nearest even).

// ---- fp16 rounding (the conversions are in kernels/kvtier_common.cuh) -------------------

__device__ __forceinline__ float fp16_round(float x) {
    return half_to_float(float_to_half(fminf(fmaxf(x, -65504.0f), 65504.0f)));
}

// ---- a packed format ---------------------------------------------------------------------

// The host passes a format as 11 int64s (python/kvtier/codecs/layout.py, `layout`); a rotated
// one's signs come with the launch (`rotation`, D floats of ±1).
struct Layout {
    int bits, asym, key_per_channel, group, rotated;
    i64 codes, k_scale, k_zero, v_scale, v_zero, row_bytes;
};

__device__ __forceinline__ Layout read_layout(const i64* p) {
    Layout f;
    f.bits = (int)p[0];
    f.asym = (int)p[1];
    f.key_per_channel = (int)p[2];
    f.group = (int)p[3];
    f.codes = p[4];
    f.k_scale = p[5];
    f.k_zero = p[6];
    f.v_scale = p[7];
    f.v_zero = p[8];
    f.row_bytes = p[9];
    f.rotated = (int)p[10];
    return f;
}

// Groups in one (layer, kv, head) tile of B tokens x D channels.
__device__ __forceinline__ int tile_groups(const Layout& f, int kv, int B, int D) {
    return (kv == 0 && f.key_per_channel) ? D : B * (D / f.group);
}

__device__ __forceinline__ int group_of(const Layout& f, int kv, int b, int d, int D) {
    return (kv == 0 && f.key_per_channel) ? d : b * (D / f.group) + d / f.group;
}

// Where a tile's scales and zero points start, in fp16 elements from the row start.
__device__ __forceinline__ i64 scale_index(const Layout& f, int kv, int l, int h, int H, int groups) {
    return ((kv == 0 ? f.k_scale : f.v_scale) >> 1) + ((i64)l * H + h) * groups;
}
__device__ __forceinline__ i64 zero_index(const Layout& f, int kv, int l, int h, int H, int groups) {
    return ((kv == 0 ? f.k_zero : f.v_zero) >> 1) + ((i64)l * H + h) * groups;
}

__device__ __forceinline__ float qmax_sym(int bits) {
    return bits == 8 ? 127.0f : bits == 4 ? 7.0f : 1.0f;
}
__device__ __forceinline__ float levels_asym(int bits) {
    return bits == 8 ? 255.0f : bits == 4 ? 15.0f : 3.0f;
}
__device__ __forceinline__ float inv_qmax_sym(int bits) {
    return bits == 8 ? 1.0f / 127.0f : bits == 4 ? 1.0f / 7.0f : 1.0f;
}
__device__ __forceinline__ float inv_levels_asym(int bits) {
    return bits == 8 ? 1.0f / 255.0f : bits == 4 ? 1.0f / 15.0f : 1.0f / 3.0f;
}

// The integer code of element d of tile row b, as a float: field d % per_byte of the row's
// byte d / per_byte, sign-extended when symmetric.
__device__ __forceinline__ float read_code(const u8* codes, const Layout& f, int b, int d, int D) {
    if (f.bits == 8) {
        u8 c = codes[(i64)b * D + d];
        return f.asym ? (float)c : (float)(signed char)c;
    }
    const int per_byte = 8 / f.bits, sign = 1 << (f.bits - 1);  // D is a multiple of per_byte
    const u8 c = codes[((i64)b * D + d) / per_byte];
    const int field = (c >> (f.bits * (d % per_byte))) & ((1 << f.bits) - 1);
    return f.asym ? (float)field : (float)((field ^ sign) - sign);
}

__device__ __forceinline__ float dequantize(float q, float s, float z, int asym) {
    float x = __fmul_rn(q, s);
    return asym ? __fadd_rn(x, z) : x;
}

// ---- the quantizing tile: a CUDA block quantizes one (slot, layer, kv, head) tile ---------

// Shared memory: the tile as fp32 with rows padded to D + 1 (no bank conflicts whether a
// group runs along a row or down a column), then the scale and zero point of each group.
__device__ void quantize_tile(float* tile, const Layout& f, u8* row, int l, int kv, int h,
                              int H, int B, int D) {
    const int stride = D + 1;
    const int groups = tile_groups(f, kv, B, D);
    float* scales = tile + B * stride;
    float* zeros = scales + groups;
    const bool per_channel = kv == 0 && f.key_per_channel;
    const int size = per_channel ? B : f.group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u16* row16 = (u16*)row;
    const i64 si = scale_index(f, kv, l, h, H, groups), zi = zero_index(f, kv, l, h, H, groups);

    // One warp per group: min and max (exact, so the reduction order does not matter).
    for (int g = warp; g < groups; g += warps) {
        const int base = per_channel ? g : (g / (D / f.group)) * stride + (g % (D / f.group)) * f.group;
        const int step = per_channel ? stride : 1;
        float mn = __int_as_float(0x7f800000), mx = -mn;  // +inf, -inf
        for (int j = lane; j < size; j += 32) {
            float x = tile[base + j * step];
            mn = fminf(mn, x);
            mx = fmaxf(mx, x);
        }
        for (int o = 16; o > 0; o >>= 1) {
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        }
        if (lane == 0) {
            float s, z = 0.0f;
            if (f.asym) {
                s = fp16_round(__fmul_rn(__fsub_rn(mx, mn), inv_levels_asym(f.bits)));
                z = fp16_round(mn);
                row16[zi + g] = float_to_half(z);
            } else {
                s = fp16_round(__fmul_rn(fmaxf(fabsf(mn), fabsf(mx)), inv_qmax_sym(f.bits)));
            }
            row16[si + g] = float_to_half(s);
            scales[g] = s;
            zeros[g] = z;
        }
    }
    __syncthreads();

    // Codes, one output byte per thread step: coalesced writes.
    const int per_byte = 8 / f.bits;
    const unsigned mask = (1u << f.bits) - 1u;
    const int n_bytes = B * D / per_byte;
    const float lo = f.asym ? 0.0f : -qmax_sym(f.bits);
    const float hi = f.asym ? levels_asym(f.bits) : qmax_sym(f.bits);
    u8* codes = row + f.codes + (i64)((l * 2 + kv) * H + h) * n_bytes;
    for (int e = threadIdx.x; e < n_bytes; e += blockDim.x) {
        unsigned byte = 0;
        for (int k = 0; k < per_byte; ++k) {
            const int flat = e * per_byte + k, b = flat / D, d = flat % D;
            const int g = group_of(f, kv, b, d, D);
            const float s = scales[g] > 0.0f ? scales[g] : 1.0f;
            const float x = f.asym ? __fsub_rn(tile[b * stride + d], zeros[g]) : tile[b * stride + d];
            const int q = (int)fminf(fmaxf(rintf(__fdiv_rn(x, s)), lo), hi);
            byte |= ((unsigned)q & mask) << (f.bits * k);
        }
        codes[e] = (u8)byte;
    }
}

__device__ __forceinline__ void tile_coords(i64 tile, int L, int H, i64* i, int* l, int* kv, int* h) {
    const int per_block = L * 2 * H;
    *i = tile / per_block;
    int t = (int)(tile % per_block);
    *h = t % H;
    t /= H;
    *kv = t % 2;
    *l = t / 2;
}

// Float pool -> packed pool. Grid: n * L * 2 * H blocks; dynamic shared memory from the host.
template <class In>
__device__ void quantize_blocks(const typename In::T* src, const i64* src_slots, u8* dst,
                                const i64* dst_slots, const i64* layout, const float* rotation,
                                int L, int H, int B, int D) {
    extern __shared__ float smem[];
    const Layout f = read_layout(layout);
    i64 i;
    int l, kv, h;
    tile_coords(blockIdx.x, L, H, &i, &l, &kv, &h);
    const i64 block_elems = (i64)L * 2 * H * B * D;
    const typename In::T* in = src + src_slots[i] * block_elems + (i64)((l * 2 + kv) * H + h) * B * D;
    for (int e = threadIdx.x; e < B * D; e += blockDim.x) smem[(e / D) * (D + 1) + e % D] = In::load(in[e]);
    __syncthreads();
    if (f.rotated) rotate_rows(smem, B, D + 1, D, rotation);
    quantize_tile(smem, f, dst + dst_slots[i] * f.row_bytes, l, kv, h, H, B, D);
}

// Packed pool -> float pool, one thread per code byte.
template <class Out>
__device__ void dequantize_blocks(const u8* src, const i64* src_slots, typename Out::T* dst,
                                  const i64* dst_slots, const i64* layout, i64 n, int L, int H,
                                  int B, int D) {
    const Layout f = read_layout(layout);
    const int per_byte = 8 / f.bits;
    const i64 tile_bytes = (i64)B * D / per_byte, block_bytes = (i64)L * 2 * H * tile_bytes;
    const i64 block_elems = (i64)L * 2 * H * B * D;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n * block_bytes;
         e += (i64)gridDim.x * blockDim.x) {
        const i64 i = e / block_bytes, within = e % block_bytes;
        const int tile = (int)(within / tile_bytes), byte = (int)(within % tile_bytes);
        const int h = tile % H, kv = (tile / H) % 2, l = tile / (2 * H);
        const u8* row = src + src_slots[i] * f.row_bytes;
        const u16* row16 = (const u16*)row;
        const u8* codes = row + f.codes + (i64)tile * tile_bytes;
        const int groups = tile_groups(f, kv, B, D);
        const i64 si = scale_index(f, kv, l, h, H, groups), zi = zero_index(f, kv, l, h, H, groups);
        typename Out::T* out = dst + dst_slots[i] * block_elems + (i64)tile * B * D;
        for (int k = 0; k < per_byte; ++k) {
            const int flat = byte * per_byte + k, b = flat / D, d = flat % D;
            const int g = group_of(f, kv, b, d, D);
            const float s = half_to_float(row16[si + g]);
            const float z = f.asym ? half_to_float(row16[zi + g]) : 0.0f;
            out[flat] = Out::store_finite(dequantize(read_code(codes, f, b, d, D), s, z, f.asym));
        }
    }
}

// A tile of a packed row -> fp32 in shared memory (rows padded to D + 1).
__device__ void dequantize_tile(const u8* row, const Layout& f, int l, int kv, int h, int H,
                                int B, int D, float* smem) {
    const u16* row16 = (const u16*)row;
    const int tile = (l * 2 + kv) * H + h;
    const u8* codes = row + f.codes + (i64)tile * B * D / (8 / f.bits);
    const int groups = tile_groups(f, kv, B, D);
    const i64 si = scale_index(f, kv, l, h, H, groups), zi = zero_index(f, kv, l, h, H, groups);
    for (int e = threadIdx.x; e < B * D; e += blockDim.x) {
        const int b = e / D, d = e % D, g = group_of(f, kv, b, d, D);
        const float s = half_to_float(row16[si + g]);
        const float z = f.asym ? half_to_float(row16[zi + g]) : 0.0f;
        smem[b * (D + 1) + d] = dequantize(read_code(codes, f, b, d, D), s, z, f.asym);
    }
    __syncthreads();
}

// Packed pool of a rotated format -> float pool: a CUDA block per (slot, layer, kv, head) tile,
// decoded and turned back in shared memory. Grid: n * L * 2 * H blocks.
template <class Out>
__device__ void dequantize_rotated_blocks(const u8* src, const i64* src_slots,
                                          typename Out::T* dst, const i64* dst_slots,
                                          const i64* layout, const float* rotation, int L, int H,
                                          int B, int D) {
    extern __shared__ float smem[];
    const Layout f = read_layout(layout);
    i64 i;
    int l, kv, h;
    tile_coords(blockIdx.x, L, H, &i, &l, &kv, &h);
    dequantize_tile(src + src_slots[i] * f.row_bytes, f, l, kv, h, H, B, D, smem);
    unrotate_rows(smem, B, D + 1, D, rotation);
    const i64 block_elems = (i64)L * 2 * H * B * D;
    typename Out::T* out = dst + dst_slots[i] * block_elems + (i64)((l * 2 + kv) * H + h) * B * D;
    for (int e = threadIdx.x; e < B * D; e += blockDim.x)
        out[e] = Out::store_finite(smem[(e / D) * (D + 1) + e % D]);
}

// Packed pool (one format) -> packed pool (another), dequantized in shared memory only.
__device__ void transcode_blocks(const u8* src, const i64* src_slots, const i64* src_layout,
                                 u8* dst, const i64* dst_slots, const i64* dst_layout,
                                 const float* rotation, int L, int H, int B, int D) {
    extern __shared__ float smem[];
    const Layout from = read_layout(src_layout), to = read_layout(dst_layout);
    i64 i;
    int l, kv, h;
    tile_coords(blockIdx.x, L, H, &i, &l, &kv, &h);
    dequantize_tile(src + src_slots[i] * from.row_bytes, from, l, kv, h, H, B, D, smem);
    if (from.rotated) unrotate_rows(smem, B, D + 1, D, rotation);
    if (to.rotated) rotate_rows(smem, B, D + 1, D, rotation);
    quantize_tile(smem, to, dst + dst_slots[i] * to.row_bytes, l, kv, h, H, B, D);
}

// ---- entry points (extern "C": plain names for CuPy) --------------------------------------

#define KVTIER_FLOAT_KERNELS(SUFFIX, TYPE)                                                      \
    extern "C" __global__ void kvtier_quantize_##SUFFIX(                                        \
        const TYPE::T* src, const i64* src_slots, u8* dst, const i64* dst_slots,                \
        const i64* layout, const float* rotation, int L, int H, int B, int D) {                 \
        quantize_blocks<TYPE>(src, src_slots, dst, dst_slots, layout, rotation, L, H, B, D);    \
    }                                                                                           \
    extern "C" __global__ void kvtier_dequantize_##SUFFIX(                                      \
        const u8* src, const i64* src_slots, TYPE::T* dst, const i64* dst_slots,                \
        const i64* layout, i64 n, int L, int H, int B, int D) {                                 \
        dequantize_blocks<TYPE>(src, src_slots, dst, dst_slots, layout, n, L, H, B, D);         \
    }                                                                                           \
    extern "C" __global__ void kvtier_dequantize_rotated_##SUFFIX(                              \
        const u8* src, const i64* src_slots, TYPE::T* dst, const i64* dst_slots,                \
        const i64* layout, const float* rotation, int L, int H, int B, int D) {                 \
        dequantize_rotated_blocks<TYPE>(src, src_slots, dst, dst_slots, layout, rotation, L, H, \
                                        B, D);                                                  \
    }

KVTIER_FLOAT_KERNELS(f16, F16)
KVTIER_FLOAT_KERNELS(bf16, BF16)
KVTIER_FLOAT_KERNELS(f32, F32)

extern "C" __global__ void kvtier_transcode(const u8* src, const i64* src_slots,
                                            const i64* src_layout, u8* dst, const i64* dst_slots,
                                            const i64* dst_layout, const float* rotation, int L,
                                            int H, int B, int D) {
    transcode_blocks(src, src_slots, src_layout, dst, dst_slots, dst_layout, rotation, L, H, B,
                     D);
}
