"""Pool sizing: how a manager's budgets become pools, decided before anything is allocated.

:func:`size_pools` turns the config, the block shape and each level's block size into a
:class:`PoolLayout`: each tier's budget in bytes and each (tier, level) pool's slots. It refuses,
with a :class:`ConfigError` naming the setting to change, configs that need a tier they lack
(``write_through``, ``share_prefixes``) and budgets the pools cannot have: no level-0 block on
the device, more slots than a pool can index, tensor pools larger than the memory they live in.
A layout never changes: the pools are allocated once from it, and :func:`make_core` builds the
core that keeps each tier within its budget and each pool within its slots.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._core import Core
from .._torch import torch_module
from ..config import KvtierConfig
from ..errors import ConfigError

__all__ = [
    "DEFAULT_CPU_BYTES",
    "DEFAULT_CUDA_SHARE",
    "MAX_POOL_SLOTS",
    "STORE_TIERS",
    "TIERS",
    "PoolLayout",
    "default_shares",
    "make_core",
    "memory_of",
    "size_pools",
]

TIERS = ("device", "host", "disk", "remote")
#: Tiers held in a :class:`KVStore` rather than a tensor pool.
STORE_TIERS = ("disk", "remote")
#: The device budget when neither ``device_budget`` nor ``device_blocks`` is set: this share of
#: the free CUDA memory, or a fixed amount of CPU memory.
DEFAULT_CUDA_SHARE = 0.5
DEFAULT_CPU_BYTES = 1 << 30
#: Slots one pool can index (the core's slot ids are 32-bit).
MAX_POOL_SLOTS = (1 << 32) - 1


def default_shares(levels: int, level_bytes: Sequence[int], ratio: float) -> tuple[float, ...]:
    """Half of a tier to level 0 (new blocks and every sequence's recent window), the other half
    split so that levels 1 and 2 hold blocks in the proportion ``compression_ratio`` asks for."""
    if levels == 1:
        return (1.0,)
    if levels == 2:
        return (0.5, 0.5)
    want = [ratio * level_bytes[1], (1 - ratio) * level_bytes[2]]
    rest = [0.0] * (levels - 3)  # levels below 2 get nothing unless configured
    total = sum(want) or 1.0
    return (0.5, 0.5 * want[0] / total, 0.5 * want[1] / total, *rest)


@dataclass(frozen=True)
class PoolLayout:
    """Each tier's budget and each pool's slots, as :func:`size_pools` decided them."""

    #: bytes per tier, for the tiers the manager has (the device first, then in :data:`TIERS`
    #: order)
    budgets: dict[str, int]
    #: slots per ``(tier, level)`` pool (0 for a level that gets no share, and for a drop level)
    slots: dict[tuple[str, int], int]
    #: bytes of one block at each level (0 for a drop level)
    level_bytes: tuple[int, ...]

    @property
    def tiers(self) -> list[str]:
        """The tiers the manager has, the device first."""
        return list(self.budgets)

    def tier_bytes(self, tier: str) -> int:
        """What ``tier``'s pools hold when full: the budget the core keeps it within."""
        return sum(self.slots[tier, lv] * b for lv, b in enumerate(self.level_bytes))


def size_pools(
    config: KvtierConfig,
    device: Any,
    level_bytes: Sequence[int],
    codecs: int,
    tier_names: Mapping[str, str] | None = None,
) -> PoolLayout:
    """The layout of a manager's pools. ``level_bytes``: one block's bytes at each level of the
    ladder (0 for a drop level); ``codecs``: the levels that hold bytes (the ladder less a drop
    level); ``device``: where the device tier lives (its free memory sets the default budget);
    ``tier_names``: what the caller's users call a tier, where it differs (the vLLM connector's
    manager lives in host memory: its ``device`` tier is their ``host``), for the errors."""
    names = dict(tier_names or {})

    def called(tier: str) -> str:
        return names.get(tier, tier)

    budgets: dict[str, int] = {"device": _device_budget(config, level_bytes[0], device)}
    for tier in TIERS[1:]:
        budget = _budget(config, tier, level_bytes[0])
        if budget is not None:
            budgets[tier] = budget
    if config.write_through and len(budgets) == 1:
        raise ConfigError(
            "write_through: needs a tier after the device to keep full-precision copies in; "
            "set host_budget (or host_blocks), disk_budget or remote_budget"
        )
    if config.share_prefixes and "remote" not in budgets:
        raise ConfigError(
            "share_prefixes: needs a remote tier to share through: set remote_budget and remote_url"
        )
    if config.share_prefixes and config.namespace == KvtierConfig().namespace:
        # Keys say tokens, shape and dtype, not which weights: only the namespace does.
        raise ConfigError(
            "share_prefixes: set namespace to name the model and its weights (e.g. "
            "'SmolLM2-135M@rev'): engines share blocks within a namespace, and two models of "
            "one shape under the default name would read each other's K/V"
        )
    shares = config.pool_shares or (
        default_shares(codecs, level_bytes, config.compression_ratio)
        + (0.0,) * (len(level_bytes) - codecs)
    )
    slots: dict[tuple[str, int], int] = {}
    for tier, budget in budgets.items():
        for level, (share, nbytes) in enumerate(zip(shares, level_bytes, strict=True)):
            slots[tier, level] = int(share * budget // nbytes) if nbytes else 0
    if slots["device", 0] < 1:
        device_tier = called("device")
        shares_hint = ", or give level 0 a larger pool_shares" if config.pool_shares else ""
        raise ConfigError(
            f"{device_tier} budget {budgets['device']} B holds no level-0 block of "
            f"{level_bytes[0]} B at level-0 share {shares[0]:g}: raise {device_tier}_budget "
            f"or {device_tier}_blocks{shares_hint}"
        )
    for tier in budgets:
        if tier != "device" and not any(slots[tier, lv] for lv in range(len(level_bytes))):
            held = [
                f"{n} B at share {sh:g}" for n, sh in zip(level_bytes, shares, strict=True) if n
            ]
            raise ConfigError(
                f"{called(tier)}_budget: {budgets[tier]} B holds no block at any level ("
                + ", ".join(held)
                + f"): expected at least one block's bytes; raise {called(tier)}_budget or "
                f"{called(tier)}_blocks, or leave both unset for no {called(tier)} tier"
            )
    layout = PoolLayout(budgets, slots, tuple(level_bytes))
    _check_pool_sizes(layout, device, called)
    return layout


def make_core(config: KvtierConfig, layout: PoolLayout) -> Core:
    """The core that decides where a manager's blocks live: each tier's budget and each pool's
    slots from ``layout``, the scoring and scheduling from ``config``."""
    return Core(
        list(layout.level_bytes),
        **config.core_arguments(
            [(t, layout.tier_bytes(t)) for t in layout.tiers],
            # Allocations never evict at once: a plan demotes and offloads first, and only the
            # retry after it may evict cached blocks (when config.evict_on_full), see
            # BlockManager._with_room.
            evict_on_full=False,
            pool_slots=[(t, lv, n) for (t, lv), n in layout.slots.items()],
            pool_headroom=True,
        ),
    )


def _budget(config: KvtierConfig, tier: str, level0_bytes: int) -> int | None:
    """A tier's budget in bytes, from ``{tier}_blocks`` or ``{tier}_budget``; None: no such
    tier."""
    blocks = getattr(config, f"{tier}_blocks", None)
    if blocks is not None:
        return int(blocks) * level0_bytes
    budget: int | None = getattr(config, f"{tier}_budget")
    return budget


def _device_budget(config: KvtierConfig, level0_bytes: int, device: Any) -> int:
    budget = _budget(config, "device", level0_bytes)
    if budget is not None:
        return budget
    torch = torch_module()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_SHARE)
    return DEFAULT_CPU_BYTES


def _check_pool_sizes(layout: PoolLayout, device: Any, called: Callable[[str], str]) -> None:
    """Refuses budgets the pools cannot have, before anything is allocated or opened: more
    slots than a pool can index, or tensor pools larger than the memory they live in."""
    for (tier, level), n in layout.slots.items():
        if n > MAX_POOL_SLOTS:
            raise ConfigError(
                f"{called(tier)} budget {layout.budgets[tier]} B makes {n} slots of "
                f"{layout.level_bytes[level]} B at level {level}, more than the "
                f"{MAX_POOL_SLOTS} a pool can index: lower the {called(tier)} budget or raise "
                "block_size"
            )
    wanted: dict[str, tuple[int, list[str]]] = {}
    for (tier, level), n in layout.slots.items():
        if tier not in STORE_TIERS:
            where = device.type if tier == "device" else "cpu"
            nbytes, tiers = wanted.get(where, (0, []))
            wanted[where] = (nbytes + n * layout.level_bytes[level], [*tiers, called(tier)])
    for where, (nbytes, tiers) in wanted.items():
        have = memory_of(where, device)
        if have is not None and nbytes > have:
            names = " and ".join(dict.fromkeys(tiers))
            raise ConfigError(
                f"{names} budget: the pools take {nbytes} B of {where} memory, allocated "
                f"when the manager is built, but the {where} has {have} B: lower the "
                f"{names} budget"
            )


def memory_of(where: str, device: Any) -> int | None:
    """Bytes of memory of the CPU (physical) or of the CUDA device; None where unknown."""
    if where == "cuda":
        torch = torch_module()
        return int(torch.cuda.mem_get_info(device)[1])
    if where != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
