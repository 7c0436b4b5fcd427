//! Unit tests of `Core` that need its private state (the access clock, the rows).

use super::*;
use crate::config::{PolicyKind, TierConfig};

/// The replay's fused append-and-read leaves the core exactly as an append followed by
/// `record_reads` of the same blocks: same blocks, read counts and access clock.
#[test]
fn append_with_read_equals_append_then_record_reads() {
    let cfg = Config {
        block_size: 4,
        level_bytes: vec![1],
        tiers: vec![TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(24),
        }],
        policy: PolicyKind::Lfu, // ranks by reads, then recency: both show in the key
        evict_on_full: true,
        ..Config::default()
    };
    let (mut fused, mut apart) = (Core::new(cfg.clone()).unwrap(), Core::new(cfg).unwrap());
    let mut out = Appended::default();
    let mut x = 7u64;
    for request in 0..300 {
        // Prefix-chained hashes from a small alphabet: hits, misses and evictions.
        let n = 1 + (x >> 7) % 8;
        let hashes: Vec<u64> = (0..n).map(|k| (x >> 3) % 5 * 100 + k).collect();
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let (a, b) = (fused.add_sequence(), apart.add_sequence());
        let got = fused.append_blocks_into(a, &hashes, &mut out, true);
        match apart.append_blocks(b, &hashes) {
            Ok(want) => {
                got.unwrap();
                assert_eq!(out, want, "request {request}");
                apart.record_reads(&want.blocks).unwrap();
            }
            Err(e) => assert_eq!(got.unwrap_err(), e, "request {request}"),
        }
        if request % 3 == 0 {
            for core in [&mut fused, &mut apart] {
                let id = core.plan().unwrap().id; // a step of the decay clock
                core.commit(id).unwrap();
            }
        }
        fused.free_sequence(a).unwrap();
        apart.free_sequence(b).unwrap();
        assert_eq!(fused.clock, apart.clock, "request {request}");
        for id in 0..apart.num_block_ids() as u32 {
            assert_eq!(fused.blocks.is_live(id), apart.blocks.is_live(id));
            if apart.blocks.is_live(id) {
                assert_eq!(
                    fused.block_score(id).unwrap(),
                    apart.block_score(id).unwrap()
                );
                let (f, p) = (
                    &fused.blocks.rows[id as usize],
                    &apart.blocks.rows[id as usize],
                );
                assert_eq!((f.reads, f.reads_step), (p.reads, p.reads_step));
            }
        }
    }
    assert!(apart.counters().evictions > 0 && apart.counters().shared_hits > 0);
}

fn salted_core() -> Core {
    Core::new(Config {
        block_size: 16,
        level_bytes: vec![64],
        namespace: crate::prefix::namespace_seed("default"),
        ..Config::default()
    })
    .unwrap()
}

/// Hashes of `tokens` as the core indexed them (0 for a partial block).
fn hashes_of(core: &Core, seq: u32) -> Vec<u64> {
    let blocks = core.sequence_blocks(seq).unwrap();
    blocks
        .iter()
        .map(|&b| core.block_hash(b).unwrap().unwrap_or(0))
        .collect()
}

/// Without a salt, the hashes are those of before salts existed, bit for bit (the values of
/// `prefix_hashes(range(32), 16)` in the default namespace, pinned in tests/test_core_api.py
/// before this change): keys persisted or published by earlier versions stay valid.
#[test]
fn an_unsalted_sequence_keeps_the_old_hashes() {
    const FIXED: [u64; 2] = [0x6061_3E95_F4B4_2118, 0xF132_5E8B_0BB9_ABE5];
    let tokens: Vec<u32> = (0..32).collect();
    let seed = crate::prefix::namespace_seed("default");
    assert_eq!(seed, 0x6C5B_964D_9473_AC1A);
    assert_eq!(crate::prefix::chain_seed(seed, None).unwrap(), seed);
    assert_eq!(crate::prefix::prefix_hashes(&tokens, 16, seed), FIXED);
    let mut c = salted_core();
    let (a, b) = (c.add_sequence(), c.add_sequence_salted(None).unwrap());
    c.append_tokens(a, &tokens).unwrap();
    let got = c.append_tokens(b, &tokens).unwrap();
    assert_eq!(hashes_of(&c, a), FIXED);
    assert_eq!(hashes_of(&c, b), FIXED);
    assert_eq!(got.shared, [true, true], "None is no salt: it shares");
    assert_eq!(c.lookup_tokens(&tokens), c.sequence_blocks(a).unwrap());
    assert_eq!(
        c.lookup_tokens_salted(&tokens, None).unwrap(),
        c.lookup_tokens(&tokens)
    );
}

/// Same tokens, different salts (or a salt and none): no block in common, and each lookup
/// finds its own salt's blocks only. Same salt: shared as without salts.
#[test]
fn salts_share_blocks_within_a_salt_only() {
    let tokens: Vec<u32> = (100..140).collect(); // 2 full blocks and a partial one
    let mut c = salted_core();
    let plain = c.add_sequence();
    let a = c.add_sequence_salted(Some("tenant-a")).unwrap();
    let b = c.add_sequence_salted(Some("tenant-b")).unwrap();
    let mut got = Vec::new();
    for s in [plain, a, b] {
        // Split where a block boundary falls inside a call: the chain goes on from the salt.
        c.append_tokens(s, &tokens[..20]).unwrap();
        got.push(c.append_tokens(s, &tokens[20..]).unwrap());
    }
    assert!(got.iter().all(|g| g.shared.iter().all(|&x| !x)));
    let blocks: Vec<Vec<u32>> = [plain, a, b]
        .iter()
        .map(|&s| c.sequence_blocks(s).unwrap().to_vec())
        .collect();
    for i in 0..3 {
        for j in 0..i {
            assert!(blocks[i].iter().all(|x| !blocks[j].contains(x)));
        }
    }
    let seed = c.cfg.namespace;
    for (salt, seq) in [("tenant-a", a), ("tenant-b", b)] {
        let salted = crate::prefix::salted_seed(seed, salt);
        let want = crate::prefix::prefix_hashes(&tokens, 16, salted);
        assert_eq!(hashes_of(&c, seq)[..2], want[..]);
        let found = c.lookup_tokens_salted(&tokens, Some(salt)).unwrap();
        assert_eq!(found, blocks[if salt == "tenant-a" { 1 } else { 2 }][..2]);
    }
    assert_eq!(c.lookup_tokens(&tokens), blocks[0][..2]);
    assert!(c
        .lookup_tokens_salted(&tokens, Some("tenant-c"))
        .unwrap()
        .is_empty());
    // The same salt shares, and a fork keeps its parent's salt.
    let a2 = c.add_sequence_salted(Some("tenant-a")).unwrap();
    let again = c.append_tokens(a2, &tokens).unwrap();
    assert_eq!(again.shared, [true, true, false]);
    assert_eq!(again.blocks[..2], blocks[1][..2]);
    let child = c.fork(a2).unwrap().child;
    c.append_tokens(child, &(140..148).collect::<Vec<_>>())
        .unwrap();
    let longer: Vec<u32> = (100..148).collect();
    assert_eq!(
        c.lookup_tokens_salted(&longer, Some("tenant-a"))
            .unwrap()
            .len(),
        3
    );
    assert_eq!(c.lookup_tokens(&longer).len(), 2);
    // An empty salt is refused (None says "no salt").
    let err = c.add_sequence_salted(Some("")).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { what: "salt", .. }));
    assert!(c.lookup_tokens_salted(&tokens, Some("")).is_err());
}

/// A salted seed is never the hash of a block: its input is never a whole number of token
/// ids long, so a salt spelling token ids does not open the unsalted chain of those ids.
#[test]
fn a_salted_seed_is_not_a_block_hash() {
    let seed = crate::prefix::namespace_seed("default");
    // "abcd" as one token id, little-endian; and salts of every length class mod 4.
    let token = u32::from_le_bytes(*b"abcd");
    assert_ne!(
        crate::prefix::salted_seed(seed, "abcd"),
        crate::prefix::chain_hash(seed, &[token])
    );
    let salts = [
        "a", "ab", "abc", "abcd", "abcde", "é", "tenant-a", "tenant-b",
    ];
    let seeds: Vec<u64> = salts
        .iter()
        .map(|s| crate::prefix::salted_seed(seed, s))
        .collect();
    for (i, x) in seeds.iter().enumerate() {
        assert!(!seeds[..i].contains(x));
        assert_ne!(*x, seed);
    }
    // Salted in another namespace: another seed.
    assert_ne!(
        crate::prefix::salted_seed(crate::prefix::namespace_seed("other"), "tenant-a"),
        seeds[6]
    );
}
