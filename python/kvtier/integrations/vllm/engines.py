"""In-process vLLM engines with the connector, for the command line's measurements (``kvtier
bench vllm``, ``kvtier eval vllm``): the environment they run under, the connector's transfer
config, an engine's scheduler-side connector, closing an engine so that the next one of the
process can start, and vLLM's prints kept off stdout. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ENGINE_ENV",
    "close_engine",
    "connector_transfer",
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
