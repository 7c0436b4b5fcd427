"""What a codec does to real K/V: ``kvtier eval codecs [--json] [--codecs ...] [--load FILE]``.

K and V are captured from SmolLM2-135M reading WikiText-2 windows, exactly as the model stores
them in its cache (keys **after** RoPE), together with the real queries of every layer. Each
codec encodes the blocks and decodes them again; we report

- bytes per token, and their ratio to fp16;
- cosine similarity of each (token, head) vector of K and of V with the original, averaged, and
  the lowest block-average (the worst block);
- relative error ``||x' - x|| / ||x||`` of K and of V;
- attention-output relative error: causal attention of the real queries over the decoded K/V
  against the same over the original K/V, for every layer.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..cli import CommandParser, positive_int
from ..codecs import BlockShape, Codec, available_codecs, get_codec
from ..errors import ConfigError
from ..results import add_save_option, save_if_asked
from . import model as real

#: Windows of WikiText-2 read by the model, and their length in tokens.
WINDOWS = 4
WINDOW_TOKENS = 512
BLOCK_SIZE = 16
DEFAULT_CODECS = (
    "fp16",
    "int8",
    "int8-asym",
    "int4",
    "int4-g64",
    "int4-tok",
    "int4-sym",
    "int2",
    "int2-g64",
)


@dataclass
class RealKV:
    """K/V and queries of ``windows`` windows, all layers."""

    #: [windows, layers, kv_heads, tokens, head_dim], fp32, keys after RoPE
    keys: torch.Tensor
    values: torch.Tensor
    #: [windows, layers, heads, tokens, head_dim], after RoPE
    queries: torch.Tensor
    block_size: int = BLOCK_SIZE

    @property
    def shape(self) -> BlockShape:
        _, layers, heads, _, dim = self.keys.shape
        return BlockShape(layers, heads, self.block_size, dim, "fp32")

    def blocks(self) -> torch.Tensor:
        """``[windows * tokens / block_size, layers, 2, kv_heads, block_size, head_dim]``."""
        w, layers, heads, tokens, dim = self.keys.shape
        kv = torch.stack((self.keys, self.values), dim=2)  # [w, L, 2, H, T, D]
        kv = kv.reshape(w, layers, 2, heads, tokens // self.block_size, self.block_size, dim)
        blocks = kv.permute(0, 4, 1, 2, 3, 5, 6)
        return blocks.reshape(-1, layers, 2, heads, self.block_size, dim).contiguous()

    def unblock(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of :meth:`blocks`: ``(keys, values)`` like :attr:`keys`."""
        w, layers, heads, tokens, dim = self.keys.shape
        x = blocks.reshape(w, tokens // self.block_size, layers, 2, heads, self.block_size, dim)
        x = x.permute(0, 2, 3, 4, 1, 5, 6).reshape(w, layers, 2, heads, tokens, dim)
        return x[:, :, 0], x[:, :, 1]


def capture(model: Any, ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> RealKV:
    """Run ``model`` over ``ids`` ``[windows, tokens]`` and keep its cache and its queries."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    queries: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(index: int) -> Any:
        def grab(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = hidden.shape
            q = module.q_proj(hidden).view(b, t, -1, module.head_dim).transpose(1, 2)
            queries[index].append(apply_rotary_pos_emb(q, q, cos, sin)[0])

        return grab

    handles = [
        layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    keys, values = [], []
    try:
        with torch.no_grad():
            for window in ids:
                cache = model(window[None], use_cache=True).past_key_values
                keys.append(torch.stack([layer.keys[0] for layer in cache.layers]))
                values.append(torch.stack([layer.values[0] for layer in cache.layers]))
    finally:
        for handle in handles:
            handle.remove()
    q = torch.stack([torch.cat(per_layer) for per_layer in queries], dim=1)
    return RealKV(torch.stack(keys).float(), torch.stack(values).float(), q.float(), block_size)


def load_real_kv(
    windows: int = WINDOWS, tokens: int = WINDOW_TOKENS, text: Path | None = None
) -> RealKV:
    """The K/V and queries of SmolLM2 over ``windows`` windows of ``text`` (default:
    :func:`~kvtier.eval.model.wikitext_path`)."""
    model, tokenizer = real.load_smollm2()
    return capture(model, real.windows(tokenizer, windows, tokens, text))


def _vector_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1, eps=1e-12)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention ``[w, L, heads, T, D]`` over ``[w, L, kv_heads, T, D]`` (GQA)."""
    w, layers, heads, t, d = q.shape
    out = F.scaled_dot_product_attention(
        q.reshape(w * layers, heads, t, d),
        k.reshape(w * layers, k.shape[2], t, d),
        v.reshape(w * layers, v.shape[2], t, d),
        is_causal=True,
        enable_gqa=True,
    )
    return out.reshape(q.shape)


def codec_quality(
    codec: Codec, kv: RealKV, reference_out: torch.Tensor | None = None
) -> dict[str, Any]:
    """Measure one codec on real K/V (see the module docstring)."""
    blocks = kv.blocks()
    shape = kv.shape
    start = time.perf_counter()
    encoded = codec.encode(blocks)
    decoded = codec.decode(encoded, dtype=torch.float32)
    seconds = time.perf_counter() - start
    keys, values = kv.unblock(decoded)
    ref = reference_out if reference_out is not None else attention(kv.queries, kv.keys, kv.values)
    out = attention(kv.queries, keys, values)
    k_cos = _vector_cosine(keys, kv.keys)
    v_cos = _vector_cosine(values, kv.values)
    per_block = F.cosine_similarity(decoded.flatten(1), blocks.flatten(1), dim=1)
    bytes_per_block = codec.bytes_per_block(shape)
    return {
        "codec": codec.name,
        "format": codec.format,
        "bytes_per_token": bytes_per_block / shape.block_size,
        "ratio_vs_fp16": bytes_per_block / shape.fp16_bytes,
        "k_cosine": float(k_cos.mean()),
        "v_cosine": float(v_cos.mean()),
        "k_cosine_p01": float(k_cos.quantile(0.01)),
        "v_cosine_p01": float(v_cos.quantile(0.01)),
        "min_block_cosine": float(per_block.min()),
        "k_rel_error": _rel(keys, kv.keys),
        "v_rel_error": _rel(values, kv.values),
        "attn_rel_error": _rel(out, ref),
        "cpu_roundtrip_s": seconds,
    }


#: Measured variants of the built-in codecs, by the name ``--codecs`` knows them by.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "int8-asym": ("int8", {"asymmetric": True}),
    "int4-g16": ("int4", {"group_size": 16}),
    "int4-tok": ("int4", {"key_per_channel": False}),
    "int4-sym": ("int4", {"asymmetric": False}),
    "int8-g32": ("int8", {"group_size": 32}),
    "int2-g16": ("int2", {"group_size": 16}),
    "int2-g32": ("int2", {"group_size": 32}),
    "int2-tok": ("int2", {"key_per_channel": False}),
    "int2-sym": ("int2", {"asymmetric": False}),
    # plain symmetric per-token grouping, one scale per vector: magdir's equal-bytes peer
    "int4-sym-head": (
        "int4",
        {"asymmetric": False, "key_per_channel": False, "group_size": None},
    ),
}


def named(spec: str) -> Codec:
    """A codec from a name on the command line, including the measured variants above."""
    if spec in VARIANTS:
        base, options = VARIANTS[spec]
        codec = get_codec(base, **options)
        codec.name = spec
        return codec
    if spec not in available_codecs():
        known = sorted({*available_codecs(), *VARIANTS})
        raise ConfigError(
            f"unknown codec {spec!r}: expected one of {', '.join(known)}",
            hint="register your own with --load FILE.py (e.g. examples/magdir_codec.py)",
        )
    return get_codec(spec)


def run(
    codecs: Sequence[str | Codec], windows: int = WINDOWS, tokens: int = WINDOW_TOKENS
) -> dict[str, Any]:
    # Codecs and text first: a bad name or path must fail before the model takes its seconds
    # to load.
    resolved = [codec if isinstance(codec, Codec) else named(codec) for codec in codecs]
    text = real.wikitext_path()
    kv = load_real_kv(windows, tokens, text)
    reference = attention(kv.queries, kv.keys, kv.values)
    rows = [codec_quality(codec, kv, reference) for codec in resolved]
    return {
        "model": real.MODEL_ID,
        "text": str(text),
        "windows": windows,
        "window_tokens": tokens,
        "block_size": kv.block_size,
        "keys": "after RoPE, as the model caches them",
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    head = (
        "| codec | bytes/token | vs fp16 | K cos | V cos | K cos p1 | V cos p1 | K rel err "
        "| V rel err | attn out rel err |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['codec']} | {r['bytes_per_token']:.0f} | {r['ratio_vs_fp16']:.3f} "
        f"| {r['k_cosine']:.5f} | {r['v_cosine']:.5f} | {r['k_cosine_p01']:.4f} "
        f"| {r['v_cosine_p01']:.4f} | {r['k_rel_error']:.4f} | {r['v_rel_error']:.4f} "
        f"| {r['attn_rel_error']:.4f} |"
        for r in result["rows"]
    ]
    return head + "\n".join(lines)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def _window_tokens(text: str) -> int:
    # Blocks are cut from each window, so a window is a whole number of them.
    tokens = positive_int(text)
    if tokens % BLOCK_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected a multiple of {BLOCK_SIZE} (the block size), got {text!r}"
        )
    return tokens


def _codec_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of codec names, got {text!r}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="kvtier eval codecs",
        description="Encode and decode real SmolLM2-135M K/V (WikiText-2) with each codec and "
        "report bytes, cosine similarity, relative error and attention-output error.",
    )
    parser.add_argument(
        "--codecs",
        type=_codec_names,
        default=list(DEFAULT_CODECS),
        help=f"comma-separated codec names (default: {','.join(DEFAULT_CODECS)})",
    )
    parser.add_argument("--windows", type=positive_int, default=WINDOWS, help="WikiText-2 windows")
    parser.add_argument(
        "--tokens",
        type=_window_tokens,
        default=WINDOW_TOKENS,
        help=f"tokens per window, a multiple of {BLOCK_SIZE} (default: {WINDOW_TOKENS})",
    )
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="FILE.py",
        help="run a Python file first (to register codecs, e.g. examples/magdir_codec.py)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_save_option(parser)
    args = parser.parse_args(argv)
    for path in args.load:
        runpy.run_path(path)
    codecs = [named(name) for name in args.codecs]  # after --load, which may register some
    print(f"capturing K/V: {args.windows} x {args.tokens} tokens ...", file=sys.stderr)
    result = run(codecs, args.windows, args.tokens)
    print(to_json(result) if args.json else table(result))
    save_if_asked(args, result, parser.prog, argv)
    return 0
