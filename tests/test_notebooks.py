"""The tutorial notebooks: committed without outputs, and they run top to bottom on the monarch kernel.

Each notebook is executed with nbclient on the "monarch" kernel in a fresh temporary directory; no cell may
produce an error, and no process the kernel started (fork server, workers) may outlive it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_gone

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted(Path(REPO, "notebooks").glob("*.ipynb"))
ELSEWHERE = {
    "slurm.ipynb": "tests/test_slurm.py runs it, on the Slurm it starts",
    "llama_fsdp.ipynb": "tests/test_llama.py runs it, on the Slurm it starts, and kills and resumes it",
    "nanogpt.ipynb": "tests/test_nanogpt.py runs it and checks its training",
    "torch_native_parallelism.ipynb": "tests/test_parallelism_notebook.py runs it and checks each reference",
}
"""Notebooks that need more than this machine: executed by the module that sets up what they need."""


def _read(path: Path):
    return nbformat.read(str(path), as_version=4)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


# -- processes -----------------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    """`{pid: parent pid}` for every running process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _monarch_procs(marker: str) -> set[int]:
    """Processes that look like monarch's (kernel, fork server, workers) and mention `marker`.

    The fork server's command line carries the kernel's sys.path, which includes its working directory
    (the test's own temporary directory), and workers forked from it share that command line; so other
    tests running at the same time do not count here.
    """
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            cmd = _cmdline(int(name))
            if marker in cmd and ("monarch" in cmd or "multiprocessing.forkserver" in cmd):
                out.add(int(name))
    return out


# -- tests ---------------------------------------------------------------------------------------------
def test_notebooks_exist():
    assert Path(REPO, "notebooks", "getting_started.ipynb") in NOTEBOOKS


def _git(*args: str, cwd: str = REPO, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check, timeout=60)


IN_GIT = os.path.isdir(os.path.join(REPO, ".git")) and shutil.which("git") is not None


def _committed(path: Path):
    """The notebook as git holds it (its index entry: what the next commit takes), else the file."""
    if not IN_GIT:
        return _read(path)
    return nbformat.reads(_git("show", f":{path.relative_to(REPO)}").stdout, as_version=4)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    """What git holds: a notebook run and saved in JupyterLab keeps its outputs on disk (the next test)."""
    nb = _committed(path)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec["name"] == "monarch"
    for i, cell in enumerate(_code_cells(nb)):
        assert cell.outputs == [], f"{path.name}: code cell {i} has outputs; strip them before committing"
        assert cell.execution_count is None, f"{path.name}: code cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_filter_stores_each_committed_notebook_as_it_is(path):
    """Git's clean filter (tools/strip_outputs.py) changes no committed notebook by a byte: otherwise each would
    show as changed in a fresh clone."""
    data = path.read_bytes()
    filtered = subprocess.run(
        [sys.executable, str(Path(REPO, "tools", "strip_outputs.py"))],
        input=data,
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert filtered.stdout == data


@pytest.mark.timeout(300)
@pytest.mark.skipif(not IN_GIT, reason="needs a git checkout (./run setup configures git's filter there)")
def test_a_notebook_run_and_saved_as_jupyterlab_does_keeps_its_outputs_and_the_tree_clean(tmp_path):
    """JupyterLab saves a notebook through the server's contents manager (PUT /api/contents, then a checkpoint);
    its autosave does the same. Run on the real kernel and saved so in a repository set up as ./run setup sets
    up this one: the file keeps its outputs, git holds none (nothing to commit, the checkpoint ignored), and
    what JupyterLab and the notebooks write beside them is ignored here."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    clean = _git("config", "filter.notebook-outputs.clean", check=False).stdout.strip()
    assert clean, "git's notebook filter is not configured: ./run setup configures it"
    for ignored in ("notebooks/.ipynb_checkpoints/actors-checkpoint.ipynb", "notebooks/llama-run/ckpt/step-5"):
        assert _git("check-ignore", "-q", ignored, check=False).returncode == 0, f"{ignored} is not ignored"
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copytree(Path(REPO, "tools"), repo / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    for name in (".gitattributes", ".gitignore"):
        shutil.copy(Path(REPO, name), repo / name)
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("%%mesh gpu=2\nprint('rank', rank)"), nbformat.v4.new_code_cell("%mesh status")],
        metadata={"kernelspec": {"name": "monarch", "display_name": "Monarch (PyTorch mesh)", "language": "python"},
                  "language_info": {"name": "python"}},
    )  # fmt: skip
    path = repo / "notebooks" / "tour.ipynb"
    nbformat.write(nb, str(path))
    git = ("-c", "user.name=t", "-c", "user.email=t@t")
    _git("init", "-q", cwd=str(repo))
    _git("config", "filter.notebook-outputs.clean", clean, cwd=str(repo))
    _git("add", "-A", cwd=str(repo))
    _git(*git, "commit", "-q", "-m", "a notebook", cwd=str(repo))

    (tmp_path / "run").mkdir()
    ran = run_notebook(path, tmp_path / "run")
    manager = FileContentsManager(root_dir=str(repo / "notebooks"))
    manager.save({"type": "notebook", "format": "json", "content": json.loads(nbformat.writes(ran))}, "tour.ipynb")
    manager.create_checkpoint("tour.ipynb")
    on_disk = _read(path)
    assert all(c.outputs for c in _code_cells(on_disk)), "the saved notebook lost its outputs"
    assert on_disk.metadata.language_info.get("version"), "(the kernel's language_info is saved, as JupyterLab does)"
    assert (repo / "notebooks" / ".ipynb_checkpoints" / "tour-checkpoint.ipynb").exists()
    assert _git("diff", "--exit-code", cwd=str(repo), check=False).returncode == 0, "git sees the outputs as a change"
    _git("add", "-A", cwd=str(repo))  # (git status lists a file whose size changed until it is added)
    assert _git("status", "--porcelain", cwd=str(repo)).stdout == ""
    held = nbformat.reads(_git("show", ":notebooks/tour.ipynb", cwd=str(repo)).stdout, as_version=4)
    assert held == nb


def run_notebook(path: Path, tmp_path: Path, local_workers: bool = True, timeout: int = 120):
    """Execute `path` on the monarch kernel in `tmp_path`; no cell may fail (but those tagged
    raises-exception) and no process the kernel started may outlive it (with `local_workers`, some must have
    run under it). Each cell may take `timeout` seconds. Returns the executed notebook.

    `tmp_path/examples` links to the checkout's `examples/`, as `notebooks/` sits beside it there: a
    notebook that imports the examples' model code finds it by looking for `examples/` from its folder up."""
    nb = _read(path)
    if not (tmp_path / "examples").exists():
        (tmp_path / "examples").symlink_to(Path(REPO, "examples"), target_is_directory=True)
    before = _monarch_procs(str(tmp_path))
    seen: set[int] = set()
    client = None

    def after_cell(**_):
        # While the kernel runs, note every process under it: the fork server and the workers.
        pid = client.km.provisioner.pid if client.km.provisioner is not None else None
        if pid is not None:
            seen.add(pid)
            seen.update(_descendants(pid))
        seen.update(_monarch_procs(str(tmp_path)) - before)

    client = nbclient.NotebookClient(
        nb,
        kernel_name="monarch",
        timeout=timeout,
        resources={"metadata": {"path": str(tmp_path)}},
        on_cell_executed=after_cell,
    )
    try:
        client.execute()
    finally:
        errors = [  # (cells tagged raises-exception show failures on purpose; their checks are below)
            (i, out.ename, out.evalue)
            for i, cell in enumerate(_code_cells(nb))
            for out in cell.outputs
            if out.output_type == "error" and "raises-exception" not in cell.metadata.get("tags", [])
        ]
        left = wait_gone(seen | (_monarch_procs(str(tmp_path)) - before))
        stray = {pid: _cmdline(pid)[:200] for pid in left}

    assert errors == []
    assert stray == {}, "processes left after the notebook's kernel shut down"
    assert len(seen) > 1 or not local_workers, "no worker processes were seen while the notebook ran"
    check = OUTPUT_CHECKS.get(path.name)
    if check is not None:
        check(nb)
    return nb


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in ELSEWHERE], ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    run_notebook(path, tmp_path)


# -- what getting_started.ipynb should show -----------------------------------------------------------
def _cell(nb, first_line: str, contains: str = ""):
    """The code cell whose source starts with `first_line` (and contains `contains`)."""
    found = [c for c in _code_cells(nb) if c.source.startswith(first_line) and contains in c.source]
    assert len(found) == 1, f"expected one cell starting {first_line!r} containing {contains!r}, got {len(found)}"
    return found[0]


def _text(cell, mime: str = "text/plain") -> str:
    parts = []
    previous = None
    for out in cell.outputs:
        if out.output_type == "stream":
            # A loaded kernel may flush one print in two messages; JupyterLab joins consecutive streams, so do we.
            text = out.text if mime == "text/plain" else ""
            if previous is not None and previous.output_type == "stream" and previous.name == out.name:
                parts[-1] += text
            else:
                parts.append(text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get(mime, "")))
        previous = out
    return "\n".join(parts)


def _error(cell) -> str:
    (err,) = [out for out in cell.outputs if out.output_type == "error"]
    return "\n".join(err.traceback)


def _result(cell) -> dict:
    results = [out for out in cell.outputs if out.output_type == "execute_result"]
    assert len(results) == 1, f"expected one result, got {cell.outputs}"
    return results[0].data


def _check_getting_started(nb) -> None:
    # %%mesh gpu=4: one labelled area per rank, and a ValueMesh of the last expression.
    first = _cell(nb, "%%mesh gpu=4")
    html = _text(first, "text/html")
    for r in range(4):
        assert f'data-label="gpu={r}"' in html
        assert f"[gpu={r}] rank {r} of 4 at {{'gpu': {r}}} on " in _text(first)
    value = _result(first)
    assert value["text/plain"].startswith("ValueMesh {gpu: 4}")
    assert re.findall(r"gpu=(\d)\s+(\d+)", value["text/plain"]) == [("0", "0"), ("1", "10"), ("2", "20"), ("3", "30")]
    assert 'data-label="gpu=3"' in value["text/html"]

    # State kept across cells: weights was made in the first cell, incremented in the second.
    state = _cell(nb, "%%mesh\nweights += 1")
    for r in range(4):
        assert f"[gpu={r}] weights = {[float(r + 1)] * 3}" in _text(state)

    # all_reduce over the mesh's gloo group: 0 + 1 + 2 + 3.
    reduce = _cell(nb, "%%mesh\nimport torch.distributed as dist")
    assert _text(reduce).count("all_reduce gives 6.0") == 4

    # --on gpu=0:2 runs on two ranks only.
    part = _text(_cell(nb, "%%mesh --on gpu=0:2"), "text/html")
    assert 'data-label="gpu=0"' in part and 'data-label="gpu=1"' in part
    assert 'data-label="gpu=2"' not in part and 'data-label="gpu=3"' not in part

    # --group arrival: labelled lines as streams, one per rank.
    arrival = _text(_cell(nb, "%%mesh --group arrival"))
    assert sorted(re.findall(r"\[gpu=(\d)\] rank \1 done", arrival)) == ["0", "1", "2", "3"]

    # A matplotlib figure (and a Markdown display) from every rank.
    plots = _cell(nb, "%%mesh\n", "plt.subplots")
    assert _text(plots, "text/html").count('class="monarch-figure"') == 4  # drawn in the theme's colours
    assert not any(out.output_type == "execute_result" for out in plots.outputs)
    for r in range(4):  # Markdown rendered, its math left for MathJax
        assert f"<p><strong>rank {r}</strong> draws $y = x^{r + 1}$</p>" in _text(plots, "text/html")

    # %mesh status: the MeshTable of the implicit mesh.
    status = _result(_cell(nb, "%mesh status"))
    assert status["text/plain"].startswith("ProcMesh {gpu: 4}")
    assert status["text/html"].count('<td class="monarch-status monarch-status-idle">idle</td>') == 4

    # %mesh pull / push.
    assert "rank 3 has tensor([4., 4., 4.])" in _text(_cell(nb, "%mesh pull weights"))
    assert _text(_cell(nb, "%%mesh\n", "learning_rate")).count("learning_rate = 0.01") == 4

    # A mesh from spawn_procs, its table, live functions on it and on a slice.
    table = _result(_cell(nb, "import torch"))
    assert table["text/plain"].startswith("ProcMesh {host: 2, gpu: 2}")
    assert "application/vnd.jupyter.widget-view+json" in table
    live = _cell(nb, "scale = 100")
    assert re.search(r"host=1,gpu=1\s+101", _text(live))
    assert re.findall(r"gpu=(\d)\s+(\S+)", _result(live)["text/plain"]) == [("0", "0.5"), ("1", "1.5")]

    # TensorView: one tensor per rank, static HTML with a labelled block each.
    tensors = _result(_cell(nb, "from monarch.widgets import TensorView"))
    assert tensors["text/html"].count("data-label=") == 4
    assert 'data-label="host=1,gpu=1"' in tensors["text/html"]
    assert "[[11., 12., 13.]" in tensors["text/plain"].replace("\n", "")

    # RemoteError caught: the failing ranks shown once, with the worker's source line.
    errors = _cell(nb, "@monarch.remote\ndef risky")
    text = _text(errors)
    assert "failed ranks: [1, 3]" in text
    assert "-- ranks 1, 3: ValueError: odd ranks do not like this input" in text
    assert 'raise ValueError("odd ranks do not like this input")' in text
    assert re.findall(r"host=(\d)\s+'ok'", _result(errors)["text/plain"]) == ["0", "1"]

    # When things go wrong: one rank fails before all_reduce; the others are released, the next cell works.
    failed = _error(_cell(nb, "%%mesh\nt = torch.ones(1) * rank\nif rank == 1"))
    assert "-- rank 1 (gpu=1): ValueError: rank 1 got a batch of the wrong shape" in failed
    assert re.search(r"ranks 0, 2-3 were released from all_reduce at Cell In\[\d+\], line 5", failed), failed
    after = _result(_cell(nb, "%%mesh\nt = torch.ones(1) * rank  # a collective"))["text/plain"]
    assert re.findall(r"gpu=(\d)\s+\(6\.0, \[(\S+),", after) == [(str(r), f"{r + 1.0}") for r in range(4)], after
    # a rank that ignores the interrupt: named by %mesh status and by the cell it would have held up
    status = _result(_cell(nb, "import time\n\n# every rank in its loop first"))["text/plain"]
    busy = [line for line in status.splitlines() if " busy " in line]
    assert len(busy) == 1 and busy[0].startswith("3 ") and re.search(r"%%mesh cell at Cell In\[\d+\], line 6", busy[0])
    refused = " ".join(_error(_cell(nb, '%%mesh\nprint("not run')).split())  # (wrapped to fit an output area)
    assert "this cell was not started: rank 3 is still running an earlier call on mesh {gpu: 4}" in refused
    assert "%mesh restart" in refused
    fresh = _text(_cell(nb, '%%mesh\nprint(f"rank {rank}: weights defined?'))
    assert fresh.count("weights defined? False") == 4


# -- what distributed_tensors.ipynb should show -------------------------------------------------------
def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d*(?:e[+-]\d+)?", text)]


def _shown(cell) -> list[str]:
    """The tensors `monarch.show` displayed in `cell`, as printed by torch: the value of the rank it shows
    (its TensorView lists every rank, each after its label)."""
    out = []
    for o in cell.outputs:
        text = str(o.data.get("text/plain", "")) if o.output_type == "display_data" else ""
        if text.startswith("tensor on ") and ", showing " in text:
            label = text.split("\n", 1)[0].split(", showing ", 1)[1]
            values = re.split(r"^\[(\w+=\d+(?:,\w+=\d+)*)\]\n", text, flags=re.M)
            out.append(dict(zip(values[1::2], (v.rstrip("\n") for v in values[2::2])))[label])
    return out


def _rows(table: str) -> list[tuple[str, ...]]:
    """The coordinate and rank columns of the first printed MeshTable in `table`."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if {"status", "memory", "rank"} <= set(line.split()))
    width = lines[start].split().index("rank") + 1
    rows = []
    for line in lines[start + 2 :]:
        if not re.match(r"\d", line):
            break
        rows.append(tuple(line.split()[:width]))
    return rows


def _after_start(text: str, sizes: str) -> str:
    """`text` of a cell that spawned a mesh of `sizes`: it opens with the start's line; the rest."""
    start, _, rest = text.partition("\n")
    assert re.fullmatch(rf"monarch: \d+ workers \{{{sizes}\}} ready in \d+\.\d\d s", start), start
    return rest


def _check_distributed_tensors(nb) -> None:
    # A 4-worker mesh and its table.
    table = _after_start(_text(_cell(nb, "mesh = this_host().spawn_procs")), "gpu: 4")
    assert table.startswith("ProcMesh {gpu: 4}")
    assert _rows(table) == [("0", "0"), ("1", "1"), ("2", "2"), ("3", "3")]
    assert table.count(" cpu ") == 4

    # Without a mesh, a local tensor; inside activate(), a handle, and one warning that "cuda" means the CPU.
    assert _result(_cell(nb, "torch.rand(3, 4)"))["text/plain"].startswith("tensor([[")
    handle = _cell(nb, "with mesh.activate():\n    t = torch.rand(3, 4")
    assert _result(handle)["text/plain"] == "monarch.Tensor(shape=(3, 4), dtype=torch.float32, mesh={gpu: 4})"
    assert _text(handle).count("the mesh's workers have no CUDA") == 1

    # inspect and show fetch rank 0's copy; other coordinates give another rank's random numbers.
    inspected = _result(_cell(nb, "monarch.inspect(t)"))["text/plain"]
    shown0 = [c for c in _code_cells(nb) if c.source == "monarch.show(t)"]
    assert len(shown0) == 1 and _shown(shown0[0]) == [inspected]
    shown1 = _cell(nb, "monarch.show(t, gpu=1)")
    assert "showing gpu=1" in _text(shown1)
    (t1,) = _shown(shown1)
    assert len(_numbers(t1)) == 12 and t1 != inspected

    # t @ t.T: a symmetric 3 x 3 matrix.
    (obj,) = _shown(_cell(nb, "with mesh.activate():\n    obj = t @ t.T"))
    m = _numbers(obj)
    assert len(m) == 9 and all(abs(m[3 * i + j] - m[3 * j + i]) < 2e-4 for i in range(3) for j in range(3))

    # The failed allocation surfaces as a RemoteError with the worker's message; the workers recover.
    failure = _cell(nb, "try:\n", "big_w")
    text = _text(failure)
    assert "RemoteError" in text and "can't allocate memory" in text
    assert "RECOVERED!" in "".join(out.text for out in failure.outputs if out.get("name") == "stdout")

    # The search doubles N up to the cap and stops there by itself.
    search = _text(_cell(nb, "N = 1"))
    assert re.findall(r"at least (\d+) x 2\*\*24 elements work", search) == ["1", "2", "4", "8"]
    assert "cap reached: stopping at 8 x 2**24 elements" in search and "max is" not in search

    # reduce("gpu", "sum"): a differs between ranks, r is the same on every rank.
    a0, a1, r0, r1 = _shown(_cell(nb, "with mesh.activate():\n    a = torch.rand"))
    assert a0 != a1 and r0 == r1
    assert all(x > y for x, y in zip(_numbers(r0), _numbers(a0)))  # a sum of positive numbers

    # The 2 x 2 mesh, its reductions over gpu and over host, renamed and split views.
    remote = _after_start(_text(_cell(nb, "# NYI: schedule public API")), "host: 2, gpu: 2")
    assert remote.startswith("ProcMesh {host: 2, gpu: 2}")
    assert _rows(remote) == [("0", "0", "0"), ("0", "1", "1"), ("1", "0", "2"), ("1", "1", "3")]
    sums = _text(_cell(nb, "def at(x, host, gpu)"))
    assert "rgpu on host 1 is eg summed over its gpus: True" in sums
    assert "rhost on gpu 1 is eg summed over the hosts: True" in sums
    assert _text(_cell(nb, "mesh_2d_parallel = ")).startswith("ProcMesh {dp: 2, tp: 2}")
    split = _text(_cell(nb, "mesh_3d_parallel = "))
    assert split.startswith("ProcMesh {dp: 1, pp: 2, tp: 2}")
    assert _rows(split) == [("0", "0", "0", "0"), ("0", "0", "1", "1"), ("0", "1", "0", "2"), ("0", "1", "1", "3")]

    # Pipelining: stage 0 is ranks 0 and 1; the output ends on stage 1 (ranks 2 and 3), through ReLUs.
    assert _rows(_text(_cell(nb, "pipeline_mesh = "))) == [("0", "0"), ("1", "1")]
    pipeline = _cell(nb, "def forward_pipeline")
    (out,) = _shown(pipeline)
    assert len(_numbers(out)) == 12 and min(_numbers(out)) >= 0
    assert _rows(_text(pipeline).split("ProcMesh {gpu: 2}", 1)[1]) == [("0", "2"), ("1", "3")]

    # The simulator, where the tutorial uses it: after each version of train, a timeline of 4 simulated ranks
    # (plain SVG, no script), its overlap line; nothing overlaps on one stream or with the early drop, some does
    # with the late drop.
    sims = [c for c in _code_cells(nb) if c.source.rstrip().endswith("simulate()")]
    assert len(sims) == 3
    overlaps = []
    for sim in sims:
        html = _text(sim, "text/html")
        assert "<svg class='monarch-timeline'" in html and "<script" not in html
        assert "monarch.Simulator on h100 (datasheet)" in html
        assert all(f"data-rank='{r}'" in html for r in range(4)) and "data-rank='4'" not in html
        found = re.findall(r"communication overlapped with compute: (\d+)% \(per rank\)", html)
        assert len(found) == 1, html
        overlaps.append(int(found[0]))
        assert "peak memory: " in html
    print("simulated overlap per variant:", overlaps)
    assert overlaps[0] == 0 and overlaps[1] == 0 and overlaps[2] > 0, overlaps

    # DDP: every run prints 8 steps of a falling loss (the plain one, and the streams variants if present).
    runs = [c for c in _code_cells(nb) if c.source.rstrip().endswith("run_ddp()")]
    assert len(runs) == 3  # plain grad_generator, then the two streams variants
    for run in runs:
        steps = re.findall(r"step (\d+): loss (\d+\.\d+)", _text(run))
        assert [int(s) for s, _ in steps] == list(range(8)), _text(run)
        losses = [float(v) for _, v in steps]
        assert all(b < a for a, b in zip(losses, losses[1:])), losses


# -- what slurm.ipynb should show ----------------------------------------------------------------------
def _check_slurm(nb) -> None:
    reserve = _text(_cell(nb, "import monarch\nimport monarch.notebook"))
    assert "monarch: job notebook-demo is up: 2 hosts (node1, node2)" in reserve, reserve
    assert "('notebook-demo', 'RUNNING', 2)" in reserve
    table = _text(_cell(nb, "mesh = job.spawn_procs"))
    assert "ProcMesh {host: 2, gpu: 2}" in table and table.count("node1") == 2 and table.count("node2") == 2
    cell = _text(_cell(nb, "%%mesh mesh"))
    assert cell.count("all_reduce gives 6.0") == 4 and "[host=1,gpu=1] node2: rank 3 of 4" in cell, cell
    collectives = _cell(nb, "import torch\n\n\n@monarch.remote")
    assert "over host: [2.0, 4.0, 2.0, 4.0]" in _text(collectives)
    assert "over gpu:  [1.0, 1.0, 5.0, 5.0]" in _text(collectives)
    assert _result(collectives)["text/plain"] == "tensor([0., 2., 4., 6.])"
    sync = _text(_cell(nb, "@monarch.remote\ndef model_scale"))
    assert "before: [1, 1, 1, 1]" in sync and "after:  [10, 10, 10, 10]" in sync
    assert re.search(
        r"synced: \{'node1 \(10.77.0.11\)': \['model.py'\], 'node2 \(10.77.0.12\)': \['model.py'\]\}", sync
    ), sync
    assert "notebook-demo" not in _result(_cell(nb, "mesh.exit()\nmonarch.notebook.cleanup"))["text/plain"]


def _check_profiling(nb) -> None:
    # The profiled loop: the merged timeline (plain SVG, no script, no site) and the summary of 4 ranks.
    loop = _cell(nb, "with mesh.activate():\n    with profile(")
    html = _text(loop, "text/html")
    assert "<svg class='monarch-timeline'" in html and "<script" not in html
    assert all(f"rank {r} (dp={r})" in html for r in range(4))
    assert "monarch-profile-summary" in html and "per rank, ms per step (2 steps)" in html
    assert len(html) < 200_000, f"the timeline is {len(html)} bytes"
    # What the text says of a CPU run: every rank's reduces (through shared memory: ranges of monarch's own, the
    # ops inside them not compute) count as communication, and at most part of them hides behind compute.
    rows = re.findall(r"^\d \(dp=\d\)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)%$", _text(loop), re.M)
    assert len(rows) == 4, _text(loop)
    assert all(float(r[2]) > 0 and int(r[4]) < 100 for r in rows), _text(loop)
    files = _result(_cell(nb, "sorted(p.split"))["text/plain"]
    assert all(f"rank{r}.pt.trace.json" in files for r in range(4)) and "merged.pt.trace.json" in files
    # %%mesh --profile: rank 2 made slow on purpose is named.
    straggler = _text(_cell(nb, "%%mesh mesh --profile"), "text/html")
    assert "slowest: rank 2 (dp=2)" in straggler and "data-rank='2' class='monarch-slowest'" in straggler
    # Memory: a snapshot per rank, each with the 4 MB tensor made in the cell.
    memory = _result(_cell(nb, "import monarch.memory"))
    for r in range(4):
        assert f"snapshot_rank{r}.pickle" in memory["text/plain"]
    assert memory["text/plain"].count("3.8 MiB") >= 4, memory["text/plain"]
    assert "<svg" in memory["text/html"] and "<script" not in memory["text/html"]


def _check_actors(nb) -> None:
    """notebooks/actors.ipynb: the trainers learn through their loaders and the parameter server (actors calling
    actors), each endpoint's print lands under its rank, and the supervisor handles a SIGKILL while the rest of
    its mesh keeps answering."""
    table = _text(_cell(nb, "loaders = procs.spawn"))
    assert table.count("loaders (DataLoader), trainers (Trainer)") == 4, table
    trained = _text(_cell(nb, "losses = []"))
    first, last = (float(x) for x in re.search(r"first step (\S+), last step (\S+)\n", trained).groups())
    assert last < first / 100, trained
    assert "server: 240 updates" in trained and "batches served per loader: [60, 60, 60, 60]" in trained, trained
    report = _text(_cell(nb, "trainers.report.call"))
    for g in range(4):
        assert f"[gpu={g}] trainer {g}: step 60, loss" in report, report
    assert "streamed: [" in report and "chosen: " in report, report
    supervised = _text(_cell(nb, "os.kill(pids[1], signal.SIGKILL)"))
    assert (
        "supervisor saw: [\"actor mesh 'workers' (Worker) on {gpu: 2}: rank 1 (gpu=1) killed by SIGKILL" in supervised
    )
    assert "gpu 0 still answers: {'gpu': 0/2}" in supervised, supervised  # (a Point: gpu 0 of 2)


OUTPUT_CHECKS = {
    "actors.ipynb": _check_actors,
    "getting_started.ipynb": _check_getting_started,
    "distributed_tensors.ipynb": _check_distributed_tensors,
    "slurm.ipynb": _check_slurm,
    "profiling.ipynb": _check_profiling,
}
