"""Every change monarch makes to torch outside its own classes, in one place."""

from __future__ import annotations

import contextvars
import functools
import logging
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as torch_device

from monarch.runtime.tensor.engine import engine_for
from monarch.runtime.wire import protocol as P


class CudaMeansCpu(TorchFunctionMode):
    """On a mesh without CUDA, "cuda" means the CPU: `device="cuda"`, the default device set by
    `torch.set_default_device("cuda")`, `t.to("cuda")`, `t.cuda()` and `module.to("cuda")`.

    Runs before torch parses the arguments, which would otherwise try to initialize CUDA here. `warn=False`
    for a simulated GPU mesh on a controller without CUDA: its metadata says CPU, its costs are the GPU's.
    """

    def __init__(self, warn: bool = True) -> None:
        super().__init__()
        self.warn = warn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (every op inside activate() on a CPU mesh passes here: the common case is checked first, cheaply)
        kwargs = kwargs or {}
        if func is _CUDA:
            self._warn()
            return args[0].to("cpu")
        if func is _TO and any(_is_cuda(a) for a in args[1:]):
            self._warn()
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is None and torch_device.CURRENT_DEVICE is not None and _is_cuda(torch_device.CURRENT_DEVICE):
            if func in _constructors():  # torch.set_default_device("cuda"), found without making a tensor
                dev = "cuda"  # (which would initialize CUDA)
        if dev is not None and _is_cuda(dev):
            self._warn()
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)

    def _warn(self) -> None:
        if self.warn:
            _warn_cuda()


_CUDA, _TO = torch.Tensor.cuda, torch.Tensor.to


def _is_cuda(x: Any) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.split(":", 1)[0] == "cuda"


_warned_cuda = False


def _warn_cuda() -> None:
    """Once per process: tutorials ask for "cuda" in many places."""
    global _warned_cuda
    if not _warned_cuda:
        _warned_cuda = True
        warnings.warn("the mesh's workers have no CUDA: tensors requested on 'cuda' are made on the CPU", stacklevel=4)


def _constructors():
    from torch.utils._device import _device_constructors

    return _device_constructors()


_local_manual_seed = None


def install(capturing: contextvars.ContextVar) -> None:
    """Once per process, at the first `activate()`:

    - `torch.manual_seed(s)` inside `activate()` (the mesh in `capturing`) seeds the workers too (it is
      not a torch op, so no mode sees it); elsewhere it is torch's own;
    - fake tensors' shape errors are not logged (the user gets them raised at the op).
    """
    global _local_manual_seed
    if _local_manual_seed is not None:
        return
    _local_manual_seed = torch.manual_seed
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

    @functools.wraps(_local_manual_seed)
    def manual_seed(seed):
        mesh = capturing.get()
        if mesh is not None and mesh.spawned.state == "running":
            engine_for(mesh.spawned).push(mesh._shape.ranks, P.Seed(int(seed)))
        return _local_manual_seed(seed)

    torch.manual_seed = manual_seed
