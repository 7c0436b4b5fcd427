"""The codec interface: blocks of K/V in, packed bytes out, and back.

A batch of blocks is a tensor ``[n, layers, 2, kv_heads, block_size, head_dim]`` (K then V) in
fp16, bf16 or fp32, on the CPU or a CUDA device. A codec packs each block into one row of
:meth:`Codec.bytes_per_block` bytes, made of named :class:`Section` s (codes, scales, ...), so
a pool of one (tier, level) is simply a ``uint8`` tensor ``[slots, bytes_per_block]``.

Two ways in:

- :meth:`Codec.encode` / :meth:`Codec.decode` / :meth:`Codec.transcode` work on whole batches
  and carry the format along in an :class:`Encoded`, so a payload is never read by the wrong
  codec;
- :meth:`Codec.encode_into` / :meth:`Codec.decode_into` / :meth:`Codec.transcode_into` gather
  from slots of one pool and write slots of another — what ``BlockManager`` uses to execute a
  plan. Every argument is checked before anything is written, so a failed call leaves the pools
  as they were.

Subclasses implement the math as a torch reference (``_encode``/``_decode``) that runs on any
device; a codec with CUDA kernels (``has_kernels``) names them by overriding ``_kernels()``
(:class:`~kvtier.codecs.quant.QuantCodec` returns :mod:`kvtier.codecs.cuda`), and they run for
CUDA tensors when CuPy is installed; a codec with a native CPU implementation (``has_native``)
names it by overriding ``_native()`` (QuantCodec's: :mod:`kvtier.codecs.native`, Rust in the
extension), and it runs for CPU tensors. ``backend="torch"`` forces the reference, ``"cuda"``
and ``"native"`` refuse what they cannot run: this module knows no kernel. The byte layout needs no
torch: ``bytes_per_block`` works with numpy alone, which is how the simulator sizes pools.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from .._torch import DTYPES, as_tensor, cupy_available, dtype_name, torch_dtype, torch_module
from ..errors import InvalidArgumentError, PayloadError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

#: How a call picks its implementation: ``auto`` takes the CUDA kernels for CUDA tensors and the
#: native (Rust) code for CPU tensors where the codec has them, else the torch reference.
Backend = Literal["auto", "torch", "cuda", "native"]

#: The implementation a call runs.
Implementation = Literal["torch", "cuda", "native"]

#: The dtypes of K/V a block holds (keys of :data:`kvtier._torch.DTYPES`, the storage dtypes).
FLOAT_DTYPES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class BlockShape:
    """The shape of one block: K and V of ``block_size`` tokens for every layer and KV head."""

    layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    #: the model's dtype, what ``decode`` returns by default
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "block_size", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{field}: expected a positive integer, got {value!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"dtype: expected one of {', '.join(FLOAT_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, kv_heads, block_size, head_dim)``: a block's tensor shape."""
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def fp16_bytes(self) -> int:
        """Bytes of the block in fp16: the baseline compression ratios are quoted against."""
        return 2 * self.elements

    @classmethod
    def of(cls, tensor: torch.Tensor) -> BlockShape:
        """The block shape of a batch or pool tensor ``[n, layers, 2, kv_heads, block, dim]``."""
        dims = tuple(tensor.shape)
        if len(dims) != 6 or dims[2] != 2:
            raise InvalidArgumentError(
                "expected blocks shaped [n, layers, 2, kv_heads, block_size, head_dim] "
                f"(K and V on axis 2), got {list(dims)}"
            )
        if any(d == 0 for d in dims[1:]):
            raise InvalidArgumentError(f"expected non-empty block dimensions, got {list(dims)}")
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 8:
            raise InvalidArgumentError(
                f"expected K/V in float16, bfloat16 or float32, got {tensor.dtype}"
            )
        _, layers, _, heads, block, dim = dims
        return cls(layers, heads, block, dim, dtype_name(tensor.dtype))


@dataclass(frozen=True)
class Section:
    """One named, typed array inside a packed block."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


@dataclass(frozen=True)
class Encoded:
    """A batch of packed blocks with what it takes to read them back."""

    #: the byte format (a codec's :attr:`Codec.format`) and its version
    format: str
    version: int
    shape: BlockShape
    #: ``uint8 [n, bytes_per_block]``
    data: torch.Tensor

    def __len__(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


class CodecKernels(Protocol):
    """A codec's CUDA kernels (what :meth:`Codec._kernels` returns): pool rows to pool rows, one
    launch a batch, the arguments checked already, the slots int64 tensors on the pools'
    device."""

    def quantize_into(
        self,
        codec: Codec,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        dst: torch.Tensor,
        dst_slots: torch.Tensor,
        shape: BlockShape,
    ) -> None: ...

    def dequantize_into(
        self,
        codec: Codec,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        dst: torch.Tensor,
        dst_slots: torch.Tensor,
        shape: BlockShape,
    ) -> None: ...

    def transcode_into(
        self,
        codec: Codec,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        to: Codec,
        dst: torch.Tensor,
        dst_slots: torch.Tensor,
        shape: BlockShape,
    ) -> None: ...


class NativeKernels(CodecKernels, Protocol):
    """A codec's CPU implementation (what :meth:`Codec._native` returns): the
    :class:`CodecKernels` calls for CPU pools, and one layer of packed rows decoded into a
    ``[n, 2, kv_heads, block_size, head_dim]`` tensor (:meth:`Codec.decode_layer`)."""

    def dequantize_layer(
        self,
        codec: Codec,
        src: torch.Tensor,
        src_slots: Any,
        dst: torch.Tensor,
        shape: BlockShape,
        layer: int,
    ) -> None: ...


class Codec(ABC):
    """Packs blocks of K/V into bytes and back. Subclass it (and register it) to add one."""

    #: registry name, e.g. ``int4`` or ``learned:mine``
    name: str = ""
    #: version of the byte format; bump it when the layout changes
    version: int = 1
    #: decode(encode(x)) == x exactly (for inputs already in the storage dtype)
    lossless: bool = False
    #: CUDA kernels exist for this codec: :meth:`_kernels` returns them
    has_kernels: bool = False
    #: a native CPU implementation exists for this codec: :meth:`_native` returns it
    has_native: bool = False
    #: every section's leading axis is the layer, so one layer decodes from its own bytes
    layer_major: bool = False

    @property
    @abstractmethod
    def format(self) -> str:
        """Identifies the byte format: payloads move only between codecs of equal format."""

    @abstractmethod
    def sections(self, shape: BlockShape) -> tuple[Section, ...]:
        """The arrays of one packed block, in their order in the row."""

    @abstractmethod
    def _encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Reference encoder: ``[n, *shape.dims]`` float -> one tensor per section."""

    @abstractmethod
    def _decode(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        """Reference decoder: sections -> ``[n, *shape.dims]``, fp32 or the storage dtype."""

    def max_magnitude(self, dtype: str) -> float:
        """The largest ``|value|`` of ``dtype`` K/V (``fp16``, ``bf16``, ``fp32``) this codec
        stores within its error bound: past it a value would come back clamped (or worse).
        :meth:`encode` refuses larger values, and a :class:`~kvtier.BlockManager` K/V its
        ladder cannot hold. Unbounded by default (a user's codec knows its own range)."""
        return math.inf

    def check_shape(self, shape: BlockShape) -> None:  # noqa: B027 - optional hook
        """Raise :class:`InvalidArgumentError` if this codec cannot pack blocks of ``shape``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name or '?'} format={self.format}>"

    def _kernels(self) -> CodecKernels:
        """This codec's CUDA kernels, for a codec with :attr:`has_kernels` (it overrides this; the
        kernels' module is imported when first asked for, so this one imports none)."""
        raise TypeError(f"codec {self.name!r} has no CUDA kernels")

    def _native(self) -> NativeKernels:
        """This codec's native CPU implementation, for a codec with :attr:`has_native` (it
        overrides this, importing the module when first asked for)."""
        raise TypeError(f"codec {self.name!r} has no native implementation")

    # -- layout ---------------------------------------------------------------------------------

    def bytes_per_block(self, shape: BlockShape) -> int:
        self.check_shape(shape)
        return sum(s.nbytes for s in self.sections(shape))

    def offsets(self, shape: BlockShape) -> dict[str, int]:
        """Byte offset of each section within a packed row."""
        out, at = {}, 0
        for s in self.sections(shape):
            out[s.name] = at
            at += s.nbytes
        return out

    def pack(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        """Sections -> ``uint8 [n, bytes_per_block]`` rows."""
        torch = torch_module()
        n = next(iter(parts.values())).shape[0]
        device = next(iter(parts.values())).device
        rows = torch.empty((n, self.bytes_per_block(shape)), dtype=torch.uint8, device=device)
        self._write_parts(rows, Slots(torch.arange(n), slice(0, n)), parts, shape)
        return rows

    def unpack(self, rows: torch.Tensor, shape: BlockShape) -> dict[str, torch.Tensor]:
        n, parts, at = rows.shape[0], {}, 0
        for s in self.sections(shape):
            chunk = rows[:, at : at + s.nbytes].contiguous()
            parts[s.name] = chunk.view(torch_dtype(s.dtype)).reshape(n, *s.shape)
            at += s.nbytes
        return parts

    def _write_parts(
        self, pool: torch.Tensor, slots: Slots, parts: dict[str, torch.Tensor], shape: BlockShape
    ) -> None:
        """Write each section straight into its columns of the destination rows (no concat)."""
        torch = torch_module()
        at = 0
        for s in self.sections(shape):
            part = parts[s.name].to(torch_dtype(s.dtype)).contiguous()
            flat = part.view(torch.uint8).reshape(len(slots), s.nbytes)
            if slots.span is not None:
                pool[slots.span, at : at + s.nbytes] = flat
            else:
                pool[slots.index, at : at + s.nbytes] = flat
            at += s.nbytes

    # -- whole batches --------------------------------------------------------------------------

    def encode(self, blocks: Any, *, backend: Backend = "auto") -> Encoded:
        """Pack a batch ``[n, layers, 2, kv_heads, block_size, head_dim]`` (any DLPack tensor)."""
        torch = torch_module()
        blocks = as_tensor(blocks, "blocks")
        shape = BlockShape.of(blocks)
        check_range(blocks, self.max_magnitude(shape.dtype), repr(self.name))
        n = blocks.shape[0]
        out = torch.empty((n, self.bytes_per_block(shape)), dtype=torch.uint8, device=blocks.device)
        every = torch.arange(n, dtype=torch.int64)
        self.encode_into(blocks, every, out, every, backend=backend)
        return Encoded(self.format, self.version, shape, out)

    def decode(
        self, encoded: Encoded, *, dtype: Any = None, backend: Backend = "auto"
    ) -> torch.Tensor:
        """Unpack to ``[n, *shape.dims]`` in ``dtype`` (default: the model dtype it was encoded
        from). Raises :class:`PayloadError` for another format, version or a truncated batch."""
        torch = torch_module()
        self.check_payload(encoded)
        shape = encoded.shape
        out_dtype = torch_dtype(shape.dtype) if dtype is None else dtype
        n = len(encoded)
        out = torch.empty((n, *shape.dims), dtype=out_dtype, device=encoded.data.device)
        every = torch.arange(n, dtype=torch.int64)
        self.decode_into(encoded.data, every, out, every, backend=backend)
        return out

    def transcode(self, encoded: Encoded, to: Codec, *, backend: Backend = "auto") -> Encoded:
        """Repack a batch in another codec's format (a level move): dequantized values stay
        fp32 in between, never rounded to the model dtype; on CUDA, quantized-to-quantized
        moves never hold the dequantized values in global memory."""
        torch = torch_module()
        self.check_payload(encoded)
        shape = encoded.shape
        n = len(encoded)
        out = torch.empty(
            (n, to.bytes_per_block(shape)), dtype=torch.uint8, device=encoded.data.device
        )
        every = torch.arange(n, dtype=torch.int64)
        self.transcode_into(encoded.data, every, to, out, every, shape, backend=backend)
        return Encoded(to.format, to.version, shape, out)

    def check_payload(self, encoded: Encoded) -> None:
        if not isinstance(encoded, Encoded):
            raise InvalidArgumentError(
                f"expected an Encoded batch (from Codec.encode), got {type(encoded).__name__}"
            )
        if encoded.format != self.format or encoded.version != self.version:
            raise PayloadError(
                f"payload is format {encoded.format!r} v{encoded.version}; codec {self.name!r} "
                f"reads {self.format!r} v{self.version}"
            )
        want = self.bytes_per_block(encoded.shape)
        data = encoded.data
        if data.dtype != torch_module().uint8 or data.dim() != 2 or data.shape[1] != want:
            raise PayloadError(
                f"payload truncated or malformed: expected uint8 [n, {want}] for {encoded.shape}, "
                f"got {data.dtype} {list(data.shape)}"
            )

    # -- pools ----------------------------------------------------------------------------------

    def encode_into(
        self, src: Any, src_slots: Any, dst: Any, dst_slots: Any, *, backend: Backend = "auto"
    ) -> None:
        """Pack blocks ``src[src_slots]`` of a float pool into rows ``dst[dst_slots]`` of a
        packed pool ``uint8 [slots, bytes_per_block]``. The blocks' values must be within
        :meth:`max_magnitude` (unchecked here, for speed: a :class:`~kvtier.BlockManager`
        checks K/V as it is appended; :meth:`encode` checks its batch)."""
        src, dst = as_tensor(src, "src"), as_tensor(dst, "dst")
        shape = BlockShape.of(src)
        check_pool(src, "src", None)
        check_pool(dst, "dst", self.bytes_per_block(shape))
        s, d = slot_pair(src_slots, src, dst_slots, dst)
        if not len(s):
            return
        run = self._implementation(backend, src, dst)
        if run == "cuda":
            self._kernels().quantize_into(self, src, s.index, dst, d.index, shape)
        elif run == "native":
            self._native().quantize_into(self, src, s.index, dst, d.index, shape)
        else:
            self._write_parts(dst, d, self._encode(s.read(src)), shape)

    def decode_into(
        self, src: Any, src_slots: Any, dst: Any, dst_slots: Any, *, backend: Backend = "auto"
    ) -> None:
        """Unpack rows ``src[src_slots]`` of a packed pool into blocks ``dst[dst_slots]`` of a
        float pool (its dtype is the output dtype)."""
        src, dst = as_tensor(src, "src"), as_tensor(dst, "dst")
        shape = BlockShape.of(dst)
        check_pool(src, "src", self.bytes_per_block(shape))
        check_pool(dst, "dst", None)
        s, d = slot_pair(src_slots, src, dst_slots, dst)
        if not len(s):
            return
        run = self._implementation(backend, src, dst)
        if run == "cuda":
            self._kernels().dequantize_into(self, src, s.index, dst, d.index, shape)
        elif run == "native":
            self._native().dequantize_into(self, src, s.index, dst, d.index, shape)
        else:
            d.write(
                dst, saturate_to(self._decode(self.unpack(s.read(src), shape), shape), dst.dtype)
            )

    def transcode_into(
        self,
        src: Any,
        src_slots: Any,
        to: Codec,
        dst: Any,
        dst_slots: Any,
        shape: BlockShape,
        *,
        backend: Backend = "auto",
    ) -> None:
        """Repack rows ``src[src_slots]`` (this format) as rows ``dst[dst_slots]`` of ``to``."""
        src, dst = as_tensor(src, "src"), as_tensor(dst, "dst")
        check_pool(src, "src", self.bytes_per_block(shape))
        check_pool(dst, "dst", to.bytes_per_block(shape))
        s, d = slot_pair(src_slots, src, dst_slots, dst)
        if not len(s):
            return
        run = self._implementation(backend, src, dst, to)
        if run == "cuda" and to.has_kernels:
            self._kernels().transcode_into(self, src, s.index, to, dst, d.index, shape)
        elif run == "native":
            self._native().transcode_into(self, src, s.index, to, dst, d.index, shape)
        else:
            values = self._decode(self.unpack(s.read(src), shape), shape)
            to._write_parts(dst, d, to._encode(values), shape)

    def decode_layer(
        self,
        rows: torch.Tensor,
        shape: BlockShape,
        layer: int,
        *,
        slots: torch.Tensor | None = None,
        dtype: Any = None,
        device: Any = None,
    ) -> torch.Tensor:
        """One layer of packed rows ``uint8 [n, bytes_per_block]`` (or of rows ``slots`` of a
        pool), decoded to ``[n, 2, kv_heads, block_size, head_dim]`` in ``dtype`` (default: the
        model dtype) on ``device`` (default: the rows' device).

        Attention reads one layer at a time: a layer-major codec reads, and moves to ``device``,
        only that layer's bytes of each section; any other codec decodes whole blocks. Host
        rows decoded onto a GPU cross the bus encoded, in one copy from pinned memory, and
        decode there (with the CUDA kernels where the codec has them)."""
        rows = as_tensor(rows, "rows")
        check_pool(rows, "rows", self.bytes_per_block(shape))
        if not 0 <= layer < shape.layers:
            raise InvalidArgumentError(f"layer: expected 0 <= layer < {shape.layers}, got {layer}")
        out_dtype = torch_dtype(shape.dtype) if dtype is None else dtype
        device = rows.device if device is None else device
        native = self._native_rows(rows, slots, out_dtype, device)
        if native is not None:
            torch = torch_module()
            out = torch.empty((len(native), *shape.dims[1:]), dtype=out_dtype)
            self._native().dequantize_layer(self, rows, native, out, shape, layer)
            return out
        torch = torch_module()
        pick = slice(None) if slots is None else slots.to(rows.device)
        if not self.layer_major:
            whole = self.unpack(rows[pick].to(device), shape)
            return saturate_to(self._decode(whole, shape)[:, layer], out_dtype)
        one = BlockShape(1, shape.kv_heads, shape.block_size, shape.head_dim, shape.dtype)
        layer_rows = self.layer_rows(rows, pick, shape, layer)
        device = torch.device(device)
        if device.type == "cuda" and layer_rows.device.type == "cpu":
            layer_rows = layer_rows.pin_memory().to(device, non_blocking=True)
        else:
            layer_rows = layer_rows.to(device)
        if layer_rows.is_cuda:  # the CUDA kernels, where the codec has them
            out = torch.empty((len(layer_rows), *one.dims), dtype=out_dtype, device=device)
            every = torch.arange(len(out))
            self.decode_into(layer_rows, every, out, every)
            return out[:, 0]
        return saturate_to(self._decode(self.unpack(layer_rows, one), one)[:, 0], out_dtype)

    def layer_rows(
        self, rows: torch.Tensor, pick: Any, shape: BlockShape, layer: int
    ) -> torch.Tensor:
        """Rows ``pick`` of a layer-major codec's packed ``rows``, cut to layer ``layer``: each
        section's bytes of that layer, in order, which is the packed row of a one-layer block
        (``uint8 [n, bytes_per_block(one layer)]``, contiguous, on the rows' device)."""
        torch = torch_module()
        return torch.cat([rows[pick, cols] for cols, _ in self.layer_columns(shape, layer)], 1)

    def write_layer_rows(
        self,
        pool: torch.Tensor,
        slots: torch.Tensor,
        shape: BlockShape,
        layer: int,
        rows: torch.Tensor,
    ) -> None:
        """The inverse of :meth:`layer_rows`: ``rows``, packed rows of one-layer blocks (what
        :meth:`encode` of ``blocks[:, None]`` gives for one layer of ``blocks``), written at
        layer ``layer`` of rows ``slots`` of a layer-major codec's packed ``pool`` (the other
        layers' bytes untouched)."""
        for cols, at in self.layer_columns(shape, layer):
            pool[slots, cols] = rows[:, at : at + cols.stop - cols.start]

    def layer_columns(self, shape: BlockShape, layer: int) -> Iterator[tuple[slice, int]]:
        """Per section of a layer-major codec's packed row: the columns of layer ``layer``'s
        bytes, and where they start in the packed row of a one-layer block."""
        if not self.layer_major:
            raise InvalidArgumentError(
                f"codec {self.name!r} is not layer-major: a layer of its blocks has no bytes of "
                "its own"
            )
        at = one = 0
        for s in self.sections(shape):
            per_layer = s.nbytes // shape.layers
            yield slice(at + layer * per_layer, at + (layer + 1) * per_layer), one
            at, one = at + s.nbytes, one + per_layer

    def _native_rows(
        self, rows: torch.Tensor, slots: torch.Tensor | None, out_dtype: Any, device: Any
    ) -> Any:
        """The rows :meth:`decode_layer` decodes natively (a numpy array of slots), or None
        where the torch path runs it: a codec without a native implementation, a tensor off
        the CPU, another output dtype, or slots that are not in-range indices (the torch path
        gives them their indexing meaning, negative or boolean)."""
        torch = torch_module()
        if not (self.has_native and self.layer_major and rows.device.type == "cpu"):
            return None
        if torch.device(device).type != "cpu" or out_dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        ):
            return None
        if slots is None:
            return np.arange(rows.shape[0])
        idx = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else None
        if idx is None or idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            return None
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows.shape[0]):
            return None
        return idx

    # -- backend choice -------------------------------------------------------------------------

    def _implementation(
        self, backend: Backend, src: torch.Tensor, dst: torch.Tensor, to: Codec | None = None
    ) -> Implementation:
        """What runs a call from pool ``src`` to pool ``dst`` (into codec ``to``'s format for a
        transcode); ``cuda`` or ``native`` asked for but impossible raise."""
        if backend == "torch":
            return "torch"
        on_cuda = src.is_cuda and dst.is_cuda
        on_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
        native = self.has_native and (to is None or to.has_native)
        if backend == "cuda":
            if not (on_cuda and self.has_kernels):
                raise InvalidArgumentError(
                    f"backend='cuda' needs CUDA tensors and a codec with kernels; codec "
                    f"{self.name!r} has_kernels={self.has_kernels}, tensors on "
                    f"{src.device} and {dst.device}"
                )
            return "cuda"
        if backend == "native":
            if not (on_cpu and native):
                codecs = f"codec {self.name!r} has_native={self.has_native}"
                if to is not None:
                    codecs += f", codec {to.name!r} has_native={to.has_native}"
                raise InvalidArgumentError(
                    f"backend='native' needs CPU tensors and codecs with a native "
                    f"implementation; {codecs}, tensors on {src.device} and {dst.device}"
                )
            return "native"
        if backend != "auto":
            raise InvalidArgumentError(
                f"backend: expected 'auto', 'torch', 'cuda' or 'native', got {backend!r}"
            )
        if on_cuda and self.has_kernels and cupy_available():
            return "cuda"
        if on_cpu and native and not _overlap(src, dst):
            return "native"
        return "torch"


# -- argument checks (all of them run before anything is written) --------------------------------


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes may overlap (the native path writes while it reads; torch's
    gathers copy first)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_range(values: torch.Tensor, limit: float, holder: str) -> None:
    """Refuses ``values`` with a NaN, an infinity or a magnitude past ``limit`` (what
    ``holder`` holds), when their dtype can hold such values at all."""
    torch = torch_module()
    if limit >= torch.finfo(values.dtype).max or not values.numel():
        return
    lo, hi = torch.aminmax(values)
    largest = max(-float(lo), float(hi))
    if not largest <= limit:  # NaN compares false
        raise InvalidArgumentError(
            f"blocks: expected finite values of magnitude at most {limit:.7g} (the most "
            f"{holder} holds for {dtype_name(values.dtype)} K/V), got {largest:.7g}"
        )


def saturate_to(values: torch.Tensor, dtype: Any) -> torch.Tensor:
    """Decoded ``values`` in ``dtype``, saturating at fp16's largest value rather than
    overflowing to inf: a value decoded from an fp16 scale rounded up can land just past
    65504 (127 * 516 = 65532 for a block of 65504s), which append took as finite."""
    torch = torch_module()
    if dtype == torch.float16 and values.dtype != torch.float16:
        values = values.clamp(-65504.0, 65504.0)
    return values.to(dtype)


def check_pool(pool: torch.Tensor, what: str, row_bytes: int | None) -> None:
    """A float pool (``row_bytes`` None; shape checked by BlockShape.of) or a packed pool."""
    torch = torch_module()
    if row_bytes is not None and (
        pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != row_bytes
    ):
        raise InvalidArgumentError(
            f"{what}: expected a packed pool uint8 [slots, {row_bytes}], "
            f"got {pool.dtype} {list(pool.shape)}"
        )
    if not pool.is_contiguous():
        raise InvalidArgumentError(
            f"{what}: expected a contiguous tensor (strides {pool.stride()}); call .contiguous()"
        )


@dataclass(frozen=True)
class Slots:
    """Checked slot indices on a pool's device; ``span`` is set when they are one ascending
    run, so the torch path can use a view instead of a gather or a scatter."""

    index: torch.Tensor
    span: slice | None

    def __len__(self) -> int:
        return int(self.index.numel())

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        return pool[self.span] if self.span is not None else pool[self.index]

    def write(self, pool: torch.Tensor, rows: torch.Tensor) -> None:
        if self.span is not None:
            pool[self.span] = rows
        else:
            pool[self.index] = rows.to(pool.dtype)


def slot_pair(
    src_slots: Any, src: torch.Tensor, dst_slots: Any, dst: torch.Tensor
) -> tuple[Slots, Slots]:
    """Checked slot indices: equal lengths, in range, distinct destinations (two writes to one
    slot would race on a GPU)."""
    if src.device != dst.device:
        raise InvalidArgumentError(
            f"expected src and dst pools on one device, got {src.device} and {dst.device}"
        )
    s = _slots(src_slots, "src_slots", src.shape[0])
    d = _slots(dst_slots, "dst_slots", dst.shape[0])
    if s.shape != d.shape:
        raise InvalidArgumentError(
            f"expected as many src_slots as dst_slots, got {s.numel()} and {d.numel()}"
        )
    if d.numel() and d.unique().numel() != d.numel():
        raise InvalidArgumentError("dst_slots: expected distinct slots, got a repeated slot")
    return _on(s, src.device), _on(d, dst.device)


def _on(slots: torch.Tensor, device: torch.device) -> Slots:
    torch = torch_module()
    n = slots.numel()
    span = None
    if n and bool((slots == torch.arange(int(slots[0]), int(slots[0]) + n)).all()):
        span = slice(int(slots[0]), int(slots[0]) + n)
    return Slots(slots.to(device), span)


def _slots(slots: Any, what: str, rows: int) -> torch.Tensor:
    torch = torch_module()
    if isinstance(slots, torch.Tensor):
        t = slots.detach().cpu()
    else:
        try:
            t = torch.as_tensor(slots)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"{what}: expected a 1-D array of slot indices") from exc
    if t.dim() != 1 or (t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool)):
        raise InvalidArgumentError(
            f"{what}: expected a 1-D integer array of slot indices, got {t.dtype} {list(t.shape)}"
        )
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= rows):
        raise InvalidArgumentError(
            f"{what}: expected slots in [0, {rows}), got min {int(t.min())} max {int(t.max())}"
        )
    return t
