"""kvtier inside other frameworks: :mod:`kvtier.integrations.hf` (transformers' ``Cache``) and
:mod:`kvtier.integrations.vllm` (vLLM's KV connector).

Each imports its framework, so import the one you use (it needs that extra installed).
"""
