"""`monarch.Simulator.calibrate()`: measure this machine and save a `DeviceProfile` for the simulator.

On a machine with a GPU it measures the GPU (one worker per GPU); otherwise its CPU with `workers`
workers, all measuring at once, so that workers sharing cores see what they get in a real run of that
many. Measured: the per-command cost of the tensor engine's worker half on the main stream and on a side
stream, matmul FLOP/s, memory bandwidth, a whole-mesh reduce of a small and a large tensor (fitted to the
ring model's α and β) and of one element (gloo's ring skips empty segments), a reduce over one rank (the
engine's own work per reduce), decoding a batch, each op of a small training step on tiny tensors (its
overhead beyond a tiny add's; with its gradients reduced as they come, on the main stream and on a side
stream, what the ops after and beside a reduce lose; when its batch starts and its loss comes back), and
the controller's round trip for a fetched value; on a CPU also how compute and a reduce
that overlap slow each other down, what a hand-over between a worker's threads costs, and how much the
controller's Python and the workers slow each other down when they run at once (as they do while the
controller issues a step). What cannot be measured on one machine (links between hosts) is derived: twice
the latency, half the bandwidth of the local links.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monarch.runtime.mesh import this_host
from monarch.runtime.remote import RemoteFunction
from monarch.runtime.simulator import devices
from monarch.runtime.simulator.devices import NOISY, STEERING, DeviceProfile
from monarch.runtime.tensor.engine import flush

WORKER = "monarch.runtime.worker.calibration"
SMALL = 256
"""Floats in the small reduce (its time is mostly latency)."""


CURVES = ("reduce_in_step", "reduce_in_step_loaded", "cold_ops")
"""A profile's figures that are lists of measured points ([[x, y], ...])."""
PASSES = 3
"""Times `calibrate()` measures everything, one pass after another; each figure is the median of its passes."""


def calibrate(
    path: str | os.PathLike | None = None,
    workers: int = 4,
    quick: bool = False,
    passes: int | None = None,
    simulator: Callable[[DeviceProfile, int], Any] | None = None,
) -> DeviceProfile:
    """Measure, save (to `path`, default this machine's profile) and return the profile.

    Everything is measured `passes` times (default `PASSES`, 1 if `quick`), one pass after another; each
    figure is the median of its passes, and how far the passes spread, (max - min) / median, is kept per
    figure in the profile's `spread`; `simulator(profile, workers)` (a `Simulator` on one host) simulates a
    sample step with each pass's figures, and how far apart those land is said on stderr. A machine too
    busy to calibrate (steps more than `NOISY` apart) is named there rather than averaged away."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"calibrate: workers must be a positive integer, got {workers!r}")
    if passes is None:
        passes = 1 if quick else PASSES
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"calibrate: passes must be a positive integer, got {passes!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = gpus or workers
    print(
        f"monarch.Simulator.calibrate: measuring {n} {'GPU' if gpus else 'CPU'} worker(s), {passes} pass(es)…",
        file=sys.stderr,
    )
    mesh = this_host().spawn_procs({"gpu": n})
    try:
        profiles = [_one_pass(mesh, n, gpus, quick) for _ in range(passes)]
    finally:
        mesh.exit()
    steps = _simulated_steps(simulator, profiles, n, "cuda" if gpus else "cpu") if passes > 1 and simulator else None
    profile = _combine(profiles, steps)
    print(f"monarch.Simulator.calibrate: {confidence(profile)}", file=sys.stderr)
    out = Path(path) if path is not None else devices.local_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json())
    print(f"monarch.Simulator.calibrate: saved {out}", file=sys.stderr)
    return profile


def confidence(profile: DeviceProfile) -> str:
    """One line on how far a profile's passes agreed: a step simulated with each pass's figures, the figures
    that moved most, and whether the machine was too noisy to trust it."""
    if "step" not in profile.spread:
        return "one pass: no spread measured (calibrate(passes=3) measures it)"
    steps = profile.measured.get("steps", [])
    spread = {k: v for k, v in profile.spread.items() if k in STEERING}
    moved = sorted(spread, key=spread.__getitem__, reverse=True)[:3]
    said = (
        f"a sample training step simulated with each of the {len(steps)} passes' figures takes "
        f"{' / '.join(f'{1000 * t:.2f}' for t in steps)} ms ({100 * profile.spread['step']:.0f}% apart; the figures "
        f"that moved most: {', '.join(f'{k} {100 * spread[k]:.0f}%' for k in moved)})"
    )
    if profile.spread["step"] > NOISY:
        return (
            f"THIS MACHINE WAS TOO NOISY TO CALIBRATE WELL: {said}; simulated times may be off by as much: "
            "calibrate again with nothing else running"
        )
    return said


def _simulated_steps(
    simulator: Callable[[DeviceProfile, int], Any], profiles: list[DeviceProfile], n: int, device: str
) -> list[float]:
    """Seconds a step of the sample model (its gradients reduced on main as they come, then fetched) takes
    simulated with each profile: how far the passes' figures move a step, the calibration's confidence."""
    import torch

    from monarch.runtime.fetch import inspect

    out = []
    for profile in profiles:
        sim = simulator(profile, n)
        sim._backend.warned = True  # (its values are not computed: said to people who fetch them, not here)
        try:
            with sim.mesh.activate():
                torch.manual_seed(0)
                model = _sample_model().to(device)
                params = list(reversed(list(model.parameters())))
            times = []
            for _ in range(4):
                start = sim.time
                inspect(_sample_step(sim.mesh, model, params, device, "main" if n > 1 else "none"))
                times.append(sim.time - start)
            out.append(statistics.median(times[1:]))
        finally:
            sim.exit()
    return out


def _one_pass(mesh, n: int, gpus: int, quick: bool) -> DeviceProfile:
    """Everything measured once, as a profile."""
    per_rank = RemoteFunction.by_name(WORKER, "measure", mesh).call_async(quick=quick).result().values()
    rtt = _round_trip(mesh)
    shared_cores = n > 1 and not gpus  # (CPU workers: compute, reduces and threads contend; gloo's ring)
    comm = [_engine_reduces(mesh, rtt, quick, one_element=shared_cores)] if n > 1 else []
    handoff = _handoff(mesh, quick) if shared_cores else 0.0
    side_wait = _side_wait(mesh, quick) if shared_cores else 0.0
    in_step = _reduce_in_step(mesh, rtt, quick) if shared_cores else []
    if shared_cores:
        with _spinning():
            loaded = _reduce_in_step(mesh, rtt, quick)
    else:
        loaded = []
    slowdown = 1.0 if gpus else _controller_slowdown(mesh, quick)
    load = _controller_load(mesh, rtt, quick) if shared_cores else 1.0
    one_rank = _one_rank_reduce(mesh, rtt, quick)
    in_program, extra, after_reduce, beside_reduce, ends = _sample_step_costs(mesh, quick, "cuda" if gpus else "cpu")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in per_rank)

    flops = statistics.median(max(v for k, v in r.items() if k.startswith("matmul")) for r in per_rank)
    enqueue = med("side_enqueue")
    decode = min(med("decode"), enqueue)
    side_op = max(med("side_total") - enqueue, 1e-7)
    main_op = med("main_op")
    reduce_overhead = max(one_rank - main_op, 0.0)  # (the engine's own work per reduce, beyond a command's)
    base = devices.DEVICES["h100" if gpus else "cpu"]
    intra_lat, intra_bw = base.intra_latency, base.intra_bw
    if comm:
        small = statistics.median(c[str(SMALL)] for c in comm)
        large = statistics.median(c[str(1 << 18)] for c in comm)
        steps = 2 * (n - 1)
        # a reduce is its command's cost and the engine's own work plus a ring all-reduce; what the small one
        # costs beyond those is latency, what the large one costs beyond the small one is bandwidth
        intra_lat = max(small - main_op - reduce_overhead, 1e-7) / steps
        nbytes = 4 * ((1 << 18) - SMALL)
        intra_bw = (2 * (n - 1) / n) * nbytes / max(large - small, 1e-9)
    name = f"{socket.gethostname()}-{'gpu' if gpus else 'cpu'}"
    return DeviceProfile(
        name=name,
        kind="gpu" if gpus else "cpu",
        flops={"float32": flops, "default": flops},
        mem_bw=med("mem_bw"),
        efficiency=1.0,  # (measured on matmuls: already what they reach)
        # (an op in a program costs more than one of a loop of the same op: a tiny add_ 2-4 times as much, on a
        # CPU and on a GPU; the loop's figure is the floor)
        op_overhead=max(in_program, side_op if gpus else main_op - enqueue, 1e-7),
        dispatch=max(enqueue - decode, 1e-7),  # (decoding is charged when a batch arrives)
        intra_latency=intra_lat,
        intra_bw=intra_bw,
        inter_latency=2 * intra_lat,
        inter_bw=intra_bw / 2,
        # (in a step on busy cores a batch takes longer to start, and a value to come back, than on idle ones)
        wire_latency=max(ends[0] - ends[2] * decode, rtt / 2) if ends else rtt / 2,
        fetch_latency=max(ends[1], rtt / 2) if ends else 0.0,
        controller_slowdown=slowdown,
        controller_load=load,
        compute_contention=med("contention_compute") if shared_cores else 1.0,
        comm_contention=med("contention_comm") if shared_cores else 1.0,
        handoff=handoff,
        side_wait=side_wait,
        after_reduce=after_reduce,
        beside_reduce=beside_reduce,
        decode=decode,
        reduce_floor=statistics.median(c["1"] for c in comm) if shared_cores else 0.0,
        reduce_in_step=in_step,
        reduce_in_step_loaded=loaded,
        cold_ops=_per_point(per_rank, "cold_ops"),
        op_extra=extra,
        reduce_overhead=reduce_overhead,
        memory=base.memory if gpus else 0,
        alloc_round=base.alloc_round if gpus else 1,
        source=f"calibrated on {socket.gethostname()} with {n} workers, {datetime.date.today().isoformat()}",
        measured={
            "workers": n,
            "cores": os.cpu_count(),
            "per_rank": per_rank,
            "collectives": comm,
            "round_trip": rtt,
            "one_rank_reduce": one_rank,
            "step_ends": ends,
        },
    )


def _per_point(per_rank: list[dict], key: str) -> list[list[float]]:
    """``[[x, y], ...]`` measured on every rank (the same xs): each point's y, the median over the ranks."""
    found = [r[key] for r in per_rank if r.get(key)]
    if not found:
        return []
    return [[x, statistics.median(f[i][1] for f in found)] for i, (x, _) in enumerate(found[0])]


def _combine(profiles: list[DeviceProfile], steps: list[float] | None = None) -> DeviceProfile:
    """One profile from several passes: each figure the median of its passes, their spread kept (and that of
    `steps`, a step simulated with each pass's figures, as ``step``)."""
    first = profiles[0]
    if len(profiles) == 1:
        return first
    values: dict[str, object] = {}
    each: dict[str, list[float]] = {}
    for f in dataclasses.fields(DeviceProfile):
        xs = [getattr(p, f.name) for p in profiles]
        if isinstance(xs[0], float) and not isinstance(xs[0], bool):
            values[f.name] = statistics.median(xs)
            each[f.name] = xs
    ops = sorted({op for p in profiles for op in p.op_extra})
    values["op_extra"] = {op: statistics.median(p.op_extra.get(op, 0.0) for p in profiles) for op in ops}
    each["op_extra"] = [sum(p.op_extra.values()) for p in profiles]
    flops = statistics.median(p.flops["float32"] for p in profiles)
    values["flops"] = {"float32": flops, "default": flops}
    for key in CURVES:  # ([[x, y], ...]: each point's median; spread of the ys' sums)
        points = [getattr(p, key) for p in profiles]
        if points[0] and all(len(ps) == len(points[0]) for ps in points):
            values[key] = [
                [statistics.median(ps[i][j] for ps in points) for j in (0, 1)] for i in range(len(points[0]))
            ]
            each[key] = [sum(y for _, y in ps) for ps in points]
    each["flops"] = [p.flops["float32"] for p in profiles]
    measured = {k: v for k, v in first.measured.items() if k in ("workers", "cores")}
    if steps:
        each["step"] = [float(t) for t in steps]
        measured["steps"] = [float(t) for t in steps]
    measured["range"] = {k: max(xs) - min(xs) for k, xs in each.items()}
    measured["passes"] = [p.measured for p in profiles]
    spread = {k: _spread(xs) for k, xs in each.items()}
    return dataclasses.replace(first, **values, spread=spread, measured=measured)  # type: ignore[arg-type]


def _spread(xs: list[float]) -> float:
    """(max - min) / median of `xs` (of the mean magnitude where the median is 0); 0 when all are equal."""
    lo, hi = min(xs), max(xs)
    if hi == lo:
        return 0.0
    mid = abs(statistics.median(xs)) or statistics.fmean(abs(x) for x in xs)
    return (hi - lo) / mid


def _engine_reduces(mesh, rtt: float, quick: bool, one_element: bool) -> dict:
    """Seconds per whole-mesh `reduce_("sum")` of 256 and 2**18 floats, and of 1 if `one_element` (gloo's ring
    is quicker for a tensor of fewer elements than two per rank, such as a small layer's bias: the
    one-element time bounds that),
    issued through the tensor engine as a program issues them (back to back, then a fetch), the
    controller's issuing and the round trip taken out."""
    import torch

    from monarch.runtime.fetch import inspect

    k, runs = (8, 2) if quick else (16, 9)  # (a step's reduces cost what these say: many runs, the median)
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
    controller's issuing and the round trip taken out. Reduces quick enough to run while they are issued
    (one element on 2 workers) leave nothing after the issuing: they cost at most what issuing each took."""
    from monarch.runtime.fetch import inspect

    start = time.perf_counter()
    with mesh.activate():
        for _ in range(k):
            t.reduce_(mesh.names[0], "sum")
    issued = time.perf_counter()
    inspect(t)
    after = time.perf_counter() - issued - rtt
    return (after if after > 0 else issued - start) / k


def _one_rank_reduce(mesh, rtt: float, quick: bool) -> float:
    """Seconds per `reduce_` over a group of one rank (the first): no ring, only the engine's own work (its
    failure flag's collective, the process group's, on a GPU the wait for the flag) and the command's."""
    import torch

    from monarch.runtime.fetch import inspect

    k, runs = (16, 3) if quick else (32, 5)  # (a few reduces' time less a noisy round trip can read as none)
    dim = mesh.names[0]
    one = mesh.slice(**{dim: range(0, 1)})
    with one.activate():
        t = torch.ones(1)
        t.reduce_(dim, "sum")
    inspect(t)  # (warm: the group of one)
    return statistics.median(_per_reduce(one, t, k, rtt) for _ in range(runs))


def _sample_step_costs(mesh, quick: bool, device: str) -> tuple[float, dict[str, float], float, float, list | None]:
    """Seconds a tiny `add_` takes inside a small training step, what each other op of the step costs beyond
    it, by op name (`op_extra`), what the ops after a reduce lose (`after_reduce`) and beside one on a side
    stream (`beside_reduce`), and how the step's batch arrives and its loss returns (`_ends`).

    The step (embedding, layer norm, attention, an MLP, cross entropy, autograd, an update) runs through the
    engine on tiny tensors, so that an op's time is its overhead: ATen's dispatch, on a GPU its launches.
    Each command is timed on every worker as it runs (the engine's `around` hook). An op's figure is its
    mean over all (on shared cores a worker is sometimes put off the core mid-op, and a step pays for
    that too). Then, on a mesh of several workers, the same step reduces each gradient as `grad_generator`
    gives it (the tutorial's step): what the ops between two reduces take beyond those figures, per reduce,
    is `after_reduce`; and once more with each reduce on a side stream, dropped after the next gradient
    (the tutorial's variant 3): what the step's ops take beyond those figures, per reduce, is
    `beside_reduce`."""
    import torch

    from monarch.runtime.fetch import inspect
    from monarch.runtime.tensor.streams import Stream

    with mesh.activate():
        torch.manual_seed(0)
        model = _sample_model().to(device)
        params = list(reversed(list(model.parameters())))

    marks: list[tuple[float, float, float]] = []
    """Per step: the controller's clock at its start, when it had issued it, when it had the loss."""

    side = Stream("calibrate-comms")

    def step(reduce: str) -> None:
        t0 = time.perf_counter()
        loss = _sample_step(mesh, model, params, device, reduce, side)
        issued = time.perf_counter()
        inspect(loss)
        marks.append((t0, issued, time.perf_counter()))

    def timed(reduce: str) -> list:
        step(reduce)  # (warm)
        marks.clear()

        def steps() -> None:
            for _ in range(3 if quick else 10):
                step(reduce)

        return _timed_commands(mesh, steps)

    times: dict[str, list[float]] = {}
    for per_rank in timed("none"):
        for name, start, end in per_rank:
            times.setdefault(name, []).append(end - start)
    mean = {name: statistics.fmean(ts) for name, ts in times.items()}
    base = mean["aten::add_.Tensor"]
    extra = {
        name: t - base for name, t in sorted(mean.items()) if name.startswith("aten::") and name != "aten::add_.Tensor"
    }
    if len(mesh) == 1 or device != "cpu":
        return base, extra, 0.0, 0.0, None
    per_rank = timed("main")
    main_marks = list(marks)
    lost = [  # per gap between two of a step's reduces: what its ops lost
        sum(e - st - mean.get(name, e - st) for name, st, e in gap)
        for cmds in per_rank
        for step_cmds in _by_step(cmds, main_marks)
        for gap in _between_reduces(step_cmds)
    ]
    # beside a side stream's reduces: what a step's ops (all on main) lost, per reduce
    beside = [
        sum(e - st - mean.get(name, e - st) for name, st, e in step_cmds if name.startswith("aten::")) / len(params)
        for cmds in timed("side")
        for step_cmds in _by_step(cmds, marks)
    ]
    after = max(statistics.fmean(lost), 0.0) if lost else 0.0
    return base, extra, after, max(statistics.fmean(beside), 0.0) if beside else 0.0, _ends(per_rank, main_marks)


def _timed_commands(mesh, run: Callable[[], None]) -> list:
    """Per rank, (name, start, end) of each command its worker ran while `run()` issued commands and waited for
    them (timed on the workers through the engine's `around` hook)."""
    RemoteFunction.by_name(WORKER, "time_ops", mesh).call_async().result()
    try:
        run()
    finally:
        per_rank = RemoteFunction.by_name(WORKER, "timed_ops", mesh).call_async().result().values()
    return per_rank


def _sample_step(mesh, model, params: list, device: str, reduce: str, side: Any = None) -> Any:
    """Issue one training step of `_sample_model()` on `mesh` (nothing waits): each gradient as
    `grad_generator` gives it not reduced (``none``), reduced on main (``main``), or on stream `side`, dropped
    after the next gradient (``side``: the tutorial's variant 3). Returns its loss."""
    import torch

    from monarch.runtime.tensor.comms import grad_generator

    dim = mesh.names[-1]  # (`gpu`: a calibration's mesh has only it, a simulated one `host` first)
    with mesh.activate():
        x = torch.randint(0, 32, (2, 6), device=device)
        loss = model(x, x.roll(1, 1))
        with torch.no_grad():
            if reduce == "side":  # each reduce runs beside the next gradient
                it = iter((p, g, *side.borrow(g, mutable=True)) for p, g in zip(params, grad_generator(loss, params)))
                todo = next(it, None)
                while todo is not None:
                    p, g, alias, borrow = todo
                    with side.activate():
                        alias.reduce_(dim, "sum")
                    todo = next(it, None)
                    borrow.drop()
                    p.add_(g * -0.01)
            else:
                for p, g in zip(params, grad_generator(loss, params)):
                    if reduce == "main":
                        g.reduce_(dim, "sum")
                    p.add_(g * -0.01)
    return loss


def _by_step(cmds: list, marks: list[tuple[float, float, float]]) -> list[list]:
    """A worker's timed commands (name, start, end), cut into the steps the controller ran (`marks`: each
    step's start, issued, value fetched; the same monotonic clock)."""
    return [[c for c in cmds if t0 <= c[1] <= got] for t0, _, got in marks]


def _between_reduces(step_cmds: list) -> list[list]:
    """The commands of one step between each two consecutive reduces."""
    at = [i for i, c in enumerate(step_cmds) if c[0] == "Reduce"]
    return [step_cmds[i + 1 : j] for i, j in zip(at, at[1:])]


def _ends(per_rank: list, marks: list[tuple[float, float, float]]) -> list | None:
    """(seconds from the controller's having issued a step to a worker's first command, seconds from the
    fetched rank's last command to the controller's having the value, commands per step), medians over the
    steps that went as one batch (their first command started after the controller had issued them); None
    if none did."""
    arrive, back, counts = [], [], []
    for rank, cmds in enumerate(per_rank):
        for (_, issued, got), mine in zip(marks, _by_step(cmds, marks)):
            if not mine or mine[0][1] < issued:
                continue
            arrive.append(mine[0][1] - issued)
            counts.append(len(mine))
            if rank == 0:  # (`inspect` fetches from the first rank)
                back.append(got - max(c[2] for c in mine))
    if not arrive or not back:
        return None
    return [statistics.median(arrive), statistics.median(back), round(statistics.median(counts))]  # (JSON's)


def _sample_model():
    """The model `_sample_step_costs` times: the ops a training step issues most, on tiny tensors."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Sample(nn.Module):
        def __init__(self, vocab: int = 32, d: int = 8, heads: int = 2):
            super().__init__()
            self.heads = heads
            self.emb, self.norm = nn.Embedding(vocab, d), nn.LayerNorm(d)
            self.qkv, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
            self.out = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            b, t, d = h.shape
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm(h)).split(d, 2))
            a = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1) @ v
            h = h + a.transpose(1, 2).reshape(b, t, d)
            h = h + self.down(F.gelu(self.up(h)).relu())
            return F.cross_entropy(self.out(h).view(b * t, -1), y.view(-1))

    return Sample()


def _handoff(mesh, quick: bool) -> float:
    """Seconds a CPU worker loses per hand-over between its threads: small reduces handed to a side stream
    and waited for (a borrow, the reduce, its drop, an op on main: as a step reduces gradients) against
    the same reduces back to back on that stream. Each hand-over wakes the main thread, then the stream's."""
    import torch

    from monarch.runtime.fetch import inspect
    from monarch.runtime.tensor.streams import Stream

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


SIDE_WAIT_MATMULS = 60
"""`_side_wait`'s compute on main beside a side stream's reduce: this many 128x128 matmuls (on 4 workers sharing
2 cores about 4 ms: several turns of the scheduler)."""


def _side_wait(mesh, quick: bool) -> float:
    """Seconds a side stream's reduce waits to begin while its worker's main thread computes: a borrow, a small
    reduce on the side stream, `SIDE_WAIT_MATMULS` matmuls on main, the drop, as a step reduces gradients
    beside its backward. Each command is timed on every worker (the engine's `around` hook); the figure is
    the mean over ranks and repeats of the reduce's start less the borrow's end (what a step's overlap
    follows: a wait of a scheduler's turn or two, the odd one far longer; a reduce that began only when main
    waited at the drop counts up to there)."""
    import torch

    from monarch.runtime.fetch import inspect
    from monarch.runtime.tensor.streams import Stream

    k = 8 if quick else 24
    dim = mesh.names[0]
    side = Stream("calibrate-side")
    with mesh.activate():
        a, t = torch.rand(128, 128), torch.ones(SMALL)
        alias, borrow = side.borrow(t, mutable=True)
        with side.activate():
            alias.reduce_(dim, "sum")  # (warm: the stream's thread and its group)
        borrow.drop()
    inspect(t)

    def beside() -> None:
        with mesh.activate():
            for _ in range(k):
                alias, borrow = side.borrow(t, mutable=True)
                with side.activate():
                    alias.reduce_(dim, "sum")
                for _ in range(SIDE_WAIT_MATMULS):
                    b = a @ a  # noqa: F841  (dropped at once, as a backward's intermediates go)
                borrow.drop()
        inspect(t)

    waits = []
    for cmds in _timed_commands(mesh, beside):
        cmds = sorted(cmds, key=lambda c: c[1])
        borrowed = [end for name, _, end in cmds if name == "BorrowStart"]
        begun = [start for name, start, _ in cmds if name == "Reduce"]
        waits += [b - q for q, b in zip(borrowed, begun)]
    return max(statistics.fmean(waits), 0.0) if waits else 0.0


IN_STEP_MATMULS = (1, 10, 30, 100)
"""`_reduce_in_step`'s compute between two collectives: this many 128x128 matmuls (on 4 workers sharing 2 cores
about 0.1, 0.7, 2 and 7 ms: a tiny model's gradient to a transformer block's)."""


def _reduce_in_step(mesh, rtt: float, quick: bool) -> list[list[float]]:
    """``[[compute, extra], ...]``: seconds a whole-mesh reduce of `SMALL` floats costs beyond its back-to-back
    time when every worker computed for ``compute`` seconds before it, as a step's gradients come (compute and
    a reduce, `k` times, against the same compute alone and the same reduces back to back, alternately; the
    median of several runs: one run's figure is the difference of three timings)."""
    import torch

    from monarch.runtime.fetch import inspect

    k, runs = (8, 3) if quick else (16, 7)
    dim = mesh.names[0]
    with mesh.activate():
        a = torch.rand(128, 128)
        t = torch.ones(SMALL)
        t.reduce_(dim, "sum")  # (warm)
    inspect(t)

    def loop(matmuls: int, compute: bool, reduce: bool) -> float:
        start = time.perf_counter()
        with mesh.activate():
            for _ in range(k):
                if compute:
                    for _ in range(matmuls):
                        b = a @ a  # noqa: F841  (its result is dropped at once, as a step's activations go)
                if reduce:
                    t.reduce_(dim, "sum")
        inspect(t)
        return time.perf_counter() - start - rtt

    out = []
    for matmuls in IN_STEP_MATMULS:
        compute, extra = [], []
        for i in range(runs):
            kinds = ((True, True), (False, True), (True, False))
            took = {kind: loop(matmuls, *kind) for kind in (kinds if i % 2 else kinds[::-1])}
            compute.append(took[True, False] / k)
            extra.append((took[True, True] - took[True, False] - took[False, True]) / k)
        # (a loaded machine can time the compute below the round trip taken out: some compute was done)
        out.append([max(statistics.median(compute), 1e-6), max(statistics.median(extra), 0.0)])
    return sorted(out)


def _controller_slowdown(mesh, quick: bool) -> float:
    """How much slower the controller issues commands while CPU workers on its machine compute, than while
    they wait: the time to issue the same tiny ops, behind a batch of matmuls and with the workers idle."""
    import torch

    from monarch.runtime.fetch import inspect

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

    from monarch.runtime.fetch import inspect

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

    from monarch.runtime.fetch import inspect

    with mesh.activate():
        t = torch.ones(1)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        inspect(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
