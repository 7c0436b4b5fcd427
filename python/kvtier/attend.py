"""Attention straight over stored blocks: no gather, no full-precision copy of the cache.

``BlockManager.attend`` computes the attention output of the newest queries of one or many
sequences at one layer by walking each sequence's blocks where they lie. This module is the
contract the three implementations share, and the torch reference both kernels must match:

- the CPU kernel, Rust (``crates/kvtier-attend``, called through ``kvtier._core.attend``);
- the CUDA kernel (``kernels/kvtier_attend.cu`` through CuPy, :mod:`kvtier.attend_cuda`);
- :func:`reference`: dequantize every block to fp32, softmax in fp32 (torch, any device).

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
  ``[layers, Hkv, B * D / group]``, ``v_zero``. A value decodes as ``q * s (+ z)`` in fp32.

``layer`` picks the layer; a pool whose ``layer_override`` is not -1 is read at that layer instead
(a staging pool holds one layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from .codecs.base import (
    BlockShape,
    Codec,
    _cupy_available,
    all_finite,
    dtype_name,
    torch_module,
)
from .codecs.identity import IdentityCodec
from .codecs.quant import QuantCodec
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

#: The int64s that describe one pool to the kernels, in order.
DESC_FIELDS = (
    "kind",  # 0 float, 1 quant
    "dtype_or_bits",  # float: 0 fp32, 1 fp16, 2 bf16; quant: 2, 4 or 8
    "flags",  # quant: bit 0 asymmetric, bit 1 keys per channel
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
ASYMMETRIC, KEY_PER_CHANNEL = 1, 2
FLOAT_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}


def readable(codec: Codec) -> bool:
    """Whether the kernels read this codec's blocks where they lie (else they are decoded to a
    staging pool first)."""
    if isinstance(codec, IdentityCodec):
        return True
    return isinstance(codec, QuantCodec) and codec.bits in (2, 4, 8) and not codec.rotate


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
            d["flags"] = ASYMMETRIC * codec.asymmetric + KEY_PER_CHANNEL * codec.key_per_channel
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


def check_problem(
    q: torch.Tensor,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    pools: list[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
) -> Problem:
    """The call's sizes, after checking that every index the kernels will follow is in range
    (they trust these arrays)."""
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
    if seq_lens.shape != (S,) or block_pool.shape != block_slot.shape or block_pool.shape[0] != S:
        raise InvalidArgumentError("seq_lens, block_pool, block_slot: expected [S], [S, M], [S, M]")
    M = block_pool.shape[1]
    B = shape.block_size
    if S and (int(seq_lens.min()) < Q or int(seq_lens.max()) > M * B):
        raise InvalidArgumentError(
            f"seq_lens: expected each in [{Q} queries, {M * B} tokens of the block table], got "
            f"{seq_lens.tolist()}"
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
    return Problem(S, Q, Hq, shape.kv_heads, B, D, M, layer, float(scale))


class _DtypeCodes(dict[Any, int]):
    """torch dtype -> the kernels' float code, filled on first use (torch imports lazily)."""

    def __missing__(self, dtype: Any) -> int:
        code = FLOAT_CODES[dtype_name(dtype)]
        self[dtype] = code
        return code


_DTYPE_CODES = _DtypeCodes()


def describe(views: list[PoolView], shape: BlockShape) -> np.ndarray:
    """The descriptors of ``views``, int64 ``[len(views), len(DESC_FIELDS)]``."""
    rows = [v.describe(shape) for v in views]
    return np.stack(rows) if rows else np.zeros((0, len(DESC_FIELDS)), dtype=np.int64)


def run_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    mass: np.ndarray,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    views: list[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
    desc: np.ndarray | None = None,
) -> None:
    """Fills ``out`` (like ``q``) and ``mass`` (numpy fp32 ``[S, M]``) with the fastest kernel
    for ``q``'s device: the Rust kernel on the CPU, the CUDA kernel on a GPU with CuPy, else the
    reference. The caller has checked the arguments (:func:`check_problem` says what holds);
    ``q`` and ``out`` are contiguous, ``[S, Q, Hq, D]`` or, for one sequence, ``[Q, Hq, D]``;
    ``desc``: :func:`describe` of ``views``, when the caller keeps it."""
    torch = torch_module()
    if q.dim() == 3:
        q, out = q[None], out[None]
    if q.is_cpu:
        d = describe(views, shape) if desc is None else desc
        S, Q, Hq, D = q.shape
        # The kernel trusts these: contiguous int32 and int64, alive for the call.
        _core.attend(
            q.data_ptr(),
            _DTYPE_CODES[q.dtype],
            out.data_ptr(),
            mass.ctypes.data,
            seq_lens,
            block_pool,
            block_slot,
            d,
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
        )
        return
    if q.device.type == "cuda" and _cupy_available():
        from .attend_cuda import attend_cuda

        on_device = torch.empty(mass.shape, dtype=torch.float32, device=q.device)
        attend_cuda(q, out, on_device, seq_lens, block_pool, block_slot, views, shape, layer, scale)
        mass[...] = on_device.cpu().numpy()
        return
    got, got_mass = reference(q, seq_lens, block_pool, block_slot, views, shape, layer, scale)
    out.copy_(got)
    mass[...] = got_mass.numpy()


def _block_values(pool: PoolView, shape: BlockShape, layer: int, slots: Any) -> torch.Tensor:
    """``[n, 2, Hkv, B, D]`` fp32 of one layer of ``slots`` of ``pool``."""
    torch = torch_module()
    at = layer if pool.layer_override < 0 else pool.layer_override
    idx = torch.as_tensor(slots, dtype=torch.int64, device=pool.tensor.device)
    if isinstance(pool.codec, IdentityCodec):
        return pool.tensor[:, at].index_select(0, idx).float()
    return pool.codec.decode_layer(pool.tensor, shape, at, slots=idx, dtype=torch.float32)


def reference(
    q: torch.Tensor,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    pools: list[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, mass)`` by the plain method: every block decoded to fp32, then softmax in fp32.
    ``out`` is in ``q``'s dtype on its device, ``mass`` fp32 ``[S, M]`` on the CPU."""
    torch = torch_module()
    p = check_problem(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale)
    S, Q, Hq, D, B, M = p.seqs, p.queries, p.q_heads, p.head_dim, p.block_size, p.max_blocks
    group = Hq // p.kv_heads
    out = torch.zeros((S, Q, Hq, D), dtype=q.dtype, device=q.device)
    mass = torch.zeros((S, M), dtype=torch.float32)
    for s in range(S):
        n = int(seq_lens[s])
        m = -(-n // B)
        kv = torch.zeros((m, 2, p.kv_heads, B, D), dtype=torch.float32, device=q.device)
        keep = torch.ones(m * B, dtype=torch.bool, device=q.device)
        for i, pool in enumerate(pools):
            rows = np.nonzero(block_pool[s, :m] == i)[0]
            if len(rows):
                values = _block_values(pool, shape, layer, block_slot[s, rows])
                kv[torch.as_tensor(rows, device=q.device)] = values.to(q.device)
        for j in np.nonzero(block_pool[s, :m] == -1)[0]:
            keep[j * B : (j + 1) * B] = False
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(p.kv_heads, m * B, D)[:, :n]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(p.kv_heads, m * B, D)[:, :n]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        scores = torch.einsum("qhd,hnd->hqn", q[s].float(), k) * scale
        pos = torch.arange(n, device=q.device)
        visible = (pos[None, :] <= (n - Q + torch.arange(Q, device=q.device))[:, None]) & keep[
            None, :n
        ]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a query that sees nothing: zeros
        out[s] = torch.einsum("hqn,hnd->qhd", probs, v).to(q.dtype)
        per_token = probs.mean((0, 1)).cpu()
        padded = torch.zeros(m * B)
        padded[:n] = per_token
        mass[s, :m] = padded.view(m, B).sum(1)
    return out, mass


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


def _check_cpu_tensors(
    q: torch.Tensor,
    out: torch.Tensor,
    mass: Any,
    pools: list[PoolView],
    shape: BlockShape,
    p: Problem,
) -> None:
    """What the Rust kernel trusts about the memory behind its addresses."""
    from .codecs.base import torch_dtype

    torch = torch_module()
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
    for i, view in enumerate(pools):
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
    pools: list[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
    threads: int = 0,
    *,
    checked: bool = True,
) -> None:
    """Writes ``out`` (``q``'s shape and dtype) and ``mass`` (fp32 ``[S, M]``: a CPU tensor or a
    numpy array) as :func:`reference` computes them, with the Rust kernel on the CPU
    (``kvtier._core.attend``; AVX2 where the CPU has it, the calling thread for small calls, else
    rayon's pool; ``threads`` 1 keeps it on the calling thread, n asks for a pool of n).

    ``checked=False`` skips the checks here (:func:`check_problem`, the tensors' device, dtype,
    shape and row layout) for a caller that made them already, and takes the tables as
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
        p = check_problem(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale)
        _check_cpu_tensors(q, out, mass, pools, shape, p)
    S, Q, Hq, D = q.shape
    M = block_pool.shape[1] if block_pool.ndim == 2 else block_pool.size // max(S, 1)
    mass_ptr = mass.data_ptr() if hasattr(mass, "data_ptr") else mass.ctypes.data
    # q, out, mass and the pools' tensors stay referenced here until the kernel returns
    _core.attend(
        q.data_ptr(),
        FLOAT_CODES[dtype_name(q.dtype)],
        out.data_ptr(),
        mass_ptr,
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
    )
