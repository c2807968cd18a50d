"""Actors on a Slurm job's hosts (issue 28): actor meshes on 2 fake hosts x 4 processes, started by the hosts'
agents; actors calling actors on the other host (TCP with CURVE between the workers, never through the kernel);
and Monarch's getting-started program, its actor sections as its users write them (only the host mesh comes
from `monarch.notebook.reserve`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zmq

import monarch.notebook
from monarch.actor import Actor, context, endpoint

from conftest import REPO, wait_for, wait_gone, worker_pids
from helpers.slurm_cluster import missing, running

WHY = missing()
if WHY is not None and os.environ.get("CI") and os.geteuid() == 0:
    raise RuntimeError(f"the actors-on-hosts tests cannot run: {WHY}")
pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(WHY is not None, reason=f"no Slurm here: {WHY}")]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with running(tmp_path_factory.mktemp("slurm-jobs")) as c:
        job = monarch.notebook.reserve(2, name="actors", timeout=120)
        try:
            yield c, job
        finally:
            job.cleanup()


@pytest.fixture(scope="module")
def procs(job):
    mesh = job[1].spawn_procs({"gpu": 4})
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


def test_monarchs_getting_started_runs_as_its_users_write_it(job, tmp_path):
    """examples/actors/getting_started.py: the guide's actor sections, the host mesh being the job's two hosts.
    First in this module: the script's controller attaches to the job's agents, which serve one at a time."""
    from test_notebooks import _monarch_procs

    env = dict(os.environ, MONARCH_HOSTS="actors", PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "examples.actors.getting_started"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Counter value: 0" in out
    assert "values: [2, 2, 2, 2, 1, 1, 1, 1]" in out  # the broadcasts ran, in the order sent, before the call
    assert "hosts: {'host': 2}" in out
    assert "Process mesh extent: {host: 2, gpus: 4}" in out  # (an Extent, printed as Monarch prints it)
    for h in range(2):
        for g in range(4):
            assert f"Trainer {{'host': {h}/2, 'gpus': {g}/4}} taking a step." in out, out  # (a Point, likewise)
    assert out.count("'Step with data <fake data 1> and input = None'") == 8, out  # each trainer's own loader
    assert "It didn't say hello" in out and out.rstrip().endswith("done"), out
    wait_for(lambda: not _monarch_procs(str(tmp_path)), what="the script's workers gone with it")


class Where(Actor):
    def __init__(self) -> None:
        self.me = context().actor_instance.rank

    @endpoint
    def host(self) -> tuple[int, int, str]:
        import socket

        return self.me["host"], self.me["gpu"], socket.gethostname()


class Asker(Actor):
    def __init__(self, others) -> None:
        self.me = context().actor_instance.rank
        self.others = others

    @endpoint
    def ask_other_host(self) -> tuple[int, int, str]:
        return self.others.slice(host=1 - self.me["host"], gpu=self.me["gpu"]).host.call_one().get()

    @endpoint
    def ask_everyone(self) -> list:
        return self.others.host.call().get().values()


def test_call_reaches_2_hosts_x_4_through_their_agents(procs):
    where = procs.spawn("where", Where)
    got = where.host.call().get().values()
    assert [(h, g) for h, g, _ in got] == [(h, g) for h in range(2) for g in range(4)]
    assert {name for h, _, name in got if h == 0} == {"node1"}
    assert {name for h, _, name in got if h == 1} == {"node2"}
    where.stop()


def test_actors_call_actors_on_the_other_host_over_curve(procs):
    where = procs.spawn("where2", Where)
    askers = procs.spawn("askers", Asker, where)
    got = askers.ask_other_host.call().get().values()
    assert [(h, g, name) for h, g, name in got] == [(1 - h, g, f"node{2 - h}") for h in range(2) for g in range(4)]
    assert len(askers.slice(host=0, gpu=0).ask_everyone.call_one().get()) == 8
    inbox = where._inboxes[0]
    assert inbox.addr.startswith("tcp://10.77.0.") and inbox.public is not None  # across hosts: CURVE
    # A client without the inbox's CURVE key gets no handshake, so nothing it sends is even read.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inbox.addr)
    sock.send(b"hello")
    assert sock.poll(300) == 0
    sock.close(0)
    askers.stop()
    where.stop()
