"""The actors living in this worker process: made and called through functions the controller calls by name
(`monarch.runtime.actors`), and called by other actors through this process's inbox (`wire/actor_end.py`).

One thread serves them all, the worker's main thread: controller calls and inbox messages alike, each run to
its end, so what one sender sends an actor runs in the order sent. While an endpoint waits for another actor's
answer (`actor_ref.py`), this thread goes on serving the inbox, so actors that call each other back do not
deadlock. An `async def` endpoint runs on this process's event loop (a thread of its own) while this thread
serves; what that thread sends goes through this one (ZeroMQ sockets belong to one thread).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import zmq

from monarch.runtime.common import actors as shared
from monarch.runtime.common import context
from monarch.runtime.common.shape import Shape
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.actor_end import Inbox, InboxAddress, Outbox
from monarch.runtime.worker.describe import describe

_actors: dict[str, tuple[Any, shared.ActorInstance]] = {}
host: Any = None
"""This process's `worker.Worker` (it sets itself here as it starts: this module never imports it)."""
_loop: asyncio.AbstractEventLoop | None = None


def spawn(name: str, cls: type, args: tuple, kwargs: dict) -> InboxAddress:
    """Construct this process's actor `name`; the address of this process's inbox (for actor references)."""
    if name in _actors:
        raise ValueError(f"an actor named {name!r} already runs on this process (spawn it under another name)")
    box = mailbox()
    instance = shared.ActorInstance(name, context.current_rank())
    token = _enter(instance, context.current_rank())
    try:
        _actors[name] = (cls(*args, **kwargs), instance)
    finally:
        shared.current = token
    return box.inbox.address


def invoke(name: str, endpoint: str, args: tuple, kwargs: dict, message_rank: dict[str, int] | None = None) -> Any:
    """Run endpoint `endpoint` of actor `name` (its result, awaited if it is a coroutine)."""
    got = _actors.get(name)
    if got is None:
        raise RuntimeError(f"no actor named {name!r} on this process (it was stopped, or its spawn failed here)")
    actor, instance = got
    method = getattr(actor, endpoint, None)
    if method is None or not getattr(method, shared.ENDPOINT, False):
        raise AttributeError(f"{type(actor).__name__} has no endpoint {endpoint!r}")
    token = _enter(instance, context.current_rank() if message_rank is None else message_rank)
    try:
        result = method(*args, **kwargs)
        if inspect.isawaitable(result):
            result = _await(result)
        return result
    finally:
        shared.current = token


def cast(
    actor: str, endpoint: str, names: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...], arguments: bytes
) -> tuple[bool, Any]:
    """Run one `broadcast()`'s endpoint here: (True, its result) or (False, the exception)."""
    worker = host
    rank = _message_rank(names, sizes, ranks)
    try:
        args, kwargs = codec.loads(arguments)
        if worker is not None:
            worker.in_user_code = True
        return True, invoke(actor, endpoint, args, kwargs, rank)
    except BaseException as e:  # (Ctrl-C too: it ends this message, not the worker)
        return False, e
    finally:
        if worker is not None:
            worker.in_user_code = False


_views: dict[tuple, tuple[dict[str, int], dict[str, int]]] = {}


def _message_rank(names: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...]) -> dict[str, int]:
    """This process's coordinates in the view a message was sent to (and, on the side, sets it as the
    current view, for `current_rank()`)."""
    key = (names, sizes, ranks)
    got = _views.get(key)
    if got is None:
        view = Shape(names, sizes, ranks)
        got = (view.coords(ranks.index(context.worker.rank)), view.size_dict)
        if len(_views) < 1024:
            _views[key] = got
    context.view = context.CallView(dict(got[0]), dict(got[1]))
    return dict(got[0])


def stop(name: str) -> bool:
    """Forget actor `name` (its object goes when nothing else holds it); whether there was one."""
    return _actors.pop(name, None) is not None


def running() -> list[tuple[str, str]]:
    """(name, class name) of each actor on this process."""
    return [(name, type(actor).__name__) for name, (actor, _) in _actors.items()]


def _enter(instance: shared.ActorInstance, message_rank: dict[str, int]) -> shared.Context | None:
    before = shared.current
    shared.current = shared.Context(instance, message_rank)
    return before


def _await(awaitable: Any) -> Any:
    """Run `awaitable` on this process's event loop and wait for it, serving the inbox meanwhile; Ctrl-C (the
    call interrupted) cancels it."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="monarch-actors-loop", daemon=True).start()

    async def run() -> Any:
        return await awaitable

    future = asyncio.run_coroutine_threadsafe(run(), _loop)
    box = mailbox()
    future.add_done_callback(lambda _: box.wake())
    try:
        box.pump(future.done)
        return future.result()
    except KeyboardInterrupt:
        future.cancel()
        raise


def loop() -> asyncio.AbstractEventLoop | None:
    """The actors' event loop, once an `async def` endpoint ran."""
    return _loop


# -- the mailbox: this process's inbox and its outboxes -------------------------------------------------
class Mailbox:
    """This process's inbox (other actors' messages to ours) and outboxes (ours to theirs), all used by the
    main thread only; other threads hand it what to send (`post`)."""

    def __init__(self) -> None:
        self.worker = host
        assert self.worker is not None, "actors run on a worker"
        self.main = threading.get_ident()
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
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._socks: dict[Any, Outbox] = {}
        self.worker.side_poll = self.serve_until_command

    # -- sending ----------------------------------------------------------------------------------
    def outbox(self, to: InboxAddress) -> Outbox:
        box = self.outboxes.get(to.addr)
        if box is None:
            box = self.outboxes[to.addr] = Outbox(self.ctx, to, self.me)
            self._socks[box.sock] = box
            self.poller.register(box.sock, zmq.POLLIN)
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

    def serve_until_command(self, cmd: zmq.Socket) -> None:
        """The worker's idle wait: serve the inbox until a command from the controller is ready."""
        self.poller.register(cmd, zmq.POLLIN)
        try:
            while not self._step(cmd):
                pass
        finally:
            self.poller.unregister(cmd)

    def _step(self, cmd: zmq.Socket | None) -> bool:
        """One wait and what it brought; whether `cmd` is ready."""
        events = dict(self.poller.poll())
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        while self.posted:
            self.posted.popleft()()
        for sock in events:
            box = self._socks.get(sock)
            if box is not None:
                self._take_answers(box)
        if self.inbox.sock in events:
            self._serve_inbox()
        return cmd is not None and cmd in events

    def _take_answers(self, box: Outbox) -> None:
        while box.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            env = box.recv()
            if env is not None:
                take = self.answers.pop(env.message.call_id, None)
                if take is not None:
                    take(env)

    def _serve_inbox(self) -> None:
        sock = self.inbox.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            got = self.inbox.recv()
            if got is not None:
                self._serve(*got)

    def _serve(self, identity: bytes, env: codec.Envelope) -> None:
        """Run one actor message here, as a call of the controller's would run (its output goes to the call
        the sender was serving), and answer it."""
        msg: protocol.ActorSend = env.message
        worker = self.worker
        before = (worker.call_id, worker.in_user_code, context.view)
        worker.call_id = msg.origin
        rank = _message_rank(msg.names, msg.sizes, msg.ranks)
        ok = True
        try:
            args, kwargs = codec.loads(env.body, env.buffers)
            worker.in_user_code = True
            value = invoke(msg.actor, msg.endpoint, args, kwargs, rank)
        except BaseException as e:  # (Ctrl-C too: the sender waits for an answer)
            ok, value = False, describe(e)
        finally:
            worker.in_user_code = False
        if msg.call_id:
            try:
                body = codec.dumps(value)
            except Exception as e:
                ok, body = False, codec.dumps(describe(e, f"the result ({type(value).__name__}) cannot be pickled: "))
            worker.output.flush()
            self.inbox.answer(identity, protocol.ActorAnswer(msg.call_id, ok), body)
        else:
            worker.output.flush()
            if not ok:
                print(
                    f"monarch: {msg.actor}.{msg.endpoint} (a broadcast from another actor) failed:\n"
                    f"{value.traceback or value.exc_type + ': ' + value.message}",
                    file=sys.stderr,
                )
        worker.call_id, worker.in_user_code, context.view = before


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
