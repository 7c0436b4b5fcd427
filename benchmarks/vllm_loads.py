"""What kvtier's loads do to prefill inside vLLM at its default scheduling limits (a whole
prompt a step, as ``vllm serve`` schedules it): ``kvtier bench vllm``'s workload through an
engine without a connector (the baseline: vLLM recomputes what its own prefix cache lost) and
one with kvtier's ladder (``bf16,int8,int4`` on the workload's host budget, loading what its
lookups offer: only what has been loading faster than it computes), in interleaved rounds, each
starting with the other configuration, so that the machine's drift hits both alike.

    python benchmarks/vllm_loads.py [--rounds 5] [--save PATH]

Per round: vLLM's mean prefill time per request (``vllm:request_prefill_time_seconds``) of
each, and the ladder's over the recompute's; their median over the rounds. Per request: its
TTFT with the ladder over its TTFT without a connector in the same round. The machine's noise
is that ratio over the requests the connector did not hit (they differ by its saves and by the
machine alone); a request the connector hit is *slower* when its ratio is above the largest of
those in its round. Prints each round's figures, then the JSON. Issue 59's targets: the median
prefill ratio <= 1.0, and no hit request slower. ``--save PATH`` writes the JSON with the run's
provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

from kvtier.integrations.vllm.engines import ENGINE_ENV
from kvtier.results import add_save_option, save_if_asked

for _name, _value in ENGINE_ENV.items():
    os.environ.setdefault(_name, _value)

from kvtier.bench.vllm import driver  # noqa: E402 - after vLLM's environment
from kvtier.bench.vllm.workload import FULL, make_workload  # noqa: E402

CONFIGS = ("recompute", "kvtier-ladder")


def round_figures(base: dict, ladder: dict) -> dict:
    """One round's comparison: prefill means, and each request's TTFT ratio, hit or not."""
    prefill = {
        name: r["vllm_histograms"]["prefill"]["mean_s"]
        for name, r in (("recompute", base), ("kvtier-ladder", ladder))
    }
    ratios = [
        mine / theirs
        for mine, theirs in zip(
            ladder["ttft_per_request_s"], base["ttft_per_request_s"], strict=True
        )
    ]
    hit = [
        mine > theirs
        for mine, theirs in zip(
            ladder["cached_tokens_per_request"], base["cached_tokens_per_request"], strict=True
        )
    ]
    noise = [r for r, h in zip(ratios, hit, strict=True) if not h]
    hits = [r for r, h in zip(ratios, hit, strict=True) if h]
    bound = max(noise) if noise else None
    connector = ladder["kvtier"]["connector"]
    return {
        "prefill_mean_s": prefill,
        "prefill_ratio": prefill["kvtier-ladder"] / prefill["recompute"],
        "ttft_ratio_per_request": ratios,
        "hit_requests": sum(hit),
        "noise_bound": bound,
        "hit_ratios": hits,
        "slower_hit_requests": sum(r > bound for r in hits) if bound is not None else None,
        "connector_hit_rate": ladder["connector_hit_rate"],
        "unpaid_tokens": connector["unpaid_tokens"],
        "seconds_per_token": ladder["kvtier"]["seconds_per_token"],
        "same_output": sum(a == b for a, b in zip(ladder["outputs"], base["outputs"], strict=True)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    add_save_option(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected at least 1, got {args.rounds}")
    settings = dataclasses.replace(FULL, step_tokens=None)  # vLLM's default limits
    work = make_workload(settings)

    def log(*parts: object) -> None:
        print(*parts, file=sys.stderr, flush=True)

    rounds = []
    for i in range(args.rounds):
        results = {}
        # Each round starts with the other configuration: no place in the round favours one.
        for config in CONFIGS[i % 2 :] + CONFIGS[: i % 2]:
            result, outputs = driver.run_config(
                config, work.model_dir, settings, work.turns, work.warm, {}, log
            )
            results[config] = {**result, "outputs": outputs}
        figures = round_figures(results["recompute"], results["kvtier-ladder"])
        rounds.append(figures)
        print(
            f"round {i + 1}: prefill mean {figures['prefill_mean_s']['kvtier-ladder']:.3f} s "
            f"vs {figures['prefill_mean_s']['recompute']:.3f} s recomputed: "
            f"{figures['prefill_ratio']:.3f}; {figures['hit_requests']} hit requests, "
            f"{figures['slower_hit_requests']} slower than the noise bound "
            f"{figures['noise_bound']}; hit rate {figures['connector_hit_rate']:.1%}, "
            f"unpaid tokens {figures['unpaid_tokens']}"
        )
    ratios = [r["prefill_ratio"] for r in rounds]
    res = {
        "rounds": rounds,
        "prefill_ratios": ratios,
        "median_prefill_ratio": statistics.median(ratios),
        "slower_hit_requests": sum(r["slower_hit_requests"] or 0 for r in rounds),
        "hit_requests": sum(r["hit_requests"] for r in rounds),
        "workload_requests": len(work.turns),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(
        f"median prefill ratio {res['median_prefill_ratio']:.3f} over {args.rounds} rounds "
        f"({[round(r, 3) for r in ratios]}); hit requests slower than the noise: "
        f"{res['slower_hit_requests']} of {res['hit_requests']}"
    )
    print(json.dumps(res))
    save_if_asked(args, res, "python benchmarks/vllm_loads.py", argv)


if __name__ == "__main__":
    main()
