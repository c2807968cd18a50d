"""The Llama FSDP training as a script, for `srun torchrun` under `sbatch` (see `train.sbatch`):

    torchrun --nproc_per_node 4 -m examples.llama.train --model_name tiny --steps 20 \\
        --ckpt_dir /shared/ckpt --checkpoint_interval 5 --use_profiler --profile_dir /shared/traces

It resumes from the newest checkpoint in `--ckpt_dir`, so the same command continues an interrupted run.
With `--use_profiler`, torch's profiler runs with the seed's schedule and each rank writes
`rank{N}.pt.trace.json`; rank 0 then writes `merged.pt.trace.json` and prints the per-rank summary.
From a notebook, the same training runs through monarch: notebooks/llama_fsdp.ipynb.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from .trainer import TrainConfig, Trainer

PROFILE_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3, "repeat": 1}
"""The seed's profiler schedule: skip one step, warm up two, record three, once."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m examples.llama.train", description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in ("plays", "mixed_precision"):
            continue
        default = getattr(defaults, f.name)
        ap.add_argument(f"--{f.name}", type=type(default) if default is not None else str, default=default)
    ap.add_argument("--steps", type=int, default=20, help="train until this step (counting resumed ones)")
    ap.add_argument("--report_interval", type=int, default=1, help="print the loss every this many steps")
    ap.add_argument(
        "--use_profiler", action=argparse.BooleanOptionalAction, default=False, help="profile with the seed's schedule"
    )
    ap.add_argument("--profile_dir", default="./traces", help="where the profiler's traces go")
    ap.add_argument("--losses", help="rank 0 writes {step: loss} here as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        print(
            "examples.llama.train runs under torchrun (srun torchrun under sbatch: see train.sbatch); "
            "from a notebook use notebooks/llama_fsdp.ipynb",
            file=sys.stderr,
        )
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        return _train(args)
    finally:
        # The trainer (its FSDP state holds the group) must be gone before the group: a gloo rank that exits
        # with both alive can abort ("terminate called without an active exception"), and torchrun's agents
        # then wait for each other.
        gc.collect()
        dist.destroy_process_group()


def _train(args: argparse.Namespace) -> int:
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    trainer = Trainer(cfg)
    rank = trainer.rank
    if rank == 0:
        print(f"resumed from {trainer.resumed_from}" if trainer.resumed_from else "starting fresh", flush=True)
    prof = _profiler(args.profile_dir, rank) if args.use_profiler else None
    losses, times = {}, []
    tokens = cfg.batch_size * cfg.seq_len * trainer.world
    while trainer.step_no < args.steps:
        t0 = time.perf_counter()
        loss = trainer.step()
        times.append(time.perf_counter() - t0)
        losses[trainer.step_no] = loss
        if prof is not None:
            prof.step()
        if rank == 0 and trainer.step_no % args.report_interval == 0:
            print(f"step {trainer.step_no} loss {loss:.6f} ({times[-1] * 1e3:.1f} ms, "
                  f"{tokens / times[-1]:,.0f} tokens/s)", flush=True)  # fmt: skip
    if prof is not None:
        prof.stop()
        dist.barrier()
        if rank == 0:
            _merge(args.profile_dir, trainer.world)
    if rank == 0:
        steady = times[2:] or times
        if steady:
            print(f"mean step {sum(steady) / len(steady) * 1e3:.2f} ms over {len(steady)} steps", flush=True)
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
    return 0


def _profiler(directory: str, rank: int):
    os.makedirs(directory, exist_ok=True)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (kineto's start/stop notes, on every rank)

    def write(prof) -> None:
        prof.export_chrome_trace(os.path.join(directory, f"rank{rank}.pt.trace.json"))

    prof = torch.profiler.profile(schedule=torch.profiler.schedule(**PROFILE_SCHEDULE), on_trace_ready=write)
    prof.start()
    return prof


def _merge(directory: str, world: int) -> None:
    """The ranks' traces on one timeline, and which rank the others waited for (hosts' clocks assumed synced)."""
    from monarch.runtime.tools import traces

    ranks = []
    for r in range(world):
        with open(os.path.join(directory, f"rank{r}.pt.trace.json")) as f:
            ranks.append(traces.RankTrace(r, f"rank={r}", json.load(f)))
    merged = traces.merge(ranks)
    with open(os.path.join(directory, "merged.pt.trace.json"), "w") as f:
        json.dump(merged, f)
    print(traces.summarize(merged).text(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
