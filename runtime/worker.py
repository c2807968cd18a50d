"""The worker process: one per mesh point.

This module is preloaded by the fork server (it imports torch), so a worker forked from it is
ready in milliseconds. `main` is the process entry point.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import datetime
import io
import itertools
import linecache
import math
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import zmq

from monarch.runtime import context, groups, stdin, wire
from monarch.runtime.shape import Shape

PR_SET_PDEATHSIG = 1

current: Worker | None = None
"""This process's worker (code running on it can send output and ask for input through it)."""


@dataclass
class WorkerConfig:
    """Everything a worker needs to start; sent through the fork server's private pipe."""

    mesh_id: int
    """Which spawned mesh this worker belongs to."""
    rank: int
    """Global rank in that mesh."""
    coords: dict[str, int]
    """Coordinates in that mesh."""
    sizes: dict[str, int]
    """Sizes of that mesh."""
    local_rank: int
    """Index among this host's workers (picks the GPU)."""
    cmd_addr: str
    """Controller socket that publishes commands (XPUB)."""
    reply_addr: str
    """Controller socket that collects replies and output (PULL)."""
    key: bytes
    """HMAC key for signing messages."""
    store_addr: tuple[str, int]
    """The controller's torch.distributed TCPStore."""
    interrupt_path: str
    """A file of int64 slots, one per rank: the call the controller's next SIGINT is meant for."""
    env: dict[str, str]
    """Environment to run with (the controller's, plus rank variables)."""
    cwd: str
    """Working directory (the controller's)."""
    sys_path: list[str]
    """`sys.path` (the controller's)."""
    threads: int
    """torch intra-op threads."""
    forkserver_pid: int | None
    """The parent; the worker dies with it."""


def main(cfg: WorkerConfig) -> None:
    _die_with_parent(cfg.forkserver_pid)
    os.setsid()  # terminal Ctrl-C goes to the controller, which forwards interrupts
    os.environ.update(cfg.env)
    os.chdir(cfg.cwd)
    sys.path[:] = cfg.sys_path
    Worker(cfg).run()


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


class Output:
    """Forwards everything written to file descriptors 1 and 2 (Python or C) to the controller."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.lock = threading.Lock()
        self.streams: dict[int, tuple[str, Any]] = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.streams[r] = (name, codecs.getincrementaldecoder("utf-8")("replace"))
        sys.stdout, sys.stderr = _Stream(1), _Stream(2)
        self._pending = select.poll()  # is anything written and not yet sent? (one system call)
        for fd in self.streams:
            self._pending.register(fd, select.POLLIN)
        threading.Thread(target=self._loop, name="monarch-output", daemon=True).start()

    def _loop(self) -> None:
        fds = list(self.streams)
        while fds:
            ready, _, _ = select.select(fds, [], [])
            with self.lock:
                fds = [fd for fd in fds if self._drain(fd) or fd not in ready]

    def _drain(self, fd: int) -> bool:
        name, decoder = self.streams[fd]
        chunks = []
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                return False
            chunks.append(data)
        text = decoder.decode(b"".join(chunks)) if chunks else ""
        if text:
            w = self.worker
            w.send(("out", w.call_id, w.cfg.mesh_id, w.cfg.rank, name, text))
        return True

    def flush(self) -> None:
        """Send everything written so far; called before each reply so output precedes it."""
        if not self.streams:
            return
        for f in (sys.stdout, sys.stderr):
            if type(f) is _Stream:  # ours say whether they hold anything; a stream the user set is flushed
                if not f.written:
                    continue
                f.written = False
            try:
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass
        ready = self._pending.poll(0)
        with self.lock:  # even with nothing ready: the output thread may hold text it read but has not sent
            for fd, _ in ready:
                self._drain(fd)


class _Stream(io.TextIOWrapper):
    """`sys.stdout` / `sys.stderr` on a worker: line-buffered onto file descriptor 1 or 2, and
    remembering whether it was written to, so that a call's end flushes only what needs it."""

    written = False

    def __init__(self, fd: int):
        super().__init__(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )

    def write(self, s: str) -> int:
        self.written = True
        return super().write(s)


class Worker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.key = cfg.key
        self.call_id: int | None = None
        self.in_user_code = False
        self.fns: dict[int, Any] = {}
        self.views: dict[tuple, context.CallView] = {}
        """This worker's coordinates in each mesh view it was called on."""
        self.send_lock = threading.Lock()
        self.zctx = zmq.Context()
        self.cmd = self.zctx.socket(zmq.SUB)
        self.cmd.setsockopt(zmq.RCVHWM, 0)
        self.to_all = b"%d:*" % cfg.mesh_id
        self.to_me = b"%d:%d|" % (cfg.mesh_id, cfg.rank)
        self.cmd.setsockopt(zmq.SUBSCRIBE, self.to_all)  # commands to the whole mesh
        self.cmd.setsockopt(zmq.SUBSCRIBE, self.to_me)  # and to this rank
        self.cmd.connect(cfg.cmd_addr)
        self.out = self.zctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 5000)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(cfg.reply_addr)
        self.output = Output(self)
        self.backlog: collections.deque[tuple] = collections.deque()
        """Commands that arrived while user code waited for stdin; served next."""
        self._input_ids = itertools.count(1)
        self.in_debugger = False
        """True while a pdb prompt on this worker is reading commands."""
        with open(cfg.interrupt_path, "rb") as f:
            self.targets = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.cancelled: set[int] = set()
        """Calls interrupted before they started here (this worker was busy with another call)."""
        signal.signal(signal.SIGINT, self._on_sigint)
        global current
        current = self
        stdin.install(self)

    def _on_sigint(self, signum, frame) -> None:
        (target,) = struct.unpack_from("<q", self.targets, 8 * self.cfg.rank)
        if target == self.call_id and self.in_user_code:
            raise KeyboardInterrupt
        if target > 0:  # a call not started yet (perhaps queued behind another thread's): skip it
            if len(self.cancelled) > 1024:  # ids of calls that had finished as they were interrupted
                self.cancelled = set(sorted(self.cancelled)[512:])
            self.cancelled.add(target)

    def send(self, header: tuple, body: list | None = None) -> None:
        frames = wire.encode(self.key, header, body)
        with self.send_lock:
            if len(frames) == 1:
                self.out.send(frames[0])
            else:
                self.out.send_multipart(frames, copy=False)

    # -- start-up ----------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        torch.seed()  # forked workers share the fork server's RNG state; give each its own, as a fresh process has
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if gpus and local_workers <= gpus:
            device = torch.device("cuda", cfg.local_rank)
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
            if gpus and cfg.local_rank == 0:  # NCCL refuses two ranks on one GPU; every worker decides alike
                print(
                    f"monarch: {local_workers} workers on this host but {gpus} GPUs: the workers use the CPU "
                    f"(spawn at most {gpus} per host to give each its own GPU)",
                    file=sys.stderr,
                )
        context.worker = context.WorkerInfo(cfg.rank, cfg.coords, cfg.sizes, cfg.local_rank, device)
        context.view = context.CallView(dict(cfg.coords), dict(cfg.sizes))
        host, port = cfg.store_addr
        timeout = datetime.timedelta(seconds=float(os.environ.get("MONARCH_GROUP_TIMEOUT", "600")))
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"monarch/{cfg.mesh_id}/", store),
            rank=cfg.rank,
            world_size=math.prod(cfg.sizes.values()),
            timeout=timeout,
        )
        groups._groups[groups.WORLD] = dist.group.WORLD
        store.set_timeout(timeout)  # NCCL meets through the store on first use: wait as long as collectives do
        groups.store, groups.timeout, groups.prefix = store, timeout, f"monarch/{cfg.mesh_id}/"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "device": str(device)}
        self.send(("ready", cfg.mesh_id, cfg.rank, info))

    def run(self) -> None:
        try:
            self._start()
        except BaseException:
            self.send(("failed", self.cfg.mesh_id, self.cfg.rank, traceback.format_exc()))
            self._close()
            return
        while True:
            if self.backlog:
                header, body, buffers = self.backlog.popleft()
            else:
                try:
                    msg = self.receive()
                except KeyboardInterrupt:
                    continue
                if msg is None:
                    continue
                header, body, buffers = msg
            kind = header[0]
            if kind == "exit":
                break
            try:
                if kind == "call":
                    self._call(header, body, buffers)
                elif kind == "groups":
                    groups.create(header[1], self.cfg.rank, header[2])
                    self.output.flush()  # what it printed belongs to no call: send it before the next one starts
                elif kind == "ops":
                    from monarch.runtime import tensor_worker

                    tensor_worker.run(wire.loads(body, buffers))
                    self.output.flush()
            except Exception:  # a bug of ours: report it, keep serving
                traceback.print_exc()
        self._close()

    def receive(self) -> tuple | None:
        """The next command (header, body, buffers); None for one that failed its signature check."""
        cmd = self.cmd
        frame = cmd.recv(copy=False)
        first = frame.buffer
        topic = self.to_all if first[: len(self.to_all)] == self.to_all else self.to_me
        frames = [first[len(topic) :]]
        while frame.more:
            frame = cmd.recv(copy=False)
            frames.append(frame)
        try:
            return wire.decode(self.key, frames)
        except wire.BadSignature as e:
            print(f"monarch worker {self.cfg.rank}: dropped a message: {e}", file=sys.stderr)
            return None

    def request_input(self, prompt: str, password: bool = False) -> str:
        """Ask the controller for a line of input (pdb, input()); blocks until it answers.

        Commands arriving meanwhile are kept for later, in order. Raises `RuntimeError` when the
        controller has no stdin to offer (nbclient, a non-blocking call) and `KeyboardInterrupt`
        when the user interrupted instead of answering.
        """
        req = next(self._input_ids)
        self.output.flush()  # what was printed before the prompt shows before it
        header = ("input", self.call_id, self.cfg.mesh_id, self.cfg.rank, req, prompt, password, self.in_debugger)
        self.send(header)
        while True:
            msg = self.receive()
            if msg is None:
                continue
            header = msg[0]
            if header[0] == "stdin" and header[1] == req:
                _, _, ok, text = header
                if ok:
                    return text
                if text == "interrupted":
                    raise KeyboardInterrupt
                raise RuntimeError(text)
            self.backlog.append(msg)
            if header[0] == "exit":
                raise RuntimeError("the mesh is stopping; no input will come")

    def send_display(self, data: dict, metadata: dict) -> None:
        """Send a rich display (a mime bundle) made on this worker, in order with its output."""
        self.output.flush()
        self.send(("display", self.call_id, self.cfg.mesh_id, self.cfg.rank, data, metadata))

    def _close(self) -> None:
        self.output.flush()
        if dist.is_initialized():  # a communicator stuck on a dead peer may never let go: not waited for long
            t = threading.Thread(target=_destroy_groups, name="monarch-destroy", daemon=True)
            t.start()
            t.join(5)
        self.send(("bye", self.cfg.mesh_id, self.cfg.rank))
        self.out.close()
        self.cmd.close()
        self.zctx.term()

    # -- live functions ----------------------------------------------------------------------------
    def _call(self, header: tuple, body, buffers: list) -> None:
        _, call_id, fid, names, sizes, ranks, fn_blob, sources = header
        engine = sys.modules.get("monarch.runtime.tensor_worker")
        if engine is not None and engine._streams:
            self.output.flush()  # what stream threads printed so far is no part of this call
        self.call_id = call_id
        key = (names, sizes, ranks)
        call_view = self.views.get(key)
        if call_view is None:
            view = Shape(names, sizes, ranks)
            call_view = context.CallView(view.coords(ranks.index(self.cfg.rank)), view.size_dict)
            if len(self.views) < 1024:
                self.views[key] = call_view
        context.view = call_view  # read only through current_rank()/current_size(), which copy
        ok, value = True, None
        try:
            if fn_blob is not None:
                for filename, lines in (sources or {}).items():
                    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
                try:
                    self.fns[fid] = cloudpickle.loads(fn_blob)
                except BaseException as e:
                    self.fns[fid] = e  # shipped once: later calls report the same failure
                    raise
            fn = self.fns[fid]
            if isinstance(fn, BaseException):
                raise RuntimeError(f"this function could not be loaded on this worker: {type(fn).__name__}: {fn}")
            args, kwargs = wire.loads(body, buffers)
            if call_id in self.cancelled:  # (after keeping the function: later calls rely on it)
                raise KeyboardInterrupt("interrupted before it started")
            self.in_user_code = True
            try:
                value = fn(*args, **kwargs)
            finally:
                self.in_user_code = False
        except BaseException as e:
            ok, value = False, _describe(e)
        if value is None and ok:
            body = _NONE
        elif ok:
            try:
                body = wire.dumps(value)
            except Exception as e:
                ok, value = False, _describe(e, f"the result ({type(value).__name__}) cannot be pickled: ")
        self.output.flush()
        if ok:
            self.send(("result", call_id, self.cfg.mesh_id, self.cfg.rank), body)
        else:
            self.send(("error", call_id, self.cfg.mesh_id, self.cfg.rank), wire.dumps(value))
        self.call_id = None
        self.cancelled.discard(call_id)


def _destroy_groups() -> None:
    try:
        dist.destroy_process_group()
    except Exception:
        pass


_NONE = wire.dumps(None)

_PLUMBING = {__file__, *(os.path.join(os.path.dirname(__file__), f) for f in ("cells.py", "stdin.py"))}
"""Our frames at the top of a worker traceback; left out so the user's code comes first."""


def _describe(e: BaseException, prefix: str = "") -> tuple[str, str, str]:
    """(type name, message, traceback) with our own frames (worker plumbing) left out."""
    if type(e).__name__ == "PoisonedValueError":  # its message holds the traceback that matters
        return (type(e).__qualname__, prefix + str(e), "")
    te = traceback.TracebackException.from_exception(e)
    for t in (te, *_chained(te)):
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename not in _PLUMBING])
    return (type(e).__qualname__, prefix + str(e), "".join(te.format()))


def _chained(te: traceback.TracebackException) -> list[traceback.TracebackException]:
    out, seen = [], set()
    todo = [te.__cause__, te.__context__]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
        todo += [t.__cause__, t.__context__]
    return out
