"""Actors (issue 28, first part): `procs.spawn(name, cls, ...)` on real worker meshes, the endpoints' adverbs
(`call`, `call_one`, `broadcast`, `choose`, `stream`), `async def` endpoints, `context()`, the order of messages,
and the errors a user meets: grouped remote tracebacks, a constructor that fails, bad names and adverbs."""

from __future__ import annotations

import asyncio
import os

import pytest

import monarch
from monarch.actor import Actor, context, current_rank, endpoint, this_host

from conftest import started, wait_for, wait_gone, worker_pids

pytestmark = pytest.mark.timeout(60)


class Counter(Actor):
    def __init__(self, start: int):
        self.n = start
        self.log: list[int] = []
        self.me = context().actor_instance.rank

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        self.log.append(by)
        return self.n

    @endpoint
    def history(self) -> list[int]:
        return self.log

    @endpoint
    def where(self) -> tuple[dict, dict, dict]:
        c = context()
        return c.actor_instance.rank, c.message_rank, current_rank()

    @endpoint
    async def twice_later(self, x: int, delay: float = 0.01) -> int:
        await asyncio.sleep(delay)
        return 2 * x

    @endpoint
    def fail_on(self, gpu: int) -> int:
        if self.me["gpu"] == gpu:
            raise ValueError(f"no counting on gpu {gpu}")
        return self.n

    @endpoint
    def hold(self, gate: str, gpu: int | None = None) -> int:
        """On gpu `gpu` (every actor when None): say it started (`<gate>.<rank>`), then wait for the test to
        create `<gate>.open`."""
        if gpu is None or self.me["gpu"] == gpu:
            open(f"{gate}.{self.me['gpu']}", "w").close()  # (as conftest.say_started, by the actor's own rank)
            wait_for(lambda: os.path.exists(gate + ".open"), what=f"{gate}.open")
        return self.me["gpu"]

    def not_an_endpoint(self) -> None:
        pass

    @endpoint
    def record(self, value: object) -> None:
        self.log.append(value)

    @endpoint
    def recorded(self) -> list:
        return self.log


@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


def test_call_reaches_every_actor_and_each_keeps_its_state(procs):
    c = procs.spawn("state", Counter, 10)
    assert c.incr.call(2).get().values() == [12] * 4
    assert c.slice(gpu=1).incr.call_one(5).get() == 17
    assert c.incr.call().get().values() == [13, 18, 13, 13]
    values = c.incr.call(0).get()
    assert values.item(gpu=1) == 18 and values.sizes == {"gpu": 4}


def test_messages_from_one_sender_arrive_in_the_order_sent(procs):
    c = procs.spawn("order", Counter, 0)
    futures = [c.incr.call(i) for i in range(1, 51)]  # not waited for in between
    for f in futures:
        f.get()
    for b in range(10):
        c.incr.broadcast(100 + b)
    assert c.history.call().get().values() == [[*range(1, 51), *range(100, 110)]] * 4


def test_slices_and_context(procs):
    c = procs.spawn("where", Counter, 0)
    got = c.slice(gpu=slice(2, 4)).where.call().get().values()
    # the actor's own coordinates in its mesh; the message's coordinates in the slice it was sent to
    assert got == [({"gpu": 2}, {"gpu": 0}, {"gpu": 0}), ({"gpu": 3}, {"gpu": 1}, {"gpu": 1})]
    assert c.slice(gpu=3).where.call_one().get()[0] == {"gpu": 3}
    assert len(c.slice(gpu=slice(0, 2))) == 2 and c.slice(gpu=slice(0, 2)).sizes == {"gpu": 2}


def test_async_endpoints_and_awaiting_futures(procs):
    c = procs.spawn("async", Counter, 0)
    assert c.twice_later.call(21).get().values() == [42] * 4

    async def main():
        return await c.twice_later.call(1), await c.slice(gpu=0).twice_later.call_one(5)

    mesh_value, one = asyncio.run(main())
    assert mesh_value.values() == [2] * 4 and one == 10


def test_stream_yields_each_answer_as_it_arrives(procs, tmp_path):
    c = procs.spawn("stream", Counter, 0)
    assert sorted(f.get() for f in c.incr.stream(0)) == [0, 0, 0, 0]
    gate = str(tmp_path / "gate")
    it = c.hold.stream(gate, 2)  # gpu=2 holds until the gate opens; the others answer at once
    first = [next(it) for _ in range(3)]  # (would wait forever if stream waited for every answer)
    assert all(f.done() for f in first)  # a future is yielded once it is answered, as Monarch's are
    assert sorted(f.get() for f in first) == [0, 1, 3] and started(gate, 1)
    open(gate + ".open", "w").close()
    assert [f.get() for f in it] == [2]


def test_stream_is_one_call_whose_answers_come_apart_and_a_failure_stays_with_its_actor(procs):
    from monarch.runtime.controller import get_controller

    c = procs.spawn("stream_one", Counter, 5)
    calls = get_controller()._ids
    before = next(calls)
    futures = list(c.fail_on.stream(1))
    assert next(calls) == before + 2  # one call to the four actors (not four), and this one
    assert sorted(f.done() for f in futures) == [True] * 4
    values, errors = [], []
    for f in futures:
        try:
            values.append(f.get())
        except Exception as e:
            errors.append(e)
    assert values == [5, 5, 5] and len(errors) == 1
    assert "no counting on gpu 1" in str(errors[0]) and "gpu=1" in str(errors[0]), errors[0]
    # each actor sees the message as sent to the whole mesh, as with call(); the next call runs as usual
    seen = sorted((f.get()[1]["gpu"], f.get()[2]["gpu"]) for f in c.where.stream())
    assert seen == [(g, g) for g in range(4)] and c.incr.call(1).get().values() == [6] * 4


def test_choose_spreads_calls_over_the_actors(procs, tmp_path):
    c = procs.spawn("choose", Counter, 0)
    gate = str(tmp_path / "gate")
    futures = [c.hold.choose(gate) for _ in range(4)]  # four in flight at once: one each
    wait_for(lambda: started(gate, 4), what="the four calls on four actors")
    open(gate + ".open", "w").close()
    assert sorted(f.get() for f in futures) == [0, 1, 2, 3]
    assert c.incr.choose(1).get() == 1


def test_an_endpoint_error_comes_back_grouped_with_its_rank_and_the_actors_keep_working(procs):
    c = procs.spawn("errors", Counter, 7)
    with pytest.raises(monarch.RemoteError) as e:
        c.fail_on.call(2).get()
    text = str(e.value)
    assert "errors.fail_on failed on 1 of 4 ranks" in text and "rank 2" in text, text
    assert "ValueError: no counting on gpu 2" in text and "in fail_on" in text
    assert "worker/actors.py" not in text  # our plumbing is left out of the traceback
    assert c.fail_on.call(9).get().values() == [7] * 4  # the same actors answer again


def test_broadcasts_interleaved_with_calls_and_slices_keep_their_order(procs):
    """Broadcasts travel in batches (`controller/casts.py`); a call, a broadcast to another slice, or another
    mesh's message sends the batch first, so each actor still runs what it was sent in the order sent."""
    c = procs.spawn("batched", Counter, 0)
    for b in range(300):  # more than one batch
        c.incr.broadcast(b)
    c.slice(gpu=slice(0, 2)).incr.broadcast(1000)  # another slice: the queue goes first
    f = c.incr.call(2000)  # a call: every queued broadcast goes first
    c.incr.broadcast(3000)
    f.get()
    history = c.history.call().get().values()
    assert history[0] == history[1] == [*range(300), 1000, 2000, 3000]
    assert history[2] == history[3] == [*range(300), 2000, 3000]


def test_a_lone_broadcast_is_delivered_with_nothing_sent_after_it(procs, tmp_path):
    c = procs.spawn("lone", Counter, 0)
    gate = str(tmp_path / "gate")
    open(gate + ".open", "w").close()  # (hold() returns at once: it only says it started)
    c.slice(gpu=2).hold.broadcast(gate, 2)
    wait_for(lambda: os.path.exists(gate + ".2"), what="the broadcast running with nothing sent after it")


def test_a_broadcasts_arguments_are_taken_when_it_is_made(procs):
    c = procs.spawn("taken", Counter, 0)
    payload = [1, 2, 3]
    c.record.broadcast(payload)
    payload.append(4)  # after the broadcast: not what the actors get
    assert c.recorded.call().get().values() == [[[1, 2, 3]]] * 4


def test_broadcasts_made_just_before_the_mesh_exits_still_run(tmp_path):
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    c = mesh.spawn("last", Counter, 0)
    gate = str(tmp_path / "last")
    open(gate + ".open", "w").close()
    c.hold.broadcast(gate)
    mesh.exit()
    assert wait_gone(pids) == []
    assert os.path.exists(gate + ".0") and os.path.exists(gate + ".1")


def test_a_failed_broadcast_goes_to_the_unhandled_fault_hook(procs, monkeypatch):
    import monarch.actor

    seen = []
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", lambda failure: seen.append(failure))
    c = procs.spawn("hooked", Counter, 0)
    c.fail_on.broadcast(1)
    wait_for(lambda: seen, what="the broadcast's failure reaching the hook")
    assert seen[0].mesh_name == "hooked" and "fail_on" in seen[0].what and "no counting on gpu 1" in str(seen[0])


def test_bad_spawns_and_calls_say_what_is_wrong(procs):
    with pytest.raises(TypeError, match=r"the class must subclass monarch.actor.Actor"):
        procs.spawn("plain", dict)
    with pytest.raises(ValueError, match=r"give the actors a name"):
        procs.spawn("", Counter, 0)
    first = procs.spawn("twice", Counter, 0)
    second = procs.spawn("twice", Counter, 10)  # a name spawned again (Monarch allows it): actors of their own
    assert first.incr.call(1).get().values() == [1] * 4 and second.incr.call(1).get().values() == [11] * 4
    assert second.name == "twice#2" and first.incr.call(0).get().values() == [1] * 4
    with pytest.raises(
        monarch.RemoteError, match=r"(?s)twice2.__init__ failed on 4 of 4 ranks.*missing 1 required positional argument"
    ):
        procs.spawn("twice2", Counter)  # the constructor's own error, raised at spawn
    c = procs.spawn("bad", Counter, 0)
    with pytest.raises(AttributeError, match=r"Counter has no endpoint 'nothing' \(its endpoints: .*incr"):
        c.nothing  # noqa: B018
    with pytest.raises(RuntimeError, match=r"Counter.not_an_endpoint is not annotated as an endpoint.*as_endpoint"):
        c.not_an_endpoint()  # a plain method: Monarch's message, and as_endpoint() calls it as one
    with pytest.raises(ValueError, match=r"call_one\(\) needs exactly one actor; bad.incr here is on \{gpu: 4\}"):
        c.incr.call_one()
    with pytest.raises(TypeError, match=r"call an endpoint with an adverb"):
        c.incr()
    # sent to a live function, an actor mesh is a reference the function can call (test_actor_refs.py)
    assert sorted(monarch.remote(lambda m: m.slice(gpu=0).incr.call_one(5).get()).on(procs)(c).values()) == [
        5,
        10,
        15,
        20,
    ]


def test_stopped_actors_are_gone_from_their_processes(procs):
    c = procs.spawn("stopping", Counter, 0)
    c.stop()
    with pytest.raises(monarch.RemoteError, match=r"no actor named 'stopping' on this process"):
        c.incr.call().get()
    procs.spawn("stopping", Counter, 0)  # the name is free again


def test_a_process_that_dies_under_an_actor_mesh_fails_its_calls_naming_the_rank(tmp_path):
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    try:
        c = mesh.spawn("dying", Counter, 0)
        gate = str(tmp_path / "gate")
        f = c.slice(gpu=1).hold.call_one(gate)  # (never opened)
        wait_for(lambda: started(gate, 1), what="the call on gpu=1")
        os.kill(pids[1], 9)
        with pytest.raises(monarch.WorkerDiedError, match=r"rank 1 \(gpu=1\)"):
            f.get(timeout=30)
    finally:
        mesh.exit()
    assert wait_gone(pids) == []


def test_in_the_notebook_an_actors_prints_arrive_labelled_and_errors_show_once_even_nested():
    """Prints arrive as lines labelled with their process (docs/features/actors.md says so). An endpoint that
    calls another actor's failing endpoint fails in turn: the inner error is shown once, under the name users
    import (`monarch.RemoteError`), never the internal module path."""
    from helpers.kernel_client import monarch_kernel

    define = (
        "from monarch.actor import Actor, endpoint, context, this_host\n"
        "class Greeter(Actor):\n"
        "    @endpoint\n"
        "    def hello(self, who):\n"
        "        me = context().actor_instance.rank['gpu']\n"
        "        print(f'hello {who} from actor {me}')\n"
        "        return me\n"
        "    @endpoint\n"
        "    def boom(self):\n"
        "        raise KeyError('nothing here')\n"
        "class Outer(Actor):\n"
        "    def __init__(self, inner):\n"
        "        self.inner = inner\n"
        "    @endpoint\n"
        "    def go(self):\n"
        "        return self.inner.boom.call().get()\n"
        "procs = this_host().spawn_procs({'gpu': 2})\n"
        "greeters = procs.spawn('greeters', Greeter)\n"
        "outer = procs.spawn('outer', Outer, greeters)"
    )
    with monarch_kernel() as k:
        assert k.run(define).status == "ok"
        r = k.run("greeters.hello.call('you').get()")
        assert r.status == "ok", r.text()
        text = r.text()
        assert "[gpu=0] hello you from actor 0" in text and "[gpu=1] hello you from actor 1" in text, text
        assert "ValueMesh {gpu: 2}" in text
        r = k.run("greeters.boom.call().get()")
        assert r.status == "error"
        error = "\n".join(r.reply["traceback"])
        assert "greeters.boom failed on 2 of 2 ranks" in error and "ranks 0-1: KeyError: 'nothing here'" in error
        assert "Cell In[" in error and "in boom" in error, error
        r = k.run("outer.go.call().get()")
        assert r.status == "error"
        error = "\n".join(r.reply["traceback"])
        assert "outer.go failed on 2 of 2 ranks" in error, error
        assert "-- ranks 0-1: RemoteError: greeters.boom failed on 2 of 2 ranks\n" in error, error
        assert "monarch.RemoteError: greeters.boom failed on 2 of 2 ranks" in error, error
        assert error.count("KeyError: 'nothing here'") == 2, error  # (its header line and its traceback's last)
        assert error.count("greeters.boom failed") == 2 and "runtime.common.errors" not in error, error
        assert k.run("procs.exit()").status == "ok"


def test_in_the_notebook_pdb_serves_an_endpoint_and_ctrl_c_interrupts_a_waiting_call(tmp_path):
    """`breakpoint()` in an endpoint is answered per rank as in a live function; interrupting a cell that waits
    on `call()` interrupts the endpoints on the actors, and they serve the next call."""
    from helpers.kernel_client import monarch_kernel

    define = (
        "import os, time\n"
        "from monarch.actor import Actor, endpoint, context, this_host\n"
        "class Stepper(Actor):\n"
        "    @endpoint\n"
        "    def debug(self, x):\n"
        "        y = x * 10\n"
        "        breakpoint()\n"
        "        return y + 1\n"
        "    @endpoint\n"
        "    def snooze(self, marker):\n"
        "        open(f'{marker}.{os.getpid()}', 'w').close()\n"
        "        time.sleep(60)\n"
        "    @endpoint\n"
        "    def ping(self):\n"
        "        return 'pong'\n"
        "procs = this_host().spawn_procs({'gpu': 2})\n"
        "steppers = procs.spawn('steppers', Stepper)"
    )
    with monarch_kernel() as k:
        assert k.run(define).status == "ok"
        prompts: list[str] = []

        def stdin_hook(msg):
            prompts.append(msg["content"]["prompt"])
            k.kc.input("p y" if len(prompts) % 2 else "c")

        r = k.run("steppers.debug.call(4).get()", allow_stdin=True, stdin_hook=stdin_hook)
        assert r.status == "ok", r.text()
        assert len(prompts) == 4 and all(p.endswith("(Pdb) ") for p in prompts), prompts
        text = r.text()
        assert "[gpu=0] 40" in text and "[gpu=1] 40" in text and "41" in text, text
        marker = str(tmp_path / "snoozing")
        k.interrupt_when(lambda: started(marker, 2), "snooze running on both actors")
        r = k.run(f"steppers.snooze.call({marker!r}).get()", timeout=30)
        assert r.status == "error" and "KeyboardInterrupt" in r.text() and "time.sleep(60)" in r.text(), r.text()
        r = k.run("steppers.ping.call().get().values()")
        assert r.status == "ok" and "['pong', 'pong']" in r.text(), r.text()
        assert k.run("procs.exit()").status == "ok"
        # actors on the mesh `%%mesh` cells run on, beside the cells' namespace
        assert k.run("%%mesh gpu=2\nx = 10 * rank").status == "ok"
        r = k.run("cells = get_ipython().run_line_magic('mesh', 'status').mesh\n"
                  "cells.spawn('pingers', Stepper).ping.call().get().values()")  # fmt: skip
        assert r.status == "ok" and "['pong', 'pong']" in r.text(), r.text()
        r = k.run("%%mesh\nx")
        assert r.status == "ok" and "gpu=1        10" in r.text(), r.text()  # the namespace survived the actors


def test_the_mesh_table_lists_each_processs_actors(procs):
    a = procs.spawn("tabled", Counter, 0)
    procs.slice(gpu=slice(0, 2)).spawn("half", Counter, 0)
    rows = procs.to_table(with_memory=False).rows
    assert [r["actors"].count("tabled (Counter)") for r in rows] == [1, 1, 1, 1]
    assert [("half (Counter)" in r["actors"]) for r in rows] == [True, True, False, False]
    assert "actors" in procs.to_table(with_memory=False).columns
    a.stop()
    assert not any("tabled" in r["actors"] for r in procs.to_table(with_memory=False).rows)


class TorchrunStyle(Actor):
    @endpoint
    def train(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # from the environment, as under torchrun
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()


def test_torchrun_style_code_runs_in_actors_after_setup_torch_elastic_env():
    from monarch.spmd import setup_torch_elastic_env

    mesh = this_host().spawn_procs({"gpu": 3})
    pids = worker_pids(mesh)
    try:
        trainers = mesh.spawn("torchrun", TorchrunStyle)
        envs = setup_torch_elastic_env(trainers)
        assert [(e["RANK"], e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs] == [
            (str(r), "3", "127.0.0.1") for r in range(3)
        ]
        assert len({e["MASTER_PORT"] for e in envs}) == 1
        assert trainers.train.call().get().values() == [3.0] * 3  # its own default group: 0 + 1 + 2
        with pytest.raises(monarch.RemoteError, match=r"handed over to torchrun-style code"):
            monarch.remote(lambda g: g).on(mesh)(mesh.process_group("gpu"))
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
