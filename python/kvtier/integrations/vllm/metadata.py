"""What the connector's scheduler side tells its worker side each step (vLLM's connector
metadata): the loads and saves it decided, and the finished requests whose blocks wait for their
last save. The scheduler builds it (:mod:`.scheduler`), vLLM hands it to every worker
(:mod:`.worker`); the two sides share nothing else but the worker's answers over :mod:`.link`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KVTierMetadata", "LoadSpec", "SaveSpec"]


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
class SaveSpec:
    """Save the K/V of ``tokens`` (complete blocks, all of them computed by now) that the
    manager lacks, reading vLLM blocks ``block_ids``."""

    req_id: str
    salt: str | None
    tokens: list[int]
    block_ids: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps until their save is done (get_finished)
    finishing: set[str] = field(default_factory=set)
    #: the step runs no forward pass (what it scheduled waits for background loads, or
    #: nothing): the worker may wait for a load to end instead of returning at once
    idle: bool = False
    #: the tiers forget what they store before this step's loads (vLLM's
    #: ``reset_prefix_cache(reset_connector=True)``, ``/reset_prefix_cache?reset_connector=true``)
    reset: bool = False
