"""Codecs by name: the built-ins, codecs registered at run time, and codecs other packages
declare in the ``kvtier.codecs`` entry-point group.

A package adds a codec with, in its ``pyproject.toml``::

    [project.entry-points."kvtier.codecs"]
    mine = "my_package.codecs:MyCodec"     # a Codec subclass, a factory, or an instance

and ``get_codec("mine")`` (or a ladder such as ``fp16,int8,mine``) finds it once installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from ..errors import ConfigError
from .base import Codec
from .identity import IdentityCodec
from .quant import Int2Codec, Int4Codec, Int8Codec

ENTRY_POINT_GROUP = "kvtier.codecs"

#: What may be registered: a Codec instance, or a callable (a Codec subclass or a factory)
#: that takes keyword options and returns one.
CodecFactory = Codec | Callable[..., Codec]

_BUILTINS: dict[str, CodecFactory] = {
    "fp16": lambda: IdentityCodec("fp16"),
    "bf16": lambda: IdentityCodec("bf16"),
    "fp32": lambda: IdentityCodec("fp32"),
    "int8": Int8Codec,
    "int4": Int4Codec,
    # values grouped by 64 instead of 32: half the value scales (4.5 bits a value with 32-token
    # blocks), for heads of 64 or more
    "int4-g64": lambda: Int4Codec(group_size=64, name="int4-g64"),
    # int4 of rotated head vectors, as int2-rot: whether the rotation pays at 4 bits too
    # (kvtier eval vllm)
    "int4-rot": lambda: Int4Codec(rotate=True, name="int4-rot"),
    "int2": Int2Codec,
    # values grouped by 64: the leaner int2 (0.203 of fp16 with 16-token blocks and head_dim
    # 128, against int2's 0.219), for heads of 64 or more
    "int2-g64": lambda: Int2Codec(group_size=64, name="int2-g64"),
    # int2 of Hadamard-rotated head vectors (QuaRot): same bytes, a fraction of the error on
    # SmolLM2 (docs/quality.md); the torch reference on every device, staged for attention
    "int2-rot": lambda: Int2Codec(rotate=True, name="int2-rot"),
    "int2-rot-g64": lambda: Int2Codec(group_size=64, rotate=True, name="int2-rot-g64"),
}

_lock = threading.Lock()
_registered: dict[str, CodecFactory] = {}
_entry_points: dict[str, metadata.EntryPoint] | None = None


def register_codec(name: str, codec: CodecFactory, *, replace: bool = False) -> None:
    """Make ``codec`` available as ``name`` in this process (ladders, ``get_codec``)."""
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ConfigError(f"codec name: expected a non-empty lower-case name, got {name!r}")
    if not (isinstance(codec, Codec) or callable(codec)):
        raise ConfigError(
            f"codec {name!r}: expected a Codec, a Codec subclass or a factory, got "
            f"{type(codec).__name__}"
        )
    with _lock:
        if not replace and (name in _registered or name in _BUILTINS):
            raise ConfigError(
                f"codec {name!r} is already registered; pass replace=True to replace it"
            )
        _registered[name] = codec


def unregister_codec(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def get_codec(name: str, **options: Any) -> Codec:
    """The codec called ``name``, built with ``options`` (e.g. ``get_codec("int4",
    group_size=64)``). Run-time registrations come first, then built-ins, then entry points."""
    factory = _find(name)
    if isinstance(factory, Codec):
        if options:
            raise ConfigError(f"codec {name!r} is a ready instance: it takes no options")
        codec = factory
    else:
        try:
            codec = factory(**options)
        except TypeError as exc:
            raise ConfigError(f"codec {name!r}: bad options {options}: {exc}") from exc
        if not isinstance(codec, Codec):
            raise ConfigError(
                f"codec {name!r}: its factory returned {type(codec).__name__}, not a Codec"
            )
    if not codec.name:
        codec.name = name
    return codec


def available_codecs() -> list[str]:
    """Every name ``get_codec`` accepts, sorted."""
    with _lock:
        names = set(_BUILTINS) | set(_registered) | set(_discover())
    return sorted(names)


def _find(name: str) -> CodecFactory:
    with _lock:
        if name in _registered:
            return _registered[name]
        if name in _BUILTINS:  # an installed package cannot take over a built-in name
            return _BUILTINS[name]
        entry = _discover().get(name)
    if entry is None:
        raise ConfigError(
            f"unknown codec {name!r}: expected one of {', '.join(available_codecs())}",
            hint="register it with kvtier.codecs.register_codec or the 'kvtier.codecs' "
            "entry-point group",
        )
    try:
        loaded = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"codec {name!r}: loading entry point {entry.value!r} failed: {exc}"
        ) from exc
    with _lock:
        return _registered.setdefault(name, loaded)


def _discover() -> dict[str, metadata.EntryPoint]:
    global _entry_points
    if _entry_points is None:
        _entry_points = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return _entry_points


def rescan_entry_points() -> None:
    """Forget the entry points seen so far (after installing a package in this process)."""
    global _entry_points
    with _lock:
        _entry_points = None
