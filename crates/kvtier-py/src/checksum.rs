//! The stored-value checksum (xxh3-64, `kvtier.stores`): in one call, fused with a copy, or a
//! piece at a time (`StreamingChecksum`).

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use std::hash::Hasher as _;
use twox_hash::XxHash3_64;

/// `parts` as contiguous uint8 arrays (converted where they are not already).
fn byte_arrays<'py>(parts: &[Bound<'py, PyAny>]) -> PyResult<Vec<PyReadonlyArray1<'py, u8>>> {
    parts
        .iter()
        .map(|p| crate::arrays::array::<u8>(p, "parts", "uint8"))
        .collect()
}

fn byte_slices<'a>(arrays: &'a [PyReadonlyArray1<'_, u8>]) -> PyResult<Vec<&'a [u8]>> {
    arrays.iter().map(|a| Ok(a.as_slice()?)).collect()
}

/// xxh3-64 of the concatenation of `parts` (uint8 arrays), read without the GIL: the checksum
/// of stored values (`kvtier.stores`). Streaming, so a header and a payload need no joining copy.
#[pyfunction]
#[pyo3(signature = (*parts, seed = 0))]
pub fn checksum(py: Python<'_>, parts: Vec<Bound<'_, PyAny>>, seed: u64) -> PyResult<u64> {
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

/// Bytes of a stored value read from its file at a time, each hashed right after it is read,
/// while it is in cache.
const READ_CHUNK: u64 = 512 << 10;

/// Reads one stored value whole: its bytes and the xxh3-64 of all but the last 8 (its own
/// checksum field). A file shorter than its size said when opened is read as far as it goes.
fn read_one(path: &str) -> std::io::Result<(Vec<u8>, u64)> {
    use std::io::Read as _;
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let hashed = size.saturating_sub(8) as usize;
    let mut data = Vec::with_capacity(size as usize);
    let mut hasher = XxHash3_64::with_seed(0);
    loop {
        let at = data.len();
        // `read_to_end` fills the spare capacity without zeroing it first.
        let n = (&mut file).take(READ_CHUNK).read_to_end(&mut data)?;
        hasher.write(&data[at.min(hashed)..data.len().min(hashed)]);
        if n == 0 || data.len() as u64 >= size {
            break;
        }
    }
    Ok((data, hasher.finish()))
}

/// Reads stored values from `paths`, without the GIL: for each path in order, a tuple of its
/// bytes (a uint8 array) and the checksum of all but its last 8 bytes (the stored checksum
/// field, which `format.unseal` compares with it), or the `OSError` reading it raised (say
/// `FileNotFoundError`) — one missing file does not stop the others.
#[pyfunction]
pub fn read_checksummed(py: Python<'_>, paths: Vec<String>) -> Vec<Py<PyAny>> {
    let read: Vec<_> = py.detach(|| paths.iter().map(|p| read_one(p)).collect());
    read.into_iter()
        .map(|r| match r {
            Ok((data, digest)) => (numpy::PyArray1::from_vec(py, data), digest)
                .into_pyobject(py)
                .expect("a tuple of an array and an int")
                .into_any()
                .unbind(),
            Err(e) => PyErr::from(e).into_value(py).into_any(),
        })
        .collect()
}
