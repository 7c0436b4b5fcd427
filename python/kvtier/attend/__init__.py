"""Attention straight over stored blocks: no gather, no full-precision copy of the cache.

``BlockManager.attend`` computes the attention output of the newest queries of one or many
sequences at one layer by walking each sequence's blocks where they lie, through
:func:`run_attention` (here), which picks one of three implementations of one contract:

- :mod:`.call` — the contract (what a call's arguments hold, the pool descriptors the kernels
  read), :class:`AttentionCall`, the value that carries one call's inputs, and its checks;
- :mod:`.torch_ref` — :func:`reference`: every block dequantized to fp32, softmax in fp32
  (torch, any device), the oracle both kernels must match;
- :mod:`.cpu` — :func:`attend_cpu`: the Rust kernel (``crates/kvtier-attend``, called through
  ``kvtier._core.attend``);
- :mod:`.cuda` — :func:`attend_cuda`: ``kernels/kvtier_attend.cu`` through CuPy, and its launch
  plan.

Each backend imports :mod:`.call` and nothing above it; this module, the dispatcher, imports
them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import _core
from .._torch import cupy_available, torch_module
from ..codecs.base import BlockShape
from . import cuda, torch_ref
from .call import (
    ASYMMETRIC,
    DESC_FIELDS,
    DTYPE_CODES,
    FLOAT,
    FLOAT_CODES,
    KEY_PER_CHANNEL,
    QUANT,
    ROTATED,
    AttentionCall,
    PoolView,
    Problem,
    check_problem,
    describe,
    readable,
    rotation_of,
)
from .cpu import attend_cpu
from .cuda import attend_cuda
from .torch_ref import reference

if TYPE_CHECKING:
    import torch

__all__ = [
    "ASYMMETRIC",
    "DESC_FIELDS",
    "FLOAT",
    "FLOAT_CODES",
    "KEY_PER_CHANNEL",
    "QUANT",
    "ROTATED",
    "AttentionCall",
    "PoolView",
    "Problem",
    "attend_cpu",
    "attend_cuda",
    "check_problem",
    "describe",
    "readable",
    "reference",
    "rotation_of",
    "run_attention",
]


def run_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    mass: np.ndarray,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    views: Sequence[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
    desc: np.ndarray | None = None,
    rotation: np.ndarray | None = None,
) -> None:
    """Fills ``out`` (like ``q``) and ``mass`` (numpy fp32 ``[S, M]``) with the fastest kernel
    for ``q``'s device: the Rust kernel on the CPU, the CUDA kernel on a GPU with CuPy, else the
    reference. The caller has checked the arguments (:meth:`AttentionCall.check` says what
    holds) but for ``q``'s values, which the kernels check are finite; ``q`` and ``out`` are
    contiguous, ``[S, Q, Hq, D]`` or, for one sequence, ``[Q, Hq, D]``. ``desc`` and
    ``rotation``: :func:`describe` and :func:`rotation_of` of ``views``, for a caller that keeps
    them (given ``desc``, ``rotation`` is taken as given; else both are worked out here).

    The manager calls this once per layer per decode step: on the CPU it goes straight to the
    kernel with the arrays it was given (no :class:`AttentionCall` is built, nothing checked)."""
    torch = torch_module()
    if q.dim() == 3:
        q, out = q[None], out[None]
    if q.is_cpu:
        S, Q, Hq, D = q.shape
        if desc is None:
            desc, rotation = describe(views, shape), rotation_of(views, D)
        # The kernel trusts these: contiguous int32 and int64, alive for the call.
        _core.attend(
            q.data_ptr(),
            DTYPE_CODES[q.dtype],
            out.data_ptr(),
            mass,
            seq_lens,
            block_pool,
            block_slot,
            desc,
            S,
            Q,
            Hq,
            shape.kv_heads,
            shape.block_size,
            D,
            block_pool.shape[1],
            layer,
            scale,
            0,
            rotation=rotation,
        )
        return
    call = AttentionCall(q, seq_lens, block_pool, block_slot, views, shape, layer, scale)
    if q.device.type == "cuda" and cupy_available():
        on_device = torch.empty(mass.shape, dtype=torch.float32, device=q.device)
        cuda.run(call, out, on_device)
        mass[...] = on_device.cpu().numpy()
        return
    got, got_mass = torch_ref.run(call)
    out.copy_(got)
    mass[...] = got_mass.numpy()
