//! The eviction index of one pool: its evictable blocks ordered by the policy's key, lowest
//! first, with lazy deletion (an entry is valid while its block's version still matches).
//!
//! Blocks mostly become evictable in increasing key order (a request's blocks are freed after
//! they were read, and keys grow with the access clock), so entries that arrive in order go to a
//! FIFO run at O(1); only out-of-order ones pay for the heap. The minimum is the smaller of the
//! two heads, so the order is exact whatever the arrival order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::core::Key;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Entry {
    pub key: Key,
    pub block: u32,
    pub version: u32,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct EvictionQueue {
    run: Ring,
    spill: BinaryHeap<Reverse<Entry>>,
}

/// A FIFO in a ring whose size is a power of two (or zero): a position wraps by one mask,
/// where `VecDeque` compares and subtracts on every push, pop and look at the back.
#[derive(Debug, Clone, Default)]
struct Ring {
    buf: Vec<Entry>,
    head: usize,
    len: usize,
}

impl Ring {
    #[inline(always)]
    fn at(&self, k: usize) -> usize {
        (self.head + k) & self.buf.len().wrapping_sub(1)
    }

    #[inline(always)]
    fn front(&self) -> Option<&Entry> {
        (self.len > 0).then(|| &self.buf[self.head])
    }

    /// Appends `e` unless its key is below the last entry's; returns whether it did.
    #[inline(always)]
    fn push_in_order(&mut self, e: Entry) -> bool {
        let mask = self.buf.len().wrapping_sub(1);
        let mut tail = (self.head + self.len) & mask;
        // Keys alone decide: valid entries never tie (a key ends in its block's access
        // clock, which no two blocks share), and comparing whole entries costs more.
        if self.len > 0 && e.key < self.buf[tail.wrapping_sub(1) & mask].key {
            return false;
        }
        if self.len == self.buf.len() {
            self.grow(e);
            tail = self.len;
        }
        self.buf[tail] = e;
        self.len += 1;
        true
    }

    #[inline(always)]
    fn pop_front(&mut self) -> Option<Entry> {
        let e = *self.front()?;
        self.head = self.at(1);
        self.len -= 1;
        Some(e)
    }

    /// Doubles the ring, its entries unwrapped to the start; `fill` pads the free part.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, fill: Entry) {
        let size = (2 * self.buf.len()).max(16);
        let mut buf = Vec::with_capacity(size);
        buf.extend((0..self.len).map(|k| self.buf[self.at(k)]));
        buf.resize(size, fill);
        self.buf = buf;
        self.head = 0;
    }

    fn retain(&mut self, keep: impl Fn(&Entry) -> bool) {
        // Kept entries move towards the head, into positions already read.
        let mut kept = 0;
        for k in 0..self.len {
            let e = self.buf[self.at(k)];
            if keep(&e) {
                let i = self.at(kept);
                self.buf[i] = e;
                kept += 1;
            }
        }
        self.len = kept;
    }
}

impl EvictionQueue {
    #[inline(always)]
    pub fn push(&mut self, e: Entry) {
        if !self.run.push_in_order(e) {
            self.spill.push(Reverse(e));
        }
    }

    pub fn len(&self) -> usize {
        self.run.len + self.spill.len()
    }

    /// The lowest valid entry, dropping stale ones on the way; it stays in the queue.
    #[inline]
    pub fn peek_valid(&mut self, valid: impl Fn(&Entry) -> bool) -> Option<Entry> {
        while self.run.front().is_some_and(|e| !valid(e)) {
            self.run.pop_front();
        }
        while self.spill.peek().is_some_and(|Reverse(e)| !valid(e)) {
            self.spill.pop();
        }
        match (self.run.front(), self.spill.peek()) {
            (Some(a), Some(Reverse(b))) => Some(*a.min(b)),
            (Some(a), None) => Some(*a),
            (None, Some(Reverse(b))) => Some(*b),
            (None, None) => None,
        }
    }

    /// Removes and returns the lowest valid entry, dropping stale ones on the way.
    #[inline]
    pub fn pop_valid(&mut self, valid: impl Fn(&Entry) -> bool) -> Option<Entry> {
        if self.spill.is_empty() {
            // Entries arrived in order (the usual case): the run alone holds the minimum.
            while let Some(e) = self.run.pop_front() {
                if valid(&e) {
                    return Some(e);
                }
            }
            return None;
        }
        let top = self.peek_valid(valid)?;
        match self.spill.peek() {
            Some(Reverse(b)) if *b == top => self.spill.pop(),
            _ => return self.run.pop_front(),
        };
        Some(top)
    }

    pub fn retain(&mut self, valid: impl Fn(&Entry) -> bool) {
        self.run.retain(&valid);
        self.spill.retain(|Reverse(e)| valid(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Debug, Clone)]
    enum Op {
        /// An entry with this key (mostly rising, like an access clock; sometimes not).
        Push(u64),
        /// Pop the lowest valid entry.
        Pop,
        /// Invalidate the entry of this block (a hit or a key change).
        Stale(u32),
        /// Sweep stale entries.
        Retain,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..40).prop_map(Op::Push),
            4 => Just(Op::Pop),
            2 => (0u32..200).prop_map(Op::Stale),
            1 => Just(Op::Retain),
        ]
    }

    proptest! {
        /// Through the ring's wrap-arounds and growth, spills and sweeps, the queue pops the
        /// valid entries in key order, as a sorted set of them does.
        #[test]
        fn pops_valid_entries_in_key_order(ops in proptest::collection::vec(op(), 1..400)) {
            let mut queue = EvictionQueue::default();
            let mut valid: BTreeSet<(u64, u32)> = BTreeSet::new(); // (key, block)
            let mut version = vec![0u32; 400];
            let mut clock = 10_000u64;
            let (mut next, key_of) = (0u32, |k: u64| Key::new(0.0, 0.0, k));
            for op in ops {
                match op {
                    Op::Push(back) => {
                        // Rising, or (one in four) `back` steps below the last; unique, as
                        // access clocks are, by the block in the low bits.
                        clock += 41;
                        let t = if back % 4 == 0 { clock - 41 * back - 1 } else { clock };
                        let block = next;
                        let k = t << 12 | u64::from(block);
                        next += 1;
                        version[block as usize] += 1;
                        queue.push(Entry { key: key_of(k), block, version: version[block as usize] });
                        valid.insert((k, block));
                    }
                    Op::Pop => {
                        let got = queue.pop_valid(|e| version[e.block as usize] == e.version);
                        let want = valid.pop_first();
                        prop_assert_eq!(got.map(|e| (e.key, e.block)), want.map(|(k, b)| (key_of(k), b)));
                        if let Some(e) = got {
                            version[e.block as usize] += 1; // popped: its entry is gone
                        }
                    }
                    Op::Stale(b) => {
                        if b < next {
                            version[b as usize] += 1;
                            valid.retain(|&(_, block)| block != b);
                        }
                    }
                    Op::Retain => {
                        queue.retain(|e| version[e.block as usize] == e.version);
                        prop_assert_eq!(queue.len(), valid.len());
                    }
                }
                prop_assert!(queue.len() >= valid.len());
            }
        }
    }
}
