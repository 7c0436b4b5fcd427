"""Decode tokens/s of transformers caches on SmolLM2-135M, the methods interleaved step by step:
each round prefills a WikiText-2 prompt of 512 and of 4,096 tokens into a fresh cache of every
method, then times ``--steps`` single-token forward passes of each, one step of every method in
turn (the order rotating), so that a slow spell of a shared machine falls on all of them alike.
Prints each method's median tokens/s over all its steps and its ratio to the first method's (the
named baseline, measured in the same run): the ratio of the medians, and the median and quartiles
of the per-turn ratios (each step against the baseline's step of the same turn). Figures only: it
passes or fails nothing.

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 python benchmarks/hf_decode.py \\
        [--methods dynamic-sdpa,kvtier-2bit-attend,kvtier-default-attend] [--rounds 3] [--steps 30]
        [--save PATH]

``--save PATH`` writes the figures with every timed step (seconds, in turn order) and the run's
provenance. Methods are ``kvtier eval cache``'s (``kvtier.eval.cache.methods``). Each attention
implementation gets a model of its own (a step never switches one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvtier.integrations.hf  # noqa: F401  (registers attn_implementation="kvtier")
from kvtier.eval.cache.methods import methods
from kvtier.eval.model import smollm2_f32_dir, wikitext_ids
from kvtier.results import add_save_option, save_if_asked

PROMPTS = (512, 4096)


class Decoder:
    """One method's cache after a prompt, stepped greedily one token at a time."""

    def __init__(self, model: Any, make: Any, prompt: torch.Tensor) -> None:
        self.model, self.cache = model, make(model)
        with torch.no_grad():
            logits = model(prompt, past_key_values=self.cache, use_cache=True).logits
        self.token = logits[:, -1:].argmax(-1)

    def step(self) -> float:
        """Seconds of one single-token forward pass."""
        with torch.no_grad():
            start = time.perf_counter()
            logits = self.model(self.token, past_key_values=self.cache, use_cache=True).logits
            self.token = logits[:, -1:].argmax(-1)
            return time.perf_counter() - start


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, q2, q3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dynamic-sdpa,kvtier-2bit-attend,kvtier-default-attend")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    add_save_option(ap)
    args = ap.parse_args(argv)
    names = args.methods.split(",")
    known = methods()
    path = smollm2_f32_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = wikitext_ids(tokenizer, max(PROMPTS))[None]
    models: dict[str, Any] = {}
    for name in names:
        attn = known[name].attn
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=attn, dtype=torch.float32
            )
    # per (method, prompt): seconds of each timed step, in turn order
    times: dict[tuple[str, int], list[float]] = {(n, p): [] for n in names for p in PROMPTS}
    for r in range(args.rounds):
        for p in PROMPTS:
            decoders = {n: Decoder(models[known[n].attn], known[n].make, ids[:, :p]) for n in names}
            for d in decoders.values():  # a first step each, untimed: warm
                d.step()
            for s in range(args.steps):
                for k in range(len(names)):
                    name = names[(r + s + k) % len(names)]
                    times[name, p].append(decoders[name].step())
            rates = "  ".join(
                f"{n} {1 / statistics.median(times[n, p][-args.steps :]):.2f}" for n in names
            )
            print(f"round {r} after {p} tokens (tokens/s): {rates}", flush=True)
            del decoders
    print(
        f"{args.rounds} rounds x {args.steps} steps; x: against {names[0]}: the ratio of the "
        "median rates (per-turn ratios: median [quartiles])"
    )
    result: dict[str, Any] = {
        "methods": names,
        "baseline": names[0],
        "rounds": args.rounds,
        "steps": args.steps,
        "prompts": {},
    }
    for p in PROMPTS:
        base = times[names[0], p]
        rows = result["prompts"][str(p)] = {}
        for name in names:
            got = times[name, p]
            per_turn = [b / g for g, b in zip(got, base, strict=True)]
            q1, q2, q3 = quartiles(per_turn)
            ratio = statistics.median(base) / statistics.median(got)
            print(
                f"@{p:<5} {name:24s} {1 / statistics.median(got):6.2f} tokens/s  x {ratio:.2f}  "
                f"(per turn {q2:.2f} [{q1:.2f}, {q3:.2f}])"
            )
            rows[name] = {
                "tokens_per_s": 1 / statistics.median(got),
                "ratio_of_medians": ratio,
                "per_turn_ratio_quartiles": [q1, q2, q3],
                "step_s_samples": got,
            }
    save_if_asked(args, result, "python benchmarks/hf_decode.py", argv)


if __name__ == "__main__":
    main()
