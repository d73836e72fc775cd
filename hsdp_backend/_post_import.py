"""Run a callback right after a module is imported, without importing it.

hsdp adapts a few torch modules (FSDP2's reduction path, ``init_process_group``
under ``python -m hsdp_backend.run``) only in processes that use them.
Importing them eagerly would cost every process about a second of CPU, so the
adaptation waits for the process's own import. Standard library only: this
runs from a ``sitecustomize`` before torch exists.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

_lock = threading.Lock()
_pending: dict[str, list[Callable]] = {}


def when_imported(name: str, callback: Callable) -> None:
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


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        for callback in callbacks:
            callback(module)

    def __getattr__(self, attr):  # get_source, is_package, ... for tracebacks and tools
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        # Let the rest of sys.meta_path find the real spec, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_FINDER = _Finder()
