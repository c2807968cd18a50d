"""How busy this machine is, for waits on other processes' reactions.

A wait for a worker to react to an interrupt, or for a debugged rank to reach its next prompt, is a
moment of that process's CPU time. On a machine busy with other work every process gets a share of each
CPU, and the moment stretches by as much: `stretched` scales such a grace by the run queue's length per
CPU, so that what a quiet machine decides in 0.6 s a loaded one decides the same way, later.
"""

from __future__ import annotations

import os

MOST = 10.0
"""The most a grace is stretched (a run queue longer than this per CPU is not waited out)."""


def contention() -> float:
    """Runnable tasks per CPU on this machine now (at least 1.0; 1.0 where the system does not say)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0]) - 1  # (the reader itself is running)
    except (OSError, ValueError, IndexError):
        return 1.0
    return min(MOST, max(1.0, running / (os.cpu_count() or 1)))


def stretched(seconds: float) -> float:
    """`seconds` of a quiet machine, as long as it takes on this one now."""
    return seconds * contention()


ASK_WAIT = 5.0
"""The most seconds to wait for busy ranks to say where they are. Their control threads answer within
milliseconds, even while user code or a collective holds the main thread, so the wait ends with the last
answer; the bound is for a rank whose thread holding the GIL keeps it from answering."""
