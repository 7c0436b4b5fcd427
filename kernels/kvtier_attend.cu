// kvtier's attention kernel: the attention output of the newest queries of S sequences at one
// layer, computed straight over their K/V blocks where they lie in the pools (float pools read
// as they are, int8/int4/int2 pools dequantized in registers a tile at a time, rotated ones
// turned back in shared memory by kvtier_common.cuh's unrotate_rows), without gathering the cache or decoding it to a full-precision
// copy. The contract, the pool layouts, the 16
// int64s that describe a pool and the torch reference it must match are in
// python/kvtier/attend/call.py; the launches are in python/kvtier/attend/cuda.py.
//
// Compiled at run time by NVRTC through CuPy, after kernels/kvtier_common.cuh (the integer
// types, the fp16/bf16 conversions and the F16/BF16/F32 element types), which the loader puts
// before this file's text: NVRTC needs no include path.
//
// Two launches per call (per layer per batch):
//
//   kvtier_attend_<q dtype>   grid (S * Hkv, splits, row tiles), ATTEND_THREADS threads.
//       One CTA per (sequence, K/V head, split of the block table, tile of <= MAX_ROWS rows),
//       where a row is one (query, query head) pair of the head's GQA group: rows r = i * G + g
//       (query i, head hk * G + g), so every K/V byte of a split is read once for all G * Q
//       rows (once per row tile when G * Q > MAX_ROWS, i.e. for long prefills). The CTA walks
//       its blocks a tile of T tokens (T / B blocks) at a time: K and V dequantized to fp32 in
//       shared memory, scores in the log2 domain, an online softmax (running max m and sum l
//       per row), the output accumulated in fp32 in shared memory. It writes, per row, its
//       split's log2-sum-exp (part_lse) and output (to `out` directly when there is one split,
//       else normalised fp32 to part_out), and per (block, row) the block's log2-sum-exp of
//       scores (blse, -inf for a block the row does not see) for the mass.
//
//   kvtier_attend_combine_<q dtype>   grid (mass CTAs + out CTAs, S), COMBINE_THREADS threads.
//       Mass CTAs: each row's final log2-sum-exp over splits, then each block's mass
//       sum_rows 2^(blse - LSE) / (Hq * Q). Out CTAs (only with splits > 1): flash-decoding's
//       combine, out = sum_splits 2^(lse_split - LSE) * part_out, in q's dtype.
//
// Why two launches: a block's mass is its probability under each row's *final* softmax, which
// is known only once every split of the row is done. One launch would need a grid-wide
// dependency (a last-CTA-done counter with fences); the second launch is a few microseconds and
// keeps both kernels free of atomics.
//
// Shared memory of the main kernel (dynamic, floats; the host sizes it the same way):
//   q rows [RT][D] | acc [RT][D] | K tile [T][D + 1] (padded: the score loop reads down the
//   token axis, one token per lane, without bank conflicts) | V tile [T][D] | p [RT][T]

typedef unsigned long long u64;

#define ATTEND_THREADS 128
#define COMBINE_THREADS 256
#define MAX_ROWS 16         // rows (query, head pairs) of one CTA: the host never asks for more
#define MAX_TILE_BLOCKS 8   // blocks in one tile of T tokens
#define MASS_BLOCKS 32      // blocks one combine CTA sums the mass of (4 per warp)
#define ROW_CHUNK 1024      // rows whose final log2-sum-exp a combine CTA holds at a time

// The pool descriptor's fields (python/kvtier/attend/call.py, DESC_FIELDS).
#define DESC_KIND 0
#define DESC_DTYPE_OR_BITS 1
#define DESC_FLAGS 2
#define DESC_PTR 3
#define DESC_ROW_BYTES 5
#define DESC_LAYER_OVERRIDE 7
#define DESC_GROUP 8
#define DESC_CODES 9
#define DESC_K_SCALE 10
#define DESC_K_ZERO 11
#define DESC_V_SCALE 12
#define DESC_V_ZERO 13
#define DESC_INTS 16
#define KIND_FLOAT 0
#define FLAG_ASYMMETRIC 1
#define FLAG_KEY_PER_CHANNEL 2
#define FLAG_ROTATED 4

// ---- small helpers (the conversions are in kernels/kvtier_common.cuh) ---------------------

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// 16 bytes, for vector loads of float pools.
struct alignas(16) Word4 {
    unsigned w[4];
};

// ---- one block of a tile: where its bytes lie and how to read them ------------------------

struct BlockRef {
    const u8* row;        // the slot's row; null: the block is not read (skipped, or not seen)
    i64 codes;            // quant: byte offsets of the sections within the row
    i64 scale[2], zero[2];
    int kind, dtype_or_bits, flags, group;
    int layer;            // the layer read (the call's, or the pool's override)
    int valid_tokens;     // tokens of the block the sequence holds (B but for its last block)
};

// One (layer, kv, head) [B, D] tile of a float pool row -> fp32 rows of `stride` floats in
// shared memory. Tokens past `valid_tokens` are stored as 0: the pool's bytes there may be
// anything (NaN included), and 0 * NaN would poison the P.V sum.
__device__ void load_float_tile(const BlockRef& r, int kv, int hk, int H, int B, int D,
                                float* dst, int stride) {
    const int esize = r.dtype_or_bits == 0 ? 4 : 2;
    const u8* src = r.row + ((i64)(r.layer * 2 + kv) * H + hk) * B * D * esize;
    const int n = B * D, valid = r.valid_tokens * D;
    if (((u64)src & 15) == 0) {
        // 16-byte loads: 4 or 8 elements of one token (D is a multiple of 8)
        const int per = 16 / esize;
        for (int u = threadIdx.x; u < n / per; u += blockDim.x) {
            const int e = u * per, b = e / D, d = e % D;
            float* out = dst + b * stride + d;
            if (e >= valid) {
                for (int k = 0; k < per; ++k) out[k] = 0.0f;
                continue;
            }
            const Word4 w = ((const Word4*)src)[u];
            if (esize == 4) {
#pragma unroll
                for (int k = 0; k < 4; ++k) out[k] = __uint_as_float(w.w[k]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const u16 h = (u16)(w.w[k >> 1] >> ((k & 1) * 16));  // little-endian
                    out[k] = r.dtype_or_bits == 1 ? half_to_float(h) : bf16_to_float(h);
                }
            }
        }
        return;
    }
    for (int e = threadIdx.x; e < n; e += blockDim.x) {  // a pool view not 16-byte aligned
        float x = 0.0f;
        if (e < valid) {
            if (esize == 4) x = ((const float*)src)[e];
            else if (r.dtype_or_bits == 1) x = half_to_float(((const u16*)src)[e]);
            else x = bf16_to_float(((const u16*)src)[e]);
        }
        dst[(e / D) * stride + e % D] = x;
    }
}

// One (layer, kv, head) tile of a QuantCodec row -> fp32 in shared memory, decoded as
// kernels/kvtier_codecs.cu decodes (q * s, then + z, each one fp32 operation). Each thread
// takes a word of codes at a time, values of one token (D is a multiple of 8): 4 bytes (4 int8
// or 8 int4 values), or 2 bytes of int2 (8 values; 4 bytes would cross a token where D is not
// a multiple of 16).
__device__ void load_quant_tile(const BlockRef& r, int kv, int hk, int H, int B, int D,
                                float* dst, int stride) {
    const int bits = r.dtype_or_bits;  // 2, 4 or 8: codes low bits first in each byte
    const int tile_bytes = B * D * bits / 8;
    const u8* codes = r.row + r.codes + ((i64)(r.layer * 2 + kv) * H + hk) * tile_bytes;
    const bool per_channel = kv == 0 && (r.flags & FLAG_KEY_PER_CHANNEL);
    const bool asym = (r.flags & FLAG_ASYMMETRIC) != 0;
    const int per_row = D / r.group;  // groups along one token when grouped per token
    const int groups = per_channel ? D : B * per_row;
    const i64 first = ((i64)r.layer * H + hk) * groups;
    const u16* scales = (const u16*)(r.row + r.scale[kv]) + first;
    const u16* zeros = (const u16*)(r.row + r.zero[kv]) + first;  // read only when asymmetric
    const int word_bytes = bits == 2 ? 2 : 4;
    const int per_word = 8 * word_bytes / bits;
    const unsigned mask = (1u << bits) - 1u, sign = 1u << (bits - 1);
    const int valid = r.valid_tokens * D;
    const bool aligned = ((u64)codes & (word_bytes - 1)) == 0;
    for (int u = threadIdx.x; u < B * D / per_word; u += blockDim.x) {
        const int e = u * per_word, b = e / D, d0 = e % D;
        float* out = dst + b * stride + d0;
        if (e >= valid) {
            for (int k = 0; k < per_word; ++k) out[k] = 0.0f;
            continue;
        }
        const u8* w = codes + (i64)word_bytes * u;
        unsigned word;
        if (word_bytes == 2) word = aligned ? ((const u16*)codes)[u] : w[0] | (w[1] << 8);
        else if (aligned) word = ((const unsigned*)codes)[u];
        else word = w[0] | (w[1] << 8) | (w[2] << 16) | ((unsigned)w[3] << 24);
        for (int k = 0; k < per_word; ++k) {  // value k: bits [k * bits, (k + 1) * bits)
            const int d = d0 + k;
            const unsigned c = (word >> (k * bits)) & mask;
            // two's complement when symmetric: (c ^ sign) - sign sign-extends `bits` bits
            const float q = asym ? (float)c : (float)((int)(c ^ sign) - (int)sign);
            const int g = per_channel ? d : b * per_row + d / r.group;
            float x = __fmul_rn(q, half_to_float(scales[g]));
            if (asym) x = __fadd_rn(x, half_to_float(zeros[g]));
            out[k] = x;
        }
    }
}

__device__ __forceinline__ void load_tile(const BlockRef& r, int kv, int hk, int H, int B, int D,
                                          float* dst, int stride) {
    if (r.kind == KIND_FLOAT) load_float_tile(r, kv, hk, H, B, D, dst, stride);
    else load_quant_tile(r, kv, hk, H, B, D, dst, stride);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---- the main kernel ---------------------------------------------------------------------

// Arguments: q/out [S, Q, Hq, D]; part_out [S, Hkv, splits, R, D] fp32 (splits > 1 only);
// part_lse [S, Hkv, splits, R]; blse [S, M, Hkv, R]; seq_lens [S], block_pool/block_slot
// [S, M] int32; descs [pools, 16] int64; rotation [D] fp32 (±1: the rotated pools' signs, null
// when no pool is rotated). R = (Hq / Hkv) * Q rows per K/V head; RT rows per
// CTA (<= MAX_ROWS); T tokens per tile (a multiple of B, T / B <= MAX_TILE_BLOCKS, B divides
// 32); bps blocks per split. scale_log2 = scale * log2(e): scores live in the log2 domain.
template <class IO>
__device__ void attend_tiles(const typename IO::T* q, typename IO::T* out, float* part_out,
                             float* part_lse, float* blse, const int* seq_lens,
                             const int* block_pool, const int* block_slot, const i64* descs,
                             const float* rotation, int Q, int Hq, int Hkv, int B, int D, int M,
                             int layer,
                             float scale_log2, int RT, int T, int bps, int splits) {
    extern __shared__ Word4 smem_words[];
    __shared__ BlockRef refs[MAX_TILE_BLOCKS];
    __shared__ float row_max[MAX_ROWS], row_sum[MAX_ROWS], row_alpha[MAX_ROWS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int s = blockIdx.x / Hkv, hk = blockIdx.x % Hkv, sp = blockIdx.y;
    const int G = Hq / Hkv, R = G * Q;
    const int r0 = blockIdx.z * RT, rows = imin(RT, R - r0);
    const int n = seq_lens[s], m = (n + B - 1) / B;
    const int j_begin = sp * bps, j_end = imin(j_begin + bps, m);
    // The tile's last row is its latest query: no block past what it sees is read.
    const int last_pos = n - Q + (r0 + rows - 1) / G;
    const int j_seen = imin(j_end, last_pos / B + 1);
    const int nb = T / B;

    float* qs = (float*)smem_words;  // [RT][D]
    float* acc = qs + RT * D;        // [RT][D]
    float* ks = acc + RT * D;        // [T][D + 1]
    float* vs = ks + T * (D + 1);    // [T][D]
    float* ps = vs + T * D;          // [RT][T]: scores, then probabilities

    for (int e = tid; e < RT * D; e += blockDim.x) {
        const int r = e / D, d = e % D;
        float x = 0.0f;
        if (r < rows) {
            const int i = (r0 + r) / G, h = hk * G + (r0 + r) % G;
            x = IO::load(q[(((i64)s * Q + i) * Hq + h) * D + d]);
        }
        qs[e] = x;
        acc[e] = 0.0f;
    }
    if (tid < MAX_ROWS) {
        row_max[tid] = neg_inf();
        row_sum[tid] = 0.0f;
    }
    __syncthreads();

    for (int jt = j_begin; jt < j_end; jt += nb) {
        if (jt >= j_seen) {  // no row of the tile sees these blocks: nothing to read
            for (int e = tid; e < rows * nb; e += blockDim.x) {
                const int r = e / nb, j = jt + e % nb;
                if (j < j_end) blse[(((i64)s * M + j) * Hkv + hk) * R + r0 + r] = neg_inf();
            }
            continue;
        }
        if (tid < nb) {
            const int j = jt + tid;
            BlockRef& r = refs[tid];
            r.row = nullptr;
            const int pool = j < j_seen ? block_pool[(i64)s * M + j] : -1;
            if (pool >= 0) {
                const i64* dsc = descs + (i64)pool * DESC_INTS;
                r.kind = (int)dsc[DESC_KIND];
                r.dtype_or_bits = (int)dsc[DESC_DTYPE_OR_BITS];
                r.flags = (int)dsc[DESC_FLAGS];
                r.group = (int)dsc[DESC_GROUP];
                r.layer = dsc[DESC_LAYER_OVERRIDE] < 0 ? layer : (int)dsc[DESC_LAYER_OVERRIDE];
                r.codes = dsc[DESC_CODES];
                r.scale[0] = dsc[DESC_K_SCALE];
                r.zero[0] = dsc[DESC_K_ZERO];
                r.scale[1] = dsc[DESC_V_SCALE];
                r.zero[1] = dsc[DESC_V_ZERO];
                r.valid_tokens = imin(B, n - j * B);
                r.row = (const u8*)dsc[DESC_PTR] + (i64)block_slot[(i64)s * M + j] * dsc[DESC_ROW_BYTES];
            }
        }
        __syncthreads();
        for (int bi = 0; bi < nb; ++bi) {  // uniform: every thread reads the same refs
            if (refs[bi].row == nullptr) continue;
            load_tile(refs[bi], 0, hk, Hkv, B, D, ks + bi * B * (D + 1), D + 1);
            load_tile(refs[bi], 1, hk, Hkv, B, D, vs + bi * B * D, D);
        }
        __syncthreads();
        for (int bi = 0; bi < nb; ++bi) {  // uniform too: rotated blocks turned back
            const BlockRef& r = refs[bi];
            if (r.row == nullptr || r.kind == KIND_FLOAT || !(r.flags & FLAG_ROTATED)) continue;
            unrotate_rows(ks + bi * B * (D + 1), B, D + 1, D, rotation);
            unrotate_rows(vs + bi * B * D, B, D, D, rotation);
        }

        // Scores: one (row, token) pair per thread step; a warp's lanes take consecutive
        // tokens of one row (q broadcast, K rows padded to D + 1: no bank conflicts).
        for (int e = tid; e < rows * T; e += blockDim.x) {
            const int r = e / T, t = e % T, bi = t / B;
            const int token = (jt + bi) * B + t % B, pos = n - Q + (r0 + r) / G;
            float score = neg_inf();
            if (refs[bi].row != nullptr && token <= pos) {  // token <= pos < n
                const float* qr = qs + r * D;
                const float* kr = ks + t * (D + 1);
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
                score = dot * scale_log2;
            }
            ps[e] = score;
        }
        __syncthreads();

        // Online softmax, one warp per row; each block's own log2-sum-exp for the mass
        // (segments of B lanes are one block: B divides 32).
        for (int r = warp; r < rows; r += warps) {
            float* pr = ps + r * T;
            float tile_max = neg_inf();
            for (int t = lane; t < T; t += 32) tile_max = fmaxf(tile_max, pr[t]);
            tile_max = warp_max(tile_max);
            const float old_max = row_max[r], new_max = fmaxf(old_max, tile_max);
            float total = 0.0f;
            for (int t0 = 0; t0 < T; t0 += 32) {  // uniform trip count: every lane shuffles
                const int t = t0 + lane;
                float p = 0.0f;
                if (t < T && new_max != neg_inf()) {
                    p = exp2f(pr[t] - new_max);  // 2^-inf = 0 for masked tokens
                    pr[t] = p;
                } else if (t < T) {
                    pr[t] = 0.0f;
                }
                total += p;
                float block_sum = p;
                for (int o = B >> 1; o > 0; o >>= 1)
                    block_sum += __shfl_xor_sync(0xffffffffu, block_sum, o);
                const int j = jt + t / B;
                if (t < T && t % B == 0 && j < j_end)
                    blse[(((i64)s * M + j) * Hkv + hk) * R + r0 + r] =
                        block_sum > 0.0f ? new_max + log2f(block_sum) : neg_inf();
            }
            total = warp_sum(total);
            if (lane == 0) {
                const float alpha = new_max == neg_inf() ? 0.0f : exp2f(old_max - new_max);
                row_alpha[r] = alpha;
                row_sum[r] = row_sum[r] * alpha + total;
                row_max[r] = new_max;
            }
        }
        __syncthreads();

        // acc = acc * alpha + P . V; skipped blocks' V rows were never loaded: left out.
        for (int e = tid; e < rows * D; e += blockDim.x) {
            const int r = e / D, d = e % D;
            const float* pr = ps + r * T;
            float a = acc[e] * row_alpha[r];
            for (int bi = 0; bi < nb; ++bi) {
                if (refs[bi].row == nullptr) continue;
                for (int t = bi * B; t < (bi + 1) * B; ++t) a = fmaf(pr[t], vs[t * D + d], a);
            }
            acc[e] = a;
        }
        __syncthreads();  // before the next tile overwrites refs, K, V and p
    }

    // This split's result per row: its log2-sum-exp and its normalised output.
    const i64 part = ((i64)s * Hkv + hk) * splits + sp;
    for (int e = tid; e < rows * D; e += blockDim.x) {
        const int r = e / D, d = e % D;
        const float l = row_sum[r];
        const float o = l > 0.0f ? acc[e] / l : 0.0f;  // a row that saw no key: zeros
        if (splits == 1) {
            const int i = (r0 + r) / G, h = hk * G + (r0 + r) % G;
            out[(((i64)s * Q + i) * Hq + h) * D + d] = IO::store(o);
        } else {
            part_out[(part * R + r0 + r) * D + d] = o;
        }
    }
    if (tid < rows) {
        const float l = row_sum[tid];
        part_lse[part * R + r0 + tid] = l > 0.0f ? row_max[tid] + log2f(l) : neg_inf();
    }
}

// ---- the combine kernel ------------------------------------------------------------------

// A row's final log2-sum-exp over its splits (part_lse of one row: stride R between splits).
__device__ __forceinline__ float row_lse(const float* pl, int splits, int R) {
    float mx = neg_inf();
    for (int k = 0; k < splits; ++k) mx = fmaxf(mx, pl[(i64)k * R]);
    if (mx == neg_inf()) return mx;
    float sum = 0.0f;
    for (int k = 0; k < splits; ++k) sum += exp2f(pl[(i64)k * R] - mx);
    return mx + log2f(sum);
}

template <class IO>
__device__ void attend_combine(typename IO::T* out, const float* part_out, const float* part_lse,
                               const float* blse, float* mass, const int* seq_lens, int Q, int Hq,
                               int Hkv, int B, int D, int M, int splits, int mass_ctas) {
    __shared__ float lse[ROW_CHUNK];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int s = blockIdx.y, G = Hq / Hkv, R = G * Q, rows = Hkv * R;
    const float* pl = part_lse + (i64)s * Hkv * splits * R;  // [Hkv, splits, R]

    if ((int)blockIdx.x < mass_ctas) {
        // Mass of blocks [j0, j0 + MASS_BLOCKS): 4 per warp, lanes across rows.
        const int m = (seq_lens[s] + B - 1) / B, j0 = blockIdx.x * MASS_BLOCKS;
        const int per_warp = MASS_BLOCKS / (COMBINE_THREADS / 32);
        float sums[MASS_BLOCKS / (COMBINE_THREADS / 32)];
#pragma unroll
        for (int k = 0; k < per_warp; ++k) sums[k] = 0.0f;
        for (int c0 = 0; c0 < rows; c0 += ROW_CHUNK) {
            const int chunk = imin(ROW_CHUNK, rows - c0);
            __syncthreads();  // the previous chunk's lse is read
            for (int x = tid; x < chunk; x += blockDim.x) {
                const int row = c0 + x, h = row / R, r = row % R;
                lse[x] = row_lse(pl + (i64)h * splits * R + r, splits, R);
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < per_warp; ++k) {
                const int j = j0 + warp * per_warp + k;
                if (j >= m) continue;
                const float* b = blse + ((i64)s * M + j) * rows + c0;  // [Hkv * R] rows
                for (int x = lane; x < chunk; x += 32)
                    if (lse[x] != neg_inf()) sums[k] += exp2f(b[x] - lse[x]);
            }
        }
#pragma unroll
        for (int k = 0; k < per_warp; ++k) {
            const float total = warp_sum(sums[k]);
            const int j = j0 + warp * per_warp + k;
            if (lane == 0 && j < M) mass[(i64)s * M + j] = j < m ? total / (float)(Hq * Q) : 0.0f;
        }
        return;
    }

    // Out: one warp per row, splits weighted by their share of the row's softmax.
    const int row = ((int)blockIdx.x - mass_ctas) * warps + warp;
    if (row >= rows) return;
    const int h = row / R, r = row % R, i = r / G, head = h * G + r % G;
    const float* rl = pl + (i64)h * splits * R + r;
    float mx = neg_inf();
    for (int k = lane; k < splits; k += 32) mx = fmaxf(mx, rl[(i64)k * R]);
    mx = warp_max(mx);
    float sum = 0.0f;
    if (mx != neg_inf())
        for (int k = lane; k < splits; k += 32) sum += exp2f(rl[(i64)k * R] - mx);
    sum = warp_sum(sum);
    const float total = mx == neg_inf() ? neg_inf() : mx + log2f(sum);
    const float* po = part_out + (((i64)s * Hkv + h) * splits * R + r) * D;  // + k * R * D
    typename IO::T* o = out + (((i64)s * Q + i) * Hq + head) * D;
    for (int d = lane; d < D; d += 32) {
        float x = 0.0f;
        if (total != neg_inf())
            for (int k = 0; k < splits; ++k) {
                const float w = rl[(i64)k * R];
                if (w != neg_inf()) x = fmaf(exp2f(w - total), po[(i64)k * R * D + d], x);
            }
        o[d] = IO::store(x);
    }
}

// ---- entry points (extern "C": plain names for CuPy) --------------------------------------

#define KVTIER_ATTEND_KERNELS(SUFFIX, IO)                                                      \
    extern "C" __global__ void kvtier_attend_##SUFFIX(                                         \
        const IO::T* q, IO::T* out, float* part_out, float* part_lse, float* blse,             \
        const int* seq_lens, const int* block_pool, const int* block_slot, const i64* descs,   \
        const float* rotation, int Q, int Hq, int Hkv, int B, int D, int M, int layer,         \
        float scale_log2, int RT, int T, int bps, int splits) {                                \
        attend_tiles<IO>(q, out, part_out, part_lse, blse, seq_lens, block_pool, block_slot,   \
                         descs, rotation, Q, Hq, Hkv, B, D, M, layer, scale_log2, RT, T, bps,  \
                         splits);                                                              \
    }                                                                                          \
    extern "C" __global__ void kvtier_attend_combine_##SUFFIX(                                 \
        IO::T* out, const float* part_out, const float* part_lse, const float* blse,           \
        float* mass, const int* seq_lens, int Q, int Hq, int Hkv, int B, int D, int M,         \
        int splits, int mass_ctas) {                                                           \
        attend_combine<IO>(out, part_out, part_lse, blse, mass, seq_lens, Q, Hq, Hkv, B, D, M, \
                           splits, mass_ctas);                                                 \
    }

KVTIER_ATTEND_KERNELS(f16, F16)
KVTIER_ATTEND_KERNELS(bf16, BF16)
KVTIER_ATTEND_KERNELS(f32, F32)
