"""LMCache's simulator beside kvtier's plain-Python LRU replay (see kvtier/bench/lmcache_peer.py)."""

from kvtier.bench.lmcache_peer import main

if __name__ == "__main__":
    raise SystemExit(main())
