"""Attention tables: where a manager's blocks lie, as the attention kernels read them.

:class:`AttentionTables` owns, for one manager:

- the pools the kernels read where they lie (:attr:`~AttentionTables.views`: the device pools,
  and the host pools when the device is the CPU, of codecs with a kernel) and their
  descriptors;
- :attr:`~AttentionTables.lut`, per (tier, level), the index of its pool among the views (-2: the
  blocks there are staged, decoded into a staging pool per call; -1: a drop level, skipped);
- a few :class:`AttentionBatch` tables (per batch of sequence ids: each block's pool and slot),
  kept while the *epoch* stands. Anything that moves blocks or gives a sequence new blocks calls
  :meth:`~AttentionTables.invalidate`, so a decode step builds a batch's table once and reads it
  for every layer;
- the :class:`AttentionStep` of the latest call: what every layer's call of one decode step
  shares (the batch at those lengths, checked, and where its masses go), built by its first
  layer.

It reads the core, the block ledger and the pools; it changes none of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._core import Core, Plan
from .._torch import torch_module
from ..attend import PoolView, describe, readable, rotation_of
from ..codecs import BlockShape, Codec, IdentityCodec
from ..errors import InvalidArgumentError
from .ledger import BlockLedger
from .tiers import Tiers

__all__ = ["AttentionBatch", "AttentionStep", "AttentionTables", "per_block"]

#: Batch tables kept at once (a decode step's batch, a prefill's, a few more).
_BATCHES = 8


@dataclass
class AttentionBatch:
    """Where the blocks of a batch of sequences lie, as the attention kernels read them."""

    #: the tables' epoch it was built in (blocks move: a new epoch)
    epoch: int
    #: per sequence, its blocks
    blocks: list[np.ndarray]
    counts: list[int]
    #: ``[sequences, max blocks]`` int32: the attention pool of each block (-2: staged, -1:
    #: none) and its slot
    pools: np.ndarray
    slots: np.ndarray
    staged: bool
    #: ``(row, column, block)`` of the blocks that were not complete in every layer when it was
    #: built: a shared one may not be written yet at the layer attention reads
    unsure: list[tuple[int, int, int]]
    #: per sequence, the index of its first block still in attention (not dropped)
    first_kept: np.ndarray

    def check_sighted(
        self, ids: tuple[int, ...], tokens: tuple[int, ...], queries: int, block_size: int
    ) -> None:
        """Raises for a query that would see no key: every block up to its own dropped (a
        chunk longer than the recent window)."""
        first = np.asarray(tokens) - queries  # each sequence's first query's position
        blind = np.nonzero(self.first_kept * block_size > first)[0]
        if len(blind):
            row = int(blind[0])
            raise InvalidArgumentError(
                f"q: the query at token {first[row]} of sequence {ids[row]} would see no key: "
                f"its blocks before token {self.first_kept[row] * block_size} have left "
                f"attention (the drop level); a chunk of {queries} queries needs a "
                f"recent_window of at least {queries} tokens"
            )

    def check_written(
        self, ledger: BlockLedger, ids: tuple[int, ...], tokens: tuple[int, ...], layer: int
    ) -> None:
        """Raises for a block of the first ``tokens`` tokens that ``layer`` has not written (a
        shared block whose owner is behind; usually one block a sequence: the one being
        filled)."""
        bs, written = ledger.block_size, ledger.written
        for row, col, block in self.unsure:
            need = min(bs, tokens[row] - bs * col)
            if need > 0 and written[block, layer] < need:
                raise InvalidArgumentError(
                    f"sequence {ids[row]} layer {layer}: block {block} is shared but its owner "
                    "has not written this layer yet; append the owner's layer first"
                )


@dataclass
class AttentionStep:
    """What the attention calls of one decode step share (every layer's, for one batch of
    sequences at the same lengths and queries): built and checked by the first, read by the
    rest."""

    #: ``(epoch, ids, tokens, queries)``: the calls it serves
    key: tuple[int, tuple[int, ...], tuple[int, ...], int]
    batch: AttentionBatch
    #: int32 ``[sequences]``: each sequence's tokens (the kernels' ``seq_lens``)
    lengths: np.ndarray
    #: the blocks attention reads, flat: each sequence's first ``ceil(tokens / block_size)``
    blocks: np.ndarray
    #: which entries of a call's ``[sequences, max blocks]`` masses are those blocks': all of
    #: them (None), else a mask
    select: np.ndarray | None

    def masses(self, mass: np.ndarray) -> np.ndarray:
        """A call's masses of :attr:`blocks`, in their order."""
        return mass.reshape(-1) if self.select is None else mass[self.select]


class AttentionTables:
    """The attention kernels' view of one manager's pools, and its batch tables.

    Public for code that drives the kernels itself (``kvtier bench manager`` times the kernel
    alone against :meth:`BlockManager.attend`): :meth:`batch` gives a batch's table, to pass
    with :attr:`views` and :attr:`descriptors` to :func:`kvtier.attend.run_attention`. Not
    locked: the manager calls it under its lock; outside code calls it while no other thread
    uses the manager."""

    def __init__(
        self,
        core: Core,
        ledger: BlockLedger,
        tiers: Tiers,
        shape: BlockShape,
        codecs: Sequence[Codec],
        levels: int,
        drop_level: int | None,
    ) -> None:
        self.core = core
        self.ledger = ledger
        self.tiers = tiers
        self.shape = shape
        readable_tiers = ("device",) if tiers.device.type == "cuda" else ("device", "host")
        #: the pools the kernels read where they lie
        self.views: list[PoolView] = []
        #: ``[tiers, levels]`` int32: per (tier, level) (tiers in ``Plan.TIERS`` order), the
        #: index of its pool in :attr:`views`; -2: staged, -1: out of attention (a drop level)
        self.lut = np.full((len(Plan.TIERS), levels), -2, dtype=np.int32)
        for (tier, level), pool in tiers.pools.items():
            if tier in readable_tiers and readable(codecs[level]):
                self.lut[Plan.TIERS.index(tier), level] = len(self.views)
                self.views.append(PoolView(pool, codecs[level]))
        if drop_level is not None:
            self.lut[:, drop_level] = -1  # out of attention: the kernels skip it
        #: :attr:`views` as the kernels take them (:func:`kvtier.attend.describe`)
        self.descriptors = describe(self.views, shape)
        #: :func:`kvtier.attend.rotation_of` :attr:`views` (the signs the CPU kernel takes)
        self.rotation = rotation_of(self.views, shape.head_dim)
        self._batches: dict[tuple[int, ...], AttentionBatch] = {}
        self._step: AttentionStep | None = None
        #: bumped whenever blocks move or sequences grow: the batch tables' validity
        self.epoch = 0

    def invalidate(self) -> None:
        """Blocks moved or sequences grew: every batch table is stale."""
        self.epoch += 1

    def batch(self, ids: tuple[int, ...], counts: Sequence[int]) -> AttentionBatch:
        """Where the blocks of the sequences ``ids`` lie for the kernels (the first ``counts``
        of each at least), kept until blocks move (the epoch changes) or a sequence outgrows
        it: a decode step reads it for every layer. Raises :class:`BlockLostError` for a
        sequence with a lost block."""
        batch = self._batches.get(ids)
        if (
            batch is None
            or batch.epoch != self.epoch
            or any(n > have for n, have in zip(counts, batch.counts, strict=True))
        ):
            if len(self._batches) >= _BATCHES or (batch and batch.epoch != self.epoch):
                self._batches.clear()
            batch = self._build(ids)
            self._batches[ids] = batch
        return batch

    def step(self, ids: tuple[int, ...], tokens: tuple[int, ...], queries: int) -> AttentionStep:
        """The :class:`AttentionStep` of a call of ``queries`` queries over sequences ``ids``
        of ``tokens`` tokens each: the latest call's when it serves this one too (the layers of
        a decode step), else built and checked (raises for queries that would see no
        key, :class:`BlockLostError` for a lost block).
        ``tokens`` are at least ``queries`` (the caller checks)."""
        key = (self.epoch, ids, tokens, queries)
        step = self._step
        if step is not None and step.key == key:
            return step
        bs = self.shape.block_size
        counts = [-(-n // bs) for n in tokens]
        batch = self.batch(ids, counts)
        batch.check_sighted(ids, tokens, queries, bs)
        width = batch.pools.shape[1]
        blocks = np.concatenate([b[:n] for b, n in zip(batch.blocks, counts, strict=True)])
        select = (
            None
            if all(n == width for n in counts)
            else np.arange(width)[None, :] < np.array(counts)[:, None]
        )
        lengths = np.array(tokens, dtype=np.int32)
        self._step = step = AttentionStep(key, batch, lengths, blocks, select)
        return step

    def _build(self, ids: tuple[int, ...]) -> AttentionBatch:
        core, ledger = self.core, self.ledger
        blocks = [core.sequence_blocks(s) for s in ids]
        counts = [len(b) for b in blocks]
        width = max(counts, default=0)
        pools = np.full((len(ids), width), -1, dtype=np.int32)
        slots = np.zeros((len(ids), width), dtype=np.int32)
        unsure = []
        for row, (seq, b) in enumerate(zip(ids, blocks, strict=True)):
            ledger.check_not_lost(seq, b)
            info = core.block_info(b)
            pools[row, : len(b)] = self.lut[info["tier"], info["level"]]
            slots[row, : len(b)] = info["slot"]
            for col in np.nonzero((ledger.written[b] < ledger.block_size).any(axis=1))[0].tolist():
                unsure.append((row, col, int(b[col])))
        staged = bool((pools == -2).any())
        kept = pools != -1
        first_kept = np.where(kept.any(axis=1), kept.argmax(axis=1), counts)
        return AttentionBatch(self.epoch, blocks, counts, pools, slots, staged, unsure, first_kept)

    def stage(
        self, batch: AttentionBatch, layer: int
    ) -> tuple[np.ndarray, np.ndarray, list[PoolView], np.ndarray]:
        """``(pools, slots, views, descriptors)`` for a batch with staged blocks: the
        attention pools plus a staging pool holding ``layer`` of the blocks the kernels cannot
        read where they lie (a store tier, a codec without a kernel, host memory behind a GPU),
        decoded; the batch's pools and slots (copies) point at it. Raises
        :class:`~kvtier.manager.tiers.BlocksLost` for blocks a store could not give back."""
        pools, slots = batch.pools.copy(), batch.slots.copy()
        staged = np.nonzero(pools == -2)
        blocks = np.array(
            [batch.blocks[r][j] for r, j in zip(*staged, strict=True)], dtype=np.uint32
        )
        torch = torch_module()
        tiers = self.tiers
        stage = torch.empty(
            (len(blocks), 1, *self.shape.dims[1:]), dtype=tiers.dtype, device=tiers.device
        )
        for (tier, level), rows, where, ids in tiers.locations(blocks):
            at = slice(None) if rows is None else torch.from_numpy(rows).to(tiers.device)
            stage[at, 0] = tiers.read_layer(tier, level, where, layer, ids)
        pools[staged] = len(self.views)
        slots[staged] = np.arange(len(blocks), dtype=np.int32)
        views = [*self.views, PoolView(stage, IdentityCodec(self.shape.dtype), 0)]
        desc = np.concatenate([self.descriptors, describe(views[-1:], self.shape)])
        return pools, slots, views, desc


def per_block(per_token: np.ndarray, block_size: int) -> np.ndarray:
    """Per-token values summed per block (the last one partial)."""
    m = math.ceil(len(per_token) / block_size)
    padded = np.zeros(m * block_size, dtype=np.float64)
    padded[: len(per_token)] = per_token
    return padded.reshape(m, block_size).sum(axis=1)
