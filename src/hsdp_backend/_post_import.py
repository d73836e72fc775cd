"""Run a callback right after a module is imported, without importing it.

hsdp adapts two torch modules only in processes that use them: FSDP2's
reduction path (hsdp_backend.fsdp) and, under ``python -m hsdp_backend.run``,
``init_process_group``. Importing them eagerly would cost every process about
a second of CPU, so the adaptation waits for the process's own import.

Standard library built-ins only, and no import of the hsdp_backend package:
the launcher's ``sitecustomize`` loads this file by path in every process it
starts, before torch exists, and registers it under this module's name so
that the package later shares the same hook.
"""

import _thread
import sys

_lock = _thread.allocate_lock()
_pending = {}  # module name -> [callback(module)]


def when_imported(name, callback):
    """Calls ``callback(module)`` once ``name`` has been imported: now if it
    already is, otherwise right after its body has run (before any
    ``from name import *`` elsewhere copies its names)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


class _Loader:
    """Delegates to the real loader, then runs the callbacks."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Put the real loader back first, so nothing that inspects the module
        # later sees this wrapper.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        for callback in callbacks:
            try:
                callback(module)
            except Exception as exc:  # noqa: BLE001
                # Raising here would fail the import of a module that did load
                # (and importlib would run it again on the next import).
                import warnings

                warnings.warn(
                    f"hsdp: adapting {self._name} after its import failed: {exc!r}", stacklevel=2
                )

    def __getattr__(self, attr):  # get_source, is_package, ... for tracebacks and tools
        return getattr(self._loader, attr)


class _Finder:
    """Answers only for modules with pending callbacks: asks the finders after
    it for the real spec and wraps that spec's loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None

    def invalidate_caches(self):
        pass


_FINDER = _Finder()
