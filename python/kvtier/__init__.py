"""kvtier — a tiered, mixed-precision KV-cache manager for LLM serving.

The Rust core (``kvtier._core``) decides which block lives where and at which precision; Python
moves the bytes. Importing ``kvtier`` needs only numpy: torch, CuPy, transformers, vLLM and redis
are imported by the parts that use them.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from ._core import Core, Plan, prefix_hashes
from .config import KvtierConfig, parse_bytes
from .errors import (
    BlockBusyError,
    BlockLostError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidSequenceError,
    KvtierError,
    MissingDependencyError,
    OutOfCapacityError,
    PlanError,
    TraceError,
)
from .manager import BlockManager, ManagerStats

try:
    __version__ = _metadata.version("kvtier")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "BlockBusyError",
    "BlockLostError",
    "BlockManager",
    "ConfigError",
    "Core",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidSequenceError",
    "KvtierConfig",
    "KvtierError",
    "ManagerStats",
    "MissingDependencyError",
    "OutOfCapacityError",
    "Plan",
    "PlanError",
    "TraceError",
    "__version__",
    "parse_bytes",
    "prefix_hashes",
]
