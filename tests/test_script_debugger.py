"""The script debugger (issue 13): a plain script's workers paused in pdb wait for `monarch debug`, which
lists them, attaches to one, casts a command to several and continues them all; and MONARCH_LOG.

Every script runs as a real process with real workers; the client runs under a pseudo-terminal, as a
person at a terminal meets it. Each test checks that no worker is left."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pexpect
import pytest

from conftest import REPO, wait_for, wait_gone

PROMPT = "monarch_dbg> "

MAIN_SCRIPT = """
import monarch
from monarch.actor import this_host


@monarch.remote
def work():
    rank = monarch.current_rank()["gpu"]
    x = rank * 7 + 1
    if rank in (1, 3):
        breakpoint()
    print("finishing", rank)
    return x


mesh = this_host().spawn_procs({"gpu": NGPU})
print("PIDS", " ".join(str(row["pid"]) for row in mesh.to_table().rows), flush=True)
print("RESULT", work.on(mesh)().values(), flush=True)
mesh.exit()
"""


class Script:
    """A script run as its own process; its stdout and stderr read as they come."""

    def __init__(self, path, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(path), *args], cwd=REPO, env=env, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.out = {"stdout": "", "stderr": ""}
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for t in self._readers:
            t.start()

    def _read(self, name: str, stream) -> None:
        for line in stream:
            self.out[name] += line

    def wait_for(self, name: str, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            ended = self.proc.poll() is not None
            if ended:  # (what it wrote last: read to the end of its output)
                for t in self._readers:
                    t.join(timeout)
            m = re.search(pattern, self.out[name])
            if m:
                return m
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the script's {name}:\n{self.out['stdout']}\n{self.out['stderr']}")

    def worker_pids(self) -> list[int]:
        return [int(p) for p in self.wait_for("stdout", r"PIDS ([\d ]+)\n").group(1).split()]

    def finish(self, timeout: float = 30) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:
            t.join(30)
        return rc


@pytest.fixture
def run_dir():
    """A short $XDG_RUNTIME_DIR of this test's own (socket paths must stay under 108 bytes), so that the
    client finds only this test's script."""
    path = tempfile.mkdtemp(prefix="mdbg-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(run_dir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=run_dir, **extra)
    env.pop("MONARCH_LOG", None)
    env.update(extra)
    return env


def _start(tmp_path, run_dir: str, ngpu: int, **env: str) -> tuple[Script, list[int]]:
    path = tmp_path / "script.py"
    path.write_text(MAIN_SCRIPT.replace("NGPU", str(ngpu)))
    script = Script(path, _env(run_dir, **env))
    return script, script.worker_pids()


def _client(run_dir: str, *args: str) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable, ["-m", "monarch", "debug", *args], cwd=REPO, env=_env(run_dir), encoding="utf-8",
        timeout=30, dimensions=(40, 200),
    )  # fmt: skip


def _say(client: pexpect.spawn, line: str, *expected: str) -> str:
    """Type `line`; expect each of `expected` (regular expressions) in order, then the next prompt.
    Returns what came back."""
    client.sendline(line)
    seen = ""
    for pattern in expected:
        client.expect(pattern)
        seen += client.before + client.after
    client.expect_exact(PROMPT)
    return seen + client.before


@pytest.mark.timeout(60)
def test_a_script_paused_on_ranks_1_and_3_is_listed_attached_cast_to_and_continued(tmp_path, run_dir):
    script, pids = _start(tmp_path, run_dir, 4)
    try:
        # both ranks say once where they paused; only the first says how to attach
        script.wait_for("stderr", r"rank 3 \(gpu=3\) paused in pdb at script\.py:\d+")
        err = script.out["stderr"]
        first = (
            r"monarch: rank ([13]) \(gpu=\1\) paused in pdb at script\.py:12; attach with: python -m monarch debug\n"
        )
        assert re.search(first, err) and err.count("attach with") == 1, err
        client = _client(run_dir)
        client.expect(r"connected to .*script\.py \(pid \d+\): 2 ranks paused in pdb")
        client.expect_exact(PROMPT)

        # list: rank, coordinates, where, prompt
        listed = _say(client, "list")
        rows = re.findall(r"^(\d+)\s+(gpu=\d)\s+work\s+(script\.py:\d+)\s+\(Pdb\)\s*$", listed, re.M)
        assert [(r, c) for r, c, _ in rows] == [("1", "gpu=1"), ("3", "gpu=3")], listed

        # attach to rank 1: its pdb answers, with its own value; detach comes back
        client.sendline("attach 1")
        client.expect(r"attached to rank 1 \(gpu=1\), paused at script\.py:12")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("p x")
        client.expect(r"\r\n8\r\n")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("p rank")
        client.expect(r"\r\n1\r\n")
        client.expect_exact("[gpu=1] (Pdb) ")
        _say(client, "detach")

        # cast to rank 3 only: its value, labelled
        out = _say(client, "cast ranks(3) p x * 10", r"\[gpu=3\] 220\r\n")
        assert "gpu=1" not in out, out
        # a selection by coordinates reaches both
        out = _say(client, "cast ranks(gpu=0:4) p x + 1000")
        assert "[gpu=1] 1008" in out and "[gpu=3] 1022" in out, out

        # continue: every paused rank goes on, the script finishes with every rank's result
        _say(client, "continue", r"continued: rank 1 \(gpu=1\), rank 3 \(gpu=3\)")
        assert script.finish() == 0, script.out["stderr"]
        assert "RESULT [1, 8, 15, 22]" in script.out["stdout"], script.out["stdout"]
        assert "[gpu=1] finishing 1" in script.out["stdout"] and "[gpu=3] finishing 3" in script.out["stdout"]
        # the terminal saw the debugged ranks' output too; no runtime log lines by default
        assert "[gpu=3] 220" in script.out["stdout"]
        assert "monarch[" not in script.out["stderr"], script.out["stderr"]
        # the script is gone: the client says so at the next command and ends; the socket is removed
        client.sendline("list")
        client.expect(r"closed the connection")
        client.expect(pexpect.EOF)
        assert os.listdir(os.path.join(run_dir, "monarch")) == []
    finally:
        script.finish(10)
    assert wait_gone(pids) == []


@pytest.mark.timeout(60)
def test_mistakes_get_a_clear_message_and_a_client_that_leaves_leaves_the_ranks_paused(tmp_path, run_dir):
    script, pids = _start(tmp_path, run_dir, 2)
    try:
        script.wait_for("stderr", r"attach with: python -m monarch debug")
        client = _client(run_dir)
        client.expect_exact(PROMPT)
        paused = r"paused: 1 \(gpu=1\)"
        for line, message in [
            ("frobnicate", r"unknown command 'frobnicate'; commands: list, attach \[<actor>\] <rank>, cast \[<actor>\] <ranks> <pdb command>, continue, help, quit"),
            ("p x", r"unknown command 'p'.*\(pdb commands go to a rank: attach <rank>, or cast <ranks> <command>\)"),
            ("attach 0", r"rank 0 is not paused; " + paused),
            ("attach one", r"attach takes a rank number, e.g. attach 1 or attach <actor> 1; " + paused),
            ("attach", r"attach takes one rank: attach <rank> or attach <actor> <rank> \[mesh=<id>\]; " + paused),
            ("attach work 1 2", r"attach takes one rank: attach <rank> or attach <actor> <rank>"),
            ("attach nobody 1", r"no paused rank runs actor 'nobody'; the paused ranks run: work"),
            ("cast 1 p x", r"cast needs ranks\(...\) or \* \(after the actor's name, if any\), then a pdb command; e.g. cast ranks\(1,3\) p x"),
            ("cast nobody ranks(1) p x", r"no paused rank runs actor 'nobody'"),
            ("cast ranks(1)", r"cast needs a pdb command after ranks\(1\)"),
            ("cast ranks(1 p x", r"ranks\( has no closing \)"),
            ("cast ranks(0) p x", r"rank 0 is not paused; " + paused),
            ("cast ranks(gpu=5:9) p x", r"no paused rank matches ranks\(gpu=5:9\); " + paused),
            ("cast ranks(host=0) p x", r"ranks\(host=0\): no dimension host; the mesh has gpu"),
            ("cast ranks(a:b) p x", r"ranks\(a:b\): 'a:b' is not a number or a range a:b or a:b:step"),
            ("cast ranks(0:4:0) p x", r"ranks\(0:4:0\): '0:4:0' has step 0; a step is 1 or more"),
            ("cast ranks(gpu=(1,3) p x", r"ranks\( has no closing \)"),
            ("cast ranks(gpu=()) p x", r"ranks\(gpu=\(\)\): \(\) lists no value"),
            ("detach", r"not attached to a rank; attach <rank> first"),
        ]:  # fmt: skip
            out = _say(client, line, message)
            assert "Traceback" not in out, out
        assert "attach (a) [<actor>] <rank>" in _say(client, "help")

        # a second client while one is attached is turned away, saying why
        second = _client(run_dir)
        second.expect(r"refused: another monarch debug client is attached to this script")
        second.expect(pexpect.EOF)
        second.close()
        assert second.exitstatus == 1

        # another user cannot reach the socket: the directory is private (0700), and one that can get
        # through it (as root can) is still turned away by the server's check of who connects
        if os.getuid() == 0 and shutil.which("setpriv"):
            sock = os.path.join(run_dir, "monarch", os.listdir(os.path.join(run_dir, "monarch"))[0])
            probe = (
                "import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('REFUSED', type(e).__name__); raise SystemExit\n"
                "s.settimeout(30)\nprint('GOT', repr(s.recv(100)))\n"
            )  # fmt: skip
            as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            out = subprocess.run([*as_nobody, sys.executable, "-c", probe, sock], capture_output=True, text=True)
            assert "REFUSED PermissionError" in out.stdout, out
            caps = ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
            out = subprocess.run([*as_nobody, *caps, sys.executable, "-c", probe, sock], capture_output=True, text=True)
            assert "GOT b''" in out.stdout, out  # connected, then closed without a word

        # quit: the client leaves, the rank stays paused for the next client
        client.sendline("quit")
        client.expect(pexpect.EOF)
        client = _client(run_dir)
        client.expect(r"1 rank paused in pdb")
        client.expect_exact(PROMPT)
        # a rank that runs on while attached: the client says so and comes back
        client.sendline("attach 1")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("c")
        client.expect(r"rank 1 \(gpu=1\) continued: it is no longer paused")
        client.expect_exact(PROMPT)
        assert script.finish() == 0, script.out["stderr"]
        assert "RESULT [1, 8]" in script.out["stdout"]
        client.sendline("quit")
        client.expect(pexpect.EOF)
    finally:
        script.finish(10)
    assert wait_gone(pids) == []


@pytest.mark.timeout(30)
def test_the_client_with_no_paused_script_says_so_and_exits_1(run_dir):
    out = subprocess.run(
        [sys.executable, "-m", "monarch", "debug"], capture_output=True, text=True, env=_env(run_dir), cwd=REPO
    )
    assert out.returncode == 1
    assert f"monarch debug: no monarch script has a rank paused in pdb (looked in {run_dir}/monarch)" in out.stderr
    os.mkdir(os.path.join(run_dir, "monarch"), 0o700)
    out = subprocess.run(
        [sys.executable, "-m", "monarch", "debug", "--pid", "1"], capture_output=True, text=True, env=_env(run_dir)
    )
    assert out.returncode == 1 and "no monarch script with pid 1 waits for a debugger" in out.stderr, out.stderr
    # Monarch's --host/--port (its TCP server) are refused, saying what to type instead
    out = subprocess.run(
        [sys.executable, "-m", "monarch", "debug", "--port", "27000"], capture_output=True, text=True, env=_env(run_dir)
    )
    assert out.returncode == 2 and "--host and --port name Monarch's TCP debug server" in out.stderr, out.stderr
    assert "type 'monarch debug' (with --pid PID when several scripts wait)" in out.stderr
    # a socket left by a script that was killed is removed, and does not count
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(run_dir, "monarch", f"debug-{gone.stdout.strip()}.sock")
    socket.socket(socket.AF_UNIX).bind(stale)
    out = subprocess.run([sys.executable, "-m", "monarch", "debug"], capture_output=True, text=True, env=_env(run_dir))
    assert out.returncode == 1 and "no monarch script has a rank paused" in out.stderr
    assert not os.path.exists(stale)
    # the client never trusts a directory others can reach: it says so and stops
    os.chmod(os.path.join(run_dir, "monarch"), 0o755)
    out = subprocess.run([sys.executable, "-m", "monarch", "debug"], capture_output=True, text=True, env=_env(run_dir))
    assert out.returncode == 1 and "has mode 0o755: others can reach it; make it private" in out.stderr, out.stderr
    # the client (and `import monarch`) stay light: no torch, zmq or IPython
    light = "import sys, monarch, monarch.__main__, monarch.runtime.tools.debugger; print(sorted({'torch', 'zmq', 'IPython'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", light], capture_output=True, text=True).stdout == "[]\n"


@pytest.mark.timeout(30)
def test_the_debuggers_directory_is_refused_when_a_link_or_someone_elses_or_open_to_others(run_dir, monkeypatch):
    from monarch.runtime.wire import debug as debugwire

    monkeypatch.setenv("XDG_RUNTIME_DIR", run_dir)
    path = os.path.join(run_dir, "monarch")
    made = debugwire.private_dir(create=True)
    assert made == path and os.stat(path).st_mode & 0o777 == 0o700
    os.chmod(path, 0o750)
    with pytest.raises(debugwire.UnsafeDirError, match="has mode 0o750: others can reach it"):
        debugwire.private_dir(create=True)
    os.rmdir(path)
    os.mkdir(os.path.join(run_dir, "elsewhere"), 0o700)
    os.symlink(os.path.join(run_dir, "elsewhere"), path)  # an attacker's link to a directory they read
    with pytest.raises(debugwire.UnsafeDirError, match="is a symbolic link"):
        debugwire.private_dir(create=True)
    os.unlink(path)
    if os.getuid() == 0:
        os.mkdir(path, 0o700)
        os.chown(path, 65534, 65534)
        with pytest.raises(debugwire.UnsafeDirError, match="belongs to uid 65534, not to you"):
            debugwire.private_dir(create=True)


LOG_SCRIPT = """
import monarch
from monarch.actor import this_host


@monarch.remote
def work():
    return monarch.current_rank()["gpu"]


mesh = this_host().spawn_procs({"gpu": 2})
print("PIDS", " ".join(str(row["pid"]) for row in mesh.to_table().rows), flush=True)
print("RESULT", work.on(mesh)().values(), flush=True)
mesh.exit()
"""


def _run_logged(tmp_path, value: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    path = tmp_path / "logged.py"
    path.write_text(LOG_SCRIPT)
    env = dict(os.environ, MONARCH_LOG=value)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=50)
    pids = [int(p) for p in re.search(r"PIDS ([\d ]+)\n", out.stdout).group(1).split()]
    return out, pids


@pytest.mark.timeout(60)
def test_monarch_log_info_tells_what_the_controller_and_the_workers_do(tmp_path):
    out, pids = _run_logged(tmp_path, "info")
    assert out.returncode == 0 and "RESULT [0, 1]" in out.stdout, out.stderr
    err = out.stderr
    assert re.search(r"^monarch\[controller\] [\d:.]+ INFO mesh 0 \{gpu: 2\}: starting 2 workers$", err, re.M), err
    assert re.search(r"^monarch\[controller\] [\d:.]+ INFO mesh 0: 2 workers ready in \d+\.\d\d s$", err, re.M), err
    for rank in (0, 1):
        line = rf"^\[gpu={rank}\] monarch\[worker gpu={rank}\] [\d:.]+ INFO ready: rank {rank}, pid \d+, device cpu$"
        assert re.search(line, err, re.M), err
        assert f"[gpu={rank}] monarch[worker gpu={rank}]" in err and "exiting, as the controller asked" in err
    assert re.search(r"^monarch\[controller\] .* INFO mesh 0 stopped", err, re.M), err
    assert "DEBUG" not in err  # (calls are logged at debug only)
    assert wait_gone(pids) == []


@pytest.mark.timeout(60)
def test_a_bad_monarch_log_value_warns_once_naming_the_allowed_values(tmp_path):
    out, pids = _run_logged(tmp_path, "verbose")
    assert out.returncode == 0 and "RESULT [0, 1]" in out.stdout, out.stderr
    warning = "MONARCH_LOG='verbose' is not one of debug, info, warning; using warning"
    assert out.stderr.count(warning) == 1, out.stderr  # the controller's; workers stay quiet
    assert re.search(r"^monarch\[controller\] [\d:.]+ WARNING " + re.escape(warning), out.stderr, re.M)
    assert " INFO " not in out.stderr
    assert wait_gone(pids) == []


INTERRUPTED_SCRIPT = """
import os, sys, time
import monarch
from monarch.actor import this_host


@monarch.remote
def work(stop):
    x = monarch.current_rank()["gpu"] * 7 + 1
    if x == 8 and stop:
        breakpoint()
    return x


mesh = this_host().spawn_procs({"gpu": 2})
print("PIDS", " ".join(str(row["pid"]) for row in mesh.to_table().rows), flush=True)
fut = work.on(mesh).call_async(True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
fut.interrupt()
try:
    fut.result(timeout=30)
except BaseException as e:
    print("INTERRUPTED", type(e).__name__, flush=True)
while not os.path.exists(sys.argv[1] + ".go-on"):
    time.sleep(0.02)
print("AGAIN", work.on(mesh)(False).values(), flush=True)
mesh.exit()
"""


@pytest.mark.timeout(60)
def test_a_rank_whose_call_is_interrupted_drops_out_while_a_client_is_attached(tmp_path, run_dir):
    path, flag = tmp_path / "interrupted.py", tmp_path / "interrupt-now"
    path.write_text(INTERRUPTED_SCRIPT)
    script = Script(path, _env(run_dir), str(flag))
    pids = script.worker_pids()
    try:
        script.wait_for("stderr", r"attach with: python -m monarch debug")
        client = _client(run_dir)
        client.expect_exact(PROMPT)
        client.sendline("attach 1")
        client.expect_exact("[gpu=1] (Pdb) ")
        flag.touch()  # the script interrupts its call: rank 1's pdb ends with it
        script.wait_for("stdout", r"INTERRUPTED")
        client.sendline("p x")
        client.expect(r"monarch debug: rank 1 is no longer paused: its call ended\r\n")
        client.expect_exact(PROMPT)
        assert "no rank is paused" in _say(client, "list")
        # the script goes on: its next call runs; it ends, and so does the client at its next command
        (tmp_path / "interrupt-now.go-on").touch()
        assert script.finish() == 0, script.out["stderr"]
        assert "AGAIN [1, 8]" in script.out["stdout"]
        client.sendline("list")
        client.expect(pexpect.EOF)
    finally:
        script.finish(10)
    assert wait_gone(pids) == []


GUIDE_SCRIPT = """
import monarch
from monarch.actor import Actor, current_rank, endpoint, this_host


def _bad_rank():
    raise ValueError("bad rank")


def _debugee_actor_internal(rank):
    if rank % 4 == 0:
        rank += 1
        return rank
    elif rank % 4 == 1:
        rank += 2
        return rank
    elif rank % 4 == 2:
        rank += 3
        _bad_rank()
    elif rank % 4 == 3:
        rank += 4
        return rank


class DebugeeActor(Actor):
    @endpoint
    def to_debug(self):
        rank = current_rank().rank
        breakpoint()  # noqa
        return _debugee_actor_internal(rank)

    @endpoint
    def fail(self):
        raise RuntimeError("failed with no breakpoint")


@monarch.remote
def checked(n):
    seen = n * 2
    breakpoint()
    raise KeyError(seen)


if __name__ == "__main__":
    process_mesh = this_host().spawn_procs(per_host={"gpu": 4})
    print("PIDS", " ".join(str(row["pid"]) for row in process_mesh.to_table().rows), flush=True)
    debugee_mesh = process_mesh.spawn("debugee", DebugeeActor)
    try:
        print("RESULT", debugee_mesh.to_debug.call().get(), flush=True)
    except Exception as e:
        print("FAILED", e, flush=True)
    try:
        checked.on(process_mesh.slice(gpu=1))(21)
    except Exception as e:
        print("FAILED AGAIN", e, flush=True)
    try:
        debugee_mesh.fail.call().get()
    except Exception as e:
        print("FAILED THIRD", e, flush=True)
    process_mesh.exit()
"""


def _line_of(source: str, text: str) -> int:
    """The line number of `text` in `source` as a script file (its first line is 1)."""
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.timeout(90)
def test_monarchs_guide_the_failing_rank_stops_post_mortem_where_it_raised(tmp_path, run_dir):
    """Monarch's debugging guide on 4 ranks: every rank stops at its breakpoint; Monarch's commands list, attach
    and cast to them by actor name and rank ranges; after `continue` (which clears breakpoints set with `b`), the
    rank whose endpoint raises stops again, post-mortem at the raising line, and is listed so; `where`, `p`,
    `up` work there; continuing it lets the error reach the caller. A live function does the same (and `q`
    there lets the error go on too); a later call that raises with no breakpoint does not stop."""
    path = tmp_path / "script.py"
    path.write_text(GUIDE_SCRIPT)
    at_breakpoint = f"script.py:{_line_of(GUIDE_SCRIPT, 'return _debugee_actor_internal(rank)')}"  # (after it)
    raised = f"script.py:{_line_of(GUIDE_SCRIPT, 'raise ValueError')}"
    script = Script(path, _env(run_dir))
    pids = script.worker_pids()
    client = None
    try:
        wait_for(lambda: script.out["stderr"].count("paused in pdb") == 4, what="4 ranks paused")
        client = _client(run_dir)
        client.expect(r"connected to .*script\.py \(pid \d+\): 4 ranks paused in pdb")
        client.expect_exact(PROMPT)
        listed = _say(client, "list")
        rows = re.findall(r"^(\d)\s+gpu=\1\s+debugee\.to_debug\s+(\S+)\s+\(Pdb\)\s*$", listed, re.M)
        assert rows == [(str(r), at_breakpoint) for r in range(4)], listed

        # Monarch's forms: cast <actor> ranks(start:stop:step), ranks(dim=(a,b)); attach <actor> <rank>
        out = _say(client, "cast debugee ranks(0:4:2) p rank + 100")
        assert "[gpu=0] 100" in out and "[gpu=2] 102" in out and "gpu=1" not in out and "gpu=3" not in out, out
        out = _say(client, "cast debugee ranks(gpu=(1,3)) p rank * 10")
        assert "[gpu=1] 10" in out and "[gpu=3] 30" in out and "gpu=0" not in out, out
        _say(client, "cast ranks(0) b _debugee_actor_internal", r"\[gpu=0\] Breakpoint 1 at .*script\.py:\d+")
        client.sendline("a debugee 1")
        client.expect(rf"attached to rank 1 \(gpu=1\), paused at {re.escape(at_breakpoint)};")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("rank")
        client.expect(r"\r\n1\r\n")
        client.expect_exact("[gpu=1] (Pdb) ")
        _say(client, "detach")

        # continue: every rank goes on (rank 0's breakpoint cleared); rank 2 raises and stops post-mortem
        _say(client, "continue", r"continued: rank 0 \(gpu=0\), rank 1 \(gpu=1\), rank 2 \(gpu=2\), rank 3 \(gpu=3\)")
        note = "(post-mortem: ValueError: bad rank)"
        script.wait_for("stderr", rf"rank 2 \(gpu=2\) paused in pdb at {re.escape(raised)} {re.escape(note)}")
        listed = _say(client, "l")
        rows = re.findall(r"^(\d+)\s+(gpu=\d)\s+(\S+)\s+(.+?)\s+\(Pdb\)\s*$", listed, re.M)
        assert rows == [("2", "gpu=2", "debugee.to_debug", f"{raised} {note}")], listed
        client.sendline("attach debugee 2")
        client.expect(rf"attached to rank 2 \(gpu=2\), paused at {re.escape(raised)} {re.escape(note)}")
        client.expect_exact("[gpu=2] (Pdb) ")
        client.sendline("where")
        client.expect(r"script\.py\(\d+\)to_debug\(\)\r\n-> return _debugee_actor_internal\(rank\)")
        client.expect(r"> .*script\.py\(\d+\)_bad_rank\(\)\r\n-> raise ValueError\(\"bad rank\"\)")
        client.expect_exact("[gpu=2] (Pdb) ")
        client.sendline("p rank")
        client.expect(r"NameError: name 'rank' is not defined")  # (_bad_rank has none)
        client.expect_exact("[gpu=2] (Pdb) ")
        client.sendline("up")
        client.expect(r"_debugee_actor_internal\(\)\r\n-> _bad_rank\(\)")
        client.expect_exact("[gpu=2] (Pdb) ")
        client.sendline("p rank")
        client.expect(r"\r\n5\r\n")  # 2 + 3
        client.expect_exact("[gpu=2] (Pdb) ")
        client.sendline("c")
        client.expect(r"rank 2 \(gpu=2\) continued: it is no longer paused; its error goes on to the caller")
        client.expect_exact(PROMPT)
        failed = script.wait_for(
            "stdout",
            r"FAILED debugee\.to_debug failed on 1 of 4 ranks[^\n]*\n(?:.*\n)*?"
            r".*-- rank 2 \(gpu=2\): ValueError: bad rank",
        )
        assert "RESULT" not in script.out["stdout"] and failed

        # a live function, debugged, that raises: post-mortem too; `q` there lets its error go on
        checked = f"script.py:{_line_of(GUIDE_SCRIPT, 'raise KeyError(seen)')}"
        script.wait_for("stderr", rf"rank 1 \(gpu=1\) paused in pdb at {re.escape(checked)}\n")
        assert re.search(rf"^1\s+gpu=1\s+checked\s+{re.escape(checked)}\s+\(Pdb\)\s*$", _say(client, "list"), re.M)
        client.sendline("attach checked 1")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("c")
        client.expect(r"rank 1 \(gpu=1\) continued: it is no longer paused\r\n")
        client.expect_exact(PROMPT)
        script.wait_for(
            "stderr", rf"rank 1 \(gpu=1\) paused in pdb at {re.escape(checked)} \(post-mortem: KeyError: 42\)"
        )
        client.sendline("attach 1")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("p seen")
        client.expect(r"\r\n42\r\n")
        client.expect_exact("[gpu=1] (Pdb) ")
        client.sendline("q")
        client.expect(r"rank 1 \(gpu=1\) quit pdb: it is no longer paused; its error goes on to the caller")
        client.expect_exact(PROMPT)
        script.wait_for("stdout", r"FAILED AGAIN checked failed on 1 of 1 rank[^\n]*\n(?:.*\n)*?.*KeyError: 42")

        # a later call raising with no breakpoint is not held: the script ends with its error
        assert script.finish() == 0, script.out["stderr"]
        assert re.search(r"FAILED THIRD debugee\.fail failed on 4 of 4 ranks", script.out["stdout"]), script.out
        assert script.out["stderr"].count("paused in pdb") == 7, script.out["stderr"]  # 5 breakpoints, 2 post-mortems
        assert script.out["stderr"].count("post-mortem") == 2, script.out["stderr"]
        client.sendline("list")
        client.expect(pexpect.EOF)
    finally:
        if client is not None:
            client.close(force=True)
        if script.proc.poll() is None:  # (a failed test: its script may still wait)
            script.proc.kill()
        script.finish(10)
    assert wait_gone(pids) == []


NO_DEBUGGER_SCRIPT = """
import monarch
from monarch.actor import Actor, current_rank, endpoint, this_host


class Failing(Actor):
    @endpoint
    def boom(self):
        raise ValueError(f"boom on {current_rank()['gpu']}")


@monarch.remote
def broken():
    raise KeyError("broken")


mesh = this_host().spawn_procs({"gpu": 2})
print("PIDS", " ".join(str(row["pid"]) for row in mesh.to_table().rows), flush=True)
try:
    mesh.spawn("failing", Failing).boom.call().get()
except Exception as e:
    print("FAILED", e, flush=True)
try:
    broken.on(mesh)()
except Exception as e:
    print("FAILED AGAIN", e, flush=True)
mesh.exit()
"""


@pytest.mark.timeout(60)
def test_a_script_that_never_stopped_in_pdb_is_not_held_when_an_endpoint_raises(tmp_path, run_dir):
    """No breakpoint, no debugger: an endpoint's error and a live function's go straight to the caller (no
    post-mortem pause, no debugger started), as they always did."""
    path = tmp_path / "script.py"
    path.write_text(NO_DEBUGGER_SCRIPT)
    script = Script(path, _env(run_dir))
    pids = script.worker_pids()
    try:
        assert script.finish(30) == 0, script.out["stderr"]
    finally:
        script.finish(10)
    out, err = script.out["stdout"], script.out["stderr"]
    assert re.search(r"FAILED failing\.boom failed on 2 of 2 ranks", out) and "ValueError: boom on" in out, out
    assert "FAILED AGAIN broken failed on 2 of 2 ranks" in out and "KeyError: 'broken'" in out, out
    assert "pdb" not in err and "post-mortem" not in out + err, err
    assert not os.path.exists(os.path.join(run_dir, "monarch"))  # the debugger never started
    assert wait_gone(pids) == []
