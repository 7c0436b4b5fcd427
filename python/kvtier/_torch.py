"""torch, imported where it is used: the module itself, kvtier's dtype names, tensor arguments,
and whether CuPy (the CUDA kernels' loader) is importable.

A bottom-floor module: the codecs, the attention kernels and the manager import it; it imports
nothing of kvtier's but its errors, and neither torch nor CuPy until a function asks for them
(``import kvtier`` needs only numpy).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidArgumentError, require

if TYPE_CHECKING:
    import torch

#: Storage dtypes by kvtier name: (torch dtype attribute, bytes).
DTYPES: dict[str, tuple[str, int]] = {
    "fp16": ("float16", 2),
    "bf16": ("bfloat16", 2),
    "fp32": ("float32", 4),
    "u8": ("uint8", 1),
}

_NEEDS_TORCH = "kvtier's codecs need torch"


def torch_module() -> Any:
    """torch, or a MissingDependencyError naming the extra that installs it."""
    torch = sys.modules.get("torch")  # the hot paths call this: skip the import machinery
    return torch if torch is not None else require("torch", "torch", purpose=_NEEDS_TORCH)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a kvtier dtype name (a key of :data:`DTYPES`)."""
    return getattr(torch_module(), DTYPES[name][0])


def dtype_name(dtype: torch.dtype) -> str:
    """The kvtier name of a torch dtype, or InvalidArgumentError."""
    for name, (attr, _) in DTYPES.items():
        if getattr(torch_module(), attr) == dtype:
            return name
    raise InvalidArgumentError(f"unsupported dtype {dtype}")


def cupy_available() -> bool:
    """Whether CuPy imports (the CUDA kernels run through it)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def as_tensor(value: Any, what: str) -> torch.Tensor:
    """A torch view of any DLPack producer (torch, CuPy, numpy ...), without a copy."""
    torch = torch_module()
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__dlpack__"):
        return torch.from_dlpack(value)
    raise InvalidArgumentError(
        f"{what}: expected a torch tensor or a DLPack array (CuPy, numpy ...), "
        f"got {type(value).__name__}"
    )


def all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN nor inf (on a GPU: a synchronising read of one flag)."""
    torch = torch_module()
    if x.device.type != "cpu":
        return bool(torch.isfinite(x).all())
    # numpy: a fraction of torch's cost on the CPU (for bf16, 10x: torch has no fast path).
    if x.dtype == torch.bfloat16:  # non-finite: every exponent bit set
        bits = x.view(torch.int16).numpy()
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(x.numpy()).all())
