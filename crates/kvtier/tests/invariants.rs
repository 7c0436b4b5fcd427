//! Property tests of the core's invariants under random operation sequences: pools never hand a
//! slot out twice and `used + free == capacity`; per-tier bytes equal the bytes of slots in use;
//! a committed plan never leaves a tier over its budget; pinned blocks never move; a shared
//! block moves at most once per plan; freeing everything (and evicting) restores the empty state.
//!
//! Prefix-aware, under every policy: no indexed block is stranded (its ancestors are all
//! indexed, up to a root), the per-pool reclaimable counts equal a brute-force count (cached
//! blocks whose whole subtree is cached), and an append never fails while cached, unpinned
//! blocks hold the room it needs.
//!
//! Released chains (`release`, `release_cached`) change only which leaf goes first: every
//! invariant above holds with them.
//!
//! The index log: replayed onto the indexed hashes before each operation (a block that left
//! is gone, one that moved lies in its new tier), it gives the indexed hashes after it, but for
//! those newly indexed (which it does not log).

use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

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
    /// A plan that makes room for this many new level-0 blocks (then committed or aborted),
    /// keeping the cached blocks of these hashes (a prompt's cached prefix).
    PlanRoom(u64, bool, Vec<u64>),
    /// A live sequence's conversation ends (`release`), or a cached chain's (`release_cached`).
    Release(usize),
    ReleaseCached(Vec<u64>),
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
        2 => (1..8u64, any::<bool>(), prop::collection::vec(0..24u64, 0..4))
            .prop_map(|(n, commit, keep)| Op::PlanRoom(n, commit, keep)),
        1 => (0..8usize).prop_map(Op::Release),
        1 => prop::collection::vec(0..24u64, 1..6).prop_map(Op::ReleaseCached),
    ]
}

fn config(
    policy: PolicyKind,
    evict_on_full: bool,
    host: bool,
    write_through: bool,
    pools: bool,
) -> Config {
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
    // Fixed slots per pool, as the Python BlockManager gives them (its pressure pass 4).
    let pool_slots = if pools {
        // Small: the levels below fill up, and room is made by evicting into their slots.
        let mut slots = vec![
            (Tier::Device, 0, 6),
            (Tier::Device, 1, 3),
            (Tier::Device, 2, 5),
        ];
        if host {
            slots.extend([(Tier::Host, 0, 3), (Tier::Host, 1, 2), (Tier::Host, 2, 4)]);
        }
        slots
    } else {
        Vec::new()
    };
    Config {
        block_size: 4,
        level_bytes: vec![64, 32, 16],
        tiers,
        policy,
        recent_window: 4,
        evict_on_full,
        write_through,
        max_move_bytes: Some(64 * 6),
        pool_slots,
        pool_headroom: pools,
        ..Config::default()
    }
}

/// Whether each block is cached (unreferenced, unpinned, not in the pending plan, holding a
/// slot), with `also_referenced` counted as referenced.
fn cached_blocks(core: &Core, also_referenced: &HashSet<u32>) -> HashSet<u32> {
    let moving: HashSet<u32> = core
        .pending_plan()
        .map(|p| {
            p.moves
                .iter()
                .filter(|m| m.kind != MoveKind::Backup)
                .map(|m| m.block)
                .collect()
        })
        .unwrap_or_default();
    (0..core.num_block_ids() as u32)
        .filter(|&b| {
            core.block_loc(b)
                .is_ok_and(|loc| loc.slot != kvtier::NO_SLOT)
                && core.block_refcount(b).unwrap() == 0
                && !core.block_pinned(b).unwrap()
                && !moving.contains(&b)
                && !also_referenced.contains(&b)
        })
        .collect()
}

/// Blocks eviction (leaf after leaf) can free: cached, with every indexed descendant cached.
fn reclaimable_blocks(core: &Core, cached: &HashSet<u32>) -> HashSet<u32> {
    let mut children: std::collections::HashMap<u32, Vec<u32>> = Default::default();
    for b in 0..core.num_block_ids() as u32 {
        if let Ok(Some(p)) = core.block_parent(b) {
            children.entry(p).or_default().push(b);
        }
    }
    fn all_cached(
        b: u32,
        cached: &HashSet<u32>,
        children: &std::collections::HashMap<u32, Vec<u32>>,
    ) -> bool {
        cached.contains(&b)
            && children
                .get(&b)
                .is_none_or(|cs| cs.iter().all(|&c| all_cached(c, cached, children)))
    }
    cached
        .iter()
        .copied()
        .filter(|&b| all_cached(b, cached, &children))
        .collect()
}

/// No indexed block is stranded: following parents from any indexed block reaches a root
/// through indexed blocks only; and the core's reclaimable counts are the brute-force ones.
fn check_tree(core: &Core) {
    let n = core.num_block_ids() as u32;
    for b in 0..n {
        if !core.block_indexed(b).unwrap_or(false) {
            continue;
        }
        let (mut at, mut steps) = (b, 0u32);
        while let Some(p) = core.block_parent(at).unwrap() {
            assert!(
                core.block_indexed(p).unwrap(),
                "block {b} stranded: {p} not indexed"
            );
            at = p;
            steps += 1;
            assert!(steps <= n, "a cycle through block {b}");
        }
    }
    let reclaimable = reclaimable_blocks(core, &cached_blocks(core, &HashSet::new()));
    for (tier, level, count, _) in core.reclaimable() {
        let want = reclaimable
            .iter()
            .filter(|&&b| {
                let loc = core.block_loc(b).unwrap();
                (loc.tier, loc.level) == (tier, level)
            })
            .count() as u64;
        assert_eq!(count, want, "reclaimable blocks in {tier}/{level}");
    }
}

/// Whether an append of `hashes` fits once every reclaimable device block is evicted (what
/// `evict_on_full` may do): the blocks it shares are referenced first.
fn room_exists(core: &Core, hashes: &[u64]) -> bool {
    let shared: HashSet<u32> = hashes
        .iter()
        .filter_map(|&h| core.lookup(&[h]).first().copied())
        .collect();
    let missing = hashes
        .iter()
        .filter(|&&h| core.lookup(&[h]).is_empty())
        .count() as u64;
    let reclaimable = reclaimable_blocks(core, &cached_blocks(core, &shared));
    let cfg = core.config();
    let on_device: Vec<kvtier::Loc> = reclaimable
        .iter()
        .map(|&b| core.block_loc(b).unwrap())
        .filter(|l| l.tier == Tier::Device)
        .collect();
    let freed_bytes: u64 = on_device
        .iter()
        .map(|l| cfg.level_bytes[usize::from(l.level)])
        .sum();
    let freed_slots = on_device.iter().filter(|l| l.level == 0).count() as u64;
    let usage = core.usage();
    let pool0 = usage
        .iter()
        .find(|u| u.tier == Tier::Device && u.level == 0)
        .unwrap();
    let free0 = u64::from(pool0.capacity_slots - pool0.used_slots);
    let budget = cfg.tiers[0].budget_bytes.unwrap_or(u64::MAX);
    let need = missing * cfg.level_bytes[0];
    missing <= free0 + freed_slots && core.tier_bytes()[0] + need <= budget + freed_bytes
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

/// Replays the index log onto `model` (indexed hashes and their tiers, as the log told them),
/// adds the hashes newly indexed since, and checks the result is what the core indexes.
fn check_index_log(
    core: &mut Core,
    model: &mut HashMap<u64, Tier>,
) -> std::result::Result<(), TestCaseError> {
    for change in core.take_index_log() {
        match change.tier {
            None => {
                model.remove(&change.hash);
            }
            Some(tier) => {
                if let Some(t) = model.get_mut(&change.hash) {
                    *t = tier;
                }
            }
        }
    }
    let indexed: HashMap<u64, Tier> = core
        .indexed_blocks()
        .into_iter()
        .map(|b| {
            let hash = core
                .block_hash(b)
                .unwrap()
                .expect("an indexed block has a hash");
            (hash, core.block_loc(b).unwrap().tier)
        })
        .collect();
    for (&hash, &tier) in &indexed {
        model.entry(hash).or_insert(tier);
    }
    prop_assert_eq!(&*model, &indexed, "the index log replayed != the index");
    Ok(())
}

fn run(ops: Vec<Op>, cfg: Config) -> std::result::Result<(), TestCaseError> {
    let mut core = Core::new(cfg.clone()).unwrap();
    core.set_index_log(true);
    let mut logged: HashMap<u64, Tier> = HashMap::new();
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
                    let room = cfg.prefix_aware && cfg.evict_on_full && room_exists(&core, &hashes);
                    match core.append_blocks(seq, &hashes) {
                        Ok(_) => {}
                        Err(e @ (Error::OutOfCapacity { .. } | Error::OutOfSlots { .. })) => {
                            prop_assert!(
                                !room,
                                "append refused while cached blocks held the room: {e}"
                            );
                        }
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
            Op::Release(s) => {
                if let Some(seq) = pick(&seqs, s) {
                    core.release(seq).unwrap();
                }
            }
            Op::ReleaseCached(hashes) => {
                let held = core.lookup(&hashes).len();
                prop_assert_eq!(core.release_cached(&hashes), held);
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
            Op::PlanCommit | Op::PlanAbort | Op::PlanRoom(..) => {
                let before = core.tier_bytes().to_vec();
                let (usage, released) = (core.usage(), core.counters().released);
                let kept: Vec<u32> = match &op {
                    Op::PlanRoom(_, _, hashes) => {
                        hashes.iter().flat_map(|&h| core.lookup(&[h])).collect()
                    }
                    _ => Vec::new(),
                };
                let plan = match op {
                    Op::PlanRoom(n, ..) => core.plan_keeping(n * cfg.level_bytes[0], &kept),
                    _ => core.plan(),
                }
                .unwrap()
                .clone();
                check_state(&core);
                let mut seen = HashSet::new();
                for m in &plan.moves {
                    prop_assert!(
                        !(kept.contains(&m.block) && m.kind == MoveKind::Evict),
                        "kept block {} evicted",
                        m.block
                    );
                    prop_assert!(!pinned.contains(&m.block), "pinned block {} moved", m.block);
                    if m.kind != MoveKind::Backup {
                        prop_assert!(
                            seen.insert(m.block),
                            "block {} moved twice in one plan",
                            m.block
                        );
                    }
                }
                if matches!(op, Op::PlanCommit | Op::PlanRoom(_, true, _)) {
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
                    // No copy ran: every block stays where it was, a block evicted to give its
                    // slot on included.
                    core.abort(plan.id).unwrap();
                    prop_assert_eq!(
                        core.tier_bytes(),
                        &before[..],
                        "abort changed the bytes held"
                    );
                    prop_assert_eq!(core.usage(), usage, "abort changed the pools");
                    prop_assert_eq!(core.counters().released, released, "abort released blocks");
                }
            }
        }
        check_state(&core);
        if cfg.prefix_aware {
            check_tree(&core);
        }
        check_index_log(&mut core, &mut logged)?;
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
    // Leaf-first eviction under the move cap (demotions go first) takes a few plans for a
    // long chain, but every plan makes progress.
    for _ in 0..64 {
        if core.live_blocks() == 0 {
            break;
        }
        let id = core.plan().unwrap().id;
        core.commit(id).unwrap();
        check_index_log(&mut core, &mut logged)?;
    }
    prop_assert!(
        logged.is_empty(),
        "the index log left {} hashes",
        logged.len()
    );
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
        pools in any::<bool>(),
        prefix_aware in any::<bool>(),
    ) {
        let cfg = Config { prefix_aware, ..config(policy, evict, host, write_through, pools) };
        run(ops, cfg)?;
    }
}
