"""The torch reference of the attention call (:mod:`kvtier.attend.call`), the oracle both
kernels must match: every block dequantized to fp32, then softmax in fp32, on any device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._torch import torch_module
from ..codecs.base import BlockShape
from ..codecs.identity import IdentityCodec
from .call import AttentionCall, PoolView

if TYPE_CHECKING:
    import torch


def _block_values(pool: PoolView, shape: BlockShape, layer: int, slots: Any) -> torch.Tensor:
    """``[n, 2, Hkv, B, D]`` fp32 of one layer of ``slots`` of ``pool``."""
    torch = torch_module()
    at = layer if pool.layer_override < 0 else pool.layer_override
    idx = torch.as_tensor(slots, dtype=torch.int64, device=pool.tensor.device)
    if isinstance(pool.codec, IdentityCodec):
        return pool.tensor[:, at].index_select(0, idx).float()
    return pool.codec.decode_layer(pool.tensor, shape, at, slots=idx, dtype=torch.float32)


def run(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, mass)`` of ``call`` (checked here) by the plain method: every block decoded to
    fp32, then softmax in fp32. ``out`` is in ``q``'s dtype on its device, ``mass`` fp32
    ``[S, M]`` on the CPU."""
    torch = torch_module()
    p = call.check()
    q, seq_lens, block_pool, block_slot = call.q, call.seq_lens, call.block_pool, call.block_slot
    S, Q, Hq, D, B, M = p.seqs, p.queries, p.q_heads, p.head_dim, p.block_size, p.max_blocks
    group = Hq // p.kv_heads
    out = torch.zeros((S, Q, Hq, D), dtype=q.dtype, device=q.device)
    mass = torch.zeros((S, M), dtype=torch.float32)
    for s in range(S):
        n = int(seq_lens[s])
        m = -(-n // B)
        kv = torch.zeros((m, 2, p.kv_heads, B, D), dtype=torch.float32, device=q.device)
        keep = torch.ones(m * B, dtype=torch.bool, device=q.device)
        for i, pool in enumerate(call.pools):
            rows = np.nonzero(block_pool[s, :m] == i)[0]
            if len(rows):
                values = _block_values(pool, call.shape, call.layer, block_slot[s, rows])
                kv[torch.as_tensor(rows, device=q.device)] = values.to(q.device)
        for j in np.nonzero(block_pool[s, :m] == -1)[0]:
            keep[j * B : (j + 1) * B] = False
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(p.kv_heads, m * B, D)[:, :n]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(p.kv_heads, m * B, D)[:, :n]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        scores = torch.einsum("qhd,hnd->hqn", q[s].float(), k) * call.scale
        pos = torch.arange(n, device=q.device)
        visible = (pos[None, :] <= (n - Q + torch.arange(Q, device=q.device))[:, None]) & keep[
            None, :n
        ]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a query that sees nothing: zeros
        out[s] = torch.einsum("hqn,hnd->qhd", probs, v).to(q.dtype)
        per_token = probs.mean((0, 1)).cpu()
        padded = torch.zeros(m * B)
        padded[:n] = per_token
        mass[s, :m] = padded.view(m, B).sum(1)
    return out, mass


def reference(
    q: torch.Tensor,
    seq_lens: np.ndarray,
    block_pool: np.ndarray,
    block_slot: np.ndarray,
    pools: Sequence[PoolView],
    shape: BlockShape,
    layer: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, mass)`` by the plain method: every block decoded to fp32, then softmax in fp32.
    ``out`` is in ``q``'s dtype on its device, ``mass`` fp32 ``[S, M]`` on the CPU
    (:func:`run` of these arguments as an :class:`~kvtier.attend.call.AttentionCall`)."""
    return run(AttentionCall(q, seq_lens, block_pool, block_slot, pools, shape, layer, scale))
