"""One controller, 512 ranks: 8 synthetic hosts of 64 ranks each (`helpers/synthetic_hosts.py`: real host
agents, real CURVE links and relays, the workers' protocol spoken per rank; only the workers' work is
synthetic). What a user sees of a call, its output and its errors at that size, and how it came: each host's
agent bundles its ranks' replies and output (`runtime/wire/fanin.py`). The agents here hold a call's replies
until all of their ranks answered (a wait of a minute instead of milliseconds), so that what is counted does not
depend on how fast this machine is."""

from __future__ import annotations

import re
import socket

import pytest

import monarch
import monarch.notebook

from conftest import pid_alive
from helpers.synthetic_hosts import Came, Counter, SyntheticJob, a_list, fail_on, noop, rank_of, say

pytestmark = pytest.mark.timeout(300)

HOSTS, PER_HOST = 8, 64
RANKS = HOSTS * PER_HOST


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = SyntheticJob(tmp_path_factory.mktemp("scale"), "scale", hosts=HOSTS, env={"MONARCH_BUNDLE_WAIT_US": "60e6"})
    j.start()
    yield j
    assert j.stop() == []
    assert not any(pid_alive(p) for p in j.pids)


@pytest.fixture(scope="module")
def mesh(job):
    # Spawned right after the attach: the synthetic ranks say Ready within milliseconds of it, which is what
    # found start-up messages lost before an agent's command connection was made.
    m = monarch.notebook.job(job.name).spawn_procs({"gpu": PER_HOST})
    yield m
    m.exit()


def test_a_call_on_512_ranks_reaches_the_controller_as_one_bundle_per_host(mesh):
    with Came() as came:
        assert noop.on(mesh)().values() == [None] * RANKS
    assert (came.bundles, came.items) == (HOSTS, HOSTS)  # 64 equal answers: one item, its ranks
    with Came() as came:
        assert rank_of.on(mesh)().values() == list(range(RANKS))
    assert (came.bundles, came.items) == (HOSTS, RANKS)  # distinct values: each its own item, still one bundle
    with Came() as came:
        assert rank_of.on(mesh.slice(host=slice(2, 4), gpu=slice(0, 3)))().values() == [128, 129, 130, 192, 193, 194]
    assert (came.bundles, came.items) == (2, 6)  # only the view's hosts, as soon as the view's ranks there answered


def test_an_equal_value_that_can_be_changed_is_each_ranks_own(mesh):
    with Came() as came:
        lists = a_list.on(mesh)().values()
    assert came.items == HOSTS  # (one item per host, as for None)
    lists[0].append(2)
    assert lists[0] == [1, 2] and lists[1] == [1] and lists[-1] == [1]


def test_a_call_gets_every_ranks_value_in_rank_order(mesh):
    table = mesh.to_table(with_memory=False)
    assert table.rows[-1]["rank"] == RANKS - 1
    text = str(table).splitlines()  # a row per host
    assert len(text) == 3 + HOSTS and text[3 + 7].split()[:4] == ["7", "448-511", "64", socket.gethostname()]
    assert rank_of.on(mesh)().values() == list(range(RANKS))
    assert noop.on(mesh)().values() == [None] * RANKS
    view = mesh.slice(host=5)
    assert rank_of.on(view)().values() == list(range(5 * PER_HOST, 6 * PER_HOST))


def test_one_failing_rank_of_512_is_named_and_the_mesh_goes_on(mesh):
    with pytest.raises(monarch.RemoteError) as e:
        fail_on.on(mesh)(417)
    text = str(e.value)
    assert f"fail_on failed on 1 of {RANKS} ranks" in text, text
    assert "rank 417 (host=6,gpu=33): ValueError: rank 417 fails on purpose" in text, text
    assert noop.on(mesh)().values() == [None] * RANKS


def test_a_line_from_every_rank_arrives_once_with_its_label(mesh, capfd):
    with Came() as came:
        say.on(mesh)("hello from the harness")
    assert (came.bundles, came.items) == (HOSTS, 2 * HOSTS)  # per host: the line once, the answer once
    out = capfd.readouterr().out
    labels = re.findall(r"^\[(host=\d+,gpu=\d+)\] hello from the harness$", out, re.M)
    assert len(labels) == RANKS and len(set(labels)) == RANKS, out[-2000:]


def test_actors_on_512_ranks_answer_a_call_in_one_bundle_per_host_and_a_failing_one_is_named(mesh):
    counters = mesh.spawn("counters", Counter)
    with Came() as came:
        assert counters.incr.call().get().values() == [1] * RANKS
    assert (came.bundles, came.items) == (HOSTS, HOSTS)
    assert counters.rank.call().get().values() == list(range(RANKS))
    one = counters.slice(host=7, gpu=63)
    assert one.incr.call_one().get() == 2
    with pytest.raises(monarch.RemoteError) as e:
        counters.fail_on.call(300).get()
    assert f"failed on 1 of {RANKS} ranks" in str(e.value), str(e.value)
    assert "ValueError: actor 300 fails on purpose" in str(e.value), str(e.value)
    assert counters.incr.call().get().values() == [2] * (RANKS - 1) + [3]
    # stream(): one call, its answers bundled per host like call()'s, each actor's future its own
    with Came() as came:
        answers = sorted(f.get() for f in counters.rank.stream())
    assert answers == list(range(RANKS)) and (came.bundles, came.items) == (HOSTS, RANKS)  # (values all differ)
    futures = list(counters.fail_on.stream(300))
    failed = [f for f in futures if f.exception() is not None]
    assert len(futures) == RANKS and len(failed) == 1 and "actor 300 fails" in str(failed[0].exception())
