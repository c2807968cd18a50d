"""Measurements for `monarch.Simulator.calibrate()`, run on every worker of a real mesh at once (so that
workers sharing cores measure what they get when they all run). Collectives are measured from the
controller, through the tensor engine (`monarch.runtime.simulator.calibration`).

Commands go through the tensor engine's own worker half (decoding a pickled batch, the handler table,
the reduce with its failure check), so the per-command costs are the ones a real program pays.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time

import torch

from monarch.runtime.wire import codec
from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.protocol import Ref
from monarch.runtime.worker.engine import commands
from monarch.runtime.worker.engine.streams import sync_streams
from monarch.runtime.worker.engine.table import table

_BASE = 1 << 40
"""Table ids used here (far above any id the controller hands out)."""


def _together() -> None:
    """Wait for every worker of the mesh: each measurement runs on all of them at once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _median(fn, repeat: int) -> float:
    _together()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _repeats(fn, sync, seconds: float = 0.1) -> int:
    """How many calls of `fn` take `seconds`: a sample that long spans many of the scheduler's time slices,
    so workers sharing cores measure the rate they get together (a 3 ms sample often ran alone). The same
    number on every worker (the fewest any found), so that each does the same work in `_shared_time`."""
    fn()  # (warm)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    k = max(1, int(seconds / max(time.perf_counter() - t, 1e-9)))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        n = torch.tensor([k])
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        k = int(n.item())
    return k


def _shared_time(fn, repeat: int) -> float:
    """The median over `repeat` samples of how long `fn` takes when every worker runs it at once, from when
    all start until all have ended: on shared cores the rate each gets while all compute, as in a training
    step. (Timed to each worker's own end instead, a worker that finished first left the others the cores,
    and their next samples ran faster: a rate that moved by a third between calibrations.)"""
    times = []
    for _ in range(repeat):
        _together()
        t = time.perf_counter()
        fn()
        _together()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _batch(cmds: list) -> list:
    return codec.dumps(P.pack_commands(cmds))


def _run(frames: list) -> None:
    commands.run(P.unpack_commands(codec.loads(frames[0], frames[1:])))


def measure(n_ops: int = 1000, quick: bool = False) -> dict:
    """This worker's rates and per-command costs (seconds, FLOP/s, bytes/s)."""
    rep = 3 if quick else 7
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = _BASE, _BASE + 1
    table[x] = torch.ones(4, device=dev)
    table[y] = torch.ones(4, device=dev)
    out: dict = {"device": dev}
    try:
        # one tiny op per command, on the main stream (what the command thread pays per op)
        main = _batch([P.Op("aten::add_.Tensor", (Ref(x), Ref(y)), {}, x, "calibrate")] * n_ops)
        out["main_op"] = _median(lambda: (_run(main), sync_streams()), rep) / n_ops
        # the same on a side stream: what the command thread pays to hand it on, and the stream to run it
        side_cmd = P.OnStream(1 << 20, P.Op("aten::add_.Tensor", (Ref(x), Ref(y)), {}, x, "calibrate"))
        side = _batch([side_cmd] * n_ops)
        out["side_enqueue"] = _median(lambda: _run(side), rep) / n_ops
        # of which decoding the batch (done for all of it before its first command runs)
        out["decode"] = _median(lambda: P.unpack_commands(codec.loads(side[0], side[1:])), rep) / n_ops
        sync_streams()
        out["side_total"] = _median(lambda: (_run(side), sync_streams()), rep) / n_ops
        # compute and memory rates, straight torch (the ops a model issues are as fast as torch's)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        # (a GPU reaches its rate only on large matmuls and copies: small ones measure the launches)
        sizes = ((256,) if quick else (256, 512)) if dev == "cpu" else ((2048,) if quick else (2048, 4096))
        for n in sizes:
            a = torch.randn(n, n, device=dev)
            k = _repeats(lambda a=a: a @ a, sync)
            t = _shared_time(lambda a=a, k=k: ([a @ a for _ in range(k)], sync()), rep) / k
            out[f"matmul{n}_flops"] = 2 * n**3 / t
            del a
        # (into a tensor made once: each fresh result of `big + 1.0` was memory the kernel had to map and zero
        # on a CPU, a cost that moved the figure from 2 to 16 GB/s between calibrations on one machine)
        big = torch.ones(1 << (22 if dev == "cpu" else 26), device=dev)
        dst = torch.empty_like(big)
        t = _shared_time(lambda: ([torch.add(big, 1.0, out=dst) for _ in range(20)], sync()), rep) / 20
        out["mem_bw"] = 2 * big.numel() * big.element_size() / t
        if dev == "cpu":
            out.update(_contention(rep))
            out["cold_ops"] = _cold_ops(x, y, 3 if quick else 5)
    finally:
        table.pop(x, None)
        table.pop(y, None)
    return out


COLD_BYTES = (1 << 18, 1 << 19, 1 << 20, 1 << 22)
"""`_cold_ops`' copies: this many bytes each (read, then written: twice as many moved)."""
SMALL_RUN = 5
"""`_cold_ops`' small ops after each copy, each of another kind (as a step's views, transposes and adds)."""


def _cold_ops(x: int, y: int, rep: int) -> list[list[float]]:
    """``[[bytes, extra], ...]``: seconds each of a run of small ops costs beyond what it costs in a loop of
    small ops, when an op that moved ``bytes`` ran just before the run (a step's matmuls and activations move
    more than the caches hold: the interpreter's and ATen's working set is gone, and each kind of op pays to
    bring its own back). Every worker at once, through the engine: runs of `SMALL_RUN` small ops, each after
    a copy or not, alternately; each small op timed as it runs (`time_ops`), the copies not."""
    w, src, dst, out = _BASE + 2, _BASE + 3, _BASE + 4, _BASE + 5
    table[w] = torch.ones(64, 64)
    small = [
        P.Op("aten::view", (Ref(w), [32, 128]), {}, out, "calibrate"),
        P.Op("aten::t", (Ref(w),), {}, out, "calibrate"),
        P.Op("aten::add_.Tensor", (Ref(x), Ref(y)), {}, x, "calibrate"),
        P.Op("aten::expand", (Ref(x), [3, 4]), {}, out, "calibrate"),
        P.Op("aten::transpose.int", (Ref(w), 0, 1), {}, out, "calibrate"),
    ]
    assert len(small) == SMALL_RUN

    def small_ops(batch: list, runs: int) -> float:
        _together()
        time_ops()
        _run(batch)
        return sum(e - t for name, t, e in timed_ops() if name != "aten::copy_") / (runs * SMALL_RUN)

    points = []
    try:
        for nbytes in COLD_BYTES:
            table[src] = torch.ones(nbytes // 4)
            table[dst] = torch.empty(nbytes // 4)
            copy = P.Op("aten::copy_", (Ref(dst), Ref(src)), {}, dst, "calibrate")
            runs = 40
            after, alone = _batch([copy, *small] * runs), _batch(small * runs)
            extra = []
            for i in range(rep):  # (in either order by turns: the machine's speed moves)
                if i % 2:
                    base = small_ops(alone, runs)
                    extra.append(small_ops(after, runs) - base)
                else:
                    extra.append(small_ops(after, runs) - small_ops(alone, runs))
            points.append([float(2 * nbytes), max(statistics.median(extra), 0.0)])
    finally:
        for ref in (w, src, dst, out):
            table.pop(ref, None)
    return points


def time_ops() -> None:
    """Time every tensor command this worker runs from now on, until `timed_ops()`."""
    record: list[tuple[str, float, float]] = []

    def around(cmd, handler) -> None:
        t = time.perf_counter()
        handler(cmd)
        record.append((cmd.name if type(cmd) is P.Op else type(cmd).__name__, t, time.perf_counter()))

    around.record = record
    commands.around = around


def timed_ops() -> list[tuple[str, float, float]]:
    """(op name or command type, start, end) of each command run since `time_ops()`, in the order they ended
    (`time.perf_counter()`: the host's monotonic clock, which the controller shares); stops timing."""
    around, commands.around = commands.around, None
    return getattr(around, "record", [])


_CAP = 50.0
"""The largest contention factor reported (a collective that made no progress at all reads as this)."""


def _contention(rep: int) -> dict:
    """How compute on the main thread and a collective on a stream thread slow each other down when they
    overlap on a CPU worker, as in a training step where gradients are reduced during the backward pass.

    Every worker starts a small reduce on a stream thread (the engine's: through shared memory where the
    workers share a machine, else the data and a failure flag, then the flag read) and at once computes on
    its main thread about half as long as the reduce takes alone.
    From when each ends, with both alone as the baseline: `fc`, how many times longer the compute ran
    while they overlapped, and `fm`, the same for the reduce (the simulator's sharing model, inverted)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    from monarch.runtime.common.groups import WORLD
    from monarch.runtime.worker import groups, local_reduce

    data, flag = torch.ones(256), torch.zeros(1)
    local = None  # (the engine's way on one machine: `local_reduce`; met here by every rank at once)
    if groups.current is not None and local_reduce.usable("sum", data.dtype, "cpu"):
        local = groups.current.local(WORLD, 0, dist.group.WORLD)

    def reduce() -> None:
        if local is not None:
            local.all_reduce(data, "sum", 0)
            return
        failed = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        dist.all_reduce(data)
        failed.wait()
        flag.item()

    alone_r = _median(reduce, rep)
    a = torch.randn(256, 256)
    one = _median(lambda: a @ a, rep)
    k = max(1, round(alone_r / 2 / max(one, 1e-9)))
    alone_c = _median(lambda: [a @ a for _ in range(k)], rep)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    ended: queue.SimpleQueue = queue.SimpleQueue()

    def stream() -> None:
        while jobs.get():
            reduce()
            ended.put(time.perf_counter())

    threading.Thread(target=stream, name="calibrate-contention", daemon=True).start()
    fcs, fms = [], []
    try:
        for _ in range(rep):
            _together()
            t0 = time.perf_counter()
            jobs.put(True)
            for _ in range(k):
                a @ a
            dc = time.perf_counter() - t0
            dr = ended.get() - t0
            if dc <= dr:  # the compute ended first: the reduce then ran alone for dr - dc
                fc, fm = dc / alone_c, dc / max(alone_r - (dr - dc), dc / _CAP)
            else:
                fm, fc = dr / alone_r, dr / max(alone_c - (dc - dr), dr / _CAP)
            fcs.append(min(max(fc, 1.0), _CAP))
            fms.append(min(max(fm, 1.0), _CAP))
    finally:
        jobs.put(False)
    return {"contention_compute": statistics.median(fcs), "contention_comm": statistics.median(fms)}
