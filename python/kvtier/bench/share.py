"""``kvtier bench share``: an engine takes a prompt's K/V that another engine published to Redis,
beside plain redis-py GETs of the same values, in one run.

The shape: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, fp16) in blocks of 16 tokens, so
a block is 2 MiB at level 0. Compression is off, so that a ``step()`` moves nothing and what it
costs is the publishing.

- publish: engine A (``share_prefixes``) appends a P-token prompt to every layer, then one
  ``step()`` puts its complete blocks on the server. Beside it: the same appends and ``step()``
  by an engine without sharing.
- take: a fresh engine B calls ``add_sequence(prompt)``: one pipelined round trip for the
  prompt's blocks, each value's checks, the copy into B's device pool. Baseline: the same keys
  fetched with one redis-py pipeline of GETs (bytes only: no checks, no copy). For scale, the
  time B would spend appending the prompt's K/V itself (the model's compute to make it is not
  counted).

Every round checks that B gathers exactly A's K/V. Starts a redis-server on loopback unless
``--redis-url`` names one. Prints a table (``--json``: one JSON object); figures, never pass/fail.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..cli import positive_int
from ..config import KvtierConfig
from ..errors import KvtierError, require
from ..manager import BlockManager
from ..results import save_if_asked
from ..stores.local_redis import LocalRedis
from . import bench_parser, run_as_script

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float16
PROMPT, QUICK_PROMPT = 512, 128
ROUNDS, QUICK_ROUNDS = 5, 1


def _engine(url: str, namespace: str, blocks: int, share: bool) -> BlockManager:
    config = KvtierConfig(
        block_size=BLOCK_SIZE,
        enable_compression=False,
        device_blocks=2 * blocks + 2,
        remote_budget=1 << 30,
        remote_url=url,
        share_prefixes=share,
        namespace=namespace,
    )
    bm = BlockManager(config, LAYERS, KV_HEADS, HEAD_DIM, DTYPE, "cpu")
    for pool in bm.pools.values():
        pool.zero_()  # touched, as in an engine that has run a while: no first-write page faults
    return bm


def _append(bm: BlockManager, ids: np.ndarray, kv: torch.Tensor) -> int:
    seq = bm.add_sequence(ids)
    for layer in range(LAYERS):
        bm.append(seq, layer, kv[layer, 0], kv[layer, 1])
    return seq


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _samples(seconds: list[float]) -> list[float]:
    """Every round's time in ms, in order: the spread behind a median of :func:`_ms`."""
    return [t * 1e3 for t in seconds]


def run(prompt: int, rounds: int, url: str, log: Callable[..., None]) -> dict[str, Any]:
    redis = require("redis", "redis", purpose="kvtier bench share needs redis-py")
    blocks = prompt // BLOCK_SIZE
    ids = np.arange(prompt) + 1
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYERS, 2, prompt, KV_HEADS, HEAD_DIM, generator=g).to(DTYPE)
    client = redis.Redis.from_url(url)
    publish, plain_step, take, raw_get, append = [], [], [], [], []
    try:
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            namespace = f"bench-share-{uuid.uuid4().hex[:8]}"
            a, plain = _engine(url, namespace, blocks, True), _engine(url, namespace, blocks, False)
            seq_a = _append(a, ids, kv)
            publish.append(_timed(a.step)[0])
            _append(plain, ids, kv)
            plain_step.append(_timed(plain.step)[0])
            if a.stats().counters["prefix_published"] != blocks:
                raise KvtierError(f"engine A published {a.stats().counters} of {blocks} blocks")

            b = _engine(url, namespace, blocks, True)
            seconds, seq_b = _timed(functools.partial(b.add_sequence, ids))
            take.append(seconds)
            if b.num_tokens(seq_b) != prompt:
                raise KvtierError(f"engine B took {b.num_tokens(seq_b)} of {prompt} tokens")
            for layer in (0, LAYERS - 1):
                if not all(map(torch.equal, a.gather(seq_a, layer), b.gather(seq_b, layer))):
                    raise KvtierError(f"engine B's K/V differs from A's at layer {layer}")

            hashes = a.core.block_info(a.core.sequence_blocks(seq_a))["hash"]
            keys = [a.stores["remote", 0].namespace.key(int(h)) for h in hashes]
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            seconds, values = _timed(pipe.execute)
            raw_get.append(seconds)
            if sum(len(v) for v in values) < blocks * a.level_bytes[0]:
                raise KvtierError("the baseline's GETs came back short")

            c = _engine(url, namespace + "-alone", blocks, False)
            append.append(_timed(functools.partial(_append, c, ids, kv))[0])
            client.delete(*keys)
            for bm in (a, plain, b, c):
                bm.close()
    finally:
        client.close()
    nbytes = blocks * a.level_bytes[0]
    take_ms, raw_ms = _ms(take), _ms(raw_get)
    return {
        "shape": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "fp16",
        },
        "prompt_tokens": prompt,
        "blocks": blocks,
        "bytes": nbytes,
        "rounds": rounds,
        "redis": {
            "url": url,
            "version": _server_version(redis, url),
            "parser": "hiredis" if importlib.util.find_spec("hiredis") else "python",
        },
        "publish": {
            "step_ms": _ms(publish),
            "step_ms_without_sharing": _ms(plain_step),
            "step_ms_samples": _samples(publish),
            "step_ms_without_sharing_samples": _samples(plain_step),
            "gb_per_s": nbytes / statistics.median(publish) / 1e9,
        },
        "take": {
            "add_sequence_ms": take_ms,
            "gb_per_s": nbytes / statistics.median(take) / 1e9,
            "baseline": "one redis-py pipeline of GETs, bytes only",
            "baseline_ms": raw_ms,
            "ratio_vs_baseline": take_ms / raw_ms,
            "add_sequence_ms_samples": _samples(take),
            "baseline_ms_samples": _samples(raw_get),
        },
        "append_prompt_ms": _ms(append),
        "append_prompt_ms_samples": _samples(append),
    }


def _server_version(redis: Any, url: str) -> str:
    probe = redis.Redis.from_url(url)
    try:
        return str(probe.info("server")["redis_version"])
    finally:
        probe.close()


def _table(result: dict[str, Any]) -> str:
    s, p, t = result["shape"], result["publish"], result["take"]
    mib = result["bytes"] / 2**20
    lines = [
        f"kvtier bench share: a {result['prompt_tokens']}-token prompt, {result['blocks']} blocks "
        f"of {s['layers']}x{s['kv_heads']}x{s['head_dim']} fp16 KV ({mib:.1f} MiB), median of "
        f"{result['rounds']} round(s); redis {result['redis']['version']}, "
        f"{result['redis']['parser']} parser",
        f"publish  step() with sharing      {p['step_ms']:9.1f} ms  ({p['gb_per_s']:.2f} GB/s)",
        f"         step() without sharing   {p['step_ms_without_sharing']:9.1f} ms",
        f"take     add_sequence(prompt)     {t['add_sequence_ms']:9.1f} ms  "
        f"({t['gb_per_s']:.2f} GB/s)",
        f"         baseline: redis-py GETs  {t['baseline_ms']:9.1f} ms  "
        f"(kvtier / baseline: {t['ratio_vs_baseline']:.2f})",
        f"append   the prompt's K/V itself  {result['append_prompt_ms']:9.1f} ms  "
        "(without the model's compute)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("share", __doc__, f"a {QUICK_PROMPT}-token prompt, {QUICK_ROUNDS} round")
    ap.add_argument(
        "--prompt", type=positive_int, default=None, help=f"P tokens (default: {PROMPT})"
    )
    ap.add_argument("--rounds", type=positive_int, default=None, help=f"rounds (default: {ROUNDS})")
    ap.add_argument(
        "--redis-url",
        default=None,
        help="a Redis server to share through (default: start redis-server on loopback)",
    )
    args = ap.parse_args(argv)
    prompt = args.prompt or (QUICK_PROMPT if args.quick else PROMPT)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    if prompt < BLOCK_SIZE or rounds < 1:
        ap.error(f"expected --prompt >= {BLOCK_SIZE} and --rounds >= 1, got {prompt}, {rounds}")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(LocalRedis()).url
        result = run(prompt, rounds, url, log)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    save_if_asked(args, result, ap.prog, argv)
    return 0


if __name__ == "__main__":
    run_as_script("share")
