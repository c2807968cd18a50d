"""The tensor engine on a worker: a table from reference ids to tensors, and the ops that fill it.

Ops arrive in batches (`run`), in order; nothing is sent back unless the controller asks for a value
(`fetch`). An op that fails stores a `Poison` for its results, and every op that uses a poisoned
value is poisoned in turn, so the worker keeps serving and independent values stay fetchable.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from monarch.runtime import context, groups

_table: dict[int, Any] = {}
_ops: dict[str, Any] = {}
_warned_cuda = False


@dataclass
class Poison:
    """Stands for a value whose computation failed (here or in an op it depends on)."""

    exc_type: str
    message: str
    traceback: str
    issued_at: str
    """The controller line that issued the failing op."""
    failed_on: str | None = None
    """Where it failed when not on this worker: e.g. "rank 3 (its input to the collective issued at ...)"."""

    @classmethod
    def of(cls, e: BaseException, where: str, tb: str | None = None) -> Poison:
        """The poison for exception `e`, being handled now (its traceback, unless `tb` is given)."""
        return cls(type(e).__qualname__, str(e), traceback.format_exc() if tb is None else tb, where)


class Ref:
    """A reference to a tensor in the worker's table (pickles as its id)."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self):
        return Ref, (self.id,)


class PoisonedValueError(RuntimeError):
    """Raised when a fetched value depends on an op that failed on this worker."""


def _op(name: str):
    fn = _ops.get(name)
    if fn is None:
        ns, _, rest = name.partition("::")
        base, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), base)
        fn = _ops[name] = getattr(packet, overload or "default")
    return fn


def _device(value: Any) -> Any:
    """`cuda` on a worker without CUDA: the CPU, with one warning."""
    global _warned_cuda
    dev = torch.device(value) if isinstance(value, str | torch.device) else value
    if isinstance(dev, torch.device) and dev.type == "cuda":
        w = context.worker
        if not torch.cuda.is_available():
            if not _warned_cuda:
                _warned_cuda = True
                warnings.warn("no CUDA on this worker: tensors requested on 'cuda' are made on the CPU", stacklevel=2)
            return torch.device("cpu")
        if w is not None and w.device.type == "cuda":
            return w.device  # each worker owns one GPU; the controller's `cuda:0` means "mine"
    return dev


def _on_device(dev_type: str) -> torch.device:
    """The device a tensor the controller describes as `dev_type` ("cpu" or "cuda") lives on here."""
    w = context.worker
    if dev_type == "cuda" and w is not None and w.device.type == "cuda":
        return w.device
    return torch.device("cpu")


def _resolve(obj: Any, poisons: list) -> Any:
    if isinstance(obj, Ref):
        v = _table.get(obj.id)
        if isinstance(v, Poison):
            poisons.append(v)
        elif v is None:
            poisons.append(Poison("KeyError", f"tensor {obj.id} was freed or never made here", "", "?"))
        return v
    if isinstance(obj, list | tuple):
        return type(obj)(_resolve(o, poisons) for o in obj)
    if isinstance(obj, dict):
        return {k: (_device(v) if k == "device" else _resolve(v, poisons)) for k, v in obj.items()}
    return obj


def _store(ids: Any, value: Any) -> None:
    if isinstance(ids, list | tuple):
        for i, v in zip(ids, value if isinstance(value, list | tuple) else [value] * len(ids)):
            _store(i, v)
    elif ids is not None:
        _table[ids] = value


class _StreamThread:
    """A stream other than main: its commands run in order on their own thread (and, on a GPU, its
    own CUDA stream, so its kernels overlap the main stream's)."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"monarch-stream-{sid}", daemon=True).start()

    def _loop(self) -> None:
        _here.sid = self.sid
        w = context.worker
        if torch.cuda.is_available() and w is not None and w.device.type == "cuda":
            torch.cuda.set_device(w.device)
            torch.cuda.set_stream(torch.cuda.Stream(w.device))
        while True:
            fn = self.queue.get()
            try:
                fn()
            except Exception:  # our bug; ops poison their results themselves
                traceback.print_exc()


_streams: dict[int, _StreamThread] = {}
_here = threading.local()
"""`.sid` on a stream thread: the stream it runs."""
_stream_groups: dict[tuple[int, int], Any] = {}


def _group(gid: int, dev_type: str = "cpu") -> Any:
    """The group `gid` for the stream running here. Collectives of two streams over one group would
    run in whatever order each worker's threads reach them, and gloo or NCCL would pair the wrong ones;
    so each stream other than main gets its own copy of the group, per device type (made on first use:
    gloo for CPU tensors, NCCL for CUDA ones)."""
    group = groups._groups[gid]
    sid = getattr(_here, "sid", 0)
    if sid == 0 or group is None or isinstance(group, BaseException):
        return group
    copy = _stream_groups.get((sid, gid, dev_type))
    if copy is None:
        ranks = dist.get_process_group_ranks(group)
        name = f"{groups.prefix}stream/{sid}/{gid}/{dev_type}/{'-'.join(map(str, ranks))}/"
        copy = _stream_groups[(sid, gid, dev_type)] = _make_group(name, group.rank(), ranks, dev_type)
    return copy


def _thread_store() -> Any:
    """This thread's own connection to the mesh's store. One connection serves one request at a time:
    a stream thread waiting in it for a peer would keep another thread from publishing what that
    peer waits for (two streams making their groups at once deadlocked)."""
    if threading.current_thread() is threading.main_thread():
        return groups.store
    store = getattr(_here, "store", None)
    if store is None:
        store = _here.store = groups.store.clone()
        store.set_timeout(groups.timeout)
    return store


def _make_group(name: str, rank: int, ranks: list[int], dev_type: str) -> Any:
    """A group of `ranks` meeting under `name` in the mesh's store: gloo, or NCCL for CUDA tensors."""
    store = dist.PrefixStore(name, _thread_store())
    if dev_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = groups.timeout
        opts.global_ranks_in_group = ranks
        return dist.ProcessGroupNCCL(store, rank, len(ranks), opts)  # its communicator is made on first use
    return dist.ProcessGroupGloo(store, rank, len(ranks), groups.timeout)


_stream_pairs: dict[tuple, Any] = {}


def _p2p(peer: int, dev_type: str) -> tuple[Any, int]:
    """(backend, the peer's rank in it) for sends between this worker and global rank `peer`, on the
    stream running here: the mesh's default group on main; elsewhere a two-worker group of the stream's
    own, made by the two alone (a copy of the whole group would wait for workers the move skips)."""
    me = dist.get_rank()
    sid = getattr(_here, "sid", 0)
    if sid == 0:
        return groups._groups[groups.WORLD]._get_backend(torch.device(dev_type)), peer
    lo, hi = sorted((me, peer))
    pg = _stream_pairs.get((sid, lo, hi, dev_type))
    if pg is None:
        name = f"{groups.prefix}stream/{sid}/pair/{lo}-{hi}/{dev_type}/"
        pg = _stream_pairs[(sid, lo, hi, dev_type)] = _make_group(name, 0 if me == lo else 1, [lo, hi], dev_type)
    return pg, 1 if me == lo else 0


def _on(sid: int, fn) -> None:
    """Run `fn` on stream `sid`, after what is already queued there (main: right now, on this thread)."""
    if sid == 0:
        fn()
        return
    st = _streams.get(sid)
    if st is None:
        st = _streams[sid] = _StreamThread(sid)
    st.queue.put(fn)


def _sync_streams() -> None:
    """Wait until every stream has run what was queued on it (before a value is read)."""
    events = []
    for st in list(_streams.values()):
        ev = threading.Event()
        st.queue.put(ev.set)
        events.append(ev)
    for ev in events:
        ev.wait()
    if events and torch.cuda.is_available():
        torch.cuda.synchronize()  # and until their kernels are done


def run(batch: list[tuple]) -> None:
    """Execute a batch of commands from the controller, in order (per stream)."""
    for cmd in batch:
        if cmd[0] == "s":
            _on(cmd[1], lambda c=cmd[2]: _execute(c))
        else:
            _execute(cmd)


class _Mark:
    """A point in one stream that another waits for: a thread event, plus a CUDA event on a GPU."""

    def __init__(self) -> None:
        self.host = threading.Event()
        self.cuda = None

    def record(self) -> None:
        if torch.cuda.is_available():
            self.cuda = torch.cuda.Event()
            self.cuda.record()  # on this thread's current CUDA stream
        self.host.set()

    def wait(self) -> None:
        self.host.wait()
        if self.cuda is not None:
            torch.cuda.current_stream().wait_event(self.cuda)


def _execute(cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "borrow":
        _, _, from_sid, to_sid, src, alias = cmd
        made = _Mark()
        _on(from_sid, made.record)  # the borrower waits for what the origin stream queued before
        _on(to_sid, lambda: (made.wait(), _table.__setitem__(alias, _table.get(src))))
    elif kind == "drop":
        _, _, from_sid, to_sid, alias = cmd
        done = _Mark()
        _on(to_sid, done.record)  # the origin waits for the borrower's ops
        _on(from_sid, lambda: (done.wait(), _table.pop(alias, None)))
    else:
        _run_one(cmd)


def _run_one(cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "op":
        _, name, args, kwargs, out, where = cmd
        _run_op(name, args, kwargs, out, where)
    elif kind == "reduce":
        _reduce(*cmd[1:])
    elif kind == "to_mesh":
        _to_mesh(*cmd[1:])
    elif kind == "send_to":
        _send_to(*cmd[1:])
    elif kind == "recv_from":
        _recv_from(*cmd[1:])
    elif kind == "alias":  # `t.data = other`: t's id now names other's tensor
        _table[cmd[1]] = _table.get(cmd[2])
    elif kind == "del":
        for i in cmd[1]:
            _table.pop(i, None)
    elif kind == "seed":
        torch.manual_seed(cmd[1])
    elif kind == "poison":  # an op the controller could not send
        _, out, exc_type, message, where = cmd
        _store(out, Poison(exc_type, message, "", where))


def _run_op(name: str, args: tuple, kwargs: dict, out: Any, where: str) -> None:
    poisons: list[Poison] = []
    a = _resolve(args, poisons)
    k = _resolve(kwargs, poisons)
    if poisons:
        if name.startswith("aten::_foreach_") and _foreach_where_fine(name, args, kwargs, a, k, out, where):
            return
        _fail(name, args, kwargs, out, poisons[0])
        return
    try:
        value = _op(name)(*a, **k)
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
        _fail(name, args, kwargs, out, Poison.of(e, where, tb))
        return
    _store(out, value)


def _foreach_where_fine(name: str, args: tuple, kwargs: dict, a: tuple, k: dict, out: Any, where: str) -> bool:
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
                    bad[i] = e if isinstance(e, Poison) else Poison("KeyError", "an input was freed", "", where)
    good = [i for i in range(n) if i not in bad]

    def pick(v):
        return type(v)(v[i] for i in good) if per_position(v) else v

    try:
        value = _op(name)(*map(pick, a), **{key: pick(v) for key, v in k.items()}) if good else None
    except Exception as e:
        _fail(name, args, kwargs, out, Poison.of(e, where))
        return True
    if isinstance(out, list) and len(out) == n:  # out of place: one result per position
        results = iter(value or ())
        for i in range(n):
            _store(out[i], bad[i] if i in bad else next(results))
    written = written_args(_op(name), args, kwargs)
    for i, poison in bad.items():  # in place: the tensors at failed positions no longer hold their values
        for v in written:
            if per_position(v) and isinstance(v[i], Ref):
                _table[v[i].id] = poison
    return True


_UNANNOTATED_WRITES = {
    f"aten::{op}": ((3, 4), 5) for op in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
}
"""Ops that write arguments their schema does not mark: (positions, the `training` flag's position)."""


def written_args(op: Any, args: tuple, kwargs: dict) -> list:
    """The arguments op `op` writes (handles or Refs, or lists of them for foreach ops): those its schema
    marks, and those it writes without saying so (batch norm's running stats, when training)."""
    written = []
    spec = _UNANNOTATED_WRITES.get(op.name())
    if spec is not None and len(args) > spec[1] and args[spec[1]]:
        written += [args[i] for i in spec[0]]
    schema = op._schema
    for i, arg in enumerate(schema.arguments if schema.is_mutable else ()):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written


def _fail(name: str, args: tuple, kwargs: dict, out: Any, poison: Poison) -> None:
    """Poison an op's results, and the tensors it would have written (in-place ops, out=): they no
    longer hold what the program says they hold."""
    _store(out, poison)
    try:
        written = written_args(_op(name), args, kwargs)
    except Exception:  # the op itself is unknown here: it wrote nothing
        return
    for v in written:
        for ref in v if isinstance(v, list | tuple) else (v,):
            if isinstance(ref, Ref):
                _table[ref.id] = poison


_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def _reduce(
    src: int, out: int, gid: int, size: int, reduction: str, scatter: bool, shape: tuple, dtype, dev_type: str, where
) -> None:
    """A collective over the group `gid`. A rank whose input failed still takes part (with zeros), and
    every rank's result is poisoned with that failure, since every result depends on every input."""
    v = _table.get(src)
    bad = not isinstance(v, torch.Tensor)
    try:
        device = _on_device(dev_type)
        group = _group(gid, dev_type)
        me = group.rank()
        in_place = out == src and not bad and reduction != "stack" and not scatter
        if in_place and v.is_contiguous():
            t = v.detach()  # reduce_: straight into the tensor, as a plain all_reduce does
        elif bad:
            t = torch.zeros(shape, dtype=dtype, device=device)
        else:
            t = v.detach().clone(memory_format=torch.contiguous_format)  # NCCL takes contiguous tensors only
        failed = torch.tensor([me + 1 if bad else 0], device=device)  # which rank's input failed (+1), if any
        failed_work = dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if reduction == "stack":
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            result = torch.stack(parts)
            if scatter:  # all-to-all: rank i keeps the i-th slice of everyone's
                result = result[:, me] if result.dim() > 1 else result
        else:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]), group=group)
            result = t / size if reduction == "avg" else t
            if scatter:
                result = result.chunk(size)[me].clone()
        failed_work.wait()
        culprit = int(failed.item()) - 1
        if culprit >= 0:  # every rank takes part in sharing that failure
            mine = v if isinstance(v, Poison) else Poison("KeyError", f"tensor {src} is not on this worker", "", where)
            shared = _share_poison(group, device, mine if culprit == me else None, where)
    except Exception as e:
        _table[out] = Poison.of(e, where)
        return
    if culprit >= 0:
        _table[out] = mine if bad else shared
    elif out == src:  # reduce_: in place, so borrowed views see it too
        if result is not v and result.data_ptr() != v.data_ptr():
            with torch.no_grad():
                v.copy_(result)
    else:
        _table[out] = result


def _share_poison(group: Any, device: torch.device, mine: Poison | None, where: str) -> Poison:
    """The failure of the one rank that passes `mine`, on every rank of `group` (a collective: all call it).

    Travels as JSON in a byte tensor that only that rank fills (a sum), never as a pickle."""
    data = b""
    if mine is not None:
        me = context.worker.rank if context.worker is not None else 0
        data = json.dumps([mine.exc_type, mine.message, mine.traceback, mine.issued_at, me]).encode()
    n = torch.tensor([len(data)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    buf = buf.to(device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    exc_type, message, tb, issued_at, rank = json.loads(bytes(buf.cpu().numpy()).decode())
    return Poison(exc_type, message, tb, issued_at, f"rank {rank} (its input to the collective issued at {where})")


def _to_mesh(src: int, out: int, pairs: list, shape: tuple, dtype, dev_type: str, where: str) -> None:
    """Point-to-point copies within the mesh; a poisoned source sends a flag, so that no receiver hangs."""
    me = dist.get_rank()
    receiving = any(d == me and s != me for s, d in pairs)
    reqs, incoming, error = [], None, None
    try:
        device = _on_device(dev_type)
        for s, d in pairs:
            if s == me and d == me:
                v = _table.get(src)
                _table[out] = v.clone() if isinstance(v, torch.Tensor) else v
            elif s == me:
                v = _table.get(src)
                bad = not isinstance(v, torch.Tensor)
                data = torch.zeros(shape, dtype=dtype, device=device) if bad else v.detach().contiguous()
                flag = torch.tensor([1 if bad else 0], device=device)  # on the data's device: one backend
                pg, peer = _p2p(d, dev_type)
                reqs += [pg.send([flag], peer, 0), pg.send([data], peer, 1)]
            elif d == me:
                flag, data = (
                    torch.zeros(1, dtype=torch.long, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                pg, peer = _p2p(s, dev_type)
                incoming = (flag, data)
                reqs += [pg.recv([flag], peer, 0), pg.recv([data], peer, 1)]
        for r in reqs:
            r.wait()
    except Exception as e:
        error, tb = e, traceback.format_exc()
    if receiving:
        if error is not None:
            _table[out] = Poison.of(error, where, tb)
        else:
            flag, data = incoming
            _table[out] = data if not flag.item() else Poison("RuntimeError", "the source value failed", "", where)
    elif error is not None:
        print(f"monarch: the move issued at {where} was not sent: {type(error).__name__}: {error}", file=sys.stderr)


_links: dict[str, Any] = {}
"""Two-worker gloo groups to workers of other spawned meshes, by link name."""


def _link(name: str, rank: int, peer_mesh: int) -> Any:
    """The link `name` (sender rank 0, receiver rank 1). The first use waits for the other side to
    arrive, or for the controller to mark the other mesh gone (then it raises: nobody waits 60 s)."""
    pg = _links.get(name)
    if pg is None:
        store = dist.PrefixStore(f"monarch/link/{name}/", _thread_store())
        store.set(f"here/{rank}", b"1")
        other, gone = f"here/{1 - rank}", groups.gone_key(peer_mesh)
        pause, deadline = 0.0005, time.monotonic() + groups.timeout.total_seconds()
        while not store.check([other]):  # check, not wait: a timed-out wait logs a warning
            if _thread_store().check([gone]):
                raise RuntimeError("the other mesh stopped or failed before it took its side of the move")
            if time.monotonic() > deadline:  # alive but never there, as long as a collective would wait
                raise TimeoutError(f"the other mesh did not take its side of the move in {groups.timeout}")
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        pg = _links[name] = dist.ProcessGroupGloo(store, rank, 2, groups.timeout)
    return pg


def _send_to(src: int, links: list, shape: tuple, dtype, where: str, peer_mesh: int) -> None:
    """This worker's half of a move to another spawned mesh; a poisoned source sends a flag."""
    me = context.worker.rank if context.worker is not None else 0
    for s, _, name in links:
        if s != me:
            continue
        v = _table.get(src)
        bad = isinstance(v, Poison) or not isinstance(v, torch.Tensor)
        data = torch.zeros(shape, dtype=dtype) if bad else v.detach().to("cpu").contiguous()
        try:
            pg = _link(name, 0, peer_mesh)
            pg.send([torch.tensor([1 if bad else 0])], 1, 0).wait()
            pg.send([data], 1, 1).wait()
        except Exception as e:  # the receiver poisons its value (if it is alive); this one stays as it was
            print(f"monarch: the move issued at {where} was not sent: {type(e).__name__}: {e}", file=sys.stderr)


def _recv_from(out: int, links: list, shape: tuple, dtype, dev_type: str, where: str, peer_mesh: int) -> None:
    me = context.worker.rank if context.worker is not None else 0
    for _, d, name in links:
        if d != me:
            continue
        flag, data = torch.zeros(1, dtype=torch.long), torch.empty(shape, dtype=dtype)
        try:
            pg = _link(name, 1, peer_mesh)
            pg.recv([flag], 0, 0).wait()
            pg.recv([data], 0, 1).wait()
            value = data.to(_on_device(dev_type))
        except Exception as e:
            _table[out] = Poison.of(e, where)
            continue
        if flag.item():
            _table[out] = Poison("RuntimeError", "the source value (on the other mesh) failed", "", where)
        else:
            _table[out] = value


def fetch(ref_id: int) -> torch.Tensor:
    """This worker's value of a tensor (called by reference from `monarch.inspect`)."""
    _sync_streams()
    v = _table.get(ref_id)
    if isinstance(v, Poison):
        raise PoisonedValueError(
            f"this value depends on an op that failed on {v.failed_on or 'this worker'}: {v.exc_type}: {v.message}\n"
            f"the failing op was issued at {v.issued_at}\n\nworker traceback:\n{v.traceback}"
        )
    if v is None:
        raise KeyError(f"tensor {ref_id} is not on this worker (freed, or made on another mesh)")
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        if v.untyped_storage().nbytes() > v.nbytes:  # a view: send its elements, not the whole storage
            v = v.clone()
    return v


def table_size() -> int:
    """How many values this worker holds (for tests of lifetime)."""
    return len(_table)
