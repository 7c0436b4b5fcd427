"""The CPU attention kernel: Rust (``crates/kvtier-attend``), called through
``kvtier._core.attend`` on the pools' addresses. It computes what :func:`kvtier.attend.reference`
computes; this module checks what the kernel trusts about the memory behind the addresses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from .._torch import dtype_name, torch_dtype, torch_module
from ..codecs.base import BlockShape
from ..codecs.identity import IdentityCodec
from ..codecs.quant import QuantCodec
from ..errors import InvalidArgumentError
from .call import FLOAT_CODES, AttentionCall, PoolView, Problem, describe, rotation_of

if TYPE_CHECKING:
    import torch


def _int32_table(a: Any, name: str) -> np.ndarray:
    """``a`` as a C-contiguous int32 array (the kernel's index type), refusing values that do
    not fit."""
    arr = np.asarray(a)
    if arr.dtype == np.int32 and arr.flags.c_contiguous:
        return arr
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name}: expected integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        raise InvalidArgumentError(f"{name}: a value does not fit int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def check_tensors(call: AttentionCall, out: torch.Tensor, mass: Any, p: Problem) -> None:
    """What the Rust kernel trusts about the memory behind its addresses (``p``: the sizes
    :meth:`AttentionCall.check` gave)."""
    torch = torch_module()
    q, shape = call.q, call.shape
    if q.device.type != "cpu" or not q.is_contiguous():
        raise InvalidArgumentError(f"q: expected a contiguous CPU tensor, got {q.device}")
    if (
        not isinstance(out, torch.Tensor)
        or out.device.type != "cpu"
        or out.dtype != q.dtype
        or out.shape != q.shape
        or not out.is_contiguous()
    ):
        raise InvalidArgumentError(
            f"out: expected a contiguous CPU tensor {list(q.shape)} of {q.dtype}"
        )
    want = (p.seqs, p.max_blocks)
    if isinstance(mass, torch.Tensor):
        ok = mass.device.type == "cpu" and mass.dtype == torch.float32 and mass.is_contiguous()
        got = tuple(mass.shape)
    else:
        ok = isinstance(mass, np.ndarray) and mass.dtype == np.float32
        ok = ok and mass.flags.c_contiguous and mass.flags.writeable
        got = tuple(np.shape(mass))
    if not ok or got != want:
        raise InvalidArgumentError(
            f"mass: expected a contiguous float32 CPU tensor or numpy array {list(want)}"
        )
    for i, view in enumerate(call.pools):
        t = view.tensor
        rows = t.shape[1:]
        inner = [math.prod(rows[k + 1 :]) for k in range(len(rows))]
        if t.device.type != "cpu" or list(t.stride()[1:]) != inner:
            raise InvalidArgumentError(
                f"pools[{i}]: expected a CPU tensor whose rows are contiguous, got "
                f"{t.device} with strides {t.stride()}"
            )
        codec = view.codec
        if isinstance(codec, IdentityCodec):
            layout = (2, shape.kv_heads, shape.block_size, shape.head_dim)
            if t.dim() != 6 or tuple(t.shape[2:]) != layout or t.dtype != torch_dtype(codec.dtype):
                raise InvalidArgumentError(
                    f"pools[{i}]: expected [slots, layers, {', '.join(map(str, layout))}] of "
                    f"{codec.dtype}, got {list(t.shape)} of {t.dtype}"
                )
        elif isinstance(codec, QuantCodec):
            need = codec.bytes_per_block(shape)
            if t.dim() != 2 or t.dtype != torch.uint8 or t.shape[1] != need:
                raise InvalidArgumentError(
                    f"pools[{i}]: expected uint8 [slots, {need}] rows of {codec.name}, got "
                    f"{list(t.shape)} of {t.dtype}"
                )


def attend_cpu(
    q: torch.Tensor,
    out: torch.Tensor,
    mass: Any,
    seq_lens: Any,
    block_pool: Any,
    block_slot: Any,
    pools: Sequence[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
    threads: int = 0,
    *,
    checked: bool = True,
) -> None:
    """Writes ``out`` (``q``'s shape and dtype) and ``mass`` (fp32 ``[S, M]``: a CPU tensor or a
    numpy array) as :func:`~kvtier.attend.reference` computes them, with the Rust kernel on the
    CPU (``kvtier._core.attend``; AVX2 where the CPU has it, the calling thread for small calls,
    else rayon's pool; ``threads`` 1 keeps it on the calling thread, n asks for a pool of n).

    ``checked=False`` skips the checks here (:meth:`AttentionCall.check`, the tensors' device,
    dtype, shape and row layout) for a caller that made them already, and takes the tables as
    C-contiguous int32 numpy arrays as they are. The kernel still checks every block's pool
    and slot against the pools' extents; it trusts that the tensors are what they say."""
    if checked:
        seq_lens = _int32_table(seq_lens, "seq_lens")
        block_pool = _int32_table(block_pool, "block_pool")
        block_slot = _int32_table(block_slot, "block_slot")
        if seq_lens.ndim == 1:  # flat tables, [S * M], as [S, M]
            n = len(seq_lens)
            block_pool, block_slot = (
                t.reshape(n, t.size // n if n else 0)
                if t.ndim == 1 and t.size % max(n, 1) == 0
                else t
                for t in (block_pool, block_slot)
            )
        call = AttentionCall(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale)
        check_tensors(call, out, mass, call.check())
    # Unchecked, nothing is built: the kernel gets the arrays it was given.
    S, Q, Hq, D = q.shape
    M = block_pool.shape[1] if block_pool.ndim == 2 else block_pool.size // max(S, 1)
    mass_at = mass.data_ptr() if hasattr(mass, "data_ptr") else mass  # numpy: as it is
    # q, out, mass and the pools' tensors stay referenced here until the kernel returns
    _core.attend(
        q.data_ptr(),
        FLOAT_CODES[dtype_name(q.dtype)],
        out.data_ptr(),
        mass_at,
        seq_lens,
        block_pool,
        block_slot,
        describe(pools, shape),
        S,
        Q,
        Hq,
        shape.kv_heads,
        shape.block_size,
        D,
        M,
        layer,
        float(scale),
        threads,
        rotation=rotation_of(pools, D),
    )
