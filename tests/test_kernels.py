"""The CUDA codec kernels (kernels/kvtier_codecs.cu): the sources the extension ships are the files
in the repository, and the loader's source (kernels/kvtier_common.cuh, then the kernel file)
compiles with NVRTC (no GPU needed); on a GPU every kernel writes the
same bytes and values as the torch reference on the CPU: codes and scales bit-exact, decodes
equal, transcodes byte-equal, pool calls touching only their slots."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
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
from kernel_ptx import entry_points
from kernel_ptx import ptx as compile_ptx

from kvtier import _core
from kvtier.codecs import BlockShape, Int2Codec, Int4Codec, Int8Codec, get_codec
from kvtier.codecs.cuda import kernel_source

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
ENTRY_POINTS = [
    "kvtier_quantize_f16",
    "kvtier_quantize_bf16",
    "kvtier_quantize_f32",
    "kvtier_dequantize_f16",
    "kvtier_dequantize_bf16",
    "kvtier_dequantize_f32",
    "kvtier_dequantize_rotated_f16",
    "kvtier_dequantize_rotated_bf16",
    "kvtier_dequantize_rotated_f32",
    "kvtier_transcode",
]


# ---- the shipped source (no GPU) ----------------------------------------------------------------


def test_the_extension_ships_the_kernel_files_of_the_repository() -> None:
    sources = _core.kernel_sources()
    for name in ("kvtier_common.cuh", "kvtier_codecs.cu", "kvtier_attend.cu"):
        assert name in sources, f"{name}: not in the extension (rebuild it)"
        assert sources[name].encode() == (KERNELS / name).read_bytes(), f"{name}: rebuild"


def test_the_loader_compiles_the_common_file_before_each_kernel_file(monkeypatch: Any) -> None:
    common = (KERNELS / "kvtier_common.cuh").read_text()
    want = {
        name: f'{common}\n#line 1 "{name}"\n{(KERNELS / name).read_text()}'
        for name in ("kvtier_codecs.cu", "kvtier_attend.cu")
    }
    for name in want:
        assert kernel_source(name) == want[name]
    assert kernel_source() == want["kvtier_codecs.cu"]
    # an extension built before the common file: its kernel files hold that text themselves, so
    # the repository's files are compiled instead
    stale = dict.fromkeys(want, "// self-contained")
    monkeypatch.setattr(_core, "kernel_sources", lambda: stale)
    for name in want:
        assert kernel_source(name) == want[name]


@pytest.fixture(scope="module")
def ptx() -> str:
    """The loader's source compiled by NVRTC for sm_90, as kvtier._cuda compiles it (no include
    path)."""
    return compile_ptx(kernel_source(), "kvtier_codecs.cu")


def test_the_kernels_compile_with_nvrtc_and_export_every_entry_point(ptx: str) -> None:
    # plain extern "C" names, none missing, no extras
    assert entry_points(ptx) == set(ENTRY_POINTS)


def test_the_compiled_kernels_never_fuse_the_rounding_steps(ptx: str) -> None:
    # bit-exact codes need every step of the rounding rule as its own IEEE fp32 operation
    assert not re.search(r"\bfma\.\w+\.f32\b", ptx)
    assert "div.rn.f32" in ptx and "cvt.rni.f32.f32" in ptx and "cvt.rn.f16.f32" in ptx
    assert not re.search(r"\bdiv\.(approx|full)\.f32\b", ptx)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_compiled_kernels_carry_the_reciprocal_of_every_code_range(ptx: str, bits: int) -> None:
    # s = fp16(range * fp32(1/levels)) and fp16(amax * fp32(1/qmax)): the kernels hold the same
    # fp32 constants as quant.py (1/1 needs no multiply), as PTX immediates 0fXXXXXXXX
    levels, qmax = 2**bits - 1, 2 ** (bits - 1) - 1
    for n in (levels, qmax):
        if n > 1:
            word = int(np.float32(1.0 / n).view(np.uint32))
            assert f"0f{word:08X}" in ptx, f"1/{n} of int{bits}"


# ---- on a GPU: the kernels against the torch reference -------------------------------------------


def on_gpu(enc: Any) -> Any:
    return dataclasses.replace(enc, data=enc.data.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [*CODECS, *ROTATED])
def test_gpu_encode_and_decode_equal_the_cpu_reference(
    torch_cuda: Any, which: str, dtype: str, data: str
) -> None:
    torch, codec = torch_cuda, {**CODECS, **ROTATED}[which]()
    x = DATA[data](torch, 3, SHAPE, dtype, seed=1)
    cpu = codec.encode(x, backend="torch")
    gpu = codec.encode(x.cuda(), backend="cuda")
    assert gpu.data.is_cuda and gpu.format == cpu.format and gpu.shape == cpu.shape
    # codes and scales: the rows byte for byte
    assert_same(gpu.data, cpu.data, "encoded rows")
    assert_same(codec.encode(x.cuda()).data, cpu.data, "encoded rows, backend auto")

    out = codec.decode(gpu, backend="cuda")
    assert out.is_cuda and out.dtype == x.dtype
    assert_same(out, codec.decode(cpu, backend="torch"), "decoded in the model dtype")
    for other in DTYPES:
        want = codec.decode(cpu, dtype=tdtype(torch, other), backend="torch")
        assert_same(
            codec.decode(gpu, dtype=tdtype(torch, other), backend="cuda"), want, f"decoded {other}"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize(("src", "dst"), TRANSCODES, ids=[f"{a}-to-{b}" for a, b in TRANSCODES])
def test_gpu_transcode_equals_the_cpu_reference(
    torch_cuda: Any, src: str, dst: str, data: str
) -> None:
    torch = torch_cuda
    a, b = CODECS[src](), CODECS[dst]()
    x = DATA[data](torch, 3, SHAPE, "fp16", seed=2)
    cpu = a.encode(x, backend="torch")
    want = a.transcode(cpu, b, backend="torch")
    got = a.transcode(on_gpu(cpu), b, backend="cuda")
    assert got.format == b.format
    assert_same(got.data, want.data, f"{src} -> {dst} rows")
    # and the CPU transcode is encoding the fp32 decode, so the GPU one is too
    direct = b.encode(a.decode(cpu, dtype=torch.float32, backend="torch"), backend="torch")
    assert_same(got.data, direct.data, "transcode vs encode(decode)")


@pytest.mark.gpu
def test_gpu_transcode_to_a_codec_without_kernels_falls_back(torch_cuda: Any) -> None:
    torch, int8, fp16 = torch_cuda, Int8Codec(), get_codec("fp16")
    x = edge_blocks(torch, 2, SHAPE, "fp16", seed=3)
    cpu = int8.encode(x, backend="torch")
    got = int8.transcode(on_gpu(cpu), fp16)
    assert got.data.is_cuda
    assert_same(got.data, int8.transcode(cpu, fp16).data, "int8 -> fp16 rows")
    assert_same(fp16.decode(got), int8.decode(cpu), "int8 -> fp16 values")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "which", ["int8", "int4", "int4-sym", "int2", "int2-sym", "int2-rot", "int4-rot"]
)
def test_gpu_pool_calls_match_the_cpu_path_slot_for_slot(
    torch_cuda: Any, which: str, dtype: str
) -> None:
    """Encode, decode and transcode between pools, slot for slot (a rotated codec transcodes
    to another rotated one and to a plain one)."""
    torch, codec = torch_cuda, {**CODECS, **ROTATED}[which]()
    to = {
        "int8": Int4Codec(group_size=64),
        "int2-rot": Int2Codec(group_size=64, rotate=True),
    }.get(which, Int8Codec(asymmetric=True))
    row, to_row = codec.bytes_per_block(SHAPE), to.bytes_per_block(SHAPE)
    g = torch.Generator().manual_seed(4)
    src = edge_blocks(torch, 7, SHAPE, dtype, seed=5)
    packed = torch.randint(0, 256, (9, row), dtype=torch.uint8, generator=g)
    floats = random_blocks(torch, 6, SHAPE, dtype, seed=6)
    other = torch.randint(0, 256, (5, to_row), dtype=torch.uint8, generator=g)
    src_slots, dst_slots = [6, 0, 3, 5], [8, 2, 1, 4]

    pools = {"packed": packed, "floats": floats, "other": other}
    results = {}
    for device in ("cpu", "cuda"):
        p = {k: v.clone().to(device) for k, v in pools.items()}
        s = src.to(device)
        backend = "cuda" if device == "cuda" else "torch"
        codec.encode_into(s, src_slots, p["packed"], dst_slots, backend=backend)
        codec.decode_into(p["packed"], [8, 1, 4], p["floats"], [5, 0, 2], backend=backend)
        codec.transcode_into(p["packed"], [2, 8], to, p["other"], [3, 0], SHAPE, backend=backend)
        results[device] = {k: v.cpu() for k, v in p.items()}
    for name in pools:
        assert_same(results["cuda"][name], results["cpu"][name], f"{name} pool")
    # only the named slots changed
    assert torch.equal(results["cuda"]["packed"][[0, 3, 5, 6, 7]], packed[[0, 3, 5, 6, 7]])
    assert torch.equal(results["cuda"]["floats"][[1, 3, 4]], floats[[1, 3, 4]])
    assert torch.equal(results["cuda"]["other"][[1, 2, 4]], other[[1, 2, 4]])


@pytest.mark.gpu
def test_gpu_pool_slots_may_be_cuda_tensors(torch_cuda: Any) -> None:
    torch, codec = torch_cuda, Int4Codec()
    src = random_blocks(torch, 4, SHAPE, "fp16", seed=7)
    packed = torch.zeros((4, codec.bytes_per_block(SHAPE)), dtype=torch.uint8, device="cuda")
    slots = torch.tensor([3, 1], device="cuda")
    codec.encode_into(src.cuda(), slots, packed, slots.flip(0), backend="cuda")
    want = codec.encode(src[[3, 1]], backend="torch").data
    assert_same(packed[[1, 3]], want, "rows")
    assert not packed[[0, 2]].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "names"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_gpu_other_shapes_equal_the_cpu_reference(
    torch_cuda: Any, shape: BlockShape, names: list[str], dtype: str
) -> None:
    torch = torch_cuda
    x = edge_blocks(torch, 2, shape, dtype, seed=8)
    for name in names:
        codec = CODECS[name]()
        cpu = codec.encode(x, backend="torch")
        gpu = codec.encode(x.cuda(), backend="cuda")
        assert_same(gpu.data, cpu.data, f"{name} rows")
        assert_same(codec.decode(gpu, backend="cuda"), codec.decode(cpu), f"{name} values")
    a, b = CODECS[names[0]](), CODECS[names[-1]]()
    cpu = a.encode(x, backend="torch")
    assert_same(
        a.transcode(on_gpu(cpu), b, backend="cuda").data,
        a.transcode(cpu, b, backend="torch").data,
        f"{names[0]} -> {names[-1]} rows",
    )


@pytest.mark.gpu
def test_gpu_kernels_run_on_the_callers_stream(torch_cuda: Any) -> None:
    torch, codec = torch_cuda, Int8Codec()
    x = random_blocks(torch, 64, SHAPE, "fp16", seed=9)
    want = codec.encode(x, backend="torch").data
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = x.to("cuda", non_blocking=True)
        enc = codec.encode(src, backend="cuda")
        out = codec.decode(enc, backend="cuda")
    stream.synchronize()
    assert_same(enc.data, want, "rows on a side stream")
    assert_same(out, codec.decode(codec.encode(x, backend="torch")), "values on a side stream")
