"""``kvtier bench stores``: put/get throughput of the stores beside plain storage, in one run.

For each store (host memory, a disk directory, Redis) and value size (64 KiB, 256 KiB, 2 MiB),
random values are put and read back one to a call (``put``/``get``) and 64 to a call
(``put_many``/``get_many``); every value a get returns is then copied into a buffer, as loading
a block into a tensor does (a dict get alone moves no bytes: it would compare the store's checks
with nothing), on both sides and on the clock. The baseline stores the same bytes the plain way,
without a header or a checksum:

- host: a dict holding ``bytes(value)`` (a copy: a store must own its bytes);
- disk: one file per value, written to a temporary name and renamed over the final one
  (``os.replace``), read back with ``open().read()``;
- redis: redis-py ``SET``/``GET``; 64 to a call as one pipeline (no transaction, as the store
  sends them).

A dict and files have no batch call: their batch-64 rows repeat the one-by-one loop. Each cell runs
rounds of one pass of the store and one of the baseline, interleaved a slice of ~1 MiB (or one
batch) at a time; its overhead is the median over the rounds of store time / baseline time - 1 (the
target: <= 10 %), its times each side's best pass. Passes replace the values of the pass before, as
a cache in steady state does. For the stores that checksum (disk, Redis), a cell also says what the
checksum alone costs: each slice's values are checksummed (in one call) just after the baseline's
op, on no side's clock, so from cache where the slice fits in it, as the store checksums each chunk
just after it moves it (a batch of 64 large values does not fit: there it reads memory); its share
is the median over the rounds of that time / the baseline's time: the part of the overhead that is
the checksum's own work, not the store's. Every get is checked by the store (header and checksum),
and the bytes read back are compared with the bytes written for two values of every cell. Disk
figures go through the page cache: they measure memory more than the device.

Redis: ``--redis-url``, else a redis-server started on loopback for the run, else skipped (the
reason is printed). Prints a table on stdout (``--json``: one JSON object instead); progress goes
to stderr. Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import __version__
from .._core import checksum
from ..cli import positive_int
from ..config import parse_bytes
from ..errors import ConfigError, KvtierError
from ..report import human_bytes
from ..results import save_if_asked
from ..stores import DiskStore, HostStore, KVStore, Namespace, RedisStore
from ..stores.local_redis import LocalRedis, RedisUnavailableError
from . import bench_parser, run_as_script

KiB, MiB = 2**10, 2**20
SIZES = (64 * KiB, 256 * KiB, 2 * MiB)
QUICK_SIZES = (4 * KiB, 64 * KiB)
BATCHES = (1, 64)
#: Payload bytes of one timed pass of a cell (at least one full batch), and the rounds of a
#: cell (a pass of each side each). Passes of 64 MiB filled the page cache's allowance of dirty
#: pages, so that writeback stalled whichever side crossed it (batch-1 64 KiB disk puts: 440-540
#: us instead of ~100, and that cell +35 % one run, +156 % the next, 2-CPU VM); more, smaller
#: passes measure the stores.
DATA = 16 * MiB
REPEATS = 9
#: Payload bytes a round times on one side before the other takes its turn (at least one
#: batch): whole passes back to back let a slow phase of the VM land on one side only (Redis
#: 256 KiB puts: -12 % one run, +55 % the next).
SLICE_BYTES = 1 * MiB
QUICK_DATA = 4 * MiB
TARGET_OVERHEAD_PCT = 10.0
#: The key of the checksum's own time in a round's timings (``_round``).
CHECKSUM = "checksum"
NAMESPACE = Namespace(model="kvtier-bench", codec="raw")
#: Plenty for a pipeline of 64 x 2 MiB on a busy machine: a timeout would read as a failed put.
REDIS_TIMEOUT_S = 30.0

BASELINES = {
    "host": "dict of bytes(value) copies",
    "disk": "plain files: temp + os.replace, open().read()",
    "redis": "redis-py SET/GET; batch 64: one pipeline of SET/GET",
}


class Side(Protocol):
    """One way of storing values: a store or its baseline. ``batch`` values go in a call."""

    def put(self, keys: list[str], values: list[memoryview], batch: int) -> None: ...

    def get(self, keys: list[str], batch: int) -> list[Any]: ...

    def clear(self, keys: list[str]) -> None: ...


class StoreSide:
    """A :class:`KVStore`: ``put``/``get`` for batch 1, ``put_many``/``get_many`` above."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def put(self, keys: list[str], values: list[memoryview], batch: int) -> None:
        if batch == 1:
            done = [self.store.put(k, v) for k, v in zip(keys, values, strict=True)]
        else:
            done = [
                ok
                for i in range(0, len(keys), batch)
                for ok in self.store.put_many(keys[i : i + batch], values[i : i + batch])
            ]
        if not all(done):
            raise KvtierError(f"{self.store.describe()}: {done.count(False)} puts failed")

    def get(self, keys: list[str], batch: int) -> list[Any]:
        if batch == 1:
            return [self.store.get(k) for k in keys]
        return [
            v for i in range(0, len(keys), batch) for v in self.store.get_many(keys[i : i + batch])
        ]

    def clear(self, keys: list[str]) -> None:
        self.store.delete_many(keys)


class DictSide:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, keys: list[str], values: list[memoryview], batch: int) -> None:
        for k, v in zip(keys, values, strict=True):
            self.values[k] = bytes(v)

    def get(self, keys: list[str], batch: int) -> list[Any]:
        return [self.values[k] for k in keys]

    def clear(self, keys: list[str]) -> None:
        self.values.clear()


class FileSide:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root

    def put(self, keys: list[str], values: list[memoryview], batch: int) -> None:
        for k, v in zip(keys, values, strict=True):
            path = self.root / k
            tmp = self.root / f"{k}.tmp"
            with open(tmp, "wb") as f:
                f.write(v)
            os.replace(tmp, path)

    def get(self, keys: list[str], batch: int) -> list[Any]:
        out = []
        for k in keys:
            with open(self.root / k, "rb") as f:
                out.append(f.read())
        return out

    def clear(self, keys: list[str]) -> None:
        for k in keys:
            os.unlink(self.root / k)


class RedisSide:
    """Keys get their own prefix: a server given with ``--redis-url`` may hold other data."""

    PREFIX = "kvtier-bench-plain:"

    def __init__(self, client: Any) -> None:
        self.client = client

    def put(self, keys: list[str], values: list[memoryview], batch: int) -> None:
        full = [self.PREFIX + k for k in keys]
        if batch == 1:
            for k, v in zip(full, values, strict=True):
                self.client.set(k, v)
            return
        for i in range(0, len(full), batch):
            pipe = self.client.pipeline(transaction=False)
            for k, v in zip(full[i : i + batch], values[i : i + batch], strict=True):
                pipe.set(k, v)
            pipe.execute()

    def get(self, keys: list[str], batch: int) -> list[Any]:
        full = [self.PREFIX + k for k in keys]
        if batch == 1:
            return [self.client.get(k) for k in full]
        out = []
        for i in range(0, len(full), batch):
            pipe = self.client.pipeline(transaction=False)
            for k in full[i : i + batch]:
                pipe.get(k)
            out += pipe.execute()
        return out

    def clear(self, keys: list[str]) -> None:
        full = [self.PREFIX + k for k in keys]
        for i in range(0, len(full), 1000):
            self.client.delete(*full[i : i + 1000])


def _check(side: str, got: list[Any], values: list[memoryview]) -> None:
    """Every key answered, and the first and last values came back byte for byte."""
    missing = sum(g is None for g in got)
    if len(got) != len(values) or missing:
        raise KvtierError(f"{side}: {missing or len(values) - len(got)} of {len(values)} misses")
    for i in (0, -1):
        if bytes(got[i]) != bytes(values[i]):  # (comparing memoryviews goes byte by byte)
            raise KvtierError(f"{side}: value {i % len(values)} came back with other bytes")


def _read_out(got: list[Any], sink: memoryview) -> None:
    """Copies each value read into ``sink``, as loading a block into a tensor does: a dict get
    alone hands back a reference and moves no bytes."""
    for value in got:
        sink[: len(value)] = value


def _round(
    sides: dict[str, Side],
    keys: list[str],
    values: list[memoryview],
    batch: int,
    sink: memoryview,
    flip: bool,
    checksummed: bool,
) -> dict[tuple[str, str], float]:
    """One pass of each side, interleaved: every value is put (over the previous round's), then
    every key is got and each value read into ``sink``, a slice of the keys at a time, each
    slice on one side and then on the other (which goes first alternates), so that a slow
    phase of the machine lands on both sides alike. The time each side took for each op, summed
    over its slices; checks what came back.

    With ``checksummed``, also the time (key ``(CHECKSUM, op)``) of checksumming each slice's
    values just after the baseline's op, on no side's clock: from cache, as the store does,
    so what the checksum the store must compute costs by itself in the same conditions."""
    clock = time.perf_counter
    step = max(batch, -(-SLICE_BYTES // len(values[0])))
    slices = [slice(at, at + step) for at in range(0, len(keys), step)]
    order = list(sides.items())
    took = {(name, op): 0.0 for name in (*sides, CHECKSUM) for op in ("put", "get")}
    os.sync()  # else an earlier round's dirty pages are written back on this round's clock
    for op in ("put", "get"):
        for i, part in enumerate(slices):
            ks, vs = keys[part], values[part]
            for name, side in order[:: -1 if (i % 2 == 1) != flip else 1]:
                t0 = clock()
                if op == "put":
                    side.put(ks, vs, batch)
                else:
                    got = side.get(ks, batch)
                    _read_out(got, sink)
                took[name, op] += clock() - t0
                if checksummed and name.endswith(" baseline"):
                    t0 = clock()
                    checksum(*(vs if op == "put" else got))  # the bytes of each, in one call
                    took[CHECKSUM, op] += clock() - t0
                if op == "get":
                    _check(name, got, vs)
    return took


def _count(size: int, batch: int, data: int) -> int:
    """Values in a pass of a cell: ``data`` bytes, rounded up to whole batches."""
    return math.ceil(max(data, batch * size) / (batch * size)) * batch


def measure(
    kind: str,
    store: KVStore,
    baseline: Side,
    source: memoryview,
    size: int,
    batch: int,
    data: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """The put and get rows of one cell: ``repeats`` rounds, each a pass of the store and one
    of the baseline, interleaved (``_round``). The overhead is the median of the rounds'
    ratios; the times are each side's best pass."""
    values = [source[i * size : (i + 1) * size] for i in range(_count(size, batch, data))]
    sink = memoryview(bytearray(size))
    keys = [f"kvtier-bench-{i:06d}" for i in range(len(values))]
    sides: dict[str, Side] = {kind: StoreSide(store), f"{kind} baseline": baseline}
    best = {(name, op): math.inf for name in sides for op in ("put", "get")}
    took_each: dict[tuple[str, str], list[float]] = {key: [] for key in best}  # by round
    ratios: dict[str, list[float]] = {"put": [], "get": []}
    # The first round puts new keys and every later one replaces them, as a cache in steady
    # state replaces what it evicts: then the memory a value leaves is what the next one
    # takes, on both sides. (Deleting every value between passes let the allocator give the
    # pages back to the kernel, and each pass paid to fault them in again: 64 KiB dict puts
    # took 2 us in one run and 24 us in the next.)
    shares: dict[str, list[float]] = {"put": [], "get": []}
    for r in range(repeats):
        took = _round(sides, keys, values, batch, sink, r % 2 == 1, store.checksummed)
        for op in ("put", "get"):
            ratios[op].append(took[kind, op] / took[f"{kind} baseline", op])
            shares[op].append(took[CHECKSUM, op] / took[f"{kind} baseline", op])
            for name in sides:
                best[name, op] = min(best[name, op], took[name, op])
                took_each[name, op].append(took[name, op])
    for side in sides.values():
        side.clear(keys)
    moved = len(values) * size
    rows = []
    for op in ("put", "get"):
        store_s, base_s = best[kind, op], best[f"{kind} baseline", op]
        rows.append(
            {
                "store": kind,
                "op": op,
                "size": size,
                "batch": batch,
                "values": len(values),
                "bytes": moved,
                "seconds": store_s,
                "gb_per_s": moved / store_s / 1e9,
                "values_per_s": len(values) / store_s,
                "baseline": BASELINES[kind],
                "baseline_seconds": base_s,
                "baseline_gb_per_s": moved / base_s / 1e9,
                "baseline_values_per_s": len(values) / base_s,
                "overhead_pct": 100 * (statistics.median(ratios[op]) - 1),
                "checksum_pct": (
                    100 * statistics.median(shares[op]) if store.checksummed else None
                ),
                # every round's figures, in order: the spread of the best and the medians above
                "seconds_samples": took_each[kind, op],
                "baseline_seconds_samples": took_each[f"{kind} baseline", op],
                "overhead_pct_samples": [100 * (r - 1) for r in ratios[op]],
                "checksum_pct_samples": (
                    [100 * r for r in shares[op]] if store.checksummed else None
                ),
            }
        )
    return rows


def _filesystem(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (from /proc/mounts): tmpfs means RAM."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    found = [m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
    return max(found, key=lambda m: len(m[0]))[1] if found else None


def _redis(
    stack: contextlib.ExitStack, url: str | None
) -> tuple[RedisStore, RedisSide, dict[str, Any]] | str:
    """The Redis store and its baseline, or the reason there are none."""
    try:
        redis = importlib.import_module("redis")
    except ImportError:
        return "redis-py is not installed (pip install 'kvtier[redis]')"
    started = url is None
    if url is None:
        if shutil.which("redis-server") is None:
            return "no --redis-url given and redis-server is not on PATH"
        try:
            url = stack.enter_context(LocalRedis()).url
        except RedisUnavailableError as exc:
            return f"redis-server did not start: {exc}"
    options = {"socket_timeout": REDIS_TIMEOUT_S, "socket_connect_timeout": REDIS_TIMEOUT_S}
    probe = redis.Redis.from_url(url, **options)
    try:
        version = probe.info("server")["redis_version"]
    except redis.RedisError as exc:
        raise KvtierError(
            f"cannot reach the Redis server at {url}: {exc}",
            hint="check that --redis-url names a running server, or leave it out",
        ) from exc
    finally:
        probe.close()
    store = RedisStore(url, NAMESPACE, timeout=REDIS_TIMEOUT_S)
    stack.callback(store.close)
    client_class = redis.cluster.RedisCluster if store.cluster else redis.Redis
    client = client_class.from_url(url, **options)
    stack.callback(client.close)
    info = {
        "url": url,
        "version": version,
        "cluster": store.cluster,
        "started_for_the_run": started,
        "redis_py": redis.__version__,
        # hiredis changes both sides: it parses replies in C (gets), and redis-py then packs
        # each SET by joining the value into one buffer, a copy its own packer avoids (puts).
        "parser": "hiredis" if importlib.util.find_spec("hiredis") else "python",
    }
    return store, RedisSide(client), info


def run(
    sizes: Sequence[int],
    data: int,
    repeats: int,
    directory: Path | None,
    redis_url: str | None,
    log: Callable[..., None],
) -> dict[str, Any]:
    source_bytes = max(_count(s, b, data) * s for s in sizes for b in BATCHES)
    # Random bytes, made once: zeros would flatter anything that compresses or skips pages.
    source = memoryview(np.random.default_rng(0).bytes(source_bytes))
    # Each cell holds one pass at a time: twice that leaves room for headers, never evicts.
    budget = 2 * source_bytes + 16 * MiB
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvtier-bench-stores-", dir=directory)
            )
        )
        host = HostStore(NAMESPACE, budget)
        stack.callback(host.close)
        disk = DiskStore(tmp / "store", NAMESPACE, budget)
        stack.callback(disk.close)
        targets: list[tuple[str, KVStore, Side]] = [
            ("host", host, DictSide()),
            ("disk", disk, FileSide(tmp / "plain")),
        ]
        redis = _redis(stack, redis_url)
        if isinstance(redis, str):
            skipped = {"redis": redis}
            redis_info = None
        else:
            skipped = {}
            redis_store, redis_side, redis_info = redis
            targets.append(("redis", redis_store, redis_side))
        rows = []
        for kind, store, baseline in targets:
            for size in sizes:
                for batch in BATCHES:
                    log(f"{kind}: {human_bytes(size)} values, batch {batch}")
                    rows += measure(kind, store, baseline, source, size, batch, data, repeats)
        evictions = {kind: store.stats.evictions for kind, store, _ in targets}
        environment = {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "numpy": np.__version__,
            "kvtier": __version__,
            "host_pinned": host.pin,
            "disk_dir": str(tmp),
            "disk_filesystem": _filesystem(tmp),
            "disk_fsync": disk.fsync,
            "redis": redis_info,
        }
    return {
        "sizes": list(sizes),
        "batches": list(BATCHES),
        "data_per_pass": data,
        "repeats": repeats,
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "baselines": {k: v for k, v in BASELINES.items() if k not in skipped},
        "skipped": skipped,
        "evictions": evictions,
        "environment": environment,
        "rows": rows,
    }


def _table(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"kvtier bench stores: random values, {result['repeats']} rounds of a pass of "
        f">= {human_bytes(result['data_per_pass'])} a side per cell; Python {env['python']}, "
        f"{env['cpu_count']} CPUs",
        f"disk: {env['disk_dir']} ({env['disk_filesystem'] or 'filesystem unknown'}, no fsync): "
        "writes and reads go through the page cache, so disk figures measure memory more than "
        "the device",
    ]
    redis = env["redis"]
    if redis:
        how = "started for the run" if redis["started_for_the_run"] else "given"
        cluster = ", a cluster" if redis["cluster"] else ""
        lines.append(
            f"redis: server {redis['version']} at {redis['url']} ({how}{cluster}); redis-py "
            f"{redis['redis_py']}, {redis['parser']} reply parser"
        )
    for kind, reason in result["skipped"].items():
        lines.append(f"{kind}: skipped: {reason}")
    lines.append("baselines: " + "; ".join(f"{k}: {v}" for k, v in result["baselines"].items()))
    lines += [
        "GB/s: payload bytes (1e9) per second, headers and checksums not counted",
        f"overhead = median over the rounds of store time / baseline time - 1 (target <= "
        f"{TARGET_OVERHEAD_PCT:g} %); "
        "dict and files have no batch call: their batch-64 baseline is the same loop; a get's time "
        "includes copying each value it returns into a buffer, on both sides",
        "checksum = median over the rounds of the time the checksum alone takes over the same "
        "values, from cache, just after the baseline's op / the baseline's time: the part of the "
        "overhead that is the checksum's own work (the host store computes none)",
        "",
        f"{'store':6s} {'op':4s} {'size':>9s} {'batch':>5s} {'values':>6s} {'GB/s':>8s} "
        f"{'values/s':>10s} {'base GB/s':>10s} {'overhead':>10s} {'checksum':>9s}",
    ]
    for r in result["rows"]:
        share = "-" if r["checksum_pct"] is None else f"{r['checksum_pct']:.1f}%"
        lines.append(
            f"{r['store']:6s} {r['op']:4s} {human_bytes(r['size']):>9s} {r['batch']:5d} "
            f"{r['values']:6d} {r['gb_per_s']:8.2f} {r['values_per_s']:10,.0f} "
            f"{r['baseline_gb_per_s']:10.2f} {r['overhead_pct']:+9.1f}% {share:>9s}"
        )
    if any(result["evictions"].values()):
        lines.append(f"evictions during the run (figures include them): {result['evictions']}")
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(parse_bytes(part.strip()) for part in text.split(","))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not all(sizes):
        raise argparse.ArgumentTypeError(f"expected sizes above 0, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        "stores",
        __doc__,
        f"{', '.join(human_bytes(s) for s in QUICK_SIZES)} values, "
        f"{human_bytes(QUICK_DATA)} per pass, one pass",
    )
    ap.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        metavar="S1,S2,...",
        help=f"value sizes, e.g. 64KiB,2MiB (default: {', '.join(human_bytes(s) for s in SIZES)})",
    )
    ap.add_argument(
        "--repeats", type=positive_int, default=None, help=f"rounds per cell (default {REPEATS})"
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the disk store writes (default: a temp dir)"
    )
    ap.add_argument(
        "--redis-url",
        default=None,
        help="a Redis server to measure (default: start redis-server on loopback if installed)",
    )
    args = ap.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    data = QUICK_DATA if args.quick else DATA
    repeats = args.repeats or (1 if args.quick else REPEATS)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    result = run(sizes, data, repeats, args.dir, args.redis_url, log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    save_if_asked(args, result, ap.prog, argv)
    return 0


if __name__ == "__main__":
    run_as_script("stores")
