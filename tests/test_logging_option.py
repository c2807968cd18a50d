"""`ProcMesh.logging_option`: output streamed or to a file, lines repeated across ranks collapsed."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

import monarch

from conftest import REPO, wait_for

pytestmark = pytest.mark.timeout(120)


@monarch.remote
def chatter():
    r = monarch.current_rank()["gpu"]
    for _ in range(3):
        print("same line", flush=True)
    print(f"distinct {r}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)


@monarch.remote
def chatter_then_wait(release: str):
    import time

    print("before the wait", flush=True)
    while not os.path.exists(release):
        time.sleep(0.01)
    print(f"after the wait {monarch.current_rank()['gpu']}", flush=True)


@pytest.fixture(scope="module")
def procs():
    from conftest import _spawned

    yield from _spawned({"gpu": 4})


@pytest.fixture
def logs(procs):
    """The module's mesh; its logging options back to the defaults afterwards."""
    yield procs
    procs.logging_option(stream_to_client=True, aggregate_window_sec=None)


# -- the collapsing itself (no processes) ----------------------------------------------------------


def _take(events):
    from monarch.runtime.controller.aggregate import _Held
    from monarch.runtime.controller.output import OutputEvent

    held = _Held(print)
    seq = iter(range(10**6)).__next__
    for rank, stream, text in events:
        held.add(OutputEvent(1, 0, rank, f"gpu={rank}", stream, text), seq)
    return [(e.rank, e.stream, e.text) for e in held.take(0)]


def test_similar_lines_collapse_and_each_ranks_order_is_kept():
    got = _take(
        [(r, "stdout", "loss 2.31\n") for r in range(8)]
        + [(0, "stdout", "only zero\n")]
        + [(r, "stdout", " loss 2.31 \n") for r in range(1, 8)]  # blanks at the ends aside, the same
        + [(0, "stdout", "loss 2.31\n")]
    )
    assert got == [  # rank 0's line between the two is shown between them
        (-1, "stdout", "[8 similar lines, ranks 0-7] loss 2.31\n"),
        (0, "stdout", "only zero\n"),
        (-1, "stdout", "[8 similar lines, ranks 0-7] loss 2.31\n"),
    ]
    # lines in different orders on two ranks: each rank's order holds, nothing is lost
    got = _take([(0, "stdout", "a\n"), (0, "stdout", "b\n"), (1, "stdout", "b\n"), (1, "stdout", "a\n")])
    assert got == [(0, "stdout", "a\n"), (-1, "stdout", "[2 similar lines, ranks 0-1] b\n"), (1, "stdout", "a\n")]
    # streams are told apart; one rank repeating itself is not collapsed
    got = _take([(0, "stdout", "x\n"), (1, "stderr", "x\n"), (2, "stdout", "y\ny\n")])
    assert got == [(0, "stdout", "x\n"), (1, "stderr", "x\n"), (2, "stdout", "y\ny\n")]


def test_half_lines_are_joined_and_let_go_at_the_end():
    got = _take([(0, "stdout", "hel"), (1, "stdout", "hello\n"), (0, "stdout", "lo\nrest")])
    assert got == [(-1, "stdout", "[2 similar lines, ranks 0-1] hello\n"), (0, "stdout", "rest")]


# -- a script's mesh ---------------------------------------------------------------------------------


def test_aggregation_collapses_repeated_lines_with_their_ranks(logs, capfd):
    logs.logging_option(stream_to_client=True, aggregate_window_sec=60)  # (held until the call ends)
    chatter.on(logs)()
    out, err = capfd.readouterr()
    assert "[12 similar lines, ranks 0-3] same line\n" in out, out
    assert "[gpu=0] same line" not in out
    for g in range(4):
        assert f"[gpu={g}] distinct {g}\n" in out
    assert "[4 similar lines, ranks 0-3] to stderr\n" in err, err
    assert out.index("similar lines") < out.index("distinct")  # each rank's order


def test_without_aggregation_output_is_unchanged(logs, capfd):
    logs.logging_option(aggregate_window_sec=60)
    logs.logging_option(aggregate_window_sec=None)  # off again
    chatter.on(logs)()
    out, err = capfd.readouterr()
    assert "similar" not in out + err
    for g in range(4):
        assert out.count(f"[gpu={g}] same line\n") == 3
        assert f"[gpu={g}] distinct {g}\n" in out
        assert f"[gpu={g}] to stderr\n" in err


def test_the_window_lets_lines_go_while_the_call_runs(logs, capfd, tmp_path):
    logs.logging_option(aggregate_window_sec=0.2)
    release = str(tmp_path / "release")
    fut = chatter_then_wait.on(logs).call_async(release)
    seen = []

    def shown() -> int:  # "before the wait" lines accounted for, collapsed or not
        seen.append(capfd.readouterr().out)
        text = "".join(seen)
        collapsed = sum(
            int(n) for n in re.findall(r"^\[(\d+) similar lines, ranks [-0-9, ]+\] before the wait$", text, re.M)
        )
        return collapsed + len(re.findall(r"^\[gpu=\d\] before the wait$", text, re.M))

    wait_for(lambda: shown() == 4, 30, "the held lines shown when the window ended")
    assert not fut.done()
    open(release, "w").close()
    fut.result()
    text = "".join(seen) + capfd.readouterr().out
    for g in range(4):
        assert f"[gpu={g}] after the wait {g}\n" in text


def test_not_streamed_goes_to_a_file_whose_path_is_said(logs, capfd):
    option = logs.logging_option(stream_to_client=False)
    chatter.on(logs)()
    out, err = capfd.readouterr()
    assert "same line" not in out and "to stderr" not in err
    assert option.path is not None and f"goes to {option.path}" in err
    with open(option.path) as f:
        saved = f.read()
    for g in range(4):
        assert saved.count(f"[gpu={g}] same line\n") == 3 and f"[gpu={g}] to stderr\n" in saved
    logs.logging_option(stream_to_client=False)  # the path is said once
    assert "goes to" not in capfd.readouterr().err
    logs.logging_option(stream_to_client=True)
    chatter.on(logs)()
    assert "[gpu=1] distinct 1\n" in capfd.readouterr().out


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"aggregate_window_sec": -1}, ValueError, "aggregate_window_sec=-1): give seconds >= 0"),
        ({"aggregate_window_sec": float("nan")}, ValueError, "aggregate_window_sec=nan)"),
        ({"aggregate_window_sec": "3"}, TypeError, "aggregate_window_sec='3'): give seconds"),
        ({"aggregate_window_sec": True}, TypeError, "aggregate_window_sec=True)"),
        ({"stream_to_client": 1}, TypeError, "stream_to_client=1): give True"),
        ({"stream_to_client": "yes"}, TypeError, "stream_to_client='yes')"),
        ({"windows": 3}, TypeError, "unexpected keyword argument(s) windows; it takes stream_to_client"),
        ({"level": 20}, TypeError, "level: the workers' log levels"),
    ],
)
def test_bad_options_say_what_is_allowed(logs, kwargs, error, message):
    with pytest.raises(error) as e:
        logs.logging_option(**kwargs)
    assert message in str(e.value)
    assert logs.spawned.logs is None or logs.spawned.logs.window is None  # nothing was applied


def test_awaitable_or_not(logs, capfd):
    assert asyncio.run(logs.logging_option(stream_to_client=True, aggregate_window_sec=60)) is None

    async def main():
        return await logs.logging_option(aggregate_window_sec=60)

    assert asyncio.run(main()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        option = logs.logging_option(aggregate_window_sec=60)  # never awaited: applied, and no warning
        assert "aggregate_window_sec=60" in repr(option)
        del option
        gc.collect()
    chatter.on(logs)()
    assert "[12 similar lines, ranks 0-3] same line\n" in capfd.readouterr().out


def test_a_script_as_in_monarchs_guide():
    script = textwrap.dedent(
        """
        import asyncio
        import monarch
        from monarch.actor import this_host

        @monarch.remote
        def step():
            print("loss 2.31")
            print(f"rank {monarch.current_rank()['gpu']} done")

        procs = this_host().spawn_procs({"gpu": 4})
        asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=3))
        step.on(procs)()
        print("end of script")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, cwd=REPO, check=True
    ).stdout
    assert "[4 similar lines, ranks 0-3] loss 2.31\n" in out, out
    assert "[gpu=2] rank 2 done\n" in out
    assert out.index("similar lines") < out.index("end of script")  # the call's end let the lines go


# -- a notebook ---------------------------------------------------------------------------------------


def test_kernel_cell_and_live_call_show_the_collapsed_line():
    from helpers.kernel_client import monarch_kernel

    with monarch_kernel() as k:
        r = k.run(
            "import monarch\nfrom monarch.actor import this_host\nprocs = this_host().spawn_procs({'gpu': 4})\n"
            "await procs.logging_option(stream_to_client=True, aggregate_window_sec=60)"
        )
        assert r.status == "ok", r.text()
        r = k.run("%%mesh procs\nfor _ in range(3):\n    print('same line')\nprint(f'distinct {rank}')")
        assert r.status == "ok", r.text()
        live = r.custom_items()
        assert [it["t"] for it in live if it["r"] == -1] == ["[12 similar lines, ranks 0-3] same line\n"]
        assert not any("same line" in it["t"] for it in live if it["r"] != -1)
        (final,) = r.final_outputs()
        text = final["text/plain"]
        assert "[aggregated] [12 similar lines, ranks 0-3] same line" in text, text
        for g in range(4):
            assert f"[gpu={g}] distinct {g}" in text
        assert 'data-label="aggregated"' in final["text/html"]
        # a live function's output (labelled lines in the cell's stream)
        r = k.run("@monarch.remote\ndef hi():\n    print('hi there')\nhi.on(procs)()\nNone")
        assert r.status == "ok", r.text()
        streamed = "".join(m["content"]["text"] for m in r.of("stream"))
        assert "[4 similar lines, ranks 0-3] hi there\n" in streamed, streamed
        assert k.run("procs.exit()").status == "ok"
