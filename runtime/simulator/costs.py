"""The cost model: how long an op or a collective takes on a `DeviceProfile`.

An op costs its overhead (the device's per-op overhead, plus what calibration measured this op to cost
beyond a tiny add: `op_extra`) plus the larger of its FLOPs at the dtype's achievable rate (torch's FLOP
counter formulas: matmuls, convolutions, attention; one FLOP per output element for anything else that
computes) and the bytes it reads and writes at memory bandwidth (a roofline). Views and other ops that
only describe memory cost the overhead alone.

Collectives cost the engine's own work per reduce (`reduce_overhead`) plus the models NCCL's own tuning
uses, with α the per-step latency and β the bandwidth of the slowest link the group crosses (across hosts
when the group spans hosts):
  all-reduce      ring: 2(p-1)·α + 2(p-1)/p · n/β       tree: 2·log2(p)·α + 2·n/β   (NCCL: the faster one;
                                                        gloo on CPU workers: the ring)
                  gloo's ring cuts the tensor into 2p segments and skips empty ones: a tensor of e < 2p
                  elements costs the measured one-element all-reduce (`reduce_floor`) plus (e-1)/(2p-1)
                  of the rest of the full ring's time
  reduce-scatter  (p-1)·α + (p-1)/p · n/β
  all-gather      (p-1)·α + (p-1) · n/β                 (n: one rank's input)
  all-to-all      (p-1)·α + (p-1)/p · n/β
  send/recv       α + n/β
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from monarch.runtime.simulator.devices import DeviceProfile

_NO_COMPUTE = {"view", "_unsafe_view", "alias", "as_strided", "expand", "t", "transpose", "permute", "squeeze",
               "unsqueeze", "detach", "select", "slice", "split", "unbind", "reshape", "_reshape_alias",
               "empty", "empty_strided", "empty_like", "lift_fresh", "set_", "resize_", "_to_copy"}  # fmt: skip
"""Ops that move no data (or, for empty*, touch none)."""


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def tensors_in(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for o in x for t in tensors_in(o)]
    if isinstance(x, dict):
        return [t for o in x.values() for t in tensors_in(o)]
    return []


def op_cost(dev: DeviceProfile, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, float, int]:
    """(seconds, FLOPs, bytes moved) of `func` on fake tensors `args` giving `out`."""
    base = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    overhead = dev.op_overhead
    if dev.op_extra:
        overhead = max(overhead + dev.op_extra.get(func.name() if hasattr(func, "name") else str(func), 0.0), 0.0)
    if base in _NO_COMPUTE:
        return overhead, 0.0, 0
    outs = tensors_in(out)
    moved = sum(nbytes(t) for t in tensors_in((args, kwargs))) + sum(nbytes(t) for t in outs)
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    flops = 0.0
    if formula is not None:
        try:
            flops = float(formula(*args, out_val=out, **kwargs))
        except Exception:  # a formula that does not take this overload's arguments: count as elementwise
            formula = None
    if formula is None:
        flops = float(sum(t.numel() for t in outs))
    dtype = outs[0].dtype if outs else torch.float32
    rate = dev.peak(_dtype_name(dtype)) * (dev.efficiency if formula is not None else 1.0)
    return overhead + max(flops / rate, moved / dev.mem_bw), flops, moved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def link(dev: DeviceProfile, spans_hosts: bool) -> tuple[float, float]:
    """(α, β) of the slowest link a group crosses."""
    return (dev.inter_latency, dev.inter_bw) if spans_hosts else (dev.intra_latency, dev.intra_bw)


def collective_time(
    dev: DeviceProfile, kind: str, n: int, p: int, spans_hosts: bool, elements: int | None = None
) -> float:
    """Seconds for a collective of `kind` (all_reduce, reduce_scatter, all_gather, all_to_all) over `p` ranks
    of `n` bytes per rank (its input), `elements` of them."""
    fixed = dev.op_overhead + dev.reduce_overhead
    if p <= 1:
        return fixed
    a, b = link(dev, spans_hosts)
    if kind == "all_reduce":
        ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n / b
        tree = 2 * math.log2(p) * a + 2 * n / b
        if dev.kind != "cpu":
            t = min(ring, tree)
        elif elements is not None and 0 < elements < 2 * p and 0 < dev.reduce_floor < fixed + ring:
            full = fixed + ring  # gloo: fewer non-empty segments than the ring has
            return dev.reduce_floor + (elements - 1) / (2 * p - 1) * (full - dev.reduce_floor)
        else:
            t = ring  # gloo's all-reduce is a ring
    elif kind == "all_gather":
        t = (p - 1) * a + (p - 1) * n / b
    else:  # reduce_scatter, all_to_all
        t = (p - 1) * a + (p - 1) / p * n / b
    return fixed + t


def p2p_time(dev: DeviceProfile, n: int, spans_hosts: bool) -> float:
    a, b = link(dev, spans_hosts)
    return dev.op_overhead + a + n / b


def alloc_bytes(dev: DeviceProfile, t: torch.Tensor) -> int:
    """Bytes an allocation of `t`'s storage takes (strides included, rounded as the allocator rounds)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    size = span * t.element_size()
    r = dev.alloc_round
    return -(-size // r) * r
