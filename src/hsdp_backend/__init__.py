"""hsdp: a c10d ProcessGroup backend for FSDP2.

``import hsdp_backend`` registers the backend name ``hsdp`` with
``torch.distributed``; then ``dist.init_process_group("hsdp")`` (or any group
created on top of it) runs its collectives through hsdp. See README.md and docs/.

This module is also imported by torch itself while ``import torch`` runs (the
autoload entry point lives in this package), so it must stay import-safe: it
loads nothing heavy, and the public API below is imported on first use.
"""

from hsdp_backend._registration import BACKEND_NAME, register

_API = (
    "ArgumentError",
    "ArgumentTypeError",
    "all_reduce",
    "all_reduce_coalesced",
    "buffer_stats",
    "comm_stats",
    "cpu_engine",
    "cpu_route",
    "cpu_route_report",
    "dump_trace",
    "get_hsdp_backend",
    "reduce_scatter_tensor",
    "reset_comm_stats",
)

__all__ = ["BACKEND_NAME", "register", *_API]


def __getattr__(name):
    if name in _API:
        from hsdp_backend import api

        return getattr(api, name)
    raise AttributeError(f"module 'hsdp_backend' has no attribute {name!r}")


def _warn_if_unsupported() -> None:
    # torch first: importing it runs the autoload entry point, which imports
    # _torch_compat (whose own `import torch` must find torch under way, not
    # start it).
    import torch  # noqa: F401

    from hsdp_backend import _torch_compat

    problem = _torch_compat.unsupported()
    if problem is not None:
        import warnings

        warnings.warn(problem, RuntimeWarning, stacklevel=3)


def _register_on_import() -> None:
    # An exception here would also break `import torch` when torch imports
    # us through the autoload entry point, so a failure is reported, not
    # raised; init_process_group("hsdp") then fails with torch's own
    # "unknown backend" error after this warning.
    try:
        _warn_if_unsupported()
        register()
    except Exception as exc:  # noqa: BLE001
        import warnings

        warnings.warn(
            f"hsdp_backend: could not register the 'hsdp' backend ({type(exc).__name__}: {exc})",
            RuntimeWarning,
            stacklevel=2,
        )


_register_on_import()
