"""``benchmarks/policy_lab.py``, the fast model policies are tried in before the core gets them,
is only worth trusting if it is the core's cache: under ``lru`` it must give ``kvtier
simulate``'s hits exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.simulate import SimulationConfig, run
from kvtier.traces import bundled_trace_path, load_trace

LAB_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "policy_lab.py"


def lab():
    spec = importlib.util.spec_from_file_location("policy_lab", LAB_PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("capacity", [100, 1000])
def test_the_labs_lru_is_the_cores_hit_for_hit_on_the_bundled_slice(capacity: int) -> None:
    policy_lab = lab()
    requests = policy_lab.load_trace(str(bundled_trace_path()))
    model = policy_lab.replay(requests, capacity, policy_lab.Lru())
    config = SimulationConfig(dtype="bf16", device_blocks=capacity, ladder=("bf16",))
    core = run(load_trace(bundled_trace_path()), config, ["lru:bf16"])["results"][0]
    assert (model.hits, model.refs) == (core["hit_blocks"], core["ref_blocks"])
    assert model.hits > 0


def test_age_buckets_cover_every_age_once() -> None:
    """The reuse-distance histograms' buckets (the lab's and the reference model's, as the
    core's): every age falls in exactly one, in order."""
    from kvtier.reference.frequency import age_bucket, bucket_start

    for age in [*range(64), 1000, 12345, 1 << 30]:
        b = age_bucket(age)
        assert bucket_start(b) <= age < bucket_start(b + 1)


def test_freq_beats_lru_on_the_bundled_slice_where_the_cache_is_small() -> None:
    """The lab's candidate for the adaptive default (issue 59) must at least beat recency where
    recency fails: most first-seen blocks are never read again before LRU drops them."""
    policy_lab = lab()
    requests = policy_lab.load_trace(str(bundled_trace_path()))
    for capacity in (500, 2000):
        lru = policy_lab.replay(requests, capacity, policy_lab.Lru())
        freq = policy_lab.replay(requests, capacity, policy_lab.Freq())
        assert freq.hits > 1.3 * lru.hits, capacity


def test_admit_caches_a_missed_block_only_when_it_was_missed_within_its_window() -> None:
    """The issue's `LRU + admission` peer: a block missed for the first time is not cached,
    nor is the rest of its request; missed again within the window (3 N new blocks), it is."""
    policy_lab = lab()
    cache = policy_lab.PrefixCache(10, policy_lab.Admit(window=30))
    cache.request([1, 2, 3])
    assert cache.hits == 0 and not cache.entry
    cache.request([1, 2, 4])  # 1 and 2 seen before: cached; 4 is new, so it ends there
    assert set(cache.entry) == {1, 2}
    cache.request([1, 2, 4])  # hits 1 and 2; 4 missed before: cached now
    assert cache.hits == 2 and set(cache.entry) == {1, 2, 4}
    cache.request([1, 2, 4])
    assert cache.hits == 5
    far = policy_lab.PrefixCache(10, policy_lab.Admit(window=2))
    far.request([7])
    far.request([8, 9, 10])  # three new blocks: 7's sighting falls out of a 2-block window
    far.request([7])
    assert 7 not in far.entry
