"""Monarch's job trait, mapped onto our backends: a job is a specification of hosts; `apply()` brings it into
existence (once), `state()` gives its host meshes by name, and the applied job is cached in a file so that a
later process (`job_load`) uses the same hosts.

    job = LocalJob(("trainers",))
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 4})

The cache is a pickle, as Monarch's is; it is written mode 0600 in a 0700 folder, and read only from a file
this user owns that nobody else may write (a pickle runs code as it loads).
"""

from __future__ import annotations

import abc
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monarch.runtime.common.shape import Shape
from monarch.runtime.mesh import HostMesh, this_host

DEFAULT_JOB_PATH = ".monarch/job_state.pkl"
"""Where `state()` caches the applied job, relative to the working directory (Monarch's path)."""
_MONARCH_DIR = ".monarch"
_STATE_FILE = "state.pkl"
_SPEC_FILE = "spec"


class JobState:
    """The host meshes of an applied job, by name: ``state.trainers`` (an `AttributeError` names the others)."""

    def __init__(self, hosts: Mapping[str, Any]) -> None:
        self._hosts = dict(hosts)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return self.__dict__["_hosts"][attr]
        except KeyError:
            names = ", ".join(sorted(self.__dict__.get("_hosts", {}))) or "none"
            raise AttributeError(f"{attr!r} is not a host mesh of this job (its host meshes: {names})") from None

    def __repr__(self) -> str:
        return f"JobState(hosts={self._hosts})"


@dataclass(frozen=True)
class CachedRunning:
    """A job whose state comes from another, applied earlier and found in the cache."""

    job: JobTrait
    """The applied job found in the cache."""


class JobTrait(abc.ABC):
    """A specification of hosts and, once applied, its state (Monarch's `monarch.job.JobTrait`).

    `apply()` creates the job (a no-op when it runs already); `state(cached_path)` gives its `JobState`,
    applying it first unless the job cached at `cached_path` can run this specification (`can_run`), and
    caches it there; `kill()` ends it. Subclasses implement `_create`, `_state`, `can_run` and `_kill`."""

    def __init__(self) -> None:
        self._status: str | CachedRunning = "not_running"
        self._apply_id: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def _running(self) -> JobTrait | None:
        if isinstance(self._status, CachedRunning):
            return self._status.job
        return self if self._status == "running" else None

    @property
    def active(self) -> bool:
        """Whether this job (or the cached one it stands for) has been applied."""
        return self._running is not None

    @property
    def apply_id(self) -> str | None:
        """A fresh id per `apply()` that created the job (kept in the cache); None before."""
        running = self._running
        return running._apply_id if running is not None else None

    def apply(self, client_script: str | None = None) -> None:
        """Create the job as specified, unless it runs already. `client_script`: also run that script as the
        job's client (batch mode; `LocalJob` only here)."""
        if self._running is None:
            self._create(client_script)
            self._apply_id = str(uuid.uuid4())
            self._status = "running"

    def state(self, cached_path: str | None = DEFAULT_JOB_PATH) -> JobState:
        """The job's host meshes. Not applied yet: the job cached at `cached_path` is used if it can run this
        specification, else this one is applied and cached there (None: no cache)."""
        running = self._running
        if running is not None:
            return running._state()
        cached = self._load_cached(cached_path)
        if cached is not None:
            self._status = CachedRunning(cached)
            return cached._state()
        self.apply()
        state = self._state()
        if cached_path is not None:
            self.dump(cached_path)
        return state

    def kill(self) -> None:
        """End the job (its hosts are given back) and forget that it ran."""
        running = self._running
        if running is not None:
            running._kill()
        self._status = "not_running"

    def _load_cached(self, cached_path: str | None) -> JobTrait | None:
        if cached_path is None:
            return None
        try:
            job = job_load(cached_path)
        except FileNotFoundError:
            return None
        running = job._running
        if running is None:
            return None
        if not running.can_run(self):
            running._kill()
            try:
                os.remove(os.path.realpath(cached_path))
            except FileNotFoundError:
                pass
            return None
        return job

    # -- the cache ---------------------------------------------------------------------------------
    def dump(self, filename: str) -> None:
        """Save this job (pickled) to `filename` (through a symlink, to its target), mode 0600, its folder
        made mode 0700 if missing."""
        path = os.path.realpath(filename) if os.path.islink(filename) else filename
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".job-")  # (mode 0600)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(self, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def dumps(self) -> bytes:
        """This job, pickled (`job_loads` reads it)."""
        return pickle.dumps(self)

    # -- what Monarch's jobs add, that needs what this project does not have ------------------------------
    def enable_telemetry(self, config: Any = None, **kwargs: Any) -> JobTrait:
        """Monarch's telemetry sidecar: not here (see `monarch.job.TelemetryConfig`)."""
        from monarch.runtime.job.unavailable import TelemetryConfig

        TelemetryConfig()
        return self

    def enable_admin(self, config: Any = None, **kwargs: Any) -> JobTrait:
        """Monarch's mesh admin agent: not here (see `monarch.job.MeshAdminConfig`)."""
        from monarch.runtime.job.unavailable import MeshAdminConfig

        MeshAdminConfig()
        return self

    def remote_mount(self, source: str, *args: Any, **kwargs: Any) -> None:
        """Monarch's FUSE mount of a local folder on the workers: not here."""
        raise NotImplementedError(
            f"remote_mount({source!r}): workers here see no FUSE mount of this machine's folders. On this machine "
            "they see its files already; on Slurm hosts, reserve with a workspace (SlurmJob(..., workspace=DIR)) "
            "and call mesh.sync_workspace() after an edit (only changed files travel)"
        )

    def gather_mount(self, remote_mount_point: str, *args: Any, **kwargs: Any) -> None:
        """Monarch's mount of the workers' folders here: not here."""
        raise NotImplementedError(
            f"gather_mount({remote_mount_point!r}): there is no mount of the workers' folders here; have the "
            "workers return what you need from a call (or write it to a file system the hosts share)"
        )

    # -- for subclasses ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _create(self, client_script: str | None) -> None:
        """Create the job's resources (called by `apply`, which sets the status)."""

    @abc.abstractmethod
    def _state(self) -> JobState:
        """The host meshes of the created job."""

    @abc.abstractmethod
    def can_run(self, spec: JobTrait) -> bool:
        """Whether this (applied) job can serve `spec`, so that a cached job is used instead of a new one."""

    @abc.abstractmethod
    def _kill(self) -> None:
        """End the job's resources."""


def job_loads(data: bytes) -> JobTrait:
    """A job from `JobTrait.dumps()`'s bytes (a pickle: load only bytes you made)."""
    job = pickle.loads(data)
    if not isinstance(job, JobTrait):
        raise TypeError(f"job_loads(): the bytes hold a {type(job).__name__}, not a job (JobTrait)")
    return job


def job_load(filename: str = DEFAULT_JOB_PATH) -> JobTrait:
    """The job cached in `filename` (by `state()`, `dump()`, or `monarch.job.spmd.serve`). The file must be this
    user's and writable by nobody else: it is a pickle, and loading one runs code."""
    with open(filename, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(
                f"{filename}: not loaded: a job file must belong to this user (uid {os.geteuid()}, it is "
                f"{st.st_uid}'s) and be writable by nobody else (mode {st.st_mode & 0o777:o}); loading a pickle "
                "runs code"
            )
        job = pickle.load(f)
    if not isinstance(job, JobTrait):
        raise TypeError(f"{filename} holds a {type(job).__name__}, not a job (JobTrait)")
    return job


# -- the current job's spec (Monarch's `monarch apply` contexts) -------------------------------------------
def _spec_file() -> Path:
    link = Path(DEFAULT_JOB_PATH)
    if link.is_symlink():
        return Path(_MONARCH_DIR) / Path(os.readlink(link)).parent / _SPEC_FILE
    return Path(_MONARCH_DIR) / "default" / _SPEC_FILE


def set_current_job(module_path: str) -> None:
    """Record `module_path` (``"module.attr"``, a `JobTrait` object) as the current context's job spec; the
    cache `DEFAULT_JOB_PATH` becomes a link to the context's own ``state.pkl``."""
    if not isinstance(module_path, str) or "." not in module_path:
        raise ValueError(f"module_path must be 'module.attr', got {module_path!r}")
    link = Path(DEFAULT_JOB_PATH)
    os.makedirs(_MONARCH_DIR, mode=0o700, exist_ok=True)
    if not link.is_symlink():
        default = Path(_MONARCH_DIR) / "default"
        default.mkdir(mode=0o700, parents=True, exist_ok=True)
        if link.exists():
            link.rename(default / _STATE_FILE)
        link.symlink_to(Path("default") / _STATE_FILE)
    spec = _spec_file()
    spec.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    spec.write_text(module_path)


def load_current_job() -> JobTrait:
    """A fresh job object from the current context's spec (`set_current_job`); `state()` on it connects."""
    spec = _spec_file()
    try:
        module_path = spec.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no job spec at {spec}: call set_current_job('module.attr') first") from None
    module, _, attr = module_path.rpartition(".")
    job = getattr(importlib.import_module(module), attr, None)
    if job is None:
        raise AttributeError(f"module {module!r} has no {attr!r} (the job spec {module_path!r} in {spec})")
    if not isinstance(job, JobTrait):
        raise TypeError(f"{module_path} must be a JobTrait, got {type(job).__name__}")
    return job


# -- this machine ------------------------------------------------------------------------------------------
class LocalJob(JobTrait):
    """A job on this machine: each host mesh is `this_host()` (Monarch's `LocalJob`), so a job's code runs
    here or on Slurm by changing the job alone."""

    def __init__(self, hosts: Sequence[str] = ("hosts",)) -> None:
        super().__init__()
        if isinstance(hosts, str) or not all(isinstance(h, str) and h.isidentifier() for h in hosts):
            raise ValueError(f"hosts must be a sequence of host mesh names (identifiers), got {hosts!r}")
        self._host_names = tuple(hosts)
        self._proc: subprocess.Popen | None = None
        self._log_dir: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_proc": None}  # (a process object does not pickle)

    def _state(self) -> JobState:
        return JobState({name: this_host() for name in self._host_names})

    def _create(self, client_script: str | None) -> None:
        if client_script is None:
            return  # (this machine is always there)
        if not os.path.isfile(client_script):
            raise FileNotFoundError(f"apply(client_script={client_script!r}): no such file")
        os.makedirs(os.path.join(_MONARCH_DIR, "logs"), mode=0o700, exist_ok=True)
        self._log_dir = tempfile.mkdtemp(prefix="job_", dir=os.path.join(_MONARCH_DIR, "logs"))
        with (
            open(os.path.join(self._log_dir, "stdout.log"), "w") as out,
            open(os.path.join(self._log_dir, "stderr.log"), "w") as err,
        ):
            self._proc = subprocess.Popen(
                [sys.executable, client_script], stdout=out, stderr=err, start_new_session=True
            )

    @property
    def process(self) -> subprocess.Popen:
        """The client script's process (`apply(client_script=...)`)."""
        if self._proc is None:
            raise ValueError("no client script runs for this job (apply(client_script=...) starts one)")
        return self._proc

    @property
    def log_dir(self) -> str | None:
        """Where the client script's stdout.log and stderr.log are."""
        return self._log_dir

    def can_run(self, spec: JobTrait) -> bool:
        return False  # (the spec itself is as good: this machine, whatever was saved)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()


class LocalHosts(HostMesh):
    """`n` hosts on this machine (a `ProcessJob`'s host mesh): a mesh spawned on them has a leading ``host``
    dimension, its workers all local, as a Slurm job's mesh has one for its hosts."""

    def __init__(self, n: int) -> None:
        super().__init__(Shape.from_sizes({"host": n}))

    def _new_with_shape(self, shape: Shape) -> LocalHosts:
        view = LocalHosts(1)
        view._shape = Shape.from_sizes(shape.size_dict)  # (all on this machine: only the sizes matter)
        return view


class ProcessJob(JobTrait):
    """Several hosts faked on this machine, for testing code written for several (Monarch's `ProcessJob`):
    ``ProcessJob({"trainers": 2}).state(cached_path=None).trainers.spawn_procs(per_host={"gpu": 4})`` is a mesh
    ``{host: 2, gpu: 4}`` of local workers."""

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None) -> None:
        super().__init__()
        _check_meshes(meshes)
        if env:
            raise ValueError(
                f"ProcessJob(env={env!r}): local workers inherit this process's environment when spawned; set "
                "the variables in os.environ before spawn_procs instead"
            )
        self._meshes = dict(meshes)

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise ValueError("ProcessJob cannot run a client script (batch mode); run the script yourself")

    def _state(self) -> JobState:
        return JobState({name: LocalHosts(n) for name, n in self._meshes.items()})

    def can_run(self, spec: JobTrait) -> bool:
        return False

    def _kill(self) -> None:
        pass


def _check_meshes(meshes: Any) -> None:
    """`{name: number of hosts}`, or a ValueError naming what is wrong."""
    if not isinstance(meshes, dict) or not meshes:
        raise ValueError(f"meshes must be a dict of mesh name -> number of hosts, got {meshes!r}")
    for name, n in meshes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh name {name!r}: use an identifier (it is an attribute of the job's state)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"meshes[{name!r}] = {n!r}: give a number of hosts >= 1")


# -- commands on hosts --------------------------------------------------------------------------------------
class CommandFuture:
    """`exec_command`'s result: `get()` (or `await`) runs the command and gives the highest return code."""

    def __init__(self, run: Any) -> None:
        self._run = run
        self._value: int | None = None

    def get(self, timeout: float | None = None) -> int:
        if self._value is None:
            self._value = self._run()
        return self._value

    result = get

    def __await__(self):
        import asyncio

        return asyncio.to_thread(self.get).__await__()


def exec_command(
    host_mesh: Any,
    cmd: list[str],
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    output_dir: str | None = None,
    rank: int | None = None,
    point: dict[str, int] | None = None,
    per_host: dict[str, int] | None = None,
) -> CommandFuture:
    """Run `cmd` on every process of a mesh spawned on `host_mesh` (`per_host`; one per host by default), or on
    the one at `point` or flat `rank`: a ``.py`` file or ``["-m", module, ...]`` with this Python, anything else
    as a command. Each gets MONARCH_RANK_<dim> and MONARCH_SIZE_<dim>, `env`, and `workdir` (else this
    process's working directory, where it exists). Output is printed here, or written per rank under
    `output_dir` (``$SUBDIR``: the rank's coordinates). The future gives the highest return code."""
    if (
        isinstance(cmd, str)
        or not isinstance(cmd, (list, tuple))
        or not cmd
        or not all(isinstance(c, str) for c in cmd)
    ):
        raise ValueError(f"cmd must be a non-empty list of strings (the command and its arguments), got {cmd!r}")
    if rank is not None and point is not None:
        raise ValueError(f"exec_command(rank={rank!r}, point={point!r}): give one or the other")
    if not hasattr(host_mesh, "spawn_procs"):
        raise TypeError(f"exec_command() needs a host mesh (job.state().<name>, this_host()), got {host_mesh!r}")

    def run() -> int:
        from monarch.runtime.remote import RemoteFunction

        procs = host_mesh.spawn_procs(per_host)
        try:
            view = procs
            if point is not None:
                view = procs.slice(**point)
            elif rank is not None:
                view = procs.flatten("rank").slice(rank=rank)
            fn = RemoteFunction.by_name("monarch.runtime.worker.command", "run_command", view)
            results = fn(list(cmd), dict(env or {}), workdir, os.getcwd(), output_dir)
            for got in results.values():
                if got["stdout"]:
                    print(got["stdout"], end="")
                if got["stderr"]:
                    print(got["stderr"], end="", file=sys.stderr)
            return max(got["returncode"] for got in results.values())
        finally:
            procs.exit()

    return CommandFuture(run)
