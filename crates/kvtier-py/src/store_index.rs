//! `kvtier._core.StoreIndex`: which values a host or disk store evicts, under a core policy
//! (`kvtier::StoreIndex`), shared with the store engines that keep it (`kvtier_store`).

use std::sync::{Arc, MutexGuard};

use kvtier::{Error, PolicyKind, StoreIndex};
use kvtier_store::SharedIndex;
use pyo3::prelude::*;

use crate::errors::IntoPy;

#[pyclass(name = "StoreIndex", module = "kvtier._core", frozen)]
pub struct PyStoreIndex {
    pub(crate) inner: Arc<SharedIndex>,
}

impl PyStoreIndex {
    fn lock(&self) -> MutexGuard<'_, StoreIndex> {
        self.inner.lock()
    }
}

#[pymethods]
impl PyStoreIndex {
    /// Keys and sizes of a store's values within `budget` bytes, ranked by `policy` (lru, lfu,
    /// or importance / h2o / scissorhands: the caller's scores, then as lfu). `decay` is the
    /// per-batch decay of access counts.
    #[new]
    #[pyo3(signature = (policy, budget, *, decay = 0.9))]
    fn new(policy: &str, budget: i64, decay: f32) -> PyResult<Self> {
        let budget = u64::try_from(budget)
            .map_err(|_| Error::InvalidArgument {
                what: "budget",
                reason: format!("{budget}; expected bytes >= 0"),
            })
            .py_err()?;
        let index = StoreIndex::new(PolicyKind::parse(policy).py_err()?, budget, decay).py_err()?;
        Ok(PyStoreIndex {
            inner: Arc::new(SharedIndex::new(index)),
        })
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.lock().policy().name()
    }

    #[getter]
    fn budget(&self) -> u64 {
        self.lock().budget()
    }

    #[getter]
    fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }

    fn __contains__(&self, key: &str) -> bool {
        self.lock().contains(key)
    }

    /// Records `nbytes` under `key` (replacing what it held), evicting the lowest-ranked other
    /// keys until it fits; returns them, lowest first. None, with nothing changed, when
    /// `nbytes` is over the whole budget.
    fn admit(&self, key: &str, nbytes: u64) -> Option<Vec<String>> {
        self.lock().admit(key, nbytes)
    }

    /// Forgets `key`; returns the bytes it held, or None.
    fn remove(&self, key: &str) -> Option<u64> {
        self.lock().remove(key)
    }

    /// One batch of reads of `keys` (unknown keys are skipped).
    fn touch(&self, keys: Vec<String>) {
        self.lock().touch(&keys);
    }

    /// The caller's score of each key, what the signal-ranked policies evict by first.
    fn set_scores(&self, keys: Vec<String>, scores: Vec<f32>) -> PyResult<()> {
        self.lock().set_scores(&keys, &scores).py_err()
    }

    /// Links each key to the key before it in a prefix (`parents[i]` before `keys[i]`): a key
    /// with children is evicted only after them. Pairs not both held, keys linked already and
    /// links that would close a cycle are skipped.
    fn set_parents(&self, keys: Vec<String>, parents: Vec<String>) -> PyResult<()> {
        self.lock().set_parents(&keys, &parents).py_err()
    }

    /// The keys, lowest-ranked (next evicted) first.
    fn eviction_order(&self) -> Vec<String> {
        self.lock().eviction_order()
    }
}
