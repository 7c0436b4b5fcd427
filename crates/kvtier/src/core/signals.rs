//! What the engine reports about blocks, in batches: reads, attention mass, magnitudes and
//! learned scores (each re-ranks a cached block), and pins (a pinned block never moves).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::stats::{KNOWN_ATTENTION, KNOWN_LEARNED, KNOWN_MAGNITUDE};

use super::blocks::NOT_CACHED;
use super::Core;

impl Core {
    /// Counts a read of each listed block (a block listed twice is read twice).
    pub fn record_reads(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        self.read_blocks(ids);
        Ok(())
    }

    /// [`Core::record_reads`] of blocks known to be live.
    fn read_blocks(&mut self, ids: &[u32]) {
        for &b in ids {
            self.clock += 1;
            let row = &mut self.blocks.rows[b as usize];
            row.read(
                self.decay.if_counted(self.cfg.policy),
                self.step,
                self.clock,
            );
            if row.cached_in != NOT_CACHED {
                self.refresh_evictable(b); // its recency is part of its key
            }
        }
    }

    /// Attention mass each block received in one report, aggregated over heads and queries as
    /// the caller sees fit (`BlockManager` averages them and reports each layer). Blocks at or
    /// above the report's mean count as important for Scissorhands.
    pub fn record_attention(&mut self, ids: &[u32], mass: &[f32]) -> Result<()> {
        self.check_values("attention mass", ids, mass)?;
        let mean = mass.iter().map(|&m| f64::from(m)).sum::<f64>() / mass.len().max(1) as f64;
        let alpha = self.cfg.attention_ema;
        for (&b, &m) in ids.iter().zip(mass) {
            let i = b as usize;
            let s = &mut self.stats_mut()[i];
            s.attn_ema = if s.known & KNOWN_ATTENTION != 0 {
                alpha * m + (1.0 - alpha) * s.attn_ema
            } else {
                m
            };
            s.attn_sum += m;
            s.attn_history = (s.attn_history << 1) | u32::from(f64::from(m) >= mean);
            s.known |= KNOWN_ATTENTION;
            if self.blocks.rows[i].cached_in != NOT_CACHED {
                self.refresh_evictable(b);
            }
        }
        Ok(())
    }

    /// Key/value magnitude of each block, computed when it was written.
    pub fn set_magnitude(&mut self, ids: &[u32], values: &[f32]) -> Result<()> {
        self.check_values("magnitude", ids, values)?;
        for (&b, &v) in ids.iter().zip(values) {
            let s = &mut self.stats_mut()[b as usize];
            s.magnitude = v;
            s.known |= KNOWN_MAGNITUDE;
        }
        Ok(())
    }

    /// A learned importance score of each block (e.g. a probe on key features).
    pub fn set_learned(&mut self, ids: &[u32], values: &[f32]) -> Result<()> {
        self.check_values("learned score", ids, values)?;
        for (&b, &v) in ids.iter().zip(values) {
            let s = &mut self.stats_mut()[b as usize];
            s.learned = v;
            s.known |= KNOWN_LEARNED;
        }
        Ok(())
    }

    fn check_values(&self, what: &'static str, ids: &[u32], values: &[f32]) -> Result<()> {
        if ids.len() != values.len() {
            return Err(Error::LengthMismatch {
                what,
                expected: ids.len(),
                got: values.len(),
            });
        }
        if let Some(v) = values.iter().find(|v| !v.is_finite() || **v < 0.0) {
            return Err(Error::InvalidArgument {
                what,
                reason: format!("{v} is not a finite non-negative number"),
            });
        }
        self.check_blocks(ids)
    }

    /// Pins blocks the engine is reading: the scheduler never moves or evicts them.
    pub fn pin(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        for &b in ids {
            self.blocks.rows[b as usize].pins += 1;
            self.refresh_evictable(b);
        }
        Ok(())
    }

    pub fn unpin(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        let mut count: BTreeMap<u32, u32> = BTreeMap::new();
        for &b in ids {
            *count.entry(b).or_default() += 1;
        }
        if let Some((&b, _)) = count
            .iter()
            .find(|(b, n)| self.blocks.rows[**b as usize].pins < **n)
        {
            return Err(Error::InvalidArgument {
                what: "unpin",
                reason: format!("block {b} is not pinned"),
            });
        }
        for &b in ids {
            self.blocks.rows[b as usize].pins -= 1;
            self.refresh_evictable(b);
            self.release_if_orphan(b);
        }
        Ok(())
    }
}
