"""The wire's fixed points: every message's tag, and that every backend answers every message it is sent."""

import os

import pytest

from monarch.runtime.wire import protocol

pytestmark = pytest.mark.timeout(120)

TAGS = {
    "Call": 0, "MakeGroups": 1, "RunOps": 2, "StdinReply": 3, "Exit": 4, "ReformGroups": 5, "Ready": 6,
    "StartFailed": 7, "Reply": 8, "Output": 9, "Display": 10, "Released": 11, "Busy": 12, "AskInput": 13,
    "StoreSet": 14, "StoreGet": 15, "StoreAdd": 16, "StoreCompareSet": 17, "StoreWait": 18, "StoreCheck": 19,
    "StoreDelete": 20, "StoreNumKeys": 21, "StoreAnswer": 22, "Op": 23, "Reduce": 24, "MoveWithin": 25,
    "SendTo": 26, "RecvFrom": 27, "Alias": 28, "Free": 29, "Seed": 30, "FailResults": 31, "OnStream": 32,
    "BorrowStart": 33, "BorrowEnd": 34, "ProfileStart": 35, "ProfileStep": 36, "ProfileMark": 37,
    "AgentHello": 38, "AgentInfo": 39, "StartWorkers": 40, "SignalWorkers": 41, "StopWorkers": 42,
    "WorkersStopped": 43, "WorkerLost": 44, "SyncOffer": 45, "SyncWant": 46, "SyncFiles": 47, "Synced": 48,
    "Stacks": 49, "Goodbye": 50, "ActorSend": 51, "ActorAnswer": 52, "Cast": 53,
    "CastFailed": 54, "PortSend": 55, "CallActor": 56, "ReadyTorch": 57, "Bundle": 58,
    "Lead": 59, "Leading": 60, "RackMesh": 61,
}  # fmt: skip
"""Every message's wire tag. A new message takes a new number; an existing one never changes."""


def test_every_message_keeps_its_wire_tag():
    assert {cls.__name__: tag for tag, cls in protocol.types().items()} == TAGS


def test_a_tag_is_taken_once():
    with pytest.raises(AssertionError, match="wire tag 8 of Mine is taken by Reply"):

        @protocol.message(8)
        class Mine:
            x: int


def test_control_kinds_are_an_enum_with_fixed_values():
    assert {k.name: int(k) for k in protocol.Control} == {
        "INTERRUPT": 0, "RELEASE": 1, "REPORT": 2, "DISCONNECT": 3, "STACKS": 4,
    }  # fmt: skip


def test_every_message_a_controller_sends_has_a_handler_in_every_backend():
    from monarch.runtime.simulator import backend as sim
    from monarch.runtime.worker import worker

    sent = set(protocol.TO_WORKERS)
    assert set(worker.HANDLERS) | {protocol.Exit} == sent
    assert set(sim.HANDLED) | set(sim.IGNORED) == sent
    assert not set(sim.HANDLED) & set(sim.IGNORED)


def _request(mesh, message_for):
    controller = mesh.spawned.controller
    pending = controller.call(mesh.spawned, tuple(range(len(mesh.spawned.shape))), message_for)
    return controller.wait(pending, 30)


def test_a_worker_answers_a_request_it_has_no_handler_for_with_an_error():
    """A message with a `call_id` that no handler takes (here `Busy`, which only workers send) must get an
    error reply, not leave its caller waiting."""
    from monarch.actor import this_host
    from monarch.runtime.wire import codec

    mesh = this_host().spawn_procs({"gpu": 2})
    try:
        replies = _request(mesh, lambda call_id: (protocol.Busy(call_id, "", ""), None))
        assert sorted(replies) == [0, 1]
        for env in replies.values():
            assert env.message.ok is False
            info = codec.loads(env.body, env.buffers)
            assert info.exc_type == "TypeError"
            assert "no handler for Busy on a worker (it handles Call, Cast, MakeGroups" in info.message
        assert mesh.state == "running"  # the worker served on
        from monarch import remote

        assert remote(os.getpid).on(mesh)().values() == [p["pid"] for p in mesh.spawned.info]
    finally:
        mesh.exit()


def test_a_simulated_mesh_answers_what_it_does_not_model_with_an_error():
    import monarch
    from monarch.runtime.wire import codec

    sim = monarch.Simulator(hosts=1, gpus=2, device="cpu")
    mesh = sim.mesh
    try:
        replies = _request(mesh, lambda call_id: (protocol.Busy(call_id, "", ""), None))
        for env in replies.values():
            info = codec.loads(env.body, env.buffers)
            assert (env.message.ok, info.exc_type) == (False, "NotImplementedError")
            assert info.message.startswith(
                "Busy is not simulated: a simulated mesh models Call, Cast, Exit, MakeGroups"
            )
        with pytest.raises(NotImplementedError, match="Goodbye is not simulated"):
            mesh.spawned.controller.send(mesh.spawned, None, protocol.Goodbye())
    finally:
        mesh.exit()
