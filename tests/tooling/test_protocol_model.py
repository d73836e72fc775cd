"""The spin models: the engine's step protocol, its sleep/wake handshake, a membership change and
the wait contract, with the broken variants caught.

The engine's step protocol and its sleep/wake handshake, and the wait
contract of the Works hsdp completes on its own threads, model-checked:
csrc/shm/protocol.pml and wake.pml (next to Engine.hpp), csrc/backend/wait.pml
(next to OpQueue and WorkHSDP) checked by spin through
scripts/check_protocol.sh: safe and deadlock-free, no lost wake-up, no wait
left waiting, and every broken rule caught (so the assertions bite).

`scripts/check_protocol.sh`: spin checks `csrc/shm/protocol.pml` (3 ranks x 3 steps and 2 ranks
x 6 steps, every sequence of step kinds; `HSDP_TEST_PROTOCOL_FULL=1`: 3 ranks x 4 steps; with
`-DPOOL` also pooled calls (3 ranks x 1 call and 2 x 3; full: 3 x 2) with every subset of ranks
pooled, and with `-DPOOL_REDUCE` pooled all-reduces, whose two rounds run on the ranks' own
buffers): safe and deadlock-free; the overwrite rule removed: still safe (implied by the step
order); the reduced wait, a direct step's final wait or the second slot removed, a rank skipping
a step, a pooled call returning before its peers are done, a rank reading the slots of a step a
peer posted without data, or a pooled all-reduce copying reduced parts before every rank's
`reduced`: spin must find the violation or deadlock; and `csrc/shm/wake.pml`, the sleep/wake
handshake (2 ranks x 3 steps, 3 x 2): no lost wake-up, and one found when the waiter does not
check again after announcing itself or the publisher reads `sleepers` before its store; and
`csrc/shm/epoch.pml`, a reconfigure: a lost rank that keeps writing the old segment never reaches
the survivors' new one, and every survivor gets there; a deadlock found when the new membership's
rendezvous runs on the old store keys or the queue is drained before the old segment is marked
broken (about 1 min; full: about 4 min, 1 GB)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_step_protocol_model_checks():
    assert shutil.which("spin"), "spin missing: run scripts/setup.sh (installs Debian's spin)"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_protocol.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    lines = [line for line in out.splitlines() if line.startswith("[protocol]")]
    # 6 safe runs (3 with pooled calls, one of them pooled all-reduces),
    # 7 broken rules caught (3 of the pool).
    assert len(lines) == 13, out
    wake = [line for line in out.splitlines() if line.startswith("[wake]")]
    # 2 safe runs, 2 lost wake-ups found when a rule is broken.
    assert len(wake) == 4, out
    assert sum("safe, no deadlock" in line for line in wake) == 2, out
    assert sum("violation found" in line for line in wake) == 2, out
    assert sum("safe, no deadlock" in line for line in lines) == 6, out
    assert sum("violation found" in line for line in lines) == 7, out
    assert sum("-DPOOL" in line for line in lines) == 6, out
    assert sum("-DPOOL_REDUCE" in line for line in lines) == 2, out
    epoch = [line for line in out.splitlines() if line.startswith("[epoch]")]
    # Safe; the old store's counter and no leave() before the drain caught (deadlocks).
    assert len(epoch) == 3, out
    assert sum("safe, no deadlock" in line for line in epoch) == 1, out
    assert sum("invalid end state" in line for line in epoch) == 2, out
    wait = [line for line in out.splitlines() if line.startswith("[wait]")]
    # Every scenario served; 5 broken rules caught (2 by assertion, 3 by a
    # wait left waiting).
    assert len(wait) == 6, out
    assert sum("safe, no deadlock" in line for line in wait) == 1, out
    assert sum("violation found" in line for line in wait) == 5, out
    assert sum("assertion violated" in line for line in wait) == 2, out
