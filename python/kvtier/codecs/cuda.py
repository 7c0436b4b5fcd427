"""CUDA execution of the quantized codecs: kernels/kvtier_codecs.cu through CuPy.

The kernels of :class:`~kvtier.codecs.quant.QuantCodec` (its ``_kernels()`` is this module).
Every call is one launch for the whole batch, on the caller's current torch stream, compiled by
:mod:`kvtier._cuda` (the loader the attention kernel uses too). Tensors cross by DLPack without
a copy; the codecs' argument checks (codecs/base.py) have run before anything here is called.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import _cuda
from .._torch import torch_module
from .base import BlockShape, Codec
from .layout import QuantFormat, layout
from .rotation import hadamard_signs

if TYPE_CHECKING:
    import torch

KERNEL_FILE = "kvtier_codecs.cu"
THREADS = 128
_SUFFIX = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}


def kernel_source(file: str = KERNEL_FILE) -> str:
    """What NVRTC compiles for kernels/``file`` (:func:`kvtier._cuda.kernel_source`), by default
    the codecs' kernels."""
    return _cuda.kernel_source(file)


def shared_bytes(codec: QuantFormat, shape: BlockShape) -> int:
    """Dynamic shared memory of a quantizing tile: the padded fp32 tile, scales, zero points."""
    groups = max(codec.key_groups(shape), codec.value_groups(shape))
    return 4 * (shape.block_size * (shape.head_dim + 1) + 2 * groups)


def _quant(codec: Codec) -> QuantFormat:
    """``codec``, whose format these kernels read (its ``_kernels()`` is this module: a
    :class:`~kvtier.codecs.quant.QuantCodec`), else TypeError."""
    if codec._kernels() is not sys.modules[__name__]:
        raise TypeError(f"codec {codec.name!r} has no CUDA kernels")
    return cast(QuantFormat, codec)


def _as_cupy(t: torch.Tensor) -> Any:
    torch = torch_module()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)  # CuPy has no bfloat16; the kernels read raw 16-bit words
    return _cuda.cupy().from_dlpack(t)


def _launch(
    name: str, device: torch.device, grid: int, args: tuple[Any, ...], smem: int = 0
) -> None:
    if grid == 0:
        return
    index = _cuda.device_index(device)
    fn = _cuda.compiled(KERNEL_FILE, index).get_function(name)
    if smem > _cuda.DEFAULT_SHARED_BYTES:
        fn.max_dynamic_shared_size_bytes = smem
    with _cuda.cupy().cuda.Device(index), _cuda.torch_stream(index):
        fn((grid,), (THREADS,), args, shared_mem=smem)


def _dims(shape: BlockShape) -> tuple[np.int32, ...]:
    return tuple(
        np.int32(v) for v in (shape.layers, shape.kv_heads, shape.block_size, shape.head_dim)
    )


# A layout depends only on (format, shape); keep its device copy instead of uploading 80 bytes
# from pageable memory (a synchronous copy) before every launch.
_layouts: dict[tuple[str, BlockShape, str], Any] = {}


def _device_layout(codec: QuantFormat, shape: BlockShape, device: torch.device) -> Any:
    key = (codec.format, shape, str(device))
    if key not in _layouts:
        torch = torch_module()
        _layouts[key] = _as_cupy(torch.from_numpy(layout(codec, shape)).to(device))
    return _layouts[key]


_rotations: dict[tuple[int, str], Any] = {}


def _rotation(shape: BlockShape, device: torch.device, *codecs: QuantFormat) -> np.uint64:
    """The address of the rotation's signs on ``device`` (kept) when one of ``codecs`` is
    rotated, else 0."""
    if not any(c.rotate for c in codecs):
        return np.uint64(0)
    key = (shape.head_dim, str(device))
    if key not in _rotations:
        torch = torch_module()
        signs = torch.from_numpy(hadamard_signs(shape.head_dim).copy()).to(device)
        torch.cuda.current_stream(device).synchronize()  # kept for launches on any stream
        _rotations[key] = signs
    return np.uint64(_rotations[key].data_ptr())


def _pools(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> tuple[Any, ...]:
    return _as_cupy(src), _as_cupy(src_slots), _as_cupy(dst), _as_cupy(dst_slots)


def quantize_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Float pool rows -> packed pool rows: one CUDA block per (slot, layer, K/V, head)."""
    q = _quant(codec)
    n = int(src_slots.numel())
    args = (
        *_pools(src, src_slots, dst, dst_slots),
        _device_layout(q, shape, src.device),
        _rotation(shape, src.device, q),
    )
    grid = n * shape.layers * 2 * shape.kv_heads
    _launch(
        f"kvtier_quantize_{_SUFFIX[shape.dtype]}",
        src.device,
        grid,
        (*args, *_dims(shape)),
        shared_bytes(q, shape),
    )


def dequantize_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed pool rows -> float pool rows (dtype of ``dst``): one thread per code byte; a
    rotated format's, one CUDA block per tile (turned back in shared memory)."""
    q = _quant(codec)
    n = int(src_slots.numel())
    if q.rotate:
        args = (
            *_pools(src, src_slots, dst, dst_slots),
            _device_layout(q, shape, src.device),
            _rotation(shape, src.device, q),
            *_dims(shape),
        )
        grid = n * shape.layers * 2 * shape.kv_heads
        smem = 4 * shape.block_size * (shape.head_dim + 1)
        _launch(f"kvtier_dequantize_rotated_{_SUFFIX[shape.dtype]}", src.device, grid, args, smem)
        return
    code_bytes = n * shape.elements * q.bits // 8
    grid = min(-(-code_bytes // THREADS), 65535 * 32)
    args = (
        *_pools(src, src_slots, dst, dst_slots),
        _device_layout(q, shape, src.device),
        np.int64(n),
    )
    _launch(f"kvtier_dequantize_{_SUFFIX[shape.dtype]}", src.device, grid, (*args, *_dims(shape)))


def transcode_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    to: Any,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed rows of one format -> packed rows of another, dequantized in shared memory only."""
    a, b = _quant(codec), _quant(to)
    n = int(src_slots.numel())
    args = (
        _as_cupy(src),
        _as_cupy(src_slots),
        _device_layout(a, shape, src.device),
        _as_cupy(dst),
        _as_cupy(dst_slots),
        _device_layout(b, shape, src.device),
        _rotation(shape, src.device, a, b),
        *_dims(shape),
    )
    grid = n * shape.layers * 2 * shape.kv_heads
    _launch("kvtier_transcode", src.device, grid, args, shared_bytes(b, shape))
