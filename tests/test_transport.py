"""Transport: signed messages, TCP and IPC on one code path, private socket directory."""

import os
import pickle
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import zmq

import monarch
from monarch.runtime.controller import get_controller
from monarch.runtime.wire import codec, protocol

from conftest import REPO


def test_import_monarch_is_light():
    code = (
        "import sys, monarch, monarch.actor; print(sorted(m for m in ('torch', 'zmq', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr


def test_signature_checked_before_unpickling(mesh8, tmp_path):
    ctl = get_controller()
    transport = ctl.backend.transport
    assert stat.S_IMODE(os.stat(ctl.backend.dir).st_mode) == 0o700
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    header = protocol.pack(protocol.Reply(10**9, True))
    mesh_id = mesh8.spawned.mesh_id
    forged = codec.encode(os.urandom(32), mesh_id, 0, 10**6, header, [pickle.dumps(Evil())])  # wrong key
    raw = [b"\0" * 32 + pickle.dumps(Evil())]  # no valid signature at all
    s = transport.ctx.socket(zmq.PUSH)
    s.connect(transport.reply_addr)
    for frames in (forged, raw):
        s.send_multipart(frames)
    s.close(linger=1000)

    @monarch.remote
    def ok():
        return 1

    assert ok.on(mesh8)().values() == [1] * 8  # the controller kept working
    assert not marker.exists()
    try:
        codec.decode(transport._meshes[mesh_id].key, forged)
    except codec.BadSignature:
        pass
    else:
        raise AssertionError("a forged message passed the signature check")


def test_large_tensors_are_out_of_band():
    import torch

    t = torch.randn(1024, 1024)
    frames = codec.encode(b"k" * 32, 0, 0, 1, ("x",), codec.dumps({"t": t}))
    assert len(frames) == 2 and len(frames[0]) < 1000 and frames[1].nbytes == t.nbytes
    env = codec.decode(b"k" * 32, frames)
    assert torch.equal(codec.loads(env.body, env.buffers)["t"], t)


def _tensors():
    import torch

    base = torch.arange(24.0).reshape(4, 6)
    return {
        "float": torch.arange(4.0),
        "bfloat16": torch.randn(5).to(torch.bfloat16),  # (no numpy dtype: sent as its bytes)
        "bool": torch.tensor([True, False, True]),
        "0-dim": torch.tensor(3.5),
        "0-dim int": torch.tensor(5),  # (bytearray() of such an array would make 5 zero bytes)
        "0-dim zero": torch.tensor(0),
        "0-dim bool": torch.tensor(True),
        "empty": torch.empty(0, 3),
        "strided view": base[:, ::2],
        "offset view": base[1:3, 1:5],  # (its own elements only, from the middle of a storage)
        "complex conjugate": torch.tensor([1 + 2j, 3 - 1j]).conj(),  # (numpy refuses its conjugate bit)
        "float8": torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn),
        "large": torch.randn(300, 300),  # out of band
        "needs grad": torch.ones(3, requires_grad=True),  # torch's own pickling
    }


@pytest.mark.parametrize("kind", list(_tensors()))
def test_a_tensor_alone_comes_back_equal_through_the_c_pickler(kind):
    """A result that is one tensor skips cloudpickle (`codec._Reduced`): whatever its kind, it comes back
    equal, with its dtype, shape and strides of its own, and large ones out of band."""
    t = _tensors()[kind]
    parts = codec.dumps(t)
    assert len(parts) == (2 if kind == "large" else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch warns of a buffer that is not writable: a small one's is its own)
        back = codec.loads(parts[0], parts[1:])
    assert back.dtype == t.dtype and back.shape == t.shape and back.requires_grad == t.requires_grad
    assert back.is_contiguous() and torch_equal(back, t)
    flat = back.detach().reshape(-1)
    flat[:1] = flat[:1].clone()  # writable memory (a write to a read-only buffer would crash)
    assert torch_equal(back, t)
    listed = codec.dumps([t])  # (inside a list: cloudpickle's way, the same)
    assert torch_equal(codec.loads(listed[0], listed[1:])[0], back)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a.detach(), b.detach())


TCP = textwrap.dedent(
    """
    import monarch
    from monarch.actor import this_host
    from monarch.runtime.controller import get_controller
    import torch, torch.distributed as dist

    mesh = this_host().spawn_procs({"host": 2, "gpu": 2})
    print("ADDR", get_controller().backend.transport.cmd_addr)

    @monarch.remote
    def red(g):
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        return t.item()

    print("SUM", red.on(mesh)(mesh.process_group("host")).values())
    mesh.exit()
    """
)


def test_tcp_transport(tmp_path):
    script = tmp_path / "tcp.py"
    script.write_text(TCP)
    env = dict(os.environ, MONARCH_TRANSPORT="tcp", MONARCH_BIND_ADDR="127.0.0.1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "ADDR tcp://127.0.0.1:" in r.stdout
    assert "SUM [2.0, 2.0, 2.0, 2.0]" in r.stdout


def test_waiting_for_a_long_call_does_not_burn_cpu(mesh8):
    """The caller polls for replies only briefly and only while they are coming; a call that takes
    seconds is waited for asleep (in a blocking receive that wakes every 20 ms), not polled for."""
    import time

    @monarch.remote
    def nap(seconds):
        time.sleep(seconds)

    receiver = get_controller().receiver
    cpus, receiver.cpus = receiver.cpus, len(mesh8) + 1  # (as on a machine where polling pays)
    try:
        nap.on(mesh8)(0)
        before = receiver.polls
        nap.on(mesh8)(1.0)
        polls = receiver.polls - before
    finally:
        receiver.cpus = cpus
    assert polls > 0
    # polling before every 20 ms sleep would be ~50 polls; polling only at the start and while the burst
    # of 8 replies comes in at the end (once after each) is about 9
    assert polls <= len(mesh8) + 3, f"the waiting caller polled {polls} times in a 1 s wait"


def test_a_caller_polls_for_replies_only_while_its_workers_leave_a_cpu_free(mesh8):
    """Polling for replies takes a CPU: with as many local workers as CPUs it would take one from the workers
    it waits for, so the caller sleeps at once; with a CPU to spare, it polls."""

    @monarch.remote
    def noop():
        return None

    receiver = get_controller().receiver
    cpus = receiver.cpus
    try:
        receiver.cpus = len(mesh8)
        before = receiver.polls
        for _ in range(20):
            noop.on(mesh8)()
        assert receiver.polls == before, "the caller polled while its 8 workers had every CPU"

        def polled(call) -> bool:
            # (a reply the background thread handled before the caller came to wait is not polled for, which a
            # loaded machine makes likelier: one of many calls must poll)
            for _ in range(100):
                call()
                if receiver.polls > before:
                    return True
            return False

        assert polled(lambda: noop.on(mesh8.slice(gpu=0))()), "calls to one worker with 7 CPUs to spare polled not once"
        receiver.cpus = len(mesh8) + 1
        before = receiver.polls
        assert polled(lambda: noop.on(mesh8)()), "the caller never polled though a CPU was free beside its workers"
    finally:
        receiver.cpus = cpus


def test_output_that_overtakes_a_workers_ready_does_not_get_ready_dropped(tmp_path):
    """`Ready` goes up the command socket and output up the reply socket, numbered from one counter: output sent
    just after `Ready` may arrive first. Each socket's numbers are checked on their own, so neither is taken
    for a replay (the spawn waited forever when `Ready` was)."""
    from monarch.runtime.common.config import from_env
    from monarch.runtime.wire.controller_end import ControllerTransport
    from monarch.runtime.wire.worker_end import WorkerTransport

    os.chmod(tmp_path, 0o700)
    ctl = ControllerTransport(from_env({}), str(tmp_path))
    (keys,) = ctl.add_mesh(7, 1)
    worker = WorkerTransport(keys)
    try:
        worker.hello(protocol.Ready({"pid": 1}))  # number 1, up the command socket
        worker.send(protocol.Output(None, "stdout", "printed at start\n"))  # number 2, up the reply socket
        end, reply = time.monotonic() + 30, None
        while reply is None and time.monotonic() < end:  # the output is taken first: this worker's number 2
            reply = ctl.recv(block=False) or time.sleep(0.01)
        assert type(reply.message).__name__ == "Output"
        assert [type(e.message).__name__ for e in _read_cmd_for(ctl, 30.0)] == ["Ready"]  # then number 1
        worker.hello(protocol.Ready({"pid": 1}))  # a real replay is still refused: number 3 is new, 1 is not
        assert [type(e.message).__name__ for e in _read_cmd_for(ctl, 30.0)] == ["Ready"]
    finally:
        worker.close()
        ctl.close()
        ctl.close_store()
        ctl.terminate()  # as the backend does: a context left to the garbage collector can block the exit


def _read_cmd_for(ctl, seconds: float) -> list:
    end, out = time.monotonic() + seconds, []
    while time.monotonic() < end and not out:
        out = ctl.read_cmd()
        time.sleep(0.01)
    return out


@pytest.mark.parametrize("first_byte", [None, 2], ids=["random-topics", "topics-starting-like-a-hello"])
def test_a_workers_hello_read_before_other_workers_subscriptions_keeps_each_on_its_connection(
    tmp_path, monkeypatch, first_byte
):
    """libzmq's XPUB_MANUAL pairs a received message with its connection only for (un)subscriptions, but takes
    the next pairing at every receive: a plain upstream hello read before two other workers' subscriptions made
    rank 1's topic apply to rank 2's connection (rank 1 never got its commands; rank 2 got them). A hello is
    subscription-shaped (`keys.HELLO`), so the pairings hold. Here the order is made certain: the fake workers
    are inproc sockets, whose messages are queued at the controller's socket in the order sent. A topic may
    begin with the hello's second byte (1 in 256): it is still a subscription (a hello is longer)."""
    from monarch.runtime.common.config import from_env
    from monarch.runtime.wire import controller_end
    from monarch.runtime.wire.controller_end import ControllerTransport
    from monarch.runtime.wire.keys import HELLO

    if first_byte is not None:  # every topic starts with the hello's second byte: still a subscription
        urandom = os.urandom
        monkeypatch.setattr(controller_end.os, "urandom", lambda n: bytes([first_byte]) + urandom(n - 1))
    os.chmod(tmp_path, 0o700)
    ctl = ControllerTransport(from_env({}), str(tmp_path))
    keys = ctl.add_mesh(9, 3)
    monkeypatch.undo()
    ctl.cmd.bind("inproc://test-hello-pairing")
    socks = []
    try:
        for k in keys:  # rank 0 subscribes and says hello, then ranks 1 and 2 subscribe
            s = ctl.ctx.socket(zmq.XSUB)
            s.setsockopt(zmq.LINGER, 0)
            s.connect("inproc://test-hello-pairing")
            for topic in (k.mesh_topic, k.rank_topic):
                s.send(b"\x01" + topic)
            if k.rank == 0:
                (frame,) = codec.encode(k.key, k.mesh_id, k.rank, 1, protocol.pack(protocol.Ready({"pid": 1})))
                s.send(HELLO + frame)
            socks.append(s)
        assert [type(e.message).__name__ for e in _read_cmd_for(ctl, 30.0)] == ["Ready"]
        ctl.send(9, (1,), protocol.Exit())  # to rank 1 alone: its own topic
        assert socks[1].poll(30_000) and not socks[2].poll(200) and not socks[0].poll(0)
    finally:
        for s in socks:
            s.close(0)
        ctl.close()
        ctl.close_store()
        ctl.terminate()
