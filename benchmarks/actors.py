"""Actors side by side with torchmonarch (issue 28, item 5): the same actor program on both, in the same run.

    python benchmarks/actors.py                 # or: ./run bench --actors
    TORCHMONARCH_PYTHON=/work/.venvs/torchmonarch/bin/python python benchmarks/actors.py

torchmonarch (Meta's Monarch, PyPI `torchmonarch==0.7.0`) lives in a venv of its own, its import name being
`monarch` too; without TORCHMONARCH_PYTHON it is skipped (said so). Both sides run the same script
(`from monarch.actor import Actor, endpoint, this_host`), 8 processes, each in a fresh process, in the order
monarch, torchmonarch, torchmonarch, monarch; each figure is the mean of its two runs (`run.abba`):

- spawn of 8 actors to the first answer: spawn_procs + spawn + the first call().get() (the library imported
  before); then a second mesh's, in the same process;
- call() to the 8 actors, round trip, and call_one() to one of them: medians of ROUND_TRIPS after warm-up;
- an actor's call_one() to an actor of another process (an actor mesh passed to its constructor), timed
  inside the calling actor: median of ROUND_TRIPS;
- broadcast(): BROADCASTS issued without replies, then one call().get() that checks every actor ran them all
  (messages from one sender run in order): issued per second, and per second until that answer (median of 3);
- the floor, in the same run, before and after the actors (mean): a raw pyzmq round trip between one process
  and 8 forked processes over IPC (a ROUTER bound by the parent, a DEALER in each child; one small message to
  each, each echoes it: `rtt_router` in benchmarks/floor.py), median. Our call() is reported as a ratio to it
  (issue 28's target: 1.5x at most).

Ratios: how much better monarch is (torchmonarch's time / monarch's, monarch's rate / torchmonarch's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import floor  # benchmarks/floor.py: the raw pyzmq echo, the floor
from run import ROUND_TRIPS, N, abba, header, measure, peer_env, print_rows  # benchmarks/run.py, next to this file

BROADCASTS = 5000
PORT_SENDS = 2000
"""Messages one actor sends a port in a row (to the script, then to an actor of another process)."""
RL_STEPS = 40
"""Steps of the RL loop (`examples/grpo/loop.py`) timed on each side."""
BROADCAST_TARGET = 50_000
"""Broadcasts issued per second, issue 28's target."""
FLOOR_TARGET = 1.5
"""Our call() to 8 actors at most this many times the raw pyzmq round trip (issue 28)."""

CLASSES = textwrap.dedent(
    """
    class Noop(Actor):
        def __init__(self):
            self.n = 0

        @endpoint
        def noop(self):
            return None

        @endpoint
        def count(self):
            self.n += 1

        @endpoint
        def seen(self):
            return self.n

        @endpoint
        def blast(self, port, n):  # n messages to a port, fire and forget
            for i in range(n):
                port.send(i)


    class Sink(Actor):  # the receiving end of a channel, in another process
        def __init__(self):
            self.port, self.receiver = Channel.open()

        @endpoint
        def where(self):
            return self.port

        @endpoint
        def drain(self, n):
            for _ in range(n):
                self.receiver.recv().get()
            return n


    class Caller(Actor):  # holds a reference to the Noop actors (its constructor's argument), times calls to TARGET
        def __init__(self, others):
            self.other = others.slice(**TARGET)

        @endpoint
        def ping(self, n):
            for _ in range(50):
                self.other.noop.call_one().get()
            ts = []
            for _ in range(n):
                t0 = time.perf_counter(); self.other.noop.call_one().get(); ts.append(time.perf_counter() - t0)
            return statistics.median(ts)


    def round_trips(f):
        for _ in range(50):
            f()
        ts = []
        cpu = time.process_time()
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        return statistics.median(ts), (time.process_time() - cpu) / ROUND_TRIPS


    """
)
"""The actors both scripts use: `Noop`, and `Caller`, which times `call_one()`s to `TARGET` of the Noop actors
it was given (each script sets `TARGET`); `round_trips(f)`: median and CPU per call of `f`."""

ACTORS = (
    textwrap.dedent(
        """
    import json, statistics, time
    t0 = time.perf_counter()
    from monarch.actor import Actor, endpoint, this_host
    imported = time.perf_counter() - t0
    from monarch.actor import Channel
    """
    )
    + CLASSES
    + textwrap.dedent(
        """
    def spawn():
        t0 = time.perf_counter()
        procs = this_host().spawn_procs(PER_HOST)
        actors = procs.spawn("noop", Noop)
        actors.noop.call().get()
        return procs, actors, time.perf_counter() - t0


    procs, actors, first = spawn()
    procs2, _, second = spawn()
    STOP(procs2)

    call, call_cpu = round_trips(lambda: actors.noop.call().get())
    one = actors.slice(**{DIM: 0})
    call_one, _ = round_trips(lambda: one.noop.call_one().get())
    callers = procs.spawn("callers", Caller, actors)
    a2a = callers.slice(**{DIM: 0}).ping.call_one(ROUND_TRIPS).get()

    issued, total, expected = [], [], 0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(BROADCASTS):
            actors.count.broadcast()
        t1 = time.perf_counter()
        seen = list(actors.seen.call().get().values())
        t2 = time.perf_counter()
        expected += BROADCASTS
        assert seen == [expected] * N, f"broadcasts lost: actors saw {seen}, {expected} sent"
        issued.append(BROADCASTS / (t1 - t0))
        total.append(BROADCASTS / (t2 - t0))
    port, receiver = Channel.open()  # an actor's port sends to the script
    to_client = []
    for _ in range(3):
        t0 = time.perf_counter()
        one.blast.call_one(port, PORT_SENDS).get()
        for _ in range(PORT_SENDS):
            receiver.recv().get()
        to_client.append(PORT_SENDS / (time.perf_counter() - t0))
    sinks = procs2b = this_host().spawn_procs(ONE)
    sink = procs2b.spawn("sink", Sink)
    sink_port = sink.where.call_one().get()
    a2a_ports = []
    for _ in range(3):
        t0 = time.perf_counter()
        draining = sink.drain.call_one(PORT_SENDS)
        one.blast.call_one(sink_port, PORT_SENDS).get()
        draining.get()
        a2a_ports.append(PORT_SENDS / (time.perf_counter() - t0))
    STOP(procs2b)
    out = {
        "import": imported, "first": first, "second": second, "call": call, "call_cpu": call_cpu,
        "call_one": call_one, "a2a": a2a, "issued": statistics.median(issued), "total": statistics.median(total),
        "port_to_client": statistics.median(to_client), "port_a2a": statistics.median(a2a_ports),
    }
    print(json.dumps(out), flush=True)
    STOP(procs)
    """
    )
)

OURS = 'PER_HOST = {"gpu": N}\nONE = {"gpu": 1}\nDIM = "gpu"\nTARGET = {"gpu": 1}\nSTOP = lambda p: p.exit()\n'
THEIRS = (
    'PER_HOST = {"gpus": N}\nONE = {"gpus": 1}\nDIM = "gpus"\nTARGET = {"gpus": 1}\nSTOP = lambda p: p.stop().get()\n'
)

HOSTS = (
    textwrap.dedent(
        """
    import json, statistics, time
    import monarch.notebook
    from monarch.actor import Actor, endpoint
    TARGET = {"host": 1, "gpu": 0}
    """
    )
    + CLASSES
    + textwrap.dedent(
        """
    job = monarch.notebook.reserve(2, name="bench-actors", timeout=120)
    try:
        procs = job.spawn_procs({"gpu": N // 2})
        actors = procs.spawn("noop", Noop)
        call, _ = round_trips(lambda: actors.noop.call().get())
        one = actors.slice(host=1, gpu=0)
        call_one, _ = round_trips(lambda: one.noop.call_one().get())
        a2a = procs.spawn("callers", Caller, actors).slice(host=0, gpu=0).ping.call_one(ROUND_TRIPS).get()
        t0 = time.perf_counter()
        for _ in range(BROADCASTS):
            actors.count.broadcast()
        t1 = time.perf_counter()
        assert actors.seen.call().get().values() == [BROADCASTS] * N
        t2 = time.perf_counter()
        procs.exit()
    finally:
        monarch.notebook.cleanup("bench-actors")
    print(json.dumps({"call": call, "call_one": call_one, "a2a": a2a, "issued": BROADCASTS / (t1 - t0),
                      "total": BROADCASTS / (t2 - t0)}))
    """
    )
)


def hosts() -> dict | str:
    """Our actors on 2 fake Slurm hosts x N/2 (tests/helpers/slurm_cluster.py; needs root and Slurm's packages):
    the figures, or why they were not measured. torchmonarch is not run there (its hosts would need its own
    agents started through Slurm)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from helpers.slurm_cluster import Cluster, missing

    why = missing()
    if why is not None:
        return why
    cluster = Cluster(hosts=2)
    cluster.start()
    try:
        with tempfile.TemporaryDirectory() as jobs:
            env = dict(os.environ, SLURM_CONF=str(cluster.conf), MONARCH_JOBS_DIR=jobs)
            got = measure(sys.executable, f"BROADCASTS = {BROADCASTS}\n" + HOSTS, env)
    finally:
        cluster.stop()
    return got if got is not None else "the run failed (above)"


def side(python: str, prelude: str, env: dict | None = None) -> dict | None:
    return measure(python, f"BROADCASTS = {BROADCASTS}\nPORT_SENDS = {PORT_SENDS}\n{prelude}" + ACTORS, env)


RL = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, EXAMPLES_PARENT)
    from examples.grpo.loop import train
    got = asyncio.run(train(RL_STEPS, log=False))
    print(json.dumps({"rl_step": got["step_ms"] / 1e3, "rl_start": got["start_s"], "rl_reward": got["final_reward"]}))
    """
)


def rl_side(python: str, env: dict | None = None) -> dict | None:
    """The RL loop of `examples/grpo/loop.py` (written against Monarch's API only), run from a folder holding
    nothing but a link to `examples/` (the checkout's own `monarch/` folder must not shadow either package)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.join(repo, "examples"), os.path.join(d, "examples"))
        return measure(python, f"EXAMPLES_PARENT = {d!r}\nRL_STEPS = {RL_STEPS}\n" + RL, env, cwd=d)


def run_all() -> dict:
    floor1 = floor.rtt_router()
    tm = os.environ.get("TORCHMONARCH_PYTHON")
    if tm:
        ours, theirs = abba(lambda: side(sys.executable, OURS), lambda: side(tm, THEIRS, peer_env()))
        rl_ours, rl_theirs = abba(lambda: rl_side(sys.executable), lambda: rl_side(tm, peer_env()))
    else:
        ours, theirs = side(sys.executable, OURS), None
        rl_ours, rl_theirs = rl_side(sys.executable), None
    if ours is not None and rl_ours is not None:
        ours.update(rl_ours)
    if theirs is not None and rl_theirs is not None:
        theirs.update(rl_theirs)
    floor2 = floor.rtt_router()
    floors = [f for f in (floor1, floor2) if f is not None]
    results = {"monarch": ours, "torchmonarch": theirs, "floor": sum(floors) / len(floors) if floors else None}
    results["hosts"] = hosts()
    if tm:
        results["torchmonarch_version"] = _version(tm)
    return results


def _version(python: str) -> str:
    r = subprocess.run([python, "-m", "pip", "show", "torchmonarch"], capture_output=True, text=True, check=False)
    return next((ln.split(":", 1)[1].strip() for ln in r.stdout.splitlines() if ln.startswith("Version:")), "?")


def report(results: dict) -> None:
    ours, theirs, floor = results["monarch"], results["torchmonarch"], results["floor"]
    if ours is None:
        print("actors: monarch's side failed (above)")
        return
    if "torchmonarch_version" in results:
        print(f"torchmonarch {results['torchmonarch_version']} ({os.environ['TORCHMONARCH_PYTHON']})")
        if theirs is None:
            print("torchmonarch: failed (above); monarch alone")
    else:
        print("torchmonarch: skipped (set TORCHMONARCH_PYTHON to the python of a venv with torchmonarch installed)")
    peers = {"monarch": ours} | ({"torchmonarch": theirs} if theirs else {})
    rows = [
        ("import of monarch.actor", "import", "s", 1),
        (f"spawn of {N} actors to the first answer (spawn_procs + spawn + call().get())", "first", "s", 1),
        (f"a second mesh of {N} actors, the same", "second", "s", 1),
        (f"call() to {N} actors, round trip (median of {ROUND_TRIPS})", "call", "ms", 1e3),
        ("  the caller's CPU per call() (all its threads)", "call_cpu", "ms", 1e3),
        (f"call_one() to one actor, round trip (median of {ROUND_TRIPS})", "call_one", "ms", 1e3),
        ("an actor's call_one() to an actor in another process, timed inside the caller", "a2a", "ms", 1e3),
    ]
    print_rows(peers, rows)
    for title, key in (
        (f"broadcast()s to {N} actors issued per second ({BROADCASTS} in a row)", "issued"),
        ("  and per second until one call() after them answers (all ran)", "total"),
        (f"port.send() from an actor to the script, per second until all {PORT_SENDS} received", "port_to_client"),
        ("port.send() from an actor to an actor of another process, the same", "port_a2a"),
    ):
        if key not in ours:
            continue
        parts = [f"monarch {ours[key]:,.0f}/s"]
        if theirs and key in theirs:
            parts.append(f"torchmonarch {theirs[key]:,.0f}/s (ratio {ours[key] / theirs[key]:.1f}x)")
        print(f"{title}: " + " | ".join(parts))
    if "rl_step" in ours:
        rl = {"monarch": ours} | ({"torchmonarch": theirs} if theirs and "rl_step" in theirs else {})
        print_rows(
            rl,
            [
                (f"RL loop (examples/grpo/loop.py, {RL_STEPS} steps): a step, median", "rl_step", "ms", 1e3),
                ("  its start: meshes and actors spawned, weights shared", "rl_start", "s", 1),
            ],
        )
        print(
            "  final reward (mean of the last 10 steps): "
            + " | ".join(f"{k} {v['rl_reward']:.3f}" for k, v in rl.items())
        )
    met = "met" if ours["issued"] >= BROADCAST_TARGET else "not met"
    print(f"  target: {BROADCAST_TARGET:,} broadcasts issued per second: {met}")
    if floor:
        parts = [f"monarch {ours['call'] / floor:.2f}x"]
        if theirs:
            parts.append(f"torchmonarch {theirs['call'] / floor:.2f}x")
        met = "met" if ours["call"] / floor <= FLOOR_TARGET else "not met"
        print(
            f"floor: raw pyzmq round trip to {N} forked processes over IPC (median, mean of 2 runs): {floor * 1e3:.3g} ms"
        )
        print(f"call() to {N} / floor: " + " | ".join(parts) + f"  (target <= {FLOOR_TARGET}x: {met})")
    else:
        print("floor: the raw pyzmq echo failed (above)")
    on_hosts = results.get("hosts")
    if isinstance(on_hosts, dict):
        print(
            f"on 2 fake Slurm hosts x {N // 2} (through the hosts' agents; monarch only), ratio to one host's figure:"
        )
        for title, key, unit, scale in (
            (f"  call() to {N} actors", "call", "ms", 1e3),
            ("  call_one() to an actor on the second host", "call_one", "ms", 1e3),
            ("  an actor's call_one() to an actor on the other host (TCP + CURVE)", "a2a", "ms", 1e3),
        ):
            print(f"{title}: {on_hosts[key] * scale:.3g} {unit} ({on_hosts[key] / ours[key]:.2f}x one host's)")
        print(
            f"  broadcast()s issued per second: {on_hosts['issued']:,.0f}/s; until all ran: {on_hosts['total']:,.0f}/s"
        )
    elif on_hosts:
        print(f"on 2 fake Slurm hosts: not measured ({on_hosts})")


def main() -> None:
    header()
    report(run_all())


if __name__ == "__main__":
    main()
