"""Racks: the fan-in's second level (`runtime/agent/rack.py`). 8 synthetic hosts of 16 ranks, racked by 4
(`MONARCH_RACK_ABOVE=0`, `MONARCH_RACK_SIZE=4`, as a job of more than 64 hosts is by default): each rack's leader
merges its hosts' bundles, so a call on 128 ranks reaches the controller as two messages, and nothing a user sees
changes. Agents hold a call's replies until all of their ranks answered (a wait of a minute instead of
milliseconds), so that what is counted does not depend on how fast this machine is. A lost leader's rack is named
in the error of what its hosts ran."""

from __future__ import annotations

import dataclasses
import re

import pytest

import monarch
import monarch.notebook
from monarch.runtime.controller import get_controller
from monarch.runtime.wire import fanin

from conftest import pid_alive, wait_for
from helpers.synthetic_hosts import Came, Counter, SyntheticJob, fail_on, noop, rank_of, say

pytestmark = pytest.mark.timeout(300)

HOSTS, PER_HOST, RACK = 8, 16, 4
RANKS = HOSTS * PER_HOST


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = SyntheticJob(tmp_path_factory.mktemp("racks"), "racks", hosts=HOSTS, env={"MONARCH_BUNDLE_WAIT_US": "60e6"})
    j.start()
    yield j
    get_controller().detach(j.name)
    assert j.stop() == []
    assert not any(pid_alive(p) for p in j.pids)


def racked(job):
    """A mesh of 16 ranks on each host of `job`, attached with racks of 4."""
    local = get_controller().backend
    settings = local.settings
    local.settings = dataclasses.replace(settings, rack_above=0, rack_size=RACK)  # (read as the job attaches)
    try:
        return monarch.notebook.job(job.name).spawn_procs({"gpu": PER_HOST})
    finally:
        local.settings = settings


@pytest.fixture(scope="module")
def mesh(job):
    m = racked(job)
    yield m
    m.exit()


def test_the_job_is_racked_and_each_rack_sends_one_bundle_a_call(mesh):
    backend = get_controller().jobs["racks"]
    assert [h.leader for h in backend.hosts] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [bool(h.leading) for h in backend.hosts] == [True, False, False, False, True, False, False, False]
    # the controller's command and reply sockets connect to the leaders only; each host's store, to the host
    assert [sorted(h.connected) for h in backend.hosts] == [["cmd", "reply", "store"]] + [["store"]] * 3 + [
        ["cmd", "reply", "store"]
    ] + [["store"]] * 3
    assert backend.hosts[4].connected["cmd"] != backend.hosts[4].record.endpoints["cmd"]
    seen = get_controller().backend.transport._meshes[mesh.spawned.mesh_id].agents_seen
    with Came() as came:
        assert noop.on(mesh)().values() == [None] * RANKS
    assert (came.bundles, came.items) == (2, 2)  # 64 equal answers a rack: one item, its ranks
    assert set(seen) == {fanin.rack_sender(0), fanin.rack_sender(4)}  # signed as the racks, not their hosts
    with Came() as came:
        assert rank_of.on(mesh)().values() == list(range(RANKS))
    assert (came.bundles, came.items) == (2, RANKS)  # distinct values: each its own item, still one bundle a rack


def test_a_call_on_some_hosts_of_a_rack_goes_up_as_each_host_is_done(mesh):
    # (a leader does not see which of its hosts a call on a view reaches: each host's part goes on at once)
    with Came() as came:
        view = mesh.slice(host=slice(2, 4), gpu=slice(0, 3))
        assert rank_of.on(view)().values() == [32, 33, 34, 48, 49, 50]
    assert (came.bundles, came.items) == (2, 6)
    assert rank_of.on(mesh.slice(host=5, gpu=7))().values() == [87]


def test_one_failing_rank_is_named_and_the_mesh_goes_on(mesh):
    with pytest.raises(monarch.RemoteError) as e:
        fail_on.on(mesh)(101)
    text = str(e.value)
    assert f"fail_on failed on 1 of {RANKS} ranks" in text, text
    assert "rank 101 (host=6,gpu=5): ValueError: rank 101 fails on purpose" in text, text
    assert noop.on(mesh)().values() == [None] * RANKS


def test_a_line_from_every_rank_arrives_once_with_its_label(mesh, capfd):
    with Came() as came:
        say.on(mesh)("hello from a rack")
    assert (came.bundles, came.items) == (2, 4)  # per rack: the line once, the answer once
    out = capfd.readouterr().out
    labels = re.findall(r"^\[(host=\d+,gpu=\d+)\] hello from a rack$", out, re.M)
    assert len(labels) == RANKS and len(set(labels)) == RANKS, out[-2000:]


def test_actors_answer_through_the_racks(mesh):
    counters = mesh.spawn("counters", Counter)
    with Came() as came:
        assert counters.incr.call().get().values() == [1] * RANKS
    assert (came.bundles, came.items) == (2, 2)
    assert counters.rank.call().get().values() == list(range(RANKS))
    assert counters.slice(host=7, gpu=15).incr.call_one().get() == 2
    answers = sorted(f.get() for f in counters.rank.stream())
    assert answers == list(range(RANKS))
    counters.stop().get()


def test_a_job_attached_again_is_racked_again_and_a_lost_leader_is_named_for_its_racks_hosts(mesh, job):
    get_controller().detach(job.name)  # (its meshes stop; each leader lets its members go, as for a new kernel)
    again = racked(job)
    assert noop.on(again)().values() == [None] * RANKS
    counters = again.spawn("survivors", Counter)  # (a mesh with actors goes on without lost ranks)
    assert counters.incr.call().get().values() == [1] * RANKS
    job.procs[4].kill()  # the second rack's leader
    backend = get_controller().jobs[job.name]
    wait_for(lambda: backend.hosts[4].lost, 30, what="the leader's host taken as lost")
    with pytest.raises(monarch.RemoteError) as e:
        counters.incr.call().get()
    assert "(host=4,gpu=0)" in str(e.value) and "127.0.0.5" in str(e.value), str(e.value)
    with pytest.raises(monarch.RemoteError) as e:  # hosts 5-7: their replies came through it
        counters.slice(host=6).incr.call().get()
    text = str(e.value)
    assert "(host=6,gpu=0)" in text and "127.0.0.7" in text and "127.0.0.5) (its rack's leader)" in text, text
    first = counters.slice(host=slice(0, 4)).incr.call().get().values()  # the other rack answers
    assert len(first) == 4 * PER_HOST and len(set(first)) == 1 and first[0] >= 2, first
    assert [h.leader for h in backend.hosts][5:] == [-1, -1, -1]  # the rest of its rack: direct from now on
    again.exit()
