"""One controller at 8 to 4,096 ranks, on synthetic hosts: how its cost grows.

    python benchmarks/scale.py [--sizes 8,64,512,4096] [--per-host 64] [--calls 20] [--plot benchmarks/scale.png]
                               [--no-bundles] [--heartbeat-timeout 6] [--rack-above 64] [--rack-size 16]

Each size runs in a fresh process against `tests/helpers/synthetic_hosts.py`'s agents: real host agents (CURVE
links with heartbeats, relays, the workers' protocol spoken per rank, each rank's messages signed with its own
numbers), whose ranks answer from one thread per host instead of one process each, so that this machine holds
4,096 of them. Ranks are placed `--per-host` to a host (fewer on one host below that). Measured, the
controller's CPU (`time.process_time`: all its threads) and the wall time, per:

- attach and spawn (the agents already up): `job.spawn_procs` until every rank said Ready;
- a no-op live function on every rank (mean of `--calls` after one warm-up), and the messages it reached the
  controller in (each host's agent bundles its ranks' replies: `runtime/wire/fanin.py`; `--no-bundles` turns
  that off, `MONARCH_BUNDLE_WAIT_US=0`, for the figures without it);
- an actor endpoint `call()` on an actor on every rank (mean of `--calls`);
- a tensor-engine op issued (`x = x + 1` under `mesh.activate()`, 2,000 of them after one untimed round; the
  engine sends them in batches, one signed message per batch whatever the ranks; the synthetic ranks drop them);
- one printed line from every rank, until the call returns (every line handed to the output first);
- one rank failing: until the grouped `RemoteError` naming it is raised.

The synthetic hosts share this machine's cores with the controller: the wall times include their work, the
CPU figures do not. The controller spends CPU while idle too (ZeroMQ's heartbeats on its four links to each host,
measured over two idle seconds: `idle_cpu_ms_s`); the synthetic hosts make each call last longer than on a
cluster, so each CPU figure is also given net of that idle rate over the call's wall time (`*_net_ms`). Hundreds
of synthetic hosts on 2 cores can starve one of them past the heartbeats' 6 s (it is then taken as lost):
`--heartbeat-timeout` raises it for the run. A job of more hosts than `--rack-above` (the runtime's default, 64) is
racked by `--rack-size` (`runtime/agent/rack.py`: each rack's leader merges its hosts' bundles). Prints a markdown table; `--plot` draws the controller's CPU per call
against ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")

ONE_SIZE = """
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import monarch, monarch.notebook
from monarch.runtime.controller import get_controller
from helpers.synthetic_hosts import Counter, SyntheticJob, fail_on, noop, say

hosts, per_host, calls, ops = {hosts}, {per_host}, {calls}, 2000


def transport_sends(mesh):  # messages sent to the mesh so far (one number per signed send, whatever the ranks)
    return mesh.spawned.backend.transport._meshes[mesh.spawned.mesh_id].seq
ranks = hosts * per_host
out = {{"ranks": ranks, "hosts": hosts}}
job = SyntheticJob(Path(tempfile.mkdtemp()), "scale", hosts=hosts)
out["agents_up_s"] = job.start(timeout=600)
try:
    def timed(fn):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - c0, time.perf_counter() - t0

    got = {{}}
    out["spawn_cpu_s"], out["spawn_s"] = timed(
        lambda: got.setdefault("mesh", monarch.notebook.job("scale").spawn_procs({{"gpu": per_host}})))
    mesh = got["mesh"]
    assert noop.on(mesh)().values() == [None] * ranks
    c0 = time.process_time()
    time.sleep(2)
    idle = (time.process_time() - c0) / 2  # (CPU seconds a second, idle: the links' heartbeats)
    out["idle_cpu_ms_s"] = 1e3 * idle
    transport = get_controller().backend.transport
    bundles = transport.bundles
    cpu, wall = timed(lambda: [noop.on(mesh)() for _ in range(calls)])
    out["noop_cpu_ms"], out["noop_ms"] = 1e3 * cpu / calls, 1e3 * wall / calls
    out["noop_net_ms"] = 1e3 * (cpu - idle * wall) / calls
    out["noop_bundles"] = (transport.bundles - bundles) / calls
    counters = mesh.spawn("counters", Counter)
    assert counters.incr.call().get().values() == [1] * ranks
    cpu, wall = timed(lambda: [counters.incr.call().get() for _ in range(calls)])
    out["actor_cpu_ms"], out["actor_ms"] = 1e3 * cpu / calls, 1e3 * wall / calls
    out["actor_net_ms"] = 1e3 * (cpu - idle * wall) / calls
    import torch

    def issue():
        with mesh.activate():
            t = torch.zeros(4)
            for _ in range(ops):
                t = t + 1

    issue()  # (the first time: the capture's own set-up)
    sent = transport_sends(mesh)
    cpu, wall = timed(issue)
    out["op_cpu_us"], out["op_us"] = 1e6 * cpu / ops, 1e6 * wall / ops
    out["op_batches"] = transport_sends(mesh) - sent
    lines = []
    controller = get_controller()
    controller.output, shown = lines.append, controller.output  # (counted, not printed)
    try:
        out["print_cpu_ms"], out["print_ms"] = (1e3 * x for x in timed(lambda: say.on(mesh)("a line")))
    finally:
        controller.output = shown
    assert len(lines) == ranks, len(lines)

    def fails():
        try:
            fail_on.on(mesh)(ranks - 3)
        except monarch.RemoteError as e:
            assert f"rank {{ranks - 3}} " in str(e), str(e)
        else:
            raise AssertionError("no error")

    out["fail_cpu_ms"], out["fail_ms"] = (1e3 * x for x in timed(fails))
    mesh.exit()
finally:
    left = job.stop()
    assert not left, left
print("RESULT " + json.dumps(out))
"""


def one_size(
    hosts: int, per_host: int, calls: int, bundles: bool = True, heartbeat_timeout: float = 6.0,
    racks: dict[str, str] | None = None,
) -> dict:  # fmt: skip
    script = ONE_SIZE.format(tests=TESTS, hosts=hosts, per_host=per_host, calls=calls)
    with tempfile.TemporaryDirectory() as jobs:
        env = dict(os.environ, MONARCH_JOBS_DIR=jobs, MONARCH_HEARTBEAT_TIMEOUT=str(heartbeat_timeout), **(racks or {}))
        if not bundles:
            env["MONARCH_BUNDLE_WAIT_US"] = "0"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"{hosts} hosts x {per_host}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def table(rows: list[dict]) -> str:
    out = [
        "| ranks (hosts) | attach + spawn | controller CPU idle | no-op call: controller CPU (net of idle) / wall "
        "| messages per call | actor `call()`: CPU (net) / wall | a tensor op issued: CPU / wall | a line from every rank "
        "| one rank of all failing |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['ranks']:,} ({r['hosts']}) | {r['spawn_s']:.2f} s | {r['idle_cpu_ms_s']:.1f} ms/s "
            f"| {r['noop_cpu_ms']:.2f} ({r['noop_net_ms']:.2f}) / {r['noop_ms']:.2f} ms "
            f"| {r['noop_bundles'] or r['ranks']:g} | {r['actor_cpu_ms']:.2f} ({r['actor_net_ms']:.2f}) / {r['actor_ms']:.2f} ms "
            f"| {r['op_cpu_us']:.1f} / {r['op_us']:.1f} µs "
            f"| {r['print_cpu_ms']:.1f} / {r['print_ms']:.1f} ms | {r['fail_cpu_ms']:.1f} / {r['fail_ms']:.1f} ms |"
        )
    return "\n".join(out)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    """The controller's CPU per call against ranks: each of `runs` (label -> rows), the first drawn solid, then
    dashed, then dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    colors = {}
    for n, (run, rows) in enumerate(runs.items()):
        ranks = [r["ranks"] for r in rows]
        for key, label in (("noop_cpu_ms", "no-op call"), ("actor_cpu_ms", "actor call()"),
                           ("print_cpu_ms", "a line from every rank"), ("fail_cpu_ms", "one rank failing")):  # fmt: skip
            line = ax.plot(ranks, [r[key] for r in rows], marker="os^"[n % 3], linestyle=("-", "--", ":")[n % 3],
                           color=colors.get(key), label=f"{label}, {run}")  # fmt: skip
            colors[key] = line[0].get_color()
        if n == 0:
            for r in rows:
                ax.annotate(f"{r['hosts']} host{'s' if r['hosts'] > 1 else ''}", (r["ranks"], r["noop_cpu_ms"]),
                            textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("controller CPU per call (ms)")
    ax.set_title("one controller, synthetic hosts")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,512,4096", help="rank counts, comma-separated")
    ap.add_argument("--per-host", type=int, default=64, help="ranks per synthetic host")
    ap.add_argument("--calls", type=int, default=20, help="no-op calls timed per size")
    ap.add_argument("--plot", default="", help="where to draw the PNG (none without)")
    ap.add_argument("--no-bundles", action="store_true", help="host agents send each message up as it came")
    ap.add_argument("--compare", action="store_true", help="each size with bundles and without, side by side")
    ap.add_argument("--heartbeat-timeout", type=float, default=6.0, help="seconds before a silent host is lost")
    ap.add_argument("--rack-above", type=int, help="rack a job of more hosts than this (default: the runtime's)")
    ap.add_argument("--rack-size", type=int, help="hosts per rack (default: the runtime's)")
    args = ap.parse_args()
    racks = {}
    if args.rack_above is not None:
        racks["MONARCH_RACK_ABOVE"] = str(args.rack_above)
    if args.rack_size is not None:
        racks["MONARCH_RACK_SIZE"] = str(args.rack_size)
    modes = [True, False] if args.compare else [not args.no_bundles]
    runs: dict[str, list[dict]] = {}
    for ranks in (int(s) for s in args.sizes.split(",")):
        per_host = min(ranks, args.per_host)
        if ranks % per_host:
            raise SystemExit(f"--sizes: {ranks} ranks is not a multiple of --per-host {per_host}")
        for bundles in modes:
            row = one_size(ranks // per_host, per_host, args.calls, bundles, args.heartbeat_timeout, racks)
            runs.setdefault("bundled" if bundles else "one message per rank", []).append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    for run, rows in runs.items():
        print(f"\n{run}:\n{table(rows)}")
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
