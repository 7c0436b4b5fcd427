"""The worker's tiers and the paged caches they exchange whole blocks with.

A :class:`WorkerTiers` is a :class:`~kvtier.BlockManager` (in host memory, or on the caches'
device), the :class:`~.paged.PagedLayout` of vLLM's per-layer caches and those caches: it saves
complete blocks of the caches into manager sequences, loads them back into other blocks (decoded
to the model dtype), a layer at a time or all at once, and tells what the tiers hold of a prompt
and where (:class:`~.link.Held`). :class:`LayerLoads` runs one step's loads a layer at a time on
a thread of their own (on CUDA, on a stream of their own), beside the forward pass. It keeps no state of its own beyond the three; the worker side
of the connector decides what to save and load, and counts it. Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._core import Plan
from ..._torch import torch_module
from ...errors import InvalidArgumentError, KvtierError
from .link import CONNECTOR_TIERS, Held
from .paged import PagedBlocks

if TYPE_CHECKING:
    import torch

    from ...manager import BlockManager
    from .metadata import LoadSpec
    from .paged import PagedLayout

__all__ = ["LayerLoads", "WorkerTiers"]

log = logging.getLogger("kvtier.vllm")


@dataclass
class WorkerTiers:
    """The worker's tiers (``manager``) and the paged caches (``caches``, one per layer, in the
    manager's layer order, all of ``layout``) they exchange blocks with."""

    manager: BlockManager
    layout: PagedLayout
    caches: list[torch.Tensor]
    #: saves encode where the caches are, below level 0 (:meth:`~kvtier.BlockManager.
    #: append_blocks` with ``encode``), rather than copying them whole into level 0
    encode: bool = False

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        """The leading tokens of ``tokens`` (a request of cache salt ``salt``) the tiers can load
        (whole blocks), and where each block lies (tier and level) now."""
        manager = self.manager
        bs = manager.block_size
        hit = manager.lookup(tokens, salt=salt) // bs
        blocks = manager.core.lookup_tokens(tokens, salt)[:hit]
        info = manager.core.block_info(blocks)
        places = [
            (CONNECTOR_TIERS[Plan.TIERS[tier]], manager.ladder[level])
            for tier, level in zip(info["tier"].tolist(), info["level"].tolist(), strict=True)
        ]
        if manager.config.share_prefixes:
            # Blocks past the core's own that the server holds: published at level 0.
            places += [("remote", manager.ladder[0])] * (hit - len(blocks))
        return Held.of_blocks(places, bs)

    def save(
        self,
        seq: int,
        block_ids: Sequence[int] | np.ndarray,
        on_keys: Callable[[int, torch.Tensor], None] | None = None,
    ) -> int:
        """Appends to manager sequence ``seq`` the K/V it lacks among whole paged blocks
        ``block_ids`` (the sequence's blocks from its first token; its token ids declared),
        a layer at a time (:meth:`save_layer`). Returns the blocks written at the last layer
        (those a cached prefix already held are skipped)."""
        written = 0
        ids = np.asarray(block_ids, dtype=np.int64)  # once, not at every layer
        for layer in range(len(self.caches)):
            written = self.save_layer(layer, seq, ids, on_keys)
        return written

    def save_layer(
        self,
        layer: int,
        seq: int,
        block_ids: Sequence[int] | np.ndarray,
        on_keys: Callable[[int, torch.Tensor], None] | None = None,
    ) -> int:
        """One layer of :meth:`save`: the blocks of ``block_ids`` that manager sequence ``seq``
        lacks at ``layer``, appended whole where they lie in its cache
        (:meth:`~kvtier.BlockManager.append_blocks` of :class:`~.paged.PagedBlocks`: on the
        CPU, checked in place and copied once, into the pool; with :attr:`encode`, gathered
        and encoded where the cache is, on a GPU by the CUDA kernels, and only the encoded
        bytes copied). Returns how many. ``on_keys(layer, keys)`` sees their keys, ``[blocks,
        block_size, kv_heads, head_dim]``."""
        manager, layout, cache = self.manager, self.layout, self.caches[layer]
        bs = layout.block_size
        start = manager.num_tokens(seq, layer)
        if start >= len(block_ids) * bs:
            return 0
        if start % bs:
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: holds {start} tokens, not whole blocks of {bs}"
            )
        source = PagedBlocks.of(layout, cache, block_ids[start // bs :])
        if self.encode:
            blocks = source.read()
            manager.append_blocks(seq, layer, blocks, encode=True)
        else:
            manager.append_blocks(seq, layer, source)
        if on_keys is not None:
            on_keys(layer, (blocks if self.encode else source.read())[:, 0].transpose(1, 2))
        return len(source)

    def load(self, seq: int, start: int, end: int, block_ids: Sequence[int] | np.ndarray) -> int:
        """Writes the K/V of tokens ``start:end`` of manager sequence ``seq`` (decoded to the
        model dtype) into whole paged blocks ``block_ids``, as far as the sequence holds them.
        Returns how many of ``block_ids`` were written, from the first: the rest must be
        recomputed. A block the tiers lost raises :class:`~kvtier.BlockLostError` (some layers
        may have been written: the caller recomputes them all)."""
        ok = self.loadable(seq, start, end, len(block_ids))
        ids = np.asarray(block_ids[:ok], dtype=np.int64)  # once, not at every layer
        for layer in range(len(self.caches)):
            self.load_layer(layer, seq, start, ids)
        return ok

    def loadable(self, seq: int, start: int, end: int, num_block_ids: int) -> int:
        """How many whole blocks of tokens ``start:end`` manager sequence ``seq`` holds in every
        layer (at most ``num_block_ids``)."""
        bs = self.layout.block_size
        if start % bs:
            raise InvalidArgumentError(
                f"start: expected a multiple of the block size {bs}, got {start}"
            )
        have = min(self.manager.num_tokens(seq, len(self.caches) - 1), end)
        return min(num_block_ids, max(0, (have - start) // bs))

    def load_layer(
        self, layer: int, seq: int, start: int, block_ids: Sequence[int] | np.ndarray
    ) -> None:
        """One layer of :meth:`load`: the blocks of ``seq`` from token ``start`` (a block
        boundary), as many as ``block_ids``, into those blocks of layer ``layer``'s cache
        (:meth:`~kvtier.BlockManager.load_blocks`: on the CPU, a level-0 block in one copy)."""
        if not len(block_ids):
            return
        into = PagedBlocks.of(self.layout, self.caches[layer], block_ids)
        self.manager.load_blocks(seq, layer, start // self.layout.block_size, into)


class LayerLoads:
    """One step's synchronous loads, a layer at a time on the worker's layer thread, so that
    the forward pass computes layer ``i`` while layer ``i + 1`` loads. On a GPU the copies go
    on a stream of their own and each layer's attention waits for its event."""

    def __init__(self, tiers: WorkerTiers, loads: Sequence[LoadSpec], thread: Executor) -> None:
        self.ready = [threading.Event() for _ in tiers.caches]
        self.events: list[Any] = [None] * len(tiers.caches)
        self.results: list[tuple[int, list[int]]] = []
        #: how long the loads took on the layer thread (their reads, decodes and copies)
        self.seconds = 0.0
        self.job = thread.submit(self._run, tiers, loads)

    def _run(self, tiers: WorkerTiers, loads: Sequence[LoadSpec]) -> None:
        torch = torch_module()
        manager, caches = tiers.manager, tiers.caches
        # load, sequence, blocks to write (an array: the layers take it as it is)
        work: list[tuple[LoadSpec, int | None, np.ndarray]] = []
        nothing = np.empty(0, dtype=np.int64)
        start = time.perf_counter()
        cuda = caches[0].device.type == "cuda"
        try:
            for load in loads:
                try:
                    seq = manager.add_sequence(load.tokens, salt=load.salt)
                    n = len(load.block_ids)
                    ok = tiers.loadable(seq, load.start, len(load.tokens), n)
                    work.append((load, seq, np.asarray(load.block_ids[:ok], dtype=np.int64)))
                except KvtierError as exc:
                    log.warning("kvtier: load of request %s failed (%s)", load.req_id, exc)
                    work.append((load, None, nothing))
            stream = torch.cuda.Stream(caches[0].device) if cuda else None
            for layer in range(len(caches)):
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for i, (load, held, ids) in enumerate(work):
                        if held is None or not len(ids):
                            continue
                        try:
                            tiers.load_layer(layer, held, load.start, ids)
                        except Exception as exc:  # a block lost in the tiers: all recomputed
                            log.warning("kvtier: load of request %s failed (%s)", load.req_id, exc)
                            work[i] = (load, held, nothing)
                    if stream is not None:
                        self.events[layer] = stream.record_event()
                self.ready[layer].set()
            if stream is not None:
                stream.synchronize()
        finally:
            for ready in self.ready:  # no layer waits for ever
                ready.set()
            for _, held, _ in work:
                if held is not None:
                    manager.free(held)
            # One entry per load, in order (a load never reached wrote nothing).
            self.results = [(len(ids), load.block_ids[len(ids) :]) for load, _, ids in work]
            self.results += [(0, load.block_ids) for load in loads[len(work) :]]
            self.seconds = time.perf_counter() - start

    def wait(self, layer: int) -> None:
        self.ready[layer].wait()
        event = self.events[layer]
        if event is not None:
            torch_module().cuda.current_stream().wait_event(event)

    def finish(self) -> list[tuple[int, list[int]]]:
        """Per load: the blocks written and those that were not."""
        self.job.result()
        return self.results
