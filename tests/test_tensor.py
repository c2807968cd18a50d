"""The tensor engine: ops captured inside mesh.activate() run on the workers; values, collectives, failures."""

import asyncio
import inspect
import os
import signal
import time

import pytest
import torch
import torch.nn as nn

import monarch
from monarch.runtime.remote import RemoteFunction

from conftest import say_started, started, wait_for, wait_gone, worker_pids

pytestmark = pytest.mark.timeout(60)


def _all(t, mesh):
    """Every rank's value, in rank order."""
    return [monarch.inspect(t, **c) for c, _ in mesh._shape.points()]


def test_ops_run_on_workers_and_match_local_torch(mesh):
    local = torch.rand(3, 4)
    assert type(local) is torch.Tensor
    with mesh.activate():
        a = torch.arange(12.0).reshape(3, 4)
        b = (a @ a.T + 1).relu_().sum(dim=1)
        c = a[1:, ::2] * local[1:, ::2]  # a local tensor travels with the op
        d = torch.cat([a, a]).view(2, 3, 4).mean()
    assert isinstance(b, monarch.Tensor) and b.shape == (3,) and "mesh={host: 2, gpu: 2}" in repr(b)
    ref = torch.arange(12.0).reshape(3, 4)
    for rank_value in _all(b, mesh):
        assert torch.equal(rank_value, (ref @ ref.T + 1).relu_().sum(dim=1))
    assert torch.equal(monarch.inspect(c, host=1, gpu=1), ref[1:, ::2] * local[1:, ::2])
    assert monarch.inspect(d).item() == pytest.approx(ref.mean().item())
    assert type(torch.ones(2) + 1) is torch.Tensor  # outside activate(), torch is untouched


def test_random_values_differ_per_rank(mesh):
    with mesh.activate():
        t = torch.rand(4)
    values = _all(t, mesh)
    assert len({tuple(v.tolist()) for v in values}) == 4


@pytest.mark.parametrize("reduction", ["sum", "avg", "max", "min", "product", "stack"])
@pytest.mark.parametrize("dims", ["gpu", "host", ("host", "gpu")])
def test_reduce_matches_local(mesh, reduction, dims):
    with mesh.activate():
        t = torch.rand(4, 3) + 0.5
        r = t.reduce(dims, reduction)
    values = _all(t, mesh)
    dims_t = (dims,) if isinstance(dims, str) else dims
    for coords, _ in mesh._shape.points():
        group = [
            values[r2]
            for c2, r2 in mesh._shape.points()
            if all(c2[d] == coords[d] for d in mesh.names if d not in dims_t)
        ]
        stacked = torch.stack(group)
        expected = {
            "sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0),
            "product": stacked.prod(0), "stack": stacked,
        }[reduction]  # fmt: skip
        assert torch.allclose(monarch.inspect(r, **coords), expected, rtol=1e-5), (coords, reduction)


def test_reduce_scatter_all_to_all_and_in_place(mesh):
    with mesh.activate():
        t = torch.rand(2, 3)
        rs = t.reduce("gpu", "sum", scatter=True)
        a2a = t.reduce("gpu", "stack", scatter=True)
        inplace = t * 1
        same = inplace.reduce_("gpu", "sum")
    assert same is inplace
    v = {(c["host"], c["gpu"]): monarch.inspect(t, **c) for c, _ in mesh._shape.points()}
    for h in range(2):
        total = v[(h, 0)] + v[(h, 1)]
        for g in range(2):
            assert torch.allclose(monarch.inspect(rs, host=h, gpu=g), total[g : g + 1])
            assert torch.allclose(monarch.inspect(a2a, host=h, gpu=g), torch.stack([v[(h, 0)][g], v[(h, 1)][g]]))
            assert torch.allclose(monarch.inspect(inplace, host=h, gpu=g), total)


def test_reduce_on_a_slice_and_a_renamed_view(mesh):
    half = mesh.slice(host=1).rename(gpu="tp")
    with half.activate():
        t = torch.rand(3)
        r = t.reduce("tp", "sum")
    x0, x1 = monarch.inspect(t, tp=0), monarch.inspect(t, tp=1)
    assert torch.allclose(monarch.inspect(r, tp=1), x0 + x1)


def test_model_forward_and_backward_on_a_2x2_mesh(mesh):
    with mesh.activate():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        x = torch.rand(5, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        (gb,) = torch.autograd.grad(model(x).sum(), [model[2].bias])
    local = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    coords = {"host": 1, "gpu": 0}
    with torch.no_grad():
        for p_local, p_remote in zip(local.parameters(), model.parameters()):
            p_local.copy_(monarch.inspect(p_remote, **coords))
    xl = monarch.inspect(x, **coords)
    ll = local(xl).pow(2).mean()
    ll.backward()
    assert torch.allclose(monarch.inspect(loss, **coords), ll)
    for p_local, p_remote in zip(local.parameters(), model.parameters()):
        assert torch.allclose(monarch.inspect(p_remote.grad, **coords), p_local.grad, atol=1e-6)
    assert monarch.inspect(gb, **coords).item() == pytest.approx(5.0)


def test_failed_op_poisons_only_dependents(mesh):
    with mesh.activate():
        ok = torch.ones(3, 4) * 2
        big = torch.rand(4, 2**55)  # 512 PiB: more than any address space, so malloc fails (no OOM kill)
        bad = ok @ big
        worse = bad + 1
        also_ok = ok + 1
        summed = worse.reduce("gpu", "sum")  # a poisoned input still takes part: no rank hangs
    with pytest.raises(monarch.RemoteError) as info:
        monarch.inspect(worse, host=1, gpu=1)
    text = str(info.value)
    assert "can't allocate memory" in text and "test_tensor.py" in text and "big = torch.rand(4," in _line(text)
    with pytest.raises(monarch.RemoteError):
        monarch.inspect(summed)
    assert torch.equal(monarch.inspect(also_ok), torch.full((3, 4), 3.0))  # independent values stay fetchable
    with mesh.activate():
        after = (ok * 5).reduce("host", "sum")
    assert torch.equal(monarch.inspect(after), torch.full((3, 4), 20.0))  # workers alive, collectives work


def test_a_collective_whose_input_failed_on_one_rank_fails_on_every_rank_of_its_group(mesh):
    """Every result of a collective depends on every rank's input: one failed input poisons the whole
    group's results (carrying that rank's error); other groups and later collectives are unaffected."""
    kinds = [("sum", False), ("avg", False), ("max", False), ("min", False), ("product", False)]
    kinds += [("stack", False), ("sum", True), ("stack", True)]
    with mesh.activate():
        me = torch.arange(4).reduce(("host", "gpu"), "stack", scatter=True)[:1]  # all-to-all: each rank's index
        picked = torch.index_select(torch.arange(3.0), 0, me).repeat(2)  # fails on rank 3 only
        outs = [picked.reduce("gpu", k, scatter=s) for k, s in kinds]
        fine = torch.ones(2).reduce("gpu")
    assert [monarch.inspect(me, **c).item() for c, _ in mesh._shape.points()] == [0, 1, 2, 3]
    p0, p1 = torch.zeros(2), torch.ones(2)  # the inputs of ranks 0 and 1 (host=0)
    stacked = torch.stack([p0, p1])
    expected = [p0 + p1, (p0 + p1) / 2, torch.max(p0, p1), torch.min(p0, p1), p0 * p1, stacked]
    for (kind, scatter), out, want in zip(kinds, outs, expected + [None, None]):
        for gpu in (0, 1):
            if want is None:
                want = (p0 + p1).chunk(2)[gpu] if kind == "sum" else stacked[:, gpu]
            assert torch.equal(monarch.inspect(out, host=0, gpu=gpu), want), (kind, scatter, gpu)
        with pytest.raises(monarch.RemoteError, match=r"(?s)failed on rank 3 .*index out of range"):
            monarch.inspect(out, host=1, gpu=0)  # its own input was fine
        with pytest.raises(monarch.RemoteError, match="index"):
            monarch.inspect(out, host=1, gpu=1)
    assert monarch.inspect(fine, host=1, gpu=0).tolist() == [2.0, 2.0]


def test_reduce_rejects_avg_of_integers_and_an_all_to_all_of_the_wrong_length(mesh):
    with mesh.activate():
        ints = torch.ones(4, dtype=torch.long)
        with pytest.raises(ValueError, match="'avg' needs a floating-point tensor, got torch.int64"):
            ints.reduce("gpu", "avg")
        with pytest.raises(ValueError, match=r"needs a leading dimension of 2 .* got shape \(4,\)"):
            ints.reduce("gpu", "stack", scatter=True)
        ok = ints.reshape(2, 2).reduce("gpu", "stack", scatter=True)
    assert monarch.inspect(ok).tolist() == [[1, 1], [1, 1]]


def _line(text: str) -> str:
    """The source line the error names as the op's origin."""
    import linecache

    where = text.split("the failing op was issued at ", 1)[1].split("\n", 1)[0]
    path, rest = where.rsplit(":", 1)
    return linecache.getline(path, int(rest.split(" ", 1)[0]))


def test_cross_mesh_use_is_a_type_error(mesh):
    from monarch.actor import this_host

    other = this_host().spawn_procs({"gpu": 2})
    try:
        with mesh.activate():
            t = torch.ones(2)
        with other.activate():
            with pytest.raises(TypeError, match=r"a tensor on mesh \{host: 2, gpu: 2\} used inside \{gpu: 2\}"):
                t + 1
        with mesh.slice(host=0).activate():  # another view of the same workers, but not all of them
            with pytest.raises(TypeError, match="used only on the mesh that made it"):
                t * 3
            with pytest.raises(TypeError, match="reduce: a tensor on mesh .* used only on the mesh that made it"):
                t.reduce("gpu")  # a collective too
        stages = [mesh.slice(host=h) for h in range(2)]
        with stages[0].activate():
            s0 = torch.ones(2)
        with stages[1].activate():  # the two slices have one shape: their ranks tell them apart
            with pytest.raises(TypeError, match=r"mesh \{gpu: 2\} \(ranks 0-1\) used inside \{gpu: 2\} \(ranks 2-3\)"):
                s0 + 1
            assert monarch.inspect(s0.to_mesh(stages[1]) + 1).tolist() == [2.0, 2.0]  # moving it is the way
        # outside activate(), ops on a handle still run on its own mesh (autograd's backward may run there)
        assert torch.equal(monarch.inspect(t + 1), torch.full((2,), 2.0))
    finally:
        other.exit()


def test_freed_handles_are_deleted_on_workers(mesh):
    size = RemoteFunction.by_name("monarch.runtime.worker.engine.table", "table_size", mesh)
    with mesh.activate():
        w = torch.zeros(16)
    monarch.inspect(w)
    before = max(size().values())
    for _ in range(1000):
        with mesh.activate():
            w = (w + torch.ones(16)) * 0.5
    assert monarch.inspect(w).shape == (16,)
    after = max(size().values())
    assert after - before < 10, (before, after)


def test_inspect_inside_activate_gives_a_local_tensor_and_the_first_worker_is_reused(mesh):
    """Inside `mesh.activate()` (the capture's dispatch mode on), `inspect` still returns a local tensor, and
    torch code goes on being captured after it; the fetch bound to the first worker is made once per view."""
    with mesh.activate():
        x = torch.arange(4.0) * 2
        local = monarch.inspect(x)
        y = x + 1  # captured still
        assert type(local) is torch.Tensor and local.tolist() == [0.0, 2.0, 4.0, 6.0]
        assert type(y) is not torch.Tensor
    assert monarch.inspect(y).tolist() == [1.0, 3.0, 5.0, 7.0]
    first = mesh._derived["fetch"]
    monarch.inspect(y)
    assert mesh._derived["fetch"] is first and len(first._mesh._shape) == 1
    assert monarch.inspect(y, host=1, gpu=1).tolist() == [1.0, 3.0, 5.0, 7.0]  # (coords: sliced each time)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the workers have CUDA here")
def test_cuda_request_on_a_cpu_mesh_warns_once(mesh, monkeypatch):
    """Every way a tutorial asks for "cuda" makes the tensor on the CPU of a mesh without CUDA, with one
    warning per process."""
    from monarch.runtime.tensor import patches

    monkeypatch.setattr(patches, "_warned_cuda", False)
    with pytest.warns(UserWarning, match="no CUDA") as record:
        torch.set_default_device("cuda")  # the seed tutorial's first cell
        try:
            with mesh.activate():
                a = torch.rand(2)
                b = torch.zeros(2, device="cuda") + torch.ones(2, device=torch.device("cuda", 0))
                c = torch.ones(2).to("cuda") * torch.ones(2).cuda()
                lin = nn.Linear(2, 2).to("cuda")
                d = lin(torch.ones(1, 2).to(torch.device("cuda"), torch.float32))
        finally:
            torch.set_default_device(None)
    (warned,) = [w for w in record if "no CUDA" in str(w.message)]
    assert warned.filename == __file__  # the user's line, not ours
    assert monarch.inspect(a + b + c).device.type == "cpu"
    assert monarch.inspect(d).shape == (1, 2) and lin.weight.device.type == "cpu"
    assert torch.get_default_device().type == "cpu" and type(torch.rand(1)) is torch.Tensor


def test_to_mesh_pipelines_between_slices(mesh):
    stages = [mesh.rename(host="pp").slice(pp=i) for i in range(2)]
    with stages[0].activate():
        x = torch.rand(3, 4)
        y = x * 2
    moved = y.to_mesh(stages[1])
    assert moved.mesh is stages[1]
    with stages[1].activate():
        z = moved + 1
    for g in range(2):
        assert torch.allclose(monarch.inspect(z, gpu=g), monarch.inspect(x, gpu=g) * 2 + 1)
    with pytest.raises(ValueError, match="shapes differ"):
        y.to_mesh(mesh)


def test_to_mesh_between_spawned_meshes(mesh):
    """Two separately spawned meshes of one shape: values move worker to worker and back; a failed
    value arrives poisoned and both meshes keep serving."""
    from monarch.actor import this_host

    other = this_host().spawn_procs({"host": 2, "gpu": 2})
    try:
        with mesh.activate():
            x = torch.rand(3, 4) + torch.arange(3.0).reshape(3, 1)
            bad = torch.rand(2, 2**55)  # fails on the workers (more than any address space)
        moved = x.to_mesh(other)
        assert moved.mesh is other
        with other.activate():
            y = moved * 2
        back = y.to_mesh(mesh)
        with mesh.activate():
            z = back - x
        for c, _ in mesh._shape.points():
            assert torch.equal(monarch.inspect(y, **c), monarch.inspect(x, **c) * 2)
            assert torch.allclose(monarch.inspect(z, **c), monarch.inspect(x, **c))
        poisoned = bad.to_mesh(other)
        with pytest.raises(Exception, match="failed"):
            monarch.inspect(poisoned)
        with other.activate():
            fine = torch.ones(2) * 3
        assert monarch.inspect(fine).tolist() == [3.0, 3.0]
        with pytest.raises(ValueError, match="shapes differ"):
            x.to_mesh(other.slice(host=0))
        with pytest.raises(TypeError, match="used only on the mesh that made it"):
            with other.activate():
                x + 1
    finally:
        other.exit()


def test_move_to_a_mesh_that_dies_before_taking_it_does_not_stall_the_sender(mesh, capfd, tmp_path):
    """The receiving mesh is busy, then killed, before its workers reach the move: the sending
    workers give up on the link as soon as the controller marks that mesh gone, and keep serving."""
    from monarch.actor import this_host

    @monarch.remote
    def nap(marker, seconds):
        say_started(marker)
        time.sleep(seconds)

    from monarch.runtime.controller import get_controller

    store = get_controller().backend.store
    other = this_host().spawn_procs({"host": 2, "gpu": 2})
    pids = worker_pids(other)
    try:
        marker = str(tmp_path / "napping")
        busy = nap.on(other).call_async(marker, 30)  # the receivers will not reach the move for 30 s
        with mesh.activate():
            x = torch.ones(3)
        x.to_mesh(other)
        with mesh.activate():
            after = x + 1  # queued behind the send on every worker of `mesh`
        wait_for(lambda: started(marker, 4), what="the receivers' nap")
        link = f">{other.spawned.mesh_id}."  # (links are named "<mesh>.<rank>><mesh>.<rank>")
        waiting = lambda: sum(link in k and k.endswith("/here/0") for k in list(store.data))  # noqa: E731
        wait_for(lambda: waiting() == len(mesh), what="every sender waiting for its receiver")  # (its store key)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(Exception, match="rank 1"):
            busy.result(timeout=30)
        assert monarch.inspect(after).tolist() == [2.0, 2.0, 2.0]
        # the senders gave up because the controller marked the mesh gone (not after the group timeout: that
        # says otherwise); their report comes on its own, perhaps after `after`'s value
        err: list[str] = []
        gave_up = "the other mesh stopped or failed before it took its side of the move"
        wait_for(lambda: err.append(capfd.readouterr().err) or gave_up in "".join(err), 30, "the senders' report")
        assert wait_gone(pids) == []
    finally:
        other.exit()


def test_to_mesh_on_a_side_stream_between_views_that_leave_workers_out(mesh):
    """On a stream other than main, a move uses two-worker groups of that stream's own: only the two
    workers of each pair take part (a copy of the whole group would wait for the rest)."""
    side = monarch.Stream("moves")
    first, last = mesh.slice(host=0, gpu=0), mesh.slice(host=1, gpu=1)  # ranks 1 and 2 take no part
    with side.activate():
        with first.activate():
            x = torch.arange(3.0) * 5
        y = x.to_mesh(last)
        with last.activate():
            z = y + 1
        assert monarch.inspect(z).tolist() == [1.0, 6.0, 11.0]
        assert monarch.inspect(z.to_mesh(first)).tolist() == [1.0, 6.0, 11.0]


def test_moves_on_two_side_streams_at_once_between_overlapping_views():
    """Each stream thread makes its two-worker groups through a store connection of its own: with one
    shared connection, two streams making theirs at once deadlocked."""
    from monarch.actor import this_host

    three = this_host().spawn_procs({"pp": 3})
    lo, hi = three.slice(pp=range(0, 2)), three.slice(pp=range(1, 3))  # ranks (0, 1) and (1, 2)
    s1, s2 = monarch.Stream("s1"), monarch.Stream("s2")
    try:
        results = []
        for rnd in range(3):
            with lo.activate(), s1.activate():
                a = (torch.arange(2.0) + 100 + 10 * rnd).reduce("pp", "stack", scatter=True)  # pp=i holds [..+i]*2
                up = a.to_mesh(hi)
            with hi.activate(), s2.activate():
                b = (torch.arange(2.0) + 200 + 10 * rnd).reduce("pp", "stack", scatter=True)
                down = b.to_mesh(lo)
            results.append((rnd, up, down))
        for rnd, up, down in results:
            for name, t, base in (("s1", up, 100), ("s2", down, 200)):
                with (s1 if name == "s1" else s2).activate():
                    got = [monarch.inspect(t, pp=i).tolist() for i in range(2)]
                assert got == [[base + 10 * rnd] * 2, [base + 10 * rnd + 1] * 2], (name, rnd, got)
    finally:
        three.exit()


def test_collectives_on_two_streams_over_one_group_do_not_mix(mesh):
    """Each stream runs on its own worker thread; reductions of two streams over the same dimension
    must still pair up with their own kind on every rank."""
    side = monarch.Stream("comms")
    pairs = []
    with mesh.activate():
        for _ in range(30):
            with side.activate():
                a = torch.ones(5000)
                ra = a.reduce("gpu", "sum")
            b = torch.ones(5000) * 100
            rb = b.reduce("gpu", "sum")
            pairs.append((ra, rb))
    for ra, rb in pairs:
        assert torch.all(monarch.inspect(ra) == 2) and torch.all(monarch.inspect(rb) == 200)


def test_ddp_with_grad_generator_trains(mesh):
    dp = mesh.flatten("dp")
    with dp.activate():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.reduce("dp", "avg"))  # the same initial weights on every replica
        losses = []
        for _ in range(25):
            x = torch.rand(32, 8)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            rparams = list(reversed(list(model.parameters())))
            with torch.no_grad():
                for p, g in zip(rparams, monarch.grad_generator(loss, rparams)):
                    g.reduce_("dp", "avg")
                    p -= 0.05 * g
            losses.append(loss.reduce("dp", "avg"))
    first, last = monarch.inspect(losses[0]).item(), monarch.inspect(losses[-1]).item()
    assert last < first / 5, (first, last)
    w = [monarch.inspect(model[0].weight, dp=i) for i in range(4)]
    assert all(torch.allclose(w[0], wi) for wi in w[1:])  # averaged gradients keep replicas identical


def test_streams_ddp_with_borrows(mesh):
    dp = mesh.flatten("dp")
    main, comms = monarch.get_active_stream(), monarch.Stream("comms")
    assert main.name == "main"
    with dp.activate():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.reduce("dp", "avg"))
        x = torch.rand(8, 4)
        loss = model(x).pow(2).mean()
        rparams = list(reversed(list(model.parameters())))
        reduced = []
        with torch.no_grad():
            it = iter(
                (p, g, *comms.borrow(g, mutable=True)) for p, g in zip(rparams, monarch.grad_generator(loss, rparams))
            )
            todo = next(it, None)
            while todo is not None:
                param, grad, comm_grad, borrow = todo
                with comms.activate():
                    comm_grad.reduce_("dp", "sum")
                todo = next(it, None)
                borrow.drop()
                reduced.append(grad * 1)  # after drop, main sees the reduced gradient
        local = [monarch.inspect(g, dp=0) for g in reduced]
    # each reduced gradient is the sum over replicas of the per-replica gradient
    for i, p in enumerate(rparams):
        with dp.activate():
            (g,) = torch.autograd.grad(model(x).pow(2).mean(), [p])
        per_rank = [monarch.inspect(g, dp=r) for r in range(4)]
        assert torch.allclose(local[i], sum(per_rank), atol=1e-5)


def test_borrow_misuse_is_explained(mesh):
    comms = monarch.Stream("comms2")
    with mesh.activate():
        t = torch.ones(3)
        with pytest.raises(TypeError, match="of stream 'main' used on stream 'comms2'.*comms2.borrow"):
            with comms.activate():
                t + 1
        t_comms, borrow = comms.borrow(t, mutable=True)
        with pytest.raises(TypeError, match=r"mutably borrowed by stream 'comms2' at .*test_tensor.py:\d+"):
            t * 2
        with comms.activate():
            t_comms.mul_(5)
        borrow.drop()
        with pytest.raises(TypeError, match="used after its borrow was dropped"):
            with comms.activate():
                t_comms + 1
        seen, b2 = comms.borrow(t)  # immutable: the origin may read but not write
        u = t + 1
        with pytest.raises(TypeError, match="immutably borrowed .* may not be changed"):
            t.add_(1)
        with comms.activate():
            v = seen * 2
        b2.drop()
    assert torch.equal(monarch.inspect(u), torch.full((3,), 6.0))
    with comms.activate():
        assert torch.equal(monarch.inspect(v), torch.full((3,), 10.0))
    with pytest.raises(TypeError, match="inspect: a borrowed tensor used after its borrow was dropped"):
        monarch.inspect(seen)


def test_borrow_rules_cover_views_out_arguments_and_the_borrowing_stream(mesh):
    """A view shares its tensor's memory, and so its borrows; `out=` writes; an immutable borrow is
    read-only on the borrowing stream too."""
    comms = monarch.Stream("comms3")
    with mesh.activate():
        t = torch.ones(4)
        early_view = t[:2]  # made before the borrow
        t_comms, b = comms.borrow(t, mutable=True)
        with pytest.raises(TypeError, match="mutably borrowed by stream 'comms3'"):
            early_view.add_(100)
        with comms.activate():
            t_comms[2:].mul_(3)  # the borrower may write through a view of its borrow
        b.drop()
        with pytest.raises(TypeError, match="used after its borrow was dropped"):
            with comms.activate():
                t_comms[:1] + 1  # nor may a view of a dropped borrow be used
        view_comms, b_view = comms.borrow(t[1:], mutable=True)  # borrowing a view lends the memory it shares
        with pytest.raises(TypeError, match="mutably borrowed"):
            t + 1
        b_view.drop()
        seen, b2 = comms.borrow(t)
        with pytest.raises(TypeError, match="immutably borrowed .* may not be changed"):
            torch.add(t, 1, out=t)
        with pytest.raises(TypeError, match="immutably borrowed .* may not be changed"):
            torch._foreach_add_([t], 1)  # a list-taking in-place op writes each of its tensors
        with comms.activate():
            with pytest.raises(TypeError, match="immutably borrowed .* may not be changed there"):
                seen.add_(1)
            with pytest.raises(TypeError, match="immutably borrowed .* may not be changed there"):
                seen[:1].zero_()
        b2.drop()
    assert monarch.inspect(t).tolist() == [1.0, 1.0, 3.0, 3.0]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_ops_of_the_backward_pass_of_grad_generator_name_the_line_that_asked_for_it(mesh, monkeypatch):
    """The backward pass runs on a thread of its own: its ops are attributed to the user's line."""
    from monarch.runtime.tensor.engine import engine_for

    engine = engine_for(mesh.spawned)
    with mesh.activate():
        lin = nn.Linear(2, 2)
        loss = lin(torch.ones(1, 2)).sum()
        engine.flush()
        sent, send = [], engine._send
        monkeypatch.setattr(engine, "_send", lambda ranks: (sent.extend(engine.batches.get(ranks, [])), send(ranks)))
        grads = list(monarch.grad_generator(loss, [lin.bias, lin.weight]))
        line = inspect.currentframe().f_lineno - 1
        engine.flush()
    from monarch.runtime.wire import protocol

    cmds = [protocol.unpack(cmd) if type(cmd) is tuple else cmd for cmd in sent]  # (ops are queued packed)
    wheres = {cmd.where for cmd in cmds if type(cmd) is protocol.Op}
    assert wheres == {
        f"{__file__}:{line} in {test_ops_of_the_backward_pass_of_grad_generator_name_the_line_that_asked_for_it.__name__} (the backward pass of grad_generator)"
    }
    assert monarch.inspect(grads[0]).tolist() == [1.0, 1.0]


def test_a_deleted_handle_is_freed_on_the_workers_without_another_command(mesh):
    """`del big` in an idle notebook frees the workers' memory soon, not at the next command."""
    import gc

    pids = worker_pids(mesh)
    with mesh.activate():
        big = torch.ones(32 * 1024 * 1024)  # 128 MiB on each worker
    _all(big[:1], mesh)  # made on every worker
    before = [_rss_kib(p) for p in pids]
    del big
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_rss_kib(p) < b - 100_000 for p, b in zip(pids, before)):
        time.sleep(0.05)
    assert all(_rss_kib(p) < b - 100_000 for p, b in zip(pids, before)), (before, [_rss_kib(p) for p in pids])


@pytest.mark.timeout(120)
def test_worker_memory_is_flat_over_a_1000_step_training_loop(mesh):
    dp = mesh.flatten("dp")
    pids = [row["pid"] for row in mesh.to_table().rows]
    with dp.activate():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt_params = list(model.parameters())

    def steps(n):
        for _ in range(n):
            with dp.activate():
                x = torch.rand(16, 64)
                loss = model(x).pow(2).mean()
                grads = torch.autograd.grad(loss, opt_params)
                with torch.no_grad():
                    for p, g in zip(opt_params, grads):
                        p -= 0.01 * g
                    loss = loss.reduce("dp", "avg")
        return monarch.inspect(loss)

    steps(200)  # warm up: allocator pools, caches
    before = [_rss_kib(p) for p in pids]
    steps(1000)
    after = [_rss_kib(p) for p in pids]
    growth = max(a - b for a, b in zip(after, before))
    assert growth < 8 * 1024, f"worker RSS grew by {growth} KiB over 1,000 steps"


def test_values_inside_activate_and_nested_activate(mesh):
    import multiprocessing  # noqa: F401  (imported before torch in notebooks: memory formats must still travel)

    with mesh.activate():
        t = torch.ones(3) * 2
        c = t.clone(memory_format=torch.preserve_format)
        assert monarch.inspect(t.sum()).item() == 6.0  # a fetched value is local: .item() runs here
        with pytest.raises(TypeError, match="depends on the tensor's values.*monarch.inspect"):
            t.sum().item()
        with mesh.activate():  # nested activation of the same mesh
            u = t * 3
    assert torch.equal(monarch.inspect(c), torch.full((3,), 2.0))
    assert torch.equal(monarch.inspect(u), torch.full((3,), 6.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_and_nccl_reduce():
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    gpus = this_host().spawn_procs({"gpu": n})
    try:
        with gpus.activate():
            t = torch.ones(1024, device="cuda") * 2
            r = t.reduce("gpu", "sum")
        assert torch.equal(monarch.inspect(r, gpu=n - 1), torch.full((1024,), 2.0 * n))
    finally:
        gpus.exit()


def test_use_after_exit_is_a_type_error():
    from monarch.actor import this_host

    short = this_host().spawn_procs({"gpu": 2})
    with short.activate():
        t = torch.ones(2)
    short.exit()
    with pytest.raises(TypeError, match=r"mesh \{gpu: 2\} is stopped, and its tensors went with its workers"):
        t + 1
    with pytest.raises(TypeError, match="is stopped"):
        monarch.inspect(t)
    with pytest.raises(TypeError, match="is stopped"):
        t.reduce("gpu")


def test_reduce_on_a_split_view_and_fetch_shard(mesh):
    split = mesh.split(host=("dp", "pp"), gpu=("tp",), pp=2)  # dp=1, pp=2, tp=2
    with split.activate():
        t = torch.rand(2)
        r = t.reduce(("pp", "tp"), "max")
    values = [monarch.inspect(t, dp=0, pp=p, tp=q) for p in range(2) for q in range(2)]
    fut = monarch.fetch_shard(r, dp=0, pp=1, tp=0)
    assert torch.equal(fut.result(timeout=30), torch.stack(values).amax(0))  # a future of a local tensor
    assert fut.done() and torch.equal(asyncio.run(_awaited(monarch.fetch_shard(r))), fut.result())


async def _awaited(fut):
    return await fut


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streams_and_borrows():
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    gpus = this_host().spawn_procs({"gpu": n})
    comms = monarch.Stream("comms")
    try:
        with gpus.activate():
            g = torch.ones(1 << 20, device="cuda")
            for _ in range(20):  # queue enough work on the main stream that a race would show
                g = g * 1.0 + 0.0
            borrowed, borrow = comms.borrow(g, mutable=True)
            with comms.activate():
                borrowed.reduce_("gpu", "sum")
                borrowed.mul_(2)
            borrow.drop()
            h = g + 1
        assert torch.equal(monarch.inspect(h), torch.full((1 << 20,), 2.0 * n + 1))
    finally:
        gpus.exit()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_collectives_streams_failures_and_moves():
    """On GPU workers: every reduction over NCCL, CPU tensors over gloo beside them, two streams over one
    group (each its own NCCL copy), a failed input on one rank, and moves within and between meshes."""
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    gpus = this_host().spawn_procs({"gpu": n})
    other = this_host().spawn_procs({"gpu": n})
    side = monarch.Stream("side")
    try:
        with gpus.activate():
            me = torch.arange(n, device="cuda").reduce("gpu", "stack", scatter=True)[:1].float()  # rank index
            x = (me + 1).repeat(n)  # rank r holds [r+1] * n
            results = {k: x.reduce("gpu", k) for k in ("sum", "avg", "max", "min", "product")}
            stacked, scattered = x.reduce("gpu", "stack"), x.reduce("gpu", "sum", scatter=True)
            cpu_sum = torch.ones(3, device="cpu").reduce("gpu")  # gloo, beside NCCL
            pairs = []
            for _ in range(10):
                with side.activate():
                    ra = torch.ones(4096, device="cuda").reduce("gpu")
                pairs.append((ra, (torch.ones(4096, device="cuda") * 100).reduce("gpu")))
            picked = torch.index_select(torch.arange(float(max(n - 1, 1)), device="cuda"), 0, me.long())
            poisoned = picked.reduce("gpu")  # fails on the last rank (when n > 1)
            within = x.to_mesh(gpus)
        moved = x.to_mesh(other)
        ranks = torch.arange(1.0, n + 1)
        assert monarch.inspect(results["sum"]).tolist() == [ranks.sum().item()] * n
        assert monarch.inspect(results["avg"]).tolist() == [ranks.mean().item()] * n
        assert monarch.inspect(results["max"]).tolist() == [float(n)] * n
        assert monarch.inspect(results["product"]).tolist() == [ranks.prod().item()] * n
        assert torch.equal(monarch.inspect(stacked, gpu=n - 1), ranks.unsqueeze(1).repeat(1, n))
        assert monarch.inspect(scattered, gpu=n - 1).tolist() == [ranks.sum().item()]
        assert monarch.inspect(cpu_sum).tolist() == [float(n)] * 3
        for ra, rb in pairs:
            assert torch.all(monarch.inspect(ra) == n) and torch.all(monarch.inspect(rb) == 100 * n)
        if n > 1:
            with pytest.raises(monarch.RemoteError, match=f"failed on rank {n - 1}"):
                monarch.inspect(poisoned, gpu=0)
        assert torch.equal(monarch.inspect(within, gpu=n - 1), monarch.inspect(x, gpu=n - 1))
        assert torch.equal(monarch.inspect(moved, gpu=n - 1), torch.full((n,), float(n)))
    finally:
        gpus.exit()
        other.exit()


def test_manual_seed_inside_activate_seeds_the_workers():
    from monarch.actor import this_host

    seeded = this_host().spawn_procs({"gpu": 2})  # its own mesh: afterwards its ranks draw the same numbers
    try:
        with seeded.activate():
            torch.manual_seed(1234)
            x = torch.rand(5)
        torch.manual_seed(1234)
        expected = torch.rand(5)
        for value in _all(x, seeded):
            assert torch.equal(value, expected)
        assert torch.manual_seed.__name__ == "manual_seed" and type(torch.rand(2)) is torch.Tensor
    finally:
        seeded.exit()


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_output_of_stream_ops_done_before_a_live_call_is_not_part_of_it(capfd):
    """A warning printed (from C++, straight to the file descriptor) by an op on a side stream that ran
    before a live call belongs to no call. (Output printed by a stream while a call runs cannot be told
    apart from the call's own: a known limitation.)"""
    from monarch.actor import this_host

    @monarch.remote
    def nap(seconds):
        time.sleep(seconds)

    fresh = this_host().spawn_procs({"gpu": 2})
    side = monarch.Stream("side")
    try:
        with fresh.activate(), side.activate():
            out = torch.zeros(3)
            torch.add(torch.ones(2), torch.ones(2), out=out)  # torch warns: "An output ... was resized"
        with side.activate():  # each rank's side stream has run it (inspect waits for one rank's streams)
            assert [monarch.inspect(out, gpu=g).tolist() for g in (0, 1)] == [[2.0, 2.0]] * 2
        got = []
        nap.on(fresh).start((0.1,), {}, output=got.append).result()
        assert [e.text for e in got if "resized" in e.text] == []
        assert capfd.readouterr().err.count("was resized") == 2  # once per worker, as output of no call
    finally:
        fresh.exit()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0.1),
        lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    ],
    ids=["sgd", "adam", "adamw-foreach"],
)
def test_an_optimizer_steps_handles_as_it_steps_local_tensors(mesh, make_opt):
    """optimizer.step() inside activate() matches local torch: its profiler markers stay on the
    controller, and Adam's step counter (`.item()` each step) is a value the controller knows."""
    w0, x = torch.arange(6.0).reshape(2, 3) / 10, torch.arange(12.0).reshape(4, 3) / 10

    def train(model):
        with torch.no_grad():
            model.weight.copy_(w0)
            model.bias.zero_()
        opt = make_opt(model.parameters())
        for _ in range(3):
            opt.zero_grad()
            ((model(x) - 1) ** 2).mean().backward()
            opt.step()
        return model.weight

    local = train(nn.Linear(3, 2))
    with mesh.activate():
        remote = train(nn.Linear(3, 2))
    for value in _all(remote, mesh):
        assert torch.allclose(value, local.detach(), atol=1e-6)


def test_the_controller_answers_item_of_a_value_it_knows_and_explains_one_it_does_not(mesh):
    with mesh.activate():
        step = torch.tensor(0.0)
        for _ in range(3):
            step += 1
        assert step.item() == 3.0 and bool(step > 2)  # no round trip: every worker holds the same
        drawn = torch.rand(())  # differs per worker: only they know it
        with pytest.raises(TypeError, match="the result depends on the tensor's values.*monarch.inspect"):
            drawn.item()
        step.add_(drawn)  # written with a value the controller does not know: forgotten
        with pytest.raises(TypeError, match="the result depends on the tensor's values"):
            step.item()
    assert 3.0 <= monarch.inspect(step).item() < 4.0


def test_a_local_tensor_is_sent_as_it_was_when_the_op_was_issued(mesh):
    """The batch goes later; a local tensor changed meanwhile (here by another thread, which runs torch
    locally) must not change what the op computes."""
    import threading

    buf = torch.zeros(2)
    with mesh.activate():
        y = torch.ones(2) + buf
        filler = threading.Thread(target=lambda: buf.add_(5))
        filler.start()
        filler.join()
    assert buf.tolist() == [5.0, 5.0] and monarch.inspect(y).tolist() == [1.0, 1.0]


def test_a_known_value_is_forgotten_when_any_alias_of_its_tensor_is_written(mesh):
    """The controller answers `.item()` only while it is sure: views have no value of their own, and a
    write through any alias (or by a list-taking foreach op) with values it does not know forgets it."""

    def answer(t):
        with mesh.activate():
            try:
                return t.item()
            except TypeError:
                return None

    cases = []
    with mesh.activate():
        x = torch.zeros(())
        x.detach().add_(torch.rand(()))  # through a view
        cases.append(x)
        y = torch.zeros(1)
        (part,) = y.unbind()
        y.fill_(3.0)  # the root, known: the view still has no value of its own
        cases.append(part)
        z = torch.zeros(())
        torch._foreach_add_([z], [torch.rand(())])
        cases.append(z)
        w = torch.ones(())
        same = w.mul_(2)  # in place, with known inputs: both names are one tensor, still known
        w.mul_(3)
        big = torch.zeros(())
        src = torch.ones(())
        big.set_(src)  # big is now src's memory (its schema does not say so)
        big.add_(1)
        cases.append(src)
        bn = nn.BatchNorm1d(1)
        bn(torch.rand(4, 1))  # writes its running stats, which its schema does not say either
        cases.append(bn.running_mean)
    assert [answer(t) for t in cases] == [None] * 5
    assert answer(same) == answer(w) == 6.0
    for t in cases + [same]:
        assert answer(t) in (None, monarch.inspect(t).item())


def test_an_in_place_op_with_a_failed_input_poisons_the_tensor_it_writes(mesh):
    with mesh.activate():
        bad = torch.index_select(torch.arange(3.0), 0, torch.tensor([100]))  # fails on the workers
        t = torch.ones(1)
        t.add_(bad)
        fine = torch.ones(1) + 1
    with pytest.raises(monarch.RemoteError, match="index out of range"):
        monarch.inspect(t)
    assert monarch.inspect(fine).tolist() == [2.0]
    with mesh.activate():  # a foreach op (a foreach optimizer's step) poisons only the positions that failed
        g1, g2 = torch.ones(1), torch.ones(1)
        torch._foreach_add_([g1, g2], [torch.ones(1), bad])
        sums = torch._foreach_add([g1, g2], 1)
    assert monarch.inspect(g1).tolist() == [2.0] and monarch.inspect(sums[0]).tolist() == [3.0]
    for poisoned in (g2, sums[1]):
        with pytest.raises(monarch.RemoteError, match="index out of range"):
            monarch.inspect(poisoned)


def test_a_live_call_is_not_held_back_by_a_collective_queued_on_a_stream(tmp_path):
    """Rank 1's live call waits for rank 0's; a stream collective queued between them must not make
    rank 0 wait for rank 1 (which cannot queue it until its call returns)."""
    from monarch.actor import this_host

    @monarch.remote
    def recv_from_rank0(marker):
        import torch.distributed as dist

        t = torch.zeros(1)
        say_started(marker)
        dist.recv(t, src=0)
        return t.item()

    @monarch.remote
    def send_to_rank1():
        import torch.distributed as dist

        dist.send(torch.ones(1) * 42, dst=1)

    pair = this_host().spawn_procs({"host": 2})
    pids = worker_pids(pair)
    try:
        marker = str(tmp_path / "receiving")
        waiting = recv_from_rank0.on(pair.slice(host=1)).call_async(marker)
        wait_for(lambda: started(marker, 1), what="rank 1's receive")
        comms = monarch.Stream("comms")
        with pair.activate(), comms.activate():
            r = torch.ones(1).reduce("host", "sum")
        send_to_rank1.on(pair.slice(host=0)).call_async().result(timeout=30)
        assert waiting.result(timeout=30).values() == [42.0]
        with comms.activate():
            assert monarch.inspect(r).tolist() == [2.0]
    finally:
        pair.exit()
    assert wait_gone(pids) == []


def test_the_default_dtype_set_on_the_controller_holds_on_the_workers(mesh):
    torch.set_default_dtype(torch.float64)
    try:
        with mesh.activate():
            x = torch.zeros(3) + 0.1
            r = torch.arange(3.0) / 3
        assert x.dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    assert monarch.inspect(x).dtype == torch.float64 and monarch.inspect(x).tolist() == [0.1] * 3
    assert torch.equal(monarch.inspect(r), torch.arange(3.0, dtype=torch.float64) / 3)


def test_assigning_data_rebinds_the_tensor_on_the_workers_too(mesh):
    local = torch.ones(3)
    with mesh.activate():
        x = torch.zeros(2)
        x.data = torch.ones(3) * 4
        y = x + 1
        with pytest.raises(TypeError, match="needs a monarch.Tensor of the same mesh"):
            x.data = local
    assert tuple(x.shape) == (3,) and monarch.inspect(y).tolist() == [5.0, 5.0, 5.0]


def test_an_op_whose_argument_cannot_be_sent_fails_alone(mesh):
    """A command that cannot be pickled poisons its own result; the rest of its batch still runs."""
    import threading

    from monarch.runtime.tensor.engine import engine_for
    from monarch.runtime.wire import protocol

    with mesh.activate():
        before = torch.ones(2) * 7
    engine = engine_for(mesh.spawned)
    bad = monarch.Tensor(torch.empty(2), next(engine.ids), mesh)  # the handle of the crafted op's result
    engine.push(
        mesh._shape.ranks,
        protocol.Op("aten::add.Tensor", (protocol.Ref(before._ref), threading.Lock()), {}, bad._ref, "here:1"),
    )
    with mesh.activate():
        after = before + 1
    with pytest.raises(monarch.RemoteError, match="an argument of aten::add.Tensor cannot be sent to the workers"):
        monarch.inspect(bad)
    assert monarch.inspect(before).tolist() == [7.0, 7.0] and monarch.inspect(after).tolist() == [8.0, 8.0]


OPERATORS = ["x + 1", "1 + x", "x - 2.5", "2 - x", "x * y", "x / 4", "3 / x", "x ** 2", "2 ** x", "x // 2",
             "x % 2", "x == 2", "x < y", "x + True", "x @ y"]  # fmt: skip


def _counting_dispatch(monkeypatch) -> list:
    """Count the ops that reach the capture mode through torch's dispatch."""
    from monarch.runtime.tensor import capture

    calls: list = []
    real = capture._Capture.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(capture._Capture, "__torch_dispatch__", counted)
    return calls


def test_operators_learned_from_torch_skip_its_dispatch_and_give_what_it_gives(mesh, monkeypatch):
    """An operator on a handle goes through torch's dispatch the first time for operands like these, which
    says which op it is; later ones go straight to the op. Both give torch's results on the workers."""
    from monarch.runtime.tensor import handles

    calls = _counting_dispatch(monkeypatch)
    local = {"x": torch.arange(1.0, 5.0), "y": torch.full((4,), 3.0)}
    with mesh.activate():
        handles_ = {"x": torch.arange(1.0, 5.0), "y": torch.full((4,), 3.0)}
        results = []
        for _ in range(2):
            calls.clear()
            results.append([eval(e, {}, handles_) for e in OPERATORS])
    learned = {key[0] for key in handles._OPERATORS}
    assert {"__add__", "__radd__", "__rsub__", "__rpow__", "__matmul__", "__eq__"} <= learned
    assert "__rtruediv__" not in learned  # `3 / x` is two ops: x.reciprocal() * 3, the second an operator itself
    assert [str(f) for f in calls] == ["aten.reciprocal.default"]  # all torch dispatched in the second round
    for e, first, second in zip(OPERATORS, *results):
        want = eval(e, {}, local)
        assert torch.equal(monarch.inspect(first), want) and torch.equal(monarch.inspect(second), want), e


def test_the_operators_fast_path_steps_aside_for_autograd_modes_and_autocast(mesh, monkeypatch):
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = _counting_dispatch(monkeypatch)
    with mesh.activate():
        x = torch.ones(4)
        w = torch.ones(4, requires_grad=True)
        for _ in range(2):
            x * 2, w * 2  # learned, if not yet
        calls.clear()
        assert (w * 2).grad_fn is not None and calls  # autograd records it: torch dispatches it
        calls.clear()
        seen = Seen()
        with seen:
            x * 2
        assert seen.funcs and calls  # another function mode sees it
        calls.clear()
        with Through():
            x * 2
        assert calls
        calls.clear()
        with torch.autocast("cpu"):
            x * 2
        assert calls
        calls.clear()
        x * 2
        assert calls == []  # and with none of them, the learned op
    assert torch.equal(monarch.inspect(x * 2), torch.full((4,), 2.0))


def test_operators_learned_on_two_threads_at_once_keep_nothing(mesh, monkeypatch):
    """Thread A learns an operator; inside it thread B starts learning another and is still at it when A is
    done. Each thread records its own ops: afterwards nothing records, and dropped handles are freed."""
    import threading
    import weakref

    from monarch.runtime.tensor import capture, handles

    real = capture.run
    b_inside, a_done = threading.Event(), threading.Event()
    state: dict = {}

    def run(mesh_, func, args, kwargs):
        if threading.current_thread() is b_thread:
            b_inside.set()
            assert a_done.wait(30)
        elif not b_thread.is_alive() and "started" not in state:
            state["started"] = True
            b_thread.start()
            assert b_inside.wait(30)
        return real(mesh_, func, args, kwargs)

    def b_work():
        with mesh.activate():
            y = torch.ones(7, 3)
            state["b"] = weakref.ref(y)
            state["b_out"] = monarch.inspect(y * 5)

    b_thread = threading.Thread(target=b_work)
    with mesh.activate():
        x = torch.ones(5, 3)
    monkeypatch.setattr(capture, "run", run)
    with mesh.activate():
        out = x - 4  # (shapes no other test uses: both operators are learned here)
    a_done.set()
    b_thread.join(30)
    monkeypatch.setattr(capture, "run", real)
    assert handles._learning.seen is None
    assert ("__sub__", x._meta, int) in handles._OPERATORS and torch.equal(state["b_out"], torch.full((7, 3), 5.0))
    assert torch.equal(monarch.inspect(out), torch.full((5, 3), -3.0))
    held = weakref.ref(x)
    with mesh.activate():
        x + 1  # (a learned operator now)
    del x, out
    assert held() is None and state["b"]() is None
