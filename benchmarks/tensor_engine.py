"""Tensor engine on 8 workers: op issue rate and inspect vs torchmonarch; `reduce` vs plain gloo all_reduce.

    python benchmarks/tensor_engine.py [--ops 5000] [--inspects 200] [--reduces 10]
    TORCHMONARCH_PYTHON=/tmp/tmvenv/bin/python python benchmarks/tensor_engine.py   # adds Meta's Monarch

monarch: `this_host().spawn_procs({"gpu": 8})`, then inside `with mesh.activate():` a loop of N `x = x + 1`
on a 4-float tensor, timed on the controller from the first op until the last one is handed to the
transport (the `with` block exited, which sends the last batch); `monarch.inspect(x)` afterwards, not
timed, checks the value is N + the start value. The loop runs 3 times after a warm-up; the median is
reported, each loop's rate and the share of its wall time the controller's main thread was on a CPU
(`time.thread_time()`) too. A second figure times the same loops until the value is back (issue + run
on the workers + inspect). inspect: median of K `monarch.inspect(t)` of 4 floats.
reduce: `t.reduce("gpu", "sum")` of a float32 tensor of 1 MB and 16 MB, each timed from the issue to
`monarch.inspect(r[:1].clone())` returning (so it includes completion), median of R after 2 warm-ups;
every element is checked afterwards on the first and last rank. A second row does the same with the
in-place `t.reduce_("gpu", "sum")` (reset to 0.5 before each, outside the clock), which like
`dist.all_reduce` reduces into the tensor itself; `reduce` must copy first, since its input stays.

Peers, each timed the same way in the same run:
- plain torch.distributed: 8 processes from `torch.multiprocessing.spawn`, gloo over a FileStore; rank 0
  times `dist.all_reduce` of the same sizes, R times after 2 warm-ups, with a barrier before each.
- torchmonarch (when TORCHMONARCH_PYTHON names a Python that has it; its import name is also
  `monarch`, so it runs in that Python, outside this checkout): `spawn_tensor_engine` on
  `this_host().spawn_procs(per_host={"gpus": 8})`, the same op loop and inspects. Its `reduce` is not
  measured: on CPU it fails ("no comm found for stream") and takes the workers down.

Ratios are peer / monarch for times and monarch / peer for rates (higher is better for monarch). Each
side runs in fresh processes; processes left behind by a side are found by an environment marker,
reported and killed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

from run import header, peer_env  # benchmarks/run.py, next to this file

WORKERS = 8
OPS = 5000
REPEATS = 3
WARMUP_OPS = 500
INSPECTS = 200
REDUCES = 10
SIZES_MB = (1, 16)

# The op loop and the inspects; `SPAWN` makes `mesh` (and `stop()`), per side.
COMMON = textwrap.dedent(
    """
    import json, statistics, time
    import torch
    import monarch

    def op_loop(start, n):
        with mesh.activate():
            x = torch.full((4,), float(start))
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(n):
                x = x + 1
        issued, cpu = time.perf_counter() - t0, time.thread_time() - c0
        value = monarch.inspect(x)
        done = time.perf_counter() - t0
        assert torch.equal(value, torch.full((4,), float(start + n))), (value, start + n)
        return n / issued, n / done, cpu / issued

    t0 = time.perf_counter()
    SPAWN
    out = {}
    try:
        with mesh.activate():
            first = torch.zeros(4) + 1
        assert torch.equal(monarch.inspect(first), torch.ones(4))
        out["first"] = time.perf_counter() - t0
        op_loop(7, WARMUP_OPS)
        loops = [op_loop(7, OPS) for _ in range(REPEATS)]
        for i, key in enumerate(("ops_issued", "ops_done", "issue_cpu")):
            out[key] = statistics.median(lp[i] for lp in loops)
            out[key + "_all"] = [lp[i] for lp in loops]
        with mesh.activate():
            small = torch.arange(4.0)
        for _ in range(20):
            monarch.inspect(small)
        ts = []
        for _ in range(INSPECTS):
            t0 = time.perf_counter()
            v = monarch.inspect(small)
            ts.append(time.perf_counter() - t0)
        assert torch.equal(v, torch.arange(4.0)), v
        out["inspect"] = statistics.median(ts)
        REDUCE
    finally:
        stop()
    print(json.dumps(out))
    """
)

MONARCH_SPAWN = """
from monarch.actor import this_host
mesh = this_host().spawn_procs({"gpu": WORKERS})
stop = mesh.exit
"""

MONARCH_REDUCE = """
for mb in SIZES_MB:
    with mesh.activate():
        a = torch.ones(mb * 2**20 // 4) * 0.5
    for inplace in (False, True):
        ts = []
        for i in range(2 + REDUCES):
            if inplace:  # back to 0.5, settled before the clock starts
                with mesh.activate():
                    a.fill_(0.5)
                    monarch.inspect(a[:1].clone())
            t0 = time.perf_counter()
            with mesh.activate():
                r = a.reduce_("gpu", "sum") if inplace else a.reduce("gpu", "sum")
                head = r[:1].clone()
            assert monarch.inspect(head).item() == 0.5 * WORKERS
            ts.append(time.perf_counter() - t0)
        for coords in ({"gpu": 0}, {"gpu": WORKERS - 1}):  # every element, first and last rank (not timed)
            assert torch.equal(monarch.inspect(r, **coords), torch.full(a.shape, 0.5 * WORKERS)), coords
        out[f"reduce_{'inplace_' if inplace else ''}{mb}"] = statistics.median(ts[2:])
"""

TORCHMONARCH_SPAWN = """
from monarch.actor import this_host
from monarch.mesh_controller import spawn_tensor_engine
procs = this_host().spawn_procs(per_host={"gpus": WORKERS})
mesh = spawn_tensor_engine(procs)

def stop():
    mesh.exit()
    procs.stop().get()
"""


def _script(spawn: str, reduce: str, ops: int, inspects: int, reduces: int) -> str:
    head = (
        f"WORKERS = {WORKERS}\nOPS = {ops}\nREPEATS = {REPEATS}\nWARMUP_OPS = {WARMUP_OPS}\nINSPECTS = {inspects}\n"
        f"REDUCES = {reduces}\nSIZES_MB = {SIZES_MB!r}\n"
    )
    body = COMMON.replace("SPAWN\n", spawn.strip() + "\n", 1)
    body = body.replace("    REDUCE\n", textwrap.indent(reduce.strip() + "\n", " " * 4) if reduce else "", 1)
    return head + body


def _run_side(python: str, src: str, timeout: float = 600, env: dict | None = None) -> dict | None:
    """Run `src` with `python` outside the checkout (so `import monarch` is that Python's package)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_cell import _gone  # benchmarks/kernel_cell.py, next to this file

    tag = uuid.uuid4().hex[:12]
    env = {**(env or os.environ), "TENSOR_ENGINE_BENCH": tag}
    marker = f"TENSOR_ENGINE_BENCH={tag}"
    try:
        r = subprocess.run(
            [python, "-c", src], capture_output=True, text=True, timeout=timeout, env=env, cwd=tempfile.gettempdir()
        )
    finally:
        leftover = _gone({}, marker.encode())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = r.stderr.strip().splitlines()[-3:] if r.stderr else r.returncode
        print(f"  ({python}: failed: {tail})")
        return None
    out = json.loads(lines[-1])
    out["leftover"] = leftover
    return out


def _gloo_worker(rank: int, world: int, init: str, sizes_mb: tuple, reduces: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = {}
    try:
        for mb in sizes_mb:
            t = torch.full((mb * 2**20 // 4,), 0.5)
            ts = []
            for _ in range(2 + reduces):
                t.fill_(0.5)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                ts.append(time.perf_counter() - t0)
            assert torch.equal(t, torch.full(t.shape, 0.5 * world)), t[:4]
            out[f"reduce_{mb}"] = statistics.median(ts[2:])
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result, "w") as f:
            json.dump(out, f)


def measure_gloo(reduces: int = REDUCES) -> dict:
    """Plain gloo all_reduce on WORKERS processes from torch.multiprocessing.spawn (joined before return)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo-bench-") as d:
        result = os.path.join(d, "result.json")
        mp.spawn(
            _gloo_worker, args=(WORKERS, f"file://{d}/store", SIZES_MB, reduces, result), nprocs=WORKERS, join=True
        )
        with open(result) as f:
            out = json.load(f)
    out["leftover"] = []
    return out


def measure(ops: int = OPS, inspects: int = INSPECTS, reduces: int = REDUCES, before: str | None = None) -> dict:
    """Figures per side (seconds; ops per second): monarch, gloo, and torchmonarch when TORCHMONARCH_PYTHON is set."""
    results: dict = {}
    script = _script(MONARCH_SPAWN, MONARCH_REDUCE, ops, inspects, reduces)
    if before:
        from run import abba, before_env

        results["monarch"], results["monarch before"] = abba(
            lambda: _run_side(sys.executable, script),
            lambda: _run_side(sys.executable, script, env=before_env(before)),
            warm_up=True,  # (its first row, spawn + first op + inspect, is one-time)
        )
    else:
        results["monarch"] = _run_side(sys.executable, script)
    assert results["monarch"] is not None, "monarch's tensor-engine benchmark failed"
    results["gloo"] = measure_gloo(reduces)
    tm = os.environ.get("TORCHMONARCH_PYTHON")
    if tm:
        results["torchmonarch"] = _run_side(tm, _script(TORCHMONARCH_SPAWN, "", ops, inspects, reduces), env=peer_env())
    return results


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def report(results: dict, ops: int = OPS, inspects: int = INSPECTS, reduces: int = REDUCES) -> None:
    ours = results["monarch"]
    # title, key (the peers' key when it differs), unit, scale, higher is better
    rows = [
        (f"ops issued per second, `x = x + 1` x {ops} (median of {REPEATS})", "ops_issued", "ops/s", 1, True),
        ("same loops, completed per second (issue to value back)", "ops_done", "ops/s", 1, True),
        (f"inspect of 4 floats, round trip (median of {inspects})", "inspect", "ms", 1e3, False),
    ]
    for mb in SIZES_MB:
        rows.append((f"reduce sum of {mb} MB float32 (out of place: a fresh result tensor), issue to value back "
                     f"(median of {reduces})", f"reduce_{mb}", "ms", 1e3, False))  # fmt: skip
        rows.append((f"  {mb} MB with reduce_ (in place, like dist.all_reduce)",
                     f"reduce_inplace_{mb}:reduce_{mb}", "ms", 1e3, False))  # fmt: skip
    rows.append(("spawn + first op + inspect, torch imported (one-time)", "first", "s", 1, False))
    for title, keys, unit, scale, higher in rows:
        key, _, peer_key = keys.partition(":")
        peer_key = peer_key or key
        parts = [f"monarch {_fmt(ours[key] * scale)} {unit}"]
        for peer, res in results.items():
            if peer == "monarch":
                continue
            theirs = key if res and key in res else peer_key  # ("monarch before" has our keys; gloo, its own)
            if res and theirs in res:
                ratio = ours[key] / res[theirs] if higher else res[theirs] / ours[key]
                parts.append(f"{peer} {_fmt(res[theirs] * scale)} {unit} (ratio {ratio:.2f}x)")
            elif peer == "torchmonarch" or (peer == "gloo" and key.startswith("reduce")):
                why = "" if res else ", failed"
                if res and key.startswith("reduce"):
                    why = ", fails on CPU"
                parts.append(f"{peer} not measured{why}")
        print(f"{title}: " + " | ".join(parts))
    for peer, res in results.items():
        if res and "ops_issued_all" in res:
            each = ", ".join(_fmt(v) for v in res["ops_issued_all"])
            cpu = ", ".join(f"{v:.0%}" for v in res["issue_cpu_all"])
            print(f"  {peer}: ops/s issued per loop {each}; controller's main thread on a CPU while issuing: {cpu}")
    for mb in SIZES_MB:
        key = f"reduce_{mb}"
        gb = [f"{p} {mb * 2**20 / res[key] / 1e9:.2f}" for p, res in results.items() if res and key in res]
        print(f"  reduce {mb} MB, algorithm bandwidth in GB/s (size / time): " + ", ".join(gb))
    if "torchmonarch" not in results:
        print("torchmonarch: not measured (set TORCHMONARCH_PYTHON to a Python with torchmonarch)")
    for peer, res in results.items():
        if res and res["leftover"]:
            print(f"  ({peer}: {len(res['leftover'])} processes outlived shutdown, killed: {res['leftover']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=OPS, help="ops in the timed loop (default %(default)s)")
    ap.add_argument("--inspects", type=int, default=INSPECTS, help="timed inspects (default %(default)s)")
    ap.add_argument("--reduces", type=int, default=REDUCES, help="timed reduces per size (default %(default)s)")
    args = ap.parse_args()
    header()
    t0 = time.perf_counter()
    results = measure(args.ops, args.inspects, args.reduces)
    report(results, args.ops, args.inspects, args.reduces)
    print(f"(whole run {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
