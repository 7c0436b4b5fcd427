"""The storage tiers against real backends: host memory, a real directory, a real redis-server
(and a real 3-node Redis Cluster) started on loopback. Every fault is a real one: bytes flipped
in a real file, a server killed with SIGKILL, a write past a real file-size limit."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import InvalidArgumentError, PayloadError
from kvtier.stores import (
    FORMAT_VERSION,
    DiskStore,
    HostStore,
    KVStore,
    Namespace,
    RedisStore,
    StoreClosedError,
)
from kvtier.stores import format as fmt

NS = Namespace("smollm2-135m", codec="int4", dtype="float16", shape="L30xH3xB16xD64")
RNG = np.random.default_rng(7)


def payload(n: int) -> bytes:
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def store(open_store: Any) -> KVStore:
    return open_store(NS)


# -- the interface, on every store ---------------------------------------------------------------


def test_round_trip_single_and_batched(store: KVStore) -> None:
    values = [payload(n) for n in (0, 1, 4096, 65536, 1 << 20)]
    keys = [0xDEADBEEF00000000 + i for i in range(len(values))]
    assert store.put_many(keys, values) == [True] * len(values)
    got = store.get_many([*keys, 12345])
    assert [bytes(g) for g in got[:-1]] == values and got[-1] is None
    assert store.put("text-key", np.arange(100, dtype=np.float32))
    assert np.array_equal(np.frombuffer(store.get("text-key"), np.float32), np.arange(100))
    assert sorted(store.keys()) == sorted([f"{k:016x}" for k in keys] + ["text-key"])
    assert store.contains(keys[2]) and not store.contains(12345)
    assert store.contains_many([keys[2], 12345, "text-key"]) == [True, False, True]
    # overwrite, delete, pop
    assert store.put(keys[0], b"new") and bytes(store.get(keys[0])) == b"new"
    assert store.delete(keys[1]) and not store.delete(keys[1]) and store.get(keys[1]) is None
    assert bytes(store.pop(keys[2])) == values[2] and store.pop(keys[2]) is None
    s = store.stats
    assert s.corrupt == 0 and s.errors == 0 and s.hits >= 8 and s.misses >= 3


def test_returned_values_are_read_only_and_stable(store: KVStore) -> None:
    v = bytearray(payload(1000))
    store.put(1, v)
    v[0] ^= 0xFF  # the caller reuses its buffer: the store kept its own copy
    got = store.get(1)
    assert got is not None and got.readonly and bytes(got) == bytes([v[0] ^ 0xFF]) + bytes(v[1:])
    store.put(1, b"other")
    assert got[0] == v[0] ^ 0xFF  # a view handed out earlier is never rewritten


def test_namespaces_never_see_each_other(store: KVStore) -> None:
    others = [
        Namespace("another-model", codec=NS.codec, dtype=NS.dtype, shape=NS.shape),
        Namespace(NS.model, tenant="tenant b", codec=NS.codec, dtype=NS.dtype, shape=NS.shape),
        NS.with_codec("int8", NS.dtype, NS.shape),
        NS.with_codec(NS.codec, NS.dtype, "L30xH3xB32xD64"),
    ]
    store.put(42, b"mine")
    for ns in others:
        view = store.with_namespace(ns)
        assert view.get(42) is None and not view.contains(42) and list(view.keys()) == []
        view.put(42, b"theirs")
    assert bytes(store.get(42)) == b"mine" and list(store.keys()) == [f"{42:016x}"]


def test_bad_input_is_refused_and_changes_nothing(store: KVStore) -> None:
    store.put(7, b"kept")
    bad: list[tuple[Any, str]] = [
        (lambda: store.put(-1, b"x"), "64-bit hash"),
        (lambda: store.put(2**64, b"x"), "64-bit hash"),
        (lambda: store.put("has space", b"x"), "printable ASCII"),
        (lambda: store.put(1.5, b"x"), "64-bit hash or"),
        (lambda: store.put(7, "a str"), "expected bytes"),
        (lambda: store.put(7, object()), "expected bytes"),
        (lambda: store.put(7, np.arange(10)[::2]), "contiguous"),
        (lambda: store.put_many([7, 8], [b"x"]), "one value per key"),
    ]
    for call, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            call()
    assert bytes(store.get(7)) == b"kept" and list(store.keys()) == [f"{7:016x}"]
    view = store.with_namespace(NS.with_codec("int8", NS.dtype, NS.shape))
    store.close()
    calls: list[Any] = [
        lambda s: s.get(7),
        lambda s: s.get_many([7]),
        lambda s: s.pop(7),
        lambda s: s.put(7, b"x"),
        lambda s: s.put_many([7], [b"x"]),
        lambda s: s.contains(7),
        lambda s: s.contains_many([7]),
        lambda s: s.delete(7),
        lambda s: list(s.keys()),
    ]
    for closed in (store, view):  # a namespace view shares its backend, closed or not
        for call in calls:
            with pytest.raises(StoreClosedError, match="closed"):
                call(closed)


def test_a_namespace_checks_its_fields() -> None:
    with pytest.raises(InvalidArgumentError, match="namespace model"):
        Namespace("")
    with pytest.raises(InvalidArgumentError, match="namespace tenant"):
        Namespace("m", tenant="line\nbreak")


# -- the value format ------------------------------------------------------------------------------


def sealed(ns: Namespace = NS, key: str = NS.key(5), data: bytes = b"payload" * 100) -> bytes:
    return b"".join(bytes(c) for c in fmt.Sealed(ns, key, memoryview(data)).chunks())


def test_one_pass_copy_and_checksum_equals_the_two_pass_seal() -> None:
    from kvtier._core import checksum, copy_checksum

    parts = [RNG.integers(0, 256, n, dtype=np.uint8) for n in (0, 5, 200_003)]
    joined = np.concatenate(parts)
    out = np.zeros(len(joined) + 7, np.uint8)
    assert copy_checksum(out, *parts) == checksum(joined)
    assert bytes(out[: len(joined)]) == joined.tobytes() and not out[len(joined) :].any()
    payload = memoryview(parts[2].tobytes())
    assert bytes(fmt.seal_joined(NS, NS.key(9), payload)) == b"".join(
        bytes(c) for c in fmt.Sealed(NS, NS.key(9), payload).chunks()
    )
    with pytest.raises(InvalidArgumentError, match="expected at least"):
        copy_checksum(np.zeros(3, np.uint8), parts[2])
    frozen = np.zeros(10, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="writable"):
        copy_checksum(frozen, parts[1])


def test_checksum_parts_may_be_any_bytes_like() -> None:
    from kvtier._core import StreamingChecksum, checksum, digest

    data = RNG.integers(0, 256, 70_001, dtype=np.uint8)
    want = checksum(data)
    for part in (data.tobytes(), bytearray(data.tobytes()), memoryview(data.tobytes())):
        assert checksum(part) == want
    # A contiguous view is hashed as its bytes, whatever its format and shape; a strided one as
    # the bytes it shows.
    assert checksum(memoryview(data[:70_000].view(np.float32).reshape(100, -1))) == checksum(
        data[:70_000]
    )
    assert checksum(memoryview(data.tobytes())[::3]) == checksum(data[::3].copy())
    assert checksum(b"ab", b"c") == checksum(np.frombuffer(b"abc", np.uint8))
    streamed = StreamingChecksum()
    for at in range(0, len(data), 30_000):  # pieces of any size, in order
        streamed.update(data[at : at + 30_000])
        assert streamed.digest() == checksum(data[: at + 30_000])
    streamed.update(b"", bytearray(b"x"))
    assert streamed.digest() == checksum(data, b"x") != want
    for call in (checksum, digest):
        with pytest.raises(InvalidArgumentError, match="uint8"):
            call(np.array([1, 256]))  # would wrap
        with pytest.raises(InvalidArgumentError, match="uint8"):
            call(np.array([-1], np.int8))


def crc64_nvme(data: bytes) -> int:
    """CRC-64/NVME bit by bit, from its published parameters (poly 0xad93d23594c93659,
    reflected, init and xorout all ones): what any CRC library computes."""
    crc = 2**64 - 1
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x9A6C9329AC4BC9B5 if crc & 1 else 0)
    return crc ^ (2**64 - 1)


def test_the_checksum_is_the_published_crc64_nvme() -> None:
    """Any CRC library can check a stored value: the catalogue's check value, and the bitwise
    definition on random data of every length around the vector paths' block sizes."""
    from kvtier._core import checksum

    assert checksum(b"123456789") == crc64_nvme(b"123456789") == 0xAE8B14860A799888
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099):
        data = RNG.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert checksum(data) == crc64_nvme(data), n


def test_digests_that_name_things_are_seeded_xxh3() -> None:
    """``digest`` (namespaces, token selections, file names) is xxh3-64, the prefix hash chain's
    hash: the same bytes with another seed name something else."""
    from kvtier._core import checksum, digest
    from kvtier.reference import xxh3

    data = RNG.integers(0, 256, 5_000, dtype=np.uint8)
    assert digest(data) == xxh3.xxh3_64(data.tobytes()) != checksum(data)
    assert digest(data.tobytes(), seed=7) == digest(data, seed=7) == xxh3.xxh3_64(data.tobytes(), 7)
    assert digest(b"ab", b"c") == digest(b"abc") != digest(b"abc", seed=1)


@pytest.mark.parametrize("n", [0, 1, fmt.CHUNK - 1, fmt.CHUNK, 3 * fmt.CHUNK + 5])
def test_a_value_sealed_as_it_is_written_is_the_joined_seal(n: int) -> None:
    payload = memoryview(RNG.integers(0, 256, n, dtype=np.uint8).tobytes())
    sealed = fmt.Sealed(NS, NS.key(3), payload)
    chunks = list(sealed.chunks())
    assert len(chunks) == 2 + sealed.payload_chunks
    assert all(len(c) <= fmt.CHUNK for c in chunks[1:-1])
    joined = b"".join(bytes(c) for c in chunks)
    assert joined == bytes(fmt.seal_joined(NS, NS.key(3), payload)) and len(joined) == sealed.size
    assert b"".join(bytes(c) for c in sealed.chunks()) == joined  # a retry writes it again
    assert bytes(fmt.unseal(NS, NS.key(3), joined)) == bytes(payload)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_files_read_and_checked_in_one_call_are_checked_like_any_value(
    tmp_path: Path, threads: int
) -> None:
    """On one thread, or on several that take the batch's files as they come once the large
    one has kept the first busy (more threads than files too): each good value's payload, and
    for each bad one the check ``unseal`` fails it with, in the order of the paths."""
    from kvtier._core import read_sealed

    values = [payload(n) for n in (0, 100, 4 * fmt.CHUNK + 3)]
    blobs = [bytes(fmt.seal_joined(NS, NS.key(4), memoryview(v))) for v in values]
    flipped = bytearray(blobs[2])
    flipped[-fmt.CHUNK] ^= 4  # in the value's last part
    files = {"a": blobs[0], "b": blobs[1], "c": blobs[2], "flipped": flipped, "tiny": b"KVTR"}
    files["short"] = blobs[2][:-3]  # a value cut short
    files["other key"] = bytes(fmt.seal_joined(NS, NS.key(5), memoryview(values[1])))
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / n) for n in [*files, "missing", "dir"]]
    (tmp_path / "dir").mkdir()
    texts = [fmt.header_texts(NS, NS.key(4))] * len(paths)
    read = read_sealed(paths, NS.digest, texts, threads)
    assert isinstance(read[-2], FileNotFoundError) and isinstance(read[-1], IsADirectoryError)
    for view, value in zip(read[:3], values, strict=True):
        assert isinstance(view, memoryview) and view.readonly and bytes(view) == value
    for bad, name in zip(read[3:-2], list(files)[3:], strict=True):
        assert isinstance(bad, PayloadError)
        with pytest.raises(PayloadError) as direct:
            fmt.unseal(NS, NS.key(4), files[name])
        assert str(bad) == str(direct.value)
    assert [str(e) for e in read[3:-2]] == [
        "checksum mismatch: the value is corrupt",
        "4 bytes: shorter than any header",
        f"{len(blobs[2]) - 3} bytes, the header says {len(blobs[2]) - 8 - len(values[2])}"
        f" + {len(values[2])} + 8: truncated or padded",
        f'written as key "{NS.key(5)}", read as "{NS.key(4)}"',
    ]
    with pytest.raises(InvalidArgumentError, match="texts"):
        read_sealed(paths, NS.digest, texts[:1], threads)


def test_an_unchecked_seal_differs_only_in_its_zero_checksum() -> None:
    """The host store's values: same header and payload, checksum field 0, never verified."""
    payload = memoryview(b"payload" * 100)
    checked = bytes(fmt.seal_joined(NS, NS.key(5), payload))
    unchecked = bytes(fmt.seal_joined(NS, NS.key(5), payload, checksummed=False))
    assert unchecked[:-8] == checked[:-8] and unchecked[-8:] == bytes(8)
    assert bytes(fmt.unseal(NS, NS.key(5), unchecked, verify=False)) == bytes(payload)
    with pytest.raises(PayloadError, match="checksum"):
        fmt.unseal(NS, NS.key(5), unchecked)


def test_every_flipped_bit_is_caught() -> None:
    blob = sealed()
    assert bytes(fmt.unseal(NS, NS.key(5), blob)) == b"payload" * 100
    for pos in range(len(blob)):
        for bit in (0, 7):
            bad = bytearray(blob)
            bad[pos] ^= 1 << bit
            with pytest.raises(PayloadError):
                fmt.unseal(NS, NS.key(5), bytes(bad))


@pytest.mark.parametrize(
    ("blob", "reader", "message"),
    [
        (sealed()[:-1], NS, "truncated"),
        (sealed() + b"\0", NS, "truncated"),
        (sealed()[:10], NS, "shorter than any header"),
        (b"NOTKVTIER" * 10, NS, "not a kvtier value"),
        (sealed(), NS.with_codec("int8", NS.dtype, NS.shape), "another namespace"),
        (sealed(), Namespace(NS.model, "t2", NS.codec, NS.dtype, NS.shape), "another namespace"),
        (sealed(key=NS.key(6)), NS, "written as key"),
    ],
)
def test_foreign_or_damaged_values_are_refused(
    blob: bytes, reader: Namespace, message: str
) -> None:
    with pytest.raises(PayloadError, match=message):
        fmt.unseal(reader, NS.key(5), blob)


def test_another_format_version_is_refused() -> None:
    blob = bytearray(sealed())
    blob[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(PayloadError, match="format version"):
        fmt.unseal(NS, NS.key(5), bytes(blob))


def test_a_value_of_format_version_1_is_refused() -> None:
    """Version 1 checksummed with xxh3-64: such a value, whole and sound in its own format, is
    refused for its version; sealed as version 2 with that checksum, for its checksum."""
    from kvtier.reference import xxh3

    v1 = bytearray(sealed())
    v1[4:6] = (1).to_bytes(2, "little")
    v1[-8:] = xxh3.xxh3_64(bytes(v1[:-8])).to_bytes(8, "little")
    with pytest.raises(PayloadError, match="format version 1, this kvtier reads 2"):
        fmt.unseal(NS, NS.key(5), bytes(v1))
    v1[4:6] = FORMAT_VERSION.to_bytes(2, "little")
    with pytest.raises(PayloadError, match="checksum mismatch"):
        fmt.unseal(NS, NS.key(5), bytes(v1))


@pytest.mark.parametrize(  # not "host": a host store's values live and die with its process
    "open_store", ["disk", pytest.param("redis", marks=pytest.mark.redis)], indirect=True
)
def test_another_format_versions_values_are_neither_read_nor_removed(open_store: Any) -> None:
    """A rolling upgrade: kvtier 1 (format 1, its namespace digest without the version) and this
    one share a directory or a Redis. Neither sees the other's keys, so neither removes the
    other's values as foreign."""
    from kvtier._core import store_path
    from kvtier.reference import xxh3

    store = open_store(NS)
    fields = (NS.model, NS.tenant, NS.codec, NS.dtype, NS.shape)
    v1_digest = xxh3.xxh3_64("\0".join(("kvtier-namespace", *fields)).encode())
    v1_key = f"kvtier:{v1_digest:016x}:{NS.key(5).rsplit(':', 1)[1]}"
    # Version 1's header, packed here by hand: the layout of versions 1 and 2 is the same.
    texts = struct.pack("<H", len(v1_key)) + v1_key.encode() + NS.packed_texts
    head = struct.pack("<4sHHQQ", b"KVTR", 1, 24 + len(texts), 3, v1_digest) + texts
    v1_value = head + b"old" + xxh3.xxh3_64(head + b"old").to_bytes(8, "little")
    if store.kind == "disk":
        v1_file = Path(store_path(os.fspath(store.root), v1_key))
        v1_file.parent.mkdir(parents=True)
        v1_file.write_bytes(v1_value)
        still_there = v1_file.read_bytes
    else:
        raw = store._client()
        raw.set(v1_key, v1_value)
        still_there = lambda: raw.get(v1_key)  # noqa: E731
    assert v1_key != NS.key(5) and store.get(5) is None
    assert store.put(5, b"new") and bytes(store.get(5)) == b"new"
    assert list(store.keys()) == [NS.key(5).rsplit(":", 1)[1]]
    assert still_there() == v1_value and store.stats.corrupt == 0


def _sealed_v2_fixture() -> dict[str, Any]:
    """crates/kvtier-store/tests/fixtures/sealed-v2.txt: a value as kvtier sealed it before
    the format moved into the Rust store crate (issue 43), with what it was sealed from."""
    path = Path(__file__).parents[1] / "crates/kvtier-store/tests/fixtures/sealed-v2.txt"
    fields: dict[str, Any] = {}
    section = None
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            fields[section] = b""
        elif section is not None:
            fields[section] += bytes.fromhex(line)
        else:
            name, value = line.split(" ", 1)
            fields[name] = int(value, 16) if name == "digest" else value
    return fields


def test_a_value_sealed_before_the_format_moved_to_rust_reads_and_seals_the_same(
    tmp_path: Path,
) -> None:
    """The byte layout did not change: a value stored by the old Python encoder reads back
    (unseal, and from a disk store's file), and sealing its payload today gives its bytes."""
    from kvtier._core import store_path

    old = _sealed_v2_fixture()
    ns = Namespace(
        "fixture-model",
        "tenant-a",
        "int4",
        "float16",
        "BlockShape(layers=2, heads=4, head_dim=64, tokens=16)",
    )
    key = ns.key(0x0123456789ABCDEF)
    assert (ns.digest, ns.packed_texts, key) == (old["digest"], old["texts"], old["key"])
    payload, sealed = old["payload"], old["sealed"]
    assert bytes(fmt.unseal(ns, key, sealed)) == payload
    assert fmt.read_key(sealed) == key
    assert bytes(fmt.seal_joined(ns, key, memoryview(payload))) == sealed
    assert b"".join(bytes(c) for c in fmt.Sealed(ns, key, memoryview(payload)).chunks()) == sealed
    unchecked = fmt.seal_joined(ns, key, memoryview(payload), checksummed=False)
    assert unchecked == sealed[:-8] + bytes(8)
    assert len(sealed) == len(payload) + fmt.OVERHEAD + len(key) + len(ns.packed_texts) - 6
    file = Path(store_path(os.fspath(tmp_path), key))
    file.parent.mkdir(parents=True)
    file.write_bytes(sealed)
    store = DiskStore(tmp_path, ns, 1 << 20)
    assert bytes(store.get(0x0123456789ABCDEF)) == payload and store.stats.corrupt == 0


def test_any_contiguous_buffer_unseals_to_a_read_only_view_of_its_payload() -> None:
    blob = sealed()
    array = np.frombuffer(blob, np.uint8).copy()
    for form in (blob, bytearray(blob), memoryview(blob), array, array.view(np.int8), array[None]):
        view = fmt.unseal(NS, NS.key(5), form)
        assert view.readonly and view.format == "B" and bytes(view) == b"payload" * 100
    with pytest.raises(InvalidArgumentError, match="contiguous buffer, got memoryview"):
        fmt.unseal(NS, NS.key(5), memoryview(blob + blob)[::2])
    with pytest.raises(InvalidArgumentError, match="contiguous buffer, got list"):
        fmt.unseal(NS, NS.key(5), list(blob))


def test_a_foreign_value_in_a_store_is_a_counted_miss_and_removed(tmp_path: Path) -> None:
    """A value written by another codec, copied under this namespace's key, is never served."""
    int8 = NS.with_codec("int8", NS.dtype, NS.shape)
    store = DiskStore(tmp_path, NS, 1 << 20)
    store.with_namespace(int8).put(9, b"int8 bytes")
    store.put(9, b"int4 bytes")
    [theirs] = [
        p for p in tmp_path.rglob("*") if p.is_file() and b"int4 bytes" not in p.read_bytes()
    ]
    [mine] = [p for p in tmp_path.rglob("*") if p.is_file() and p != theirs]
    mine.write_bytes(theirs.read_bytes())
    assert store.get(9) is None
    assert store.stats.corrupt == 1 and not mine.exists() and theirs.exists()


# -- disk ------------------------------------------------------------------------------------------


def test_disk_names_a_file_by_its_key_or_by_the_key_hash(tmp_path: Path) -> None:
    """``_core.store_path``: ``<root>/<namespace>/<low byte of the key hash>/<name>``, and the
    hash in place of a name that is not a safe file name."""
    from kvtier._core import digest, store_path

    def where(name: str, file: str | None = None) -> str:
        h = digest((NS.prefix + name).encode())
        return f"/r/{NS.digest:016x}/{h & 0xFF:02x}/{file or f'~{h:016x}'}"

    for name in ("0000000000000007", "block_7.v=2-x", "x" * 120):
        assert store_path("/r", NS.prefix + name) == where(name, name)
    for name in (".tmp-1-2-x", "a:b", "x" * 121, "a/b", "é"):
        assert store_path("/r", NS.prefix + name) == where(name)
    with pytest.raises(InvalidArgumentError, match="store key"):
        store_path("/r", "kvtier-without-a-namespace")


def test_disk_batch_calls_refuse_bad_batches_before_touching_anything(tmp_path: Path) -> None:
    """``_core.write_stored`` / ``read_stored``: a malformed key or a column of the wrong
    length is an InvalidArgumentError, and nothing is written or counted."""
    from kvtier._core import StoreIndex, read_stored, write_stored

    index = StoreIndex("lru", 1 << 20)
    good, bad = NS.key(1), "no-namespace"
    head = fmt.header(NS, good, 3)
    with pytest.raises(InvalidArgumentError, match="store key"):
        write_stored(str(tmp_path), [good, bad], [head, head], [b"abc", b"abc"], index, ".t-")
    with pytest.raises(InvalidArgumentError, match="payloads"):
        write_stored(str(tmp_path), [good], [head], [], index, ".t-")
    with pytest.raises(InvalidArgumentError, match="store key"):
        read_stored(str(tmp_path), [bad], NS.digest, NS.packed_texts, index)
    assert len(index) == 0 and list(tmp_path.iterdir()) == []
    assert write_stored(str(tmp_path), [good], [head], [b"abc"], index, ".t-") == ([True], [], 0)
    (value,) = read_stored(str(tmp_path), [good], NS.digest, NS.packed_texts, index)
    assert bytes(value) == b"abc" and index.used_bytes == len(head) + 3 + 8


def test_disk_files_gone_or_unreadable_are_misses_and_the_rest_is_read(tmp_path: Path) -> None:
    """A file removed behind the store's back is a miss that leaves the budget; one that cannot
    be read (here a directory in its place) is a miss and a counted error; the batch's other
    values are read all the same. Directories removed behind its back are made again."""
    store = DiskStore(tmp_path, NS, 1 << 20)
    values = [payload(3000 + i) for i in range(4)]
    store.put_many([1, 2, 3, 4], values)
    used, gone = store.used_bytes, os.path.getsize(store._path(NS.key(2)))
    os.unlink(store._path(NS.key(2)))
    os.unlink(store._path(NS.key(3)))
    os.mkdir(store._path(NS.key(3)))
    got = store.get_many([1, 2, 3, 4])
    assert [bytes(g) if g is not None else None for g in got] == [values[0], None, None, values[3]]
    assert store.stats.errors == 1 and store.stats.misses == 2 and store.stats.corrupt == 0
    assert store.used_bytes == used - gone  # the value whose file is gone no longer counts
    shutil.rmtree(os.path.dirname(os.path.dirname(store._path(NS.key(1)))))  # the namespace's
    assert store.put_many([1, 3], values[:2]) == [True, True]  # its directories made again
    assert [bytes(v) for v in store.get_many([1, 3])] == values[:2]


def test_disk_values_read_a_chunk_at_a_time_are_checked_whole(tmp_path: Path) -> None:
    """A value is read and hashed 256 KiB at a time, its checksum field held back from the
    hash until the end: files just under, at and over a chunk boundary (the field split by
    one) read back exactly, and a flip in their last payload byte is caught."""
    store = DiskStore(tmp_path, NS, 1 << 24, io_threads=1)
    chunk = 256 * 1024
    overhead = len(fmt.header(NS, NS.key(0), 0)) + 8
    sizes = [n - overhead for n in (chunk - 1, chunk, chunk + 4, 2 * chunk + 8, 2 * chunk + 9)]
    values = [payload(n) for n in sizes]
    store.put_many(list(range(len(sizes))), values)
    assert [bytes(v) for v in store.get_many(list(range(len(sizes))))] == values
    for key in range(len(sizes)):
        path = Path(store._path(NS.key(key)))
        raw = bytearray(path.read_bytes())
        raw[-9] ^= 1
        path.write_bytes(bytes(raw))
    assert store.get_many(list(range(len(sizes)))) == [None] * len(sizes)
    assert store.stats.corrupt == len(sizes)


def test_disk_survives_a_restart(tmp_path: Path) -> None:
    values = {i: payload(10_000 + i) for i in range(20)}
    store = DiskStore(tmp_path, NS, 1 << 20)
    store.put_many(list(values), list(values.values()))
    store.close()
    reopened = DiskStore(tmp_path, NS, 1 << 20)
    assert reopened.used_bytes == store.used_bytes
    assert [bytes(v) for v in reopened.get_many(list(values))] == list(values.values())


def test_a_disk_batch_written_on_threads_ends_as_if_written_in_order(tmp_path: Path) -> None:
    """A batch is written on several threads at once, yet it ends as puts in order would: a
    key given twice holds its last value, and a value evicted by a later one of the same batch
    leaves no file behind (the budget holds on disk, not only in the index)."""
    one = len(sealed(data=payload(10_000)))
    store = DiskStore(tmp_path, NS, 4 * one + 10, io_threads=4)
    keys = [0, 1, 2, 0, 3, 4, 5, 1]
    values = [payload(10_000) for _ in keys]
    assert store.put_many(keys, values) == [True] * len(keys)
    assert sorted(store.keys()) == [f"{k:016x}" for k in (1, 3, 4, 5)]
    assert [bytes(v) for v in store.get_many([1, 3, 4, 5])] == [values[i] for i in (7, 4, 5, 6)]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 4 and sum(p.stat().st_size for p in files) == store.used_bytes
    with pytest.raises(InvalidArgumentError, match="io_threads"):
        DiskStore(tmp_path, NS, 1 << 20, io_threads=0)


def test_a_file_written_checksummed_is_the_joined_seal_or_nothing(tmp_path: Path) -> None:
    """``_core.write_checksummed``: each file holds exactly ``seal_joined``'s bytes; a write that
    fails leaves the old file as it was and no temporary file."""
    from kvtier._core import write_checksummed

    # The large value first: it takes long enough for the batch to call helper threads.
    values = [payload(n) for n in (4 * fmt.CHUNK + 3, 0, 100, 1 << 18)]
    heads = [fmt.header(NS, NS.key(i), len(v)) for i, v in enumerate(values)]
    paths = [str(tmp_path / f"v{i}") for i in range(len(values))]
    tmps = [p + ".tmp" for p in paths]

    def written_right() -> bool:
        return all(
            Path(paths[i]).read_bytes() == bytes(fmt.seal_joined(NS, NS.key(i), memoryview(v)))
            for i, v in enumerate(values)
        )

    # In order, hashed chunk by chunk; the files shared among threads; with CPUs to spare
    # (a large value is then hashed on a thread beside its writing).
    for threads in (1, 2, 8):
        assert write_checksummed(tmps, paths, heads, values, threads=threads) == [None] * 4
        assert written_right()
    for i, v in enumerate(values):  # one at a time, with a CPU to spare
        assert write_checksummed(
            tmps[i : i + 1], paths[i : i + 1], heads[i : i + 1], [v], threads=2
        ) == [None]
    assert written_right()
    (err,) = write_checksummed(
        [str(tmp_path / "gone" / "t")], [paths[2]], [heads[0]], [b"new"], fsync=True
    )
    assert isinstance(err, FileNotFoundError) and Path(paths[2]).read_bytes()[-108:-8] == values[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0", "v1", "v2", "v3"]
    with pytest.raises(InvalidArgumentError, match="payloads"):
        write_checksummed(tmps, paths, heads, values[:2])


def test_disk_corruption_is_a_miss_and_the_file_is_removed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, NS, 1 << 20)
    store.put_many([1, 2, 3], [payload(5000)] * 3)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    flipped, truncated, _ = files
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    flipped.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    got = store.get_many([1, 2, 3])
    assert sum(g is None for g in got) == 2 and store.stats.corrupt == 2
    assert not flipped.exists() and not truncated.exists()
    assert store.used_bytes == files[2].stat().st_size


def test_disk_budget_evicts_least_recently_used_and_refuses_the_oversized(tmp_path: Path) -> None:
    one = len(sealed(data=payload(10_000)))
    store = DiskStore(tmp_path, NS, 3 * one + 10)
    for i in range(3):
        store.put(i, payload(10_000))
    store.get(0)  # 0 is now more recent than 1
    assert store.put(3, payload(10_000))
    assert [store.contains(i) for i in range(4)] == [True, False, True, True]
    assert store.stats.evictions == 1 and store.used_bytes <= store.budget
    assert not store.put(0, payload(4 * one))  # larger than the whole budget: refused
    assert store.get(0) is not None and store.stats.put_failures == 1


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from kvtier.stores import DiskStore, Namespace
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    store = DiskStore(sys.argv[1], Namespace("m"), 1 << 30)
    assert store.put(1, b"small value")
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    ok = store.put(1, bytes(1_000_000))
    print(ok, bytes(store.get(1)).decode(), store.stats.put_failures, store.stats.errors, store.used_bytes > 0)
    """
)


def test_a_full_disk_refuses_without_corrupting(tmp_path: Path) -> None:
    """A real write failure (RLIMIT_FSIZE: the kernel refuses the bytes past the limit, as a
    full disk does): the put reports failure, the old value stays, no temporary file is left."""
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "small", "value", "1", "1", "True"]
    assert [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith(".tmp")] == []


FSYNC_WRITER = textwrap.dedent(
    """
    import sys
    from kvtier.stores import DiskStore, Namespace
    store = DiskStore(sys.argv[1], Namespace("m"), 1 << 30, fsync=True)
    assert store.put_many([1, 2, 3], [b"a" * 100, b"b" * 200_000, b"c"]) == [True] * 3
    print("\\n".join(store._path(store.namespace.key(k)) for k in (1, 2, 3)))
    """
)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_fsync_syncs_each_file_and_then_its_directory(tmp_path: Path) -> None:
    """``fsync=True`` promises a value survives a power loss: its file is synced before the
    rename, and the directory holding the new name after it (the file's sync does not cover
    its name), as are the directories a first write creates. Seen in the real system calls."""
    trace = tmp_path / "strace.log"
    root = tmp_path / "store"
    strace = ["strace", "-f", "-y", "-e", "trace=fsync", "-o", str(trace)]
    out = subprocess.run(
        [*strace, sys.executable, "-c", FSYNC_WRITER, str(root)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    # One line per call, as it starts ("fsync(5</path>) = 0", or "<unfinished ...>" when
    # another thread's call is logged before it returns).
    lines = trace.read_text().splitlines()
    calls = [line.split("fsync(", 1)[1] for line in lines if "fsync(" in line]
    synced = [call.split("<", 1)[1].split(">", 1)[0] for call in calls if call[:1].isdigit()]
    paths = out.stdout.split()
    tmp_files = [p for p in synced if ".tmp-" in p]
    assert len(tmp_files) == 3  # each value's file, before its rename
    for path in paths:
        assert os.path.dirname(path) in synced[synced.index(tmp_files[-1]) :]
    namespace_dir = os.path.dirname(os.path.dirname(paths[0]))
    assert namespace_dir in synced and str(root) in synced


WRITER = textwrap.dedent(
    """
    import sys
    from kvtier.stores import DiskStore, Namespace
    store = DiskStore(sys.argv[1], Namespace("m"), 1 << 30)
    fill = int(sys.argv[2])
    for _ in range(300):
        assert store.put("shared", bytes([fill]) * 300_000)
    """
)


def test_two_processes_writing_one_key_never_tear_it(tmp_path: Path) -> None:
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(fill)])
        for fill in (0xAA, 0x55)
    ]
    reader = DiskStore(tmp_path, Namespace("m"), 1 << 30)
    seen = set()
    while any(w.poll() is None for w in writers):
        got = reader.get("shared")
        if got is not None:
            assert len(set(bytes(got))) == 1 and len(got) == 300_000
            seen.add(got[0])
    assert all(w.returncode == 0 for w in writers)
    assert reader.stats.corrupt == 0 and seen <= {0xAA, 0x55} and seen


def test_pop_hands_a_value_to_exactly_one_taker(tmp_path: Path) -> None:
    for store in (HostStore(NS, 1 << 20), DiskStore(tmp_path, NS, 1 << 20)):
        for round_ in range(20):
            store.put(round_, b"only once")
            results: list[Any] = []

            def take(s: Any = store, key: int = round_, out: list[Any] = results) -> None:
                out.append(s.pop(key))

            threads = [threading.Thread(target=take) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sum(r is not None for r in results) == 1


def test_host_budget_evicts_least_recently_used() -> None:
    one = len(sealed(data=payload(1000)))
    store = HostStore(NS, 2 * one)
    store.put_many([1, 2], [payload(1000)] * 2)
    store.get(1)
    store.put(3, payload(1000))
    assert [store.contains(i) for i in (1, 2, 3)] == [True, False, True]
    assert store.used_bytes == 2 * one and store.stats.evictions == 1
    assert not store.put(4, payload(3 * one)) and store.contains(1)


def test_host_views_are_read_only_and_outlive_what_they_were_got_from() -> None:
    """A host get hands out a view of the stored bytes themselves (no copy): it cannot write
    them, and it stays whole after the value is replaced, evicted, deleted, or the store closed.
    Payloads of any contiguous buffer type are stored as their bytes."""
    one = len(sealed(data=payload(1000)))
    store = HostStore(NS, 2 * one)
    floats = np.arange(250, dtype=np.float32)
    store.put_many([1, 2], [floats, memoryview(floats)])
    views = [store.get(1), store.get(2)]
    assert all(v is not None and v.readonly for v in views)
    with pytest.raises(TypeError):
        views[0][0] = 1  # type: ignore[index]
    with pytest.raises((BufferError, ValueError)):
        np.frombuffer(views[0], np.uint8)[0] = 1  # read-only: numpy refuses the write
    store.put(1, payload(1000))  # replaces 1
    store.put(3, payload(1000))  # evicts 2
    assert not store.contains(2)
    store.close()
    for view in views:
        assert view is not None and bytes(view) == floats.tobytes()
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        HostStore(NS, one).put(1, np.arange(8, dtype=np.uint8)[::2])


def test_a_host_store_dropped_without_close_is_freed() -> None:
    """Its values are freed with it: the store and its extension handle refer to each other,
    and the garbage collector must be able to see that."""
    import gc
    import weakref

    store = HostStore(NS, 1 << 20)
    view = store.with_namespace(Namespace(model="other"))
    store.put(1, payload(1000))
    refs = [weakref.ref(store), weakref.ref(view)]
    del store, view
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_put_racing_close_leaves_nothing_in_the_closed_store() -> None:
    """A put on another thread that passed its open check just before ``close`` (here while
    its value goes through ``format.payload_view``, Python code the thread can be switched out
    of) is refused, not left in the closed store's values."""
    import array

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(100):
            store = HostStore(NS, 1 << 24)
            values = store._values
            value = array.array("B", bytes(1000))  # not a type the store reads directly

            def put_until_closed(store: HostStore = store, value: Any = value) -> None:
                try:
                    while store.put(1, value):
                        pass
                except StoreClosedError:
                    pass

            putter = threading.Thread(target=put_until_closed)
            putter.start()
            time.sleep(1e-4)
            store.close()
            putter.join()
            assert len(values) == 0
    finally:
        sys.setswitchinterval(switch)


def _budgeted(kind: str, tmp_path: Path, budget: int, policy: str) -> KVStore:
    if kind == "host":
        return HostStore(NS, budget, policy=policy)
    return DiskStore(tmp_path, NS, budget, policy=policy)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_budgeted_stores_evict_by_the_cores_policy(kind: str, tmp_path: Path) -> None:
    one = len(sealed(data=payload(1000)))
    survivors = {}
    for policy in ("lru", "lfu", "importance"):
        store = _budgeted(kind, tmp_path / policy, 3 * one, policy)
        assert store.policy == policy
        store.put_many([1, 2, 3], [payload(1000)] * 3)
        for _ in range(3):
            store.get(1)  # 1: read often, but longest ago
        store.get_many([2, 3])
        store.set_scores([1, 2, 3], [0.1, 0.2, 0.9])  # 3 matters most, 1 least
        store.set_scores([99], [1.0])  # unknown keys are skipped
        assert store.put(4, payload(1000)) and store.stats.evictions == 1
        survivors[policy] = [k for k in (1, 2, 3) if store.contains(k)]
        assert store.used_bytes == 3 * one
    assert survivors == {"lru": [2, 3], "lfu": [1, 3], "importance": [2, 3]}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_budgeted_stores_evict_a_prefix_tail_first(kind: str, tmp_path: Path) -> None:
    """Blocks of a prefix under their hashes, each linked to the one before it: eviction takes
    the leaves (the tail), never a block whose later blocks are held, whatever the policy says
    (here lru, whose least recent block is the prefix's first)."""
    one = len(sealed(data=payload(1000)))
    store = _budgeted(kind, tmp_path, 4 * one, "lru")
    prefix = [11, 12, 13]  # put in order: 11 is the least recent
    store.put_many([*prefix, 20], [payload(1000)] * 4)
    store.set_parents(prefix[1:], prefix[:-1])
    store.set_parents([99], [11])  # a key not held is skipped
    with pytest.raises(InvalidArgumentError, match="one per key"):
        store.set_parents([12, 13], [11])
    assert store.put_many([30, 31], [payload(1000)] * 2) == [True, True]
    # 13 (the tail, the least recent leaf) went, then 12 (a leaf then, less recent than 20):
    # what is left of the prefix still loads
    assert [k for k in (*prefix, 20, 30, 31) if store.contains(k)] == [11, 20, 30, 31]
    assert store.put(32, payload(1000)) and not store.contains(11) and store.contains(20)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_bad_policy_or_scores_are_refused(kind: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='unknown policy "fifo"'):
        _budgeted(kind, tmp_path, 1000, "fifo")
    store = _budgeted(kind, tmp_path, 10_000, "importance")
    store.put(1, payload(100))
    with pytest.raises(InvalidArgumentError, match="one per key"):
        store.set_scores([1, 2], [1.0])
    with pytest.raises(InvalidArgumentError, match="finite"):
        store.set_scores([1], [float("nan")])
    assert store.get(1) is not None


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("budget", [0, -1, 2**63, 1.5, True, "1GiB"])
def test_a_budget_that_is_not_a_positive_byte_count_is_refused_at_construction(
    kind: str, budget: object, tmp_path: Path
) -> None:
    """A budget of 0 bytes would open a store that refuses every put: the constructor says so
    (naming the argument, the value and what it takes), and a disk store makes no directory."""
    with pytest.raises(InvalidArgumentError) as info:
        _budgeted(kind, tmp_path / "kv", budget, "lru")  # type: ignore[arg-type]
    expected = "expected a positive number of bytes (at most 2**63 - 1)"
    assert str(info.value) == f"budget: {expected}, got {budget!r}"
    assert not (tmp_path / "kv").exists()
    assert _budgeted(kind, tmp_path / "kv", 1, "lru").budget == 1
    assert _budgeted(kind, tmp_path / "top", 2**63 - 1, "lru").budget == 2**63 - 1


def test_disk_reopened_under_a_smaller_budget_keeps_the_newest(tmp_path: Path) -> None:
    one = len(sealed(data=payload(1000)))
    store = DiskStore(tmp_path, NS, 10 * one)
    for i in range(5):
        store.put(i, payload(1000))
        later = time.time() + i  # distinct mtimes, oldest first
        os.utime(store._path(NS.key(i)), (later, later))
    reopened = DiskStore(tmp_path, NS, 2 * one)
    assert [reopened.contains(i) for i in range(5)] == [False, False, False, True, True]
    assert reopened.used_bytes == 2 * one and reopened.stats.evictions == 3


# -- redis -----------------------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_corrupt_and_foreign_values_are_misses(redis_server: Any) -> None:
    import redis

    store = RedisStore(redis_server.url, NS)
    raw = redis.Redis.from_url(redis_server.url)
    store.put(11, payload(5000))
    blob = bytearray(raw.get(NS.key(11)))
    blob[100] ^= 1
    raw.set(NS.key(11), bytes(blob))
    raw.set(NS.key(12), b"written by something else")
    raw.set(NS.key(13), b"tiny")  # shorter than its own checksum field
    assert store.get_many([11, 12, 13]) == [None, None, None]
    assert store.stats.corrupt == 3 and raw.exists(NS.key(11), NS.key(12), NS.key(13)) == 0


@pytest.fixture(params=["hiredis", "python"])
def reply_parser(request: Any) -> Any:
    """redis-py's reply parsers: hiredis (kvtier's `redis` extra installs it) and its own
    pure-Python one (what a plain `pip install redis` gets)."""
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    if request.param == "hiredis" and not HIREDIS_AVAILABLE:
        pytest.skip("hiredis is not installed")
    return _HiredisParser if request.param == "hiredis" else _RESP2Parser


def parsing_with(store: RedisStore, parser: Any) -> RedisStore:
    """``store``, its connections (none made yet) reading replies with ``parser``."""
    store._client().connection_pool.connection_kwargs["parser_class"] = parser
    return store


@pytest.mark.redis
def test_redis_refusing_one_get_misses_that_value_only(
    redis_server: Any, reply_parser: Any
) -> None:
    """A key that holds no string (the server answers WRONGTYPE) is a miss, counted once; the
    other values of the batch are read in step, and the server is not taken for gone."""
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    store = parsing_with(RedisStore(redis_server.url, NS), reply_parser)
    values = [payload(70_000 + i) for i in range(3)]
    store.put_many([21, 23, 24], values)
    raw.rpush(NS.key(22), b"a list, not a value")
    got = store.get_many([21, 22, 23, 24])
    assert got[1] is None and [bytes(g) for g in got if g is not None] == values
    assert store.stats.errors == 1 and store.stats.hits == 3
    assert store.put(25, b"at once") and bytes(store.get(25)) == b"at once"


@pytest.mark.redis
def test_a_redis_store_without_hiredis_says_so_once(
    redis_server: Any, monkeypatch: Any, caplog: Any
) -> None:
    import redis.utils

    from kvtier.stores import remote

    remote._warn_no_hiredis.cache_clear()
    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    with caplog.at_level("WARNING", logger="kvtier.stores"):
        RedisStore(redis_server.url, NS).close()
        RedisStore(redis_server.url, NS).close()
    said = [r.getMessage() for r in caplog.records if "hiredis" in r.getMessage()]
    assert len(said) == 1 and "pip install 'kvtier[redis]'" in said[0]


@pytest.mark.redis
def test_redis_values_are_the_sealed_bytes_with_their_ttl(
    redis_server: Any, reply_parser: Any
) -> None:
    """A put writes its own SET commands around the caller's payload: what the server holds
    must be exactly the joined sealed value, with the TTL asked for."""
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    values = [payload(n) for n in (0, 1, 7000, 300_000, 3 * fmt.CHUNK + 5)]
    for ttl in (None, 60.0):
        store = parsing_with(RedisStore(redis_server.url, NS, ttl=ttl), reply_parser)
        keys = [f"ttl-{ttl}-{n}" for n in range(len(values))]
        assert store.put_many(keys, values) == [True] * len(values)
        for key, value in zip(keys, values, strict=True):
            held = raw.get(NS.key(key))
            assert held == bytes(fmt.seal_joined(NS, NS.key(key), memoryview(value)))
            assert bytes(store.get(key)) == value
            remaining_ms = raw.pttl(NS.key(key))
            assert remaining_ms == -1 if ttl is None else 0 < remaining_ms <= 60_000
        store.close()


@pytest.mark.redis
def test_redis_refusing_one_value_fails_that_put_only(redis_server: Any) -> None:
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    store = RedisStore(redis_server.url, NS)
    before = raw.config_get("maxmemory")["maxmemory"]
    try:
        # Room for a few of the values: the server refuses the rest (OOM), each refusal a
        # failed put of that value only, and the replies after it are still read in step.
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", str(raw.info("memory")["used_memory"] + 3_000_000))
        keys, values = [f"fill-{i}" for i in range(8)], [payload(1_000_000 + i) for i in range(8)]
        stored = store.put_many(keys, values)
        assert True in stored and False in stored and stored == sorted(stored, reverse=True)
        raw.config_set("maxmemory", before)
        assert store.put("later", values[0])
        for key, value, ok in zip(keys, values, stored, strict=True):
            assert (bytes(store.get(key)) == value) if ok else store.get(key) is None
        assert store.stats.put_failures == stored.count(False) and store.stats.errors == 1
    finally:
        raw.config_set("maxmemory", before)
        store.delete_many([f"fill-{i}" for i in range(8)] + ["later"])


@pytest.mark.redis
@pytest.mark.parametrize("first_call", ["get", "put"])
def test_redis_killed_mid_run_then_back(first_call: str) -> None:
    """Whichever call meets the dead server first: misses and failed puts, at once."""
    from conftest import local_redis

    server = local_redis()
    try:
        store = RedisStore(server.url, NS, timeout=0.5, retry_after=0.3)
        assert store.put(1, b"before")
        server.kill()
        start = time.monotonic()
        if first_call == "get":
            assert store.get(1) is None  # a miss, not an exception
        assert store.put_many([2, 3], [b"x", b"y"]) == [False, False]
        assert store.get_many([1, 2]) == [None, None] and not store.contains(1)
        assert store.contains_many([1, 2]) == [False, False]
        assert time.monotonic() - start < 2.0  # no waiting on a dead server per call
        assert store.stats.errors >= 1 and store.stats.put_failures == 2
        server.start(server.ports[0])
        time.sleep(0.35)  # retry_after
        assert store.put(4, b"after")  # reconnected on its own
        assert bytes(store.get(4)) == b"after" and store.get(1) is None  # no persistence
    finally:
        server.stop()


@pytest.mark.redis
def test_redis_over_tls_needs_the_ca_and_a_client_certificate() -> None:
    from conftest import local_redis

    server = local_redis(tls=True)
    try:
        client = {"tls_ca": server.tls_ca, "tls_cert": server.tls_cert, "tls_key": server.tls_key}
        store = RedisStore(server.url, NS, timeout=0.5, **client)
        assert server.url.startswith("rediss://") and store.put(1, b"secret")
        assert bytes(store.get(1)) == b"secret"
        # A client the server refuses (no certificate), one that cannot verify the server (no
        # CA) and a plain-text one: misses and failed puts, never an exception.
        plain_url = server.url.replace("rediss://", "redis://")
        for url, tls in [
            (server.url, {"tls_ca": server.tls_ca}),
            (server.url, {"tls_cert": server.tls_cert, "tls_key": server.tls_key}),
            (plain_url, {}),
        ]:
            other = RedisStore(url, NS, timeout=0.5, **tls)
            assert other.get(1) is None and not other.put(2, b"x")
            assert other.stats.errors >= 1
        assert bytes(store.get(1)) == b"secret" and store.get(2) is None
        with pytest.raises(InvalidArgumentError, match="rediss://"):
            RedisStore(plain_url, NS, tls_ca=server.tls_ca)
    finally:
        server.stop()


@pytest.mark.redis
def test_redis_cluster(redis_cluster: Any) -> None:
    store = RedisStore(redis_cluster.url, NS)
    assert store.cluster
    keys = [int(k) for k in RNG.integers(0, 2**63, 300, dtype=np.int64)]
    values = [payload(2000) for _ in keys]
    assert all(store.put_many(keys, values))
    assert [bytes(v) for v in store.get_many(keys)] == values
    assert sorted(store.keys()) == sorted(f"{k:016x}" for k in keys)
    assert bytes(store.pop(keys[0])) == values[0] and store.get(keys[0]) is None
    assert store.with_namespace(Namespace("other")).get_many(keys[1:3]) == [None, None]


@pytest.mark.redis
def test_redis_cluster_over_tls_and_a_refused_client_misses() -> None:
    from conftest import local_redis

    cluster = local_redis(3, tls=True)
    try:
        client = {
            "tls_ca": cluster.tls_ca,
            "tls_cert": cluster.tls_cert,
            "tls_key": cluster.tls_key,
        }
        store = RedisStore(cluster.url, NS, timeout=0.5, **client)
        assert store.cluster and cluster.url.startswith("rediss://")
        keys = list(range(100))  # spread over the three nodes' slots
        values = [payload(500) for _ in keys]
        assert all(store.put_many(keys, values))
        assert [bytes(v) for v in store.get_many(keys)] == values
        # No client certificate: the nodes refuse it; a miss and a failed put, not an exception.
        refused = RedisStore(cluster.url, NS, cluster=True, timeout=0.5, tls_ca=cluster.tls_ca)
        assert refused.get(1) is None and refused.put(2, b"x") is False
        assert refused.stats.errors >= 1 and refused.stats.put_failures == 1
        assert bytes(store.get(2)) == values[2]  # what was stored is untouched
    finally:
        cluster.stop()


@pytest.mark.gpu
def test_host_store_pins_its_buffers(torch_cuda: Any) -> None:
    store = HostStore(NS, 1 << 20)
    assert store.pin
    value = payload(4096)
    store.put(1, value)
    got = store.get(1)
    assert got is not None and bytes(got) == value
    # The view a get hands out points into the pinned buffer the value was sealed into.
    tensor = torch_cuda.frombuffer(got, dtype=torch_cuda.uint8)
    assert tensor.is_pinned()


def test_disk_writes_around_a_temporary_file_a_dead_process_left(tmp_path: Path) -> None:
    """A put goes through this thread's temporary name for the key; a file already there under
    that name (a dead process that had this one's id left it) is neither written into nor a
    reason to fail: the put takes another name."""
    store = DiskStore(tmp_path, NS, 1 << 20)
    path = store._path(NS.key(7))
    directory, name = os.path.split(path)
    os.makedirs(directory)
    stale = os.path.join(directory, store._tmp_tag() + name)
    with open(stale, "wb") as f:
        f.write(b"half a value")
    assert store.put(7, b"new value") and bytes(store.get(7)) == b"new value"
    with open(stale, "rb") as f:
        assert f.read() == b"half a value"
    assert store.put(7, b"newer value") and bytes(store.get(7)) == b"newer value"
    assert sorted(p.name for p in Path(path).parent.iterdir()) == sorted(
        [os.path.basename(path), os.path.basename(stale)]
    )


def test_disk_keys_that_look_like_temporary_files_are_values(tmp_path: Path) -> None:
    """Keys are free strings: one that starts with a dot, or with the temporary files' prefix,
    is stored and found again after a restart like any other."""
    store = DiskStore(tmp_path, NS, 1 << 20)
    keys = [".tmp-1-2-x", ".hidden", "plain"]
    assert store.put_many(keys, [b"a", b"b", b"c"]) == [True] * 3
    reopened = DiskStore(tmp_path, NS, 1 << 20)
    assert sorted(reopened.keys()) == sorted(keys)
    assert [bytes(reopened.get(k)) for k in keys] == [b"a", b"b", b"c"]


def test_disk_cleans_up_after_a_crash_half_way(tmp_path: Path) -> None:
    """A temporary file left by a writer that died is not a value and is removed on open."""
    store = DiskStore(tmp_path, NS, 1 << 20)
    store.put(1, b"value")
    leftover = next(p for p in tmp_path.rglob("*") if p.is_file()).parent / ".tmp-999-1-0"
    leftover.write_bytes(b"half a value")
    reopened = DiskStore(tmp_path, NS, 1 << 20)
    assert not leftover.exists() and list(reopened.keys()) == [f"{1:016x}"]
    assert os.path.getsize(next(p for p in tmp_path.rglob("*") if p.is_file())) == (
        reopened.used_bytes
    )
