//! The paged-cache data path (`kvtier-paged`) bound to Python: whole blocks between a paged
//! cache and kvtier's form, their check and key norms, one token's write into a pool row. The
//! addresses come from torch's `data_ptr()` of tensors the caller (`kvtier.manager`,
//! `kvtier.integrations.vllm.paged`) checked and keeps alive: these trust them. The GIL is
//! released while the kernels run.

use kvtier_paged::{Beyond, Blocks, Error, Geometry, Layout};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn value_error(e: Error) -> PyErr {
    PyValueError::new_err(e.0)
}

/// The cache's blocks `ids` of the layout named `layout`, checked (`kvtier_paged::Blocks`).
fn blocks_of<'a>(
    layout: &str,
    (shape, strides): ((usize, usize, usize), (usize, usize)),
    elem: usize,
    at: (usize, usize),
    ids: &'a [i64],
) -> PyResult<Blocks<'a>> {
    let layout = Layout::parse(layout).map_err(value_error)?;
    Blocks::new(layout, Geometry::of(shape, strides), elem, at, ids).map_err(value_error)
}

/// `(norms, 0)`, or an empty array and the refusal's code (1 K, 2 V).
fn norms_or_code(
    py: Python<'_>,
    outcome: Result<Vec<f32>, Beyond>,
) -> (Bound<'_, PyArray1<f32>>, u8) {
    match outcome {
        Ok(norms) => (PyArray1::from_vec(py, norms), 0),
        Err(bad) => (PyArray1::from_vec(py, Vec::new()), bad as u8),
    }
}

/// Copies whole blocks between a paged cache on the CPU and kvtier's block form: cache block
/// `block_ids[i]` (at `cache + block_ids[i] * block_stride` elements of `elem` bytes) and the
/// `2 * H * N * D` contiguous elements at address `blocks[i]`; into the cache when
/// `to_cache`, else out of it. `strides` are a head's and a token's in the cache (the
/// `channels` layout; the CPU layouts' heads are contiguous).
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
    let addrs = blocks.as_slice()?;
    let ids = block_ids.as_slice()?;
    let source = blocks_of(layout, (shape, strides), elem, (cache, block_stride), ids)?;
    // SAFETY: the caller's tensors hold these blocks (see the module's docs).
    py.detach(|| unsafe { source.copy(addrs, to_cache) })
        .map_err(value_error)
}

/// Checks whole blocks of a paged cache on the CPU finite and measures their keys, in place:
/// for cache blocks `block_ids` (as [`paged_copy`] reads them), each token's key norm averaged
/// over heads, block by block, and 0; or an empty array and 1 / 2 when some K / V holds a NaN,
/// an infinity or a value of magnitude past `limit`. `dtype` is the kernels' code (0 fp32, 1
/// fp16, 2 bf16). With `copy_to` (one address a block, as [`paged_copy`]'s `blocks`), each
/// block is also copied out there once checked: on a refusal, some may have been.
#[pyfunction]
#[pyo3(signature = (
    layout, cache, block_stride, strides, block_ids, shape, dtype, copy_to=None,
    limit=f32::INFINITY,
))]
#[allow(clippy::too_many_arguments)]
pub fn paged_scan<'py>(
    py: Python<'py>,
    layout: &str,
    cache: usize,
    block_stride: usize,
    strides: (usize, usize),
    block_ids: PyReadonlyArray1<'_, i64>,
    shape: (usize, usize, usize),
    dtype: u8,
    copy_to: Option<PyReadonlyArray1<'_, u64>>,
    limit: f32,
) -> PyResult<(Bound<'py, PyArray1<f32>>, u8)> {
    let elem = kvtier_paged::element_bytes(dtype).map_err(value_error)?;
    let dsts = match &copy_to {
        Some(addrs) => Some(addrs.as_slice()?),
        None => None,
    };
    let ids = block_ids.as_slice()?;
    let source = blocks_of(layout, (shape, strides), elem, (cache, block_stride), ids)?;
    // SAFETY: the caller's cache holds these blocks, and its destinations (see the module's docs).
    let outcome = py
        .detach(|| unsafe { source.scan(dtype, dsts, limit) })
        .map_err(value_error)?;
    Ok(norms_or_code(py, outcome))
}

/// Copies `bytes` bytes from each address of `srcs` to the address of `dsts` beside it (rows
/// of pools or of staging tensors, whole blocks), rows that do not overlap.
#[pyfunction]
pub fn copy_rows(
    py: Python<'_>,
    srcs: PyReadonlyArray1<'_, u64>,
    dsts: PyReadonlyArray1<'_, u64>,
    bytes: usize,
) -> PyResult<()> {
    let (srcs, dsts) = (srcs.as_slice()?, dsts.as_slice()?);
    // SAFETY: see the module's docs.
    py.detach(|| unsafe { kvtier_paged::copy_rows(srcs, dsts, bytes) })
        .map_err(value_error)
}

/// Writes one token's K and V, `heads` rows of `head_dim` elements each (rows
/// `src_head_stride` elements apart at `k_src` and `v_src`), to rows `dst_head_stride`
/// elements apart at `k_dst` and `v_dst`, once both are known to be finite and within
/// `limit` in magnitude. Returns `(key norm averaged over heads, 0)`, or `(0.0, 1)` /
/// `(0.0, 2)` without writing anything when K / V holds a NaN, an infinity or a larger value.
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
    let dst = (k_dst, v_dst, dst_head_stride);
    let src = (k_src, v_src, src_head_stride);
    // SAFETY: see the module's docs.
    let outcome = unsafe { kvtier_paged::write_token(dst, src, heads, head_dim, dtype, limit) }
        .map_err(value_error)?;
    Ok(match outcome {
        Ok(norm) => (norm, 0),
        Err(bad) => (0.0, bad as u8),
    })
}

/// Each token's key norm averaged over heads, for `num_blocks` blocks in kvtier's form at
/// `blocks` (contiguous, each `2 * heads * tokens * dim` elements of `dtype`: K `[heads, tokens,
/// dim]` then V), block by block, and 0; or an empty array and 1 / 2 when some K / V holds a
/// NaN, an infinity or a value of magnitude past `limit`.
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
    // SAFETY: see the module's docs.
    let outcome = py
        .detach(|| unsafe {
            kvtier_paged::blocks_key_norms(blocks, num_blocks, shape, dtype, limit)
        })
        .map_err(value_error)?;
    Ok(norms_or_code(py, outcome))
}
