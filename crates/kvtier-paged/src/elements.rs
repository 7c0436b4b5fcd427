//! Element types (bf16, fp16, f32 by the kernels' dtype code), their bound checks, and K/V
//! checked finite with each token's key norm on its way into a level-0 pool: one token written
//! (the decode step's append, without the ~10 small numpy or torch operations, each a
//! microsecond or more, that the same work costs from Python), or whole blocks in kvtier's form
//! checked in one pass.

use kvtier_attend::{f16_to_f32, f32_to_f16};

use crate::{Beyond, Error};

/// Bytes of one element, by the kernels' dtype code: 0 fp32, 1 fp16, 2 bf16.
pub fn element_bytes(dtype: u8) -> Result<usize, Error> {
    match dtype {
        0 => Ok(4),
        1 | 2 => Ok(2),
        _ => Err(Error(format!(
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
/// `limit` in magnitude (the most the manager's ladder holds). Returns the key norm averaged
/// over heads, or which of K and V holds a NaN, an infinity or a larger value (then nothing
/// is written).
///
/// # Safety
/// The source rows valid for reading, the destination rows for writing, as described; no
/// destination row overlaps a source row.
#[allow(clippy::too_many_arguments)]
pub unsafe fn write_token(
    (k_dst, v_dst, dst_head_stride): (usize, usize, usize),
    (k_src, v_src, src_head_stride): (usize, usize, usize),
    heads: usize,
    head_dim: usize,
    dtype: u8,
    limit: f32,
) -> Result<Result<f64, Beyond>, Error> {
    let size = element_bytes(dtype)?;
    let held = |x: f32| x.is_finite() && x.abs() <= limit;
    let mut norm = 0.0f64;
    for h in 0..heads {
        let k = row(k_src + h * src_head_stride * size, head_dim, dtype);
        let mut squares = 0.0f64;
        for x in k {
            if !held(x) {
                return Ok(Err(Beyond::Key));
            }
            squares += f64::from(x) * f64::from(x);
        }
        norm += squares.sqrt();
        let v = row(v_src + h * src_head_stride * size, head_dim, dtype);
        if v.into_iter().any(|x| !held(x)) {
            return Ok(Err(Beyond::Value));
        }
    }
    for h in 0..heads {
        for (src, dst) in [(k_src, k_dst), (v_src, v_dst)] {
            std::ptr::copy_nonoverlapping(
                (src + h * src_head_stride * size) as *const u8,
                (dst + h * dst_head_stride * size) as *mut u8,
                head_dim * size,
            );
        }
    }
    Ok(Ok(norm / heads.max(1) as f64))
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
                type $t = $crate::elements::Fp16;
                $body
            }
            _ => {
                type $t = $crate::elements::Bf16;
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
/// `[heads, tokens, dim]` then V), into `norms` (`tokens` values); `Beyond::Key` / `Beyond::Value` when K / V
/// holds a NaN, an infinity or a value past `bound` ([`Bits::any_beyond`]). A norm past f32's
/// range is f32's largest value.
fn block_norms<T: Bits>(
    block: &[T],
    (heads, tokens, dim): (usize, usize, usize),
    norms: &mut [f32],
    bound: u32,
) -> Result<(), Beyond> {
    let (k, v) = block.split_at(heads * tokens * dim);
    if T::any_beyond(k, bound) {
        return Err(Beyond::Key);
    }
    if T::any_beyond(v, bound) {
        return Err(Beyond::Value);
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

/// Each token's key norm averaged over heads, for `num_blocks` blocks in kvtier's form at
/// `blocks` (contiguous, each `2 * heads * tokens * dim` elements of `dtype`: K `[heads, tokens,
/// dim]` then V), block by block; or which of K and V holds a NaN, an infinity or a value of
/// magnitude past `limit` (the most the manager's ladder holds). A share of the blocks on each
/// thread of rayon's pool when they are many.
///
/// # Safety
/// `blocks` valid for reading `num_blocks` whole blocks.
pub unsafe fn blocks_key_norms(
    blocks: usize,
    num_blocks: usize,
    shape: (usize, usize, usize),
    dtype: u8,
    limit: f32,
) -> Result<Result<Vec<f32>, Beyond>, Error> {
    use rayon::prelude::*;
    element_bytes(dtype)?;
    let (heads, tokens, dim) = shape;
    let per_block = (2 * heads * tokens * dim).max(1);
    let mut norms = vec![0.0f32; num_blocks * tokens];
    let outcome = each_dtype!(dtype, T, {
        let all = std::slice::from_raw_parts(blocks as *const T, num_blocks * per_block);
        let bound = bound_of::<T>(limit);
        let tokens = tokens.max(1);
        if std::mem::size_of_val(all) < crate::layout::PARALLEL_BYTES {
            let mut work = all.chunks_exact(per_block).zip(norms.chunks_mut(tokens));
            work.try_for_each(|(block, out)| block_norms(block, shape, out, bound))
        } else {
            let work = all
                .par_chunks_exact(per_block)
                .zip(norms.par_chunks_mut(tokens));
            work.with_min_len(2)
                .try_for_each(|(block, out)| block_norms(block, shape, out, bound))
        }
    });
    Ok(outcome.map(|()| norms))
}
