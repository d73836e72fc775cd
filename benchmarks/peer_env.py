"""Where the peers of ``python -m benchmarks.peers`` live, whether they can run, and how their launches
start: Open MPI and MPICH under their own launcher (one launch each: two MPI libraries cannot share
a process), DeepSpeed's shm op inside the ordinary rank launch; and the two-process memcpy limit.

Nothing here is installed by the project's setup or CI: scripts/setup_peers.sh puts the peers under
``.venv/peers/`` (or ``$HSDP_PEERS_DIR``), where this module looks for them. A peer that is not
there, or fails to start, is reported missing with the reason, never dropped silently.
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile

from benchmarks import common
from tools import settings
from tools.ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ("gloo", "ompi", "mpich", "deepspeed")
MPI_PEERS = ("ompi", "mpich")
HINT = "run scripts/setup_peers.sh"


def peers_dir() -> str:
    return settings.read("HSDP_PEERS_DIR") or os.path.join(ROOT, ".venv", "peers")


def _site_packages(prefix: str, package: str) -> str | None:
    """``<prefix>/lib/pythonX.Y/site-packages`` of this interpreter when it holds ``package``."""
    path = os.path.join(prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
    return path if os.path.isdir(os.path.join(path, package)) else None


def _ompi_mpirun() -> str | None:
    """Open MPI's launcher: Debian names it mpirun.openmpi; a bare mpirun may be MPICH's."""
    for path in filter(None, map(shutil.which, ("mpirun.openmpi", "mpirun"))):
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "Open MPI" in out.stdout + out.stderr:
            return path
    return None


def _missing(why: str) -> dict:
    return {"available": False, "reason": f"{why} ({HINT})"}


def find_peers(wanted: list[str]) -> dict[str, dict]:
    """Per wanted peer: ``{"available": True, ...how to run it}`` or ``{"available": False,
    "reason": ...}``. Cheap checks (files, ``mpirun --version``, DeepSpeed's op loading once in a
    subprocess); a launch that fails later turns its peer missing too."""
    mpi_prefix = os.path.join(peers_dir(), "mpi")
    mpi4py = _site_packages(mpi_prefix, "mpi4py")
    out: dict[str, dict] = {}
    for peer in wanted:
        if peer == "gloo":
            out[peer] = {"available": True}
        elif peer == "deepspeed":
            out[peer] = _probe_deepspeed(os.path.join(peers_dir(), "deepspeed"))
        elif mpi4py is None:
            out[peer] = _missing(f"mpi4py not found under {mpi_prefix}")
        elif peer == "ompi":
            mpirun = _ompi_mpirun()
            libs = sorted(glob.glob("/usr/lib/*/libmpi.so.40"))  # Debian's, as setup installs
            if mpirun and libs:
                out[peer] = {"available": True, "launcher": mpirun, "libmpi": libs[0]}
            else:
                out[peer] = _missing(
                    "Open MPI not installed (no mpirun reporting 'Open MPI' or no "
                    "libmpi.so.40; apt-get install openmpi-bin libopenmpi-dev)"
                )
        else:
            mpiexec = os.path.join(mpi_prefix, "bin", "mpiexec")
            lib = os.path.join(mpi_prefix, "lib", "libmpi.so.12")
            if os.path.exists(mpiexec) and os.path.exists(lib):
                out[peer] = {"available": True, "launcher": mpiexec, "libmpi": lib}
            else:
                out[peer] = _missing(f"MPICH wheel not found under {mpi_prefix}")
        if peer in MPI_PEERS and out[peer]["available"]:
            out[peer]["pythonpath"] = mpi4py
    return out


_DS_PROBE = """
import torch
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
assert builder is not None, "the CPU accelerator has no ShareMemCommBuilder"
level = builder.load().vector_kernel_level()
assert level >= 1, f"the shm fp32 kernel needs avx2 (level {level})"
assert hasattr(torch.ops.deepspeed, "inference_all_reduce_")
import deepspeed
print("OK", deepspeed.__version__, level)
"""


def _probe_deepspeed(prefix: str) -> dict:
    """Loads DeepSpeed's shm op once in a subprocess: builds it if setup did not (so no rank
    compiles while the others time), and proves it loads."""
    path = _site_packages(prefix, "deepspeed")
    if path is None:
        return _missing(f"deepspeed not found under {prefix}")
    # DeepSpeed on the CPU accelerator, its JIT-built ops kept beside it.
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": f"{prefix}/torch_extensions"}
    probe = [sys.executable, "-c", _DS_PROBE]
    try:
        run_env = {**os.environ, **env, "PYTHONPATH": path}
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=600, env=run_env)
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "building/loading its shm op took over 600 s"}
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not last.startswith("OK"):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"available": False, "reason": "shm op did not load: " + " | ".join(tail)}
    return {"available": True, "sys_path": path, "env": env, "version": last.split()[1]}


def mpi_command(peer: str, info: dict, world: int) -> list[str]:
    """The launcher line for ``world`` ranks of benchmarks.peers' MPI rank body."""
    body = [sys.executable, "-c", "import benchmarks.peers as p; p.mpi_rank_main()"]
    if peer == "mpich":
        return [info["launcher"], "-n", str(world), *body]
    # vader (shared memory) with CMA single copy; no binding, like the other launches;
    # oversubscribed when there are more ranks than cores.
    flags = "--oversubscribe --bind-to none --mca btl self,vader"
    flags += " --mca btl_vader_single_copy_mechanism cma"
    return [info["launcher"], "-np", str(world), *flags.split(), *body]


def run_mpi_launch(peer: str, info: dict, world: int, job: dict, env: dict, timeout_s: float):
    """One MPI launch of ``world`` ranks; (rank 0's output, None) or (None, why it failed)."""
    with tempfile.TemporaryDirectory(prefix=f"hsdp_peers_{peer}_") as tmp:
        cfg, out = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "out.pkl")
        with open(cfg, "wb") as f:
            pickle.dump({**job, "peer": peer, "out": out, "timeout": timeout_s}, f)
        path = os.pathsep.join(filter(None, (info["pythonpath"], ROOT, os.getenv("PYTHONPATH"))))
        run_env = {"OMP_NUM_THREADS": "1", **os.environ, **env, "PYTHONPATH": path}
        run_env["HSDP_PEERS_CONFIG"] = cfg
        run_env["MPI4PY_LIBMPI"] = info["libmpi"]  # one mpi4py wheel, two MPI libraries
        if os.geteuid() == 0:  # containers run as root; Open MPI refuses that by default
            run_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        # A session of its own, killed whole (the ranks with it) on a timeout or an interrupt.
        pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        proc = subprocess.Popen(
            mpi_command(peer, info, world), cwd=ROOT, env=run_env, **pipe, start_new_session=True
        )
        try:
            log, why = proc.communicate(timeout=max(1.0, timeout_s))[0], None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, why = proc.communicate()[0], f"launch timed out after {timeout_s:.0f} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        tail = " | ".join(log.strip().splitlines()[-6:])
        if why or proc.returncode or not os.path.exists(out):
            return None, f"{why or f'launch failed (exit {proc.returncode})'}: {tail}"
        with open(out, "rb") as f:
            return pickle.load(f), None


def _memcpy_rank(rank: int, world: int, sizes: list[int], sampling) -> dict[int, float]:
    import torch
    import torch.distributed as dist

    out = {}
    for n in sizes:
        dist.barrier()  # both processes copy at once, for the same budget
        out[n] = common.memcpy_us(n, torch.float32, sampling)
    return out


def memcpy2(sizes: list[int], sampling) -> dict[int, dict]:
    """Two single-thread ``dst.copy_(src)`` processes at once, per size: the per-process copy rate
    when two ranks share the memory system. Time: the slower process's median."""
    kwargs = {"sizes": sizes, "sampling": sampling}
    timeout = 120 + 10 * sampling.budget_s * len(sizes)
    both = run_ranks(
        _memcpy_rank, 2, backend="gloo", timeout_s=timeout, collective_timeout_s=60, kwargs=kwargs
    )
    out = {}
    for n in sizes:
        us = max(r[n] for r in both)
        out[n] = {"us": us, "gbps": n / us / 1e3, "per_process_us": [r[n] for r in both]}
    return out
