"""Decode tokens/s of transformers caches on SmolLM2-135M, the methods interleaved: each round
prefills a WikiText-2 prompt of 512 and of 4,096 tokens with every method in turn (a round starting
with the next method each time: the machine may be shared) and times ``--steps`` single-token
forward passes after it. Prints each method's median tokens/s over the rounds and its ratio to
the first method's (the named baseline, measured in the same run), and each round's ratio.
Figures only: it passes or fails nothing.

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 python benchmarks/hf_decode.py \\
        [--methods dynamic-sdpa,kvtier-2bit-attend,kvtier-default-attend] [--rounds 3] [--steps 30]

Methods are ``kvtier eval cache``'s (``kvtier.eval.cache.methods``).
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

PROMPTS = (512, 4096)


def decode_rate(model: Any, cache: Any, prompt: Any, steps: int) -> float:
    """Tokens/s of greedy single-token steps after prefilling ``prompt`` into ``cache``: one over
    the median step (the first two left out)."""
    with torch.no_grad():
        logits = model(prompt, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dynamic-sdpa,kvtier-2bit-attend,kvtier-default-attend")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    names = args.methods.split(",")
    known = methods()
    path = smollm2_f32_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = wikitext_ids(tokenizer, max(PROMPTS))[None]
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    )
    rates: dict[tuple[str, int], list[float]] = {(n, p): [] for n in names for p in PROMPTS}
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            method = known[name]
            model.set_attn_implementation(method.attn)
            for p in PROMPTS:
                rate = decode_rate(model, method.make(model), ids[:, :p], args.steps)
                rates[name, p].append(rate)
                print(f"round {r}: {name} after {p} tokens: {rate:.2f} tokens/s", flush=True)
    print(f"median over {args.rounds} rounds; x: against {names[0]}, median and per round")
    for p in PROMPTS:
        base = rates[names[0], p]
        for name in names:
            got = rates[name, p]
            per_round = " ".join(f"{a / b:.2f}" for a, b in zip(got, base, strict=True))
            ratio = statistics.median(got) / statistics.median(base)
            print(
                f"@{p:<5} {name:24s} {statistics.median(got):6.2f} tokens/s  x {ratio:.2f}  ({per_round})"
            )


if __name__ == "__main__":
    main()
