"""Actors calling actors (issue 28 item 2) on one host: actor meshes passed to actors as references, sliced and
called from inside endpoints; the messages go worker to worker (each worker's inbox), are signed, and an
endpoint that waits for another actor serves its own inbox meanwhile (no deadlock, even when called back); an
actor waiting for itself gets a clear error."""

from __future__ import annotations

import os
import pickle

import pytest
import zmq

from monarch.actor import Actor, context, endpoint, this_host
from monarch.runtime.common.errors import RemoteError
from monarch.runtime.wire import codec, protocol

from conftest import wait_gone, worker_pids

pytestmark = pytest.mark.timeout(90)


class Loader(Actor):
    def __init__(self) -> None:
        self.i = 0
        self.me = context().actor_instance.rank

    @endpoint
    def example(self) -> str:
        self.i += 1
        print(f"loader {self.me['gpu']} gives batch {self.i}")
        return f"batch {self.i} from {self.me['gpu']}"

    @endpoint
    def fail(self) -> None:
        raise ValueError(f"loader {self.me['gpu']} has no data")

    @endpoint
    def ask_back(self, trainers, gpu: int) -> str:
        """Call a trainer back while that trainer waits for this answer."""
        return trainers.slice(gpu=gpu).name_of.call_one().get()

    @endpoint
    def where(self) -> tuple[dict, dict]:
        return context().actor_instance.rank, context().message_rank


class Trainer(Actor):
    def __init__(self, loaders) -> None:
        self.me = context().actor_instance.rank
        self.loader = loaders.slice(**self.me)  # as Monarch's getting-started guide does
        self.loaders = loaders

    @endpoint
    def step(self) -> str:
        return f"trainer {self.me['gpu']} got " + self.loader.example.call_one().get()

    @endpoint
    def from_all(self) -> list[str]:
        return self.loaders.example.call().get().values()

    @endpoint
    def from_next(self) -> str:
        n = self.loaders.size("gpu")
        return self.loaders.slice(gpu=(self.me["gpu"] + 1) % n).example.call_one().get()

    @endpoint
    async def step_async(self) -> str:
        return await self.loader.example.call_one()

    @endpoint
    def loader_fails(self) -> str:
        try:
            self.loader.fail.call_one().get()
        except RemoteError as e:
            return str(e)
        return "no error"

    @endpoint
    def round_trip(self, trainers) -> str:
        return self.loader.ask_back.call_one(trainers, self.me["gpu"]).get()

    @endpoint
    def name_of(self) -> str:
        return f"trainer {self.me['gpu']}"

    @endpoint
    def call_myself(self, trainers) -> str:
        return trainers.slice(**self.me).name_of.call_one().get()

    @endpoint
    def streamed(self) -> list[str]:
        return sorted(f.get() for f in self.loaders.example.stream())

    @endpoint
    def message_ranks(self) -> list:
        return self.loaders.slice(gpu=slice(1, 3)).where.call().get().values()

    @endpoint
    def broadcast_then_ask(self) -> str:
        self.loader.example.broadcast()  # ordered before the call that follows
        return self.loader.example.call_one().get()


@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs({"gpu": 3})
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


@pytest.fixture
def pair(procs, request):
    tag = request.node.name[-20:].replace("[", "_").replace("]", "_")
    loaders = procs.spawn(f"loaders-{tag}", Loader)
    trainers = procs.spawn(f"trainers-{tag}", Trainer, loaders)
    yield loaders, trainers
    trainers.stop()
    loaders.stop()


def test_an_actor_calls_the_actors_it_was_given(pair):
    loaders, trainers = pair
    assert trainers.step.call().get().values() == [f"trainer {g} got batch 1 from {g}" for g in range(3)]
    assert trainers.step.call().get().values() == [f"trainer {g} got batch 2 from {g}" for g in range(3)]
    assert trainers.from_next.call().get().values() == [f"batch 3 from {(g + 1) % 3}" for g in range(3)]
    assert loaders.example.call().get().values() == [f"batch 4 from {g}" for g in range(3)]


def test_a_call_to_every_actor_and_a_stream_from_an_endpoint(pair):
    loaders, trainers = pair
    got = trainers.slice(gpu=0).from_all.call_one().get()
    assert got == [f"batch 1 from {g}" for g in range(3)]
    assert trainers.slice(gpu=1).streamed.call_one().get() == [f"batch 2 from {g}" for g in range(3)]


def test_message_rank_is_the_place_in_the_slice_sent_to(pair):
    _, trainers = pair
    got = trainers.slice(gpu=0).message_ranks.call_one().get()
    assert got == [({"gpu": 1}, {"gpu": 0}), ({"gpu": 2}, {"gpu": 1})]


def test_an_async_endpoint_awaits_another_actor(pair):
    _, trainers = pair
    assert trainers.step_async.call().get().values() == [f"batch 1 from {g}" for g in range(3)]


def test_a_broadcast_and_a_call_from_one_sender_arrive_in_order(pair):
    _, trainers = pair
    assert trainers.broadcast_then_ask.call().get().values() == [f"batch 2 from {g}" for g in range(3)]


def test_a_callee_that_calls_its_caller_back_does_not_deadlock(pair):
    _, trainers = pair
    assert trainers.round_trip.call(trainers).get().values() == [f"trainer {g}" for g in range(3)]


def test_an_actor_calling_itself_gets_a_clear_error(pair):
    _, trainers = pair
    with pytest.raises(RemoteError, match="calls its own endpoint 'name_of' and would wait for itself"):
        trainers.slice(gpu=2).call_myself.call_one(trainers).get()
    assert trainers.slice(gpu=2).name_of.call_one().get() == "trainer 2"  # and it still serves


def test_an_error_in_the_called_actor_reaches_the_calling_endpoint_with_its_traceback(pair):
    _, trainers = pair
    text = trainers.slice(gpu=1).loader_fails.call_one().get()
    assert "ValueError: loader 1 has no data" in text and "in fail" in text


def test_output_of_a_called_actor_goes_to_the_call_that_caused_it(pair, capfd):
    _, trainers = pair
    trainers.step.call().get()
    out = capfd.readouterr().out
    for g in range(3):
        assert f"loader {g} gives batch 1" in out


def test_an_inbox_drops_what_is_not_signed_with_its_key(pair):
    """An attacker on this machine who reached the inbox (it is in a private directory) and sends a message
    signed with another key, or replays nothing it could read: dropped before anything is unpickled."""
    loaders, trainers = pair
    inbox = loaders._inboxes[0]
    assert inbox.addr.startswith("ipc://")
    assert os.stat(os.path.dirname(inbox.addr[len("ipc://") :])).st_mode & 0o077 == 0  # only we can connect
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(inbox.addr)
    bomb = pickle.dumps(("not", "unpickled"))
    message = protocol.ActorSend(1, loaders.name, "example", ("gpu",), (1,), (0,), None)
    sock.send_multipart(codec.encode(os.urandom(32), 99, 0, 1, protocol.pack(message), [bomb]))
    assert sock.poll(300) == 0  # no answer: dropped
    sock.close(0)
    assert trainers.step.call().get().values() == [f"trainer {g} got batch 1 from {g}" for g in range(3)]


def test_a_reference_back_on_the_controller_says_what_to_use(pair):
    loaders, _ = pair
    ref = pickle.loads(pickle.dumps(loaders))
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        ref.nope  # noqa: B018
    assert ref.sizes == {"gpu": 3}
    with pytest.raises(RuntimeError, match="a reference, for the actors it was sent to"):
        ref.example.call()
