"""One controller, 512 ranks: 8 synthetic hosts of 64 ranks each (`helpers/synthetic_hosts.py`: real host
agents, real CURVE links and relays, the workers' protocol spoken per rank; only the workers' work is
synthetic). What a user sees of a call, its output and its errors at that size."""

from __future__ import annotations

import re

import pytest

import monarch
import monarch.notebook

from conftest import pid_alive
from helpers.synthetic_hosts import SyntheticJob, fail_on, noop, rank_of, say

pytestmark = pytest.mark.timeout(300)

HOSTS, PER_HOST = 8, 64
RANKS = HOSTS * PER_HOST


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = SyntheticJob(tmp_path_factory.mktemp("scale"), "scale", hosts=HOSTS)
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


def test_a_call_gets_every_ranks_value_in_rank_order(mesh):
    assert mesh.to_table(with_memory=False).rows[-1]["rank"] == RANKS - 1
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
    say.on(mesh)("hello from the harness")
    out = capfd.readouterr().out
    labels = re.findall(r"^\[(host=\d+,gpu=\d+)\] hello from the harness$", out, re.M)
    assert len(labels) == RANKS and len(set(labels)) == RANKS, out[-2000:]
