"""Codecs: how a block of K/V is stored at each precision level.

``get_codec(name)`` returns one by name — ``fp16``/``bf16``/``fp32`` (level 0), ``int8``,
``int4`` and ``int2`` (KIVI-style), a ``learned:<name>`` pair of torch modules, or a codec a
package declares in the ``kvtier.codecs`` entry-point group. Layouts and byte counts need only
numpy; encoding and decoding need torch, and CuPy for the CUDA kernels. See docs/codecs.md for
the measured quality and speed of each.
"""

from __future__ import annotations

from typing import Any

from .base import Backend, BlockShape, Codec, Encoded, Section
from .identity import IdentityCodec
from .quant import INT2_GROUP_SIZE, INT4_GROUP_SIZE, Int2Codec, Int4Codec, Int8Codec, QuantCodec
from .registry import (
    ENTRY_POINT_GROUP,
    available_codecs,
    get_codec,
    register_codec,
    rescan_entry_points,
    unregister_codec,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "INT2_GROUP_SIZE",
    "INT4_GROUP_SIZE",
    "Backend",
    "BlockShape",
    "Codec",
    "Encoded",
    "IdentityCodec",
    "Int2Codec",
    "Int4Codec",
    "Int8Codec",
    "LearnedCodec",
    "LinearCompressor",
    "LinearDecompressor",
    "QuantCodec",
    "Section",
    "available_codecs",
    "fit_pca",
    "get_codec",
    "register_codec",
    "rescan_entry_points",
    "unregister_codec",
]

_NEEDS_TORCH = {"LearnedCodec", "LinearCompressor", "LinearDecompressor", "fit_pca"}


def __getattr__(name: str) -> Any:
    # The learned codec subclasses torch.nn.Module: import it (and torch) only when asked.
    if name in _NEEDS_TORCH:
        from ..errors import require

        require("torch", "torch", purpose="learned codecs need torch")
        from . import learned

        return getattr(learned, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
