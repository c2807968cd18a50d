"""A worker process's entry point. Light to import: the local backend names it as the process target."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from monarch.runtime.common import last_words

PR_SET_PDEATHSIG = 1


def run(cfg: Any) -> None:
    """Start serving as the worker `cfg` (a `protocol.WorkerStart`) describes."""
    from monarch.runtime.worker.control import block_signal

    block_signal()  # before any thread starts: only the control thread takes the controller's signal
    last_words.enable(os.path.dirname(cfg.interrupt_path), cfg.keys.mesh_id, cfg.keys.rank)
    _die_with_parent(cfg.parent_pid)
    _exit_with_controller(cfg.controller_pid)
    os.setsid()  # terminal Ctrl-C goes to the controller, which forwards interrupts
    yield_to_controller(cfg.nice)
    name_process(f"monarch worker {cfg.label} mesh {cfg.keys.mesh_id}", f"monarch {cfg.label}")
    os.environ.update(cfg.env)
    from monarch.runtime.common import log

    log.configure(f"worker {cfg.label}", worker=True)  # (MONARCH_LOG came with the controller's environment)
    os.chdir(cfg.cwd)
    sys.path[:] = cfg.sys_path
    from monarch.runtime.worker.worker import Worker

    Worker(cfg).run()


def yield_to_controller(nice: int) -> None:
    """Run `nice` steps below the controller's CPU priority, so that on a machine with fewer free cores than
    workers the controller, which issues their work, is not made to wait for a core by the workers it feeds.

    Both ways Linux shares CPUs: this thread's nice value (threads it starts inherit it), and, as `setsid`
    made this process a session of its own, its session's autogroup (with autogroups on, Linux shares CPUs
    between sessions first: 8 workers would be 8 sessions against the controller's one). Raising either is
    allowed to any user; where one is not there (no autogroups) it is skipped.
    """
    if nice <= 0:
        return
    try:
        os.nice(nice)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def name_process(title: str, short: str) -> None:
    """How `ps` and `top -c` show this process (`title`), and plain `top` (`short`, at most 15 bytes)."""
    try:
        import setproctitle
    except ImportError:  # a dependency; without it the process keeps multiprocessing's command line
        return
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(short[:15])


def _die_with_parent(parent: int | None) -> None:
    # multiprocessing hands every forked child the fork server's "alive" pipe, which keeps the fork
    # server up while any child lives. Drop it: the fork server must exit with the controller, and
    # we with the fork server.
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        forkserver._forkserver._forkserver_alive_fd = None
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the fork server (and so the controller) died before we could watch it


def _exit_with_controller(pid: int) -> None:
    """Exit the moment the controller process is gone (even killed with SIGKILL, even while this
    worker is busy in C code): a thread waits on a pidfd of the controller."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look every 0.2 s
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="monarch-controller-watch", daemon=True).start()
