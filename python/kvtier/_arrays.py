"""Array arguments of the Rust core: validated and converted here when they are not already a
contiguous 1-D numpy array of the right dtype (the bindings take those zero-copy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgumentError

_INTEGER_RANGES = {"uint8": (0, 255), "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}


def as_array(obj: Any, name: str, dtype: str) -> np.ndarray:
    """``obj`` as a contiguous 1-D array of ``dtype``, or InvalidArgumentError saying why not.

    Integers must fit the target without wrapping (no negative block ids); floats are only
    accepted for float targets. Lists and tuples are fine; 2-D arrays and strings are not.
    """
    if isinstance(obj, (bytes, bytearray)):
        obj = np.frombuffer(obj, np.uint8)  # asarray would make one 0-d string of them
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"{name}: expected a 1-D array of {dtype}, got {type(obj).__name__}"
        ) from e
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"{name}: expected a 1-D array of {dtype}, got shape {arr.shape}"
        )
    target = np.dtype(dtype)
    if arr.size == 0:
        return np.zeros(0, dtype=target)
    if target.kind == "u":
        if arr.dtype.kind not in "iub":
            raise InvalidArgumentError(f"{name}: expected integers ({dtype}), got {arr.dtype}")
        if np.can_cast(arr.dtype, target, "safe"):  # nothing to wrap: skip two passes over it
            return np.ascontiguousarray(arr, dtype=target)
        lo, hi = _INTEGER_RANGES[dtype]
        if int(arr.min()) < lo or int(arr.max()) > hi:
            raise InvalidArgumentError(
                f"{name}: values must lie in [{lo}, {hi}] for {dtype}, got [{arr.min()}, {arr.max()}]"
            )
    elif arr.dtype.kind not in "iuf":
        raise InvalidArgumentError(f"{name}: expected numbers ({dtype}), got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=target)
