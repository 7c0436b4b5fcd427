"""Room on the device for new blocks: what a plan frees, and why there is none.

The manager makes room (a plan that demotes and offloads, then a retry that may evict) under its
own locks; these functions only read the core: :func:`slots_after` says whether a plan frees
enough level-0 device slots to be worth running, :func:`why_full` writes the
:class:`OutOfCapacityError` message that says what holds the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .._core import Core, Plan

__all__ = ["pool_usage", "slots_after", "why_full"]


def pool_usage(core: Core, tier: str, level: int) -> tuple[str, int, int, int, int]:
    """``(tier, level, used slots, slots, bytes)`` of one pool."""
    return next(u for u in core.usage() if u[:2] == (tier, level))


def slots_after(core: Core, plan: Plan, evict_on_full: bool) -> int:
    """Level-0 device slots free once ``plan`` commits, counting the cached blocks an eviction
    may take then (with ``evict_on_full``)."""
    device = Plan.TIERS.index("device")
    _, _, used, cap, _ = pool_usage(core, "device", 0)
    # Every move out of the pool but a backup (a copy) frees its slot.
    leaving = (plan.src_tier == device) & (plan.src_level == 0)
    leaving &= plan.kind != Plan.KINDS.index("backup")
    free = cap - used + int(leaving.sum())
    if evict_on_full:
        free += next(n for t, lv, n, _ in core.reclaimable() if (t, lv) == ("device", 0))
    return free


def why_full(
    core: Core,
    live: Iterable[int],
    blocks: int,
    level_bytes: Sequence[int],
    behind: Sequence[str],
    evict_on_full: bool,
    device_budget: int,
) -> str:
    """Why ``blocks`` new level-0 blocks do not fit: what the ``live`` sequences and the cached
    blocks hold on the device, against its budget and its level-0 slots, and what to change
    (``behind``: the tiers after the device)."""
    held = np.unique(
        np.concatenate([core.sequence_blocks(s) for s in live] + [np.zeros(0, np.uint32)])
    )
    info = core.block_info(held)
    on_device = info["tier"] == Plan.TIERS.index("device")
    sizes = np.asarray(level_bytes, dtype=np.int64)
    live_bytes = int(sizes[info["level"][on_device]].sum())
    live0 = int((on_device & (info["level"] == 0)).sum())
    device_bytes = dict(core.tier_bytes())["device"]
    _, _, used0, cap0, _ = pool_usage(core, "device", 0)
    cached_bytes, cached0 = device_bytes - live_bytes, used0 - live0
    if cached_bytes and not evict_on_full:
        why = "the device is full and evict_on_full is off, so its cached blocks are kept"
        fix = "set evict_on_full, free sequences, or raise device_budget/device_blocks"
    elif behind:
        # Complete live blocks go to the tiers behind the device when room is needed, so
        # what is left on it is what they could not take.
        why = f"the live sequences do not fit in the device and {'/'.join(behind)} tiers"
        fix = f"free sequences, or raise device_budget/device_blocks or the {behind[0]} budget"
    else:
        why = "the live sequences do not fit on the device"
        fix = "free sequences, or raise device_budget/device_blocks (or add a host tier)"
    return (
        f"{why}: {blocks} more level-0 block(s) of {level_bytes[0]} B needed; live "
        f"sequences hold {live_bytes} B there ({live0} of the {cap0} level-0 slots, where "
        f"new K/V goes), cached blocks {cached_bytes} B ({cached0} level-0 slots), device "
        f"budget {device_budget} B; {fix}"
    )
