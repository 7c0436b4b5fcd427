"""kvtier inside other frameworks: :mod:`kvtier.integrations.hf` (transformers' ``Cache``).

Each module imports its framework, so import the one you use (it needs that extra installed).
"""
