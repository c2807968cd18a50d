"""What profiling costs: monarch.profiler on a mesh vs torch's profiler in each rank of a torchrun job.

Both run the same data-parallel step (an MLP's forward and backward, its gradients all-reduced over gloo) on 4
ranks of this machine, 20 steps unprofiled, then 20 steps profiled (one warmup step, the rest recorded). Reported
per side: the step time without and with the profiler (the profiler's overhead), and the time from the last step to
the traces on disk. monarch's includes gathering every rank's trace to the controller, merging them onto one clock
and summarizing them; torchrun's ranks each write their own file, and nothing merges them.

    python benchmarks/profiling.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

RANKS = 4
STEPS = 20
REPEATS = 3

STEP = textwrap.dedent(
    """
    import torch, torch.nn as nn, torch.distributed as dist

    torch.manual_seed(0)
    MODEL = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    X, Y = torch.rand(64, 256), torch.rand(64, 256)

    def step():
        loss = ((MODEL(X) - Y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in MODEL.parameters():
                dist.all_reduce(p.grad)
                p -= 0.001 * p.grad
                p.grad = None
    """
)

TORCHRUN = STEP + textwrap.dedent(
    """
    import json, os, sys, time
    from torch.profiler import ProfilerActivity, profile, schedule

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps, out = int(sys.argv[1]), sys.argv[2]
    for _ in range(3):
        step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    plain = (time.perf_counter() - t) / steps

    def ready(prof):
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}.pt.trace.json"))

    dist.barrier()
    t = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps - 1),
                   on_trace_ready=ready)
    prof.start()
    for _ in range(steps):
        step()
        prof.step()
    dist.barrier()
    profiled = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    prof.stop()
    dist.barrier()
    written = time.perf_counter() - t
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump({"plain": plain, "profiled": profiled, "written": written}, f)
    dist.destroy_process_group()
    """
)


def torchrun_once() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "prof.py")
        with open(script, "w") as f:
            f.write(TORCHRUN)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), script, str(STEPS), tmp]
        env = dict(os.environ, OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="6")
        subprocess.run(cmd, capture_output=True, timeout=600, cwd=tmp, env=env, check=True)
        with open(os.path.join(tmp, "times.json")) as f:
            return json.load(f)


def monarch_once() -> dict:
    import monarch
    from monarch.actor import this_host
    from monarch.profiler import Schedule, profile

    @monarch.remote
    def setup(code: str) -> None:  # the step lives on each worker, made once (its model keeps its state)
        import sys
        import types

        mod = types.ModuleType("bench_step")
        exec(code, mod.__dict__)
        sys.modules["bench_step"] = mod

    @monarch.remote
    def steps(n: int) -> None:
        import sys

        for _ in range(n):
            sys.modules["bench_step"].step()

    mesh = this_host().spawn_procs({"gpu": RANKS})
    try:
        setup.on(mesh)(STEP)
        steps.on(mesh)(3)
        t = time.perf_counter()
        steps.on(mesh)(STEPS)  # the same loop as a torchrun rank's, in one call
        plain = (time.perf_counter() - t) / STEPS
        with tempfile.TemporaryDirectory() as tmp:
            sched = Schedule(wait=0, warmup=1, active=STEPS - 1)
            prof = profile(mesh=mesh, on_trace_ready=tmp, activities=["CPU"], schedule=sched)
            t = time.perf_counter()
            prof.start()
            for _ in range(STEPS):  # a call per step: prof.step() is issued between them, as a user writes it
                steps.on(mesh)(1)
                prof.step()
            profiled = (time.perf_counter() - t) / STEPS
            t = time.perf_counter()
            prof.stop()
            written = time.perf_counter() - t
        # the per-step calls cost a round trip each: measured unprofiled too, so the overhead compares like with like
        t = time.perf_counter()
        for _ in range(STEPS):
            steps.on(mesh)(1)
        plain_calls = (time.perf_counter() - t) / STEPS
    finally:
        mesh.exit()
    return {"plain": plain, "plain_calls": plain_calls, "profiled": profiled, "written": written}


def main() -> None:
    mon = [monarch_once() for _ in range(REPEATS)]
    peer = [torchrun_once() for _ in range(REPEATS)]

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    m_over = med(mon, "profiled") / med(mon, "plain_calls")
    t_over = med(peer, "profiled") / med(peer, "plain")
    print(f"{RANKS} ranks, {STEPS} steps, medians of {REPEATS} runs")
    print(
        f"step unprofiled: monarch {med(mon, 'plain') * 1e3:.1f} ms in one call, {med(mon, 'plain_calls') * 1e3:.1f} ms "
        f"a call per step | torchrun {med(peer, 'plain') * 1e3:.1f} ms"
    )
    print(
        f"step profiled (a call per step): monarch {med(mon, 'profiled') * 1e3:.1f} ms ({m_over:.2f}x) | "
        f"torchrun {med(peer, 'profiled') * 1e3:.1f} ms ({t_over:.2f}x)"
    )
    print(
        f"last step to traces on disk: monarch {med(mon, 'written'):.2f} s (gathered, merged, summarized) | "
        f"torchrun {med(peer, 'written'):.2f} s (per rank only, no merge)"
    )


if __name__ == "__main__":
    main()
