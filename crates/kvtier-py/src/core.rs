//! `kvtier._core.Core`: the block table, pools, statistics and scheduler of one engine.
//! The Rust `Core` sits behind a mutex; every call runs through [`PyCore::with`], which releases
//! the GIL first, so batch calls never block other Python threads.

use std::sync::Mutex;

use kvtier::{Config, Core, Error, PolicyKind, Tier, TierConfig};
use numpy::PyArray1;
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::array;
use crate::errors::{to_py, IntoPy};
use crate::plan::PyPlan;

/// A core method taking one f32 value per block (`record_attention`, `set_magnitude`, ...).
type PerBlockCall = fn(&mut Core, &[u32], &[f32]) -> Result<(), Error>;

/// One pool's occupancy as Python sees it: `(tier, level, used_slots, capacity_slots, bytes)`.
pub type UsageRow = (&'static str, u8, u32, u32, u64);

pub fn usage_rows(usage: Vec<kvtier::PoolUsage>) -> Vec<UsageRow> {
    usage
        .into_iter()
        .map(|u| {
            (
                u.tier.name(),
                u.level,
                u.used_slots,
                u.capacity_slots,
                u.bytes,
            )
        })
        .collect()
}

/// Blocks added by an append, and which of them were shared from the cache.
type AppendedArrays<'py> = (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<bool>>);

#[pyclass(name = "Core", module = "kvtier._core", frozen)]
pub struct PyCore {
    inner: Mutex<Core>,
}

impl PyCore {
    /// Runs `f` on the core with the GIL released.
    pub fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Core) -> R + Send) -> R {
        py.detach(|| f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// A batch call taking one f32 value per block, with both arrays validated first.
    fn per_block(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        (values, name): (&Bound<'_, PyAny>, &str),
        call: PerBlockCall,
    ) -> PyResult<()> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let values = array::<f32>(values, name, "float32")?;
        let (b, v) = (blocks.as_slice()?, values.as_slice()?);
        self.with(py, |c| call(c, b, v)).py_err()
    }

    pub fn config(&self) -> Config {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .config()
            .clone()
    }
}

/// An integer argument of any size, as Python gave it (`None`: beyond +-2**127), so that one
/// out of the core's range is refused with an error naming the argument rather than PyO3's bare
/// `OverflowError`.
#[derive(Clone, Copy)]
pub struct Int(Option<i128>);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let overflow = |e: &PyErr| e.is_instance_of::<PyOverflowError>(obj.py());
        // i64 first: under the limited API PyO3's i128 conversion is several times slower, and
        // ids cross on every call.
        match obj.extract::<i64>() {
            Ok(v) => Ok(Int(Some(v.into()))),
            Err(e) if overflow(&e) => match obj.extract::<i128>() {
                Ok(v) => Ok(Int(Some(v))),
                Err(e) if overflow(&e) => Ok(Int(None)),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        }
    }
}

/// The unsigned types arguments convert to, with their largest value for the message.
pub trait Unsigned: TryFrom<i128> {
    const MAX: u128;
}

impl Unsigned for u8 {
    const MAX: u128 = u8::MAX as u128;
}
impl Unsigned for u32 {
    const MAX: u128 = u32::MAX as u128;
}
impl Unsigned for u64 {
    const MAX: u128 = u64::MAX as u128;
}

impl From<i64> for Int {
    fn from(v: i64) -> Int {
        Int(Some(v.into()))
    }
}

impl Int {
    fn to<T: Unsigned>(self) -> Result<T, String> {
        let out_of_range = || {
            let got = self
                .0
                .map_or("an integer beyond 2**127".to_string(), |v| v.to_string());
            format!(
                "{got} is out of range: expected an integer from 0 to {}",
                T::MAX
            )
        };
        self.0
            .and_then(|v| T::try_from(v).ok())
            .ok_or_else(out_of_range)
    }
}

/// A `salt` argument: a `str` (the core refuses an empty one), `None` for no salt, anything
/// else an `InvalidArgumentError` rather than PyO3's bare `TypeError`.
pub struct Salt(pub String);

impl<'a, 'py> FromPyObject<'a, 'py> for Salt {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<String>() {
            Ok(s) => Ok(Salt(s)),
            Err(_) => {
                let got = obj
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |n| n.to_string());
                Err(to_py(Error::InvalidArgument {
                    what: "salt",
                    reason: format!("expected a non-empty str, or None for no salt; got {got}"),
                }))
            }
        }
    }
}

impl Salt {
    pub fn as_deref(salt: &Option<Salt>) -> Option<&str> {
        salt.as_ref().map(|s| s.0.as_str())
    }
}

/// An id or count argument in the core's range, or an `InvalidArgumentError` naming it.
fn int_arg<T: Unsigned>(what: &'static str, v: Int) -> PyResult<T> {
    v.to()
        .map_err(|reason| to_py(Error::InvalidArgument { what, reason }))
}

/// A config value in the core's range, or a `ConfigError` naming the field.
fn config_int<T: Unsigned>(field: &'static str, v: Int) -> PyResult<T> {
    v.to()
        .map_err(|reason| to_py(Error::InvalidConfig { field, reason }))
}

fn config_tier(name: &str) -> PyResult<Tier> {
    Tier::parse(name).map_err(|_| {
        to_py(Error::InvalidConfig {
            field: "tiers",
            reason: format!("unknown tier {name:?}: expected device, host, disk or remote"),
        })
    })
}

fn parse_tiers(tiers: Vec<(String, Option<Int>)>) -> PyResult<Vec<TierConfig>> {
    tiers
        .into_iter()
        .map(|(name, budget)| {
            let budget_bytes = budget
                .map(|b| config_int("tiers (budget bytes)", b))
                .transpose()?;
            Ok(TierConfig {
                tier: config_tier(&name)?,
                budget_bytes,
            })
        })
        .collect()
}

#[pymethods]
impl PyCore {
    #[new]
    #[pyo3(signature = (
        level_bytes, *, tiers = vec![("device".to_string(), None)], block_size = 16,
        policy = "importance", enable_compression = true, pressure_only = false, compression_ratio = 0.5,
        drop_ratio = 0.0, recent_window = 128, sink_blocks = 1, keep_leaves = 2,
        ends_level = None, settle_cached = false, weights = (0.4, 0.4, 0.2), headroom = 0.1,
        hysteresis = 0.1, max_move_bytes = None, decay = 0.9, attention_ema = 0.5,
        scissorhands_window = 8, write_through = false, evict_on_full = true,
        namespace = "default", pool_slots = vec![], pool_headroom = false, prefix_aware = true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        level_bytes: Vec<Int>,
        tiers: Vec<(String, Option<Int>)>,
        block_size: i64,
        policy: &str,
        enable_compression: bool,
        pressure_only: bool,
        compression_ratio: f32,
        drop_ratio: f32,
        recent_window: i64,
        sink_blocks: i64,
        keep_leaves: i64,
        ends_level: Option<Int>,
        settle_cached: bool,
        weights: (f32, f32, f32),
        headroom: f32,
        hysteresis: f32,
        max_move_bytes: Option<Int>,
        decay: f32,
        attention_ema: f32,
        scissorhands_window: i64,
        write_through: bool,
        evict_on_full: bool,
        namespace: &str,
        pool_slots: Vec<(String, Int, Int)>,
        pool_headroom: bool,
        prefix_aware: bool,
    ) -> PyResult<Self> {
        let pool_slots = pool_slots
            .into_iter()
            .map(|(t, l, n)| {
                Ok((
                    config_tier(&t)?,
                    config_int("pool_slots", l)?,
                    config_int("pool_slots", n)?,
                ))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let level_bytes = level_bytes
            .into_iter()
            .map(|b| config_int("level_bytes", b))
            .collect::<PyResult<Vec<u64>>>()?;
        let cfg = Config {
            block_size: config_int("block_size", block_size.into())?,
            level_bytes,
            tiers: parse_tiers(tiers)?,
            policy: PolicyKind::parse(policy).py_err()?,
            enable_compression,
            pressure_only,
            compression_ratio,
            drop_ratio,
            recent_window: config_int("recent_window", recent_window.into())?,
            sink_blocks: config_int("sink_blocks", sink_blocks.into())?,
            keep_leaves: config_int("keep_leaves", keep_leaves.into())?,
            ends_level: ends_level
                .map(|l| config_int("ends_level", l))
                .transpose()?,
            settle_cached,
            weights: [weights.0, weights.1, weights.2],
            headroom,
            hysteresis,
            max_move_bytes: max_move_bytes
                .map(|b| config_int("max_move_bytes", b))
                .transpose()?,
            decay,
            attention_ema,
            scissorhands_window: config_int("scissorhands_window", scissorhands_window.into())?,
            write_through,
            evict_on_full,
            namespace: kvtier::namespace_seed(namespace),
            pool_slots,
            pool_headroom,
            prefix_aware,
        };
        Ok(PyCore {
            inner: Mutex::new(Core::new(cfg).py_err()?),
        })
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.config().block_size
    }

    /// Whether cached blocks form prefix trees and eviction takes leaves only.
    #[getter]
    fn prefix_aware(&self) -> bool {
        self.config().prefix_aware
    }

    /// The level a cached chain's ends settle at (``settle_cached``): ``ends_level`` as given,
    /// or the deepest kept level whose blocks take at least a quarter of level 0's bytes.
    #[getter]
    fn ends_level(&self) -> u8 {
        self.config().resolved_ends_level()
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.config().policy.name()
    }

    #[getter]
    fn level_bytes(&self) -> Vec<u64> {
        self.config().level_bytes
    }

    #[getter]
    fn tiers(&self) -> Vec<(&'static str, Option<u64>)> {
        self.config()
            .tiers
            .iter()
            .map(|t| (t.tier.name(), t.budget_bytes))
            .collect()
    }

    /// The scheduler's step clock (number of plans made).
    #[getter]
    fn step(&self, py: Python<'_>) -> u32 {
        self.with(py, |c| c.step_clock())
    }

    /// A new sequence; with `salt`, its blocks are shared only with sequences of that salt.
    #[pyo3(signature = (salt = None))]
    fn add_sequence(&self, py: Python<'_>, salt: Option<Salt>) -> PyResult<u32> {
        let salt = Salt::as_deref(&salt);
        self.with(py, |c| c.add_sequence_salted(salt)).py_err()
    }

    /// Appends token ids; returns `(block_ids, shared)` for the blocks added.
    fn append_tokens<'py>(
        &self,
        py: Python<'py>,
        seq: Int,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<AppendedArrays<'py>> {
        let seq = int_arg("seq", seq)?;
        let tokens = array::<u32>(tokens, "tokens", "uint32")?;
        let t = tokens.as_slice()?;
        let out = self.with(py, |c| c.append_tokens(seq, t)).py_err()?;
        Ok((
            PyArray1::from_vec(py, out.blocks),
            PyArray1::from_vec(py, out.shared),
        ))
    }

    /// Appends whole blocks by their chained hashes; returns `(block_ids, shared)`.
    fn append_blocks<'py>(
        &self,
        py: Python<'py>,
        seq: Int,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<AppendedArrays<'py>> {
        let seq = int_arg("seq", seq)?;
        let hashes = array::<u64>(hashes, "hashes", "uint64")?;
        let h = hashes.as_slice()?;
        let out = self.with(py, |c| c.append_blocks(seq, h)).py_err()?;
        Ok((
            PyArray1::from_vec(py, out.blocks),
            PyArray1::from_vec(py, out.shared),
        ))
    }

    /// Appends `n` tokens without ids (their K/V only); the sequence stops being hashed.
    /// Returns `(block_ids, shared)` for the blocks added (none shared).
    fn extend<'py>(&self, py: Python<'py>, seq: Int, n: Int) -> PyResult<AppendedArrays<'py>> {
        let (seq, n) = (int_arg("seq", seq)?, int_arg("n", n)?);
        let out = self.with(py, |c| c.extend(seq, n)).py_err()?;
        Ok((
            PyArray1::from_vec(py, out.blocks),
            PyArray1::from_vec(py, out.shared),
        ))
    }

    /// Forks a sequence; returns `(child, copy)` where `copy` is `(src_block, dst_block)` of
    /// the partial block whose bytes the engine must copy, or `None`.
    fn fork(&self, py: Python<'_>, seq: Int) -> PyResult<(u32, Option<(u32, u32)>)> {
        let seq = int_arg("seq", seq)?;
        let f = self.with(py, |c| c.fork(seq)).py_err()?;
        Ok((f.child, f.copy))
    }

    /// Takes blocks out of the prefix index; each is freed once nothing references it.
    fn forget(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let ids = blocks.as_slice()?;
        self.with(py, |c| c.forget(ids)).py_err()
    }

    /// Every block in the prefix index, as uint32 ids.
    fn indexed_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_vec(py, self.with(py, |c| c.indexed_blocks()))
    }

    /// Starts (or stops, dropping what it holds) logging changes to the prefix index, for
    /// :meth:`take_index_log`.
    fn set_index_log(&self, py: Python<'_>, on: bool) {
        self.with(py, |c| c.set_index_log(on));
    }

    /// The changes to the prefix index since the last call, oldest first, as `(hashes,
    /// tiers)`: each a block's prefix hash (uint64) and the tier it lies in now (int8, its
    /// index in `Plan.TIERS`), or -1 where it left the index. Empty while the log is off.
    fn take_index_log<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i8>>) {
        let log = self.with(py, |c| c.take_index_log());
        let hashes = log.iter().map(|c| c.hash).collect();
        let tiers = log.iter().map(|c| c.tier.map_or(-1, |t| t as i8)).collect();
        (
            PyArray1::from_vec(py, hashes),
            PyArray1::from_vec(py, tiers),
        )
    }

    /// Says that a live sequence's conversation has ended: the blocks it is the last to hold
    /// when freed are released, evicted before every block that is not (prefix-aware cores).
    fn release(&self, py: Python<'_>, seq: Int) -> PyResult<()> {
        let seq = int_arg("seq", seq)?;
        self.with(py, |c| c.release(seq)).py_err()
    }

    /// Releases the blocks of the longest cached prefix of these chained hashes (a chain whose
    /// sequence is freed); returns how many blocks that is.
    fn release_cached(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = array::<u64>(hashes, "hashes", "uint64")?;
        let h = hashes.as_slice()?;
        Ok(self.with(py, |c| c.release_cached(h)))
    }

    /// :meth:`release_cached` of the longest cached prefix of these token ids (of sequences
    /// salted with `salt`, or of unsalted ones).
    #[pyo3(signature = (tokens, salt = None))]
    fn release_cached_tokens(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<Salt>,
    ) -> PyResult<usize> {
        let tokens = array::<u32>(tokens, "tokens", "uint32")?;
        let t = tokens.as_slice()?;
        let salt = Salt::as_deref(&salt);
        self.with(py, |c| c.release_cached_tokens_salted(t, salt))
            .py_err()
    }

    fn free_sequence(&self, py: Python<'_>, seq: Int) -> PyResult<()> {
        let seq = int_arg("seq", seq)?;
        self.with(py, |c| c.free_sequence(seq)).py_err()
    }

    fn sequence_blocks<'py>(
        &self,
        py: Python<'py>,
        seq: Int,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let seq = int_arg("seq", seq)?;
        let v = self
            .with(py, |c| c.sequence_blocks(seq).map(<[u32]>::to_vec))
            .py_err()?;
        Ok(PyArray1::from_vec(py, v))
    }

    fn sequence_tokens(&self, py: Python<'_>, seq: Int) -> PyResult<u64> {
        let seq = int_arg("seq", seq)?;
        self.with(py, |c| c.sequence_tokens(seq)).py_err()
    }

    fn sequences(&self, py: Python<'_>) -> Vec<u32> {
        self.with(py, |c| c.sequence_ids())
    }

    /// Blocks of the longest cached prefix of these chained hashes.
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let hashes = array::<u64>(hashes, "hashes", "uint64")?;
        let h = hashes.as_slice()?;
        Ok(PyArray1::from_vec(py, self.with(py, |c| c.lookup(h))))
    }

    /// Blocks of the longest cached prefix of these token ids (of sequences salted with
    /// `salt`, or of unsalted ones).
    #[pyo3(signature = (tokens, salt = None))]
    fn lookup_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        salt: Option<Salt>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let tokens = array::<u32>(tokens, "tokens", "uint32")?;
        let t = tokens.as_slice()?;
        let salt = Salt::as_deref(&salt);
        let blocks = self
            .with(py, |c| c.lookup_tokens_salted(t, salt))
            .py_err()?;
        Ok(PyArray1::from_vec(py, blocks))
    }

    fn record_reads(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let b = blocks.as_slice()?;
        self.with(py, |c| c.record_reads(b)).py_err()
    }

    fn record_attention(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        mass: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.per_block(py, blocks, (mass, "mass"), Core::record_attention)
    }

    fn set_magnitude(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.per_block(py, blocks, (values, "values"), Core::set_magnitude)
    }

    fn set_learned(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.per_block(py, blocks, (values, "values"), Core::set_learned)
    }

    fn pin(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let b = blocks.as_slice()?;
        self.with(py, |c| c.pin(b)).py_err()
    }

    fn unpin(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let b = blocks.as_slice()?;
        self.with(py, |c| c.unpin(b)).py_err()
    }

    /// Evicts `n` cached level-0 device blocks as making room does, none of `protected`;
    /// returns their hashes (uint64), or None, with nothing evicted, if fewer than `n` could go.
    #[pyo3(signature = (n, protected = None))]
    fn evict_cached<'py>(
        &self,
        py: Python<'py>,
        n: u64,
        protected: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyArray1<u64>>>> {
        let protected = protected
            .map(|p| array::<u32>(p, "protected", "uint32"))
            .transpose()?;
        let ids = match &protected {
            Some(p) => p.as_slice()?,
            None => &[],
        };
        let evicted = self.with(py, |c| c.evict_cached(n, ids)).py_err()?;
        Ok(evicted.map(|hashes| PyArray1::from_vec(py, hashes)))
    }

    /// Places new blocks of a save (pinned, unwritten, held by one sequence) where a cached
    /// block settles: with ``settle_cached``, the chain's ends (its sinks and its last
    /// ``keep_leaves`` blocks) at the ends' level (``ends_level``), any other at the bottom
    /// level, where that level has a free device slot, else the most precise level below 0
    /// with one; without, the chain's ends at level 0 and the others at the most precise level
    /// below 0 with a free slot. A block no slot is left for stays at level 0. Returns each
    /// one's level.
    fn place_saved<'py>(
        &self,
        py: Python<'py>,
        blocks: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let b = blocks.as_slice()?;
        let levels = self.with(py, |c| c.place_saved(b)).py_err()?;
        Ok(PyArray1::from_vec(py, levels))
    }

    /// Plans moves and holds them pending until `commit(plan.id)` or `abort(plan.id)`.
    /// `room_bytes`: also free that much of the device budget for blocks about to be allocated
    /// (demoting and offloading before anything is evicted). `keep`: cached blocks the call
    /// the room is for will share (a prompt's cached prefix): moved if need be, never evicted.
    #[pyo3(signature = (room_bytes = 0, *, keep = None))]
    fn plan(
        &self,
        py: Python<'_>,
        room_bytes: i64,
        keep: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPlan> {
        let room_bytes = int_arg("room_bytes", room_bytes.into())?;
        let keep = keep
            .map(|k| array::<u32>(k, "keep", "uint32"))
            .transpose()?;
        let kept = match &keep {
            Some(k) => k.as_slice()?,
            None => &[],
        };
        // Columns are built from the pending plan in place: no copy of the move list.
        self.with(py, |c| c.plan_keeping(room_bytes, kept).map(PyPlan::from))
            .py_err()
    }

    fn commit(&self, py: Python<'_>, plan_id: Int) -> PyResult<()> {
        let plan_id = int_arg("plan_id", plan_id)?;
        self.with(py, |c| c.commit(plan_id)).py_err()
    }

    /// Drops the pending plan: every block stays where it was. ``copied``: some of its copies
    /// ran (the engine failed midway), so the blocks it evicted to move others into their
    /// slots are gone rather than given back.
    #[pyo3(signature = (plan_id, *, copied = false))]
    fn abort(&self, py: Python<'_>, plan_id: Int, copied: bool) -> PyResult<()> {
        let plan_id = int_arg("plan_id", plan_id)?;
        self.with(py, |c| {
            if copied {
                c.abort_after_copies(plan_id)
            } else {
                c.abort(plan_id)
            }
        })
        .py_err()
    }

    /// Where each of `blocks` is: `(tier, level, slot)` columns, [`Self::block_info`]'s first
    /// three alone, for the hot paths (a save's or a load's blocks, a layer at a time).
    #[allow(clippy::type_complexity)]
    fn block_places<'py>(
        &self,
        py: Python<'py>,
        blocks: &Bound<'py, PyAny>,
    ) -> PyResult<(
        Bound<'py, PyArray1<u8>>,
        Bound<'py, PyArray1<u8>>,
        Bound<'py, PyArray1<u32>>,
    )> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let ids = blocks.as_slice()?;
        let (mut tier, mut level, mut slot) = (Vec::new(), Vec::new(), Vec::new());
        self.with(py, |c| -> Result<(), Error> {
            for &b in ids {
                let loc = c.block_loc(b)?;
                tier.push(loc.tier as u8);
                level.push(loc.level);
                slot.push(loc.slot);
            }
            Ok(())
        })
        .py_err()?;
        Ok((
            PyArray1::from_vec(py, tier),
            PyArray1::from_vec(py, level),
            PyArray1::from_vec(py, slot),
        ))
    }

    /// Columns describing blocks: tier, level, slot, refcount, pinned, position, hash (0 for
    /// a partial block), has_copy, score (the policy's primary ranking value), indexed (in the
    /// prefix index), parent (in the prefix tree; -1 for a root, an unindexed block or a
    /// plain core) and released (its conversation ended: evicted first).
    fn block_info<'py>(
        &self,
        py: Python<'py>,
        blocks: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let blocks = array::<u32>(blocks, "blocks", "uint32")?;
        let ids = blocks.as_slice()?;
        let cols = self
            .with(py, |c| -> Result<_, Error> {
                let mut cols = BlockColumns::default();
                for &b in ids {
                    let loc = c.block_loc(b)?;
                    cols.tier.push(loc.tier as u8);
                    cols.level.push(loc.level);
                    cols.slot.push(loc.slot);
                    cols.refcount.push(c.block_refcount(b)?);
                    cols.pinned.push(c.block_pinned(b)?);
                    cols.position.push(c.block_position(b)?);
                    cols.hash.push(c.block_hash(b)?.unwrap_or(0));
                    cols.has_copy.push(c.block_copy(b)?.is_some());
                    cols.score.push(c.block_score(b)?.primary());
                    cols.indexed.push(c.block_indexed(b)?);
                    cols.parent.push(c.block_parent(b)?.map_or(-1, i64::from));
                    cols.released.push(c.block_released(b)?);
                }
                Ok(cols)
            })
            .py_err()?;
        let d = PyDict::new(py);
        d.set_item("tier", PyArray1::from_vec(py, cols.tier))?;
        d.set_item("level", PyArray1::from_vec(py, cols.level))?;
        d.set_item("slot", PyArray1::from_vec(py, cols.slot))?;
        d.set_item("refcount", PyArray1::from_vec(py, cols.refcount))?;
        d.set_item("pinned", PyArray1::from_vec(py, cols.pinned))?;
        d.set_item("position", PyArray1::from_vec(py, cols.position))?;
        d.set_item("hash", PyArray1::from_vec(py, cols.hash))?;
        d.set_item("has_copy", PyArray1::from_vec(py, cols.has_copy))?;
        d.set_item("score", PyArray1::from_vec(py, cols.score))?;
        d.set_item("indexed", PyArray1::from_vec(py, cols.indexed))?;
        d.set_item("parent", PyArray1::from_vec(py, cols.parent))?;
        d.set_item("released", PyArray1::from_vec(py, cols.released))?;
        Ok(d)
    }

    /// Occupancy per pool: `[(tier, level, used_slots, capacity_slots, bytes), ...]`.
    fn usage(&self, py: Python<'_>) -> Vec<UsageRow> {
        usage_rows(self.with(py, |c| c.usage()))
    }

    /// What evicting could free now, per pool: `[(tier, level, blocks, bytes)]` of its cached
    /// blocks whose every indexed descendant is cached too (eviction takes leaves).
    fn reclaimable(&self, py: Python<'_>) -> Vec<(&'static str, u8, u64, u64)> {
        self.with(py, |c| c.reclaimable())
            .into_iter()
            .map(|(t, level, n, bytes)| (t.name(), level, n, bytes))
            .collect()
    }

    /// Whether an allocation that does not fit evicts cached blocks (lowest-ranked first)
    /// instead of failing.
    #[getter]
    fn evict_on_full(&self) -> bool {
        self.config().evict_on_full
    }

    #[setter]
    fn set_evict_on_full(&self, py: Python<'_>, on: bool) {
        self.with(py, |c| c.set_evict_on_full(on));
    }

    /// Bytes in use per configured tier.
    fn tier_bytes(&self, py: Python<'_>) -> Vec<(&'static str, u64)> {
        let cfg = self.config();
        let bytes = self.with(py, |c| c.tier_bytes().to_vec());
        cfg.tiers.iter().map(|t| t.tier.name()).zip(bytes).collect()
    }

    fn set_budget(&self, py: Python<'_>, tier: &str, budget: Option<Int>) -> PyResult<()> {
        let tier = Tier::parse(tier).py_err()?;
        let budget = budget.map(|b| config_int("budget", b)).transpose()?;
        self.with(py, |c| c.set_budget(tier, budget)).py_err()
    }

    /// Event counters since creation.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (k, live, cached) = self.with(py, |c| {
            (c.counters().clone(), c.live_blocks(), c.cached_blocks())
        });
        counters_dict(py, &k, live as u64, cached)
    }

    fn __repr__(&self) -> String {
        let c = self.config();
        format!(
            "Core(policy={:?}, levels={:?}, block_size={})",
            c.policy.name(),
            c.level_bytes,
            c.block_size
        )
    }
}

#[derive(Default)]
struct BlockColumns {
    tier: Vec<u8>,
    level: Vec<u8>,
    slot: Vec<u32>,
    refcount: Vec<u32>,
    pinned: Vec<bool>,
    position: Vec<u32>,
    hash: Vec<u64>,
    has_copy: Vec<bool>,
    score: Vec<f64>,
    indexed: Vec<bool>,
    parent: Vec<i64>,
    released: Vec<bool>,
}

pub fn counters_dict<'py>(
    py: Python<'py>,
    k: &kvtier::Counters,
    live: u64,
    cached: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in [
        ("allocated", k.allocated),
        ("released", k.released),
        ("shared_hits", k.shared_hits),
        ("evictions", k.evictions),
        ("demotions", k.demotions),
        ("promotions", k.promotions),
        ("offloads", k.offloads),
        ("fetches", k.fetches),
        ("drops", k.drops),
        ("backups", k.backups),
        ("noop_promotions", k.noop_promotions),
        ("deferred_moves", k.deferred_moves),
        ("bytes_moved", k.bytes_moved),
        ("plans", k.plans),
        ("aborts", k.aborts),
        ("cancelled_moves", k.cancelled_moves),
        ("live_blocks", live),
        ("cached_blocks", cached),
    ] {
        d.set_item(name, v)?;
    }
    Ok(d)
}
