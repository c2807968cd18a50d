"""Running the controller's tensor commands on a worker, in order, through a handler table.

Nothing is sent back unless the controller asks for a value (`table.fetch`). An op that fails stores a
`Poison` for its results, and every op that uses a poisoned value is poisoned in turn, so the worker
keeps serving and independent values stay fetchable.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from monarch.runtime.common.op_schema import written_args
from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.protocol import Ref
from monarch.runtime.worker.engine import comms, streams
from monarch.runtime.worker.engine import profiler as profiling
from monarch.runtime.worker.engine.table import Poison, resolve, store, table

_ops: dict[str, Any] = {}


def run(batch: list) -> None:
    """Execute a batch of commands, in order (per stream)."""
    handlers = _HANDLERS
    for cmd in batch:
        kind = type(cmd)
        if kind is P.OnStream:
            streams.on(cmd.stream_id, lambda c=cmd.cmd: _execute(c))
        elif around is None:
            handlers[kind](cmd)
        else:
            around(cmd, handlers[kind])


def run_packed(items: list) -> None:
    """`run` for a batch as it travels (`protocol.pack_commands`): its ops, most of it, straight from their
    tuples, without making an `Op` of each first."""
    if around is not None:
        run(P.unpack_commands(items))
        return
    handlers = _HANDLERS
    for t in items:
        if type(t) is tuple and len(t) == 6 and t[0] == _OP_TAG and type(t[0]) is int:
            run_op(t[1], t[2], t[3], t[4], t[5])
            continue
        cmd = P.unpack(t)
        if type(cmd) is P.OnStream:
            cmd.cmd = P.unpack(cmd.cmd)
            streams.on(cmd.stream_id, lambda c=cmd.cmd: _execute(c))
        else:
            handlers[type(cmd)](cmd)


_OP_TAG = P.Op._tag

around: Any = None
"""When set, `around(cmd, handler)` runs each command instead of `handler(cmd)` (memory recording runs each in a
range named for the controller's line that issued it)."""


def _execute(cmd: Any) -> None:
    if around is None:
        _HANDLERS[type(cmd)](cmd)
    else:
        around(cmd, _HANDLERS[type(cmd)])


def _op(name: str):
    fn = _ops.get(name)
    if fn is None:
        ns, _, rest = name.partition("::")
        base, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), base)
        fn = _ops[name] = getattr(packet, overload or "default")
    return fn


def _call(name: str):
    """What calling op `name` calls (`OpOverload.__call__` is one more Python call per op)."""
    op = _op(name)
    fn = _calls[name] = getattr(op, "_op", op)
    return fn


_calls: dict[str, Any] = {}


def _borrow_start(cmd: P.BorrowStart) -> None:
    made = streams.Mark()
    streams.on(cmd.from_stream, made.record)  # the borrower waits for what the origin stream queued before
    streams.on(cmd.to_stream, lambda: (made.wait(), table.__setitem__(cmd.alias, table.get(cmd.src))))


def _borrow_end(cmd: P.BorrowEnd) -> None:
    done = streams.Mark()
    streams.on(cmd.to_stream, done.record)  # the origin waits for the borrower's ops
    streams.on(cmd.from_stream, lambda: (done.wait(), table.pop(cmd.alias, None)))


def _alias(cmd: P.Alias) -> None:
    table[cmd.ref] = table.get(cmd.target)  # `t.data = other`: t's id now names other's tensor


def _free(cmd: P.Free) -> None:
    for i in cmd.refs:
        table.pop(i, None)


def _seed(cmd: P.Seed) -> None:
    torch.manual_seed(cmd.seed)


def _fail_results(cmd: P.FailResults) -> None:
    store(cmd.out, Poison(cmd.exc_type, cmd.message, "", cmd.where))


def _run_op(cmd: P.Op) -> None:
    run_op(cmd.name, cmd.args, cmd.kwargs, cmd.out, cmd.where)


def run_op(name: str, args: tuple, kwargs: dict, out: Any, where: str) -> None:
    """Run one `Op` (given by its fields: most of a batch runs from the tuples it travels as)."""
    poisons: list[Poison] = []
    a = resolve(args, poisons)
    k = resolve(kwargs, poisons) if kwargs else kwargs
    if poisons:
        cmd = P.Op(name, args, kwargs, out, where)
        if name.startswith("aten::_foreach_") and _foreach_where_fine(cmd, a, k):
            return
        _fail(cmd, poisons[0])
        return
    try:
        value = (_calls.get(name) or _call(name))(*a, **k)
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
        _fail(P.Op(name, args, kwargs, out, where), Poison.of(e, where, tb))
        return
    if type(out) is int:
        table[out] = value
    else:
        store(out, value)


def _foreach_where_fine(cmd: P.Op, a: tuple, k: dict) -> bool:
    """A foreach op with failed inputs: run it on the positions whose inputs are fine and poison the others
    (as the op per tensor would), instead of every position. False if the lists cannot be matched up."""
    n = next((len(v) for v in a if isinstance(v, list | tuple)), 0)
    if not n:
        return False

    def per_position(v):
        return isinstance(v, list | tuple) and len(v) == n

    bad: dict[int, Poison] = {}
    for v in (*a, *k.values()):
        if per_position(v):
            for i, e in enumerate(v):
                if i not in bad and (isinstance(e, Poison) or (e is None and isinstance(v, list))):
                    bad[i] = e if isinstance(e, Poison) else Poison("KeyError", "an input was freed", "", cmd.where)
    good = [i for i in range(n) if i not in bad]

    def pick(v):
        return type(v)(v[i] for i in good) if per_position(v) else v

    try:
        value = _op(cmd.name)(*map(pick, a), **{key: pick(v) for key, v in k.items()}) if good else None
    except Exception as e:
        _fail(cmd, Poison.of(e, cmd.where))
        return True
    out = cmd.out
    if isinstance(out, list) and len(out) == n:  # out of place: one result per position
        results = iter(value or ())
        for i in range(n):
            store(out[i], bad[i] if i in bad else next(results))
    written = written_args(_op(cmd.name), cmd.args, cmd.kwargs)
    for i, poison in bad.items():  # in place: the tensors at failed positions no longer hold their values
        for v in written:
            if per_position(v) and isinstance(v[i], Ref):
                table[v[i].id] = poison
    return True


def _fail(cmd: P.Op, poison: Poison) -> None:
    """Poison an op's results, and the tensors it would have written (in-place ops, out=): they no
    longer hold what the program says they hold."""
    store(cmd.out, poison)
    try:
        written = written_args(_op(cmd.name), cmd.args, cmd.kwargs)
    except Exception:  # the op itself is unknown here: it wrote nothing
        return
    for v in written:
        for ref in v if isinstance(v, list | tuple) else (v,):
            if isinstance(ref, Ref):
                table[ref.id] = poison


def _call_actor(cmd: P.CallActor) -> None:
    """`rref`: an actor's endpoint on this worker's tensors; its result kept as the command's outputs."""
    from monarch.runtime.worker import actors  # (the actors of this process; imported when one is called)

    poisons: list[Poison] = []
    a = resolve(cmd.args, poisons)
    k = resolve(cmd.kwargs, poisons) if cmd.kwargs else cmd.kwargs
    if poisons:
        store(cmd.out, poisons[0])
        return
    try:
        value = actors.invoke(cmd.actor, cmd.endpoint, a, k)
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        store(cmd.out, Poison.of(e, cmd.where, tb))
        return
    store(cmd.out, value)


_HANDLERS = {
    P.Op: _run_op,
    P.Reduce: comms.reduce,
    P.MoveWithin: comms.move_within,
    P.SendTo: comms.send_to,
    P.RecvFrom: comms.recv_from,
    P.Alias: _alias,
    P.Free: _free,
    P.Seed: _seed,
    P.FailResults: _fail_results,
    P.CallActor: _call_actor,
    P.BorrowStart: _borrow_start,
    P.BorrowEnd: _borrow_end,
    P.ProfileStart: lambda c: profiling.start(c.config),
    P.ProfileStep: lambda c: profiling.step(),
    P.ProfileMark: lambda c: profiling.mark(c.name, c.enter),
}
