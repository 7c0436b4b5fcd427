//! `_core.attend`: the CPU attention kernel (crates/kvtier-attend) over pools given by address.
//! The queries, the output and each pool arrive as raw addresses (torch's `data_ptr()`) with
//! the extents the sizes imply; the masses as an address too or as a numpy array; the block
//! tables and the pool descriptors as numpy arrays, borrowed without a copy. Everything the kernel follows
//! is checked against those extents in the core before a byte is read; what cannot be checked
//! here is that an address holds what the caller says (kvtier.attend.attend_cpu checks the
//! tensors and keeps them alive for the call). The compute runs without the GIL.

use kvtier_attend::{Exec, FloatDtype, Inputs, Outputs, Pool, PoolDesc, Problem, DESC_LEN};
use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{attend_to_py as to_py, invalid};

/// A C-contiguous numpy array of `T`, borrowed: its values.
fn values<'a, 'py, T: numpy::Element>(
    array: &'a PyReadonlyArrayDyn<'py, T>,
    name: &str,
) -> PyResult<&'a [T]> {
    array
        .as_slice()
        .map_err(|_| invalid(format!("{name}: expected a C-contiguous array")))
}

fn borrow<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    obj.extract::<PyReadonlyArrayDyn<'py, T>>().map_err(|_| {
        invalid(format!(
            "{name}: expected a numpy array of {dtype}, got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })
}

/// Bytes `[at, at + len)` as a slice (empty without reading `at` when `len` is 0).
///
/// # Safety
/// `at` must be valid for reads of `len` bytes for `'a`, and not written meanwhile.
unsafe fn bytes_at<'a>(at: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    std::slice::from_raw_parts(at as *const u8, len)
}

fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
}

/// Attention of each sequence's newest `queries` queries over its blocks (see
/// python/kvtier/attend/call.py): writes `out` (`[seqs, queries, q_heads, head_dim]` of `q_dtype`:
/// 0 fp32, 1 fp16, 2 bf16, at `out_ptr`) and `mass` (fp32 `[seqs, max_blocks]` at `mass_ptr`)
/// from `q` (the same shape and dtype at `q_ptr`), `seq_lens` (int32 `[seqs]`), `block_pool` and
/// `block_slot` (int32 `[seqs, max_blocks]`, or flat), `pools` (int64 `[P, 16]` descriptors,
/// each with its `ptr` and `slots * row_bytes` bytes there). `threads`: 0 rayon's pool, 1 this
/// thread only, n a pool of n. `rotation` (float32 `[head_dim]`, ±1): the signs of the rotated
/// pools' Hadamard rotation, when a pool is rotated.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (
    q_ptr, q_dtype, out_ptr, mass, seq_lens, block_pool, block_slot, pools, seqs, queries,
    q_heads, kv_heads, block_size, head_dim, max_blocks, layer, scale, threads = 0,
    rotation = None
))]
pub fn attend(
    py: Python<'_>,
    q_ptr: usize,
    q_dtype: i64,
    out_ptr: usize,
    mass: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    block_pool: &Bound<'_, PyAny>,
    block_slot: &Bound<'_, PyAny>,
    pools: &Bound<'_, PyAny>,
    seqs: usize,
    queries: usize,
    q_heads: usize,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    max_blocks: usize,
    layer: usize,
    scale: f64,
    threads: usize,
    rotation: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let dtype = FloatDtype::from_code(q_dtype).ok_or_else(|| {
        invalid(format!(
            "q_dtype: expected 0 (fp32), 1 (fp16) or 2 (bf16), got {q_dtype}"
        ))
    })?;
    let seq_lens = borrow::<i32>(seq_lens, "seq_lens", "int32")?;
    let block_pool = borrow::<i32>(block_pool, "block_pool", "int32")?;
    let block_slot = borrow::<i32>(block_slot, "block_slot", "int32")?;
    let descs = borrow::<i64>(pools, "pools", "int64")?;
    let rotation = rotation
        .map(|r| borrow::<f32>(r, "rotation", "float32"))
        .transpose()?;
    let signs: &[f32] = match &rotation {
        Some(r) => values(r, "rotation")?,
        None => &[],
    };
    let descs_v = values(&descs, "pools")?;
    let shape = descs.shape();
    if !(shape.len() == 2 && shape[1] == DESC_LEN || shape.len() == 1 && shape[0] == 0) {
        return Err(invalid(format!(
            "pools: expected int64 [pools, {DESC_LEN}] descriptors, got shape {shape:?}"
        )));
    }
    let q_len = [seqs, queries, q_heads, head_dim, dtype.size()]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| invalid("q: its size overflows".into()))?;
    let mass_len = seqs
        .checked_mul(max_blocks)
        .ok_or_else(|| invalid("mass: its size overflows".into()))?;
    // A numpy array is borrowed for writing (held to the end of the call); an int is an address.
    let mut mass_array = mass.extract::<PyReadwriteArrayDyn<'_, f32>>().ok();
    let mass_ptr = match &mut mass_array {
        Some(array) => {
            let c_order = array.is_c_contiguous();
            let values = array
                .as_slice_mut()
                .ok()
                .filter(|_| c_order)
                .ok_or_else(|| {
                    invalid("mass: expected a C-contiguous numpy array of float32".into())
                })?;
            if values.len() != mass_len {
                return Err(invalid(format!(
                    "mass: expected {mass_len} float32s ([{seqs}, {max_blocks}]), got {}",
                    values.len()
                )));
            }
            values.as_mut_ptr() as usize
        }
        None => mass.extract::<usize>().map_err(|_| {
            invalid(format!(
                "mass: expected a writable numpy array of float32 or an address, got {}",
                mass.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?,
    };
    for (name, at, len) in [("q_ptr", q_ptr, q_len), ("out_ptr", out_ptr, q_len)] {
        if at == 0 && len > 0 {
            return Err(invalid(format!("{name}: a null address for {len} bytes")));
        }
    }
    if mass_len > 0 && (mass_ptr == 0 || !mass_ptr.is_multiple_of(4)) {
        return Err(invalid(format!(
            "mass_ptr: expected the non-null, 4-aligned address of {mass_len} float32s"
        )));
    }
    let mut pool_list = Vec::with_capacity(descs_v.len() / DESC_LEN);
    let out_range = (out_ptr, q_len);
    let mass_range = (mass_ptr, 4 * mass_len);
    for (i, fields) in descs_v.chunks_exact(DESC_LEN).enumerate() {
        let desc = PoolDesc::from_fields(i, fields).map_err(to_py)?;
        let extent = desc
            .extent()
            .ok_or_else(|| invalid(format!("pools[{i}]: slots * row_bytes overflows")))?;
        let at = usize::try_from(fields[kvtier_attend::DESC_PTR])
            .map_err(|_| invalid(format!("pools[{i}]: a negative address")))?;
        if at == 0 && extent > 0 {
            return Err(invalid(format!(
                "pools[{i}]: a null address for {extent} bytes"
            )));
        }
        if overlap((at, extent), out_range) || overlap((at, extent), mass_range) {
            return Err(invalid(format!(
                "pools[{i}]: its bytes overlap out or mass"
            )));
        }
        // SAFETY: the caller gives the address of a pool of `slots` rows of `row_bytes` bytes,
        // alive and unwritten for the call (kvtier.attend.attend_cpu holds the tensors).
        let bytes = unsafe { bytes_at(at, extent) };
        pool_list.push(Pool { desc, bytes });
    }
    if overlap(out_range, (q_ptr, q_len)) || overlap(out_range, mass_range) {
        return Err(invalid("out: overlaps q or mass".into()));
    }
    if overlap(mass_range, (q_ptr, q_len)) {
        return Err(invalid("mass: overlaps q".into()));
    }
    // SAFETY: as for the pools: the caller's tensors of these extents, alive for the call;
    // `out` and `mass` overlap nothing else that is read or written (checked above).
    let q = unsafe { bytes_at(q_ptr, q_len) };
    let out: &mut [u8] = if q_len == 0 {
        &mut []
    } else {
        unsafe { std::slice::from_raw_parts_mut(out_ptr as *mut u8, q_len) }
    };
    let mass: &mut [f32] = if mass_len == 0 {
        &mut []
    } else {
        unsafe { std::slice::from_raw_parts_mut(mass_ptr as *mut f32, mass_len) }
    };
    let problem = Problem {
        seqs,
        queries,
        q_heads,
        kv_heads,
        block_size,
        head_dim,
        max_blocks,
        layer,
        scale: scale as f32,
    };
    let inputs = Inputs {
        q,
        dtype,
        seq_lens: values(&seq_lens, "seq_lens")?,
        block_pool: values(&block_pool, "block_pool")?,
        block_slot: values(&block_slot, "block_slot")?,
        pools: &pool_list,
        rotation: signs,
    };
    let exec = Exec {
        threads,
        isa: kvtier_attend::Isa::Auto,
    };
    py.detach(|| kvtier_attend::attend(&problem, &inputs, Outputs { out, mass }, exec))
        .map_err(to_py)
}
