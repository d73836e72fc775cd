"""The loaded mode (``--load N``): N CPU-bound processes beside the ranks for
the whole run, as data-loader workers or other jobs share a training
machine's cores. Each spins in pure Python at the default priority, so the
scheduler time-slices it with the ranks; how a backend waits when its peer
is descheduled (spin, futex, yield) is then what the numbers show."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

SPIN = "while True: pass"


def parse(text: str) -> int:
    """``--load``: a count, or ``cores`` for one per core of this process."""
    if text == "cores":
        return len(os.sched_getaffinity(0))
    count = int(text)
    if count < 0:
        raise ValueError("--load must be >= 0 or 'cores'")
    return count


@contextlib.contextmanager
def busy(count: int):
    """Runs ``count`` spinning processes until the block ends (or fails)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SPIN],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches the parent, which stops them
        )
        for _ in range(count)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(10)
