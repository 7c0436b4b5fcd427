"""``kv_connector_extra_config`` → the connector's KvtierConfig, without an engine."""

from __future__ import annotations

import pytest

from kvtier import ConfigError

pytestmark = pytest.mark.vllm
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
        # the connector's own default: level 0 stages a step's saves, the bottom level holds
        ({}, {}, (0.08, 0.08, 0.84)),
        ({"ladder": "bf16,int8,int4"}, {}, (0.08, 0.08, 0.84)),
        ({"ladder": "bf16,int4"}, {}, (0.08, 0.92)),
        # given shares are kept, from the extra config or the environment
        ({"pool_shares": "0.5,0.2,0.3"}, {}, (0.5, 0.2, 0.3)),
        ({}, {"KVTIER_POOL_SHARES": "0.4,0.3,0.3"}, (0.4, 0.3, 0.3)),
        # one level, or compression off: nothing to split
        ({"ladder": "bf16"}, {}, None),
        ({"enable_compression": False}, {}, None),
        ({}, {"VLLM_ENABLE_KV_COMPRESSION": "0"}, None),
    ],
)
def test_pool_shares_put_most_of_the_host_budget_at_the_bottom_level_unless_given(
    extra: dict[str, object], environ: dict[str, str], shares: tuple[float, ...] | None
) -> None:
    assert connector_config(extra, block_size=32, environ=environ).pool_shares == shares


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"block_size": 16}, "block_size is set by vLLM's block size"),
        ({"device_budget": "1GiB"}, "device_budget is set by vLLM's own KV pool"),
        ({"pool_shares": "a,b"}, "pool_shares: expected comma-separated fractions"),
        ({"no_such_field": 1}, "unknown config field"),
        ({"ladder": "bf16,int4,drop"}, "a 'drop' level has no meaning there"),
    ],
)
def test_bad_keys_and_values_are_refused_clearly(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        connector_config(extra, block_size=32, environ={})


def test_the_connector_ranks_by_recency_unless_told_otherwise() -> None:
    """Under importance, evicting a cached block by magnitude strands the rest of its prefix:
    the connector's own default is lru; a policy named in the extra config or KVTIER_POLICY
    stands."""
    assert connector_config({}, block_size=32, environ={}).policy == "lru"
    named = connector_config({"policy": "importance"}, block_size=32, environ={})
    assert named.policy == "importance"
    from_env = connector_config({}, block_size=32, environ={"KVTIER_POLICY": "h2o"})
    assert from_env.policy == "h2o"
