"""Where a simulated step's time differs from a real one's: the step cut into the controller's issuing, the
wait for the batch, the workers' commands and the fetch, then the commands by op, side by side.

Real: one worker mesh on this machine; each command is timed on every worker through the engine's `around`
hook (on a GPU that is the command thread's time: launching the op, not running it), on the host's
monotonic clock, which the controller shares. Simulated: the same program on `Simulator(device=profile)`,
its events read from the model (rank 0). A step's phases are medians over the measured steps; an op's time
is its mean.

    python benchmarks/sim_ops.py [--device cpu|cuda] [--workers 4] [--steps 8] [--program "DDP variant 1"]
                                 [--profile PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

import torch

import monarch
from monarch.actor import this_host
from monarch.runtime.remote import RemoteFunction
from monarch.runtime.simulator.simulator import Simulator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulator import programs  # noqa: E402  (the same programs as the simulator's benchmark)


def _timing(mesh, on: bool):
    """Start timing each command on the workers, or stop and return each rank's (name, start, end) list."""
    fn = RemoteFunction.by_name("monarch.runtime.worker.calibration", "time_ops" if on else "timed_ops", mesh)
    return fn.call_async().result()


def _start(cmd: tuple[str, float, float]) -> float:
    return cmd[1]


def _phases(t0: float, issued: float, ended: float, cmds: list[tuple[str, float, float]]) -> dict:
    """A step's phases (seconds) from its controller marks and rank 0's commands (name, start, end)."""
    first, last = cmds[0][1], max(e for _, _, e in cmds)
    return {
        "step": ended - t0,
        "controller issuing": issued - t0,
        "until the first command": first - issued,
        "commands' span": last - first,
        "command thread busy": sum(e - s for _, s, e in cmds),
        "after the last command": ended - last,
    }


def real_steps(mesh, make, train, data, n: int) -> tuple[list[dict], list[list]]:
    with mesh.activate():
        torch.manual_seed(0)
        model = make()
    phases, per_step = [], []
    for i in range(n + 2):
        if i >= 2:
            _timing(mesh, True)
        t0 = time.perf_counter()
        with mesh.activate():
            loss = train(model, *data())
        issued = time.perf_counter()
        monarch.inspect(loss)
        ended = time.perf_counter()
        if i >= 2:
            cmds = sorted(map(tuple, _timing(mesh, False).item(dp=0)), key=_start)
            phases.append(_phases(t0, issued, ended, cmds))
            per_step.append(cmds)
    return phases, per_step


def sim_steps(profile, workers: int, make, train, data, n: int) -> tuple[list[dict], list[list]]:
    sim = Simulator(hosts=1, gpus=workers, device=profile)
    mesh = sim.mesh.rename(gpu="dp")
    with mesh.activate():
        torch.manual_seed(0)
        model = make()
    phases, per_step = [], []
    w = sim._backend.workers
    for i in range(n + 2):
        sim.reset()
        t0 = sim.time
        with mesh.activate():
            loss = train(model, *data())
        issued = sim.time
        with contextlib.redirect_stderr(io.StringIO()):
            monarch.inspect(loss)
        ended = sim.time
        if i >= 2:
            cmds = sorted(
                (
                    ("Reduce" if ev.kind == "comm" else ev.name, float(ev.start[k[0]]), float(ev.end[k[0]]))
                    for ev in w.events
                    if len(k := (ev.ranks == 0).nonzero()[0])
                ),
                key=_start,
            )
            # the send happens at the fetch, whose arrival is the controller's clock when it fetched
            phases.append(_phases(t0, issued, ended, cmds))
            per_step.append(cmds)
    sim.exit()
    return phases, per_step


def by_op(per_step: list[list]) -> dict[str, tuple[float, float]]:
    """Op -> (commands per step, mean seconds per command: a step's total for the op, divided)."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    for cmds in per_step:
        for name, s, e in cmds:
            times[name].append(e - s)
    return {k: (len(v) / len(per_step), statistics.fmean(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--program", default="DDP variant 1")
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate now)")
    args = ap.parse_args()
    if args.device == "cuda":
        args.workers = torch.cuda.device_count()
    (name, (make, train, data)), *_ = (
        p for p in programs(monarch.Stream("comms"), args.device).items() if args.program in p[0]
    )
    profile = args.profile or os.path.join(tempfile.mkdtemp(), "calibrated.json")
    if args.profile is None:
        with contextlib.redirect_stderr(io.StringIO()):
            Simulator.calibrate(profile, workers=args.workers)
    mesh = this_host().spawn_procs({"gpu": args.workers}).rename(gpu="dp")
    try:
        real, real_cmds = real_steps(mesh, make, train, data, args.steps)
    finally:
        mesh.exit()
    sim, sim_cmds = sim_steps(profile, args.workers, make, train, data, args.steps)
    print(f"{name}: {args.workers} {args.device} worker(s), {os.cpu_count()} cores, torch {torch.__version__}")
    print("(a simulated command's time is its stream's; on a GPU the real one is the command thread's)")
    print(f"{'ms per step (rank 0)':32}{'real':>9}{'sim':>9}")
    for key in real[0]:
        r, s = (1e3 * statistics.median(p[key] for p in ph) for ph in (real, sim))
        print(f"{key:32}{r:9.2f}{s:9.2f}")
    ro, so = by_op(real_cmds), by_op(sim_cmds)
    print(f"\n{'command':40}{'per step':>9}{'real us':>9}{'sim us':>9}{'real ms/step':>13}{'sim ms/step':>12}")
    for op in sorted(ro, key=lambda k: -ro[k][0] * ro[k][1])[:20]:
        n, r = ro[op]
        s = so.get(op, (0, float("nan")))[1]
        print(f"{op:40}{n:9.1f}{1e6 * r:9.1f}{1e6 * s:9.1f}{1e3 * n * r:13.2f}{1e3 * n * s:12.2f}")


if __name__ == "__main__":
    main()
