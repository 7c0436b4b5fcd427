"""Plain-Python reference models, the baselines the Rust core is checked and timed against.

They are deliberately written the way one would without kvtier: dicts, lists and loops, no numpy
in their logic. Only the tests and the benchmarks (``kvtier bench core``, the LMCache peer) use
them; ``import kvtier`` does not import them.

- :mod:`kvtier.reference.core` — :class:`~kvtier.reference.core.ModelCore`, the rules of
  :class:`kvtier._core.Core` (block table, prefix index and its prefix trees, statistics,
  scheduler) for one device tier: the Hypothesis test drives it and the core with the same
  random operations and compares them after every step;
- :mod:`kvtier.reference.lru` — :func:`~kvtier.reference.lru.lru_replay`, an exact LRU
  prefix-cache replay of a trace (the simulator's peer), and
  :func:`~kvtier.reference.lru.model_replay`, the simulator's LRU replay through the model;
- :mod:`kvtier.reference.xxh3` — XXH3-64 and the prefix hash chain (salted or not), without the
  extension.
"""
