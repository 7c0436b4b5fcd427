//! Whole blocks between a paged KV cache, in the layout its attention backend packs them, and
//! kvtier's block form `[2, H, N, D]` (K then V, token-major per head): the vLLM connector's
//! CPU data path, one pass over the bytes (`kvtier.integrations.vllm.paged` says which layout
//! is whose). A block of the cache holds, per head `h` and token `n` of its `N` tokens:
//!
//! - `channels`: K at `[h, n, 0..D]`, V at `[h, n, D..2D]` (heads and tokens strided);
//! - `cpu-vec`: per head a region of K column-major `[D, N]`, then one of V row-major `[N, D]`;
//! - `cpu-amx`: per head K in tiles `[N/16, D/2, 16, 2]` (16 tokens a tile, channel pairs as
//!   32-bit words), then V in tiles `[D/16, N/2, 16, 2]` (16 channels a tile, token pairs).

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Channels,
    CpuVec,
    CpuAmx,
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

/// As [`run`] for one element at unaligned addresses.
#[inline(always)]
unsafe fn one<T: Copy, const TO_CACHE: bool>(cache: *mut T, block: *mut T) {
    if TO_CACHE {
        cache.write_unaligned(block.read_unaligned());
    } else {
        block.write_unaligned(cache.read_unaligned());
    }
}

/// Moves one block between the cache (`cache`: the block's first element) and kvtier's form
/// (`block`: `2 * H * N * D` contiguous elements of `E` bytes), towards the cache when
/// `TO_CACHE`.
///
/// # Safety
/// `cache` valid for the block's elements under `g`, `block` for `2 * H * N * D` elements;
/// they do not overlap; `cpu-amx` needs 2-byte elements and N, D multiples of 16.
unsafe fn move_block<const TO_CACHE: bool>(
    layout: Layout,
    g: Geometry,
    elem: usize,
    cache: *mut u8,
    block: *mut u8,
) {
    let (h_n, n, d) = (g.heads, g.tokens, g.dim);
    let plane = n * d * elem; // bytes of one head's K (or V) in either form
    for h in 0..h_n {
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
                // V: per tile of 16 channels and pair of tokens, 16 (channel, token) pairs.
                let (v_cache, v_block) = (k_cache.add(plane).cast::<u16>(), v_block.cast::<u16>());
                for tile in 0..d / 16 {
                    for pair in 0..n / 2 {
                        let src = v_cache.add(tile * n * 16 + pair * 32);
                        let row = v_block.add(2 * pair * d + tile * 16);
                        for j in 0..16 {
                            one::<u16, TO_CACHE>(src.add(2 * j), row.add(j));
                            one::<u16, TO_CACHE>(src.add(2 * j + 1), row.add(d + j));
                        }
                    }
                }
            }
        }
    }
}

/// The cache's `[rows, cols]` (row-major) is the block's `[cols, rows]`: element `(r, c)` of
/// the cache is `(c, r)` of the block.
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
    for r in 0..rows {
        for c in 0..cols {
            one::<T, TO_CACHE>(cache.add(r * cols + c), block.add(c * rows + r));
        }
    }
}

fn layout_of(name: &str) -> PyResult<Layout> {
    match name {
        "channels" => Ok(Layout::Channels),
        "cpu-vec" => Ok(Layout::CpuVec),
        "cpu-amx" => Ok(Layout::CpuAmx),
        _ => Err(PyValueError::new_err(format!(
            "layout: expected channels, cpu-vec or cpu-amx, got {name:?}"
        ))),
    }
}

/// Copies whole blocks between a paged cache on the CPU and kvtier's block form: cache block
/// `block_ids[i]` (at `cache + block_ids[i] * block_stride` elements of `elem` bytes) and the
/// `2 * H * N * D` contiguous elements at address `blocks[i]`; into the cache when
/// `to_cache`, else out of it. `strides` are a head's and a token's in the cache (the
/// `channels` layout; the CPU layouts' heads are contiguous). The GIL is released meanwhile.
/// The addresses come from torch's `data_ptr()` of tensors the caller
/// (`kvtier.integrations.vllm.paged`) checked and keeps alive: this trusts them.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn paged_copy(
    py: Python<'_>,
    layout: &str,
    to_cache: bool,
    cache: usize,
    block_stride: usize,
    strides: (usize, usize),
    block_ids: PyReadonlyArray1<'_, i64>,
    blocks: PyReadonlyArray1<'_, u64>,
    shape: (usize, usize, usize),
    elem: usize,
) -> PyResult<()> {
    let layout = layout_of(layout)?;
    let (heads, tokens, dim) = shape;
    if !matches!(elem, 2 | 4)
        || (layout == Layout::CpuAmx && (elem != 2 || tokens % 16 != 0 || dim % 16 != 0))
    {
        return Err(PyValueError::new_err(format!(
            "paged_copy: {layout:?} with {elem}-byte elements, block size {tokens}, head_dim {dim}"
        )));
    }
    let ids = block_ids.as_slice()?;
    let addrs = blocks.as_slice()?;
    if ids.len() != addrs.len() || ids.iter().any(|&b| b < 0) {
        return Err(PyValueError::new_err(
            "paged_copy: expected one non-negative block id per block address",
        ));
    }
    let g = Geometry {
        heads,
        tokens,
        dim,
        head_stride: strides.0,
        token_stride: strides.1,
    };
    let (ids, addrs) = (ids.to_vec(), addrs.to_vec());
    py.detach(|| {
        for (&id, &addr) in ids.iter().zip(&addrs) {
            let at = (cache + id as usize * block_stride * elem) as *mut u8;
            // SAFETY: the caller's tensors hold these blocks (see above), which do not overlap.
            unsafe {
                if to_cache {
                    move_block::<true>(layout, g, elem, at, addr as *mut u8);
                } else {
                    move_block::<false>(layout, g, elem, at, addr as *mut u8);
                }
            }
        }
    });
    Ok(())
}

/// Copies `bytes` bytes from each address of `srcs` to the address of `dsts` beside it (rows
/// of pools or of staging tensors, whole blocks), the GIL released. The addresses come from
/// torch's `data_ptr()` of tensors the caller checked and keeps alive, rows that do not
/// overlap: this trusts them.
#[pyfunction]
pub fn copy_rows(
    py: Python<'_>,
    srcs: PyReadonlyArray1<'_, u64>,
    dsts: PyReadonlyArray1<'_, u64>,
    bytes: usize,
) -> PyResult<()> {
    let (srcs, dsts) = (srcs.as_slice()?.to_vec(), dsts.as_slice()?.to_vec());
    if srcs.len() != dsts.len() {
        return Err(PyValueError::new_err(
            "copy_rows: expected one destination per source",
        ));
    }
    py.detach(|| {
        for (&src, &dst) in srcs.iter().zip(&dsts) {
            // SAFETY: see above.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where `(kv, h, n, d)` is in a contiguous cache block of `layout`, by the formulas of
    /// vLLM's `reshape_and_cache` (element by element, independent of the copy's loops).
    fn cache_index(layout: Layout, g: Geometry, kv: usize, h: usize, n: usize, d: usize) -> usize {
        let (nn, dd) = (g.tokens, g.dim);
        let region = (2 * h + kv) * nn * dd;
        match (layout, kv) {
            (Layout::Channels, _) => h * g.head_stride + n * g.token_stride + kv * dd + d,
            (Layout::CpuVec, 0) => region + d * nn + n,
            (Layout::CpuVec, _) => region + n * dd + d,
            (Layout::CpuAmx, 0) => {
                region + 2 * ((n / 16) * 16 * (dd / 2) + (d / 2) * 16 + n % 16) + d % 2
            }
            (Layout::CpuAmx, _) => {
                region + (d / 16) * nn * 16 + (n / 2) * 32 + (d % 16) * 2 + n % 2
            }
        }
    }

    #[test]
    fn every_layout_round_trips_each_element_to_its_place() {
        let (h, n, d) = (3, 32, 64);
        let g = Geometry {
            heads: h,
            tokens: n,
            dim: d,
            head_stride: n * 2 * d,
            token_stride: 2 * d,
        };
        for layout in [Layout::Channels, Layout::CpuVec, Layout::CpuAmx] {
            let block: Vec<u16> = (0..2 * h * n * d).map(|i| i as u16).collect();
            let mut cache = vec![0u16; 2 * h * n * d];
            let mut back = vec![0u16; block.len()];
            unsafe {
                let mut src = block.clone();
                move_block::<true>(
                    layout,
                    g,
                    2,
                    cache.as_mut_ptr().cast(),
                    src.as_mut_ptr().cast(),
                );
                move_block::<false>(
                    layout,
                    g,
                    2,
                    cache.as_mut_ptr().cast(),
                    back.as_mut_ptr().cast(),
                );
            }
            assert_eq!(back, block, "{layout:?}");
            for kv in 0..2 {
                for hh in 0..h {
                    for t in 0..n {
                        for c in 0..d {
                            let want = block[((kv * h + hh) * n + t) * d + c];
                            assert_eq!(
                                cache[cache_index(layout, g, kv, hh, t, c)],
                                want,
                                "{layout:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
