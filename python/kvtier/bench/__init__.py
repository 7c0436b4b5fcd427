"""Benchmarks behind ``kvtier bench``: each prints figures beside a named baseline measured in the
same run, and never passes or fails on time."""
