"""``kv_connector_extra_config`` → the connector's KvtierConfig, without an engine."""

from __future__ import annotations

import pytest

from kvtier import ConfigError

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
vllm_integration = pytest.importorskip("kvtier.integrations.vllm", exc_type=ImportError)
connector_config = vllm_integration.connector_config


def test_values_read_as_json_or_as_their_kvtier_variables_would() -> None:
    cfg = connector_config(
        {
            "host_budget": "64MiB",
            "ladder": "bf16,int8,int4",
            "pool_shares": "0.5,0.05,0.45",
            "weights": [0.5, 0.5, 0.0],
            "enable_compression": "true",
            "compression_ratio": 0.3,
            "remote_url": "redis://127.0.0.1:1",
        },
        block_size=32,
        environ={},
    )
    # The host budget is the manager's device tier: the manager lives in host memory.
    assert cfg.device_budget == 64 << 20 and cfg.host_budget is None
    assert cfg.ladder == ("bf16", "int8", "int4") and cfg.pool_shares == (0.5, 0.05, 0.45)
    assert cfg.weights == (0.5, 0.5, 0.0) and cfg.enable_compression is True
    assert cfg.block_size == 32
    assert cfg.share_prefixes and cfg.remote_budget == 4 * (64 << 20)


def test_defaults_and_the_original_variables() -> None:
    cfg = connector_config({}, block_size=128, environ={"VLLM_KV_COMPRESSION_RATIO": "0.25"})
    assert cfg.device_budget == 2 << 30 and cfg.compression_ratio == 0.25
    assert not cfg.share_prefixes and cfg.remote_budget is None


@pytest.mark.parametrize(
    ("extra", "environ", "shares"),
    [
        # the connector's own default is sized by the worker (staging_shares)
        ({}, {}, None),
        ({"ladder": "bf16,int4"}, {}, None),
        # given shares are kept, from the extra config or the environment
        ({"pool_shares": "0.5,0.2,0.3"}, {}, (0.5, 0.2, 0.3)),
        ({}, {"KVTIER_POOL_SHARES": "0.4,0.3,0.3"}, (0.4, 0.3, 0.3)),
    ],
)
def test_pool_shares_stand_where_given(
    extra: dict[str, object], environ: dict[str, str], shares: tuple[float, ...] | None
) -> None:
    assert connector_config(extra, block_size=32, environ=environ).pool_shares == shares


@pytest.mark.parametrize(
    ("host_budget", "stage_blocks", "slots"),
    [
        # two steps' blocks at level 0, one step's at int8, the rest of the budget at int4
        ("1GiB", 8, {0: 16, 1: 8}),
        # a budget of 32 bf16 blocks: a quarter of it stages at most (level 0 twice over: a
        # stage takes at most an eighth), one stage at least
        (32, 8, {0: 6, 1: 3}),
        # 16 blocks: level 0 twice over would take more than an eighth
        (16, 8, {0: 2, 1: 2}),
        (16, 1, {0: 1, 1: 1}),
        (2, 8, {0: 1, 1: 1}),
    ],
)
def test_staging_levels_hold_one_steps_saves_and_the_bottom_level_the_rest(
    host_budget: str | int, stage_blocks: int, slots: dict[int, int]
) -> None:
    """The manager built from the shares has ``stage_blocks`` slots (bounded) at each middle
    level and twice as many at level 0 (a step's saves land beside the step before's, which
    move down meanwhile) where that costs the bottom level little, and the bottom level takes
    every byte they leave (here without the chains' ends, which add rooms of their own: see
    the next test)."""
    from kvtier import BlockManager
    from kvtier.codecs.base import BlockShape

    shape = BlockShape(2, 2, 32, 64, "bf16")
    bf16_block = 2 * 2 * 2 * 32 * 64 * 2
    budget = host_budget if isinstance(host_budget, str) else host_budget * bf16_block
    extra = {"host_budget": str(budget), "sink_blocks": 0, "keep_leaves": 0}
    cfg = connector_config(extra, block_size=32, environ={})
    shares = vllm_integration.staging_shares(cfg, shape, stage_blocks)
    assert len(shares) == 3 and abs(sum(shares) - 1.0) < 1e-9
    bm = BlockManager(cfg.replace(pool_shares=shares), 2, 2, 64, dtype="bf16", device="cpu")
    assert {lv: bm.slots["device", lv] for lv in (0, 1)} == slots
    staged = sum(bm.level_bytes[lv] * n for lv, n in slots.items())
    assert bm.slots["device", 2] == (cfg.device_budget - staged) // bm.level_bytes[2]


@pytest.mark.parametrize(
    ("extra", "ends"),
    [
        ({"ladder": "bf16,int8,int4"}, 2),  # int4 is the bottom: no room above it
        ({"ladder": "bf16,int4,int2-rot-g64"}, 1),
        ({"ladder": "bf16,int4,int2-rot-g64", "keep_leaves": 2}, 1),
        ({"ladder": "bf16,int2-rot,int2-rot-g64"}, 0),  # nothing between of 4 bits or more
        ({"ladder": "bf16,int8,int4", "ends_level": 0}, 0),
        ({"ladder": "bf16,int4"}, 1),
    ],
)
def test_the_chains_ends_have_a_room_where_they_settle(extra: dict[str, object], ends: int) -> None:
    """The cached chains' ends (sinks, last blocks) settle at the deepest level of at least 4
    bits a value (a quarter of bf16's bytes), or at ``ends_level``, where the core puts them;
    above the bottom, that level keeps a room for them beside the staging slots: SINK_SHARE of
    the budget, and LEAF_SHARE for each of the ``keep_leaves`` last blocks. The connector's
    cached blocks settle (``settle_cached``) unless told otherwise."""
    from kvtier import BlockManager
    from kvtier.codecs.base import BlockShape

    shape = BlockShape(2, 2, 32, 64, "bf16")
    cfg = connector_config({"host_budget": "1GiB", **extra}, block_size=32, environ={})
    assert cfg.settle_cached and cfg.sink_blocks == 1
    bare = cfg.replace(sink_blocks=0, keep_leaves=0)
    shares = vllm_integration.staging_shares(cfg, shape, 8)
    staging = vllm_integration.staging_shares(bare, shape, 8)
    rooms = [a - b for a, b in zip(shares[:-1], staging[:-1], strict=True)]
    room = vllm_integration.SINK_SHARE + vllm_integration.LEAF_SHARE * cfg.keep_leaves
    want = [room if level == ends else 0.0 for level in range(len(rooms))]
    assert rooms == pytest.approx(want)
    assert shares[-1] == pytest.approx(1.0 - sum(shares[:-1]))
    bm = BlockManager(cfg.replace(pool_shares=shares), 2, 2, 64, dtype="bf16", device="cpu")
    assert bm.core.ends_level == vllm_integration.ends_level_of(cfg, bm.level_bytes) == ends
    assert not connector_config({"settle_cached": False}, block_size=32, environ={}).settle_cached
    off = connector_config({}, block_size=32, environ={"KVTIER_SETTLE_CACHED": "0"})
    assert not off.settle_cached


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"block_size": 16}, "block_size is set by vLLM's block size"),
        ({"device_budget": "1GiB"}, "device_budget is set by vLLM's own KV pool"),
        ({"pool_shares": "a,b"}, "pool_shares: expected comma-separated fractions"),
        ({"no_such_field": 1}, "unknown config field"),
        ({"ladder": "bf16,int4,drop"}, "a 'drop' level has no meaning there"),
        ({"ladder": "bf16,int3"}, r"kv_connector_extra_config: ladder: unknown codec 'int3'"),
    ],
)
def test_bad_keys_and_values_are_refused_clearly(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        connector_config(extra, block_size=32, environ={})


def test_the_connector_ranks_by_importance_unless_told_otherwise() -> None:
    """Eviction takes leaves of the prefix trees, ranked by reuse (importance ranks levels):
    the connector's default is the library's, importance; a policy named in the extra config
    or KVTIER_POLICY stands."""
    assert connector_config({}, block_size=32, environ={}).policy == "importance"
    named = connector_config({"policy": "lru"}, block_size=32, environ={})
    assert named.policy == "lru"
    from_env = connector_config({}, block_size=32, environ={"KVTIER_POLICY": "h2o"})
    assert from_env.policy == "h2o"
