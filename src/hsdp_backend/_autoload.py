"""Entry points torch calls on its own. Keep this module tiny and import-safe.

``autoload`` runs at the end of ``import torch`` (the ``torch.backends``
entry-point group; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` disables it). An
exception escaping from it would break ``import torch`` for the user, so it
catches everything and only warns. It registers the backend name and a
creator; the C++ extension is loaded only when a group is actually created.

``register`` is the ``torch.distributed.backends`` entry point: torch >= 2.14
calls it when a process group names "hsdp" and nothing registered that name
yet (``Backend._ensure_backend_registered``); torch 2.13 never reads that
group, so there ``autoload`` or ``import hsdp_backend`` must have run.
"""


def register() -> None:
    from hsdp_backend._registration import register as _register

    _register()


def autoload() -> None:
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - must never break `import torch`
        import warnings

        warnings.warn(
            f"hsdp_backend: could not register the 'hsdp' c10d backend at "
            f"import torch ({type(exc).__name__}: {exc}); "
            f"`import hsdp_backend` will retry and show the full error",
            RuntimeWarning,
            stacklevel=2,
        )
