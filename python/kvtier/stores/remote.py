"""Values on a Redis or Valkey server (or a Redis Cluster), shared by every engine that can
reach it: the tier that lets a decode instance read what a prefill instance wrote.

Batches go out as one pipeline (one round trip per node). To a single server, kvtier writes
its own ``SET`` and ``GET`` commands (RESP, the protocol's framing of the same commands) on a
connection of redis-py's pool: a put sends the header and the checksum around the caller's
payload, from its buffer a hashed chunk at a time, instead of joining them by a copy; a get
hashes each value as soon as its reply is in, while it is in cache. When the server cannot be
reached, ``get`` is a miss and ``put`` reports failure at once, without waiting on the network
again for ``retry_after`` seconds; after that the next call reconnects. A command the server
refuses (a put over its ``maxmemory``, a get of a key that holds no string) fails for that
value only. The engine keeps running either way. The server's own ``maxmemory`` and eviction
policy bound what it holds (set ``ttl`` to let values expire).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import InvalidArgumentError, require
from .base import Checked, KVStore, StoredForm, log
from .format import Namespace, Sealed, seal_joined


class RedisStore(KVStore):
    """``url``: ``redis://[user:password@]host:port[/db]`` or ``rediss://...`` for TLS (then
    ``tls_ca``, ``tls_cert``, ``tls_key`` name the files). ``cluster``: talk to a Redis
    Cluster; None asks the server whether it is one. ``timeout``: seconds for a connect and
    for each reply. ``ttl``: seconds a value lives (None: until the server evicts it)."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        cluster: bool | None = None,
        timeout: float = 1.0,
        retry_after: float = 1.0,
        ttl: float | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        super().__init__(namespace)
        redis = require("redis", "redis", purpose="RedisStore needs redis-py")
        if not redis.utils.HIREDIS_AVAILABLE:
            _warn_no_hiredis()
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgumentError(
                f"url: expected redis://host:port, rediss://host:port (TLS) or unix://path, "
                f"got {url!r}"
            )
        if not timeout > 0 or not retry_after >= 0 or (ttl is not None and not ttl > 0):
            raise InvalidArgumentError(
                f"timeout > 0, retry_after >= 0 and ttl > 0 (or None) expected, got "
                f"{timeout}, {retry_after}, {ttl}"
            )
        self.url = url
        self.retry_after = retry_after
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        # A cluster client raises RedisClusterException (not a RedisError) when no node answers.
        self._errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)
        self._refused = redis.exceptions.ResponseError
        options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        tls = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        if url.startswith("rediss://"):
            options.update(ssl_ca_certs=tls_ca, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        elif any(v is not None for v in tls.values()):
            given = ", ".join(k for k, v in tls.items() if v is not None)
            raise InvalidArgumentError(
                f"{given}: TLS files need a TLS URL (rediss://host:port), got {url!r}"
            )
        if cluster is None:
            cluster = self._is_cluster(redis, url, options)
        self.cluster = cluster
        client_class = redis.cluster.RedisCluster if cluster else redis.Redis
        self._connect: Callable[[], Any] = lambda: client_class.from_url(url, **options)
        # The client, made on first use and shared by every namespace view: a cluster client
        # connects as it is made, and a cluster that is away then is an outage like any other.
        self._clients: list[Any] = [None]
        self._down_until = [0.0]  # shared by every namespace view
        self._down_lock = threading.Lock()

    def _seal(self, key: str, payload: memoryview) -> StoredForm:
        if self.cluster:
            # One buffer for the cluster client to route and send, copied and checksummed in
            # one pass.
            return (seal_joined(self.namespace, key, payload),)
        return Sealed(self.namespace, key, payload)

    @staticmethod
    def _is_cluster(redis: Any, url: str, options: dict[str, Any]) -> bool:
        probe = redis.Redis.from_url(url, **options)
        try:
            return bool(probe.info("cluster").get("cluster_enabled"))
        except redis.exceptions.RedisError:
            return False  # unreachable now: a plain client reconnects when it comes back
        finally:
            probe.close()

    def describe(self) -> str:
        return f"redis store {self.url}{' (cluster)' if self.cluster else ''}"

    # -- failure handling -------------------------------------------------------------------------

    def _client(self) -> Any:
        with self._down_lock:
            if self._clients[0] is None:
                self._clients[0] = self._connect()
            return self._clients[0]

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until[0]

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._down_lock:
            first = self._available()
            self._down_until[0] = time.monotonic() + self.retry_after
        if first:  # one log line per outage
            self._error(what, exc)
        else:
            self.stats.count_errors()

    def _run(self, what: str, fill: Any, n: int, default: Any) -> list[Any]:
        """Runs the commands ``fill`` queues on a pipeline; on a server error, ``default`` for
        each of the ``n`` commands."""
        if not self._available():
            return [default] * n
        try:
            pipe = self._client().pipeline(transaction=False)
            fill(pipe)
            return list(pipe.execute())
        except self._errors as exc:
            self._failed(what, exc)
            return [default] * n

    # -- KVStore --------------------------------------------------------------------------------

    def _on_connection(
        self, what: str, work: Callable[[Any], list[Any]], n: int, default: Any
    ) -> list[Any]:
        """``work(connection)`` on a connection of the single server's pool, retried as
        redis-py retries a pipeline (every command sent this way is idempotent); on a server
        error, ``default`` for each of the ``n`` commands."""
        if not self._available():
            return [default] * n
        pool = self._client().connection_pool
        conn = None
        try:
            conn = pool.get_connection()
            done: list[Any] = conn.retry.call_with_retry(
                lambda: work(conn), lambda _: conn.disconnect()
            )
            return done
        except self._errors as exc:
            self._failed(what, exc)
            return [default] * n
        finally:
            if conn is not None:
                pool.release(conn)

    def _replies(self, conn: Any, what: str, n: int, default: Any) -> Iterator[Any]:
        """The next ``n`` replies on ``conn``, in order. A reply that is the server's refusal
        of that command (e.g. over maxmemory) is ``default``, logged once for all of them,
        and the replies after it are still read in step."""
        refused, refusal = 0, None
        for _ in range(n):
            try:
                yield conn.read_response()
            except self._refused as exc:  # this command only; read on
                refused, refusal = refused + 1, exc
                yield default
        if refusal is not None:  # one line per batch
            self._error(f"{what} of {refused} of {n} values", refusal)

    def _put(self, keys: list[str], values: list[StoredForm]) -> list[bool]:
        if self.cluster:

            def fill(pipe: Any) -> None:
                for key, parts in zip(keys, values, strict=True):
                    pipe.set(key, memoryview(parts[0]), px=self._ttl_ms)

            return [bool(r) for r in self._run("put", fill, len(keys), False)]

        def send_sets(conn: Any) -> list[bool]:
            conn.send_packed_command(_set_commands(keys, values, self._ttl_ms))
            return [r in (b"OK", "OK") for r in self._replies(conn, "put", len(keys), False)]

        return self._on_connection("put", send_sets, len(keys), False)

    def _get(self, keys: list[str]) -> list[Any]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.get(key)

        return self._run("get", fill, len(keys), None)

    def _get_checked(self, keys: list[str]) -> list[Checked]:
        if self.cluster:
            return super()._get_checked(keys)

        def send_gets(conn: Any) -> list[Checked]:
            get = b"*2\r\n$3\r\nGET\r\n"
            conn.send_packed_command([b"".join(get + _bulk(k.encode()) for k in keys)])
            # Each value is checked as soon as it is in, while it is in cache, not after the
            # whole batch has pushed it out.
            replies = self._replies(conn, "get", len(keys), None)
            return [self._unseal(k, blob) for k, blob in zip(keys, replies, strict=True)]

        return self._on_connection("get", send_gets, len(keys), None)

    def _pop(self, key: str) -> Any:
        return self._run("pop", lambda pipe: pipe.getdel(key), 1, None)[0]

    def _contains(self, key: str) -> bool:
        return self._contains_many([key])[0]

    def _contains_many(self, keys: list[str]) -> list[bool]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.exists(key)

        return [bool(r) for r in self._run("contains", fill, len(keys), 0)]

    def _delete(self, keys: list[str]) -> list[bool]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.delete(key)

        return [bool(r) for r in self._run("delete", fill, len(keys), 0)]

    def _discard_corrupt(self, key: str) -> None:
        self._delete([key])

    def _scan(self, prefix: str) -> Iterable[str]:
        if not self._available():
            return []
        try:
            return [
                k.decode() if isinstance(k, bytes) else k
                for k in self._client().scan_iter(match=prefix + "*", count=1000)
            ]
        except self._errors as exc:
            self._failed("scan", exc)
            return []

    def _close(self) -> None:
        if self._clients[0] is not None:
            self._clients[0].close()


@functools.cache
def _warn_no_hiredis() -> None:
    # Measured here: a 2 MiB GET took 2.1-4.4 ms with redis-py's parser, 1.0-1.05 with hiredis.
    log.warning(
        "redis-py is parsing replies in Python (hiredis is not installed): large gets run "
        "slower and unsteadily; pip install 'kvtier[redis]' or hiredis"
    )


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _set_commands(keys: list[str], values: list[Sealed], ttl_ms: int | None) -> Iterator[Any]:
    """``SET key value [PX ttl]`` for each value, in RESP, as buffers to send one after another.
    The value's chunks go out as they are, each hashed once it is sent (``Sealed.chunks``); the
    small pieces between two payloads are joined into one."""
    args = b"*3\r\n$3\r\nSET\r\n" if ttl_ms is None else b"*5\r\n$3\r\nSET\r\n"
    px = b"" if ttl_ms is None else _bulk(b"PX") + _bulk(b"%d" % ttl_ms)
    between = b""
    for key, value in zip(keys, values, strict=True):
        chunks = value.chunks()
        head = next(chunks)
        yield b"".join((between, args, _bulk(key.encode()), b"$%d\r\n" % value.size, head))
        yield from itertools.islice(chunks, value.payload_chunks)
        between = next(chunks) + b"\r\n" + px
    yield between
