"""Values in this process's memory: pinned (page-locked) buffers when CUDA is in use, so a
device copy from them runs as DMA, else plain bytes."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .base import KVStore, Parts
from .format import Namespace, seal_joined


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class HostStore(KVStore):
    """A byte budget of host memory. When a put does not fit, the least recently used values
    are evicted (a value larger than the whole budget is refused). Thread-safe.

    ``pin``: keep values in pinned memory (default: when torch is imported and sees CUDA).
    """

    kind = "host"
    # Values are private buffers of this process, handed out read-only: the header is still
    # checked on every get (namespace, key, codec, shape), the payload checksum is not.
    verify_checksum = False

    def __init__(self, namespace: Namespace, budget: int, *, pin: bool | None = None) -> None:
        super().__init__(namespace)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise InvalidArgumentError(f"budget: expected bytes >= 0, got {budget!r}")
        self.budget = budget
        self.pin = _cuda_in_use() if pin is None else bool(pin)
        self._values: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def describe(self) -> str:
        return f"host store ({self._bytes}/{self.budget} B{', pinned' if self.pin else ''})"

    @staticmethod
    def _pinned(size: int) -> np.ndarray:
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()

    def _seal(self, key: str, payload: memoryview) -> Parts:
        # One copy, checksummed on the way, straight into the buffer the store keeps.
        if self.pin:
            return (seal_joined(self.namespace, key, payload, alloc=self._pinned),)
        return (seal_joined(self.namespace, key, payload),)

    def _put(self, keys: list[str], values: list[Parts]) -> list[bool]:
        done = []
        for key, (buf,) in zip(keys, values, strict=True):
            size = len(buf)
            if size > self.budget:
                done.append(False)
                continue
            evicted = 0
            with self._lock:
                old = self._values.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                while self._bytes + size > self.budget:
                    _, gone = self._values.popitem(last=False)
                    self._bytes -= len(gone)
                    evicted += 1
                self._values[key] = buf
                self._bytes += size
            if evicted:
                self._evicted(evicted)
            done.append(True)
        return done

    def _get(self, keys: list[str]) -> list[Any]:
        out = []
        with self._lock:
            for key in keys:
                blob = self._values.get(key)
                if blob is not None:
                    self._values.move_to_end(key)
                out.append(blob)
        return out

    def _pop(self, key: str) -> Any:
        with self._lock:
            blob = self._values.pop(key, None)
            if blob is not None:
                self._bytes -= len(blob)
        return blob

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._values

    def _delete(self, keys: list[str]) -> list[bool]:
        return [self._pop(k) is not None for k in keys]

    def _discard_corrupt(self, key: str) -> None:
        self._pop(key)

    def _scan(self, prefix: str) -> Iterable[str]:
        with self._lock:
            return [k for k in self._values if k.startswith(prefix)]

    def _close(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
