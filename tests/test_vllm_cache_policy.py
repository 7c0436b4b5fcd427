"""``KvtierCachePolicy``: kvtier's core as the eviction policy of vLLM's own CPU offloading tier,
driven through vLLM's real ``CPUOffloadingManager`` (as its ``OffloadingConnector``'s scheduler
side drives it: :func:`kvtier.peers.vllm_replay`), on the bundled Mooncake slice and by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_simulate_peers import bundled

from kvtier._core import Simulator
from kvtier.bench.tiering import ChunkGeometry, replay
from kvtier.peers import vllm_replay
from kvtier.simulate import SimulationConfig, build_core
from kvtier.traces import Trace

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("no_kvtier_env")]

MODULE = "kvtier.integrations.vllm"


def simulated_hits(trace: Trace, policy: str, capacity: int) -> tuple[list[int], int]:
    """Each request's hit blocks in ``kvtier simulate``'s replay (bf16 only, ``capacity``
    blocks): the cumulative hits its timeline samples after every request, differenced; and
    the requests whose new blocks it refused."""
    config = SimulationConfig(dtype="bf16", device_blocks=capacity, ladder=("bf16",))
    sim = Simulator(
        build_core(config, policy, ("bf16",)),
        trace.hash_offsets.astype(np.uint64),
        trace.hash_ids.astype(np.uint64),
        trace.input_lengths.astype(np.uint64),
        timeline_every=1,
    )
    sim.run(len(trace))
    cumulative = [hits for _, hits, _, _ in sim.timeline()]
    return np.diff([0, *cumulative]).tolist(), sim.stats()["rejected"]


@pytest.mark.parametrize(
    ("policy", "capacity"),
    [("importance", 30), ("importance", 300), ("importance", 2000), ("lru", 300), ("lru", 2000)],
)
def test_vllms_manager_with_kvtiers_policy_hits_what_simulate_hits(
    policy: str, capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request by request, the same hits as ``kvtier simulate`` of the same policy (the default
    ``importance``, or ``KVTIER_POLICY``'s) and capacity: the policy evicts what the core
    evicts, a request's own prefix never, and a request whose new blocks do not fit beside its
    prefix stores none of them (at 30 blocks, a quarter of the requests)."""
    if policy != "importance":
        monkeypatch.setenv("KVTIER_POLICY", policy)
    trace = bundled()
    run = vllm_replay(trace, "vllm-kvtier", capacity)
    hits, rejected = simulated_hits(trace, policy, capacity)
    assert run.hits.tolist() == hits
    assert run.rejected == rejected and (rejected > 0) == (capacity == 30)
    assert run.evicted_own_prefix == 0
    assert run.held.max() == capacity  # full, and never over


def manager(chunks: int) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(
        num_chunks=chunks, cache_policy="KvtierCachePolicy", cache_policy_module_path=MODULE
    )


def keys_of(name: str, n: int) -> list[Any]:
    """A chain of ``n`` keys (block hashes named after ``name``), KV-cache group 0."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{name}{i}".encode(), 0) for i in range(n)]


def context(name: str, keys: list[Any], params: dict[str, Any] | None = None) -> Any:
    """A request's context as the scheduler makes it: each key's end-token position."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=name, kv_transfer_params=params)
    for i, key in enumerate(keys, start=1):
        ctx.set_offload_key_position(key, 16 * i)
    return ctx


def store(m: Any, name: str, keys: list[Any], params: dict[str, Any] | None = None) -> Any:
    """One request storing ``keys`` whole and finishing; returns what its store evicted."""
    ctx = context(name, keys, params)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    assert out is not None, f"{name}: cannot store"
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return out.evicted_keys


def test_eviction_takes_leaves_spares_what_is_read_and_is_all_or_nothing() -> None:
    """Asked for victims (vLLM's ``evict(n, protected)``), the policy gives leaves of the
    prefix trees only, never a chunk being read (vLLM's ``ref_cnt``, pinned in the core) nor a
    protected one, and gives ``n`` or nothing."""
    m = manager(6)
    policy = m._policy  # the manager's own instance of it
    a, b = keys_of("a", 4), keys_of("b", 2)
    store(m, "a", a)
    store(m, "b", b)
    # With a's first three chunks being loaded, its leaf a3 may go, nothing above it.
    reader = context("reader", a[:3])
    m.prepare_load(a[:3], reader)
    assert policy.evict(4, set()) is None  # a3, b1, b0, then nothing: none goes
    assert policy.evict(2, {b[1]}) is None  # a3, then b0 only under a protected leaf
    assert all(policy.get(k) is not None for k in a + b)
    gone = policy.evict(3, set())
    assert gone is not None and {k for k, _ in gone} == {a[3], b[1], b[0]}
    assert [policy.get(k) is not None for k in a] == [True, True, True, False]


def test_a_store_that_finds_no_room_changes_nothing() -> None:
    """vLLM's store of three new chunks into a full tier whose only free leaves are two: refused
    (``prepare_store`` returns None), and everything held is still held and still evictable."""
    m = manager(4)
    a = keys_of("a", 4)
    store(m, "a", a)
    reader = context("reader", a[:2])
    m.prepare_load(a[:2], reader)
    c = keys_of("c", 3)
    ctx = context("c", c)
    m.on_new_request(ctx)
    assert m.prepare_store(c, ctx) is None
    m.on_request_finished(ctx)
    m.complete_load(a[:2], reader)
    assert all(m.lookup(k, ctx).name == "HIT" for k in a)
    assert set(store(m, "d", keys_of("d", 4))) == set(a)


def test_a_released_chain_goes_before_an_older_live_one() -> None:
    """A request whose ``kv_transfer_params`` say ``{"kvtier": {"release": true}}`` ends its
    conversation: its chain is evicted first, though another chain is older."""
    m = manager(6)
    old, ended, new = keys_of("old", 2), keys_of("ended", 2), keys_of("new", 2)
    store(m, "old", old)
    store(m, "ended", ended, {"kvtier": {"release": True}})
    assert store(m, "new", new) == []  # room for all three
    assert set(store(m, "next", keys_of("next", 2))) == set(ended)


def test_a_failed_store_leaves_the_rest_consistent() -> None:
    """vLLM's store fails (``complete_store(success=False)``): its chunks leave the tier and the
    core; what was held before stays, and later stores fill the tier to the last chunk."""
    m = manager(5)
    a = keys_of("a", 3)
    store(m, "a", a)
    b = a + keys_of("b", 2)
    ctx = context("b", b)
    m.on_new_request(ctx)
    out = m.prepare_store(b[3:], ctx)
    assert out is not None and out.keys_to_store == b[3:]
    m.complete_store(out.keys_to_store, ctx, success=False)
    m.on_request_finished(ctx)
    assert [m.lookup(k, ctx).name for k in b] == ["HIT"] * 3 + ["MISS"] * 2
    assert store(m, "c", keys_of("c", 2)) == []  # the failed store's chunks are free again
    assert set(store(m, "d", keys_of("d", 5))) == set(a) | set(keys_of("c", 2))


def test_through_vllms_tiering_manager_too_and_with_a_tier_behind() -> None:
    """The same policy as the primary tier of vLLM's ``TieringOffloadingManager`` (over a real
    ``SharedOffloadRegion``, the chunks' bytes written into it): alone, it hits what ``kvtier
    simulate`` hits; with a tier behind it (vLLM's example tier, which keeps every chunk the
    primary stores), chunks it evicted come back on a hit through vLLM's promotion path: more
    hits."""
    trace = bundled()
    geometry = ChunkGeometry(layers=1, kv_heads=1, head_dim=64)
    alone, _ = replay(trace, geometry, 300, policy="kvtier")
    assert alone.tolist() == simulated_hits(trace, "importance", 300)[0]
    behind, _ = replay(trace, geometry, 300, policy="kvtier", tiers=[{"type": "example"}])
    assert behind.sum() > 1.5 * alone.sum()
