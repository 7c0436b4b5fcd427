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

__all__ = ["fits_in_tiers", "pool_usage", "slots_after", "why_full"]


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


def fits_in_tiers(
    core: Core,
    live: Iterable[int],
    blocks: int,
    slots: dict[tuple[str, int], int],
    demote: bool,
    evict: bool,
) -> bool:
    """Whether the ``live`` sequences' blocks and ``blocks`` new ones can all lie in the pools
    (``slots`` per (tier, level)) at once: new blocks, and pinned ones (still being written),
    where they are written (the device's level-0 slots); every other block in any tier at its
    own level or, when ``demote``, a lower one (a lossy level cannot go back up). Cached blocks
    count only where they may not be ``evict``ed (then every used slot does, write-through
    copies too). An assignment with nested choices, possible exactly when, for each level l,
    the blocks that must lie at level l or lower are no more than the slots there (Hall's
    condition); without demotion, level by level."""
    held = np.unique(
        np.concatenate([core.sequence_blocks(s) for s in live] + [np.zeros(0, np.uint32)])
    )
    info = core.block_info(held)
    levels = 1 + max(level for _, level in slots)
    free = np.zeros(levels, dtype=np.int64)
    for (_, level), n in slots.items():
        free[level] += n
    placed = info["slot"] != Plan.NO_SLOT  # dropped blocks hold no slot
    pinned = placed & info["pinned"].astype(bool)
    np.subtract.at(free, info["level"][pinned].astype(np.int64), 1)
    device0 = slots.get(("device", 0), 0)
    on_device0 = pinned & (info["tier"] == Plan.TIERS.index("device")) & (info["level"] == 0)
    if blocks > device0 - int(on_device0.sum()):
        return False
    need = np.bincount(info["level"][placed & ~pinned].astype(np.int64), minlength=levels)
    if not evict:  # every used slot holds a block that stays somewhere
        used = np.zeros(levels, dtype=np.int64)
        for _, level, n, _, _ in core.usage():
            used[level] += n
        need = used - np.bincount(info["level"][pinned].astype(np.int64), minlength=levels)
    need[0] += blocks
    if not demote:
        return bool((need <= free).all())
    # Suffix sums: blocks at level l or lower (higher index) against the slots there.
    return bool((np.cumsum(need[::-1]) <= np.cumsum(free[::-1])).all())


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
