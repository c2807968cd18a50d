"""Live functions: `@monarch.remote` functions run on every worker of a mesh."""

from __future__ import annotations

import asyncio
import functools
import inspect
import linecache
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import cloudpickle

from monarch.runtime import context, fnblob, protocol, wire
from monarch.runtime.controller import OutputEvent
from monarch.runtime.errors import Release, RemoteError, RemoteInterrupt, group_failures
from monarch.runtime.mesh import ProcMesh, active_mesh
from monarch.runtime.shape import Shape

T = TypeVar("T")
INTERRUPT_GRACE = 0.6
"""Seconds an interrupted call waits for the workers to say where they were."""


class ValueMesh(Generic[T]):
    """One value per point of the mesh view a call ran on.

    `item(gpu=3)` picks a value by coordinates; iterating yields values in rank order;
    `items()` yields ``(coordinates, value)``.
    """

    def __init__(self, shape: Shape, values: list[T]):
        self._shape = shape
        self._values = values

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.size_dict

    def item(self, **coords: int) -> T:
        """The value at `coords`; every dimension of size > 1 must be given."""
        return self._values[self._shape.index(**coords)]

    def items(self) -> Iterator[tuple[dict[str, int], T]]:
        for i, v in enumerate(self._values):
            yield self._shape.coords(i), v

    def values(self) -> list[T]:
        return list(self._values)

    def __iter__(self) -> Iterator[T]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def describe(self) -> str:
        """The shape of the view the values came from, e.g. ``{host: 2, gpu: 4}``."""
        return self._shape.describe()

    def label(self, coords: dict[str, int]) -> str:
        """A point's coordinates as text, e.g. ``host=0,gpu=3``."""
        return self._shape.label(coords)

    def to_table(self) -> str:
        rows = [(self._shape.label(c), repr(v)) for c, v in self.items()]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)

    def __repr__(self) -> str:
        return f"ValueMesh {self._shape.describe()}:\n{self.to_table()}"


class Future(Generic[T]):
    """The pending result of an asynchronous live-function call; `result()` waits for it."""

    def __init__(self, pending, shape: Shape, name: str):
        self._pending = pending
        self._shape = shape
        self._name = name
        self._value: ValueMesh[T] | None = None

    def done(self) -> bool:
        return self._pending.future.done()

    def result(self, timeout: float | None = None) -> ValueMesh[T]:
        """Wait for every worker; raise `RemoteError` if any failed. Ctrl-C interrupts the workers."""
        if self._value is None:
            controller = self._pending.mesh.controller
            try:
                replies = controller.wait(self._pending, timeout)
            except KeyboardInterrupt:
                raise self._interrupt() from None
            self._value = self._decode(replies)
        return self._value

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt on the workers still running this call, and return at once (what Ctrl-C
        does to a call being waited for; for calls nobody waits for, such as `%%mesh --noblock` runs)."""
        if not self.done():
            self._pending.mesh.controller.interrupt(self._pending)

    def _interrupt(self) -> RemoteInterrupt:
        """Interrupt the busy workers and collect, for a moment, where each one was."""
        pending = self._pending
        controller = pending.mesh.controller
        controller.interrupt(pending)
        try:
            controller.wait(pending, INTERRUPT_GRACE)
        except BaseException:
            pass  # a worker that did not answer in time is reported as busy
        labels = pending.mesh.labels
        raw = []
        for rank, env in list(pending.replies.items()):
            if not env.message.ok:
                try:
                    raw.append((rank, labels[rank], _loads(env.body, env.buffers)))
                except Exception:
                    pass
        busy = sorted(set(self._shape.ranks) - set(pending.replies))
        queued = sorted(set(busy) & controller.busy_with_earlier_calls(pending))
        if busy and not pending.future.done():
            pending.mesh.abandoned.add(pending.call_id)  # the next call on these ranks says so, not waits
        return RemoteInterrupt(self._name, group_failures(raw), busy, len(self._shape), queued)

    get = result

    def __await__(self):
        yield from asyncio.wrap_future(self._pending.future).__await__()
        return self.result()

    def _decode(self, replies: dict[int, tuple]) -> ValueMesh[T]:
        pending = self._pending
        labels = pending.mesh.labels
        values, failed, released = [], [], []
        for rank in self._shape.ranks:
            env = replies[rank]
            try:
                obj = _loads(env.body, env.buffers)
            except Exception as e:
                info = protocol.ErrorInfo(type(e).__qualname__, f"result cannot be unpickled here: {e}", "")
                failed.append((rank, labels[rank], info))
                continue
            if not env.message.ok and obj.exc_type == protocol.RELEASED and rank in pending.released:
                r = pending.released[rank]
                released.append(Release(rank, labels[rank], r.collective, r.where, r.user_groups))
            elif not env.message.ok:
                failed.append((rank, labels[rank], obj))
            else:
                values.append(obj)
        if failed or released:
            raise RemoteError(self._name, group_failures(failed), len(self._shape), released)
        return ValueMesh(self._shape, values)


def _loads(body, buffers) -> Any:
    """Unpickle a result as local objects, also inside `mesh.activate()` (whose capture would turn
    the tensors being rebuilt into commands for the workers)."""
    capture = sys.modules.get("monarch.runtime.tensor.capture")
    if capture is None or capture.capturing.get() is None:
        return wire.loads(body, buffers)
    import torch

    with torch.utils._python_dispatch._disable_current_modes():
        return wire.loads(body, buffers)


class RemoteFunction:
    """A function that runs on the workers of a mesh. Make one with `@monarch.remote`.

    ``f(*args)`` runs it on the active mesh (`with mesh.activate():`); ``f.on(mesh)(*args)`` on a
    given mesh or slice. Both return a `ValueMesh`; `call_async` returns a `Future`. On a worker,
    calling it just runs the function there.
    """

    def __init__(self, fn, mesh: ProcMesh | None = None):
        if not callable(fn):
            raise TypeError(f"@monarch.remote needs a function, got {fn!r}")
        self._fn = fn
        self._mesh = mesh
        functools.update_wrapper(self, fn)

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
    ) -> Future:
        """Start the call with options: `no_stdin` (why the workers cannot be given input, if they
        cannot), `output` (where its output goes, instead of the controller's sink), `name` (in errors)."""
        mesh = self._mesh or active_mesh()
        if mesh is None:
            raise RuntimeError(
                f"no mesh to run {self.__name__} on: use {self.__name__}.on(mesh)(...) or call it inside `with mesh.activate():`"
            )
        spawned, shape = mesh._spawned, mesh._shape
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
            body = _pickle((args, kwargs), "arguments", fn)
            # The function travels in the message, apart from the arguments: a worker keeps it even when
            # the arguments fail to unpickle there.
            fn_blob, sources = (blob, _sources(fn)) if ship else (None, None)
            pending = controller.call(
                spawned,
                shape.ranks,
                lambda call_id: (
                    protocol.Call(call_id, fid, shape.names, shape.sizes, shape.ranks, fn_blob, sources),
                    body,
                ),
                no_stdin,
                output,
                name or self.__name__,
            )
            have.update(shape.ranks)
        return Future(pending, shape, name or self.__name__)

    def __repr__(self) -> str:
        return f"<live function {self.__qualname__}>"

    @classmethod
    def by_name(cls, module: str, qualname: str, mesh: ProcMesh) -> RemoteFunction:
        """A function the workers import by name (worker-side code the controller must not import)."""
        return cls(_named(module, qualname), mesh)


class _Named:
    """Stands for a function that only workers import: its name, nothing else."""

    def __init__(self, module: str, qualname: str) -> None:
        self.__module__, self.__qualname__ = module, qualname
        self.__name__ = qualname.rsplit(".", 1)[-1]
        self.ref = wire.FunctionRef(module, qualname)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__module__}.{self.__qualname__} runs on workers only")


@functools.cache
def _named(module: str, qualname: str) -> _Named:
    return _Named(module, qualname)


def remote(fn):
    """Decorator: make `fn` a live function (shipped by value with the globals it uses)."""
    return RemoteFunction(fn)


def _by_reference(fn) -> wire.FunctionRef | None:
    """A reference to `fn` if workers can import it (not defined in `__main__`)."""
    if isinstance(fn, _Named):
        return fn.ref
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    mod = sys.modules.get(module or "")
    if mod is None or module == "__main__" or getattr(mod, "__spec__", None) is None or "<locals>" in qualname:
        return None
    try:
        found = wire.import_function(module, qualname)
    except (AttributeError, ImportError):
        return None
    return wire.FunctionRef(module, qualname) if found is fn else None


def _pickle(obj, what: str, fn) -> Any:
    try:
        return wire.dumps_function(obj) if what == "function" else wire.dumps(obj)
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
