"""The connector's scheduler side: what the tiers can give each waiting request, and the loads
and saves of each step.

:class:`KVTierScheduler` asks the worker's tiers (over :mod:`.link`: directly in one process, else
over the worker's socket) how much of a prompt they hold and where, tells vLLM how many tokens
beyond its own hit it may load and whether in the background, and, once vLLM has allocated
blocks, plans the load. Each step it plans the saves of the prompt blocks that step completes,
and, when a request finishes, of the blocks it generated; the plan goes to the workers in
:class:`~.metadata.KVTierMetadata`. It never changes the tiers.

When vLLM publishes KV events (``--kv-events-config``), each save carries vLLM's keys of its
blocks (:func:`~.events.block_keys`), the worker announces what it stored and what its tiers
dropped (:mod:`.events`), and this side hands vLLM the workers' events (``take_events``).

A request whose ``kv_transfer_params`` say ``{"kvtier": {"release": true}}`` ends its
conversation (:func:`release_requested`): once it finishes, the next step's metadata has the
workers release its chain (:class:`~.metadata.ReleaseSpec`), which the tiers then evict first.

State, per request: its ``cache_salt`` and vLLM's request (from lookup to finish), the lookup's
hit until vLLM allocates, the admitted load until vLLM asks for its sources (the same step), and,
once scheduled, its blocks and how far they are saved. A request of unknown salt is never saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, KvtierError
from .events import KVTierEvents, block_keys
from .link import Held, Link, link_to_worker
from .metadata import KVTierMetadata, LoadSpec, ReleaseSpec, SaveSpec
from .metrics import CounterReports, Counters, connector_stats, hit_sources

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .config import ConnectorSettings
    from .metrics import KVTierStats

log = logging.getLogger("kvtier.vllm")

__all__ = ["KVTierScheduler", "release_asked", "release_requested"]


@dataclass
class _Hit:
    """What the tiers can load of a waiting request's prompt: ``tokens[start:end]``."""

    start: int  # vLLM's own hit
    end: int
    background: bool
    held: Held  # where the lookup found the prompt's blocks


@dataclass
class _Request:
    """The scheduler's view of a running request."""

    salt: str | None
    #: vLLM's request: its tokens so far (prompt and output) and block hashes
    request: Request
    block_ids: list[int]
    saved: int = 0  # tokens sent to the worker for saving


def keyed_by_tokens(request: Request) -> bool:
    """Whether a request's K/V follows from its token ids (and salt) alone, which kvtier keys
    blocks by: not where images, audio or prompt embeddings stand in for some of them (the same
    placeholder ids, other K/V). Such a request is neither loaded nor saved."""
    return not getattr(request, "mm_features", None) and (
        getattr(request, "prompt_embeds", None) is None
    )


def release_requested(request: Request) -> bool:
    """Whether ``request`` ends its conversation: its ``kv_transfer_params`` (vLLM's
    per-request connector parameters, a server request's ``kv_transfer_params`` field, or
    ``SamplingParams(extra_args={"kv_transfer_params": ...})``) hold ``{"kvtier": {"release":
    true}}``. Its chain will not be read again, so the tiers evict it first. A ``kvtier`` entry
    of another shape is ignored, with a warning."""
    return release_asked(getattr(request, "kv_transfer_params", None), request.request_id)


def release_asked(params: Any, request_id: str) -> bool:
    """:func:`release_requested` of request ``request_id``'s ``kv_transfer_params``."""
    entry = params.get("kvtier") if isinstance(params, dict) else None
    if entry is None:
        return False
    if not (isinstance(entry, dict) and set(entry) <= {"release"}) or not isinstance(
        entry.get("release", False), bool
    ):
        log.warning(
            "kvtier: request %s: kv_transfer_params['kvtier'] is %r; expected "
            '{"release": true} or {"release": false}: ignored',
            request_id,
            entry,
        )
        return False
    return bool(entry.get("release", False))


class KVTierScheduler:
    """The scheduler side of :class:`~.connector.KVTierConnector`: lookups, the loads and saves
    of each step, and the counts of lookups and hit tokens (by where they lay)."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings) -> None:
        self.settings = settings
        policy = settings.load_failure_policy
        if policy not in ("recompute", "fail"):
            raise ConfigError(
                f"load_failure_policy: expected 'recompute' or 'fail', got {policy!r}"
            )
        # A block the tiers cannot give back is a miss: vLLM recomputes it.
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        transfer.kv_load_failure_policy = policy
        #: lookups and hit tokens, by where the lookup found them
        self.counters = Counters()
        self._reports = CounterReports(self.counters)
        self._link: Link | None = None
        self._requests: dict[str, _Request] = {}
        self._hits: dict[str, _Hit] = {}
        #: this step's admitted loads, for get_external_cache_hit_sources: (start, held)
        self._admitted: dict[str, tuple[int, Held]] = {}
        #: each admitted request's cache_salt (a request of unknown salt is never saved)
        self._salts: dict[str, str | None] = {}
        self._loads: list[LoadSpec] = []
        #: finished requests whose chains the next step's metadata releases
        self._releases: list[ReleaseSpec] = []
        #: a reset asked for and not yet in a step's metadata: lookups miss until the worker
        #: has it (it forgets before that step's loads)
        self._reset_pending = False
        #: vLLM publishes KV events: saves carry vLLM's keys of their blocks
        events = vllm_config.kv_events_config
        self.kv_events = events is not None and bool(events.enable_kv_cache_events)
        #: each admitted request, for its tokens as it generates them (and its block hashes)
        self._vllm_requests: dict[str, Request] = {}
        #: the workers' KV events not yet taken by vLLM
        self._events: list[KVCacheEvent] = []

    @property
    def link(self) -> Link:
        """The worker's tiers as the scheduler sees them: directly in one process, else over
        the worker's socket (with tensor parallelism, all ranks as one)."""
        if self._link is None:
            self._link = link_to_worker(self.settings.engine_id, self.settings.tp_size)
        return self._link

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit the tiers can load, as far as loading them has been
        faster than computing them (:meth:`~.link.Held.paying`, by the worker's timing);
        loaded in the background (the request waits, others run) when some of them are on
        disk or on the server (``async_loads``: ``auto``), or always, or never."""
        salt = self._salts[request.request_id] = request.cache_salt or None
        if not keyed_by_tokens(request):
            return 0, False  # neither loaded nor saved (not in _vllm_requests)
        self._vllm_requests[request.request_id] = request
        if not self.settings.loads_kv or self._reset_pending:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        # vLLM computes at least the prompt's last token itself.
        try:
            held = self.link.lookup(tokens[: len(tokens) - 1], salt)
        except KvtierError as exc:
            log.warning("kvtier: lookup failed (%s); a miss", exc)
            return 0, False
        counters = self.counters
        counters.lookups += 1
        hit = held.paying(num_computed_tokens)  # only what loads faster than it computes
        counters.unpaid_tokens += max(0, held.tokens - hit)
        if hit <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        async_loads = self.settings.async_loads
        background = async_loads == "always" or (async_loads == "auto" and held.resident < hit)
        self._hits[request.request_id] = _Hit(num_computed_tokens, hit, background, held)
        counters.count_hits(held.places(num_computed_tokens, hit))
        return hit - num_computed_tokens, background

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        start = hit.start
        end = min(hit.end, start + num_external_tokens)
        bs = self.settings.block_size
        block_ids = list(blocks.get_block_ids()[0])[start // bs : end // bs]
        # A synchronous load runs before the step's saves: what the lookup found is there (a
        # background one may find less, which is a load error: recomputed).
        tokens = list(request.prompt_token_ids or [])[:end]
        salt = self._salts.get(request.request_id)
        load = LoadSpec(request.request_id, salt, tokens, start, block_ids, hit.background)
        self._loads.append(load)
        self._admitted[request.request_id] = (start, hit.held)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tokens vLLM admitted from the tiers for ``request`` this step, by the tier the
        lookup found them in (vLLM's ``vllm:prompt_tokens_cached_by_source``): ``host`` for
        host memory, ``disk``, and ``external_unspecified`` for the server (see
        :data:`~.metrics.HIT_SOURCES`)."""
        admitted = self._admitted.pop(request.request_id, None)
        if admitted is None:
            return hit_sources({}, num_external_tokens)
        start, held = admitted
        return hit_sources(held.places(start, start + num_external_tokens), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads, releases=self._releases)
        meta.tokens = scheduler_output.total_num_scheduled_tokens
        meta.idle = meta.tokens == 0
        meta.reset, self._reset_pending = self._reset_pending, False
        self._loads, self._releases = [], []
        self._admitted.clear()  # vLLM asks for a load's sources in the step that admits it
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._vllm_requests.get(new.req_id)
            if new.prompt_token_ids is None or request is None:
                continue  # prompt embeddings (no token ids to key them by), or salt unknown
            req = _Request(self._salts[new.req_id], request, list(new.block_ids[0]))
            self._requests[new.req_id] = req
            self._plan_save(meta, new.req_id, req, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                known.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, known, cached.num_computed_tokens[i] + scheduled[req_id])
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._salts.pop(req_id, None)
            self._vllm_requests.pop(req_id, None)
        return meta

    def _plan_save(self, meta: KVTierMetadata, req_id: str, req: _Request, computed: int) -> None:
        """Saves the request's blocks that are complete once this step has run (``computed``
        tokens), of its prompt and of what it generated (the next turn of a conversation starts
        with them), as far as vLLM knows their tokens: all of them, unless it schedules ahead
        of its outputs (async scheduling), where a generated block goes a step later."""
        if not self.settings.saves_kv:
            return
        bs = self.settings.block_size
        request = req.request
        # num_tokens: the prompt and the outputs vLLM has (no draft tokens, no placeholders).
        end = min(computed, request.num_tokens) // bs * bs
        if end <= req.saved:
            return
        req.saved = end
        blocks = end // bs
        tokens = list(request.all_token_ids[:end])
        save = SaveSpec(req_id, req.salt, tokens, req.block_ids[:blocks])
        if self.kv_events:
            save.keys = block_keys(request, blocks, bs)
        meta.saves.append(save)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. Its blocks are vLLM's to free at once: every complete one was
        saved in the step that computed it (:meth:`_plan_save`) or, with async scheduling
        (vLLM schedules a step before it has the outputs of the one before), is saved by the
        step running as vLLM finishes the request, within that step, before a later one can
        write to its blocks. Nothing waits for a later step, so a prefix-cache reset right
        after ``generate()`` finds no block held.

        A request that ends its conversation (:func:`release_requested`) has the next step's
        workers release what the tiers hold of its tokens, prompt and output: every save of
        it has run by then."""
        if keyed_by_tokens(request) and release_requested(request):
            tokens = list(request.all_token_ids)
            salt = request.cache_salt or None
            self._releases.append(ReleaseSpec(request.request_id, salt, tokens))
        self._requests.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        self._vllm_requests.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: the workers forget what their
        tiers store in the next step (its metadata says so), and every lookup misses until
        then. What a shared remote tier holds stays: other engines publish to it too."""
        self._reset_pending = True
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Keeps the workers' KV events of the step for :meth:`take_events`."""
        events = connector_output.kv_cache_events
        if isinstance(events, KVTierEvents):
            self._events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' KV events since the last call, in order: the blocks the tiers stored
        (``BlockStored``, medium ``CPU`` or ``STORAGE``) and dropped (``BlockRemoved``), keyed
        by vLLM's block hashes. vLLM publishes them with its own prefix cache's."""
        events, self._events = self._events, []
        return events

    def get_compression_stats(self) -> dict[str, Any]:
        """The worker's figures (asked over the link) with this side's lookups and hits."""
        return connector_stats(self.link.stats(), self.counters)

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """This side's counters since the last call."""
        return self._reports.take()
