"""The CPU attention kernel (crates/kvtier-attend through kvtier.attend.attend_cpu) against the
torch reference of the contract (kvtier.attend.reference): every codec and mix of levels, blocks
of one sequence spread over several pools (a staging pool read at its own layer among them),
skipped blocks, odd lengths, one query and chunked-prefill queries, several sequences of
different lengths in one call, GQA ratios 1 to 8, head sizes 64/80/128/256, blocks of 16 and 32
tokens, one thread and rayon's pool.

The problems are tests/attend_problems.py's, as the CUDA kernel's tests build them (pools built
by each codec's own ``encode``); int2 runs wherever int4 does (``attend_problems.PACKED``).

Tolerances, against the reference computed in fp32 from the same dequantized values: the output within 1e-5 absolute plus 1e-5 relative
for fp32 queries (fp32 accumulation in another order, the kernel's exp within 2 ulp of torch's),
5e-3 for fp16 and 2e-2 for bf16 (their rounding of the output, about 2 units in the last place:
the kernel's and torch's fp32 results round to neighbours); the mass, a probability, within 2e-6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attend_problems import PACKED, assert_matches, packed, problem  # noqa: E402

from kvtier.attend import PoolView, attend_cpu, reference  # noqa: E402
from kvtier.codecs import Codec, Int2Codec, Int4Codec, Int8Codec  # noqa: E402
from kvtier.errors import InvalidArgumentError  # noqa: E402

TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 2e-2}
MASS_TOLERANCE = 2e-6


def _check(threads: Sequence[int] = (1,), **kw: Any) -> None:
    """Runs the kernel (with each number of ``threads``) and the reference on one random problem
    of :func:`attend_problems.problem` (``kw``: its options) and compares them."""
    args = problem(**kw)
    q, lens, block_pool = args[0], args[1], args[2]
    want, want_mass = reference(*args)
    tol = TOLERANCE[kw.get("q_dtype", "fp32")]
    for n in threads:
        out = torch.full_like(q, float("nan"))
        mass = torch.full(block_pool.shape, float("nan"))
        attend_cpu(q, out, mass, *args[1:], threads=n)
        assert_matches(out, mass, want, want_mass, tol=tol, mass_tol=MASS_TOLERANCE)
        # each sequence's masses sum to 1 where a query saw anything
        assert np.all(mass.sum(1).numpy() <= 1 + 1e-5)
    assert len(lens) == q.shape[0]


CUSTOM = [
    Int4Codec(group_size=None, name="int4-ghead"),
    Int8Codec(group_size=32, name="int8-g32"),
    Int8Codec(asymmetric=True, group_size=8, name="int8-asym-g8"),
    Int4Codec(group_size=16, key_per_channel=False, asymmetric=False, name="int4-sym-g16"),
]
# int2 as int4 above, and keys per token with one group a token (the zero point's q-sum path)
# and groups of 2, the smallest a codec takes
CUSTOM_INT2 = [
    Int2Codec(group_size=None, name="int2-ghead"),
    Int2Codec(group_size=16, key_per_channel=False, asymmetric=False, name="int2-sym-g16"),
    Int2Codec(group_size=None, key_per_channel=False, name="int2-asym-ktok-ghead"),
    Int2Codec(group_size=2, key_per_channel=False, name="int2-asym-ktok-g2"),
]
MIXES: dict[str, tuple[str, list[str | Codec]]] = {
    "fp32": ("fp32", ["fp32"]),
    "fp16": ("fp16", ["fp16"]),
    "bf16": ("bf16", ["bf16"]),
    "int8": ("fp32", ["int8"]),
    "int4": ("fp16", ["int4"]),
    "int2": ("fp16", ["int2"]),
    "int2-g64": ("fp32", ["int2-g64"]),
    **{c.name: ("fp32", [c]) for c in CUSTOM + CUSTOM_INT2},
    "ladder": ("fp16", ["fp16", "int8", "int4"]),
    "int2-ladder": ("fp16", ["fp16", "int8", "int4", "int2"]),
    "bf16-ladder": ("bf16", ["bf16", "int8", "int4", CUSTOM[3]]),
    "bf16-int2-ladder": ("bf16", ["bf16", "int8", "int2", CUSTOM_INT2[1]]),
    "fp32-everything": (
        "fp32",
        ["fp32", "fp16", "bf16", "int8", "int4", "int2", *CUSTOM, *CUSTOM_INT2],
    ),
    # rotated codecs, read in place: the queries rotated, the values summed apart and turned
    # back once (with plain ones in the same call, and the aggressive ladder's levels)
    "int2-rot": ("fp32", ["int2-rot"]),
    "int4-rot": ("fp16", ["int4-rot"]),
    "2bit-ladder": ("fp16", ["fp16", "int2-rot", "int2-rot-g64"]),
    "rotated-and-plain": ("bf16", ["bf16", "int8", "int4-rot", "int2", "int2-rot-g64"]),
    "rotated-custom": (
        "fp32",
        [
            Int2Codec(
                group_size=None, key_per_channel=False, rotate=True, name="int2-rot-ktok-ghead"
            )
        ],
    ),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("queries", [1, 5])
def test_every_codec_and_mix_of_levels_matches_the_reference(mix: str, queries: int) -> None:
    q_dtype, codecs = MIXES[mix]
    _check(codecs=codecs, q_dtype=q_dtype, queries=queries, staging=True, threads=(1, 2))


@pytest.mark.parametrize("low", PACKED)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 32), (128, 32), (256, 16)])
def test_gqa_ratios_head_sizes_and_block_sizes_match_the_reference(
    low: str, group: int, head_dim: int, block_size: int
) -> None:
    _check(
        codecs=["fp32", "int8", packed(low, head_dim)],
        q_heads=2 * group,
        head_dim=head_dim,
        block_size=block_size,
        queries=2,
        lengths=(3 * block_size + 5, 9),
        seed=group * head_dim + block_size,
    )


@pytest.mark.parametrize("low", ["int2-rot"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32), (256, 16)])
def test_rotated_blocks_at_gqa_ratios_head_sizes_and_block_sizes_match_the_reference(
    low: str, group: int, head_dim: int, block_size: int
) -> None:
    """A rotated codec needs a power-of-two head_dim (its Hadamard rotation): 80 is refused
    when the codec is made (test_codecs.py)."""
    _check(
        codecs=["fp32", "int8", low],
        q_heads=2 * group,
        head_dim=head_dim,
        block_size=block_size,
        queries=2,
        lengths=(3 * block_size + 5, 9),
        seed=group * head_dim + block_size,
    )


@pytest.mark.parametrize("low", [*PACKED, "int2-rot"])
@pytest.mark.parametrize("queries", [1, 2, 16, 33])
def test_many_sequences_of_odd_lengths_and_chunked_prefill(low: str, queries: int) -> None:
    lengths = (33, 1 + queries, 70, 256, 17 + queries)
    _check(codecs=["fp16", "int8", low], q_dtype="fp16", queries=queries, lengths=lengths)


@pytest.mark.parametrize("low", [*PACKED, "int2-rot"])
def test_long_sequences_split_over_the_pool_match_the_reference(low: str) -> None:
    # large enough to leave the calling thread, with sequences cut into runs of blocks
    _check(
        codecs=["fp32", "int8", low],
        q_heads=16,
        head_dim=128,
        lengths=(1500, 700),
        threads=(0, 2),
    )


def test_skipped_blocks_get_no_mass_and_a_query_that_sees_nothing_gets_zeros() -> None:
    args = list(problem(codecs=["int8"], queries=3, lengths=(40, 20)))
    block_pool = args[2]
    block_pool[1, :2] = -1  # sequence 1 holds 2 blocks: both skipped
    block_pool[0, 1] = -1
    q = args[0]
    out = torch.full_like(q, float("nan"))
    mass = torch.full(block_pool.shape, float("nan"))
    attend_cpu(q, out, mass, *args[1:])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert float(mass[1].abs().sum()) == 0.0 and float(mass[0, 1]) == 0.0
    assert abs(float(mass[0].sum()) - 1.0) < 1e-5
    want, want_mass = reference(*args)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=MASS_TOLERANCE, rtol=0)


@pytest.mark.parametrize("low", PACKED)
def test_masses_may_be_numpy_and_tables_flat_or_int64(low: str) -> None:
    args = problem(codecs=["fp16", low], lengths=(50, 90))
    q, lens, block_pool, block_slot = args[:4]
    want, want_mass = reference(*args)
    out = torch.empty_like(q)
    mass = np.empty(block_pool.shape, dtype=np.float32)
    attend_cpu(q, out, mass, lens.astype(np.int64), block_pool.ravel(), block_slot, *args[4:])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(mass, want_mass.numpy(), atol=MASS_TOLERANCE, rtol=0)
    # the unchecked path takes what a caller that checked already holds
    out2 = torch.empty_like(q)
    attend_cpu(q, out2, mass, *args[1:], checked=False)
    assert torch.equal(out, out2)


def test_bad_arguments_raise_invalid_argument_before_anything_is_read() -> None:
    args = problem(codecs=["fp32", "int8"], lengths=(40, 20))
    q, lens, block_pool, block_slot, pools, shape, layer, scale = args
    out = torch.empty_like(q)
    mass = torch.empty(block_pool.shape)

    def call(**change: Any) -> None:
        kw = {
            "q": q,
            "out": out,
            "mass": mass,
            "seq_lens": lens,
            "block_pool": block_pool,
            "block_slot": block_slot,
            "pools": pools,
            "shape": shape,
            "layer": layer,
            "scale": scale,
        }
        kw.update(change)
        attend_cpu(**kw)

    slot_past = block_slot.copy()
    slot_past[0, 0] = 24
    int8_first = block_pool.copy()
    int8_first[0, 0] = 1
    with pytest.raises(InvalidArgumentError, match="slot"):
        call(block_pool=int8_first, block_slot=slot_past)
    no_such_pool = block_pool.copy()
    no_such_pool[0, 0] = 2
    with pytest.raises(InvalidArgumentError, match="block_pool"):
        call(block_pool=no_such_pool)
    with pytest.raises(InvalidArgumentError, match="seq_lens"):
        call(seq_lens=np.array([40, 10_000], np.int32))
    with pytest.raises(InvalidArgumentError, match="q"):
        call(q=q[..., :32].contiguous(), out=out[..., :32].contiguous())
    with pytest.raises(InvalidArgumentError, match="out"):
        call(out=torch.empty_like(q, dtype=torch.float16))
    with pytest.raises(InvalidArgumentError, match="out"):
        call(out=torch.empty(q.shape[:-1]))
    with pytest.raises(InvalidArgumentError, match="mass"):
        call(mass=torch.empty(2, 3))
    with pytest.raises(InvalidArgumentError, match="pools"):
        call(pools=[PoolView(pools[0].tensor.transpose(1, 2), pools[0].codec), pools[1]])
    with pytest.raises(InvalidArgumentError, match="pools"):
        call(pools=[pools[0], PoolView(pools[1].tensor[:, :-1], pools[1].codec)])
    with pytest.raises(InvalidArgumentError, match="scale"):
        call(scale=float("nan"))
    with pytest.raises(InvalidArgumentError, match="query heads"):
        call(q=q[:, :, :3].contiguous(), out=out[:, :, :3].contiguous())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_query_is_refused_not_answered_with_zeros(bad: float) -> None:
    """The kernel's softmax drops a NaN score, so a NaN query would come back as a row of
    zeros with zero mass (SDPA gives NaN): the kernel and the reference refuse it instead, the
    Rust kernel itself too (unchecked, as the manager calls it), in every query dtype."""
    args = problem(codecs=["fp32", "int8"], lengths=(40, 20))
    q = args[0].clone()
    q[1, 0, 1, 5] = bad
    for checked in (True, False):
        out, mass = torch.zeros_like(q), torch.full(args[2].shape, -1.0)
        with pytest.raises(InvalidArgumentError, match="q: expected finite values, got NaN or"):
            attend_cpu(q, out, mass, *args[1:], checked=checked)
        assert not out.any() and (mass == -1).all(), "nothing written"
    for dtype in (torch.float16, torch.bfloat16):
        half = q.to(dtype)
        out = torch.zeros_like(half)
        with pytest.raises(InvalidArgumentError, match="q: expected finite values"):
            attend_cpu(half, out, mass, *args[1:], checked=False)
        assert not out.any()
    with pytest.raises(InvalidArgumentError, match="q: expected finite values"):
        reference(q, *args[1:])


def test_the_binding_checks_what_it_is_given() -> None:
    """``_core.attend`` itself refuses a slot past its pool, a layer past its pool and a
    descriptor that lies, whatever the Python checks did."""
    from kvtier import _core
    from kvtier.attend import describe

    args = problem(codecs=["int8"], lengths=(40,), skip=0)
    q, lens, block_pool, block_slot, pools, shape, layer, scale = args
    out = torch.empty_like(q)
    mass = np.empty(block_pool.shape, np.float32)
    desc = describe(pools, shape)

    def call(
        desc: Any = desc, slots: Any = block_slot, layer: int = layer, mass: Any = mass
    ) -> None:
        S, Q, Hq, D = q.shape
        _core.attend(
            q.data_ptr(), 0, out.data_ptr(), mass, lens, block_pool, slots, desc,
            S, Q, Hq, shape.kv_heads, shape.block_size, D, block_pool.shape[1], layer, scale, 1,
        )  # fmt: skip

    call()
    by_address = np.full_like(mass, np.nan)
    call(mass=by_address.ctypes.data)  # the masses by address: the same figures
    np.testing.assert_array_equal(by_address, mass)
    wide = np.empty((1, block_pool.shape[1] + 1), np.float32)
    for bad, message in [
        (wide, rf"mass: expected {mass.size} float32s \(\[1, {mass.size}\]\), got {wide.size}"),
        (mass.astype(np.float64), "mass: expected a writable numpy array of float32"),
        (np.empty((3, 2), np.float32).T, "mass: expected a C-contiguous"),
        ("mass", "mass: expected a writable numpy array of float32 or an address, got str"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            call(mass=bad)
    readonly = mass.copy()
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="mass: expected a writable"):
        call(mass=readonly)
    past = block_slot.copy()
    past[0, 0] = 24
    with pytest.raises(InvalidArgumentError, match="slot 24 out of range"):
        call(slots=past)
    with pytest.raises(InvalidArgumentError, match="layer 2 out of range"):
        call(layer=2)
    lying = desc.copy()
    lying[0, 5] -= 1  # rows a byte shorter than the codec's sections
    with pytest.raises(InvalidArgumentError, match="pool 0"):
        call(desc=lying)
    with pytest.raises(InvalidArgumentError, match="pools"):
        call(desc=desc[:, :8].copy())
