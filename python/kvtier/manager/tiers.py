"""Pools and tiers: the tensors and stores that hold a manager's blocks, and the byte moves.

Per (tier, level) there is one pool, allocated once from the :class:`PoolLayout`:

- ``device`` and ``host`` pools are tensors: level 0 a float pool ``[slots, layers, 2,
  kv_heads, block_size, head_dim]`` in the model dtype (on the device, or pinned host memory
  behind a GPU), every other level a packed pool ``uint8 [slots, bytes_per_block]`` of its codec;
- ``disk`` and ``remote`` are :mod:`kvtier.stores` (a directory, a Redis server), one store per
  tier seen through one namespace per level, its values keyed ``{instance}.{slot}`` so the core
  addresses them exactly like a pool. As in a pool, a slot a block leaves keeps its bytes until a
  block reuses it; :meth:`Tiers.close` deletes this instance's values.

:meth:`Tiers.execute` copies a plan's bytes (one batched codec call or copy per kind of move and
pair of pools), raising :class:`StoreRefused` when a store refuses a write and
:class:`BlocksLost` naming the blocks a store could not give back; the caller aborts the plan.
A refusing tier is left out of plans for :data:`STORE_RETRY_S` (:meth:`suspend`,
:meth:`resume`). This class reads the core (where blocks lie) and sets tier budgets in it; it
never changes which block lives where.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import Core, Plan, copy_rows
from .._torch import torch_module
from ..codecs import BlockShape, Codec
from ..config import KvtierConfig
from ..errors import ConfigError
from ..stores import DiskStore, KVStore, Namespace, RedisStore
from .sizing import STORE_TIERS, PoolLayout

if TYPE_CHECKING:
    import torch

    from .external import ExternalBlocks

__all__ = ["STORE_RETRY_S", "BlocksLost", "StoreRefused", "Tiers"]

log = logging.getLogger("kvtier.manager")

#: Seconds a store tier that refused a write is left out of plans.
STORE_RETRY_S = 1.0


class StoreRefused(Exception):
    """A store tier refused a write (full, server gone)."""

    def __init__(self, tier: str) -> None:
        super().__init__(f"the {tier} tier refused a write")
        self.tier = tier


class BlocksLost(Exception):
    """A store tier could not give ``blocks`` back (corrupt, evicted, server gone)."""

    def __init__(self, tier: str, blocks: np.ndarray) -> None:
        super().__init__(f"{len(blocks)} block(s) lost from the {tier} tier")
        self.tier, self.blocks = tier, blocks


class Tiers:
    """The pools and stores of one manager, and the moves of bytes between them.

    ``pools``: the tensor pools by ``(tier, level)``; ``stores``: the store pools likewise.
    Neither is ever replaced: a pool's tensor lives as long as the manager."""

    def __init__(
        self,
        core: Core,
        layout: PoolLayout,
        config: KvtierConfig,
        shape: BlockShape,
        dtype: Any,
        device: Any,
        codecs: Sequence[Codec],
        ladder: Sequence[str],
    ) -> None:
        torch = torch_module()
        self.core = core
        self.layout = layout
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.codecs = list(codecs)
        self.level_bytes = layout.level_bytes
        self.instance = uuid.uuid4().hex[:16]
        self.pools: dict[tuple[str, int], Any] = {}
        for (tier, level), n in layout.slots.items():
            if tier in STORE_TIERS or level >= len(self.codecs):  # a drop level holds no bytes
                continue
            on = device if tier == "device" else torch.device("cpu")
            pin = tier == "host" and device.type == "cuda"
            dims = (n, *shape.dims) if level == 0 else (n, self.level_bytes[level])
            dt = dtype if level == 0 else torch.uint8
            try:
                self.pools[tier, level] = torch.empty(dims, dtype=dt, device=on, pin_memory=pin)
            except RuntimeError as exc:  # torch's out-of-memory errors among them
                raise ConfigError(
                    f"{tier} budget: could not allocate its level-{level} pool of "
                    f"{n * self.level_bytes[level]} B on {on} ({exc}); lower the {tier} budget"
                ) from None
        self.stores = self._open_stores(config, ladder)
        self._suspended: dict[str, float] = {}
        #: pinned host memory that packed rows cross the bus through, one buffer a way
        self._to_host, self._to_device = PinnedStaging(), PinnedStaging()

    def _open_stores(
        self, config: KvtierConfig, ladder: Sequence[str]
    ) -> dict[tuple[str, int], KVStore]:
        """One store per store tier, seen through one namespace per level (its codec)."""
        stores: dict[tuple[str, int], KVStore] = {}
        for tier in (t for t in self.layout.budgets if t in STORE_TIERS):
            base_ns = Namespace(config.namespace, codec=ladder[0], dtype=self.shape.dtype)
            if tier == "disk":
                if config.disk_path is None:
                    raise ConfigError("disk_budget: the disk tier needs a directory: set disk_path")
                # The core keeps the tier within its budget; the store's own budget only
                # allows for the headers.
                root = Path(config.disk_path) / f"manager-{self.instance}"
                store: KVStore = DiskStore(root, base_ns, 2 * self.layout.budgets[tier])
                # Its files are this manager's slots, of no use to anyone else: a manager
                # dropped without close() (a collected TieredCache's own) takes them along.
                weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
            else:
                if config.remote_url is None:
                    raise ConfigError(
                        "remote_budget: the remote tier needs a server: set remote_url"
                    )
                store = RedisStore(
                    config.remote_url,
                    base_ns,
                    timeout=config.remote_timeout,
                    ttl=config.remote_ttl,
                    retry_after=STORE_RETRY_S,
                    tls_ca=config.remote_tls_ca,
                    tls_cert=config.remote_tls_cert,
                    tls_key=config.remote_tls_key,
                )
            for level, codec in enumerate(ladder[: len(self.codecs)]):
                stores[tier, level] = store.with_namespace(
                    base_ns.with_codec(codec, self.shape.dtype, str(self.shape))
                )
        return stores

    def close(self) -> None:
        """Deletes this instance's values from the store tiers and closes them."""
        for (_, level), store in self.stores.items():
            if store.closed:
                continue
            if isinstance(store, DiskStore):
                shutil.rmtree(store.root, ignore_errors=True)
            else:
                # Slot keys only (instance.slot), never the published prefix hashes.
                mine = [k for k in store.keys() if k.startswith(f"{self.instance}.")]  # noqa: SIM118
                store.delete_many(mine)
            if level == len(self.codecs) - 1:
                store.close()

    @property
    def pool_bytes(self) -> int:
        """Bytes allocated for all tensor pools."""
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    # -- reads and writes -----------------------------------------------------------------------

    def locations(
        self, blocks: np.ndarray
    ) -> Iterator[tuple[tuple[str, int], np.ndarray | None, np.ndarray, np.ndarray]]:
        """Blocks grouped by pool: ``((tier, level), rows in blocks, slots, block ids)``; rows
        None when one pool holds them all."""
        if not len(blocks):
            return
        tiers, levels, slots = self.core.block_places(blocks)
        key = tiers.astype(np.int64) * 256 + levels
        first = int(key[0])
        if (key == first).all():  # the usual case: no grouping
            yield (Plan.TIERS[first // 256], first % 256), None, slots, blocks
            return
        for k in np.unique(key):
            rows = np.nonzero(key == k)[0]
            yield (Plan.TIERS[int(k) // 256], int(k) % 256), rows, slots[rows], blocks[rows]

    def read_layer(
        self,
        tier: str,
        level: int,
        slots: np.ndarray,
        layer: int,
        blocks: np.ndarray,
        device: Any = None,
    ) -> torch.Tensor:
        """``[n, 2, kv_heads, block_size, head_dim]`` of one layer of blocks, decoded to the
        model dtype, on the device (or on ``device``: a packed level's bytes go there encoded,
        to be decoded there); raises :class:`BlocksLost` for blocks a store lost."""
        pool, idx = self._source((tier, level), slots, blocks)
        if level == 0 and pool.device.type == "cpu" == self.device.type:
            out = pool.new_empty((len(idx), *pool.shape[2:]))
            copy_rows(row_addresses(pool, idx.numpy(), layer), _rows_of(out), _row_bytes(out))
            return out
        idx = idx.to(pool.device)
        device = torch_module().device(self.device if device is None else device)
        if level == 0:
            return pool[:, layer].index_select(0, idx).to(device, non_blocking=True)
        codec = self.codecs[level]
        if device.type == "cuda" and pool.device.type == "cpu" and codec.layer_major:
            return self._decode_on_gpu(codec, pool, idx.numpy(), layer, device)
        return codec.decode_layer(
            pool, self.shape, layer, slots=idx, dtype=self.dtype, device=device
        )

    def _decode_on_gpu(
        self, codec: Codec, pool: torch.Tensor, slots: np.ndarray, layer: int, device: Any
    ) -> torch.Tensor:
        """One layer of host-pool rows ``slots`` decoded on a GPU: the layer's bytes gathered
        natively into pinned memory (the packed rows of one-layer blocks), copied there
        encoded without waiting, and decoded there (the CUDA kernels, where the codec has
        them)."""
        torch = torch_module()
        one = BlockShape(
            1, self.shape.kv_heads, self.shape.block_size, self.shape.head_dim, self.shape.dtype
        )
        host = self._to_device.take((len(slots), codec.bytes_per_block(one)))
        copy_layer_rows(codec, self.shape, layer, host, pool, slots, into_pool=False)
        rows = host.to(device, non_blocking=True)
        self._to_device.used(torch.cuda.current_stream(device).record_event())
        return codec.decode_layer(rows, one, 0, dtype=self.dtype)

    def read_layer_into(
        self,
        tier: str,
        level: int,
        slots: np.ndarray,
        layer: int,
        blocks: np.ndarray,
        into: ExternalBlocks,
        pick: np.ndarray | None,
    ) -> None:
        """:meth:`read_layer` into blocks ``pick`` of ``into``: a level-0 CPU pool's rows are
        copied straight there; packed rows are decoded where ``into`` is (on a GPU, they cross
        encoded); raises :class:`BlocksLost` for blocks a store lost."""
        if (tier, level) == ("device", 0) and self.device.type == "cpu" == into.device.type:
            into.copy_from(row_addresses(self.pools[tier, 0], slots, layer), pick)
        else:
            into.write(self.read_layer(tier, level, slots, layer, blocks, into.device), pick)

    def write_tokens(
        self, slots: torch.Tensor, layer: int, offsets: torch.Tensor, k: Any, v: Any
    ) -> None:
        """K/V of tokens into level-0 device slots ``slots`` at ``offsets`` of ``layer``."""
        pool = self.pools["device", 0]
        pool[slots, layer, 0, :, offsets] = k
        pool[slots, layer, 1, :, offsets] = v

    def write_blocks(self, slots: torch.Tensor, layer: int, blocks: torch.Tensor) -> None:
        """Whole blocks of one layer, ``[n, 2, H, N, D]`` contiguous, into level-0 device slots
        ``slots`` (on the CPU, a copy a block in the extension: torch's indexed copies run at
        a quarter of memcpy's speed there)."""
        pool = self.pools["device", 0]
        if pool.device.type != "cpu":
            pool[slots, layer] = blocks
            return
        copy_rows(_rows_of(blocks), row_addresses(pool, slots.numpy(), layer), _row_bytes(blocks))

    def write_external(
        self,
        slots: np.ndarray,
        layer: int,
        blocks: ExternalBlocks,
        pick: np.ndarray | None,
        *,
        measure: bool = False,
        limit: float = math.inf,
    ) -> np.ndarray | None:
        """Blocks ``pick`` of ``blocks`` (every one when None), one layer's, into level-0 CPU
        slots ``slots``: each copied straight from where it lies into its slot (with
        ``measure``, checked within ``limit`` and measured on the way:
        :meth:`ExternalBlocks.copy_to`)."""
        addresses = row_addresses(self.pools["device", 0], slots, layer)
        return blocks.copy_to(addresses, pick, measure=measure, limit=limit)

    def write_encoded(
        self, level: int, slots: np.ndarray, layer: int, blocks: torch.Tensor
    ) -> None:
        """Whole blocks of one layer, ``[n, 2, H, N, D]`` on any device, encoded there by
        level ``level``'s codec (its CUDA kernels on a GPU, its native code on the CPU) and
        written at that layer of device-tier slots ``slots`` of the level: only the encoded
        bytes cross to the pool (from a GPU, through pinned memory)."""
        torch = torch_module()
        codec, pool = self.codecs[level], self.pools["device", level]
        rows = codec.encode(blocks[:, None]).data  # one-layer blocks: that layer's bytes
        if pool.device.type != "cpu":
            idx = torch.from_numpy(slots.astype(np.int64)).to(pool.device)
            codec.write_layer_rows(pool, idx, self.shape, layer, rows.to(pool.device))
            return
        if rows.device.type == "cuda":
            host = self._to_host.take(rows.shape)
            host.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(rows.device).synchronize()
            rows = host
        copy_layer_rows(codec, self.shape, layer, rows.contiguous(), pool, slots, into_pool=True)

    def copy_level0(self, src: int, dst: int) -> None:
        """Level-0 device slot ``src``'s bytes into slot ``dst``."""
        pool = self.pools["device", 0]
        pool[dst] = pool[src]

    def rows(self, values: list[memoryview], level: int) -> torch.Tensor:
        """Values of a level's size as a CPU tensor of its rows, ``[n, *row]``."""
        torch = torch_module()
        raw = np.empty((len(values), self.level_bytes[level]), dtype=np.uint8)
        for i, v in enumerate(values):
            raw[i] = np.frombuffer(v, np.uint8)
        rows = torch.from_numpy(raw)
        if level == 0:
            rows = rows.view(self.dtype)
        return rows.reshape(len(values), *self._row_shape(level))

    # -- plans ----------------------------------------------------------------------------------

    def execute(self, plan: Plan) -> None:
        """Copies a plan's bytes: one batched codec call or copy per kind of move and pair of
        pools (evictions and drops move none). Commits nothing: the caller commits the plan,
        or aborts it if this raises."""
        if not len(plan):
            return
        torch = torch_module()
        tiers, kinds = Plan.TIERS, Plan.KINDS
        copies = np.isin(plan.kind, [kinds.index("evict"), kinds.index("drop")], invert=True)
        cols = np.stack([plan.src_tier, plan.src_level, plan.dst_tier, plan.dst_level]).T[copies]
        blocks = plan.block[copies]
        src_slots, dst_slots = plan.src_slot[copies], plan.dst_slot[copies]
        groups, inverse = np.unique(cols, axis=0, return_inverse=True)
        for g, (st, sl, dt, dl) in enumerate(groups):
            pick = inverse.reshape(-1) == g
            src_key, dst_key = (tiers[st], int(sl)), (tiers[dt], int(dl))
            src, s = self._source(src_key, src_slots[pick], blocks[pick])
            dst, d = self._destination(dst_key, dst_slots[pick])
            if sl == dl:
                dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device, non_blocking=True)
            elif st == dt and sl == 0:
                self.codecs[dl].encode_into(src, s, dst, d)
            elif st == dt:
                self.codecs[sl].transcode_into(src, s, self.codecs[dl], dst, d, self.shape)
            else:
                raise RuntimeError(f"plan moves a block across tiers and levels at once: {cols}")
            if dst_key in self.stores:
                self._store_rows(dst_key, dst_slots[pick], dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def suspend(self, tier: str) -> None:
        """A store tier refused a write: no moves into it (its budget is what it holds) for
        :data:`STORE_RETRY_S`."""
        used = dict(self.core.tier_bytes())[tier]
        self.core.set_budget(tier, used)
        self._suspended[tier] = time.monotonic() + STORE_RETRY_S
        log.warning("the %s tier refused a write: no moves into it for a while", tier)

    def resume(self) -> None:
        """Gives back their budget to the suspended tiers whose time is up."""
        now = time.monotonic()
        for tier, until in list(self._suspended.items()):
            if now >= until:
                self.core.set_budget(tier, self.layout.tier_bytes(tier))
                del self._suspended[tier]

    # -- store rows -----------------------------------------------------------------------------

    def _slot_keys(self, slots: np.ndarray) -> list[str]:
        return [f"{self.instance}.{int(s)}" for s in slots]

    def _row_shape(self, level: int) -> tuple[int, ...]:
        return tuple(self.shape.dims) if level == 0 else (self.level_bytes[level],)

    def _load(self, key: tuple[str, int], slots: np.ndarray, blocks: np.ndarray) -> torch.Tensor:
        """Rows of a store pool as a CPU tensor ``[n, *row]``; raises :class:`BlocksLost`
        naming the blocks the store could not give back."""
        level = key[1]
        values = self.stores[key].get_many(self._slot_keys(slots))
        nbytes = self.level_bytes[level]
        got = [v for v in values if v is not None and len(v) == nbytes]
        if len(got) < len(values):
            lost = [i for i, v in enumerate(values) if v is None or len(v) != nbytes]
            raise BlocksLost(key[0], blocks[lost])
        return self.rows(got, level)

    def _source(
        self, key: tuple[str, int], slots: np.ndarray, blocks: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a group of moves reads: a tensor pool and the slots, or a store's rows loaded."""
        torch = torch_module()
        if key in self.stores:
            return self._load(key, slots, blocks), torch.arange(len(slots))
        return self.pools[key], torch.from_numpy(slots.astype(np.int64))

    def _destination(
        self, key: tuple[str, int], slots: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a group of moves writes: a tensor pool and the slots, or rows that
        :meth:`_store_rows` then puts."""
        torch = torch_module()
        if key in self.stores:
            dt = self.dtype if key[1] == 0 else torch.uint8
            rows = torch.empty((len(slots), *self._row_shape(key[1])), dtype=dt)
            return rows, torch.arange(len(slots))
        return self.pools[key], torch.from_numpy(slots.astype(np.int64))

    def _store_rows(self, key: tuple[str, int], slots: np.ndarray, rows: torch.Tensor) -> None:
        torch = torch_module()
        raw = rows.reshape(len(slots), -1).contiguous().view(torch.uint8).numpy()
        done = self.stores[key].put_many(self._slot_keys(slots), list(raw))
        if not all(done):
            raise StoreRefused(key[0])


def _row_bytes(blocks: torch.Tensor) -> int:
    """Bytes of one row (block) of a contiguous tensor of blocks."""
    return int(blocks.stride(0) * blocks.element_size())


def _rows_of(blocks: torch.Tensor) -> np.ndarray:
    """The address of each row (block) of a contiguous tensor of blocks."""
    step = np.uint64(_row_bytes(blocks))
    return np.uint64(blocks.data_ptr()) + step * np.arange(blocks.shape[0], dtype=np.uint64)


def row_addresses(pool: torch.Tensor, slots: np.ndarray, layer: int) -> np.ndarray:
    """The address of layer ``layer`` of each slot of a level-0 pool (on the CPU)."""
    item = pool.element_size()
    slot, row = pool.stride()[:2]
    return slots.astype(np.uint64) * (slot * item) + (pool.data_ptr() + layer * row * item)


class PinnedStaging:
    """A pinned host buffer that packed rows cross the bus through: grown as needed and kept
    (pinning memory costs far more than a copy), and taken again only once the copy that last
    read it (:meth:`used`) is done."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._busy: Any = None  # the CUDA event of the copy reading it

    def take(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """``uint8`` rows of ``shape`` in the buffer, free to write."""
        torch = torch_module()
        if self._busy is not None:
            self._busy.synchronize()
            self._busy = None
        need = int(np.prod(shape))
        if self._buffer is None or self._buffer.numel() < need:
            have = 0 if self._buffer is None else self._buffer.numel()
            self._buffer = torch.empty(max(need, 2 * have), dtype=torch.uint8, pin_memory=True)
        return self._buffer[:need].view(*shape)

    def used(self, event: Any) -> None:
        """A copy out of the buffer is queued; ``event`` ends it."""
        self._busy = event


def copy_layer_rows(
    codec: Codec,
    shape: BlockShape,
    layer: int,
    rows: torch.Tensor,
    pool: torch.Tensor,
    slots: np.ndarray,
    *,
    into_pool: bool,
) -> None:
    """Between layer ``layer`` of a layer-major codec's packed CPU ``pool`` (rows ``slots``)
    and ``rows``, the packed rows of one-layer blocks (``uint8 [len(slots), bytes]``,
    contiguous, on the CPU): each section's bytes of the layer, a native copy per block
    (torch's indexed copies run several times slower on the CPU). ``into_pool``: from
    ``rows`` into the pool (:meth:`Codec.write_layer_rows`), else out of it
    (:meth:`Codec.layer_rows`)."""
    at_rows = np.uint64(rows.data_ptr()) + np.uint64(rows.stride(0)) * np.arange(
        len(slots), dtype=np.uint64
    )
    at_pool = np.uint64(pool.data_ptr()) + np.uint64(pool.stride(0)) * slots.astype(np.uint64)
    for cols, at in codec.layer_columns(shape, layer):
        ours, theirs = at_rows + np.uint64(at), at_pool + np.uint64(cols.start)
        src, dst = (ours, theirs) if into_pool else (theirs, ours)
        copy_rows(src, dst, cols.stop - cols.start)
