"""The rotation of rotated codecs (``rotate=True``, :mod:`.quant`): ``H = S diag(signs)``, ``S``
Sylvester's ``D x D`` Hadamard matrix (entries ±1, ``S S = D I``; ``D`` a power of two), ``signs``
fixed random ±1 per column (QuaRot's choice, Ashkboos et al., 2024). A rotated codec stores each
K/V head vector ``x`` as ``x @ H / D`` (spreading its outlier channels over all of them, which is
what 2-bit groups cannot hold) and decodes ``y @ H.T``.

Both products run as Sylvester's transform (``log2(D)`` passes of butterflies ``(a, b) -> (a + b,
a - b)``) and one multiply by the signs (over ``D``), in the order the native code
(``crates/kvtier-attend/src/rotation.rs``) and the CUDA kernels (``kernels/kvtier_common.cuh``)
take, so all three round alike and write the same bytes. Below :mod:`.quant`, :mod:`.native` and
:mod:`.cuda`, which all take the signs from here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from .._torch import torch_module

if TYPE_CHECKING:
    import torch

__all__ = ["hadamard", "hadamard_signs", "rotated", "unrotated"]


def hadamard(dim: int, device: Any) -> torch.Tensor:
    """The ``[dim, dim]`` matrix ``H`` (entries ±1, ``H @ H.T == dim * I``), for checks: the
    codecs never multiply by it."""
    return _hadamard_cpu(dim).to(device)


@functools.cache
def hadamard_signs(dim: int) -> np.ndarray:
    """The column signs of the ``dim``-wide rotation (the first row of :func:`hadamard`, since
    Sylvester's is all ones), float32 ±1: what the native code and the kernels take to rotate
    (read-only)."""
    signs = _hadamard_cpu(dim)[0].numpy().astype(np.float32)
    signs.flags.writeable = False
    return signs


def rotated(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / D`` along the last axis: Sylvester's transform, then one multiply by
    ``signs / D`` (exact: ±2^-k), then ``+ 0`` (a zero comes out +0: a group holding both zeros
    has no one minimum, and torch's reduction picks either)."""
    torch = torch_module()
    D = x.shape[-1]
    scale = torch.from_numpy(hadamard_signs(D) / np.float32(D)).to(x.device)
    return walsh_hadamard(x).mul_(scale).add_(0.0)


def unrotated(y: torch.Tensor) -> torch.Tensor:
    """``y @ H.T`` along the last axis: the signs, then Sylvester's transform."""
    torch = torch_module()
    signs = torch.from_numpy(hadamard_signs(y.shape[-1]).copy()).to(y.device)
    return walsh_hadamard(y * signs)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ S`` along the last axis: pass ``h`` = 1, 2, 4 ... turns each pair of entries ``h``
    apart within a run of ``2h`` into their sum and difference, each one fp32 operation."""
    torch = torch_module()
    *lead, D = x.shape
    h = 1
    while h < D:
        pairs = x.reshape(*lead, D // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, D)
        h *= 2
    return x


@functools.cache
def _hadamard_cpu(dim: int) -> torch.Tensor:
    torch = torch_module()
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    # fixed signs (a seeded generator: the same matrix on every machine, so stored rows decode)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return h * signs.float()[None, :]
