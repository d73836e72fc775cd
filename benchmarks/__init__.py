"""Benchmarks of hsdp against gloo: ``python -m benchmarks <suite> ...`` from
the repository root. Not part of the installed package: the repository
root on sys.path finds this directory and tools/, while ``hsdp_backend``
(under src/) is the installed one, with its compiled extension.

Method
------
For a suite that runs its ranks itself, the parent starts W rank processes
per world size (tools/ranks.py, the tests' launcher: spawn, env://
rendezvous on a free loopback port, one wall-clock deadline for the whole
run; when a rank fails the others get a short grace period, then every rank
still alive is killed and the run exits non-zero). Each rank runs
single-threaded (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``),
initialises the default group on ``hsdp`` and a second group over the same
ranks on ``gloo``, so both backends are measured in the same processes, on
the same buffers, at the same time: every result is checked against the
exact answer first, then timed interleaved (benchmarks/timing.py), so
machine noise hits both alike and the ratio stays meaningful.

Suites, one module each (its docstring is its ``--help``):

- ``collectives``: all_gather_into_tensor / reduce_scatter_tensor /
  all_reduce per size, nccl-tests bus bandwidth, against memcpy.
- ``coalesced``: FSDP2's per-module coalesced all-gather / reduce-scatter of
  200 transformer parameter shards: per tensor, gloo coalesced, hsdp fused.
- ``numerics``: bf16 / fp16 AVG error in ulps against an fp64 reference.
- ``training``: the FSDP2 examples under torchrun, against a compute-only
  baseline (exposed communication).
- ``hosts``: collectives and training on 2 simulated hosts x 2 ranks
  (tools/simhosts.py; needs root).

Every suite prints its tables (benchmarks/report.py), writes its raw numbers
with machine information as JSON and draws a PNG (``bench_results/`` by
default; ``--json`` / ``--plot``).
"""
