//! K/V checked finite, with each token's key norm, on its way into a level-0 pool: one token
//! written (the decode step's append, without the ~10 small numpy or torch operations, each a
//! microsecond or more, that the same work costs from Python), or whole blocks checked in one
//! pass (the vLLM connector's saves).

use kvtier_attend::f16_to_f32;
use numpy::PyArray1;
use pyo3::prelude::*;

/// Bits of one element, by the kernels' dtype code: 0 fp32, 1 fp16, 2 bf16.
pub(crate) fn element_bytes(dtype: u8) -> PyResult<usize> {
    match dtype {
        0 => Ok(4),
        1 | 2 => Ok(2),
        _ => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "dtype: expected 0 (fp32), 1 (fp16) or 2 (bf16), got {dtype}"
        ))),
    }
}

/// The values of one row of `n` elements at `ptr` as f32.
///
/// # Safety
/// `ptr` must be valid for reading `n` elements of `dtype`.
unsafe fn row(ptr: usize, n: usize, dtype: u8) -> impl Iterator<Item = f32> {
    (0..n).map(move |i| match dtype {
        0 => (ptr as *const f32).add(i).read_unaligned(),
        1 => f16_to_f32((ptr as *const u16).add(i).read_unaligned()),
        _ => f32::from_bits(u32::from((ptr as *const u16).add(i).read_unaligned()) << 16),
    })
}

/// Writes one token's K and V, `heads` rows of `head_dim` elements each (rows
/// `src_head_stride` elements apart at `k_src` and `v_src`), to rows `dst_head_stride`
/// elements apart at `k_dst` and `v_dst`, once both are known to be finite. Returns
/// `(key norm averaged over heads, 0)`, or `(0.0, 1)` / `(0.0, 2)` without writing anything
/// when K / V holds a NaN or an infinity. The addresses come from torch's `data_ptr()` of
/// tensors the caller (kvtier.manager) has checked and keeps alive: this trusts them.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn write_token(
    k_dst: usize,
    v_dst: usize,
    dst_head_stride: usize,
    k_src: usize,
    v_src: usize,
    src_head_stride: usize,
    heads: usize,
    head_dim: usize,
    dtype: u8,
) -> PyResult<(f64, u8)> {
    let size = element_bytes(dtype)?;
    let mut norm = 0.0f64;
    for h in 0..heads {
        // SAFETY: the caller passes rows of `head_dim` elements of `dtype` `src_head_stride`
        // elements apart for `heads` heads.
        let k = unsafe { row(k_src + h * src_head_stride * size, head_dim, dtype) };
        let mut squares = 0.0f64;
        for x in k {
            if !x.is_finite() {
                return Ok((0.0, 1));
            }
            squares += f64::from(x) * f64::from(x);
        }
        norm += squares.sqrt();
        // SAFETY: as above, for V.
        let v = unsafe { row(v_src + h * src_head_stride * size, head_dim, dtype) };
        if v.into_iter().any(|x| !x.is_finite()) {
            return Ok((0.0, 2));
        }
    }
    for h in 0..heads {
        for (src, dst) in [(k_src, k_dst), (v_src, v_dst)] {
            // SAFETY: source rows as above; destination rows of `head_dim` elements
            // `dst_head_stride` apart inside the caller's pool, never overlapping a source.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src + h * src_head_stride * size) as *const u8,
                    (dst + h * dst_head_stride * size) as *mut u8,
                    head_dim * size,
                );
            }
        }
    }
    Ok((norm / heads.max(1) as f64, 0))
}

/// An element type's bits: whether the value is a NaN or an infinity, and the value as f32.
pub(crate) trait Bits: Copy + Send + Sync {
    fn widen(self) -> f32;
    /// Whether any of `xs` is a NaN or an infinity: the largest exponent field of them all, a
    /// fold without early exit that the compiler vectorizes.
    fn any_non_finite(xs: &[Self]) -> bool;
}

/// [`Bits::any_non_finite`] of elements whose exponent field is `mask` of their `bits`.
#[inline(always)]
fn exponent_all_ones<T: Copy, B: Ord + Copy + std::ops::BitAnd<Output = B> + From<u8>>(
    xs: &[T],
    bits: impl Fn(T) -> B,
    mask: B,
) -> bool {
    xs.iter().fold(B::from(0), |m, &x| m.max(bits(x) & mask)) == mask
}

/// bf16 bits.
#[derive(Clone, Copy)]
pub(crate) struct Bf16(u16);
/// fp16 bits.
#[derive(Clone, Copy)]
pub(crate) struct Fp16(u16);

/// `$body` with `$t` the element type of the kernels' dtype code `$code` (0 fp32, 1 fp16,
/// else bf16).
macro_rules! each_dtype {
    ($code:expr, $t:ident, $body:expr) => {
        match $code {
            0 => {
                type $t = f32;
                $body
            }
            1 => {
                type $t = $crate::tokens::Fp16;
                $body
            }
            _ => {
                type $t = $crate::tokens::Bf16;
                $body
            }
        }
    };
}
pub(crate) use each_dtype;

impl Bits for Bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    #[inline(always)]
    fn any_non_finite(xs: &[Self]) -> bool {
        exponent_all_ones(xs, |x| x.0, 0x7f80)
    }
}

impl Bits for Fp16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    fn any_non_finite(xs: &[Self]) -> bool {
        exponent_all_ones(xs, |x| x.0, 0x7c00)
    }
}

impl Bits for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn any_non_finite(xs: &[Self]) -> bool {
        exponent_all_ones(xs, f32::to_bits, 0x7f80_0000)
    }
}

/// Each token's key norm averaged over heads, for one block in kvtier's form (`block`: K
/// `[heads, tokens, dim]` then V), into `norms` (`tokens` values); Err(1) / Err(2) when K / V
/// holds a NaN or an infinity. A norm past f32's range is f32's largest value.
fn block_norms<T: Bits>(
    block: &[T],
    (heads, tokens, dim): (usize, usize, usize),
    norms: &mut [f32],
) -> Result<(), u8> {
    let (k, v) = block.split_at(heads * tokens * dim);
    if T::any_non_finite(k) {
        return Err(1);
    }
    if T::any_non_finite(v) {
        return Err(2);
    }
    norms.fill(0.0);
    for head in k.chunks_exact(tokens * dim) {
        for (row, norm) in head.chunks_exact(dim).zip(norms.iter_mut()) {
            let mut lanes = [0.0f32; 16];
            for c in row.chunks(16) {
                for (lane, x) in lanes.iter_mut().zip(c) {
                    let x = x.widen();
                    *lane += x * x;
                }
            }
            *norm += lanes.iter().sum::<f32>().sqrt();
        }
    }
    let per_head = 1.0 / heads.max(1) as f32;
    norms
        .iter_mut()
        .for_each(|n| *n = (*n * per_head).min(f32::MAX));
    Ok(())
}

/// [`block_norms`] of the blocks at `blocks` of `dtype`, a share of them on each thread of
/// rayon's pool when they are many.
///
/// # Safety
/// `blocks` valid for reading `norms.len() / tokens` whole blocks.
unsafe fn blocks_norms(
    blocks: usize,
    shape: (usize, usize, usize),
    dtype: u8,
    norms: &mut [f32],
) -> Result<(), u8> {
    use rayon::prelude::*;
    let (heads, tokens, dim) = shape;
    let per_block = 2 * heads * tokens * dim;
    let n = norms.len() / tokens.max(1);
    each_dtype!(dtype, T, {
        let all = std::slice::from_raw_parts(blocks as *const T, n * per_block);
        let (per_block, tokens) = (per_block.max(1), tokens.max(1));
        if std::mem::size_of_val(all) < crate::paged::PARALLEL_BYTES {
            let mut work = all.chunks_exact(per_block).zip(norms.chunks_mut(tokens));
            return work.try_for_each(|(block, out)| block_norms(block, shape, out));
        }
        let work = all
            .par_chunks_exact(per_block)
            .zip(norms.par_chunks_mut(tokens));
        work.with_min_len(2)
            .try_for_each(|(block, out)| block_norms(block, shape, out))
    })
}

/// Each token's key norm averaged over heads, for `num_blocks` blocks in kvtier's form at
/// `blocks` (contiguous, each `2 * heads * tokens * dim` elements of `dtype`: K `[heads, tokens,
/// dim]` then V), block by block, and 0; or an empty array and 1 / 2 when some K / V holds a
/// NaN or an infinity. The GIL is released meanwhile. The address comes from torch's
/// `data_ptr()` of a tensor the caller (kvtier.manager) has checked and keeps alive: this
/// trusts it.
#[pyfunction]
pub fn block_key_norms(
    py: Python<'_>,
    blocks: usize,
    num_blocks: usize,
    shape: (usize, usize, usize),
    dtype: u8,
) -> PyResult<(Bound<'_, PyArray1<f32>>, u8)> {
    element_bytes(dtype)?;
    let outcome = py.detach(|| {
        let mut norms = vec![0.0f32; num_blocks * shape.1];
        // SAFETY: the tensor holds `num_blocks` whole blocks (see above).
        unsafe { blocks_norms(blocks, shape, dtype, &mut norms) }.map(|()| norms)
    });
    Ok(match outcome {
        Ok(norms) => (PyArray1::from_vec(py, norms), 0),
        Err(bad) => (PyArray1::from_vec(py, Vec::new()), bad),
    })
}
