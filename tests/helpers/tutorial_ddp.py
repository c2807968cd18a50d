"""The tutorial's DDP code (seed 001: "DDP Example", "Simulation of DDP", "Overlapping Comms/Compute"), kept
in one place for the simulator's tests and its benchmark (`benchmarks/simulator.py`)."""

from __future__ import annotations

import torch
import torch.nn as nn

import monarch


class Net(nn.Module):
    """The tutorial's model: eight 4x4 linear layers with ReLUs."""

    def __init__(self):
        super().__init__()
        layers = []
        for _ in range(8):
            layers.append(nn.Linear(4, 4))
            layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, input, target):
        output = self.layers(input)
        return torch.nn.functional.cross_entropy(output, target)


def make_train(variant: int, comms):
    """The tutorial's `train` in its three versions: 1 reduces on the main stream; 2 borrows each gradient to
    `comms` (a `monarch.Stream`) and drops the borrow at once; 3 drops it after the next gradient is asked for,
    so the reduce runs beside the next backward step. Returns the loss (the tutorial's returns nothing), so
    that a caller can end a step by fetching it."""
    if variant not in (1, 2, 3):
        raise ValueError(f"variant={variant!r}: the tutorial has variants 1, 2 and 3")

    def train(model, input, target):
        loss = model(input, target)
        rparameters = list(reversed(list(model.parameters())))
        grads = monarch.grad_generator(loss, rparameters)
        with torch.no_grad():
            if variant == 1:
                it = iter(zip(rparameters, grads))
                todo = next(it, None)
                while todo is not None:
                    param, grad = todo
                    grad.reduce_("dp", "sum")
                    todo = next(it, None)
                    param += 0.01 * grad
                return loss
            it = iter((param, grad, *comms.borrow(grad, mutable=True)) for param, grad in zip(rparameters, grads))
            todo = next(it, None)
            while todo is not None:
                param, grad, comm_grad, borrow = todo
                with comms.activate():
                    comm_grad.reduce_("dp", "sum")
                if variant == 2:
                    borrow.drop()
                todo = next(it, None)
                if variant == 3:
                    borrow.drop()
                param += 0.01 * grad
        return loss

    return train
