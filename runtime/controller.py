"""The controller: one per process; owns the sockets, the workers and the calls in flight.

Threads: the user's thread sends commands (pipelined, never waiting for an answer) on an XPUB
socket (one send reaches every worker of a mesh; a worker subscribes to its mesh and its rank); one I/O thread receives replies and output on a PULL socket and watches each worker's
process sentinel, so a dead worker is noticed the moment it exits.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import datetime
import itertools
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

import zmq

from monarch.runtime import groups, wire
from monarch.runtime.errors import WorkerDiedError, exit_cause
from monarch.runtime.shape import Shape
from monarch.runtime.stdin_service import InputRequest, StdinService, _terminal_input

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
SPAWN_TIMEOUT = float(os.environ.get("MONARCH_SPAWN_TIMEOUT", "120"))
EXIT_GRACE = 3.0
"""Seconds a worker gets to exit after `exit()` before it is killed."""
SPIN = float(os.environ.get("MONARCH_SPIN_US", "500")) / 1e6
"""Seconds a caller waiting for replies polls for them (yielding the CPU to any runnable thread) before
it sleeps: waking a sleeping thread costs tens of microseconds, more on a VM whose idle CPU halted
(on a 2-core VM this takes an 8-worker round trip from ~0.53 to ~0.48 ms). 0 turns polling off."""
RX_HANDBACK = 0.01
"""Seconds after a waiting caller returns before the I/O thread receives again (output that
arrives between calls, e.g. from a non-blocking call, is delayed at most this long)."""


@dataclass
class OutputEvent:
    """A chunk of a worker's stdout or stderr."""

    call_id: int | None
    """The call it was written during, or None between calls."""
    mesh_id: int
    rank: int
    label: str
    """The worker's coordinates, e.g. ``"gpu=3"``."""
    stream: str
    """``"stdout"``, ``"stderr"``, or ``"display"`` for a rich display (then `data` holds it)."""
    text: str
    data: dict | None = None
    """A display's mime bundle (``{"text/plain": ..., "image/png": ...}``)."""
    metadata: dict | None = None


class _LineLabeller:
    """Default output sink: write worker output to our stdout/stderr, each line labelled."""

    def __init__(self) -> None:
        self.at_line_start: dict[tuple[int, int, str], bool] = {}

    def break_line(self) -> None:
        """End any half-written line (before a prompt), so the prompt starts on its own line."""
        if not all(self.at_line_start.values()) and sys.stdout is not None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.at_line_start = dict.fromkeys(self.at_line_start, True)

    def __call__(self, ev: OutputEvent) -> None:
        out = sys.stdout if ev.stream != "stderr" else sys.stderr
        if out is None:
            return
        if ev.stream == "display":  # a rich display: its text form
            text = (ev.data or {}).get("text/plain", "")
            ev = OutputEvent(ev.call_id, ev.mesh_id, ev.rank, ev.label, "stdout", text + "\n")
        key = (ev.mesh_id, ev.rank, ev.stream)
        prefix = f"[{ev.label}] "
        parts = []
        start = self.at_line_start.get(key, True)
        for line in ev.text.splitlines(keepends=True):
            parts.append(prefix + line if start else line)
            start = line.endswith("\n")
        self.at_line_start[key] = start
        out.write("".join(parts))
        out.flush()


@dataclass
class SpawnedMesh:
    """The processes of one spawned mesh; every view of it refers to this."""

    controller: Controller
    mesh_id: int
    shape: Shape
    procs: list[Any]
    labels: list[str]
    info: list[dict] = field(default_factory=list)
    ready: dict[int, dict] = field(default_factory=dict)
    """Start-up reports, by rank (filled by the I/O thread)."""
    start_error: tuple[int, str] | None = None
    state: str = "starting"
    """starting, running, failed, stopping or stopped."""
    failure: WorkerDiedError | None = None
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    all_exited: threading.Event = field(default_factory=threading.Event)
    fns: dict[bytes, tuple[int, set[int]]] = field(default_factory=dict)
    """Pickled function -> (function id, ranks that have it)."""
    order_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held from deciding what the workers lack (a function, a group) until the message that brings it
    is sent, so that no message relying on it, from another thread, overtakes it."""
    groups: dict[tuple, int] = field(default_factory=dict)
    """Rank partition -> group id."""
    targets: Any = None
    """Shared with the workers: per rank, the id of the call the next SIGINT is meant for."""

    def check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.state != "running":
            raise RuntimeError(f"mesh {self.shape.describe()} is {self.state}; spawn a new one (mesh.respawn())")


@dataclass
class PendingCall:
    call_id: int
    mesh: SpawnedMesh
    ranks: tuple[int, ...]
    future: concurrent.futures.Future
    replies: dict[int, tuple[str, list]] = field(default_factory=dict)
    no_stdin: str | None = None
    """Why this call cannot be given input (workers asking get an error saying so), or None."""
    output: Callable[[OutputEvent], None] | None = None
    """Where this call's output goes, instead of the controller's `output`."""


class Controller(StdinService):
    """Owns this process's meshes. Get it with `get_controller()`."""

    def __init__(self) -> None:
        self.key = os.urandom(32)
        self.zctx = zmq.Context()
        self.pub = self.zctx.socket(zmq.XPUB)
        self.pull = self.zctx.socket(zmq.PULL)
        for s in (self.pub, self.pull):
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
        self.dir = tempfile.mkdtemp(prefix="monarch-")  # mode 0700: only this user can connect
        transport = os.environ.get("MONARCH_TRANSPORT", "ipc")
        if transport == "ipc":
            self.host = "127.0.0.1"
            self.pub.bind(f"ipc://{self.dir}/cmd")
            self.pull.bind(f"ipc://{self.dir}/reply")
        elif transport == "tcp":
            self.host = os.environ.get("MONARCH_BIND_ADDR", "127.0.0.1")
            self.pub.bind(f"tcp://{self.host}:0")
            self.pull.bind(f"tcp://{self.host}:0")
        else:
            raise ValueError(f"MONARCH_TRANSPORT={transport!r}; use 'ipc' or 'tcp'")
        self.cmd_addr = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.reply_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        # An empty message on the reply socket wakes whoever receives (a call failed from another thread).
        self.pull.bind(f"inproc://monarch-wake-{id(self)}")
        self._waker = self.zctx.socket(zmq.PUSH)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(f"inproc://monarch-wake-{id(self)}")
        self._waker_lock = threading.Lock()
        self.pub_lock = threading.Lock()
        self.spawn_lock = threading.Lock()
        self.meshes: dict[int, SpawnedMesh] = {}
        self.calls: dict[int, PendingCall] = {}
        self.sentinels: dict[int, tuple[SpawnedMesh, int]] = {}
        self.output: Callable[[OutputEvent], None] = _LineLabeller()
        """Where worker output and displays go; the notebook extension routes them per cell."""
        self.stdin: Callable[[InputRequest], str] = _terminal_input
        """Answers workers' input requests; runs on the thread waiting for the call."""
        self.stdin_queue: collections.deque[InputRequest] = collections.deque()
        self._stdin_lock = threading.Lock()  # held by the thread serving a prompt
        self._stdin_owner: tuple[int, int] | None = None
        self._owner_since = 0.0
        self.listeners: list[Callable[[SpawnedMesh], None]] = []
        """Called (on any thread) when a mesh's workers change state: busy, idle, failed, stopped."""
        self._ids = itertools.count(1)
        self._mesh_ids = itertools.count(0)
        self._store = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._rx_lock = threading.RLock()  # held by the one thread that receives (an RLock: see wait())
        self._rx_count_lock = threading.Lock()
        self._rx_waiters = 0  # callers receiving for themselves in wait()
        self._rcvtimeo = -1  # the receive socket's RCVTIMEO (ms), set by waiting callers
        self._main_receiving = False  # the main thread is inside _receive_until (Ctrl-C is held)
        self._sigint_held = False
        self._sigint_handler = self._on_sigint  # one object, so that getsignal() can recognise it
        self._io = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._io.start()
        atexit.register(self.shutdown)

    # -- spawning ----------------------------------------------------------------------------------
    def _store_addr(self) -> tuple[str, int]:
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                self.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
            )
        return self.host, self._store.port

    def spawn(self, sizes: dict[str, int]) -> SpawnedMesh:
        """Start one worker process per point of `sizes` on this host; return when all are ready."""
        shape = Shape.from_sizes(sizes)
        process_cls = _forkserver()  # starts it: it imports torch in parallel with us
        store_addr = self._store_addr()  # imports torch while the fork server does the same
        from monarch.runtime import spawn_entry

        n = len(shape)
        env = dict(os.environ)
        threads = int(env.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // n))
        fs_pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        with self.spawn_lock:
            mesh_id = next(self._mesh_ids)
            labels = [shape.label(c) for c, _ in shape.points()]
            mesh = SpawnedMesh(self, mesh_id, shape, [], labels)
            targets_path = os.path.join(self.dir, f"interrupt-{mesh_id}")
            mesh.targets = _shared_slots(targets_path, n)
            self.meshes[mesh_id] = mesh
            for coords, rank in shape.points():
                wenv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
                cfg = dict(
                    mesh_id=mesh_id, rank=rank, coords=coords, sizes=shape.size_dict, local_rank=rank,
                    cmd_addr=self.cmd_addr, reply_addr=self.reply_addr, key=self.key, store_addr=store_addr,
                    interrupt_path=targets_path, env=wenv, cwd=os.getcwd(), sys_path=list(sys.path), threads=threads, forkserver_pid=fs_pid,
                )  # fmt: skip
                p = process_cls(target=spawn_entry.run, args=(cfg,), name=f"monarch-{mesh_id}-{rank}")
                p.start()
                multiprocessing.process._children.discard(p)  # we reap it, via its sentinel
                mesh.procs.append(p)
            try:
                self._await_ready(mesh)
            except BaseException:
                self._kill(mesh)
                self.meshes.pop(mesh_id, None)
                raise
            mesh.state = "running"
            for rank, p in enumerate(mesh.procs):
                self.sentinels[p.sentinel] = (mesh, rank)
            self._wake()
        self._changed(mesh)
        return mesh

    def _await_ready(self, mesh: SpawnedMesh) -> None:
        """Wait until every worker has reported ready (on the reply socket, read by the I/O thread)
        and subscribed to its commands (seen here, on the command socket)."""
        n = len(mesh.procs)
        subscribed: set[int] = set()
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        by_fd = {p.sentinel: rank for rank, p in enumerate(mesh.procs)}
        for fd in by_fd:
            poller.register(fd, zmq.POLLIN)
        deadline = time.monotonic() + SPAWN_TIMEOUT
        what = f"spawning mesh {mesh.shape.describe()}"
        prefix = b"\x01%d:" % mesh.mesh_id
        while len(subscribed) < n or len(mesh.ready) < n:
            if mesh.start_error:
                rank, tb = mesh.start_error
                raise RuntimeError(f"{what}: rank {rank} ({mesh.labels[rank]}) failed to start:\n{tb}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(n)) - (subscribed & set(mesh.ready)))
                raise TimeoutError(f"{what}: ranks {missing} not ready after {SPAWN_TIMEOUT:.0f} s")
            with self.pub_lock:
                events = dict(poller.poll(min(left, 0.005) * 1000))
                while self.pub in events:
                    try:
                        sub = self.pub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sub.startswith(prefix) and sub.endswith(b"|"):
                        subscribed.add(int(sub[len(prefix) : -1]))
            for fd, rank in by_fd.items():
                if fd in events and rank not in mesh.ready:
                    time.sleep(0.05)  # let the I/O thread deliver its last words, if any
                    if mesh.start_error:
                        break
                    code = mesh.procs[rank]._popen.poll()
                    raise RuntimeError(
                        f"{what}: rank {rank} ({mesh.labels[rank]}) {exit_cause(code)} before it was ready"
                    )
        mesh.info = [mesh.ready[r] for r in range(n)]

    # -- commands ----------------------------------------------------------------------------------
    def send(self, mesh: SpawnedMesh, ranks: tuple[int, ...], frames: list) -> None:
        """Send one signed message to `ranks` of `mesh` without waiting for anything."""
        if len(ranks) == len(mesh.procs):
            topics = [b"%d:*" % mesh.mesh_id]  # everyone: one send
        else:
            topics = [b"%d:%d|" % (mesh.mesh_id, r) for r in ranks]
        pub, rest = self.pub, frames[1:]
        with self.pub_lock:
            if self._closed:  # shutting down (e.g. a late free from the reaper thread): nobody to send to
                return
            for topic in topics:  # the topic prefixes the first frame: one frame for small messages
                if rest:
                    with _no_interrupt_midway():
                        pub.send(topic + frames[0], _SNDMORE)
                        pub.send_multipart(rest, copy=False)
                else:
                    pub.send(topic + frames[0])

    def call(
        self,
        mesh: SpawnedMesh,
        ranks: tuple[int, ...],
        frames_for: Callable[[int], list],
        no_stdin: str | None = None,
        output: Callable[[OutputEvent], None] | None = None,
    ) -> PendingCall:
        """Start a call on `ranks`; its future resolves to `{rank: (kind, body, buffers)}`."""
        mesh.check_usable()
        call_id = next(self._ids)
        pending = PendingCall(call_id, mesh, ranks, concurrent.futures.Future(), no_stdin=no_stdin, output=output)
        self.calls[call_id] = pending
        if mesh.failure is not None:  # died between the check and the registration
            self._fail(pending, mesh.failure)
        else:
            self.send(mesh, ranks, frames_for(call_id))
        if self.listeners:
            self._changed(mesh)
        return pending

    def _changed(self, mesh: SpawnedMesh) -> None:
        for fn in list(self.listeners):
            try:
                fn(mesh)
            except Exception:
                traceback.print_exc(file=sys.__stderr__)

    def interrupt(self, pending: PendingCall) -> None:
        """Interrupt `pending` on the workers still busy with it. Each is told which call the SIGINT is
        for: a worker running another thread's call goes on with it and skips `pending` when it comes."""
        for r in pending.ranks:
            if r not in pending.replies:
                try:
                    struct.pack_into("<q", pending.mesh.targets, 8 * r, pending.call_id)
                    os.kill(pending.mesh.info[r]["pid"], signal.SIGINT)
                except (ProcessLookupError, IndexError):
                    pass

    def busy_with_earlier_calls(self, pending: PendingCall) -> set[int]:
        """Ranks of `pending`'s mesh that have not yet answered a call issued before it (by another thread)."""
        busy: set[int] = set()
        for other in list(self.calls.values()):
            if other is not pending and other.mesh is pending.mesh and other.call_id < pending.call_id:
                busy.update(r for r in other.ranks if r not in other.replies)
        return busy

    def _fail(self, pending: PendingCall, error: BaseException) -> None:
        self.calls.pop(pending.call_id, None)
        try:
            pending.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        self._poke()
        if self.listeners:
            self._changed(pending.mesh)

    def _poke(self) -> None:
        """Wake a caller blocked receiving, so it sees that its call ended (failed) at once."""
        with self._waker_lock:
            if not self._closed:
                try:
                    self._waker.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # plenty of pokes already queued

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # already full of wake-ups

    # -- the I/O thread ----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = select.poll()
        pull_fd = self.pull.getsockopt(zmq.FD)
        poller.register(self._wake_r, select.POLLIN)
        watched: set[int] = set()
        watching_pull = False
        while not self._closed:
            try:
                for fd in set(self.sentinels) - watched:
                    poller.register(fd, select.POLLIN)
                    watched.add(fd)
                # While a caller in wait() receives for itself, leave it the socket; still watch workers.
                mine = self._rx_waiters == 0 and self._rx_lock.acquire(blocking=False)
                if mine:
                    try:
                        self._drain()  # until empty, so the socket's notification fd is re-armed
                    finally:
                        self._rx_lock.release()
                if mine != watching_pull:
                    poller.register(pull_fd, select.POLLIN) if mine else poller.unregister(pull_fd)
                    watching_pull = mine
                # Not receiving: a caller in wait() is. It does not wake us when it returns (that would
                # cost a wake-up per call); we look again after RX_HANDBACK instead.
                for fd, _ in poller.poll(None if mine else RX_HANDBACK * 1000):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    elif fd in self.sentinels:
                        poller.unregister(fd)
                        watched.discard(fd)
                        self._on_exit(*self.sentinels.pop(fd))
            except Exception:
                if self._closed:
                    return
                print("monarch: internal error in the I/O thread:", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)

    def wait(self, pending: PendingCall, timeout: float | None = None) -> dict[int, tuple[str, list]]:
        """Wait for a call's replies, receiving them on this thread (no hand-off from the I/O thread).

        The I/O thread only drains the socket when woken; a waiting caller takes the receive lock
        and drains it itself, and so returns the moment the last reply is in.
        """
        fut = pending.future
        deadline = None if timeout is None else time.monotonic() + timeout
        spin = bool(SPIN)  # poll first; after a quiet stretch, just sleep
        counted = False
        # Ctrl-C is raised in the main thread between any two bytecodes; one that lands while a message
        # is being taken off the socket and handled would lose it (and so a call's reply). Hold it there.
        # Our handler acts as Python's default one (raises KeyboardInterrupt) except there, so it stays
        # installed; a handler someone else set is left alone.
        if threading.get_ident() == _MAIN:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._sigint_handler)
        try:
            with self._rx_count_lock:
                self._rx_waiters += 1
                counted = True  # no call between these two lines: Ctrl-C cannot fall between them
            while not fut.done():
                if self.stdin_queue and self.serve_stdin():
                    continue
                left = 0.02 if deadline is None else min(0.02, deadline - time.monotonic())
                if left <= 0:
                    break
                if not self._rx_lock.acquire(blocking=False):
                    # another caller receives, our replies included: wait for our call, and look again
                    # soon in case that caller is done before we are
                    concurrent.futures.wait([fut], timeout=min(left, 0.002))
                    continue
                try:
                    spin = self._receive_until(fut, left, spin) and bool(SPIN)
                finally:
                    self._rx_lock.release()
        finally:
            if self._rx_lock._is_owned():  # Ctrl-C right after acquire(), before its try: still ours
                self._rx_lock.release()
            if counted:
                with self._rx_count_lock:
                    self._rx_waiters -= 1  # the I/O thread receives again within RX_HANDBACK
        return fut.result(0)

    def _receive_until(self, fut: concurrent.futures.Future, timeout: float, spin: bool) -> bool:
        """Handle replies as they come (blocking receives: fewest system calls) until `fut` is done,
        `timeout` passes with nothing received, or a worker asks for input (the caller serves it).

        With `spin`, poll for `SPIN` seconds before each sleep. False when the time ran out."""
        main = threading.get_ident() == _MAIN
        if main:
            self._main_receiving = True
        try:
            return self._receive_messages(fut, timeout, spin)
        finally:
            if main:
                self._main_receiving = False
                if self._sigint_held:
                    self._sigint_held = False
                    raise KeyboardInterrupt

    def _on_sigint(self, signum, frame) -> None:
        """SIGINT while a waiting main thread receives: delivered once the message in hand is handled."""
        if self._main_receiving:
            self._sigint_held = True
            return
        raise KeyboardInterrupt

    def _receive_messages(self, fut: concurrent.futures.Future, timeout: float, spin: bool) -> bool:
        pull = self.pull
        ms = max(1, int(timeout * 1000))
        if ms != self._rcvtimeo:
            pull.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        while not fut.done() and not self._sigint_held:
            frame = _poll_briefly(pull) if spin else None
            if frame is None:
                try:
                    frame = pull.recv(copy=False)
                except zmq.Again:
                    return False
            frames = _whole_message(pull, frame)
            if frames is None:  # a poke: look at our call again
                continue
            spin = bool(SPIN)  # replies come in bursts: poll for the next one
            if self._handle(frames) == "input":
                return True
        return True

    def _drain(self) -> None:
        """Handle everything received so far (the I/O thread; also re-arms the socket's notification fd)."""
        pull = self.pull
        while True:
            try:
                frame = pull.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = _whole_message(pull, frame)
            if frames is not None:  # else a poke for a waiting caller that already left
                self._handle(frames)

    def _handle(self, frames: list) -> str | None:
        """Act on one message; return its kind."""
        try:
            header, body, buffers = wire.decode(self.key, frames)
        except wire.BadSignature as e:
            print(f"monarch: dropped a message that failed its signature check ({e})", file=sys.__stderr__)
            return None
        kind = header[0]
        if kind == "result" or kind == "error":
            _, call_id, _, rank = header
            pending = self.calls.get(call_id)
            if pending is None:
                return kind  # its caller already gave up on it
            pending.replies[rank] = (kind, body, buffers)
            if len(pending.replies) == len(pending.ranks):
                self.calls.pop(call_id, None)
                if not pending.future.done():
                    pending.future.set_result(pending.replies)
                if self.listeners:
                    self._changed(pending.mesh)
            return kind
        if kind == "ready" or kind == "failed":
            _, mesh_id, rank, data = header
            mesh = self.meshes.get(mesh_id)
            if mesh is not None and kind == "ready":
                mesh.ready[rank] = data
            elif mesh is not None:
                mesh.start_error = (rank, data)
        elif kind == "out" or kind == "display":
            if kind == "out":
                _, call_id, mesh_id, rank, stream, text = header
                data = metadata = None
            else:
                _, call_id, mesh_id, rank, data, metadata = header
                stream, text = "display", ""
            mesh = self.meshes.get(mesh_id)
            label = mesh.labels[rank] if mesh else f"rank={rank}"
            pending = self.calls.get(call_id) if call_id is not None else None
            sink = pending.output if pending is not None and pending.output is not None else self.output
            try:
                sink(OutputEvent(call_id, mesh_id, rank, label, stream, text, data, metadata))
            except Exception:
                traceback.print_exc(file=sys.__stderr__)
        elif kind == "input":
            _, call_id, mesh_id, rank, req_id, prompt, password, debugger = header
            mesh = self.meshes.get(mesh_id)
            if mesh is not None:
                self._on_input(InputRequest(mesh, rank, mesh.labels[rank], call_id, req_id, prompt, password, debugger))
        return kind

    def _on_exit(self, mesh: SpawnedMesh, rank: int) -> None:
        code = mesh.procs[rank]._popen.poll()
        mesh.exitcodes[rank] = code
        if len(mesh.exitcodes) == len(mesh.procs):
            mesh.all_exited.set()
        if mesh.state != "running":
            return  # stopping, or already failed: expected
        mesh.state = "failed"
        mesh.failure = WorkerDiedError(
            rank, mesh.labels[rank], exit_cause(code), mesh.shape.describe(), len(mesh.procs)
        )
        self._kill(mesh)
        self._mark_gone(mesh)
        for pending in list(self.calls.values()):
            if pending.mesh is mesh:
                self._fail(pending, mesh.failure)
        self._changed(mesh)
        print(f"monarch: {mesh.failure}", file=sys.stderr)

    # -- stopping ----------------------------------------------------------------------------------
    def _kill(self, mesh: SpawnedMesh) -> None:
        for p in mesh.procs:
            if p.pid is not None and p._popen.returncode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _mark_gone(self, mesh: SpawnedMesh) -> None:
        """Tell workers of other meshes, waiting in the store to meet one of this mesh's, to give up."""
        if self._store is not None:
            try:
                self._store.set(groups.gone_key(mesh.mesh_id), b"1")
            except Exception:  # the store is ours and local: this is not expected, and not fatal
                traceback.print_exc(file=sys.__stderr__)

    def stop(self, mesh: SpawnedMesh) -> None:
        """Stop a mesh's workers: ask them to exit, kill those that do not. Idempotent."""
        if mesh.state in ("stopping", "stopped"):
            mesh.all_exited.wait(EXIT_GRACE + 2)
            return
        was_running = mesh.state == "running"
        mesh.state = "stopping"
        if was_running:
            self.send(mesh, tuple(range(len(mesh.procs))), wire.encode(self.key, ("exit",)))
        if not mesh.all_exited.wait(EXIT_GRACE if was_running else 0):
            self._kill(mesh)
            mesh.all_exited.wait(2)
        for pending in list(self.calls.values()):
            if pending.mesh is mesh:
                self._fail(pending, RuntimeError(f"mesh {mesh.shape.describe()} was stopped during the call"))
        mesh.state = "stopped"
        self._mark_gone(mesh)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, f"interrupt-{mesh.mesh_id}"))  # workers and we keep our mappings
        self.meshes.pop(mesh.mesh_id, None)
        self._changed(mesh)

    def shutdown(self) -> None:
        """Stop every mesh and close the sockets (runs at interpreter exit)."""
        if self._closed:
            return
        for mesh in list(self.meshes.values()):
            self.stop(mesh)
        self._closed = True
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is self._sigint_handler:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        self._wake()
        self._io.join(2)
        with self._waker_lock:
            self._waker.close(0)
        with self.pub_lock:
            self.pub.close(0)
        self.pull.close(0)
        self.zctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
        global _controller
        if _controller is self:
            _controller = None


_MAIN = threading.main_thread().ident
"""The thread Python runs signal handlers in (Ctrl-C is raised there)."""


def _shared_slots(path: str, n: int) -> mmap.mmap:
    """`n` int64 slots in a file the workers map too (zeros to start)."""
    with open(path, "wb") as f:
        f.truncate(8 * n)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 8 * n)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _no_interrupt_midway():
    """Hold Ctrl-C back until the block is done (a message of several frames cut short would swallow
    the next message: workers would drop both), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread is interrupted
        return
    held: list = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if held and callable(old):
            old(signal.SIGINT, held[0])


def _whole_message(sock: zmq.Socket, first: zmq.Frame) -> list | None:
    """All frames of the message that starts with `first`; None for a poke (one empty frame)."""
    if not first.more:
        return [first] if len(first) else None
    frames = [first]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def _poll_briefly(sock: zmq.Socket) -> zmq.Frame | None:
    """The next message's first frame if one arrives within `SPIN` seconds, else None."""
    end = time.perf_counter() + SPIN
    while True:
        try:
            return sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            if time.perf_counter() > end:
                return None
            os.sched_yield()  # anyone runnable here goes first


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["monarch.runtime.worker"])
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


_controller: Controller | None = None
_lock = threading.Lock()
on_create: list[Callable[[Controller], None]] = []
"""Called with each new controller (the notebook extension installs its output and stdin here)."""


def get_controller() -> Controller:
    """This process's controller, created on first use."""
    global _controller
    with _lock:
        if _controller is None:
            _controller = Controller()
            for fn in on_create:
                fn(_controller)
        return _controller
