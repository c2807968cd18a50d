"""Live functions: shipping by value, results, output, errors."""

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

import monarch
from monarch.runtime.common.errors import RemoteError

SCALE = 10


def helper(x):
    return x * SCALE


@monarch.remote
def uses_globals_and_closures(x):
    return helper(x) + monarch.current_rank()["gpu"]


def test_importable_function_runs_with_its_module(mesh8):
    # this test module is importable, so the function goes by reference and the worker imports it
    res = uses_globals_and_closures.on(mesh8)(2)
    assert res.item(host=1, gpu=3) == 23


def test_closure_and_lambda(mesh8):
    k = 7

    def make():
        return lambda: k * 2

    f = monarch.remote(make())
    assert set(f.on(mesh8)().values()) == {14}


def test_value_mesh_api(mesh8):
    @monarch.remote
    def coords():
        return monarch.current_rank()

    vm = coords.on(mesh8)()
    assert len(vm) == 8 and vm.sizes == {"host": 2, "gpu": 4}
    assert vm.values()[5] == {"host": 1, "gpu": 1}
    assert [c for c, _ in vm.items()] == vm.values() == [p for p, _ in vm]  # (point, value), as Monarch's
    assert vm.item(host=0, gpu=2) == {"host": 0, "gpu": 2}
    assert "host=1,gpu=3  {'host': 1/2, 'gpu': 3/4}" in vm.to_table()  # a Point, as Monarch prints it
    with pytest.raises(ValueError, match="coordinate gpu=4 is out of range"):
        vm.item(host=0, gpu=4)


def test_active_mesh_and_async(mesh8):
    @monarch.remote
    def add(a, b=0):
        return a + b

    with pytest.raises(RuntimeError, match=r"no mesh to run add on: use add.on\(mesh\)"):
        add(1)
    view = mesh8.slice(host=1)
    with view.activate():
        assert add(1, b=2).values() == [3] * 4
    fut = add.on(mesh8).call_async(5)
    assert fut.result(timeout=30).values() == [5] * 8 and fut.done()

    async def main():
        return await add.on(mesh8).call_async(6)

    assert asyncio.run(main()).values() == [6] * 8


def test_calls_from_two_threads(mesh8):
    @monarch.remote
    def ident(x):
        return x

    out = {}

    def run(i):
        out[i] = [ident.on(mesh8)(i * 100 + j).values() for j in range(20)]

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert all(out[i][j] == [i * 100 + j] * 8 for i in range(3) for j in range(20))


def test_threads_racing_a_new_function_all_find_it_shipped(mesh8):
    """The call that ships a function to the workers is never overtaken by another thread's call."""
    for round_ in range(15):
        f = monarch.remote(eval(f"lambda x: x + {round_}"))  # a new function each round
        start = threading.Barrier(4)
        got, errors = [], []

        def call(i, f=f, start=start, got=got, errors=errors):
            start.wait()
            try:
                got.append(f.on(mesh8)(i).values())
            except Exception as e:
                errors.append(e)

        ts = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        assert not errors, errors[0]
        assert sorted(v[0] for v in got) == [i + round_ for i in range(4)]


def test_tensors_round_trip_out_of_band(mesh8):
    x = torch.arange(1 << 16, dtype=torch.float32)
    half = torch.randn(300, 7).to(torch.bfloat16)

    @monarch.remote
    def twice(t, h):
        return t * 2, h.float().sum().item(), torch.ones(3)

    res = twice.on(mesh8.slice(host=0, gpu=1))(x, half)
    big, s, small = res.item()
    assert torch.equal(big, x * 2)
    assert s == pytest.approx(half.float().sum().item(), rel=1e-3)
    assert torch.equal(small, torch.ones(3))


def test_worker_output_reaches_controller_labelled(mesh8, capfd):
    @monarch.remote
    def talk():
        print("hello from", monarch.current_rank()["gpu"])
        print("to stderr", file=sys.stderr)
        os.write(1, b"raw fd write\n")  # C-level writes are forwarded too

    talk.on(mesh8.slice(host=1))()
    out, err = capfd.readouterr()
    for g in range(4):
        assert f"[host=1,gpu={g}] hello from {g}\n" in out
        assert f"[host=1,gpu={g}] raw fd write\n" in out
        assert f"[host=1,gpu={g}] to stderr\n" in err


def test_output_arrives_before_the_result(mesh8):
    """Everything a call wrote, half lines and C-level writes included, is delivered (to the call's
    own sink) before its result: a notebook cell shows it in the cell that made it."""

    @monarch.remote
    def partial():
        sys.stdout.write("no newline")  # held in the stream's buffer until the call ends
        os.write(2, b"raw, ")  # straight to the file descriptor
        print("half", file=sys.stderr, end="")

    for _ in range(3):  # the second and later calls reuse the worker's flushed state
        got: list = []
        partial.on(mesh8.slice(host=0)).start((), {}, output=got.append).result()
        for g in range(4):
            text = "".join(e.text for e in got if e.label == f"host=0,gpu={g}" and e.stream == "stdout")
            err = "".join(e.text for e in got if e.label == f"host=0,gpu={g}" and e.stream == "stderr")
            assert text == "no newline" and err == "raw, half", (text, err)


def test_output_of_every_call_arrives_before_its_result(mesh8):
    """Whole lines wake the worker's output thread at once; the call's end must wait for it."""

    @monarch.remote
    def say(i):
        print("line", i)

    view = mesh8.slice(host=1)
    for i in range(400):
        got: list = []
        say.on(view).start((i,), {}, output=got.append).result()
        texts = sorted("".join(e.text for e in got if e.rank == r) for r in view._shape.ranks)
        assert texts == [f"line {i}\n"] * 4, (i, texts)


def test_identical_errors_are_grouped_with_ranks(mesh8):
    @monarch.remote
    def fails():
        r = monarch.current_rank()
        if r["host"] == 1 and r["gpu"] == 3:
            raise KeyError("only on the last rank")
        raise ValueError("bad value")

    with pytest.raises(RemoteError) as e:
        fails.on(mesh8)()
    err = e.value
    assert err.ranks == list(range(8))
    assert [(f.ranks, f.exc_type) for f in err.failures] == [(list(range(7)), "ValueError"), ([7], "KeyError")]
    text = str(err)
    assert text.startswith("fails failed on 8 of 8 ranks")
    assert "-- ranks 0-6: ValueError: bad value" in text
    assert "-- rank 7 (host=1,gpu=3): KeyError: 'only on the last rank'" in text
    assert text.count('raise ValueError("bad value")') == 1  # shown once, with its source line
    # the workers are still alive and serve the next call
    assert len(uses_globals_and_closures.on(mesh8)(1)) == 8


def test_unpicklable_function_and_arguments_are_type_errors(mesh8):
    lock = threading.Lock()

    @monarch.remote
    def uses_lock():
        return lock.locked()

    with pytest.raises(
        TypeError, match=r"cannot send the function of .*uses_lock to the workers: cannot pickle '_thread.lock'"
    ):
        uses_lock.on(mesh8)()

    @monarch.remote
    def ident(x):
        return x

    with pytest.raises(
        TypeError, match=r"cannot send the arguments of .*ident to the workers: cannot pickle 'generator'"
    ):
        ident.on(mesh8)(i for i in range(3))
    with pytest.raises(TypeError, match="on\\(\\) needs a ProcMesh"):
        ident.on("mesh")


def test_unpicklable_result_is_a_remote_error(mesh8):
    @monarch.remote
    def gives_lock():
        return threading.Lock()

    with pytest.raises(RemoteError, match=r"the result \(lock\) cannot be pickled"):
        gives_lock.on(mesh8.slice(host=0, gpu=0))()


def test_importable_functions_go_by_reference():
    import cloudpickle

    from monarch.runtime.remote import _by_reference

    blob = cloudpickle.dumps(_by_reference(uses_globals_and_closures.__monarch_fn__))
    assert b"test_remote" in blob and b"uses_globals_and_closures" in blob and len(blob) < 200
    assert _by_reference(monarch.remote(lambda: 1).__monarch_fn__) is None


NOTEBOOK = r"""
import sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
cells = [
    "import monarch\nfrom monarch.actor import this_host\nmesh = this_host().spawn_procs({'gpu': 2})",
    "factor = 3\ndef inner(x):\n    return x / (factor - 3)\n",
    "@monarch.remote\ndef outer(x):\n    y = x + 1\n    return inner(y)\n",
    "try:\n    outer.on(mesh)(1)\nexcept monarch.RemoteError as e:\n    print('CAUGHT', e)",
    "factor = 5\nprint('CHANGED', outer.on(mesh)(1).values())\nmesh.exit()",
]
for c in cells:
    r = shell.run_cell(c)
    if r.error_in_exec or r.error_before_exec:
        sys.exit(1)
"""


def test_notebook_defined_code_shows_source_lines(tmp_path):
    """Functions defined in IPython cells: no NameError trap, and worker tracebacks show cell source."""
    script = tmp_path / "nb.py"
    script.write_text(NOTEBOOK)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "CAUGHT outer failed on 2 of 2 ranks" in out
    assert "-- ranks 0-1: ZeroDivisionError: division by zero" in out
    assert "    return inner(y)" in out
    assert "    return x / (factor - 3)" in out
    assert "NameError" not in out
    assert "CHANGED [1.0, 1.0]" in out  # globals are captured at each call
