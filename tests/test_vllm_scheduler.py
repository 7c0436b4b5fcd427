"""``KVTierConnector`` under vLLM's real ``Scheduler``, step by step, for what an engine run
reaches only by chance: preemption, chunked prefill, aborted requests, background (async)
loads that finish out of order or fail.

The engine here is vLLM's own scheduler and block pool with both sides of the connector in this
process; only the model is replaced, by a stand-in that writes, for each token it computes, K/V
that are a function of the token's whole prefix into the paged cache (a CUDA-style ``[B, H, N,
2D]`` layout, K in the first half of the channels), and before each step checks every token it
did not compute this step: a token vLLM counts as computed must hold its prefix's K/V, whether
vLLM's prefix cache kept it, kvtier loaded it, or vLLM recomputed it after a load error. Wrong
K/V anywhere fails the test at the step it would have been read."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_engines import vllm_block_hashes

pytestmark = pytest.mark.vllm

BLOCK = 32
HEADS = 3  # SmolLM2's KV heads (its config is the model's: 9 query heads)
HEAD_DIM = 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def kv_of(prefix: tuple[int, ...]) -> Any:
    """The stand-in model's K/V for the last token of ``prefix``: ``[HEADS, 2 * HEAD_DIM]``
    small integers (exact in bf16), different for different prefixes."""
    import torch

    digest = hashlib.blake2b(repr(prefix).encode(), digest_size=HEADS * 2 * HEAD_DIM).digest()
    return (torch.tensor(list(digest), dtype=torch.float32) - 128).view(HEADS, 2 * HEAD_DIM)


class Engine:
    """vLLM's scheduler and the connector's two sides, stepped by hand."""

    def __init__(
        self,
        model_dir: Any,
        *,
        num_blocks: int,
        max_tokens_per_step: int = 4 * BLOCK,
        prefix_caching: bool = True,
        tensor_parallel: int = 1,
        atol: float = 0.0,
        kv_events: bool = False,
        **extra: Any,
    ) -> None:
        """``kv_events``: vLLM's KV events on (the batches its scheduler publishes are kept in
        :attr:`published`)."""
        import copy

        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.integrations.vllm import KVTierConnector

        model = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0)
        config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=max_tokens_per_step,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVTierConnector",
                kv_connector_module_path="kvtier.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"ladder": "bf16", **extra},
            ),
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
        )
        config.cache_config.num_gpu_blocks = num_blocks
        # What the model's attention layers tell connectors: their backend (here a CUDA one's
        # name, whose cache splits K and V along the channels).
        backend = SimpleNamespace(get_name=lambda: "FLASH_ATTN")
        for name in LAYERS:
            config.compilation_config.static_forward_context[name] = SimpleNamespace(
                attn_backend=backend
            )
        # Each tensor-parallel worker holds its share of the KV heads.
        self.heads = HEADS // tensor_parallel
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=self.heads, head_size=HEAD_DIM, dtype=torch.bfloat16
        )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        #: the KV event batches vLLM's scheduler published (its own prefix cache's and the
        #: connector's), with ``kv_events``
        self.published: list[Any] = []
        self.scheduler.kv_event_publisher.publish = self.published.append  # type: ignore[method-assign]
        self.workers, self.caches = [], []
        for rank in range(tensor_parallel):
            worker_config = copy.copy(config)
            worker_config.parallel_config = copy.copy(config.parallel_config)
            worker_config.parallel_config.rank = rank
            worker = KVTierConnector(worker_config, KVConnectorRole.WORKER, kv_config)
            caches = {
                name: torch.zeros(num_blocks, self.heads, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
                for name in LAYERS
            }
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append(caches)
        # vLLM's own merge of the workers' reports (a request is done when every rank says so).
        self.aggregator = KVOutputAggregator(tensor_parallel)
        self.outputs: dict[str, list[int]] = {}
        self.atol = atol  # what a lossy level may change in a loaded value (0: exact)
        self.checked_tokens = 0
        self.preempted = 0
        #: vLLM's external-hit figures, as its scheduler reported them each step
        self.external_hits = 0
        self.hits_by_source: dict[str, int] = {}
        #: the connector's counters as vLLM's scheduler passed them on (to its Prometheus
        #: counters and logs), the workers' added up by vLLM's own aggregator
        self.counted: dict[str, int] = {}

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def worker(self) -> Any:
        """Rank 0's worker-side connector."""
        return self.workers[0]

    @property
    def tiers(self) -> Any:
        """Rank 0's tiers (its manager, layout and caches)."""
        return self.worker.worker.tiers

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 4,
        salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Adds a request; ``kv_transfer_params`` as a client passes them (a server request's
        field, or ``SamplingParams.extra_args``)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        request = Request(req_id, prompt, params, None, cache_salt=salt, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        self.outputs[req_id] = []

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self, before_finish: Callable[[], None] | None = None) -> Any:
        """One engine step: schedule, load, check and compute, save, report back (every
        tensor-parallel worker does each; ``before_finish`` runs before they report)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.scheduler
        out = sched.schedule()
        self.preempted += len(out.preempted_req_ids or ())
        for worker in self.workers:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = {}
        for layer in LAYERS:  # the forward pass, a layer at a time as vLLM's
            for worker in self.workers:
                worker.wait_for_layer_load(layer)
            for req_id, start in starts.items():
                request = sched.requests[req_id]
                end = start + out.num_scheduled_tokens[req_id]
                tokens = list(request.all_token_ids)
                blocks = sched.kv_cache_manager.get_block_ids(req_id)[0]
                self._check(layer, tokens[:start], blocks)
                self._compute(layer, tokens, start, end, blocks)
                if end >= request.num_prompt_tokens:  # a token is sampled
                    sampled[req_id] = 10 + sum(tokens) % 997
        for worker in self.workers:
            worker.wait_for_save()
        if before_finish is not None:
            before_finish()
        ids = list(starts)
        results = []
        for worker in self.workers:
            sending, recving = worker.get_finished(out.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            results.append(
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending,
                        finished_recving=recving,
                        invalid_block_ids=invalid,
                        kv_connector_stats=worker.get_kv_connector_stats(),
                        kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                    ),
                )
            )
        for req_id in sampled:
            self.outputs[req_id].append(sampled[req_id])
        reports = sched.update_from_output(out, self.aggregator.aggregate(results))
        for report in reports.values():
            counted = report.scheduler_stats and report.scheduler_stats.kv_connector_stats
            for name, n in (counted or {}).items():
                self.counted[name] = self.counted.get(name, 0) + n
            hits = report.scheduler_stats and report.scheduler_stats.connector_prefix_cache_stats
            if hits:
                self.external_hits += hits.hits
                for source, n in hits.hits_by_source.items():
                    self.hits_by_source[source.value] = self.hits_by_source.get(source.value, 0) + n
        return out

    def run(self, timeout: float = 60.0) -> None:
        """Steps until every request is done; a step with nothing to run waits a little for
        background loads (real threads)."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests():
            assert time.monotonic() < deadline, "the requests did not finish"
            if not self.step().total_num_scheduled_tokens:
                time.sleep(0.01)

    def _compute(
        self, layer: str, tokens: list[int], start: int, end: int, blocks: list[int]
    ) -> None:
        for i in range(start, end):
            kv = kv_of(tuple(tokens[: i + 1]))
            for rank, caches in enumerate(self.caches):
                caches[layer][blocks[i // BLOCK], :, i % BLOCK] = kv[self._heads(rank)]

    def _check(self, layer: str, tokens: list[int], blocks: list[int]) -> None:
        """Every computed token holds its prefix's K/V in ``layer`` of every rank."""
        import torch

        for i in range(len(tokens)):
            want = kv_of(tuple(tokens[: i + 1])).to(torch.bfloat16)
            for rank, caches in enumerate(self.caches):
                got = caches[layer][blocks[i // BLOCK], :, i % BLOCK].float()
                error = (got - want[self._heads(rank)].float()).abs().max().item()
                assert error <= self.atol, f"wrong K/V for token {i} in {layer} of rank {rank}"
        self.checked_tokens += len(tokens)

    def _heads(self, rank: int) -> slice:
        return slice(rank * self.heads, (rank + 1) * self.heads)

    def blocks_in_use(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()


@pytest.fixture
def engine_factory(vllm_model_dir: Any) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        engine = Engine(vllm_model_dir, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def prompt(seed: int, blocks: int, extra: int = 5) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 20000 for i in range(blocks * BLOCK + extra)]


def stats(engine: Engine) -> dict[str, Any]:
    return dict(engine.connector.get_compression_stats()["connector"])


class GatedLoader:
    """An executor that runs submitted loads only when the test says, in the order it says:
    the connector's background loads, finishing when a slow disk or server would let them."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self.pending.append(lambda: fn(*args))

    def run(self, index: int) -> None:
        self.pending.pop(index)()

    def shutdown(self, wait: bool = True) -> None:
        while self.pending:
            self.run(0)


def test_chunked_prefill_and_preemption_reload_the_right_kv(
    engine_factory: Callable[..., Engine],
) -> None:
    """Prompts prefilled in chunks in a pool too small for all of them: vLLM preempts some and
    resumes them later; the connector loads what it saved of their prompts into the new blocks
    (vLLM's own prefix cache is off here, so that only kvtier can serve them). Every token read
    holds its prefix's K/V."""
    engine = engine_factory(num_blocks=16, max_tokens_per_step=2 * BLOCK, prefix_caching=False)
    for i in range(4):
        engine.add(f"r{i}", prompt(i, 3), max_tokens=80)
    engine.run()
    assert engine.preempted > 0 and engine.blocks_in_use() == 0
    counters = stats(engine)
    assert counters["saved_blocks"] >= 4 * 3
    assert counters["loaded_blocks"] > 0, counters  # a resumed request loaded its prompt
    assert counters["load_errors"] == 0
    assert all(len(out) == 80 for out in engine.outputs.values())


def saved_and_forgotten(engine: Engine, *prompts: list[int]) -> None:
    """Runs ``prompts`` (the connector saves them), then empties vLLM's prefix cache."""
    for i, p in enumerate(prompts):
        engine.add(f"first-{i}", p)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()


def test_a_prompt_whose_tokens_do_not_say_its_kv_is_neither_loaded_nor_saved(
    engine_factory: Callable[..., Engine],
) -> None:
    """kvtier keys blocks by token ids: an image's placeholder ids (or prompt embeddings) are
    the same for other pixels, so such a request must miss, or it would read another image's
    K/V. The same token ids without them hit."""
    import torch
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    engine = engine_factory(num_blocks=16)
    p = prompt(7, 3)
    saved_and_forgotten(engine, p)
    params = SamplingParams(max_tokens=4)
    plain = Request("plain", p, params, None, block_hasher=engine.hasher)
    assert engine.connector.get_num_new_matched_tokens(plain, 0)[0] == 3 * BLOCK
    image = MultiModalFeatureSpec(None, "image", "pixels-a", PlaceholderRange(offset=0, length=8))
    pictured = Request("image", p, params, None, mm_features=[image], block_hasher=engine.hasher)
    embedded = Request(
        "embeds", p, params, None, prompt_embeds=torch.zeros(len(p), 8), block_hasher=engine.hasher
    )
    for request in (pictured, embedded):
        assert engine.connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_background_loads_that_finish_out_of_order(
    engine_factory: Callable[..., Engine],
) -> None:
    """Two requests whose prompts load in the background wait while a third runs; their loads
    finish in the opposite order, and each request resumes when its own is done."""
    engine = engine_factory(num_blocks=64, async_loads="always")
    engine.worker.worker.loader = loader = GatedLoader()
    a, b, c = prompt(1, 3), prompt(2, 2), prompt(3, 2)
    saved_and_forgotten(engine, a, b)
    engine.add("a", a)
    engine.add("b", b)
    engine.step()
    assert len(loader.pending) == 2  # both wait for their loads
    engine.add("c", c)
    engine.step()
    assert engine.scheduler.requests["c"].num_computed_tokens > 0  # c runs meanwhile
    engine.step(before_finish=lambda: loader.run(1))  # b's load finishes first
    engine.step()
    assert engine.outputs["b"] and not engine.outputs["a"]
    engine.step(before_finish=lambda: loader.run(0))
    engine.run()
    counters = stats(engine)
    assert counters["loaded_blocks"] == (len(a) - 1) // BLOCK + (len(b) - 1) // BLOCK
    assert counters["load_errors"] == 0
    assert engine.blocks_in_use() == 0


def test_an_aborted_request_keeps_its_blocks_until_its_background_load_is_over(
    engine_factory: Callable[..., Engine],
) -> None:
    """A request aborted while its load runs keeps its blocks (the load writes into them) until
    the worker reports the load over; a running request aborted mid-prefill frees at once."""
    engine = engine_factory(num_blocks=64, async_loads="always")
    engine.worker.worker.loader = loader = GatedLoader()
    saved_and_forgotten(engine, prompt(4, 3))
    engine.add("a", prompt(4, 3))
    engine.step()
    assert len(loader.pending) == 1 and engine.blocks_in_use() > 0
    engine.abort("a")
    engine.step()
    assert engine.blocks_in_use() > 0
    engine.step(before_finish=lambda: loader.run(0))
    assert engine.blocks_in_use() == 0 and not engine.scheduler.requests
    engine.add("d", prompt(5, 6))
    engine.step()
    assert engine.blocks_in_use() > 0
    engine.abort("d")
    engine.run()
    assert engine.blocks_in_use() == 0 and not engine.scheduler.requests


def test_hits_on_disk_load_in_the_background_and_lost_files_are_recomputed(
    engine_factory: Callable[..., Engine], tmp_path: Any
) -> None:
    """A host tier of four blocks with a disk tier behind it: blocks the core offloaded load in
    the background (``async_loads`` auto), exactly. With the files gone, the blocks are load
    errors reported with their request, and vLLM recomputes them."""
    engine = engine_factory(
        num_blocks=64, host_budget="24KiB", disk_budget="16MiB", disk_path=str(tmp_path)
    )
    a, b = prompt(6, 3), prompt(7, 3)
    saved_and_forgotten(engine, a, b)
    pools = {
        (p["tier"], p["level"]): p["blocks"] for p in engine.worker.get_compression_stats()["pools"]
    }
    assert pools.get(("disk", 0), 0) > 0, pools
    engine.add("a", a)
    engine.step()
    assert engine.scheduler.requests["a"].status.name == "WAITING_FOR_REMOTE_KVS"
    engine.run()
    counters = stats(engine)
    assert counters["loaded_blocks"] == (len(a) - 1) // BLOCK and counters["load_errors"] == 0
    assert engine.scheduler.reset_prefix_cache()
    for f in tmp_path.rglob("*"):
        if f.is_file():
            f.unlink()
    engine.add("a again", a)  # a's blocks, or b's, are on disk
    engine.add("b", b)
    engine.run()
    after = stats(engine)
    assert after["load_errors"] > 0
    assert engine.blocks_in_use() == 0


def test_hits_are_reported_by_the_tier_and_level_the_lookup_found_them_in(
    engine_factory: Callable[..., Engine], tmp_path: Any
) -> None:
    """A host tier of four blocks with a disk tier behind it, two prompts of three blocks: the
    connector tells vLLM how many of each prompt's loaded tokens came from host memory and how
    many from disk (vLLM's ``vllm:prompt_tokens_cached_by_source``), adding up to vLLM's
    external hits, and its own figures split them by tier and level the same way."""
    engine = engine_factory(
        num_blocks=64, host_budget="24KiB", disk_budget="16MiB", disk_path=str(tmp_path)
    )
    a, b = prompt(12, 3), prompt(13, 3)
    saved_and_forgotten(engine, a, b)
    before = engine.connector.get_compression_stats()["connector"]
    # Where the worker's tiers hold each prompt's blocks now (both are looked up in one step).
    want: dict[str, int] = {}
    for p in (a, b):
        for (tier, _), n in engine.tiers.lookup(p[:-1]).places(0, len(p)).items():
            want[tier] = want.get(tier, 0) + n
    assert want["host"] > 0 and want["disk"] > 0, want
    engine.external_hits, engine.hits_by_source = 0, {}
    engine.add("a", a)
    engine.add("b", b)
    engine.run()
    assert stats(engine)["load_errors"] == 0
    assert engine.external_hits == 6 * BLOCK
    assert engine.hits_by_source == want  # vLLM files a mismatch under external_unspecified
    after = engine.connector.get_compression_stats()["connector"]
    gained = {
        t: n - before["hit_tokens_by_tier"][t] for t, n in after["hit_tokens_by_tier"].items()
    }
    assert gained == want
    assert after["hit_tokens_by_level"] == {"bf16": after["hit_tokens"]}


def test_blocks_slower_to_load_than_to_recompute_are_recomputed(
    engine_factory: Callable[..., Engine], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector offers vLLM only the leading tokens whose load has been faster than their
    recompute, by what the worker measured (its prefill steps, its loads by place). Here
    loads pay by far, so the disk is made slow: the worker's measured disk figure raised to
    ten recomputes a token, as on a machine whose disk is slower than its prefill. Each
    prompt then loads the blocks in host memory before its first block on disk and no more;
    vLLM recomputes the rest (the stand-in model checks every token's K/V), and the
    connector counts what it held and did not offer."""
    from kvtier.integrations.vllm.link import LoadCosts

    engine = engine_factory(
        num_blocks=64, host_budget="24KiB", disk_budget="16MiB", disk_path=str(tmp_path)
    )
    a, b = prompt(14, 3), prompt(15, 3)
    saved_and_forgotten(engine, a, b)
    worker = engine.worker.worker
    measured = worker.costs()
    assert measured.recompute is not None and measured.recompute > 0  # timed, not assumed
    load = (
        *(p for p in measured.load if p[0] != "disk"),
        ("disk", "bf16", 10 * measured.recompute),
    )
    monkeypatch.setattr(worker, "costs", lambda: LoadCosts(load, measured.recompute))
    held = [engine.tiers.lookup(p[:-1]) for p in (a, b)]
    assert any(h.resident < h.tokens for h in held), held  # some block on disk
    before, checked = stats(engine), engine.checked_tokens
    engine.external_hits, engine.hits_by_source = 0, {}
    engine.add("a", a)
    engine.add("b", b)
    engine.run()
    after = stats(engine)
    assert engine.external_hits == sum(h.resident for h in held)
    assert engine.hits_by_source.get("disk", 0) == 0
    assert after["unpaid_tokens"] - before["unpaid_tokens"] == sum(
        h.tokens - h.resident for h in held
    )
    assert (
        after["loaded_blocks"] - before["loaded_blocks"] == sum(h.resident for h in held) // BLOCK
    )
    assert after["load_errors"] == 0 and engine.checked_tokens > checked


def test_hit_sources_name_each_tier_as_vllm_does_and_ranks_load_from_the_farthest() -> None:
    """Without an engine: the connector's tiers as vLLM's source labels (the server, a store,
    is ``external_unspecified``; tokens no tier accounts for too), the split of a hit by
    tier and level, and a tensor-parallel hit: as long as the shortest rank's, each block from
    the farthest tier any rank holds it in."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvtier.integrations.vllm import hit_sources
    from kvtier.integrations.vllm.link import Held, LoadCosts
    from kvtier.integrations.vllm.metrics import Counters

    places = {
        ("host", "bf16"): 64,
        ("host", "int4"): 32,
        ("disk", "int4"): 32,
        ("remote", "bf16"): 32,
    }
    assert hit_sources(places, 192) == {
        CacheHitSource.HOST: 96,
        CacheHitSource.DISK: 32,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 32 + 32,
    }
    assert hit_sources({}, 0) == {} and hit_sources({("host", "bf16"): 32}, 32) == {
        CacheHitSource.HOST: 32
    }

    rank0 = Held.of_blocks(
        [("host", "bf16"), ("host", "bf16"), ("host", "int4"), ("disk", "int4")], BLOCK
    )
    rank1 = Held.of_blocks([("host", "bf16"), ("disk", "int8"), ("host", "int4")], BLOCK)
    assert (rank0.tokens, rank0.resident) == (4 * BLOCK, 3 * BLOCK)
    assert rank0.places(BLOCK, 4 * BLOCK) == {
        ("host", "bf16"): BLOCK,
        ("host", "int4"): BLOCK,
        ("disk", "int4"): BLOCK,
    }
    both = Held.slowest([rank0, rank1])
    assert both.runs == (("host", "bf16", BLOCK), ("disk", "int8", BLOCK), ("host", "int4", BLOCK))
    assert (both.tokens, both.resident) == (3 * BLOCK, BLOCK)
    assert Held.slowest([rank0, Held()]).tokens == 0

    # What pays: a token saves 1 s loaded from host memory, costs 3 s more from disk.
    costs = LoadCosts((("host", "int4", 1.0), ("disk", "int4", 5.0)), recompute=2.0)
    places = [("host", "int4"), ("disk", "int4")] + [("host", "int4")] * 3
    held = Held.of_blocks(places, BLOCK, costs)
    assert held.paying(0) == 5 * BLOCK  # the three after the disk block make up for it
    assert Held.of_blocks(places[:4], BLOCK, costs).paying(0) == BLOCK  # two do not
    assert held.paying(BLOCK) == 5 * BLOCK  # from vLLM's own hit on: even, the longer
    assert Held.of_blocks(places[1:2], BLOCK, costs).paying(0) == 0
    assert held.paying(6 * BLOCK) == 6 * BLOCK  # vLLM holds more than the tiers
    assert Held.of_blocks(places, BLOCK).paying(0) == 5 * BLOCK  # nothing measured: all
    other = LoadCosts((("disk", "int4", 7.0), ("disk", "int8", 1.0)), recompute=1.0)
    both_costs = Held.slowest([held, Held.of_blocks(places, BLOCK, other)]).costs
    assert {(t, lv): s for t, lv, s in both_costs.load} == {
        ("host", "int4"): 1.0,
        ("disk", "int4"): 7.0,
        ("disk", "int8"): 1.0,
    }
    assert both_costs.recompute == 2.0

    counters = Counters()
    counters.count_hits(rank0.places(BLOCK, 4 * BLOCK))
    assert counters.hit_tokens == 3 * BLOCK
    assert counters.as_dict()["hit_tokens"] == 3 * BLOCK  # only numbers: vLLM adds them up
    assert counters.hits_by(["host", "disk"], ["bf16", "int8", "int4"]) == {
        "hit_tokens_by_tier": {"host": 2 * BLOCK, "disk": BLOCK},
        "hit_tokens_by_level": {"bf16": BLOCK, "int8": 0, "int4": 2 * BLOCK},
        "hit_tokens_by_tier_level": {
            "host": {"bf16": BLOCK, "int8": 0, "int4": BLOCK},
            "disk": {"bf16": 0, "int8": 0, "int4": BLOCK},
        },
    }


def test_a_finished_request_leaves_no_block_held_and_its_answer_is_saved_by_then(
    engine_factory: Callable[..., Engine],
) -> None:
    """The blocks a request generates are saved in the step that computes them, so that nothing
    of it is left to save when it finishes: vLLM frees its blocks in the step it finishes in,
    and a prefix-cache reset right then succeeds (what ``LLM.reset_prefix_cache()`` right after
    ``generate()`` does; a block kept for a save in a later step would make it fail). The next
    turn, prompt and answer, loads every block of both from the tiers, each token with its
    prefix's K/V."""
    engine = engine_factory(num_blocks=64)
    p = prompt(14, 2)  # two blocks and 5 tokens
    engine.add("a", p, max_tokens=40)
    while len(engine.outputs["a"]) < 40:
        engine.step()
    assert "a" not in engine.scheduler.requests
    assert engine.blocks_in_use() == 0
    assert engine.scheduler.reset_prefix_cache()
    computed = p + engine.outputs["a"][:-1]  # the last token sampled is never computed
    assert engine.tiers.lookup(computed).tokens == len(computed) // BLOCK * BLOCK == 3 * BLOCK
    before = stats(engine)["loaded_blocks"]
    engine.add("next turn", [*computed, 7, 8, 9])
    engine.run()
    assert stats(engine)["loaded_blocks"] - before == 3
    assert stats(engine)["load_errors"] == 0


def test_the_workers_figures_count_its_loads_and_claim_no_lookups(
    engine_factory: Callable[..., Engine],
) -> None:
    """The scheduler looks prompts up and counts the hit tokens by tier and level; the worker
    only loads what it is told to. So the worker-side connector's figures count the blocks it
    loaded and say nothing of lookups or hits (no zeros that read as "nothing was hit"), while
    the scheduler-side's carry both."""
    engine = engine_factory(num_blocks=64)
    a = prompt(15, 3)
    saved_and_forgotten(engine, a)
    engine.add("a", a)
    engine.run()
    scheduler_side = engine.connector.get_compression_stats()["connector"]
    worker_side = engine.worker.get_compression_stats()["connector"]
    assert scheduler_side["loaded_blocks"] == worker_side["loaded_blocks"] == 3
    assert scheduler_side["hit_tokens_by_tier"] == {"host": 3 * BLOCK}
    lookups = {"lookups", "hit_tokens", "hit_tokens_by_tier", "hit_tokens_by_level"}
    assert not lookups & worker_side.keys(), worker_side
    assert "hit_tokens_by_tier_level" not in worker_side


def test_a_cache_salt_shares_blocks_with_its_own_salt_only(
    engine_factory: Callable[..., Engine],
) -> None:
    """Requests of a tenant (vLLM's ``cache_salt``) load what requests of the same salt saved,
    never what another tenant or an unsalted request saved."""
    engine = engine_factory(num_blocks=64)
    a = prompt(8, 3)
    engine.add("tenant-a", a, salt="a")
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    loads = []
    for req_id, salt in [("tenant-b", "b"), ("unsalted", None), ("tenant-a again", "a")]:
        before = stats(engine)["loaded_blocks"]
        engine.add(req_id, a, salt=salt)
        engine.run()
        loads.append(stats(engine)["loaded_blocks"] - before)
        assert engine.scheduler.reset_prefix_cache()
    assert loads == [0, 0, (len(a) - 1) // BLOCK]


def first_channel_scorer(layer: int, keys: Any) -> Any:
    """A stand-in for a learned probe: a block's mean first key channel (shifted to be
    non-negative: the stand-in model's K lies in [-128, 127])."""
    return keys[..., 0].float().mean(dim=(1, 2)) + 128


def test_a_learned_scorer_decides_which_saved_blocks_keep_full_precision(
    engine_factory: Callable[..., Engine],
) -> None:
    """With ``"scorer"`` (and the importance weights on the learned signal only), the blocks
    the host tier demotes to make room are those the scorer ranks lowest: within each prompt,
    every block still at bf16 scored above every block at int8 (no sink nor chain end kept
    above the rest: the scorer alone decides)."""
    engine = engine_factory(
        num_blocks=64,
        host_budget="80KiB",  # 4 blocks at bf16, 14 at int8: the 16 blocks saved all stay
        ladder="bf16,int8",
        pool_shares="0.3,0.7",
        policy="importance",
        weights="0,1,0",
        sink_blocks=0,
        keep_leaves=0,
        scorer="test_vllm_scheduler:first_channel_scorer",
    )
    prompts = [prompt(20 + i, 4) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add(f"p{i}", p)
    engine.run()
    manager = engine.tiers.manager
    assert stats(engine)["saved_blocks"] == 16
    mixed = 0
    for p in prompts:
        blocks = manager.core.lookup_tokens(p)
        assert len(blocks) == 4
        levels = manager.core.block_info(blocks)["level"].tolist()
        scores = [
            float(
                sum(
                    kv_of(tuple(p[: i + 1]))[:, 0].mean() for i in range(j * BLOCK, (j + 1) * BLOCK)
                )
            )
            for j in range(len(blocks))
        ]
        kept = [s for s, level in zip(scores, levels, strict=True) if level == 0]
        demoted = [s for s, level in zip(scores, levels, strict=True) if level == 1]
        if kept and demoted:
            mixed += 1
            assert min(kept) > max(demoted), (levels, scores)
    assert mixed > 0


@pytest.mark.parametrize("sink_blocks", [1, 0])
def test_a_saved_prefix_keeps_its_sink_block_at_bf16_longest(
    engine_factory: Callable[..., Engine], sink_blocks: int
) -> None:
    """Saved prompts (their manager sequences freed) are cached blocks, demoted least recently
    used first to make room at bf16; the first block of each (``sink_blocks`` 1, the default)
    after every other, so that each prompt keeps its sink at bf16 while its other blocks go to
    int8. Without the rule (``sink_blocks`` 0) the oldest prompts' sinks go down first. A block
    a step, so that a save never needs more room at bf16 than the step before left (room for a
    whole prompt there would demote every block, sinks too: the rule never refuses room)."""
    engine = engine_factory(
        num_blocks=64,
        max_tokens_per_step=BLOCK,
        host_budget="80KiB",  # 4 blocks at bf16 (3 kept: 10 % headroom), 14 at int8
        ladder="bf16,int8",
        pool_shares="0.3,0.7",
        policy="lru",
        sink_blocks=sink_blocks,
        ends_level=0,  # the ends settle at bf16 (by default: at int8, the bottom here)
    )
    prompts = [prompt(40 + i, 4) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add(f"p{i}", p)
    engine.run()
    engine.tiers.manager.step()  # the step after the last save
    assert stats(engine)["saved_blocks"] == 12
    core = engine.tiers.manager.core
    levels = [core.block_info(core.lookup_tokens(p))["level"].tolist() for p in prompts]
    assert all(len(held) == 4 for held in levels), "demoted, every block still held"
    sinks_kept = [held[0] == 0 for held in levels]
    if sink_blocks:
        assert levels == [[0, 1, 1, 1]] * 3
    else:
        assert not all(sinks_kept), levels


def test_the_saves_staging_leaves_the_chains_ends_alone(
    engine_factory: Callable[..., Engine],
) -> None:
    """Under the connector's own shares with the chains' ends kept at level 0 (``ends_level``
    0), level 0 holds two steps' saves and a room for the ends. Ten saved prompts, a step at a
    time: each keeps its first and last blocks at bf16 (the room holds 35) and the rest settle
    at int8, each step's after it; the room the next step's saves ask for is the staging's, not
    the ends' (it took four sinks of twelve prompts in ``kvtier eval vllm`` when it was half of
    all level 0)."""
    engine = engine_factory(
        num_blocks=128,
        host_budget="3MiB",  # the ends' room: 7 % of it, 35 bf16 blocks
        ladder="bf16,int8",
        ends_level=0,
        keep_leaves=1,
    )
    prompts = [prompt(60 + i, 4) for i in range(10)]
    for i, p in enumerate(prompts):
        engine.add(f"p{i}", p)
    engine.run()
    engine.tiers.manager.step()  # the step after the last save
    core = engine.tiers.manager.core
    assert core.usage()[0][3] == 2 * 4 + 35  # level 0: two steps of 4 blocks, and the room
    levels = [core.block_info(core.lookup_tokens(p))["level"].tolist() for p in prompts]
    assert levels == [[0, 1, 1, 0]] * 10


def test_a_scorer_that_is_not_importable_is_refused(vllm_model_dir: Any) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="scorer: expected 'package"):
        Engine(vllm_model_dir, num_blocks=8, scorer="no_such_module:score")


def test_tensor_parallel_ranks_store_their_own_heads_and_a_rank_that_lost_blocks_recomputes(
    engine_factory: Callable[..., Engine], tmp_path: Any
) -> None:
    """Three tensor-parallel workers (SmolLM2's 9 heads), one KV head each: each saves and
    loads its own shard in tiers of its own (a namespace and a disk directory per rank). The
    scheduler's hit is the shortest of theirs. When one rank's blocks are gone, vLLM (its own
    merge of the workers' reports) recomputes them on every rank."""
    engine = engine_factory(
        num_blocks=64,
        tensor_parallel=3,
        host_budget="8KiB",
        disk_budget="16MiB",
        disk_path=str(tmp_path),
    )
    ranks = engine.workers
    namespaces = [w.worker.tiers.manager.config.namespace.split("|")[5] for w in ranks]
    assert namespaces == ["tp0of3", "tp1of3", "tp2of3"]
    a, b = prompt(9, 3), prompt(10, 3)
    saved_and_forgotten(engine, a, b)
    for w in ranks:
        assert w.worker.tiers.lookup(a[:-1]).tokens == 3 * BLOCK
    assert sorted(d.name for d in tmp_path.iterdir()) == ["tp0", "tp1", "tp2"]
    engine.add("a", a)
    engine.run()
    counters = stats(engine)
    assert counters["loaded_blocks"] == 3 and counters["load_errors"] == 0
    per_rank = engine.connector.get_compression_stats()["ranks"]
    assert [r["connector"]["loaded_blocks"] for r in per_rank] == [3, 3, 3]
    # Rank 1 loses its disk tier.
    assert engine.scheduler.reset_prefix_cache()
    for f in (tmp_path / "tp1").rglob("*"):
        if f.is_file():
            f.unlink()
    engine.add("a again", a)
    engine.add("b", b)
    engine.run()  # every token read on every rank holds its prefix's K/V
    per_rank = engine.connector.get_compression_stats()["ranks"]
    lost = [r["connector"]["load_errors"] for r in per_rank]
    assert [n > 0 for n in lost] == [False, True, False]
    # Rank 1's errors reach vLLM's counters (vllm:kvtier_load_errors_total) and the
    # connector's figures; the blocks loaded are counted once, not once a rank.
    assert engine.counted["load_errors"] == sum(lost) == stats(engine)["load_errors"]
    assert engine.counted["loaded_blocks"] == per_rank[0]["connector"]["loaded_blocks"]


def test_a_save_larger_than_level_0_is_written_in_pieces(
    engine_factory: Callable[..., Engine],
) -> None:
    """A host tier whose level 0 holds two blocks (the rest int8), a prompt of eight blocks
    prefilled in one step: the save goes in pieces, each demoted to make room for the next,
    and the whole prompt loads back."""
    engine = engine_factory(
        num_blocks=64,
        max_tokens_per_step=16 * BLOCK,
        host_budget="60KiB",
        ladder="bf16,int8",
        pool_shares="0.2,0.8",
        atol=1.0,  # int8 of values in [-128, 127]: half a step of 255 / 255
    )
    levels = {
        p["level"]: p["capacity_blocks"] for p in engine.worker.get_compression_stats()["pools"]
    }
    assert levels[0] == 2 and levels[1] >= 8, levels
    a = prompt(11, 8)
    saved_and_forgotten(engine, a)
    counters = stats(engine)
    assert counters["save_failures"] == 0 and counters["saved_blocks"] == 8
    engine.add("a", a)
    engine.run()
    counters = stats(engine)
    assert counters["loaded_blocks"] == 8
    # The lookup found most of them at int8, and says so.
    assert counters["hit_tokens_by_level"]["int8"] > counters["hit_tokens_by_level"]["bf16"]
    assert sum(counters["hit_tokens_by_level"].values()) == 8 * BLOCK


def _vllm_configs(model_dir: Any, *, kv_cache_dtype: str = "auto", **extra: Any) -> tuple[Any, Any]:
    """vLLM's config of an engine on the CPU with the connector (``extra``: its extra config),
    and the KV-cache config of the stand-in model's full-attention layers (16 blocks) in the
    dtype vLLM stores ``kv_cache_dtype`` as."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype=kv_cache_dtype),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(),
    )
    dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype)
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    return config, KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"ladder": "bf16,int3"}, r"kv_connector_extra_config: ladder: unknown codec 'int3'"),
        ({"kv_cache_dtype": "fp8"}, r"kv_cache_dtype: .* got 'fp8'"),
        ({"kv_cache_dtype": "fp8_e4m3"}, r"kv_cache_dtype: .* got 'fp8_e4m3'"),
        ({"kv_cache_dtype": "fp8_e5m2"}, r"kv_cache_dtype: .* got 'fp8_e5m2'"),
    ],
)
def test_settings_the_connector_cannot_serve_are_refused_naming_them(
    vllm_model_dir: Any, setting: dict[str, str], message: str
) -> None:
    """Through the connector's own constructor as vLLM calls it, in either role (before vLLM
    installs it): a ladder level that is no codec (once refused by the worker alone, naming
    the codec but not the setting), and a KV cache of fp8 (which vLLM's CPU backend stores,
    as uint8 with scales: once refused by the worker alone, as "dtype: expected one of fp16,
    bf16, fp32, got 'u8'"), whose bytes the connector's codecs do not read. The configs are
    vLLM's own; no weights are loaded."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm import KVTierConnector

    config, kv_config = _vllm_configs(vllm_model_dir, host_budget="1MiB", **setting)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=message):
            KVTierConnector(config, role, kv_config)


@pytest.mark.parametrize("case", ["hybrid", "sliding_window", "mla", "pipeline_parallel"])
def test_models_and_layouts_it_cannot_serve_are_refused_clearly(
    vllm_model_dir: Any, case: str
) -> None:
    """The refusals the README advertises, through the connector's own constructor as vLLM
    calls it (either role): a hybrid model (two KV-cache groups), a sliding-window one, MLA's
    latent cache, pipeline parallelism. The configs are vLLM's own; no weights are loaded."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm import KVTierConnector

    config, _ = _vllm_configs(vllm_model_dir)
    shape = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD_DIM}
    full = FullAttentionSpec(**shape, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(**shape, dtype=torch.bfloat16, sliding_window=64)
    groups = {
        "hybrid": [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], sliding)],
        "sliding_window": [KVCacheGroupSpec(list(LAYERS), sliding)],
        "mla": [
            KVCacheGroupSpec(
                list(LAYERS),
                MLAAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
                ),
            )
        ],
        "pipeline_parallel": [KVCacheGroupSpec(list(LAYERS), full)],
    }[case]
    if case == "pipeline_parallel":
        config.parallel_config.pipeline_parallel_size = 2
    kv_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    expected = {
        "hybrid": "one KV-cache group",
        "sliding_window": "SlidingWindowSpec",
        "mla": "MLAAttentionSpec",
        "pipeline_parallel": "pipeline_parallel_size=2",
    }[case]
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=expected):
            KVTierConnector(config, role, kv_config)


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs() -> None:
    """Each attention layer waits for its own load, so vLLM must not capture the whole model in
    one CUDA graph: the connector's class says so when asked (vLLM's config asks it when full
    CUDA graphs are on, and then captures piecewise). Only the answer is checked here; that
    vLLM captures piecewise around the loads needs a CUDA device to see."""
    from kvtier.integrations.vllm import KVTierConnector

    assert KVTierConnector.requires_piecewise_for_cudagraph({}) is True


def test_a_refused_start_leaves_nothing_behind(vllm_model_dir: Any) -> None:
    """A budget the worker's tiers cannot hold is refused by the worker's constructor, before
    vLLM installs the connector as its process's, in the connector's words (``host_budget``,
    not the manager's ``device_budget``); and caches refused at registration, after vLLM
    installed it, uninstall it: the next engine of the process makes its own connector instead
    of failing with this one's error."""
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm import KVTierConnector

    # a bf16 block here: 2 layers x K and V x 3 heads x 32 tokens x 8 channels x 2 bytes = 6 KiB
    config, kv_config = _vllm_configs(vllm_model_dir, host_budget="4KiB", ladder="bf16,int8")
    with pytest.raises(ConfigError, match="host budget 4096 B holds no level-0 block") as refused:
        KVTierConnector(config, KVConnectorRole.WORKER, kv_config)
    assert "raise host_budget or host_blocks" in str(refused.value)
    assert "device" not in str(refused.value)

    # What the tiers can hold passes, a shared remote tier too (the worker names its namespace
    # after the engine at registration; nothing connects before then).
    config, kv_config = _vllm_configs(
        vllm_model_dir, host_budget="1MiB", ladder="bf16", remote_url="redis://127.0.0.1:9"
    )
    KVTierConnector(config, KVConnectorRole.WORKER, kv_config).shutdown()

    config, kv_config = _vllm_configs(vllm_model_dir, host_budget="1MiB", ladder="bf16")
    worker = KVTierConnector(config, KVConnectorRole.WORKER, kv_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker  # vLLM's install (ensure_kv_transfer_...)
    try:
        cache = torch.zeros(16, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
        with pytest.raises(ConfigError, match="no KV cache registered for layers"):
            worker.register_kv_caches({LAYERS[0]: cache})
        assert not kv_transfer_state.has_kv_transfer_group()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None


# -- KV events ----------------------------------------------------------------------------------


def connector_events(engine: Engine) -> list[Any]:
    """The connector's events among those vLLM's scheduler published (its own prefix cache's
    are on medium ``GPU``), in order."""
    return [
        e
        for batch in engine.published
        for e in batch.events
        if getattr(e, "medium", None) in ("CPU", "STORAGE")
    ]


def announced(events: list[Any]) -> dict[Any, str]:
    """What a router that reads ``events`` believes the tiers hold: vLLM's block hash → the
    medium."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: dict[Any, str] = {}
    for e in events:
        if isinstance(e, BlockStored):
            held.update(dict.fromkeys(e.block_hashes, e.medium))
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                if held.get(h) == e.medium:
                    del held[h]
    return held


def held_by_tiers(engine: Engine, prompts: list[list[int]]) -> dict[Any, str]:
    """vLLM's hashes of the prompts' blocks rank 0's tiers hold now, with the medium each lies
    on (the background step over, what it dropped reported by one more step)."""
    engine.worker.worker._settle()
    engine.step()  # nothing scheduled: the workers report what the step dropped
    media = {"host": "CPU", "disk": "STORAGE"}
    held: dict[Any, str] = {}
    for p in prompts:
        places = engine.tiers.lookup(p).runs
        hashes = iter(vllm_block_hashes(p))
        for tier, _, tokens in places:
            for _ in range(tokens // BLOCK):
                held[next(hashes)] = media[tier]
    return held


@pytest.mark.parametrize("tensor_parallel", [1, 3])
def test_kv_events_name_the_blocks_the_host_tier_stores_and_drops_by_vllms_hashes(
    engine_factory: Callable[..., Engine], tensor_parallel: int
) -> None:
    """With vLLM's KV events on, the scheduler publishes the connector's beside its prefix
    cache's: ``BlockStored`` (medium ``CPU``) for each block a save wrote, under vLLM's own hash
    of it (the key vLLM's own events gave it on ``GPU``), with its tokens and parent, and
    ``BlockRemoved`` when the host tier of four blocks evicts it to store others, or forgets it
    on a reset. A router replaying them holds what the tiers hold; with tensor parallelism
    rank 0 speaks for all, once."""
    from vllm.distributed.kv_events import BlockStored

    budget = f"{24 // tensor_parallel}KiB"  # four blocks of each rank's heads
    engine = engine_factory(
        num_blocks=64, kv_events=True, tensor_parallel=tensor_parallel, host_budget=budget
    )
    a = prompt(20, 3)
    engine.add("a", a, max_tokens=1)
    engine.run()
    events = connector_events(engine)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == vllm_block_hashes(a)[:3]
    assert stored[0].parent_block_hash is None
    assert [t for e in stored for t in e.token_ids] == a[: 3 * BLOCK]
    assert {(e.medium, e.block_size, e.group_idx) for e in stored} == {("CPU", BLOCK, 0)}
    for e in stored[1:]:  # a step's blocks chain on from the previous step's
        assert (
            e.parent_block_hash
            == vllm_block_hashes(a)[vllm_block_hashes(a).index(e.block_hashes[0]) - 1]
        )
    on_gpu = {
        h
        for b in engine.published
        for e in b.events
        if e.medium == "GPU"
        for h in getattr(e, "block_hashes", [])
    }
    assert set(vllm_block_hashes(a)[:3]) <= on_gpu  # the keys vLLM's own prefix cache published
    # More prompts than the host tier holds: it evicts, and says so.
    prompts = [a, *(prompt(21 + i, 2) for i in range(3))]
    for i, p in enumerate(prompts[1:]):
        engine.add(f"p{i}", p, max_tokens=1)
        engine.run()
    events = connector_events(engine)
    assert any(e.__class__.__name__ == "BlockRemoved" for e in events)
    held = held_by_tiers(engine, prompts)
    assert 0 < len(held) <= 4
    assert announced(connector_events(engine)) == held
    # A reset with the connector's: everything it announced is removed.
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.add("after", prompt(30, 1), max_tokens=1)
    engine.run()
    assert announced(connector_events(engine)) == held_by_tiers(engine, [prompt(30, 1)])


def test_kv_events_follow_blocks_the_core_moves_to_disk(
    engine_factory: Callable[..., Engine], tmp_path: Any
) -> None:
    """A host tier of four blocks with a disk tier behind it: a block the core offloads is
    announced on ``STORAGE`` and removed from ``CPU``; a router replaying the events holds each
    block on the medium the tiers hold it on."""
    engine = engine_factory(
        num_blocks=64,
        kv_events=True,
        host_budget="24KiB",
        disk_budget="16MiB",
        disk_path=str(tmp_path),
    )
    prompts = [prompt(40 + i, 3) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add(f"p{i}", p, max_tokens=1)
        engine.run()
    held = held_by_tiers(engine, prompts)
    assert set(held.values()) == {"CPU", "STORAGE"}, held
    assert len(held) == 9
    assert announced(connector_events(engine)) == held


def test_a_request_that_ends_its_conversation_has_its_chain_evicted_first(
    engine_factory: Callable[..., Engine],
) -> None:
    """A client that knows a conversation is over says so with the request's
    ``kv_transfer_params={"kvtier": {"release": True}}``: once the request finishes and its
    blocks are saved, the tiers release them. When the host tier of four blocks fills, they go
    before an older conversation's blocks (which the tiers would evict first otherwise: saved
    longer ago); what is left of both still loads."""
    # Four blocks and no headroom kept free: only a save that needs room evicts.
    engine = engine_factory(num_blocks=64, host_budget="24KiB", headroom=0.0, shed_saves=False)
    older, ended, new = prompt(60, 2), prompt(61, 2), prompt(62, 2)
    engine.add("older", older, max_tokens=1)
    engine.run()
    engine.add("ended", ended, max_tokens=1, kv_transfer_params={"kvtier": {"release": True}})
    engine.run()
    # Released in the step after it finished, once every save of it had run: both blocks.
    assert stats(engine)["released_blocks"] == 2
    assert engine.tiers.lookup(older).tokens == engine.tiers.lookup(ended).tokens == 2 * BLOCK
    engine.add("new", new, max_tokens=1)  # its two blocks need the room of two held ones
    engine.run()
    held = {
        name: engine.tiers.lookup(p).tokens
        for name, p in [("older", older), ("ended", ended), ("new", new)]
    }
    assert held == {"older": 2 * BLOCK, "ended": 0, "new": 2 * BLOCK}, held
    assert engine.scheduler.reset_prefix_cache()
    before = stats(engine)["loaded_blocks"]
    engine.add("older again", older)
    engine.run()
    assert stats(engine)["loaded_blocks"] - before == 2
    assert stats(engine)["load_errors"] == 0


def test_only_a_kvtier_release_entry_of_the_documented_shape_releases(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``{"kvtier": {"release": true}}`` releases; other connectors' parameters beside it are
    theirs; a ``kvtier`` entry of another shape releases nothing and says why."""
    from kvtier.integrations.vllm.scheduler import release_requested

    def request(params: Any) -> Any:
        return SimpleNamespace(request_id="r", kv_transfer_params=params)

    assert release_requested(request({"kvtier": {"release": True}, "do_remote_prefill": False}))
    for quiet in (None, {}, {"do_remote_prefill": True}, {"kvtier": {"release": False}}):
        assert not release_requested(request(quiet))
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtier.vllm"]
    assert not warnings
    for odd in ({"kvtier": True}, {"kvtier": {"release": "yes"}}, {"kvtier": {"relase": True}}):
        assert not release_requested(request(odd))
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtier.vllm"]
    assert len(warnings) == 3 and all('expected {"release": true}' in w for w in warnings)
