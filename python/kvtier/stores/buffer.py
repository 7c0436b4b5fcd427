"""The lookup buffer a prefill process hands KV to a decode process through, over any
:class:`KVStore` (a Redis server when the two run on different machines).

The semantics of vLLM's former ``KVLookupBufferBase`` and ``KVStoreBufferBase``:

- :class:`LookupBuffer`: ``insert(input_tokens, roi, key, value, hidden)`` stores three tensors
  under the tokens the boolean mask ``roi`` selects; ``drop_select(input_tokens, roi)`` takes
  them out again as ``[key, value, hidden]`` (``[None, None, None]`` on a miss), so each entry
  is consumed once; ``drop_select(None, None)`` takes any entry.
- :class:`KVStoreBuffer`: ``put(key, tensor)`` / ``get(key)``, plain named tensors.

Differences from vLLM's in-memory ``SimpleBuffer``, which matched entries by the common prefix
of the selected tokens: a store is looked up by key, so an entry matches only exactly the same
selected tokens. Its key is a digest of them (xxh3-64 of their little-endian int64 bytes, and
their count); the tokens are stored in the entry too and compared on select, so a digest
collision is a miss, never wrong KV. ``drop_select`` returns ``[key, value, hidden]``, not
SimpleBuffer's ``[input_tokens, roi, key, value, hidden]``: the caller holds what it asked with.
The buffer does not slice ``key``/``value`` by ``roi``: they are stored as given. Inserting the
same selected tokens again replaces the earlier entry.

Each entry is one value in the store (which adds its own header and checksum), in a container
of tensors; no pickle. Layout, little-endian::

    magic    4 bytes  b"KVTT"
    version  u8       CONTAINER_VERSION
    count    u8       tensors that follow
    per tensor:
      present  u8     0: None, nothing else follows; 1: a tensor
      dtype    u8 length + ASCII torch dtype name without "torch." ("bfloat16", "float8_e4m3fn")
      ndim     u8
      dims     ndim x u64
      data     numel x itemsize bytes, C order

Entries live in their own namespace (the store's model and tenant, codec ``lookup-buffer`` or
``tensor-buffer``), so KV blocks stored under the store's namespace are never taken by
``drop_select(None, None)``, and a container of another version is a miss.
"""

from __future__ import annotations

import logging
import math
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .._core import digest
from ..errors import InvalidArgumentError, KvtierError, PayloadError, require
from .base import KVStore

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger("kvtier.stores")

__all__ = ["CONTAINER_VERSION", "KVStoreBuffer", "LookupBuffer", "pack_tensors", "unpack_tensors"]

MAGIC = b"KVTT"
CONTAINER_VERSION = 1
_HEAD = struct.Struct("<4sBB")
_U8 = struct.Struct("<B")
_DIM = struct.Struct("<Q")

#: The integer dtypes token ids may come in (hashed as int64 either way).
_TOKEN_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
#: Seeds the digest of the selected tokens, so it differs from every other xxh3 in kvtier.
_TOKENS_SEED = digest(b"kvtier lookup buffer tokens")
_ENTRY_PREFIX = "tokens-"

_B = TypeVar("_B", bound="_Buffer")


def _torch() -> Any:
    return require("torch", "torch", purpose="the lookup buffer stores torch tensors")


def _check_little_endian() -> None:
    # Tensor bytes are written in host order; every platform torch ships for is little-endian.
    if sys.byteorder != "little":
        raise KvtierError("the tensor container is little-endian; this host is big-endian")


# -- the tensor container --------------------------------------------------------------------------


def pack_tensors(tensors: Sequence[Tensor | None]) -> bytes:
    """The container of ``tensors`` (None allowed) as one bytes value. Tensors on another
    device are copied to the CPU first; any dtype whose elements are whole bytes is kept as is
    (quantized and sparse tensors are refused)."""
    torch = _torch()
    _check_little_endian()
    if len(tensors) > 255:
        raise InvalidArgumentError(f"a container holds at most 255 tensors, got {len(tensors)}")
    parts: list[Any] = [_HEAD.pack(MAGIC, CONTAINER_VERSION, len(tensors))]
    for i, t in enumerate(tensors):
        if t is None:
            parts.append(_U8.pack(0))
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"tensor {i}: expected a torch.Tensor or None, got {type(t).__name__}"
            )
        if t.layout != torch.strided or t.is_quantized:
            raise InvalidArgumentError(
                f"tensor {i}: expected a dense tensor, got layout {t.layout}, dtype {t.dtype}"
            )
        name = str(t.dtype).removeprefix("torch.").encode()
        host = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        dims = b"".join(_DIM.pack(d) for d in host.shape)
        parts += [_U8.pack(1), _U8.pack(len(name)), name, _U8.pack(host.ndim), dims]
        parts.append(host.reshape(-1).view(torch.uint8).numpy().data)
    return b"".join(parts)


def unpack_tensors(blob: Any, device: Any = "cpu") -> list[Tensor | None]:
    """The tensors of a container (any buffer), as new tensors on ``device``; raises
    :class:`PayloadError` saying what is wrong with a malformed one."""
    torch = _torch()
    _check_little_endian()
    view = memoryview(blob)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    try:
        magic, version, count = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise PayloadError(f"magic {bytes(magic)!r} is not {MAGIC!r}: not a tensor container")
        if version != CONTAINER_VERSION:
            raise PayloadError(
                f"container version {version}, this kvtier reads {CONTAINER_VERSION}"
            )
        pos = _HEAD.size
        out: list[Tensor | None] = []
        for i in range(count):
            (present,) = _U8.unpack_from(view, pos)
            pos += 1
            if present == 0:
                out.append(None)
                continue
            if present != 1:
                raise PayloadError(f"tensor {i}: present flag {present}, expected 0 or 1")
            (n,) = _U8.unpack_from(view, pos)
            name = bytes(view[pos + 1 : pos + 1 + n]).decode("ascii", errors="replace")
            (ndim,) = _U8.unpack_from(view, pos + 1 + n)
            pos += 2 + n
            dims = [_DIM.unpack_from(view, pos + 8 * d)[0] for d in range(ndim)]
            pos += 8 * ndim
            dtype = _dtype(torch, name, i)
            nbytes = math.prod(dims) * dtype.itemsize
            if pos + nbytes > len(view):
                raise PayloadError(
                    f"tensor {i}: {name}{dims} needs {nbytes} bytes, {len(view) - pos} are left"
                )
            t = torch.empty(dims, dtype=dtype)
            if nbytes:  # copied into a fresh tensor: aligned, writable, owned by the caller
                dst = t.reshape(-1).view(torch.uint8).numpy()
                dst[:] = np.frombuffer(view, np.uint8, count=nbytes, offset=pos)
            pos += nbytes
            out.append(t.to(device))
    except struct.error as exc:
        raise PayloadError(f"tensor container truncated: {exc}") from None
    if pos != len(view):
        raise PayloadError(f"{len(view) - pos} bytes after the last tensor")
    return out


def _dtype(torch: Any, name: str, i: int) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{name}":
        raise PayloadError(f"tensor {i}: unknown dtype {name!r}")
    return dtype


# -- the buffers ------------------------------------------------------------------------------------


def _device(torch: Any, device: Any) -> Any:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device: expected a torch device, got {device!r}") from exc


class _Buffer:
    """What both buffers share: a store view in their own namespace, the device tensors are
    returned on, and closing."""

    codec = ""

    def __init__(self, store: KVStore, device: Any) -> None:
        if not isinstance(store, KVStore):
            raise InvalidArgumentError(
                f"store: expected a kvtier.stores.KVStore, got {type(store).__name__}"
            )
        self._torch = _torch()
        self.device = _device(self._torch, device)
        ns = store.namespace.with_codec(self.codec, "tensors", f"container-v{CONTAINER_VERSION}")
        self.store = store.with_namespace(ns)

    def _unpack(self, blob: Any, key: str) -> list[Tensor | None] | None:
        """The tensors of a stored value; a malformed one is a miss (logged), like the store's
        own checks: the store's checksum passed, so it was written by another version."""
        try:
            return unpack_tensors(blob)
        except PayloadError as exc:
            log.warning("%s: %s is not served: %s", self.store.describe(), key, exc)
            return None

    def _to_device(self, t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(self.device)

    def _check_tensor(self, what: str, t: Any) -> None:
        if not isinstance(t, self._torch.Tensor):
            raise InvalidArgumentError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")

    def close(self) -> None:
        """Closes the store the buffer was made with (the entries stay where they live: a Redis
        server or a directory outlives it, host memory does not)."""
        self.store.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r}, device={self.device})"


class LookupBuffer(_Buffer):
    """KV handed from a prefill process to a decode process, keyed by the selected tokens.
    ``device``: where ``drop_select`` puts the tensors it returns. Thread- and process-safe as
    far as the store is: ``drop_select`` takes an entry with the store's atomic ``pop``, so of
    two consumers only one gets it."""

    codec = "lookup-buffer"

    def __init__(self, store: KVStore, *, device: Any = "cpu") -> None:
        super().__init__(store, device)

    def insert(
        self,
        input_tokens: Tensor,
        roi: Tensor | None,
        key: Tensor,
        value: Tensor,
        hidden: Tensor,
    ) -> bool:
        """Stores ``key``, ``value`` and ``hidden`` under the tokens ``roi`` selects (None: all
        of them). Returns False when the store refused it (budget) or failed (server away):
        the decode side then misses and recomputes."""
        selected = self._selected(input_tokens, roi)
        for what, t in (("key", key), ("value", value), ("hidden", hidden)):
            self._check_tensor(what, t)
        entry = pack_tensors([selected, key, value, hidden])
        return self.store.put(_entry_key(selected), entry)

    def drop_select(self, input_tokens: Tensor | None, roi: Tensor | None) -> list[Tensor | None]:
        """Takes out the entry inserted under exactly the tokens ``roi`` selects (None: all of
        them) and returns ``[key, value, hidden]``, or ``[None, None, None]`` when there is
        none. ``drop_select(None, None)`` takes any entry."""
        if input_tokens is None:
            if roi is not None:
                raise InvalidArgumentError("roi: given without input_tokens; pass both or neither")
            return self._take_any()
        selected = self._selected(input_tokens, roi)
        name = _entry_key(selected)
        blob = self.store.pop(name)
        if blob is None:
            return _miss()
        tensors = self._entry(blob, name)
        if tensors is None:
            return _miss()
        if not self._torch.equal(tensors[0], selected):
            # Two token lists with one digest: not ours. Put it back for whoever it belongs to.
            log.warning("%s: digest collision on %s; a miss", self.store.describe(), name)
            self.store.put(name, blob)
            return _miss()
        return [self._to_device(t) for t in tensors[1:]]

    def _take_any(self) -> list[Tensor | None]:
        for name in self.store.keys():  # noqa: SIM118 (a store, not a dict)
            if not name.startswith(_ENTRY_PREFIX):
                continue
            blob = self.store.pop(name)
            if blob is None:
                continue  # another consumer took it first
            tensors = self._entry(blob, name)
            if tensors is not None:
                return [self._to_device(t) for t in tensors[1:]]
        return _miss()

    def _entry(self, blob: Any, name: str) -> list[Tensor | None] | None:
        tensors = self._unpack(blob, name)
        if tensors is None:
            return None
        if len(tensors) != 4 or any(t is None for t in tensors):
            log.warning("%s: %s is not a lookup-buffer entry", self.store.describe(), name)
            return None
        return tensors

    def _selected(self, input_tokens: Any, roi: Any) -> Tensor:
        """The token ids ``roi`` selects, as a CPU int64 tensor; raises on bad arguments."""
        torch = self._torch
        if (
            not isinstance(input_tokens, torch.Tensor)
            or input_tokens.ndim != 1
            or str(input_tokens.dtype).removeprefix("torch.") not in _TOKEN_DTYPES
        ):
            got = (
                f"a {input_tokens.ndim}-D {input_tokens.dtype} tensor"
                if isinstance(input_tokens, torch.Tensor)
                else type(input_tokens).__name__
            )
            raise InvalidArgumentError(f"input_tokens: expected a 1-D integer tensor, got {got}")
        if len(input_tokens) == 0:
            raise InvalidArgumentError("input_tokens: expected at least one token, got none")
        tokens: Tensor = input_tokens.detach().to("cpu", torch.int64)
        if roi is None:
            return tokens.contiguous()
        if (
            not isinstance(roi, torch.Tensor)
            or roi.dtype != torch.bool
            or roi.shape != tokens.shape
        ):
            got = (
                f"a {roi.dtype} tensor of shape {list(roi.shape)}"
                if isinstance(roi, torch.Tensor)
                else type(roi).__name__
            )
            raise InvalidArgumentError(
                f"roi: expected a boolean tensor of shape [{len(tokens)}] (one flag per token) "
                f"or None, got {got}"
            )
        selected: Tensor = tokens[roi.detach().to("cpu")].contiguous()
        if len(selected) == 0:
            raise InvalidArgumentError("roi: selects no tokens; select at least one")
        return selected


def _miss() -> list[Tensor | None]:
    return [None, None, None]


def _entry_key(selected: Tensor) -> str:
    data = np.ascontiguousarray(selected.numpy(), dtype="<i8").view(np.uint8)
    return f"{_ENTRY_PREFIX}{len(selected)}-{digest(data, seed=_TOKENS_SEED):016x}"


class KVStoreBuffer(_Buffer):
    """Named tensors in a store: ``put(key, tensor)`` / ``get(key)``. ``device``: where ``get``
    puts the tensors it returns."""

    codec = "tensor-buffer"

    def __init__(self, store: KVStore, *, device: Any = "cpu") -> None:
        super().__init__(store, device)

    def put(self, key: str, value: Tensor | None) -> bool:
        """Stores ``value`` under ``key`` (1-200 printable ASCII characters, no spaces), replacing
        what was there. ``put(key, None)`` deletes ``key``, so ``get`` then misses; it returns
        True. Otherwise False when the store refused it (budget) or failed (server away)."""
        self._check_key(key)
        if value is None:
            self.store.delete(key)
            return True
        self._check_tensor("value", value)
        return self.store.put(key, pack_tensors([value]))

    def get(self, key: str) -> Tensor | None:
        """The tensor stored under ``key``, or None."""
        self._check_key(key)
        blob = self.store.get(key)
        if blob is None:
            return None
        tensors = self._unpack(blob, key)
        if tensors is None or len(tensors) != 1:
            return None
        return self._to_device(tensors[0])

    @staticmethod
    def _check_key(key: Any) -> None:
        # The store checks the characters; a non-str (an int would be taken as a hash) is ours.
        if not isinstance(key, str):
            raise InvalidArgumentError(f"key: expected a str, got {type(key).__name__}")
