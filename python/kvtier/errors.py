"""kvtier's exceptions: one hierarchy under :class:`KvtierError`.

Pure Python on purpose: the Rust bindings import these classes by name from ``kvtier.errors`` when
they map a core error, so the names below are a contract with ``crates/kvtier-py``. Each class also
derives from the built-in exception a caller would naturally catch (``ValueError`` for bad input,
``KeyError`` for an unknown id, ``ImportError`` for a missing optional package), so code that knows
nothing about kvtier still handles them sensibly.

Any of them may carry a ``hint``: one line that tells the user what to do next. The CLI prints it
under the error.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = [
    "BlockBusyError",
    "BlockLostError",
    "ConfigError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidSequenceError",
    "KvtierError",
    "MissingDependencyError",
    "OutOfCapacityError",
    "PayloadError",
    "PlanError",
    "TraceError",
    "require",
]


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""

    hint: str | None = None

    def __init__(self, *args: Any, hint: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if hint is not None:
            self.hint = hint


class ConfigError(KvtierError, ValueError):
    """A configuration value (argument or ``KVTIER_*`` variable) is invalid."""


class InvalidArgumentError(KvtierError, ValueError):
    """An argument has the wrong shape, dtype, length or value."""


class _KeyErrorMessage(KvtierError, KeyError):
    # KeyError.__str__ returns repr(arg), which wraps a sentence in quotes; these carry sentences.
    def __str__(self) -> str:
        return Exception.__str__(self)


class InvalidBlockError(_KeyErrorMessage):
    """A block id is unknown or was already freed."""


class InvalidSequenceError(_KeyErrorMessage):
    """A sequence id is unknown or was already freed."""


class OutOfCapacityError(KvtierError):
    """A pool has no free slot for the request (and eviction was not allowed to make room)."""


class PlanError(KvtierError, RuntimeError):
    """A plan was committed or aborted out of order, twice, or after the state it was made for."""


class BlockBusyError(KvtierError):
    """A block can't be changed now: it is pinned, or part of a plan that is not yet committed."""


class PayloadError(KvtierError, ValueError):
    """Packed bytes do not match the codec, block shape or format version reading them, or
    are truncated or corrupt. Nothing is decoded from them."""


class TraceError(KvtierError, ValueError):
    """A trace file can't be read as a request trace: a directory, no requests, not UTF-8,
    truncated gzip, a row with a missing, malformed or out-of-range value, a timestamp that is
    not finite or goes backwards, or hash ids that are not prefix-chained. The message names the
    file, and the line where there is one."""

    hint = (
        "a trace is Mooncake JSON lines (.jsonl, optionally .gz), an Azure CSV or a CSV with "
        "timestamp,input_length,output_length, in arrival order; see 'kvtier simulate --help'"
    )


class BlockLostError(KvtierError):
    """A block's bytes could not be read back from a store tier (corrupt, evicted by the
    server, or the server is gone). Its sequence must be freed and recomputed; nothing wrong
    is ever returned in its place."""


class MissingDependencyError(KvtierError, ImportError):
    """An optional package that this feature needs is not installed."""


def require(module: str, extra: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module``, or raise :class:`MissingDependencyError` naming the extra to install.

    >>> np = require("numpy", "dev")
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        what = purpose or f"this feature of kvtier needs '{module}'"
        install = f"pip install 'kvtier[{extra}]'"
        raise MissingDependencyError(
            f"{what}, which is not importable ({exc}); install it with {install}",
            name=module,
            hint=install,
        ) from exc
