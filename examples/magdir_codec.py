"""A user-written codec: the original design's magnitude + direction decomposition.

Each (token, head) vector is stored as its L2 norm in fp16 plus its unit direction quantized
with a fixed scale (the components of a unit vector lie in [-1, 1], so no per-vector scale is
needed): ``D + 2`` bytes a vector at 8 bits, ``D / 2 + 2`` at 4 bits — exactly the bytes of
plain symmetric per-token grouping with one fp16 scale per vector. ``kvtier eval codecs``
measures both on real K/V (docs/codecs.md): grouping wins at both widths, because a fixed
scale spends most of its levels on a range the components of a 64-dim unit vector never reach.
So magdir is not a built-in; it stays here as the example of writing and registering a codec.

Use it::

    python examples/magdir_codec.py                   # round trip on random blocks
    kvtier eval codecs --load examples/magdir_codec.py --codecs int8,magdir8,int4-sym-head,magdir4

or, from a package, declare it in the ``kvtier.codecs`` entry-point group.
"""

from __future__ import annotations

import torch

from kvtier.codecs import BlockShape, Codec, Section, register_codec
from kvtier.errors import InvalidArgumentError


class MagDirCodec(Codec):
    """Norm in fp16, unit direction in ``bits``-bit symmetric codes with the fixed scale 1/qmax."""

    def __init__(self, bits: int = 8) -> None:
        if bits not in (4, 8):
            raise InvalidArgumentError(f"bits: expected 4 or 8, got {bits}")
        self.bits = bits
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"magdir{bits}"

    @property
    def format(self) -> str:
        return f"magdir{self.bits}"

    def check_shape(self, shape: BlockShape) -> None:
        if self.bits == 4 and shape.head_dim % 2:
            raise InvalidArgumentError(f"head_dim {shape.head_dim} is odd: 4-bit codes pair up")

    def sections(self, shape: BlockShape) -> tuple[Section, ...]:
        L, _, H, B, D = shape.dims
        return (
            Section("norm", "fp16", (L, 2, H, B)),
            Section("codes", "u8", (L, 2, H, B, D * self.bits // 8)),
        )

    def _encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        x = blocks.float()
        norm = x.norm(dim=-1, keepdim=True)
        direction = x / torch.where(norm > 0, norm, 1.0)
        q = torch.round(direction * self.qmax).clamp(-self.qmax, self.qmax).to(torch.int16)
        if self.bits == 8:
            codes = q.to(torch.int8).view(torch.uint8)
        else:
            nib = q & 15
            codes = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
        return {"norm": norm.squeeze(-1).half(), "codes": codes}

    def _decode(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        codes = parts["codes"]
        if self.bits == 8:
            q = codes.view(torch.int8).float()
        else:
            c = codes.to(torch.int16)
            q = ((torch.stack((c & 15, c >> 4), dim=-1).flatten(-2) ^ 8) - 8).float()
        direction = q / self.qmax
        # the quantized direction is no longer unit length: renormalise before scaling
        direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return direction * parts["norm"].float()[..., None]


for _bits in (8, 4):
    register_codec(f"magdir{_bits}", lambda bits=_bits: MagDirCodec(bits), replace=True)


if __name__ == "__main__":
    blocks = torch.randn(4, 2, 2, 3, 16, 64, dtype=torch.float16)
    for bits in (8, 4):
        codec = MagDirCodec(bits)
        back = codec.decode(codec.encode(blocks))
        cos = torch.nn.functional.cosine_similarity(back.float(), blocks.float(), dim=-1)
        print(
            f"{codec.name}: {codec.bytes_per_block(BlockShape.of(blocks))} bytes/block, "
            f"mean cosine {float(cos.mean()):.5f}"
        )
