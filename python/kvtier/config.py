"""kvtier's configuration: one dataclass, filled from arguments, then ``KVTIER_*`` variables.

:class:`KvtierConfig` holds every knob of the scheduler, the scorer and the tiers. Build it directly
(environment ignored) or with :meth:`KvtierConfig.from_env`, where the precedence is

    explicit argument  >  KVTIER_<NAME>  >  the original design's VLLM_* alias  >  default

Every value is checked in ``__post_init__``; a bad one raises :class:`kvtier.errors.ConfigError`
naming the field (and the variable it came from) and what was expected. :data:`ENV_VARS` lists the
variables; the configuration page, ``docs/configuration.md``, is generated from it
(:func:`configuration_page`, whose table is :func:`env_table_markdown`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral, Real
from typing import Any

from .errors import ConfigError

__all__ = [
    "CONFIGURATION_PAGE_COMMAND",
    "ENV_VARS",
    "MAX_SIZE",
    "MAX_U32",
    "POLICIES",
    "EnvVar",
    "KvtierConfig",
    "configuration_page",
    "env_table_markdown",
    "normalize_dtype",
    "parse_bytes",
]

#: Scheduling policies the core knows by name.
POLICIES: tuple[str, ...] = ("importance", "lru", "lfu", "h2o", "scissorhands")
#: ``kvtier simulate``'s prefix of a policy on a plain core (``plain-lru``): eviction ranks every
#: cached block, not the leaves of the prefix trees (``prefix_aware`` off).
PLAIN = "plain-"

#: Most levels a ladder may have.
MAX_LEVELS = 8

_DTYPE_ALIASES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}

_LEVEL_NAME = re.compile(r"^[a-z0-9][a-z0-9_.:+-]*$")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

#: Largest byte count (or block count) kvtier takes: the core counts in unsigned 64-bit integers.
MAX_SIZE = 2**64 - 1
#: Largest count the core keeps in 32 bits (tokens per block, windows, slots).
MAX_U32 = 2**32 - 1
_MAX_SIZE_TEXT = f"at most {MAX_SIZE:,} (2**64 - 1, 16 EiB)"


def parse_bytes(text: str) -> int:
    """Parse a size such as ``8GiB``, ``512MB``, ``1.5 KiB``, ``1e9`` or ``4096`` into bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000; units are case-insensitive; a bare number is bytes, exactly (a fraction of a byte is
    rounded to the nearest). At most :data:`MAX_SIZE` (2**64 - 1). Raises :class:`ConfigError`.
    """
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"invalid size {text!r}: expected a non-negative number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '8GiB', '512MB', '1e9'"
        )
    # The float only bounds the magnitude (so '1e999999999' is never computed exactly); the
    # value itself is exact, so that '18446744073709551615' is that many bytes.
    if not float(m.group(1)) * _UNITS[unit] <= 2.0**65:
        raise ConfigError(f"invalid size {text!r}: expected {_MAX_SIZE_TEXT} bytes")
    value = round(Fraction(m.group(1)) * _UNITS[unit])
    if value > MAX_SIZE:
        raise ConfigError(f"invalid size {text!r}: expected {_MAX_SIZE_TEXT} bytes")
    return value


def normalize_dtype(name: str) -> str:
    """Map a dtype name (``float16``, ``torch.bfloat16``, ``fp32`` ...) to ``fp16``/``bf16``/``fp32``."""
    key = str(name).strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ConfigError(
            f"unknown model dtype {name!r}: expected one of fp16, bf16, fp32 "
            "(or float16, bfloat16, float32)"
        ) from None


def _default_ladder(dtype: str, levels: int) -> tuple[str, ...]:
    return (normalize_dtype(dtype), "int8", "int4")[:levels]


# ---------------------------------------------------------------------------------------------
# Environment variables


def _parse_bool(text: str) -> bool:
    key = text.strip().lower()
    if key in ("1", "true", "yes", "on"):
        return True
    if key in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(","))


def _float_list(expected: str) -> Callable[[str], tuple[float, ...]]:
    def parse(text: str) -> tuple[float, ...]:
        try:
            return tuple(float(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"expected {expected}, got {text!r}") from None

    return parse


_parse_weights = _float_list("three comma-separated numbers (magnitude,learned,attention)")
_parse_shares = _float_list("comma-separated fractions, one per level")


def _parse_size(text: str) -> int:
    return parse_bytes(text)


@dataclass(frozen=True)
class EnvVar:
    """One environment variable that :meth:`KvtierConfig.from_env` reads."""

    name: str
    field: str
    alias: str | None
    kind: str
    #: what the value counts or is, with its range: ``bytes``, ``blocks``, ``seconds, > 0``,
    #: ``fraction in [0, 1]`` ...
    unit: str
    help: str
    parse: Callable[[str], Any] = dataclasses.field(repr=False, compare=False)


def _var(field_name: str, kind: str, unit: str, help: str, alias: str | None = None) -> EnvVar:
    parsers: dict[str, Callable[[str], Any]] = {
        "bool": _parse_bool,
        "int": _parse_int,
        "float": _parse_float,
        "size": _parse_size,
        "list": _parse_list,
        "weights": _parse_weights,
        "shares": _parse_shares,
        "str": str.strip,
    }
    return EnvVar(
        f"KVTIER_{field_name.upper()}", field_name, alias, kind, unit, help, parsers[kind]
    )


#: The variables :meth:`KvtierConfig.from_env` reads, in the order of the configuration table.
ENV_VARS: tuple[EnvVar, ...] = (
    _var(
        "enable_compression",
        "bool",
        "boolean",
        "store blocks below level 0 at all (off: every block stays at the model dtype)",
        "VLLM_ENABLE_KV_COMPRESSION",
    ),
    _var(
        "compression_ratio",
        "float",
        "fraction in [0, 1]",
        "fraction of the compressible blocks, by importance, kept at level 1 (the rest go lower)",
        "VLLM_KV_COMPRESSION_RATIO",
    ),
    _var(
        "drop_ratio",
        "float",
        "fraction in [0, 1]",
        "with a `drop` level at the end of the ladder: fraction of the compressible blocks, "
        "lowest ranked first, that leave attention for good (never sent back: a drop is not "
        "recoverable)",
    ),
    _var(
        "levels",
        "int",
        "levels, 1 to 3",
        "number of precision levels when no ladder is given: 1 = dtype, 2 = +int8, 3 = +int4",
        "VLLM_KV_COMPRESSION_LEVELS",
    ),
    _var(
        "ladder",
        "list",
        "codec names",
        "codec of each level, comma-separated, e.g. `fp16,int8,int4`; sets levels",
    ),
    _var("policy", "str", "name", "scheduling policy: " + ", ".join(POLICIES)),
    _var("block_size", "int", "tokens, >= 1", "tokens per block"),
    _var("recent_window", "int", "tokens", "most recent tokens of each sequence kept at level 0"),
    _var(
        "sink_blocks",
        "int",
        "blocks",
        "first blocks of each sequence (attention sink) kept at level 0; in a cached prefix, "
        "demoted last",
    ),
    _var(
        "keep_leaves",
        "int",
        "blocks",
        "a cached prefix's last blocks (where the next turn continues: its recent window) are "
        "demoted after every other cached block but the sinks; 0: off",
    ),
    _var(
        "ends_level",
        "int",
        "level",
        "where a cached prefix's ends (its sinks and last `keep_leaves` blocks) settle with "
        "`settle_cached`; unset: the deepest level of at least a quarter of level 0's bytes "
        "(4 bits a value under 16-bit blocks)",
    ),
    _var(
        "settle_cached",
        "bool",
        "boolean",
        "cached blocks settle where a full cache keeps them as soon as that level has room "
        "(a prefix's ends at `ends_level`, the rest at the bottom), not only under pressure; "
        "pools sized by `pool_shares` only (the vLLM connector's default)",
    ),
    _var(
        "weights", "weights", "3 numbers >= 0", "importance weights `magnitude,learned,attention`"
    ),
    _var(
        "device_budget",
        "size",
        "bytes",
        "device tier budget in bytes (`8GiB`, `512MB`, `1e9`); unset: 64 GiB in `kvtier "
        "simulate`, half the free CUDA memory (1 GiB on a CPU) in a `BlockManager`",
    ),
    _var(
        "device_blocks",
        "int",
        "blocks",
        "device tier budget in blocks at level 0 (instead of bytes; in `kvtier simulate` a "
        "block is one trace block, 512 tokens); unset = `device_budget`",
    ),
    _var(
        "host_budget",
        "size",
        "bytes",
        "host (pinned DRAM) tier budget in bytes; unset = no host tier",
    ),
    _var(
        "host_blocks", "int", "blocks", "host tier budget in blocks at level 0 (instead of bytes)"
    ),
    _var(
        "pool_shares",
        "shares",
        "fractions that sum to 1",
        "fraction of each tier's budget given to each level's pool, e.g. `0.5,0.3,0.2`; "
        "unset = half to level 0, the rest by `compression_ratio`",
    ),
    _var("disk_budget", "size", "bytes", "disk tier budget in bytes; unset = no disk tier"),
    _var(
        "disk_path",
        "str",
        "directory",
        "directory of the disk tier (a `BlockManager` needs it with `disk_budget`)",
    ),
    _var(
        "remote_budget",
        "size",
        "bytes",
        "remote (Redis/Valkey) tier budget in bytes; unset = no remote tier",
    ),
    _var(
        "remote_url",
        "str",
        "URL",
        "server of the remote tier: `redis://host:port`, `rediss://` for TLS; a Redis Cluster "
        "is detected",
    ),
    _var(
        "remote_timeout",
        "float",
        "seconds, > 0",
        "seconds to wait for the remote server to connect or reply",
    ),
    _var(
        "remote_ttl",
        "float",
        "seconds, > 0",
        "seconds a remote-tier value lives after its write, so a crashed engine's values expire "
        "(a block left there longer is lost: its sequence recomputes); unset = until evicted",
    ),
    _var(
        "share_prefixes",
        "bool",
        "boolean",
        "publish each complete prompt block to the remote server under its prefix hash, and "
        "take a new prompt's blocks from there when another engine published them (needs a "
        "`namespace` that names the model)",
    ),
    _var(
        "remote_tls_ca",
        "str",
        "file",
        "CA certificate file that signed the server's (`rediss://` only)",
    ),
    _var(
        "remote_tls_cert",
        "str",
        "file",
        "client certificate file, for servers that require one (`rediss://` only)",
    ),
    _var(
        "remote_tls_key", "str", "file", "private key file of `remote_tls_cert` (`rediss://` only)"
    ),
    _var(
        "max_move_bytes",
        "size",
        "bytes per step",
        "cap on bytes moved per `step()`; unset = no cap",
    ),
    _var(
        "headroom",
        "float",
        "fraction in [0, 1)",
        "fraction of each tier's budget (and of each `BlockManager` pool) kept free for new blocks",
    ),
    _var(
        "hysteresis",
        "float",
        "score margin in [0, 1]",
        "score margin a block must clear before it is promoted or demoted back",
    ),
    _var("decay", "float", "factor in (0, 1]", "per-step decay of access counters"),
    _var(
        "attention_ema",
        "float",
        "weight in (0, 1]",
        "weight of the newest attention observation in its moving average",
    ),
    _var(
        "scissorhands_window",
        "int",
        "steps, >= 1",
        "steps over which `scissorhands` measures persistence",
    ),
    _var(
        "write_through",
        "bool",
        "boolean",
        "on demotion, keep the block's more precise bytes in the next tier (host), so a later "
        "promotion restores it exactly",
    ),
    _var(
        "evict_on_full",
        "bool",
        "boolean",
        "when a new block does not fit even after demoting and offloading, evict cached "
        "blocks (those no live sequence references), lowest-ranked first; 0: keep them and fail",
    ),
    _var(
        "prefix_aware",
        "bool",
        "boolean",
        "cached blocks form prefix trees: eviction takes leaves only (the policy ranks the "
        "leaves), so no cached block is stranded behind an evicted one; 0: plain, the policy "
        "ranks every cached block (LMCache's simulator does)",
    ),
    _var(
        "namespace",
        "str",
        "text",
        "namespace of prefix hashes and stored keys (model, codec, tenant)",
    ),
)

_ENV_BY_FIELD = {var.field: var for var in ENV_VARS}

#: Fields that state the same budget two ways (bytes or blocks). An explicit value for either
#: outranks the variables of both, or a variable for the other form would clash with it.
_SAME_BUDGET = {
    "device_budget": "device_blocks",
    "device_blocks": "device_budget",
    "host_budget": "host_blocks",
    "host_blocks": "host_budget",
}


# ---------------------------------------------------------------------------------------------
# The config


@dataclass(frozen=True)
class KvtierConfig:
    """Every knob of kvtier. ``docs/configuration.md`` lists the matching variables, units and
    defaults."""

    enable_compression: bool = True
    compression_ratio: float = 0.5
    #: fraction of the compressible blocks that leave attention (needs a ``drop`` level)
    drop_ratio: float = 0.0
    levels: int = 3
    #: codec per level; ``None`` derives it from ``levels`` and the model dtype.
    ladder: tuple[str, ...] | None = None
    policy: str = "importance"
    block_size: int = 16
    recent_window: int = 128
    sink_blocks: int = 1
    #: a cached prefix's last blocks kept after the others (0: off)
    keep_leaves: int = 2
    #: where a cached prefix's ends settle (``settle_cached``); ``None``: the deepest level of
    #: at least a quarter of level 0's bytes
    ends_level: int | None = None
    settle_cached: bool = False
    #: importance weights (magnitude, learned, attention).
    weights: tuple[float, float, float] = (0.4, 0.4, 0.2)
    device_budget: int | None = None
    #: device budget in level-0 blocks; the BlockManager turns it into bytes
    device_blocks: int | None = None
    host_budget: int | None = None
    host_blocks: int | None = None
    #: fraction of a tier's budget per level's pool (the BlockManager's fixed partition)
    pool_shares: tuple[float, ...] | None = None
    disk_budget: int | None = None
    disk_path: str | None = None
    remote_budget: int | None = None
    remote_url: str | None = None
    remote_timeout: float = 1.0
    remote_ttl: float | None = None
    share_prefixes: bool = False
    remote_tls_ca: str | None = None
    remote_tls_cert: str | None = None
    remote_tls_key: str | None = None
    max_move_bytes: int | None = None
    headroom: float = 0.1
    hysteresis: float = 0.1
    decay: float = 0.9
    attention_ema: float = 0.5
    scissorhands_window: int = 8
    write_through: bool = False
    evict_on_full: bool = True
    prefix_aware: bool = True
    namespace: str = "default"

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_env(
        cls, *, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> KvtierConfig:
        """Build a config: explicit ``overrides`` > ``KVTIER_*`` > ``VLLM_*`` aliases > defaults.

        An override whose value is ``None`` counts as not given (so CLI options that were not
        passed can be forwarded as they are). Empty variables count as unset. A budget given in
        bytes outranks the variable in blocks, and the other way round (``device_budget`` and
        ``KVTIER_DEVICE_BLOCKS``, ``host_blocks`` and ``KVTIER_HOST_BUDGET``). ``environ``
        defaults to ``os.environ``.
        """
        env = os.environ if environ is None else environ
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {', '.join(unknown)}: expected some of "
                + ", ".join(sorted(fields))
            )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for var in ENV_VARS:
            same = (var.field, _SAME_BUDGET.get(var.field, var.field))
            if any(overrides.get(name) is not None for name in same):
                continue
            for name in (var.name, var.alias):
                if name is None or not env.get(name, "").strip():
                    continue
                try:
                    values[var.field] = var.parse(env[name])
                except (ValueError, ConfigError) as exc:
                    raise ConfigError(f"{name} (config field '{var.field}'): {exc}") from None
                sources[var.field] = name
                break
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ConfigError as exc:
            # Name the variable the bad value came from, so the user knows where to look.
            for fname, src in sources.items():
                if str(exc).startswith(f"{fname}:"):
                    raise ConfigError(f"{src}: {exc}") from None
            raise

    def replace(self, **changes: Any) -> KvtierConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def resolved_ladder(self, dtype_name: str) -> tuple[str, ...]:
        """The codec of each level for a model of ``dtype_name`` (``fp16``, ``bfloat16`` ...).

        An explicit ``ladder`` is returned as it is; otherwise ``levels`` picks a prefix of
        ``(dtype, "int8", "int4")``. With ``enable_compression`` off, only level 0 remains.
        """
        ladder = (
            self.ladder if self.ladder is not None else _default_ladder(dtype_name, self.levels)
        )
        return ladder if self.enable_compression else ladder[:1]

    def core_arguments(
        self, tiers: Sequence[tuple[str, int | None]], **overrides: Any
    ) -> dict[str, Any]:
        """The keyword arguments of :class:`kvtier.Core` (all but ``level_bytes``) for this
        config on ``tiers`` (name, budget in bytes): every knob of the core the config holds,
        then ``overrides`` — a caller's own rule for a knob (``kvtier simulate``'s
        ``evict_on_full=True``) or an argument no config holds (``pressure_only``,
        ``pool_slots``, ``pool_headroom``). The one place a config becomes a core's arguments:
        ``Core(level_bytes, **config.core_arguments(tiers))``; the reference model
        (:class:`kvtier.reference.core.ModelCore`) takes the same ones."""
        return {
            "tiers": list(tiers),
            "block_size": self.block_size,
            "policy": self.policy,
            "enable_compression": self.enable_compression,
            "compression_ratio": self.compression_ratio,
            "drop_ratio": self.drop_ratio,
            "recent_window": self.recent_window,
            "sink_blocks": self.sink_blocks,
            "keep_leaves": self.keep_leaves,
            "ends_level": self.ends_level,
            "settle_cached": self.settle_cached,
            "weights": self.weights,
            "headroom": self.headroom,
            "hysteresis": self.hysteresis,
            "max_move_bytes": self.max_move_bytes,
            "decay": self.decay,
            "attention_ema": self.attention_ema,
            "scissorhands_window": self.scissorhands_window,
            "write_through": self.write_through,
            "evict_on_full": self.evict_on_full,
            "namespace": self.namespace,
            "prefix_aware": self.prefix_aware,
            **overrides,
        }

    # -- validation -----------------------------------------------------------------------------

    def _check_tls(self) -> None:
        """TLS files only with a ``rediss://`` server, each an existing file, key with cert."""
        given = {
            name: getattr(self, name)
            for name in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key")
            if getattr(self, name) is not None
        }
        if not given:
            return
        url = self.remote_url
        if not isinstance(url, str) or not url.startswith("rediss://"):
            raise ConfigError(
                f"{', '.join(given)}: expected a TLS server (remote_url=rediss://host:port) "
                f"with TLS files, got remote_url={url!r}"
            )
        for name, path in given.items():
            if not isinstance(path, str) or not os.path.isfile(path):
                raise ConfigError(f"{name}: expected a readable file, got {path!r}")
        if ("remote_tls_cert" in given) != ("remote_tls_key" in given):
            raise ConfigError(
                "remote_tls_cert and remote_tls_key: expected both (a client certificate and "
                "its key) or neither"
            )

    def __post_init__(self) -> None:
        set_ = self._set
        set_("enable_compression", _bool(self, "enable_compression"))
        set_("write_through", _bool(self, "write_through"))
        set_("evict_on_full", _bool(self, "evict_on_full"))
        set_("prefix_aware", _bool(self, "prefix_aware"))
        set_("settle_cached", _bool(self, "settle_cached"))
        set_("share_prefixes", _bool(self, "share_prefixes"))

        set_("compression_ratio", _number(self, "compression_ratio", 0.0, 1.0))
        set_("drop_ratio", _number(self, "drop_ratio", 0.0, 1.0))
        set_("headroom", _number(self, "headroom", 0.0, 1.0, hi_open=True))
        set_("hysteresis", _number(self, "hysteresis", 0.0, 1.0))
        set_("decay", _number(self, "decay", 0.0, 1.0, lo_open=True))
        set_("attention_ema", _number(self, "attention_ema", 0.0, 1.0, lo_open=True))
        set_("remote_timeout", _number(self, "remote_timeout", 0.0, math.inf, lo_open=True))
        if self.remote_ttl is not None:
            set_("remote_ttl", _number(self, "remote_ttl", 0.0, math.inf, lo_open=True))

        set_("block_size", _integer(self, "block_size", 1))
        set_("recent_window", _integer(self, "recent_window", 0))
        set_("sink_blocks", _integer(self, "sink_blocks", 0))
        set_("keep_leaves", _integer(self, "keep_leaves", 0))
        if self.ends_level is not None:
            set_("ends_level", _integer(self, "ends_level", 0))
        set_("scissorhands_window", _integer(self, "scissorhands_window", 1))
        for name in _BYTE_FIELDS:
            if getattr(self, name) is not None:
                set_(name, _byte_count(self, name))

        for tier in ("device", "host"):
            blocks = f"{tier}_blocks"
            if getattr(self, blocks) is not None:
                set_(blocks, _block_count(self, blocks))
                if getattr(self, f"{tier}_budget") is not None:
                    raise ConfigError(
                        f"{blocks}: expected either {tier}_budget (bytes) or {blocks}, not both"
                    )
        if self.pool_shares is not None:
            set_("pool_shares", _shares(self.pool_shares))
        self._check_tls()

        if not isinstance(self.policy, str) or self.policy.strip().lower() not in POLICIES:
            raise ConfigError(
                f"policy: unknown policy {self.policy!r}: expected one of {', '.join(POLICIES)}"
            )
        set_("policy", self.policy.strip().lower())

        if (
            not isinstance(self.namespace, str)
            or not self.namespace
            or not self.namespace.isprintable()
        ):
            raise ConfigError(
                f"namespace: expected a non-empty printable string, got {self.namespace!r}"
            )

        weights = self.weights
        if (
            isinstance(weights, (str, bytes))
            or not hasattr(weights, "__len__")
            or len(weights) != 3
        ):
            raise ConfigError(
                f"weights: expected three numbers (magnitude, learned, attention), got {weights!r}"
            )
        ws = tuple(_as_float(w) for w in weights)
        if any(w is None or not math.isfinite(w) or w < 0 for w in ws):
            raise ConfigError(
                f"weights: expected three finite non-negative numbers, got {tuple(weights)!r}"
            )
        if sum(w for w in ws if w is not None) <= 0:
            raise ConfigError(f"weights: expected a positive sum, got {tuple(weights)!r}")
        set_("weights", ws)

        set_("levels", _integer(self, "levels", 1))
        if self.ladder is None:
            if not 1 <= self.levels <= 3:
                raise ConfigError(
                    f"levels: expected 1, 2 or 3 without a ladder (or up to {MAX_LEVELS} "
                    f"with an explicit ladder), got {self.levels}"
                )
        else:
            ladder = self._check_ladder(self.ladder)
            set_("ladder", ladder)
            # The ladder wins: levels is its length.
            set_("levels", len(ladder))
        if self.drop_ratio > 0 and (self.ladder is None or self.ladder[-1] != "drop"):
            raise ConfigError(
                f"drop_ratio {self.drop_ratio:g}: needs a ladder ending in a 'drop' level, e.g. "
                "ladder='fp16,int8,int4,drop'"
            )
        if self.pool_shares is not None and len(self.pool_shares) != self.levels:
            raise ConfigError(
                f"pool_shares: expected one fraction per level ({self.levels}), "
                f"got {len(self.pool_shares)}"
            )

    def _check_ladder(self, ladder: object) -> tuple[str, ...]:
        if isinstance(ladder, str):
            ladder = _parse_list(ladder)
        if not isinstance(ladder, (tuple, list)) or not ladder:
            raise ConfigError(f"ladder: expected a non-empty list of codec names, got {ladder!r}")
        names = tuple(str(x).strip().lower() for x in ladder)
        if len(names) > MAX_LEVELS:
            raise ConfigError(f"ladder: expected at most {MAX_LEVELS} levels, got {len(names)}")
        for name in names:
            if not _LEVEL_NAME.match(name):
                raise ConfigError(
                    f"ladder: invalid codec name {name!r}: expected names like fp16, int8, int4, "
                    "drop, learned:mine"
                )
        if "drop" in names[:-1]:
            raise ConfigError(
                f"ladder: 'drop' must be the last level (it holds no bytes), got {','.join(names)}"
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"ladder: expected distinct codec names, got {','.join(names)}")
        if names[0] not in ("fp16", "bf16", "fp32"):
            normalized = _DTYPE_ALIASES.get(names[0])
            if normalized is None:
                raise ConfigError(
                    f"ladder: expected level 0 to be the model dtype (fp16, bf16 or fp32), got {names[0]!r}"
                )
            names = (normalized, *names[1:])
        return names

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


def _shares(value: object) -> tuple[float, ...]:
    if isinstance(value, str):
        value = _parse_shares(value)
    shares = tuple(_as_float(x) for x in value) if isinstance(value, (tuple, list)) else ()
    if (
        not shares
        or any(x is None or not math.isfinite(x) or x < 0 for x in shares)
        or not 0.99 <= sum(x for x in shares if x is not None) <= 1.01
    ):
        raise ConfigError(
            f"pool_shares: expected non-negative fractions that sum to 1, one per level, "
            f"got {value!r}"
        )
    return tuple(float(x) for x in shares if x is not None)


def _as_float(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, Real):
        return None
    return float(x)


def _bool(cfg: KvtierConfig, name: str) -> bool:
    value = getattr(cfg, name)
    if isinstance(value, bool):
        return value
    if isinstance(value, Integral) and int(value) in (0, 1):
        return bool(value)
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def _number(
    cfg: KvtierConfig,
    name: str,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    value = getattr(cfg, name)
    x = _as_float(value)
    ok = (
        x is not None
        and math.isfinite(x)
        and (x > lo if lo_open else x >= lo)
        and (x < hi if hi_open else x <= hi)
    )
    if not ok or x is None:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{name}: expected a number in {rng}, got {value!r}")
    return x


def _integer(cfg: KvtierConfig, name: str, lo: int, *, what: str = "an integer") -> int:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < lo:
        bound = "non-negative" if lo == 0 else f">= {lo}"
        raise ConfigError(f"{name}: expected {what} {bound}, got {value!r}")
    return int(value)


#: Fields in bytes. Each takes what its variable takes (``8GiB``, ``512MB``, ``1e9``, ``4096``)
#: as well as an int.
_BYTE_FIELDS = ("device_budget", "host_budget", "disk_budget", "remote_budget", "max_move_bytes")
#: The byte fields that are a tier's budget: more than 0 bytes when set.
_TIER_BUDGETS = _BYTE_FIELDS[:4]


def _byte_count(cfg: KvtierConfig, name: str) -> int:
    value = getattr(cfg, name)
    if isinstance(value, str):
        try:
            count = parse_bytes(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    elif isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 0:
        count = -1
    elif int(value) > MAX_SIZE:
        raise ConfigError(f"{name}: expected {_MAX_SIZE_TEXT} bytes, got {value!r}")
    else:
        count = int(value)
    if name in _TIER_BUDGETS and count == 0:
        # A tier of no bytes would be built, then refuse every block; unset leaves it out.
        raise ConfigError(
            f"{name}: expected a positive byte count (unset: no "
            f"{name.removesuffix('_budget')} tier), got {value!r}"
        )
    if count < 0:
        least = "positive" if name in _TIER_BUDGETS else "non-negative"
        raise ConfigError(
            f"{name}: expected a byte count: a {least} int or a size such as '16GiB', "
            f"'512MB', '1e9', got {value!r}"
        )
    return count


def _block_count(cfg: KvtierConfig, name: str) -> int:
    """A budget in blocks: an int >= 1, or its variable's text (a plain integer such as '4096')."""
    value = getattr(cfg, name)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(
                f"{name}: expected a block count: an integer >= 1 (or its digits, e.g. '4096'), "
                f"got {getattr(cfg, name)!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise ConfigError(
            f"{name}: expected a block count: an integer >= 1 (or its digits, e.g. '4096'), "
            f"got {value!r}"
        )
    if int(value) > MAX_SIZE:
        raise ConfigError(
            f"{name}: expected a block count of at most {MAX_SIZE:,} (2**64 - 1), got {value!r}"
        )
    return int(value)


def _format_default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def env_table_markdown() -> str:
    """The configuration table (Markdown), generated from :data:`ENV_VARS`: one row a field,
    with its variable, alias, default, unit and meaning."""
    defaults = KvtierConfig()
    rows = [
        "| variable | alias | field | default | unit | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for var in ENV_VARS:
        default = _format_default(getattr(defaults, var.field))
        if var.field == "ladder":
            default = "from levels"
        alias = f"`{var.alias}`" if var.alias else ""
        rows.append(
            f"| `{var.name}` | {alias} | `{var.field}` | `{default}` | {var.unit} | {var.help} |"
        )
    return "\n".join(rows)


#: The command that writes ``docs/configuration.md`` from :func:`configuration_page`, run from
#: the repository's root.
CONFIGURATION_PAGE_COMMAND = (
    ".venv/bin/python -c 'from kvtier.config import configuration_page as p; "
    'print(p(), end="")\' > docs/configuration.md'
)


def _error_example(environ: Mapping[str, str]) -> str:
    """The message of the ConfigError that ``environ`` raises."""
    try:
        KvtierConfig.from_env(environ=environ)
    except ConfigError as exc:
        return str(exc)
    raise AssertionError(f"expected a ConfigError from {dict(environ)}")


def configuration_page() -> str:
    """The configuration page, ``docs/configuration.md``, in Markdown: where a value comes from,
    how values are written, what a bad one raises, the keys vLLM's connector takes, and
    :func:`env_table_markdown`.

    :data:`CONFIGURATION_PAGE_COMMAND` writes the file; ``tests/test_config.py`` fails when the
    file and this function part ways."""
    aliases = ", ".join(f"`{v.alias}`" for v in ENV_VARS if v.alias)
    sizes = ", ".join(f"`{v.field}`" for v in ENV_VARS if v.kind == "size")
    bad = {"KVTIER_HOST_BUDGET": "8 gigs", "KVTIER_HEADROOM": "1.5"}
    errors = "\n".join(
        f"- with `{name}={shlex.quote(text)}`: `{_error_example({name: text})}`"
        for name, text in bad.items()
    )
    return f"""<!-- Generated from python/kvtier/config.py by configuration_page(): edit that, not
this file. Regenerate it, from the repository's root, with
    {CONFIGURATION_PAGE_COMMAND}
tests/test_config.py fails while this file and the code differ. -->

# Configuration

Every setting of kvtier is a field of [`KvtierConfig`](reference/config.md): the scheduling
policy and its knobs, the precision ladder, and each tier's budget. Each field can also be set
by an environment variable, `KVTIER_<FIELD>`, and in vLLM by a key of the connector's extra
config. The [table](#every-setting) at the end lists them all, with defaults and units.

## Where a value comes from

`KvtierConfig(...)` takes its arguments and nothing else: the environment is ignored.
`KvtierConfig.from_env(**arguments)` is the config that a `BlockManager`, a `TieredCache`,
vLLM's connector and its plug-ins, and `kvtier simulate` build when they are handed none. It
takes each field from the first of these that sets it:

1. an argument: a keyword of `from_env`, an option of `kvtier simulate` (`--policy`,
   `--ladder`, `--host-bytes` ...), a key of vLLM's `kv_connector_extra_config`;
2. its `KVTIER_<FIELD>` variable, e.g. `KVTIER_HOST_BUDGET=8GiB`;
3. the original design's `VLLM_*` alias, for the fields that have one: {aliases};
4. the default.

An argument of `None` counts as not given, and an empty variable as unset. A budget given in
bytes outranks the variable in blocks, and the other way round: `host_budget="8GiB"` wins over
`KVTIER_HOST_BLOCKS`.

## Writing values

- **Sizes** in bytes ({sizes}) take `8GiB`, `512MB`, `1.5 KiB`, `1e9` or plain bytes
  (`4096`). KiB, MiB, GiB and TiB are powers of 1024; KB, MB, GB and TB are powers of 1000;
  units are case-insensitive (`kvtier.parse_bytes` reads them).
- **Booleans** take `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`, in any case.
- **Lists** are comma-separated: a ladder `bf16,int8,int4`, the weights
  `magnitude,learned,attention`, the pool shares one fraction a level (`0.5,0.3,0.2`).
- **Fractions** are numbers from 0 to 1 and **seconds** numbers above 0; the table gives each
  field's range.

A value that does not parse or is out of range raises `kvtier.ConfigError` (a `ValueError`)
when the config is built. Its message names the variable the value came from (or the field,
for an argument) and what was expected. For example, `KvtierConfig.from_env()` raises

{errors}

## In vLLM

The keys of `kv_connector_extra_config` for `KVTierConnector`, and of a `KvtierTier` entry in
`secondary_tiers`, are these field names. A value is written as its variable's would be
(`"host_budget": "8GiB"`, `"ladder": "bf16,int8,int4"`) or as JSON (numbers, booleans, lists).
The keys count as arguments, so they win over the variables.

The connector keeps its tiers in host memory, behind vLLM's own KV pool, so `host_budget`
(2 GiB unless set) is the budget of its first tier. vLLM decides `block_size`,
`device_budget` and `device_blocks` itself: a key that sets one is refused. A few keys are the
connector's own rather than fields: `async_loads`, `load_failure_policy`, `scorer` and
`shed_saves` ([vllm.md](vllm.md) covers them). `KvtierCachePolicy` reads the variables only.

## Every setting

{env_table_markdown()}
"""
