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
    for f in counters.incr.stream(): f.get()           # each actor's answer as it comes

An endpoint call is a live-function call by name of the workers' `monarch.runtime.worker.actors.invoke`: it
rides the same signed transport, and its output, errors (grouped by kind, with their ranks), interrupts and
debugger are a live function's. The adverbs themselves are declared once, for every kind of endpoint, in
`common/endpoint.py`.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

from monarch.runtime import mesh as _mesh
from monarch.runtime.actors import ports as _ports  # noqa: F401  (installs the controller's port router)
from monarch.runtime.actors import supervision
from monarch.runtime.actors.supervision import MeshFailure
from monarch.runtime.common.actors import Actor, endpoints_of, methods_of
from monarch.runtime.common.endpoint import Adverbs, NotAnEndpoint, One, Stream, expose_endpoints
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.common.mesh_trait import MeshTrait
from monarch.runtime.common.ports import Port
from monarch.runtime.common.shape import Shape
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.values import Done, Future
from monarch.runtime.wire import codec

if TYPE_CHECKING:
    from monarch.runtime.controller import SpawnedMesh

WORKER = "monarch.runtime.worker.actors"
REF = "monarch.runtime.worker.actor_ref"

OneFuture = One
"""The future of one actor's answer (`call_one`, `choose`): `get()` gives its value."""


class ActorMesh(MeshTrait):
    """The actors named `name` on the processes of a proc mesh view; slices like one. Get an endpoint as an
    attribute (`actors.step`) and call it with an adverb: `call`, `call_one`, `broadcast`, `choose`, `stream`
    (or `send(actors.step, args, kwargs, port=...)`)."""

    def __init__(self, procs: ProcMesh, name: str, cls: type, endpoints: list[str], inboxes: dict[int, Any]):
        self._procs, self._name, self._cls, self._endpoints = procs, name, cls, endpoints
        self._inboxes = inboxes
        """Global rank -> its process's inbox (`wire.actor_end.InboxAddress`), for references sent to actors."""
        self._lock = threading.Lock()
        self._choosing: dict[int, int] = {}
        """Per point of this view (its index), `choose` calls not answered yet."""
        expose_endpoints(self, endpoints)

    @property
    def _shape(self) -> Shape:  # type: ignore[override]
        return self._procs._shape

    def _new_with_shape(self, shape: Shape) -> ActorMesh:
        procs = self._procs._new_with_shape(shape)
        return ActorMesh(procs, self._name, self._cls, self._endpoints, self._inboxes)

    @property
    def name(self) -> str:
        return self._name

    @property
    def procs(self) -> ProcMesh:
        """The proc mesh view these actors run on."""
        return self._procs

    @property
    def initialized(self) -> Done[None]:
        """A future that is done once every actor is constructed (already: `spawn` waits)."""
        return Done(None)

    def _endpoint(self, name: str) -> ActorEndpoint:
        return ActorEndpoint(self, name)

    def __getattr__(self, attr: str) -> Any:
        endpoints = self.__dict__.get("_endpoints", ())
        if attr.startswith("__") or attr not in endpoints:
            cls = self.__dict__.get("_cls")
            if cls is not None and not attr.startswith("_") and attr in methods_of(cls):
                return NotAnEndpoint(self, attr, cls.__name__)
            raise AttributeError(
                f"{getattr(cls, '__name__', 'the actor')} has no endpoint {attr!r} (its endpoints: "
                f"{', '.join(endpoints) or 'none'}; mark a method with @endpoint to call it)"
            )
        return self._endpoint(attr)

    def stop(self, reason: str = "stopped by client") -> Done[None]:
        """Stop these actors: each process cancels their concurrent calls, runs their `__cleanup__(None)` and
        forgets them; the processes keep running. Waits; returns a done future (`.get()`, `await`)."""
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
        return Done(None)

    def owner(self) -> supervision.Owner | None:
        """Who is told of this actor mesh's failures (`monarch.runtime.actors.supervision`)."""
        return self._procs.spawned.owners.get(self._name)

    def __reduce__(self) -> Any:
        """Sent to a worker (an actor's constructor or endpoint argument), an actor mesh becomes a reference
        whose messages go straight to these actors' processes (`worker/actor_ref.py`, named here as data:
        controller code never imports worker code)."""
        shape = self._procs._shape
        inboxes = {rank: self._inboxes[rank] for rank in shape.ranks}
        args = (self._name, self._cls.__name__, self._endpoints, shape, inboxes, methods_of(self._cls))
        return codec.call_function, (REF, "reference", *args)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._cls.__name__} on {self._procs.describe()}>"


class ActorEndpoint(Adverbs[Any, Any]):
    """One endpoint of an actor mesh; call it with an adverb (`common/endpoint.py`)."""

    def __init__(self, actors: ActorMesh, name: str):
        self._actors, self._name = actors, name

    @property
    def _shape(self) -> Shape:
        return self._actors._shape

    @property
    def _what(self) -> str:
        return f"{self._actors._name}.{self._name.lstrip('~^')}"

    def _in_flight(self) -> tuple[threading.Lock, dict[int, int]]:
        return self._actors._lock, self._actors._choosing

    def _view(self, points: list[int] | None) -> ProcMesh:
        procs = self._actors._procs
        return procs if points is None else _point(procs, points[0])

    def _live(self) -> list[int]:
        return _live_points(self._actors._procs)

    def _call(self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        a = self._actors
        fn = _worker_fn("invoke", self._view(points))
        if points is None:
            return fn.start((a._name, self._name, args, kwargs), {}, name=self._what)
        point = a._point(points[0])  # (its place in the whole mesh the message went to, as Monarch's choose/stream)
        return fn.start((a._name, self._name, args, kwargs, point), {}, name=self._what)

    def stream(self, *args: Any, **kwargs: Any) -> Stream[Any]:
        """Call every actor, as one call (sent once per host, answers bundled as `call()`'s); yield each
        one's future as it is answered (`.get()` it: a failure raises there)."""
        return Stream([One(f) for f in self._call(None, args, kwargs).each()])

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Run the endpoint on every actor, on the workers' own tensors (`monarch.Tensor` arguments are each
        worker's), in order with the tensor engine's ops; its result a `monarch.Tensor` on the actors' mesh, whose
        metadata `@endpoint(propagate=fn)` gives. Monarch's distributed-tensor adverb."""
        from monarch.runtime.tensor import actor_calls  # (here: `import monarch.actor` must not import torch)

        a = self._actors
        return actor_calls.rref(a._procs, a._name, a._cls, self._name, args, kwargs)

    def _post(
        self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[Any] | None
    ) -> None:
        """No call is tracked: it is queued with the broadcasts made about then (`controller/casts.py`), which go
        down the command connection as one signed `Cast` (before anything else sent to the mesh, so it keeps
        its place among the calls); only a failure comes back (`CastFailed`), unless `port` takes the answers.
        Ranks already lost are skipped (their death was reported)."""
        procs = self._actors._procs
        spawned, shape = procs.spawned, procs._shape
        spawned.check_usable()
        ranks = shape.ranks if points is None else tuple(shape.ranks[i] for i in points)
        if spawned.lost:
            ranks = tuple(r for r in ranks if r not in spawned.lost)
        if not _cast_failures.registered:
            _cast_failures.register()
        if ranks:
            if not args and not kwargs and port is None:
                arguments = _NO_ARGS
            else:
                arguments = codec.dumps_whole((args, kwargs, port))
            item = (self._actors._name, self._name, shape.names, shape.sizes, shape.ranks, arguments)
            spawned.controller.cast(spawned, ranks, item)


def _worker_fn(name: str, procs: ProcMesh) -> Any:
    """The workers' `monarch.runtime.worker.actors.<name>`, as a live function on `procs` (imported here, not at
    the top: `import monarch.actor` must not import zmq or torch)."""
    from monarch.runtime.remote import RemoteFunction

    return RemoteFunction.by_name(WORKER, name, procs)


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


_NO_ARGS = codec.dumps_whole(((), {}, None))


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
    endpoint raised): in a notebook it is shown in the running cell (or, between cells, the next one run),
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
    check_spawn(name, cls)
    known = procs.spawned.actors
    ranks = frozenset(procs._shape.ranks)
    if name in known and known[name][1] & ranks:  # a second spawn under a name (Monarch allows it): its own
        name = next(f"{name}#{i}" for i in itertools.count(2) if f"{name}#{i}" not in known)
    spawning = _worker_fn("spawn", procs).start((name, cls, args, kwargs), {}, name=f"{name}.__init__", sources_of=cls)
    inboxes = spawning.result()
    _, ranks = known.get(name, ("", frozenset()))
    known[name] = (cls.__name__, ranks | frozenset(procs._shape.ranks))
    supervision.adopt(procs.spawned, name, supervision.owner_here())
    return ActorMesh(procs, name, cls, endpoints_of(cls), dict(zip(procs._shape.ranks, inboxes.values(), strict=True)))


def bootstrap(procs: ProcMesh, fn: Any, binds: list[set[int]] | None) -> None:
    """`spawn_procs(bootstrap=, proc_bind=)`: run on every new worker (`runtime/worker/bootstrap.py`)."""
    from monarch.runtime.remote import RemoteFunction

    run = RemoteFunction.by_name("monarch.runtime.worker.bootstrap", "bootstrap", procs)
    run.start((fn, binds), {}, name="spawn_procs(bootstrap=...)", sources_of=fn).result()


_mesh.ACTORS = spawn
_mesh.BOOTSTRAP = bootstrap
