"""The prefill->decode lookup buffer and the named-tensor buffer, over real stores: host memory,
a real directory, a real redis-server on loopback. Races are real threads and real processes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvtier.errors import InvalidArgumentError, PayloadError  # noqa: E402
from kvtier.stores import (  # noqa: E402
    DiskStore,
    HostStore,
    KVStore,
    KVStoreBuffer,
    LookupBuffer,
    Namespace,
)
from kvtier.stores import buffer as buf  # noqa: E402

NS = Namespace("lookup-buffer-tests", tenant="t1")
GEN = torch.Generator().manual_seed(7)


def randn(*shape: int, dtype: Any = torch.float32) -> Any:
    return torch.randn(*shape, generator=GEN).to(dtype)


def kv(tokens: int, dtype: Any = torch.float32) -> tuple[Any, Any, Any]:
    """Key and value shaped [layers, kv_heads, tokens, head_dim], and a hidden state."""
    return randn(4, 3, tokens, 16, dtype=dtype), randn(4, 3, tokens, 16, dtype=dtype), randn(64)


@pytest.fixture
def store(open_store: Any) -> KVStore:
    return open_store(NS)


@pytest.fixture
def buffer(store: KVStore) -> Iterator[LookupBuffer]:
    b = LookupBuffer(store)
    for key in list(b.store.keys()):  # a Redis server lives for the whole session
        b.store.delete(key)
    yield b
    b.close()


def same(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bits (NaN-safe, and exact for every dtype)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


# -- LookupBuffer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_keeps_every_bit(buffer: LookupBuffer, dtype: Any) -> None:
    tokens = torch.arange(100, 120)
    key, value, hidden = kv(20, dtype)
    assert buffer.insert(tokens, None, key, value, hidden.to(dtype)) is True
    got = buffer.drop_select(tokens, None)
    assert isinstance(got, list) and len(got) == 3
    assert same(got[0], key) and same(got[1], value) and same(got[2], hidden.to(dtype))
    assert all(t.device.type == "cpu" for t in got)
    got[0][0] = 0  # the caller owns what it got: writable, not a view of the store's bytes


def test_drop_select_removes_the_entry(buffer: LookupBuffer) -> None:
    tokens = torch.tensor([5, 6, 7])
    buffer.insert(tokens, None, *kv(3))
    assert buffer.drop_select(tokens, None)[0] is not None
    assert buffer.drop_select(tokens, None) == [None, None, None]
    assert list(buffer.store.keys()) == []


def test_roi_selects_the_tokens_an_entry_is_keyed_by(buffer: LookupBuffer) -> None:
    tokens = torch.arange(10)
    roi = torch.zeros(10, dtype=torch.bool)
    roi[3:7] = True
    key, value, hidden = kv(4)
    buffer.insert(tokens, roi, key, value, hidden)
    # Other selections of the same tokens miss, and a miss leaves the entry in place.
    assert buffer.drop_select(tokens, None) == [None, None, None]
    assert buffer.drop_select(tokens, roi.roll(1)) == [None, None, None]
    # The same selected tokens hit, however they are given: the key is those tokens alone.
    other = torch.tensor([99, 3, 4, 5, 6, 98])
    other_roi = torch.tensor([False, True, True, True, True, False])
    got = buffer.drop_select(other, other_roi)
    assert same(got[0], key) and same(got[1], value) and same(got[2], hidden)
    buffer.insert(tokens, roi, key, value, hidden)
    got = buffer.drop_select(torch.tensor([3, 4, 5, 6], dtype=torch.int32), None)
    assert same(got[0], key)


def test_mismatched_tokens_are_misses(buffer: LookupBuffer) -> None:
    tokens = torch.arange(1000, 1016)
    buffer.insert(tokens, None, *kv(16))
    for other in (
        tokens[:-1],  # a prefix (vLLM's SimpleBuffer matched prefixes; a store matches exactly)
        torch.cat([tokens, torch.tensor([1])]),
        tokens.flip(0),
        tokens + 1,
        tokens + (1 << 32),  # same low 32 bits: ids are hashed as int64
    ):
        assert buffer.drop_select(other, None) == [None, None, None]
    assert buffer.drop_select(tokens, None)[0] is not None


def test_token_dtype_does_not_matter(buffer: LookupBuffer) -> None:
    key, value, hidden = kv(5)
    buffer.insert(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int16), None, key, value, hidden)
    got = buffer.drop_select(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8), None)
    assert same(got[0], key)


def test_none_none_takes_any_entry_one_at_a_time(buffer: LookupBuffer) -> None:
    for i in range(5):
        buffer.insert(torch.arange(i, i + 8), None, *kv(8)[:2], torch.tensor([float(i)]))
    taken = []
    for left in range(4, -1, -1):
        key, value, hidden = buffer.drop_select(None, None)
        assert key is not None and value is not None and hidden is not None
        taken.append(int(hidden.item()))
        assert len(list(buffer.store.keys())) == left
    assert sorted(taken) == list(range(5))
    assert buffer.drop_select(None, None) == [None, None, None]


def test_none_none_leaves_other_values_of_the_store_alone(buffer: LookupBuffer) -> None:
    # Entries live in their own namespace: blocks under the store's namespace, and tensors of a
    # KVStoreBuffer on the same backend, are never taken.
    store = buffer.store.with_namespace(NS)
    store.put(42, b"a KV block")
    KVStoreBuffer(store).put("named", torch.ones(3))
    assert buffer.drop_select(None, None) == [None, None, None]
    assert bytes(store.get(42)) == b"a KV block"
    assert same(KVStoreBuffer(store).get("named"), torch.ones(3))
    KVStoreBuffer(store).put("named", None)
    store.delete(42)


def test_inserting_the_same_tokens_again_replaces_the_entry(buffer: LookupBuffer) -> None:
    tokens = torch.arange(6)
    buffer.insert(tokens, None, *kv(6))
    key, value, hidden = kv(6)
    buffer.insert(tokens, None, key, value, hidden)
    got = buffer.drop_select(tokens, None)
    assert same(got[0], key) and buffer.drop_select(None, None) == [None, None, None]


def test_a_digest_collision_is_a_miss_and_the_entry_stays(buffer: LookupBuffer) -> None:
    mine, theirs = torch.arange(8), torch.arange(8) * 3
    key, value, hidden = kv(8)
    # What a collision looks like: an entry under our tokens' key that holds other tokens.
    name = buf._entry_key(mine)
    buffer.store.put(name, buf.pack_tensors([theirs, key, value, hidden]))
    assert buffer.drop_select(mine, None) == [None, None, None]
    stored = buf.unpack_tensors(buffer.store.get(name))
    assert stored[0] is not None and torch.equal(stored[0], theirs)  # put back for its owner


def test_a_malformed_entry_is_a_miss(buffer: LookupBuffer, caplog: Any) -> None:
    tokens = torch.arange(3)
    name = buf._entry_key(tokens)
    for bad in (b"not a container", buf.pack_tensors([tokens, torch.ones(1)])):
        buffer.store.put(name, bad)
        assert buffer.drop_select(tokens, None) == [None, None, None]
    buffer.store.put(name, b"garbage again")
    assert buffer.drop_select(None, None) == [None, None, None]
    assert "is not served" in caplog.text and "not a lookup-buffer entry" in caplog.text


def test_a_refused_insert_returns_false() -> None:
    tiny = LookupBuffer(HostStore(NS, 1000))
    tokens = torch.arange(4)
    assert tiny.insert(tokens, None, *kv(4)) is False
    assert tiny.drop_select(tokens, None) == [None, None, None]


@pytest.mark.gpu
def test_tensors_on_cuda_come_back_on_the_buffer_device(store: KVStore) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpu = LookupBuffer(store, device="cuda")
    key, value, hidden = (t.cuda() for t in kv(4, torch.bfloat16))
    tokens = torch.arange(4, device="cuda")
    assert gpu.insert(tokens, None, key, value, hidden)
    got = gpu.drop_select(tokens, torch.ones(4, dtype=torch.bool, device="cuda"))
    assert all(t is not None and t.is_cuda for t in got)
    assert same(got[0].cpu(), key.cpu()) and same(got[2].cpu(), hidden.cpu())


# -- races: exactly one consumer gets an entry ----------------------------------------------------


def test_threads_racing_for_one_entry(buffer: LookupBuffer) -> None:
    threads = 6
    barrier = threading.Barrier(threads)
    tokens = torch.arange(32)

    def race(results: list[Any], select_any: bool) -> None:
        barrier.wait()
        got = buffer.drop_select(None, None) if select_any else buffer.drop_select(tokens, None)
        results.append(got[0] is not None)

    for round_ in range(10):
        buffer.insert(tokens, None, *kv(32))
        results: list[Any] = []
        pool = [
            threading.Thread(target=race, args=(results, round_ % 2 == 1)) for _ in range(threads)
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert sorted(results) == [False] * (threads - 1) + [True]


def test_threads_draining_a_buffer_take_each_entry_once(buffer: LookupBuffer) -> None:
    entries, threads = 40, 4
    for i in range(entries):
        buffer.insert(torch.tensor([i, i + 1]), None, *kv(2)[:2], torch.tensor([i]))
    barrier = threading.Barrier(threads)
    taken: list[int] = []

    def drain() -> None:
        barrier.wait()
        while (hidden := buffer.drop_select(None, None)[2]) is not None:
            taken.append(int(hidden.item()))

    pool = [threading.Thread(target=drain) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert sorted(taken) == list(range(entries))


CONSUMER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from kvtier.stores import DiskStore, LookupBuffer, Namespace
    root, go = sys.argv[1], sys.argv[2]
    buffer = LookupBuffer(DiskStore(root, Namespace("lookup-buffer-tests", tenant="t1"), 1 << 30))
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    first = buffer.drop_select(torch.arange(100, 108), None)[2]
    taken = []
    while (hidden := buffer.drop_select(None, None)[2]) is not None:
        taken.append(int(hidden.item()))
    print(json.dumps({"first": None if first is None else int(first.item()), "taken": taken}))
    """
)


def test_processes_racing_on_a_directory_take_each_entry_once(tmp_path: Path) -> None:
    root, go = tmp_path / "kv", tmp_path / "go"
    producer = LookupBuffer(DiskStore(root, NS, 1 << 30))
    entries = 30
    for i in range(entries):
        producer.insert(torch.arange(100 + i, 108 + i), None, *kv(8)[:2], torch.tensor([i]))
    consumers = [
        subprocess.Popen(
            [sys.executable, "-c", CONSUMER, str(root), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for c in consumers:  # every one has imported torch and opened the store
        assert c.stdout is not None and c.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for c in consumers:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
        results.append(json.loads(out))
    # At most one got entry 0 by its tokens (a late one may find another's None, None took it),
    # and every entry went to exactly one consumer.
    firsts = [r["first"] for r in results]
    assert firsts.count(0) <= 1 and firsts.count(None) >= len(consumers) - 1
    taken = [i for r in results for i in r["taken"]] + [f for f in firsts if f is not None]
    assert sorted(taken) == list(range(entries))
    assert list(producer.store.keys()) == []


# -- bad input -------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors(buffer: LookupBuffer) -> None:
    tokens = torch.arange(4)
    key, value, hidden = kv(4)
    bad: list[tuple[Any, str]] = [
        (
            lambda: buffer.insert([1, 2, 3], None, key, value, hidden),
            "1-D integer tensor, got list",
        ),
        (lambda: buffer.insert(tokens[None], None, key, value, hidden), "got a 2-D"),
        (lambda: buffer.insert(tokens.float(), None, key, value, hidden), "torch.float32"),
        (lambda: buffer.insert(tokens[:0], None, key, value, hidden), "at least one token"),
        (lambda: buffer.insert(tokens, tokens, key, value, hidden), "boolean tensor of shape"),
        (lambda: buffer.insert(tokens, tokens > 9, key, value, hidden), "selects no tokens"),
        (lambda: buffer.insert(tokens, tokens[:3] > 0, key, value, hidden), "of shape \\[4\\]"),
        (lambda: buffer.insert(tokens, [True] * 4, key, value, hidden), "got list"),
        (lambda: buffer.insert(tokens, None, key.numpy(), value, hidden), "key: expected a torch"),
        (lambda: buffer.insert(tokens, None, key, None, hidden), "value: expected a torch"),
        (lambda: buffer.insert(tokens, None, key, value, 1.0), "hidden: expected a torch"),
        (lambda: buffer.drop_select(None, tokens > 0), "without input_tokens"),
        (lambda: buffer.drop_select(tokens, tokens), "boolean tensor"),
        (lambda: LookupBuffer("redis://x"), "store: expected a kvtier.stores.KVStore"),
        (lambda: LookupBuffer(buffer.store, device="no-such-device"), "device"),
    ]
    sparse = key.to_sparse()
    bad.append((lambda: buffer.insert(tokens, None, sparse, value, hidden), "dense tensor"))
    for call, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            call()
    assert list(buffer.store.keys()) == []


# -- KVStoreBuffer ---------------------------------------------------------------------------------


def test_kvstore_buffer_put_get_and_none_deletes(store: KVStore) -> None:
    named = KVStoreBuffer(store)
    for key in list(named.store.keys()):
        named.store.delete(key)
    assert named.get("layer-0/k") is None
    values = {
        "layer-0/k": randn(3, 5, dtype=torch.bfloat16),
        "layer-0/v": randn(3, 5, dtype=torch.float16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(10, dtype=torch.int64) - 5,
    }
    for key, value in values.items():
        assert named.put(key, value) is True
    for key, value in values.items():
        assert same(named.get(key), value)
    assert named.put("layer-0/k", torch.zeros(2)) and same(named.get("layer-0/k"), torch.zeros(2))
    assert named.put("layer-0/k", None) is True and named.get("layer-0/k") is None
    assert named.put("never-there", None) is True and named.get("never-there") is None
    assert same(named.get("layer-0/v"), values["layer-0/v"])  # the others stay


def test_kvstore_buffer_bad_input(store: KVStore) -> None:
    named = KVStoreBuffer(store)
    for call, message in [
        (lambda: named.put(1, torch.ones(1)), "key: expected a str, got int"),
        (lambda: named.get(b"bytes"), "key: expected a str, got bytes"),
        (lambda: named.put("has space", torch.ones(1)), "printable ASCII"),
        (lambda: named.put("k", [1.0]), "value: expected a torch.Tensor, got list"),
        (lambda: KVStoreBuffer(object()), "store"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            call()


# -- the tensor container ------------------------------------------------------------------------


BYTE_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
]


def test_container_round_trips_every_dtype_and_shape() -> None:
    raw = torch.randint(0, 256, (2, 3, 5), dtype=torch.uint8, generator=GEN)
    tensors: list[Any] = []
    for dtype in BYTE_DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        data = raw & 1 if dtype == torch.bool else raw  # a bool byte is 0 or 1
        tensors.append(data.repeat(1, 1, size).view(dtype))  # [2, 3, 5] of random bits
    tensors += [
        None,
        torch.tensor(3.0),  # 0-d
        torch.empty(2, 0, 3),  # no elements
        randn(6, 4).t(),  # not contiguous
        torch.complex(randn(3), randn(3)).conj(),  # a lazy conjugate
        randn(4).requires_grad_(),
    ]
    back = buf.unpack_tensors(buf.pack_tensors(tensors))
    assert len(back) == len(tensors)
    for t, b in zip(tensors, back, strict=True):
        if t is None:
            assert b is None
        else:
            assert b is not None and same(b, t.detach().resolve_conj().contiguous())
            assert b.is_contiguous() and not b.requires_grad


def test_container_layout_is_the_documented_one() -> None:
    t = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    expected = (
        b"KVTT"
        + struct.pack("<BB", buf.CONTAINER_VERSION, 2)
        + b"\x00"  # None
        + b"\x01"
        + struct.pack("<B", 8)
        + b"bfloat16"
        + struct.pack("<BQQ", 2, 1, 2)
        + t.view(torch.int16).numpy().astype("<i2").tobytes()
    )
    assert buf.pack_tensors([None, t]) == expected


def test_malformed_containers_raise_payload_errors() -> None:
    good = buf.pack_tensors([torch.arange(6, dtype=torch.int32).reshape(2, 3), None])
    for cut in range(len(good)):
        with pytest.raises(PayloadError):
            buf.unpack_tensors(good[:cut])
    for bad, message in [
        (b"XXXX" + good[4:], "magic"),
        (good[:4] + b"\x09" + good[5:], "container version 9"),
        (good + b"\x00", "1 bytes after the last tensor"),
        (good.replace(b"int32", b"int99"), "unknown dtype 'int99'"),
        (good.replace(b"int32", b"dtype"), "unknown dtype"),  # an attribute, not a dtype
        (good[:6] + b"\x07" + good[7:], "present flag 7"),
    ]:
        with pytest.raises(PayloadError, match=message):
            buf.unpack_tensors(bad)


def test_container_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(InvalidArgumentError, match="at most 255"):
        buf.pack_tensors([None] * 256)
    with pytest.raises(InvalidArgumentError, match="dense tensor"):
        buf.pack_tensors([torch.eye(3).to_sparse()])
    with pytest.raises(InvalidArgumentError, match=r"expected a torch\.Tensor or None, got str"):
        buf.pack_tensors(["text"])


def test_a_large_entry_is_fast_enough(buffer: LookupBuffer) -> None:
    # SmolLM2's K and V for 512 tokens in fp32 (24 MB): the buffer copies bytes, it never
    # loops over elements in Python.
    tokens = torch.arange(512)
    key = randn(30, 3, 512, 64)
    start = time.perf_counter()
    assert buffer.insert(tokens, None, key, key, randn(576))
    got = buffer.drop_select(tokens, None)
    assert same(got[0], key) and time.perf_counter() - start < 10
