"""BlockManager's write paths mixed across the layers of one sequence: encoded whole blocks
(``append_blocks(encode=True)``, which a connector's save uses and which places blocks below
level 0), plain whole blocks, and token appends (whole or in chunks), in any order. Whatever a
layer's path and whatever the other layers' paths did, each layer either reads back what its
block's level holds (level 0 exactly, a lower level as its codec reproduces the block) or the
call is refused before anything changes; and no call ever changes another sequence's bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvtier import BlockManager, InvalidArgumentError, KvtierConfig  # noqa: E402

LAYERS, HEADS, DIM, BS, BLOCKS = 3, 2, 32, 16, 5
#: Ladders of every built-in codec family below a level 0 of each float dtype.
LADDERS = [
    ("fp16", "int8"),
    ("bf16", "int8", "int4"),
    ("fp32", "int4"),
    ("bf16", "int2-rot"),
    ("fp16", "int4-rot", "int2"),
]
MODES = ("encoded", "blocks", "tokens", "chunks")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def as_blocks(x: Any) -> Any:
    """One layer's ``[2, tokens, heads, dim]`` as ``append_blocks`` takes it."""
    return x.reshape(2, BLOCKS, BS, HEADS, DIM).permute(1, 0, 3, 2, 4).contiguous()


def writes(bm: BlockManager, seq: int, layer: int, x: Any, mode: str, chunk: int) -> Any:
    """The calls that write layer ``layer`` of ``seq`` (K/V ``x``: ``[2, tokens, heads, dim]``)
    by ``mode``, one at a time, each from where the layer stands."""
    if mode in ("encoded", "blocks"):
        yield lambda: bm.append_blocks(seq, layer, as_blocks(x), encode=mode == "encoded")
        return
    step = len(x[0]) if mode == "tokens" else chunk
    while (at := bm.num_tokens(seq, layer)) < len(x[0]):
        yield lambda: bm.append(seq, layer, x[0, at : at + step], x[1, at : at + step])


def everything(bm: BlockManager, seqs: list[int]) -> list[Any]:
    """What a user can read of ``seqs``: every layer's gathered blocks."""
    return [bm.gather_blocks(s, layer).clone() for s in seqs for layer in range(LAYERS)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ladder=st.sampled_from(LADDERS),
    modes=st.lists(st.sampled_from(MODES), min_size=LAYERS, max_size=LAYERS),
    chunk=st.sampled_from([1, 7, 16, 40]),
    seed=st.integers(0, 2**16),
)
def test_any_mix_of_write_paths_reads_back_its_levels_and_leaves_other_sequences_alone(
    ladder: tuple[str, ...], modes: list[str], chunk: int, seed: int
) -> None:
    dtype = DTYPES[ladder[0]]
    config = KvtierConfig(
        block_size=BS, recent_window=BS, sink_blocks=1, ladder=ladder, device_blocks=32
    )
    bm = BlockManager(config, LAYERS, HEADS, DIM, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    other = bm.add_sequence()
    y = torch.randn(LAYERS, 2, BLOCKS * BS, HEADS, DIM, generator=g).to(dtype)
    for layer in range(LAYERS):
        bm.append_blocks(other, layer, as_blocks(y[layer]))
    others = everything(bm, [other])
    seq = bm.add_sequence(np.arange(BLOCKS * BS))
    x = torch.randn(LAYERS, 2, BLOCKS * BS, HEADS, DIM, generator=g).to(dtype)
    for layer, mode in enumerate(modes):
        for call in writes(bm, seq, layer, x[layer], mode, chunk):
            pools = {key: pool.view(torch.uint8).clone() for key, pool in bm.pools.items()}
            try:
                call()
            except InvalidArgumentError as exc:
                # Only a token append into part of a block placed below level 0 is refused.
                assert mode == "chunks", exc  # noqa: PT017 - the refusal is the subject
                assert "placed below level 0" in str(exc)  # noqa: PT017
                assert all(
                    torch.equal(pools[key], pool.view(torch.uint8))
                    for key, pool in bm.pools.items()
                )
                break
        for call in writes(bm, seq, layer, x[layer], "tokens", chunk):  # the rest, whole
            call()
        assert bm.num_tokens(seq, layer) == BLOCKS * BS
        got_others = everything(bm, [other])
        assert all(torch.equal(a, b) for a, b in zip(others, got_others, strict=True)), (
            layer,
            mode,
        )
    levels = bm.core.block_info(bm.core.sequence_blocks(seq))["level"]
    for layer in range(LAYERS):
        got = bm.gather_blocks(seq, layer)
        want = as_blocks(x[layer])
        for i, level in enumerate(levels.tolist()):
            codec = bm.codecs[level]
            block = want[i : i + 1, None]  # a one-layer block: that layer's bytes
            expect = block[:, 0] if level == 0 else codec.decode(codec.encode(block))[:, 0]
            assert torch.equal(got[i : i + 1], expect), (layer, i, level, modes)


def test_the_reported_mix_reads_back_and_leaves_the_other_sequence_alone() -> None:
    """The case that corrupted another sequence: layer 0 encoded (blocks 1-2 placed at int8,
    the chain's ends at fp16), layers 1 and 2 plain; the plain path wrote level-0 slots at the
    int8 pool's slot numbers."""
    config = KvtierConfig(
        block_size=BS, recent_window=BS, sink_blocks=1, ladder="fp16,int8", device_blocks=32
    )
    bm = BlockManager(config, LAYERS, HEADS, DIM, torch.float16, "cpu")
    other = bm.add_sequence()
    y = torch.randn(BLOCKS, 2, HEADS, BS, DIM).half()
    for layer in range(LAYERS):
        bm.append_blocks(other, layer, y)
    seq = bm.add_sequence(list(range(BLOCKS * BS)))
    x = torch.randn(LAYERS, BLOCKS, 2, HEADS, BS, DIM).half()
    bm.append_blocks(seq, 0, x[0], encode=True)
    assert bm.core.block_info(bm.core.sequence_blocks(seq))["level"].tolist() == [0, 1, 1, 0, 0]
    bm.append_blocks(seq, 1, x[1])
    k, v = x[2].permute(1, 0, 3, 2, 4).reshape(2, BLOCKS * BS, HEADS, DIM)
    bm.append(seq, 2, k, v)
    for layer in range(LAYERS):
        assert torch.equal(bm.gather_blocks(other, layer), y)
        got = bm.gather_blocks(seq, layer)
        assert torch.equal(got[0], x[layer, 0]) and torch.equal(got[3:], x[layer, 3:])
        int8 = bm.codecs[1]
        want = int8.decode(int8.encode(x[layer, 1:3, None]))[:, 0]
        assert torch.equal(got[1:3], want)
    seq2 = bm.add_sequence(list(range(1000, 1000 + BLOCKS * BS)))
    bm.append_blocks(seq2, 0, x[0], encode=True)
    bm.append(seq2, 1, k[:7], v[:7])  # the sink's part, then part of an int8 block:
    with pytest.raises(InvalidArgumentError, match="placed below level 0"):
        bm.append(seq2, 1, k[7:20], v[7:20])


def test_a_tensor_on_neither_the_cpu_nor_cuda_is_refused_by_name() -> None:
    """A meta tensor (no data) raised torch's NotImplementedError from an encoded append."""
    config = KvtierConfig(block_size=BS, ladder="fp16,int8", device_blocks=8)
    bm = BlockManager(config, LAYERS, HEADS, DIM, torch.float16, "cpu")
    seq = bm.add_sequence(list(range(BS)))
    meta = torch.empty(1, 2, HEADS, BS, DIM, dtype=torch.float16, device="meta")
    for encode in (True, False):
        with pytest.raises(InvalidArgumentError, match="on meta"):
            bm.append_blocks(seq, 0, meta, encode=encode)
    k = torch.empty(BS, HEADS, DIM, dtype=torch.float16, device="meta")
    with pytest.raises(InvalidArgumentError, match="on meta"):
        bm.append(seq, 0, k, k)
    assert bm.num_tokens(seq, 0) == 0
