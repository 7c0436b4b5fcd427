"""GB/s of the vLLM connector's save and load paths (kvtier.integrations.vllm.tiers) on one device's
paged caches, beside a plain copy of the same bytes between the device and host memory (the
baseline: what moving the blocks costs with nothing else done).

    python benchmarks/vllm_paths.py [--device cuda] [--layout channels|cpu-vec|cpu-amx] [--blocks 64]
        [--ladder bf16,int8] [--encode | --no-encode] [--save PATH]

Shape: Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16), vLLM block size 16. With a
ladder below bf16, saves are encoded where the caches are (the worker's way on a GPU, the default
there: ``--encode``) and land at its level 1, or land at bf16 (``--no-encode``, the worker's way
on the CPU: its tiers' step encodes them later); loads decode them into the paged caches. GB/s
are always of the bf16 bytes the blocks hold in vLLM's cache, so that a path moving fewer bytes
can beat the copy. Each figure is the best of ``--repeats``; the JSON also carries every
repeat's GB/s (``*_samples``), and ``--save PATH`` writes it with the run's provenance.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvtier import BlockManager, KvtierConfig
from kvtier.cli import positive_int
from kvtier.integrations.vllm.paged import PagedLayout
from kvtier.integrations.vllm.tiers import WorkerTiers
from kvtier.results import add_save_option, save_if_asked

L, H, N, D = 32, 8, 16, 128


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best(fn, device: str, repeats: int) -> tuple[float, list[float]]:
    """The best of ``repeats`` timed calls of ``fn`` after one untimed, and every call's."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times), times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--layout",
        default=None,
        choices=["channels", "cpu-vec", "cpu-amx"],
        help="channels (CUDA backends), cpu-vec or cpu-amx (vLLM's CPU backend by ISA)",
    )
    ap.add_argument("--blocks", type=positive_int, default=64)
    ap.add_argument("--ladder", default="bf16", help="the tiers' ladder, e.g. bf16,int8")
    ap.add_argument(
        "--encode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="encode saves where the caches are (default: on a GPU)",
    )
    ap.add_argument("--repeats", type=positive_int, default=5)
    add_save_option(ap)
    args = ap.parse_args(argv)
    split = args.layout or ("channels" if args.device.startswith("cuda") else "cpu-amx")
    layout = PagedLayout(split, H, N, D)
    nb = args.blocks
    pool = 2 * nb + 8
    caches = [
        torch.randn((pool, H, N, 2 * D), device=args.device).to(torch.bfloat16) for _ in range(L)
    ]
    ids = list(range(0, 2 * nb, 2))
    dst = list(range(1, 2 * nb, 2))
    nbytes = nb * L * H * N * 2 * D * 2
    ladder = tuple(args.ladder.split(","))
    encode = args.device.startswith("cuda") if args.encode is None else args.encode
    cfg = KvtierConfig(
        block_size=N,
        device_budget=4 * nbytes,
        ladder=ladder,
        # level 0 takes a save's blocks as they are allocated, level 1 all of them encoded
        pool_shares=(0.3, 0.7, *[0.0] * (len(ladder) - 2)) if len(ladder) > 1 else None,
        recent_window=0,
        sink_blocks=0,
    )
    bm = BlockManager(cfg, L, H, D, dtype="bf16", device="cpu")
    tokens = list(range(nb * N))
    tiers = WorkerTiers(bm, layout, caches, encode=encode)

    def save() -> None:
        seq = bm.add_sequence(tokens)
        tiers.save(seq, ids)
        bm.free(seq)
        bm.core.forget(bm.core.lookup_tokens(tokens))  # the next repeat saves again

    save_s, save_all = best(save, args.device, args.repeats)
    seq = bm.add_sequence(tokens)
    tiers.save(seq, ids)
    load_s, load_all = best(lambda: tiers.load(seq, 0, nb * N, dst), args.device, args.repeats)
    src = torch.cat([c[:nb].reshape(-1) for c in caches])
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=args.device.startswith("cuda"))
    d2h_s, d2h_all = best(lambda: host.copy_(src), args.device, args.repeats)
    h2d_s, h2d_all = best(lambda: src.copy_(host), args.device, args.repeats)
    gb = nbytes / 1e9
    res = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "layout": split,
        "ladder": args.ladder,
        "encode": encode,
        "saved_level": int(bm.core.block_info(bm.core.sequence_blocks(seq))["level"].max()),
        "blocks": nb,
        "bytes": nbytes,
        "save_gb_s": gb / save_s,
        "load_gb_s": gb / load_s,
        "copy_to_host_gb_s": gb / d2h_s,
        "copy_from_host_gb_s": gb / h2d_s,
    }
    res["save_x_copy"] = res["save_gb_s"] / res["copy_to_host_gb_s"]
    res["load_x_copy"] = res["load_gb_s"] / res["copy_from_host_gb_s"]
    for key, times in (
        ("save_gb_s", save_all),
        ("load_gb_s", load_all),
        ("copy_to_host_gb_s", d2h_all),
        ("copy_from_host_gb_s", h2d_all),
    ):
        res[f"{key}_samples"] = [gb / t for t in times]
    print(
        f"{res['device']} {split} {args.ladder}{' encoded' if encode else ''}: {nb} blocks, "
        f"{nbytes / 1e6:.0f} MB of bf16: save {res['save_gb_s']:.2f} GB/s "
        f"({res['save_x_copy']:.2f}x a plain copy to host at {res['copy_to_host_gb_s']:.2f}), "
        f"load {res['load_gb_s']:.2f} GB/s ({res['load_x_copy']:.2f}x a plain copy from host at "
        f"{res['copy_from_host_gb_s']:.2f})"
    )
    print(json.dumps(res))
    save_if_asked(args, res, "python benchmarks/vllm_paths.py", argv)


if __name__ == "__main__":
    main()
