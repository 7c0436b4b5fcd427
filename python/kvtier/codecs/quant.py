"""Group-wise integer quantization: the ``int8``, ``int4`` and ``int2`` codecs and their torch
reference.

A block is split into groups; each group stores integer codes and an fp16 scale (and an fp16
zero point when asymmetric). Values are grouped per token, ``group_size`` values along the head
dimension (the whole head by default); keys may instead be grouped **per channel**, along the
block's tokens, as KIVI does (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache"): key outliers sit in fixed channels, so a per-channel group keeps
them from blowing up every token's scale.

The rounding rule (the CUDA kernels in kernels/kvtier_codecs.cu and the native CPU code in
crates/kvtier-attend/src/codec.rs follow it operation by operation, so codes are bit-exact and
scales equal):

- symmetric: ``s = fp16(amax * fp32(1/qmax))``, ``q = round(x / s')`` clamped to
  ``[-qmax, qmax]`` (``qmax`` 127, 7 or 1 for 8, 4 or 2 bits);
- asymmetric: ``s = fp16((max - min) * fp32(1/levels))``, ``z = fp16(min)``,
  ``q = round((x - z) / s')`` clamped to ``[0, levels]`` (``levels`` 255, 15 or 3);

where ``s' = s`` if ``s > 0`` else 1, ``fp16()`` rounds to nearest even after clamping to
±65504, ``round`` is half-to-even, and every step is a single fp32 operation. Decoding is
``q * s (+ z)`` in fp32; cast to fp16, it saturates at ±65504 (a scale rounded up to fp16
can take an fp16-max input's codes just past it, which fp16 would hold as inf). Inputs beyond
what fp16 scales hold (:meth:`QuantCodec.max_magnitude`) are refused by ``encode`` and by a
``BlockManager``'s appends; the pool-to-pool calls, which do not check, saturate them.

Rotated codecs (``rotate=True``) quantize ``y = x @ H / D`` instead of the head vectors ``x``, with ``H`` the ``[D, D]`` Hadamard
matrix of :func:`.rotation.hadamard` (entries ±1, ``H @ H.T == D * I``), and decode ``x = y @ H.T``,
clamped to ±65504. Both products run as Sylvester's transform (``log2(D)`` passes of
butterflies ``(a, b) -> (a + b, a - b)``, :mod:`.rotation`) and one multiply by the
signs (over ``D``), in the order the native code (``crates/kvtier-attend/src/rotation.rs``) and
the CUDA kernels (``kernels/kvtier_common.cuh``) take, so all three round alike and write the
same bytes. Dividing by ``D`` rather
than ``sqrt(D)`` (the orthogonal rotation) bounds every ``|y|`` by ``max |x|``: a rotated
vector never leaves the range an unrotated one may hold (the orthogonal rotation takes a
coherent vector, such as a constant, ``sqrt(D)`` times past it, where fp16 scales saturate), so
the rotated codec's error on ``y`` obeys the unrotated codec's bound, and ``x``'s error is that
error rotated back (``||x' - x|| = sqrt(D) * ||y' - y||`` a head vector). Clamping the decoded
values to the codec's range only brings them closer to the input. The price is at the other
end: a spread-out vector's ``y`` is ``sqrt(D)`` times smaller than before, so its scales reach
fp16's subnormals (below 6.1e-5) for groups of ``|x|`` under about ``1e-4 * sqrt(D)``. Format
version 2; version 1 (the orthogonal rotation) is refused.

Codes narrower than a byte are packed ``8 / bits`` a byte along the head dimension, low bits
first: element ``per * i + j`` of a row sits at bits ``bits * j`` .. ``bits * j + bits - 1`` of
byte ``i`` (int4: element ``2i`` in the low nibble; int2: element ``4i + j`` at bits ``2j, 2j + 1``).
Symmetric codes are two's complement in their ``bits`` (sign-extended when unpacked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._torch import torch_module
from ..errors import InvalidArgumentError
from .base import BlockShape, Codec, CodecKernels, NativeKernels, Section
from .rotation import rotated, unrotated

if TYPE_CHECKING:
    import torch

_FP16_MAX = 65504.0


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-_FP16_MAX, _FP16_MAX).half().float()


#: The grouping options of the built-in ``int2``, ``int4`` and ``int8`` codecs, by bits.
_BUILTIN_OPTIONS = {
    2: {"asymmetric": True, "key_per_channel": True},
    4: {"asymmetric": True, "key_per_channel": True},
    8: {"asymmetric": False, "key_per_channel": False},
}
#: The class of the built-in codec of these bits (named in advice a user can run).
_BUILTIN_CLASS = {2: "Int2Codec", 4: "Int4Codec", 8: "Int8Codec"}


class QuantCodec(Codec):
    """Integer codes with fp16 scales per group; the shared machinery of ``int8``, ``int4`` and
    ``int2``."""

    layer_major = True

    has_kernels = True
    has_native = True

    def __init__(
        self,
        name: str,
        bits: int,
        *,
        asymmetric: bool,
        key_per_channel: bool,
        group_size: int | None = None,
        rotate: bool = False,
    ) -> None:
        if bits not in (2, 4, 8):
            raise InvalidArgumentError(f"bits: expected 2, 4 or 8, got {bits!r}")
        if group_size is not None and (
            not isinstance(group_size, int) or group_size < 2 or group_size % 2
        ):
            raise InvalidArgumentError(
                f"group_size: expected an even number of values >= 2 (or None for the whole "
                f"head), got {group_size!r}"
            )
        self.name = name
        self.bits = bits
        self.asymmetric = bool(asymmetric)
        self.key_per_channel = bool(key_per_channel)
        self.group_size = group_size
        self.rotate = bool(rotate)
        if self.rotate:
            # v1 rotated by H / sqrt(D): its bytes would decode sqrt(D) times too large here.
            self.version = 2

    def _kernels(self) -> CodecKernels:
        """kernels/kvtier_codecs.cu (:mod:`kvtier.codecs.cuda`), imported when first asked for."""
        from . import cuda

        return cuda

    def _native(self) -> NativeKernels:
        """crates/kvtier-attend/src/codec.rs (:mod:`kvtier.codecs.native`), imported when first
        asked for."""
        from . import native

        return native

    @property
    def format(self) -> str:
        group = "head" if self.group_size is None else str(self.group_size)
        keys = "chan" if self.key_per_channel else "tok"
        rot = "-rot" if self.rotate else ""
        return f"int{self.bits}-{'asym' if self.asymmetric else 'sym'}-k{keys}-g{group}{rot}"

    def max_magnitude(self, dtype: str) -> float:
        """fp16 scales and zero points bound what a group holds: an asymmetric group's zero
        point is its minimum, a rotated codec decodes within ±65504, and a symmetric group's
        scale is ``max|x| / qmax``. (fp16 K/V never exceeds any of them.)"""
        if self.asymmetric or self.rotate:
            return _FP16_MAX
        return _FP16_MAX * (2 ** (self.bits - 1) - 1)

    def group(self, shape: BlockShape) -> int:
        """Values per group along the head dimension."""
        return shape.head_dim if self.group_size is None else self.group_size

    def check_shape(self, shape: BlockShape) -> None:
        D = shape.head_dim
        per_byte = 8 // self.bits
        if D % per_byte:  # no group size helps: say so first
            odd = "is odd" if per_byte == 2 else f"is not divisible by {per_byte}"
            count = {2: "two", 4: "four"}[per_byte]
            raise InvalidArgumentError(
                f"head_dim {D} {odd}: int{self.bits} packs {count} values a byte along it"
            )
        g = self.group(shape)
        if D % g:
            raise InvalidArgumentError(self._group_advice(D, g))
        if self.rotate and D & (D - 1):
            raise InvalidArgumentError(
                f"head_dim {D} is not a power of two: codec {self.name!r} rotates each head "
                "vector by a Hadamard matrix, which needs one; use it without rotate=True"
            )

    def _group_advice(self, head_dim: int, group: int) -> str:
        """Why ``group`` does not fit ``head_dim``, the group sizes that do, and how to use one."""
        fits = [n for n in range(2, head_dim + 1, 2) if head_dim % n == 0]
        sizes = ", ".join([*map(str, fits), "None (the whole head)"])
        # the nearest to the chosen trade-off of bytes against error: the largest one below it
        pick = max((n for n in fits if n < group), default=None)
        base = f"int{self.bits}"
        # the built-in codec of these bits, with this codec's other options kept
        options = f"group_size={pick}" + "".join(
            f", {k}={getattr(self, k)}"
            for k, v in _BUILTIN_OPTIONS[self.bits].items()
            if getattr(self, k) != v
        )
        cls = _BUILTIN_CLASS[self.bits]
        named = f"{base}-g{pick if pick is not None else 'head'}"
        return (
            f"head_dim {head_dim} is not divisible by group_size {group} of codec "
            f"{self.name!r}: expected a group_size that divides it, one of {sizes}; "
            f"e.g. get_codec({base!r}, {options}) or {cls}({options}), and in a ladder under "
            f"a name of its own: register_codec({named!r}, lambda: {cls}({options}, "
            f"name={named!r})), then ladder=(..., {named!r})"
        )

    def key_groups(self, shape: BlockShape) -> int:
        """Groups of one (layer, head) of keys in a block."""
        if self.key_per_channel:
            return shape.head_dim
        return self.value_groups(shape)

    def value_groups(self, shape: BlockShape) -> int:
        return shape.block_size * (shape.head_dim // self.group(shape))

    def sections(self, shape: BlockShape) -> tuple[Section, ...]:
        L, H = shape.layers, shape.kv_heads
        code_bytes = shape.head_dim * self.bits // 8
        out = [Section("codes", "u8", (L, 2, H, shape.block_size, code_bytes))]
        for kv, groups in (("k", self.key_groups(shape)), ("v", self.value_groups(shape))):
            out.append(Section(f"{kv}_scale", "fp16", (L, H, groups)))
            if self.asymmetric:
                out.append(Section(f"{kv}_zero", "fp16", (L, H, groups)))
        return tuple(out)

    # -- the reference ------------------------------------------------------------------------

    def _grouped(self, x: torch.Tensor, kv: int) -> tuple[torch.Tensor, int]:
        """``[n, L, H, B, D]`` -> a view whose axis ``dim`` runs along each group: the tokens
        (axis -2, no transpose) for per-channel keys, else groups of the head dimension."""
        n, L, H, B, D = x.shape
        if kv == 0 and self.key_per_channel:
            return x, -2
        g = self.group_size or D
        return x.reshape(n, L, H, B, D // g, g), -1

    def _quantize(
        self, groups: torch.Tensor, dim: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes (as floats), scales and zero points of groups along axis ``dim``."""
        torch = torch_module()
        if self.asymmetric:
            levels = float(2**self.bits - 1)
            mn = groups.amin(dim, keepdim=True)
            mx = groups.amax(dim, keepdim=True)
            s = _fp16_round((mx - mn) * float(np.float32(1.0 / levels)))
            z = _fp16_round(mn)
            q = (groups - z).div_(torch.where(s > 0, s, 1.0))
            return q.round_().clamp_(0, levels), s, z
        qmax = float(2 ** (self.bits - 1) - 1)
        # max|x| from the two extremes (no |x| temporary); abs() keeps a zero group's scale +0
        amax = torch.maximum(
            groups.amax(dim, keepdim=True).abs(), groups.amin(dim, keepdim=True).abs()
        )
        s = _fp16_round(amax * float(np.float32(1.0 / qmax)))
        q = groups / torch.where(s > 0, s, 1.0)
        return q.round_().clamp_(-qmax, qmax), s, None

    def _encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        torch = torch_module()
        x = blocks.float()
        if self.rotate:
            x = rotated(x)  # |x| stays within max |blocks|
        n, L, _, H, B, D = x.shape
        parts = {}
        if not self.key_per_channel:
            # K and V grouped alike: quantize both in one pass.
            g = self.group(BlockShape(L, H, B, D))
            q, s, z = self._quantize(x.reshape(n, L, 2, H, B, D // g, g))
            for kv, name in ((0, "k"), (1, "v")):
                parts[f"{name}_scale"] = s[:, :, kv].reshape(n, L, H, -1)
                if z is not None:
                    parts[f"{name}_zero"] = z[:, :, kv].reshape(n, L, H, -1)
            parts["codes"] = self._pack_codes(q.reshape(n, L, 2, H, B, D))
            return parts
        codes = torch.empty((n, L, 2, H, B, D * self.bits // 8), dtype=torch.uint8, device=x.device)
        for kv, name in ((0, "k"), (1, "v")):
            q, s, z = self._quantize(*self._grouped(x[:, :, kv], kv))
            parts[f"{name}_scale"] = s.reshape(n, L, H, -1)
            if z is not None:
                parts[f"{name}_zero"] = z.reshape(n, L, H, -1)
            codes[:, :, kv] = self._pack_codes(q.reshape(n, L, H, B, D))
        parts["codes"] = codes
        return parts

    def _decode(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        x = self._dequantize(parts, shape)
        if not self.rotate:
            return x
        # +0: zeros come out +0, as the rotation leaves them (a group then has one minimum)
        return unrotated(x).clamp_(-_FP16_MAX, _FP16_MAX).add_(0.0)

    def _dequantize(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        torch = torch_module()
        q = self._unpack_codes(parts["codes"])  # [n, L, 2, H, B, D] fp32
        n = q.shape[0]
        L, _, H, B, D = shape.dims
        if not self.key_per_channel:  # K and V grouped alike: one pass, in place
            g = self.group(shape)
            groups = q.view(n, L, 2, H, B, D // g, g)
            groups.mul_(
                torch.stack((parts["k_scale"], parts["v_scale"]), 2)
                .float()
                .view(n, L, 2, H, B, D // g, 1)
            )
            if self.asymmetric:
                groups.add_(
                    torch.stack((parts["k_zero"], parts["v_zero"]), 2)
                    .float()
                    .view(n, L, 2, H, B, D // g, 1)
                )
            return q
        for kv, name in ((0, "k"), (1, "v")):
            groups, dim = self._grouped(q[:, :, kv], kv)  # views into q: decode in place
            at = [*groups.shape]
            at[dim] = 1
            groups.mul_(parts[f"{name}_scale"].float().reshape(at))
            if self.asymmetric:
                groups.add_(parts[f"{name}_zero"].float().reshape(at))
        return q

    def _pack_codes(self, q: torch.Tensor) -> torch.Tensor:
        torch = torch_module()
        bits = self.bits
        if bits == 8:
            return q.to(torch.uint8) if self.asymmetric else q.to(torch.int8).view(torch.uint8)
        per_byte = 8 // bits
        small = q.to(torch.int16) & ((1 << bits) - 1)  # two's complement when symmetric
        packed = small[..., 0::per_byte]
        for j in range(1, per_byte):
            packed = packed | (small[..., j::per_byte] << (bits * j))
        return packed.to(torch.uint8)

    def _unpack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        torch = torch_module()
        bits = self.bits
        if bits == 8:
            return (codes if self.asymmetric else codes.view(torch.int8)).float()
        per_byte, mask = 8 // bits, (1 << bits) - 1
        fields = [codes & mask]
        fields += [(codes >> (bits * j)) & mask for j in range(1, per_byte - 1)]
        fields.append(codes >> (bits * (per_byte - 1)))  # the top field needs no mask
        small = torch.stack(fields, dim=-1).flatten(-2)
        if not self.asymmetric:  # sign-extend the two's complement field
            sign = 1 << (bits - 1)
            return small.view(torch.int8).bitwise_xor_(sign).float().sub_(sign)
        return small.float()


class Int8Codec(QuantCodec):
    """``int8``: one fp16 scale per token and head (symmetric by default; the asymmetric form
    adds an fp16 zero point and measured no better on real K/V, see docs/codecs.md)."""

    def __init__(
        self, *, asymmetric: bool = False, group_size: int | None = None, name: str = "int8"
    ) -> None:
        super().__init__(
            name, 8, asymmetric=asymmetric, key_per_channel=False, group_size=group_size
        )


#: Values per group of the ``int4`` codec's values (measured on SmolLM2, docs/codecs.md).
INT4_GROUP_SIZE = 32


class Int4Codec(QuantCodec):
    """``int4``, KIVI-style: keys per channel along the block's tokens, values per token in
    groups of ``group_size``; asymmetric, fp16 scale and zero point per group."""

    def __init__(
        self,
        *,
        group_size: int | None = INT4_GROUP_SIZE,
        key_per_channel: bool = True,
        asymmetric: bool = True,
        rotate: bool = False,
        name: str = "int4",
    ) -> None:
        super().__init__(
            name,
            4,
            asymmetric=asymmetric,
            key_per_channel=key_per_channel,
            group_size=group_size,
            rotate=rotate,
        )


#: Values per group of the ``int2`` codec's values (measured on SmolLM2, docs/codecs.md).
INT2_GROUP_SIZE = 32


class Int2Codec(QuantCodec):
    """``int2``, KIVI-style like ``int4`` at 2 bits: keys per channel along the block's tokens,
    values per token in groups of ``group_size``; asymmetric, fp16 scale and zero point per
    group; four codes a byte (head_dim must be a multiple of 4)."""

    def __init__(
        self,
        *,
        group_size: int | None = INT2_GROUP_SIZE,
        key_per_channel: bool = True,
        asymmetric: bool = True,
        rotate: bool = False,
        name: str = "int2",
    ) -> None:
        super().__init__(
            name,
            2,
            asymmetric=asymmetric,
            key_per_channel=key_per_channel,
            group_size=group_size,
            rotate=rotate,
        )
