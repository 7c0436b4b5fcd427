"""Whole blocks of K/V that live outside the manager, in an engine's own paged cache: what
:meth:`BlockManager.append_blocks` takes besides a tensor, and what
:meth:`BlockManager.load_blocks` writes. A CPU manager checks such blocks where they lie and
copies each once, between the engine's cache and its level-0 pool (no staging copy in kvtier's
form on the way); blocks at other levels are decoded and written.
:class:`~kvtier.integrations.vllm.paged.PagedBlocks` is one, over vLLM's caches.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from ..codecs.base import BlockShape

__all__ = ["ExternalBlocks"]


class ExternalBlocks(ABC):
    """Whole blocks of one layer held outside the manager, in kvtier's form once read:
    ``[len(self), 2, kv_heads, block_size, head_dim]`` (K then V) of :attr:`dtype` on
    :attr:`device`. ``pick`` selects some of them (a bool mask or indices)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def dims(self) -> tuple[int, int, int]:
        """``(kv_heads, block_size, head_dim)`` of every block."""

    @property
    @abstractmethod
    def dtype(self) -> Any: ...

    @property
    @abstractmethod
    def device(self) -> Any: ...

    @abstractmethod
    def key_norms(self, limit: float = math.inf) -> np.ndarray:
        """Per token, block by block, the mean over heads of its key's norm (float32, ``len(self)
        * block_size`` values), once K and V are known to be finite and of magnitude at most
        ``limit``; raises :class:`~kvtier.InvalidArgumentError` if they are not (the message
        of :func:`kvtier.manager.checks.refusal`). Writes nothing."""

    @abstractmethod
    def copy_to(
        self,
        addresses: np.ndarray,
        pick: np.ndarray | None = None,
        *,
        measure: bool = False,
        limit: float = math.inf,
    ) -> np.ndarray | None:
        """Copies blocks ``pick`` (every one when None) in kvtier's form to the CPU memory at
        ``addresses`` (uint64, one per block copied, each ``2 * kv_heads * block_size *
        head_dim`` contiguous elements of :attr:`dtype` the caller owns). With ``measure``,
        each is checked on the way (as :meth:`key_norms` checks, within ``limit``) and the
        copied blocks' :meth:`key_norms` returned; on a refusal some blocks may have been
        copied."""

    @abstractmethod
    def copy_from(self, addresses: np.ndarray, pick: np.ndarray | None = None) -> None:
        """:meth:`copy_to` backwards: the memory at ``addresses`` into blocks ``pick``."""

    @abstractmethod
    def read(self) -> torch.Tensor:
        """The blocks as a new tensor in kvtier's form, on :attr:`device`."""

    @abstractmethod
    def write(self, blocks: torch.Tensor, pick: np.ndarray | None = None) -> None:
        """Writes ``blocks`` (kvtier's form, of :attr:`dtype`, on any device) into blocks
        ``pick``."""


def check_external(source: ExternalBlocks, shape: BlockShape, dtype: Any) -> None:
    """Refuses a source whose blocks are not ``shape``'s or not of ``dtype``."""
    want = (shape.kv_heads, shape.block_size, shape.head_dim)
    if tuple(source.dims) != want:
        raise InvalidArgumentError(
            f"blocks: expected blocks of [{want[0]} kv_heads, {want[1]} block_size, {want[2]} "
            f"head_dim], got a {type(source).__name__} of {list(source.dims)}"
        )
    if source.dtype != dtype:
        raise InvalidArgumentError(
            f"blocks: expected dtype {dtype} (the model dtype of this manager), got {source.dtype}"
        )
