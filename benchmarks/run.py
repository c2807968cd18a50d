"""Side-by-side runtime benchmarks: monarch vs ipyparallel (and torchmonarch when given).

    ./run bench                 # installs ipyparallel if missing, measures both, prints ratios
    TORCHMONARCH_PYTHON=/path/to/venv/bin/python ./run bench   # adds Meta's Monarch (own venv:
                                # its import name is also `monarch`)
    ./run bench --workloads     # adds benchmarks/workloads.py: nanoGPT and the Llama FSDP step vs torchrun
    ./run bench --actors        # adds benchmarks/actors.py (actors, ports and the RL loop vs torchmonarch:
                                # TORCHMONARCH_PYTHON; a raw pyzmq echo, the floor), benchmarks/spmd.py (a
                                # torchrun script's start through SPMDActor) and benchmarks/rdma.py (RDMABuffer
                                # bandwidth against a copy)
    ./run bench --before REV    # adds this project at git revision REV ("monarch before"), installed
                                # beside the checkout, measured in the same run (a change's before/after)

Each figure comes from fresh processes in this run; ratios are peer / monarch (higher is better). The hardware
floor (benchmarks/floor.py: raw pyzmq round trips and bare forks, no monarch) is measured first, in the same run,
and each headline figure is followed by its ratio to its floor ("÷ floor") and issue 29's target where it has one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable

N = 8
ROUND_TRIPS = 500
FLOOR_TARGET = 1.5
"""Issue 29: a no-op call on N workers at most this many times the raw pyzmq round trip to N forks."""

MONARCH = textwrap.dedent(
    """
    import json, statistics, time
    import torch  # (a program with torch: its workers set torch up and join the group at spawn, as measured)
    t0 = time.perf_counter()
    from monarch.actor import this_host
    import monarch
    mesh = this_host().spawn_procs({"gpu": N})
    cold = time.perf_counter() - t0
    seconds = []
    for _ in range(5):  # (one start is at the mercy of the machine's noise: the median of five)
        t0 = time.perf_counter()
        mesh2 = this_host().spawn_procs({"gpu": N})
        seconds.append(time.perf_counter() - t0)
        mesh2.exit()
    second = statistics.median(seconds)

    @monarch.remote
    def noop():
        return None

    f = noop.on(mesh)
    for _ in range(50):
        f()
    ts = []
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    mesh.exit()
    print(json.dumps({"cold": cold, "second": second, "rtt": statistics.median(ts)}))
    """
)

IPYPARALLEL = textwrap.dedent(
    """
    import json, statistics, time, logging
    import ipyparallel as ipp
    logging.disable(logging.WARNING)

    def start():
        t0 = time.perf_counter()
        cluster = ipp.Cluster(n=N, log_level=logging.ERROR)
        rc = cluster.start_and_connect_sync()
        rc.wait_for_engines(N, timeout=120)
        rc[:].execute("import torch", block=True)
        return cluster, rc, time.perf_counter() - t0

    c1, rc, cold = start()
    c2, rc2, second = start()
    rc2.close(); c2.stop_cluster_sync()
    dv = rc[:]

    def noop():
        return None

    for _ in range(20):
        dv.apply_sync(noop)
    ts = []
    for _ in range(ROUND_TRIPS // 5):
        t0 = time.perf_counter(); dv.apply_sync(noop); ts.append(time.perf_counter() - t0)
    rc.close(); c1.stop_cluster_sync()
    print(json.dumps({"cold": cold, "second": second, "rtt": statistics.median(ts)}))
    """
)

TORCHMONARCH = textwrap.dedent(
    """
    import json, statistics, time, asyncio
    t0 = time.perf_counter()
    from monarch.actor import Actor, endpoint, this_host

    class Noop(Actor):
        @endpoint
        def noop(self):
            return None

    procs = this_host().spawn_procs(per_host={"gpus": N})
    actors = procs.spawn("noop", Noop)
    actors.noop.call().get()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    procs2 = this_host().spawn_procs(per_host={"gpus": N})
    procs2.spawn("noop", Noop).noop.call().get()
    second = time.perf_counter() - t0
    for _ in range(20):
        actors.noop.call().get()
    ts = []
    for _ in range(ROUND_TRIPS // 5):
        t0 = time.perf_counter(); actors.noop.call().get(); ts.append(time.perf_counter() - t0)
    print(json.dumps({"cold": cold, "second": second, "rtt": statistics.median(ts)}))
    """
)


def before_env(site: str | None) -> dict | None:
    """The environment that makes `import monarch` the earlier copy installed in `site` (None: this one)."""
    if not site:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def install_before(rev: str) -> str:
    """Install this repository's monarch at git revision `rev` into a directory of its own; return it."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # named by commit, not by what was typed: "HEAD" or a branch moves, and an install kept under its name would
    # stand for an older revision
    rev = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--short", f"{rev}^{{commit}}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    site = os.path.join(tempfile.gettempdir(), f"bench-before-{rev}")
    if not os.path.isdir(os.path.join(site, "monarch")):
        tree = tempfile.mkdtemp(prefix="bench-before-")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", tree, rev], check=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, tree],
                           check=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], check=False)
    print(f"monarch before: revision {rev}, installed in {site}")
    return site


def install_now() -> str:
    """Install the working tree as it is into a directory of its own, the way `install_before` installs the
    earlier revision, and put it first on PYTHONPATH for every measurement of "monarch" (an editable install
    costs each worker's first imports some ms: the two sides must be installed alike to be compared)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = tempfile.mkdtemp(prefix="bench-now-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, repo], check=True)
    os.environ["PYTHONPATH"] = site + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    print(f"monarch: the working tree, installed in {site}")
    return site


def peer_env() -> dict:
    """The environment for a peer's own Python (torchmonarch's import name is also `monarch`): without the
    PYTHONPATH that `install_now` / `before_env` put our trees on."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def measure(python: str, code: str, env: dict | None = None, cwd: str | None = None) -> dict | None:
    src = f"N = {N}\nROUND_TRIPS = {ROUND_TRIPS}\n" + code
    # run outside the checkout, so that `import monarch` means the installed package of that Python
    r = subprocess.run(
        [python, "-c", src], capture_output=True, text=True, timeout=600, env=env, cwd=cwd or tempfile.gettempdir()
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        print(f"  ({python}: failed: {r.stderr.strip().splitlines()[-1:] if r.stderr else r.returncode})")
        return None
    return json.loads(lines[-1])


def abba(
    now: Callable[[], dict | None], before: Callable[[], dict | None], warm_up: bool = False
) -> tuple[dict | None, dict | None]:
    """Measure this tree and the earlier one in the order now, before, before, now, and average each side: run in
    one fixed order, the side measured first read slower on this VM's one-time figures (cold caches; an
    interleaved A/B of the same code showed no difference).

    `warm_up`: one run of `before` first, not counted, for one-time figures (a cold spawn, the first op): even in
    this order the very first run is the cold one, and it is always `now`'s. The same tree on both sides, this
    harness's ABBA of tensor_engine's script: the first side read 0.98, 0.94, 0.995x the other with no warm-up,
    0.98, 1.10, 1.05x after one (eleventh session, `benchmarks/RESULTS.md`)."""
    if warm_up:
        before()
    a1 = now()
    b1, b2 = before(), before()
    a2 = now()
    return _mean([a1, a2]), _mean([b1, b2])


def _mean(runs: list[dict | None]) -> dict | None:
    """Each number averaged over `runs` (anything else taken from the first); None if a run failed."""
    if any(r is None for r in runs):
        return None
    first = runs[0]
    assert first is not None
    return {
        k: statistics.mean(r[k] for r in runs if r is not None)
        if isinstance(v, int | float) and not isinstance(v, bool)
        else v
        for k, v in first.items()
    }


def ensure_ipyparallel() -> None:
    try:
        import ipyparallel  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "ipyparallel==9.2.0"], check=True)


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def print_rows(results: dict, rows: list[tuple[str, str, str, float]]) -> None:
    """One line per (title, key, unit, scale): monarch's figure, then each peer's with the ratio peer / monarch."""
    ours = results["monarch"]
    for title, key, unit, scale in rows:
        parts = [f"monarch {ours[key] * scale:.3g} {unit}"]
        for peer, res in results.items():
            if peer != "monarch" and res and key in res:
                parts.append(f"{peer} {res[key] * scale:.3g} {unit} (ratio {res[key] / ours[key]:.1f}x)")
        print(f"{title}: " + " | ".join(parts))


def _times(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def print_floor_ratio(
    results: dict, key: str, floor: float | None, what: str, target: str = "", label: str = ""
) -> None:
    """The line under a headline figure: each side's `key` ÷ this run's `floor` (seconds), and `target`."""
    if not floor:
        print(f"  {label}÷ floor: not measured (the floor, {what}, failed above){target}")
        return
    unit = f"{floor * 1e3:.3g} ms" if floor >= 1e-3 else f"{floor * 1e6:.3g} µs"
    parts = [f"{side} {_times(res[key] / floor)}" for side, res in results.items() if res and key in res]
    print(f"  {label}÷ floor ({what}: {unit}): " + " | ".join(parts) + target)


def print_headline(results: dict, floors: dict) -> None:
    """The headline rows (`print_rows`), each followed by its ratio to the floor and issue 29's target."""
    ours, tm = results["monarch"], results.get("torchmonarch")
    forks = f"{N} forks of a process with only the stdlib and pyzmq, to their hellos"
    if tm:
        met = "met" if ours["cold"] <= tm["cold"] else "not met"
    else:
        met = "torchmonarch not measured"
    print_rows(results, [("cold spawn of 8 workers to ready (torch imported, group up)", "cold", "s", 1)])
    print_floor_ratio(
        results, "cold", floors.get("spawn"), forks, f"; target (issue 29): no slower than torchmonarch's: {met}"
    )
    print_floor_ratio(
        results, "cold", floors.get("torch_import"), "`import torch` alone in a fresh process, which ours pay once"
    )
    print_rows(results, [("second mesh's spawn (8 workers; monarch's: median of 5)", "second", "s", 1)])
    print_floor_ratio(results, "second", floors.get("spawn"), forks)
    print_rows(results, [("no-op call on 8 workers, round trip (median)", "rtt", "ms", 1e3)])
    rtt = floors.get("rtt")
    met = "?" if not rtt else "met" if ours["rtt"] / rtt <= FLOOR_TARGET else "not met"
    print_floor_ratio(
        results,
        "rtt",
        rtt,
        f"raw pyzmq round trip to {N} forks, XPUB/XSUB down and PUSH/PULL up (as ours with MONARCH_LANES=0)",
        f"; target (issue 29): <= {FLOOR_TARGET}x: {met}",
    )
    print_floor_ratio(results, "rtt", floors.get("rtt_unix"), f"raw Unix stream sockets to {N} forks, as our lanes")


def header() -> None:
    """What a benchmark prints first: the machine; and quiet logging."""
    logging.disable(logging.WARNING)
    print(f"machine: {machine()}")


def options(argv: list[str]) -> argparse.Namespace:
    """The command line of `./run bench`, declared once (`--help` is made from it)."""
    parser = argparse.ArgumentParser(
        prog="./run bench",
        description="Side-by-side runtime benchmarks: monarch against its peers, measured in the same run; "
        "results go in benchmarks/RESULTS.md. TORCHMONARCH_PYTHON=/path/to/venv/bin/python adds Meta's Monarch.",
    )
    parser.add_argument("--before", metavar="REV", help="also measure this project at git revision REV, side by side")
    parser.add_argument(
        "--workloads", action="store_true", help="add nanoGPT and the Llama FSDP step vs torchrun (minutes)"
    )
    parser.add_argument(
        "--actors", action="store_true", help="add actors, ports, the RL loop, SPMDActor and RDMA (vs torchmonarch)"
    )
    for part, what in (
        ("kernel", "the first cell and cells through a real kernel"),
        ("tensors", "the tensor engine (activate, inspect)"),
        ("faults", "failure paths (a rank raising, Ctrl-C, a killed worker)"),
        ("profiling", "the profiler's overhead"),
        ("simulator", "the simulator against measured steps"),
    ):
        parser.add_argument(f"--no-{part}", action="store_true", help=f"skip {what}")
    return parser.parse_args(argv)


def main() -> None:
    args = options(sys.argv[1:])
    ensure_ipyparallel()
    print(f"machine: {machine()}")
    before = install_before(args.before) if args.before else None
    if before:
        install_now()
    import floor  # benchmarks/floor.py (it imports this module: imported here, not at the top)

    floors = floor.floors()  # before our side, in the same run
    print(floor.describe(floors))
    if before:
        now, earlier = abba(
            lambda: measure(sys.executable, MONARCH),
            lambda: measure(sys.executable, MONARCH, before_env(before)),
            warm_up=True,
        )
        results = {"monarch": now, "monarch before": earlier}
    else:
        results = {"monarch": measure(sys.executable, MONARCH)}
    results["ipyparallel"] = measure(sys.executable, IPYPARALLEL)
    tm = os.environ.get("TORCHMONARCH_PYTHON")
    if tm:
        results["torchmonarch"] = measure(tm, TORCHMONARCH, peer_env())
    ours = results["monarch"]
    assert ours is not None, "monarch benchmark failed"
    print_headline(results, floors)
    if not args.no_kernel:
        import kernel_cell

        kernel_cell.report(kernel_cell.measure(kernel_cell.N_CELLS, before), kernel_cell.N_CELLS)
    if not args.no_tensors:
        import tensor_engine

        engine = tensor_engine.measure(before=before)
        tensor_engine.report(engine)
        print_floor_ratio(
            engine, "inspect", floors.get("rtt_one"), "raw pyzmq round trip to one fork", label="inspect "
        )
        print_floor_ratio(
            engine, "inspect", floors.get("rtt_unix_one"), "raw Unix stream socket, as our lanes", label="inspect "
        )
    if not args.no_faults:
        import faults

        faults.report(faults.measure(before))
    here = os.path.dirname(os.path.abspath(__file__))
    for skip, script in ((args.no_profiling, "profiling.py"), (args.no_simulator, "simulator.py")):
        if not skip:  # (each in its own process: they start meshes and a controller of their own)
            print(flush=True)
            subprocess.run([sys.executable, os.path.join(here, script)], check=False)
    if args.workloads:  # (minutes: real training side by side with torchrun; Slurm's part needs root)
        print(flush=True)
        subprocess.run([sys.executable, os.path.join(here, "workloads.py")], check=False)
    if args.actors:  # (minutes: the same actor programs on monarch and torchmonarch, and their floors)
        for script in ("actors.py", "spmd.py", "rdma.py"):
            print(flush=True)
            subprocess.run([sys.executable, os.path.join(here, script)], check=False)


if __name__ == "__main__":
    main()
