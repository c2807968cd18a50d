"""Proof under repetition (issue 30): the agent, store and shutdown paths, many times in a row, in one
controller process, as a kernel that lives for days would run them.

    python benchmarks/stress.py [--rounds 200] [--every 20]

Each round:
- attaches to a job of two host agents on this machine (real agent processes on 127.0.0.1 and 127.0.0.2,
  started by `tests/helpers/agent_job.py`), spawns {host: 2, gpu: 1} there, runs an all_reduce over a
  dimension's group (a rendezvous through the store, relayed by the agents), exits the mesh (the
  controller detaches from the agents);
- spawns {gpu: 2} locally, makes a group, prints a burst from a call nobody waits for and exits at once:
  every line must arrive (the last one is checked);
- counts what the controller holds: RSS, open file descriptors, threads, store keys; and worker processes
  left running (none may be).

A round that raises, loses output or leaves a process is a failure, reported with its error; the run goes
on. Not part of the test suite (it takes minutes); its result goes in `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.agent_job import AgentJob  # noqa: E402  (two host agents on this machine, as the tests start them)

BURST = 2000
"""Lines each local worker prints just before its mesh exits."""


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def workers() -> list[int]:
    """Worker processes descending from this one (its own and the agents' workers)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    procs = {int(pid): (int(ppid), args) for pid, ppid, args in (line.split(None, 2) for line in out)}
    me, found = os.getpid(), []
    for pid, (ppid, args) in procs.items():
        if not args.startswith("monarch worker"):
            continue
        p, hops = ppid, 0
        while p != me and p in procs and hops < 4:
            p, hops = procs[p][0], hops + 1
        if p == me:
            found.append(pid)
    return found


def one_round(job_name: str) -> None:
    import monarch
    import monarch.notebook
    from monarch.actor import this_host

    @monarch.remote
    def reduce_over(group):
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return t.item()

    @monarch.remote
    def burst(n):
        rank = monarch.current_rank()["gpu"]
        for i in range(n):
            print(f"rank {rank} line {i}")
        print(f"LAST of rank {rank}", flush=True)

    remote = monarch.notebook.job(job_name).spawn_procs({"gpu": 1})
    try:
        got = reduce_over.on(remote)(remote.process_group("host")).values()
        if got != [2.0, 2.0]:
            raise AssertionError(f"all_reduce across the agents gave {got}")
    finally:
        remote.exit()

    local = this_host().spawn_procs({"gpu": 2})
    captured = io.StringIO()
    with redirect_stdout(captured):  # (the controller prints workers' output to sys.stdout)
        try:
            got = reduce_over.on(local)(local.process_group("gpu")).values()
            if got != [2.0, 2.0]:
                raise AssertionError(f"all_reduce on the local mesh gave {got}")
            burst.on(local).call_async(BURST)
        finally:
            local.exit()
    text = captured.getvalue()
    for rank in range(2):
        if f"LAST of rank {rank}" not in text:
            lines = text.count(f"rank {rank} line ")
            raise AssertionError(f"rank {rank}'s output was cut at shutdown: {lines} of {BURST} lines arrived")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="print a line of counts every this many rounds")
    args = ap.parse_args()

    from monarch.runtime.controller import get_controller

    root = tempfile.mkdtemp(prefix="monarch-stress-")
    agents = AgentJob(Path(root), "stress", hosts=2)
    agents.start(timeout=60)
    failures: list[tuple[int, str]] = []
    rows = []
    started = time.monotonic()
    try:
        for i in range(1, args.rounds + 1):
            try:
                one_round(agents.name)
            except Exception as e:
                failures.append((i, f"{type(e).__name__}: {e}"))
                traceback.print_exc()
            left = workers()
            if left:  # (an exited mesh's workers are gone when exit() returns)
                failures.append((i, f"worker processes left running: {left}"))
            if i == 1 or i % args.every == 0 or i == args.rounds:
                store = get_controller().backend.store
                row = (i, rss_mib(), len(os.listdir("/proc/self/fd")), threading.active_count(), len(store.data),
                       len(store.marks), len(left), time.monotonic() - started)  # fmt: skip
                rows.append(row)
                print("round {:4d}  RSS {:6.1f} MiB  fds {:4d}  threads {:3d}  store keys {:3d} (+{} gone marks)  "
                      "workers left {}  {:.0f} s".format(*row), flush=True)  # fmt: skip
    finally:
        get_controller().shutdown()
        left = agents.stop()
        shutil.rmtree(root, ignore_errors=True)
        if left:
            failures.append((args.rounds, f"agent processes left running: {left}"))
    print(f"\n{args.rounds} rounds, {len(failures)} failures, {time.monotonic() - started:.0f} s")
    for i, why in failures:
        print(f"  round {i}: {why}")
    first, last = rows[1] if len(rows) > 2 else rows[0], rows[-1]
    print(
        f"from round {first[0]} to {last[0]}: RSS {first[1]:.1f} -> {last[1]:.1f} MiB, fds {first[2]} -> {last[2]}, "
        f"threads {first[3]} -> {last[3]}, store keys {first[4]} -> {last[4]}"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
