"""A ``drop`` level: the lowest-ranked blocks leave attention (``drop_ratio``), in a
BlockManager and in SmolLM2 through a TieredCache.

The oracle for the model: the same tokens run in one forward pass with no cache and a 4-D mask
that hides exactly the dropped positions from the scored queries. RoPE is already in the keys, so
attention over the blocks left must give that pass's logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier import BlockManager, KvtierConfig  # noqa: E402
from kvtier.errors import ConfigError, InvalidArgumentError  # noqa: E402

BS = 4
DROPPING = KvtierConfig(
    ladder="fp32,drop", drop_ratio=0.5, block_size=BS, recent_window=8, sink_blocks=1
)


def manager(config: KvtierConfig = DROPPING, layers: int = 2) -> BlockManager:
    return BlockManager(config, layers, 2, 64, dtype=torch.float32, device="cpu")


def filled(bm: BlockManager, tokens: int = 40) -> tuple[int, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, 2, 64, generator=gen)
    v = torch.randn(tokens, 2, 64, generator=gen)
    s = bm.add_sequence()
    for layer in range(bm.shape.layers):
        bm.append(s, layer, k, v)
    return s, k, v


def dropped_blocks(bm: BlockManager, seq: int) -> np.ndarray:
    info = bm.core.block_info(bm.core.sequence_blocks(seq))
    return np.nonzero(info["level"] == bm.drop_level)[0]


def test_the_lowest_ranked_half_leaves_and_the_rest_is_exact():
    bm = manager()
    s, k, v = filled(bm)  # 10 blocks: the sink, 7 ranked, 2 in the recent window
    assert bm.step()["drop"] == 4  # round(0.5 * 7)
    gone = dropped_blocks(bm, s)
    assert 0 not in gone and not {8, 9} & set(gone.tolist()), "sink and window stay"
    keep = np.ones(40, dtype=bool)
    for b in gone:
        keep[b * BS : (b + 1) * BS] = False
    K, V = bm.gather(s, 1)
    assert torch.equal(K, k[keep]) and torch.equal(V, v[keep])
    assert bm.attended_tokens(s, 1) == int(keep.sum()) == 24
    assert bm.num_tokens(s, 1) == 40  # positions go on from the whole sequence
    stats = bm.stats()
    drop_pool = next(p for p in stats.pools if p.codec == "drop")
    assert (drop_pool.blocks, drop_pool.bytes) == (4, 0)
    assert stats.held_bytes == 6 * bm.level_bytes[0]
    assert stats.level0_bytes == 10 * bm.level_bytes[0]


def test_attend_skips_dropped_blocks_as_sdpa_over_the_kept_keys():
    bm = manager()
    s, _, _ = filled(bm)
    bm.step()
    q = torch.randn(3, 4, 64)  # 3 new queries, 4 query heads over 2 K/V heads
    out, mass = bm.attend(s, 0, q, return_mass=True)
    K, V = bm.gather(s, 0)
    K, V = K.repeat_interleave(2, 1), V.repeat_interleave(2, 1)
    n = K.shape[0]
    causal = torch.ones(3, n, dtype=torch.bool).tril(n - 3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1), attn_mask=causal
    ).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    gone = dropped_blocks(bm, s)
    assert (mass[0, gone] == 0).all() and mass[0].sum() == pytest.approx(1.0, abs=1e-5)


def test_drops_are_one_way_and_the_ratio_counts_those_already_gone():
    bm = manager()
    s, _, _ = filled(bm)
    bm.step()
    first = set(dropped_blocks(bm, s).tolist())
    more = torch.randn(16, 2, 64)
    for layer in range(2):
        bm.append(s, layer, more, more)
    bm.step()  # 14 blocks, 11 ranked: round(5.5) = 6 out, so 2 more
    now = set(dropped_blocks(bm, s).tolist())
    assert first < now and len(now) == 6
    assert bm.lookup(torch.arange(56).tolist()) <= min(now) * BS, "a dropped block is no hit"


@pytest.mark.parametrize("tokens", [32, 33])
def test_the_newest_block_never_drops_whatever_the_window(tokens: int) -> None:
    """With no window and no sink, a drop ratio of 1 would take every block out of attention
    (the query saw zeros, mass 0): the newest block, the one being written, always stays."""
    config = KvtierConfig(
        ladder="fp32,drop", drop_ratio=1.0, block_size=16, recent_window=0, sink_blocks=0
    )
    bm = manager(config, layers=1)
    s, k, v = filled(bm, tokens)
    bm.step()
    newest = (tokens - 1) // 16
    assert newest not in dropped_blocks(bm, s).tolist()
    assert len(dropped_blocks(bm, s)) == newest, "every other block left"
    K, V = bm.gather(s, 0)
    assert torch.equal(K, k[newest * 16 :]) and torch.equal(V, v[newest * 16 :])
    q = torch.randn(1, 4, 64)
    out, mass = bm.attend(s, 0, q, return_mass=True)
    assert mass[0, newest] == pytest.approx(1.0) and out.abs().sum() > 0
    # A chunk of queries reaching back past the kept block would see no key: refused.
    with pytest.raises(InvalidArgumentError, match=r"would see no key.*recent_window of at least"):
        bm.attend(s, 0, torch.randn(tokens - newest * 16 + 1, 4, 64))


def test_a_drop_level_must_be_last_and_a_drop_ratio_needs_one():
    with pytest.raises(ConfigError, match="'drop' must be the last level"):
        KvtierConfig(ladder="fp16,drop,int4")
    with pytest.raises(ConfigError, match=r"drop_ratio 0\.5: needs a ladder ending in a 'drop'"):
        KvtierConfig(ladder="fp16,int8,int4", drop_ratio=0.5)
    with pytest.raises(ConfigError, match="drop_ratio"):
        KvtierConfig(drop_ratio=1.5)


def test_without_a_drop_ratio_a_drop_level_only_relieves_the_budget():
    bm = manager(KvtierConfig(ladder="fp32,drop", block_size=BS, recent_window=8))
    s, _, _ = filled(bm)
    assert bm.step().get("drop", 0) == 0
    assert bm.attended_tokens(s) == 40


# -- SmolLM2 through a TieredCache -------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    pytest.importorskip("transformers")
    from kvtier.errors import MissingDependencyError
    from kvtier.eval import model as real

    try:
        real.smollm2_dir()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    from kvtier.integrations.hf import ATTENTION

    eager, tok = real.load_smollm2("eager")
    kernel, _ = real.load_smollm2(ATTENTION)
    return eager, kernel, real.wikitext_ids(tok, 512)[None]


@pytest.mark.hf
@pytest.mark.parametrize("attention", ["eager", "kvtier"])
@torch.no_grad()
def test_smollm2_attends_over_the_blocks_left_exactly(smollm2, attention):
    from kvtier.integrations.hf import TieredCache

    eager, kernel, text = smollm2
    model = eager if attention == "eager" else kernel
    config = KvtierConfig(
        ladder="fp32,drop", drop_ratio=0.5, block_size=16, recent_window=32, policy="h2o"
    )
    ids = text[:, :272]
    cache = TieredCache(model, config)
    model(ids[:, :256], past_key_values=cache, use_cache=True)  # the prefill, then a step
    assert cache.moves.get("drop", 0) > 0
    seq = cache.sequences[0]
    gone = dropped_blocks(cache.manager, seq)
    assert len(gone) == 7  # 16 blocks: the sink, 2 in the window, 13 ranked: 6.5 rounds up
    got = model(ids[:, 256:], past_key_values=cache, use_cache=True).logits[0]
    # The oracle: one pass, no cache, the dropped positions hidden from the last 16 queries.
    allowed = torch.ones(272, 272, dtype=torch.bool).tril()
    for b in gone:
        allowed[256:, b * 16 : (b + 1) * 16] = False
    mask = torch.zeros(1, 1, 272, 272).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = eager(ids, attention_mask=mask, use_cache=False).logits[0, 256:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    full = eager(ids, use_cache=False).logits[0, 256:]
    assert (got - full).abs().max() > 1e-2, "the dropped blocks must have mattered"


@pytest.mark.hf
@torch.no_grad()
def test_a_padded_batch_and_crop_are_refused_once_blocks_drop(smollm2):
    from kvtier.integrations.hf import TieredCache

    eager, _, text = smollm2
    config = KvtierConfig(ladder="fp32,drop", drop_ratio=0.5, block_size=16, recent_window=32)
    ids = text[:, :128]
    cache = TieredCache(eager, config)
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[1, :5] = 0
    with pytest.raises(InvalidArgumentError, match="padded"):
        eager(ids.repeat(2, 1), attention_mask=mask, past_key_values=cache, use_cache=True)
    cache = TieredCache(eager, config)
    eager(ids, past_key_values=cache, use_cache=True)
    assert cache.moves.get("drop", 0) > 0
    with pytest.raises(InvalidArgumentError, match="crop"):
        cache.crop(-4)
