"""CUDA attention over stored blocks: kernels/kvtier_attend.cu through CuPy.

:func:`attend_cuda` computes what :func:`kvtier.attend.reference` computes (the contract is in
:mod:`kvtier.attend.call`), reading every block where it lies: float pools as they are, int8, int4
and int2 pools dequantized a tile at a time in shared memory. Two launches per call, on the
caller's current torch stream: the attention itself (one CTA per sequence, K/V head, split of
the block table and tile of up to 16 (query, head) rows, so a head's K/V bytes are read once for
its whole GQA group), then a small combine that merges the splits (flash-decoding) and sums each
block's attention mass. The kernel file says why the mass needs the second launch.

:func:`plan` picks the launch shape from the problem's sizes alone (no device values), so a
steady decode loop neither synchronises nor uploads anything but its block tables; the pool
descriptors are uploaded once per distinct set and kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _cuda
from .._torch import torch_dtype, torch_module
from ..codecs.base import BlockShape
from ..codecs.identity import IdentityCodec
from ..codecs.quant import QuantCodec
from ..errors import InvalidArgumentError
from .call import AttentionCall, PoolView, Problem, readable, rotation_of

if TYPE_CHECKING:
    import torch

KERNEL_FILE = "kvtier_attend.cu"
#: The kernel file's constants (kernels/kvtier_attend.cu): keep them equal.
ATTEND_THREADS = 128
COMBINE_THREADS = 256
MAX_ROWS = 16
MAX_TILE_BLOCKS = 8
MASS_BLOCKS = 32
#: Values of K (and of V) one tile holds: T tokens x D, so a tile is 32 KiB of fp32 K and V.
TILE_VALUES = 4096
#: A split reads at least this many tokens (fewer would spend more on the combine than it saves).
MIN_SPLIT_TOKENS = 256
#: Split the block table only while the rows of a K/V head are few (decode, short prefills):
#: past this, the rows alone fill the GPU.
MAX_SPLIT_ROWS = 64
MAX_HEAD_DIM = 256
_DEFAULT_SMEM = _cuda.DEFAULT_SHARED_BYTES
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrMultiProcessorCount
_ATTR_SMEM_OPTIN, _ATTR_SMS = 97, 16
#: Static shared memory of the main kernel (BlockRef[8] and three row arrays), kept free.
_STATIC_SMEM = 1024


def kernel_source() -> str:
    """What NVRTC compiles: kernels/kvtier_common.cuh, then kernels/kvtier_attend.cu (the copies
    the extension ships, else the repository's: :func:`kvtier._cuda.kernel_source`)."""
    return _cuda.kernel_source(KERNEL_FILE)


@functools.cache
def _device_limits(device: int) -> tuple[int, int]:
    """(streaming multiprocessors, most dynamic shared memory a CTA may opt in to)."""
    runtime = _cuda.cupy().cuda.runtime
    sms = int(runtime.deviceGetAttribute(_ATTR_SMS, device))
    optin = int(runtime.deviceGetAttribute(_ATTR_SMEM_OPTIN, device))
    return sms, max(optin - _STATIC_SMEM, _DEFAULT_SMEM - _STATIC_SMEM)


@dataclass(frozen=True)
class LaunchPlan:
    """The launch shape of one call (sizes only: no device value goes into it)."""

    #: (query, head) rows of one CTA, and the CTAs that cover a K/V head's G * Q rows
    rows_per_cta: int
    row_tiles: int
    #: tokens of K/V one CTA holds at a time (a multiple of the block size)
    tile_tokens: int
    #: blocks of the block table one split reads, and the splits
    blocks_per_split: int
    splits: int
    #: dynamic shared memory of the main kernel, bytes
    shared_bytes: int
    #: combine CTAs per sequence that sum masses, and that merge splits (0 with one split)
    mass_ctas: int
    out_ctas: int


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def shared_bytes(rows: int, tile_tokens: int, head_dim: int) -> int:
    """The main kernel's dynamic shared memory: q and acc [rows, D], K [T, D + 1], V [T, D],
    p [rows, T], in fp32."""
    return 4 * (2 * rows * head_dim + tile_tokens * (2 * head_dim + 1) + rows * tile_tokens)


def plan(p: Problem, sms: int, max_shared: int = 227 * 1024 - _STATIC_SMEM) -> LaunchPlan:
    """How :func:`attend_cuda` launches ``p`` on a GPU with ``sms`` multiprocessors."""
    B, D, M = p.block_size, p.head_dim, p.max_blocks
    R = p.q_heads // p.kv_heads * p.queries
    rows = min(MAX_ROWS, R)
    nb = max(1, min(MAX_TILE_BLOCKS, TILE_VALUES // D // B))
    while shared_bytes(rows, nb * B, D) > max_shared and (rows > 1 or nb > 1):
        if nb > 1:
            nb //= 2
        else:
            rows //= 2
    T = nb * B
    row_tiles = _ceil(R, rows)
    ctas = p.seqs * p.kv_heads * row_tiles
    least = nb * _ceil(_ceil(MIN_SPLIT_TOKENS, B), nb)  # blocks, a whole number of tiles
    if R > MAX_SPLIT_ROWS or ctas >= 2 * sms or least >= M:
        bps = max(M, 1)  # one split: the CTAs already fill the GPU twice over
    else:
        bps = nb * _ceil(max(least, _ceil(M, _ceil(2 * sms, ctas))), nb)
    splits = max(1, _ceil(M, bps))
    return LaunchPlan(
        rows_per_cta=rows,
        row_tiles=row_tiles,
        tile_tokens=T,
        blocks_per_split=bps,
        splits=splits,
        shared_bytes=shared_bytes(rows, T, D),
        mass_ctas=_ceil(M, MASS_BLOCKS),
        out_ctas=_ceil(p.q_heads * p.queries, COMBINE_THREADS // 32) if splits > 1 else 0,
    )


def check_shapes(call: AttentionCall) -> None:
    """What the kernel needs beyond :meth:`AttentionCall.check`: sizes it was written for, pools
    on q's device laid out as :mod:`kvtier.attend.call` says, the layer in every pool."""
    torch = torch_module()
    q, pools, shape, layer = call.q, call.pools, call.shape, call.layer
    D, B = shape.head_dim, shape.block_size
    if D % 8 or D > MAX_HEAD_DIM:
        raise InvalidArgumentError(
            f"head_dim {D}: the CUDA kernel takes multiples of 8 up to {MAX_HEAD_DIM}"
        )
    if B > 32 or 32 % B:
        raise InvalidArgumentError(f"block_size {B}: the CUDA kernel takes 1, 2, 4, 8, 16 or 32")
    if not q.is_cuda or not q.is_contiguous():
        raise InvalidArgumentError(f"q: expected a contiguous CUDA tensor, got {q.device}")
    for i, pool in enumerate(pools):
        t, codec = pool.tensor, pool.codec
        if t.device != q.device:
            raise InvalidArgumentError(f"pool {i}: on {t.device}, q on {q.device}")
        if not readable(codec):
            raise InvalidArgumentError(
                f"pool {i}: codec {codec.name!r} is not read in place (decode it to a staging "
                "pool first)"
            )
        at = layer if pool.layer_override < 0 else pool.layer_override
        if isinstance(codec, IdentityCodec):
            want = (shape.kv_heads, B, D)
            if (
                t.dim() != 6
                or tuple(t.shape[2:]) != (2, *want)
                or t.dtype != torch_dtype(codec.dtype)
            ):
                raise InvalidArgumentError(
                    f"pool {i}: expected {codec.dtype} [slots, layers, 2, {', '.join(map(str, want))}]"
                    f", got {t.dtype} {list(t.shape)}"
                )
            layers = t.shape[1]
            inner = t[:1]
        else:
            assert isinstance(codec, QuantCodec)
            if t.dim() != 2 or t.dtype != torch.uint8 or t.shape[1] < codec.bytes_per_block(shape):
                raise InvalidArgumentError(
                    f"pool {i}: expected uint8 [slots, >= {codec.bytes_per_block(shape)}], got "
                    f"{t.dtype} {list(t.shape)}"
                )
            layers = shape.layers
            inner = t[:1]
        if not 0 <= at < layers:
            raise InvalidArgumentError(f"pool {i}: layer {at} out of its {layers} layers")
        if t.shape[0] and not inner.is_contiguous():
            raise InvalidArgumentError(f"pool {i}: expected each row contiguous")
    if not 0 <= layer < shape.layers:
        raise InvalidArgumentError(f"layer {layer}: expected 0 to {shape.layers - 1}")


# The descriptors of a set of pools change only when a pool does: keep their device copy rather
# than upload 128 bytes a pool (from pageable memory: a synchronous copy) before every launch.
_descriptors: dict[tuple[bytes, str], Any] = {}
_MAX_DESCRIPTOR_SETS = 256


def _device_descriptors(pools: Sequence[PoolView], shape: BlockShape, device: Any) -> Any:
    torch = torch_module()
    table = (
        np.stack([p.describe(shape) for p in pools])
        if pools
        else np.zeros((1, 16), dtype=np.int64)  # every block skipped: nothing is read
    )
    key = (table.tobytes(), str(device))
    found = _descriptors.get(key)
    if found is None:
        if len(_descriptors) >= _MAX_DESCRIPTOR_SETS:
            _descriptors.clear()
        found = _descriptors[key] = torch.from_numpy(table).to(device)
        # kept for launches on any stream: make sure the copy has landed first
        torch.cuda.current_stream(device).synchronize()
    return found


_rotations: dict[tuple[int, str], Any] = {}


def _device_rotation(pools: Sequence[PoolView], head_dim: int, device: Any) -> int:
    """The address of the rotation's signs on ``device`` (kept, as the descriptors are) when a
    pool is rotated, else 0."""
    signs = rotation_of(pools, head_dim)
    if signs is None:
        return 0
    key = (head_dim, str(device))
    found = _rotations.get(key)
    if found is None:
        torch = torch_module()
        found = _rotations[key] = torch.from_numpy(signs.copy()).to(device)
        torch.cuda.current_stream(device).synchronize()
    return int(found.data_ptr())


def _table(x: Any, name: str, device: Any) -> Any:
    """A block table or seq_lens as a contiguous int32 tensor on ``device``."""
    torch = torch_module()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.device != device:
        raise InvalidArgumentError(f"{name}: expected a numpy array or an int32 tensor on {device}")
    return x.contiguous()


def attend_cuda(
    q: torch.Tensor,
    out: torch.Tensor,
    mass: torch.Tensor,
    seq_lens: Any,
    block_pool: Any,
    block_slot: Any,
    pools: Sequence[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
    *,
    trusted: bool = False,
) -> None:
    """Writes ``out`` (``q``'s shape and dtype) and ``mass`` (fp32 ``[S, M]``, on q's device)
    as :func:`kvtier.attend.reference` computes them, on the current torch stream.

    ``seq_lens``, ``block_pool`` and ``block_slot`` are numpy arrays (checked, then uploaded) or
    int32 tensors on q's device: those are copied to the host and checked too (a synchronising
    copy) unless ``trusted`` says the caller built them in range (the kernel follows every
    index it is given). ``q`` is checked to be finite (NaN or inf is refused: the kernel would
    give such a row zeros), a synchronising read that ``trusted`` skips too: a trusting caller
    vouches for its queries."""
    call = AttentionCall(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale)
    run(call, out, mass, trusted=trusted)


def run(
    call: AttentionCall, out: torch.Tensor, mass: torch.Tensor, *, trusted: bool = False
) -> None:
    """:func:`attend_cuda` of ``call``."""
    torch = torch_module()
    q, shape, layer, scale = call.q, call.shape, call.layer, call.scale
    check_shapes(call)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise InvalidArgumentError(f"out: expected {q.dtype} {list(q.shape)} on {q.device}")
    if not out.is_contiguous():
        raise InvalidArgumentError("out: expected a contiguous tensor")
    seq_lens, block_pool, block_slot = call.seq_lens, call.block_pool, call.block_slot
    tables = [seq_lens, block_pool, block_slot]
    if trusted and not any(isinstance(x, np.ndarray) for x in tables):
        S, Q, Hq, D = q.shape
        if (
            tuple(seq_lens.shape) != (S,)
            or block_pool.dim() != 2
            or tuple(block_pool.shape) != tuple(block_slot.shape)
            or block_pool.shape[0] != S
            or Hq % shape.kv_heads
        ):
            raise InvalidArgumentError(
                "seq_lens, block_pool, block_slot: expected [S], [S, M], [S, M]"
            )
        p = Problem(
            S, Q, Hq, shape.kv_heads, shape.block_size, D, block_pool.shape[1], layer, scale
        )
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"scale: expected a finite number, got {scale}")
    else:
        lens_h, pool_h, slot_h = (
            x if isinstance(x, np.ndarray) else x.cpu().numpy() for x in tables
        )
        host = dataclasses.replace(call, seq_lens=lens_h, block_pool=pool_h, block_slot=slot_h)
        p = host.check()
    S, M = p.seqs, p.max_blocks
    if mass.shape != (S, M) or mass.dtype != torch.float32 or mass.device != q.device:
        raise InvalidArgumentError(f"mass: expected float32 [{S}, {M}] on {q.device}")
    if not mass.is_contiguous():
        raise InvalidArgumentError("mass: expected a contiguous tensor")
    if S == 0 or p.queries == 0 or M == 0:
        mass.zero_()
        return
    device = q.device
    index = _cuda.device_index(device)
    sms, max_shared = _device_limits(index)
    lp = plan(p, sms, max_shared)
    if lp.shared_bytes > max_shared:
        raise InvalidArgumentError(
            f"head_dim {p.head_dim}, block_size {p.block_size}: a tile needs "
            f"{lp.shared_bytes} bytes of shared memory, this GPU gives a CTA {max_shared}"
        )
    R = p.q_heads // p.kv_heads * p.queries
    if S > 65535 or lp.row_tiles > 65535 or lp.splits > 65535:
        raise InvalidArgumentError(
            f"{S} sequences x {R} rows a K/V head: more than one launch takes (65535 each)"
        )
    lens, pool_ids, slots = (
        _table(x, n, device)
        for x, n in zip(tables, ("seq_lens", "block_pool", "block_slot"), strict=True)
    )
    descs = _device_descriptors(call.pools, shape, device)
    f32 = torch.float32
    part_lse = torch.empty((S, p.kv_heads, lp.splits, R), dtype=f32, device=device)
    blse = torch.empty((S, M, p.kv_heads, R), dtype=f32, device=device)
    part_out = (
        torch.empty((S, p.kv_heads, lp.splits, R, p.head_dim), dtype=f32, device=device)
        if lp.splits > 1
        else part_lse  # not read with one split
    )
    suffix = _SUFFIX[str(q.dtype).removeprefix("torch.")]
    ptr = [
        np.uint64(t.data_ptr())
        for t in (q, out, part_out, part_lse, blse, lens, pool_ids, slots, descs, mass)
    ]
    i32 = np.int32
    dims = (
        i32(p.queries),
        i32(p.q_heads),
        i32(p.kv_heads),
        i32(p.block_size),
        i32(p.head_dim),
        i32(M),
    )
    cupy = _cuda.cupy()
    module = _cuda.compiled(KERNEL_FILE, index)
    main = module.get_function(f"kvtier_attend_{suffix}")
    combine = module.get_function(f"kvtier_attend_combine_{suffix}")
    if lp.shared_bytes > _DEFAULT_SMEM and main.max_dynamic_shared_size_bytes < lp.shared_bytes:
        main.max_dynamic_shared_size_bytes = lp.shared_bytes
    with cupy.cuda.Device(index), _cuda.torch_stream(index):
        main(
            (S * p.kv_heads, lp.splits, lp.row_tiles),
            (ATTEND_THREADS,),
            (
                *ptr[:9],
                np.uint64(_device_rotation(call.pools, p.head_dim, device)),
                *dims,
                i32(layer),
                np.float32(scale * math.log2(math.e)),
                i32(lp.rows_per_cta),
                i32(lp.tile_tokens),
                i32(lp.blocks_per_split),
                i32(lp.splits),
            ),
            shared_mem=lp.shared_bytes,
        )
        combine(
            (lp.mass_ctas + lp.out_ctas, S),
            (COMBINE_THREADS,),
            (
                ptr[1],
                ptr[2],
                ptr[3],
                ptr[4],
                ptr[9],
                ptr[5],
                *dims,
                i32(lp.splits),
                i32(lp.mass_ctas),
            ),
        )
