"""Tools beside the package, run from the repository root: the rank launcher of the tests and
benchmarks, the simulated hosts, the tests' settings and index. benchmarks/ builds on them;
nothing here imports benchmarks/."""
