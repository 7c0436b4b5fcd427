"""CPU execution of the quantized codecs: crates/kvtier-attend/src/codec.rs through
:mod:`kvtier._core`.

The native path of :class:`~kvtier.codecs.quant.QuantCodec` (its ``_native()`` is this module),
byte for byte the torch reference's codes, scales and decoded values (quant.py's rounding rule;
the one difference: the sign of a zero point or a decoded zero in a group whose minimum is a
zero and which holds both +0 and -0, where torch's own answer depends on its reduction order).
The same calls as :mod:`kvtier.codecs.cuda` (the :class:`~kvtier.codecs.base.CodecKernels`
protocol) for pools on the CPU, and :func:`dequantize_layer` for
:meth:`~kvtier.codecs.base.Codec.decode_layer`. Pools cross as row addresses (torch's
``data_ptr()`` plus slot times row size) without a copy; the work runs on the extension's
threads with the GIL released. Every function checks the tensors it hands over (on the CPU,
contiguous, slots in range) before the extension reads an address.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import _core
from .._torch import torch_module
from ..errors import InvalidArgumentError
from .base import BlockShape, Codec
from .layout import QuantFormat, layout
from .rotation import hadamard_signs

if TYPE_CHECKING:
    import torch

# A layout depends only on (format, shape): keep it rather than walk the sections every call.
_layouts: dict[tuple[str, BlockShape], np.ndarray] = {}


def _quant(codec: Codec) -> QuantFormat:
    """``codec``, whose format the extension reads (its ``_native()`` is this module: a
    :class:`~kvtier.codecs.quant.QuantCodec`), else TypeError."""
    if not codec.has_native or codec._native() is not sys.modules[__name__]:
        raise TypeError(f"codec {codec.name!r} has no native implementation")
    return cast(QuantFormat, codec)


def _layout(codec: QuantFormat, shape: BlockShape) -> np.ndarray:
    key = (codec.format, shape)
    if key not in _layouts:
        _layouts[key] = layout(codec, shape)
    return _layouts[key]


def _rotation(shape: BlockShape, *codecs: QuantFormat) -> np.ndarray | None:
    """The rotation's signs when one of ``codecs`` is rotated (:func:`.rotation.hadamard_signs`)."""
    return hadamard_signs(shape.head_dim) if any(c.rotate for c in codecs) else None


def _dims(shape: BlockShape) -> tuple[int, int, int, int]:
    return (shape.layers, shape.kv_heads, shape.block_size, shape.head_dim)


def _dtype_code(t: torch.Tensor, what: str) -> int:
    torch = torch_module()
    code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}.get(t.dtype)
    if code is None:
        raise InvalidArgumentError(f"{what}: expected float16, bfloat16 or float32, got {t.dtype}")
    return code


def _rows(pool: torch.Tensor, slots: Any, what: str) -> np.ndarray:
    """The addresses of rows ``slots`` of ``pool`` (a contiguous CPU tensor, rows along axis 0)
    as uint64, after checking the pool and that every slot is a row of it."""
    if pool.device.type != "cpu":
        raise InvalidArgumentError(f"{what}: expected a CPU tensor, got one on {pool.device}")
    if not pool.is_contiguous():
        raise InvalidArgumentError(
            f"{what}: expected a contiguous tensor (strides {pool.stride()}); call .contiguous()"
        )
    idx = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            f"{what}: expected a 1-D integer array of slot indices, got {idx.dtype} {idx.shape}"
        )
    rows = pool.shape[0]
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        raise InvalidArgumentError(
            f"{what}: expected slots in [0, {rows}), got min {int(idx.min())} max {int(idx.max())}"
        )
    row_bytes = pool[0].numel() * pool.element_size() if rows else 0
    return np.uint64(pool.data_ptr()) + idx.astype(np.uint64) * np.uint64(row_bytes)


def quantize_into(
    codec: Codec,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Float pool rows ``src[src_slots]`` -> packed pool rows ``dst[dst_slots]``."""
    q = _quant(codec)
    _core.quantize_rows(
        _rows(src, src_slots, "src"),
        _rows(dst, dst_slots, "dst"),
        _layout(q, shape),
        _dims(shape),
        _dtype_code(src, "src"),
        rotation=_rotation(shape, q),
    )


def dequantize_into(
    codec: Codec,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed pool rows ``src[src_slots]`` -> float pool rows ``dst[dst_slots]`` (in the dtype
    of ``dst``, fp16 saturating at ±65504)."""
    q = _quant(codec)
    _core.dequantize_rows(
        _rows(src, src_slots, "src"),
        _rows(dst, dst_slots, "dst"),
        _layout(q, shape),
        _dims(shape),
        _dtype_code(dst, "dst"),
        (0, shape.layers),
        rotation=_rotation(shape, q),
    )


def dequantize_layer(
    codec: Codec,
    src: torch.Tensor,
    src_slots: Any,
    dst: torch.Tensor,
    shape: BlockShape,
    layer: int,
) -> None:
    """Layer ``layer`` of packed pool rows ``src[src_slots]`` -> ``dst``, a contiguous
    ``[len(src_slots), 2, kv_heads, block_size, head_dim]`` in its own dtype. Only that layer's
    bytes of each row are read."""
    q = _quant(codec)
    n = len(src_slots)
    if tuple(dst.shape) != (n, *shape.dims[1:]):
        raise InvalidArgumentError(
            f"dst: expected [{n}, {', '.join(map(str, shape.dims[1:]))}], got {list(dst.shape)}"
        )
    _core.dequantize_rows(
        _rows(src, src_slots, "src"),
        _rows(dst, np.arange(n), "dst"),
        _layout(q, shape),
        _dims(shape),
        _dtype_code(dst, "dst"),
        (layer, 1),
        rotation=_rotation(shape, q),
    )


def transcode_into(
    codec: Codec,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    to: Codec,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed rows of one format -> packed rows of another, the values between kept in fp32."""
    a, b = _quant(codec), _quant(to)
    _core.transcode_rows(
        _rows(src, src_slots, "src"),
        _layout(a, shape),
        _rows(dst, dst_slots, "dst"),
        _layout(b, shape),
        _dims(shape),
        rotation=_rotation(shape, a, b),
    )
