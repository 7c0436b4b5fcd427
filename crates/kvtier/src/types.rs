//! The vocabulary the core's modules share, below all of them: a block's ranking key ([`Key`]),
//! where a block's bytes are ([`Loc`]), and the ids that stand for none ([`NO_SLOT`],
//! [`NO_BLOCK`]). The eviction queues (`evict`), the store index, the block table (`core`) and
//! the scheduler all speak it; it imports nothing of theirs but the tiers.

use crate::config::Tier;

pub const NO_SLOT: u32 = u32::MAX;

/// Where a block's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub tier: Tier,
    pub level: u8,
    pub slot: u32,
}

/// Ranking key of a block under the policy: lower goes first. Three components compared in
/// order; floats are stored as order-preserving integers so heap comparisons are integer ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key(u64, u64, u64);

/// Maps an f64 onto a u64 with the same order (total order, -inf lowest): a negative one has
/// every bit flipped, any other its sign bit set (by one mask, not a branch on the sign).
fn ordered(x: f64) -> u64 {
    let bits = x.to_bits();
    let negative = ((bits as i64) >> 63) as u64;
    bits ^ (negative | (1 << 63))
}

impl Key {
    pub fn new(primary: f64, secondary: f64, recency: u64) -> Key {
        Key(ordered(primary), ordered(secondary), recency)
    }

    /// A key below every key [`Key::new`] makes of numbers (-inf included; only a NaN with
    /// every bit set maps as low), ordered among its kind by `recency`: what a block that goes
    /// before all others is ranked by.
    pub fn first(recency: u64) -> Key {
        Key(0, 0, recency)
    }

    /// The primary component (the policy's score) as a float.
    pub fn primary(self) -> f64 {
        let bits = if self.0 >> 63 == 1 {
            self.0 & !(1 << 63)
        } else {
            !self.0
        };
        f64::from_bits(bits)
    }
}

/// No block: a root's parent, the end of a list of children.
pub(crate) const NO_BLOCK: u32 = u32::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys order their floats as `f64::total_cmp` does, and give them back unchanged.
    #[test]
    fn keys_order_floats_and_give_them_back() {
        let xs = [
            f64::NEG_INFINITY,
            -1e300,
            -1.0,
            -f64::MIN_POSITIVE / 4.0,
            -0.0,
            0.0,
            f64::MIN_POSITIVE / 4.0,
            0.5,
            1.0,
            1e300,
            f64::INFINITY,
        ];
        for (i, &a) in xs.iter().enumerate() {
            assert_eq!(Key::new(a, 0.0, 0).primary().to_bits(), a.to_bits());
            for &b in &xs[i + 1..] {
                assert!(Key::new(a, 0.0, 0) < Key::new(b, 0.0, 0), "{a} < {b}");
                assert!(
                    Key::new(0.0, a, 9) < Key::new(0.0, b, 0),
                    "{a} < {b} second"
                );
            }
            // `first` keys go before every key of numbers, even an older one.
            assert!(
                Key::first(u64::MAX) < Key::new(a, f64::NEG_INFINITY, 0),
                "first < {a}"
            );
        }
        assert!(Key::first(1) < Key::first(2));
    }
}
