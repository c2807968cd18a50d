"""The simulator checked against reality: the tutorial's DDP step (its three variants) and a small
transformer's training step, simulated with this machine's calibrated CPU profile and measured on a real
CPU mesh of the same shape, side by side in one run.

Reported per program: step time (median over measured steps after two warm-up steps, and over rounds that
alternate the two sides, each ended by fetching a value, as a notebook does; each round's error too, which
shows how much of the error is the machine changing speed between rounds; a round's real steps are measured
half before its calibration and half after, and a round where the two halves differ by more than `MOVED` is
named: the machine changed speed while it calibrated), peak memory above the step's
start (real: `monarch.memory`'s CPU recording; simulated: the model's allocations), and the overlap of
communication with compute (real: `monarch.profiler`'s summary of one profiled step; simulated: the
simulator's summary). The error is (simulated - measured) / measured.

    python benchmarks/simulator.py [--workers 4] [--steps 20] [--rounds 7] [--profile PATH] [--only NAME]
                                   [--json PATH]
    python benchmarks/simulator.py --device cuda    # on a GPU machine: one worker per GPU, a GPU profile

With `--device cuda` the models and data live on the GPUs, the profile is the GPUs' own (calibrated, and
the datasheet's `h100` beside it), and a larger transformer is added, whose step is bound by its matmuls
rather than by launching kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

import monarch
from monarch.actor import this_host
from monarch.runtime.simulator.simulator import Simulator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.tutorial_ddp import Net, make_train  # noqa: E402  (the tutorial's, shared with tests/test_simulator.py)


class Block(nn.Module):
    """A pre-norm transformer block, attention written out (so its FLOPs are matmuls)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    def __init__(self, vocab=256, d=128, layers=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input, target):
        logits = self.head(self.blocks(self.emb(input)))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


def programs(comms, device: str = "cpu") -> dict:
    """name -> (model class, train, data); the DDP variants are the tutorial's, `comms` their side stream."""

    def ddp_data():
        return torch.rand(3, 4, device=device), torch.full((3,), 1, dtype=torch.int64, device=device)

    def tokens(batch: int, seq: int, vocab: int = 256):
        return lambda: tuple(torch.randint(0, vocab, (batch, seq), device=device) for _ in range(2))

    def on_device(cls, **kw):
        return lambda: cls(**kw).to(device)

    out = {
        "DDP variant 1 (one stream)": (on_device(Net), make_train(1, comms), ddp_data),
        "DDP variant 2 (drop at once)": (on_device(Net), make_train(2, comms), ddp_data),
        "DDP variant 3 (drop late)": (on_device(Net), make_train(3, comms), ddp_data),
        "transformer, 2 blocks d=128 (variant 3)": (on_device(Tiny), make_train(3, comms), tokens(8, 64)),
    }
    if device != "cpu":
        out["transformer, 4 blocks d=1024 (variant 3)"] = (
            on_device(Tiny, vocab=8192, d=1024, layers=4, heads=16),
            make_train(3, comms),
            tokens(16, 512, 8192),
        )
    return out


def steps(mesh, make, train, data, n: int, clock, between=None) -> tuple[list[float], object]:
    """Step times (each ended by fetching the loss), by `clock`."""
    with mesh.activate():
        torch.manual_seed(0)
        model = make()
    times = []
    for i in range(n):
        if between is not None:
            between(i)
        t = clock()
        with mesh.activate():
            loss = train(model, *data())
        monarch.inspect(loss)
        times.append(clock() - t)
    return times, model


def _allocated(size: int, cuda: bool) -> int:
    """What an allocation of `size` bytes takes: CUDA's caching allocator rounds it up to 512 bytes (its
    snapshot names the size asked for), the CPU allocator takes what was asked."""
    return -(-size // 512) * 512 if cuda else size


def real_times(mesh, make, train, data, n: int) -> list[float]:
    """Seconds per real step, after two warm-up steps."""
    return steps(mesh, make, train, data, n, time.perf_counter)[0][2:]


def real_side(mesh, make, train, data, n: int, cuda: bool = False, before: list[float] | None = None) -> dict:
    """The real step (its time with `before`'s, steps measured before this round's calibration), its peak
    memory and overlap; `moved`: how far the step's median moved from `before`'s to this one's."""
    times, model = steps(mesh, make, train, data, n, time.perf_counter)
    # peak memory above the step's start, from monarch.memory's recording of one step
    with tempfile.TemporaryDirectory() as d:
        gc.collect()  # (what earlier steps dropped is freed before the window, as `Simulator.reset()` does)
        monarch.memory.record_memory_history(mesh=mesh)
        with mesh.activate():
            loss = train(model, *data())
        monarch.inspect(loss)
        monarch.memory.dump_memory_snapshot(d, mesh=mesh)
        monarch.memory.record_memory_history(None, mesh=mesh)
        peaks = []
        for f in sorted(os.listdir(d)):
            with open(os.path.join(d, f), "rb") as fh:
                snap = pickle.load(fh)
            level = peak = 0
            for ev in (ev for trace in snap["device_traces"] for ev in trace):
                size = _allocated(ev["size"], cuda)
                level += size if ev["action"] == "alloc" else -size if ev["action"] == "free_completed" else 0
                peak = max(peak, level)
            peaks.append(peak)
    # overlap, from monarch.profiler's summary of one profiled step
    with tempfile.TemporaryDirectory() as d:
        with mesh.activate(), monarch.profiler.profile(on_trace_ready=d, mesh=mesh, activities=["CPU"]) as prof:
            loss = train(model, *data())
            prof.step()
        monarch.inspect(loss)
        summary = prof.result.summary if prof.result is not None else None
    overlaps = [r.overlap_pct or 0.0 for r in summary.ranks] if summary is not None else []  # percent
    kept = sorted(times[2:] + (before or []))
    quart = (kept[(3 * len(kept)) // 4] - kept[len(kept) // 4]) / statistics.median(kept)
    moved = (statistics.median(times[2:]) - statistics.median(before)) / statistics.median(kept) if before else 0.0
    return {
        "step": statistics.median(kept),
        "peak": statistics.median(peaks),
        "overlap": _mean(overlaps),
        "spread": quart,  # (the real steps' interquartile range over their median: how steady the machine was)
        "moved": moved,
    }


def sim_side(profile, hosts: int, gpus: int, make, train, data, n: int) -> dict:
    sim = Simulator(hosts=hosts, gpus=gpus, device=profile)
    mesh = sim.mesh.rename(gpu="dp")
    clock = lambda: sim.time  # noqa: E731
    times, model = steps(mesh, make, train, data, n, clock)
    sim.reset()
    with mesh.activate():
        loss = train(model, *data())
    monarch.inspect(loss)
    s = sim.summary()
    peak = statistics.median(p - int(b) for p, b in zip(s.peak_bytes, sim._backend.workers.baseline))
    overlaps = [v or 0.0 for v in s.overlap().values()]
    sim.exit()
    return {"step": statistics.median(times[2:]), "peak": peak, "overlap": 100 * _mean(overlaps)}


NOISY_STEPS = 0.25
"""Real steps whose interquartile range exceeds this share of their median: the machine was not steady."""
MOVED = 0.10
"""A real step whose median after its round's calibration differs from the one before by more than this share:
the machine changed speed while it calibrated, and the profile describes neither."""


def held_steady(real: dict) -> bool:
    """Whether the machine held steady through a round's real steps: they neither spread nor moved."""
    return abs(real.get("moved", 0.0)) <= MOVED and real["spread"] <= NOISY_STEPS


def _quietly(fn, *args, **kwargs):
    """`fn`, with what it says on stderr dropped (calibrating's progress lines)."""
    with contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


def _medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7, help="measure each side this many times; report the median")
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate before each round)")
    ap.add_argument("--only", default="", help="run the programs whose name contains this")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one worker per GPU")
    ap.add_argument("--json", default=None, help="also write every round's figures (both sides) to this file")
    args = ap.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: this machine has no CUDA GPU")
        args.workers = torch.cuda.device_count()
    profile_path = args.profile or os.path.join(tempfile.mkdtemp(), "calibrated.json")
    mesh = this_host().spawn_procs({"gpu": args.workers}).rename(gpu="dp")
    what = f"{args.workers} CPU workers" if args.device == "cpu" else f"{args.workers} x {torch.cuda.get_device_name()}"
    print(f"{os.cpu_count()} cores, {what}, torch {torch.__version__}; profile "
          f"{args.profile or 'calibrated before each round (a VM speeds up and slows down within minutes)'}")  # fmt: skip
    print(f"{'program':<42}{'step ms real':>13}{'sim':>8}{'err':>8}{'err per round':>28}{'peak KiB real':>15}"
          f"{'sim':>9}{'err':>8}"
          f"{'overlap % real':>16}{'sim':>7}")  # fmt: skip
    chosen = {k: v for k, v in programs(monarch.Stream("comms"), args.device).items() if args.only in k}
    reals: dict[str, list] = {name: [] for name in chosen}
    sims: dict[str, list] = {name: [] for name in chosen}
    sheets: dict[str, list] = {name: [] for name in chosen}
    trusts: list[str] = []
    calibrations: list[dict] = []
    # rounds outside, programs inside: each round calibrates once (a VM speeds up and slows down within
    # minutes), then measures every program on both sides, alternately; the real steps are measured half
    # before the calibration and half after, so that they see the machine the calibration saw (on this VM a
    # program's median over 20 steps moves by ±10% within a minute with nothing else running)
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", file=sys.stderr, flush=True)
        before: dict[str, list[float]] = {}
        if args.profile is None:
            before = {name: real_times(mesh, *chosen[name], args.steps) for name in chosen}
            profile = _quietly(Simulator.calibrate, profile_path, workers=args.workers)
            trusts.append(profile.trust().removeprefix("; ") or "one pass")
            calibrations.append({"profile": json.loads(profile.to_json()), "at": time.time()})
        for name, (make, train, data) in chosen.items():
            reals[name].append(real_side(mesh, make, train, data, args.steps, args.device == "cuda", before.get(name)))
            sims[name].append(sim_side(profile_path, 1, args.workers, make, train, data, args.steps))
            if args.device == "cuda":  # the datasheet's H100 beside the calibration
                sheets[name].append(sim_side("h100", 1, args.workers, make, train, data, args.steps))
    rows = []
    worst: list[tuple[float, str]] = []
    steady: list[tuple[float, str, int]] = []  # (per program: its worst round where the machine held steady)
    said: list[str] = []
    for name in chosen:
        real, sim = _medians(reals[name]), _medians(sims[name])
        errors = [(s["step"] - r["step"]) / r["step"] for r, s in zip(reals[name], sims[name])]
        worst.append((max(errors, key=abs), name))
        held = [e for e, r in zip(errors, reals[name]) if held_steady(r)]
        if held:
            steady.append((max(held, key=abs), name, len(held)))
        noisy = [i + 1 for i, r in enumerate(reals[name]) if r["spread"] > NOISY_STEPS]
        if noisy:
            said.append(
                f"{name}: real steps spread by more than {100 * NOISY_STEPS:.0f}% (interquartile) in round(s) {noisy}"
            )
        moved = [f"{i + 1} ({100 * r['moved']:+.0f}%)" for i, r in enumerate(reals[name]) if abs(r["moved"]) > MOVED]
        if moved:
            said.append(
                f"{name}: the real step moved by more than {100 * MOVED:.0f}% from before the calibration to after "
                f"it in round(s) {', '.join(moved)}"
            )
        e_step = (sim["step"] - real["step"]) / real["step"]
        e_peak = (sim["peak"] - real["peak"]) / real["peak"] if real["peak"] else float("nan")
        rows.append((name, real, sim))
        per_round = "/".join(
            f"{100 * (s['step'] - r['step']) / r['step']:+.0f}" for r, s in zip(reals[name], sims[name])
        )
        print(f"{name:<42}{1000 * real['step']:>13.2f}{1000 * sim['step']:>8.2f}{100 * e_step:>7.0f}%"
              f"{per_round:>28}{real['peak'] / 1024:>15.1f}{sim['peak'] / 1024:>9.1f}{100 * e_peak:>7.0f}%"
              f"{real['overlap']:>16.1f}{sim['overlap']:>7.1f}", flush=True)  # fmt: skip
        if sheets[name]:
            sheet = _medians(sheets[name])["step"]
            print(
                f"{'  (datasheet h100)':<42}{'':>13}{1000 * sheet:>8.2f}{100 * (sheet - real['step']) / real['step']:>7.0f}%"
            )
    mesh.exit()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "real": reals, "sim": sims, "calibrations": calibrations}, f, indent=1)
    if worst:
        e, name = max(worst, key=lambda x: abs(x[0]))
        print(f"worst round: {100 * e:+.0f}% ({name}); overlap error (points): "
              + ", ".join(f"{r[2]['overlap'] - r[1]['overlap']:+.1f}" for r in rows))  # fmt: skip
    if steady:
        print("worst round where the machine held steady: "
              + ", ".join(f"{100 * e:+.0f}% ({name}, of {n})" for e, name, n in steady))  # fmt: skip
    for i, trust in enumerate(trusts):
        if "NOISY" in trust:
            said.append(f"round {i + 1}'s calibration: {trust}")
    for line in said:
        print(f"noisy: {line}")
    if len(rows) < 3 or args.workers < 2:  # (one worker has no one to overlap communication with)
        return
    real_o = [rows[i][1]["overlap"] for i in range(3)]
    sim_o = [rows[i][2]["overlap"] for i in range(3)]

    def order(o: list) -> str:  # "1 = 2 < 3": ties within 0.05 percentage points
        idx = sorted(range(3), key=lambda i: o[i])
        out = str(idx[0] + 1)
        for a, b in zip(idx, idx[1:]):
            out += (" = " if abs(o[b] - o[a]) < 0.05 else " < ") + str(b + 1)
        return out

    print(f"overlap %, variants 1-3: real {[round(x, 2) for x in real_o]} ({order(real_o)}), simulated "
          f"{[round(x, 2) for x in sim_o]} ({order(sim_o)}): {'same order' if order(real_o) == order(sim_o) else 'DIFFERENT order'}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
