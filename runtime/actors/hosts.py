"""Monarch's names for how processes find each other: transports, process identities, and the calls that
start or attach to workers by address. Here workers are forked on this machine or started by a job's host
agents (`monarch.notebook.reserve`), which authenticate every controller with the job's keys; joining a mesh by
address alone (Monarch's `attach_to_workers` with ``ca="trust_all_connections"``) would let anyone who can
reach the port run code there, so those calls say what to use instead."""

from __future__ import annotations

import enum
import itertools
import os
import secrets
from dataclasses import dataclass
from typing import Any

_JOBS = (
    "reserve hosts with `python -m monarch.notebook reserve --hosts N --gpus-per-host M` (or "
    "`monarch.job.SlurmJob`), then attach with `monarch.notebook.job(name).spawn_procs(...)`: the job's host "
    "agents take only controllers that hold its keys"
)


class ChannelTransport(enum.Enum):
    """Monarch's transports; `enable_transport` maps them onto ours (``ipc`` on one machine, TCP with CURVE)."""

    TcpWithLocalhost = "tcp(localhost)"
    TcpWithHostname = "tcp(hostname)"
    MetaTlsWithHostname = "metatls(hostname)"
    MetaTlsWithIpV6 = "metatls(ipv6)"
    Tls = "tls"
    Local = "local"
    Unix = "unix"


_TRANSPORTS = {
    ChannelTransport.Unix: "ipc",
    ChannelTransport.Local: "ipc",
    ChannelTransport.TcpWithLocalhost: "tcp",
    ChannelTransport.TcpWithHostname: "tcp",
}


def enable_transport(transport: ChannelTransport | str) -> None:
    """Choose the transport before the first mesh: ``ChannelTransport.Unix`` (or ``"unix"``: sockets in a private
    directory, the default) or ``ChannelTransport.TcpWithHostname`` (``"tcp"``: TCP, encrypted with ZeroMQ CURVE,
    bound to ``MONARCH_BIND_ADDR``)."""
    from monarch.runtime.common import config
    from monarch.runtime.controller import current

    if isinstance(transport, str):
        by_value = {t.value: t for t in ChannelTransport} | {"tcp": ChannelTransport.TcpWithHostname}
        if transport not in by_value:
            raise ValueError(f"enable_transport({transport!r}): give a ChannelTransport, e.g. ChannelTransport.Unix")
        transport = by_value[transport]
    kind = _TRANSPORTS.get(transport)
    if kind is None:
        raise ValueError(
            f"enable_transport({transport}): TLS certificates are Meta's setup; here every TCP connection is "
            "encrypted and authenticated with ZeroMQ CURVE keys made per mesh: use ChannelTransport.TcpWithHostname"
        )
    if current() is not None:
        if config.settings().transport == kind:
            return
        raise RuntimeError(
            f"enable_transport({transport}) must come before the first mesh is spawned (this controller already "
            f"uses {config.settings().transport!r})"
        )
    config.use_transport(kind)


_uids = itertools.count(1)


@dataclass(frozen=True)
class Uid:
    """A unique identifier (Monarch's `Uid`): ``Uid.instance("label")``, ``Uid.from_string(text)``."""

    value: int
    label: str | None = None

    @staticmethod
    def anonymous() -> Uid:
        return Uid(secrets.randbits(63))

    @staticmethod
    def instance(label: str | None = None) -> Uid:
        return Uid(secrets.randbits(63), label)

    @staticmethod
    def instance_from_value(value: int, label: str | None = None) -> Uid:
        return Uid(value, label)

    @staticmethod
    def from_string(uid: str) -> Uid:
        label, sep, rest = uid.partition("<")
        if not sep or not rest.endswith(">"):
            raise ValueError(f"Uid.from_string({uid!r}): expected 'label<hex>'")
        return Uid(int(rest[:-1], 16), label or None)

    @property
    def is_instance(self) -> bool:
        return True

    @property
    def is_singleton(self) -> bool:
        return False

    @property
    def instance_value(self) -> int | None:
        return self.value

    def __str__(self) -> str:
        return f"{self.label or ''}<{self.value:x}>"


@dataclass(frozen=True)
class ProcId:
    """A process's identity (Monarch's `ProcId`)."""

    uid: Uid

    @staticmethod
    def from_string(proc_id: str) -> ProcId:
        return ProcId(Uid.from_string(proc_id.split("@", 1)[0]))

    @property
    def label(self) -> str | None:
        return self.uid.label

    def __str__(self) -> str:
        return str(self.uid)


def default_bootstrap_cmd() -> Any:
    """Monarch starts remote processes with a bootstrap command; here a job's host agent forks them."""
    raise NotImplementedError(f"default_bootstrap_cmd(): workers are not started by a command here; {_JOBS}")


def hosts_from_config(name: str) -> Any:
    """The hosts a configuration names (Monarch's own is not implemented yet): the environment variable `name`
    holds the name of a reserved job (`python -m monarch.notebook reserve --name NAME`), whose hosts it gives;
    unset, this machine as a host mesh of one host (``{hosts: 1}``), so a program written for a cluster runs on a
    laptop as it is."""
    from monarch.runtime.common.shape import Shape
    from monarch.runtime.mesh import HostMesh

    job = os.environ.get(name, "").strip()
    if not job:
        return HostMesh(Shape(("hosts",), (1,), (0,)))
    from monarch.runtime.slurm.jobs import Job

    return Job(job)


def attach(addr: str) -> None:
    raise NotImplementedError(f"attach({addr!r}): a controller reaches its workers through a job here: {_JOBS}")


def attach_to_workers(*, workers: Any, ca: Any = None, private_key: Any = None, name: str | None = None) -> Any:
    raise NotImplementedError(f"attach_to_workers(...): joining workers by address alone is refused here; {_JOBS}")


def run_worker_loop_forever(*, address: str, ca: Any = None, private_key: Any = None) -> None:
    raise NotImplementedError(
        f"run_worker_loop_forever(address={address!r}): a host serves meshes through a job's host agent here "
        f"(`python -m monarch.runtime.agent --job-dir DIR`, started by the job's srun); {_JOBS}"
    )


run_worker_loop_until_shutdown = run_worker_loop_forever
start_worker_loop_forever = run_worker_loop_forever


def proc_id_of_this_process() -> ProcId:
    """This process's identity."""
    return ProcId(Uid(os.getpid(), "proc"))
