"""The block ledger: what the manager knows of each block beside the core.

Per block id (flat arrays, grown on demand as the core hands out ids): the tokens each layer has
written, whether the manager pins it, the running sum and count of its tokens' key norms (the
magnitude signal the core ranks by), and whether a store tier lost it.

Invariants: a block is pinned (here and in the core) from allocation until every layer has
written all its tokens, so plans never move a block being written; a lost block is pinned for
good and never shared, and reading it raises :class:`BlockLostError`. The arrays are read by
the manager and its parts (read-only by convention); they change only through the methods
here, called under the manager's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._core import Core
from ..errors import BlockLostError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["BlockLedger", "key_norm_sums"]


class BlockLedger:
    """Per-block bookkeeping of one manager: written counts, pins, key-norm sums, lost blocks.

    Read :attr:`written`, :attr:`pinned`, :attr:`lost` freely (they may be replaced by larger
    arrays when blocks are tracked: index them, do not keep them); :meth:`magnitude` gives the
    magnitude signal of blocks."""

    def __init__(self, core: Core, layers: int, block_size: int) -> None:
        self.core = core
        self.layers = layers
        self.block_size = block_size
        #: ``[blocks, layers]`` int32: tokens written per layer
        self.written = np.zeros((0, layers), dtype=np.int32)
        #: pinned by the manager while incomplete (the core may hold more pins of its own)
        self.pinned = np.zeros(0, dtype=bool)
        #: the running key-norm sum and token count behind the magnitude signal
        self.norm_sum = np.zeros(0, dtype=np.float64)
        self.norm_count = np.zeros(0, dtype=np.int64)
        #: lost from a store tier: never read nor shared again
        self.lost = np.zeros(0, dtype=bool)

    # -- lifecycle ------------------------------------------------------------------------------

    def track(self, new: np.ndarray) -> None:
        """Starts the ledger of blocks the core just allocated: nothing written, not lost."""
        if not len(new):
            return
        top = int(new.max()) + 1
        if top > len(self.pinned):
            grow = max(top, 2 * len(self.pinned))
            self.written = np.concatenate(
                [self.written, np.zeros((grow - len(self.written), self.layers), np.int32)]
            )
            self.pinned = _grown(self.pinned, grow)
            self.norm_sum = _grown(self.norm_sum, grow)
            self.norm_count = _grown(self.norm_count, grow)
            self.lost = _grown(self.lost, grow)
        self.written[new] = 0
        self.lost[new] = False
        self.norm_sum[new] = 0.0
        self.norm_count[new] = 0

    def pin(self, blocks: np.ndarray) -> None:
        """Pins blocks (in the core too) until :meth:`unpin`."""
        if len(blocks):
            self.core.pin(blocks)
            self.pinned[blocks] = True

    def unpin(self, blocks: np.ndarray) -> None:
        """Unpins blocks this ledger pinned (in the core too)."""
        self.core.unpin(blocks)
        self.pinned[blocks] = False

    def copy(self, src: int, dst: int) -> None:
        """``dst`` (a fork's copy of the partial block ``src``) holds what ``src`` holds."""
        self.written[dst] = self.written[src]
        self.norm_sum[dst] = self.norm_sum[src]
        self.norm_count[dst] = self.norm_count[src]

    def mark_lost(self, blocks: np.ndarray) -> None:
        """Blocks a store could not give back: forgotten by the prefix cache (never shared) and
        the live ones pinned where they are (never moved again) and marked lost."""
        self.core.forget(blocks)
        live = blocks[self.core.block_info(blocks)["refcount"] > 0]
        self.core.pin(live)
        self.pinned[live] = True
        self.lost[live] = True

    # -- writes ---------------------------------------------------------------------------------

    def wrote_token(self, block: int, layer: int, offset: int, norm: float, last: bool) -> bool:
        """One token written at ``offset`` of ``block`` in ``layer`` (the decode step's path:
        the next token of a pinned block), its key norm ``norm``. At the ``last`` layer or the
        block's last token, tells the core the block's magnitude. Returns whether the block is
        now complete in every layer (for the caller to finish)."""
        self.written[block, layer] = offset + 1
        self.norm_sum[block] += norm
        self.norm_count[block] += 1
        full = offset + 1 == self.block_size
        if last or full:
            self.core.set_magnitude(
                np.array([block], dtype=np.uint32),
                np.array([self.norm_sum[block] / self.norm_count[block]], np.float32),
            )
            return full and bool((self.written[block] == self.block_size).all())
        return False

    def wrote(
        self, blocks: np.ndarray, layer: int, offsets: np.ndarray, norms: np.ndarray
    ) -> np.ndarray:
        """Tokens written in ``layer``, one per entry: its block, offset and key norm. Tells the
        core the blocks' new magnitude and returns those of them now complete in every layer
        and still pinned (for the caller to finish)."""
        # A block's written count is its highest written offset.
        np.maximum.at(self.written[:, layer], blocks, offsets + 1)
        np.add.at(self.norm_sum, blocks, norms)
        np.add.at(self.norm_count, blocks, 1)
        uniq = np.unique(blocks)
        self.core.set_magnitude(uniq, self.magnitude(uniq))
        return uniq[self.pinned[uniq] & (self.written[uniq] == self.block_size).all(axis=1)]

    def wrote_blocks(self, blocks: np.ndarray, layer: int, norm_sums: np.ndarray) -> np.ndarray:
        """Whole blocks (distinct, none written before in ``layer``) written in ``layer``, the
        sums of their tokens' key norms ``norm_sums``: what :meth:`wrote` does for all their
        tokens, without a per-token pass. Returns those now complete in every layer and still
        pinned."""
        self.wrote_layer(blocks, layer)
        return self.measured(blocks, norm_sums, 1, tell_all=layer == self.layers - 1)

    def wrote_layer(self, blocks: np.ndarray, layer: int) -> None:
        """Whole blocks written in ``layer``, their key norms told later (:meth:`measured`)."""
        self.written[blocks, layer] = self.block_size

    def measured(
        self, blocks: np.ndarray, norm_sums: np.ndarray, layers: int, *, tell_all: bool = False
    ) -> np.ndarray:
        """The sums of the key norms of ``layers`` written layers of whole blocks
        (:meth:`wrote_layer`). Returns the blocks now complete in every layer and still
        pinned."""
        bs = self.block_size
        self.norm_sum[blocks] += norm_sums
        self.norm_count[blocks] += layers * bs
        complete = self.written[blocks].min(axis=1) == bs
        # A block being written is pinned, so no plan ranks it: the core hears its magnitude
        # once complete (and at the last layer, for a reader of the layers written so far).
        told = blocks if tell_all else blocks[complete]
        if len(told):
            self.core.set_magnitude(told, self.magnitude(told))
        return blocks[complete & self.pinned[blocks]]

    def filled(self, blocks: np.ndarray, norm_sums: np.ndarray) -> None:
        """Blocks written whole at once (every layer, every token: fetched from another
        engine), the sums of their tokens' key norms ``norm_sums``: complete, so unpinned."""
        bs = self.block_size
        self.written[blocks] = bs
        # The magnitude signal as appends would have left it (the mean over heads of each
        # token's key norm, averaged over the block's tokens and layers).
        self.norm_sum[blocks] = norm_sums
        self.norm_count[blocks] = self.layers * bs
        self.core.set_magnitude(blocks, self.magnitude(blocks))
        self.unpin(blocks)

    # -- reads ----------------------------------------------------------------------------------

    def magnitude(self, blocks: np.ndarray) -> np.ndarray:
        """fp32 per block: the mean over its written tokens (and layers) of each token's key
        norm averaged over heads, the signal the scheduler ranks by."""
        return (self.norm_sum[blocks] / self.norm_count[blocks]).astype(np.float32)

    def cached_prefix(self, blocks: np.ndarray) -> int:
        """Tokens of the leading blocks that are complete in every layer."""
        if not len(blocks):
            return 0
        complete = (self.written[blocks] == self.block_size).all(axis=1)
        n = len(complete) if complete.all() else int(np.argmin(complete))
        return n * self.block_size

    def check_not_lost(self, seq: int, blocks: np.ndarray) -> None:
        """Raises :class:`BlockLostError` if one of ``seq``'s ``blocks`` was lost."""
        lost = blocks[self.lost[blocks]]
        if len(lost):
            raise BlockLostError(
                f"sequence {seq}: block {int(lost[0])} was lost from a store tier (corrupt, "
                "evicted by the server, or the server is gone); free the sequence and compute "
                "its K/V again"
            )

    def check_written(self, seq: int, layer: int, blocks: np.ndarray, tokens: int) -> None:
        """Raises unless ``layer`` has written the first ``tokens`` tokens of ``blocks`` (a
        shared block whose owner is behind has not)."""
        bs = self.block_size
        written = self.written[blocks, layer]
        if tokens >= bs * len(blocks) and (len(blocks) == 0 or written.min() == bs):
            return  # whole blocks, all written (the usual case)
        need = np.minimum(bs, tokens - bs * np.arange(len(blocks)))
        short = np.nonzero(written < need)[0]
        if len(short):
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: block {int(blocks[short[0]])} (tokens from "
                f"{int(short[0]) * bs}) is shared but its owner has not written this layer "
                "yet; append the owner's layer first"
            )

    def check_writable(self, seq: int, layer: int, start: int, stop: int) -> None:
        """Raises unless each token of ``[start, stop)`` (of blocks the sequence has) that is
        still to be written lies in a block at level 0 on the device, where appends write."""
        if stop <= start:
            return
        bs = self.block_size
        blocks = self.core.sequence_blocks(seq)[start // bs : (stop - 1) // bs + 1]
        if self.pinned[blocks].all():
            return  # pinned blocks never move (the usual case: the block being filled)
        positions = np.arange(start, stop)
        blocks = blocks[positions // bs - start // bs]
        fresh = blocks[(positions % bs >= self.written[blocks, layer]) & ~self.pinned[blocks]]
        if not len(fresh):
            return
        fresh = np.unique(fresh)
        info = self.core.block_info(fresh)
        moved = (info["tier"] != 0) | (info["level"] != 0)
        if moved.any():
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: block {int(fresh[moved.argmax()])} is no longer "
                "at level 0 on the device, so tokens cannot be written into it"
            )


def key_norm_sums(rows: torch.Tensor) -> torch.Tensor:
    """Per level-0 row ``[n, layers, 2, kv_heads, block_size, head_dim]``: the sum over its
    layers and tokens of each token's key norm averaged over heads."""
    return rows[:, :, 0].float().norm(dim=-1).mean(dim=2).sum(dim=(1, 2))


def _grown(a: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([a, np.zeros(size - len(a), a.dtype)])
