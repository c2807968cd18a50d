"""Tensor commands that involve several workers: collectives, and moves within and between meshes.

Every rank of a collective takes part even when its input failed (so no rank hangs), and then every
rank's result carries that failure."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from monarch.runtime.common import context
from monarch.runtime.wire import protocol as P
from monarch.runtime.worker import groups, local_reduce
from monarch.runtime.worker.engine.streams import current_sid
from monarch.runtime.worker.engine.table import Poison, on_device, table

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def reduce(cmd: P.Reduce) -> None:
    """A collective over group `cmd.gid`. A rank whose input failed still takes part (with zeros), and
    every rank's result is poisoned with that failure, since every result depends on every input."""
    src, out, where = cmd.src, cmd.out, cmd.where
    v = table.get(src)
    bad = not isinstance(v, torch.Tensor)
    try:
        device = on_device(cmd.device_type)
        group = groups.current.for_stream(cmd.gid, current_sid(), cmd.device_type)
        me = group.rank()
        in_place = out == src and not bad and cmd.reduction != "stack" and not cmd.scatter
        failed = me + 1 if bad else 0  # which rank's input failed (+1), if any
        local = None
        if local_reduce.usable(cmd.reduction, cmd.dtype, cmd.device_type):  # (not `stack`)
            local = groups.current.local(cmd.gid, current_sid(), group)  # (same answer on every rank)
        writable = in_place and v.is_contiguous()
        if writable:
            t = v.detach()  # reduce_: straight into the tensor, as a plain all_reduce does
        elif bad:
            t, writable = torch.zeros(cmd.shape, dtype=cmd.dtype, device=device), True
        elif local is not None:
            t = v.detach()  # (read straight into the shared slots: no copy of it first)
        else:
            t = v.detach().clone(memory_format=torch.contiguous_format)  # NCCL takes contiguous tensors only
        if local is not None:  # its workers share this machine: through shared memory, flag included
            result = t if writable else torch.empty(t.shape, dtype=t.dtype, device=device)
            with torch.profiler.record_function("shm:all_reduce"):  # (a profile counts it as communication)
                culprit = local.all_reduce(t, cmd.reduction, failed, out=result) - 1
        else:
            flag = torch.tensor([failed], device=device)
            failed_work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
            if cmd.reduction == "stack":
                parts = [torch.empty_like(t) for _ in range(cmd.size)]
                dist.all_gather(parts, t, group=group)
                result = torch.stack(parts)
            else:
                dist.all_reduce(t, op=getattr(dist.ReduceOp, _REDUCE_OPS[cmd.reduction]), group=group)
                result = t
            failed_work.wait()
            culprit = int(flag.item()) - 1
        if cmd.reduction == "stack":
            if cmd.scatter:  # all-to-all: rank i keeps the i-th slice of everyone's
                result = result[:, me] if result.dim() > 1 else result
        else:
            result = result / cmd.size if cmd.reduction == "avg" else result
            if cmd.scatter:
                result = result.chunk(cmd.size)[me].clone()
        if culprit >= 0:  # every rank takes part in sharing that failure
            mine = v if isinstance(v, Poison) else Poison("KeyError", f"tensor {src} is not on this worker", "", where)
            shared = _share_poison(group, device, mine if culprit == me else None, where)
    except Exception as e:
        table[out] = Poison.of(e, where)
        return
    if culprit >= 0:
        table[out] = mine if bad else shared
    elif out == src:  # reduce_: in place, so borrowed views see it too
        if result is not v and result.data_ptr() != v.data_ptr():
            with torch.no_grad():
                v.copy_(result)
    else:
        table[out] = result


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


def move_within(cmd: P.MoveWithin) -> None:
    """Point-to-point copies within the mesh; a poisoned source sends a flag, so that no receiver hangs."""
    me = dist.get_rank()
    shape, dtype, where = cmd.shape, cmd.dtype, cmd.where
    receiving = any(d == me and s != me for s, d in cmd.pairs)
    reqs, incoming, error = [], None, None
    try:
        device = on_device(cmd.device_type)
        for s, d in cmd.pairs:
            if s == me and d == me:
                v = table.get(cmd.src)
                table[cmd.out] = v.clone() if isinstance(v, torch.Tensor) else v
            elif s == me:
                v = table.get(cmd.src)
                bad = not isinstance(v, torch.Tensor)
                data = torch.zeros(shape, dtype=dtype, device=device) if bad else v.detach().contiguous()
                flag = torch.tensor([1 if bad else 0], device=device)  # on the data's device: one backend
                pg, peer = groups.current.pair(d, current_sid(), cmd.device_type)
                reqs += [pg.send([flag], peer, 0), pg.send([data], peer, 1)]
            elif d == me:
                flag, data = (
                    torch.zeros(1, dtype=torch.long, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                pg, peer = groups.current.pair(s, current_sid(), cmd.device_type)
                incoming = (flag, data)
                reqs += [pg.recv([flag], peer, 0), pg.recv([data], peer, 1)]
        for r in reqs:
            r.wait()
    except Exception as e:
        error, tb = e, traceback.format_exc()
    if receiving:
        if error is not None:
            table[cmd.out] = Poison.of(error, where, tb)
        else:
            flag, data = incoming
            table[cmd.out] = data if not flag.item() else Poison("RuntimeError", "the source value failed", "", where)
    elif error is not None:
        print(f"monarch: the move issued at {where} was not sent: {type(error).__name__}: {error}", file=sys.stderr)


def send_to(cmd: P.SendTo) -> None:
    """This worker's half of a move to another spawned mesh; a poisoned source sends a flag."""
    me = context.worker.rank if context.worker is not None else 0
    for s, _, name in cmd.links:
        if s != me:
            continue
        v = table.get(cmd.src)
        bad = isinstance(v, Poison) or not isinstance(v, torch.Tensor)
        data = torch.zeros(cmd.shape, dtype=cmd.dtype) if bad else v.detach().to("cpu").contiguous()
        try:
            pg = groups.current.link(name, 0, cmd.peer_mesh)
            pg.send([torch.tensor([1 if bad else 0])], 1, 0).wait()
            pg.send([data], 1, 1).wait()
        except Exception as e:  # the receiver poisons its value (if it is alive); this one stays as it was
            print(f"monarch: the move issued at {cmd.where} was not sent: {type(e).__name__}: {e}", file=sys.stderr)


def recv_from(cmd: P.RecvFrom) -> None:
    me = context.worker.rank if context.worker is not None else 0
    for _, d, name in cmd.links:
        if d != me:
            continue
        flag, data = torch.zeros(1, dtype=torch.long), torch.empty(cmd.shape, dtype=cmd.dtype)
        try:
            pg = groups.current.link(name, 1, cmd.peer_mesh)
            pg.recv([flag], 0, 0).wait()
            pg.recv([data], 0, 1).wait()
            value = data.to(on_device(cmd.device_type))
        except Exception as e:
            table[cmd.out] = Poison.of(e, cmd.where)
            continue
        if flag.item():
            table[cmd.out] = Poison("RuntimeError", "the source value (on the other mesh) failed", "", cmd.where)
        else:
            table[cmd.out] = value
