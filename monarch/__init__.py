"""monarch: distributed PyTorch from a notebook or a script.

Start here::

    import monarch, torch
    from monarch.actor import this_host

    mesh = this_host().spawn_procs({"gpu": 4})   # 4 worker processes, one per GPU (or the CPU)

    @monarch.remote                               # a live function, shipped by value to the workers
    def where():
        return monarch.current_rank()

    where.on(mesh)()                              # a ValueMesh: one value per worker

    with mesh.activate():                         # the tensor engine: torch ops run on every worker
        t = torch.ones(3) * 2
    monarch.inspect(t, gpu=0)                     # rank 0's value, fetched

In a notebook, ``%%mesh gpu=4`` above a cell runs it on 4 workers (``%mesh help`` lists the magics; the
Monarch kernel loads them, ``%load_ext monarch`` does in any IPython). ``help(monarch.ProcMesh)`` tells
what a mesh can do; ``monarch.Tensor`` is the tensor engine's handle (a torch.Tensor subclass).

``import monarch`` is cheap: it imports neither torch, zmq nor IPython; each name here is imported on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "remote",
    "RemoteError",
    "WorkerDiedError",
    "MeshBusyError",
    "MeshStoppedError",
    "ValueMesh",
    "Future",
    "ProcMesh",
    "current_rank",
    "current_size",
    "inspect",
    "show",
    "fetch_shard",
    "grad_generator",
    "Stream",
    "get_active_stream",
    "Simulator",
]

# (`Tensor` is exported but not in __all__: help(monarch) would print torch.Tensor's 200 KB of methods)
_EXPORTS = {
    "remote": "monarch.runtime.remote",
    "ValueMesh": "monarch.runtime.values",
    "Future": "monarch.runtime.values",
    "RemoteError": "monarch.runtime.common.errors",
    "WorkerDiedError": "monarch.runtime.common.errors",
    "MeshBusyError": "monarch.runtime.common.errors",
    "MeshStoppedError": "monarch.runtime.common.errors",
    "ProcMesh": "monarch.runtime.mesh",
    "current_rank": "monarch.runtime.common.context",
    "current_size": "monarch.runtime.common.context",
    "Tensor": "monarch.runtime.tensor.handles",
    "inspect": "monarch.runtime.fetch",
    "fetch_shard": "monarch.runtime.fetch",
    "grad_generator": "monarch.runtime.tensor.comms",
    "Stream": "monarch.runtime.tensor.streams",
    "get_active_stream": "monarch.runtime.tensor.streams",
    "show": "monarch.extension.show",
    "Simulator": "monarch.simulator",
}

if TYPE_CHECKING:
    from monarch.runtime.common.context import current_rank, current_size
    from monarch.runtime.common.errors import MeshBusyError, MeshStoppedError, RemoteError, WorkerDiedError
    from monarch.runtime.mesh import ProcMesh
    from monarch.runtime.remote import remote
    from monarch.runtime.values import Future, ValueMesh


_SUBMODULES = {"memory", "profiler"}
"""Public modules reachable after a bare `import monarch` (`monarch.memory.dump_memory_snapshot()`)."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"monarch.{name}")  # (binds itself as an attribute of monarch)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def load_ipython_extension(ip: Any) -> None:
    """`%load_ext monarch`: the `%%mesh` and `%mesh` magics in any IPython (the Monarch kernel preloads them)."""
    from monarch.extension import load_ipython_extension as load

    load(ip)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
