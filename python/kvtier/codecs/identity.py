"""Level 0: blocks stored as they are, in a float dtype (``fp16``, ``bf16``, ``fp32``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._torch import torch_dtype, torch_module
from .base import BlockShape, Codec, Section

if TYPE_CHECKING:
    import torch


class IdentityCodec(Codec):
    """Stores blocks in ``dtype``: lossless for blocks already in it, a cast otherwise. A float
    pool ``[slots, *shape.dims]`` viewed as ``uint8 [slots, bytes]`` is its packed pool."""

    layer_major = True

    lossless = True

    def __init__(self, dtype: str = "fp16") -> None:
        if dtype not in ("fp16", "bf16", "fp32"):
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(f"dtype: expected fp16, bf16 or fp32, got {dtype!r}")
        self.name = dtype
        self.dtype = dtype

    @property
    def format(self) -> str:
        return self.dtype

    def sections(self, shape: BlockShape) -> tuple[Section, ...]:
        return (Section("values", self.dtype, shape.dims),)

    def max_magnitude(self, dtype: str) -> float:
        """This dtype's largest value: past it a cast would overflow to infinity."""
        return float(torch_module().finfo(torch_dtype(self.dtype)).max)

    def _encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": blocks.to(torch_dtype(self.dtype))}

    def _decode(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        return parts["values"]
