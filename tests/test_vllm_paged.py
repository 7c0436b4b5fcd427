"""The vLLM connector's data path without a vLLM engine: paged layouts (where K and V of each
token sit in an attention backend's cache) and the save/load of whole blocks through a
BlockManager, on the CPU and, on a GPU, on CUDA caches laid out as vLLM's CUDA backends lay them,
byte for byte against the CPU path; and on caches vLLM's own backend classes, allocator and CPU
kernel make."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier import BlockManager, ConfigError, KvtierConfig
from kvtier.codecs import BlockShape, get_codec
from kvtier.integrations.vllm.paged import (
    BACKEND_LAYOUTS,
    PagedBlocks,
    PagedLayout,
    layout_for_backend,
)
from kvtier.integrations.vllm.tiers import LayerLoads, WorkerTiers

torch = pytest.importorskip("torch")

H, N, D = 3, 16, 64  # kv heads, block size, head dim


def per_token_kv(blocks: int, seed: int) -> Any:
    """K and V of ``blocks * N`` tokens, ``[2, tokens, H, D]``, bf16, all distinct."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, blocks * N, H, D), generator=g).to(torch.bfloat16)


def cpu_backend_cache(num_blocks: int, kv: Any, block_ids: list[int], *, isa: str) -> Any:
    """A cache as vLLM 0.32's CPU backend writes it (``cpu_attn_reshape_and_cache``, by the
    element formulas of ``csrc/cpu/cpu_attn_vec.hpp`` and ``cpu_attn_amx.hpp``): each block's
    ``[H, N, 2D]`` is, per head, N * D elements of K then N * D of V, packed for the ISA."""
    cache = torch.zeros((num_blocks, H, N, 2 * D), dtype=torch.bfloat16)
    flat = cache.view(num_blocks, H, 2, N * D)
    for i, b in enumerate(block_ids):
        for n in range(N):
            k, v = kv[0, i * N + n], kv[1, i * N + n]  # [H, D] each
            for d in range(D):
                if isa == "amx":
                    # K: tiles of 16 tokens, each a row of channel pairs (int32 quadwords)
                    k_at = 2 * ((n // 16) * 16 * (D // 2) + (d // 2) * 16 + n % 16) + d % 2
                    # V: tiles of 16 channels, each a row of token pairs
                    v_at = (d // 16) * N * 16 + (n // 2) * 32 + (d % 16) * 2 + n % 2
                else:  # vec, vec16: K column-major [D, N], V row-major [N, D]
                    k_at, v_at = d * N + n, n * D + d
                flat[b, :, 0, k_at] = k[:, d]
                flat[b, :, 1, v_at] = v[:, d]
    return cache


def flash_cache(num_blocks: int, kv: Any, block_ids: list[int], *, nhd: bool) -> Any:
    """A cache as vLLM's CUDA backends see it: ``[B, H, N, 2D]`` split along the channels
    (``kv_cache.transpose(1, 2).split(head_size, -1)``), in memory ``[B, N, H, 2D]`` (``nhd``,
    the LBNHC layout) or ``[B, H, N, 2D]`` (LBHNC)."""
    if nhd:
        cache = torch.zeros((num_blocks, N, H, 2 * D), dtype=torch.bfloat16).transpose(1, 2)
    else:
        cache = torch.zeros((num_blocks, H, N, 2 * D), dtype=torch.bfloat16)
    for i, b in enumerate(block_ids):
        k = kv[0, i * N : (i + 1) * N].transpose(0, 1)  # [H, N, D]
        v = kv[1, i * N : (i + 1) * N].transpose(0, 1)
        cache[b] = torch.cat((k, v), dim=-1)
    return cache


CASES = {
    "cpu-amx": ("CPU_ATTN:amx", lambda nb, kv, ids: cpu_backend_cache(nb, kv, ids, isa="amx")),
    "cpu-vec": ("CPU_ATTN:vec", lambda nb, kv, ids: cpu_backend_cache(nb, kv, ids, isa="vec")),
    "cpu-vec16": (
        "CPU_ATTN:vec16",
        lambda nb, kv, ids: cpu_backend_cache(nb, kv, ids, isa="vec16"),
    ),
    "flash-nhd": ("FLASH_ATTN", lambda nb, kv, ids: flash_cache(nb, kv, ids, nhd=True)),
    "flash-hnd": ("FLASH_ATTN", lambda nb, kv, ids: flash_cache(nb, kv, ids, nhd=False)),
    # vLLM 0.32's triton_attn, flashinfer and flex_attention read their caches as flash_attn
    # does: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    "triton": ("TRITON_ATTN", lambda nb, kv, ids: flash_cache(nb, kv, ids, nhd=True)),
    "flashinfer": ("FLASHINFER", lambda nb, kv, ids: flash_cache(nb, kv, ids, nhd=False)),
    "flex": ("FLEX_ATTENTION", lambda nb, kv, ids: flash_cache(nb, kv, ids, nhd=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_reads_and_writes_what_its_backend_means(case: str) -> None:
    backend, make = CASES[case]
    kv = per_token_kv(3, seed=1)
    ids = [5, 0, 2]
    cache = make(8, kv, ids)
    layout = layout_for_backend(backend, cache, num_kv_heads=H, block_size=N, head_dim=D)
    assert layout.split == (case[:7] if backend.startswith("CPU_ATTN") else "channels")
    assert torch.equal(layout.read(cache, torch.tensor(ids)), kv)
    # Writing into other blocks makes the same cache the backend would have written.
    other = [1, 7, 3]
    got = make(8, per_token_kv(3, seed=2), [4])  # unrelated content elsewhere
    before = got.clone()
    layout.write(got, torch.tensor(other), kv)
    want = make(8, kv, other)
    for b in range(8):
        assert torch.equal(got[b], want[b] if b in other else before[b]), b


def test_a_cache_that_is_not_a_supported_layout_is_refused_clearly() -> None:
    mla = torch.zeros((4, 1, N, 576), dtype=torch.bfloat16)  # a latent cache, one "head"
    with pytest.raises(ConfigError, match=r"expected a \[num_blocks, 3, 16, 128\] paged cache"):
        layout_for_backend("FLASH_ATTN", mla, num_kv_heads=H, block_size=N, head_dim=D)
    strided = torch.zeros((4, N, H, 2 * D), dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ConfigError, match="needs them contiguous"):
        layout_for_backend("CPU_ATTN:amx", strided, num_kv_heads=H, block_size=N, head_dim=D)
    layout = PagedLayout("channels", H, N, D)
    with pytest.raises(kvtier_error(), match=r"kv: expected shape \[2, 32, 3, 64\]"):
        layout.write(torch.zeros((4, H, N, 2 * D)), torch.tensor([0, 1]), per_token_kv(1, 0))


@pytest.mark.parametrize(
    "backend", ["ROCM_ATTN", "ROCM:FLASH_ATTN", "XFORMERS", "FLASHMLA", "CPU_ATTN:neon"]
)
def test_a_backend_whose_layout_kvtier_does_not_know_is_refused_by_name(backend: str) -> None:
    """ROCM_ATTN holds a block as [2, N, H * head_dim]: for two KV heads the very shape of the
    channel split, with "V of head 0" holding the keys of head 1. So is ROCm's AITER
    FlashAttention with shuffled caches, which calls itself FLASH_ATTN (the connector names it
    ROCM:FLASH_ATTN). Refused by name, never read as another backend's layout."""
    two_heads = torch.zeros((4, 2, N, 2 * D), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=rf"attention backend {backend} is not one .* refused"):
        layout_for_backend(backend, two_heads, num_kv_heads=2, block_size=N, head_dim=D)


def kvtier_error() -> Any:
    from kvtier import InvalidArgumentError

    return InvalidArgumentError


# -- caches as vLLM's own classes make them -----------------------------------------------------

#: The CUDA backends whose caches kvtier reads (BACKEND_LAYOUTS' ``channels``). FLASHINFER's class
#: imports the flashinfer package, CUDA-only: where it is not installed (any CPU machine), that
#: backend is checked on caches built by hand (CASES) only.
CUDA_BACKENDS = ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"]
#: The instruction sets vLLM's CPU backend packs caches for here (amx: a CPU with AMX tiles).
CPU_ISAS = ["vec", "vec16"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])


def vllm_layer_caches(layout: Any, dtype: Any, block_size: int, blocks: int = 8) -> list[Any]:
    """Two layers' caches as vLLM's worker allocates them in ``layout`` (a ``KVCacheLayout``,
    as its engine core resolves one): vLLM's KV cache config for the layers' full-attention
    spec, and its ``[B, H, N, 2D]`` views of one buffer."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        create_kv_cache_views,
    )

    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout.name
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=dtype)
    group = KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)
    budget = blocks * LAYERS * spec.page_size_bytes
    kv_config = get_kv_cache_config_from_groups(config, [group], budget)
    [tensor] = kv_config.kv_cache_tensors
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, kv_config.num_blocks, layout, tensor)


def cuda_backend_kv(cache: Any) -> tuple[Any, Any]:
    """K and V caches, ``[B, N, H, D]`` each, as vLLM 0.32's CUDA backends read a layer's cache
    (flash_attn, triton_attn, flashinfer and flex_attention:
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``)."""
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    return k, v


def saved_and_loaded(layout: PagedLayout, caches: list[Any], dtype: Any, n: int) -> None:
    """Saves blocks 5, 0 and 2 of ``caches`` into a BlockManager of ``dtype`` and loads them
    back into blocks 1, 7 and 3 (block size ``n``)."""
    from kvtier._torch import dtype_name

    name = dtype_name(dtype)
    cfg = KvtierConfig(block_size=n, device_budget=1 << 20, ladder=(name,), recent_window=0)
    bm = BlockManager(cfg, LAYERS, H, D, dtype=name, device="cpu")
    tokens = list(range(100, 100 + 3 * n))
    seq = bm.add_sequence(tokens)
    assert WorkerTiers(bm, layout, caches).save(seq, [5, 0, 2]) == 3
    bm.free(seq)
    seq = bm.add_sequence(tokens)
    assert WorkerTiers(bm, layout, caches).load(seq, 0, 3 * n, [1, 7, 3]) == 3
    bm.free(seq)


@pytest.mark.parametrize(
    "backend",
    [b for b in CUDA_BACKENDS if b != "FLASHINFER" or importlib.util.find_spec("flashinfer")],
)
def test_vllms_own_cuda_backend_classes_lay_out_caches_as_kvtier_reads_them(backend: str) -> None:
    """Not built by hand: the class vLLM registers under the backend's name; every layout vLLM
    may run it with (its ``supported_kv_cache_layouts``, else vLLM's default preference: all
    six, some of them with layers interleaved in each block); every float dtype it stores a
    cache in (the model dtypes it supports under ``kv_cache_dtype`` auto, and float16 or
    bfloat16: its quantized ones the connector refuses, KV_CACHE_DTYPES); two layers' views
    of one buffer, as vLLM's allocator makes them. K/V written where the backend's forward
    pass reads them are read by kvtier's layout, saved, and loaded into other blocks exactly
    where the backend reads them, nothing else in the buffer changing."""
    pytest.importorskip("vllm")
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    from kvtier.integrations.vllm.config import KV_CACHE_DTYPES

    assert {b for b, split in BACKEND_LAYOUTS.items() if split == "channels"} == set(CUDA_BACKENDS)
    backend_class = AttentionBackendEnum[backend].get_class()
    assert backend_class.get_name() == backend
    dtypes = set(backend_class.supported_dtypes)  # kv_cache_dtype auto: the model's
    named = set(backend_class.supported_kv_cache_dtypes) & set(KV_CACHE_DTYPES) - {"auto"}
    dtypes |= {STR_DTYPE_TO_TORCH_DTYPE[d] for d in named}
    layouts = get_supported_kv_cache_layouts([backend_class])
    ids, other = torch.tensor([5, 0, 2]), torch.tensor([1, 7, 3])
    for dtype in sorted(dtypes, key=str):
        for vllm_layout in layouts:
            case = (str(dtype), vllm_layout.name)
            caches = vllm_layer_caches(vllm_layout, dtype, N)
            kvs = [per_token_kv(3, seed=layer).to(dtype) for layer in range(LAYERS)]
            for cache, kv in zip(caches, kvs, strict=True):
                k, v = cuda_backend_kv(cache)
                k[ids] = kv[0].view(3, N, H, D)
                v[ids] = kv[1].view(3, N, H, D)
            before = [c.clone() for c in caches]
            layout = layout_for_backend(
                backend, caches[0], num_kv_heads=H, block_size=N, head_dim=D
            )
            assert layout.split == "channels", case
            for cache, kv in zip(caches, kvs, strict=True):
                assert torch.equal(layout.read(cache, ids), kv), case
            saved_and_loaded(layout, caches, dtype, N)
            for cache, kv, old in zip(caches, kvs, before, strict=True):
                k, v = cuda_backend_kv(cache)
                assert torch.equal(torch.stack((k[other], v[other])).view(kv.shape), kv), case
                kept = [b for b in range(len(cache)) if b not in other.tolist()]
                assert torch.equal(cache[kept], old[kept]), case


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_vllms_own_cpu_backend_packs_caches_as_kvtier_reads_them(isa: str) -> None:
    """CPU_ATTN as vLLM makes its caches: its class's layout, its allocator's views of one
    buffer, K/V written by its own kernel (``cpu_attn_reshape_and_cache``, called as its forward
    pass calls it) packed for the instruction set, in each dtype it supports (amx: bf16, the
    only one vLLM picks it for). kvtier reads each token's K and V back, and its loads into
    other blocks are byte for byte what the kernel writes there."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    n = 32  # the CPU backend's blocks are multiples of 32 tokens
    backend_class = AttentionBackendEnum["CPU_ATTN"].get_class()
    assert backend_class.get_name() == "CPU_ATTN"
    dtypes = [torch.bfloat16] if isa == "amx" else backend_class.supported_dtypes
    g = torch.Generator().manual_seed(5)
    kvs = [torch.randn((2, 3 * n, H, D), generator=g) for _ in range(LAYERS)]

    def kernel_write(cache: Any, kv: Any, block_ids: list[int]) -> None:
        blocks = cache.shape[0]
        k_cache, v_cache = cache.view(blocks, H, 2 * n, -1).chunk(2, dim=2)  # its forward's
        slots = torch.tensor([b * n + t for b in block_ids for t in range(n)])
        ops.cpu_attn_reshape_and_cache(kv[0], kv[1], k_cache, v_cache, slots, isa)

    for dtype in dtypes:
        for vllm_layout in get_supported_kv_cache_layouts([backend_class]):
            case = (str(dtype), vllm_layout.name)
            caches = vllm_layer_caches(vllm_layout, dtype, n)
            want = vllm_layer_caches(vllm_layout, dtype, n)
            for cache, expected, kv in zip(caches, want, kvs, strict=True):
                kernel_write(cache, kv.to(dtype), [5, 0, 2])
                kernel_write(expected, kv.to(dtype), [5, 0, 2])
                kernel_write(expected, kv.to(dtype), [1, 7, 3])
            name = f"CPU_ATTN:{isa}"
            layout = layout_for_backend(name, caches[0], num_kv_heads=H, block_size=n, head_dim=D)
            for cache, kv in zip(caches, kvs, strict=True):
                assert torch.equal(layout.read(cache, torch.tensor([5, 0, 2])), kv.to(dtype)), case
            saved_and_loaded(layout, caches, dtype, n)
            for cache, expected in zip(caches, want, strict=True):
                assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8)), case


LAYERS = 2


def manager(ladder: str = "bf16") -> BlockManager:
    cfg = KvtierConfig(
        block_size=N, device_budget=1 << 20, ladder=tuple(ladder.split(",")), recent_window=0
    )
    return BlockManager(cfg, LAYERS, H, D, dtype="bf16", device="cpu")


def caches_for(case: str, blocks: int, ids: list[int], seed: int, device: str = "cpu") -> Any:
    backend, make = CASES[case]
    kvs = [per_token_kv(blocks, seed + layer) for layer in range(LAYERS)]
    caches = [make(8, kv, ids).to(device) for kv in kvs]
    layout = layout_for_backend(backend, caches[0], num_kv_heads=H, block_size=N, head_dim=D)
    return layout, caches, kvs


@pytest.mark.parametrize("case", list(CASES))
def test_saved_blocks_load_back_exactly_into_other_blocks(case: str) -> None:
    bm = manager()
    tokens = list(range(100, 100 + 3 * N))
    layout, caches, kvs = caches_for(case, 3, [6, 1, 4], seed=10)
    seq = bm.add_sequence(tokens)
    assert WorkerTiers(bm, layout, caches).save(seq, [6, 1, 4]) == 3
    # The key-norm signal the scheduler ranks by: per block, the mean over its layers and
    # tokens of each token's key norm averaged over heads.
    norms = torch.stack([kv[0].float().norm(dim=-1).mean(dim=-1) for kv in kvs])  # [L, T]
    want = norms.reshape(LAYERS, 3, N).mean(dim=(0, 2)).numpy()
    np.testing.assert_allclose(bm.ledger.magnitude(bm.core.sequence_blocks(seq)), want, rtol=1e-4)
    bm.free(seq)
    # A second request with the same first two blocks: vLLM gave it blocks 0 and 2.
    pin = bm.add_sequence(tokens[: 2 * N])
    assert bm.num_tokens(pin) == 2 * N  # both cached
    _, fresh, _ = caches_for(case, 1, [7], seed=99)
    into = WorkerTiers(bm, layout, fresh)
    assert into.load(pin, 0, 2 * N, [0, 2]) == 2
    for layer in range(LAYERS):
        assert torch.equal(layout.read(fresh[layer], torch.tensor([0, 2])), kvs[layer][:, : 2 * N])
    # A load of more than the tiers hold writes what they hold and says so.
    assert into.load(pin, N, 3 * N, [3, 5]) == 1


def test_a_saved_prefix_is_not_written_twice() -> None:
    bm = manager()
    tokens = list(range(3 * N))
    layout, caches, _ = caches_for("cpu-amx", 3, [0, 1, 2], seed=3)
    tiers = WorkerTiers(bm, layout, caches)
    first = bm.add_sequence(tokens[: 2 * N])
    assert tiers.save(first, [0, 1]) == 2
    bm.free(first)
    again = bm.add_sequence(tokens)
    assert bm.num_tokens(again) == 2 * N
    assert tiers.save(again, [0, 1, 2]) == 1


def test_gather_blocks_is_gather_in_the_stored_form() -> None:
    bm = manager("bf16,int8,int4")
    layout, caches, _ = caches_for("cpu-amx", 3, [0, 1, 2], seed=8)
    seq = bm.add_sequence(list(range(3 * N)))
    WorkerTiers(bm, layout, caches).save(seq, [0, 1, 2])
    bm.append(seq, 0, *per_token_kv(1, 9)[:, :5])  # a partial last block at layer 0
    bm.step()  # some blocks at int8 / int4: both decode them alike
    for layer in range(LAYERS):
        k, v = bm.gather(seq, layer)
        blocks = bm.gather_blocks(seq, layer)
        assert blocks.shape == (3 + (layer == 0), 2, H, N, D)
        tokens = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, H, D)[:, : len(k)]
        assert torch.equal(tokens[0], k) and torch.equal(tokens[1], v)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["flash-nhd", "flash-hnd"])
@pytest.mark.parametrize("ladder", ["bf16", "bf16,int8,int4"])
@pytest.mark.parametrize("encode", [False, True])
def test_gpu_save_and_load_equal_the_cpu_path_byte_for_byte(
    torch_cuda: Any, case: str, ladder: str, encode: bool
) -> None:
    """The worker's path on CUDA caches laid out as vLLM's CUDA backends lay them: what it
    loads back (after the manager demoted the blocks down the ladder) equals the same path on
    CPU caches, byte for byte; with ``encode`` (the worker's saves on a GPU), the blocks were
    encoded on the GPU by the CUDA kernels, on the CPU by the native code."""
    out, pools = {}, {}
    cfg = KvtierConfig(
        block_size=N,
        device_budget=1 << 20,
        ladder=tuple(ladder.split(",")),
        recent_window=0,
        sink_blocks=0,
    )
    for device in ("cpu", "cuda"):
        bm = BlockManager(cfg, LAYERS, H, D, dtype="bf16", device="cpu")
        layout, caches, _ = caches_for(case, 4, [3, 0, 6, 2], seed=20, device=device)
        seq = bm.add_sequence(list(range(4 * N)))
        WorkerTiers(bm, layout, caches, encode=encode).save(seq, [3, 0, 6, 2])
        pools[device] = {key: pool.clone() for key, pool in bm.pools.items()}
        moves = bm.step()
        if not encode:
            assert moves.get("demote", 0) == (4 if "int4" in ladder else 0)
        _, fresh, _ = caches_for(case, 1, [7], seed=5, device=device)
        assert WorkerTiers(bm, layout, fresh).load(seq, 0, 4 * N, [1, 4, 5, 7]) == 4
        out[device] = [c.cpu() for c in fresh]
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for key, pool in pools["cpu"].items():  # the saved bytes, before any move
        assert torch.equal(pool.view(torch.uint8), pools["cuda"][key].view(torch.uint8)), key


def test_a_run_of_whole_blocks_ends_complete_whatever_wrote_its_middle_layer() -> None:
    """Three layers: the first from vLLM's cache (which starts a run of fresh blocks), the
    second as a tensor (the general path), the last from the cache again (through the run):
    once the last layer is written the blocks are complete, unpinned, measured and cached."""
    layers = 3
    bm = BlockManager(
        KvtierConfig(block_size=N, device_budget=1 << 20, recent_window=0),
        layers, H, D, dtype="bf16", device="cpu",
    )  # fmt: skip
    tokens = list(range(700, 700 + 2 * N))
    kvs = [per_token_kv(2, seed=60 + layer) for layer in range(layers)]
    caches = [CASES["cpu-amx"][1](4, kv, [1, 3]) for kv in kvs]
    layout = layout_for_backend("CPU_ATTN:amx", caches[0], num_kv_heads=H, block_size=N, head_dim=D)
    seq = bm.add_sequence(tokens)
    bm.append_blocks(seq, 0, PagedBlocks.of(layout, caches[0], [1, 3]))
    bm.append_blocks(seq, 1, layout.read_blocks(caches[1], torch.tensor([1, 3])))
    bm.append_blocks(seq, 2, PagedBlocks.of(layout, caches[2], [1, 3]))
    blocks = bm.core.sequence_blocks(seq)
    assert not bm.ledger.pinned[blocks].any()
    norms = torch.stack([kv[0].float().norm(dim=-1).mean(dim=-1) for kv in kvs])  # [L, T]
    want = norms.reshape(layers, 2, N).mean(dim=(0, 2)).numpy()
    np.testing.assert_allclose(bm.ledger.magnitude(blocks), want, rtol=1e-4)
    bm.free(seq)
    assert bm.lookup(tokens) == 2 * N


@pytest.mark.parametrize("case", ["cpu-amx", "flash-nhd"])
def test_encoded_saves_land_where_cached_blocks_settle_and_load_back_decoded(case: str) -> None:
    """The worker's saves as it runs them on a GPU (``encode``), here on CPU caches: the core
    places each block before it is written (the chain's ends, its sink and its last two blocks,
    at bf16, the others at int8 while it has slots, then int4), each layer is encoded where the
    cache is, and a load gives back what each level's codec decodes of the block vLLM wrote."""
    shape = BlockShape(LAYERS, H, N, D, "bf16")
    budget = 1 << 20
    int8 = 2.5 * get_codec("int8").bytes_per_block(shape) / budget  # two slots
    cfg = KvtierConfig(
        block_size=N,
        device_budget=budget,
        ladder=("bf16", "int8", "int4"),
        pool_shares=(0.3, int8, 0.7 - int8),
    )
    bm = BlockManager(cfg, LAYERS, H, D, dtype="bf16", device="cpu")
    tokens = list(range(500, 500 + 6 * N))
    layout, caches, kvs = caches_for(case, 6, [3, 0, 6, 2, 5, 1], seed=50)
    seq = bm.add_sequence(tokens)
    assert WorkerTiers(bm, layout, caches, encode=True).save(seq, [3, 0, 6, 2, 5, 1]) == 6
    levels = bm.core.block_info(bm.core.sequence_blocks(seq))["level"].tolist()
    assert levels == [0, 1, 1, 2, 0, 0]
    bm.free(seq)
    pin = bm.add_sequence(tokens)
    assert bm.num_tokens(pin) == 6 * N
    _, fresh, _ = caches_for(case, 1, [7], seed=51)
    assert WorkerTiers(bm, layout, fresh).load(pin, 0, 6 * N, [1, 4, 5, 0, 6, 7]) == 6
    for layer in range(LAYERS):
        got = layout.read(fresh[layer], torch.tensor([1, 4, 5, 0, 6, 7]))
        for i, level in enumerate(levels):
            block = kvs[layer][:, i * N : (i + 1) * N]  # [2, N, H, D]
            codec = get_codec(bm.ladder[level])
            whole = block.permute(0, 2, 1, 3)[None, None].contiguous()  # [1, 1, 2, H, N, D]
            want = codec.decode(codec.encode(whole))[0, 0].permute(0, 2, 1, 3)
            assert torch.equal(got[:, i * N : (i + 1) * N], want), (layer, i)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layer_wise_loads_are_in_each_layer_once_it_is_waited_for(
    request: Any, device: str
) -> None:
    """The worker's loads of one step, a layer at a time on a thread of their own while vLLM's
    forward pass computes the layers before (on CUDA: the copies on a stream of their own, and
    each layer's attention waiting for that layer's event): once a layer is waited for, its
    blocks hold the saved K/V as the compute stream reads them; at the end each load says which
    blocks it wrote and which it did not (the tiers held three of four)."""
    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    bm = manager()
    tokens = list(range(300, 300 + 3 * N))
    layout, caches, kvs = caches_for("flash-nhd", 3, [6, 1, 4], seed=30, device=device)
    seq = bm.add_sequence(tokens)
    assert WorkerTiers(bm, layout, caches).save(seq, [6, 1, 4]) == 3
    bm.free(seq)
    _, fresh, _ = caches_for("flash-nhd", 1, [7], seed=98, device=device)
    into = [0, 2, 5, 3]  # vLLM's blocks for the prompt and one more block of tokens
    load = SimpleNamespace(
        req_id="r", salt=None, tokens=[*tokens, *range(N + 1)], start=0, block_ids=into
    )
    with ThreadPoolExecutor(1) as thread:
        loads = LayerLoads(WorkerTiers(bm, layout, fresh), [load], thread)
        for layer in range(LAYERS):
            loads.wait(layer)
            assert (loads.events[layer] is not None) == (device == "cuda")
            got = layout.read(fresh[layer], torch.tensor(into[:3], device=device))
            assert torch.equal(got.cpu(), kvs[layer][:, : 3 * N]), layer
        assert loads.finish() == [(3, [3])]
    assert bm.sequences() == [], "the loads' sequences are freed"


def saved(case: str, source: bool, kv_of: Any = None) -> tuple[BlockManager, int]:
    """A manager holding 3 blocks of 2 layers saved from ``case``'s caches: handed over where
    they lie (``source``, :class:`PagedBlocks`) or read into a tensor first."""
    bm = manager()
    layout, caches, _ = caches_for(case, 3, [6, 1, 4], seed=21)
    seq = bm.add_sequence(list(range(3 * N)))
    for layer, cache in enumerate(caches):
        blocks = PagedBlocks.of(layout, cache, [6, 1, 4])
        bm.append_blocks(seq, layer, blocks if source else blocks.read())
    return bm, seq


@pytest.mark.parametrize("case", ["cpu-amx", "cpu-vec", "flash-nhd", "flash-hnd"])
def test_blocks_handed_over_where_they_lie_are_stored_as_their_tensor_is(case: str) -> None:
    """append_blocks of PagedBlocks (checked in the cache, copied once into the pool) stores
    what append_blocks of the same blocks read into a tensor stores, with the same key norms
    (the importance signal), to float rounding."""
    (a, sa), (b, sb) = saved(case, source=True), saved(case, source=False)
    for layer in range(LAYERS):
        assert torch.equal(a.gather_blocks(sa, layer), b.gather_blocks(sb, layer))
    blocks = a.core.sequence_blocks(sa)
    assert a.ledger.norm_count[blocks].tolist() == b.ledger.norm_count[blocks].tolist()
    np.testing.assert_allclose(a.ledger.norm_sum[blocks], b.ledger.norm_sum[blocks], rtol=1e-5)


@pytest.mark.parametrize("case", ["cpu-amx", "cpu-vec", "flash-nhd"])
@pytest.mark.parametrize(("kv", "value"), [(0, "nan"), (0, "inf"), (1, "-inf"), (1, "nan")])
def test_a_cache_block_that_is_not_finite_is_refused_and_nothing_is_stored(
    case: str, kv: int, value: str
) -> None:
    bm = manager()
    layout, caches, kvs = caches_for(case, 3, [6, 1, 4], seed=5)
    bad = kvs[0].clone()
    bad[kv, 2 * N + 7, 1, D - 3] = float(value)  # block 4, token 7, head 1
    layout.write(caches[0], torch.tensor([6, 1, 4]), bad)
    huge = kvs[1].clone()
    huge[0, 5, 0, :] = 3e38  # finite, though its square overflows float32: accepted
    layout.write(caches[1], torch.tensor([6, 1, 4]), huge)
    seq = bm.add_sequence(list(range(3 * N)))
    before = bm.core.usage()
    with pytest.raises(kvtier_error(), match=f"NaN or inf in {'KV'[kv]}; nothing was stored"):
        bm.append_blocks(seq, 0, PagedBlocks.of(layout, caches[0], [6, 1, 4]))
    assert bm.num_tokens(seq, 0) == 0 and bm.core.usage() == before
    bm.append_blocks(seq, 1, PagedBlocks.of(layout, caches[1], [6, 1, 4]))
    assert torch.equal(bm.gather(seq, 1)[0], huge[0])


def test_paged_blocks_refuse_what_is_not_the_managers() -> None:
    bm = manager()
    layout, caches, _ = caches_for("cpu-amx", 1, [0], seed=1)
    seq = bm.add_sequence(list(range(N)))
    with pytest.raises(kvtier_error(), match=r"block_ids: expected blocks of the cache's 8"):
        PagedBlocks.of(layout, caches[0], [8])
    with pytest.raises(kvtier_error(), match=r"expected dtype torch\.bfloat16"):
        bm.append_blocks(seq, 0, PagedBlocks.of(layout, caches[0].float(), [0]))
    other = PagedLayout("cpu-amx", H, 2 * N, D)
    wide = torch.zeros((2, H, 2 * N, 2 * D), dtype=torch.bfloat16)
    with pytest.raises(kvtier_error(), match=r"expected blocks of \[3 kv_heads, 16 block_size"):
        bm.append_blocks(seq, 0, PagedBlocks.of(other, wide, [0]))
    assert bm.num_tokens(seq, 0) == 0


@pytest.mark.parametrize("case", ["cpu-amx", "cpu-vec", "flash-nhd"])
def test_load_blocks_writes_what_gather_blocks_gives_from_every_level(case: str) -> None:
    """Level-0 blocks are copied from the pool into place, int8/int4 ones decoded and written:
    either way the cache then holds gather_blocks' K/V, in the backend's layout."""
    bm = manager("bf16,int8,int4")
    layout, caches, _ = caches_for(case, 3, [0, 1, 2], seed=8)
    seq = bm.add_sequence(list(range(3 * N)))
    WorkerTiers(bm, layout, caches).save(seq, [0, 1, 2])
    bm.step()
    assert len(set(bm.core.block_info(bm.core.sequence_blocks(seq))["level"].tolist())) > 1
    _, fresh, _ = caches_for(case, 1, [7], seed=99)
    for layer in range(LAYERS):
        bm.load_blocks(seq, layer, 1, PagedBlocks.of(layout, fresh[layer], [5, 3]))
        got = PagedBlocks.of(layout, fresh[layer], [5, 3]).read()
        assert torch.equal(got, bm.gather_blocks(seq, layer)[1:3])
    before = fresh[0].clone()
    with pytest.raises(kvtier_error(), match=r"expected whole blocks it holds, got blocks 2:4"):
        bm.load_blocks(seq, 0, 2, PagedBlocks.of(layout, fresh[0], [5, 3]))
    assert torch.equal(fresh[0], before)


@pytest.mark.parametrize("kv", [0, 1])
def test_a_layer_refused_after_the_first_leaves_nothing_it_could_be_read_as(kv: int) -> None:
    """Layers after the first find their blocks allocated: their blocks are checked as they are
    copied into the pool. A refusal there writes no token of the layer, and the layer's good
    blocks then save and read back as they are."""
    bm = manager()
    layout, caches, kvs = caches_for("cpu-amx", 3, [6, 1, 4], seed=12)
    seq = bm.add_sequence(list(range(3 * N)))
    bm.append_blocks(seq, 0, PagedBlocks.of(layout, caches[0], [6, 1, 4]))
    before = bm.core.usage()
    bad, values = caches[1].clone(), kvs[1].clone()
    values[kv, N + 3] = float("nan") if kv == 0 else float("inf")  # in the second block
    layout.write(bad, torch.tensor([6, 1, 4]), values)
    with pytest.raises(kvtier_error(), match=f"NaN or inf in {'KV'[kv]}"):
        bm.append_blocks(seq, 1, PagedBlocks.of(layout, bad, [6, 1, 4]))
    assert bm.num_tokens(seq, 1) == 0 and bm.core.usage() == before
    bm.append_blocks(seq, 1, PagedBlocks.of(layout, caches[1], [6, 1, 4]))
    k, v = bm.gather(seq, 1)
    assert torch.equal(k, kvs[1][0]) and torch.equal(v, kvs[1][1])


def test_a_layer_a_sharer_wrote_first_is_not_written_again_by_the_save() -> None:
    """A save's later layers go straight to the slots its first layer filled, unless some layer
    of those blocks is written already: a sequence sharing the blocks in flight wrote it
    (the layer's owner, whose K/V stays), and its tokens are counted once."""
    bm = manager()
    layout, caches, kvs = caches_for("cpu-amx", 2, [0, 1], seed=21)
    _, sharer_caches, sharer_kvs = caches_for("cpu-amx", 2, [2, 3], seed=50)
    tokens = list(range(2 * N))
    seq = bm.add_sequence(tokens)
    bm.append_blocks(seq, 0, PagedBlocks.of(layout, caches[0], [0, 1]))
    sharer = bm.add_sequence(tokens)
    assert bm.core.sequence_blocks(sharer).tolist() == bm.core.sequence_blocks(seq).tolist()
    bm.append_blocks(sharer, 1, PagedBlocks.of(layout, sharer_caches[1], [2, 3]))
    bm.append_blocks(seq, 1, PagedBlocks.of(layout, caches[1], [0, 1]))
    assert bm.num_tokens(seq, 1) == 2 * N
    assert torch.equal(bm.gather(seq, 0)[0], kvs[0][0])
    assert torch.equal(bm.gather(seq, 1)[0], sharer_kvs[1][0])
    blocks = bm.core.sequence_blocks(seq)
    assert bm.ledger.norm_count[blocks].tolist() == [LAYERS * N] * 2
    assert not bm.ledger.pinned[blocks].any()  # complete: free to move
