//! `kvtier._core.Simulator`: trace replay in Rust, run in one call, or in chunks so Python can draw progress.

use std::sync::Mutex;

use kvtier::sim::{LoadCosts, Simulator, Trace};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::array;
use crate::core::{counters_dict, usage_rows, PyCore, UsageRow};
use crate::errors::IntoPy;

#[pyclass(name = "Simulator", module = "kvtier._core", frozen)]
pub struct PySimulator {
    inner: Mutex<Simulator>,
}

impl PySimulator {
    fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Simulator) -> R + Send) -> R {
        py.detach(|| f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner())))
    }
}

#[pymethods]
impl PySimulator {
    /// A replay of a trace (CSR `offsets` into chained block `hashes`, `input_tokens` per
    /// request) through a fresh core configured like `core` (whose own state is not touched),
    /// sampling its timeline every `timeline_every` requests and after the last (0: never).
    /// With `recompute_seconds` (per token) and `load_seconds` (per block, by tier of
    /// `Tier::ALL` and level), a request counts only the leading hits whose load pays.
    #[new]
    #[pyo3(signature = (
        core, offsets, hashes, input_tokens, *, step_every = 1, timeline_every = 0,
        recompute_seconds = None, load_seconds = None
    ))]
    #[allow(clippy::too_many_arguments)] // Python keywords
    fn new(
        core: &PyCore,
        offsets: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        input_tokens: &Bound<'_, PyAny>,
        step_every: u64,
        timeline_every: usize,
        recompute_seconds: Option<f64>,
        load_seconds: Option<Vec<f64>>,
    ) -> PyResult<Self> {
        let offsets = array::<u64>(offsets, "offsets", "uint64")?
            .as_array()
            .to_vec();
        let hashes = array::<u64>(hashes, "hashes", "uint64")?
            .as_array()
            .to_vec();
        let input_tokens = array::<u64>(input_tokens, "input_tokens", "uint64")?
            .as_array()
            .to_vec();
        let trace = Trace::new(offsets, hashes, input_tokens).py_err()?;
        let mut sim = Simulator::new(core.config(), trace, step_every).py_err()?;
        sim.sample_every(timeline_every);
        match (recompute_seconds, load_seconds) {
            (Some(recompute_per_token), Some(load_per_block)) => sim
                .set_costs(LoadCosts {
                    recompute_per_token,
                    load_per_block,
                })
                .py_err()?,
            (None, None) => {}
            _ => {
                return Err(kvtier::Error::InvalidArgument {
                    what: "recompute_seconds, load_seconds",
                    reason: "expected both or neither".into(),
                })
                .py_err()
            }
        }
        Ok(PySimulator {
            inner: Mutex::new(sim),
        })
    }

    /// Replays up to `n` more requests (GIL released); returns how many it replayed.
    fn run(&self, py: Python<'_>, n: usize) -> PyResult<usize> {
        self.with(py, |s| s.run(n)).py_err()
    }

    #[getter]
    fn done(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.done())
    }

    #[getter]
    fn total(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.total())
    }

    /// Replay counters; hits by place are `{(tier, level): (blocks, tokens)}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.with(py, |s| s.stats().clone());
        let d = PyDict::new(py);
        d.set_item("requests", st.requests)?;
        d.set_item("ref_blocks", st.ref_blocks)?;
        d.set_item("hit_blocks", st.hit_blocks)?;
        d.set_item("ref_tokens", st.ref_tokens)?;
        d.set_item("hit_tokens", st.hit_tokens)?;
        d.set_item("rejected", st.rejected)?;
        let places = PyDict::new(py);
        for (t, tier) in kvtier::Tier::ALL.iter().enumerate() {
            for (l, (&blocks, &tokens)) in st.hit_blocks_at[t]
                .iter()
                .zip(&st.hit_tokens_at[t])
                .enumerate()
            {
                if blocks > 0 {
                    places.set_item((tier.name(), l), (blocks, tokens))?;
                }
            }
        }
        d.set_item("hits_by_place", places)?;
        d.set_item("peak_tier_bytes", st.peak_tier_bytes)?;
        Ok(d)
    }

    /// Timeline samples so far: `(requests, hit_blocks, ref_blocks, bytes per level)`.
    fn timeline(&self, py: Python<'_>) -> Vec<(usize, u64, u64, Vec<u64>)> {
        self.with(py, |s| {
            s.timeline()
                .iter()
                .map(|p| {
                    (
                        p.requests,
                        p.hit_blocks,
                        p.ref_blocks,
                        p.level_bytes.clone(),
                    )
                })
                .collect()
        })
    }

    /// Occupancy per pool of the simulated core, as `Core.usage()`.
    fn usage(&self, py: Python<'_>) -> Vec<UsageRow> {
        usage_rows(self.with(py, |s| s.core.usage()))
    }

    /// Event counters of the simulated core, as `Core.counters()`.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (k, live, cached) = self.with(py, |s| {
            (
                s.core.counters().clone(),
                s.core.live_blocks(),
                s.core.cached_blocks(),
            )
        });
        counters_dict(py, &k, live as u64, cached)
    }
}
