"""torchrun, with the script's default process group on the hsdp backend.

Usage -- exactly torchrun's arguments::

    python -m hsdp_backend.run --nproc-per-node 4 train.py --lr 0.1
    python -m hsdp_backend.run --nnodes 2 --rdzv-backend c10d \\
        --rdzv-endpoint host:29400 --nproc-per-node 8 train.py

The script is not edited. In every rank, ``dist.init_process_group()`` with no
backend, with ``"gloo"`` or with ``"cpu:gloo,cuda:nccl"`` (either order,
positional or ``backend=``) runs on ``"hsdp"`` instead; any other backend
(``"nccl"``, ``"mpi"``, ``"hsdp"``, ...) is left as the script wrote it.
Set ``HSDP_RUN_VERBOSE=1`` to have each rank print one line on stderr per
mapped call, e.g. ``[hsdp.run rank 0] init_process_group(backend='gloo') -> 'hsdp'``.

How: this module sets two variables and then calls
``torch.distributed.run.main(argv)`` (torchrun itself; nothing of it is
reimplemented). ``PYTHONPATH`` gets ``hsdp_backend/_launch`` prepended, a
directory holding only a ``sitecustomize.py``, and ``HSDP_RUN_BACKEND_MAP=1``
turns that ``sitecustomize`` on. Python imports it at start-up in each rank
(and in anything a rank starts, which inherits both variables); it installs
an import hook that wraps ``init_process_group`` as soon as
``torch.distributed`` loads, without importing torch itself, and then runs
whichever ``sitecustomize`` it shadows. Nothing else in the environment is
changed. Interpreters started with ``-I``, ``-E`` or ``-S`` skip
``PYTHONPATH``/``sitecustomize`` and therefore keep the script's backend.
"""

from __future__ import annotations

import os
import sys

__all__ = ["launch_dir", "prepare_env", "main"]


def launch_dir() -> str:
    """The directory with the injected ``sitecustomize.py``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch")


def prepare_env(environ=None) -> dict:
    """Sets up ``environ`` (default: ``os.environ``) so that the Python
    processes started from it map the default backend to hsdp."""
    environ = os.environ if environ is None else environ
    here = launch_dir()
    path = environ.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != here:
        environ["PYTHONPATH"] = here + (os.pathsep + path if path else "")
    environ["HSDP_RUN_BACKEND_MAP"] = "1"  # read by the injected sitecustomize
    return environ


def main(argv: list[str] | None = None) -> None:
    """Runs torchrun with ``argv`` (default: ``sys.argv[1:]``)."""
    if argv is None:
        argv = sys.argv[1:]
        sys.argv[0] = "python -m hsdp_backend.run"  # torchrun's --help and usage errors
    prepare_env()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(list(argv))


if __name__ == "__main__":
    main()
