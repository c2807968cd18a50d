"""Hosts reserved through Slurm, used from a notebook; their agents outlive the kernel.

    python -m monarch.notebook reserve --hosts 2 --gpus-per-host 8 --name train
    python -m monarch.notebook list
    python -m monarch.notebook cleanup train

    import monarch.notebook
    job = monarch.notebook.job("train")
    mesh = job.spawn_procs({"gpu": 8})      # a ProcMesh {host: 2, gpu: 8}: %%mesh, live functions, tensors
    monarch.notebook.cleanup("train")       # scancel

The job's directory (MONARCH_JOBS_DIR, default ~/.monarch/jobs) must be one its hosts see at the same path.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def reserve(hosts: int, gpus_per_host: int = 0, **kw: Any):
    """Reserve `hosts` nodes through Slurm, one agent each; returns the `Job` once every agent is up. Options:
    `name`, `partition`, `time_limit`, `workspace` (a directory copied to each host), `timeout` (none),
    `interface` (the network interface the agents listen on and give gloo/NCCL; default: the first one up)."""
    from monarch.runtime.slurm.jobs import reserve as _reserve

    return _reserve(hosts, gpus_per_host, **kw)


def job(name: str):
    """The job reserved under `name` (by this or an earlier process)."""
    from monarch.runtime.slurm.jobs import Job

    return Job(name)


def list_jobs() -> list[dict]:
    """The jobs recorded here, each with its Slurm state."""
    from monarch.runtime.slurm.jobs import list_jobs as _list

    return _list()


def cleanup(name: str) -> None:
    """Cancel job `name` (its agents and workers end) and forget it."""
    from monarch.runtime.slurm.jobs import cleanup as _cleanup

    _cleanup(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monarch.notebook", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reserve", help="reserve hosts through Slurm (waits until every host's agent is up)")
    r.add_argument("--hosts", type=int, required=True, help="number of hosts (Slurm nodes)")
    r.add_argument("--gpus-per-host", type=int, default=0, help="GPUs to ask for on each host (default 0)")
    r.add_argument("--partition", help="Slurm partition (default: Slurm's default)")
    r.add_argument("--time", dest="time_limit", help="time limit, as sbatch takes it (e.g. 2:00:00)")
    r.add_argument("--name", help="the job's name, to find it later (default: monarch-XXXXXX)")
    r.add_argument("--workspace", help="a directory to copy to each host (only changed files travel)")
    r.add_argument("--interface", help="network interface for agents and gloo/NCCL (default: first one up)")
    r.add_argument("--timeout", type=float, help="give up after this many seconds (default: wait)")
    sub.add_parser("list", help="the jobs recorded here, with their Slurm state")
    c = sub.add_parser("cleanup", help="cancel a job and forget it")
    c.add_argument("name")
    args = ap.parse_args(argv)
    from monarch.runtime.slurm.commands import SlurmError

    try:
        if args.cmd == "reserve":
            j = reserve(
                args.hosts, args.gpus_per_host, name=args.name, partition=args.partition,
                time_limit=args.time_limit, workspace=args.workspace, timeout=args.timeout,
                interface=args.interface,
            )  # fmt: skip
            print(f"attach with: monarch.notebook.job({j.name!r}).spawn_procs({{'gpu': N}})")
        elif args.cmd == "list":
            for j in list_jobs():
                print(
                    f"{j['name']}  Slurm {j['slurm_id']}  {j['hosts']} hosts  {j['state']}  agents up {j['agents_up']}"
                )
        else:
            cleanup(args.name)
            print(f"job {args.name}: cancelled")
    except KeyboardInterrupt:
        print("monarch: the request was cancelled", file=sys.stderr)
        return 130
    except (ValueError, SlurmError, TimeoutError) as e:
        print(f"monarch: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
