"""The caches ``kvtier eval cache`` compares, by name: each *method* is a way to build a
transformers ``Cache`` for the model (the baseline ``DynamicCache``, transformers'
``QuantizedCache``, kvpress's presses on a ``DynamicCache``, kvtier's ``TieredCache`` with several
settings), with the attention implementation it runs the model with."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import KvtierConfig
from ...errors import ConfigError
from ...integrations.hf import TieredCache

__all__ = [
    "DEFAULT_METHODS",
    "KVPRESS_INSTALL",
    "PRESSES",
    "Method",
    "available",
    "method",
    "methods",
]


@dataclass(frozen=True)
class Method:
    """A named way to build a cache for ``model``."""

    name: str
    about: str
    make: Callable[[Any], Any]
    #: the model's attention implementation for this method
    attn: str = "eager"
    #: a kvpress press, built afresh for each prefill, that compresses the cache during it
    press: Callable[[], Any] | None = None
    #: the module this method imports, and how to install it when it is missing
    needs: tuple[str, str] | None = None


def _kvtier(name: str, about: str, attn: str = "eager", **fields: Any) -> Method:
    config = KvtierConfig(**fields)
    return Method(name, about, lambda model: TieredCache(model, config), attn)


_BENCH = "pip install 'kvtier[bench]'"


def _quantized(backend: str, nbits: int) -> Method:
    def make(model: Any) -> Any:
        from transformers import QuantizedCache

        # quanto builds a C++ extension with ninja on first use; the venv's ninja must be found.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return QuantizedCache(backend=backend, config=model.config, nbits=nbits)

    module = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    return Method(
        f"{backend}-int{nbits}",
        f"transformers QuantizedCache, {backend}, {nbits} bits, groups of 64, last 128 tokens full",
        make,
        needs=(module, _BENCH),
    )


#: kvpress's presses that run offline on SmolLM2 (no statistics or weights to download), by the
#: name a method gives them: ``kvpress-<name>@<compression ratio>``.
PRESSES = {"knorm": "KnormPress", "snapkv": "SnapKVPress", "expected": "ExpectedAttentionPress"}
#: kvpress 0.5.5 pins transformers<5.3 (pip would downgrade the model's transformers), so it goes
#: in without its pins, beside the few packages it imports.
KVPRESS_INSTALL = (
    "pip install --no-deps kvpress==0.5.5 datasets multiprocess pyarrow xxhash 'pandas<3' "
    "pytz six 'fire<0.7'"
)


def _kvpress(press: str, ratio: float) -> Method:
    """DynamicCache with kvpress's ``press`` active during every prefill (the first half of a
    perplexity window, a passkey prompt): it drops the fraction ``ratio`` of the prefilled
    tokens' K/V in every layer; what is decoded after the prefill is kept whole."""

    def make_press() -> Any:
        kvpress = importlib.import_module("kvpress")  # untyped, and installed only by hand
        return getattr(kvpress, PRESSES[press])(compression_ratio=ratio)

    return Method(
        f"kvpress-{press}@{ratio:g}",
        f"kvpress {PRESSES[press]}, compression ratio {ratio:g} at prefill, on DynamicCache",
        _dynamic,
        press=make_press,
        needs=("kvpress", KVPRESS_INSTALL),
    )


def _dynamic(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def methods() -> dict[str, Method]:
    """Every method by name; kvtier ones keep the first block and the last 128 tokens at level 0
    (the aggressive one 32), as QuantizedCache keeps its last 128 tokens unquantized."""
    ladder = ("fp32", "int8", "int4")
    rows = [
        Method("dynamic", "transformers DynamicCache (baseline)", _dynamic),
        Method("dynamic-sdpa", "transformers DynamicCache, sdpa attention", _dynamic, "sdpa"),
        _quantized("quanto", 4),
        _quantized("hqq", 4),
        _quantized("quanto", 2),
        _kvtier(
            "kvtier-exact",
            "TieredCache, level 0 only (must equal the baseline)",
            enable_compression=False,
        ),
        _kvtier(
            "kvtier-int8", "TieredCache, int8 beyond the recent window", ladder=("fp32", "int8")
        ),
        _kvtier(
            "kvtier-int4", "TieredCache, int4 beyond the recent window", ladder=("fp32", "int4")
        ),
        _kvtier(
            "kvtier-default", "default ladder fp32,int8,int4, ratio 0.5, importance", ladder=ladder
        ),
        _kvtier(
            "kvtier-exact-attend",
            "TieredCache, level 0 only, attention over the blocks (kvtier attention)",
            "kvtier",
            enable_compression=False,
        ),
        _kvtier(
            "kvtier-default-attend",
            "default ladder, attention over the blocks (kvtier attention; mass from the kernel)",
            "kvtier",
            ladder=ladder,
        ),
        _kvtier("kvtier-h2o", "default ladder, h2o policy", ladder=ladder, policy="h2o"),
        _kvtier(
            "kvtier-h2o-attend",
            "default ladder, h2o policy, attention over the blocks (mass from the kernel)",
            "kvtier",
            ladder=ladder,
            policy="h2o",
        ),
        _kvtier(
            "kvtier-h2o-sdpa",
            "default ladder, h2o policy, sdpa attention (no attention signal)",
            "sdpa",
            ladder=ladder,
            policy="h2o",
        ),
        _kvtier(
            "kvtier-default-sdpa",
            "default ladder, sdpa attention (no attention signal)",
            "sdpa",
            ladder=ladder,
        ),
        _kvtier("kvtier-lru", "default ladder, lru policy", ladder=ladder, policy="lru"),
        _kvtier(
            "kvtier-int4-lean",
            "ladder fp32,int4-g64, blocks of 64, no recent window or sink (quanto's bytes or fewer)",
            ladder=("fp32", "int4-g64"),
            block_size=64,
            recent_window=0,
            sink_blocks=0,
        ),
        _kvtier(
            "kvtier-aggressive",
            "ladder fp32,int8,int4, ratio 0 (all to int4), recent window 32",
            ladder=ladder,
            compression_ratio=0.0,
            recent_window=32,
        ),
        # Below int4 (issue 32): 2-bit blocks, and blocks out of attention altogether.
        _kvtier(
            "kvtier-int2",
            "ladder fp32,int2 (KIVI-style 2 bits) beyond a recent window of 32",
            ladder=("fp32", "int2"),
            recent_window=32,
        ),
        _kvtier(
            "kvtier-int4-int2",
            "ladder fp32,int4,int2, ratio 0.25 (a quarter int4), recent window 32",
            ladder=("fp32", "int4", "int2"),
            compression_ratio=0.25,
            recent_window=32,
        ),
        _kvtier(
            "kvtier-int2-rot",
            "ladder fp32,int2-rot (int2 of Hadamard-rotated vectors), recent window 32",
            ladder=("fp32", "int2-rot"),
            recent_window=32,
        ),
        _kvtier(
            "kvtier-int2-rot-g64",
            "ladder fp32,int2-rot-g64, recent window 16",
            ladder=("fp32", "int2-rot-g64"),
            recent_window=16,
        ),
        _kvtier(
            "kvtier-2bit",
            "ladder fp32,int2-rot,int2-rot-g64, ratio 0.5, recent window 16: the aggressive "
            "ladder (<= 0.25 of the fp16 bytes)",
            ladder=("fp32", "int2-rot", "int2-rot-g64"),
            recent_window=16,
        ),
        _kvtier(
            "kvtier-2bit-attend",
            "kvtier-2bit, attention over the blocks (kvtier attention: rotated codes read in "
            "place, the queries rotated once)",
            "kvtier",
            ladder=("fp32", "int2-rot", "int2-rot-g64"),
            recent_window=16,
        ),
        _kvtier(
            "kvtier-2bit-drop",
            "ladder fp32,int2,drop, drop ratio 0.1, h2o, recent window 32 (<= 0.25 of fp16 bytes)",
            ladder=("fp32", "int2", "drop"),
            drop_ratio=0.1,
            policy="h2o",
            recent_window=32,
        ),
        _kvtier(
            "kvtier-2bit-drop-importance",
            "kvtier-2bit-drop under the importance policy (key magnitude and attention)",
            ladder=("fp32", "int2", "drop"),
            drop_ratio=0.1,
            recent_window=32,
        ),
        _kvtier(
            "kvtier-drop",
            "ladder fp32,drop, drop ratio 0.5, h2o, recent window 32 (eviction only)",
            ladder=("fp32", "drop"),
            drop_ratio=0.5,
            policy="h2o",
            recent_window=32,
        ),
    ]
    rows += [_kvpress(press, ratio) for press in PRESSES for ratio in (0.5, 0.75)]
    return {m.name: m for m in rows}


def method(name: str) -> Method | None:
    """The method called ``name``: one of :func:`methods`, or a press at any compression
    ratio from 0 to 1 (``kvpress-knorm@0.6``); None for a name that is neither."""
    found = methods().get(name)
    if found is not None:
        return found
    family, at, ratio_text = name.partition("@")
    press = family.removeprefix("kvpress-")
    if not (at and family.startswith("kvpress-") and press in PRESSES):
        return None
    try:
        ratio = float(ratio_text)
    except ValueError:
        return None
    return _kvpress(press, ratio) if 0.0 <= ratio < 1.0 else None


DEFAULT_METHODS = (
    "dynamic",
    "dynamic-sdpa",
    "quanto-int4",
    "hqq-int4",
    "kvtier-exact",
    "kvtier-exact-attend",
    "kvtier-int8",
    "kvtier-int4",
    "kvtier-int4-lean",
    "kvtier-default",
    "kvtier-default-attend",
    "kvtier-h2o",
    "kvtier-h2o-attend",
    "kvtier-lru",
    "kvtier-aggressive",
    "quanto-int2",
    "kvtier-int2",
    "kvtier-int4-int2",
    "kvtier-int2-rot",
    "kvtier-int2-rot-g64",
    "kvtier-2bit",
    "kvtier-2bit-attend",
    "kvtier-2bit-drop",
    "kvtier-drop",
)


def available(names: list[str]) -> tuple[list[Method], list[str]]:
    """The methods whose packages are installed, and a note for each left out."""
    found = {name: method(name) for name in names}
    unknown = [name for name, m in found.items() if m is None]
    if unknown:
        presses = "|".join(PRESSES)
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}: expected some of {', '.join(methods())}, "
            f"or kvpress-{{{presses}}}@RATIO with RATIO from 0 to 1 (1 excluded)",
            hint="run 'kvtier eval cache --help' for the methods",
        )
    chosen, skipped = [], []
    for name in names:
        m = found[name]
        assert m is not None
        if m.needs is not None:
            module, install = m.needs
            try:
                importlib.import_module(module)
            except ImportError as exc:
                skipped.append(f"{name}: {module} is not importable ({exc}); {install}")
                continue
        chosen.append(m)
    return chosen, skipped
