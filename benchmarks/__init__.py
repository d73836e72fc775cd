"""Benchmarks of hsdp against its peers, one torchrun script per suite over one helper
(``common.py``): ``python -m benchmarks SUITE ...`` from the repository root launches a suite once per
world size (``__main__.py``). Every script checks each contender against the exact answer before
it times it, times the contenders interleaved in the same processes on the same buffers, and
reports ratios. Not part of the installed package: it measures the installed ``hsdp_backend``.

- ``collectives``: all-gather, reduce-scatter and all-reduce per size, against gloo and memcpy.
- ``coalesced``: FSDP2's per-module coalesced all-gather and reduce-scatter of 200 shards.
- ``numerics``: bf16 and fp16 AVG's error in ulps against the fp64 mean.
- ``training``: FSDP2 and HSDP training steps on hsdp, gloo, torch's fake backend (the zero-cost
  limit), hsdp without its FSDP2 shim and hsdp on pool buffers.
- ``device_calls``: hsdp's cost per call on a device's route against its plain backend.
- ``fsdp_copies``: FSDP2's own copies around its collectives, as shares of the step.
- ``hosts``: collectives and training across simulated hosts (needs root).

Beside them: ``layer_cost`` and ``pytest_harnesses`` (one process each), ``engine_bench.cpp``
(the engine without torch), and in tools/ the peers (MPI, DeepSpeed) and the perf breakdown.
"""
