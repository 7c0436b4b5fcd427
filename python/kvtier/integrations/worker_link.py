"""How the vLLM connector's scheduler side asks the worker side what its tiers hold.

The tiers (a :class:`~kvtier.BlockManager` in host memory) live with the worker, which owns the
paged caches the bytes move between. vLLM runs the scheduler in the worker's process only in its
in-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); otherwise (``vllm serve``, ``LLM`` by
default) the worker is a process of its own. So the worker answers on a Unix socket beside its
process (local only, named after the engine id, authenticated with it), and a scheduler in the
same process takes the direct path. Either way the scheduler sees one :class:`Link`.

Only questions cross the socket: how many leading tokens of a prompt the tiers can load, and
their figures. Bytes never do, and the scheduler never changes the tiers: what it decides goes to
the worker in vLLM's connector metadata.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import KvtierError

if TYPE_CHECKING:
    import torch

    from ..manager import BlockManager
    from .paged import PagedLayout

log = logging.getLogger("kvtier.vllm")

__all__ = ["Counters", "Link", "WorkerTiers", "link_to_worker", "serve"]


@dataclass
class Counters:
    """What the connector did, since its start."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    save_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class WorkerTiers:
    """The worker's tiers and the paged caches they exchange blocks with."""

    manager: BlockManager
    layout: PagedLayout
    caches: list[torch.Tensor]
    counters: Counters = field(default_factory=Counters)

    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        """Leading tokens of ``tokens`` (a request of cache salt ``salt``) the tiers can load
        (whole blocks), and how many of them lie in host memory (the manager's device tier), to
        be copied at once; the rest are on disk or on the server."""
        manager = self.manager
        hit = manager.lookup(tokens, salt=salt)
        blocks = manager.core.lookup_tokens(tokens, salt)[: hit // manager.block_size]
        away = np.flatnonzero(manager.core.block_info(blocks)["tier"] != 0)
        resident = int(away[0]) if len(away) else len(blocks)
        return hit, resident * manager.block_size

    def stats(self) -> dict[str, Any]:
        stats = self.manager.get_compression_stats()
        stats["worker"] = self.counters.as_dict()
        return stats


class Link(Protocol):
    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]: ...
    def stats(self) -> dict[str, Any]: ...


# Workers of this process, by engine id and tensor-parallel rank: a scheduler here asks them
# directly.
_LOCAL: dict[tuple[str, int], WorkerTiers] = {}
_LOCAL_LOCK = threading.Lock()


def _address(engine_id: str, rank: int) -> str:
    digest = hashlib.sha256(f"{engine_id}#{rank}".encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"kvtier-{digest}.sock")


def _authkey(engine_id: str) -> bytes:
    return hashlib.sha256(b"kvtier worker link " + engine_id.encode()).digest()


def serve(engine_id: str, tiers: WorkerTiers, rank: int = 0) -> Listener:
    """Registers ``tiers`` (the worker of tensor-parallel rank ``rank``) for schedulers in
    this process and answers the others on its socket (a daemon thread per connection).
    Close the returned listener to stop."""
    with _LOCAL_LOCK:
        _LOCAL[engine_id, rank] = tiers
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
            threading.Thread(target=_answer, args=(conn, tiers), daemon=True).start()

    threading.Thread(target=accept, name="kvtier-worker-link", daemon=True).start()
    return listener


def forget(engine_id: str, tiers: WorkerTiers, listener: Listener | None, rank: int = 0) -> None:
    with _LOCAL_LOCK:
        if _LOCAL.get((engine_id, rank)) is tiers:
            del _LOCAL[engine_id, rank]
    if listener is not None:
        listener.close()


def _answer(conn: Connection, tiers: WorkerTiers) -> None:
    with conn:
        while True:
            try:
                op, arg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if op == "lookup":
                    conn.send(("ok", tiers.lookup(*arg)))
                elif op == "stats":
                    conn.send(("ok", tiers.stats()))
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

    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        hit, resident = self._ask("lookup", (tokens, salt))
        return int(hit), int(resident)

    def stats(self) -> dict[str, Any]:
        value: dict[str, Any] = self._ask("stats", None)
        return value


class _AllRanks:
    """Tensor-parallel workers, each with the tiers of its own heads: a block loads only if
    every rank holds it, so a hit is the shortest of theirs."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links

    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        hits = [link.lookup(tokens, salt) for link in self.links]
        return min(h for h, _ in hits), min(r for _, r in hits)

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
