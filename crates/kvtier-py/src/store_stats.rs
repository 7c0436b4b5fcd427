//! `kvtier._core.StoreStats`: what a store did (`kvtier_store::StoreCounts`, counted without a
//! lock): Python stores count a batch in one call, the host store's engine as it goes.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use kvtier_store::StoreCounts;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// What a store did since it was opened (all namespaces of its backend together).
#[pyclass(name = "StoreStats", module = "kvtier._core", frozen)]
pub struct PyStoreStats {
    pub(crate) counts: Arc<StoreCounts>,
}

#[pymethods]
impl PyStoreStats {
    #[new]
    fn new() -> Self {
        PyStoreStats {
            counts: Arc::default(),
        }
    }

    /// Values stored.
    #[getter]
    fn puts(&self) -> u64 {
        self.counts.puts.load(Relaxed)
    }

    /// Payload bytes of the values stored.
    #[getter]
    fn put_bytes(&self) -> u64 {
        self.counts.put_bytes.load(Relaxed)
    }

    /// Puts refused or failed: over budget, disk full, server unreachable.
    #[getter]
    fn put_failures(&self) -> u64 {
        self.counts.put_failures.load(Relaxed)
    }

    #[getter]
    fn hits(&self) -> u64 {
        self.counts.hits.load(Relaxed)
    }

    /// Payload bytes of the values served.
    #[getter]
    fn hit_bytes(&self) -> u64 {
        self.counts.hit_bytes.load(Relaxed)
    }

    #[getter]
    fn misses(&self) -> u64 {
        self.counts.misses.load(Relaxed)
    }

    /// Values that failed a check (truncated, bit-flipped, foreign); each also counts as a miss.
    #[getter]
    fn corrupt(&self) -> u64 {
        self.counts.corrupt.load(Relaxed)
    }

    /// Backend errors (I/O, connection); gets that hit one also count as misses.
    #[getter]
    fn errors(&self) -> u64 {
        self.counts.errors.load(Relaxed)
    }

    #[getter]
    fn evictions(&self) -> u64 {
        self.counts.evictions.load(Relaxed)
    }

    #[getter]
    fn deletes(&self) -> u64 {
        self.counts.deletes.load(Relaxed)
    }

    /// A batch of puts: `stored` values of `payload_bytes` in all, `failed` refused or failed.
    fn count_puts(&self, stored: u64, payload_bytes: u64, failed: u64) {
        self.counts.count_puts(stored, payload_bytes, failed);
    }

    /// A batch of gets: `corrupt` of the `misses` failed a check.
    fn count_gets(&self, hits: u64, hit_bytes: u64, misses: u64, corrupt: u64) {
        self.counts.count_gets(hits, hit_bytes, misses, corrupt);
    }

    #[pyo3(signature = (n = 1))]
    fn count_errors(&self, n: u64) {
        self.counts.count_errors(n);
    }

    fn count_evictions(&self, n: u64) {
        self.counts.count_evictions(n);
    }

    fn count_deletes(&self, n: u64) {
        self.counts.count_deletes(n);
    }

    /// The counters by name.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, value) in self.counts.fields() {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let fields: Vec<String> = self
            .counts
            .fields()
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        format!("StoreStats({})", fields.join(", "))
    }
}
