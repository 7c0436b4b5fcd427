"""The skip guard of tests/conftest.py: under ``CI`` a skip passes only for a missing CUDA device
("no CUDA device"); a skip for a missing package fails, even one whose reason mentions CUDA.
Checked on the guard itself and on a real pytest run of the real conftest."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import NO_CUDA_DEVICE, _skip_allowed_under_ci

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.parametrize(
    ("reason", "allowed"),
    [
        (f"Skipped: {NO_CUDA_DEVICE}: torch.cuda.is_available() is False", True),
        (f"Skipped: {NO_CUDA_DEVICE}", True),
        (NO_CUDA_DEVICE, True),
        ("Skipped: CuPy is not installed: the CUDA kernels run through it", False),
        ("Skipped: NVRTC is not loadable: CUDA path could not be detected", False),
        ("Skipped: could not import 'cupy': No module named 'cupy'", False),
        ("Skipped: not installed: ['vllm'] (vLLM's CUDA build; no CUDA device needed)", False),
        ("Skipped: WikiText-2 not found", False),
    ],
)
def test_only_a_missing_cuda_device_may_skip_under_ci(reason: str, allowed: bool) -> None:
    assert _skip_allowed_under_ci(reason) is allowed


INNER = f'''
import sys

import pytest


def test_no_device():
    pytest.skip("{NO_CUDA_DEVICE}: torch.cuda.is_available() is False")


@pytest.mark.skipif(True, reason="{NO_CUDA_DEVICE}")
def test_no_device_by_mark():
    pass


def test_no_cupy():
    pytest.skip("CuPy is not installed: the CUDA kernels run through it")


def test_torch_cuda_without_cupy(torch_cuda):
    pass


def setup_module():
    sys.modules["cupy"] = None  # CuPy's import fails, as on a machine without it
'''

INNER_COLLECT = """
import pytest

pytest.importorskip("kvtier_no_such_module")


def test_never_collected():
    pass
"""


def test_a_ci_run_fails_every_skip_but_a_missing_cuda_device(tmp_path: Path) -> None:
    """The real conftest in a pytest run under ``CI=true``: skips for the missing device pass
    (by call and by mark), a missing package fails (a skip of a test, a test module's
    importorskip), and ``torch_cuda`` without CuPy asks for the device first: on a machine
    without one it skips for it, on one with a device the missing CuPy fails."""
    pytest.importorskip("torch")  # torch_cuda's own import
    import torch

    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "test_inner_collect.py").write_text(INNER_COLLECT)
    report = tmp_path / "report.xml"
    env = {**os.environ, "CI": "true"}
    env.pop("PYTEST_ADDOPTS", None)
    args = ["-p", "no:cacheprovider", "-q", f"--junitxml={report}"]
    args += ["--continue-on-collection-errors", "--rootdir", str(tmp_path), "-c", os.devnull]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    outcomes, messages = {}, {}
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name") or case.get("classname") or ""
        found = [child for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[name] = found[0].tag if found else "passed"
        messages[name] = found[0].get("message", "") if found else ""
    device = torch.cuda.is_available()
    want = {
        "test_no_device": "skipped",
        "test_no_device_by_mark": "skipped",
        "test_no_cupy": "failure",
        "test_torch_cuda_without_cupy": "failure" if device else "skipped",
    }
    got = {name: outcomes.get(name) for name in want}
    assert got == want, run.stdout + run.stderr
    if not device:  # the device is asked for before CuPy
        assert NO_CUDA_DEVICE in messages["test_torch_cuda_without_cupy"], messages
    # The module whose importorskip skipped it whole: a collection error under CI.
    collect = [k for name, k in outcomes.items() if "test_inner_collect" in name]
    assert collect == ["error"], (outcomes, run.stdout)
    assert run.returncode == 1, run.stdout
