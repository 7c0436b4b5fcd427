"""Values in this process's memory: pinned (page-locked) buffers when CUDA is in use, so a
device copy from them runs as DMA, else plain bytes."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from .base import BudgetedStore, StoredForm
from .format import Namespace, seal_joined


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class HostStore(BudgetedStore):
    """A byte budget of host memory. When a put does not fit, the values ``policy`` ranks
    lowest are evicted (the core's policies, see :class:`kvtier._core.StoreIndex`; a value
    larger than the whole budget is refused). Thread-safe.

    ``pin``: keep values in pinned memory (default: when torch is imported and sees CUDA).
    """

    kind = "host"
    # Values are private buffers of this process, handed out read-only: the header is still
    # checked on every get (namespace, key, codec, shape); no checksum is computed or verified.
    checksummed = False

    def __init__(
        self,
        namespace: Namespace,
        budget: int,
        *,
        policy: str = "lru",
        pin: bool | None = None,
    ) -> None:
        super().__init__(namespace, budget, policy)
        self.pin = _cuda_in_use() if pin is None else bool(pin)
        self._values: dict[str, Any] = {}

    def describe(self) -> str:
        pinned = ", pinned" if self.pin else ""
        return f"host store ({self.used_bytes}/{self.budget} B, {self.policy}{pinned})"

    @staticmethod
    def _pinned(size: int) -> np.ndarray:
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()

    def _seal(self, key: str, payload: memoryview) -> StoredForm:
        # One copy, straight into the buffer the store keeps.
        alloc = self._pinned if self.pin else None
        return (seal_joined(self.namespace, key, payload, alloc, checksummed=False),)

    def _put(self, keys: list[str], values: list[StoredForm]) -> list[bool]:
        done = []
        evicted = 0
        with self._lock:
            for key, (buf,) in zip(keys, values, strict=True):
                victims = self._index.admit(key, len(buf))
                if victims is None:
                    done.append(False)  # larger than the whole budget
                    continue
                for v in victims:
                    del self._values[v]
                evicted += len(victims)
                self._values[key] = buf
                done.append(True)
        if evicted:
            self._evicted(evicted)
        return done

    def _get(self, keys: list[str]) -> list[Any]:
        with self._lock:
            out = [self._values.get(key) for key in keys]
            self._index.touch([k for k, v in zip(keys, out, strict=True) if v is not None])
        return out

    def _pop(self, key: str) -> Any:
        with self._lock:
            self._index.remove(key)
            return self._values.pop(key, None)

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
            for key in self._values:
                self._index.remove(key)
            self._values.clear()
