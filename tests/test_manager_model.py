"""BlockManager against a plain reference: random operation sequences (Hypothesis) and threads.

The reference keeps, per sequence, its token ids and how many tokens each layer has appended.
K/V are a deterministic function of the token prefix and the layer (as a real model's are), so
sequences that share a prompt prefix — and so share cached blocks in the manager — have identical
K/V, and what :meth:`BlockManager.gather` must return is known exactly: bit-exact at level 0,
within the codec's error at int8 and int4 (per block, cosine >= 0.99 and >= 0.95 on keys with
their per-channel offsets removed, so that a block holding another block's K/V fails).

Keys are shaped like real keys: per-channel offsets, and a few outlier channels of large
magnitude (why int4 groups keys per channel).

Contract checked after every operation:

- every gather is exact (fp16-only ladder) or each block within its level's bound;
- a call that fails raises a kvtier error and leaves everything as it was: stats (counters,
  pools, sequences, tokens), pool bytes, every block's location, every sequence's blocks and
  tokens per layer (so every gather too);
- invalid appends of every kind fail (wrong shape, k/v mismatch, dtype, device, NaN/inf in K or
  in V, unknown sequence, bad layer, more tokens than the device holds), and a retry with valid
  K/V for the same tokens is stored and gathered correctly;
- K/V with ``requires_grad=True`` are accepted, stored detached and gathered exactly;
- an allocating call (add_sequence with ids, add_tokens, append, fork) never raises
  OutOfCapacityError while the live sequences (after the call) fit in all the tiers together
  (:meth:`ManagerVsReference.room_for`: the device, and the host and disk tiers a config has),
  unless ``evict_on_full=False`` was asked for; its message names the live and cached bytes and
  the budget. Writes that fit only once blocks are offloaded are made on purpose
  (``test_writes_that_fit_only_by_offloading_succeed``).

The default run is modest (see ``FAST``); ``-m slow`` runs many more examples and a longer
thread soak (``KVTIER_SOAK_S`` seconds per config, 20 by default).
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier import (  # noqa: E402
    BlockLostError,
    BlockManager,
    InvalidArgumentError,
    InvalidSequenceError,
    KvtierConfig,
    KvtierError,
    OutOfCapacityError,
    Plan,
)

LAYERS, HEADS, DIM, BS = 2, 2, 32, 4
#: Bytes of one fp16 block (K and V of every layer): a disk budget is given in these.
BLOCK_BYTES = LAYERS * 2 * HEADS * BS * DIM * 2
#: Per-block cosine similarity a lossy level must keep (keys centred on their channel offsets).
BOUNDS = {"int8": 0.99, "int4": 0.95}
MAX_SEQS = 6
#: Counters a plan made and aborted (a full device looking for room) may change.
PLAN_BOOKKEEPING = ("plans", "aborts", "deferred_moves", "noop_promotions")

# -- K/V as a function of the token prefix -------------------------------------------------------


def _channel_profile(layer: int) -> tuple[Any, Any]:
    """Per-channel offset and scale of layer ``layer``'s keys, ``[heads, dim]`` each: small
    offsets, and three outlier channels per head with a large offset and spread."""
    g = torch.Generator().manual_seed(7919 + layer)
    offset = torch.randn(HEADS, DIM, generator=g) * 0.5
    scale = torch.ones(HEADS, DIM)
    for h in range(HEADS):
        outliers = torch.randperm(DIM, generator=g)[:3]
        sign = torch.where(torch.rand(3, generator=g) < 0.5, -1.0, 1.0)
        offset[h, outliers] = sign * (8.0 + 8.0 * torch.rand(3, generator=g))
        scale[h, outliers] = 3.0 + 3.0 * torch.rand(3, generator=g)
    return offset, scale


PROFILES = [_channel_profile(layer) for layer in range(LAYERS)]
#: Key offsets as the model dtype sees them, ``[layers, heads, dim]``.
K_OFFSETS = torch.stack([p[0] for p in PROFILES]).half().float()


def prefix_hash(prev: int, token: int) -> int:
    """The running hash of a token prefix (deterministic across runs: tuples of ints)."""
    return hash((prev, token, 0x5EED)) & ((1 << 63) - 1)


_KV_CACHE: dict[tuple[int, int], Any] = {}
_KV_LOCK = threading.Lock()


def token_kv(h: int, layer: int) -> Any:
    """K and V of the token whose prefix hashes to ``h``, at ``layer``: fp16 ``[2, heads, dim]``."""
    key = (h, layer)
    got = _KV_CACHE.get(key)
    if got is not None:
        return got
    rng = np.random.default_rng([h, layer])
    z = torch.from_numpy(rng.standard_normal((2, HEADS, DIM), dtype=np.float32))
    offset, scale = PROFILES[layer]
    kv = torch.stack([z[0] * scale + offset, z[1]]).half()
    with _KV_LOCK:
        if len(_KV_CACHE) > 200_000:
            _KV_CACHE.clear()
        _KV_CACHE[key] = kv
    return kv


@dataclass
class Ref:
    """What one sequence must hold: its tokens (declared ids, or private ones for a sequence
    without ids) with their prefix hashes, and the tokens each layer has appended."""

    ids: bool
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=lambda: [0] * LAYERS)

    def extend(self, tokens: list[int]) -> None:
        h = self.hashes[-1] if self.hashes else 0
        for t in tokens:
            h = prefix_hash(h, t)
            self.tokens.append(t)
            self.hashes.append(h)

    def copy(self) -> Ref:
        return Ref(self.ids, list(self.tokens), list(self.hashes), list(self.lengths))

    def kv(self, layer: int, start: int = 0, end: int | None = None) -> tuple[Any, Any]:
        """Reference K and V of tokens ``start:end`` at ``layer``, ``[n, heads, dim]`` fp16."""
        end = self.lengths[layer] if end is None else end
        if end <= start:
            empty = torch.empty(0, HEADS, DIM, dtype=torch.float16)
            return empty, empty.clone()
        x = torch.stack([token_kv(h, layer) for h in self.hashes[start:end]])
        return x[:, 0].contiguous(), x[:, 1].contiguous()


def _bits(x: Any) -> Any:
    return x.detach().contiguous().view(torch.int16)


def block_mismatches(
    k: Any, v: Any, want_k: Any, want_v: Any, layer: int, levels: list[int], ladder: Any
) -> list[str]:
    """Why gathered K/V are not the reference, block by block ('' list: they are). Level 0
    bit-exact; lower levels within their codec's bound."""
    bad = []
    for j, lv in enumerate(levels):
        sl = slice(j * BS, (j + 1) * BS)
        gk, gv, wk, wv = k[sl], v[sl], want_k[sl], want_v[sl]
        if lv == 0:
            if not (torch.equal(_bits(gk), _bits(wk)) and torch.equal(_bits(gv), _bits(wv))):
                diff = (gk.float() - wk.float()).abs().nan_to_num(1e9).max().item()
                bad.append(f"block {j} (level 0) is not bit-exact (max |dK| {diff:g})")
            continue
        bound = BOUNDS[ladder[lv]]
        off = K_OFFSETS[layer]
        ck = torch.nn.functional.cosine_similarity(
            (gk.float() - off).flatten(), (wk.float() - off).flatten(), dim=0
        ).item()
        cv = torch.nn.functional.cosine_similarity(
            gv.float().flatten(), wv.float().flatten(), dim=0
        ).item()
        if not (ck >= bound and cv >= bound):  # NaN fails too
            bad.append(f"block {j} ({ladder[lv]}): cosine K {ck:.4f} V {cv:.4f} < {bound}")
    return bad


def _near_number(msg: str, word: str) -> bool:
    """``word`` occurs in ``msg`` with a number within a few words of it."""
    for m in re.finditer(word, msg, flags=re.IGNORECASE):
        around = msg[max(0, m.start() - 40) : m.end() + 40]
        if re.search(r"\d", around):
            return True
    return False


def capacity_message_problems(msg: str) -> list[str]:
    return [
        f"the message does not give the {w} bytes"
        for w in ("live", "cached", "budget")
        if not _near_number(msg, w)
    ]


# -- room in the tiers ---------------------------------------------------------------------------


def live_places(bm: BlockManager, live: set[int]) -> dict[tuple[str, int, bool], int]:
    """How many of the ``live`` blocks lie in each (tier, level), pinned or not."""
    info = bm.core.block_info(np.array(sorted(live), dtype=np.uint32))
    places: dict[tuple[str, int, bool], int] = {}
    for tier, level, pinned in zip(info["tier"], info["level"], info["pinned"], strict=True):
        key = (Plan.TIERS[int(tier)], int(level), bool(pinned))
        places[key] = places.get(key, 0) + 1
    return places


def room_problem(bm: BlockManager, live: set[int], new_blocks: int) -> str | None:
    """Why the ``live`` blocks and ``new_blocks`` new ones cannot all lie in the manager's pools
    at once, or None when they can. Cached blocks do not count (an eviction takes them). New
    blocks go into the device's level-0 slots (K/V is written there), as do the pinned blocks
    (incomplete: written there too); every other live block may go to any tier, at its own
    level or a lower one (a lossy level cannot go back up), each pool holding as many blocks as
    it has slots. That is an assignment of blocks to pools with nested choices, possible
    exactly when, for each level l, the blocks that must lie at level l or lower are no more
    than the free slots of those levels (Hall's condition)."""
    free = dict(bm.slots)
    movable = [0] * len(bm.ladder)  # unpinned live blocks by level
    for (tier, level, pinned), n in live_places(bm, live).items():
        if pinned:
            free[tier, level] -= n
        else:
            movable[level] += n
    if new_blocks > free["device", 0]:
        return f"{new_blocks} new blocks, {free['device', 0]} free level-0 device slots"
    for level in range(len(bm.ladder)):
        slots = sum(n for (_, lv), n in free.items() if lv >= level)
        need = sum(movable[level:]) + (new_blocks if level == 0 else 0)
        if need > slots:
            return f"{need} blocks for levels >= {level}, {slots} slots there"
    return None


# -- the state machine ---------------------------------------------------------------------------

FAMILIES = {
    "fp16": [("fp16",), None],  # None: enable_compression=False, default ladder
    "int8": [("fp16", "int8")],
    "int4": [("fp16", "int8", "int4"), None],  # None: the default ladder (levels=3)
}


@st.composite
def configs(draw: st.DrawFn, family: str) -> dict[str, Any]:
    ladder = draw(st.sampled_from(FAMILIES[family]))
    cfg: dict[str, Any] = {
        "block_size": BS,
        "device_blocks": draw(st.integers(6, 24)),
        "recent_window": draw(st.integers(4, 8)),
        "sink_blocks": draw(st.integers(0, 1)),
        "policy": draw(st.sampled_from(["importance", "lru"])),
    }
    if ladder is not None:
        cfg["ladder"] = ladder
    elif family == "fp16":
        cfg["enable_compression"] = False
    host = draw(st.one_of(st.none(), st.integers(4, 32)))
    if host is not None:
        cfg["host_blocks"] = host
        if family != "fp16" and draw(st.booleans()):
            cfg["write_through"] = True
    disk = draw(st.one_of(st.none(), st.none(), st.integers(4, 16)))
    if disk is not None:
        cfg["disk_budget"] = disk * BLOCK_BYTES  # the directory is made per example
    evict = draw(st.sampled_from(["default", "default", True, False]))
    if evict != "default":
        cfg["evict_on_full"] = evict
    return cfg


#: Invalid appends: how the K/V (or the call) is broken, and the error it must raise.
BAD_APPENDS: dict[str, type[Exception]] = {
    "heads": InvalidArgumentError,
    "head_dim": InvalidArgumentError,
    "ndim_2": InvalidArgumentError,
    "ndim_4": InvalidArgumentError,
    "k_v_tokens": InvalidArgumentError,
    "k_v_heads": InvalidArgumentError,
    "dtype_both": InvalidArgumentError,
    "dtype_v": InvalidArgumentError,
    "device_meta": InvalidArgumentError,
    "nan_k": InvalidArgumentError,
    "inf_k": InvalidArgumentError,
    "neg_inf_k": InvalidArgumentError,
    "nan_v": InvalidArgumentError,
    "inf_v": InvalidArgumentError,
    "freed_seq": InvalidSequenceError,
    "unknown_seq": InvalidSequenceError,
    "layer_high": InvalidArgumentError,
    "layer_negative": InvalidArgumentError,
    "layer_bool": InvalidArgumentError,
    "layer_float": InvalidArgumentError,
    "budget": OutOfCapacityError,
}


class ManagerVsReference(RuleBasedStateMachine):
    """A BlockManager and the reference, driven by the same operations."""

    family = "int4"
    #: What the machine tries and checks; a driver may narrow them to look past a known failure.
    bad_appends: tuple[str, ...] = tuple(sorted(BAD_APPENDS))
    check_capacity_message = True
    try_requires_grad = True
    check_room = True
    try_fork = True

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.disk_dir: str | None = None
        self.refs: dict[int, Ref] = {}
        self.prompts: list[list[int]] = []
        self.freed: list[int] = []
        self.next_private = 1 << 31  # token ids of sequences without ids: never shared
        self.next_unique = 1000  # prompt ids never seen before (the shared ones are < 41)

    # ---- setup ----------------------------------------------------------------------------

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.cfg = data.draw(configs(self.family), label="config")
        extra = {}
        if "disk_budget" in self.cfg:
            self.disk_dir = tempfile.mkdtemp(prefix="kvtier-model-")
            extra["disk_path"] = self.disk_dir
        self.bm = BlockManager(
            KvtierConfig(**self.cfg, **extra), LAYERS, HEADS, DIM, torch.float16, "cpu"
        )
        # OutOfCapacityError while the live blocks fit is a bug, except where the user asked
        # to keep cached blocks rather than evict them.
        self.assert_room = self.check_room and self.cfg.get("evict_on_full", "default") is not False
        self.slots0 = self.bm.slots["device", 0]
        note(f"config {self.cfg}; ladder {self.bm.ladder}; slots {self.bm.slots}")

    # ---- helpers --------------------------------------------------------------------------

    @property
    def m(self) -> BlockManager:
        assert self.bm is not None
        return self.bm

    def ready(self) -> bool:
        return self.bm is not None

    def has_seqs(self) -> bool:
        return self.bm is not None and bool(self.refs)

    def some_seq(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.refs)), label="seq")

    def live_blocks(self) -> set[int]:
        core = self.m.core
        return {b for s in self.refs for b in core.sequence_blocks(s).tolist()}

    def room_for(self, new_blocks: int) -> str | None:
        """Whether the live blocks and ``new_blocks`` more fit in all the tiers together (None)
        or why not: :func:`room_problem` of the live blocks where they are now."""
        return room_problem(self.m, self.live_blocks(), new_blocks)

    def snapshot(self) -> dict[str, Any]:
        """Everything a failed call must leave as it was (gather not called: it records reads)."""
        bm, core = self.m, self.m.core
        st_ = bm.stats()
        seqs = {
            s: (
                [bm.num_tokens(s, layer) for layer in range(LAYERS)],
                core.sequence_blocks(s).tolist(),
                core.sequence_tokens(s),
            )
            for s in bm.sequences()
        }
        blocks = np.array(sorted(self.live_blocks()), dtype=np.uint32)
        info = core.block_info(blocks)
        cols = ("tier", "level", "slot", "refcount", "pinned", "position", "hash", "has_copy")
        where = {
            int(b): tuple(info[c][i].item() for c in cols) for i, b in enumerate(blocks.tolist())
        }
        pools = {
            key: pool.detach().clone().contiguous().view(torch.uint8)
            for key, pool in bm.pools.items()
        }
        return {
            "counters": dict(st_.counters),
            "pools": st_.pools,
            "sequences": st_.sequences,
            "tokens": st_.tokens,
            "held_bytes": st_.held_bytes,
            "seqs": seqs,
            "blocks": where,
            "pool_bytes": pools,
        }

    def assert_unchanged(self, what: str, before: dict[str, Any], exc: Exception) -> None:
        after = self.snapshot()
        problems = []
        cb, ca = before["counters"], after["counters"]
        if isinstance(exc, OutOfCapacityError):
            # The plan a full device makes to find room may be made and aborted, moving nothing:
            # its own bookkeeping may count, the moves and their bytes must not.
            cb = {k: v for k, v in cb.items() if k not in PLAN_BOOKKEEPING}
            ca = {k: v for k, v in ca.items() if k not in PLAN_BOOKKEEPING}
        changed = {k: (cb.get(k), ca.get(k)) for k in set(cb) | set(ca) if cb.get(k) != ca.get(k)}
        if changed:
            problems.append(f"counters changed (before, after): {changed}")
        for key in ("pools", "sequences", "tokens", "held_bytes", "seqs", "blocks"):
            if before[key] != after[key]:
                problems.append(f"{key} changed: {before[key]} -> {after[key]}")
        for key, b in before["pool_bytes"].items():
            if not torch.equal(b, after["pool_bytes"][key]):
                rows = (b != after["pool_bytes"][key]).reshape(b.shape[0], -1).any(1)
                problems.append(f"pool {key} bytes changed in slots {rows.nonzero().flatten()}")
        assert not problems, f"{what} raised {exc!r} and changed state: " + "; ".join(problems)

    def attempt(
        self,
        what: str,
        fn: Any,
        *,
        new_blocks: int = 0,
        expect: type[Exception] | None = None,
    ) -> tuple[bool, Any]:
        """Runs ``fn``: a failure must be a kvtier error (``expect`` if given) that changed
        nothing; OutOfCapacityError only when the live blocks plus ``new_blocks`` would not fit
        in all the tiers together (:meth:`room_for`). Returns (succeeded, result)."""
        live = len(self.live_blocks())
        no_room = self.room_for(new_blocks)
        before = self.snapshot()
        err: Exception | None = None
        try:
            result = fn()
        except Exception as exc:
            err = exc
        if err is None:
            if expect is not None:
                raise AssertionError(f"{what} succeeded; expected {expect.__name__}")
            return True, result
        if not isinstance(err, KvtierError):
            raise AssertionError(f"{what} raised a non-kvtier error {err!r}") from err
        # Input that is invalid and also would not fit may be refused for either reason.
        if expect is not None and not isinstance(err, (expect, OutOfCapacityError)):
            raise AssertionError(
                f"{what} raised {type(err).__name__} ({err}), expected {expect.__name__}"
            ) from err
        if isinstance(err, OutOfCapacityError):
            if self.assert_room and no_room is None:
                raise AssertionError(
                    f"{what} raised OutOfCapacityError though the live sequences fit in the "
                    f"tiers: {live} live blocks + {new_blocks} new, slots {self.m.slots}, "
                    f"live blocks by (tier, level, pinned) {live_places(self.m, self.live_blocks())} "
                    f"(evict_on_full={self.cfg.get('evict_on_full', 'default')}): {err}"
                ) from err
            problems = capacity_message_problems(str(err)) if self.check_capacity_message else []
            assert not problems, f"{what}: OutOfCapacityError message {err}: {problems}"
        self.assert_unchanged(what, before, err)
        note(f"{what} failed as it may: {type(err).__name__}: {err}")
        return False, None

    def blocks_to_grow(self, seq: int, end: int) -> int:
        """New blocks the sequence needs to hold ``end`` tokens."""
        have = len(self.m.core.sequence_blocks(seq))
        return max(0, -(-end // BS) - have)

    def check_gather(self, seq: int, layer: int) -> None:
        bm, ref = self.m, self.refs[seq]
        try:
            k, v = bm.gather(seq, layer)
        except BlockLostError as exc:  # a clear cause; wrong data never
            note(f"gather({seq}, {layer}) raised {exc!r}")
            return
        # Nothing else may fail: no store tier loses blocks here, and each sequence appends
        # every token it holds itself (a shared block's owner never lags behind it).
        n = ref.lengths[layer]
        assert tuple(k.shape) == (n, HEADS, DIM) and tuple(v.shape) == (n, HEADS, DIM), (
            f"gather({seq}, {layer}): shapes {list(k.shape)} {list(v.shape)}, {n} tokens expected"
        )
        assert k.dtype == torch.float16 and v.dtype == torch.float16
        assert not k.requires_grad and not v.requires_grad, "gather returns tensors with grad"
        blocks = bm.core.sequence_blocks(seq)[: -(-n // BS)]
        levels = bm.core.block_info(blocks)["level"].tolist()
        want_k, want_v = ref.kv(layer)
        bad = block_mismatches(k, v, want_k, want_v, layer, levels, bm.ladder)
        assert not bad, f"gather(seq {seq}, layer {layer}) returned wrong K/V: {bad}"

    # ---- K/V appends ------------------------------------------------------------------------

    def fresh_tokens(self, ref: Ref, n: int, data: st.DataObject) -> list[int]:
        if ref.ids:
            return data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n), label="ids")
        out = list(range(self.next_private, self.next_private + n))
        self.next_private += n
        return out

    def declare(self, seq: int, end: int, data: st.DataObject) -> bool:
        """Makes the sequence's tokens reach ``end``: ids declared with add_tokens for a sequence
        with ids, private tokens for one without. False: add_tokens failed (as it may)."""
        ref = self.refs[seq]
        n = end - len(ref.tokens)
        if n <= 0:
            return True
        new = self.fresh_tokens(ref, n, data)
        if ref.ids:
            ok, _ = self.attempt(
                f"add_tokens(seq {seq}, {n} ids)",
                lambda: self.m.add_tokens(seq, np.array(new, dtype=np.int64)),
                new_blocks=self.blocks_to_grow(seq, end),
            )
            if not ok:
                return False
        ref.extend(new)
        return True

    def append_valid(self, seq: int, layer: int, n: int, *, grad: bool = False) -> bool:
        """Appends the reference K/V of the next ``n`` tokens of ``layer`` (declared already)."""
        ref = self.refs[seq]
        start = ref.lengths[layer]
        end = start + n
        k, v = ref.kv(layer, start, end)
        if grad:
            k, v = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
        grow = self.blocks_to_grow(seq, end) if end > self.m.core.sequence_tokens(seq) else 0
        ok, _ = self.attempt(
            f"append(seq {seq}, layer {layer}, tokens {start}:{end}"
            f"{', requires_grad' if grad else ''})",
            lambda: self.m.append(seq, layer, k, v),
            new_blocks=grow,
        )
        if ok:
            ref.lengths[layer] = end
            assert self.m.num_tokens(seq, layer) == end
        return ok

    # ---- rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.ready() and len(self.refs) < MAX_SEQS)
    @rule(data=st.data(), with_ids=st.sampled_from([True, True, True, False]))
    def add_sequence(self, data: st.DataObject, with_ids: bool) -> None:
        bm = self.m
        if not with_ids:
            ok, seq = self.attempt("add_sequence()", bm.add_sequence)
            assert ok, "add_sequence() without ids failed"
            self.refs[seq] = Ref(ids=False)
            return
        prompt: list[int] = []
        if self.prompts and data.draw(st.booleans(), label="share a prefix"):
            earlier = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            prompt = earlier[: data.draw(st.integers(0, len(earlier)), label="prefix")]
        prompt += data.draw(st.lists(st.integers(0, 40), max_size=3 * BS), label="new ids")
        ok, seq = self.attempt(
            f"add_sequence({len(prompt)} ids)",
            lambda: bm.add_sequence(np.array(prompt, dtype=np.int64)),
            new_blocks=-(-len(prompt) // BS),
        )
        if not ok:
            return
        self.prompts.append(prompt)
        ref = Ref(ids=True)
        ref.extend(prompt)
        cached = [bm.num_tokens(seq, layer) for layer in range(LAYERS)]
        assert len(set(cached)) == 1 and cached[0] % BS == 0 and cached[0] <= len(prompt), (
            f"add_sequence: cached prefix per layer {cached} for a prompt of {len(prompt)}"
        )
        ref.lengths = cached
        self.refs[seq] = ref

    @precondition(lambda self: self.ready() and len(self.refs) < MAX_SEQS)
    @rule(blocks=st.integers(1, 3), extra=st.integers(0, BS - 1), decode=st.integers(0, 2))
    def request(self, blocks: int, extra: int, decode: int) -> None:
        """A whole short request with a prompt never seen before: prefill, a few decode steps,
        free. Many of them fill the tiers with cached blocks, which must make room for the
        next ones (a long run of these never runs out while the live sequences fit)."""
        n = blocks * BS + extra
        prompt = list(range(self.next_unique, self.next_unique + n))
        self.next_unique += n + decode
        ok, seq = self.attempt(
            f"add_sequence({n} new ids)",
            lambda: self.m.add_sequence(np.array(prompt, dtype=np.int64)),
            new_blocks=-(-n // BS),
        )
        if not ok:
            return
        ref = Ref(ids=True)
        ref.extend(prompt)
        assert self.m.num_tokens(seq) == 0, "a prompt never seen before had a cached prefix"
        self.refs[seq] = ref
        done = all(self.append_valid(seq, layer, n) for layer in range(LAYERS))
        for i in range(decode if done else 0):
            token = [prompt[-1] + 1 + i]
            ok, _ = self.attempt(
                f"add_tokens(seq {seq}, 1 id)",
                lambda t=token: self.m.add_tokens(seq, np.array(t, dtype=np.int64)),
                new_blocks=self.blocks_to_grow(seq, len(ref.tokens) + 1),
            )
            if not ok:
                break
            ref.extend(token)
            if not all(self.append_valid(seq, layer, 1) for layer in range(LAYERS)):
                break
        for layer in range(LAYERS):
            self.check_gather(seq, layer)
        ok, _ = self.attempt(f"free({seq})", lambda: self.m.free(seq))
        assert ok, f"free({seq}) failed"
        del self.refs[seq]
        self.freed.append(seq)

    @precondition(has_seqs)
    @rule(
        data=st.data(),
        n=st.integers(1, 2 * BS),
        all_layers=st.booleans(),
        grad=st.sampled_from([False, False, False, True]),
    )
    def append(self, data: st.DataObject, n: int, all_layers: bool, grad: bool) -> None:
        seq = self.some_seq(data)
        ref = self.refs[seq]
        grad = grad and self.try_requires_grad
        layers = list(range(LAYERS)) if all_layers else [data.draw(st.integers(0, LAYERS - 1))]
        if not self.declare(seq, max(ref.lengths[layer] for layer in layers) + n, data):
            return
        for layer in layers:
            if not self.append_valid(seq, layer, n, grad=grad):
                return

    @precondition(has_seqs)
    @rule(data=st.data(), retry=st.booleans())
    def append_invalid(self, data: st.DataObject, retry: bool) -> None:
        """A broken append must fail, change nothing, and not keep a valid retry out."""
        how = data.draw(st.sampled_from(self.bad_appends), label="how")
        seq = self.some_seq(data)
        ref = self.refs[seq]
        layer = data.draw(st.integers(0, LAYERS - 1), label="layer")
        n = data.draw(st.integers(1, BS + 2), label="tokens")
        start = ref.lengths[layer]
        if how == "budget":
            # Up to the end of one more new block than the device has level-0 slots (new blocks
            # are pinned there until written): this can never fit.
            have = len(self.m.core.sequence_blocks(seq))
            n = (have + self.slots0 + 1) * BS - start
        end = start + n
        expect = BAD_APPENDS[how]
        bm = self.m
        if how == "budget" and ref.ids:
            # The ids come first; declaring that many must fail the same way.
            new = self.fresh_tokens(ref, end - len(ref.tokens), data)
            self.attempt(
                f"add_tokens(seq {seq}, {len(new)} ids: more than the device holds)",
                lambda: bm.add_tokens(seq, np.array(new, dtype=np.int64)),
                expect=expect,
                new_blocks=self.blocks_to_grow(seq, end),
            )
            return
        if how != "budget" and not self.declare(seq, end, data):
            return
        if how == "budget":
            private = Ref(ids=False, tokens=[], hashes=[], lengths=[0] * LAYERS)
            private.extend(self.fresh_tokens(private, n, data))
            private.lengths[layer] = n
            k, v = private.kv(layer)
        else:
            k, v = ref.kv(layer, start, end)
        target_seq, target_layer = seq, layer
        k, v = k.clone(), v.clone()
        i = data.draw(st.integers(0, n - 1), label="token")
        h, d = data.draw(st.integers(0, HEADS - 1)), data.draw(st.integers(0, DIM - 1))
        if how == "heads":
            k, v = k[:, :1], v[:, :1]
        elif how == "head_dim":
            k, v = k[..., : DIM // 2], v[..., : DIM // 2]
        elif how == "ndim_2":
            k, v = k[:, 0], v[:, 0]
        elif how == "ndim_4":
            k, v = k[None], v[None]
        elif how == "k_v_tokens":
            v = torch.cat([v, v[:1]])
        elif how == "k_v_heads":
            v = v[:, :1]
        elif how == "dtype_both":
            k, v = k.float(), v.float()
        elif how == "dtype_v":
            v = v.to(torch.bfloat16)
        elif how == "device_meta":
            k, v = k.to("meta"), v.to("meta")
        elif how in ("nan_k", "inf_k", "neg_inf_k", "nan_v", "inf_v"):
            bad = {"nan": math.nan, "inf": math.inf, "neg": -math.inf}[how.split("_")[0]]
            (k if how.endswith("_k") else v)[i, h, d] = bad
        elif how == "freed_seq":
            if not self.freed:
                return
            target_seq = data.draw(st.sampled_from(self.freed), label="freed seq")
        elif how == "unknown_seq":
            target_seq = data.draw(st.sampled_from([10**6, 2**32 + 5, -1]), label="unknown")
        elif how == "layer_high":
            target_layer = LAYERS
        elif how == "layer_negative":
            target_layer = -1
        elif how == "layer_bool":
            target_layer = True
        elif how == "layer_float":
            target_layer = 0.0
        self.attempt(
            f"append({how}: seq {target_seq}, layer {target_layer!r}, "
            f"k {list(k.shape)} {k.dtype} {k.device}, v {list(v.shape)} {v.dtype} {v.device})",
            lambda: bm.append(target_seq, target_layer, k, v),
            expect=expect,
            new_blocks=self.blocks_to_grow(seq, end) if end > bm.core.sequence_tokens(seq) else 0,
        )
        # The same tokens with valid K/V: stored, and gathered as they are (an
        # OutOfCapacityError is judged inside).
        if retry and how != "budget" and self.append_valid(seq, layer, n):
            self.check_gather(seq, layer)

    @precondition(has_seqs)
    @rule(data=st.data())
    def gather(self, data: st.DataObject) -> None:
        seq = self.some_seq(data)
        self.check_gather(seq, data.draw(st.integers(0, LAYERS - 1), label="layer"))

    @precondition(ready)
    @rule(data=st.data(), how=st.sampled_from(["freed_seq", "unknown_seq", "layer"]))
    def gather_invalid(self, data: st.DataObject, how: str) -> None:
        if how == "freed_seq" and not self.freed:
            return
        if how == "layer" and not self.refs:
            return
        seq = {
            "freed_seq": lambda: data.draw(st.sampled_from(self.freed)),
            "unknown_seq": lambda: 10**6,
            "layer": lambda: self.some_seq(data),
        }[how]()
        layer = data.draw(st.sampled_from([LAYERS, -1])) if how == "layer" else 0
        expect = InvalidArgumentError if how == "layer" else InvalidSequenceError
        self.attempt(
            f"gather({how}: {seq}, {layer})", lambda: self.m.gather(seq, layer), expect=expect
        )

    @precondition(has_seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if len(self.refs) >= MAX_SEQS or not self.try_fork:
            return
        seq = self.some_seq(data)
        partial = 1 if self.m.core.sequence_tokens(seq) % BS else 0
        ok, child = self.attempt(f"fork({seq})", lambda: self.m.fork(seq), new_blocks=partial)
        if ok:
            assert child not in self.refs
            self.refs[child] = self.refs[seq].copy()
            for layer in range(LAYERS):
                assert self.m.num_tokens(child, layer) == self.refs[child].lengths[layer]

    @precondition(has_seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.some_seq(data)
        ok, _ = self.attempt(f"free({seq})", lambda: self.m.free(seq))
        assert ok, f"free({seq}) failed"
        del self.refs[seq]
        self.freed.append(seq)

    @precondition(ready)
    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([*self.freed, 10**6]), label="seq")
        self.attempt(f"free({seq}) again", lambda: self.m.free(seq), expect=InvalidSequenceError)

    @precondition(ready)
    @rule(times=st.integers(1, 3))
    def step(self, times: int) -> None:
        for _ in range(times):
            self.m.step()

    @precondition(has_seqs)
    @rule(data=st.data(), queries=st.integers(1, 3))
    def record_attention(self, data: st.DataObject, queries: int) -> None:
        seq = self.some_seq(data)
        layer = data.draw(st.integers(0, LAYERS - 1), label="layer")
        n = self.refs[seq].lengths[layer]
        if n == 0:
            return
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        w = torch.softmax(torch.randn(HEADS, queries, n, generator=g) * 3, dim=-1)
        ok, _ = self.attempt(
            f"record_attention(seq {seq}, layer {layer}, {list(w.shape)})",
            lambda: self.m.record_attention(seq, layer, w),
        )
        assert ok, "a valid record_attention failed"

    @precondition(has_seqs)
    @rule(data=st.data(), how=st.sampled_from(["length", "scalar", "layer", "seq"]))
    def record_attention_invalid(self, data: st.DataObject, how: str) -> None:
        seq = self.some_seq(data)
        layer = data.draw(st.integers(0, LAYERS - 1), label="layer")
        n = self.refs[seq].lengths[layer]
        w = torch.full((HEADS, 1, n + 1), 1.0 / (n + 1))
        expect: type[Exception] = InvalidArgumentError
        if how == "scalar":
            w = torch.tensor(0.5)
        elif how == "layer":
            w, layer = torch.full((HEADS, 1, max(n, 1)), 0.1), LAYERS
        elif how == "seq":
            seq, expect = 10**6, InvalidSequenceError
        self.attempt(
            f"record_attention({how}: seq {seq}, layer {layer}, {list(w.shape)})",
            lambda: self.m.record_attention(seq, layer, w),
            expect=expect,
        )

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def gathers_match_the_reference(self) -> None:
        if self.bm is None:
            return
        bm = self.bm
        assert sorted(bm.sequences()) == sorted(self.refs)
        for pool in bm.pools.values():
            assert not pool.requires_grad, "a pool takes part in autograd (K/V stored undetached)"
        for seq, ref in self.refs.items():
            for layer in range(LAYERS):
                assert bm.num_tokens(seq, layer) == ref.lengths[layer], (
                    f"seq {seq} layer {layer}: {bm.num_tokens(seq, layer)} tokens, "
                    f"{ref.lengths[layer]} appended"
                )
                self.check_gather(seq, layer)

    def teardown(self) -> None:
        if self.bm is None:
            return
        try:
            for seq in list(self.refs):
                self.bm.free(seq)
            self.bm.step()
            assert self.bm.stats().sequences == 0
        finally:
            self.bm.close()
            if self.disk_dir is not None:
                shutil.rmtree(self.disk_dir, ignore_errors=True)


class Fp16Only(ManagerVsReference):
    """fp16-only ladder: every gather bit-exact."""

    family = "fp16"


class Int8Ladder(ManagerVsReference):
    family = "int8"


class Int4Ladder(ManagerVsReference):
    family = "int4"


MACHINES = [Fp16Only, Int8Ladder, Int4Ladder]
HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def _settings(examples_var: str, examples: int, steps: int) -> settings:
    return settings(
        max_examples=int(os.environ.get(examples_var, str(examples))),
        stateful_step_count=steps,
        deadline=None,
        derandomize=False,
        suppress_health_check=HEALTH,
    )


FAST = _settings("KVTIER_MODEL_EXAMPLES", 40, 40)
SLOW = _settings("KVTIER_MODEL_EXAMPLES_SLOW", 500, 50)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.family)
def test_manager_matches_the_reference(machine: type[ManagerVsReference]) -> None:
    run_state_machine_as_test(machine, settings=FAST)


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.family)
def test_manager_matches_the_reference_long(machine: type[ManagerVsReference]) -> None:
    run_state_machine_as_test(machine, settings=SLOW)


# -- a long run of requests -------------------------------------------------------------------------

LONG_RUN_CONFIGS = {
    "fp16": {"enable_compression": False},
    "fp16+host": {"enable_compression": False, "host_blocks": 4},
    "int4": {},
    "int4+host": {"host_blocks": 8},
    "int4+write_through": {"host_blocks": 8, "write_through": True},
}


def gather_problems(bm: BlockManager, seq: int, ref: Ref) -> list[str]:
    out = []
    for layer in range(LAYERS):
        k, v = bm.gather(seq, layer)
        n = ref.lengths[layer]
        levels = bm.core.block_info(bm.core.sequence_blocks(seq)[: -(-n // BS)])["level"]
        want_k, want_v = ref.kv(layer)
        out += block_mismatches(k, v, want_k, want_v, layer, levels.tolist(), bm.ladder)
    return out


@pytest.mark.parametrize("name", list(LONG_RUN_CONFIGS))
def test_a_long_run_of_distinct_prompts_never_runs_out(name: str) -> None:
    """Default config, an 8-block device: 150 requests whose two-block prompts were never seen
    before (add_sequence, append every layer, gather, free). One request is live at a time, so
    the blocks the freed ones left cached must be reclaimed (after demotion/offload had their
    chance) for the next: OutOfCapacityError is a bug. The newest prompt is still cached."""
    cfg = LONG_RUN_CONFIGS[name]
    bm = BlockManager(
        KvtierConfig(block_size=BS, device_blocks=8, recent_window=4, **cfg),
        LAYERS,
        HEADS,
        DIM,
        torch.float16,
        "cpu",
    )
    n = 2 * BS
    for i in range(150):
        ids = np.arange(n) + 1000 + n * i
        try:
            seq = bm.add_sequence(ids)
            ref = Ref(ids=True)
            ref.extend(ids.tolist())
            for layer in range(LAYERS):
                k, v = ref.kv(layer, 0, n)
                bm.append(seq, layer, k, v)
                ref.lengths[layer] = n
        except OutOfCapacityError as exc:
            pytest.fail(f"request {i}: {exc!r} with 1 live sequence of 2 blocks ({bm.slots})")
        assert not gather_problems(bm, seq, ref), (i, gather_problems(bm, seq, ref))
        bm.free(seq)
    assert bm.stats().counters["evictions"] > 0
    assert bm.lookup(ids) == n, "the newest prompt is no longer cached"


# -- writes that fit only by offloading ------------------------------------------------------------

#: An 8-block device (level-0 slots for 4 to 8 of them) with host and disk tiers behind it:
#: ``disk`` in blocks.
OFFLOAD_CONFIGS = {
    "fp16+host": {"enable_compression": False, "host_blocks": 8},
    "fp16+disk": {"enable_compression": False, "disk": 8},
    "fp16+host+disk": {"enable_compression": False, "host_blocks": 6, "disk": 6},
    "int4+host": {"host_blocks": 8},
    "int4+host+disk": {"host_blocks": 6, "disk": 6},
    "int4+host+write_through": {"host_blocks": 12, "write_through": True},
}


@pytest.mark.parametrize("name", list(OFFLOAD_CONFIGS))
def test_writes_that_fit_only_by_offloading_succeed(name: str, tmp_path: Any) -> None:
    """Three live sequences grow a whole block at a time (every layer, so each block is
    complete and may move) past what the device holds: each write succeeds while the live
    blocks fit in all the tiers together (:func:`room_problem`), blocks going to the host and
    disk tiers to make room, and only then is one refused with OutOfCapacityError. Every
    sequence then gathers its own K/V."""
    cfg = dict(OFFLOAD_CONFIGS[name])
    if "disk" in cfg:
        cfg.update(disk_budget=cfg.pop("disk") * BLOCK_BYTES, disk_path=str(tmp_path / "kv"))
    bm = BlockManager(
        KvtierConfig(block_size=BS, device_blocks=8, recent_window=BS, **cfg),
        LAYERS,
        HEADS,
        DIM,
        torch.float16,
        "cpu",
    )
    try:
        refs = {bm.add_sequence(): Ref(ids=False) for _ in range(3)}
        device_slots = sum(n for (tier, _), n in bm.slots.items() if tier == "device")
        refused = None
        for i in range(200):
            seq = list(refs)[i % len(refs)]
            live = {b for s in refs for b in bm.core.sequence_blocks(s).tolist()}
            problem = room_problem(bm, live, 1)
            ref = refs[seq]
            end = len(ref.tokens) + BS
            ref.extend(list(range(10_000 * (seq + 1) + len(ref.tokens), 10_000 * (seq + 1) + end)))
            refusal: OutOfCapacityError | None = None
            try:
                for layer in range(LAYERS):
                    k, v = ref.kv(layer, ref.lengths[layer], end)
                    bm.append(seq, layer, k, v)
                    ref.lengths[layer] = end
            except OutOfCapacityError as exc:
                refusal = exc
            if refusal is not None:
                assert problem is not None, (
                    f"block {i}: refused though the live blocks fit in the tiers (slots "
                    f"{bm.slots}, live {live_places(bm, live)}): {refusal}"
                )
                refused = i
                break
            assert problem is None, f"block {i} was written though {problem}"
        assert refused is not None, "the tiers never filled"
        held = {b for s in refs for b in bm.core.sequence_blocks(s).tolist()}
        assert len(held) > device_slots, (
            f"{len(held)} live blocks, {device_slots} device slots: nothing had to be offloaded"
        )
        assert bm.get_compression_stats()["offloads"] > 0
        for seq, ref in refs.items():
            assert not gather_problems(bm, seq, ref), (seq, gather_problems(bm, seq, ref))
    finally:
        bm.close()


# -- threads ----------------------------------------------------------------------------------------

#: Soak configs: an exact one whose blocks travel to the host and back, and a compressed one.
SOAK_CONFIGS = {
    "fp16+host": {"enable_compression": False, "device_blocks": 120, "host_blocks": 64},
    "int4": {"device_blocks": 240},
}
#: Per writer at most a sequence and its fork of up to this many tokens: 3 writers need
#: 3 * 2 * 10 = 60 blocks (+ a partial block per fork), within the 120 level-0 slots of both.
SOAK_TOKENS = 9 * BS
SYSTEM_PROMPT = list(range(100, 100 + 3 * BS + 1))


def soak(config: dict[str, Any], seconds: float, writers: int = 3) -> dict[str, int]:
    bm = BlockManager(
        KvtierConfig(block_size=BS, recent_window=8, **config),
        LAYERS,
        HEADS,
        DIM,
        torch.float16,
        "cpu",
    )
    assert bm.slots["device", 0] >= 2 * writers * (SOAK_TOKENS // BS + 1)
    errors: list[str] = []
    counts = {"gathers": 0, "mismatches": 0, "sequences": 0, "forks": 0}
    count_lock = threading.Lock()
    stop = threading.Event()

    def check(seq: int, ref: Ref, layer: int) -> None:
        k, v = bm.gather(seq, layer)
        n = ref.lengths[layer]
        want_k, want_v = ref.kv(layer)
        assert tuple(k.shape) == (n, HEADS, DIM), (seq, layer, list(k.shape), n)
        # A block's level may change between the gather and any query of it: every block must
        # be within the bound of the ladder's last level (an exact one is), never another
        # block's K/V or garbage; on an fp16-only ladder, bit-exact.
        levels = [len(bm.ladder) - 1] * -(-n // BS)
        bad = block_mismatches(k, v, want_k, want_v, layer, levels, bm.ladder)
        with count_lock:
            counts["gathers"] += 1
            if bad:
                counts["mismatches"] += 1
                errors.append(f"gather(seq {seq}, layer {layer}) wrong: {bad}")

    def grow(seq: int, ref: Ref, rng: random.Random, target: int) -> None:
        while max(ref.lengths) < target and not stop.is_set():
            n = min(rng.randint(1, 2 * BS), target - max(ref.lengths))
            end = max(ref.lengths) + n
            if end > len(ref.tokens):
                new = [rng.randint(0, 40) for _ in range(end - len(ref.tokens))]
                bm.add_tokens(seq, np.array(new, dtype=np.int64))
                ref.extend(new)
            for layer in range(LAYERS):
                start = ref.lengths[layer]
                k, v = ref.kv(layer, start, end)
                bm.append(seq, layer, k, v)
                ref.lengths[layer] = end
                check(seq, ref, layer)

    def writer(w: int) -> None:
        rng = random.Random(1000 + w)
        try:
            while not stop.is_set():
                prompt = SYSTEM_PROMPT[: rng.randint(0, len(SYSTEM_PROMPT))]
                prompt += [rng.randint(0, 40) for _ in range(rng.randint(0, 2 * BS))]
                seq = bm.add_sequence(np.array(prompt, dtype=np.int64))
                ref = Ref(ids=True)
                ref.extend(prompt)
                ref.lengths = [bm.num_tokens(seq, layer) for layer in range(LAYERS)]
                for layer in range(LAYERS):
                    check(seq, ref, layer)
                grow(seq, ref, rng, rng.randint(len(prompt), SOAK_TOKENS - BS))
                child, child_ref = None, None
                if rng.random() < 0.5:
                    child = bm.fork(seq)
                    child_ref = ref.copy()
                    grow(child, child_ref, rng, SOAK_TOKENS)
                    grow(seq, ref, rng, SOAK_TOKENS)
                    for layer in range(LAYERS):
                        check(seq, ref, layer)
                    with count_lock:
                        counts["forks"] += 1
                bm.free(seq)
                if child is not None and child_ref is not None:
                    for layer in range(LAYERS):
                        check(child, child_ref, layer)
                    bm.free(child)
                with count_lock:
                    counts["sequences"] += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(f"writer {w}: {exc!r}")
            stop.set()

    def stepper() -> None:
        try:
            while not stop.is_set():
                bm.step()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(f"stepper: {exc!r}")
            stop.set()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads.append(threading.Thread(target=stepper))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that races show
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, f"{len(errors)} error(s), first: {errors[:5]}; {counts}"
    assert counts["mismatches"] == 0
    assert counts["sequences"] > 0 and counts["gathers"] > 0, counts
    stats = bm.stats().counters
    return {**counts, **{k: stats.get(k, 0) for k in ("demotions", "offloads", "fetches")}}


@pytest.mark.parametrize("config", list(SOAK_CONFIGS))
def test_writers_and_a_stepper_never_see_wrong_kv_briefly(config: str) -> None:
    soak(SOAK_CONFIGS[config], seconds=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(SOAK_CONFIGS))
def test_writers_and_a_stepper_never_see_wrong_kv(config: str) -> None:
    counts = soak(SOAK_CONFIGS[config], seconds=float(os.environ.get("KVTIER_SOAK_S", "20")))
    print(config, counts)
