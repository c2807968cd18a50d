"""torchrun's environment on a worker (`monarch.spmd.setup_torch_elastic_env`): where the rendezvous is, and
this process's rank in the mesh view, so that code written for torchrun (`init_process_group()` from the
environment) runs here; the worker's own process groups are handed over to it."""

from __future__ import annotations

import math
import os
import socket

from monarch.runtime.common import context
from monarch.runtime.common.net import interface_addr
from monarch.runtime.worker import groups


def rendezvous_point(port: int | None) -> tuple[str, int]:
    """(address, port) for a rendezvous on this worker's host: the interface its process groups use (the
    host agent's, `GLOO_SOCKET_IFNAME`), else loopback (a mesh on this one machine); a free port unless given."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    addr = (interface_addr(interface) if interface else None) or "127.0.0.1"
    if port is None:
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    return addr, port


def set_elastic_env(addr: str, port: int) -> dict[str, str]:
    """Set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (this worker's place in the view it was called on;
    LOCAL_RANK and LOCAL_WORLD_SIZE are already set) and release the worker's own groups, so that the next
    `init_process_group()` here makes the default group from this environment."""
    coords, sizes = context.current_rank(), context.current_size()
    rank = 0
    for dim, size in sizes.items():
        rank = rank * size + coords[dim]
    env = {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(math.prod(sizes.values())),
    }
    os.environ.update(env)
    if groups.current is not None:
        groups.current.hand_over()
    return env
