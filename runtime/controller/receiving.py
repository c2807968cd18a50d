"""Receiving what workers send: replies, output, displays, input requests.

A caller waiting for a call receives on its own thread (no hand-off from another thread: a wake-up
costs tens of µs), polling briefly while replies are coming and sleeping in a blocking receive
otherwise. When nobody waits, a background thread drains the socket, so that output of calls nobody
waits for (`--noblock`) still arrives. Each message goes to a handler by its type.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import select
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from monarch.runtime.common import ports
from monarch.runtime.common.errors import group_failures, placed
from monarch.runtime.common.processes import usable_cpus
from monarch.runtime.controller.output import OutputEvent
from monarch.runtime.controller.stdin import InputRequest
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.controller_end import DROPPED, POKE
from monarch.runtime.wire.hold import HOLD, MAIN

_ENDED = frozenset(("FINISHED", "CANCELLED", "CANCELLED_AND_NOTIFIED"))
"""A future's states once it ended (`_ended`)."""


def _ended(fut: concurrent.futures.Future[Any]) -> bool:
    """`fut.done()` without taking its lock (asked after each reply: the lock was 5% of a no-op call's Python).
    Reading the state alone is safe: it only ever moves forward, and `result()` takes the lock after."""
    return fut._state in _ENDED


if TYPE_CHECKING:
    from monarch.runtime.backends.base import Replies
    from monarch.runtime.controller.core import Controller
    from monarch.runtime.controller.state import PendingCall, SpawnedMesh

RX_HANDBACK = 0.01
"""Seconds after a waiting caller returns before the background thread receives again (output that
arrives between calls, e.g. from a non-blocking call, is delayed at most this long)."""
RX_LOOK_AGAIN = 0.05
"""Seconds the background thread sleeps on the socket's notification fd before it looks anyway: that fd
is edge-triggered and shared with callers that receive for themselves, whose waits can consume an edge
meant for it (seen: an interrupted call's replies, and every reply after them, left unread)."""


CAST_FAILED: Callable[[SpawnedMesh, int, str, str, protocol.ErrorInfo], None] | None = None
"""Takes a failed `broadcast()` (mesh, rank, actor, endpoint, error): set by `monarch.runtime.actors`, a layer
above, which hands it to the actor mesh's owner."""


class Receiver:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.replies: Replies = controller.backend.replies
        self.spin = controller.settings.spin
        self.cpus = usable_cpus()
        """CPUs this process may run on: a caller polls only while the workers it waits for leave one free."""
        self._rx_lock = self.replies.recv_lock  # held by the one thread that receives (an RLock: see wait())
        self._rx_count_lock = threading.Lock()
        self._rx_waiters = 0  # callers receiving for themselves in wait()
        self._main_receiving = False
        self.polls = 0
        """How many times a waiting caller polled for replies before sleeping (for tests: polling happens
        only while replies are coming)."""
        self._handlers: dict[type[Any], Callable[[codec.Envelope], bool | None]] = {
            protocol.Reply: controller.calls.reply,
            protocol.Output: self._on_output,
            protocol.Display: self._on_display,
            protocol.AskInput: self._on_input,
            protocol.Released: controller.calls.released,
            protocol.Busy: controller.calls.busy_report,
            protocol.Stacks: controller.watchdogs.took_stacks,
            protocol.CastFailed: self._on_cast_failed,
            protocol.PortSend: self._on_port_send,
            protocol.Bundle: self._on_bundle,
        }
        self.taps: list[Callable[[OutputEvent], None]] = []
        """Also given every output event, after its sink (the script debugger shows its ranks' output)."""
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._io = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._io.start()

    # -- waiting for a call ------------------------------------------------------------------------
    def wait(
        self, pending: PendingCall, timeout: float | None = None, until: concurrent.futures.Future[Any] | None = None
    ) -> Any:
        """Wait for a call's replies, receiving them on this thread; serve input requests meanwhile. With
        `until`, wait for that future instead (one that ends with the call or before it: a point's reply)."""
        fut = pending.future if until is None else until
        deadline = None if timeout is None else time.monotonic() + timeout
        polling = self._polling_pays(pending)
        spin = polling  # poll first; after a quiet stretch, just sleep
        counted = False
        HOLD.install()  # (over Python's default handler only) Ctrl-C is held while a reply is handled
        stdin = self.controller.stdin
        try:
            with self._rx_count_lock:
                self._rx_waiters += 1
                counted = True  # no call between these two lines: Ctrl-C cannot fall between them
            while not _ended(fut):
                if stdin.queue and stdin.serve(self):
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
                    spin = self._receive_until(fut, left, spin, polling) and polling
                finally:
                    self._rx_lock.release()
        finally:
            if self._rx_lock._is_owned():  # type: ignore[attr-defined]  # Ctrl-C right after acquire(), before its try: still ours
                self._rx_lock.release()
            if counted:
                with self._rx_count_lock:
                    self._rx_waiters -= 1  # the background thread receives again within RX_HANDBACK
        return fut.result(0)

    def _polling_pays(self, pending: PendingCall) -> bool:
        """Whether to poll for `pending`'s replies before sleeping. Polling saves the wake-up of a sleeping
        thread only when the workers it waits for have CPUs of their own beside the poller: 8 workers on 2
        cores need both, and a poller there takes CPU from the very workers it waits for (a no-op call on
        8 workers was 10-15% slower polling; `benchmarks/RESULTS.md`)."""
        if not self.spin:
            return False
        mesh = pending.mesh
        return mesh.backend.workers_here(mesh.mesh_id, pending.ranks) < self.cpus

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """While a waiting caller serves a prompt, the background thread receives (other ranks' output)."""
        with self._rx_count_lock:
            self._rx_waiters -= 1
        self.wake()
        try:
            yield
        finally:
            with self._rx_count_lock:
                self._rx_waiters += 1

    def _receive_until(
        self, fut: concurrent.futures.Future[dict[int, codec.Envelope]], timeout: float, spin: bool, polling: bool
    ) -> bool:
        """Handle replies as they come until `fut` is done, `timeout` passes with nothing received, or a
        worker asks for input (the caller serves it). With `spin`, poll for `self.spin` seconds before the
        first sleep; with `polling`, again after each reply (replies come in bursts). False when the time
        ran out.

        On the main thread Ctrl-C is held while a message is handled (one landing between taking a
        reply off the socket and recording it would lose the reply), and raised right after."""
        held = threading.get_ident() == MAIN and HOLD.enter()
        try:
            return self._receive_messages(fut, timeout, spin, polling)
        finally:
            if held:
                HOLD.leave()

    def _receive_messages(
        self, fut: concurrent.futures.Future[dict[int, codec.Envelope]], timeout: float, spin: bool, polling: bool
    ) -> bool:
        replies = self.replies
        replies.set_timeout(max(1, int(timeout * 1000)))
        recv, on_reply, reply = replies.recv, self.controller.calls.reply, protocol.Reply
        while fut._state not in _ENDED and not HOLD.pending:  # (`_ended`, inline: asked after each message)
            got = None
            if spin:
                self.polls += 1
                got = replies.poll_briefly(self.spin)
            if got is None:
                got = recv(True)
                if got is None:
                    return False
            if got is POKE or got is DROPPED:  # a poke: look at our call again
                continue
            spin = polling  # replies come in bursts: poll for the next one
            if type(got.message) is reply:  # (the common message: `handle`'s table, one call fewer)
                on_reply(got)
            elif self.handle(got):
                return True
        return True

    # -- the background thread ---------------------------------------------------------------------
    def _drain(self) -> None:
        """Handle everything received so far (also re-arms the socket's notification fd)."""
        while True:
            got = self.replies.recv(False)
            if got is None:
                return
            if got is not POKE and got is not DROPPED:  # (a poke for a waiting caller that already left)
                self.handle(got)

    def _io_loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        with self._rx_lock:
            reply_fd = self.replies.reply_fd
        watching = False
        while not self._closed:
            try:
                # While a caller in wait() receives for itself, leave it the socket.
                mine = self._rx_waiters == 0 and self._rx_lock.acquire(blocking=False)
                if mine:
                    try:
                        self._drain()  # until empty, so the socket's notification fd is re-armed
                    finally:
                        self._rx_lock.release()
                if mine != watching:
                    poller.register(reply_fd, select.POLLIN) if mine else poller.unregister(reply_fd)
                    watching = mine
                # Not receiving: a caller in wait() is. It does not wake us when it returns (that would
                # cost a wake-up per call); we look again after RX_HANDBACK instead.
                for fd, _ in poller.poll((RX_LOOK_AGAIN if mine else RX_HANDBACK) * 1000):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
            except Exception:
                if self._closed:
                    return
                print("monarch: internal error in the receiving thread:", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # already full of wake-ups

    def close(self) -> None:
        self._closed = True
        self.wake()
        self._io.join(2)

    # -- handlers ----------------------------------------------------------------------------------
    def handle(self, env: codec.Envelope) -> bool:
        """Act on one message; True if it asks for input (a waiting caller should serve it)."""
        handler = self._handlers.get(type(env.message))
        if handler is None:
            self.replies.log("a message", f"{type(env.message).__name__} is not something workers send up")
            return False
        return handler(env) is True

    def show_early_errors(self, pending: PendingCall) -> None:
        """Show the tracebacks of ranks that failed while the call goes on (a timer thread), grouped as the
        call's error groups them: each distinct one once, with its ranks, in its first rank's place; the
        other ranks' places name the error and where it is shown."""
        errors = self.controller.calls.take_early_errors(pending)
        labels = pending.mesh.labels
        pending.errors_shown.update(env.rank for env, _ in errors)
        failures = group_failures([(env.rank, labels[env.rank], info) for env, info in errors])
        for rank, text in placed([(f, None) for f in failures]):
            self.notice(pending, rank, text, "error")

    def notice(self, pending: PendingCall, rank: int, text: str, stream: str = "stderr") -> None:
        """Show a line of the runtime's about `pending` where its output goes, in `rank`'s place."""
        mesh = pending.mesh
        event = OutputEvent(pending.call_id, mesh.mesh_id, rank, mesh.labels[rank], stream, text)
        self._deliver(pending, event, as_is=True)

    def _event(
        self,
        env: codec.Envelope,
        stream: str,
        text: str,
        data: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        c = self.controller
        mesh = c.meshes.get(env.mesh_id)
        label = mesh.labels[env.rank] if mesh is not None else f"rank={env.rank}"
        call_id = env.message.call_id
        pending = c.calls.get(call_id) if call_id is not None else None
        self._deliver(pending, OutputEvent(call_id, env.mesh_id, env.rank, label, stream, text, data, metadata))

    def sink(self, pending: PendingCall | None) -> Callable[[OutputEvent], None]:
        """The call's own output (a cell's areas) if it has one, else the controller's."""
        return pending.output if pending is not None and pending.output is not None else self.controller.output

    def _deliver(self, pending: PendingCall | None, event: OutputEvent, as_is: bool = False) -> None:
        """To the call's own output (a cell's areas) if it has one, else the controller's; through the mesh's
        logging options if it has any (`ProcMesh.logging_option`: `as_is`, a line of the runtime's, is never
        collapsed)."""
        sink = self.sink(pending)
        mesh = self.controller.meshes.get(event.mesh_id)
        logs = mesh.logs if mesh is not None else None
        try:
            if logs is None:
                sink(event)
            else:
                logs.deliver(sink, event, pending, as_is)
        except Exception:
            traceback.print_exc(file=sys.__stderr__)
        for tap in self.taps:
            try:
                tap(event)
            except Exception:
                traceback.print_exc(file=sys.__stderr__)

    def _on_cast_failed(self, env: codec.Envelope) -> None:
        """A `broadcast()` to actors raised on a worker: to the actors' layer (`CAST_FAILED`), which tells the
        actor mesh's owner; never user code on this thread."""
        mesh = self.controller.meshes.get(env.mesh_id)
        if mesh is None or CAST_FAILED is None:
            return
        try:
            info = codec.loads(env.body, env.buffers)
        except Exception as e:
            info = protocol.ErrorInfo(type(e).__qualname__, f"its error cannot be unpickled here: {e}", "")
        CAST_FAILED(mesh, env.rank, env.message.actor, env.message.endpoint, info)

    def _on_port_send(self, env: codec.Envelope) -> None:
        """A worker sent a message to a port of this process (`common/ports.py`): hand it to the port's
        receiving end (a `PortReceiver`'s queue, a local actor's answer), never user code on this thread."""
        msg = env.message
        try:
            ok, value = msg.ok, codec.loads(env.body, env.buffers)
        except Exception as e:
            ok, value = False, RuntimeError(f"a message to a port could not be unpickled here: {type(e).__name__}: {e}")
        ports.take(msg.port_id, msg.rank, ok, value)

    def _on_bundle(self, env: codec.Envelope) -> None:
        """A host's messages to one mesh, bundled by its agent (checked by the transport, `wire/fanin.py`): a reply's
        ranks at once (`Calls.reply_group`); anything else to its handler once per rank (a line in each rank's
        place, each rank's report)."""
        on_reply, handlers = self.controller.calls.reply_group, self._handlers
        for ranks, message, body in env.message.items:
            if type(message) is protocol.Reply:
                on_reply(codec.Envelope(env.mesh_id, ranks[0], env.seq, message, body, []), ranks)
                continue
            handler = handlers[type(message)]
            for rank in ranks:
                handler(codec.Envelope(env.mesh_id, rank, env.seq, message, body, []))

    def _on_output(self, env: codec.Envelope) -> None:
        self._event(env, env.message.stream, env.message.text)

    def _on_display(self, env: codec.Envelope) -> None:
        self._event(env, "display", "", env.message.data, env.message.metadata)

    def _on_input(self, env: codec.Envelope) -> bool:
        msg = env.message
        mesh = self.controller.meshes.get(env.mesh_id)
        if mesh is None:
            return False
        label = mesh.labels[env.rank]
        if mesh.logs is not None:  # what the ranks wrote before the prompt, shown first
            mesh.logs.let_go()
        self.controller.stdin.on_request(
            InputRequest(
                mesh, env.rank, label, msg.call_id, msg.req_id, msg.prompt, msg.password, msg.debugger, msg.where
            )
        )
        return True
