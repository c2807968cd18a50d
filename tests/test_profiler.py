"""monarch.profiler on real workers: a trace per rank and a merged one, the summary naming a slow rank,
live functions, a worker profiling itself, `%%mesh --profile` in a real kernel, and clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

import monarch
from monarch.profiler import Schedule, profile, record_function
from monarch.runtime.tools import traces

from conftest import say_started, wait_gone, worker_pids
from helpers import perfetto_tp

pytestmark = pytest.mark.timeout(120)


def _processes(merged: dict) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in merged["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }


def _names_by_pid(merged: dict) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in merged["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(e["pid"], set()).add(e["name"])
    return out


@pytest.fixture(scope="module")
def mesh4():
    from monarch.actor import this_host

    m = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(m)
    yield m
    m.exit()
    assert wait_gone(pids) == []


@monarch.remote
def _imports_inductor() -> bool:
    import sys

    return "torch._inductor" in sys.modules


def test_a_profiled_tensor_engine_loop_writes_a_trace_per_rank_and_a_merged_one(mesh4, tmp_path):
    out = tmp_path / "traces"
    with mesh4.activate():
        w = torch.rand(64, 64)
        sched = Schedule(wait=0, warmup=1, active=2, repeat=1)
        with profile(on_trace_ready=str(out), schedule=sched, record_shapes=True) as prof:
            for _ in range(3):
                with record_function("forward"):
                    x = torch.rand(32, 64) @ w
                with record_function("grad_sync"):
                    x.reduce_("gpu", reduction="sum")
                prof.step()
        total = monarch.inspect(x.sum())
    assert total.item() > 0
    files = sorted(os.listdir(out))
    assert files == ["merged.pt.trace.json"] + [f"rank{r}.pt.trace.json" for r in range(4)]
    for r in range(4):  # each rank's own trace is torch's, with the marks made on the controller
        own = json.loads((out / f"rank{r}.pt.trace.json").read_text())
        assert {"forward", "grad_sync"} <= {e.get("name") for e in own["traceEvents"]}
    merged = json.loads((out / "merged.pt.trace.json").read_text())
    assert _processes(merged) == {r: f"rank {r} (gpu={r})" for r in range(4)}
    names = _names_by_pid(merged)
    for r in range(4):
        assert {"forward", "grad_sync", "aten::mm"} <= names[r]
        assert sum(n.startswith("ProfilerStep#") for n in names[r]) == 2
    assert prof.result is not None and prof.result.summary is not None
    # torch's profiler would import inductor (2 s per worker) to read one of its flags; nobody here compiled
    assert _imports_inductor.on(mesh4)().values() == [False] * 4
    assert [s.rank for s in prof.result.summary.ranks] == [0, 1, 2, 3]
    assert all(s.steps == 2 and s.step_ms > 0 for s in prof.result.summary.ranks)


def test_perfettos_trace_processor_reads_the_merged_trace(mesh4, tmp_path):
    perfetto_tp.require()
    with mesh4.activate(), profile(on_trace_ready=str(tmp_path)):
        with record_function("forward"):
            x = torch.rand(8, 8) @ torch.rand(8, 8)
        x.reduce_("gpu", reduction="sum")
    procs, slices, errors = perfetto_tp.query(
        tmp_path / "merged.pt.trace.json",
        "select name from process where name like 'rank %'",
        "select distinct name from slice",
        perfetto_tp.IMPORT_ERRORS,
    )
    assert {r["name"] for r in procs} == {f"rank {r} (gpu={r})" for r in range(4)}
    assert {"forward", "aten::mm"} <= {r["name"] for r in slices}
    assert errors == []


@monarch.remote
def _train_step(slow_rank: int, ahead: str | None = None) -> float:
    """A step whose forward takes rank `slow_rank` longest: it is still computing once every other rank said
    (``<ahead>.<rank>``) it goes on to the all_reduce, however the machine runs them."""
    import glob

    import torch.distributed as dist

    from monarch.profiler import record_function

    a = torch.rand(128, 128)
    slow = monarch.current_rank()["gpu"] == slow_rank
    with record_function("forward"):
        while slow and len(glob.glob(glob.escape(ahead) + ".*")) < dist.get_world_size() - 1:
            a = a @ a
            a = a / a.norm()
        for _ in range(300 if slow else 5):
            a = a @ a
            a = a / a.norm()
    if ahead is not None and not slow:
        say_started(ahead)
    dist.all_reduce(a)
    return float(a.sum())


def test_the_summary_names_the_rank_the_others_wait_for(mesh4, tmp_path):
    with profile(mesh=mesh4, on_trace_ready=str(tmp_path), schedule=Schedule(wait=0, warmup=1, active=3)) as prof:
        for step in range(4):
            _train_step.on(mesh4)(2, str(tmp_path / f"step{step}"))
            prof.step()
    summary = prof.result.summary
    assert summary.slowest == 2, summary.text()
    assert summary.why.startswith("slowest: rank 2 (gpu=2)") and "wait for it in collectives" in summary.why
    by_rank = {s.rank: s for s in summary.ranks}
    assert all(by_rank[r].comm_ms > by_rank[2].comm_ms for r in (0, 1, 3))  # they waited, it did not
    from monarch.widgets.timeline import render

    html = render(prof.result)
    assert "<svg" in html and "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "data-rank='2' class='monarch-slowest'" in html
    assert all(f"rank {r} (gpu={r})" in html for r in range(4))


def _rank_trace(rank: int, pid: int, steps: list[tuple[float, float]], ops: list[tuple[str, str, float, float]]):
    """A trace as torch writes it: `ops` are (cat, name, start us, duration us) on the main thread (tid = pid),
    or on GPU 0's stream 7 for cat "kernel"."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": pid, "tid": pid,
               "ts": s, "dur": d} for i, (s, d) in enumerate(steps)]  # fmt: skip
    for cat, name, s, d in ops:
        gpu = cat == "kernel"
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu else pid, "tid": 7 if gpu else pid,
                       "ts": s, "dur": d})  # fmt: skip
    return traces.RankTrace(rank, f"gpu={rank}", {"traceEvents": events, "baseTimeNanoseconds": 10**18}, 0, "h")


def test_the_summary_reads_compute_communication_idle_and_overlap():
    """The arithmetic on traces made by hand: CPU ops, a gloo range, GPU kernels overlapping NCCL."""
    even = [_rank_trace(r, 100 + r, [(0, 1000)], [("cpu_op", "aten::mm", 0, 400),
                                                   ("cpu_op", "aten::add", 100, 50),  # inside mm: not counted twice
                                                   ("user_annotation", "gloo:all_reduce", 500, 300)])
            for r in range(3)]  # fmt: skip
    s = traces.summarize(traces.merge(even))
    assert s.slowest is None and s.why.startswith("no rank stands out"), s.text()
    r0 = s.ranks[0]
    assert (r0.step_ms, r0.compute_ms, r0.comm_ms, r0.idle_ms, r0.overlap_pct) == (1.0, 0.4, 0.3, 0.3, 0.0)
    # rank 1 computes 800 us while the others wait 700 us in the collective: it is named
    late = [_rank_trace(r, 100 + r, [(0, 1000)], [("cpu_op", "aten::mm", 0, 800 if r == 1 else 100),
                                                   ("user_annotation", "gloo:all_reduce", 800 if r == 1 else 100,
                                                    100 if r == 1 else 800)])
            for r in range(3)]  # fmt: skip
    s = traces.summarize(traces.merge(late))
    assert s.slowest == 1 and s.why.startswith("slowest: rank 1 (gpu=1): 0.90 ms per step outside communication")
    # on a GPU, kernels are what counts: half of the NCCL kernel hides behind compute
    gpu = [_rank_trace(0, 100, [(0, 1000)], [("cpu_op", "aten::mm", 0, 900), ("kernel", "sm80_gemm", 100, 400),
                                              ("kernel", "ncclDevKernel_AllReduce", 300, 400)])]  # fmt: skip
    (g,) = traces.summarize(traces.merge(gpu)).ranks
    assert (g.device, g.compute_ms, g.comm_ms, g.overlap_pct, round(g.idle_ms, 3)) == ("gpu", 0.4, 0.4, 50.0, 0.4)
    merged = traces.merge(gpu)
    assert {e["tid"] for e in merged["traceEvents"] if e.get("name") == "sm80_gemm"} == {traces.GPU_THREAD + 7}
    assert _processes(merged) == {0: "rank 0 (gpu=0)"}


@monarch.remote
def _profile_myself(directory: str) -> list[str]:
    with profile(on_trace_ready=directory) as prof:
        with record_function("inner"):
            torch.rand(50, 50) @ torch.rand(50, 50)
    rank = monarch.current_rank()["gpu"]
    return [os.path.basename(p) for p in prof.result.rank_files[rank]]


def test_a_worker_profiles_itself_inside_a_live_function(mesh4, tmp_path):
    got = _profile_myself.on(mesh4.slice(gpu=slice(0, 2)))(str(tmp_path)).values()
    assert got == [["rank0.pt.trace.json"], ["rank1.pt.trace.json"]]
    trace = json.loads((tmp_path / "rank1.pt.trace.json").read_text())
    assert "inner" in {e.get("name") for e in trace["traceEvents"]}
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]  # no merged one


def test_bad_arguments_say_what_is_allowed(mesh4, tmp_path):
    with pytest.raises(ValueError, match="on_trace_ready=.*the directory the traces go to"):
        profile(on_trace_ready=print)
    with pytest.raises(ValueError, match=r"Schedule\(active=0\): at least one step"):
        Schedule(wait=1, warmup=1, active=0)
    with pytest.raises(ValueError, match=r"Schedule\(wait=-1\)"):
        Schedule(wait=-1, warmup=1, active=1)
    with pytest.raises(ValueError, match="allowed are ProfilerActivity.CPU and .CUDA"):
        profile(activities=["TPU"])
    with pytest.raises(ValueError, match="no mesh to profile"):
        with profile(on_trace_ready=str(tmp_path)):
            pass
    with pytest.raises(RuntimeError, match="profiles do not nest"):
        with profile(mesh=mesh4, on_trace_ready=str(tmp_path / "a")):
            with profile(mesh=mesh4, on_trace_ready=str(tmp_path / "b")):
                pass
    # the outer profile ended cleanly: a new one runs
    with profile(mesh=mesh4, on_trace_ready=str(tmp_path / "c")) as prof:
        _train_step.on(mesh4)(-1)
    assert len(prof.result.rank_files) == 4


def test_mesh_profile_in_a_notebook_shows_the_timeline_and_names_the_slow_rank(tmp_path):
    from helpers.kernel_client import monarch_kernel

    out = tmp_path / "cell-traces"
    with monarch_kernel() as k:
        r = k.run("%%mesh gpu=3\nimport torch\nimport torch.distributed as dist\nx = torch.ones(4)")
        assert r.status == "ok", r.text()
        pids = k.worker_pids()
        cell = (
            f"%%mesh --profile {out}\n"
            "import time\n"
            "a = torch.rand(128, 128)\n"
            "until = time.perf_counter() + (1.0 if rank == 1 else 0.02)\n"
            "while time.perf_counter() < until:\n"
            "    a = (a @ a) / 128\n"
            "dist.all_reduce(x)\n"
            "x.sum().item()"
        )
        r = k.run(cell)
        assert r.status == "ok", r.text()
        html = [m["content"]["data"]["text/html"] for m in r.of("display_data") if "text/html" in m["content"]["data"]]
        timeline = [h for h in html if "monarch-timeline" in h]
        assert len(timeline) == 1, html
        assert "data-rank='1' class='monarch-slowest'" in timeline[0]
        assert "slowest: rank 1 (gpu=1)" in timeline[0]
        assert sorted(os.listdir(out)) == ["merged.pt.trace.json"] + [f"rank{r}.pt.trace.json" for r in range(3)]
        r = k.run("%%mesh --profile x --noblock\n1")
        assert r.status == "error" and "cannot run with --noblock" in r.text()
        k.km.shutdown_kernel(now=False)
    assert wait_gone(pids) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workers_record_cuda_kernels_and_the_summary_counts_them(tmp_path):
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    m = this_host().spawn_procs({"gpu": n})
    pids = worker_pids(m)
    try:
        with m.activate(), profile(on_trace_ready=str(tmp_path), schedule=Schedule(wait=0, warmup=1, active=2)) as prof:
            w = torch.rand(1024, 1024, device="cuda")
            for _ in range(3):
                with record_function("forward"):
                    x = (w @ w).relu()
                x.reduce_("gpu", reduction="sum")
                prof.step()
    finally:
        m.exit()
    assert wait_gone(pids) == []
    merged = json.loads((tmp_path / "merged.pt.trace.json").read_text())
    kernels = [e for e in merged["traceEvents"] if e.get("cat") == "kernel"]
    assert {e["pid"] for e in kernels} == set(range(n))  # each rank's GPU streams sit in its own process
    assert all(e["tid"] >= traces.GPU_THREAD for e in kernels)
    assert all(s.device == "gpu" and s.compute_ms > 0 for s in prof.result.summary.ranks), prof.result.summary.text()
    if n > 1:
        assert any("nccl" in e["name"].lower() for e in kernels)


def test_a_profile_while_memory_is_recorded_on_cpu_says_why_it_cannot(mesh4, tmp_path):
    import monarch.memory

    if torch.cuda.is_available():
        pytest.skip("on CUDA workers memory recording does not use the profiler")
    monarch.memory.record_memory_history(mesh=mesh4)
    try:
        with pytest.raises(monarch.RemoteError, match="monarch.memory is recording this CPU worker's allocations"):
            with profile(mesh=mesh4, on_trace_ready=str(tmp_path)):
                _train_step.on(mesh4)(-1)
    finally:
        monarch.memory.record_memory_history(enabled=None, mesh=mesh4)
    with profile(mesh=mesh4, on_trace_ready=str(tmp_path)) as prof:  # and once it stopped, a profile runs
        _train_step.on(mesh4)(-1)
    assert len(prof.result.rank_files) == 4
