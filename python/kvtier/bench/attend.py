"""``kvtier bench attend``: attention straight over stored blocks, beside a memory copy and SDPA.

One call is one layer of one decode step (one query per sequence) for a batch of sequences whose
blocks lie in pools of one or several levels:

- ``level0``: every block in the model dtype; ``int8``; ``int4``;
- ``ladder``: the default ladder (dtype, int8, int4) in the vLLM connector's default pool shares,
  oldest blocks lowest: the first 84 % of a sequence's blocks int4, the next 8 % int8, the
  newest 8 % in the model dtype.

Shapes: Llama-3-8B (32 query heads, 8 K/V heads, head_dim 128, fp16, blocks of 16) on a GPU, and
SmolLM2-135M (9/3/64, fp32) on the CPU. The pools hold one layer (a real pool's other layers
only put its rows further apart; the bytes read per call are the same), their slots shuffled.

Per call: the kernel's time, the pool bytes it reads per second, and two baselines measured in
the same run on the same device:

- a plain device memory copy of as many bytes (``dst.copy_(src)``, whose GB/s counts the bytes
  read and written): the bandwidth reference, and on a GPU the kernel's read rate as % of it;
- torch's ``scaled_dot_product_attention`` over an uncompressed contiguous cache of the same
  tokens in the model dtype (``enable_gqa``): ``speedup_vs_sdpa`` = SDPA's time / the kernel's.

Backends: ``cuda`` (kvtier.attend.attend_cuda) on a GPU; on the CPU the Rust kernel
``kvtier.attend.attend_cpu`` where this build has it, else the torch reference
(``kvtier.attend.reference``, said so in the output). Figures, never pass/fail; a table on
stderr, JSON on stdout (``--json``: JSON only). Times are medians of CUDA-event-timed runs after
warm-up on a GPU, the best of ``--repeats`` on the CPU.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import attend as attend_mod
from ..attend import PoolView
from ..cli import positive_int
from ..codecs import BlockShape, Codec, get_codec
from ..results import save_if_asked
from . import bench_parser
from .core import cpu_time, gpu_time

#: ``fn(q, out, mass, seq_lens, block_pool, block_slot, pools, shape, layer, scale)``
Kernel = Callable[..., None]


@dataclass(frozen=True)
class Model:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16


LLAMA3_8B = Model("llama3-8b", 32, 8, 128, "fp16")
SMOLLM2 = Model("smollm2-135m", 9, 3, 64, "fp32")
GPU_CONTEXTS = (512, 4096, 32768)
CPU_CONTEXTS = (512, 4096)
QUICK_CONTEXTS = (256,)
MIXES = ("level0", "int8", "int4", "ladder")
#: the vLLM connector's default pool shares, newest level first: (level 0, int8, int4)
LADDER_SHARES = (0.08, 0.08, 0.84)
_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ---- backends -------------------------------------------------------------------------------------


def _reference_kernel(
    q: torch.Tensor, out: torch.Tensor, mass: torch.Tensor, *args: Any, **kwargs: Any
) -> None:
    o, m = attend_mod.reference(q, *args, **kwargs)
    out.copy_(o)
    mass.copy_(m)


def kernels() -> dict[str, Kernel]:
    """The backends this build and machine have, by name."""
    found: dict[str, Kernel] = {"reference": _reference_kernel}
    attend_cpu = getattr(attend_mod, "attend_cpu", None)
    if attend_cpu is not None:
        found["cpu"] = attend_cpu
    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401

            from ..attend import attend_cuda

            found["cuda"] = attend_cuda
        except ImportError:
            pass
    return found


def default_backend(found: dict[str, Kernel]) -> str:
    return next(b for b in ("cuda", "cpu", "reference") if b in found)


# ---- the work -------------------------------------------------------------------------------------


def levels(mix: str, model: Model) -> list[str]:
    return {"level0": [model.dtype], "int8": ["int8"], "int4": ["int4"]}.get(
        mix, [model.dtype, "int8", "int4"]
    )


def level_of_blocks(mix: str, blocks: int) -> np.ndarray:
    """Which of the mix's levels each block of a sequence lies at (0: the first listed)."""
    if mix != "ladder":
        return np.zeros(blocks, dtype=np.int32)
    newest = round(blocks * LADDER_SHARES[0])
    middle = round(blocks * LADDER_SHARES[1])
    at = np.full(blocks, 2, dtype=np.int32)  # the oldest: int4
    at[blocks - newest - middle : blocks - newest] = 1
    at[blocks - newest :] = 0
    return at


@dataclass
class Work:
    """One call's inputs, the pools it reads and the baselines' inputs."""

    q: torch.Tensor
    out: torch.Tensor
    mass: torch.Tensor
    seq_lens: np.ndarray
    block_pool: np.ndarray
    block_slot: np.ndarray
    pools: list[PoolView]
    shape: BlockShape
    scale: float
    #: bytes of pool rows the call reads (K and V of every block at the call's layer)
    pool_bytes: int
    #: the same tokens, uncompressed and contiguous: [seqs, kv_heads, tokens, head_dim]
    k: torch.Tensor
    v: torch.Tensor


def layer_bytes(codec: Codec, shape: BlockShape) -> int:
    """Bytes of one layer of one block (every pool section is layer-major)."""
    return codec.bytes_per_block(shape) // shape.layers


def build(model: Model, mix: str, context: int, seqs: int, device: str, seed: int = 0) -> Work:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = np.random.default_rng(seed)
    B, D, H = model.block_size, model.head_dim, model.kv_heads
    shape = BlockShape(1, H, B, D, model.dtype)
    dtype = _TORCH_DTYPES[model.dtype]
    m = -(-context // B)
    kv = torch.randn((seqs * m, *shape.dims), generator=gen).to(dtype).to(device)
    codecs = [get_codec(name) for name in levels(mix, model)]
    at = np.tile(level_of_blocks(mix, m), seqs)
    block_pool = at.reshape(seqs, m).astype(np.int32)
    block_slot = np.zeros((seqs, m), dtype=np.int32)
    pools, pool_bytes = [], 0
    for i, codec in enumerate(codecs):
        mine = np.nonzero(at == i)[0]  # a level the mix leaves empty gets a one-slot pool
        slots = rng.permutation(len(mine)).astype(np.int32)
        block_slot.reshape(-1)[mine] = slots
        rows = torch.empty_like(kv[: max(len(mine), 1)])
        if len(mine):
            rows[torch.as_tensor(slots, dtype=torch.int64, device=device)] = kv[
                torch.as_tensor(mine, device=device)
            ]
        packed = rows if codec.name == model.dtype else codec.encode(rows).data.contiguous()
        pools.append(PoolView(packed, codec))
        pool_bytes += len(mine) * layer_bytes(codec, shape)
    seq_lens = np.full(seqs, context, dtype=np.int32)
    # the uncompressed cache SDPA reads: [seqs, m * B, ...] -> [seqs, H, tokens, D]
    blocks = kv.view(seqs, m, 2, H, B, D)
    k = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(seqs, H, m * B, D)[:, :, :context]
    v = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(seqs, H, m * B, D)[:, :, :context]
    q = torch.randn((seqs, 1, model.q_heads, D), generator=gen).to(dtype).to(device)
    return Work(
        q=q,
        out=torch.empty_like(q),
        mass=torch.empty((seqs, m), dtype=torch.float32, device=device),
        seq_lens=seq_lens,
        block_pool=block_pool,
        block_slot=block_slot,
        pools=pools,
        shape=shape,
        scale=D**-0.5,
        pool_bytes=pool_bytes,
        k=k.contiguous(),
        v=v.contiguous(),
    )


# ---- timing ---------------------------------------------------------------------------------------


def measure(
    model: Model, mix: str, context: int, seqs: int, backend: str, kernel: Kernel, repeats: int
) -> dict[str, Any]:
    device = "cuda" if backend == "cuda" else "cpu"
    timer = gpu_time if device == "cuda" else cpu_time
    w = build(model, mix, context, seqs, device)

    tables: list[Any] = [w.seq_lens, w.block_pool, w.block_slot]
    options: dict[str, Any] = {}
    if backend == "cuda":  # a decode loop keeps its block tables on the device
        tables = [torch.from_numpy(t).to(device) for t in tables]
        options["trusted"] = True

    def call() -> None:
        kernel(w.q, w.out, w.mass, *tables, w.pools, w.shape, 0, w.scale, **options)

    seconds = timer(call, repeats)
    src = torch.empty(w.pool_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = timer(lambda: dst.copy_(src), repeats)
    q = w.q.transpose(1, 2)  # [seqs, q_heads, 1, D]
    sdpa = timer(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q, w.k, w.v, scale=w.scale, enable_gqa=True
        ),
        repeats,
    )
    row: dict[str, Any] = {
        "model": model.name,
        "dtype": model.dtype,
        "mix": mix,
        "levels": levels(mix, model),
        "context": context,
        "seqs": seqs,
        "backend": backend,
        "us": seconds * 1e6,
        "us_samples": [t * 1e6 for t in seconds.samples],
        "pool_bytes": w.pool_bytes,
        "gb_per_s": w.pool_bytes / seconds / 1e9,
        "copy_us": copy * 1e6,
        "copy_us_samples": [t * 1e6 for t in copy.samples],
        # a copy reads and writes the bytes: its rate counts both
        "copy_gb_per_s": 2 * w.pool_bytes / copy / 1e9,
        "sdpa_us": sdpa * 1e6,
        "sdpa_us_samples": [t * 1e6 for t in sdpa.samples],
        "sdpa_cache_bytes": w.k.numel() * w.k.element_size() * 2,
        "speedup_vs_sdpa": sdpa / seconds,
    }
    if device == "cuda":
        row["pct_of_copy"] = 100 * row["gb_per_s"] / row["copy_gb_per_s"]
    return row


def _line(r: dict[str, Any]) -> str:
    pct = f" {r['pct_of_copy']:5.1f}% of copy" if "pct_of_copy" in r else ""
    return (
        f"{r['model']:13s} {r['mix']:7s} {r['context']:6d} x{r['seqs']} {r['backend']:9s} "
        f"{r['us']:10.1f} us {r['gb_per_s']:8.2f} GB/s (copy {r['copy_gb_per_s']:7.1f} GB/s){pct}"
        f"  sdpa {r['sdpa_us']:9.1f} us  x{r['speedup_vs_sdpa']:.2f} vs sdpa"
    )


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("attend", __doc__, f"SmolLM2 on the CPU, {QUICK_CONTEXTS[0]} tokens, one run")
    ap.add_argument(
        "--backend",
        choices=("auto", "cuda", "cpu", "reference"),
        default="auto",
        help="which kernel (auto: cuda on a GPU, else the CPU kernel, else the torch reference)",
    )
    ap.add_argument("--contexts", type=positive_int, nargs="+", help="tokens per sequence")
    ap.add_argument(
        "--seqs", type=positive_int, help="sequences per call (default: 4 on a GPU, 1 on CPU)"
    )
    ap.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES), help="level mixes")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed runs per figure")
    args = ap.parse_args(argv)
    log = (lambda *_: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    found = kernels()
    backend = default_backend(found) if args.backend == "auto" else args.backend
    if args.quick and args.backend == "auto":
        backend = "cpu" if "cpu" in found else "reference"
    if backend not in found:
        print(
            f"error: backend {backend!r} is not available here (have: {', '.join(found)})\n"
            "hint: cuda needs a GPU and CuPy; cpu needs a build of kvtier with attend_cpu",
            file=sys.stderr,
        )
        return 2
    gpu = backend == "cuda"
    model = LLAMA3_8B if gpu else SMOLLM2
    contexts = args.contexts or (
        QUICK_CONTEXTS if args.quick else GPU_CONTEXTS if gpu else CPU_CONTEXTS
    )
    seqs = args.seqs or (4 if gpu else 1)
    repeats = 1 if args.quick else (max(args.repeats, 20) if gpu else args.repeats)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    log(
        f"kvtier bench attend: {model.name} ({model.q_heads}/{model.kv_heads}/{model.head_dim}, "
        f"{model.dtype}, blocks of {model.block_size}) on {device}, backend {backend}, "
        f"torch {torch.__version__}"
    )
    if backend == "reference":
        log("note: the torch reference stands in for the CPU kernel (not in this build)")
    rows = []
    for context in contexts:
        for mix in args.mixes:
            r = measure(model, mix, context, seqs, backend, found[backend], repeats)
            rows.append(r)
            log(_line(r))
    result = {
        "device": device,
        "backend": backend,
        "model": model.__dict__,
        "cpu_threads": torch.get_num_threads(),
        "ladder_shares": LADDER_SHARES,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    save_if_asked(args, result, ap.prog, argv)
    return 0
