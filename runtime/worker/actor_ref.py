"""An actor mesh as another actor holds it: what an `ActorMesh` becomes when it is pickled to a worker (passed
to an actor's constructor or endpoint). It slices like the mesh and has the same adverbs; its messages go
straight to the receiving workers' inboxes (`actors.py`, `wire/actor_end.py`), not through the controller.

    class Trainer(Actor):
        def __init__(self, loaders):
            self.loader = loaders.slice(**context().actor_instance.rank)

        @endpoint
        def step(self):
            batch = self.loader.next.call_one().get()   # waits; this process serves its inbox meanwhile
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from monarch.runtime.common import actors as shared
from monarch.runtime.common.endpoint import Adverbs, NotAnEndpoint, expose_endpoints
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.common.mesh_trait import MeshTrait
from monarch.runtime.common.ports import Port
from monarch.runtime.common.shape import Shape
from monarch.runtime.common.valuemesh import ValueMesh
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.actor_end import InboxAddress

_ids = itertools.count(1)


class ActorRef(MeshTrait):
    """The actors named `name` on the points of `shape`; `inboxes` reaches each point's process."""

    def __init__(
        self,
        name: str,
        cls_name: str,
        endpoints: list[str],
        shape: Shape,
        inboxes: dict[int, InboxAddress],
        methods: list[str] | None = None,
    ):
        self._name, self._cls_name, self._endpoints, self._shape = name, cls_name, endpoints, shape
        self._inboxes = inboxes
        self._methods = methods or []
        self._lock = threading.Lock()
        self._choosing: dict[int, int] = {}
        expose_endpoints(self, endpoints)

    @property
    def name(self) -> str:
        return self._name

    def _new_with_shape(self, shape: Shape) -> ActorRef:
        return ActorRef(self._name, self._cls_name, self._endpoints, shape, self._inboxes, self._methods)

    def _endpoint(self, name: str) -> RefEndpoint:
        return RefEndpoint(self, name)

    def __getattr__(self, attr: str) -> Any:
        endpoints = self.__dict__.get("_endpoints", ())
        if attr.startswith("__") or attr not in endpoints:
            if attr in self.__dict__.get("_methods", ()):
                return NotAnEndpoint(self, attr, self.__dict__.get("_cls_name", "the actor"))
            raise AttributeError(
                f"{self.__dict__.get('_cls_name', 'the actor')} has no endpoint {attr!r} (its endpoints: "
                f"{', '.join(endpoints) or 'none'}; mark a method with @endpoint to call it)"
            )
        return RefEndpoint(self, attr)

    def __reduce__(self) -> Any:
        return reference, (self._name, self._cls_name, self._endpoints, self._shape, self._inboxes, self._methods)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._cls_name} on {self._shape.describe()} (a reference)>"


def reference(
    name: str, cls_name: str, endpoints: list[str], shape: Shape, inboxes: dict, methods: list[str] | None = None
) -> ActorRef:
    """An `ActorRef` (what an `ActorMesh` pickles to)."""
    return ActorRef(name, cls_name, endpoints, shape, inboxes, methods)


class RefEndpoint(Adverbs[Any, Any]):
    """One endpoint of an actor reference; call it with an adverb (`common/endpoint.py`)."""

    def __init__(self, ref: ActorRef, name: str):
        self._ref, self._name = ref, name

    @property
    def _shape(self) -> Shape:
        return self._ref._shape

    @property
    def _what(self) -> str:
        return f"{self._ref._name}.{self._name.lstrip('~^')}"

    def _in_flight(self) -> tuple[threading.Lock, dict[int, int]]:
        return self._ref._lock, self._ref._choosing

    def _view(self, points: list[int] | None) -> Shape:
        shape = self._ref._shape
        return shape if points is None else _point(shape, points[0])

    def _call(self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RefFuture:
        future = RefFuture(self._what, self._view(points))
        self._send_to(points, args, kwargs, None, future)
        return future

    def _post(
        self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[Any] | None
    ) -> None:
        self._send_to(points, args, kwargs, port, None)

    def _send_to(
        self, points: list[int] | None, args: tuple, kwargs: dict, port: Port[Any] | None, future: RefFuture | None
    ) -> None:
        """One `ActorSend` to each actor at `points` (all: None); each names the whole view as the message's,
        so an actor's `current_rank()` is its place in the mesh, as Monarch's choose and stream give it."""
        from monarch.runtime.worker import actors

        box = actors.mailbox()
        ref = self._ref
        shape = ref._shape
        targets = (
            list(enumerate(shape.ranks)) if points is None else [(i, shape.ranks[p]) for i, p in enumerate(points)]
        )
        if future is not None:
            _refuse_self_call(ref, self._view(points), self._name, box.inbox.address)
        body = codec.dumps((args, kwargs, port))
        origin = box.worker.call_id

        def send() -> None:
            for i, rank in targets:
                call_id = next(_ids) if future is not None else 0
                if future is not None:
                    box.answers[call_id] = lambda env, i=i: future._take(i, env)
                message = protocol.ActorSend(
                    call_id, ref._name, self._name, shape.names, shape.sizes, shape.ranks, origin
                )
                box.outbox(ref._inboxes[rank]).send(message, body)

        box.post(send)


class RefFuture:
    """The answers to one message sent through a reference: `get(timeout=)` waits (serving this process's
    inbox meanwhile), `await` it in an `async def` endpoint."""

    def __init__(self, name: str, shape: Shape):
        self._name, self._shape = name, shape
        self._envs: dict[int, codec.Envelope] = {}
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._callbacks: list[Any] = []

    def _take(self, i: int, env: codec.Envelope) -> None:
        with self._lock:
            self._envs[i] = env
            done = self.done()
            waiters = list(self._waiters) if done else []
            callbacks = list(self._callbacks) if done else []
        for loop, f in waiters:
            loop.call_soon_threadsafe(lambda f=f: f.done() or f.set_result(None))
        for fn in callbacks:
            fn(self)

    def done(self) -> bool:
        return len(self._envs) == len(self._shape)

    def add_done_callback(self, fn: Any) -> None:
        """Call `fn(self)` once every answer is in (on the thread that took the last), or at once."""
        with self._lock:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    def get(self, timeout: float | None = None) -> ValueMesh[Any]:
        """Wait for every answer; their `ValueMesh` (a failure raises `RemoteError`, grouped by kind)."""
        from monarch.runtime.worker import actors

        if not self.done():
            box = actors.mailbox()
            if threading.get_ident() != box.main:
                raise RuntimeError(
                    f"{self._name}: get() waits on the process's main thread only; in an `async def` endpoint "
                    "use `await` instead"
                )
            if timeout is None:
                box.pump(self.done)
            else:
                actors.pump_for(box, self.done, timeout, self._name)
        return self._value()

    result = get

    def __await__(self) -> Any:
        if not self.done():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            with self._lock:
                if not self.done():
                    self._waiters.append((loop, waiter))
                else:
                    waiter.set_result(None)
            yield from waiter.__await__()
        return self._value()

    def _value(self) -> ValueMesh[Any]:
        values, failed = [], []
        for i, rank in enumerate(self._shape.ranks):
            env = self._envs[i]
            obj = codec.loads(env.body, env.buffers)
            label = self._shape.label(self._shape.coords(i))
            if env.message.ok:
                values.append(obj)
            else:
                failed.append((rank, label, obj if isinstance(obj, ErrorInfo) else ErrorInfo("Error", str(obj), "")))
        if failed:
            raise RemoteError(self._name, group_failures(failed), len(self._shape))
        return ValueMesh(self._shape, values)


def _point(shape: Shape, index: int) -> Shape:
    coords = shape.coords(index)
    return shape.slice(**{dim: range(c, c + 1) for dim, c in coords.items()})


def _refuse_self_call(ref: ActorRef, shape: Shape, endpoint: str, own: InboxAddress) -> None:
    """An actor waiting for its own answer would wait forever: it serves one message at a time."""
    current = shared.current()
    if current is None or current.actor_instance.name != ref._name:
        return
    if any(ref._inboxes[r].addr == own.addr for r in shape.ranks):
        raise RuntimeError(
            f"actor {ref._name!r} calls its own endpoint {endpoint!r} and would wait for itself forever (an actor "
            f"runs one message at a time): call the method directly (self.{endpoint}(...)), use broadcast(), or "
            "slice this process out of the mesh"
        )
