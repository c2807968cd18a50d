"""How fast failures are noticed: the figures the tests no longer assert (they assert behaviour).

    python benchmarks/faults.py [--before DIR]

- a killed controller (SIGKILL) with 8 workers busy in C code: until every worker is gone;
- a worker killed with kill -9 during a call: until the call raises;
- Ctrl-C during a live function on 8 workers: until KeyboardInterrupt is raised;
- a worker stopped with SIGSTOP during a call: until the call raises (before the redesign: never);
- the CPU the waiting thread uses while a call runs 2 s;
- one of 4 ranks raises just before an all_reduce the others enter: until the call raises (before issue
  11: the group timeout, 600 s), side by side with torchrun (gloo), from the raise until torchrun exits.

Each side runs in fresh processes. With `--before DIR` (a directory holding an installed earlier
monarch, see `run.py --before`), that code is measured in the same run; ratios are before / now.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from run import header, print_rows  # benchmarks/run.py, next to this file

REPEATS = 3

BUSY_CONTROLLER = textwrap.dedent(
    """
    import time
    import torch  # (a program with torch: workers set it up at spawn)
    from monarch.actor import this_host
    import monarch
    mesh = this_host().spawn_procs({"gpu": 8})
    pids = [r["pid"] for r in mesh.to_table().rows]

    @monarch.remote
    def busy():
        import torch
        t = torch.randn(256, 256)
        while True:
            t = torch.tanh(t @ t)

    fut = busy.on(mesh).call_async()
    time.sleep(1.0)
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(120)
    """
)

IN_PROCESS = textwrap.dedent(
    """
    import json, os, signal, statistics, threading, time
    import torch  # (a program with torch: workers set it up at spawn)
    from monarch.actor import this_host
    import monarch

    # Ctrl-C as a user's: a shell starts background jobs with SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, signal.default_int_handler)

    @monarch.remote
    def nap(seconds):
        import time
        time.sleep(seconds)

    out = {}
    died = []
    for _ in range(REPEATS):
        mesh = this_host().spawn_procs({"gpu": 4})
        pid = mesh.to_table().rows[2]["pid"]
        fut = nap.on(mesh).call_async(60)
        time.sleep(0.3)
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        try:
            fut.result(timeout=30)
        except Exception:
            died.append(time.perf_counter() - t0)
        mesh.exit()
    out["worker_death"] = statistics.median(died)

    mesh = this_host().spawn_procs({"gpu": 8})
    f = nap.on(mesh)
    f(0)
    interrupted = []
    for _ in range(REPEATS):
        timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.perf_counter()
        try:
            f(30)
        except KeyboardInterrupt:
            interrupted.append(time.perf_counter() - t0 - 0.5)
        f(0)  # (interrupted workers serve the next call)
    out["interrupt"] = statistics.median(interrupted)

    t0 = time.thread_time()
    f(2.0)
    out["wait_cpu"] = time.thread_time() - t0
    mesh.exit()

    mesh = this_host().spawn_procs({"gpu": 4})
    pid = mesh.to_table().rows[2]["pid"]
    fut = nap.on(mesh).call_async(60)
    time.sleep(0.3)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        fut.result(timeout=FROZEN_LIMIT)
        out["frozen"] = None
    except Exception as e:
        out["frozen"] = None if "Timeout" in type(e).__name__ else time.perf_counter() - t0
    try:
        os.kill(pid, signal.SIGKILL)  # (already killed, where the mesh noticed it was frozen)
    except ProcessLookupError:
        pass
    mesh.exit()

    @monarch.remote
    def one_fails():
        import torch, torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails before the all_reduce")
        t = torch.ones(1)
        dist.all_reduce(t)

    mesh = this_host().spawn_procs({"gpu": 4})
    f = one_fails.on(mesh)
    ended = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        try:
            f.call_async().result(timeout=ONE_RANK_LIMIT)
        except monarch.RemoteError:
            ended.append(time.perf_counter() - t0)
        except Exception:  # still waiting: never released
            ended.append(float("inf"))
            break
    out["one_rank_fails"] = statistics.median(ended)
    mesh.exit()
    print(json.dumps(out), flush=True)
    """
)

TORCHRUN = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank 1 fails before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)
    """
)


def torchrun_one_rank_fails() -> float:
    """Seconds from rank 1's raise until `torchrun --nproc-per-node 4` exits, reporting it (median)."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        script, stamp = os.path.join(tmp, "fail.py"), os.path.join(tmp, "raised")
        with open(script, "w") as f:
            f.write(TORCHRUN)
        for _ in range(REPEATS):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", script, stamp]
            subprocess.run(cmd, capture_output=True, timeout=300, cwd=tmp, env=dict(os.environ, OMP_NUM_THREADS="1"))
            end = time.time()
            with open(stamp) as f:
                times.append(end - float(f.read()))
    return statistics.median(times)


FROZEN_LIMIT = 20.0
"""Seconds a SIGSTOPped worker's call is waited for before it counts as never noticed."""
ONE_RANK_LIMIT = 60.0
"""Seconds a call with one failed rank is waited for before it counts as never released."""


def _env(before: str | None) -> dict:
    env = dict(os.environ)
    if before:
        env["PYTHONPATH"] = before + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def controller_death(before: str | None) -> float:
    """Seconds from SIGKILL of a controller with 8 busy workers until the last worker is gone (median)."""
    times = []
    for _ in range(REPEATS):
        proc = subprocess.Popen(
            [sys.executable, "-c", BUSY_CONTROLLER], stdout=subprocess.PIPE, text=True, env=_env(before),
            cwd=tempfile.gettempdir(),
        )  # fmt: skip
        try:
            pids = [int(p) for p in proc.stdout.readline().split()]
            t0 = time.perf_counter()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            while any(_alive(p) for p in pids) and time.perf_counter() - t0 < 60:
                time.sleep(0.005)
            times.append(time.perf_counter() - t0)
        finally:
            proc.kill()
            proc.wait()
    return statistics.median(times)


def in_process(before: str | None) -> dict:
    src = f"REPEATS = {REPEATS}\nFROZEN_LIMIT = {FROZEN_LIMIT}\nONE_RANK_LIMIT = {ONE_RANK_LIMIT}\n" + IN_PROCESS
    r = subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=600, env=_env(before),
        cwd=tempfile.gettempdir(),
    )  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError("faults benchmark failed:\n" + "\n".join(r.stderr.strip().splitlines()[-25:]))
    return json.loads(lines[-1])


def measure(before: str | None = None) -> dict:
    def side(site: str | None) -> dict:
        res = in_process(site)
        res["controller_death"] = controller_death(site)
        return res

    results: dict = {}
    if before:
        from run import abba

        results["monarch"], results["monarch before"] = abba(lambda: side(None), lambda: side(before))
    else:
        results["monarch"] = side(None)
    results["torchrun"] = {"one_rank_fails": torchrun_one_rank_fails()}
    return results


def report(results: dict) -> None:
    for res in results.values():
        if "frozen" in res and res["frozen"] is None:
            res["frozen"] = float("inf")  # never noticed: shown as inf
    rows = [
        ("controller SIGKILLed, 8 workers busy in C: until every worker is gone (median)", "controller_death", "s", 1),
        ("worker killed (kill -9) during a call: until the call raises (median)", "worker_death", "ms", 1e3),
        ("Ctrl-C during a live function on 8 workers: until KeyboardInterrupt (median)", "interrupt", "ms", 1e3),
        (f"worker stopped (SIGSTOP) during a call: until the call raises (inf: not within {FROZEN_LIMIT:.0f} s)",
         "frozen", "s", 1),
        ("CPU used by the thread waiting 2 s for a call", "wait_cpu", "ms", 1e3),
        ("one of 4 ranks raises before an all_reduce: until the call raises (torchrun: until it exits)",
         "one_rank_fails", "s", 1),
    ]  # fmt: skip
    print_rows(results, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a directory with an earlier monarch installed, measured in the same run")
    args = ap.parse_args()
    header()
    report(measure(args.before))


if __name__ == "__main__":
    main()
