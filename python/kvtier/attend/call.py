"""The attention call: what the three implementations of :mod:`kvtier.attend` take and
compute (the contract), the value that carries one call's inputs (:class:`AttentionCall`), its
checks, and the pool descriptors the kernels read. The bottom of the package: it imports no
backend.

The problem
-----------

``S`` sequences, ``Q`` new queries each, ``Hq`` query heads, ``Hkv`` K/V heads (``Hq`` a
multiple of ``Hkv``: query head ``h`` reads K/V head ``h // (Hq // Hkv)``, transformers'
``repeat_kv`` order), head size ``D``, blocks of ``B`` tokens.

- ``q``: ``[S, Q, Hq, D]`` contiguous, fp32, fp16 or bf16; ``out`` the same shape and dtype.
- ``seq_lens``: int32 ``[S]``, the tokens each sequence holds, its ``Q`` new ones included
  (already appended). Query ``i`` sits at position ``seq_lens[s] - Q + i`` and sees every key at
  or before it (causal; with ``Q = 1``, the whole sequence).
- ``block_pool`` / ``block_slot``: int32 ``[S, M]``: where block ``j`` of sequence ``s`` lies, as
  an index into ``pools`` and a slot of that pool. Pool ``-1`` marks a block attention skips (a
  dropped block): its keys are masked out. Entries past a sequence's last block are ignored.
- ``mass``: fp32 ``[S, M]`` out: the attention probability each block received, averaged over the
  ``Hq * Q`` (head, query) pairs, so each sequence's masses sum to 1 (0 for skipped blocks and
  entries past the end). This is the H2O-style signal ``record_attention`` takes.
- ``scale``: the softmax scale (usually ``D ** -0.5``); scores ``q . k * scale`` in fp32, a
  numerically stable softmax (a running max), fp32 accumulation; a query that sees no key at all
  (every visible block skipped) gets an output of zeros.

Pools, as the kernels read them: one row per slot, described by :data:`DESC_FIELDS` int64s.

- float (``kind`` 0): ``[slots, layers, 2, Hkv, B, D]`` in ``dtype`` (0 fp32, 1 fp16, 2 bf16),
  K then V, the level-0 pool (and a staging pool of decoded blocks, ``layers`` 1);
- quant (``kind`` 1): ``uint8 [slots, row_bytes]``, the sections of
  :class:`kvtier.codecs.QuantCodec` at byte offsets within the row (documented with the codec
  and in kernels/kvtier_codecs.cu): codes ``[layers, 2, Hkv, B, D * bits / 8]`` of 8, 4 or 2
  bits (4-bit: even ``d`` in the low nibble; 2-bit: ``d = 4i + j`` at bits ``2j, 2j + 1`` of byte
  ``i``; two's complement when symmetric, unsigned when asymmetric),
  ``k_scale`` fp16 ``[layers, Hkv, Gk]`` (``Gk = D`` per channel: one group per channel along the
  block's tokens; else ``B * D / group`` per token), ``k_zero`` (asymmetric only), ``v_scale``
  ``[layers, Hkv, B * D / group]``, ``v_zero``. A value decodes as ``q * s (+ z)`` in fp32. A
  rotated codec's (``flags`` bit 2) decodes so in the rotated basis, then turns back
  (:mod:`kvtier.codecs.quant`): the kernels take the rotation's signs
  (:func:`kvtier.codecs.rotation.hadamard_signs`, :func:`rotation_of`); the CPU one rotates the
  queries and turns the output back rather than each block, the CUDA one turns each tile back
  in shared memory.

``layer`` picks the layer; a pool whose ``layer_override`` is not -1 is read at that layer instead
(a staging pool holds one layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._torch import all_finite, dtype_name, torch_module
from ..codecs.base import BlockShape, Codec
from ..codecs.identity import IdentityCodec
from ..codecs.quant import QuantCodec
from ..codecs.rotation import hadamard_signs
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

#: The int64s that describe one pool to the kernels, in order.
DESC_FIELDS = (
    "kind",  # 0 float, 1 quant
    "dtype_or_bits",  # float: 0 fp32, 1 fp16, 2 bf16; quant: 2, 4 or 8
    "flags",  # quant: bit 0 asymmetric, bit 1 keys per channel, bit 2 rotated
    "ptr",  # address of slot 0
    "slots",
    "row_bytes",  # bytes from one slot to the next
    "layers",  # layers in a row
    "layer_override",  # -1: the call's layer; else this layer
    "group",  # quant: values per group along D
    "codes",  # quant: byte offsets of the sections within a row (-1 when absent)
    "k_scale",
    "k_zero",
    "v_scale",
    "v_zero",
    "reserved0",
    "reserved1",
)
FLOAT, QUANT = 0, 1
ASYMMETRIC, KEY_PER_CHANNEL, ROTATED = 1, 2, 4
FLOAT_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}


def readable(codec: Codec) -> bool:
    """Whether the kernels read this codec's blocks where they lie (else they are decoded to a
    staging pool first). Rotated codecs are: the CPU kernel rotates the queries and turns the
    output back, the CUDA kernel turns each tile back in shared memory."""
    if isinstance(codec, IdentityCodec):
        return True
    return isinstance(codec, QuantCodec) and codec.bits in (2, 4, 8)


@dataclass(frozen=True)
class PoolView:
    """One pool the kernels read: its tensor and the codec of its rows."""

    tensor: torch.Tensor
    codec: Codec
    #: read at this layer whatever the call's (a staging pool holds one layer)
    layer_override: int = -1

    def describe(self, shape: BlockShape) -> np.ndarray:
        """The pool's :data:`DESC_FIELDS` int64s (``shape`` is the manager's block shape; a
        staging pool's ``layers`` comes from its tensor)."""
        t, codec = self.tensor, self.codec
        d = dict.fromkeys(DESC_FIELDS, 0)
        d["ptr"], d["slots"], d["layer_override"] = t.data_ptr(), t.shape[0], self.layer_override
        d["row_bytes"] = t.stride(0) * t.element_size()
        if isinstance(codec, IdentityCodec):
            d["kind"], d["dtype_or_bits"] = FLOAT, FLOAT_CODES[codec.dtype]
            d["layers"] = t.shape[1]
            d["codes"] = d["k_scale"] = d["k_zero"] = d["v_scale"] = d["v_zero"] = -1
        elif isinstance(codec, QuantCodec):
            off = codec.offsets(shape)
            d["kind"], d["dtype_or_bits"], d["layers"] = QUANT, codec.bits, shape.layers
            d["flags"] = (
                ASYMMETRIC * codec.asymmetric
                + KEY_PER_CHANNEL * codec.key_per_channel
                + ROTATED * codec.rotate
            )
            d["group"] = codec.group(shape)
            for name in ("codes", "k_scale", "k_zero", "v_scale", "v_zero"):
                d[name] = off.get(name, -1)
        else:
            raise InvalidArgumentError(
                f"codec {codec.name!r}: the attention kernels cannot read it"
            )
        return np.array([d[f] for f in DESC_FIELDS], dtype=np.int64)


@dataclass(frozen=True)
class Problem:
    """One attention call's sizes."""

    seqs: int
    queries: int
    q_heads: int
    kv_heads: int
    block_size: int
    head_dim: int
    max_blocks: int
    layer: int
    scale: float


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention call's inputs, as the reference and the kernels take them: the queries,
    where each sequence's blocks lie, the pools that hold them, the layer and the softmax scale
    (the module's docstring says what each holds). What a call writes, ``out`` and ``mass``, is
    not in it. :meth:`check` says whether the kernels may follow it and gives its sizes."""

    #: ``[S, Q, Hq, D]`` fp32, fp16 or bf16
    q: torch.Tensor
    #: int32 ``[S]``: numpy (the CUDA kernel takes an int32 tensor on q's device too)
    seq_lens: Any
    #: int32 ``[S, M]``: the pool (an index into ``pools``, -1 skipped) of each block
    block_pool: Any
    #: int32 ``[S, M]``: the slot of each block in its pool
    block_slot: Any
    pools: Sequence[PoolView]
    shape: BlockShape
    layer: int
    scale: float

    def check(self) -> Problem:
        """The call's sizes, after checking that every index the kernels will follow is in
        range (they trust these arrays, here numpy), that ``q`` is finite and ``scale`` too."""
        q, pools, shape, scale = self.q, self.pools, self.shape, self.scale
        seq_lens, block_pool, block_slot = self.seq_lens, self.block_pool, self.block_slot
        torch = torch_module()
        if q.dim() != 4 or q.shape[3] != shape.head_dim:
            raise InvalidArgumentError(
                f"q: expected [seqs, queries, heads, {shape.head_dim}], got {list(q.shape)}"
            )
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidArgumentError(f"q: expected float32, float16 or bfloat16, got {q.dtype}")
        S, Q, Hq, D = q.shape
        if Hq % shape.kv_heads:
            raise InvalidArgumentError(
                f"q: {Hq} query heads is not a multiple of {shape.kv_heads} K/V heads"
            )
        if (
            seq_lens.shape != (S,)
            or block_pool.shape != block_slot.shape
            or block_pool.shape[0] != S
        ):
            raise InvalidArgumentError(
                "seq_lens, block_pool, block_slot: expected [S], [S, M], [S, M]"
            )
        M = block_pool.shape[1]
        B = shape.block_size
        if S and (int(seq_lens.min()) < Q or int(seq_lens.max()) > M * B):
            raise InvalidArgumentError(
                f"seq_lens: expected each in [{Q} queries, {M * B} tokens of the block table], "
                f"got {seq_lens.tolist()}"
            )
        used = np.arange(M)[None, :] * B < seq_lens[:, None]
        pool_ids, slot_ids = block_pool[used], block_slot[used]
        if len(pool_ids):
            if int(pool_ids.min()) < -1 or int(pool_ids.max()) >= len(pools):
                raise InvalidArgumentError(f"block_pool: expected -1 to {len(pools) - 1}")
            for i, p in enumerate(pools):
                mine = slot_ids[pool_ids == i]
                if len(mine) and (int(mine.min()) < 0 or int(mine.max()) >= p.tensor.shape[0]):
                    raise InvalidArgumentError(f"block_slot: a slot out of range of pool {i}")
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"scale: expected a finite number, got {scale}")
        if not all_finite(q):  # else a row of zeros that looks like an answer
            raise InvalidArgumentError("q: expected finite values, got NaN or inf")
        return Problem(S, Q, Hq, shape.kv_heads, B, D, M, self.layer, float(scale))


def check_problem(
    q: torch.Tensor,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    pools: Sequence[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
) -> Problem:
    """The call's sizes, after checking that every index the kernels will follow is in range
    (they trust these arrays): :meth:`AttentionCall.check` of these arguments."""
    return AttentionCall(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale).check()


class _DtypeCodes(dict[Any, int]):
    """torch dtype -> the kernels' float code, filled on first use (torch imports lazily)."""

    def __missing__(self, dtype: Any) -> int:
        code = FLOAT_CODES[dtype_name(dtype)]
        self[dtype] = code
        return code


#: torch dtype -> the kernels' float code (:data:`FLOAT_CODES`), a dict lookup a call
DTYPE_CODES: dict[Any, int] = _DtypeCodes()


def rotation_of(views: Sequence[PoolView], head_dim: int) -> np.ndarray | None:
    """The rotation signs the CPU kernel takes for ``views`` (``rotation``): those of
    :func:`~kvtier.codecs.rotation.hadamard_signs` when a pool is rotated, else None."""
    if any(isinstance(v.codec, QuantCodec) and v.codec.rotate for v in views):
        return hadamard_signs(head_dim)
    return None


def describe(views: Sequence[PoolView], shape: BlockShape) -> np.ndarray:
    """The descriptors of ``views``, int64 ``[len(views), len(DESC_FIELDS)]``."""
    rows = [v.describe(shape) for v in views]
    return np.stack(rows) if rows else np.zeros((0, len(DESC_FIELDS)), dtype=np.int64)
