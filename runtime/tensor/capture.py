"""`with mesh.activate():` — the modes that turn torch ops on the controller into commands."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from monarch.runtime.tensor import comms, patches
from monarch.runtime.tensor.engine import capturing, engine_for, flush
from monarch.runtime.tensor.handles import run

__all__ = ["activate", "capturing", "comms", "flush"]
"""(`comms` is imported for its registration: the collectives of every `Tensor`.)"""


class _Capture(TorchDispatchMode):
    """While active, every torch op runs on the workers of `mesh` and returns handles."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.monarch_mesh = mesh
        """(named so that `handles` recognizes this mode as the one on top, for its operators' fast path)"""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (torch's default wraps __torch_dispatch__ in two more Python calls per op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":  # record_function markers (e.g. in optimizer.step()): the controller's
            with torch.utils._python_dispatch._disable_current_modes():
                return func(*args, **(kwargs or {}))
        return run(self.monarch_mesh, func, args, kwargs or {})


@contextlib.contextmanager
def activate(mesh) -> Iterator[None]:
    """The capture modes for `mesh` (entered by `mesh.activate()`)."""
    engine = engine_for(mesh.spawned)
    patches.install(capturing)
    token = capturing.set(mesh)
    try:
        with contextlib.ExitStack() as stack:
            if engine.cpu_only or engine.simulated_cuda:
                stack.enter_context(patches.CudaMeansCpu(warn=not engine.simulated_cuda))
            stack.enter_context(_Capture(mesh))
            yield
    finally:
        capturing.reset(token)
