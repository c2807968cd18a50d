"""Training a Llama with FSDP2: one `Trainer` per rank, the same code under monarch or under torchrun.

Under monarch the controller drives it with live functions that keep the rank's trainer between calls:

    setup.on(mesh)(TrainConfig(ckpt_dir="/shared/ckpt"))   # builds, shards, loads the newest checkpoint
    losses = train_steps.on(mesh)(10)                         # ten steps; a ValueMesh of loss lists

Checkpoints (`torch.distributed.checkpoint`, every `checkpoint_interval` steps) go to
`ckpt_dir/step-NNNNNNNN/`; a trainer starts from the newest complete one, so a run that was interrupted at
any point continues from its last checkpoint and reaches the same losses as one that never stopped.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .. import shakespeare
from .model import Llama, model_args


@dataclass
class TrainConfig:
    """What to train and how (the seed's MODEL_ARGS, the ones that apply here)."""

    model_name: str = "tiny"
    """A name in `model.CONFIGS`: tiny, small, llama2_7b, llama2_13b."""
    ckpt_dir: str | None = None
    """Where checkpoints are saved and the newest is loaded from (a path every host sees); None: none."""
    checkpoint_interval: int = 5
    """Save after every this many steps."""
    batch_size: int = 4
    """Sequences per rank per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    lr: float = 3e-3
    """AdamW's learning rate."""
    seed: int = 0
    """Seeds the weights and the batches (a batch depends on seed, step and rank only)."""
    plays: list[str] = field(default_factory=lambda: ["hamlet", "macbeth", "othello", "king-lear"])
    """The corpus: Shakespeare's plays (`shakespeare.play_names()`)."""
    mixed_precision: bool | None = None
    """bf16 parameters with fp32 reductions; None: on CUDA only."""
    loss_log: str | None = None
    """Rank 0 appends a line `{"step": N, "loss": L}` here per step (what a run that is cut off leaves)."""


class Trainer:
    """One rank's model, optimizer and data; `step()` trains one step and returns its loss."""

    def __init__(self, cfg: TrainConfig):
        if not dist.is_initialized():
            raise RuntimeError("Trainer needs a process group: run it on a mesh's workers or under torchrun")
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        text = shakespeare.text(cfg.plays)
        self.codec = shakespeare.CharCodec(text)
        self.data = self.codec.encode(text)
        args = model_args(cfg.model_name)
        if self.codec.vocab_size > args.vocab_size:
            raise ValueError(
                f"the corpus has {self.codec.vocab_size} characters; {cfg.model_name} has {args.vocab_size}"
            )
        self.mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        self.model = self._build(args, cuda if cfg.mixed_precision is None else cfg.mixed_precision)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0, foreach=False)
        self.step_no = 0
        """Steps done (the next step's number is step_no + 1)."""
        self.resumed_from: str | None = self.load_newest()

    def _build(self, args, mixed: bool) -> Llama:
        torch.manual_seed(self.cfg.seed)
        model = Llama(args)
        model.init_weights(self.cfg.seed)  # the same full weights on every rank, then each keeps its shard
        model.to(self.device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        kw = {"mesh": self.mesh, **({"mp_policy": policy} if policy else {})}
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model

    # -- data --------------------------------------------------------------------------------------------
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s batch for this rank: the same whatever happened before it (resume gives equal losses)."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1_009 + self.rank)
        starts = torch.randint(len(self.data) - self.cfg.seq_len - 1, (self.cfg.batch_size,), generator=gen)
        x = torch.stack([self.data[s : s + self.cfg.seq_len] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + self.cfg.seq_len] for s in starts.tolist()])
        return x.to(self.device), y.to(self.device)

    # -- training ----------------------------------------------------------------------------------------
    def step(self) -> float:
        """One step: forward, backward (FSDP reduce-scatters the gradients), AdamW; the mean loss over ranks."""
        step = self.step_no + 1
        x, y = self.batch(step)
        loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_no = step
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        value = mean.item() / self.world
        if self.cfg.loss_log and self.rank == 0:
            with open(self.cfg.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": value}) + "\n")
        if self.cfg.ckpt_dir and step % self.cfg.checkpoint_interval == 0:
            self.save()
        return value

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self) -> str:
        """Save model and optimizer (each rank its shards) as `ckpt_dir/step-NNNNNNNN`; returns the path."""
        assert self.cfg.ckpt_dir is not None
        path = Path(self.cfg.ckpt_dir) / f"step-{self.step_no:08d}"
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        return str(path)

    def load_newest(self) -> str | None:
        """Load the newest complete checkpoint in `ckpt_dir`, if any; returns its path."""
        path = newest_checkpoint(self.cfg.ckpt_dir) if self.cfg.ckpt_dir else None
        if path is None:
            return None
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step_no = checkpoint_step(path)
        return str(path)

    def sample(self, prompt: str = "HAMLET:\n", tokens: int = 120, temperature: float = 0.8) -> str:
        """Text the model writes after `prompt` (every rank takes part: the weights are sharded)."""
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        ids = self.codec.encode(prompt)[None].to(self.device)
        with torch.no_grad():
            for _ in range(tokens):
                logits = self.model(ids[:, -self.cfg.seq_len :])[:, -1, : self.codec.vocab_size] / temperature
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                ids = torch.cat([ids, nxt], dim=1)
        return self.codec.decode(ids[0].tolist())


_CKPT = re.compile(r"^step-(\d{8})$")


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was saved after."""
    m = _CKPT.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint directory (step-NNNNNNNN)")
    return int(m.group(1))


def logged_losses(path: str | os.PathLike) -> dict[int, float]:
    """The losses a `loss_log` holds, by step (a step trained twice: its last line)."""
    out: dict[int, float] = {}
    p = Path(path)
    for line in p.read_text().splitlines() if p.exists() else []:
        rec = json.loads(line)
        out[int(rec["step"])] = float(rec["loss"])
    return out


def newest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (its `.metadata`, written last, is there) in `ckpt_dir`."""
    root = Path(ckpt_dir)
    done = (
        [p for p in root.glob("step-*") if _CKPT.match(p.name) and (p / ".metadata").exists()] if root.is_dir() else []
    )
    return max(done, key=checkpoint_step, default=None)


# -- live functions: the controller's handles on each rank's trainer ---------------------------------------
_trainer: Trainer | None = None


def setup(cfg: TrainConfig) -> dict:
    """Build this rank's trainer (loading the newest checkpoint); what it resumed from and its sizes."""
    global _trainer
    _trainer = None  # (a trainer of an earlier setup lets go of its memory first)
    _trainer = Trainer(cfg)
    n = sum(p.to_local().numel() for p in _trainer.model.parameters())  # (this rank's shards)
    return {"resumed_from": _trainer.resumed_from, "step": _trainer.step_no, "params_here": n}


def train_steps(n: int) -> list[tuple[int, float, float]]:
    """Train `n` steps; per step (its number, its loss, its seconds)."""
    if _trainer is None:
        raise RuntimeError("train_steps: no trainer on this rank; call setup(cfg) first")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = _trainer.step()
        out.append((_trainer.step_no, loss, time.perf_counter() - t0))
    return out


def sample(prompt: str = "HAMLET:\n", tokens: int = 120) -> str:
    """The trainer's text after `prompt`."""
    if _trainer is None:
        raise RuntimeError("sample: no trainer on this rank; call setup(cfg) first")
    return _trainer.sample(prompt, tokens)
