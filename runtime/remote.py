"""Live functions: `@monarch.remote` functions run on every worker of a mesh."""

from __future__ import annotations

import functools
import inspect
import linecache
import pickle
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle

from monarch.runtime.common import context
from monarch.runtime.common.endpoint import Adverbs
from monarch.runtime.common.errors import cell_name
from monarch.runtime.controller import OutputEvent, fnblob
from monarch.runtime.mesh import ProcMesh, active_mesh
from monarch.runtime.values import Future
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.hold import Deferred


class RemoteFunction(Adverbs[Any, Any]):
    """A function that runs on the workers of a mesh. Make one with `@monarch.remote`.

    ``f(*args)`` runs it on the active mesh (`with mesh.activate():`); ``f.on(mesh)(*args)`` on a
    given mesh or slice. Both return a `ValueMesh`; `call_async` returns a `Future`. On a worker,
    calling it just runs the function there. It is also an endpoint, as Monarch's free functions are:
    ``f.call()``, ``f.call_one()``, ``f.broadcast()``, ``f.choose()``, ``f.stream()`` and
    ``send(f, args, kwargs, port=)`` on its mesh (`common/endpoint.py`).
    """

    def __init__(self, fn, mesh: ProcMesh | None = None):
        if not callable(fn):
            raise TypeError(f"@monarch.remote needs a function, got {fn!r}")
        self._fn = fn
        self._mesh = mesh
        functools.update_wrapper(self, fn)
        self._name = getattr(fn, "__name__", "function")

    # -- the adverbs: on the mesh it is bound to, or the active one --------------------------------
    def _target(self) -> ProcMesh:
        mesh = self._mesh or active_mesh()
        if mesh is None:
            raise RuntimeError(
                f"no mesh to run {self.__name__} on: use {self.__name__}.on(mesh).call(...) or call it inside "
                "`with mesh.activate():`"
            )
        return mesh

    @property
    def _shape(self) -> Any:
        return self._target()._shape

    @property
    def _what(self) -> str:
        return self.__name__

    def _in_flight(self) -> tuple[Any, dict[int, int]]:
        import threading

        got = self.__dict__.get("_choosing")
        if got is None:
            got = self.__dict__["_choosing"] = (threading.Lock(), {})
        return got

    def _call(self, points: list[int] | None, args: tuple, kwargs: dict) -> Future:
        mesh = self._target()
        if points is not None:
            coords = mesh._shape.coords(points[0])
            mesh = mesh.slice(**{dim: range(c, c + 1) for dim, c in coords.items()})
        return RemoteFunction(self._fn, mesh).start(args, kwargs)

    def _post(self, points: list[int] | None, args: tuple, kwargs: dict, port: Any) -> None:
        """Run it without waiting; each worker's result to `port` (a failure too), else a failure said on
        stderr (nobody waits to be told)."""
        mesh = self._target()
        if points is not None:
            coords = mesh._shape.coords(points[0])
            mesh = mesh.slice(**{dim: range(c, c + 1) for dim, c in coords.items()})
        if port is not None:
            to_port = RemoteFunction.by_name("monarch.runtime.worker.actors", "call_to_port", mesh)
            to_port.start((self._fn, port, args, kwargs), {}, name=self.__name__)
            return
        future = RemoteFunction(self._fn, mesh).start(args, kwargs)

        def report(f: Future) -> None:
            error = f.exception()
            if error is not None:
                print(f"monarch: {self.__name__} (not waited for) failed: {error}", file=sys.stderr)

        future.add_done_callback(report)

    def on(self, mesh: ProcMesh) -> RemoteFunction:
        """This function bound to `mesh` (any view of a spawned mesh)."""
        if not isinstance(mesh, ProcMesh):
            raise TypeError(f"on() needs a ProcMesh (from spawn_procs or a view of one), got {type(mesh).__name__}")
        return RemoteFunction(self._fn, mesh)

    def __call__(self, *args, **kwargs):
        if context.worker is not None:
            return self._fn(*args, **kwargs)
        return self.call_async(*args, **kwargs).result()

    @property
    def __monarch_fn__(self):
        """The function itself (what a worker that imports this live function by name runs)."""
        return self._fn

    def call_async(self, *args, **kwargs) -> Future:
        """Start the call on every worker and return at once."""
        return self.start(args, kwargs)

    def start(
        self,
        args: tuple,
        kwargs: dict,
        *,
        no_stdin: str | None = None,
        output: Callable[[OutputEvent], None] | None = None,
        name: str = "",
        sources_of: Any = None,
    ) -> Future:
        """Start the call with options: `no_stdin` (why the workers cannot be given input, if they
        cannot), `output` (where its output goes, instead of the controller's sink), `name` (in errors),
        `sources_of` (a class or function whose by-value code's source lines go along, for the workers'
        tracebacks and pdb: an actor class spawned by name)."""
        mesh = self._mesh or active_mesh()
        if mesh is None:
            raise RuntimeError(
                f"no mesh to run {self.__name__} on: use {self.__name__}.on(mesh)(...) or call it inside `with mesh.activate():`"
            )
        spawned, shape = mesh.spawned, mesh._shape
        spawned.check_usable()
        if spawned.abandoned:  # an interrupted call still runs somewhere: a new one would wait behind it
            mesh.refuse_if_busy(
                name or self.__name__,
                "Wait for it to end, or start a new mesh with mesh.respawn() (the workers' state is lost).",
                interrupted_only=True,
            )
        controller = spawned.controller
        fn = self._fn
        blob = fnblob.function_blob(fn, lambda: _by_reference(fn), lambda obj: _pickle(obj, "function", fn))
        # Whether the workers have the function yet, and the send that ships it, are one step: a call
        # from another thread must not overtake the message that carries the function.
        with spawned.order_lock:
            engine = spawned.engine
            if engine is not None:
                engine.flush()  # tensor commands issued before this call run before it (its lock also waits
                # for a batch that another thread, e.g. the frees reaper, is sending right now)
            known = spawned.fns.get(blob)
            if known is None:
                known = spawned.fns[blob] = (len(spawned.fns) + 1, set())
            fid, have = known
            ship = not have.issuperset(shape.ranks)
            body = [_NO_ARGUMENTS] if not args and not kwargs else _pickle((args, kwargs), "arguments", fn)
            # The function travels in the message, apart from the arguments: a worker keeps it even when
            # the arguments fail to unpickle there.
            fn_blob, sources = (blob, _sources(fn)) if ship else (None, None)
            if sources_of is not None:
                sources = {**(sources or {}), **_sources(sources_of)} or None
            cells = {f: c for f in sources or () if (c := cell_name(f)) is not None} or None
            # Ctrl-C from here until the caller waits would leave the call running on the workers with nobody
            # to interrupt it (seen: Kernel > Interrupt landing in a mesh view's Thread.start(), called back
            # as the call started): held until it is sent, then it interrupts the call as in result().
            with Deferred() as ctrl_c:
                pending = controller.call(
                    spawned,
                    shape.ranks,
                    lambda call_id: (
                        protocol.Call(call_id, fid, shape.names, shape.sizes, shape.ranks, fn_blob, sources, cells),
                        body,
                    ),
                    no_stdin,
                    output,
                    name or self.__name__,
                    torch=not (isinstance(fn, _Named) and fn.__module__ in _WITHOUT_TORCH),
                )
            have.update(shape.ranks)
        future: Future = Future(pending, shape, name or self.__name__)
        if ctrl_c.pressed:
            raise future.interrupted() from None
        return future

    def __repr__(self) -> str:
        return f"<live function {self.__qualname__}>"

    @classmethod
    def by_name(cls, module: str, qualname: str, mesh: ProcMesh) -> RemoteFunction:
        """A function the workers import by name (worker-side code the controller must not import)."""
        return cls(_named(module, qualname), mesh)


_WITHOUT_TORCH = frozenset(
    {
        "monarch.runtime.worker.actors",
        "monarch.runtime.worker.rdma",
        "monarch.runtime.worker.bootstrap",
        "monarch.runtime.worker.workspace",
        "monarch.runtime.worker.command",
        "time",
    }
)
"""Worker modules whose functions run without torch set up (actors, their buffers, a process's set-up): calling
them does not make a mesh of a program without torch set it up (`Controller.ready_torch`)."""


class _Named:
    """Stands for a function that only workers import: its name, nothing else."""

    def __init__(self, module: str, qualname: str) -> None:
        self.__module__, self.__qualname__ = module, qualname
        self.__name__ = qualname.rsplit(".", 1)[-1]
        self.ref = codec.FunctionRef(module, qualname)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__module__}.{self.__qualname__} runs on workers only")


@functools.cache
def _named(module: str, qualname: str) -> _Named:
    return _Named(module, qualname)


def remote(fn):
    """Decorator: make `fn` a live function (shipped by value with the globals it uses)."""
    context.live_functions = True  # (its meshes start with torch set up: `WorkerStart.torch`)
    return RemoteFunction(fn)


def _by_reference(fn) -> codec.FunctionRef | None:
    """A reference to `fn` if workers can import it (not defined in `__main__`)."""
    if isinstance(fn, _Named):
        return fn.ref
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    mod = sys.modules.get(module or "")
    if mod is None or module == "__main__" or getattr(mod, "__spec__", None) is None or "<locals>" in qualname:
        return None
    try:
        found = codec.import_function(module, qualname)
    except (AttributeError, ImportError):
        return None
    return codec.FunctionRef(module, qualname) if found is fn else None


_NO_ARGUMENTS = pickle.dumps(((), {}), protocol=5)
"""A call's arguments when there are none (as `codec.dumps` pickles them: the same bytes, made once)."""


def _pickle(obj, what: str, fn) -> Any:
    try:
        return codec.dumps_function(obj) if what == "function" else codec.dumps(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"cannot send the {what} of {name} to the workers: {e}. Live functions, their arguments and the "
            "globals they use must be picklable by cloudpickle (no open files, locks, sockets or generators)"
        ) from e


def _sources(fn) -> dict[str, list[str]]:
    """Source lines of the by-value code `fn` uses, so worker tracebacks can show them."""
    out: dict[str, list[str]] = {}
    if isinstance(fn, _Named):
        return out
    seen: set[int] = set()
    todo = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            todo.extend(v for v in vars(obj).values() if inspect.isfunction(v))
            continue
        code = getattr(obj, "__code__", None)
        if code is None or code.co_filename in out:
            continue
        if not cloudpickle.cloudpickle._should_pickle_by_reference(obj):
            lines = linecache.getlines(code.co_filename, getattr(obj, "__globals__", None))
            if lines:
                out[code.co_filename] = lines
            glb = getattr(obj, "__globals__", {})
            for name in code.co_names:
                v = getattr(glb.get(name), "__wrapped__", glb.get(name))  # a RemoteFunction wraps its function
                if inspect.isfunction(v) or inspect.isclass(v):
                    todo.append(v)
    return out
