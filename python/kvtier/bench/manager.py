"""``kvtier bench manager``: the BlockManager beside a contiguous torch KV cache, in one run.

Both do the same appends and reads of a decode-like workload.

The shape: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, fp16), blocks of 16 tokens.

- decode: S sequences each append a P-token prompt to every layer (then one ``step()``), then G
  decode steps of a custom engine: per layer, each sequence appends one token's K/V, then
  attention for the step's query (32 heads, grouped over the 8 K/V heads) is computed over each
  sequence's whole layer; one ``step()`` per decode step. The manager computes attention with
  ``attend`` (one call per layer for every sequence, over the blocks where they lie) for the
  default ladder (fp16, int8, int4; recent window 128) and with compression off (fp16 only),
  and, for the default ladder, the older way too: ``gather`` each sequence's layer back
  (decoded, contiguous) and run torch's SDPA over it. The baseline preallocates ``[max_tokens,
  kv_heads, head_dim]`` K and V per sequence and layer: append is a slice copy, attention is
  torch's SDPA over the slice, in fp16 (the ratios' denominator, the manager's dtype) and, as
  further baselines, in bf16 and fp32 (converted off the clock): on a CPU torch's fp16 SDPA is
  slow, so "x best" compares against the fastest of the three. Tokens/s counts tokens of a
  sequence (all layers) per second.
- bandwidth: one ``attend`` over every layer of every sequence, best of R: the pool bytes it
  reads per second, beside a plain copy of as many bytes in the same run (the memory bound).
- memory: bytes the pools hold per token after a final ``step()``, against fp16 K/V (131,072
  B/token), for the default ladder, fp16 only, and an aggressive setting (every compressible
  block to int4, recent window 32); measured after the decode workload and, separately, on
  longer sequences (prompt, ``step()``, decode appends and steps, no gathers). The recent window
  and the sink block stay fp16, so bytes per token fall as sequences grow: the length is given
  with each figure.

Runs on the CPU, and on CUDA when ``torch.cuda.is_available()``. Prints a table on stdout
(``--json``: one JSON object instead); progress goes to stderr. Figures, never pass/fail.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..cli import positive_int
from ..config import KvtierConfig
from ..manager import BlockManager
from ..results import save_if_asked
from . import bench_parser, run_as_script
from .core import best_of

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float16
#: fp16 K and V of one token over every layer: 2 * 32 * 8 * 128 * 2 bytes.
FP16_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
#: The design target: at default settings the manager holds at most this share of fp16 bytes.
TARGET_RATIO = 0.6

#: The manager settings compared (``KvtierConfig`` overrides besides the device budget).
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "fp16_only": {"enable_compression": False},
    "aggressive": {"compression_ratio": 0.0, "recent_window": 32},
}
#: The timed decode runs: name -> (setting, how attention reads the cache).
TIMED: dict[str, tuple[str, str]] = {
    "default": ("default", "attend"),
    "fp16_only": ("fp16_only", "attend"),
    "default_gather": ("default", "gather"),
}
Q_HEADS = 32
#: The contiguous caches measured: "baseline" (the ratios' denominator) holds the manager's
#: dtype; the others show what torch's SDPA does at other dtypes on the same device (on a CPU
#: its fp16 path is far slower than its fp32 one).
BASELINES: dict[str, torch.dtype] = {
    "baseline": DTYPE,
    "baseline_bf16": torch.bfloat16,
    "baseline_fp32": torch.float32,
}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Workload:
    sequences: int
    prompt: int
    steps: int

    @property
    def length(self) -> int:
        return self.prompt + self.steps

    @property
    def tokens(self) -> int:
        return self.sequences * self.length


QUICK = Workload(sequences=2, prompt=256, steps=4)
FULL = Workload(sequences=4, prompt=512, steps=32)
#: The memory runs: sequences of this many tokens (prompt plus ``steps`` decode tokens).
QUICK_MEMORY = Workload(sequences=2, prompt=512 - 4, steps=4)
FULL_MEMORY = Workload(sequences=4, prompt=2048 - 8, steps=8)

Inputs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _inputs(work: Workload, device: torch.device) -> Inputs:
    """Per sequence: prompt K and V ``[P, heads, dim]`` and decode K and V ``[G, heads, dim]``,
    with per-token scales so that key norms (the magnitude signal) differ between blocks. Every
    layer appends the same tensors: the data does not change the cost."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(work.sequences):
        four = []
        for n in (work.prompt, work.prompt, work.steps, work.steps):
            scale = torch.rand((n, 1, 1), generator=gen) * 2 + 0.1
            x = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen) * scale
            four.append(x.to(DTYPE).to(device))
        out.append((four[0], four[1], four[2], four[3]))
    return out


def _queries(work: Workload, device: torch.device) -> torch.Tensor:
    """The decode steps' queries, ``[steps, sequences, 1, Q_HEADS, HEAD_DIM]``."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((work.steps, work.sequences, 1, Q_HEADS, HEAD_DIM), generator=gen)
    return q.to(DTYPE).to(device)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one sequence's queries ``[1, Q_HEADS, D]`` over ``[n, KV_HEADS, D]`` K/V."""
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kt, vt, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _device_blocks(work: Workload) -> int:
    """One device budget for every setting, in level-0 blocks: room for every block of every
    sequence at level 0 within the default ladder's half share and the pools' headroom, so that
    no append has to wait for a ``step()`` to make room."""
    blocks = work.sequences * math.ceil(work.length / BLOCK_SIZE)
    return math.ceil(2 * blocks / (1 - KvtierConfig().headroom)) + 4


def _manager(setting: str, work: Workload, device: torch.device) -> BlockManager:
    cfg = KvtierConfig(device_blocks=_device_blocks(work), **SETTINGS[setting])
    return BlockManager(cfg, LAYERS, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)


def _syncer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _throughput(setting: str, work: Workload, total_s: float, prefill_s: float) -> dict[str, Any]:
    """The figures every side of the decode workload reports alike."""
    return {
        "setting": setting,
        "tokens": work.tokens,
        "total_s": total_s,
        "tokens_per_s": work.tokens / total_s,
        "prefill_s": prefill_s,
        "decode_s": total_s - prefill_s,
        "decode_tokens_per_s": work.sequences * work.steps / (total_s - prefill_s),
    }


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": statistics.fmean(values) * 1e3 if values else 0.0,
        "max_ms": max(values, default=0.0) * 1e3,
        "count": len(values),
    }


def _memory(bm: BlockManager, setting: str, work: Workload) -> dict[str, Any]:
    st = bm.stats()
    per_token = st.held_bytes / st.tokens
    return {
        "setting": setting,
        "ladder": list(bm.ladder),
        "recent_window": bm.config.recent_window,
        "compression_ratio": bm.config.compression_ratio,
        "sequences": st.sequences,
        "sequence_tokens": work.length,
        "tokens": st.tokens,
        "held_bytes": st.held_bytes,
        "held_bytes_per_token": per_token,
        "ratio_vs_fp16": per_token / FP16_BYTES_PER_TOKEN,
        "pool_bytes": bm.pool_bytes,
        "pool_bytes_per_token": bm.pool_bytes / st.tokens,
        "blocks_per_level": {
            f"{p.tier}/{p.level}:{p.codec}": p.blocks for p in st.pools if p.blocks
        },
        "moves": {
            k: st.counters.get(k, 0) for k in ("demotions", "promotions", "offloads", "evictions")
        },
    }


def run_manager(
    setting: str,
    work: Workload,
    inputs: Inputs,
    device: torch.device,
    *,
    read: str | None = "attend",
    read_repeats: int = 1,
) -> dict[str, Any]:
    """The workload on a fresh manager (construction not timed); attention by ``read``:
    ``attend``, ``gather`` (then SDPA) or None (no reads: the memory runs). Ends with an
    untimed ``step()`` before the memory figures."""
    sync = _syncer(device)
    bm = _manager(setting, work, device)
    queries = _queries(work, device)
    sync()
    clock = time.perf_counter
    prefill_appends: list[float] = []
    appends: list[float] = []
    reads: list[float] = []
    steps: list[float] = []
    start = clock()
    seqs = [bm.add_sequence() for _ in range(work.sequences)]
    for seq, (kp, vp, _, _) in zip(seqs, inputs, strict=True):
        for layer in range(LAYERS):
            t0 = clock()
            bm.append(seq, layer, kp, vp)
            sync()
            prefill_appends.append(clock() - t0)
    t0 = clock()
    bm.step()
    sync()
    prefill_step = clock() - t0
    prefill_s = clock() - start
    for g in range(work.steps):
        for layer in range(LAYERS):
            for seq, (_, _, kd, vd) in zip(seqs, inputs, strict=True):
                t0 = clock()
                bm.append(seq, layer, kd[g : g + 1], vd[g : g + 1])
                sync()
                appends.append(clock() - t0)
            t0 = clock()
            if read == "attend":
                bm.attend(seqs, layer, queries[g])
            elif read == "gather":
                for i, seq in enumerate(seqs):
                    _sdpa(queries[g, i], *bm.gather(seq, layer))
            sync()
            if read is not None:
                reads.append(clock() - t0)
        t0 = clock()
        bm.step()
        sync()
        steps.append(clock() - t0)
    total_s = clock() - start
    bm.step()
    sync()
    out: dict[str, Any] = {
        **_throughput(setting, work, total_s, prefill_s),
        "read": read,
        "prefill_append": _ms(prefill_appends),
        "prefill_step_ms": prefill_step * 1e3,
        "append": _ms(appends),
        "attention": _ms(reads),
        "step": _ms(steps),
    }
    if read is not None:

        def read_all() -> None:
            for layer in range(LAYERS):
                if read == "attend":
                    bm.attend(seqs, layer, queries[0], record=False)
                else:
                    for i, seq in enumerate(seqs):
                        _sdpa(queries[0, i], *bm.gather(seq, layer))
            sync()

        read_s = best_of(read_repeats, read_all)
        out["read_all_ms"] = read_s * 1e3
        out["read_all_ms_samples"] = [t * 1e3 for t in read_s.samples]
    out["memory"] = _memory(bm, setting, work)
    if read == "attend":
        out["bandwidth"] = _bandwidth(out["memory"]["held_bytes"], out["read_all_ms"], device)
        out["attend_overhead"] = _attend_overhead(bm, seqs, queries[0], read_repeats, sync)
    return out


def _attend_overhead(
    bm: BlockManager, seqs: list[int], q: torch.Tensor, repeats: int, sync: Callable[[], None]
) -> dict[str, Any]:
    """One layer's ``attend`` call against its kernel alone (the same tables and pools, as the
    manager keeps them): what the call adds to the kernel, per call."""
    from ..attend import run_attention

    calls = 50

    def manager_calls() -> None:
        for _ in range(calls):
            bm.attend(seqs, 1, q, record=False)
        sync()

    lengths = np.array([bm.num_tokens(s, 1) for s in seqs], dtype=np.int32)
    tables = bm.attention_tables
    batch = tables.batch(tuple(seqs), [-(-int(n) // BLOCK_SIZE) for n in lengths])
    out = torch.empty_like(q)
    mass = np.zeros(batch.pools.shape, dtype=np.float32)

    def kernel_calls() -> None:
        for _ in range(calls):
            run_attention(
                q, out, mass, lengths, batch.pools, batch.slots, tables.views, bm.shape, 1,
                HEAD_DIM**-0.5, tables.descriptors, tables.rotation,
            )  # fmt: skip
        sync()

    call_s = best_of(max(repeats, 3), manager_calls)
    kernel_s = best_of(max(repeats, 3), kernel_calls)
    call, kernel = call_s / calls, kernel_s / calls
    return {
        "call_us": call * 1e6,
        "kernel_us": kernel * 1e6,
        "overhead_us": (call - kernel) * 1e6,
        "call_us_samples": [t / calls * 1e6 for t in call_s.samples],
        "kernel_us_samples": [t / calls * 1e6 for t in kernel_s.samples],
    }


def _bandwidth(nbytes: int, read_ms: float, device: torch.device) -> dict[str, Any]:
    """Pool bytes ``attend`` read per second, beside a plain copy of as many bytes."""
    sync = _syncer(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        sync()

    copy_s = best_of(5, copy)
    attend_gbs = nbytes / (read_ms / 1e3) / 1e9
    copy_gbs = nbytes / copy_s / 1e9  # bytes read per second, as for attend
    return {
        "bytes": nbytes,
        "attend_gb_per_s": attend_gbs,
        "copy_gb_per_s": copy_gbs,
        "copy_gb_per_s_samples": [nbytes / t / 1e9 for t in copy_s.samples],
        "ratio_vs_copy": attend_gbs / copy_gbs,
    }


def run_baseline(
    work: Workload,
    inputs: Inputs,
    device: torch.device,
    *,
    read_repeats: int = 1,
    dtype: torch.dtype = DTYPE,
) -> dict[str, Any]:
    """The same appends and reads on a preallocated contiguous cache of ``dtype`` (allocation
    and the inputs' conversion not timed)."""
    sync = _syncer(device)
    shape = (work.length, KV_HEADS, HEAD_DIM)
    cache = [
        [
            (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
            for _ in range(LAYERS)
        ]
        for _ in range(work.sequences)
    ]
    inputs = [tuple(x.to(dtype) for x in four) for four in inputs]  # type: ignore[misc]
    sync()
    queries = _queries(work, device).to(dtype)
    clock = time.perf_counter
    prefill_appends: list[float] = []
    appends: list[float] = []
    reads: list[float] = []
    start = clock()
    for layers, (kp, vp, _, _) in zip(cache, inputs, strict=True):
        for k, v in layers:
            t0 = clock()
            k[: work.prompt].copy_(kp)
            v[: work.prompt].copy_(vp)
            sync()
            prefill_appends.append(clock() - t0)
    prefill_s = clock() - start
    n = work.prompt
    for g in range(work.steps):
        for layer in range(LAYERS):
            for layers, (_, _, kd, vd) in zip(cache, inputs, strict=True):
                k, v = layers[layer]
                t0 = clock()
                k[n : n + 1].copy_(kd[g : g + 1])
                v[n : n + 1].copy_(vd[g : g + 1])
                sync()
                appends.append(clock() - t0)
            t0 = clock()
            for i, layers in enumerate(cache):
                k, v = layers[layer]
                _sdpa(queries[g, i], k[: n + 1], v[: n + 1])
            sync()
            reads.append(clock() - t0)
        n += 1
    total_s = clock() - start

    def read_all() -> None:
        for layer in range(LAYERS):
            for i, layers in enumerate(cache):
                k, v = layers[layer]
                _sdpa(queries[0, i], k[:n], v[:n])
        sync()

    allocated = 2 * work.sequences * LAYERS * math.prod(shape) * dtype.itemsize
    read_s = best_of(read_repeats, read_all)
    return {
        **_throughput(f"contiguous torch cache, {_DTYPE_NAMES[dtype]}", work, total_s, prefill_s),
        "prefill_append": _ms(prefill_appends),
        "append": _ms(appends),
        "attention": _ms(reads),
        "read_all_ms": read_s * 1e3,
        "read_all_ms_samples": [t * 1e3 for t in read_s.samples],
        "allocated_bytes": allocated,
        "allocated_bytes_per_token": allocated / work.tokens,
    }


def run_device(
    device: torch.device, work: Workload, memory_work: Workload, repeats: int, log: Any
) -> dict[str, Any]:
    inputs = _inputs(work, device)
    # Warm-up: first calls into torch ops and the codecs, off the clock.
    tiny = Workload(sequences=1, prompt=48, steps=2)
    for setting, read in TIMED.values():
        run_manager(setting, tiny, _inputs(tiny, device), device, read=read)
    decode: dict[str, Any] = {}
    for name, dtype in BASELINES.items():
        run_baseline(tiny, _inputs(tiny, device), device, dtype=dtype)
        log(f"[{device}] {name}: contiguous torch cache, {_DTYPE_NAMES[dtype]}")
        decode[name] = run_baseline(work, inputs, device, read_repeats=repeats, dtype=dtype)
    baseline = decode["baseline"]
    fastest = max(decode[name]["decode_tokens_per_s"] for name in BASELINES)
    for name, (setting, read) in TIMED.items():
        log(f"[{device}] manager {name}: decode workload")
        r = run_manager(setting, work, inputs, device, read=read, read_repeats=repeats)
        r["tokens_per_s_ratio_vs_baseline"] = r["tokens_per_s"] / baseline["tokens_per_s"]
        r["decode_tokens_per_s_ratio_vs_baseline"] = (
            r["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
        )
        # against the fastest contiguous cache of any dtype: the strongest baseline
        r["decode_tokens_per_s_ratio_vs_fastest_baseline"] = r["decode_tokens_per_s"] / fastest
        decode[name] = r
    del inputs
    memory: dict[str, Any] = {}
    memory_inputs = _inputs(memory_work, device)
    for setting in SETTINGS:
        log(f"[{device}] manager {setting}: memory run, {memory_work.length}-token sequences")
        memory[setting] = run_manager(setting, memory_work, memory_inputs, device, read=None)[
            "memory"
        ]
    return {"device": str(device), "decode": decode, "memory": memory}


def _table(result: dict[str, Any]) -> str:
    work, mem_work = result["workload"], result["memory_workload"]
    lines = [
        f"kvtier bench manager: Llama-3-8B KV ({LAYERS} layers, {KV_HEADS} kv heads, head_dim "
        f"{HEAD_DIM}, fp16), block_size {BLOCK_SIZE}; torch {result['torch']}, "
        f"{result['cpu_threads']} CPU threads",
        f"decode workload: {work['sequences']} sequences x ({work['prompt']} prompt + "
        f"{work['steps']} decode tokens), every layer; attention ({Q_HEADS} query heads) per "
        "layer per decode step; step() after the prefill and after each decode step",
    ]
    for dev in result["devices"]:
        d = dev["decode"]
        base = d["baseline"]
        lines += [
            "",
            f"[{dev['device']}] throughput (tokens of a sequence, all layers; ratio against the "
            "contiguous torch cache)",
            f"  {'':24s} {'tokens/s':>10s} {'x base':>8s} {'decode tok/s':>12s} {'x base':>8s}"
            f" {'x best':>7s} {'prefill s':>9s} {'decode s':>9s}",
        ]
        for name in (*BASELINES, *TIMED):
            r = d[name]
            label = _label(name)
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            dratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            best = r.get("decode_tokens_per_s_ratio_vs_fastest_baseline")
            lines.append(
                f"  {label:24s} {r['tokens_per_s']:10.0f} {ratio:8.3f} "
                f"{r['decode_tokens_per_s']:12.1f} {dratio:8.3f} "
                f"{'-' if best is None else format(best, '.3f'):>7s} {r['prefill_s']:9.2f} "
                f"{r['decode_s']:9.2f}"
            )
        lines.append(
            "  x base: against the contiguous fp16 cache; x best: against the fastest contiguous "
            "cache of any dtype"
        )
        lines += [
            f"[{dev['device']}] per call, mean ms (max)",
            f"  {'':24s} {'prefill append':>15s} {'decode append':>15s} {'attention':>15s}"
            f" {'read all':>9s} {'step':>17s} {'prefill step':>12s}",
        ]
        for name in (*BASELINES, *TIMED):
            r = d[name]
            label = _label(name)
            step = (
                f"{r['step']['mean_ms']:7.3f} ({r['step']['max_ms']:7.2f})" if "step" in r else "-"
            )
            pstep = f"{r['prefill_step_ms']:.1f}" if "prefill_step_ms" in r else "-"
            lines.append(
                f"  {label:24s} {r['prefill_append']['mean_ms']:15.3f} "
                f"{r['append']['mean_ms']:15.3f} {r['attention']['mean_ms']:15.3f} "
                f"{r['read_all_ms']:9.1f} {step:>17s} {pstep:>12s}"
            )
        lines.append(
            f"[{dev['device']}] attend over every layer and sequence: pool bytes read per "
            "second, beside a plain copy of as many bytes"
        )
        for name in ("default", "fp16_only"):
            b, o = d[name]["bandwidth"], d[name]["attend_overhead"]
            lines.append(
                f"  {_label(name):24s} {b['bytes'] / 2**20:8.1f} MiB  attend "
                f"{b['attend_gb_per_s']:7.2f} GB/s  copy {b['copy_gb_per_s']:7.2f} GB/s  "
                f"x copy {b['ratio_vs_copy']:.3f}  one call {o['call_us']:.0f} us = kernel "
                f"{o['kernel_us']:.0f} + {o['overhead_us']:.0f}"
            )
        lines += [
            f"[{dev['device']}] memory after a final step(): held bytes per token against fp16 "
            f"({FP16_BYTES_PER_TOKEN:,} B/token; target at default settings <= {TARGET_RATIO}x)",
            f"  {'':24s} {'seq len':>7s} {'held B/token':>12s} {'x fp16':>7s}"
            f" {'pool MiB':>9s} {'pool B/token':>12s}  blocks per level",
        ]
        rows = [(f"decode: {n}", d[n]["memory"]) for n in ("default", "fp16_only")] + [
            (f"long: {n}", m) for n, m in dev["memory"].items()
        ]
        for label, m in rows:
            levels = ", ".join(f"{k.split(':')[1]} {v}" for k, v in m["blocks_per_level"].items())
            lines.append(
                f"  {label:24s} {m['sequence_tokens']:7d} {m['held_bytes_per_token']:12,.0f} "
                f"{m['ratio_vs_fp16']:7.3f} {m['pool_bytes'] / 2**20:9.1f} "
                f"{m['pool_bytes_per_token']:12,.0f}  {levels}"
            )
        alloc = base["allocated_bytes_per_token"]
        lines.append(
            f"  {'contiguous torch cache':24s} {work['prompt'] + work['steps']:7d} "
            f"{alloc:12,.0f} {alloc / FP16_BYTES_PER_TOKEN:7.3f} "
            f"{base['allocated_bytes'] / 2**20:9.1f} {alloc:12,.0f}  (preallocated to the length)"
        )
    lines.append(
        f"settings: default = fp16,int8,int4, compression_ratio 0.5, recent_window 128; fp16_only"
        f" = enable_compression=False; aggressive = compression_ratio 0.0, recent_window 32; "
        f"device_blocks {result['device_blocks']} (decode) / {result['memory_device_blocks']} "
        f"(long: {mem_work['sequences']} x {mem_work['prompt'] + mem_work['steps']} tokens, no "
        "reads)"
    )
    if not result["cuda"]:
        lines.append("cuda: not available (torch.cuda.is_available() is False): not measured")
    return "\n".join(lines)


def _label(name: str) -> str:
    if name in BASELINES:
        return f"contiguous {_DTYPE_NAMES[BASELINES[name]]} + SDPA"
    setting, read = TIMED[name]
    return f"{setting}: {read}"


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        "manager",
        __doc__,
        f"{QUICK.sequences} x ({QUICK.prompt} + {QUICK.steps}) tokens, memory at "
        f"{QUICK_MEMORY.length}",
    )
    ap.add_argument("--sequences", type=positive_int, default=None, help="S (default: 4, quick: 2)")
    ap.add_argument(
        "--prompt", type=positive_int, default=None, help="P tokens (default: 512, quick: 256)"
    )
    ap.add_argument(
        "--steps", type=positive_int, default=None, help="G decode steps (default: 32, quick: 4)"
    )
    ap.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed runs of 'read all' (best; default 3)",
    )
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU figures")
    ap.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's choice)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = QUICK if args.quick else FULL
    work = Workload(
        args.sequences or base.sequences, args.prompt or base.prompt, args.steps or base.steps
    )
    memory_work = QUICK_MEMORY if args.quick else FULL_MEMORY
    repeats = args.repeats or (1 if args.quick else 3)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "shape": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "fp16",
        },
        "fp16_bytes_per_token": FP16_BYTES_PER_TOKEN,
        "target_ratio_vs_fp16": TARGET_RATIO,
        "workload": asdict(work),
        "memory_workload": asdict(memory_work),
        "device_blocks": _device_blocks(work),
        "memory_device_blocks": _device_blocks(memory_work),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda": cuda,
        "devices": [],
    }
    log(
        f"kvtier bench manager: {work.sequences} x ({work.prompt} + {work.steps}) tokens; memory "
        f"at {memory_work.length} tokens"
    )
    devices = ([] if args.no_cpu else [torch.device("cpu")]) + (
        [torch.device("cuda", torch.cuda.current_device())] if cuda else []
    )
    for device in devices:
        result["devices"].append(run_device(device, work, memory_work, repeats, log))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    save_if_asked(args, result, ap.prog, argv)
    return 0


if __name__ == "__main__":
    run_as_script("manager")
