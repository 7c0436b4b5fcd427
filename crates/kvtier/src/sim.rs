//! Trace replay through a real [`Core`]: the numbers `kvtier simulate` reports.
//!
//! A trace is a list of requests, each a run of prefix-chained block hashes (equal hash ⇒ equal
//! prefix, as in Mooncake traces) plus its token counts. Per request, in order:
//! 1. the longest cached prefix is looked up; each hit block is counted by the (tier, level) it
//!    was found at — a lower-precision or lower-tier hit is still a hit, and the report says so.
//!    With [`LoadCosts`], only the leading hits whose load saves the most time over their
//!    recompute count (the rule of the vLLM connector's lookup): the rest are recomputed;
//! 2. a sequence takes every block of the request (hits shared, misses allocated at level 0 on
//!    the device), and reads are recorded. When the new blocks do not fit, the scheduler first
//!    plans room for them (demoting and offloading cached blocks where the ladder or a lower
//!    tier can keep them, committed at once); what still does not fit is evicted;
//! 3. every `step_every` requests the scheduler plans, and the plan is committed at once (the
//!    simulator moves no bytes);
//! 4. the sequence is freed: its blocks stay cached for later requests.
//!
//! Requests are replayed one at a time (no overlap), so the device holds at most one request's
//! live blocks plus the cache.

use crate::config::{Config, Tier};
use crate::core::{Appended, Core};
use crate::error::{Error, Result};

/// Requests in CSR form: the hashes of request `i` are `hashes[offsets[i]..offsets[i+1]]`.
#[derive(Debug, Clone)]
pub struct Trace {
    pub offsets: Vec<u64>,
    pub hashes: Vec<u64>,
    /// Prompt tokens per request; the last block of a request may be partial.
    pub input_tokens: Vec<u64>,
}

impl Trace {
    pub fn new(offsets: Vec<u64>, hashes: Vec<u64>, input_tokens: Vec<u64>) -> Result<Trace> {
        let n = input_tokens.len();
        if offsets.len() != n + 1 {
            return Err(Error::LengthMismatch {
                what: "trace offsets",
                expected: n + 1,
                got: offsets.len(),
            });
        }
        if offsets[0] != 0
            || offsets.windows(2).any(|w| w[1] < w[0])
            || offsets[n] != hashes.len() as u64
        {
            return Err(Error::InvalidArgument {
                what: "trace offsets",
                reason: "expected non-decreasing offsets from 0 to the number of hashes".into(),
            });
        }
        Ok(Trace {
            offsets,
            hashes,
            input_tokens,
        })
    }

    pub fn len(&self) -> usize {
        self.input_tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_tokens.is_empty()
    }

    pub fn request(&self, i: usize) -> &[u64] {
        &self.hashes[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }
}

/// Counters of one replay. Hits are indexed `[tier as usize][level]`.
#[derive(Debug, Clone, Default)]
pub struct SimStats {
    pub requests: u64,
    pub ref_blocks: u64,
    pub hit_blocks: u64,
    pub ref_tokens: u64,
    pub hit_tokens: u64,
    pub hit_blocks_at: Vec<Vec<u64>>,
    pub hit_tokens_at: Vec<Vec<u64>>,
    /// Requests whose new blocks did not fit even after evicting every cached block.
    pub rejected: u64,
    /// Peak bytes per tier (config order) seen after a request.
    pub peak_tier_bytes: Vec<u64>,
}

/// What a hit saves, for [`Simulator::set_costs`]: seconds to recompute a token, and to load one
/// block from each place (flat at `tier * levels + level`, [`Tier::ALL`] order).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadCosts {
    pub recompute_per_token: f64,
    pub load_per_block: Vec<f64>,
}

impl LoadCosts {
    /// How many of the leading hits, each `(place, tokens)`, to load: the prefix that saves
    /// the most seconds (the longest of equals; 0 when no load saves anything). A slow place
    /// between fast ones is loaded where what follows it makes up for it.
    pub fn paying(&self, hits: &[(usize, u64)]) -> usize {
        let (mut cut, mut best, mut gained) = (0, 0.0, 0.0);
        for (k, &(place, tokens)) in hits.iter().enumerate() {
            gained += tokens as f64 * self.recompute_per_token - self.load_per_block[place];
            if gained >= best {
                (cut, best) = (k + 1, gained);
            }
        }
        cut
    }
}

/// The replay's state after its first `requests` requests: one point of the timeline that
/// `kvtier simulate --plot` draws.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub requests: usize,
    pub hit_blocks: u64,
    pub ref_blocks: u64,
    /// Bytes held at each level, all tiers together.
    pub level_bytes: Vec<u64>,
}

pub struct Simulator {
    pub core: Core,
    trace: Trace,
    step_every: u64,
    next: usize,
    /// Read through [`Simulator::stats`]: its hits by place are filled in when `run` returns.
    stats: SimStats,
    /// Reused by every request's append.
    appended: Appended,
    /// Whether the device can make room by anything but eviction: a lower level or a lower
    /// tier to move cached blocks into.
    plans_room: bool,
    /// Hit (blocks, tokens) by place, flat at `tier * levels + level`: a hit costs one index
    /// and two adds, not two nested ones. Copied into `stats` when `run` returns.
    hits_at: Vec<[u64; 2]>,
    levels: usize,
    /// Requests between timeline samples (0: none); sampled in the replay loop, so the
    /// timeline does not depend on how the caller splits the replay into `run` calls.
    sample_every: usize,
    /// Requests done when the next sample is due.
    next_sample: usize,
    timeline: Vec<Sample>,
    /// Hits that pay only (None: every hit counts).
    costs: Option<LoadCosts>,
    /// Reused by every request: its leading hits' places and tokens.
    hits: Vec<(usize, u64)>,
}

impl Simulator {
    pub fn new(cfg: Config, trace: Trace, step_every: u64) -> Result<Simulator> {
        if step_every == 0 {
            return Err(Error::InvalidArgument {
                what: "step_every",
                reason: "expected at least 1".into(),
            });
        }
        let levels = cfg.num_levels();
        let tiers = cfg.tiers.len();
        let plans_room = tiers > 1 || (cfg.enable_compression && cfg.last_kept_level() > 0);
        let core = Core::new(cfg)?;
        Ok(Simulator {
            core,
            trace,
            step_every,
            next: 0,
            appended: Appended::default(),
            plans_room,
            hits_at: vec![[0; 2]; Tier::ALL.len() * levels],
            levels,
            sample_every: 0,
            next_sample: usize::MAX,
            timeline: Vec::new(),
            costs: None,
            hits: Vec::new(),
            stats: SimStats {
                hit_blocks_at: vec![vec![0; levels]; Tier::ALL.len()],
                hit_tokens_at: vec![vec![0; levels]; Tier::ALL.len()],
                peak_tier_bytes: vec![0; tiers],
                ..SimStats::default()
            },
        })
    }

    pub fn done(&self) -> usize {
        self.next
    }

    pub fn total(&self) -> usize {
        self.trace.len()
    }

    /// Counts only the hits whose load pays (see [`LoadCosts::paying`]) from the next request
    /// on; `load_per_block` takes one entry per tier of [`Tier::ALL`] and level.
    pub fn set_costs(&mut self, costs: LoadCosts) -> Result<()> {
        let places = Tier::ALL.len() * self.levels;
        if costs.load_per_block.len() != places {
            return Err(Error::InvalidArgument {
                what: "load_per_block",
                reason: format!(
                    "expected {places} entries (tiers x levels), got {}",
                    costs.load_per_block.len()
                ),
            });
        }
        let seconds = std::iter::once(&costs.recompute_per_token).chain(&costs.load_per_block);
        if !seconds.into_iter().all(|s| s.is_finite() && *s >= 0.0) {
            return Err(Error::InvalidArgument {
                what: "costs",
                reason: "expected finite seconds >= 0".into(),
            });
        }
        self.costs = Some(costs);
        Ok(())
    }

    /// The counters of the requests replayed so far.
    pub fn stats(&self) -> &SimStats {
        &self.stats
    }

    /// Samples the timeline every `every` requests and after the last one, from the next
    /// request on (`every` = 0: no more samples).
    pub fn sample_every(&mut self, every: usize) {
        self.sample_every = every;
        self.next_sample = self.sample_due();
    }

    /// The samples taken so far, in request order.
    pub fn timeline(&self) -> &[Sample] {
        &self.timeline
    }

    /// Replays up to `n` more requests; returns how many it replayed.
    pub fn run(&mut self, n: usize) -> Result<usize> {
        let end = self.next.saturating_add(n).min(self.trace.len());
        let start = self.next;
        let replayed = (start..end).try_for_each(|i| {
            self.replay(i)?;
            self.next = i + 1;
            if self.next == self.next_sample {
                self.sample();
            }
            Ok(())
        });
        self.copy_hits();
        replayed.map(|()| end - start)
    }

    /// Requests done when the next sample is due: the next multiple of `sample_every`, or
    /// the end of the trace.
    fn sample_due(&self) -> usize {
        match self.sample_every {
            0 => usize::MAX,
            every => ((self.next / every + 1) * every).min(self.trace.len()),
        }
    }

    fn sample(&mut self) {
        let mut level_bytes = vec![0; self.levels];
        for pool in self.core.usage() {
            level_bytes[usize::from(pool.level)] += pool.bytes;
        }
        self.timeline.push(Sample {
            requests: self.next,
            hit_blocks: self.stats.hit_blocks,
            ref_blocks: self.stats.ref_blocks,
            level_bytes,
        });
        self.next_sample = self.sample_due();
    }

    /// Copies the flat hit counters into `stats` (once per `run`, out of its loop).
    fn copy_hits(&mut self) {
        for (k, &[blocks, tokens]) in self.hits_at.iter().enumerate() {
            let (t, l) = (k / self.levels, k % self.levels);
            self.stats.hit_blocks_at[t][l] = blocks;
            self.stats.hit_tokens_at[t][l] = tokens;
        }
    }

    fn replay(&mut self, i: usize) -> Result<()> {
        let Simulator {
            core,
            trace,
            stats,
            appended,
            hits_at,
            levels,
            costs,
            hits,
            ..
        } = self;
        let bs = u64::from(core.config().block_size);
        let hashes = trace.request(i);
        let input = trace.input_tokens[i];
        stats.requests += 1;
        stats.ref_blocks += hashes.len() as u64;
        stats.ref_tokens += input;
        if self.plans_room {
            make_room(core, hashes)?;
        }
        let seq = core.add_sequence();
        // The append shares every indexed block and takes references before it evicts
        // anything, so the hits are the leading shared blocks, where they were found.
        let n_hits = match core.append_blocks_into(seq, hashes, appended, true) {
            Ok(()) => appended.shared.iter().take_while(|&&s| s).count(),
            Err(Error::OutOfCapacity { .. } | Error::OutOfSlots { .. }) => {
                stats.rejected += 1;
                appended.blocks = core.lookup(hashes);
                appended.blocks.len()
            }
            Err(e) => return Err(e),
        };
        hits.clear();
        for (k, &b) in appended.blocks[..n_hits].iter().enumerate() {
            // Live: the append just returned it.
            let loc = core.blocks.rows[b as usize].loc;
            // Every block is full but the request's last, which holds what is left.
            let tokens = if k + 1 < hashes.len() {
                bs
            } else {
                input.saturating_sub(bs * k as u64).min(bs)
            };
            hits.push((loc.tier as usize * *levels + usize::from(loc.level), tokens));
        }
        let n_hits = costs.as_ref().map_or(n_hits, |c| c.paying(hits));
        let mut hit_tokens = 0;
        for &(place, tokens) in &hits[..n_hits] {
            hits_at[place][0] += 1;
            hits_at[place][1] += tokens;
            hit_tokens += tokens;
        }
        stats.hit_blocks += n_hits as u64;
        stats.hit_tokens += hit_tokens;
        if (i as u64 + 1).is_multiple_of(self.step_every) {
            core.plan_and_commit(0)?;
        }
        core.free_sequence(seq)?;
        for (peak, &now) in stats.peak_tier_bytes.iter_mut().zip(core.tier_bytes()) {
            *peak = (*peak).max(now);
        }
        Ok(())
    }
}

/// Before a request's blocks are allocated: if its new (unindexed) blocks would not fit in the
/// device budget, plans and commits room for them, so that the allocation evicts only what no
/// lower level or tier could keep.
fn make_room(core: &mut Core, hashes: &[u64]) -> Result<()> {
    let Some(budget) = core.budget(core.tier_pos(Tier::Device)) else {
        return Ok(());
    };
    let new = hashes
        .iter()
        .filter(|&&h| core.index.get(h).is_none())
        .count() as u64;
    let need = new * core.level_bytes(0);
    let device = core.tier_bytes()[core.tier_pos(Tier::Device)];
    if need > 0 && device + need > budget {
        core.plan_and_commit(need)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PolicyKind, TierConfig};

    /// 50 requests of 1–8 blocks drawn from 30 hashes, on a device of 20 blocks.
    fn small_sim() -> Simulator {
        let (mut offsets, mut hashes, mut input) = (vec![0], Vec::new(), Vec::new());
        for i in 0..50u64 {
            let len = 1 + i * 7 % 8;
            hashes.extend((0..len).map(|k| (i * 13 + k * 5) % 30));
            offsets.push(hashes.len() as u64);
            input.push(len * 16 - 3);
        }
        let cfg = Config {
            block_size: 16,
            level_bytes: vec![1],
            tiers: vec![TierConfig {
                tier: Tier::Device,
                budget_bytes: Some(20),
            }],
            policy: PolicyKind::Lru,
            evict_on_full: true,
            ..Config::default()
        };
        Simulator::new(cfg, Trace::new(offsets, hashes, input).unwrap(), 1).unwrap()
    }

    #[test]
    fn timeline_is_sampled_every_n_requests_and_at_the_end_however_the_run_is_split() {
        let mut whole = small_sim();
        whole.sample_every(12);
        whole.run(usize::MAX).unwrap();
        let requests: Vec<usize> = whole.timeline().iter().map(|s| s.requests).collect();
        assert_eq!(requests, [12, 24, 36, 48, 50]);
        let last = whole.timeline().last().unwrap();
        assert_eq!(last.hit_blocks, whole.stats().hit_blocks);
        assert_eq!(last.ref_blocks, whole.stats().ref_blocks);
        let held: u64 = whole.core.usage().iter().map(|p| p.bytes).sum();
        assert_eq!(last.level_bytes, [held]);
        assert!(whole.stats().hit_blocks > 0 && held > 0);

        let mut split = small_sim();
        split.sample_every(12);
        for n in [5, 7, 1, 30, 100] {
            split.run(n).unwrap();
        }
        assert_eq!(split.timeline(), whole.timeline());
    }

    #[test]
    fn a_request_loads_the_leading_hits_that_save_the_most_time() {
        // One second a token to recompute; places 0 (free), 1 (2 s a block), 2 (9 s a block).
        let costs = LoadCosts {
            recompute_per_token: 1.0,
            load_per_block: vec![0.0, 2.0, 9.0],
        };
        let block = |place| (place, 4); // 4 tokens: 4 s to recompute
        assert_eq!(costs.paying(&[]), 0);
        assert_eq!(costs.paying(&[block(0), block(1), block(1)]), 3);
        assert_eq!(costs.paying(&[block(0), block(2)]), 1); // the slow one last: recomputed
        assert_eq!(costs.paying(&[block(2)]), 0);
        // A slow block that what follows makes up for (-5 + 3 + 3 > 0) is loaded.
        assert_eq!(costs.paying(&[block(2), block(0), block(0)]), 3);
        assert_eq!(costs.paying(&[block(2), block(0), block(2)]), 0);
        // Equal: the longer (a hit that loads as fast as it computes spares the compute).
        let even = LoadCosts {
            recompute_per_token: 0.5,
            load_per_block: vec![2.0],
        };
        assert_eq!(even.paying(&[(0, 4), (0, 4)]), 2);
    }

    #[test]
    fn hits_that_do_not_pay_are_not_counted_and_bad_costs_are_refused() {
        let mut all = small_sim();
        all.run(usize::MAX).unwrap();
        assert!(all.stats().hit_blocks > 0);
        let places = Tier::ALL.len(); // one level
        let mut none = small_sim();
        let slow = LoadCosts {
            recompute_per_token: 1.0,
            load_per_block: vec![17.0; places], // a block of 16 tokens recomputes in 16 s
        };
        none.set_costs(slow).unwrap();
        none.run(usize::MAX).unwrap();
        assert_eq!((none.stats().hit_blocks, none.stats().hit_tokens), (0, 0));
        // What the core did is the same: the rule only says which hits a request loads.
        assert_eq!(none.core.counters(), all.core.counters());
        let mut fast = small_sim();
        let cheap = LoadCosts {
            recompute_per_token: 1.0,
            load_per_block: vec![1.0; places],
        };
        fast.set_costs(cheap).unwrap();
        fast.run(usize::MAX).unwrap();
        assert_eq!(fast.stats().hit_blocks, all.stats().hit_blocks);

        let mut sim = small_sim();
        for bad in [
            vec![0.0; places + 1],
            vec![f64::NAN; places],
            vec![-1.0; places],
        ] {
            let costs = LoadCosts {
                recompute_per_token: 1.0,
                load_per_block: bad,
            };
            assert!(matches!(
                sim.set_costs(costs),
                Err(Error::InvalidArgument { .. })
            ));
        }
    }

    #[test]
    fn no_timeline_unless_asked() {
        let mut sim = small_sim();
        sim.run(usize::MAX).unwrap();
        assert!(sim.timeline().is_empty());
    }
}
