"""Local workers yield the CPU to the controller that issues their work (`MONARCH_WORKER_NICE`).

Checked on real workers: each worker's nice value (its main thread's, and a thread it starts later), its
session's autogroup where Linux has them, and that the controller's own priority is left alone.
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
