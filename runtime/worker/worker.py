"""The worker process: one per mesh point. Serves the controller's messages through a handler table.

The fork server imports this module once (and torch, unless the mesh's program has not imported it: see
`WorkerStart.torch`); a worker forked from it is ready in milliseconds. `main.run` is the process entry point.
Torch and the process groups are set up in `setup_torch`, at start or on the controller's `ReadyTorch`: this
module and those it imports at the top never import torch.
"""

from __future__ import annotations

import bdb
import collections
import datetime
import itertools
import linecache
import logging
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any

import cloudpickle

from monarch.runtime.common import context, errors, log, ports
from monarch.runtime.common.processes import run_as_batch
from monarch.runtime.common.shape import Shape
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.store import store_client
from monarch.runtime.wire.worker_end import WorkerTransport
from monarch.runtime.worker import actors, stdin
from monarch.runtime.worker.control import Control
from monarch.runtime.worker.describe import describe
from monarch.runtime.worker.output import Output

_log = log.get("worker")

current: Worker | None = None
"""This process's worker (code running on it can send output and ask for input through it)."""


HANDLERS: dict[type, str] = {
    protocol.Call: "_call",
    protocol.MakeGroups: "_make_groups",
    protocol.RunOps: "_run_ops",
    protocol.StdinReply: "_late_stdin",
    protocol.ReformGroups: "_reform_groups",
    protocol.Cast: "_cast",
    protocol.ReadyTorch: "_ready_torch",
}
"""A worker's handler per message type (`Exit` ends its loop); anything else is answered by `_unsupported`."""


class Worker:
    def __init__(self, cfg: protocol.WorkerStart):
        self.cfg = cfg
        self.rank: int = cfg.keys.rank
        self.mesh_id: int = cfg.keys.mesh_id
        self.transport = WorkerTransport(cfg.keys, cfg.spin)
        self._send = self.transport.send
        self._reply = self.transport.reply
        self.call_id: int | None = None
        self.in_user_code = False
        self.fns: dict[int, Any] = {}
        self.views: dict[tuple, context.CallView] = {}
        """This worker's coordinates in each mesh view it was called on."""
        self.output = Output(self)
        self.backlog: collections.deque[codec.Envelope] = collections.deque()
        """Commands that arrived while user code waited for stdin; served next."""
        self._input_ids = itertools.count(1)
        self.in_debugger = False
        """True while a pdb prompt on this worker is reading commands."""
        self.side_poll: Any = None
        """Once this process runs actors: waits for the next command while serving their inbox (`actors.py`)."""
        with open(cfg.interrupt_path, "rb") as f:
            self.targets = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.released: tuple[str, str] | None = None
        """(collective, where) when the control thread released this call from a collective."""
        self.cancelled: set[int] = set()
        """Calls interrupted before they started here (this worker was busy with another call)."""
        self.main_thread = threading.get_ident()
        """The thread that serves messages (actors' sockets belong to it)."""
        self.handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}
        self.streams: Any = None
        """The tensor engine's streams module, once torch is set up here (`setup_torch`)."""
        self.engine: Any = None
        """The tensor engine's commands module, likewise."""
        self._debug = _log.isEnabledFor(logging.DEBUG)
        signal.signal(signal.SIGINT, self._on_sigint)
        global current
        current = self
        stdin.install(self)
        self.control = Control(self, self.targets)
        actors.host = self
        ports.ROUTER = actors.WorkerRouter(self)

    def _on_sigint(self, signum, frame) -> None:
        (target,) = struct.unpack_from("<q", self.targets, protocol.SLOT * self.rank)
        if target == self.call_id and self.in_user_code:
            lane = self.transport.lane
            if lane is not None and lane.defer_interrupt():
                return  # (raised as soon as the message this thread reads or writes is whole)
            raise KeyboardInterrupt
        if target > 0 and target in actors.deferred:  # an actor's `async def` endpoint answers it: cancel it
            actors.interrupt(target)
            return
        if target > 0:  # a call not started yet (perhaps queued behind another thread's): skip it
            if len(self.cancelled) > 1024:  # ids of calls that had finished as they were interrupted
                self.cancelled = set(sorted(self.cancelled)[512:])
            self.cancelled.add(target)

    def send(self, message: Any, body: list | None = None) -> None:
        """Send a message to the controller (any thread)."""
        self._send(message, body)

    # -- start-up ----------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        context.worker = context.WorkerInfo(self.rank, cfg.coords, cfg.sizes, cfg.local_rank, "cpu", self.mesh_id)
        context.view = context.CallView(dict(cfg.coords), dict(cfg.sizes))
        if cfg.torch:
            self.setup_torch()
        else:  # torch, if the actors import it, starts with the threads it would have been given
            os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
            if os.path.isdir("/proc/driver/nvidia/gpus"):
                context.worker.device = "not set (torch not loaded)"
        device = context.worker.device
        info = {"pid": os.getpid(), "host": socket.gethostname(), "device": str(device), "torch": cfg.torch}
        self.transport.hello(protocol.Ready(info))

    def setup_torch(self) -> None:
        """Import torch and set it up as a fresh process of this worker's would be: its threads, an RNG of
        its own, its GPU, the mesh's default process group (with every other worker of the mesh)."""
        import torch

        from monarch.runtime.worker import groups
        from monarch.runtime.worker.engine import commands, streams

        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        # Forked workers share the fork server's RNG state: each gets its own, as a fresh process has. (Not
        # `torch.seed()`: on a machine without a GPU its CUDA half only queues a lazy call, formatting the
        # caller's whole stack, for nothing.)
        seed = torch.default_generator.seed()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            torch.cuda.manual_seed_all(seed)
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
        assert context.worker is not None
        context.worker.device = device
        store = store_client(self.transport, datetime.timedelta(seconds=cfg.group_timeout))
        groups.current = groups.Groups(store, self.mesh_id, self.rank, cfg.sizes, cfg.group_timeout, backend)
        self.streams, self.engine = streams, commands

    def _ready_torch(self, env: codec.Envelope) -> None:
        if self.streams is None:
            self.setup_torch()
            _log.info("torch set up (the controller's first message that needs it)")
        self.output.flush()

    def run(self) -> None:
        try:
            self._start()
        except BaseException:
            self.transport.hello(protocol.StartFailed(traceback.format_exc()))
            self._close()
            return
        if self.cfg.batch:  # (once set up: see `run_as_batch`)
            run_as_batch()
        handlers = self.handlers
        said_ready = False
        while True:
            if self.backlog:
                env = self.backlog.popleft()
            else:
                try:
                    if self.side_poll is not None and not self.transport.ready():
                        self.side_poll(self.transport.cmd)
                        env = self.transport.recv(readable=True)
                    else:
                        env = self.transport.recv()
                except KeyboardInterrupt:
                    continue
                if env is None:
                    continue
            if not said_ready:  # Not before: output overtaking our Ready (another socket) would get it dropped.
                said_ready = True
                _log.info("ready: rank %d, pid %d, device %s", self.rank, os.getpid(), context.worker.device)
            kind = type(env.message)
            if kind is protocol.Exit:
                break
            handler = handlers.get(kind)
            try:
                if handler is None:
                    self._unsupported(env.message)
                    continue
                handler(env)
            except Exception:  # a bug of ours: report it, keep serving
                traceback.print_exc()
        _log.info("exiting, as the controller asked")
        actors.stop_all()  # (their `__cleanup__`, before our last output and Goodbye)
        self._close(goodbye=True)

    def _unsupported(self, message: Any) -> None:
        """A message no handler takes: a request (it has a `call_id`) is answered with an error, so that its
        caller raises instead of waiting; anything else is a bug of ours, said on stderr."""
        why = f"no handler for {type(message).__name__} on a worker (it handles {', '.join(sorted(c.__name__ for c in self.handlers))}, Exit)"
        call_id = getattr(message, "call_id", None)
        if call_id is None:
            raise TypeError(why)
        self.transport.send(protocol.Reply(call_id, False), codec.dumps(protocol.ErrorInfo("TypeError", why, "")))

    def _make_groups(self, env: codec.Envelope) -> None:
        from monarch.runtime.worker import groups

        groups.current.create(env.message.gid, env.message.partition)
        self.output.flush()  # what it printed belongs to no call: send it before the next one starts

    def _run_ops(self, env: codec.Envelope) -> None:
        self.engine.run_packed(codec.loads(env.body, env.buffers))
        self.output.flush()

    def _reform_groups(self, env: codec.Envelope) -> None:
        from monarch.runtime.worker import groups

        groups.current.reform(env.message.generation)
        _log.info("process groups re-formed (generation %d)", env.message.generation)
        self.output.flush()

    def _cast(self, env: codec.Envelope) -> None:
        """`broadcast()`s to actors here, in order; only a failure is answered (`CastFailed`)."""
        self.call_id = None
        for item in codec.loads(env.body, env.buffers):
            ok, value = actors.cast(*item)
            if not ok:
                self.output.flush()
                self._send(protocol.CastFailed(item[0], item[1]), codec.dumps(describe(value)))
        self.output.flush()

    def _late_stdin(self, env: codec.Envelope) -> None:
        pass  # an answer to a prompt given up on (the call was interrupted): nobody waits for it

    def request_input(self, prompt: str, password: bool = False) -> str:
        """Ask the controller for a line of input (pdb, input()); blocks until it answers.

        Commands arriving meanwhile are kept for later, in order. Raises `RuntimeError` when the
        controller has no stdin to offer (nbclient, a non-blocking call) and `KeyboardInterrupt`
        when the user interrupted instead of answering.
        """
        req = next(self._input_ids)
        self.output.flush()  # what was printed before the prompt shows before it
        where = stdin.paused_at() if self.in_debugger else ""
        self.send(protocol.AskInput(self.call_id, req, prompt, password, self.in_debugger, where))
        while True:
            env = self.transport.recv()
            if env is None:
                continue
            msg = env.message
            if type(msg) is protocol.StdinReply and msg.req_id == req:
                if msg.ok:
                    return msg.text
                if msg.text == "interrupted":
                    raise KeyboardInterrupt
                raise RuntimeError(msg.text)
            self.backlog.append(env)
            if type(msg) is protocol.Exit:
                raise RuntimeError("the mesh is stopping; no input will come")

    def send_display(self, data: dict, metadata: dict) -> None:
        """Send a rich display (a mime bundle) made on this worker, in order with its output."""
        self.output.flush()
        self.send(protocol.Display(self.call_id, data, metadata))

    def _close(self, goodbye: bool = False) -> None:
        self.output.flush()
        groups = sys.modules.get("monarch.runtime.worker.groups")
        if groups is not None and groups.current is not None:
            groups.current.destroy()
        if goodbye:  # after all our output: the controller stops reading us when this arrives
            self.output.flush()
            self.transport.send(protocol.Goodbye())
        self.transport.close()

    # -- live functions ----------------------------------------------------------------------------
    def _call(self, env: codec.Envelope) -> None:
        # Every call on every worker runs this, and each line costs several times its tight-loop time in a
        # process that wakes once per message (issue 29): the common case takes the fewest steps.
        msg: protocol.Call = env.message
        call_id = msg.call_id
        if self.streams is not None and self.streams.threads:  # what stream threads printed is no part of this call
            self.output.flush()
        self.released = None
        self.call_id = call_id
        call_view = self.views.get((msg.names, msg.sizes, msg.ranks))
        if call_view is None:
            call_view = self._view_of(msg)
        context.view = call_view  # read only through current_rank()/current_size(), which copy
        if self._debug:
            _log.debug("call %d started", call_id)
        try:
            if msg.sources:  # (with the function, or for code it is given: an actor class)
                self._keep_sources(msg)
            if msg.fn is not None:
                try:
                    self.fns[msg.fid] = cloudpickle.loads(msg.fn)
                except BaseException as e:
                    self.fns[msg.fid] = e  # shipped once: later calls report the same failure
                    raise
            fn = self.fns[msg.fid]
            if isinstance(fn, BaseException):
                raise RuntimeError(f"this function could not be loaded on this worker: {type(fn).__name__}: {fn}")
            args, kwargs = codec.loads(env.body, env.buffers)
            self.in_user_code = True  # (first: Ctrl-C from here on is raised, before it lands in `cancelled`)
            debugged = stdin.answered
            try:
                if call_id in self.cancelled:  # (after keeping the function: later calls rely on it)
                    raise KeyboardInterrupt("interrupted before it started")
                value = fn(*args, **kwargs)
            except bdb.BdbQuit:
                value = None  # `q` at a pdb prompt: the call ends quietly on this rank, as a cell does
            except Exception as e:
                stdin.post_mortem_if_debugged(e, debugged)  # (debugged in pdb: stops there first)
                raise
            finally:
                self.in_user_code = False
            if value is actors.DEFERRED:  # an actor answers through its port, later (`actors.invoke`)
                self.output.flush()
                self.call_id = None
                return
            ok, body = (True, _NONE) if value is None else _result(value)
        except BaseException as e:
            ok, body = False, self._failure(call_id, e)
        if self._debug:
            _log.debug("call %d done (%s)", call_id, "ok" if ok else "failed")
        self.output.flush()
        self._reply(call_id, ok, body)
        self.call_id = None
        if self.cancelled:
            self.cancelled.discard(call_id)

    def _view_of(self, msg: protocol.Call) -> context.CallView:
        """This worker's coordinates in the view a call names (kept for the next calls on it)."""
        view = Shape(msg.names, msg.sizes, msg.ranks)
        call_view = context.CallView(view.coords(msg.ranks.index(self.rank)), view.size_dict)
        if len(self.views) < 1024:
            self.views[(msg.names, msg.sizes, msg.ranks)] = call_view
        return call_view

    def _keep_sources(self, msg: protocol.Call) -> None:
        """The source lines of the code a call brings, for tracebacks and pdb here."""
        for filename, lines in msg.sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        errors.KNOWN_CELLS.update(msg.cells or {})  # pdb and stacks name them as the notebook does

    def _failure(self, call_id: int, e: BaseException) -> list:
        """The reply body of a call that raised `e` here (or was released from a collective)."""
        value = describe(e)
        if self.released is None and isinstance(e, Exception):
            self.control.claim_release(call_id, e)
        if self.released is not None:  # its collective raised because we shut its connections down
            collective, where = self.released
            value = protocol.ErrorInfo(RELEASED, f"released from {collective} at {where}", "")
        return codec.dumps(value)


def _result(value: Any) -> tuple[bool, list]:
    """(ok, the reply body) of a call that returned `value`."""
    try:
        return True, codec.dumps(value)
    except Exception as e:
        return False, codec.dumps(describe(e, f"the result ({type(value).__name__}) cannot be pickled: "))


_NONE = codec.dumps(None)
RELEASED = protocol.RELEASED
