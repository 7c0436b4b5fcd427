"""``attn_implementation="kvtier"``: SmolLM2's attention over a TieredCache's blocks.

Marked ``hf``. The oracles: DynamicCache with sdpa (at level 0 the tokens must be the same), and
the gather path over the same compressed blocks (the logits must agree to rounding).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from test_hf_cache import (  # noqa: E402
    COMPRESSED,
    EXACT,
    PROMPT,
    generate,
    prompt_ids,
)
from transformers import DynamicCache  # noqa: E402

from kvtier import BlockManager  # noqa: E402
from kvtier.errors import ConfigError, MissingDependencyError  # noqa: E402
from kvtier.eval import model as real  # noqa: E402
from kvtier.integrations.hf import ATTENTION, TieredCache  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("model_threads")]


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any, Any]:
    """SmolLM2 with sdpa, the same weights with kvtier attention, and the tokenizer."""
    try:
        real.smollm2_dir()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    sdpa, tok = real.load_smollm2()
    kvtier, _ = real.load_smollm2(ATTENTION)
    return sdpa, kvtier, tok


@pytest.fixture
def no_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention over the blocks must never gather them."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("gather called: attention should read the blocks where they lie")

    monkeypatch.setattr(BlockManager, "gather", refuse)


def test_level0_generate_is_dynamic_cache_token_for_token(models, no_gather):
    sdpa, model, tok = models
    ids = prompt_ids(tok)
    reference = generate(sdpa, ids, DynamicCache(config=sdpa.config), max_new_tokens=40)
    cache = TieredCache(model, EXACT)
    assert cache.attend
    out = generate(model, ids, cache, max_new_tokens=40)
    assert out.tolist() == reference.tolist()
    assert cache.get_seq_length() == out.shape[1] - 1


@torch.no_grad()
def test_compressed_blocks_give_the_gather_paths_logits(models):
    """Prefill, then chunks and single tokens with a step after each, so int8/int4 blocks are
    read both ways. The two ways round fp32 sums differently, and a K/V value that differs in
    its last bits can fall on the other side of an int4 step when its block is compressed: the
    logits agree within 1e-2 (of values ~10), the predictions everywhere."""
    sdpa, model, tok = models
    ids = prompt_ids(tok, " ".join([PROMPT] * 6))
    logits = []
    for m, attend in ((sdpa, False), (model, True)):
        cache = TieredCache(m, COMPRESSED)
        assert cache.attend is attend
        out = [m(ids[:, :40], past_key_values=cache, use_cache=True).logits]
        for start, stop in ((40, 52), (52, 53), (53, 54), (54, ids.shape[1])):
            out.append(m(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
        assert sum(cache.kv_bytes()["blocks"][1:]) > 0, "some blocks are compressed"
        logits.append(torch.cat(out, 1))
        cache.close()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-2)
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).all()


def test_the_kernels_attention_mass_reaches_the_scheduler(models):
    """With sdpa no attention weights exist; kvtier attention reports the mass each block got,
    so h2o ranks blocks with no eager attention and no hook."""
    sdpa, model, tok = models
    ids = prompt_ids(tok, PROMPT + " " + PROMPT)
    config = COMPRESSED.replace(policy="h2o")
    scores = {}
    for name, m in (("sdpa", sdpa), ("kvtier", model)):
        cache = TieredCache(m, config)
        with torch.no_grad():
            m(ids, past_key_values=cache, use_cache=True)
        bm = cache.manager
        scores[name] = bm.core.block_info(bm.core.sequence_blocks(cache.sequences[0]))["score"]
    assert not scores["sdpa"].any()
    assert scores["kvtier"].argmax() == 0 and scores["kvtier"].min() < scores["kvtier"].max()


def test_padded_batches_and_beams_match_dynamic_cache(models):
    sdpa, model, tok = models
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(
        ["Hello, my name is", "The capital of France is a city that"],
        return_tensors="pt",
        padding=True,
    )
    kw = {"attention_mask": enc.attention_mask}
    ref = generate(sdpa, enc.input_ids, DynamicCache(config=sdpa.config), **kw)
    out = generate(model, enc.input_ids, TieredCache(model, EXACT), **kw)
    assert out.tolist() == ref.tolist()  # padding: sdpa over gathered K/V with the mask
    ids = prompt_ids(tok)
    beams = {"num_beams": 3, "max_new_tokens": 16}
    ref = generate(sdpa, ids, DynamicCache(config=sdpa.config), **beams)
    assert generate(model, ids, TieredCache(model, EXACT), **beams).tolist() == ref.tolist()


def test_kvtier_attention_without_a_tiered_cache_is_sdpa(models):
    sdpa, model, tok = models
    ids = prompt_ids(tok)
    ref = generate(sdpa, ids, DynamicCache(config=sdpa.config))
    assert generate(model, ids, DynamicCache(config=model.config)).tolist() == ref.tolist()


def test_a_direct_update_reaches_no_later_forward(models):
    """``update`` called outside a forward (to seed a cache, say) hands its keys to no
    attention: the model's next forward, with a DynamicCache or with no cache, is sdpa's."""
    sdpa, model, tok = models
    ids = prompt_ids(tok)
    ref = generate(sdpa, ids, DynamicCache(config=sdpa.config), max_new_tokens=4)
    cache = TieredCache(model, EXACT)
    assert cache.attend
    keys = torch.randn(1, cache.num_kv_heads, 3, cache.head_dim)
    cache.update(keys, keys.clone(), 0)
    out = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=4)
    assert out.tolist() == ref.tolist()
    cache.update(keys, keys.clone(), 0)
    with torch.no_grad():
        got, want = model(ids, use_cache=False).logits, sdpa(ids, use_cache=False).logits
    torch.testing.assert_close(got, want)


def test_attend_needs_the_kvtier_implementation(models):
    sdpa, _, _ = models
    with pytest.raises(ConfigError, match="attn_implementation='kvtier'"):
        TieredCache(sdpa, EXACT, attend=True)
    assert not TieredCache(sdpa, EXACT).attend
