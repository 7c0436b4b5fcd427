//! `_core.quantize_rows`, `_core.dequantize_rows` and `_core.transcode_rows`: the quantized
//! codecs on the CPU (crates/kvtier-attend/src/codec.rs) over rows given by address, as
//! `copy_rows` takes them: a numpy uint64 array of row addresses for each side (torch's
//! `data_ptr()` plus slot times row size), the format as the 10 int64s of
//! python/kvtier/codecs/layout.py, the block dimensions. Checked here: the addresses (non-null,
//! no overflow), that no destination row overlaps another or any source row (so the slices below
//! are sound), and in the core everything else (the format against the dimensions and the row
//! size). What cannot be checked is that an address holds what the caller says
//! (kvtier.codecs.native checks the tensors and keeps them alive for the call). The work runs
//! without the GIL.

use std::ops::Range;

use kvtier_attend::{BlockDims, Exec, FloatDtype, PackedFormat};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::arrays::array;
use crate::errors::{attend_to_py, invalid};

type Dims = (usize, usize, usize, usize);

fn block_dims((layers, heads, block, dim): Dims) -> BlockDims {
    BlockDims {
        layers,
        heads,
        block,
        dim,
    }
}

fn dtype_of(code: i64) -> PyResult<FloatDtype> {
    FloatDtype::from_code(code).ok_or_else(|| {
        invalid(format!(
            "dtype: expected 0 (fp32), 1 (fp16) or 2 (bf16), got {code}"
        ))
    })
}

fn format_of(layout: &Bound<'_, PyAny>, what: &str) -> PyResult<PackedFormat> {
    let fields: PyReadonlyArray1<'_, i64> = array(layout, what, "int64")?;
    PackedFormat::from_layout(fields.as_slice()?).map_err(|e| invalid(format!("{what}: {e}")))
}

/// Bytes of one block of `layers` layers of `dims` in `dtype` (None on overflow).
fn block_bytes(dims: Dims, layers: usize, dtype: FloatDtype) -> PyResult<usize> {
    [layers, 2, dims.1, dims.2, dims.3, dtype.size()]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| invalid("dims: the block's size overflows".into()))
}

/// The byte ranges `[address, address + len)` of `addrs`, checked non-null and in range.
fn ranges(addrs: &Bound<'_, PyAny>, what: &str, len: usize) -> PyResult<Vec<Range<usize>>> {
    let addrs: PyReadonlyArray1<'_, u64> = array(addrs, what, "uint64")?;
    addrs
        .as_slice()?
        .iter()
        .map(|&a| {
            let at = usize::try_from(a).ok().filter(|&a| a != 0 || len == 0);
            match at.and_then(|at| at.checked_add(len).map(|end| at..end)) {
                Some(r) => Ok(r),
                None => Err(invalid(format!(
                    "{what}: address {a:#x} cannot hold a row of {len} bytes"
                ))),
            }
        })
        .collect()
}

/// Refuses destination rows that overlap one another (a slot twice) or any source row.
fn check_disjoint(src: &[Range<usize>], dst: &[Range<usize>]) -> PyResult<()> {
    if src.len() != dst.len() {
        return Err(invalid(format!(
            "expected as many dst rows as src rows, got {} and {}",
            dst.len(),
            src.len()
        )));
    }
    let mut sorted: Vec<&Range<usize>> = dst.iter().filter(|r| !r.is_empty()).collect();
    sorted.sort_unstable_by_key(|r| r.start);
    if sorted.windows(2).any(|w| w[1].start < w[0].end) {
        return Err(invalid(
            "dst: rows overlap (a destination slot given twice?)".into(),
        ));
    }
    for r in src.iter().filter(|r| !r.is_empty()) {
        // the last destination row that starts before `r` ends is the only one that can reach
        // into it: the rows are sorted and disjoint
        let i = sorted.partition_point(|d| d.start < r.end);
        if i > 0 && sorted[i - 1].end > r.start {
            return Err(invalid("src and dst rows overlap".into()));
        }
    }
    Ok(())
}

/// # Safety
/// Each range must be readable memory, alive and unwritten for `'a`.
unsafe fn reads<'a>(rows: &[Range<usize>]) -> Vec<&'a [u8]> {
    rows.iter()
        .map(|r| {
            if r.is_empty() {
                &[][..]
            } else {
                std::slice::from_raw_parts(r.start as *const u8, r.len())
            }
        })
        .collect()
}

/// # Safety
/// Each range must be writable memory, alive for `'a`, read or written by nothing else meanwhile
/// (disjoint from the others and from every source: [`check_disjoint`]).
unsafe fn writes<'a>(rows: &[Range<usize>]) -> Vec<&'a mut [u8]> {
    rows.iter()
        .map(|r| {
            if r.is_empty() {
                &mut [][..]
            } else {
                std::slice::from_raw_parts_mut(r.start as *mut u8, r.len())
            }
        })
        .collect()
}

/// A rotated format's signs, copied (float32 `[D]`), or None.
fn signs_of(rotation: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<f32>>> {
    rotation
        .map(|r| {
            let a = r
                .extract::<numpy::PyReadonlyArray1<'_, f32>>()
                .map_err(|_| invalid("rotation: expected a 1-D float32 array".into()))?;
            Ok(a.as_slice()
                .map_err(|_| invalid("rotation: expected a contiguous array".into()))?
                .to_vec())
        })
        .transpose()
}

fn exec(threads: usize) -> Exec {
    Exec {
        threads,
        isa: kvtier_attend::Isa::Auto,
    }
}

/// Quantizes float blocks into packed rows: block at address `src[i]` (`[L, 2, H, B, D]` of
/// `dtype`: 0 fp32, 1 fp16, 2 bf16; `dims` is `(L, H, B, D)`) into the row at `dst[i]`, in the
/// packed format `layout`. `threads`: 0 rayon's pool, 1 this thread only, n a pool of n.
/// `rotation` (float32 `[D]`, ±1): a rotated format's signs.
#[pyfunction]
#[pyo3(signature = (src, dst, layout, dims, dtype, threads = 0, rotation = None))]
#[allow(clippy::too_many_arguments)]
pub fn quantize_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    layout: &Bound<'_, PyAny>,
    dims: Dims,
    dtype: i64,
    threads: usize,
    rotation: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let dtype = dtype_of(dtype)?;
    let to = format_of(layout, "layout")?;
    let signs = signs_of(rotation)?;
    let src = ranges(src, "src", block_bytes(dims, dims.0, dtype)?)?;
    let dst = ranges(dst, "dst", to.row_bytes)?;
    check_disjoint(&src, &dst)?;
    // SAFETY: the caller's tensors hold these rows for the call (see the module's doc); the
    // destinations overlap nothing else (checked above).
    let (src, mut dst) = unsafe { (reads(&src), writes(&dst)) };
    py.detach(|| {
        kvtier_attend::quantize(
            block_dims(dims),
            dtype,
            &to,
            &src,
            &mut dst,
            signs.as_deref().unwrap_or(&[]),
            exec(threads),
        )
    })
    .map_err(attend_to_py)
}

/// Dequantizes `layers = (first, count)` layers of the packed rows at `src` (format `layout`)
/// into float blocks of those layers (`[count, 2, H, B, D]` of `dtype`) at `dst`.
#[pyfunction]
#[pyo3(signature = (src, dst, layout, dims, dtype, layers, threads = 0, rotation = None))]
#[allow(clippy::too_many_arguments)]
pub fn dequantize_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    layout: &Bound<'_, PyAny>,
    dims: Dims,
    dtype: i64,
    layers: (usize, usize),
    threads: usize,
    rotation: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let dtype = dtype_of(dtype)?;
    let from = format_of(layout, "layout")?;
    let signs = signs_of(rotation)?;
    let (first, count) = layers;
    let end = first
        .checked_add(count)
        .ok_or_else(|| invalid("layers: first + count overflows".into()))?;
    let src = ranges(src, "src", from.row_bytes)?;
    let dst = ranges(dst, "dst", block_bytes(dims, count, dtype)?)?;
    check_disjoint(&src, &dst)?;
    // SAFETY: as in `quantize_rows`.
    let (src, mut dst) = unsafe { (reads(&src), writes(&dst)) };
    py.detach(|| {
        kvtier_attend::dequantize(
            block_dims(dims),
            &from,
            first..end,
            &src,
            dtype,
            &mut dst,
            signs.as_deref().unwrap_or(&[]),
            exec(threads),
        )
    })
    .map_err(attend_to_py)
}

/// Repacks the rows at `src` (format `src_layout`) as rows of `dst_layout` at `dst`, the values
/// between the two kept in fp32.
#[pyfunction]
#[pyo3(signature = (src, src_layout, dst, dst_layout, dims, threads = 0, rotation = None))]
#[allow(clippy::too_many_arguments)]
pub fn transcode_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    src_layout: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    dst_layout: &Bound<'_, PyAny>,
    dims: Dims,
    threads: usize,
    rotation: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let from = format_of(src_layout, "src_layout")?;
    let to = format_of(dst_layout, "dst_layout")?;
    let signs = signs_of(rotation)?;
    let src = ranges(src, "src", from.row_bytes)?;
    let dst = ranges(dst, "dst", to.row_bytes)?;
    check_disjoint(&src, &dst)?;
    // SAFETY: as in `quantize_rows`.
    let (src, mut dst) = unsafe { (reads(&src), writes(&dst)) };
    py.detach(|| {
        kvtier_attend::transcode(
            block_dims(dims),
            &from,
            &to,
            &src,
            &mut dst,
            signs.as_deref().unwrap_or(&[]),
            exec(threads),
        )
    })
    .map_err(attend_to_py)
}
