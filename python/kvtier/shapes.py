"""KV-cache shapes of common models, and the bytes a block takes at each level of a ladder.

The byte counts follow the storage formats in ARCHITECTURE.md "Codecs" (one scale, or scale and
zero point, in fp16 per quantization group); they size pools and budgets in the simulator. The
codecs themselves (python/kvtier/codecs) report the same numbers for the bytes they really write.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
#: Values per scale/zero-point group along the head dimension (int4 values, per token).
INT4_GROUP = 32


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
        """Bytes of one block of ``block_tokens`` tokens stored with ``codec``."""
        t, d = block_tokens, self.head_dim
        per_head = {  # bytes of K and V of one layer and KV head
            "drop": 0,
            # symmetric per token and head: one fp16 scale per (token, head)
            "int8": 2 * t * (d + 2),
            # KIVI: keys per channel (scale+zero per channel over the block's tokens),
            # values per token in groups of INT4_GROUP (scale+zero per group)
            "int4": (t * d // 2 + 4 * d) + (t * d // 2 + 4 * t * (d // INT4_GROUP)),
        }
        if codec in _DTYPE_BYTES:
            return 2 * self.layers * self.kv_heads * t * d * _DTYPE_BYTES[codec]
        if codec not in per_head:
            known = ", ".join([*_DTYPE_BYTES, *per_head])
            raise ConfigError(f"unknown codec {codec!r} in the ladder: expected one of {known}")
        return self.layers * self.kv_heads * per_head[codec]

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
    its bytes over that tier's bandwidth; where that is slower than recomputing, the block is
    recomputed, so a hit never costs more than a miss."""

    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.5

    def seconds_per_token(self, shape: KVShape) -> float:
        return 2.0 * shape.params / (self.peak_tflops * 1e12 * self.mfu)

    def describe(self, shape: KVShape) -> str:
        us = self.seconds_per_token(shape) * 1e6
        return (
            f"prefill = 2*{shape.params:.3g} FLOP/token at {self.peak_tflops:g} TFLOP/s x "
            f"{self.mfu:g} MFU = {us:.1f} us/token; a hit in a slower tier costs its bytes / "
            "tier bandwidth (capped at the recompute cost)"
        )
