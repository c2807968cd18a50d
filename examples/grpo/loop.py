"""GRPO with actors: generators, a scorer, a replay buffer and a trainer, weights moved with `RDMABuffer`, steps
overlapped. Written against Meta Monarch's public API only (`monarch.actor`, `monarch.rdma`), so the same file
runs on this project and on torchmonarch:

    python -m examples.grpo.loop --steps 60          # prints the reward per step and a `summary: {json}` line

The task is a contextual bandit a policy can learn: a state is a random vector, each of `ACTIONS` actions has
a hidden direction, and an action's reward is 1 when its direction is the closest to the state (0 otherwise),
so a random policy earns 1/ACTIONS and a perfect one 1. Each step:

- every generator samples `GROUP` actions for a batch of states with its copy of the policy and sends them to
  the scorer (a port: fire and forget);
- the scorer scores each group and puts it in the replay buffer;
- the trainer takes the newest groups from the buffer, computes GRPO's group-relative advantages and a
  PPO-clipped loss (with a KL penalty to the first policy), steps Adam, and bumps the policy version;
- the generators then read the new weights straight from the trainer's `RDMABuffer`s (`read_into`), while the
  next batch is generated: generation of step n+1 overlaps training of step n (`asyncio.gather`), so a batch
  may come from the policy one version behind (PPO's ratio corrects for it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from monarch.actor import Actor, Channel, Port, concurrent_endpoint, endpoint, this_host
from monarch.rdma import RDMABuffer

STATE = 8
"""Size of a state vector."""
ACTIONS = 4
GROUP = 16
"""Actions sampled per state (GRPO's group)."""
BATCH = 8
"""States per generator per step."""
CLIP = 0.2
KL = 0.02


@dataclass
class Rollout:
    version: int
    """The policy version that sampled it."""
    states: torch.Tensor
    """[BATCH, STATE]"""
    actions: torch.Tensor
    """[BATCH, GROUP]"""
    logps: torch.Tensor
    """[BATCH, GROUP]: log-probabilities under that policy."""
    rewards: torch.Tensor | None = None


def policy() -> nn.Module:
    torch.manual_seed(0)  # every copy starts from the same weights
    return nn.Sequential(nn.Linear(STATE, 32), nn.Tanh(), nn.Linear(32, ACTIONS))


def task(seed: int = 1) -> torch.Tensor:
    """The hidden action directions [ACTIONS, STATE]."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(ACTIONS, STATE, generator=g), dim=1)


class Generator(Actor):
    def __init__(self, weights: dict, scorer_port: Port, seed: int) -> None:
        self.model = policy()
        self.weights = weights  # name -> the trainer's RDMABuffer of that parameter
        self.out = scorer_port
        self.version = 0
        self.gen = torch.Generator().manual_seed(seed)

    @endpoint
    async def generate(self) -> int:
        """Sample a batch with the current policy; its groups go to the scorer. The version used."""
        states = torch.randn(BATCH, STATE, generator=self.gen)
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=self.model(states))
            actions = dist.sample((GROUP,)).T  # [BATCH, GROUP]
            logps = dist.log_prob(actions.T).T
        self.out.send(Rollout(self.version, states, actions, logps))
        return self.version

    @endpoint
    async def update(self, version: int) -> None:
        """Read the trainer's new weights into this copy of the policy (no copy through the caller)."""
        params = dict(self.model.named_parameters())
        for name, buffer in self.weights.items():
            with torch.no_grad():
                await buffer.read_into(params[name].data.view(torch.uint8).flatten())
        self.version = version


class Scorer(Actor):
    def __init__(self, buffer) -> None:
        self.port, self.receiver = Channel.open()
        self.buffer = buffer
        self.directions = task()
        self.task: asyncio.Task | None = None

    @endpoint
    async def rollouts(self) -> Port:
        """The port generators send rollouts to."""
        return self.port

    @endpoint
    async def start(self) -> None:
        """Score rollouts as they come, until `None` (runs as a task: this returns at once)."""
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while (r := await self.receiver.recv()) is not None:
            best = (r.states @ self.directions.T).argmax(dim=1, keepdim=True)  # [BATCH, 1]
            r.rewards = (r.actions == best).float()
            await self.buffer.put.call_one(r)

    @endpoint
    async def drain(self) -> None:
        self.port.send(None)
        if self.task is not None:
            await self.task


class ReplayBuffer(Actor):
    def __init__(self) -> None:
        self.items: list[Rollout] = []
        self.arrived = asyncio.Event()

    @endpoint
    async def put(self, r: Rollout) -> None:
        self.items.append(r)
        self.arrived.set()

    @concurrent_endpoint
    async def take(self, n: int) -> list[Rollout]:
        """The newest `n` rollouts, waiting for them (as a task: `put` runs meanwhile)."""
        while len(self.items) < n:
            self.arrived.clear()
            await self.arrived.wait()
        out, self.items = self.items[-n:], []
        return out


class Trainer(Actor):
    def __init__(self, lr: float) -> None:
        self.model = policy()
        self.reference = policy()
        self.optim = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.version = 0

    @endpoint
    async def weights(self) -> dict:
        """An `RDMABuffer` of each parameter: generators read the current weights from them."""
        return {n: RDMABuffer(p.data.view(torch.uint8).flatten()) for n, p in self.model.named_parameters()}

    @endpoint
    async def step(self, batch: list[Rollout]) -> dict:
        """One GRPO step on `batch`; its figures."""
        states = torch.cat([r.states for r in batch])  # [N, STATE]
        actions = torch.cat([r.actions for r in batch])  # [N, GROUP]
        old = torch.cat([r.logps for r in batch])
        rewards = torch.cat([r.rewards for r in batch])
        adv = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)
        dist = torch.distributions.Categorical(logits=self.model(states))
        logps = dist.log_prob(actions.T).T
        ratio = (logps - old).exp()
        ppo = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
        with torch.no_grad():
            ref = torch.distributions.Categorical(logits=self.reference(states))
        kl = torch.distributions.kl_divergence(dist, ref).mean()
        loss = ppo + KL * kl
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.version += 1
        lag = self.version - 1 - min(r.version for r in batch)
        return {"version": self.version, "reward": rewards.mean().item(), "loss": loss.item(), "lag": lag}


async def train(steps: int = 60, generators: int = 2, lr: float = 0.02, log: bool = True) -> dict:
    """Run the loop for `steps` trainer steps; per step its figures, and the run's summary."""
    t0 = time.perf_counter()
    gen_procs = this_host().spawn_procs(per_host={"gpus": generators})
    hub = this_host().spawn_procs(per_host={"gpus": 1})  # the scorer, the buffer and the trainer
    try:
        buffer = hub.spawn("buffer", ReplayBuffer)
        scorer = hub.spawn("scorer", Scorer, buffer)
        trainer = hub.spawn("trainer", Trainer, lr)
        weights = await trainer.weights.call_one()
        port = await scorer.rollouts.call_one()
        gens = gen_procs.spawn("generators", Generator, weights, port, 7)
        await scorer.start.call_one()
        ready = time.perf_counter()
        history, step_s = [], []
        await gens.generate.call()  # the first batch, with the first policy
        for step in range(steps):
            s0 = time.perf_counter()
            batch = await buffer.take.call_one(generators)
            # the next batch is generated while this one trains: one policy version behind, at most
            _, stats = await asyncio.gather(gens.generate.call(), trainer.step.call_one(batch))
            await gens.update.call(stats["version"])
            step_s.append(time.perf_counter() - s0)
            history.append(stats)
            if log and (step % 10 == 0 or step == steps - 1):
                print(f"step {step:3d}  reward {stats['reward']:.3f}  loss {stats['loss']:+.3f}  lag {stats['lag']}")
        await scorer.drain.call_one()
    finally:
        await gen_procs.stop()
        await hub.stop()
    tail = [h["reward"] for h in history[-10:]]
    return {
        "steps": steps,
        "first_reward": history[0]["reward"],
        "final_reward": statistics.fmean(tail),
        "random_reward": 1 / ACTIONS,
        "step_ms": statistics.median(step_s) * 1e3,
        "start_s": ready - t0,
        "wall_s": time.perf_counter() - t0,
        "history": history,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m examples.grpo.loop", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--json", default=None, help="also write the summary (with every step) here")
    args = ap.parse_args(argv)
    summary = asyncio.run(train(args.steps, args.generators, args.lr))
    line = {k: v for k, v in summary.items() if k != "history"}
    print("summary: " + json.dumps({k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
                                    for k, v in line.items()}), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":
    main()
