"""Reading and writing whole blocks of a paged KV cache the way its attention backend reads them.

vLLM hands each attention layer's cache to connectors as a ``[num_blocks, kv_heads, block_size,
2 * head_dim]`` view (its logical ``[B, H, N, C]``; the memory order behind it varies). The view's
shape is the same everywhere, but *where K and V of a token are* is the backend's business:

- ``channels`` (FLASH_ATTN, TRITON_ATTN, FLASHINFER, FLEX_ATTENTION on CUDA): token ``n`` of
  head ``h`` is ``[b, h, n]``; its first ``head_dim`` channels are K, the rest V.
- vLLM's CPU_ATTN reads each block's ``[H, N, 2D]`` as ``[H, 2, N * D]``: per head, a region of
  K then one of V, each packed for the kernel of the instruction set the backend chose
  (``layer.isa``; vLLM 0.32's ``reshape_and_cache`` in ``csrc/cpu/cpu_attn_*.hpp``):

  - ``cpu-vec`` (ISA ``vec``, ``vec16``): K column-major ``[D, N]``, V row-major ``[N, D]``;
  - ``cpu-amx`` (ISA ``amx``: bf16 with blocks a multiple of 32 on a CPU with AMX): K in tiles
    ``[N / 16, D / 2, 16, 2]`` (16 tokens a tile, channel pairs), V in tiles ``[D / 16, N / 2,
    16, 2]`` (16 channels a tile, token pairs).

  The logical token axis means nothing there: a byte-for-byte copy of a block survives any
  layout, but a codec grouping a token's channels, or a channel's tokens, needs the right one.

Other backends read the same shape otherwise: ROCm's ROCM_ATTN, and its AITER FlashAttention
(which calls itself FLASH_ATTN) with shuffled caches, hold a block as ``[2, N, H * head_dim]``,
which for two KV heads has exactly the accepted shape with another meaning. So the backends are
allow-listed (:data:`BACKEND_LAYOUTS`, CPU_ATTN by ISA), and every other one, and every backend
on ROCm, refused.

A :class:`PagedLayout` moves K/V between such a cache and kvtier's token-major
``[num_tokens, kv_heads, head_dim]`` form, whole blocks at a time, on whatever device the cache
is (the index and the copies stay there); :class:`~.tiers.WorkerTiers` moves them between such
caches and a :class:`~kvtier.BlockManager`. Anything else is refused by :func:`layout_for_backend`
rather than guessed. Nothing here needs vLLM.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..._core import paged_copy, paged_scan
from ..._torch import dtype_name, torch_module
from ...attend import FLOAT_CODES
from ...errors import ConfigError, InvalidArgumentError
from ...manager import ExternalBlocks
from ...manager.checks import refusal

if TYPE_CHECKING:
    import torch

__all__ = ["BACKEND_LAYOUTS", "PagedBlocks", "PagedLayout", "layout_for_backend"]

Split = Literal["channels", "cpu-vec", "cpu-amx"]

#: The attention backends whose paged cache kvtier reads, by ``get_name()`` (CPU_ATTN by
#: ``name:isa``, see :func:`~.config.backend_name`), and where their K and V are (vLLM 0.32:
#: CPU_ATTN's ``cpu_attn_reshape_and_cache``; the CUDA backends' forward passes read
#: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). On ROCm the name is prefixed
#: (``ROCM:``): none is listed.
BACKEND_LAYOUTS: dict[str, Split] = {
    "CPU_ATTN:amx": "cpu-amx",
    "CPU_ATTN:vec": "cpu-vec",
    "CPU_ATTN:vec16": "cpu-vec",
    "FLASH_ATTN": "channels",
    "TRITON_ATTN": "channels",
    "FLASHINFER": "channels",
    "FLEX_ATTENTION": "channels",
}

#: AMX tiles: 16 rows of 64 bytes, i.e. 16 tokens (K) or channels (V) of bf16 pairs.
_TILE = 16


@dataclass(frozen=True)
class PagedLayout:
    """Where K and V of each token sit in one layer's ``[B, H, N, 2D]`` paged cache."""

    split: Split
    num_kv_heads: int
    block_size: int
    head_dim: int

    @property
    def name(self) -> str:
        """Names the layout in stored keys: blocks of one layout never load into another."""
        return f"{self.split}-h{self.num_kv_heads}-n{self.block_size}-d{self.head_dim}"

    def check(self, cache: torch.Tensor, what: str = "kv cache") -> None:
        """Refuses a cache that is not ``[B, H, N, 2D]`` of this layout."""
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
            raise InvalidArgumentError(
                f"{what}: expected a [num_blocks, {want[0]}, {want[1]}, {want[2]}] paged cache "
                f"(kv_heads, block_size, 2 * head_dim), got {list(cache.shape)}"
            )
        if self.split != "channels" and not _heads_contiguous(cache):
            raise InvalidArgumentError(
                f"{what}: the {self.split} layout reads each block's [H, N, 2D] as per-head "
                "regions of K and V, which needs them contiguous (head-major); got strides "
                f"{list(cache.stride())}"
            )
        if self.split == "cpu-amx" and (self.block_size % _TILE or self.head_dim % _TILE):
            raise InvalidArgumentError(
                f"{what}: the cpu-amx layout packs 16 tokens and 16 channels a tile: expected a "
                f"block size and head_dim that are multiples of 16, got {self.block_size} and "
                f"{self.head_dim}"
            )

    def _regions(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as ``[B, H, N, 2, D]`` (channels) or ``[B, H, 2, N * D]`` (K then V
        regions, the CPU layouts)."""
        b, h, n, _ = cache.shape
        if self.split == "channels":
            return cache.view(b, h, n, 2, self.head_dim)
        return cache.view(b, h, 2, n * self.head_dim)

    def _unpack(self, region: torch.Tensor, kv: int) -> torch.Tensor:
        """One CPU region, ``[b, H, N * D]`` of K (``kv`` 0) or V, as a view ``[b, H, N, D]``
        or, where tiles interleave tokens and channels, ``[b, H, N / t, t, D / c, c]`` (what
        ``[b, H, N, D]`` reshapes to)."""
        b, h = region.shape[:2]
        n, d = self.block_size, self.head_dim
        if self.split == "cpu-vec":
            return region.view(b, h, d, n).transpose(2, 3) if kv == 0 else region.view(b, h, n, d)
        if kv == 0:  # [N/16, D/2, 16 tokens, 2 channels]
            tiles = region.view(b, h, n // _TILE, d // 2, _TILE, 2).permute(0, 1, 2, 4, 3, 5)
        else:  # [D/16, N/2, 16 channels, 2 tokens]
            tiles = region.view(b, h, d // _TILE, n // 2, _TILE, 2).permute(0, 1, 3, 5, 2, 4)
        return tiles

    def _pack(self, x: torch.Tensor, kv: int) -> torch.Tensor:
        """:meth:`_unpack` backwards: ``[b, H, N, D]`` of K or V as its region's order (a view,
        ``[b, H, ...]``)."""
        b, h = x.shape[:2]
        n, d = self.block_size, self.head_dim
        if self.split == "cpu-vec":
            return x.transpose(2, 3) if kv == 0 else x
        if kv == 0:
            return x.reshape(b, h, n // _TILE, _TILE, d // 2, 2).permute(0, 1, 2, 4, 3, 5)
        return x.reshape(b, h, n // 2, 2, d // _TILE, _TILE).permute(0, 1, 4, 2, 5, 3)

    def read_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks in kvtier's form, ``[len(block_ids), 2, H, N, D]`` (what
        :meth:`~kvtier.BlockManager.gather_blocks` returns; a view where it can be), from the
        cache's blocks ``block_ids`` (an int64 tensor on its device)."""
        b, h, n, d = block_ids.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        if cache.device.type == "cpu":
            blocks = cache.new_empty((b, 2, h, n, d))
            self._native(cache, block_ids, blocks, to_cache=False)
            return blocks
        picked = self._regions(cache).index_select(0, block_ids)
        if self.split == "channels":
            return picked.permute(0, 3, 1, 2, 4)  # [b, H, N, 2, D] -> [b, 2, H, N, D]
        blocks = picked.new_empty((b, 2, h, n, d))
        for kv in (0, 1):
            tokens = self._unpack(picked[:, :, kv], kv)
            blocks[:, kv].view(tokens.shape).copy_(tokens)
        return blocks

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of whole blocks: ``[2, len(block_ids) * N, H, D]`` (K first), a new tensor on
        the cache's device; ``block_ids`` is an int64 tensor on that device."""
        blocks = self.read_blocks(cache, block_ids)  # [b, 2, H, N, D]
        return blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, self.num_kv_heads, self.head_dim)

    def write_blocks(
        self, cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """Writes whole blocks in kvtier's form, ``[len(block_ids), 2, H, N, D]`` (what
        :meth:`~kvtier.BlockManager.gather_blocks` returns), into ``cache``: one copy."""
        want = (len(block_ids), 2, self.num_kv_heads, self.block_size, self.head_dim)
        if tuple(blocks.shape) != want:
            raise InvalidArgumentError(
                f"blocks: expected shape {list(want)}, got {list(blocks.shape)}"
            )
        blocks = blocks.to(cache.dtype)
        if cache.device.type == "cpu":
            self._native(cache, block_ids, blocks.contiguous(), to_cache=True)
            return
        if self.split == "channels":
            stored = blocks.permute(0, 2, 3, 1, 4)  # -> [b, H, N, 2, D]
        else:
            b, h = len(block_ids), self.num_kv_heads
            stored = blocks.new_empty((b, h, 2, self.block_size * self.head_dim))
            for kv in (0, 1):
                packed = self._pack(blocks[:, kv], kv)
                stored[:, :, kv].view(packed.shape).copy_(packed)
        self._regions(cache).index_copy_(0, block_ids, stored)

    def _native(
        self, cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor, *, to_cache: bool
    ) -> None:
        """The CPU path of :meth:`read_blocks` (``to_cache`` False) and :meth:`write_blocks`:
        one pass over the bytes in the extension (``_core.paged_copy``), between ``cache``
        and ``blocks`` (contiguous ``[b, 2, H, N, D]`` of the cache's dtype)."""
        ids = self._ids(cache, block_ids.numpy())
        step = np.uint64(blocks.stride(0) * blocks.element_size())  # contiguous blocks
        addrs = np.uint64(blocks.data_ptr()) + step * np.arange(len(ids), dtype=np.uint64)
        self.copy(cache, ids, addrs, to_cache=to_cache)

    def _ids(self, cache: torch.Tensor, block_ids: np.ndarray) -> np.ndarray:
        """``block_ids`` as int64, refused unless each is one of the cache's blocks."""
        ids = block_ids.astype(np.int64, copy=False)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < cache.shape[0]:
            raise InvalidArgumentError(
                f"block_ids: expected blocks of the cache's {cache.shape[0]}, got {ids.tolist()}"
            )
        return ids

    def copy(
        self, cache: torch.Tensor, ids: np.ndarray, addrs: np.ndarray, *, to_cache: bool
    ) -> None:
        """Whole blocks between a CPU ``cache`` (its blocks ``ids``, int64, checked) and kvtier's
        form at ``addrs`` (one uint64 address a block, ``2 * H * N * D`` contiguous elements of
        the cache's dtype each), in the extension."""
        paged_copy(
            self.split, to_cache, cache.data_ptr(), cache.stride(0),
            (cache.stride(1), cache.stride(2)), ids, addrs,
            (self.num_kv_heads, self.block_size, self.head_dim), cache.element_size(),
        )  # fmt: skip

    def key_norms(
        self,
        cache: torch.Tensor,
        ids: np.ndarray,
        copy_to: np.ndarray | None = None,
        limit: float = math.inf,
    ) -> np.ndarray:
        """Per token of a CPU ``cache``'s blocks ``ids`` (int64, checked), block by block, the
        mean over heads of its key's norm, read in place; raises
        :class:`~kvtier.InvalidArgumentError` if K or V holds a NaN, an infinity or a value
        of magnitude past ``limit``. With ``copy_to`` (addresses as :meth:`copy`'s), each
        block is copied there once checked (on a refusal, some may have been)."""
        norms, bad = paged_scan(
            self.split, cache.data_ptr(), cache.stride(0), (cache.stride(1), cache.stride(2)),
            ids, (self.num_kv_heads, self.block_size, self.head_dim), _float_code(cache.dtype),
            copy_to, limit,
        )  # fmt: skip
        if bad:
            raise refusal("blocks", limit, f" in {'KV'[bad - 1]}")
        return norms

    def write(self, cache: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes ``kv`` (``[2, len(block_ids) * N, H, D]``, the form :meth:`read` returns) into
        whole blocks of ``cache``."""
        n = len(block_ids)
        want = (2, n * self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != want:
            raise InvalidArgumentError(f"kv: expected shape {list(want)}, got {list(kv.shape)}")
        per_block = kv.reshape(2, n, self.block_size, self.num_kv_heads, self.head_dim)
        self.write_blocks(cache, block_ids, per_block.permute(1, 0, 3, 2, 4))


@dataclass(frozen=True)
class PagedBlocks(ExternalBlocks):
    """Whole blocks ``block_ids`` of one layer's paged ``cache`` of ``layout``, as
    :meth:`~kvtier.BlockManager.append_blocks` takes them and
    :meth:`~kvtier.BlockManager.load_blocks` writes them: on the CPU the manager checks them
    where they lie (:meth:`PagedLayout.key_norms`) and copies each once, between the cache and
    its pool slot (:meth:`PagedLayout.copy`)."""

    layout: PagedLayout
    cache: torch.Tensor
    block_ids: np.ndarray  # int64, each one of the cache's blocks

    @classmethod
    def of(cls, layout: PagedLayout, cache: torch.Tensor, block_ids: Any) -> PagedBlocks:
        """Blocks ``block_ids`` (ints, any sequence or array) of ``cache``, checked."""
        return cls(layout, cache, layout._ids(cache, np.asarray(block_ids)))

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.layout.num_kv_heads, self.layout.block_size, self.layout.head_dim

    @property
    def dtype(self) -> Any:
        return self.cache.dtype

    @property
    def device(self) -> Any:
        return self.cache.device

    def key_norms(self, limit: float = math.inf) -> np.ndarray:
        return self.layout.key_norms(self.cache, self.block_ids, limit=limit)

    def copy_to(
        self,
        addresses: np.ndarray,
        pick: np.ndarray | None = None,
        *,
        measure: bool = False,
        limit: float = math.inf,
    ) -> np.ndarray | None:
        ids = self.block_ids if pick is None else self.block_ids[pick]
        if measure:
            return self.layout.key_norms(self.cache, ids, addresses, limit)
        self.layout.copy(self.cache, ids, addresses, to_cache=False)
        return None

    def copy_from(self, addresses: np.ndarray, pick: np.ndarray | None = None) -> None:
        ids = self.block_ids if pick is None else self.block_ids[pick]
        self.layout.copy(self.cache, ids, addresses, to_cache=True)

    def read(self) -> torch.Tensor:
        return self.layout.read_blocks(self.cache, self._ids_tensor(None))

    def write(self, blocks: torch.Tensor, pick: np.ndarray | None = None) -> None:
        blocks = blocks.to(self.cache.device, non_blocking=True)
        self.layout.write_blocks(self.cache, self._ids_tensor(pick), blocks)

    def _ids_tensor(self, pick: np.ndarray | None) -> torch.Tensor:
        ids = self.block_ids if pick is None else self.block_ids[pick]
        tensor: torch.Tensor = torch_module().from_numpy(np.ascontiguousarray(ids))
        return tensor.to(self.cache.device)


@functools.cache
def _float_code(dtype: torch.dtype) -> int:
    """The kernels' code of a cache dtype (asked for at every layer of every save)."""
    return FLOAT_CODES[dtype_name(dtype)]


def _heads_contiguous(cache: torch.Tensor) -> bool:
    """Whether each block's ``[H, N, 2D]`` is one contiguous run (blocks may be apart)."""
    _, h, n, c = cache.shape
    return cache.stride()[1:] == (n * c, c, 1) or h * n * c == 0


def layout_for_backend(
    backend_name: str, cache: Any, *, num_kv_heads: int, block_size: int, head_dim: int
) -> PagedLayout:
    """The layout of an attention backend's per-layer cache, checked against the tensor.

    ``backend_name`` is :func:`~.config.backend_name`'s (``AttentionBackend.get_name()``,
    with ``:isa`` for CPU_ATTN, prefixed ``ROCM:`` on ROCm); ``cache`` the layer's tensor as
    vLLM registers it. Raises :class:`ConfigError` for a backend not in
    :data:`BACKEND_LAYOUTS` and for a cache that is not its layout (MLA's latent
    cache, a kernel block size below the block size, a quantized cache).
    """
    split = BACKEND_LAYOUTS.get(backend_name)
    if split is None:
        raise ConfigError(
            f"KVTierConnector: attention backend {backend_name} is not one whose paged cache "
            f"kvtier knows where K and V are in ({', '.join(BACKEND_LAYOUTS)}; none on ROCm): "
            "refused rather than guessed; choose one of those with --attention-backend "
            "(LLM(attention_backend=...))"
        )
    layout = PagedLayout(split, num_kv_heads, block_size, head_dim)
    try:
        layout.check(cache, f"{backend_name} cache")
    except InvalidArgumentError as exc:
        raise ConfigError(
            f"{exc}; kvtier's vLLM connector supports full attention with a paged "
            "[num_blocks, kv_heads, block_size, 2 * head_dim] cache per layer"
        ) from None
    return layout
