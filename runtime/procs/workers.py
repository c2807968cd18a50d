"""Worker processes on this machine: forked from a fork server that has imported torch, watched, signalled,
stopped. Used by the local backend (this machine's meshes) and by the host agent (its host's share of a
job's meshes).

A second mesh starts in a fraction of a second because the fork server (the standard library's
`multiprocessing` forkserver, preloading the worker module) has torch imported already. A program that has not
imported torch (actors only, as Monarch's examples) gets its workers from a second fork server that has not
either: they answer at once, and import torch only when something needs it (`WorkerStart.torch`). A monitor thread
watches each worker's process sentinel (a dead worker is noticed at once, not by heartbeat) and checks
every half second that no worker is frozen (stopped by SIGSTOP). Interrupts and control requests reach a
worker through its record in a shared file of slots, then a signal.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.spawn
import os
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.common import last_words
from monarch.runtime.common.errors import cell_frame, exit_cause
from monarch.runtime.common.processes import proc_state
from monarch.runtime.wire import codec, protocol

LIVENESS_INTERVAL = 0.5
"""Seconds between checks that no worker is stopped (one read of /proc per worker)."""
_OWNER = "owner"
"""File in each of our temporary directories: the pid and start time of the process that made it."""
ENTRY = ("monarch.runtime.worker.main", "run")
"""A worker's entry point, named (code that starts workers never imports worker code)."""


@dataclass
class _Group:
    """One mesh's workers on this machine."""

    path: str
    targets: mmap.mmap
    procs: dict[int, Any] = field(default_factory=dict)
    """Global rank -> its process."""
    expected: int = 0
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    all_exited: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    """Set once started, cleared when stopping: only then is an exit a lost worker."""
    lost: set[int] = field(default_factory=set)
    """Ranks reported lost. Each is reported once, and the others are still watched: whether a mesh goes on
    without a rank (one with actors) or is stopped (SPMD code) is the controller's decision."""
    stopped_since: dict[int, float] = field(default_factory=dict)
    control_seq: int = 0


class WorkerProcs:
    """This machine's worker processes, by mesh. `on_lost(mesh_id, rank, cause)` is called (monitor thread)
    when a worker of a running mesh exits or stays frozen, once per worker (the others are still watched);
    `poll_fd` (with `on_poll`) is one more descriptor the monitor thread watches for its owner: looked at
    every few ms while a mesh starts."""

    def __init__(
        self,
        settings: Any,
        directory: str,
        on_lost: Callable[[int, int, str], None],
        poll_fd: int | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.dir = directory
        self.on_lost = on_lost
        self.groups: dict[int, _Group] = {}
        self.changed = threading.Condition()
        """Notified when a worker exits (and by the owner, for its own start-up news)."""
        self._sentinels: dict[int, tuple[int, int]] = {}
        """Process sentinel fd -> (mesh id, rank)."""
        self._poll_fd, self._on_poll = poll_fd, on_poll
        self.starting = 0
        """Meshes being started (the monitor looks at `poll_fd` every few ms meanwhile)."""
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._monitor = threading.Thread(target=self._watch, name="monarch-monitor", daemon=True)
        self._monitor.start()

    # -- starting ------------------------------------------------------------------------------------
    def add(self, mesh_id: int, size: int, expected: int) -> str:
        """A group for `expected` workers of a mesh of `size`; returns its slot file's path."""
        path = os.path.join(self.dir, f"interrupt-{mesh_id}")
        with self.changed:
            self.groups[mesh_id] = _Group(path, _shared_slots(path, size), expected=expected)
            self.starting += 1
        self._wake()
        return path

    def fork(self, mesh_id: int, rank: int, cfg: Any) -> int:
        """Start the worker `cfg` (a `protocol.WorkerStart`) describes; returns its pid."""
        process_cls = fork_server(cfg.torch)
        p = process_cls(target=codec.call_function, args=(*ENTRY, cfg), name=f"monarch-{mesh_id}-{rank}")
        p.start()
        multiprocessing.process._children.discard(p)  # we reap it, via its sentinel
        with self.changed:
            self.groups[mesh_id].procs[rank] = p
            self._sentinels[p.sentinel] = (mesh_id, rank)
        self._wake()
        return p.pid

    def started(self, mesh_id: int, ok: bool) -> None:
        """The owner is done starting the group (its workers are ready, or it gave up)."""
        with self.changed:
            self.starting -= 1
            group = self.groups.get(mesh_id)
            if ok and group is not None:
                group.running = True

    def exited(self, mesh_id: int) -> dict[int, int | None]:
        """Exit statuses of the group's workers that are gone (so far)."""
        group = self.groups.get(mesh_id)
        return dict(group.exitcodes) if group is not None else {}

    # -- signals -------------------------------------------------------------------------------------
    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        group = self.groups.get(mesh_id)
        if group is None:
            return
        for r in ranks:
            p = group.procs.get(r)
            if p is None:
                continue
            try:
                struct.pack_into("<q", group.targets, protocol.SLOT * r, call_id)
                os.kill(p.pid, signal.SIGINT)
            except (ProcessLookupError, ValueError):
                pass

    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: int) -> None:
        group = self.groups.get(mesh_id)
        if group is None:
            return
        with self.changed:
            group.control_seq += 1
            seq = group.control_seq
        # Every request is written before any rank is woken: a rank released first shuts connections its
        # peers' collectives then fail on, and each peer must find its own request already there.
        asked = [(r, p) for r in ranks if (p := group.procs.get(r)) is not None]
        for r, _ in asked:
            struct.pack_into("<qqq", group.targets, protocol.SLOT * r + 8, seq, call_id, kind)
        for _, p in asked:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except (ProcessLookupError, ValueError):
                pass

    # -- stopping ------------------------------------------------------------------------------------
    def stopping(self, mesh_id: int) -> None:
        """From now on an exit is expected (not a lost worker)."""
        group = self.groups.get(mesh_id)
        if group is not None:
            group.running = False

    def kill(self, mesh_id: int) -> None:
        group = self.groups.get(mesh_id)
        if group is None:
            return
        group.running = False
        for p in list(group.procs.values()):
            if p.pid is not None and p._popen.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)

    def kill_rank(self, mesh_id: int, rank: int) -> None:
        """Kill one worker of the group now (the rest go on); does not wait."""
        group = self.groups.get(mesh_id)
        p = group.procs.get(rank) if group is not None else None
        if p is not None and p.pid is not None and p._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)

    def wait_exit(self, mesh_id: int, grace: float) -> dict[int, int | None]:
        """Wait up to `grace` seconds for every worker of the group to exit, kill those left, forget the
        group; returns the exit statuses."""
        group = self.groups.get(mesh_id)
        if group is None:
            return {}
        group.running = False
        if not group.all_exited.wait(grace):
            self.kill(mesh_id)
            group.all_exited.wait(2)
        self.forget(mesh_id)
        return dict(group.exitcodes)

    def forget(self, mesh_id: int) -> None:
        with self.changed:
            group = self.groups.pop(mesh_id, None)
            for fd, (m, _) in list(self._sentinels.items()):
                if m == mesh_id:
                    del self._sentinels[fd]
        if group is not None:
            with contextlib.suppress(OSError):
                os.unlink(group.path)  # workers (if any are left) keep their mapping
            last_words.forget(self.dir, mesh_id, list(group.procs))
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._monitor.join(2)

    # -- the monitor thread ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._poll_fd is not None:
            poller.register(self._poll_fd, select.POLLIN)
        watched: set[int] = set()
        next_check = time.monotonic() + LIVENESS_INTERVAL
        while not self._closed:
            try:
                with self.changed:
                    sentinels = dict(self._sentinels)
                    starting = self.starting
                for fd in set(sentinels) - watched:
                    poller.register(fd, select.POLLIN)
                    watched.add(fd)
                for fd in watched - set(sentinels):
                    poller.unregister(fd)
                    watched.discard(fd)
                # The owner's fd may be edge-triggered (a ZeroMQ socket's) and any send may consume its
                # edge: while a mesh starts, look every few ms whatever the fd says.
                events = poller.poll(5 if starting else LIVENESS_INTERVAL * 1000)
                if self._closed:
                    return
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                if self._on_poll is not None:
                    self._on_poll()
                for fd, _ in events:
                    if fd in sentinels and fd in watched:
                        poller.unregister(fd)
                        watched.discard(fd)
                        self._exited(*sentinels[fd])
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + LIVENESS_INTERVAL
                    self._check_frozen()
            except Exception:
                if self._closed:
                    return
                print("monarch: internal error in the monitor thread:", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)

    def _exited(self, mesh_id: int, rank: int) -> None:
        group = self.groups.get(mesh_id)
        if group is None:
            return
        code = group.procs[rank]._popen.poll()
        with self.changed:
            group.exitcodes[rank] = code
            if len(group.exitcodes) >= group.expected:
                group.all_exited.set()
            self.changed.notify_all()
        if group.running and rank not in group.lost:
            group.lost.add(rank)
            said = last_words.read(self.dir, mesh_id, rank, cell_frame) if code is not None and code < 0 else ""
            self.on_lost(mesh_id, rank, exit_cause(code) + said)

    def _check_frozen(self) -> None:
        now = time.monotonic()
        for mesh_id, group in list(self.groups.items()):
            if not group.running:
                continue
            for rank, p in list(group.procs.items()):
                if rank in group.lost or proc_state(p.pid) != "T":
                    group.stopped_since.pop(rank, None)
                    continue
                since = group.stopped_since.setdefault(rank, now)
                if now - since >= self.settings.frozen_after and group.running:
                    group.lost.add(rank)
                    self.on_lost(
                        mesh_id,
                        rank,
                        f"is frozen: stopped (SIGSTOP or Ctrl-Z, process state T) for {now - since:.1f} s",
                    )


def _shared_slots(path: str, n: int) -> mmap.mmap:
    """One record of `protocol.SLOT` bytes per rank in a file the workers map too (zeros to start)."""
    with open(path, "wb") as f:
        f.truncate(protocol.SLOT * n)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, protocol.SLOT * n)
    finally:
        os.close(fd)


# -- private directories, and those of processes that were killed ---------------------------------------
def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def private_dir(prefix: str) -> str:
    """A new directory only this user can open (mode 0700), marked with its owner process."""
    path = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(path, _OWNER), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return path


def clean_stale_dirs(root: str | None = None) -> list[str]:
    """Remove our directories (sockets, fork server address) left by processes that are gone (a
    controller killed with SIGKILL cleans nothing); returns what was removed. Only directories of this
    user with an owner file naming a process that no longer runs are ours to remove."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("monarch-"):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as f:
                pid_text, start = f.read().split()
            if _start_time(int(pid_text)) == start:
                continue  # its owner still runs
        except (OSError, ValueError):  # no owner file: not ours (or being made right now)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# -- the fork server ------------------------------------------------------------------------------------
_mp_dir: str | None = None


_light: multiprocessing.forkserver.ForkServer | None = None
"""The fork server without torch (started on first use)."""


def fork_server(torch: bool = True) -> type[_WorkerProcess]:
    """Start the fork server (once per process), its address in a directory of ours; returns the process
    class that forks from it. It imports torch while the caller carries on. With `torch` False: the one that
    does not import torch (`preload_light`)."""
    global _mp_dir, _light
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is None:  # else the program set multiprocessing up itself: its directory
        _mp_dir = config["tempdir"] = private_dir("monarch-mp-")
        atexit.register(shutil.rmtree, _mp_dir, True)
    if not torch:
        with _prep_lock:
            if _light is None:
                _light = multiprocessing.forkserver.ForkServer()
                _light.set_forkserver_preload(["monarch.runtime.worker.preload_light", *_for_cells()])
            _light.ensure_running()
        return _LightWorkerProcess
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["monarch.runtime.worker.preload", *_for_cells()])
    multiprocessing.forkserver.ensure_running()
    return _WorkerProcess


def torch_server_started() -> bool:
    """Whether the fork server that imports torch was started (a kernel starts it as it starts)."""
    return fork_server_pid() is not None


def _for_cells() -> list[str]:
    """What a `%%mesh` cell imports on a worker (IPython's display, ~0.25 s each, 8 workers at once on the
    first cell): imported once by the fork server instead, when the controller runs in IPython (a kernel,
    where cells run). A script's fork server does without (a name that fails to import is skipped)."""
    return ["IPython.display", "IPython.core.display_functions"] if "IPython" in sys.modules else []


def warm_fork_server() -> int:
    """Start the fork server and wait until it has imported torch (by forking one process that counts
    the GPUs): for a process that says it is ready only when a mesh can start at once (a host agent).
    Returns the number of GPUs its workers see, so that the caller need not import torch itself."""
    p = fork_server()(target=_count_gpus, name="monarch-warm-up")
    p.start()
    p.join()
    return max(p.exitcode or 0, 0)


def _count_gpus() -> None:
    import torch

    sys.exit(min(torch.cuda.device_count(), 255) if torch.cuda.is_available() else 0)  # (as the exit code)


def fork_server_pid(torch: bool = True) -> int | None:
    server = multiprocessing.forkserver._forkserver if torch else _light
    return getattr(server, "_forkserver_pid", None)


def _prep_without_main(name):
    data = _get_preparation_data(name)
    data.pop("init_main_from_path", None)
    data.pop("init_main_from_name", None)
    return data


class _Popen(multiprocessing.popen_forkserver.Popen):
    """Forks a worker from the fork server without re-running the user's `__main__` in it.

    multiprocessing would re-import the main script in each child (hence its
    `if __name__ == "__main__"` rule); workers need nothing from it, since live functions
    travel by value.
    """

    def _launch(self, process_obj):
        with _prep_lock:
            multiprocessing.spawn.get_preparation_data = _prep_without_main
            try:
                super()._launch(process_obj)
            finally:
                multiprocessing.spawn.get_preparation_data = _get_preparation_data


class _LightPopen(_Popen):
    """Forks from the fork server without torch."""

    def _launch(self, process_obj):
        assert _light is not None
        with _prep_lock:  # (the standard library's Popen asks the module's server; here, ours)
            multiprocessing.forkserver.connect_to_new_process = _light.connect_to_new_process
            try:
                super()._launch(process_obj)
            finally:
                multiprocessing.forkserver.connect_to_new_process = _connect


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _LightWorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _LightPopen(process_obj)


_get_preparation_data = multiprocessing.spawn.get_preparation_data
_connect = multiprocessing.forkserver.connect_to_new_process
_prep_lock = threading.RLock()
