"""Slurm's commands as monarch uses them: `sbatch` to reserve, `squeue` (JSON where the installed Slurm has
it, else its parsable format) and `scontrol` to follow a job, `scancel` to end it, `sinfo` to check a
request before it is made. Plain subprocess calls; the environment (e.g. `SLURM_CONF`) is the caller's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

TERMINAL = {
    "COMPLETED": "ended (its agents exited)",
    "FAILED": "failed",
    "CANCELLED": "was cancelled",
    "TIMEOUT": "reached its time limit",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "OUT_OF_MEMORY": "ran out of memory",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "missed its deadline",
}
"""Slurm's terminal job states, in words."""


class SlurmError(RuntimeError):
    """Slurm is missing, refused a request, or ended a job."""


@dataclass
class JobState:
    state: str
    """Slurm's word: PENDING, RUNNING, COMPLETED, CANCELLED, ... or GONE (Slurm no longer knows the job)."""
    reason: str = ""
    """Why it pends (Resources, Priority, ...), when it does."""
    nodes: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL or self.state == "GONE"

    def words(self) -> str:
        if self.state == "GONE":
            return "is no longer known to Slurm (it ended)"
        if self.state in TERMINAL:
            return TERMINAL[self.state]
        reason = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"is {self.state.lower()}{reason}"


def require() -> None:
    """Raise `SlurmError` naming what is missing when Slurm's commands are not here."""
    missing = [c for c in ("sbatch", "squeue", "scancel", "sinfo") if shutil.which(c) is None]
    if missing:
        raise SlurmError(
            f"Slurm is not installed here ({', '.join(missing)} not on PATH): monarch reserves hosts through "
            "Slurm; install its client (Debian: slurm-client) or run where Slurm is"
        )


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def partition(name: str | None) -> tuple[str, int, bool]:
    """(the partition's name, its number of nodes, whether it has GPUs); the default one when `name` is
    None. `SlurmError` for a partition that does not exist."""
    out = _run("sinfo", "-h", "-o", "%P %D %G")
    if out.returncode != 0:
        raise SlurmError(f"sinfo failed: {out.stderr.strip()}")
    rows: dict[str, tuple[int, bool]] = {}
    default = None
    for line in out.stdout.splitlines():
        p, nodes, *rest = line.split()
        gres = rest[0] if rest else ""
        is_default = p.endswith("*")
        p = p.rstrip("*")
        n, gpus = rows.get(p, (0, False))
        rows[p] = (n + int(nodes), gpus or "gpu" in gres)
        if is_default:
            default = p
    want = name or default
    if want not in rows:
        known = ", ".join(sorted(rows)) or "none"
        raise SlurmError(f"no Slurm partition {want!r} (partitions: {known})")
    return want, *rows[want]


def submit(script: str) -> str:
    """`sbatch` the script; returns the job id."""
    out = _run("sbatch", "--parsable", script)
    if out.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def state(job_id: str) -> JobState:
    """The job's state as Slurm knows it now."""
    out = _run("squeue", "--json", "--states=all", "--jobs", job_id)
    if out.returncode == 0:
        try:
            jobs = json.loads(out.stdout).get("jobs", [])
            for j in jobs:
                if str(j.get("job_id")) == job_id:
                    st = j.get("job_state")
                    st = st[0] if isinstance(st, list) else st
                    return JobState(str(st), str(j.get("state_reason", "")), str(j.get("nodes", "")))
        except (ValueError, AttributeError):
            pass
    else:
        out = _run("squeue", "-h", "--states=all", "-j", job_id, "-o", "%T|%r|%N")
        line = out.stdout.strip().splitlines()
        if out.returncode == 0 and line:
            st, reason, nodes = (line[0].split("|") + ["", ""])[:3]
            return JobState(st, reason, nodes)
    out = _run("scontrol", "show", "job", job_id)  # finished jobs linger here (MinJobAge) when squeue forgot them
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return JobState(field.split("=", 1)[1])
    return JobState("GONE")


def cancel(job_id: str) -> None:
    out = _run("scancel", job_id)
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        raise SlurmError(f"scancel {job_id} failed: {out.stderr.strip()}")
