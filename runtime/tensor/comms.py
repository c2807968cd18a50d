"""Tensor engine commands that involve several workers: collectives, moves between views, and
gradients yielded one at a time.
"""

from __future__ import annotations

import threading

import torch

from monarch.runtime.common import helper_cpu
from monarch.runtime.controller import SpawnedMesh
from monarch.runtime.tensor import known as known_values
from monarch.runtime.tensor.checks import check_alive, check_same_mesh, check_stream, issuer, where
from monarch.runtime.tensor.engine import capturing, engine_for
from monarch.runtime.tensor.handles import COLLECTIVES, Tensor, new_handle
from monarch.runtime.tensor.streams import get_active_stream
from monarch.runtime.wire import protocol as P


def reduce(t: Tensor, dims, reduction: str, scatter: bool, inplace: bool = False) -> Tensor:
    """`t.reduce(...)` / `t.reduce_(...)`: see `monarch.Tensor.reduce`."""
    allowed = ("sum", "avg", "max", "min", "product", "stack")
    if reduction not in allowed:
        raise ValueError(f"reduce: unknown reduction {reduction!r}; use one of {', '.join(allowed)}")
    if not isinstance(t, Tensor):
        raise TypeError(f"reduce: needs a monarch.Tensor (made inside mesh.activate()), got {type(t).__name__}")
    check_stream("reduce", t, get_active_stream(), mutating=inplace)
    mesh = t._mesh
    active = capturing.get()  # inside another mesh's activate(), a collective is the same mistake as `t + 1`
    if active is not None:
        check_same_mesh("reduce", t, active)
    if mesh.spawned.state != "running":
        check_alive("reduce", mesh.spawned)
    dims_t = (dims,) if isinstance(dims, str) else tuple(dims)
    for d in dims_t:
        if d not in mesh.names:
            raise ValueError(
                f"reduce: mesh {mesh._shape.describe()} has no dimension {d!r}; it has {', '.join(mesh.names)}"
            )
    size = 1
    for d in dims_t:
        size *= mesh.size(d)
    group = mesh.process_group(dims_t)
    shape = tuple(t.shape)
    if reduction == "avg" and not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise ValueError(f"reduce: 'avg' needs a floating-point tensor, got {t.dtype}; use 'sum', or convert first")
    if reduction == "stack":
        if scatter and (not shape or shape[0] != size):
            raise ValueError(
                f"reduce: stack with scatter (all-to-all) over {size} ranks needs a leading dimension of {size} "
                f"(slice i goes to rank i), got shape {shape}"
            )
        out_shape = (size, *shape) if not scatter else (size, *shape[1:])
    else:
        if scatter and (not shape or shape[0] % size):
            raise ValueError(
                f"reduce: scatter over {size} ranks needs a leading dimension divisible by {size}, got {shape}"
            )
        out_shape = (shape[0] // size, *shape[1:]) if scatter else shape
    engine = engine_for(mesh.spawned)
    out = t if inplace else new_handle(engine, mesh, out_shape, t.dtype, t.device)
    if inplace:
        known_values.forget(t)
    cmd = P.Reduce(t._ref, out._ref, group.gid, size, reduction, scatter, shape, t.dtype, t.device.type, where())
    engine.push(mesh._shape.ranks, cmd)
    return out


def to_mesh(t: Tensor, dst) -> Tensor:
    """`t` moved worker to worker onto `dst`, a mesh (or view) with the same sizes.

    Pairs workers by position (rank i of t's view sends to rank i of `dst`); pipelined like any op.
    Between views of one spawned mesh the move uses that mesh's group; between two spawned meshes,
    a two-worker gloo link per pair, made on first use (through host memory on GPUs).
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"to_mesh: needs a monarch.Tensor, got {type(t).__name__}")
    if not isinstance(getattr(dst, "spawned", None), SpawnedMesh):  # (a ProcMesh: the layer above)
        raise TypeError(f"to_mesh: needs a ProcMesh to move to (from spawn_procs or a view of one), got {dst!r}")
    check_stream("to_mesh", t, get_active_stream())
    src = t._mesh
    if tuple(dst._shape.sizes) != tuple(src._shape.sizes):
        raise ValueError(f"to_mesh: shapes differ: {src._shape.describe()} -> {dst._shape.describe()}")
    if dst.spawned is not src.spawned:
        return _to_other_mesh(t, src, dst)
    engine = engine_for(src.spawned)
    out = new_handle(engine, dst, tuple(t.shape), t.dtype, t.device)
    pairs = list(zip(src._shape.ranks, dst._shape.ranks))
    ranks = tuple(sorted(set(src._shape.ranks) | set(dst._shape.ranks)))
    engine.push(ranks, P.MoveWithin(t._ref, out._ref, pairs, tuple(t.shape), t.dtype, t.device.type, where()))
    return out


def _to_other_mesh(t: Tensor, src, dst) -> Tensor:
    for m in (src, dst):
        if m.spawned.state != "running":
            check_alive("to_mesh", m.spawned)
    src_engine, dst_engine = engine_for(src.spawned), engine_for(dst.spawned)
    out = new_handle(dst_engine, dst, tuple(t.shape), t.dtype, t.device)
    a, b = src.spawned.mesh_id, dst.spawned.mesh_id
    links = [(s, d, f"{a}.{s}>{b}.{d}") for s, d in zip(src._shape.ranks, dst._shape.ranks)]
    at = where()
    with _MOVES:  # one order of moves on every mesh, or two threads moving crosswise deadlock the workers
        src_engine.push(src._shape.ranks, P.SendTo(t._ref, links, tuple(t.shape), t.dtype, at, b))
        dst_engine.push(dst._shape.ranks, P.RecvFrom(out._ref, links, tuple(t.shape), t.dtype, t.device.type, at, a))
        src_engine.flush()  # both halves on the wire now: a sender never waits on a receive still queued here
        dst_engine.flush()
    return out


_MOVES = threading.Lock()
"""Held while a move between spawned meshes is queued on both."""


def grad_generator(loss: Tensor, params, grad_outputs=None):
    """Gradients of `loss` for `params`, yielded one at a time in the order given (pass the
    parameters last layer first), the backward pass issued incrementally: only as far as the next
    gradient asked for, so that what the loop issues for one gradient (its reduction, say) lands
    between the backward ops before it and those after it, the same way on every run.
    """
    params = list(params)
    ready: list = [None] * len(params)
    cond = threading.Condition()
    state: dict = {"done": False, "error": None, "result": None, "want": None, "closed": False}

    meter: list = []  # (the backward thread's `helper_cpu.Meter`: the loop waits while it computes)

    def hook(i):
        def put(g):
            if meter:
                meter[0].report()
            with cond:
                ready[i] = g
                cond.notify_all()
                # lockstep: go on with the backward pass only once the loop asks for a gradient not made yet
                while not state["closed"] and (state["want"] is None or ready[state["want"]] is not None):
                    cond.wait()
            return g

        return put

    handles = [p.register_hook(hook(i)) for i, p in enumerate(params)]

    at = where()

    def backward():
        issuer.where = f"{at} (the backward pass of grad_generator)"
        meter.append(helper_cpu.Meter())
        try:
            state["result"] = torch.autograd.grad(loss, params, grad_outputs=grad_outputs, allow_unused=True)
        except BaseException as e:
            state["error"] = e
        finally:
            meter[0].report()
            with cond:
                state["done"] = True
                cond.notify_all()

    worker = threading.Thread(target=backward, name="monarch-backward", daemon=True)
    worker.start()
    try:
        for i in range(len(params)):
            with cond:
                state["want"] = i
                cond.notify_all()
                while ready[i] is None and not state["done"]:
                    cond.wait()
                state["want"] = None
                if state["error"] is not None:
                    raise state["error"]
                g = ready[i] if ready[i] is not None else state["result"][i]
            yield g
    finally:
        with cond:
            state["closed"] = True  # (an abandoned loop: the backward pass runs to its end)
            cond.notify_all()
        worker.join()
        for h in handles:
            h.remove()


COLLECTIVES.update(reduce=reduce, to_mesh=to_mesh)
