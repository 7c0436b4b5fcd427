"""``kvtier eval cache --plot``: each method's perplexity against the fp16-equivalent KV bytes it
held. Needs ``kvtier[plot]``."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ...errors import ConfigError, require

__all__ = ["OFF_SCALE", "plot"]

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

    from ...report import resolve_plot_path

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
