"""Presenting simulation results: a text table, a plot, and a progress bar.

Everything here reads the result dict of ``kvtier simulate`` (schema: ``docs/simulate-schema.md``)
and nothing else; none of it changes a result. Output goes where the caller says: the CLI prints
:func:`render_table` to stdout and lets :class:`Progress` draw on stderr. matplotlib is imported
only by :func:`plot` (extra ``kvtier[plot]``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from .errors import InvalidArgumentError, MissingDependencyError

__all__ = [
    "Progress",
    "capacity_curves",
    "device_blocks",
    "human_bytes",
    "plot",
    "plot_capacity",
    "policy_label",
    "render_table",
    "resolve_plot_path",
]

TIER_ORDER = ("device", "host", "disk", "remote")

_BOLD = "\033[1m"
_DIM = "\033[2m"
_GREEN = "\033[32m"
_RESET = "\033[0m"


# ---------------------------------------------------------------------------------------------
# Formatting helpers


def human_bytes(n: float | None) -> str:
    """``1536`` → ``'1.50 KiB'``; three significant figures, binary units."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{1000 * s:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def _share(part: int, whole: int) -> str:
    return f"{part:,} ({100 * part / whole:.1f} %)" if whole else f"{part:,}"


def _place_key(ladder: Sequence[str]) -> Callable[[tuple[str, str]], tuple[int, int, str, str]]:
    def key(place: tuple[str, str]) -> tuple[int, int, str, str]:
        tier, level = place
        t = TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)
        lv = list(ladder).index(level) if level in ladder else len(ladder)
        return (t, lv, tier, level)

    return key


def _places(results: Sequence[Mapping[str, Any]], field: str) -> list[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()
    ladder: list[str] = []
    for r in results:
        for level in r.get("ladder", []):
            if level not in ladder:
                ladder.append(level)
        for row in r.get(field, []):
            seen.add((row["tier"], row["level"]))
    return sorted(seen, key=_place_key(ladder))


def _lookup(rows: Iterable[Mapping[str, Any]], place: tuple[str, str]) -> Mapping[str, Any] | None:
    for row in rows:
        if (row["tier"], row["level"]) == place:
            return row
    return None


# ---------------------------------------------------------------------------------------------
# The table


def _header_lines(result: Mapping[str, Any]) -> list[str]:
    lines = []
    trace = result.get("trace") or {}
    if trace:
        name = Path(str(trace.get("path", "?"))).name
        lines.append(
            f"trace   {name} ({trace.get('format', '?')}): "
            f"{_count(trace.get('requests'))} requests, "
            f"{_count(trace.get('block_refs'))} block refs, "
            f"{_count(trace.get('distinct_blocks'))} distinct blocks of "
            f"{trace.get('block_tokens', '?')} tokens, "
            f"{_seconds(trace.get('duration_s'))}"
        )
    model = result.get("model") or {}
    if model:
        per_token = ", ".join(
            f"{level} {human_bytes(b)}" for level, b in (model.get("bytes_per_token") or {}).items()
        )
        lines.append(
            f"model   {model.get('name', '?')}: {model.get('layers', '?')} layers, "
            f"{model.get('kv_heads', '?')} KV heads, head dim {model.get('head_dim', '?')}, "
            f"{model.get('dtype', '?')}; KV per token: {per_token}"
        )
    tiers = result.get("tiers") or []
    if tiers:
        parts = []
        for t in tiers:
            budget = t.get("budget_bytes")
            part = f"{t['tier']} {'unlimited' if budget is None else human_bytes(budget)}"
            if t.get("gbps") is not None:
                part += f" @ {t['gbps']:g} GB/s"
            parts.append(part)
        lines.append("tiers   " + "; ".join(parts))
    return lines


def policy_label(result: Mapping[str, Any]) -> str:
    """A result's policy as a column or a legend names it: ``optimal (offline)`` for a bound
    that reads the trace's future."""
    label = str(result.get("policy", "?"))
    return f"{label} (offline)" if result.get("offline") else label


def render_table(result: Mapping[str, Any], *, color: bool) -> str:
    """A fixed-width text table of a simulate result: rows are metrics, columns are policies.

    ``color`` adds ANSI bold/dim and marks the best policy of each rate in green (never an
    offline bound: no cache can run it); callers pass ``False`` when ``NO_COLOR`` is set or the
    output is not a terminal.
    """
    results: list[Mapping[str, Any]] = list(result.get("results") or [])
    # Each row: (label, values, kind) where kind is "section", "rate" (higher is better) or "".
    rows: list[tuple[str, list[str], str, list[float | None]]] = []

    def row(
        label: str, values: list[str], kind: str = "", nums: list[float | None] | None = None
    ) -> None:
        rows.append((label, values, kind, nums or []))

    def section(label: str) -> None:
        rows.append((label, [""] * len(results), "section", []))

    ladders = [",".join(r.get("ladder", [])) for r in results]
    row("ladder", ladders)
    row("requests", [_count(r.get("requests")) for r in results])
    rejected = [r.get("rejected_requests") or 0 for r in results]
    if any(rejected):
        row(
            "rejected requests",
            [_share(n, r.get("requests") or 0) for n, r in zip(rejected, results, strict=True)],
        )
    own = [r.get("evicted_own_prefix") for r in results]
    if any(own):
        row(
            "own prefix evicted",
            [
                "-" if n is None else _share(n, r.get("requests") or 0)
                for n, r in zip(own, results, strict=True)
            ],
        )
    row(
        "block hit rate",
        [_pct(r.get("block_hit_rate")) for r in results],
        "rate",
        [r.get("block_hit_rate") for r in results],
    )
    row(
        "token hit rate",
        [_pct(r.get("token_hit_rate")) for r in results],
        "rate",
        [r.get("token_hit_rate") for r in results],
    )

    places = _places(results, "hits_by_place")
    if places:
        section("hit blocks by tier/level")
        for place in places:
            values = []
            for r in results:
                hit = _lookup(r.get("hits_by_place", []), place)
                values.append(_share(hit["blocks"], r.get("ref_blocks", 0)) if hit else "-")
            row(f"  {place[0]}/{place[1]}", values)

    places = _places(results, "bytes_by_place")
    if places:
        section("held at the end")
        for place in places:
            values = []
            for r in results:
                held = _lookup(r.get("bytes_by_place", []), place)
                values.append(
                    f"{human_bytes(held['bytes'])} ({held['blocks']:,} blocks)" if held else "-"
                )
            row(f"  {place[0]}/{place[1]}", values)
        tiers = sorted(
            {t for r in results for t in (r.get("peak_bytes_by_tier") or {})},
            key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER), t),
        )
        for tier in tiers:
            row(
                f"  peak {tier}",
                [human_bytes((r.get("peak_bytes_by_tier") or {}).get(tier)) for r in results],
            )

    section("moves")
    for key, label in (
        ("promotions", "promotions (from an exact copy)"),
        ("demotions", "demotions"),
        ("offloads", "offloads"),
        ("fetches", "fetches"),
        ("evictions", "evictions"),
        ("noop_promotions", "lossy, no copy to promote"),
    ):
        row(f"  {label}", [_count((r.get("moves") or {}).get(key)) for r in results])
    row("  bytes moved", [human_bytes((r.get("moves") or {}).get("bytes_moved")) for r in results])
    row("  blocks allocated", [_count(r.get("allocated_blocks")) for r in results])
    row("  blocks released", [_count(r.get("released_blocks")) for r in results])

    section("prefill (estimate)")
    prefill = [r.get("prefill") or {} for r in results]
    row(
        "  time saved",
        [_pct(p.get("saved_fraction")) for p in prefill],
        "rate",
        [p.get("saved_fraction") for p in prefill],
    )
    row(
        "  with cache / without",
        [f"{_seconds(p.get('with_cache_s'))} / {_seconds(p.get('baseline_s'))}" for p in prefill],
    )
    row("wall time", [_seconds(r.get("wall_s")) for r in results])

    # Layout: pad first, colour after, so escape codes never count towards widths.
    headers = [policy_label(r) for r in results]
    label_w = max([len("policy")] + [len(label) for label, *_ in rows])
    col_w = [
        max([len(headers[i])] + [len(values[i]) for _, values, _, _ in rows])
        for i in range(len(results))
    ]

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    out = _header_lines(result)
    if out:
        out.append("")
    head = "policy".ljust(label_w) + "".join(
        "  " + h.rjust(w) for h, w in zip(headers, col_w, strict=True)
    )
    out.append(paint(head, _BOLD))
    out.append("-" * len(head))
    for label, values, kind, nums in rows:
        if kind == "section":
            out.append(paint(label, _DIM))
            continue
        best = None
        if kind == "rate" and len(results) > 1:
            # An offline bound is no contender: the best is the best of those a cache can run.
            known = [
                x
                for x, r in zip(nums, results, strict=True)
                if x is not None and not r.get("offline")
            ]
            best = max(known) if known else None
        cells = []
        for i, (value, w) in enumerate(zip(values, col_w, strict=True)):
            cell = value.rjust(w)
            if best is not None and nums[i] == best and not results[i].get("offline"):
                cell = paint(cell, _GREEN)
            cells.append("  " + cell)
        out.append(label.ljust(label_w) + "".join(cells))

    if any(rejected):
        out.append("")
        out.append(
            "rejected: did not fit on the device even after evicting every cached block; "
            "hits counted, new blocks not cached"
        )
    if any(own):
        out.append("")
        out.append(
            "own prefix evicted: the request's store evicted blocks of the prefix it had just "
            "loaded (vLLM pins a loaded block only while its load runs)"
        )
    peers = [
        (policy_label(r), r["source"]) for r in results if r.get("source", "kvtier") != "kvtier"
    ]
    if peers:
        out.append("")
        out.extend(paint(f"{label}: {source}", _DIM) for label, source in peers)
    cost_models = {str(p["cost_model"]) for p in prefill if p.get("cost_model")}
    for cm in sorted(cost_models):
        out.append("")
        out.append(paint(f"prefill cost model: {cm}", _DIM))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The plot


def resolve_plot_path(path: str | os.PathLike[str]) -> Path:
    """The file :func:`plot` writes for ``path``: ``path`` itself, or ``path.png`` when it has
    no suffix (as matplotlib would). Raises :class:`InvalidArgumentError` when matplotlib can't
    write that format, the directory does not exist or ``path`` is one. Needs matplotlib."""
    from matplotlib.backend_bases import FigureCanvasBase

    hint = (
        "give the plot a file name ending in .png, .svg or .pdf (no suffix: .png) "
        "in a directory that exists"
    )
    out = Path(path)
    if out.is_dir():
        raise InvalidArgumentError(f"cannot write a plot to {out}: it is a directory", hint=hint)
    if not out.suffix:
        out = out.with_name(out.name.rstrip(".") + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise InvalidArgumentError(
            f"cannot write a plot to {out}: matplotlib writes no '{out.suffix}' files, "
            f"only {', '.join(sorted(formats))}",
            hint=hint,
        )
    if not out.parent.is_dir():
        raise InvalidArgumentError(
            f"cannot write a plot to {out}: directory {out.parent} does not exist", hint=hint
        )
    return out


def plot(result: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a PNG (or any format matplotlib infers from ``path``) with two panels; returns
    the file written (see :func:`resolve_plot_path`).

    Top: cumulative block hit rate over requests, one line per policy. Below: bytes held by
    level (all tiers) over requests, stacked, one panel per policy. Needs ``kvtier[plot]``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            f"--plot needs matplotlib, which is not importable ({exc}): pip install 'kvtier[plot]'",
            name="matplotlib",
            hint="pip install 'kvtier[plot]'",
        ) from exc

    out = resolve_plot_path(path)
    results = list(result.get("results") or [])
    ncols = max(1, min(3, len(results)))
    nrows = 1 + max(1, math.ceil(len(results) / ncols))
    # A bare Figure (no pyplot) renders with the Agg canvas and leaves the user's backend alone.
    fig = Figure(figsize=(4.2 * ncols + 2, 3.2 * nrows), layout="constrained")
    grid = fig.add_gridspec(nrows, ncols)

    ax = fig.add_subplot(grid[0, :])
    styles = ("-", "--", ":", "-.")  # so that policies with equal curves stay visible
    for i, r in enumerate(results):
        tl = r.get("timeline") or {}
        ax.plot(
            tl.get("request", []),
            [100 * x for x in tl.get("block_hit_rate", [])],
            label=f"{policy_label(r)} ({','.join(r.get('ladder', []))})",
            linestyle=styles[i % len(styles)],
            linewidth=1.6,
        )
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative block hit rate (%)")
    trace = result.get("trace") or {}
    ax.set_title(f"{Path(str(trace.get('path', ''))).name}: hit rate".lstrip(": "))
    ax.grid(alpha=0.3)
    if results:
        ax.legend(loc="lower right", fontsize="small")

    shared = None
    for i, r in enumerate(results):
        sub = fig.add_subplot(grid[1 + i // ncols, i % ncols], sharey=shared)
        shared = shared or sub
        tl = r.get("timeline") or {}
        by_level = tl.get("bytes_by_level") or {}
        ladder = [lv for lv in r.get("ladder", []) if lv in by_level]
        ladder += [lv for lv in by_level if lv not in ladder]
        x = tl.get("request", [])
        if ladder and x:
            sub.stackplot(
                x, *[[b / 2**30 for b in by_level[lv]] for lv in ladder], labels=ladder, alpha=0.85
            )
            sub.legend(loc="upper left", fontsize="small")
        sub.set_title(f"{policy_label(r)}: KV bytes held by level", fontsize="medium")
        sub.set_xlabel("requests replayed")
        sub.set_ylabel("GiB")
        sub.grid(alpha=0.3)

    fig.savefig(out, dpi=110)
    return out


def device_blocks(result: Mapping[str, Any]) -> float:
    """The device budget of a saved replay in full-precision blocks (level 0's bytes a block)."""
    model, trace = result["model"], result["trace"]
    level0 = next(iter(model["bytes_per_token"].values()))
    device = next(t for t in result["tiers"] if t["tier"] == "device")
    return float(device["budget_bytes"]) / float(level0 * trace["block_tokens"])


def capacity_curves(saved: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Block hit rate by device budget, one curve per policy (and ladder) over several saved
    replays of one trace at several budgets: ``{label: [(device blocks, percent), ...]}``, each
    sorted by budget. Raises :class:`InvalidArgumentError` when the replays are of different
    traces or models (their budgets would not compare)."""
    traces = {(r["trace"]["path"], r["trace"]["requests"], r["model"]["name"]) for r in saved}
    if len(traces) > 1:
        raise InvalidArgumentError(
            "the saved results replay different traces or models: "
            + "; ".join(f"{Path(p).name} ({n} requests, {m})" for p, n, m in sorted(traces)),
            hint="plot the results of one trace and one model at a time",
        )
    curves: dict[str, list[tuple[float, float]]] = {}
    for result in saved:
        blocks = device_blocks(result)
        for r in result["results"]:
            label = f"{policy_label(r)} ({','.join(r.get('ladder', []))})"
            curves.setdefault(label, []).append((blocks, 100 * r["block_hit_rate"]))
    return {label: sorted(points) for label, points in curves.items()}


def plot_capacity(saved: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write the hit-rate-vs-capacity plot of several saved replays (:func:`capacity_curves`):
    block hit rate against the device budget in full-precision blocks, log scale, one line per
    policy. Returns the file written. Needs ``kvtier[plot]``."""
    from matplotlib.figure import Figure

    out = resolve_plot_path(path)
    curves = capacity_curves(saved)
    fig = Figure(figsize=(7.5, 4.6), layout="constrained")
    ax = fig.add_subplot()
    for i, (label, points) in enumerate(curves.items()):
        xs, ys = zip(*points, strict=True)
        ax.plot(
            xs, ys, marker="o", markersize=3.5, linestyle=("-", "--", ":", "-.")[i % 4], label=label
        )
    ax.set_xscale("log")
    ax.set_xlabel("device budget (full-precision blocks)")
    ax.set_ylabel("block hit rate (%)")
    trace = saved[0]["trace"] if saved else {}
    ax.set_title(f"{Path(str(trace.get('path', ''))).name}: hit rate by capacity".lstrip(": "))
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(out, dpi=110)
    return out


# ---------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A minimal progress bar on stderr.

    >>> with Progress(total=1000, label="replaying") as p:  # doctest: +SKIP
    ...     p.update(10)

    ``mode`` is ``"bar"`` (redrawn in place, at most every ``min_interval`` seconds), ``"line"``
    (one summary line at the end) or ``"off"`` (nothing). ``None`` picks ``"bar"`` on a terminal
    and ``"line"`` when the stream is not a terminal or ``NO_COLOR`` is set.
    """

    width = 28

    def __init__(
        self,
        total: int | None = None,
        label: str = "",
        *,
        mode: str | None = None,
        stream: TextIO | None = None,
        min_interval: float = 0.1,
        unit: str = "requests",
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if mode is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
            mode = "bar" if tty and not os.environ.get("NO_COLOR") else "line"
        if mode not in ("bar", "line", "off"):
            raise ValueError(f"mode must be 'bar', 'line' or 'off', got {mode!r}")
        self.mode = mode
        self.total = total
        self.label = label
        self.unit = unit
        self.done = 0
        self.min_interval = min_interval
        self._start = time.perf_counter()
        self._last_draw = -math.inf
        self._drawn = False

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(ok=exc_type is None)

    def update(self, n: int = 1) -> None:
        """Advance by ``n``."""
        self.set(self.done + n)

    def set(self, done: int, total: int | None = None) -> None:
        """Set the absolute position (and the total, when it becomes known)."""
        self.done = done
        if total is not None:
            self.total = total
        if self.mode != "bar":
            return
        now = time.perf_counter()
        finished = self.total is not None and done >= self.total
        if finished or now - self._last_draw >= self.min_interval:
            self._last_draw = now
            self._draw(now)

    def __call__(self, done: int, total: int) -> None:
        """Use the bar as a ``progress(done, total)`` callback."""
        self.set(done, total)

    def _text(self, now: float) -> str:
        elapsed = now - self._start
        label = f"{self.label} " if self.label else ""
        if self.total:
            frac = min(1.0, max(0.0, self.done / self.total))
            filled = round(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            return (
                f"{label}[{bar}] {self.done:,}/{self.total:,} {self.unit} "
                f"{100 * frac:3.0f}% {elapsed:.1f}s"
            )
        return f"{label}{self.done:,} {self.unit} {elapsed:.1f}s"

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self._text(now) + "\033[K")
        self.stream.flush()
        self._drawn = True

    def close(self, *, ok: bool = True) -> None:
        """Finish: end the bar's line, or print the one summary line in ``"line"`` mode."""
        now = time.perf_counter()
        if self.mode == "bar":
            if ok:
                self._draw(now)
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
        elif self.mode == "line" and ok:
            label = f"{self.label}: " if self.label else ""
            total = f"/{self.total:,}" if self.total else ""
            elapsed = now - self._start
            self.stream.write(f"{label}{self.done:,}{total} {self.unit} in {elapsed:.1f}s\n")
            self.stream.flush()
        self.mode = "off"
