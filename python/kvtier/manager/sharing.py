"""Prefix sharing between engines through the remote tier (``share_prefixes``).

:class:`PrefixSharing` owns the queue of complete blocks (with their prefix hash) that the next
step publishes, and the counters ``prefix_published`` and ``prefix_fetched``. Published values
are level-0 rows under their prefix hash in the remote tier's level-0 namespace (never under this
instance's slots, so closing a manager leaves them for the other engines); a prompt's blocks that
the manager lacks are filled from there up to the first miss.

A queued block stays pinned (a pin of its own in the core, on top of the ledger's) until
published, so no plan moves it nor eviction frees it before its bytes are sent. The server is
asked outside the manager's lock: each operation comes in a part to run under the lock and a
part to run outside it, and the manager sequences them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import Core, prefix_hashes
from .._torch import torch_module
from ..stores import KVStore
from .ledger import BlockLedger, key_norm_sums
from .tiers import Tiers

if TYPE_CHECKING:
    import torch

__all__ = ["PrefixSharing"]


class PrefixSharing:
    """Publishes complete prompt blocks to ``store`` and fills new prompts from it; with no
    store (sharing off) it holds its counters only and :attr:`active` is False."""

    def __init__(
        self,
        core: Core,
        ledger: BlockLedger,
        tiers: Tiers,
        store: KVStore | None,
        namespace: str,
    ) -> None:
        self.core = core
        self.ledger = ledger
        self.tiers = tiers
        self.store = store
        self.namespace = namespace
        #: block id -> prefix hash of the complete blocks the next step publishes
        self.pending: dict[int, int] = {}
        self.counters = {"prefix_published": 0, "prefix_fetched": 0}

    @property
    def active(self) -> bool:
        return self.store is not None

    # -- publishing -----------------------------------------------------------------------------

    def queue(self, done: np.ndarray) -> None:
        """Queues complete blocks that have a prefix hash (under the lock), pinned again (the
        core counts pins) until published. Only blocks whose exact K/V a level-0 device slot
        holds: a block an encoded append placed below level 0 holds its codec's bytes only,
        and is not shared."""
        info = self.core.block_info(done)
        hashes = info["hash"]
        hashed = (hashes != 0) & (info["level"] == 0) & (info["tier"] == 0)
        self.core.pin(done[hashed])
        self.pending.update(zip(done[hashed].tolist(), hashes[hashed].tolist(), strict=True))

    def take(self) -> tuple[np.ndarray, list[int], torch.Tensor]:
        """Empties the queue (under the lock): ``(blocks, hashes, level-0 slots)``. The
        caller unpins the blocks once :meth:`send` has run, whatever it did."""
        torch = torch_module()
        queued, self.pending = self.pending, {}
        blocks = np.fromiter(queued, dtype=np.uint32, count=len(queued))
        slots = torch.from_numpy(self.core.block_info(blocks)["slot"].astype(np.int64))
        return blocks, list(queued.values()), slots

    def send(self, hashes: list[int], slots: torch.Tensor) -> int:
        """Puts the rows of level-0 device ``slots`` on the server under ``hashes`` (outside
        the lock: the blocks stay pinned at level 0 on the device meanwhile, so their pool rows
        are sent as they are, on the CPU without a copy). Returns how many went (a failed put
        costs the sharing only)."""
        torch = torch_module()
        pool = self.tiers.pools["device", 0]
        if pool.device.type == "cpu":
            rows = [pool[s].view(-1).view(torch.uint8).numpy() for s in slots.tolist()]
        else:
            host = pool.index_select(0, slots.to(pool.device)).cpu()
            rows = list(host.reshape(len(slots), -1).view(torch.uint8).numpy())
        assert self.store is not None
        return sum(self.store.put_many(hashes, rows))

    def published(self, n: int) -> None:
        self.counters["prefix_published"] += n

    # -- fetching -------------------------------------------------------------------------------

    def hashes_of(self, tokens: np.ndarray, salt: str | None) -> np.ndarray:
        """The prefix hashes of the whole blocks of ``tokens`` (a sequence of ``salt``)."""
        return prefix_hashes(tokens, self.ledger.block_size, self.namespace, salt)

    def held(self, hashes: np.ndarray) -> int:
        """The leading blocks of ``hashes`` that the server holds, up to the first it lacks
        (one round trip, outside the lock)."""
        assert self.store is not None
        found = [*self.store.contains_many([int(h) for h in hashes]), False]
        return found.index(False)

    def wanted(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The leading ``blocks`` of a new prompt that have a prefix hash, and their hashes
        (under the lock)."""
        hashes = self.core.block_info(blocks)["hash"]
        n = len(hashes) if hashes.all() else int(np.argmin(hashes != 0))
        return blocks[:n], hashes[:n]

    def get(self, hashes: np.ndarray) -> list[memoryview]:
        """The values of the leading ``hashes`` that the server holds, up to the first miss
        (outside the lock; a value of the wrong size is a miss)."""
        assert self.store is not None
        values = self.store.get_many([int(h) for h in hashes])
        hits: list[memoryview] = []
        for v in values:
            if v is None or len(v) != self.tiers.level_bytes[0]:
                break
            hits.append(v)
        return hits

    def fill(self, blocks: np.ndarray, hits: list[memoryview]) -> int:
        """Writes ``hits`` into the leading ``blocks`` (under the lock) as far as they are still
        untouched (nothing written, still pinned), and completes them. Returns how many."""
        torch = torch_module()
        ledger = self.ledger
        blocks = blocks[: len(hits)]
        untouched = (ledger.written[blocks] == 0).all(axis=1) & ledger.pinned[blocks]
        k = len(blocks) if untouched.all() else int(np.argmin(untouched))
        if not k:
            return 0
        blocks, hits = blocks[:k], hits[:k]
        slots = self.core.block_info(blocks)["slot"].astype(np.int64)
        pool = self.tiers.pools["device", 0]
        sums: Any
        if pool.device.type == "cpu":
            # Block by block, each value straight into its row, whose keys' norms are then
            # taken while the row is in cache (2.5x faster than whole-batch passes).
            sums = np.empty(k)
            for i, (slot, value) in enumerate(zip(slots.tolist(), hits, strict=True)):
                row = pool[slot]
                row.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(value, np.uint8)
                sums[i] = float(key_norm_sums(row[None])[0])
        else:
            rows = self.tiers.rows(hits, 0).to(self.tiers.device)
            pool[torch.from_numpy(slots).to(self.tiers.device)] = rows
            sums = key_norm_sums(rows).cpu().numpy()
        ledger.filled(blocks, sums)
        self.counters["prefix_fetched"] += k
        return k
