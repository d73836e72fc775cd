#!/usr/bin/env bash
# Everything hsdp can check only on a GPU, in one command, into one report.
#
#   bash scripts/gpu_check.sh [--ranks N] [report path]
#                      (default: 2 ranks, gpu_check_report.txt)
#
# --ranks N: the multi-rank checks and the example run on N ranks (HSDP
# meshes on 4) whatever the number of GPUs: ranks beyond it share GPUs, each
# with its own NCCL_HOSTID (pytest_hsdp/_placement.py says what such a
# run proves: NCCL's semantics over its socket transport, not its speed).
#
# On a machine without a GPU it says so in one line and exits 0. With one or
# more, the Python it checks with is, in this order: HSDP_GPU_CHECK_PYTHON (a
# Python that already has torch with CUDA and hsdp_backend installed); the
# machine's own python3 when its torch sees a GPU and it has the build tools
# (scikit-build-core, ninja, pytest, pytest-timeout): the package is built
# against that torch into build/gpu-site, offline (GPU images often cannot
# download), and the environment's CXX is used unless the build refuses it
# (a g++ that links libstdc++ statically), then /usr/bin/g++, saying so;
# else the venv of scripts/setup.sh (torch 2.14.1, downloaded). Then it
# records the device and the
# versions, runs tests/integration/test_cuda.py (the one-GPU checks, the one-GPU checks
# under TORCH_CUDA_SANITIZER=1, and the two-GPU part when there are two
# GPUs), and trains the FSDP2 example on one GPU rank on hsdp and on nccl
# (losses compared, step times side by side), and measures hsdp's cost per
# CUDA call against nccl's, also with hsdp's flight recorder off
# (benchmarks/device_calls.py; HSDP_GPU_CHECK_QUICK=1 for its short form).
# Exits non-zero if anything failed; the report says what.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Whether a build log holds cmake/CxxRuntime.cmake's refusal. CMake folds a
# message's lines wherever they grow long (on one GPU image, inside the
# phrase itself), so the log's whitespace is joined first.
cxx_refused() { tr -s '[:space:]' ' ' < "$1" | grep -q "cannot share torch's C++ runtime"; }
if [ "${1:-}" = "--cxx-refused" ]; then
  cxx_refused "$2"
  exit
fi

ranks=2
report=gpu_check_report.txt
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks)
      ranks=${2:-}
      shift
      [ $# -eq 0 ] || shift
      ;;
    *)
      report=$1
      shift
      ;;
  esac
done
if ! [[ "$ranks" =~ ^[1-8]$ ]]; then
  echo "gpu_check: --ranks takes a number of ranks from 1 to 8, got '${ranks}'" >&2
  exit 2
fi
export HSDP_GPU_CHECK_RANKS=$ranks

gpus=0
if command -v nvidia-smi > /dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
fi
if [ "$gpus" -eq 0 ]; then
  echo "gpu_check: no GPU on this machine (nvidia-smi lists none); nothing checked"
  exit 0
fi

mkdir -p build
: > "$report"
say() { echo "$*" | tee -a "$report"; }
failed=0

PY=${HSDP_GPU_CHECK_PYTHON:-}
machine_python_builds() {
  python3 - 2> /dev/null << 'EOF'
import shutil, sys
import ninja, pytest, pytest_timeout, scikit_build_core, torch  # noqa: F401
sys.exit(not (torch.cuda.is_available() and shutil.which("cmake")))
EOF
}
if [ -z "$PY" ] && machine_python_builds; then
  site=build/gpu-site
  say "== build against the machine's python3 ($(python3 -c 'import torch; print("torch", torch.__version__)') -> $site)"
  build_log=build/gpu_check_build.log
  build_here() {
    rm -rf "$site" build/gpu
    python3 -m pip install --quiet --no-index --no-build-isolation --no-deps --target "$site" \
      -C build-dir=build/gpu . > "$build_log" 2>&1
    local rc=$?
    cat "$build_log" >> "$report"
    return $rc
  }
  if ! build_here; then
    if cxx_refused "$build_log" && [ -x /usr/bin/g++ ]; then
      say "the environment's compiler (CXX=${CXX:-unset}) was refused (log above); building with /usr/bin/g++"
      CXX=/usr/bin/g++ build_here || { say "FAILED: building with /usr/bin/g++ (log above)"; exit 1; }
    else
      say "FAILED: building against the machine's python3 (log above)"
      exit 1
    fi
  fi
  # The tests' plugin (pure Python) beside it; where the machine's python3 cannot build it (no
  # setuptools >= 64), from its sources, loaded by name.
  if ! python3 -m pip install --quiet --no-index --no-build-isolation --no-deps --target "$site" \
    ./pytest-hsdp >> "$report" 2>&1; then
    say "pytest-hsdp could not be installed (log above); loading it from pytest-hsdp/src"
    export PYTHONPATH="$PWD/pytest-hsdp/src${PYTHONPATH:+:$PYTHONPATH}" PYTEST_PLUGINS=pytest_hsdp
  fi
  export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
elif [ -z "$PY" ]; then
  say "== setup (scripts/setup.sh)"
  if ! bash scripts/setup.sh >> "$report" 2>&1; then
    say "FAILED: scripts/setup.sh (log above)"
    exit 1
  fi
  PY=.venv/bin/python
fi

say "== device and versions ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader >> "$report" 2>&1
"$PY" - >> "$report" 2>&1 << 'EOF'
import torch
import hsdp_backend
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
print("gpus visible to torch:", torch.cuda.device_count())
print("hsdp_backend from", hsdp_backend.__file__)
EOF
[ $? -eq 0 ] || { say "FAILED: torch with CUDA and hsdp_backend must import"; failed=1; }

# torch 2.11-2.13's ProcessGroupNCCL hands NCCL a bf16 PREMUL_SUM factor as
# the low half of a float (docs/versions.md): 0.5 becomes 0. NCCL's one-rank
# path applies the factor too, so one GPU shows what this torch does; hsdp
# must give 0.5 whatever the plain group gives.
say "== bf16 PREMUL_SUM(0.5) at one rank: the ProcessGroupNCCL hsdp wraps, and hsdp"
"$PY" - >> "$report" 2>&1 << 'EOF' || { say "FAILED: hsdp's bf16 PREMUL_SUM(0.5) (report above)"; failed=1; }
import socket
import torch
import torch.distributed as dist
from hsdp_backend import _torch_compat
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("hsdp", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
plain = dist.new_group(backend=_torch_compat.WRAPPED_NCCL)
got = {}
for name, group in (("hsdp", None), (_torch_compat.WRAPPED_NCCL, plain)):
    t = torch.ones(4, device=dev, dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
    got[name] = t.float().tolist()
    print(f"{name}: bf16 all_reduce PREMUL_SUM(0.5) of ones -> {got[name]}")
dist.destroy_process_group()
assert got["hsdp"] == [0.5] * 4, got
EOF
tail -n 2 "$report"

say "== tests/integration/test_cuda.py (1 and $ranks ranks, HSDP meshes on 4, on $gpus GPU(s))"
"$PY" -m pytest tests/integration/test_cuda.py -v -rs --timeout 1200 >> "$report" 2>&1 || failed=1
tail -n 1 "$report"

# Against the ProcessGroupNCCL hsdp wraps ("nccl-legacy" from 2.14; on 2.15
# plain "nccl" is ProcessGroupNCCL2), saved as gpu_check_nccl.
wrapped=$("$PY" -c 'from hsdp_backend import _torch_compat; print(_torch_compat.WRAPPED_NCCL)')
say "== FSDP2 example on $ranks rank(s) of $gpus GPU(s): hsdp against $wrapped"
# Ranks beyond the GPUs share them (the example takes LOCAL_RANK % GPUs), each
# with an NCCL host identity of its own where they do.
share=()
if [ "$ranks" -gt "$gpus" ]; then
  share=(--no-python sh -c 'NCCL_HOSTID=gpu-check-rank$LOCAL_RANK exec "$0" "$@"' "$PY")
fi
for backend in hsdp "$wrapped"; do
  label=$([ "$backend" = hsdp ] && echo hsdp || echo nccl)
  "$PY" -m torch.distributed.run --nproc-per-node "$ranks" "${share[@]}" examples/train_fsdp.py \
    --device cuda --backend "$backend" --steps 10 --json > "build/gpu_check_$label.jsonl" \
    2>> "$report" || { say "FAILED: the example on $backend"; failed=1; }
done
"$PY" - >> "$report" 2>&1 << 'EOF' || failed=1
import json, statistics
runs = {}
for b in ("hsdp", "nccl"):
    with open(f"build/gpu_check_{b}.jsonl") as f:
        runs[b] = [json.loads(line) for line in f if line.startswith("{")]
assert runs["hsdp"] and len(runs["hsdp"]) == len(runs["nccl"]), {b: len(r) for b, r in runs.items()}
print("step  loss hsdp        loss nccl        step_ms hsdp  step_ms nccl")
for h, n in zip(runs["hsdp"], runs["nccl"]):
    print(f"{h['step']:4d}  {h['loss']:.9f}  {n['loss']:.9f}  {h['step_ms']:12.2f}  {n['step_ms']:12.2f}")
# Step 1 includes NCCL's communicator set-up: medians over the rest.
med = {b: statistics.median(m["step_ms"] for m in r[1:]) for b, r in runs.items()}
print(f"median step_ms (steps 2+): hsdp {med['hsdp']:.2f}, nccl {med['nccl']:.2f}, "
      f"ratio hsdp/nccl {med['hsdp'] / med['nccl']:.3f}")
worst = max(abs(h["loss"] - n["loss"]) for h, n in zip(runs["hsdp"], runs["nccl"]))
print(f"largest loss difference: {worst:.3g}")
# 1-D FSDP: hsdp hands NCCL the same reduce-scatters and all-gathers the plain
# group runs and both run FSDP2's kernels, so the losses agree to the last
# bits (the bound only absorbs a rounding step).
scale = max(abs(m["loss"]) for m in runs["nccl"])
assert worst <= 1e-6 * scale, "losses differ between hsdp and nccl"
EOF
tail -n 3 "$report"

# per_call WHAT JSON_NAME [benchmark flags]: one run of the per-call benchmark.
per_call() {
  local what=$1 json=$2
  shift 2
  say "== per-call cost: hsdp against nccl, $what (python -m benchmarks device_calls)"
  "$PY" -m benchmarks device_calls --ranks 1 --device cuda "$@" --json "build/$json" \
    >> "$report" 2>&1 || { say "FAILED: the per-call benchmark, $what"; failed=1; }
  grep 'largest ratio' "$report" | tail -n 1 || true
}
per_call "as users run it" gpu_check_device_calls.json ${HSDP_GPU_CHECK_QUICK:+--quick}
# The flight recorder's share of that cost: the same calls with it off
# (short form; docs/gpu.md reads the two side by side).
HSDP_TRACE_ENTRIES=0 per_call "hsdp's flight recorder off (HSDP_TRACE_ENTRIES=0)" \
  gpu_check_device_calls_untraced.json --quick

if [ "$failed" -ne 0 ]; then
  say "gpu_check: FAILED (see $report)"
  exit 1
fi
say "gpu_check: all passed (report: $report)"
