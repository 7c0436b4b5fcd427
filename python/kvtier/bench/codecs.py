"""``kvtier bench codecs``: encode/decode speed of the codecs on a Llama-3-8B-shaped KV.

The work: 1,024 tokens of Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, fp16 — 128 MiB)
in 64 blocks of 16 tokens, encoded into a packed pool and decoded back. Effective bandwidth
counts the bytes a pass must move: fp16 blocks read plus packed bytes written (encode), or the
reverse (decode).

- CPU: kvtier's native codecs (Rust, crates/kvtier-attend/src/codec.rs; what ``backend="auto"``
  runs on the CPU) beside its torch reference, measured in the same run (``kv_gb_per_s``: the
  16-bit K/V bytes encoded or decoded a second; ``speedup_vs_torch_cpu``: native over torch),
  a plain torch copy of the same K/V (the memory's pace on this machine), the int8 -> int4
  transcode both ways, a plain per-token torch quantizer (the few lines people write) and
  transformers' quantized-cache backend, optimum-quanto (if installed), quantizing the same K/V
  as ``QuantizedCache`` does (int4, group 64, MaxOptimizer).
- GPU (when CUDA is available): kvtier's CUDA kernels beside the same torch reference on the
  GPU, as a ratio; and the int8 -> int4 transcode. Times are the median of CUDA-event-timed
  runs after warm-up.

Prints a table on stderr and JSON on stdout (``--json``: JSON only). Figures, never pass/fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..cli import positive_int
from ..codecs import Backend, BlockShape, Codec, get_codec
from ..results import save_if_asked
from . import bench_parser
from .core import Seconds, Timer, cpu_time, gpu_time

SHAPE = BlockShape(layers=32, kv_heads=8, block_size=16, head_dim=128, dtype="fp16")
TOKENS = 1024
QUICK_TOKENS = 64
CODECS = ("int8", "int4")
#: HBM bandwidth by device name fragment, GB/s (vendor data sheets), for "% of peak".
PEAK_GBPS = {"H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0}


def _row(name: str, seconds: Seconds, moved: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "us": seconds * 1e6,
        "us_samples": [t * 1e6 for t in seconds.samples],
        "gb_per_s": moved / seconds / 1e9,
        "bytes_moved": moved,
        **extra,
    }


def _blocks(device: str, tokens: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = tokens // SHAPE.block_size
    return torch.randn((n, *SHAPE.dims), generator=gen).to(dtype).to(device)


def bench_codec(
    codec: Codec, blocks: torch.Tensor, backend: Backend, timer: Timer, repeats: int
) -> list[dict[str, Any]]:
    n = blocks.shape[0]
    packed_bytes = n * codec.bytes_per_block(SHAPE)
    kv_bytes = blocks.numel() * blocks.element_size()
    packed = torch.empty((n, codec.bytes_per_block(SHAPE)), dtype=torch.uint8, device=blocks.device)
    out = torch.empty_like(blocks)
    slots = torch.arange(n)
    enc = timer(lambda: codec.encode_into(blocks, slots, packed, slots, backend=backend), repeats)
    dec = timer(lambda: codec.decode_into(packed, slots, out, slots, backend=backend), repeats)
    moved = kv_bytes + packed_bytes
    suffix = " (native)" if backend == "native" else ""
    return [
        _row(
            f"{codec.name} {op}{suffix}",
            seconds,
            moved,
            codec=codec.name,
            op=op,
            backend=backend,
            kv_gb_per_s=kv_bytes / seconds / 1e9,
        )
        for op, seconds in (("encode", enc), ("decode", dec))
    ]


def plain_torch_int8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token symmetric int8 quantizer people write inline: the CPU baseline."""
    scale = blocks.abs().amax(-1, keepdim=True).float() / 127
    q = (blocks.float() / scale.clamp_min(1e-8)).round().to(torch.int8)
    return q, scale.half()


def bench_quanto(blocks: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """optimum-quanto doing QuantizedCache's work on the same K/V: int4, axis 0, group 64."""
    try:
        from optimum.quanto import MaxOptimizer, qint4, quantize_weight
    except ImportError:
        return []
    # quanto JIT-builds its C++ unpacker with ninja: find the one pip put beside this Python.
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"]))
    optimizer = MaxOptimizer()
    # QuantizedCache hands quanto [batch, heads, tokens, head_dim] per layer: one tensor each
    # for K and V of every layer.
    tokens = blocks.shape[0] * SHAPE.block_size
    kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(SHAPE.layers, 2, 1, SHAPE.kv_heads, tokens, -1)
    tensors = [kv[layer, i].contiguous() for layer in range(SHAPE.layers) for i in range(2)]

    def quantize() -> list[Any]:
        out = []
        for t in tensors:
            scale, zero = optimizer(t, qint4, 0, 64)
            out.append(quantize_weight(t, qint4, 0, scale, zero, 64))
        return out

    quantized = quantize()
    enc = cpu_time(quantize, repeats)
    dec = cpu_time(lambda: [q.dequantize() for q in quantized], repeats)
    packed = sum(
        q._data._data.numel() + 2 * (q._scale.numel() + q._shift.numel()) for q in quantized
    )
    moved = blocks.numel() * 2 + packed
    return [
        _row(
            "quanto int4 encode", enc, moved, codec="quanto-int4-g64", op="encode", backend="quanto"
        ),
        _row(
            "quanto int4 decode", dec, moved, codec="quanto-int4-g64", op="decode", backend="quanto"
        ),
    ]


def run_cpu(
    repeats: int, tokens: int, *, quanto: bool = True, dtype: torch.dtype = torch.float16
) -> list[dict[str, Any]]:
    blocks = _blocks("cpu", tokens, dtype)
    kv_bytes = blocks.numel() * blocks.element_size()
    rows = []
    for name in CODECS:
        codec = get_codec(name)
        reference = bench_codec(codec, blocks, "torch", cpu_time, repeats)
        for r, t in zip(
            bench_codec(codec, blocks, "native", cpu_time, repeats), reference, strict=True
        ):
            r["torch_cpu_us"] = t["us"]
            r["speedup_vs_torch_cpu"] = t["us"] / r["us"]
            rows.append(r)
        rows += reference
    out = torch.empty_like(blocks)
    seconds = cpu_time(lambda: out.copy_(blocks), repeats)
    rows.append(
        _row(
            "torch copy (memory pace)",
            seconds,
            2 * kv_bytes,
            codec="copy",
            op="copy",
            backend="torch",
            kv_gb_per_s=kv_bytes / seconds / 1e9,
        )
    )
    rows += _cpu_transcodes(blocks, repeats)
    seconds = cpu_time(lambda: plain_torch_int8(blocks), repeats)
    moved = blocks.numel() * 3 + blocks.numel() // SHAPE.head_dim * 2
    rows.append(
        _row(
            "plain torch int8 encode",
            seconds,
            moved,
            codec="plain-int8",
            op="encode",
            backend="torch",
        )
    )
    try:
        rows += bench_quanto(blocks, repeats) if quanto else []
    except Exception as exc:  # a peer that fails to build is reported, not fatal
        print(f"quanto peer skipped: {exc}", file=sys.stderr)
    return rows


def _cpu_transcodes(blocks: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """int8 -> int4 rows on the CPU, native and torch, with their ratio."""
    int8, int4 = get_codec("int8"), get_codec("int4")
    shape = dataclasses.replace(SHAPE, dtype=_DTYPE_NAMES[blocks.dtype])
    n = blocks.shape[0]
    src = int8.encode(blocks).data
    dst = torch.empty((n, int4.bytes_per_block(shape)), dtype=torch.uint8)
    slots = torch.arange(n)
    kv_bytes = blocks.numel() * blocks.element_size()
    rows = []
    for backend in ("native", "torch"):

        def move(b: Backend = backend) -> None:
            int8.transcode_into(src, slots, int4, dst, slots, shape, backend=b)

        seconds = cpu_time(move, repeats)
        rows.append(
            _row(
                f"int8->int4 transcode ({backend})",
                seconds,
                src.numel() + dst.numel(),
                codec="int8->int4",
                op="transcode",
                backend=backend,
                kv_gb_per_s=kv_bytes / seconds / 1e9,
            )
        )
    rows[0]["torch_cpu_us"] = rows[1]["us"]
    rows[0]["speedup_vs_torch_cpu"] = rows[1]["us"] / rows[0]["us"]
    return rows


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def run_gpu(repeats: int, tokens: int) -> dict[str, Any]:
    blocks = _blocks("cuda", tokens)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    rows = []
    for codec_name in CODECS:
        codec = get_codec(codec_name)
        kernel = bench_codec(codec, blocks, "cuda", gpu_time, repeats)
        reference = bench_codec(codec, blocks, "torch", gpu_time, repeats)
        for k, r in zip(kernel, reference, strict=False):
            k["torch_gpu_us"] = r["us"]
            k["speedup_vs_torch_gpu"] = r["us"] / k["us"]
            if peak:
                k["pct_of_peak"] = 100 * k["gb_per_s"] / peak
            rows.append(k)
    int8, int4 = get_codec("int8"), get_codec("int4")
    n = blocks.shape[0]
    src = int8.encode(blocks).data
    dst = torch.empty((n, int4.bytes_per_block(SHAPE)), dtype=torch.uint8, device="cuda")
    slots = torch.arange(n)
    moved = src.numel() + dst.numel()
    backends: tuple[Backend, ...] = ("cuda", "torch")
    for backend in backends:

        def move(b: Backend = backend) -> None:
            int8.transcode_into(src, slots, int4, dst, slots, SHAPE, backend=b)

        seconds = gpu_time(move, repeats)
        rows.append(
            _row(
                f"int8->int4 transcode ({backend})",
                seconds,
                moved,
                codec="int8->int4",
                op="transcode",
                backend=backend,
            )
        )
    return {"device": name, "peak_gb_per_s": peak, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("codecs", __doc__, f"{QUICK_TOKENS} tokens, one run", "print only the JSON")
    ap.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per figure (CPU: best)"
    )
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU figures")
    ap.add_argument("--no-quanto", action="store_true", help="skip the optimum-quanto peer")
    ap.add_argument(
        "--dtype", choices=("fp16", "bf16"), default="fp16", help="the K/V's dtype on the CPU"
    )
    args = ap.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tokens = QUICK_TOKENS if args.quick else TOKENS
    repeats = 1 if args.quick else args.repeats
    log = (lambda *_: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    log(
        f"kvtier bench codecs: {tokens} tokens of Llama-3-8B KV ({SHAPE}; on the CPU in "
        f"{args.dtype}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    result: dict[str, Any] = {
        "shape": SHAPE.__dict__,
        "tokens": tokens,
        "fp16_bytes": tokens // SHAPE.block_size * SHAPE.fp16_bytes,
        "cpu_threads": torch.get_num_threads(),
    }
    if not args.no_cpu:
        result["cpu_dtype"] = args.dtype
        result["cpu"] = run_cpu(repeats, tokens, quanto=not args.no_quanto, dtype=dtype)
        for r in result["cpu"]:
            extra = ""
            if "kv_gb_per_s" in r:
                extra = f"  {r['kv_gb_per_s']:6.2f} GB/s of {args.dtype} K/V"
            if "speedup_vs_torch_cpu" in r:
                extra += f"  x{r['speedup_vs_torch_cpu']:.1f} vs torch"
            log(f"cpu  {r['name']:32s} {r['us'] / 1e3:9.2f} ms  {r['gb_per_s']:7.2f} GB/s{extra}")
    if torch.cuda.is_available():
        result["gpu"] = run_gpu(repeats if args.quick else max(repeats, 20), tokens)
        log(f"gpu: {result['gpu']['device']}")
        for r in result["gpu"]["rows"]:
            extra = ""
            if "speedup_vs_torch_gpu" in r:
                extra = f"  x{r['speedup_vs_torch_gpu']:.1f} vs torch on GPU"
            if "pct_of_peak" in r:
                extra += f"  {r['pct_of_peak']:.0f}% of HBM peak"
            log(f"gpu  {r['name']:28s} {r['us']:9.1f} us  {r['gb_per_s']:8.1f} GB/s{extra}")
    else:
        result["gpu"] = None
        log("gpu: none (torch.cuda.is_available() is False): GPU figures not measured")
    print(json.dumps(result, indent=2))
    save_if_asked(args, result, ap.prog, argv)
    return 0
