"""The native CPU codecs (crates/kvtier-attend/src/codec.rs through kvtier.codecs.native) against
the torch reference, as tests/test_kernels.py holds the CUDA kernels to it: every format, model
dtype and output dtype writes the same bytes and values, on random blocks and on blocks whose
tiles hit every edge of the rounding rule (zero and constant groups, subnormal and underflowing
scales, outliers, values beyond fp16, ties, signed zeros); transcodes equal the reference's;
pool calls touch only their slots, in any slot order; ``backend="auto"`` takes the native path
on the CPU and ``"native"`` refuses what it cannot run; bad input raises
``InvalidArgumentError`` with nothing written; the work runs without the GIL."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import numpy as np
import pytest
from codec_cases import (
    CODECS,
    DATA,
    DTYPES,
    ROTATED,
    SHAPE,
    SHAPES,
    TRANSCODES,
    assert_same,
    edge_blocks,
    random_blocks,
    tdtype,
)

torch = pytest.importorskip("torch")

from kvtier import _core  # noqa: E402
from kvtier.codecs import (  # noqa: E402
    BlockShape,
    Encoded,
    Int2Codec,
    Int4Codec,
    Int8Codec,
    QuantCodec,
    get_codec,
    native,
)
from kvtier.codecs.layout import layout  # noqa: E402
from kvtier.errors import InvalidArgumentError  # noqa: E402

# ---- every format, dtype and output dtype ---------------------------------------------------------


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [*CODECS, *ROTATED])
def test_native_encode_and_decode_equal_the_torch_reference(
    which: str, dtype: str, data: str
) -> None:
    codec = {**CODECS, **ROTATED}[which]()
    x = DATA[data](torch, 3, SHAPE, dtype, seed=1)
    want = codec.encode(x, backend="torch")
    got = codec.encode(x, backend="native")
    assert got.format == want.format and got.shape == want.shape
    assert_same(got.data, want.data, "encoded rows")
    assert_same(codec.encode(x).data, want.data, "encoded rows, backend auto")

    out = codec.decode(got, backend="native")
    assert out.dtype == x.dtype
    assert_same(out, codec.decode(want, backend="torch"), "decoded in the model dtype")
    for other in DTYPES:
        reference = codec.decode(want, dtype=tdtype(torch, other), backend="torch")
        assert_same(
            codec.decode(got, dtype=tdtype(torch, other), backend="native"),
            reference,
            f"decoded {other}",
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "names"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_native_other_shapes_equal_the_torch_reference(
    shape: BlockShape, names: list[str], dtype: str
) -> None:
    x = edge_blocks(torch, 2, shape, dtype, seed=8)
    for name in names:
        codec = CODECS[name]()
        want = codec.encode(x, backend="torch")
        got = codec.encode(x, backend="native")
        assert_same(got.data, want.data, f"{name} rows")
        assert_same(codec.decode(got, backend="native"), codec.decode(want), f"{name} values")


@pytest.mark.parametrize("group", [2, 4, 16, None])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_native_takes_any_valid_group_size(bits: int, group: int | None) -> None:
    shape = BlockShape(1, 2, 8, 16)
    x = edge_blocks(torch, 2, shape, "bf16", seed=10)
    for asym in (False, True):
        for kpc in (False, True):
            codec = QuantCodec("q", bits, asymmetric=asym, key_per_channel=kpc, group_size=group)
            want = codec.encode(x, backend="torch")
            got = codec.encode(x, backend="native")
            assert_same(got.data, want.data, codec.format)
            assert_same(
                codec.decode(got, backend="native"),
                codec.decode(want, backend="torch"),
                codec.format,
            )


def _signed_zero_tiles(shape: BlockShape) -> Any:
    """Tiles whose groups hold signed zeros in every way whose result the rule fixes: all -0,
    -0 beside positive values (the minimum is -0), +0 beside negative values (the maximum is
    +0), both zeros beside values of both signs (the extremes are not zeros)."""
    B, D = shape.block_size, shape.head_dim
    g = torch.Generator().manual_seed(21)
    pos = torch.rand((B, D), generator=g) + 0.25
    cases = [torch.full((B, D), -0.0), pos.clone(), -pos.clone(), torch.randn((B, D), generator=g)]
    cases[1][:, ::3] = -0.0
    cases[2][:, ::3] = 0.0
    cases[3][:, ::5], cases[3][:, 1::5], cases[3][:, 2] = -0.0, 0.0, 3.0
    cases[3][:, 3] = -3.0
    x = torch.empty((2, *shape.dims))
    tiles = x.view(-1, B, D)
    for i in range(tiles.shape[0]):
        tiles[i] = cases[i % len(cases)]
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", list(CODECS))
def test_native_keeps_the_sign_of_zero_where_the_rule_fixes_it(which: str, dtype: str) -> None:
    codec = CODECS[which]()
    x = _signed_zero_tiles(SHAPE).to(tdtype(torch, dtype))
    want = codec.encode(x, backend="torch")
    got = codec.encode(x, backend="native")
    assert_same(got.data, want.data, "encoded rows")
    for other in DTYPES:
        out_dtype = tdtype(torch, other)
        assert_same(
            codec.decode(got, dtype=out_dtype, backend="native"),
            codec.decode(want, dtype=out_dtype, backend="torch"),
            f"decoded {other}",
        )


@pytest.mark.parametrize("which", list(CODECS))
def test_groups_of_both_zeros_differ_from_torch_in_the_sign_of_zero_at_most(which: str) -> None:
    """A group whose minimum is a zero and which holds both +0 and -0: torch's amin returns the
    zero its reduction order meets (it differs between CPUs); the native path takes -0 as the
    minimum. Codes and scales are equal; zero points and decoded values equal as numbers."""
    codec = CODECS[which]()
    B, D = SHAPE.block_size, SHAPE.head_dim
    tile = torch.rand((B, D), generator=torch.Generator().manual_seed(22))
    tile[:, ::2], tile[:, 1::4] = 0.0, -0.0
    x = tile.expand(2, *SHAPE.dims).contiguous().half()
    want = codec.encode(x, backend="torch")
    got = codec.encode(x, backend="native")
    parts_got, parts_want = codec.unpack(got.data, SHAPE), codec.unpack(want.data, SHAPE)
    for name in parts_want:
        if name.endswith("_zero"):
            assert torch.equal(parts_got[name], parts_want[name]), name  # -0 == +0
        else:
            assert_same(parts_got[name], parts_want[name], name)
    assert torch.equal(codec.decode(got, backend="native"), codec.decode(want, backend="torch"))


# ---- transcodes and pools ---------------------------------------------------------------------------


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize(("src", "dst"), TRANSCODES, ids=[f"{a}-to-{b}" for a, b in TRANSCODES])
def test_native_transcode_equals_the_torch_reference(src: str, dst: str, data: str) -> None:
    a, b = CODECS[src](), CODECS[dst]()
    x = DATA[data](torch, 3, SHAPE, "fp16", seed=2)
    enc = a.encode(x, backend="torch")
    want = a.transcode(enc, b, backend="torch")
    got = a.transcode(enc, b, backend="native")
    assert got.format == b.format
    assert_same(got.data, want.data, f"{src} -> {dst} rows")
    assert_same(a.transcode(enc, b).data, want.data, "backend auto")


def test_transcode_to_a_codec_without_native_code_runs_the_reference() -> None:
    int8, fp16 = Int8Codec(), get_codec("fp16")
    enc = int8.encode(edge_blocks(torch, 2, SHAPE, "fp16", seed=3))
    out = torch.empty((2, fp16.bytes_per_block(SHAPE)), dtype=torch.uint8)
    assert int8._implementation("auto", enc.data, out, fp16) == "torch"
    assert_same(
        int8.transcode(enc, fp16).data, int8.transcode(enc, fp16, backend="torch").data, "fp16"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "which", ["int8", "int4", "int4-sym", "int2", "int2-sym", "int2-rot", "int4-rot"]
)
def test_native_pool_calls_match_the_torch_path_slot_for_slot(which: str, dtype: str) -> None:
    """Encode, decode and transcode between pools, slot for slot (a rotated codec transcodes
    to another rotated one, and int8 to a rotated one)."""
    codec = {**CODECS, **ROTATED}[which]()
    to = {
        "int8": Int4Codec(group_size=64),
        "int2-rot": Int2Codec(group_size=64, rotate=True),
        "int4-rot": Int8Codec(asymmetric=True),
    }.get(which, Int8Codec(asymmetric=True))
    row, to_row = codec.bytes_per_block(SHAPE), to.bytes_per_block(SHAPE)
    g = torch.Generator().manual_seed(4)
    src = edge_blocks(torch, 7, SHAPE, dtype, seed=5)
    packed = torch.randint(0, 256, (9, row), dtype=torch.uint8, generator=g)
    floats = random_blocks(torch, 6, SHAPE, dtype, seed=6)
    other = torch.randint(0, 256, (5, to_row), dtype=torch.uint8, generator=g)
    pools = {"packed": packed, "floats": floats, "other": other}
    results = {}
    for backend in ("native", "torch"):
        p = {k: v.clone() for k, v in pools.items()}
        codec.encode_into(src, [6, 0, 3, 5], p["packed"], [8, 2, 1, 4], backend=backend)
        codec.decode_into(p["packed"], [8, 1, 4], p["floats"], [5, 0, 2], backend=backend)
        codec.transcode_into(p["packed"], [2, 8], to, p["other"], [3, 0], SHAPE, backend=backend)
        results[backend] = p
    for name in pools:
        assert_same(results["native"][name], results["torch"][name], f"{name} pool")
    # only the named slots changed
    assert torch.equal(results["native"]["packed"][[0, 3, 5, 6, 7]], packed[[0, 3, 5, 6, 7]])
    assert torch.equal(results["native"]["floats"][[1, 3, 4]], floats[[1, 3, 4]])
    assert torch.equal(results["native"]["other"][[1, 2, 4]], other[[1, 2, 4]])


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", None])
@pytest.mark.parametrize("which", ["int8", "int4", "int2-ktok"])
def test_native_decode_layer_equals_the_reference_layer_by_layer(
    which: str, dtype: str | None
) -> None:
    codec = CODECS[which]()
    shape = BlockShape(3, 2, 16, 64, "bf16")
    rows = codec.encode(edge_blocks(torch, 5, shape, "bf16", seed=11)).data
    slots = torch.tensor([4, 0, 2, 2])
    out_dtype = None if dtype is None else tdtype(torch, dtype)
    for layer in range(shape.layers):
        got = codec.decode_layer(rows, shape, layer, slots=slots, dtype=out_dtype)
        want = codec.decode(
            encoded(codec, shape, rows[slots]),
            dtype=out_dtype or torch.bfloat16,
            backend="torch",
        )[:, layer]
        assert_same(got, want, f"layer {layer}")
    # every row when no slots are named
    whole = codec.decode_layer(rows, shape, 1)
    assert_same(
        whole,
        codec.decode(encoded(codec, shape, rows), backend="torch")[:, 1],
        "all rows",
    )


def encoded(codec: QuantCodec, shape: BlockShape, rows: Any) -> Encoded:
    return Encoded(codec.format, codec.version, shape, rows.contiguous())


def test_decode_layer_reads_only_the_layer_asked_for() -> None:
    codec = Int4Codec()
    shape = BlockShape(2, 2, 16, 64)
    rows = codec.encode(random_blocks(torch, 2, shape, "fp16", seed=12)).data
    want = codec.decode_layer(rows, shape, 0)
    # garbage in every layer-1 byte of every section leaves layer 0's decode as it was
    spoiled = rows.clone()
    at = 0
    for s in codec.sections(shape):
        half = s.nbytes // shape.layers
        spoiled[:, at + half : at + s.nbytes] = 0x7C  # fp16 0x7C7C: a NaN in a scale
        at += s.nbytes
    assert_same(codec.decode_layer(spoiled, shape, 0), want, "layer 0")


# ---- choosing the implementation ---------------------------------------------------------------------


def test_auto_runs_native_code_on_the_cpu_and_torch_forces_the_reference(monkeypatch: Any) -> None:
    codec = Int8Codec()
    x = random_blocks(torch, 2, SHAPE, "fp16", seed=13)
    calls: list[str] = []
    for name in ("quantize_into", "dequantize_into", "transcode_into", "dequantize_layer"):
        real = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1]
        )
    enc = codec.encode(x)
    codec.decode(enc)
    codec.transcode(enc, Int4Codec())
    codec.decode_layer(enc.data, SHAPE, 1)
    assert calls == ["quantize_into", "dequantize_into", "transcode_into", "dequantize_layer"]
    calls.clear()
    enc = codec.encode(x, backend="torch")
    codec.decode(enc, backend="torch")
    codec.transcode(enc, Int4Codec(), backend="torch")
    assert calls == []


def test_rotated_codecs_run_natively_on_the_cpu() -> None:
    rot = Int2Codec(rotate=True)
    assert rot.has_native and rot.has_kernels
    x = random_blocks(torch, 1, SHAPE, "fp16", seed=14)
    out = torch.empty((1, rot.bytes_per_block(SHAPE)), dtype=torch.uint8)
    assert rot._implementation("auto", x, out) == "native"
    assert_same(rot.encode(x).data, rot.encode(x, backend="torch").data, "rotated rows")
    with pytest.raises(InvalidArgumentError, match="needs CUDA tensors"):
        rot.encode(x, backend="cuda")
    with pytest.raises(InvalidArgumentError, match="has_native=False"):
        get_codec("fp16").encode(x, backend="native")


def test_backend_native_refuses_a_target_without_native_code() -> None:
    enc = Int8Codec().encode(random_blocks(torch, 1, SHAPE, "fp16", seed=15))
    with pytest.raises(InvalidArgumentError, match="codec 'fp16' has_native=False"):
        Int8Codec().transcode(enc, get_codec("fp16"), backend="native")


def test_auto_runs_the_reference_for_pools_that_share_memory() -> None:
    codec = Int8Codec()
    row = codec.bytes_per_block(SHAPE)
    pool = torch.zeros((4, row), dtype=torch.uint8)
    assert codec._implementation("auto", pool[:2], pool[2:]) == "native"
    assert codec._implementation("auto", pool, pool) == "torch"
    # a transcode within one pool, slot to other slot: the same bytes as two pools
    x = random_blocks(torch, 1, SHAPE, "fp16", seed=16)
    codec.encode_into(x, [0], pool, [0])
    codec.transcode_into(pool, [0], codec, pool, [3], SHAPE)
    assert torch.equal(pool[3], pool[0])


# ---- bad input: the right error, and nothing written ------------------------------------------------


def test_native_refuses_bad_pools_and_slots_before_writing() -> None:
    codec = Int4Codec()
    x = random_blocks(torch, 4, SHAPE, "fp16", seed=17)
    packed = torch.zeros((4, codec.bytes_per_block(SHAPE)), dtype=torch.uint8)
    slots = torch.tensor([0, 1])
    cases = [
        (
            "src: expected a contiguous",
            lambda: native.quantize_into(codec, x.transpose(0, 1), slots, packed, slots, SHAPE),
        ),
        (
            "dst: expected slots in [0, 4)",
            lambda: native.quantize_into(codec, x, slots, packed, torch.tensor([0, 4]), SHAPE),
        ),
        (
            "src: expected slots in [0, 4)",
            lambda: native.quantize_into(codec, x, torch.tensor([-1, 0]), packed, slots, SHAPE),
        ),
        (
            "src: expected float16",
            lambda: native.quantize_into(codec, x.double(), slots, packed, slots, SHAPE),
        ),
        (
            "given twice",
            lambda: native.quantize_into(codec, x, slots, packed, torch.tensor([1, 1]), SHAPE),
        ),
        (
            "dst: expected",
            lambda: native.dequantize_layer(codec, packed, slots, x[:3, 0], SHAPE, 0),
        ),
        (
            "has no native",
            lambda: native.quantize_into(get_codec("fp16"), x, slots, packed, slots, SHAPE),
        ),
        (
            "expected as many",
            lambda: native.quantize_into(codec, x, slots, packed, slots[:1], SHAPE),
        ),
    ]
    for match, call in cases:
        with pytest.raises((InvalidArgumentError, TypeError), match=re.escape(match)):
            call()
        assert not packed.any(), match


def test_the_extension_checks_addresses_formats_and_overlaps() -> None:
    codec = Int8Codec()
    shape = BlockShape(1, 1, 2, 4)
    lay = layout(codec, shape)
    dims = (1, 1, 2, 4)
    x = torch.ones((2, *shape.dims))
    rows = torch.zeros((3, codec.bytes_per_block(shape)), dtype=torch.uint8)
    row = rows.shape[1]
    src = np.array([x.data_ptr(), x.data_ptr() + 64], dtype=np.uint64)
    dst = np.array([rows.data_ptr(), rows.data_ptr() + row], dtype=np.uint64)
    bad = [
        ("src: address 0x0", {"src": np.array([0, src[1]], dtype=np.uint64)}),
        ("dst: rows overlap", {"dst": np.array([dst[0], dst[0] + 1], dtype=np.uint64)}),
        ("src and dst rows overlap", {"src": dst}),
        ("expected as many", {"dst": dst[:1]}),
        ("bits: expected 2, 4 or 8", {"layout": np.r_[3, lay[1:]]}),
        ("expected 11 int64s", {"layout": lay[:9]}),
        ("lie past the row", {"layout": np.r_[lay[:9], lay[9] - 2, lay[10]]}),
        ("rotated: expected 0 or 1", {"layout": np.r_[lay[:10], 2]}),
        ("the rotation's 4 signs", {"layout": np.r_[lay[:10], 1]}),
        ("head_dim 4", {"layout": np.r_[lay[:3], 3, lay[4:]]}),
        ("dtype: expected 0", {"dtype": 5}),
        ("heads: expected a positive", {"dims": (1, 0, 2, 4)}),
    ]
    for match, change in bad:
        args = {"src": src, "dst": dst, "layout": lay, "dims": dims, "dtype": 0} | change
        with pytest.raises(InvalidArgumentError, match=re.escape(match)):
            _core.quantize_rows(
                args["src"], args["dst"], args["layout"], args["dims"], args["dtype"]
            )
        assert not rows.any(), match
    _core.quantize_rows(src, dst, lay, dims, 0)
    assert rows[:2].any() and not rows[2].any()
    with pytest.raises(InvalidArgumentError, match="layers"):
        _core.dequantize_rows(dst, src, lay, dims, 0, (1, 1))


# ---- the GIL ------------------------------------------------------------------------------------------


def test_a_native_call_runs_while_python_runs() -> None:
    """One thread transcodes many rows (one block read again and again into distinct rows, on one
    core) while the main thread counts in pure Python, noting the time every 256 iterations: a
    call that held the GIL would freeze the counter for its whole duration (see
    tests/test_core_api.py's GIL test for why counting alone proves nothing)."""
    shape = BlockShape(4, 8, 16, 128)
    a, b = Int8Codec(), Int2Codec()
    one = a.encode(random_blocks(torch, 1, shape, "fp16", seed=18)).data
    n = 600
    dst = torch.empty((n, b.bytes_per_block(shape)), dtype=torch.uint8)
    src_rows = np.full(n, one.data_ptr(), dtype=np.uint64)
    dst_rows = dst.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(dst.shape[1])
    dims = (shape.layers, shape.kv_heads, shape.block_size, shape.head_dim)
    args = (src_rows, layout(a, shape), dst_rows, layout(b, shape), dims)
    started, finished = threading.Barrier(2), threading.Event()
    window = [0.0, 0.0]

    def work() -> None:
        started.wait()
        window[0] = time.perf_counter()
        for _ in range(3):
            _core.transcode_rows(*args, threads=1)
        window[1] = time.perf_counter()
        finished.set()

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    ticks, samples, clock = 0, [], time.perf_counter
    while not finished.is_set():
        ticks += 1
        if ticks % 256 == 0:
            samples.append(clock())
    thread.join()
    slice_s = 0.01
    inside = set(range(int(window[0] / slice_s) + 1, int(window[1] / slice_s)))
    seen = {int(t / slice_s) for t in samples}
    assert len(inside) >= 3, f"the call was too short to tell: {window}"
    share = len(inside & seen) / len(inside)
    assert share > 0.5, f"Python ran in only {share:.0%} of the slices during the native call"
    assert torch.equal(dst[n - 1], a.transcode(encoded(a, shape, one), b).data[0])
