"""``kvtier simulate``: replay a request trace through the real core and report what a deployment
would see — hit rates by tier and level, memory by level, moves, and the prefill time saved.

The replay loop runs in Rust (``kvtier._core.Simulator``); this module sizes the tiers from the
model's KV shape and the ladder, drives the replay (in one call, or in chunks when it draws
progress) and shapes the result, with the timeline the core sampled, as documented in
docs/simulate-schema.md. The peers of :mod:`kvtier.peers` (vLLM's own cache policies, and the
offline bound) replay beside kvtier's policies on the device budget, at the model dtype, and
their results take the same shape, less what they cannot fill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from . import peers
from ._core import Core, Simulator
from .config import MAX_SIZE, MAX_U32, PLAIN, KvtierConfig
from .errors import ConfigError
from .shapes import KVShape, PrefillCost, model_shape
from .traces import Trace

TIERS = ("device", "host", "disk", "remote")
#: Timeline points per replay (for the plot).
TIMELINE_POINTS = 200
#: Progress updates per replay. Each is a return to Python that leaves the core's caches
#: colder, and a whole replay takes 20 ms to a few seconds: a coarse bar is enough.
PROGRESS_STEPS = 20

_BYTES_RANGE = "0 to 2**64 - 1 bytes (16 EiB)"


def _check_int(name: str, value: object, lo: int, hi: int, expected: str) -> None:
    # Checked here so that a bad value is a ConfigError naming it, not PyO3's OverflowError.
    if isinstance(value, bool) or not isinstance(value, Integral) or not lo <= int(value) <= hi:
        raise ConfigError(f"{name}: {value!r} is out of range: expected {expected}")


@dataclass(frozen=True)
class SimulationConfig:
    model: str = "llama3-8b"
    dtype: str = "fp16"
    #: Device budget in bytes, or in full-precision blocks (exactly one of the two).
    device_bytes: int | None = None
    device_blocks: int | None = None
    host_bytes: int | None = None
    disk_bytes: int | None = None
    remote_bytes: int | None = None
    host_gbps: float = 25.0
    disk_gbps: float = 5.0
    remote_gbps: float = 1.25
    ladder: tuple[str, ...] = ("fp16", "int8", "int4")
    step_every: int = 1
    block_tokens: int = 512
    base: KvtierConfig = field(default_factory=KvtierConfig)
    #: Apply the per-sequence rank split of live blocks (a decode-time rule) during replay too.
    split_live: bool = False
    cost: PrefillCost = field(default_factory=PrefillCost)

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "remote_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_SIZE, _BYTES_RANGE)
        if self.device_blocks is not None:
            _check_int("device_blocks", self.device_blocks, 1, MAX_SIZE, "1 to 2**64 - 1 blocks")
        _check_int("block_tokens", self.block_tokens, 1, MAX_U32, "1 to 2**32 - 1 tokens")
        _check_int("step_every", self.step_every, 1, MAX_SIZE, "1 to 2**64 - 1 requests")
        base = self.base
        for name in ("recent_window", "sink_blocks", "scissorhands_window"):
            _check_int(name, getattr(base, name), 0, MAX_U32, "0 to 2**32 - 1")
        if base.max_move_bytes is not None:
            _check_int("max_move_bytes", base.max_move_bytes, 0, MAX_SIZE, _BYTES_RANGE)

    def shape(self) -> KVShape:
        return model_shape(self.model)

    def device_budget(self) -> int:
        if (self.device_bytes is None) == (self.device_blocks is None):
            raise ConfigError(
                "give the device budget either in bytes or in blocks, not both or neither"
            )
        if self.device_blocks is not None:
            block_bytes = self.shape().block_bytes(self.dtype, self.block_tokens)
            if self.device_blocks * block_bytes > MAX_SIZE:
                raise ConfigError(
                    f"device_blocks: {self.device_blocks} blocks of {block_bytes} bytes are "
                    f"out of range: expected at most {MAX_SIZE // block_bytes:,} blocks "
                    f"({_BYTES_RANGE})"
                )
            return self.device_blocks * block_bytes
        assert self.device_bytes is not None
        return self.device_bytes

    def tiers(self) -> list[tuple[str, int | None]]:
        tiers: list[tuple[str, int | None]] = [("device", self.device_budget())]
        for name, budget in (
            ("host", self.host_bytes),
            ("disk", self.disk_bytes),
            ("remote", self.remote_bytes),
        ):
            if budget is not None:
                tiers.append((name, budget))
        return tiers

    def gbps(self, tier: str) -> float | None:
        return {"host": self.host_gbps, "disk": self.disk_gbps, "remote": self.remote_gbps}.get(
            tier
        )

    def load_seconds(self, tier: str, nbytes: int) -> float:
        """Seconds to load ``nbytes`` from ``tier`` onto the device (0 there: a hit in place)."""
        gbps = self.gbps(tier)
        return 0.0 if gbps is None else nbytes / (gbps * 1e9)


def parse_policy_spec(spec: str, default_ladder: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """``"lru"`` or ``"lru:fp16"`` / ``"importance:fp16+int8+int4"`` → (policy, ladder); the
    policy keeps a ``plain-`` prefix (see :func:`split_plain`)."""
    policy, _, ladder = spec.partition(":")
    return policy.strip(), tuple(x.strip() for x in ladder.split("+")) if ladder else default_ladder


def split_plain(policy: str) -> tuple[str, bool]:
    """``"plain-lru"`` → ``("lru", True)``; ``"lru"`` → ``("lru", False)``."""
    return (policy.removeprefix(PLAIN), True) if policy.startswith(PLAIN) else (policy, False)


def build_core(config: SimulationConfig, policy: str, ladder: tuple[str, ...]) -> Core:
    """A core configured like the simulated deployment (sized in bytes from the KV shape)."""
    base = config.base
    if ladder[0] != config.dtype:
        raise ConfigError(
            f"ladder {'+'.join(ladder)} must start with the model dtype {config.dtype}"
        )
    level_bytes = config.shape().ladder_bytes(ladder, config.block_tokens)
    bigger = [k for k in range(1, len(ladder)) if level_bytes[k] > level_bytes[k - 1]]
    if bigger:
        k = bigger[0]
        raise ConfigError(
            f"block_tokens (--block-tokens) {config.block_tokens}: a block of that many tokens "
            f"takes {level_bytes[k]} bytes at {ladder[k]} (its scales outweigh the data) against "
            f"{level_bytes[k - 1]} at {ladder[k - 1]}: a lower level must not be larger",
            hint="use larger blocks (the default is 512 tokens), or a ladder without that level",
        )
    policy, plain = split_plain(policy)
    return Core(
        level_bytes,
        **base.core_arguments(
            config.tiers(),
            block_size=config.block_tokens,
            policy=policy,
            prefix_aware=base.prefix_aware and not plain,
            enable_compression=base.enable_compression and len(ladder) > 1,
            pressure_only=not config.split_live,
            # The replay takes no drop ratio from the config (the core's default: none).
            drop_ratio=0.0,
            # A cache: a full device makes room by evicting what no running request needs.
            evict_on_full=True,
        ),
    )


def _replay(
    trace: Trace,
    config: SimulationConfig,
    policy: str,
    ladder: tuple[str, ...],
    progress: Callable[[int, int], None] | None,
    done_before: int,
    total_all: int,
) -> dict[str, Any]:
    shape = config.shape()
    level_bytes = shape.ladder_bytes(ladder, config.block_tokens)
    seconds_per_token = config.cost.seconds_per_token(shape)
    # A request loads the leading hits that save the most time (the vLLM connector's rule).
    load_seconds = [config.load_seconds(tier, nbytes) for tier in TIERS for nbytes in level_bytes]
    sim = Simulator(
        build_core(config, policy, ladder),
        trace.hash_offsets.astype(np.uint64),
        trace.hash_ids.astype(np.uint64),
        trace.input_lengths.astype(np.uint64),
        recompute_seconds=seconds_per_token,
        load_seconds=load_seconds,
        step_every=config.step_every,
        timeline_every=max(1, len(trace) // TIMELINE_POINTS),
    )
    n = len(trace)
    chunk = max(1, n // PROGRESS_STEPS) if progress is not None else max(n, 1)
    wall = 0.0
    while sim.done < n:
        t0 = time.perf_counter()
        sim.run(chunk)
        wall += time.perf_counter() - t0
        if progress is not None:
            progress(done_before + sim.done, total_all)

    st = sim.stats()
    counters = sim.counters()
    hits_by_place = []
    saved_s = 0.0
    for (tier, level), (blocks, tokens) in sorted(
        st["hits_by_place"].items(), key=lambda kv: (TIERS.index(kv[0][0]), kv[0][1])
    ):
        hits_by_place.append(
            {"tier": tier, "level": ladder[level], "blocks": blocks, "tokens": tokens}
        )
        # The hits a request loads save time together (a slow one among them may not).
        saved_s += tokens * seconds_per_token - blocks * config.load_seconds(
            tier, level_bytes[level]
        )
    baseline_s = st["ref_tokens"] * seconds_per_token
    bytes_by_place = [
        {"tier": tier, "level": ladder[level], "blocks": used, "bytes": nbytes}
        for tier, level, used, _cap, nbytes in sim.usage()
        if used
    ]
    tier_names = [t for t, _ in config.tiers()]
    return {
        "policy": policy,
        "ladder": list(ladder),
        "offline": False,
        "source": "kvtier",
        "requests": st["requests"],
        "ref_blocks": st["ref_blocks"],
        "hit_blocks": st["hit_blocks"],
        "ref_tokens": st["ref_tokens"],
        "hit_tokens": st["hit_tokens"],
        "block_hit_rate": st["hit_blocks"] / max(st["ref_blocks"], 1),
        "token_hit_rate": st["hit_tokens"] / max(st["ref_tokens"], 1),
        "rejected_requests": st["rejected"],
        "hits_by_place": hits_by_place,
        "bytes_by_place": bytes_by_place,
        "peak_bytes_by_tier": dict(zip(tier_names, st["peak_tier_bytes"], strict=True)),
        "moves": {
            "promotions": counters["promotions"],
            "demotions": counters["demotions"],
            "offloads": counters["offloads"],
            "fetches": counters["fetches"],
            "evictions": counters["evictions"],
            "noop_promotions": counters["noop_promotions"],
            "bytes_moved": counters["bytes_moved"],
        },
        "allocated_blocks": counters["allocated"],
        "released_blocks": counters["released"],
        "prefill": _prefill(baseline_s, saved_s, config.cost.describe(shape)),
        "wall_s": wall,
        "timeline": _timeline(sim, trace, ladder),
    }


def _peer_spec(
    policy: str, ladder_text: str | None, config: SimulationConfig
) -> tuple[str, tuple[str, ...]]:
    """A peer's spec checked: it holds blocks at the model dtype alone."""
    if ladder_text is None:
        return policy, (config.dtype,)
    ladder = tuple(x.strip() for x in ladder_text.split("+"))
    if ladder != (config.dtype,):
        raise ConfigError(
            f"{policy} has no ladder: it holds every block at the model dtype "
            f"({config.dtype}), got the ladder {'+'.join(ladder)}",
            hint=f"write {policy}:{config.dtype}, or no ladder for it (--ladder and "
            "KVTIER_LADDER reach every policy that names none of its own)",
        )
    return policy, ladder


def _peer_capacity(config: SimulationConfig, policy: str) -> int:
    lower = [t for t, _ in config.tiers() if t != "device"]
    if lower:
        raise ConfigError(
            f"{policy} is one cache of the device budget: it has no {', '.join(lower)} tier",
            hint="compare it on the device budget alone: leave out --host-bytes, --disk-bytes "
            "and --remote-bytes (and their KVTIER_* variables)",
        )
    block_bytes = config.shape().block_bytes(config.dtype, config.block_tokens)
    blocks = config.device_budget() // block_bytes
    if blocks < 1:
        raise ConfigError(
            f"{policy}: a device budget of {config.device_budget()} bytes holds no block of "
            f"{block_bytes} bytes",
            hint="give the device at least one block (--device-blocks N)",
        )
    return blocks


def _sample_points(n: int) -> list[int]:
    """Requests done at each timeline sample, as the core samples: every
    ``n // TIMELINE_POINTS`` requests, and after the last."""
    every = max(1, n // TIMELINE_POINTS)
    return [*range(every, n, every), n] if n else []


def _replay_peer(
    trace: Trace,
    config: SimulationConfig,
    policy: str,
    progress: Callable[[int, int], None] | None,
    done_before: int,
    total_all: int,
) -> dict[str, Any]:
    shape = config.shape()
    bs = config.block_tokens
    block_bytes = shape.block_bytes(config.dtype, bs)

    def report(done: int) -> None:
        if progress is not None:
            progress(done_before + done, total_all)

    t0 = time.perf_counter()
    run = peers.replay(
        trace, policy, _peer_capacity(config, policy), None if progress is None else report
    )
    wall = time.perf_counter() - t0

    # Tokens of each hit, as the core counts them: a full block each, but a request's last
    # block holds what is left of its input.
    counts = trace.blocks_per_request.astype(np.int64)
    inputs = trace.input_lengths.astype(np.int64)
    hits = run.hits
    whole = (hits == counts) & (counts > 0)
    last = np.clip(inputs - (counts - 1) * bs, 0, bs)
    hit_tokens_each = np.where(whole, (counts - 1) * bs + last, hits * bs)
    hit_blocks = int(hits.sum())
    hit_tokens = int(hit_tokens_each.sum())
    ref_blocks = int(trace.block_refs)
    ref_tokens = int(inputs.sum())

    seconds_per_token = config.cost.seconds_per_token(shape)
    baseline_s = ref_tokens * seconds_per_token
    saved_s = hit_tokens * seconds_per_token  # device hits: nothing to load
    held_end = int(run.held[-1]) if len(run.held) else 0
    points = _sample_points(len(trace))
    at = np.array(points, dtype=np.int64) - 1
    refs_so_far = np.cumsum(counts)[at]
    start_ms = float(trace.timestamps_ms[0]) if len(trace) else 0.0
    result: dict[str, Any] = {
        "policy": policy,
        "ladder": [config.dtype],
        "offline": run.offline,
        "source": run.source,
        "requests": len(trace),
        "ref_blocks": ref_blocks,
        "hit_blocks": hit_blocks,
        "ref_tokens": ref_tokens,
        "hit_tokens": hit_tokens,
        "block_hit_rate": hit_blocks / max(ref_blocks, 1),
        "token_hit_rate": hit_tokens / max(ref_tokens, 1),
        "rejected_requests": run.rejected,
        "hits_by_place": [
            {"tier": "device", "level": config.dtype, "blocks": hit_blocks, "tokens": hit_tokens}
        ]
        if hit_blocks
        else [],
        "bytes_by_place": [
            {
                "tier": "device",
                "level": config.dtype,
                "blocks": held_end,
                "bytes": held_end * block_bytes,
            }
        ]
        if held_end
        else [],
        "peak_bytes_by_tier": {"device": int(run.held.max(initial=0)) * block_bytes},
        "moves": {"evictions": run.evictions},
        "allocated_blocks": run.stored,
        "prefill": _prefill(baseline_s, saved_s, config.cost.describe(shape)),
        "wall_s": wall,
        "timeline": {
            "request": points,
            "time_s": [(float(trace.timestamps_ms[k]) - start_ms) / 1e3 for k in at.tolist()],
            "block_hit_rate": (np.cumsum(hits)[at] / np.maximum(refs_so_far, 1)).tolist(),
            "bytes_by_level": {config.dtype: (run.held[at] * block_bytes).tolist()},
        },
    }
    if policy in peers.VLLM_POLICIES:
        result["evicted_own_prefix"] = run.evicted_own_prefix
    return result


def _timeline(sim: Simulator, trace: Trace, ladder: tuple[str, ...]) -> dict[str, Any]:
    samples = sim.timeline()
    start_ms = float(trace.timestamps_ms[0]) if len(trace) else 0.0
    return {
        "request": [done for done, _, _, _ in samples],
        "time_s": [(float(trace.timestamps_ms[done - 1]) - start_ms) / 1e3 for done, *_ in samples],
        "block_hit_rate": [hits / max(refs, 1) for _, hits, refs, _ in samples],
        "bytes_by_level": {
            name: [level_bytes[k] for *_, level_bytes in samples] for k, name in enumerate(ladder)
        },
    }


def run(
    trace: Trace,
    config: SimulationConfig,
    policies: Sequence[str] = ("importance",),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Replays ``trace`` once per policy spec (``policy`` or ``policy:ladder+...``): kvtier's
    policies through the core, the peers of :data:`kvtier.peers.PEERS` on the device budget
    alone, at the model dtype (a peer given a ladder, or lower tiers, is refused)."""
    shape = config.shape()
    specs = []
    for spec in policies:
        policy, sep, ladder_text = spec.partition(":")
        if policy.strip() in peers.PEERS:
            specs.append(_peer_spec(policy.strip(), ladder_text if sep else None, config))
            _peer_capacity(config, policy.strip())
        else:
            specs.append(parse_policy_spec(spec, config.ladder))
    if any(policy in peers.VLLM_POLICIES for policy, _ in specs):
        peers.require_vllm()  # before any replay, so that a missing vLLM fails at once
    results = []
    total_all = len(trace) * len(specs)
    for k, (policy, ladder) in enumerate(specs):
        if policy in peers.PEERS:
            results.append(_replay_peer(trace, config, policy, progress, k * len(trace), total_all))
        else:
            results.append(
                _replay(trace, config, policy, ladder, progress, k * len(trace), total_all)
            )
    all_levels = dict.fromkeys(name for _, ladder in specs for name in ladder)
    return {
        "trace": {
            "path": trace.source,
            "format": trace.format,
            "requests": len(trace),
            "block_refs": trace.block_refs,
            "distinct_blocks": trace.distinct_blocks,
            "block_tokens": config.block_tokens,
            "duration_s": trace.duration_s,
        },
        "model": {
            "name": shape.name,
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": config.dtype,
            "bytes_per_token": {
                name: shape.block_bytes(name, config.block_tokens) / config.block_tokens
                for name in all_levels
            },
        },
        "tiers": [
            {"tier": t, "budget_bytes": b, "gbps": config.gbps(t)} for t, b in config.tiers()
        ],
        "results": results,
    }


def _prefill(baseline_s: float, saved_s: float, cost_model: str) -> dict[str, Any]:
    """A result's prefill estimate: the time without the cache, with it, and saved."""
    return {
        "baseline_s": baseline_s,
        "with_cache_s": baseline_s - saved_s,
        "saved_s": saved_s,
        "saved_fraction": saved_s / baseline_s if baseline_s else 0.0,
        "cost_model": cost_model,
    }
