//! The stored-value checksum (xxh3-64, `kvtier.stores`): in one call, fused with a copy, or a
//! piece at a time (`StreamingChecksum`). Files hashed as they are read or written: `files.rs`.

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use std::hash::Hasher as _;
use twox_hash::XxHash3_64;

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

/// xxh3-64 of the concatenation of `parts` (uint8 arrays), read without the GIL: the checksum
/// of stored values (`kvtier.stores`). Streaming, so a header and a payload need no joining copy.
#[pyfunction]
#[pyo3(signature = (*parts, seed = 0))]
pub fn checksum(py: Python<'_>, parts: Vec<Bound<'_, PyAny>>, seed: u64) -> PyResult<u64> {
    // One `bytes` (a store key): hashed in place, without building an array for it.
    if let [only] = parts.as_slice() {
        if let Ok(b) = only.cast::<pyo3::types::PyBytes>() {
            let bytes = b.as_bytes();
            return Ok(py.detach(|| XxHash3_64::oneshot_with_seed(seed, bytes)));
        }
    }
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    Ok(py.detach(|| {
        let mut h = XxHash3_64::with_seed(seed);
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
pub fn copy_checksum(
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
            crate::errors::to_py(kvtier::Error::InvalidArgument {
                what: "out",
                reason: "expected a writable, contiguous uint8 numpy array".into(),
            })
        })?;
    let arrays = byte_arrays(&parts)?;
    let slices = byte_slices(&arrays)?;
    let dst = out.as_slice_mut()?;
    let total: usize = slices.iter().map(|s| s.len()).sum();
    if dst.len() < total {
        return Err(crate::errors::to_py(kvtier::Error::InvalidArgument {
            what: "out",
            reason: format!(
                "{} bytes, expected at least the {total} of the parts",
                dst.len()
            ),
        }));
    }
    Ok(py.detach(|| {
        let mut h = XxHash3_64::with_seed(seed);
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

/// xxh3-64 of bytes given in pieces: `update(*parts)` any number of times, then `digest()` —
/// the value `checksum` gives for all the pieces joined. For writers that hash each chunk of a
/// value just before they send it, while it is in cache.
#[pyclass(name = "StreamingChecksum", module = "kvtier._core")]
pub struct PyStreamingChecksum {
    hasher: XxHash3_64,
}

#[pymethods]
impl PyStreamingChecksum {
    #[new]
    #[pyo3(signature = (seed = 0))]
    fn new(seed: u64) -> Self {
        PyStreamingChecksum {
            hasher: XxHash3_64::with_seed(seed),
        }
    }

    /// Hashes `parts` (uint8 arrays or bytes-like), in order, without the GIL.
    #[pyo3(signature = (*parts))]
    fn update(&mut self, py: Python<'_>, parts: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let arrays = byte_arrays(&parts)?;
        let slices = byte_slices(&arrays)?;
        let hasher = &mut self.hasher;
        py.detach(|| {
            for s in &slices {
                hasher.write(s);
            }
        });
        Ok(())
    }

    /// The checksum of everything given so far (more may still be given).
    fn digest(&self) -> u64 {
        self.hasher.finish()
    }
}
