"""A real Slurm on this machine, with extra hosts faked by network namespaces, for the scale-out tests.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`./run test` installs them when it
runs as root). Each fake host is a network namespace on a bridge (10.77.0.1 is this machine, host i is
10.77.0.(10 + i)) with its own hostname and its own slurmd; slurmctld and munged run here. `start()`
brings it all up and `stop()` takes every piece down again (jobs, daemons, namespaces, the bridge, the
files), whatever state it is in. docs/features/slurm.md says how the tests use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from conftest import wait_for

BRIDGE = "mnbr0"
NET = "10.77.0"
CONTROLLER_ADDR = f"{NET}.1"
REQUIRED = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "munged", "ip", "nsenter", "unshare")


def missing() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    if os.geteuid() != 0:
        return "the scale-out tests need root (network namespaces, slurmd); run ./run test as root"
    lost = [c for c in REQUIRED if shutil.which(c) is None]
    if lost:
        return f"not installed: {', '.join(lost)} (./run test installs slurmctld slurmd slurm-client munge as root)"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


class Cluster:
    """`hosts` fake hosts named node1..nodeN, each in namespace `mnh1`..., one partition `debug`."""

    def __init__(self, hosts: int = 2, cpus: int = 4) -> None:
        self.hosts = hosts
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="monarch-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.names = [f"node{i}" for i in range(1, hosts + 1)]
        self.addrs = [f"{NET}.{10 + i}" for i in range(1, hosts + 1)]
        self.netns = [f"mnh{i}" for i in range(1, hosts + 1)]
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        """The environment for Slurm's commands (sbatch, squeue, scancel) to reach this cluster."""

    # -- up ------------------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        try:
            self._network()
            self._munge()
            self._config()
            self._daemons()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{CONTROLLER_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i, (ns, addr) in enumerate(zip(self.netns, self.addrs), start=1):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"mnv{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", f"mnv{i}", "master", BRIDGE, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _munge(self) -> None:
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        if _run("pgrep", "-x", "munged", check=False).returncode != 0:
            _run("runuser", "-u", "munge", "--", "/usr/sbin/munged")
            self._munged = True
        wait_for((run / "munge.socket.2").exists, 60, "munged's socket")  # (before the daemons authenticate)

    def _config(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        mem = 2048
        lines = [
            f"ClusterName=monarchtest\nSlurmctldHost={os.uname().nodename}({CONTROLLER_ADDR})",
            "SlurmUser=root\nAuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none",
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nAccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none\nReturnToService=2\nMpiDefault=none\nJobRequeue=0",
            "SlurmdTimeout=10\nMailProg=/bin/true\nSlurmdParameters=config_overrides",
            f"StateSaveLocation={d}/state\nSlurmctldPidFile={d}/slurmctld.pid\nSlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdSpoolDir={d}/spool/%n\nSlurmdPidFile={d}/slurmd-%n.pid\nSlurmdLogFile={d}/slurmd-%n.log",
            "SlurmctldPort=6817\nSchedulerParameters=sched_interval=1\nMinJobAge=2",
        ]
        for i, (name, addr) in enumerate(zip(self.names, self.addrs), start=1):
            lines.append(f"NodeName={name} NodeAddr={addr} Port={6820 + i} CPUs={self.cpus} RealMemory={mem}")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemons(self) -> None:
        log = open(self.dir / "daemons.log", "ab")
        self.procs.append(
            subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=log, env=self.env)
        )
        for name, ns in zip(self.names, self.netns):
            (self.dir / "spool" / name).mkdir()
            # nsenter, not `ip netns exec` (which remounts /sys, and slurmd then fails); its own hostname
            cmd = ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
                   f"hostname {name}; exec slurmd -D -N {name} -f {self.conf}"]  # fmt: skip
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env))

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=self.env)
            states = out.stdout.strip()
            if (
                out.returncode == 0
                and len(states.splitlines()) == self.hosts
                and all(line.split()[1] == "idle" for line in states.splitlines())
            ):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args}):\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"Slurm nodes not idle after {timeout:.0f} s: {states!r}\n{self.log_tail()}")

    # -- down ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, env=self.env, timeout=30)
        for ns in self.netns:  # whatever runs in a fake host: slurmd, jobs, agents, workers
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.netns:
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", BRIDGE, check=False)
        if getattr(self, "_munged", False):
            _run("pkill", "-x", "munged", check=False)
            # (gone, not just told to go: the next cluster's start would take a dying one for running)
            wait_for(lambda: _run("pgrep", "-x", "munged", check=False).returncode != 0, 60, "munged's exit")
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers for tests ---------------------------------------------------------------------------
    def link(self, host: int, up: bool) -> None:
        """Cut host `host`'s link (no RST: packets just stop), or restore it."""
        _run("ip", "link", "set", f"mnv{host + 1}", "up" if up else "down")

    def pids_in(self, host: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns[host]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for f in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
        return "\n".join(parts)


@contextlib.contextmanager
def running(jobs_dir: Path, hosts: int = 2) -> Iterator[Cluster]:
    """A started cluster that `monarch.notebook` (SLURM_CONF, MONARCH_JOBS_DIR) uses, for a module's tests;
    afterwards it is down, the environment as it was, and none of its namespaces left."""
    c = Cluster(hosts=hosts)
    c.start()
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "MONARCH_JOBS_DIR")}
    os.environ["SLURM_CONF"] = str(c.conf)
    os.environ["MONARCH_JOBS_DIR"] = str(jobs_dir)
    try:
        yield c
    finally:
        c.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert [ns for ns in c.netns if ns in listed] == []
