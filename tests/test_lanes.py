"""Lanes (runtime/wire/lanes.py): local workers talk to the controller over one Unix stream connection each.

The framing on real sockets however the bytes arrive; Ctrl-C while a worker waits to write; local meshes on
lanes and, with MONARCH_LANES=0, on the sockets; a worker that takes no commands is dropped after the stall;
a lane that goes corrupt ends its worker, and its mesh fails naming it. Lanes under attack from another user:
tests/test_hardening.py.
"""

import os
import signal
import socket
import struct
import threading
import time

import pytest

import monarch
from monarch.runtime.common.config import Settings
from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.controller import Controller
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.wire import lanes

from conftest import wait_for, wait_gone

MESSAGES = [
    [b"small"],
    [os.urandom(100_000)],  # one frame, over the size that is copied into its header's bytes
    [b"head", os.urandom(300_000), b"", memoryview(os.urandom(5000))],
    [b"x" * 65535],
]


def _wire(messages: list) -> bytes:
    return b"".join(bytes(p) for m in messages for p in lanes.pack(m))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_reader_cuts_whole_messages_however_the_bytes_arrive(chunk):
    data = _wire(MESSAGES)
    a, b = socket.socketpair()
    got: list = []
    reader = lanes.Reader()

    def write():
        for i in range(0, len(data), chunk):
            a.sendall(data[i : i + chunk])
        a.close()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while True:
            frames = reader.next()
            if frames is not None:
                got.append(frames)
            elif not reader.fill(b):
                break
    finally:
        writer.join()
        b.close()
    assert got == [[bytes(p) for p in m] for m in MESSAGES]


def test_a_reader_gives_back_a_large_messages_memory_and_goes_on_reading():
    """After a message over 16 chunks the reader's buffer shrinks again (its kept view made anew)."""
    messages = [[b"a"], [os.urandom(3 * lanes.CHUNK * 16)], [b"b" * 10, b"c"], [os.urandom(lanes.CHUNK + 1)]]
    a, b = socket.socketpair()
    large_taken = threading.Event()

    def write():
        a.sendall(_wire(messages[:2]))
        large_taken.wait(30)  # (the rest after it: nothing else in the buffer when the large one is cut off)
        a.sendall(_wire(messages[2:]))
        a.close()

    writer = threading.Thread(target=write)
    writer.start()
    got, sizes = [], []
    reader = lanes.Reader()
    try:
        while True:
            frames = reader.next()
            if frames is not None:
                got.append(frames)
                sizes.append(len(reader.buf))
                if len(got) == 2:
                    large_taken.set()
            elif not reader.fill(b):
                break
    finally:
        large_taken.set()
        writer.join()
        b.close()
    assert got == messages
    assert sizes[1] == lanes.CHUNK and reader.view.obj is reader.buf  # shrunk right after the large one


@pytest.mark.parametrize("chunk", [1, 5, 4096, 1 << 20])
def test_a_worker_takes_each_checked_command_off_its_stream_in_order_however_the_bytes_arrive(tmp_path, chunk):
    """`LaneClient.recv_checked`: a one-frame message its check takes comes back as what the check made of it; one
    the check refuses, and one of several frames, as their frames; whatever `ready` cut out first, as its frames;
    then None once the controller closed the lane."""
    messages = [[b"take 1"], [b"refuse"], [b"take " + b"2" * 70_000], [b"a", b"b"], [b"take 3"], [b"take 4"]]
    data = _wire(messages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "lane"))
    listener.listen(1)
    client = lanes.LaneClient(str(tmp_path / "lane"))
    conn, _ = listener.accept()

    def write():
        for i in range(0, len(data), chunk):
            conn.sendall(data[i : i + chunk])
        conn.close()

    def check(view: memoryview):
        assert type(view) is memoryview  # (a view of the reader's buffer: no copy made for it)
        return ("took", bytes(view)) if bytes(view[:4]) == b"take" else None

    writer = threading.Thread(target=write)
    writer.start()
    got = []
    try:
        while True:
            while len(got) == 4 and not client.ready():  # ("take 3": read whole, cut out as frames by `ready`)
                assert client._fill()
            taken = client.recv_checked(check)
            if taken is None:
                break
            got.append(taken)
    finally:
        writer.join()
        client.close()
        listener.close()
    assert got == [
        ("took", b"take 1"),
        [b"refuse"],
        ("took", b"take " + b"2" * 70_000),
        [b"a", b"b"],
        [b"take 3"],
        ("took", b"take 4"),
    ]


@pytest.mark.parametrize(
    "head, why",
    [
        (struct.pack("<I", 0), "a message of 0 frames"),
        (struct.pack("<I", lanes.MAX_FRAMES + 1), f"a message of {lanes.MAX_FRAMES + 1} frames"),
        (struct.pack("<IQ", 1, 1 << 62), f"a message of {12 + (1 << 62)} bytes"),  # (not a buffer to allocate)
    ],
)
def test_bytes_that_frame_no_message_are_refused(head, why):
    a, b = socket.socketpair()
    a.sendall(head + bytes(64))
    reader = lanes.Reader()
    reader.fill(b)
    with pytest.raises(lanes.CorruptLane, match=why):
        reader.next()
    a.close()
    b.close()


def test_ctrl_c_while_a_worker_waits_to_write_leaves_every_message_whole(tmp_path):
    """A worker's send blocks while the controller does not read; Ctrl-C lands in the wait (the handler asks
    the lane to defer it, as the worker's does). The message is written whole all the same, then
    KeyboardInterrupt is raised; the stream stays in step for the next message."""
    server = lanes.LaneServer(str(tmp_path / "lanes"))
    client = lanes.LaneClient(server.path)
    # (far more than a socket holds, so the send waits for the reader; less than an unproven lane may claim)
    big = [b"first", os.urandom(768 << 10)]
    raised = []
    landed = threading.Event()

    def alarm(signum, frame):
        if client.defer_interrupt():
            landed.set()
        else:  # (not in the write yet: ring again)
            signal.setitimer(signal.ITIMER_REAL, 0.01)

    old = signal.signal(signal.SIGALRM, alarm)
    # The controller reads nothing until the interrupt has landed in the blocked write.
    reader = threading.Thread(target=lambda: landed.wait(30) and _pump_until(server, 2))
    reader.start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        try:
            client.send(big)
        except KeyboardInterrupt:
            raised.append(True)
        client.send([b"second"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        landed.set()
        reader.join()
    assert raised == [True]
    assert [frames for _, frames in server.messages] == [big, [b"second"]]
    client.close()
    server.close()


@pytest.mark.parametrize("spin", [0.0, 0.5])
def test_ctrl_c_while_a_worker_waits_for_a_command_interrupts_the_wait_and_loses_nothing(tmp_path, spin):
    """Waiting for a command (input() at a pdb prompt waits so) is interrupted at once, and what comes next
    is read whole; also while the worker polls for it (`spin`, here longer than the wait)."""
    server = lanes.LaneServer(str(tmp_path / "lanes"))
    client = lanes.LaneClient(server.path, spin)
    client.send([b"hello"])  # (whose lane it is: the controller binds it on its first message)
    _pump_until(server, 1)
    (lane,) = server.lanes.values()

    def alarm(signum, frame):
        while frame is not None and frame.f_code is not lanes.LaneClient._fill.__code__:
            frame = frame.f_back
        if frame is None:  # (not in the wait yet: ring again)
            signal.setitimer(signal.ITIMER_REAL, 0.01)
        elif not client.defer_interrupt():
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            client.recv()  # nothing comes
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    big = [b"next", os.urandom(1 << 20)]
    parts = lanes.pack(big)
    lane.send(parts, lanes.size(parts))
    stop = threading.Event()
    pumper = threading.Thread(target=lambda: [server.pump(0.05) for _ in iter(stop.is_set, True)])
    pumper.start()  # (writes what waits, as the controller's receiving thread does)
    try:
        assert client.recv() == big
    finally:
        stop.set()
        pumper.join()
    client.close()
    server.close()


def test_a_worker_that_polls_for_commands_takes_each_whole_then_sleeps(tmp_path):
    """`spin`: commands that come while the worker polls, and after it gave up and sleeps, arrive whole and
    in order; it polls only for `spin` seconds per wait (then its thread sleeps in poll()), and not at all
    after a wait longer than that."""
    server = lanes.LaneServer(str(tmp_path / "lanes"))
    client = lanes.LaneClient(server.path, 0.05)
    client.send([b"hello"])
    _pump_until(server, 1)
    (lane,) = server.lanes.values()
    got: list = []
    two = threading.Event()

    def read() -> None:
        for _ in range(3):
            got.append(client.recv())
            if len(got) == 2:
                two.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for frames in ([b"one"], [b"two", os.urandom(300_000)]):  # (the second: more than one read)
            parts = lanes.pack(frames)
            if lane.send(parts, lanes.size(parts)):
                while lane.out:
                    server.pump(0.01)
        assert two.wait(30)  # (a wait for the rest of "two" is no wait for "three")

        def asleep_in_poll() -> bool:
            with open(f"/proc/self/task/{reader.native_id}/wchan") as f:  # (where in the kernel it sleeps:
                return f.read().startswith("poll_schedule_timeout")  # spinning, it runs or waits for the GIL)

        wait_for(asleep_in_poll, what="the reader asleep in poll()")
        parts = lanes.pack([b"three"])
        lane.send(parts, lanes.size(parts))
    finally:
        reader.join(30)
    assert [f[0] for f in got] == [b"one", b"two", b"three"] and len(got[1][1]) == 300_000
    assert not client._quick  # "three" came after the polling: the next wait sleeps at once
    client.close()
    server.close()


def _pump_until(server: lanes.LaneServer, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(server.messages) < n and time.monotonic() < deadline:
        server.pump(0.1)


@monarch.remote
def on_a_lane():
    from monarch.runtime.worker import worker

    return worker.current.transport.lane is not None


@monarch.remote
def busy():
    threading.Event().wait()  # busy in a call until the worker is dropped (and killed)


@monarch.remote
def take(blob):
    return len(blob)


def _controller(**settings) -> Controller:
    return Controller(Settings(**settings))


@pytest.mark.parametrize("use_lanes", [True, False])
def test_local_workers_talk_over_lanes_unless_told_not_to(use_lanes):
    ctl = _controller(lanes=use_lanes)
    try:
        spawned = ctl.spawn({"gpu": 3})
        mesh = ProcMesh(spawned, spawned.shape)
        pids = [i["pid"] for i in spawned.info]
        assert on_a_lane.on(mesh)().values() == [use_lanes] * 3
        bound = ctl.backend.transport._meshes[spawned.mesh_id].lanes
        assert (bound is not None and all(lane is not None for lane in bound)) == use_lanes
        blob = os.urandom(3 << 20)  # a large argument and result both ways
        assert take.on(mesh)(blob).values() == [len(blob)] * 3
        assert take.on(mesh.slice(gpu=1))(b"x").values() == [1]  # to one worker
        mesh.exit()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


def test_a_worker_that_takes_no_commands_is_dropped_after_the_stall():
    """Commands wait in the controller for a worker busy in a call; past `send_hwm` of them the sender waits
    for it, and after `send_stall` seconds in which it took none, the worker is dropped, named."""
    ctl = _controller(send_hwm=3, send_stall=1.0)
    try:
        spawned = ctl.spawn({"gpu": 2})
        mesh = ProcMesh(spawned, spawned.shape)
        pids = [i["pid"] for i in spawned.info]
        one = mesh.slice(gpu=1)
        busy_call = busy.on(one).call_async()
        blob = os.urandom(1 << 20)  # each fills the socket's buffer: the rest wait in the controller
        with pytest.raises(WorkerDiedError) as e:  # (the call that waited for room raises, and any after it)
            for _ in range(50):
                take.on(one).call_async(blob)
        assert "rank 1 (gpu=1)" in str(e.value) and "took no commands for 1 s while 3 were queued" in str(e.value)
        with pytest.raises(WorkerDiedError, match="took no commands"):
            busy_call.result(timeout=60)
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


def test_meshes_start_with_the_smallest_command_queue():
    """`send_hwm` bounds commands, not the store's answers: a worker's rendezvous (torch's process group, over
    the controller's store) gets every answer however small it is."""
    import torch  # noqa: F401  (workers set torch up, and so rendezvous, when the controller has it)

    ctl = _controller(send_hwm=1, spawn_timeout=60)
    pids = []
    try:
        for _ in range(5):
            spawned = ctl.spawn({"gpu": 4})
            pids += [i["pid"] for i in spawned.info]
            assert [i["torch"] for i in spawned.info] == [True] * 4
            ProcMesh(spawned, spawned.shape).exit()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


def test_a_lane_that_goes_corrupt_ends_its_worker_and_the_mesh_fails_naming_it():
    ctl = _controller()
    try:
        spawned = ctl.spawn({"gpu": 2})
        mesh = ProcMesh(spawned, spawned.shape)
        pids = [i["pid"] for i in spawned.info]
        lane = ctl.backend.transport._meshes[spawned.mesh_id].lanes[0]
        with lane.lock:
            lane.sock.setblocking(True)
            lane.sock.sendall(struct.pack("<I", 0) + bytes(16))  # no message has 0 frames
            lane.sock.setblocking(False)
        wait_for(lambda: mesh.status()[0] == "failed", what="rank 0 to be reported lost")
        with pytest.raises(WorkerDiedError, match=r"rank 0 \(gpu=0\)"):
            take.on(mesh)(b"x").values()
    finally:
        ctl.shutdown()
    assert wait_gone(pids) == []


# -- a bound lane's messages, checked in one step each (`codec.one_sender`) ----------------------------------
def test_a_bound_lane_checks_each_message_as_the_sockets_do(tmp_path):
    """Once a lane belongs to a worker, its one-frame messages are checked in one call each. Everything the
    sockets refuse is refused there too, named in the log, and what follows still arrives, in order: a forged
    signature, a replay, another rank's message, a header that does not unpickle or is no message; large
    and many-frame messages, and `Goodbye`, take the general path."""
    from monarch.runtime.wire import codec, protocol
    from monarch.runtime.wire.controller_end import DROPPED, ControllerTransport

    transport = ControllerTransport(Settings(), str(tmp_path))
    logged: list[str] = []
    transport.log = lambda kind, detail: logged.append(f"{kind}: {detail}")  # (the log's sink, read below)
    keys = transport.add_mesh(7, 2, lanes=True)
    mesh = transport._meshes[7]
    clients = [lanes.LaneClient(transport.lanes.path) for _ in range(2)]
    seq = [0, 0]

    def signed(rank, message, body=None, key=None, number=None):
        if number is None:
            seq[rank] += 1
        return codec.encode(
            key or keys[rank].key, 7, rank, seq[rank] if number is None else number, protocol.pack(message), body
        )

    def received(n):
        got, deadline = [], time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            env = transport.recv(False) or transport.recv(True)
            if env is not None and env is not DROPPED:
                got.append(env)
        return got

    def out(text):
        return protocol.Output(None, "stdout", text)

    try:
        transport.set_timeout(100)
        clients[0].send(signed(0, out("first")))  # binds the lane to rank 0
        assert [e.message.text for e in received(1)] == ["first"]
        lane = mesh.lanes[0]
        assert lane is not None and lane.take is not None  # bound: the one-step path from now on

        replay = signed(0, out("again"))
        clients[0].send(replay)
        clients[0].send(replay)  # the same number again
        clients[0].send(signed(0, out("forged"), key=os.urandom(32)))
        clients[0].send(signed(1, out("rank 1's"), number=99))  # rank 1's own key: signed right, wrong lane
        seq[0] += 1
        clients[0].send([codec._sign(keys[0].key, [m := codec._ENVELOPE.pack(7, 0, seq[0], 3) + b"zzz"]) + m])
        clients[0].send(codec.encode(keys[0].key, 7, 0, seq[0] + 1, (9999, 1)))  # no message has that tag
        seq[0] += 1
        big = "x" * 100_000  # one frame over 64 KiB: signed with HMAC-SHA256
        later = [
            signed(0, out(big)),
            signed(0, protocol.Reply(5, True), codec.dumps(bytearray(os.urandom(50_000)))),  # 2 frames
            signed(0, out("last")),
        ]
        writer = threading.Thread(target=lambda: [clients[0].send(m) for m in later])  # (more than a socket holds)
        writer.start()
        got = received(4)
        writer.join(30)
        assert [type(e.message).__name__ for e in got] == ["Output", "Output", "Reply", "Output"]
        assert [got[0].message.text, got[1].message.text == big, got[3].message.text] == ["again", True, "last"]
        assert len(codec.loads(got[2].body, got[2].buffers)) == 50_000
        assert [line.split(":")[0] for line in logged] == [
            "a replayed message",
            "a message",
            "a message",
            "a message",
            "a message",
        ]
        assert "bad signature" in logged[1] and "wrote on the lane of rank 0" in logged[2]
        assert "header could not be read" in logged[3] and "not a message" in logged[4]

        # A Goodbye read in one go with the messages before it counts only once they were handled (the mesh
        # is forgotten after it: anything still queued would be lost).
        for message in (out("a"), out("b"), protocol.Goodbye()):
            clients[0].send(signed(0, message))
        assert transport.recv(True).message.text == "a" and 0 not in mesh.goodbyes
        assert transport.recv(True).message.text == "b" and 0 not in mesh.goodbyes
        deadline, delivered = time.monotonic() + 30, []
        while 0 not in mesh.goodbyes and time.monotonic() < deadline:
            delivered.append(transport.recv(True))
        assert 0 in mesh.goodbyes and all(d is None or d is DROPPED for d in delivered)  # (the transport's own)
    finally:
        for c in clients:
            c.close()
        transport.close()
        transport.close_store()
        transport.terminate()


def test_a_workers_one_frame_message_is_signed_as_encode_signs_it(tmp_path):
    """`codec.one_signer` (a worker's reply in one call) makes the very bytes `encode` makes for every one-frame
    message under `codec.SMALL`, and declines at `SMALL` (where `encode` signs with HMAC-SHA256); `send_frame`
    writes it as `send` writes `encode`'s frames."""
    from monarch.runtime.wire import codec, protocol

    key = os.urandom(32)
    sign = codec.one_signer(key, 7, 3)
    for message, body in [
        (protocol.Reply(11, True), codec.dumps(None)[0]),
        (protocol.Output(4, "stdout", "héllo\n"), b""),
        (protocol.Reply(12, False), os.urandom(codec.SMALL - 200)),
    ]:
        pieces = sign(5, protocol.pack(message), body)
        assert pieces is not None and b"".join(pieces) == codec.encode(key, 7, 3, 5, protocol.pack(message), [body])[0]
        env = codec.decode(key, [b"".join(pieces)])
        assert (env.mesh_id, env.rank, env.seq, protocol.unpack(env.message), bytes(env.body)) == (
            7,
            3,
            5,
            message,
            body,
        )
    assert sign(6, protocol.pack(protocol.Reply(13, True)), os.urandom(codec.SMALL)) is None

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "lane"))
    server.listen(1)
    client = lanes.LaneClient(str(tmp_path / "lane"))
    b, _ = server.accept()
    with server, b:
        client.send_frame(sign(7, protocol.pack(protocol.Reply(14, True)), b"x"))
        client.send(codec.encode(key, 7, 3, 7, protocol.pack(protocol.Reply(14, True)), [b"x"]))
        n = len(lanes.pack([codec.encode(key, 7, 3, 7, protocol.pack(protocol.Reply(14, True)), [b"x"])[0]])[0])
        got = b""
        while len(got) < 2 * n:
            got += b.recv(65536)
        assert got[:n] == got[n:]
    client.close()
