//! Slot pools: one per (tier, level), fixed-size slots indexed `0..capacity`. Python owns the
//! tensor a slot indexes into; the core only hands indices out and takes them back.
//!
//! Invariants: a slot is either free or in use, never both; `used + free == capacity`; a slot is
//! never handed out twice. Slots are created lazily (`fresh` counts slots ever touched), so an
//! unbounded pool costs nothing until used.

use crate::config::Tier;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct SlotPool {
    tier: Tier,
    level: u8,
    capacity: u32,
    fresh: u32,
    free: Vec<u32>,
    in_use: Vec<bool>,
    used: u32,
}

impl SlotPool {
    pub fn new(tier: Tier, level: u8, capacity: u32) -> Self {
        SlotPool {
            tier,
            level,
            capacity,
            fresh: 0,
            free: Vec::new(),
            in_use: Vec::new(),
            used: 0,
        }
    }

    pub fn level(&self) -> u8 {
        self.level
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn used(&self) -> u32 {
        self.used
    }

    pub fn free_count(&self) -> u32 {
        self.capacity - self.used
    }

    pub fn is_in_use(&self, slot: u32) -> bool {
        self.in_use.get(slot as usize).copied().unwrap_or(false)
    }

    /// Raises the capacity to `slots` (a pool never shrinks: slots may be handed out).
    pub fn grow_to(&mut self, slots: u32) {
        self.capacity = self.capacity.max(slots);
    }

    /// Hands out one slot, or `None` when the pool is full.
    #[inline]
    pub fn alloc_one(&mut self) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if self.fresh < self.capacity => {
                self.fresh += 1;
                self.in_use.push(false);
                self.fresh - 1
            }
            None => return None,
        };
        debug_assert!(!self.in_use[slot as usize], "slot handed out twice");
        self.in_use[slot as usize] = true;
        self.used += 1;
        Some(slot)
    }

    /// Hands out `n` slots, all or none.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n as u64 > u64::from(self.free_count()) {
            return Err(Error::OutOfSlots {
                tier: self.tier,
                level: self.level,
                requested: n as u64,
                free: u64::from(self.free_count()),
            });
        }
        Ok((0..n)
            .map(|_| self.alloc_one().expect("checked free count"))
            .collect())
    }

    /// Takes slots back, all or none: a slot that is not in use (or listed twice) is an error.
    pub fn free(&mut self, slots: &[u32]) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        for &s in slots {
            if !self.is_in_use(s) || !seen.insert(s) {
                return Err(Error::InvalidArgument {
                    what: "slot",
                    reason: format!("{s} in {}/level {} is not in use", self.tier, self.level),
                });
            }
        }
        for &s in slots {
            self.release(s);
        }
        Ok(())
    }

    /// Takes one slot back; the caller guarantees it is in use.
    #[inline]
    pub(crate) fn release(&mut self, slot: u32) {
        debug_assert!(self.is_in_use(slot), "freeing a free slot");
        self.in_use[slot as usize] = false;
        self.used -= 1;
        self.free.push(slot);
    }
}
