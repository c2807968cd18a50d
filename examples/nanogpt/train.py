"""Train the character-level GPT with DDP, on a local monarch mesh or under torchrun.

    python -m examples.nanogpt.train --n_gpus 2 --config tiny              # a monarch mesh of 2 workers
    torchrun --nproc_per_node 2 -m examples.nanogpt.train --config tiny    # plain DDP, no monarch

Both run the same `Trainer` in each rank: DDP over the default process group (gloo on CPU, NCCL on GPU;
monarch's workers already have one), bf16 autocast on CUDA. Rank 0 prints progress; the script ends with
a ``summary: {...}`` line (JSON: the median step time, tokens/s, the final train and validation loss) for
benchmarks; ``--json PATH`` writes it with every step's time and every evaluation.

In a notebook or a live function, `start(train_config("tiny"))` makes this worker's `Trainer` and
`current()` finds it again from a later cell or call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .data import Corpus, get_batch, load_corpus
from .model import CONFIGS, GPT


@dataclass(frozen=True)
class TrainConfig:
    """How to train: the model's config name and the optimizer's schedule. Batches are per rank."""

    model: str = "tiny"
    """A name in `model.CONFIGS`: "tiny" or "small"."""
    max_iters: int = 300
    """Optimizer steps in all; the learning rate decays to `min_lr` over them."""
    batch_size: int = 32
    """Sequences per rank per step (the global batch is this times the number of ranks)."""
    lr: float = 1e-2
    """The peak learning rate, reached after `warmup_iters`."""
    min_lr: float = 1e-3
    """The learning rate at `max_iters` (cosine decay)."""
    warmup_iters: int = 50
    """Steps of linear warm-up (fewer, at this peak rate, and the tiny model's loss spikes and ends higher)."""
    weight_decay: float = 0.1
    """AdamW's weight decay, on the weight matrices only."""
    grad_clip: float = 1.0
    """The most the gradients' global norm may be (0: no clipping)."""
    eval_interval: int = 100
    """Steps between evaluations in `run` (and at its end)."""
    eval_iters: int = 10
    """Batches per rank averaged for one evaluation of each split."""
    seed: int = 1337
    """Seeds the model's initial weights and, with the step and the rank, every batch."""
    log_interval: int = 25
    """Steps between rank 0's progress lines (0: none)."""
    plays: tuple[str, ...] | None = None
    """The plays to train on (`examples.shakespeare.play_names()`); all of them by default."""
    compile: bool = False
    """torch.compile the model (worth it on a GPU)."""


DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(  # nanoGPT's config/train_shakespeare_char.py
        max_iters=5000, batch_size=64, lr=1e-3, min_lr=1e-4, warmup_iters=100, eval_interval=250, eval_iters=200
    ),
}
"""Each model config's training defaults (over `TrainConfig`'s, which are tiny's)."""


def train_config(model: str = "tiny", **overrides: Any) -> TrainConfig:
    """The training config for model config `model`, with its defaults and `overrides` (None: default)."""
    if model not in CONFIGS:
        raise ValueError(f"no model config {model!r}; there are {sorted(CONFIGS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return TrainConfig(model=model, **{**DEFAULTS.get(model, {}), **given})


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate at `step`: linear warm-up, then cosine decay to `min_lr` at `max_iters`."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if step >= cfg.max_iters:
        return cfg.min_lr
    ratio = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class Trainer:
    """One rank's model, optimizer and data: DDP when a process group of more than one rank exists.

    `train(n)` runs n steps and returns their records (loss averaged over the ranks, learning rate, ms);
    `evaluate()` the mean train and validation loss; `summary()` the figures of the steps so far.
    Every rank must call `train` and `evaluate` together (they hold collectives).
    """

    def __init__(self, cfg: TrainConfig, corpus: Corpus | None = None) -> None:
        self.cfg = cfg
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = _device()
        self.corpus = corpus if corpus is not None else load_corpus(list(cfg.plays) if cfg.plays else None)
        self.model_config = CONFIGS[cfg.model].with_vocab(self.corpus.vocab_size)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        self.model = GPT(self.model_config).to(self.device)
        self.optimizer = self.model.optimizer(cfg.lr, cfg.weight_decay)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp: torch.nn.Module = DDP(self.model, device_ids=ids) if self.distributed else self.model
        self.forward = torch.compile(self.ddp) if cfg.compile else self.ddp
        cuda = self.device.type == "cuda"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        self.step = 0
        self.history: list[dict[str, Any]] = []
        """One record per step: step, loss (mean over ranks), lr, ms."""
        self.evals: list[dict[str, Any]] = []
        """One record per `evaluate()`: step, train, val."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens every step trains on, over all ranks."""
        return self.world * self.cfg.batch_size * self.model_config.block_size

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train(self, steps: int, log: bool = True) -> list[dict[str, Any]]:
        """Run `steps` optimizer steps; their records. With `log`, rank 0 prints a line every `log_interval`
        steps."""
        cfg, block = self.cfg, self.model_config.block_size
        self.ddp.train()
        losses, records = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            lr = lr_at(cfg, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(
                self.corpus.train,
                cfg.batch_size,
                block,
                seed=cfg.seed,
                step=self.step,
                rank=self.rank,
                device=self.device,
            )
            with self.autocast:
                _, loss = self.forward(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self._sync()
            ms = (time.perf_counter() - t0) * 1000
            losses.append(loss.detach().float())
            records.append({"step": self.step, "lr": lr, "ms": ms})
            self.step += 1
            if log and cfg.log_interval and self.rank == 0 and (self.step % cfg.log_interval == 0 or self.step == 1):
                tps = self.tokens_per_step / (ms / 1000)
                print(f"step {self.step:4d}/{cfg.max_iters}: loss {loss.item():.4f}, {ms:.1f} ms, {tps:,.0f} tokens/s")
        if losses:
            mean = torch.stack(losses)
            if self.distributed:
                dist.all_reduce(mean)  # (gloo has no AVG)
                mean /= self.world
            for record, value in zip(records, mean.tolist()):
                record["loss"] = value
        self.history.extend(records)
        return records

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """The mean loss on `eval_iters` batches per rank of each split, averaged over the ranks (the same
        batches at every evaluation): ``{"step": ..., "train": ..., "val": ...}``."""
        cfg, block = self.cfg, self.model_config.block_size
        self.model.eval()
        out = torch.zeros(2, device=self.device)
        for i, split in enumerate((self.corpus.train, self.corpus.val)):
            for k in range(cfg.eval_iters):
                x, y = get_batch(
                    split, cfg.batch_size, block, seed=cfg.seed + 1, step=k, rank=self.rank, device=self.device
                )
                with self.autocast:
                    out[i] += self.model(x, y)[1].float() / cfg.eval_iters
        if self.distributed:
            dist.all_reduce(out)
            out /= self.world
        self.model.train()
        record = {"step": self.step, "train": out[0].item(), "val": out[1].item()}
        self.evals.append(record)
        return record

    def sample(self, prompt: str = "\n", chars: int = 300, seed: int = 0, temperature: float = 0.8) -> str:
        """`chars` characters the model writes after `prompt` (the same `seed`, the same text)."""
        self.model.eval()
        idx = self.corpus.codec.encode(prompt)[None].to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with self.autocast:
            out = self.model.generate(idx, chars, temperature=temperature, generator=gen)
        self.model.train()
        return self.corpus.codec.decode(out[0, len(prompt) :].tolist())

    def summary(self, skip: int = 5) -> dict[str, Any]:
        """The run's figures: median step time (leaving out the first `skip` steps: warm-up, compilation),
        tokens/s over all ranks, the last loss and evaluation."""
        times = [r["ms"] for r in self.history[skip:]] or [r["ms"] for r in self.history] or [float("nan")]
        step_ms = statistics.median(times)
        last = self.evals[-1] if self.evals else {}
        return {
            "config": self.cfg.model,
            "world": self.world,
            "device": str(self.device.type),
            "params": self.model.num_params(),
            "steps": self.step,
            "batch_size": self.cfg.batch_size,
            "block_size": self.model_config.block_size,
            "step_ms": step_ms,
            "mean_step_ms": statistics.fmean(times),
            "tokens_per_s": self.tokens_per_step / (step_ms / 1000),
            "train_time_s": sum(r["ms"] for r in self.history) / 1000,
            "loss": self.history[-1]["loss"] if self.history else None,
            "train_loss": last.get("train"),
            "val_loss": last.get("val"),
        }


_current: Trainer | None = None


def start(cfg: TrainConfig) -> Trainer:
    """Make this process's `Trainer` for `cfg` (every rank at once: DDP's constructor is a collective) and
    keep it for `current()`."""
    global _current
    _current = Trainer(cfg)
    return _current


def current() -> Trainer:
    """The `Trainer` that `start` made in this process (a later `%%mesh` cell or live function finds it)."""
    if _current is None:
        raise RuntimeError("no Trainer in this process yet: call examples.nanogpt.train.start(cfg) first")
    return _current


def _release() -> None:
    """Drop this process's `Trainer` (its DDP reducer holds the process group) before the group goes: a
    gloo rank that exits with both alive can abort ("terminate called without an active exception")."""
    global _current
    _current = None
    gc.collect()


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train `cfg` to `max_iters` in this process (one rank, or alone), evaluating every `eval_interval`
    steps and at the end; returns `Trainer.summary()` with the evaluations."""
    t0 = time.perf_counter()
    trainer = start(cfg)
    if trainer.rank == 0:
        print(
            f"nanoGPT {cfg.model}: {trainer.model.num_params() / 1e6:.2f}M parameters, {trainer.world} rank(s) on "
            f"{trainer.device.type}, {trainer.tokens_per_step:,} tokens per step, {cfg.max_iters} steps",
            flush=True,
        )
    while trainer.step < cfg.max_iters:
        trainer.train(min(cfg.eval_interval, cfg.max_iters - trainer.step))
        ev = trainer.evaluate()
        if trainer.rank == 0:
            print(f"step {ev['step']}: train loss {ev['train']:.4f}, val loss {ev['val']:.4f}", flush=True)
    step_times = [r["ms"] for r in trainer.history]
    return {**trainer.summary(), "evals": trainer.evals, "step_times_ms": step_times, "run_s": time.perf_counter() - t0}


def run_rank(cfg: TrainConfig) -> dict[str, Any]:
    """What each worker of the mesh runs (a live function): `run`, then rank 0's sample of text."""
    out = run(cfg)
    if current().rank == 0:
        out["sample"] = current().sample(chars=200)
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.nanogpt.train", description=__doc__.split("\n")[0])
    p.add_argument("--n_gpus", type=int, default=1, help="workers of the local monarch mesh (one per GPU, or CPU)")
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="the model config")
    for field in ("max_iters", "batch_size", "eval_interval", "eval_iters", "warmup_iters", "log_interval", "seed"):
        p.add_argument(f"--{field}", type=int, default=None)
    for field in ("lr", "min_lr", "weight_decay", "grad_clip"):
        p.add_argument(f"--{field}", type=float, default=None)
    p.add_argument("--plays", default=None, help="comma-separated play names (default: all 38)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    return p.parse_args(argv)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The script: train under torchrun in this process, or on a local mesh of `--n_gpus` workers; prints
    progress and a final ``summary: {json}`` line, and returns the summary."""
    args = _parse(argv)
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "plays"}
    plays = tuple(args.plays.split(",")) if args.plays else None
    cfg = train_config(args.config, plays=plays, **{k: v for k, v in vars(args).items() if k in names})
    t0 = time.perf_counter()
    if _under_torchrun():
        mode = "torchrun"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, device_id=_device() if backend == "nccl" else None)
        try:
            summary = run(cfg)
        finally:
            _release()
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return summary
    else:
        import monarch
        from monarch.actor import this_host

        mode = "monarch"
        mesh = this_host().spawn_procs({"gpu": args.n_gpus})
        try:
            results = monarch.remote(run_rank).on(mesh)(cfg)
        finally:
            mesh.exit()
        summary = results.item(gpu=0)
        if "sample" in summary:
            print("sample:\n" + summary.pop("sample"))
    summary = {"mode": mode, **summary, "wall_s": time.perf_counter() - t0}
    line = json.dumps({k: v for k, v in summary.items() if k not in ("evals", "step_times_ms")})
    print(f"summary: {line}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    # Run as the importable module, not as __main__: the live function then travels to the workers by name.
    importlib.import_module(__spec__.name).main()
