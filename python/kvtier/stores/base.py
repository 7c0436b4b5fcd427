"""The one interface over stored bytes that every tier speaks.

A :class:`KVStore` is bound to a :class:`Namespace`; :meth:`KVStore.with_namespace` gives another
view of the same backend (same memory, directory or connection, same budget). Subclasses move
sealed values (``format.Sealed``) under full keys; this class does the sealing, the checks and the
counting, so every store treats a bad value the same way: a miss, logged and counted.
"""

from __future__ import annotations

import copy
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .._core import StoreIndex, StoreStats
from ..errors import InvalidArgumentError, KvtierError, PayloadError
from .format import Namespace, Sealed, payload_view, unseal

log = logging.getLogger("kvtier.stores")

#: A payload as a store's reading path hands it on: a view, a miss (None), or the check its
#: stored value failed.
Checked = memoryview | PayloadError | None

#: A value in the form a store's ``_put`` takes, as its ``_seal`` made it: a
#: :class:`~.format.Sealed` (written a chunk at a time) by default, or one buffer from
#: ``format.seal_joined`` for a store that keeps or sends one.
StoredForm = Any


class StoreClosedError(KvtierError):
    """The store was closed; open a new one."""


class KVStore(ABC):
    """``put/get/contains/delete/pop`` of byte values under keys of one namespace, and their
    batch forms (the normal path). A miss is ``None``; a value that fails any check is a miss."""

    kind: str = "store"
    #: Whether values carry a checksum that ``get`` verifies. Off only where values never leave
    #: this process's memory (the host store): nothing can flip their bits between put and get
    #: there, so hashing them would be work no reader uses.
    checksummed: bool = True

    def __init__(self, namespace: Namespace) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(
                f"namespace: expected a kvtier.stores.Namespace, got {type(namespace).__name__}"
            )
        self.namespace = namespace
        #: what the store did (all namespaces of its backend together), counted without a lock
        self.stats = StoreStats()
        self._closed = [False]  # shared by every namespace view of this backend

    def with_namespace(self, namespace: Namespace) -> KVStore:
        """The same backend seen through another namespace."""
        view = copy.copy(self)
        KVStore.__init__(view, namespace)
        view.stats, view._closed = self.stats, self._closed
        return view

    # -- the public API -------------------------------------------------------------------------

    def put(self, key: str | int, value: Any) -> bool:
        """Stores ``value`` (any contiguous bytes: bytes, numpy, CPU tensor) under ``key``.
        Returns False when the store refused or failed (budget, disk full, server away); what
        was stored before is then left as it was."""
        return self.put_many([key], [value])[0]

    def get(self, key: str | int) -> memoryview | None:
        """The payload stored under ``key`` as a read-only view, or None (a miss)."""
        return self.get_many([key])[0]

    def put_many(self, keys: Sequence[str | int], values: Sequence[Any]) -> list[bool]:
        self._check_open()
        if len(keys) != len(values):
            raise InvalidArgumentError(
                f"put_many: {len(keys)} keys but {len(values)} values; expected one value per key"
            )
        key_of, seal = self.namespace.key, self._seal
        full = [key_of(k) for k in keys]
        payloads = [payload_view(v) for v in values]
        done = self._put(full, [seal(k, p) for k, p in zip(full, payloads, strict=True)])
        stored = [len(p) for p, d in zip(payloads, done, strict=True) if d]
        self.stats.count_puts(len(stored), sum(stored), len(done) - len(stored))
        return done

    def get_many(self, keys: Sequence[str | int]) -> list[memoryview | None]:
        self._check_open()
        full = [self.namespace.key(k) for k in keys]
        return self._served(full, self._get_checked(full))

    def pop(self, key: str | int) -> memoryview | None:
        """Takes the value out: returns it and deletes it, atomically (of two processes popping
        one key, one gets it). A miss is None."""
        self._check_open()
        full = self.namespace.key(key)
        return self._served([full], [self._pop_checked(full)])[0]

    def contains(self, key: str | int) -> bool:
        """Whether a value is stored under ``key`` (``get`` still checks it)."""
        self._check_open()
        return self._contains(self.namespace.key(key))

    def contains_many(self, keys: Sequence[str | int]) -> list[bool]:
        """:meth:`contains` of each key, in one round trip to a server."""
        self._check_open()
        return self._contains_many([self.namespace.key(k) for k in keys])

    def delete(self, key: str | int) -> bool:
        """Deletes ``key``; True when there was a value."""
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[str | int]) -> list[bool]:
        self._check_open()
        done = self._delete([self.namespace.key(k) for k in keys])
        self.stats.count_deletes(sum(done))
        return done

    def set_scores(self, keys: Sequence[str | int], scores: Sequence[float]) -> None:
        """Reports how much the values under ``keys`` matter (importance, accumulated attention,
        persistence: what the store's policy ranks by). A store that evicts under a policy that
        ranks by such a signal (host and disk stores with ``importance``, ``h2o`` or
        ``scissorhands``) keeps the highest-scored values longest; other stores (a Redis
        server evicts under its own ``maxmemory-policy``) ignore it. Unknown keys are skipped."""
        self._check_open()
        if len(keys) != len(scores):
            raise InvalidArgumentError(
                f"set_scores: {len(keys)} keys but {len(scores)} scores; expected one per key"
            )
        self._rank([self.namespace.key(k) for k in keys], [float(s) for s in scores])

    def set_parents(self, keys: Sequence[str | int], parents: Sequence[str | int]) -> None:
        """Says that ``parents[i]`` is the key before ``keys[i]`` in a prefix (a block's value is
        worth loading only while every block before it is held, as with prefix hashes). A store
        that evicts by a budget (host and disk stores) then evicts leaves only, so no value is
        stranded behind an evicted one; other stores (a Redis server evicts under its own
        ``maxmemory-policy``) ignore it. Keys not both held are skipped."""
        self._check_open()
        if len(keys) != len(parents):
            raise InvalidArgumentError(
                f"set_parents: {len(keys)} keys but {len(parents)} parents; expected one per key"
            )
        key = self.namespace.key
        self._link([key(k) for k in keys], [key(p) for p in parents])

    def keys(self) -> Iterator[str]:
        """The keys of this namespace (as given to ``put``; hashes as 16 hex digits)."""
        self._check_open()
        n = len(self.namespace.prefix)
        return (k[n:] for k in self._scan(self.namespace.prefix))

    def close(self) -> None:
        """Releases the backend (connections, file handles); the stored values stay where they
        live (a disk directory or a Redis server outlives the store, host memory does not)."""
        if not self._closed[0]:
            self._closed[0] = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed[0]

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()}, namespace={self.namespace})"

    def describe(self) -> str:
        return self.kind

    # -- for subclasses -------------------------------------------------------------------------
    # A store implements the methods that raise NotImplementedError here (the public methods
    # above call them), or overrides the public methods themselves, as the host store does to
    # make each call one call into the extension.

    def _seal(self, key: str, payload: memoryview) -> StoredForm:
        """The value to store, sealed as it is written (a store that keeps or sends one buffer
        overrides this with ``format.seal_joined``)."""
        return Sealed(self.namespace, key, payload)

    def _put(self, keys: list[str], values: list[StoredForm]) -> list[bool]:
        """Stores the sealed values under full keys; which were stored."""
        raise NotImplementedError

    def _rank(self, keys: list[str], scores: list[float]) -> None:  # noqa: B027 (optional)
        """Scores of full keys for a store whose policy ranks by them; others ignore them."""

    def _link(self, keys: list[str], parents: list[str]) -> None:  # noqa: B027 (optional)
        """Prefix links of full keys for a store that evicts by a budget; others ignore them."""

    def _get(self, keys: list[str]) -> list[Any]:
        """The stored blobs (any buffer) or None; backend errors become None (and are counted
        with :meth:`_error`). A store implements this, or :meth:`_get_checked` when it checks
        values as it reads them."""
        raise NotImplementedError

    def _pop(self, key: str) -> Any:
        """The blob taken out from under ``key``, or None (see :meth:`_get`)."""
        raise NotImplementedError

    def _get_checked(self, keys: list[str]) -> list[Checked]:
        """The payloads under ``keys``, checked: each a view, None (a miss) or the
        :class:`PayloadError` its stored value failed with."""
        return [self._unseal(k, blob) for k, blob in zip(keys, self._get(keys), strict=True)]

    def _pop_checked(self, key: str) -> Checked:
        """:meth:`_get_checked` of one value taken out."""
        return self._unseal(key, self._pop(key))

    def _contains(self, key: str) -> bool:
        raise NotImplementedError

    def _contains_many(self, keys: list[str]) -> list[bool]:
        return [self._contains(k) for k in keys]

    def _delete(self, keys: list[str]) -> list[bool]:
        """Deletes full keys; which held a value."""
        raise NotImplementedError

    @abstractmethod
    def _scan(self, prefix: str) -> Iterable[str]: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _discard_corrupt(self, key: str) -> None:
        """Called for a value that failed its checks: the store removes it."""
        raise NotImplementedError

    def _error(self, what: str, exc: BaseException) -> None:
        self.stats.count_errors()
        log.warning("%s: %s failed: %s", self.describe(), what, exc)

    def _evicted(self, n: int = 1) -> None:
        self.stats.count_evictions(n)

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed[0]:
            raise StoreClosedError(f"{self.describe()}: the store is closed")

    def _unseal(self, key: str, blob: Any) -> Checked:
        if blob is None:
            return None
        try:
            return unseal(self.namespace, key, blob, verify=self.checksummed)
        except PayloadError as exc:
            return exc

    def _served(self, keys: list[str], checked: list[Checked]) -> list[memoryview | None]:
        """The payloads to hand out: a value that failed a check is logged, counted, removed
        and served as a miss."""
        out: list[memoryview | None] = []
        hits = hit_bytes = corrupt = 0
        for key, payload in zip(keys, checked, strict=True):
            if isinstance(payload, PayloadError):
                corrupt += 1
                log.warning("%s: %s is not served: %s", self.describe(), key, payload)
                self._discard_corrupt(key)
                payload = None
            elif payload is not None:
                hits += 1
                hit_bytes += len(payload)
            out.append(payload)
        self.stats.count_gets(hits, hit_bytes, len(keys) - hits, corrupt)
        return out


#: The largest budget a store's index counts (a signed 64-bit byte count).
MAX_BUDGET = 2**63 - 1


class BudgetedStore(KVStore):
    """A store within a byte budget (the host and disk stores): the core's
    :class:`kvtier._core.StoreIndex` counts its values and ranks them under ``policy`` for
    eviction, and ``set_scores`` feeds the policies that rank by a signal."""

    def __init__(self, namespace: Namespace, budget: int, policy: str) -> None:
        super().__init__(namespace)
        # A budget of 0 bytes would make a store that refuses every put.
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= MAX_BUDGET:
            raise InvalidArgumentError(
                f"budget: expected a positive number of bytes (at most 2**63 - 1), got {budget!r}"
            )
        self.budget = budget
        self._index = StoreIndex(policy, budget)
        self._lock = threading.Lock()

    @property
    def policy(self) -> str:
        return self._index.policy

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def _index_key(self, key: str) -> str:
        """What the index knows a full key by."""
        return key

    def _rank(self, keys: list[str], scores: list[float]) -> None:
        with self._lock:
            self._index.set_scores([self._index_key(k) for k in keys], scores)

    def _link(self, keys: list[str], parents: list[str]) -> None:
        index_key = self._index_key
        with self._lock:
            self._index.set_parents([index_key(k) for k in keys], [index_key(p) for p in parents])
