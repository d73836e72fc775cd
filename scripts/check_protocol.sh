#!/usr/bin/env bash
# Model-checks the engine's step protocol (csrc/shm/protocol.pml), its
# sleep/wake handshake (csrc/shm/wake.pml), a membership change
# (csrc/shm/epoch.pml) and the wait contract of the Works
# hsdp completes on its own threads (csrc/backend/wait.pml) with spin: the
# protocol must be safe and deadlock-free, the overwrite rule must be implied
# by the order of steps (NO_REUSE_WAIT safe), no wake-up may be lost, no wait
# may wait for ever, and each broken rule must be caught. Exits non-zero otherwise. Needs spin and gcc (Debian's
# spin: scripts/setup.sh installs it).
#
# By default the safe configurations are proved at sizes that take seconds
# (3 ranks x 3 calls; pooled calls at 3 ranks x 1 call and 2 ranks x 3 calls):
# about a minute on 2 cores. HSDP_TEST_PROTOCOL_FULL=1 proves them at
# 3 ranks x 4 calls and pooled 3 ranks x 2 calls (up to 40 million states a
# run): about four minutes and 1 GB of memory. The broken rules are caught
# at the same sizes either way (spin stops at the first error).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
model=$PWD/csrc/shm/protocol.pml
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

# check EXPECT DEFINES...: EXPECT is "safe" (no error) or "violation".
# The model is protocol.pml, or MODEL_FILE (named MODEL in the output).
check() {
  local expect=$1
  shift
  spin "$@" -a "${MODEL_FILE:-$model}" > spin.log 2>&1 || { cat spin.log; exit 1; }
  gcc -O2 -DSAFETY -DCOLLAPSE -o pan pan.c 2> gcc.log || { cat gcc.log; exit 1; }
  ./pan -m100000 > pan.log 2>&1 || true
  local errors
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' pan.log)
  local states
  states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' pan.log)
  if grep -q "depth too small\|max search depth too small" pan.log; then
    echo "[protocol] $*: search depth too small"; cat pan.log; exit 1
  fi
  if [ "$expect" = safe ] && [ "$errors" = 0 ]; then
    echo "[${MODEL:-protocol}] ${*:-base}: safe, no deadlock ($states states)"
  elif [ "$expect" = violation ] && [ -n "$errors" ] && [ "$errors" != 0 ]; then
    echo "[${MODEL:-protocol}] $*: violation found, as it must be: $(grep -m1 "pan:1" pan.log)"
  else
    echo "[protocol] $*: expected $expect, spin says errors=${errors:-?}"; cat pan.log; exit 1
  fi
}

if [ "${HSDP_TEST_PROTOCOL_FULL:-0}" = 1 ]; then
  calls=(-DW=3 -DK=4) pooled=(-DW=3 -DK=2)
else
  calls=(-DW=3 -DK=3) pooled=(-DW=3 -DK=1)
fi
check safe "${calls[@]}"
check safe -DW=2 -DK=6
check safe "${calls[@]}" -DNO_REUSE_WAIT
check violation -DW=3 -DK=4 -DNO_REDUCED_WAIT
check violation -DW=3 -DK=4 -DNO_DIRECT_WAIT
check violation -DW=3 -DK=4 -DONE_SLOT
check violation -DW=3 -DK=4 -DSKIP_STEP
# Pooled calls (every subset of ranks with a pool buffer), with the others.
check safe "${pooled[@]}" -DPOOL
check safe -DW=2 -DK=3 -DPOOL
check violation -DW=2 -DK=3 -DPOOL -DNO_POOL_WAIT
check violation -DW=2 -DK=3 -DPOOL -DNO_POOL_RETRY
# Pooled all-reduces: two rounds on the ranks' own buffers.
check safe "${pooled[@]}" -DPOOL -DPOOL_REDUCE
check violation -DW=2 -DK=2 -DPOOL -DPOOL_REDUCE -DNO_POOL_REDUCED_WAIT
# The sleep/wake handshake: no lost wake-up, and each broken rule loses one.
MODEL=wake MODEL_FILE=$(dirname "$model")/wake.pml
check safe -DW=2 -DK=3
check safe -DW=3 -DK=2
check violation -DW=2 -DK=3 -DNO_RECHECK
check violation -DW=2 -DK=3 -DSLEEPERS_FIRST
# A membership change: the lost rank's writes never reach the new segment,
# every survivor gets there, and each broken rule caught.
MODEL=epoch MODEL_FILE=$(dirname "$model")/epoch.pml
check safe
check violation -DSHARED_COUNTER
check violation -DNO_LEAVE
check violation -DREUSED_UUID
# The wait contract: every scenario served, and each broken rule caught.
MODEL=wait MODEL_FILE=$(dirname "$model")/../backend/wait.pml
check safe
check violation -DRELEASED_ON_WORKER
check violation -DNO_ELASTIC
check violation -DNO_RESCUE
check violation -DEARLY_RELEASE
check violation -DNO_WAKE
