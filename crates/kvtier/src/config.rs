//! Configuration of a [`crate::Core`]: the level ladder (bytes per block at each precision level),
//! the storage tiers and their byte budgets, the policy and the scheduler's knobs. A `Config` is
//! validated once by [`Config::validate`]; the rest of the core relies on that.

use crate::error::{Error, Result};
use std::fmt;

/// Where a block's bytes live, fastest first. The numeric order is the offload order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
    Remote = 3,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }

    pub fn parse(name: &str) -> Result<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| Error::InvalidArgument {
                what: "tier",
                reason: format!("{name:?}; expected one of device, host, disk, remote"),
            })
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How blocks are ranked. Low rank is demoted, offloaded and evicted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `w_mag*magnitude + w_learned*learned + w_attn*attention`, normalised per sequence; blocks
    /// with none of the three signals (trace replay) fall back on decayed access frequency.
    /// That ranks demotion and offload; eviction of a prefix-aware core's cached leaves goes by
    /// how often each block's prefix came back, adapted to the reuse it measures (see
    /// `core::frequency`).
    Importance,
    /// Least recently read first.
    Lru,
    /// Least (decayed) frequently read first.
    Lfu,
    /// Heavy hitters: lowest accumulated attention first (H2O).
    H2o,
    /// Lowest persistence of importance over a window of attention reports first (Scissorhands).
    Scissorhands,
}

impl PolicyKind {
    pub fn parse(name: &str) -> Result<PolicyKind> {
        match name {
            "importance" => Ok(PolicyKind::Importance),
            "lru" => Ok(PolicyKind::Lru),
            "lfu" => Ok(PolicyKind::Lfu),
            "h2o" => Ok(PolicyKind::H2o),
            "scissorhands" => Ok(PolicyKind::Scissorhands),
            _ => Err(Error::UnknownPolicy {
                name: name.to_string(),
            }),
        }
    }

    /// Whether the policy's key counts reads (a decayed read count): the others leave the
    /// count unkept.
    pub fn ranks_by_reads(self) -> bool {
        matches!(self, PolicyKind::Lfu | PolicyKind::Importance)
    }

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Importance => "importance",
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::H2o => "h2o",
            PolicyKind::Scissorhands => "scissorhands",
        }
    }
}

/// One storage tier and its byte budget (`None` = unbounded).
#[derive(Debug, Clone, PartialEq)]
pub struct TierConfig {
    pub tier: Tier,
    pub budget_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one block at each level, level 0 first. A level of 0 bytes is `drop`: the block
    /// leaves attention and holds no slot.
    pub level_bytes: Vec<u64>,
    /// Tiers in offload order; the first must be `device`.
    pub tiers: Vec<TierConfig>,
    pub policy: PolicyKind,
    /// Split the non-recent blocks of live sequences between levels 1 and 2 by rank.
    pub enable_compression: bool,
    /// Use levels only to relieve budget pressure (demote before offloading or evicting), with no
    /// rank split of live sequences. Trace replay uses this: it has no decode-time signals.
    pub pressure_only: bool,
    /// Fraction of those blocks that go to level 1 (the rest go to level 2).
    pub compression_ratio: f32,
    /// With a `drop` level: fraction of each live sequence's ranked blocks (those outside its
    /// sink blocks and recent window, dropped ones included) that leave attention, lowest
    /// ranked first. `compression_ratio` then splits the blocks kept.
    pub drop_ratio: f32,
    /// Tokens at the end of each sequence kept at level 0.
    pub recent_window: u32,
    /// Leading blocks of each sequence kept at level 0 (attention sinks).
    pub sink_blocks: u32,
    /// A cached chain's last `keep_leaves` blocks (its leaf of the prefix tree and the blocks
    /// just before it: where the next turn continues, that turn's recent window) are demoted
    /// and offloaded after every other cached block of their pool but the sinks. 0: off.
    pub keep_leaves: u32,
    /// The level a cached chain's ends (its sinks and its last `keep_leaves` blocks) settle at
    /// (`settle_cached`). `None`: the deepest kept level whose blocks take at least a quarter
    /// of level 0's bytes (with a 16-bit level 0, at least 4 bits a value: int4 holds a chain's
    /// ends about as well as full precision, int2 does not).
    pub ends_level: Option<u8>,
    /// Cached blocks settle where a full cache would keep them, as soon as that level has a
    /// free slot, not only under pressure: a chain's ends at `ends_level`, any other block at
    /// the last kept level (see `End::home`). For a prefix cache whose pools
    /// above the bottom level stage what is saved (vLLM's connector): what a hit loads then
    /// does not depend on how full the cache happens to be. Explicitly sized pools only
    /// (`pool_slots` with `pool_headroom`).
    pub settle_cached: bool,
    /// Weights of magnitude, learned score and attention in the importance score.
    pub weights: [f32; 3],
    /// Fraction of a tier's budget the scheduler keeps free by demoting and offloading.
    pub headroom: f32,
    /// Rank margin (fraction of a sequence) a block must cross before it changes level again.
    pub hysteresis: f32,
    /// Cap on bytes copied by one plan (`None` = unlimited). Evictions copy nothing.
    pub max_move_bytes: Option<u64>,
    /// Per-step decay of read counts.
    pub decay: f32,
    /// Weight of the newest report in the attention moving average.
    pub attention_ema: f32,
    /// Attention reports that Scissorhands' persistence counts (at most 32).
    pub scissorhands_window: u32,
    /// On demotion, keep the block's higher-precision bytes in the next tier so a later promotion
    /// restores it exactly.
    pub write_through: bool,
    /// Evict cached (unreferenced) blocks when an allocation does not fit, instead of failing
    /// (the default: a block nobody references is reclaimable, as in vLLM's prefix cache).
    pub evict_on_full: bool,
    /// Seed of the prefix hash chain: different namespaces never share hashes.
    pub namespace: u64,
    /// Explicit slot capacities `(tier, level, slots)`; other pools are sized from the budget.
    pub pool_slots: Vec<(Tier, u8, u32)>,
    /// Keep `headroom` free in each explicitly sized pool too, not only in each tier's bytes.
    /// An engine whose pools are fixed partitions of its memory (the Python `BlockManager`)
    /// needs this: a full level cannot borrow the bytes another level leaves free.
    pub pool_headroom: bool,
    /// Cached blocks form prefix trees (a block is worth loading only while every block before
    /// it is held), and eviction takes leaves only: the policy ranks the leaves, and a parent
    /// becomes one when its last cached child goes. Off ("plain"), the policy ranks every cached
    /// block, as a cache of independent blocks would (LMCache's simulator does): an evicted
    /// parent then strands its children.
    pub prefix_aware: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            block_size: 16,
            level_bytes: vec![4096, 2048, 1024],
            tiers: vec![TierConfig {
                tier: Tier::Device,
                budget_bytes: None,
            }],
            policy: PolicyKind::Importance,
            enable_compression: true,
            pressure_only: false,
            compression_ratio: 0.5,
            drop_ratio: 0.0,
            recent_window: 128,
            sink_blocks: 1,
            keep_leaves: 2,
            ends_level: None,
            settle_cached: false,
            weights: [0.4, 0.4, 0.2],
            headroom: 0.1,
            hysteresis: 0.1,
            max_move_bytes: None,
            decay: 0.9,
            attention_ema: 0.5,
            scissorhands_window: 8,
            write_through: false,
            evict_on_full: true,
            namespace: 0,
            pool_slots: Vec::new(),
            pool_headroom: false,
            prefix_aware: true,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(invalid(
                "block_size",
                "expected a positive number of tokens",
            ));
        }
        if self.level_bytes.is_empty() || self.level_bytes.len() > 8 {
            return Err(invalid("level_bytes", "expected 1 to 8 levels"));
        }
        if self.level_bytes[0] == 0 {
            return Err(invalid("level_bytes", "level 0 cannot be drop (0 bytes)"));
        }
        if self.level_bytes.windows(2).any(|w| w[1] > w[0]) {
            return Err(invalid(
                "level_bytes",
                "expected non-increasing bytes per level",
            ));
        }
        if self.tiers.is_empty() || self.tiers[0].tier != Tier::Device {
            return Err(invalid("tiers", "expected the device tier first"));
        }
        if self.tiers.windows(2).any(|w| w[1].tier <= w[0].tier) {
            return Err(invalid(
                "tiers",
                "expected each tier at most once, in offload order",
            ));
        }
        let unit = |x: f32| (0.0..=1.0).contains(&x);
        if !unit(self.compression_ratio) {
            return Err(invalid(
                "compression_ratio",
                format!("{} is not in [0, 1]", self.compression_ratio),
            ));
        }
        if !unit(self.drop_ratio) {
            return Err(invalid(
                "drop_ratio",
                format!("{} is not in [0, 1]", self.drop_ratio),
            ));
        }
        if self.drop_ratio > 0.0 && self.drop_level().is_none() {
            return Err(invalid(
                "drop_ratio",
                "needs a drop level (a level of 0 bytes) at the end of the ladder",
            ));
        }
        if !unit(self.headroom) || self.headroom >= 1.0 {
            return Err(invalid(
                "headroom",
                format!("{} is not in [0, 1)", self.headroom),
            ));
        }
        if !unit(self.hysteresis) {
            return Err(invalid(
                "hysteresis",
                format!("{} is not in [0, 1]", self.hysteresis),
            ));
        }
        if !unit(self.decay) || self.decay == 0.0 {
            return Err(invalid("decay", format!("{} is not in (0, 1]", self.decay)));
        }
        if !unit(self.attention_ema) || self.attention_ema == 0.0 {
            return Err(invalid(
                "attention_ema",
                format!("{} is not in (0, 1]", self.attention_ema),
            ));
        }
        if self.weights.iter().any(|w| !w.is_finite() || *w < 0.0)
            || self.weights.iter().sum::<f32>() <= 0.0
        {
            return Err(invalid(
                "weights",
                "expected non-negative weights with a positive sum",
            ));
        }
        if self.scissorhands_window == 0 || self.scissorhands_window > 32 {
            return Err(invalid("scissorhands_window", "expected 1 to 32 reports"));
        }
        for &(tier, level, _) in &self.pool_slots {
            if usize::from(level) >= self.level_bytes.len() || self.tier_index(tier).is_none() {
                return Err(invalid(
                    "pool_slots",
                    format!("no pool {tier}/level {level} in this config"),
                ));
            }
        }
        Ok(())
    }

    pub fn num_levels(&self) -> usize {
        self.level_bytes.len()
    }

    pub fn tier_index(&self, tier: Tier) -> Option<usize> {
        self.tiers.iter().position(|t| t.tier == tier)
    }

    /// The last level that still holds bytes (drop levels excluded).
    pub fn last_kept_level(&self) -> u8 {
        let kept = self.level_bytes.iter().take_while(|&&b| b > 0).count();
        (kept - 1) as u8
    }

    /// The level a cached chain's ends settle at: `ends_level` (at most the last kept level),
    /// or by default the deepest kept level whose blocks take at least a quarter of level 0's
    /// bytes.
    pub fn resolved_ends_level(&self) -> u8 {
        let last = self.last_kept_level();
        self.ends_level.map_or_else(
            || {
                let full = self.level_bytes[0];
                (0..=last)
                    .rev()
                    .find(|&l| 4 * self.level_bytes[usize::from(l)] >= full)
                    .unwrap_or(0)
            },
            |l| l.min(last),
        )
    }

    /// The first drop level, if the ladder has one.
    pub fn drop_level(&self) -> Option<u8> {
        self.level_bytes
            .iter()
            .position(|&b| b == 0)
            .map(|l| l as u8)
    }
}
