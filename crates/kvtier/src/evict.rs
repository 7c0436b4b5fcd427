//! The eviction index of one pool: its evictable blocks ordered by the policy's key, lowest
//! first, with lazy deletion (an entry is valid while its block's version still matches).
//!
//! Blocks mostly become evictable in increasing key order (a request's blocks are freed after
//! they were read, and keys grow with the access clock), so entries that arrive in order go to a
//! FIFO run at O(1); only out-of-order ones pay for the heap. The minimum is the smaller of the
//! two heads, so the order is exact whatever the arrival order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::types::Key;

/// A queued block: its id and the version its entry was made at. The entry stands for the
/// block while the block's version still matches; then its key is the block's current key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ticket {
    pub block: u32,
    pub version: u32,
}

/// A ticket with its key: what the spill heap orders, and what a peek returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Entry {
    pub key: Key,
    pub ticket: Ticket,
}

/// An entry of the in-order run: its ticket alone (8 bytes, not 32), since a valid entry's key
/// is its block's key, computed again where one is needed. Debug builds keep the key too, to
/// check exactly that.
#[derive(Debug, Clone, Copy, Default)]
struct RunEntry {
    ticket: Ticket,
    #[cfg(debug_assertions)]
    key: Key,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct EvictionQueue {
    run: Ring,
    /// The key of the run's newest entry, the bound an entry must reach to join the run.
    last: Key,
    spill: BinaryHeap<Reverse<Entry>>,
}

/// A FIFO in a ring whose size is a power of two (or zero): a position wraps by one mask,
/// where `VecDeque` compares and subtracts on every push, pop and look at the back.
#[derive(Debug, Clone, Default)]
struct Ring {
    buf: Vec<RunEntry>,
    head: usize,
    len: usize,
}

impl Ring {
    #[inline(always)]
    fn at(&self, k: usize) -> usize {
        (self.head + k) & self.buf.len().wrapping_sub(1)
    }

    #[inline(always)]
    fn front(&self) -> Option<&RunEntry> {
        (self.len > 0).then(|| &self.buf[self.head])
    }

    #[inline(always)]
    fn pop_front(&mut self) -> Option<RunEntry> {
        let e = *self.front()?;
        self.head = self.at(1);
        self.len -= 1;
        Some(e)
    }

    /// Makes room for `n` more entries: at least doubles the ring, its entries unwrapped to
    /// the start.
    #[inline(always)]
    fn reserve(&mut self, n: usize) {
        if self.len + n > self.buf.len() {
            self.grow(n);
        }
    }

    #[cold]
    #[inline(never)]
    fn grow(&mut self, n: usize) {
        let size = (self.len + n)
            .next_power_of_two()
            .max(2 * self.buf.len())
            .max(16);
        let mut buf = Vec::with_capacity(size);
        buf.extend((0..self.len).map(|k| self.buf[self.at(k)]));
        buf.resize(size, RunEntry::default());
        self.buf = buf;
        self.head = 0;
    }

    /// Pops entries from the front until `n` valid ones are out (or the ring is empty),
    /// writing their blocks to `out` from its start; returns how many it wrote. The ring's
    /// state stays in locals throughout (writes to `out` cannot move it).
    #[inline(always)]
    fn pop_valid_into(
        &mut self,
        n: usize,
        valid: impl Fn(&Ticket) -> bool,
        out: &mut [u32],
    ) -> usize {
        let (mask, mut head, mut len) = (self.buf.len().wrapping_sub(1), self.head, self.len);
        let buf = &self.buf[..];
        let mut popped = 0;
        while popped < n && len > 0 {
            let e = buf[head];
            head = (head + 1) & mask;
            len -= 1;
            if valid(&e.ticket) {
                out[popped] = e.ticket.block;
                popped += 1;
            }
        }
        (self.head, self.len) = (head, len);
        popped
    }

    fn retain(&mut self, keep: impl Fn(&Ticket) -> bool) {
        // Kept entries move towards the head, into positions already read.
        let mut kept = 0;
        for k in 0..self.len {
            let e = self.buf[self.at(k)];
            if keep(&e.ticket) {
                let i = self.at(kept);
                self.buf[i] = e;
                kept += 1;
            }
        }
        self.len = kept;
    }
}

impl EvictionQueue {
    /// Queues `ticket` under `key`: in the run when the key is not below the run's newest
    /// (keys alone decide: valid entries never tie, as a key ends in its block's access
    /// clock, which no two blocks share), else in the spill heap.
    #[inline(always)]
    pub fn push(&mut self, key: Key, ticket: Ticket) {
        self.pusher(1).push(key, ticket);
    }

    /// A [`Pusher`] for up to `n` entries.
    #[inline(always)]
    pub fn pusher(&mut self, n: usize) -> Pusher<'_> {
        self.run.reserve(n);
        let Ring { buf, head, len } = &mut self.run;
        Pusher {
            mask: buf.len() - 1,
            head: *head,
            len: *len,
            last: self.last,
            buf,
            run_len: len,
            run_last: &mut self.last,
            spill: &mut self.spill,
        }
    }

    pub fn len(&self) -> usize {
        self.run.len + self.spill.len()
    }

    /// The run's first entry with its key, `key_of` its block's (the entry is valid).
    fn run_front(&self, key_of: impl Fn(u32) -> Key) -> Option<Entry> {
        let e = self.run.front()?;
        let key = key_of(e.ticket.block);
        #[cfg(debug_assertions)]
        assert_eq!(key, e.key, "a valid entry's block changed its key");
        Some(Entry {
            key,
            ticket: e.ticket,
        })
    }

    /// The lowest valid entry, dropping stale ones on the way; it stays in the queue.
    /// `key_of(block)` is the current key of a block with a valid entry.
    #[inline]
    pub fn peek_valid(
        &mut self,
        valid: impl Fn(&Ticket) -> bool,
        key_of: impl Fn(u32) -> Key,
    ) -> Option<Entry> {
        while self.run.front().is_some_and(|e| !valid(&e.ticket)) {
            self.run.pop_front();
        }
        while self
            .spill
            .peek()
            .is_some_and(|Reverse(e)| !valid(&e.ticket))
        {
            self.spill.pop();
        }
        let run = self.run_front(key_of);
        match (run, self.spill.peek()) {
            (Some(a), Some(&Reverse(b))) => Some(a.min(b)),
            (a, b) => a.or(b.map(|&Reverse(b)| b)),
        }
    }

    /// Removes and returns the lowest valid entry's ticket, dropping stale ones on the way
    /// (`key_of` as for [`EvictionQueue::peek_valid`]).
    #[inline]
    pub fn pop_valid(
        &mut self,
        valid: impl Fn(&Ticket) -> bool,
        key_of: impl Fn(u32) -> Key,
    ) -> Option<Ticket> {
        if self.spill.is_empty() {
            // Entries arrived in order (the usual case): the run alone holds the minimum.
            while let Some(e) = self.run.pop_front() {
                if valid(&e.ticket) {
                    return Some(e.ticket);
                }
            }
            return None;
        }
        let top = self.peek_valid(valid, key_of)?;
        match self.spill.peek() {
            Some(Reverse(b)) if *b == top => self.spill.pop(),
            _ => self.run.pop_front().map(|_| Reverse(top)),
        };
        Some(top.ticket)
    }

    /// Pops the blocks of the `n` lowest valid entries onto `out`, lowest first (fewer when
    /// the queue runs out), dropping stale entries on the way; returns how many it popped.
    /// `key_of` as for [`EvictionQueue::peek_valid`].
    #[inline]
    pub fn pop_valid_into(
        &mut self,
        n: u64,
        valid: impl Fn(&Ticket) -> bool,
        key_of: impl Fn(u32) -> Key,
        out: &mut Vec<u32>,
    ) -> u64 {
        let first = out.len();
        if self.spill.is_empty() {
            // Entries arrived in order (the usual case): the run alone holds the minimum, and
            // popping adds nothing to the spill heap.
            out.resize(first + n as usize, 0);
            let popped = self
                .run
                .pop_valid_into(n as usize, valid, &mut out[first..]);
            out.truncate(first + popped);
            return popped as u64;
        }
        while ((out.len() - first) as u64) < n {
            let Some(t) = self.pop_valid(&valid, &key_of) else {
                break;
            };
            out.push(t.block);
        }
        (out.len() - first) as u64
    }

    pub fn retain(&mut self, valid: impl Fn(&Ticket) -> bool) {
        self.run.retain(&valid);
        self.spill.retain(|Reverse(e)| valid(&e.ticket));
    }
}

/// In-order pushes into one queue, the ring's position, length and newest key held in locals
/// (written back when it is dropped), so that a loop of pushes does not reload them after
/// every write into the ring. Made by [`EvictionQueue::pusher`] with room for its pushes.
pub(crate) struct Pusher<'a> {
    buf: &'a mut [RunEntry],
    mask: usize,
    head: usize,
    len: usize,
    last: Key,
    run_len: &'a mut usize,
    run_last: &'a mut Key,
    spill: &'a mut BinaryHeap<Reverse<Entry>>,
}

impl Pusher<'_> {
    /// [`EvictionQueue::push`]; at most as many pushes as the pusher was made for.
    #[inline(always)]
    pub fn push(&mut self, key: Key, ticket: Ticket) {
        if self.len > 0 && key < self.last {
            self.spill.push(Reverse(Entry { key, ticket }));
            return;
        }
        self.last = key;
        self.buf[(self.head + self.len) & self.mask] = RunEntry {
            ticket,
            #[cfg(debug_assertions)]
            key,
        };
        self.len += 1;
    }
}

impl Drop for Pusher<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        debug_assert!(
            self.len <= self.buf.len(),
            "more pushes than the pusher was made for"
        );
        (*self.run_len, *self.run_last) = (self.len, self.last);
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
        /// Through the ring's wrap-arounds and growth, spills and sweeps, the queue peeks and
        /// pops the valid entries in key order, as a sorted set of them does, with the keys its
        /// blocks have.
        #[test]
        fn pops_valid_entries_in_key_order(ops in proptest::collection::vec(op(), 1..400)) {
            let mut queue = EvictionQueue::default();
            let mut valid: BTreeSet<(u64, u32)> = BTreeSet::new(); // (key, block)
            let mut version = vec![0u32; 400];
            let mut keys = vec![0u64; 400];
            let mut clock = 10_000u64;
            let mut next = 0u32;
            let key = |k: u64| Key::new(0.0, 0.0, k);
            for op in ops {
                let is_valid = |t: &Ticket| version[t.block as usize] == t.version;
                let key_of = |b: u32| key(keys[b as usize]);
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
                        keys[block as usize] = k;
                        queue.push(key(k), Ticket { block, version: version[block as usize] });
                        valid.insert((k, block));
                    }
                    Op::Pop => {
                        let want = valid.pop_first().map(|(k, b)| (key(k), b));
                        let peeked = queue.peek_valid(is_valid, key_of);
                        prop_assert_eq!(peeked.map(|e| (e.key, e.ticket.block)), want);
                        let got = queue.pop_valid(is_valid, key_of);
                        prop_assert_eq!(got.map(|t| (key_of(t.block), t.block)), want);
                        if let Some(t) = got {
                            version[t.block as usize] += 1; // popped: its entry is gone
                        }
                    }
                    Op::Stale(b) => {
                        if b < next {
                            version[b as usize] += 1;
                            valid.retain(|&(_, block)| block != b);
                        }
                    }
                    Op::Retain => {
                        queue.retain(|t| version[t.block as usize] == t.version);
                        prop_assert_eq!(queue.len(), valid.len());
                    }
                }
                prop_assert!(queue.len() >= valid.len());
            }
        }
    }
}
