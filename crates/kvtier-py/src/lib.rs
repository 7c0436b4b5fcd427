//! Python bindings of the kvtier core: `kvtier._core`. Bindings only — one file per class,
//! errors mapped in `errors.rs`, numpy arrays in through `arrays.rs`.

mod arrays;
mod core;
mod errors;
mod plan;
mod sim;
mod store_index;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use std::hash::Hasher as _;

/// Chained 64-bit hashes of each full `block_size` block of `tokens` in a namespace — the
/// same hashes `Core.append_tokens` indexes. Stable across processes and machines.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, namespace = "default"))]
fn prefix_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    namespace: &str,
) -> PyResult<Bound<'py, numpy::PyArray1<u64>>> {
    if block_size == 0 {
        return Err(errors::to_py(kvtier::Error::InvalidArgument {
            what: "block_size",
            reason: "expected a positive number of tokens".into(),
        }));
    }
    let tokens = arrays::array::<u32>(tokens, "tokens", "uint32")?;
    let t = tokens.as_slice()?;
    let seed = kvtier::namespace_seed(namespace);
    let hashes = py.detach(|| kvtier::prefix_hashes(t, block_size, seed));
    Ok(numpy::PyArray1::from_vec(py, hashes))
}

/// The 64-bit seed of a namespace's hash chain.
#[pyfunction]
fn namespace_seed(namespace: &str) -> u64 {
    kvtier::namespace_seed(namespace)
}

/// `parts` as contiguous uint8 arrays (converted where they are not already).
fn byte_arrays<'py>(parts: &[Bound<'py, PyAny>]) -> PyResult<Vec<PyReadonlyArray1<'py, u8>>> {
    parts
        .iter()
        .map(|p| arrays::array::<u8>(p, "parts", "uint8"))
        .collect()
}

fn byte_slices<'a>(arrays: &'a [PyReadonlyArray1<'_, u8>]) -> PyResult<Vec<&'a [u8]>> {
    arrays.iter().map(|a| Ok(a.as_slice()?)).collect()
}

/// xxh3-64 of the concatenation of `parts` (uint8 arrays), read without the GIL: the checksum
/// of stored values (`kvtier.stores`). Streaming, so a header and a payload need no joining copy.
#[pyfunction]
#[pyo3(signature = (*parts, seed = 0))]
fn checksum(py: Python<'_>, parts: Vec<Bound<'_, PyAny>>, seed: u64) -> PyResult<u64> {
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    Ok(py.detach(|| {
        let mut h = twox_hash::XxHash3_64::with_seed(seed);
        for s in &slices {
            h.write(s);
        }
        h.finish()
    }))
}

/// Copies `parts` (uint8 arrays) one after another into the start of `out` (a writable,
/// contiguous uint8 array at least as long) and returns the xxh3-64 of the copied bytes, with
/// `seed`. One pass without the GIL: each chunk is hashed right after it is copied, while it is
/// still in cache, so sealing a value costs about what copying it does.
#[pyfunction]
#[pyo3(signature = (out, *parts, seed = 0))]
fn copy_checksum(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    parts: Vec<Bound<'_, PyAny>>,
    seed: u64,
) -> PyResult<u64> {
    const CHUNK: usize = 64 << 10;
    let mut out = out
        .extract::<numpy::PyReadwriteArray1<'_, u8>>()
        .ok()
        .filter(|a| a.as_slice().is_ok())
        .ok_or_else(|| {
            errors::to_py(kvtier::Error::InvalidArgument {
                what: "out",
                reason: "expected a writable, contiguous uint8 numpy array".into(),
            })
        })?;
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    let dst = out.as_slice_mut()?;
    let total: usize = slices.iter().map(|s| s.len()).sum();
    if dst.len() < total {
        return Err(errors::to_py(kvtier::Error::InvalidArgument {
            what: "out",
            reason: format!(
                "{} bytes, expected at least the {total} of the parts",
                dst.len()
            ),
        }));
    }
    Ok(py.detach(|| {
        let mut h = twox_hash::XxHash3_64::with_seed(seed);
        let mut at = 0;
        for s in &slices {
            for chunk in s.chunks(CHUNK) {
                let copied = &mut dst[at..at + chunk.len()];
                copied.copy_from_slice(chunk);
                h.write(copied);
                at += chunk.len();
            }
        }
        h.finish()
    }))
}

/// The CUDA sources of kvtier's kernels (kernels/*.cu), by file name. Compiled into the
/// extension so that every installed copy of kvtier carries the kernels it was built with.
#[pyfunction]
fn kernel_sources() -> std::collections::HashMap<&'static str, &'static str> {
    std::collections::HashMap::from([(
        "kvtier_codecs.cu",
        include_str!("../../../kernels/kvtier_codecs.cu"),
    )])
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<core::PyCore>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<sim::PySimulator>()?;
    m.add_class::<store_index::PyStoreIndex>()?;
    m.add_function(wrap_pyfunction!(prefix_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_seed, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(copy_checksum, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    Ok(())
}
