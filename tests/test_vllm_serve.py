"""``vllm serve`` with the connector, as a user runs it: vLLM's own processes (scheduler and
worker apart, so the scheduler asks the worker's tiers over its socket), an HTTP server on a
loopback port, completions of one prompt (computed, then from vLLM's own prefix cache, then,
that cache emptied, loaded from kvtier) and kvtier's counters on vLLM's ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of metric ``name`` over its series (those with ``label``, e.g. ``source="host"``)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for labels, v in found if label in labels)


def test_vllm_serve_loads_a_prompt_from_kvtier_and_reports_it_on_metrics(
    vllm_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from kvtier.eval.model import wikitext_ids

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    prompt = [int(t) for t in wikitext_ids(tok, 2000)][: 6 * BLOCK + 5]
    port = free_port()
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_budget": "64MiB", "ladder": "bf16"},
    }
    env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: processes apart
    # `vllm serve`'s server. The `vllm` script itself asks for the distribution "vllm", which
    # the CPU build (distribution "vllm-cpu") is not: the module runs the same server.
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            *serve, str(vllm_model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", "1024", "--block-size", str(BLOCK),
            "--enforce-eager", "--kv-transfer-config", json.dumps(config),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                call(f"{base}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(2)
        body = {"model": str(vllm_model_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0}
        json.loads(call(f"{base}/v1/completions", body))  # computed, and saved
        cached = json.loads(call(f"{base}/v1/completions", body))  # vLLM's own prefix hit
        call(f"{base}/reset_prefix_cache", {})
        loaded = json.loads(call(f"{base}/v1/completions", body))  # kvtier's
        # A load gives what vLLM's own prefix hit gives: the same blocks in its pool, the rest
        # computed alike (a recompute runs other kernels: on a CPU with AMX, other rounding).
        assert loaded["choices"][0]["text"] == cached["choices"][0]["text"]
        text = call(f"{base}/metrics").decode()
        loadable = (len(prompt) - 1) // BLOCK
        assert metric(text, "vllm:kvtier_saved_blocks_total") == len(prompt) // BLOCK
        assert metric(text, "vllm:kvtier_loaded_blocks_total") == loadable
        assert metric(text, "vllm:kvtier_load_errors_total") == 0
        assert metric(text, "vllm:external_prefix_cache_hits_total") == loadable * BLOCK
        # ... from host memory, as the scheduler's lookup over the worker's socket found them.
        by_source = "vllm:prompt_tokens_cached_by_source_total"
        assert metric(text, by_source, 'source="host"') == loadable * BLOCK
        assert metric(text, by_source) == metric(text, by_source, 'source="device"') + (
            loadable * BLOCK
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
