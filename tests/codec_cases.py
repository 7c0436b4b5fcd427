"""The codecs' test cases shared by the kernel tests (tests/test_kernels.py, CUDA) and the native
ones (tests/test_codecs_native.py): the codec variants, random blocks and blocks whose tiles hit
every edge of the rounding rule, the transcodes and the other shapes, and a bit-for-bit
comparison that names the first difference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.codecs import BlockShape, Int2Codec, Int4Codec, Int8Codec, QuantCodec

DTYPES = ["fp16", "bf16", "fp32"]
CODECS: dict[str, Callable[[], QuantCodec]] = {
    "int8": lambda: Int8Codec(),
    "int8-asym": lambda: Int8Codec(asymmetric=True),
    "int8-chan-asym": lambda: QuantCodec("int8-chan", 8, asymmetric=True, key_per_channel=True),
    "int4": lambda: Int4Codec(),
    "int4-g64": lambda: Int4Codec(group_size=64),
    "int4-sym": lambda: Int4Codec(asymmetric=False),
    "int4-ktok": lambda: Int4Codec(key_per_channel=False),
    "int2": lambda: Int2Codec(),
    "int2-g64": lambda: Int2Codec(group_size=64),
    "int2-sym": lambda: Int2Codec(asymmetric=False),
    "int2-ktok": lambda: Int2Codec(key_per_channel=False),
}
#: Rotated codecs: the torch reference, the native code and the CUDA kernels write them alike.
ROTATED: dict[str, Callable[[], QuantCodec]] = {
    "int2-rot": lambda: Int2Codec(rotate=True),
    "int2-rot-g64": lambda: Int2Codec(group_size=64, rotate=True),
    "int2-rot-ktok": lambda: Int2Codec(key_per_channel=False, rotate=True),
    "int4-rot": lambda: Int4Codec(rotate=True),
    "int8-rot": lambda: QuantCodec(
        "int8-rot", 8, asymmetric=False, key_per_channel=False, rotate=True
    ),
}
SHAPE = BlockShape(2, 4, 16, 64)
STEP = 2.0**-24  # the smallest fp16 subnormal


def tdtype(torch: Any, name: str) -> Any:
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def random_blocks(torch: Any, n: int, shape: BlockShape, dtype: str, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape.dims), generator=g).to(tdtype(torch, dtype))


def edge_blocks(torch: Any, n: int, shape: BlockShape, dtype: str, seed: int) -> Any:
    """Random blocks whose (slot, layer, kv, head) tiles cycle through the cases the rounding
    rule has to get right: zero and constant groups, underflowing and subnormal scales (which
    make the clamp decide), outliers, the largest values fp16 scales hold, rounding ties."""
    g = torch.Generator().manual_seed(seed)
    B, D = shape.block_size, shape.head_dim
    x = torch.randn((n, *shape.dims), generator=g)
    tiles = x.view(-1, B, D)
    b, d = torch.meshgrid(torch.arange(B), torch.arange(D), indexing="ij")
    high, low = (b + d) % 7 == 0, (b + d) % 7 == 3  # every group holds both

    def spread(top: float, bottom: float, fill: Any) -> Any:
        t = fill.clone()
        t[high], t[low] = top, bottom
        return t

    def uniform(a: float) -> Any:
        return (torch.rand((B, D), generator=g) * 2 - 1) * a

    halves3 = torch.randint(0, 3, (B, D), generator=g) + 0.5
    halves = torch.randint(0, 15, (B, D), generator=g) + 0.5
    halves127 = torch.randint(0, 127, (B, D), generator=g) + 0.5
    # fp16 scales and zero points bound what a codec holds (Codec.max_magnitude): 65504, the
    # largest bf16 below it 65280; encode refuses more, so the edge is the range's own
    top = 65280.0 if dtype == "bf16" else 65504.0
    huge = (torch.randn((B, D), generator=g) * 1e6 / 30).clamp(-top, top)
    fp16_max = (torch.randint(0, 2, (B, D), generator=g) * 2 - 1) * top  # scales round up
    mixed = torch.randn((B, D), generator=g)
    mixed[3] = 0  # one token's groups all zero
    mixed[:, 7] = 2.5  # one constant channel
    outlier = torch.randn((B, D), generator=g)
    outlier[:, 5] *= 100
    outlier[2] *= 50
    cases = [
        torch.zeros(B, D),
        torch.full((B, D), 1.5),
        torch.full((B, D), -0.3),
        uniform(1e-7),
        outlier,
        spread(1.4 * 127 * STEP, -1.4 * 127 * STEP, uniform(1.4 * 127 * STEP)),
        spread(1.4 * 7 * STEP, -1.4 * 7 * STEP, uniform(1.4 * 7 * STEP)),
        spread(0.7 * 255 * STEP, -0.7 * 255 * STEP, uniform(0.7 * 255 * STEP)),
        spread(0.7 * 15 * STEP, -0.7 * 15 * STEP, uniform(0.7 * 15 * STEP)),
        spread(1.4 * STEP, -1.4 * STEP, uniform(1.4 * STEP)),  # int2 symmetric, bf16/fp32 only
        spread(0.7 * 3 * STEP, -0.7 * 3 * STEP, uniform(0.7 * 3 * STEP)),
        spread(3.0, 0.0, halves3),
        huge,
        fp16_max,
        spread(15.0, 0.0, halves),
        spread(127.0, 0.0, halves127),
        -torch.randn((B, D), generator=g).abs() - 2,
        mixed,
    ]
    for i in range(tiles.shape[0]):
        k = i % (len(cases) + 2)  # leave some tiles plain random
        if k < len(cases):
            tiles[i] = cases[k]
    return x.to(tdtype(torch, dtype))


DATA = {"random": random_blocks, "edge": edge_blocks}


def assert_same(got: Any, want: Any, what: str) -> None:
    """Equal tensors bit for bit (so -0.0 is not 0.0), naming the first difference."""
    import torch

    got, want = got.cpu().contiguous(), want.contiguous()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    as_int = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    bits_got = got.view(as_int.get(got.dtype, got.dtype)).reshape(-1)
    bits_want = want.view(as_int.get(want.dtype, want.dtype)).reshape(-1)
    if not torch.equal(bits_got, bits_want):
        diff = (bits_got != bits_want).nonzero()
        first = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.numel()} of {got.numel()} elements differ; first at flat index "
            f"{first}: got {got.reshape(-1)[first].item()} want {want.reshape(-1)[first].item()}"
        )


TRANSCODES = [
    ("int8", "int4"),
    ("int4", "int8"),
    ("int8-asym", "int4-g64"),
    ("int4", "int4-sym"),
    ("int4-ktok", "int4"),
    ("int8", "int8-chan-asym"),
    ("int4", "int2"),
    ("int2", "int8"),
    ("int2-sym", "int2-g64"),
    ("int2-ktok", "int2"),
]


SHAPES = [
    (
        "b32-d128",
        BlockShape(2, 2, 32, 128),
        ["int8", "int8-asym", "int4", "int4-g64", "int4-ktok", "int2", "int2-g64"],
    ),
    ("d80-int8", BlockShape(2, 2, 16, 80), ["int8", "int8-asym", "int8-chan-asym"]),
    # 64 x 257 fp32 of shared memory: more than the 48 KiB a launch gets by default
    ("b64-d256", BlockShape(1, 2, 64, 256), ["int8", "int4", "int4-g64", "int2"]),
]
