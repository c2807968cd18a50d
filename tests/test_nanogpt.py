"""The nanoGPT workload (examples/nanogpt, notebooks/nanogpt.ipynb): the tiny config's validation loss falls
below the bound the notebook states, trained in `%%mesh` cells and a live-function loop (with a progress bar
and a live loss curve); the tensor engine's DDP repeats the DDP run's first steps; the script trains on a
local mesh and leaves no worker behind, and runs under torchrun as plain DDP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_notebooks import _cmdline, _code_cells, _descendants, run_notebook

from conftest import REPO, pid_alive, wait_gone

sys.path.append(REPO)  # (examples/)
from examples.nanogpt import CONFIGS, GPT, get_batch, load_corpus  # noqa: E402
from examples.nanogpt.train import lr_at, train_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BOUND = 2.3
"""The validation loss (nats/char) the tiny config must fall below: the notebook states it too."""
NOTEBOOK = Path(REPO, "notebooks", "nanogpt.ipynb")


def _text(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get("text/plain", "")))
    return "\n".join(parts)


def _cell(nb, contains: str):
    found = [c for c in _code_cells(nb) if contains in c.source]
    assert len(found) == 1, f"expected one cell containing {contains!r}, got {len(found)}"
    return found[0]


# -- the pieces ----------------------------------------------------------------------------------------
def test_batches_depend_on_seed_step_and_rank_only():
    corpus = load_corpus(["macbeth"])
    a = get_batch(corpus.train, 4, 16, seed=1, step=3, rank=1)
    assert all(torch.equal(u, v) for u, v in zip(a, get_batch(corpus.train, 4, 16, seed=1, step=3, rank=1)))
    assert not torch.equal(a[0], get_batch(corpus.train, 4, 16, seed=1, step=3, rank=0)[0])
    assert not torch.equal(a[0], get_batch(corpus.train, 4, 16, seed=1, step=4, rank=1)[0])
    x, y = a
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets: one character later


def test_model_shapes_tying_and_generate():
    torch.manual_seed(0)
    config = CONFIGS["tiny"].with_vocab(65)
    model = GPT(config)
    assert model.wte.weight is model.lm_head.weight
    idx = torch.randint(65, (2, config.block_size))
    logits, loss = model(idx, torch.randint(65, (2, config.block_size)))
    assert logits.shape == (2, config.block_size, 65)
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.2  # about uniform at initialisation
    gen = model.generate(idx[:1, :5], 100, generator=torch.Generator().manual_seed(1))  # past the context too
    assert gen.shape == (1, 105) and torch.equal(gen[:, :5], idx[:1, :5])
    assert CONFIGS["small"].n_layer == 6 and CONFIGS["small"].n_embd == 384 and CONFIGS["small"].block_size == 256


def test_schedule():
    cfg = train_config("tiny")
    assert lr_at(cfg, 0) < lr_at(cfg, cfg.warmup_iters - 1) == cfg.lr
    assert lr_at(cfg, cfg.max_iters) == pytest.approx(cfg.min_lr)
    assert train_config("small").max_iters == 5000 and train_config("tiny", max_iters=7).max_iters == 7


# -- the notebook --------------------------------------------------------------------------------------
def test_notebook(tmp_path):
    t0 = time.monotonic()
    nb = run_notebook(NOTEBOOK, tmp_path, timeout=120)
    print(f"the notebook ran in {time.monotonic() - t0:.1f} s")

    assert f"BOUND = {BOUND}" in _cell(nb, "BOUND = ").source

    # 1. %%mesh cells: DDP over gloo on two ranks, 100 steps, the same mean loss returned by both.
    setup = _text(_cell(nb, "%%mesh gpu=2 --save setup"))
    for r in range(2):
        assert re.search(
            rf"rank {r}: DistributedDataParallel over (gloo|nccl) with 2 ranks on (cpu|cuda:{r})", setup
        ), setup
    first = _text(_cell(nb, "records = trainer.train(100)"))
    assert re.search(r"after 100 steps: train loss \d\.\d+, val loss \d\.\d+", first), first
    assert len(set(re.findall(r"gpu=\d\s+(\d\.\d+)", first))) == 1, first

    # 2. The controller loop: a progress bar (widget) and the curve (inline SVG in the theme's colours,
    # updated in place).
    loop = _cell(nb, "bar = widgets.IntProgress")
    kinds = [set(out.get("data", {})) for out in loop.outputs]
    assert any("application/vnd.jupyter.widget-view+json" in k for k in kinds), kinds
    curves = [out["data"]["text/html"] for out in loop.outputs if "text/html" in out.get("data", {})]
    assert curves and 'class="monarch-figure"' in curves[-1] and "currentColor" in curves[-1], kinds
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    bars = [m["state"] for m in state.values() if m.get("model_name") == "IntProgressModel"]
    assert bars and bars[-1]["value"] == bars[-1]["max"] == 300, bars
    final = re.search(r"final: step 300, train loss (\d\.\d+), val loss (\d\.\d+) \(bound (\d\.\d+)\)", _text(loop))
    assert final, _text(loop)
    train_loss, val_loss, bound = (float(g) for g in final.groups())
    print(f"final train loss {train_loss:.4f}, val loss {val_loss:.4f} (bound {bound})")
    assert bound == BOUND and val_loss < BOUND and train_loss < BOUND

    # 3. The tensor engine: the loss falls, step for step as in the DDP run.
    te = _text(_cell(nb, "TE_STEPS = 30"))
    losses = [float(v) for v in re.findall(r"tensor engine step \d+: loss (\d\.\d+)", te)]
    assert len(losses) == 6, te
    assert losses[-1] < losses[0] - 0.5 and sum(losses[3:]) < sum(losses[:3]), losses
    difference = re.search(r"largest difference from the DDP run's first 30 steps: (\S+)", te)
    assert difference, te
    if not torch.cuda.is_available():  # (on GPUs the Trainer runs in bf16, the tensor engine here in fp32)
        assert float(difference.group(1)) < 1e-3, te

    # 4. A sample of text: 300 characters after the prompt, with words in it.
    sample = _text(_cell(nb, "def sample(prompt, chars)"))
    assert sample.startswith("sample:\nROMEO:\n"), sample
    body = sample.split("ROMEO:\n", 1)[1]
    assert len(body) >= 300 and len(re.findall(r"\b(the|and|to|of|I|you|my)\b", body)) >= 3, body


# -- the script ----------------------------------------------------------------------------------------
def _run_watching(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    """Run `cmd` from the checkout; note every process under it while it runs (a mesh's workers), with its
    command line."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in _descendants(proc.pid):
            seen[pid] = _cmdline(pid) or seen.get(pid, "")  # (the latest: a worker names itself once forked)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(10)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out)), seen


def _summary(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, output
    return json.loads(lines[0].removeprefix("summary: "))


def test_script_on_a_local_mesh(tmp_path):
    cmd = [sys.executable, "-m", "examples.nanogpt.train", "--n_gpus", "2", "--config", "tiny"]
    done, seen = _run_watching([*cmd, "--json", str(tmp_path / "summary.json")], timeout=240)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout
    summary = _summary(done.stdout)
    assert summary["mode"] == "monarch" and summary["world"] == 2 and summary["steps"] == 300
    assert summary["val_loss"] < BOUND and summary["tokens_per_s"] > 0 and summary["step_ms"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["evals"][-1]["val"] == summary["val_loss"]
    assert "[gpu=0] step  300/300: loss" in done.stdout and "[gpu=1] step" not in done.stdout  # rank 0 reports
    assert "sample:\n" in done.stdout
    assert sum("monarch worker" in cmd for cmd in seen.values()) == 2, seen
    left = wait_gone(seen)
    assert left == [], {p: seen[p] for p in left if pid_alive(p)}


def test_script_under_torchrun(tmp_path):
    args = ["--config", "tiny", "--max_iters", "10", "--eval_interval", "10", "--eval_iters", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "examples.nanogpt.train"]
    env_clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=180, env=env_clean)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done.stdout)  # rank 0's only
    assert summary["mode"] == "torchrun" and summary["world"] == 2 and summary["steps"] == 10
    assert summary["tokens_per_s"] > 0 and summary["val_loss"] < 4.0
    assert "monarch" not in done.stderr.lower(), done.stderr
