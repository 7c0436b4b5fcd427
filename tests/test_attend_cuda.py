"""The CUDA attention kernel (kernels/kvtier_attend.cu through kvtier.attend.cuda) against the
torch reference of the contract (kvtier.attend.reference): every codec and mix of levels, several
pools in one sequence, skipped blocks, odd lengths, one and several queries, several sequences, GQA
ratios 1 to 8, head sizes 64/80/128/256, the split (flash-decoding) path and the row tiles of long
prefills; int2 wherever int4 (``attend_problems.PACKED``).

Tolerances, against the reference computed in fp32 from the same dequantized values: the output
within 1e-4 (fp32 q), 2e-3 (fp16) or 1.6e-2 (bf16) absolute plus the same relative (one or two
units in the last place of the output dtype: the kernel's exp2 and summation order differ from
torch's); the mass, a probability, within 2e-5.

The GPU tests need a CUDA device and CuPy; the NVRTC compile test needs only CuPy with a loadable
NVRTC, as tests/test_kernels.py's; the host run of the kernel's tile decoder needs a C++ compiler
and torch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attend_problems import PACKED, assert_matches, packed, problem
from kernel_ptx import entry_points, ptx

from kvtier.attend import PoolView, Problem, describe, reference
from kvtier.attend.cuda import (
    ATTEND_THREADS,
    MAX_ROWS,
    MAX_TILE_BLOCKS,
    kernel_source,
    plan,
    shared_bytes,
)
from kvtier.codecs import (
    BlockShape,
    Codec,
    Int2Codec,
    Int4Codec,
    Int8Codec,
    QuantCodec,
    get_codec,
)

TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}
MASS_TOLERANCE = 2e-5
ENTRY_POINTS = {
    f"kvtier_attend{kind}_{suffix}"
    for kind in ("", "_combine")
    for suffix in ("f16", "bf16", "f32")
}


# ---- without a GPU: the source compiles, the launch plan covers the problem ----------------------


def test_the_kernel_compiles_with_nvrtc_and_exports_every_entry_point() -> None:
    compiled = ptx(kernel_source(), "kvtier_attend.cu")
    assert entry_points(compiled) == ENTRY_POINTS
    assert ".local" not in compiled, "no register array spilled to local memory by construction"


@pytest.mark.parametrize("queries", [1, 3, 40])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_launch_plan_covers_every_block_and_row_within_shared_memory(
    queries: int, head_dim: int, block_size: int
) -> None:
    for seqs, q_heads, kv_heads, blocks, sms in [(1, 32, 8, 2048, 132), (64, 8, 1, 40, 16)]:
        p = Problem(seqs, queries, q_heads, kv_heads, block_size, head_dim, blocks, 0, 1.0)
        for max_shared in (227 * 1024, 99 * 1024):
            lp = plan(p, sms, max_shared - 1024)
            rows = q_heads // kv_heads * queries
            assert 1 <= lp.rows_per_cta <= MAX_ROWS and lp.rows_per_cta * lp.row_tiles >= rows
            assert lp.tile_tokens % block_size == 0
            assert lp.tile_tokens // block_size <= MAX_TILE_BLOCKS
            assert lp.blocks_per_split * lp.splits >= blocks > lp.blocks_per_split * (lp.splits - 1)
            assert lp.shared_bytes == shared_bytes(lp.rows_per_cta, lp.tile_tokens, head_dim)
            assert lp.shared_bytes <= max_shared - 1024
            assert lp.out_ctas == 0 if lp.splits == 1 else lp.out_ctas * 8 >= q_heads * queries
    # a long decode with few CTAs splits its block table (flash-decoding)
    assert plan(Problem(1, 1, 32, 8, 16, 128, 2048, 0, 1.0), 132).splits > 1
    assert ATTEND_THREADS % 32 == 0


# The kernel's quantized tile decoder (BlockRef and load_quant_tile, cut from the kernel's source)
# compiled for the host, its CUDA built-ins given host meanings, and run for every thread of a CTA
# one after another (the decoder's threads share nothing but the tile they write).
_HOST_PRELUDE = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;
struct Dim { unsigned x; };
static Dim threadIdx, blockDim;
static float __fmul_rn(float a, float b) { return a * b; }  // -ffp-contract=off: no FMA
static float __fadd_rn(float a, float b) { return a + b; }
static float half_to_float(u16 h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24)
                  : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return (h >> 15) ? -v : v;
}
"""
_HOST_MAIN = r"""
// argv: bits flags group layer valid_tokens H B D kv hk codes k_scale k_zero v_scale v_zero
// row_bytes misalign; the row's bytes on stdin; the tile [B][D + 1] fp32 on stdout
int main(int argc, char** argv) {
    long a[17];
    for (int i = 0; i < 17; ++i) a[i] = std::atol(argv[i + 1]);
    std::vector<u8> buf(a[15] + a[16] + 8);
    if (std::fread(buf.data() + a[16], 1, a[15], stdin) != (size_t)a[15]) return 1;
    BlockRef r;
    r.row = buf.data() + a[16];
    r.kind = 1, r.dtype_or_bits = (int)a[0], r.flags = (int)a[1], r.group = (int)a[2];
    r.layer = (int)a[3], r.valid_tokens = (int)a[4];
    r.codes = a[10], r.scale[0] = a[11], r.zero[0] = a[12], r.scale[1] = a[13], r.zero[1] = a[14];
    const int H = (int)a[5], B = (int)a[6], D = (int)a[7], stride = D + 1;
    std::vector<float> tile(B * stride, NAN);
    blockDim.x = 128;
    for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x)
        load_quant_tile(r, (int)a[8], (int)a[9], H, B, D, tile.data(), stride);
    std::fwrite(tile.data(), sizeof(float), tile.size(), stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_tile_decoder(tmp_path_factory: Any) -> Path:
    """The kernel's load_quant_tile built for the host (skips without a C++ compiler)."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or clang++) to build the tile decoder for the host")
    src = kernel_source()
    flags = re.findall(r"^#define FLAG_\w+ \d+$", src, re.M)
    start = src.index("struct BlockRef {")
    ref = src[start : src.index("};", start) + 2]
    start = src.index("__device__ void load_quant_tile(")
    body = src[start : src.index("\n}\n", start) + 3]
    out: Path = tmp_path_factory.mktemp("tile") / "decode"
    source = out.with_suffix(".cpp")
    source.write_text("\n".join([_HOST_PRELUDE, *flags, ref, body, _HOST_MAIN]))
    cmd = [cxx, "-O1", "-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-o"]
    subprocess.run([*cmd, str(out), str(source)], check=True, capture_output=True)
    return out


#: Codecs whose tiles the host run decodes: (bits, asymmetric, keys per channel, the values'
#: group at most: the largest of 64, 32, 16, 8, 2 up to it that divides head_dim; None: a head)
TILE_CODECS = {
    "int8": (8, False, False, None),
    "int4": (4, True, True, 32),
    "int2": (2, True, True, 32),
    "int2-g64": (2, True, True, 64),
    "int2-sym-ktok-g16": (2, False, False, 16),
    "int2-ktok-g2": (2, True, False, 2),
    "int4-sym-ktok-g8": (4, False, False, 8),
}


@pytest.mark.parametrize("name", list(TILE_CODECS))
@pytest.mark.parametrize(("head_dim", "block_size"), [(8, 32), (24, 16), (64, 16), (80, 1)])
def test_the_kernels_tile_decoder_on_the_host_matches_the_codec(
    host_tile_decoder: Path, name: str, head_dim: int, block_size: int
) -> None:
    """Every (K or V, head) tile of a block decodes, on a host run of the kernel's decoder, to
    the codec's own values bit for bit, and tokens past the valid ones to zeros: the codes of one
    token never spill into the next (head_dim 8 and 24: an int2 token is less than a 4-byte
    word), at any alignment of the row."""
    torch = pytest.importorskip("torch")
    bits, asymmetric, per_channel, most = TILE_CODECS[name]
    group = None
    if most is not None:
        group = max(g for g in (2, 8, 16, 32, 64) if g <= most and head_dim % g == 0)
    codec = QuantCodec(
        name, bits, asymmetric=asymmetric, key_per_channel=per_channel, group_size=group
    )
    shape = BlockShape(2, 2, block_size, head_dim, "fp16")
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size)
    x = torch.randn((1, *shape.dims), generator=gen) * 2
    x[..., 3] *= 4
    rows = codec.encode(x).data.contiguous()
    want = codec.decode_layer(rows, shape, 1, dtype=torch.float32)[0]  # [2, H, B, D]
    desc = describe([PoolView(rows, codec)], shape)[0]
    row = rows[0].numpy().tobytes()
    # (valid tokens, bytes the row lies past an aligned address, K or V, head)
    for valid, misalign, kv, hk in [
        (block_size, 0, 0, 0),
        (block_size, 2, 1, 1),
        (max(1, block_size - 3), 1, 1, 0),
        (1, 0, 0, 1),
    ]:
        args = [
            desc[1], desc[2], desc[8], 1, valid, 2, block_size, head_dim, kv, hk, *desc[9:14],
            len(row), misalign,
        ]  # fmt: skip
        run = subprocess.run(
            [str(host_tile_decoder), *map(str, args)], input=row, capture_output=True, check=True
        )
        tile = np.frombuffer(run.stdout, np.float32).reshape(block_size, head_dim + 1)
        expect = want[kv, hk].clone()
        expect[valid:] = 0.0
        got = torch.from_numpy(tile[:, :head_dim].copy())
        assert torch.equal(got, expect), (name, kv, hk, valid, misalign)


# ---- on a GPU: the kernel against the reference ---------------------------------------------------


def _check(torch: Any, *, tables_on_gpu: bool = False, **kw: Any) -> Any:
    """Runs the kernel and the reference on one random problem of
    :func:`attend_problems.problem` on the GPU (``kw``: its options; fp16 queries and random
    lengths unless given) and compares them; returns the launch plan the kernel used."""
    from kvtier.attend import check_problem
    from kvtier.attend.cuda import _device_limits, attend_cuda

    kw = {"q_dtype": "fp16", "lengths": None, "slots": 48, **kw}
    args = problem(device="cuda", **kw)
    q, lens, block_pool, block_slot, pools, shape, layer, scale = args
    want, want_mass = reference(*args)
    out = torch.full_like(q, float("nan"))
    mass = torch.full(block_pool.shape, float("nan"), device="cuda")
    tables: list[Any] = [lens, block_pool, block_slot]
    if tables_on_gpu:
        tables = [torch.from_numpy(t).cuda() for t in tables]
    attend_cuda(q, out, mass, *tables, pools, shape, layer, scale)
    torch.cuda.synchronize()
    tol = TOLERANCE[kw["q_dtype"]]
    assert_matches(out, mass, want, want_mass, tol=tol, mass_tol=MASS_TOLERANCE)
    return plan(check_problem(*args), *_device_limits(torch.cuda.current_device()))


CUSTOM = Int4Codec(group_size=16, key_per_channel=False, asymmetric=False, name="int4-sym-g16")
CUSTOM_INT2 = Int2Codec(group_size=16, key_per_channel=False, asymmetric=False, name="int2-sym-g16")
MIXES: dict[str, tuple[str, list[str | Codec]]] = {
    "fp16": ("fp16", ["fp16"]),
    "bf16": ("bf16", ["bf16"]),
    "fp32": ("fp32", ["fp32"]),
    "int8": ("fp16", ["int8"]),
    "int4": ("fp16", ["int4"]),
    "int2": ("fp16", ["int2"]),
    "int2-g64": ("fp32", ["int2-g64"]),
    "int8-asym-g8": ("bf16", [Int8Codec(asymmetric=True, group_size=8, name="int8-asym-g8")]),
    "int4-sym-g16": ("fp32", [CUSTOM]),
    "int2-sym-g16": ("fp32", [CUSTOM_INT2]),
    # keys per token, a group a token; values in groups of 2 (the smallest a codec takes)
    "int2-asym-ktok": ("fp16", [Int2Codec(group_size=2, key_per_channel=False, name="int2-ktok")]),
    "ladder": ("fp16", ["fp16", "int8", "int4"]),
    "int2-ladder": ("fp16", ["fp16", "int8", "int4", "int2"]),
    "bf16-ladder": ("bf16", ["bf16", "int8", "int4", CUSTOM]),
    "bf16-int2-ladder": ("bf16", ["bf16", "int8", "int2", CUSTOM_INT2]),
    # rotated codecs: each tile turned back in shared memory
    "int2-rot": ("fp32", ["int2-rot"]),
    "int4-rot": ("fp16", ["int4-rot"]),
    "2bit-ladder": ("fp16", ["fp16", "int2-rot", "int2-rot-g64"]),
    "rotated-and-plain": ("bf16", ["bf16", "int8", "int4-rot", "int2", "int2-rot-g64"]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("queries", [1, 5])
def test_every_codec_and_mix_of_levels_matches_the_reference(
    torch_cuda: Any, mix: str, queries: int
) -> None:
    q_dtype, codecs = MIXES[mix]
    _check(torch_cuda, codecs=codecs, q_dtype=q_dtype, queries=queries, seqs=3)


@pytest.mark.gpu
@pytest.mark.parametrize("low", PACKED)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("queries", [1, 3])
def test_gqa_ratios_and_head_sizes_match_the_reference(
    torch_cuda: Any, low: str, group: int, head_dim: int, queries: int
) -> None:
    _check(
        torch_cuda,
        codecs=["fp16", "int8", packed(low, head_dim)],  # in groups of 16 at head_dim 80
        q_heads=2 * group,
        kv_heads=2,
        head_dim=head_dim,
        queries=queries,
        block_size=32 if head_dim == 80 else 16,
        seed=group * 1000 + head_dim,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("low", PACKED)
@pytest.mark.parametrize("block_size", [16, 32])
def test_odd_lengths_and_many_sequences_match_the_reference(
    torch_cuda: Any, low: str, block_size: int
) -> None:
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size + 7, 257, 5]
    _check(torch_cuda, codecs=[low, "fp16"], lengths=lengths, block_size=block_size)
    # several queries: the causal mask inside and across blocks
    _check(torch_cuda, codecs=["int8", "fp16"], lengths=lengths[2:], queries=3, skip=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("low", [*PACKED, "int2-rot"])
def test_long_contexts_split_the_block_table_and_still_match(torch_cuda: Any, low: str) -> None:
    lp = _check(
        torch_cuda,
        codecs=["fp16", "int8", low],
        lengths=[6000],
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        skip=0.05,
    )
    assert lp.splits > 1, "the flash-decoding path is the one tested"
    lp = _check(torch_cuda, codecs=["bf16", low], q_dtype="bf16", lengths=[4000, 3001], queries=4)
    assert lp.splits > 1


@pytest.mark.gpu
@pytest.mark.parametrize("low", PACKED)
def test_long_prefills_tile_their_rows_and_match(torch_cuda: Any, low: str) -> None:
    lp = _check(torch_cuda, codecs=["fp16", low], lengths=[200, 70], queries=60, q_heads=8)
    assert lp.row_tiles > 1 and lp.splits == 1


@pytest.mark.gpu
def test_skipped_blocks_get_no_mass_and_a_query_that_sees_nothing_gets_zeros(
    torch_cuda: Any,
) -> None:
    torch = torch_cuda
    _check(torch, codecs=["fp16", "int8"], skip=0.6, seed=3)
    from kvtier.attend.cuda import attend_cuda

    shape = BlockShape(1, 1, 16, 64, "fp16")
    pool = PoolView(torch.randn((4, *shape.dims), device="cuda").half(), get_codec("fp16"))
    q = torch.randn((1, 2, 2, 64), device="cuda").half()
    out, mass = torch.full_like(q, float("nan")), torch.full((1, 3), 7.0, device="cuda")
    # block 0 skipped: the first query (position 15) sees nothing, the second sees block 1
    tables = np.array([17], np.int32), np.array([[-1, 0, 0]], np.int32), np.zeros((1, 3), np.int32)
    attend_cuda(q, out, mass, *tables, [pool], shape, 0, 0.125)
    want, want_mass = reference(q, *tables, [pool], shape, 0, 0.125)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(mass.cpu(), want_mass.cpu().float(), atol=MASS_TOLERANCE, rtol=0)
    assert mass[0, 0].item() == 0.0 and mass[0, 2].item() == 0.0


@pytest.mark.gpu
def test_a_staging_pool_is_read_at_its_own_layer(torch_cuda: Any) -> None:
    torch = torch_cuda
    from kvtier.attend.cuda import attend_cuda

    shape = BlockShape(3, 2, 16, 128, "bf16")
    main = PoolView(torch.randn((6, *shape.dims), device="cuda").bfloat16(), get_codec("bf16"))
    staged = torch.randn((6, 1, 2, 2, 16, 128), device="cuda").bfloat16()
    stage = PoolView(staged, get_codec("bf16"), layer_override=0)
    rng = np.random.default_rng(1)
    tables = (
        np.array([90, 33], np.int32),
        rng.integers(0, 2, (2, 6)).astype(np.int32),
        rng.integers(0, 6, (2, 6)).astype(np.int32),
    )
    q = torch.randn((2, 1, 8, 128), device="cuda").bfloat16()
    out, mass = torch.empty_like(q), torch.empty((2, 6), device="cuda")
    attend_cuda(q, out, mass, *tables, [main, stage], shape, 2, 0.1)
    want, want_mass = reference(q, *tables, [main, stage], shape, 2, 0.1)
    torch.testing.assert_close(out, want, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(mass.cpu(), want_mass, atol=MASS_TOLERANCE, rtol=0)


@pytest.mark.gpu
def test_tables_may_be_cuda_tensors_and_descriptors_are_uploaded_once(torch_cuda: Any) -> None:
    from kvtier.attend import cuda as module

    _check(torch_cuda, codecs=["int8", "fp16"], tables_on_gpu=True, seed=7)
    held = len(module._descriptors)
    _check(torch_cuda, codecs=["int8", "fp16"], tables_on_gpu=False, seed=7)  # same pools' bytes
    assert len(module._descriptors) <= held + 1


@pytest.mark.gpu
def test_the_kernel_runs_on_the_current_stream(torch_cuda: Any) -> None:
    torch = torch_cuda
    from kvtier.attend.cuda import attend_cuda

    shape = BlockShape(1, 8, 16, 128, "fp16")
    pool = PoolView(torch.randn((64, *shape.dims), device="cuda").half(), get_codec("fp16"))
    tables = (
        np.array([1000], np.int32),
        np.zeros((1, 63), np.int32),
        np.arange(63, dtype=np.int32)[None],
    )
    q = torch.randn((1, 1, 32, 128), device="cuda").half()
    want, want_mass = reference(q, *tables, [pool], shape, 0, 0.088)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, mass = torch.empty_like(q), torch.empty((1, 63), device="cuda")
        torch.cuda._sleep(10_000_000)  # the kernel queues behind this, on `side`
        attend_cuda(q, out, mass, *tables, [pool], shape, 0, 0.088)
    side.synchronize()
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(mass.cpu(), want_mass, atol=MASS_TOLERANCE, rtol=0)


@pytest.mark.gpu
def test_bad_arguments_raise_before_anything_is_launched(torch_cuda: Any) -> None:
    torch = torch_cuda
    from kvtier.attend.cuda import attend_cuda
    from kvtier.errors import InvalidArgumentError

    shape = BlockShape(1, 1, 16, 64, "fp16")
    pool = PoolView(torch.randn((2, *shape.dims), device="cuda").half(), get_codec("fp16"))
    q = torch.randn((1, 1, 2, 64), device="cuda").half()
    out, mass = torch.empty_like(q), torch.empty((1, 2), device="cuda")
    good = np.array([20], np.int32), np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32)
    with pytest.raises(InvalidArgumentError, match="slot"):
        attend_cuda(q, out, mass, good[0], good[1], good[2] + 5, [pool], shape, 0, 0.1)
    with pytest.raises(InvalidArgumentError, match="mass"):
        attend_cuda(q, out, mass[:, :1], *good, [pool], shape, 0, 0.1)
    with pytest.raises(InvalidArgumentError, match="layer"):
        attend_cuda(q, out, mass, *good, [pool], shape, 1, 0.1)
    slots_on_gpu = torch.from_numpy(good[2] + 5).cuda()
    with pytest.raises(InvalidArgumentError, match="slot"):  # checked on a host copy
        attend_cuda(q, out, mass, good[0], good[1], slots_on_gpu, [pool], shape, 0, 0.1)
    for bad in (float("nan"), float("inf")):  # the kernel would give such a row zeros
        nan_q = q.clone()
        nan_q[0, 0, 1, 7] = bad
        with pytest.raises(InvalidArgumentError, match="q: expected finite values"):
            attend_cuda(nan_q, out, mass, *good, [pool], shape, 0, 0.1)
