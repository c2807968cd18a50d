"""Local workers' use of the CPU: their priority below the controller's (`MONARCH_WORKER_NICE`), and polling
for the next command before sleeping (`MONARCH_WORKER_SPIN_US`).

Checked on real workers: each worker's nice value (its main thread's, and a thread it starts later), its
session's autogroup where Linux has them, and that the controller's own priority is left alone; whether
workers poll, from the CPUs the controller may use when it spawns them.
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
        for got in priorities.on(mesh)():
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
def lane_spin():
    from monarch.runtime.worker import worker

    return worker.current.transport.lane.spin


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("cpus, setting, want", [(2, 0.0003, 0.0003), (1, 0.0003, 0.0), (2, 0.0, 0.0)])
def test_local_workers_poll_for_commands_only_with_a_cpu_each_beside_the_controller(cpus, setting, want):
    """One worker and the controller on 2 CPUs: it polls for `MONARCH_WORKER_SPIN_US`; on 1 CPU, or with the
    setting 0, it sleeps at once (it would take the CPU from the controller that sends it work)."""
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
        assert list(lane_spin.on(mesh)()) == [want]
        mesh.exit()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


def test_how_many_local_workers_may_poll_for_the_cpus_there_are():
    from monarch.runtime.backends.local import spins

    assert spins(1, 2) and not spins(1, 1)  # one worker: a CPU each
    assert not spins(8, 16) and spins(8, 17) and not spins(2, 4) and spins(2, 5)  # more: a core each, in pairs
