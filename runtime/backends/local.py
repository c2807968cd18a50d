"""The local backend: workers forked on this machine (`procs.WorkerProcs`), over the controller's own
transport (IPC sockets in a private directory, or TCP with CURVE) and its rendezvous store.

The transport and the store are the controller's: a `HostsBackend` for a job's host agents connects the
same sockets to the agents, so replies of every mesh arrive in one place. Workers announce themselves up
the command socket (`Ready`, behind their subscriptions); this backend reads that socket for every backend
(`expect_startup`).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.backends.base import Backend, LostCallback
from monarch.runtime.common import context, groups, limits, log
from monarch.runtime.common.config import Settings
from monarch.runtime.common.errors import exit_cause
from monarch.runtime.common.processes import batches, usable_cores, usable_cpus
from monarch.runtime.common.processes import proc_state as _proc_state
from monarch.runtime.common.shape import Shape
from monarch.runtime.procs.workers import (
    WorkerProcs,
    clean_stale_dirs,
    fork_server,
    fork_server_pid,
    private_dir,
    torch_server_started,
)
from monarch.runtime.wire import protocol
from monarch.runtime.wire.controller_end import ControllerTransport, PeerStalled
from monarch.runtime.wire.protocol import Control
from monarch.runtime.wire.store import StoreServer

_log = log.get("backend")
GOODBYE_WAIT = 5.0
"""Seconds to wait, after a worker exited when asked, for its last messages to be received."""


@dataclass
class _Mesh:
    shape: Shape
    labels: list[str]
    ready: dict[int, dict] = field(default_factory=dict)
    start_error: tuple[int, str] | None = None


def spins(workers: int, cores: int) -> bool:
    """Whether local workers poll for their next command (`Settings.worker_spin`): only where each of them and
    the controller have a core of their own. A poller on a hyperthread of the controller's core slows it
    (16 CPUs in 8 pairs, 8 workers polling: a no-op call read faster in some runs and slower in others); on
    16 cores, 8 polling workers made it 114 µs against 122-156 sleeping (`benchmarks/RESULTS.md`)."""
    return workers + 1 <= cores


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
        self._startup: dict[int, Callable[[Any], None]] = {}
        """Mesh id -> who takes its workers' start-up messages (another backend's meshes too)."""
        self.procs = WorkerProcs(settings, self.dir, on_lost, self.transport.cmd_fd, self._read_startup)
        self.transport.on_startup = self._take_startup

    # -- start-up messages, for every backend -------------------------------------------------------------
    def expect_startup(self, mesh_id: int, take: Callable[[Any], None] | None) -> None:
        """Route the start-up messages (`Ready`, `StartFailed`) of mesh `mesh_id` to `take` (monitor
        thread) while it starts; None: that mesh is done starting."""
        with self.procs.changed:
            if take is None:
                if self._startup.pop(mesh_id, None) is not None:
                    self.procs.starting -= 1
            else:
                self._startup[mesh_id] = take
                self.procs.starting += 1

    def _read_startup(self) -> None:
        got = self.transport.read_cmd()
        if got:
            self._take_startup(*got)

    def _take_startup(self, *got: Any) -> None:
        """Hand start-up messages to whoever starts their mesh (up the command socket: the monitor thread;
        over a lane: the receiving thread)."""
        with self.procs.changed:
            for env in got:
                take = self._startup.get(env.mesh_id)
                if take is not None:
                    take(env)
            self.procs.changed.notify_all()

    # -- starting ------------------------------------------------------------------------------------
    def start(
        self, mesh_id: int, shape: Shape, labels: list[str], progress: Callable[[int], None] | None = None
    ) -> list[dict]:
        n = len(shape)
        limits.check(f"a mesh of {n:,} workers {shape.describe()}", workers=n)
        # Workers set torch up at start where the program uses torch (it imported it, made live functions, or
        # runs cells: IPython, a kernel, whose fork server imports torch as it starts); a program of actors
        # only answers sooner without it (torch is set up on the first message that needs it).
        torch = "torch" in sys.modules or context.live_functions or "IPython" in sys.modules or torch_server_started()
        fork_server(torch)  # starts it: it imports torch (if it does) while we carry on
        keys = self.transport.add_mesh(mesh_id, n, lanes=True)
        mesh = _Mesh(shape, labels)
        self.meshes[mesh_id] = mesh
        path = self.procs.add(mesh_id, n, n)
        self.expect_startup(mesh_id, lambda env: take_startup(mesh, env))
        env = dict(os.environ)
        threads = int(env.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // n))
        spin = self.settings.worker_spin if spins(n, usable_cores()) else 0.0
        ok = False
        try:
            for coords, rank in shape.points():
                wenv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
                cfg = protocol.WorkerStart(
                    keys[rank], coords, shape.size_dict, rank, labels[rank], path, wenv, os.getcwd(), list(sys.path),
                    threads, fork_server_pid(torch), os.getpid(), self.settings.group_timeout,
                    self.settings.worker_nice, spin, batches(n, usable_cpus()), torch,
                )  # fmt: skip
                self.procs.fork(mesh_id, rank, cfg)
            exits = lambda: {r: exit_cause(c) for r, c in self.procs.exited(mesh_id).items()}  # noqa: E731
            await_ready(self.procs.changed, mesh, n, self.settings.spawn_timeout, progress, exits)
            ok = True
        except BaseException:
            self.procs.kill(mesh_id)
            self.procs.wait_exit(mesh_id, 2)
            self._forget(mesh_id)
            raise
        finally:
            self.expect_startup(mesh_id, None)
            self.procs.started(mesh_id, ok)
        return [mesh.ready[r] for r in range(n)]

    # -- messages --------------------------------------------------------------------------------------
    def send(self, mesh_id: int, ranks: tuple[int, ...] | None, message: Any, body: list | None = None) -> None:
        try:
            self.transport.send(mesh_id, ranks, message, body)
        except PeerStalled as e:
            group = self.procs.groups.get(mesh_id)
            if group is None:
                return
            candidates = list(group.procs) if e.ranks is None else e.ranks
            stopped = [r for r in candidates if _proc_state(group.procs[r].pid) == "T"]
            rank = stopped[0] if stopped else min(candidates)
            why = "it is stopped (SIGSTOP or Ctrl-Z)" if stopped else "it is alive but does not read"
            self.on_lost(
                mesh_id,
                rank,
                f"took no commands for {e.seconds:.0f} s while {self.settings.send_hwm} were queued for it "
                f"({why}); it was dropped (MONARCH_SEND_STALL, MONARCH_SEND_HWM)",
            )

    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        self.procs.interrupt(mesh_id, ranks, call_id)

    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: Control) -> None:
        self.procs.control(mesh_id, ranks, call_id, kind)

    def mark_gone(self, mesh_id: int) -> None:
        self.store.set(groups.gone_key(mesh_id), b"1")

    # -- stopping --------------------------------------------------------------------------------------
    def kill(self, mesh_id: int) -> None:
        self.procs.kill(mesh_id)

    def kill_rank(self, mesh_id: int, rank: int) -> None:
        self.procs.kill_rank(mesh_id, rank)

    def stop(self, mesh_id: int, graceful: bool) -> dict[int, int | None]:
        if mesh_id not in self.meshes:
            return {}
        self.procs.stopping(mesh_id)
        if graceful:
            self.send(mesh_id, None, protocol.Exit())
        codes = self.procs.wait_exit(mesh_id, self.settings.exit_grace if graceful else 0)
        if graceful:  # (only workers asked to exit say Goodbye: one that died with status 0 did not)
            drain_output(self.transport, mesh_id, codes)
        self._forget(mesh_id)
        return codes

    def _forget(self, mesh_id: int) -> None:
        self.meshes.pop(mesh_id, None)
        self.transport.remove_mesh(mesh_id)
        self.store.forget_mesh(mesh_id)

    def close(self) -> None:
        self.procs.close()
        self.store.close()
        self.transport.close()
        self.transport.terminate()
        shutil.rmtree(self.dir, ignore_errors=True)


def drain_output(transport: ControllerTransport, mesh_id: int, codes: dict[int, int | None]) -> None:
    """Before a mesh is forgotten (its messages dropped from then on), receive everything its workers that
    exited when asked (status 0) sent, up to their `Goodbye`: the output a worker prints as it exits (its
    last log lines) is never lost."""
    clean = [r for r, code in codes.items() if code == 0]
    missing = transport.await_goodbyes(mesh_id, clean, GOODBYE_WAIT)
    if missing:
        _log.info("mesh %d: ranks %s exited without their last output arriving", mesh_id, missing)


def take_startup(mesh: Any, env: Any) -> None:
    """Note a start-up message in `mesh` (`ready`, `start_error`)."""
    if isinstance(env.message, protocol.Ready):
        mesh.ready[env.rank] = env.message.info
    elif isinstance(env.message, protocol.StartFailed):
        mesh.start_error = (env.rank, env.message.traceback)


def await_ready(
    changed: threading.Condition,
    mesh: Any,
    n: int,
    timeout: float,
    progress: Callable[[int], None] | None,
    exits: Callable[[], dict[int, str]],
) -> None:
    """Wait until `n` workers of `mesh` said `Ready` (`mesh.ready`, `mesh.start_error`, updated under
    `changed`); raise, naming the rank, if one failed to start or exited first (`exits()`: rank -> cause),
    or `TimeoutError` after `timeout` seconds. `progress(ready)` meanwhile."""
    what = f"spawning mesh {mesh.shape.describe()}"
    deadline = time.monotonic() + timeout
    while True:
        if progress is not None:
            progress(len(mesh.ready))  # (not under the lock: it may write to a notebook)
        with changed:
            if len(mesh.ready) >= n:
                return
            if mesh.start_error is not None:
                rank, tb = mesh.start_error
                raise RuntimeError(f"{what}: rank {rank} ({mesh.labels[rank]}) failed to start:\n{tb}")
            exited = exits()
            if exited:
                rank, cause = next(iter(exited.items()))
                raise RuntimeError(f"{what}: rank {rank} ({mesh.labels[rank]}) {cause} before it was ready")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(n)) - set(mesh.ready))
                raise TimeoutError(
                    f"{what}: ranks {missing} not ready after {timeout:.0f} s (MONARCH_SPAWN_TIMEOUT sets the limit)"
                )
            changed.wait(min(left, 0.05))
