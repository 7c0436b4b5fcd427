"""Values as files in a directory: one file per key, written atomically, and still there when
the directory is opened again (after a restart, or by another process).

Layout: ``<root>/<namespace digest>/<2 hex digits>/<name>``, where the name is the key when it
is a safe file name (a prefix hash always is) and a digest of it otherwise; the header inside
names the full key either way, so a file read under another key is a miss.

A write goes to a temporary file in the same directory and is renamed over the final name, so
a reader (in this or another process) sees the old value or the new one, never a torn one. A
``pop`` claims the file by renaming it first, so of two processes popping one key only one
gets it. A file that fails its checks is removed. Temporary names start with ``.tmp-``, then
the writer's process and thread, then the final name.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from .._core import read_sealed, read_stored, store_path, write_stored
from ..errors import InvalidArgumentError
from .base import BudgetedStore, Checked
from .format import Namespace, Sealed, header_texts, read_key

_TMP = ".tmp-"


class DiskStore(BudgetedStore):
    """Files under ``root`` within a byte budget: the files ``policy`` ranks lowest are deleted
    to make room (the core's policies, see :class:`kvtier._core.StoreIndex`; a value larger
    than the budget is refused). ``fsync=True`` also makes a value survive a power loss, at
    the cost of syncing each file and, once per batch, each directory a file was renamed into.
    A batch is read or written on up to ``io_threads`` threads (default: the CPUs, at most 8),
    each value hashed as it is read or written.

    The budget is kept by this process's index of the directory, built when it opens, with the
    files in the order they were last written: several processes sharing a directory each keep
    their own view of it.
    """

    kind = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        budget: int,
        *,
        policy: str = "lru",
        fsync: bool = False,
        io_threads: int | None = None,
    ) -> None:
        # One index of paths for every namespace under root.
        super().__init__(namespace, budget, policy)
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(f"root: cannot use {self.root} as a store: {exc}") from exc
        self._root = os.fspath(self.root)
        self.fsync = fsync
        if io_threads is None:
            io_threads = min(8, os.cpu_count() or 1)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise InvalidArgumentError(f"io_threads: expected a count >= 1, got {io_threads!r}")
        self.io_threads = io_threads
        self._load_directory()

    def describe(self) -> str:
        return f"disk store {self.root} ({self.used_bytes}/{self.budget} B, {self.policy})"

    # -- paths ----------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        # A key that is a safe file name is its own file name; it never starts with a dot, so it
        # is never taken for a temporary file (``_core.store_path``).
        return store_path(self._root, key)

    def _load_directory(self) -> None:
        found = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if name.startswith(_TMP):
                    if _abandoned(name, st.st_mtime):
                        _unlink(path)  # a write or pop that died half-way: not a value
                    continue
                found.append((st.st_mtime_ns, path, st.st_size))
        found.sort()
        for _, path, size in found:
            self._admit(path, size)  # over the budget (it was lowered): the oldest go

    def _admit(self, path: str, size: int) -> None:
        """Counts ``size`` bytes under ``path`` and deletes the files evicted for them."""
        with self._lock:
            victims = self._index.admit(path, size)
        for v in victims or ():
            _unlink(v)
        if victims:
            self._evicted(len(victims))

    def _forget(self, path: str) -> None:
        with self._lock:
            self._index.remove(path)

    # -- KVStore --------------------------------------------------------------------------------

    @staticmethod
    def _tmp_tag() -> str:
        """What this thread's temporary names start with: a value's is this and its file name,
        the same each time, since ext4 creates a name it has just removed 25-45 us faster than a
        new one (a 64 KiB write: 48-61 against 83-96 us). No other writer uses it, and its
        writes are one after the other; one a dead process left is written around."""
        return f"{_TMP}{os.getpid()}-{threading.get_ident()}-"

    def _put(self, keys: list[str], values: list[Sealed]) -> list[bool]:
        """The batch written, and counted in the index, in one call (``_core.write_stored``,
        which also keeps the budget and the order of puts)."""
        done, failures, evicted = write_stored(
            self._root,
            keys,
            [v.head for v in values],
            [v.payload for v in values],
            self._index,
            self._tmp_tag(),
            fsync=self.fsync,
            threads=self.io_threads,
        )
        for i, error in failures:
            self._error(f"writing {self._path(keys[i])}", error)
        if evicted:
            self._evicted(evicted)
        return done

    def _read(self, key: str, path: str) -> Checked:
        """The value at ``path``, stored under ``key``, read and checked without the GIL
        (``_core.read_sealed``); a failure to read it is a miss and a counted error."""
        ns = self.namespace
        (read,) = read_sealed([path], ns.digest, [header_texts(ns, key)])
        if isinstance(read, OSError):
            self._error(f"reading {path}", read)
            return None
        return read

    def _get_checked(self, keys: list[str]) -> list[Checked]:
        """The batch read, checked and counted in the index in one call (``_core.read_stored``,
        on up to ``io_threads`` threads without the GIL). A missing file is a miss (and has
        left the index); any other failure to read one is a miss and a counted error."""
        ns = self.namespace
        out = read_stored(
            self._root, keys, ns.digest, ns.packed_texts, self._index, self.io_threads
        )
        for i, read in enumerate(out):
            if isinstance(read, OSError):
                self._error(f"reading {self._path(keys[i])}", read)
                out[i] = None
        return cast(list[Checked], out)  # no OSError is left

    def _index_key(self, key: str) -> str:
        return self._path(key)

    def _pop_checked(self, key: str) -> Checked:
        path = self._path(key)
        directory, _, name = path.rpartition(os.sep)
        claimed = f"{directory}{os.sep}{self._tmp_tag()}{name}"
        try:
            os.rename(path, claimed)  # atomic: one claimant wins
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._error(f"claiming {path}", exc)
            return None
        self._forget(path)
        payload = self._read(key, claimed)
        _unlink(claimed)
        return payload

    def _contains(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def _delete(self, keys: list[str]) -> list[bool]:
        done = []
        for key in keys:
            path = self._path(key)
            self._forget(path)
            done.append(_unlink(path))
        return done

    def _discard_corrupt(self, key: str) -> None:
        self._delete([key])

    def _close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""

    def _scan(self, prefix: str) -> Iterable[str]:
        ns_dir = self.root / prefix.split(":")[1]
        keys = []
        for dirpath, _, names in os.walk(ns_dir):
            for name in names:
                if name.startswith(_TMP):
                    continue
                if not name.startswith("~"):
                    keys.append(prefix + name)
                    continue
                try:  # a digest name: the header knows the key
                    with open(os.path.join(dirpath, name), "rb") as f:
                        key = read_key(f.read(4096))
                except OSError:
                    continue
                if key is not None and key.startswith(prefix):
                    keys.append(key)
        return keys


def _abandoned(tmp_name: str, mtime: float) -> bool:
    """A temporary file whose writer is gone: its process is not alive, or it is an hour old
    (another host's writer, on a shared file system). Another process's write in flight is
    left alone."""
    try:
        pid = int(tmp_name.split("-")[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return True
    except PermissionError:
        pass  # alive, someone else's
    return time.time() - mtime > 3600


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
