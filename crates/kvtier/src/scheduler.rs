//! The tier scheduler: `plan()` ranks blocks under the policy and returns the moves that keep
//! the rules of ARCHITECTURE.md "Scoring and scheduling"; the engine copies the bytes, then
//! `commit`s (or `abort`s). Two-phase so that no slot is reused before its copy is done:
//! planning reserves every destination slot and marks the block as moving; commit frees the
//! sources; abort frees the destinations. A plan that makes room may also move a block into the
//! slot of a cached leaf it evicts for it: the leaf leaves the prefix index at once, and gets
//! its slot and place back if the plan is aborted before any copy ran (`abort`), not after
//! (`abort_after_copies`).
//!
//! One plan is pending at a time. A plan never leaves a budgeted tier over its budget after
//! commit (given it was within budget before): bytes only enter a tier through a move admitted
//! under that tier's budget, and a plan's moves are computed against projected post-commit bytes.
//!
//! The passes, in order:
//! 1. live sequences: the sink blocks and the recent window want level 0 on the device; the
//!    rest are ranked per sequence and split between levels 1 and 2 by `compression_ratio`, with
//!    hysteresis at the boundary. A shared block takes the most precise wish of its owners.
//! 2. those wishes become demotions (least important first), then promotions and fetches (most
//!    important first) admitted while the device budget and the move cap allow, but in a plan
//!    that makes room for new blocks (they would take its slots). A lossy level cannot give
//!    back precision: a promotion restores from a write-through copy when one exists,
//!    otherwise it is counted as a no-op.
//! 3. pressure, tier by tier: above `budget * (1 - headroom)` the lowest-ranked blocks are
//!    demoted one level or offloaded to the next tier (a cached chain's ends after every other
//!    cached block: its last blocks, then its sinks); above the budget itself, cached blocks
//!    are evicted and, if the ladder has a `drop` level, live ones dropped.
//! 4. with `pool_headroom`, pool by pool: cached blocks settle at their home levels
//!    (`settle_cached`), then a pool filled past its headroom passes blocks down.

use crate::config::{Config, Tier};
use crate::core::{Cached, Core, End};
use crate::error::{Error, Result};
use crate::stats::BlockStats;
use crate::types::{Key, Loc, NO_BLOCK, NO_SLOT};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MoveKind {
    /// To a lower-precision level, same tier.
    Demote = 0,
    /// To a higher-precision level on the device, restored from a write-through copy.
    Promote = 1,
    /// To the next (slower) tier, same level.
    Offload = 2,
    /// Back to the device from a slower tier, same level.
    Fetch = 3,
    /// Out of the cache; nothing to copy.
    Evict = 4,
    /// Out of attention (a `drop` level); nothing to copy.
    Drop = 5,
    /// A copy of the block's current bytes into the next tier, kept for a later promotion.
    Backup = 6,
}

impl MoveKind {
    pub fn name(self) -> &'static str {
        match self {
            MoveKind::Demote => "demote",
            MoveKind::Promote => "promote",
            MoveKind::Offload => "offload",
            MoveKind::Fetch => "fetch",
            MoveKind::Evict => "evict",
            MoveKind::Drop => "drop",
            MoveKind::Backup => "backup",
        }
    }
}

/// One move: copy `src` into `dst` (decoding/encoding when the levels differ). `dst` is `None`
/// for an eviction; a drop's `dst` has no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub block: u32,
    pub kind: MoveKind,
    pub src: Loc,
    pub dst: Option<Loc>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub id: u64,
    pub moves: Vec<Move>,
    /// Promotions wanted but impossible (lossy level, no higher-precision copy).
    pub noop_promotions: u64,
    /// Moves left for a later step by the move cap or a full destination.
    pub deferred: u64,
    /// Bytes still over a budget after everything the plan could do.
    pub unmet_bytes: u64,
    /// Blocks this plan evicts, each with its parent's hash in the prefix tree (`None`: a
    /// root): taken out of the tree when planned (their parent may go in the same plan, after
    /// them), linked back if the eviction is cancelled or the plan aborted.
    pub(crate) parked: Vec<(u32, Option<u64>)>,
    /// Blocks this plan evicts to move another block into their slot (see
    /// [`Core::move_into_evicted`]): out of the prefix index from the plan on, and back in it
    /// if the plan is aborted before any copy ran.
    pub(crate) handed: Vec<Handed>,
    /// Write-through copies this plan gives up at commit, for room (block, where its copy
    /// lies): their slots take blocks in the next plan of a cascade. Abort keeps them.
    pub released: Vec<(u32, Loc)>,
}

/// A cached leaf a plan evicts to give its slot to another move, as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handed {
    pub(crate) victim: u32,
    pub(crate) loc: Loc,
    /// Its hash, if it was indexed, and its parent's (`None`: a root).
    pub(crate) indexed: Option<(u64, Option<u64>)>,
}

/// Blocks with their ranking keys.
type Ranked = Vec<(Key, u32)>;

/// What pass 1 wants for one referenced block.
#[derive(Debug, Clone, Copy)]
struct Wish {
    block: u32,
    level: u8,
    protected: bool,
}

/// Mutable state of one planning pass.
struct Pass {
    moves: Vec<Move>,
    parked: Vec<(u32, Option<u64>)>,
    handed: Vec<Handed>,
    released: Vec<(u32, Loc)>,
    projected: Vec<u64>,
    moved_bytes: u64,
    cap: u64,
    noop_promotions: u64,
    deferred: u64,
    /// Bytes each tier (by position) must keep free beyond its budget rules: room asked for
    /// blocks about to be allocated.
    reserved: [u64; Tier::ALL.len()],
}

impl Pass {
    fn new(projected: Vec<u64>, cap: u64, reserved: [u64; Tier::ALL.len()]) -> Pass {
        Pass {
            moves: Vec::new(),
            parked: Vec::new(),
            handed: Vec::new(),
            released: Vec::new(),
            projected,
            moved_bytes: 0,
            cap,
            noop_promotions: 0,
            deferred: 0,
            reserved,
        }
    }
}

impl Core {
    /// Plans moves for the current state and holds them pending until `commit`/`abort`.
    pub fn plan(&mut self) -> Result<&crate::Plan> {
        self.plan_with_room(0)
    }

    /// [`Core::plan`] that also frees `room` bytes of the device budget for blocks about to be
    /// allocated (a prefill that would not fit): the pressure pass demotes and offloads until
    /// the device is `room` under its soft budget, so that the allocation then evicts nothing a
    /// lower level or tier could keep. Nothing is evicted or dropped for the room itself.
    pub fn plan_with_room(&mut self, room: u64) -> Result<&crate::Plan> {
        self.plan_keeping(room, &[])
    }

    /// [`Core::plan_with_room`] for a call about to share the cached blocks `keep` (a prompt's
    /// cached prefix, which the call will reference): the plan moves them as it moves live
    /// blocks (demoted or offloaded, not where the call writes) but evicts none of them. Room
    /// made by evicting a block the call then lacks would be room for one block too few.
    pub fn plan_keeping(&mut self, room: u64, keep: &[u32]) -> Result<&crate::Plan> {
        self.check_blocks(keep)?;
        let plan = match self.open_plan(room)? {
            (id, None) => Plan {
                id,
                ..Plan::default()
            },
            (id, Some(reserved)) => self.busy_plan(id, reserved, keep),
        };
        Ok(self.pending.insert(plan))
    }

    /// [`Core::plan_with_room`] committed at once, for a caller that moves no bytes (the
    /// simulator, which plans after every request): an idle plan is never built.
    pub(crate) fn plan_and_commit(&mut self, room: u64) -> Result<()> {
        match self.open_plan(room)? {
            (_, None) => Ok(()), // an empty plan commits nothing
            (id, Some(reserved)) => {
                let plan = self.busy_plan(id, reserved, &[]);
                self.pending = Some(plan);
                self.commit(id)
            }
        }
    }

    /// Starts a plan: one step of the clock, one more plan counted, its id handed out; with
    /// the room reserved per tier unless the plan can only be empty.
    fn open_plan(&mut self, room: u64) -> Result<(u64, Option<[u64; Tier::ALL.len()]>)> {
        if let Some(p) = &self.pending {
            return Err(Error::PlanPending { pending: p.id });
        }
        self.step = self.step.wrapping_add(1);
        self.counters.plans += 1;
        let id = self.next_plan;
        self.next_plan += 1;
        // An array, not a Vec: a trace replay plans after every request.
        let mut reserved = [0; Tier::ALL.len()];
        reserved[self.tier_pos(Tier::Device)] = room;
        // Checked first: most of a replay's plans are idle, and an idle one allocates nothing.
        Ok((id, (!self.idle(&reserved)).then_some(reserved)))
    }

    /// A plan that may not be empty, its deferred and no-op moves counted.
    fn busy_plan(&mut self, id: u64, reserved: [u64; Tier::ALL.len()], keep: &[u32]) -> Plan {
        let (pass, unmet) = self.run_passes(reserved, keep);
        self.counters.noop_promotions += pass.noop_promotions;
        self.counters.deferred_moves += pass.deferred;
        Plan {
            id,
            moves: pass.moves,
            noop_promotions: pass.noop_promotions,
            deferred: pass.deferred,
            unmet_bytes: unmet,
            parked: pass.parked,
            handed: pass.handed,
            released: pass.released,
        }
    }

    /// Passes 1 to 3 of a plan that may not be empty. The cached blocks of `keep` are live
    /// for the pressure passes: referenced while they run (no eviction takes them), wishing
    /// for the level they are at (no promotion or fetch comes of it).
    fn run_passes(&mut self, reserved: [u64; Tier::ALL.len()], keep: &[u32]) -> (Pass, u64) {
        let cap = self.cfg.max_move_bytes.unwrap_or(u64::MAX);
        let mut pass = Pass::new(self.tier_bytes.clone(), cap, reserved);
        let mut wishes = self.level_wishes();
        self.move_live_blocks(&mut pass, &wishes);
        let mut kept: Vec<u32> = keep
            .iter()
            .copied()
            .filter(|&b| self.is_cached(b as usize))
            .collect();
        kept.sort_unstable();
        kept.dedup();
        for &b in &kept {
            self.blocks.rows[b as usize].refcount += 1;
            self.refresh_evictable(b);
            wishes.push(Wish {
                block: b,
                level: self.blocks.rows[b as usize].loc.level,
                protected: false,
            });
        }
        let unmet = self.relieve_all(&mut pass, &wishes);
        for &b in &kept {
            self.blocks.rows[b as usize].refcount -= 1;
            self.refresh_evictable(b);
        }
        (pass, unmet)
    }

    /// The pressure passes of a plan, tier by tier.
    fn relieve_all(&mut self, pass: &mut Pass, wishes: &[Wish]) -> u64 {
        let mut unmet = 0;
        for t in 0..self.cfg.tiers.len() {
            unmet += self.relieve_pressure(pass, t, wishes);
            if self.cfg.pool_headroom {
                for level in 0..self.cfg.num_levels() {
                    self.relieve_pool(pass, t, level as u8, wishes);
                }
            }
        }
        unmet
    }

    pub fn pending_plan(&self) -> Option<&Plan> {
        self.pending.as_ref()
    }

    /// The settings under which a plan can be idle (see `idle`), fixed for a core's life.
    pub(crate) fn config_may_idle(cfg: &Config) -> bool {
        cfg.policy != crate::PolicyKind::Importance
            && !Self::config_ranks_live(cfg)
            && !cfg.pool_headroom
            && cfg.drop_level().is_none()
    }

    /// Whether pass 1 ranks live blocks into levels (else it only wants them at level 0).
    fn ranks_live(&self) -> bool {
        Self::config_ranks_live(&self.cfg)
    }

    fn config_ranks_live(cfg: &Config) -> bool {
        let drops = cfg.drop_ratio > 0.0 && cfg.drop_level().is_some();
        cfg.enable_compression && !cfg.pressure_only && (cfg.last_kept_level() > 0 || drops)
    }

    /// Bytes above which a tier's pressure pass demotes and offloads to keep its headroom.
    fn soft_budget(&self, budget: u64) -> u64 {
        (budget as f64 * (1.0 - f64::from(self.cfg.headroom))) as u64
    }

    /// Bytes above which tier `t`'s pressure pass acts: its soft budget less the bytes
    /// `reserved` there, or the budget itself where nothing can be demoted or offloaded and only
    /// eviction above the budget applies. Room is made by demoting and offloading only: the
    /// hard actions (evicting, dropping) stay for the budget itself.
    fn pressure_threshold(&self, t: usize, budget: u64, reserved: u64) -> u64 {
        let demotable = self.cfg.enable_compression && self.cfg.last_kept_level() > 0;
        if demotable || t + 1 < self.cfg.tiers.len() {
            self.soft_budget(budget).saturating_sub(reserved)
        } else {
            budget
        }
    }

    /// Whether a plan now can only be empty: live blocks are not ranked, every block is at
    /// level 0 on the device (so nothing wants promoting or fetching), no pool keeps its own
    /// headroom and every tier is within its headroom. Trace replay plans after each request;
    /// this check makes those plans O(tiers) instead of O(live blocks). Not under the
    /// importance policy: pass 1 also refreshes the normalised importance cached blocks keep.
    fn idle(&self, reserved: &[u64]) -> bool {
        // Pools are tier-major and the device tier is first: pool 0 is (device, level 0).
        self.plans_may_idle
            && self.pools[1..].iter().all(|p| p.used() == 0)
            && (0..self.cfg.tiers.len()).all(|t| {
                self.budget(t).is_none_or(|b| {
                    self.tier_bytes[t] <= self.pressure_threshold(t, b, reserved[t])
                })
            })
    }

    /// Pass 1: the level each referenced block should have, and whether it is protected (sink
    /// or recent window of some sequence). One entry per block; a shared block takes the most
    /// precise wish of its owners. One pass over each sequence's blocks computes their keys and
    /// sorts them into protected, eligible for level 1 and already below it.
    fn level_wishes(&mut self) -> Vec<Wish> {
        let bs = u64::from(self.cfg.block_size);
        let window = u64::from(self.cfg.recent_window);
        let sinks = self.cfg.sink_blocks as usize;
        let compress = self.ranks_live();
        let low = self.cfg.last_kept_level().min(2);
        let ratio = f64::from(self.cfg.compression_ratio);
        let hyst = f64::from(self.cfg.hysteresis);
        let drop_level = self.cfg.drop_level().filter(|_| self.cfg.drop_ratio > 0.0);
        let may_drop = self.cfg.drop_level().is_some();
        // Sequences are only read here; taking them out lets the loop update statistics.
        // In id order, so that a plan does not depend on the map's layout.
        let ids = self.sequence_ids();
        let seqs = std::mem::take(&mut self.seqs);
        let mut wishes: Vec<Wish> = Vec::with_capacity(seqs.values().map(|s| s.blocks.len()).sum());
        let (mut eligible, mut rest): (Ranked, Ranked) = (Vec::new(), Vec::new());
        let mut any_shared = false;
        for s in ids.iter().map(|id| &seqs[id]) {
            let blocks = &s.blocks;
            let mut recent_from = (s.tokens.saturating_sub(window) / bs) as usize;
            if may_drop {
                // Under a drop level the newest block (the one being written) stays however
                // small the window: a query never loses its own block's keys.
                recent_from = recent_from.min(blocks.len().saturating_sub(1));
            }
            if self.cfg.policy == crate::PolicyKind::Importance {
                self.normalise_importance(blocks);
            }
            eligible.clear();
            rest.clear();
            let mut dropped = 0;
            for (i, &b) in blocks.iter().enumerate() {
                let row = &self.blocks.rows[b as usize];
                any_shared |= row.refcount > 1;
                let protected = i < sinks || i >= recent_from;
                if protected || !compress {
                    // Uncompressed ladders want everything unranked at level 0; dropped blocks
                    // (no slot) are never ranked back in.
                    if protected || row.loc.slot != NO_SLOT {
                        wishes.push(Wish {
                            block: b,
                            level: 0,
                            protected,
                        });
                    }
                } else if row.loc.slot == NO_SLOT {
                    dropped += 1;
                } else if row.loc.level <= 1 {
                    eligible.push((self.key(b as usize), b));
                } else {
                    rest.push((self.key(b as usize), b));
                }
            }
            if !compress {
                continue;
            }
            if let Some(level) = drop_level {
                self.drop_lowest(&mut wishes, [&mut eligible, &mut rest], dropped, level);
            }
            if low == 0 {
                // Only level 0 holds bytes (a ladder of the dtype and `drop`): the rest stay.
                wishes.extend(eligible.iter().map(|&(_, block)| Wish {
                    block,
                    level: 0,
                    protected: false,
                }));
                continue;
            }
            // The level-1 quota is `ratio` of the ranked blocks. A lossy level cannot give
            // precision back, so the quota is filled from the blocks still eligible (at level
            // 0 or 1), most important first; a block already at level 1 keeps it within the
            // hysteresis band. Boundaries by selection (O(m)), not a sort: the second bound
            // lies at or after the first, so it is selected from the tail the first left.
            let m = (eligible.len() + rest.len()) as f64;
            let quota = (ratio * m).round();
            let rank = |n: f64| (n.ceil() as usize).min(eligible.len());
            let (n_reach, n_keep) = (rank(quota), rank(quota + hyst * m));
            let mut reach = None;
            if n_reach > 0 {
                eligible.select_nth_unstable_by(n_reach - 1, |a, b| b.cmp(a));
                reach = Some(eligible[n_reach - 1].0);
            }
            let keep = match n_keep {
                0 => None,
                n if n == n_reach => reach,
                n => {
                    let tail = &mut eligible[n_reach..];
                    tail.select_nth_unstable_by(n - n_reach - 1, |a, b| b.cmp(a));
                    Some(tail[n - n_reach - 1].0)
                }
            };
            for &(key, b) in &eligible {
                let within = |bound: Option<Key>| bound.is_some_and(|k| key >= k);
                let cur = self.blocks.rows[b as usize].loc.level;
                let level_1 = if cur == 1 {
                    within(keep)
                } else {
                    within(reach)
                };
                let wish = if level_1 || low == 1 { 1 } else { low };
                wishes.push(Wish {
                    block: b,
                    level: wish,
                    protected: false,
                });
            }
            for &(_, b) in &rest {
                // Already at or below the lowest split level: no precision to ask for.
                let cur = self.blocks.rows[b as usize].loc.level;
                wishes.push(Wish {
                    block: b,
                    level: cur.max(low),
                    protected: false,
                });
            }
        }
        self.seqs = seqs;
        if any_shared {
            self.merge_shared(wishes)
        } else {
            wishes
        }
    }

    /// The `drop_ratio` quota of one sequence: of its ranked blocks (`ranked`, plus `dropped`
    /// already out of attention), the lowest ranked leave attention until the quota is met.
    /// Those are taken out of `ranked` and wished at the drop `level`. Dropping is one-way: a
    /// dropped block is never ranked back in, so the quota counts the ones already gone.
    fn drop_lowest(
        &self,
        wishes: &mut Vec<Wish>,
        ranked: [&mut Ranked; 2],
        dropped: usize,
        level: u8,
    ) {
        let [eligible, rest] = ranked;
        let total = (eligible.len() + rest.len() + dropped) as f64;
        let quota = (f64::from(self.cfg.drop_ratio) * total).round() as usize;
        let more = quota.saturating_sub(dropped);
        if more == 0 {
            return;
        }
        let mut all: Ranked = eligible.iter().chain(rest.iter()).copied().collect();
        let more = more.min(all.len());
        // (key, block) pairs are distinct: the `more` lowest are those at or below the cut.
        let cut = *all.select_nth_unstable(more - 1).1;
        let out = |x: &(Key, u32)| *x <= cut;
        wishes.extend(all[..more].iter().map(|&(_, block)| Wish {
            block,
            level,
            protected: false,
        }));
        eligible.retain(|x| !out(x));
        rest.retain(|x| !out(x));
    }

    /// One wish per block: a block shared by several sequences takes the most precise level
    /// any of them wants, and is protected if any of them protects it. O(n) with a scratch
    /// column indexed by block id (left clean afterwards).
    fn merge_shared(&mut self, wishes: Vec<Wish>) -> Vec<Wish> {
        let mut first = std::mem::take(&mut self.scratch);
        first.resize(self.num_block_ids(), u32::MAX);
        let mut merged: Vec<Wish> = Vec::with_capacity(wishes.len());
        for w in wishes {
            let i = w.block as usize;
            match first[i] {
                u32::MAX => {
                    first[i] = merged.len() as u32;
                    merged.push(w);
                }
                at => {
                    let m = &mut merged[at as usize];
                    m.level = m.level.min(w.level);
                    m.protected |= w.protected;
                }
            }
        }
        for w in &merged {
            first[w.block as usize] = u32::MAX;
        }
        self.scratch = first;
        merged
    }

    /// Min-max normalises each importance signal over the blocks of one sequence and combines
    /// them with the configured weights; a signal a block lacks gives its weight to the others.
    pub(crate) fn normalise_importance(&mut self, blocks: &[u32]) {
        use crate::stats::{KNOWN_ATTENTION, KNOWN_LEARNED, KNOWN_MAGNITUDE};
        const BITS: [u8; 3] = [KNOWN_MAGNITUDE, KNOWN_LEARNED, KNOWN_ATTENTION];
        let weights = self.cfg.weights;
        let s = self.stats_mut();
        let signals = |st: &BlockStats| [st.magnitude, st.learned, st.attn_ema];
        let mut range = [(f32::INFINITY, f32::NEG_INFINITY); 3];
        let (mut known_any, mut known_all) = (0u8, u8::MAX);
        for &b in blocks {
            let st = &s[b as usize];
            known_any |= st.known;
            known_all &= st.known;
            for (k, v) in signals(st).into_iter().enumerate() {
                // Plain comparisons: signals are never NaN, and `f32::min` pays to handle it.
                if st.known & BITS[k] != 0 {
                    let (lo, hi) = &mut range[k];
                    if v < *lo {
                        *lo = v;
                    }
                    if v > *hi {
                        *hi = v;
                    }
                }
            }
        }
        if known_any == 0 {
            for &b in blocks {
                s[b as usize].importance = 0.0;
            }
            return;
        }
        // The signals some block knows, each with its minimum and span (0: all equal). The
        // loop below skips the others, and the per-block test of a signal when every block
        // knows the same ones; the f32 operations and their order are those of the plain form
        // (`hi > lo` is `hi - lo > 0` for finite floats), so the scores are bit for bit equal.
        let mut active = [(0usize, 0.0f32, 0.0f32); 3];
        let mut n = 0;
        for (k, &(lo, hi)) in range.iter().enumerate() {
            if known_any & BITS[k] != 0 {
                active[n] = (k, lo, hi - lo);
                n += 1;
            }
        }
        // Total weight of the signals a block knows, summed in order.
        let total_weight = |known: u8| {
            (0..3)
                .filter(|&k| known & BITS[k] != 0)
                .fold(0.0f32, |w, k| w + weights[k])
        };
        let score = |st: &mut BlockStats, known: u8, weight: f32| {
            let v = signals(st);
            let mut sum = 0.0f32;
            for &(k, lo, span) in &active[..n] {
                if known & BITS[k] != 0 {
                    let x = if span > 0.0 { (v[k] - lo) / span } else { 0.5 };
                    sum += weights[k] * x;
                }
            }
            st.importance = if weight > 0.0 { sum / weight } else { 0.0 };
        };
        if known_all == known_any {
            // Every block knows the same signals: no per-block test, one total weight.
            let weight = total_weight(known_all);
            blocks
                .iter()
                .for_each(|&b| score(&mut s[b as usize], known_all, weight));
        } else {
            for &b in blocks {
                let st = &mut s[b as usize];
                score(st, st.known, total_weight(st.known));
            }
        }
    }

    fn movable(&self, b: u32) -> bool {
        let i = b as usize;
        self.blocks.rows[i].pins == 0 && !self.blocks.rows[i].moving
    }

    /// Reserves `dst` and records the move, or returns false when the pool or cap says no.
    fn push_move(
        &mut self,
        pass: &mut Pass,
        block: u32,
        kind: MoveKind,
        src: Loc,
        dst: Option<(Tier, u8)>,
    ) -> bool {
        self.push_move_into(pass, block, kind, src, dst, None)
    }

    /// [`Core::push_move`] into slot `slot` of the destination pool when given (a slot an
    /// eviction of this plan handed on, see [`Core::move_into_evicted`]), else a free one.
    fn push_move_into(
        &mut self,
        pass: &mut Pass,
        block: u32,
        kind: MoveKind,
        src: Loc,
        dst: Option<(Tier, u8)>,
        slot: Option<u32>,
    ) -> bool {
        let copies = !matches!(kind, MoveKind::Evict | MoveKind::Drop);
        let src_bytes = self.level_bytes(src.level);
        if copies && pass.moved_bytes + src_bytes > pass.cap {
            pass.deferred += 1;
            return false;
        }
        let dst = match (kind, dst) {
            (MoveKind::Evict, _) => None,
            (MoveKind::Drop, Some((tier, level))) => Some(Loc {
                tier,
                level,
                slot: NO_SLOT,
            }),
            (_, Some((tier, level))) if slot.is_some() => Some(Loc {
                tier,
                level,
                slot: slot.expect("given"),
            }),
            (_, Some((tier, level))) => match self.take_slot(tier, level) {
                Some(loc) => Some(loc),
                None => {
                    pass.deferred += 1;
                    return false;
                }
            },
            (_, None) => unreachable!("only evictions have no destination"),
        };
        if copies {
            pass.moved_bytes += src_bytes;
        }
        let cur = self.blocks.rows[block as usize].loc;
        let t_cur = self.tier_pos(cur.tier);
        if kind != MoveKind::Backup {
            pass.projected[t_cur] -= self.level_bytes(cur.level);
        }
        if kind == MoveKind::Promote {
            // The copy is consumed by the restore.
            pass.projected[self.tier_pos(src.tier)] -= src_bytes;
        }
        if let Some(d) = dst.filter(|d| d.slot != NO_SLOT) {
            pass.projected[self.tier_pos(d.tier)] += self.level_bytes(d.level);
        }
        if kind != MoveKind::Backup {
            self.blocks.rows[block as usize].moving = true;
            self.refresh_evictable_if_indexed(block);
        }
        if kind == MoveKind::Evict
            && self.prefix_aware()
            && self.blocks.rows[block as usize].indexed
        {
            let parent = self.park(block);
            pass.parked.push((block, parent));
        }
        pass.moves.push(Move {
            block,
            kind,
            src,
            dst,
        });
        true
    }

    fn fits(&self, pass: &Pass, tier_pos: usize, bytes: u64) -> bool {
        self.budget(tier_pos)
            .is_none_or(|b| pass.projected[tier_pos] + bytes + pass.reserved[tier_pos] <= b)
    }

    /// Pass 2: demotions toward the wished level, then promotions and fetches.
    fn move_live_blocks(&mut self, pass: &mut Pass, wishes: &[Wish]) {
        let mut down: Vec<(Key, u32, u8)> = Vec::new();
        let mut up: Vec<(Key, u32, u8)> = Vec::new();
        for w in wishes {
            let (b, i) = (w.block, w.block as usize);
            let loc = self.blocks.rows[i].loc;
            if (loc.tier == Tier::Device && loc.level == w.level) || !self.movable(b) {
                continue; // where it should be (the common case), or held in place
            }
            if loc.slot == NO_SLOT && self.blocks.copy[i].is_none() {
                continue;
            }
            if loc.level > w.level || loc.tier != Tier::Device {
                up.push((self.key(i), b, w.level));
            } else if loc.level < w.level {
                down.push((self.key(i), b, w.level));
            }
        }
        down.sort_unstable();
        for (_, b, level) in down {
            self.demote_to(pass, b, level);
        }
        // A plan that makes room brings nothing up: each block it would bring takes a slot the
        // room needs (a fetch there and an offload to make up for it, plan after plan, made
        // no room at all). The next plan brings them.
        if pass.reserved.iter().any(|&r| r > 0) {
            pass.deferred += up.len() as u64;
            return;
        }
        up.sort_unstable_by(|a, b| b.cmp(a));
        for (_, b, wished) in up {
            let i = b as usize;
            let loc = self.blocks.rows[i].loc;
            let restore =
                self.blocks.copy[i].filter(|c| c.level < loc.level || loc.slot == NO_SLOT);
            if loc.level > wished && restore.is_none() {
                pass.noop_promotions += 1;
            }
            let (kind, src) = match restore {
                Some(copy) => (MoveKind::Promote, copy),
                None if loc.tier != Tier::Device && loc.slot != NO_SLOT => (MoveKind::Fetch, loc),
                None => continue,
            };
            let level = src.level;
            if !self.fits(pass, 0, self.level_bytes(level)) {
                pass.deferred += 1;
                continue;
            }
            self.push_move(pass, b, kind, src, Some((Tier::Device, level)));
        }
    }

    /// Demotes a device block to `level`, first backing it up to the next tier when
    /// write-through is on and no higher-precision copy exists. To a drop level the block
    /// leaves attention for good (nothing to copy, nothing backed up: it is never ranked back).
    fn demote_to(&mut self, pass: &mut Pass, b: u32, level: u8) -> bool {
        self.demote_to_slot(pass, b, level, None)
    }

    /// [`Core::demote_to`] into slot `slot` of the destination pool when given.
    fn demote_to_slot(&mut self, pass: &mut Pass, b: u32, level: u8, slot: Option<u32>) -> bool {
        let i = b as usize;
        let loc = self.blocks.rows[i].loc;
        if self.cfg.level_bytes[usize::from(level)] == 0 {
            return self.push_move(pass, b, MoveKind::Drop, loc, Some((loc.tier, level)));
        }
        // No new copy for a plan that makes room: room takes copies' slots, not the reverse.
        let for_room = pass.reserved.iter().any(|&r| r > 0);
        if self.cfg.write_through
            && !for_room
            && self.cfg.tiers.len() > 1
            && self.blocks.copy[i].is_none()
        {
            let next = self.cfg.tiers[self.tier_pos(loc.tier) + 1..]
                .first()
                .map(|t| t.tier);
            if let Some(next) = next {
                let t = self.tier_pos(next);
                if self.fits(pass, t, self.level_bytes(loc.level)) {
                    self.push_move(pass, b, MoveKind::Backup, loc, Some((next, loc.level)));
                }
            }
        }
        self.push_move_into(
            pass,
            b,
            MoveKind::Demote,
            loc,
            Some((loc.tier, level)),
            slot,
        )
    }

    /// Moves `b` into the slot of `victim`, a cached leaf this plan evicts for it: below `b`
    /// in its tier (a demotion), or at its level in the next tier (an offload). One plan makes
    /// the room and fills it. The victim leaves the prefix index at once (nothing may share it
    /// while its slot takes `b`'s bytes) and its row gives the slot up; commit releases it, and
    /// so does an abort after copies ran (its bytes may be gone), while an abort before any
    /// copy gives it back (see [`Core::abort`]).
    fn move_into_evicted(&mut self, pass: &mut Pass, b: u32, victim: u32) -> bool {
        let loc = self.blocks.rows[b as usize].loc;
        if pass.moved_bytes + self.level_bytes(loc.level) > pass.cap {
            pass.deferred += 1;
            return false;
        }
        let at = self.blocks.rows[victim as usize].loc;
        let hash = self.blocks.rows[victim as usize].hash;
        let indexed = self.blocks.rows[victim as usize].indexed;
        if !self.push_move(pass, victim, MoveKind::Evict, at, None) {
            return false;
        }
        let parent = match pass.parked.last() {
            Some(&(p, parent)) if p == victim => {
                pass.parked.pop(); // it leaves the index now, not at commit
                parent
            }
            _ => None,
        };
        pass.handed.push(Handed {
            victim,
            loc: at,
            indexed: indexed.then_some((hash, parent)),
        });
        self.leave_prefix_index(victim);
        self.blocks.rows[victim as usize].loc.slot = NO_SLOT;
        if at.tier == loc.tier {
            self.demote_to_slot(pass, b, at.level, Some(at.slot))
        } else {
            let dst = Some((at.tier, at.level));
            self.push_move_into(pass, b, MoveKind::Offload, loc, dst, Some(at.slot))
        }
    }

    /// The cached leaf of `pools` eviction would take first, if it may give its slot to `b`:
    /// any for a live block; for a cached one, a leaf eviction would take before it (by
    /// eviction key).
    fn victim_for(&mut self, b: u32, pools: Vec<usize>, is_live: bool) -> Option<u32> {
        let (key, victim) = self.lowest_evictable(pools)?;
        (is_live || key < self.evict_key(b as usize)).then_some(victim)
    }

    /// Live blocks of tier `tier` a pressure pass may move, lowest key last (`pop` takes the
    /// lowest): unprotected ones (any move), or protected ones that are complete (`guarded`: a
    /// move to the next tier only, keeping their level, when room for new blocks is asked for;
    /// a block still being written stays where new K/V goes).
    fn movable_live(
        &self,
        wishes: &[Wish],
        tier: Tier,
        level: Option<u8>,
        guarded: bool,
    ) -> Ranked {
        let full = self.cfg.block_size;
        let mut live: Ranked = wishes
            .iter()
            .filter(|w| {
                let row = &self.blocks.rows[w.block as usize];
                let loc = row.loc;
                w.protected == guarded
                    && (!guarded || row.fill == full)
                    && self.movable(w.block)
                    && loc.tier == tier
                    && level.is_none_or(|l| loc.level == l)
                    && loc.slot != NO_SLOT
            })
            .map(|w| (self.key(w.block as usize), w.block))
            .collect();
        live.sort_unstable_by(|a, b| b.cmp(a));
        live
    }

    /// Takes a cached block's entry out of its pool's queue of every cached block for the rest
    /// of a pass (`aside`): no move applies to it now, and blocks ranked above it may still go.
    fn set_aside(&mut self, b: u32, aside: &mut Vec<(usize, Key, crate::evict::Ticket)>) {
        let loc = self.blocks.rows[b as usize].loc;
        let pool = self.pool_index(loc.tier, loc.level);
        if let Some((key, ticket)) = self.pop_cached(pool) {
            debug_assert_eq!(ticket.block, b, "the lowest entry is the block's");
            aside.push((pool, key, ticket));
        }
    }

    /// Puts back the entries a pass set aside (those still valid: the pass may have moved a
    /// block meanwhile).
    fn put_back(&mut self, aside: Vec<(usize, Key, crate::evict::Ticket)>) {
        for (pool, key, ticket) in aside {
            self.restore_cached(pool, key, ticket);
        }
    }

    /// Pass 3 for one tier. Returns the bytes it could not bring under the budget.
    fn relieve_pressure(&mut self, pass: &mut Pass, t: usize, wishes: &[Wish]) -> u64 {
        let Some(budget) = self.budget(t) else {
            return 0;
        };
        if pass.projected[t] <= self.pressure_threshold(t, budget, pass.reserved[t]) {
            return 0;
        }
        let mut aside = Vec::new();
        let unmet = self.relieve_tier(pass, t, budget, wishes, &mut aside);
        self.put_back(aside);
        unmet
    }

    /// [`Core::relieve_pressure`]'s loop. Soft actions first, lowest key first among the cached
    /// blocks of pools where one applies and the live blocks: demote one level, else offload;
    /// above the budget itself, a live block that neither fits is dropped (with a drop level);
    /// then, where room is asked for, complete protected blocks go to the next tier. Above the
    /// budget itself, with none of that left, cached leaves are evicted, lowest eviction key
    /// first (a prefix-aware core's leaves, a plain core's cached blocks).
    fn relieve_tier(
        &mut self,
        pass: &mut Pass,
        t: usize,
        budget: u64,
        wishes: &[Wish],
        aside: &mut Vec<(usize, Key, crate::evict::Ticket)>,
    ) -> u64 {
        let soft = self.soft_budget(budget).saturating_sub(pass.reserved[t]);
        let tier = self.cfg.tiers[t].tier;
        let next = self.cfg.tiers.get(t + 1).map(|c| c.tier);
        let levels = self.cfg.num_levels();
        let last_kept = self.cfg.last_kept_level();
        let demotable = self.cfg.enable_compression && last_kept > 0;
        let mut live = self.movable_live(wishes, tier, None, false);
        let mut guarded = if pass.reserved[t] > 0 && next.is_some() {
            self.movable_live(wishes, tier, None, true)
        } else {
            Vec::new()
        };
        let all_pools: Vec<usize> = (t * levels..(t + 1) * levels).collect();
        let mut pools: Vec<usize> = Vec::with_capacity(levels);
        // Live blocks no soft action fits wait for the hard pass (which may drop them).
        let mut skipped: Vec<(Key, u32)> = Vec::new();
        let mut hard = false;
        loop {
            let threshold = if hard { budget } else { soft };
            if pass.projected[t] <= threshold {
                return 0;
            }
            let next_room = next.is_some_and(|n| {
                let np = self.tier_pos(n);
                self.fits(pass, np, self.level_bytes(last_kept))
            });
            pools.clear();
            pools.extend(all_pools.iter().copied().filter(|p| {
                let level = (p % levels) as u8;
                next_room || (demotable && level < last_kept)
            }));
            let cached = self.lowest_cached(pools.iter().copied(), Cached::Any);
            let (b, is_live) = match (cached, live.last().copied()) {
                (Some(c), Some(l)) if l < c => (l.1, true),
                (Some(c), _) => (c.1, false),
                (None, Some(l)) => (l.1, true),
                (None, None) => {
                    // Nothing left to demote or offload but complete protected blocks, which
                    // may go to the next tier for the room asked for.
                    if let (Some((_, g)), true, Some(n)) = (guarded.pop(), next_room, next) {
                        let loc = self.blocks.rows[g as usize].loc;
                        self.push_move(pass, g, MoveKind::Offload, loc, Some((n, loc.level)));
                        continue;
                    }
                    if hard {
                        break;
                    }
                    hard = true;
                    live.append(&mut skipped);
                    live.sort_unstable_by(|a, b| b.cmp(a));
                    continue;
                }
            };
            if is_live {
                live.pop();
            }
            let loc = self.blocks.rows[b as usize].loc;
            let acted = if demotable && loc.level < last_kept {
                self.demote_to(pass, b, loc.level + 1)
            } else if let (true, Some(n)) = (next_room, next) {
                self.push_move(pass, b, MoveKind::Offload, loc, Some((n, loc.level)))
            } else if let (true, true, Some(d)) = (hard, is_live, self.cfg.drop_level()) {
                self.push_move(pass, b, MoveKind::Drop, loc, Some((tier, d)))
            } else {
                false
            };
            if acted {
                continue;
            }
            if is_live && !hard {
                skipped.push((self.key(b as usize), b));
            } else if !is_live {
                // The move cap or a full pool stopped a copy: keeping the headroom is off for
                // this plan, and the block waits for the evictions.
                if !hard {
                    hard = true;
                    live.append(&mut skipped);
                    live.sort_unstable_by(|a, b| b.cmp(a));
                }
                self.set_aside(b, aside);
            }
        }
        // Above the budget itself, with nothing left to demote or offload: evictions.
        self.put_back(std::mem::take(aside));
        while pass.projected[t] > budget {
            let Some((_, leaf)) = self.lowest_evictable(all_pools.iter().copied()) else {
                return pass.projected[t] - budget;
            };
            let loc = self.blocks.rows[leaf as usize].loc;
            self.push_move(pass, leaf, MoveKind::Evict, loc, None);
        }
        0
    }

    /// Pass 4 (with `pool_headroom`), for one explicitly sized pool filled past `1 - headroom`
    /// of its slots (for the device's level-0 pool, also past the slots of the room asked
    /// for): its movable blocks, lowest key first, are demoted as deep as needed, to the first
    /// lower level with a free slot, else offloaded when the next tier has room, else demoted
    /// into the slot of a cached leaf below that the plan evicts for it (one that would be
    /// evicted before the block; for room, where `evict_on_full` allows). When none is left,
    /// the pool's own cached leaves are evicted where it is completely full or (`evict_on_full`)
    /// room is asked for, lowest eviction key first, and then, for room, complete protected
    /// blocks offloaded.
    fn relieve_pool(&mut self, pass: &mut Pass, t: usize, level: u8, wishes: &[Wish]) {
        let levels = self.cfg.num_levels();
        let p = t * levels + usize::from(level);
        let tier = self.cfg.tiers[t].tier;
        let explicit = self
            .cfg
            .pool_slots
            .iter()
            .any(|e| e.0 == tier && e.1 == level);
        let cap = self.pools[p].capacity();
        if !explicit || cap == 0 {
            return;
        }
        if self.cfg.settle_cached {
            self.settle_pool(pass, t, level);
        }
        let headroom = self.headroom_slots(p);
        // The device's level-0 pool is where the blocks that asked for room will go.
        let room = if tier == Tier::Device && level == 0 {
            let slots = pass.reserved[t].div_ceil(self.level_bytes(0));
            u32::try_from(slots).unwrap_or(u32::MAX)
        } else {
            0
        };
        let keep_free = headroom.max(room).min(cap);
        let soft = cap - keep_free;
        // Slots this plan already empties at commit (every move but a backup frees the block's
        // current slot).
        let leaving = pass
            .moves
            .iter()
            .filter(|m| m.kind != MoveKind::Backup)
            .map(|m| self.blocks.rows[m.block as usize].loc)
            .filter(|cur| cur.tier == tier && cur.level == level && cur.slot != NO_SLOT)
            .count() as u32;
        let mut used = self.pools[p].used().saturating_sub(leaving);
        if used <= soft {
            return;
        }
        let mut live = self.movable_live(wishes, tier, Some(level), false);
        let next = self.cfg.tiers.get(t + 1).map(|c| c.tier);
        // A plan that makes room for new blocks: every pool may have to pass blocks on (a
        // cascade: the device's level 0 demotes into level 1, which offloads to the host...).
        let for_room = pass.reserved.iter().any(|&r| r > 0);
        let mut guarded = if for_room {
            self.movable_live(wishes, tier, Some(level), true)
        } else {
            Vec::new()
        };
        let last_kept = self.cfg.last_kept_level();
        let demotable = self.cfg.enable_compression && level < last_kept;
        // Room for new blocks may evict cached leaves (the pool's own, or one below whose slot
        // a block of the pool takes) when the engine allows evicting for room.
        let evict_for_room = room > 0 && self.cfg.evict_on_full;
        let free =
            |c: &Core, tier: Tier, level: u8| c.pools[c.pool_index(tier, level)].free_count() > 0;
        // The next tier's pool at this level, if it has a free slot for a block. When the
        // plan makes room and it has none, a write-through copy there gives its slot up at
        // commit, for the next plan of the cascade.
        let offload_to = |c: &mut Core, pass: &mut Pass| {
            next.filter(|&n| {
                if !free(c, n, level) {
                    if for_room {
                        c.release_copy_at(pass, n, level);
                    }
                    return false;
                }
                c.fits(pass, c.tier_pos(n), c.level_bytes(level))
            })
        };
        let mut aside = Vec::new();
        while used > soft {
            let cached = self.lowest_cached([p], Cached::Any);
            let (b, is_live) = match (cached, live.last().copied()) {
                (Some(c), Some(l)) if l < c => (l.1, true),
                (Some(c), _) => (c.1, false),
                (None, Some(l)) => (l.1, true),
                (None, None) => break,
            };
            if is_live {
                live.pop();
            }
            let loc = self.blocks.rows[b as usize].loc;
            let below = (level + 1..=last_kept).find(|&l| free(self, tier, l));
            let acted = match (below, offload_to(self, &mut *pass)) {
                (Some(l), _) if demotable => self.demote_to(pass, b, l),
                (_, Some(n)) => self.push_move(pass, b, MoveKind::Offload, loc, Some((n, level))),
                _ if evict_for_room => {
                    // A leaf below (a demotion), else one behind (an offload), gives its slot.
                    let below: Vec<usize> = (level + 1..=last_kept)
                        .filter(|_| demotable)
                        .map(|l| self.pool_index(tier, l))
                        .collect();
                    let victim = self.victim_for(b, below, is_live).or_else(|| {
                        let behind = next.map(|n| self.pool_index(n, level));
                        self.victim_for(b, behind.into_iter().collect(), is_live)
                    });
                    victim.is_some_and(|v| self.move_into_evicted(pass, b, v))
                }
                _ => false,
            };
            if acted {
                used -= 1;
            } else if !is_live {
                self.set_aside(b, &mut aside); // a block ranked above it may still go
            }
        }
        self.put_back(aside);
        while used > soft && (used >= cap || evict_for_room) {
            let Some((_, leaf)) = self.lowest_evictable([p]) else {
                break;
            };
            let loc = self.blocks.rows[leaf as usize].loc;
            self.push_move(pass, leaf, MoveKind::Evict, loc, None);
            used -= 1;
        }
        // Last, for room: complete protected blocks (a sink, the recent window as it stood
        // before the write that asks) keep their level in the next tier where it has room, and
        // otherwise give it up: a write never fails while room exists in any tier.
        while used > soft {
            let Some((_, g)) = guarded.pop() else {
                break;
            };
            let loc = self.blocks.rows[g as usize].loc;
            let below = (level + 1..=last_kept).find(|&l| free(self, tier, l));
            let moved = match (offload_to(self, &mut *pass), below) {
                (Some(n), _) => self.push_move(pass, g, MoveKind::Offload, loc, Some((n, level))),
                (None, Some(l)) if demotable => self.demote_to(pass, g, l),
                _ if evict_for_room => {
                    let behind = next.map(|n| self.pool_index(n, level));
                    let victim = self.victim_for(g, behind.into_iter().collect(), true);
                    victim.is_some_and(|v| self.move_into_evicted(pass, g, v))
                }
                _ => false,
            };
            if moved {
                used -= 1;
            }
        }
    }

    /// The slots pass 4 keeps free in pool `p`: `headroom` of its capacity, rounded up.
    fn headroom_slots(&self, p: usize) -> u32 {
        (f64::from(self.pools[p].capacity()) * f64::from(self.cfg.headroom)).ceil() as u32
    }

    /// With `settle_cached`, before pass 4 makes a pool's headroom: the cached blocks of pool
    /// (tier `t`, `level`) that settle deeper (see [`End::home`]: every block but the chains'
    /// ends, and above the ends' level those too) go down, lowest-ranked first, each to the
    /// deepest level between that has a free slot beyond its headroom (a level filled to the
    /// brim would evict to make its headroom again), as far as slots and the move cap go.
    fn settle_pool(&mut self, pass: &mut Pass, t: usize, level: u8) {
        let tier = self.cfg.tiers[t].tier;
        let p = self.pool_index(tier, level);
        let (last_kept, ends) = (self.cfg.last_kept_level(), self.cfg.resolved_ends_level());
        if !self.cfg.enable_compression {
            return;
        }
        for end in End::ALL {
            let home = end.home(ends, last_kept);
            while let Some((_, b)) = self.peek_cached(p, Cached::Ranked(end)) {
                let spare = |l: u8| {
                    let p = self.pool_index(tier, l);
                    self.pools[p].free_count() > self.headroom_slots(p)
                };
                let Some(to) = (level + 1..=home).rev().find(|&l| spare(l)) else {
                    break; // none free for this block, and so none for the others of its kind
                };
                if !self.demote_to(pass, b, to) {
                    return; // the move cap
                }
            }
        }
    }

    /// Gives up, at commit, one write-through copy that holds a slot of pool (`tier`,
    /// `level`), for room: a copy only spares a later promotion its precision, and a write
    /// never fails for one. Nothing is copied; an abort keeps it. A copy a move of this plan
    /// reads (a promotion's source) or already gives up stays.
    fn release_copy_at(&mut self, pass: &mut Pass, tier: Tier, level: u8) {
        let rows = &self.blocks.rows;
        let released = &pass.released;
        let found = self.blocks.copy.iter().enumerate().find_map(|(i, c)| {
            c.filter(|c| c.tier == tier && c.level == level)
                .filter(|c| !rows[i].moving && !released.contains(&(i as u32, *c)))
                .map(|c| (i as u32, c))
        });
        pass.released.extend(found);
    }

    /// Applies a pending plan after the engine copied its bytes: sources are freed now. A move
    /// whose block was pinned meanwhile, or an eviction of a block shared again meanwhile, is
    /// cancelled (its destination freed, the block left where it was) and counted.
    pub fn commit(&mut self, plan_id: u64) -> Result<()> {
        let plan = self.take_pending(plan_id)?;
        let mut parked = plan.parked.iter().peekable();
        for m in &plan.moves {
            let b = m.block;
            let i = b as usize;
            let parent = match parked.peek() {
                Some(&&(p, hash)) if p == b && m.kind == MoveKind::Evict => {
                    parked.next();
                    Some(hash)
                }
                _ => None,
            };
            // The engine pinned the block (it reads it), or a new request shares a block planned
            // for eviction (or one after it in a prefix: the block is no leaf any more), while
            // the plan was pending: that move no longer applies.
            let pinned = self.blocks.rows[i].pins > 0 && m.kind != MoveKind::Backup;
            let reshared = m.kind == MoveKind::Evict
                && (self.blocks.rows[i].refcount > 0 || !self.blocks.links[i].is_leaf());
            if pinned || reshared {
                if let Some(dst) = m.dst {
                    self.give_slot(dst);
                }
                self.blocks.rows[i].moving = false;
                self.counters.cancelled_moves += 1;
                if let Some(hash) = parent {
                    self.unpark(b, hash);
                }
                continue;
            }
            match m.kind {
                MoveKind::Backup => {
                    let dst = m.dst.expect("a backup has a destination");
                    if let Some(old) = self.blocks.copy[i].replace(dst) {
                        self.give_slot(old);
                    }
                    self.counters.backups += 1;
                }
                MoveKind::Evict => {
                    self.blocks.rows[i].moving = false;
                    self.count_eviction(b);
                    self.release_block(b);
                    continue;
                }
                MoveKind::Promote => {
                    let cur = self.blocks.rows[i].loc;
                    self.log_tier_change(b, cur.tier, m.dst);
                    self.give_slot(cur);
                    self.give_slot(m.src);
                    self.blocks.copy[i] = None;
                    self.blocks.rows[i].loc = m.dst.expect("a promotion has a destination");
                    self.counters.promotions += 1;
                }
                MoveKind::Drop => {
                    self.give_slot(m.src);
                    self.blocks.rows[i].loc = m.dst.expect("a drop has a destination level");
                    self.leave_prefix_index(b);
                    self.counters.drops += 1;
                }
                MoveKind::Demote | MoveKind::Offload | MoveKind::Fetch => {
                    self.log_tier_change(b, m.src.tier, m.dst);
                    self.give_slot(m.src);
                    self.blocks.rows[i].loc = m.dst.expect("a copy has a destination");
                    match m.kind {
                        MoveKind::Demote => self.counters.demotions += 1,
                        MoveKind::Offload => self.counters.offloads += 1,
                        _ => self.counters.fetches += 1,
                    }
                }
            }
            if !matches!(m.kind, MoveKind::Evict | MoveKind::Drop) {
                self.counters.bytes_moved += self.level_bytes(m.src.level);
            }
            self.blocks.rows[i].moving = false;
        }
        for &(b, copy) in &plan.released {
            if self.blocks.copy[b as usize] == Some(copy) {
                self.blocks.copy[b as usize] = None;
                self.give_slot(copy);
            }
        }
        self.settle(&plan);
        Ok(())
    }

    /// Drops a pending plan: its destination slots are freed, every block stays where it was.
    pub fn abort(&mut self, plan_id: u64) -> Result<()> {
        self.abort_plan(plan_id, false)
    }

    /// [`Core::abort`] of a plan some of whose copies ran: every block stays where it was but
    /// for those the plan evicted to move another block into their slot, which are gone (their
    /// bytes may have been overwritten).
    pub fn abort_after_copies(&mut self, plan_id: u64) -> Result<()> {
        self.abort_plan(plan_id, true)
    }

    fn abort_plan(&mut self, plan_id: u64, copied: bool) -> Result<()> {
        let plan = self.take_pending(plan_id)?;
        // Before any copy, a slot handed on is still its victim's, bytes and all.
        let handed_back: Vec<Loc> = if copied {
            Vec::new()
        } else {
            plan.handed.iter().map(|h| h.loc).collect()
        };
        for m in &plan.moves {
            if let Some(dst) = m.dst.filter(|d| !handed_back.contains(d)) {
                self.give_slot(dst);
            }
            self.blocks.rows[m.block as usize].moving = false;
        }
        if !copied {
            // Victims in reverse: a chain was taken leaf first, so each parent is indexed again
            // before its child looks it up.
            for h in plan.handed.iter().rev() {
                self.give_back(h);
            }
        }
        for &(b, parent) in plan.parked.iter().rev() {
            self.unpark(b, parent);
        }
        self.counters.aborts += 1;
        self.settle(&plan);
        Ok(())
    }

    /// A victim of [`Core::move_into_evicted`] takes its slot back, and its place in the prefix
    /// index and tree unless another block took its hash or its parent left meanwhile.
    fn give_back(&mut self, h: &Handed) {
        let b = h.victim;
        self.blocks.rows[b as usize].loc = h.loc;
        let Some((hash, parent)) = h.indexed else {
            return;
        };
        let parent = match parent {
            None => Some(NO_BLOCK),
            Some(p) => self.index.get(p),
        };
        if self.index_block(b, hash, parent) {
            self.log_moved(hash, h.loc.tier); // back where it was
        }
    }

    /// Logs a committed move of an indexed block from tier `from` to `dst`'s tier, if they
    /// differ (see `Core::set_index_log`).
    fn log_tier_change(&mut self, b: u32, from: Tier, dst: Option<Loc>) {
        let row = &self.blocks.rows[b as usize];
        match dst {
            Some(dst) if row.indexed && dst.tier != from => self.log_moved(row.hash, dst.tier),
            _ => {}
        }
    }

    fn take_pending(&mut self, plan_id: u64) -> Result<Plan> {
        match &self.pending {
            Some(p) if p.id == plan_id => Ok(self.pending.take().expect("matched")),
            _ => Err(Error::UnknownPlan { plan: plan_id }),
        }
    }

    /// After commit/abort: re-index evictability and free blocks nobody needs any more.
    fn settle(&mut self, plan: &Plan) {
        for m in &plan.moves {
            let i = m.block as usize;
            if self.blocks.rows[i].live {
                self.refresh_evictable(m.block);
                self.release_if_orphan(m.block);
            }
        }
    }
}
