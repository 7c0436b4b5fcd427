"""What each block of a saved prefix is worth at each precision: the placements behind the chain
ends rule (``keep_leaves``, the sink rule) and the connector's 2-bit ladder, measured on
SmolLM2-135M (transformers, the CPU) at the settings of ``kvtier eval vllm``.

Each WikiText-2 window of ``--prefix`` + ``--continuation`` tokens: the prefix runs once and its
K/V (keys after RoPE, as vLLM caches them) are cut into blocks of 32 tokens; each block goes
through a codec's encode and decode (``kvtier.codecs``) as a placement says, by its position in
the chain (first, last, in between) or by the core's importance signal (the mean norm of its
keys, what the manager records at save time); then the continuation is scored over that cache.
The model's bf16 weights compute in float32 (bf16 matrix products are ten times slower on this
CPU) and the K/V are rounded to bf16 before the codecs, as vLLM's bf16 cache holds them.
Against the same windows over the prefix's exact K/V: perplexity change, mean |Δ logprob| per
scored token, and the placement's bytes against bf16's (the codecs' packed bytes with their
scales, for this model's blocks). A prefix cache that decides levels block by block can do no
better than the best placement at its bytes; ``kvtier eval vllm`` measures what the connector's
rules actually place.

    python benchmarks/chain_ends.py [--windows 12] [--save PATH]

Figures only: it passes or fails nothing.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvtier.codecs import get_codec
from kvtier.codecs.base import BlockShape
from kvtier.eval.model import smollm2_hf_dir, wikitext_ids
from kvtier.results import add_save_option, save_if_asked

BLOCK = 32
INT2 = "int2-rot-g64"  # the bottom level of both 2-bit ladders
#: A placement: the codec of each block of a window's prefix, from the block count and the
#: blocks' key norms.
Placement = Callable[[int, list[float]], list[str]]


def by_position(first: str, last: str, middle: str = INT2, last_blocks: int = 1) -> Placement:
    return lambda n, _: [first] + [middle] * (n - 1 - last_blocks) + [last] * last_blocks


def middles_kept(k: int, order: str, ends: str = "int4", keep: str = "int4") -> Placement:
    """Both ends at ``ends``, ``k`` of the blocks between at ``keep`` and the rest at int2:
    those with the largest key norms (``importance``), the smallest (``reverse``), the last
    (``latest``) or the first (``earliest``)."""

    def place(n: int, norms: list[float]) -> list[str]:
        middle = list(range(1, n - 1))
        ranked = {
            "importance": sorted(middle, key=lambda j: -norms[j]),
            "reverse": sorted(middle, key=lambda j: norms[j]),
            "latest": middle[::-1],
            "earliest": middle,
        }[order]
        kept = set(ranked[:k])
        return [ends] + [keep if j in kept else INT2 for j in middle] + [ends]

    return place


#: name -> (what it shows, placement)
PLACEMENTS: dict[str, tuple[str, Placement]] = {
    "all-int2": ("every block at int2", by_position(INT2, INT2)),
    "sink-bf16": ("the sink rule alone", by_position("bf16", INT2)),
    "sink-bf16-leaf-int2-rot": (
        "leaf at the 2-bit ladder's middle level",
        by_position("bf16", "int2-rot"),
    ),
    "sink-bf16-leaf-bf16": ("both ends at level 0", by_position("bf16", "bf16")),
    "sink-bf16-leaf-int4": ("sink at level 0, leaf at int4", by_position("bf16", "int4")),
    "sink-bf16-leaf-int8": ("sink at level 0, leaf at int8", by_position("bf16", "int8")),
    "ends-int4": ("both ends at int4", by_position("int4", "int4")),
    "sink-bf16-last2-int4": ("the last two blocks at int4", by_position("bf16", "int4", INT2, 2)),
    "ends-int4-last2": (
        "the last two blocks and the sink at int4",
        by_position("int4", "int4", INT2, 2),
    ),
    **{
        f"ends-int4-keep2-{order}": (
            f"2 blocks between at int4, by {order}",
            middles_kept(2, order),
        )
        for order in ("importance", "reverse", "latest", "earliest")
    },
    "all-int4": ("every block at int4", by_position("int4", "int4", "int4")),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--prefix", type=int, default=256, help=f"a multiple of {BLOCK}")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    add_save_option(ap)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model_dir = smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    dim = cfg.hidden_size // cfg.num_attention_heads
    length, n = args.prefix + args.continuation, args.prefix // BLOCK
    ids = wikitext_ids(tokenizer, args.windows * length)
    windows = ids[: args.windows * length].reshape(args.windows, length)
    shape = BlockShape(layers, heads, BLOCK, dim, "bf16")
    bf16_bytes = get_codec("bf16").bytes_per_block(shape)

    with torch.no_grad():
        prefixes = []  # per window: [n, layers, 2, heads, BLOCK, dim]
        for w in windows:
            cache = DynamicCache()
            model(w[None, : args.prefix], past_key_values=cache, use_cache=True)
            kv = torch.stack([torch.stack([lay.keys[0], lay.values[0]]) for lay in cache.layers])
            kv = kv.to(torch.bfloat16)
            blocks = kv.reshape(layers, 2, heads, n, BLOCK, dim).permute(3, 0, 1, 2, 4, 5)
            prefixes.append(blocks.contiguous())
        norms = [p[:, :, 0].float().norm(dim=-1).mean(dim=(1, 2, 3)).tolist() for p in prefixes]
        decoded: dict[str, list[torch.Tensor]] = {}

        def at(codec: str, window: int) -> torch.Tensor:
            if codec not in decoded:
                c = get_codec(codec)
                decoded[codec] = [
                    p if codec == "bf16" else c.decode(c.encode(p), dtype=torch.bfloat16)
                    for p in prefixes
                ]
            return decoded[codec][window]

        def score(placement: Placement) -> tuple[torch.Tensor, float, list[list[str]]]:
            logprobs, ratio, chosen = [], 0.0, []
            for i, w in enumerate(windows):
                codecs = placement(n, norms[i])
                chosen.append(codecs)
                ratio += sum(get_codec(c).bytes_per_block(shape) for c in codecs) / (n * bf16_bytes)
                blocks = torch.stack([at(c, i)[j] for j, c in enumerate(codecs)])
                kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, args.prefix, dim)
                cache = DynamicCache()
                kv = kv.float()
                for layer in range(layers):
                    cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
                out = model(w[None, args.prefix :], past_key_values=cache, use_cache=True)
                lp = torch.log_softmax(out.logits[0, :-1].float(), -1)
                logprobs.append(lp.gather(1, w[args.prefix + 1 :, None])[:, 0])
            return torch.cat(logprobs), ratio / len(windows), chosen

        reference, _, _ = score(by_position("bf16", "bf16", "bf16"))
        ref_ppl = math.exp(-reference.mean().item())
        print(f"reference perplexity {ref_ppl:.4f} ({reference.numel()} scored tokens)", flush=True)
        rows: dict[str, Any] = {}
        for name in args.placements.split(","):
            what, placement = PLACEMENTS[name]
            t0 = time.perf_counter()
            lp, ratio, chosen = score(placement)
            ppl = math.exp(-lp.mean().item())
            rows[name] = {
                "what": what,
                "bytes_vs_bf16": ratio,
                "perplexity": ppl,
                "ppl_change": ppl / ref_ppl - 1,
                "mean_abs_logprob_change": (lp - reference).abs().mean().item(),
                "codecs": chosen,
            }
            print(
                f"{name:34s} bytes {ratio:.3f}  perplexity {ppl:.4f} {100 * (ppl / ref_ppl - 1):+6.2f} %"
                f"  mean |dlp| {rows[name]['mean_abs_logprob_change']:.4f}  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    result = {
        "model": "SmolLM2-135M-Instruct: bf16 weights computing in float32, K/V rounded to bf16 "
        "(transformers, CPU)",
        "text": "WikiText-2 test split",
        "windows": args.windows,
        "prefix": args.prefix,
        "continuation": args.continuation,
        "block": BLOCK,
        "reference_perplexity": ref_ppl,
        "scored_tokens": reference.numel(),
        "key_norms": norms,
        "rows": rows,
    }
    save_if_asked(args, result, "python benchmarks/chain_ends.py", argv)


if __name__ == "__main__":
    main()
