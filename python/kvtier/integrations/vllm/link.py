"""How the vLLM connector's scheduler side asks the worker side what its tiers hold.

The tiers (a :class:`~kvtier.BlockManager` in host memory) live with the worker, which owns the
paged caches the bytes move between. vLLM runs the scheduler in the worker's process only in its
in-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); otherwise (``vllm serve``, ``LLM`` by
default) the worker is a process of its own. So the worker answers on a Unix socket beside its
process (local only, named after the engine id, authenticated with it), and a scheduler in the
same process takes the direct path. Either way the scheduler sees one :class:`Link`.

Only questions cross the socket: how many leading tokens of a prompt the tiers can load, where
they lie (tier and level, in runs: :class:`Held`) and what the worker measured a token to cost to
load from each place and to recompute (:class:`LoadCosts`), and their figures. Bytes never do, and the
scheduler never changes the tiers: what it decides goes to the worker in vLLM's connector
metadata. Nothing here needs vLLM.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby, pairwise
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

from ...errors import KvtierError

log = logging.getLogger("kvtier.vllm")

__all__ = [
    "CONNECTOR_TIERS",
    "Held",
    "Link",
    "LoadCosts",
    "Place",
    "forget",
    "link_to_worker",
    "serve",
]

#: The connector's name for each of the manager's tiers. The manager lives in host memory, so its
#: ``device`` tier is the connector's host tier (the connector gives it no ``host`` tier of its
#: own; one would be host memory too).
CONNECTOR_TIERS = {"device": "host", "host": "host", "disk": "disk", "remote": "remote"}
#: The connector's tiers, nearest first: a load waits for the farthest of its blocks.
_DISTANCE = {"host": 0, "disk": 1, "remote": 2}

#: Where a place's tokens lie: (connector tier, level name).
Place = tuple[str, str]


@dataclass(frozen=True)
class LoadCosts:
    """What a token costs the worker, in seconds, as it measured them: to load it from each place
    (``load``: ``(tier, level, seconds)``, the reads, decodes and copies of its own loads) and to
    compute it (``recompute``: its engine's prefill steps). A place not measured yet costs
    nothing; with no recompute measured, every hit pays."""

    load: tuple[tuple[str, str, float], ...] = ()
    recompute: float | None = None

    def gain(self, place: Place) -> float:
        """Seconds a token from ``place`` saves by being loaded rather than recomputed."""
        assert self.recompute is not None
        for tier, level, seconds in self.load:
            if (tier, level) == place:
                return self.recompute - seconds
        return self.recompute

    @classmethod
    def slowest(cls, costs: Sequence[LoadCosts]) -> LoadCosts:
        """Tensor-parallel ranks' together: a step waits for its slowest rank, loading or
        computing."""
        load: dict[Place, float] = {}
        for c in costs:
            for tier, level, seconds in c.load:
                load[tier, level] = max(load.get((tier, level), 0.0), seconds)
        measured = [c.recompute for c in costs if c.recompute is not None]
        return cls(
            tuple((t, lv, s) for (t, lv), s in load.items()), max(measured) if measured else None
        )


@dataclass(frozen=True)
class Held:
    """What the tiers hold of a prompt: its leading tokens they can load (whole blocks), as runs
    ``(tier, level name, tokens)`` of consecutive tokens in one place, in prompt order; the tier
    in the connector's words (``host``, ``disk``, ``remote``)."""

    runs: tuple[tuple[str, str, int], ...] = ()
    #: what the worker measured loads and recomputes to cost
    costs: LoadCosts = LoadCosts()

    @classmethod
    def of_blocks(
        cls, places: Iterable[Place], block_size: int, costs: LoadCosts | None = None
    ) -> Held:
        """From each held block's place, in prompt order."""
        runs = tuple(
            (tier, level, block_size * sum(1 for _ in run))
            for (tier, level), run in groupby(places)
        )
        return cls(runs, costs or LoadCosts())

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.runs)

    @property
    def resident(self) -> int:
        """The leading tokens in host memory: copied at once, within the step."""
        resident = 0
        for tier, _, n in self.runs:
            if tier != "host":
                break
            resident += n
        return resident

    def paying(self, start: int) -> int:
        """The end of the held prefix worth loading past ``start`` (vLLM's own hit): the one
        whose tokens from ``start`` save the most time loaded rather than recomputed, by
        :attr:`costs` (the longest of equals); ``start`` itself when no load from there pays.
        Loads are prefixes: a slow place between fast ones is loaded where what follows it
        makes up for it."""
        costs = self.costs
        if costs.recompute is None:
            return max(start, self.tokens)
        end, best, gained, at = start, 0.0, 0.0, 0
        for tier, level, n in self.runs:
            lo, at = max(start, at), at + n
            if lo < at:
                gained += (at - lo) * costs.gain((tier, level))
                if gained >= best:
                    end, best = at, gained
        return end

    def places(self, start: int, end: int) -> dict[Place, int]:
        """How many of the prompt's tokens ``[start, end)`` lie in each place (tokens past the
        held ones in none)."""
        out: dict[Place, int] = {}
        at = 0
        for tier, level, n in self.runs:
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                out[tier, level] = out.get((tier, level), 0) + hi - lo
            at += n
        return out

    def _place_at(self, position: int) -> Place:
        at = 0
        for tier, level, n in self.runs:
            at += n
            if position < at:
                return tier, level
        raise IndexError(position)

    @classmethod
    def slowest(cls, helds: Sequence[Held]) -> Held:
        """What tensor-parallel ranks hold together: a token loads only if every rank holds
        it, from the farthest tier any rank holds it in (that rank's level)."""
        end = min(h.tokens for h in helds)
        cuts = {0, end}
        for held in helds:
            at = 0
            for _, _, n in held.runs:
                at += n
                cuts.add(min(at, end))
        bounds = sorted(cuts)
        pieces = []
        for lo, hi in pairwise(bounds):
            places = [h._place_at(lo) for h in helds]
            tier, level = max(places, key=lambda p: _DISTANCE[p[0]])  # the first farthest
            pieces.append((tier, level, hi - lo))
        runs = [
            (tier, level, sum(n for *_, n in run))
            for (tier, level), run in groupby(pieces, key=lambda p: (p[0], p[1]))
        ]
        return cls(tuple(runs), LoadCosts.slowest([h.costs for h in helds]))


class Link(Protocol):
    """A worker's tiers as the scheduler sees them (the worker itself in its own process)."""

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        """The leading tokens of ``tokens`` (a request of cache salt ``salt``) the tiers can
        load (whole blocks), and where each block lies (tier and level) now."""
        ...

    def stats(self) -> dict[str, Any]:
        """The tiers' figures (:meth:`~kvtier.BlockManager.get_compression_stats`) and, under
        ``worker``, the worker's counters."""
        ...


# Workers of this process, by engine id and tensor-parallel rank: a scheduler here asks them
# directly.
_LOCAL: dict[tuple[str, int], Link] = {}
_LOCAL_LOCK = threading.Lock()


def _address(engine_id: str, rank: int) -> str:
    digest = hashlib.sha256(f"{engine_id}#{rank}".encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"kvtier-{digest}.sock")


def _authkey(engine_id: str) -> bytes:
    return hashlib.sha256(b"kvtier worker link " + engine_id.encode()).digest()


def serve(engine_id: str, worker: Link, rank: int = 0) -> Listener:
    """Registers ``worker`` (the worker of tensor-parallel rank ``rank``) for schedulers in
    this process and answers the others on its socket (a daemon thread per connection).
    Close the returned listener to stop."""
    with _LOCAL_LOCK:
        _LOCAL[engine_id, rank] = worker
    address = _address(engine_id, rank)
    if os.path.exists(address):
        os.unlink(address)  # a dead engine's, of the same id: ids are random per engine
    listener = Listener(address, family="AF_UNIX", authkey=_authkey(engine_id))

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # closed
                return
            except Exception as exc:  # a client that failed the handshake
                log.warning("kvtier: refused a connection to the worker link: %s", exc)
                continue
            threading.Thread(target=_answer, args=(conn, worker), daemon=True).start()

    threading.Thread(target=accept, name="kvtier-worker-link", daemon=True).start()
    return listener


def forget(engine_id: str, worker: Link, listener: Listener | None, rank: int = 0) -> None:
    """Undoes :func:`serve`: schedulers no longer find ``worker``, its socket closes."""
    with _LOCAL_LOCK:
        if _LOCAL.get((engine_id, rank)) is worker:
            del _LOCAL[engine_id, rank]
    if listener is not None:
        listener.close()


def _answer(conn: Connection, worker: Link) -> None:
    with conn:
        while True:
            try:
                op, arg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if op == "lookup":  # plain tuples cross the socket
                    held = worker.lookup(*arg)
                    conn.send(("ok", (held.runs, held.costs.load, held.costs.recompute)))
                elif op == "stats":
                    conn.send(("ok", worker.stats()))
                else:
                    conn.send(("error", f"unknown request {op!r}"))
            except Exception as exc:  # the scheduler treats it as a miss
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _SocketLink:
    """The scheduler's end of a worker's socket: one connection, opened on first use and again
    after a failure. Every failure is a :class:`KvtierError` (the caller's miss)."""

    def __init__(self, engine_id: str, rank: int, timeout: float) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.timeout = timeout
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _ask(self, op: str, arg: Any) -> Any:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = Client(
                        _address(self.engine_id, self.rank),
                        family="AF_UNIX",
                        authkey=_authkey(self.engine_id),
                    )
                self._conn.send((op, arg))
                if not self._conn.poll(self.timeout):
                    raise TimeoutError(f"no answer in {self.timeout} s")
                status, value = self._conn.recv()
            except (OSError, EOFError, TimeoutError) as exc:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                raise KvtierError(f"the worker's tiers did not answer ({exc})") from None
        if status != "ok":
            raise KvtierError(f"the worker's tiers failed: {value}")
        return value

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        runs, load, recompute = self._ask("lookup", (tokens, salt))
        costs = LoadCosts(
            tuple((str(tier), str(level), float(s)) for tier, level, s in load),
            None if recompute is None else float(recompute),
        )
        return Held(tuple((str(tier), str(level), int(n)) for tier, level, n in runs), costs)

    def stats(self) -> dict[str, Any]:
        value: dict[str, Any] = self._ask("stats", None)
        return value


class _AllRanks:
    """Tensor-parallel workers, each with the tiers of its own heads: a block loads only if
    every rank holds it, so a hit is the shortest of theirs."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        return Held.slowest([link.lookup(tokens, salt) for link in self.links])

    def stats(self) -> dict[str, Any]:
        """Rank 0's figures, and every rank's under ``ranks``."""
        ranks = [link.stats() for link in self.links]
        return {**ranks[0], "ranks": ranks}


def link_to_worker(engine_id: str, ranks: int = 1, timeout: float = 10.0) -> Link:
    """The tiers of engine ``engine_id``'s ``ranks`` tensor-parallel workers as its scheduler
    sees them: each directly when it lives in this process, else through its socket."""

    def link(rank: int) -> Link:
        with _LOCAL_LOCK:
            local = _LOCAL.get((engine_id, rank))
        return local if local is not None else _SocketLink(engine_id, rank, timeout)

    return link(0) if ranks == 1 else _AllRanks([link(r) for r in range(ranks)])
