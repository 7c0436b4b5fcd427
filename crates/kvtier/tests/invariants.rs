//! Property tests of the core's invariants under random operation sequences: pools never hand a
//! slot out twice and `used + free == capacity`; per-tier bytes equal the bytes of slots in use;
//! a committed plan never leaves a tier over its budget; pinned blocks never move; a shared
//! block moves at most once per plan; freeing everything (and evicting) restores the empty state.

use proptest::prelude::*;
use std::collections::HashSet;

use kvtier::{Config, Core, Error, MoveKind, PolicyKind, Tier, TierConfig};

#[derive(Debug, Clone)]
enum Op {
    Add,
    AppendBlocks(usize, Vec<u64>),
    AppendTokens(usize, Vec<u32>),
    Fork(usize),
    Free(usize),
    Read(Vec<usize>),
    Attention(Vec<(usize, u8)>),
    Pin(usize),
    Unpin(usize),
    PlanCommit,
    PlanAbort,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Add),
        4 => (0..8usize, prop::collection::vec(0..24u64, 1..6)).prop_map(|(s, h)| Op::AppendBlocks(s, h)),
        2 => (0..8usize, prop::collection::vec(0..5u32, 1..12)).prop_map(|(s, t)| Op::AppendTokens(s, t)),
        1 => (0..8usize).prop_map(Op::Fork),
        2 => (0..8usize).prop_map(Op::Free),
        2 => prop::collection::vec(0..64usize, 1..10).prop_map(Op::Read),
        1 => prop::collection::vec((0..64usize, 0..100u8), 1..8).prop_map(Op::Attention),
        1 => (0..64usize).prop_map(Op::Pin),
        1 => (0..64usize).prop_map(Op::Unpin),
        3 => Just(Op::PlanCommit),
        1 => Just(Op::PlanAbort),
    ]
}

fn config(policy: PolicyKind, evict_on_full: bool, host: bool, write_through: bool) -> Config {
    let mut tiers = vec![TierConfig {
        tier: Tier::Device,
        budget_bytes: Some(40 * 64),
    }];
    if host {
        tiers.push(TierConfig {
            tier: Tier::Host,
            budget_bytes: Some(40 * 32),
        });
    }
    Config {
        block_size: 4,
        level_bytes: vec![64, 32, 16],
        tiers,
        policy,
        recent_window: 4,
        evict_on_full,
        write_through,
        max_move_bytes: Some(64 * 6),
        ..Config::default()
    }
}

/// Checks the bookkeeping invariants that must hold between any two calls.
fn check_state(core: &Core) {
    let usage = core.usage();
    let cfg = core.config();
    for (t, tc) in cfg.tiers.iter().enumerate() {
        let bytes: u64 = usage
            .iter()
            .filter(|u| u.tier == tc.tier)
            .map(|u| u.bytes)
            .sum();
        assert_eq!(
            bytes,
            core.tier_bytes()[t],
            "tier bytes out of step with pools"
        );
    }
    for u in &usage {
        assert!(u.used_slots <= u.capacity_slots);
    }
    // No slot is held by two blocks (copies included).
    let mut held = HashSet::new();
    let mut slots_held = 0u64;
    for b in 0..core.num_block_ids() as u32 {
        let Ok(loc) = core.block_loc(b) else { continue };
        for l in [Some(loc), core.block_copy(b).unwrap()]
            .into_iter()
            .flatten()
        {
            if l.slot != kvtier::NO_SLOT {
                assert!(
                    held.insert((l.tier, l.level, l.slot)),
                    "slot {l:?} held twice"
                );
                slots_held += 1;
            }
        }
    }
    let plan_slots: u64 = core
        .pending_plan()
        .map(|p| {
            p.moves
                .iter()
                .filter(|m| m.dst.is_some_and(|d| d.slot != kvtier::NO_SLOT))
                .count() as u64
        })
        .unwrap_or(0);
    let used: u64 = usage.iter().map(|u| u64::from(u.used_slots)).sum();
    assert_eq!(
        used,
        slots_held + plan_slots,
        "pool slots in use != slots held by blocks and plans"
    );
}

fn run(ops: Vec<Op>, cfg: Config) -> std::result::Result<(), TestCaseError> {
    let mut core = Core::new(cfg.clone()).unwrap();
    let mut seqs: Vec<u32> = Vec::new();
    let mut pinned: Vec<u32> = Vec::new();
    let pick = |v: &Vec<u32>, i: usize| {
        if v.is_empty() {
            None
        } else {
            Some(v[i % v.len()])
        }
    };
    for op in ops {
        let live_blocks: Vec<u32> = (0..core.num_block_ids() as u32)
            .filter(|&b| core.block_loc(b).is_ok())
            .collect();
        match op {
            Op::Add => seqs.push(core.add_sequence()),
            Op::AppendBlocks(s, hashes) => {
                if let Some(seq) = pick(&seqs, s) {
                    match core.append_blocks(seq, &hashes) {
                        Ok(_) | Err(Error::OutOfCapacity { .. } | Error::OutOfSlots { .. }) => {}
                        Err(Error::InvalidArgument { .. }) => {} // sequence ends in a partial block
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
            }
            Op::AppendTokens(s, tokens) => {
                if let Some(seq) = pick(&seqs, s) {
                    match core.append_tokens(seq, &tokens) {
                        Ok(_) | Err(Error::OutOfCapacity { .. } | Error::OutOfSlots { .. }) => {}
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
            }
            Op::Fork(s) => {
                if let Some(seq) = pick(&seqs, s) {
                    if let Ok(f) = core.fork(seq) {
                        seqs.push(f.child);
                    }
                }
            }
            Op::Free(s) => {
                if let Some(seq) = pick(&seqs, s) {
                    core.free_sequence(seq).unwrap();
                    seqs.retain(|&x| x != seq);
                }
            }
            Op::Read(ids) => {
                let ids: Vec<u32> = ids.iter().filter_map(|&i| pick(&live_blocks, i)).collect();
                core.record_reads(&ids).unwrap();
            }
            Op::Attention(pairs) => {
                let (ids, mass): (Vec<u32>, Vec<f32>) = pairs
                    .iter()
                    .filter_map(|&(i, m)| pick(&live_blocks, i).map(|b| (b, f32::from(m))))
                    .unzip();
                core.record_attention(&ids, &mass).unwrap();
            }
            Op::Pin(i) => {
                if let Some(b) = pick(&live_blocks, i) {
                    core.pin(&[b]).unwrap();
                    pinned.push(b);
                }
            }
            Op::Unpin(i) => {
                if let Some(b) = pick(&pinned, i) {
                    core.unpin(&[b]).unwrap();
                    let at = pinned.iter().position(|&x| x == b).unwrap();
                    pinned.swap_remove(at);
                }
            }
            Op::PlanCommit | Op::PlanAbort => {
                let before = core.tier_bytes().to_vec();
                let plan = core.plan().unwrap().clone();
                check_state(&core);
                let mut seen = HashSet::new();
                for m in &plan.moves {
                    prop_assert!(!pinned.contains(&m.block), "pinned block {} moved", m.block);
                    if m.kind != MoveKind::Backup {
                        prop_assert!(
                            seen.insert(m.block),
                            "block {} moved twice in one plan",
                            m.block
                        );
                    }
                }
                if matches!(op, Op::PlanCommit) {
                    core.commit(plan.id).unwrap();
                    for (t, tc) in cfg.tiers.iter().enumerate() {
                        if let Some(budget) = tc.budget_bytes {
                            if before[t] <= budget {
                                prop_assert!(
                                    core.tier_bytes()[t] <= budget,
                                    "tier {t} over budget after commit"
                                );
                            }
                        }
                    }
                } else {
                    core.abort(plan.id).unwrap();
                    prop_assert_eq!(
                        core.tier_bytes(),
                        &before[..],
                        "abort changed the bytes held"
                    );
                }
            }
        }
        check_state(&core);
    }
    // Free everything: only cached blocks remain, and evicting them empties every pool.
    if !pinned.is_empty() {
        core.unpin(&pinned).unwrap();
    }
    for seq in seqs {
        core.free_sequence(seq).unwrap();
    }
    for b in 0..core.num_block_ids() as u32 {
        if core.block_loc(b).is_ok() {
            prop_assert_eq!(core.block_refcount(b).unwrap(), 0);
        }
    }
    core.set_budget(Tier::Device, Some(0)).unwrap();
    if cfg.tiers.len() > 1 {
        core.set_budget(Tier::Host, Some(0)).unwrap();
    }
    for _ in 0..4 {
        let id = core.plan().unwrap().id;
        core.commit(id).unwrap();
    }
    prop_assert_eq!(
        core.live_blocks(),
        0,
        "blocks left after freeing and evicting everything"
    );
    prop_assert!(core.usage().iter().all(|u| u.used_slots == 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn invariants_hold(
        ops in prop::collection::vec(op(), 1..60),
        policy in prop::sample::select(vec![PolicyKind::Importance, PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::H2o, PolicyKind::Scissorhands]),
        evict in any::<bool>(),
        host in any::<bool>(),
        write_through in any::<bool>(),
    ) {
        run(ops, config(policy, evict, host, write_through))?;
    }
}
