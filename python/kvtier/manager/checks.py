"""Argument checks of the manager's calls: K/V, queries, layers, sequence ids, token ids, scales.

Each check raises :class:`InvalidArgumentError` naming the argument and what was expected, or
returns the argument in the form the manager works with. They hold no state and run before a
call changes anything, so a call that raises leaves the manager as it was. K/V that is not
finite (NaN or inf) is refused here too: it would reach attention as garbage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import block_key_norms
from .._torch import all_finite, as_tensor, torch_module
from ..codecs.base import BlockShape
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_kv",
    "check_layer",
    "check_query",
    "hash_array",
    "key_norms",
    "sequence_ids",
    "softmax_scale",
    "token_array",
]

_F32_MAX = float(np.finfo(np.float32).max)


def check_layer(layer: Any, layers: int) -> int:
    """``layer`` as an int in ``[0, layers)``."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise InvalidArgumentError(f"layer: expected an int, got {type(layer).__name__}")
    if not 0 <= layer < layers:
        raise InvalidArgumentError(f"layer: expected 0 <= layer < {layers}, got {layer}")
    return int(layer)


def check_kv(x: Any, what: str, shape: BlockShape, dtype: Any, device: Any) -> torch.Tensor:
    """``x`` (K or V, named ``what``) as a tensor ``[num_tokens, kv_heads, head_dim]`` of
    ``dtype`` on ``device``."""
    t = as_tensor(x, what)
    want = (shape.kv_heads, shape.head_dim)
    if t.dim() != 3 or tuple(t.shape[1:]) != want:
        raise InvalidArgumentError(
            f"{what}: expected shape [num_tokens, {want[0]} kv_heads, {want[1]} head_dim], "
            f"got {list(t.shape)}"
        )
    _check_dtype_device(t, what, dtype, device)
    return t


def _check_dtype_device(t: torch.Tensor, what: str, dtype: Any, device: Any) -> None:
    """Refuses K/V (named ``what``) not of the manager's model ``dtype`` or not on its
    ``device``."""
    if t.dtype != dtype:
        raise InvalidArgumentError(
            f"{what}: expected dtype {dtype} (the model dtype of this manager), got {t.dtype}"
        )
    if t.device != device:
        raise InvalidArgumentError(f"{what}: expected a tensor on {device}, got one on {t.device}")


def check_blocks(x: Any, shape: BlockShape, dtype: Any, device: Any) -> torch.Tensor:
    """``x`` as whole blocks of one layer, ``[num_blocks, 2, kv_heads, block_size, head_dim]``
    of ``dtype`` on ``device``, contiguous (a copy if it was not)."""
    t = as_tensor(x, "blocks")
    want = (2, shape.kv_heads, shape.block_size, shape.head_dim)
    if t.dim() != 5 or tuple(t.shape[1:]) != want:
        raise InvalidArgumentError(
            f"blocks: expected shape [num_blocks, 2, {want[1]} kv_heads, {want[2]} block_size, "
            f"{want[3]} head_dim] (K then V), got {list(t.shape)}"
        )
    _check_dtype_device(t, "blocks", dtype, device)
    return t.contiguous()


def refusal(what: str, limit: float = math.inf, part: str = "") -> InvalidArgumentError:
    """The error for K/V ``what`` (its ``part``, `` in K`` say) holding a NaN, an infinity or,
    under a finite ``limit`` (the most the manager's ladder holds), a larger value."""
    if math.isinf(limit):
        return InvalidArgumentError(
            f"{what}: expected finite values, got NaN or inf{part}; nothing was stored"
        )
    return InvalidArgumentError(
        f"{what}: expected finite values of magnitude at most {limit:.7g} (the most this "
        f"manager's ladder holds), got NaN, inf or a larger value{part}; nothing was stored"
    )


def block_key_norms_of(
    blocks: torch.Tensor, dtype_code: int, limit: float = math.inf
) -> np.ndarray:
    """Per token of ``blocks`` (checked by :func:`check_blocks`), block by block, the mean over
    heads of its key's norm, once K and V are known to be finite and within ``limit`` (see
    :func:`key_norms`): in the extension, one pass, on the CPU; elsewhere :func:`key_norms`
    of the blocks' tokens."""
    if blocks.device.type != "cpu":
        return key_norms(blocks[:, 0].transpose(1, 2), blocks[:, 1], limit).reshape(-1)
    n, _, h, bs, d = blocks.shape
    norms, bad = block_key_norms(blocks.data_ptr(), n, (h, bs, d), dtype_code, limit)
    if bad:
        raise refusal("blocks", limit, f" in {'KV'[bad - 1]}")
    return norms


def check_query(
    q: torch.Tensor, single: bool, sequences: int, shape: BlockShape, dtype: Any, device: Any
) -> tuple[int, ...]:
    """The ``[sequences, queries, q_heads, head_dim]`` dims of attend's ``q``: one sequence
    takes ``[queries, q_heads, head_dim]`` too. Its values are checked by the kernels (NaN and
    inf are refused)."""
    D = shape.head_dim
    # One sequence takes [Q, Hq, D] (or [1, Q, Hq, D]); the kernels read either alike.
    dims = tuple(q.shape) if q.dim() == 4 or not single else (1, *q.shape)
    if len(dims) != 4 or dims[0] != sequences or dims[3] != D:
        raise InvalidArgumentError(
            f"q: expected [queries, q_heads, {D}] for one sequence or [{sequences} sequences, "
            f"queries, q_heads, {D}], got {list(q.shape)}"
        )
    if dims[2] % shape.kv_heads:
        raise InvalidArgumentError(
            f"q: {dims[2]} query heads is not a multiple of the {shape.kv_heads} K/V heads"
        )
    if q.dtype is not dtype or q.device != device:
        raise InvalidArgumentError(f"q: expected {dtype} on {device}, got {q.dtype} on {q.device}")
    return dims


def key_norms(k: torch.Tensor, v: torch.Tensor, limit: float = math.inf) -> np.ndarray:
    """Per token, the mean over heads of its key's norm (the magnitude signal), once K and V
    are known to be finite: NaN or inf would reach attention as garbage (one NaN key poisons
    the softmax of every query that sees it), so either is refused before anything is stored,
    as are values past a finite ``limit`` (the most the ladder's codecs hold: they would come
    back clamped). K's finite check rides on its norms; only a non-finite norm looks at K."""
    torch = torch_module()
    norms = k.float().norm(dim=-1).mean(dim=-1)
    if not math.isinf(limit) and k.numel():
        # K's and V's extremes refuse NaN, inf and larger values alike, fetched with the norms
        top = torch.stack((k.amax(), -k.amin(), v.amax(), -v.amin())).float()
        both = torch.cat((norms, top)).cpu().numpy()
        for name, pair in (("k", both[-4:-2]), ("v", both[-2:])):
            if not (pair <= limit).all():  # NaN compares false
                raise refusal(name, limit)
        return both[:-4]
    norms = norms.cpu().numpy()
    if not np.isfinite(norms).all():
        if not all_finite(k):
            raise refusal("k")
        norms = np.minimum(np.nan_to_num(norms, posinf=_F32_MAX), _F32_MAX)  # fp32 overflow
    if not all_finite(v):
        raise refusal("v")
    return norms


def sequence_ids(seqs: Any) -> tuple[bool, tuple[int, ...]]:
    """``(single, ids)`` of attend's ``seqs``: one sequence id, or a sequence of them."""
    if type(seqs) is list and all(type(s) is int for s in seqs):  # a decode step's, at once
        return False, tuple(seqs)
    if isinstance(seqs, (int, np.integer)) and not isinstance(seqs, bool):
        return True, (int(seqs),)
    if (
        isinstance(seqs, (str, bytes))
        or not hasattr(seqs, "__iter__")
        or (hasattr(seqs, "dim") and seqs.dim() == 0)
    ):
        raise InvalidArgumentError(
            f"seqs: expected a sequence id or a list of them, got {type(seqs).__name__} {seqs!r}"
        )
    ids = []
    for s in seqs:
        if hasattr(s, "item") and getattr(s, "ndim", 0) == 0:  # a numpy or torch scalar
            s = s.item()
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise InvalidArgumentError(
                f"seqs: expected integer sequence ids, got {type(s).__name__} {s!r} in {seqs!r}"
            )
        ids.append(int(s))
    return False, tuple(ids)


def softmax_scale(scale: Any) -> float:
    """attend's ``scale`` (not None) as a finite float."""
    number = isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(
        scale, bool
    )
    if number and math.isfinite(scale):
        return float(scale)
    raise InvalidArgumentError(f"scale: expected a finite number or None, got {scale!r}")


def hash_array(block_hashes: Any) -> np.ndarray:
    """Block hashes (a list or numpy array of nonzero 64-bit ints) as a uint64 numpy array."""
    arr = np.asarray(block_hashes)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(
            f"block_hashes: expected a 1-D sequence of integer hashes, got {arr.dtype} "
            f"{list(arr.shape)}"
        )
    if arr.dtype != np.uint64 and (arr.min() < 0 or arr.max() > np.iinfo(np.uint64).max):
        raise InvalidArgumentError("block_hashes: expected hashes in [1, 2**64)")
    hashes = arr.astype(np.uint64)
    if not hashes.all():
        raise InvalidArgumentError("block_hashes: 0 is no block's hash (it means none)")
    return hashes


def token_array(token_ids: Any) -> np.ndarray:
    """Token ids (a list, numpy or torch) as a uint32 numpy array."""
    arr = np.asarray(token_ids.cpu() if hasattr(token_ids, "cpu") else token_ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgumentError(
            f"token_ids: expected a 1-D sequence of integer token ids, got {arr.dtype} "
            f"{list(arr.shape)}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint32).max):
        raise InvalidArgumentError("token_ids: expected ids in [0, 2**32)")
    return arr.astype(np.uint32)
