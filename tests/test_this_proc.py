"""`this_proc()` (issue 28): actors in the controller's own process, each on a thread of its own, with the adverbs of
worker actor meshes; Monarch's getting-started code as written; `.extent` on proc and actor meshes."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

import monarch
import monarch.actor
from monarch.actor import Actor, MeshFailure, ValueMesh, context, current_rank, endpoint, this_host, this_proc

from conftest import wait_for, wait_gone, worker_pids

pytestmark = pytest.mark.timeout(60)


class Counter(Actor):
    def __init__(self, initial_value: int):
        self.value = initial_value
        self.log: list[int] = []
        self.made_in = context().actor_instance.name

    @endpoint
    def increment(self, by: int = 1) -> None:
        self.value += by
        self.log.append(by)

    @endpoint
    def get_value(self) -> int:
        return self.value

    @endpoint
    def history(self) -> list[int]:
        return self.log

    @endpoint
    def who(self) -> tuple[str, dict, dict, str, str]:
        c = context()
        return (
            c.actor_instance.name,
            c.actor_instance.rank,
            c.message_rank,
            self.made_in,
            threading.current_thread().name,
        )

    @endpoint
    async def twice_later(self, x: int) -> tuple[int, str]:
        await asyncio.sleep(0)
        return 2 * x, context().actor_instance.name

    @endpoint
    def ask_myself(self) -> int:
        return mine[0].get_value.call_one().get(timeout=30)

    @endpoint
    async def await_myself(self) -> int:
        return await mine[0].get_value.call_one()

    @endpoint
    def ask(self, other) -> int:
        return other.get_value.call_one().get(timeout=30)


class Errorful(Actor):
    @endpoint
    def say_hello(self):
        raise Exception("I don't want to")


mine: list = []
"""The actor mesh an endpoint calls back (a module global: a local actor mesh is not sent anywhere)."""


def test_monarchs_getting_started_code_runs_as_written(capsys):
    counter = this_proc().spawn("counter", Counter, initial_value=0)
    try:
        counter.increment.broadcast()
        assert counter.get_value.call_one().get() == 1
        e = this_proc().spawn("errorful", Errorful)
        try:
            e.say_hello.call_one().get()
        except Exception:
            print("It didn't say hello")
        assert "It didn't say hello" in capsys.readouterr().out
        e.stop()
    finally:
        counter.stop()


def test_the_adverbs_of_a_local_actor_mesh():
    c = this_proc().spawn("adverbs", Counter, initial_value=5)
    try:
        values = c.get_value.call().get(timeout=30)
        assert isinstance(values, ValueMesh) and values.values() == [5] and values.sizes == {}
        c.increment.broadcast(2)
        assert c.get_value.choose().get() == 7
        assert [f.get() for f in c.get_value.stream()] == [7]
        assert c.slice().get_value.call_one().get() == 7
        assert c.extent == {} and c.sizes == {} and len(c) == 1 and this_proc().extent == {}
        with pytest.raises(ValueError, match=r"this_proc\(\) has no dimensions"):
            c.slice(gpu=0)
        with pytest.raises(AttributeError, match=r"Counter has no endpoint 'nope' \(its endpoints: .*get_value"):
            c.nope  # noqa: B018
        with pytest.raises(TypeError, match=r"call an endpoint with an adverb"):
            c.get_value()
    finally:
        c.stop()


def test_context_and_the_actors_own_thread():
    c = this_proc().spawn("ctx", Counter, initial_value=0)
    try:
        name, rank, message_rank, made_in, thread = c.who.call_one().get()
        assert (name, rank, message_rank, made_in) == ("ctx", {}, {}, "ctx")
        assert thread != threading.current_thread().name
        client = context()  # outside an actor: the client's context, as Monarch's root client's
        assert client.actor_instance.name == "client" and client.message_rank == {} and current_rank() == {}
    finally:
        c.stop()


def test_async_endpoints_and_awaiting_local_futures():
    c = this_proc().spawn("async", Counter, initial_value=3)
    try:
        assert c.twice_later.call_one(21).get() == (42, "async")

        async def main():
            return await c.twice_later.call_one(1), (await c.get_value.call()).values()

        assert asyncio.run(main()) == ((2, "async"), [3])
    finally:
        c.stop()


def test_messages_run_in_the_order_sent():
    c = this_proc().spawn("order", Counter, initial_value=0)
    try:
        futures = [c.increment.call(i) for i in range(1, 51)]
        for b in range(10):
            c.increment.broadcast(100 + b)
        for f in futures:
            f.get(timeout=30)
        assert c.history.call_one().get() == [*range(1, 51), *range(100, 110)]
    finally:
        c.stop()


def test_one_local_actor_waiting_on_another_does_not_deadlock():
    a = this_proc().spawn("a", Counter, initial_value=1)
    b = this_proc().spawn("b", Counter, initial_value=2)
    try:
        assert a.ask.call_one(b).get(timeout=30) == 2
        assert b.ask.call_one(a).get(timeout=30) == 1
    finally:
        a.stop()
        b.stop()


def test_an_actor_waiting_for_its_own_answer_gets_an_error_not_a_hang():
    c = this_proc().spawn("selfish", Counter, initial_value=0)
    mine[:] = [c]
    try:
        for endpoint_ in (c.ask_myself, c.await_myself):
            with pytest.raises(monarch.RemoteError, match=r"would wait for ever: selfish.get_value is a message to"):
                endpoint_.call_one().get(timeout=30)
        assert c.get_value.call_one().get(timeout=30) == 0  # it goes on
    finally:
        mine.clear()
        c.stop()


def test_an_endpoints_error_reaches_the_caller_as_a_remote_error():
    e = this_proc().spawn("errors", Errorful)
    try:
        with pytest.raises(monarch.RemoteError) as got:
            e.say_hello.call_one().get()
        text = str(got.value)
        assert "errors.say_hello failed on 1 of 1 ranks" in text and "rank 0 (this_proc)" in text, text
        assert "Exception: I don't want to" in text and "in say_hello" in text
        assert "runtime/actors/" not in text  # our plumbing is left out
        assert isinstance(got.value.__cause__, Exception) and str(got.value.__cause__) == "I don't want to"
        with pytest.raises(monarch.RemoteError, match=r"errors.say_hello failed"):
            e.say_hello.call().get()
    finally:
        e.stop()


def test_bad_spawns_and_a_stopped_actor():
    with pytest.raises(TypeError, match=r"must subclass monarch.actor.Actor"):
        this_proc().spawn("plain", dict)
    c = this_proc().spawn("twice", Counter, initial_value=0)
    with pytest.raises(ValueError, match=r"a this_proc\(\) actor named 'twice' already runs"):
        this_proc().spawn("twice", Counter, initial_value=0)
    with pytest.raises(monarch.RemoteError, match=r"(?s)broken.__init__ failed.*missing 1 required positional"):
        this_proc().spawn("broken", Counter)
    this_proc().spawn("broken", Counter, initial_value=0).stop()  # (the name was not kept by the failed spawn)
    c.stop()
    with pytest.raises(RuntimeError, match=r"this_proc\(\) actor 'twice' was stopped"):
        c.get_value.call_one()
    with pytest.raises(TypeError, match=r"lives in the controller's process"):
        import pickle

        pickle.dumps(c)


def test_a_failed_broadcast_is_a_mesh_failure_for_the_hook(monkeypatch):
    seen: list[MeshFailure] = []
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", seen.append)
    e = this_proc().spawn("loud", Errorful)
    try:
        e.say_hello.broadcast()
        wait_for(lambda: seen, what="the broadcast's failure reaching the hook")
        (f,) = seen
        assert isinstance(f, MeshFailure) and f.mesh_name == "loud" and f.rank == 0 and f.label == "this_proc"
        assert "raised in say_hello" in f.what and "I don't want to" in str(f)
    finally:
        e.stop()


def test_extent_of_proc_and_actor_meshes():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    pids = worker_pids(procs)
    try:
        assert procs.extent == {"gpus": 2} and repr(procs.extent) == "{'gpus': 2}"
        assert procs.extent.labels == ["gpus"] and procs.extent.nelem == 2
        counters = procs.spawn("extent", Counter, 0)
        assert counters.extent == {"gpus": 2} and counters.slice(gpus=1).extent == {}
        assert counters.get_value.call().get().values() == [0, 0]
    finally:
        procs.exit()
    assert wait_gone(pids) == []


def test_no_thread_is_left_after_stop():
    c = this_proc().spawn("threads", Counter, initial_value=0)
    c.get_value.call_one().get()
    c.stop()
    wait_for(lambda: not any(t.name == "monarch-actor-threads" for t in threading.enumerate()), what="the thread's end")
    assert os.getpid()  # (the process goes on)
