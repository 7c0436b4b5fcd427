"""A user-trained linear KV compressor as a level of a transformers ``TieredCache``.

Trains the compressor of ``learned_codec.py`` (PCA, then Adam steps on the attention-output error)
on K/V that SmolLM2-135M computes for WikiText-2 text *after* the evaluation windows, registers it
as ``learned:rank<R>``, and uses it as the last level of the ladder ``fp32,int8,learned:rank<R>``
of a TieredCache: first in ``model.generate``, then for perplexity against DynamicCache on held-out
windows (the method of ``kvtier eval cache``)::

    python examples/hf_learned_level.py --rank 32 --steps 20 --windows 4
"""

from __future__ import annotations

import argparse

import torch
from learned_codec import attention_loss  # the sibling example: this one builds on it
from transformers import DynamicCache

from kvtier import KvtierConfig
from kvtier.codecs import LearnedCodec, fit_pca
from kvtier.eval import cache as quality
from kvtier.eval import codecs as kv_capture
from kvtier.eval import model as real
from kvtier.integrations.hf import TieredCache

#: Training text starts this many tokens into WikiText-2, past any evaluation window.
TRAIN_OFFSET = 65_536


def train(
    model: object, tokenizer: object, rank: int, steps: int, windows: int = 4
) -> LearnedCodec:
    ids = real.wikitext_ids(tokenizer, TRAIN_OFFSET + windows * 512)[TRAIN_OFFSET:]
    kv = kv_capture.capture(model, ids.reshape(windows, 512))
    compressor, decompressor = fit_pca(kv.blocks(), rank)
    codec = LearnedCodec(f"rank{rank}", compressor, decompressor)
    reference = kv_capture.attention(kv.queries, kv.keys, kv.values)
    optimizer = torch.optim.Adam([*compressor.parameters(), *decompressor.parameters()], lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = attention_loss(codec, kv, reference)
        loss.backward()
        optimizer.step()
    print(
        f"trained rank {rank}: attention-output error {loss.item() if steps else float('nan'):.4f}"
    )
    # A new codec from the trained weights (its format fingerprints them), made a level by name.
    return LearnedCodec(f"rank{rank}", compressor, decompressor).register(replace=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=32, help="latent dimensions per head vector")
    parser.add_argument("--steps", type=int, default=20, help="Adam steps after PCA")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows for perplexity")
    parser.add_argument(
        "--train-windows", type=int, default=4, help="windows of 512 tokens to train on"
    )
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per window")
    args = parser.parse_args(argv)

    model, tokenizer = real.load_smollm2()
    codec = train(model, tokenizer, args.rank, args.steps, args.train_windows)
    config = KvtierConfig(ladder=("fp32", "int8", codec.name), recent_window=64)

    prompt = tokenizer(
        "The history of the printing press begins in China, where", return_tensors="pt"
    )
    cache = TieredCache(model, config)
    with torch.no_grad():
        out = model.generate(**prompt, past_key_values=cache, do_sample=False, max_new_tokens=40)
    print(f"generate: {tokenizer.decode(out[0])!r}")

    windows = real.windows(tokenizer, args.windows, args.tokens)
    methods = [
        quality.Method("dynamic", "", lambda m: DynamicCache(config=m.config)),
        quality.Method("learned", "", lambda m: TieredCache(m, config)),
    ]
    base, learned = (quality.perplexity(model, m, windows) for m in methods)
    change = learned["perplexity"] / base["perplexity"] - 1
    saved = 1 - learned["kv_bytes_fp16"] / base["kv_bytes_fp16"]
    print(
        f"perplexity: DynamicCache {base['perplexity']:.3f}, {config.ladder} "
        f"{learned['perplexity']:.3f} ({change * 100:+.2f} %), fp16-equivalent KV bytes "
        f"saved {saved * 100:.1f} %"
    )
    return {"ppl_change": change, "saved": saved}


if __name__ == "__main__":
    main()
