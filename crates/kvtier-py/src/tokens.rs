//! K/V checked finite, with each token's key norm, on its way into a level-0 pool: one token
//! written (the decode step's append, without the ~10 small numpy or torch operations, each a
//! microsecond or more, that the same work costs from Python), or whole blocks checked in one
//! pass (the vLLM connector's saves).

use kvtier_attend::{f16_to_f32, f32_to_f16};
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
/// elements apart at `k_dst` and `v_dst`, once both are known to be finite and within
/// `limit` in magnitude (the most the manager's ladder holds). Returns `(key norm averaged
/// over heads, 0)`, or `(0.0, 1)` / `(0.0, 2)` without writing anything when K / V holds a
/// NaN, an infinity or a larger value. The addresses come from torch's `data_ptr()` of
/// tensors the caller (kvtier.manager) has checked and keeps alive: this trusts them.
#[pyfunction]
#[pyo3(signature = (
    k_dst, v_dst, dst_head_stride, k_src, v_src, src_head_stride, heads, head_dim, dtype,
    limit=f32::INFINITY,
))]
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
    limit: f32,
) -> PyResult<(f64, u8)> {
    let size = element_bytes(dtype)?;
    let held = |x: f32| x.is_finite() && x.abs() <= limit;
    let mut norm = 0.0f64;
    for h in 0..heads {
        // SAFETY: the caller passes rows of `head_dim` elements of `dtype` `src_head_stride`
        // elements apart for `heads` heads.
        let k = unsafe { row(k_src + h * src_head_stride * size, head_dim, dtype) };
        let mut squares = 0.0f64;
        for x in k {
            if !held(x) {
                return Ok((0.0, 1));
            }
            squares += f64::from(x) * f64::from(x);
        }
        norm += squares.sqrt();
        // SAFETY: as above, for V.
        let v = unsafe { row(v_src + h * src_head_stride * size, head_dim, dtype) };
        if v.into_iter().any(|x| !held(x)) {
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

/// An element type's bits: whether values stay within a bound of magnitude (NaN and the
/// infinities never do), and the value as f32.
pub(crate) trait Bits: Copy + Send + Sync {
    /// Bits of the type's largest finite value: the bound that refuses NaN and infinities only.
    const FINITE: u32;
    fn widen(self) -> f32;
    /// The bits (sign cleared) of the largest value of this type at most `limit` (a positive
    /// f32, or infinity: [`Bits::FINITE`]): magnitudes compare as their bits do.
    fn bound(limit: f32) -> u32;
    /// Whether any of `xs` is a NaN, an infinity or larger in magnitude than `bound`'s value:
    /// the largest magnitude field of them all, a fold without early exit that the compiler
    /// vectorizes.
    fn any_beyond(xs: &[Self], bound: u32) -> bool;
}

/// [`Bits::any_beyond`] of elements whose magnitude field is `mask` of their `bits`.
#[inline(always)]
fn magnitude_beyond<T: Copy, B: Ord + Copy + std::ops::BitAnd<Output = B> + From<u8>>(
    xs: &[T],
    bits: impl Fn(T) -> B,
    mask: B,
    bound: B,
) -> bool {
    xs.iter().fold(B::from(0), |m, &x| m.max(bits(x) & mask)) > bound
}

/// The limit a caller passes as the bound of type `T`: infinity (or anything past `T`'s
/// range) refuses NaN and infinities only.
pub(crate) fn bound_of<T: Bits>(limit: f32) -> u32 {
    if limit.is_nan() || limit < 0.0 {
        0
    } else {
        T::bound(limit).min(T::FINITE)
    }
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
    const FINITE: u32 = 0x7f7f;
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    fn bound(limit: f32) -> u32 {
        limit.min(f32::MAX).to_bits() >> 16 // truncation: the largest bf16 at most `limit`
    }
    #[inline(always)]
    fn any_beyond(xs: &[Self], bound: u32) -> bool {
        magnitude_beyond(xs, |x| x.0, 0x7fff, bound as u16)
    }
}

impl Bits for Fp16 {
    const FINITE: u32 = 0x7bff;
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_to_f32(self.0)
    }
    fn bound(limit: f32) -> u32 {
        let near = u32::from(f32_to_f16(limit.min(65504.0)));
        if f16_to_f32(near as u16) > limit {
            near - 1 // rounded up: the fp16 below it
        } else {
            near
        }
    }
    #[inline(always)]
    fn any_beyond(xs: &[Self], bound: u32) -> bool {
        magnitude_beyond(xs, |x| x.0, 0x7fff, bound as u16)
    }
}

impl Bits for f32 {
    const FINITE: u32 = 0x7f7f_ffff;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    fn bound(limit: f32) -> u32 {
        limit.min(f32::MAX).to_bits()
    }
    #[inline(always)]
    fn any_beyond(xs: &[Self], bound: u32) -> bool {
        magnitude_beyond(xs, f32::to_bits, 0x7fff_ffff, bound)
    }
}

/// Each token's key norm averaged over heads, for one block in kvtier's form (`block`: K
/// `[heads, tokens, dim]` then V), into `norms` (`tokens` values); Err(1) / Err(2) when K / V
/// holds a NaN, an infinity or a value past `bound` ([`Bits::any_beyond`]). A norm past f32's
/// range is f32's largest value.
fn block_norms<T: Bits>(
    block: &[T],
    (heads, tokens, dim): (usize, usize, usize),
    norms: &mut [f32],
    bound: u32,
) -> Result<(), u8> {
    let (k, v) = block.split_at(heads * tokens * dim);
    if T::any_beyond(k, bound) {
        return Err(1);
    }
    if T::any_beyond(v, bound) {
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
    limit: f32,
) -> Result<(), u8> {
    use rayon::prelude::*;
    let (heads, tokens, dim) = shape;
    let per_block = 2 * heads * tokens * dim;
    let n = norms.len() / tokens.max(1);
    each_dtype!(dtype, T, {
        let all = std::slice::from_raw_parts(blocks as *const T, n * per_block);
        let bound = bound_of::<T>(limit);
        let (per_block, tokens) = (per_block.max(1), tokens.max(1));
        if std::mem::size_of_val(all) < crate::paged::PARALLEL_BYTES {
            let mut work = all.chunks_exact(per_block).zip(norms.chunks_mut(tokens));
            return work.try_for_each(|(block, out)| block_norms(block, shape, out, bound));
        }
        let work = all
            .par_chunks_exact(per_block)
            .zip(norms.par_chunks_mut(tokens));
        work.with_min_len(2)
            .try_for_each(|(block, out)| block_norms(block, shape, out, bound))
    })
}

/// Each token's key norm averaged over heads, for `num_blocks` blocks in kvtier's form at
/// `blocks` (contiguous, each `2 * heads * tokens * dim` elements of `dtype`: K `[heads, tokens,
/// dim]` then V), block by block, and 0; or an empty array and 1 / 2 when some K / V holds a
/// NaN, an infinity or a value of magnitude past `limit` (the most the manager's ladder
/// holds). The GIL is released meanwhile. The address comes from torch's `data_ptr()` of a
/// tensor the caller (kvtier.manager) has checked and keeps alive: this trusts it.
#[pyfunction]
#[pyo3(signature = (blocks, num_blocks, shape, dtype, limit=f32::INFINITY))]
pub fn block_key_norms(
    py: Python<'_>,
    blocks: usize,
    num_blocks: usize,
    shape: (usize, usize, usize),
    dtype: u8,
    limit: f32,
) -> PyResult<(Bound<'_, PyArray1<f32>>, u8)> {
    element_bytes(dtype)?;
    let outcome = py.detach(|| {
        let mut norms = vec![0.0f32; num_blocks * shape.1];
        // SAFETY: the tensor holds `num_blocks` whole blocks (see above).
        unsafe { blocks_norms(blocks, shape, dtype, &mut norms, limit) }.map(|()| norms)
    });
    Ok(match outcome {
        Ok(norms) => (PyArray1::from_vec(py, norms), 0),
        Err(bad) => (PyArray1::from_vec(py, Vec::new()), bad),
    })
}
