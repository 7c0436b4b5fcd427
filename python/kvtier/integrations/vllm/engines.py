"""In-process vLLM engines with the connector, for the command line's measurements (``kvtier
bench vllm``, ``kvtier eval vllm``): the environment they run under, an engine and the
connector's transfer config, an engine's scheduler-side connector, closing an engine so that
the next one of the process can start, and a measurement's report with vLLM's prints kept off
stdout. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_ENV",
    "close_engine",
    "connector_transfer",
    "engine",
    "report",
    "scheduler_connector",
    "stdout_to_stderr",
]

#: vLLM in this process, on loopback only, offline; set unless the environment says otherwise.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's listeners on loopback too
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # vLLM drops to one thread otherwise
}


def connector_transfer(
    extra: dict[str, Any],
    connector: str = "KVTierConnector",
    module: str = "kvtier.integrations.vllm",
) -> Any:
    """vLLM's ``KVTransferConfig`` of a connector (kvtier's unless named) saving and loading
    (``kv_both``) with ``extra`` as its extra config."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def engine(
    model_dir: Path, context: int, block_size: int, transfer: Any = None, **options: Any
) -> Any:
    """An in-process engine of the model in ``model_dir``: bf16, eager, seed 0, its stats on
    (vLLM's counters and histograms, ``get_metrics``, need the stat loggers), ``transfer`` its
    ``KVTransferConfig`` (None: no connector), ``options`` more ``LLM`` arguments."""
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=context,
        block_size=block_size,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=transfer,
        **options,
    )


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def close_engine(llm: Any) -> None:
    """Stops ``llm`` and tears torch.distributed down, so that another engine can start in
    this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def report(
    measure: Callable[[Callable[..., None]], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    json_only: bool,
) -> dict[str, Any]:
    """Runs ``measure(log)`` with what the engines print sent to stderr, then prints its
    ``table`` on stderr (unless ``json_only``) and its result as JSON on stdout; returns the
    result."""

    def log(*parts: object) -> None:
        print(*parts, file=sys.stderr, flush=True)

    with stdout_to_stderr():
        result = measure(log)
    if not json_only:
        log(table(result))
    print(json.dumps(result, indent=2))
    return result


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Sends what the engines print (native code included) to stderr, keeping stdout for a
    command's JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
