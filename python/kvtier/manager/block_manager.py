"""``BlockManager``: the facade a custom engine calls (see :mod:`kvtier.manager` for the model).

It owns the sequences (tokens written per layer, the block being filled), the two locks and the
order of work under them; everything else is a part it composes and passes what it needs:
:class:`~kvtier.manager.tiers.Tiers` (pools, stores, byte moves),
:class:`~kvtier.manager.ledger.BlockLedger` (per-block bookkeeping),
:class:`~kvtier.manager.attention.AttentionTables`,
:class:`~kvtier.manager.sharing.PrefixSharing`, and the functions of ``sizing``, ``room``,
``stats`` and ``checks``. None of them imports this module.

Thread safety: one lock (``_lock``) guards the core and the parts' bookkeeping; :meth:`step`
takes the step lock (``_step_lock``, always before ``_lock``, never while holding it) and copies
bytes outside ``_lock`` (a plan's sources stay valid and its destinations reserved until commit,
and appends only write pinned blocks, which plans never move), so appends and gathers proceed
meanwhile. Prefix sharing talks to its server outside ``_lock`` too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .._core import Plan, write_token
from .._torch import as_tensor, dtype_name, torch_dtype, torch_module
from ..attend import FLOAT_CODES, run_attention
from ..codecs import BlockShape, Codec, get_codec
from ..config import KvtierConfig, normalize_dtype
from ..errors import ConfigError, InvalidArgumentError, InvalidSequenceError, OutOfCapacityError
from .attention import AttentionTables, per_block
from .checks import (
    block_key_norms_of,
    check_blocks,
    check_kv,
    check_layer,
    check_query,
    hash_array,
    key_norms,
    refusal,
    sequence_ids,
    softmax_scale,
    token_array,
)
from .external import ExternalBlocks, check_external
from .ledger import BlockLedger
from .room import fits_in_tiers, slots_after, why_full
from .sharing import PrefixSharing
from .sizing import make_core, size_pools
from .stats import ManagerStats, collect
from .tiers import BlocksLost, StoreRefused, Tiers, row_addresses
from .timing import DecayedRate

if TYPE_CHECKING:
    import torch

    from ..stores import KVStore

log = logging.getLogger("kvtier.manager")

_T = TypeVar("_T")

#: Plans a write's room may take (a cascade: the slots one plan frees, the next one fills):
#: enough for every tier and level of a ladder.
_ROOM_ROUNDS = 8

__all__ = ["BlockManager"]


@dataclass
class _BlockRun:
    """Whole fresh blocks (tokens ``start`` to ``end``) that one layer's call of
    :meth:`BlockManager.append_blocks` wrote into level-0 CPU slots: the other layers' calls
    find the slots here. They hold while some layer has not written the blocks, which keeps
    them pinned (unmoved). The layers written through the run tell the ledger their key norms
    together, once the last of them is written (or before any other write to the sequence)."""

    start: int
    end: int
    blocks: np.ndarray
    #: per block, its level-0 CPU slot's address at layer 0, and a layer's bytes there
    addresses: np.ndarray
    layer_bytes: int
    #: layers none of the blocks is written at yet
    left: int
    #: per token of the blocks, the sum of its key norms over the layers written through the
    #: run and not yet told (:meth:`BlockManager._settle_run`), and how many layers those are
    norms: np.ndarray
    layers: int = 0


@dataclass
class _Seq:
    #: tokens written per layer
    lengths: np.ndarray
    #: the block being filled, where one-token appends write: ``(index in the sequence, block
    #: id, level-0 device slot)``; it is pinned, so it stays there until complete
    tail: tuple[int, int, int] | None = None
    #: the whole blocks the last external append wrote fresh (its other layers' path)
    run: _BlockRun | None = None


class BlockManager:
    """Tiered KV storage for one model: append K/V, gather it for attention, ``step()`` to let
    the scheduler move blocks between levels and tiers.

    ``config`` defaults to :meth:`KvtierConfig.from_env`. ``dtype`` is the model's K/V dtype
    (``torch.float16``, ``"bf16"`` ...); ``device`` where the device tier lives (default: CUDA
    when available, else the CPU). K/V cross as ``[num_tokens, num_kv_heads, head_dim]`` tensors
    (any DLPack producer) in that dtype and on that device.

    Public attributes, read-only: ``config``, ``shape`` (a :class:`BlockShape`), ``dtype``,
    ``device``, ``ladder`` (the codec name of each level), ``drop_level`` (the index of a
    ``drop`` level, or None), ``codecs``, ``level_bytes`` (one block's bytes per level),
    ``slots`` (per ``(tier, level)``), ``core`` (the Rust :class:`~kvtier._core.Core` that
    decides where blocks live), ``instance`` (this manager's id in its store tiers), and:

    - ``pools``: the tensor pools by ``(tier, level)``: ``pools["device", 0]`` is the level-0
      pool ``[slots, layers, 2, kv_heads, block_size, head_dim]`` in the model dtype, where new
      K/V is written (its slot of a block: ``core.block_info(blocks)["slot"]``); others are
      ``uint8 [slots, bytes_per_block]`` of their codec. Allocated once, never replaced.
    - ``stores``: the store pools (``disk``, ``remote``) by ``(tier, level)``.
    - ``attention_tables``: the :class:`~kvtier.manager.attention.AttentionTables` that
      :meth:`attend` reads, for code that runs the attention kernels itself.
    - ``ledger``: the :class:`~kvtier.manager.ledger.BlockLedger`, per block what was written,
      pins, lost blocks and :meth:`~kvtier.manager.ledger.BlockLedger.magnitude`, the key-norm
      signal the scheduler ranks by (for inspection).
    """

    def __init__(
        self,
        config: KvtierConfig | None,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "fp16",
        device: Any = None,
    ) -> None:
        torch = torch_module()
        self.config = config = KvtierConfig.from_env() if config is None else config
        if not isinstance(config, KvtierConfig):
            raise ConfigError(f"config: expected a KvtierConfig, got {type(config).__name__}")
        dtype_str = dtype_name(dtype) if isinstance(dtype, torch.dtype) else normalize_dtype(dtype)
        self.shape = BlockShape(num_layers, num_kv_heads, config.block_size, head_dim, dtype_str)
        self.dtype = torch_dtype(dtype_str)
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ladder = config.resolved_ladder(dtype_str)
        if self.ladder[0] != dtype_str:
            raise ConfigError(
                f"ladder: level 0 is {self.ladder[0]!r} but the model dtype is {dtype_str!r}: "
                "level 0 holds K/V exactly as the model wrote it"
            )
        # A `drop` level (last, checked by the config) holds no bytes: its blocks have left
        # attention. It has no codec, pool nor store; gather and attend skip its blocks.
        kept = self.ladder[:-1] if self.ladder[-1] == "drop" else self.ladder
        self.drop_level = len(kept) if len(kept) < len(self.ladder) else None
        self.codecs: list[Codec] = [get_codec(name) for name in kept]
        self.level_bytes = [c.bytes_per_block(self.shape) for c in self.codecs]
        self.level_bytes += [0] * (len(self.ladder) - len(kept))
        # The largest |value| appends accept: what every level holds (the quantized levels'
        # fp16 scales bound bf16/fp32 K/V); infinite when that is the dtype's whole range.
        limit = min(c.max_magnitude(dtype_str) for c in self.codecs)
        self._limit = limit if limit < torch.finfo(self.dtype).max else math.inf
        self._layout = layout = size_pools(config, self.device, self.level_bytes, len(self.codecs))
        self.slots = layout.slots
        self.core = make_core(config, layout)
        self._tiers = Tiers(
            self.core, layout, config, self.shape, self.dtype, self.device, self.codecs,
            self.ladder,
        )  # fmt: skip
        self.instance = self._tiers.instance
        self.pools: dict[tuple[str, int], Any] = self._tiers.pools
        self.stores: dict[tuple[str, int], KVStore] = self._tiers.stores
        self.ledger = BlockLedger(self.core, num_layers, config.block_size)
        self.attention_tables = AttentionTables(
            self.core, self.ledger, self._tiers, self.shape, self.codecs, len(self.ladder),
            self.drop_level,
        )  # fmt: skip
        # Prefix sharing: the remote tier's level-0 namespace, keyed by prefix hash.
        self._sharing = PrefixSharing(
            self.core,
            self.ledger,
            self._tiers,
            self.stores["remote", 0] if config.share_prefixes else None,
            config.namespace,
        )
        self._seqs: dict[int, _Seq] = {}
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        # Sequences that free_later() handed over, freed between calls.
        self._orphans: list[int] = []
        # One-token appends on the CPU are written by the extension (_core.write_token) at the
        # address of the level-0 pool (0: not on the CPU).
        pool0 = self.pools["device", 0]
        self._pool0 = pool0.data_ptr() if self.device.type == "cpu" else 0
        self._layers = num_layers
        self._token_dims = (num_layers, *self.shape.dims[2:], pool0.element_size())
        self._token_type = type(pool0)
        self._token_shape = torch.Size((1, self.shape.kv_heads, self.shape.head_dim))
        self._dtype_code = FLOAT_CODES[self.shape.dtype]
        # Encoded appends place blocks below level 0 only where a layer's bytes are its own.
        self._encodable = all(c.layer_major for c in self.codecs[1:])
        # Whether an encoded append placed blocks below level 0 yet (token appends check then)
        self._placed_below_0 = False
        # What load_blocks took per block and layer, by (tier, level) (about the last 100
        # pools' reads: a load of one pool is one per layer)
        self._load_times: dict[tuple[str, int], DecayedRate] = {}

    def close(self) -> None:
        """Deletes this manager's blocks from its disk and remote tiers and closes them. The
        tensor pools go with the object."""
        with self._step_lock, self._lock:
            self._tiers.close()

    def __enter__(self) -> BlockManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool_bytes(self) -> int:
        """Bytes allocated for all pools (what the manager costs, whatever it holds)."""
        return self._tiers.pool_bytes

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    # -- sequences ------------------------------------------------------------------------------

    def add_sequence(
        self, token_ids: Any = None, *, salt: str | None = None, block_hashes: Any = None
    ) -> int:
        """A new sequence; with ``token_ids`` (its prompt), the longest cached prefix of them is
        shared rather than stored again: :meth:`num_tokens` then says how many leading tokens
        already have their K/V, and appends start after them. With ``share_prefixes``, the
        blocks that follow are taken from the remote server where another engine published
        them (one round trip).

        ``salt`` (a non-empty ``str``: a tenant id, vLLM's ``cache_salt``) keeps the sequence's
        blocks, here and on the remote server, apart from those of sequences with another salt
        or none: it shares only with sequences of the same salt (its forks keep it). Without a
        salt, the blocks' hashes and keys are those of earlier versions.

        ``block_hashes`` instead of ``token_ids``: whole blocks named by the caller's own
        hashes (nonzero 64-bit ints, already chained: an engine's block hashes), for an engine
        that knows its blocks by hash rather than by tokens (vLLM's offloading tiers). A hash
        the cache holds shares that block, wherever it is in the sequence, as a token prefix
        would; nothing is salted (the hashes say all)."""
        if block_hashes is not None:
            if token_ids is not None or salt is not None:
                raise InvalidArgumentError(
                    "add_sequence: block_hashes name the blocks: give no token_ids or salt"
                )
            hashes = hash_array(block_hashes)
            declare = lambda seq: self.core.append_blocks(seq, hashes)  # noqa: E731
            shared = lambda: self.core.lookup(hashes)  # noqa: E731
            n = len(hashes) * self.block_size
        else:
            tokens = token_array([] if token_ids is None else token_ids)
            declare = lambda seq: self.core.append_tokens(seq, tokens)  # noqa: E731
            shared = lambda: self.core.lookup_tokens(tokens, salt)  # noqa: E731
            n = len(tokens)
        with self._lock:
            self._free_orphans()
            seq = self.core.add_sequence(salt)
            state = _Seq(np.zeros(self.shape.layers, dtype=np.int64))
            self._seqs[seq] = state
            if n:
                try:
                    self._grow(seq, lambda: declare(seq), n, shared)
                except BaseException:
                    del self._seqs[seq]
                    self.core.free_sequence(seq)
                    raise
                state.lengths[:] = self.ledger.cached_prefix(self.core.sequence_blocks(seq))
        if self._sharing.active and n:
            self._fetch_shared(seq)
        return seq

    def add_tokens(self, seq: int, token_ids: Any) -> None:
        """Declares the ids of tokens about to be appended (e.g. each generated token), so their
        blocks are hashed and can serve later prompts as a cached prefix. Without it, appended
        K/V is stored but never shared."""
        tokens = token_array(token_ids)
        with self._lock:
            self._seq(seq)
            self._grow(seq, lambda: self.core.append_tokens(seq, tokens), len(tokens))

    def num_tokens(self, seq: int, layer: int = 0) -> int:
        """Tokens whose K/V ``layer`` holds for ``seq``."""
        with self._lock:
            return int(self._seq(seq).lengths[self._layer(layer)])

    def attended_tokens(self, seq: int, layer: int = 0) -> int:
        """Tokens of ``seq`` that attention still sees at ``layer``: :meth:`num_tokens` less
        those of the blocks a ``drop`` level took out (what :meth:`gather` returns)."""
        with self._lock:
            return self._attended(seq, int(self._seq(seq).lengths[self._layer(layer)]))[1]

    def sequences(self) -> list[int]:
        with self._lock:
            self._free_orphans()
            return list(self._seqs)

    def lookup(
        self,
        token_ids: Any = None,
        *,
        salt: str | None = None,
        block_hashes: Any = None,
        local: bool = False,
    ) -> int:
        """How many leading tokens of ``token_ids`` have their K/V cached (whole blocks), for a
        sequence that :meth:`add_sequence` would add with this ``salt``; or of the blocks
        ``block_hashes`` names (:meth:`add_sequence`'s). With ``share_prefixes``, the blocks
        after those that the server holds count too (one round trip; a value is checked only
        when :meth:`add_sequence` takes it, so a damaged one can make that take fewer), unless
        ``local`` asks for this manager's own only."""
        if block_hashes is not None:
            if token_ids is not None or salt is not None:
                raise InvalidArgumentError(
                    "lookup: block_hashes name the blocks: give no token_ids or salt"
                )
            hashes = hash_array(block_hashes)
            cached = lambda: self.core.lookup(hashes)  # noqa: E731
            remote = lambda: hashes  # noqa: E731
        else:
            tokens = token_array(token_ids)
            cached = lambda: self.core.lookup_tokens(tokens, salt)  # noqa: E731
            remote = lambda: self._sharing.hashes_of(tokens, salt)  # noqa: E731
        with self._lock:
            here = self.ledger.cached_prefix(cached())
        if local or not self._sharing.active:
            return here
        bs = self.block_size
        return here + self._sharing.held(remote()[here // bs :]) * bs

    def clear_prefix_cache(self) -> int:
        """Forgets what is stored (a reset): every block leaves the prefix index, so no later
        prompt shares it. Cached blocks are freed at once (their slots, on every tier); a live
        sequence keeps its blocks until it is freed, and they are not cached then. What a shared
        remote tier holds stays there: other engines publish to it too. Returns the blocks
        forgotten."""
        with self._lock:
            blocks = self.core.indexed_blocks()
            self.core.forget(blocks)
            return len(blocks)

    def fork(self, seq: int) -> int:
        """A child sequence sharing ``seq``'s blocks (beam search, parallel sampling): full blocks
        are shared, the partial last block is copied."""
        with self._lock:
            parent = self._seq(seq)
            child, copy = self._with_room(lambda: self.core.fork(seq), 1)
            self._seqs[child] = _Seq(parent.lengths.copy())
            if copy is not None:
                src, dst = copy
                new = np.array([dst], dtype=np.uint32)
                self.ledger.track(new)
                info = self.core.block_info(np.array(copy, dtype=np.uint32))
                self._tiers.copy_level0(int(info["slot"][0]), int(info["slot"][1]))
                self.ledger.copy(src, dst)
                self.ledger.pin(new)
            return child

    def free(self, seq: int) -> None:
        """Drops a sequence. Its complete blocks stay cached for later prompts until new blocks
        need their room (``evict_on_full``, the default); blocks some layer never finished are
        forgotten, so they are never shared."""
        with self._lock:
            self._seq(seq)
            blocks = self.core.sequence_blocks(seq)
            info = self.core.block_info(blocks)
            mine = blocks[(info["refcount"] == 1) & self.ledger.pinned[blocks]]
            if len(mine):
                self.ledger.unpin(mine)
                self.core.forget(mine)
            self.core.free_sequence(seq)
            del self._seqs[seq]

    def release(self, seq: int) -> None:
        """Says that the conversation of ``seq`` has ended (a multi-turn or agentic client knows
        when): nothing will read its blocks again. Once it is freed (:meth:`free`, before or
        after this call), its cached blocks are the first to be evicted, before any block of
        a conversation still going, leaves first as always, so the rest of the chain stays
        loadable meanwhile. A block another sequence still holds stays until that one is freed
        (released then only if that one was released too), and a block read or shared again
        (a later prompt with the same prefix: the conversation went on after all) is not
        released any more. Which blocks keep precision (demotion) is unchanged. Eviction of a
        ``prefix_aware=False`` core ranks by the policy alone."""
        with self._lock:
            self._seq(seq)
            self.core.release(seq)

    def release_cached(self, token_ids: Any, *, salt: str | None = None) -> int:
        """:meth:`release` for a conversation whose sequences are freed, named by its token ids
        (and ``salt``, as :meth:`add_sequence` took them): the blocks of the longest cached
        prefix of ``token_ids`` are evicted first. Returns how many leading tokens that covers
        (whole blocks; 0 when none is cached)."""
        tokens = token_array(token_ids)
        with self._lock:
            return self.core.release_cached_tokens(tokens, salt) * self.block_size

    def free_later(self, seqs: Iterable[int]) -> None:
        """Frees ``seqs`` at the manager's next :meth:`add_sequence`, :meth:`step`,
        :meth:`stats` or :meth:`sequences` (or when appends need room). Safe where :meth:`free`
        is not: in a finalizer, which a garbage collector may run inside any call of this
        manager in the same thread."""
        self._orphans.extend(seqs)

    def _free_orphans(self) -> None:
        """Frees what :meth:`free_later` was given; called holding the lock, between calls."""
        while self._orphans:
            seq = self._orphans.pop()
            if seq in self._seqs:
                self.free(seq)

    # -- K/V ------------------------------------------------------------------------------------

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Appends K/V of new tokens, ``[num_tokens, num_kv_heads, head_dim]`` each, to one layer
        of ``seq``. The first layer to pass the sequence's end allocates its blocks; when the
        device is full, a plan demotes and offloads to make room, then cached blocks are
        evicted (``evict_on_full``), and only when the live sequences do not fit does
        :class:`OutOfCapacityError` say so. Everything is checked before anything changes:
        shape, dtype, device, finite values (NaN or inf in K or V is refused), sequence, layer
        and room; a call that raises leaves the K/V, the pools and the counters as they were,
        so a retry with good K/V stores it. K/V that require grad are stored detached."""
        if self._pool0 and self._append_one(seq, layer, k, v):
            return
        k = check_kv(k, "k", self.shape, self.dtype, self.device)
        v = check_kv(v, "v", self.shape, self.dtype, self.device)
        if k.shape != v.shape:
            raise InvalidArgumentError(
                f"expected k and v of one shape, got {list(k.shape)} and {list(v.shape)}"
            )
        layer = self._layer(layer)
        # A cache holds values: gradients do not flow into it.
        k, v = k.detach(), v.detach()
        norms = key_norms(k, v, self._limit)
        n = int(k.shape[0])
        with self._lock:
            state = self._seq(seq)
            start = int(state.lengths[layer])
            end = start + n
            if n == 0:
                return
            have = self.core.sequence_tokens(seq)
            if start < have:
                self.ledger.check_writable(seq, layer, start, min(end, have))
                self._check_whole_below_level_0(seq, layer, start, end)
            if end > have:
                self._grow(seq, lambda: self.core.extend(seq, end - have), end - have)
            self._settle_run(state)
            self._write(seq, layer, start, end, k, v, norms)
            state.lengths[layer] = end

    def append_blocks(self, seq: int, layer: int, blocks: Any, *, encode: bool = False) -> None:
        """Appends whole blocks of K/V to one layer of ``seq``, ``[num_blocks, 2, kv_heads,
        block_size, head_dim]`` (K then V: the form :meth:`gather_blocks` returns), from the
        layer's first token not yet written, which must start a block. What :meth:`append`
        does with their tokens (the same checks, room and errors; a call that raises changes
        nothing), for an engine whose own cache is paged: no token-major form on the way, one
        copy a block into the level-0 pool. Blocks of a cached prefix the sequence shares are
        skipped, as :meth:`append` skips their tokens.

        ``blocks`` may also be :class:`~kvtier.manager.ExternalBlocks` (blocks of an engine's
        paged cache, :class:`~kvtier.integrations.vllm.paged.PagedBlocks`): on the CPU the
        manager checks them where they lie and copies each once, into the pool.

        ``encode``: for blocks saved into a prefix cache (the sequence is freed once they are
        written, so no recent window keeps them at level 0), such as a connector's saves. The
        core places the blocks no layer has written yet where a cached block settles
        (:meth:`~kvtier._core.Core.place_saved`: with ``settle_cached``, the chain's ends at
        the ends' level and the others at the bottom level where it has a free slot; else the
        chain's ends at level 0 and the others at the most precise level below 0 with a free
        slot; a block no slot is left for stays at level 0) and each
        layer's blocks are encoded where ``blocks`` lie, by their level's codec (on a GPU, with
        its CUDA kernels), so only encoded bytes cross to the pools. ``blocks`` may be on any
        device. Under a ladder whose lower levels are not all layer-major codecs, the blocks
        stay at level 0."""
        if encode:
            self._append_encoded(seq, layer, blocks)
            return
        if isinstance(blocks, ExternalBlocks):
            check_external(blocks, self.shape, self.dtype)
            if self._pool0 == 0 or blocks.device.type != "cpu":  # (a CPU manager has _pool0)
                blocks = blocks.read().to(self.device)
            elif self._append_run(seq, layer, blocks):
                return
        norms = None  # external blocks: measured on their way into the pool
        if not isinstance(blocks, ExternalBlocks):
            blocks = check_blocks(blocks, self.shape, self.dtype, self.device).detach()
            norms = block_key_norms_of(blocks, self._dtype_code, self._limit)
        layer = self._layer(layer)
        n, bs = len(blocks), self.block_size
        with self._lock:
            state = self._seq(seq)
            start = self._block_start(seq, state, layer)
            if n == 0:
                return
            end = start + n * bs
            have = self.core.sequence_tokens(seq)
            if start < have:
                self.ledger.check_writable(seq, layer, start, min(end, have))
            if end > have:
                if norms is None:  # checked before the sequence grows: a refusal changes nothing
                    norms = blocks.key_norms(self._limit)
                self._grow(seq, lambda: self.core.extend(seq, end - have), end - have)
            self._settle_run(state)
            run = self._write_blocks(seq, layer, start // bs, blocks, norms)
            state.lengths[layer] = end
            if run is not None:
                state.run = run

    def _append_encoded(self, seq: int, layer: int, blocks: Any) -> None:
        """:meth:`append_blocks` with ``encode``: checked and measured where they lie, then
        under the lock the sequence's blocks for them placed (those no layer wrote) and written
        where each lies, encoded below level 0. A call that raises leaves the blocks unwritten
        (a placement stays: the blocks hold no bytes either way)."""
        if isinstance(blocks, ExternalBlocks):
            check_external(blocks, self.shape, self.dtype)
            blocks = blocks.read()  # where they lie (on a GPU, gathered there)
        blocks = as_tensor(blocks, "blocks")
        if blocks.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"blocks: expected a tensor on the CPU or a CUDA device, got one on {blocks.device}"
            )
        blocks = check_blocks(blocks, self.shape, self.dtype, blocks.device).detach()
        norms = block_key_norms_of(blocks, self._dtype_code, self._limit)  # refuses NaN, inf
        layer = self._layer(layer)
        n, bs = len(blocks), self.block_size
        with self._lock:
            state = self._seq(seq)
            start = self._block_start(seq, state, layer)
            if n == 0:
                return
            end = start + n * bs
            have = self.core.sequence_tokens(seq)
            first = start // bs
            held = self.ledger.written[self.core.sequence_blocks(seq)[first : first + n], layer]
            if ((held > 0) & (held < bs)).any():
                raise InvalidArgumentError(
                    f"sequence {seq} layer {layer}: a block of tokens {start}:{end} is partly "
                    "written: encoded appends write whole blocks"
                )
            if start < have:
                self.ledger.check_writable(seq, layer, start, min(end, have))
            if end > have:
                self._grow(seq, lambda: self.core.extend(seq, end - have), end - have)
            self._settle_run(state)
            ids = self.core.sequence_blocks(seq)[first : first + n]
            written = self.ledger.written[ids]
            todo = np.nonzero(written[:, layer] == 0)[0]
            unplaced = todo[(written[todo].max(axis=1) == 0) & self.ledger.pinned[ids[todo]]]
            if len(unplaced) and self._encodable:
                self.core.place_saved(ids[unplaced])
                self._placed_below_0 = True
                self.attention_tables.invalidate()  # blocks moved: attention tables are stale
            self._write_encoded(ids[todo], todo, layer, blocks)
            sums = norms.reshape(n, bs)[todo].sum(axis=1, dtype=np.float64)
            self._finish(self.ledger.wrote_blocks(ids[todo], layer, sums))
            state.lengths[layer] = end

    def _write_encoded(
        self, ids: np.ndarray, rows: np.ndarray, layer: int, blocks: torch.Tensor
    ) -> None:
        """Rows ``rows`` of ``blocks`` (one layer's, on any device) into blocks ``ids`` where
        each lies: a level-0 slot takes the K/V as it is, a lower level's its codec's bytes."""
        torch = torch_module()
        for (_, level), pick, slots, _ in self._tiers.locations(ids):
            which = rows if pick is None else rows[pick]
            part = (
                blocks
                if len(which) == len(blocks)
                else blocks[torch.from_numpy(which).to(blocks.device)]
            )
            if level == 0:
                index = torch.from_numpy(slots.astype(np.int64)).to(self.device)
                self._tiers.write_blocks(index, layer, part.to(self.device).contiguous())
            else:
                self._tiers.write_encoded(level, slots, layer, part)

    def _block_start(self, seq: int, state: _Seq, layer: int) -> int:
        """The token a whole-block append to ``layer`` of ``seq`` starts at, which must start a
        block."""
        start = int(state.lengths[layer])
        if start % self.block_size:
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: holds {start} tokens, not whole blocks of "
                f"{self.block_size}: append the rest of its last block with append()"
            )
        return start

    def _append_run(self, seq: int, layer: Any, blocks: ExternalBlocks) -> bool:
        """:meth:`append_blocks` of CPU external blocks at a layer after the one that
        wrote them first: straight into the slots of the sequence's :class:`_BlockRun`, checked
        and measured on the way (a refusal leaves bytes only in slots no layer-owner wrote).
        False, with nothing done, whenever the general path must run: not that run's blocks,
        or some of them written at this layer already (shared, or complete and so free to
        move)."""
        if type(layer) is not int or not 0 <= layer < self._layers:
            return False
        with self._lock:
            state = self._seqs.get(seq)
            run = None if state is None else state.run
            if (
                state is None
                or run is None
                or int(state.lengths[layer]) != run.start
                or len(blocks) != len(run.blocks)
                or self.ledger.written[run.blocks, layer].any()
            ):
                return False
            addresses = run.addresses + layer * run.layer_bytes
            norms = blocks.copy_to(addresses, measure=True, limit=self._limit)
            assert norms is not None
            self.ledger.wrote_layer(run.blocks, layer)
            np.add(run.norms, norms, out=run.norms)
            run.layers += 1
            run.left -= 1
            state.lengths[layer] = run.end
            # Settled once no layer is left to the run, and at the model's last layer whatever
            # the count says (layers written out of order, some by the general path): a block
            # complete by then is never left pinned.
            if run.left <= 0 or layer == self._layers - 1:
                self._settle_run(state)
        return True

    def _settle_run(self, state: _Seq) -> None:
        """Tells the ledger the key norms of the layers written through the sequence's
        :class:`_BlockRun` (and finishes its blocks complete by now); called before any other
        write to the sequence, so that no write completes a block whose norms are untold."""
        run = state.run
        if run is None or not run.layers:
            return
        sums = run.norms.reshape(len(run.blocks), -1).sum(axis=1)
        self._finish(self.ledger.measured(run.blocks, sums, run.layers))
        run.norms[:] = 0.0
        run.layers = 0

    def _write_blocks(
        self, seq: int, layer: int, first: int, blocks: Any, norms: np.ndarray | None
    ) -> _BlockRun | None:
        """:meth:`append_blocks`' write: ``blocks`` into the sequence's blocks from its block
        ``first`` (allocated), but for those some layer-owner already wrote (a shared
        prefix), whose tokens :meth:`_write` writes where they are partly written. ``norms``
        None: external blocks all unwritten at ``layer`` are checked and measured as they are
        copied (a refusal leaves bytes in slots nothing reads, as no layer-owner wrote them).
        Returns the :class:`_BlockRun` of external blocks written whole into level-0 CPU
        slots, all of them."""
        torch = torch_module()
        bs, n = self.block_size, len(blocks)
        ids = self.core.sequence_blocks(seq)[first : first + n]
        written = self.ledger.written[ids, layer]
        whole = written == 0
        if norms is None and not whole.all():
            norms = blocks.key_norms(self._limit)
        every = norms is None or whole.all()  # (norms None: every block is whole)
        if every or whole.any():
            fresh = ids if every else ids[whole]
            _, levels, slots = self.core.block_places(fresh)
            slots = slots.astype(np.int64)
            run = None
            if levels.any():
                # Placed below level 0 by another layer's encoded append: each block is
                # written where it lies, encoded there (never at its slot number in level 0).
                if isinstance(blocks, ExternalBlocks):
                    norms = blocks.key_norms(self._limit) if norms is None else norms
                    blocks = blocks.read()
                self._write_encoded(fresh, np.nonzero(whole)[0], layer, blocks)
            elif isinstance(blocks, ExternalBlocks):
                pick = None if every else whole
                got = self._tiers.write_external(
                    slots, layer, blocks, pick, measure=norms is None, limit=self._limit
                )
                if norms is None:
                    norms = got
                if every:
                    start, pool = first * bs, self._tiers.pools["device", 0]
                    left = int((self.ledger.written[ids] == 0).all(axis=0).sum()) - 1
                    run = _BlockRun(
                        start, start + n * bs, ids, row_addresses(pool, slots, 0),
                        pool.stride(1) * pool.element_size(), left, np.zeros(n * bs),
                    )  # fmt: skip
            else:
                part = blocks if every else blocks[torch.from_numpy(whole).to(self.device)]
                self._tiers.write_blocks(torch.from_numpy(slots).to(self.device), layer, part)
            assert norms is not None
            per_block = norms.reshape(n, bs) if every else norms.reshape(n, bs)[whole]
            sums = per_block.sum(axis=1, dtype=np.float64)
            self._finish(self.ledger.wrote_blocks(fresh, layer, sums))
            if every:
                return run
        partial = np.nonzero(~whole & (written < bs))[0]
        if len(partial) and isinstance(blocks, ExternalBlocks):
            blocks = blocks.read()
        for i in partial:
            assert norms is not None  # measured first: not every block was whole
            k, v = blocks[i].transpose(1, 2)  # [N, H, D] each
            start = (first + int(i)) * bs
            self._write(seq, layer, start, start + bs, k, v, norms[i * bs : (i + 1) * bs])
        return None

    def load_blocks(self, seq: int, layer: int, first: int, into: ExternalBlocks) -> None:
        """Writes blocks ``first : first + len(into)`` of ``seq`` at ``layer`` (whole and written,
        none dropped), decoded to the model dtype, into ``into`` (blocks of an engine's paged
        cache): what :meth:`gather_blocks` gives for them. On the CPU a level-0 block is copied
        once, from the pool into place; others are decoded, then written. Counts a read of
        each. Raises :class:`BlockLostError` for a block a store lost (blocks of other pools
        may have been written)."""
        check_external(into, self.shape, self.dtype)
        layer = self._layer(layer)
        n, bs = len(into), self.block_size
        with self._lock:
            tokens = int(self._seq(seq).lengths[layer])
            if not first >= 0 or (first + n) * bs > tokens:
                raise InvalidArgumentError(
                    f"sequence {seq} layer {layer}: expected whole blocks it holds, got blocks "
                    f"{first}:{first + n} of {bs} tokens with {tokens} tokens written"
                )
            blocks = self.core.sequence_blocks(seq)[first : first + n]
            self.ledger.check_written(seq, layer, blocks, n * bs)
            self.ledger.check_not_lost(seq, blocks)
            for (tier, level), pick, slots, ids in self._tiers.locations(blocks):
                if self.drop_level is not None and level == self.drop_level:
                    raise InvalidArgumentError(
                        f"sequence {seq}: block {int(ids[0])} was dropped (level "
                        f"{self.ladder[level]!r}): its K/V is gone"
                    )
                start = time.perf_counter()
                try:
                    self._tiers.read_layer_into(tier, level, slots, layer, ids, into, pick)
                except BlocksLost as exc:
                    self._mark_lost(exc.blocks.astype(np.uint32))
                    self.ledger.check_not_lost(seq, blocks)
                    raise
                took = self._load_times.setdefault((tier, level), DecayedRate(0.99))
                took.add(time.perf_counter() - start, len(ids))
            if len(blocks):
                self.core.record_reads(blocks)

    def _append_one(self, seq: int, layer: Any, k: Any, v: Any) -> bool:
        """The decode step's append on the CPU: one token into the block this sequence is
        filling, its checks inlined (this runs once per layer per token). False, with nothing
        done, whenever the general path must run: another shape or kind of input, a new block
        needed, or not the next token of a block being filled."""
        tensor = self._token_type
        if not (
            type(k) is tensor
            and type(v) is tensor
            and k.shape == self._token_shape
            and v.shape == self._token_shape
            and k.dtype is self.dtype
            and v.dtype is self.dtype
            and k.is_cpu
            and v.is_cpu
            and k.stride(1) == v.stride(1)  # the token axis has one element: any stride
            and k.stride(2) == 1 == v.stride(2)
            and type(layer) is int
            and 0 <= layer < self._layers
        ):
            return False
        layers, H, bs, D, item = self._token_dims
        ledger = self.ledger
        with self._lock:
            state = self._seqs.get(seq)
            if state is None:
                return False
            start = int(state.lengths[layer])
            index, off = divmod(start, bs)
            grows = start == self.core.sequence_tokens(seq)  # this layer is the first there
            if grows and off == 0:
                return False  # a new block first
            tail = state.tail
            if tail is None or tail[0] != index:
                block = int(self.core.sequence_blocks(seq)[index])
                info = self.core.block_info(np.array([block], dtype=np.uint32))
                if info["tier"][0] != 0 or info["level"][0] != 0 or not ledger.pinned[block]:
                    return False
                tail = state.tail = (index, block, int(info["slot"][0]))
            _, block, slot = tail
            if (
                not ledger.pinned[block]
                or ledger.lost[block]
                or ledger.written[block, layer] != off
            ):
                return False
            # K of head 0 at [slot, layer, 0, 0, off]; V half a layer's row further on.
            k_at = self._pool0 + (((slot * layers + layer) * 2 * H * bs) + off) * D * item
            norm, bad = write_token(
                k_at, k_at + H * bs * D * item, bs * D, k.data_ptr(), v.data_ptr(), k.stride(1),
                H, D, self._dtype_code, self._limit,
            )  # fmt: skip
            if bad:
                raise refusal("kv"[bad - 1], self._limit)
            if grows:
                self.core.extend(seq, 1)  # room in the block being filled: allocates nothing
            done = ledger.wrote_token(block, layer, off, norm, layer == layers - 1)
            state.lengths[layer] = start + 1
            if done:
                self._finish(np.array([block], dtype=np.uint32))
        return True

    def _write(
        self, seq: int, layer: int, start: int, end: int, k: Any, v: Any, norms: np.ndarray
    ) -> None:
        """The general append: tokens ``[start, end)`` of ``seq`` (its blocks allocated) into
        the level-0 device pool, but for those already there (a shared block its owner wrote)."""
        torch = torch_module()
        bs = self.block_size
        positions = np.arange(start, end)
        index = positions // bs
        blocks = self.core.sequence_blocks(seq)[index[0] : index[-1] + 1]
        offset = positions % bs
        tok_blocks = blocks[index - index[0]]
        fresh = offset >= self.ledger.written[tok_blocks, layer]
        if not fresh.any():
            return
        info = self.core.block_info(blocks)
        low = fresh & (info["level"][index - index[0]] != 0)
        if low.any():
            # Blocks an encoded append placed below level 0, whole here (checked before the
            # call changed anything): encoded where they lie, a block at a time.
            sel = torch.from_numpy(np.nonzero(low)[0]).to(k.device)
            H, D = self.shape.kv_heads, self.shape.head_dim
            whole = torch.stack((k[sel], v[sel]), 1).reshape(-1, bs, 2, H, D)
            ids = tok_blocks[low][::bs]
            blocks_of = whole.permute(0, 2, 3, 1, 4).contiguous()  # [n, 2, H, N, D]
            self._write_encoded(ids, np.arange(len(ids)), layer, blocks_of)
        where = np.nonzero(fresh & ~low)[0]
        if len(where):
            local = index[where] - index[0]
            slots = torch.from_numpy(info["slot"][local].astype(np.int64)).to(self.device)
            offs = torch.from_numpy(offset[where]).to(self.device)
            sel = torch.from_numpy(where).to(self.device)
            ks, vs = (k, v) if len(where) == len(positions) else (k[sel], v[sel])
            self._tiers.write_tokens(slots, layer, offs, ks, vs)
        where = np.nonzero(fresh)[0]
        # Bookkeeping after the writes.
        self._finish(self.ledger.wrote(tok_blocks[where], layer, offset[where], norms[where]))

    def _check_whole_below_level_0(self, seq: int, layer: int, start: int, end: int) -> None:
        """Refuses, before anything changes, an append of tokens ``[start, end)`` that would
        write part of a block an encoded append placed below level 0: its codec encodes whole
        blocks. (Only after such a placement: the check costs a core call.)"""
        if not self._placed_below_0:
            return
        bs = self.block_size
        first = start // bs
        ids = self.core.sequence_blocks(seq)[first : -(-end // bs)]
        written = self.ledger.written[ids, layer]
        below = (self.core.block_places(ids)[1] != 0) & (written < bs)
        starts = (first + np.arange(len(ids))) * bs
        part = below & ((written > 0) | (starts < start) | (starts + bs > end))
        if part.any():
            i = int(np.argmax(part))
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: tokens {start}:{end} cover part of block "
                f"{first + i} (tokens {starts[i]}:{starts[i] + bs}), which an encoded "
                "append_blocks placed below level 0: append its whole block (append_blocks, "
                "or all its tokens in one append); nothing was stored"
            )

    def _finish(self, done: np.ndarray) -> None:
        """Blocks every layer has written in full: unpinned (and queued to be published)."""
        if not len(done):
            return
        self.ledger.unpin(done)
        if self._sharing.active:
            self._sharing.queue(done)

    def gather(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of ``seq`` at ``layer``, ``[num_tokens, num_kv_heads,
        head_dim]`` each, decoded to the model dtype, contiguous, on the device. Counts a read
        of each block for the scheduler. Under a ladder with a ``drop`` level, the tokens of
        dropped blocks are left out (fewer than :meth:`num_tokens`, in order; the sink blocks,
        the recent window and the newest block are never dropped, so the newest tokens are
        always the last)."""
        tokens, blocks = self._gather_blocks(seq, layer)
        m, bs = blocks.shape[0], self.block_size
        kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, m * bs, *self.shape.dims[2:5:2])
        # One block reshapes to a strided view, not a copy: contiguous as promised.
        return kv[0, :tokens].contiguous(), kv[1, :tokens].contiguous()

    def gather_blocks(self, seq: int, layer: int) -> torch.Tensor:
        """The blocks of ``seq`` at ``layer`` as stored, decoded to the model dtype, on the
        device: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` (K then V), the last
        block possibly partial (its rows past :meth:`num_tokens` undefined). For engines whose
        own cache is paged: no token-major copy on the way. Counts a read of each block.
        Dropped blocks (a ``drop`` level) are left out, as :meth:`gather` leaves them."""
        return self._gather_blocks(seq, layer)[1]

    def _gather_blocks(self, seq: int, layer: int) -> tuple[int, torch.Tensor]:
        torch = torch_module()
        layer = self._layer(layer)
        with self._lock:
            blocks, tokens = self._attended(seq, int(self._seq(seq).lengths[layer]))
            self.ledger.check_written(seq, layer, blocks, tokens)
            self.ledger.check_not_lost(seq, blocks)
            out = None
            for (tier, level), rows, slots, ids in self._tiers.locations(blocks):
                try:
                    part = self._tiers.read_layer(tier, level, slots, layer, ids)
                except BlocksLost as exc:
                    self._mark_lost(exc.blocks.astype(np.uint32))
                    self.ledger.check_not_lost(seq, blocks)
                    raise
                if rows is None:  # one pool holds them all, in order
                    out = part
                    break
                if out is None:
                    out = torch.empty(
                        (len(blocks), *self.shape.dims[1:]), dtype=self.dtype, device=self.device
                    )
                out.index_copy_(0, torch.from_numpy(rows).to(self.device), part)
            if out is None:
                out = torch.empty((0, *self.shape.dims[1:]), dtype=self.dtype, device=self.device)
            if len(blocks):
                self.core.record_reads(blocks)
        return tokens, out

    def attend(
        self,
        seqs: int | Sequence[int],
        layer: int,
        q: Any,
        *,
        scale: float | None = None,
        record: bool = True,
        return_mass: bool = False,
    ) -> Any:
        """Attention output of the newest queries of ``seqs`` at ``layer``, computed over their
        blocks where they lie: level-0 blocks read as they are, INT8/INT4 blocks dequantized a
        tile at a time inside the kernel (the Rust CPU kernel, or the CUDA kernel), never
        gathered into a full-precision copy.

        ``q``: ``[queries, q_heads, head_dim]`` for one sequence, or ``[len(seqs), queries,
        q_heads, head_dim]`` for several, in the model dtype on the device; ``q_heads`` a
        multiple of the K/V heads (grouped-query attention). The queries are each sequence's
        last ``queries`` tokens, whose K/V :meth:`append` has already stored; query ``i`` sees
        the keys up to its own position (causal, so a prefill chunk over a cached prefix works
        too). ``scale``: the softmax scale (default ``head_dim ** -0.5``). Returns the output,
        shaped and typed like ``q`` (with ``return_mass``: ``(output, mass)``, ``mass`` fp32
        ``[len(seqs), max_blocks]`` numpy, each block's share of the attention, averaged over
        heads and queries). ``record``: the masses feed the scheduler's attention signal (as
        :meth:`record_attention` does) and each block counts as read, as :meth:`gather`
        counts it."""
        torch = torch_module()
        single, ids = sequence_ids(seqs)
        q = as_tensor(q, "q")
        dims = check_query(q, single, len(ids), self.shape, self.dtype, self.device)
        if scale is None:
            sm_scale = self.shape.head_dim**-0.5
        elif type(scale) is float and math.isfinite(scale):  # a model's, every layer
            sm_scale = scale
        else:
            sm_scale = softmax_scale(scale)
        if type(layer) is not int or not 0 <= layer < self._layers:
            layer = self._layer(layer)
        queries = dims[1]
        if q.requires_grad:
            q = q.detach()
        if not q.is_contiguous():
            q = q.contiguous()
        if not ids:  # an empty batch: nothing to read
            out = torch.empty_like(q)
            return (out, np.zeros((0, 0), dtype=np.float32)) if return_mass else out
        tables = self.attention_tables
        with self._lock:
            tokens = tuple([int(self._seq(s).lengths[layer]) for s in ids])
            if tokens and min(tokens) < max(queries, 1):
                raise InvalidArgumentError(
                    f"q: {queries} queries, but a sequence holds {min(tokens)} tokens at layer "
                    f"{layer}: append the queries' K/V first"
                )
            # Every layer of a decode step reads the same tables: the first builds them.
            step = tables.step(ids, tokens, queries)
            batch = step.batch
            batch.check_written(self.ledger, ids, tokens, layer)
            if batch.staged:
                try:
                    pools, slots, views, desc = tables.stage(batch, layer)
                except BlocksLost as exc:  # a store could not give a block back: never wrong K/V
                    self._mark_lost(exc.blocks.astype(np.uint32))
                    for seq, blocks in zip(ids, batch.blocks, strict=True):
                        self.ledger.check_not_lost(seq, blocks)
                    raise
            else:
                pools, slots = batch.pools, batch.slots
                views, desc = tables.views, tables.descriptors
            out = torch.empty_like(q)
            mass = np.zeros(pools.shape, dtype=np.float32)
            # The kernels refuse a NaN or inf query before they write or this records anything.
            run_attention(
                q, out, mass, step.lengths, pools, slots, views, self.shape, layer, sm_scale,
                desc, tables.rotation,
            )  # fmt: skip
            if record and len(step.blocks):
                self.core.record_attention(step.blocks, step.masses(mass))
                self.core.record_reads(step.blocks)
        return (out, mass) if return_mass else out

    # -- signals --------------------------------------------------------------------------------

    def record_attention(self, seq: int, layer: int, weights: Any) -> None:
        """Feeds attention weights whose last axis runs over the sequence's tokens (e.g.
        ``[heads, queries, tokens]`` from eager attention; the tokens :meth:`gather` returns,
        so without those of dropped blocks). Each block is credited the attention
        *mass* it received: the weights are averaged over the leading axes (so a prefill's many
        queries weigh no more than one decode step's), then summed over the block's tokens, as
        H2O accumulates attention. The core smooths these masses over reports."""
        w = as_tensor(weights, "weights")
        layer = self._layer(layer)
        with self._lock:
            tokens = int(self._seq(seq).lengths[layer])
            blocks, tokens = self._attended(seq, tokens)  # weights over what gather returned
            if w.dim() < 1 or w.shape[-1] != tokens:
                raise InvalidArgumentError(
                    f"weights: expected a last axis of {tokens} tokens (sequence {seq}, layer "
                    f"{layer}), got shape {list(w.shape)}"
                )
            per_token = w.detach().float().reshape(-1, tokens).mean(0).cpu().numpy()
            mass = per_block(per_token, self.block_size)
            self.core.record_attention(blocks, mass.astype(np.float32))

    def set_learned_scores(self, seq: int, scores: Any, first_block: int = 0) -> None:
        """A learned importance score per block of ``seq`` (e.g. from a probe on its keys),
        from its block ``first_block`` on (default: every block)."""
        values = np.asarray(scores, dtype=np.float32).reshape(-1)
        with self._lock:
            self._seq(seq)
            blocks = self.core.sequence_blocks(seq)
            if not 0 <= first_block <= len(blocks):
                raise InvalidArgumentError(
                    f"first_block: expected 0 to {len(blocks)} (sequence {seq} has {len(blocks)} "
                    f"blocks), got {first_block}"
                )
            blocks = blocks[first_block:]
            if len(values) != len(blocks) or not np.isfinite(values).all():
                raise InvalidArgumentError(
                    f"scores: expected {len(blocks)} finite scores (one per block of sequence "
                    f"{seq} from block {first_block}), got {len(values)}"
                )
            self.core.set_learned(blocks, values)

    # -- scheduling -----------------------------------------------------------------------------

    def step(self, room_bytes: int = 0) -> dict[str, int]:
        """Lets the core plan moves and executes them: one batched codec call or copy per kind of
        move and pair of pools, then commit. If a copy fails, the plan is aborted (every block
        stays where it was) and the error raised; a store tier that refuses or loses blocks is
        handled instead (see :mod:`kvtier.manager`) and the summary says so. Returns the plan's
        summary. ``room_bytes``: also free that much of the device budget for blocks about to be
        allocated."""
        with self._step_lock:
            if self._sharing.pending:
                self._publish()
            with self._lock:
                self._free_orphans()
                self._tiers.resume()
                plan = self.core.plan(room_bytes)
            return self._run(plan)

    def _run(self, plan: Plan) -> dict[str, int]:
        """Executes a plan and commits it (aborts it if a copy fails); called holding the step
        lock, not the lock."""
        try:
            self._tiers.execute(plan)
        except (StoreRefused, BlocksLost) as exc:
            with self._lock:
                self.core.abort(plan.id, copied=True)  # some copies may have run
                return {**plan.summary(), **self._store_failed(exc)}
        except BaseException:
            with self._lock:
                self.core.abort(plan.id, copied=True)
            raise
        with self._lock:
            self.core.commit(plan.id)
            self.attention_tables.invalidate()  # blocks moved: attention tables are stale
        return plan.summary()

    def _store_failed(self, exc: StoreRefused | BlocksLost) -> dict[str, int]:
        """After a plan was aborted for a store: a refusing tier sits out a while; lost blocks
        are forgotten (so never shared) and pinned where they are (so never moved again)."""
        if isinstance(exc, StoreRefused):
            self._tiers.suspend(exc.tier)
            return {"store_refused": 1}
        lost = exc.blocks.astype(np.uint32)
        self._mark_lost(lost)
        log.warning("%d block(s) lost from the %s tier", len(lost), exc.tier)
        return {"lost": len(lost)}

    def _mark_lost(self, blocks: np.ndarray) -> None:
        self.attention_tables.invalidate()
        self.ledger.mark_lost(blocks)

    def _grow(
        self,
        seq: int,
        call: Callable[[], Any],
        tokens: int,
        shared: Callable[[], np.ndarray] | None = None,
    ) -> None:
        """Runs a core call that allocates blocks for ``tokens`` more tokens of ``seq`` (the
        first of them the cached blocks ``shared()`` names, as the prefix cache holds them at
        the time) and tracks the new blocks, pinned until complete."""
        have = len(self.core.sequence_blocks(seq))
        total = -(-(self.core.sequence_tokens(seq) + tokens) // self.block_size)
        added, is_shared = self._with_room(call, total - have, shared)
        new = added[~is_shared]
        self.ledger.track(new)
        self.ledger.pin(new)
        self.attention_tables.invalidate()  # the sequence has new blocks: its table is stale

    def _with_room(
        self,
        call: Callable[[], _T],
        blocks: int,
        shared: Callable[[], np.ndarray] | None = None,
    ) -> _T:
        """Runs a core call that needs at most ``blocks`` blocks, new level-0 ones on the device
        but the cached ones ``shared()`` names (which it shares). When they do not fit: a plan
        demotes and offloads to make room (run only if it, with the cached blocks an eviction
        may take, makes enough; else aborted, nothing moved), then the call is retried, evicting
        cached blocks lowest-ranked first when ``evict_on_full``. The plan keeps the blocks the
        call will share: room made by evicting one would be room for one block too few. If it
        still fails, :class:`OutOfCapacityError` says what holds the device, and nothing changed
        but the count of the aborted plan. Called with the lock held."""
        try:
            return call()
        except OutOfCapacityError:
            pass
        if self._orphans:
            self._free_orphans()
            with contextlib.suppress(OutOfCapacityError):
                return call()
        keep = shared or (lambda: np.zeros(0, np.uint32))
        new = max(0, blocks - len(keep()))
        self._lock.release()  # the step lock comes first: never wait for it holding this one
        try:
            self._make_room(new, keep)
        finally:
            self._lock.acquire()
        self.core.evict_on_full = self.config.evict_on_full
        try:
            return call()
        except OutOfCapacityError as exc:
            # The core's own words name the limit that stopped it (bytes or slots, which pool).
            raise OutOfCapacityError(f"{self._full(new)} (the core: {exc})") from None
        finally:
            self.core.evict_on_full = False

    def _full(self, blocks: int) -> str:
        """Why ``blocks`` new level-0 blocks do not fit (see :func:`room.why_full`)."""
        layout = self._layout
        return why_full(
            self.core, self._seqs, blocks, self.level_bytes, layout.tiers[1:],
            self.config.evict_on_full, layout.tier_bytes("device"),
        )  # fmt: skip

    def _make_room(self, blocks: int, keep: Callable[[], np.ndarray]) -> None:
        """Runs a plan that frees ``blocks`` level-0 device slots by demoting and offloading,
        if it (with the cached blocks an eviction may then take) frees enough. When it does
        not, but the live blocks and the new ones fit in the tiers together
        (:func:`room.fits_in_tiers`), plans run one after another, each taking the slots the
        last freed (a slot a move frees is free only once the plan commits: room two levels or
        two tiers away takes a cascade), while each moves something. A write that cannot fit
        moves nothing. ``keep()``: the cached blocks the write will share, which the plans may
        move but never evict."""
        compress = self.config.enable_compression and len(self.codecs) > 1
        with self._step_lock:
            if self._sharing.pending:
                self._publish()
            for cascade in range(_ROOM_ROUNDS):
                with self._lock:
                    self._tiers.resume()
                    # The plan may evict cached leaves for the room (into whose slots blocks
                    # of level 0 go) as far as the config allows eviction at all.
                    self.core.evict_on_full = self.config.evict_on_full
                    try:
                        plan = self.core.plan(blocks * self.level_bytes[0], keep=keep())
                    finally:
                        self.core.evict_on_full = False
                    enough = slots_after(self.core, plan, self.config.evict_on_full) >= blocks
                    moves = len(plan) or plan.released_copies
                    if not enough and (
                        not moves
                        or cascade == _ROOM_ROUNDS - 1
                        or (cascade == 0 and not self._fits(blocks, compress))
                    ):
                        self.core.abort(plan.id)
                        return
                self._run(plan)
                if enough:
                    return

    def _fits(self, blocks: int, compress: bool) -> bool:
        """Whether the live blocks and ``blocks`` new ones fit in the tiers together."""
        return fits_in_tiers(
            self.core, self._seqs, blocks, self.slots, compress, self.config.evict_on_full
        )

    # -- prefix sharing -------------------------------------------------------------------------

    def _publish(self) -> None:
        """Puts the blocks completed since the last step on the remote server (outside the
        lock); called holding the step lock. A failed put costs the sharing only."""
        with self._lock:
            blocks, hashes, slots = self._sharing.take()
        try:
            sent = self._sharing.send(hashes, slots)
        finally:
            with self._lock:
                self.core.unpin(blocks)
        self._sharing.published(sent)

    def _fetch_shared(self, seq: int) -> None:
        """Fills the leading blocks of a new sequence's prompt that this manager lacks from what
        other engines published (a value that fails its checks is a miss, so the engine computes
        that block and the rest). The server is asked outside the lock: nobody else knows the
        sequence yet, and its unwritten blocks stay pinned where they are."""
        with self._lock:
            first = int(self._seqs[seq].lengths[0]) // self.block_size
            blocks, hashes = self._sharing.wanted(self.core.sequence_blocks(seq)[first:])
        if not len(blocks):
            return
        hits = self._sharing.get(hashes)
        if not hits:
            return
        with self._lock:
            if self._sharing.fill(blocks, hits):
                state = self._seqs[seq]
                state.lengths[:] = self.ledger.cached_prefix(self.core.sequence_blocks(seq))

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> ManagerStats:
        """Pool occupancy, bytes saved and move counters, read from the core."""
        with self._lock:
            self._free_orphans()
            tokens = sum(int(s.lengths.max(initial=0)) for s in self._seqs.values())
            return collect(
                self.core, self.ladder, self.level_bytes, self.drop_level, self._seqs, tokens,
                self._sharing.counters,
            )  # fmt: skip

    def load_seconds(self) -> dict[tuple[str, str], float]:
        """Seconds :meth:`load_blocks` has been taking to write one block at every layer into an
        engine's cache (read, decode, copy), by the (tier, level name) it read from: recent
        loads weigh the most. Places it has not read from are absent."""
        with self._lock:
            rates = [(place, took.rate) for place, took in self._load_times.items()]
        return {
            (tier, self.ladder[level]): rate * self._layers
            for (tier, level), rate in rates
            if rate is not None
        }

    def get_compression_stats(self) -> dict[str, Any]:
        """``memory_saved_mb``, ``avg_compression_ratio``, per-pool blocks and bytes, and the
        promotions, demotions, offloads, evictions and hits so far (see :class:`ManagerStats`)."""
        return self.stats().as_dict()

    # -- internals ------------------------------------------------------------------------------

    def _seq(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except (KeyError, TypeError):
            raise InvalidSequenceError(
                f"unknown sequence {seq!r}: expected one returned by add_sequence or fork and "
                "not yet freed"
            ) from None

    def _layer(self, layer: Any) -> int:
        return check_layer(layer, self.shape.layers)

    def _attended(self, seq: int, tokens: int) -> tuple[np.ndarray, int]:
        """The blocks of the first ``tokens`` tokens of ``seq`` that attention sees, and their
        tokens: all of them, less those a ``drop`` level took out. Dropped blocks are full ones
        (never the sink, the recent window, nor the block being filled), so the tokens left
        fill the blocks left in order."""
        blocks = self.core.sequence_blocks(seq)[: -(-tokens // self.block_size)]
        if self.drop_level is None:
            return blocks, tokens
        kept = blocks[self.core.block_info(blocks)["level"] != self.drop_level]
        return kept, tokens - (len(blocks) - len(kept)) * self.block_size
