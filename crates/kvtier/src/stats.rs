//! Per-block statistics, updated in batches: attention mass (moving average, running sum and a
//! persistence history for Scissorhands), key/value magnitude and a learned score.
//!
//! Decay is lazy: a counter stores its value as of the step it was last touched, so a batch
//! update costs O(batch) and `step()` costs nothing per block.

/// The statistics of one block, kept in `Core::stats` by block id. The read counters (a decayed
/// count on the step clock and the access clock of the last read) live in the block's hot row
/// instead (`core::BlockRow`): every request touches them. One struct per block, so a new block
/// resets one cache line and the scheduler reads one per block; reset when a block id is reused.
#[derive(Debug, Default, Clone, Copy)]
pub struct BlockStats {
    pub attn_ema: f32,
    pub attn_sum: f32,
    /// Bit i set: the block was above its report's mean attention i reports ago.
    pub attn_history: u32,
    pub magnitude: f32,
    pub learned: f32,
    /// Last normalised importance the scheduler computed (kept for cached blocks).
    pub importance: f32,
    /// Bit 0: magnitude known, bit 1: learned known, bit 2: attention known.
    pub known: u8,
}

pub const KNOWN_MAGNITUDE: u8 = 1;
pub const KNOWN_LEARNED: u8 = 2;
pub const KNOWN_ATTENTION: u8 = 4;

/// Steps covered by the decay table: a block read again within this many steps (a few
/// thousand requests of a busy engine) decays by a lookup, not a `powi`.
pub const DECAY_TABLE_LEN: usize = 1024;

/// `decay^k` for k below [`DECAY_TABLE_LEN`] from a table of repeated products, else computed.
#[derive(Debug, Clone)]
pub struct DecayTable {
    decay: f32,
    table: Box<[f32; DECAY_TABLE_LEN]>,
    /// `ln(1/decay)`, computed once: every ranking key under `lfu` and `importance` uses it.
    log_inv: f64,
}

impl DecayTable {
    pub fn new(decay: f32) -> Self {
        let mut table = Box::new([1.0f32; DECAY_TABLE_LEN]);
        for k in 1..DECAY_TABLE_LEN {
            table[k] = table[k - 1] * decay;
        }
        DecayTable {
            decay,
            table,
            log_inv: -f64::from(decay).ln(),
        }
    }

    /// This table where `policy` ranks by decayed read counts (so they are kept), else `None`.
    #[inline(always)]
    pub fn if_counted(&self, policy: crate::PolicyKind) -> Option<&DecayTable> {
        policy.ranks_by_reads().then_some(self)
    }

    #[inline]
    pub fn pow(&self, k: u32) -> f32 {
        match self.table.get(k as usize) {
            Some(v) => *v,
            None => self.decay.powi(k.min(i32::MAX as u32) as i32),
        }
    }

    /// `ln(1/decay)`, the slope of the step-invariant log key of a decayed counter.
    pub fn log_inv(&self) -> f64 {
        self.log_inv
    }

    /// The log of a decayed count last updated at `step`, on a step-invariant scale, so values
    /// computed at different steps compare: ln(c * d^(now-t)) + now*ln(1/d) = ln c + t*ln(1/d).
    /// A count of zero is -inf.
    pub fn log_count(&self, count: f32, step: u32) -> f64 {
        if count > 0.0 {
            f64::from(count).ln() + f64::from(step) * self.log_inv()
        } else {
            f64::NEG_INFINITY
        }
    }
}
