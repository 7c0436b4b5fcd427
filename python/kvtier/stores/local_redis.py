"""A real Redis server (or a small Redis Cluster) on loopback, started from the ``redis-server``
on PATH and stopped on exit: for the tests, the store benchmark and the prefill/decode example,
so none of them needs a server set up by hand.

    with LocalRedis() as server:
        store = RedisStore(server.url, ns)
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import KvtierError


class RedisUnavailableError(KvtierError):
    """redis-server is not installed or did not come up."""


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (+10000), which Redis wants
    at most 65535."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for port in random.sample(range(20000, 45000), 200):
        if all(_bindable(p) for p in (port, port + 10000)):
            return port
    raise RedisUnavailableError("no free pair of loopback ports for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """``nodes=1``: one server; ``nodes>=3``: a Redis Cluster of that many primaries (no
    replicas). ``url`` points at the first node (cluster clients discover the rest)."""

    def __init__(self, nodes: int = 1, *, binary: str = "redis-server") -> None:
        if nodes != 1 and nodes < 3:
            raise ValueError(f"nodes: 1 (a server) or >= 3 (a cluster), got {nodes}")
        found = shutil.which(binary)
        if found is None:
            raise RedisUnavailableError(
                f"{binary} is not on PATH: install it (Debian: apt-get install redis-server)"
            )
        self.binary: str = found
        self.cluster = nodes > 1
        self.ports = [free_port(cluster=self.cluster) for _ in range(nodes)]
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-redis-")
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self, port: int | None = None) -> None:
        """Starts every node (or just ``port``: a restart after :meth:`kill`)."""
        for p in self.ports if port is None else [port]:
            args = [
                self.binary,
                "--port",
                str(p),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--loglevel",
                "warning",
            ]
            if self.cluster:
                args += [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{p}.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
            with open(Path(self._dir.name) / f"redis-{p}.log", "ab") as log:
                self._procs[p] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        for p in self.ports if port is None else [port]:
            self._wait(lambda p=p: _ping(p), f"redis-server on port {p} did not answer PING")
        if self.cluster and port is None:
            self._create_cluster()

    def _create_cluster(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailableError("redis-cli is not on PATH (it ships with redis-server)")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def ok() -> bool:
            out = subprocess.run(
                [cli, "-p", str(self.ports[0]), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            return "cluster_state:ok" in out

        self._wait(ok, "the Redis Cluster did not reach cluster_state:ok")

    @staticmethod
    def _wait(ready: Any, message: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RedisUnavailableError(message)
            time.sleep(0.05)

    def kill(self, port: int | None = None) -> None:
        """Kills a node (default: the first) the way a crash would: SIGKILL, no shutdown."""
        proc = self._procs.pop(self.ports[0] if port is None else port)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self._procs.values():
            proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs.clear()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
