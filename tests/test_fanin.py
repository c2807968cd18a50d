"""A host agent's fan-in (`runtime/wire/fanin.py`): its workers' replies and output go up to the controller in
bundles, each distinct message once with the ranks that sent it, each rank's own order kept; and the controller's
end takes a bundle only when it is a host agent's, new, and names the mesh's ranks."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import zmq

from monarch.runtime.common.config import Settings
from monarch.runtime.wire import codec, fanin, protocol
from monarch.runtime.wire.controller_end import DROPPED, ControllerTransport

pytestmark = pytest.mark.timeout(60)

KEY = os.urandom(32)
MESH = 7


class Worker:
    """A worker's messages as its host's agent reads them (one zmq frame each), numbered as a worker numbers them."""

    def __init__(self, rank: int, key: bytes = KEY) -> None:
        self.rank, self.key, self.seq = rank, key, 0

    def frames(self, message, value=None, body=None) -> list[zmq.Frame]:
        self.seq += 1
        body = body if body is not None else codec.dumps(value)
        return [
            zmq.Frame(bytes(f)) for f in codec.encode(self.key, MESH, self.rank, self.seq, protocol.pack(message), body)
        ]


def call(call_id: int, ranks: tuple[int, ...]) -> memoryview:
    """A `Call` as it goes down (its first frame after the topic)."""
    (frame,) = codec.encode(
        KEY, MESH, codec.CONTROLLER, call_id, protocol.pack(protocol.Call(call_id, 0, ("gpu",), (len(ranks),), ranks))
    )
    return memoryview(frame)


class Up:
    """What the fan-in sends up: bundles decoded as the controller would (signature first), other messages as is."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def __call__(self, frames) -> None:
        self.sent.append([bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in frames])

    def decoded(self) -> list[codec.Envelope]:
        return [codec.decode(KEY, frames) for frames in self.sent]

    def bundles(self) -> list[list[tuple[tuple[int, ...], object, object]]]:
        out = []
        for env in self.decoded():
            assert env.rank == fanin.agent_sender(3), env.rank
            bundle = protocol.unpack(env.message)
            assert type(bundle) is protocol.Bundle
            out.append(
                [(ranks, protocol.unpack(m), codec.loads(body) if body else None) for ranks, m, body in bundle.items]
            )
        return out


def make(wait: float = 60.0, ranks=range(4)) -> tuple[fanin.FanIn, Up, list[str]]:
    up, logged = Up(), []
    f = fanin.FanIn(3, up, lambda what, why: logged.append(f"{what}: {why}"), wait)
    f.add_mesh(MESH, KEY, list(ranks))
    return f, up, logged


def test_equal_replies_of_a_hosts_ranks_go_up_as_one_item_once_all_of_them_answered():
    f, up, _ = make()
    workers = [Worker(r) for r in range(4)]
    for w in workers[:3]:
        f.take(w.frames(protocol.Reply(1, True), None))
    assert up.sent == [] and f.due() is not None  # held: rank 3 has not answered
    f.take(workers[3].frames(protocol.Reply(1, True), None))
    assert up.bundles() == [[((0, 1, 2, 3), protocol.Reply(1, True), None)]]
    assert f.due() is None


def test_distinct_values_are_items_of_their_own_and_a_view_on_part_of_the_host_goes_when_its_ranks_answered():
    f, up, _ = make()
    workers = [Worker(r) for r in range(4)]
    f.saw_command(MESH, call(2, (1, 2, 9)))  # rank 9 is another host's: two replies from this one
    f.take(workers[2].frames(protocol.Reply(2, True), "b"))
    f.take(workers[1].frames(protocol.Reply(2, True), "a"))
    assert up.bundles() == [[((2,), protocol.Reply(2, True), "b"), ((1,), protocol.Reply(2, True), "a")]]


def test_a_rank_that_answers_late_goes_in_a_later_bundle_after_the_wait():
    f, up, _ = make(wait=0.001)
    workers = [Worker(r) for r in range(4)]
    for w in workers[:3]:
        f.take(w.frames(protocol.Reply(1, True), 5))
    due = f.due()
    assert due is not None
    f.flush_due(due - 0.0005)
    assert up.sent == []
    f.flush_due(due)
    f.take(workers[3].frames(protocol.Reply(1, True), 5))
    assert up.bundles() == [[((0, 1, 2), protocol.Reply(1, True), 5)], [((3,), protocol.Reply(1, True), 5)]]


def test_equal_lines_are_grouped_only_where_each_ranks_own_order_is_kept():
    f, up, _ = make()
    w0, w1 = Worker(0), Worker(1)
    line = lambda text: protocol.Output(1, "stdout", text)  # noqa: E731
    f.take(w0.frames(line("a\n")))
    f.take(w1.frames(line("b\n")))
    f.take(w1.frames(line("a\n")))  # after its "b": it may not join rank 0's "a", which comes first
    f.take(w0.frames(line("b\n")))  # joins rank 1's "b", which comes after rank 0's "a"
    f.take(w0.frames(line("c\n")))
    f.take(w1.frames(line("c\n")))
    f.flush(MESH)
    (items,) = up.bundles()
    texts = [(ranks, m.text) for ranks, m, _ in items]
    # each rank, reading the items in order, sees its own lines in its own order
    for rank, own in ((0, ["a\n", "b\n", "c\n"]), (1, ["b\n", "a\n", "c\n"])):
        assert [t for ranks, t in texts if rank in ranks] == own, texts
    assert texts == [((0,), "a\n"), ((1, 0), "b\n"), ((1,), "a\n"), ((0, 1), "c\n")]


def test_equal_reports_are_bundled_too_even_those_holding_lists():
    f, up, _ = make()
    stacks = protocol.Stacks(5, [("MainThread", [("Cell In[3], line 2", "dist.all_reduce(t)")])])
    busy = protocol.Busy(1, "Cell In[3], line 2", "all_reduce")
    workers = [Worker(r) for r in range(4)]
    for w in workers:
        f.take(w.frames(stacks, body=[b""]))
    for w in workers[:3]:
        f.take(w.frames(busy, body=[b""]))
    f.flush(MESH)
    assert up.bundles() == [[((0, 1, 2, 3), stacks, None), ((0, 1, 2), busy, None)]]


def test_a_message_that_is_not_bundled_goes_up_after_what_was_held_before_it():
    f, up, _ = make()
    w0, w1 = Worker(0), Worker(1)
    f.take(w0.frames(protocol.Output(1, "stdout", "before\n")))
    f.take(w1.frames(protocol.Reply(1, True), 1))
    ask = w0.frames(protocol.AskInput(1, 1, "? ", False, False, ""))
    f.take(ask)
    envs = up.decoded()
    assert [type(protocol.unpack(e.message)).__name__ for e in envs] == ["Bundle", "AskInput"]
    assert envs[1].rank == 0  # (as the worker sent it: its own signature and number)
    big = w1.frames(protocol.Reply(2, True), b"x" * codec.SMALL)  # (too large to bundle: as it is)
    f.take(big)
    assert up.sent[-1] == [bytes(x.buffer) for x in big]


def test_the_agent_drops_what_fails_its_checks_and_says_so():
    f, up, logged = make()
    w0 = Worker(0)
    frames = w0.frames(protocol.Reply(1, True), 1)
    f.take(frames)
    f.take([zmq.Frame(bytes(frames[0].buffer))])  # the same message again
    f.take(Worker(1, key=os.urandom(32)).frames(protocol.Reply(1, True), 1))  # another key
    f.flush(MESH)
    assert up.bundles() == [[((0,), protocol.Reply(1, True), 1)]]
    assert any("a replayed message: rank 0 of mesh 7 already sent number 1" in line for line in logged), logged
    assert any("failed its checks: bad signature" in line for line in logged), logged


def test_with_no_wait_nothing_is_bundled():
    f, up, _ = make(wait=0.0)
    frames = Worker(0).frames(protocol.Reply(1, True), 1)
    f.take(frames)
    assert up.sent == [[bytes(x.buffer) for x in frames]]


# -- the controller's end --------------------------------------------------------------------------
@pytest.fixture
def transport():
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        t = ControllerTransport(Settings(lanes=False), d)
        keys = t.add_mesh(MESH, 4)
        push = t.ctx.socket(zmq.PUSH)
        push.connect(t.reply_addr)
        t.set_timeout(5000)
        t.key = keys[0].key
        t.push = push
        yield t
        push.close(0)
        t.close()
        t.close_store()
        t.terminate()


def _bundle(key: bytes, seq: int, items, sender: int = fanin.agent_sender(0)) -> list:
    return codec.encode(key, MESH, sender, seq, protocol.pack(protocol.Bundle(tuple(items))))


def _received(t: ControllerTransport, frames: list) -> object:
    t.push.send_multipart(frames)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = t.recv(True)
        if got is not None:
            return got
    raise AssertionError("nothing came")


def test_the_controller_takes_a_bundle_once_and_refuses_a_forged_or_a_wrong_one(transport):
    t = transport
    reply = protocol.pack(protocol.Reply(4, True))
    body = codec.dumps(None)[0]
    good = _bundle(t.key, 1, [((0, 1, 2, 3), reply, body)])
    env = _received(t, good)
    assert env.rank == fanin.agent_sender(0)
    assert env.message == protocol.Bundle((((0, 1, 2, 3), protocol.Reply(4, True), body),))
    assert _received(t, good) is DROPPED  # the same bundle again
    assert _received(t, _bundle(os.urandom(32), 2, [((0,), reply, body)])) is DROPPED  # not the mesh's key
    assert _received(t, _bundle(t.key, 3, [((0, 4), reply, body)])) is DROPPED  # rank 4: the mesh has 4
    ask = protocol.pack(protocol.AskInput(4, 1, "? ", False, False, ""))
    assert _received(t, _bundle(t.key, 4, [((0,), ask, body)])) is DROPPED  # never bundled
    assert _received(t, _bundle(t.key, 5, [((1,), reply, body)], sender=fanin.agent_sender(1))).rank == -3
    # what was refused is logged, not raised: the receiver goes on
    assert _received(t, _bundle(t.key, 6, [((2,), reply, body)])).message.items[0][0] == (2,)
