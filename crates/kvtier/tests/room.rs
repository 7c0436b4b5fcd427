//! A write never fails while room exists (`ARCHITECTURE.md`: `OutOfCapacityError` means the
//! live sequences do not fit in all the tiers together), on a core set up as the Python
//! `BlockManager` sets one up: fixed slots per (tier, level) pool in the device, host and disk
//! tiers, `pool_headroom`, allocations that evict nothing at once. Random appends, frees and
//! steps; an append the core refuses is retried as the manager retries it (a plan with room for
//! its blocks, committed, then the append again, evicting cached blocks where the config allows
//! eviction), and the retry must succeed whenever the live blocks and the new ones fit in the
//! pools of all the tiers together ([`room_problem`]).

use proptest::prelude::*;
use std::collections::HashMap;

use kvtier::{Config, Core, Error, PolicyKind, Tier, TierConfig};

const LEVEL_BYTES: [u64; 3] = [64, 32, 16];
/// Plans a write's room may take, as `BlockManager._make_room` runs them.
const ROOM_ROUNDS: usize = 8;

#[derive(Debug, Clone)]
enum Op {
    Add,
    /// This many new blocks (hashes never seen) at the end of a sequence.
    Append(usize, usize),
    Free(usize),
    /// A scheduler step: a plan, committed.
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Add),
        6 => (0..4usize, 1..4usize).prop_map(|(s, n)| Op::Append(s, n)),
        1 => (0..4usize).prop_map(Op::Free),
        2 => Just(Op::Step),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    policy: PolicyKind,
    host: bool,
    disk: bool,
    recent_window: u32,
    sink_blocks: u32,
    write_through: bool,
    evict_on_full: bool,
}

fn config(s: &Setup) -> Config {
    let mut pool_slots = vec![
        (Tier::Device, 0, 4),
        (Tier::Device, 1, 3),
        (Tier::Device, 2, 3),
    ];
    if s.host {
        pool_slots.extend([(Tier::Host, 0, 3), (Tier::Host, 1, 2), (Tier::Host, 2, 3)]);
    }
    if s.disk {
        pool_slots.extend([(Tier::Disk, 0, 3), (Tier::Disk, 1, 2), (Tier::Disk, 2, 2)]);
    }
    // Each tier's budget is what its pools hold when full, as the manager's layout gives it.
    let tiers = [Tier::Device, Tier::Host, Tier::Disk]
        .into_iter()
        .filter(|&t| pool_slots.iter().any(|p| p.0 == t))
        .map(|tier| TierConfig {
            tier,
            budget_bytes: Some(
                pool_slots
                    .iter()
                    .filter(|p| p.0 == tier)
                    .map(|p| u64::from(p.2) * LEVEL_BYTES[usize::from(p.1)])
                    .sum(),
            ),
        })
        .collect();
    Config {
        block_size: 4,
        level_bytes: LEVEL_BYTES.to_vec(),
        tiers,
        policy: s.policy,
        recent_window: s.recent_window,
        sink_blocks: s.sink_blocks,
        write_through: s.write_through && s.host,
        evict_on_full: false,
        pool_slots,
        pool_headroom: true,
        ..Config::default()
    }
}

/// Live blocks (referenced by a sequence) by (tier, level, pinned).
fn live_places(core: &Core) -> HashMap<(Tier, u8, bool), i64> {
    let mut places = HashMap::new();
    for b in 0..core.num_block_ids() as u32 {
        let Ok(loc) = core.block_loc(b) else { continue };
        if core.block_refcount(b).unwrap() == 0 {
            continue; // cached: an eviction may take it
        }
        let key = (loc.tier, loc.level, core.block_pinned(b).unwrap());
        *places.entry(key).or_insert(0) += 1;
    }
    places
}

/// Why the live blocks and `new` new ones cannot all lie in the pools at once, or None when
/// they can: new blocks (and pinned ones) in the device's level-0 slots where they are written,
/// every other live block in any tier at its own level or a lower one (a lossy level cannot go
/// back up). An assignment with nested choices: possible exactly when, for each level `l`, the
/// blocks that must lie at level `l` or lower are no more than the free slots there (Hall).
fn room_problem(core: &Core, new: i64) -> Option<String> {
    let mut free: HashMap<(Tier, u8), i64> = core
        .usage()
        .iter()
        .map(|u| ((u.tier, u.level), i64::from(u.capacity_slots)))
        .collect();
    let mut movable = vec![0i64; LEVEL_BYTES.len()];
    for ((tier, level, pinned), n) in live_places(core) {
        if pinned {
            *free.get_mut(&(tier, level)).unwrap() -= n;
        } else {
            movable[usize::from(level)] += n;
        }
    }
    let device0 = free[&(Tier::Device, 0)];
    if new > device0 {
        return Some(format!(
            "{new} new blocks, {device0} free level-0 device slots"
        ));
    }
    for level in 0..LEVEL_BYTES.len() {
        let slots: i64 = free
            .iter()
            .filter(|((_, l), _)| usize::from(*l) >= level)
            .map(|(_, n)| n)
            .sum();
        let need = movable[level..].iter().sum::<i64>() + if level == 0 { new } else { 0 };
        if need > slots {
            return Some(format!(
                "{need} blocks for levels >= {level}, {slots} slots there"
            ));
        }
    }
    None
}

fn run(ops: Vec<Op>, setup: &Setup) -> std::result::Result<(), TestCaseError> {
    let mut core = Core::new(config(setup)).unwrap();
    let mut seqs: Vec<u32> = Vec::new();
    let mut next_hash = 0u64;
    for op in ops {
        match op {
            Op::Add => seqs.push(core.add_sequence()),
            Op::Append(s, n) => {
                let Some(&seq) = seqs.get(s % seqs.len().max(1)) else {
                    continue;
                };
                let hashes: Vec<u64> = (0..n)
                    .map(|_| {
                        next_hash += 1;
                        next_hash
                    })
                    .collect();
                match core.append_blocks(seq, &hashes) {
                    Ok(_) => {}
                    Err(Error::OutOfCapacity { .. } | Error::OutOfSlots { .. }) => {
                        // What the manager does: a plan that makes room (it may evict cached
                        // leaves where the config allows), committed, then the append again.
                        let problem = room_problem(&core, n as i64);
                        let before = live_places(&core);
                        // Plans one after another, each taking the slots the last freed
                        // (a cascade), while each moves something, as the manager runs them.
                        let mut retry = Err(Error::InvalidArgument {
                            what: "room",
                            reason: "no plan ran".into(),
                        });
                        for _ in 0..ROOM_ROUNDS {
                            core.set_evict_on_full(setup.evict_on_full);
                            let plan = core.plan_with_room(n as u64 * LEVEL_BYTES[0]).unwrap();
                            let (id, moved) =
                                (plan.id, !plan.moves.is_empty() || !plan.released.is_empty());
                            core.set_evict_on_full(false);
                            core.commit(id).unwrap();
                            core.set_evict_on_full(setup.evict_on_full);
                            retry = core.append_blocks(seq, &hashes);
                            core.set_evict_on_full(false);
                            if retry.is_ok() || !moved {
                                break;
                            }
                        }
                        if let Err(e) = retry {
                            prop_assert!(
                                problem.is_some() || !setup.evict_on_full,
                                "{n} new blocks refused after a plan with room, though they fit \
                                 in the tiers: {e}; live blocks by (tier, level, pinned) before \
                                 the plan {before:?}, after {:?}; pools {:?}",
                                live_places(&core),
                                core.usage()
                            );
                        }
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                }
            }
            Op::Free(s) => {
                if !seqs.is_empty() {
                    let seq = seqs.remove(s % seqs.len());
                    core.free_sequence(seq).unwrap();
                }
            }
            Op::Step => {
                let id = core.plan().unwrap().id;
                core.commit(id).unwrap();
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn a_write_is_refused_only_when_the_live_blocks_do_not_fit_in_the_tiers(
        ops in prop::collection::vec(op(), 1..50),
        policy in prop::sample::select(vec![PolicyKind::Importance, PolicyKind::Lru]),
        host in any::<bool>(),
        disk in any::<bool>(),
        recent_window in prop::sample::select(vec![0u32, 4, 8]),
        sink_blocks in 0u32..2,
        write_through in any::<bool>(),
        evict_on_full in any::<bool>(),
    ) {
        let setup = Setup { policy, host, disk, recent_window, sink_blocks, write_through, evict_on_full };
        run(ops, &setup)?;
    }
}
