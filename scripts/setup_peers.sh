#!/usr/bin/env bash
# Installs the peers of `python -m benchmarks.peers` (opt-in: neither CI nor
# scripts/setup.sh runs this). Idempotent: what is already there is kept.
#
#   Open MPI   Debian's openmpi-bin + libopenmpi-dev (apt-get; needs root)
#   MPICH      the PyPI `mpich` wheel         } both under $PEERS/mpi, one
#   mpi4py     the PyPI `mpi4py` wheel (4.x)  } prefix, beside the venv
#   DeepSpeed  the PyPI `deepspeed` sdist, --no-deps, under $PEERS/deepspeed,
#              with its small pure dependencies; its shm op is built once here
#
# Nothing goes into the venv's own site-packages: torch and the installed
# hsdp_backend stay as they are. The benchmark puts these prefixes on the
# path of its own launches only.
#
# One mpi4py for two MPIs: mpi4py 4.x wheels carry an extension per MPI ABI
# (MPI.mpich.*.so, MPI.openmpi.*.so) and pick one at import from the
# libmpi they load; MPI4PY_LIBMPI names that library per launch (Debian's
# libmpi.so.40 for Open MPI, $PEERS/mpi/lib/libmpi.so.12 for MPICH).
#
# Environment: PYTHON (default .venv/bin/python), HSDP_PEERS_DIR (default
# .venv/peers), SKIP_APT=1 to leave apt alone, PEERS="ompi mpich deepspeed"
# for a subset.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PEERS_DIR=${HSDP_PEERS_DIR:-.venv/peers}
WANT=${PEERS:-"ompi mpich deepspeed"}
DS_VERSION=${DS_VERSION:-0.19.8}

if [[ ! -x $PYTHON ]]; then
    echo "error: $PYTHON not found; run scripts/setup.sh first" >&2
    exit 1
fi
mkdir -p "$PEERS_DIR"
PEERS_DIR=$(cd "$PEERS_DIR" && pwd)
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
pip_prefix() { # pip install into a prefix of its own, never the venv
    local prefix=$1
    shift
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --prefix "$prefix" "$@"
}
wants() { [[ " $WANT " == *" $1 "* ]]; }

# ---- Open MPI (Debian)
if wants ompi; then
    if dpkg -s openmpi-bin libopenmpi-dev >/dev/null 2>&1; then
        echo "Open MPI: already installed ($(mpirun.openmpi --version 2>/dev/null | head -1))"
    elif [[ ${SKIP_APT:-0} == 1 ]]; then
        echo "Open MPI: not installed and SKIP_APT=1: the benchmark will report it missing"
    elif [[ $(id -u) -ne 0 ]]; then
        echo "Open MPI: not installed; as root: apt-get install openmpi-bin libopenmpi-dev"
    else
        echo "Open MPI: apt-get install openmpi-bin libopenmpi-dev..."
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev
    fi
fi

# ---- mpi4py + MPICH (one prefix: the wheel's libmpi.so.12 lands in its lib/)
MPI_PREFIX=$PEERS_DIR/mpi
MPI_SITE=$MPI_PREFIX/lib/python$PYVER/site-packages
if wants ompi || wants mpich; then
    if [[ -d $MPI_SITE/mpi4py && -e $MPI_PREFIX/lib/libmpi.so.12 ]]; then
        echo "mpi4py + MPICH: already under $MPI_PREFIX"
    else
        echo "mpi4py + MPICH: pip install --prefix $MPI_PREFIX mpi4py mpich..."
        pip_prefix "$MPI_PREFIX" "mpi4py>=4" mpich
    fi
    # Both MPIs, each through the same mpi4py: a one-line smoke test.
    for lib in "$MPI_PREFIX/lib/libmpi.so.12" /usr/lib/*/libmpi.so.40; do
        [[ -e $lib ]] || continue
        PYTHONPATH=$MPI_SITE MPI4PY_LIBMPI=$lib "$PYTHON" -c \
            'from mpi4py import MPI; print("  mpi4py", MPI.Get_library_version().splitlines()[0].strip())'
    done
fi

# ---- DeepSpeed (CPU accelerator), its shm all-reduce op built once
DS_PREFIX=$PEERS_DIR/deepspeed
DS_SITE=$DS_PREFIX/lib/python$PYVER/site-packages
if wants deepspeed; then
    if [[ -d $DS_SITE/deepspeed ]]; then
        echo "DeepSpeed: already under $DS_PREFIX"
    else
        # --no-deps: its requirements name torch, which must stay the venv's
        # own; --no-build-isolation: its setup.py imports that torch. The
        # small pure dependencies go into the same prefix (numpy, ninja and
        # packaging are the venv's already).
        echo "DeepSpeed $DS_VERSION: pip install --no-deps --prefix $DS_PREFIX..."
        pip_prefix "$DS_PREFIX" --no-deps --no-build-isolation "deepspeed==$DS_VERSION" \
            hjson msgpack einops psutil py-cpuinfo tqdm \
            pydantic pydantic-core annotated-types typing-inspection
    fi
    echo "DeepSpeed: building / loading its shm op (first time: a minute or two)..."
    PYTHONPATH=$DS_SITE DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$DS_PREFIX/torch_extensions \
        "$PYTHON" -c '
import torch
from deepspeed.accelerator import get_accelerator
op = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
assert hasattr(torch.ops.deepspeed, "inference_all_reduce_")
print("  shm op ready, vector kernel level", op.vector_kernel_level())
' 2>&1 | grep -a -v "No CUDA runtime"
fi

"$PYTHON" -c 'import torch; print("venv torch unchanged:", torch.__version__)'
echo "peers ready under $PEERS_DIR: python -m benchmarks.peers --quick"
