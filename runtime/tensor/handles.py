"""Handles and dispatch: `monarch.Tensor`, and turning a torch op on handles into one command.

Each op computes its result's metadata locally (fake tensors, cached by op and input metadata, so
most ops skip them) and appends one command to the mesh's batch. The results are handles: a
torch.Tensor subclass holding a reference id, the mesh view, the stream, and the metadata.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._pytree import tree_map

from monarch.runtime.common.op_schema import alias_plan, may_write_unannotated, written_args
from monarch.runtime.tensor import known as known_values
from monarch.runtime.tensor.checks import (
    check_alive,
    check_same_mesh,
    check_stream,
    clear_rejected,
    reject,
    rejected,
    where,
)
from monarch.runtime.tensor.engine import Engine, engine_for
from monarch.runtime.tensor.patches import CudaMeansCpu
from monarch.runtime.tensor.streams import MAIN, Borrow, Stream, get_active_stream
from monarch.runtime.wire import codec
from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.protocol import Ref

_make_wrapper = torch.Tensor._make_wrapper_subclass


_TABLE = "monarch.runtime.worker.engine.table"


class Tensor(torch.Tensor):
    """A tensor that lives on every worker of a mesh; the controller holds only its metadata.

    Use `monarch.inspect(t, **coords)` for a value; `t.reduce(dims, "sum")` for collectives.
    """

    _ref: int
    _mesh: Any
    _meta: tuple
    # (the rest start as these class-wide values: most handles never change them, and each attribute set
    # on a new handle costs time on every op)
    _fake: torch.Tensor | None = None
    _borrow: Any = None
    """For a borrowed view: the Borrow that made it."""
    _lent: list | tuple = ()
    """Borrows of this tensor (and its views) not yet dropped (a list once it has one)."""
    _root: Any = None
    """For a view (or an in-place op's result): the handle that owns the memory."""
    _value: Any = None
    """The value, where the controller knows it (see `tensor/known.py`)."""

    @staticmethod
    def __new__(cls, meta: Any, ref: int, mesh: Any, stream: Stream | None = None):
        if isinstance(meta, torch.Tensor):  # a fake tensor
            meta = _Meta((tuple(meta.shape), meta.stride(), meta.dtype, meta.device))
        shape, stride, dtype, device = meta
        r = _make_wrapper(cls, shape, stride, None, None, dtype, torch.strided, device)
        r._meta, r._ref, r._mesh = meta, ref, mesh
        r._stream = stream if stream is not None else get_active_stream()
        r._engine_ref = (mesh.spawned.engine or engine_for(mesh.spawned)).weak
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Sent to a worker of its mesh (an actor endpoint's argument, a live function's): that worker's tensor
        there. The commands that make it go first (the engine's batch is sent now)."""
        engine = self._engine_ref()
        if engine is not None:
            engine.flush()
        return codec.call_function, (_TABLE, "local", self._mesh.spawned.mesh_id, self._ref)

    def __del__(self) -> None:
        engine = self._engine_ref() if hasattr(self, "_engine_ref") else None
        if engine is not None and self._ref >= 0 and self._borrow is None:  # a borrowed view shares its origin's
            engine.free(self._ref, self._stream.id, self._mesh._shape.ranks)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mesh = _mesh_of(args, kwargs)
        return run(mesh, func, args, kwargs or {})

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        """`t.data = other` (nn.Module.to and the like): `t` becomes `other`'s tensor on the workers too."""
        if value is self:
            return
        if not isinstance(value, Tensor) or value._mesh.spawned is not self._mesh.spawned:
            raise reject(
                f"t.data = ...: needs a monarch.Tensor of the same mesh, got {type(value).__name__}; "
                "to change the values, use `with torch.no_grad(): t.copy_(other)`"
            )
        check_stream("t.data = ...", self, get_active_stream(), mutating=True)
        _DATA.__set__(self, value)  # the controller's metadata
        self._meta, self._fake = value._meta, None
        self._root, self._value = (value._root if value._root is not None else value), value._value
        engine_for(self._mesh.spawned).push(self._mesh._shape.ranks, P.Alias(self._ref, value._ref))

    def reduce(self, dims: str | tuple[str, ...], reduction: str = "sum", scatter: bool = False) -> Tensor:
        """A collective over mesh dimension(s) `dims` of this tensor's mesh: the result on every worker.

        `reduction` is sum, avg, max, min, product or stack (a new leading dimension: all-gather);
        `scatter=True` makes sum a reduce-scatter and stack an all-to-all.
        """
        return COLLECTIVES["reduce"](self, dims, reduction, scatter)

    def reduce_(self, dims: str | tuple[str, ...], reduction: str = "sum", scatter: bool = False) -> Tensor:
        """In-place `reduce`: the result is written into this tensor on every worker."""
        if reduction == "stack" or scatter:
            raise ValueError(f"reduce_: {reduction!r} with scatter={scatter} changes the shape; use reduce()")
        COLLECTIVES["reduce"](self, dims, reduction, scatter, inplace=True)
        return self

    def to_mesh(self, dst: Any) -> Tensor:
        """This tensor moved worker to worker onto `dst`, a view of the same mesh with the same shape."""
        return COLLECTIVES["to_mesh"](self, dst)

    def _lend(self, to: Stream, mutable: bool) -> tuple[Tensor, Borrow]:
        """`to.borrow(self, mutable)` (`Stream.borrow` calls it)."""
        return borrow(to, self, mutable)


COLLECTIVES: dict[str, Callable[..., Any]] = {}
"""`reduce` and `to_mesh`, registered by `tensor.comms`, which builds on this module. `capture` imports
comms, and a `Tensor` is made only inside `activate()`, so every tensor finds them."""

_DATA = torch.Tensor.data  # the C descriptor behind `t.data`
_BINARY = [
    f"__{p}{n}__"
    for n in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
    for p in ("", "r", "i")
] + ["__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]


def _strict(name: str):
    base = getattr(torch.Tensor, name)
    learns = not name.startswith("__i")  # (in-place operators: torch's dispatch also bumps the version counter)

    def method(self, *args):
        clear_rejected()
        if learns and len(args) == 1 and type(self) is Tensor:
            other = args[0]
            kind = type(other)
            if kind is Tensor or kind in _SCALARS:
                mesh = _plain_capture(self, other, kind)
                if mesh is not None:
                    key = (name, self._meta, other._meta if kind is Tensor else kind)
                    plan = _OPERATORS.get(key)
                    if plan is not None:
                        return run(mesh, plan[0], (other, self) if plan[1] else (self, other), {})
                    return _learn(key, base, self, other)
        out = base(self, *args)
        if out is NotImplemented and rejected() is not None:
            raise rejected()
        return out

    method.__name__ = name
    return method


_SCALARS = (int, float, bool)
_OPERATORS: dict[tuple, tuple[Any, bool]] = {}
"""(operator, this handle's metadata, the other operand's metadata or type) -> (the op torch dispatched for
it, whether it took the operands swapped): learned from torch's own dispatch of the first such call, so
that the next ones go to `run` directly, skipping torch's dispatch through the modes (a third of the
controller's time per op)."""


class _Learning(threading.local):
    seen: list | None = None
    """While `_learn` runs an operator through torch on this thread: what reached `run`, as (op, args, kwargs)."""


_learning = _Learning()


def _plain_capture(self: Tensor, other: Any, kind: type) -> Any:
    """The mesh whose capture mode is the only dispatch mode, if nothing else would take part in dispatching
    an operator on these operands (no autograd, autocast, other function or dispatch modes); else None."""
    if _dispatch_modes() != 1 or _any_requires_grad(self, other) or _autocast():
        return None
    functions = _function_modes()
    if functions and (functions > 1 or type(_function_mode_at(0)) is not CudaMeansCpu):
        return None
    return getattr(_dispatch_mode_at(0), "monarch_mesh", None)


_dispatch_modes, _dispatch_mode_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_function_modes, _function_mode_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_autocast = torch._C._is_any_autocast_enabled


_any_requires_grad: Callable[..., bool] = getattr(
    torch._C, "_any_requires_grad", lambda *ts: any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)
)
"""(torch's, which unlike `t.requires_grad` does not call the function modes: CudaMeansCpu's Python, per op)"""


def _learn(key: tuple, base: Callable, self: Tensor, other: Any) -> Any:
    """Run an operator through torch and remember which op it became, if it became exactly one, taking the
    operands as they are (either way round): most do (`x + 1`: aten.add.Tensor(x, 1)); some do not
    (`1 / x`: reciprocal, then mul)."""
    outer, seen = _learning.seen, []
    _learning.seen = seen
    try:
        out = base(self, other)
    finally:
        _learning.seen = outer
        if outer is not None:  # (an operator inside another's learning: `1 / x` is `x.reciprocal() * 1`)
            outer.extend(seen)
    if out is NotImplemented:
        if rejected() is not None:
            raise rejected()
        return out
    if len(seen) == 1 and not seen[0][2] and len(_OPERATORS) < 10_000:
        func, args, _ = seen[0]
        if len(args) == 2 and args[0] is self and _same(args[1], other):
            _OPERATORS[key] = (func, False)
        elif len(args) == 2 and args[1] is self and _same(args[0], other):
            _OPERATORS[key] = (func, True)
    return out


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(b) in _SCALARS and a == b)


for _name in _BINARY:
    if hasattr(torch.Tensor, _name):
        setattr(Tensor, _name, _strict(_name))


def _mesh_of(args, kwargs) -> Any:
    found = None

    def look(x):
        nonlocal found
        if isinstance(x, Tensor) and found is None:
            found = x._mesh
        return x

    tree_map(look, (args, kwargs))
    return found


def run(mesh, func, args: tuple, kwargs: dict) -> Any:
    if mesh is None:
        raise reject(f"{func}: no mesh; ops on monarch tensors run inside `with mesh.activate():`")
    spawned = mesh.spawned
    if spawned.state != "running":
        check_alive(func, spawned)
    seen = _learning.seen
    if seen is not None:
        seen.append((func, args, kwargs))
    engine = spawned.engine or engine_for(spawned)
    stream = get_active_stream()
    info = _OP_INFO.get(func) or _op_info(func)
    mutated = _mutated_args(func, args, kwargs) if info.writes else _NONE
    tensors: list[torch.Tensor] = []
    default_dtype = _default_dtype()
    key_parts: list = [info, default_dtype]  # factories' results follow it
    wire_args = _walk(args, tensors, key_parts)
    wire_kwargs = _walk(kwargs, tensors, key_parts) if kwargs else _NO_KWARGS
    for x in tensors:
        if type(x) is Tensor or isinstance(x, Tensor):
            if x._mesh is not mesh:
                check_same_mesh(func, x, mesh)
            root = x._root if x._root is not None else x
            if x._stream is not stream or root._lent or root._borrow is not None:
                check_stream(func, x, stream, mutating=id(x) in mutated)
    try:
        key = tuple(key_parts)
        spec = engine.specs.get(key)
    except TypeError:  # an argument that cannot be hashed: no caching for this op
        key, spec = None, None
    known = info.deterministic and known_values.all_known(tensors, Tensor)
    if info.shares_memory:  # `a.set_(b)`: a becomes b's memory, which its schema does not say
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
            raise reject(
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
    if default_dtype is not _FLOAT32 and isinstance(spec, _Meta) and _takes_dtype(func):
        if wire_kwargs.get("dtype") is None:  # torch.set_default_dtype() changed only the controller
            wire_kwargs = dict(wire_kwargs, dtype=spec[2])
    out = Tensor(spec, engine.new_id(), mesh, stream) if type(spec) is _Meta else _build(spec, engine, mesh, stream)
    aliases = _note_aliases(func, args, kwargs, out) if info.aliases else {}
    if info.shares_memory and len(args) > 1 and isinstance(args[0], Tensor) and isinstance(args[1], Tensor):
        args[0]._root = args[1]._root if args[1]._root is not None else args[1]
    if computed:
        known_values.attach(out, values, Tensor, aliases, mutated)
    ids = out._ref if type(out) is Tensor else _ids_like(out)
    engine.push(mesh._shape.ranks, P.op_tuple(info.name, wire_args, wire_kwargs, ids, where()), stream)
    return out


_default_dtype, _FLOAT32 = torch.get_default_dtype, torch.float32
_SHARES_MEMORY = {torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.source_Tensor_storage_offset}
_NO_KWARGS: dict = {}
"""(an op's keyword arguments on the wire when it has none: never written to)"""


class _OpInfo:
    """What `run` asks of an op at every use, worked out at its first (`_op_info`)."""

    __slots__ = ("aliases", "deterministic", "name", "shares_memory", "writes")

    def __init__(self, func: Any) -> None:
        self.name: str = func.name()
        """As the workers look it up (``aten::add.Tensor``)."""
        schema = getattr(func, "_schema", None)
        self.writes = schema is not None and (schema.is_mutable or may_write_unannotated(func))
        """Whether it may write an argument (most write none, and `_mutated_args` is not asked)."""
        self.deterministic = known_values.deterministic(func)
        self.shares_memory = func in _SHARES_MEMORY
        self.aliases = bool(alias_plan(func))
        """Whether a result may share an argument's memory (views, in-place results)."""


_OP_INFO: dict[Any, _OpInfo] = {}
"""(Also part of the metadata cache's keys, standing for its op: hashed by identity, unlike an op object.)"""


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO[func] = _OpInfo(func)
    return info


@functools.cache
def _takes_dtype(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.name == "dtype" and a.kwarg_only for a in schema.arguments)


def _walk(obj: Any, tensors: list, key: list) -> Any:
    """`obj` for the wire (handles become `Ref`s); collects tensors, and a hashable description in `key`."""
    kind = type(obj)
    if kind is Tensor:
        tensors.append(obj)
        key.append(obj._meta)
        return Ref(obj._ref)
    if kind in _ATOMS:
        key.append(obj)
        return obj
    if kind is tuple:  # an op's arguments: mostly handles and numbers
        key.append((tuple, len(obj)))
        out = []
        for o in obj:
            k = type(o)
            if k is Tensor:
                tensors.append(o)
                key.append(o._meta)
                out.append(Ref(o._ref))
            elif k in _ATOMS:
                key.append(o)
                out.append(o)
            else:
                out.append(_walk(o, tensors, key))
        return tuple(out)
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


_ATOMS = {int, float, bool, str, type(None), torch.dtype, torch.device}
"""Argument types taken as they are."""


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
        return Tensor(spec, engine.new_id(), mesh, stream)
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


_NONE: set[int] = set()
"""(the arguments an op that writes none writes: never added to)"""


def _note_aliases(func, args: tuple, kwargs: dict, out: Any) -> dict[int, Any]:
    """Results that share memory with an input (views, in-place results) remember whose memory it is, so
    that the borrow rules of that tensor cover them too. Returns id(result) -> the input it aliases."""
    found: dict[int, Any] = {}
    for r, i, name in alias_plan(func):
        src = args[i] if i < len(args) else kwargs.get(name)
        if not isinstance(src, Tensor):
            continue
        result = out[r] if isinstance(out, tuple) and len(out) > r and not isinstance(out, list) else out
        for o in result if isinstance(result, list | tuple) else (result,):
            if isinstance(o, Tensor) and o is not src:
                o._root = src._root if src._root is not None else src
                found[id(o)] = src
    return found


def borrow(to: Stream, t: Tensor, mutable: bool) -> tuple[Tensor, Borrow]:
    """`to.borrow(t, mutable)`: see `monarch.Stream.borrow`."""
    if not isinstance(t, Tensor):
        raise TypeError(f"borrow: needs a monarch.Tensor (made inside mesh.activate()), got {type(t).__name__}")
    root = t._root if t._root is not None else t  # a view is borrowed with the memory it shares
    known_values.forget(t)  # the borrower may write it
    if root._borrow is not None:
        raise reject(f"borrow: this tensor is itself borrowed (at {root._borrow.where}); borrow the original")
    if t._stream is to:
        raise reject(f"borrow: the tensor already belongs to stream {to.name!r}")
    for lent in root._lent:
        if lent.mutable or mutable:
            raise reject(f"borrow: this tensor is already {lent.describe()}; drop that borrow first")
    b = Borrow(t, to, mutable, where())
    mesh = t._mesh
    engine = engine_for(mesh.spawned)
    alias = Tensor(t._meta, engine.new_id(), mesh, stream=to)
    alias._borrow = b
    b.alias_ref = alias._ref
    if not root._lent:
        root._lent = []
    root._lent.append(b)
    owner_ref = weakref.ref(root)  # not the tensor itself: the borrow must not keep it alive
    engine.push(mesh._shape.ranks, P.BorrowStart(b.id, t._stream.id, to.id, t._ref, alias._ref), stream=MAIN)

    def drop(bb: Borrow) -> None:
        bb.dropped_at = where()
        owner = owner_ref()
        if owner is not None and bb in owner._lent:
            owner._lent.remove(bb)
        engine.push(
            mesh._shape.ranks, P.BorrowEnd(bb.id, bb.from_stream.id, bb.to_stream.id, bb.alias_ref), stream=MAIN
        )

    b._drop = drop
    return alias, b


def _ids_like(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out._ref
    if isinstance(out, list | tuple):
        return [_ids_like(o) for o in out]
    return None


def new_handle(engine: Engine, mesh, shape: tuple, dtype, device) -> Tensor:
    stride, acc = [], 1
    for d in reversed(shape):  # contiguous
        stride.append(acc)
        acc *= max(d, 1)
    return Tensor(_Meta((tuple(shape), tuple(reversed(stride)), dtype, device)), engine.new_id(), mesh)
