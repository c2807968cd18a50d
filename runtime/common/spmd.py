"""`SPMDActor`: Monarch's actor that runs a script written for torchrun on every process of a mesh.

    actors = procs.spawn("_SPMDActor", SPMDActor)
    first = dict.fromkeys(procs._labels, 0)
    addr, port = actors.slice(**first).get_host_port.call_one(None).get()
    actors.main.call(addr, port, ["train.py", "--lr", "0.1"]).get()     # or ["-m", "pkg.train", ...]

Each actor learns its place when it is made (the spawn's view of the mesh, as Monarch's does): RANK is its
rank in the view, LOCAL_RANK its coordinate in the view's last dimension (the "gpus" of ``{"hosts": 2,
"gpus": 8}``), LOCAL_WORLD_SIZE that dimension's size, GROUP_RANK the host's index (RANK // LOCAL_WORLD_SIZE).

The class lives here, in the layer both sides share, because the controller imports it to spawn it and a
worker unpickles it: neither may import the other's code. Its endpoints only ever run on a worker, where they
reach the worker's half (`monarch.runtime.worker.spmd`: the address, the handing over of the worker's own
process groups, running the script) by name.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from monarch.runtime.common import context
from monarch.runtime.common.actors import Actor, endpoint

WORKER = "monarch.runtime.worker.spmd"
"""The worker's half, named (imported on the worker by the endpoints, never by the controller)."""


def _worker() -> Any:
    return importlib.import_module(WORKER)


def rank_in(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """A point's rank in a view: its coordinates, row-major (the last dimension varies fastest)."""
    rank = 0
    for dim, size in sizes.items():
        rank = rank * size + coords[dim]
    return rank


class SPMDActor(Actor):
    """Runs a script written for torchrun on each process of the mesh it is spawned on (Monarch's
    `monarch.spmd.SPMDActor`): `get_host_port` picks the rendezvous on one process, `main` sets torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
    ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT) and runs the script as ``python script.py args`` or
    ``python -m module args`` would (``__name__ == "__main__"``, `sys.argv`), in the process itself. `setup_env`
    sets the environment alone, for an actor's own code that calls `init_process_group()`.

    The process's own process groups are handed over first (torch allows one default group): the script's
    `init_process_group()` makes its own, as under torchrun. A group the script leaves behind is destroyed when
    the script returns (or, if it failed, before the next run), so `main` runs again on the same processes.
    `SystemExit(0)` (or `sys.exit()`) is success; another status fails the call."""

    def __init__(self) -> None:
        super().__init__()
        coords, sizes = dict(context.current_rank()), dict(context.current_size())
        last = list(sizes)[-1] if sizes else None
        self.rank: int = rank_in(coords, sizes)
        self.world_size: int = math.prod(sizes.values())
        self.local_rank: int = coords[last] if last is not None else 0
        self.nproc_per_node: int = sizes[last] if last is not None else 1
        self.local_world_size: int = self.nproc_per_node
        self.group_rank: int = self.rank // self.local_world_size
        self.group_world_size: int = -(-self.world_size // self.local_world_size)

    def _env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """torchrun's variables for this process, with the rendezvous at `master_addr`:`master_port`."""
        if not isinstance(master_addr, str) or not master_addr:
            raise ValueError(f"master_addr must be a host name or address (a non-empty str), got {master_addr!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"master_port must be a port number (an int in 1..65535), got {master_port!r}")
        return {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": "rank",
            "WORLD_SIZE": str(self.world_size),
        }

    def _setup_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        return _worker().set_env(self._env(master_addr, master_port))

    @endpoint
    def get_host_port(self, use_ipaddr: Any = None) -> tuple[str, int]:
        """(address, free port) on this process's host for the rendezvous. `use_ipaddr` None: the address of
        the interface the mesh's process groups use (loopback for a mesh on one machine), which every host of
        the mesh reaches; Monarch's `AddrType` (or "Default", "IPv4", "IPv6"): this host's name resolved to
        such an address, as Monarch does."""
        return _worker().host_port(use_ipaddr)

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """Set torchrun's environment variables in this process and hand its own process groups over, so that
        code calling `init_process_group()` afterwards makes its group from the environment. Returns the
        variables set."""
        return self._setup_env(master_addr, master_port)

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Set torchrun's environment and run the script: `script_args` is ``[path, *args]`` or ``["-m",
        module, *args]``, as after torchrun's own options. True when the script ends (or exits with status 0);
        its exception (or a non-zero exit status) fails the call on this rank."""
        worker = _worker()
        script_args = worker.check_script_args(script_args)
        self._setup_env(master_addr, master_port)
        try:
            worker.run_script(script_args)
        except BaseException as e:
            raise worker.script_error(e)  # noqa: B904 (the script's error, from the script's own frame on)
        return True
