"""The Python API of ``kvtier._core`` as a user meets it: bad arguments raise clear kvtier errors
and change nothing; prefix hashes are stable and are the ones the core indexes; batch calls
release the GIL; the simulator's LRU replay agrees with the plain-Python one."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import _core
from kvtier.reference import lru, xxh3
from kvtier.reference.core import ModelCore
from kvtier.simulate import SimulationConfig, run
from kvtier.traces import bundled_trace_path, load_trace

U32, U64 = np.uint32, np.uint64


def state(core: kvtier.Core) -> dict[str, Any]:
    """Everything observable about a core, for "an error changes nothing" checks."""
    seqs = {
        s: (core.sequence_blocks(s).tolist(), core.sequence_tokens(s)) for s in core.sequences()
    }
    blocks = sorted({b for bs, _ in seqs.values() for b in bs})
    info = core.block_info(np.array(blocks, dtype=U32))
    return {
        "seqs": seqs,
        "blocks": {k: v.tolist() for k, v in info.items()},
        "usage": core.usage(),
        "counters": dict(core.counters()),
        "step": core.step,
    }


@pytest.fixture
def core() -> kvtier.Core:
    """A small core with two sequences, one cached prefix and a few statistics."""
    c = kvtier.Core([64, 32, 16], tiers=[("device", 64 * 12)], block_size=4, recent_window=4)
    s = c.add_sequence()
    c.append_blocks(s, np.arange(1, 6, dtype=U64))
    done = c.add_sequence()
    c.append_tokens(done, np.arange(10, dtype=U32))
    c.free_sequence(done)  # its two full blocks stay cached, the partial one is freed
    c.record_reads(np.array([0, 1, 1], dtype=U32))
    return c


def unchanged(core: kvtier.Core, error: type[BaseException], call: Any, *args: Any) -> str:
    before = state(core)
    with pytest.raises(error) as info:
        call(*args)
    assert state(core) == before, f"{call.__name__} raised and changed the state"
    return str(info.value)


# ---- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [np.array([0.0, 1.0]), [0.5], np.array([1, 2], dtype=np.float32)])
def test_float_ids_are_refused_naming_the_dtype(core: kvtier.Core, ids: Any) -> None:
    msg = unchanged(core, kvtier.InvalidArgumentError, core.record_reads, ids)
    assert "uint32" in msg and "blocks" in msg


@pytest.mark.parametrize("ids", [np.array([0, -1], dtype=np.int64), [-3], [2**32]])
def test_ids_out_of_the_u32_range_are_refused(core: kvtier.Core, ids: Any) -> None:
    for call in (core.record_reads, core.pin, core.block_info, core.block_places):
        msg = unchanged(core, kvtier.InvalidArgumentError, call, ids)
        assert "uint32" in msg


def test_hashes_must_be_unsigned_64_bit(core: kvtier.Core) -> None:
    seq = core.sequences()[0]
    msg = unchanged(core, kvtier.InvalidArgumentError, core.append_blocks, seq, [-1])
    assert "uint64" in msg
    unchanged(core, kvtier.InvalidArgumentError, core.lookup, np.array([1.5]))


@pytest.mark.parametrize(
    "bad",
    [np.zeros((2, 2), dtype=U32), np.zeros((1, 3), dtype=U32), np.uint32(3), "0,1", [[0, 1]]],
)
def test_arrays_must_be_one_dimensional(core: kvtier.Core, bad: Any) -> None:
    msg = unchanged(core, kvtier.InvalidArgumentError, core.record_reads, bad)
    assert "1-D" in msg or "integers" in msg


def test_lists_and_strided_views_are_converted(core: kvtier.Core) -> None:
    strided = np.array([0, 99, 1, 99], dtype=U32)[::2]
    assert not strided.flags.c_contiguous
    core.record_reads(strided)
    core.record_reads([0, 1])
    core.record_reads(np.array([], dtype=np.int64))
    core.record_reads([])
    assert core.lookup([1, 2]).tolist() == core.lookup(np.array([1, 2], dtype=U64)).tolist()


def test_mismatched_lengths_are_refused(core: kvtier.Core) -> None:
    ids = np.array([0, 1, 2], dtype=U32)
    msg = unchanged(
        core, kvtier.InvalidArgumentError, core.record_attention, ids, np.ones(2, dtype=np.float32)
    )
    assert "expected 3 values, got 2" in msg
    for call in (core.set_magnitude, core.set_learned):
        unchanged(core, kvtier.InvalidArgumentError, call, ids, np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_signal_values_must_be_finite_and_non_negative(core: kvtier.Core, value: float) -> None:
    ids = np.array([0, 1], dtype=U32)
    values = np.array([0.5, value], dtype=np.float32)
    for call in (core.record_attention, core.set_magnitude, core.set_learned):
        msg = unchanged(core, kvtier.InvalidArgumentError, call, ids, values)
        assert "finite non-negative" in msg


def test_block_places_are_block_infos_first_columns(core: kvtier.Core) -> None:
    blocks = np.array(sorted({b for s in core.sequences() for b in core.sequence_blocks(s)}), U32)
    info = core.block_info(blocks)
    tier, level, slot = core.block_places(blocks)
    assert tier.tolist() == info["tier"].tolist() and level.tolist() == info["level"].tolist()
    assert slot.tolist() == info["slot"].tolist() and len(slot) == len(blocks) > 1


def test_unknown_blocks_raise_invalid_block_error(core: kvtier.Core) -> None:
    ids = np.array([0, 1, 99], dtype=U32)
    for call in (core.record_reads, core.pin, core.unpin, core.block_info, core.block_places):
        msg = unchanged(core, kvtier.InvalidBlockError, call, ids)
        assert "unknown block 99" in msg
    unchanged(
        core, kvtier.InvalidBlockError, core.record_attention, ids, np.ones(3, dtype=np.float32)
    )
    assert issubclass(kvtier.InvalidBlockError, KeyError)  # plain Python code can catch it


def test_unpinning_more_than_was_pinned_is_refused(core: kvtier.Core) -> None:
    core.pin(np.array([0], dtype=U32))
    msg = unchanged(core, kvtier.InvalidArgumentError, core.unpin, np.array([0, 0], dtype=U32))
    assert "not pinned" in msg
    core.unpin(np.array([0], dtype=U32))


def test_unknown_sequences_raise_invalid_sequence_error(core: kvtier.Core) -> None:
    calls: list[tuple[Any, ...]] = [
        (core.append_blocks, 77, np.array([1], dtype=U64)),
        (core.append_tokens, 77, np.array([1, 2], dtype=U32)),
        (core.fork, 77),
        (core.free_sequence, 77),
        (core.sequence_blocks, 77),
        (core.sequence_tokens, 77),
    ]
    for call, *args in calls:
        msg = unchanged(core, kvtier.InvalidSequenceError, call, *args)
        assert "unknown sequence 77" in msg
    seq = core.sequences()[0]
    core.free_sequence(seq)
    unchanged(core, kvtier.InvalidSequenceError, core.free_sequence, seq)  # freed twice


def test_negative_ids_and_counts_are_invalid_arguments_that_change_nothing(
    core: kvtier.Core,
) -> None:
    seq = core.sequences()[0]
    calls: list[tuple[Any, ...]] = [
        (core.append_blocks, -1, np.array([1], dtype=U64)),
        (core.append_tokens, -1, np.array([1, 2], dtype=U32)),
        (core.extend, -1, 4),
        (core.extend, seq, -1),
        (core.fork, -1),
        (core.free_sequence, -1),
        (core.sequence_blocks, -1),
        (core.sequence_tokens, -1),
        (core.plan, -1),
        (core.commit, -1),
        (core.abort, -1),
    ]
    for call, *args in calls:
        msg = unchanged(core, kvtier.InvalidArgumentError, call, *args)
        assert "-1 is out of range: expected an integer from 0 to " in msg, msg


@pytest.mark.parametrize("big", [2**32, 2**64, 2**200])
def test_ids_and_counts_beyond_the_cores_range_are_invalid_arguments(
    core: kvtier.Core, big: int
) -> None:
    calls = [(core.extend, big, 4), (core.fork, big), (core.sequence_tokens, big)]
    for call, *args in calls:
        msg = unchanged(core, kvtier.InvalidArgumentError, call, *args)
        assert "seq: " in msg and "out of range: expected an integer from 0 to 4294967295" in msg
    msg = unchanged(core, kvtier.InvalidArgumentError, core.extend, core.sequences()[0], 2**64)
    assert "n: 18446744073709551616 is out of range" in msg


def test_append_blocks_after_a_partial_block_is_refused(core: kvtier.Core) -> None:
    seq = core.add_sequence()
    core.append_tokens(seq, np.arange(6, dtype=U32))
    msg = unchanged(
        core, kvtier.InvalidArgumentError, core.append_blocks, seq, np.array([5], dtype=U64)
    )
    assert "partial block" in msg


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "fifo"}, "unknown policy"),
        ({"compression_ratio": 1.5}, "compression_ratio"),
        ({"compression_ratio": -0.1}, "compression_ratio"),
        ({"compression_ratio": float("nan")}, "compression_ratio"),
        ({"headroom": 1.0}, "headroom"),
        ({"hysteresis": 2.0}, "hysteresis"),
        ({"decay": 0.0}, "decay"),
        ({"attention_ema": 0.0}, "attention_ema"),
        ({"weights": (0.0, 0.0, 0.0)}, "weights"),
        ({"weights": (-1.0, 1.0, 1.0)}, "weights"),
        ({"scissorhands_window": 33}, "scissorhands_window"),
        ({"block_size": 0}, "block_size"),
        ({"tiers": [("host", None)]}, "tiers"),
        ({"tiers": [("device", None), ("device", None)]}, "tiers"),
        ({"pool_slots": [("host", 0, 4)]}, "pool_slots"),
        ({"pool_slots": [("device", 5, 4)]}, "pool_slots"),
    ],
)
def test_invalid_configs_raise_config_error(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(kvtier.ConfigError, match=field):
        kvtier.Core([64, 32, 16], **kwargs)


@pytest.mark.parametrize(
    ("ladder", "field"),
    [([], "1 to 8 levels"), ([0], "drop"), ([16, 32], "non-increasing"), ([1] * 9, "1 to 8")],
)
def test_invalid_ladders_raise_config_error(ladder: list[int], field: str) -> None:
    with pytest.raises(kvtier.ConfigError, match=field):
        kvtier.Core(ladder)


def test_the_unknown_policy_error_lists_the_policies() -> None:
    with pytest.raises(kvtier.ConfigError) as info:
        kvtier.Core([64], policy="fifo")
    for name in ("importance", "lru", "lfu", "h2o", "scissorhands"):
        assert name in str(info.value)


def test_an_unknown_tier_name_is_refused() -> None:
    with pytest.raises(kvtier.ConfigError, match='tiers: unknown tier "gpu"'):
        kvtier.Core([64], tiers=[("gpu", None)])
    core = kvtier.Core([64])
    with pytest.raises(kvtier.KvtierError, match="gpu"):
        core.set_budget("gpu", 10)
    with pytest.raises(kvtier.InvalidArgumentError, match="host is not configured"):
        core.set_budget("host", 10)


def test_negative_budgets_and_sizes_are_refused_and_change_nothing(core: kvtier.Core) -> None:
    # A negative size is a ConfigError naming the field; a non-integer a TypeError (PyO3's).
    msg = unchanged(core, kvtier.ConfigError, core.set_budget, "device", -1)
    assert "budget: -1 is out of range" in msg
    for bad in (1.5, "10"):
        unchanged(core, TypeError, core.set_budget, "device", bad)
    for kwargs, field in (
        ({"tiers": [("device", -5)]}, "tiers (budget bytes)"),
        ({"max_move_bytes": -1}, "max_move_bytes"),
        ({"block_size": -16}, "block_size"),
        ({"recent_window": -1}, "recent_window"),
    ):
        with pytest.raises(kvtier.ConfigError, match=re.escape(field)):
            kvtier.Core([64], **kwargs)
    with pytest.raises(kvtier.ConfigError, match="level_bytes"):
        kvtier.Core([-64])


@pytest.mark.parametrize("big", [2**64, 10**30, 2**200])
def test_budgets_and_sizes_beyond_u64_are_config_errors_naming_the_field(
    core: kvtier.Core, big: int
) -> None:
    """Not PyO3's bare OverflowError: the error names the field and the largest value."""
    for kwargs, field in (
        ({"tiers": [("device", big)]}, "tiers (budget bytes)"),
        ({"max_move_bytes": big}, "max_move_bytes"),
        ({"pool_slots": [("device", 0, big)]}, "pool_slots"),
    ):
        with pytest.raises(kvtier.ConfigError, match=re.escape(field)) as info:
            kvtier.Core([64], **kwargs)
        assert "out of range: expected an integer from 0 to" in str(info.value)
    with pytest.raises(kvtier.ConfigError, match="level_bytes"):
        kvtier.Core([big])
    msg = unchanged(core, kvtier.ConfigError, core.set_budget, "device", big)
    assert "budget: " in msg and "out of range" in msg


# ---- plans ----------------------------------------------------------------------------------


def test_one_plan_at_a_time_and_only_the_pending_one_commits(core: kvtier.Core) -> None:
    plan = core.plan()
    msg = unchanged(core, kvtier.PlanError, core.plan)
    assert f"plan {plan.id} is still pending" in msg
    for call in (core.commit, core.abort):
        msg = unchanged(core, kvtier.PlanError, call, plan.id + 1)
        assert f"no pending plan with id {plan.id + 1}" in msg
    core.commit(plan.id)
    for call in (core.commit, core.abort):  # neither twice nor after the fact
        unchanged(core, kvtier.PlanError, call, plan.id)
    again = core.plan()
    assert again.id == plan.id + 1
    core.abort(again.id)
    assert core.counters()["aborts"] == 1 and core.counters()["plans"] == 2


def test_plan_columns_and_kinds(core: kvtier.Core) -> None:
    plan = core.plan()
    n = len(plan)
    cols = ("block", "kind", "src_tier", "src_level", "src_slot", "dst_tier", "dst_level")
    for name in (*cols, "dst_slot"):
        assert getattr(plan, name).shape == (n,)
    assert plan.block.dtype == U32 and plan.kind.dtype == np.uint8
    assert set(plan.summary()) <= set(kvtier.Plan.KINDS)
    assert sum(plan.summary().values()) == n
    assert "Plan(id=" in repr(plan)
    core.abort(plan.id)


# ---- capacity --------------------------------------------------------------------------------


def test_a_full_device_refuses_new_blocks_naming_the_budget() -> None:
    core = kvtier.Core([64], tiers=[("device", 64 * 4)], evict_on_full=False)
    seq = core.add_sequence()
    core.append_blocks(seq, np.arange(1, 4, dtype=U64))
    msg = unchanged(
        core, kvtier.OutOfCapacityError, core.append_blocks, seq, np.array([7, 8], dtype=U64)
    )
    assert "256-byte budget" in msg and "requested 128 bytes" in msg and "64 free" in msg
    # A prefix already cached needs no room: shared, not refused.
    other = core.add_sequence()
    blocks, shared = core.append_blocks(other, np.array([1, 2], dtype=U64))
    assert shared.tolist() == [True, True]
    assert core.block_info(blocks)["refcount"].tolist() == [2, 2]


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_a_full_device_evicts_cached_blocks_when_allowed(prefix_aware: bool) -> None:
    core = kvtier.Core(
        [64],
        tiers=[("device", 64 * 4)],
        evict_on_full=True,
        policy="lru",
        prefix_aware=prefix_aware,
    )
    done = core.add_sequence()
    core.append_blocks(done, np.arange(1, 5, dtype=U64))
    core.free_sequence(done)
    core.record_reads(np.array([0, 2], dtype=U32))  # blocks 1 and 3 are least recently read
    seq = core.add_sequence()
    core.append_blocks(seq, np.array([7, 8], dtype=U64))
    hashes = np.arange(1, 5, dtype=U64)
    if prefix_aware:
        # Only leaves go, least recent first: the chain 1-2-3-4 loses 4, then 3 (a leaf now).
        assert core.lookup(hashes).tolist() == [0, 1]
    else:
        # Plain LRU takes blocks 1 and 3 and strands 2 and 4 behind them.
        assert core.lookup(np.array([1], dtype=U64)).tolist() == [0]
        assert core.lookup(np.array([2], dtype=U64)).tolist() == []
    assert core.counters()["evictions"] == 2
    # Live blocks are never evicted: with nothing cached left, the device is full.
    core.append_blocks(seq, np.array([9, 10], dtype=U64))
    with pytest.raises(kvtier.OutOfCapacityError):
        core.append_blocks(seq, np.array([11], dtype=U64))


def test_a_released_chain_is_evicted_before_an_older_live_ones_chain() -> None:
    """A client that knows a conversation ended says so, ``release(seq)``: once its sequence
    is freed, its cached blocks are evicted before an older chain whose conversation goes on
    (which LRU would take first), leaf first. ``release_cached`` names a chain already freed
    by its hashes (``release_cached_tokens``: by its tokens and salt); a block read again is
    not released any more."""
    core = kvtier.Core([64], tiers=[("device", 64 * 6)], policy="lru", block_size=4)
    older = core.add_sequence()
    core.append_blocks(older, np.array([1, 2, 3], dtype=U64))
    core.free_sequence(older)
    ended = core.add_sequence()
    blocks, _ = core.append_blocks(ended, np.array([7, 8, 9], dtype=U64))
    core.release(ended)
    assert not core.block_info(blocks)["released"].any(), "released once freed"
    core.free_sequence(ended)
    assert core.block_info(blocks)["released"].all()
    new = core.add_sequence()
    core.append_blocks(new, np.array([20], dtype=U64))  # room for one: the released leaf
    assert core.lookup(np.array([7, 8, 9], dtype=U64)).tolist() == blocks[:2].tolist()
    assert len(core.lookup(np.array([1, 2, 3], dtype=U64))) == 3
    core.append_blocks(new, np.array([21, 22], dtype=U64))
    assert len(core.lookup(np.array([7, 8, 9], dtype=U64))) == 0
    assert len(core.lookup(np.array([1, 2, 3], dtype=U64))) == 3
    # A chain already cached, by hashes: it goes before the older one too, unless read again.
    assert core.release_cached(np.array([1, 2, 3, 4], dtype=U64)) == 3
    held = core.lookup(np.array([1, 2, 3], dtype=U64))
    assert core.block_info(held)["released"].all()
    core.record_reads(held[:1])
    assert core.block_info(held)["released"].tolist() == [False, True, True]
    core.free_sequence(new)  # blocks 20-22 cached, unreleased, more recent than 1-3
    core.append_blocks(core.add_sequence(), np.array([30, 31], dtype=U64))
    assert len(core.lookup(np.array([1, 2, 3], dtype=U64))) == 1
    assert len(core.lookup(np.array([20, 21, 22], dtype=U64))) == 3
    # By tokens, in the salt the sequence had; an unknown sequence is refused.
    salted = core.add_sequence(salt="tenant")
    core.append_tokens(salted, np.arange(8, dtype=U32))
    core.free_sequence(salted)
    assert core.release_cached_tokens(np.arange(8, dtype=U32)) == 0
    assert core.release_cached_tokens(np.arange(10, dtype=U32), "tenant") == 2
    with pytest.raises(kvtier.InvalidSequenceError):
        core.release(salted)


# ---- prefix hashes ----------------------------------------------------------------------------

#: ``prefix_hashes(range(32), 16)`` in the default namespace, computed once: the chain is part
#: of the on-disk / on-Redis key format, so it must never change between runs or releases.
FIXED = [0x60613E95F4B42118, 0xF1325E8B0BB9ABE5]
DEFAULT_SEED = 0x6C5B964D9473AC1A


def test_prefix_hashes_are_fixed_values() -> None:
    assert kvtier.prefix_hashes(np.arange(32, dtype=U32), 16).tolist() == FIXED
    assert kvtier.prefix_hashes(list(range(32)), 16, namespace="default").tolist() == FIXED
    assert _core.namespace_seed("default") == DEFAULT_SEED
    # A trailing partial block has no hash; the chain makes the second hash depend on the first.
    assert kvtier.prefix_hashes(np.arange(40, dtype=U32), 16).tolist() == FIXED
    assert kvtier.prefix_hashes(np.arange(15, dtype=U32), 16).tolist() == []
    assert kvtier.prefix_hashes(np.arange(16, 32, dtype=U32), 16).tolist() != FIXED[1:]


def test_prefix_hashes_are_the_same_in_another_process() -> None:
    code = (
        "import numpy as np, kvtier;"
        "print(kvtier.prefix_hashes(np.arange(32, dtype=np.uint32), 16).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    assert out.strip() == str(FIXED)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 33, 60, 64, 512])
def test_prefix_hashes_are_published_xxh3(block_size: int) -> None:
    """The chain is XXH3-64 (checked against a plain-Python transcription of the spec, every
    input length class: 4..16, 17..128, 129..240 and > 240 bytes)."""
    tokens = np.random.default_rng(block_size).integers(0, 2**32, 3 * block_size, dtype=U32)
    expected = xxh3.prefix_hashes(tokens.tolist(), block_size)
    assert kvtier.prefix_hashes(tokens, block_size).tolist() == expected
    assert xxh3.xxh3_64(b"default") == DEFAULT_SEED
    assert xxh3.namespace_seed("tenant-a") == _core.namespace_seed("tenant-a")


def test_namespaces_never_share_hashes() -> None:
    tokens = np.arange(64, dtype=U32)
    spaces = ["default", "llama-3-8b", "llama-3-8b/int8", "tenant-a", ""]
    chains = [kvtier.prefix_hashes(tokens, 16, namespace=ns).tolist() for ns in spaces]
    flat = [h for chain in chains for h in chain]
    assert len(set(flat)) == len(flat)


#: ``prefix_hashes(range(32), 16, salt="tenant-a")`` in the default namespace: salted keys are
#: a key format too.
FIXED_SALTED = [0x37B1C97212A83883, 0x3D258908B3EF8364]


def test_salted_prefix_hashes_are_fixed_values_and_none_is_no_salt() -> None:
    tokens = np.arange(32, dtype=U32)
    assert kvtier.prefix_hashes(tokens, 16, salt="tenant-a").tolist() == FIXED_SALTED
    assert kvtier.prefix_hashes(tokens, 16, "default", None).tolist() == FIXED
    assert xxh3.prefix_hashes(list(range(32)), 16, salt="tenant-a") == FIXED_SALTED
    assert xxh3.prefix_hashes(list(range(32)), 16, salt=None) == FIXED
    # The chain goes on from the salted seed, as from the namespace seed.
    seed = xxh3.salted_seed(DEFAULT_SEED, "tenant-a")
    assert FIXED_SALTED[0] == xxh3.chain_hash(seed, list(range(16)))


@pytest.mark.parametrize("salt", ["a", "ab", "abc", "abcd", "tenant-a", "é" * 3, "x" * 300])
def test_salted_prefix_hashes_are_published_xxh3(salt: str) -> None:
    """Every length class of the salted seed's input (1..3, 4..8, ..., > 240 bytes), against the
    plain-Python transcription of XXH3."""
    tokens = np.random.default_rng(len(salt)).integers(0, 2**32, 48, dtype=U32)
    for ns in ["default", "tenant-ns"]:
        want = xxh3.prefix_hashes(tokens.tolist(), 16, ns, salt=salt)
        assert kvtier.prefix_hashes(tokens, 16, ns, salt=salt).tolist() == want


def test_salts_never_share_hashes() -> None:
    """Salts against each other, against no salt, across namespaces, and against a chain whose
    first block spells the salt: all distinct."""
    tokens = np.arange(64, dtype=U32)
    chains = [
        kvtier.prefix_hashes(tokens, 16, namespace=ns, salt=salt).tolist()
        for ns in ["default", "tenant-a"]
        for salt in [None, "tenant-a", "tenant-b", "default", "a", "abcd"]
    ]
    # "abcd" as one token id: a salt's seed is never that block's hash.
    spelled = np.frombuffer(b"abcd", dtype="<u4").astype(U32)
    chains.append(kvtier.prefix_hashes(np.concatenate([spelled, tokens]), 1).tolist())
    flat = [h for chain in chains for h in chain]
    assert len(set(flat)) == len(flat)
    assert xxh3.salted_seed(DEFAULT_SEED, "abcd") != xxh3.chain_hash(DEFAULT_SEED, spelled.tolist())


@pytest.mark.parametrize("bad", ["", 7, b"tenant-a", ["a"]])
def test_a_salt_must_be_a_non_empty_str(bad: Any) -> None:
    core = kvtier.Core([64], block_size=16)
    model = ModelCore([64], block_size=16)
    tokens = np.arange(32, dtype=U32)
    for call in [
        lambda: core.add_sequence(bad),
        lambda: core.add_sequence(salt=bad),
        lambda: core.lookup_tokens(tokens, bad),
        lambda: kvtier.prefix_hashes(tokens, 16, salt=bad),
        lambda: model.add_sequence(bad),
        lambda: model.lookup_tokens(tokens.tolist(), bad),
        lambda: xxh3.prefix_hashes(tokens.tolist(), 16, salt=bad),
    ]:
        with pytest.raises(kvtier.InvalidArgumentError, match="invalid salt: expected a non-empty"):
            call()
    assert core.sequences() == [] and model.sequences() == []


def test_salted_sequences_share_within_their_salt_only() -> None:
    core = kvtier.Core([64], block_size=16, namespace="tenants")
    tokens = np.arange(1000, 1040, dtype=U32)  # 2 full blocks and a partial one
    seqs = {salt: core.add_sequence(salt) for salt in [None, "tenant-a", "tenant-b"]}
    for salt, seq in seqs.items():
        got, shared = core.append_tokens(seq, tokens)
        assert not shared.any(), salt
        hashes = kvtier.prefix_hashes(tokens, 16, namespace="tenants", salt=salt)
        assert core.block_info(got)["hash"].tolist() == [*hashes.tolist(), 0]
        assert core.lookup_tokens(tokens, salt).tolist() == got.tolist()[:2]
        assert core.lookup_tokens(tokens, salt=salt).tolist() == got.tolist()[:2]
    assert core.lookup_tokens(tokens).tolist() == core.sequence_blocks(seqs[None]).tolist()[:2]
    assert core.lookup_tokens(tokens, "tenant-c").tolist() == []
    again = core.add_sequence(salt="tenant-b")
    got, shared = core.append_tokens(again, tokens[:32])
    assert shared.tolist() == [True, True]
    assert got.tolist() == core.sequence_blocks(seqs["tenant-b"]).tolist()[:2]
    # A fork keeps the salt: its next block is indexed in the salted chain.
    child, _ = core.fork(again)
    core.append_tokens(child, tokens[:16])
    longer = np.concatenate([tokens[:32], tokens[:16]])
    assert len(core.lookup_tokens(longer, "tenant-b")) == 3
    assert len(core.lookup_tokens(longer)) == 2


def test_prefix_hashes_refuse_a_zero_block_size() -> None:
    with pytest.raises(kvtier.InvalidArgumentError, match="block_size"):
        kvtier.prefix_hashes(np.arange(4, dtype=U32), 0)


@pytest.mark.parametrize("namespace", ["default", "tenant-b"])
def test_append_tokens_indexes_the_prefix_hashes(namespace: str) -> None:
    core = kvtier.Core([64], block_size=16, namespace=namespace)
    tokens = np.arange(1000, 1056, dtype=U32)  # 3 full blocks and a partial one
    seq = core.add_sequence()
    core.append_tokens(seq, tokens[:20])  # a block boundary falls inside a call
    core.append_tokens(seq, tokens[20:])
    blocks = core.sequence_blocks(seq).tolist()
    hashes = kvtier.prefix_hashes(tokens, 16, namespace=namespace)
    assert core.block_info(np.array(blocks, dtype=U32))["hash"].tolist() == [*hashes.tolist(), 0]
    assert core.lookup(hashes).tolist() == blocks[:3]
    assert core.lookup_tokens(tokens).tolist() == blocks[:3]
    assert core.lookup_tokens(tokens[:40]).tolist() == blocks[:2]
    # Another request with the same first 32 tokens shares those two blocks.
    other = core.add_sequence()
    got, shared = core.append_tokens(other, np.concatenate([tokens[:32], [7] * 16]).astype(U32))
    assert got.tolist()[:2] == blocks[:2] and shared.tolist() == [True, True, False]
    # And a core in another namespace finds nothing.
    stranger = kvtier.Core([64], block_size=16, namespace=namespace + "-x")
    stranger.append_tokens(stranger.add_sequence(), tokens)
    assert stranger.lookup(hashes).tolist() == []


# ---- the GIL ----------------------------------------------------------------------------------


def test_two_batch_calls_on_two_cores_run_while_python_runs() -> None:
    """Two threads each run a long ``record_reads`` on their own core while the main thread
    counts in pure Python, noting the time every 256 iterations. A call that held the GIL
    would freeze the counter for its whole duration: the 10 ms slices inside the calls would
    see no iteration. (Counting iterations alone proves nothing: every GIL hand-off between the
    threads gives the counter a 5 ms slice, tens of thousands of iterations, even when each call
    holds the GIL throughout.) Robust to a loaded 2-core machine: released, nearly every slice
    sees iterations; held, almost none does."""
    cores, ids = [], []
    for _ in range(2):
        core = kvtier.Core([64])
        blocks, _ = core.append_blocks(core.add_sequence(), np.arange(1, 50_001, dtype=U64))
        cores.append(core)
        ids.append(np.resize(blocks, 20_000_000))
    started = threading.Barrier(3)
    finished = [threading.Event(), threading.Event()]
    windows: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]

    def work(i: int) -> None:
        started.wait()
        t0 = time.perf_counter()
        cores[i].record_reads(ids[i])
        windows[i] = (t0, time.perf_counter())
        finished[i].set()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()
    ticks, samples, clock = 0, [], time.perf_counter
    while not (finished[0].is_set() and finished[1].is_set()):
        ticks += 1
        if ticks % 256 == 0:
            samples.append(clock())
    for t in threads:
        t.join()
    slice_s = 0.01
    inside = set()  # whole 10 ms slices during which a batch call was running
    for t0, t1 in windows:
        inside |= set(range(int(t0 / slice_s) + 1, int(t1 / slice_s)))
    seen = {int(t / slice_s) for t in samples}
    assert len(inside) >= 3, f"the calls were too short to tell: {windows}"
    share = len(inside & seen) / len(inside)
    assert share > 0.5, f"Python ran in only {share:.0%} of the slices during the batch calls"
    for core in cores:
        assert core.counters()["live_blocks"] == 50_000


# ---- the simulator ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "importance"])
@pytest.mark.parametrize("capacity", [20, 300])
def test_simulated_replay_equals_the_model_replaying_call_for_call(
    capacity: int, policy: str
) -> None:
    """20 blocks: some requests do not fit at all (rejected, their hits still counted). Under
    ``importance`` the replay runs long enough for the measured reuse distances to set its
    ages and its chances of a reuse (see ``kvtier.reference.frequency``; at 300 blocks, of the
    first four classes), and the model follows them hit for hit."""
    trace = load_trace(bundled_trace_path()).head(1000)
    cfg = SimulationConfig(device_blocks=capacity, ladder=("fp16",))
    result = run(trace, cfg, policies=[policy])["results"][0]
    expected = lru.model_replay(trace, capacity, policy=policy)
    assert (capacity == 20) == (expected["rejected"] > 0)
    if policy == "importance" and capacity == 300:
        assert expected["ranked_classes"] >= 4
    assert (result["hit_blocks"], result["ref_blocks"], result["rejected_requests"]) == (
        expected["hit_blocks"],
        expected["ref_blocks"],
        expected["rejected"],
    )


def test_the_default_policy_hits_more_than_lru_where_the_cache_is_small_and_no_less_where_not() -> (
    None
):
    """``importance`` (the default) measures reuse on a trace with no other signal: on the
    bundled slice it hits over 1.4 times what LRU does at 500 and 2,000 blocks (most first-seen
    blocks are never read again before LRU drops them), and no less at 10,000 (README's
    bundled-slice table has the figures beside vLLM's policies)."""
    trace = load_trace(bundled_trace_path())
    for capacity, ratio in ((500, 1.4), (2000, 1.4), (10000, 1.0)):
        cfg = SimulationConfig(device_blocks=capacity, ladder=("fp16",))
        lru_, importance = run(trace, cfg, policies=["lru", "importance"])["results"]
        assert importance["hit_blocks"] >= ratio * lru_["hit_blocks"], capacity


def test_a_full_device_offloads_to_a_host_with_room_and_evicts_nothing() -> None:
    # The device holds one request and a block more: each request's new blocks need room made
    # first. With a host tier behind it, room is made by offloading, so every block ever seen
    # stays cached: the hits are exactly the references to blocks seen before.
    trace = load_trace(bundled_trace_path()).head(1000)
    device = int(np.diff(trace.hash_offsets).max()) + 1
    tiered = SimulationConfig(device_blocks=device, host_bytes=10**15, ladder=("fp16",))
    result = run(trace, tiered, policies=["lru"])["results"][0]
    assert result["moves"]["evictions"] == 0
    assert result["moves"]["offloads"] > 0
    assert result["hit_blocks"] == len(trace.hash_ids) - len(np.unique(trace.hash_ids))
    alone = SimulationConfig(device_blocks=device, ladder=("fp16",))
    assert run(trace, alone, policies=["lru"])["results"][0]["hit_blocks"] < result["hit_blocks"]


@pytest.mark.parametrize("capacity", [300, 3000])
def test_simulated_lru_equals_the_plain_python_lru(capacity: int) -> None:
    trace = load_trace(bundled_trace_path())
    cfg = SimulationConfig(device_blocks=capacity, ladder=("fp16",))
    result, aware = run(trace, cfg, policies=["plain-lru", "lru"])["results"]
    expected = lru.lru_replay(trace, capacity)
    # Leaf-first eviction strands nothing, so it hits at least as often as plain LRU.
    assert aware["hit_blocks"] >= expected["hit_blocks"]
    assert result["rejected_requests"] == 0  # every request fits at these capacities
    assert (result["hit_blocks"], result["ref_blocks"]) == (
        expected["hit_blocks"],
        expected["ref_blocks"],
    )
    assert result["hit_tokens"] == expected["hit_tokens"]
    # Evictions may differ slightly: the core references a request's cached blocks before it
    # makes room for its new ones, so it never evicts a block the request is about to use (a
    # cached child whose parent was evicted); the plain LRU can, and then re-inserts it.


def test_the_timeline_is_the_same_with_or_without_a_progress_bar() -> None:
    # With progress the replay returns to Python 20 times; without, once. The core samples the
    # timeline itself, so both give the same points, and the last one is the final result.
    trace = load_trace(bundled_trace_path()).head(1000)
    cfg = SimulationConfig(device_blocks=300, host_bytes=10**12, ladder=("fp16", "int8", "int4"))
    calls: list[tuple[int, int]] = []
    drawn = run(trace, cfg, progress=lambda done, total: calls.append((done, total)))
    quiet = run(trace, cfg)
    assert len(calls) == 20 and calls[-1] == (1000, 1000)
    timeline = quiet["results"][0]["timeline"]
    assert drawn["results"][0]["timeline"] == timeline
    assert timeline["request"] == [*range(5, 1001, 5)]
    result = quiet["results"][0]
    assert timeline["block_hit_rate"][-1] == result["block_hit_rate"]
    held = dict.fromkeys(result["ladder"], 0)
    for place in result["bytes_by_place"]:
        held[place["level"]] += place["bytes"]
    assert {name: b[-1] for name, b in timeline["bytes_by_level"].items()} == held
    assert held["int8"] > 0 and held["int4"] > 0  # the importance ladder at work
    assert timeline["time_s"][-1] == (trace.timestamps_ms[999] - trace.timestamps_ms[0]) / 1e3
