"""Real training, side by side in one run: the Llama FSDP step through a Slurm job reserved by monarch against the
same training under `srun torchrun` (examples/llama/train.sbatch) on the same fake hosts; checkpoint save and
load; a profiled step against an unprofiled one; and nanoGPT through monarch against torchrun.

    sudo python benchmarks/workloads.py [--steps 30]          # or: ./run bench --workloads

The Llama part needs root and Slurm's packages (as the scale-out tests: tests/helpers/slurm_cluster.py's Slurm
with 2 fake hosts, 2 processes each); without them it says so and measures nanoGPT alone. Each side runs in a
fresh process, in the order monarch, torchrun, torchrun, monarch, and each figure is the mean of its two runs.
Per step: the mean over the steps after the first three (warm-up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from run import abba, header  # noqa: E402

from helpers.slurm_cluster import Cluster, missing  # noqa: E402

STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 30
WARMUP = 3

LLAMA_MONARCH = textwrap.dedent(
    """
    import json, statistics, sys, time
    sys.path.append(REPO)
    import monarch, monarch.notebook
    from monarch.profiler import Schedule, profile
    from examples.llama import trainer

    setup, train_steps = monarch.remote(trainer.setup), monarch.remote(trainer.train_steps)

    @monarch.remote
    def checkpoint_seconds():
        t = trainer._trainer
        t0 = time.perf_counter(); t.save(); save = time.perf_counter() - t0
        t0 = time.perf_counter(); t.load_newest(); load = time.perf_counter() - t0
        return save, load

    job = monarch.notebook.reserve(2, 2, name="bench-llama")
    mesh = job.spawn_procs({"gpu": 2})
    try:
        setup.on(mesh)(trainer.TrainConfig(ckpt_dir=CKPT, checkpoint_interval=10**9))
        train_steps.on(mesh)(WARMUP)
        walls, inside = [], []
        for _ in range(STEPS - WARMUP):
            t0 = time.perf_counter()
            [(_, _, secs)] = train_steps.on(mesh)(1).item(host=0, gpu=0)
            walls.append(time.perf_counter() - t0)
            inside.append(secs)
        profiled = []
        with profile(mesh=mesh, schedule=Schedule(wait=0, warmup=1, active=STEPS), on_trace_ready=TRACES) as prof:
            for _ in range(STEPS - WARMUP + 1):
                t0 = time.perf_counter()
                train_steps.on(mesh)(1)
                profiled.append(time.perf_counter() - t0)
                prof.step()
        save, load = checkpoint_seconds.on(mesh)().item(host=0, gpu=0)
    finally:
        mesh.exit()
        monarch.notebook.cleanup("bench-llama")
    print(json.dumps({"step": statistics.mean(walls), "step_inside": statistics.mean(inside),
                      "step_profiled": statistics.mean(profiled[1:]), "save": save, "load": load}))
    """
)


def llama_monarch(cluster: Cluster, env: dict) -> dict | None:
    with tempfile.TemporaryDirectory() as d:
        code = (
            f"REPO, STEPS, WARMUP = {REPO!r}, {STEPS}, {WARMUP}\nCKPT, TRACES = {d + '/ckpt'!r}, {d + '/traces'!r}\n"
            + LLAMA_MONARCH
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        print(f"monarch (Llama) failed:\n{out.stderr[-3000:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_torchrun(cluster: Cluster, env: dict) -> dict | None:
    """examples/llama/train.sbatch as a user would submit it, unprofiled, no checkpoints."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(env, PYTHON=sys.executable, GPUS_PER_NODE="2", MASTER_ADDR=cluster.addrs[0], GLOO_SOCKET_IFNAME="eth0",
                   CKPT_DIR=d + "/ckpt", PROFILE_DIR=d + "/traces")  # fmt: skip
        args = [f"--steps={STEPS}", "--no-use_profiler", "--checkpoint_interval=1000000000", "--report_interval=1"]
        sub = subprocess.run(
            ["sbatch", "--parsable", f"--output={d}/out", "examples/llama/train.sbatch", *args],
            capture_output=True, text=True, cwd=REPO, env=env, check=True,
        )  # fmt: skip
        job_id = sub.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 300
        while True:
            st = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env).stdout
            if not st.strip():
                break
            if time.monotonic() > deadline:  # (its steps are in the log already: a hang at exit costs no figure)
                subprocess.run(["scancel", job_id], env=env, check=False)
                break
            time.sleep(0.5)
        log = open(f"{d}/out").read()
    steps = [float(ms) / 1e3 for ms in re.findall(r"^step \d+ loss \S+ \(([\d.]+) ms", log, re.M)]
    if len(steps) != STEPS:
        print(f"torchrun (Llama) failed:\n{log[-3000:]}")
        return None
    steady = steps[WARMUP:]
    return {"step": sum(steady) / len(steady), "step_inside": sum(steady) / len(steady)}


def llama() -> None:
    why = missing()
    if why is not None:
        print(f"Llama FSDP on Slurm: skipped ({why})")
        return
    cluster = Cluster(hosts=2)
    cluster.start()
    try:
        with tempfile.TemporaryDirectory() as jobs:
            env = dict(os.environ, SLURM_CONF=str(cluster.conf), MONARCH_JOBS_DIR=jobs)
            ours, theirs = abba(lambda: llama_monarch(cluster, env), lambda: llama_torchrun(cluster, env))
    finally:
        cluster.stop()
    print(
        f"Llama tiny, FSDP2 over 2 fake hosts x 2 processes (gloo), {STEPS} steps, mean of steps {WARMUP + 1}-{STEPS}:"
    )
    if ours is None or theirs is None:
        return
    print(f"  step, driven from the controller (one live call per step): monarch {ours['step'] * 1e3:.1f} ms | "
          f"srun torchrun {theirs['step'] * 1e3:.1f} ms (ratio {theirs['step'] / ours['step']:.2f}x)")  # fmt: skip
    print(f"  step, timed inside the worker: monarch {ours['step_inside'] * 1e3:.1f} ms | "
          f"srun torchrun {theirs['step_inside'] * 1e3:.1f} ms (ratio {theirs['step_inside'] / ours['step_inside']:.2f}x)")  # fmt: skip
    print(f"  profiled step (torch's profiler on every rank): {ours['step_profiled'] * 1e3:.1f} ms, "
          f"unprofiled {ours['step'] * 1e3:.1f} ms (ratio {ours['step'] / ours['step_profiled']:.2f}x)")  # fmt: skip
    print(f"  checkpoint (torch.distributed.checkpoint, model + AdamW): save {ours['save'] * 1e3:.1f} ms, "
          f"load {ours['load'] * 1e3:.1f} ms")  # fmt: skip


NANOGPT_STEPS = 60

NANOGPT_CELL = """%%mesh gpu=2
import json, sys
sys.path.append({repo!r})
from examples.nanogpt import train as nanogpt
trainer = nanogpt.start(nanogpt.train_config("tiny", max_iters={steps}))
trainer.train({steps}, log=False)
if rank == 0:
    print("SUMMARY " + json.dumps(trainer.summary()))
"""


def nanogpt_mesh() -> dict | None:
    """The tiny config's steps in a `%%mesh gpu=2` cell of a real kernel (its rank 0's figures)."""
    from helpers.kernel_client import monarch_kernel

    with monarch_kernel() as k:
        r = k.run(NANOGPT_CELL.format(repo=REPO, steps=NANOGPT_STEPS), timeout=600)
        text = r.text()
        k.run("%mesh shutdown")
    m = re.search(r"SUMMARY (\{.*\})", text)
    if r.status != "ok" or m is None:
        print(f"nanoGPT through %%mesh failed:\n{text[-3000:]}")
        return None
    return json.loads(m.group(1))


def nanogpt_torchrun() -> dict | None:
    """The same under `torchrun --nproc_per_node 2 -m examples.nanogpt.train`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "examples.nanogpt.train",
           "--config", "tiny", f"--max_iters={NANOGPT_STEPS}", f"--eval_interval={NANOGPT_STEPS}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    m = re.search(r"^summary: (\{.*\})", out.stdout, re.M)
    if out.returncode != 0 or m is None:
        print(f"nanoGPT under torchrun failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        return None
    return json.loads(m.group(1))


def nanogpt() -> None:
    ours, theirs = abba(nanogpt_mesh, nanogpt_torchrun)
    print(f"nanoGPT tiny, DDP over 2 CPU processes (gloo), {NANOGPT_STEPS} steps, median step after the first 5:")
    if ours is None or theirs is None:
        return
    print(f"  step: %%mesh gpu=2 {ours['step_ms']:.1f} ms | torchrun {theirs['step_ms']:.1f} ms "
          f"(ratio {theirs['step_ms'] / ours['step_ms']:.2f}x)")  # fmt: skip
    print(f"  tokens/s: %%mesh gpu=2 {ours['tokens_per_s']:,.0f} | torchrun {theirs['tokens_per_s']:,.0f} "
          f"(ratio {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x)")  # fmt: skip


def main() -> None:
    header()
    if "--no-nanogpt" not in sys.argv:
        nanogpt()
    if "--no-llama" not in sys.argv:
        llama()


if __name__ == "__main__":
    main()
