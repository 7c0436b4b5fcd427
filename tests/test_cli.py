"""The ``kvtier`` command line: argument errors, and how ``simulate`` drives the simulator.

The simulator itself is replaced by a recording fake here, so these tests pin down the CLI's side
of the contract (``SimulationConfig`` fields, ``run(trace, config, policies=, progress=)``, the
output streams); full replays are tested with the real simulator elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from bad_traces import BAD_TRACES
from sample_result import sample_result

from kvtier.cli import DEFAULT_DEVICE_BYTES, main
from kvtier.shapes import model_shape

GiB = 2**30


@pytest.fixture(autouse=True)
def _clean_env(no_kvtier_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 9, "input_length": 300, "output_length": 5, "hash_ids": [3]},
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@dataclasses.dataclass
class FakeSimulationConfig:
    model: str
    dtype: str
    device_bytes: int | None
    device_blocks: int | None
    host_bytes: int | None
    disk_bytes: int | None
    remote_bytes: int | None
    host_gbps: float
    disk_gbps: float
    remote_gbps: float
    ladder: tuple[str, ...]
    step_every: int
    block_tokens: int
    base: Any


@pytest.fixture
def fake_sim(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def run(trace: Any, config: Any, *, policies: list[str], progress: Any) -> dict[str, Any]:
        calls.update(trace=trace, config=config, policies=policies)
        progress(len(trace), len(trace))
        return sample_result(policies=len(policies))

    module = types.ModuleType("kvtier.simulate")
    module.SimulationConfig = FakeSimulationConfig  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.simulate", module)
    return calls


def _error_lines(stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert len(lines) == 2, stderr
    assert lines[0].startswith("error: ")
    assert lines[1].startswith("hint: ")
    return lines[0], lines[1]


@pytest.mark.parametrize(
    ("argv", "in_error"),
    [
        (["simulate", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
        (["simulate", "--device-bytes", "12XB"], "--device-bytes"),
        (["simulate", "--device-bytes", "8GiB", "--device-blocks", "10"], "not allowed with"),
        (["simulate", "--compare", "lru,fifo"], "fifo"),
        (["simulate", "--compare", "lru:"], "lru:"),
        (["simulate", "--compare", "lru:bf16++int4"], "policy:level+level"),
        (["simulate", "--policy", "lru", "--compare", "lru,h2o"], "not allowed with"),
        (["simulate", "--policy", "fifo"], "fifo"),
        (["simulate", "--limit", "0"], "--limit"),
        (["simulate", "--host-gbps", "-1"], "--host-gbps"),
        (["simulate", "--format", "parquet"], "--format"),
        (["simulate", "--ladder", "fp16,int8", "--dtype", "bf16"], "dtype"),
        (["simulate", "--ladder", "int8,int4"], "ladder"),
        (["simulate", "--dtype", "int3"], "int3"),
        (["bench", "everything"], "everything"),
        ([], "no command"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_arguments_exit_2_with_error_and_hint(
    capsys: pytest.CaptureFixture[str], argv: list[str], in_error: str
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    error, hint = _error_lines(err)
    assert in_error in error
    assert len(hint) > len("hint: ")


#: Counts the benchmarks and evaluations take that only make sense from 1 up (0 timed runs
#: printed a header and figures of nothing, with exit status 0), each with a value refused.
NON_POSITIVE_COUNTS = [
    ["bench", "codecs", "--repeats", "0"],
    ["bench", "attend", "--repeats", "0"],
    ["bench", "attend", "--contexts", "512", "0"],
    ["bench", "attend", "--seqs", "-1"],
    ["bench", "core", "--capacity", "0"],
    ["bench", "manager", "--sequences", "0"],
    ["bench", "manager", "--prompt", "-16"],
    ["bench", "manager", "--steps", "0"],
    ["bench", "manager", "--repeats", "0"],
    ["bench", "manager", "--threads", "0"],
    ["bench", "share", "--prompt", "0"],
    ["bench", "share", "--rounds", "0"],
    ["bench", "stores", "--repeats", "0"],
    ["bench", "vllm", "--prompt-tokens", "0"],
    ["bench", "vllm", "--probe-tokens", "-1"],
    ["bench", "vllm", "--host-blocks", "0"],
    ["bench", "vllm", "--step-tokens", "0"],
    ["eval", "codecs", "--windows", "0"],
    ["eval", "cache", "--chunk", "0"],
    ["eval", "vllm", "--generated", "0"],
]


@pytest.mark.parametrize("argv", NON_POSITIVE_COUNTS, ids=" ".join)
def test_a_count_below_one_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "", "a refused command printed data"
    error, hint = _error_lines(err)
    assert argv[2] in error and "expected a positive integer" in error, error
    assert f"kvtier {argv[0]} {argv[1]} --help" in hint


def test_bad_environment_variable_is_reported_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_POLICY", "fifo")
    assert main(["simulate", "/nonexistent/trace.jsonl"]) == 2
    error, _ = _error_lines(capsys.readouterr().err)
    assert "KVTIER_POLICY" in error


def test_missing_trace_hint_mentions_the_bundled_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "/nonexistent/trace.jsonl"]) == 2
    _, hint = _error_lines(capsys.readouterr().err)
    assert "bundled" in hint


def test_malformed_trace_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "many"}\n')
    assert main(["simulate", str(bad), "--format", "mooncake"]) == 2
    _error_lines(capsys.readouterr().err)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    assert "--device-bytes" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith("kvtier ")


def test_python_dash_m_kvtier_runs_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "version"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("kvtier ")


def test_simulate_defaults(
    fake_sim: dict[str, Any], trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(trace_file), "--no-progress"]) == 0
    cfg = fake_sim["config"]
    assert cfg.model == "llama3-8b"
    assert cfg.dtype == "bf16"
    assert cfg.device_bytes == DEFAULT_DEVICE_BYTES == 64 * GiB
    assert cfg.device_blocks is None
    assert (cfg.host_bytes, cfg.disk_bytes, cfg.remote_bytes) == (None, None, None)
    assert (cfg.host_gbps, cfg.disk_gbps, cfg.remote_gbps) == (25.0, 5.0, 1.25)
    assert cfg.ladder == ("bf16", "int8", "int4")
    assert cfg.step_every == 1
    assert cfg.block_tokens == 512
    assert cfg.base.policy == "importance"
    assert fake_sim["policies"] == ["importance"]
    assert len(fake_sim["trace"]) == 3
    out, err = capsys.readouterr()
    assert "block hit rate" in out
    assert "\033[" not in out  # captured stdout is not a terminal
    assert "error" not in err


def test_simulate_options_reach_the_simulator(
    fake_sim: dict[str, Any], trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "simulate",
        str(trace_file),
        "--model", "llama2-7b",
        "--device-blocks", "100",
        "--host-bytes", "1GiB",
        "--disk-bytes", "1e12",
        "--remote-bytes", "512MB",
        "--disk-gbps", "2.5",
        "--ladder", "fp16,int4",
        "--compare", "lru,importance,lru",
        "--limit", "2",
        "--step-every", "8",
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    cfg = fake_sim["config"]
    assert (cfg.model, cfg.dtype, cfg.ladder) == ("llama2-7b", "fp16", ("fp16", "int4"))
    assert (cfg.device_bytes, cfg.device_blocks) == (None, 100)
    assert (cfg.host_bytes, cfg.disk_bytes, cfg.remote_bytes) == (GiB, 10**12, 512 * 10**6)
    assert cfg.disk_gbps == 2.5
    assert cfg.step_every == 8
    assert fake_sim["policies"] == ["lru", "importance"]
    assert len(fake_sim["trace"]) == 2
    out = capsys.readouterr().out
    assert out.splitlines()[out.splitlines().index("") + 1].split() == [
        "policy",
        "lru",
        "importance",
    ]


def test_simulate_compare_accepts_a_ladder_per_policy(
    fake_sim: dict[str, Any], trace_file: Path
) -> None:
    argv = ["simulate", str(trace_file), "--no-progress", "--compare", "lru:bf16,H2O:BF16+int8"]
    assert main(argv) == 0
    assert fake_sim["policies"] == ["lru:bf16", "h2o:bf16+int8"]
    assert fake_sim["config"].base.policy == "lru"


def test_the_banner_shows_the_ladder_each_compared_policy_runs(
    fake_sim: dict[str, Any], trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", str(trace_file), "--no-progress", "--compare", "lru:bf16,lru,importance"]
    assert main(argv) == 0
    banner = capsys.readouterr().err.splitlines()[0]
    assert banner.endswith(
        "3 requests, policies lru:bf16, lru:bf16+int8+int4, importance:bf16+int8+int4"
    ), banner
    # Without ladders of their own, they all run the one ladder, named once.
    assert main(["simulate", str(trace_file), "--no-progress", "--compare", "lru,importance"]) == 0
    banner = capsys.readouterr().err.splitlines()[0]
    assert banner.endswith("policies lru, importance, ladder bf16,int8,int4"), banner


def test_a_mooncake_trace_with_another_block_size_says_its_blocks_are_512_tokens(
    fake_sim: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--no-progress", "--block-tokens", "256"]) == 2
    error, hint = _error_lines(capsys.readouterr().err)
    assert "line 1: 14 hash_ids for input_length 6758, expected ceil(6758/256) = 27" in error
    assert error.endswith(
        "the row fits 512-token blocks, the block size Mooncake traces are made of"
    )
    assert (
        hint
        == "hint: drop --block-tokens (block_tokens= in load_trace) to use 512, the trace's own block size"
    )
    assert not fake_sim  # nothing was replayed


def test_simulate_budgets_fall_back_to_the_environment(
    fake_sim: dict[str, Any], trace_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_DEVICE_BUDGET", "8GiB")
    monkeypatch.setenv("KVTIER_HOST_BUDGET", "16GiB")
    monkeypatch.setenv("KVTIER_POLICY", "lru")
    assert main(["simulate", str(trace_file), "--no-progress", "--host-bytes", "2GiB"]) == 0
    cfg = fake_sim["config"]
    assert (cfg.device_bytes, cfg.host_bytes) == (8 * GiB, 2 * GiB)
    assert fake_sim["policies"] == ["lru"]


def test_simulate_json_is_the_only_stdout(
    fake_sim: dict[str, Any], trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(trace_file), "--json", "--compare", "lru,importance"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == sample_result()
    assert "replaying" in err  # progress and logs go to stderr


def test_simulate_plot(
    fake_sim: dict[str, Any], trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    png = tmp_path / "out.png"
    assert main(["simulate", str(trace_file), "--no-progress", "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert str(png) in capsys.readouterr().err


def test_simulate_draws_hit_rate_by_capacity_from_saved_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real replays of the bundled trace's first requests at two budgets, saved; read back with
    ``--from-json``, each policy's curve has the saved hit rate at each budget, and ``--plot``
    draws it. A file of another trace or no result at all is refused by name."""
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    saved = []
    for blocks in (4, 400):
        path = tmp_path / f"run-{blocks}.json"
        args = ["simulate", "--limit", "150", "--device-blocks", str(blocks), "--no-progress"]
        assert main([*args, "--compare", "lru,importance", "--json", "--save", str(path)]) == 0
        saved.append((blocks, json.loads(path.read_text())))
    capsys.readouterr()
    png = tmp_path / "capacity.png"
    files = [
        a for blocks, _ in saved for a in ("--from-json", str(tmp_path / f"run-{blocks}.json"))
    ]
    assert main(["simulate", *files, "--json", "--plot", str(png)]) == 0
    curves = json.loads(capsys.readouterr().out)
    for label, policy in (
        ("lru (bf16,int8,int4)", "lru"),
        ("importance (bf16,int8,int4)", "importance"),
    ):
        want = [
            [
                blocks,
                100 * next(r for r in result["results"] if r["policy"] == policy)["block_hit_rate"],
            ]
            for blocks, result in saved
        ]
        assert [b for b, _ in curves[label]] == [b for b, _ in want]
        assert [r for _, r in curves[label]] == pytest.approx([r for _, r in want])
        assert want[0][1] < want[1][1]  # the budgets differ where it shows
    assert png.read_bytes().startswith(b"\x89PNG")

    other = json.loads((tmp_path / "run-4.json").read_text())
    other["trace"]["requests"] = 99
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["simulate", *files[:2], "--from-json", str(tmp_path / "other.json")]) == 2
    assert "different traces" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert main(["simulate", "--from-json", str(tmp_path / "junk.json")]) == 2
    assert "not a saved kvtier simulate result" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case",
    [
        "directory",
        "truncated gzip",
        "not UTF-8",
        "hash id >= 2**64",
        "csv length over the request limit",
        "empty file",
        "csv header without rows",
        "hash id after two parents",
    ],
)
def test_a_bad_trace_file_is_one_error_line_naming_it(
    fake_sim: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    write, message = BAD_TRACES[case]
    path = write(tmp_path)
    assert main(["simulate", str(path), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    error, _ = _error_lines(err)
    assert re.search(re.escape(str(path)) + ".*" + message, error), error
    assert not fake_sim  # nothing was replayed


def test_simulate_blocks_come_from_the_environment(
    fake_sim: dict[str, Any], trace_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_DEVICE_BLOCKS", "100")
    monkeypatch.setenv("KVTIER_HOST_BLOCKS", "10")
    assert main(["simulate", str(trace_file), "--no-progress"]) == 0
    cfg = fake_sim["config"]
    assert (cfg.device_bytes, cfg.device_blocks) == (None, 100)
    # A simulated block is one of the trace's 512-token blocks at level 0 (bf16 for llama3-8b).
    assert cfg.host_bytes == 10 * model_shape("llama3-8b").block_bytes("bf16", 512)


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"KVTIER_DEVICE_BLOCKS": "100"}, ["--device-bytes", "8GiB"], (8 * GiB, None, None)),
        ({"KVTIER_DEVICE_BUDGET": "8GiB"}, ["--device-blocks", "50"], (None, 50, None)),
        ({"KVTIER_HOST_BLOCKS": "10"}, ["--host-bytes", "1GiB"], (DEFAULT_DEVICE_BYTES, None, GiB)),
    ],
)
def test_a_budget_flag_outranks_the_variable_in_the_other_unit(
    fake_sim: dict[str, Any],
    trace_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    argv: list[str],
    expected: tuple[int | None, int | None, int | None],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["simulate", str(trace_file), "--no-progress", *argv]) == 0
    cfg = fake_sim["config"]
    assert (cfg.device_bytes, cfg.device_blocks, cfg.host_bytes) == expected


@pytest.mark.parametrize("plot_path", ["missing/out.png", "out.xyz", "."])
def test_a_bad_plot_path_fails_before_the_replay(
    fake_sim: dict[str, Any],
    trace_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    plot_path: str,
) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    bad = tmp_path / plot_path
    assert main(["simulate", str(trace_file), "--no-progress", "--plot", str(bad)]) == 2
    error, hint = _error_lines(capsys.readouterr().err)
    assert str(bad) in error
    assert "plot" in hint and "bundled" not in hint
    assert not fake_sim  # nothing was replayed


def test_simulate_plot_without_a_suffix_reports_the_png_it_wrote(
    fake_sim: dict[str, Any], trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    argv = ["simulate", str(trace_file), "--no-progress", "--plot", str(tmp_path / "sim")]
    assert main(argv) == 0
    assert (tmp_path / "sim.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "sim").exists()
    assert f"wrote {tmp_path / 'sim.png'}\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device-bytes", "1e30"], "--device-bytes: invalid size '1e30': expected at most"),
        (["--host-bytes", str(2**64)], "--host-bytes: invalid size"),
        (["--device-bytes", "0"], "--device-bytes: expected a positive size"),
        (["--host-bytes", "0GiB"], "--host-bytes: expected a positive size"),
        (["--disk-bytes", "0"], "--disk-bytes: expected a positive size"),
        (["--remote-bytes", "0.4"], "--remote-bytes: expected a positive size"),
        (["--remote-bytes", "1e20"], "(2**64 - 1, 16 EiB) bytes"),
        (
            ["--device-blocks", str(2**64)],
            "--device-blocks: expected an integer from 1 to 2**64 - 1",
        ),
        # It fits the type, but not in bytes: 3e11 blocks of 64 MiB is above 2**64 - 1 bytes.
        (["--device-blocks", "300000000000"], "expected at most 274,877,906,943 blocks"),
        (["--limit", str(10**30)], "--limit: expected an integer from 1 to 2**63 - 1"),
        (["--block-tokens", "0"], "--block-tokens: expected an integer from 1 to 2**32 - 1"),
        (["--block-tokens", str(2**32)], "--block-tokens: expected an integer from 1 to 2**32 - 1"),
        (["--step-every", str(2**64)], "--step-every: expected an integer from 1 to 2**64 - 1"),
    ],
)
def test_an_out_of_range_size_or_count_says_what_range_was_expected(
    fake_sim: dict[str, Any],
    trace_file: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: str,
) -> None:
    assert main(["simulate", str(trace_file), "--no-progress", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    error, _ = _error_lines(err)
    assert expected in error, error
    assert not fake_sim  # nothing was replayed


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("KVTIER_DEVICE_BUDGET", "1e30", "KVTIER_DEVICE_BUDGET"),
        ("KVTIER_HOST_BUDGET", str(2**64), "KVTIER_HOST_BUDGET"),
        ("KVTIER_DEVICE_BLOCKS", str(2**64), "KVTIER_DEVICE_BLOCKS"),
        ("KVTIER_HOST_BLOCKS", str(10**12), "KVTIER_HOST_BLOCKS: 1000000000000 blocks"),
    ],
)
def test_an_out_of_range_budget_variable_is_reported_by_name(
    fake_sim: dict[str, Any],
    trace_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    var: str,
    value: str,
    expected: str,
) -> None:
    monkeypatch.setenv(var, value)
    assert main(["simulate", str(trace_file), "--no-progress"]) == 2
    error, hint = _error_lines(capsys.readouterr().err)
    assert expected in error and "2**64 - 1" in error, error
    assert len(hint) > len("hint: ")
    assert not fake_sim  # nothing was replayed


def test_an_out_of_range_value_in_the_real_simulator_is_an_error_not_a_traceback(
    trace_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Past the u32 the core takes (and past int64, where PyO3 raised a bare OverflowError).
    monkeypatch.setenv("KVTIER_RECENT_WINDOW", str(2**64))
    assert main(["simulate", str(trace_file), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    error, hint = _error_lines(err)
    assert "recent_window" in error and "expected 0 to 2**32 - 1" in error, error
    assert "KVTIER_" in hint


def test_blocks_too_small_for_the_ladder_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At a few tokens a block, int4's scales outweigh its data: the error says that, not the
    core's bare "non-increasing bytes per level"."""
    trace = tmp_path / "lengths.csv"
    trace.write_text("timestamp,input_length,output_length\n0,100,10\n5,200,10\n")
    assert main(["simulate", str(trace), "--block-tokens", "2", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    error, hint = _error_lines(err)
    assert out == "" and "block_tokens (--block-tokens) 2" in error and "at int4" in error, error
    assert "larger blocks" in hint


def test_an_overflow_in_the_replay_is_an_error_not_a_traceback(
    fake_sim: dict[str, Any],
    trace_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise OverflowError("out of range integral type conversion attempted")

    monkeypatch.setattr(sys.modules["kvtier.simulate"], "run", run)
    assert main(["simulate", str(trace_file), "--no-progress"]) == 2
    error, _ = _error_lines(capsys.readouterr().err)
    assert "out of the range the core takes" in error, error
