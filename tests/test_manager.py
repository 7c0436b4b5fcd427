"""BlockManager: what a custom engine relies on — exact K/V at level 0, the codec's own error
after demotion, exact again after a promotion from a write-through copy, prefix sharing, forks,
capacity, bad input that changes nothing, and threads."""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
from kvtier import (  # noqa: E402
    BlockLostError,
    BlockManager,
    ConfigError,
    InvalidArgumentError,
    InvalidSequenceError,
    KvtierConfig,
    OutOfCapacityError,
)
from kvtier._core import Plan  # noqa: E402
from kvtier.codecs import BlockShape, get_codec  # noqa: E402

LAYERS, HEADS, DIM, BS = 3, 2, 32, 16


def manager(device: str = "cpu", dtype: Any = torch.float16, **cfg: Any) -> BlockManager:
    base: dict[str, Any] = {"block_size": BS, "recent_window": 32, "device_blocks": 64}
    base.update(cfg)
    return BlockManager(KvtierConfig(**base), LAYERS, HEADS, DIM, dtype, device)


def kv(tokens: int, seed: int, device: str = "cpu", dtype: Any = torch.float16) -> Any:
    """K and V for every layer: ``[layers, 2, tokens, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, tokens, HEADS, DIM, generator=g).to(device, dtype)


def append_all(bm: BlockManager, seq: int, x: Any, chunks: list[int] | None = None) -> None:
    chunks = chunks or [x.shape[2]]
    at = 0
    for n in chunks:
        for layer in range(LAYERS):
            bm.append(seq, layer, x[layer, 0, at : at + n], x[layer, 1, at : at + n])
        at += n


def assert_gathers(bm: BlockManager, seq: int, x: Any) -> None:
    """What gather returns is each block's own K/V, bit for bit: exactly at level 0; below it
    as its codec reproduces it, encoded at its level at once or at levels above first and
    transcoded down (the tiers demote a level or more at a time, transcoding natively)."""
    for layer in range(LAYERS):
        k, v = bm.gather(seq, layer)
        assert k.is_contiguous() and v.is_contiguous() and k.dtype == x.dtype
        tokens = bm.num_tokens(seq, layer)
        assert k.shape == v.shape == (tokens, HEADS, DIM)
        m = -(-tokens // BS)
        levels = bm.core.block_info(bm.core.sequence_blocks(seq)[:m])["level"].tolist()
        full = torch.zeros(LAYERS, 2, m * BS, HEADS, DIM, dtype=x.dtype, device=x.device)
        full[:, :, :tokens] = x[:, :, :tokens]
        # [m, layers, 2, heads, block, dim], the codecs' block layout
        as_blocks = full.reshape(LAYERS, 2, m, BS, HEADS, DIM).permute(2, 0, 1, 4, 3, 5)
        got = torch.zeros(2, m * BS, HEADS, DIM, dtype=k.dtype)
        got[0, :tokens], got[1, :tokens] = k, v
        got = got.unflatten(1, (m, BS))  # [2, m, block, heads, dim]
        for level in set(levels):
            pick = [i for i, lv in enumerate(levels) if lv == level]
            ways = []
            for path in _demotions(level):
                blocks = as_blocks[pick].contiguous()
                if path:
                    encoded = bm.codecs[path[0]].encode(blocks)
                    for above, below in itertools.pairwise(path):
                        encoded = bm.codecs[above].transcode(encoded, bm.codecs[below])
                    blocks = bm.codecs[path[-1]].decode(encoded)
                # [n, 2, heads, block, dim] -> [2, n, block, heads, dim], as `got` is
                ways.append(blocks[:, layer].permute(1, 0, 3, 2, 4))
            for j, i in enumerate(pick):
                assert any(torch.equal(got[:, i], way[:, j]) for way in ways), (layer, i, level)


def _demotions(level: int) -> list[list[int]]:
    """The ways down to ``level``: the levels a block was encoded at, in order (none: level 0)."""
    if level == 0:
        return [[]]
    above = range(1, level)
    return [[*p, level] for n in range(level) for p in itertools.combinations(above, n)]


def assert_close_blocks(got: Any, want: Any) -> None:
    """Each block of gathered K or V ``[tokens, heads, dim]`` is its own data, perhaps through a
    lossy level: cosine > 0.97 with the original block. A block holding another block's K/V,
    or garbage, fails."""
    n = got.shape[0]
    m = -(-n // BS)
    pad = (0, 0, 0, 0, 0, m * BS - n)
    a = torch.nn.functional.pad(got.float(), pad).reshape(m, -1)
    b = torch.nn.functional.pad(want.float(), pad).reshape(m, -1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    assert bool((cos > 0.97).all()), cos


def levels_of(bm: BlockManager, seq: int) -> list[int]:
    return bm.core.block_info(bm.core.sequence_blocks(seq))["level"].tolist()


def snapshot(bm: BlockManager) -> tuple[Any, ...]:
    stats = bm.get_compression_stats()
    pools = {key: pool.clone() for key, pool in bm.pools.items()}
    seqs = {s: bm.num_tokens(s, 0) for s in bm.sequences()}
    return stats, pools, seqs, bm.core.counters()


def assert_same(
    a: tuple[Any, ...], b: tuple[Any, ...], *, planned: int = 0, aborted: int = 0
) -> None:
    """Equal stats, pools and sequences; ``planned`` plans (that moved nothing), ``aborted`` of
    them aborted, allowed."""
    counters = dict(b[3], plans=b[3]["plans"] - planned, aborts=b[3]["aborts"] - aborted)
    stats = dict(b[0], counters=dict(b[0]["counters"], **counters))
    assert a[0] == stats and a[2] == b[2] and a[3] == counters
    for key in a[1]:
        assert torch.equal(a[1][key].view(torch.uint8), b[1][key].view(torch.uint8)), key


# -- correctness -----------------------------------------------------------------------------------


def test_level_0_gives_back_exactly_what_was_written_in_any_chunking() -> None:
    bm = manager(enable_compression=False)
    x = kv(83, seed=1)
    seq = bm.add_sequence()
    append_all(bm, seq, x, [1, 15, 16, 40, 11])
    assert bm.num_tokens(seq) == 83
    for layer in range(LAYERS):
        k, v = bm.gather(seq, layer)
        assert torch.equal(k, x[layer, 0]) and torch.equal(v, x[layer, 1])


def test_numpy_and_other_dlpack_producers_are_accepted() -> None:
    bm = manager(enable_compression=False)
    x = kv(20, seed=2)
    seq = bm.add_sequence()
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0].numpy(), x[layer, 1].numpy())
    assert torch.equal(bm.gather(seq, 2)[0], x[2, 0])


def test_after_demotions_gather_returns_what_the_codec_reproduces() -> None:
    bm = manager()
    x = kv(200, seed=3)
    seq = bm.add_sequence()
    append_all(bm, seq, x, [120, 80])
    bm.step()
    levels = levels_of(bm, seq)
    # sink and the 32-token recent window (the last 2 full blocks + the partial one) stay fp16;
    # the rest is split between int8 and int4
    assert levels[0] == 0 and levels[-3:] == [0, 0, 0]
    assert {1, 2} <= set(levels[1:-3])
    assert_gathers(bm, seq, x)
    # and the error is the codec's: int4 keys stay close to the originals
    k, _ = bm.gather(seq, 0)
    cos = torch.nn.functional.cosine_similarity(k.float().flatten(), x[0, 0].float().flatten(), 0)
    assert cos > 0.98


def test_a_promotion_from_a_write_through_copy_restores_the_original_exactly() -> None:
    bm = manager(write_through=True, host_blocks=64, recent_window=64)
    x = kv(12 * BS, seed=4)
    ids = np.arange(12 * BS) + 1000
    a = bm.add_sequence(ids)
    assert bm.num_tokens(a) == 0  # nothing cached yet
    append_all(bm, a, x)
    bm.step()
    assert max(levels_of(bm, a)) > 0
    stats = bm.get_compression_stats()
    assert stats["backups"] == stats["demotions"] > 0
    host = sum(p["bytes"] for p in stats["pools"] if p["tier"] == "host")
    assert host == stats["backups"] * bm.level_bytes[0], "the copies are level-0 blocks on the host"
    bm.free(a)
    # A new prompt reusing the first 8 blocks: their tail is now in its recent window.
    b = bm.add_sequence(ids[: 8 * BS])
    assert bm.num_tokens(b) == 8 * BS
    before = levels_of(bm, b)
    bm.step()
    after = levels_of(bm, b)
    assert any(lb > 0 and la == 0 for lb, la in zip(before, after, strict=True))
    assert bm.get_compression_stats()["promotions"] > 0
    assert_gathers(bm, b, x[:, :, : 8 * BS])
    # the promoted blocks are exact
    promoted = [i for i, (lb, la) in enumerate(zip(before, after, strict=True)) if lb and not la]
    k, _ = bm.gather(b, 1)
    for i in promoted:
        assert torch.equal(k[i * BS : (i + 1) * BS], x[1, 0, i * BS : (i + 1) * BS])


def test_a_cached_prefix_is_shared_and_not_written_again() -> None:
    bm = manager(enable_compression=False)
    x = kv(5 * BS + 3, seed=5)
    ids = np.arange(5 * BS + 3)
    a = bm.add_sequence(ids)
    append_all(bm, a, x)
    assert bm.lookup(ids) == 5 * BS
    assert bm.lookup(ids[: 2 * BS + 7]) == 2 * BS
    assert bm.lookup(ids + 1) == 0
    held = bm.stats().held_bytes
    b = bm.add_sequence(ids[: 3 * BS + 4])
    assert bm.num_tokens(b) == 3 * BS
    rest = x[:, :, 3 * BS : 3 * BS + 4]
    append_all(bm, b, rest)
    assert bm.stats().held_bytes == held + bm.level_bytes[0]  # only the partial block is new
    assert bm.get_compression_stats()["hits"] == 3
    for layer in range(LAYERS):
        k, _ = bm.gather(b, layer)
        assert torch.equal(k, x[layer, 0, : 3 * BS + 4])


def test_a_salted_prefix_is_shared_within_its_salt_only() -> None:
    bm = manager(enable_compression=False)
    ids = np.arange(3 * BS + 5) + 500
    x = {salt: kv(3 * BS + 5, seed=i) for i, salt in enumerate([None, "tenant-a", "tenant-b"])}
    seqs = {}
    for salt, kvs in x.items():
        seqs[salt] = bm.add_sequence(ids, salt=salt)
        assert bm.num_tokens(seqs[salt]) == 0, f"{salt} found another salt's blocks"
        append_all(bm, seqs[salt], kvs)
    blocks = {salt: set(bm.core.sequence_blocks(s).tolist()) for salt, s in seqs.items()}
    assert not (blocks[None] & blocks["tenant-a"] or blocks[None] & blocks["tenant-b"])
    assert not blocks["tenant-a"] & blocks["tenant-b"]
    for salt in x:
        assert bm.lookup(ids, salt=salt) == 3 * BS
    assert bm.lookup(ids) == 3 * BS and bm.lookup(ids, salt="tenant-c") == 0
    # Within a salt, a prompt shares as without salts, and reads its own salt's K/V.
    for salt, kvs in x.items():
        again = bm.add_sequence(ids[: 2 * BS + 1], salt=salt)
        assert bm.num_tokens(again) == 2 * BS
        assert set(bm.core.sequence_blocks(again)[:2].tolist()) <= blocks[salt]
        for layer in range(LAYERS):
            assert torch.equal(bm.gather(again, layer)[1], kvs[layer, 1, : 2 * BS])
    # A fork keeps its parent's salt: the blocks it completes serve that salt only.
    child = bm.fork(seqs["tenant-a"])
    more = np.arange(BS - 5) + 9000
    bm.add_tokens(child, more)
    append_all(bm, child, kv(BS - 5, seed=9))
    longer = np.concatenate([ids, more])
    assert bm.lookup(longer, salt="tenant-a") == 4 * BS
    assert bm.lookup(longer) == 3 * BS and bm.lookup(longer, salt="tenant-b") == 3 * BS


def test_a_salt_must_be_a_non_empty_str() -> None:
    bm = manager()
    ids = np.arange(2 * BS)
    append_all(bm, bm.add_sequence(ids), kv(2 * BS, seed=3))
    before = snapshot(bm)
    for bad in ["", 7, b"tenant", ["tenant"]]:
        with pytest.raises(InvalidArgumentError, match="salt"):
            bm.add_sequence(ids, salt=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="salt"):
            bm.lookup(ids, salt=bad)  # type: ignore[arg-type]
    assert_same(before, snapshot(bm))
    assert bm.sequences() == [0]


def test_a_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    bm = manager(enable_compression=False)
    x = kv(2 * BS + 5, seed=6)
    parent = bm.add_sequence()
    append_all(bm, parent, x)
    child = bm.fork(parent)
    assert bm.num_tokens(child) == 2 * BS + 5
    y = kv(3, seed=7)
    append_all(bm, child, y)
    for layer in range(LAYERS):
        kp, _ = bm.gather(parent, layer)
        kc, _ = bm.gather(child, layer)
        assert torch.equal(kp, x[layer, 0])
        assert torch.equal(kc, torch.cat([x[layer, 0], y[layer, 0]]))
    bm.free(parent)
    assert torch.equal(bm.gather(child, 0)[0][: 2 * BS + 5], x[0, 0])


def test_clearing_the_prefix_cache_frees_what_is_cached_and_keeps_live_sequences_whole() -> None:
    """A reset: no later prompt shares what was stored; cached blocks are freed at once, a live
    sequence still reads its own K/V and is not cached when freed."""
    bm = manager(enable_compression=False)
    cached_ids, live_ids = np.arange(4 * BS), np.arange(1000, 1000 + 3 * BS + 5)
    cached, live = bm.add_sequence(cached_ids), bm.add_sequence(live_ids)
    x, y = kv(4 * BS, seed=1), kv(3 * BS + 5, seed=2)
    append_all(bm, cached, x)
    append_all(bm, live, y)
    bm.free(cached)
    held = bm.stats().held_bytes
    assert bm.lookup(cached_ids) == 4 * BS and bm.lookup(live_ids) == 3 * BS
    assert bm.clear_prefix_cache() == 4 + 3  # the indexed blocks: every full one
    assert bm.lookup(cached_ids) == 0 and bm.lookup(live_ids) == 0
    assert bm.stats().held_bytes == held - 4 * bm.level_bytes[0]
    for layer in range(LAYERS):
        k, v = bm.gather(live, layer)
        assert torch.equal(k, y[layer, 0]) and torch.equal(v, y[layer, 1])
    bm.free(live)
    assert bm.stats().held_bytes == 0 and bm.clear_prefix_cache() == 0


def test_freeing_everything_returns_every_slot() -> None:
    bm = manager()
    seqs = [bm.add_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        append_all(bm, s, kv(70 + i, seed=i))
    bm.step()
    for s in seqs:
        bm.free(s)
    assert bm.stats().held_bytes == 0  # anonymous blocks are never cached
    with pytest.raises(InvalidSequenceError):
        bm.gather(seqs[0], 0)


# -- signals ---------------------------------------------------------------------------------------


def test_attention_reports_decide_which_blocks_keep_int8() -> None:
    bm = manager(weights=(0.0, 0.0, 1.0), recent_window=16)
    x = kv(12 * BS, seed=8)
    seq = bm.add_sequence()
    append_all(bm, seq, x)
    weights = torch.zeros(HEADS, 1, 12 * BS)
    weights[:, :, 5 * BS : 6 * BS] = 1.0  # block 5 gets all the attention
    bm.record_attention(seq, 0, weights)
    bm.step()
    levels = levels_of(bm, seq)
    assert levels[5] == 1
    assert levels.count(2) > 0
    with pytest.raises(InvalidArgumentError, match="last axis of 192 tokens"):
        bm.record_attention(seq, 0, torch.zeros(3))


class _RecordsAttention:
    """Forwards to the real core and keeps what ``record_attention`` hands it."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.reports: list[tuple[list[int], list[float]]] = []

    def record_attention(self, blocks: Any, mass: Any) -> None:
        self.reports.append((np.asarray(blocks).tolist(), np.asarray(mass).tolist()))
        self._core.record_attention(blocks, mass)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def test_a_block_is_credited_the_sum_of_its_tokens_attention() -> None:
    bm = manager()
    seq = bm.add_sequence()
    append_all(bm, seq, kv(2 * BS + 4, seed=3))  # two full blocks and a partial one of 4 tokens
    recorder = _RecordsAttention(bm.core)
    bm.core = recorder
    weights = torch.zeros(HEADS, 2, 2 * BS + 4)
    weights[:, :, 1] = 0.25  # two tokens of block 0
    weights[:, :, 7] = 0.5
    weights[0, 0, BS + 3] = 0.8  # one head and one query of four: a mean of 0.2 over them
    weights[:, :, 2 * BS :] = 0.05  # every token of the partial block
    bm.record_attention(seq, 0, weights)
    [(blocks, mass)] = recorder.reports
    assert blocks == bm.core.sequence_blocks(seq).tolist()
    # Summed over each block's tokens (not averaged over them), averaged over heads and queries.
    assert mass == pytest.approx([0.75, 0.2, 0.2])


def test_learned_scores_need_one_finite_score_per_block() -> None:
    bm = manager(weights=(0.0, 1.0, 0.0), recent_window=16)
    seq = bm.add_sequence()
    append_all(bm, seq, kv(10 * BS, seed=9))
    scores = np.zeros(10)
    scores[3] = 5.0
    bm.set_learned_scores(seq, scores)
    bm.step()
    assert levels_of(bm, seq)[3] == 1
    with pytest.raises(InvalidArgumentError, match="expected 10 finite scores"):
        bm.set_learned_scores(seq, np.zeros(4))


# -- stats -----------------------------------------------------------------------------------------


def test_stats_are_the_real_pool_occupancy() -> None:
    bm = manager(recent_window=16)
    seq = bm.add_sequence()
    append_all(bm, seq, kv(20 * BS, seed=10))
    bm.step()
    st = bm.stats()
    levels = levels_of(bm, seq)
    by_level = [levels.count(lv) for lv in range(3)]
    assert [p.blocks for p in st.pools] == by_level
    assert st.held_bytes == sum(n * b for n, b in zip(by_level, bm.level_bytes, strict=True))
    assert st.level0_bytes == 20 * bm.level_bytes[0]
    d = bm.get_compression_stats()
    assert d["memory_saved_mb"] == pytest.approx((st.level0_bytes - st.held_bytes) / 1e6)
    assert d["avg_compression_ratio"] > 1.5
    assert d["demotions"] == sum(by_level[1:])
    text = st.to_prometheus()
    assert 'kvtier_pool_blocks{tier="device",level="2",codec="int4"} ' + str(by_level[2]) in text
    assert "# TYPE kvtier_moves_total counter" in text


def test_the_original_designs_variables_configure_the_manager() -> None:
    cfg = KvtierConfig.from_env(
        environ={"VLLM_KV_COMPRESSION_LEVELS": "2", "KVTIER_DEVICE_BLOCKS": "8"}
    )
    bm = BlockManager(cfg, LAYERS, HEADS, DIM, torch.float16, "cpu")
    assert bm.ladder == ("fp16", "int8")
    assert bm.slots["device", 0] == 4  # half of 8 level-0 blocks
    off = KvtierConfig.from_env(environ={"VLLM_ENABLE_KV_COMPRESSION": "0"}, device_blocks=8)
    assert BlockManager(off, LAYERS, HEADS, DIM, "fp16", "cpu").ladder == ("fp16",)


# -- capacity --------------------------------------------------------------------------------------


def test_a_full_device_refuses_an_append_naming_the_budget_and_writes_nothing() -> None:
    bm = manager(device_blocks=4, enable_compression=False)  # 4 level-0 slots, nothing else
    seq = bm.add_sequence()
    x = kv(5 * BS, seed=11)
    append_all(bm, seq, x[:, :, : 4 * BS])
    before = snapshot(bm)
    with pytest.raises(OutOfCapacityError, match="budget"):
        bm.append(seq, 0, x[0, 0, 4 * BS :], x[0, 1, 4 * BS :])
    # The append let one plan try to make room; it could not, so it was aborted: nothing moved.
    assert_same(before, snapshot(bm), planned=1, aborted=1)


def test_a_full_device_offloads_to_the_host_instead_of_failing() -> None:
    bm = manager(device_blocks=8, host_blocks=64, recent_window=16)
    seq = bm.add_sequence()
    x = kv(40 * BS, seed=12)
    append_all(bm, seq, x, [BS] * 40)  # far more than the device holds
    stats = bm.get_compression_stats()
    assert stats["offloads"] > 0
    assert sum(p["blocks"] for p in stats["pools"] if p["tier"] == "host") > 0
    assert_gathers(bm, seq, x)


def test_a_prefill_beyond_the_headroom_offloads_cached_blocks_instead_of_failing() -> None:
    bm = manager(device_blocks=8, host_blocks=64, recent_window=16, enable_compression=False)
    ids = np.arange(8 * BS)
    a = bm.add_sequence(ids)
    x = kv(8 * BS, seed=15)
    append_all(bm, a, x)
    bm.free(a)  # eight cached blocks fill the device
    b = bm.add_sequence()
    y = kv(6 * BS, seed=16)
    append_all(bm, b, y)  # one prefill of six blocks: far more than the headroom frees
    stats = bm.get_compression_stats()
    assert stats["offloads"] >= 6
    assert stats["evictions"] == 0
    assert_gathers(bm, b, y)
    c = bm.add_sequence(ids)  # the old prompt is still cached, on the host
    assert bm.num_tokens(c, 0) == 8 * BS
    assert_gathers(bm, c, x)


def test_evict_on_full_makes_room_from_cached_blocks() -> None:
    bm = manager(device_blocks=4, enable_compression=False, evict_on_full=True)
    ids = np.arange(4 * BS)
    a = bm.add_sequence(ids)
    append_all(bm, a, kv(4 * BS, seed=13))
    bm.free(a)  # 4 cached blocks fill the device
    b = bm.add_sequence()
    x = kv(2 * BS, seed=14)
    append_all(bm, b, x)
    assert bm.get_compression_stats()["evictions"] == 2
    assert torch.equal(bm.gather(b, 1)[0], x[1, 0])


def test_a_released_conversation_is_evicted_before_an_older_one_that_goes_on() -> None:
    """A multi-turn client says when a conversation ends (``release``): its blocks are evicted
    first once freed, before those of an older conversation, which LRU alone would take;
    ``release_cached`` does it for one already freed, by its tokens. A later prompt that
    shares a released prefix takes it back (the conversation went on)."""
    bm = manager(device_blocks=6, enable_compression=False, evict_on_full=True, policy="lru")
    older, ended = np.arange(3 * BS), np.arange(3 * BS) + 1000
    a = bm.add_sequence(older)
    append_all(bm, a, kv(3 * BS, seed=40))
    bm.free(a)
    b = bm.add_sequence(ended)
    append_all(bm, b, kv(3 * BS, seed=41))
    bm.release(b)
    bm.free(b)
    c = bm.add_sequence()
    append_all(bm, c, kv(2 * BS, seed=42))  # room for two blocks: the released chain's leaves
    assert bm.get_compression_stats()["evictions"] == 2
    assert (bm.lookup(older), bm.lookup(ended)) == (3 * BS, BS)
    with pytest.raises(InvalidSequenceError):
        bm.release(b)
    # Freed already, named by its tokens: a later conversation goes before the older one,
    # but for the block a new prompt shared again (the conversation went on after all).
    bm.free(c)
    recent = np.arange(2 * BS) + 2000
    e = bm.add_sequence(recent)
    append_all(bm, e, kv(2 * BS, seed=43))
    bm.free(e)
    assert bm.release_cached(recent) == 2 * BS
    bm.free(bm.add_sequence(recent[:BS]))
    d = bm.add_sequence()
    append_all(bm, d, kv(3 * BS, seed=44))
    assert (bm.lookup(older), bm.lookup(ended), bm.lookup(recent)) == (2 * BS, 0, BS)
    assert bm.release_cached(np.arange(5)) == 0  # no whole block: nothing released


@pytest.mark.parametrize("ladder", [("fp16",), ("fp16", "int8", "int4")])
def test_live_sequences_spill_to_the_host_tier_rather_than_fail(ladder: tuple[str, ...]) -> None:
    """A device of 8 blocks, an 8 MiB host tier: live sequences of four blocks each, one step
    after each. The device's level 0 soon holds only recent windows (protected): room for the
    next sequence is made by moving complete ones to the host (level 0 there is still level 0),
    so every sequence fits while the tiers together hold them, whatever the ladder."""
    bm = manager(
        device_blocks=8, host_budget=8 << 20, recent_window=BS, sink_blocks=0, ladder=ladder
    )
    seqs = []
    for i in range(6):
        seq = bm.add_sequence()
        x = kv(4 * BS, seed=30 + i)
        append_all(bm, seq, x)
        bm.step()
        seqs.append((seq, x))
    moves = bm.get_compression_stats()
    assert moves["offloads"] > 0, moves
    for seq, x in seqs:  # every sequence still reads back (the lossy levels approximately)
        k, _ = bm.gather(seq, 0)
        assert k.shape[0] == 4 * BS
        if ladder == ("fp16",):
            assert torch.equal(k, x[0, 0])


def test_a_sequence_freed_before_any_step_leaves_its_blocks_ranked_by_their_learned_scores() -> (
    None
):
    """A save (add, write, score, free, as the vLLM connector does) never lives through a
    plan: its cached blocks are still ranked by the scores it set, so the lowest-scored goes
    down the ladder first when room is needed (eviction, which decides whether a block will
    be loaded again, goes by how often its prefix came back instead: see
    ``test_model_hypothesis.py::test_eviction_ranks_importance_leaves_by_reuse_first``).
    Scores may start at any block (the blocks a save added)."""
    bm = manager(device_blocks=6, weights=(0.0, 1.0, 0.0))
    low, high = np.arange(2 * BS), np.arange(2 * BS) + 1000
    a = bm.add_sequence(low)
    append_all(bm, a, kv(2 * BS, seed=15))
    bm.set_learned_scores(a, [9.0, 5.0])
    bm.set_learned_scores(a, [0.5], first_block=1)  # its leaf scores lowest
    with pytest.raises(InvalidArgumentError, match="first_block: expected 0 to 2"):
        bm.set_learned_scores(a, [1.0], first_block=3)
    b = bm.add_sequence(high)
    append_all(bm, b, kv(2 * BS, seed=16))
    bm.set_learned_scores(b, [0.5, 9.0])  # its leaf scores highest
    leaves = [bm.core.sequence_blocks(s)[1] for s in (a, b)]
    bm.free(a)
    bm.free(b)
    info = bm.core.block_info(leaves)
    assert info["score"][0] < info["score"][1]
    c = bm.add_sequence()
    append_all(bm, c, kv(2 * BS, seed=17))  # needs room: demotions, no eviction
    assert bm.get_compression_stats()["evictions"] == 0
    levels = bm.core.block_info(leaves)["level"].tolist()
    assert levels[0] > levels[1], f"a's leaf (0.5) went further down than b's (9.0): {levels}"
    assert bm.lookup(low) == 2 * BS and bm.lookup(high) == 2 * BS, "both prefixes still load"


def poison(x: Any, value: float = float("nan")) -> Any:
    """A copy of ``x`` with one element (in its last token) non-finite."""
    y = x.clone()
    y[-1, -1, -1] = value if value != 1 else float("inf")
    return y


def test_a_freed_prompts_blocks_are_reclaimed_by_default_so_the_device_never_wedges() -> None:
    """Default settings, a small device: prompt after prompt (each freed once done) never runs
    out, whether the freed blocks are demoted first or not; the cached blocks are evicted,
    lowest-ranked first, once nothing else makes room."""
    for cfg in ({"enable_compression": False}, {}):
        bm = manager(device_blocks=8, **cfg)
        for i in range(12):
            seq = bm.add_sequence(np.arange(4 * BS) + 1000 * i)
            x = kv(4 * BS, seed=i)
            append_all(bm, seq, x)
            assert_gathers(bm, seq, x)
            bm.free(seq)
        assert bm.get_compression_stats()["evictions"] > 0, cfg
        # A cached prefix that still fits is shared, not recomputed.
        again = bm.add_sequence(np.arange(4 * BS) + 11000)
        assert bm.num_tokens(again, 0) > 0


def test_out_of_capacity_means_the_live_sequences_do_not_fit_and_says_what_holds_the_device() -> (
    None
):
    bm = manager(device_blocks=4, enable_compression=False)  # 4 level-0 slots
    old = bm.add_sequence(np.arange(2 * BS))
    append_all(bm, old, kv(2 * BS, seed=1))
    bm.free(old)  # 2 cached blocks
    seq = bm.add_sequence()
    append_all(bm, seq, kv(4 * BS, seed=2))  # takes the cached blocks' room
    before = snapshot(bm)
    with pytest.raises(OutOfCapacityError) as info:
        bm.append(seq, 0, *kv(BS, seed=3)[0])
    msg = str(info.value)
    b0 = bm.level_bytes[0]
    assert "the live sequences do not fit" in msg, msg
    assert f"live sequences hold {4 * b0} B" in msg and "cached blocks 0 B" in msg, msg
    assert f"device budget {4 * b0} B" in msg, msg
    assert_same(before, snapshot(bm), planned=1, aborted=1)

    # With eviction off, the cached blocks are what holds the device, and the message says so.
    kept = manager(device_blocks=4, enable_compression=False, evict_on_full=False)
    old = kept.add_sequence(np.arange(3 * BS))
    append_all(kept, old, kv(3 * BS, seed=1))
    kept.free(old)
    seq = kept.add_sequence()
    with pytest.raises(OutOfCapacityError, match="evict_on_full is off") as info:
        append_all(kept, seq, kv(2 * BS, seed=2))
    assert f"cached blocks {3 * b0} B (3 level-0 slots)" in str(info.value), str(info.value)


def test_a_failed_append_stores_nothing_and_a_retry_stores_its_kv() -> None:
    """NaN or inf in K or V is refused before a byte moves (K and V alike), so the retry with
    good K/V is written, not skipped as already there; K/V that require grad are stored
    detached."""
    bm = manager()
    seq = bm.add_sequence()
    x = kv(BS + 3, seed=21)
    for bad in (poison(x[0, 0]), poison(x[0, 0], 1)):
        before = snapshot(bm)
        for k, v in ((bad, x[0, 1]), (x[0, 0], bad)):
            with pytest.raises(InvalidArgumentError, match="expected finite values"):
                bm.append(seq, 0, k, v)
            assert_same(before, snapshot(bm))
    grad = x.clone().requires_grad_(True)
    append_all(bm, seq, grad)
    assert_gathers(bm, seq, x)
    assert not bm.gather(seq, 0)[0].requires_grad


def test_a_fork_on_a_full_device_makes_room_for_its_partial_block() -> None:
    bm = manager(device_blocks=4, enable_compression=False)
    old = bm.add_sequence(np.arange(3 * BS))
    append_all(bm, old, kv(3 * BS, seed=1))
    bm.free(old)
    seq = bm.add_sequence()
    x = kv(BS // 2, seed=2)
    append_all(bm, seq, x)  # one partial block; three cached fill the device
    child = bm.fork(seq)
    assert_gathers(bm, child, x)


def test_a_prompt_saved_in_pieces_through_a_small_full_level_0_is_never_refused() -> None:
    """A connector's save: each piece of a prompt shares what the pieces before it stored and
    writes two blocks more, through a level 0 of two slots, with the levels below full of
    other prompts. The blocks a piece shares sit at level 0, cached: the room its new blocks
    need is made by moving them (they are about to be shared) and evicting other prompts'
    blocks, never by evicting them (room for one block too few, a refused save; issue 59)."""
    bm = manager(
        device_blocks=16, recent_window=128, pool_shares=(2 / 16, 0.07, 0.805), evict_on_full=True
    )
    assert bm.slots[("device", 0)] == 2
    for prompt in range(40):
        tokens = np.arange(6 * BS) + 10_000 * prompt
        x = kv(6 * BS, seed=prompt)
        for end in (2 * BS, 4 * BS, 6 * BS):
            seq = bm.add_sequence(tokens[:end])
            held = bm.num_tokens(seq)
            assert held == end - 2 * BS, (prompt, end)  # the pieces before it, all there
            for layer in range(LAYERS):
                blocks = x[layer, :, held:end].reshape(2, 2, BS, HEADS, DIM).transpose(0, 1)
                bm.append_blocks(seq, layer, blocks.transpose(2, 3))
            bm.free(seq)
        assert bm.lookup(tokens) == 6 * BS
        bm.step()


def test_budgets_the_pools_cannot_have_are_config_errors_naming_the_budget() -> None:
    from kvtier import ConfigError

    with pytest.raises(ConfigError, match="more than the 4294967295 a pool can index"):
        manager(device_blocks=None, device_budget=1 << 50)  # a PiB
    with pytest.raises(ConfigError, match=r"device budget: the pools take \d+ B of cpu memory"):
        manager(device_blocks=None, device_budget=1 << 44)  # 16 TiB
    with pytest.raises(ConfigError, match="device and host budget"):
        manager(host_budget=1 << 44)
    with pytest.raises(ConfigError, match="disk budget"):
        manager(disk_budget=1 << 62, disk_path="/nonexistent")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_tier_budget_below_one_block_is_refused_not_an_empty_tier(tier: str, tmp_path) -> None:
    """A positive budget smaller than a block gave a tier of no slots that held nothing."""
    paths = {"disk_path": str(tmp_path)} if tier == "disk" else {}
    with pytest.raises(ConfigError, match=f"{tier}_budget: 100 B holds no block at any level"):
        manager(**{f"{tier}_budget": 100}, **paths)
    assert not list(tmp_path.iterdir()), "nothing created"


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("what", "call", "error", "match"),
    [
        ("layer", lambda bm, s, k: bm.append(s, LAYERS, k, k), InvalidArgumentError, "layer"),
        (
            "heads",
            lambda bm, s, k: bm.append(s, 0, k[:, :1], k[:, :1]),
            InvalidArgumentError,
            "kv_heads",
        ),
        (
            "dim",
            lambda bm, s, k: bm.append(s, 0, k[..., :8], k[..., :8]),
            InvalidArgumentError,
            "head_dim",
        ),
        (
            "dtype",
            lambda bm, s, k: bm.append(s, 0, k.float(), k.float()),
            InvalidArgumentError,
            "dtype",
        ),
        (
            "device",
            lambda bm, s, k: bm.append(s, 0, k.to("meta"), k.to("meta")),
            InvalidArgumentError,
            "expected a tensor on cpu",
        ),
        ("k/v", lambda bm, s, k: bm.append(s, 0, k, k[:2]), InvalidArgumentError, "one shape"),
        (
            "sequence",
            lambda bm, s, k: bm.append(s + 99, 0, k, k),
            InvalidSequenceError,
            "unknown sequence",
        ),
        ("gather", lambda bm, s, k: bm.gather(s, -1), InvalidArgumentError, "layer"),
        ("tokens", lambda bm, s, k: bm.add_tokens(s, [[1, 2]]), InvalidArgumentError, "token_ids"),
        (
            "not a tensor",
            lambda bm, s, k: bm.append(s, 0, "k", "v"),
            InvalidArgumentError,
            "DLPack",
        ),
        ("NaN in K", lambda bm, s, k: bm.append(s, 0, poison(k), k), InvalidArgumentError, "k: "),
        (
            "inf in V",
            lambda bm, s, k: bm.append(s, 0, k, poison(k, 1)),
            InvalidArgumentError,
            "v: ",
        ),
    ],
)
def test_bad_input_raises_a_clear_error_and_changes_nothing(
    what: str, call: Any, error: type[Exception], match: str
) -> None:
    bm = manager()
    seq = bm.add_sequence()
    x = kv(40, seed=15)
    append_all(bm, seq, x)
    bm.step()
    before = snapshot(bm)
    with pytest.raises(error, match=match):
        call(bm, seq, x[0, 0, :4])
    assert_same(before, snapshot(bm))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_bf16_kv_is_refused(bad: float) -> None:
    """bf16 is checked through its bits (numpy has no bf16): NaN and both infinities, in K and
    in V, strided or not; the largest finite bf16 values are accepted where every level holds
    them (a bf16 ladder; a quantized level's range is tests/test_value_range.py's)."""
    bm = manager(dtype=torch.bfloat16, ladder=("bf16",))
    seq = bm.add_sequence()
    x = kv(BS, seed=16, dtype=torch.bfloat16)[0]
    for which in (0, 1):
        bad_x = x.clone()
        bad_x[which, -1, -1, -1] = bad
        with pytest.raises(InvalidArgumentError, match=("k: ", "v: ")[which]):
            bm.append(seq, 0, bad_x[0].transpose(0, 1).transpose(0, 1), bad_x[1])
    huge = torch.full_like(x, 3.3e38)
    bm.append(seq, 0, huge[0], huge[1])
    assert bm.num_tokens(seq, 0) == BS


def test_a_config_the_manager_cannot_serve_is_refused() -> None:
    from kvtier import ConfigError

    with pytest.raises(ConfigError, match="write_through: needs a tier after the device"):
        manager(write_through=True)
    with pytest.raises(ConfigError, match="set disk_path"):
        manager(disk_budget=1 << 20)
    with pytest.raises(ConfigError, match="set remote_url"):
        manager(remote_budget=1 << 20)
    with pytest.raises(ConfigError, match="holds no level-0 block"):
        manager(device_blocks=None, device_budget=1000)
    with pytest.raises(ConfigError, match="model dtype"):
        manager(ladder=("bf16", "int8"))


# -- threads ---------------------------------------------------------------------------------------


def test_two_writers_and_a_stepper_never_corrupt_a_block() -> None:
    bm = manager(device_blocks=48, host_blocks=64, recent_window=16)
    data = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        try:
            seq = bm.add_sequence()
            x = kv(30 * BS + 7, seed=seed)
            data[seq] = x
            at = 0
            for n in [5, 11, 16, 1, 30, 3] * 15:
                n = min(n, x.shape[2] - at)
                if n <= 0:
                    break
                for layer in range(LAYERS):
                    bm.append(seq, layer, x[layer, 0, at : at + n], x[layer, 1, at : at + n])
                    k, v = bm.gather(seq, layer)
                    assert_close_blocks(k, x[layer, 0, : at + n])
                    assert_close_blocks(v, x[layer, 1, : at + n])
                at += n
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def stepper() -> None:
        try:
            while not stop.is_set():
                bm.step()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in (20, 21)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that races show
    step_thread = threading.Thread(target=stepper)
    step_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    step_thread.join()
    sys.setswitchinterval(switch)
    assert not errors, errors
    assert bm.get_compression_stats()["demotions"] > 0
    for seq, x in data.items():
        assert bm.num_tokens(seq) == x.shape[2]
        for layer in range(LAYERS):
            k, v = bm.gather(seq, layer)
            assert_close_blocks(k, x[layer, 0])
            assert_close_blocks(v, x[layer, 1])


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_level_0_is_exact_and_demotions_match_the_codec(torch_cuda: Any) -> None:
    bm = manager("cuda", host_blocks=64, write_through=True)
    x = kv(150, seed=16, device="cuda")
    seq = bm.add_sequence()
    append_all(bm, seq, x, [100, 50])
    assert bm.pools["host", 0].is_pinned()
    assert_gathers(bm, seq, x)
    bm.step()
    assert max(levels_of(bm, seq)) > 0
    for layer in range(LAYERS):
        k, v = bm.gather(seq, layer)
        assert_close_blocks(k, x[layer, 0])
        assert_close_blocks(v, x[layer, 1])
        assert torch.equal(k[-20:], x[layer, 0, -20:])  # the recent window stays exact


# -- disk and remote tiers (kvtier.stores) ---------------------------------------------------------

#: Small device, no sink or recent window: blocks demote and then leave the device at once.
SPILL = {"device_blocks": 24, "recent_window": 0, "sink_blocks": 0}


def spill(bm: BlockManager, n: int = 12) -> dict[int, Any]:
    seqs = {}
    for i in range(n):
        seq = bm.add_sequence()
        seqs[seq] = kv(3 * BS, seed=100 + i)
        append_all(bm, seq, seqs[seq])
        bm.step()
    return seqs


def gathered(bm: BlockManager, seqs: dict[int, Any]) -> list[Any]:
    return [torch.stack(bm.gather(s, layer)) for s in seqs for layer in range(LAYERS)]


def store_tier_matches_host_tier(**tier: Any) -> BlockManager:
    """The same workload with a store tier and with a host tier of the same budget: the core
    plans the same moves, so every gathered K/V must be bit-identical."""
    budget = 4 << 20
    ref = manager(**SPILL, host_budget=budget)
    bm = manager(**SPILL, **tier)
    seqs = spill(bm)
    spill(ref)
    name = "disk" if "disk_budget" in tier else "remote"
    assert sum(p.blocks for p in bm.stats().pools if p.tier == name) > 0
    for a, b in zip(gathered(bm, seqs), gathered(ref, seqs), strict=True):
        assert torch.equal(a, b)
    return bm


def test_disk_tier_serves_exactly_what_a_host_tier_would(tmp_path: Path) -> None:
    bm = store_tier_matches_host_tier(disk_budget=4 << 20, disk_path=str(tmp_path))
    counters = bm.stats().counters
    assert counters["offloads"] > 0 and counters["fetches"] > 0
    # Each level travels packed: the files are the codec's bytes plus a small header.
    sizes = {p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    overhead = {s - b for s in sizes for b in bm.level_bytes[1:]}
    assert min(overhead) < 400 and max(sizes) < bm.level_bytes[0]
    bm.close()
    assert not any(tmp_path.iterdir())


def test_a_manager_dropped_without_close_takes_its_disk_tier_along(tmp_path: Path) -> None:
    bm = manager(**SPILL, disk_budget=4 << 20, disk_path=str(tmp_path))
    spill(bm)
    assert any(p.is_file() for p in tmp_path.rglob("*"))  # blocks were offloaded to disk
    del bm
    gc.collect()
    assert not any(tmp_path.iterdir())


def a_file_on_disk(bm: BlockManager, seqs: Iterable[int]) -> Path:
    """The file of a block of one of ``seqs`` that sits on the disk tier. (The tier holds other
    files too: a slot a block left keeps its value until a block reuses it, as a pool slot
    does.)"""
    disk = Plan.TIERS.index("disk")
    for seq in seqs:
        info = bm.core.block_info(bm.core.sequence_blocks(seq))
        for tier, level, slot in zip(info["tier"], info["level"], info["slot"], strict=True):
            if tier == disk:
                store = bm.stores["disk", int(level)]
                return Path(store._path(store.namespace.key(f"{bm.instance}.{slot}")))
    raise AssertionError("no block of these sequences is on disk")


def test_a_block_corrupted_on_disk_is_lost_never_served(tmp_path: Path) -> None:
    bm = manager(**SPILL, disk_budget=4 << 20, disk_path=str(tmp_path))
    seqs = spill(bm)
    victim = a_file_on_disk(bm, seqs)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    lost, served = [], 0
    for seq in seqs:
        try:
            bm.gather(seq, 0)
            served += 1
        except BlockLostError:
            lost.append(seq)
    assert len(lost) == 1 and served == len(seqs) - 1
    for _ in range(3):
        bm.step()  # the engine keeps running; the lost block is never fetched again
    with pytest.raises(BlockLostError, match=f"sequence {lost[0]}"):
        bm.gather(lost[0], 1)
    bm.free(lost[0])
    again = bm.add_sequence()
    append_all(bm, again, seqs[lost[0]])  # recomputed K/V fits again
    assert bm.gather(again, 0)[0].shape[0] == 3 * BS


@pytest.mark.redis
def test_remote_tier_serves_exactly_what_a_host_tier_would(redis_server: Any) -> None:
    bm = store_tier_matches_host_tier(remote_budget=4 << 20, remote_url=redis_server.url)
    from kvtier.stores import RedisStore

    def mine() -> int:
        views = [RedisStore(redis_server.url, s.namespace) for s in bm.stores.values()]
        return sum(k.startswith(bm.instance) for v in views for k in v.keys())  # noqa: SIM118

    assert mine() > 0
    bm.close()
    assert mine() == 0


@pytest.mark.redis
def test_remote_values_expire_after_remote_ttl(redis_server: Any) -> None:
    """A crashed engine's values leave the server by themselves; a block that outlives them is
    lost (a miss), and every block still served is exactly what a host tier serves."""
    import redis

    # Long enough that a busy machine's slow spill still finds the last values alive.
    bm = manager(**SPILL, remote_budget=4 << 20, remote_url=redis_server.url, remote_ttl=2.0)
    ref = manager(**SPILL, host_budget=4 << 20)
    seqs = spill(bm)
    spill(ref)
    server = redis.Redis.from_url(redis_server.url)
    mine = f"kvtier:*:{bm.instance}.*"
    ttls = [server.pttl(k) for k in server.scan_iter(match=mine)]
    assert ttls and all(0 < t <= 2000 for t in ttls), ttls
    time.sleep(2.1)
    lost = 0
    for seq in seqs:
        try:
            got = bm.gather(seq, 0)
        except BlockLostError:
            lost += 1
            continue
        assert all(torch.equal(a, b) for a, b in zip(got, ref.gather(seq, 0), strict=True))
    assert 0 < lost < len(seqs) and not list(server.scan_iter(match=mine))
    bm.close()


def sharing(url: str, **cfg: Any) -> tuple[BlockManager, BlockManager]:
    """Two engines of one model that share prefixes through the server at ``url`` (in a
    namespace of their own: the server lives for the whole run)."""
    base = {"remote_budget": 4 << 20, "remote_url": url, "namespace": f"share-{uuid.uuid4()}"}
    base.update(cfg)
    return manager(share_prefixes=True, **base), manager(share_prefixes=True, **base)


@pytest.mark.redis
def test_an_engine_takes_the_prompt_blocks_another_engine_published(redis_server: Any) -> None:
    a, b = sharing(redis_server.url)
    x, ids = kv(5 * BS + 3, seed=40), np.arange(5 * BS + 3) + 1000
    append_all(a, a.add_sequence(ids), x)
    assert b.num_tokens(b.add_sequence(ids)) == 0  # nothing published before a step
    a.step()  # publishes what became complete
    assert a.stats().counters["prefix_published"] == 5
    assert b.lookup(ids[: 4 * BS + 2]) == 4 * BS and b.lookup(ids) == 5 * BS
    assert b.lookup(ids + 1) == 0
    seq = b.add_sequence(ids[: 4 * BS + 2])
    assert b.num_tokens(seq) == 4 * BS and b.stats().counters["prefix_fetched"] == 4
    append_all(b, seq, x[:, :, 4 * BS : 4 * BS + 2])  # only the rest is computed
    for layer in range(LAYERS):
        k, v = b.gather(seq, layer)
        assert torch.equal(k, x[layer, 0, : 4 * BS + 2]) and torch.equal(
            v, x[layer, 1, : 4 * BS + 2]
        )
    assert b.lookup(ids) == 5 * BS  # 4 blocks cached here now, the 5th on the server
    # the magnitude signal the scheduler ranks by, as if b had appended the blocks itself
    mine, theirs = b.core.sequence_blocks(seq)[:4], a.core.sequence_blocks(0)[:4]
    np.testing.assert_allclose(
        b.ledger.magnitude(mine),
        a.ledger.magnitude(theirs),
        rtol=1e-5,
    )
    b.step()
    assert b.stats().counters["prefix_published"] == 0  # what it fetched is there already
    a.close()
    c = manager(
        share_prefixes=True,
        remote_budget=4 << 20,
        remote_url=redis_server.url,
        namespace=b.config.namespace,
    )
    assert c.num_tokens(c.add_sequence(ids)) == 5 * BS  # what a published outlives it


def test_a_sequence_named_by_block_hashes_is_cached_and_found_by_them() -> None:
    """An engine that knows its blocks by hash (vLLM's offloading tiers) declares them so: a
    hash names its block wherever it sat, a later sequence shares what the cache holds, and
    bad hashes are refused with nothing added."""
    bm = manager()
    x = kv(3 * BS, seed=60)
    seq = bm.add_sequence(block_hashes=[11, 22, 33])
    assert bm.num_tokens(seq) == 0
    append_all(bm, seq, x)
    bm.free(seq)
    assert bm.lookup(block_hashes=[11, 22, 33, 44]) == 3 * BS
    assert bm.lookup(block_hashes=[22]) == BS and bm.lookup(block_hashes=[44, 11]) == 0
    again = bm.add_sequence(block_hashes=np.array([22, 33], dtype=np.uint64))
    assert bm.num_tokens(again) == 2 * BS
    for layer in range(LAYERS):
        k, v = bm.gather(again, layer)
        assert torch.equal(k, x[layer, 0, BS:]) and torch.equal(v, x[layer, 1, BS:])
    before = bm.sequences()
    for bad, match in [
        ({"block_hashes": [0]}, "0 is no block's hash"),
        ({"block_hashes": [-1]}, r"expected hashes in \[1, 2\*\*64\)"),
        ({"block_hashes": [[1, 2]]}, "expected a 1-D sequence of integer hashes"),
        ({"token_ids": np.arange(BS), "block_hashes": [5]}, "give no token_ids or salt"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            bm.add_sequence(**bad)
    with pytest.raises(InvalidArgumentError, match="give no token_ids or salt"):
        bm.lookup(salt="tenant", block_hashes=[5])
    assert bm.sequences() == before


@pytest.mark.redis
def test_blocks_named_by_hash_are_shared_through_the_server(redis_server: Any) -> None:
    a, b = sharing(redis_server.url)
    x, hashes = kv(3 * BS, seed=61), [101, 102, 103]
    append_all(a, a.add_sequence(block_hashes=hashes), x)
    a.step()
    assert b.lookup(block_hashes=hashes) == 3 * BS and b.lookup(block_hashes=[102]) == BS
    seq = b.add_sequence(block_hashes=hashes[1:])
    assert b.num_tokens(seq) == 2 * BS and b.stats().counters["prefix_fetched"] == 2
    assert torch.equal(b.gather(seq, 1)[1], x[1, 1, BS:])


@pytest.mark.redis
def test_blocks_saved_encoded_below_level_0_are_not_published(redis_server: Any) -> None:
    """An encoded save places blocks below level 0 before a byte is written: only their
    codec's bytes exist, so they are not published (their slot number names a row of another
    pool); the chain's ends that stayed at level 0 (its sink, its last two blocks) are,
    exactly, and another engine takes the sink (the last blocks follow one it cannot take)."""
    shape = BlockShape(LAYERS, HEADS, BS, DIM, "bf16")
    int8 = 2.5 * get_codec("int8").bytes_per_block(shape) / (64 * shape.fp16_bytes)
    a2, b2 = sharing(
        redis_server.url,
        dtype=torch.bfloat16,
        ladder=("bf16", "int8", "int4"),
        pool_shares=(0.4, int8, 0.6 - int8),
    )
    x, ids = kv(4 * BS, seed=46, dtype=torch.bfloat16), np.arange(4 * BS) + 500
    seq = a2.add_sequence(ids)
    for layer in range(LAYERS):
        a2.append_blocks(seq, layer, as_blocks(x, layer, 0, 4), encode=True)
    assert a2.core.block_info(a2.core.sequence_blocks(seq))["level"].tolist() == [0, 1, 0, 0]
    a2.step()
    assert a2.stats().counters["prefix_published"] == 3
    got = b2.add_sequence(ids)
    assert b2.num_tokens(got) == BS
    for layer in range(LAYERS):
        assert torch.equal(b2.gather_blocks(got, layer)[0], as_blocks(x, layer, 0, 1)[0])


@pytest.mark.redis
def test_a_prompt_freed_and_pressed_out_before_the_step_is_still_published(
    redis_server: Any,
) -> None:
    a, b = sharing(redis_server.url, device_blocks=6, evict_on_full=True, enable_compression=False)
    ids, x = np.arange(4 * BS) + 77, kv(4 * BS, seed=44)
    seq = a.add_sequence(ids)
    append_all(a, seq, x)
    a.free(seq)
    append_all(a, a.add_sequence(), kv(4 * BS, seed=45))  # needs the freed prompt's room
    assert a.stats().counters["prefix_published"] == 4
    got = b.add_sequence(ids)
    assert b.num_tokens(got) == 4 * BS and torch.equal(b.gather(got, 2)[0], x[2, 0])


@pytest.mark.redis
def test_publishing_and_taking_race_with_appends_and_steps(redis_server: Any) -> None:
    """Engine a writes two prompts from two threads while a third steps (publishing, demoting);
    engine b takes them meanwhile: whatever b gets at any moment is exactly a's K/V."""
    a, b = sharing(redis_server.url, device_blocks=48, host_blocks=64, recent_window=16)
    n = 6 * BS
    prompts = [(np.arange(n) + 1000 * i, kv(n, seed=50 + i)) for i in range(2)]
    errors: list[BaseException] = []
    stop = threading.Event()
    taken: list[int] = []

    def guarded(fn: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        return run

    @guarded
    def writer(i: int) -> None:
        ids, x = prompts[i]
        seq = a.add_sequence(ids)
        for at in range(0, n, 5):
            for layer in range(LAYERS):
                a.append(seq, layer, x[layer, 0, at : at + 5], x[layer, 1, at : at + 5])

    @guarded
    def stepper() -> None:
        while not stop.is_set():
            a.step()

    @guarded
    def taker() -> None:
        while not stop.is_set():
            for ids, x in prompts:
                seq = b.add_sequence(ids)
                got = b.num_tokens(seq)
                taken.append(got)
                for layer in range(LAYERS):
                    k, v = b.gather(seq, layer)
                    assert torch.equal(k, x[layer, 0, :got]) and torch.equal(v, x[layer, 1, :got])
                b.free(seq)

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    others = [threading.Thread(target=stepper), threading.Thread(target=taker)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that races show
    try:
        for t in others + writers:
            t.start()
        for t in writers:
            t.join()
        stop.set()
        for t in others:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert taken, "the taker ran"
    a.step()  # publishes whatever completed after the stepper's last step
    assert a.stats().counters["prefix_published"] == 12
    assert a.get_compression_stats()["demotions"] > 0  # the blocks moved on after publishing
    for ids, x in prompts:
        seq = b.add_sequence(ids)
        assert b.num_tokens(seq) == n and torch.equal(b.gather(seq, 1)[1], x[1, 1])


@pytest.mark.redis
def test_a_damaged_shared_block_is_computed_again_never_served(redis_server: Any) -> None:
    import redis

    a, b = sharing(redis_server.url)
    x, ids = kv(4 * BS, seed=41), np.arange(4 * BS) + 7
    append_all(a, a.add_sequence(ids), x)
    a.step()
    store = a.stores["remote", 0]
    third = store.namespace.key(int(a.core.block_info(a.core.sequence_blocks(0))["hash"][2]))
    server = redis.Redis.from_url(redis_server.url)
    value = bytearray(server.get(third))
    value[len(value) // 2] ^= 1
    server.set(third, bytes(value))
    assert b.lookup(ids) == 4 * BS  # found on the server, checked only when taken
    seq = b.add_sequence(ids)
    assert b.num_tokens(seq) == 2 * BS  # the blocks before the damaged one
    assert b.lookup(ids) == 2 * BS
    assert not server.exists(third)  # dropped from the server, so nobody else takes it
    append_all(b, seq, x[:, :, 2 * BS :])
    assert torch.equal(b.gather(seq, 1)[0], x[1, 0])


@pytest.mark.redis
def test_engines_of_another_model_or_namespace_share_nothing(redis_server: Any) -> None:
    a, same = sharing(redis_server.url)
    ids = np.arange(2 * BS)
    append_all(a, a.add_sequence(ids), kv(2 * BS, seed=42))
    a.step()
    tier = {"share_prefixes": True, "remote_budget": 4 << 20, "remote_url": redis_server.url}
    ns = a.config.namespace
    other_dtype = manager(dtype=torch.bfloat16, namespace=ns, **tier)
    other_ns = manager(namespace=ns + "-other", **tier)
    for other in (other_dtype, other_ns):
        assert other.num_tokens(other.add_sequence(ids)) == 0
    assert same.num_tokens(same.add_sequence(ids)) == 2 * BS


@pytest.mark.redis
def test_a_salted_published_block_is_found_with_its_salt_only(redis_server: Any) -> None:
    a, b = sharing(redis_server.url)
    ids = np.arange(3 * BS) + 300
    xa, xplain = kv(3 * BS, seed=46), kv(3 * BS, seed=47)
    append_all(a, a.add_sequence(ids, salt="tenant-a"), xa)
    a.step()
    assert a.stats().counters["prefix_published"] == 3
    # The keys on the server are the salted chain's, not the plain one's.
    store = a.stores["remote", 0]
    salted = kvtier.prefix_hashes(ids, BS, a.config.namespace, salt="tenant-a").tolist()
    plain = kvtier.prefix_hashes(ids, BS, a.config.namespace).tolist()
    assert store.contains_many(salted) == [True] * 3
    assert store.contains_many(plain) == [False] * 3
    assert b.lookup(ids, salt="tenant-a") == 3 * BS
    assert b.lookup(ids) == 0 and b.lookup(ids, salt="tenant-b") == 0
    for salt in (None, "tenant-b"):
        seq = b.add_sequence(ids, salt=salt)
        assert b.num_tokens(seq) == 0 and b.stats().counters["prefix_fetched"] == 0
        b.free(seq)
    seq = b.add_sequence(ids, salt="tenant-a")
    assert b.num_tokens(seq) == 3 * BS and b.stats().counters["prefix_fetched"] == 3
    assert torch.equal(b.gather(seq, 2)[0], xa[2, 0])
    # An unsalted prompt of the same tokens publishes apart and is taken apart.
    append_all(a, a.add_sequence(ids), xplain)
    a.step()
    assert store.contains_many(plain) == [True] * 3
    seq = b.add_sequence(ids)
    assert b.num_tokens(seq) == 3 * BS and torch.equal(b.gather(seq, 2)[0], xplain[2, 0])


def test_sharing_prefixes_needs_a_remote_tier_and_a_named_model() -> None:
    with pytest.raises(ConfigError, match="share_prefixes: needs a remote tier"):
        manager(share_prefixes=True, host_budget=1 << 20)
    with pytest.raises(ConfigError, match="share_prefixes: set namespace to name the model"):
        manager(share_prefixes=True, remote_budget=1 << 20, remote_url="redis://127.0.0.1:9")


@pytest.mark.redis
def test_a_shared_prefix_server_that_is_gone_is_a_miss() -> None:
    from conftest import local_redis

    server = local_redis()
    try:
        a, b = sharing(server.url, remote_timeout=0.5)
        ids = np.arange(3 * BS)
        x = kv(3 * BS, seed=43)
        append_all(a, a.add_sequence(ids), x)
        a.step()
        assert a.stats().counters["prefix_published"] == 3
        server.kill()
        seq = b.add_sequence(ids)  # computes its prompt itself
        assert b.num_tokens(seq) == 0
        append_all(b, seq, x)
        b.step()
        assert b.stats().counters["prefix_published"] == 0
        assert torch.equal(b.gather(seq, 2)[1], x[2, 1])
    finally:
        server.stop()


@pytest.mark.redis
def test_remote_tier_over_tls() -> None:
    from conftest import local_redis

    server = local_redis(tls=True)
    try:
        bm = store_tier_matches_host_tier(
            remote_budget=4 << 20,
            remote_url=server.url,
            remote_tls_ca=server.tls_ca,
            remote_tls_cert=server.tls_cert,
            remote_tls_key=server.tls_key,
        )
        assert bm.stats().counters["fetches"] > 0
        bm.close()
    finally:
        server.stop()


@pytest.mark.redis
def test_the_engine_keeps_running_when_redis_dies() -> None:
    from conftest import local_redis

    server = local_redis()
    try:
        bm = manager(**SPILL, remote_budget=4 << 20, remote_url=server.url, remote_timeout=0.5)
        seqs = spill(bm, 8)
        server.kill()
        summaries = [bm.step() for _ in range(3)]
        assert any("store_refused" in s or "lost" in s for s in summaries), summaries
        more = spill(bm, 4)  # new sequences are still served from the device
        lost = 0
        for seq in {**seqs, **more}:
            try:
                bm.gather(seq, 0)
            except BlockLostError:
                lost += 1
        assert 0 < lost < len(seqs) + len(more)
    finally:
        server.stop()


# -- whole blocks (append_blocks) -----------------------------------------------------------------


def as_blocks(x: Any, layer: int, first: int, count: int) -> Any:
    """Blocks ``first:first + count`` of one layer of ``kv``'s output, in the form
    ``append_blocks`` takes: ``[count, 2, heads, BS, dim]``."""
    tokens = x[layer, :, first * BS : (first + count) * BS]  # [2, tokens, H, D]
    return tokens.reshape(2, count, BS, HEADS, DIM).permute(1, 0, 3, 2, 4).contiguous()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_whole_blocks_are_stored_as_their_tokens_appended_one_by_one_are(
    request: Any, device: str, dtype: Any
) -> None:
    """The same K/V, the same key-norm signal the scheduler ranks by, and the blocks cached
    for later prompts once every layer has them; a sequence sharing a cached prefix appends
    the blocks after it. (On the CPU the extension checks and copies them; on CUDA, torch.)"""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    x = kv(3 * BS, seed=40, device=device, dtype=dtype)
    tokens = np.arange(3 * BS)
    by_token, by_block = manager(device, dtype), manager(device, dtype)
    a = by_token.add_sequence(tokens)
    append_all(by_token, a, x)
    b = by_block.add_sequence(tokens)
    for layer in range(LAYERS):
        by_block.append_blocks(b, layer, as_blocks(x, layer, 0, 3))
    assert_gathers(by_block, b, x)
    blocks_a, blocks_b = by_token.core.sequence_blocks(a), by_block.core.sequence_blocks(b)
    np.testing.assert_allclose(
        by_block.ledger.magnitude(blocks_b), by_token.ledger.magnitude(blocks_a), rtol=1e-4
    )
    by_block.free(b)
    assert by_block.lookup(tokens) == 3 * BS
    longer = by_block.add_sequence(np.arange(4 * BS))
    assert by_block.num_tokens(longer) == 3 * BS
    y = kv(4 * BS, seed=40, device=device, dtype=dtype)
    y[:, :, : 3 * BS] = x
    for layer in range(LAYERS):
        by_block.append_blocks(longer, layer, as_blocks(y, layer, 3, 1))
    assert_gathers(by_block, longer, y)


def test_whole_blocks_into_a_block_another_sequence_is_writing_keep_its_tokens() -> None:
    """A sequence that shares blocks another is still writing (the same prompt, added before
    the first finished): its whole blocks fill the rest of them, and the tokens already there
    stay the writer's."""
    bm = manager()
    tokens = np.arange(2 * BS)
    x = kv(2 * BS, seed=41)
    writer = bm.add_sequence(tokens)
    bm.append(writer, 0, x[0, 0, :5], x[0, 1, :5])
    reader = bm.add_sequence(tokens)
    other = x.clone()
    other[0, :, :5] += 1.0  # what the writer wrote wins where it wrote
    bm.append_blocks(reader, 0, as_blocks(other, 0, 0, 2))
    k, v = bm.gather(reader, 0)
    assert torch.equal(k, x[0, 0]) and torch.equal(v, x[0, 1])


@pytest.mark.parametrize("encode", [False, True])
def test_bad_whole_blocks_are_refused_saying_what_was_expected_and_store_nothing(
    encode: bool,
) -> None:
    bm = manager(ladder=("fp16", "int8", "int4"), keep_leaves=1)  # block 1 is no chain end
    seq = bm.add_sequence(np.arange(3 * BS))
    x = kv(3 * BS, seed=42)
    good = as_blocks(x, 0, 0, 2)
    k_nan, v_inf = good.clone(), good.clone()
    k_nan[1, 0, 1, 3, 5] = float("nan")
    v_inf[0, 1, 0, 0, 0] = float("inf")
    cases = [
        (k_nan, "expected finite values, got NaN or inf in K"),
        (v_inf, "expected finite values, got NaN or inf in V"),
        (good[:, :, :1], r"expected shape \[num_blocks, 2, 2 kv_heads, 16 block_size"),
        (good.float(), "expected dtype torch.float16"),
    ]
    before = snapshot(bm)
    levels = bm.core.block_info(bm.core.sequence_blocks(seq))["level"]
    for blocks, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            bm.append_blocks(seq, 0, blocks, encode=encode)
        assert_same(before, snapshot(bm))
        assert (bm.core.block_info(bm.core.sequence_blocks(seq))["level"] == levels).all()
    bm.append(seq, 1, x[1, 0, :3], x[1, 1, :3])
    with pytest.raises(InvalidArgumentError, match="holds 3 tokens, not whole blocks of 16"):
        bm.append_blocks(seq, 1, as_blocks(x, 1, 0, 1), encode=encode)
    bm.append_blocks(seq, 0, good, encode=encode)  # the retry with good blocks stores them
    assert bm.num_tokens(seq, 0) == 2 * BS
    placed = bm.core.block_info(bm.core.sequence_blocks(seq))["level"]
    assert placed.tolist() == ([0, 1, 0] if encode else [0, 0, 0])  # the sink stays at 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_encoded_whole_blocks_land_below_level_0_as_their_codec_encodes_them(
    request: Any, device: str
) -> None:
    """A save's blocks (``append_blocks`` with ``encode``) go where a cached block settles:
    the chain's ends (its sink and its last two blocks) at level 0, the next two at int8 (its
    two slots), the one after at int4; each layer is encoded where the K/V lies (on CUDA, by the
    kernels; only encoded bytes cross) and gathers as the codec decodes it, with the key-norm
    signal of a plain append. Freed, the prompt is cached whole; a prompt that shares it
    appends its next blocks encoded too."""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    shape = BlockShape(LAYERS, HEADS, BS, DIM, "bf16")
    int8 = 2.5 * get_codec("int8").bytes_per_block(shape) / (64 * shape.fp16_bytes)
    shares = (0.4, int8, 0.6 - int8)  # int8: 2 slots
    x = kv(6 * BS, seed=43, device=device, dtype=torch.bfloat16)
    tokens = np.arange(6 * BS)
    bm = manager(dtype=torch.bfloat16, ladder=("bf16", "int8", "int4"), pool_shares=shares)
    plain = manager(dtype=torch.bfloat16, ladder=("bf16", "int8", "int4"), pool_shares=shares)
    seq, ref = bm.add_sequence(tokens), plain.add_sequence(tokens)
    for layer in range(LAYERS):
        bm.append_blocks(seq, layer, as_blocks(x, layer, 0, 6), encode=True)
        plain.append_blocks(ref, layer, as_blocks(x, layer, 0, 6).cpu())
    blocks = bm.core.sequence_blocks(seq)
    levels = bm.core.block_info(blocks)["level"].tolist()
    assert levels == [0, 1, 1, 2, 0, 0]
    for layer in range(LAYERS):
        got = bm.gather_blocks(seq, layer)
        for i, level in enumerate(levels):
            codec = get_codec(bm.ladder[level])
            whole = as_blocks(x, layer, i, 1).cpu()[:, None]
            want = codec.decode(codec.encode(whole))[:, 0]
            assert torch.equal(got[i : i + 1], want), (layer, i)
    np.testing.assert_allclose(
        bm.ledger.magnitude(blocks),
        plain.ledger.magnitude(plain.core.sequence_blocks(ref)),
        rtol=1e-4,
    )
    bm.free(seq)
    assert bm.lookup(tokens) == 6 * BS
    longer = bm.add_sequence(np.arange(9 * BS))
    y = kv(9 * BS, seed=44, device=device, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        bm.append_blocks(longer, layer, as_blocks(y, layer, 6, 3), encode=True)
    assert bm.num_tokens(longer, LAYERS - 1) == 9 * BS
    new = bm.core.sequence_blocks(longer)[6:]
    assert bm.core.block_info(new)["level"].tolist() == [
        2,
        0,
        0,
    ]  # int8 is full; the new ends at bf16
