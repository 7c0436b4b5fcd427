"""Storage tiers: one :class:`KVStore` interface over host memory, a disk directory and a
Redis server, with content-addressed, namespaced keys and checksummed values; and the lookup
buffer a prefill process hands KV to a decode process through.

``redis-py`` is imported only when a :class:`RedisStore` is made (``pip install 'kvtier[redis]'``).
"""

from .._core import StoreStats
from .base import KVStore, StoreClosedError
from .buffer import KVStoreBuffer, LookupBuffer
from .disk import DiskStore
from .format import FORMAT_VERSION, Namespace
from .host import HostStore
from .remote import RedisStore

__all__ = [
    "FORMAT_VERSION",
    "DiskStore",
    "HostStore",
    "KVStore",
    "KVStoreBuffer",
    "LookupBuffer",
    "Namespace",
    "RedisStore",
    "StoreClosedError",
    "StoreStats",
]
