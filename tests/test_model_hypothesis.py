"""Random operation sequences against the Rust core and the plain-Python model of its rules.

:class:`kvtier.reference.core.ModelCore` implements the core's rules for one device tier, prefix trees
included (``prefix_aware`` on and off). Hypothesis drives both with the same operations —
sequences (append by hash and by tokens, fork, free, release), ``forget``, released chains
(``release_cached`` by hashes and by tokens), statistics, pins, plans (committed, aborted or left
pending, and blocks shared, extended, pinned or orphaned while a plan evicts them), lookups,
budget changes, and bad calls — with small budgets so that eviction, demotion and drops happen,
and after every step compares everything a user can observe: sequences, every block's
tier/level/refcount/pin/position/hash/score/indexed/parent/released, pool usage,
reclaimable blocks per pool, counters, the step clock and each plan's moves. Slot numbers are not
compared (the model does not assign them); they are checked for uniqueness instead.

Invariants checked on the core alone, whatever the model says: used <= capacity per pool; pool
bytes add up to the tier's bytes; no slot held by two blocks (nor reserved by a plan for a block
while another holds it); no stranded block (every indexed block's parent chain reaches a root
through indexed blocks, and a root sits at position 0 unless the pending plan evicts it); a
committed plan leaves the tier within its budget; pinned blocks never appear in a plan and no
block appears twice; a failing call raises a kvtier exception and changes nothing; freeing every
sequence and evicting empties the core.

The deterministic tests at the end pin down the rules of prefix trees (leaf-first eviction, a
parked eviction cancelled by a new child, forget and drops taking descendants, the eviction key
of ``importance``) on both kinds of core, and the core bugs this machine and its model found
(eviction of a block shared or pinned while the plan was pending; an append that evicted and
then failed; drop levels never reached; a block linked under itself when an append repeats
the hash its sequence ended on), fixed since.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier
from kvtier.reference.core import KINDS, POLICIES, ModelCore, ModelPlan

NO_SLOT = kvtier.Plan.NO_SLOT
NO_TIER = kvtier.Plan.NO_TIER
EVICT = KINDS.index("evict")


#: f32-exact statistic values (the core stores f32).
VALUES = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0, 7.75])
#: Hashes and tokens from small pools, so that prefixes are shared often.
HASHES = st.lists(st.integers(1, 16), max_size=6)
TOKENS = st.lists(st.integers(0, 2), max_size=14)
#: Hashes seldom indexed yet: blocks appended after a shared one are new, its children.
NEW_HASHES = st.lists(st.integers(201, 216), min_size=1, max_size=3)
#: Sequence salts: none or two tenants (same tokens, apart); an empty salt is refused.
SALTS = st.sampled_from([None, "a", "tenant-b"])
ANY_SALT = st.one_of(SALTS, st.just(""))
#: Requests served before the rules start: (hashes, tokens, by tokens?, finished?).
Request = tuple[list[int], list[int], bool, bool]
WARM_UP = st.lists(st.tuples(HASHES, TOKENS, st.booleans(), st.booleans()), max_size=6)
#: What may happen to a block while a plan that evicts it is pending (see ``_disturb``).
DISTURBANCES = st.sampled_from(["share", "extend", "child", "pin", "orphan"])
BUDGETS = st.one_of(st.none(), st.integers(0, 40), st.integers(40, 240), st.integers(80, 240))


LADDERS = [[8], [8, 4], [8, 4, 2], [8, 4, 2, 0], [8, 4, 0], [8, 8, 3]]


@st.composite
def configs(draw: st.DrawFn, kind: str = "any") -> dict[str, Any]:
    """Core arguments. ``any``: everything varies; ``split``: live sequences with the rank split
    (ladders of 3+ levels, roomy budget); ``cache``: trace-replay style, a tight budget that
    evicts and demotes under pressure."""
    one = draw  # readability: one(st.sampled_from(...))
    split, cache = kind == "split", kind == "cache"
    if split:
        ladder = one(st.sampled_from([[8, 4, 2], [8, 4, 2, 0], [8, 8, 3], [8, 4]]))
        budget = one(st.one_of(st.none(), st.integers(120, 400)))
    elif cache:
        ladder = one(st.sampled_from(LADDERS))
        budget = one(st.integers(48, 200))
    else:
        ladder = one(st.sampled_from(LADDERS))
        budget = one(BUDGETS)
    cfg: dict[str, Any] = {
        "level_bytes": ladder,
        "tiers": [("device", budget)],
        "block_size": one(st.sampled_from([1, 2] if split else [2, 4] if cache else [1, 2, 4])),
        "policy": one(st.sampled_from(POLICIES)),
        "enable_compression": True if split else one(st.sampled_from([True, True, False])),
        "pressure_only": False if split else cache or one(st.sampled_from([False, False, True])),
        "compression_ratio": one(st.sampled_from([0.0, 0.3, 0.5, 0.5, 1.0])),
        # Trace replay: 512-token blocks, a 128-token window: the window is under one block.
        "recent_window": one(st.sampled_from([0, 2] if split or cache else [0, 2, 4, 8])),
        "sink_blocks": one(st.sampled_from([0, 0, 1] if cache else [0, 0, 1, 2])),
        "keep_leaves": one(st.sampled_from([0, 1, 1, 2])),
        "weights": one(st.sampled_from([(0.4, 0.4, 0.2), (1.0, 0.0, 0.0), (0.0, 0.3, 0.7)])),
        "headroom": one(st.sampled_from([0.0, 0.1, 0.3])),
        "hysteresis": one(st.sampled_from([0.0, 0.0, 0.1, 0.25])),
        "max_move_bytes": one(st.sampled_from([None, None, 0, 8, 20])),
        "decay": one(st.sampled_from([0.9, 0.9, 0.5, 1.0])),
        "attention_ema": one(st.sampled_from([0.5, 1.0, 0.3])),
        "scissorhands_window": one(st.sampled_from([1, 4, 8])),
        "evict_on_full": one(st.sampled_from([True, True, False]) if cache else st.booleans()),
        "prefix_aware": one(st.booleans()),
    }
    if 0 in ladder:  # a drop level: the rank split may also drop the lowest ranked blocks
        cfg["drop_ratio"] = one(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    if one(st.integers(0, 2 if cache or split else 4)) == 0:
        # Few level-0 slots: writes make room for slots, not bytes (under the rank split too,
        # where a cached block's subtree may sit at lower levels).
        cfg["pool_slots"] = [("device", 0, one(st.integers(2, 8) if split else st.integers(1, 8)))]
    return cfg


class CoreVsModel(RuleBasedStateMachine):
    core: kvtier.Core
    model: ModelCore

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.pending: tuple[kvtier.Plan, ModelPlan] | None = None
        self.budget_at_plan: int | None = None
        self.last_err: Exception | None = None

    # ---- helpers -------------------------------------------------------------------------

    def budget(self) -> int | None:
        return self.model.budget

    def core_state(self, with_slots: bool = False) -> dict[str, Any]:
        c = self.core
        ids = self.model.live_blocks()
        info = c.block_info(np.array(ids, dtype=np.uint32))  # raises if one is not live
        cols = [
            info[k].tolist()
            for k in (
                "tier",
                "level",
                "refcount",
                "pinned",
                "position",
                "hash",
                "has_copy",
                "score",
                "indexed",
                "parent",
                "released",
            )
        ]
        state: dict[str, Any] = {
            "seqs": {
                s: (tuple(c.sequence_blocks(s).tolist()), c.sequence_tokens(s))
                for s in c.sequences()
            },
            "blocks": dict(zip(ids, zip(*cols, strict=True), strict=True)),
            "usage": c.usage(),
            "reclaimable": c.reclaimable(),
            "tier_bytes": c.tier_bytes(),
            "counters": dict(c.counters()),
            "step": c.step,
        }
        if with_slots:
            state["slots"] = dict(
                zip(
                    ids,
                    zip(info["level"].tolist(), info["slot"].tolist(), strict=True),
                    strict=True,
                )
            )
        return state

    def model_state(self) -> dict[str, Any]:
        m = self.model

        def extra(b: int) -> tuple[int, bool, float, bool, int, bool]:
            # hash, has_copy, score, indexed, parent, released
            return (
                m.block_hash(b),
                False,
                m.score(b),
                m.indexed[b],
                m.block_parent(b),
                m.released[b],
            )

        return {
            "seqs": {s: (tuple(m.seqs[s].blocks), m.seqs[s].tokens) for s in m.sequences()},
            "blocks": {
                b: (0, m.level[b], m.refcount[b], m.pins[b] > 0, m.position[b], *extra(b))
                for b in m.live_blocks()
            },
            "usage": m.usage(),
            "reclaimable": m.reclaimable(),
            "tier_bytes": [("device", m.tier_bytes)],
            "counters": m.counters_dict(),
            "step": m.step,
        }

    def both(self, name: str, *args: Any) -> tuple[Any, Any]:
        """Calls ``name`` on both; they must agree on raising, and a raise changes nothing."""
        before = self.core_state(with_slots=True)
        core_err = model_err = None
        result: Any = None
        expected: Any = None
        try:
            result = getattr(self.core, name)(*args)
        except kvtier.KvtierError as e:  # anything else fails the test: not a kvtier error
            core_err = e
        try:
            expected = getattr(self.model, name)(
                *[a.tolist() if hasattr(a, "tolist") else a for a in args]
            )
        except kvtier.KvtierError as e:
            model_err = e
        assert type(core_err) is type(model_err), (name, args, core_err, model_err)
        self.last_err = core_err
        if core_err is not None:
            assert self.core_state(with_slots=True) == before, (
                f"{name} raised {core_err!r} and changed state"
            )
        return result, expected

    def some_seq(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(self.model.sequences()))

    def some_blocks(self, data: st.DataObject, max_size: int = 6) -> list[int]:
        return data.draw(st.lists(st.sampled_from(self.model.live_blocks()), max_size=max_size))

    def has_seqs(self) -> bool:
        return self.ready and bool(self.model.seqs)

    def has_blocks(self) -> bool:
        return self.ready and bool(self.model.live_blocks())

    # ---- rules ---------------------------------------------------------------------------

    @initialize(cfg=configs(), warm=WARM_UP)
    def setup(self, cfg: dict[str, Any], warm: list[Request]) -> None:
        self.start(cfg, warm)

    def start(self, cfg: dict[str, Any], warm: list[Request]) -> None:
        """Both cores with the same config, and a few requests already served (some still
        running, some finished with their blocks cached): most bugs need some state."""
        self.core = kvtier.Core(**cfg)
        self.model = ModelCore(**cfg)
        self.ready = True
        for hashes, tokens, by_tokens, finished in warm:
            seq = self._request(hashes, tokens, by_tokens)
            if finished:
                self.both("free_sequence", seq)

    @rule(salt=ANY_SALT)
    def add_sequence(self, salt: str | None) -> None:
        got, want = self.both("add_sequence", salt)
        assert got == want

    def _room_check(self, before_bytes: int, err: bool) -> None:
        budget = self.budget()
        if not err and budget is not None and before_bytes <= budget:
            assert self.model.tier_bytes <= budget, "an append went over the device budget"

    def _append_blocks(self, seq: int, hashes: list[int]) -> None:
        before = self.model.tier_bytes
        got, want = self.both("append_blocks", seq, np.array(hashes, dtype=np.uint64))
        if got is not None:
            assert (got[0].tolist(), got[1].tolist()) == want
        self._room_check(before, got is None)

    def _append_tokens(self, seq: int, tokens: list[int]) -> None:
        before = self.model.tier_bytes
        got, want = self.both("append_tokens", seq, np.array(tokens, dtype=np.uint32))
        if got is not None:
            assert (got[0].tolist(), got[1].tolist()) == want
        self._room_check(before, got is None)

    @rule(hashes=HASHES, tokens=TOKENS, by_tokens=st.booleans(), salt=SALTS)
    def new_request(
        self, hashes: list[int], tokens: list[int], by_tokens: bool, salt: str | None
    ) -> None:
        self._request(hashes, tokens, by_tokens, salt)

    def _request(
        self, hashes: list[int], tokens: list[int], by_tokens: bool, salt: str | None = None
    ) -> int:
        seq, _ = self.both("add_sequence", salt)
        if by_tokens:
            self._append_tokens(seq, tokens)
        else:
            self._append_blocks(seq, hashes)
        return int(seq)

    @precondition(has_seqs)
    @rule(data=st.data(), hashes=HASHES)
    def append_blocks(self, data: st.DataObject, hashes: list[int]) -> None:
        self._append_blocks(self.some_seq(data), hashes)

    @precondition(has_seqs)
    @rule(data=st.data(), tokens=TOKENS)
    def append_tokens(self, data: st.DataObject, tokens: list[int]) -> None:
        self._append_tokens(self.some_seq(data), tokens)

    @precondition(has_seqs)
    @rule(hashes=HASHES, tokens=TOKENS)
    def grow_longest(self, hashes: list[int], tokens: list[int]) -> None:
        """Makes long sequences (beyond the sink and recent window) common."""
        m = self.model
        seq = max(m.sequences(), key=lambda s: (len(m.seqs[s].blocks), s))
        if m.seqs[seq].tokens % m.block_size:
            self._append_tokens(seq, tokens)
        else:
            self._append_blocks(seq, [h + 100 * len(m.seqs[seq].blocks) for h in hashes])

    @precondition(has_seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        before = self.model.tier_bytes
        got, want = self.both("fork", self.some_seq(data))
        assert got == want
        self._room_check(before, got is None)

    @precondition(has_seqs)
    @rule(data=st.data())
    def free_sequence(self, data: st.DataObject) -> None:
        self.both("free_sequence", self.some_seq(data))

    @precondition(has_seqs)
    @rule(data=st.data(), free=st.booleans())
    def release(self, data: st.DataObject, free: bool) -> None:
        """A conversation ends: its blocks go first once cached (freed now, or later)."""
        seq = self.some_seq(data)
        self.both("release", seq)
        if free:
            self.both("free_sequence", seq)

    @precondition(lambda self: self.ready)
    @rule(hashes=HASHES, tokens=TOKENS, salt=ANY_SALT)
    def release_cached(self, hashes: list[int], tokens: list[int], salt: str | None) -> None:
        """A conversation whose sequences are gone ends, named by its hashes or tokens."""
        got, want = self.both("release_cached", np.array(hashes, dtype=np.uint64))
        assert got == want
        got, want = self.both("release_cached_tokens", np.array(tokens, dtype=np.uint32), salt)
        assert got == want

    @precondition(lambda self: self.pending is not None and self.has_seqs())
    @rule(data=st.data())
    def free_while_moving(self, data: st.DataObject) -> None:
        """A sequence ends while some of its blocks are in the pending plan."""
        assert self.pending is not None
        moving = {b for b, *_ in self.pending[1].moves}
        seqs = [s for s in self.model.sequences() if moving & set(self.model.seqs[s].blocks)]
        if seqs:
            self.both("free_sequence", data.draw(st.sampled_from(seqs)))

    @precondition(has_blocks)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """Blocks whose bytes turned out incomplete leave the index (with their descendants)."""
        self.both("forget", np.array(self.some_blocks(data, 3), dtype=np.uint32))

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data(), how=DISTURBANCES)
    def disturb_an_eviction(self, data: st.DataObject, how: str) -> None:
        self._disturb(data, how)

    @precondition(lambda self: self.ready and self.pending is None and bool(self.model.cached))
    @rule(
        data=st.data(),
        percent=st.integers(0, 50),
        before=st.integers(0, 3),
        how=DISTURBANCES,
        then=st.sampled_from(["commit", "abort"]),
    )
    def evict_and_disturb(
        self, data: st.DataObject, percent: int, before: int, how: str, then: str
    ) -> None:
        """Memory pressure with cached blocks: after a few plans (demotions first), a plan
        evicts, something happens to a block it evicts before the engine is done, and the plan
        is committed or aborted."""
        budget = self.budget()
        self.both("set_budget", "device", self.model.tier_bytes * percent // 100)
        for _ in range(before):
            self.checked_plan()
            self.finish("commit")
        self.checked_plan()
        self.both("set_budget", "device", budget)  # the pressure is gone: requests fit again
        self._disturb(data, how)
        self.finish(then)

    def _disturb(self, data: st.DataObject, how: str) -> None:
        """While a plan that evicts a block is pending: a new request shares it (``share``),
        and appends after it (``extend``), then ends (``child``: the block is cached again but
        has a child); or the engine pins it (``pin``); or its parent leaves the index and it is
        pinned (``orphan``: cancelled, it cannot be linked back)."""
        assert self.pending is not None
        m, plan = self.model, self.pending[1]
        evicting = [b for b, kind, *_ in plan.moves if kind == EVICT and m.live[b]]
        if not evicting:
            return
        b = data.draw(st.sampled_from(evicting))
        if how in ("share", "extend", "child") and m.indexed[b]:
            more = data.draw(NEW_HASHES) if how != "share" else []
            seq = self._request([m.hash[b], *more], [], False)
            if how == "child":
                self.both("free_sequence", seq)
        elif how == "orphan":
            parent = next(
                (m.index.get(h) for x, h in plan.parked if x == b and h is not None), None
            )
            if parent is not None:
                self.both("forget", np.array([parent], dtype=np.uint32))
        if how in ("pin", "orphan"):
            self.both("pin", np.array([b], dtype=np.uint32))

    @precondition(has_blocks)
    @rule(data=st.data())
    def record_reads(self, data: st.DataObject) -> None:
        self.both("record_reads", np.array(self.some_blocks(data, 8), dtype=np.uint32))

    @precondition(has_seqs)
    @rule(data=st.data())
    def read_sequence(self, data: st.DataObject) -> None:
        """What an engine does each step: a read of every block of a running sequence."""
        blocks = self.model.seqs[self.some_seq(data)].blocks
        self.both("record_reads", np.array(blocks, dtype=np.uint32))

    @precondition(lambda self: self.has_seqs() and self.pending is None)
    @rule(data=st.data(), attention=st.booleans(), commit=st.booleans())
    def engine_step(self, data: st.DataObject, attention: bool, commit: bool) -> None:
        """One decode step of an engine: every running sequence reads its blocks (and reports
        the attention they got), then the scheduler plans and the plan is executed."""
        for seq in self.model.sequences():
            blocks = np.array(self.model.seqs[seq].blocks, dtype=np.uint32)
            self.both("record_reads", blocks)
            if attention:
                mass = data.draw(st.lists(VALUES, min_size=len(blocks), max_size=len(blocks)))
                self.both("record_attention", blocks, np.array(mass, dtype=np.float32))
        self.checked_plan()
        self.finish("commit" if commit else "abort")

    @precondition(has_blocks)
    @rule(
        data=st.data(), which=st.sampled_from(["record_attention", "set_magnitude", "set_learned"])
    )
    def signal(self, data: st.DataObject, which: str) -> None:
        ids = self.some_blocks(data)
        values = data.draw(st.lists(VALUES, min_size=len(ids), max_size=len(ids)))
        self.both(which, np.array(ids, dtype=np.uint32), np.array(values, dtype=np.float32))

    @precondition(has_blocks)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ids = self.some_blocks(data, 3)
        self.both("pin", np.array(ids, dtype=np.uint32))

    @precondition(lambda self: self.ready and any(self.model.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = [b for b in self.model.live_blocks() if self.model.pins[b]]
        ids = data.draw(st.lists(st.sampled_from(pinned), max_size=3, unique=True))
        self.both("unpin", np.array(ids, dtype=np.uint32))

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), n=st.integers(0, 4))
    def evict_cached(self, data: st.DataObject, n: int) -> None:
        """A cache asks for ``n`` victims (vLLM's offloading ``CachePolicy.evict``), some
        blocks protected: the same ones from both, in the same order, or none from either."""
        protected = self.some_blocks(data, 3) if self.model.live_blocks() else []
        got, want = self.both("evict_cached", n, np.array(protected, dtype=np.uint32))
        if self.last_err is None:
            assert (None if got is None else got.tolist()) == want

    @rule(data=st.data(), what=st.integers(0, 11))
    def bad_call(self, data: st.DataObject, what: int) -> None:
        """A call that must fail (the model says which error) and change nothing."""
        m = self.model
        unknown_seq = data.draw(st.sampled_from([m.next_seq, m.next_seq + 7, 2**32 - 1]))
        live = m.live_blocks()
        unknown_block = data.draw(st.sampled_from([len(m.live), len(m.live) + 3, *m.free_ids]))
        ids = np.array([*live[:2], unknown_block], dtype=np.uint32)
        calls: list[tuple[str, tuple[Any, ...]]] = [
            ("append_blocks", (unknown_seq, np.array([1, 2], dtype=np.uint64))),
            ("append_tokens", (unknown_seq, np.array([0, 1, 2], dtype=np.uint32))),
            ("fork", (unknown_seq,)),
            ("free_sequence", (unknown_seq,)),
            ("record_reads", (ids,)),
            ("pin", (ids,)),
            ("unpin", (np.array(live[:1] * 40, dtype=np.uint32),)),  # more unpins than pins
            ("record_attention", (ids[:-1], np.ones(len(ids), dtype=np.float32))),
            ("set_magnitude", (ids, np.full(len(ids), -1.0, dtype=np.float32))),
            ("forget", (ids,)),
            ("release", (unknown_seq,)),
            (data.draw(st.sampled_from(["commit", "abort"])), (data.draw(st.integers(0, 2**20)),)),
        ]
        name, args = calls[what]
        if name in ("commit", "abort") and self.pending and args[0] == self.pending[0].id:
            return
        if name == "unpin" and (not live or m.pins[live[0]] >= 40):
            return
        self.both(name, *args)
        assert self.last_err is not None, f"{name}{args} did not fail"

    def checked_plan(self) -> bool:
        """plan() on both; compares the plans, checks them on the core alone, and holds them
        pending. Returns whether a plan was made (False: one was already pending)."""
        before = self.core_state(with_slots=True)
        got, want = self.both("plan")
        if got is None:
            assert self.pending is not None, "plan() refused without a pending plan"
            return False
        assert self.pending is None, "plan() while a plan is pending must raise PlanError"
        moves = list(
            zip(
                got.block.tolist(),
                got.kind.tolist(),
                got.src_level.tolist(),
                got.dst_level.tolist(),
                strict=True,
            )
        )
        assert moves == [(b, k, s, 0 if d is None else d) for b, k, s, d in want.moves]
        assert (got.id, got.noop_promotions, got.deferred, got.unmet_bytes) == (
            want.id,
            want.noop_promotions,
            want.deferred,
            want.unmet_bytes,
        )
        # The core alone: pinned blocks never move, no block moves twice, slots are sound.
        blocks, slots = before["blocks"], before["slots"]
        counts = Counter(got.block.tolist())
        assert all(n == 1 for n in counts.values()), counts
        for i, b in enumerate(got.block.tolist()):
            assert not blocks[b][3], f"pinned block {b} in a plan"
            assert (got.src_level[i], got.src_slot[i]) == slots[b]
        held = {(lv, s) for lv, s in slots.values() if s != NO_SLOT}
        reserved = [
            (int(lv), int(s))
            for t, lv, s in zip(got.dst_tier, got.dst_level, got.dst_slot, strict=True)
            if t != NO_TIER and s != NO_SLOT
        ]
        assert len(set(reserved)) == len(reserved), "a slot reserved twice"
        assert not held & set(reserved), "a slot reserved while another block holds it"
        self.pending = (got, want)
        self.budget_at_plan = self.budget()
        return True

    @rule(then=st.sampled_from(["commit", "commit", "abort", "keep"]))
    def plan(self, then: str) -> None:
        if self.checked_plan() and then != "keep":
            self.finish(then)

    def finish(self, how: str) -> None:
        assert self.pending is not None
        plan, _ = self.pending
        cancelled = self.model.counters["cancelled_moves"]
        self.both(how, plan.id)
        self.pending = None
        budget = self.budget()
        # A move cancelled at commit (its block pinned, or shared again, meanwhile) leaves the
        # block where it was: the budget then holds only from the next plan on.
        kept = (
            how == "commit"
            and plan.unmet_bytes == 0
            and budget == self.budget_at_plan
            and self.model.counters["cancelled_moves"] == cancelled
        )
        if kept and budget is not None:
            assert self.model.tier_bytes <= budget, "a committed plan broke the budget"

    @precondition(lambda self: self.pending is not None)
    @rule(how=st.sampled_from(["commit", "abort"]))
    def finish_pending(self, how: str) -> None:
        self.finish(how)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        hashes = data.draw(HASHES)
        got, want = self.both("lookup", np.array(hashes, dtype=np.uint64))
        assert got.tolist() == want
        tokens = data.draw(TOKENS)
        salt = data.draw(ANY_SALT)
        got, want = self.both("lookup_tokens", np.array(tokens, dtype=np.uint32), salt)
        assert (got is None and want is None) or got.tolist() == want

    @rule(budget=BUDGETS)
    def set_budget(self, budget: int | None) -> None:
        self.both("set_budget", "device", budget)

    @precondition(lambda self: self.ready and self.pending is None and self.model.tier_bytes > 0)
    @rule(percent=st.integers(0, 90), plans=st.integers(1, 4), keep_last=st.booleans())
    def squeeze(self, percent: int, plans: int, keep_last: bool) -> None:
        """Memory pressure: the budget drops below what is in use, then a few steps run
        (demotions of live and cached blocks, evictions); the last plan may stay pending while
        the engine goes on (its evictions and demotions not yet done)."""
        self.both("set_budget", "device", self.model.tier_bytes * percent // 100)
        for i in range(plans):
            self.checked_plan()
            if not (keep_last and i == plans - 1):
                self.finish("commit")

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        if not self.ready:
            return
        core = self.core_state(with_slots=True)
        slots = core.pop("slots")
        assert core == self.model_state()
        usage = self.core.usage()
        assert all(used <= cap for _, _, used, cap, _ in usage)
        assert sum(u[4] for u in usage) == self.core.tier_bytes()[0][1]
        caps = {lv: cap for _, lv, _, cap, _ in usage}
        held = [(lv, s) for lv, s in slots.values() if s != NO_SLOT]
        assert len(set(held)) == len(held), "a slot held by two blocks"
        assert all(s < caps[lv] for lv, s in held)
        for b, (lv, s) in slots.items():
            assert (s == NO_SLOT) == (self.model.level_bytes[lv] == 0), (b, lv, s)
        # Refcounts are references: every block of a sequence is live, and its refcount is the
        # number of times the sequences hold it (the model could share a core bug; this can't).
        held_by = Counter(b for blocks, _ in core["seqs"].values() for b in blocks)
        refcount = {b: info[2] for b, info in core["blocks"].items()}
        assert set(held_by) <= set(refcount), "a sequence holds a freed block"
        assert all(refcount[b] == held_by.get(b, 0) for b in refcount), "refcount != references"
        cached = sum(1 for b, info in core["blocks"].items() if info[2] == 0 and not info[3])
        assert core["counters"]["cached_blocks"] <= cached

    @invariant()
    def no_stranded_block(self) -> None:
        """On the core alone: every indexed block's parent chain reaches a root through indexed
        blocks (no cycle), and a root is at position 0 unless the pending plan evicts it (a
        parked leaf); a plain core links nothing."""
        if not self.ready:
            return
        ids = self.model.live_blocks()  # the core's live blocks too (`agree` checks the count)
        info = self.core.block_info(np.array(ids, dtype=np.uint32))
        indexed = dict(zip(ids, info["indexed"].tolist(), strict=True))
        parent = dict(zip(ids, info["parent"].tolist(), strict=True))
        position = dict(zip(ids, info["position"].tolist(), strict=True))
        evicting: set[int] = set()
        if self.pending is not None:
            plan = self.pending[0]
            kinds = plan.kind.tolist()
            evicting = {b for b, k in zip(plan.block.tolist(), kinds, strict=True) if k == EVICT}
        for b in ids:
            if not indexed[b] or not self.core.prefix_aware:
                assert parent[b] == -1, f"block {b} has a parent {parent[b]} out of a tree"
                continue
            chain, x = [b], b
            while parent[x] != -1:
                x = parent[x]
                assert indexed.get(x), f"block {b} stranded: its ancestor {x} is not indexed"
                assert x not in chain, f"block {b} in a cycle of parents: {[*chain, x]}"
                chain.append(x)
            assert position[x] == 0 or x in evicting, (
                f"block {b}'s tree has a root {x} at position {position[x]}"
            )

    def check(self) -> None:
        """Both invariants, for the targeted scenarios below."""
        self.agree()
        self.no_stranded_block()

    def teardown(self) -> None:
        if not self.ready:
            return
        if self.pending is not None:
            self.finish("commit")
        for seq in self.model.sequences():
            self.both("free_sequence", seq)
        pinned = [b for b in self.model.live_blocks() for _ in range(self.model.pins[b])]
        self.both("unpin", np.array(pinned, dtype=np.uint32))
        self.both("set_budget", "device", 0)
        for _ in range(12):
            if not self.model.cached:
                break
            self.checked_plan()
            self.finish("commit")
        self.agree()
        counters = self.core.counters()
        assert counters["live_blocks"] == 0 and counters["cached_blocks"] == 0
        assert counters["allocated"] == counters["released"]
        assert self.core.tier_bytes() == [("device", 0)]
        assert all(u[2] == 0 and u[4] == 0 for u in self.core.usage())


class SplitVsModel(CoreVsModel):
    """Live sequences under the rank split: wishes, hysteresis, no-op promotions, shared blocks."""

    @initialize(cfg=configs("split"), warm=WARM_UP)
    def setup(self, cfg: dict[str, Any], warm: list[Request]) -> None:
        self.start(cfg, warm)


class CacheVsModel(CoreVsModel):
    """A prefix cache under a tight budget: eviction on a full device, pressure, drops."""

    @initialize(cfg=configs("cache"), warm=WARM_UP)
    def setup(self, cfg: dict[str, Any], warm: list[Request]) -> None:
        self.start(cfg, warm)


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreVsModel = CoreVsModel.TestCase
TestSplitVsModel = SplitVsModel.TestCase
TestCacheVsModel = CacheVsModel.TestCase
for _case in (TestCoreVsModel, TestSplitVsModel, TestCacheVsModel):
    _case.settings = SETTINGS


# ---- targeted scenarios, same comparison -----------------------------------------------------


def _pair(**cfg: Any) -> CoreVsModel:
    machine = CoreVsModel()
    machine.start(cfg, [])
    return machine


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("decay", [0.9, 0.37])
def test_statistics_and_scores_match_bit_for_bit(policy: str, decay: float) -> None:
    """Many steps of f32 statistics — decayed reads (also more than 64 steps apart, where the
    core leaves its table for powi), attention EMA and history, magnitude, learned score — must
    give the model and the core the same scores and the same plans."""
    rng = np.random.default_rng(7)
    pair = _pair(
        level_bytes=[8, 4, 2],
        block_size=2,
        policy=policy,
        decay=decay,
        attention_ema=0.3,
        recent_window=2,
        sink_blocks=1,
        weights=(0.3, 0.5, 0.2),
        hysteresis=0.05,
        compression_ratio=0.4,
    )
    for seq_hashes in (range(1, 30), range(100, 112), range(200, 241)):
        seq, _ = pair.both("add_sequence")
        pair._append_blocks(int(seq), list(seq_hashes))
    live = np.array(pair.model.live_blocks(), dtype=np.uint32)
    f32 = np.float32
    for step in range(90):
        some = rng.choice(live, size=rng.integers(1, len(live)), replace=True)
        if step % 3 == 0 or step > 80:  # some blocks are not read for 70+ steps
            pair.both("record_reads", some if step < 10 or step > 80 else some[:3])
        mass = rng.random(len(some), dtype=f32) * f32(rng.choice([1e-3, 1.0, 50.0]))
        pair.both("record_attention", some, mass)
        if step % 7 == 0:
            pair.both("set_magnitude", some, rng.random(len(some), dtype=f32))
            pair.both("set_learned", some[::2], rng.random(len(some[::2]), dtype=f32) * f32(3))
        pair.checked_plan()
        pair.finish("commit" if step % 4 else "abort")
        pair.check()


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_a_private_block_freed_while_its_move_is_pending_is_released_at_commit(
    prefix_aware: bool,
) -> None:
    pair = _pair(
        level_bytes=[8, 4, 2],
        block_size=1,
        recent_window=0,
        sink_blocks=0,
        prefix_aware=prefix_aware,
    )
    seq, _ = pair.both("add_sequence")
    pair._append_blocks(int(seq), [1, 2, 1, 2, 3, 1])  # the repeats are private copies
    assert pair.checked_plan()
    moving = {b for b, *_ in pair.model.pending.moves} if pair.model.pending else set()
    assert any(not pair.model.indexed[b] for b in moving)
    pair.both("free_sequence", seq)
    pair.check()  # private blocks stay until their move is done
    pair.finish("commit")
    pair.check()
    assert pair.core.counters()["live_blocks"] == 3  # hashes 1, 2, 3 stay cached


def _lookups(core: kvtier.Core, *prefixes: list[int]) -> list[int]:
    return [len(core.lookup(np.array(p, dtype=np.uint64))) for p in prefixes]


@pytest.mark.parametrize("prefix_aware", [True, False])
@pytest.mark.parametrize("how", ["commit", "abort"])
def test_pool_slots_short_of_level_0_evict_level_0_first(how: str, prefix_aware: bool) -> None:
    pair = _pair(
        level_bytes=[8, 4],
        evict_on_full=True,
        policy="lru",
        pool_slots=[("device", 0, 3)],
        recent_window=0,
        sink_blocks=0,
        compression_ratio=0.0,
        prefix_aware=prefix_aware,
    )
    seq, _ = pair.both("add_sequence")
    pair._append_blocks(int(seq), [1, 2, 3])
    pair.checked_plan()  # ratio 0: all three go to level 1
    pair.finish(how)
    pair.both("free_sequence", seq)
    for hashes in ([4, 5], [6], [7, 8, 9]):
        seq, _ = pair.both("add_sequence")
        pair._append_blocks(int(seq), hashes)
        pair.both("free_sequence", seq)
        pair.check()
        if hashes == [4, 5] and how == "commit":
            # Level 1 holds 1-2-3; level 0 has the two free slots 4 and 5 take.
            assert _lookups(pair.core, [1, 2, 3], [4, 5]) == [3, 2]
        if hashes == [4, 5] and how == "abort":
            # 1-2-3 stayed at level 0 and two of them make room. Prefix-aware: the leaf 3,
            # then 2 (a leaf now), and the prefix 1 still loads; plain: the least recently
            # used, 1 and 2, which strands 3 behind them.
            assert _lookups(pair.core, [1], [3]) == ([1, 0] if prefix_aware else [0, 1])
    # [7, 8, 9] needs all three level-0 slots: the level-0 blocks go, 1-2-3 at level 1 stay.
    assert _lookups(pair.core, [1, 2, 3], [7, 8, 9]) == ([3, 3] if how == "commit" else [0, 3])


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_a_write_short_of_level_0_slots_evicts_below_a_level_0_block(prefix_aware: bool) -> None:
    """The level-0 slot a write needs is held by a cached block whose children sit at lower
    levels: prefix-aware, its subtree goes first, leaf by leaf, then the block itself; plain,
    the block goes alone and strands its children."""
    pair = _pair(
        level_bytes=[64, 32, 16],
        block_size=4,
        recent_window=0,
        sink_blocks=1,  # block 0 stays at level 0; the others go down
        pool_slots=[("device", 0, 3), ("device", 1, 4), ("device", 2, 4)],
        prefix_aware=prefix_aware,
    )
    seq, _ = pair.both("add_sequence")
    pair._append_blocks(int(seq), [1, 2, 3])
    pair.checked_plan()
    pair.finish("commit")
    branch, _ = pair.both("add_sequence")
    pair._append_blocks(int(branch), [1, 4])  # a second child of block 0
    pair.checked_plan()
    pair.finish("commit")
    levels = {pair.model.hash[b]: pair.model.level[b] for b in pair.model.live_blocks()}
    assert levels == {1: 0, 2: 2, 3: 1, 4: 1}
    pair.both("free_sequence", seq)
    pair.both("free_sequence", branch)
    for hashes in ([7, 8], [9]):  # live: then level 0 is full
        seq, _ = pair.both("add_sequence")
        pair._append_blocks(int(seq), hashes)
        pair.check()
    evictions = pair.core.counters()["evictions"]
    if prefix_aware:
        assert evictions == 4, "the subtree, leaf by leaf, then its root"
        assert _lookups(pair.core, [1], [2], [3], [4]) == [0, 0, 0, 0]
    else:
        assert evictions == 1
        assert _lookups(pair.core, [1], [2], [3], [4]) == [0, 1, 1, 1], "stranded"


def test_forget_takes_the_descendants_out_of_the_index() -> None:
    """Forgetting a block takes every block after it in a cached prefix out of the index: the
    cached ones are freed, a live one stays, private to its sequence."""
    pair = _pair(level_bytes=[8], block_size=1, policy="lru")
    done, _ = pair.both("add_sequence")
    pair._append_blocks(int(done), [1, 2, 3, 4])
    pair.both("free_sequence", done)
    live, _ = pair.both("add_sequence")
    pair._append_blocks(int(live), [1, 2, 5])
    blocks = pair.model.seqs[live].blocks
    assert [pair.model.block_parent(b) for b in blocks] == [-1, blocks[0], blocks[1]]
    pair.both("forget", np.array([blocks[1]], dtype=np.uint32))  # hash 2
    pair.check()
    assert _lookups(pair.core, [1, 2], [3], [4], [5]) == [1, 0, 0, 0]
    assert pair.core.counters()["live_blocks"] == 3  # 1, and the live sequence's 2 and 5
    info = pair.core.block_info(np.array(blocks, dtype=np.uint32))
    assert info["indexed"].tolist() == [True, False, False]


@pytest.mark.parametrize("how", ["forget", "evict", "abort"])
def test_a_branching_prefix_tree_goes_leaf_first_in_the_core_order(how: str) -> None:
    """A cached tree with branches, forgotten at its root or evicted whole (or planned for
    eviction, linked back by an abort, then forgotten): its blocks are freed children first,
    siblings in the core's order (the ids later blocks get show it)."""
    pair = _pair(level_bytes=[8], block_size=1, policy="lru", tiers=[("device", None)])
    for hashes in ([1, 2, 3], [1, 4, 5], [1, 2, 6], [1, 4, 7, 8]):
        seq, _ = pair.both("add_sequence")
        pair._append_blocks(int(seq), hashes)
        pair.both("free_sequence", seq)
    root = pair.model.index[1]
    assert len(pair.model.children[root]) == 2
    if how != "forget":
        pair.both("set_budget", "device", 0)
        pair.checked_plan()
        pair.finish("commit" if how == "evict" else "abort")
        pair.both("set_budget", "device", None)
    if how != "evict":
        pair.both("forget", np.array([root], dtype=np.uint32))
    pair.check()
    assert pair.core.counters()["live_blocks"] == 0
    seq, _ = pair.both("add_sequence")
    pair._append_blocks(int(seq), list(range(10, 18)))  # takes the freed ids, last freed first
    pair.check()


def test_a_block_a_sequence_holds_twice_leaves_attention_with_all_its_places() -> None:
    """The drop quota takes the lowest ranked places of a sequence; a block that holds two of
    them and is cut after the first leaves with both (the other place wants no level)."""
    pair = _pair(
        level_bytes=[8, 4, 2, 0],
        block_size=1,
        compression_ratio=0.0,
        recent_window=2,
        sink_blocks=0,
        drop_ratio=0.25,
    )
    twice, _ = pair.both("add_sequence")
    once, _ = pair.both("add_sequence")
    pair._append_blocks(int(once), [2, 1, 1, 1])
    pair._append_blocks(int(twice), [2, 2, 1, 1])  # its two ranked places: one block
    block = pair.model.seqs[twice].blocks[0]
    pair.checked_plan()
    assert pair.pending is not None
    assert pair.pending[0].block.tolist() == [block] and pair.pending[0].summary() == {"drop": 1}
    pair.finish("commit")
    pair.check()


def test_a_committed_drop_takes_the_descendants_out_of_the_index() -> None:
    """A block dropped out of attention can never load again, nor can anything cached after
    it in a prefix: the cached blocks below it are freed at commit."""
    pair = _pair(
        level_bytes=[8, 4, 0],
        block_size=1,
        policy="lru",
        recent_window=0,
        sink_blocks=0,
        drop_ratio=0.5,
        compression_ratio=0.0,
    )
    seq, _ = pair.both("add_sequence")
    pair._append_blocks(int(seq), [1, 2, 3, 4])
    done, _ = pair.both("add_sequence")
    pair._append_blocks(int(done), [1, 2, 3, 4, 5, 6])
    pair.both("free_sequence", done)  # 5 and 6 cached after the live prefix
    pair.checked_plan()  # the newest live block stays at level 0
    assert pair.pending is not None and pair.pending[0].summary() == {"drop": 2, "demote": 1}
    pair.finish("commit")
    pair.check()
    assert _lookups(pair.core, [1, 2, 3, 4, 5, 6]) == [0]
    assert pair.core.counters()["live_blocks"] == 4  # the live sequence's, all private now


def test_eviction_ranks_importance_leaves_by_reuse_first() -> None:
    """Under ``importance`` a prefix-aware core evicts the cached leaf whose prefix came back
    least often (sequences that took it), not the least important one (which the demotion
    order ranks first), nor the least recently read."""
    pair = _pair(
        level_bytes=[8],
        block_size=1,
        policy="importance",
        weights=(1.0, 0.0, 0.0),
        tiers=[("device", 32)],
        headroom=0.0,
    )
    kept: list[int] = []
    gone: list[int] = []
    for hashes, magnitude, turns in (([3, 4], [1.0, 0.0], 2), ([1, 2], [0.0, 1.0], 1)):
        for _ in range(turns):
            seq, _ = pair.both("add_sequence")
            pair._append_blocks(int(seq), hashes)
            blocks = np.array(pair.model.seqs[seq].blocks, dtype=np.uint32)
            pair.both("set_magnitude", blocks, np.array(magnitude, dtype=np.float32))
            pair.both("free_sequence", seq)
        (kept if turns > 1 else gone).append(int(blocks[1]))
    assert pair.model.key(kept[0]) < pair.model.key(gone[0])  # less important, older
    pair.both("set_budget", "device", 24)
    pair.checked_plan()
    assert pair.pending is not None and pair.pending[0].block.tolist() == gone
    pair.finish("commit")
    pair.check()


# ---- regressions: core bugs this machine found, as minimal cases -----------------------------


def _blocks(core: kvtier.Core, *hashes: int) -> tuple[int, list[int]]:
    seq = core.add_sequence()
    blocks, _ = core.append_blocks(seq, np.array(hashes, dtype=np.uint64))
    return seq, blocks.tolist()


def _lru(budget: int, prefix_aware: bool) -> kvtier.Core:
    return kvtier.Core(
        [100], tiers=[("device", budget)], policy="lru", headroom=0.0, prefix_aware=prefix_aware
    )


def test_a_block_shared_while_its_eviction_is_pending_is_not_freed_under_the_sequence() -> None:
    core = _lru(400, prefix_aware=False)
    seq, _ = _blocks(core, 1, 2, 3, 4)
    core.free_sequence(seq)  # four cached blocks, 400 bytes
    core.set_budget("device", 200)
    plan = core.plan()  # evicts blocks 0 and 1 (lowest LRU keys)
    assert plan.summary() == {"evict": 2}
    seq2, _ = _blocks(core, 1)  # hash 1 is still indexed: block 0 is shared again
    core.commit(plan.id)
    # The eviction of the block shared again is cancelled; the other one goes.
    info = core.block_info(core.sequence_blocks(seq2))
    assert info["refcount"].tolist() == [1]
    assert core.counters()["cancelled_moves"] == 1 and core.counters()["evictions"] == 1
    assert len(core.lookup(np.array([1], dtype=np.uint64))) == 1


def _pending_eviction_of_a_prefix() -> tuple[kvtier.Core, list[int], kvtier.Plan]:
    """A prefix-aware core whose pending plan evicts the last two blocks of a cached prefix of
    four (the leaf, then its parent)."""
    core = _lru(400, prefix_aware=True)
    seq, blocks = _blocks(core, 1, 2, 3, 4)
    core.free_sequence(seq)
    core.set_budget("device", 200)
    plan = core.plan()
    assert plan.block.tolist() == [blocks[3], blocks[2]]
    return core, blocks, plan


def test_a_prefix_shared_while_its_eviction_is_pending_stays_whole() -> None:
    core, blocks, plan = _pending_eviction_of_a_prefix()
    _blocks(core, 1, 2, 3, 4)  # the whole prefix is shared again
    core.commit(plan.id)
    # The leaf's eviction is cancelled and it is linked back under its parent, whose eviction
    # is cancelled then (it has a child again).
    assert core.counters()["cancelled_moves"] == 2 and core.counters()["evictions"] == 0
    assert core.block_info(np.array(blocks, dtype=np.uint32))["parent"].tolist() == [
        -1,
        *blocks[:3],
    ]
    assert len(core.lookup(np.array([1, 2, 3, 4], dtype=np.uint64))) == 4


def test_a_block_given_a_child_while_its_eviction_is_pending_stays() -> None:
    core, _, plan = _pending_eviction_of_a_prefix()
    core.set_budget("device", None)
    seq2, blocks2 = _blocks(core, 1, 2, 3, 9)  # a request that ends after block 2 ...
    core.free_sequence(seq2)  # ... and is done: block 2 is cached, with a cached child
    core.commit(plan.id)
    assert core.counters()["cancelled_moves"] == 1 and core.counters()["evictions"] == 1
    assert core.lookup(np.array([1, 2, 3, 9], dtype=np.uint64)).tolist() == blocks2
    assert len(core.lookup(np.array([1, 2, 3, 4], dtype=np.uint64))) == 3


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_a_block_pinned_while_its_eviction_is_pending_stays(prefix_aware: bool) -> None:
    core = _lru(200, prefix_aware)
    seq, blocks = _blocks(core, 1, 2)
    core.free_sequence(seq)
    core.set_budget("device", 100)
    plan = core.plan()
    # Prefix-aware, the leaf (block 1); plain, the least recently used (block 0).
    evicted = blocks[1] if prefix_aware else blocks[0]
    assert plan.block.tolist() == [evicted]
    core.pin(np.array([evicted], dtype=np.uint32))
    core.commit(plan.id)  # the engine reads the block: its eviction is cancelled
    assert core.counters()["cancelled_moves"] == 1 and core.counters()["evictions"] == 0
    core.unpin(np.array([evicted], dtype=np.uint32))
    assert len(core.lookup(np.array([1, 2], dtype=np.uint64))) == 2


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_a_failed_append_over_a_lowered_budget_evicts_nothing(prefix_aware: bool) -> None:
    core = kvtier.Core(
        [100], tiers=[("device", 1000)], evict_on_full=True, policy="lru", prefix_aware=prefix_aware
    )
    seq, _ = _blocks(core, 1, 2, 3)
    core.free_sequence(seq)  # 3 cached blocks
    _blocks(core, *range(10, 17))  # 7 live blocks: 1000 bytes in use
    core.set_budget("device", 500)
    with pytest.raises(kvtier.OutOfCapacityError):
        _blocks(core, 99)
    assert core.counters()["cached_blocks"] == 3  # evicting them would not have made room


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_live_blocks_are_dropped_above_the_budget_when_the_ladder_has_a_drop_level(
    prefix_aware: bool,
) -> None:
    core = kvtier.Core(
        [8, 4, 0],
        tiers=[("device", 48)],
        block_size=1,
        policy="lru",
        recent_window=0,
        sink_blocks=0,
        pressure_only=True,
        prefix_aware=prefix_aware,
    )
    _blocks(core, *range(1, 7))  # six live blocks, 48 bytes
    core.set_budget("device", 10)
    # Five demoted to level 1 (the newest block stays at level 0): 28 bytes, 18 still over.
    first = core.plan()
    assert first.summary() == {"demote": 5} and first.unmet_bytes == 18
    core.commit(first.id)
    second = core.plan()
    # The lowest-ranked live blocks are dropped until the tier fits: all five, 8 bytes left.
    assert second.summary().get("drop", 0) == 5 and second.unmet_bytes == 0


def test_a_block_is_never_its_own_parent() -> None:
    """A parent is older than the append or linked before the block in it: a repeated hash
    (the sequence ended on it, and nothing is indexed under it now) has no parent, so the
    block is not indexed, rather than linked under itself and never evicted."""
    core = kvtier.Core([8], block_size=1, policy="lru")
    seq, blocks = _blocks(core, 5, 6)
    core.forget(np.array([blocks[1]], dtype=np.uint32))  # hash 6 leaves the index
    again, _ = core.append_blocks(seq, np.array([6], dtype=np.uint64))  # the chain's own hash
    b = int(again[0])
    parent = core.block_info(np.array([b], dtype=np.uint32))["parent"].tolist()
    core.free_sequence(seq)
    core.set_budget("device", 0)
    plan = core.plan()
    core.commit(plan.id)
    # The block has no block indexed before it: it is not indexed, and nothing stays cached.
    assert parent == [-1] and core.counters()["live_blocks"] == 0
