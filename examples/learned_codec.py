"""Train a learned KV compressor on real K/V, save it, load it back as a codec, measure it.

The compressor is the common kind people write for HF caches: per layer and per K/V, a linear
projection of each head vector from ``head_dim`` to ``rank`` dimensions (stored in fp16) and
back. Training has two stages, both on K/V captured from SmolLM2-135M reading WikiText-2:

1. PCA: the projection with the least squared error (closed form);
2. a few Adam steps on what attention actually sees — the error of the attention output for the
   model's real queries — starting from PCA.

Quality is reported on held-out windows (text the codec never saw), beside ``int4`` and ``int8``:

    python examples/learned_codec.py --rank 24 --steps 30 --out /tmp/kv_rank24.safetensors

``--save PATH`` also writes the result with its provenance (``kvtier.results``): the training's
attention errors and, per codec, the held-out figures of the table (``kvtier eval codecs``'s rows).
The saved file is loaded with ``LearnedCodec.load(path)`` and registered as ``learned:<name>``,
so a ladder such as ``fp16,int8,learned:rank24`` can use it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvtier.codecs import LearnedCodec, fit_pca, get_codec
from kvtier.eval import codecs as quality
from kvtier.eval import model as real
from kvtier.results import add_save_option, save_if_asked


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
    add_save_option(parser)
    args = parser.parse_args()

    model, tokenizer = real.load_smollm2()
    kv = quality.capture(model, real.windows(tokenizer, args.windows, 512))
    train, test = split(kv, args.windows - 2)

    compressor, decompressor = fit_pca(train.blocks(), args.rank)
    codec = LearnedCodec(f"rank{args.rank}", compressor, decompressor)
    reference = quality.attention(train.queries, train.keys, train.values)
    pca_error = attention_loss(codec, train, reference).item()
    print(f"PCA  train attention error {pca_error:.4f}")

    params = [*compressor.parameters(), *decompressor.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    start = time.perf_counter()
    losses = []  # the train attention error before each step
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = attention_loss(codec, train, reference)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  train attention error {loss.item():.4f}")
    train_s = time.perf_counter() - start
    print(f"trained {args.steps} steps in {train_s:.1f} s")

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
    result: dict[str, Any] = {
        "model": "smollm2-135m",
        "text": str(real.wikitext_path()),
        "window_tokens": 512,
        "block_size": kv.block_size,
        "keys": "after RoPE, as the model caches them",
        "rank": args.rank,
        "steps": args.steps,
        "learning_rate": 1e-3,
        "train_windows": list(range(args.windows - 2)),
        "held_out_windows": [args.windows - 2, args.windows - 1],
        "training": {
            "pca_train_attn_rel_error": pca_error,
            "train_attn_rel_error_before_step": losses,
            "train_s": train_s,
        },
        # on the held-out windows: int8, int4, the PCA projection untrained, the trained one
        "rows": rows,
    }
    save_if_asked(args, result, "python examples/learned_codec.py", None)


if __name__ == "__main__":
    main()
