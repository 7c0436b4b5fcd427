"""The CPU attention kernel's time per call (kvtier._core.attend, crates/kvtier-attend), run by
hand: ``python benchmarks/attend_cpu.py [--json] [--repeat N]``. Prints figures, never passes or
fails.

Cases: SmolLM2-135M decode (1 sequence, 1 query, 9 query heads over 3 K/V heads, head_dim 64,
fp32) at 512 and 4096 tokens; Llama-3-8B decode (4 sequences of 528 tokens, 32 query heads over
8, head_dim 128, fp16). Each over blocks all at level 0, all int8, all int4, all int2, and the
ladder (the newest 25 % at level 0, the next 25 % int8, the oldest half int4). One layer's pools,
so the bytes the kernel reads are exactly the pools' bytes that the block tables name.

Beside each: a torch copy of the same number of bytes (``dst.copy_(src)``, which reads and
writes them) and ``torch.nn.functional.scaled_dot_product_attention`` over a contiguous
uncompressed cache of the same tokens (in the model's dtype, and in fp32: torch's CPU SDPA is slow
in fp16), both measured in the same run, on one torch
thread unless ``--torch-threads`` says otherwise. Columns: the kernel through ``_core.attend``
on the calling thread (``threads=1``) and on rayon's pool (``threads=0``: small calls stay on the
calling thread); ``attend_cpu`` with its checks and with ``checked=False``. Times are the best
of ``--repeat`` batches' means (the machine may be shared); ``--save PATH`` writes every case
with each batch's mean (``*_us_samples``) and the run's provenance."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier import _core
from kvtier.attend import FLOAT_CODES, PoolView, attend_cpu, describe
from kvtier.codecs import BlockShape, get_codec
from kvtier.results import add_save_option, save_if_asked

MIXES = ("level0", "int8", "int4", "int2", "ladder")


def best_us(
    fn: Callable[[], Any], repeat: int, budget_s: float = 0.15
) -> tuple[float, list[float]]:
    """Best mean time of one call over ``repeat`` batches, in microseconds, and each batch's."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, min(2000, int(budget_s / repeat / one)))
    means = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        means.append((time.perf_counter() - t0) / per_batch * 1e6)
    return min(means), means


def case(
    name: str,
    *,
    seqs: int,
    tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    mix: str,
    repeat: int,
) -> dict[str, Any]:
    B = 16
    shape = BlockShape(1, kv_heads, B, head_dim, dtype)
    blocks = -(-tokens // B)
    levels = {"level0": [dtype], "int8": ["int8"], "int4": ["int4"], "int2": ["int2"]}.get(
        mix, [dtype, "int8", "int4"]
    )
    gen = torch.Generator().manual_seed(0)
    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    # a level for each block: the ladder's newest quarter at level 0, then int8, the rest int4
    if mix == "ladder":
        at = np.full(blocks, 2, np.int32)
        at[blocks - blocks // 2 :] = 1
        at[blocks - blocks // 4 :] = 0
    else:
        at = np.zeros(blocks, np.int32)
    views, pool_bytes = [], 0
    slots = seqs * blocks
    block_pool = np.tile(at, (seqs, 1)).astype(np.int32)
    block_slot = np.arange(slots, dtype=np.int32).reshape(seqs, blocks)  # each block its own row
    for level, codec_name in enumerate(levels):
        codec = get_codec(codec_name)
        used = int((block_pool == level).sum())
        values = torch.randn((slots, *shape.dims), generator=gen).to(tdtype)
        if codec_name == dtype:
            tensor = values
        else:
            tensor = torch.zeros((slots, codec.bytes_per_block(shape)), dtype=torch.uint8)
            every = torch.arange(slots)
            codec.encode_into(values, every, tensor, every)
        views.append(PoolView(tensor, codec))
        pool_bytes += used * (tensor.numel() * tensor.element_size() // slots)
    seq_lens = np.full(seqs, tokens, np.int32)
    q = torch.randn((seqs, 1, q_heads, head_dim), generator=gen).to(tdtype)
    out = torch.empty_like(q)
    mass = np.empty((seqs, blocks), np.float32)
    scale = head_dim**-0.5
    desc = describe(views, shape)

    def kernel(threads: int) -> Callable[[], None]:
        args = (q.data_ptr(), FLOAT_CODES[dtype], out.data_ptr(), mass.ctypes.data)
        sizes = (seqs, 1, q_heads, kv_heads, B, head_dim, blocks, 0, scale, threads)
        return lambda: _core.attend(*args, seq_lens, block_pool, block_slot, desc, *sizes)

    row: dict[str, Any] = {
        "case": name,
        "mix": mix,
        "tokens": tokens,
        "seqs": seqs,
        "pool_bytes": pool_bytes,
    }

    def timed(key: str, fn: Callable[[], Any]) -> None:
        row[key], row[f"{key}_samples"] = best_us(fn, repeat)

    timed("kernel_us", kernel(1))
    timed("kernel_pool_us", kernel(0))
    args = (q, out, mass, seq_lens, block_pool, block_slot, views, shape, 0, scale)
    timed("attend_cpu_us", lambda: attend_cpu(*args, threads=1))
    timed("attend_cpu_unchecked_us", lambda: attend_cpu(*args, threads=1, checked=False))
    src = torch.empty(pool_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    timed("memcpy_us", lambda: dst.copy_(src))
    k = torch.randn((seqs, kv_heads, tokens, head_dim), generator=gen).to(tdtype)
    v = torch.randn_like(k)
    qs = q.transpose(1, 2)  # [S, Hq, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    timed("sdpa_us", lambda: sdpa(qs, k, v, scale=scale, enable_gqa=True))
    if dtype == "fp32":
        row["sdpa_fp32_us"], row["sdpa_fp32_us_samples"] = row["sdpa_us"], row["sdpa_us_samples"]
    else:  # torch's CPU SDPA in fp16 is far slower than in fp32: both are shown
        q32, k32, v32 = qs.float(), k.float(), v.float()
        timed("sdpa_fp32_us", lambda: sdpa(q32, k32, v32, scale=scale, enable_gqa=True))
    row["sdpa_cache_bytes"] = 2 * k.numel() * k.element_size()
    row["kernel_gbps"] = pool_bytes / row["kernel_us"] / 1e3
    row["memcpy_gbps"] = pool_bytes / row["memcpy_us"] / 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    parser.add_argument("--repeat", type=int, default=15, help="batches per figure (best kept)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's threads for the baselines (default 1, as the kernel's first column)",
    )
    add_save_option(parser)
    a = parser.parse_args(argv)
    torch.set_num_threads(a.torch_threads)
    shapes = [
        ("smollm2", {"seqs": 1, "tokens": 512, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "fp32"}),
        ("smollm2", {"seqs": 1, "tokens": 4096, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "fp32"}),
        ("llama3-8b", {"seqs": 4, "tokens": 528, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16"}),
    ]  # fmt: skip
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
    if not a.json:
        print(
            f"{'case':<10} {'tokens':>6} {'mix':<7} {'MB read':>8} {'kernel us':>9} {'GB/s':>6} "
            f"{'pool us':>8} {'py us':>7} {'py!chk':>7} {'memcpy us':>9} {'GB/s':>6} "
            f"{'sdpa us':>8} {'sdpa32':>7} {'vs memcpy':>9} {'vs sdpa32':>9}"
        )
    rows = []
    for name, kw in shapes:
        for mix in MIXES:
            r = case(name, mix=mix, repeat=a.repeat, **kw)  # type: ignore[arg-type]
            rows.append(r)
            if a.json:
                print(json.dumps(r))
                continue
            print(
                f"{name:<10} {r['tokens']:>6} {mix:<7} {r['pool_bytes'] / 1e6:>8.3f} "
                f"{r['kernel_us']:>9.1f} {r['kernel_gbps']:>6.1f} {r['kernel_pool_us']:>8.1f} "
                f"{r['attend_cpu_us']:>7.1f} {r['attend_cpu_unchecked_us']:>7.1f} "
                f"{r['memcpy_us']:>9.1f} {r['memcpy_gbps']:>6.1f} {r['sdpa_us']:>8.1f} "
                f"{r['sdpa_fp32_us']:>7.1f} {r['kernel_us'] / r['memcpy_us']:>8.2f}x "
                f"{r['kernel_us'] / r['sdpa_fp32_us']:>8.2f}x"
            )
    result = {"torch_threads": torch.get_num_threads(), "repeat": a.repeat, "rows": rows}
    save_if_asked(a, result, "python benchmarks/attend_cpu.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
