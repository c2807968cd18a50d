"""A small training script written for torchrun, gloo on the CPU: a tiny model trained with DDP, then with FSDP2
(`fully_shard`), a few steps each, every rank on its own data. Each rank writes what it saw to
``<out>/rank<RANK>.json``: its losses, torchrun's environment, `__name__` and `sys.argv`.

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/spmd_train.py --out DIR
    actors.main.call(addr, port, ["tests/helpers/spmd_train.py", "--out", DIR])      # the same, through SPMDActor

`--fail-rank R`: rank R raises right after joining the group (`--fail-at start`: the others wait for it in DDP's
constructor) or in DDP's second step, before its backward (`--fail-at step`: the others wait in theirs).
`--exit N`: the script ends with `sys.exit(N)`.
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
       "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def train(net: nn.Module, steps: int, rank: int, fail: bool = False) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(net(x), y)
        if fail and step == 1:
            raise ValueError(f"rank {rank} fails on purpose in step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-at", choices=("start", "step"), default="start")
    p.add_argument("--exit", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)  # (bit-equal losses whatever the thread count a launcher gives)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == args.fail_rank and args.fail_at == "start":
        raise ValueError(f"rank {rank} fails on purpose")
    ddp = train(DDP(model()), args.steps, rank, fail=rank == args.fail_rank)
    net = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    fsdp = train(net, args.steps, rank)
    seen = {
        "ddp": ddp,
        "fsdp": fsdp,
        "env": {k: os.environ.get(k) for k in ENV},
        "name": __name__,
        "argv": sys.argv,
        "host": socket.gethostname(),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    # Every rank past its last collective before any tears its groups down: a rank that destroys them while its
    # peer's gloo threads still use the connections can end that peer with "terminate called without an active
    # exception" (SIGABRT; seen under torchrun on a loaded machine).
    dist.barrier()
    dist.destroy_process_group()
    if args.exit is not None:
        sys.exit(args.exit)


if __name__ == "__main__":
    main()
