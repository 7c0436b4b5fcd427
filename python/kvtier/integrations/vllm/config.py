"""The connector's settings, read once from vLLM's configuration for either role.

:func:`connector_config` turns ``kv_connector_extra_config`` into the :class:`~kvtier.KvtierConfig`
of the worker's tiers; :func:`staging_shares` sizes their levels once a block's bytes are known;
:class:`ConnectorSettings` holds what both roles read from vLLM (block size, roles, tensor
parallelism, the attention spec, the connector's own keys), checked here so that a bad setting
fails the same way in the scheduler and in the workers. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ...codecs import get_codec
from ...codecs.base import BlockShape
from ...config import ENV_VARS, KvtierConfig, parse_bytes
from ...errors import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "ASYNC_LOADS",
    "CONNECTOR_KEYS",
    "DEFAULT_HOST_BUDGET",
    "KV_CACHE_DTYPES",
    "LEAF_SHARE",
    "MAX_STAGING_SHARE",
    "SINK_SHARE",
    "VLLM_OWNED",
    "ConnectorSettings",
    "attention_spec",
    "backend_name",
    "connector_config",
    "ends_level_of",
    "ends_room_share",
    "engine_namespace",
    "import_scorer",
    "staging_shares",
    "tiers_config",
    "tp_rank",
]

#: Of the host budget, at most this fraction stages saves at the levels above the bottom.
MAX_STAGING_SHARE = 0.25
#: Of the host budget, what the level where cached prefixes' ends settle (``ends_level``,
#: with ``settle_cached``) keeps for their sinks (``sink_blocks``) and for each of their last
#: blocks (``keep_leaves``), beside the staging, while the rest goes to the bottom level.
SINK_SHARE = 0.02
LEAF_SHARE = 0.05
#: The host tier's budget when the extra config names none.
DEFAULT_HOST_BUDGET = "2GiB"
#: Keys of ``kv_connector_extra_config`` that are the connector's own, not KvtierConfig fields.
CONNECTOR_KEYS = frozenset({"load_failure_policy", "async_loads", "scorer", "shed_saves"})
#: ``async_loads``: when a hit loads in the worker's background while the request waits.
ASYNC_LOADS = ("auto", "always", "never")
_VARS = {var.field: var for var in ENV_VARS}
#: vLLM's ``kv_cache_dtype`` values whose caches the connector reads: K/V as the model computed
#: them, in a float dtype its codecs take. A quantized cache (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``,
#: the per-token-head and nvfp4 kinds) holds bytes with scales beside them that it does not.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
#: KvtierConfig fields vLLM decides, not the user.
VLLM_OWNED = {
    "block_size": "vLLM's block size (--block-size)",
    "device_budget": "vLLM's own KV pool (--gpu-memory-utilization); use host_budget",
    "device_blocks": "vLLM's own KV pool (--num-gpu-blocks-override); use host_blocks",
}


def connector_config(
    extra: Mapping[str, Any], *, block_size: int, environ: Mapping[str, str] | None = None
) -> KvtierConfig:
    """The :class:`KvtierConfig` of the connector's tiers from ``kv_connector_extra_config``
    (KvtierConfig field names; sizes as ``"64GiB"``; lists as ``"bf16,int8,int4"`` or JSON
    lists) over ``KVTIER_*`` and the original ``VLLM_*`` variables. ``host_budget`` (default
    2 GiB) becomes the manager's device budget: the manager lives in host memory.

    ``pool_shares``, when neither the extra config nor ``KVTIER_POOL_SHARES`` gives it and the
    ladder has several levels, stays unset here: the worker sizes it once it knows the bytes of
    a block (:func:`staging_shares`). ``settle_cached`` is on unless the extra config or
    ``KVTIER_SETTLE_CACHED`` says otherwise: the levels above the bottom stage saves and keep
    the chains' ends, and a saved block goes where a full host keeps it."""
    extra = {k: v for k, v in extra.items() if k not in CONNECTOR_KEYS}
    for name, owner in VLLM_OWNED.items():
        if extra.get(name) is not None:
            raise ConfigError(f"kv_connector_extra_config: {name} is set by {owner}")
    # A string value reads as its KVTIER_* variable would ("64GiB", "bf16,int8,int4",
    # "0.5,0.2,0.3", "true"); JSON numbers, lists and booleans pass as they are.
    overrides: dict[str, Any] = {}
    for name, value in extra.items():
        var = _VARS.get(name)
        if isinstance(value, str) and var is not None:
            try:
                value = var.parse(value)
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"kv_connector_extra_config: {name}: {exc}") from None
        elif isinstance(value, list):
            value = tuple(value)
        overrides[name] = value
    if "settle_cached" not in overrides and "KVTIER_SETTLE_CACHED" not in (
        os.environ if environ is None else environ
    ):
        overrides["settle_cached"] = True
    env = KvtierConfig.from_env(environ=environ, **overrides)
    host = env.host_budget
    if host is None and env.host_blocks is None:
        host = parse_bytes(DEFAULT_HOST_BUDGET)
    remote = env.remote_budget
    if env.remote_url is not None and remote is None:
        remote = 4 * (host or 0) or parse_bytes(DEFAULT_HOST_BUDGET)
    if env.ladder is not None and env.ladder[-1] == "drop":
        raise ConfigError(
            "ladder: the connector's tiers are a prefix cache behind vLLM's own pool, whose "
            "attention kvtier does not run: a block leaves it by eviction, so a 'drop' level "
            f"has no meaning there; remove it from {','.join(env.ladder)}"
        )
    for name in env.ladder or ():
        try:
            get_codec(name)
        except ConfigError as exc:  # its message names the codec, not the setting
            where = "kv_connector_extra_config: ladder" if "ladder" in extra else "ladder"
            raise ConfigError(
                f"{where}: {exc} (one codec a level, from the KV cache's dtype down, e.g. "
                "bf16,int8,int4)"
            ) from None
    return env.replace(
        block_size=block_size,
        device_budget=host,
        device_blocks=env.host_blocks,
        host_budget=None,
        host_blocks=None,
        remote_budget=remote,
        share_prefixes=env.remote_url is not None,
    )


def staging_shares(config: KvtierConfig, shape: BlockShape, stage_blocks: int) -> tuple[float, ...]:
    """The connector's own ``pool_shares`` for blocks of ``shape``: ``stage_blocks`` slots (the
    blocks one step of vLLM may complete: ``max_num_batched_tokens`` over the block size) at
    each middle level and twice as many at level 0 (once where a stage of that takes more than
    an eighth of the budget), at most a quarter of the budget and at least one stage; beside
    them, at the level where the chains' ends settle where that is not the bottom, the ends'
    room (:func:`ends_room_share`); and the rest of the budget at the bottom level.

    vLLM's own pool holds the hot blocks at full precision; behind it the connector is
    capacity. A save lands at level 0 (pinned there until its last layer is written), and the
    tiers' step after vLLM's, on a thread of its own, moves it down (the bottom level making
    room by evicting its lowest-ranked leaf): with ``settle_cached``, to where a full host
    keeps it, the chains' ends (their sinks, and their last blocks: where the next turn
    continues) at the ends' level (``ends_level``: by default the deepest of at least 4 bits a
    value, as int4 holds the ends about as well as full precision and int2 does not) and the
    rest at the bottom. So the levels above the bottom stage what a step passes on, level 0
    twice over (one step's saves land in one half while the step before's move down from the
    other), and keep the chains' ends; sized so, they leave the rest of the bytes to the
    bottom level. A save larger than level 0 has free goes in pieces after the forward pass,
    each making room for the next, so a long prefill chunk still fits."""
    ladder = config.resolved_ladder(shape.dtype)
    level_bytes = [get_codec(name).bytes_per_block(shape) for name in ladder]
    budget = _host_budget(config, level_bytes[0])
    # One stage's bytes at each level, level 0 twice over where that takes at most half the
    # staging share (else a small budget would lose bottom-level blocks to it).
    staged = [2 * level_bytes[0], *level_bytes[1:-1]]
    if sum(staged) > MAX_STAGING_SHARE / 2 * budget:
        staged[0] = level_bytes[0]
    affordable = int(MAX_STAGING_SHARE * budget) // sum(staged)
    stage = max(1, min(stage_blocks, affordable))
    # Half a byte more than the slots take: the manager's floor of share * budget / bytes
    # must not lose one to rounding.
    above = [(stage * b + 0.5) / budget for b in staged]
    ends = ends_level_of(config, level_bytes)
    if ends < len(above):
        above[ends] += ends_room_share(config)
    if sum(above) >= 1.0:
        raise ConfigError(
            f"host budget {budget} B holds no level-0 block with room below it: one block "
            f"takes {' + '.join(map(str, staged))} B at the levels above the bottom "
            f"({', '.join(ladder[:-1])}) and the bottom level ({ladder[-1]}) needs room too: "
            "raise host_budget or host_blocks"
        )
    return (*above, 1.0 - sum(above))


def ends_room_share(config: KvtierConfig) -> float:
    """The share of the budget :func:`staging_shares` gives the level where the chains' ends
    settle: :data:`SINK_SHARE` with ``sink_blocks``, and :data:`LEAF_SHARE` for each of the
    ``keep_leaves`` last blocks."""
    return SINK_SHARE * (config.sink_blocks > 0) + LEAF_SHARE * config.keep_leaves


def ends_level_of(config: KvtierConfig, level_bytes: Sequence[int]) -> int:
    """The level the chains' ends settle at under a ladder of ``level_bytes``, as the core
    resolves it (:attr:`kvtier._core.Core.ends_level`): ``ends_level`` (at most the last kept
    level), or the deepest kept level whose blocks take at least a quarter of level 0's."""
    last = sum(1 for b in level_bytes if b > 0) - 1
    if config.ends_level is not None:
        return min(config.ends_level, last)
    return max(level for level in range(last + 1) if 4 * level_bytes[level] >= level_bytes[0])


def ends_room_slots(config: KvtierConfig, block_bytes: int) -> int:
    """The slots of the ends' room in a host tier of ``config`` at a level whose blocks take
    ``block_bytes``: at level 0, what the saves' staging must leave alone."""
    return int(ends_room_share(config) * _host_budget(config, block_bytes)) // block_bytes


def _host_budget(config: KvtierConfig, block_bytes: int) -> int:
    if config.device_budget is not None:
        return config.device_budget
    assert config.device_blocks is not None, "connector_config sets one of the two"
    return config.device_blocks * block_bytes


@dataclass(frozen=True)
class ConnectorSettings:
    """What both roles of the connector read from vLLM's configuration, checked."""

    engine_id: str
    #: vLLM's block size (tokens)
    block_size: int
    #: blocks one step may complete (``max_num_batched_tokens`` over the block size): what the
    #: connector's staging levels hold
    stage_blocks: int
    #: the worker's tiers, before the worker adds what it learns from the caches
    config: KvtierConfig
    saves_kv: bool
    loads_kv: bool
    tp_size: int
    #: the one full-attention spec of the model's KV cache (:func:`attention_spec`)
    spec: Any
    #: the attention layers, in the order of the tiers' layers
    layer_names: tuple[str, ...]
    #: one of :data:`ASYNC_LOADS`
    async_loads: str
    #: ``"package.module:function"``, imported (:func:`import_scorer`)
    scorer: Callable[[int, torch.Tensor], Any] | None
    #: ``load_failure_policy`` as given (the scheduler checks it and sets vLLM's)
    load_failure_policy: object
    #: a save that finds the tiers' level 0 full while their step makes room is cut to what
    #: fits, the rest skipped (True, the default: vLLM's step never waits for kvtier's), or
    #: waits for that step (False: every block saved, the forward pass held up meanwhile)
    shed_saves: bool = True

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> ConnectorSettings:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "vLLM makes a connector only with a kv_transfer_config"
        extra = dict(transfer.kv_connector_extra_config or {})
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)} (K/V as the model "
                f"computed them, which KVTierConnector reads), got {cache_dtype!r}: a quantized "
                "cache, whose bytes and scales its codecs do not read; leave --kv-cache-dtype "
                "(LLM(kv_cache_dtype=...)) at auto"
            )
        block_size = int(vllm_config.cache_config.block_size)
        step_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        config = connector_config(extra, block_size=block_size)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "KVTierConnector supports tensor parallelism, not pipeline parallelism "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size}) yet"
            )
        spec = attention_spec(kv_cache_config)
        async_loads = extra.get("async_loads", "auto")
        if isinstance(async_loads, bool):  # JSON true/false
            async_loads = "always" if async_loads else "never"
        async_loads = str(async_loads).lower()
        if async_loads not in ASYNC_LOADS:
            raise ConfigError(
                f"async_loads: expected one of {', '.join(ASYNC_LOADS)}, "
                f"got {extra['async_loads']!r}"
            )
        return cls(
            engine_id=str(transfer.engine_id),
            block_size=block_size,
            stage_blocks=-(-step_tokens // block_size),
            config=config,
            saves_kv=transfer.kv_role in ("kv_producer", "kv_both"),
            loads_kv=transfer.kv_role in ("kv_consumer", "kv_both"),
            tp_size=int(parallel.tensor_parallel_size),
            spec=spec,
            layer_names=tuple(kv_cache_config.kv_cache_groups[0].layer_names),
            async_loads=async_loads,
            scorer=import_scorer(extra.get("scorer")),
            load_failure_policy=extra.get("load_failure_policy", "recompute"),
            shed_saves=_flag(extra, "shed_saves", default=True),
        )


def _flag(extra: Mapping[str, Any], name: str, *, default: bool) -> bool:
    """A boolean of the extra config: JSON true/false, or "true"/"false" as a string."""
    value = extra.get(name, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def tiers_config(settings: ConnectorSettings) -> KvtierConfig:
    """The worker's tiers' config, less the namespace (which needs the cache layout): the
    staging shares of :func:`staging_shares` for a block of the model's KV where none are
    given, and every check of the manager's pools made on it now, with nothing allocated, so
    that the connector's constructor refuses what its tiers could not hold (in the connector's
    words: ``host_budget``, not the manager's ``device_budget``)."""
    import torch

    from ..._torch import dtype_name
    from ...manager.sizing import size_pools

    config, spec = settings.config, settings.spec
    shape = BlockShape(
        len(settings.layer_names),
        spec.num_kv_heads,
        settings.block_size,
        spec.head_size,
        dtype_name(spec.dtype),
    )
    ladder = config.resolved_ladder(shape.dtype)
    if ladder[0] != shape.dtype:
        raise ConfigError(
            f"ladder: level 0 is {ladder[0]!r} but vLLM's KV cache is {shape.dtype!r}: level 0 "
            "holds K/V exactly as vLLM wrote it"
        )
    if config.pool_shares is None and config.enable_compression and config.levels > 1:
        config = config.replace(pool_shares=staging_shares(config, shape, settings.stage_blocks))
    level_bytes = [get_codec(name).bytes_per_block(shape) for name in ladder]
    # The worker names the namespace after the engine when it registers the caches; any name
    # but the default's stands for it here (sharing prefixes needs one).
    named = config.replace(namespace=f"{config.namespace}/vllm")
    size_pools(
        named, torch.device("cpu"), level_bytes, len(level_bytes), tier_names={"device": "host"}
    )
    return config


def attention_spec(kv_cache_config: KVCacheConfig) -> Any:
    """The one full-attention spec the connector supports, or a clear refusal."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1:
        raise ConfigError(
            f"KVTierConnector supports models with one KV-cache group (full attention in every "
            f"layer); this model has {len(groups)}: {kinds} (hybrid or sliding-window models "
            "are not supported yet)"
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec) or type(spec) is not FullAttentionSpec:
        raise ConfigError(
            f"KVTierConnector supports full attention (FullAttentionSpec); this model's KV cache "
            f"is {kinds[0]} (MLA, sliding-window and state-space caches are not supported yet)"
        )
    if getattr(spec, "sliding_window", None):
        raise ConfigError("KVTierConnector does not support sliding-window attention yet")
    return spec


def import_scorer(path: object) -> Callable[[int, torch.Tensor], Any] | None:
    """``"package.module:function"``: the learned importance of the blocks saved,
    ``function(layer, keys)`` with ``keys`` ``[blocks, block_size, kv_heads, head_dim]`` →
    one finite, non-negative score per block (higher: kept at higher precision); averaged over
    layers."""
    if path is None:
        return None
    module, _, name = str(path).partition(":")
    try:
        scorer = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"scorer: expected 'package.module:function' naming an importable function, got "
            f"{path!r} ({exc})"
        ) from None
    if not callable(scorer):
        raise ConfigError(f"scorer: {path!r} is not callable")
    return cast("Callable[[int, torch.Tensor], Any]", scorer)


def backend_name(vllm_config: VllmConfig, layer_name: str) -> str:
    """The name of the attention backend of layer ``layer_name`` (it decides the layout),
    prefixed ``ROCM:`` on ROCm, whose backends reuse CUDA's names for other layouts; for
    CPU_ATTN followed by ``:`` and the instruction set its kernels were chosen for (the layer's
    ``isa``, set before the caches are registered), whose cache layout differs by it."""
    from vllm.platforms import current_platform

    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        raise ConfigError(f"KVTierConnector: layer {layer_name} has no attention backend")
    name = str(backend.get_name())
    if name == "CPU_ATTN":
        name = f"{name}:{getattr(layer, 'isa', None)}"
    return f"ROCM:{name}" if current_platform.is_rocm() else name


def tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return 0
    from vllm.distributed import parallel_state

    try:
        return int(parallel_state.get_tensor_model_parallel_rank())
    except AssertionError:  # no tensor-parallel group: a worker driven by hand
        return int(vllm_config.parallel_config.rank) % size


def engine_namespace(vllm_config: VllmConfig, spec: Any, user: str, rank: int) -> str:
    """What stored blocks depend on besides their tokens: the model and its revision, the KV
    dtype, the block size and parallel rank (the layout is added when the worker knows it),
    and the user's namespace (a tenant, a weights version)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = str(spec.dtype).removeprefix("torch.")
    parts = [
        "vllm",
        str(model.model),
        str(model.revision or "main"),
        dtype,
        f"bs{spec.block_size}",
        f"tp{rank}of{parallel.tensor_parallel_size}",
        user,
    ]
    return "|".join(parts)
