"""What a KV cache costs in quality and buys in memory, on a real model: ``kvtier eval cache``.

SmolLM2-135M (fp32, on the CPU, eager attention so that attention weights reach the scheduler)
reads WikiText-2. Each *method* is a transformers ``Cache``: ``DynamicCache`` (the baseline),
transformers' ``QuantizedCache`` (quanto at 4 and 2 bits, HQQ at 4), kvpress's presses on a
``DynamicCache`` (``kvpress-knorm@0.5``: the press, and the fraction of each prefill's tokens it
drops), and ``TieredCache`` with several kvtier settings. For each we measure

- **perplexity**: each window of ``--tokens`` tokens is split in half. The first half is the
  context, run as one prefill; the scheduler then steps (compressing what left the recent
  window), and the second half is teacher-forced ``--chunk`` tokens per forward pass, with a
  scheduler step after each. Only the second half is scored, so every scored prediction attends
  over K/V the cache has really compressed; with ``--chunk 1`` this is token-by-token decoding
  exactly, and larger chunks differ only in that a chunk's own tokens see each other at full
  precision (as the recent window always does);
- **passkey retrieval**: a 5-digit key hidden in filler text at several depths of prompts of
  1K and 2K tokens, then ``generate`` (greedy) through the cache; exact match of the key
  (a press compresses the prompt's prefill, then decodes greedily token by token);
- **KV bytes** held at the end of each window (what the cache's tensors take; kvtier's from its
  pools), against ``DynamicCache``'s, and "fp16-equivalent": the same with every floating-point
  tensor counted at 2 bytes, i.e. the cache a 16-bit deployment of the model would hold;
- **speed** of ``generate`` (greedy, 64 new tokens) after prompts of 512 and 4,096 tokens: the
  decode rate (one over the median time from one new token's logits to the next; the mean
  rate is in the JSON too) and the prefill's seconds.

A press compresses during a prefill only (kvpress's prefill presses): the first half of a
perplexity window, where the other caches compress too, and a passkey prompt; the tokens after
it are kept whole. ``--plot`` draws perplexity against fp16-equivalent bytes, from a run or from
a saved ``--json`` result (``--from-json``).

Each method runs the model with an attention implementation: ``eager`` (the default, so that
attention weights reach the scheduler), ``sdpa``, or ``kvtier`` (attention over the blocks,
:func:`kvtier.integrations.hf.kvtier_attention`, whose kernel reports the attention mass).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..cli import CommandParser, non_negative_int, positive_int
from ..config import KvtierConfig
from ..errors import ConfigError, require
from ..integrations.hf import TieredCache
from . import model as real

WINDOWS = 8
WINDOW_TOKENS = 1024
CHUNK = 16
PASSKEY_LENGTHS = (1024, 2048)
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
SPEED_PROMPTS = (512, 4096)
SPEED_NEW = 64


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
            "kvtier-2bit-drop",
            "ladder fp32,int2,drop, drop ratio 0.1, h2o, recent window 32 (<= 0.25 of fp16 bytes)",
            ladder=("fp32", "int2", "drop"),
            drop_ratio=0.1,
            policy="h2o",
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
    "kvtier-2bit-drop",
    "kvtier-drop",
)


# -- bytes -----------------------------------------------------------------------------------------


def _tensor_bytes(obj: Any, as_fp16: bool) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses such as quanto's are
    opened with ``__tensor_flatten__``); ``as_fp16`` counts floating-point elements at 2 bytes."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = flatten()
            return sum(_tensor_bytes(getattr(obj, n), as_fp16) for n in names)
        size = 2 if as_fp16 and obj.is_floating_point() else obj.element_size()
        return obj.numel() * size
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, as_fp16) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, as_fp16) for v in obj)
    return 0


def cache_bytes(cache: Any) -> tuple[int, int]:
    """``(real, fp16_equivalent)`` K/V bytes the cache holds now."""
    if isinstance(cache, TieredCache):
        held = cache.kv_bytes()
        bm = cache.manager
        assert bm is not None
        fp16_block = bm.shape.fp16_bytes
        level0 = held["blocks"][0]
        return held["held"], held["held"] - level0 * (bm.level_bytes[0] - fp16_block)
    # transformers' layers keep their tensors in attributes (quantized ones in their own types).
    parts = [vars(layer) for layer in cache.layers]
    return _tensor_bytes(parts, False), _tensor_bytes(parts, True)


def _release(cache: Any) -> None:
    if isinstance(cache, TieredCache):
        cache.close()


def _prefill(model: Any, method: Method, ids: torch.Tensor, cache: Any) -> Any:
    """One forward pass of ``ids`` (a row of token ids) into the empty ``cache``, with the
    method's press, if any, compressing the cache during it; the model's output."""
    if method.press is None:
        return model(ids[None], past_key_values=cache, use_cache=True)
    with method.press()(model):
        # kvpress's hooks tell a prefill by the ``cache_position`` keyword, which transformers
        # no longer passes to attention layers (since 5.3): pass it, the layers hand it on.
        return model(
            ids[None], past_key_values=cache, use_cache=True, cache_position=torch.arange(len(ids))
        )


def _positions(start: int, count: int) -> torch.Tensor:
    # Explicit positions: after a press the cache holds fewer tokens than the text has, and
    # the model would otherwise number the next ones from the cache's length.
    return torch.arange(start, start + count)[None]


@torch.no_grad()
def _greedy(
    model: Any,
    method: Method,
    prompt: torch.Tensor,
    new_tokens: int,
    eos: int | None = None,
    on_logits: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Greedy decoding token by token after a prefill of ``prompt`` (the new tokens), for the
    methods ``generate`` cannot serve: a press leaves fewer tokens in the cache than the
    prompt has, where ``generate`` would take the cache's length for the next position."""
    cache = method.make(model)
    try:
        logits = _prefill(model, method, prompt, cache).logits[0, -1]
        out: list[int] = []
        while True:
            on_logits()
            out.append(int(logits.argmax()))
            if len(out) == new_tokens or out[-1] == eos:
                return torch.tensor(out)
            step = torch.tensor([[out[-1]]])
            position = _positions(len(prompt) + len(out) - 1, 1)
            logits = model(
                step, past_key_values=cache, use_cache=True, position_ids=position
            ).logits[0, -1]
    finally:
        _release(cache)


# -- perplexity ------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(
    model: Any, method: Method, windows: torch.Tensor, chunk: int = CHUNK
) -> dict[str, Any]:
    """Perplexity of the second half of each window given the first (see the module doc)."""
    nll, count, real_bytes, fp16_bytes = 0.0, 0, 0, 0
    start = time.perf_counter()
    for ids in windows:
        context = len(ids) // 2
        cache = method.make(model)
        try:
            logits = _prefill(model, method, ids[:context], cache).logits[0, -1:]
            for s in range(context, len(ids) - 1, chunk):
                part = ids[s : min(s + chunk, len(ids) - 1)]
                position = _positions(s, len(part))
                out = model(
                    part[None], past_key_values=cache, use_cache=True, position_ids=position
                ).logits[0]
                logits = torch.cat([logits, out])
            target = ids[context:]
            nll += float(F.cross_entropy(logits.float(), target, reduction="sum"))
            count += len(target)
            b = cache_bytes(cache)
            real_bytes += b[0]
            fp16_bytes += b[1]
        finally:
            _release(cache)
    return {
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "kv_bytes": real_bytes // len(windows),
        "kv_bytes_fp16": fp16_bytes // len(windows),
        "seconds": time.perf_counter() - start,
    }


# -- passkey ---------------------------------------------------------------------------------------

_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there.\n"
)
_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> torch.Tensor:
    """Token ids of a prompt of about ``length`` tokens with ``key`` at ``depth`` (0 = start of
    the filler, 1 = its end)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(_INTRO + needle + _QUESTION).input_ids)
    per_filler = len(tokenizer(_FILLER * 10).input_ids) / 10
    fillers = max(1, round((length - fixed) / per_filler))
    before = round(fillers * depth)
    text = _INTRO + _FILLER * before + needle + _FILLER * (fillers - before) + _QUESTION
    return tokenizer(text, return_tensors="pt").input_ids[0]


@torch.no_grad()
def passkey(
    model: Any,
    tokenizer: Any,
    method: Method,
    lengths: tuple[int, ...] = PASSKEY_LENGTHS,
    depths: tuple[float, ...] = PASSKEY_DEPTHS,
    seed: int = 0,
) -> dict[str, Any]:
    """Exact-match accuracy of retrieving a random 5-digit key, one trial per (length, depth)."""
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randrange(10_000, 100_000))
            ids = passkey_prompt(tokenizer, length, depth, key)[None]
            if method.press is not None:
                new = _greedy(model, method, ids[0], 8, tokenizer.eos_token_id)
            else:
                cache = method.make(model)
                try:
                    out = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        past_key_values=cache,
                        do_sample=False,
                        max_new_tokens=8,
                        pad_token_id=tokenizer.eos_token_id,
                    )
                finally:
                    _release(cache)
                new = out[0, ids.shape[1] :]
            answer = tokenizer.decode(new)
            found = "".join(c for c in answer.strip()[:8] if c.isdigit())[:5]
            trials.append(
                {"tokens": ids.shape[1], "depth": depth, "key": key, "found": found == key}
            )
    return {"accuracy": sum(bool(t["found"]) for t in trials) / len(trials), "trials": trials}


# -- speed -----------------------------------------------------------------------------------------


class _StepClock:
    """A logits processor that notes when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.tick()
        return scores

    def tick(self) -> None:
        self.times.append(time.perf_counter())


@torch.no_grad()
def speed(
    model: Any, method: Method, prompt: torch.Tensor, new_tokens: int = SPEED_NEW
) -> dict[str, Any]:
    """A greedy ``generate`` of ``new_tokens`` after ``prompt`` (for a press, the same greedy
    decoding token by token): the prefill's seconds (to the first token's logits) and the decode
    rate (one over the median step between new tokens)."""
    from transformers import LogitsProcessorList

    ids = prompt[None]
    clock = _StepClock()
    if method.press is not None:
        start = time.perf_counter()
        _greedy(model, method, prompt, new_tokens, on_logits=clock.tick)
        return _rates(clock.times, start, len(prompt), new_tokens)
    cache = method.make(model)
    try:
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.generation_config.eos_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    finally:
        _release(cache)
    return _rates(clock.times, start, int(ids.shape[1]), new_tokens)


def _rates(times: list[float], start: float, prompt: int, new_tokens: int) -> dict[str, Any]:
    steps = sorted(b - a for a, b in itertools.pairwise(times))
    # The median step: on a shared machine a few steps stall on other work, and the mean
    # would carry those stalls into one method's figure and not another's.
    median = steps[len(steps) // 2] if steps else 0.0
    return {
        "prompt": prompt,
        "new_tokens": new_tokens,
        "prefill_s": times[0] - start,
        "decode_tokens_per_s": 1 / median if median > 0 else None,
        "decode_mean_tokens_per_s": len(steps) / sum(steps) if steps else None,
    }


# -- the run ---------------------------------------------------------------------------------------


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


def run(
    names: list[str],
    windows: int = WINDOWS,
    tokens: int = WINDOW_TOKENS,
    chunk: int = CHUNK,
    lengths: tuple[int, ...] = PASSKEY_LENGTHS,
    depths: tuple[float, ...] = PASSKEY_DEPTHS,
    speed_new: int = SPEED_NEW,
    speed_prompts: tuple[int, ...] = SPEED_PROMPTS,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    # Methods and text first: a bad name or path must fail before the model takes its seconds
    # to load.
    chosen, skipped = available(names)
    source = real.wikitext_path()
    _, tokenizer = real.load_smollm2("eager")
    text = real.windows(tokenizer, windows, tokens, source)
    prompts = [real.windows(tokenizer, 1, n, source)[0] for n in speed_prompts] if speed_new else []
    rows = []
    for method in chosen:
        model, _ = real.load_smollm2(method.attn)
        progress(f"{method.name}: perplexity")
        row: dict[str, Any] = {"method": method.name, "about": method.about}
        row.update(perplexity(model, method, text, chunk))
        if lengths and depths:
            progress(f"{method.name}: passkey")
            row["passkey"] = passkey(model, tokenizer, method, lengths, depths)
        row["attn"] = method.attn
        for prompt in prompts:
            progress(f"{method.name}: speed, {len(prompt)}-token prompt")
            row.setdefault("speed", []).append(speed(model, method, prompt, speed_new))
        rows.append(row)
    base = next((r for r in rows if r["method"] == "dynamic"), None)
    for r in rows:
        if base is not None:
            r["ppl_change"] = r["perplexity"] / base["perplexity"] - 1
            r["bytes_vs_dynamic"] = r["kv_bytes"] / base["kv_bytes"]
            r["bytes_vs_fp16"] = r["kv_bytes_fp16"] / base["kv_bytes_fp16"]
            for mine, theirs in zip(r.get("speed", []), base.get("speed", []), strict=True):
                if mine["decode_tokens_per_s"] and theirs["decode_tokens_per_s"]:
                    mine["vs_baseline"] = (
                        mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
                    )
    return {
        "model": real.MODEL_ID + " (fp32, CPU; attention per method)",
        "text": str(source),
        "windows": windows,
        "window_tokens": tokens,
        "scored": "second half of each window, after a prefill of the first half",
        "chunk": chunk,
        "passkey_lengths": list(lengths),
        "passkey_depths": list(depths),
        "speed": f"generate, {speed_new} new tokens, greedy, after prompts of "
        f"{', '.join(map(str, speed_prompts))} tokens: decode tokens/s",
        "threads": torch.get_num_threads(),
        "skipped": skipped,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    """A markdown table of the result."""
    prompts = [sp["prompt"] for sp in result["rows"][0].get("speed", [])] if result["rows"] else []
    head = "".join(f" decode tok/s @{n} | x base |" for n in prompts)
    lines = [
        "| method | attention | perplexity | vs baseline | passkey | KV bytes | vs baseline "
        f"| fp16-equiv. vs fp16 |{head}",
        "|---|---|---|---|---|---|---|---|" + "---|---|" * len(prompts),
    ]
    for r in result["rows"]:
        pk = r.get("passkey")
        speeds = "".join(
            f" {_num(sp['decode_tokens_per_s'])} | {_num(sp.get('vs_baseline'), '.2f')} |"
            for sp in r.get("speed", [])
        )
        lines.append(
            f"| {r['method']} | {r.get('attn', 'eager')} | {r['perplexity']:.3f} "
            f"| {r.get('ppl_change', 0) * 100:+.2f} % "
            f"| {'-' if pk is None else format(pk['accuracy'], '.0%')} "
            f"| {r['kv_bytes'] / 1e6:.2f} MB | {r.get('bytes_vs_dynamic', 1):.3f} "
            f"| {r.get('bytes_vs_fp16', 1):.3f} |{speeds}"
        )
    for note in result["skipped"]:
        lines.append(f"\nskipped {note}")
    return "\n".join(lines)


#: Perplexity beyond this many times the baseline's is drawn at the plot's top edge.
OFF_SCALE = 1.5

#: How each family of methods (the method's name up to its first '-') is drawn: kvtier's one
#: colour and marker, each peer its own.
_STYLES = {
    "kvtier": ("tab:blue", "o", "kvtier TieredCache"),
    "dynamic": ("black", "*", "DynamicCache (baseline)"),
    "quanto": ("tab:orange", "s", "QuantizedCache, quanto"),
    "hqq": ("tab:red", "D", "QuantizedCache, HQQ"),
    "kvpress": ("tab:green", "^", "kvpress press on DynamicCache"),
}


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a plot of each method's perplexity against the fp16-equivalent KV bytes it held,
    relative to DynamicCache's (a 16-bit cache holding every token), one labelled point per
    method; returns the file written (``path``, with ``.png`` added when it has no suffix).
    Needs ``kvtier[plot]``."""
    require("matplotlib", "plot", purpose="--plot needs matplotlib")
    from matplotlib.figure import Figure

    from ..report import resolve_plot_path

    out = resolve_plot_path(path)
    rows = [r for r in result["rows"] if "bytes_vs_fp16" in r]
    if not rows:
        raise ConfigError(
            "nothing to plot: no row has bytes relative to the baseline (the run had no "
            "'dynamic' row)",
            hint="run the 'dynamic' method with the others",
        )
    base = next((r for r in rows if r["method"] == "dynamic"), None)
    # Perplexity above OFF_SCALE x the baseline's is drawn at that edge, its value in its name:
    # a collapsed peer (quanto at 2 bits: 10x) would otherwise flatten every other point.
    cap = OFF_SCALE * base["perplexity"] if base is not None else math.inf
    rows = [
        r
        if r["perplexity"] <= cap
        else {**r, "perplexity": cap, "method": f"{r['method']} ({r['perplexity']:.0f}, off scale)"}
        for r in rows
    ]
    # A bare Figure (no pyplot) renders with the Agg canvas and leaves the user's backend alone.
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.add_subplot()
    families: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        families.setdefault(r["method"].split("-")[0], []).append(r)
    for family, group in families.items():
        colour, marker, label = _STYLES.get(family, ("tab:gray", "X", family))
        ax.scatter(
            [r["bytes_vs_fp16"] for r in group],
            [r["perplexity"] for r in group],
            c=colour,
            marker=marker,
            s=70 if marker == "*" else 36,
            label=label,
        )
    _label(ax, rows)
    if base is not None:
        ax.axhline(base["perplexity"], color="black", linewidth=0.6, linestyle="--")
    ax.set_xlabel("KV bytes held, fp16-equivalent, relative to a 16-bit DynamicCache")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(
        f"{result.get('model', '')}: {result.get('windows', '?')} windows of "
        f"{result.get('window_tokens', '?')} tokens of {result.get('text', '')}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=150)
    return out


def _label(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Name each point, moving a name up when it would overlap one already placed nearby."""
    xs = [r["bytes_vs_fp16"] for r in rows]
    ys = [r["perplexity"] for r in rows]
    # Positions in points of the plot's area (about 480 x 310), near enough to spot overlaps.
    x_scale = 480 / ((max(xs) - min(xs)) or 1)
    y_scale = 310 / ((max(ys) - min(ys)) or 1)
    placed: list[tuple[float, float, float]] = []  # left, bottom, right of each name
    for r, x, y in sorted(zip(rows, xs, ys, strict=True), key=lambda t: (t[1], t[2])):
        left, bottom = x * x_scale + 4, y * y_scale + 3
        right = left + 3.6 * len(r["method"])  # 7-point type: about 3.6 points a character
        while any(left < qr and ql < right and abs(bottom - qb) < 9 for ql, qb, qr in placed):
            bottom += 9
        placed.append((left, bottom, right))
        moved = bottom - (y * y_scale + 3)
        ax.annotate(
            r["method"],
            (r["bytes_vs_fp16"], r["perplexity"]),
            xytext=(4, 3 + moved),
            textcoords="offset points",
            fontsize=7,
            arrowprops={"arrowstyle": "-", "linewidth": 0.4, "color": "gray"} if moved else None,
        )


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _window_tokens(text: str) -> int:
    # The first half of a window is the context and the second half is scored: both need a token.
    tokens = positive_int(text)
    if tokens < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return tokens


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of method names, got {text!r}"
        )
    return names


def _lengths(text: str) -> tuple[int, ...]:
    # '' is allowed: it skips the passkey test.
    try:
        return tuple(positive_int(part) for part in text.split(",") if part.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from None


def _depths(text: str) -> tuple[float, ...]:
    depths = []
    for part in filter(str.strip, text.split(",")):
        try:
            depth = float(part)
        except ValueError:
            depth = float("nan")
        if not 0.0 <= depth <= 1.0:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers from 0 to 1, got {text!r}"
            )
        depths.append(depth)
    return tuple(depths)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="kvtier eval cache",
        description="Perplexity, passkey retrieval, KV bytes and tokens/s of DynamicCache, "
        "QuantizedCache, kvpress's presses and kvtier's TieredCache on SmolLM2-135M and "
        "WikiText-2.",
    )
    parser.add_argument(
        "--methods",
        type=_names,
        default=list(DEFAULT_METHODS),
        help=f"comma-separated (default: {','.join(DEFAULT_METHODS)}); others: "
        f"{','.join(n for n in methods() if n not in DEFAULT_METHODS and '@' not in n)}, and "
        "a kvpress press at any "
        f"compression ratio, kvpress-{{{'|'.join(PRESSES)}}}@RATIO (needs kvpress: "
        f"{KVPRESS_INSTALL})",
    )
    parser.add_argument("--windows", type=positive_int, default=WINDOWS, help="WikiText-2 windows")
    parser.add_argument(
        "--tokens", type=_window_tokens, default=WINDOW_TOKENS, help="tokens per window (>= 2)"
    )
    parser.add_argument(
        "--chunk", type=positive_int, default=CHUNK, help="tokens per teacher-forced step"
    )
    parser.add_argument(
        "--passkey-lengths",
        type=_lengths,
        default=PASSKEY_LENGTHS,
        help="prompt lengths in tokens ('' to skip the passkey test; default: "
        f"{','.join(map(str, PASSKEY_LENGTHS))})",
    )
    parser.add_argument(
        "--passkey-depths",
        type=_depths,
        default=PASSKEY_DEPTHS,
        help="where the key sits in the filler, 0 = start, 1 = end (default: "
        f"{','.join(map(str, PASSKEY_DEPTHS))})",
    )
    parser.add_argument(
        "--speed-tokens", type=non_negative_int, default=SPEED_NEW, help="0 skips the speed run"
    )
    parser.add_argument(
        "--speed-prompts",
        type=_lengths,
        default=SPEED_PROMPTS,
        help=f"prompt lengths of the speed runs (default: {','.join(map(str, SPEED_PROMPTS))})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also write a plot of perplexity against fp16-equivalent bytes (.png, .svg, .pdf; "
        "needs kvtier[plot])",
    )
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        type=Path,
        help="read the results from a file of this command's --json output instead of running "
        "the models (the options of the run are then ignored)",
    )
    args = parser.parse_args(argv)
    plot_path = None
    if args.plot:
        require("matplotlib", "plot", purpose="--plot needs matplotlib")
        from ..report import resolve_plot_path

        # Checked now, so that a bad path fails before the run rather than after it.
        plot_path = resolve_plot_path(args.plot)
    if args.from_json is not None:
        result = _load(args.from_json)
    else:
        result = run(
            args.methods,
            windows=args.windows,
            tokens=args.tokens,
            chunk=args.chunk,
            lengths=args.passkey_lengths,
            depths=args.passkey_depths,
            speed_new=args.speed_tokens,
            speed_prompts=args.speed_prompts,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    print(json.dumps(result, indent=2) if args.json else table(result))
    if plot_path is not None:
        print(f"wrote {plot(result, plot_path)}", file=sys.stderr)
    return 0


def _load(path: Path) -> dict[str, Any]:
    """A result written by ``kvtier eval cache --json``."""
    hint = "give a file written by 'kvtier eval cache --json > FILE'"
    try:
        result = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", hint=hint) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}", hint=hint) from None
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and {"method", "perplexity", "kv_bytes"} <= r.keys() for r in rows
    ):
        raise ConfigError(f"{path} holds no rows of 'kvtier eval cache --json'", hint=hint)
    result.setdefault("skipped", [])
    return result
