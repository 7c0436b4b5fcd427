"""CuPy and NVRTC for kvtier's CUDA kernels: the kernel sources, their compilation, the device
and stream a launch goes on.

A bottom-floor module shared by the codecs' kernels (:mod:`kvtier.codecs.cuda`) and the
attention kernel (:mod:`kvtier.attend.cuda`); it knows no codec nor attention call. The sources
ship inside the extension module (``kvtier._core.kernel_sources()``); each kernel file is
compiled by NVRTC once per device and process, after kernels/kvtier_common.cuh. CuPy is
imported when a function needs it, never at import (``import kvtier`` needs only numpy).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _core
from ._torch import torch_module
from .errors import InvalidArgumentError, require

if TYPE_CHECKING:
    import torch

#: What every kernel file shares (types, fp16/bf16 conversions): compiled before each one's text.
COMMON_FILE = "kvtier_common.cuh"
#: The repository's kernel files, read when the extension was built before COMMON_FILE existed.
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
#: NVRTC options; no include path is needed (a kernel is one string: COMMON_FILE, then the file).
NVRTC_OPTIONS = ("--std=c++17",)
#: Dynamic shared memory a CTA gets without opting in to more.
DEFAULT_SHARED_BYTES = 48 * 1024


def cupy() -> Any:
    """CuPy, or a MissingDependencyError naming the extra that installs it."""
    return require(
        "cupy",
        "cuda13",
        purpose="kvtier's CUDA kernels need CuPy (cupy-cuda13x; cuda12 for CUDA 12 builds of torch)",
    )


def kernel_source(file: str) -> str:
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


@functools.cache
def compiled(file: str, device: int) -> Any:
    """kernels/``file`` compiled for ``device`` (a CuPy ``RawModule``), once per process."""
    cp = cupy()
    with cp.cuda.Device(device):
        module = cp.RawModule(code=kernel_source(file), options=NVRTC_OPTIONS)
        module.compile()
    return module


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (torch's current device when it names none)."""
    return device.index if device.index is not None else torch_module().cuda.current_device()


def torch_stream(index: int) -> Any:
    """The current torch stream of device ``index`` as a CuPy stream, to launch on inside a
    ``with``: through the CUDA stream protocol where CuPy and torch speak it (CuPy 14 deprecates
    ``ExternalStream``), else by its raw handle."""
    cp, torch = cupy(), torch_module()
    stream = torch.cuda.current_stream(index)
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cp.cuda.Stream.from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream, index)
