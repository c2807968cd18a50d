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
from collections.abc import Iterator
from typing import Any

from monarch.runtime.common import actors as shared
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.common.shape import Shape
from monarch.runtime.common.valuemesh import ValueMesh
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.actor_end import InboxAddress

_ids = itertools.count(1)


class ActorRef:
    """The actors named `name` on the points of `shape`; `inboxes` reaches each point's process."""

    def __init__(self, name: str, cls_name: str, endpoints: list[str], shape: Shape, inboxes: dict[int, InboxAddress]):
        self._name, self._cls_name, self._endpoints, self._shape = name, cls_name, endpoints, shape
        self._inboxes = inboxes
        self._choose_rr = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.size_dict

    extent = sizes

    def size(self, dim: str | None = None) -> int:
        return self._shape.size(dim)

    def __len__(self) -> int:
        return len(self._shape)

    def slice(self, **index: int | range | slice) -> ActorRef:
        """The actors of a slice, as `ProcMesh.slice` takes it (`slice(gpu=0)`, `slice(**point)`)."""
        return ActorRef(self._name, self._cls_name, self._endpoints, self._shape.slice(**index), self._inboxes)

    def __getattr__(self, attr: str) -> RefEndpoint:
        endpoints = self.__dict__.get("_endpoints", ())
        if attr.startswith("__") or attr not in endpoints:
            raise AttributeError(
                f"{self.__dict__.get('_cls_name', 'the actor')} has no endpoint {attr!r} (its endpoints: "
                f"{', '.join(endpoints) or 'none'}; mark a method with @endpoint to call it)"
            )
        return RefEndpoint(self, attr)

    def __reduce__(self) -> Any:
        return reference, (self._name, self._cls_name, self._endpoints, self._shape, self._inboxes)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._cls_name} on {self._shape.describe()} (a reference)>"


def reference(name: str, cls_name: str, endpoints: list[str], shape: Shape, inboxes: dict) -> ActorRef:
    """An `ActorRef` (what an `ActorMesh` pickles to)."""
    return ActorRef(name, cls_name, endpoints, shape, inboxes)


class RefEndpoint:
    """One endpoint of an actor reference; call it with an adverb."""

    def __init__(self, ref: ActorRef, name: str):
        self._ref, self._name = ref, name

    def _send(self, shape: Shape, args: tuple, kwargs: dict, answer: bool) -> RefFuture | None:
        from monarch.runtime.worker import actors

        box = actors.mailbox()
        ref = self._ref
        if answer:
            _refuse_self_call(ref, shape, self._name, box.inbox.address)
        body = codec.dumps((args, kwargs))
        future = RefFuture(f"{ref._name}.{self._name}", shape) if answer else None
        origin = box.worker.call_id

        def send() -> None:
            for i, rank in enumerate(shape.ranks):
                call_id = next(_ids) if future is not None else 0
                if future is not None:
                    box.answers[call_id] = lambda env, i=i: future._take(i, env)
                message = protocol.ActorSend(
                    call_id, ref._name, self._name, shape.names, shape.sizes, shape.ranks, origin
                )
                box.outbox(ref._inboxes[rank]).send(message, body)

        box.post(send)
        return future

    def call(self, *args: Any, **kwargs: Any) -> RefFuture:
        """Call every actor of the reference; a future of their `ValueMesh`."""
        future = self._send(self._ref._shape, args, kwargs, True)
        assert future is not None
        return future

    def call_one(self, *args: Any, **kwargs: Any) -> RefFuture:
        """Call the one actor of a reference of size 1; a future of its value."""
        shape = self._ref._shape
        if len(shape) != 1:
            raise ValueError(
                f"call_one() needs exactly one actor; {self._ref._name!r} here is {shape.describe()} "
                f"({len(shape)} actors): slice it to one point first, e.g. .slice(**point), or use call()"
            )
        return self.call(*args, **kwargs)._one()

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting for them."""
        self._send(self._ref._shape, args, kwargs, False)

    def choose(self, *args: Any, **kwargs: Any) -> RefFuture:
        """Call one actor of the reference (each in turn); a future of its value."""
        ref = self._ref
        point = ref._choose_rr % len(ref._shape)
        ref._choose_rr += 1
        future = self._send(_point(ref._shape, point), args, kwargs, True)
        assert future is not None
        return future._one()

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Call every actor; yield each one's value as it arrives."""
        shape = self._ref._shape
        futures = [self._send(_point(shape, i), args, kwargs, True) for i in range(len(shape))]
        waiting = {f._one() for f in futures if f is not None}
        from monarch.runtime.worker import actors

        box = actors.mailbox()
        while waiting:
            box.pump(lambda: any(f.done() for f in waiting))
            for f in [f for f in waiting if f.done()]:
                waiting.discard(f)
                yield f.get()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint with an adverb: {self._name}.call(...).get(), .call_one(...), .broadcast(...), "
            ".choose(...) or .stream(...)"
        )


class RefFuture:
    """The answers to one message sent through a reference: `get(timeout=)` waits (serving this process's
    inbox meanwhile), `await` it in an `async def` endpoint."""

    def __init__(self, name: str, shape: Shape):
        self._name, self._shape = name, shape
        self._envs: dict[int, codec.Envelope] = {}
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._single = False

    def _one(self) -> RefFuture:
        self._single = True
        return self

    def _take(self, i: int, env: codec.Envelope) -> None:
        with self._lock:
            self._envs[i] = env
            waiters = list(self._waiters) if self.done() else []
        for loop, f in waiters:
            loop.call_soon_threadsafe(lambda f=f: f.done() or f.set_result(None))

    def done(self) -> bool:
        return len(self._envs) == len(self._shape)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every answer; the `ValueMesh` (`call`) or the one value (`call_one`, `choose`)."""
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
                _pump_for(box, self.done, timeout, self._name)
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

    def _value(self) -> Any:
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
        if self._single:
            return values[0]
        return ValueMesh(self._shape, values)


def _pump_for(box: Any, done: Any, timeout: float, name: str) -> None:
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
        raise TimeoutError(f"{name}: no answer from every actor within {timeout} s")


def _point(shape: Shape, index: int) -> Shape:
    coords = shape.coords(index)
    return shape.slice(**{dim: range(c, c + 1) for dim, c in coords.items()})


def _refuse_self_call(ref: ActorRef, shape: Shape, endpoint: str, own: InboxAddress) -> None:
    """An actor waiting for its own answer would wait forever: it serves one message at a time."""
    current = shared.current
    if current is None or current.actor_instance.name != ref._name:
        return
    if any(ref._inboxes[r].addr == own.addr for r in shape.ranks):
        raise RuntimeError(
            f"actor {ref._name!r} calls its own endpoint {endpoint!r} and would wait for itself forever (an actor "
            f"runs one message at a time): call the method directly (self.{endpoint}(...)), use broadcast(), or "
            "slice this process out of the mesh"
        )
