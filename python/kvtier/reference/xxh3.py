"""The prefix hash chain in plain Python: XXH3-64 and the seeds and chained block hashes the core
builds on it, without the extension.

The core hashes a block as xxh3_64(token ids as little-endian u32, seed = parent hash). XXH3 is
specified bit for bit (github.com/Cyan4973/xxHash, doc/xxhash_spec.md); :func:`xxh3_64` is a
direct transcription of its 64-bit variant, all length classes, so the reference model chains
hashes exactly as the core does without any dependency (and the tests pin that the core's
hashes are the published XXH3).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError

__all__ = [
    "chain_hash",
    "chain_seed",
    "namespace_seed",
    "prefix_hashes",
    "salted_seed",
    "xxh3_64",
]


_M64 = (1 << 64) - 1
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def _r64(b: bytes, o: int) -> int:
    return int.from_bytes(b[o : o + 8], "little")


def _r32(b: bytes, o: int) -> int:
    return int.from_bytes(b[o : o + 4], "little")


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p & _M64) ^ (p >> 64)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * _P64_2) & _M64
    h ^= h >> 29
    h = (h * _P64_3) & _M64
    return h ^ (h >> 32)


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _M64
    return h ^ (h >> 32)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _rrmxmx(h: int, n: int) -> int:
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h = (h * 0x9FB21C651E98DF25) & _M64
    h ^= ((h >> 35) + n) & _M64
    h = (h * 0x9FB21C651E98DF25) & _M64
    return h ^ (h >> 28)


def _mix16(d: bytes, o: int, s: bytes, so: int, seed: int) -> int:
    lo = _r64(d, o) ^ ((_r64(s, so) + seed) & _M64)
    hi = _r64(d, o + 8) ^ ((_r64(s, so + 8) - seed) & _M64)
    return _fold(lo, hi)


def _swap(x: int, width: int) -> int:
    return int.from_bytes(x.to_bytes(width, "little"), "big")


def xxh3_64(data: bytes, seed: int = 0) -> int:
    """XXH3-64 of ``data`` with a 64-bit ``seed``, in plain Python."""
    n, s = len(data), _SECRET
    if n == 0:
        return _xxh64_avalanche(seed ^ _r64(s, 56) ^ _r64(s, 64))
    if n <= 3:
        combo = (data[0] << 16) | (data[n >> 1] << 24) | data[n - 1] | (n << 8)
        return _xxh64_avalanche(combo ^ (((_r32(s, 0) ^ _r32(s, 4)) + seed) & _M64))
    if n <= 8:
        seed ^= _swap(seed & 0xFFFFFFFF, 4) << 32
        x = (_r32(data, n - 4) + (_r32(data, 0) << 32)) & _M64
        return _rrmxmx(x ^ (((_r64(s, 8) ^ _r64(s, 16)) - seed) & _M64), n)
    if n <= 16:
        lo = _r64(data, 0) ^ (((_r64(s, 24) ^ _r64(s, 32)) + seed) & _M64)
        hi = _r64(data, n - 8) ^ (((_r64(s, 40) ^ _r64(s, 48)) - seed) & _M64)
        return _avalanche((n + _swap(lo, 8) + hi + _fold(lo, hi)) & _M64)
    if n <= 128:
        acc = n * _P64_1
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(data, 48, s, 96, seed) + _mix16(data, n - 64, s, 112, seed)
                acc += _mix16(data, 32, s, 64, seed) + _mix16(data, n - 48, s, 80, seed)
            acc += _mix16(data, 16, s, 32, seed) + _mix16(data, n - 32, s, 48, seed)
        acc += _mix16(data, 0, s, 0, seed) + _mix16(data, n - 16, s, 16, seed)
        return _avalanche(acc & _M64)
    if n <= 240:
        acc = n * _P64_1
        for i in range(8):
            acc += _mix16(data, 16 * i, s, 16 * i, seed)
        acc = _avalanche(acc & _M64)
        for i in range(8, n // 16):
            acc += _mix16(data, 16 * i, s, 16 * (i - 8) + 3, seed)
        acc += _mix16(data, n - 16, s, 136 - 17, seed)
        return _avalanche(acc & _M64)
    return _xxh3_long(data, seed)


def _xxh3_long(data: bytes, seed: int) -> int:
    s = _SECRET
    if seed:
        s = b"".join(
            ((_r64(_SECRET, 16 * i) + seed) & _M64).to_bytes(8, "little")
            + ((_r64(_SECRET, 16 * i + 8) - seed) & _M64).to_bytes(8, "little")
            for i in range(len(_SECRET) // 16)
        )
    n = len(data)
    acc = [_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1]

    def stripe(o: int, so: int) -> None:
        for i in range(8):
            v = _r64(data, o + 8 * i)
            k = v ^ _r64(s, so + 8 * i)
            acc[i ^ 1] = (acc[i ^ 1] + v) & _M64
            acc[i] = (acc[i] + (k & 0xFFFFFFFF) * (k >> 32)) & _M64

    stripes = (len(s) - 64) // 8
    block_len = 64 * stripes
    blocks = (n - 1) // block_len
    for b in range(blocks):
        for j in range(stripes):
            stripe(b * block_len + 64 * j, 8 * j)
        for i in range(8):
            a = acc[i] ^ (acc[i] >> 47) ^ _r64(s, len(s) - 64 + 8 * i)
            acc[i] = (a * _P32_1) & _M64
    for j in range(((n - 1) - block_len * blocks) // 64):
        stripe(blocks * block_len + 64 * j, 8 * j)
    stripe(n - 64, len(s) - 64 - 7)
    res = n * _P64_1
    for i in range(4):
        res += _fold(acc[2 * i] ^ _r64(s, 11 + 16 * i), acc[2 * i + 1] ^ _r64(s, 19 + 16 * i))
    return _avalanche(res & _M64)


def namespace_seed(namespace: str) -> int:
    """Seed of a namespace's hash chain (``kvtier.namespace_seed`` in plain Python)."""
    return xxh3_64(namespace.encode())


def salted_seed(seed: int, salt: str) -> int:
    """Seed of the hash chain of a sequence salted with ``salt`` in the namespace of ``seed``
    (``kvtier::salted_seed``): XXH3 of the salt's UTF-8 bytes and one or two 0xFF bytes (so
    that the length is never a multiple of 4, as a block's always is), seeded with ``seed``."""
    data = salt.encode() + b"\xff"
    if len(data) % 4 == 0:
        data += b"\xff"
    return xxh3_64(data, seed)


def chain_seed(seed: int, salt: str | None) -> int:
    """The namespace seed ``seed`` without a salt, its :func:`salted_seed` with one; a salt
    that is not a non-empty ``str`` is an :class:`InvalidArgumentError`, as in the core."""
    if salt is None:
        return seed
    if not isinstance(salt, str):
        raise InvalidArgumentError(
            f"invalid salt: expected a non-empty str, or None for no salt; got {type(salt).__name__}"
        )
    if not salt:
        raise InvalidArgumentError(
            "invalid salt: expected a non-empty str, or None for no salt; got an empty one"
        )
    return salted_seed(seed, salt)


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one block of token ids given its parent's hash."""
    return xxh3_64(struct.pack(f"<{len(tokens)}I", *tokens), parent)


def prefix_hashes(
    tokens: Sequence[int], block_size: int, namespace: str = "default", salt: str | None = None
) -> list[int]:
    """Chained hashes of every full block of ``tokens`` (``kvtier.prefix_hashes`` in Python),
    of a sequence salted with ``salt`` if given."""
    parent, out = chain_seed(namespace_seed(namespace), salt), []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[i : i + block_size])
        out.append(parent)
    return out
