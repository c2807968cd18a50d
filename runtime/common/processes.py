"""What /proc says of a process (every side: the controller watches its workers, a worker its peers)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this thread may run on (its affinity, as taskset or a Slurm job sets it), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def proc_state(pid: int | None) -> str | None:
    """The state letter of process `pid` (R, S, D, T, Z, ...), or None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None
