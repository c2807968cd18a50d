"""Meshes of worker processes and the actors on them: `from monarch.actor import this_host, Actor, endpoint`.
`this_proc()` is this process itself (its actors run on threads here); `MeshFailure` and
`unhandled_fault_hook` are supervision (assign `monarch.actor.unhandled_fault_hook = my_hook` to take over).

class Trainer(Actor):
    @endpoint
    def step(self):
        ...

procs = this_host().spawn_procs({"gpu": 4})
trainers = procs.spawn("trainer", Trainer)
trainers.step.call().get()          # a ValueMesh, one value per actor
"""

from monarch.runtime.actors import ActorEndpoint, ActorMesh, MeshFailure, OneFuture, unhandled_fault_hook
from monarch.runtime.actors.local import LocalProc, context, this_proc
from monarch.runtime.common.actors import Actor, Context, endpoint
from monarch.runtime.common.context import current_rank, current_size
from monarch.runtime.mesh import Extent, HostMesh, MeshTable, ProcMesh, this_host
from monarch.runtime.values import Future, ValueMesh

__all__ = [
    "this_host",
    "this_proc",
    "LocalProc",
    "Extent",
    "HostMesh",
    "ProcMesh",
    "MeshTable",
    "current_rank",
    "current_size",
    "Actor",
    "endpoint",
    "context",
    "Context",
    "ActorMesh",
    "ActorEndpoint",
    "Future",
    "OneFuture",
    "ValueMesh",
    "unhandled_fault_hook",
    "MeshFailure",
]
