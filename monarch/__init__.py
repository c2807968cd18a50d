"""monarch: a notebook-first environment for distributed PyTorch.

This is the public face; everything is imported lazily, so `import monarch` stays cheap and does
not import torch, zmq or IPython. The implementation lives in `monarch.runtime`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "remote",
    "RemoteError",
    "WorkerDiedError",
    "MeshBusyError",
    "ValueMesh",
    "Future",
    "ProcMesh",
    "current_rank",
    "current_size",
    "Tensor",
    "inspect",
    "show",
    "fetch_shard",
    "grad_generator",
    "Stream",
    "get_active_stream",
    "Simulator",
]

_EXPORTS = {
    "remote": "monarch.runtime.remote",
    "ValueMesh": "monarch.runtime.remote",
    "Future": "monarch.runtime.remote",
    "RemoteError": "monarch.runtime.errors",
    "WorkerDiedError": "monarch.runtime.errors",
    "MeshBusyError": "monarch.runtime.errors",
    "ProcMesh": "monarch.runtime.mesh",
    "current_rank": "monarch.runtime.context",
    "current_size": "monarch.runtime.context",
    "Tensor": "monarch.runtime.tensor.handles",
    "inspect": "monarch.runtime.tensor.values",
    "fetch_shard": "monarch.runtime.tensor.values",
    "grad_generator": "monarch.runtime.tensor.comms",
    "Stream": "monarch.runtime.tensor.streams",
    "get_active_stream": "monarch.runtime.tensor.streams",
    "show": "monarch.extension.show",
    "Simulator": "monarch.simulator",
}

if TYPE_CHECKING:
    from monarch.runtime.context import current_rank, current_size
    from monarch.runtime.errors import MeshBusyError, RemoteError, WorkerDiedError
    from monarch.runtime.mesh import ProcMesh
    from monarch.runtime.remote import Future, ValueMesh, remote


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
