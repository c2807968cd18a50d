"""`monarch.spmd.setup_torch_elastic_env`: run code written for torchrun on a mesh's processes (or actors).

    setup_torch_elastic_env(trainers)            # an actor mesh, or a ProcMesh view
    trainers.train.call().get()                  # inside: dist.init_process_group() from the environment

Monarch's TorchTitan notebook does this: a trainer actor whose code calls `init_process_group()` as under
torchrun. Each process gets MASTER_ADDR and MASTER_PORT (a free port on the first process's host, on the
interface its process groups use), RANK and WORLD_SIZE (its place in the view); LOCAL_RANK and LOCAL_WORLD_SIZE
are already set. The processes' own default group is given up first (torch allows one), so that code's
`init_process_group()` makes the new one; the mesh's own groups then say so if used.
"""

from __future__ import annotations

from typing import Any

from monarch.runtime.actors import ActorMesh, _point
from monarch.runtime.mesh import ProcMesh

WORKER = "monarch.runtime.worker.spmd"


def setup_torch_elastic_env(mesh: ProcMesh | ActorMesh, master_port: int | None = None) -> list[dict[str, Any]]:
    """Give every process of `mesh` torchrun's environment (see the module); returns what each one got."""
    from monarch.runtime.remote import RemoteFunction

    procs = mesh.procs if isinstance(mesh, ActorMesh) else mesh
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"setup_torch_elastic_env() needs a ProcMesh or an actor mesh, got {type(mesh).__name__}")
    first = RemoteFunction.by_name(WORKER, "rendezvous_point", _point(procs, 0))
    (addr, port) = first.start((master_port,), {}, name="setup_torch_elastic_env").result().values()[0]
    got = RemoteFunction.by_name(WORKER, "set_elastic_env", procs).start(
        (addr, port), {}, name="setup_torch_elastic_env"
    )
    return got.result().values()
