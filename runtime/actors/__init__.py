"""Actor meshes, the controller's side: `procs.spawn(name, cls, *args)` and the endpoints' adverbs.

    class Counter(Actor):
        def __init__(self, start):
            self.n = start

        @endpoint
        def incr(self, by=1):
            self.n += by
            return self.n

    counters = procs.spawn("counters", Counter, 0)     # one Counter per process of `procs`
    counters.incr.call(2).get()                        # a ValueMesh: 2 on every process
    counters.slice(gpu=0).incr.call_one().get()        # exactly one actor: its value
    counters.incr.broadcast()                          # no reply; a failure goes to the mesh's supervisor
    counters.incr.choose().get()                       # one actor, the least busy
    for value in counters.incr.stream(): ...           # each actor's value as it comes

An endpoint call is a live-function call by name of the workers' `monarch.runtime.worker.actors.invoke`: it
rides the same signed transport, and its output, errors (grouped by kind, with their ranks), interrupts and
debugger are a live function's.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from monarch.runtime import mesh as _mesh
from monarch.runtime.actors import supervision
from monarch.runtime.actors.supervision import MeshFailure
from monarch.runtime.common.actors import Actor, endpoints_of
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.values import Future, ValueMesh
from monarch.runtime.wire import codec

if TYPE_CHECKING:
    from monarch.runtime.controller import SpawnedMesh

WORKER = "monarch.runtime.worker.actors"
REF = "monarch.runtime.worker.actor_ref"


class ActorMesh:
    """The actors named `name` on the processes of a proc mesh view; slices like one. Get an endpoint as an
    attribute (`actors.step`) and call it with an adverb: `call`, `call_one`, `broadcast`, `choose`, `stream`."""

    def __init__(self, procs: ProcMesh, name: str, cls: type, endpoints: list[str], inboxes: dict[int, Any]):
        self._procs, self._name, self._cls, self._endpoints = procs, name, cls, endpoints
        self._inboxes = inboxes
        """Global rank -> its process's inbox (`wire.actor_end.InboxAddress`), for references sent to actors."""
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}
        """Per point of this view (its index), `choose` calls not answered yet."""

    @property
    def name(self) -> str:
        return self._name

    @property
    def procs(self) -> ProcMesh:
        """The proc mesh view these actors run on."""
        return self._procs

    @property
    def sizes(self) -> dict[str, int]:
        return self._procs.sizes

    extent = property(lambda self: self._procs.extent, doc="`{dimension: size}`, as Monarch prints it.")

    def size(self, dim: str | None = None) -> int:
        return self._procs.size(dim)

    def __len__(self) -> int:
        return len(self._procs)

    def slice(self, **index: int | range | slice) -> ActorMesh:
        """The actors of a slice of the mesh, as `ProcMesh.slice` takes it (`slice(gpu=0)`, `slice(**point)`)."""
        return ActorMesh(self._procs.slice(**index), self._name, self._cls, self._endpoints, self._inboxes)

    def __getattr__(self, attr: str) -> ActorEndpoint:
        if attr.startswith("__") or attr not in self.__dict__.get("_endpoints", ()):
            endpoints = ", ".join(self.__dict__.get("_endpoints", ())) or "none"
            cls = self.__dict__.get("_cls")
            raise AttributeError(
                f"{getattr(cls, '__name__', 'the actor')} has no endpoint {attr!r} (its endpoints: {endpoints}; "
                "mark a method with @endpoint to call it)"
            )
        return ActorEndpoint(self, attr)

    def stop(self) -> None:
        """Stop these actors (each process forgets its object); the processes keep running."""
        procs = self._procs
        _worker_fn("stop", procs).start((self._name,), {}, name=f"{self._name}.stop").result()
        known = procs.spawned.actors
        if self._name in known:
            cls, ranks = known[self._name]
            left = ranks - frozenset(procs._shape.ranks)
            if left:
                known[self._name] = (cls, left)
            else:
                del known[self._name]

    def owner(self) -> supervision.Owner | None:
        """Who is told of this actor mesh's failures (`monarch.runtime.actors.supervision`)."""
        return self._procs.spawned.owners.get(self._name)

    def __reduce__(self) -> Any:
        """Sent to a worker (an actor's constructor or endpoint argument), an actor mesh becomes a reference
        whose messages go straight to these actors' processes (`worker/actor_ref.py`, named here as data:
        controller code never imports worker code)."""
        shape = self._procs._shape
        inboxes = {rank: self._inboxes[rank] for rank in shape.ranks}
        args = (self._name, self._cls.__name__, self._endpoints, shape, inboxes)
        return codec.call_function, (REF, "reference", *args)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._cls.__name__} on {self._procs.describe()}>"


class ActorEndpoint:
    """One endpoint of an actor mesh; call it with an adverb."""

    def __init__(self, actors: ActorMesh, name: str):
        self._actors, self._name = actors, name

    def _start(self, procs: ProcMesh, args: tuple, kwargs: dict) -> Future:
        a = self._actors
        fn = _worker_fn("invoke", procs)
        return fn.start((a._name, self._name, args, kwargs), {}, name=f"{a._name}.{self._name}")

    def call(self, *args: Any, **kwargs: Any) -> Future:
        """Call every actor of the mesh; a `Future` of their `ValueMesh` (`.get()`, or `await` it)."""
        return self._start(self._actors._procs, args, kwargs)

    def call_one(self, *args: Any, **kwargs: Any) -> OneFuture:
        """Call the one actor of a mesh of size 1 (a slice to one point); a future of its value."""
        procs = self._actors._procs
        if len(procs) != 1:
            raise ValueError(
                f"call_one() needs exactly one actor; {self._actors._name!r} here is {procs.describe()} "
                f"({len(procs)} actors): slice it to one point first, e.g. .slice(**point), or use call()"
            )
        return OneFuture(self._start(procs, args, kwargs))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting; a failure becomes a `MeshFailure` for the actor mesh's owner
        (its `__supervise__`, else `unhandled_fault_hook`), never raised here.

        No call is tracked: it is queued with the broadcasts made about then (`controller/casts.py`), which go
        down the command connection as one signed `Cast` (before anything else sent to the mesh, so it keeps
        its place among the calls); only a failure comes back (`CastFailed`). Ranks already lost are skipped
        (their death was reported)."""
        a = self._actors
        spawned, shape = a._procs.spawned, a._procs._shape
        spawned.check_usable()
        ranks = shape.ranks if not spawned.lost else tuple(r for r in shape.ranks if r not in spawned.lost)
        if not _cast_failures.registered:
            _cast_failures.register()
        if ranks:
            arguments = _NO_ARGS if not args and not kwargs else codec.dumps_whole((args, kwargs))
            item = (a._name, self._name, shape.names, shape.sizes, shape.ranks, arguments)
            spawned.controller.cast(spawned, ranks, item)

    def choose(self, *args: Any, **kwargs: Any) -> OneFuture:
        """Call one actor of the mesh, the one with the fewest `choose` calls in flight; a future of its value."""
        a = self._actors
        with a._lock:
            point = min(_live_points(a._procs), key=lambda i: (a._in_flight.get(i, 0), i))
            a._in_flight[point] = a._in_flight.get(point, 0) + 1
        future = self._start(_point(a._procs, point), args, kwargs)

        def done(_: Future) -> None:
            with a._lock:
                a._in_flight[point] -= 1

        future.add_done_callback(done)
        return OneFuture(future)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Call every actor; yield each one's value as it arrives (a failure raises when it comes)."""
        procs = self._actors._procs
        futures = [self._start(_point(procs, i), args, kwargs) for i in range(len(procs))]
        waiting: dict[concurrent.futures.Future, Future] = {}
        for f in futures:
            done: concurrent.futures.Future = concurrent.futures.Future()
            f.add_done_callback(lambda _, d=done: d.set_result(None))
            waiting[done] = f
        for done in concurrent.futures.as_completed(waiting):
            yield OneFuture(waiting[done]).get()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint with an adverb: {self._name}.call(...).get(), .call_one(...), .broadcast(...), "
            ".choose(...) or .stream(...)"
        )


class OneFuture:
    """The future of one actor's answer (`call_one`, `choose`): `get()` gives the value, not a `ValueMesh`."""

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def get(self, timeout: float | None = None) -> Any:
        return _only(self._future.result(timeout))

    result = get

    def __await__(self):
        return (yield from self._await().__await__())

    async def _await(self) -> Any:
        return _only(await self._future)


def _worker_fn(name: str, procs: ProcMesh) -> Any:
    """The workers' `monarch.runtime.worker.actors.<name>`, as a live function on `procs` (imported here, not at
    the top: `import monarch.actor` must not import zmq or torch)."""
    from monarch.runtime.remote import RemoteFunction

    return RemoteFunction.by_name(WORKER, name, procs)


def _only(values: ValueMesh) -> Any:
    (value,) = values.values()
    return value


def _live_points(procs: ProcMesh) -> list[int]:
    """The points of `procs` (their indices) whose process is alive, so that `choose` skips a dead one (all of
    them when every one is dead: the call then says how they died)."""
    spawned = getattr(procs, "spawned", None)  # (a this_proc() mesh has none, and never loses its process)
    lost = spawned.lost if spawned is not None else {}
    live = [i for i, rank in enumerate(procs._shape.ranks) if rank not in lost]
    return live or list(range(len(procs)))


def _point(procs: ProcMesh, index: int) -> ProcMesh:
    """The view of `procs`'s point `index` (its dimensions kept, each of size 1)."""
    coords = procs._shape.coords(index)
    return procs.slice(**{dim: range(c, c + 1) for dim, c in coords.items()})


_NO_ARGS = codec.dumps_whole(((), {}))


class _CastFailures:
    """Failed broadcasts, as workers report them (`CastFailed`, on the receiving thread): those of one
    broadcast's ranks, arriving within `WINDOW` seconds, become one `MeshFailure` (its error grouped by kind
    with its ranks, as a call's are) for the actor mesh's owner."""

    WINDOW = 0.05

    def __init__(self) -> None:
        self.registered = False
        self._lock = threading.Lock()
        self._held: dict[tuple[int, str, str], list[tuple[int, str, ErrorInfo]]] = {}

    def register(self) -> None:
        """Have the controller's receiving thread hand us failed broadcasts (at the first broadcast: importing
        the controller here would make `import monarch.actor` import zmq)."""
        from monarch.runtime.controller import receiving

        receiving.CAST_FAILED = self
        self.registered = True

    def __call__(self, spawned: SpawnedMesh, rank: int, actor: str, endpoint: str, info: ErrorInfo) -> None:
        key = (spawned.mesh_id, actor, endpoint)
        with self._lock:
            held = self._held.setdefault(key, [])
            held.append((rank, spawned.labels[rank], info))
            if len(held) > 1:
                return
        timer = threading.Timer(self.WINDOW, self._deliver, (spawned, key))
        timer.daemon = True
        timer.start()

    def _deliver(self, spawned: SpawnedMesh, key: tuple[int, str, str]) -> None:
        with self._lock:
            raw = self._held.pop(key, [])
        _, actor, endpoint = key
        cls_name, ranks = spawned.actors.get(actor, ("", frozenset()))
        error = RemoteError(f"{actor}.{endpoint}", group_failures(raw), len(ranks) or len(raw))
        failure = supervision.endpoint_failed(actor, cls_name, spawned.shape.describe(), endpoint, error)
        supervision.deliver(failure, spawned.owners.get(actor))


_cast_failures = _CastFailures()


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """What happens to a `MeshFailure` that no owner handled (a process under an actor mesh died, a broadcast's
    endpoint raised): in a notebook it is shown in the cell that spawned the actor mesh (or the one running),
    else printed on stderr; the process goes on. Replace it on `monarch.actor` to handle them yourself:
    ``monarch.actor.unhandled_fault_hook = my_hook``."""
    supervision.default_hook(failure)


def check_spawn(name: Any, cls: Any) -> None:
    """Refuse a spawn's bad name or class (before anything starts)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"spawn(name={name!r}, ...): give the actors a name (a non-empty string)")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn({name!r}, {cls!r}): the class must subclass monarch.actor.Actor")


def spawn(procs: ProcMesh, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
    """`ProcMesh.spawn`: construct `cls(*args, **kwargs)` on every process of `procs` (waits: a constructor's
    error raises here, with its ranks)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"spawn(name={name!r}, ...): give the actors a name (a non-empty string)")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn({name!r}, {cls!r}): the class must subclass monarch.actor.Actor")
    spawning = _worker_fn("spawn", procs).start((name, cls, args, kwargs), {}, name=f"{name}.__init__", sources_of=cls)
    inboxes = spawning.result()
    known = procs.spawned.actors
    _, ranks = known.get(name, ("", frozenset()))
    known[name] = (cls.__name__, ranks | frozenset(procs._shape.ranks))
    supervision.adopt(procs.spawned, name, supervision.owner_here())
    return ActorMesh(procs, name, cls, endpoints_of(cls), dict(zip(procs._shape.ranks, inboxes, strict=True)))


_mesh.ACTORS = spawn
