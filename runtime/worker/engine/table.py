"""A worker's table of tensors by reference id, and the poison that stands for a failed value."""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from monarch.runtime.common import context
from monarch.runtime.wire.protocol import Ref
from monarch.runtime.worker.engine.streams import sync_streams

table: dict[int, Any] = {}
_warned_cuda = False


@dataclass
class Poison:
    """Stands for a value whose computation failed (here or in an op it depends on)."""

    exc_type: str
    message: str
    traceback: str
    issued_at: str
    """The controller line that issued the failing op."""
    failed_on: str | None = None
    """Where it failed when not on this worker: e.g. "rank 3 (its input to the collective issued at ...)"."""

    @classmethod
    def of(cls, e: BaseException, where: str, tb: str | None = None) -> Poison:
        """The poison for exception `e`, being handled now (its traceback, unless `tb` is given)."""
        return cls(type(e).__qualname__, str(e), traceback.format_exc() if tb is None else tb, where)


class PoisonedValueError(RuntimeError):
    """Raised when a fetched value depends on an op that failed on this worker."""


def device(value: Any) -> Any:
    """`cuda` on a worker without CUDA: the CPU, with one warning."""
    global _warned_cuda
    dev = torch.device(value) if isinstance(value, str | torch.device) else value
    if isinstance(dev, torch.device) and dev.type == "cuda":
        w = context.worker
        if not torch.cuda.is_available():
            if not _warned_cuda:
                _warned_cuda = True
                warnings.warn("no CUDA on this worker: tensors requested on 'cuda' are made on the CPU", stacklevel=2)
            return torch.device("cpu")
        if w is not None and w.device.type == "cuda":
            return w.device  # each worker owns one GPU; the controller's `cuda:0` means "mine"
    return dev


def on_device(dev_type: str) -> torch.device:
    """The device a tensor the controller describes as `dev_type` ("cpu" or "cuda") lives on here."""
    w = context.worker
    if dev_type == "cuda" and w is not None and w.device.type == "cuda":
        return w.device
    return torch.device("cpu")


def resolve(obj: Any, poisons: list) -> Any:
    """`obj` with `Ref`s replaced by the tensors they name; poisons met are appended to `poisons`."""
    kind = type(obj)
    if kind is tuple:  # an op's arguments: mostly tensors and numbers
        out = []
        for o in obj:
            t = type(o)
            if t is Ref:
                v = table.get(o.id)
                if v is None or type(v) is Poison:
                    v = _missing(o, v, poisons)
                out.append(v)
            else:
                out.append(o if t in _LEAVES else resolve(o, poisons))
        return tuple(out)
    if kind is dict and not obj:
        return {}
    if kind is Ref:
        v = table.get(obj.id)
        return v if v is not None and type(v) is not Poison else _missing(obj, v, poisons)
    if isinstance(obj, list | tuple):
        return type(obj)(resolve(o, poisons) for o in obj)
    if isinstance(obj, dict):
        return {k: (device(v) if k == "device" else resolve(v, poisons)) for k, v in obj.items()}
    return obj


_LEAVES = {int, float, bool, str, type(None)}


def _missing(ref: Ref, v: Any, poisons: list) -> Any:
    """A `Ref` whose value is a poison (`v`) or gone (None): noted in `poisons`."""
    poisons.append(v if v is not None else Poison("KeyError", f"tensor {ref.id} was freed or never made here", "", "?"))
    return v


def store(ids: Any, value: Any) -> None:
    """Keep `value` (or its parts) under `ids` (an id, None, or a nested list of ids)."""
    if isinstance(ids, list | tuple):
        for i, v in zip(ids, value if isinstance(value, list | tuple) else [value] * len(ids)):
            store(i, v)
    elif ids is not None:
        table[ids] = value


def fetch(ref_id: int) -> torch.Tensor:
    """This worker's value of a tensor (called by reference from `monarch.inspect`)."""
    sync_streams()
    v = table.get(ref_id)
    if isinstance(v, Poison):
        raise PoisonedValueError(
            f"this value depends on an op that failed on {v.failed_on or 'this worker'}: {v.exc_type}: {v.message}\n"
            f"the failing op was issued at {v.issued_at}\n\nworker traceback:\n{v.traceback}"
        )
    if v is None:
        raise KeyError(f"tensor {ref_id} is not on this worker (freed, or made on another mesh)")
    if isinstance(v, torch.Tensor):
        if v.requires_grad:  # (each op through torch's dispatcher costs a worker just woken several µs)
            v = v.detach()
        if not v.is_cpu:
            v = v.cpu()
        if v.untyped_storage().nbytes() > v.nbytes:  # a view: send its elements, not the whole storage
            v = v.clone()
    return v


def local(mesh_id: int, ref_id: int) -> torch.Tensor:
    """What a `monarch.Tensor` given to an actor's endpoint (or a live function) becomes on the worker: this
    worker's tensor (what `monarch.Tensor.__reduce_ex__` names)."""
    w = context.worker
    if w is None or w.mesh_id != mesh_id:
        raise ValueError(
            f"a monarch.Tensor of mesh {mesh_id} was sent to a worker of another mesh "
            f"({'none' if w is None else w.mesh_id}): its values live on its own mesh's workers; move it with "
            "t.to_mesh(other) first, or fetch it (monarch.inspect) and send the value"
        )
    v = table.get(ref_id)
    if v is None or isinstance(v, Poison):
        return fetch(ref_id)  # (raises, saying why)
    sync_streams()
    return v


def table_size() -> int:
    """How many values this worker holds (for tests of lifetime)."""
    return len(table)
