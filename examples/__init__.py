"""The examples are torchrun scripts; from the repository root their models and training loop are
also importable (``from examples.train_fsdp import build_model, train``), which the benchmarks do."""
