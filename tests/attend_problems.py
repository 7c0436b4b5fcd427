"""Random attention problems for the tests of the attention kernels against the reference of the
contract (kvtier.attend.reference): tests/test_attend.py runs them on the CPU kernel,
tests/test_attend_cuda.py on the CUDA kernel. One problem is pools of random blocks in each
codec's layout (encoded by the codec itself), block tables that skip some blocks and hold garbage
past each sequence's end, sequences of given (or random) odd lengths, and optionally a staging
pool of decoded blocks read at its own layer.

torch is imported where it is used: tests/test_attend_cuda.py's tests without a GPU import this
module too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.attend import PoolView
from kvtier.codecs import BlockShape, Codec, Int2Codec, Int4Codec, get_codec

#: torch's dtype of each float level (and of each query dtype)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name])


#: The codecs of fewer bits than a byte: the tests run int2 wherever they run int4.
PACKED = ("int4", "int2")


def packed(name: str, head_dim: int) -> str | Codec:
    """``name`` (``int4`` or ``int2``) at its default group of 32 channels where ``head_dim``
    allows it, else in groups of 16 (head_dim 80)."""
    if head_dim % 32 == 0:
        return name
    cls = {"int4": Int4Codec, "int2": Int2Codec}[name]
    return cls(group_size=16, name=f"{name}-g16")


def pool(
    codec: Codec,
    shape: BlockShape,
    slots: int,
    gen: Any,
    device: str = "cpu",
    layers: int | None = None,
) -> Any:
    """``slots`` random blocks of ``layers`` layers (the shape's by default) in ``codec``'s pool
    layout on ``device``: fp32 values drawn from ``gen`` (spread 2, a channel of outliers as
    real K has), kept as floats of the codec's dtype or encoded by the codec itself."""
    import torch

    dims = (slots, shape.layers if layers is None else layers, *shape.dims[1:])
    x = torch.randn(dims, generator=gen) * 2
    x[..., 3] *= 4  # a channel of larger keys and values, as real K has
    x = x.to(device)
    if codec.name in DTYPES:
        return x.to(dtype(codec.name))
    return codec.encode(x).data.contiguous()


def problem(
    *,
    codecs: Sequence[str | Codec],
    device: str = "cpu",
    q_dtype: str = "fp32",
    queries: int = 1,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    lengths: Sequence[int] | None = (100, 37),
    seqs: int = 2,
    skip: float = 0.15,
    staging: bool = False,
    slots: int = 24,
    layer: int = 1,
    seed: int = 0,
) -> tuple[Any, ...]:
    """A random call ``(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale)`` on
    ``device``: a pool of ``slots`` blocks of 2 layers per codec of ``codecs`` (a staging pool
    of one layer of decoded blocks after them with ``staging``), sequences of ``lengths`` tokens
    (``seqs`` random lengths in [queries, 300) when None) whose table entries point at a random
    pool and slot, a ``skip`` fraction skipped (-1) and garbage past each end. The model dtype
    is ``q_dtype``, fp16 for fp32 queries. Tables are numpy int32 on the host."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    shape = BlockShape(2, kv_heads, block_size, head_dim, "fp16" if q_dtype == "fp32" else q_dtype)
    pools = []
    for c in codecs:
        codec = c if isinstance(c, Codec) else get_codec(c)
        pools.append(PoolView(pool(codec, shape, slots, gen, device), codec))
    if staging:  # a one-layer pool of decoded blocks, read at its own layer
        codec = get_codec(shape.dtype)
        pools.append(PoolView(pool(codec, shape, slots, gen, device, 1), codec, layer_override=0))
    lens = np.asarray(
        lengths if lengths is not None else rng.integers(queries, 300, size=seqs), dtype=np.int32
    )
    seqs = len(lens)
    blocks = int(-(-lens.max() // block_size)) + 2  # table entries past every end
    block_pool = rng.integers(0, len(pools), size=(seqs, blocks)).astype(np.int32)
    block_pool[rng.random((seqs, blocks)) < skip] = -1
    block_slot = rng.integers(0, slots, size=(seqs, blocks)).astype(np.int32)
    for s, n in enumerate(lens):
        block_pool[s, -(-n // block_size) :] = 12345  # garbage past the end: ignored
        block_slot[s, -(-n // block_size) :] = -7
    q = torch.randn((seqs, queries, q_heads, head_dim), generator=gen)
    q = q.to(dtype(q_dtype)).to(device)
    return q, lens, block_pool, block_slot, pools, shape, layer, head_dim**-0.5


def assert_matches(
    out: Any, mass: Any, want: Any, want_mass: Any, *, tol: float, mass_tol: float
) -> None:
    """``out`` within ``tol`` absolute plus ``tol`` relative of the reference's, compared in fp32;
    ``mass`` (a tensor on any device) within ``mass_tol`` absolute of the reference's."""
    import torch

    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(mass.cpu(), want_mass, atol=mass_tol, rtol=0)
