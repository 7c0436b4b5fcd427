"""The built wheel carries the CUDA kernel sources inside the package (a user's GPU host reads
them from the installed kvtier, not from a source tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MATURIN = Path(sys.executable).parent / "maturin"

# Runs inside the clean venv: load the extension by path (numpy is not installed there, and the
# kernel sources need nothing else), print what it carries.
PROBE = """
import importlib.util, json, pathlib, sys
site = pathlib.Path(sys.argv[1])
so = next((site / "kvtier").glob("_core*.so"))
spec = importlib.util.spec_from_file_location("kvtier._core", so)
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
print(json.dumps({"sources": core.kernel_sources(), "top": sorted(p.name for p in site.iterdir())}))
"""


@pytest.mark.skipif(not MATURIN.exists(), reason="maturin is not installed beside this Python")
def test_wheel_installed_in_a_clean_venv_carries_the_kernel_sources(tmp_path: Path) -> None:
    import json

    dist = tmp_path / "dist"
    subprocess.run(
        [str(MATURIN), "build", "--release", "--out", str(dist)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=900,
    )
    (wheel,) = dist.glob("kvtier-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    out = subprocess.run(
        [str(python), "-c", PROBE, str(site)], check=True, capture_output=True, text=True
    ).stdout
    carried = json.loads(out)
    kernels = sorted((REPO / "kernels").glob("*.cu*"))  # the .cu files and kvtier_common.cuh
    assert kernels, "the repo has kernel sources"
    for path in kernels:
        assert carried["sources"][path.name] == path.read_text(), f"{path.name} differs"
    assert "kernels" not in carried["top"], "no stray top-level kernels/ in site-packages"
    assert (site / "kvtier" / "codecs" / "cuda.py").is_file()
    shutil.rmtree(env_dir)
