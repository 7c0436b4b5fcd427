"""CUDA execution of the quantized codecs: kernels/kvtier_codecs.cu through CuPy.

The source ships inside the extension module (``kvtier._core.kernel_sources()``), is compiled
by NVRTC once per device and process after kernels/kvtier_common.cuh (:func:`kernel_source` and
:func:`compiled`, which the attention kernel's loader uses too), and every call is one launch
for the whole batch, on the caller's current torch stream. Tensors cross by DLPack without a
copy; the codecs' argument checks (codecs/base.py) have run before anything here is called.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from ..errors import InvalidArgumentError, require
from .base import BlockShape, torch_module
from .quant import QuantCodec

if TYPE_CHECKING:
    import torch

KERNEL_FILE = "kvtier_codecs.cu"
#: What every kernel file shares (types, fp16/bf16 conversions): compiled before each one's text.
COMMON_FILE = "kvtier_common.cuh"
#: The repository's kernel files, read when the extension was built before COMMON_FILE existed.
KERNELS_DIR = Path(__file__).resolve().parents[3] / "kernels"
#: NVRTC options; no include path is needed (a kernel is one string: COMMON_FILE, then the file).
NVRTC_OPTIONS = ("--std=c++17",)
THREADS = 128
_DEFAULT_SMEM = 48 * 1024
_SUFFIX = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}


def kernel_source(file: str = KERNEL_FILE) -> str:
    """What NVRTC compiles for kernels/``file``: kernels/kvtier_common.cuh, then the file (after a
    ``#line`` that numbers NVRTC's messages by the file's own lines). Both are the copies the
    extension ships; an extension built before kvtier_common.cuh existed ships kernel files that
    still hold its text, so then both are the repository's files."""
    sources = _core.kernel_sources()
    if COMMON_FILE not in sources:
        sources = {}
        for name in (COMMON_FILE, file):
            path = KERNELS_DIR / name
            if not path.is_file():
                raise InvalidArgumentError(
                    f"{name}: not in this build of kvtier._core, nor at {path}; rebuild kvtier"
                )
            sources[name] = path.read_text()
    return f'{sources[COMMON_FILE]}\n#line 1 "{file}"\n{sources[file]}'


def _cupy() -> Any:
    return require(
        "cupy",
        "cuda13",
        purpose="kvtier's CUDA kernels need CuPy (cupy-cuda13x; cuda12 for CUDA 12 builds of torch)",
    )


@functools.cache
def compiled(file: str, device: int) -> Any:
    """kernels/``file`` compiled for ``device`` (a CuPy ``RawModule``), once per process."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source(file), options=NVRTC_OPTIONS)
        module.compile()
    return module


def layout(codec: QuantCodec, shape: BlockShape) -> np.ndarray:
    """The 10 int64s that describe a packed format to the kernels (``struct Layout``)."""
    off = codec.offsets(shape)
    return np.array(
        [
            codec.bits,
            int(codec.asymmetric),
            int(codec.key_per_channel),
            codec.group(shape),
            off["codes"],
            off["k_scale"],
            off.get("k_zero", 0),
            off["v_scale"],
            off.get("v_zero", 0),
            codec.bytes_per_block(shape),
        ],
        dtype=np.int64,
    )


def shared_bytes(codec: QuantCodec, shape: BlockShape) -> int:
    """Dynamic shared memory of a quantizing tile: the padded fp32 tile, scales, zero points."""
    groups = max(codec.key_groups(shape), codec.value_groups(shape))
    return 4 * (shape.block_size * (shape.head_dim + 1) + 2 * groups)


def _quant(codec: Any) -> QuantCodec:
    if not isinstance(codec, QuantCodec):
        raise TypeError(f"codec {codec.name!r} has no CUDA kernels")
    return codec


def _as_cupy(t: torch.Tensor) -> Any:
    torch = torch_module()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)  # CuPy has no bfloat16; the kernels read raw 16-bit words
    return _cupy().from_dlpack(t)


def torch_stream(index: int) -> Any:
    """The current torch stream of device ``index`` as a CuPy stream, to launch on inside a
    ``with``: through the CUDA stream protocol where CuPy and torch speak it (CuPy 14 deprecates
    ``ExternalStream``), else by its raw handle."""
    cupy, torch = _cupy(), torch_module()
    stream = torch.cuda.current_stream(index)
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, index)


def _launch(
    name: str, device: torch.device, grid: int, args: tuple[Any, ...], smem: int = 0
) -> None:
    if grid == 0:
        return
    cupy, torch = _cupy(), torch_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = compiled(KERNEL_FILE, index).get_function(name)
    if smem > _DEFAULT_SMEM:
        fn.max_dynamic_shared_size_bytes = smem
    with cupy.cuda.Device(index), torch_stream(index):
        fn((grid,), (THREADS,), args, shared_mem=smem)


def _dims(shape: BlockShape) -> tuple[np.int32, ...]:
    return tuple(
        np.int32(v) for v in (shape.layers, shape.kv_heads, shape.block_size, shape.head_dim)
    )


# A layout depends only on (format, shape); keep its device copy instead of uploading 80 bytes
# from pageable memory (a synchronous copy) before every launch.
_layouts: dict[tuple[str, BlockShape, str], Any] = {}


def _device_layout(codec: QuantCodec, shape: BlockShape, device: torch.device) -> Any:
    key = (codec.format, shape, str(device))
    if key not in _layouts:
        torch = torch_module()
        _layouts[key] = _as_cupy(torch.from_numpy(layout(codec, shape)).to(device))
    return _layouts[key]


def _pools(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> tuple[Any, ...]:
    return _as_cupy(src), _as_cupy(src_slots), _as_cupy(dst), _as_cupy(dst_slots)


def quantize_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Float pool rows -> packed pool rows: one CUDA block per (slot, layer, K/V, head)."""
    q = _quant(codec)
    n = int(src_slots.numel())
    args = (*_pools(src, src_slots, dst, dst_slots), _device_layout(q, shape, src.device))
    grid = n * shape.layers * 2 * shape.kv_heads
    _launch(
        f"kvtier_quantize_{_SUFFIX[shape.dtype]}",
        src.device,
        grid,
        (*args, *_dims(shape)),
        shared_bytes(q, shape),
    )


def dequantize_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed pool rows -> float pool rows (dtype of ``dst``): one thread per code byte."""
    q = _quant(codec)
    n = int(src_slots.numel())
    code_bytes = n * shape.elements * q.bits // 8
    grid = min(-(-code_bytes // THREADS), 65535 * 32)
    args = (
        *_pools(src, src_slots, dst, dst_slots),
        _device_layout(q, shape, src.device),
        np.int64(n),
    )
    _launch(f"kvtier_dequantize_{_SUFFIX[shape.dtype]}", src.device, grid, (*args, *_dims(shape)))


def transcode_into(
    codec: Any,
    src: torch.Tensor,
    src_slots: torch.Tensor,
    to: Any,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    shape: BlockShape,
) -> None:
    """Packed rows of one format -> packed rows of another, dequantized in shared memory only."""
    a, b = _quant(codec), _quant(to)
    n = int(src_slots.numel())
    args = (
        _as_cupy(src),
        _as_cupy(src_slots),
        _device_layout(a, shape, src.device),
        _as_cupy(dst),
        _as_cupy(dst_slots),
        _device_layout(b, shape, src.device),
        *_dims(shape),
    )
    grid = n * shape.layers * 2 * shape.kv_heads
    _launch("kvtier_transcode", src.device, grid, args, shared_bytes(b, shape))
