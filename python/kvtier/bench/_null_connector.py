"""A vLLM connector with nothing behind it: it never matches, loads or saves. What vLLM's own
connector path costs (its hooks around every attention layer, the metadata of every step),
measured beside kvtier's by ``benchmarks/vllm_overhead.py``: the part of the connector's cost
that no connector can avoid.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["NullConnector"]


class NullConnector(KVConnectorBase_V1):
    # worker side: nothing to load or save
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side: no match, so nothing is ever allocated for it
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
