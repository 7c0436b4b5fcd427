"""TieredCache in transformers: SmolLM2-135M with HF's own ``generate`` and forward loops.

Marked ``hf``. DynamicCache is the oracle: at level 0 a TieredCache must give the same tokens,
for greedy, sampled, batched (left-padded) and beam-search decoding and for ``crop``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from transformers import DynamicCache  # noqa: E402

from kvtier import KvtierConfig  # noqa: E402
from kvtier.errors import ConfigError, InvalidArgumentError, MissingDependencyError  # noqa: E402
from kvtier.eval import cache as quality  # noqa: E402
from kvtier.eval import model as real  # noqa: E402
from kvtier.integrations.hf import TieredCache, check_supported  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("model_threads")]

PROMPT = "The history of the printing press begins in China, where"
#: Small blocks and window, so a short generation already demotes blocks.
COMPRESSED = KvtierConfig(block_size=8, recent_window=16, device_blocks=512)
EXACT = COMPRESSED.replace(enable_compression=False)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    try:
        real.smollm2_dir()
    except MissingDependencyError as exc:
        pytest.skip(f"SmolLM2 not installed: {exc}")
    return real.load_smollm2()


def generate(model: Any, ids: Any, cache: Any, **kw: Any) -> Any:
    kw.setdefault("do_sample", False)
    kw.setdefault("max_new_tokens", 24)
    return model.generate(
        ids,
        attention_mask=kw.pop("attention_mask", torch.ones_like(ids)),
        past_key_values=cache,
        pad_token_id=model.generation_config.eos_token_id,
        **kw,
    )


def prompt_ids(tokenizer: Any, text: str = PROMPT) -> Any:
    return tokenizer(text, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def greedy(smollm2: tuple[Any, Any]) -> tuple[Any, Any]:
    """The prompt's ids and DynamicCache's greedy 40-token continuation: the oracle."""
    model, tok = smollm2
    ids = prompt_ids(tok)
    return ids, generate(model, ids, DynamicCache(config=model.config), max_new_tokens=40)


def test_level0_generate_is_dynamic_cache_token_for_token(smollm2, greedy):
    model, _ = smollm2
    ids, reference = greedy
    cache = TieredCache(model, EXACT)
    out = generate(model, ids, cache, max_new_tokens=40)
    assert out.tolist() == reference.tolist()
    # The cache holds every token but the last generated one (it is never fed back).
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.kv_bytes()["held"] == cache.kv_bytes()["level0"] > 0


def test_compressed_cache_demotes_and_greedy_text_holds(smollm2, greedy):
    model, _ = smollm2
    ids, reference = greedy
    cache = TieredCache(model, COMPRESSED)
    out = generate(model, ids, cache, max_new_tokens=40)
    held = cache.kv_bytes()
    assert cache.moves.get("demote", 0) > 0
    assert sum(held["blocks"][1:]) > 0 and held["held"] < held["level0"]
    # int8/int4 blocks perturb attention a little; the text must still start as HF's does.
    start = ids.shape[1]
    assert out[0, start : start + 12].tolist() == reference[0, start : start + 12].tolist()


def test_step_cadence_is_the_users_choice(smollm2, greedy):
    model, _ = smollm2
    ids, _ = greedy
    cache = TieredCache(model, COMPRESSED, step_every=0)
    generate(model, ids, cache, max_new_tokens=30)
    assert cache.moves == {} and cache.kv_bytes()["held"] == cache.kv_bytes()["level0"]
    summary = cache.step()  # the scheduler runs when the user says so
    assert summary["demote"] > 0 and cache.kv_bytes()["held"] < cache.kv_bytes()["level0"]


def test_batch_with_left_padding_matches_dynamic_cache(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(
        ["Hello, my name is", "The capital of France is a city that"],
        return_tensors="pt",
        padding=True,
    )
    ref = generate(
        model, enc.input_ids, DynamicCache(config=model.config), attention_mask=enc.attention_mask
    )
    cache = TieredCache(model, EXACT)
    out = generate(model, enc.input_ids, cache, attention_mask=enc.attention_mask)
    assert out.tolist() == ref.tolist()
    assert cache.batch_size == 2


def test_sampling_with_several_return_sequences_matches(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok)
    kw = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 16}
    torch.manual_seed(7)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    torch.manual_seed(7)
    cache = TieredCache(model, EXACT)
    out = generate(model, ids, cache, **kw)
    assert out.tolist() == ref.tolist()


def test_beam_search_reorders_by_forking(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok)
    kw = {"num_beams": 3, "max_new_tokens": 16}
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = TieredCache(model, EXACT)
    out = generate(model, ids, cache, **kw)
    assert out.tolist() == ref.tolist()
    # Beams are forks: the prompt's full block is one block shared by all three.
    blocks = [cache.manager.core.sequence_blocks(s)[0] for s in cache.sequences]
    assert len({int(b) for b in blocks}) == 1


@torch.no_grad()
def test_forward_loop_and_crop_match_dynamic_cache(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok)
    caches = [DynamicCache(config=model.config), TieredCache(model, EXACT)]
    logits = []
    for cache in caches:
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(5):
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        cache.crop(-3)  # what assisted decoding does after rejecting candidates
        assert cache.get_seq_length() == ids.shape[1] + 5 - 3
        logits.append(model(nxt, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_eager_attention_feedback_reaches_the_scheduler(smollm2):
    _, tok = smollm2
    model, _ = real.load_smollm2("eager")
    ids = prompt_ids(tok, PROMPT + " " + PROMPT)
    config = COMPRESSED.replace(policy="h2o")
    scores = {}
    for feedback in (False, True):
        cache = TieredCache(model, config, feedback=feedback)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        bm = cache.manager
        scores[feedback] = bm.core.block_info(bm.core.sequence_blocks(cache.sequences[0]))["score"]
    assert len(model._kvtier_feedback_handles) == model.config.num_hidden_layers
    # h2o ranks by accumulated attention: nothing without the hook; with it, the first block
    # (the attention sink) is the heaviest hitter.
    assert not scores[False].any()
    assert scores[True].argmax() == 0 and scores[True].min() < scores[True].max()


@torch.no_grad()
def test_int8_perplexity_within_half_a_percent_and_passkey_found(smollm2):
    model, tok = smollm2
    windows = real.windows(tok, 2, 512)
    table = quality.methods()
    base = quality.perplexity(model, table["dynamic"], windows)
    int8 = quality.perplexity(model, table["kvtier-int8"], windows)
    assert int8["perplexity"] <= base["perplexity"] * 1.005
    assert int8["kv_bytes"] < 0.6 * base["kv_bytes"]
    found = quality.passkey(model, tok, table["kvtier-default"], lengths=(1024,), depths=(0.5,))
    assert found["accuracy"] == 1.0


def test_models_it_cannot_serve_are_refused_when_built():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, T5Config

    check_supported(LlamaConfig(num_hidden_layers=2))
    cases = {
        "sliding_window": MistralConfig(num_hidden_layers=2, sliding_window=64),
        "sliding_attention": Qwen2Config(
            num_hidden_layers=2, use_sliding_window=True, sliding_window=64, max_window_layers=1
        ),
        "encoder-decoder": T5Config(num_layers=2),
    }
    for expected, config in cases.items():
        with pytest.raises(ConfigError, match=expected):
            TieredCache(config, EXACT)
    mla = LlamaConfig(num_hidden_layers=2)
    mla.kv_lora_rank = 64
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        TieredCache(mla, EXACT)


def test_bad_use_gets_clear_errors(smollm2):
    model, tok = smollm2
    with pytest.raises(InvalidArgumentError, match="step_every"):
        TieredCache(model, EXACT, step_every=-1)
    from kvtier import BlockManager

    wrong = BlockManager(
        EXACT, num_layers=2, num_kv_heads=3, head_dim=64, dtype="fp32", device="cpu"
    )
    with pytest.raises(ConfigError, match="layers, kv_heads, head_dim"):
        TieredCache(model, manager=wrong)
    cache = TieredCache(model, EXACT)
    with torch.no_grad():
        model(prompt_ids(tok), past_key_values=cache, use_cache=True)
        with pytest.raises(InvalidArgumentError, match="batch of 2 rows"):
            model(prompt_ids(tok).repeat(2, 1), past_key_values=cache, use_cache=True)
    with pytest.raises(InvalidArgumentError, match="kv_heads"):
        cache.layers[0].update(torch.zeros(1, 9, 2, 64), torch.zeros(1, 9, 2, 64))
    # After reset the cache takes a new batch.
    cache.reset()
    with torch.no_grad():
        model(prompt_ids(tok).repeat(2, 1), past_key_values=cache, use_cache=True)
    assert cache.batch_size == 2


def test_a_user_trained_compressor_serves_as_a_level(smollm2, monkeypatch):
    """examples/hf_learned_level.py: a trained linear compressor as the last level of a
    TieredCache, in generate and in perplexity; it must run and save bytes (its quality is
    reported, not asserted: a low-rank projection is a weak codec for SmolLM2's values)."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    example = importlib.import_module("hf_learned_level")
    try:
        argv = ["--steps", "2", "--train-windows", "1", "--windows", "1", "--tokens", "512"]
        result = example.main(argv)
    finally:
        from kvtier.codecs import unregister_codec

        unregister_codec("learned:rank32")
        sys.modules.pop("hf_learned_level", None)
        sys.modules.pop("learned_codec", None)
    assert result["saved"] > 0.3
    assert result["ppl_change"] < 0.5


def test_kvtier_eval_cache_command_prints_its_table_as_json(smollm2, capsys, monkeypatch, tmp_path):
    from kvtier.cli import main

    # The text it reads is the one KVTIER_WIKITEXT names, and the result says which.
    text = tmp_path / "wiki-head.raw"
    text.write_text(real.wikitext_path().read_text(encoding="utf-8")[:50_000], encoding="utf-8")
    monkeypatch.setenv("KVTIER_WIKITEXT", str(text))
    methods = "dynamic,kvtier-int8,kvtier-default,kvtier-default-attend"
    argv = ["eval", "cache", "--methods", methods, "--windows", "1", "--tokens", "256"]
    argv += ["--passkey-lengths", "", "--speed-tokens", "4", "--speed-prompts", "32,48", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == str(text)
    base, int8, default, attend = result["rows"]
    assert [r["method"] for r in result["rows"]] == methods.split(",")
    assert base["ppl_change"] == 0 and base["bytes_vs_dynamic"] == 1
    assert int8["scored_tokens"] == 128
    assert 0.2 < int8["bytes_vs_dynamic"] < 0.9 and abs(int8["ppl_change"]) < 0.01
    for row in result["rows"]:
        assert [s["prompt"] for s in row["speed"]] == [32, 48]
        assert all(s["decode_tokens_per_s"] > 0 and s["prefill_s"] > 0 for s in row["speed"])
    assert all(s["vs_baseline"] > 0 for s in int8["speed"]), "ratios against the baseline"
    # attention over the blocks: the gather path's perplexity and bytes
    assert (default["attn"], attend["attn"]) == ("eager", "kvtier")
    assert attend["kv_bytes"] == default["kv_bytes"]
    assert abs(attend["perplexity"] / default["perplexity"] - 1) < 1e-3


@pytest.mark.parametrize(
    ("options", "in_error"),
    [
        (["--windows", "0"], "argument --windows: expected a positive integer, got '0'"),
        (["--tokens", "1"], "argument --tokens: expected an integer >= 2, got '1'"),
        (["--chunk", "0"], "argument --chunk: expected a positive integer, got '0'"),
        (["--speed-tokens", "-1"], "argument --speed-tokens: expected an integer >= 0"),
        (["--passkey-lengths", "1k"], "expected comma-separated positive integers, got '1k'"),
        (["--passkey-depths", "0.5,2"], "expected comma-separated numbers from 0 to 1"),
        (["--methods", "dynamic,kvtier-int3"], "unknown method(s) kvtier-int3: expected some of"),
        (["--methods", "kvpress-knorm@1"], "unknown method(s) kvpress-knorm@1: expected some of"),
        (["--from-json", "/no/such/file.json"], "cannot read /no/such/file.json"),
        (["--plot", "curve.webmx"], "matplotlib writes no '.webmx' files"),
    ],
)
def test_kvtier_eval_cache_rejects_bad_options_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    in_error: str,
) -> None:
    from kvtier.cli import main

    monkeypatch.setattr(real, "load_smollm2", lambda *a: pytest.fail("the model was loaded"))
    assert main(["eval", "cache", *options]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    error, hint = [line for line in err.splitlines() if line.startswith(("error:", "hint:"))]
    assert error.startswith("error: ") and in_error in error
    assert hint.startswith("hint: ") and len(hint) > len("hint: ")


@pytest.mark.parametrize("where", ["missing.raw", "."])
def test_kvtier_eval_cache_refuses_a_wikitext_path_that_is_not_a_file_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
    where: str,
) -> None:
    """A text the user named is read or refused, never passed over for the bundled one."""
    from kvtier.cli import main

    path = tmp_path / where
    monkeypatch.setenv("KVTIER_WIKITEXT", str(path))
    monkeypatch.setattr(real, "load_smollm2", lambda *a: pytest.fail("the model was loaded"))
    argv = ["eval", "cache", "--methods", "dynamic", "--windows", "1", "--tokens", "16"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    error, hint = [line for line in err.splitlines() if line.startswith(("error:", "hint:"))]
    what = "no such file" if where == "missing.raw" else "a directory"
    assert error == (
        "error: KVTIER_WIKITEXT: expected the path of a text file (WikiText-2's test split, "
        f"wikitext2_test.raw), got {str(path)!r} ({what})"
    )
    assert "unset KVTIER_WIKITEXT" in hint


def test_caches_on_a_shared_manager_free_their_rows_however_they_end(smollm2):
    """One small manager, a cache per request: the rows are freed when the cache is closed,
    when a ``with`` block ends, when it is reset for the next batch, and when it is simply
    dropped. Twelve requests on a manager that holds about two never run out (on a manager
    that kept the rows, the third would), and every one generates DynamicCache's tokens."""
    from kvtier import BlockManager

    model, tok = smollm2
    ids = prompt_ids(tok)
    want = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=6)
    cfg = EXACT.replace(device_blocks=8)  # blocks of 8 tokens: a request takes 3
    bm = BlockManager(
        cfg, num_layers=30, num_kv_heads=3, head_dim=64, dtype=model.dtype, device="cpu"
    )
    reused = TieredCache(model, manager=bm)
    for i in range(12):
        how = ("dropped", "with", "reset", "close")[i % 4]
        if how == "with":
            with TieredCache(model, manager=bm) as cache:
                got = generate(model, ids, cache, max_new_tokens=6)
        elif how == "reset":
            reused.reset()
            got = generate(model, ids, reused, max_new_tokens=6)
            reused.reset()
        else:
            cache = TieredCache(model, manager=bm)
            got = generate(model, ids, cache, max_new_tokens=6)
            if how == "close":
                cache.close()
            del cache
        assert torch.equal(got, want), (i, how)
        assert bm.sequences() == [], (i, how)


#: A small ``kvtier eval cache --json`` result: the baseline, a peer and two kvtier rows.
RESULT = {
    "model": "SmolLM2-135M",
    "text": "wikitext2_test.raw",
    "windows": 1,
    "window_tokens": 256,
    "skipped": [],
    "rows": [
        {
            "method": m,
            "perplexity": p,
            "kv_bytes": b,
            "kv_bytes_fp16": b // 2,
            "ppl_change": c,
            "bytes_vs_dynamic": b / 1000,
            "bytes_vs_fp16": b / 1000,
        }
        for m, p, b, c in [
            ("dynamic", 25.5, 1000, 0.0),
            ("quanto-int4", 25.8, 221, 0.012),
            ("kvpress-knorm@0.5", 27.0, 750, 0.06),
            ("kvtier-int4", 25.6, 302, 0.004),
            ("kvtier-int2-aggressive", 26.1, 200, 0.02),
        ]
    ],
}


def test_kvtier_eval_cache_plots_a_saved_result_without_running_the_model(
    tmp_path, monkeypatch, capsys
):
    pyplot = pytest.importorskip("matplotlib.pyplot", reason="matplotlib (kvtier[plot]) absent")
    from kvtier.cli import main

    monkeypatch.setattr(real, "load_smollm2", lambda *a: pytest.fail("the model was loaded"))
    saved = tmp_path / "quality.json"
    saved.write_text(json.dumps(RESULT))
    assert main(["eval", "cache", "--from-json", str(saved), "--plot", str(tmp_path / "c")]) == 0
    out, err = capsys.readouterr()
    # the table of the saved rows on stdout, where the plot went on stderr
    assert [line.split(" | ")[0] for line in out.splitlines()[2:]] == [
        f"| {r['method']}" for r in RESULT["rows"]
    ]
    assert f"wrote {tmp_path / 'c.png'}" in err
    image = pyplot.imread(tmp_path / "c.png")
    height, width, channels = image.shape
    assert width >= 800 and height >= 500 and channels in (3, 4)
    assert image.std() > 0.05, "the plot has marks on it"


def test_kvtier_eval_cache_merges_saved_runs_against_the_baseline_of_either(tmp_path, capsys):
    """Runs of a few methods each merge into one result: rows in order, and every row's
    figures against ``dynamic`` computed again from whichever run held it."""
    from kvtier.cli import main

    def strip(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in ("ppl_change", "bytes_vs_dynamic")}

    first = {**RESULT, "rows": [strip(r) for r in RESULT["rows"][2:]]}
    second = {**RESULT, "rows": [strip(r) for r in RESULT["rows"][:2]]}
    paths = []
    for i, part in enumerate((first, second)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    assert (
        main(
            ["eval", "cache", "--json", "--from-json", str(paths[0]), "--from-json", str(paths[1])]
        )
        == 0
    )
    merged = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in merged["rows"]] == [
        r["method"] for r in RESULT["rows"][2:] + RESULT["rows"][:2]
    ]
    by_name = {r["method"]: r for r in merged["rows"]}
    assert by_name["kvtier-int4"]["ppl_change"] == pytest.approx(25.6 / 25.5 - 1)
    assert by_name["kvtier-int4"]["bytes_vs_dynamic"] == pytest.approx(0.302)
    # runs of other settings, or the same method twice, are refused by name
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**second, "windows": 8}))
    again = tmp_path / "again.json"
    again.write_text(json.dumps(first))
    for extra, message in ((other, "windows differ"), (again, "kvpress-knorm@0.5 is in both")):
        assert main(["eval", "cache", "--from-json", str(paths[0]), "--from-json", str(extra)]) == 2
        assert message in capsys.readouterr().err


def test_quanto_int2_bytes_count_its_packed_codes_and_fp16_scales(smollm2):
    """quanto-int2 packs four codes a byte, with a scale and a shift per group of 64 values
    (fp32 here, fp16 in a 16-bit deployment): its bytes must count exactly that."""
    pytest.importorskip("optimum.quanto", reason="optimum-quanto (kvtier[bench]) absent")
    model, tok = smollm2
    cfg = model.config
    ids = real.windows(tok, 1, 64)[0]
    held = {}
    for bits in (4, 2):
        cache = quality.methods()[f"quanto-int{bits}"].make(model)
        with torch.no_grad():
            model(ids[None], past_key_values=cache, use_cache=True)  # a prefill: all quantized
        held[bits] = quality.cache_bytes(cache)
    values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 64 * cfg.head_dim  # K and V
    groups = values // 64
    for bits in (4, 2):
        assert held[bits] == (
            values * bits // 8 + groups * 2 * 4,
            values * bits // 8 + groups * 2 * 2,
        )
    assert held[2][1] < 0.6 * held[4][1]


KVPRESS_ABSENT = (
    "kvpress is not installed: kvpress 0.5.5 pins transformers<5.3, so pip cannot install it "
    f"beside kvtier[hf]; it runs without its pins: {quality.KVPRESS_INSTALL}"
)


def test_the_kvpress_install_hint_names_what_make_venv_installs() -> None:
    """The hint users get and requirements/kvpress.txt (what ``make venv`` and CI install)
    list the same packages."""
    listed = (Path(__file__).parents[1] / "requirements" / "kvpress.txt").read_text()
    wanted = [line for line in listed.splitlines() if line and not line.startswith("#")]
    hint = quality.KVPRESS_INSTALL.removeprefix("pip install --no-deps ")
    assert [part.strip("'") for part in hint.split()] == wanted


def test_a_kvpress_press_shrinks_the_prefill_and_nothing_else(smollm2):
    """A press at ratio 0 is DynamicCache exactly (the positions after a prefill are the
    text's); at 0.5 it holds half the prefill's tokens and every token decoded after it."""
    pytest.importorskip("kvpress", reason=KVPRESS_ABSENT)
    model, tok = smollm2
    windows = real.windows(tok, 1, 256)
    rows = {
        name: quality.perplexity(model, quality.method(name), windows)
        for name in ("dynamic", "kvpress-knorm@0", "kvpress-knorm@0.5")
    }
    assert rows["kvpress-knorm@0"]["perplexity"] == rows["dynamic"]["perplexity"]
    # 255 tokens held by DynamicCache; the press keeps 64 of the 128 prefilled, then 127 more.
    assert rows["kvpress-knorm@0.5"]["kv_bytes"] * 255 == rows["dynamic"]["kv_bytes"] * 191
    assert rows["kvpress-knorm@0.5"]["perplexity"] != rows["dynamic"]["perplexity"]
    # the passkey decodes greedily by hand after the pressed prefill; at ratio 0, as generate
    found = quality.passkey(
        model, tok, quality.method("kvpress-knorm@0"), lengths=(512,), depths=(0.5,)
    )
    assert found["accuracy"] == 1.0
