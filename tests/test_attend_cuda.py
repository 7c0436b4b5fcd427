"""The CUDA attention kernel (kernels/kvtier_attend.cu through kvtier.attend_cuda) against the torch
reference of the contract (kvtier.attend.reference): every codec and mix of levels, several pools
in one sequence, skipped blocks, odd lengths, one and several queries, several sequences, GQA
ratios 1 to 8, head sizes 64/80/128/256, the split (flash-decoding) path and the row tiles of long
prefills.

Tolerances, against the reference computed in fp32 from the same dequantized values: the output
within 1e-4 (fp32 q), 2e-3 (fp16) or 1.6e-2 (bf16) absolute plus the same relative (one or two
units in the last place of the output dtype: the kernel's exp2 and summation order differ from
torch's); the mass, a probability, within 2e-5.

The GPU tests need a CUDA device and CuPy; the NVRTC compile test needs only CuPy with a loadable
NVRTC, as tests/test_kernels.py's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attend_problems import assert_matches, int4, problem
from kernel_ptx import entry_points, ptx

from kvtier.attend import PoolView, Problem, reference
from kvtier.attend_cuda import (
    ATTEND_THREADS,
    MAX_ROWS,
    MAX_TILE_BLOCKS,
    kernel_source,
    plan,
    shared_bytes,
)
from kvtier.codecs import BlockShape, Codec, Int4Codec, Int8Codec, get_codec

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


# ---- on a GPU: the kernel against the reference ---------------------------------------------------


def _check(torch: Any, *, tables_on_gpu: bool = False, **kw: Any) -> Any:
    """Runs the kernel and the reference on one random problem of
    :func:`attend_problems.problem` on the GPU (``kw``: its options; fp16 queries and random
    lengths unless given) and compares them; returns the launch plan the kernel used."""
    from kvtier.attend import check_problem
    from kvtier.attend_cuda import _device_limits, attend_cuda

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
MIXES: dict[str, tuple[str, list[str | Codec]]] = {
    "fp16": ("fp16", ["fp16"]),
    "bf16": ("bf16", ["bf16"]),
    "fp32": ("fp32", ["fp32"]),
    "int8": ("fp16", ["int8"]),
    "int4": ("fp16", ["int4"]),
    "int8-asym-g8": ("bf16", [Int8Codec(asymmetric=True, group_size=8, name="int8-asym-g8")]),
    "int4-sym-g16": ("fp32", [CUSTOM]),
    "ladder": ("fp16", ["fp16", "int8", "int4"]),
    "bf16-ladder": ("bf16", ["bf16", "int8", "int4", CUSTOM]),
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
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("queries", [1, 3])
def test_gqa_ratios_and_head_sizes_match_the_reference(
    torch_cuda: Any, group: int, head_dim: int, queries: int
) -> None:
    _check(
        torch_cuda,
        codecs=["fp16", "int8", int4(head_dim)],  # int4 in groups of 16 at head_dim 80
        q_heads=2 * group,
        kv_heads=2,
        head_dim=head_dim,
        queries=queries,
        block_size=32 if head_dim == 80 else 16,
        seed=group * 1000 + head_dim,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_odd_lengths_and_many_sequences_match_the_reference(
    torch_cuda: Any, block_size: int
) -> None:
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size + 7, 257, 5]
    _check(torch_cuda, codecs=["int4", "fp16"], lengths=lengths, block_size=block_size)
    # several queries: the causal mask inside and across blocks
    _check(torch_cuda, codecs=["int8", "fp16"], lengths=lengths[2:], queries=3, skip=0.3)


@pytest.mark.gpu
def test_long_contexts_split_the_block_table_and_still_match(torch_cuda: Any) -> None:
    lp = _check(
        torch_cuda,
        codecs=["fp16", "int8", "int4"],
        lengths=[6000],
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        skip=0.05,
    )
    assert lp.splits > 1, "the flash-decoding path is the one tested"
    lp = _check(
        torch_cuda, codecs=["bf16", "int4"], q_dtype="bf16", lengths=[4000, 3001], queries=4
    )
    assert lp.splits > 1


@pytest.mark.gpu
def test_long_prefills_tile_their_rows_and_match(torch_cuda: Any) -> None:
    lp = _check(torch_cuda, codecs=["fp16", "int4"], lengths=[200, 70], queries=60, q_heads=8)
    assert lp.row_tiles > 1 and lp.splits == 1


@pytest.mark.gpu
def test_skipped_blocks_get_no_mass_and_a_query_that_sees_nothing_gets_zeros(
    torch_cuda: Any,
) -> None:
    torch = torch_cuda
    _check(torch, codecs=["fp16", "int8"], skip=0.6, seed=3)
    from kvtier.attend_cuda import attend_cuda

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
    assert mass.cpu().tolist() == pytest.approx(want_mass.tolist(), abs=MASS_TOLERANCE)
    assert mass[0, 0].item() == 0.0 and mass[0, 2].item() == 0.0


@pytest.mark.gpu
def test_a_staging_pool_is_read_at_its_own_layer(torch_cuda: Any) -> None:
    torch = torch_cuda
    from kvtier.attend_cuda import attend_cuda

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
    from kvtier import attend_cuda as module

    _check(torch_cuda, codecs=["int8", "fp16"], tables_on_gpu=True, seed=7)
    held = len(module._descriptors)
    _check(torch_cuda, codecs=["int8", "fp16"], tables_on_gpu=False, seed=7)  # same pools' bytes
    assert len(module._descriptors) <= held + 1


@pytest.mark.gpu
def test_the_kernel_runs_on_the_current_stream(torch_cuda: Any) -> None:
    torch = torch_cuda
    from kvtier.attend_cuda import attend_cuda

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
    from kvtier.attend_cuda import attend_cuda
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
