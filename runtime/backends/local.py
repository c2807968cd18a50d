"""The local backend: workers forked on this machine from a fork server that has imported torch.

A second mesh starts in a fraction of a second because the fork server (the standard library's
`multiprocessing` forkserver, preloading the worker module) has torch imported already. A monitor
thread watches each worker's process sentinel (a dead worker is noticed at once, not by heartbeat),
reads start-up messages, and checks every half second that no worker is frozen (stopped by SIGSTOP).
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

from monarch.runtime import groups, protocol, wire
from monarch.runtime.backends.base import Backend, LostCallback
from monarch.runtime.backends.store import StoreServer
from monarch.runtime.backends.transport import ControllerTransport, PeerStalled
from monarch.runtime.config import Settings
from monarch.runtime.errors import exit_cause
from monarch.runtime.shape import Shape

LIVENESS_INTERVAL = 0.5
"""Seconds between checks that no worker is stopped (one read of /proc per worker)."""
_OWNER = "owner"
"""File in each of our temporary directories: the pid and start time of the process that made it."""


@dataclass
class _Mesh:
    shape: Shape
    labels: list[str]
    interrupt_path: str
    targets: mmap.mmap
    procs: list[Any] = field(default_factory=list)
    ready: dict[int, dict] = field(default_factory=dict)
    start_error: tuple[int, str] | None = None
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    all_exited: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    """Set once started, cleared when stopping: only then is an exit a lost worker."""
    stopped_since: dict[int, float] = field(default_factory=dict)
    control_seq: int = 0


class LocalBackend(Backend):
    """Workers on this machine, over IPC sockets in a private directory (or TCP with CURVE)."""

    def __init__(self, settings: Settings, on_lost: LostCallback) -> None:
        clean_stale_dirs()
        self.settings = settings
        self.on_lost = on_lost
        self.dir = private_dir("monarch-")
        self.transport = ControllerTransport(settings, self.dir)
        self.replies = self.transport
        self.store = StoreServer(self.transport)
        self.meshes: dict[int, _Mesh] = {}
        self._sentinels: dict[int, tuple[int, int]] = {}
        """Process sentinel fd -> (mesh id, rank)."""
        self._changed = threading.Condition()
        self._starting = 0
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._monitor = threading.Thread(target=self._watch, name="monarch-monitor", daemon=True)
        self._monitor.start()

    # -- starting ------------------------------------------------------------------------------------
    def start(
        self, mesh_id: int, shape: Shape, labels: list[str], progress: Callable[[int], None] | None = None
    ) -> list[dict]:
        n = len(shape)
        process_cls = _forkserver()  # starts it: it imports torch while we carry on
        fs_pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        keys = self.transport.add_mesh(mesh_id, n)
        path = os.path.join(self.dir, f"interrupt-{mesh_id}")
        mesh = _Mesh(shape, labels, path, _shared_slots(path, n))
        env = dict(os.environ)
        threads = int(env.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // n))
        with self._changed:
            self.meshes[mesh_id] = mesh
            self._starting += 1
        try:
            for coords, rank in shape.points():
                wenv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
                cfg = protocol.WorkerStart(
                    keys[rank], coords, shape.size_dict, rank, labels[rank], path, wenv, os.getcwd(), list(sys.path),
                    threads, fs_pid, os.getpid(), self.settings.group_timeout,
                )  # fmt: skip
                # the worker's entry point, named (controller-side code never imports worker code)
                entry = ("monarch.runtime.worker.main", "run", cfg)
                p = process_cls(target=wire.call_function, args=entry, name=f"monarch-{mesh_id}-{rank}")
                p.start()
                multiprocessing.process._children.discard(p)  # we reap it, via its sentinel
                with self._changed:
                    mesh.procs.append(p)
                    self._sentinels[p.sentinel] = (mesh_id, rank)
                self._wake()
            self._await_ready(mesh, progress)
        except BaseException:
            self._kill(mesh)
            mesh.all_exited.wait(2)
            self._forget(mesh_id)
            raise
        finally:
            with self._changed:
                self._starting -= 1
        mesh.running = True
        return [mesh.ready[r] for r in range(n)]

    def _await_ready(self, mesh: _Mesh, progress: Callable[[int], None] | None) -> None:
        n = len(mesh.shape)
        what = f"spawning mesh {mesh.shape.describe()}"
        deadline = time.monotonic() + self.settings.spawn_timeout
        while True:
            if progress is not None:
                progress(len(mesh.ready))  # (not under the lock: it may write to a notebook)
            with self._changed:
                if len(mesh.ready) >= n:
                    return
                if mesh.start_error is not None:
                    rank, tb = mesh.start_error
                    raise RuntimeError(f"{what}: rank {rank} ({mesh.labels[rank]}) failed to start:\n{tb}")
                if mesh.exitcodes:
                    rank, code = next(iter(mesh.exitcodes.items()))
                    raise RuntimeError(
                        f"{what}: rank {rank} ({mesh.labels[rank]}) {exit_cause(code)} before it was ready"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(n)) - set(mesh.ready))
                    raise TimeoutError(
                        f"{what}: ranks {missing} not ready after {self.settings.spawn_timeout:.0f} s "
                        "(MONARCH_SPAWN_TIMEOUT sets the limit)"
                    )
                self._changed.wait(min(left, 0.05))

    # -- messages --------------------------------------------------------------------------------------
    def send(self, mesh_id: int, ranks: tuple[int, ...] | None, message: Any, body: list | None = None) -> None:
        try:
            self.transport.send(mesh_id, ranks, message, body)
        except PeerStalled as e:
            mesh = self.meshes.get(mesh_id)
            if mesh is None:
                return
            candidates = range(len(mesh.procs)) if e.ranks is None else e.ranks
            stopped = [r for r in candidates if _proc_state(mesh.procs[r].pid) == "T"]
            rank = stopped[0] if stopped else min(candidates)
            why = "it is stopped (SIGSTOP or Ctrl-Z)" if stopped else "it is alive but does not read"
            self.on_lost(
                mesh_id,
                rank,
                f"took no commands for {e.seconds:.0f} s while {self.settings.send_hwm} were queued for it "
                f"({why}); it was dropped (MONARCH_SEND_STALL, MONARCH_SEND_HWM)",
            )

    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return
        for r in ranks:
            try:
                struct.pack_into("<q", mesh.targets, protocol.SLOT * r, call_id)
                os.kill(mesh.procs[r].pid, signal.SIGINT)
            except (ProcessLookupError, IndexError, ValueError):
                pass

    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: int) -> None:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return
        with self._changed:
            mesh.control_seq += 1
            seq = mesh.control_seq
        for r in ranks:
            try:
                struct.pack_into("<qqq", mesh.targets, protocol.SLOT * r + 8, seq, call_id, kind)
                os.kill(mesh.procs[r].pid, signal.SIGUSR1)
            except (ProcessLookupError, IndexError, ValueError):
                pass

    def mark_gone(self, mesh_id: int) -> None:
        self.store.set(groups.gone_key(mesh_id), b"1")

    # -- stopping --------------------------------------------------------------------------------------
    def kill(self, mesh_id: int) -> None:
        mesh = self.meshes.get(mesh_id)
        if mesh is not None:
            mesh.running = False
            self._kill(mesh)

    def _kill(self, mesh: _Mesh) -> None:
        for p in mesh.procs:
            if p.pid is not None and p._popen.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)

    def stop(self, mesh_id: int, graceful: bool) -> dict[int, int | None]:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return {}
        mesh.running = False
        if graceful:
            self.send(mesh_id, None, protocol.Exit())
        if not mesh.all_exited.wait(self.settings.exit_grace if graceful else 0):
            self._kill(mesh)
            mesh.all_exited.wait(2)
        self._forget(mesh_id)
        return dict(mesh.exitcodes)

    def _forget(self, mesh_id: int) -> None:
        with self._changed:
            mesh = self.meshes.pop(mesh_id, None)
            for fd, (m, _) in list(self._sentinels.items()):
                if m == mesh_id:
                    del self._sentinels[fd]
        self.transport.remove_mesh(mesh_id)
        if mesh is not None:
            with contextlib.suppress(OSError):
                os.unlink(mesh.interrupt_path)  # workers (if any are left) keep their mapping
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._monitor.join(2)
        self.store.close()
        self.transport.close()
        self.transport.terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the monitor thread ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(self.transport.cmd_fd, select.POLLIN)
        watched: set[int] = set()
        next_check = time.monotonic() + LIVENESS_INTERVAL
        while not self._closed:
            try:
                with self._changed:
                    sentinels = dict(self._sentinels)
                    starting = self._starting
                for fd in set(sentinels) - watched:
                    poller.register(fd, select.POLLIN)
                    watched.add(fd)
                for fd in watched - set(sentinels):
                    poller.unregister(fd)
                    watched.discard(fd)
                # The command socket's fd is edge-triggered and any send may consume its edge: while a
                # mesh starts, look at the socket every few ms whatever the fd says.
                events = poller.poll(5 if starting else LIVENESS_INTERVAL * 1000)
                if self._closed:
                    return
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                self._read_startup()
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

    def _read_startup(self) -> None:
        got = self.transport.read_cmd()
        if not got:
            return
        with self._changed:
            for env in got:
                mesh = self.meshes.get(env.mesh_id)
                if mesh is None:
                    continue
                if isinstance(env.message, protocol.Ready):
                    mesh.ready[env.rank] = env.message.info
                elif isinstance(env.message, protocol.StartFailed):
                    mesh.start_error = (env.rank, env.message.traceback)
            self._changed.notify_all()

    def _exited(self, mesh_id: int, rank: int) -> None:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return
        code = mesh.procs[rank]._popen.poll()
        with self._changed:
            mesh.exitcodes[rank] = code
            if len(mesh.exitcodes) == len(mesh.procs):
                mesh.all_exited.set()
            self._changed.notify_all()
        if mesh.running:
            mesh.running = False
            self.on_lost(mesh_id, rank, exit_cause(code))

    def _check_frozen(self) -> None:
        now = time.monotonic()
        for mesh_id, mesh in list(self.meshes.items()):
            if not mesh.running:
                continue
            for rank, p in enumerate(mesh.procs):
                if _proc_state(p.pid) != "T":
                    mesh.stopped_since.pop(rank, None)
                    continue
                since = mesh.stopped_since.setdefault(rank, now)
                if now - since >= self.settings.frozen_after and mesh.running:
                    mesh.running = False
                    self.on_lost(
                        mesh_id,
                        rank,
                        f"is frozen: stopped (SIGSTOP or Ctrl-Z, process state T) for {now - since:.1f} s",
                    )
                    break


def _proc_state(pid: int | None) -> str | None:
    """The state letter of process `pid` (R, S, D, T, Z, ...), or None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _shared_slots(path: str, n: int) -> mmap.mmap:
    """One record of `protocol.SLOT` bytes per rank in a file the workers map too (zeros to start)."""
    with open(path, "wb") as f:
        f.truncate(protocol.SLOT * n)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, protocol.SLOT * n)
    finally:
        os.close(fd)


# -- private directories, and those of controllers that were killed -------------------------------------
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


def _forkserver():
    """Start the fork server (once per process), its address in a directory of ours."""
    global _mp_dir
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is None:  # else the program set multiprocessing up itself: its directory
        _mp_dir = config["tempdir"] = private_dir("monarch-mp-")
        atexit.register(shutil.rmtree, _mp_dir, True)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["monarch.runtime.worker.preload"])
    multiprocessing.forkserver.ensure_running()
    return _WorkerProcess


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


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


_get_preparation_data = multiprocessing.spawn.get_preparation_data
_prep_lock = threading.Lock()
