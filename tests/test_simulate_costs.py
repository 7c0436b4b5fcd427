"""``kvtier simulate`` loads only what pays: a request's hits are the leading blocks whose loads
(their bytes over their tier's bandwidth) save the most time over recomputing them, the rule of
the vLLM connector's lookup; a hit never makes prefill slower."""

from __future__ import annotations

from functools import cache

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.simulate import SimulationConfig, build_core, run
from kvtier.traces import Trace, bundled_trace_path, load_trace


@cache
def bundled() -> Trace:
    return load_trace(bundled_trace_path())


def behind_a_remote_tier(gbps: float) -> SimulationConfig:
    """A device of 200 bf16 blocks of Llama-3-8B (64 MiB each, 16.6 ms to recompute at the
    cost model's H100) and a remote tier that holds everything, at ``gbps``."""
    return SimulationConfig(
        dtype="bf16", device_blocks=200, remote_bytes=10**13, remote_gbps=gbps, ladder=("bf16",)
    )


def remote_blocks(result: dict) -> int:
    return sum(p["blocks"] for p in result["hits_by_place"] if p["tier"] == "remote")


def test_blocks_slower_to_load_than_to_recompute_are_recomputed() -> None:
    # At 1.25 GB/s a block loads in 54 ms: slower than its recompute, so never loaded (a
    # remote block before a device one still would be, where the pair saved time: it never
    # does here, device hits being the most recent prefixes); at 100 GB/s, in 0.7 ms.
    slow, fast = (
        run(bundled(), behind_a_remote_tier(g), ["lru"])["results"][0] for g in (1.25, 100)
    )
    assert remote_blocks(slow) == 0 and remote_blocks(fast) > 10_000
    assert fast["block_hit_rate"] > 5 * slow["block_hit_rate"]
    for r in (slow, fast):
        prefill = r["prefill"]
        assert 0 < prefill["saved_s"] <= prefill["baseline_s"]
        assert "leading hits that save the most time" in prefill["cost_model"]
    # What was kept is the same either way: the rule only says which hits a request loads.
    assert slow["bytes_by_place"] == fast["bytes_by_place"]


def test_a_remote_block_is_loaded_where_it_pays_at_a_lower_level() -> None:
    # At 1.25 GB/s a bf16 block loads in 54 ms, an int4 one (a quarter of the bytes, and its
    # scales) in 15.2 ms: under the 16.6 ms recompute, so int4 blocks are loaded.
    config = SimulationConfig(
        dtype="bf16",
        device_blocks=200,
        remote_bytes=10**13,
        remote_gbps=1.25,
        ladder=("bf16", "int4"),
    )
    result = run(bundled(), config, ["lru"])["results"][0]
    remote = {p["level"] for p in result["hits_by_place"] if p["tier"] == "remote"}
    assert remote == {"int4"}


def test_costs_are_checked() -> None:
    from kvtier._core import Simulator

    trace = bundled()
    config = behind_a_remote_tier(1.25)
    core = build_core(config, "lru", ("bf16",))
    args = (trace.hash_offsets, trace.hash_ids, trace.input_lengths)
    ids = [a.astype("uint64") for a in args]
    with pytest.raises(InvalidArgumentError, match="expected both or neither"):
        Simulator(core, *ids, recompute_seconds=1e-5)
    with pytest.raises(InvalidArgumentError, match=r"expected 4 entries \(tiers x levels\)"):
        Simulator(core, *ids, recompute_seconds=1e-5, load_seconds=[0.0])
    with pytest.raises(InvalidArgumentError, match="finite seconds >= 0"):
        Simulator(core, *ids, recompute_seconds=-1.0, load_seconds=[0.0] * 4)
