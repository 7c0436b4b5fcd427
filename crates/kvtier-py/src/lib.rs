//! Python bindings of kvtier: `kvtier._core`. Bindings only — one file per class or group of
//! functions over the core (`kvtier`), the attention kernel (`kvtier-attend`), the paged-cache
//! data path (`kvtier-paged`) and the store engines (`kvtier-store`); errors mapped in `errors.rs`, numpy arrays in through `arrays.rs`.

mod arrays;
mod attend;
mod checksum;
mod codec;
mod core;
mod errors;
mod files;
mod host;
mod paged;
mod plan;
mod sealed;
mod sim;
mod store_index;
mod store_stats;

use pyo3::prelude::*;

/// Chained 64-bit hashes of each full `block_size` block of `tokens` in a namespace — the
/// same hashes `Core.append_tokens` indexes (for a sequence added with `salt`, give the same
/// salt). Stable across processes and machines.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, namespace = "default", salt = None))]
fn prefix_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    namespace: &str,
    salt: Option<core::Salt>,
) -> PyResult<Bound<'py, numpy::PyArray1<u64>>> {
    if block_size == 0 {
        return Err(errors::to_py(kvtier::Error::InvalidArgument {
            what: "block_size",
            reason: "expected a positive number of tokens".into(),
        }));
    }
    let tokens = arrays::array::<u32>(tokens, "tokens", "uint32")?;
    let t = tokens.as_slice()?;
    let seed = kvtier::chain_seed(
        kvtier::namespace_seed(namespace),
        core::Salt::as_deref(&salt),
    )
    .map_err(errors::to_py)?;
    let hashes = py.detach(|| kvtier::prefix_hashes(t, block_size, seed));
    Ok(numpy::PyArray1::from_vec(py, hashes))
}

/// The 64-bit seed of a namespace's hash chain.
#[pyfunction]
fn namespace_seed(namespace: &str) -> u64 {
    kvtier::namespace_seed(namespace)
}

/// The CUDA sources of kvtier's kernels (kernels/*.cu, and kernels/kvtier_common.cuh that the
/// loader puts before each), by file name. Compiled into the extension so that every installed
/// copy of kvtier carries the kernels it was built with.
#[pyfunction]
fn kernel_sources() -> std::collections::HashMap<&'static str, &'static str> {
    std::collections::HashMap::from([
        (
            "kvtier_common.cuh",
            include_str!("../../../kernels/kvtier_common.cuh"),
        ),
        (
            "kvtier_codecs.cu",
            include_str!("../../../kernels/kvtier_codecs.cu"),
        ),
        (
            "kvtier_attend.cu",
            include_str!("../../../kernels/kvtier_attend.cu"),
        ),
    ])
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<core::PyCore>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<sim::PySimulator>()?;
    m.add_class::<store_index::PyStoreIndex>()?;
    m.add_class::<checksum::PyStreamingChecksum>()?;
    m.add_class::<store_stats::PyStoreStats>()?;
    m.add_class::<host::PyHostValues>()?;
    m.add_class::<host::HostValue>()?;
    m.add_function(wrap_pyfunction!(attend::attend, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_seed, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(checksum::copy_checksum, m)?)?;
    m.add_function(wrap_pyfunction!(checksum::checksum, m)?)?;
    m.add_function(wrap_pyfunction!(checksum::digest, m)?)?;
    m.add_function(wrap_pyfunction!(files::read_sealed, m)?)?;
    m.add_function(wrap_pyfunction!(files::read_stored, m)?)?;
    m.add_function(wrap_pyfunction!(files::store_path, m)?)?;
    m.add_function(wrap_pyfunction!(sealed::unseal, m)?)?;
    m.add_function(wrap_pyfunction!(sealed::seal_header, m)?)?;
    m.add_function(wrap_pyfunction!(sealed::pack_texts, m)?)?;
    m.add_function(wrap_pyfunction!(sealed::read_key, m)?)?;
    sealed::add_constants(m)?;
    m.add_function(wrap_pyfunction!(files::write_checksummed, m)?)?;
    m.add_function(wrap_pyfunction!(files::write_stored, m)?)?;
    m.add_function(wrap_pyfunction!(paged::write_token, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_copy, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_scan, m)?)?;
    m.add_function(wrap_pyfunction!(paged::copy_rows, m)?)?;
    m.add_function(wrap_pyfunction!(paged::block_key_norms, m)?)?;
    m.add_function(wrap_pyfunction!(codec::quantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(codec::dequantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(codec::transcode_rows, m)?)?;
    Ok(())
}
