"""The Llama FSDP workload (examples/llama, notebooks/llama_fsdp.ipynb) on a real Slurm with two fake hosts:
the notebook trains under the profiler, is interrupted (its job cancelled), re-reserves and resumes; the same
training as `sbatch examples/llama/train.sbatch` gives the reference an uninterrupted run reaches; a host's
agent killed mid-run is named, and the resumed run matches too. Needs root and Slurm (as tests/test_slurm.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import monarch
import monarch.notebook
from monarch.runtime.slurm import commands as slurm

from conftest import REPO, wait_for, wait_gone, worker_pids
from helpers.slurm_cluster import missing, running

sys.path.append(REPO)  # (examples/: the workers get this path too)
from examples.llama import trainer  # noqa: E402

WHY = missing()
if WHY is not None and os.environ.get("CI") and os.geteuid() == 0:
    raise RuntimeError(f"the Llama tests cannot run: {WHY}")
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(WHY is not None, reason=f"no Slurm here: {WHY}")]

STEPS = 40
TOLERANCE = 1e-5
"""Resumed and uninterrupted losses at the same step may differ by this much (CPU, fp32)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(tmp_path_factory.mktemp("slurm-jobs")) as c:
        yield c


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> dict[int, float]:
    """`sbatch examples/llama/train.sbatch`: 2 hosts x 2 processes under srun torchrun, 40 steps, profiled."""
    out = tmp_path_factory.mktemp("sbatch")
    env = dict(
        os.environ, PYTHON=sys.executable, GPUS_PER_NODE="2", MASTER_ADDR=cluster.addrs[0], GLOO_SOCKET_IFNAME="eth0",
        CKPT_DIR=str(out / "ckpt"), PROFILE_DIR=str(out / "traces"),
    )  # fmt: skip
    cmd = ["sbatch", "--parsable", f"--output={out}/slurm-%j.out", "examples/llama/train.sbatch"]
    sub = subprocess.run([*cmd, f"--losses={out}/losses.json"], capture_output=True, text=True, cwd=REPO, env=env)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 180
    while not slurm.state(job_id).terminal and time.monotonic() < deadline:
        time.sleep(0.5)
    log = (out / f"slurm-{job_id}.out").read_text()
    state = slurm.state(job_id)
    assert state.terminal and (out / "losses.json").exists(), f"{state}\n{log[-3000:]}\n{cluster.log_tail()}"
    assert "starting fresh" in log and f"step {STEPS} loss" in log, log[-3000:]
    # the profiler: a trace per rank, the merged one, and the per-rank summary on rank 0's output
    assert sorted(p.name for p in (out / "traces").iterdir()) == [
        "merged.pt.trace.json",
        *(f"rank{r}.pt.trace.json" for r in range(4)),
    ]
    assert re.search(r"^3 \(rank=3\)\s+\d", log, re.M) and ("slowest: rank" in log or "no rank stands out" in log)
    assert [p.name for p in sorted((out / "ckpt").iterdir())] == [f"step-{s:08d}" for s in range(5, STEPS + 1, 5)]
    losses = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 1.0, losses  # it learns
    print(f"sbatch: loss {losses[1]:.4f} at step 1, {losses[STEPS]:.4f} at step {STEPS}")
    return losses


def _matches(got: dict[int, float], want: dict[int, float]) -> float:
    assert got and set(got) <= set(want), (sorted(got), sorted(want))
    worst = max(abs(got[s] - want[s]) for s in got)
    assert worst <= TOLERANCE, {s: (got[s], want[s]) for s in got if abs(got[s] - want[s]) > TOLERANCE}
    return worst


def test_the_llama_notebook_trains_profiles_and_resumes_after_its_job_is_cancelled(cluster, uninterrupted, tmp_path):
    from test_notebooks import _cell, _text, run_notebook

    nb = run_notebook(Path(REPO, "notebooks", "llama_fsdp.ipynb"), tmp_path, local_workers=False, timeout=180)
    run = tmp_path / "llama-run"
    # the profiler: a trace per rank and the merged one; the timeline and the per-rank table inline
    traces = sorted(p.name for p in (run / "traces").iterdir())
    assert traces == ["merged.pt.trace.json", *(f"rank{r}.pt.trace.json" for r in range(4))]
    profiled = _cell(nb, "from monarch.profiler import")
    html = _text(profiled, "text/html")
    assert "<svg" in html and "monarch-profile" in html and "3 (host=1,gpu=1)" in html
    assert "training-progress" in html and "<polyline" in html  # the loss curve, drawn as it trained
    # the interruption: the call failed naming the cancelled job; the resume started from a checkpoint
    cut = " ".join(_text(_cell(nb, "import subprocess")).split())  # (notices are wrapped to fit an output area)
    assert "the call failed (WorkerDiedError) when the job was cancelled" in cut, cut
    assert re.search(r"monarch: rank \d \(host=\d,gpu=\d\) .* whose Slurm job \d+ was cancelled", cut), cut
    resumed = _text(_cell(nb, "job = monarch.notebook.reserve", "resumed"))
    step = int(re.search(r"resumed from \S+/step-(\d{8})", resumed).group(1))
    assert step >= 20 and step % 5 == 0, resumed
    # every step's loss, both runs' (the steps trained twice: the resumed run's), equals the uninterrupted run's
    logged = trainer.logged_losses(run / "losses.jsonl")
    assert sorted(logged) == list(range(1, STEPS + 1)) or max(logged) > STEPS
    worst = _matches({s: v for s, v in logged.items() if s <= STEPS}, uninterrupted)
    print(f"notebook: resumed at step {step}; largest difference from the uninterrupted run {worst:.1e}")
    assert "llama-fsdp" not in [j["name"] for j in monarch.notebook.list_jobs()]


def test_a_host_agent_killed_mid_run_is_named_and_the_resumed_run_matches(cluster, uninterrupted, tmp_path, capfd):
    cfg = trainer.TrainConfig(ckpt_dir=str(tmp_path / "ckpt"), checkpoint_interval=5, loss_log=str(tmp_path / "log"))
    setup, train_steps = monarch.remote(trainer.setup), monarch.remote(trainer.train_steps)
    job = monarch.notebook.reserve(2, 2, name="llama-kill")
    mesh = job.spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    setup.on(mesh)(cfg)
    running = train_steps.on(mesh).call_async(STEPS)
    wait_for(lambda: max(trainer.logged_losses(cfg.loss_log), default=0) >= 12, 120, "step 12 logged")
    agent = job.dir.agents()[1]  # host 1's (node2)
    os.kill(agent.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(monarch.WorkerDiedError) as e:
        running.result(timeout=60)
    print(f"agent killed: the call failed after {time.monotonic() - t0:.1f} s: {str(e.value).splitlines()[0]}")
    assert "node2" in str(e.value), str(e.value)
    # what the survivors' collectives raised as their peers went ("Connection reset by peer") is not shown:
    # the death is told instead
    assert "Connection reset by peer" not in capfd.readouterr().err
    mesh.exit()
    monarch.notebook.cleanup("llama-kill")
    assert wait_gone(pids + [a.pid for a in job.dir.agents()]) == []
    cut_at = max(trainer.logged_losses(cfg.loss_log))

    job = monarch.notebook.reserve(2, 2, name="llama-kill")
    mesh = job.spawn_procs({"gpu": 2})
    try:
        back = setup.on(mesh)(cfg).item(host=0, gpu=0)
        assert back["resumed_from"] is not None and back["step"] >= 10, back
        rows = train_steps.on(mesh)(STEPS - back["step"]).item(host=0, gpu=0)
    finally:
        mesh.exit()
        monarch.notebook.cleanup("llama-kill")
    assert [s for s, *_ in rows] == list(range(back["step"] + 1, STEPS + 1))
    _matches(trainer.logged_losses(cfg.loss_log), uninterrupted)  # (steps trained twice: their second loss)
    _matches({s: v for s, v, _ in rows}, uninterrupted)
    print(f"cut at step {cut_at}, resumed from step {back['step']}")
