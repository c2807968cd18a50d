"""Faults: dead workers, dead controllers, bad input. Each checks that no process is left behind."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import monarch
from monarch.actor import this_host
from monarch.runtime.common.errors import RemoteError, WorkerDiedError

from conftest import pid_alive, say_started, started, wait_for, wait_gone, worker_pids


@monarch.remote
def sleep(seconds):
    import time

    time.sleep(seconds)
    return seconds


@monarch.remote
def nap_after_saying(marker, seconds):
    say_started(marker)
    time.sleep(seconds)


@monarch.remote
def rank():
    return monarch.current_rank()["gpu"]


def test_worker_sigkill_mid_call_fails_the_call_and_mesh_respawns(tmp_path):
    mesh = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(mesh)
    marker = str(tmp_path / "started")
    fut = nap_after_saying.on(mesh).call_async(marker, 60)
    wait_for(lambda: started(marker, 4), what="the call starting on every rank")
    os.kill(pids[2], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as e:  # (not a TimeoutError: the death is noticed, from its sentinel)
        fut.result(timeout=30)
    msg = str(e.value)
    assert "rank 2 (gpu=2) of mesh {gpu: 4} killed by SIGKILL (kill -9, or the kernel's out-of-memory killer)" in msg
    assert e.value.ranks == [2]
    assert wait_gone(pids) == []  # the rest of the mesh was stopped, nothing hangs in a collective
    assert mesh.status() == ["stopped", "stopped", "failed", "stopped"]
    with pytest.raises(WorkerDiedError, match="rank 2"):
        rank.on(mesh)()  # later calls say why, at once
    fresh = mesh.respawn()
    assert rank.on(fresh)().values() == [0, 1, 2, 3]
    new_pids = worker_pids(fresh)
    fresh.exit()
    assert wait_gone(new_pids) == []


def test_segfault_and_exit_status_are_named():
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)

    @monarch.remote
    def crash():
        import ctypes

        if monarch.current_rank()["gpu"] == 1:
            ctypes.string_at(0)
        time.sleep(30)

    with pytest.raises(
        WorkerDiedError, match=r"rank 1 \(gpu=1\) of mesh \{gpu: 2\} crashed with SIGSEGV \(segmentation fault\)"
    ) as e:
        crash.on(mesh)()
    # where: ctypes' function, called from the user's line (from the stacks faulthandler wrote as it died)
    assert " in string_at (__init__.py, line " in str(e.value)
    line = next(n for n, text in enumerate(open(__file__), 1) if "ctypes.string_at(0)" in text)
    assert f"called from crash ({__file__}, line {line})" in " ".join(str(e.value).split())
    assert wait_gone(pids) == []

    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)

    @monarch.remote
    def quit():
        os._exit(3)

    with pytest.raises(WorkerDiedError, match="exited with status 3"):
        quit.on(mesh.slice(gpu=0))()
    assert wait_gone(pids) == []


def test_exit_is_idempotent_and_later_use_is_explained():
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    view = mesh.slice(gpu=1)
    view.exit()  # a view stops the workers it shares
    mesh.exit()
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match=r"mesh \{gpu: 2\} is stopped; spawn a new one \(mesh.respawn\(\)\)"):
        rank.on(mesh)()


def test_user_exceptions_keep_workers_alive(mesh8):
    @monarch.remote
    def boom():
        raise SystemExit(2)  # even SystemExit and KeyboardInterrupt are reported, not fatal

    pids = worker_pids(mesh8)
    with pytest.raises(RemoteError, match="SystemExit"):
        boom.on(mesh8)()
    assert all(pid_alive(p) for p in pids) and len(rank.on(mesh8)()) == 8


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"gpu": 0}, "mesh dimension 'gpu' has size 0; sizes must be positive integers"),
        ({"gpu": 2.5}, "mesh dimension 'gpu' has size 2.5"),
        ([8], "mesh sizes must be a non-empty dict like {'gpu': 8}, got [8]"),
        ({"1gpu": 2}, "invalid mesh dimension name '1gpu'"),
    ],
)
def test_bad_spawn_sizes(sizes, message):
    with pytest.raises(ValueError) as e:
        this_host().spawn_procs(sizes)
    assert message in str(e.value)


CONTROLLER = textwrap.dedent(
    """
    import glob, os, sys, time
    from monarch.actor import this_host
    import monarch

    mesh = this_host().spawn_procs({"gpu": 8})
    pids = [r["pid"] for r in mesh.to_table().rows]
    marker = os.path.join(sys.argv[1], "busy")

    @monarch.remote
    def busy():
        import torch
        open(f"{marker}.{monarch.current_rank()['gpu']}", "w").close()
        t = torch.randn(256, 256)
        while True:  # busy in C code (a matmul), not asleep
            t = torch.tanh(t @ t)

    fut = busy.on(mesh).call_async()
    while len(glob.glob(marker + ".*")) < 8:  # every worker is in the loop
        time.sleep(0.01)
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(60)
    """
)


def _forkserver_children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _dirs_of(pid: int) -> list[str]:
    """Our temporary directories (sockets, the fork server's address) whose owner is `pid`."""
    root, out = tempfile.gettempdir(), []
    for name in os.listdir(root):
        if name.startswith("monarch-"):
            try:
                with open(os.path.join(root, name, "owner")) as f:
                    if f.read().split()[0] == str(pid):
                        out.append(os.path.join(root, name))
            except OSError:
                pass
    return out


def test_controller_sigkill_takes_every_busy_worker_down_and_the_next_start_cleans_up(tmp_path):
    """Workers busy in C code used to outlive a killed controller by 1.8-5.7 s (the fork server's slow
    interpreter shutdown). Each now watches the controller itself (benchmarks/controller_death.py reports
    how long they take; here, a generous bound only guards against a hang)."""
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 8 and all(pid_alive(p) for p in pids)
        helpers = _forkserver_children(proc.pid)  # the fork server, resource tracker
        left = _dirs_of(proc.pid)
        assert len(left) == 2  # its sockets' directory and its fork server's
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert wait_gone(pids, 30) == [], "workers outlived their controller"
        assert wait_gone(helpers, 30) == []
        assert all(os.path.isdir(d) for d in left)  # a SIGKILL cleans nothing...
        subprocess.run(
            [sys.executable, "-c", "from monarch.actor import this_host; this_host().spawn_procs({'gpu': 1}).exit()"],
            check=True,
            timeout=120,
        )
        assert not any(os.path.exists(d) for d in left)  # ...the next controller to start does
    finally:
        proc.kill()
        proc.wait()


INTERRUPTED = textwrap.dedent(
    """
    import glob, signal, sys, threading, time, os
    import monarch
    from monarch.actor import this_host

    mesh = this_host().spawn_procs({"gpu": 2})
    marker = sys.argv[1]

    @monarch.remote
    def busy(marker):
        import os, time
        open(f"{marker}.{os.getpid()}", "w").close()
        time.sleep(30)

    def ctrl_c_once_both_run():  # (once the call runs on both workers, not after a fixed delay)
        while len(glob.glob(marker + ".*")) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_both_run, daemon=True).start()
    try:
        busy.on(mesh)(marker)
    except KeyboardInterrupt as e:
        print("INTERRUPTED", "time.sleep(30)" in str(e), flush=True)
    @monarch.remote
    def ok():
        return 1
    print("NEXT", ok.on(mesh)().values(), flush=True)
    mesh.exit()
    """
)


def test_ctrl_c_interrupts_workers_and_they_stay_alive(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPTED)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "busy")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "INTERRUPTED True" in r.stdout  # ended by the interrupt, showing where the workers were
    assert "NEXT [1, 1]" in r.stdout


def test_ctrl_c_is_held_until_a_multi_frame_message_is_out():
    """A command of several frames cut short would swallow the next one (workers drop both): Ctrl-C
    during its send is delivered right after the last frame."""
    from monarch.runtime.wire.hold import HOLD, _Swap

    before = signal.getsignal(signal.SIGINT)
    done = []
    signal.signal(signal.SIGINT, HOLD.handler)  # (a controller installs it over Python's default handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            assert HOLD.enter()
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the signal arrives here, between two frames
                done.append("last frame sent")
            finally:
                HOLD.leave()
        assert done == ["last frame sent"]
    finally:
        signal.signal(signal.SIGINT, before)
    # where another handler is set, the slow way does the same and puts that handler back
    with pytest.raises(KeyboardInterrupt):
        with _Swap():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("last frame sent again")
    assert done[-1] == "last frame sent again"
    assert signal.getsignal(signal.SIGINT) is before
    # it is used only where Ctrl-C would run Python code: a handler that is a function, on the main thread
    assert _Swap.needed()
    off_main: list = []
    thread = threading.Thread(target=lambda: off_main.append(_Swap.needed()))
    thread.start()
    thread.join()
    assert off_main == [False]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a background job's: nothing can interrupt a send)
    try:
        assert not _Swap.needed()
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_a_reply_is_being_handled_does_not_lose_it(tmp_path, monkeypatch):
    """Ctrl-C that lands while the waiting thread checks a large reply of another call: that call still
    completes (the interrupt is held until the reply is handled)."""
    from monarch.runtime.controller import Controller
    from monarch.runtime.wire import codec

    mesh = this_host().spawn_procs({"gpu": 2})
    gate = tmp_path / "reply-now"

    @monarch.remote
    def big(gate):
        import torch

        while not os.path.exists(gate):  # (replies once `slow` is waited for: the waiting thread takes them)
            time.sleep(0.01)
        return torch.ones(16_000_000)  # 64 MB: its signature check takes tens of ms

    @monarch.remote
    def slow():
        time.sleep(30)

    sign, pressed = codec._sign, []

    def press_ctrl_c_during_the_check(key, parts):
        # Pressed from inside the check itself: a thread looking for it from outside could miss those few ms
        # on a loaded machine (and then nothing would interrupt `slow`).
        names, f = [], sys._getframe()
        while f is not None:
            names.append(f.f_code.co_name)
            f = f.f_back
        if not pressed and sum(len(p) for p in parts) > 1 << 20 and "_receive_messages" in names:
            pressed.append(threading.current_thread().name)
            os.kill(os.getpid(), signal.SIGINT)
        return sign(key, parts)

    def open_the_gate_once_slow_is_waited_for():
        def waiting() -> bool:
            f = sys._current_frames().get(threading.main_thread().ident)
            while f is not None and f.f_code is not Controller.wait.__code__:
                f = f.f_back
            return f is not None

        wait_for(waiting, what="the wait for slow")
        gate.touch()

    monkeypatch.setattr(codec, "_sign", press_ctrl_c_during_the_check)
    try:
        pending = big.on(mesh).call_async(str(gate))
        threading.Thread(target=open_the_gate_once_slow_is_waited_for, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            slow.on(mesh)()
        assert pressed == ["MainThread"]  # (the waiting thread, checking a reply of `big`)
        assert [float(t.sum()) for t in pending.result(timeout=30).values()] == [16e6, 16e6]
    finally:
        monkeypatch.undo()
        mesh.exit()


def test_ctrl_c_on_a_call_queued_behind_another_threads_call_leaves_that_call_alone(tmp_path):
    """Two threads call one mesh; Ctrl-C on the call still queued behind the other thread's interrupts
    only that call: the running one completes, the queued one never runs, and its function stays
    shipped for the next call."""
    import threading

    from monarch.runtime.controller import Controller

    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    marker, after = tmp_path / "ran", tmp_path / "ran-after"
    marks = str(tmp_path / "slow")
    release = tmp_path / "release"

    @monarch.remote
    def slow(marks, release):
        say_started(marks)
        while not os.path.exists(release):  # (busy until the test has interrupted the queued call)
            time.sleep(0.01)
        return "slow done"

    @monarch.remote
    def touch(path):
        open(path, "a").close()
        return "touched"

    def waiting_for_its_call(ident: int) -> bool:
        """Whether thread `ident` is in the controller's wait for a call (sent, its replies awaited)."""
        f = sys._current_frames().get(ident)
        while f is not None and f.f_code is not Controller.wait.__code__:
            f = f.f_back
        return f is not None

    def ctrl_c_once_the_queued_call_waits():  # (not after a fixed delay)
        wait_for(lambda: waiting_for_its_call(threading.main_thread().ident), what="the queued call's wait")
        os.kill(os.getpid(), signal.SIGINT)

    try:
        results = []
        other = threading.Thread(target=lambda: results.append(slow.on(mesh)(marks, str(release)).values()))
        other.start()
        wait_for(lambda: started(marks, 2), what="slow running on both workers")
        threading.Thread(target=ctrl_c_once_the_queued_call_waits, daemon=True).start()
        try:
            with pytest.raises(
                KeyboardInterrupt, match="ranks 0-1 are busy with an earlier call and will skip this one"
            ):
                touch.on(mesh)(str(marker))
        finally:
            release.touch()
        other.join(30)
        assert results == [["slow done", "slow done"]]  # the other thread's call was not interrupted
        # each worker takes calls in order: once the next one has run, the interrupted one has been passed
        assert touch.on(mesh)(str(after)).values() == ["touched", "touched"]  # (its function stays shipped)
        assert after.exists() and not marker.exists()  # the interrupted call was skipped
    finally:
        mesh.exit()
    assert wait_gone(pids) == []


def test_ctrl_c_while_a_call_starts_interrupts_it_on_the_workers(tmp_path):
    """Ctrl-C that lands after a call was sent but before its caller waits (here: in a mesh view's callback,
    in a `Thread.start()` as the kernel's mesh table does) interrupts the call on the workers, as one during
    the wait does; it is not raised bare with the workers left running. Both ways of holding Ctrl-C: under
    the controller's own handler, and under another (ipykernel puts Python's default one back per cell)."""
    from monarch.runtime.common.errors import RemoteInterrupt

    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    presses: list[int] = []
    armed = threading.Event()  # (once per call: not again while the interrupted call is waited for)

    def press_as_the_call_starts() -> None:
        if threading.current_thread() is threading.main_thread() and armed.is_set() and mesh_busy():
            armed.clear()
            presses.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # (delivered before kill() returns; its handler runs at the next call)
            threading.Thread(target=lambda: None).start()  # an untimed wait for the thread to run, where Ctrl-C lands

    def mesh_busy() -> bool:
        return any(s == "busy" for s in mesh.status())

    assert sleep.on(mesh)(0).values() == [0, 0]  # (shipped: what is interrupted is the call, not a slow first load)
    stop = mesh.on_change(press_as_the_call_starts)
    before = signal.getsignal(signal.SIGINT)
    try:
        for handler in (before, signal.default_int_handler):
            signal.signal(signal.SIGINT, handler)
            got: BaseException | None = None
            armed.set()
            try:
                sleep.on(mesh)(30)
            except KeyboardInterrupt as e:  # (caught whole: a bare one reaching pytest would end the session)
                got = e
            assert isinstance(got, RemoteInterrupt), repr(got)
            # Each worker said where it was: in the sleep, or (still on its way to it on a loaded machine) before
            # it started; either is right, and neither is left busy.
            assert got.busy == [] and sorted(r for f in got.failures for r in f.ranks) == [0, 1], str(got)
            assert rank.on(mesh)().values() == [0, 1]  # the workers are not left sleeping (not "mesh busy")
        assert len(presses) == 2
    finally:
        stop()
        signal.signal(signal.SIGINT, before)
        mesh.exit()
    assert wait_gone(pids) == []
