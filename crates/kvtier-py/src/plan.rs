//! `kvtier._core.Plan`: the moves of one pending plan as numpy columns.

use kvtier::{Plan, NO_SLOT};
use numpy::PyArray1;
use pyo3::prelude::*;

/// `dst_tier` of an eviction.
const NO_TIER: u8 = u8::MAX;

#[pyclass(name = "Plan", module = "kvtier._core", frozen)]
pub struct PyPlan {
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    noop_promotions: u64,
    #[pyo3(get)]
    deferred: u64,
    #[pyo3(get)]
    unmet_bytes: u64,
    /// Write-through copies the plan gives up at commit, for room (their slots take blocks
    /// in the next plan).
    #[pyo3(get)]
    released_copies: usize,
    block: Vec<u32>,
    kind: Vec<u8>,
    src_tier: Vec<u8>,
    src_level: Vec<u8>,
    src_slot: Vec<u32>,
    dst_tier: Vec<u8>,
    dst_level: Vec<u8>,
    dst_slot: Vec<u32>,
}

impl From<&Plan> for PyPlan {
    fn from(p: &Plan) -> Self {
        let m = &p.moves;
        PyPlan {
            id: p.id,
            noop_promotions: p.noop_promotions,
            deferred: p.deferred,
            unmet_bytes: p.unmet_bytes,
            released_copies: p.released.len(),
            block: m.iter().map(|m| m.block).collect(),
            kind: m.iter().map(|m| m.kind as u8).collect(),
            src_tier: m.iter().map(|m| m.src.tier as u8).collect(),
            src_level: m.iter().map(|m| m.src.level).collect(),
            src_slot: m.iter().map(|m| m.src.slot).collect(),
            dst_tier: m
                .iter()
                .map(|m| m.dst.map_or(NO_TIER, |d| d.tier as u8))
                .collect(),
            dst_level: m.iter().map(|m| m.dst.map_or(0, |d| d.level)).collect(),
            dst_slot: m
                .iter()
                .map(|m| m.dst.map_or(NO_SLOT, |d| d.slot))
                .collect(),
        }
    }
}

#[pymethods]
impl PyPlan {
    /// Move kinds by code: 0 demote, 1 promote, 2 offload, 3 fetch, 4 evict, 5 drop, 6 backup.
    #[classattr]
    const KINDS: [&'static str; 7] = [
        "demote", "promote", "offload", "fetch", "evict", "drop", "backup",
    ];
    /// Tiers by code (`dst_tier == 255` for an eviction).
    #[classattr]
    const TIERS: [&'static str; 4] = ["device", "host", "disk", "remote"];
    #[classattr]
    const NO_SLOT: u32 = NO_SLOT;
    #[classattr]
    const NO_TIER: u8 = NO_TIER;

    #[getter]
    fn block<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.block)
    }
    #[getter]
    fn kind<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.kind)
    }
    #[getter]
    fn src_tier<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.src_tier)
    }
    #[getter]
    fn src_level<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.src_level)
    }
    #[getter]
    fn src_slot<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.src_slot)
    }
    #[getter]
    fn dst_tier<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.dst_tier)
    }
    #[getter]
    fn dst_level<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        PyArray1::from_slice(py, &self.dst_level)
    }
    #[getter]
    fn dst_slot<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.dst_slot)
    }

    /// Number of moves of each kind, by name.
    fn summary(&self) -> std::collections::BTreeMap<&'static str, usize> {
        let mut out = std::collections::BTreeMap::new();
        for &k in &self.kind {
            *out.entry(Self::KINDS[usize::from(k)]).or_insert(0) += 1;
        }
        out
    }

    fn __len__(&self) -> usize {
        self.block.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(id={}, moves={}, {:?})",
            self.id,
            self.block.len(),
            self.summary()
        )
    }
}
