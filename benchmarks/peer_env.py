"""Where the peers of the ``peers`` suite live, whether they can run, and how
their launches start: Open MPI and MPICH under their own launcher (one
launch each, since two MPI libraries cannot share a process), DeepSpeed's
shm op inside the ordinary rank launch, and the two-process memcpy limit.

Nothing here is installed by the project's setup or CI:
scripts/setup_peers.sh puts the peers under ``.venv/peers/`` (or
``$HSDP_PEERS_DIR``), where this module looks for them. A peer that is not
there, or fails to start, is reported as missing with the reason; the
suite never drops one silently.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tools import settings
from tools.ranks import free_port  # noqa: F401  (re-exported for the suite)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ("gloo", "ompi", "mpich", "deepspeed")
MPI_PEERS = ("ompi", "mpich")
SETUP_HINT = "run scripts/setup_peers.sh"


def peers_dir() -> str:
    return settings.read("HSDP_PEERS_DIR") or os.path.join(ROOT, ".venv", "peers")


def _site_packages(prefix: str) -> str | None:
    """``<prefix>/lib/pythonX.Y/site-packages`` of this interpreter's version, if present."""
    path = os.path.join(
        prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages"
    )
    return path if os.path.isdir(path) else None


def _ompi_mpirun() -> str | None:
    """Open MPI's launcher: Debian names it mpirun.openmpi; a bare mpirun may be MPICH's."""
    for name in ("mpirun.openmpi", "mpirun"):
        path = shutil.which(name)
        if not path:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "Open MPI" in out.stdout + out.stderr:
            return path
    return None


def _ompi_libmpi() -> str | None:
    for pattern in ("/usr/lib/*/libmpi.so.40", "/usr/lib64/openmpi/lib/libmpi.so.40"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def find_peers(wanted: list[str]) -> dict[str, dict]:
    """Per wanted peer: ``{"available": True, ...how to run it}`` or
    ``{"available": False, "reason": ...}``. Cheap checks only (files,
    ``mpirun --version``, DeepSpeed's op loading in a subprocess); a launch
    that fails later turns its peer missing too."""
    base = peers_dir()
    mpi_prefix = os.path.join(base, "mpi")
    mpi4py_path = _site_packages(mpi_prefix)
    if mpi4py_path and not os.path.isdir(os.path.join(mpi4py_path, "mpi4py")):
        mpi4py_path = None
    out: dict[str, dict] = {}
    for peer in wanted:
        if peer == "gloo":
            out[peer] = {"available": True}
        elif peer in MPI_PEERS and mpi4py_path is None:
            out[peer] = {
                "available": False,
                "reason": f"mpi4py not found under {mpi_prefix} ({SETUP_HINT})",
            }
        elif peer == "ompi":
            mpirun, lib = _ompi_mpirun(), _ompi_libmpi()
            if not mpirun or not lib:
                out[peer] = {
                    "available": False,
                    "reason": "Open MPI not installed (no mpirun reporting 'Open MPI' or no "
                    f"libmpi.so.40; apt-get install openmpi-bin libopenmpi-dev, or {SETUP_HINT})",
                }
            else:
                out[peer] = {"available": True, "launcher": mpirun, "libmpi": lib}
        elif peer == "mpich":
            mpiexec = os.path.join(mpi_prefix, "bin", "mpiexec")
            lib = os.path.join(mpi_prefix, "lib", "libmpi.so.12")
            if not (os.path.exists(mpiexec) and os.path.exists(lib)):
                out[peer] = {
                    "available": False,
                    "reason": f"MPICH wheel not found under {mpi_prefix} ({SETUP_HINT})",
                }
            else:
                out[peer] = {"available": True, "launcher": mpiexec, "libmpi": lib}
        elif peer == "deepspeed":
            out[peer] = _probe_deepspeed(os.path.join(base, "deepspeed"))
        if peer in MPI_PEERS and out[peer]["available"]:
            out[peer]["pythonpath"] = mpi4py_path
    return out


def deepspeed_env(prefix: str) -> dict[str, str]:
    """DeepSpeed on the CPU accelerator, its JIT-built ops kept beside it."""
    return {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.path.join(prefix, "torch_extensions"),
    }


_DS_PROBE = """
import torch
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
assert builder is not None, "the CPU accelerator has no ShareMemCommBuilder"
op = builder.load()
level = op.vector_kernel_level()
assert level >= 1, f"the shm fp32 kernel needs avx2 (level {level})"
assert hasattr(torch.ops.deepspeed, "inference_all_reduce_")
import deepspeed
print("OK", deepspeed.__version__, level)
"""


def _probe_deepspeed(prefix: str) -> dict:
    """Loads DeepSpeed's shm op once in a subprocess: builds it if setup did
    not (so no rank compiles while others time), and proves it loads."""
    path = _site_packages(prefix)
    if not path or not os.path.isdir(os.path.join(path, "deepspeed")):
        return {"available": False, "reason": f"deepspeed not found under {prefix} ({SETUP_HINT})"}
    env = {**os.environ, **deepspeed_env(prefix), "PYTHONPATH": path}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _DS_PROBE],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "building/loading its shm op took over 600 s"}
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode != 0 or not last[0].startswith("OK"):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"available": False, "reason": "shm op did not load: " + " | ".join(tail)}
    return {
        "available": True,
        "sys_path": path,
        "env": deepspeed_env(prefix),
        "version": last[0].split()[1],
    }


# ---------------------------------------------------------------- MPI launches


def mpi_command(peer: str, info: dict, world: int) -> list[str]:
    """The launcher line for ``world`` ranks of this repository's MPI rank body."""
    body = [sys.executable, "-c", "import benchmarks.peers as p; p.mpi_rank_main()"]
    if peer == "ompi":
        # vader (shared memory) with CMA single copy, as the issue measured;
        # no binding, like the other launches; oversubscribe for W > cores.
        return [
            info["launcher"],
            "-np",
            str(world),
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,vader",
            "--mca",
            "btl_vader_single_copy_mechanism",
            "cma",
            *body,
        ]
    return [info["launcher"], "-n", str(world), *body]


def run_mpi_launch(
    peer: str, info: dict, world: int, config: dict, env: dict, port: int, timeout_s: float
) -> tuple[dict | None, str | None]:
    """Runs one MPI launch; returns (rank 0's output, None) or (None, why it failed)."""
    with tempfile.TemporaryDirectory(prefix=f"hsdp_peers_{peer}_") as tmp:
        cfg_path, out_path = os.path.join(tmp, "config.pkl"), os.path.join(tmp, "out.pkl")
        with open(cfg_path, "wb") as f:
            pickle.dump(
                {
                    "config": config,
                    "peer": peer,
                    "port": port,
                    "out": out_path,
                    "timeout": timeout_s,
                },
                f,
            )
        run_env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            **env,
            "HSDP_PEERS_CONFIG": cfg_path,
            "MPI4PY_LIBMPI": info["libmpi"],  # one mpi4py wheel, two MPI libraries
            "PYTHONPATH": os.pathsep.join(
                p for p in (info["pythonpath"], ROOT, os.environ.get("PYTHONPATH")) if p
            ),
        }
        if os.geteuid() == 0:  # containers run as root; Open MPI refuses that by default
            run_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        log_path = os.path.join(tmp, "log.txt")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                mpi_command(peer, info, world),
                cwd=ROOT,
                env=run_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole on timeout
            )
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s))
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if sys.exc_info()[0] is not subprocess.TimeoutExpired:
                    raise
                rc = None
        with open(log_path) as f:
            tail = " | ".join(f.read().strip().splitlines()[-6:])
        if rc is None:
            return None, f"launch timed out after {timeout_s:.0f} s: {tail}"
        if rc != 0 or not os.path.exists(out_path):
            return None, f"launch failed (exit {rc}): {tail}"
        with open(out_path, "rb") as f:
            return pickle.load(f), None


# ---------------------------------------------------------------- memcpy2


def _memcpy_worker(sizes, seconds, dtype_name, barrier, queue):
    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    out = {}
    for nbytes in sizes:
        src = torch.ones(max(nbytes // elem, 1), dtype=dtype)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        calls = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7))))
        barrier.wait()  # both copy for the same wall time: the samples overlap
        samples, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(samples) < 3:
            t1 = time.perf_counter()
            for _ in range(calls):
                dst.copy_(src)
            samples.append((time.perf_counter() - t1) / calls)
        out[nbytes] = statistics.median(samples)
    queue.put(out)


def measure_memcpy2(sizes: list[int], dtype_name: str, seconds: float) -> dict[int, dict]:
    """Two single-thread ``dst.copy_(src)`` processes at once, per size: the
    per-process copy rate when two ranks share the memory system (the limit
    of one rank's side of a 2-rank collective). Time: the slower process's
    median."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    sizes = sorted(set(sizes))
    procs = [
        ctx.Process(target=_memcpy_worker, args=(sizes, seconds, dtype_name, barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=60 + 4 * seconds * len(sizes)) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    out = {}
    for n in sizes:
        t = max(r[n] for r in results)
        out[n] = {
            "us": t * 1e6,
            "gbps": n / t / 1e9,
            "per_process_us": [r[n] * 1e6 for r in results],
        }
    return out
