"""Jobs: hosts reserved through Slurm, whose agents outlive the kernels that use them.

`reserve` submits a batch job that starts one host agent per node (`srun`) and waits until every agent has
written itself down in the job's directory; `Job.spawn_procs` attaches this process's controller to the
agents (once) and starts a mesh on them; `cleanup` cancels the job. A later process (a restarted kernel)
finds the job by name and attaches again: the agents are the same, the workers are new.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from monarch.runtime.mesh import ProcMesh
from monarch.runtime.procs.jobfiles import JobDir, jobs_root
from monarch.runtime.remote import RemoteFunction
from monarch.runtime.slurm import commands as slurm

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class JobMesh(ProcMesh):
    """A mesh on a job's hosts: a `ProcMesh` whose workspace (if the job was reserved with one) can be synced."""

    def sync_workspace(self) -> dict[str, list[str]]:
        """Copy the job's workspace to its hosts again (only changed files travel) and reload, on this view's
        workers, the modules whose files changed. Returns host -> files changed."""
        backend = self.spawned.backend
        directory = getattr(backend, "workspace", None)
        if not directory:
            raise ValueError(
                f"mesh {self.describe()} has no workspace to sync: its job was reserved without --workspace"
            )
        changed = backend.sync_workspace(directory)
        files = sorted({p for paths in changed.values() for p in paths})
        if files:
            RemoteFunction.by_name("monarch.runtime.worker.workspace", "reload", self)(files)
        return changed


class Job:
    """A reserved job (`monarch.notebook.job(name)`)."""

    def __init__(self, name: str) -> None:
        self.dir = JobDir.named(name)
        if not (self.dir.path / "job.json").exists():
            known = ", ".join(j["name"] for j in list_jobs()) or "none"
            raise ValueError(
                f"no job named {name!r} (jobs: {known}); reserve one with "
                "python -m monarch.notebook reserve --hosts N --name NAME"
            )
        self.meta = self.dir.meta()

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def hosts(self) -> int:
        return int(self.meta["hosts"])

    @property
    def extent(self) -> dict[str, int]:
        """The job's shape as a host mesh: ``{"host": N}`` (Monarch's `HostMesh.extent`)."""
        return {"host": self.hosts}

    def state(self) -> slurm.JobState:
        return slurm.state(self.meta["slurm_id"])

    def spawn_procs(self, per_host: dict[str, int] | None = None) -> ProcMesh:
        """A mesh on the job's hosts: dimensions ``{"host": N, **per_host}`` (e.g. ``{"gpu": 8}``), one
        worker per point, each host's workers started by its agent."""
        from monarch.runtime.controller import get_controller

        per_host = {"gpu": 1} if per_host is None else dict(per_host)
        if "host" in per_host:
            raise ValueError(f"per_host is the shape on each host; 'host' is the job's own dimension: {per_host}")
        agents = self.dir.agents()
        if len(agents) < self.hosts:
            st = self.state()
            raise RuntimeError(
                f"job {self.name}: {len(agents)} of {self.hosts} hosts' agents are up; the Slurm job "
                f"{self.meta['slurm_id']} {st.words()}"
            )
        controller = get_controller()
        backend = controller.attach(self.dir, agents[: self.hosts], lambda: why_ended(self.dir))
        workspace = self.meta.get("workspace")
        if workspace:
            backend.workspace = workspace
            backend.sync_workspace(workspace)  # the workers start with the code as it is now
            if workspace not in sys.path:
                sys.path.insert(0, workspace)  # (functions of its modules travel by reference)
        spawned = controller.spawn({"host": self.hosts, **per_host}, backend)
        return JobMesh(spawned, spawned.shape)

    def cleanup(self) -> None:
        cleanup(self.name)

    def __repr__(self) -> str:
        return f"<Job {self.name}: {self.hosts} hosts, Slurm job {self.meta.get('slurm_id')}>"


def why_ended(job: JobDir) -> str:
    """'Slurm job 12 was cancelled' when the job's Slurm job has ended (a host's agent goes with it),
    waiting a moment for Slurm to say so; "" when it still runs (or there is no Slurm job)."""
    try:
        slurm_id = job.meta().get("slurm_id")
    except (OSError, ValueError):
        return ""
    if not slurm_id:
        return ""
    deadline = time.monotonic() + 1.5
    while True:
        try:
            st = slurm.state(slurm_id)
        except (OSError, subprocess.SubprocessError):
            return ""
        if st.terminal:
            return f"Slurm job {slurm_id} {st.words()}"
        if st.state not in ("COMPLETING", "RUNNING") or time.monotonic() > deadline:
            return ""
        time.sleep(0.1)


def list_jobs() -> list[dict[str, Any]]:
    """Every job recorded here, with its Slurm state."""
    root = jobs_root()
    out = []
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        try:
            meta = JobDir(path).meta()
        except (OSError, ValueError):
            continue
        st = slurm.state(meta["slurm_id"]) if meta.get("slurm_id") and shutil.which("squeue") else None
        out.append(
            {
                "name": path.name,
                "slurm_id": meta.get("slurm_id"),
                "hosts": meta.get("hosts"),
                "gpus_per_host": meta.get("gpus_per_host"),
                "state": st.state if st else "UNKNOWN",
                "reason": st.reason if st else "",
                "agents_up": len(JobDir(path).agents()),
                "workspace": meta.get("workspace"),
            }
        )
    return out


def cleanup(name: str) -> None:
    """Cancel the job (`scancel`; its agents kill their workers) and forget it."""
    jd = JobDir.named(name)
    if not (jd.path / "job.json").exists():
        raise ValueError(f"no job named {name!r}")
    from monarch.runtime import controller as ctl

    c = ctl.current()
    if c is not None:
        c.detach(name)
    slurm_id = jd.meta().get("slurm_id")
    if slurm_id:
        slurm.require()
        slurm.cancel(slurm_id)
    shutil.rmtree(jd.path, ignore_errors=True)


def reserve(
    hosts: int,
    gpus_per_host: int = 0,
    name: str | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    workspace: str | None = None,
    timeout: float | None = None,
    echo: Callable[[str], None] | None = None,
    interface: str | None = None,
    sbatch: Sequence[str] = (),
) -> Job:
    """Submit a job of `hosts` nodes, one agent each; wait (with no limit unless `timeout`) until every agent
    is up, saying what the queue does meanwhile; Ctrl-C cancels the request. `interface`: the network
    interface every agent listens on and gives its workers' gloo/NCCL (default: each host's first one up
    that is not loopback). `sbatch`: more options for the batch script, one ``#SBATCH`` line each (e.g.
    ``["--exclusive", "--mem=64G"]``)."""
    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
    if not isinstance(gpus_per_host, int) or gpus_per_host < 0:
        raise ValueError(f"gpus_per_host must be an integer >= 0, got {gpus_per_host!r}")
    bad = [o for o in sbatch if not isinstance(o, str) or not o.startswith("-") or not o.isprintable()]
    if isinstance(sbatch, str) or bad:
        raise ValueError(f"sbatch options must be a list of options such as '--mem=64G', got {sbatch!r}")
    name = name or f"monarch-{os.urandom(3).hex()}"
    if not _NAME.match(name):
        raise ValueError(
            f"job name {name!r}: use letters, digits, '_', '.', '-' (at most 64, not starting with a sign)"
        )
    slurm.require()
    part, nodes, has_gpus = slurm.partition(partition)
    if hosts > nodes:
        raise ValueError(f"hosts={hosts}: partition {part} has {nodes} node{'s' if nodes != 1 else ''}")
    if workspace is not None and not os.path.isdir(workspace):
        raise ValueError(f"workspace {workspace!r} is not a directory")
    jd = JobDir.named(name)
    meta = {
        "name": name, "hosts": hosts, "gpus_per_host": gpus_per_host, "partition": part, "time": time_limit,
        "interface": interface, "sbatch": list(sbatch),
        "workspace": os.path.abspath(workspace) if workspace else None, "python": sys.executable,
        "created": time.time(), "slurm_id": None,
    }  # fmt: skip
    try:
        jd.create(meta)
    except FileExistsError:
        raise ValueError(f"a job named {name!r} exists; cleanup({name!r}) it or choose another name") from None
    try:
        if gpus_per_host and not has_gpus:
            echo(f"monarch: partition {part} has no GPUs: the workers will use the CPU")
        script = jd.path / "job.sbatch"
        script.write_text(_script(jd, meta, gpus_per_host if has_gpus else 0))
        meta["slurm_id"] = slurm.submit(str(script))
        jd.write_meta(meta)
        _wait_for_agents(jd, meta, timeout, echo)
    except BaseException:
        if meta["slurm_id"]:
            try:
                slurm.cancel(meta["slurm_id"])
            except slurm.SlurmError:
                pass
        shutil.rmtree(jd.path, ignore_errors=True)
        raise
    return Job(name)


def _script(jd: JobDir, meta: dict, gpus: int) -> str:
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=monarch-{meta['name']}",
        f"#SBATCH --nodes={meta['hosts']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={jd.path}/slurm-%j.out",
    ]
    if meta["partition"]:
        lines.append(f"#SBATCH --partition={meta['partition']}")
    if meta["time"]:
        lines.append(f"#SBATCH --time={meta['time']}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += [f"#SBATCH {option}" for option in meta.get("sbatch") or ()]
    agent = [sys.executable, "-m", "monarch.runtime.agent", "--job-dir", str(jd.path)]
    if meta["workspace"]:
        agent += ["--workspace", "auto"]
    if meta.get("interface"):
        agent += ["--interface", meta["interface"]]
    lines.append(f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {' '.join(q(a) for a in agent)}")
    return "\n".join(lines) + "\n"


def _wait_for_agents(jd: JobDir, meta: dict, timeout: float | None, echo: Callable[[str], None]) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    while True:
        up = len(jd.agents())
        if up >= meta["hosts"]:
            hosts = ", ".join(a.host for a in jd.agents())
            echo(f"monarch: job {meta['name']} is up: {up} hosts ({hosts}), Slurm job {meta['slurm_id']}")
            return
        st = slurm.state(meta["slurm_id"])
        if st.terminal:
            log = _log_tail(jd, meta["slurm_id"])
            raise slurm.SlurmError(
                f"job {meta['name']} (Slurm {meta['slurm_id']}) {st.words()} before its agents were up{log}"
            )
        line = f"monarch: job {meta['name']} (Slurm {meta['slurm_id']}) {st.words()}; {up}/{meta['hosts']} hosts up"
        if line != said:
            echo(line)
            said = line
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {meta['name']}: not up after {timeout:.0f} s ({line.split(': ', 1)[1]})")
        time.sleep(0.2)


def _log_tail(jd: JobDir, slurm_id: str) -> str:
    path = jd.path / f"slurm-{slurm_id}.out"
    try:
        text = path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""
    return f"; its output ends:\n{text}" if text.strip() else ""
