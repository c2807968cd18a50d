"""The system's limits, met before they bite: the controller raises its open-files limit to the hard one and sizes
ZeroMQ's socket limit from it; a mesh or a job the limits cannot hold fails at once, naming the limit and the
number it needs, with nothing started and the controller serving on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys, time
    soft, hard, workers, hosts = map(int, sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    import torch, zmq
    import monarch
    from monarch.actor import this_host
    from monarch.runtime.controller import get_controller

    def children():
        return sorted(p for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())
                      and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid()))

    mesh = this_host().spawn_procs({"gpu": 2})
    out = {"limit": resource.getrlimit(resource.RLIMIT_NOFILE)}
    out["max_sockets"] = get_controller().backend.transport.ctx.get(zmq.MAX_SOCKETS)
    before = children()
    try:
        if workers:
            this_host().spawn_procs({"gpu": workers})
        if hosts:
            from monarch.runtime.procs.jobfiles import AgentRecord, JobDir
            job = JobDir(__import__("pathlib").Path(sys.argv[5]) / "big")
            job.create({})
            ends = {k: "tcp://127.0.0.1:9" for k in ("ctl", "cmd", "reply", "store")}
            get_controller().attach(job, [AgentRecord(i, f"h{i}", "127.0.0.1", 1, ends) for i in range(hosts)])
    except Exception as e:
        out["error"] = f"{type(e).__name__}: " + " ".join(str(e).split())
    out["started"] = [p for p in children() if p not in before]
    out["still"] = monarch.remote(lambda: 1).on(mesh)().values()
    print(json.dumps(out), flush=True)
    mesh.exit()
    """
)


def run(tmp_path, soft: int, hard: int, workers: int = 0, hosts: int = 0) -> dict:
    script = tmp_path / "limits.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), str(soft), str(hard), str(workers), str(hosts), str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_controller_raises_its_open_files_limit_to_the_hard_one_and_sizes_zeromq_from_it(tmp_path):
    out = run(tmp_path, 256, 4096)
    assert out["limit"] == [4096, 4096]
    assert out["max_sockets"] == 4096  # (ZeroMQ's default is 1,023)
    assert "error" not in out and out["still"] == [1, 1]


def test_a_mesh_the_limit_cannot_hold_fails_at_once_naming_it_and_starts_nothing(tmp_path):
    out = run(tmp_path, 300, 300, workers=100)
    assert out["error"].startswith("LimitError: a mesh of 100 workers {gpu: 100} needs about 500 more open files")
    assert "may have 300 (RLIMIT_NOFILE; hard limit 300)" in out["error"] and "ulimit -n" in out["error"]
    assert out["started"] == [] and out["still"] == [1, 1]  # nothing forked; the first mesh serves on


def test_a_job_of_more_hosts_than_the_limit_holds_fails_before_connecting_to_any(tmp_path):
    out = run(tmp_path, 1100, 1100, hosts=200)
    assert out["error"].startswith("LimitError: job big (200 hosts) needs about 1,600 more open files"), out
    assert "RLIMIT_NOFILE" in out["error"]
    assert out["started"] == [] and out["still"] == [1, 1]
