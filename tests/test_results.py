"""Results files (``--save PATH``): a measuring command's own JSON result, with the provenance a
doc's figure is checked against (command line, date, commit, machine, versions)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtier import results
from kvtier.cli import main

REPO = Path(__file__).resolve().parents[1]


def _head() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def _saved(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The provenance of a results file, and the result beside it."""
    saved = json.loads(path.read_text())
    return saved.pop("provenance"), saved


def _check_provenance(provenance: dict[str, Any], argv: list[str]) -> None:
    assert provenance["command"] == shlex.join(argv)
    date = datetime.datetime.fromisoformat(provenance["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.UTC) - date) < datetime.timedelta(minutes=5)
    head = _head()
    if head is None:
        pytest.skip("not a git checkout: no commit to record")
    assert provenance["commit"] == head and isinstance(provenance["dirty"], bool)
    machine = provenance["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    assert isinstance(machine["cpu_model"], str) and machine["cpu_model"]
    assert machine["memory_bytes"] > 0 and isinstance(machine["gpus"], list)
    assert {"python", "kvtier", "numpy"} <= provenance["versions"].keys()


def test_simulate_saves_what_json_prints_with_its_provenance(tmp_path, capsys) -> None:
    path = tmp_path / "runs" / "sim.json"  # a directory that does not exist yet
    argv = ["simulate", "--limit", "50", "--json", "--no-progress", "--save", str(path)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert f"wrote {path}" in err
    provenance, result = _saved(path)
    assert result == json.loads(out)
    _check_provenance(provenance, ["kvtier", *argv])


def test_bench_core_saves_its_result_with_every_sample(tmp_path, capsys) -> None:
    """The figures are the best of repeats; the file also holds every repeat."""
    path = tmp_path / "core.json"
    argv = ["bench", "core", "--quick", "--no-lmcache", "--json", "--save", str(path)]
    assert main(argv) == 0
    provenance, result = _saved(path)
    assert result == json.loads(capsys.readouterr().out)
    _check_provenance(provenance, ["kvtier", *argv])
    stats, plan, sim = result["stats"], result["plan"], result["simulate"]
    assert len(stats["rust_updates_per_s_samples"]) == 3
    assert stats["rust_updates_per_s"] == max(stats["rust_updates_per_s_samples"])
    assert plan["rust_steady_plan_ms"] == pytest.approx(min(plan["rust_steady_plan_ms_samples"]))
    assert plan["rust_plan_ms"] == pytest.approx(min(plan["rust_plan_ms_samples"]))
    lru = sim["kvtier_lru"]
    assert lru["wall_s"] == min(lru["wall_s_samples"]) and len(lru["wall_s_samples"]) == 11
    model = sim["python_model"]
    assert model["kvtier_wall_s"] == min(model["kvtier_wall_s_samples"])


@pytest.mark.parametrize("command", [["simulate"], ["bench", "core"]])
def test_a_save_path_that_cannot_be_written_fails_before_the_run(
    tmp_path, capsys, command: list[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for bad, message in (
        (blocker / "sub" / "r.json", f"{blocker} is not a directory"),
        (tmp_path, "expected a file path, got a directory"),
    ):
        assert main([*command, "--save", str(bad)]) == 2
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert lines[0].startswith("error: argument --save: ") and message in lines[0]
        assert lines[1].startswith("hint: ") and len(lines) == 2, "nothing ran"
        assert out == ""


def test_save_makes_the_directory_and_replaces_the_file_whole(tmp_path) -> None:
    path = tmp_path / "a" / "b" / "r.json"
    read_back = {"provenance": {"command": "an older run"}, "rows": [1, 2]}
    assert results.save(path, read_back, ["kvtier", "x y"]) == path
    provenance, result = _saved(path)
    assert provenance["command"] == "kvtier 'x y'", "this run's provenance, not the one read"
    assert result == {"rows": [1, 2]}
    results.save(path, {"rows": [3]}, ["kvtier"])
    assert _saved(path)[1] == {"rows": [3]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"], "no temporary left"


def test_provenance_never_fails_without_git_or_nvidia_smi(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    provenance = results.provenance(["kvtier", "simulate"])
    assert provenance["commit"] is None and provenance["dirty"] is None
    assert isinstance(provenance["machine"]["gpus"], list)
    assert provenance["machine"]["cpu_count"] == os.cpu_count()
