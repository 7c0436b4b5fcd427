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
a saved ``--json`` result (``--from-json``). Several saved results of runs with the same settings
(each with a few ``--methods``) merge into one (``--from-json`` again for each), their figures
against ``dynamic`` taken from whichever holds it.

Each method runs the model with an attention implementation: ``eager`` (the default, so that
attention weights reach the scheduler), ``sdpa``, or ``kvtier`` (attention over the blocks,
:func:`kvtier.integrations.hf.kvtier_attention`, whose kernel reports the attention mass).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ...cli import CommandParser, non_negative_int, positive_int
from ...errors import ConfigError, require
from ...results import add_save_option, save_if_asked
from .methods import DEFAULT_METHODS, KVPRESS_INSTALL, PRESSES, Method, available, method, methods
from .metrics import (
    CHUNK,
    PASSKEY_DEPTHS,
    PASSKEY_LENGTHS,
    SPEED_NEW,
    SPEED_PROMPTS,
    WINDOW_TOKENS,
    WINDOWS,
    against_baseline,
    cache_bytes,
    passkey,
    passkey_prompt,
    perplexity,
    run,
    speed,
)
from .plot import OFF_SCALE, plot

__all__ = [
    "CHUNK",
    "DEFAULT_METHODS",
    "KVPRESS_INSTALL",
    "OFF_SCALE",
    "PASSKEY_DEPTHS",
    "PASSKEY_LENGTHS",
    "PRESSES",
    "SPEED_NEW",
    "SPEED_PROMPTS",
    "WINDOWS",
    "WINDOW_TOKENS",
    "Method",
    "against_baseline",
    "available",
    "cache_bytes",
    "main",
    "merge",
    "method",
    "methods",
    "passkey",
    "passkey_prompt",
    "perplexity",
    "plot",
    "run",
    "speed",
    "table",
]


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
    add_save_option(parser)
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
        action="append",
        help="read the results from a file of this command's --json output (or --save) instead "
        "of running the models (the options of the run are then ignored); given again, the "
        "files' rows are merged (runs with the same settings, each method once)",
    )
    args = parser.parse_args(argv)
    plot_path = None
    if args.plot:
        require("matplotlib", "plot", purpose="--plot needs matplotlib")
        from ...report import resolve_plot_path

        # Checked now, so that a bad path fails before the run rather than after it.
        plot_path = resolve_plot_path(args.plot)
    if args.from_json is not None:
        result = merge([_load(path) for path in args.from_json], args.from_json)
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
    save_if_asked(args, result, parser.prog, argv)
    if plot_path is not None:
        print(f"wrote {plot(result, plot_path)}", file=sys.stderr)
    return 0


#: What runs must share for their rows to be compared (the text by its file name).
_RUN_SETTINGS = ("model", "windows", "window_tokens", "chunk", "passkey_lengths", "passkey_depths")


def merge(results: list[dict[str, Any]], paths: list[Path] | None = None) -> dict[str, Any]:
    """One result holding the rows of ``results`` (runs with the same settings) in order, each
    row's figures against ``dynamic`` recomputed from the merged rows. The provenance of each
    result that has one (a ``--save``d file) is kept in ``merged_from``."""
    names = [str(p) for p in paths] if paths else [f"result {i + 1}" for i in range(len(results))]
    first = results[0]

    def settings(result: dict[str, Any]) -> dict[str, Any]:
        return {
            **{key: result.get(key) for key in _RUN_SETTINGS},
            "text": Path(str(result.get("text"))).name,
        }

    merged = {k: v for k, v in first.items() if k != "provenance"} | {"rows": [], "skipped": []}
    sources = [
        {"file": name, "provenance": result["provenance"]}
        for name, result in zip(names, results, strict=True)
        if "provenance" in result
    ]
    if sources:
        merged["merged_from"] = sources
    seen: dict[str, str] = {}
    for name, result in zip(names, results, strict=True):
        if settings(result) != settings(first):
            differ = sorted(k for k, v in settings(result).items() if settings(first)[k] != v)
            raise ConfigError(
                f"{name} was run with other settings than {names[0]} ({', '.join(differ)} "
                "differ): their figures cannot be merged",
                hint="merge results of runs with the same --windows, --tokens, --chunk and "
                "passkey options",
            )
        for row in result["rows"]:
            if row["method"] in seen:
                raise ConfigError(
                    f"method {row['method']} is in both {seen[row['method']]} and {name}",
                    hint="merge results of disjoint --methods",
                )
            seen[row["method"]] = name
            merged["rows"].append(dict(row))
        merged["skipped"] += result["skipped"]
    against_baseline(merged["rows"])
    return merged


def _load(path: Path) -> dict[str, Any]:
    """A result written by ``kvtier eval cache --json`` (or ``--save``)."""
    hint = "give a file written by 'kvtier eval cache --json > FILE' or '--save FILE'"
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
