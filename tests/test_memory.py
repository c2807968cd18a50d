"""monarch.memory on real workers: a snapshot file per rank holding the allocations of a known tensor made by
the tensor engine and by a live function, each with the user's line; torch's own snapshot readers accept the
CPU snapshots; the inline view; a worker snapshotting itself; clear errors. CUDA: torch's own snapshot."""

from __future__ import annotations

import inspect
import os
import pickle
import types

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

import monarch
import monarch.memory
from monarch.runtime.tools.memory import MemorySnapshots, summarize

from conftest import _spawned

pytestmark = pytest.mark.timeout(90)

N = 1_000_003
NBYTES = 4 * N
"""torch.zeros(N) in float32: the CPU allocator rounds nothing."""


@pytest.fixture(scope="module")
def mesh2():
    yield from _spawned({"gpu": 2})


@monarch.remote
def held(action: str):
    """A tensor kept on each worker between calls (this function's globals live on in the worker)."""
    global _kept
    if action == "make":
        _kept = torch.zeros(N, dtype=torch.float32)  # the live function's line
        return _kept.untyped_storage().data_ptr()
    _kept = None
    return None


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _allocs(snap: dict, size: int) -> list[dict]:
    return [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["size"] == size]


def _torch_reads(snap: dict) -> None:
    """torch's own snapshot readers (`python -m torch.cuda._memory_viz ...`) take the snapshot."""
    assert "total_allocated" in memory_viz.segsum(snap)
    assert "entries" in memory_viz.trace(snap)
    assert "snapshot.pickle" in memory_viz.trace_plot(snap)  # the memory viewer's page, the snapshot inside
    assert "snapshot.pickle" in memory_viz.segment_plot(snap)
    assert "<non-python>" not in memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    memory_viz.segments(snap, format_flamegraph=lambda lines: lines)


def test_a_snapshot_per_rank_holds_the_known_tensor_with_the_users_line(mesh2, tmp_path):
    out = tmp_path / "snapshots"
    with mesh2.activate():
        monarch.memory.record_memory_history()
        t = torch.zeros(N, dtype=torch.float32)  # the tensor engine's line
        engine_line = inspect.currentframe().f_lineno - 1
        ptrs = held.on(mesh2)("make").values()
        snaps = monarch.memory.dump_memory_snapshot(dir_snapshots=str(out))
    assert isinstance(snaps, MemorySnapshots) and t.shape == (N,)
    assert sorted(os.listdir(out)) == ["snapshot_rank0.pickle", "snapshot_rank1.pickle"]
    assert snaps.paths == {r: str(out / f"snapshot_rank{r}.pickle") for r in (0, 1)}
    held_line = _line_of(held, "# the live function's line")
    for rank in (0, 1):
        with open(snaps.paths[rank], "rb") as f:
            snap = pickle.load(f)
        assert snap["monarch"]["format"] == "monarch-cpu-memory" and snap["monarch"]["rank"] == rank
        frames = [e["frames"] for e in _allocs(snap, NBYTES)]
        by_engine = [f for f in frames if any(x["line"] == engine_line and x["filename"] == __file__ for x in f)]
        by_live_fn = [f for f in frames if any(x["line"] == held_line and x["name"] == "held" for x in f)]
        assert by_engine and by_live_fn, frames
        assert (
            by_engine[0][0]["name"] == "aten::empty"
            and by_engine[0][-1]["name"] == inspect.currentframe().f_code.co_name
        )
        assert {"filename": __file__, "line": held_line, "name": "held"} in by_live_fn[0]
        live = {b["address"]: b for seg in snap["segments"] for b in seg["blocks"]}
        assert live[ptrs[rank]]["requested_size"] == NBYTES  # alive at the dump, with its frames
        _torch_reads(snap)
    summary = snaps.ranks[0]
    assert summary.allocated >= 2 * NBYTES and summary.peak >= summary.allocated and len(summary.timeline) >= 3
    assert {a.where for a in summary.largest[:2]} == {
        f"test_memory.py:{engine_line} in test_a_snapshot_per_rank_holds_the_known_tensor_with_the_users_line",
        f"test_memory.py:{held_line} in held",
    }
    page = snaps._repr_html_()
    assert 'data-rank="0"' in page and 'data-rank="1"' in page and page.count("<svg") == 2
    assert "<script" not in page and "http" not in page  # self-contained: nothing runs, nothing is fetched
    assert f"test_memory.py:{held_line} in held" in page and "rank 1 (gpu=1)" in repr(snaps)

    # the history goes on across dumps: a free, and the block gone from the live ones
    held.on(mesh2)("drop")
    with mesh2.activate():
        again = monarch.memory.dump_memory_snapshot(dir_snapshots=str(out))
    with open(again.paths[1], "rb") as f:
        snap = pickle.load(f)
    assert len(_allocs(snap, NBYTES)) >= 2  # the earlier ones are still in the history
    freed = [e for e in snap["device_traces"][0] if e["action"] == "free_completed" and e["addr"] == ptrs[1]]
    assert freed and freed[-1]["size"] == NBYTES
    assert ptrs[1] not in {b["address"] for seg in snap["segments"] for b in seg["blocks"]}
    monarch.memory.record_memory_history(None, mesh=mesh2)
    with pytest.raises(RuntimeError, match=r"record_memory_history\(\) first \(ranks 0-1\)"):
        monarch.memory.dump_memory_snapshot(str(out), mesh=mesh2)


def test_on_a_worker_it_snapshots_that_worker(mesh2, tmp_path):
    @monarch.remote
    def own(directory):
        monarch.memory.record_memory_history(max_entries=1000)
        x = torch.zeros(N, dtype=torch.float32)
        snaps = monarch.memory.dump_memory_snapshot(directory)
        monarch.memory.record_memory_history(None)
        return x.untyped_storage().data_ptr(), snaps

    results = own.on(mesh2)(str(tmp_path)).values()
    for rank, (ptr, snaps) in enumerate(results):
        assert [r.rank for r in snaps.ranks] == [rank] and snaps.paths[rank] == str(
            tmp_path / f"snapshot_rank{rank}.pickle"
        )
        with open(snaps.paths[rank], "rb") as f:
            snap = pickle.load(f)
        (alloc,) = [e for e in _allocs(snap, NBYTES) if e["addr"] == ptr]
        assert {"filename": __file__, "line": _line_of(own, "x = torch.zeros"), "name": "own"} in alloc["frames"]
        assert snaps.ranks[0].largest[0].where.endswith(" in own")


def test_clear_errors(mesh2, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"enabled='sometimes'.*'all'.*'state'.*None"):
        monarch.memory.record_memory_history("sometimes", mesh=mesh2)
    with pytest.raises(ValueError, match="max_entries=0"):
        monarch.memory.record_memory_history(max_entries=0, mesh=mesh2)
    with pytest.raises(ValueError, match=r"no mesh to act on.*mesh\.activate\(\).*mesh=.*%%mesh"):
        monarch.memory.dump_memory_snapshot()
    with pytest.raises(ValueError, match="give a ProcMesh"):
        monarch.memory.record_memory_history(mesh="gpu=2")
    monarch.memory.record_memory_history(None, mesh=mesh2)
    with pytest.raises(
        RuntimeError, match=r"dump_memory_snapshot: no memory history .*record_memory_history\(\) first"
    ):
        monarch.memory.dump_memory_snapshot(mesh=mesh2)

    @monarch.remote
    def inside_a_profile():
        with torch.autograd.profiler.profile(use_kineto=True):
            try:
                monarch.memory.record_memory_history()
            except RuntimeError as e:
                return str(e)

    (msg, _) = inside_a_profile.on(mesh2)().values()
    assert "a torch profiler is running" in msg and "one profile at a time" in msg

    # in a notebook, the %%mesh cells' mesh is the default
    from monarch.extension import magics

    shell = types.SimpleNamespace()
    monkeypatch.setattr("IPython.get_ipython", lambda: shell)
    monkeypatch.setitem(magics._loaded, id(shell), types.SimpleNamespace(current=mesh2.slice(gpu=1), implicit=None))
    monarch.memory.record_memory_history(enabled="state")
    snaps = monarch.memory.dump_memory_snapshot(str(tmp_path))
    assert [r.rank for r in snaps.ranks] == [1] and snaps.ranks[0].events == 0  # "state": no history kept
    monarch.memory.record_memory_history(None)


def test_view_of_a_snapshot_without_workers():
    snap = {
        "segments": [
            {"device": 0, "address": 4096, "total_size": 1024, "stream": 0, "blocks": [
                {"address": 4096, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                 "frames": [{"filename": "??", "line": 0, "name": "aten::empty"},
                            {"filename": "/home/u/train.py", "line": 7, "name": "step"}]},
            ]},
        ],
        "device_traces": [[
            {"action": "alloc", "addr": 8192, "size": 500, "stream": 0, "frames": [], "time_us": 10},
            {"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "frames": [], "time_us": 20},
            {"action": "free_completed", "addr": 8192, "size": 500, "stream": 0, "frames": [], "time_us": 30},
        ]],
    }  # fmt: skip
    r = summarize(snap, 3, "gpu=3", "/tmp/x/snapshot_rank3.pickle", "cuda:0")
    assert r.allocated == 1000 and r.events == 3
    assert r.timeline == [(10, 0), (10, 500), (20, 1524), (30, 1024)] and r.peak == 1524
    assert r.largest[0].where == "train.py:7 in step"
    page = MemorySnapshots("/tmp/x", [r])._repr_html_() or ""
    assert 'data-rank="3"' in page and "train.py:7 in step" in page and "--jp-" in page


def test_frames_of_monarchs_own_worker_code_are_never_the_users_line():
    """torch's CUDA history keeps every Python frame, the worker's own (`run_op`) among them: the block's line
    is then the controller's that issued the command, for a worker whose monarch is installed here or
    elsewhere (another host)."""
    import monarch.runtime as runtime

    def snap(worker_code: str) -> dict:
        frames = [
            {"filename": "??", "line": 0, "name": "aten::zeros"},
            {"filename": os.path.join(os.path.dirname(torch.__file__), "_ops.py"), "line": 840, "name": "__call__"},
            {"filename": worker_code, "line": 136, "name": "run_op"},
            {"filename": worker_code, "line": 50, "name": "run_packed"},
        ]
        return {
            "segments": [{"device": 0, "address": 4096, "total_size": 1024, "stream": 0, "blocks": [
                {"address": 4096, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                 "frames": frames}]}],
            "device_traces": [[{"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "frames": frames,
                                "time_us": 20}]],
            "external_annotations": [
                {"device": 0, "stage": "START", "name": "monarch-op@/home/u/nb.py:12 in f", "time_us": 15},
                {"device": 0, "stage": "END", "name": "monarch-op@/home/u/nb.py:12 in f", "time_us": 25},
            ],
        }  # fmt: skip

    here = os.path.join(os.path.dirname(runtime.__file__), "worker", "engine", "commands.py")
    assert summarize(snap(here), 0, "gpu=0", "/x", "cuda:0").largest[0].where == "nb.py:12 in f"
    there = "/opt/elsewhere/monarch/runtime/worker/engine/commands.py"
    r = summarize(snap(there), 0, "gpu=0", "/x", "cuda:0", runtime="/opt/elsewhere/monarch/runtime/")
    assert r.largest[0].where == "nb.py:12 in f"
    assert summarize(snap(there), 0, "gpu=0", "/x", "cuda:0").largest[0].where == "commands.py:136 in run_op"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_workers_write_torchs_own_snapshot(tmp_path):
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    gpus = this_host().spawn_procs({"gpu": n})
    try:
        with gpus.activate():
            monarch.memory.record_memory_history()
            t = torch.zeros(N, dtype=torch.float32, device="cuda")  # the tensor engine's line
            line = inspect.currentframe().f_lineno - 1
            snaps = monarch.memory.dump_memory_snapshot(dir_snapshots=str(tmp_path))
            monarch.memory.record_memory_history(None)
        assert t.device.type == "cuda" and sorted(os.listdir(tmp_path)) == [
            f"snapshot_rank{r}.pickle" for r in range(n)
        ]
        for rank in range(n):
            with open(snaps.paths[rank], "rb") as f:
                snap = pickle.load(f)
            assert "monarch" not in snap  # torch's own, as torch.cuda.memory._dump_snapshot writes it
            blocks = [b for seg in snap["segments"] if seg["device"] == rank for b in seg["blocks"]]
            block = next(b for b in blocks if b["state"] == "active_allocated" and b["requested_size"] == NBYTES)
            assert block["size"] == 4_000_256  # the caching allocator rounds up to 512 bytes
            made = [
                e for e in snap["device_traces"][rank] if e["action"] == "alloc" and e["size"] in (NBYTES, 4_000_256)
            ]
            assert made and made[-1]["frames"]  # (torch 2.11 writes the requested size here)
            assert any(a["name"].startswith("monarch-op@") for a in snap.get("external_annotations", []))
            memory_viz.segsum(snap)
            memory_viz.trace_plot(snap)
        assert snaps.ranks[0].device == "cuda:0" and snaps.ranks[0].allocated >= NBYTES
        where = f"test_memory.py:{line} in test_cuda_workers_write_torchs_own_snapshot"
        assert where in [a.where for a in snaps.ranks[0].largest]  # from the annotation of the tensor command
    finally:
        gpus.exit()
