"""Races: each ZeroMQ socket touched by one thread at a time, under load.

ZeroMQ sockets are not thread-safe: a socket used by two threads at once can abort the whole process
(libzmq asserts), and with it the user's kernel. These tests drive the paths where a second thread could
reach a socket (attaching and detaching a job's host agents while the store and the receiver serve) many
times in a child process, so that an abort fails the test instead of the test run.
"""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import monarch

from conftest import REPO, wait_gone

ATTACH_LOOP = textwrap.dedent(
    """
    import os, shutil, sys, threading, time
    import zmq
    from monarch.runtime.wire import protocol as P
    from monarch.runtime.procs.workers import private_dir
    from monarch.runtime.wire.store import StoreServer
    from monarch.runtime.wire.keys import AgentCurve
    from monarch.runtime.wire.controller_end import ControllerTransport
    from monarch.runtime.wire.worker_end import WorkerTransport
    from monarch.runtime.common.config import Settings

    sys.setswitchinterval(0.001)  # (threads take turns more often: more chances to meet on a socket)
    ROUNDS, CLIENTS = int(sys.argv[1]), 4
    d = private_dir("monarch-race-")
    transport = ControllerTransport(Settings(), d)
    store = StoreServer(transport)
    keys = transport.add_mesh(0, CLIENTS)

    # a host agent's three sockets, as its relay binds them (CURVE servers of the job's key pair)
    curve = AgentCurve.new()
    actx = zmq.Context()
    agent = {}
    for name, kind in (("cmd", zmq.XSUB), ("reply", zmq.PUSH), ("store", zmq.DEALER)):
        s = actx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        curve.serve(s)
        s.bind(f"ipc://{d}/agent-{name}")
        agent[name] = s
    endpoints = {name: s.getsockopt_string(zmq.LAST_ENDPOINT) for name, s in agent.items()}

    stop = threading.Event()
    served = [0] * CLIENTS
    errors = []
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}")

    def rendezvous(rank):  # a busy rendezvous: every client sets and reads keys without a pause
        w = WorkerTransport(keys[rank])
        conn = w.store_client()
        i = 0
        while not stop.is_set():
            i += 1
            conn.request(P.StoreSet(f"k/{rank}/{i % 50}", b"x" * 64), 30)
            conn.request(P.StoreCheck((f"k/{(rank + 1) % CLIENTS}/0",)), 30)
            served[rank] += 2
        conn.close()
        w.close()

    # (before issue 30 the receiver had a lock of its own, which nothing else took)
    recv_lock = getattr(transport, "recv_lock", None) or threading.RLock()

    def receiving():  # what the controller's receiving thread does, under its receive lock
        while not stop.is_set():
            with recv_lock:
                transport.set_timeout(1)
                transport.recv(True)

    threads = [threading.Thread(target=rendezvous, args=(r,)) for r in range(CLIENTS)]
    threads.append(threading.Thread(target=receiving))
    for t in threads:
        t.start()
    rounds = 0
    # (and on until the store has answered as many requests meanwhile: how fast its clients run next to this
    # loop is the machine's business; a store that stopped answering hangs the loop, and the test fails)
    while rounds < ROUNDS or (sum(served) <= ROUNDS and not errors):
        transport.connect_agent(endpoints, curve)
        transport.disconnect_agent(endpoints)
        rounds += 1
        time.sleep(0.0002)  # (let the other threads in)
    stop.set()
    for t in threads:
        t.join(30)
    alive = [t.name for t in threads if t.is_alive()]
    store.close()
    transport.close()
    transport.terminate()
    for s in agent.values():
        s.close(0)
    actx.term()
    shutil.rmtree(d, ignore_errors=True)
    print("ROUNDS", ROUNDS, "SERVED", sum(served), "STUCK", alive, "ERRORS", errors, flush=True)
    """
)


@pytest.mark.timeout(120)
def test_attaching_and_detaching_agents_while_the_store_serves_never_aborts():
    """Issue 30: "Fatal Python error: Aborted" in the store thread's poll, while a job's agents were
    attached (the store's socket was connected from the caller's thread, the reply socket while another
    thread received). On 5789c6b this child aborted, crashed, hung or lost its store in 4 runs of 6."""
    rounds = 800
    try:
        out = subprocess.run(
            [sys.executable, "-c", ATTACH_LOOP, str(rounds)], capture_output=True, text=True, timeout=80, cwd=REPO
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the attach loop hung:\n{e.stdout}\n{e.stderr}") from None
    assert out.returncode == 0, f"rc {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert f"ROUNDS {rounds} " in out.stdout, out.stdout + out.stderr[-3000:]
    assert "STUCK [] ERRORS []" in out.stdout, out.stdout + out.stderr[-3000:]
    served = int(out.stdout.split("SERVED ")[1].split()[0])
    assert served > rounds, out.stdout  # the store answered all along


BURST_THEN_EXIT = textwrap.dedent(
    """
    import sys
    import monarch
    from monarch.actor import this_host

    LINES = int(sys.argv[1])


    @monarch.remote
    def burst():
        rank = monarch.current_rank()["gpu"]
        for i in range(LINES):
            print(f"rank {rank} line {i} " + "x" * 80)
        print(f"LAST of rank {rank}", flush=True)


    mesh = this_host().spawn_procs({"gpu": 4})
    print("PIDS", " ".join(str(row["pid"]) for row in mesh.to_table().rows), flush=True)
    burst.on(mesh).call_async()  # nobody waits for it: the exit below stops the mesh right after
    mesh.exit()
    print("EXITED", flush=True)
    """
)


@pytest.mark.timeout(90)
def test_output_printed_just_before_a_mesh_exits_all_arrives(tmp_path):
    """Issue 30: a worker's last lines (its log line as it exits, a burst from a call nobody waited for)
    were dropped when the controller forgot the mesh before reading them. On 5789c6b ranks' "LAST" lines
    and their "exiting" log lines went missing in most runs."""
    lines = 20_000
    env = dict(os.environ, MONARCH_LOG="info")
    out = subprocess.run(
        [sys.executable, "-c", BURST_THEN_EXIT, str(lines)],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0 and "EXITED" in out.stdout, out.stderr[-3000:]
    pids = [int(p) for p in re.search(r"PIDS ([\d ]+)\n", out.stdout).group(1).split()]
    for rank in range(4):
        got = sum(1 for line in out.stdout.splitlines() if line.startswith(f"[gpu={rank}] rank {rank} line "))
        assert got == lines, f"rank {rank}: {got} of {lines} lines arrived"
        assert f"[gpu={rank}] LAST of rank {rank}" in out.stdout, f"rank {rank}'s last line was lost"
        assert re.search(rf"^\[gpu={rank}\] monarch\[worker gpu={rank}\] .* exiting, as the controller asked$",
                         out.stderr, re.M), f"rank {rank}'s last log line was lost:\n{out.stderr[-3000:]}"  # fmt: skip
    assert wait_gone(pids) == []


@monarch.remote
def _sum_over(group):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


@pytest.mark.timeout(90)
def test_the_store_drops_a_mesh_keys_when_it_stops():
    """Issue 30: the rendezvous store kept every key forever (155 keys after 31 meshes). A stopped mesh's
    keys go: its default group's, its dimensions' groups', its moves' links to another mesh. What stays is
    one mark per mesh that it is gone (so that a worker of another mesh waiting to meet it gives up)."""
    import torch

    from monarch.actor import this_host
    from monarch.runtime.controller import get_controller

    store = get_controller().backend.store
    before = dict(store.data)
    for _ in range(3):
        a = this_host().spawn_procs({"host": 2, "gpu": 2})
        b = this_host().spawn_procs({"host": 2, "gpu": 2})
        assert _sum_over.on(a)(a.process_group("gpu")).values() == [2.0] * 4
        with a.activate():
            x = torch.ones(2)
        moved = x.to_mesh(b)  # a link between the two meshes, per rank
        assert monarch.inspect(moved, host=1, gpu=1).tolist() == [1.0, 1.0]
        ids = (a.spawned.mesh_id, b.spawned.mesh_id)
        made = [k for k in store.data if k not in before]
        assert any(k.startswith(f"monarch/{ids[0]}/") for k in made), made
        assert any(k.startswith("monarch/link/") for k in made), made
        a.exit()
        b.exit()
        assert store.data == before, sorted(set(store.data) - set(before))
        assert all(f"monarch/gone/{i}" in store.marks for i in ids)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_attaching_to_a_job_again_and_again_leaks_no_descriptors(tmp_path):
    """Each detach from a job's agents left its wake-up pipe open (2 descriptors per attach on 5789c6b):
    a notebook that spawns on a job cell after cell ran out of descriptors in the end."""
    import monarch.notebook

    from helpers.agent_job import AgentJob

    job = AgentJob(tmp_path, "fds", hosts=2)
    job.start()
    try:

        def attach_spawn_exit():
            m = monarch.notebook.job("fds").spawn_procs({"gpu": 1})
            assert _sum_over.on(m)(m.process_group("host")).values() == [2.0, 2.0]
            m.exit()  # the job's last mesh here: the controller detaches

        attach_spawn_exit()  # (the first attach makes what every later one shares)
        before = _fds()
        for _ in range(12):
            attach_spawn_exit()
        deadline = time.monotonic() + 30  # ZeroMQ closes sockets in its own thread, a moment later
        while _fds() > before + 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _fds() <= before + 6, f"{_fds() - before} descriptors more after 12 attaches"
    finally:
        assert job.stop() == []
