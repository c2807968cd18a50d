"""`monarch.Simulator.calibrate()`: measure this machine and save a `DeviceProfile` for the simulator.

On a machine with a GPU it measures the GPU (one worker per GPU); otherwise its CPU with `workers`
workers, all measuring at once, so that workers sharing cores see what they get in a real run of that
many. Measured: the per-command cost of the tensor engine's worker half on the main stream and on a side
stream, matmul FLOP/s, memory bandwidth, a whole-mesh reduce of a small and a large tensor (fitted to the
ring model's α and β) and of one element (gloo's ring skips empty segments), and the controller's round
trip for a fetched value; on a CPU also how compute and a reduce that overlap slow each other down, what
a hand-over between a worker's threads costs, and how much the controller's Python and the workers slow
each other down when they run at once (as they do while the controller issues a step). What cannot be
measured on one machine (links between hosts) is derived: twice the latency, half the bandwidth of the
local links.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from monarch.runtime.backends.sim import devices
from monarch.runtime.backends.sim.devices import DeviceProfile
from monarch.runtime.mesh import this_host
from monarch.runtime.remote import RemoteFunction
from monarch.runtime.tensor.engine import flush

WORKER = "monarch.runtime.worker.calibration"
SMALL = 256
"""Floats in the small reduce (its time is mostly latency)."""


def calibrate(path: str | os.PathLike | None = None, workers: int = 4, quick: bool = False) -> DeviceProfile:
    """Measure, save (to `path`, default this machine's profile) and return the profile."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"calibrate: workers must be a positive integer, got {workers!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = gpus or workers
    print(f"monarch.Simulator.calibrate: measuring {n} {'GPU' if gpus else 'CPU'} worker(s)…", file=sys.stderr)
    mesh = this_host().spawn_procs({"gpu": n})
    try:
        per_rank = list(RemoteFunction.by_name(WORKER, "measure", mesh).call_async(quick=quick).result())
        rtt = _round_trip(mesh)
        shared_cores = n > 1 and not gpus  # (CPU workers: compute, reduces and threads contend; gloo's ring)
        comm = [_engine_reduces(mesh, rtt, quick, one_element=shared_cores)] if n > 1 else []
        handoff = _handoff(mesh, quick) if shared_cores else 0.0
        slowdown = 1.0 if gpus else _controller_slowdown(mesh, quick)
        load = _controller_load(mesh, rtt, quick) if shared_cores else 1.0
    finally:
        mesh.exit()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in per_rank)

    flops = statistics.median(max(v for k, v in r.items() if k.startswith("matmul")) for r in per_rank)
    enqueue = med("side_enqueue")
    side_op = max(med("side_total") - enqueue, 1e-7)
    main_op = med("main_op")
    base = devices.DEVICES["h100" if gpus else "cpu"]
    intra_lat, intra_bw = base.intra_latency, base.intra_bw
    if comm:
        small = statistics.median(c[str(SMALL)] for c in comm)
        large = statistics.median(c[str(1 << 18)] for c in comm)
        steps = 2 * (n - 1)
        # a reduce is its command's cost plus a ring all-reduce; what the small one costs beyond the command
        # is latency, what the large one costs beyond the small one is bandwidth
        intra_lat = max(small - main_op, 1e-7) / steps
        nbytes = 4 * ((1 << 18) - SMALL)
        intra_bw = (2 * (n - 1) / n) * nbytes / max(large - small, 1e-9)
    name = f"{socket.gethostname()}-{'gpu' if gpus else 'cpu'}"
    profile = DeviceProfile(
        name=name,
        kind="gpu" if gpus else "cpu",
        flops={"float32": flops, "default": flops},
        mem_bw=med("mem_bw"),
        efficiency=1.0,  # (measured on matmuls: already what they reach)
        op_overhead=side_op if gpus else max(main_op - enqueue, 1e-7),
        dispatch=enqueue,
        intra_latency=intra_lat,
        intra_bw=intra_bw,
        inter_latency=2 * intra_lat,
        inter_bw=intra_bw / 2,
        wire_latency=rtt / 2,
        controller_slowdown=slowdown,
        controller_load=load,
        compute_contention=med("contention_compute") if shared_cores else 1.0,
        comm_contention=med("contention_comm") if shared_cores else 1.0,
        handoff=handoff,
        reduce_floor=statistics.median(c["1"] for c in comm) if shared_cores else 0.0,
        memory=base.memory if gpus else 0,
        alloc_round=base.alloc_round if gpus else 1,
        source=f"calibrated on {socket.gethostname()} with {n} workers, {datetime.date.today().isoformat()}",
        measured={"workers": n, "cores": os.cpu_count(), "per_rank": per_rank, "collectives": comm, "round_trip": rtt},
    )
    out = Path(path) if path is not None else devices.local_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json())
    print(f"monarch.Simulator.calibrate: saved {out}", file=sys.stderr)
    return profile


def _engine_reduces(mesh, rtt: float, quick: bool, one_element: bool) -> dict:
    """Seconds per whole-mesh `reduce_("sum")` of 256 and 2**18 floats, and of 1 if `one_element` (gloo's ring
    is quicker for a tensor of fewer elements than two per rank, such as a small layer's bias: the
    one-element time bounds that),
    issued through the tensor engine as a program issues them (back to back, then a fetch), the
    controller's issuing and the round trip taken out."""
    import torch

    from monarch.runtime.tensor.values import inspect

    k, runs = (8, 2) if quick else (16, 5)
    dim = mesh.names[0]
    out = {}
    for n in (1, SMALL, 1 << 18) if one_element else (SMALL, 1 << 18):
        with mesh.activate():
            t = torch.ones(n)
            t.reduce_(dim, "sum")
        inspect(t)  # (warm)
        out[str(n)] = statistics.median(_per_reduce(mesh, t, k, rtt) for _ in range(runs))
    return out


def _per_reduce(mesh, t, k: int, rtt: float) -> float:
    """Seconds per whole-mesh `reduce_("sum")` of `t`: `k` of them back to back, then a fetch; the
    controller's issuing and the round trip taken out."""
    from monarch.runtime.tensor.values import inspect

    with mesh.activate():
        for _ in range(k):
            t.reduce_(mesh.names[0], "sum")
    issued = time.perf_counter()
    inspect(t)
    return max(time.perf_counter() - issued - rtt, 0.0) / k


def _handoff(mesh, quick: bool) -> float:
    """Seconds a CPU worker loses per hand-over between its threads: small reduces handed to a side stream
    and waited for (a borrow, the reduce, its drop, an op on main: as a step reduces gradients) against
    the same reduces back to back on that stream. Each hand-over wakes the main thread, then the stream's."""
    import torch

    from monarch.runtime.tensor.streams import Stream
    from monarch.runtime.tensor.values import inspect

    k, runs = (8, 2) if quick else (16, 9)  # (the difference is a few ms in 0.15 s: many runs, the median)
    dim = mesh.names[0]
    side = Stream("calibrate")
    with mesh.activate():
        t = torch.ones(SMALL)

    def back_to_back() -> None:  # (one hand-over in all)
        alias, borrow = side.borrow(t, mutable=True)
        with side.activate():
            for _ in range(k):
                alias.reduce_(dim, "sum")
        borrow.drop()

    def handed() -> None:
        for _ in range(k):
            alias, borrow = side.borrow(t, mutable=True)
            with side.activate():
                alias.reduce_(dim, "sum")
            borrow.drop()
            t.mul_(0.5)

    with mesh.activate():
        back_to_back()  # (warm: the stream's thread and its groups)
    inspect(t)
    extra = []
    for _ in range(runs):
        took = []
        for pattern in (back_to_back, handed) if len(extra) % 2 else (handed, back_to_back):
            start = time.perf_counter()
            with mesh.activate():
                pattern()
            inspect(t)
            took.append((pattern, time.perf_counter() - start))
        by = dict(took)
        extra.append((by[handed] - by[back_to_back]) / (k - 1))
    return max(statistics.median(extra), 0.0)


def _controller_slowdown(mesh, quick: bool) -> float:
    """How much slower the controller issues commands while CPU workers on its machine compute, than while
    they wait: the time to issue the same tiny ops, behind a batch of matmuls and with the workers idle."""
    import torch

    from monarch.runtime.tensor.values import inspect

    n = 300 if quick else 1000

    def issue(t) -> float:
        start = time.perf_counter()
        for _ in range(n):
            t.add_(1)
        return time.perf_counter() - start

    ratios = []
    for _ in range(1 if quick else 3):
        with mesh.activate():
            t = torch.ones(4)
            a = torch.ones(512, 512)
        inspect(t)
        with mesh.activate():
            idle = issue(t)
        inspect(t)
        with mesh.activate():
            for _ in range(60):  # about a second of work on each worker
                a = a @ a / 512
            flush(mesh)
            busy = issue(t)
        inspect(t)
        ratios.append(busy / idle)
    return max(1.0, statistics.median(ratios))


def _controller_load(mesh, rtt: float, quick: bool) -> float:
    """How many times longer the workers' work takes while the controller runs Python on their machine (as
    it does while it issues a step): the engine's small reduces back to back, with another process
    computing beside them and without, alternately. A reduce waits for every worker's turn on the cores,
    so it feels a core taken more than compute does (on 2 cores and 4 workers: 1.4 times, compute 1.2)."""
    import torch

    from monarch.runtime.tensor.values import inspect

    k, runs = (8, 2) if quick else (16, 6)
    with mesh.activate():
        t = torch.ones(SMALL)
        t.reduce_(mesh.names[0], "sum")
    inspect(t)  # (warm)
    idle, busy = [], []
    for _ in range(runs):
        idle.append(_per_reduce(mesh, t, k, rtt))
        with _spinning():
            busy.append(_per_reduce(mesh, t, k, rtt))
    return max(1.0, statistics.median(busy) / max(statistics.median(idle), 1e-9))


@contextlib.contextmanager
def _spinning():
    """Another process computing on this machine (pure Python, one thread) while the block runs; it ends
    with the block, or by itself if this process dies."""
    code = (
        "import os, sys\n"
        "parent = os.getppid()\n"
        "sys.stdout.write('x'); sys.stdout.flush()\n"
        "while os.getppid() == parent:\n"
        "    for _ in range(100000): pass\n"
    )
    proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdout=subprocess.PIPE)
    try:
        proc.stdout.read(1)  # (it is spinning)
        yield
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _round_trip(mesh) -> float:
    """Seconds from asking for a small value to having it (the controller's side included)."""
    import torch

    from monarch.runtime.tensor.values import inspect

    with mesh.activate():
        t = torch.ones(1)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        inspect(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
