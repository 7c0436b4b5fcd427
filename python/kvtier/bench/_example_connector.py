"""vLLM's ExampleConnector as ``kvtier bench vllm`` runs it: unchanged but for one clamp.

vLLM 0.32's ``ExampleConnector.get_num_new_matched_tokens`` returns its match minus the tokens
vLLM's own prefix cache already holds, which is negative when that cache holds more (a repeated
prompt whose shorter prefix the connector saved earlier); vLLM's Prometheus counter of external
hits then refuses the negative increment and the engine step raises. A negative count loads
nothing either way (``update_state_after_alloc`` loads only for a positive one), so clamping it
to 0 changes nothing else.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["ClampedExampleConnector"]


class ClampedExampleConnector(ExampleConnector):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (None if tokens is None else max(0, int(tokens))), bool(load_async)
