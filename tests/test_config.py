"""KvtierConfig: precedence of arguments and environment, parsing, validation, the configuration page."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from pathlib import Path

import pytest

from kvtier.config import (
    CONFIGURATION_PAGE_COMMAND,
    ENV_VARS,
    POLICIES,
    KvtierConfig,
    configuration_page,
    parse_bytes,
)
from kvtier.errors import ConfigError

CONFIGURATION_PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

ALIASED = [
    # field, KVTIER_* var, VLLM_* alias, (alias text, value), (KVTIER text, value), explicit value
    (
        "compression_ratio",
        "KVTIER_COMPRESSION_RATIO",
        "VLLM_KV_COMPRESSION_RATIO",
        ("0.3", 0.3),
        ("0.7", 0.7),
        0.9,
    ),
    ("levels", "KVTIER_LEVELS", "VLLM_KV_COMPRESSION_LEVELS", ("1", 1), ("2", 2), 3),
    (
        "enable_compression",
        "KVTIER_ENABLE_COMPRESSION",
        "VLLM_ENABLE_KV_COMPRESSION",
        ("0", False),
        ("1", True),
        False,
    ),
]

pytestmark = pytest.mark.usefixtures("no_kvtier_env")


def test_defaults_are_the_documented_ones() -> None:
    cfg = KvtierConfig.from_env()
    assert cfg == KvtierConfig()
    assert (cfg.enable_compression, cfg.compression_ratio, cfg.levels) == (True, 0.5, 3)
    assert cfg.ladder is None
    assert cfg.policy == "importance"
    assert (cfg.block_size, cfg.recent_window, cfg.sink_blocks) == (16, 128, 1)
    assert cfg.weights == (0.4, 0.4, 0.2)
    assert cfg.device_budget is cfg.host_budget is cfg.disk_budget is cfg.remote_budget is None
    assert cfg.max_move_bytes is None
    assert (cfg.headroom, cfg.hysteresis, cfg.decay, cfg.attention_ema) == (0.1, 0.1, 0.9, 0.5)
    assert cfg.scissorhands_window == 8
    assert (cfg.write_through, cfg.evict_on_full) == (False, True)
    assert cfg.namespace == "default"
    assert (cfg.remote_timeout, cfg.remote_ttl) == (1.0, None)


def test_core_arguments_carry_every_knob_of_the_core_a_config_holds() -> None:
    """``KvtierConfig.core_arguments`` is the one place a config becomes ``Core``'s arguments
    (the manager's, the simulator's, the reference model's): every config field that is also a
    keyword of ``Core`` goes in, with its value; overrides win; the core takes the result."""
    import kvtier

    keywords = set(inspect.signature(kvtier.Core).parameters) - {"level_bytes"}
    shared = {f.name for f in dataclasses.fields(KvtierConfig)} & keywords
    cfg = KvtierConfig(
        policy="h2o", block_size=8, recent_window=7, namespace="x", prefix_aware=False
    )
    args = cfg.core_arguments([("device", 4096)], evict_on_full=False, pool_headroom=True)
    assert set(args) == shared | {"tiers", "pool_headroom"} and set(args) <= keywords
    assert all(args[name] == getattr(cfg, name) for name in shared - {"evict_on_full"})
    assert (args["tiers"], args["evict_on_full"]) == ([("device", 4096)], False)
    core = kvtier.Core([64, 32], **args)
    assert (core.policy, core.block_size, core.prefix_aware) == ("h2o", 8, False)
    assert (core.tiers, core.evict_on_full) == ([("device", 4096)], False)


@pytest.mark.parametrize(("field", "var", "alias", "from_alias", "from_var", "explicit"), ALIASED)
def test_precedence_explicit_then_kvtier_then_vllm_alias_then_default(
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    var: str,
    alias: str,
    from_alias: tuple[str, object],
    from_var: tuple[str, object],
    explicit: object,
) -> None:
    default = getattr(KvtierConfig(), field)
    assert from_alias[1] != default
    assert from_var[1] != from_alias[1]
    assert explicit != from_var[1]
    assert getattr(KvtierConfig.from_env(), field) == default

    monkeypatch.setenv(alias, from_alias[0])
    assert getattr(KvtierConfig.from_env(), field) == from_alias[1]

    monkeypatch.setenv(var, from_var[0])
    assert getattr(KvtierConfig.from_env(), field) == from_var[1]

    assert getattr(KvtierConfig.from_env(**{field: explicit}), field) == explicit


def test_constructor_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_POLICY", "lru")
    assert KvtierConfig().policy == "importance"
    assert KvtierConfig.from_env().policy == "lru"


def test_none_override_and_empty_variable_count_as_not_given() -> None:
    env = {"KVTIER_POLICY": "h2o", "KVTIER_BLOCK_SIZE": "  "}
    cfg = KvtierConfig.from_env(environ=env, policy=None, block_size=None)
    assert cfg.policy == "h2o"
    assert cfg.block_size == 16


@pytest.mark.parametrize(
    ("env", "explicit", "expected"),
    [
        ({"KVTIER_DEVICE_BLOCKS": "100"}, {"device_budget": 2**33}, (2**33, None, None, None)),
        ({"KVTIER_DEVICE_BUDGET": "8GiB"}, {"device_blocks": 50}, (None, 50, None, None)),
        ({"KVTIER_HOST_BLOCKS": "10"}, {"host_budget": 2**30}, (None, None, 2**30, None)),
        ({"KVTIER_HOST_BUDGET": "1GiB"}, {"host_blocks": 10}, (None, None, None, 10)),
    ],
)
def test_an_explicit_budget_outranks_the_variable_in_the_other_unit(
    env: dict[str, str], explicit: dict[str, int], expected: tuple[int | None, ...]
) -> None:
    cfg = KvtierConfig.from_env(environ=env, **explicit)
    assert (cfg.device_budget, cfg.device_blocks, cfg.host_budget, cfg.host_blocks) == expected


def test_environment_values_are_parsed_by_type() -> None:
    env = {
        "KVTIER_ENABLE_COMPRESSION": "off",
        "KVTIER_LADDER": "FP16, int8",
        "KVTIER_POLICY": " LFU ",
        "KVTIER_WEIGHTS": "1,0,0.5",
        "KVTIER_DEVICE_BUDGET": "8GiB",
        "KVTIER_HOST_BUDGET": "512MB",
        "KVTIER_DISK_BUDGET": "1e12",
        "KVTIER_MAX_MOVE_BYTES": "4096",
        "KVTIER_DECAY": "0.5",
        "KVTIER_WRITE_THROUGH": "yes",
        "KVTIER_NAMESPACE": "llama3/int8",
        "KVTIER_REMOTE_TTL": "3600",
    }
    cfg = KvtierConfig.from_env(environ=env)
    assert cfg.enable_compression is False
    assert cfg.ladder == ("fp16", "int8")
    assert cfg.levels == 2
    assert cfg.policy == "lfu"
    assert cfg.weights == (1.0, 0.0, 0.5)
    assert cfg.device_budget == 8 * 2**30
    assert cfg.host_budget == 512 * 10**6
    assert cfg.disk_budget == 10**12
    assert cfg.max_move_bytes == 4096
    assert cfg.decay == 0.5
    assert cfg.write_through is True
    assert cfg.namespace == "llama3/int8"
    assert cfg.remote_ttl == 3600.0


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"KVTIER_LEVELS": "three"}, ["KVTIER_LEVELS", "levels"]),
        ({"VLLM_KV_COMPRESSION_LEVELS": "three"}, ["VLLM_KV_COMPRESSION_LEVELS", "levels"]),
        ({"KVTIER_COMPRESSION_RATIO": "1.5"}, ["KVTIER_COMPRESSION_RATIO", "compression_ratio"]),
        ({"KVTIER_ENABLE_COMPRESSION": "maybe"}, ["KVTIER_ENABLE_COMPRESSION"]),
        ({"KVTIER_DEVICE_BUDGET": "8 gigs"}, ["KVTIER_DEVICE_BUDGET"]),
        ({"KVTIER_POLICY": "fifo"}, ["KVTIER_POLICY", "policy"]),
        ({"KVTIER_WEIGHTS": "1,2"}, ["KVTIER_WEIGHTS", "weights"]),
    ],
)
def test_bad_environment_value_names_the_variable(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierConfig.from_env(environ=env)
    for name in names:
        assert name in str(info.value)


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match="polcy"):
        KvtierConfig.from_env(polcy="lru")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("8 gib", 8 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5KiB", 1536),
        ("2TB", 2 * 10**12),
        ("3TiB", 3 * 2**40),
        ("64KB", 64_000),
        ("1e9", 10**9),
        ("4096", 4096),
        ("100B", 100),
        ("0", 0),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "8 GiBs", "8XB", "1.2.3", "1e999", "ten"])
def test_parse_bytes_rejects_with_the_expected_form(text: str) -> None:
    with pytest.raises(ConfigError, match="expected"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compression_ratio", 1.5),
        ("compression_ratio", -0.1),
        ("compression_ratio", float("nan")),
        ("levels", 0),
        ("levels", 4),  # more than 3 levels needs an explicit ladder
        ("ladder", ()),
        ("ladder", ("int8", "int4")),  # level 0 must be the model dtype
        ("ladder", ("fp16", "int8", "int8")),
        ("ladder", ("fp16", "bad name")),
        ("ladder", tuple(["fp16"] + [f"int{i}" for i in range(8)])),
        ("policy", "fifo"),
        ("block_size", 0),
        ("block_size", 16.0),
        ("recent_window", -1),
        ("sink_blocks", -1),
        ("weights", (0.0, 0.0, 0.0)),
        ("weights", (1.0, -1.0, 1.0)),
        ("weights", (1.0, 1.0)),
        ("device_budget", -1),
        ("host_budget", -5),
        ("disk_budget", 1.5),
        ("remote_budget", "8 gigs"),
        ("device_blocks", 0),
        ("host_blocks", "1e3"),
        ("host_blocks", 2.0),
        ("max_move_bytes", -1),
        ("headroom", 1.0),
        ("hysteresis", 2.0),
        ("decay", 0.0),
        ("attention_ema", 1.5),
        ("scissorhands_window", 0),
        ("enable_compression", "yes"),
        ("write_through", 2),
        ("namespace", ""),
        ("remote_tls_ca", "/no/such/ca.crt"),
        ("remote_ttl", 0),
        ("remote_ttl", float("inf")),
    ],
)
def test_each_invalid_value_is_a_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{field}:")
    assert "expected" in str(info.value)


BYTE_FIELDS = ["device_budget", "host_budget", "disk_budget", "remote_budget", "max_move_bytes"]


@pytest.mark.parametrize("field", BYTE_FIELDS)
@pytest.mark.parametrize(
    ("text", "expected"),
    [("16GiB", 16 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9), (" 4096 ", 4096)],
)
def test_every_byte_field_takes_the_sizes_its_variable_takes(
    field: str, text: str, expected: int
) -> None:
    """``KvtierConfig(host_budget="16GiB")`` and ``from_env(host_budget="16GiB")`` give what
    ``KVTIER_HOST_BUDGET=16GiB`` gives; an int is still bytes."""
    from_var = KvtierConfig.from_env(environ={f"KVTIER_{field.upper()}": text})
    assert getattr(from_var, field) == expected
    assert getattr(KvtierConfig(**{field: text}), field) == expected  # type: ignore[arg-type]
    assert getattr(KvtierConfig.from_env(environ={}, **{field: text}), field) == expected
    assert getattr(KvtierConfig(**{field: expected}), field) == expected


TIER_BUDGETS = ["device_budget", "host_budget", "disk_budget", "remote_budget"]


@pytest.mark.parametrize("field", TIER_BUDGETS)
@pytest.mark.parametrize("value", [0, "0", "0GiB", "0.1"])
def test_a_tier_budget_of_no_bytes_is_refused(field: str, value: object) -> None:
    """A tier of 0 bytes would be built and then refuse every block: the config says so (an
    unset budget is how a tier is left out; "0.1" rounds to 0 bytes)."""
    with pytest.raises(ConfigError) as info:
        KvtierConfig(**{field: value})  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{field}: expected a positive byte count (unset: no {field.split('_')[0]} tier), "
        f"got {value!r}"
    )
    var = f"KVTIER_{field.upper()}"
    with pytest.raises(ConfigError, match=rf"^{var}: {field}: expected a positive .*got 0$"):
        KvtierConfig.from_env(environ={var: str(value)})
    assert getattr(KvtierConfig(**{field: 1}), field) == 1


def test_max_move_bytes_of_zero_still_means_no_moves() -> None:
    assert KvtierConfig(max_move_bytes=0).max_move_bytes == 0


def test_the_readme_block_manager_config() -> None:
    cfg = KvtierConfig.from_env(environ={}, device_blocks=4096, host_budget="16GiB")
    assert (cfg.device_blocks, cfg.host_budget) == (4096, 16 * 2**30)


@pytest.mark.parametrize("field", ["device_blocks", "host_blocks"])
def test_a_block_budget_takes_an_int_or_its_variables_digits(field: str) -> None:
    assert getattr(KvtierConfig(**{field: 4096}), field) == 4096
    assert getattr(KvtierConfig(**{field: "4096"}), field) == 4096  # type: ignore[arg-type]
    from_var = KvtierConfig.from_env(environ={f"KVTIER_{field.upper()}": "4096"})
    assert getattr(from_var, field) == 4096


@pytest.mark.parametrize("field", BYTE_FIELDS)
def test_a_bad_size_string_names_the_field_and_the_form_expected(field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierConfig.from_env(environ={}, **{field: "16 gigs"})
    message = str(info.value)
    assert message.startswith(f"{field}: invalid size '16 gigs'")
    assert "expected a non-negative number with an optional unit" in message
    assert "'8GiB'" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device_budget", "1e30"),
        ("host_budget", 2**64),
        ("disk_budget", "16777216TiB"),  # 2**64 exactly
        ("remote_budget", str(2**64)),
        ("max_move_bytes", 10**30),
        ("device_blocks", 2**64),
        ("host_blocks", str(2**64)),
    ],
)
def test_a_count_beyond_u64_is_a_config_error_that_says_the_maximum(
    field: str, value: object
) -> None:
    # The core counts bytes and blocks in u64: beyond it, an OverflowError would surface later.
    with pytest.raises(ConfigError) as info:
        KvtierConfig(**{field: value})  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{field}:")
    assert "at most 18,446,744,073,709,551,615 (2**64 - 1" in str(info.value)


def test_the_largest_size_is_exact_and_allowed() -> None:
    top = 2**64 - 1
    assert parse_bytes(str(top)) == top  # not rounded through a float to 2**64
    assert KvtierConfig(device_budget=str(top)).device_budget == top  # type: ignore[arg-type]
    assert KvtierConfig(host_budget=top).host_budget == top
    assert KvtierConfig(device_blocks=top).device_blocks == top


def test_a_size_variable_beyond_u64_names_the_variable_and_the_maximum() -> None:
    with pytest.raises(ConfigError) as info:
        KvtierConfig.from_env(environ={"KVTIER_HOST_BUDGET": "1e30"})
    assert str(info.value).startswith("KVTIER_HOST_BUDGET (config field 'host_budget')")
    assert "at most 18,446,744,073,709,551,615" in str(info.value)


def test_ladder_wins_over_levels_and_names_are_normalised() -> None:
    cfg = KvtierConfig(levels=3, ladder=("Float16", "INT8"))
    assert cfg.ladder == ("fp16", "int8")
    assert cfg.levels == 2
    five = KvtierConfig(ladder=("bf16", "int8", "int4", "learned:mine", "drop"))
    assert five.levels == 5


@pytest.mark.parametrize(
    ("levels", "expected"),
    [(1, ("bf16",)), (2, ("bf16", "int8")), (3, ("bf16", "int8", "int4"))],
)
def test_resolved_ladder_from_levels(levels: int, expected: tuple[str, ...]) -> None:
    assert KvtierConfig(levels=levels).resolved_ladder("torch.bfloat16") == expected


def test_resolved_ladder_explicit_and_compression_off() -> None:
    cfg = KvtierConfig(ladder=("fp16", "int4"))
    assert cfg.resolved_ladder("fp16") == ("fp16", "int4")
    assert KvtierConfig(enable_compression=False).resolved_ladder("float32") == ("fp32",)
    with pytest.raises(ConfigError, match="dtype"):
        KvtierConfig().resolved_ladder("int8")


def test_config_is_frozen_and_replace_validates() -> None:
    cfg = KvtierConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "lru"  # type: ignore[misc]
    assert cfg.replace(policy="lru").policy == "lru"
    with pytest.raises(ConfigError, match="policy"):
        cfg.replace(policy="nope")


def test_every_field_has_one_variable_and_policies_are_listed() -> None:
    fields = [f.name for f in dataclasses.fields(KvtierConfig)]
    assert sorted(v.field for v in ENV_VARS) == sorted(fields)
    assert all(v.name == f"KVTIER_{v.field.upper()}" for v in ENV_VARS)
    policy_var = next(v for v in ENV_VARS if v.field == "policy")
    assert all(p in policy_var.help for p in POLICIES)


def _page_table_rows() -> list[list[str]]:
    text = CONFIGURATION_PAGE.read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        if re.match(r"^\|\s*`(KVTIER|VLLM)_", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_configuration_page_lists_exactly_the_config_variables() -> None:
    rows = _page_table_rows()
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == sorted(v.name for v in ENV_VARS)
    aliases = {row[0].strip("`"): row[1].strip("`") or None for row in rows}
    assert aliases == {v.name: v.alias for v in ENV_VARS}
    assert all(v.unit for v in ENV_VARS)


def test_configuration_page_is_the_generated_one() -> None:
    page = CONFIGURATION_PAGE.read_text(encoding="utf-8") if CONFIGURATION_PAGE.exists() else ""
    generated = configuration_page()
    if page != generated:
        diff = difflib.unified_diff(
            page.splitlines(),
            generated.splitlines(),
            "docs/configuration.md",
            "generated",
            n=1,
            lineterm="",
        )
        pytest.fail(
            "docs/configuration.md is not what kvtier.config.configuration_page() generates; "
            f"regenerate it with\n    {CONFIGURATION_PAGE_COMMAND}\n" + "\n".join(list(diff)[:60])
        )


def test_configuration_page_names_the_connector_s_own_keys() -> None:
    # The page is generated in kvtier.config, which may not import the vLLM integration (a
    # floor above it): its words about the connector are checked against the connector here.
    from kvtier.integrations.vllm.config import CONNECTOR_KEYS, DEFAULT_HOST_BUDGET, VLLM_OWNED

    page = configuration_page()
    section = page[page.index("## In vLLM") : page.index("## Every setting")]
    named = set(re.findall(r"`(\w+)`", section))
    assert named >= CONNECTOR_KEYS
    assert named >= set(VLLM_OWNED)
    assert parse_bytes(DEFAULT_HOST_BUDGET) == 2 * 2**30
    assert "(2 GiB unless set)" in section


def test_remote_tls_files_come_from_the_environment_and_are_checked(tmp_path: Path) -> None:
    files = {}
    for name in ("ca", "cert", "key"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("-----BEGIN-----")
    env = {
        "KVTIER_REMOTE_URL": "rediss://cache.internal:6380",
        "KVTIER_REMOTE_TLS_CA": str(files["ca"]),
        "KVTIER_REMOTE_TLS_CERT": str(files["cert"]),
        "KVTIER_REMOTE_TLS_KEY": str(files["key"]),
    }
    cfg = KvtierConfig.from_env(environ=env)
    assert (cfg.remote_tls_ca, cfg.remote_tls_cert, cfg.remote_tls_key) == tuple(
        str(files[n]) for n in ("ca", "cert", "key")
    )
    with pytest.raises(
        ConfigError, match="remote_tls_ca, remote_tls_cert, remote_tls_key: expected a TLS"
    ):
        KvtierConfig.from_env(environ={**env, "KVTIER_REMOTE_URL": "redis://cache.internal:6379"})
    with pytest.raises(ConfigError, match="expected both"):
        KvtierConfig.from_env(environ={**env, "KVTIER_REMOTE_TLS_KEY": ""})
    with pytest.raises(ConfigError, match="remote_tls_cert: expected a readable file"):
        KvtierConfig.from_env(environ={**env, "KVTIER_REMOTE_TLS_CERT": str(tmp_path)})
