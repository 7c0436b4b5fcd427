"""What kvtier reads of vLLM's native offloading (``OffloadingConnector``): its chunk keys, and
where K and V of a chunk sit in its CPU tier's shared region.

vLLM 0.32's CPU tier (``SharedOffloadRegion``, filled by ``CPUOffloadingWorker``) keeps a chunk
— ``blocks_per_chunk`` GPU blocks of every layer — in one row of an mmap: a cell per worker (its
tensor-parallel rank), in rank order; in a cell the worker's layers in order; for a layer its
``blocks_per_chunk`` pages back to back, each one block of that layer's GPU cache byte for byte.
A page is ``[H, N, 2D]`` or ``[N, H, 2D]`` (the engine's resolved ``kv_cache_layout``, ``LBHNC``
or ``LBNHC``) with, in each ``2D``, a token's K then V (the ``channels`` split of the CUDA
attention backends, see :mod:`.paged`).

:class:`ChunkLayout` reads that geometry from the offloading spec — the one KV-cache group's
layers, the bytes a worker keeps per block, the KV dtype, the layout name — and the head size
from the model's config, and refuses by name what it cannot read (hybrid models, MLA, quantized
or canonical pages, context parallelism, a backend whose pages it does not know). Its
:meth:`~ChunkLayout.caches` are per-(worker, layer) ``[chunks, H, tokens, 2D]`` views of the
region, paged caches whose blocks are the chunks, which :class:`~.tiers.WorkerTiers` saves from
and loads into as it does vLLM's own GPU caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._torch import torch_dtype, torch_module
from ...errors import ConfigError, InvalidArgumentError
from .paged import BACKEND_LAYOUTS, PagedLayout

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_offload.base import OffloadKey

__all__ = ["ChunkLayout", "chunk_hash"]

_U64 = (1 << 64) - 1

#: vLLM's KV dtypes whose pages hold K/V as the model computed them, as kvtier names them.
KV_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
#: The cache layouts (``KVCacheLayout`` names and their old aliases) whose pages are one block
#: of one layer each, and whether a page is token-major (``[N, H, 2D]``).
PAGE_ORDERS = {"LBNHC": True, "NHD": True, "LBHNC": False, "HND": False}


def chunk_hash(key: OffloadKey) -> int:
    """A chunk's 64-bit hash for kvtier's core: the first 8 bytes of vLLM's block hash (a hash
    already: a chain of the prompt's tokens) with the KV-cache group mixed in. Equal for equal
    keys in every process, so two engines agree on it."""
    from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx

    h = int.from_bytes(get_offload_block_hash(key)[:8].ljust(8, b"\0"), "big")
    h ^= (get_offload_group_idx(key) * 0x9E3779B97F4A7C15) & _U64
    return h


@dataclass(frozen=True)
class ChunkLayout:
    """Where K and V of every chunk sit in vLLM's CPU tier (see the module's docstring)."""

    #: one worker's one layer of a chunk: its heads, the chunk's tokens, the head size, the split
    paged: PagedLayout
    #: the KV dtype, as kvtier names it
    dtype: str
    #: layers per worker
    layers: int
    #: workers (tensor-parallel ranks) whose cells make a chunk's row
    workers: int
    #: pages are ``[N, H, 2D]`` (else ``[H, N, 2D]``)
    token_major: bool
    #: bytes of one worker's cell of a chunk, and of one layer's part of it
    cell_bytes: int
    layer_bytes: int

    @property
    def name(self) -> str:
        """Names the layout in stored keys: chunks of one layout never load into another."""
        order = "nhd" if self.token_major else "hnd"
        return f"{self.paged.name}-{order}-l{self.layers}-w{self.workers}"

    @property
    def block_size(self) -> int:
        """Tokens of a chunk: kvtier's block."""
        return self.paged.block_size

    @property
    def chunk_bytes(self) -> int:
        return self.workers * self.cell_bytes

    @classmethod
    def from_spec(
        cls, spec: Any, *, attention_backend: str | None = None, head_dim: int | None = None
    ) -> ChunkLayout:
        """The layout of the chunks of ``spec`` (vLLM's ``OffloadingSpec``). The scheduler
        process that builds secondary tiers knows no attention backend: ``attention_backend``
        names it (default: ``FLASH_ATTN`` on CUDA, whose layout every CUDA backend of
        :data:`~.paged.BACKEND_LAYOUTS` shares; nothing elsewhere). ``head_dim``: the head size,
        read from the model's config when not given."""
        what = "KvtierTier"
        config = spec.config
        if len(config.groups) != 1:
            raise ConfigError(
                f"{what}: the model's KV cache has {len(config.groups)} groups (a hybrid or "
                "sliding-window model): kvtier reads one full-attention group"
            )
        if config.canonical_layout or config.replicated_layout:
            kind = "canonical_layout" if config.canonical_layout else "the replicated (MLA) layout"
            raise ConfigError(f"{what}: chunks in {kind} are not pages kvtier reads; turn it off")
        parallel = config.parallel
        if max(parallel.pcp_size, parallel.dcp_size, parallel.pp_size) > 1:
            raise ConfigError(
                f"{what}: context and pipeline parallelism split a block's tokens or layers "
                "across workers in ways kvtier does not read; tensor parallelism only"
            )
        dtype = KV_DTYPES.get(config.model.dtype)
        if dtype is None:
            raise ConfigError(
                f"{what}: KV cache dtype {config.model.dtype!r}: expected one of "
                f"{', '.join(KV_DTYPES)} (a quantized cache keeps scales kvtier does not read)"
            )
        backend = attention_backend or _platform_backend()
        split = BACKEND_LAYOUTS.get(backend)
        if split is None:
            raise ConfigError(
                f"{what}: attention backend {backend!r} is not one whose paged cache kvtier "
                f"knows where K and V are in ({', '.join(BACKEND_LAYOUTS)}): refused rather "
                "than guessed"
            )
        token_major = PAGE_ORDERS.get(str(config.kv_cache_layout))
        if token_major is None:
            raise ConfigError(
                f"{what}: KV cache layout {config.kv_cache_layout!r}: expected one of "
                f"{', '.join(PAGE_ORDERS)} (a page one block of one layer)"
            )
        (group,) = config.groups
        layers, gpu_block = len(group.layer_names), int(group.tokens_per_block)
        per_block, per_chunk = int(config.worker_kv_bytes_per_block), int(spec.blocks_per_chunk)
        elem = torch_dtype(dtype).itemsize
        dim = head_dim or _model_head_dim(config.model.name)
        heads, rest = divmod(per_block, layers * 2 * gpu_block * dim * elem)
        if rest or not heads:
            raise ConfigError(
                f"{what}: a worker's {per_block} B a block over {layers} layers is not 2 x "
                f"{gpu_block} tokens x kv_heads x {dim} (head_dim) x {elem} B each: not pages "
                "of full attention's K and V (MLA, padded or quantized pages) or not this "
                "head_dim"
            )
        if per_chunk > 1 and not token_major:
            raise ConfigError(
                f"{what}: {per_chunk} GPU blocks a chunk of {config.kv_cache_layout} pages "
                "(head-major) do not make one block of kvtier's: set the offloading block_size "
                "to the GPU's, or use a token-major (LBNHC) layout"
            )
        if split != "channels" and token_major:
            raise ConfigError(f"{what}: the {split} layout needs head-major (LBHNC) pages")
        return cls(
            PagedLayout(split, heads, gpu_block * per_chunk, dim),
            dtype,
            layers,
            int(parallel.world_size),
            token_major,
            per_block * per_chunk,
            per_block * per_chunk // layers,
        )

    def caches(self, region: memoryview) -> list[torch.Tensor]:
        """One paged cache per (worker, layer), worker-major, over ``region`` (the CPU tier's
        ``[chunks, row bytes]`` memoryview): ``[chunks, H, tokens, 2D]`` views whose block ``c``
        is chunk ``c``. They share the region's memory: nothing is copied."""
        torch = torch_module()
        shape, strides = region.shape or (), region.strides or ()
        if len(shape) != 2 or strides[0] < self.chunk_bytes:
            raise InvalidArgumentError(
                f"region: expected [chunks, row] with rows of at least {self.chunk_bytes} B "
                f"(a chunk of {self.name}), got shape {shape}, strides {strides}"
            )
        base = torch.frombuffer(region, dtype=torch.uint8).view(torch_dtype(self.dtype))
        elem = base.element_size()
        h, n, c = self.paged.num_kv_heads, self.block_size, 2 * self.paged.head_dim
        inner = (c, h * c, 1) if self.token_major else (n * c, c, 1)
        stride = (strides[0] // elem, *inner)
        return [
            base.as_strided(
                (shape[0], h, n, c),
                stride,
                (worker * self.cell_bytes + layer * self.layer_bytes) // elem,
            )
            for worker in range(self.workers)
            for layer in range(self.layers)
        ]


def _platform_backend() -> str:
    """The attention backend whose layout the platform's caches have, for a scheduler process
    that cannot ask its workers."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "FLASH_ATTN"
    raise ConfigError(
        f"KvtierTier: vLLM's native offloading on {current_platform.device_name or 'this'} "
        "platform: set attention_backend in the tier's config to the backend its workers run "
        f"(one of {', '.join(BACKEND_LAYOUTS)})"
    )


def _model_head_dim(model: str) -> int:
    """The head size of ``model`` (a local directory or a hub name in the local cache)."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model)
    except Exception as exc:
        raise ConfigError(
            f"KvtierTier: cannot read the config of model {model!r} for its head size ({exc}); "
            "set head_dim in the tier's config"
        ) from None
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    if getattr(text, "kv_lora_rank", None):
        raise ConfigError(f"KvtierTier: {model} uses MLA (a latent cache): not K/V pages")
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(dim)
