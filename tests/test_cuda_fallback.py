"""Without CuPy, kvtier's CUDA kernels cannot run: calls on CUDA tensors fall back to the torch
reference. That must not pass unseen: the first such call of a process logs one warning naming
what to install, and the stats say so; work on CPU tensors (which never needs CuPy) warns
nothing.

Each case runs in a process of its own whose ``import cupy`` really fails
(``sys.modules["cupy"] = None``, as on a machine without it). On a CPU machine the fallback is
reached through :func:`kvtier._torch.cupy_available`, the question the codecs and the attention
dispatcher ask before a call on CUDA tensors; on a GPU, through a manager on CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

#: What a user is told to run: the extra of pyproject.toml for this torch's CUDA.
INSTALL = "pip install 'kvtier[{}]'".format(
    "cuda12" if (torch.version.cuda or "").startswith("12.") else "cuda13"
)

_PRELUDE = """
import json, sys
sys.modules["cupy"] = None  # `import cupy` raises ImportError, as where it is not installed
import numpy as np
import torch
from kvtier import BlockManager, KvtierConfig
from kvtier._torch import cuda_fallback, cuda_kernels, cupy_available
out = {}


def work(device):
    # A ladder with kernels (int8, int4): appends, then steps that demote through the codecs.
    bm = BlockManager(
        KvtierConfig(block_size=4, device_blocks=16, recent_window=4, sink_blocks=0),
        2, 2, 32, torch.float16, device,
    )
    seq = bm.add_sequence()
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        k, v = torch.randn(2, 20, 2, 32, generator=g).half().to(device)
        bm.append(seq, layer, k, v)
    for _ in range(3):
        bm.step()
    return bm
"""


def _run(body: str) -> tuple[dict[str, Any], list[str]]:
    """Runs ``body`` after :data:`_PRELUDE` in a fresh process: what it put in ``out``, and
    the lines of its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + body + "\nprint(json.dumps(out))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr.splitlines()


def _warnings(stderr: list[str]) -> list[str]:
    return [line for line in stderr if "kvtier's CUDA kernels need CuPy" in line]


def test_without_cupy_the_first_cuda_call_warns_once_and_the_stats_say_why() -> None:
    out, stderr = _run("""
out["kernels"] = cuda_kernels()
bm = work("cpu")  # CPU tensors: the codecs run natively, CuPy is never asked for
out["cpu_demotions"] = bm.get_compression_stats()["demotions"]
out["cpu_stats"] = bm.get_compression_stats()["cuda_fallback"]
out["cpu_fallback"] = cuda_fallback()
print("--- cpu work done", file=sys.stderr, flush=True)
# What a call on CUDA tensors asks first (codecs' backend choice, run_attention), twice.
out["available"] = [cupy_available(), cupy_available()]
out["stats"] = bm.get_compression_stats()["cuda_fallback"]
out["prometheus"] = bm.stats().to_prometheus()
""")
    backend, why = out["kernels"]
    assert backend == "torch"
    assert "CuPy" in why and "torch reference" in why and INSTALL in why, why
    cpu_part = stderr[: stderr.index("--- cpu work done")]
    assert out["cpu_demotions"] > 0, "nothing ran through the codecs"
    assert not _warnings(cpu_part), "CPU work warned about CuPy, which it never needs"
    assert out["cpu_stats"] is None and out["cpu_fallback"] is None
    assert out["available"] == [False, False]
    assert _warnings(stderr) == [why], stderr  # once per process, naming what to install
    assert out["stats"] == why
    assert "kvtier_cuda_fallback 1" in out["prometheus"]


def test_where_cupy_imports_nothing_falls_back() -> None:
    pytest.importorskip("cupy")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from kvtier._torch import cuda_kernels, cupy_available, cuda_fallback; "
            "print(json.dumps([cuda_kernels(), cupy_available(), cuda_fallback()]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == [["cuda", None], True, None]
    assert not _warnings(done.stderr.splitlines())


@pytest.mark.gpu
def test_a_manager_on_cuda_without_cupy_warns_once_and_reports_the_fallback() -> None:
    """The real path: appends and demotions of a manager on CUDA run the torch reference, the
    first of them warns, and its stats name what to install."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    out, stderr = _run("""
bm = work("cuda")
out["demotions"] = bm.get_compression_stats()["demotions"]
out["stats"] = bm.get_compression_stats()["cuda_fallback"]
""")
    assert out["demotions"] > 0, "nothing ran through the codecs"
    assert out["stats"] is not None and INSTALL in out["stats"]
    assert _warnings(stderr) == [out["stats"]], stderr
