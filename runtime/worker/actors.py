"""The actors living in this worker process: made and called through functions the controller calls by name
(`monarch.runtime.actors`), and called by other actors through this process's inbox (`wire/actor_end.py`).

One thread serves them all, the worker's main thread: controller calls and inbox messages alike, each run to
its end, so what one sender sends an actor runs in the order sent. While an endpoint waits for another actor's
answer (`actor_ref.py`), this thread goes on serving the inbox, so actors that call each other back do not
deadlock. An `async def` endpoint runs on this process's event loop (a thread of its own) while this thread
serves; what that thread sends goes through this one (ZeroMQ sockets belong to one thread).

How a message is answered: a plain endpoint's return value is the answer (the call's `Reply`, an inbox
`ActorAnswer`, or nothing for a broadcast). An endpoint declared `explicit_response_port` gets the answer's
`Port` and answers through it, now or later; a `concurrent_endpoint` runs as a task on the event loop, the
message's handler returning at once, and its task answers through the port when it ends. Either way `invoke`
returns `DEFERRED`, and whoever called it does not answer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import os
import select
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch.runtime.common import actors as shared
from monarch.runtime.common import context, ports
from monarch.runtime.common.mesh_trait import Point
from monarch.runtime.common.shape import Shape
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.actor_end import Inbox, InboxAddress, Outbox
from monarch.runtime.worker import stdin
from monarch.runtime.worker.describe import describe

DEFERRED = type("Deferred", (), {"__repr__": lambda self: "DEFERRED"})()
"""What `invoke` returns when the answer goes through the message's response port instead (see the module)."""

INBOX_BATCH = 64
"""Inbox messages served in a row before what else waits (sends posted by other threads, commands) is looked at."""
CLEANUP_WAIT = 10.0
"""Seconds an actor's concurrent tasks and `__cleanup__` may take when it stops, before the stop goes on."""


@dataclass
class Living:
    """One actor of this process."""

    obj: Any
    instance: shared.ActorInstance
    tasks: set[concurrent.futures.Future[Any]] = field(default_factory=set)
    """Its `async def` endpoints' calls still running (or queued: see `_enqueue`)."""
    queue: collections.deque[Callable[[], Any]] = field(default_factory=collections.deque)
    """Its `async def` endpoint calls not started yet, in the order they came (one runs at a time)."""
    busy: bool = False
    """One of its `async def` endpoint calls runs (event loop's thread only)."""


deferred: dict[int, concurrent.futures.Future[Any]] = {}
"""Controller call id -> the task of the `async def` endpoint answering it (for Ctrl-C: `interrupt`)."""


_actors: dict[str, Living] = {}
host: Any = None
"""This process's `worker.Worker` (it sets itself here as it starts: this module never imports it)."""
_loop: asyncio.AbstractEventLoop | None = None


def spawn(name: str, cls: type, args: tuple, kwargs: dict) -> InboxAddress:
    """Construct this process's actor `name`; the address of this process's inbox (for actor references)."""
    if name in _actors:
        raise ValueError(f"an actor named {name!r} already runs on this process (spawn it under another name)")
    box = mailbox()
    rank = context.current_rank()
    worker = context.worker
    proc = f"mesh {host.mesh_id} rank {worker.rank} pid {os.getpid()}" if host is not None and worker else ""
    instance = shared.ActorInstance(name, rank, proc)
    token = shared.enter(shared.Context(instance, rank))
    try:
        _actors[name] = Living(cls(*args, **kwargs), instance)
    finally:
        shared.leave(token)
    return box.inbox.address


def system_actor(name: str, make: Callable[[], Any]) -> InboxAddress:
    """This process's hidden actor `name` (made by `make()` on first use), for the runtime's own services that
    other processes reach through this process's inbox (`worker/rdma.py`'s `__monarch_rdma__`); the inbox's
    address. No actor mesh is spawned for it: callers build references to it themselves."""
    box = mailbox()
    if name not in _actors:
        _actors[name] = Living(make(), shared.ActorInstance(name))
    return box.inbox.address


def invoke(
    name: str,
    endpoint: str,
    args: tuple,
    kwargs: dict,
    message_rank: Point | None = None,
    answer: ports.Deliver | None = None,
) -> Any:
    """Run endpoint `endpoint` of actor `name`: its result (awaited if it is a coroutine), or `DEFERRED` when it
    answers through its response port. `answer` takes that answer (None: this controller call's `Reply`)."""
    living = _actors.get(name)
    if living is None:
        raise RuntimeError(f"no actor named {name!r} on this process (it was stopped, or its spawn failed here)")
    method, options, is_async = _method(living.obj, endpoint)
    if message_rank is None:  # (the call's view: its `Point` made only if the endpoint asks, `Context`)
        ctx = shared.Context(living.instance, None, context.view)
    else:
        context.view = context.CallView(dict(message_rank), dict(message_rank.extent))
        ctx = shared.Context(living.instance, message_rank)
    token = shared.enter(ctx)
    debugged = stdin.answered
    try:
        if not is_async and not options.explicit_response_port:
            if living.tasks:  # its async calls still queued or running come first: they came first
                mailbox().pump(lambda: not living.tasks)
            result = method(*args, **kwargs)
            if result is not None and inspect.isawaitable(result):
                result = _await(result)
            return result
        call_id = host.call_id if answer is None and host is not None else None
        port = _response_port(answer if answer is not None else _reply_to_call(), ctx.message_rank.rank)
        if is_async:
            # On the event loop, while this thread takes the next message: a call to another actor of this
            # process, or a concurrent one, runs meanwhile; this actor's own plain ones wait their turn.
            coro = method(port, *args, **kwargs) if options.explicit_response_port else method(*args, **kwargs)
            what = f"{name}.{endpoint}"
            _start_task(living, coro, port, options.explicit_response_port, what, ctx, options.concurrent, call_id)
            return DEFERRED
        try:
            result = method(port, *args, **kwargs)
            if inspect.isawaitable(result):
                _await(result)
        except BaseException:
            if not port._sent:
                raise
            print(f"monarch: {name}.{endpoint} raised after it answered through its port:", file=sys.stderr)
            traceback.print_exc()
        return DEFERRED
    except Exception as e:
        stdin.post_mortem_if_debugged(e, debugged)  # (debugged in pdb: stops there first, as Monarch does)
        raise
    finally:
        stdin.answered = debugged  # (what was debugged in this message is no concern of one it is nested in)
        shared.leave(token)


_ENDPOINTS: dict[tuple[type, str], tuple[str, Any, shared.EndpointOptions, bool]] = {}
"""(actor class, endpoint name) -> (attribute, its function, options, whether a coroutine function), as `_method`
found them: a call to every actor of a mesh resolves its endpoint once per process, not once per message."""


def _method(actor: Any, endpoint: str) -> tuple[Any, shared.EndpointOptions, bool]:
    """The bound method an endpoint name calls, how (`as_endpoint` names a plain method with a prefix), and whether
    it is a coroutine function."""
    known = _ENDPOINTS.get((type(actor), endpoint))
    if known is not None:
        attr, fn, options, is_async = known
        method = getattr(actor, attr, None)
        if getattr(method, "__func__", None) is fn:  # (not shadowed by the instance since)
            return method, options, is_async
    loose = endpoint.startswith(shared.LOOSE)
    if loose:
        ported = endpoint.startswith(shared.LOOSE_PORTED)
        attr = endpoint[len(shared.LOOSE_PORTED if ported else shared.LOOSE) :]
    else:
        attr = endpoint
    method = getattr(actor, attr, None)
    options = shared.options_of(method)
    if loose and callable(method):
        options = options or shared.EndpointOptions(explicit_response_port=ported)
    elif method is None or options is None:
        raise AttributeError(f"{type(actor).__name__} has no endpoint {attr!r}")
    is_async = inspect.iscoroutinefunction(method)
    fn = getattr(method, "__func__", None)
    if fn is not None and len(_ENDPOINTS) < 4096:
        _ENDPOINTS[type(actor), endpoint] = (attr, fn, options, is_async)
    return method, options, is_async


def _response_port(deliver: ports.Deliver, rank: int) -> ports.Port[Any]:
    """The port a message's answer goes through, for an endpoint that answers through it: usable here (no
    pickling) or sent anywhere (its entry in this process's table of ports takes it)."""
    ref = ports.register(deliver, once=True)

    def here(rank: int | None, ok: bool, value: Any) -> None:
        ports.unregister(ref.port_id)
        deliver(rank, ok, value)

    return ports.Port(ref, rank, here)


def _reply_to_call() -> ports.Deliver:
    """How the running controller call answers later: its `Reply`, from any thread."""
    worker, call_id = host, host.call_id

    def deliver(rank: int | None, ok: bool, value: Any) -> None:
        worker.output.flush()
        worker.send(protocol.Reply(call_id, ok), _answer_body(ok, value))

    return deliver


def _answer_body(ok: bool, value: Any) -> list[Any]:
    """A call's answer as a reply body: the value, or the exception as the caller shows it (`ErrorInfo`)."""
    if not ok:
        return codec.dumps(describe(value))
    try:
        return codec.dumps(value)
    except Exception as e:
        return codec.dumps(describe(e, f"the result ({type(value).__name__}) cannot be pickled: "))


def _start_task(
    living: Living,
    coro: Any,
    port: ports.Port[Any],
    explicit: bool,
    what: str,
    ctx: shared.Context,
    concurrent_: bool,
    call_id: int | None,
) -> None:
    """Run an `async def` endpoint's coroutine on the event loop; its result (or exception) goes to `port` when
    it ends (an explicit-port endpoint answers for itself). A `concurrent_endpoint`'s starts at once; a plain one
    after the actor's earlier plain ones ended (`living.queue`)."""

    async def run() -> None:
        token = shared.enter(ctx)  # (this task's own context: what `context()` gives inside)
        try:
            value = await coro
        except asyncio.CancelledError:
            if not explicit and not port._sent:
                interrupted = call_id is not None and call_id in _interrupted
                port.exception(KeyboardInterrupt() if interrupted else RuntimeError(f"{what} was cancelled"))
            raise
        except BaseException as e:
            if not explicit and not port._sent:
                port.exception(e)
            else:
                print(f"monarch: {what} raised after it answered through its port:", file=sys.stderr)
                traceback.print_exception(e)
            return
        finally:
            shared.leave(token)
        if not explicit and not port._sent:
            try:
                port.send(value)
            except Exception as e:  # (never silent: the caller waits for this answer)
                print(f"monarch: {what}'s answer could not be sent:", file=sys.stderr)
                traceback.print_exc()
                if not port._sent:
                    port.exception(e)

    loop = _event_loop()
    task: concurrent.futures.Future[Any] = concurrent.futures.Future()
    living.tasks.add(task)

    def done(_: Any) -> None:
        living.tasks.discard(task)
        if call_id is not None:
            deferred.pop(call_id, None)
            _interrupted.discard(call_id)
        if host is not None and not living.tasks:
            mailbox().wake()  # (a message waiting for this actor's async calls to end goes on)

    task.add_done_callback(done)
    if call_id is not None:
        deferred[call_id] = task

    def begin() -> None:  # (on the event loop)
        if task.cancelled():  # (before it started: the actor stopped)
            coro.close()
            task.set_running_or_notify_cancel()  # (a cancelled future counts as done for wait() once notified)
            return
        inner = asyncio.ensure_future(_sequenced(living, run) if not concurrent_ else run())
        asyncio.futures._chain_future(inner, task)  # type: ignore[attr-defined]

    loop.call_soon_threadsafe(begin)


async def _sequenced(living: Living, run: Callable[[], Any]) -> None:
    """Run `run()` when the actor's earlier plain `async def` calls have ended (event loop only)."""
    if living.busy:
        ready = asyncio.get_running_loop().create_future()
        living.queue.append(lambda: ready.done() or ready.set_result(None))
        await ready
    living.busy = True
    try:
        await run()
    finally:
        if living.queue:
            living.queue.popleft()()
        else:
            living.busy = False


_interrupted: set[int] = set()


def interrupt(call_id: int) -> bool:
    """Ctrl-C for controller call `call_id`, answered by an `async def` endpoint's task here: cancel it (its
    caller gets `KeyboardInterrupt`); whether there was one. Any thread (a signal handler)."""
    task = deferred.get(call_id)
    if task is None or _loop is None:
        return False
    _interrupted.add(call_id)
    _loop.call_soon_threadsafe(task.cancel)
    return True


def cast(
    actor: str, endpoint: str, names: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...], arguments: bytes
) -> tuple[bool, Any]:
    """Run one `broadcast()`'s (or `send()`'s) endpoint here: (True, its result) or (False, the exception);
    (True, DEFERRED) when the answer went elsewhere (to the send's port, or to be reported later)."""
    worker = host
    rank = _message_rank(names, sizes, ranks)
    port: ports.Port[Any] | None = None
    try:
        args, kwargs, *rest = codec.loads(arguments)
        port = rest[0] if rest else None
        if worker is not None:
            worker.in_user_code = True
        answer = _to_port(port, rank.rank) if port is not None else _cast_failed(actor, endpoint)
        ok, value = True, invoke(actor, endpoint, args, kwargs, rank, answer)
    except BaseException as e:  # (Ctrl-C too: it ends this message, not the worker)
        ok, value = False, e
    finally:
        if worker is not None:
            worker.in_user_code = False
    if port is not None and value is not DEFERRED:
        port._ranked(rank.rank)._post(ok, value)
        return True, DEFERRED
    return ok, value


def call_to_port(fn: Callable[..., Any], port: ports.Port[Any], args: tuple, kwargs: dict) -> None:
    """`send(remote_fn, args, kwargs, port=)`: run a live function here, its result (or error) to `port`,
    ranked with this worker's place in the view it was sent to."""
    ranked = port._ranked(context.current_rank().rank)
    try:
        value = fn(*args, **kwargs)
    except Exception as e:
        ranked.exception(e)
        return
    ranked.send(value)


def _to_port(port: ports.Port[Any], rank: int) -> ports.Deliver:
    """An answer to `port`, sent as the actor at `rank` of the message's view."""
    ranked = port._ranked(rank)
    return lambda _, ok, value: ranked._post(ok, value)


def _cast_failed(actor: str, endpoint: str) -> ports.Deliver:
    """A broadcast's later answer: nothing, unless it failed (`CastFailed`, for the actor mesh's owner)."""
    worker = host

    def deliver(rank: int | None, ok: bool, value: Any) -> None:
        if not ok and worker is not None:
            worker.output.flush()
            worker.send(protocol.CastFailed(actor, endpoint), codec.dumps(describe(value)))

    return deliver


_views: dict[tuple, tuple[Point, dict[str, int], dict[str, int]]] = {}


def _message_rank(names: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...]) -> Point:
    """This process's place in the view a message was sent to (and, on the side, sets it as the current view,
    for `current_rank()`)."""
    key = (names, sizes, ranks)
    got = _views.get(key)
    if got is None:
        view = Shape(names, sizes, ranks)
        index = ranks.index(context.worker.rank)
        got = (Point(index, view.size_dict), view.coords(index), view.size_dict)
        if len(_views) < 1024:
            _views[key] = got
    context.view = context.CallView(dict(got[1]), dict(got[2]))
    return got[0]


def stop(name: str) -> bool:
    """Stop actor `name`: its concurrent tasks are cancelled, its `__cleanup__(None)` runs, its object goes
    when nothing else holds it; whether there was one."""
    living = _actors.pop(name, None)
    if living is None:
        return False
    _clean_up(name, living, None)
    return True


def stop_all() -> None:
    """Stop every actor of this process, the last spawned first (the process is exiting)."""
    for name in reversed(list(_actors)):
        stop(name)


def _clean_up(name: str, living: Living, exc: BaseException | None) -> None:
    """Cancel the actor's concurrent tasks and wait for them, then run its `__cleanup__(exc)` (awaited on the
    event loop if `async def`); each within `CLEANUP_WAIT` seconds, errors said on stderr."""
    tasks = list(living.tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        concurrent.futures.wait(tasks, CLEANUP_WAIT)
    cleanup = getattr(living.obj, "__cleanup__", None)
    if cleanup is None:
        return
    token = shared.enter(shared.Context(living.instance, living.instance.rank))
    try:
        result = cleanup(exc)
        if inspect.isawaitable(result):
            _await(result, CLEANUP_WAIT)
    except BaseException:
        print(f"monarch: {name}.__cleanup__ raised:", file=sys.stderr)
        traceback.print_exc()
    finally:
        shared.leave(token)


def running() -> list[tuple[str, str]]:
    """(name, class name) of each actor on this process."""
    return [(name, type(living.obj).__name__) for name, living in _actors.items()]


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="monarch-actors-loop", daemon=True).start()
    return _loop


def _await(awaitable: Any, timeout: float | None = None) -> Any:
    """Run `awaitable` on this process's event loop and wait for it, serving the inbox meanwhile (on the main
    thread); Ctrl-C (the call interrupted) cancels it."""

    async def run() -> Any:
        return await awaitable

    future = asyncio.run_coroutine_threadsafe(run(), _event_loop())
    box = mailbox()
    if threading.get_ident() != box.main:
        return future.result(timeout)
    future.add_done_callback(lambda _: box.wake())
    try:
        if timeout is None:
            box.pump(future.done)
        else:
            pump_for(box, future.done, timeout, "an actor's coroutine")
        return future.result()
    except KeyboardInterrupt:
        future.cancel()
        raise


def loop() -> asyncio.AbstractEventLoop | None:
    """The actors' event loop, once an `async def` endpoint ran."""
    return _loop


def pump_for(box: Mailbox, done: Callable[[], bool], timeout: float, what: str) -> None:
    """`box.pump(done)` for at most `timeout` seconds (`TimeoutError` naming `what` after)."""
    import time

    deadline = time.monotonic() + timeout
    timer = threading.Timer(timeout, box.wake)
    timer.daemon = True
    timer.start()
    try:
        box.pump(lambda: done() or time.monotonic() >= deadline)
    finally:
        timer.cancel()
    if not done():
        raise TimeoutError(f"{what}: no answer within {timeout} s")


# -- the mailbox: this process's inbox and its outboxes -------------------------------------------------
class Mailbox:
    """This process's inbox (other actors' messages to ours) and outboxes (ours to theirs), all used by the
    main thread only; other threads hand it what to send (`post`)."""

    def __init__(self) -> None:
        self.worker = host
        assert self.worker is not None, "actors run on a worker"
        self.main = self.worker.main_thread
        transport = self.worker.transport
        self.ctx = transport.ctx
        self.inbox = Inbox(self.ctx, transport.keys)
        self.me = (transport.keys.mesh_id, transport.keys.rank)
        self.outboxes: dict[str, Outbox] = {}
        self.answers: dict[int, Callable[[codec.Envelope], None]] = {}
        """Call number -> what takes its answer."""
        self.posted: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.idle_poller: zmq.Poller | None = None
        """`poller` and the controller's commands: the idle wait's, made once (not registered for each)."""
        self._socks: dict[Any, Outbox] = {}
        self._quiet = False
        """No ZeroMQ socket here was used since a wait found none of them readable: a message arriving now
        makes its socket's descriptor (`zmq.FD`) readable, so the idle wait may sleep on the bare descriptors
        (`serve_until_command`). Any use of a socket may take that signal while a message waits: it clears this."""
        self._bare: select.poll | None = None
        """The idle wait's poll over the bare descriptors (the lane, the wake pipe, each socket's `zmq.FD`)."""
        self._lane = -1
        """The descriptor of the controller's commands (-1: a ZeroMQ socket, which the idle wait cannot wait on)."""
        self.worker.side_poll = self.serve_until_command

    # -- sending ----------------------------------------------------------------------------------
    def outbox(self, to: InboxAddress) -> Outbox:
        self._quiet = False  # (what it returns is used at once)
        box = self.outboxes.get(to.addr)
        if box is None:
            box = self.outboxes[to.addr] = Outbox(self.ctx, to, self.me)
            self._socks[box.sock] = box
            self._bare = None
            for poller in (self.poller, self.idle_poller):
                if poller is not None:
                    poller.register(box.sock, zmq.POLLIN)
        return box

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the main thread (now, if this is it)."""
        if threading.get_ident() == self.main:
            fn()
        else:
            self.posted.append(fn)
            self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    # -- receiving --------------------------------------------------------------------------------
    def pump(self, done: Callable[[], bool]) -> None:
        """Serve the inbox and take answers until `done()` (main thread)."""
        while not done():
            self._step(None)

    def serve_until_command(self, cmd: zmq.Socket | int) -> None:
        """The worker's idle wait: serve the inbox until a command from the controller is ready."""
        poller = self.idle_poller
        if poller is None:
            poller = self.idle_poller = zmq.Poller()
            for sock, flags in self.poller.sockets:
                poller.register(sock, flags)
            poller.register(cmd, zmq.POLLIN)
            self._lane = cmd if isinstance(cmd, int) else -1  # (a lane's descriptor)
        if self._quiet and self._lane >= 0:
            # The idle wait while no actor message is on its way (most of a worker's life), written out here
            # (each command runs it cold): one `poll` on the bare descriptors; ZeroMQ's poll would check every
            # socket's events before and after it (five more system calls per command). Done if the commands
            # alone woke it (anything else: `_step` looks).
            ready = (self._bare or self._bare_poll()).poll()
            if len(ready) == 1 and ready[0][0] == self._lane:
                return
        while not self._step(cmd, poller):
            pass

    def _bare_poll(self) -> select.poll:
        """The idle wait's poll object: the lane, the wake pipe, and every ZeroMQ socket's descriptor."""
        bare = self._bare = select.poll()
        for fd in (
            self._lane,
            self._wake_r,
            self.inbox.sock.getsockopt(zmq.FD),
            *(s.getsockopt(zmq.FD) for s in self._socks),
        ):
            bare.register(fd, select.POLLIN)
        return bare

    def _step(self, cmd: zmq.Socket | None, poller: zmq.Poller | None = None) -> bool:
        """One wait (on `poller`; by default `self.poller`, without the commands) and what it brought; whether `cmd`
        is ready."""
        events = dict((poller or self.poller).poll())
        # (ZeroMQ's poll read every socket's events: where none is readable, the next message signals its descriptor)
        self._quiet = self.inbox.sock not in events and not any(sock in events for sock in self._socks)
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        self._run_posted()
        for sock in events:
            box = self._socks.get(sock)
            if box is not None:
                self._take_answers(box)
        if self.inbox.sock in events:
            self._serve_inbox()
            self._run_posted()
        return cmd is not None and cmd in events

    def _run_posted(self) -> None:
        # Only what was there on entry: a task posting sends as fast as this thread runs them would otherwise
        # keep it here for ever, and the controller's commands and the inbox would never get their turn.
        posted = self.posted
        for _ in range(len(posted)):
            posted.popleft()()

    def _take_answers(self, box: Outbox) -> None:
        while box.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            env = box.recv()
            if env is not None:
                take = self.answers.pop(env.message.call_id, None)
                if take is not None:
                    take(env)

    def _serve_inbox(self) -> None:
        """Serve up to `INBOX_BATCH` messages of the inbox: under a flood (producers sending a port faster than
        this process takes it) what this process's tasks send, and the controller's commands, still get their
        turn between batches (the next poll sees the rest at once)."""
        sock = self.inbox.sock
        for _ in range(INBOX_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            got = self.inbox.recv()
            if got is None:
                continue
            identity, env = got
            if type(env.message) is protocol.PortSend:
                take_port_message(env)
            else:
                self._serve(identity, env)

    def _serve(self, identity: bytes, env: codec.Envelope) -> None:
        """Run one actor message here, as a call of the controller's would run (its output goes to the call
        the sender was serving), and answer it."""
        msg: protocol.ActorSend = env.message
        worker = self.worker
        before = (worker.call_id, worker.in_user_code, context.view)
        worker.call_id = msg.origin
        rank = _message_rank(msg.names, msg.sizes, msg.ranks)
        port: ports.Port[Any] | None = None
        ok = True
        try:
            args, kwargs, *rest = codec.loads(env.body, env.buffers)
            port = rest[0] if rest else None
            worker.in_user_code = True
            value = invoke(msg.actor, msg.endpoint, args, kwargs, rank, self._answer_for(msg, identity, port, rank))
        except BaseException as e:  # (Ctrl-C too: the sender waits for an answer)
            ok, value = False, e
        finally:
            worker.in_user_code = False
        worker.output.flush()
        if value is not DEFERRED:
            if msg.call_id:
                self._answer(identity, msg.call_id, ok, value)
            elif port is not None:
                port._ranked(rank.rank)._post(ok, value)
            elif not ok:
                info = describe(value)
                print(
                    f"monarch: {msg.actor}.{msg.endpoint} (a broadcast from another actor) failed:\n"
                    f"{info.traceback or info.exc_type + ': ' + info.message}",
                    file=sys.stderr,
                )
        worker.call_id, worker.in_user_code, context.view = before

    def _answer_for(
        self, msg: protocol.ActorSend, identity: bytes, port: ports.Port[Any] | None, rank: Point
    ) -> ports.Deliver:
        """Where an actor message's later answer goes (an endpoint that answers through its port)."""
        if msg.call_id:
            call_id = msg.call_id
            return lambda _, ok, value: self.post(lambda: self._answer(identity, call_id, ok, value))
        if port is not None:
            return _to_port(port, rank.rank)
        return lambda _, ok, value: None

    def _answer(self, identity: bytes, call_id: int, ok: bool, value: Any) -> None:
        self._quiet = False
        self.inbox.answer(identity, protocol.ActorAnswer(call_id, ok), _answer_body(ok, value))


def take_port_message(env: codec.Envelope) -> None:
    """A `PortSend` for a port of this process (from the inbox, or down the command connection)."""
    msg: protocol.PortSend = env.message
    try:
        value = codec.loads(env.body, env.buffers)
        ok = msg.ok
    except Exception as e:
        ok, value = False, RuntimeError(f"a message to a port could not be unpickled here: {type(e).__name__}: {e}")
    ports.take(msg.port_id, msg.rank, ok, value)


_box: Mailbox | None = None


def mailbox() -> Mailbox:
    """This process's mailbox (made on first use: a process's first actor, or its first actor reference)."""
    global _box
    if _box is None:
        if context.worker is None:
            raise RuntimeError(
                "this actor mesh is a reference, for the actors it was sent to; here, call the actor mesh that "
                "spawn() returned"
            )
        _box = Mailbox()
    return _box


# -- ports: this process's router ------------------------------------------------------------------------
class WorkerRouter:
    """How a worker reaches ports of other processes (`common/ports.py`): a worker's through its inbox, the
    controller's up this worker's reply connection."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def here(self) -> tuple[int, int] | None:
        return (self.worker.mesh_id, self.worker.rank)

    def inbox(self) -> Any:
        return mailbox().inbox.address

    def deliver(self, ref: ports.PortRef, rank: int | None, ok: bool, value: Any) -> None:
        message = protocol.PortSend(ref.port_id, ports.UNRANKED if rank is None else rank, ok)
        body = _port_body(ok, value)
        if ref.owner is None:
            self.worker.send(message, body)
            return
        box = mailbox()
        box.post(lambda: box.outbox(ref.inbox).send(message, body))

    def block(self, done: Callable[[], bool], timeout: float | None) -> None:
        if threading.get_ident() != self.worker.main_thread:
            return  # (another thread waits on the future itself)
        box = mailbox()
        if timeout is None:
            box.pump(done)
        else:
            try:
                pump_for(box, done, timeout, "a port")
            except TimeoutError:
                pass


def _port_body(ok: bool, value: Any) -> list[Any]:
    """A port message's body: the value, or the exception itself (a stand-in naming it if it cannot be
    pickled)."""
    try:
        return codec.dumps(value)
    except Exception as e:
        if ok:
            raise TypeError(f"port.send({type(value).__name__}): the value cannot be pickled: {e}") from e
        return codec.dumps(RuntimeError(f"{type(value).__qualname__}: {value}"))
