"""What a KV cache costs in quality and buys in memory, on a real model: ``kvtier eval cache``.

SmolLM2-135M (fp32, on the CPU, eager attention so that attention weights reach the scheduler)
reads WikiText-2. Each *method* is a transformers ``Cache``: ``DynamicCache`` (the baseline),
transformers' ``QuantizedCache`` (quanto and HQQ backends, the peers), and ``TieredCache`` with
several kvtier settings. For each we measure

- **perplexity**: each window of ``--tokens`` tokens is split in half. The first half is the
  context, run as one prefill; the scheduler then steps (compressing what left the recent
  window), and the second half is teacher-forced ``--chunk`` tokens per forward pass, with a
  scheduler step after each. Only the second half is scored, so every scored prediction attends
  over K/V the cache has really compressed; with ``--chunk 1`` this is token-by-token decoding
  exactly, and larger chunks differ only in that a chunk's own tokens see each other at full
  precision (as the recent window always does);
- **passkey retrieval**: a 5-digit key hidden in filler text at several depths of prompts of
  1K and 2K tokens, then ``generate`` (greedy) through the cache; exact match of the key;
- **KV bytes** held at the end of each window (what the cache's tensors take; kvtier's from its
  pools), against ``DynamicCache``'s, and "fp16-equivalent": the same with every floating-point
  tensor counted at 2 bytes, i.e. the cache a 16-bit deployment of the model would hold;
- **speed** of ``generate`` (greedy, 64 new tokens) after prompts of 512 and 4,096 tokens: the
  decode rate (one over the median time from one new token's logits to the next; the mean
  rate is in the JSON too) and the prefill's seconds.

Each method runs the model with an attention implementation: ``eager`` (the default, so that
attention weights reach the scheduler), ``sdpa``, or ``kvtier`` (attention over the blocks,
:func:`kvtier.integrations.hf.kvtier_attention`, whose kernel reports the attention mass).
"""

from __future__ import annotations

import argparse
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
from ..errors import ConfigError
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


def _kvtier(name: str, about: str, attn: str = "eager", **fields: Any) -> Method:
    config = KvtierConfig(**fields)
    return Method(name, about, lambda model: TieredCache(model, config), attn)


def _quantized(backend: str) -> Method:
    def make(model: Any) -> Any:
        from transformers import QuantizedCache

        # quanto builds a C++ extension with ninja on first use; the venv's ninja must be found.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return QuantizedCache(backend=backend, config=model.config, nbits=4)

    return Method(
        f"{backend}-int4",
        f"transformers QuantizedCache, {backend}, 4 bits, groups of 64, last 128 tokens full",
        make,
    )


def methods() -> dict[str, Method]:
    """Every method by name; kvtier ones keep the first block and the last 128 tokens at level 0
    (the aggressive one 32), as QuantizedCache keeps its last 128 tokens unquantized."""
    from transformers import DynamicCache

    ladder = ("fp32", "int8", "int4")
    rows = [
        Method(
            "dynamic",
            "transformers DynamicCache (baseline)",
            lambda m: DynamicCache(config=m.config),
        ),
        Method(
            "dynamic-sdpa",
            "transformers DynamicCache, sdpa attention",
            lambda m: DynamicCache(config=m.config),
            "sdpa",
        ),
        _quantized("quanto"),
        _quantized("hqq"),
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
    ]
    return {m.name: m for m in rows}


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
            logits = model(ids[None, :context], past_key_values=cache, use_cache=True).logits[
                0, -1:
            ]
            for s in range(context, len(ids) - 1, chunk):
                part = ids[s : min(s + chunk, len(ids) - 1)]
                out = model(part[None], past_key_values=cache, use_cache=True).logits[0]
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
            answer = tokenizer.decode(out[0, ids.shape[1] :])
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
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def speed(
    model: Any, method: Method, prompt: torch.Tensor, new_tokens: int = SPEED_NEW
) -> dict[str, Any]:
    """A greedy ``generate`` of ``new_tokens`` after ``prompt``: the prefill's seconds (to the
    first token's logits) and the decode rate (one over the median step between new tokens)."""
    from transformers import LogitsProcessorList

    ids = prompt[None]
    cache = method.make(model)
    clock = _StepClock()
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
    times = clock.times
    steps = sorted(b - a for a, b in itertools.pairwise(times))
    # The median step: on a shared machine a few steps stall on other work, and the mean
    # would carry those stalls into one method's figure and not another's.
    median = steps[len(steps) // 2] if steps else 0.0
    return {
        "prompt": int(ids.shape[1]),
        "new_tokens": new_tokens,
        "prefill_s": times[0] - start,
        "decode_tokens_per_s": 1 / median if median > 0 else None,
        "decode_mean_tokens_per_s": len(steps) / sum(steps) if steps else None,
    }


# -- the run ---------------------------------------------------------------------------------------


def available(names: list[str]) -> tuple[list[Method], list[str]]:
    """The methods whose packages are installed, and a note for each left out."""
    table = methods()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}: expected some of {', '.join(table)}",
            hint="run 'kvtier eval cache --help' for the methods",
        )
    chosen, skipped = [], []
    needs = {"quanto-int4": "optimum.quanto", "hqq-int4": "hqq"}
    for name in names:
        module = needs.get(name)
        if module is not None:
            try:
                __import__(module)
            except ImportError:
                skipped.append(f"{name}: {module} is not installed (pip install 'kvtier[bench]')")
                continue
        chosen.append(table[name])
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
    # Methods first: an unknown name must fail before the model takes its seconds to load.
    chosen, skipped = available(names)
    _, tokenizer = real.load_smollm2("eager")
    text = real.windows(tokenizer, windows, tokens)
    prompts = [real.windows(tokenizer, 1, n)[0] for n in speed_prompts] if speed_new else []
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
        "text": "wikitext2_test.raw",
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
        "QuantizedCache and kvtier's TieredCache on SmolLM2-135M and WikiText-2.",
    )
    parser.add_argument(
        "--methods",
        type=_names,
        default=list(DEFAULT_METHODS),
        help=f"comma-separated (default: {','.join(DEFAULT_METHODS)})",
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
    args = parser.parse_args(argv)
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
    return 0
