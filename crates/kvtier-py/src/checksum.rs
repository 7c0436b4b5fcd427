//! `kvtier._core`'s checksum and digest functions over Python bytes: the stored-value checksum
//! (CRC-64/NVME) in one call, fused with a copy, or a piece at a time (`StreamingChecksum`);
//! and `digest`, the xxh3-64 that names things. The engines are `kvtier_store::checksum`'s.

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use kvtier_store::checksum::{self as engine, Checksum};

/// `parts` as contiguous uint8 arrays (converted where they are not already).
pub(crate) fn byte_arrays<'py>(
    parts: &[Bound<'py, PyAny>],
) -> PyResult<Vec<PyReadonlyArray1<'py, u8>>> {
    parts
        .iter()
        .map(|p| crate::arrays::bytes_array(p, "parts"))
        .collect()
}

pub(crate) fn byte_slices<'a>(arrays: &'a [PyReadonlyArray1<'_, u8>]) -> PyResult<Vec<&'a [u8]>> {
    arrays.iter().map(|a| Ok(a.as_slice()?)).collect()
}

/// The checksum of the concatenation of `parts` (uint8 arrays or bytes-like), read without the
/// GIL: the checksum of stored values. Streaming, so a header and a payload need no joining copy.
#[pyfunction]
#[pyo3(signature = (*parts))]
pub fn checksum(py: Python<'_>, parts: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    Ok(py.detach(|| Checksum::of_parts(&slices)))
}

/// xxh3-64 of the concatenation of `parts` with `seed`: the digest that names a namespace or a
/// selection of tokens (not a checksum: a CRC is linear, so it makes a poor name).
#[pyfunction]
#[pyo3(signature = (*parts, seed = 0))]
pub fn digest(py: Python<'_>, parts: Vec<Bound<'_, PyAny>>, seed: u64) -> PyResult<u64> {
    // One `bytes` (a store key): hashed in place, without building an array for it.
    if let [only] = parts.as_slice() {
        if let Ok(b) = only.cast::<pyo3::types::PyBytes>() {
            let bytes = b.as_bytes();
            return Ok(py.detach(|| engine::digest(&[bytes], seed)));
        }
    }
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    Ok(py.detach(|| engine::digest(&slices, seed)))
}

/// Copies `parts` (uint8 arrays) one after another into the start of `out` (a writable,
/// contiguous uint8 array at least as long) and returns the checksum of the copied bytes. One
/// pass without the GIL: each chunk is checksummed right after it is copied, while it is still
/// in cache, so sealing a value costs about what copying it does.
#[pyfunction]
#[pyo3(signature = (out, *parts))]
pub fn copy_checksum(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    parts: Vec<Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let mut out = out
        .extract::<numpy::PyReadwriteArray1<'_, u8>>()
        .ok()
        .filter(|a| a.as_slice().is_ok())
        .ok_or_else(|| {
            crate::errors::to_py(kvtier::Error::InvalidArgument {
                what: "out",
                reason: "expected a writable, contiguous uint8 numpy array".into(),
            })
        })?;
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    let dst = out.as_slice_mut()?;
    let len = dst.len();
    py.detach(|| engine::copy_checksum(dst, &slices))
        .ok_or_else(|| {
            let total: usize = slices.iter().map(|s| s.len()).sum();
            crate::errors::to_py(kvtier::Error::InvalidArgument {
                what: "out",
                reason: format!("{len} bytes, expected at least the {total} of the parts"),
            })
        })
}

/// The checksum of bytes given in pieces: `update(*parts)` any number of times, then
/// `digest()` — the value `checksum` gives for all the pieces joined. For writers that checksum
/// each chunk of a value just after they send it, while it is in cache.
#[pyclass(name = "StreamingChecksum", module = "kvtier._core")]
pub struct PyStreamingChecksum {
    sum: Checksum,
}

#[pymethods]
impl PyStreamingChecksum {
    #[new]
    fn new() -> Self {
        PyStreamingChecksum {
            sum: Checksum::new(),
        }
    }

    /// Checksums `parts` (uint8 arrays or bytes-like), in order, without the GIL.
    #[pyo3(signature = (*parts))]
    fn update(&mut self, py: Python<'_>, parts: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let arrays = byte_arrays(&parts)?;
        let slices = byte_slices(&arrays)?;
        let sum = &mut self.sum;
        py.detach(|| {
            for s in &slices {
                sum.update(s);
            }
        });
        Ok(())
    }

    /// The checksum of everything given so far (more may still be given).
    fn digest(&self) -> u64 {
        self.sum.value()
    }
}
