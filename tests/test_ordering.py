"""Messages that rely on earlier ones never overtake them: across threads, between live calls and
tensor commands, and after a failure on the workers. (Each test failed before its fix.)"""

import gc
import threading

import pytest
import torch

import monarch
from monarch.runtime.common import context

pytestmark = pytest.mark.timeout(120)


def _explode():
    if context.worker is not None:
        raise ImportError("no such module on the workers")
    return Arg()


class Arg:
    """An argument that pickles here and fails to unpickle on a worker."""

    def __reduce__(self):
        return _explode, ()


def test_a_function_shipped_with_bad_arguments_still_arrives(mesh):
    @monarch.remote
    def answer(x):
        return 42

    with pytest.raises(monarch.RemoteError, match="no such module on the workers"):
        answer.on(mesh)(Arg())
    assert answer.on(mesh)(1).values() == [42] * 4  # the function was kept although its arguments failed


def test_a_live_call_runs_after_the_tensor_commands_issued_before_it(mesh):
    @monarch.remote
    def draw():
        return torch.randn(3)

    with mesh.activate():
        torch.manual_seed(1234)  # a tensor-engine command, batched
        fut = draw.call_async()
        values = fut.result().values()  # decoded inside activate(): still local tensors
    assert all(type(v) is torch.Tensor for v in values)
    torch.manual_seed(1234)
    want = torch.randn(3)
    assert all(torch.equal(v, want) for v in values)


def test_two_threads_starting_on_a_fresh_mesh_share_one_engine():
    from monarch.actor import this_host

    for _ in range(3):
        m = this_host().spawn_procs({"gpu": 1})
        try:
            go = threading.Barrier(2)
            made = {}

            def first_tensor(tag, value, m=m, go=go, made=made):
                go.wait()
                with m.activate():
                    made[tag] = torch.full((4,), value)

            ts = [threading.Thread(target=first_tensor, args=a) for a in (("A", 1.0), ("B", 2.0))]
            [t.start() for t in ts]
            [t.join(60) for t in ts]
            assert {k: monarch.inspect(t)[0].item() for k, t in made.items()} == {"A": 1.0, "B": 2.0}
        finally:
            m.exit()


def test_freed_tensors_are_freed_on_the_workers_that_hold_them(mesh):
    @monarch.remote
    def table_size():
        from monarch.runtime.worker.engine import table

        return table.table_size()

    before = table_size.on(mesh)().values()
    a, b = mesh.slice(host=0), mesh.slice(host=1)
    for _ in range(30):
        with a.activate():
            t = torch.ones(100)  # on ranks 0-1
        del t  # freed after a's batch went out
        with b.activate():
            torch.zeros(1)  # the next batch goes to ranks 2-3
    gc.collect()
    with a.activate():
        torch.zeros(1)
    with b.activate():
        torch.zeros(1)
    after = table_size.on(mesh)().values()
    assert all(x - y <= 3 for x, y in zip(after, before)), (before, after)


def test_crosswise_moves_between_meshes_from_two_threads_do_not_deadlock():
    from monarch.actor import this_host

    m1 = this_host().spawn_procs({"gpu": 1})
    m2 = this_host().spawn_procs({"gpu": 1})
    try:
        out = {}

        def mover(src, dst, tag, value):
            with src.activate():
                out[tag] = [(torch.ones(100000) * value).to_mesh(dst) for _ in range(150)]

        ts = [threading.Thread(target=mover, args=a, daemon=True) for a in ((m1, m2, "A", 1.0), (m2, m1, "B", 2.0))]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        a = monarch.fetch_shard(out["A"][-1]).result(timeout=30)
        b = monarch.fetch_shard(out["B"][-1]).result(timeout=30)
        assert a.eq(1.0).all() and b.eq(2.0).all()
    finally:
        m1.exit()
        m2.exit()
