"""`monarch.spmd`: code written for torchrun, on a mesh's processes (Monarch's names and semantics).

    actors = procs.spawn("_SPMDActor", SPMDActor)                  # Monarch's spmd_ddp example, as is
    first = dict.fromkeys(procs._labels, 0)
    addr, port = actors.slice(**first).get_host_port.call_one(None).get()
    actors.main.call(addr, port, ["train.py"]).get()               # the script on every process

    setup_torch_elastic_env(procs)        # only the environment: an actor's own code calls init_process_group()

`SPMDActor` lives in `common/spmd.py` (both sides load it), its worker half in `worker/spmd.py`. Each process's
own process groups are handed over to the script (torch allows one default group), so the mesh's own groups
(`mesh.process_group`, the tensor engine's reduces) then say so if used.
"""

from __future__ import annotations

import asyncio
from typing import Any

from monarch.runtime.actors import ActorMesh
from monarch.runtime.common.spmd import SPMDActor
from monarch.runtime.mesh import ProcMesh

ENV_ACTOR = "_SPMDActor(setup_torch_elastic_env)"
"""The name `setup_torch_elastic_env` spawns its SPMDActor under, for as long as it runs (not Monarch's
"_SPMDActor": a process holds one actor per name, and the user's own may already be there)."""


def _procs(mesh: Any, what: str) -> ProcMesh:
    procs = mesh.procs if isinstance(mesh, ActorMesh) else mesh
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"{what}() needs a ProcMesh (or an actor mesh), got {type(mesh).__name__}: {mesh!r}")
    return procs


def _check_master(master_addr: Any, master_port: Any) -> None:
    if (master_addr is None) != (master_port is None):
        raise ValueError(
            f"master_addr={master_addr!r}, master_port={master_port!r}: give both (the rendezvous you chose) or "
            "neither (the first process's host picks a free port)"
        )


def first_point(procs: ProcMesh) -> dict[str, int]:
    """The coordinates of `procs`'s first point (every dimension 0), as Monarch's examples slice to it."""
    return dict.fromkeys(procs.names, 0)


def setup_torch_elastic_env(
    proc_mesh: ProcMesh | ActorMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: Any = None,
) -> list[dict[str, str]]:
    """Give every process of `proc_mesh` torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...:
    `SPMDActor.setup_env`) and hand its own process groups over, so code in its actors calls
    `init_process_group()` as under torchrun. Without `master_addr`/`master_port` the first process's host gives
    its address and a free port (`use_ipaddr`: see `SPMDActor.get_host_port`). Returns each process's variables
    (Monarch's returns None)."""
    procs = _procs(proc_mesh, "setup_torch_elastic_env")
    _check_master(master_addr, master_port)
    actors = procs.spawn(ENV_ACTOR, SPMDActor)
    try:
        if master_addr is None:
            master_addr, master_port = actors.slice(**first_point(procs)).get_host_port.call_one(use_ipaddr).get()
        return actors.setup_env.call(master_addr, master_port).get().values()
    finally:
        actors.stop()


async def setup_torch_elastic_env_async(
    proc_mesh: ProcMesh | ActorMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: Any = None,
) -> list[dict[str, str]]:
    """`setup_torch_elastic_env`, awaited: ``await setup_torch_elastic_env_async(procs)``."""
    procs = _procs(proc_mesh, "setup_torch_elastic_env_async")
    _check_master(master_addr, master_port)
    actors = await asyncio.to_thread(procs.spawn, ENV_ACTOR, SPMDActor)  # (the spawn waits: not on the loop)
    try:
        if master_addr is None:
            master_addr, master_port = await actors.slice(**first_point(procs)).get_host_port.call_one(use_ipaddr)
        got = await actors.setup_env.call(master_addr, master_port)
        return got.values()
    finally:
        await asyncio.to_thread(actors.stop)


def run_spmd(procs: ProcMesh, script_args: list[str], use_ipaddr: Any = None) -> None:
    """Run a torchrun script on every process of `procs`, as Monarch's `SPMDJob.run_spmd` does: an SPMDActor
    per process, the rendezvous on the first one, `main` on all (a failure raises `RemoteError`)."""
    actors = procs.spawn("_SPMDActor", SPMDActor)
    try:
        addr, port = actors.slice(**first_point(procs)).get_host_port.call_one(use_ipaddr).get()
        actors.main.call(addr, port, list(script_args)).get()
    finally:
        if procs.state == "running":
            actors.stop()
