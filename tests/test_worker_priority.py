"""Local workers' use of the CPU: their priority below the controller's (`MONARCH_WORKER_NICE`), polling
for the next command before sleeping (`MONARCH_WORKER_SPIN_US`), and `SCHED_BATCH` where they outnumber the cores.

Checked on real workers: each worker's nice value (its main thread's, and a thread it starts later), its
session's autogroup where Linux has them, and that the controller's own priority is left alone; whether
workers poll and whether they run as `SCHED_BATCH`, from the CPUs the controller may use when it spawns them.
"""

import os
import threading

import pytest

import monarch
from monarch.runtime.common.config import Settings
from monarch.runtime.controller import Controller
from monarch.runtime.mesh import ProcMesh

from conftest import wait_gone

AUTOGROUPS = os.path.exists("/proc/self/autogroup")


@monarch.remote
def priorities():
    got: dict = {}

    def look():
        got["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=look)
    t.start()
    t.join()
    got["main"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if AUTOGROUPS:
        got["autogroup"] = open("/proc/self/autogroup").read().split()[-1]
    return got


@pytest.mark.parametrize("nice", [10, 0])
def test_local_workers_run_nice_steps_below_the_controller(nice):
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    mine_group = open("/proc/self/autogroup").read() if AUTOGROUPS else None
    ctl = Controller(Settings(worker_nice=nice))
    try:
        spawned = ctl.spawn({"gpu": 2})
        mesh = ProcMesh(spawned, spawned.shape)
        pids = [i["pid"] for i in spawned.info]
        want = min(mine + nice, 19)
        for got in priorities.on(mesh)().values():
            assert got["main"] == want and got["thread"] == want, got
            if AUTOGROUPS:
                assert got["autogroup"] == str(nice), got
        mesh.exit()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    if AUTOGROUPS:
        assert open("/proc/self/autogroup").read() == mine_group  # a worker's setsid made its own


@monarch.remote
def how_it_waits():
    from monarch.runtime.worker import worker

    got: dict = {"spin": worker.current.transport.lane.spin}
    t = threading.Thread(target=lambda: got.setdefault("thread", os.sched_getscheduler(0)))
    t.start()
    t.join()
    got["main"] = os.sched_getscheduler(0)
    got["all"] = sorted({p for p in map(_policy, os.listdir("/proc/self/task")) if p is not None})
    return got


def _policy(tid: str) -> int | None:
    try:
        return os.sched_getscheduler(int(tid))
    except ProcessLookupError:
        return None  # (a thread that ended since the listing: the one `how_it_waits` joined may still be leaving)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize(
    "cpus, setting, spin, policy",
    [(2, 0.0003, 0.0003, os.SCHED_OTHER), (1, 0.0003, 0.0, os.SCHED_BATCH), (2, 0.0, 0.0, os.SCHED_OTHER)],
)
def test_local_workers_poll_with_a_cpu_each_and_run_as_batch_where_they_outnumber_the_cpus(cpus, setting, spin, policy):
    """One worker and the controller on 2 CPUs: it polls for `MONARCH_WORKER_SPIN_US` under the default policy; on
    1 CPU it sleeps at once (it would take the CPU from the controller that sends it work) and runs as
    `SCHED_BATCH`, every thread of it, those it started while it set up and a thread it starts later (its waking
    does not preempt the controller); with
    the setting 0 it sleeps at once. The controller's own policy is left alone."""
    mine = os.sched_getaffinity(0)
    ctl = Controller(Settings(worker_spin=setting))
    try:
        os.sched_setaffinity(0, sorted(mine)[:cpus])  # (this thread's: the backend counts the CPUs it may use)
        try:
            spawned = ctl.spawn({"gpu": 1})
        finally:
            os.sched_setaffinity(0, mine)
        mesh = ProcMesh(spawned, spawned.shape)
        pids = [i["pid"] for i in spawned.info]
        want = {"spin": spin, "main": policy, "thread": policy, "all": [policy]}
        assert how_it_waits.on(mesh)().values() == [want]
        mesh.exit()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_how_many_local_workers_may_poll_for_the_cores_there_are():
    from monarch.runtime.backends.local import spins
    from monarch.runtime.common.processes import batches

    assert spins(1, 2) and not spins(1, 1) and spins(8, 9) and not spins(8, 8)  # a core each, the controller's too
    assert batches(1, 1) and batches(64, 2) and not batches(1, 2) and not batches(8, 9)  # CPUs: the others' complement


@pytest.mark.parametrize(
    "siblings, want",
    [
        (["0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"], 4),  # hyperthread pairs: 8 CPUs, 4 cores
        (["0-1", "0-1", "2-3", "2-3"], 2),
        ([str(c) for c in range(8)], 8),  # a core per CPU
        (None, 4),  # no topology to read: pairs assumed
    ],
)
def test_cores_are_counted_once_however_many_hyperthreads_they_have(tmp_path, siblings, want):
    from monarch.runtime.common.processes import usable_cores

    for cpu, listed in enumerate(siblings or ()):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(listed + "\n")
    assert usable_cores(range(8 if siblings is None else len(siblings)), str(tmp_path)) == want
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))  # (this machine's own)
