"""Injected by ``python -m hsdp_backend.run``; maps a rank's default backend to hsdp.

The launcher puts this file's directory first on ``PYTHONPATH`` and sets
``HSDP_RUN_BACKEND_MAP=1`` for the processes torchrun starts. Python's ``site``
then imports this module at start-up in every such process (each rank, but
also anything a rank spawns), so it must stay cheap: it does NOT import torch.
It only

1. installs (through hsdp_backend/_post_import.py) a ``sys.meta_path`` finder
   that, right after ``torch.distributed.distributed_c10d`` executes (i.e. before
   ``torch.distributed/__init__.py`` star-imports its names), wraps
   ``init_process_group`` so that the backends a script gets by default --
   no backend, ``"gloo"``, ``"cpu:gloo,cuda:nccl"`` (either order) -- become
   ``"hsdp"``; any other backend string is passed through unchanged;
2. runs the ``sitecustomize`` this file shadows (the next one on ``sys.path``,
   e.g. Debian's ``/usr/lib/python3.X/sitecustomize.py`` or one on the user's
   own ``PYTHONPATH``), so the process behaves as it would without us.

Step 1 happens only while ``HSDP_RUN_BACKEND_MAP=1`` is set; step 2 always.
``HSDP_RUN_VERBOSE=1`` prints one line on stderr per mapped call.

This directory must hold nothing but this file: everything in it is
importable by every process launched through ``hsdp_backend.run``.
"""

import os
import sys

_ENABLE_ENV = "HSDP_RUN_BACKEND_MAP"
_VERBOSE_ENV = "HSDP_RUN_VERBOSE"
_TARGET = "torch.distributed.distributed_c10d"
_HSDP = "hsdp"
_MARK = "_hsdp_run_wrapped"


def _hsdp_map_backend(backend):
    """Returns "hsdp" when ``backend`` is one a script gets by default (what
    it would get on a plain torchrun), else None (leave the argument alone)."""
    if backend is None:
        return _HSDP
    if not isinstance(backend, str):
        return None
    norm = backend.strip().lower().replace(" ", "")
    if norm == "":  # torch treats a falsy backend like no backend at all
        return _HSDP
    if norm == "gloo":
        return _HSDP
    if sorted(norm.split(",")) == ["cpu:gloo", "cuda:nccl"]:
        return _HSDP
    return None


def _hsdp_rank(kwargs):
    rank = kwargs.get("rank", -1)
    if isinstance(rank, int) and rank >= 0:
        return str(rank)
    return os.environ.get("RANK", "?")


def _hsdp_import_backend():
    """Imports hsdp_backend (which registers "hsdp") or explains what to do."""
    try:
        import hsdp_backend
    except ImportError as exc:
        raise ImportError(
            f"hsdp_backend.run: this rank was started by `python -m hsdp_backend.run`, "
            f"which maps init_process_group()'s default/gloo backend to 'hsdp', but "
            f"`import hsdp_backend` failed in this process ({exc}). Run the ranks "
            f"with a Python in which the hsdp-backend package is installed "
            f"(this rank runs {sys.executable}), or launch with plain `torchrun` "
            f"to keep the script's own backend."
        ) from exc
    import torch.distributed as dist

    if hsdp_backend.BACKEND_NAME.upper() not in dist.Backend._plugins:
        hsdp_backend.register()  # raises the real reason registration failed


def _hsdp_wrap(orig):
    if getattr(orig, _MARK, False):
        return orig

    def init_process_group(*args, **kwargs):
        positional = bool(args)
        backend = args[0] if positional else kwargs.get("backend")
        new = _hsdp_map_backend(backend)
        if new is not None:
            _hsdp_import_backend()
            if positional:
                args = (new,) + tuple(args[1:])
            else:
                kwargs["backend"] = new
            if os.environ.get(_VERBOSE_ENV) == "1":
                shown = repr(str(backend)) if isinstance(backend, str) else repr(backend)
                # One write: ranks run unbuffered, and a line must not be
                # interleaved with another rank's.
                sys.stderr.write(
                    f"[hsdp.run rank {_hsdp_rank(kwargs)}] "
                    f"init_process_group(backend={shown}) -> {new!r}\n"
                )
                sys.stderr.flush()
        return orig(*args, **kwargs)

    # functools.wraps without importing functools.
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(init_process_group, attr, getattr(orig, attr))
        except AttributeError:
            pass
    init_process_group.__dict__.update(getattr(orig, "__dict__", {}))
    init_process_group.__wrapped__ = orig
    setattr(init_process_group, _MARK, True)
    return init_process_group


def _hsdp_patch(c10d):
    fn = getattr(c10d, "init_process_group", None)
    if fn is None:
        return
    wrapped = _hsdp_wrap(fn)
    c10d.init_process_group = wrapped
    # torch.distributed copies the name with a star-import; patch the copy
    # too if it was already made (c10d imported before this hook existed).
    pkg = sys.modules.get("torch.distributed")
    if pkg is not None and getattr(pkg, "init_process_group", None) is fn:
        pkg.init_process_group = wrapped


def _hsdp_post_import():
    """hsdp_backend/_post_import.py, loaded by path (importing the package
    would import torch) under its package name, so the package shares it."""
    import importlib.machinery
    from importlib._bootstrap import module_from_spec

    name = "hsdp_backend._post_import"
    module = sys.modules.get(name)
    if module is None:
        path = os.path.join(
            os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "_post_import.py"
        )
        loader = importlib.machinery.SourceFileLoader(name, path)
        spec = importlib.machinery.ModuleSpec(name, loader, origin=path)
        spec.has_location = True  # gives the module its __file__
        module = module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
    return module


def _hsdp_install():
    if os.environ.get(_ENABLE_ENV) != "1":
        return
    _hsdp_post_import().when_imported(_TARGET, _hsdp_patch)


def _hsdp_chain():
    """Runs the sitecustomize this module shadows, if there is one."""
    import importlib.machinery

    here = os.path.dirname(os.path.realpath(__file__))
    rest = []
    for entry in sys.path:
        try:
            if os.path.realpath(entry or os.curdir) == here:
                continue
        except (TypeError, ValueError, OSError):
            pass
        rest.append(entry)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    try:
        from importlib._bootstrap import module_from_spec
    except ImportError:  # pragma: no cover - private API moved
        from importlib.util import module_from_spec
    module = module_from_spec(spec)
    # Visible as sitecustomize while it runs, as it would be without us.
    this = sys.modules.get(__name__)
    sys.modules[__name__] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if this is not None:
            sys.modules[__name__] = this
    # `import sitecustomize; sitecustomize.X` keeps working for its names.
    ours = globals()
    for name, value in vars(module).items():
        if not name.startswith("__") and name not in ours:
            ours[name] = value
    ours["_hsdp_chained"] = module


_hsdp_install()  # first, so a shadowed sitecustomize that imports torch is covered
_hsdp_chain()
