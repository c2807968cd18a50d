"""SPMD script start side by side with torchmonarch and torchrun: Monarch's spmd_ddp pattern on both, in the same run.

    python benchmarks/spmd.py
    TORCHMONARCH_PYTHON=/work/.venvs/torchmonarch/bin/python python benchmarks/spmd.py

The script is a trivial one written for torchrun (gloo: `init_process_group`, one `all_reduce`,
`destroy_process_group`), on N processes. Both sides run the same controller code (`from monarch.actor import
this_host; from monarch.spmd import SPMDActor`), each in a fresh process, in the order monarch, torchmonarch,
torchmonarch, monarch after one uncounted torchmonarch run (`run.abba`); each figure is the mean of its two runs:

- script start: spawn_procs + spawn SPMDActor + get_host_port on the first point + main() of the script to its
  end, from a fresh controller (the library imported before);
- again: main() once more on the same actors (a new rendezvous, a fresh process group), median of AGAIN;
- a second mesh: the same as script start, in the same controller (our fork server is warm by then);
- torchrun: `python -m torch.distributed.run --standalone --nproc-per-node N script`, its whole wall time
  (its processes start and import torch each time), the baseline a torchrun user knows.

Ratios: how much faster monarch is (the peer's time / monarch's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

from run import abba, header, measure, peer_env, print_rows  # benchmarks/run.py, next to this file

N = 4
"""Processes per script."""
AGAIN = 7
"""main() calls again on the same actors (their median is reported): each rendezvous is torch's own, and one in a
few waits out torch's TCPStore connect backoff (about 0.4-0.65 s, on both sides) when a rank connects before
rank 0's server listens."""

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
    """
)
"""The trivial torchrun script both sides run."""

DRIVER = textwrap.dedent(
    """
    import json, statistics, time
    from monarch.actor import this_host
    from monarch.spmd import SPMDActor


    def start():
        t0 = time.perf_counter()
        procs = this_host().spawn_procs(per_host=PER_HOST)
        actors = procs.spawn("_SPMDActor", SPMDActor)
        first_values = dict.fromkeys(procs._labels, 0)
        addr, port = actors.slice(**first_values).get_host_port.call_one(None).get()
        actors.main.call(addr, port, [SCRIPT_PATH]).get()
        return procs, actors, time.perf_counter() - t0


    procs, actors, first = start()
    agains = []
    for _ in range(AGAIN):
        t0 = time.perf_counter()
        addr, port = actors.slice(**dict.fromkeys(procs._labels, 0)).get_host_port.call_one(None).get()
        actors.main.call(addr, port, [SCRIPT_PATH]).get()
        agains.append(time.perf_counter() - t0)
    again = statistics.median(agains)
    procs2, _, second = start()
    STOP(procs2)
    STOP(procs)
    print(json.dumps({"first": first, "again": again, "second": second}), flush=True)
    """
)

OURS = 'PER_HOST = {"gpus": N}\nSTOP = lambda p: p.exit()\n'
THEIRS = 'PER_HOST = {"gpus": N}\nSTOP = lambda p: p.stop().get()\n'


def side(python: str, prelude: str, script: str, env: dict | None = None) -> dict | None:
    return measure(python, f"N = {N}\nAGAIN = {AGAIN}\nSCRIPT_PATH = {script!r}\n{prelude}" + DRIVER, env)


def torchrun(script: str) -> float | None:
    """The whole wall time of torchrun running `script` on N processes (mean of 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(N), script]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=300)
        if r.returncode != 0:
            print(f"  (torchrun failed: {r.stderr.strip().splitlines()[-1:]})")
            return None
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def main() -> None:
    header()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "trivial.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        tm = os.environ.get("TORCHMONARCH_PYTHON")
        if tm:
            ours, theirs = abba(
                lambda: side(sys.executable, OURS, script), lambda: side(tm, THEIRS, script, peer_env()), warm_up=True
            )
        else:
            ours, theirs = side(sys.executable, OURS, script), None
            print("torchmonarch: skipped (set TORCHMONARCH_PYTHON to the python of a venv with torchmonarch installed)")
        baseline = torchrun(script)
    if ours is None:
        print("spmd: monarch's side failed (above)")
        return
    peers = {"monarch": ours} | ({"torchmonarch": theirs} if theirs else {})
    print_rows(
        peers,
        [
            (f"SPMD script start on {N} processes (spawn + SPMDActor + main to its end)", "first", "s", 1),
            (f"  main() again on the same actors (median of {AGAIN})", "again", "s", 1),
            ("  a second mesh, the same, in the same controller", "second", "s", 1),
        ],
    )
    if baseline is not None:
        print(
            f"torchrun --nproc-per-node {N} of the same script, its whole wall time: {baseline:.3g} s "
            f"(ratio to monarch's script start {baseline / ours['first']:.1f}x)"
        )


if __name__ == "__main__":
    main()
