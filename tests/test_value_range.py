"""What each codec holds, and what happens past it: the quantized codecs keep fp16 scales and
zero points, so bf16/fp32 K/V has a largest magnitude each level stores within its error bound
(``Codec.max_magnitude``). ``encode`` refuses larger values (and NaN, inf), on every backend,
and a ``BlockManager`` refuses to append them — naming the largest value its ladder holds —
rather than hand back values clamped at 65,536 or NaN from a finite block; every finite block
within the range decodes finite, close to what was encoded, on both CPU backends."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvtier import BlockManager, InvalidArgumentError, KvtierConfig  # noqa: E402
from kvtier.codecs import get_codec  # noqa: E402

QUANT = ["int8", "int4", "int2", "int4-rot", "int2-rot"]
WIDE = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPE = {"layers": 2, "kv_heads": 2, "block_size": 16, "head_dim": 64}
BACKENDS = ["torch", "native"]


def at_most(value: float, dtype: Any) -> float:
    """The largest value of ``dtype`` at most ``value`` (a conversion may round up)."""
    x = value
    while float(torch.tensor(x).to(dtype)) > value:
        x *= 1 - 2**-12
    return float(torch.tensor(x).to(dtype))


def block(pattern: str, magnitude: float, dtype: Any, seed: int = 0) -> Any:
    """One block ``[1, layers, 2, heads, block, dim]`` of ``pattern`` at ``magnitude`` (the
    nearest ``dtype`` value at most it)."""
    magnitude = at_most(magnitude, dtype)
    dims = (1, SHAPE["layers"], 2, SHAPE["kv_heads"], SHAPE["block_size"], SHAPE["head_dim"])
    if pattern == "constant":
        x = torch.full(dims, magnitude)
    elif pattern == "alternating":
        x = torch.full(dims, magnitude)
        x[..., 1::2] *= -1
    else:  # random, its largest value at the magnitude
        x = torch.randn(dims, generator=torch.Generator().manual_seed(seed))
        x = x / x.abs().max() * magnitude
    return x.to(dtype).clamp(-magnitude, magnitude)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(WIDE))
@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("pattern", ["constant", "alternating"])
def test_a_block_past_what_the_codec_holds_is_refused_not_decoded_to_nan_or_clamped(
    name: str, dtype: str, backend: str, pattern: str
) -> None:
    codec = get_codec(name)
    limit = codec.max_magnitude(dtype)
    for magnitude in (3e38, 1e5 if limit < 1e5 else 2 * limit):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"at most {limit:.7g}")):
            codec.encode(block(pattern, magnitude, WIDE[dtype]), backend=backend)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(QUANT),
    dtype=st.sampled_from(list(WIDE)),
    pattern=st.sampled_from(["constant", "alternating", "random"]),
    fraction=st.sampled_from([1.0, 0.99, 0.5, 1e-3]),
    seed=st.integers(0, 1000),
)
def test_every_block_within_the_range_decodes_finite_and_close_on_both_backends(
    name: str, dtype: str, pattern: str, fraction: float, seed: int
) -> None:
    codec = get_codec(name)
    limit = codec.max_magnitude(dtype)
    x = block(pattern, limit * fraction, WIDE[dtype], seed)
    top = float(x.float().abs().max())
    for backend in BACKENDS:
        out = codec.decode(codec.encode(x, backend=backend), backend=backend).float()
        assert torch.isfinite(out).all(), (name, dtype, pattern, backend)
        # Never clamped: the worst error is a fraction of the block's largest value (int2's
        # four levels at worst, a rotation spreading one tile's error over the head).
        worst = float((out - x.float()).abs().max())
        assert worst <= 0.75 * top, (name, dtype, pattern, backend, worst, top)


def test_int8_holds_bf16_values_past_fp16s_range_and_int4_refuses_them() -> None:
    """The reported case: a bf16 block around 1e5 came back at 65,536 through int4 with no
    error. int8's scale holds it (1e5 / 127 is an fp16); int4's zero point (the minimum, in
    fp16) cannot, so encode refuses it."""
    x = block("random", 1e5, torch.bfloat16) + 1.5e5
    int8 = get_codec("int8")
    back = int8.decode(int8.encode(x)).float()
    assert float((back - x.float()).abs().max()) < 0.01 * float(x.float().abs().max())
    with pytest.raises(InvalidArgumentError, match="at most 65504"):
        get_codec("int4").encode(x)


def test_fp16_blocks_are_never_refused_for_their_magnitude() -> None:
    """fp16 K/V is within every codec's range: its largest value encodes as before."""
    x = block("alternating", 65504.0, torch.float16)
    for name in QUANT:
        codec = get_codec(name)
        assert codec.max_magnitude("fp16") >= 65504.0
        assert torch.isfinite(codec.decode(codec.encode(x)).float()).all()


LADDERS = [("bf16", "int4"), ("bf16", "int8", "int2-rot"), ("fp32", "int4-rot"), ("bf16", "int8")]


def manager(ladder: tuple[str, ...]) -> BlockManager:
    config = KvtierConfig(
        block_size=16, recent_window=16, sink_blocks=1, ladder=ladder, device_blocks=16
    )
    return BlockManager(config, 2, 2, 64, ladder[0], "cpu")


def state(bm: BlockManager) -> tuple[Any, ...]:
    pools = {key: pool.view(torch.uint8).clone() for key, pool in bm.pools.items()}
    seqs = {s: bm.num_tokens(s, layer) for s in bm.sequences() for layer in range(2)}
    return pools, seqs, bm.core.counters()


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(torch.equal(a[0][key], b[0][key]) for key in a[0]) and a[1] == b[1] and a[2] == b[2]


@pytest.mark.parametrize("ladder", LADDERS, ids=",".join)
@pytest.mark.parametrize("path", ["tokens", "token", "blocks", "encoded"])
def test_a_manager_refuses_kv_its_ladder_cannot_hold_naming_the_largest_it_can(
    ladder: tuple[str, ...], path: str
) -> None:
    """Every append path (tokens, the one-token decode path, whole blocks, encoded blocks)
    refuses K/V past the ladder's range before anything changes, in K or in V; K/V at the
    range's edge is stored, and its lower levels read back finite and close."""
    bm = manager(ladder)
    dtype = bm.dtype
    limit = min(get_codec(name).max_magnitude(ladder[0]) for name in ladder[1:])
    seq = bm.add_sequence(np.arange(64))
    fill = torch.randn(2, 2, 2, 16, 64, dtype=torch.float32).to(dtype)  # [blocks, K/V, H, N, D]
    for layer in range(2):
        bm.append_blocks(seq, layer, fill)

    def append(blocks: Any) -> None:
        for layer in range(2):
            if path == "blocks" or path == "encoded":
                bm.append_blocks(seq, layer, blocks, encode=path == "encoded")
                continue
            k, v = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, 2, 64)
            step = 1 if path == "token" else len(k)
            for at in range(0, len(k), step):
                bm.append(seq, layer, k[at : at + step], v[at : at + step])

    for kv in (0, 1):
        bad = torch.randn(2, 2, 2, 16, 64).to(dtype)
        bad[1, kv, 1, 5, 7] = 2.0 * limit
        before = state(bm)
        with pytest.raises(InvalidArgumentError, match=re.escape(f"magnitude at most {limit:.7g}")):
            append(bad)
        if path != "token":  # one token at a time: the tokens before the bad one are stored
            assert same(before, state(bm))
    if path == "token":
        return
    edge = torch.randn(2, 2, 2, 16, 64)
    edge = (edge / edge.abs().max() * at_most(limit, dtype)).to(dtype)
    edge = edge.clamp(-at_most(limit, dtype), at_most(limit, dtype))
    append(edge)
    bm.step()  # blocks 1 and 2 (neither the sink nor the recent window) go down the ladder
    assert (bm.core.block_info(bm.core.sequence_blocks(seq))["level"][1:3] > 0).all()
    want = torch.cat((fill, edge)).float()
    for layer in range(2):
        got = bm.gather_blocks(seq, layer).float()
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max()) <= 0.75 * limit
