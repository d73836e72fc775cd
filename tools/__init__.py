"""Tools beside the package, run from the repository root: the rank launcher of the tests, the
simulated hosts, the tests' settings and index, and the benchmarks against peers and the perf
breakdown (``python -m tools.peers``, ``python -m tools.breakdown``)."""
