# Hand-written stub of the Rust extension (crates/kvtier-py); checked by `make stubtest`. Its
# docstrings are the Rust doc comments (tests/test_core_stub_docs.py): the docs site reads them here.
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, final

import numpy as np
import numpy.typing as npt

from kvtier.errors import PayloadError

__all__ = [
    "FORMAT_CHECKSUM_BYTES",
    "FORMAT_MAGIC",
    "FORMAT_OVERHEAD",
    "FORMAT_VERSION",
    "Core",
    "HostValue",
    "HostValues",
    "Plan",
    "Simulator",
    "StoreIndex",
    "StoreStats",
    "StreamingChecksum",
    "attend",
    "block_key_norms",
    "checksum",
    "copy_checksum",
    "copy_rows",
    "dequantize_rows",
    "digest",
    "kernel_sources",
    "namespace_seed",
    "pack_texts",
    "paged_copy",
    "paged_scan",
    "prefix_hashes",
    "quantize_rows",
    "read_key",
    "read_sealed",
    "read_stored",
    "seal_header",
    "store_path",
    "transcode_rows",
    "unseal",
    "write_checksummed",
    "write_stored",
    "write_token",
]

# The stored-value format (crates/kvtier-store/src/format.rs, defined there once).
FORMAT_MAGIC: Final[bytes]
FORMAT_VERSION: Final[int]
#: Bytes of the trailing checksum field.
FORMAT_CHECKSUM_BYTES: Final[int]
#: Bytes a value adds to its payload beyond the texts of its header.
FORMAT_OVERHEAD: Final[int]

_Ids = npt.ArrayLike
_Usage = list[tuple[str, int, int, int, int]]

@final
class Core:
    """Block table, slot pools, prefix index, statistics and tier scheduler of one engine."""

    def __new__(
        cls,
        level_bytes: list[int],
        *,
        tiers: list[tuple[str, int | None]] = ...,
        block_size: int = 16,
        policy: str = "importance",
        enable_compression: bool = True,
        pressure_only: bool = False,
        compression_ratio: float = 0.5,
        drop_ratio: float = 0.0,
        recent_window: int = 128,
        sink_blocks: int = 1,
        keep_leaves: int = 2,
        ends_level: int | None = None,
        settle_cached: bool = False,
        weights: tuple[float, float, float] = ...,
        headroom: float = 0.1,
        hysteresis: float = 0.1,
        max_move_bytes: int | None = None,
        decay: float = 0.9,
        attention_ema: float = 0.5,
        scissorhands_window: int = 8,
        write_through: bool = False,
        evict_on_full: bool = True,
        namespace: str = "default",
        pool_slots: list[tuple[str, int, int]] = ...,
        pool_headroom: bool = False,
        prefix_aware: bool = True,
    ) -> Core: ...
    @property
    def block_size(self) -> int: ...
    @property
    def prefix_aware(self) -> bool:
        """Whether cached blocks form prefix trees and eviction takes leaves only."""
    @property
    def ends_level(self) -> int:
        """The level a cached chain's ends settle at (``settle_cached``): ``ends_level`` as given,
        or the deepest kept level whose blocks take at least a quarter of level 0's bytes."""
    @property
    def policy(self) -> str: ...
    @property
    def level_bytes(self) -> list[int]: ...
    @property
    def tiers(self) -> list[tuple[str, int | None]]: ...
    @property
    def step(self) -> int:
        """The scheduler's step clock (number of plans made)."""
    @property
    def evict_on_full(self) -> bool:
        """Whether an allocation that does not fit evicts cached blocks (lowest-ranked first)
        instead of failing."""
    @evict_on_full.setter
    def evict_on_full(self, on: bool) -> None: ...
    def add_sequence(self, salt: str | None = None) -> int:
        """A new sequence; with `salt`, its blocks are shared only with sequences of that salt."""
    def append_tokens(
        self, seq: int, tokens: _Ids
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.bool_]]:
        """Appends token ids; returns `(block_ids, shared)` for the blocks added."""
    def append_blocks(
        self, seq: int, hashes: _Ids
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.bool_]]:
        """Appends whole blocks by their chained hashes; returns `(block_ids, shared)`."""
    def extend(self, seq: int, n: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.bool_]]:
        """Appends `n` tokens without ids (their K/V only); the sequence stops being hashed.
        Returns `(block_ids, shared)` for the blocks added (none shared)."""
    def fork(self, seq: int) -> tuple[int, tuple[int, int] | None]:
        """Forks a sequence; returns `(child, copy)` where `copy` is `(src_block, dst_block)` of
        the partial block whose bytes the engine must copy, or `None`."""
    def release(self, seq: int) -> None:
        """Says that a live sequence's conversation has ended: the blocks it is the last to hold
        when freed are released, evicted before every block that is not (prefix-aware cores)."""
    def release_cached(self, hashes: _Ids) -> int:
        """Releases the blocks of the longest cached prefix of these chained hashes (a chain whose
        sequence is freed); returns how many blocks that is."""
    def release_cached_tokens(self, tokens: _Ids, salt: str | None = None) -> int:
        """:meth:`release_cached` of the longest cached prefix of these token ids (of sequences
        salted with `salt`, or of unsalted ones)."""
    def free_sequence(self, seq: int) -> None: ...
    def forget(self, blocks: _Ids) -> None:
        """Takes blocks out of the prefix index; each is freed once nothing references it."""
    def indexed_blocks(self) -> npt.NDArray[np.uint32]:
        """Every block in the prefix index, as uint32 ids."""
    def set_index_log(self, on: bool) -> None:
        """Starts (or stops, dropping what it holds) logging changes to the prefix index, for
        :meth:`take_index_log`."""
    def take_index_log(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int8]]:
        """The changes to the prefix index since the last call, oldest first, as `(hashes,
        tiers)`: each a block's prefix hash (uint64) and the tier it lies in now (int8, its
        index in `Plan.TIERS`), or -1 where it left the index. Empty while the log is off."""
    def sequence_blocks(self, seq: int) -> npt.NDArray[np.uint32]: ...
    def sequence_tokens(self, seq: int) -> int: ...
    def sequences(self) -> list[int]: ...
    def lookup(self, hashes: _Ids) -> npt.NDArray[np.uint32]:
        """Blocks of the longest cached prefix of these chained hashes."""
    def lookup_tokens(self, tokens: _Ids, salt: str | None = None) -> npt.NDArray[np.uint32]:
        """Blocks of the longest cached prefix of these token ids (of sequences salted with
        `salt`, or of unsalted ones)."""
    def record_reads(self, blocks: _Ids) -> None: ...
    def record_attention(self, blocks: _Ids, mass: npt.ArrayLike) -> None: ...
    def set_magnitude(self, blocks: _Ids, values: npt.ArrayLike) -> None: ...
    def set_learned(self, blocks: _Ids, values: npt.ArrayLike) -> None: ...
    def pin(self, blocks: _Ids) -> None: ...
    def unpin(self, blocks: _Ids) -> None: ...
    def evict_cached(self, n: int, protected: _Ids | None = None) -> npt.NDArray[np.uint64] | None:
        """Evicts `n` cached level-0 device blocks as making room does, none of `protected`;
        returns their hashes (uint64), or None, with nothing evicted, if fewer than `n` could go."""
    def place_saved(self, blocks: _Ids) -> npt.NDArray[np.uint8]:
        """Places new blocks of a save (pinned, unwritten, held by one sequence) where a cached
        block settles: with ``settle_cached``, the chain's ends (its sinks and its last
        ``keep_leaves`` blocks) at the ends' level (``ends_level``), any other at the bottom
        level, where that level has a free device slot, else the most precise level below 0
        with one; without, the chain's ends at level 0 and the others at the most precise level
        below 0 with a free slot. A block no slot is left for stays at level 0. Returns each
        one's level."""
    def plan(self, room_bytes: int = 0, *, keep: _Ids | None = None) -> Plan:
        """Plans moves and holds them pending until `commit(plan.id)` or `abort(plan.id)`.
        `room_bytes`: also free that much of the device budget for blocks about to be allocated
        (demoting and offloading before anything is evicted). `keep`: cached blocks the call
        the room is for will share (a prompt's cached prefix): moved if need be, never evicted."""
    def commit(self, plan_id: int) -> None: ...
    def abort(self, plan_id: int, *, copied: bool = False) -> None:
        """Drops the pending plan: every block stays where it was. ``copied``: some of its copies
        ran (the engine failed midway), so the blocks it evicted to move others into their
        slots are gone rather than given back."""
    def block_places(
        self, blocks: _Ids
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint32]]:
        """Where each of `blocks` is: `(tier, level, slot)` columns, [`Self::block_info`]'s first
        three alone, for the hot paths (a save's or a load's blocks, a layer at a time)."""
    def block_info(self, blocks: _Ids) -> dict[str, npt.NDArray[Any]]:
        """Columns describing blocks: tier, level, slot, refcount, pinned, position, hash (0 for
        a partial block), has_copy, score (the policy's primary ranking value), indexed (in the
        prefix index), parent (in the prefix tree; -1 for a root, an unindexed block or a
        plain core) and released (its conversation ended: evicted first)."""
    def usage(self) -> _Usage:
        """Occupancy per pool: `[(tier, level, used_slots, capacity_slots, bytes), ...]`."""
    def reclaimable(self) -> list[tuple[str, int, int, int]]:
        """What evicting could free now, per pool: `[(tier, level, blocks, bytes)]` of its cached
        blocks whose every indexed descendant is cached too (eviction takes leaves)."""
    def tier_bytes(self) -> list[tuple[str, int]]:
        """Bytes in use per configured tier."""
    def set_budget(self, tier: str, budget: int | None) -> None: ...
    def counters(self) -> dict[str, int]:
        """Event counters since creation."""

@final
class Plan:
    """The moves of one pending plan, as numpy columns."""

    KINDS: ClassVar[list[str]]
    TIERS: ClassVar[list[str]]
    NO_SLOT: Final[int]
    NO_TIER: Final[int]
    @property
    def id(self) -> int: ...
    @property
    def noop_promotions(self) -> int: ...
    @property
    def deferred(self) -> int: ...
    @property
    def unmet_bytes(self) -> int: ...
    @property
    def released_copies(self) -> int:
        """Write-through copies the plan gives up at commit, for room (their slots take blocks
        in the next plan)."""
    @property
    def block(self) -> npt.NDArray[np.uint32]: ...
    @property
    def kind(self) -> npt.NDArray[np.uint8]: ...
    @property
    def src_tier(self) -> npt.NDArray[np.uint8]: ...
    @property
    def src_level(self) -> npt.NDArray[np.uint8]: ...
    @property
    def src_slot(self) -> npt.NDArray[np.uint32]: ...
    @property
    def dst_tier(self) -> npt.NDArray[np.uint8]: ...
    @property
    def dst_level(self) -> npt.NDArray[np.uint8]: ...
    @property
    def dst_slot(self) -> npt.NDArray[np.uint32]: ...
    def summary(self) -> dict[str, int]:
        """Number of moves of each kind, by name."""
    def __len__(self) -> int: ...

@final
class Simulator:
    """Replays a trace through a fresh core configured like ``core``."""

    def __new__(
        cls,
        core: Core,
        offsets: _Ids,
        hashes: _Ids,
        input_tokens: _Ids,
        *,
        step_every: int = 1,
        timeline_every: int = 0,
        recompute_seconds: float | None = None,
        load_seconds: Sequence[float] | None = None,
    ) -> Simulator: ...
    def run(self, n: int) -> int: ...
    @property
    def done(self) -> int: ...
    @property
    def total(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def timeline(self) -> list[tuple[int, int, int, list[int]]]: ...
    def usage(self) -> _Usage: ...
    def counters(self) -> dict[str, int]: ...

@final
class StoreIndex:
    """Keys and sizes of a store's values within a byte budget, evicted by a core policy."""

    def __new__(cls, policy: str, budget: int, *, decay: float = 0.9) -> StoreIndex: ...
    @property
    def policy(self) -> str: ...
    @property
    def budget(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: str, /) -> bool: ...
    def admit(self, key: str, nbytes: int) -> list[str] | None: ...
    def remove(self, key: str) -> int | None: ...
    def touch(self, keys: list[str]) -> None: ...
    def set_scores(self, keys: list[str], scores: list[float]) -> None: ...
    def set_parents(self, keys: list[str], parents: list[str]) -> None: ...
    def eviction_order(self) -> list[str]: ...

@final
class StoreStats:
    """What a store did since it was opened (all namespaces of its backend together)."""

    def __new__(cls) -> StoreStats: ...
    @property
    def puts(self) -> int:
        """Values stored."""
    @property
    def put_bytes(self) -> int:
        """Payload bytes of the values stored."""
    @property
    def put_failures(self) -> int:
        """Puts refused or failed: over budget, disk full, server unreachable."""
    @property
    def hits(self) -> int: ...
    @property
    def hit_bytes(self) -> int:
        """Payload bytes of the values served."""
    @property
    def misses(self) -> int: ...
    @property
    def corrupt(self) -> int:
        """Values that failed a check (truncated, bit-flipped, foreign); each also counts as a miss."""
    @property
    def errors(self) -> int:
        """Backend errors (I/O, connection); gets that hit one also count as misses."""
    @property
    def evictions(self) -> int: ...
    @property
    def deletes(self) -> int: ...
    def count_puts(self, stored: int, payload_bytes: int, failed: int) -> None:
        """A batch of puts: `stored` values of `payload_bytes` in all, `failed` refused or failed."""
    def count_gets(self, hits: int, hit_bytes: int, misses: int, corrupt: int) -> None:
        """A batch of gets: `corrupt` of the `misses` failed a check."""
    def count_errors(self, n: int = 1) -> None: ...
    def count_evictions(self, n: int) -> None: ...
    def count_deletes(self, n: int) -> None: ...
    def as_dict(self) -> dict[str, int]:
        """The counters by name."""

@final
class HostValue:
    """A value a host store holds; its buffer is its payload, read-only."""

    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...

    def __len__(self) -> int: ...

@final
class HostValues:
    """One namespace's handle on the values of a host store, put and got in one call each."""

    def __new__(
        cls,
        index: StoreIndex,
        stats: StoreStats,
        namespace: Any,
        on_corrupt: Callable[[str, str], object],
        alloc: Callable[[int], Any] | None = None,
    ) -> HostValues: ...
    def view(self, namespace: Any, on_corrupt: Callable[[str, str], object]) -> HostValues: ...
    def put_many(self, keys: Sequence[Any], values: Sequence[Any]) -> list[bool]: ...
    def put(self, key: Any, value: Any) -> bool: ...
    def get_many(self, keys: Sequence[Any]) -> list[memoryview | None]: ...
    def get(self, key: Any) -> memoryview | None: ...
    def pop(self, key: Any) -> memoryview | None: ...
    def contains(self, key: Any) -> bool: ...
    def delete_many(self, keys: Sequence[Any]) -> list[bool]: ...
    def scan(self, prefix: str) -> list[str]: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...

def attend(
    q_ptr: int,
    q_dtype: int,
    out_ptr: int,
    mass: int | npt.NDArray[np.float32],
    seq_lens: npt.NDArray[np.int32],
    block_pool: npt.NDArray[np.int32],
    block_slot: npt.NDArray[np.int32],
    pools: npt.NDArray[np.int64],
    seqs: int,
    queries: int,
    q_heads: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    max_blocks: int,
    layer: int,
    scale: float,
    threads: int = 0,
    rotation: npt.NDArray[np.float32] | None = None,
) -> None:
    """The CPU attention kernel over pools given by address (kvtier.attend.attend_cpu wraps it):
    reads q and the pools, writes out and ``mass`` (an address, or a float32 numpy array of
    ``seqs * max_blocks`` values); the GIL is released meanwhile."""

def prefix_hashes(
    tokens: _Ids, block_size: int, namespace: str = "default", salt: str | None = None
) -> npt.NDArray[np.uint64]:
    """Chained 64-bit hashes of each full `block_size` block of `tokens` in a namespace — the
    same hashes `Core.append_tokens` indexes (for a sequence added with `salt`, give the same
    salt). Stable across processes and machines."""

def namespace_seed(namespace: str) -> int: ...
def kernel_sources() -> dict[str, str]:
    """The CUDA sources of kvtier's kernels (kernels/*.cu), by file name."""

def checksum(*parts: npt.ArrayLike) -> int:
    """CRC-64/NVME of ``parts`` joined: the checksum of stored values."""

def digest(*parts: npt.ArrayLike, seed: int = 0) -> int:
    """xxh3-64 of ``parts`` joined, with ``seed``: the digest that names things."""

@final
class StreamingChecksum:
    """The checksum of bytes given in pieces: the value ``checksum`` gives for them joined."""

    def __new__(cls) -> StreamingChecksum: ...
    def update(self, *parts: npt.ArrayLike) -> None: ...
    def digest(self) -> int: ...

def copy_checksum(out: npt.NDArray[np.uint8], *parts: npt.ArrayLike) -> int: ...
def read_sealed(
    paths: list[str], digest: int, texts: list[bytes], threads: int = 1
) -> list[memoryview | OSError | PayloadError]: ...
def read_stored(
    root: str,
    keys: list[str],
    digest: int,
    texts: bytes,
    index: StoreIndex,
    threads: int = 1,
) -> list[memoryview | OSError | PayloadError | None]: ...
def seal_header(digest: int, key: str, texts: bytes, length: int) -> bytes:
    """The header of a value of ``length`` payload bytes stored under ``key`` in the namespace
    ``digest`` whose packed texts after the key are ``texts``."""

def pack_texts(*texts: str) -> bytes:
    """``texts``, each as a header stores it (a u16 length, then UTF-8)."""

def read_key(value: bytes | bytearray | memoryview | npt.NDArray[np.uint8]) -> str | None:
    """The key a stored value says it was written under, or None when its header is unreadable."""

def store_path(root: str, key: str) -> str: ...
def unseal(
    value: bytes | bytearray | memoryview | npt.NDArray[np.uint8],
    digest: int,
    texts: bytes,
    *,
    verify: bool = True,
) -> memoryview:
    """The payload of a stored value as a read-only view, once every check passed."""

def write_checksummed(
    tmp_paths: list[str],
    paths: list[str],
    heads: list[bytes],
    payloads: Sequence[npt.ArrayLike],
    *,
    fsync: bool = False,
    threads: int = 1,
) -> list[OSError | None]: ...
def write_stored(
    root: str,
    keys: list[str],
    heads: list[bytes],
    payloads: Sequence[npt.ArrayLike],
    index: StoreIndex,
    tmp_tag: str,
    *,
    fsync: bool = False,
    threads: int = 1,
) -> tuple[list[bool], list[tuple[int, OSError]], int]: ...
def write_token(
    k_dst: int,
    v_dst: int,
    dst_head_stride: int,
    k_src: int,
    v_src: int,
    src_head_stride: int,
    heads: int,
    head_dim: int,
    dtype: int,
    limit: float = ...,
) -> tuple[float, int]: ...
def paged_copy(
    layout: str,
    to_cache: bool,
    cache: int,
    block_stride: int,
    strides: tuple[int, int],
    block_ids: npt.NDArray[np.int64],
    blocks: npt.NDArray[np.uint64],
    shape: tuple[int, int, int],
    elem: int,
) -> None: ...
def paged_scan(
    layout: str,
    cache: int,
    block_stride: int,
    strides: tuple[int, int],
    block_ids: npt.NDArray[np.int64],
    shape: tuple[int, int, int],
    dtype: int,
    copy_to: npt.NDArray[np.uint64] | None = None,
    limit: float = ...,
) -> tuple[npt.NDArray[np.float32], int]: ...
def block_key_norms(
    blocks: int, num_blocks: int, shape: tuple[int, int, int], dtype: int, limit: float = ...
) -> tuple[npt.NDArray[np.float32], int]: ...
def copy_rows(srcs: npt.NDArray[np.uint64], dsts: npt.NDArray[np.uint64], bytes: int) -> None: ...
def quantize_rows(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    layout: npt.ArrayLike,
    dims: tuple[int, int, int, int],
    dtype: int,
    threads: int = 0,
    rotation: npt.NDArray[np.float32] | None = None,
) -> None: ...
def dequantize_rows(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    layout: npt.ArrayLike,
    dims: tuple[int, int, int, int],
    dtype: int,
    layers: tuple[int, int],
    threads: int = 0,
    rotation: npt.NDArray[np.float32] | None = None,
) -> None: ...
def transcode_rows(
    src: npt.ArrayLike,
    src_layout: npt.ArrayLike,
    dst: npt.ArrayLike,
    dst_layout: npt.ArrayLike,
    dims: tuple[int, int, int, int],
    threads: int = 0,
    rotation: npt.NDArray[np.float32] | None = None,
) -> None: ...
