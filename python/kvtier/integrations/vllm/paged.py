"""Reading and writing whole blocks of a paged KV cache the way its attention backend reads them.

vLLM hands each attention layer's cache to connectors as a ``[num_blocks, kv_heads, block_size,
2 * head_dim]`` view (its logical ``[B, H, N, C]``; the memory order behind it varies). The view's
shape is the same everywhere, but *where K and V of a token are* is the backend's business:

- ``channels`` (FLASH_ATTN, TRITON_ATTN, FLASHINFER, FLEX_ATTENTION on CUDA): token ``n`` of
  head ``h`` is ``[b, h, n]``; its first ``head_dim`` channels are K, the rest V.
- ``rows`` (vLLM's CPU_ATTN): a block's ``[H, N, 2D]`` bytes are read as ``[H, 2N, D]``; K of
  token ``n`` is row ``n`` and V row ``N + n``, so the logical token axis means nothing there.

Other backends read the same shape otherwise: ROCm's ROCM_ATTN, and its AITER FlashAttention
(which calls itself FLASH_ATTN) with shuffled caches, hold a block as ``[2, N, H * head_dim]``,
which for two KV heads has exactly the accepted shape with another meaning. So the backends are
allow-listed (:data:`BACKEND_SPLITS`), and every other one, and every backend on ROCm, refused.

A :class:`PagedLayout` moves K/V between such a cache and kvtier's token-major
``[num_tokens, kv_heads, head_dim]`` form, whole blocks at a time, on whatever device the cache
is (the index and the copies stay there); :class:`~.tiers.WorkerTiers` moves them between such
caches and a :class:`~kvtier.BlockManager`. Anything else is refused by :func:`layout_for_backend`
rather than guessed. Nothing here needs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ...errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["BACKEND_SPLITS", "PagedLayout", "layout_for_backend"]

Split = Literal["channels", "rows"]

#: The attention backends whose paged cache kvtier reads, by ``get_name()``, and where their K
#: and V are (vLLM 0.32: CPU_ATTN's ``do_kv_cache_update`` writes rows; the CUDA backends'
#: forward passes read ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). On ROCm the
#: name is prefixed (``ROCM:``, see :func:`~.config.backend_name`): none is listed.
BACKEND_SPLITS: dict[str, Split] = {
    "CPU_ATTN": "rows",
    "FLASH_ATTN": "channels",
    "TRITON_ATTN": "channels",
    "FLASHINFER": "channels",
    "FLEX_ATTENTION": "channels",
}


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
        if self.split == "rows" and not _rows_viewable(cache):
            raise InvalidArgumentError(
                f"{what}: the {self.split} layout reads each block's [H, N, 2D] bytes as "
                "[H, 2N, D], which needs them contiguous (head-major); got strides "
                f"{list(cache.stride())}"
            )

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as ``[B, H, 2, N, D]`` (rows) or ``[B, H, N, 2, D]`` (channels)."""
        b, h, n, _ = cache.shape
        if self.split == "rows":
            return cache.view(b, h, 2, n, self.head_dim)
        return cache.view(b, h, n, 2, self.head_dim)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of whole blocks: ``[2, len(block_ids) * N, H, D]`` (K first), a new tensor on
        the cache's device; ``block_ids`` is an int64 tensor on that device."""
        picked = self._blocks(cache).index_select(0, block_ids)
        # -> [2, blocks, N, H, D]
        kv = (
            picked.permute(2, 0, 3, 1, 4) if self.split == "rows" else picked.permute(3, 0, 2, 1, 4)
        )
        return kv.reshape(2, -1, self.num_kv_heads, self.head_dim)

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
        # -> [blocks, H, 2, N, D] (rows) or [blocks, H, N, 2, D] (channels)
        order = (0, 2, 1, 3, 4) if self.split == "rows" else (0, 2, 3, 1, 4)
        self._blocks(cache).index_copy_(0, block_ids, blocks.permute(order).to(cache.dtype))

    def write(self, cache: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes ``kv`` (``[2, len(block_ids) * N, H, D]``, the form :meth:`read` returns) into
        whole blocks of ``cache``."""
        n = len(block_ids)
        want = (2, n * self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != want:
            raise InvalidArgumentError(f"kv: expected shape {list(want)}, got {list(kv.shape)}")
        per_block = kv.reshape(2, n, self.block_size, self.num_kv_heads, self.head_dim)
        if self.split == "rows":
            rows = per_block.permute(1, 3, 0, 2, 4)  # [blocks, H, 2, N, D]
        else:
            rows = per_block.permute(1, 3, 2, 0, 4)  # [blocks, H, N, 2, D]
        self._blocks(cache).index_copy_(0, block_ids, rows.to(cache.dtype))


def _rows_viewable(cache: torch.Tensor) -> bool:
    """Whether each block's ``[H, N, 2D]`` is one contiguous run (blocks may be apart)."""
    _, h, n, c = cache.shape
    return cache.stride()[1:] == (n * c, c, 1) or h * n * c == 0


def layout_for_backend(
    backend_name: str, cache: Any, *, num_kv_heads: int, block_size: int, head_dim: int
) -> PagedLayout:
    """The layout of an attention backend's per-layer cache, checked against the tensor.

    ``backend_name`` is ``AttentionBackend.get_name()`` (prefixed ``ROCM:`` on ROCm);
    ``cache`` the layer's tensor as vLLM registers it. Raises :class:`ConfigError` for a
    backend not in :data:`BACKEND_SPLITS` and for a cache that is not its layout (MLA's latent
    cache, a kernel block size below the block size, a quantized cache).
    """
    split = BACKEND_SPLITS.get(backend_name)
    if split is None:
        raise ConfigError(
            f"KVTierConnector: attention backend {backend_name} is not one whose paged cache "
            f"kvtier knows where K and V are in ({', '.join(BACKEND_SPLITS)}; none on ROCm): "
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
