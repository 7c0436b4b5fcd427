//! The scheduling rules of ARCHITECTURE.md, one test each, on small hand-checkable states.

use kvtier::{
    chain_hash, prefix_hashes, Config, Core, Error, MoveKind, PolicyKind, Tier, TierConfig,
};

fn core(cfg: Config) -> Core {
    Core::new(cfg).unwrap()
}

fn cfg() -> Config {
    Config {
        block_size: 4,
        level_bytes: vec![64, 32, 16],
        recent_window: 8,
        sink_blocks: 1,
        ..Config::default()
    }
}

/// A sequence of `n` full blocks with distinct hashes starting at `base`.
fn seq_with(core: &mut Core, base: u64, n: u64) -> (u32, Vec<u32>) {
    let s = core.add_sequence();
    let hashes: Vec<u64> = (base..base + n).collect();
    let blocks = core.append_blocks(s, &hashes).unwrap().blocks;
    (s, blocks)
}

fn unbounded(tiers: &[Tier]) -> Vec<TierConfig> {
    tiers
        .iter()
        .map(|&tier| TierConfig {
            tier,
            budget_bytes: None,
        })
        .collect()
}

fn commit(core: &mut Core) -> kvtier::Plan {
    let plan = core.plan().unwrap().clone();
    core.commit(plan.id).unwrap();
    plan
}

#[test]
fn sink_and_recent_window_stay_at_level_0_and_the_rest_split_by_ratio() {
    let mut c = core(cfg());
    let (_, blocks) = seq_with(&mut c, 100, 10); // 40 tokens; window 8 tokens = last 2 blocks
                                                 // Magnitudes rank the middle blocks 1..=7: block i has magnitude i.
    let mid: Vec<u32> = blocks[1..8].to_vec();
    c.set_magnitude(&mid, &(1..=7).map(|x| x as f32).collect::<Vec<_>>())
        .unwrap();
    commit(&mut c);
    let level = |c: &Core, b: u32| c.block_loc(b).unwrap().level;
    assert_eq!(level(&c, blocks[0]), 0, "sink");
    assert_eq!(level(&c, blocks[8]), 0, "recent");
    assert_eq!(level(&c, blocks[9]), 0, "recent");
    // 7 ranked blocks, ratio 0.5 → round(3.5) = 4 most important at level 1, 3 at level 2.
    let levels: Vec<u8> = mid.iter().map(|&b| level(&c, b)).collect();
    assert_eq!(levels, vec![2, 2, 2, 1, 1, 1, 1]);
}

#[test]
fn drop_ratio_takes_the_lowest_ranked_out_of_attention_and_counts_them_later() {
    let mut c = core(Config {
        level_bytes: vec![64, 32, 16, 0],
        drop_ratio: 0.3,
        ..cfg()
    });
    let (s, blocks) = seq_with(&mut c, 100, 10);
    let mid: Vec<u32> = blocks[1..8].to_vec();
    c.set_magnitude(&mid, &(1..=7).map(|x| x as f32).collect::<Vec<_>>())
        .unwrap();
    let plan = commit(&mut c);
    let drops: Vec<u32> = plan
        .moves
        .iter()
        .filter(|m| m.kind == MoveKind::Drop)
        .map(|m| m.block)
        .collect();
    assert_eq!(drops.len(), 2, "round(0.3 * 7) = 2 of the 7 ranked blocks");
    let level = |c: &Core, b: u32| c.block_loc(b).unwrap().level;
    // The two lowest leave; of the 5 kept, round(2.5) = 3 most important at level 1.
    let levels: Vec<u8> = mid.iter().map(|&b| level(&c, b)).collect();
    assert_eq!(levels, vec![3, 3, 2, 2, 1, 1, 1]);
    assert_eq!(
        (level(&c, blocks[0]), level(&c, blocks[9])),
        (0, 0),
        "sink, recent"
    );
    assert_eq!(
        c.tier_bytes()[0],
        3 * 64 + 3 * 32 + 2 * 16,
        "a dropped block holds nothing"
    );
    // Four more blocks: 11 ranked now, 2 of them gone: round(3.3) = 3 out, so one more.
    c.append_blocks(s, &[200, 201, 202, 203]).unwrap();
    let later = commit(&mut c);
    assert_eq!(
        later
            .moves
            .iter()
            .filter(|m| m.kind == MoveKind::Drop)
            .count(),
        1
    );
    assert!(
        c.lookup(&[100, 101]).len() == 1,
        "a dropped block leaves the prefix index"
    );
}

#[test]
fn a_drop_ratio_needs_a_drop_level() {
    let err = Core::new(Config {
        drop_ratio: 0.5,
        ..cfg()
    })
    .err();
    assert!(matches!(
        err,
        Some(Error::InvalidConfig {
            field: "drop_ratio",
            ..
        })
    ));
}

#[test]
fn a_device_budget_demotes_lowest_first_then_offloads() {
    let mut cfg = cfg();
    cfg.enable_compression = true;
    cfg.pressure_only = true;
    cfg.headroom = 0.0;
    cfg.policy = kvtier::PolicyKind::Lru;
    cfg.tiers = vec![
        TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(6 * 64),
        },
        TierConfig {
            tier: Tier::Host,
            budget_bytes: None,
        },
    ];
    let mut c = core(cfg);
    let (s, blocks) = seq_with(&mut c, 1, 6);
    c.free_sequence(s).unwrap(); // all six cached at level 0, device exactly full
    c.set_budget(Tier::Device, Some(3 * 64)).unwrap();
    let plan = commit(&mut c);
    assert!(c.tier_bytes()[0] <= 3 * 64);
    // The oldest blocks move first, but the sink (block 0) after the others; each block
    // moves at most once per plan.
    assert_eq!(plan.moves[0].block, blocks[1]);
    assert_eq!(plan.moves[0].kind, MoveKind::Demote);
    // Keep squeezing: blocks at the last level go to the host instead of being dropped.
    c.set_budget(Tier::Device, Some(64)).unwrap();
    for _ in 0..4 {
        commit(&mut c);
    }
    assert!(c.tier_bytes()[0] <= 64);
    assert!(c.counters().offloads > 0);
    assert_eq!(
        c.counters().evictions,
        0,
        "the host had room: nothing should be evicted"
    );
    assert_eq!(
        c.lookup(&(1..7).collect::<Vec<_>>()).len(),
        6,
        "every block still cached"
    );
}

#[test]
fn promotion_restores_from_a_write_through_copy_and_is_a_noop_without_one() {
    for write_through in [true, false] {
        let mut cfg = cfg();
        cfg.write_through = write_through;
        cfg.tiers = unbounded(&[Tier::Device, Tier::Host]);
        let mut c = core(cfg);
        let (s, blocks) = seq_with(&mut c, 1, 6);
        commit(&mut c); // middle blocks demoted
        let b = blocks[2];
        assert!(c.block_loc(b).unwrap().level > 0);
        assert_eq!(c.block_copy(b).unwrap().is_some(), write_through);
        // A new request whose prefix ends at block 2 puts it in that request's recent window.
        c.free_sequence(s).unwrap();
        let child = c.add_sequence();
        c.append_blocks(child, &[1, 2, 3]).unwrap(); // block 2 is now in the recent window
        let plan = commit(&mut c);
        let loc = c.block_loc(b).unwrap();
        if write_through {
            assert_eq!(
                loc.level, 0,
                "restored to full precision from the host copy"
            );
            assert!(plan
                .moves
                .iter()
                .any(|m| m.block == b && m.kind == MoveKind::Promote));
        } else {
            assert!(loc.level > 0, "a lossy level cannot give back precision");
            assert!(
                plan.noop_promotions > 0,
                "the wanted promotion is counted as a no-op"
            );
        }
    }
}

#[test]
fn pinned_blocks_never_move_and_shared_blocks_move_once() {
    let mut c = core(cfg());
    let (s, blocks) = seq_with(&mut c, 1, 10);
    let child = c.fork(s).unwrap().child; // every block shared by two sequences
    c.pin(&blocks[3..5]).unwrap();
    let plan = commit(&mut c);
    for m in &plan.moves {
        assert!(!blocks[3..5].contains(&m.block));
    }
    let mut moved: Vec<u32> = plan.moves.iter().map(|m| m.block).collect();
    let n = moved.len();
    moved.sort_unstable();
    moved.dedup();
    assert_eq!(moved.len(), n, "a shared block appears once");
    assert_eq!(c.block_loc(blocks[3]).unwrap().level, 0);
    assert_eq!(c.block_refcount(blocks[3]).unwrap(), 2);
    c.free_sequence(child).unwrap();
}

#[test]
fn sources_are_freed_only_at_commit_and_abort_changes_nothing() {
    let mut c = core(cfg());
    let (_, blocks) = seq_with(&mut c, 1, 6);
    let before = c.usage();
    let plan = c.plan().unwrap().clone();
    assert!(!plan.moves.is_empty());
    // While pending: the source slots are still held, so a new block cannot take them.
    for m in &plan.moves {
        assert_eq!(c.block_loc(m.block).unwrap(), m.src);
    }
    assert!(matches!(c.plan(), Err(Error::PlanPending { .. })));
    c.abort(plan.id).unwrap();
    assert_eq!(c.usage(), before);
    assert!(matches!(c.commit(plan.id), Err(Error::UnknownPlan { .. })));
    let plan = commit(&mut c);
    for m in &plan.moves {
        assert_eq!(c.block_loc(m.block).unwrap(), m.dst.unwrap());
    }
    assert!(plan.moves.iter().all(|m| blocks.contains(&m.block)));
}

#[test]
fn a_full_device_refuses_or_evicts_cached_blocks() {
    let mut cfg = cfg();
    cfg.tiers = vec![TierConfig {
        tier: Tier::Device,
        budget_bytes: Some(3 * 64),
    }];
    cfg.evict_on_full = false;
    let mut c = core(cfg.clone());
    let (s, _) = seq_with(&mut c, 1, 3);
    let s2 = c.add_sequence();
    let err = c.append_blocks(s2, &[9]).unwrap_err();
    assert!(
        matches!(err, Error::OutOfCapacity { budget: 192, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("budget"));
    c.free_sequence(s).unwrap(); // cached, but eviction is off
    assert!(c.append_blocks(s2, &[9]).is_err());
    cfg.evict_on_full = true;
    for prefix_aware in [true, false] {
        let mut c = core(Config {
            prefix_aware,
            ..cfg.clone()
        });
        let (s, _) = seq_with(&mut c, 1, 3);
        c.free_sequence(s).unwrap();
        let s2 = c.add_sequence();
        c.append_blocks(s2, &[9]).unwrap();
        assert_eq!(c.counters().evictions, 1);
        if prefix_aware {
            // The leaf goes: the rest of the prefix still loads.
            assert_eq!(
                c.lookup(&[1, 2, 3]).len(),
                2,
                "block 3 (the leaf) was evicted"
            );
        } else {
            // Plain: block 1 (least recent) goes, and strands blocks 2 and 3.
            assert_eq!(c.lookup(&[1, 2, 3]).len(), 0, "block 1 was evicted");
            assert_eq!(c.lookup(&[2, 3]).len(), 2);
        }
    }
}

#[test]
fn prefix_hashes_are_chained_stable_and_shared() {
    let tokens: Vec<u32> = (0..10).collect();
    let h = prefix_hashes(&tokens, 4, 7);
    assert_eq!(h.len(), 2, "the partial third block has no hash");
    assert_eq!(h[0], chain_hash(7, &[0, 1, 2, 3]));
    assert_eq!(h[1], chain_hash(h[0], &[4, 5, 6, 7]));
    // Pinned value: xxh3 is specified bit for bit, so this never changes across runs/machines.
    // Pinned value, equal to the reference xxh3 (python-xxhash `xxh3_64(pack("<4I",1,2,3,4))`):
    // the hash is specified bit for bit, so it never changes across runs, machines or builds.
    assert_eq!(chain_hash(0, &[1, 2, 3, 4]), 8_052_976_908_588_476_977);
    let mut c = core(cfg());
    let a = c.add_sequence();
    let b = c.add_sequence();
    let ra = c.append_tokens(a, &tokens).unwrap();
    let rb = c.append_tokens(b, &tokens).unwrap();
    assert_eq!(ra.shared, vec![false, false, false]);
    assert_eq!(
        rb.shared,
        vec![true, true, false],
        "full blocks shared, partial block private"
    );
    assert_eq!(rb.blocks[..2], ra.blocks[..2]);
    assert_eq!(c.block_refcount(ra.blocks[0]).unwrap(), 2);
    assert_eq!(c.lookup_tokens(&tokens).len(), 2);
    // Growing the partial block to full indexes it under the chained hash.
    c.append_tokens(a, &[10, 11]).unwrap();
    assert_eq!(c.lookup_tokens(&(0..12).collect::<Vec<_>>()).len(), 3);
}

#[test]
fn fork_shares_full_blocks_and_copies_the_partial_one() {
    let mut c = core(cfg());
    let s = c.add_sequence();
    c.append_tokens(s, &(0..10).collect::<Vec<_>>()).unwrap();
    let f = c.fork(s).unwrap();
    let parent = c.sequence_blocks(s).unwrap().to_vec();
    let child = c.sequence_blocks(f.child).unwrap().to_vec();
    assert_eq!(parent[..2], child[..2]);
    assert_ne!(parent[2], child[2]);
    assert_eq!(f.copy, Some((parent[2], child[2])));
    c.free_sequence(s).unwrap();
    assert_eq!(c.block_refcount(child[0]).unwrap(), 1);
    assert!(
        c.block_loc(parent[2]).is_err(),
        "the parent's private partial block is freed"
    );
}

#[test]
fn bad_input_changes_nothing() {
    let mut c = core(cfg());
    let (_, blocks) = seq_with(&mut c, 1, 3);
    let before = (c.usage(), c.counters().clone());
    assert!(matches!(
        c.record_reads(&[blocks[0], 999]),
        Err(Error::UnknownBlock { block: 999 })
    ));
    assert!(matches!(
        c.record_attention(&blocks, &[1.0]),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        c.set_magnitude(&blocks[..1], &[f32::NAN]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        c.free_sequence(77),
        Err(Error::UnknownSequence { seq: 77 })
    ));
    assert!(matches!(
        c.unpin(&blocks[..1]),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!((c.usage(), c.counters().clone()), before);
    assert_eq!(
        c.block_score(blocks[0]).unwrap().primary(),
        0.0,
        "no read was recorded"
    );
    let bad = Config {
        compression_ratio: 1.5,
        ..cfg()
    };
    assert!(matches!(
        Core::new(bad),
        Err(Error::InvalidConfig {
            field: "compression_ratio",
            ..
        })
    ));
    assert!(matches!(
        kvtier::PolicyKind::parse("fifo"),
        Err(Error::UnknownPolicy { .. })
    ));
}

fn budgeted(budget: u64, evict_on_full: bool) -> Config {
    Config {
        level_bytes: vec![100],
        tiers: vec![TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(budget),
        }],
        policy: kvtier::PolicyKind::Lru,
        headroom: 0.0,
        evict_on_full,
        ..cfg()
    }
}

/// Prefix-aware, a plan evicts leaf after leaf (the leaf first, then its parent, which the
/// eviction made a leaf), and a cancelled eviction cancels its parent's and links the block
/// back: a prefix shared again while the plan was pending stays whole.
#[test]
fn commit_cancels_evicting_a_prefix_shared_or_pinned_meanwhile() {
    let mut c = core(budgeted(400, false));
    let (s, blocks) = seq_with(&mut c, 1, 4);
    c.free_sequence(s).unwrap();
    c.set_budget(Tier::Device, Some(200)).unwrap();
    let plan = c.plan().unwrap().clone();
    assert_eq!(
        plan.moves.iter().map(|m| m.block).collect::<Vec<_>>(),
        [blocks[3], blocks[2]],
        "the leaf, then its parent"
    );
    let s2 = c.add_sequence();
    assert_eq!(
        c.append_blocks(s2, &[1, 2, 3]).unwrap().blocks,
        blocks[..3],
        "shared again"
    );
    c.pin(&blocks[3..]).unwrap(); // and the engine reads the leaf
    c.commit(plan.id).unwrap();
    assert_eq!(c.counters().cancelled_moves, 2);
    assert_eq!(c.counters().evictions, 0);
    assert_eq!(c.block_parent(blocks[3]).unwrap(), Some(blocks[2]));
    c.unpin(&blocks[3..]).unwrap();
    assert_eq!(c.lookup(&[1, 2, 3, 4]).len(), 4);
    // Aborted, a plan links its evictions back too.
    c.free_sequence(s2).unwrap();
    let plan = c.plan().unwrap().clone();
    assert_eq!(plan.moves.len(), 2);
    c.abort(plan.id).unwrap();
    assert_eq!(c.block_parent(blocks[3]).unwrap(), Some(blocks[2]));
    assert_eq!(c.lookup(&[1, 2, 3, 4]).len(), 4);
    let plan = c.plan().unwrap().clone();
    c.commit(plan.id).unwrap();
    assert_eq!(c.lookup(&[1, 2, 3, 4]).len(), 2);
}

#[test]
fn commit_cancels_evicting_a_block_shared_or_pinned_meanwhile() {
    let mut c = core(Config {
        prefix_aware: false,
        ..budgeted(400, false)
    });
    let (s, blocks) = seq_with(&mut c, 1, 4);
    c.free_sequence(s).unwrap();
    c.set_budget(Tier::Device, Some(200)).unwrap();
    let plan = c.plan().unwrap().clone();
    assert_eq!(
        plan.moves.iter().map(|m| m.block).collect::<Vec<_>>(),
        blocks[..2]
    );
    let s2 = c.add_sequence();
    assert_eq!(
        c.append_blocks(s2, &[1]).unwrap().blocks,
        vec![blocks[0]],
        "shared again"
    );
    c.pin(&blocks[1..2]).unwrap(); // and the engine reads the other one
    c.commit(plan.id).unwrap();
    assert_eq!(c.counters().cancelled_moves, 2);
    assert_eq!(c.counters().evictions, 0);
    assert_eq!(c.block_refcount(blocks[0]).unwrap(), 1);
    c.unpin(&blocks[1..2]).unwrap();
    assert_eq!(c.lookup(&[1, 2]).len(), 2);
}

#[test]
fn an_append_that_cannot_fit_evicts_nothing() {
    let mut c = core(budgeted(1000, true));
    let (s, _) = seq_with(&mut c, 1, 3);
    c.free_sequence(s).unwrap(); // 3 cached
    seq_with(&mut c, 10, 7); // 7 live: 1000 bytes in use
    c.set_budget(Tier::Device, Some(500)).unwrap();
    let s2 = c.add_sequence();
    assert!(matches!(
        c.append_blocks(s2, &[99]),
        Err(Error::OutOfCapacity { .. })
    ));
    assert_eq!(
        c.cached_blocks(),
        3,
        "evicting them would not have made room"
    );
    assert!(
        c.append_blocks(s2, &[1, 2]).is_ok(),
        "a wholly shared request always fits"
    );
}

#[test]
fn raising_a_budget_grows_its_pools() {
    let mut c = core(budgeted(200, false));
    seq_with(&mut c, 1, 2);
    c.set_budget(Tier::Device, Some(500)).unwrap();
    seq_with(&mut c, 10, 3);
    assert_eq!(c.tier_bytes()[0], 500);
}

#[test]
fn above_the_budget_live_blocks_are_dropped_when_the_ladder_has_a_drop_level() {
    let mut cfg = budgeted(48, false);
    cfg.level_bytes = vec![8, 4, 0];
    cfg.block_size = 1;
    cfg.recent_window = 0;
    cfg.sink_blocks = 0;
    cfg.pressure_only = true;
    let mut c = core(cfg);
    seq_with(&mut c, 1, 6);
    c.set_budget(Tier::Device, Some(10)).unwrap();
    let first = commit(&mut c);
    // The newest block stays at level 0 (a drop ladder never drops the block being written).
    assert_eq!(first.unmet_bytes, 18, "five demotions leave 28 bytes");
    let second = commit(&mut c);
    assert_eq!(
        second
            .moves
            .iter()
            .filter(|m| m.kind == MoveKind::Drop)
            .count(),
        5
    );
    assert_eq!(second.unmet_bytes, 0);
    assert!(c.tier_bytes()[0] <= 10);
}

#[test]
fn tokens_without_ids_are_never_hashed_nor_shared() {
    let mut c = core(cfg());
    let a = c.add_sequence();
    let tokens: Vec<u32> = (0..8).collect();
    c.append_tokens(a, &tokens).unwrap(); // two hashed blocks
    let added = c.extend(a, 6).unwrap(); // one full anonymous block and a partial one
    assert_eq!(added.blocks.len(), 2);
    assert_eq!(c.sequence_tokens(a).unwrap(), 14);
    // Ids given after the gap are not hashed either: the sequence is opaque now.
    c.append_tokens(a, &[1, 2]).unwrap();
    assert_eq!(c.sequence_tokens(a).unwrap(), 16);
    // A second sequence with the same ids shares the hashed prefix only.
    let b = c.add_sequence();
    let shared = c
        .append_tokens(b, &(0..16).collect::<Vec<u32>>())
        .unwrap()
        .shared;
    assert_eq!(shared, vec![true, true, false, false]);
    assert!(matches!(
        c.extend(99, 1),
        Err(Error::UnknownSequence { seq: 99 })
    ));
}

#[test]
fn pool_headroom_demotes_then_offloads_out_of_a_full_explicit_pool() {
    let mut cfg = cfg();
    cfg.pressure_only = true; // no rank split: only the pool pass moves blocks
    cfg.headroom = 0.25;
    cfg.policy = kvtier::PolicyKind::Lru;
    cfg.tiers = unbounded(&[Tier::Device, Tier::Host]);
    cfg.pool_slots = vec![
        (Tier::Device, 0, 8),
        (Tier::Device, 1, 2),
        (Tier::Device, 2, 1),
    ];
    cfg.pool_headroom = true;
    let mut c = core(cfg.clone());
    let (s, blocks) = seq_with(&mut c, 100, 8); // level 0 full: 8 of 8 slots, soft limit 6
    c.free_sequence(s).unwrap(); // all cached now
    let plan = commit(&mut c);
    let kinds: Vec<MoveKind> = plan.moves.iter().map(|m| m.kind).collect();
    // The two least recently used but the sink go down a level (level 1 has 2 free slots of 2).
    assert_eq!(kinds, vec![MoveKind::Demote, MoveKind::Demote]);
    assert_eq!(plan.moves[0].block, blocks[1]);
    let used = |c: &Core, tier: Tier, level: u8| {
        c.usage()
            .into_iter()
            .find(|u| u.tier == tier && u.level == level)
            .unwrap()
            .used_slots
    };
    assert_eq!(used(&c, Tier::Device, 0), 6);
    // Level 1 is now over its own limit (2 of 2, soft 1): its lowest block goes to level 2, and
    // when level 2 is full too, blocks are offloaded to the host.
    let kinds = |p: kvtier::Plan| p.moves.iter().map(|m| m.kind).collect::<Vec<_>>();
    assert_eq!(kinds(commit(&mut c)), vec![MoveKind::Demote]);
    // Level 2 keeps ceil(25 % of 1) = 1 slot free, and is the last level: off to the host.
    assert_eq!(kinds(commit(&mut c)), vec![MoveKind::Offload]);
    assert_eq!(used(&c, Tier::Device, 1), 1);
    assert_eq!(used(&c, Tier::Device, 2), 0);
    assert_eq!(used(&c, Tier::Host, 2), 1);
    // Without the flag the same state plans nothing: pools sized from budgets never trigger it.
    cfg.pool_headroom = false;
    let mut c = core(cfg);
    let (s, _) = seq_with(&mut c, 100, 8);
    c.free_sequence(s).unwrap();
    assert!(commit(&mut c).moves.is_empty());
}

#[test]
fn forgotten_blocks_are_not_shared_and_are_freed_with_their_last_owner() {
    let mut c = core(cfg());
    let a = c.add_sequence();
    let tokens: Vec<u32> = (0..8).collect();
    let blocks = c.append_tokens(a, &tokens).unwrap().blocks;
    c.forget(&blocks[1..]).unwrap();
    let b = c.add_sequence();
    let shared = c.append_tokens(b, &tokens).unwrap().shared;
    assert_eq!(shared, vec![true, false]);
    let live = c.live_blocks();
    c.free_sequence(a).unwrap();
    assert_eq!(
        c.live_blocks(),
        live - 1,
        "the forgotten block goes with its owner"
    );
    assert!(c.forget(&[999]).is_err());
}

#[test]
fn a_plan_with_room_offloads_cached_blocks_so_that_new_ones_evict_nothing() {
    let mut cfg = budgeted(4 * 100, true);
    cfg.tiers.push(TierConfig {
        tier: Tier::Host,
        budget_bytes: None,
    });
    let mut c = core(cfg);
    let (s, blocks) = seq_with(&mut c, 1, 4);
    c.free_sequence(s).unwrap(); // four cached blocks, the device exactly full
    assert!(
        commit(&mut c).moves.is_empty(),
        "within budget: nothing to do"
    );
    // Room for two new blocks: the two least recently used but the sink go to the host,
    // nothing else.
    let plan = c.plan_with_room(2 * 100).unwrap().clone();
    c.commit(plan.id).unwrap();
    let moved: Vec<(u32, MoveKind)> = plan.moves.iter().map(|m| (m.block, m.kind)).collect();
    assert_eq!(
        moved,
        vec![
            (blocks[1], MoveKind::Offload),
            (blocks[2], MoveKind::Offload)
        ]
    );
    let (_, new) = seq_with(&mut c, 10, 2);
    assert_eq!(new.len(), 2);
    assert_eq!(c.counters().evictions, 0);
    assert_eq!(
        c.lookup(&[1, 2, 3, 4]).len(),
        4,
        "every old block still cached"
    );
    // More room than the device can give: its cached blocks go to the host, then its two live
    // blocks, the recent window (complete: level 0 on the host is still level 0; only a block
    // being written stays where new K/V goes), and nothing is evicted for the rest.
    let plan = c.plan_with_room(10 * 100).unwrap().clone();
    let moved: Vec<(u32, MoveKind)> = plan.moves.iter().map(|m| (m.block, m.kind)).collect();
    assert_eq!(
        moved,
        vec![
            (blocks[3], MoveKind::Offload),
            (blocks[0], MoveKind::Offload), // the sink, after the other cached block
            (new[0], MoveKind::Offload),
            (new[1], MoveKind::Offload),
        ]
    );
    c.abort(plan.id).unwrap();
    // A block being written (partial) stays.
    let s3 = c.add_sequence();
    let partial = c.append_tokens(s3, &[1, 2]).unwrap().blocks[0];
    let plan = c.plan_with_room(10 * 100).unwrap().clone();
    assert!(plan.moves.iter().all(|m| m.block != partial));
    c.abort(plan.id).unwrap();
}

#[test]
fn a_full_level_0_pool_with_bytes_to_spare_names_its_slots_and_reclaims_when_allowed() {
    // Level 0 holds 2 blocks; the other levels' slots leave bytes free in the budget.
    let mut cfg = cfg();
    cfg.tiers = vec![TierConfig {
        tier: Tier::Device,
        budget_bytes: Some(2 * 64 + 4 * 32 + 4 * 16),
    }];
    cfg.pool_slots = vec![
        (Tier::Device, 0, 2),
        (Tier::Device, 1, 4),
        (Tier::Device, 2, 4),
    ];
    cfg.evict_on_full = false;
    let mut c = core(cfg);
    let (s, _) = seq_with(&mut c, 1, 2);
    c.free_sequence(s).unwrap();
    assert_eq!(
        c.reclaimable()[0],
        (Tier::Device, 0, 2, 128),
        "two cached level-0 blocks"
    );
    let s2 = c.add_sequence();
    let err = c.append_blocks(s2, &[9]).unwrap_err();
    // Not "requested 64 bytes, 192 free": the bytes are there, the slots are not.
    assert!(
        matches!(
            err,
            Error::OutOfSlots {
                requested: 1,
                free: 0,
                ..
            }
        ),
        "{err}"
    );
    c.set_evict_on_full(true);
    c.append_blocks(s2, &[9]).unwrap();
    assert_eq!(c.counters().evictions, 1);
    assert_eq!(c.reclaimable()[0], (Tier::Device, 0, 1, 64));
}

#[test]
fn a_plan_with_room_frees_that_many_level_0_slots_by_demoting() {
    // Eight level-0 slots; the pool's own headroom (10 %) would free one. Asking for the room
    // of four blocks demotes four cached blocks (nothing is evicted for the room itself).
    let mut cfg = cfg();
    cfg.recent_window = 0;
    cfg.sink_blocks = 0;
    cfg.tiers = vec![TierConfig {
        tier: Tier::Device,
        budget_bytes: Some(8 * 64 + 8 * 32 + 8 * 16),
    }];
    cfg.pool_slots = vec![
        (Tier::Device, 0, 8),
        (Tier::Device, 1, 8),
        (Tier::Device, 2, 8),
    ];
    cfg.pool_headroom = true;
    cfg.evict_on_full = false;
    let mut c = core(cfg);
    let (s, _) = seq_with(&mut c, 1, 8);
    c.free_sequence(s).unwrap();
    let plan = c.plan_with_room(4 * 64).unwrap().clone();
    let out_of_level_0 = plan
        .moves
        .iter()
        .filter(|m| m.src.level == 0 && m.kind != MoveKind::Backup)
        .count();
    assert!(out_of_level_0 >= 4, "{:?}", plan.moves);
    assert!(plan.moves.iter().all(|m| m.kind != MoveKind::Evict));
    c.commit(plan.id).unwrap();
    let s2 = c.add_sequence();
    c.append_blocks(s2, &[20, 21, 22, 23]).unwrap();
    assert_eq!(c.counters().evictions, 0);
}

/// A write needs a level-0 slot that a cached block holds whose children sit at lower levels:
/// prefix-aware, its subtree goes first, leaf by leaf, then the block itself; plain, the block
/// goes alone and strands its children.
#[test]
fn a_write_evicts_below_a_level_0_block_to_free_its_slot() {
    for prefix_aware in [true, false] {
        let mut c = core(Config {
            recent_window: 0,
            sink_blocks: 1, // block 0 stays at level 0; the others go down
            pool_slots: vec![
                (Tier::Device, 0, 3),
                (Tier::Device, 1, 4),
                (Tier::Device, 2, 4),
            ],
            prefix_aware,
            ..cfg()
        });
        let (s, blocks) = seq_with(&mut c, 1, 3);
        commit(&mut c);
        let levels: Vec<u8> = blocks
            .iter()
            .map(|&b| c.block_loc(b).unwrap().level)
            .collect();
        assert_eq!(levels[0], 0);
        assert!(levels[1] > 0 && levels[2] > 0, "{levels:?}");
        c.free_sequence(s).unwrap();
        seq_with(&mut c, 7, 2); // live: level 0 is full
        let (_, new) = seq_with(&mut c, 9, 1);
        assert_eq!(c.block_loc(new[0]).unwrap().level, 0);
        if prefix_aware {
            assert_eq!(c.counters().evictions, 3, "the subtree, then its root");
            assert!(c.lookup(&[1]).is_empty());
        } else {
            assert_eq!(c.counters().evictions, 1);
            assert_eq!(
                c.lookup(&[2, 3]).len(),
                2,
                "stranded behind the evicted block 1"
            );
        }
    }
}

/// Two level-0 slots, none at level 1 and `bottom` at level 2, where every ranked block wants
/// to go; room for level 0 is made by moving blocks into the slots of cached leaves below.
fn bottom_level_core(bottom: u32) -> Core {
    core(Config {
        recent_window: 0,
        sink_blocks: 0,
        compression_ratio: 0.0,
        headroom: 0.0,
        pool_slots: vec![
            (Tier::Device, 0, 2),
            (Tier::Device, 1, 0),
            (Tier::Device, 2, bottom),
        ],
        pool_headroom: true,
        policy: kvtier::PolicyKind::Lru,
        ..cfg()
    })
}

/// Two victims in one plan, the second the parent of the first (eviction takes leaves: a chain
/// goes child first). An abort before any copy gives both back, the parent first, so that the
/// child finds its parent indexed again: nothing is released (found by the manager's
/// hypothesis model, where a failed `add_sequence` lost a cached block this way).
#[test]
fn an_abort_gives_back_a_chain_of_victims_whole() {
    let mut c = bottom_level_core(2);
    let (a, old) = seq_with(&mut c, 1, 2);
    assert_eq!(commit(&mut c).moves.len(), 2, "both go to the bottom level");
    c.free_sequence(a).unwrap(); // a cached chain there: old[0] the parent of old[1]
    seq_with(&mut c, 5, 2); // level 0 full, the bottom level too
    assert!(commit(&mut c).moves.is_empty(), "nowhere to demote to");
    let (released, used) = (c.counters().released, c.usage());
    let plan = c.plan_with_room(128).unwrap().clone();
    let evicted: Vec<u32> = plan
        .moves
        .iter()
        .filter(|m| m.kind == MoveKind::Evict)
        .map(|m| m.block)
        .collect();
    assert_eq!(evicted, [old[1], old[0]], "the leaf, then its parent");
    c.abort(plan.id).unwrap();
    assert_eq!(c.lookup(&[1, 2]), old, "both indexed again");
    assert_eq!(c.block_parent(old[1]).unwrap(), Some(old[0]));
    assert_eq!(c.counters().released, released, "nothing released");
    assert_eq!(c.usage(), used);
}

/// Room for a new block when every level below is full: the plan evicts the lowest-ranked
/// cached leaf below and moves a level-0 block into its slot, in one plan. Aborted before any
/// copy, the plan gives the victim back; aborted after copies, it cannot.
#[test]
fn room_is_made_by_moving_a_block_into_the_slot_of_a_leaf_below_it_evicts() {
    for (commits, copied) in [(true, false), (false, false), (false, true)] {
        let mut c = bottom_level_core(1);
        let (a, old) = seq_with(&mut c, 1, 1);
        let plan = commit(&mut c);
        assert_eq!(plan.moves.len(), 1, "its block goes to the bottom level");
        c.free_sequence(a).unwrap(); // a cached leaf at level 2
        let (_, live) = seq_with(&mut c, 5, 2); // level 0 full, the bottom level too
        assert!(commit(&mut c).moves.is_empty(), "nowhere to demote to");
        let victim_slot = c.block_loc(old[0]).unwrap();
        let plan = c.plan_with_room(64).unwrap().clone();
        let kinds: Vec<(u32, MoveKind)> = plan.moves.iter().map(|m| (m.block, m.kind)).collect();
        assert_eq!(
            kinds,
            [(old[0], MoveKind::Evict), (live[0], MoveKind::Demote)]
        );
        assert_eq!(
            plan.moves[1].dst,
            Some(victim_slot),
            "into the evicted block's slot"
        );
        assert!(
            c.lookup(&[1]).is_empty(),
            "the victim left the index with the plan"
        );
        let used = |c: &Core| c.usage().iter().map(|u| u.used_slots).collect::<Vec<u32>>();
        if commits {
            c.commit(plan.id).unwrap();
            assert_eq!(c.block_loc(live[0]).unwrap(), victim_slot);
            assert!(c.block_loc(old[0]).is_err());
            assert_eq!(used(&c), [1, 0, 1]);
        } else if copied {
            c.abort_after_copies(plan.id).unwrap();
            assert_eq!(c.block_loc(live[0]).unwrap().level, 0);
            assert!(c.block_loc(old[0]).is_err(), "its bytes may be gone");
            assert_eq!(used(&c), [2, 0, 0]);
        } else {
            c.abort(plan.id).unwrap();
            assert_eq!(c.block_loc(live[0]).unwrap().level, 0);
            assert_eq!(c.block_loc(old[0]).unwrap(), victim_slot, "given back");
            assert_eq!(c.lookup(&[1]), old, "and indexed again");
            assert_eq!(used(&c), [2, 0, 1]);
        }
        assert_eq!(c.counters().evictions, u64::from(commits));
    }
}

/// A freed sequence's blocks are cached; room asked for at level 0 demotes them lowest key
/// first, but its sink (block 0, with `sink_blocks` 1) after every other cached block, and
/// still when nothing else is left: the rule orders demotions, it never refuses one.
#[test]
fn a_cached_prefix_keeps_its_sink_at_level_0_longest() {
    for sink_blocks in [1, 0] {
        let mut c = core(Config {
            recent_window: 0,
            sink_blocks,
            compression_ratio: 0.0,
            headroom: 0.0,
            pool_slots: vec![
                (Tier::Device, 0, 4),
                (Tier::Device, 1, 0),
                (Tier::Device, 2, 8),
            ],
            pool_headroom: true,
            policy: kvtier::PolicyKind::Lru, // block 0 is the least recently used
            ..cfg()
        });
        let (s, blocks) = seq_with(&mut c, 1, 4);
        c.free_sequence(s).unwrap();
        let at_level_0 = |c: &Core| -> Vec<u32> {
            blocks
                .iter()
                .copied()
                .filter(|&b| c.block_loc(b).unwrap().level == 0)
                .collect()
        };
        let mut kept = Vec::new();
        for room_blocks in 2..=4 {
            let plan = c.plan_with_room(room_blocks * 64).unwrap().clone();
            c.commit(plan.id).unwrap();
            kept.push(at_level_0(&c));
        }
        let b = &blocks;
        if sink_blocks == 1 {
            assert_eq!(kept, [vec![b[0], b[3]], vec![b[0]], vec![]]);
        } else {
            assert_eq!(kept, [vec![b[2], b[3]], vec![b[3]], vec![]]);
        }
        assert_eq!(c.lookup(&[1, 2, 3, 4]), blocks, "demoted, all still held");
    }
}

/// A cached chain keeps its other end too (`keep_leaves`): its last blocks, where the next turn
/// continues, are demoted after every other cached block but the sink, whatever their key (here
/// the last block is the least recently used); without the rule they go as their key says.
#[test]
fn a_cached_prefix_keeps_its_last_blocks_after_the_others_and_before_its_sink() {
    for keep_leaves in [1, 2, 0] {
        let mut c = core(Config {
            recent_window: 0,
            keep_leaves,
            compression_ratio: 0.0,
            headroom: 0.0,
            pool_slots: vec![
                (Tier::Device, 0, 5),
                (Tier::Device, 1, 0),
                (Tier::Device, 2, 8),
            ],
            pool_headroom: true,
            policy: kvtier::PolicyKind::Lru,
            ..cfg()
        });
        let (s, blocks) = seq_with(&mut c, 1, 5);
        c.free_sequence(s).unwrap();
        // Read in order 4, 0, 1, 2, 3: the leaf (block 4) is the least recently used.
        for b in [4, 0, 1, 2, 3] {
            c.record_reads(&[blocks[b]]).unwrap();
        }
        let mut demoted = Vec::new();
        for room_blocks in 1..=5 {
            let plan = c.plan_with_room(room_blocks * 64).unwrap().clone();
            c.commit(plan.id).unwrap();
            demoted.extend(
                plan.moves
                    .iter()
                    .map(|m| blocks.iter().position(|&b| b == m.block).unwrap()),
            );
        }
        let want: [usize; 5] = match keep_leaves {
            1 => [1, 2, 3, 4, 0],
            2 => [1, 2, 4, 3, 0],
            _ => [4, 1, 2, 3, 0],
        };
        assert_eq!(demoted, want, "keep_leaves {keep_leaves}");
    }
}

/// The last blocks follow the chain: a block appended after a cached chain's leaf makes the
/// block `keep_leaves` before it an ordinary one again, demoted with the others first, and
/// evicting the leaf makes the block before its parent an end again.
#[test]
fn a_chains_last_blocks_move_with_its_leaf() {
    let last_two = || {
        core(Config {
            recent_window: 0,
            keep_leaves: 2,
            compression_ratio: 0.0,
            headroom: 0.0,
            pool_slots: vec![
                (Tier::Device, 0, 6),
                (Tier::Device, 1, 0),
                (Tier::Device, 2, 8),
            ],
            pool_headroom: true,
            policy: kvtier::PolicyKind::Lru,
            ..cfg()
        })
    };
    let mut c = last_two();
    let (s, blocks) = seq_with(&mut c, 1, 4);
    c.free_sequence(s).unwrap();
    let s = c.add_sequence();
    let grown = c.append_blocks(s, &[1, 2, 3, 4, 5]).unwrap().blocks;
    assert_eq!(&grown[..4], &blocks[..]);
    c.free_sequence(s).unwrap();
    // Read in order 2, 1, 3, 4, 0: block 2 was an end (the leaf's parent) and is not now.
    for b in [2, 1, 3, 4, 0] {
        c.record_reads(&[grown[b]]).unwrap();
    }
    let plan = c.plan_with_room(3 * 64).unwrap().clone();
    c.commit(plan.id).unwrap();
    let first: Vec<u32> = plan.moves.iter().map(|m| m.block).collect();
    assert_eq!(first, [grown[2], grown[1]]);
    // A chain of five, cached: evicting its leaf (4) leaves 2 and 3 its last blocks.
    let mut c = last_two();
    let (s, blocks) = seq_with(&mut c, 1, 5);
    c.free_sequence(s).unwrap();
    for b in [2, 1, 3, 0] {
        c.record_reads(&[blocks[b]]).unwrap();
    }
    assert_eq!(c.evict_cached(1, &[]).unwrap().unwrap(), [5]);
    let plan = c.plan_with_room(3 * 64).unwrap().clone();
    c.commit(plan.id).unwrap();
    let first: Vec<u32> = plan.moves.iter().map(|m| m.block).collect();
    assert_eq!(first, [blocks[1]]);
}

/// With `settle_cached`, a cached chain settles where a full cache keeps it as soon as there is
/// room, not under pressure: its ends (the sink and its last `keep_leaves` blocks) at
/// `ends_level`, by default the deepest level of at least a quarter of level 0's bytes (4 bits
/// a value under 16-bit blocks), the others at the bottom, lowest-ranked first, each at the
/// deepest level between with a free slot beyond its headroom (level 1 once the bottom is that
/// full: settling never fills a pool so far that it evicts to make its headroom again). A saved
/// block is placed there before it is written.
#[test]
fn cached_blocks_settle_at_their_home_levels() {
    let settling = |level_bytes: Vec<u64>, bottom: u32, keep_leaves: u32, ends: Option<u8>| {
        core(Config {
            level_bytes,
            recent_window: 0,
            compression_ratio: 0.0,
            pool_slots: vec![
                (Tier::Device, 0, 8),
                (Tier::Device, 1, 4),
                (Tier::Device, 2, bottom),
            ],
            pool_headroom: true,
            settle_cached: true,
            keep_leaves,
            ends_level: ends,
            pressure_only: true, // live blocks stay at level 0
            policy: kvtier::PolicyKind::Lru,
            ..cfg()
        })
    };
    let levels = |c: &Core, blocks: &[u32]| -> Vec<u8> {
        blocks
            .iter()
            .map(|&b| c.block_loc(b).unwrap().level)
            .collect()
    };
    // Level 1 takes a quarter of level 0's bytes, the bottom less: the ends settle at level 1.
    let mut c = settling(vec![64, 16, 8], 8, 1, None);
    let (s, blocks) = seq_with(&mut c, 1, 5);
    commit(&mut c);
    assert_eq!(levels(&c, &blocks), [0; 5], "live: nothing settles");
    c.free_sequence(s).unwrap();
    commit(&mut c);
    assert_eq!(levels(&c, &blocks), [1, 2, 2, 2, 1]);
    // The bottom takes a quarter (64, 32, 16): there is nothing above it for the ends; with
    // `ends_level` 0 they stay, the last two blocks with `keep_leaves` 2.
    for (ends, keep_leaves, want) in [
        (None, 1, [2, 2, 2, 2, 2]),
        (Some(0), 1, [0, 2, 2, 2, 0]),
        (Some(0), 2, [0, 2, 2, 0, 0]),
    ] {
        let mut c = settling(vec![64, 32, 16], 8, keep_leaves, ends);
        let (s, blocks) = seq_with(&mut c, 1, 5);
        c.free_sequence(s).unwrap();
        commit(&mut c);
        assert_eq!(levels(&c, &blocks), want, "{ends:?} {keep_leaves}");
    }
    // A bottom of three slots, one of them headroom: the two lowest-ranked middles go there,
    // the third to level 1.
    let mut c = settling(vec![64, 16, 8], 3, 1, None);
    let (s, blocks) = seq_with(&mut c, 1, 5);
    c.free_sequence(s).unwrap();
    commit(&mut c);
    assert_eq!(levels(&c, &blocks), [1, 2, 2, 1, 1]);
    // Without the leaf rule, a second chain finds the bottom at its headroom: it settles at
    // level 1, and the first chain's leaf at the bottom is not evicted to make headroom.
    let mut c = settling(vec![64, 16, 8], 3, 0, Some(0));
    let (s, first) = seq_with(&mut c, 1, 3);
    c.free_sequence(s).unwrap();
    commit(&mut c);
    let (s, second) = seq_with(&mut c, 100, 3);
    c.free_sequence(s).unwrap();
    commit(&mut c);
    assert_eq!(levels(&c, &first), [0, 2, 2]);
    assert_eq!(levels(&c, &second), [0, 1, 1]);
    assert_eq!(c.counters().evictions, 0);
    // Saved blocks go straight there.
    let mut c = settling(vec![64, 16, 8], 8, 2, None);
    let (_, blocks) = seq_with(&mut c, 1, 5);
    c.pin(&blocks).unwrap();
    assert_eq!(c.place_saved(&blocks).unwrap(), [1, 2, 2, 1, 1]);
}

/// A save's new blocks, placed before any byte is written: the chain's ends (its sink and,
/// here, its one last block) stay at level 0, the others go to the most precise lower level
/// with a free slot (level 1 while it has one, then level 2). Bytes follow the slots. A block
/// that is not new (shared, unpinned, already placed) is refused, and nothing moves.
#[test]
fn a_saved_block_is_placed_where_a_cached_one_settles_before_it_is_written() {
    let mut c = core(Config {
        pool_slots: vec![
            (Tier::Device, 0, 8),
            (Tier::Device, 1, 2),
            (Tier::Device, 2, 2),
        ],
        keep_leaves: 1,
        ..cfg()
    });
    let (s, blocks) = seq_with(&mut c, 1, 6);
    c.pin(&blocks).unwrap();
    let before = c.tier_bytes()[0];
    assert_eq!(c.place_saved(&blocks).unwrap(), [0, 1, 1, 2, 2, 0]);
    for (&b, level) in blocks.iter().zip([0, 1, 1, 2, 2, 0]) {
        assert_eq!(c.block_loc(b).unwrap().level, level);
    }
    assert_eq!(c.tier_bytes()[0], before - 2 * (64 - 32) - 2 * (64 - 16));
    let used: Vec<u32> = c.usage().iter().map(|u| u.used_slots).collect();
    assert_eq!(used, [2, 2, 2]);
    // Placed blocks, an unpinned one, a shared one: refused, nothing changed.
    let err = c.place_saved(&[blocks[1]]).unwrap_err();
    assert!(
        format!("{err}").contains("not a new level-0 device block"),
        "{err}"
    );
    let (_, more) = seq_with(&mut c, 100, 2);
    let shared = c.add_sequence();
    c.append_blocks(shared, &[100]).unwrap();
    c.pin(&more[1..]).unwrap();
    assert!(c.place_saved(&[more[1], more[0]]).is_err());
    c.pin(&more[..1]).unwrap();
    assert!(
        c.place_saved(&[more[1], more[0]]).is_err(),
        "block 0 is shared"
    );
    assert_eq!(
        c.usage().iter().map(|u| u.used_slots).collect::<Vec<_>>(),
        [4, 2, 2]
    );
    // Freed and unpinned, placed blocks are cached where they lie.
    c.unpin(&blocks).unwrap();
    c.free_sequence(s).unwrap();
    assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]), blocks);
}

/// A device of `blocks` level-0 blocks that evicts to make room, one level, under `policy`.
fn one_level(policy: PolicyKind, blocks: u64) -> Core {
    core(Config {
        level_bytes: vec![64],
        tiers: vec![TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(blocks * 64),
        }],
        policy,
        evict_on_full: true,
        ..cfg()
    })
}

const POLICIES: [PolicyKind; 5] = [
    PolicyKind::Importance,
    PolicyKind::Lru,
    PolicyKind::Lfu,
    PolicyKind::H2o,
    PolicyKind::Scissorhands,
];

/// An earlier turn of a conversation: a sequence that takes the chain and lets go of it.
fn earlier_turn(core: &mut Core, base: u64, n: u64) {
    let (turn, _) = seq_with(core, base, n);
    core.free_sequence(turn).unwrap();
}

/// A client that says a conversation ended (`release`) has its chain's cached blocks evicted
/// before any other, under every policy: here before an older chain that every policy would
/// evict first otherwise (all blocks unread and unscored: the least recent goes; under
/// `importance`, a chain seen once goes before one an earlier turn took too). Leaves
/// still go first (the rest of the chain stays loadable), and the blocks' ranking for
/// demotion (`block_score`) is unchanged.
#[test]
fn a_released_chain_is_evicted_before_an_older_unreleased_one() {
    for policy in POLICIES {
        for released in [true, false] {
            let mut c = one_level(policy, 6);
            let (old, _) = seq_with(&mut c, 100, 3);
            c.free_sequence(old).unwrap();
            earlier_turn(&mut c, 200, 3);
            let (ended, blocks) = seq_with(&mut c, 200, 3);
            let scores: Vec<_> = blocks.iter().map(|&b| c.block_score(b).unwrap()).collect();
            if released {
                c.release(ended).unwrap();
            }
            c.free_sequence(ended).unwrap();
            for &b in &blocks {
                assert_eq!(c.block_released(b).unwrap(), released);
            }
            let after: Vec<_> = blocks.iter().map(|&b| c.block_score(b).unwrap()).collect();
            assert_eq!(after, scores, "{policy:?}: demotion order unchanged");
            seq_with(&mut c, 300, 1); // room for one block: one leaf goes
            let (old_held, ended_held) = (c.lookup(&[100, 101, 102]), c.lookup(&[200, 201, 202]));
            if released {
                assert_eq!((old_held.len(), ended_held.len()), (3, 2), "{policy:?}");
            } else {
                assert_eq!((old_held.len(), ended_held.len()), (2, 3), "{policy:?}");
            }
            if released {
                seq_with(&mut c, 400, 2); // the rest of the released chain, leaf first
                assert_eq!(c.lookup(&[200, 201, 202]).len(), 0, "{policy:?}");
                assert_eq!(c.lookup(&[100, 101, 102]).len(), 3, "{policy:?}");
            }
        }
    }
}

/// `release_cached` names a chain whose sequence is gone, by its hashes (or tokens): the same
/// rank. A block read again, or shared by a new sequence that lets go of it unreleased, is not
/// released any more: the conversation evidently goes on.
#[test]
fn a_released_block_read_or_shared_again_is_not_released() {
    for policy in POLICIES {
        for again in ["read", "shared", "nothing"] {
            let mut c = one_level(policy, 6);
            let (old, _) = seq_with(&mut c, 100, 3);
            c.free_sequence(old).unwrap();
            earlier_turn(&mut c, 200, 3);
            let (ended, blocks) = seq_with(&mut c, 200, 3);
            c.free_sequence(ended).unwrap();
            assert_eq!(c.release_cached(&[200, 201, 202, 203]), 3, "the chain held");
            match again {
                "read" => c.record_reads(&blocks).unwrap(),
                "shared" => {
                    let next_turn = c.add_sequence();
                    c.append_blocks(next_turn, &[200, 201, 202]).unwrap();
                    c.free_sequence(next_turn).unwrap();
                }
                _ => {}
            }
            let released = again == "nothing";
            for &b in &blocks {
                assert_eq!(c.block_released(b).unwrap(), released, "{policy:?} {again}");
            }
            seq_with(&mut c, 300, 1);
            let evicted_old = c.lookup(&[100, 101, 102]).len() == 2;
            assert_eq!(evicted_old, !released, "{policy:?} {again}");
        }
    }
    // By tokens, salted or not: the chain the same tokens (and salt) made.
    let mut c = one_level(PolicyKind::Lru, 8);
    let tokens: Vec<u32> = (0..8).collect();
    let salted = c.add_sequence_salted(Some("tenant")).unwrap();
    let plain = c.add_sequence();
    let blocks = c.append_tokens(salted, &tokens).unwrap().blocks;
    let others = c.append_tokens(plain, &tokens).unwrap().blocks;
    c.free_sequence(salted).unwrap();
    c.free_sequence(plain).unwrap();
    assert_eq!(c.release_cached_tokens(&(0..12).collect::<Vec<_>>()), 2);
    assert!(others.iter().all(|&b| c.block_released(b).unwrap()));
    assert!(blocks.iter().all(|&b| !c.block_released(b).unwrap()));
    let n = c
        .release_cached_tokens_salted(&tokens, Some("tenant"))
        .unwrap();
    assert_eq!(n, 2);
    assert!(blocks.iter().all(|&b| c.block_released(b).unwrap()));
    assert_eq!(
        c.release_cached(&[7, 8]),
        0,
        "nothing held: nothing released"
    );
    assert!(matches!(
        c.release(99),
        Err(Error::UnknownSequence { seq: 99 })
    ));
}

/// A released block another live sequence holds (a shared prefix, a fork) is not evicted
/// while it is held (eviction takes cached blocks only); when that sequence lets go, the block
/// is released as that sequence is: the last holder decides.
#[test]
fn a_released_block_a_live_sequence_shares_stays_until_it_lets_go() {
    for policy in POLICIES {
        for last_released in [false, true] {
            let mut c = one_level(policy, 6);
            let (old, _) = seq_with(&mut c, 100, 2);
            c.free_sequence(old).unwrap();
            let (ended, blocks) = seq_with(&mut c, 200, 3);
            let going_on = c.add_sequence();
            c.append_blocks(going_on, &[200, 201]).unwrap(); // shares the first two
            c.release(ended).unwrap();
            c.free_sequence(ended).unwrap();
            assert!(c.block_released(blocks[2]).unwrap());
            assert!(!c.block_released(blocks[0]).unwrap() && !c.block_released(blocks[1]).unwrap());
            // Three new blocks where one is free: the released leaf goes, then the old
            // chain's leaf (the shared prefix is held, not cached).
            seq_with(&mut c, 300, 3);
            assert_eq!(c.lookup(&[200, 201, 202]), blocks[..2], "{policy:?}");
            assert_eq!(c.lookup(&[100, 101]).len(), 1, "{policy:?}");
            // Named by `release_cached` while held: the holder still decides when it lets go.
            assert_eq!(c.release_cached(&[200, 201]), 2);
            if last_released {
                c.release(going_on).unwrap();
            }
            c.free_sequence(going_on).unwrap();
            for &b in &blocks[..2] {
                assert_eq!(c.block_released(b).unwrap(), last_released, "{policy:?}");
            }
        }
    }
}

#[test]
fn a_plan_that_makes_room_brings_nothing_up_and_the_next_plan_does() {
    // Device pools of 3 level-0 slots (and room in bytes to spare), a host behind. A live
    // block pushed to the host by a squeezed budget wants to come back; a plan making room for
    // one new level-0 block leaves it there (fetched, it would take the slot the room needs:
    // a fetch and an offload to make up for it, plan after plan, made none), the next brings it.
    let mut cfg = cfg();
    cfg.enable_compression = false;
    cfg.pressure_only = true;
    cfg.headroom = 0.0;
    cfg.recent_window = 0;
    cfg.sink_blocks = 0;
    cfg.pool_slots = vec![
        (Tier::Device, 0, 3),
        (Tier::Device, 1, 3),
        (Tier::Device, 2, 3),
    ];
    let device_bytes = 3 * (64 + 32 + 16);
    cfg.tiers = vec![
        TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(device_bytes),
        },
        TierConfig {
            tier: Tier::Host,
            budget_bytes: None,
        },
    ];
    let mut c = core(cfg);
    let (_s, blocks) = seq_with(&mut c, 1, 3);
    c.set_budget(Tier::Device, Some(2 * 64)).unwrap();
    commit(&mut c);
    let on_host = |c: &Core| {
        blocks
            .iter()
            .filter(|&&b| c.block_loc(b).unwrap().tier == Tier::Host)
            .count()
    };
    assert_eq!(on_host(&c), 1);
    c.set_budget(Tier::Device, Some(device_bytes)).unwrap();
    let plan = c.plan_with_room(64).unwrap().clone();
    assert!(
        plan.moves.iter().all(|m| m.kind != MoveKind::Fetch),
        "{plan:?}"
    );
    c.commit(plan.id).unwrap();
    assert_eq!(on_host(&c), 1);
    let plan = commit(&mut c);
    assert!(plan.moves.iter().any(|m| m.kind == MoveKind::Fetch));
    assert_eq!(on_host(&c), 0);
}
