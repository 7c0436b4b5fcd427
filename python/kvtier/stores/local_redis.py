"""A real Redis server (or a small Redis Cluster) on loopback, started from the ``redis-server``
on PATH and stopped on exit: for the tests, the store benchmark and the prefill/decode example,
so none of them needs a server set up by hand.

    with LocalRedis() as server:
        store = RedisStore(server.url, ns)

``LocalRedis(tls=True)`` serves TLS only (``rediss://``), with certificates made by the
``openssl`` CLI for the run: a CA, the server's (for 127.0.0.1) and a client's, which the server
requires. ``tls_ca`` / ``tls_cert`` / ``tls_key`` name the files a client needs. A TLS cluster
also runs its cluster bus over TLS.
"""

from __future__ import annotations

import random
import shutil
import socket
import ssl
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


def _ping(port: int, tls: ssl.SSLContext | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as raw:
            s = raw if tls is None else tls.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:  # ssl.SSLError is one
        return False


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: str) -> None:
    """``ca.crt``, ``server.crt``/``.key`` (for 127.0.0.1 and localhost) and ``client.crt``/
    ``.key`` in ``directory``, on P-256 keys, valid for two days."""
    if shutil.which("openssl") is None:
        raise RedisUnavailableError("openssl is not on PATH: it makes the TLS test certificates")
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *key, "-days", "2", "-subj", "/CN=kvtier test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=directory)  # fmt: skip
    san = Path(directory) / "san.ext"
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", *key, "-subj", f"/CN=kvtier test {name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", str(san),
                 "-out", f"{name}.crt", cwd=directory)  # fmt: skip


class LocalRedis:
    """``nodes=1``: one server; ``nodes>=3``: a Redis Cluster of that many primaries (no
    replicas). ``url`` points at the first node (cluster clients discover the rest)."""

    def __init__(self, nodes: int = 1, *, binary: str = "redis-server", tls: bool = False) -> None:
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
        self.tls = tls
        self._tls_context: ssl.SSLContext | None = None
        if tls:
            try:
                make_certificates(self._dir.name)
            except BaseException:
                self._dir.cleanup()
                raise
            self._tls_context = ssl.create_default_context(cafile=self.tls_ca)
            self._tls_context.load_cert_chain(str(self.tls_cert), str(self.tls_key))

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.ports[0]}"

    def _file(self, name: str) -> str | None:
        return str(Path(self._dir.name) / name) if self.tls else None

    @property
    def tls_ca(self) -> str | None:
        """The CA file a client verifies the server with (None without TLS)."""
        return self._file("ca.crt")

    @property
    def tls_cert(self) -> str | None:
        """A client certificate the server accepts (None without TLS)."""
        return self._file("client.crt")

    @property
    def tls_key(self) -> str | None:
        return self._file("client.key")

    def start(self, port: int | None = None) -> None:
        """Starts every node (or just ``port``: a restart after :meth:`kill`)."""
        for p in self.ports if port is None else [port]:
            listen = ["--port", str(p)]
            if self.tls:
                d = Path(self._dir.name)
                listen = ["--port", "0", "--tls-port", str(p), "--tls-auth-clients", "yes",
                          "--tls-cert-file", str(d / "server.crt"),
                          "--tls-key-file", str(d / "server.key"),
                          "--tls-ca-cert-file", str(d / "ca.crt")]  # fmt: skip
                if self.cluster:
                    listen += ["--tls-cluster", "yes"]
            args = [
                self.binary,
                *listen,
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
            self._wait(
                lambda p=p: _ping(p, self._tls_context),
                f"redis-server on port {p} did not answer PING",
            )
        if self.cluster and port is None:
            self._create_cluster()

    def _cli(self) -> list[str]:
        """redis-cli, with the client's certificates when the nodes speak TLS."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailableError("redis-cli is not on PATH (it ships with redis-server)")
        if not self.tls:
            return [cli]
        return [cli, "--tls", "--cacert", str(self.tls_ca), "--cert", str(self.tls_cert),
                "--key", str(self.tls_key)]  # fmt: skip

    def _create_cluster(self) -> None:
        cli = self._cli()
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [*cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def ok() -> bool:
            out = subprocess.run(
                [*cli, "-p", str(self.ports[0]), "cluster", "info"],
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
