"""``KVTierConnector``: vLLM's KV kept in kvtier's compressed tiers behind vLLM's own pool.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_budget": "8GiB", "ladder": "bf16,int8,int4"}}'

vLLM's paged pool stays vLLM's. Each prompt block vLLM computes is saved, after the step that
completed it, into a :class:`~kvtier.BlockManager` that lives in host memory (its ``device``
tier is this connector's *host* tier), optionally backed by a disk directory and a Redis server.
There the Rust core ranks blocks and demotes cold ones down the ladder (bf16 → int8 → int4) and
out to disk, and promotes them back when they are hit. A later request whose prompt starts with
saved blocks loads them into the blocks vLLM allocated for it instead of recomputing them.

- **Keys** are prefix hashes of token ids in a namespace of model, dtype, layout, block size
  and parallel rank, so a change of any of them misses rather than loads foreign bytes. With
  ``remote_url`` the complete prompt blocks are also published to the server at level 0 under
  those keys (``share_prefixes``), where another engine of the same namespace, or this one after
  a restart, finds them; a prefill engine (``kv_producer``) hands its KV to a decode engine
  (``kv_consumer``) that way.
- **Loads** of blocks in host memory run within the step, a layer at a time beside the
  forward pass (each attention layer waits for its own: ``wait_for_layer_load``). A hit that
  reaches disk or the server loads in the worker's background while the request waits and
  the others run (vLLM's async load; ``"async_loads"``: ``auto``, ``always``, ``never``).
  A block the tiers cannot give back (a corrupt value, an evicted one, a server that went
  away) is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes it: a miss, never wrong K/V (the
  connector sets vLLM's ``kv_load_failure_policy`` to ``recompute`` unless
  ``kv_connector_extra_config`` says ``"load_failure_policy": "fail"``).
- **Importance**: key magnitude at save time, access frequency from hits and, with
  ``"scorer": "package.module:function"``, a learned score of each saved block's keys (see
  :func:`.config.import_scorer`); vLLM exposes no attention weights to connectors, so that
  signal's weight is renormalised away.

The tiers live with the worker; the scheduler asks them how much of a prompt they hold, directly
when both share a process, else over the worker's Unix socket (:mod:`.link`).

Supported: decoder-only models with full attention in one KV-cache group, tensor parallelism
(each rank keeps its own heads' shard in tiers of its own: a namespace and a disk directory per
rank; a prompt loads as far as every rank holds it). Refused with a clear error: hybrid and
sliding-window models, MLA, pipeline parallelism.
A request's ``cache_salt`` seeds its blocks' hashes: requests share stored blocks (here, on
disk, on the server) only with requests of the same salt.

The package, bottom up (imports point down only):

- :mod:`.config`: ``kv_connector_extra_config`` → :class:`~kvtier.KvtierConfig`, the staging
  shares, and the settings both sides read from vLLM;
- :mod:`.paged`: where K and V sit in an attention backend's paged cache;
- :mod:`.link`: what the scheduler asks the worker's tiers, and how (in process or a socket);
- :mod:`.tiers`: the worker's tiers and caches, saving and loading whole blocks;
- :mod:`.metadata`: the loads and saves the scheduler hands the workers each step;
- :mod:`.events`: vLLM's KV events (``BlockStored``/``BlockRemoved``) for what the tiers store
  and drop;
- :mod:`.metrics`: the counters, and their way to vLLM's logs and Prometheus;
- :mod:`.scheduler` and :mod:`.worker`: the two sides;
- :mod:`.connector`: the class vLLM loads, a facade over the side of its role.

Beside the connector, two plug-ins for vLLM's own offloading (``OffloadingConnector``, whose CUDA
path moves the bytes): :mod:`.cache_policy`'s ``KvtierCachePolicy`` decides what its CPU tier
evicts, and :mod:`.tier`'s ``KvtierTier`` keeps what that tier stores in kvtier's ladder behind
it (:mod:`.offload`: vLLM's chunk keys, and where K and V sit in its CPU tier).

The first four need no vLLM (the data path is tested and benchmarked without it); the names of
the others are imported, with vLLM, when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import (
    ASYNC_LOADS,
    CONNECTOR_KEYS,
    DEFAULT_HOST_BUDGET,
    LEAF_SHARE,
    MAX_STAGING_SHARE,
    SINK_SHARE,
    VLLM_OWNED,
    connector_config,
    ends_level_of,
    staging_shares,
)

if TYPE_CHECKING:
    from .cache_policy import KvtierCachePolicy
    from .connector import KVTierConnector
    from .metadata import KVTierMetadata, LoadSpec, SaveSpec
    from .metrics import HIT_SOURCES, KVTierPromMetrics, KVTierStats, hit_sources
    from .scheduler import KVTierScheduler
    from .tier import KvtierTier
    from .worker import KVTierWorker

__all__ = [
    "ASYNC_LOADS",
    "CONNECTOR_KEYS",
    "DEFAULT_HOST_BUDGET",
    "HIT_SOURCES",
    "LEAF_SHARE",
    "MAX_STAGING_SHARE",
    "SINK_SHARE",
    "VLLM_OWNED",
    "KVTierConnector",
    "KVTierMetadata",
    "KVTierPromMetrics",
    "KVTierScheduler",
    "KVTierStats",
    "KVTierWorker",
    "KvtierCachePolicy",
    "KvtierTier",
    "LoadSpec",
    "SaveSpec",
    "connector_config",
    "ends_level_of",
    "hit_sources",
    "staging_shares",
]

#: The names that need vLLM, by the module that defines them.
_NEEDS_VLLM = {
    "KVTierConnector": "connector",
    "KvtierCachePolicy": "cache_policy",
    "KvtierTier": "tier",
    "KVTierMetadata": "metadata",
    "LoadSpec": "metadata",
    "SaveSpec": "metadata",
    "HIT_SOURCES": "metrics",
    "KVTierPromMetrics": "metrics",
    "KVTierStats": "metrics",
    "hit_sources": "metrics",
    "KVTierScheduler": "scheduler",
    "KVTierWorker": "worker",
}


def __getattr__(name: str) -> Any:
    # vLLM imports this package and asks it for KVTierConnector: vLLM is there by then.
    module = _NEEDS_VLLM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from ...errors import require

    require("vllm", "vllm", purpose="kvtier.integrations.vllm plugs into vLLM")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
