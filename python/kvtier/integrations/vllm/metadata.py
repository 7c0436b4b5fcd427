"""What the connector's scheduler side tells its worker side each step (vLLM's connector
metadata): the loads and saves it decided. The scheduler builds it (:mod:`.scheduler`), vLLM
hands it to every worker (:mod:`.worker`); the two sides share nothing else but the worker's
answers over :mod:`.link`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockKeys", "KVTierMetadata", "LoadSpec", "ReleaseSpec", "SaveSpec"]


@dataclass
class LoadSpec:
    """Copy the K/V of ``tokens[start:]`` (whole blocks, which the tiers held at lookup) into
    vLLM blocks ``block_ids`` (one per ``block_size`` tokens)."""

    req_id: str
    salt: str | None  # the request's cache_salt
    tokens: list[int]
    start: int
    block_ids: list[int]
    #: in the worker's background, the request waiting meanwhile (vLLM's async load)
    background: bool = False


@dataclass
class BlockKeys:
    """vLLM's own keys of a request's leading blocks, as its prefix cache publishes them in KV
    events (:mod:`vllm.distributed.kv_events`): for the worker to announce the blocks it
    stores under the keys a router knows them by."""

    #: the block hashes (``request.block_hashes``, as vLLM's events carry them), one a block
    hashes: list[Any]
    #: each block's extra keys (cache salt, LoRA name, multimodal inputs) as events carry them
    extra_keys: list[Any] | None = None
    lora_id: int | None = None
    lora_name: str | None = None

    def head(self, blocks: int) -> BlockKeys:
        """The keys of the first ``blocks`` blocks."""
        extra = None if self.extra_keys is None else self.extra_keys[:blocks]
        return replace(self, hashes=self.hashes[:blocks], extra_keys=extra)


@dataclass
class SaveSpec:
    """Save the K/V of ``tokens`` (complete blocks, all of them computed by now) that the
    manager lacks, reading vLLM blocks ``block_ids``."""

    req_id: str
    salt: str | None
    tokens: list[int]
    block_ids: list[int]
    #: vLLM's keys of the blocks, when the engine publishes KV events (else None)
    keys: BlockKeys | None = None

    def head(self, blocks: int, block_size: int) -> SaveSpec:
        """The save of the first ``blocks`` blocks (of ``block_size`` tokens) only."""
        tokens, block_ids = self.tokens[: blocks * block_size], self.block_ids[:blocks]
        keys = None if self.keys is None else self.keys.head(blocks)
        return replace(self, tokens=tokens, block_ids=block_ids, keys=keys)


@dataclass
class ReleaseSpec:
    """A finished request's conversation has ended (its ``kv_transfer_params`` said
    ``{"kvtier": {"release": true}}``): the tiers evict the blocks they hold of ``tokens``
    (whole blocks, as its saves wrote them) before every block not released."""

    req_id: str
    salt: str | None
    tokens: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: finished requests whose chains are released, after the steps that saved them
    releases: list[ReleaseSpec] = field(default_factory=list)
    #: the step runs no forward pass (what it scheduled waits for background loads, or
    #: nothing): the worker may wait for a load to end instead of returning at once
    idle: bool = False
    #: the tokens the step computes (vLLM's scheduled tokens: the worker times its prefill)
    tokens: int = 0
    #: the tiers forget what they store before this step's loads (vLLM's
    #: ``reset_prefix_cache(reset_connector=True)``, ``/reset_prefix_cache?reset_connector=true``)
    reset: bool = False
