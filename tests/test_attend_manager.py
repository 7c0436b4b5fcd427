"""``BlockManager.attend``: attention over a manager's blocks wherever the scheduler put them,
and the one-token append that feeds it. The oracle is torch's SDPA over ``gather``'s K/V: the
same decoded values, so the two agree to the rounding of fp32 sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_manager import BS, DIM, HEADS, LAYERS, SPILL, a_file_on_disk, kv, manager, spill  # noqa: E402

from kvtier import BlockManager  # noqa: E402
from kvtier._core import Plan  # noqa: E402
from kvtier.errors import BlockLostError, InvalidArgumentError  # noqa: E402
from kvtier.manager import BlockLedger  # noqa: E402

Q_HEADS = 4 * HEADS  # grouped-query attention, 4 query heads per K/V head


def sdpa(bm: BlockManager, seq: int, layer: int, q: Any) -> Any:
    """The oracle: SDPA (fp32) over the gathered K/V, causal for the last ``len(q)`` tokens."""
    k, v = (x.float().transpose(0, 1) for x in bm.gather(seq, layer))
    n, queries = k.shape[1], q.shape[0]
    visible = torch.ones(queries, n, dtype=torch.bool, device=k.device).tril(n - queries)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=visible, enable_gqa=True
    )
    return out.transpose(0, 1)


def queries(n: int, seed: int, dtype: Any = torch.float16) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, Q_HEADS, DIM, generator=g).to(dtype)


def assert_attends_like_sdpa(bm: BlockManager, seq: int, q: Any) -> None:
    for layer in range(LAYERS):
        got = bm.attend(seq, layer, q)
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.float(), sdpa(bm, seq, layer, q), atol=2e-3, rtol=2e-3)


def decode(bm: BlockManager, seq: int, x: Any, start: int, stop: int) -> None:
    """Appends tokens ``[start, stop)`` of ``x`` one at a time (the decode path), a step each."""
    for t in range(start, stop):
        for layer in range(LAYERS):
            bm.append(seq, layer, x[layer, 0, t : t + 1], x[layer, 1, t : t + 1])
        bm.step()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_attend_over_every_level_equals_sdpa_over_the_gathered_kv(dtype: Any) -> None:
    bm = manager(dtype=dtype, recent_window=16)
    seq = bm.add_sequence()
    x = kv(6 * BS + 5, seed=1, dtype=dtype)
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0, : 5 * BS], x[layer, 1, : 5 * BS])
    bm.step()
    decode(bm, seq, x, 5 * BS, 6 * BS + 5)
    levels = bm.core.block_info(bm.core.sequence_blocks(seq))["level"]
    assert {0, 1, 2} <= set(levels.tolist()), "blocks at every level of the ladder"
    assert_attends_like_sdpa(bm, seq, queries(1, 2, dtype))
    assert_attends_like_sdpa(bm, seq, queries(7, 3, dtype))  # a chunk: causal over the prefix


@pytest.mark.parametrize("ladder", ["fp16,int4,int2", "fp16,int4,int2-rot"])
def test_int2_and_rotated_int2_blocks_are_read_in_place_and_equal_sdpa(ladder: str) -> None:
    """int2 codes are read where they lie, rotated ones too (on the CPU: the kernel rotates the
    queries and turns the rotated values' sum back, rather than each block)."""
    bm = manager(ladder=ladder, recent_window=16)
    seq = bm.add_sequence()
    x = kv(6 * BS + 5, seed=4)
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0], x[layer, 1])
    bm.step()
    assert 2 in bm.core.block_info(bm.core.sequence_blocks(seq))["level"]
    assert bm.attention_tables.lut[0, 2] == 2
    assert_attends_like_sdpa(bm, seq, queries(3, 6))


def ragged(bm: BlockManager, seed: int) -> list[int]:
    """Three sequences of 3 blocks and a token, part of a block and 5 blocks, every layer."""
    seqs = []
    for i, n in enumerate((3 * BS + 1, BS - 3, 5 * BS)):
        seq = bm.add_sequence()
        x = kv(n, seed=seed + i)
        for layer in range(LAYERS):
            bm.append(seq, layer, x[layer, 0], x[layer, 1])
        seqs.append(seq)
    return seqs


def test_a_batch_of_sequences_of_different_lengths_in_one_call() -> None:
    bm = manager(recent_window=16)
    seqs = ragged(bm, seed=10)
    bm.step()
    q = torch.stack([queries(2, 20 + i) for i in range(3)])  # [3 sequences, 2 queries, ...]
    out, mass = bm.attend(seqs, 1, q, return_mass=True)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(out[i].float(), sdpa(bm, seq, 1, q[i]), atol=2e-3, rtol=2e-3)
        blocks = -(-bm.num_tokens(seq) // BS)
        assert mass[i, :blocks].sum() == pytest.approx(1.0, abs=1e-5)
        assert not mass[i, blocks:].any()


def test_blocks_on_the_host_and_on_disk_are_read_without_a_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host blocks (CPU memory) are read in place; disk blocks are staged, one layer. Neither
    goes through a gather (refused while attend runs; the oracle gathers afterwards)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("gather called: attend should read the blocks where they lie")

    for tier in ({"host_budget": 4 << 20}, {"disk_budget": 4 << 20, "disk_path": str(tmp_path)}):
        bm = manager(**SPILL, **tier)
        seqs = spill(bm)
        name = "host" if "host_budget" in tier else "disk"
        away = Plan.TIERS.index(name)
        seq = next(
            s
            for s in seqs
            if (bm.core.block_info(bm.core.sequence_blocks(s))["tier"] == away).any()
        )
        q = queries(1, 5)
        with monkeypatch.context() as m:
            m.setattr(BlockManager, "gather", refuse)
            m.setattr(BlockManager, "gather_blocks", refuse)
            got = [bm.attend(seq, layer, q) for layer in range(LAYERS)]
        for layer in range(LAYERS):
            want = sdpa(bm, seq, layer, q)
            torch.testing.assert_close(got[layer].float(), want, atol=2e-3, rtol=2e-3)
        bm.close()


def test_a_block_lost_from_disk_is_refused_never_attended(tmp_path: Path) -> None:
    bm = manager(**SPILL, disk_budget=4 << 20, disk_path=str(tmp_path))
    seqs = spill(bm)
    a_file_on_disk(bm, seqs).write_bytes(b"garbage")
    lost = 0
    for seq in seqs:
        try:
            bm.attend(seq, 0, queries(1, 6))
        except BlockLostError:
            lost += 1
            with pytest.raises(BlockLostError):  # and every time after
                bm.attend(seq, 1, queries(1, 6))
    assert lost == 1
    bm.close()


def test_an_empty_batch_attends_to_an_empty_output() -> None:
    bm = manager()
    q = torch.empty(0, 1, Q_HEADS, DIM, dtype=torch.float16)
    out, mass = bm.attend([], 0, q, return_mass=True)
    assert out.shape == q.shape and out.dtype == q.dtype and mass.shape == (0, 0)


def test_decode_steps_layer_by_layer_attend_like_sdpa_as_blocks_move() -> None:
    """As a model decodes: each layer appends its token, then attends, and a scheduler step
    after every token moves blocks down the ladder. The layers of one step share one table of
    where the blocks lie (built by the first); every call still equals sdpa over the gathered
    K/V, through the new block a token opens and the moves a step makes (read again after
    them at the same lengths)."""
    bm = manager(recent_window=16)
    seq = bm.add_sequence()
    x = kv(3 * BS + 2, seed=31)
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0, : 2 * BS - 2], x[layer, 1, : 2 * BS - 2])
    bm.step()
    levels_seen = set()
    for t in range(2 * BS - 2, 3 * BS + 2):  # crosses into a new block
        for layer in range(LAYERS):
            bm.append(seq, layer, x[layer, 0, t : t + 1], x[layer, 1, t : t + 1])
            q = queries(1, t * LAYERS + layer)
            got = bm.attend([seq], layer, q[None])[0]
            torch.testing.assert_close(got.float(), sdpa(bm, seq, layer, q), atol=2e-3, rtol=2e-3)
        bm.step()
        levels_seen |= set(bm.core.block_info(bm.core.sequence_blocks(seq))["level"].tolist())
        # the same lengths after the step's moves: read where the blocks lie now
        q = queries(1, t)
        for layer in range(LAYERS):
            got = bm.attend([seq], layer, q[None])[0]
            torch.testing.assert_close(got.float(), sdpa(bm, seq, layer, q), atol=2e-3, rtol=2e-3)
    assert levels_seen > {0}, "the steps moved blocks below level 0"


def test_a_batchs_masses_reach_the_scheduler_as_each_sequences_own() -> None:
    """A batch of sequences of different lengths in one call records each block's mass as
    calls one sequence at a time record it: the scores of a twin manager match."""

    def filled() -> tuple[BlockManager, list[int]]:
        bm = manager(policy="h2o", recent_window=16)
        return bm, ragged(bm, seed=40)

    (batched, seqs), (one_by_one, _) = filled(), filled()
    q = torch.stack([queries(1, 50 + i) for i in range(3)])
    for layer in range(LAYERS):
        batched.attend(seqs, layer, q)
        for i, seq in enumerate(seqs):
            one_by_one.attend(seq, layer, q[i])
    blocks = np.concatenate([batched.core.sequence_blocks(s) for s in seqs])
    got = batched.core.block_info(blocks)["score"]
    np.testing.assert_allclose(got, one_by_one.core.block_info(blocks)["score"], rtol=1e-6)
    assert got.all(), "every block was attended"


def test_the_attention_mass_feeds_the_scheduler() -> None:
    """Under h2o, blocks are ranked by the attention they received: queries that look at one
    block make it the heaviest hitter, with no attention weights handed in."""
    bm = manager(policy="h2o", recent_window=16)
    seq = bm.add_sequence()
    x = kv(4 * BS, seed=7)
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0], x[layer, 1])
    q = x[1, 0, 2 * BS + 3].repeat_interleave(4, 0)[None] * 8  # the key of a token of block 2
    _, mass = bm.attend(seq, 1, q, return_mass=True)
    assert mass[0].argmax() == 2
    scores = bm.core.block_info(bm.core.sequence_blocks(seq))["score"]
    assert scores.argmax() == 2 and scores[2] > 0
    # record=False leaves the signal alone
    bm2 = manager(policy="h2o", recent_window=16)
    seq2 = bm2.add_sequence()
    for layer in range(LAYERS):
        bm2.append(seq2, layer, x[layer, 0], x[layer, 1])
    bm2.attend(seq2, 1, q, record=False)
    assert not bm2.core.block_info(bm2.core.sequence_blocks(seq2))["score"].any()


def test_a_shared_block_its_owner_has_not_written_is_refused() -> None:
    bm = manager()
    tokens = np.arange(2 * BS)
    owner = bm.add_sequence(tokens)
    x = kv(2 * BS, seed=8)
    for layer in range(LAYERS):
        bm.append(owner, layer, x[layer, 0], x[layer, 1])
    reader = bm.add_sequence(tokens)  # shares both blocks
    assert bm.num_tokens(reader) == 2 * BS
    torch.testing.assert_close(
        bm.attend(reader, 2, queries(1, 9)), bm.attend(owner, 2, queries(1, 9))
    )
    late = bm.add_sequence()
    with pytest.raises(InvalidArgumentError, match="append the queries' K/V first"):
        bm.attend(late, 0, queries(1, 9))


def test_bad_queries_get_clear_errors_and_change_nothing() -> None:
    bm = manager()
    seq = bm.add_sequence()
    x = kv(20, seed=9)
    for layer in range(LAYERS):
        bm.append(seq, layer, x[layer, 0], x[layer, 1])
    cases = [
        (queries(1, 1, torch.float32), "expected torch.float16"),
        (torch.zeros(1, Q_HEADS, DIM + 1, dtype=torch.float16), "q: expected"),
        (torch.zeros(1, HEADS + 1, DIM, dtype=torch.float16), "not a multiple"),
        (queries(21, 1), "append the queries' K/V first"),
    ]
    for q, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            bm.attend(seq, 0, q)
    with pytest.raises(InvalidArgumentError, match="layer"):
        bm.attend(seq, LAYERS, queries(1, 1))
    assert bm.num_tokens(seq) == 20


def test_non_finite_queries_are_refused_and_record_nothing() -> None:
    """One NaN (or inf) in a query would reach the kernels as a row of zeros with zero mass,
    which looks like an answer and teaches the scheduler that its blocks are unread: refused,
    for one sequence and in a batch, before any mass is recorded (the scores a step computes
    equal those of a twin manager that was never asked)."""

    def two_sequences() -> tuple[BlockManager, list[int]]:
        bm = manager()
        seqs = [bm.add_sequence() for _ in range(2)]
        x = kv(3 * BS, seed=9)
        for seq in seqs:
            for layer in range(LAYERS):
                bm.append(seq, layer, x[layer, 0], x[layer, 1])
        return bm, seqs

    def scores(bm: BlockManager, seqs: list[int]) -> Any:
        bm.step()
        blocks = np.concatenate([bm.core.sequence_blocks(s) for s in seqs])
        return bm.core.block_info(blocks)["score"]

    (bm, seqs), (twin, _) = two_sequences(), two_sequences()
    for bad in (float("nan"), float("inf"), float("-inf")):
        one = queries(1, 1)
        one[0, 1, 3] = bad
        batch = torch.stack([queries(1, 2), one])
        for ids, q in ((seqs[0], one), (seqs, batch)):
            with pytest.raises(InvalidArgumentError, match="q: expected finite values"):
                bm.attend(ids, 0, q)
    np.testing.assert_array_equal(scores(bm, seqs), scores(twin, seqs))
    bm.attend(seqs, 0, torch.stack([queries(1, 2), queries(1, 3)]))  # good ones still record
    assert not np.array_equal(scores(bm, seqs), scores(twin, seqs))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"q": queries(1, 1).to("meta")}, "q: expected torch.float16 on cpu, got .* on meta"),
        ({"scale": "x"}, "scale: expected a finite number or None, got 'x'"),
        ({"scale": float("nan")}, "scale: expected a finite number or None, got nan"),
        ({"seqs": torch.tensor(0)}, "seqs: expected a sequence id or a list of them, got Tensor"),
        ({"seqs": "abc"}, "seqs: expected a sequence id or a list of them, got str 'abc'"),
        ({"seqs": [0.5]}, "seqs: expected integer sequence ids, got float 0.5"),
    ],
)
def test_attend_argument_errors_name_the_argument(arguments: dict, message: str) -> None:
    bm = manager()
    seq = bm.add_sequence()
    x = kv(BS, seed=9)
    bm.append(seq, 0, x[0, 0], x[0, 1])
    call = {"seqs": seq, "q": queries(1, 1), **arguments}
    with pytest.raises(InvalidArgumentError, match=message):
        bm.attend(call.pop("seqs"), 0, call.pop("q"), **call)


def test_one_token_appends_store_what_bulk_appends_store() -> None:
    """The decode path (one token, the extension's write) against one bulk append, for every
    dtype, with strided views as transformers hands them; NaN is refused, nothing stored."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        bulk, single = manager(dtype=dtype), manager(dtype=dtype)
        x = kv(2 * BS + 3, seed=11, dtype=dtype)
        a, b = bulk.add_sequence(), single.add_sequence()
        for layer in range(LAYERS):
            bulk.append(a, layer, x[layer, 0], x[layer, 1])
        strided = x.transpose(2, 3).contiguous().transpose(2, 3)  # heads-major, as HF's K/V
        for t in range(x.shape[2]):
            for layer in range(LAYERS):
                single.append(b, layer, strided[layer, 0, t : t + 1], strided[layer, 1, t : t + 1])
        for layer in range(LAYERS):
            for got, want in zip(single.gather(b, layer), bulk.gather(a, layer), strict=True):
                assert torch.equal(got, want)
        # the magnitude signal: the same mean key norm per block, however the tokens came
        norms = [m.ledger.magnitude(m.core.sequence_blocks(q)) for m, q in ((single, b), (bulk, a))]
        np.testing.assert_allclose(norms[0], norms[1], rtol=1e-5)
        bad = x[0, 0, :1].clone()
        bad[0, 0, 0] = float("nan")
        for k, v, which in ((bad, x[0, 1, :1], "k"), (x[0, 0, :1], bad, "v")):
            with pytest.raises(InvalidArgumentError, match=f"{which}: expected finite values"):
                single.append(b, 0, k, v)
        assert single.num_tokens(b, 0) == x.shape[2]
        assert single.core.sequence_tokens(b) == x.shape[2], "a refused append changes nothing"


def test_decode_appends_take_the_fast_path_for_transformers_views(monkeypatch) -> None:
    """transformers hands a decode step's K and V as views whose one-element token axis has
    different strides: the one-token path still takes them (the general path would cost ~20x),
    falling back only where a new block starts."""
    bm = manager(dtype=torch.float32)
    seq = bm.add_sequence()
    general = []  # (blocks, offsets) of each write the general path books
    original = BlockLedger.wrote
    monkeypatch.setattr(
        BlockLedger, "wrote", lambda self, *a: general.append(a[::2]) or original(self, *a)
    )
    x = kv(2 * BS, seed=12, dtype=torch.float32)
    for t in range(2 * BS):
        for layer in range(LAYERS):
            k = x[layer, 0, t : t + 1].clone()  # strides (H*D, D, 1)
            v = torch.empty(HEADS * DIM).as_strided((1, HEADS, DIM), (7, DIM, 1))
            v.copy_(x[layer, 1, t : t + 1])  # strides (7, D, 1): another token stride
            bm.append(seq, layer, k, v)
    order = bm.core.sequence_blocks(seq).tolist()
    starts = {order.index(int(blocks[0])) * BS + int(offsets[0]) for blocks, offsets in general}
    assert sorted(starts) == [0, BS], "the general path only where a block starts"
    k, v = bm.gather(seq, 1)
    assert torch.equal(k, x[1, 0]) and torch.equal(v, x[1, 1])


@pytest.mark.gpu
def test_attend_on_cuda_equals_sdpa_over_the_gathered_kv() -> None:
    """The CUDA kernel through the manager: every level, a batch, a chunk (not yet run on a
    GPU in this project's CI machines)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    bm = manager("cuda", recent_window=16)
    seqs = []
    for i, n in enumerate((5 * BS + 3, 2 * BS)):
        seq = bm.add_sequence()
        x = kv(n, seed=30 + i, device="cuda")
        for layer in range(LAYERS):
            bm.append(seq, layer, x[layer, 0], x[layer, 1])
        seqs.append(seq)
    bm.step()
    levels = bm.core.block_info(bm.core.sequence_blocks(seqs[0]))["level"]
    assert {0, 1, 2} <= set(levels.tolist())
    for seq in seqs:
        q = queries(3, 31).cuda()
        for layer in range(LAYERS):
            got = bm.attend(seq, layer, q)
            want = sdpa(bm, seq, layer, q)
            torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    q = torch.stack([queries(1, 32), queries(1, 33)]).cuda()
    out, mass = bm.attend(seqs, 1, q, return_mass=True)
    assert out.shape == q.shape and np.allclose(mass.sum(1), 1.0, atol=1e-4)
