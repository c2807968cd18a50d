"""Scale-out on a real Slurm: monarch's host agents vs ipyparallel's Slurm launcher, side by side.

    sudo python benchmarks/scale_out.py [--hosts 1,2,4] [--workers 2]     # or: ./run bench --slurm
                                        [--no-peers] [--compare-bundles]

Needs root and Slurm's packages (as the scale-out tests do): it brings up tests/helpers/slurm_cluster.py's Slurm
with 4 fake hosts (network namespaces on a bridge, a slurmd each) and takes it all down again at the end.
For each host count H (W workers per host), each side in a fresh process (`--no-peers`: monarch alone;
`--compare-bundles`: monarch again with its agents sending each reply up as it came, `MONARCH_BUNDLE_WAIT_US=0`):

- monarch: `monarch.notebook.reserve(H)` (sbatch, agents up with torch preloaded), `job.spawn_procs({"gpu": W})`,
  the first no-op live function back: *reserve to first call*; then the no-op round trip (median), the
  controller's CPU per call (`time.process_time`, all its threads), the controller's CPU per tensor-engine
  op issued (a broadcast with no reply), and the bytes that reach each host per call (the host's veth
  counters) with W and 2W workers per host: equal when the controller sends one message per host.
- ipyparallel: `ipp.Cluster(engines="slurm", n=H*W)` (its SlurmEngineSetLauncher's sbatch, engines placed W
  per node) until `import torch` has run on every engine: *cluster start to ready*; then `apply_sync` no-op
  round trip (median) and the controller process's CPU per `apply_sync`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from run import header  # noqa: E402

from helpers.slurm_cluster import CONTROLLER_ADDR, Cluster, missing  # noqa: E402

ROUND_TRIPS = 300
CPU_CALLS = 300
OPS = 3000

TIME_CALLS = textwrap.dedent(
    """
    import statistics, time

    def time_calls(f):  # (median round trip, this process's CPU per call) of a no-op call, after a warm-up
        for _ in range(30):
            f()
        ts = []
        for _ in range(ROUND_TRIPS):
            t1 = time.perf_counter(); f(); ts.append(time.perf_counter() - t1)
        c0 = time.process_time()
        for _ in range(CPU_CALLS):
            f()
        return statistics.median(ts), (time.process_time() - c0) / CPU_CALLS
    """
)

MONARCH = textwrap.dedent(
    """
    import json, statistics, time
    import torch
    import monarch, monarch.notebook

    def tx(hosts):  # bytes sent toward each fake host so far (its veth on this machine's side)
        out = []
        for i in range(1, hosts + 1):
            with open(f"/sys/class/net/mnv{i}/statistics/tx_bytes") as f:
                out.append(int(f.read()))
        return out

    @monarch.remote
    def noop():
        return None

    def bytes_per_call(f):  # bytes toward each host per live call
        b0 = tx(H)
        for _ in range(CPU_CALLS):
            f()
        return [(b - a) / CPU_CALLS for a, b in zip(b0, tx(H))]

    def op_bytes(mesh):  # bytes toward each host per tensor-engine op (a broadcast, no reply)
        with mesh.activate():
            x = torch.zeros(4)
            for _ in range(100):
                x = x + 1
        monarch.inspect(x)
        b0 = tx(H)
        with mesh.activate():
            for _ in range(OPS):
                x = x + 1
        monarch.inspect(x)
        return statistics.mean((b - a) / OPS for a, b in zip(b0, tx(H)))

    t0 = time.perf_counter()
    job = monarch.notebook.reserve(H, name=f"bench{H}")
    reserved = time.perf_counter() - t0
    try:
        mesh = job.spawn_procs({"gpu": W})
        spawned = time.perf_counter() - t0
        f = noop.on(mesh)
        f()
        first = time.perf_counter() - t0
        rtt, cpu_call = time_calls(f)
        with mesh.activate():
            x = torch.zeros(4)
            for _ in range(200):
                x = x + 1
            c0 = time.process_time()
            for _ in range(OPS):
                x = x + 1
            cpu_op = (time.process_time() - c0) / OPS
        assert torch.equal(monarch.inspect(x), torch.full((4,), float(OPS + 200)))
        per_host = bytes_per_call(f)
        op1 = op_bytes(mesh)
        mesh.exit()
        mesh2 = job.spawn_procs({"gpu": 2 * W})
        f2 = noop.on(mesh2)
        for _ in range(30):
            f2()
        per_host2 = bytes_per_call(f2)
        op2 = op_bytes(mesh2)
        mesh2.exit()
    finally:
        monarch.notebook.cleanup(f"bench{H}")
    print(json.dumps({"reserved": reserved, "spawned": spawned, "first": first, "rtt": rtt,
                      "cpu_call": cpu_call, "cpu_op": cpu_op, "bytes_per_host": statistics.mean(per_host),
                      "bytes_per_host_2w": statistics.mean(per_host2), "op_bytes": op1, "op_bytes_2w": op2}))
    """
)

LOCAL = textwrap.dedent(
    """
    import json, time
    import monarch
    from monarch.actor import this_host

    @monarch.remote
    def noop():
        return None

    mesh = this_host().spawn_procs({"gpu": H * W})
    f = noop.on(mesh)
    rtt, cpu_call = time_calls(f)
    mesh.exit()
    print(json.dumps({"rtt": rtt, "cpu_call": cpu_call}))
    """
)

IPYPARALLEL = textwrap.dedent(
    """
    import json, logging, statistics, time
    logging.disable(logging.WARNING)
    import ipyparallel as ipp
    from traitlets.config import Config

    t0 = time.perf_counter()

    cfg = Config()
    # W engines on each of H nodes (its default script asks for --ntasks=n, which Slurm may pack on one node)
    cfg.SlurmEngineSetLauncher.batch_template = (
        "#!/bin/sh\\n#SBATCH --export=ALL\\n#SBATCH --job-name=ipengine-{cluster_id}\\n"
        f"#SBATCH --nodes={H}\\n#SBATCH --ntasks-per-node={W}\\nsrun {{program_and_args}}\\n"
    )
    cluster = ipp.Cluster(engines="slurm", n=H * W, controller_ip=ADDR, config=cfg, log_level=logging.ERROR)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(H * W, timeout=300)
        dv = rc[:]
        dv.execute("import torch", block=True)
        hosts = len(set(dv.apply_sync(__import__("socket").gethostname)))

        def noop():
            return None

        dv.apply_sync(noop)
        ready = time.perf_counter() - t0
        for _ in range(20):
            dv.apply_sync(noop)
        ts = []
        for _ in range(ROUND_TRIPS // 3):
            t1 = time.perf_counter(); dv.apply_sync(noop); ts.append(time.perf_counter() - t1)
        c0 = time.process_time()
        for _ in range(CPU_CALLS // 3):
            dv.apply_sync(noop)
        cpu_call = (time.process_time() - c0) / (CPU_CALLS // 3)
    finally:
        rc.close()
        cluster.stop_cluster_sync()
    print(json.dumps({"first": ready, "rtt": statistics.median(ts), "cpu_call": cpu_call, "hosts": hosts}))
    """
)


def measure(code: str, hosts: int, workers: int, env: dict) -> dict | None:
    src = (
        f"H = {hosts}\nW = {workers}\nROUND_TRIPS = {ROUND_TRIPS}\nCPU_CALLS = {CPU_CALLS}\nOPS = {OPS}\n"
        f"ADDR = {CONTROLLER_ADDR!r}\n" + TIME_CALLS + code
    )
    r = subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=900, env=env, cwd=tempfile.gettempdir()
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        print(f"  (failed: {r.stderr.strip()[-1500:] if r.stderr else r.returncode})")
        return None
    return json.loads(lines[-1])


def report(hosts: int, workers: int, ours: dict | None, local: dict | None, ipp: dict | None) -> None:
    n = hosts * workers
    print(f"{hosts} host(s) x {workers} workers ({n} ranks):")
    if ours:
        print(
            f"  monarch: reserve to first call {ours['first']:.2f} s (reserve {ours['reserved']:.2f} s, "
            f"spawn {ours['spawned'] - ours['reserved']:.2f} s, first call "
            f"{(ours['first'] - ours['spawned']) * 1e3:.0f} ms); no-op round trip {ours['rtt'] * 1e3:.2f} ms; "
            f"controller CPU {ours['cpu_call'] * 1e6:.0f} us per call, {ours['cpu_op'] * 1e6:.1f} us per op issued; "
            f"bytes toward each host per call {ours['bytes_per_host']:.0f} with {workers} workers per host, "
            f"{ours['bytes_per_host_2w']:.0f} with {2 * workers}; per op issued {ours['op_bytes']:.0f} and "
            f"{ours['op_bytes_2w']:.0f}"
        )
    if local:
        print(
            f"  monarch, the same {n} ranks on this machine (no agents): round trip {local['rtt'] * 1e3:.2f} ms; "
            f"controller CPU {local['cpu_call'] * 1e6:.0f} us per call"
        )
    if ipp:
        print(
            f"  ipyparallel (Slurm launcher, engines on {ipp['hosts']} host(s)): cluster start to ready "
            f"{ipp['first']:.2f} s; apply_sync round trip {ipp['rtt'] * 1e3:.2f} ms; controller CPU "
            f"{ipp['cpu_call'] * 1e6:.0f} us per call"
        )
    if ours and ipp:
        print(
            f"  ratio ipyparallel / monarch: start {ipp['first'] / ours['first']:.1f}x, round trip "
            f"{ipp['rtt'] / ours['rtt']:.1f}x, controller CPU per call {ipp['cpu_call'] / ours['cpu_call']:.1f}x"
        )


def main() -> None:
    why = missing()
    if why:
        sys.exit(f"scale_out: cannot run: {why}")
    args = sys.argv[1:]
    counts = [int(h) for h in (args[args.index("--hosts") + 1] if "--hosts" in args else "1,2,4").split(",")]
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 2
    header()
    cluster = Cluster(hosts=max(counts), cpus=4 * workers)
    t0 = time.perf_counter()
    cluster.start()
    print(f"Slurm up with {cluster.hosts} fake hosts in {time.perf_counter() - t0:.1f} s")
    jobs = tempfile.mkdtemp(prefix="monarch-bench-jobs-")
    ipdir = tempfile.mkdtemp(prefix="monarch-bench-ipython-")
    env = dict(os.environ, SLURM_CONF=str(cluster.conf), MONARCH_JOBS_DIR=jobs, IPYTHONDIR=ipdir)
    try:
        peers, compare = "--no-peers" not in args, "--compare-bundles" in args
        for hosts in counts:
            ours = measure(MONARCH, hosts, workers, env)
            local = measure(LOCAL, hosts, workers, env) if peers else None
            ipp = measure(IPYPARALLEL, hosts, workers, env) if peers else None
            report(hosts, workers, ours, local, ipp)
            apart = measure(MONARCH, hosts, workers, dict(env, MONARCH_BUNDLE_WAIT_US="0")) if compare else None
            if apart:
                print(
                    f"  monarch, one message per rank (no bundles): no-op round trip {apart['rtt'] * 1e3:.2f} ms; "
                    f"controller CPU {apart['cpu_call'] * 1e6:.0f} us per call; reserve to first call "
                    f"{apart['first']:.2f} s"
                )
    finally:
        cluster.stop()
        subprocess.run(["rm", "-rf", jobs, ipdir], check=False)


if __name__ == "__main__":
    main()
