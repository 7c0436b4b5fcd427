"""Hugging Face transformers: :class:`TieredCache`, a ``Cache`` whose K/V live in a BlockManager.

::

    cache = TieredCache(model)          # kvtier settings from KVTIER_* variables
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Each batch row is one manager sequence. Every attention layer's ``update`` appends the new K/V
(after RoPE, exactly as the model computed them) and returns the row's whole K/V gathered back,
older blocks decoded from whatever level the scheduler put them at. After the last layer of every
``step_every``-th forward pass, ``step()`` lets the scheduler demote, offload and promote. The
cache implements transformers 5's ``Cache`` API: one :class:`TieredLayer` (a ``CacheLayerMixin``)
per decoder layer, ``crop``, ``reorder_cache`` (beam search), ``batch_repeat_interleave`` and
``batch_select_indices`` (sequences are forked, so beams share their common blocks).

Attention feedback: with ``attn_implementation="eager"`` the attention modules return their
weights. :func:`attention_feedback` registers a forward hook on each of them (PyTorch's own
``register_forward_hook``; transformers' source is untouched) that hands the weights, summed over
heads per block, to the scheduler when the module ran with a ``TieredCache``. ``TieredCache(model)``
installs it by itself for an eager model. With sdpa or flash attention no weights exist; key
magnitude (always measured) and learned scores carry the importance.

Attention over the blocks: with ``attn_implementation="kvtier"`` (registered in transformers'
``AttentionInterface`` when this module is imported: ``model.set_attn_implementation("kvtier")``,
or ``from_pretrained(..., attn_implementation="kvtier")``) the model's attention runs through
:meth:`BlockManager.attend`, over each row's blocks where they lie: ``update`` appends the new
K/V and gathers nothing, and the attention mass each block received reaches the scheduler from
the kernel, with no eager attention and no hook. Without a ``TieredCache`` (another cache, or
none), or when a batch is padded, the "kvtier" implementation is plain sdpa, over gathered K/V
where the cache is a ``TieredCache``.

Models it cannot serve correctly are refused when the cache is built (:func:`check_supported`):
sliding-window, chunked, linear-attention and hybrid layers, encoder-decoder models, and keys and
values of different head sizes (MLA).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..config import KvtierConfig
from ..errors import ConfigError, InvalidArgumentError
from ..manager import BlockManager

__all__ = [
    "ATTENTION",
    "TieredCache",
    "TieredLayer",
    "attention_feedback",
    "check_supported",
    "kvtier_attention",
]

#: The name of kvtier's attention in transformers' registry (``attn_implementation``).
ATTENTION = "kvtier"

#: Layer types (transformers' ``config.layer_types``) whose cache is plain full attention.
_FULL_ATTENTION = "full_attention"


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def check_supported(config: Any) -> None:
    """Raises :class:`ConfigError` naming why a model of ``config`` cannot use a TieredCache: the
    manager holds one full-attention K/V sequence per layer and nothing else."""
    text = _text_config(config)
    name = getattr(text, "model_type", type(text).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"TieredCache: {name} is an encoder-decoder model; expected a decoder-only one"
        )
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != _FULL_ATTENTION})
        if other:
            raise ConfigError(
                f"TieredCache: {name} has {', '.join(other)} layers; only full-attention layers "
                "are supported (a sliding window or a recurrent state would be served wrong K/V)"
            )
    else:
        for field in ("sliding_window", "attention_chunk_size"):
            if getattr(text, field, None) is not None and getattr(text, "use_sliding_window", True):
                raise ConfigError(
                    f"TieredCache: {name} sets {field}={getattr(text, field)}; only "
                    "full-attention layers are supported"
                )
    if getattr(text, "num_kv_shared_layers", 0):
        raise ConfigError(f"TieredCache: {name} shares K/V between layers; not supported")
    for field in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if getattr(text, field, None) is not None:
            raise ConfigError(
                f"TieredCache: {name} sets {field} (latent or unequal K and V heads, e.g. MLA); "
                "expected keys and values of one head size"
            )


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder config."""
    text = _text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(text.num_hidden_layers), int(kv_heads), int(head_dim)


class TieredLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's view of a :class:`TieredCache`; the K/V are in the cache's manager."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # A weak reference: the cache owns its layers, not the other way round.
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx

    @property
    def cache(self) -> TieredCache:
        cache = self._cache()
        if cache is None:
            raise InvalidArgumentError("this TieredLayer's TieredCache no longer exists")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Keys of dropped blocks are not returned: the mask spans the keys attention gets,
        # offset so that the newest (never dropped) sit at their true positions. Older keys
        # then sit at or after theirs, still before every query: causal masking is unchanged.
        seen, kept = self.get_seq_length(), self.cache._attended(self.layer_idx)
        return kept + query_length, seen - kept

    def get_seq_length(self) -> int:
        return self.cache._length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        # The manager's sequences span every layer: the cache crops them all at once.
        raise InvalidArgumentError("crop a TieredCache as a whole: cache.crop(-n)")


class TieredCache(Cache):
    """A transformers ``Cache`` backed by a kvtier :class:`BlockManager`.

    ``model``: the model it serves (its config gives the K/V shape, its dtype and device the
    manager's), or just its ``PretrainedConfig`` (the manager is then built at the first update,
    from the tensors it receives). ``config``: kvtier's settings (default
    :meth:`KvtierConfig.from_env`). ``manager``: an existing manager to store into instead
    (shared between caches, e.g. one per request); the cache then never closes it.
    ``step_every``: forward passes between scheduler steps (0 = never; call :meth:`step`).
    ``feedback``: install :func:`attention_feedback` on ``model`` when it runs eager attention.
    ``attend``: attention reads the blocks (:func:`kvtier_attention`) and ``update`` returns
    only the new K/V; the default is on when the model's ``attn_implementation`` is
    ``"kvtier"``, and it needs that implementation (any other would see only the new tokens).
    """

    def __init__(
        self,
        model: Any,
        config: KvtierConfig | None = None,
        *,
        manager: BlockManager | None = None,
        step_every: int = 1,
        feedback: bool = True,
        attend: bool | None = None,
    ) -> None:
        model_config = getattr(model, "config", model)
        check_supported(model_config)
        if isinstance(step_every, bool) or not isinstance(step_every, int) or step_every < 0:
            raise InvalidArgumentError(f"step_every: expected an int >= 0, got {step_every!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = _kv_shape(model_config)
        self.kvtier_config = (
            config
            if config is not None
            else (manager.config if manager is not None else KvtierConfig.from_env())
        )
        self.step_every = step_every
        implementation = getattr(model_config, "_attn_implementation", None)
        self.attend = implementation == ATTENTION if attend is None else bool(attend)
        if self.attend and implementation != ATTENTION:
            raise ConfigError(
                f"TieredCache(attend=True): the model runs {implementation!r} attention, which "
                f"would see only the new tokens; load it with attn_implementation={ATTENTION!r} "
                f"(or model.set_attn_implementation({ATTENTION!r}))"
            )
        self._rows = _Rows(manager, owns=manager is None)
        # Frees the rows when the cache is garbage-collected (and closes a manager it built).
        weakref.finalize(self, self._rows.close, collected=True)
        if manager is not None:
            want = (self.num_layers, self.num_kv_heads, self.head_dim)
            have = (manager.shape.layers, manager.shape.kv_heads, manager.shape.head_dim)
            if have != want:
                raise ConfigError(
                    f"manager: holds K/V of (layers, kv_heads, head_dim) = {have}, the model "
                    f"needs {want}"
                )
        elif hasattr(model, "dtype") and hasattr(model, "device"):
            self.manager = self._new_manager(model.dtype, model.device)
        # With eager feedback the hook ends the forward pass (_layer_done) after the last
        # layer's attention has reported its weights, over the K/V that update returned; a step
        # before it could drop blocks those weights still cover.
        self._hooked = feedback and _attn_implementation(model) == "eager"
        if self._hooked:
            attention_feedback(model)
        if self.attend and isinstance(model, torch.nn.Module):
            # An update's keys reach the attention of its own forward only.
            for module in model.modules():
                if isinstance(getattr(module, "layer_idx", None), int):
                    _scope_pending(module)
        self.drops = self.kvtier_config.resolved_ladder("fp32")[-1] == "drop"
        if self.drops and isinstance(model, torch.nn.Module):
            _refuse_padding_with_drops(model)
        self.forwards = 0
        #: move counts summed over this cache's steps
        self.moves: dict[str, int] = {}
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])

    @property
    def manager(self) -> BlockManager | None:
        """The manager the K/V live in (None until the first update when built from a config)."""
        return self._rows.manager

    @manager.setter
    def manager(self, manager: BlockManager | None) -> None:
        self._rows.manager = manager

    @property
    def sequences(self) -> list[int]:
        """The manager sequence of each batch row (empty until the first update)."""
        return self._rows.sequences

    @sequences.setter
    def sequences(self, sequences: list[int]) -> None:
        self._rows.sequences = sequences

    def _new_manager(self, dtype: Any, device: Any) -> BlockManager:
        return BlockManager(
            self.kvtier_config,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            device=device,
        )

    # -- what attention calls --------------------------------------------------------------------

    def _update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, shape = self._rows, keys.shape
        bm, seqs = rows.manager, rows.sequences
        # Every layer of every step: the usual case in one test, the rest in _rows_for.
        if not (
            bm is not None
            and len(shape) == 4
            and shape == values.shape
            and shape[0] == len(seqs)
            and shape[1] == self.num_kv_heads
            and shape[3] == self.head_dim
        ):
            bm, seqs = self._rows_for(layer, keys, values)
        for row, seq in enumerate(seqs):
            bm.append(seq, layer, keys[row].transpose(0, 1), values[row].transpose(0, 1))
        if self.attend:
            # Attention (kvtier_attention) reads the blocks: hand it only the new K/V, and
            # which cache and layer they belong to. It ends the forward pass (_layer_done):
            # a step now would move blocks under this layer's attention.
            _PENDING.value = (self, layer, keys)
            return keys, values
        out = self._gathered(layer)
        if not self._hooked:
            self._layer_done(layer)
        return out

    def _rows_for(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[BlockManager, list[int]]:
        """The manager and the sequences of the rows of ``keys``, built on the first update;
        raises for states of another shape than the model's or another batch than the cache's."""
        want = (self.num_kv_heads, self.head_dim)
        if keys.dim() != 4 or keys.shape != values.shape or tuple(keys.shape[1::2]) != want:
            raise InvalidArgumentError(
                f"layer {layer}: expected key and value states [batch, {want[0]} kv_heads, "
                f"tokens, {want[1]} head_dim], got {list(keys.shape)} and {list(values.shape)}"
            )
        rows = self._rows
        if rows.manager is None:
            rows.manager = self._new_manager(keys.dtype, keys.device)
        batch = keys.shape[0]
        if not rows.sequences:
            rows.sequences = [rows.manager.add_sequence() for _ in range(batch)]
        elif batch != len(rows.sequences):
            raise InvalidArgumentError(
                f"layer {layer}: batch of {batch} rows, but this cache holds {len(rows.sequences)} "
                "sequences; reset() it (or use a new cache) for another batch"
            )
        return rows.manager, rows.sequences

    def _layer_done(self, layer: int) -> None:
        """After the last layer's attention: the forward pass is done, maybe a step."""
        if layer == self.num_layers - 1:
            self.forwards += 1
            if self.step_every and self.forwards % self.step_every == 0:
                self.step()

    def _gathered(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V of ``layer``, ``[batch, kv_heads, tokens, head_dim]`` each."""
        assert self.manager is not None
        out_k, out_v = [], []
        for seq in self.sequences:
            k, v = self.manager.gather(seq, layer)
            out_k.append(k.transpose(0, 1))
            out_v.append(v.transpose(0, 1))
        return torch.stack(out_k), torch.stack(out_v)

    def _attend(self, layer: int, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention output ``[batch, queries, heads, head_dim]`` of ``query`` ``[batch, heads,
        queries, head_dim]`` over the rows' blocks (their masses go to the scheduler)."""
        rows = self._rows
        assert rows.manager is not None
        out: torch.Tensor = rows.manager.attend(
            rows.sequences, layer, query.transpose(1, 2), scale=scale
        )
        return out

    def _length(self, layer: int) -> int:
        if not self.sequences or self.manager is None:
            return 0
        return self.manager.num_tokens(self.sequences[0], layer)

    def _attended(self, layer: int) -> int:
        """Tokens attention sees at ``layer`` (fewer than :meth:`_length` once blocks are
        dropped); every row must see as many, since their K/V are stacked."""
        bm = self.manager
        if not self.sequences or bm is None:
            return 0
        if bm.drop_level is None:
            return bm.num_tokens(self.sequences[0], layer)
        counts = {bm.attended_tokens(seq, layer) for seq in self.sequences}
        if len(counts) > 1 and not self.attend:  # the kernels take ragged rows
            raise InvalidArgumentError(
                f"layer {layer}: the batch rows have dropped different numbers of blocks "
                f"({sorted(counts)} tokens left), so their K/V cannot be stacked; run the rows "
                "in separate caches, or use attn_implementation='kvtier'"
            )
        return min(counts)

    def record_attention(self, layer: int, weights: torch.Tensor) -> None:
        """Attention weights ``[batch, heads, queries, tokens]`` of ``layer`` for the scheduler
        (what :func:`attention_feedback`'s hook calls)."""
        if self.manager is None or weights.dim() != 4 or weights.shape[0] != len(self.sequences):
            raise InvalidArgumentError(
                f"weights: expected [{len(self.sequences)} batch rows, heads, queries, tokens], "
                f"got {list(weights.shape)}"
            )
        for row, seq in enumerate(self.sequences):
            self.manager.record_attention(seq, layer, weights[row])

    def step(self) -> dict[str, int]:
        """One scheduler step on the manager; returns its summary (also added to :attr:`moves`)."""
        if self.manager is None:
            return {}
        summary = self.manager.step()
        for name, n in summary.items():
            self.moves[name] = self.moves.get(name, 0) + int(n)
        return summary

    # -- the Cache API ---------------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length(layer_idx) if layer_idx < self.num_layers else 0

    def reset(self) -> None:
        """Frees every row's sequence (their complete blocks stay cached in the manager for
        reuse); the cache then takes a new batch."""
        self._rows.release()
        self.forwards = 0
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (a positive value is the length to keep,
        transformers' older convention). Each row is rebuilt from the K/V attention saw up to
        there, so what attention sees of the kept tokens does not change."""
        length = self.get_seq_length()
        keep = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
        if keep >= length or self.manager is None:
            return
        bm, keep = self.manager, max(keep, 0)
        if any(bm.attended_tokens(seq) < length for seq in self.sequences):
            raise InvalidArgumentError(
                "crop: blocks of this cache were dropped (a 'drop' level), so the K/V of the "
                "kept tokens cannot be rebuilt at their positions; crop needs a ladder without "
                "'drop'"
            )
        for row, seq in enumerate(self.sequences):
            kept = bm.add_sequence()
            for layer in range(self.num_layers):
                k, v = bm.gather(seq, layer)
                bm.append(kept, layer, k[:keep], v[:keep])
            bm.free(seq)
            self.sequences[row] = kept

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([row for row in range(len(self.sequences)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices).reshape(-1).tolist())

    def _select(self, rows: list[int]) -> None:
        """Row ``i`` becomes a fork of old row ``rows[i]`` (full blocks shared, not copied)."""
        if not self.sequences or self.manager is None:
            return
        old = self.sequences
        if any(not 0 <= r < len(old) for r in rows):
            raise InvalidArgumentError(f"expected rows in [0, {len(old)}), got {rows}")
        self.sequences = [self.manager.fork(old[r]) for r in rows]
        for seq in old:
            self.manager.free(seq)

    @property
    def batch_size(self) -> int:
        return len(self.sequences) if self.sequences else -1

    # -- what it holds ---------------------------------------------------------------------------

    def kv_bytes(self) -> dict[str, Any]:
        """K/V bytes this cache's sequences hold, from the pools: ``held`` (each block at its
        level), ``level0`` (the same blocks uncompressed) and ``blocks`` per level. A block shared
        by two rows counts once; a partly filled block counts whole, as it occupies a slot."""
        levels = len(self.manager.ladder) if self.manager is not None else 1
        if self.manager is None or not self.sequences:
            return {"held": 0, "level0": 0, "blocks": [0] * levels}
        bm = self.manager
        blocks = np.unique(np.concatenate([bm.core.sequence_blocks(s) for s in self.sequences]))
        counts = np.bincount(bm.core.block_info(blocks)["level"], minlength=levels)
        return {
            "held": int(sum(int(n) * b for n, b in zip(counts, bm.level_bytes, strict=True))),
            "level0": len(blocks) * bm.level_bytes[0],
            "blocks": [int(n) for n in counts],
        }

    def close(self) -> None:
        """Frees the sequences, and closes the manager if this cache built it. Leaving a
        ``with TieredCache(...) as cache:`` block, or dropping the cache, does it too."""
        self.reset()
        self._rows.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Rows:
    """The manager and the sequences of a cache's rows: what its finalizer frees, kept apart
    from the cache so that the finalizer does not keep the cache alive."""

    def __init__(self, manager: BlockManager | None, *, owns: bool) -> None:
        self.manager = manager
        self.owns = owns
        self.sequences: list[int] = []

    def release(self, *, collected: bool = False) -> None:
        """Frees the rows' sequences; for a collected cache at the manager's next call (a
        garbage collector may run the finalizer inside any manager call of this thread)."""
        bm, seqs = self.manager, self.sequences
        self.sequences = []
        if bm is None or not seqs:
            return
        if collected:
            bm.free_later(seqs)
        else:
            for seq in seqs:
                bm.free(seq)

    def close(self, *, collected: bool = False) -> None:
        self.release(collected=collected)
        if self.owns and self.manager is not None:
            if not collected:  # a collected cache's own manager goes with it
                self.manager.close()
            self.manager = None


def _attn_implementation(model: Any) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def attention_feedback(model: Any) -> list[Any]:
    """Registers (once per model) a forward hook on every attention module that has a
    ``layer_idx``: when the module ran with a :class:`TieredCache` and returned attention weights
    (eager attention), they go to :meth:`TieredCache.record_attention`. Returns the hook handles
    (``handle.remove()`` undoes it)."""
    handles: list[Any] | None = getattr(model, "_kvtier_feedback_handles", None)
    if handles is not None:
        return handles

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, TieredCache) or not cache._hooked:
            return  # not a TieredCache, or one built with feedback=False
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(weights, torch.Tensor) and weights.dim() == 4:
            cache.record_attention(module.layer_idx, weights.detach())
        cache._layer_done(module.layer_idx)

    handles = [
        module.register_forward_hook(hook, with_kwargs=True)
        for name, module in model.named_modules()
        if name.endswith("self_attn") and isinstance(getattr(module, "layer_idx", None), int)
    ]
    model._kvtier_feedback_handles = handles
    return handles


def _refuse_padding_with_drops(model: torch.nn.Module) -> None:
    """Registers (once per model) a forward pre-hook that refuses a padded batch served by a
    :class:`TieredCache` whose ladder drops blocks: the mask of the keys left after a drop
    spans them at shifted positions, where a padding token could be taken for a real one."""
    if getattr(model, "_kvtier_padding_hook", None) is not None:
        return

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache, mask = kwargs.get("past_key_values"), kwargs.get("attention_mask")
        if (
            isinstance(cache, TieredCache)
            and cache.drops
            and isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and not bool(mask.all())
        ):
            raise InvalidArgumentError(
                "attention_mask: this batch is padded, and the TieredCache's ladder drops "
                "blocks ('drop' level), which supports unpadded batches only; run rows of "
                "different lengths in separate caches, or use a ladder without 'drop'"
            )

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    model._kvtier_padding_hook = handle  # type: ignore[assignment]


# -- attention over the blocks ---------------------------------------------------------------------

#: What the last ``TieredCache.update`` in attend mode handed to attention, per thread:
#: ``(cache, layer, keys)``. It belongs to the forward of the attention module that made it:
#: every such forward starts by clearing it (:func:`_scope_pending`), so an update made outside
#: a forward (a direct ``cache.update``), or in one that raised before its attention, reaches no
#: later attention.
_PENDING = threading.local()


def _clear_pending(module: Any, args: Any) -> None:
    _PENDING.value = None


def _scope_pending(module: torch.nn.Module) -> None:
    """Registers (once per module) a forward pre-hook that clears the pending entry."""
    if getattr(module, "_kvtier_pending_hook", None) is None:
        module._kvtier_pending_hook = module.register_forward_pre_hook(_clear_pending)  # type: ignore[assignment]


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``attn_implementation="kvtier"``: over a
    :class:`TieredCache`'s blocks (:meth:`BlockManager.attend`) when ``key`` is what that
    cache's ``update`` just returned, else sdpa (over gathered K/V when the batch is padded or
    dropout is on; over ``key``/``value`` as given for any other cache)."""
    pending = getattr(_PENDING, "value", None)
    _PENDING.value = None
    # From its next forward on, this module clears what an earlier update left (a TieredCache
    # built on the model did so already).
    _scope_pending(module)
    layer = getattr(module, "layer_idx", None)
    if pending is None or pending[1] != layer:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cache, _, keys = pending
    if keys is not key:
        raise InvalidArgumentError(
            f"layer {layer}: the keys reaching attention are not those the TieredCache returned "
            "(the model transforms them between the cache and attention), so attention over "
            "the blocks cannot serve it; use TieredCache(attend=False) with sdpa or eager"
        )
    if attention_mask is None and not dropout:
        out = cache._attend(layer, query, scaling), None
    else:
        k, v = cache._gathered(layer)
        out = sdpa_attention_forward(
            module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cache._layer_done(layer)
    return out


def _kvtier_mask(**kwargs: Any) -> torch.Tensor | None:
    """The mask for ``"kvtier"``: none for a causal batch without padding (the kernels mask
    causally by position), else sdpa's."""
    padding = kwargs.get("attention_mask")
    causal = kwargs.get("mask_function") is causal_mask_function
    if causal and (padding is None or bool(padding.all())):
        return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(ATTENTION, kvtier_attention)
AttentionMaskInterface.register(ATTENTION, _kvtier_mask)
