//! The prefix index is a hand-written open-addressing table: random inserts, removals and
//! lookups must leave it answering exactly like a `HashMap` (a removal in the middle of a probe
//! run must not hide the entries after it).

use proptest::prelude::*;
use std::collections::HashMap;

use kvtier::PrefixIndex;

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u32),
    /// Removes the key if it maps to this block (a wrong block must leave it in place).
    Remove(u64, u32),
}

/// Few distinct keys so that runs form and entries are removed from their middle; some small
/// (trace ids), some spread over the whole range (chained hashes).
fn key() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..48u64,
        (0..16u64).prop_map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (key(), 0..4u32).prop_map(|(k, b)| Op::Insert(k, b)),
        2 => (key(), 0..4u32).prop_map(|(k, b)| Op::Remove(k, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn answers_like_a_hash_map(ops in prop::collection::vec(op(), 1..400)) {
        let mut index = PrefixIndex::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k, b) => {
                    let fresh = !model.contains_key(&k);
                    if fresh {
                        model.insert(k, b);
                    }
                    prop_assert_eq!(index.insert(k, b), fresh);
                }
                Op::Remove(k, b) => {
                    if model.get(&k) == Some(&b) {
                        model.remove(&k);
                    }
                    index.remove(k, b);
                }
            }
            prop_assert_eq!(index.len(), model.len());
            for k in (0..48u64).chain((0..16u64).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)) {
                prop_assert_eq!(index.get(k), model.get(&k).copied(), "key {}", k);
            }
        }
    }
}

#[test]
fn grows_past_a_million_entries_and_keeps_them() {
    let mut index = PrefixIndex::default();
    let n = 1_000_000u64;
    for k in 0..n {
        assert!(index.insert(k * 7919, k as u32));
    }
    for k in (0..n).step_by(2) {
        index.remove(k * 7919, k as u32);
    }
    assert_eq!(index.len(), (n / 2) as usize);
    assert!((0..n).all(|k| index.get(k * 7919) == (k % 2 == 1).then_some(k as u32)));
}
