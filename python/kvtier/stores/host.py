"""Values in this process's memory: pinned (page-locked) buffers when CUDA is in use, so a
device copy from them runs as DMA, else plain bytes."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._core import HostValues
from .base import BudgetedStore, log
from .format import Namespace

#: The calls a host store answers in one call into the extension.
_ONE_CALL = ("put", "put_many", "get", "get_many", "pop", "contains", "delete_many")


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class HostStore(BudgetedStore):
    """A byte budget of host memory. When a put does not fit, the values ``policy`` ranks
    lowest are evicted (the core's policies, see :class:`kvtier._core.StoreIndex`; a value
    larger than the whole budget is refused). Thread-safe.

    ``pin``: keep values in pinned memory (default: when torch is imported and sees CUDA).

    A put or a get is one call into the extension (``_core.HostValues``): the key, the header,
    the copy, the index and the counters in Rust, so a call costs a few tenths of a microsecond
    beside its copy. Values are private buffers of this process, handed out read-only: the
    header is checked on every get (namespace, key, codec, shape); no checksum is computed or
    verified.
    """

    kind = "host"
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
        alloc = self._pinned if self.pin else None
        self._bind(HostValues(self._index, self.stats, namespace, self._corrupt, alloc))

    def with_namespace(self, namespace: Namespace) -> HostStore:
        view = super().with_namespace(namespace)
        assert isinstance(view, HostStore)
        view._bind(self._values.view(namespace, view._corrupt))
        return view

    def _bind(self, values: HostValues) -> None:
        """Makes the public calls ``values``' own methods on this instance: a caller's call goes
        straight into the extension, without a Python frame on the way (a fifth of a small
        get). The methods below do the same for a call through the class."""
        self._values = values
        for name in _ONE_CALL:
            setattr(self, name, getattr(values, name))

    def describe(self) -> str:
        pinned = ", pinned" if self.pin else ""
        return f"host store ({self.used_bytes}/{self.budget} B, {self.policy}{pinned})"

    @staticmethod
    def _pinned(size: int) -> np.ndarray:
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()

    def _corrupt(self, key: str, reason: str) -> None:
        log.warning("%s: %s is not served: %s", self.describe(), key, reason)

    # -- the public API, each one call ----------------------------------------------------------

    def put(self, key: str | int, value: Any) -> bool:
        return self._values.put(key, value)

    def put_many(self, keys: Sequence[str | int], values: Sequence[Any]) -> list[bool]:
        return self._values.put_many(keys, values)

    def get(self, key: str | int) -> memoryview | None:
        return self._values.get(key)

    def get_many(self, keys: Sequence[str | int]) -> list[memoryview | None]:
        return self._values.get_many(keys)

    def pop(self, key: str | int) -> memoryview | None:
        return self._values.pop(key)

    def contains(self, key: str | int) -> bool:
        return self._values.contains(key)

    def contains_many(self, keys: Sequence[str | int]) -> list[bool]:
        return [self._values.contains(k) for k in keys]

    def delete_many(self, keys: Sequence[str | int]) -> list[bool]:
        return self._values.delete_many(keys)

    # -- the rest of KVStore -------------------------------------------------------------------

    def _scan(self, prefix: str) -> Iterable[str]:
        return self._values.scan(prefix)

    def _close(self) -> None:
        self._values.close()
