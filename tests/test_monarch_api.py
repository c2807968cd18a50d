"""Meta Monarch's actor API as its programs use it, on real worker processes: every name of its `monarch.actor`,
`current_rank()` as a `Point`, ports and channels, `send()`, explicit response ports, concurrent endpoints,
`__cleanup__`, `Accumulator`, `as_endpoint`, the shape trait every mesh shares, and the adverbs declared once
(one test over the three kinds of endpoint)."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest

import monarch
from monarch.actor import (
    Accumulator,
    Actor,
    ActorError,
    Channel,
    Extent,
    Point,
    Port,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    context,
    current_actor_name,
    current_rank,
    current_size,
    endpoint,
    send,
    this_host,
    this_proc,
)

from conftest import wait_gone, worker_pids

MONARCH_ACTOR_ALL = [
    # Meta Monarch's `monarch.actor.__all__` at its HEAD, then the names torchmonarch 0.7's adds.
    "Accumulator", "Actor", "ActorError", "current_actor_name", "as_endpoint", "current_rank", "current_size",
    "concurrent_endpoint", "endpoint", "Future", "Point", "ProcMesh", "ProcId", "Channel", "send",
    "shutdown_context", "ValueMesh", "debug_controller", "get_or_spawn_controller", "this_host", "this_proc",
    "default_bootstrap_cmd", "HostMesh", "context", "hosts_from_config", "Port", "PortReceiver", "Endpoint",
    "Extent", "run_worker_loop_forever", "attach_to_workers", "attach", "enable_transport", "Context",
    "ChannelTransport", "unhandled_fault_hook", "MeshFailure", "config", "get_meter", "span", "traced", "Uid",
    "returns_future", "run_worker_loop_until_shutdown", "start_worker_loop_forever",
]  # fmt: skip

REFUSED = {
    # what needs Monarch's own bootstrap (workers joined by address alone, TLS), each refused naming what to use
    "attach": lambda a: a.attach("tcp://host:1234"),
    "attach_to_workers": lambda a: a.attach_to_workers(workers=["tcp://host:1"], ca="trust_all_connections"),
    "run_worker_loop_forever": lambda a: a.run_worker_loop_forever(address="tcp://host:1", ca=None),
    "run_worker_loop_until_shutdown": lambda a: a.run_worker_loop_until_shutdown(address="tcp://h:1", ca=None),
    "start_worker_loop_forever": lambda a: a.start_worker_loop_forever(address="tcp://h:1", ca=None),
    "default_bootstrap_cmd": lambda a: a.default_bootstrap_cmd(),
    "debug_controller": lambda a: a.debug_controller(),
}


def test_every_name_of_monarchs_monarch_actor_is_here_and_does_something():
    import monarch.actor as a

    missing = [n for n in MONARCH_ACTOR_ALL if not hasattr(a, n)]
    assert missing == []
    assert set(MONARCH_ACTOR_ALL) <= set(a.__all__)
    for name, call in REFUSED.items():
        with pytest.raises(NotImplementedError, match=r"monarch\.notebook|monarch debug|here") as got:
            call(a)
        assert len(str(got.value)) > 60, (name, got.value)  # says what to use instead, not just "no"
    # the small ones that need no mesh
    assert str(a.Extent(["host", "gpu"], [2, 4])) == "{host: 2, gpu: 4}" and a.Extent({"gpu": 4}).nelements == 4
    uid = a.Uid.instance("trainer")
    assert a.Uid.from_string(str(uid)) == uid and a.ProcId(uid).label == "trainer"
    assert a.config.prefix_python_logs_with_actor is True
    assert a.hosts_from_config("NO_SUCH_VARIABLE_SET").extent == {"hosts": 1}  # no job named: this machine
    with a.span("load"):
        pass
    assert a.traced(lambda x: x + 1)(1) == 2
    a.get_meter("monarch.test").create_counter("steps").add(1)
    with pytest.raises(ValueError, match=r"ZeroMQ CURVE.*TcpWithHostname"):
        a.enable_transport(a.ChannelTransport.Tls)


def test_a_point_is_a_read_only_mapping_with_a_rank_and_an_extent():
    p = Point(5, Extent(["host", "gpu"], [2, 4]))
    assert dict(p) == {"host": 1, "gpu": 1} and p.rank == 5 and p["gpu"] == 1 and p.size("gpu") == 4
    assert list(p) == ["host", "gpu"] and len(p) == 2 and repr(p) == "{'host': 1/2, 'gpu': 1/4}"
    assert pickle.loads(pickle.dumps(p)) == p and p == {"host": 1, "gpu": 1}
    with pytest.raises(ValueError, match=r"Point\(rank=8\): a rank of extent \{host: 2, gpu: 4\} is in range\(8\)"):
        Point(8, Extent(["host", "gpu"], [2, 4]))
    assert Point(0, Extent()) == {} and Point(0, {}).extent.nelements == 1


class Where(Actor):
    def __init__(self) -> None:
        self.made_at = current_rank()

    @endpoint
    def where(self) -> tuple:
        r, ctx = current_rank(), context()
        return (r.rank, dict(r), dict(r.extent), current_size(), dict(ctx.actor_instance.rank), current_actor_name())


class Folks(Actor):
    """The endpoints the tests below call, in every way Monarch's programs do."""

    def __init__(self, out: Port | None = None) -> None:
        self.out = out
        self.pending: list[Port] = []
        self.event = asyncio.Event()
        self.value = None
        self.cleanup_mark: str | None = None

    @endpoint
    def rank(self, times: int = 1) -> int:
        return current_rank().rank * times

    @endpoint
    def boom(self) -> None:
        raise KeyError("boom")

    @endpoint
    def tell(self, x: int) -> None:
        assert self.out is not None
        self.out.send((current_rank().rank, x))

    @endpoint
    def open_port(self) -> Port:
        self.port, self.receiver = Channel.open()
        return self.port

    @endpoint
    def take(self, n: int) -> list:
        return [self.receiver.recv().get(timeout=30) for _ in range(n)]

    @endpoint(explicit_response_port=True)
    def later(self, port: Port, x: int) -> None:
        if x < 0:
            port.send(-x)  # answered at once
        else:
            self.pending.append(port)  # or by another endpoint, later

    @endpoint
    def release(self, value: int) -> int:
        for port in self.pending:
            port.send(value)
        n, self.pending = len(self.pending), []
        return n

    @concurrent_endpoint
    async def wait_for_update(self) -> int:
        await self.event.wait()  # delivered by `update`, another endpoint, while this one waits
        return self.value

    @endpoint
    async def update(self, value: int) -> None:
        self.value = value
        self.event.set()

    @endpoint
    def mark_cleanup(self, path: str) -> None:
        self.cleanup_mark = path

    def plain(self) -> str:
        return "plain"

    def __cleanup__(self, exc: Exception | None) -> None:
        if self.cleanup_mark:
            with open(f"{self.cleanup_mark}.{current_rank().rank}", "w") as f:
                f.write(repr(exc))


@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


def test_current_rank_is_a_point_in_the_mesh_the_message_went_to(procs):
    w = procs.spawn("where", Where)
    got = w.where.call().get()
    assert [v[:5] for v in got.values()] == [
        (0, {"gpus": 0}, {"gpus": 2}, {"gpus": 2}, {"gpus": 0}),
        (1, {"gpus": 1}, {"gpus": 2}, {"gpus": 2}, {"gpus": 1}),
    ]
    assert got.values()[1][5].startswith("where[1] on mesh ")
    # a slice to one point: the message's rank has no dimensions, the actor's own rank is still gpus=1
    assert w.slice(gpus=1).where.call_one().get()[:5] == (0, {}, {}, {}, {"gpus": 1})
    # iterating a ValueMesh gives (point, value), as Monarch's does; items() too; values() the values
    assert [(dict(p), p.rank, v[0]) for p, v in got] == [({"gpus": 0}, 0, 0), ({"gpus": 1}, 1, 1)]
    assert got.slice(gpus=1).values() == [got.values()[1]] and got.item(gpus=0)[0] == 0
    # a live function's current_rank() is its worker's point in the view it was called on
    assert monarch.remote(lambda: tuple(current_rank())).on(procs)().values() == [("gpus",), ("gpus",)]
    # the client's, as Monarch's root client: a point of no dimensions
    assert current_rank() == {} and current_size() == {} and context().actor_instance.name == "client"


def test_every_mesh_shares_one_shape_api(procs):
    w = procs.spawn("shapes", Where)
    values = w.where.call().get()
    for m in (procs, w, values):
        assert m.extent == {"gpus": 2} and m.sizes == {"gpus": 2} and m.size() == 2 and len(m) == 2
        assert m._labels == ("gpus",) and m.size(["gpus"]) == 2
        assert len(m.slice(gpus=1)) == 1 and m.slice(gpus=slice(0, 1)).extent == {"gpus": 1}
        assert m.rename(gpus="dp").extent == {"dp": 2} and m.split(gpus=("a", "b"), b=2).extent == {"a": 1, "b": 2}
        assert m.flatten("all").extent == {"all": 2}
    assert this_host().extent == {} and procs.host_mesh.extent == {} and this_proc().extent == {}
    first = dict.fromkeys(procs._labels, 0)  # Monarch's DDP example picks its first point so
    assert w.slice(**first).where.call_one().get()[4] == {"gpus": 0}


def test_stream_accumulator_as_endpoint_and_actor_errors(procs):
    f = procs.spawn("misc", Folks)
    assert sorted(x.get() for x in f.rank.stream(3)) == [0, 3]
    assert Accumulator(f.rank, 10, lambda acc, x: acc + x).accumulate(5).get() == 15
    assert asyncio.run(_awaited(Accumulator(f.rank, 0, lambda a, x: a + x).accumulate(7))) == 7
    with pytest.raises(RuntimeError, match=r"Folks.plain is not annotated as an endpoint"):
        f.plain()
    assert as_endpoint(f.plain).call().get().values() == ["plain", "plain"]
    with pytest.raises(ValueError, match=r"as_endpoint\(\) takes a method of a spawned actor mesh"):
        as_endpoint(f.rank)
    with pytest.raises(monarch.RemoteError, match=r"(?s)misc.boom failed on 2 of 2 ranks.*KeyError: 'boom'"):
        f.boom.call().get()
    err = ActorError(KeyError("boom"), "Actor call misc.boom failed.")
    assert str(err).startswith("Actor call misc.boom failed.") and "KeyError: 'boom'" in str(err)
    assert pickle.loads(pickle.dumps(err)).exception_formatted == err.exception_formatted
    with pytest.raises(
        ValueError, match=r"misc.rank.rref\(\): the endpoint says nothing of its result's shape.*propagate"
    ):
        f.rank.rref()


async def _awaited(x):
    return await x


def test_ports_between_the_controller_and_actors(procs):
    port, receiver = Channel.open()
    f = procs.spawn("ports", Folks, port)  # a Port pickles: each actor's sends reach this receiver
    f.tell.call(7).get()
    assert sorted([receiver.recv().get(timeout=30), receiver.recv().get(timeout=30)]) == [(0, 7), (1, 7)]
    # a port opened in an actor, sent to from here (down the command connection) and from the other actor
    theirs = f.slice(gpus=0).open_port.call_one().get()
    theirs.send("from the controller")
    other = f.slice(gpus=1)
    send(other.tell, (1,), {}, port=None)  # fire and forget to actor 1 (its answer to its own port, ours)
    assert receiver.recv().get(timeout=30) == (0, 1)  # (its rank in the slice the message went to)
    assert f.slice(gpus=0).take.call_one(1).get() == ["from the controller"]
    # send(port=): each actor's answer to the port, ranked; selection="choose": one actor
    ranked_port, ranked = Channel.open_ranked()
    send(f.rank, (10,), {}, port=ranked_port, selection="all")
    assert sorted([ranked.recv().get(timeout=30), ranked.recv().get(timeout=30)]) == [(0, 0), (1, 10)]
    send(f.rank, (10,), {}, port=ranked_port, selection="choose")
    assert ranked.recv().get(timeout=30) in [(0, 0), (1, 10)]
    # an exception sent to a port raises at the receiver; a failing endpoint's error goes to the port too
    p, r = Channel.open()
    p.exception(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        r.recv().get(timeout=30)
    send(f.boom, (), {}, port=p, selection="choose")
    with pytest.raises(KeyError, match="boom"):
        r.recv().get(timeout=30)
    once, r1 = Channel.open(once=True)
    once.send(1)
    with pytest.raises(RuntimeError, match=r"takes one message"):
        once.send(2)
    assert asyncio.run(_awaited(r1.recv())) == 1
    with pytest.raises(TimeoutError, match=r"nothing came within 0.2 s"):
        Channel.open()[1].recv().get(timeout=0.2)
    with pytest.raises(ValueError, match=r"selections are 'all' and 'choose'"):
        send(f.rank, (), {}, selection="some")


def test_an_explicit_response_port_answers_later_from_another_endpoint(procs):
    f = procs.spawn("explicit", Folks)
    one = f.slice(gpus=0)
    assert one.later.call_one(-4).get(timeout=30) == 4  # answered at once, through the port
    waiting = one.later.call_one(1)  # the endpoint returns; the answer waits for release()
    assert one.release.call_one(42).get(timeout=30) == 1 and waiting.get(timeout=30) == 42
    both = f.later.call(1)  # a call to both: each answers through its own port
    assert f.release.call(5).get(timeout=30).values() == [1, 1] and both.get(timeout=30).values() == [5, 5]


def test_a_concurrent_endpoint_waits_for_what_another_endpoint_delivers(procs):
    """Monarch's grpo_actor pattern: one endpoint waits (an asyncio.Event) for an update another delivers."""
    f = procs.spawn("concurrent", Folks)
    waiting = f.wait_for_update.call()
    f.update.call(9).get(timeout=30)  # would wait behind wait_for_update forever without concurrency
    assert waiting.get(timeout=30).values() == [9, 9]


def test_cleanup_runs_when_actors_stop_and_when_their_processes_stop(tmp_path):
    procs = this_host().spawn_procs({"gpus": 2})
    pids = worker_pids(procs)
    try:
        f = procs.spawn("cleaned", Folks)
        f.mark_cleanup.call(str(tmp_path / "actor")).get()
        assert f.stop().get() is None  # Monarch's stop() returns a future
        assert sorted(os.listdir(tmp_path)) == ["actor.0", "actor.1"]
        assert (tmp_path / "actor.0").read_text() == "None"
        g = procs.spawn("cleaned-too", Folks)
        g.mark_cleanup.call(str(tmp_path / "procs")).get()
        waiting = g.wait_for_update.call()  # a concurrent call still running: cancelled before __cleanup__
    finally:
        asyncio.run(_awaited(procs.stop()))  # `await procs.stop()`, as Monarch's examples write it
    assert wait_gone(pids) == []
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("procs")) == ["procs.0", "procs.1"]
    with pytest.raises((monarch.RemoteError, monarch.MeshStoppedError)):
        waiting.get(timeout=30)


class Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n


class Driver(Actor):
    """Runs the adverbs test against a reference it holds (the second kind of endpoint)."""

    @endpoint
    def check(self, counters) -> list:
        return _adverbs(counters, lambda f: f.get(timeout=30))


def _adverbs(counters, get) -> list:
    """Every adverb against `counters` (one actor, or a mesh of them); what each gave."""
    n = len(counters)
    out = [sorted(get(counters.incr.call(1)).values())]
    one = counters.slice(**{d: 0 for d in counters._labels}) if counters._labels else counters
    out.append(get(one.incr.call_one(1)))
    out.append(get(counters.incr.choose(0)) > 0)
    out.append(sorted(get(f) for f in counters.incr.stream(0)))
    counters.incr.broadcast(1)
    port, receiver = Channel.open()
    send(counters.incr, (0,), {}, port=port, selection="all")
    out.append(sorted(receiver.recv().get(timeout=30) for _ in range(n)))
    with pytest.raises(TypeError, match=r"call an endpoint with an adverb"):
        counters.incr()
    return out


def test_the_adverbs_mean_the_same_on_every_kind_of_endpoint(procs):
    """Declared once (`common/endpoint.py`): the controller's actor meshes, references held by actors, and
    `this_proc()` actors give the same answers to the same adverbs."""
    on_workers = procs.spawn("adverbs", Counter)
    assert _adverbs(on_workers, lambda f: f.get(timeout=30)) == [[1, 1], 2, True, [1, 2], [2, 3]]
    held = procs.spawn("adverbs-held", Counter)
    driver = this_host().spawn_procs({"gpus": 1})
    try:
        d = driver.spawn("driver", Driver)
        assert d.check.call_one(held).get(timeout=60) == [[1, 1], 2, True, [1, 2], [2, 3]]
    finally:
        driver.exit()
    local = this_proc().spawn("adverbs-local", Counter)
    try:
        assert _adverbs(local, lambda f: f.get(timeout=30)) == [[1], 2, True, [2], [3]]
    finally:
        local.stop()


def test_singletons_and_the_clients_end():
    from monarch.actor import get_or_spawn_controller

    a = get_or_spawn_controller("the-counter", Counter).get()
    b = get_or_spawn_controller("the-counter", Counter).get()
    assert a is b and a.incr.call_one().get() == 1 and b.incr.call_one().get() == 2
    with pytest.raises(TypeError, match=r"'the-counter' is a Counter"):
        get_or_spawn_controller("the-counter", Folks)
    assert isinstance(a.incr.call().get(), ValueMesh)
    a.stop()


class Linear(Actor):
    """The tensor engine and actors together, as Monarch's getting-started guide has them."""

    def __init__(self) -> None:
        import torch

        self.w = torch.eye(3) * (1 + current_rank().rank)

    @endpoint(propagate=lambda x: x)
    def forward(self, x):
        return x @ self.w

    @endpoint
    def describe(self, t) -> tuple:
        return type(t).__name__, tuple(t.shape), float(t.sum())

    @endpoint(propagate=lambda x: x)
    def broken(self, x):
        raise ValueError("no")


def test_distributed_tensors_meet_actors_on_the_same_workers(procs):
    import torch

    lin = procs.spawn("linear", Linear)
    with procs.activate():
        t = torch.ones(3, 3)
        out = torch.relu(lin.forward.rref(t))  # the endpoint on each worker's own `t`; the result a handle
        twice = out * 2
        bad = lin.broken.rref(t) + 1
    assert isinstance(out, monarch.Tensor) and tuple(out.shape) == (3, 3)
    assert monarch.inspect(twice, gpus=1).tolist() == [[4.0, 4.0, 4.0]] * 3  # ones @ (2 * eye) * 2
    # a handle given to an endpoint is that worker's tensor there (after the ops that made it)
    assert lin.describe.call(out).get().values() == [("Tensor", (3, 3), 9.0), ("Tensor", (3, 3), 18.0)]
    with pytest.raises(monarch.RemoteError, match=r"(?s)ValueError: no"):
        monarch.inspect(bad, gpus=0)  # the endpoint's error poisons what depends on its result
    # a live function is an endpoint too, under activate(): call(), and send() with a port
    with procs.activate():
        assert monarch.remote(lambda: current_rank().rank).call().get().values() == [0, 1]
        port, receiver = Channel.open_ranked()
        send(monarch.remote(lambda: "hi"), (), {}, port=port)
        assert sorted(receiver.recv().get(timeout=30) for _ in range(2)) == [(0, "hi"), (1, "hi")]
    other = this_host().spawn_procs({"gpus": 1})
    try:
        with pytest.raises(monarch.RemoteError, match=r"a monarch.Tensor of mesh \d+ was sent to a worker of another"):
            other.spawn("lin2", Linear).describe.call_one(out).get()
    finally:
        other.exit()


class Producer(Actor):
    """Sends a port as fast as it can until stopped (Monarch's grpo_yield generators)."""

    @endpoint
    async def start(self, port: Port) -> None:
        self.running = True
        self.task = asyncio.create_task(self._loop(port))

    async def _loop(self, port: Port) -> None:
        i = 0
        while self.running:
            port.send(i)
            i += 1
            await asyncio.sleep(0)

    @endpoint
    async def stop_producing(self) -> None:
        self.running = False
        await self.task


class Relay(Actor):
    """Takes from its own port and passes on, from an `async def` endpoint's task."""

    def __init__(self) -> None:
        self.port, self.receiver = Channel.open()

    @endpoint
    def where(self) -> Port:
        return self.port

    @endpoint
    async def relay(self, out: Port, n: int) -> None:
        for _ in range(n):
            out.send(await self.receiver.recv())

    @endpoint
    def ping(self) -> str:
        return "pong"


class Queue(Actor):
    """Monarch's grpo_actor queue: `get` waits for what `put` brings (so it must not hold the actor's turn)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()

    @endpoint
    async def put(self, x: int) -> None:
        await self.items.put(x)

    @concurrent_endpoint
    async def get(self) -> int:
        return await self.items.get()

    @endpoint
    async def stop(self) -> str:  # an endpoint named as an actor mesh's method: `q.stop.call_one()` reaches it
        return "stopped the queue's work"

    @endpoint(explicit_response_port=True)
    def later(self, port: Port) -> None:
        self.port = port  # never answered: a caller with a timeout gets TimeoutError

    @endpoint
    async def slow(self, gate: str) -> str:
        while not os.path.exists(gate):
            await asyncio.sleep(0.01)
        return "slow done"


class Caller(Actor):
    def __init__(self, q) -> None:
        self.q = q

    @endpoint
    def wait_briefly(self) -> str:
        try:
            self.q.later.call_one().get(timeout=0.5)
        except TimeoutError as e:
            return f"TimeoutError: {e}"
        return "answered"


def test_a_flooded_process_still_sends_what_its_tasks_send(procs):
    """Producers sending a port faster than its process takes it (Monarch's grpo_yield): that process's own
    sends (from an `async def` endpoint's task) and the controller's calls still get their turn."""
    flood = this_host().spawn_procs({"gpus": 2})
    try:
        relay = procs.slice(gpus=0).spawn("relay", Relay)
        producers = flood.spawn("producers", Producer)
        producers.start.call(relay.where.call_one().get()).get()
        out, receiver = Channel.open()
        relaying = relay.relay.call_one(out, 200)
        got = [receiver.recv().get(timeout=60) for _ in range(200)]
        assert len(got) == 200 and relay.ping.call_one().get(timeout=60) == "pong"
        relaying.get(timeout=60)
        producers.stop_producing.call().get(timeout=60)
    finally:
        flood.exit()


def test_async_endpoints_run_one_at_a_time_per_actor_and_actors_do_not_block_each_other(procs, tmp_path):
    q = procs.slice(gpus=1).spawn("queue", Queue)
    other = procs.slice(gpus=1).spawn("other", Queue)  # another actor of the same process
    gate = str(tmp_path / "gate")
    waiting = q.get.call_one()  # a concurrent endpoint waits for what put brings; put is not held behind it
    slow = q.slow.call_one(gate)  # a plain async endpoint holds this actor's turn...
    assert other.stop.call_one().get(timeout=30) == "stopped the queue's work"  # ...not the other actor's
    q.put.call_one(7)  # (queued behind `slow`, in the order sent)
    open(gate, "w").close()
    assert slow.get(timeout=30) == "slow done" and waiting.get(timeout=30) == 7
    # an endpoint named `stop`: `q.stop()` still stops the actor mesh
    assert q.stop.call_one().get(timeout=30) == "stopped the queue's work"
    # a reference's get(timeout=) raises TimeoutError when no answer comes (Monarch's crawler relies on it)
    c = procs.slice(gpus=0).spawn("caller", Caller, q)
    assert c.wait_briefly.call_one().get(timeout=30).startswith("TimeoutError: queue.later")
    assert q.stop().get() is None and other.stop().get() is None


class OwnEngine(Actor):
    """Monarch's grpo_actor_te: an actor running the tensor engine on its own process."""

    @endpoint
    async def step(self) -> float:
        import torch

        from monarch.fetch import fetch_shard

        with context().actor_instance.proc_mesh.activate():
            t = torch.ones(4) * 2
        return (await fetch_shard(t.sum())).item()


def test_an_actor_drives_its_own_process_tensor_engine():
    one = this_host().spawn_procs({"gpus": 1})
    try:
        assert one.spawn("own", OwnEngine).step.call_one().get(timeout=30) == 8.0
    finally:
        one.exit()
    two = this_host().spawn_procs({"gpus": 2})
    try:
        with pytest.raises(monarch.RemoteError, match=r"each actor would drive every process of its mesh"):
            two.spawn("own", OwnEngine).step.call().get(timeout=30)
    finally:
        two.exit()
