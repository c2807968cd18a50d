"""monarch.Simulator: the tutorial's DDP variants, a 512-rank step, the cost model, memory, calibration, and
what a simulated mesh refuses (with words)."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import monarch

from helpers import perfetto_tp
from helpers.tutorial_ddp import Net, make_train

pytestmark = pytest.mark.timeout(180)


def simulate(variant: int, hosts: int = 1, gpus: int = 4, **kw) -> monarch.Simulator:
    comms = monarch.Stream("comms")
    simulator = monarch.Simulator(hosts=hosts, gpus=gpus, trace_mode="stream_only", **kw)
    mesh = simulator.mesh.rename(gpu="dp") if hosts == 1 else simulator.mesh.flatten("dp")  # DDP over every rank
    with mesh.activate():
        model = Net()
        make_train(variant, comms)(model, torch.rand(3, 4), torch.full((3,), 1, dtype=torch.int64))
    return simulator


def test_the_tutorials_ddp_variants_overlap_more_and_more(tmp_path):
    overlaps = {}
    for v in (1, 2, 3):
        sim = simulate(v)
        s = sim.summary()
        per_rank = s.overlap()
        assert set(per_rank) == {0, 1, 2, 3}
        overlaps[v] = sum(per_rank.values()) / 4
        path = sim.trace(tmp_path / f"variant{v}.json")
        trace = json.load(open(path))
        procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
        assert procs == {r: f"rank {r} (host=0,gpu={r})" for r in range(4)}
        threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        assert threads == ({"stream main"} if v == 1 else {"stream main", "stream comms"})
        reduces = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("all_reduce")]
        assert len(reduces) == 4 * 16  # 16 parameters' gradients, on each of 4 ranks
        assert s.commands > 200 and s.step_ms > 0
        sim.exit()
    print("overlap of communication with compute per variant:", {v: f"{100 * o:.1f}%" for v, o in overlaps.items()})
    assert overlaps[1] == 0.0  # one stream: nothing can overlap
    assert overlaps[2] < overlaps[3]  # dropping the borrow late lets the reduce run beside the next backward step
    assert overlaps[3] > 0.05


def test_a_64_host_by_8_gpu_ddp_step_is_simulated_in_seconds(tmp_path):
    started = time.perf_counter()
    sim = simulate(3, hosts=64, gpus=8)
    s = sim.summary()
    took = time.perf_counter() - started
    print(f"64 x 8 = 512 ranks: simulated in {took:.1f} s, {s.step_ms:.2f} ms simulated, {s.overlap_line()}")
    assert len(s.timeline.ranks) == 512
    assert len(s.peak_bytes) == 512 and len(set(s.peak_bytes)) == 1  # every rank holds the same
    trace = sim.trace_dict()
    assert len({e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}) == 512
    # the all-reduces cross hosts: slower than the same step on one host's 8 GPUs
    one_host = simulate(3, hosts=1, gpus=8)
    comm_512 = s.timeline.ranks[0].comm_ms
    comm_8 = one_host.summary().timeline.ranks[0].comm_ms
    assert comm_512 > comm_8
    sim.exit()
    one_host.exit()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"gpus": 0}, ["gpus must be a positive integer, got 0"]),
        ({"hosts": -2}, ["hosts must be a positive integer, got -2"]),
        ({"gpus": 2.5}, ["gpus must be a positive integer, got 2.5"]),
        ({"device": "tpu"}, ["unknown device 'tpu'", "a100, h100, h200, cpu", "'local'"]),
        ({"trace_mode": "everything"}, ["unknown trace_mode 'everything'", "'stream_only', 'full'"]),
        ({"device": "/nowhere/profile.json"}, ["/nowhere/profile.json does not exist"]),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_allowed(kwargs, words):
    with pytest.raises(ValueError) as e:
        monarch.Simulator(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_local_device_without_a_calibration_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_SIM_PROFILES", str(tmp_path))
    with pytest.raises(ValueError, match=r"run monarch.Simulator.calibrate\(\) first"):
        monarch.Simulator(device="local")


def test_inspect_gives_the_shape_and_dtype_and_says_the_values_were_not_computed(capfd):
    sim = monarch.Simulator(hosts=1, gpus=2)
    with sim.mesh.activate():
        a = torch.rand(3, 5)
        n = torch.arange(7)
    v = monarch.inspect(a, gpu=1)
    assert v.shape == (3, 5) and v.dtype == torch.float32 and torch.isnan(v).all()
    i = monarch.inspect(n)
    assert i.dtype == torch.int64 and i.shape == (7,) and (i == 0).all()
    err = capfd.readouterr().err
    assert err.count("values are not computed on a simulated mesh") == 1
    sim.exit()


def test_commands_sent_under_activate_run_once_and_issue_none_of_their_own():
    # A batch sent from user code under `mesh.activate()` (here by `inspect`; in a step by a full batch at a
    # reduce) runs in this process: the simulated workers' fake-tensor calls must not be captured as commands.
    sim = monarch.Simulator(hosts=1, gpus=2, trace_mode="full")
    with sim.mesh.activate():
        x = torch.randint(0, 5, (3,))
        y = torch.nn.functional.embedding(x, torch.rand(5, 4))
        v = monarch.inspect(y)
    assert type(v) is torch.Tensor and v.shape == (3, 4) and torch.isnan(v).all()
    ops = [e["name"] for e in sim.trace_dict()["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
    assert ops == ["aten::randint.low", "aten::rand", "aten::embedding"]
    sim.exit()


def test_live_functions_and_cells_on_a_simulated_mesh_fail_saying_why():
    sim = monarch.Simulator(hosts=1, gpus=2)

    @monarch.remote
    def f():
        return 1

    with pytest.raises(monarch.RemoteError, match="a live function cannot run on a simulated mesh"):
        f.on(sim.mesh)()
    from monarch.runtime.cells import run_cell

    with pytest.raises(monarch.RemoteError, match="a %%mesh cell cannot run on a simulated mesh"):
        run_cell(sim.mesh, "print(rank)", "<cell>").result()
    sim.exit()


def test_the_mesh_behaves_as_a_proc_mesh_pipelines_and_collectives_over_hosts():
    sim = monarch.Simulator(hosts=2, gpus=4, device="a100", trace_mode="full")
    mesh = sim.mesh
    table = mesh.to_table()
    rows = table.rows
    assert len(rows) == 8 and rows[5]["hostname"] == "sim-host1" and rows[5]["device"] == "cuda:1"
    three_d = mesh.split(host=("dp", "pp"), gpu=("tp",), pp=2)
    assert three_d.sizes == {"dp": 1, "pp": 2, "tp": 4}
    pipeline = mesh.rename(host="pp")
    stages = [pipeline.slice(pp=i) for i in range(2)]
    with stages[0].activate():
        x = torch.rand(64, 1024, device="cuda")
        w = torch.rand(1024, 1024, device="cuda")
        y = x @ w
    y1 = y.to_mesh(stages[1])
    with stages[1].activate():
        z = y1.relu()
    with mesh.activate():
        g = torch.rand(1 << 20, device="cuda")
        by_gpu = g.reduce("gpu", "sum")
        by_host = g.reduce("host", "sum")
    assert monarch.inspect(z, gpu=2).shape == (64, 1024)
    trace = sim.trace_dict()
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] < 8]
    assert any(e["name"] == "send/recv" for e in xs)
    mm = next(e for e in xs if e["name"] == "aten::mm")
    assert mm["args"]["flops"] == 2 * 64 * 1024 * 1024 and mm["cat"] == "kernel"
    reduces = [e for e in xs if e["name"].startswith("all_reduce") and e["pid"] == 0]
    intra, inter = reduces[-2]["dur"], reduces[-1]["dur"]  # over gpu (NVLink), then over host (the network)
    assert inter > intra
    assert any(e.get("ph") == "C" and e["name"] == "memory" for e in trace["traceEvents"])  # full mode
    assert any(e.get("pid") == 9 and e.get("cat") == "controller" for e in trace["traceEvents"])
    del by_gpu, by_host
    sim.exit()


def test_optimizers_and_autograd_run_unchanged_and_commands_have_no_limit():
    sim = monarch.Simulator(hosts=1, gpus=2)
    with sim.mesh.activate():
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(torch.rand(32, 64)), torch.randint(0, 10, (32,)))
            loss.backward()
            for p in model.parameters():
                p.grad.reduce_("gpu", "avg")
            opt.step()
            opt.zero_grad()
    assert monarch.inspect(loss).shape == ()
    names = {e["name"] for e in sim.trace_dict()["traceEvents"] if e.get("ph") == "X"}
    assert {"aten::addmm", "aten::mm", "all_reduce (avg)"} <= names
    sim.reset()
    with sim.mesh.activate():  # more commands than Meta's simulator records (10,000)
        x = torch.ones(10)
        for _ in range(11_000):
            x.add_(1)
    s = sim.summary()
    assert s.commands >= 11_000
    assert sum(1 for e in sim.trace_dict()["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1) >= 11_000
    sim.exit()


def test_memory_per_rank_counts_a_known_tensor_and_names_the_peak():
    sim = monarch.Simulator(hosts=1, gpus=2, device="cpu")
    with sim.mesh.activate():
        big = torch.zeros(1_000_003)
        view = big[10:20]  # views: no new memory
        halves = big.split(500_002)
        del view, halves
    s = sim.summary()
    assert s.peak_bytes == [4_000_012, 4_000_012]
    assert "test_simulator.py" in s.peak_where[0]
    assert "peak memory: 3.81 MiB on ranks 0-1" in s.memory_line()
    del big
    sim.reset()
    with sim.mesh.activate():
        small = torch.zeros(10)
    assert sim.summary().peak_bytes == [40, 40]  # the big one was freed before this window
    del small
    # a tensor the program dropped in a reference cycle (an autograd graph's) is freed before the window too,
    # not whenever Python's collector comes round to it, inside the window (where it would hide the peak)
    cycle: list = []
    with sim.mesh.activate():
        cycle += [torch.zeros(1000), cycle]
    base = sim._backend.workers.live.copy()
    del cycle
    gc.disable()
    try:
        sim.reset()
        gc.collect()  # (the collector, once the window has begun)
        with sim.mesh.activate():
            small = torch.zeros(10)
        summary = sim.summary()
        del small
    finally:
        gc.enable()
    assert list(sim._backend.workers.baseline) == list(base - 4000)
    assert [p - b for p, b in zip(summary.peak_bytes, sim._backend.workers.baseline)] == [40, 40]
    sim.exit()


def test_the_cost_model_follows_flops_bytes_and_dtype():
    from monarch.runtime.simulator import costs, devices

    h100 = devices.DEVICES["h100"]
    aten = torch.ops.aten
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a = torch.empty(4096, 4096, dtype=torch.bfloat16)
        out = aten.mm.default(a, a)
        t_bf16, flops, _ = costs.op_cost(h100, aten.mm.default, (a, a), {}, out)
        a32 = torch.empty(4096, 4096)
        t_f32, _, _ = costs.op_cost(h100, aten.mm.default, (a32, a32), {}, aten.mm.default(a32, a32))
        v = torch.empty(1 << 26)
        t_add, _, moved = costs.op_cost(h100, aten.add.Tensor, (v, v), {}, aten.add.Tensor(v, v))
    assert flops == 2 * 4096**3
    assert t_bf16 == pytest.approx(h100.op_overhead + flops / (989e12 * 0.7))
    assert t_f32 > 10 * t_bf16  # fp32 runs without tensor cores
    assert moved == 3 * 4 * (1 << 26) and t_add == pytest.approx(h100.op_overhead + moved / h100.mem_bw)
    # a ring all-reduce's bandwidth term, and the slower links across hosts
    n = 1 << 30
    t_in = costs.collective_time(h100, "all_reduce", n, 8, False)
    t_out = costs.collective_time(h100, "all_reduce", n, 8, True)
    assert t_in == pytest.approx(h100.op_overhead + min(14 * 6e-6 + 2 * 7 / 8 * n / 370e9, 6 * 6e-6 + 2 * n / 370e9))
    assert t_out > 5 * t_in
    # gloo (CPU workers) cuts a tensor into 2 segments per rank and skips empty ones: on 4 workers, a tensor
    # of fewer than 8 elements costs the one-element floor plus (e-1)/7 of the rest of the full ring
    cpu = dataclasses.replace(
        devices.DEVICES["cpu"], op_overhead=0.0, dispatch=1e-6, intra_latency=1e-3, intra_bw=1e15, reduce_floor=2e-3
    )
    full = 6e-3  # 2(p-1)·α
    for elements, want in ((1, 2e-3), (4, 2e-3 + 3 / 7 * 4e-3), (7, 2e-3 + 6 / 7 * 4e-3), (8, full), (100, full)):
        got = costs.collective_time(cpu, "all_reduce", 4 * elements, 4, False, elements)
        assert got == pytest.approx(want, rel=1e-6), elements
    assert costs.collective_time(h100, "all_reduce", 16, 8, False, 4) == costs.collective_time(
        h100, "all_reduce", 16, 8, False
    )  # (NCCL: no such effect modelled)
    sim = monarch.Simulator(hosts=1, gpus=4, device=cpu)
    with sim.mesh.activate():
        bias, weight = torch.ones(4), torch.ones(4, 4)
        bias.reduce_("gpu", "sum")
        weight.reduce_("gpu", "sum")
    sim.summary()
    took = [float(e.end[0] - e.start[0]) for e in sim._backend.workers.events if e.name.startswith("all_reduce")]
    sim.exit()
    assert took == [pytest.approx(2e-3 + 3 / 7 * 4e-3), pytest.approx(full)]


def test_calibrated_op_overheads_and_the_engines_cost_per_reduce_count():
    """`op_extra` adds an op's measured overhead beyond a tiny add (a view's is negative, never below zero in
    all); `reduce_overhead` is the engine's own work in every reduce, over one rank or a ring."""
    from monarch.runtime.simulator import costs, devices

    base = dataclasses.replace(devices.DEVICES["h100"], op_overhead=10e-6)
    dev = dataclasses.replace(base, op_extra={"aten::mm": 40e-6, "aten::t": -4e-6, "aten::view": -50e-6})
    aten = torch.ops.aten
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a = torch.empty(4, 4)
        mm, t, view = aten.mm.default(a, a), aten.t.default(a), aten.view.default(a, (16,))
        plain = costs.op_cost(base, aten.mm.default, (a, a), {}, mm)[0]
        assert costs.op_cost(dev, aten.mm.default, (a, a), {}, mm)[0] == pytest.approx(plain + 40e-6)
        assert costs.op_cost(dev, aten.t.default, (a,), {}, t)[0] == pytest.approx(6e-6)
        assert costs.op_cost(dev, aten.view.default, (a, (16,)), {}, view)[0] == 0.0
        assert (
            costs.op_cost(dev, aten.relu.default, (a,), {}, a)[0]
            == costs.op_cost(base, aten.relu.default, (a,), {}, a)[0]
        )
    fixed = dataclasses.replace(base, reduce_overhead=200e-6)
    for p in (1, 8):
        got = costs.collective_time(fixed, "all_reduce", 1 << 20, p, False)
        assert got == pytest.approx(costs.collective_time(base, "all_reduce", 1 << 20, p, False) + 200e-6)


def test_on_a_gpu_a_reduce_holds_the_thread_that_issued_it():
    """The engine reads a reduce's failure flag on the host: on a GPU the command thread waits for a reduce on
    the main stream, and a drop waits for the borrowing stream's thread, so a later op on another stream starts
    only after the reduce (on a CPU the main stream is that thread anyway)."""
    from monarch.runtime.simulator import devices

    gpu = dataclasses.replace(devices.DEVICES["h100"], intra_latency=5e-3, op_overhead=1e-6, dispatch=1e-6)
    sim = monarch.Simulator(hosts=1, gpus=2, device=gpu)
    comms, other = monarch.Stream("comms"), monarch.Stream("other")
    with sim.mesh.activate():
        g = torch.ones(256)
        g.reduce_("gpu", "sum")  # on the main stream
        with other.activate():
            torch.ones(4)
        alias, borrow = comms.borrow(g, mutable=True)
        with comms.activate():
            alias.reduce_("gpu", "sum")
        borrow.drop()
        with other.activate():
            after_drop = torch.ones(4)
    monarch.inspect(after_drop)
    events = [(e.name, float(e.start[0]), float(e.end[0])) for e in sim._backend.workers.events]
    sim.exit()
    (_, _, end1), (_, _, end2) = [e for e in events if e[0].startswith("all_reduce")]
    ones = [start for name, start, _ in events if name.startswith("aten::ones")][1:]  # (the first made g)
    assert ones[0] >= end1 and ones[1] >= end2 > end1 + 0.9 * 2 * 5e-3, (events, ones)  # (a ring of 2: 2 steps)


def _overlapped(matmuls: int = 1, **factors) -> dict:
    """A side stream's reduce (~40 ms) with `matmuls` ~10 ms matmuls on main issued while it runs, then the
    drop and an op on main, on 2 CPU workers of a made-up profile: {name: (start, end)} of rank 0 (the last
    of a name), in ms of the simulated clock."""
    from monarch.runtime.simulator import devices

    cpu = dataclasses.replace(
        devices.DEVICES["cpu"], flops={"default": 3.3554432e9}, efficiency=1.0, op_overhead=0.0, dispatch=1e-6,
        intra_latency=20e-3, **factors,
    )  # fmt: skip
    sim = monarch.Simulator(hosts=1, gpus=2, device=cpu)
    comms = monarch.Stream("comms")
    with sim.mesh.activate():
        g, a = torch.ones(256), torch.rand(256, 256)
        alias, borrow = comms.borrow(g, mutable=True)
        with comms.activate():
            alias.reduce_("gpu", "sum")
        for _ in range(matmuls):
            b = a @ a
        borrow.drop()
        b.add_(1)
    monarch.inspect(b)
    events = {e.name: (1e3 * float(e.start[0]), 1e3 * float(e.end[0])) for e in sim._backend.workers.events}
    sim.exit()
    return events


def test_on_a_cpu_compute_and_a_reduce_that_overlap_share_the_cores_and_a_drop_costs_a_handoff():
    alone = _overlapped()
    (r0, r1), (m0, m1), (a0, _) = alone["all_reduce (sum)"], alone["aten::mm"], alone["aten::add_.Tensor"]
    assert m1 - m0 == pytest.approx(10, abs=0.1) and r1 - r0 == pytest.approx(40, abs=0.5)
    assert r0 <= m0 < r1 and a0 == pytest.approx(r1, abs=0.05)  # the drop waits for the reduce, no more
    shared = _overlapped(compute_contention=2.0, comm_contention=4.0, handoff=3e-3)
    (s0, s1), (n0, n1), (b0, _) = shared["all_reduce (sum)"], shared["aten::mm"], shared["aten::add_.Tensor"]
    print(f"alone: matmul {m1 - m0:.1f} ms, reduce {r1 - r0:.1f} ms; sharing: {n1 - n0:.1f} ms, {s1 - s0:.1f} ms")
    # the side stream's thread slept: the reduce starts when it is woken (half the hand-over) after it was
    # queued; the matmul, queued after it, starts meanwhile (the clock goes on with the controller's own time)
    assert s0 - 1.5 <= n0 + 1e-6 and n0 < s0 + 35
    assert n1 - n0 == pytest.approx(20, abs=0.1)  # twice as slow while they overlap (all of its time)
    # the reduce made a quarter of its progress for those 20 ms: 15 ms later than alone
    assert s1 - s0 == pytest.approx(40 + 20 - 20 / 4, abs=0.1)
    assert b0 == pytest.approx(s1 + 1.5, abs=0.05)  # the main thread's wake after the drop (the other half)
    # GPUs keep neither: the datasheet profiles have no contention and no hand-over cost
    from monarch.runtime.simulator import devices

    assert all(
        (d.compute_contention, d.comm_contention, d.handoff) == (1.0, 1.0, 0.0) for d in devices.DEVICES.values()
    )


def test_on_a_cpu_where_a_reduce_beside_compute_stalls_it_begins_after_the_op_running_when_it_was_queued():
    """Calibrated `comm_contention` at `STALLED` or above: a stream thread woken while main computed got no
    core. Its reduce then begins when main's op ends (which runs at full speed meanwhile), and shares the cores
    with main's next op; the drop still waits for it."""
    from monarch.runtime.simulator.devices import STALLED

    ev = _overlapped(compute_contention=2.0, comm_contention=STALLED, handoff=3e-3)
    (r0, r1), (m0, m1), (a0, _) = ev["all_reduce (sum)"], ev["aten::mm"], ev["aten::add_.Tensor"]
    assert m1 - m0 == pytest.approx(10, abs=0.1)  # not slowed down: the reduce had not begun
    assert r0 == pytest.approx(m1, abs=0.01) and r1 - r0 == pytest.approx(40, abs=0.5)
    assert a0 == pytest.approx(r1 + 1.5, abs=0.05)  # the main thread's wake after the drop
    two = _overlapped(matmuls=2, compute_contention=2.0, comm_contention=STALLED, handoff=3e-3)
    (r0, r1), (m0, m1) = two["all_reduce (sum)"], two["aten::mm"]
    assert r0 < m0 and m1 - m0 == pytest.approx(20, abs=0.1)  # the second matmul shares the cores with it
    assert r1 - r0 == pytest.approx(40 + 20 - 20 / STALLED, abs=0.5)
    below = _overlapped(compute_contention=2.0, comm_contention=STALLED - 1, handoff=3e-3)
    assert below["all_reduce (sum)"][0] < below["aten::mm"][1] - 15  # below it: begins when woken, as before


def test_on_a_cpu_a_stalled_side_stream_begins_after_waiting_its_turn_for_a_core():
    """Where a collective beside compute stalls, a side stream's thread given a reduce while main computes
    waits `side_wait` for a core (the scheduler's turn), then shares the cores with main's next op; until then
    main's ops run at full speed. A short wait is the stalled model above; a longer one than main's compute
    leaves the reduce to main's drop (no overlap)."""
    from monarch.runtime.simulator.devices import STALLED

    stalled = dict(compute_contention=2.0, comm_contention=STALLED, handoff=3e-3)
    soon = _overlapped(matmuls=2, side_wait=5e-3, **stalled)  # (queued at 1.5 ms: its turn comes in the first)
    (r0, r1), (m0, m1) = soon["all_reduce (sum)"], soon["aten::mm"]
    assert r0 == pytest.approx(m0, abs=0.05) and m1 - m0 == pytest.approx(20, abs=0.1)  # the second one shares
    late = _overlapped(matmuls=2, side_wait=15e-3, **stalled)  # (after the first matmul: not its turn yet)
    (r0, r1), (m0, m1), (a0, _) = late["all_reduce (sum)"], late["aten::mm"], late["aten::add_.Tensor"]
    assert m1 - m0 == pytest.approx(10, abs=0.1) and r0 == pytest.approx(m1, abs=0.05)  # neither matmul slowed
    assert r1 - r0 == pytest.approx(40, abs=0.5) and a0 == pytest.approx(r1 + 1.5, abs=0.05)

    # a profile saved before `side_wait` was measured: the stalled model as it was
    def since_first(events: dict) -> list:  # (the controller's clock starts the first op a little later each run)
        t = events["aten::ones"][0]
        return [(k, round(a - t, 6), round(b - t, 6)) for k, (a, b) in sorted(events.items())]

    assert since_first(_overlapped(matmuls=2, **stalled)) == since_first(
        _overlapped(matmuls=2, side_wait=0.0, **stalled)
    )


def test_on_a_cpu_ranks_meet_further_apart_while_the_controller_computes_beside_them():
    """A collective after compute costs `reduce_in_step` beyond its own time (its ranks arrive apart), and
    toward `reduce_in_step_loaded` by the share of the span since the ranks' last collective that the
    controller computed on their host, as its recent spans of Python say (what it does beside the ranks' compute
    mostly comes after it issued the collective)."""
    from monarch.runtime.simulator import devices

    def extra(wait) -> tuple[float, float]:
        cpu = dataclasses.replace(
            devices.DEVICES["cpu"], flops={"default": 3.3554432e9}, efficiency=1.0, op_overhead=0.0,
            dispatch=1e-6, intra_latency=20e-3, reduce_in_step=[[0.01, 1e-3]],
            reduce_in_step_loaded=[[0.01, 4e-3]],
        )  # fmt: skip
        sim = monarch.Simulator(hosts=1, gpus=2, device=cpu)
        workers, spans, planned = sim._backend.workers, [], []
        busy, apart = workers.controller_busy, workers._apart
        workers.controller_busy = lambda t0, t1, share=1.0: (spans.append((t0, t1, share)), busy(t0, t1, share))[1]
        workers._apart = lambda groups, ready: (planned.append(len(spans)), apart(groups, ready))[1]
        gc.collect()
        gc.disable()  # (a collection of the test run's heap would count as the controller's CPU)
        try:
            with sim.mesh.activate():
                g, a = torch.ones(256), torch.rand(256, 256)
                g.reduce_("gpu", "sum")
                b = a @ a  # noqa: F841  (10 ms of compute since that collective)
            wait(0.03)
            with sim.mesh.activate():
                g.reduce_("gpu", "sum")
        finally:
            gc.enable()
        monarch.inspect(g)
        first, last = [e for e in workers.events if e.name.startswith("all_reduce")][-2:]
        sim.exit()
        took = float(last.end[0] - last.start[0]) - 2 * 20e-3  # (a ring of 2: two steps of latency)
        # the controller's share, over its spans up to when the reduce was planned, of a span as long as the
        # ranks' since their last collective (what it will do beside them is not known yet then)
        known = spans[: planned[-1]]
        now = known[-1][1]
        lo = now - (float(last.start.max()) - float(first.end.max()))
        cpu_s = sum((b - max(a, lo)) * c for a, b, c in known if b > lo)
        return 1e3 * took, cpu_s / (now - lo)

    slept, idle = extra(time.sleep)
    spun, share = extra(_spin)
    print(
        f"extra after 10 ms of compute: controller asleep {slept:.2f} ms ({idle:.2f}), spinning {spun:.2f} ({share:.2f})"
    )
    assert idle < 0.2 and idle + 0.2 < share <= 1.0  # (a loaded machine gives the spinning thread less than a core)
    assert slept == pytest.approx(1 + 3 * idle, abs=0.1) and spun == pytest.approx(1 + 3 * share, abs=0.3)


def test_on_a_cpu_a_batch_is_decoded_on_arrival_and_the_ops_after_a_reduce_pay_for_the_wait():
    """A worker decodes a whole batch before its first command (`decode` per command), and on a CPU worker the
    first op after a reduce its command thread ran loses `after_reduce`; the first op on main beside a side
    stream's reduce loses `beside_reduce` (not one that waited for the reduce's drop instead: the hand-over is
    what the wait cost); never on a GPU. A fetched value reaches the controller `fetch_latency` after the
    worker had it."""
    from monarch.runtime.simulator import devices

    def run(kind: str, mode: str) -> tuple[list, list]:
        dev = dataclasses.replace(
            devices.DEVICES["cpu" if kind == "cpu" else "h100"], op_overhead=1e-3, dispatch=1e-6,
            intra_latency=5e-3, decode=2e-3, after_reduce=7e-3, beside_reduce=11e-3, fetch_latency=3e-3,
        )  # fmt: skip
        sim = monarch.Simulator(hosts=1, gpus=2, device=dev)
        comms = monarch.Stream("comms")
        with sim.mesh.activate():
            g = torch.ones(4)
            if mode == "main":
                g.reduce_("gpu", "sum")
            else:
                alias, borrow = comms.borrow(g, mutable=True)
                with comms.activate():
                    alias.reduce_("gpu", "sum")
                if mode == "beside":
                    torch.zeros(4)  # (runs beside the reduce)
                borrow.drop()
            g.add_(1)
            g.add_(1)
        monarch.inspect(g)
        w = sim._backend.workers
        ops = [(e.name, 1e3 * float(e.start[0]), 1e3 * float(e.end[0])) for e in w.events]
        # the value comes back `fetch_latency` after the worker had it
        assert 1e3 * sim.time >= 1e3 * w.synced(0) + 3 - 0.01 and any(
            what == "fetch a value" and 1e3 * end == pytest.approx(1e3 * w.synced(0) + 3, abs=0.01)
            for _, end, what in sim._backend.controller_spans
        )
        sent = [
            (1e3 * t, int(what.split()[1])) for t, _, what in sim._backend.controller_spans if what.startswith("sent")
        ]
        wire = 1e3 * dev.wire_latency
        sim.exit()
        return ops, [(t + wire, n) for t, n in sent]

    def took(ops: list, name: str) -> list:
        return [end - start for n, start, end in ops if n == name]

    ops, batches = run("cpu", "main")
    (arrived, n), *_ = batches
    print("one stream, CPU:", ops, batches)
    assert ops[0][1] == pytest.approx(arrived + n * 2.0, abs=0.01)  # (the first op waits for the whole batch)
    assert took(ops, "aten::add_.Tensor") == [pytest.approx(1 + 7, abs=0.01), pytest.approx(1, abs=0.01)]
    ops, _ = run("cpu", "beside")
    assert took(ops, "aten::zeros") == [pytest.approx(1 + 11, abs=0.01)], ops
    assert took(ops, "aten::add_.Tensor") == [pytest.approx(1, abs=0.01)] * 2, ops
    ops, _ = run("cpu", "drop at once")
    assert took(ops, "aten::add_.Tensor") == [pytest.approx(1, abs=0.01)] * 2, ops
    for mode in ("main", "beside"):
        ops, _ = run("gpu", mode)
        assert took(ops, "aten::add_.Tensor") == [pytest.approx(1, abs=0.01)] * 2, (mode, ops)


def test_on_a_cpu_an_op_after_ops_that_moved_more_than_the_caches_hold_costs_what_calibration_found():
    """`cold_ops`: an op costs the extra interpolated at the bytes its rank's last `COLD_WINDOW` ops moved in
    all (none after views); never on a GPU. The window is as long as calibration's runs of small ops."""
    from monarch.runtime.simulator import devices, model
    from monarch.runtime.worker import calibration as worker_calibration

    assert model.COLD_WINDOW == worker_calibration.SMALL_RUN
    points = [[1e6, 1e-3], [4e6, 3e-3]]

    def views(kind: str, elements: int) -> list[float]:
        """Seconds each of COLD_WINDOW + 1 views takes after an add of `elements` floats (12 bytes each moved)."""
        base = devices.DEVICES["cpu" if kind == "cpu" else "h100"]
        dev = dataclasses.replace(
            base, op_overhead=1e-3, dispatch=1e-6, cold_ops=points, flops={"default": 1e15}, mem_bw=1e15
        )
        sim = monarch.Simulator(hosts=1, gpus=2, device=dev)
        with sim.mesh.activate():
            a = torch.ones(elements)
            for _ in range(model.COLD_WINDOW):  # (the ones out of the window)
                a = a.view(-1)
            b = a + a
            for _ in range(model.COLD_WINDOW + 1):
                b = b.view(-1)
        monarch.inspect(b)
        ops = [e for e in sim._backend.workers.events if e.name == "aten::view"]
        sim.exit()
        return [float(e.end[0] - e.start[0]) for e in ops[model.COLD_WINDOW :]]

    # an add of n floats reads two and writes one: 12n bytes
    assert views("cpu", 10) == pytest.approx([1e-3] * 6, abs=1e-6)  # (120 bytes: nothing to speak of)
    after_1mb = views("cpu", 1_000_000 // 12)
    assert after_1mb[:5] == pytest.approx([2e-3] * 5, abs=1e-5) and after_1mb[5] == pytest.approx(1e-3, abs=1e-6)
    assert views("cpu", 2_500_000 // 12)[0] == pytest.approx(1e-3 + 2e-3, abs=1e-5)  # (halfway to 4 MB)
    assert views("cpu", 40_000_000 // 12)[0] == pytest.approx(1e-3 + 3e-3, abs=1e-5)  # (beyond: the last point)
    assert views("gpu", 1_000_000 // 12) == pytest.approx([1e-3] * 6, abs=1e-6)


def test_on_a_cpu_a_reduce_after_compute_costs_what_calibration_found_a_step_s_reduces_cost():
    """`reduce_in_step`: a CPU collective costs the extra interpolated at the compute each rank ran since its
    last collective (none back to back), on every rank of its group; never on a GPU."""
    from monarch.runtime.simulator import devices

    points = [[2e-3, 1e-3], [10e-3, 3e-3]]

    def reduces(kind: str, compute: int) -> list[float]:
        base = devices.DEVICES["cpu" if kind == "cpu" else "h100"]
        dev = dataclasses.replace(
            base, op_overhead=1e-3, dispatch=1e-6, intra_latency=5e-3, reduce_in_step=points, flops={"default": 1e15}
        )
        sim = monarch.Simulator(hosts=1, gpus=2, device=dev)
        with sim.mesh.activate():
            g = torch.ones(4)
            for _ in range(compute):
                g.add_(1)  # (1 ms each: `op_overhead`)
            g.reduce_("gpu", "sum")
            g.reduce_("gpu", "sum")  # (back to back: nothing computed since the first)
        monarch.inspect(g)
        took = [1e3 * float(e.end[0] - e.start[0]) for e in sim._backend.workers.events if e.kind == "comm"]
        sim.exit()
        return took

    # (`torch.ones` is an op too: 1 ms of compute before the first reduce, then `compute` more)
    first, plain = reduces("cpu", 0)
    assert first == pytest.approx(plain + 0.5)  # (1 ms: half of the first point's, from none at none)
    assert reduces("cpu", 5) == [pytest.approx(plain + 2.0), pytest.approx(plain)]  # (6 ms: between the points)
    assert reduces("cpu", 19) == [pytest.approx(plain + 3.0), pytest.approx(plain)]  # (20 ms: the last point's)
    first, plain = reduces("gpu", 5)
    assert first == pytest.approx(plain)


def _beside_the_controller(wait, load: float) -> tuple[float, list[tuple[float, float, float]]]:
    """A 40 ms reduce on 2 CPU workers of a made-up profile, sent just before the controller spends ~30 ms
    in `wait`: how long the reduce took (ms), and the spans of the controller's clock the simulator charged to
    its host's workers meanwhile, each as (start, end) in ms from the reduce's start and the share of that
    span the controller's threads computed, as the simulator measured it (the wait is one span, the next
    cell's few Python lines another)."""
    from monarch.runtime.simulator import devices

    cpu = dataclasses.replace(
        devices.DEVICES["cpu"], op_overhead=0.0, dispatch=1e-6, intra_latency=20e-3, controller_load=load
    )
    sim = monarch.Simulator(hosts=1, gpus=2, device=cpu)
    workers, spans = sim._backend.workers, []
    busy = workers.controller_busy
    workers.controller_busy = lambda t0, t1, share=1.0: (spans.append((t0, t1, share)), busy(t0, t1, share))[1]
    gc.collect()
    gc.disable()  # (a collection of a long test run's heap on this thread would count as the controller's CPU)
    try:
        with sim.mesh.activate():
            g = torch.ones(256)
            g.reduce_("gpu", "sum")
        spans.clear()
        wait(0.03)
        with sim.mesh.activate():
            g.add_(1)
    finally:
        gc.enable()
    monarch.inspect(g)
    (reduce,) = [e for e in sim._backend.workers.events if e.name.startswith("all_reduce")]
    sim.exit()
    start = float(reduce.start[0])  # (the reduce began as it was sent: what came before does not slow it)
    took = 1e3 * (float(reduce.end[0]) - start)
    return took, [(1e3 * max(a - start, 0.0), 1e3 * max(b - start, 0.0), c) for a, b, c in spans]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # (computes that long, however long a loaded machine takes to let it)
    while time.thread_time() < end:
        pass


def _on_another_thread(seconds: float) -> None:
    """Compute for `seconds` on a helper thread, as `grad_generator`'s backward pass does (reporting its CPU
    through `helper_cpu`), while this thread waits for it."""
    from monarch.runtime.common import helper_cpu

    def helper() -> None:
        meter = helper_cpu.Meter()
        _spin(seconds)
        meter.report()

    t = threading.Thread(target=helper)
    t.start()
    t.join()


def _slowed(spans: list[tuple[float, float, float]]) -> float:
    """How long the 40 ms reduce, sent at 0, takes (ms) at `controller_load` 2 beside `spans` of the controller's
    Python (start, end in ms; the share of it that computed): it progresses 1 + share times slower in each."""
    now = done = 0.0
    for start, end, share in [*spans, (math.inf, math.inf, 0.0)]:
        for length, rate in ((start - now, 1.0), (end - start, 1 / (1 + share))):
            if done + length * rate >= 40:
                return now + (40 - done) / rate
            done, now = done + length * rate, now + length
    raise AssertionError("unreachable: the last span is endless")


def _cpu(spans: list[tuple[float, float, float]]) -> float:
    """Ms of CPU the controller's threads spent over `spans`."""
    return sum((end - start) * share for start, end, share in spans)


def test_on_a_cpu_the_controllers_python_slows_down_the_workers_of_its_host():
    alone, _ = _beside_the_controller(_spin, 1.0)
    assert alone == pytest.approx(40, abs=0.1)
    # Twice as slow while the controller computes with all of a core: the reduce made half its progress for
    # as long as it computed. The share of a core the computing thread gets is the machine's business (less than
    # all of it on a loaded machine): the slowdown follows the share the simulator measured, span by span.
    took, spans = _beside_the_controller(_spin, 2.0)
    gap, (_, _, share) = spans[-1][1], spans[0]
    print(f"reduce alone {alone:.1f} ms; beside {gap:.1f} ms of the controller's Python ({share:.2f}): {took:.1f} ms")
    assert gap > 25 and 0 < share <= 1 and took == pytest.approx(_slowed(spans), abs=0.5), spans
    # a controller that waits takes no core: it computed for far less than the one above (CPU time, not wall)
    slept, idle = _beside_the_controller(time.sleep, 2.0)
    assert slept == pytest.approx(_slowed(idle), abs=0.5) and _cpu(idle) < _cpu(spans) / 2, (idle, spans)
    # the program's Python on a helper thread while the sending one waits for it (`grad_generator`'s autograd)
    # takes the cores just as well: all of its CPU time counts (and no other thread's: the sleep above counted
    # nothing of what the rest of this process did meanwhile)
    took, side = _beside_the_controller(_on_another_thread, 2.0)
    assert _cpu(side) >= 29 and took == pytest.approx(_slowed(side), abs=0.5), side
    # GPU workers do not share the controller's cores
    from monarch.runtime.simulator import devices

    assert all(d.controller_load == 1.0 for d in devices.DEVICES.values())


def test_calibration_measures_this_machine_and_the_simulator_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_SIM_PROFILES", str(tmp_path))
    prof = monarch.Simulator.calibrate(workers=2, quick=True)
    saved = json.loads((tmp_path / f"{os.uname().nodename}.json").read_text())
    assert saved["kind"] == ("gpu" if torch.cuda.is_available() else "cpu")
    assert saved["measured"]["workers"] >= 1 and saved["source"].startswith("calibrated on")
    for key in ("mem_bw", "op_overhead", "dispatch", "intra_latency", "intra_bw", "wire_latency"):
        assert saved[key] > 0, key
    assert saved["flops"]["float32"] > 0  # (how fast: the machine's business, a loaded one's included)
    if saved["kind"] == "cpu":  # compute and a reduce overlapping on 2 workers; hand-overs between threads
        print("contention:", saved["compute_contention"], saved["comm_contention"], "handoff:", saved["handoff"])
        # (each factor is clamped to 1 or more, and the hand-over's cost and the controller's load below at 0 and
        # 1 or more: a bound would say nothing; what can be checked is that the profile holds the measurement)
        per_rank = saved["measured"]["per_rank"]
        for key in ("compute", "comm"):
            assert saved[f"{key}_contention"] == statistics.median(r[f"contention_{key}"] for r in per_rank), key
        assert saved["reduce_floor"] == saved["measured"]["collectives"][0]["1"] > 0  # gloo, one element
        # a reduce after compute, at each compute calibrated (ascending, extras clamped at 0)
        points = saved["reduce_in_step"]
        print("reduce in step (ms):", [[round(1e3 * c, 3), round(1e3 * x, 3)] for c, x in points])
        assert len(points) == 4 and [c for c, _ in points] == sorted(c for c, _ in points)
        assert all(c > 0 and x >= 0 for c, x in points)
        # small ops after a copy, at each size calibrated (ascending, extras clamped at 0)
        cold = saved["cold_ops"]
        print("cold ops (MB, us):", [[round(b / 1e6, 1), round(1e6 * x, 1)] for b, x in cold])
        assert [b for b, _ in cold] == sorted(b for b, _ in cold) and len(cold) == 4
        assert all(x >= 0 for _, x in cold)
        print("controller load:", saved["controller_load"])
        # the same with another process computing beside them (the controller's Python in a step), at the same
        # computes; and how long a side stream's reduce waited for a core while main computed
        loaded = saved["reduce_in_step_loaded"]
        print("reduce in step, loaded (ms):", [[round(1e3 * c, 3), round(1e3 * x, 3)] for c, x in loaded])
        assert len(loaded) == 4 and all(c > 0 and x >= 0 for c, x in loaded)
        print("side stream's wait for a core (ms):", 1e3 * saved["side_wait"])
        assert saved["side_wait"] >= 0
    # the engine's own cost per reduce (over one rank), and each op of the sample step beyond a tiny add_
    # (measured less the round trip, clamped at 0: on a loaded machine a quick calibration can read 0)
    assert all(isinstance(v, (int, float)) for v in (saved["reduce_overhead"], saved["measured"]["one_rank_reduce"]))
    extra = saved["op_extra"]
    print("op_extra (us):", {k: round(v * 1e6, 1) for k, v in extra.items()})
    assert {"aten::mm", "aten::native_layer_norm_backward", "aten::_softmax", "aten::embedding"} <= set(extra)
    assert "aten::add_.Tensor" not in extra and saved["op_overhead"] + min(extra.values()) > -1e-4
    # decoding a batch, and (CPU workers sharing cores) what the ops after a reduce lose
    print("decode (us per command):", 1e6 * saved["decode"], "after a reduce (us):", 1e6 * saved["after_reduce"])
    assert saved["decode"] > 0 and saved["measured"]["per_rank"][0]["side_enqueue"] > 0  # (two timings: no ratio)
    assert isinstance(saved["after_reduce"], (int, float)) and (saved["kind"] == "cpu" or saved["after_reduce"] == 0)
    # how a step's batch arrived and its loss came back, at the end of a step on busy cores
    ends = saved["measured"]["step_ends"]
    print("step ends (arrival s, return s, commands):", ends, "round trip (s):", saved["measured"]["round_trip"])
    if saved["kind"] == "cpu" and ends is not None:
        assert ends[0] > 0 and ends[1] > 0 and ends[2] > 50  # (the sample step issues about 175 commands)
        assert saved["fetch_latency"] == max(ends[1], saved["measured"]["round_trip"] / 2)
    sim = monarch.Simulator(hosts=1, gpus=2, device="local")
    assert sim.device == prof
    with sim.mesh.activate():
        x = torch.rand(256, 256)
        (x @ x).reduce("gpu", "sum")
    assert "calibrated on" in sim.summary().text()
    sim.exit()


def test_two_calibrations_in_a_row_agree_within_the_spread_each_reports(tmp_path):
    """`calibrate()` measures everything in passes, keeps each figure's spread across them and simulates a
    sample step with each pass's figures (its confidence, what it says); a second calibration straight after
    the first lands within what the two said: the step simulated with their figures differs by no more than
    the two calibrations' ranges across passes together. A step spread above `NOISY` is said (the profile
    names itself noisy) rather than passed off as a precise figure. (Single figures are kept with their
    spread for people, not held to it: one that is the difference of two timings, such as the hand-over,
    can read 0.01 ms in one calibration and 0.5 ms in the next on a loaded machine; the step they make
    moves far less.)"""
    from monarch.runtime.simulator.devices import NOISY, STEERING

    a, b = (monarch.Simulator.calibrate(tmp_path / f"{i}.json", workers=2, quick=True, passes=5) for i in range(2))
    saved = json.loads((tmp_path / "0.json").read_text())
    assert len(saved["measured"]["passes"]) == 5 and saved["spread"] == a.spread

    def value(p, key):
        if key == "flops":
            return p.flops["float32"]
        if key == "op_extra":
            return sum(p.op_extra.values())
        if key in ("reduce_in_step", "reduce_in_step_loaded", "cold_ops"):
            return sum(x for _, x in getattr(p, key))
        return statistics.median(p.measured["steps"]) if key == "step" else getattr(p, key)

    keys = (*STEERING, "step")
    for p in (a, b):
        assert set(keys) <= set(p.spread), set(keys) - set(p.spread)
        assert len(p.measured["steps"]) == 5 and all(t > 0 for t in p.measured["steps"])
        assert ("NOISY" in p.describe()) == (p.spread["step"] > NOISY), p.describe()
        for k in keys:  # the spread is each figure's range across the passes over its median
            r = p.measured["range"][k]
            assert (r == 0) == (p.spread[k] == 0), k
            if k not in ("op_extra", "reduce_in_step", "reduce_in_step_loaded", "cold_ops") and value(
                p, k
            ):  # (these: the passes' sums, over their median)
                assert p.spread[k] == pytest.approx(r / abs(value(p, k))), k
    apart = {k: (value(a, k), value(b, k), a.measured["range"][k] + b.measured["range"][k]) for k in keys}
    print({k: f"{x:.3g} vs {y:.3g} (within {w:.2g})" for k, (x, y, w) in apart.items()})
    x, y, within = apart["step"]
    assert abs(x - y) <= within, (a.measured["steps"], b.measured["steps"])
    with pytest.raises(ValueError, match="passes must be a positive integer, got 0"):
        monarch.Simulator.calibrate(tmp_path / "x.json", passes=0)


def test_a_simulator_starts_no_process():
    code = textwrap.dedent(
        """
        import os, torch, monarch
        sim = monarch.Simulator(hosts=2, gpus=4)
        with sim.mesh.activate():
            (torch.rand(8, 8) @ torch.rand(8, 8)).reduce("gpu", "sum")
        sim.summary()
        kids = [p for p in os.listdir("/proc") if p.isdigit()
                and open(f"/proc/{p}/stat").read().split(") ")[1].split()[1] == str(os.getpid())]
        print("children:", len(kids))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "children: 0" in out.stdout


def test_trace_loads_in_perfettos_trace_processor(tmp_path):
    """Perfetto's own trace processor (its WebAssembly build, in headless Chromium: see perfetto_tp.py) reads
    a process per rank and a track per stream, every op of the trace, and reports no import error."""
    sim = simulate(3)
    path = sim.trace(tmp_path / "trace.json")
    sim.exit()
    trace = json.loads(Path(path).read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    process = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    expected: dict[tuple[str, str], int] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            key = (process[e["pid"]], thread[(e["pid"], e["tid"])])
            expected[key] = expected.get(key, 0) + 1
    procs, per_track, errors = perfetto_tp.query(
        path,
        "select name from process where name is not null",
        "select p.name as process, t.name as thread, count(*) as n from slice s join thread_track tt"
        " on s.track_id = tt.id join thread t using (utid) join process p using (upid) group by 1, 2",
        perfetto_tp.IMPORT_ERRORS,
    )
    print("Perfetto:", procs, per_track, errors)
    assert sorted(r["name"] for r in procs) == [f"rank {r} (host=0,gpu={r})" for r in range(4)]
    assert {(r["process"], r["thread"]): r["n"] for r in per_track} == expected
    assert {thread for _, thread in expected} == {"stream main", "stream comms"}
    assert errors == []


def test_steps_marked_by_sim_step_are_counted_and_an_idle_timeline_says_why():
    """Three steps read "3 steps" (per step in the table, not "1 step" for the whole run); a program whose
    controller is slower than the device says that the ranks wait for the controller's Python."""
    from monarch.widgets.sim_view import render

    sim = monarch.Simulator(hosts=1, gpus=2, device="h100")
    with sim.mesh.activate():
        w = torch.rand(64, 64)
        for _ in range(3):
            x = torch.rand(8, 64) @ w
            x.reduce_("gpu", "sum")
            sim.step()
            monarch.inspect(x.sum())  # (a step's loss, logged: the commands so far are sent)
            time.sleep(0.005)  # the controller's own work between steps (data loading, logging, ...)
    s = sim.summary()
    assert [r.steps for r in s.timeline.ranks] == [3, 3] and s.timeline.steps_marked
    assert s.steps_line() == "3 steps, ms per step" and abs(s.total_ms - 3 * s.step_ms) < 0.2 * s.total_ms
    steps = [e for e in sim.trace_dict()["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert sorted((e["pid"], e["name"]) for e in steps) == [(r, f"ProfilerStep#{k}") for r in (0, 1) for k in range(3)]
    idle = s.idle_line()
    assert idle.startswith("idle ") and "waiting for the controller to send the next commands" in idle, idle
    assert idle.endswith("the controller's Python sets the pace, not the device"), idle
    html = render(sim.trace_dict(), s)
    assert "per rank, ms per step (3 steps)" in html and "monarch-sim-idle" in html
    assert idle in s.text()
    sim.reset()  # a window without marks: not called "1 step"
    with sim.mesh.activate():
        torch.rand(8, 64) @ w
    s = sim.summary()
    assert not s.timeline.steps_marked and "no steps marked: sim.step()" in s.text()
    html = render(sim.trace_dict(), s)
    assert "per rank, ms over the whole trace (no steps marked)" in html and "sim.step() after each step" in html
    sim.exit()
