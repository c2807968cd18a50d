"""What /proc and /sys say of a process and of the CPUs it may use (every side: the controller watches its
workers, a worker its peers)."""

from __future__ import annotations

import os
from collections.abc import Collection


def usable_cpus() -> int:
    """The CPUs this thread may run on (its affinity, as taskset or a Slurm job sets it), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def usable_cores(cpus: Collection[int] | None = None, topology: str = "/sys/devices/system/cpu") -> int:
    """Physical cores among `cpus` (default: the CPUs this thread may run on): hyperthreads of one core
    (siblings, from `topology`) count once. Where the topology cannot be read, half the CPUs (pairs assumed),
    at least one."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{topology}/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return max(1, len(cpus) // 2)
    return max(1, len(cores))


def batches(workers: int, cpus: int) -> bool:
    """Whether the workers of one host run as `SCHED_BATCH` (`run_as_batch`): where they and the
    process that feeds them (the controller, or the host's agent) outnumber its CPUs. There a thread woken by
    Linux preempts the one running (the default policy), and threads that wake each other in turn (gloo's, a
    collective's peers, a worker answering while the controller sends) lose most of their time to it: on 2 CPUs,
    a 4 KB `all_reduce` among 4 processes took 5.5 ms against 0.74 as batch threads, a small model's DDP step
    8.1 ms against 3.7, a no-op call to 64 workers ~6% less."""
    return workers + 1 > cpus


def run_as_batch() -> None:
    """Schedule every thread of this worker, and the threads they start, as `SCHED_BATCH` (`batches`
    says where): a thread woken by a command, a peer or its own stream waits for the running one to block or use
    up its turn instead of preempting it. It shares the CPUs as fairly as before; only wake-up preemption is gone.
    Called once the worker is set up: setting up (its process group's rendezvous, a round trip to the controller's
    store per key) is a chain of wake-ups that would each wait out a running worker's turn (a mesh's spawn and
    first op took 5-10% longer)."""
    try:
        tids = os.listdir("/proc/self/task")
        policy, param = os.SCHED_BATCH, os.sched_param(0)
    except (AttributeError, OSError):
        return  # (not Linux: the default policy)
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), policy, param)
        except ProcessLookupError:
            continue  # (a thread that has ended since the listing)
        except OSError:
            return  # (not allowed: the default policy)


def proc_state(pid: int | None) -> str | None:
    """The state letter of process `pid` (R, S, D, T, Z, ...), or None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None
