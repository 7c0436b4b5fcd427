"""Train a learned KV compressor on real K/V, save it, load it back as a codec, measure it.

The compressor is the common kind people write for HF caches: per layer and per K/V, a linear
projection of each head vector from ``head_dim`` to ``rank`` dimensions (stored in fp16) and
back. Training has two stages, both on K/V captured from SmolLM2-135M reading WikiText-2:

1. PCA: the projection with the least squared error (closed form);
2. a few Adam steps on what attention actually sees — the error of the attention output for the
   model's real queries — starting from PCA.

Quality is reported on held-out windows (text the codec never saw), beside ``int4`` and ``int8``:

    python examples/learned_codec.py --rank 24 --steps 30 --out /tmp/kv_rank24.safetensors

The saved file is loaded with ``LearnedCodec.load(path)`` and registered as ``learned:<name>``,
so a ladder such as ``fp16,int8,learned:rank24`` can use it.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier.codecs import LearnedCodec, fit_pca, get_codec
from kvtier.eval import codecs as quality
from kvtier.eval import model as real


def split(kv: quality.RealKV, train: int) -> tuple[quality.RealKV, quality.RealKV]:
    def part(s: slice) -> quality.RealKV:
        return quality.RealKV(kv.keys[s], kv.values[s], kv.queries[s], kv.block_size)

    return part(slice(0, train)), part(slice(train, None))


def attention_loss(
    codec: LearnedCodec, kv: quality.RealKV, reference: torch.Tensor
) -> torch.Tensor:
    """Relative attention-output error with gradients through the (fp32) projection."""
    latent = codec.compressor(kv.blocks())
    keys, values = kv.unblock(codec.decompressor(latent))
    out = quality.attention(kv.queries, keys, values)
    return (out - reference).norm() / reference.norm()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=24, help="latent dimensions per head vector")
    parser.add_argument("--steps", type=int, default=30, help="Adam steps after PCA")
    parser.add_argument("--windows", type=int, default=6, help="windows of 512 tokens (2 held out)")
    parser.add_argument("--out", default="kv_learned.safetensors", help="where to save the codec")
    args = parser.parse_args()

    model, tokenizer = real.load_smollm2()
    kv = quality.capture(model, real.windows(tokenizer, args.windows, 512))
    train, test = split(kv, args.windows - 2)

    compressor, decompressor = fit_pca(train.blocks(), args.rank)
    codec = LearnedCodec(f"rank{args.rank}", compressor, decompressor)
    reference = quality.attention(train.queries, train.keys, train.values)
    print(f"PCA  train attention error {attention_loss(codec, train, reference).item():.4f}")

    params = [*compressor.parameters(), *decompressor.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = attention_loss(codec, train, reference)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  train attention error {loss.item():.4f}")
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s")

    # Save, then measure the codec as a user would load it: from the file.
    codec = LearnedCodec(f"rank{args.rank}", compressor, decompressor)
    codec.save(args.out)
    loaded = LearnedCodec.load(args.out).register(replace=True)
    assert loaded.format == codec.format
    print(f"saved {args.out}; registered {loaded.name}")

    held_out = quality.attention(test.queries, test.keys, test.values)
    pca = LearnedCodec("pca", *fit_pca(train.blocks(), args.rank))
    rows = [
        quality.codec_quality(c, test, held_out)
        for c in (get_codec("int8"), get_codec("int4"), pca, loaded)
    ]
    print(f"\nheld-out windows: {args.windows - 2}..{args.windows - 1} (not trained on)\n")
    print(quality.table({"rows": rows}))


if __name__ == "__main__":
    main()
