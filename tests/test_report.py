"""The simulate report: the text table, the plot, the progress bar."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from sample_result import sample_result

from kvtier.errors import InvalidArgumentError, MissingDependencyError
from kvtier.report import Progress, human_bytes, plot, render_table, resolve_plot_path

ANSI = re.compile(r"\033\[[0-9;]*[A-Za-z]")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (64 * 2**20, "64.0 MiB"),
        (512 * 2**30, "512 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (None, "-"),
    ],
)
def test_human_bytes(n: int | None, text: str) -> None:
    assert human_bytes(n) == text


def test_table_compares_policies_side_by_side() -> None:
    text = render_table(sample_result(), color=False)
    assert not ANSI.search(text)
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("policy"))
    assert head.split() == ["policy", "lru", "importance"]

    def row(label: str) -> list[str]:
        line = next(line for line in lines if line.strip().startswith(label))
        return re.split(r"\s{2,}", line.strip())[1:]

    assert row("block hit rate") == ["4.10 %", "8.40 %"]
    assert row("device/int8")[-1] == "40 (4.0 %)"
    assert row("host/bf16") == ["11 (1.1 %)", "14 (1.4 %)"]
    assert row("demotions") == ["120", "120"]
    assert row("lossy, no copy to promote") == ["2", "2"]
    assert row("bytes moved") == ["5.00 GiB", "5.00 GiB"]
    assert row("time saved") == ["4.10 %", "8.40 %"]
    assert row("wall time") == ["12.3 ms", "12.3 ms"]
    # Header lines name the trace, the model and the tiers in human units.
    assert "4,000" not in text
    assert "40 requests" in text
    assert "device 64.0 GiB" in text
    assert "host 512 GiB @ 25 GB/s" in text
    assert "prefill cost model:" in text


def test_table_shows_rejected_requests_only_when_there_are_some() -> None:
    result = sample_result()
    assert "rejected" not in render_table(result, color=False)
    result["results"][1]["rejected_requests"] = 10
    lines = render_table(result, color=False).splitlines()
    row = next(line for line in lines if line.startswith("rejected requests"))
    assert re.split(r"\s{2,}", row)[1:] == ["0 (0.0 %)", "10 (25.0 %)"]
    assert any("did not fit on the device" in line for line in lines)


def test_table_columns_line_up() -> None:
    text = render_table(sample_result(), color=False)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    table = [line for line in lines[start:] if line and not line.startswith("prefill cost")]
    data_rows = [line for line in table if re.search(r"\S\s{2,}\S", line)]
    assert len(data_rows) > 15
    assert len({len(line) for line in data_rows}) == 1


def test_table_for_one_policy_and_colour() -> None:
    plain = render_table(sample_result(policies=1), color=False)
    assert "importance" not in plain.split("\n\n", 1)[1].splitlines()[0]
    coloured = render_table(sample_result(), color=True)
    assert ANSI.search(coloured)
    # Colour changes nothing but the escape codes.
    assert ANSI.sub("", coloured) == render_table(sample_result(), color=False)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    out = plot(sample_result(), tmp_path / "sim.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_plot_one_policy(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    out = plot(sample_result(policies=1), tmp_path / "one.png")
    assert out.stat().st_size > 0


def test_plot_without_a_suffix_writes_and_returns_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    out = plot(sample_result(), tmp_path / "sim")
    assert out == tmp_path / "sim.png"
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("name", "message"),
    [("sim.xyz", "no '.xyz' files"), ("missing/sim.png", "does not exist"), (".", "directory")],
)
def test_plot_path_is_checked_before_drawing(tmp_path: Path, name: str, message: str) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    with pytest.raises(InvalidArgumentError, match=message) as info:
        resolve_plot_path(tmp_path / name)
    assert info.value.hint
    with pytest.raises(InvalidArgumentError, match=message):
        plot(sample_result(), tmp_path / name)
    assert not (tmp_path / name).is_file()


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingDependencyError, match=r"kvtier\[plot\]") as info:
        plot(sample_result(), tmp_path / "x.png")
    assert isinstance(info.value, ImportError)
    assert not (tmp_path / "x.png").exists()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_prints_nothing() -> None:
    out = io.StringIO()
    with Progress(10, "replaying", mode="off", stream=out) as p:
        p.update(10)
    assert out.getvalue() == ""


def test_progress_not_a_tty_prints_one_final_line() -> None:
    out = io.StringIO()
    with Progress(10, "replaying", stream=out) as p:
        for _ in range(10):
            p.update()
    assert out.getvalue().count("\n") == 1
    assert out.getvalue().startswith("replaying: 10/10 requests")


def test_progress_no_color_on_a_tty_prints_one_final_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    out = _Tty()
    with Progress(5, "replaying", stream=out) as p:
        p(5, 5)
    assert "\r" not in out.getvalue()
    assert out.getvalue().count("\n") == 1


def test_progress_bar_redraws_at_a_limited_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = _Tty()
    with Progress(label="replaying", stream=out, min_interval=3600) as p:
        for i in range(1, 1001):
            p(i, 1000)
    text = out.getvalue()
    # The first call draws, the rate limit swallows the rest until the end draws once more.
    assert 2 <= text.count("\r") <= 3
    assert text.endswith("\n")
    assert "1,000/1,000" in text
    assert "100%" in text


def test_progress_after_an_error_prints_no_summary() -> None:
    out = io.StringIO()
    p = Progress(10, "replaying", stream=out)
    p.update(3)
    p.__exit__(RuntimeError, RuntimeError("boom"), None)
    assert out.getvalue() == ""
