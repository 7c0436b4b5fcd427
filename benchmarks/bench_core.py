"""The core benchmark; same as ``kvtier bench core`` (see kvtier/bench/core.py)."""

from kvtier.bench.core import main

if __name__ == "__main__":
    raise SystemExit(main())
