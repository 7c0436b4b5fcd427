"""vLLM's KV cache events for kvtier's tiers: what they store and drop, keyed as vLLM's own
prefix cache keys its blocks, so that a router that reads vLLM's event stream (llm-d, Dynamo)
sees the host and disk tiers behind vLLM's pool.

The way there is vLLM's: the scheduler side hands the worker vLLM's keys of the blocks it asks
it to save (:class:`~.metadata.BlockKeys`: ``request.block_hashes``, each block's extra keys,
the request's LoRA; :func:`block_keys`); the worker announces a block once it is written and in
the tiers' prefix index, ``BlockStored`` with the medium of the tier it lies in (``CPU`` for host
memory, ``STORAGE`` for disk and the server), and ``BlockRemoved`` when it leaves them for good
(evicted, dropped, forgotten by a reset) or moves to another medium (then ``BlockStored`` on the
new one first). The core logs what leaves its index and what moves (``Core.take_index_log``, by
the tiers' own prefix hashes); :class:`TierEvents` maps them back to vLLM's hashes, which it
keeps from announcement to removal. The worker's events reach the scheduler in vLLM's
``KVConnectorOutput`` (:class:`KVTierEvents`), and vLLM publishes what the scheduler's
``take_events`` yields with its own prefix cache's events (``--kv-events-config``). With tensor
parallelism rank 0 speaks for all: every rank stores the same blocks.

Not announced: blocks taken from the remote server by ``share_prefixes`` (no save wrote them);
what the server holds for other engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ..._core import Plan
from .metadata import BlockKeys

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    from vllm.v1.request import Request

    from ..._core import Core

__all__ = ["MEDIA", "KVTierEvents", "TierEvents", "block_keys"]

#: vLLM's medium (``BlockStored.medium``) for each of the manager's tiers: its ``device`` tier is
#: the connector's host tier, in host memory.
MEDIA = {"device": MEDIUM_CPU, "host": MEDIUM_CPU, "disk": MEDIUM_STORAGE, "remote": MEDIUM_STORAGE}


def block_keys(request: Request, blocks: int, block_size: int) -> BlockKeys:
    """vLLM's keys of the first ``blocks`` blocks (of ``block_size`` tokens, all of them
    complete) of ``request``, as its prefix cache puts them in ``BlockStored`` events."""
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:blocks]]
    bs = block_size
    extra: list[Any] = []
    mm = 0
    for i in range(len(hashes)):
        keys, mm = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm)
        extra.append(keys)
    lora = request.lora_request
    return BlockKeys(
        hashes,
        to_event_extra_keys(extra),
        lora.adapter_id if lora is not None else None,
        lora.name if lora is not None else None,
    )


class KVTierEvents(KVConnectorKVEvents):
    """The events of a worker's report (vLLM's ``KVConnectorOutput.kv_cache_events``), in the
    order they happened. Only rank 0 reports, so vLLM's merge of the workers' reports is rank
    0's alone."""

    def __init__(self, events: Sequence[KVCacheEvent] = ()) -> None:
        self.events: list[KVCacheEvent] = list(events)
        self.workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KVTierEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []

    def __repr__(self) -> str:
        return f"<KVTierEvents events={len(self.events)}>"


@dataclass
class _Announced:
    """What was announced of a block, kept until it leaves the tiers (a move to another medium
    announces it again there)."""

    block_hash: Any
    parent: Any
    tokens: list[int]
    extra_keys: Any
    lora_id: int | None
    lora_name: str | None
    medium: str


class TierEvents:
    """The worker's account of what its tiers (``core``, of ``block_size``-token blocks)
    announced: :meth:`stored` after each save, :meth:`take` each step. Turns the core's index
    log on for its life (:meth:`close` turns it off)."""

    def __init__(self, core: Core, block_size: int) -> None:
        self.core = core
        self.block_size = block_size
        core.set_index_log(True)
        #: announced blocks, by the tiers' prefix hash
        self._announced: dict[int, _Announced] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def announced(self) -> int:
        """Blocks announced and not removed since."""
        return len(self._announced)

    def stored(
        self, keys: BlockKeys, tokens: Sequence[int], blocks: np.ndarray, first: int
    ) -> None:
        """Announces the blocks a save wrote: ``blocks`` (the tiers' block ids, still held by
        the save's sequence) are blocks ``first, first + 1, ...`` of the request whose keys
        and tokens are ``keys`` and ``tokens``. Those past the first that is not in the prefix
        index (it could not load, nor any after it) are not announced."""
        self._drain()  # what left the tiers before these blocks came, first
        info = self.core.block_info(blocks)
        bs = self.block_size
        run: list[_Announced] = []
        for j, (indexed, prefix_hash, tier) in enumerate(
            zip(info["indexed"], info["hash"], info["tier"], strict=True)
        ):
            i = first + j
            if not indexed or i >= len(keys.hashes):
                break
            block = _Announced(
                keys.hashes[i],
                keys.hashes[i - 1] if i else None,
                list(tokens[i * bs : (i + 1) * bs]),
                keys.extra_keys[i] if keys.extra_keys is not None else None,
                keys.lora_id,
                keys.lora_name,
                MEDIA[Plan.TIERS[int(tier)]],
            )
            self._announced[int(prefix_hash)] = block
            if run and run[-1].medium != block.medium:
                self._events.append(self._stored_event(run))
                run = []
            run.append(block)
        if run:
            self._events.append(self._stored_event(run))

    def take(self) -> KVTierEvents | None:
        """The events since the last call (the core's log drained first), or None."""
        self._drain()
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVTierEvents(events)

    def close(self) -> None:
        self.core.set_index_log(False)

    def _drain(self) -> None:
        """Turns the core's index log into events: ``BlockRemoved`` for an announced block
        that left the index, ``BlockStored`` on its new medium and ``BlockRemoved`` on its old
        one for an announced block that moved to another. Consecutive removals from one medium
        go in one event."""
        hashes, tiers = self.core.take_index_log()
        removed: list[Any] = []
        medium = ""
        for prefix_hash, tier in zip(hashes.tolist(), tiers.tolist(), strict=True):
            block = self._announced.get(prefix_hash)
            if block is None:
                continue  # never announced (a save that failed, a block of a load)
            if tier >= 0:
                to = MEDIA[Plan.TIERS[tier]]
                if to == block.medium:
                    continue
                if removed:  # in the order they happened
                    self._events.append(
                        BlockRemoved(block_hashes=removed, medium=medium, group_idx=0)
                    )
                    removed = []
                old = block.medium
                block.medium = to
                self._events.append(self._stored_event([block]))
            else:
                del self._announced[prefix_hash]
                old = block.medium
            if removed and old != medium:
                self._events.append(BlockRemoved(block_hashes=removed, medium=medium, group_idx=0))
                removed = []
            removed.append(block.block_hash)
            medium = old
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=medium, group_idx=0))

    def _stored_event(self, run: list[_Announced]) -> BlockStored:
        """One ``BlockStored`` for consecutive blocks of one request on one medium, as vLLM's
        block pool makes it for the blocks a step cached."""
        first = run[0]
        return BlockStored(
            block_hashes=[b.block_hash for b in run],
            parent_block_hash=first.parent,
            token_ids=[t for b in run for t in b.tokens],
            block_size=self.block_size,
            lora_id=first.lora_id,
            medium=first.medium,
            lora_name=first.lora_name,
            extra_keys=[b.extra_keys for b in run],
            group_idx=0,
        )
