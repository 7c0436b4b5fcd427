"""``BlockManager``: the tiered, mixed-precision KV store a custom engine calls.

The Rust core decides (which block lives where, at which level); this class owns the tensors and
moves the bytes. Per (tier, level) there is one pool, allocated once at construction:

- level 0 is a float pool ``[slots, layers, 2, kv_heads, block_size, head_dim]`` in the model
  dtype, where new K/V is written;
- every other level is a packed pool ``uint8 [slots, bytes_per_block]`` of its codec.

Each tier's budget is split between its levels by ``pool_shares`` (a fixed partition of memory:
the core keeps ``headroom`` free in each pool, demoting or offloading out of a full one).

Lifecycle of a block as the manager sees it: allocated at level 0 on the device when a sequence
grows, *pinned* (never moved) until every layer has written all its tokens, then free to be
demoted, offloaded, promoted by :meth:`BlockManager.step`. A block is shared between sequences by
prefix hash only once complete; a sequence that reuses a cached prefix skips writing it. Blocks
saved into a prefix cache may skip level 0: :meth:`BlockManager.append_blocks` with ``encode``
has the core place them, before anything is written, where a cached block settles (the most
precise level below 0 with a free slot; the sinks stay at level 0), and encodes each layer where
the K/V lies (a vLLM worker's saves on a GPU: only encoded bytes cross to host memory).

Tiers: ``device`` and ``host`` pools are tensors; ``disk`` and ``remote`` are
:mod:`kvtier.stores` (a directory, a Redis server), whose values are keyed by this manager's
instance id, level and slot, so the core addresses them exactly like a pool: as in a pool, a
slot a block leaves keeps its bytes until a block reuses it (no delete per move; the values stay
within the tier's budget, :meth:`BlockManager.close` deletes them all, and ``remote_ttl`` lets a
crashed engine's remote values expire). Moves to and from a store go in one batch per pool pair
and carry each level's packed bytes (an INT4 block moves a quarter of an fp16 one). A block a
store cannot give back (corrupt, evicted, server gone) is *lost*: never shared again, and
:class:`BlockLostError` for its sequence, never wrong K/V. A store that refuses a write (full,
server gone) is left out of plans for ``STORE_RETRY_S``.

Prefix sharing between engines (``share_prefixes``): each step first publishes the prompt blocks
completed since the last one to the remote server, at level 0 and keyed by their prefix hash in
the tier's level-0 namespace (so only engines of the same model, dtype, shape and namespace ever
read them); :meth:`BlockManager.add_sequence` takes the blocks of a prompt that this manager
lacks from there, up to the first miss. The server's ``maxmemory`` policy (or ``remote_ttl``)
bounds what is published; ``close()`` leaves it for the other engines. As for the local prefix
cache, a block's K/V must follow from its token ids alone within a namespace: add a request whose
K/V also depends on something else (an adapter, an image behind placeholder ids) without token ids,
so that its blocks are never shared, or give it a manager of its own namespace. Requests that may
share only among themselves (a tenant's, vLLM's ``cache_salt``) are added with a ``salt``: their
blocks' hashes, so their cache entries and remote keys, are chained from it, and a request with
another salt or none never finds them.

Thread safety: one lock guards the core and the pools' bookkeeping; :meth:`step` copies bytes
outside it (a plan's sources stay valid and its destinations reserved until commit, and appends
only write pinned blocks, which plans never move), so appends and gathers proceed meanwhile.

Layout: :class:`BlockManager` (``block_manager``) is a facade that owns the sequences and the
locks and composes parts that own their state and never import it: ``tiers`` (tensor pools,
disk/remote stores, executing a plan's moves), ``ledger`` (per block: tokens written, pins,
key-norm sums, lost blocks), ``attention`` (the tables the attention kernels read), ``sharing``
(prefix publishing and fetching), and the stateless ``sizing`` (budgets to pools), ``room``
(what a plan frees, why the device is full), ``stats`` (:class:`ManagerStats`, Prometheus text)
``checks`` (argument checks) and ``external`` (:class:`ExternalBlocks`: blocks of an engine's
own paged cache, appended and loaded where they lie).
"""

from .attention import AttentionBatch, AttentionTables
from .block_manager import BlockManager
from .external import ExternalBlocks
from .ledger import BlockLedger
from .sizing import DEFAULT_CPU_BYTES as DEFAULT_CPU_BYTES
from .sizing import DEFAULT_CUDA_SHARE as DEFAULT_CUDA_SHARE
from .sizing import MAX_POOL_SLOTS as MAX_POOL_SLOTS
from .sizing import STORE_TIERS as STORE_TIERS
from .sizing import TIERS as TIERS
from .sizing import default_shares as default_shares
from .stats import ManagerStats, PoolStats
from .tiers import STORE_RETRY_S as STORE_RETRY_S

__all__ = [
    "AttentionBatch",
    "AttentionTables",
    "BlockLedger",
    "BlockManager",
    "ExternalBlocks",
    "ManagerStats",
    "PoolStats",
]
