"""NVRTC compiles of the CUDA kernels for the tests that need no GPU (tests/test_kernels.py,
tests/test_attend_cuda.py): only CuPy with a loadable NVRTC."""

from __future__ import annotations

import re

import pytest


def ptx(source: str, name: str) -> str:
    """``source`` (a loader's ``kernel_source()``: one string, compiled with no include path, as
    the loaders compile it) compiled by NVRTC for sm_90; skips where CuPy or NVRTC is missing,
    fails with NVRTC's log where it rejects the source."""
    pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # libnvrtc missing or unloadable
        pytest.skip(f"NVRTC is not loadable: {exc}")
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "--std=c++17"])
        except nvrtc.NVRTCError as exc:
            pytest.fail(f"NVRTC rejected {name}: {exc}\n{nvrtc.getProgramLog(prog)}")
        out = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return out.decode() if isinstance(out, bytes) else out


def entry_points(ptx: str) -> set[str]:
    """The kernels a PTX module exports."""
    return set(re.findall(r"\.entry\s+(\w+)", ptx))
