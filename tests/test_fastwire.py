"""The compiled wire (runtime/wire/_fastwire.c) gives what its Python versions give, byte for byte and error for
error: `codec.one_signer`, `codec.one_sender` (a lane's check of each message) and `protocol.unpack`.

Its input comes from sockets: signatures that do not match, senders that are not the lane's, numbers already
seen, lengths that lie, headers that do not unpickle, and random bytes are each refused as the Python check
refuses them, and nothing changes (the numbers seen) unless a message is taken.
"""

import os
import pickle
import random

import pytest

from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.protocol import base

pytestmark = pytest.mark.timeout(120)

KEY = bytes(range(32))


def test_the_compiled_wire_is_built_in_this_install():
    """Setup compiles it (`setup.py`'s `FASTWIRE`); without it every worker runs the slower Python path."""
    assert codec._fastwire is not None, "runtime/wire/_fastwire.c was not built: `./run setup` needs gcc"
    assert protocol.unpack is not base.py_unpack


def _frame(key: bytes, mesh_id: int, rank: int, seq: int, message, body: bytes = b"") -> bytes:
    return b"".join(codec.py_one_signer(key, mesh_id, rank)(seq, message, body))


MESSAGES = [
    protocol.pack(protocol.Reply(7, True)),
    protocol.pack(protocol.Call(5, 1, ("host", "gpu"), (2, 4), tuple(range(8)), b"fn", {"f.py": ["x\n"]}, None)),
    protocol.pack(protocol.Output(3, "stdout", "héllo\n" * 50)),
    ("not", "a", "message"),
    None,
]


@pytest.mark.parametrize("rank", [-1, 0, 63])
@pytest.mark.parametrize("message", MESSAGES)
@pytest.mark.parametrize("body", [b"", b"body", memoryview(os.urandom(4000)), b"x" * 65000])
def test_signing_gives_the_same_bytes(rank, message, body):
    for seq in (1, 2**32 + 5, 2**64 - 1):
        got = codec.one_signer(KEY, 9, rank)(seq, message, body)
        assert got == codec.py_one_signer(KEY, 9, rank)(seq, message, body)
        assert got is None or (type(got) is list and [type(p) for p in got] == [bytes, bytes])


def test_a_message_too_large_for_one_frame_is_left_to_encode_by_both():
    py, c = codec.py_one_signer(KEY, 1, 2), codec.one_signer(KEY, 1, 2)
    h = len(pickle.dumps(None, protocol=5))
    for n in range(codec.SMALL - 20 - h - 2, codec.SMALL - 20 - h + 2):
        assert (c(1, None, b"x" * n) is None) == (py(1, None, b"x" * n) is None)
    assert c(1, None, b"x" * codec.SMALL) is None


def _both(mesh_id: int, rank: int, seen: list[int]):
    """The compiled check and the Python one, each with its own copy of `seen`."""
    a, b = list(seen), list(seen)
    return codec.one_sender(KEY, mesh_id, rank, a), a, codec.py_one_sender(KEY, mesh_id, rank, b), b


def _same(c_check, a, py_check, b, first) -> object:
    """Run both on `first`: the same result (or the same error), the same numbers seen after."""
    outcomes = []
    for check in (c_check, py_check):
        try:
            outcomes.append(("ok", check(memoryview(first))))
        except Exception as e:
            outcomes.append(("raised", type(e), str(e)))
    assert outcomes[0] == outcomes[1]
    assert a == b
    return outcomes[0]


@pytest.mark.parametrize("rank", [-1, 3])
def test_a_good_message_is_taken_once_and_its_number_kept(rank):
    c, a, py, b = _both(4, rank, [0] * 5)
    first = _frame(KEY, 4, rank, 10, MESSAGES[1], b"the body")
    kind, env = _same(c, a, py, b, first)
    assert kind == "ok" and type(env) is codec.Envelope
    assert (env.mesh_id, env.rank, env.seq, env.message, env.body, env.buffers) == (
        4, rank, 10, MESSAGES[1], b"the body", []
    )  # fmt: skip
    assert a[rank] == 10
    assert _same(c, a, py, b, first) == ("ok", None)  # (replayed)
    assert _same(c, a, py, b, _frame(KEY, 4, rank, 9, MESSAGES[0])) == ("ok", None)  # (an older number)
    assert _same(c, a, py, b, _frame(KEY, 4, rank, 11, MESSAGES[0]))[1].seq == 11


def test_messages_a_lane_must_refuse_are_refused_alike_and_change_nothing():
    c, a, py, b = _both(4, 2, [0, 0, 5])
    good = _frame(KEY, 4, 2, 6, MESSAGES[0], b"abc")
    refused = [
        good[:-1],  # (its signature no longer matches)
        bytes([good[0] ^ 1]) + good[1:],  # a signature byte changed
        good[:40] + bytes([good[40] ^ 0x80]) + good[41:],  # the sequence number changed
        _frame(os.urandom(32), 4, 2, 6, MESSAGES[0]),  # another key
        _frame(KEY, 5, 2, 6, MESSAGES[0]),  # another mesh
        _frame(KEY, 4, 1, 6, MESSAGES[0]),  # another sender
        _frame(KEY, 4, 2, 5, MESSAGES[0]),  # a number already seen
        good[: codec.FIXED - 1],  # too short to be signed
        b"",
        good + b"\0" * (codec.SMALL + 32),  # too long for one frame
    ]
    lying = bytearray(_frame(KEY, 4, 2, 6, MESSAGES[0]))
    lying[48:52] = (1 << 31).to_bytes(4, "little")  # a header longer than the message (signed again below)
    lying[:32] = codec._blake2b(bytes(lying[32:]), key=KEY, digest_size=32).digest()
    refused.append(bytes(lying))
    for first in refused:
        assert _same(c, a, py, b, first) == ("ok", None)
    assert a == [0, 0, 5]


def test_a_signed_header_that_does_not_unpickle_raises_alike_and_changes_nothing():
    c, a, py, b = _both(4, 2, [0, 0, 0])
    frame = bytearray(_frame(KEY, 4, 2, 3, MESSAGES[0]))
    frame[52:53] = b"\xff"  # (not a pickle opcode)
    frame[:32] = codec._blake2b(bytes(frame[32:]), key=KEY, digest_size=32).digest()
    kind, *_ = _same(c, a, py, b, bytes(frame))
    assert kind == "raised" and a == [0, 0, 0]


def test_random_and_mutated_bytes_never_crash_the_compiled_check():
    rng = random.Random(1234)
    c, a, py, b = _both(4, 2, [0, 0, 0])
    good = _frame(KEY, 4, 2, 1, MESSAGES[1], b"body")
    for _ in range(3000):
        first = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            first[rng.randrange(len(first))] = rng.randrange(256)
        _same(c, a, py, b, bytes(first[: rng.randint(0, len(first))]))
        _same(c, a, py, b, os.urandom(rng.randint(0, 200)))
    assert a == [0, 0, 0]


def test_every_message_unpacks_to_the_same_message():
    for tag, cls in protocol.types().items():
        values = tuple(f"v{i}" for i in range(cls._arity))
        got, want = protocol.unpack((tag, *values)), base.py_unpack((tag, *values))
        assert type(got) is cls and got == want, cls.__name__


@pytest.mark.parametrize(
    "t",
    [
        [0, 1, 2],
        (),
        ("0",),
        (True, 5, True),  # (a bool is no tag)
        (-1,),
        (10**30,),
        (len(base._TYPES),),
        (protocol.Reply._tag, 1),  # too few fields
        (protocol.Reply._tag, 1, True, 3),  # too many
        *[(tag,) for tag, cls in enumerate(base._TYPES) if cls is None][:2],  # no message has it
    ],
)
def test_what_is_no_message_is_refused_alike(t):
    with pytest.raises(ValueError) as c:
        protocol.unpack(t)
    with pytest.raises(ValueError) as py:
        base.py_unpack(t)
    assert str(c.value) == str(py.value)
