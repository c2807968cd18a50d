"""Many real workers on this machine's cores: a no-op call and an actor `call()` at 8 and 64 local workers.

    python benchmarks/local_workers.py [--sizes 8,64] [--calls 400] [--before REV] [--pairs 2]

Issue 44's targets on 64 real local workers (2 cores): a no-op call <= 2.5 ms, an actor `call()` <= 4 ms. Each
size runs in a fresh process (`run.measure`): `this_host().spawn_procs({"gpu": N})`, an actor mesh on it (so
each worker waits on its actors' poller too, as a program with actors does), 100 warm-up calls of each kind,
then `--calls` of each, timed one by one (median). Beside the wall time, the CPU: the controller's (all its
threads, per call) and the workers' (utime + stime of every thread from /proc, per call and per worker; 10 ms
ticks, summed over the workers). Where 64 workers share two cores, the wall time is about their CPU and the
controller's over two: the CPU figures say which side moved.

With `--before REV` it measures this tree and REV side by side (installed alike, `run.install_before` /
`run.install_now`), in the order now, before, before, now for each of `--pairs` pairs, and prints each run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap

from run import before_env, header, install_before, install_now, measure  # benchmarks/run.py, next to this file

CODE = textwrap.dedent(
    """
    import json, os, resource, statistics, subprocess, time
    import monarch
    from monarch.actor import Actor, endpoint, this_host

    @monarch.remote
    def noop():
        return None

    class Pinger(Actor):
        @endpoint
        def ping(self):
            return None

    mesh = this_host().spawn_procs({"gpu": N})
    f, actors = noop.on(mesh), mesh.spawn("pinger", Pinger)
    for _ in range(100):
        f(); actors.ping.call().get()
    pids = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(os.getpid())]).split()]
    pids += [int(c) for p in pids for c in subprocess.run(["pgrep", "-P", str(p)], capture_output=True,
                                                        text=True).stdout.split()]

    def workers_cpu():
        total = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    rest = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(rest[11]) + int(rest[12])
        return total / os.sysconf("SC_CLK_TCK")

    def own_cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out = {}
    for name, call in (("noop", f), ("actor", lambda: actors.ping.call().get())):
        ts = []
        w0, c0 = workers_cpu(), own_cpu()
        for _ in range(CALLS):
            t0 = time.perf_counter(); call(); ts.append(time.perf_counter() - t0)
        w1, c1 = workers_cpu(), own_cpu()
        out[name] = statistics.median(ts)
        out[name + "_controller_cpu"] = (c1 - c0) / CALLS
        out[name + "_worker_cpu"] = (w1 - w0) / CALLS / N
    mesh.exit()
    print(json.dumps(out))
    """
)


def one(n: int, calls: int, site: str | None = None) -> dict | None:
    """One size measured in a fresh process (of this tree, or of the install in `site`)."""
    return measure(sys.executable, f"N = {n}\nCALLS = {calls}\n" + CODE, before_env(site))  # (after run's own N)


def line(who: str, n: int, r: dict | None) -> str:
    if r is None:
        return f"{who:>7} {n:>3} workers: failed"
    return (
        f"{who:>7} {n:>3} workers: no-op call {r['noop'] * 1e3:.3f} ms (controller CPU {r['noop_controller_cpu'] * 1e3:.3f}"
        f" ms, each worker {r['noop_worker_cpu'] * 1e6:.1f} µs) | actor call() {r['actor'] * 1e3:.3f} ms (controller "
        f"{r['actor_controller_cpu'] * 1e3:.3f} ms, each worker {r['actor_worker_cpu'] * 1e6:.1f} µs)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64", help="worker counts, comma-separated")
    ap.add_argument("--calls", type=int, default=400, help="calls of each kind timed per size")
    ap.add_argument("--before", metavar="REV", help="also measure this project at git revision REV")
    ap.add_argument("--pairs", type=int, default=2, help="with --before: now/before pairs, in ABBA order")
    args = ap.parse_args()
    header()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.before:
        for n in sizes:
            print(line("monarch", n, one(n, args.calls)), flush=True)
        return
    before = install_before(args.before)
    install_now()
    for n in sizes:
        runs: dict[str, list[dict]] = {"now": [], "before": []}
        for i in range(args.pairs):
            for who in ("now", "before") if i % 2 == 0 else ("before", "now"):
                r = one(n, args.calls, before if who == "before" else None)
                print(line(who, n, r), flush=True)
                if r is not None:
                    runs[who].append(r)
        if runs["now"] and runs["before"]:
            now, was = (statistics.median(r["noop"] for r in runs[k]) for k in ("now", "before"))
            a_now, a_was = (statistics.median(r["actor"] for r in runs[k]) for k in ("now", "before"))
            print(f"{n} workers, medians of the runs: no-op {now * 1e3:.3f} ms vs {was * 1e3:.3f} before (ratio "
                  f"{was / now:.2f}x), actor call() {a_now * 1e3:.3f} vs {a_was * 1e3:.3f} (ratio {a_was / a_now:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
