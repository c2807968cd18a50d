"""A job whose host agents run on this machine, started by the test instead of Slurm (no root needed):
real agent processes, each listening on its own address (127.0.0.x), each with its own workspace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from monarch.runtime.procs.jobfiles import JobDir

from conftest import wait_gone


class AgentJob:
    def __init__(
        self, root: Path, name: str, hosts: int = 2, workspace: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.root, self.name, self.hosts = root, name, hosts
        self.extra_env = env or {}
        """Set in the agents' environment, over this process's."""
        os.environ["MONARCH_JOBS_DIR"] = str(root)
        self.dir = JobDir.named(name)
        meta = {"name": name, "hosts": hosts, "gpus_per_host": 0, "slurm_id": None,
                "workspace": str(workspace) if workspace else None}  # fmt: skip
        self.dir.create(meta)
        self.procs: list[subprocess.Popen] = []
        self.workspaces = [root / f"ws-{name}-{i}" for i in range(hosts)]

    def start(self, timeout: float = 30) -> None:
        for i in range(self.hosts):
            cmd = [sys.executable, "-m", "monarch.runtime.agent", "--job-dir", str(self.dir.path), "--index", str(i),
                   "--bind", f"127.0.0.{i + 1}", "--workspace", str(self.workspaces[i])]  # fmt: skip
            self.procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=self.env))
        deadline = time.monotonic() + timeout
        while len(self.dir.agents()) < self.hosts:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"an agent exited: {p.stderr.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError("agents not up")
            time.sleep(0.05)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, **self.extra_env)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> list[int]:
        """SIGTERM every agent (as scancel does); returns the pids of anything left after 30 s."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        left = wait_gone(self.pids, 5)
        shutil.rmtree(self.dir.path, ignore_errors=True)
        return left
