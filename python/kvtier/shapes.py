"""KV-cache shapes of common models, and the bytes a block takes at each level of a ladder.

The byte counts are the codecs' own (python/kvtier/codecs: the bytes they really write), so the
simulator sizes pools exactly as a BlockManager would. Computing them needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .codecs import BlockShape, get_codec
from .errors import ConfigError


@dataclass(frozen=True)
class KVShape:
    """The KV of one token, all layers: ``2 * layers * kv_heads * head_dim`` values."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    #: Parameters, for the prefill cost model (2 FLOPs per parameter per token).
    params: float

    def block_bytes(self, codec: str, block_tokens: int) -> int:
        """Bytes of one block of ``block_tokens`` tokens stored with ``codec`` (``drop``: 0)."""
        if codec == "drop":
            return 0
        shape = BlockShape(self.layers, self.kv_heads, block_tokens, self.head_dim)
        try:
            return get_codec(codec).bytes_per_block(shape)
        except ConfigError as exc:
            raise ConfigError(f"unknown codec {codec!r} in the ladder: {exc}") from None

    def ladder_bytes(self, ladder: tuple[str, ...], block_tokens: int) -> list[int]:
        return [self.block_bytes(codec, block_tokens) for codec in ladder]


MODELS: dict[str, KVShape] = {
    "llama3-8b": KVShape("llama3-8b", layers=32, kv_heads=8, head_dim=128, params=8.03e9),
    "llama2-7b": KVShape("llama2-7b", layers=32, kv_heads=32, head_dim=128, params=6.74e9),
    "smollm2-135m": KVShape("smollm2-135m", layers=30, kv_heads=3, head_dim=64, params=1.35e8),
}


def model_shape(name: str) -> KVShape:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class PrefillCost:
    """Prefill cost model: ``2 * params`` FLOPs per prompt token on a GPU of ``peak_tflops``
    at ``mfu`` utilisation (attention's quadratic term ignored, so long prompts are
    under-costed and savings are conservative). Loading a cached block from a slower tier costs
    its bytes over that tier's bandwidth; a request loads the leading hits whose load saves the
    most time over recomputing them (none when no load saves any), and recomputes the rest, as
    the vLLM connector's lookup does, so a hit never costs more than a miss."""

    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.5

    def seconds_per_token(self, shape: KVShape) -> float:
        return 2.0 * shape.params / (self.peak_tflops * 1e12 * self.mfu)

    def describe(self, shape: KVShape) -> str:
        us = self.seconds_per_token(shape) * 1e6
        return (
            f"prefill = 2*{shape.params:.3g} FLOP/token at {self.peak_tflops:g} TFLOP/s x "
            f"{self.mfu:g} MFU = {us:.1f} us/token; a hit in a slower tier costs its bytes / "
            "tier bandwidth; a request loads the leading hits that save the most time"
        )
