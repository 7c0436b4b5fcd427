"""Fixtures shared by several test files."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def torch_cuda() -> Any:
    """torch, on a machine with a CUDA device and CuPy (the kernels run through it)."""
    torch = pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: the CUDA kernels run through it")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return torch
