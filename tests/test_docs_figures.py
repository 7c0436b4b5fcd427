"""The figures of docs/quality.md are the saved results' own: every number in its tables equals,
to the digits it shows, the figure of ``docs/quality.json`` (``kvtier eval cache``, 8 windows;
several runs merged with ``--from-json``) or ``docs/quality-speed.json`` (the speed run) it
stands for; so are README.md's hit-rate tables, those of ``docs/results/``. No model runs here:
a figure edited by hand, or a result saved without the table being brought along, fails."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).parents[1] / "docs"
Row = dict[str, Any]
#: a column's figure, from the method's row and every row by method
Figure = Callable[[Row, dict[str, Row]], float]


def _passkey(r: Row, _: dict[str, Row]) -> float:
    return r["passkey"]["accuracy"] * 100


def _speed(prompt: int, key: str, against: str | None = None) -> Figure:
    def figure(r: Row, rows: dict[str, Row]) -> float:
        mine = next(s for s in r["speed"] if s["prompt"] == prompt)[key]
        if against is None:
            return float(mine)
        base = next(s for s in rows[against]["speed"] if s["prompt"] == prompt)[key]
        return float(mine / base)

    return figure


def _field(key: str, scale: float = 1.0) -> Figure:
    return lambda r, _: r[key] * scale


#: The checked tables: the start of each header line, the results it shows, and its columns'
#: figures by column index (column 0 names the method: its first word, backticks dropped).
TABLES: list[tuple[str, str, dict[int, Figure]]] = [
    (
        "| method | attention | perplexity | vs baseline | passkey | KV bytes |",
        "quality.json",
        {
            2: _field("perplexity"),
            3: _field("ppl_change", 100),
            4: _passkey,
            5: _field("kv_bytes", 1e-6),
            6: _field("bytes_vs_dynamic"),
            7: _field("bytes_vs_fp16"),
        },
    ),
    (
        "| method | ladder | fp16-equiv. vs fp16 | perplexity | passkey |",
        "quality.json",
        {2: _field("bytes_vs_fp16"), 3: _field("ppl_change", 100), 4: _passkey},
    ),
    (
        "| method | attention | perplexity | vs baseline | fp16-equiv. vs fp16 |",
        "quality.json",
        {2: _field("perplexity"), 3: _field("ppl_change", 100), 4: _field("bytes_vs_fp16")},
    ),
    (
        "| method | cache | attention | decode tok/s @512 |",
        "quality-speed.json",
        {
            3: _speed(512, "decode_tokens_per_s"),
            4: _speed(512, "decode_tokens_per_s", "dynamic"),
            5: _speed(512, "decode_tokens_per_s", "dynamic-sdpa"),
            6: _speed(4096, "decode_tokens_per_s"),
            7: _speed(4096, "decode_tokens_per_s", "dynamic"),
            8: _speed(4096, "decode_tokens_per_s", "dynamic-sdpa"),
            9: _speed(4096, "prefill_s"),
        },
    ),
]

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"docs/quality.md has {len(starts)} tables headed {header!r}"
    rows = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _shown(cell: str) -> tuple[float, int]:
    """The number a cell shows (bold, a unicode minus, units and %) and its decimals."""
    found = _NUMBER.search(cell.replace("*", "").replace("\u2212", "-"))
    assert found is not None, f"no figure in {cell!r}"
    digits = found.group().replace(",", "")
    decimals = len(digits.partition(".")[2])
    return float(digits), decimals


@pytest.mark.parametrize(
    ("header", "source", "columns"), TABLES, ids=["results", "below-int4", "attention", "speed"]
)
def test_every_figure_of_a_quality_table_is_its_saved_results(
    header: str, source: str, columns: dict[int, Figure]
) -> None:
    rows = {r["method"]: r for r in json.loads((DOCS / source).read_text())["rows"]}
    table = _table_rows((DOCS / "quality.md").read_text(), header)
    assert table, f"the table headed {header!r} has no rows"
    for cells in table:
        method = cells[0].replace("`", "").replace("*", "").split()[0]
        assert method in rows, f"{method}: no such row in docs/{source}"
        for index, figure in columns.items():
            shown, decimals = _shown(cells[index])
            want = round(figure(rows[method], rows), decimals)
            assert shown == pytest.approx(want, abs=10**-decimals / 2 + 1e-12), (
                f"docs/quality.md, {method}, column {index}: shows {cells[index]!r}, "
                f"docs/{source} says {figure(rows[method], rows)}"
            )


#: README's hit-rate tables by device blocks, one per trace (its header: ``| device blocks
#: (full trace) |`` or ``(bundled slice)``, then the capacities): each row's label, the saved
#: results it quotes and the policy they name it by.
HIT_RATE_ROWS = {
    "| LRU (kvtier, prefix-aware) |": ("simulate", "lru"),
    "| importance (kvtier's default) |": ("simulate", "importance"),
    "| vLLM's LRU (`vllm-lru`) |": ("simulate", "vllm-lru"),
    "| vLLM's ARC (`vllm-arc`) |": ("simulate", "vllm-arc"),
    "| LRU + admission (`admit`, the lab) |": ("policy-lab", "admit"),
    "| fixed decay (`lfu`, `KVTIER_DECAY=0.999`) |": ("decay-0.999", "lfu"),
    "| optimal (offline) |": ("simulate", "optimal"),
}
#: Where each trace's saved results are: the simulate runs by capacity, the lab's in one file.
TRACES = {
    "full trace": ("simulate-peers/full-trace-{blocks}", "policy-lab/full-trace.json"),
    "bundled slice": ("simulate-bundled/slice-{blocks}", "policy-lab/bundled-slice.json"),
}


def _saved_hit_rate(trace: str, results: str, policy: str, blocks: int) -> float:
    """Percent, as the saved result of ``results`` on ``trace`` gives it for ``policy`` at
    ``blocks``."""
    runs, lab = TRACES[trace]
    if results == "policy-lab":
        rows = json.loads((DOCS / "results" / lab).read_text())
        return next(r["hit_rate"] for r in rows["results"][policy] if r["blocks"] == blocks)
    suffix = "" if results == "simulate" else f"-lfu-{results}"
    path = DOCS / "results" / (runs.format(blocks=blocks) + suffix + ".json")
    saved = json.loads(path.read_text())["results"]
    return 100 * next(r["block_hit_rate"] for r in saved if r["policy"] == policy)


def _blocks(cell: str) -> int:
    return int(float(cell.rstrip("k")) * 1000) if cell.endswith("k") else int(cell)


def test_every_figure_of_the_hit_rate_tables_is_its_saved_result() -> None:
    readme = (DOCS / "simulate.md").read_text().splitlines()
    seen = set()
    trace, capacities = None, []
    for line in readme:
        header = re.match(r"\| device blocks \((.+?)\) \|(.*)", line)
        if header:
            trace = header[1]
            capacities = [_blocks(c.strip()) for c in header[2].strip(" |").split("|")]
            assert trace in TRACES, line
            continue
        label = next((k for k in HIT_RATE_ROWS if line.startswith(k)), None)
        if label is None:
            continue
        assert trace is not None, f"{label} outside a table of device blocks"
        seen.add((trace, label))
        cells = [c.strip() for c in line[len(label) :].strip(" |").split("|")]
        assert len(cells) == len(capacities), line
        for cell, blocks in zip(cells, capacities, strict=True):
            saved = _saved_hit_rate(trace, *HIT_RATE_ROWS[label], blocks)
            assert cell.strip("*") == f"{saved:.2f} %", (trace, label, blocks, saved)
    assert seen == {(t, label) for t in TRACES for label in HIT_RATE_ROWS}


#: README's table of the ladder at equal bytes (full trace): each row's label, the policy and
#: ladder it quotes, and what of that result (the hit rate, or the share of hit tokens served
#: at a level, ``hits_by_place``).
LADDER_HEADER = "| bf16 blocks' bytes (full trace, bf16→int8→int4) |"
LADDER_ROWS: dict[str, tuple[str, str, str | None]] = {
    "| LRU, bf16 only |": ("lru", "bf16", None),
    "| LRU, ladder |": ("lru", "bf16+int8+int4", None),
    "| importance, ladder |": ("importance", "bf16+int8+int4", None),
    "| importance's hit tokens served at bf16 |": ("importance", "bf16+int8+int4", "bf16"),
    "| the same at int4 |": ("importance", "bf16+int8+int4", "int4"),
}


def test_every_figure_of_the_ladder_table_is_its_saved_result() -> None:
    readme = (DOCS / "simulate.md").read_text().splitlines()
    start = readme.index(next(line for line in readme if line.startswith(LADDER_HEADER)))
    capacities = [
        _blocks(c.strip()) for c in readme[start][len(LADDER_HEADER) :].strip(" |").split("|")
    ]
    seen = set()
    for line in readme[start + 2 :]:
        if not line.startswith("|"):
            break
        label = next(k for k in LADDER_ROWS if line.startswith(k))
        seen.add(label)
        policy, ladder, level = LADDER_ROWS[label]
        cells = [c.strip().strip("*") for c in line[len(label) :].strip(" |").split("|")]
        assert len(cells) == len(capacities), line
        for cell, blocks in zip(cells, capacities, strict=True):
            path = DOCS / "results" / "simulate-ladder" / f"full-trace-{blocks}.json"
            r = next(
                r
                for r in json.loads(path.read_text())["results"]
                if r["policy"] == policy and "+".join(r["ladder"]) == ladder
            )
            if level is None:
                assert cell == f"{100 * r['block_hit_rate']:.2f} %", (label, blocks)
            else:
                tokens = {p["level"]: p["tokens"] for p in r["hits_by_place"]}
                share = 100 * tokens.get(level, 0) / sum(tokens.values())
                assert cell == f"{share:.1f} %", (label, blocks)
    assert seen == set(LADDER_ROWS)


def test_the_loads_tables_figures_are_the_saved_rounds() -> None:
    """docs/results/vllm-loads: each round's prefill means, ratio and counts are
    ``loads.json``'s, and the median docs/vllm.md quotes is its median."""
    saved = json.loads((DOCS / "results" / "vllm-loads" / "loads.json").read_text())
    text = (DOCS / "results" / "vllm-loads" / "README.md").read_text()
    rows = _table_rows(text, "| round |")
    assert len(rows) == len(saved["rounds"])
    for row, r in zip(rows, saved["rounds"], strict=True):
        means = r["prefill_mean_s"]
        for cell, want in zip(
            row[1:4], (means["recompute"], means["kvtier-ladder"], r["prefill_ratio"]), strict=True
        ):
            got, digits = _shown(cell)
            assert got == round(want, digits), (row, want)
        assert int(row[4]) == r["hit_requests"] and int(row[5]) == r["slower_hit_requests"]
        assert row[6] == f"{r['same_output']}/17"
    median = f"**{saved['median_prefill_ratio']:.3f}**"
    assert median in text and median in (DOCS / "vllm.md").read_text()


def test_the_vllm_policy_tables_figures_are_the_saved_runs() -> None:
    """README.md's table of vLLM's CPU tier under kvtier's policy and vLLM's own: each figure is
    its saved run's (docs/results/vllm-kvtier-policy), and kvtier's policy inside vLLM's manager
    hits what kvtier's replay of the same policy hits, in every run."""
    rows = _table_rows((DOCS / "vllm.md").read_text(), "| vLLM CPU tier blocks (full trace) |")
    labels = {
        "kvtier's policy (`vllm-kvtier`)": "vllm-kvtier",
        "vLLM's own LRU": "vllm-lru",
        "vLLM's own ARC": "vllm-arc",
    }
    assert [row[0] for row in rows] == list(labels)
    capacities = [500, 1000, 2000, 5000, 10000, 20000, 50000]
    for blocks in capacities:
        path = DOCS / "results" / "vllm-kvtier-policy" / f"full-trace-{blocks}.json"
        saved = {r["policy"]: r for r in json.loads(path.read_text())["results"]}
        assert saved["vllm-kvtier"]["hit_blocks"] == saved["importance"]["hit_blocks"]
        for row in rows:
            cell = row[1 + capacities.index(blocks)]
            assert cell == f"{100 * saved[labels[row[0]]]['block_hit_rate']:.2f} %", (row, blocks)


#: README.md's table of vLLM's two tiers: each row's label, and its configuration in the saved
#: runs (docs/results/vllm-tiering/hits-B.json).
TIERING_ROWS = {
    "one bf16 CPU tier of 2B, vLLM's LRU": "vllm-lru 2B",
    "one bf16 CPU tier of 2B, vLLM's ARC": "vllm-arc 2B",
    "one bf16 CPU tier of 2B, kvtier's policy": "kvtier-policy 2B",
    "B, vLLM's LRU + `KvtierTier`": "vllm-lru B + KvtierTier B",
    "B, vLLM's ARC + `KvtierTier`": "vllm-arc B + KvtierTier B",
    "B, kvtier's policy + `KvtierTier`": "kvtier-policy B + KvtierTier B",
    "B, vLLM's LRU + a bf16-only `KvtierTier`": "vllm-lru B + bf16 KvtierTier B",
}


def test_the_vllm_tiering_tables_figures_are_the_saved_runs() -> None:
    """README.md's tables of vLLM's native offloading with ``KvtierTier``: each hit rate is its
    saved run's, each held-tokens ratio and throughput the saved measurement's."""
    results = DOCS / "results" / "vllm-tiering"
    readme = (DOCS / "vllm.md").read_text()
    header = "| vLLM CPU tier B (full trace, 64-token chunks) |"
    start = next(line for line in readme.splitlines() if line.startswith(header))
    sizes = [
        int(c.strip().removeprefix("B = ").rstrip("k")) * 1000
        for c in start[len(header) :].strip(" |").split("|")
    ]
    rows = _table_rows(readme, header)
    assert [row[0] for row in rows] == list(TIERING_ROWS)
    for i, chunks in enumerate(sizes):
        saved = json.loads((results / f"hits-{chunks}.json").read_text())["configs"]
        for row in rows:
            rate = saved[TIERING_ROWS[row[0]]]["block_hit_rate"]
            assert row[1 + i].strip("*") == f"{100 * rate:.2f} %", (row[0], chunks)
    held = json.loads((results / "held.json").read_text())
    for key, row in held.items():
        if isinstance(row, dict) and row["ladder"] != "bf16":
            ratio = f"{row['tokens_held_over_bf16']:.2f}\u00d7"
            assert f"{ratio} at {row['chunk_tokens']}-token chunks" in readme, key
    speed = json.loads((results / "throughput.json").read_text())
    for ladder, row in speed.items():
        if isinstance(row, dict):
            for figure in ("store_GBps", "load_GBps"):
                assert f"{row[figure]:.2f} GB/s" in readme, (ladder, figure)


# ---------------------------------------------------------------------------------------------
# Every figure of the docs is in a results file its section links


#: The pages whose figures are checked: the README and the guides.
PAGES = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
#: A figure: a number with decimals, or one with a unit of measure after it (``%``, times,
#: ``GB/s``, ``ms``...). Integers alone are counts and sizes a reader can check by reading.
_FIGURE = re.compile(
    r"(?<![\w.\-/^])([-+\u2212]?\d[\d,]*(?:\.\d+)?)(?![\d.]*\.\d)"
    r"(?=(\s?(%|\u00d7|x\b|GB/s|MB/s|TB/s|GiB/s|ms\b|s\b|\u00b5s|us\b|tokens/s|tok/s)|\.\d|\b))"
)
#: Words just before a number that make it a setting or a target, not a measurement.
_NOT_MEASURED = re.compile(
    r"(target|targets|aim|at least|at most|up to|default|ratio of|quantile|budget|shares?|"
    r"ppl target|≤|≥|<=|>=|version|Python|vLLM|torch|transformers|kvpress|CUDA|hiredis)\W{0,3}$",
    re.IGNORECASE,
)


#: Tables the tests above check cell by cell (figures derived from the saved results, such as
#: a share of hit tokens, included): the generic check leaves them to those.
CHECKED_TABLES = (
    *(header for header, _, _ in TABLES),
    "| device blocks (",
    LADDER_HEADER,
    "| vLLM CPU tier blocks (full trace) |",
    "| vLLM CPU tier B (full trace, 64-token chunks) |",
)


def _sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of each section down to level 3, code blocks and the tables checked
    above removed."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for header in CHECKED_TABLES:
        text = re.sub(rf"^{re.escape(header)}.*\n(?:\|.*\n)*", "", text, flags=re.M)
    parts = re.split(r"^(#{1,3} .*)$", text, flags=re.M)
    return [("(top)", parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]


def _sources(page: Path, body: str) -> list[Path]:
    """The results a section links: a results folder's files, or a JSON file."""
    found: list[Path] = []
    for target in re.findall(r"\]\(([^)#\s]+)", body):
        path = (page.parent / target).resolve()
        if path.name == "README.md" and DOCS / "results" in path.parents:
            path = path.parent
        if path.is_dir():
            found += sorted(path.glob("*.json"))
        elif path.suffix == ".json" and path.is_file():
            found.append(path)
    return found


def _numbers(value: Any) -> list[float]:
    """Every number of a saved result but its timelines (a replay's hit rate after each request:
    thousands of values, which would back any figure between them)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for k, v in value.items() if k != "timeline" for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


#: How a saved number may be shown: as it is, in percent, in thousandths or thousands, in
#: millions or billions (bytes as MB/GB, seconds as ms/µs).
_SCALES = (1.0, 100.0, 1e3, 1e-3, 1e6, 1e-6, 1e-9)


def _figures(body: str) -> list[tuple[str, float, int]]:
    """``(context, value, decimals)`` of each measured-looking figure in a section's prose."""
    prose = re.sub(r"`[^`]*`", "``", body)  # code spans: names and settings
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets
    out = []
    for m in _FIGURE.finditer(prose):
        digits = m.group(1).replace(",", "").replace("\u2212", "-")
        has_unit = bool(m.group(3))
        if "." not in digits and not has_unit:
            continue
        if _NOT_MEASURED.search(prose[max(0, m.start() - 24) : m.start()]):
            continue
        context = prose[max(0, m.start() - 40) : m.end() + 12].replace("\n", " ")
        out.append((context, abs(float(digits)), len(digits.partition(".")[2])))
    return out


def _backed(value: float, decimals: int, saved: list[float]) -> bool:
    """``value`` is a saved number at the digits shown, scaled, or the percent it leaves of a
    whole (``46.8 % saved`` of a cache holding 0.532 of the bytes)."""
    half = 10**-decimals / 2 + 1e-9
    return any(
        abs(abs(n) * s - value) <= half or (0 < n < 1 and abs(100 * (1 - n) - value) <= half)
        for n in saved
        for s in _SCALES
    )


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_figure_is_in_a_results_file_its_section_links(page: Path) -> None:
    """A figure in prose or a table is the saved result of the command that measured it: each
    number the section shows with decimals or a unit equals, at the digits shown, a number of a
    results file (or folder) the section links or the page links before its first section, as
    it is or scaled (percent, thousands, millions). Settings and targets (after "target",
    "default", "≤" ...) are not figures. A tripwire for a figure typed with no result behind it,
    not a proof of each figure's source: the tables above are checked cell by cell."""
    unbacked = []
    sections = _sections(page.read_text(encoding="utf-8"))
    # what the page links before its first section: above its title, or under it (its lead)
    page_wide = [
        path
        for heading, body in sections[:2]
        if not heading.startswith("##")
        for path in _sources(page, body)
    ]
    for heading, body in sections:
        sources = {*page_wide, *_sources(page, body)}
        saved = [n for path in sources for n in _numbers(json.loads(path.read_text()))]
        for context, value, decimals in _figures(body):
            if not _backed(value, decimals, saved):
                unbacked.append(f"{heading.strip()}: {value} in …{context}…")
    assert not unbacked, (
        f"{page.name}: figures with no results file behind them (link the file that holds "
        "each, in its section, or measure it again with --save):\n" + "\n".join(unbacked)
    )
