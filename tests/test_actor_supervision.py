"""Supervision (issue 28): a process that dies under an actor mesh fails the calls waiting on it, naming the rank,
while the rest of the mesh goes on; a later call that includes the dead rank fails at once; each actor mesh on it
becomes a `MeshFailure` for its owner: the `__supervise__` of the `this_proc()` actor that spawned it, else
`monarch.actor.unhandled_fault_hook`. (A mesh without actors still fails whole: tests/test_faults.py.)"""

from __future__ import annotations

import os
import signal

import pytest

import monarch
import monarch.actor
from monarch.actor import Actor, MeshFailure, context, endpoint, this_host, this_proc
from monarch.runtime.actors import supervision

from conftest import started, wait_for, wait_gone, worker_pids

pytestmark = pytest.mark.timeout(90)


class Worker(Actor):
    def __init__(self):
        self.me = context().actor_instance.rank["gpu"]

    @endpoint
    def where(self) -> int:
        return self.me

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def fail(self) -> None:
        raise ValueError(f"no work on gpu {self.me}")

    @endpoint
    def hold(self, gate: str) -> int:
        """Say it started (`<gate>.<gpu>`), then wait for the test to create `<gate>.open`."""
        open(f"{gate}.{self.me}", "w").close()
        wait_for(lambda: os.path.exists(gate + ".open"), what=f"{gate}.open")
        return self.me


class Supervisor(Actor):
    """A this_proc() actor that spawns an actor mesh from its endpoint, so it owns it."""

    def __init__(self, handled: bool):
        self.handled = handled
        self.failures: list[MeshFailure] = []
        self.workers = None

    @endpoint
    def start(self, procs) -> list[int]:
        self.workers = procs.spawn("supervised", Worker)
        return self.workers.pid.call().get(timeout=30).values()

    @endpoint
    def seen(self) -> list[MeshFailure]:
        return list(self.failures)

    @endpoint
    def ask(self, gpu: int) -> int:
        return self.workers.slice(gpu=gpu).where.call_one().get(timeout=30)

    def __supervise__(self, failure: MeshFailure) -> bool:
        assert context().actor_instance.name == "supervisor"  # (on the actor's own thread)
        self.failures.append(failure)
        return self.handled


@pytest.fixture
def hook(monkeypatch):
    """What reaches `monarch.actor.unhandled_fault_hook` (reassigned there, as Monarch's docs do)."""
    seen: list[MeshFailure] = []
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", seen.append)
    return seen


def test_a_dead_process_fails_its_calls_the_rest_goes_on_and_the_hook_hears_of_it(tmp_path, hook):
    procs = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(procs)
    try:
        workers = procs.spawn("workers", Worker)
        gate = str(tmp_path / "gate")
        waiting = workers.hold.call(gate)  # on all four
        wait_for(lambda: started(gate, 4), what="the call on the four actors")
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(monarch.WorkerDiedError, match=r"rank 1 \(gpu=1\) of mesh \{gpu: 4\} killed by SIGKILL"):
            waiting.get(timeout=30)
        open(gate + ".open", "w").close()  # (the other three finish the failed call; nobody waits for them)

        assert workers.slice(gpu=slice(2, 4)).where.call().get(timeout=30).values() == [2, 3]
        assert workers.slice(gpu=0).where.call_one().get(timeout=30) == 0
        chosen = [workers.where.choose() for _ in range(6)]  # (in flight at once or not: never the dead one)
        assert set(f.get(timeout=30) for f in chosen) <= {0, 2, 3}

        with pytest.raises(monarch.WorkerDiedError, match=r"(?s)rank 1 \(gpu=1\).*killed by SIGKILL.*go on"):
            workers.where.call().get(timeout=30)  # at once: nothing is sent (the deadline only for a regression)
        with pytest.raises(monarch.WorkerDiedError, match=r"rank 1 \(gpu=1\)"):
            workers.slice(gpu=1).where.call_one().get(timeout=30)
        assert procs.status() == ["idle", "failed", "idle", "idle"]

        wait_for(lambda: hook, 60, "the MeshFailure reaching unhandled_fault_hook")
        (failure,) = hook
        assert isinstance(failure, MeshFailure) and failure.mesh_name == "workers"
        assert (failure.rank, failure.label) == (1, "gpu=1") and "SIGKILL" in failure.what
        assert "actor mesh 'workers' (Worker) on {gpu: 4}: rank 1 (gpu=1) killed by SIGKILL" in str(failure)
    finally:
        procs.exit()
    assert wait_gone(pids) == []


def test_a_this_proc_owner_supervises_the_actor_mesh_it_spawned(hook):
    procs = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(procs)
    boss = this_proc().spawn("supervisor", Supervisor, handled=True)
    try:
        actor_pids = boss.start.call_one(procs).get(timeout=60)
        assert actor_pids == pids
        os.kill(pids[2], signal.SIGKILL)
        wait_for(lambda: boss.seen.call_one().get(), 60, "__supervise__ being called")
        (failure,) = boss.seen.call_one().get()
        assert failure.mesh_name == "supervised" and (failure.rank, failure.label) == (2, "gpu=2")
        assert "SIGKILL" in failure.what
        assert boss.ask.call_one(3).get(timeout=30) == 3  # the owner goes on using the rest
        supervision.flush(10)
        assert hook == []  # handled: the hook never heard of it
    finally:
        boss.stop()
        procs.exit()
    assert wait_gone(pids) == []


def test_a_failure_the_owner_does_not_handle_goes_on_to_the_hook(hook):
    procs = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(procs)
    boss = this_proc().spawn("supervisor", Supervisor, handled=False)
    try:
        boss.start.call_one(procs).get(timeout=60)
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: hook, 60, "the unhandled MeshFailure reaching the hook")
        assert [f.rank for f in boss.seen.call_one().get()] == [0] and [f.rank for f in hook] == [0]
    finally:
        boss.stop()
        procs.exit()
    assert wait_gone(pids) == []


def test_a_failed_broadcast_goes_to_the_owner_too(hook):
    procs = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(procs)
    try:
        workers = procs.spawn("loud", Worker)
        workers.fail.broadcast()
        wait_for(lambda: hook, 30, "the broadcast's MeshFailure")
        (failure,) = hook
        assert failure.mesh_name == "loud" and failure.rank == 0 and failure.label == "gpu=0"
        assert "raised in fail (a broadcast) (ranks 0-1 did): ValueError: no work on gpu {0,1}" == failure.what, (
            failure.what
        )
        assert workers.where.call().get(timeout=30).values() == [0, 1]
    finally:
        procs.exit()
    assert wait_gone(pids) == []


def test_the_default_hook_prints_the_failure_and_the_process_goes_on(capfd):
    procs = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(procs)
    err: list[str] = []
    try:
        workers = procs.spawn("printed", Worker)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: err.append(capfd.readouterr().err) or "unhandled MeshFailure" in "".join(err), 60, "stderr")
        assert "actor mesh 'printed' (Worker) on {gpu: 2}: rank 1 (gpu=1) killed by SIGKILL" in "".join(err)
        assert workers.slice(gpu=0).where.call_one().get(timeout=30) == 0
    finally:
        procs.exit()
    assert wait_gone(pids) == []


def test_in_the_notebook_a_death_shows_once_where_the_user_looks_and_the_kernel_lives():
    """A worker dies while a cell runs: shown in that cell. One dies while no cell runs: nothing is appended to
    an old cell's output (a reader would take it for that cell's); the next cell run opens with it, once."""
    from helpers.kernel_client import monarch_kernel

    wait_shown = (
        "import time\n"
        "from monarch.runtime.actors import supervision\n"
        "deadline = time.monotonic() + 60\n"
        "while supervision.delivered < {n} and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    define = (
        "import os, signal\n"
        "from monarch.actor import Actor, endpoint, this_host\n"
        "from monarch.runtime.actors import supervision\n"
        "class W(Actor):\n"
        "    @endpoint\n"
        "    def pid(self):\n"
        "        return os.getpid()\n"
        "procs = this_host().spawn_procs({'gpu': 3})\n"
        "ws = procs.spawn('nb_workers', W)\n"
        "pids = ws.pid.call().get().values()\n"
        "os.kill(pids[1], signal.SIGKILL)\n"
    )
    with monarch_kernel() as k:
        r = k.run(define + wait_shown.format(n=1), timeout=90)
        assert r.status == "ok", r.text()
        text = " ".join(r.text().split())  # (as one line: it is wrapped to fit an output area)
        assert text.count("MeshFailure: actor mesh 'nb_workers' (W) on {gpu: 3}: rank 1 (gpu=1) killed by SIGKILL") == 1
        assert "unhandled_fault_hook to handle it yourself" in text and "monarch: MeshFailure" not in text, text
        pids = k.value("pids")
        r = k.run("print(ws.slice(gpu=0).pid.call_one().get() == pids[0])")  # the kernel and the rest go on
        assert r.status == "ok" and "True" in r.text(), r.text()

        # while no cell runs (a silent request runs no cell: IPython fires no pre_run_cell for it)
        os.kill(pids[2], signal.SIGKILL)
        late: list[dict] = []

        def delivered() -> int:
            msg_id = k.kc.execute("", silent=True, user_expressions={"n": "supervision.delivered"})
            while True:
                reply = k.kc.get_shell_msg(timeout=30)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            while k.kc.iopub_channel.msg_ready():  # whatever the kernel publishes meanwhile
                late.append(k.kc.get_iopub_msg(timeout=1))
            return int(reply["content"]["user_expressions"]["n"]["data"]["text/plain"])

        wait_for(lambda: delivered() == 2, 60, "the second failure delivered")
        assert [m for m in late if m["msg_type"] in ("stream", "display_data", "error")] == [], late
        r = k.run("print('the next cell')")
        text = " ".join(r.text().split())
        assert r.status == "ok" and text.count("killed by SIGKILL") == 1, text
        assert text.startswith("MeshFailure at ") and ", while no cell ran: actor mesh 'nb_workers'" in text, text
        assert "rank 2 (gpu=2) killed by SIGKILL" in text and text.rstrip().endswith("the next cell"), text
        assert "killed" not in k.run("print('and the one after')").text()  # shown once
        assert k.run("procs.exit()").status == "ok"
    assert wait_gone(pids) == []
