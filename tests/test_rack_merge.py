"""A rack leader's merger (`runtime/wire/rack_merge.py`), message by message: its hosts' bundles merged into one, each
rank's order kept; a forged, replayed or misplaced bundle refused; what it does not merge passed on as it came,
after what it held."""

from __future__ import annotations

import os

import pytest
import zmq

from monarch.runtime.wire import codec, fanin, protocol
from monarch.runtime.wire.rack_merge import RackMerge

pytestmark = pytest.mark.timeout(60)

KEY = os.urandom(32)
MESH = 7
REPLY = protocol.pack(protocol.Reply(4, True))
NONE = codec.dumps(None)[0]


def line(text: str) -> tuple:
    return protocol.pack(protocol.Output(4, "stdout", text))


def test_equal_items_of_several_hosts_are_merged_and_each_hosts_order_is_kept():
    a, b = (line("a"), NONE), (line("b"), NONE)
    held = [
        (0, (0, 1), *a), (0, (0, 1), *b),  # host 0: a then b
        (1, (2, 3), *b), (1, (2, 3), *a),  # host 1: b then a (its a may not join host 0's, before b)
        (2, (4,), *a), (2, (4,), *b),  # host 2: a joins the latest a; its b then comes after that
    ]  # fmt: skip
    assert fanin.merge(held) == (((0, 1), *a), ((0, 1, 2, 3), *b), ((2, 3, 4), *a), ((4,), *b))
    interleaved = [(0, (0,), *a), (1, (1,), *a), (0, (0,), *b), (1, (1,), *b)]
    assert fanin.merge(interleaved) == (((0, 1), *a), ((0, 1), *b))


class Up:
    """Stands for the leader's socket toward the controller: what it sends, decoded as the controller would."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def __call__(self, frames) -> None:
        self.sent.append([bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in frames])

    def take(self) -> list[codec.Envelope]:
        sent, self.sent = self.sent, []
        return [codec.decode(KEY, frames) for frames in sent]


@pytest.fixture
def leader():
    logged: list[str] = []
    merger = RackMerge(3, Up(), lambda what, why: logged.append(why), 60.0)  # (no timer runs here)
    merger.up, merger.logged = merger.send, logged
    merger.set_mesh(MESH, KEY, {3: (0, 1), 4: (2, 3)})
    return merger


def bundle(host: int, seq: int, items, now: bool = False, key: bytes = KEY) -> list[zmq.Frame]:
    message = protocol.pack(protocol.Bundle(tuple(items), now))
    return [zmq.Frame(bytes(f)) for f in codec.encode(key, MESH, fanin.agent_sender(host), seq, message)]


def test_a_call_goes_up_once_every_host_of_the_mesh_sent_its_bundle(leader):
    leader.take(bundle(3, 1, [((0, 1), REPLY, NONE)]))
    assert leader.up.sent == []  # host 4 has not answered yet
    leader.take(bundle(4, 1, [((2, 3), REPLY, NONE)]))
    (env,) = leader.up.take()
    assert (env.rank, env.seq) == (fanin.rack_sender(3), 1)  # signed as the rack, numbered as its own
    assert protocol.unpack(env.message) == protocol.Bundle((((0, 1, 2, 3), REPLY, NONE),), False)
    leader.take(bundle(4, 2, [((2,), REPLY, NONE)], now=True))  # a call on a view: its host's part goes at once
    (env,) = leader.up.take()
    assert env.seq == 2 and protocol.unpack(env.message).items == (((2,), REPLY, NONE),)


def test_a_forged_replayed_or_misplaced_bundle_is_refused_and_logged(leader):
    leader.take(bundle(3, 1, [((0, 2), REPLY, NONE)]))  # rank 2 is host 4's
    leader.take(bundle(3, 1, [((0,), REPLY, NONE)], key=os.urandom(32)))  # not the mesh's key
    leader.take(bundle(3, 1, [((0, 1), REPLY, NONE)]))
    leader.take(bundle(3, 1, [((0, 1), REPLY, NONE)]))  # the same number again
    leader.take(bundle(4, 1, [((2, 3), REPLY, NONE)]))
    (env,) = leader.up.take()
    assert protocol.unpack(env.message).items == (((0, 1, 2, 3), REPLY, NONE),)
    assert [why.split(" ")[0:3] for why in leader.logged] == [
        ["host", "3", "bundled"], ["host", "3's", "failed"], ["host", "3", "already"],
    ]  # fmt: skip


def test_what_is_not_merged_passes_as_it_came_after_what_was_held(leader):
    leader.take(bundle(3, 1, [((0, 1), line("before"), NONE)]))
    ask = codec.encode(KEY, MESH, 0, 5, protocol.pack(protocol.AskInput(4, 1, "? ", False, False, "")))
    leader.take([zmq.Frame(bytes(f)) for f in ask])  # a worker's own message: its rank's lines go first
    first, second = leader.up.take()
    assert first.rank == fanin.rack_sender(3) and protocol.unpack(first.message).items[0][0] == (0, 1)
    assert (second.rank, second.seq) == (0, 5)
    other = bundle(3, 1, [((0, 1), REPLY, NONE)])
    other[0] = zmq.Frame(codec.encode(KEY, MESH + 1, fanin.agent_sender(3), 1, protocol.pack(protocol.Bundle(())))[0])
    leader.take(other)  # a mesh the leader was not told of: as it came (the controller checks it)
    (env,) = leader.up.take()
    assert (env.mesh_id, env.rank) == (MESH + 1, fanin.agent_sender(3))
    leader.set_mesh(MESH, b"", {})
    leader.take(bundle(3, 2, [((0, 1), REPLY, NONE)]))  # its mesh is gone: as it came
    (env,) = leader.up.take()
    assert env.rank == fanin.agent_sender(3)


def test_a_bundle_of_an_agent_of_a_version_before_is_merged_too(leader):
    before = protocol.pack(protocol.Bundle((((0, 1), REPLY, NONE),)))[:2]  # (no `now` field)
    leader.take([zmq.Frame(bytes(f)) for f in codec.encode(KEY, MESH, fanin.agent_sender(3), 1, before)])
    leader.take(bundle(4, 1, [((2, 3), REPLY, NONE)]))
    (env,) = leader.up.take()
    assert protocol.unpack(env.message).items == (((0, 1, 2, 3), REPLY, NONE),) and leader.logged == []
