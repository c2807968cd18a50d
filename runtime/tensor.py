"""The tensor engine on the controller: `with mesh.activate():` turns torch ops into commands.

Each op computes its result's metadata locally (fake tensors, no data) and appends one command to
the mesh's batch; batches go out without waiting for anything (when full, when a value is fetched,
when `activate()` exits). The results are `monarch.Tensor` handles: a torch.Tensor subclass holding
a reference id, the mesh view and the fake tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _device as torch_device
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from monarch.runtime import tensor_known as known_values
from monarch.runtime import wire
from monarch.runtime.streams import MAIN, Borrow, Stream, get_active_stream
from monarch.runtime.tensor_worker import Ref, written_args

BATCH = 256
"""Commands kept before a batch is sent on its own."""
_HERE = os.path.dirname(__file__)
_TORCH = os.path.dirname(torch.__file__)


class Engine:
    """The controller's side of one spawned mesh: ids, the command batch, freed ids."""

    def __init__(self, spawned) -> None:
        self.spawned = spawned
        self.ids = itertools.count(1)
        self.batches: dict[tuple[int, ...], list] = {}
        self.dead: list[tuple] = []
        """Freed handles not yet sent: (ranks, stream id, ref)."""
        self.lock = threading.RLock()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.specs: dict[tuple, Any] = {}
        """Output metadata of ops already seen, by op and input metadata: most ops skip fake tensors."""
        # A shape error is raised to the user at the op; torch would also log it with a traceback.
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
        self.cpu_only = all(info.get("device", "cpu").startswith("cpu") for info in spawned.info)

    def push(self, ranks: tuple[int, ...], cmd: tuple, stream: Stream | None = None) -> None:
        """Queue `cmd` for `ranks`, on `stream` (default: the active one)."""
        sid = (stream or get_active_stream()).id
        if sid:
            cmd = ("s", sid, cmd)
        with self.lock:
            if ranks not in self.batches and self.batches:
                self.flush()  # another set of workers: keep one global order of commands
            batch = self.batches.setdefault(ranks, [])
            batch.append(cmd)
            if len(batch) >= BATCH:
                self._send(ranks)

    def flush(self) -> None:
        """Send every pending command now (frees too, even with no command pending)."""
        with self.lock:
            if not self.batches and self.dead:
                self._send(())
            for ranks in list(self.batches):
                self._send(ranks)

    def _send(self, ranks: tuple[int, ...]) -> None:
        batches = {ranks: self.batches.pop(ranks, [])}
        dead, self.dead = self.dead, []  # one step: a free from another thread (GC) lands in one list or the other
        if dead:
            # Frees go to the workers that hold the value, on the stream that owns it. Other rank sets have
            # no commands pending (push sends them before it switches), so theirs can go now.
            by_owner: dict[tuple, list[int]] = {}
            for owner_ranks, sid, ref in dead:
                by_owner.setdefault((owner_ranks, sid), []).append(ref)
            for (owner_ranks, sid), refs in by_owner.items():
                batches.setdefault(owner_ranks, []).append(("del", refs) if sid == 0 else ("s", sid, ("del", refs)))
        if self.spawned.state != "running":
            return
        controller = self.spawned.controller
        for to, batch in batches.items():
            if batch:
                with torch.utils._python_dispatch._disable_current_modes():
                    try:
                        body = wire.dumps(batch)
                    except Exception:  # some op's argument cannot be pickled: that op fails, not the batch
                        body = wire.dumps([_sendable(cmd) for cmd in batch])
                    frames = wire.encode(controller.key, ("ops",), body)
                controller.send(self.spawned, to, frames)

    def free(self, ref: int, stream_id: int, ranks: tuple[int, ...]) -> None:
        """Free `ref` on `ranks` (sent with the next batch, run on the stream that owns it); any thread."""
        self.dead.append((ranks, stream_id, ref))


def _sendable(cmd: tuple) -> tuple:
    """`cmd`, or, if it cannot be pickled, a command that poisons its results with the reason."""
    try:
        wire.dumps([cmd])
        return cmd
    except Exception as e:
        if cmd[0] == "s":
            return ("s", cmd[1], _sendable(cmd[2]))
        if cmd[0] != "op":
            raise  # our own commands hold nothing unpicklable
        _, name, _, _, out, where = cmd
        why = f"an argument of {name} cannot be sent to the workers: {type(e).__name__}: {e}"
        return ("poison", out, "TypeError", why, where)


def _engine(spawned) -> Engine:
    engine = getattr(spawned, "engine", None)
    if engine is None:
        with _engines_lock:  # two threads starting on one mesh must share one engine (one id counter)
            engine = getattr(spawned, "engine", None)
            if engine is None:
                engine = spawned.engine = Engine(spawned)
                _engines.add(engine)
                if len(_engines) == 1 and not _reaper_started:
                    _start_reaper()
    return engine


_engines_lock = threading.Lock()
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_reaper_started = False
FREE_DELAY = 0.1
"""Seconds a freed handle waits for a batch to ride on before it is sent alone (`del t` in an idle notebook)."""


def _start_reaper() -> None:
    """A thread that sends frees nobody else sends: polls (a free runs inside `__del__`, where waking a
    thread through a lock could deadlock)."""
    global _reaper_started
    _reaper_started = True

    def reap() -> None:
        while True:
            time.sleep(FREE_DELAY)
            for engine in list(_engines):
                if engine.dead and engine.spawned.state == "running" and engine.lock.acquire(blocking=False):
                    try:  # (a busy engine sends them with its next batch)
                        engine.flush()
                    except Exception:
                        traceback.print_exc(file=sys.__stderr__)
                    finally:
                        engine.lock.release()

    threading.Thread(target=reap, name="monarch-frees", daemon=True).start()


class Tensor(torch.Tensor):
    """A tensor that lives on every worker of a mesh; the controller holds only its metadata.

    Use `monarch.inspect(t, **coords)` for a value; `t.reduce(dims, "sum")` for collectives.
    """

    _ref: int
    _mesh: Any
    _meta: tuple
    _fake: torch.Tensor | None

    @staticmethod
    def __new__(cls, meta: Any, ref: int, mesh: Any, stream: Stream | None = None):
        if isinstance(meta, torch.Tensor):  # a fake tensor
            meta = _Meta((tuple(meta.shape), meta.stride(), meta.dtype, meta.device))
        shape, stride, dtype, device = meta
        r = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device)
        r._meta, r._fake, r._ref, r._mesh = meta, None, ref, mesh
        r._stream = stream if stream is not None else get_active_stream()
        r._borrow = None  # for a borrowed view: the Borrow that made it
        r._lent = []  # Borrows of this tensor (and its views) not yet dropped
        r._root = None  # for a view (or an in-place op's result): the handle that owns the memory
        r._value = None  # the value, where the controller knows it (see tensor_known)
        r._engine_ref = weakref.ref(_engine(mesh._spawned))
        return r

    @property
    def stream(self) -> Stream:
        return self._stream

    def _get_fake(self) -> torch.Tensor:
        """A fake tensor with this handle's metadata (made when an op's metadata is not cached)."""
        if self._fake is None:
            shape, stride, dtype, device = self._meta
            engine = self._engine_ref()
            with torch.utils._python_dispatch._disable_current_modes(), engine.fake:
                self._fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return self._fake

    @property
    def mesh(self) -> Any:
        return self._mesh

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"monarch.Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, mesh={self._mesh._shape.describe()})"

    def __del__(self) -> None:
        engine = self._engine_ref() if hasattr(self, "_engine_ref") else None
        if engine is not None and self._ref >= 0 and self._borrow is None:  # a borrowed view shares its origin's
            engine.free(self._ref, self._stream.id, self._mesh._shape.ranks)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mesh = _mesh_of(args, kwargs)
        return _run(mesh, func, args, kwargs or {})

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        """`t.data = other` (nn.Module.to and the like): `t` becomes `other`'s tensor on the workers too."""
        if value is self:
            return
        if not isinstance(value, Tensor) or value._mesh._spawned is not self._mesh._spawned:
            raise _reject(
                f"t.data = ...: needs a monarch.Tensor of the same mesh, got {type(value).__name__}; "
                "to change the values, use `with torch.no_grad(): t.copy_(other)`"
            )
        _check_stream("t.data = ...", self, get_active_stream(), mutating=True)
        _DATA.__set__(self, value)  # the controller's metadata
        self._meta, self._fake = value._meta, None
        self._root, self._value = (value._root if value._root is not None else value), value._value
        _engine(self._mesh._spawned).push(self._mesh._shape.ranks, ("alias", self._ref, value._ref))

    def reduce(self, dims: str | tuple[str, ...], reduction: str = "sum", scatter: bool = False) -> Tensor:
        """A collective over mesh dimension(s) `dims` of this tensor's mesh: the result on every worker.

        `reduction` is sum, avg, max, min, product or stack (a new leading dimension: all-gather);
        `scatter=True` makes sum a reduce-scatter and stack an all-to-all.
        """
        from monarch.runtime.tensor_comms import reduce

        return reduce(self, dims, reduction, scatter)

    def reduce_(self, dims: str | tuple[str, ...], reduction: str = "sum", scatter: bool = False) -> Tensor:
        """In-place `reduce`: the result is written into this tensor on every worker."""
        if reduction == "stack" or scatter:
            raise ValueError(f"reduce_: {reduction!r} with scatter={scatter} changes the shape; use reduce()")
        from monarch.runtime.tensor_comms import reduce

        reduce(self, dims, reduction, scatter, inplace=True)
        return self

    def to_mesh(self, dst: Any) -> Tensor:
        """This tensor moved worker to worker onto `dst`, a view of the same mesh with the same shape."""
        from monarch.runtime.tensor_comms import to_mesh

        return to_mesh(self, dst)


_DATA = torch.Tensor.data  # the C descriptor behind `t.data`
_rejected = threading.local()
_BINARY = [
    f"__{p}{n}__"
    for n in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
    for p in ("", "r", "i")
] + ["__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]


def _reject(message: str) -> TypeError:
    """A TypeError for illegal use; remembered, because torch turns TypeErrors in operators into NotImplemented."""
    err = TypeError(message)
    _rejected.err = err
    return err


def _strict(name: str):
    base = getattr(torch.Tensor, name)

    def method(self, *args):
        _rejected.err = None
        out = base(self, *args)
        if out is NotImplemented and _rejected.err is not None:
            raise _rejected.err
        return out

    method.__name__ = name
    return method


for _name in _BINARY:
    if hasattr(torch.Tensor, _name):
        setattr(Tensor, _name, _strict(_name))


class _Capture(TorchDispatchMode):
    """While active, every torch op runs on the workers of `mesh` and returns handles."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":  # record_function markers (e.g. in optimizer.step()): the controller's
            with torch.utils._python_dispatch._disable_current_modes():
                return func(*args, **(kwargs or {}))
        return _run(self.mesh, func, args, kwargs or {})


def _mesh_of(args, kwargs) -> Any:
    found = None

    def look(x):
        nonlocal found
        if isinstance(x, Tensor) and found is None:
            found = x._mesh
        return x

    tree_map(look, (args, kwargs))
    return found


def _where() -> str:
    """The user's line that issued an op: the first frame outside torch and monarch (a notebook cell is
    named as IPython names it, `Cell In[5], line 2`). On a thread that issues ops for a user's line (the
    backward pass of grad_generator), that line."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_NOT_USERS) or "contextlib" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return getattr(_issuer, "where", "?")
    filename, func = f.f_code.co_filename, f.f_code.co_name
    cell = _cell_name(filename) if "ipykernel_" in filename else None
    if cell is not None:
        return f"{cell}, line {f.f_lineno}" + ("" if func == "<module>" else f" in {func}")
    return f"{filename}:{f.f_lineno} in {func}"


_NOT_USERS = (_HERE, _TORCH, threading.__file__)
_issuer = threading.local()
"""`.where`: set on threads whose ops are issued on behalf of one user line."""


def _cell_name(filename: str) -> str | None:
    """`Cell In[5]` for the file IPython compiled cell 5 into, else None."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return None if number is None else f"Cell In[{number}]"


def _run(mesh, func, args: tuple, kwargs: dict) -> Any:
    if mesh is None:
        raise _reject(f"{func}: no mesh; ops on monarch tensors run inside `with mesh.activate():`")
    spawned = mesh._spawned
    if spawned.state != "running":
        _check_alive(func, spawned)
    engine = _engine(spawned)
    stream = get_active_stream()
    mutated = _mutated_args(func, args, kwargs)
    tensors: list[torch.Tensor] = []
    default_dtype = torch.get_default_dtype()
    key_parts: list = [func, default_dtype]  # factories' results follow it
    wire_args = _walk(args, tensors, key_parts)
    wire_kwargs = _walk(kwargs, tensors, key_parts)
    for x in tensors:
        if isinstance(x, Tensor):
            _check_same_mesh(func, x, mesh)
            root = x._root if x._root is not None else x
            if x._stream is not stream or root._lent or root._borrow is not None:
                _check_stream(func, x, stream, mutating=id(x) in mutated)
    try:
        key = tuple(key_parts)
        spec = engine.specs.get(key)
    except TypeError:  # an argument that cannot be hashed: no caching for this op
        key, spec = None, None
    known = known_values.all_known(tensors, Tensor) and known_values.deterministic(func)
    if func in _SHARES_MEMORY:  # `a.set_(b)`: a becomes b's memory, which its schema does not say
        known = False
        for x in tensors:
            if isinstance(x, Tensor):
                known_values.forget(x)
    if spec is None:
        try:
            spec = _fake_run(engine, func, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not any(isinstance(x, Tensor) for x in tensors):  # local tensors only: run here
                with torch.utils._python_dispatch._disable_current_modes():
                    return func(*args, **kwargs)
            if known:  # e.g. `.item()` of a step counter: the controller has the value
                return known_values.compute(func, args, kwargs, Tensor)
            raise _reject(
                f"{func}: the result depends on the tensor's values, which live on the workers; "
                "fetch them first: monarch.inspect(t) (e.g. monarch.inspect(t).item())"
            ) from None
        if key is not None and len(engine.specs) < 100_000:
            engine.specs[key] = spec
    values, computed = None, False
    if known and known_values.small(spec):
        try:
            values, computed = known_values.compute(func, args, kwargs, Tensor), True
        except Exception:  # the workers will say what is wrong
            pass
    if not computed and mutated:
        for x in tensors:
            if id(x) in mutated and isinstance(x, Tensor):
                known_values.forget(x)
    if default_dtype is not torch.float32 and isinstance(spec, _Meta) and _takes_dtype(func):
        if wire_kwargs.get("dtype") is None:  # torch.set_default_dtype() changed only the controller
            wire_kwargs = dict(wire_kwargs, dtype=spec[2])
    out = _build(spec, engine, mesh, stream)
    aliases = _note_aliases(func, args, kwargs, out)
    if func in _SHARES_MEMORY and len(args) > 1 and isinstance(args[0], Tensor) and isinstance(args[1], Tensor):
        args[0]._root = args[1]._root if args[1]._root is not None else args[1]
    if computed:
        known_values.attach(out, values, Tensor, aliases, mutated)
    engine.push(mesh._shape.ranks, ("op", func.name(), wire_args, wire_kwargs, _ids_like(out), _where()), stream)
    return out


_SHARES_MEMORY = {torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.source_Tensor_storage_offset}


@functools.cache
def _takes_dtype(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.name == "dtype" and a.kwarg_only for a in schema.arguments)


def _check_same_mesh(what: Any, t: Tensor, mesh) -> None:
    """`t` used inside `mesh.activate()`: it must be on that mesh (the same workers of one spawned mesh)."""
    if t._mesh is not mesh and (t._mesh._spawned is not mesh._spawned or t._mesh._shape.ranks != mesh._shape.ranks):
        raise _reject(
            f"{what}: a tensor on mesh {_name_view(t._mesh, mesh)} used inside {_name_view(mesh, t._mesh)}"
            ".activate(); a tensor is used only on the mesh that made it (move it there with t.to_mesh(that_mesh))"
        )


def _name_view(view, other) -> str:
    """A mesh view's shape, and what tells it from `other` where the shapes read the same: its ranks
    (two slices of one mesh), or its spawn number (two spawned meshes)."""
    text = view._shape.describe()
    if text == other._shape.describe():
        if view._spawned is not other._spawned:
            return f"{text} (spawned mesh #{view._spawned.mesh_id})"
        ranks = view._shape.ranks
        if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
            return f"{text} (ranks {ranks[0]}-{ranks[-1]})"
        return f"{text} (ranks {', '.join(map(str, ranks))})"
    return text


def _check_alive(what, spawned) -> None:
    if spawned.failure is not None:
        raise spawned.failure
    raise _reject(
        f"{what}: mesh {spawned.shape.describe()} is {spawned.state}, and its tensors went with its workers; "
        "make new tensors on a running mesh (mesh.respawn() starts one of the same shape)"
    )


def _walk(obj: Any, tensors: list, key: list) -> Any:
    """`obj` for the wire (handles become `Ref`s); collects tensors, and a hashable description in `key`."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        key.append(obj._meta)
        return Ref(obj._ref)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        key.append(("local", tuple(obj.shape), obj.stride(), obj.dtype, obj.device))
        with torch.utils._python_dispatch._disable_current_modes():
            return obj.detach().clone()  # its value now: it is pickled when the batch goes, and may change before
    if isinstance(obj, tuple | list):
        key.append((type(obj), len(obj)))
        return type(obj)(_walk(o, tensors, key) for o in obj)
    if isinstance(obj, dict):
        key.append((dict, tuple(obj)))
        return {k: _walk(v, tensors, key) for k, v in obj.items()}
    key.append(obj)
    return obj


def _fake_run(engine: Engine, func, args: tuple, kwargs: dict) -> Any:
    """Run `func` on fake tensors; returns the output's spec (metadata only)."""

    def to_fake(x):
        if isinstance(x, Tensor):
            return x._get_fake()
        if isinstance(x, torch.Tensor):
            return engine.fake.from_tensor(x)
        return x

    with engine.lock:  # one thread at a time computes metadata (grad_generator runs backward in another)
        fake_args, fake_kwargs = tree_map(to_fake, (args, kwargs))
        # outer activate() modes (nested activations) must not see the fake ops
        with torch.utils._python_dispatch._disable_current_modes(), engine.fake:
            fake_out = func(*fake_args, **fake_kwargs)
    return _spec(fake_out)


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _Meta((tuple(x.shape), x.stride(), x.dtype, x.device))
    if isinstance(x, tuple | list):
        return type(x)(_spec(o) for o in x)
    return x


class _Meta(tuple):
    """A tensor output's (shape, stride, dtype, device) in a cached spec."""


def _build(spec: Any, engine: Engine, mesh, stream: Stream) -> Any:
    if isinstance(spec, _Meta):
        return Tensor(spec, next(engine.ids), mesh, stream)
    if isinstance(spec, tuple | list):
        return type(spec)(_build(o, engine, mesh, stream) for o in spec)
    return spec


def _mutated_args(func, args: tuple, kwargs: dict) -> set[int]:
    """ids of the arguments `func` writes to (in-place ops, out= forms, foreach lists)."""
    if getattr(func, "_schema", None) is None:
        return set()
    out: set[int] = set()
    for v in written_args(func, args, kwargs):
        if isinstance(v, list | tuple):
            out.update(id(e) for e in v)
        else:
            out.add(id(v))
    return out


_alias_plans: dict[Any, list[tuple[int, int, str]]] = {}


def _note_aliases(func, args: tuple, kwargs: dict, out: Any) -> dict[int, Any]:
    """Results that share memory with an input (views, in-place results) remember whose memory it is, so
    that the borrow rules of that tensor cover them too. Returns id(result) -> the input it aliases."""
    found: dict[int, Any] = {}
    plan = _alias_plans.get(func)
    if plan is None:
        plan = []
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for r, ret in enumerate(schema.returns):
                sets = ret.alias_info.before_set if ret.alias_info is not None else set()
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is None:
                        continue
                    if sets & a.alias_info.before_set:
                        plan.append((r, i, a.name))
                    elif ret.alias_info is not None and not sets and isinstance(ret.type, torch.ListType):
                        plan.append((r, i, a.name))  # `Tensor(a)[]` (split, unbind): its sets are not exposed
        if func is torch.ops.aten._unsafe_view.default:  # a view whose schema says it is not
            plan = [(0, 0, "self")]
        _alias_plans[func] = plan
    for r, i, name in plan:
        src = args[i] if i < len(args) else kwargs.get(name)
        if not isinstance(src, Tensor):
            continue
        result = out[r] if isinstance(out, tuple) and len(out) > r and not isinstance(out, list) else out
        for o in result if isinstance(result, list | tuple) else (result,):
            if isinstance(o, Tensor) and o is not src:
                o._root = src._root if src._root is not None else src
                found[id(o)] = src
    return found


def _check_stream(func, x: Tensor, stream: Stream, mutating: bool = False) -> None:
    """The borrow rules; a TypeError that says which rule and where the borrow was made."""
    what = str(func)
    root = x._root if x._root is not None else x
    b = root._borrow
    if b is not None and b.dropped:
        raise _reject(
            f"{what}: a borrowed tensor used after its borrow was dropped (borrowed at {b.where}, dropped at "
            f"{b.dropped_at}); use the original tensor on stream {b.from_stream.name!r} instead"
        )
    if b is not None and mutating and not b.mutable:
        raise _reject(
            f"{what}: this tensor is {b.describe()}, so it may not be changed there "
            "(borrow with mutable=True to change it on the borrowing stream)"
        )
    if x._stream is not stream:
        raise _reject(
            f"{what}: a tensor of stream {x._stream.name!r} used on stream {stream.name!r}; a stream uses only its "
            f"own tensors: lend it with {stream.name}.borrow(t) (see monarch.Stream.borrow)"
        )
    for lent in root._lent:
        if lent.mutable:
            raise _reject(
                f"{what}: this tensor is {lent.describe()}; its stream {x._stream.name!r} may use it again only "
                "after borrow.drop()"
            )
        if mutating:
            raise _reject(
                f"{what}: this tensor is {lent.describe()}, so it may not be changed until borrow.drop() "
                "(borrow with mutable=True to change it on the borrowing stream)"
            )


def borrow(to: Stream, t: Tensor, mutable: bool) -> tuple[Tensor, Borrow]:
    """`to.borrow(t, mutable)`: see `monarch.Stream.borrow`."""
    if not isinstance(t, Tensor):
        raise TypeError(f"borrow: needs a monarch.Tensor (made inside mesh.activate()), got {type(t).__name__}")
    root = t._root if t._root is not None else t  # a view is borrowed with the memory it shares
    known_values.forget(t)  # the borrower may write it
    if root._borrow is not None:
        raise _reject(f"borrow: this tensor is itself borrowed (at {root._borrow.where}); borrow the original")
    if t._stream is to:
        raise _reject(f"borrow: the tensor already belongs to stream {to.name!r}")
    for lent in root._lent:
        if lent.mutable or mutable:
            raise _reject(f"borrow: this tensor is already {lent.describe()}; drop that borrow first")
    where = _where()
    b = Borrow(t, to, mutable, where)
    mesh = t._mesh
    engine = _engine(mesh._spawned)
    alias = Tensor(t._meta, next(engine.ids), mesh, stream=to)
    alias._borrow = b
    b.alias_ref = alias._ref
    root._lent.append(b)
    owner_ref = weakref.ref(root)  # not the tensor itself: the borrow must not keep it alive
    engine.push(mesh._shape.ranks, ("borrow", b.id, t._stream.id, to.id, t._ref, alias._ref), stream=MAIN)

    def drop(bb: Borrow) -> None:
        bb.dropped_at = _where()
        owner = owner_ref()
        if owner is not None and bb in owner._lent:
            owner._lent.remove(bb)
        engine.push(mesh._shape.ranks, ("drop", bb.id, bb.from_stream.id, bb.to_stream.id, bb.alias_ref), stream=MAIN)

    b._drop = drop
    return alias, b


def _ids_like(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out._ref
    if isinstance(out, list | tuple):
        return [_ids_like(o) for o in out]
    return None


def _new(engine: Engine, mesh, shape: tuple, dtype, device) -> Tensor:
    stride, acc = [], 1
    for d in reversed(shape):  # contiguous
        stride.append(acc)
        acc *= max(d, 1)
    return Tensor(_Meta((tuple(shape), tuple(reversed(stride)), dtype, device)), next(engine.ids), mesh)


class _Devices(TorchFunctionMode):
    """On a mesh without CUDA, "cuda" means the CPU: `device="cuda"`, the default device set by
    `torch.set_default_device("cuda")`, `t.to("cuda")`, `t.cuda()` and `module.to("cuda")`.

    Runs before torch parses the arguments, which would otherwise try to initialize CUDA here.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            _warn_cuda()
            return args[0].to("cpu")
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            _warn_cuda()
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is None and func in _constructors() and _is_cuda(torch_device.CURRENT_DEVICE):
            dev = "cuda"  # torch.set_default_device("cuda"), found without making a tensor (that would init CUDA)
        if dev is not None and _is_cuda(dev):
            _warn_cuda()
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _is_cuda(x: Any) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.split(":", 1)[0] == "cuda"


_warned_cuda = False


def _warn_cuda() -> None:
    """Once per process: tutorials ask for "cuda" in many places."""
    global _warned_cuda
    if not _warned_cuda:
        _warned_cuda = True
        warnings.warn("the mesh's workers have no CUDA: tensors requested on 'cuda' are made on the CPU", stacklevel=3)


def _constructors():
    from torch.utils._device import _device_constructors

    return _device_constructors()


@contextlib.contextmanager
def activate(mesh):
    """The capture modes for `mesh` (entered by `mesh.activate()`)."""
    engine = _engine(mesh._spawned)
    _route_manual_seed()
    token = _capturing.set(mesh)
    try:
        with contextlib.ExitStack() as stack:
            if engine.cpu_only:
                stack.enter_context(_Devices(engine))
            stack.enter_context(_Capture(mesh))
            yield
    finally:
        _capturing.reset(token)


_capturing: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_capturing", default=None)
_local_manual_seed = None


def _route_manual_seed() -> None:
    """`torch.manual_seed(s)` inside `activate()` seeds the workers too (it is not a torch op, so no
    mode sees it); elsewhere it is torch's own."""
    global _local_manual_seed
    if _local_manual_seed is not None:
        return
    _local_manual_seed = torch.manual_seed

    @functools.wraps(_local_manual_seed)
    def manual_seed(seed):
        mesh = _capturing.get()
        if mesh is not None and mesh._spawned.state == "running":
            _engine(mesh._spawned).push(mesh._shape.ranks, ("seed", int(seed)))
        return _local_manual_seed(seed)

    torch.manual_seed = manual_seed


def flush(mesh) -> None:
    engine = getattr(mesh._spawned, "engine", None)
    if engine is not None:
        engine.flush()
