"""What the vLLM connector costs when it has nothing to load: tokens/s of ``kvtier bench vllm``'s
workload through an engine with kvtier's connector (a bf16 host tier too small for any
conversation's prefix, so every prompt is saved and none is hit) against the same engine without
a connector (the baseline), in interleaved rounds (each starting with another configuration) so
that the machine's drift hits all alike.
Also, with ``--consumer``, the connector as ``kv_consumer`` (it looks up and loads, never saves):
what vLLM's connector path and kvtier's lookups cost without the saves; and, with ``--null``, a
connector that does nothing (``kvtier.bench._null_connector``): what vLLM's connector path
alone costs, which no connector avoids.

    python benchmarks/vllm_overhead.py [--pairs 5] [--step-tokens 4096] [--consumer] [--null]
        [--save PATH]

Prints each pass's tokens/s, each pair's ratio to the baseline, their median and the ratio of
the medians, then the JSON (``--save PATH``: also to PATH, with the run's provenance). Issue
44's target: the median ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from kvtier.integrations.vllm.engines import ENGINE_ENV
from kvtier.results import add_save_option, save_if_asked

for _name, _value in ENGINE_ENV.items():
    os.environ.setdefault(_name, _value)

from kvtier.bench.vllm import driver  # noqa: E402 - after vLLM's environment
from kvtier.bench.vllm.workload import FULL, make_workload, max_model_len  # noqa: E402


def transfer(role: str, budget: int) -> object:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role=role,
        kv_connector_extra_config={"host_budget": str(budget), "ladder": "bf16"},
    )


def null_transfer() -> object:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="NullConnector",
        kv_connector_module_path="kvtier.bench._null_connector",
        kv_role="kv_both",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--step-tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--consumer", action="store_true", help="also the connector as kv_consumer")
    ap.add_argument("--null", action="store_true", help="also a connector that does nothing")
    add_save_option(ap)
    args = ap.parse_args(argv)
    settings = dataclasses.replace(FULL, step_tokens=args.step_tokens)
    work = make_workload(settings)
    budget = settings.host_blocks * driver._block_bytes(work.model_dir)
    configs = {
        "no connector": lambda: None,
        "kvtier bf16 (saves)": lambda: transfer("kv_both", budget),
    }
    if args.consumer:
        configs["kvtier kv_consumer (no saves)"] = lambda: transfer("kv_consumer", budget)
    if args.null:
        configs["null connector (vLLM's path alone)"] = null_transfer
    tokens_per_s: dict[str, list[float]] = {name: [] for name in configs}
    order = list(configs.items())
    for i in range(args.pairs):
        # Each round starts with another configuration: no place in the round favours one.
        for name, make in order[i % len(order) :] + order[: i % len(order)]:
            context = max_model_len(settings)
            with driver._running(
                work.model_dir, context, settings.vllm_blocks, make(), args.step_tokens
            ) as llm:
                driver._warm_up(llm, work.warm)
                tokens, start = 0, time.perf_counter()
                for turn in work.turns:
                    driver._generate(llm, turn.tokens, settings.output_tokens)
                    tokens += len(turn.tokens) + settings.output_tokens
                tokens_per_s[name].append(tokens / (time.perf_counter() - start))
    base = tokens_per_s["no connector"]
    res: dict[str, object] = {"pairs": args.pairs, "step_tokens": args.step_tokens, "configs": {}}
    for name, values in tokens_per_s.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        figures = {
            "tokens_per_s": values,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "ratio_of_medians": statistics.median(values) / statistics.median(base),
        }
        res["configs"][name] = figures  # type: ignore[index]
        print(
            f"{name}: tokens/s {[round(v, 1) for v in values]}, over no connector "
            f"{[round(r, 3) for r in ratios]}: median {figures['median_ratio']:.3f}, ratio of "
            f"medians {figures['ratio_of_medians']:.3f}"
        )
    print(json.dumps(res))
    save_if_asked(args, res, "python benchmarks/vllm_overhead.py", argv)


if __name__ == "__main__":
    main()
