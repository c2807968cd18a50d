"""Names of Monarch's `monarch.job` that need what this project does not have (a telemetry sidecar, a mesh admin
agent, Monarch's own channels, Kubernetes, Meta's MAST): each raises `NotImplementedError` when used, naming
what to use here instead. They exist so that code written for Monarch imports, and fails where it would need them.

This module imports nothing of the controller's (`PortForwarder` is an actor class, which a worker unpickles).
"""

from __future__ import annotations

from typing import Any

from monarch.runtime.common.actors import Actor


def _refuse(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not available in this monarch: {instead}")


class TelemetryConfig:
    """Monarch's telemetry sidecar's configuration (`job.enable_telemetry`): not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "Monarch's telemetry sidecar (TelemetryConfig, job.enable_telemetry)",
            "use monarch.profiler for traces, mesh.to_table() for each worker's state and memory, mesh.stacks() "
            "for where every rank is",
        )


class MeshAdminConfig:
    """Monarch's mesh admin agent's configuration (`job.enable_admin`): not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "Monarch's mesh admin agent (MeshAdminConfig, job.enable_admin)",
            "use mesh.to_table() and mesh.busy() for what each worker runs, mesh.stacks() for where, and "
            "`monarch debug` to attach to ranks stopped in pdb",
        )


class PortForwarder(Actor):
    """Monarch's actor forwarding TCP ports between meshes over its own channels: not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(
            "PortForwarder (TCP forwarding over Monarch's channels)",
            "processes here reach each other's ports directly (on a Slurm job, over the interface its agents use: "
            "SlurmJob(..., interface=NAME)); connect to the host and port an actor returns",
        )


def shell(host_mesh_singleton: Any, *, env: dict[str, str] | None = None, workdir: str | None = None) -> int:
    """Monarch's interactive shell on a host: not here."""
    raise _refuse(
        "monarch.job.shell (an interactive terminal on a host)",
        "run commands with monarch.job.exec_command(host_mesh, ['bash', '-c', '...']), or Python with %%mesh "
        "cells; on a Slurm job, `srun --jobid ID --pty bash` opens a shell on its hosts",
    )


class KubernetesJob:
    """Monarch's job on Kubernetes: not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("KubernetesJob", "use monarch.job.SlurmJob (a Slurm cluster) or LocalJob (this machine)")


class ImageSpec:
    """A Kubernetes pod image (Monarch's `monarch.job.kubernetes.ImageSpec`): not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("monarch.job.kubernetes.ImageSpec", "use monarch.job.SlurmJob or LocalJob")


class KubeConfig:
    """A Kubernetes cluster's configuration (Monarch's `monarch.job.kubernetes.KubeConfig`): not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("monarch.job.kubernetes.KubeConfig", "use monarch.job.SlurmJob or LocalJob")


class MASTJob:
    """A job on Meta's MAST scheduler: not here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("MASTJob (Meta's internal scheduler)", "use monarch.job.SlurmJob or LocalJob")
