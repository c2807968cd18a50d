"""`monarch.job.spmd`: a job from a torchrun command line (Monarch's `serve` and `SPMDJob`), served by this
project's backends, no second launcher:

    job = serve(["torchrun", "--nproc-per-node=4", "--standalone", "train.py"], scheduler="local_cwd")
    job.run_spmd()                                  # train.py on 4 local workers, as torchrun would run it
    job = job_load(".monarch/job_state.pkl")        # later, another process: the same hosts
    job.run_spmd()

`scheduler="local_cwd"` serves it on this machine (`LocalJob`), `"slurm"` on a reservation of ``--nnodes``
hosts (`SlurmJob`; `scheduler_cfg` takes its options). Each `run_spmd()` spawns fresh workers on the job's hosts
(``{"gpus": nproc_per_node}`` per host), runs the script on them through `SPMDActor`, and stops them, as
torchrun starts fresh processes per run: an edited script (or module it imports) runs as edited.

A torchx `AppDef` is taken too when torchx is installed (its one role's args are the torchrun command, its
`num_replicas` the hosts); a plain command list can ask for several hosts with ``--nnodes=N`` on Slurm.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from monarch.runtime.actors.spmd import run_spmd
from monarch.runtime.job.job import DEFAULT_JOB_PATH, JobState, JobTrait, LocalJob, job_load
from monarch.runtime.job.slurm import SlurmJob

SCHEDULERS = ("local_cwd", "slurm")
"""What `serve(scheduler=...)` takes here."""
MESH = "workers"
"""The name of an SPMD job's host mesh (Monarch's: ``job.state().workers``)."""
SLURM_CFG = {
    "partition": "partition",
    "time": "time_limit",
    "job_name": "job_name",
    "gpus_per_node": "gpus_per_node",
    "exclusive": "exclusive",
    "slurm_args": "slurm_args",
    "cpus_per_task": "cpus_per_task",
    "mem": "mem",
    "account": "account",
    "qos": "qos",
    "job_start_timeout": "job_start_timeout",
    "interface": "interface",
    "workspace": "workspace",
}
"""`scheduler_cfg` keys for Slurm -> `SlurmJob`'s argument ("time" is torchx's name for the time limit)."""


@dataclass(frozen=True)
class TorchrunCommand:
    """What runs where, from a torchrun command line."""

    script_args: list[str]
    """``[script, *args]`` or ``["-m", module, *args]``: what `SPMDActor.main` takes."""
    nproc_per_node: int
    """Processes per host (``--nproc-per-node``)."""
    nnodes: int
    """Hosts (``--nnodes``)."""


_VALUED = (
    "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "max-restarts", "monitor-interval", "start-method",
    "event-log-handler", "role", "log-dir", "local-ranks-filter", "duplicate-stdout-filters",
    "duplicate-stderr-filters", "node-rank", "master-addr", "master-port", "local-addr", "logs-specs",
    "numa-binding", "signals-to-handle", "shutdown-timeout",
)  # fmt: skip
"""torchrun's options that take a value and mean nothing here (the rendezvous, restarts, logs: ours)."""
_FLAGS = ("standalone", "run-path", "virtual-local-rank")
"""torchrun's flags that mean nothing here."""


def _parser() -> argparse.ArgumentParser:
    """torchrun's command line (torch/distributed/run.py's options, each also with underscores)."""
    p = argparse.ArgumentParser(prog="torchrun", add_help=False, allow_abbrev=False)
    both = lambda name: (f"--{name}", f"--{name.replace('-', '_')}")  # noqa: E731
    p.add_argument("--nnodes", default="1:1")
    p.add_argument(*both("nproc-per-node"), default="1")
    for name in _VALUED:
        p.add_argument(*both(name))
    p.add_argument("-r", *both("redirects"))
    p.add_argument("-t", "--tee")
    for name in _FLAGS:
        p.add_argument(*both(name), action="store_true")
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument(*both("no-python"), action="store_true")
    p.add_argument("training_script", nargs="?")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _is_python(word: str) -> bool:
    base = os.path.basename(word)
    return word == sys.executable or base in ("python", "python3") or base.startswith("python3.")


def parse_torchrun(command: list[str]) -> TorchrunCommand:
    """A torchrun command line, as Monarch reads it: ``torchrun [options] script|-m module [args]``, ``python
    -m torch.distributed.run ...`` (or ``-m torchrun``), or ``python script.py ...`` (one process)."""
    if isinstance(command, str) or not isinstance(command, (list, tuple)) or not command:
        raise ValueError(f"give the command as a non-empty list of strings, got {command!r}")
    if not all(isinstance(word, str) for word in command):
        raise ValueError(f"the command must be strings only, got {command!r}")
    words = list(command)
    if os.path.basename(words[0]) in ("torchrun", "torch.distributed.run"):
        rest = words[1:]
    elif _is_python(words[0]) and words[1:3] in (["-m", "torch.distributed.run"], ["-m", "torchrun"]):
        rest = words[3:]
    elif _is_python(words[0]):
        if len(words) < 2 or words[1:] == ["-m"]:
            raise ValueError(f"{command!r}: no script or module after {words[0]!r}")
        return TorchrunCommand(words[1:], 1, 1)
    else:
        raise ValueError(
            f"{command!r}: expected a torchrun command (torchrun ..., python -m torch.distributed.run ..., or "
            f"python script.py ...), got {words[0]!r} first"
        )
    args, unknown = _parser().parse_known_args(rest)
    if unknown:
        raise ValueError(f"{command!r}: torchrun has no option {unknown[0]!r}")
    if args.no_python:
        raise ValueError(
            f"{command!r}: --no-python runs an executable, not Python; here the script runs inside each worker "
            "process (SPMDActor), so it must be Python: give the .py file or -m module"
        )
    if not args.training_script:
        raise ValueError(f"{command!r}: no training script (give its path, or -m and a module, after the options)")
    script_args = (["-m"] if args.module else []) + [args.training_script, *args.training_script_args]
    return TorchrunCommand(script_args, _nproc(args.nproc_per_node, command), _nnodes(args.nnodes, command))


def _nproc(value: str, command: Any) -> int:
    """``--nproc-per-node``: a number, or torchrun's ``gpu``, ``cpu``, ``auto``."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value in ("gpu", "auto", "cpu"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if value == "gpu" and not gpus:
            raise ValueError(f"{command!r}: --nproc-per-node=gpu, but this machine has no GPU")
        return gpus if value != "cpu" and gpus else os.cpu_count() or 1
    raise ValueError(f"{command!r}: --nproc-per-node={value!r}: give a number >= 1, or gpu, cpu, auto")


def _nnodes(value: str, command: Any) -> int:
    """``--nnodes``: ``N`` or ``N:N`` (elastic ranges are not served)."""
    low, _, high = value.partition(":")
    if low.isdigit() and int(low) > 0 and (not high or high == low):
        return int(low)
    raise ValueError(
        f"{command!r}: --nnodes={value!r}: give a fixed number of hosts (N, or N:N); an elastic range is not served"
    )


def _from_appdef(appdef: Any) -> tuple[TorchrunCommand, str | None]:
    """(the command, the workspace) of a torchx AppDef's one role."""
    try:
        from torchx.specs import AppDef  # type: ignore[import-not-found]
    except ImportError:
        raise TypeError(
            f"serve() got a {type(appdef).__name__}; without torchx (not installed here) it takes the torchrun "
            "command as a list of strings, e.g. ['torchrun', '--nnodes=2', '--nproc-per-node=8', 'train.py'] with "
            "scheduler='slurm' for 2 hosts"
        ) from None
    if not isinstance(appdef, AppDef):
        raise TypeError(f"serve() takes a torchrun command (a list of strings) or a torchx AppDef, got {appdef!r}")
    if len(appdef.roles) != 1:
        raise ValueError(f"AppDef {appdef.name!r} has {len(appdef.roles)} roles; an SPMD job has one")
    role = appdef.roles[0]
    words = list(role.args)
    if os.path.basename(role.entrypoint) in ("torchrun", "torch.distributed.run") or _is_python(role.entrypoint):
        words = [role.entrypoint, *words]
    cmd = parse_torchrun(words)
    workspace = None
    if role.workspace is not None and getattr(role.workspace, "projects", None):
        workspace = next(iter(role.workspace.projects))
    return TorchrunCommand(cmd.script_args, cmd.nproc_per_node, role.num_replicas), workspace


def _hosts_job(scheduler: str, cfg: dict[str, Any], nnodes: int, workspace: str | None) -> JobTrait:
    """The job that holds an SPMD job's hosts: `LocalJob` or `SlurmJob`, its one host mesh named `MESH`."""
    if scheduler not in SCHEDULERS:
        raise ValueError(
            f"scheduler={scheduler!r}: here an SPMD job runs on this machine ('local_cwd') or on Slurm ('slurm')"
        )
    if not isinstance(cfg, dict):
        raise ValueError(f"scheduler_cfg must be a dict, got {cfg!r}")
    if scheduler == "local_cwd":
        if cfg:
            raise ValueError(f"scheduler='local_cwd' takes no scheduler_cfg here, got {sorted(cfg)}")
        if nnodes != 1:
            raise ValueError(
                f"--nnodes={nnodes}: scheduler='local_cwd' is this one machine (--nnodes=1 or --standalone); for "
                f"{nnodes} hosts use scheduler='slurm'"
            )
        return LocalJob((MESH,))
    unknown = sorted(set(cfg) - set(SLURM_CFG))
    if unknown:
        raise ValueError(f"scheduler_cfg: no Slurm option {unknown[0]!r} here (options: {', '.join(SLURM_CFG)})")
    kwargs = {SLURM_CFG[k]: v for k, v in cfg.items()}
    if workspace is not None:
        kwargs.setdefault("workspace", workspace)
    return SlurmJob({MESH: nnodes}, **kwargs)


def serve(
    appdef: list[str] | Any, scheduler: str = "local_cwd", scheduler_cfg: dict[str, Any] | None = None
) -> SPMDJob:
    """An SPMD job from a torchrun command (or a torchx AppDef), its hosts brought up: `run_spmd()` runs the
    script on them. The job is cached in `DEFAULT_JOB_PATH` (``job_load()`` finds it); a job cached there
    before is used again if it can serve this one (the same Slurm hosts), else ended. See the module."""
    workspace = None
    if isinstance(appdef, (list, tuple)):
        cmd = parse_torchrun(list(appdef))
    else:
        cmd, workspace = _from_appdef(appdef)
    job = SPMDJob(_hosts_job(scheduler, dict(scheduler_cfg or {}), cmd.nnodes, workspace), cmd, scheduler)
    stale = _stale(DEFAULT_JOB_PATH)
    if stale is not None and stale._running is not None:
        if stale._running.can_run(job):
            job._job = stale._job  # (the same hosts, still up)
        else:
            stale.kill()
    job.apply()
    job.dump(DEFAULT_JOB_PATH)
    return job


def _stale(path: str) -> SPMDJob | None:
    """The SPMD job cached at `path` by an earlier `serve` (removed from there), if any."""
    if not os.path.lexists(path):
        return None
    try:
        job = job_load(path)
    except Exception as e:
        warnings.warn(f"removing the job state file {path} (it could not be loaded: {e})", stacklevel=3)
        job = None
    os.remove(os.path.realpath(path))
    return job if isinstance(job, SPMDJob) else None


class SPMDJob(JobTrait):
    """A torchrun script and the job whose hosts run it (`serve` makes one): `run_spmd()` runs the script on
    fresh workers, ``nproc_per_node`` per host, through `SPMDActor`."""

    def __init__(self, job: JobTrait, command: TorchrunCommand, scheduler: str = "local_cwd") -> None:
        super().__init__()
        self._job = job
        self._command = command
        self._scheduler = scheduler

    @property
    def script_args(self) -> list[str]:
        """What each worker runs: ``[script, *args]`` or ``["-m", module, *args]``."""
        return list(self._command.script_args)

    @property
    def nproc_per_node(self) -> int:
        return self._command.nproc_per_node

    @property
    def hosts_job(self) -> JobTrait:
        """The job holding the hosts (`LocalJob` or `SlurmJob`)."""
        return self._job

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise ValueError("an SPMD job runs its script with run_spmd(); apply() takes no client_script")
        self._job.apply()

    def _state(self) -> JobState:
        running = self._job._running
        if running is None:
            raise RuntimeError("this SPMD job's hosts were given back (kill()); serve() it again")
        return running._state()

    def can_run(self, spec: JobTrait) -> bool:
        running = self._job._running
        return isinstance(spec, SPMDJob) and running is not None and running.can_run(spec._job)

    def _kill(self) -> None:
        self._job.kill()

    def run_spmd(self) -> None:
        """Run the script on every process: fresh workers on the job's hosts (`nproc_per_node` each), torchrun's
        environment, the script's `__main__`; they are stopped when it ends. A rank's failure raises
        `RemoteError` with its traceback (the others, waiting in a collective, are released)."""
        if not self.active:
            self.apply()
        hosts = getattr(self._state(), MESH)
        procs = hosts.spawn_procs(per_host={"gpus": self._command.nproc_per_node})
        try:
            run_spmd(procs, self._command.script_args)
        finally:
            procs.exit()

    def __repr__(self) -> str:
        where = "this machine" if self._scheduler == "local_cwd" else f"{self._command.nnodes} Slurm hosts"
        return f"<SPMDJob {' '.join(self._command.script_args)}: {self._command.nproc_per_node} per host on {where}>"
