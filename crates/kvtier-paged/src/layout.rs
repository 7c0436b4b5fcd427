//! Whole blocks between a paged KV cache, in the layout its attention backend packs them
//! ([`Layout`]), and kvtier's block form `[2, H, N, D]`: the copies, and the scan that checks
//! them finite and measures their keys where they lie. The crate's docs say where K and V are
//! in each layout.

use rayon::prelude::*;

use crate::elements::{bound_of, each_dtype, element_bytes, Bits};
use crate::{Beyond, Error};

/// Bytes below which a call runs on the calling thread: waking the pool costs more.
pub(crate) const PARALLEL_BYTES: usize = 1 << 19;

/// Runs `f` over the items of `items`, on rayon's pool when they hold `bytes` or more, with
/// the first error any returns.
fn for_each<T: Send, E: Send>(
    items: Vec<T>,
    bytes: usize,
    f: impl Fn(T) -> Result<(), E> + Sync + Send,
) -> Result<(), E> {
    if bytes < PARALLEL_BYTES {
        items.into_iter().try_for_each(f)
    } else {
        items.into_par_iter().with_min_len(2).try_for_each(f)
    }
}

/// Where K and V of a block's tokens are (the crate's docs say how each packs them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Channels,
    CpuVec,
    CpuAmx,
}

impl Layout {
    /// The layout named `channels`, `cpu-vec` or `cpu-amx`.
    pub fn parse(name: &str) -> Result<Self, Error> {
        match name {
            "channels" => Ok(Layout::Channels),
            "cpu-vec" => Ok(Layout::CpuVec),
            "cpu-amx" => Ok(Layout::CpuAmx),
            _ => Err(Error(format!(
                "layout: expected channels, cpu-vec or cpu-amx, got {name:?}"
            ))),
        }
    }
}

/// A cache block's geometry, in elements: heads, tokens a block, head_dim, and the strides of
/// a head and a token (`channels` only; the CPU layouts' heads are `2 * N * D` apart).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub heads: usize,
    pub tokens: usize,
    pub dim: usize,
    pub head_stride: usize,
    pub token_stride: usize,
}

impl Geometry {
    /// A block's `(heads, tokens, head_dim)` and the cache's `(head, token)` strides.
    pub fn of((heads, tokens, dim): (usize, usize, usize), strides: (usize, usize)) -> Self {
        Geometry {
            heads,
            tokens,
            dim,
            head_stride: strides.0,
            token_stride: strides.1,
        }
    }
}

/// Copies one element or run between the cache and the block, towards the cache when
/// `TO_CACHE`.
///
/// # Safety
/// Both pointers valid for `len` elements, not overlapping.
#[inline(always)]
unsafe fn run<T: Copy, const TO_CACHE: bool>(cache: *mut T, block: *mut T, len: usize) {
    if TO_CACHE {
        std::ptr::copy_nonoverlapping(block, cache, len);
    } else {
        std::ptr::copy_nonoverlapping(cache, block, len);
    }
}

/// Moves one block between the cache (`cache`: the block's first element) and kvtier's form
/// (`block`: `2 * H * N * D` contiguous elements of `E` bytes), towards the cache when
/// `TO_CACHE`.
///
/// # Safety
/// `cache` valid for the block's elements under `g`, `block` for `2 * H * N * D` elements;
/// they do not overlap; `cpu-amx` needs 2-byte elements and N, D multiples of 16.
#[inline(always)]
unsafe fn move_block<const TO_CACHE: bool>(
    layout: Layout,
    g: Geometry,
    elem: usize,
    cache: *mut u8,
    block: *mut u8,
) {
    for h in 0..g.heads {
        move_head::<TO_CACHE>(layout, g, elem, cache, block, h);
    }
}

/// Head `h` of [`move_block`], and a prefetch of the next head's runs.
///
/// # Safety
/// As [`move_block`]'s.
#[inline(always)]
unsafe fn move_head<const TO_CACHE: bool>(
    layout: Layout,
    g: Geometry,
    elem: usize,
    cache: *mut u8,
    block: *mut u8,
    h: usize,
) {
    let (h_n, n, d) = (g.heads, g.tokens, g.dim);
    let plane = n * d * elem; // bytes of one head's K (or V) in either form
    if layout != Layout::Channels {
        // the next head's source and destination runs
        let more = h + 1 < h_n;
        let (next_k, next_v) = (block.add((h + 1) * plane), block.add((h_n + h + 1) * plane));
        prefetch(cache.add((h + 1) * 2 * plane), 2 * plane, more);
        prefetch(next_k, plane, more);
        prefetch(next_v, plane, more);
    }
    let k_block = block.add(h * plane);
    let v_block = block.add((h_n + h) * plane);
    match layout {
        Layout::Channels => {
            for t in 0..n {
                let at = cache.add((h * g.head_stride + t * g.token_stride) * elem);
                run::<u8, TO_CACHE>(at, k_block.add(t * d * elem), d * elem);
                run::<u8, TO_CACHE>(at.add(d * elem), v_block.add(t * d * elem), d * elem);
            }
        }
        Layout::CpuVec => {
            let k_cache = cache.add(h * 2 * plane);
            run::<u8, TO_CACHE>(k_cache.add(plane), v_block, plane);
            if elem == 2 {
                transpose::<u16, TO_CACHE>(k_cache.cast(), k_block.cast(), d, n);
            } else {
                transpose::<u32, TO_CACHE>(k_cache.cast(), k_block.cast(), d, n);
            }
        }
        Layout::CpuAmx => {
            let k_cache = cache.add(h * 2 * plane);
            // K: per tile of 16 tokens, [D/2, 16] words of two channels -> [16, D/2].
            let words = d / 2;
            for tile in 0..n / 16 {
                let at = tile * 16 * words;
                transpose::<u32, TO_CACHE>(
                    k_cache.cast::<u32>().add(at),
                    k_block.cast::<u32>().add(at),
                    words,
                    16,
                );
            }
            // V: per tile of 16 channels and pair of tokens, 16 words of (token 2p, token
            // 2p + 1) of one channel each: the low halves are row 2p's 16 channels.
            let (v_cache, v_block) = (k_cache.add(plane).cast::<u32>(), v_block.cast::<u16>());
            for tile in 0..d / 16 {
                for pair in 0..n / 2 {
                    let words = v_cache.add((tile * n / 2 + pair) * 16);
                    let even = v_block.add(2 * pair * d + tile * 16);
                    deinterleave::<TO_CACHE>(words, even, even.add(d));
                }
            }
        }
    }
}

/// Asks for the `bytes` at `at` (the next head's runs) to be brought into the core's cache
/// ahead of their reads and writes, when `wanted`: a block's heads lie in runs of a few KiB,
/// and the hardware's prefetchers do not cross pages.
#[inline(always)]
fn prefetch(at: *const u8, bytes: usize, wanted: bool) {
    #[cfg(target_arch = "x86_64")]
    if wanted {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, bytes, wanted);
}

/// 16 words of two 16-bit halves and two rows of 16: the low halves are `even`'s, the high
/// ones `odd`'s (towards the words when `TO_CACHE`).
///
/// # Safety
/// `words` valid for 16 (4-byte aligned) words, `even` and `odd` for 16 elements each.
#[inline(always)]
unsafe fn deinterleave<const TO_CACHE: bool>(words: *mut u32, even: *mut u16, odd: *mut u16) {
    let (mut w, mut e, mut o) = ([0u32; 16], [0u16; 16], [0u16; 16]);
    if TO_CACHE {
        e = even.cast::<[u16; 16]>().read_unaligned();
        o = odd.cast::<[u16; 16]>().read_unaligned();
        for j in 0..16 {
            w[j] = u32::from(e[j]) | u32::from(o[j]) << 16;
        }
        words.cast::<[u32; 16]>().write_unaligned(w);
    } else {
        w = words.cast::<[u32; 16]>().read_unaligned();
        for j in 0..16 {
            e[j] = w[j] as u16;
            o[j] = (w[j] >> 16) as u16;
        }
        even.cast::<[u16; 16]>().write_unaligned(e);
        odd.cast::<[u16; 16]>().write_unaligned(o);
    }
}

/// The cache's `[rows, cols]` (row-major) is the block's `[cols, rows]`: element `(r, c)` of
/// the cache is `(c, r)` of the block. 2- and 4-byte elements go in square tiles of vector
/// registers where the sides allow.
///
/// # Safety
/// Both valid for `rows * cols` elements, not overlapping.
#[inline(always)]
unsafe fn transpose<T: Copy, const TO_CACHE: bool>(
    cache: *mut T,
    block: *mut T,
    rows: usize,
    cols: usize,
) {
    // The copy reads a `[src_rows, src_cols]` matrix and writes its transpose.
    let (src, dst, src_rows, src_cols) = if TO_CACHE {
        (block, cache, cols, rows)
    } else {
        (cache, block, rows, cols)
    };
    #[cfg(target_arch = "x86_64")]
    {
        let tile = 16 / std::mem::size_of::<T>(); // elements of a 128-bit register
        if matches!(tile, 4 | 8) && src_rows.is_multiple_of(tile) && src_cols.is_multiple_of(tile) {
            for r in (0..src_rows).step_by(tile) {
                for c in (0..src_cols).step_by(tile) {
                    let from = src.add(r * src_cols + c).cast::<u8>();
                    let to = dst.add(c * src_rows + r).cast::<u8>();
                    let (from_stride, to_stride) = (src_cols * 16 / tile, src_rows * 16 / tile);
                    if tile == 4 {
                        simd::transpose_4x4_u32(from, from_stride, to, to_stride);
                    } else {
                        simd::transpose_8x8_u16(from, from_stride, to, to_stride);
                    }
                }
            }
            return;
        }
    }
    for r in 0..src_rows {
        for c in 0..src_cols {
            *dst.add(c * src_rows + r) = *src.add(r * src_cols + c);
        }
    }
}

/// Square transposes in SSE2 registers (every x86-64 CPU has them): rows of 16 bytes,
/// `stride` bytes apart, read at `from` and written transposed at `to`.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn rows<const N: usize>(at: *const u8, stride: usize) -> [__m128i; N] {
        std::array::from_fn(|i| _mm_loadu_si128(at.add(i * stride).cast()))
    }

    #[inline(always)]
    unsafe fn store<const N: usize>(at: *mut u8, stride: usize, rows: [__m128i; N]) {
        for (i, r) in rows.into_iter().enumerate() {
            _mm_storeu_si128(at.add(i * stride).cast(), r);
        }
    }

    /// # Safety
    /// 4 rows of 4 u32 at each end.
    #[inline(always)]
    pub unsafe fn transpose_4x4_u32(from: *const u8, fs: usize, to: *mut u8, ts: usize) {
        let [a0, a1, a2, a3] = rows::<4>(from, fs);
        let (t0, t1) = (_mm_unpacklo_epi32(a0, a1), _mm_unpacklo_epi32(a2, a3));
        let (t2, t3) = (_mm_unpackhi_epi32(a0, a1), _mm_unpackhi_epi32(a2, a3));
        let out = [
            _mm_unpacklo_epi64(t0, t1),
            _mm_unpackhi_epi64(t0, t1),
            _mm_unpacklo_epi64(t2, t3),
            _mm_unpackhi_epi64(t2, t3),
        ];
        store(to, ts, out);
    }

    /// # Safety
    /// 8 rows of 8 u16 at each end.
    #[inline(always)]
    pub unsafe fn transpose_8x8_u16(from: *const u8, fs: usize, to: *mut u8, ts: usize) {
        let a = rows::<8>(from, fs);
        // pairs of rows interleaved, then pairs of those, then halves
        let b: [__m128i; 8] = std::array::from_fn(|i| {
            let (x, y) = (a[2 * (i / 2)], a[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm_unpacklo_epi16(x, y)
            } else {
                _mm_unpackhi_epi16(x, y)
            }
        });
        // c[0..4] from rows 0-3 (b0..b3), c[4..8] from rows 4-7 (b4..b7)
        let c: [__m128i; 8] = std::array::from_fn(|i| {
            let base = 4 * (i / 4);
            let (x, y) = (b[base + (i % 4) / 2], b[base + 2 + (i % 4) / 2]);
            if i % 2 == 0 {
                _mm_unpacklo_epi32(x, y)
            } else {
                _mm_unpackhi_epi32(x, y)
            }
        });
        let out: [__m128i; 8] = std::array::from_fn(|j| {
            let (x, y) = (c[j / 2], c[4 + j / 2]);
            if j % 2 == 0 {
                _mm_unpacklo_epi64(x, y)
            } else {
                _mm_unpackhi_epi64(x, y)
            }
        });
        store(to, ts, out);
    }
}

/// Whole blocks `ids` of a paged cache on the CPU (block `b` at `cache + b * block_stride`
/// elements of `elem` bytes), checked to be something the kernels can move: what
/// [`Blocks::copy`] and [`Blocks::scan`] take.
#[derive(Clone, Debug)]
pub struct Blocks<'a> {
    layout: Layout,
    g: Geometry,
    elem: usize,
    cache: usize,
    block_stride: usize,
    ids: &'a [i64],
}

impl<'a> Blocks<'a> {
    /// Refuses what `layout` cannot hold (elements of 2 or 4 bytes; `cpu-amx` tiles of 16
    /// tokens and 16 channels of 2-byte elements) and negative block ids.
    pub fn new(
        layout: Layout,
        g: Geometry,
        elem: usize,
        (cache, block_stride): (usize, usize),
        ids: &'a [i64],
    ) -> Result<Self, Error> {
        let (tokens, dim) = (g.tokens, g.dim);
        if !matches!(elem, 2 | 4)
            || (layout == Layout::CpuAmx
                && (elem != 2 || !tokens.is_multiple_of(16) || !dim.is_multiple_of(16)))
        {
            return Err(Error(format!(
                "{layout:?} with {elem}-byte elements, block size {tokens}, head_dim {dim}: \
                 expected 2- or 4-byte elements (cpu-amx: 2-byte, block size and head_dim \
                 multiples of 16)"
            )));
        }
        if ids.iter().any(|&b| b < 0) {
            return Err(Error("block ids: expected non-negative ids".into()));
        }
        Ok(Blocks {
            layout,
            g,
            elem,
            cache,
            block_stride,
            ids,
        })
    }

    fn starts(&self) -> impl Iterator<Item = usize> + '_ {
        self.ids
            .iter()
            .map(|&id| self.cache + id as usize * self.block_stride * self.elem)
    }

    fn bytes(&self) -> usize {
        self.ids.len() * 2 * self.g.heads * self.g.tokens * self.g.dim * self.elem
    }

    /// Copies each block to (or, `to_cache`, from) kvtier's form at the address beside it in
    /// `addrs` (`2 * H * N * D` contiguous elements), one pass over the bytes, on rayon's pool
    /// when they are many.
    ///
    /// # Safety
    /// The cache valid for the blocks' elements under the geometry, each address for a block
    /// of kvtier's form; no two of them overlap.
    pub unsafe fn copy(&self, addrs: &[u64], to_cache: bool) -> Result<(), Error> {
        if addrs.len() != self.ids.len() {
            return Err(Error(format!(
                "copy: expected one address a block, got {} for {} blocks",
                addrs.len(),
                self.ids.len()
            )));
        }
        let work: Vec<(usize, usize)> = self
            .starts()
            .zip(addrs.iter().map(|&a| a as usize))
            .collect();
        let (layout, g, elem, wide) = (self.layout, self.g, self.elem, has_avx2());
        for_each(work, self.bytes(), |(at, addr)| {
            if to_cache {
                move_any::<true>(wide, layout, g, elem, at as *mut u8, addr as *mut u8);
            } else {
                move_any::<false>(wide, layout, g, elem, at as *mut u8, addr as *mut u8);
            }
            Ok::<(), ()>(())
        })
        .ok();
        Ok(())
    }

    /// Checks the blocks finite and measures their keys in place: each token's key norm
    /// averaged over heads, block by block (`dtype` the elements' code, of the blocks'
    /// `elem` bytes); or which of K and V holds a NaN, an infinity or a value of magnitude past
    /// `limit` (the most the manager's ladder holds). With `copy_to` (one address a block, as
    /// [`Blocks::copy`]'s), each block is also copied out there once checked, while it is in the
    /// core's cache: on a refusal, some blocks may have been copied.
    ///
    /// # Safety
    /// As [`Blocks::copy`]'s, for reading the cache and writing `copy_to`.
    pub unsafe fn scan(
        &self,
        dtype: u8,
        copy_to: Option<&[u64]>,
        limit: f32,
    ) -> Result<Result<Vec<f32>, Beyond>, Error> {
        if element_bytes(dtype)? != self.elem {
            return Err(Error(format!(
                "scan: dtype {dtype} is not of {}-byte elements",
                self.elem
            )));
        }
        if copy_to.is_some_and(|d| d.len() != self.ids.len()) {
            return Err(Error(
                "scan: expected one address a block to copy to".into(),
            ));
        }
        let (layout, g, tokens, wide) = (self.layout, self.g, self.g.tokens, has_avx2());
        let mut norms = vec![0.0f32; self.ids.len() * tokens];
        let work: Vec<_> = self
            .starts()
            .enumerate()
            .map(|(i, at)| (at, copy_to.map_or(0, |d| d[i] as usize)))
            .zip(norms.chunks_mut(tokens.max(1)))
            .collect();
        let outcome = for_each(work, self.bytes(), |((at, to), out)| {
            each_dtype!(
                dtype,
                T,
                scan_any::<T>(
                    wide,
                    layout,
                    g,
                    at as *const T,
                    out,
                    to as *mut u8,
                    bound_of::<T>(limit)
                )
            )
        });
        Ok(outcome.map(|()| norms))
    }
}

/// Each token's key norm, averaged over heads, of one cache block of `layout` (`cache`: its
/// first element), into `norms` (`N` values), read where the layout keeps K (the sums run
/// along the memory, across tokens, wherever it can); `Beyond::Key` / `Beyond::Value` when K /
/// V holds a NaN,
/// an infinity or a value past `bound` ([`Bits::any_beyond`]). A norm past f32's range is
/// f32's largest value. With `copy_to` not null,
/// each head is also copied there (as [`move_block`] copies it) once checked, while it is in
/// L1: on an error, the heads before it may have been.
///
/// # Safety
/// `cache` valid for reading the block's elements under `g`; `copy_to` null or as
/// [`move_block`]'s `block`.
#[inline(always)]
unsafe fn scan_block<T: Bits>(
    layout: Layout,
    g: Geometry,
    cache: *const T,
    norms: &mut [f32],
    copy_to: *mut u8,
    bound: u32,
) -> Result<(), Beyond> {
    let (n, d) = (g.tokens, g.dim);
    let mut squares = vec![0.0f32; n];
    norms.fill(0.0);
    for h in 0..g.heads {
        if layout != Layout::Channels && copy_to.is_null() {
            let region = 2 * n * d;
            let next = cache.add((h + 1) * region).cast::<u8>();
            prefetch(next, region * std::mem::size_of::<T>(), h + 1 < g.heads);
        }
        squares.fill(0.0);
        // A NaN or an infinity in K makes its token's sum of squares one: without a bound
        // below the type's range, K is checked element by element only then (a finite value
        // past 1.8e19 overflows it too).
        let k_finite = match layout {
            Layout::Channels => {
                for (t, sq) in squares.iter_mut().enumerate() {
                    let at = cache.add(h * g.head_stride + t * g.token_stride);
                    let (k, v) = std::slice::from_raw_parts(at, 2 * d).split_at(d);
                    if T::any_beyond(k, bound) {
                        return Err(Beyond::Key);
                    }
                    if T::any_beyond(v, bound) {
                        return Err(Beyond::Value);
                    }
                    let mut lanes = [0.0f32; 16];
                    for c in k.chunks(16) {
                        for (lane, x) in lanes.iter_mut().zip(c) {
                            *lane += x.widen() * x.widen();
                        }
                    }
                    *sq = lanes.iter().sum();
                }
                true
            }
            Layout::CpuVec | Layout::CpuAmx => {
                let region = std::slice::from_raw_parts(cache.add(h * 2 * n * d), 2 * n * d);
                let (k, v) = region.split_at(n * d);
                if T::any_beyond(v, bound) {
                    return Err(Beyond::Value);
                }
                if layout == Layout::CpuVec {
                    // K column-major: row c holds channel c of every token; 16 tokens at a time
                    // in registers.
                    for (t, sq) in squares.chunks_mut(16).enumerate() {
                        let mut lanes = [0.0f32; 16];
                        for channel in k.chunks_exact(n) {
                            let xs = &channel[16 * t..16 * t + sq.len()];
                            for (lane, x) in lanes.iter_mut().zip(xs) {
                                *lane += x.widen() * x.widen();
                            }
                        }
                        sq.copy_from_slice(&lanes[..sq.len()]);
                    }
                } else {
                    // Per tile of 16 tokens, D/2 rows of 16 words: token j's channel pair at
                    // lanes 2j, 2j + 1 of every row.
                    for (tile, sq) in k.chunks_exact(16 * d).zip(squares.chunks_exact_mut(16)) {
                        let mut lanes = [0.0f32; 32];
                        for row in tile.chunks_exact(32) {
                            for (lane, x) in lanes.iter_mut().zip(row) {
                                *lane += x.widen() * x.widen();
                            }
                        }
                        for (j, s) in sq.iter_mut().enumerate() {
                            *s = lanes[2 * j] + lanes[2 * j + 1];
                        }
                    }
                }
                let finite_enough = bound == T::FINITE && squares.iter().all(|s| s.is_finite());
                finite_enough || !T::any_beyond(k, bound)
            }
        };
        if !k_finite {
            return Err(Beyond::Key);
        }
        if !copy_to.is_null() {
            let elem = std::mem::size_of::<T>();
            move_head::<false>(layout, g, elem, cache as *mut u8, copy_to, h);
        }
        for (norm, sq) in norms.iter_mut().zip(&squares) {
            *norm += sq.sqrt();
        }
    }
    let per_head = 1.0 / g.heads.max(1) as f32;
    norms
        .iter_mut()
        .for_each(|x| *x = (*x * per_head).min(f32::MAX));
    Ok(())
}

/// [`scan_block`] and [`move_block`] compiled for AVX2, which the CPU is checked for first
/// ([`has_avx2`]): their loops vectorize twice as wide as the build's baseline (SSE2) allows.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Beyond, Bits, Geometry, Layout};

    #[target_feature(enable = "avx2")]
    pub unsafe fn scan_block<T: Bits>(
        layout: Layout,
        g: Geometry,
        cache: *const T,
        norms: &mut [f32],
        copy_to: *mut u8,
        bound: u32,
    ) -> Result<(), Beyond> {
        super::scan_block(layout, g, cache, norms, copy_to, bound)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn move_block<const TO_CACHE: bool>(
        layout: Layout,
        g: Geometry,
        elem: usize,
        cache: *mut u8,
        block: *mut u8,
    ) {
        super::move_block::<TO_CACHE>(layout, g, elem, cache, block);
    }
}

/// Whether this CPU runs the [`avx2`] copies of the loops.
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`scan_block`], as wide as the CPU allows.
///
/// # Safety
/// As [`scan_block`]'s.
unsafe fn scan_any<T: Bits>(
    wide: bool,
    layout: Layout,
    g: Geometry,
    cache: *const T,
    norms: &mut [f32],
    copy_to: *mut u8,
    bound: u32,
) -> Result<(), Beyond> {
    #[cfg(target_arch = "x86_64")]
    if wide {
        return avx2::scan_block(layout, g, cache, norms, copy_to, bound);
    }
    scan_block(layout, g, cache, norms, copy_to, bound)
}

/// [`move_block`], as wide as the CPU allows.
///
/// # Safety
/// As [`move_block`]'s.
unsafe fn move_any<const TO_CACHE: bool>(
    wide: bool,
    layout: Layout,
    g: Geometry,
    elem: usize,
    cache: *mut u8,
    block: *mut u8,
) {
    #[cfg(target_arch = "x86_64")]
    if wide {
        return avx2::move_block::<TO_CACHE>(layout, g, elem, cache, block);
    }
    move_block::<TO_CACHE>(layout, g, elem, cache, block);
}

/// Copies `bytes` bytes from each address of `srcs` to the address of `dsts` beside it (rows
/// of pools or of staging tensors, whole blocks), on rayon's pool when they are many.
///
/// # Safety
/// Each source valid for reading `bytes`, each destination for writing them; none overlap.
pub unsafe fn copy_rows(srcs: &[u64], dsts: &[u64], bytes: usize) -> Result<(), Error> {
    if srcs.len() != dsts.len() {
        return Err(Error(
            "copy_rows: expected one destination per source".into(),
        ));
    }
    let work: Vec<(u64, u64)> = srcs.iter().copied().zip(dsts.iter().copied()).collect();
    for_each(work, srcs.len() * bytes, |(src, dst)| {
        std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
        Ok::<(), ()>(())
    })
    .ok();
    Ok(())
}
