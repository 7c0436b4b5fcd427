"""torch, imported where it is used: the module itself, kvtier's dtype names, tensor arguments,
and whether CuPy (the CUDA kernels' loader) is importable: where it is not, calls on CUDA
tensors fall back to the torch reference, and the first one warns, once per process.

A bottom-floor module: the codecs, the attention kernels and the manager import it; it imports
nothing of kvtier's but its errors, and neither torch nor CuPy until a function asks for them
(``import kvtier`` needs only numpy).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
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


log = logging.getLogger("kvtier.cuda")


@functools.cache
def cupy_missing() -> str | None:
    """Why CuPy does not import in this process (its ImportError), or None when it does. Tried
    once: a failed import searches the path again at every try, and the codecs ask per call."""
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def cupy_extra() -> str:
    """The extra that installs the CuPy build for this torch's CUDA: ``cuda12`` for a CUDA 12
    build, else ``cuda13`` (pyproject.toml names both)."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) or ""
    return "cuda12" if cuda.startswith("12.") else "cuda13"


def cuda_kernels() -> tuple[str, str | None]:
    """What runs kvtier's kernels on CUDA tensors in this process: ``("cuda", None)`` (its CUDA
    kernels, through CuPy), or ``("torch", why)``: the torch reference, and why, with the
    command that installs CuPy. Asking warns nothing."""
    missing = cupy_missing()
    if missing is None:
        return "cuda", None
    return "torch", (
        f"kvtier's CUDA kernels need CuPy, which does not import ({missing}): calls on CUDA "
        f"tensors run the torch reference instead, slower; install it with "
        f"pip install 'kvtier[{cupy_extra()}]'"
    )


_fallback: str | None = None
_fallback_lock = threading.Lock()


def cupy_available() -> bool:
    """Whether CuPy imports (the CUDA kernels run through it). Asked where a call on CUDA
    tensors would launch them: when it does not, that call runs the torch reference, and the
    first such call of the process logs a warning (logger ``kvtier.cuda``) that says what to
    install; :func:`cuda_fallback` keeps it for the stats."""
    if cupy_missing() is None:
        return True
    global _fallback
    if _fallback is None:
        with _fallback_lock:
            if _fallback is None:  # once per process, whichever thread comes first
                _fallback = cuda_kernels()[1]
                log.warning("%s", _fallback)
    return False


def cuda_fallback() -> str | None:
    """Why calls on CUDA tensors in this process ran the torch reference rather than kvtier's
    CUDA kernels, with what to install; None while none has (no call on CUDA tensors needed
    the kernels, or CuPy imports)."""
    return _fallback


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
