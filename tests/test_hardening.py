"""The transport under attack from the same machine: another user, junk, fakes, replays, a frozen worker.

Each test plays the attacker found by probing the runtime (issue 10), then checks that meshes keep
working, memory stays bounded and no process is left behind. Tests that need another uid run as root
(they start a child that drops to `nobody`) and are skipped otherwise, saying so.
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

import monarch
from monarch.actor import this_host
from monarch.runtime.common.config import Settings
from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.controller import Controller, get_controller
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.wire import codec, protocol

from conftest import wait_for, wait_gone, worker_pids

root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root, to act as another user (nobody)")


TESTS = os.path.dirname(os.path.abspath(__file__))


def as_nobody(attack: str, *args) -> subprocess.Popen:
    """Run `helpers.attacker.<attack>(*args)` as uid/gid `nobody` in a fresh interpreter (a fork of this threaded
    process could hang on a lock another thread held), and wait until it says it is in place."""
    return _attacker(attack, args, "attacker.become_nobody(); ")


def as_ourselves(attack: str, *args) -> subprocess.Popen:
    """`as_nobody`, as a process of our own user (which can reach our private directory)."""
    return _attacker(attack, args, "")


def _attacker(attack: str, args: tuple, become: str) -> subprocess.Popen:
    code = (
        f"import json, sys; from helpers import attacker; {become}"
        "print(json.dumps(getattr(attacker, sys.argv[1])(*json.loads(sys.argv[2]))))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, attack, json.dumps(args)], cwd=TESTS, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line, deadline = b"", time.monotonic() + 60
    while not line.endswith(b"\n") and select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
        byte = os.read(proc.stdout.fileno(), 1)  # (byte by byte: what follows stays for communicate())
        if not byte:
            break
        line += byte
    if line != b"ready\n":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the attacker process did not start: {err[-2000:]}")
    return proc


def result_of(proc: subprocess.Popen, timeout: float = 60) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the attacker process did not finish") from None
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


def _said_at_most_once_per_interval(lines: list[str], since: float) -> bool:
    """Whether `lines` ("<who>: dropped <kind>: ...") say each kind at most once per `RateLimitedLog` interval
    since `since` (time.monotonic()): how many lines that allows follows from how long the test took, which is
    the machine's business."""
    from collections import Counter

    from monarch.runtime.common.log import RateLimitedLog

    allowed = 1 + (time.monotonic() - since) // RateLimitedLog("").interval
    said = Counter((who, rest.split(":")[0]) for who, _, rest in (ln.partition(": dropped ") for ln in lines))
    return all(n <= allowed for n in said.values())


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A":  # LISTEN
                inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            out.add(m.group(1))
    return out


@monarch.remote
def echo(x):
    return len(x) if isinstance(x, bytes) else x


# -- the rendezvous store --------------------------------------------------------------------------
@root_only
def test_another_user_cannot_reach_the_store_or_the_sockets_of_a_local_mesh(mesh):
    """The store was a TCPStore on every interface taking keys from anyone. Now nothing of the controller
    listens on TCP in IPC mode, and its sockets sit in a directory another user cannot open."""
    echo.on(mesh)(1).values()
    backend = get_controller().backend
    assert not (_socket_inodes(os.getpid()) & _listening_tcp_inodes()), "the controller listens on TCP"
    store_path = backend.transport.store_addr.removeprefix("ipc://")

    assert result_of(as_nobody("local_mesh", backend.dir, store_path)) == {"listdir": "refused", "connect": "refused"}
    lanes_path = backend.transport.lanes.path  # (the workers' lanes: wire/lanes.py)
    assert os.path.dirname(lanes_path) == backend.dir
    assert result_of(as_nobody("lane", lanes_path)) == {"connect": "refused"}
    assert echo.on(mesh)(2).values() == [2] * len(mesh)


@root_only
def test_a_lane_opened_by_another_user_is_closed_unread():
    """Were the lanes' socket reachable (its directory is not: above), a connection from another uid is
    closed as it is accepted (SO_PEERCRED), before a byte of it is read."""
    from monarch.runtime.wire.lanes import LaneServer

    where = tempfile.mkdtemp()
    os.chmod(where, 0o755)
    server = LaneServer(os.path.join(where, "lanes"))
    os.chmod(server.path, 0o666)  # open to everyone, on purpose
    try:
        attacker = as_nobody("lane", server.path)
        deadline = time.monotonic() + 60
        while not server.refused and time.monotonic() < deadline:
            server.pump(0.1)
        assert result_of(attacker) == {"connect": "allowed", "closed": True}
        assert server.refused == 1 and not server.lanes and not server.messages
    finally:
        server.close()
        os.rmdir(where)


def test_a_process_of_ours_claiming_huge_or_endless_messages_on_the_lanes_socket_changes_nothing(capfd):
    """Before: a 12-byte header claiming 512 MiB and a byte raised the controller's memory by 512 MB; one
    claiming just under 1 TiB raised MemoryError on every read, ~12,000 tracebacks in seconds, every later
    call failed and the lane was never dropped. A connection that has not signed a message may claim 1 MiB,
    its buffer grows only as bytes come, and one that misbehaves is closed, said once (rate-limited). The same
    claims against a ZeroMQ socket of ours (its buffers are made lazily) cost nothing either."""
    began = time.monotonic()
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    transport = get_controller().backend.transport
    try:
        assert echo.on(mesh)(1).values() == [1, 1]
        before = _rss_mib()
        attacker = as_ourselves("lane_flood", transport.lanes.path)
        # (meshes serve while it attacks, and while its idle half-header connection stays open)
        for i in range(20):
            assert echo.on(mesh)(i).values() == [i, i]
        got = result_of(attacker, timeout=300)
        assert got == {
            "claim_512_mib": "closed", "claim_1_tib": "closed", "many_frames": "closed",
            "endless_message": "closed", "endless_junk": "closed", "reconnects": 200,
        }  # fmt: skip
        # ZeroMQ's sockets (host agents' replies, the store) make a message's buffer from its header too, but
        # lazily: an impossible claim closes the connection, a possible one costs nothing until bytes come.
        claims = as_ourselves("zmq_claims", transport.reply_addr.removeprefix("ipc://"))
        assert echo.on(mesh)(4).values() == [4, 4]
        assert _rss_mib() - before < 100, f"the controller's memory grew from {before:.0f} to {_rss_mib():.0f} MiB"
        assert result_of(claims) == {"claim_512_mib": "open", "claim_1_tib": "closed"}
        assert echo.on(mesh)(b"\0" * (20 << 20)).values() == [20 << 20] * 2  # (a large reply: a lane grows still)
        assert _rss_mib() - before < 100, f"the controller's memory grew from {before:.0f} to {_rss_mib():.0f} MiB"
        lanes = transport.lanes.lanes
        wait_for(lambda: all(lane.owner is not None for lane in lanes.values()), what="only workers' lanes left")
        again = this_host().spawn_procs({"gpu": 2})  # spawning still works
        assert echo.on(again)(3).values() == [3, 3]
        again_pids = worker_pids(again)
        again.exit()
    finally:
        mesh.exit()
    assert wait_gone(pids + again_pids) == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "MemoryError" not in err, err[-3000:]
    closed = [ln for ln in err.splitlines() if "dropped a lane" in ln]
    assert closed and "an unproven connection sent" in closed[0] and "; closed" in closed[0], err[-3000:]
    assert _said_at_most_once_per_interval(closed, began), f"{len(closed)} lines about closed lanes for 205 connections"


@root_only
def test_another_user_cannot_open_the_memory_a_reduce_shares(mesh):
    """One machine's workers reduce through a memfd: named in no filesystem, reachable only through /proc by
    the same user. Another user finds nothing under /dev/shm and cannot open it through /proc either."""
    import torch

    with mesh.activate():
        summed = torch.ones(4).reduce(("host", "gpu"), "sum")
    assert monarch.inspect(summed).tolist() == [4.0] * 4
    pid = worker_pids(mesh)[1]
    with open(f"/proc/{pid}/maps") as f:
        assert "/memfd:monarch-reduce (deleted)" in f.read()  # (the reduce went through it)
    assert result_of(as_nobody("shared_memory", pid)) == {"dev_shm": [], "map_files": "refused", "fd": "refused"}
    assert monarch.inspect(summed, host=1, gpu=1).tolist() == [4.0] * 4


@root_only
def test_another_user_can_neither_read_commands_nor_use_the_store_over_tcp():
    """In TCP mode anyone on the machine could subscribe and read function pickles and arguments. Now
    sockets are CURVE-encrypted and admit only a running mesh's key pair: a stranger who even knows the
    server's public key and the mesh's topic (leaked here on purpose) gets nothing, and the store does not
    answer it."""
    ctl = Controller(Settings(transport="tcp", bind_addr="127.0.0.1"))
    try:
        spawned = ctl.spawn({"gpu": 2})
        mesh = ProcMesh(spawned, spawned.shape)
        transport = ctl.backend.transport
        leaked = transport._meshes[spawned.mesh_id]
        server_public, topic = transport.curve.public, leaked.topic
        cmd_addr, store_addr = transport.cmd_addr, transport.store_addr
        assert cmd_addr.startswith("tcp://127.0.0.1:")
        secret = b"SECRET-ARGUMENT-" + os.urandom(8).hex().encode()

        args = (server_public.decode(), topic.hex(), cmd_addr, store_addr, secret.hex())
        refused: list[bytes] = []
        admits = transport.curve.callback

        def callback(domain: str, key: bytes) -> bool:  # (the server's ZAP check of a client's key)
            if not admits(domain, key):
                refused.append(key)
                return False
            return True

        transport.curve.callback = callback
        attacker = as_nobody("tcp_mesh", *args)
        # Commands with the secret go out once the stranger's subscription and store request were turned away,
        # while it still listens (until result_of ends its input): not for a while each, hoping they overlap.
        wait_for(lambda: len(refused) >= 2, what="the stranger's key pair turned away")
        for _ in range(20):
            assert echo.on(mesh)(secret).values() == [len(secret)] * 2
        assert result_of(attacker) == {"received": 0, "saw_secret": False, "store_answered": False}
        pids = [i["pid"] for i in spawned.info]
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


# -- fakes, junk and a subscriber that never reads -----------------------------------------------------
def test_fake_subscriptions_upstream_junk_and_a_never_reading_subscriber_change_nothing(capfd):
    """Before: a fake subscription (b"\\x011:x|") made every later spawn raise ValueError, junk sent up the
    command socket was kept until the next spawn (512 MB), and a subscriber that never read made the
    controller queue without bound (780 MB over 40 calls)."""
    began = time.monotonic()
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    transport = get_controller().backend.transport
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.XSUB)
    attacker.setsockopt(zmq.RCVHWM, 1)  # and it never reads
    attacker.connect(transport.cmd_addr)
    for fake in (b"\x011:x|", b"\x01", b"\x01" + os.urandom(16), b"\x00", b"\x02not signed"):
        attacker.send(fake)
    junk = ctx.socket(zmq.PUSH)  # forged and garbage replies
    junk.connect(transport.reply_addr)
    try:
        echo.on(mesh)(1).values()
        before = _rss_mib()
        for _ in range(20):
            attacker.send(b"\x07" * (10 << 20), copy=False)  # 200 MB of junk up the command socket
        for i in range(2000):
            junk.send(b"x" * (i % 50))
        for _ in range(40):  # 800 MB of arguments, each a fresh object: kept if queued for the attacker
            assert echo.on(mesh)(b"\0" * (20 << 20)).values() == [20 << 20] * 2
        # The monitor drains the command socket twice a second: once it has, the controller holds nothing of
        # the junk nor of the arguments (queued without bound, they would never be given back).
        wait_for(
            lambda: _rss_mib() - before < 300, what=f"the controller's memory back within 300 MiB of {before:.0f} MiB"
        )
        assert not attacker.poll(200), "the fake subscriber received a command"
        again = this_host().spawn_procs({"gpu": 2})  # spawning still works
        assert echo.on(again)(3).values() == [3, 3]
        again_pids = worker_pids(again)
        again.exit()
    finally:
        ctx.destroy(0)
        mesh.exit()
    assert wait_gone(pids + again_pids) == []
    err = capfd.readouterr().err
    dropped = [ln for ln in err.splitlines() if "dropped" in ln]
    assert any("subscription" in ln for ln in dropped) and any("junk" in ln for ln in dropped)
    assert _said_at_most_once_per_interval(dropped, began), f"{len(dropped)} lines about dropped messages: {dropped}"


# -- replays -------------------------------------------------------------------------------------------
@monarch.remote
def note(path, text):
    with open(path, "a") as f:
        f.write(text + "\n")


def test_a_replayed_command_is_refused(tmp_path, capfd, monkeypatch):
    """A signed command sent again (by someone who captured it) must not run again."""
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    transport = get_controller().backend.transport
    sent = []
    real = transport._send_all
    monkeypatch.setattr(transport, "_send_all", lambda *a: (sent.append(a), real(*a))[1])
    path = str(tmp_path / "ran")
    try:
        note.on(mesh.slice(gpu=0))(path, "once")
        monkeypatch.undo()
        with transport.send_lock:  # the same signed frames again, the way commands go (a lane, or the socket)
            real(*sent[-1])
        note.on(mesh.slice(gpu=0))(path, "later")  # after the replay, in order
        with open(path) as f:
            assert f.read().splitlines() == ["once", "later"]
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
    captured = capfd.readouterr()
    assert "dropped a replayed command" in captured.out + captured.err


def test_a_replayed_reply_is_refused(capfd):
    """A worker's signed message sent again up the reply socket is dropped, not taken as a new one."""
    mesh = this_host().spawn_procs({"gpu": 1})
    pids = worker_pids(mesh)
    ctl = get_controller()
    transport = ctl.backend.transport
    key = transport._meshes[mesh.spawned.mesh_id].key
    out = zmq.Context.instance().socket(zmq.PUSH)
    out.connect(transport.reply_addr)
    printed = []  # what was printed so far (readouterr() takes it)
    try:
        echo.on(mesh)(1).values()
        seen = transport._meshes[mesh.spawned.mesh_id].seen[0]
        stale = codec.encode(key, mesh.spawned.mesh_id, 0, seen, protocol.pack(protocol.Output(None, "stdout", "X\n")))
        out.send_multipart(stale)
        echo.on(mesh)(2).values()
        wait_for(
            lambda: printed.append(capfd.readouterr()) or any("dropped a replayed message" in c.err for c in printed),
            what="the replayed reply to be dropped",
        )
    finally:
        out.close(0)
        mesh.exit()
    assert wait_gone(pids) == []
    printed.append(capfd.readouterr())
    assert not any("[gpu=0] X" in c.out for c in printed)


# -- a frozen worker ---------------------------------------------------------------------------------
@monarch.remote
def nap(seconds):
    time.sleep(seconds)


def test_a_frozen_worker_is_reported_by_rank_and_its_mesh_stopped():
    """A worker stopped with SIGSTOP answers nothing; calls would wait for ever. It is noticed (its process
    state, checked twice a second) and named; the mesh's workers are stopped."""
    mesh = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(mesh)
    fut = nap.on(mesh).call_async(60)
    os.kill(pids[2], signal.SIGSTOP)
    try:
        with pytest.raises(WorkerDiedError) as e:
            fut.result(timeout=60)
        assert "rank 2 (gpu=2) of mesh {gpu: 4} is frozen: stopped (SIGSTOP" in str(e.value)
        assert e.value.ranks == [2]
        assert wait_gone(pids) == []
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert mesh.status() == ["stopped", "stopped", "failed", "stopped"]


# -- a killed controller's leftovers -------------------------------------------------------------------
def test_the_next_start_removes_what_a_killed_controller_left(tmp_path):
    """A controller killed with SIGKILL cleans nothing: its socket directory and fork server's directory
    stay. The next controller to start removes them (they name a process that is gone)."""
    from monarch.runtime.procs.workers import clean_stale_dirs, private_dir

    root = tempfile.gettempdir()
    # a short-lived process that makes two directories as a controller does, then dies (a fresh interpreter:
    # a fork of this threaded process could hang on a lock another thread held)
    code = "from monarch.runtime.procs.workers import private_dir; private_dir('monarch-'); private_dir('monarch-mp-')"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    child = proc.pid
    left = []
    for name in os.listdir(root):
        if name.startswith("monarch-"):
            try:
                with open(os.path.join(root, name, "owner")) as f:
                    if f.read().split()[0] == str(child):
                        left.append(os.path.join(root, name))
            except OSError:
                pass
    assert len(left) == 2
    mine = private_dir("monarch-")  # ours, alive: kept
    users = tempfile.mkdtemp(prefix="monarch-")  # named like ours but without an owner file: not ours
    old = time.time() - 3600
    os.utime(users, (old, old))
    try:
        removed = clean_stale_dirs()
        assert set(left) <= set(removed) and not any(os.path.exists(p) for p in left)
        assert os.path.isdir(mine) and os.path.isdir(users)
    finally:
        import shutil

        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(users, ignore_errors=True)
