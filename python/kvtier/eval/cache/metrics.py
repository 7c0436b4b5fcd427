"""What ``kvtier eval cache`` measures of each method on the model (see :mod:`kvtier.eval.cache`):
perplexity of the second half of each window, passkey retrieval, the KV bytes a cache holds,
and the speed of ``generate``; :func:`run` measures every method chosen."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...integrations.hf import TieredCache
from .. import model as real
from .methods import Method, available

__all__ = [
    "CHUNK",
    "PASSKEY_DEPTHS",
    "PASSKEY_LENGTHS",
    "SPEED_NEW",
    "SPEED_PROMPTS",
    "WINDOWS",
    "WINDOW_TOKENS",
    "against_baseline",
    "cache_bytes",
    "passkey",
    "passkey_prompt",
    "perplexity",
    "run",
    "speed",
]

WINDOWS = 8
WINDOW_TOKENS = 1024
CHUNK = 16
PASSKEY_LENGTHS = (1024, 2048)
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
SPEED_PROMPTS = (512, 4096)
SPEED_NEW = 64


# -- bytes -----------------------------------------------------------------------------------------


def _tensor_bytes(obj: Any, as_fp16: bool) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses such as quanto's are
    opened with ``__tensor_flatten__``); ``as_fp16`` counts floating-point elements at 2 bytes."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = flatten()
            return sum(_tensor_bytes(getattr(obj, n), as_fp16) for n in names)
        size = 2 if as_fp16 and obj.is_floating_point() else obj.element_size()
        return obj.numel() * size
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, as_fp16) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, as_fp16) for v in obj)
    return 0


def cache_bytes(cache: Any) -> tuple[int, int]:
    """``(real, fp16_equivalent)`` K/V bytes the cache holds now."""
    if isinstance(cache, TieredCache):
        held = cache.kv_bytes()
        bm = cache.manager
        assert bm is not None
        fp16_block = bm.shape.fp16_bytes
        level0 = held["blocks"][0]
        return held["held"], held["held"] - level0 * (bm.level_bytes[0] - fp16_block)
    # transformers' layers keep their tensors in attributes (quantized ones in their own types).
    parts = [vars(layer) for layer in cache.layers]
    return _tensor_bytes(parts, False), _tensor_bytes(parts, True)


def _release(cache: Any) -> None:
    if isinstance(cache, TieredCache):
        cache.close()


def _prefill(model: Any, method: Method, ids: torch.Tensor, cache: Any) -> Any:
    """One forward pass of ``ids`` (a row of token ids) into the empty ``cache``, with the
    method's press, if any, compressing the cache during it; the model's output."""
    if method.press is None:
        return model(ids[None], past_key_values=cache, use_cache=True)
    with method.press()(model):
        # kvpress's hooks tell a prefill by the ``cache_position`` keyword, which transformers
        # no longer passes to attention layers (since 5.3): pass it, the layers hand it on.
        return model(
            ids[None], past_key_values=cache, use_cache=True, cache_position=torch.arange(len(ids))
        )


def _positions(start: int, count: int) -> torch.Tensor:
    # Explicit positions: after a press the cache holds fewer tokens than the text has, and
    # the model would otherwise number the next ones from the cache's length.
    return torch.arange(start, start + count)[None]


@torch.no_grad()
def _greedy(
    model: Any,
    method: Method,
    prompt: torch.Tensor,
    new_tokens: int,
    eos: int | None = None,
    on_logits: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Greedy decoding token by token after a prefill of ``prompt`` (the new tokens), for the
    methods ``generate`` cannot serve: a press leaves fewer tokens in the cache than the
    prompt has, where ``generate`` would take the cache's length for the next position."""
    cache = method.make(model)
    try:
        logits = _prefill(model, method, prompt, cache).logits[0, -1]
        out: list[int] = []
        while True:
            on_logits()
            out.append(int(logits.argmax()))
            if len(out) == new_tokens or out[-1] == eos:
                return torch.tensor(out)
            step = torch.tensor([[out[-1]]])
            position = _positions(len(prompt) + len(out) - 1, 1)
            logits = model(
                step, past_key_values=cache, use_cache=True, position_ids=position
            ).logits[0, -1]
    finally:
        _release(cache)


# -- perplexity ------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(
    model: Any, method: Method, windows: torch.Tensor, chunk: int = CHUNK
) -> dict[str, Any]:
    """Perplexity of the second half of each window given the first (see
    :mod:`kvtier.eval.cache`)."""
    nll, count, real_bytes, fp16_bytes = 0.0, 0, 0, 0
    start = time.perf_counter()
    for ids in windows:
        context = len(ids) // 2
        cache = method.make(model)
        try:
            logits = _prefill(model, method, ids[:context], cache).logits[0, -1:]
            for s in range(context, len(ids) - 1, chunk):
                part = ids[s : min(s + chunk, len(ids) - 1)]
                position = _positions(s, len(part))
                out = model(
                    part[None], past_key_values=cache, use_cache=True, position_ids=position
                ).logits[0]
                logits = torch.cat([logits, out])
            target = ids[context:]
            nll += float(F.cross_entropy(logits.float(), target, reduction="sum"))
            count += len(target)
            b = cache_bytes(cache)
            real_bytes += b[0]
            fp16_bytes += b[1]
        finally:
            _release(cache)
    return {
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "kv_bytes": real_bytes // len(windows),
        "kv_bytes_fp16": fp16_bytes // len(windows),
        "seconds": time.perf_counter() - start,
    }


# -- passkey ---------------------------------------------------------------------------------------

_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there.\n"
)
_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> torch.Tensor:
    """Token ids of a prompt of about ``length`` tokens with ``key`` at ``depth`` (0 = start of
    the filler, 1 = its end)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(_INTRO + needle + _QUESTION).input_ids)
    per_filler = len(tokenizer(_FILLER * 10).input_ids) / 10
    fillers = max(1, round((length - fixed) / per_filler))
    before = round(fillers * depth)
    text = _INTRO + _FILLER * before + needle + _FILLER * (fillers - before) + _QUESTION
    return tokenizer(text, return_tensors="pt").input_ids[0]


@torch.no_grad()
def passkey(
    model: Any,
    tokenizer: Any,
    method: Method,
    lengths: tuple[int, ...] = PASSKEY_LENGTHS,
    depths: tuple[float, ...] = PASSKEY_DEPTHS,
    seed: int = 0,
) -> dict[str, Any]:
    """Exact-match accuracy of retrieving a random 5-digit key, one trial per (length, depth)."""
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randrange(10_000, 100_000))
            ids = passkey_prompt(tokenizer, length, depth, key)[None]
            if method.press is not None:
                new = _greedy(model, method, ids[0], 8, tokenizer.eos_token_id)
            else:
                cache = method.make(model)
                try:
                    out = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        past_key_values=cache,
                        do_sample=False,
                        max_new_tokens=8,
                        pad_token_id=tokenizer.eos_token_id,
                    )
                finally:
                    _release(cache)
                new = out[0, ids.shape[1] :]
            answer = tokenizer.decode(new)
            found = "".join(c for c in answer.strip()[:8] if c.isdigit())[:5]
            trials.append(
                {"tokens": ids.shape[1], "depth": depth, "key": key, "found": found == key}
            )
    return {"accuracy": sum(bool(t["found"]) for t in trials) / len(trials), "trials": trials}


# -- speed -----------------------------------------------------------------------------------------


class _StepClock:
    """A logits processor that notes when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.tick()
        return scores

    def tick(self) -> None:
        self.times.append(time.perf_counter())


@torch.no_grad()
def speed(
    model: Any, method: Method, prompt: torch.Tensor, new_tokens: int = SPEED_NEW
) -> dict[str, Any]:
    """A greedy ``generate`` of ``new_tokens`` after ``prompt`` (for a press, the same greedy
    decoding token by token): the prefill's seconds (to the first token's logits) and the decode
    rate (one over the median step between new tokens)."""
    from transformers import LogitsProcessorList

    ids = prompt[None]
    clock = _StepClock()
    if method.press is not None:
        start = time.perf_counter()
        _greedy(model, method, prompt, new_tokens, on_logits=clock.tick)
        return _rates(clock.times, start, len(prompt), new_tokens)
    cache = method.make(model)
    try:
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.generation_config.eos_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    finally:
        _release(cache)
    return _rates(clock.times, start, int(ids.shape[1]), new_tokens)


def _rates(times: list[float], start: float, prompt: int, new_tokens: int) -> dict[str, Any]:
    in_order = [b - a for a, b in itertools.pairwise(times)]
    steps = sorted(in_order)
    # The median step: on a shared machine a few steps stall on other work, and the mean
    # would carry those stalls into one method's figure and not another's.
    median = steps[len(steps) // 2] if steps else 0.0
    return {
        "prompt": prompt,
        "new_tokens": new_tokens,
        "prefill_s": times[0] - start,
        "decode_tokens_per_s": 1 / median if median > 0 else None,
        "decode_mean_tokens_per_s": len(steps) / sum(steps) if steps else None,
        "decode_step_s_samples": in_order,  # every step, in order: the spread of the median
    }


def against_baseline(rows: list[dict[str, Any]]) -> None:
    """Adds each row's figures against the ``dynamic`` row's (perplexity change, bytes, decode
    speed), when there is one."""
    base = next((r for r in rows if r["method"] == "dynamic"), None)
    if base is None:
        return
    base_speed = {sp["prompt"]: sp["decode_tokens_per_s"] for sp in base.get("speed", [])}
    for r in rows:
        r["ppl_change"] = r["perplexity"] / base["perplexity"] - 1
        r["bytes_vs_dynamic"] = r["kv_bytes"] / base["kv_bytes"]
        r["bytes_vs_fp16"] = r["kv_bytes_fp16"] / base["kv_bytes_fp16"]
        for mine in r.get("speed", []):
            theirs = base_speed.get(mine["prompt"])
            if mine["decode_tokens_per_s"] and theirs:
                mine["vs_baseline"] = mine["decode_tokens_per_s"] / theirs


def run(
    names: list[str],
    windows: int = WINDOWS,
    tokens: int = WINDOW_TOKENS,
    chunk: int = CHUNK,
    lengths: tuple[int, ...] = PASSKEY_LENGTHS,
    depths: tuple[float, ...] = PASSKEY_DEPTHS,
    speed_new: int = SPEED_NEW,
    speed_prompts: tuple[int, ...] = SPEED_PROMPTS,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    # Methods and text first: a bad name or path must fail before the model takes its seconds
    # to load.
    chosen, skipped = available(names)
    source = real.wikitext_path()
    _, tokenizer = real.load_smollm2("eager")
    text = real.windows(tokenizer, windows, tokens, source)
    prompts = [real.windows(tokenizer, 1, n, source)[0] for n in speed_prompts] if speed_new else []
    rows = []
    for method in chosen:
        model, _ = real.load_smollm2(method.attn)
        progress(f"{method.name}: perplexity")
        row: dict[str, Any] = {"method": method.name, "about": method.about}
        row.update(perplexity(model, method, text, chunk))
        if lengths and depths:
            progress(f"{method.name}: passkey")
            row["passkey"] = passkey(model, tokenizer, method, lengths, depths)
        row["attn"] = method.attn
        for prompt in prompts:
            progress(f"{method.name}: speed, {len(prompt)}-token prompt")
            row.setdefault("speed", []).append(speed(model, method, prompt, speed_new))
        rows.append(row)
    against_baseline(rows)
    return {
        "model": real.MODEL_ID + " (fp32, CPU; attention per method)",
        "text": str(source),
        "windows": windows,
        "window_tokens": tokens,
        "scored": "second half of each window, after a prefill of the first half",
        "chunk": chunk,
        "passkey_lengths": list(lengths),
        "passkey_depths": list(depths),
        "speed": f"generate, {speed_new} new tokens, greedy, after prompts of "
        f"{', '.join(map(str, speed_prompts))} tokens: decode tokens/s",
        "threads": torch.get_num_threads(),
        "skipped": skipped,
        "rows": rows,
    }
