"""Meshes of worker processes and the actors on them: `from monarch.actor import this_host, Actor, endpoint`.
`this_proc()` is this process itself (its actors run on threads here); `MeshFailure` and
`unhandled_fault_hook` are supervision (assign `monarch.actor.unhandled_fault_hook = my_hook` to take over).
Every name of Meta Monarch's `monarch.actor` is here (docs/features/actors.md says which ones point elsewhere).

class Trainer(Actor):
    @endpoint
    def step(self):
        ...

procs = this_host().spawn_procs({"gpu": 4})
trainers = procs.spawn("trainer", Trainer)
trainers.step.call().get()          # a ValueMesh, one value per actor
"""

from monarch.runtime.actors import ActorEndpoint, ActorMesh, MeshFailure, OneFuture, unhandled_fault_hook
from monarch.runtime.actors import config as config
from monarch.runtime.actors.hosts import (
    ChannelTransport,
    ProcId,
    Uid,
    attach,
    attach_to_workers,
    default_bootstrap_cmd,
    enable_transport,
    hosts_from_config,
    run_worker_loop_forever,
    run_worker_loop_until_shutdown,
    start_worker_loop_forever,
)
from monarch.runtime.actors.local import LocalProc, context, current_rank, current_size, this_proc
from monarch.runtime.actors.singletons import (
    debug_controller,
    get_or_spawn_controller,
    returns_future,
    shutdown_context,
)
from monarch.runtime.common.actors import Actor, ActorError, Context, concurrent_endpoint, current_actor_name, endpoint
from monarch.runtime.common.endpoint import Accumulator, Endpoint, as_endpoint, send
from monarch.runtime.common.mesh_trait import Extent, Point
from monarch.runtime.common.ports import Channel, Port, PortReceiver
from monarch.runtime.common.telemetry import get_meter, span, traced
from monarch.runtime.mesh import HostMesh, MeshTable, ProcMesh, this_host
from monarch.runtime.values import Future, ValueMesh

__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "current_actor_name",
    "as_endpoint",
    "current_rank",
    "current_size",
    "concurrent_endpoint",
    "endpoint",
    "Future",
    "returns_future",
    "Point",
    "ProcMesh",
    "ProcId",
    "Channel",
    "send",
    "shutdown_context",
    "ValueMesh",
    "debug_controller",
    "get_or_spawn_controller",
    "this_host",
    "this_proc",
    "default_bootstrap_cmd",
    "HostMesh",
    "context",
    "hosts_from_config",
    "Port",
    "PortReceiver",
    "Endpoint",
    "Extent",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "start_worker_loop_forever",
    "attach_to_workers",
    "attach",
    "enable_transport",
    "Context",
    "ChannelTransport",
    "unhandled_fault_hook",
    "MeshFailure",
    "config",
    "get_meter",
    "span",
    "traced",
    "Uid",
    # monarch's own, beside Monarch's
    "LocalProc",
    "MeshTable",
    "ActorMesh",
    "ActorEndpoint",
    "OneFuture",
]
