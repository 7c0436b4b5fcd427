"""Codecs as a user meets them, on the CPU with the torch reference: the byte layout of each
format, round trips, the documented rounding rule (checked against an independent re-implementation
written here from quant.py's docstring), KIVI key grouping, transcoding, slot-addressed pools,
argument checks that leave pools untouched, DLPack inputs, the registry with its entry points,
learned codecs and the simulator's byte counts."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtier.codecs as codecs  # noqa: E402
from kvtier.codecs import (  # noqa: E402
    BlockShape,
    Codec,
    Encoded,
    IdentityCodec,
    Int2Codec,
    Int4Codec,
    Int8Codec,
    QuantCodec,
    available_codecs,
    get_codec,
    register_codec,
    rescan_entry_points,
    unregister_codec,
)
from kvtier.codecs.learned import LearnedCodec, LinearCompressor, fit_pca  # noqa: E402
from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.errors import ConfigError, InvalidArgumentError, PayloadError  # noqa: E402
from kvtier.shapes import model_shape  # noqa: E402

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
F32 = np.float32
FP16_STEP = 2.0**-24  # the smallest fp16 subnormal


def blocks(n: int, shape: BlockShape, dtype: Any = torch.float16, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape.dims), generator=g).to(dtype)


def cosine_per_block(a: Any, b: Any) -> Any:
    a, b = a.double().flatten(1), b.double().flatten(1)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


# ---- 1. layout ----------------------------------------------------------------------------------

LAYOUT_SHAPES = [BlockShape(30, 3, 16, 64), BlockShape(32, 8, 16, 128)]


@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=str)
def test_bytes_per_block_match_the_closed_forms_and_the_encoded_rows(shape: BlockShape) -> None:
    L, H, B, D = shape.layers, shape.kv_heads, shape.block_size, shape.head_dim
    expected = {
        "int8": L * H * 2 * B * (D + 2),
        "int4": L * H * (B * D + 4 * D + 4 * B * (D // 32)),
        "int2": L * H * (B * D // 2 + 4 * D + 4 * B * (D // 32)),
        "int2-g64": L * H * (B * D // 2 + 4 * D + 4 * B * (D // 64)),
        "fp16": 2 * L * 2 * H * B * D,
        "bf16": 2 * L * 2 * H * B * D,
        "fp32": 4 * L * 2 * H * B * D,
    }
    x = blocks(1, shape)
    for name, want in expected.items():
        codec = get_codec(name)
        assert codec.bytes_per_block(shape) == want, name
        enc = codec.encode(x)
        assert enc.data.dtype == torch.uint8
        assert tuple(enc.data.shape) == (1, want), name
        assert enc.nbytes == want


def test_int8_int4_and_int2_compress_against_fp16() -> None:
    shape = BlockShape(32, 8, 16, 128)
    fp16 = get_codec("fp16").bytes_per_block(shape)
    assert fp16 == shape.fp16_bytes
    assert get_codec("int8").bytes_per_block(shape) / fp16 < 0.55
    # int4 is 11/32 of fp16 at 16-token blocks: per-channel key scales and zero points cost
    # 4 * head_dim bytes per (layer, head), a quarter of the key codes
    assert get_codec("int4").bytes_per_block(shape) / fp16 == 11 / 32
    assert get_codec("int4").bytes_per_block(shape) / fp16 < 0.35
    assert get_codec("int4").bytes_per_block(BlockShape(32, 8, 32, 128)) / (2 * fp16) < 0.32
    # int2 holds the aggressive ladder's bottom under a quarter of fp16, scales included: 56 of
    # fp16's 256 bytes a (token, head, layer) at head_dim 64, 52 with values grouped by 64
    assert get_codec("int2").bytes_per_block(shape) / fp16 == 7 / 32
    assert get_codec("int2-g64").bytes_per_block(shape) / fp16 == 13 / 64


def test_bytes_per_block_follow_the_group_size_and_refuse_unpackable_shapes() -> None:
    assert Int4Codec(group_size=64).bytes_per_block(BlockShape(2, 2, 16, 128)) == 2 * 2 * (
        16 * 128 + 4 * 128 + 4 * 16 * 2
    )
    with pytest.raises(InvalidArgumentError, match="group_size"):
        Int4Codec(group_size=32).bytes_per_block(BlockShape(2, 2, 16, 48))


@pytest.mark.parametrize(
    ("make", "head_dim", "listed", "call"),
    [
        (Int4Codec, 10, "2, 10", "get_codec('int4', group_size=10)"),
        (Int4Codec, 6, "2, 6", "get_codec('int4', group_size=6)"),
        (Int4Codec, 48, "2, 4, 6, 8, 12, 16, 24, 48", "get_codec('int4', group_size=24)"),
        (
            lambda: Int4Codec(asymmetric=False, key_per_channel=False, group_size=16),
            20,
            "2, 4, 10, 20",
            "get_codec('int4', group_size=10, asymmetric=False, key_per_channel=False)",
        ),
        (lambda: Int8Codec(group_size=32), 20, "2, 4, 10, 20", "get_codec('int8', group_size=20)"),
        (Int2Codec, 48, "2, 4, 6, 8, 12, 16, 24, 48", "get_codec('int2', group_size=24)"),
        (
            lambda: Int2Codec(key_per_channel=False, group_size=16),
            20,
            "2, 4, 10, 20",
            "get_codec('int2', group_size=10, key_per_channel=False)",
        ),
    ],
    ids=[
        "int4-head10",
        "int4-head6",
        "int4-head48",
        "int4-sym-tok-g16-head20",
        "int8-g32-head20",
        "int2-head48",
        "int2-tok-g16-head20",
    ],
)
def test_a_group_size_that_does_not_divide_head_dim_says_which_do_and_how_to_use_one(
    make: Callable[[], QuantCodec], head_dim: int, listed: str, call: str
) -> None:
    """A small head (head_dim 10 under int4's groups of 32) is refused with the group sizes
    that fit it and code that builds such a codec, for get_codec and for a ladder; both work."""
    shape = BlockShape(2, 2, 16, head_dim)
    codec = make()
    with pytest.raises(InvalidArgumentError) as info:
        codec.bytes_per_block(shape)
    message = str(info.value)
    assert f"one of {listed}, None (the whole head);" in message
    # each listed size packs the shape; every other even size does not
    for size in [*range(2, head_dim + 1, 2), None]:
        if size is None or str(size) in listed.split(", "):
            assert type(codec)(group_size=size).bytes_per_block(shape) > 0
        else:
            with pytest.raises(InvalidArgumentError):
                type(codec)(group_size=size).bytes_per_block(shape)
    # the advice is code that runs: the codec it names packs the shape with the same options
    assert call in message
    suggested = eval(call, {"get_codec": get_codec})
    assert suggested.bytes_per_block(shape) > 0
    assert (suggested.asymmetric, suggested.key_per_channel) == (
        codec.asymmetric,
        codec.key_per_channel,
    )
    registration = re.search(r"register_codec\((.*)\), then ladder=\(\.\.\., '([^']+)'\)", message)
    assert registration, message
    name = registration.group(2)
    try:
        eval(
            f"register_codec({registration.group(1)})",
            {
                "register_codec": register_codec,
                "Int2Codec": Int2Codec,
                "Int4Codec": Int4Codec,
                "Int8Codec": Int8Codec,
            },
        )
        assert get_codec(name).bytes_per_block(shape) == suggested.bytes_per_block(shape)
        assert KvtierConfig(ladder=("fp16", name)).ladder == ("fp16", name)
    finally:
        unregister_codec(name)


# ---- 2. round trips -----------------------------------------------------------------------------

SMALL = BlockShape(2, 2, 16, 64)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_identity_codecs_are_lossless_in_their_own_dtype(dtype: str) -> None:
    codec = get_codec(dtype)
    assert codec.lossless
    x = blocks(3, SMALL, TORCH_DTYPES[dtype], seed=1) * 7
    enc = codec.encode(x)
    assert enc.format == dtype and enc.shape.dtype == dtype
    out = codec.decode(enc)
    assert out.dtype == x.dtype
    assert torch.equal(out, x)


@pytest.mark.parametrize(
    ("codec", "min_cos"),
    # int2 on Gaussian blocks: four levels over each group's range keep about 0.94
    [(Int8Codec(), 0.999), (Int4Codec(), 0.99), (Int2Codec(), 0.93)],
    ids=["int8", "int4", "int2"],
)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_quantized_round_trips_keep_each_block_close(
    codec: QuantCodec, min_cos: float, dtype: str
) -> None:
    x = blocks(4, SMALL, TORCH_DTYPES[dtype], seed=2)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.dtype == x.dtype  # decode defaults to the dtype the blocks came in
    assert out.shape == x.shape
    assert (cosine_per_block(out, x) >= min_cos).all()
    out32 = codec.decode(enc, dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert (cosine_per_block(out32, x) >= min_cos).all()
    # the model-dtype result is the fp32 one rounded once
    assert torch.equal(out32.to(x.dtype), out)


# ---- 3. the rounding rule, re-implemented from quant.py's docstring -----------------------------


def fp16(v: Any) -> np.float16:
    """fp16(): round to nearest even after clamping to +-65504."""
    return np.float16(np.clip(F32(v), F32(-65504.0), F32(65504.0)))


def reference_quantize(codec: QuantCodec, x: np.ndarray) -> dict[str, Any]:
    """Plain numpy, one group at a time: codes [n, L, 2, H, B, D] (int64), scales and zero
    points [n, L, H, groups] (float16), the fp32 decode, and how often the clamp and a
    round-half-to-even tie decided a code."""
    n, L, _, H, B, D = x.shape
    g = D if codec.group_size is None else codec.group_size
    asym = codec.asymmetric
    if asym:
        lo, hi = 0.0, float(2**codec.bits - 1)
        inv = F32(1) / F32(hi)
    else:
        hi = float(2 ** (codec.bits - 1) - 1)
        lo = -hi
        inv = F32(1) / F32(hi)
    codes = np.zeros(x.shape, dtype=np.int64)
    decoded = np.zeros(x.shape, dtype=np.float32)
    groups_of = {0: D if codec.key_per_channel else B * (D // g), 1: B * (D // g)}
    scales = {kv: np.zeros((n, L, H, groups_of[kv]), dtype=np.float16) for kv in (0, 1)}
    zeros = {kv: np.zeros((n, L, H, groups_of[kv]), dtype=np.float16) for kv in (0, 1)}
    clamped = ties = 0
    for i in range(n):
        for layer in range(L):
            for kv in (0, 1):
                for h in range(H):
                    tile = x[i, layer, kv, h]  # [B, D] float32
                    if kv == 0 and codec.key_per_channel:
                        index = [(slice(None), d) for d in range(D)]
                    else:
                        index = [
                            (b, slice(j * g, (j + 1) * g)) for b in range(B) for j in range(D // g)
                        ]
                    for gi, where in enumerate(index):
                        vals = tile[where].astype(np.float32)
                        if asym:
                            mn, mx = vals.min(), vals.max()
                            s = fp16(F32(mx - mn) * inv)
                            z = fp16(mn)
                            shifted = vals - F32(z)
                        else:
                            s = fp16(F32(np.abs(vals).max()) * inv)
                            z = np.float16(0)
                            shifted = vals
                        s_div = F32(s) if F32(s) > 0 else F32(1)
                        raw = shifted / s_div  # one fp32 division per value
                        r = np.rint(raw)  # half to even
                        ties += int(np.count_nonzero(np.abs(raw - np.floor(raw)) == 0.5))
                        clamped += int(np.count_nonzero((r < lo) | (r > hi)))
                        q = np.clip(r, lo, hi)
                        codes[i, layer, kv, h][where] = q.astype(np.int64)
                        dec = q.astype(np.float32) * F32(s)
                        if asym:
                            dec = dec + F32(z)
                        decoded[i, layer, kv, h][where] = dec
                        scales[kv][i, layer, h, gi] = s
                        zeros[kv][i, layer, h, gi] = z
    return {
        "codes": codes,
        "k_scale": scales[0],
        "v_scale": scales[1],
        "k_zero": zeros[0],
        "v_zero": zeros[1],
        "decoded": decoded,
        "clamped": clamped,
        "ties": ties,
    }


def split_row(codec: QuantCodec, shape: BlockShape, data: Any) -> dict[str, np.ndarray]:
    """The sections of packed rows as the kernel source documents them: codes [L, 2, H, B,
    D*bits/8] (8/bits codes a byte, low bits first: element per*i + j of a row at bits
    bits*j.. of byte i), then k_scale, k_zero (if asymmetric), v_scale, v_zero, fp16
    [L, H, groups]; codes returned unpacked as integers."""
    rows = data.numpy()
    n = rows.shape[0]
    L, H, B, D = shape.layers, shape.kv_heads, shape.block_size, shape.head_dim
    g = D if codec.group_size is None else codec.group_size
    code_bytes = L * 2 * H * B * D * codec.bits // 8
    raw = rows[:, :code_bytes].reshape(n, L, 2, H, B, D * codec.bits // 8)
    bits, per = codec.bits, 8 // codec.bits
    field = np.empty((*raw.shape[:-1], D), dtype=np.int64)
    for j in range(per):
        field[..., j::per] = (raw.astype(np.int64) >> (bits * j)) % 2**bits
    top = 2 ** (bits - 1)  # two's complement: fields from `top` up are negative
    codes = field if codec.asymmetric else np.where(field >= top, field - 2**bits, field)
    out = {"codes": codes}
    at = code_bytes
    for kv, groups in (("k", D if codec.key_per_channel else B * (D // g)), ("v", B * (D // g))):
        names = [f"{kv}_scale"] + ([f"{kv}_zero"] if codec.asymmetric else [])
        for name in names:
            size = L * H * groups * 2
            out[name] = rows[:, at : at + size].copy().view(np.float16).reshape(n, L, H, groups)
            at += size
    assert at == rows.shape[1], "sections do not fill the row"
    return out


EDGE_SHAPE = BlockShape(2, 11, 8, 64)  # 44 (layer, kv, head) tiles of 8 tokens x 64 channels


def pattern(B: int, D: int, high: float, low: float, rng: np.random.Generator, fill: Any) -> Any:
    """Every token's group and every channel holds both ``high`` and ``low``."""
    b, d = np.meshgrid(np.arange(B), np.arange(D), indexing="ij")
    t = fill(rng, (B, D)).astype(np.float64)
    t[(b + d) % 7 == 0] = high
    t[(b + d) % 7 == 3] = low
    return t


def edge_tiles(dtype: str, rng: np.random.Generator, top: float) -> dict[str, np.ndarray]:
    B, D = EDGE_SHAPE.block_size, EDGE_SHAPE.head_dim

    def normal(r: np.random.Generator, size: Any) -> Any:
        return r.standard_normal(size)

    def uniform(r: np.random.Generator, size: Any) -> Any:
        return r.uniform(-1, 1, size)

    def subnormal_scale(levels: float, symmetric: bool) -> np.ndarray:
        # a group whose exact scale is 1.4 fp16 subnormal steps: fp16 rounds it to 1 step, so
        # the largest values need codes beyond the range and the clamp decides them
        a = 1.4 * levels * FP16_STEP / (1 if symmetric else 2)
        return pattern(B, D, a, -a, rng, lambda r, s: a * uniform(r, s))

    def halves(top: int) -> np.ndarray:
        # with max `top` and min 0 the scale is 1, so k + 0.5 lands on a tie
        return pattern(B, D, top, 0.0, rng, lambda r, s: r.integers(0, top, s) + 0.5)

    outlier = normal(rng, (B, D))
    outlier[:, 5] *= 100
    outlier[3] *= 50
    huge = normal(rng, (B, D)) * 1e6
    if dtype == "fp16":
        huge = huge / 30
    huge = np.clip(huge, -top, top)  # the codec's range: encode refuses more
    return {
        "normal": normal(rng, (B, D)),
        "normal_x10": 10 * normal(rng, (B, D)),
        "zeros": np.zeros((B, D)),
        "const_exact": np.full((B, D), 1.5),
        "const_inexact": np.full((B, D), -0.3),
        "tiny": 1e-7 * uniform(rng, (B, D)),
        # small enough that even int2's scale (amax / 1) underflows; one sign, so that no group
        # of fp16 inputs mixes -0.0 and 0.0 (which one min() returns is not the rule's business)
        "tinier": 1e-8 * np.abs(uniform(rng, (B, D))),
        "outlier": outlier,
        "sub_int8_sym": subnormal_scale(127, True),
        "sub_int4_sym": subnormal_scale(7, True),
        "sub_int8_asym": subnormal_scale(255, False),
        "sub_int4_asym": subnormal_scale(15, False),
        "sub_int2_sym": subnormal_scale(1, True),
        "sub_int2_asym": subnormal_scale(3, False),
        "huge": huge,
        "ties_3": halves(3),
        "ties_7": halves(7),
        "ties_15": halves(15),
        "ties_127": halves(127),
        "ties_255": halves(255),
        "negative": -np.abs(normal(rng, (B, D))) - 2,
        "positive": np.abs(normal(rng, (B, D))) + 2,
    }


def edge_blocks(
    dtype: str, seed: int = 0, top: float = 65504.0
) -> tuple[Any, dict[str, tuple[int, int, int]]]:
    """One block of EDGE_SHAPE whose tiles are the edge cases, and where each case sits;
    ``top``: the largest magnitude the codec holds (:meth:`Codec.max_magnitude`)."""
    rng = np.random.default_rng(seed)
    L, _, H, B, D = EDGE_SHAPE.dims
    x = rng.standard_normal((1, L, 2, H, B, D))
    where = {}
    coords = [(layer, kv, h) for layer in range(L) for kv in (0, 1) for h in range(H)]
    cases = list(edge_tiles(dtype, rng, top).items())
    # every case once as keys and once as values
    for k, (name, tile) in enumerate(cases):
        for kv in (0, 1):
            layer, h = divmod(k, H)
            layer %= L
            x[0, layer, kv, h] = tile
            where[f"{name}/{'kv'[kv]}"] = (layer, kv, h)
    assert len(cases) <= len(coords) // 2
    return torch.from_numpy(x.astype(np.float32)).to(TORCH_DTYPES[dtype]), where


QUANT_CODECS = {
    "int8": lambda: Int8Codec(),
    "int8-asym": lambda: Int8Codec(asymmetric=True),
    "int8-g32": lambda: Int8Codec(group_size=32),
    "int4": lambda: Int4Codec(),
    "int4-g64": lambda: Int4Codec(group_size=64),
    "int4-sym": lambda: Int4Codec(asymmetric=False),
    "int4-tok-head": lambda: Int4Codec(key_per_channel=False, group_size=None),
    "int2": lambda: Int2Codec(),
    "int2-g64": lambda: Int2Codec(group_size=64),
    "int2-sym": lambda: Int2Codec(asymmetric=False),
    "int2-tok-g16": lambda: Int2Codec(key_per_channel=False, group_size=16),
}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("which", list(QUANT_CODECS))
def test_codes_and_scales_follow_the_documented_rounding_rule(which: str, dtype: str) -> None:
    codec = QUANT_CODECS[which]()
    # the largest value of the dtype within the codec's range (bf16 rounds 65504 up)
    top = float(torch.tensor(codec.max_magnitude(dtype)).to(TORCH_DTYPES[dtype]))
    if top > codec.max_magnitude(dtype):
        top = 65280.0  # the bf16 below 65504
    x, where = edge_blocks(dtype, top=top)
    shape = BlockShape.of(x)
    ref = reference_quantize(codec, x.float().numpy())
    enc = codec.encode(x)
    got = split_row(codec, shape, enc.data)

    np.testing.assert_array_equal(got["codes"], ref["codes"])
    sections = ["k_scale", "v_scale"] + (["k_zero", "v_zero"] if codec.asymmetric else [])
    for name in sections:
        # bit-exact, not merely equal as numbers (-0.0 and 0.0 differ)
        np.testing.assert_array_equal(got[name].view(np.uint16), ref[name].view(np.uint16), name)
    decoded = codec.decode(enc, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(decoded, ref["decoded"])
    # in the model dtype: the same values, saturating at fp16's largest rather than inf
    saturated = np.clip(ref["decoded"], -65504, 65504) if dtype == "fp16" else ref["decoded"]
    assert torch.equal(codec.decode(enc), torch.from_numpy(saturated).to(x.dtype))

    # the edge cases really were exercised
    # (symmetric int2's scale is amax * 1, fp16-rounded by less than half: within the range
    # no code rounds past 1)
    exact_scale = codec.bits == 2 and not codec.asymmetric
    assert ref["clamped"] > 0 or exact_scale, "no value hit the clamp"
    if dtype == "fp32":
        assert ref["ties"] > 0, "no value landed on a rounding tie"

    def tile(name: str, part: np.ndarray) -> np.ndarray:
        layer, kv, h = where[name]
        return part[0, layer, kv, h]

    for kv in "kv":
        layer, _, h = where[f"zeros/{kv}"]
        assert (got[f"{kv}_scale"][0, layer, h] == 0).all()
        assert (tile(f"zeros/{kv}", got["codes"]) == 0).all()
        assert (tile(f"zeros/{kv}", decoded) == 0).all()
        if codec.asymmetric:
            assert (got[f"{kv}_zero"][0, layer, h] == 0).all()

        # amax ~1e-8: the fp16 scale underflows to 0 and every code is 0
        layer, _, h = where[f"tinier/{kv}"]
        assert (got[f"{kv}_scale"][0, layer, h] == 0).all()
        assert (tile(f"tinier/{kv}", got["codes"]) == 0).all()

        layer, _, h = where[f"const_exact/{kv}"]
        if codec.asymmetric:
            # a constant group: no spread, the zero point is the value and decodes exactly
            assert (got[f"{kv}_zero"][0, layer, h] == np.float16(1.5)).all()
            assert (got[f"{kv}_scale"][0, layer, h] == 0).all()
            assert (tile(f"const_exact/{kv}", got["codes"]) == 0).all()
            assert (tile(f"const_exact/{kv}", decoded) == 1.5).all()
        else:
            assert (tile(f"const_exact/{kv}", got["codes"]) == 2 ** (codec.bits - 1) - 1).all()


# ---- 4. packing: int4 nibbles, int2 fields --------------------------------------------------


def packed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes along the last axis as the format spells them: element ``per * i + j`` at bits
    ``bits * j`` .. of byte ``i``, low bits first (int4: element 2i in the low nibble)."""
    per = 8 // bits
    fields = codes.astype(np.int64) % 2**bits  # two's complement for negative codes
    out = np.zeros((*codes.shape[:-1], codes.shape[-1] // per), dtype=np.int64)
    for i in range(out.shape[-1]):
        for j in range(per):
            out[..., i] |= fields[..., per * i + j] << (bits * j)
    return out.astype(np.uint8)


@pytest.mark.parametrize("make", [Int4Codec, Int2Codec], ids=["int4", "int2"])
def test_packed_codes_put_the_lower_channel_in_the_lower_bits(
    make: Callable[[], QuantCodec],
) -> None:
    codec = make()  # keys per channel, values per token in groups of 32, asymmetric
    n = 2**codec.bits  # codes 0 .. n - 1
    shape = BlockShape(1, 1, 16, 64)
    d, b = np.arange(64)[None, :], np.arange(16)[:, None]
    code = (d + b) % n  # every channel (down the tokens) and every group spans 0 .. n - 1
    x = torch.zeros((1, *shape.dims), dtype=torch.float16)
    # keys: channel d holds d + code, so per channel min d, max d + n - 1, scale 1, zero d
    x[0, 0, 0, 0] = torch.from_numpy(d + code)
    # values: token b holds the code itself (scale 1, zero 0)
    x[0, 0, 1, 0] = torch.from_numpy(code)
    enc = codec.encode(x)
    row = enc.data[0].numpy()
    tile_bytes = 16 * 64 * codec.bits // 8
    k_codes = row[:tile_bytes].reshape(16, -1)
    v_codes = row[tile_bytes : 2 * tile_bytes].reshape(16, -1)
    np.testing.assert_array_equal(k_codes, packed(code, codec.bits))
    np.testing.assert_array_equal(v_codes, packed(code, codec.bits))
    if codec.bits == 2:  # spelled out: byte 0 of token 1 holds codes 1, 2, 3, 0 from bit 0 up
        assert v_codes[1, 0] == 1 | 2 << 2 | 3 << 4 | 0 << 6
    assert torch.equal(codec.decode(enc), x)  # integers up to 78 are exact in every step


@pytest.mark.parametrize(
    ("make", "vals"),
    [
        (Int4Codec, [-7, 7, -1, 0, 3, -4, 5, -6, 1, 2, -2, -3, 4, -5, 6, 0]),
        (Int2Codec, [-1, 1, 0, -1, 1, 1, 0, 0, -1, 0, 1, -1, 0, -1, -1, 1]),
    ],
    ids=["int4", "int2"],
)
def test_symmetric_codes_are_twos_complement_fields(
    make: Callable[..., QuantCodec], vals: list[int]
) -> None:
    codec = make(asymmetric=False, key_per_channel=False, group_size=None)
    qmax = 2 ** (codec.bits - 1) - 1
    x = torch.tensor(vals, dtype=torch.float16).reshape(1, 1, 1, 1, 1, 16)
    x = x.expand(1, 1, 2, 1, 1, 16).contiguous()
    enc = codec.encode(x)  # amax = qmax: scale fp16(qmax * fp32(1/qmax)) = 1, code = value
    codes = enc.data[0, : 16 * codec.bits // 8].numpy()
    np.testing.assert_array_equal(codes, packed(np.array(vals), codec.bits))
    assert max(vals) == qmax and -qmax in vals
    assert torch.equal(codec.decode(enc), x)


# ---- 5. KIVI: keys grouped per channel ----------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "bound"),
    # about range / levels / sqrt(12) for 16 normal samples (range ~3.5)
    [(Int4Codec, 0.15), (Int2Codec, 0.4)],
    ids=["int4", "int2"],
)
def test_kivi_groups_keys_per_channel_so_an_outlier_channel_stays_contained(
    make: Callable[..., QuantCodec], bound: float
) -> None:
    shape = BlockShape(2, 2, 16, 64)
    x = blocks(2, shape, torch.float32, seed=5)
    outlier = 17
    x[:, :, 0, :, :, outlier] *= 100  # keys only
    others = [d for d in range(64) if d != outlier]

    def key_error(codec: Codec) -> float:
        out = codec.decode(codec.encode(x), dtype=torch.float32)
        err = (out - x)[:, :, 0][..., others]
        return float(err.pow(2).mean().sqrt())

    per_channel = key_error(make())
    per_token = key_error(make(key_per_channel=False, group_size=None))
    assert per_channel * 5 <= per_token, (per_channel, per_token)
    assert per_channel < bound


def test_rotated_int2_is_int2_of_the_hadamard_rotated_vectors_and_holds_outliers_better() -> None:
    from kvtier.codecs.rotation import hadamard as _hadamard

    shape = BlockShape(2, 2, 16, 64)
    x = blocks(2, shape, torch.float32, seed=6)
    x[:, :, 1, ..., 9] *= 30  # an outlier channel of values: a 2-bit per-token group cannot
    rot, plain = get_codec("int2-rot"), get_codec("int2")
    h = _hadamard(64, "cpu")
    assert bool((h.abs() == 1).all())
    torch.testing.assert_close(h @ h.T, 64 * torch.eye(64), atol=0, rtol=0)
    got = rot.decode(rot.encode(x), dtype=torch.float32)
    want = plain.decode(plain.encode(x @ h / 64), dtype=torch.float32) @ h.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert rot.bytes_per_block(shape) == plain.bytes_per_block(shape)
    err = {
        c.name: float((c.decode(c.encode(x), dtype=torch.float32) - x)[:, :, 1].norm())
        for c in (rot, plain)
    }
    assert err["int2-rot"] < 0.85 * err["int2"], err
    with pytest.raises(PayloadError):  # another format: never decoded as plain int2
        plain.decode(rot.encode(x))
    # version 1 rotated by H / sqrt(D) (issue 41): its bytes are refused, not read sqrt(D) off
    with pytest.raises(PayloadError, match="v1"):
        rot.decode(dataclasses.replace(rot.encode(x), version=1))
    with pytest.raises(InvalidArgumentError, match="not a power of two"):
        rot.bytes_per_block(BlockShape(2, 2, 16, 96))
    assert rot.has_kernels and rot.has_native  # every implementation rotates


def half_steps(codec: QuantCodec, y: Any) -> Any:
    """The unrotated asymmetric codec's bound on ``|y' - y|`` for each value of ``y`` (float64
    ``[n, L, 2, H, B, D]``): half a step of its group, ``(max - min) / (2 * levels)``, plus the
    fp16 rounding of the group's scale and zero point (a few ulps of its magnitude) and fp32
    sums (the codec's ``x @ H``)."""
    assert codec.asymmetric
    levels = 2**codec.bits - 1
    n, L, _, H, B, D = y.shape
    g = codec.group(BlockShape(L, H, B, D))

    def bound(groups: Any, dim: int) -> Any:
        mn, mx = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
        fp16 = 2.0**-10 * (mn.abs() + (mx - mn))
        fp32 = 2.0**-22 * D * torch.maximum(mn.abs(), mx.abs())
        return ((mx - mn) / (2 * levels) + fp16 + fp32).expand_as(groups)

    out = torch.empty_like(y)
    for kv in (0, 1):
        part = y[:, :, kv]
        if kv == 0 and codec.key_per_channel:  # groups along the block's tokens
            out[:, :, kv] = bound(part, -2)
        else:
            out[:, :, kv] = bound(part.reshape(n, L, H, B, D // g, g), -1).reshape(part.shape)
    return out


FP16_MAX = 65504.0


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "int4-g64", "int2-g64", "int2-rot"])
def test_a_block_at_fp16s_largest_values_decodes_finite(name: str) -> None:
    """fp16 holds 65504, so append takes it; a scale rounded up to fp16 put the decoded codes
    just past it (127 * 516 = 65532), which the fp16 output held as inf: clamped now, in
    decode, in one layer's decode (attention's reference) and in a BlockManager's gather."""
    from kvtier import BlockManager, KvtierConfig

    shape = BlockShape(2, 2, 16, 64, "fp16")
    g = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (3, *shape.dims), generator=g) * 2 - 1
    x = (signs * 65504.0).half()
    codec = get_codec(name)
    encoded = codec.encode(x)
    for got in (codec.decode(encoded), codec.decode_layer(encoded.data, shape, 1)):
        assert torch.isfinite(got).all()
    out = codec.decode(encoded)
    if not codec.rotate:  # a constant magnitude: every code at the end of its range, exact
        assert torch.equal(out, x)
    bm = BlockManager(
        KvtierConfig(ladder=f"fp16,{name}", block_size=16, device_blocks=8, recent_window=0,
                     sink_blocks=0, compression_ratio=0.0),
        2, 2, 64, dtype="fp16", device="cpu",
    )  # fmt: skip
    seq = bm.add_sequence()
    tokens = x[:2].permute(1, 2, 0, 4, 3, 5).reshape(2, 2, 32, 2, 64)  # [L, kv, tokens, H, D]
    for layer in range(2):
        bm.append(seq, layer, tokens[layer, 0], tokens[layer, 1])
    bm.step()
    assert (bm.core.block_info(bm.core.sequence_blocks(seq))["level"] == 1).all()
    for layer in range(2):
        k, v = bm.gather(seq, layer)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()


@pytest.mark.parametrize("kind", ["constant", "fp16-max", "random"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", ["int2-rot", "int2-rot-g64", "int4-rot"])
def test_rotated_int2_keeps_the_unrotated_error_bound_for_every_input_in_its_range(
    name: str, head_dim: int, dtype: str, kind: str
) -> None:
    """Issue 41: a block of 10000.0 decoded to 8188 (K) and -11,572 .. 18,828 (V), and fp16-max
    blocks to ~87 % error or inf: the Hadamard rotation took a coherent vector sqrt(D) times
    past fp16, where the scales saturate. The rotated codec must quantize vectors no larger
    than its inputs, so that the unrotated codec's bound holds on them, rotated back."""
    from kvtier.codecs.rotation import hadamard as _hadamard

    codec = get_codec(name)
    assert isinstance(codec, QuantCodec)
    shape = BlockShape(2, 2, 16, head_dim, dtype)
    g = torch.Generator().manual_seed(head_dim)
    # the largest magnitude within the codec's range (fp16's) that the dtype holds
    top = 65280.0 if dtype == "bf16" else FP16_MAX
    if kind == "constant":
        x = torch.full((2, *shape.dims), 10000.0)
    elif kind == "fp16-max":
        signs = torch.randint(0, 2, (2, *shape.dims), generator=g) * 2.0 - 1
        x = signs * top
    else:
        x = torch.randn((2, *shape.dims), generator=g)
    x = x.to(TORCH_DTYPES[dtype])
    got = codec.decode(codec.encode(x)).double()  # in the model dtype: inf would show
    x = x.double()
    # within the codec's range, as the dtype rounds it (bf16: 65536)
    assert float(got.abs().max()) <= float(torch.tensor(FP16_MAX).to(TORCH_DTYPES[dtype]))
    err = got - x

    # the bound the unrotated codec keeps on what the rotated one quantizes, y = x H / D, for
    # each head vector: ||x' - x|| = sqrt(D) ||y' - y|| (H H^T = D I; clamping only helps)
    h = torch.sign(_hadamard(head_dim, "cpu")).double()
    y = x @ h / head_dim
    assert float(y.abs().max()) <= float(x.abs().max()) * (1 + 1e-12)
    bound = head_dim**0.5 * half_steps(codec, y).norm(dim=-1)
    assert bool((err.norm(dim=-1) <= bound).all()), float((err.norm(dim=-1) / bound).max())

    # what a user sees (measured 0.0008-0.0011, 0.25-0.28 and 0.36-0.40; before the fix
    # 0.55-0.87, inf and the same 0.36-0.40): a constant comes back within 1 % everywhere (no
    # sign flip), fp16-max values at int2's error on Gaussian data, ordinary data as before
    rel = float(err.norm() / x.norm())
    if kind == "constant":
        assert float(err.abs().max()) <= 100.0, float(err.abs().max())
    else:
        assert rel < (0.35 if kind == "fp16-max" else 0.45), rel


# ---- 6. transcode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "min_cos"),
    [
        ("int8", "int4", 0.99),
        ("int4", "int2", 0.93),
        ("int8", "int2", 0.93),
        ("int2", "int8", 0.93),
    ],
    ids=["int8-to-int4", "int4-to-int2", "int8-to-int2", "int2-to-int8"],
)
def test_transcode_equals_encoding_the_fp32_decode(src: str, dst: str, min_cos: float) -> None:
    a, b = get_codec(src), get_codec(dst)
    x = blocks(3, SMALL, seed=6)
    enc = a.encode(x)
    moved = a.transcode(enc, b)
    assert moved.format == b.format and moved.version == b.version
    assert moved.shape == enc.shape
    direct = b.encode(a.decode(enc, dtype=torch.float32))
    assert torch.equal(moved.data, direct.data)
    # and it reads back as an ordinary payload of the target, in the model dtype
    out = b.decode(moved)
    assert out.dtype == torch.float16
    assert (cosine_per_block(out, x) >= min_cos).all()


def test_transcode_to_and_from_fp16() -> None:
    int8, fp16 = Int8Codec(), get_codec("fp16")
    x = blocks(2, SMALL, seed=7)
    enc8 = int8.encode(x)
    up = int8.transcode(enc8, fp16)
    assert up.format == "fp16"
    assert torch.equal(fp16.decode(up), int8.decode(enc8))
    down = fp16.transcode(fp16.encode(x), int8)
    assert torch.equal(down.data, enc8.data)


# ---- 7. pools addressed by slots ----------------------------------------------------------------

SLOT_KINDS: dict[str, Callable[[list[int]], Any]] = {
    "numpy-int64": lambda s: np.array(s, dtype=np.int64),
    "numpy-int32": lambda s: np.array(s, dtype=np.int32),
    "list": lambda s: list(s),
    "torch-int64": lambda s: torch.tensor(s, dtype=torch.int64),
    "torch-int32": lambda s: torch.tensor(s, dtype=torch.int32),
}
POOL_SHAPE = BlockShape(2, 2, 8, 32)


@pytest.mark.parametrize("kind", list(SLOT_KINDS))
@pytest.mark.parametrize("which", ["int8", "int4", "int2", "fp16"])
def test_pool_calls_gather_and_scatter_the_named_slots_only(which: str, kind: str) -> None:
    codec = get_codec(which)
    slots = SLOT_KINDS[kind]
    row = codec.bytes_per_block(POOL_SHAPE)
    g = torch.Generator().manual_seed(8)
    src = blocks(6, POOL_SHAPE, seed=9)
    src_before = src.clone()
    packed = torch.randint(0, 256, (5, row), dtype=torch.uint8, generator=g)
    before = packed.clone()

    codec.encode_into(src, slots([4, 0, 2]), packed, slots([1, 3, 0]))
    assert torch.equal(src, src_before)
    expect = codec.encode(src[[4, 0, 2]]).data
    assert torch.equal(packed[[1, 3, 0]], expect)
    assert torch.equal(packed[[2, 4]], before[[2, 4]])

    floats = blocks(4, POOL_SHAPE, seed=10)
    floats_before = floats.clone()
    codec.decode_into(packed, slots([0, 1]), floats, slots([3, 1]))
    assert torch.equal(
        floats[3], codec.decode(Encoded(codec.format, codec.version, POOL_SHAPE, expect[2:3]))[0]
    )
    assert torch.equal(
        floats[1], codec.decode(Encoded(codec.format, codec.version, POOL_SHAPE, expect[0:1]))[0]
    )
    assert torch.equal(floats[[0, 2]], floats_before[[0, 2]])

    to = Int4Codec() if which != "int4" else Int8Codec()
    other = torch.randint(
        0, 256, (4, to.bytes_per_block(POOL_SHAPE)), dtype=torch.uint8, generator=g
    )
    other_before = other.clone()
    codec.transcode_into(packed, slots([3, 1]), to, other, slots([2, 0]), POOL_SHAPE)
    moved = codec.transcode(Encoded(codec.format, codec.version, POOL_SHAPE, packed[[3, 1]]), to)
    assert torch.equal(other[[2, 0]], moved.data)
    assert torch.equal(other[[1, 3]], other_before[[1, 3]])


def test_a_float_pool_in_another_dtype_receives_the_decode_in_its_dtype() -> None:
    codec = Int8Codec()
    x = blocks(2, POOL_SHAPE, torch.bfloat16, seed=11)
    enc = codec.encode(x)
    pool = torch.zeros((3, *POOL_SHAPE.dims), dtype=torch.float32)
    codec.decode_into(enc.data, [1], pool, [2])
    assert torch.equal(pool[2], codec.decode(enc, dtype=torch.float32)[1])
    assert (pool[:2] == 0).all()


@pytest.mark.parametrize("which", ["int8", "fp16"])
def test_empty_slot_lists_are_a_no_op(which: str) -> None:
    codec = get_codec(which)
    src = blocks(2, POOL_SHAPE, seed=12)
    packed = torch.zeros((3, codec.bytes_per_block(POOL_SHAPE)), dtype=torch.uint8)
    codec.encode_into(src, [], packed, [])
    codec.transcode_into(
        packed,
        [],
        Int4Codec(),
        torch.zeros((1, Int4Codec().bytes_per_block(POOL_SHAPE)), dtype=torch.uint8),
        [],
        POOL_SHAPE,
    )
    assert len(codec.encode(src[:0])) == 0
    assert (packed == 0).all()


# ---- 8. bad input: the right error, and nothing written -----------------------------------------

D8 = BlockShape(1, 2, 8, 32)
ROW8 = Int8Codec().bytes_per_block(D8)
ROW4 = Int4Codec().bytes_per_block(D8)


def _src(n: int = 4, dims: tuple[int, ...] = D8.dims, dtype: Any = torch.float16) -> Any:
    return torch.randn((n, *dims), generator=torch.Generator().manual_seed(13)).to(dtype)


def _packed(n: int = 5, row: int = ROW8) -> Any:
    g = torch.Generator().manual_seed(14)
    return torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=g)


def _floats(n: int = 4) -> Any:
    return _src(n) * 3


def encode(src: Any = None, src_slots: Any = (0,), dst_slots: Any = (0,), **kw: Any) -> Any:
    """A call ``(codec, dst) -> codec.encode_into(src, src_slots, dst, dst_slots)``."""
    return lambda c, d: c.encode_into(_src() if src is None else src, src_slots, d, dst_slots, **kw)


def decode(src: Any = None, src_slots: Any = (0,), dst_slots: Any = (0,), **kw: Any) -> Any:
    return lambda c, d: c.decode_into(
        _packed() if src is None else src, src_slots, d, dst_slots, **kw
    )


def transcode(src: Any = None, shape: BlockShape = D8, **kw: Any) -> Any:
    src = _packed() if src is None else src
    return lambda c, d: c.transcode_into(src, [0], Int4Codec(), d, [0], shape, **kw)


D48 = BlockShape(1, 2, 8, 48)

# (name, what the message says, codec, call(codec, dst), the destination pool left untouched)
POOL_CASES: list[
    tuple[str, str, Callable[[], Codec], Callable[[Codec, Any], Any], Callable[[], Any]]
]
POOL_CASES = [
    (
        "src int32",
        "float16, bfloat16 or float32",
        Int8Codec,
        encode(_src().to(torch.int32)),
        _packed,
    ),
    ("src float64", "float16, bfloat16 or float32", Int8Codec, encode(_src().double()), _packed),
    ("src float8", "unsupported dtype", Int8Codec, encode(_src().to(torch.float8_e4m3fn)), _packed),
    ("src rank 5", "axis 2", Int8Codec, encode(_src()[:, :, 0]), _packed),
    ("src axis 2 is 3", "axis 2", Int8Codec, encode(_src(dims=(1, 3, 2, 8, 32))), _packed),
    (
        "head_dim 48, group 32",
        "not divisible",
        Int4Codec,
        encode(_src(dims=D48.dims)),
        lambda: _packed(row=ROW4),
    ),
    (
        "odd head_dim, int4",
        "odd",
        lambda: Int4Codec(group_size=None, key_per_channel=False),
        encode(_src(dims=(1, 2, 2, 8, 33))),
        lambda: _packed(row=ROW4),
    ),
    (
        "head_dim not a multiple of 4, int2",
        "head_dim 34 is not divisible by 4: int2 packs four values a byte",
        lambda: Int2Codec(group_size=None, key_per_channel=False),
        encode(_src(dims=(1, 2, 2, 8, 34))),
        lambda: _packed(row=ROW4),
    ),
    ("non-contiguous src", "src: expected a contiguous", Int8Codec, encode(_src(8)[::2]), _packed),
    (
        "non-contiguous dst",
        "dst: expected a contiguous",
        Int8Codec,
        encode(),
        lambda: _packed().t().contiguous().t(),
    ),
    (
        "src slot out of range",
        "src_slots",
        Int8Codec,
        encode(src_slots=[0, 4], dst_slots=[0, 1]),
        _packed,
    ),
    (
        "dst slot out of range",
        "dst_slots",
        Int8Codec,
        encode(src_slots=[0, 1], dst_slots=[0, 5]),
        _packed,
    ),
    (
        "negative slot",
        "min -1",
        Int8Codec,
        encode(src_slots=np.array([0, -1]), dst_slots=[0, 1]),
        _packed,
    ),
    (
        "repeated dst slots",
        "distinct",
        Int8Codec,
        encode(src_slots=[0, 1], dst_slots=[2, 2]),
        _packed,
    ),
    (
        "mismatched slot lengths",
        "as many",
        Int8Codec,
        encode(src_slots=[0, 1], dst_slots=[0]),
        _packed,
    ),
    (
        "float slots (list)",
        "integer",
        Int8Codec,
        encode(src_slots=[0.0, 1.0], dst_slots=[0, 1]),
        _packed,
    ),
    ("float slots (numpy)", "integer", Int8Codec, encode(dst_slots=np.array([0.0])), _packed),
    ("float slots (torch)", "integer", Int8Codec, encode(src_slots=torch.tensor([0.0])), _packed),
    ("2-D slots", "1-D", Int8Codec, encode(src_slots=[[0, 1]], dst_slots=[[0, 1]]), _packed),
    ("string slots", "slot indices", Int8Codec, encode(src_slots="01", dst_slots=[0, 1]), _packed),
    (
        "dst row too wide",
        "dst: expected a packed pool",
        Int8Codec,
        encode(),
        lambda: _packed(row=ROW8 + 2),
    ),
    (
        "dst not uint8",
        "dst: expected a packed pool",
        Int8Codec,
        encode(),
        lambda: _packed().to(torch.int16),
    ),
    (
        "decode: src row too narrow",
        "src: expected a packed pool",
        Int8Codec,
        decode(_packed(row=ROW8 - 2)),
        _floats,
    ),
    (
        "decode: dst int32",
        "float16, bfloat16 or float32",
        Int8Codec,
        decode(),
        lambda: _floats().to(torch.int32),
    ),
    (
        "decode: dst float64",
        "float16, bfloat16 or float32",
        Int8Codec,
        decode(),
        lambda: _floats().double(),
    ),
    (
        "decode: dst slot out of range",
        "dst_slots",
        Int8Codec,
        decode(None, [0, 1], [3, 4]),
        _floats,
    ),
    ("decode: repeated dst slots", "distinct", Int8Codec, decode(None, [0, 1], [3, 3]), _floats),
    (
        "transcode: dst row of the wrong codec",
        "dst: expected a packed pool",
        Int8Codec,
        transcode(),
        _packed,
    ),
    (
        "transcode: src row of the wrong codec",
        "src: expected a packed pool",
        Int8Codec,
        transcode(_packed(row=ROW4)),
        lambda: _packed(row=ROW4),
    ),
    (
        "transcode: target cannot pack the shape",
        "not divisible",
        Int8Codec,
        transcode(_packed(row=Int8Codec().bytes_per_block(D48)), D48),
        lambda: _packed(row=ROW4),
    ),
    (
        "backend cuda on CPU tensors",
        "needs CUDA tensors",
        Int8Codec,
        encode(backend="cuda"),
        _packed,
    ),
    ("backend cuda, decode", "needs CUDA tensors", Int8Codec, decode(backend="cuda"), _floats),
    (
        "backend cuda, transcode",
        "needs CUDA tensors",
        Int8Codec,
        transcode(backend="cuda"),
        lambda: _packed(row=ROW4),
    ),
    (
        "backend cuda, codec without kernels",
        "has_kernels=False",
        lambda: IdentityCodec("fp16"),
        encode(backend="cuda"),
        lambda: _packed(row=D8.fp16_bytes),
    ),
    ("unknown backend", "'triton'", Int8Codec, encode(backend="triton"), _packed),
    (
        "unknown backend, decode",
        "'gpu'",
        Int4Codec,
        decode(_packed(row=ROW4), backend="gpu"),
        _floats,
    ),
]


@pytest.mark.parametrize(
    ("match", "make_codec", "call", "make_dst"),
    [case[1:] for case in POOL_CASES],
    ids=[case[0] for case in POOL_CASES],
)
def test_bad_pool_arguments_raise_and_write_nothing(
    match: str,
    make_codec: Callable[[], Codec],
    call: Callable[[Codec, Any], Any],
    make_dst: Callable[[], Any],
) -> None:
    codec, dst = make_codec(), make_dst()
    before = dst.clone()
    with pytest.raises(InvalidArgumentError, match=re.escape(match)):
        call(codec, dst)
    assert torch.equal(dst, before)


def test_errors_are_value_errors_a_caller_can_catch() -> None:
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(PayloadError, ValueError)


@pytest.fixture
def int4_payload() -> Encoded:
    return Int4Codec().encode(_src(2))


def test_a_payload_is_only_read_by_its_own_format(int4_payload: Encoded) -> None:
    with pytest.raises(PayloadError, match="int4"):
        Int8Codec().decode(int4_payload)
    with pytest.raises(PayloadError):
        Int4Codec(group_size=16).decode(int4_payload)
    with pytest.raises(PayloadError):
        get_codec("fp16").decode(int4_payload)
    with pytest.raises(PayloadError):
        Int8Codec().transcode(int4_payload, Int4Codec())
    # the same format from a fresh instance reads it
    assert Int4Codec().decode(int4_payload).shape == (2, *D8.dims)


def test_a_payload_of_another_version_is_refused(int4_payload: Encoded) -> None:
    with pytest.raises(PayloadError, match="v2"):
        Int4Codec().decode(dataclasses.replace(int4_payload, version=2))


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:, :-1],
        lambda d: torch.cat([d, d[:, :2]], dim=1),
        lambda d: d.view(torch.int8),
        lambda d: d.float(),
        lambda d: d.reshape(-1),
    ],
    ids=["truncated", "extended", "int8 bytes", "float bytes", "flattened"],
)
def test_a_malformed_payload_is_refused(
    int4_payload: Encoded, damage: Callable[[Any], Any]
) -> None:
    bad = dataclasses.replace(int4_payload, data=damage(int4_payload.data))
    with pytest.raises(PayloadError):
        Int4Codec().decode(bad)
    with pytest.raises(PayloadError):
        Int4Codec().transcode(bad, Int8Codec())


def test_decode_wants_an_encoded_batch(int4_payload: Encoded) -> None:
    with pytest.raises(InvalidArgumentError, match="Encoded"):
        Int4Codec().decode(int4_payload.data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda c, x, e: c.encode(x, backend="cuda"),
        lambda c, x, e: c.decode(e, backend="cuda"),
        lambda c, x, e: c.transcode(e, Int4Codec(), backend="cuda"),
        lambda c, x, e: c.encode(x, backend="CUDA"),
        lambda c, x, e: c.decode(e, backend=None),
    ],
    ids=["encode cuda", "decode cuda", "transcode cuda", "encode CUDA", "decode None"],
)
def test_whole_batch_calls_check_the_backend(call: Callable[..., Any]) -> None:
    codec, x = Int8Codec(), _src(1)
    enc = codec.encode(x)
    with pytest.raises(InvalidArgumentError):
        call(codec, x, enc)


def test_bad_codec_options_are_refused() -> None:
    for bad in (0, 3, 1, 2.0, "32"):
        with pytest.raises(InvalidArgumentError, match="group_size"):
            Int4Codec(group_size=bad)  # type: ignore[arg-type]
    for bits in (3, 1, 16):
        with pytest.raises(InvalidArgumentError, match="expected 2, 4 or 8"):
            QuantCodec(f"int{bits}", bits, asymmetric=False, key_per_channel=False)
    with pytest.raises(InvalidArgumentError):
        IdentityCodec("fp8")
    with pytest.raises(InvalidArgumentError):
        BlockShape(0, 1, 16, 64)
    with pytest.raises(InvalidArgumentError):
        BlockShape(1, 1, 16, 64, dtype="fp64")


# ---- 9. DLPack ----------------------------------------------------------------------------------


def test_numpy_arrays_go_in_by_dlpack() -> None:
    codec = Int8Codec()
    x = blocks(2, POOL_SHAPE, seed=15)
    arr = x.numpy().copy()
    assert arr.dtype == np.float16
    from_numpy = codec.encode(arr)
    assert from_numpy.shape.dtype == "fp16"
    assert torch.equal(from_numpy.data, codec.encode(x).data)

    # numpy pools are written in place, without a copy
    packed = np.zeros((3, codec.bytes_per_block(POOL_SHAPE)), dtype=np.uint8)
    codec.encode_into(arr, np.array([1]), packed, np.array([2]))
    np.testing.assert_array_equal(packed[2], from_numpy.data[1].numpy())
    assert not packed[:2].any()
    floats = np.zeros((2, *POOL_SHAPE.dims), dtype=np.float32)
    codec.decode_into(packed, [2], floats, [0])
    np.testing.assert_array_equal(
        floats[0], codec.decode(from_numpy, dtype=torch.float32)[1].numpy()
    )
    assert not floats[1].any()


def test_objects_without_dlpack_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="DLPack"):
        Int8Codec().encode([[1.0, 2.0]])


# ---- 10. registry -------------------------------------------------------------------------------


def test_get_codec_builds_with_options() -> None:
    assert get_codec("int4", group_size=64).format != get_codec("int4").format
    assert get_codec("int4", group_size=64).format == "int4-asym-kchan-g64"
    assert get_codec("int8").format == "int8-sym-ktok-ghead"
    assert get_codec("int2-g64").format == "int2-asym-kchan-g64"
    assert get_codec("int2").format == "int2-asym-kchan-g32"
    assert {"fp16", "bf16", "fp32", "int8", "int4", "int2", "int2-g64"} <= set(available_codecs())
    with pytest.raises(ConfigError, match="bad options"):
        get_codec("int8", nonsense=1)


def test_unknown_codec_names_list_the_available_ones() -> None:
    with pytest.raises(ConfigError) as info:
        get_codec("int3")
    message = str(info.value)
    for name in ("fp16", "int8", "int4"):
        assert name in message
    assert info.value.hint and "register_codec" in info.value.hint


def test_registering_a_codec_makes_it_available() -> None:
    name = "int8-g32-test"
    assert name not in available_codecs()
    register_codec(name, lambda **kw: Int8Codec(group_size=32, name=name, **kw))
    try:
        codec = get_codec(name)
        assert codec.name == name and codec.format == "int8-sym-ktok-g32"
        assert get_codec(name, asymmetric=True).format == "int8-asym-ktok-g32"
        assert name in available_codecs()
        with pytest.raises(ConfigError, match="already registered"):
            register_codec(name, Int8Codec)
        register_codec(name, Int4Codec, replace=True)
        assert get_codec(name).format == Int4Codec().format
    finally:
        unregister_codec(name)
    assert name not in available_codecs()
    with pytest.raises(ConfigError):
        get_codec(name)


def test_a_registered_instance_is_returned_as_is_and_takes_no_options() -> None:
    codec = Int8Codec(group_size=16, name="")
    register_codec("i8-instance-test", codec)
    try:
        got = get_codec("i8-instance-test")
        assert got is codec and got.name == "i8-instance-test"
        with pytest.raises(ConfigError, match="no options"):
            get_codec("i8-instance-test", group_size=8)
    finally:
        unregister_codec("i8-instance-test")


def test_built_in_names_and_bad_names_cannot_be_registered() -> None:
    with pytest.raises(ConfigError):
        register_codec("int8", Int8Codec)
    for bad in ("", "Mine", " mine", None):
        with pytest.raises(ConfigError):
            register_codec(bad, Int8Codec)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        register_codec("not-callable-test", 42)  # type: ignore[arg-type]
    register_codec("returns-nothing-test", lambda: None)
    try:
        with pytest.raises(ConfigError, match="not a Codec"):
            get_codec("returns-nothing-test")
    finally:
        unregister_codec("returns-nothing-test")


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution declaring two codecs in the kvtier.codecs group."""
    (tmp_path / "kvt_plugin_mod.py").write_text(
        "from kvtier.codecs import Int8Codec\n\n"
        "def make(**options):\n"
        "    return Int8Codec(group_size=16, name='plugin8', **options)\n"
    )
    info = tmp_path / "kvt_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvt_plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[kvtier.codecs]\nplugin8 = kvt_plugin_mod:make\nint8 = kvt_plugin_mod:make\n"
        "broken8 = kvt_plugin_mod:missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rescan_entry_points()
    yield tmp_path
    monkeypatch.undo()
    for name in ("plugin8", "broken8"):
        unregister_codec(name)
    sys.modules.pop("kvt_plugin_mod", None)
    rescan_entry_points()
    assert "plugin8" not in available_codecs()


def test_entry_point_codecs_are_found_after_a_rescan(plugin: Path) -> None:
    assert "plugin8" in available_codecs()
    codec = get_codec("plugin8")
    assert codec.name == "plugin8" and codec.format == "int8-sym-ktok-g16"
    assert get_codec("plugin8", asymmetric=True).format == "int8-asym-ktok-g16"
    x = blocks(1, POOL_SHAPE, seed=16)
    assert (cosine_per_block(codec.decode(codec.encode(x)), x) > 0.999).all()


def test_an_entry_point_cannot_take_over_a_built_in_name(plugin: Path) -> None:
    codec = get_codec("int8")
    assert type(codec) is Int8Codec
    assert codec.name == "int8" and codec.format == "int8-sym-ktok-ghead"


def test_an_entry_point_that_fails_to_load_raises_config_error(plugin: Path) -> None:
    with pytest.raises(ConfigError, match="broken8"):
        get_codec("broken8")


# ---- 11. learned codecs -------------------------------------------------------------------------

LEARNED_SHAPE = BlockShape(2, 2, 16, 64)
RANK = 8


def low_rank_blocks(n: int, seed: int, basis_seed: int = 17) -> Any:
    """Head vectors in a rank-8 affine subspace (fixed by ``basis_seed``)."""
    L, _, H, B, D = LEARNED_SHAPE.dims
    g = torch.Generator().manual_seed(basis_seed)
    basis = torch.randn((RANK, D), generator=g)
    mean = torch.randn(D, generator=g)
    latent = torch.randn((n, L, 2, H, B, RANK), generator=torch.Generator().manual_seed(seed))
    return (latent @ basis + mean).to(torch.float16)


@pytest.fixture(scope="module")
def pca() -> tuple[Any, Any]:
    return fit_pca(low_rank_blocks(6, seed=1), RANK)


def test_fit_pca_recovers_low_rank_data(pca: tuple[Any, Any]) -> None:
    codec = LearnedCodec("pca-test", *pca)
    x = low_rank_blocks(3, seed=2)  # other blocks of the same subspace
    enc = codec.encode(x)
    assert enc.format.startswith("learned/pca-test/") and enc.format.endswith("/fp16")
    out = codec.decode(enc)
    assert out.dtype == torch.float16
    assert (cosine_per_block(out, x) > 0.999).all()
    assert codec.bytes_per_block(LEARNED_SHAPE) == 2 * 2 * 2 * 16 * RANK * 2
    assert enc.data.shape[1] == codec.bytes_per_block(LEARNED_SHAPE)
    with pytest.raises(InvalidArgumentError, match="rank"):
        fit_pca(x, 65)


def test_a_saved_linear_codec_is_rebuilt_from_the_file_alone(
    pca: tuple[Any, Any], tmp_path: Path
) -> None:
    codec = LearnedCodec("pca-test", *pca)
    path = tmp_path / "x.safetensors"
    codec.save(path)
    loaded = LearnedCodec.load(path)
    assert isinstance(loaded.compressor, LinearCompressor)
    assert loaded.format == codec.format and loaded.name == "learned:pca-test"
    enc = codec.encode(low_rank_blocks(2, seed=18))
    assert torch.equal(loaded.decode(enc), codec.decode(enc))
    assert LearnedCodec.load(path, name="other").format != codec.format
    bf16 = LearnedCodec("pca-test", *pca, latent_dtype="bf16")
    bf16.save(path)
    assert LearnedCodec.load(path).format == bf16.format != codec.format


class HeadDown(torch.nn.Module):
    """A user's compressor: a linear map of head_dim, not kvtier's LinearCompressor."""

    def __init__(self, head_dim: int, rank: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(head_dim, rank)

    def forward(self, x: Any) -> Any:
        return self.proj(x)


class HeadUp(torch.nn.Module):
    def __init__(self, rank: int, head_dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(rank, head_dim)

    def forward(self, z: Any) -> Any:
        return self.proj(z)


def test_user_modules_save_and_load_into_given_instances(tmp_path: Path) -> None:
    torch.manual_seed(19)
    codec = LearnedCodec("mine-test", HeadDown(64, 16), HeadUp(16, 64))
    assert codec.bytes_per_block(LEARNED_SHAPE) == 2 * 2 * 2 * 16 * 16 * 2
    path = tmp_path / "mine.safetensors"
    codec.save(path)
    with pytest.raises(InvalidArgumentError, match="compressor="):
        LearnedCodec.load(path)
    fresh = LearnedCodec.load(path, HeadDown(64, 16), HeadUp(16, 64))  # new random weights
    assert fresh.format == codec.format
    x = blocks(2, LEARNED_SHAPE, seed=20)
    enc = codec.encode(x)
    assert torch.equal(fresh.decode(enc), codec.decode(enc))
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        LearnedCodec.load(path, HeadDown(64, 8), HeadUp(8, 64))
    not_learned = tmp_path / "plain.safetensors"
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.zeros(2)}, str(not_learned))
    with pytest.raises(InvalidArgumentError, match="not a kvtier learned codec"):
        LearnedCodec.load(not_learned)


def test_a_payload_of_other_weights_is_refused(pca: tuple[Any, Any]) -> None:
    codec = LearnedCodec("pca-test", *pca)
    other = LearnedCodec("pca-test", *fit_pca(low_rank_blocks(6, seed=1, basis_seed=21), RANK))
    enc = codec.encode(low_rank_blocks(1, seed=17))
    with pytest.raises(PayloadError):
        other.decode(enc)
    assert codec.decode(enc).shape == (1, *LEARNED_SHAPE.dims)


def test_register_makes_a_learned_codec_available_by_name(pca: tuple[Any, Any]) -> None:
    codec = LearnedCodec("pca-reg-test", *pca)
    assert codec.register() is codec
    try:
        assert get_codec("learned:pca-reg-test") is codec
        assert "learned:pca-reg-test" in available_codecs()
        with pytest.raises(ConfigError):
            codec.register()
        codec.register(replace=True)
    finally:
        unregister_codec("learned:pca-reg-test")


def test_learned_codecs_transcode_through_the_torch_path(pca: tuple[Any, Any]) -> None:
    learned, int8 = LearnedCodec("pca-test", *pca), Int8Codec()
    x = low_rank_blocks(2, seed=17)
    enc8 = int8.encode(x)
    to_learned = int8.transcode(enc8, learned)
    assert to_learned.format == learned.format
    assert torch.equal(to_learned.data, learned.encode(int8.decode(enc8, dtype=torch.float32)).data)
    encl = learned.encode(x)
    to_int8 = learned.transcode(encl, int8)
    assert torch.equal(to_int8.data, int8.encode(learned.decode(encl, dtype=torch.float32)).data)
    with pytest.raises(InvalidArgumentError):
        learned.encode(x, backend="cuda")


def test_a_decompressor_of_the_wrong_shape_is_refused_before_writing(
    pca: tuple[Any, Any],
) -> None:
    comp, _ = pca
    codec = LearnedCodec("bad-test", comp, HeadUp(RANK, 32))  # back to 32 channels, not 64
    x = low_rank_blocks(2, seed=3)
    packed = codec.encode(x).data
    pool = torch.ones((2, *LEARNED_SHAPE.dims), dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="decompressor returned"):
        codec.decode_into(packed, [0, 1], pool, [0, 1])
    assert (pool == 1).all()


def test_learned_codec_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgumentError):
        LearnedCodec("x", torch.nn.Identity(), lambda z: z)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="latent_dtype"):
        LearnedCodec("x", torch.nn.Identity(), torch.nn.Identity(), latent_dtype="int8")
    assert "LearnedCodec" in codecs.__all__ and codecs.LearnedCodec is LearnedCodec


# ---- 12. the simulator's byte counts are the codecs' --------------------------------------------


def test_model_shapes_size_blocks_with_the_codecs() -> None:
    llama = model_shape("llama3-8b")
    assert llama.block_bytes("int4", 16) == get_codec("int4").bytes_per_block(
        BlockShape(32, 8, 16, 128)
    )
    assert llama.block_bytes("int8", 16) == get_codec("int8").bytes_per_block(
        BlockShape(32, 8, 16, 128)
    )
    assert llama.block_bytes("drop", 16) == 0
    with pytest.raises(ConfigError, match="int3"):
        llama.block_bytes("int3", 16)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "int2"])
def test_decode_layer_reads_one_layer_of_chosen_rows_exactly_as_decode(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(5, 3, 2, 2, 32, 64).half()
    enc = codec.encode(x)
    full = codec.decode(enc)
    slots = torch.tensor([4, 0, 2])
    for layer in range(3):
        assert torch.equal(codec.decode_layer(enc.data, enc.shape, layer), full[:, layer])
        got = codec.decode_layer(enc.data, enc.shape, layer, slots=slots, dtype=torch.float32)
        assert torch.equal(got, codec.decode(enc, dtype=torch.float32)[slots, layer])
    with pytest.raises(InvalidArgumentError, match="layer"):
        codec.decode_layer(enc.data, enc.shape, 3)


@pytest.mark.parametrize("name", ["int8", "int4", "int4-g64", "int2-rot", "int2-rot-g64"])
def test_one_layer_of_packed_rows_is_the_packed_row_of_a_one_layer_block(name: str) -> None:
    """A layer-major codec's bytes of one layer, section by section, are the packed row of a
    one-layer block: what decode_layer copies to a GPU in one piece and the kernels decode."""
    codec = get_codec(name)
    x = torch.randn(4, 3, 2, 2, 32, 64).half()
    enc = codec.encode(x)
    one = dataclasses.replace(enc.shape, layers=1)
    for layer in range(3):
        rows = codec.layer_rows(enc.data, slice(None), enc.shape, layer)
        assert rows.shape == (4, codec.bytes_per_block(one))
        got = codec.decode(Encoded(codec.format, codec.version, one, rows))
        assert torch.equal(got[:, 0], codec.decode(enc)[:, layer])


@pytest.mark.parametrize("name", ["int8", "int4", "int2-rot-g64"])
def test_a_layer_of_packed_rows_goes_into_and_out_of_a_pool_by_native_copies(name: str) -> None:
    """A layer's bytes written into rows of a packed pool (an encoded save's) and read back
    out of it (an encoded load's), by the native copies the manager runs on the CPU, are what
    :meth:`Codec.write_layer_rows` and :meth:`Codec.layer_rows` make: the other layers' bytes
    and the other rows untouched."""
    from kvtier.manager.tiers import copy_layer_rows

    codec = get_codec(name)
    x = torch.randn(3, 3, 2, 2, 32, 64).half()
    shape = BlockShape.of(x)
    one = dataclasses.replace(shape, layers=1)
    pool = torch.randint(0, 256, (6, codec.bytes_per_block(shape)), dtype=torch.uint8)
    by_torch, natively = pool.clone(), pool.clone()
    slots = np.array([4, 0, 2])
    for layer in range(3):
        rows = codec.encode(x[:, layer : layer + 1].contiguous()).data
        assert rows.shape == (3, codec.bytes_per_block(one))
        codec.write_layer_rows(by_torch, torch.from_numpy(slots), shape, layer, rows)
        copy_layer_rows(codec, shape, layer, rows, natively, slots, into_pool=True)
        assert torch.equal(natively, by_torch)
        out = torch.zeros_like(rows)
        copy_layer_rows(codec, shape, layer, out, natively, slots, into_pool=False)
        assert torch.equal(out, codec.layer_rows(natively, torch.from_numpy(slots), shape, layer))
        assert torch.equal(out, rows)
    assert torch.equal(natively[[1, 3, 5]], pool[[1, 3, 5]])
    got = codec.decode(Encoded(codec.format, codec.version, shape, natively[slots]))
    assert torch.equal(got, codec.decode(codec.encode(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "int2-rot"])
def test_host_rows_decoded_onto_a_gpu_equal_the_host_decode(torch_cuda: Any, name: str) -> None:
    """Host rows decoded onto a GPU (the layer's bytes copied there encoded, decoded by the
    kernels) give the host decode's values."""
    codec = get_codec(name)
    x = torch.randn(6, 3, 2, 2, 32, 64).half()
    enc = codec.encode(x)
    slots = torch.tensor([5, 1, 3])
    for layer in range(3):
        host = codec.decode_layer(enc.data, enc.shape, layer, slots=slots)
        gpu = codec.decode_layer(enc.data, enc.shape, layer, slots=slots, device="cuda")
        assert gpu.is_cuda and torch.equal(gpu.cpu(), host)
