"""Values as files in a directory: one file per key, written atomically, and still there when
the directory is opened again (after a restart, or by another process).

Layout: ``<root>/<namespace digest>/<2 hex digits>/<name>``, where the name is the key when it
is a safe file name (a prefix hash always is) and a digest of it otherwise; the header inside
names the full key either way, so a file read under another key is a miss.

A write goes to a temporary file in the same directory and is renamed over the final name, so
a reader (in this or another process) sees the old value or the new one, never a torn one. A
``pop`` claims the file by renaming it first, so of two processes popping one key only one
gets it. A file that fails its checks is removed.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .._core import checksum, read_checksummed
from ..errors import InvalidArgumentError
from .base import BudgetedStore
from .format import Namespace, Received, Sealed, read_key

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.=-]{1,120}")
_TMP = ".tmp-"


class DiskStore(BudgetedStore):
    """Files under ``root`` within a byte budget: the files ``policy`` ranks lowest are deleted
    to make room (the core's policies, see :class:`kvtier._core.StoreIndex`; a value larger
    than the budget is refused). ``fsync=True`` also makes a value survive a power loss, at
    the cost of a sync per write.

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
        self._counter = itertools.count()
        self._dirs: set[str] = set()  # directories known to exist (saves a makedirs per put)
        self._load_directory()

    def describe(self) -> str:
        return f"disk store {self.root} ({self.used_bytes}/{self.budget} B, {self.policy})"

    # -- paths ----------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        _, ns, name = key.split(":", 2)  # kvtier:<namespace digest>:<key>
        digest = checksum(np.frombuffer(key.encode(), np.uint8))
        if not _SAFE_NAME.fullmatch(name):
            name = f"~{digest:016x}"
        return f"{self._root}{os.sep}{ns}{os.sep}{digest & 0xFF:02x}{os.sep}{name}"  # join: 3 µs

    def _load_directory(self) -> None:
        found = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if _TMP in name:
                    if _abandoned(name, st.st_mtime):
                        _unlink(path)  # a write or pop that died half-way: not a value
                    continue
                found.append((st.st_mtime_ns, path, st.st_size))
        found.sort()
        for _, path, size in found:
            self._admit(path, size)  # over the budget (it was lowered): the oldest go

    def _admit(self, path: str, size: int) -> bool:
        """Counts ``size`` bytes under ``path`` and deletes the files evicted for them."""
        with self._lock:
            victims = self._index.admit(path, size)
        for v in victims or ():
            _unlink(v)
        if victims:
            self._evicted(len(victims))
        return victims is not None

    def _recount(self, path: str) -> None:
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        if path not in self._index:
            self._admit(path, size)

    def _forget(self, path: str) -> None:
        with self._lock:
            self._index.remove(path)

    # -- KVStore --------------------------------------------------------------------------------

    def _tmp(self, directory: str) -> str:
        return os.path.join(
            directory, f"{_TMP}{os.getpid()}-{threading.get_ident()}-{next(self._counter)}"
        )

    def _put(self, keys: list[str], values: list[Sealed]) -> list[bool]:
        return [self._put_one(k, v) for k, v in zip(keys, values, strict=True)]

    def _put_one(self, key: str, value: Sealed) -> bool:
        if value.size > self.budget:
            return False
        path = self._path(key)
        directory = os.path.dirname(path)
        self._admit(path, value.size)  # room first, so the budget holds while the file is written
        tmp = self._tmp(directory)
        try:
            if directory not in self._dirs:
                os.makedirs(directory, exist_ok=True)
                self._dirs.add(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in value.chunks():
                    view = memoryview(chunk)
                    while view:  # a write may stop short (signals, huge chunks)
                        view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            self._error(f"writing {path}", exc)
            self._forget(path)
            self._recount(path)  # the old value is still there
            self._dirs.discard(directory)  # in case someone removed it: made again next time
            return False
        return True

    def _read(self, paths: list[str]) -> list[Received | None]:
        """The values at ``paths``, read and hashed in one call without the GIL; a missing
        file is a miss (and leaves the index), any other failure a miss and a counted error."""
        out: list[Received | None] = []
        for path, read in zip(paths, read_checksummed(paths), strict=True):
            if isinstance(read, FileNotFoundError):
                self._forget(path)
                out.append(None)
            elif isinstance(read, OSError):
                self._error(f"reading {path}", read)
                out.append(None)
            else:
                out.append(Received(*read))
        return out

    def _get(self, keys: list[str]) -> list[Any]:
        paths = [self._path(k) for k in keys]
        out = self._read(paths)
        with self._lock:
            self._index.touch([p for p, d in zip(paths, out, strict=True) if d is not None])
        return out

    def _index_key(self, key: str) -> str:
        return self._path(key)

    def _pop(self, key: str) -> Any:
        path = self._path(key)
        claimed = self._tmp(os.path.dirname(path))
        try:
            os.rename(path, claimed)  # atomic: one claimant wins
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._error(f"claiming {path}", exc)
            return None
        self._forget(path)
        (data,) = self._read([claimed])
        _unlink(claimed)
        return data

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
                if _TMP in name:
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
