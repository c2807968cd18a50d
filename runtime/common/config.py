"""Every `MONARCH_*` setting, read once per process into a frozen `Settings`.

The controller reads them; workers get the values they need from the controller when they start
(`protocol.WorkerStart`), so a worker never reads a knob of its own. Bad values are a `ValueError` naming the
variable, the value and what is allowed.

Five knobs are read here too, but when used rather than once, as a process may switch them: `jobs_dir()`
(``MONARCH_JOBS_DIR``), `sim_profiles_dir()` (``MONARCH_SIM_PROFILES``), `output_dir()`
(``MONARCH_OUTPUT_DIR``), `rdma_path()` (``MONARCH_RDMA_PATH``, the controller's environment reaching its
workers) and `log_level_name()`
(``MONARCH_LOG``, read by every process, workers too: `common/log.py` turns a bad value into a warning, not an
error, as logging must never stop a run).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """The runtime's knobs. Environment variable in brackets; defaults suit one machine."""

    transport: str = "ipc"
    """[MONARCH_TRANSPORT] ``ipc`` (sockets in a private directory) or ``tcp`` (across hosts; encrypted
    with ZeroMQ CURVE, one key pair per mesh)."""
    bind_addr: str = "127.0.0.1"
    """[MONARCH_BIND_ADDR] The interface address TCP sockets bind to (never all interfaces by default)."""
    spawn_timeout: float = 120.0
    """[MONARCH_SPAWN_TIMEOUT] Seconds a mesh may take to start before spawning fails."""
    group_timeout: float = 600.0
    """[MONARCH_GROUP_TIMEOUT] Seconds a collective (and the rendezvous store) waits for the other ranks."""
    spin: float = 0.0005
    """[MONARCH_SPIN_US, in µs] How long a caller waiting for replies polls for them before it sleeps;
    waking a sleeping thread costs tens of µs on a VM. Only when the workers it waits for leave this machine
    a CPU free (else polling takes a CPU from them). 0 turns polling off."""
    send_hwm: int = 1000
    """[MONARCH_SEND_HWM] Commands queued for one worker that has not taken them yet; past this, senders
    wait for it (backpressure) instead of queueing more memory."""
    send_stall: float = 10.0
    """[MONARCH_SEND_STALL] Seconds a sender waits for a worker whose queue is full; then that worker is
    dropped and its mesh fails, naming it."""
    frozen_after: float = 2.0
    """[MONARCH_FROZEN_AFTER] Seconds a worker may stay stopped (SIGSTOP, process state T) before it is
    reported lost and its mesh fails."""
    exit_grace: float = 3.0
    """[MONARCH_EXIT_GRACE] Seconds workers get to exit after `mesh.exit()` before they are killed."""
    hang_report: float = 30.0
    """[MONARCH_HANG_REPORT] Seconds a call may run while some of its ranks wait in a collective before the
    call's output says which ranks wait where and which rank they wait for (once per call). 0 turns it off."""
    stack_report: float = 0.0
    """[CONTROLLER_PYSPY_REPORT_INTERVAL] Every this many seconds, write the stacks of the controller and of
    every worker to the controller's stderr (a kernel's: the Jupyter server's log). 0 (the default): never."""
    lanes: bool = True
    """[MONARCH_LANES] ``1`` (the default) or ``0``: whether workers forked on this machine (IPC transport) talk
    to the controller over a Unix stream connection each (`runtime/wire/lanes.py`) instead of ZeroMQ's command
    and reply sockets, which cost two more thread wake-ups per message."""
    worker_nice: int = 0
    """[MONARCH_WORKER_NICE, 0 to 19] How many steps below the controller's CPU priority (``nice``) workers
    forked on this machine run. Where the cores are fewer than the workers plus one, a trade: the controller
    issuing tensor ops gets the CPU before the workers it feeds (2 cores, 8 workers, 10: ops issued per second
    1.7x, completed 1.1x), and a call's replies each wake it while other workers wait to run (a no-op call
    0.85-0.9x). A worker still has every CPU the controller leaves idle. 0 (the default): the same priority.
    Workers a host agent starts are left as they are."""
    worker_spin: float = 0.0005
    """[MONARCH_WORKER_SPIN_US, in µs] How long a worker forked on this machine, waiting for its next command,
    polls its lane before it sleeps, when its last wait was no longer than that (commands coming that close
    together). A command then finds it awake: the controller's send wakes no sleeping CPU (on a VM an
    interrupt to another virtual CPU, paid by the sender). Only where polling takes no CPU from the
    controller: one worker, beside the controller with a CPU each (2 cores: a no-op call 46-63 µs against
    83-108); more, where each and the controller could have a core to itself with CPUs in hyperthread pairs
    (`backends.local.spins`; 16 CPUs and 8 workers polling read faster in some runs, slower in others). 0
    turns it off."""
    bundle_wait: float = 0.002
    """[MONARCH_BUNDLE_WAIT_US, in µs] How long a host agent holds its workers' replies and output for more of the
    same call's to join them, so that they go to the controller as one bundle (`wire/fanin.py`): a call's replies
    go at once when all of the host's ranks it addressed answered, and anything else goes at least this soon.
    0 turns bundling off (each message goes up as it came)."""
    bundle_above: int = 64
    """[MONARCH_BUNDLE_ABOVE] Host agents bundle the replies of meshes of more ranks than this (and only on hosts
    with several of its ranks). A smaller mesh's replies go up as they came, through a C proxy: bundling saves the
    controller ~10 µs a rank but costs each reply a hop through the agent's Python (~0.1-0.2 ms a call on a
    2-core machine); it pays where ranks are many. 0: every mesh of several ranks a host."""
    rack_size: int = 16
    """[MONARCH_RACK_SIZE, at least 2] Hosts per rack once a job's hosts are racked (`MONARCH_RACK_ABOVE`): one
    agent of each rack (its leader) relays the rack's commands and replies, merging their bundles (`agent/rack.py`),
    so that the controller sends and receives one message a rack instead of one a host."""
    rack_above: int = 64
    """[MONARCH_RACK_ABOVE] A job of more hosts than this is racked (`MONARCH_RACK_SIZE`). Up to 64 hosts a no-op
    call costs the controller under 4 ms; at 128 hosts of 8 ranks 8.4 ms one level deep, 3.0 racked, and its cost per
    host grows with the hosts (ZeroMQ's I/O thread writes and reads every host's connection). 0: every job of two
    hosts or more."""
    heartbeat_timeout: float = 6.0
    """[MONARCH_HEARTBEAT_TIMEOUT] Seconds a link across hosts (the controller's to a host agent) may go without a
    sign of the other end before that host is taken as lost; each end pings every third of it. Raise it where a
    host may be starved of CPU for longer (3 s took a host that was only slow for lost on a 2-core VM with 30-45%
    steal; hundreds of synthetic hosts on one machine need more). At least 1."""
    prewarm: bool = True
    """[MONARCH_PREWARM] ``1`` (the default) or ``0``: whether the Monarch kernel starts the workers' fork server
    (the process that imports torch once, workers being forked from it) as the kernel starts, so that its
    first mesh does not wait for torch's import (about 0.9 s on a 2-core VM). Scripts start it at their first
    spawn either way."""


_ENV = {
    "transport": "MONARCH_TRANSPORT",
    "bind_addr": "MONARCH_BIND_ADDR",
    "spawn_timeout": "MONARCH_SPAWN_TIMEOUT",
    "group_timeout": "MONARCH_GROUP_TIMEOUT",
    "spin": "MONARCH_SPIN_US",
    "worker_spin": "MONARCH_WORKER_SPIN_US",
    "bundle_wait": "MONARCH_BUNDLE_WAIT_US",
    "bundle_above": "MONARCH_BUNDLE_ABOVE",
    "send_hwm": "MONARCH_SEND_HWM",
    "send_stall": "MONARCH_SEND_STALL",
    "frozen_after": "MONARCH_FROZEN_AFTER",
    "exit_grace": "MONARCH_EXIT_GRACE",
    "hang_report": "MONARCH_HANG_REPORT",
    "stack_report": "CONTROLLER_PYSPY_REPORT_INTERVAL",
    "heartbeat_timeout": "MONARCH_HEARTBEAT_TIMEOUT",
    "rack_size": "MONARCH_RACK_SIZE",
    "rack_above": "MONARCH_RACK_ABOVE",
    "prewarm": "MONARCH_PREWARM",
    "lanes": "MONARCH_LANES",
    "worker_nice": "MONARCH_WORKER_NICE",
}


_SWITCHES = {
    "prewarm": "start the fork server with the kernel",
    "lanes": "local workers talk over Unix stream connections",
}
"""The on/off settings, and what 1 means."""


def _number(var: str, text: str, kind: type, minimum: float) -> float | int:
    what = "an integer" if kind is int else "a number"
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{var}={text!r} is not {what}; give {what} >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{var}={text!r} is too small; give {what} >= {minimum}")
    return value


def from_env(env: dict[str, str] | os._Environ = os.environ) -> Settings:
    """Settings from environment variables (unset ones keep their defaults)."""
    values: dict = {}
    defaults = Settings()
    for field, var in _ENV.items():
        text = env.get(var)
        if text is None or text == "":
            continue
        if field == "transport":
            if text not in ("ipc", "tcp"):
                raise ValueError(f"{var}={text!r}; use 'ipc' (one machine) or 'tcp' (across hosts)")
            values[field] = text
        elif field == "bind_addr":
            values[field] = text
        elif field in ("spin", "worker_spin", "bundle_wait"):
            values[field] = _number(var, text, float, 0) / 1e6
        elif field in _SWITCHES:
            if text.strip().lower() not in ("0", "1", "false", "true", "no", "yes"):
                raise ValueError(f"{var}={text!r}; use 1 ({_SWITCHES[field]}) or 0")
            values[field] = text.strip().lower() in ("1", "true", "yes")
        elif field == "send_hwm":
            values[field] = _number(var, text, int, 1)
        elif field in ("bundle_above", "rack_above"):
            values[field] = _number(var, text, int, 0)
        elif field == "rack_size":
            values[field] = _number(var, text, int, 2)
        elif field == "heartbeat_timeout":
            values[field] = _number(var, text, float, 1)
        elif field == "worker_nice":
            try:
                nice = int(text)
            except ValueError:
                nice = -1
            if not 0 <= nice <= 19:
                raise ValueError(f"{var}={text!r}; give an integer from 0 (the controller's priority) to 19")
            values[field] = nice
        else:
            values[field] = _number(var, text, float, 0 if field != "spawn_timeout" else 1)
    return Settings(**{**defaults.__dict__, **values})


@functools.cache
def settings() -> Settings:
    """This process's settings (read from the environment on first use)."""
    return from_env()


def jobs_dir() -> Path:
    """[MONARCH_JOBS_DIR] Where Slurm jobs' directories are made and found (default ``~/.monarch/jobs``); it
    must be on a disk the job's hosts share, at the same path."""
    return Path(os.environ.get("MONARCH_JOBS_DIR") or Path.home() / ".monarch" / "jobs")


def sim_profiles_dir() -> Path:
    """[MONARCH_SIM_PROFILES] Where `Simulator.calibrate()` saves this machine's profile and where
    ``device="<hostname>"`` finds it (default ``~/.cache/monarch/sim``)."""
    return Path(os.environ.get("MONARCH_SIM_PROFILES") or Path.home() / ".cache" / "monarch" / "sim")


def output_dir() -> Path:
    """[MONARCH_OUTPUT_DIR] Where a ``%%mesh`` cell's full output goes when a rank wrote more than its saved
    view keeps (default ``~/.monarch/output``): a folder per cell, a file per rank."""
    return Path(os.environ.get("MONARCH_OUTPUT_DIR") or Path.home() / ".monarch" / "output")


def rdma_path() -> str:
    """[MONARCH_RDMA_PATH] How `RDMABuffer` reads and writes reach a buffer of another process: ``auto`` (the
    default: shared memory, or CUDA IPC, on one host; the owner's transport otherwise) or ``transport`` (the
    owner's transport wherever it has one: to measure or test it on one machine)."""
    text = os.environ.get("MONARCH_RDMA_PATH", "").strip().lower() or "auto"
    if text not in ("auto", "transport"):
        raise ValueError(
            f"MONARCH_RDMA_PATH={os.environ['MONARCH_RDMA_PATH']!r}; use 'auto' (shared memory on one host) or "
            "'transport' (always through the owner process)"
        )
    return text


def log_level_name() -> str:
    """[MONARCH_LOG] The runtime's log level as given (``debug``, ``info`` or ``warning``; "" when unset);
    `common/log.py` checks it."""
    return os.environ.get("MONARCH_LOG", "").strip().lower()


def use_transport(kind: str) -> None:
    """Make this process's controller use transport `kind` (``ipc`` or ``tcp``), as ``MONARCH_TRANSPORT`` would:
    Monarch's `enable_transport`. Only before the controller reads its settings (its first mesh)."""
    if kind not in ("ipc", "tcp"):
        raise ValueError(f"transport {kind!r}; use 'ipc' (one machine) or 'tcp' (across hosts)")
    os.environ["MONARCH_TRANSPORT"] = kind
    settings.cache_clear()
