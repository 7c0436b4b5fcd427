"""The packed format of the quantized codecs as the kernels read it: the 10 int64s of
:func:`layout` (``struct Layout`` in kernels/kvtier_codecs.cu, ``PackedFormat`` in
crates/kvtier-attend/src/codec.rs), computed from a codec's sections, the one source of truth.

Shared by the CUDA kernels (:mod:`kvtier.codecs.cuda`) and the CPU ones (:mod:`kvtier.codecs.native`);
:class:`QuantFormat` is a protocol so that neither imports the codec that imports them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .base import BlockShape


class QuantFormat(Protocol):
    """What the kernels read of a codec: a :class:`~kvtier.codecs.quant.QuantCodec`'s format."""

    name: str
    bits: int
    asymmetric: bool
    key_per_channel: bool
    rotate: bool

    @property
    def format(self) -> str: ...
    def group(self, shape: BlockShape) -> int: ...
    def key_groups(self, shape: BlockShape) -> int: ...
    def value_groups(self, shape: BlockShape) -> int: ...
    def offsets(self, shape: BlockShape) -> dict[str, int]: ...
    def bytes_per_block(self, shape: BlockShape) -> int: ...


def layout(codec: QuantFormat, shape: BlockShape) -> np.ndarray:
    """The 11 int64s that describe a packed format to the kernels: ``bits, asymmetric,
    key_per_channel, group, codes, k_scale, k_zero, v_scale, v_zero, row_bytes, rotated``
    (offsets in bytes from the row's start; the zero points' are 0 when symmetric; a rotated
    format's signs go with each call)."""
    off = codec.offsets(shape)
    return np.array(
        [
            codec.bits,
            int(codec.asymmetric),
            int(codec.key_per_channel),
            codec.group(shape),
            off["codes"],
            off["k_scale"],
            off.get("k_zero", 0),
            off["v_scale"],
            off.get("v_zero", 0),
            codec.bytes_per_block(shape),
            int(codec.rotate),
        ],
        dtype=np.int64,
    )
