"""The engines of ``kvtier bench vllm`` (see :mod:`kvtier.bench.vllm`): the four configurations
(no connector, vLLM's ExampleConnector, kvtier bf16 and kvtier's ladder) each run the workload
through a vLLM engine of its own, the long prompt's hit against its recompute, and the report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import KvtierError
from ...integrations.vllm.engines import (
    ENGINE_ENV,
    close_engine,
    connector_transfer,
    engine,
    scheduler_connector,
)
from ...traces import bundled_trace_path
from .workload import (
    BLOCK,
    Settings,
    Turn,
    distinct_blocks,
    last_turn_indices,
    make_workload,
    max_model_len,
)

__all__ = [
    "CONFIGS",
    "CONNECTORS",
    "DEFAULT_LIMITS_CONFIGS",
    "ENGINE_ENV",
    "HISTOGRAMS",
    "LABELS",
    "LADDERS",
    "TARGET_HIT_TTFT_RATIO",
    "TARGET_LADDER_RATIO",
    "over_recompute",
    "run",
    "run_config",
    "run_probe",
    "table",
]

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
#: The configurations run again at vLLM's default limits (ExampleConnector's engine computes a
#: whole prompt a step under either).
DEFAULT_LIMITS_CONFIGS = ("recompute", "kvtier-bf16", "kvtier-ladder")
#: vLLM's own histograms reported per configuration, by their Prometheus names.
HISTOGRAMS = {
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}
CONNECTORS = {
    "recompute": None,
    "example": "vLLM's ExampleConnector (match count clamped at 0)",
    "kvtier-bf16": "KVTierConnector",
    "kvtier-ladder": "KVTierConnector",
}


# -- engines ----------------------------------------------------------------------------------


def _block_bytes(model_dir: Path) -> int:
    """Bytes of one bf16 block of the model's K/V (all layers, K and V)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * BLOCK * head_dim * 2)


def _transfer(config: str, extra: dict[str, Any]) -> Any:
    if config == "recompute":
        return None
    if config == "example":
        # vLLM's ExampleConnector with its one crash fixed (see _example_connector)
        return connector_transfer(
            extra, "ClampedExampleConnector", "kvtier.bench._example_connector"
        )
    return connector_transfer(extra)


def _engine(model_dir: Path, context: int, blocks: int, transfer: Any, step: int | None) -> Any:
    """An engine; ``step=None`` keeps vLLM's default scheduling limits."""
    limits: dict[str, Any] = (
        {}
        if step is None
        else {
            "max_num_batched_tokens": step,  # chunked prefill: at most this many tokens a step
            "max_num_seqs": min(step, 256),  # vLLM wants max_num_batched_tokens >= max_num_seqs
        }
    )
    return engine(model_dir, context, BLOCK, transfer, num_gpu_blocks_override=blocks, **limits)


@contextlib.contextmanager
def _running(
    model_dir: Path, context: int, blocks: int, transfer: Any, step: int | None
) -> Iterator[Any]:
    llm = _engine(model_dir, context, blocks, transfer, step)
    try:
        yield llm
    finally:
        close_engine(llm)


#: What a client sends with a conversation's last turn to say the conversation ends (a
#: server request's ``kv_transfer_params``; ``extra_args`` for an offline engine).
RELEASE = {"kv_transfer_params": {"kvtier": {"release": True}}}


def _generate(llm: Any, tokens: Sequence[int], max_tokens: int, release: bool = False) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args=RELEASE if release else None,
    )
    return llm.generate([{"prompt_token_ids": list(tokens)}], params, use_tqdm=False)[0]


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.endswith(("prefix_cache_hits", "prefix_cache_queries")):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _histograms(llm: Any) -> dict[str, dict[str, Any]]:
    """vLLM's :data:`HISTOGRAMS` now: count, sum and cumulative bucket counts, summed over
    label sets."""
    out: dict[str, dict[str, Any]] = {}
    names = {name: key for key, name in HISTOGRAMS.items()}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is None:
            continue
        h = out.setdefault(key, {"count": 0, "sum": 0.0, "buckets": {}})
        h["count"] += int(m.count)
        h["sum"] += float(m.sum)
        for le, n in m.buckets.items():
            h["buckets"][le] = h["buckets"].get(le, 0) + int(n)
    return out


def _histogram_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one histogram gained between two snapshots: its count, sum and mean, and the upper
    bounds of the buckets holding its median and 90th percentile (vLLM's buckets are all that
    is known of single values)."""
    empty: dict[str, Any] = {"count": 0, "sum": 0.0, "buckets": {}}
    before = before or empty
    count = after["count"] - before["count"]
    total = after["sum"] - before["sum"]
    buckets = {le: n - before["buckets"].get(le, 0) for le, n in after["buckets"].items()}

    def bound(q: float) -> float | None:
        ordered = sorted(buckets.items(), key=lambda item: float(item[0]))
        return next((float(le) for le, n in ordered if count and n >= q * count), None)

    return {
        "count": count,
        "sum_s": total,
        "mean_s": total / count if count else None,
        "median_at_most_s": bound(0.5),
        "p90_at_most_s": bound(0.9),
        "buckets": buckets,
    }


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
    link = scheduler_connector(llm).scheduler.link
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
    release: bool = False,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Runs the workload through one engine, then ``then(llm)`` if given; returns the
    workload's figures and each request's output. With ``release`` (kvtier configurations),
    each conversation's last turn carries kvtier's release hint."""
    last_turns = last_turn_indices(turns) if release and config in LADDERS else set()
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
            before, histograms_before = _counters(llm), _histograms(llm)
            ttfts, outputs, cached = [], [], []
            load = [os.getloadavg()[0]]
            t1 = time.perf_counter()
            for n, turn in enumerate(turns):
                out = _generate(llm, turn.tokens, settings.output_tokens, n in last_turns)
                ttfts.append(_ttft(out))
                cached.append(int(out.num_cached_tokens or 0))
                outputs.append(list(out.outputs[0].token_ids))
                log(
                    f"  {config}: request {n + 1}/{len(turns)}, {len(turn.tokens)} tokens, "
                    f"{out.num_cached_tokens or 0} cached, TTFT {ttfts[-1]:.2f} s"
                )
            wall = time.perf_counter() - t1
            load.append(os.getloadavg()[0])
            after = _counters(llm)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            histograms = {
                key: _histogram_figures(histograms_before.get(key, {}), h)
                for key, h in _histograms(llm).items()
            }
            scheduler = llm.llm_engine.vllm_config.scheduler_config
            limits = {
                "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
                "max_num_seqs": int(scheduler.max_num_seqs),
            }
            held: dict[str, Any] | None = None
            details: dict[str, Any] | None = None
            if config in LADDERS:
                stats = scheduler_connector(llm).get_compression_stats()
                held = _kvtier_held(stats, budget)
                held["loadable_tokens"] = _loadable(llm, turns)
                details = {
                    "connector": stats["connector"],
                    "pools": stats["pools"],
                    "demotions": stats["demotions"],
                    "promotions": stats["promotions"],
                    "evictions": stats["evictions"],
                    "avg_compression_ratio": stats["avg_compression_ratio"],
                    # what the worker measured a token to cost, to load by place and to compute
                    "seconds_per_token": stats["seconds_per_token"],
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
        "cached_tokens": sum(cached),
        # each request's prompt tokens vLLM did not compute (its own prefix hit and the
        # connector's)
        "cached_tokens_per_request": cached,
        "scheduling_limits": limits,
        "ttft_s": _stats(ttfts),
        "ttft_per_request_s": ttfts,
        # vLLM's own histograms over the workload: its prefill time and TTFT per request
        "vllm_histograms": histograms,
        "wall_s": wall,
        "tokens_per_s": (prompt + generated) / wall,
        "prompt_tokens_per_s": prompt / wall,
        # The machine's pace while this configuration ran: prompt tokens vLLM computed per
        # second of TTFT, and the 1-minute load average before and after (other processes
        # slow every figure of a configuration alike).
        "computed_tokens_per_ttft_s": (prompt - sum(cached)) / sum(ttfts),
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
    levels = _kvtier_held(scheduler_connector(llm).get_compression_stats(), budget)[
        "blocks_per_level"
    ]
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


def _workload_pass(
    configs: Sequence[str],
    model_dir: Path,
    settings: Settings,
    turns: Sequence[Turn],
    warm: Sequence[int],
    extras: dict[str, dict[str, Any]],
    log: Callable[..., None],
    hooks: Mapping[str, Callable[[Any], None]],
    release: bool = False,
) -> dict[str, Any]:
    """The workload through one engine per configuration (``recompute`` first: the others'
    outputs are compared with its)."""
    results: dict[str, Any] = {}
    reference: list[list[int]] = []
    for config in configs:
        log(f"{config}: starting an engine")
        result, outputs = run_config(
            config,
            model_dir,
            settings,
            turns,
            warm,
            extras.get(config, {}),
            log,
            hooks.get(config),
            release,
        )
        if config == "recompute":
            reference = outputs
        result["same_output_as_recompute"] = sum(
            a == b for a, b in zip(outputs, reference, strict=True)
        )
        results[config] = result
        log(
            f"{config}: connector hit {result['connector_hit_rate']:.1%}, TTFT median "
            f"{result['ttft_s']['median']:.2f} s, {result['tokens_per_s']:.1f} tokens/s"
        )
    return results


def over_recompute(configs: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each kvtier configuration's figures over the recompute's of the same pass: vLLM's own
    mean prefill time and mean TTFT per request, and the workload's wall time."""

    def ratio(mine: float | None, base: float | None) -> float | None:
        return mine / base if mine is not None and base else None

    base = configs["recompute"]
    out = {}
    for config in LADDERS:
        mine = configs[config]
        out[config] = {
            "prefill_mean": ratio(
                mine["vllm_histograms"]["prefill"]["mean_s"],
                base["vllm_histograms"]["prefill"]["mean_s"],
            ),
            "ttft_mean": ratio(
                mine["vllm_histograms"]["ttft"]["mean_s"], base["vllm_histograms"]["ttft"]["mean_s"]
            ),
            "wall": ratio(mine["wall_s"], base["wall_s"]),
        }
    return out


def run(
    settings: Settings,
    extra: dict[str, Any],
    log: Callable[..., None],
    kvtier_extra: dict[str, Any] | None = None,
    default_limits: bool = True,
    release: bool = False,
) -> dict[str, Any]:
    """The whole benchmark: ``extra`` is the ladder's own extra config, ``kvtier_extra`` both
    kvtier configurations' (the ladder's wins where they overlap). With ``default_limits`` (and
    cut-down settings), the workload runs again at vLLM's default scheduling limits
    (:data:`DEFAULT_LIMITS_CONFIGS`). With ``release``, the kvtier configurations send kvtier's
    release hint with each conversation's last turn (in the workload: the last turn it keeps)."""
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
    extras = {"kvtier-bf16": both, "kvtier-ladder": {**both, **extra}}
    configs = _workload_pass(CONFIGS, model_dir, settings, turns, warm, extras, log, hooks, release)
    default_pass = None
    if default_limits and settings.step_tokens is not None:
        log("the workload again at vLLM's default scheduling limits")
        at_default = _workload_pass(
            DEFAULT_LIMITS_CONFIGS,
            model_dir,
            dataclasses.replace(settings, step_tokens=None),
            turns,
            warm,
            extras,
            log,
            {},
            release,
        )
        default_pass = {
            "scheduling_limits": at_default["recompute"]["scheduling_limits"],
            "configs": at_default,
            "over_recompute": over_recompute(at_default),
        }
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
        "release_last_turns": release,
        "configs": configs,
        "over_recompute": over_recompute(configs),
        "default_limits": default_pass,
        "ladder_tokens_held_over_bf16": ladder_held / bf16_held if bf16_held else None,
        "target_ladder_tokens_held_over_bf16": TARGET_LADDER_RATIO,
        "probe": probe_result,
        "wall_s": time.perf_counter() - t0,
    }


# -- output -----------------------------------------------------------------------------------


def _config_lines(configs: dict[str, Any]) -> list[str]:
    """One row per configuration, under a two-line header."""
    lines = [
        f"{'configuration':26s} {'connector':>9s} {'vLLM own':>9s} {'TTFT med':>9s} "
        f"{'TTFT p90':>9s} {'prefill':>9s} {'TTFT':>9s} {'tokens/s':>9s} {'held tok':>9s} "
        f"{'tok/GB':>10s}  {'same':6s} {'prefill':>7s} {'load':>5s}",
        f"{'':26s} {'hit rate':>9s} {'hit rate':>9s} {'':>9s} {'':>9s} {'mean':>9s} "
        f"{'mean':>9s} {'':>9s} {'':>9s} {'':>10s}  {'output':6s} {'tok/s':>7s} {'avg':>5s}",
    ]
    for r in configs.values():
        held, h = r["held"], r["vllm_histograms"]
        lines.append(
            f"{r['label']:26s} {r['connector_hit_rate']:9.1%} {r['vllm_prefix_hit_rate']:9.1%} "
            f"{r['ttft_s']['median']:8.2f}s {r['ttft_s']['p90']:8.2f}s "
            f"{h['prefill']['mean_s']:8.3f}s {h['ttft']['mean_s']:8.3f}s {r['tokens_per_s']:9.1f} "
            + (
                f"{held['tokens']:9,d} {held['tokens_per_gb']:10,.0f}"
                if held
                else f"{'-':>9s} {'-':>10s}"
            )
            + f"  {r['same_output_as_recompute']:>2d}/{r['requests']:<3d} "
            f"{r['computed_tokens_per_ttft_s']:7.1f} {max(r['loadavg_1m']):5.1f}"
        )
    return lines


def _over_recompute_line(configs: dict[str, Any], over: dict[str, dict[str, float | None]]) -> str:
    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    return "over the recompute's (vLLM's mean prefill time, mean TTFT, wall): " + "; ".join(
        f"{LABELS[c]} {num(o['prefill_mean'])}, {num(o['ttft_mean'])}, {num(o['wall'])} "
        f"({configs[c]['kvtier']['connector']['save_failures']} saves refused)"
        for c, o in over.items()
    )


def table(result: dict[str, Any]) -> str:
    """The run's figures as the table printed on stderr."""
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
        *_config_lines(result["configs"]),
        "tok/GB: kvtier per GB of host budget; ExampleConnector per GB on disk "
        f"({result['configs']['example']['held']['bytes'] / 1e6:.1f} MB). prefill and TTFT "
        "mean: vLLM's own histograms (vllm:request_prefill_time_seconds, "
        "vllm:time_to_first_token_seconds); prefill tok/s: tokens vLLM computed per second of "
        "TTFT; load avg: the machine's 1-minute load "
        f"(it has {result['cpu_count']} CPUs): where they differ, so do TTFT and tokens/s",
        _over_recompute_line(result["configs"], result["over_recompute"]),
    ]
    at_default = result.get("default_limits")
    if at_default:
        limits = at_default["scheduling_limits"]
        lines += [
            "",
            "at vLLM's default scheduling limits (max_num_batched_tokens "
            f"{limits['max_num_batched_tokens']}, max_num_seqs {limits['max_num_seqs']}: a "
            "whole prompt a step):",
            *_config_lines(at_default["configs"]),
            _over_recompute_line(at_default["configs"], at_default["over_recompute"]),
            "",
        ]
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
