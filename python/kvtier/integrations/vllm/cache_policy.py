"""``KvtierCachePolicy``: kvtier's scheduler deciding what vLLM's own CPU offloading tier evicts.

With vLLM's native offloading (``OffloadingConnector``, its ``CPUOffloadingSpec`` or
``TieringOffloadingSpec``), vLLM moves the bytes between the GPU and its CPU tier and keeps the
chunks; a ``CachePolicy`` only decides which cached chunk goes when the tier needs room. This
one decides by kvtier's core, as ``kvtier simulate`` replays it:

- a request's keys form a chain (vLLM records each key's end-token position in the request's
  context), so the cached chunks form prefix trees, and eviction takes leaves only: a chunk
  goes only once no cached chunk continues its prefix, and no cached chunk is ever stranded
  behind a missing one;
- leaves are ranked by the core's policy (``KVTIER_POLICY``, default ``importance``: measured
  reuse and its chance of coming back, see docs/simulate.md);
- a request whose ``kv_transfer_params`` hold ``{"kvtier": {"release": true}}`` ends its
  conversation: its chain goes first (:func:`~.scheduler.release_requested`'s rule).

Load it by name in the connector's extra config::

    "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592,
        "eviction_policy": "KvtierCachePolicy",
        "cache_policy_module_path": "kvtier.integrations.vllm"}

How vLLM's calls map onto the core: a request's store misses (``on_store_miss``) append its
chain to a core sequence of its own, sharing the chunks the tier holds and allocating the new
ones (evicting, when the tier is full, exactly what vLLM then asks ``evict`` for); a chunk
being written or read (``ref_cnt`` other than 0) is pinned; the request's end
(``on_request_finished``) runs the core's step and frees the sequence, leaving its chunks
cached. Each call is one core call or a few; the core's state is bounded by the tier's chunks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.kv_offload.base import get_offload_group_idx
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from ..._core import Core
from ...config import KvtierConfig
from ...errors import KvtierError, OutOfCapacityError
from .offload import chunk_hash
from .scheduler import release_asked

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext

__all__ = ["KvtierCachePolicy"]

log = logging.getLogger("kvtier.vllm")

_U64 = (1 << 64) - 1

#: The core's block size: it ranks chunks, it never counts their tokens (vLLM gives a policy its
#: capacity only), so any size ranks them alike.
_CHUNK_TOKENS = 16


@dataclass
class _Chain:
    """One request's chain of keys in one KV-cache group, as far as its core sequence holds it."""

    seq: int
    held: int = 0  # keys of the chain the sequence holds, from the first


@dataclass
class _RequestChains:
    """A request's core sequences, one per KV-cache group (in its ``ReqContext``'s state)."""

    chains: dict[int, _Chain] = field(default_factory=dict)
    #: a store of this request appended to the core (else, at its end, its hits are)
    stored: bool = False
    #: the policy these sequences belong to (a context may meet another policy's tier)
    owner: object = None


class KvtierCachePolicy(CachePolicy):
    """vLLM's ``CachePolicy`` over kvtier's core (see the module's docstring)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.config = KvtierConfig.from_env()
        self._new_core()

    def _new_core(self) -> None:
        # One level, one tier of `cache_capacity` chunks: the core ranks and evicts, vLLM
        # holds the bytes. A cache: a full tier makes room by evicting.
        self.core = Core(
            [1],
            **self.config.core_arguments(
                [("device", self.cache_capacity)],
                block_size=_CHUNK_TOKENS,
                enable_compression=False,
                pressure_only=True,
                drop_ratio=0.0,
                evict_on_full=True,
            ),
        )
        self.core.set_index_log(True)  # which chunks an append evicted
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._hash: dict[OffloadKey, int] = {}  # the core's hash of each chunk's key
        self._key: dict[int, OffloadKey] = {}
        self._block: dict[OffloadKey, int] = {}  # the core's block of each chunk
        #: chunks the core evicted to make room for a store, for vLLM's `evict` that follows
        self._evicted: list[tuple[OffloadKey, ChunkStatus]] = []
        #: keys a store appended, for vLLM's `insert` that follows
        self._appended: set[OffloadKey] = set()
        #: the core found no room for the store ``on_store_miss`` announced: `evict` refuses
        self._refused = False
        #: chunks vLLM holds that the core lost track of (after a failed store before them)
        self._untracked: set[OffloadKey] = set()

    # -- vLLM's CachePolicy --------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """A chunk vLLM allocated for a store: the core holds it already when the store's
        misses came first (``on_store_miss``); else it is a prefix of its own."""
        self.chunks[key] = chunk
        if key in self._appended:
            self._appended.discard(key)
            self._pin(key)
        else:
            self._root(key)

    def remove(self, key: OffloadKey) -> None:
        """A failed store: the chunk leaves the core. Chunks after it in its prefix, which the
        core forgets with it (they could never load), are tracked again as prefixes of their
        own once the request that held them ends, if vLLM still holds them."""
        chunk = self.chunks.pop(key)
        self._untracked.discard(key)
        if key not in self._block:
            return
        block = self._blocks([key])
        if chunk.ref_cnt != 0:
            self.core.unpin(block)
        self.core.forget(block)
        self._drop(key)
        for h in self._left():
            after = self._key.get(h)
            if after is not None:
                if after in self.chunks and self.chunks[after].ref_cnt != 0:
                    self.core.unpin(self._blocks([after]))  # its block goes; no pin may hold it
                self._drop(after)
                if after in self._appended:
                    self._appended.discard(after)  # not inserted yet: `insert` roots it
                else:
                    self._untracked.add(after)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Chunks read: the core counts reads as the engine reading them."""
        blocks = self._blocks([k for k in keys if k in self._block])
        if len(blocks):
            self.core.record_reads(blocks)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A store is about to allocate chunks for ``keys``: the request's chain up to them
        is appended to its core sequence (the chunks the tier holds shared, the new ones
        allocated), the core evicting for room as it ranks; ``evict`` hands those over. If
        the core cannot make room (every chunk it could evict is in use), nothing changes
        and ``evict`` refuses."""
        keys = list(keys)
        new = set(keys)
        state = self._request(req_context)
        state.stored = True
        self._refused = False
        for group, chain in self._chains(req_context, keys).items():
            held = state.chains.get(group)
            start = 0 if held is None else held.held
            run = []  # the next keys of the chain: held by the tier, or new
            for key in chain[start:]:
                if key not in new and key not in self._block:
                    break  # not stored, nor to be: the chain stops here
                run.append(key)
            if not any(k in new for k in run):
                continue
            if held is None:
                held = state.chains[group] = _Chain(self.core.add_sequence())
            try:
                blocks = self._append(held.seq, run)
            except OutOfCapacityError:
                # No room but the request's own prefix: vLLM's `evict` for this store gets
                # None (as a replay keeps a request's hits and refuses its new blocks).
                self._refused = True
                continue
            held.held += len(run)
            self.core.record_reads(blocks)  # the request reads its whole chain
            self._appended.update(k for k in run if k in new)
            self._evicted += [self._evict(h) for h in self._left() if h in self._key]
        # Keys of another chain shape (a gap vLLM skipped): `insert` roots them.

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """``n`` chunks, none of ``protected``, or None with nothing changed: those the core
        evicted for the store ``on_store_miss`` announced (None if it found no room beside the
        request's own prefix), else its lowest-ranked leaves now (``Core.evict_cached``). (More than ``n`` only while a failed store's chunk, which vLLM
        freed, is still held by its request's core sequence: vLLM frees the extra ones too.)"""
        evicted, self._evicted = self._evicted, []
        if self._refused:
            self._refused = False
            return None
        if len(evicted) < n:
            keep = self._blocks([k for k in protected if k in self._block])
            hashes = self.core.evict_cached(n - len(evicted), keep)
            if hashes is None:
                if evicted:  # the core's count of free chunks fell behind vLLM's
                    log.warning(
                        "KvtierCachePolicy: %d chunks evicted for a store vLLM asked %d of",
                        len(evicted),
                        n,
                    )
                return None
            self._left()  # the same hashes, logged
            evicted += [self._evict(int(h)) for h in hashes]
        return evicted

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """The request's end: a request that stored nothing reads its hits now (a store read
        them as it appended), the core runs its step, and the request's sequences are freed
        (released first when it ended its conversation)."""
        state = self._request(req_context)
        if not state.stored:
            for group, keys in enumerate(key_groups):
                hits = [k for k in keys if k in reused_keys]
                if hits and all(k in self._block for k in hits):
                    state.chains[group] = _Chain(self.core.add_sequence(), len(hits))
                    self.core.record_reads(self._append(state.chains[group].seq, hits))
        plan = self.core.plan()
        self.core.commit(plan.id)
        release = release_asked(req_context.kv_transfer_params, req_context.req_id)
        for chain in state.chains.values():
            if release:
                self.core.release(chain.seq)
            self.core.free_sequence(chain.seq)
        state.chains.clear()
        for key in list(self._untracked):  # room now, their old blocks freed
            with contextlib.suppress(OutOfCapacityError):
                self._root(key)
                self._untracked.discard(key)

    def clear(self) -> None:
        self._new_core()

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self._block:
            self.core.unpin(self._blocks([key]))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key in self._block:
            self.core.pin(self._blocks([key]))

    # -- the core's side -----------------------------------------------------------------------

    def _request(self, req_context: ReqContext) -> _RequestChains:
        state = req_context.get_state(_RequestChains)
        if state is None or state.owner is not self:
            state = _RequestChains(owner=self)
            req_context.set_state(state)
        return state

    def _chains(self, req_context: ReqContext, keys: list[OffloadKey]) -> dict[int, list[Any]]:
        """The request's keys by KV-cache group, each group's in chain order (by end-token
        position), as far as vLLM recorded positions: every key up to the last of ``keys``."""
        positions = _positions(req_context)
        chains: dict[int, list[Any]] = {}
        for key, _ in sorted(positions.items(), key=lambda kv: kv[1]):
            chains.setdefault(get_offload_group_idx(key), []).append(key)
        last: dict[int, int] = {}
        for k in keys:
            group = get_offload_group_idx(k)
            last[group] = max(last.get(group, -1), positions.get(k, -1))
        return {
            group: [k for k in chain if positions[k] <= last[group]]
            for group, chain in chains.items()
            if group in last
        }

    def _append(self, seq: int, keys: list[OffloadKey]) -> Any:
        hashes = np.array([self._hash_of(k) for k in keys], dtype=np.uint64)
        blocks, _ = self.core.append_blocks(seq, hashes)
        for key, block in zip(keys, blocks.tolist(), strict=True):
            self._block[key] = block
        return blocks

    def _hash_of(self, key: OffloadKey) -> int:
        """The core's hash of a chunk: the first 8 bytes of vLLM's block hash (a hash already,
        so the core's statistics see what a replay of the same blocks sees), its KV-cache group
        mixed in; never another key's."""
        h = self._hash.get(key)
        if h is None:
            h = chunk_hash(key)
            while h in self._key:
                h = (h + 1) & _U64
            self._hash[key] = h
            self._key[h] = key
        return h

    def _blocks(self, keys: Iterable[OffloadKey]) -> Any:
        return np.array([self._block[k] for k in keys], dtype=np.uint32)

    def _left(self) -> list[int]:
        """The hashes that left the core's index since the last call (evicted, forgotten)."""
        hashes, tiers = self.core.take_index_log()
        return [int(h) for h in hashes[tiers < 0]]

    def _root(self, key: OffloadKey) -> None:
        """``key``'s chunk as a prefix of its own: its chain is unknown, or broken."""
        seq = self.core.add_sequence()
        try:
            self._append(seq, [key])
        finally:
            self.core.free_sequence(seq)
        self._pin(key)

    def _pin(self, key: OffloadKey) -> None:
        """Pins ``key``'s block while vLLM's chunk is in use (being written, or read)."""
        if self.chunks[key].ref_cnt != 0:
            self.core.pin(self._blocks([key]))

    def _evict(self, h: int) -> tuple[OffloadKey, ChunkStatus]:
        key = self._key[h]
        chunk = self.chunks.pop(key)
        self._drop(key)
        return key, chunk

    def _drop(self, key: OffloadKey) -> None:
        h = self._hash.pop(key)
        self._key.pop(h, None)
        self._block.pop(key, None)


def _positions(req_context: ReqContext) -> dict[Any, int]:
    """Each key vLLM recorded for the request, with its end-token position (vLLM 0.32 keeps them
    in the context; ``get_offload_key_position`` answers one key at a time)."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict):
        raise KvtierError(
            "KvtierCachePolicy: this vLLM's ReqContext records no key positions "
            "(_offload_key_positions); it needs vLLM 0.32's"
        )
    return positions
