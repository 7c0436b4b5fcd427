"""Stored values: a small versioned header, the payload, and a checksum; and the namespaces
that keep different models, codecs, shapes and tenants apart.

The format is defined once, in Rust (``crates/kvtier-store/src/format.rs``, which documents the
layout): a magic, the format version, the header's and the payload's lengths, the namespace
digest, the key, codec, dtype and shape as texts, then the payload and a CRC-64/NVME of
everything before it (0 in the host store, whose values never leave the process and are never
verified). This module reads its constants (``_core.FORMAT_*``) and seals headers with its
encoder (``_core.seal_header``); values are checked there too (``_core.unseal``; for files
``_core.read_stored`` and ``read_sealed``).

The header names the key it was written under, so a value copied or renamed to another key is a
miss too. Reading checks every field against what the reader expects: a value from another
namespace, codec, shape or format version, a truncated one or one with a flipped bit is refused
(:class:`~kvtier.errors.PayloadError`), never returned. No pickle. The namespace digest covers
the version, so values of another version live under other keys and are never read (a cache
loses nothing it cannot compute again); one found under this version's key anyway is refused
for its version.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .._core import (
    FORMAT_CHECKSUM_BYTES,
    FORMAT_MAGIC,
    FORMAT_OVERHEAD,
    StreamingChecksum,
    copy_checksum,
    digest,
    pack_texts,
    seal_header,
)
from .._core import FORMAT_VERSION as FORMAT_VERSION
from .._core import read_key as read_key
from .._core import unseal as _unseal
from ..errors import InvalidArgumentError

MAGIC = FORMAT_MAGIC
#: Bytes a value adds to its payload beyond the texts of its header.
OVERHEAD = FORMAT_OVERHEAD
_ZERO_SUM = bytes(FORMAT_CHECKSUM_BYTES)


def _sum_field(checksum: int) -> bytes:
    """The trailing checksum field holding ``checksum`` (little-endian, like every field)."""
    return checksum.to_bytes(FORMAT_CHECKSUM_BYTES, "little")


#: Payload bytes hashed and handed to the writer at a time (``Sealed.chunks``): small enough to
#: still be in cache when the writer reads them.
CHUNK = 512 * 1024

_KEY_TEXT = re.compile(r"[\x21-\x7e]{1,200}")


def _key_text(value: Any) -> str:
    if not isinstance(value, str) or not _KEY_TEXT.fullmatch(value):
        raise InvalidArgumentError(
            f"key: expected a 64-bit hash or 1-200 printable ASCII characters without spaces, "
            f"got {value!r}"
        )
    return value


def _field_text(what: str, value: Any, *, empty: bool = False) -> str:
    if (
        not isinstance(value, str)
        or not value.isprintable()
        or len(value) > 200
        or (not value and not empty)
    ):
        raise InvalidArgumentError(f"{what}: expected 1-200 printable characters, got {value!r}")
    return value


@dataclass(frozen=True)
class Namespace:
    """Whose values a store reads and writes: a model (or any name the engines agree on), a
    tenant, and what the bytes are (codec, dtype, shape). Two namespaces that differ in any
    field never see each other's keys, and a value read under the wrong one is a miss.

    ``shape`` is free text (``str(BlockShape)`` for KV blocks); keys are strings or the core's
    64-bit prefix hashes.
    """

    model: str
    tenant: str = "default"
    codec: str = "raw"
    dtype: str = "uint8"
    shape: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "tenant", "codec", "dtype"):
            _field_text(f"namespace {name}", getattr(self, name))
        _field_text("namespace shape", self.shape, empty=True)

    @cached_property
    def digest(self) -> int:
        """Names the namespace in stored keys and headers. It covers the format version, so
        engines running two versions of kvtier on one Redis or directory (a rolling upgrade)
        never read each other's values, nor remove them as foreign: each version's values
        age out by eviction."""
        fields = (self.model, self.tenant, self.codec, self.dtype, self.shape)
        text = "\0".join(("kvtier-namespace", f"format {FORMAT_VERSION}", *fields))
        return digest(text.encode())

    @cached_property
    def packed_texts(self) -> bytes:
        """The header texts after the key (codec, dtype, shape), as stored."""
        return pack_texts(self.codec, self.dtype, self.shape)

    @cached_property
    def prefix(self) -> str:
        """What every stored key of this namespace starts with."""
        return f"kvtier:{self.digest:016x}:"

    def key(self, key: str | int) -> str:
        """The stored key of ``key``: a 64-bit prefix hash (as 16 hex digits) or a string."""
        if type(key) is str and _KEY_TEXT.fullmatch(key):  # the common case, checked inline
            return self.prefix + key
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not 0 <= key < 2**64:
                raise InvalidArgumentError(f"key: expected a 64-bit hash, got {key}")
            return f"{self.prefix}{int(key):016x}"
        return self.prefix + _key_text(key)

    def with_codec(self, codec: str, dtype: str, shape: str) -> Namespace:
        return Namespace(self.model, self.tenant, codec, dtype, shape)


def _empty(size: int) -> np.ndarray:
    return np.empty(size, np.uint8)


def header_texts(ns: Namespace, key: str) -> bytes:
    """The texts of a value's header (key, codec, dtype, shape), as stored."""
    return pack_texts(key) + ns.packed_texts


def header(ns: Namespace, key: str, length: int) -> bytes:
    """The header of a value of ``length`` payload bytes stored under ``key``."""
    return seal_header(ns.digest, key, ns.packed_texts, length)


def payload_view(value: Any) -> memoryview:
    """The bytes of ``value`` (bytes, bytearray, memoryview, a contiguous numpy array or CPU
    torch tensor) as a flat byte view, without copying."""
    if hasattr(value, "__dlpack__") and type(value).__module__.startswith("torch"):
        if value.device.type != "cpu":
            raise InvalidArgumentError(
                f"value: expected bytes or a CPU tensor, got a tensor on {value.device}; "
                "copy it to the host first"
            )
        import torch

        value = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(value)
    except TypeError:
        raise InvalidArgumentError(
            f"value: expected bytes, bytearray, memoryview, a numpy array or a CPU tensor, got "
            f"{type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError("value: expected a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Sealed:
    """A value on its way out: its header, its payload and (once written) its checksum.

    ``chunks()`` gives the value as buffers to write one after another, hashing each payload
    chunk once the writer has taken it and asks for the next, so the hash reads bytes the write
    has just brought into cache: sealing costs a pass over cached bytes instead of one more
    pass over memory (hashing before the write was that pass: a 256 KiB Redis put at batch 1
    went from +17-30 % to -1..+6 % over redis-py). A writer that retries calls ``chunks()``
    again. ``size`` is known before anything is hashed.
    """

    __slots__ = ("head", "payload", "size")

    def __init__(self, ns: Namespace, key: str, payload: memoryview) -> None:
        self.head = header(ns, key, len(payload))
        self.payload = payload
        self.size = len(self.head) + len(payload) + FORMAT_CHECKSUM_BYTES

    @property
    def payload_chunks(self) -> int:
        """How many payload buffers ``chunks()`` gives between the header and the checksum."""
        return -(-len(self.payload) // CHUNK)

    def chunks(self) -> Iterator[Any]:
        digest = StreamingChecksum()
        digest.update(np.frombuffer(self.head, np.uint8))
        yield self.head
        body = np.frombuffer(self.payload, np.uint8)
        for at in range(0, len(body), CHUNK):
            chunk = body[at : at + CHUNK]
            yield chunk
            digest.update(chunk)
        yield _sum_field(digest.digest())


def seal_joined(
    ns: Namespace,
    key: str,
    payload: memoryview,
    alloc: Callable[[int], np.ndarray] | None = None,
    *,
    checksummed: bool = True,
) -> np.ndarray | bytes:
    """The whole stored value in one buffer from ``alloc(size)`` (default: a numpy array): the
    header and the payload are copied and checksummed in one pass (for stores that keep or send
    one buffer).

    ``checksummed=False`` copies without hashing and leaves the checksum field 0, for values
    that never leave this process's memory and so are never verified (the host store); without
    ``alloc`` that value is ``bytes``, joined in one copy."""
    if not checksummed and alloc is None:
        return b"".join((header(ns, key, len(payload)), payload, _ZERO_SUM))
    head = np.frombuffer(header(ns, key, len(payload)), np.uint8)
    body = np.frombuffer(payload, np.uint8)
    end = len(head) + len(body)
    out = (alloc or _empty)(end + FORMAT_CHECKSUM_BYTES)[: end + FORMAT_CHECKSUM_BYTES]
    if checksummed:
        total = copy_checksum(out, head, body)
    else:
        out[: len(head)] = head
        out[len(head) : end] = body
        total = 0
    out[end:] = np.frombuffer(_sum_field(total), np.uint8)
    return out


def unseal(ns: Namespace, key: str, blob: Any, *, verify: bool = True) -> memoryview:
    """The payload of a stored value (bytes or any contiguous buffer) as a read-only view,
    after checking everything (``_core.unseal``, which also computes the checksum); raises
    :class:`PayloadError` saying which check failed. ``verify=False`` skips only the checksum,
    for values that never left this process's memory."""
    return _unseal(blob, ns.digest, header_texts(ns, key), verify=verify)
