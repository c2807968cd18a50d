"""Workers' stdin outside a kernel: input() served by the script's terminal, one rank at a time; pdb too
where the script debugger (`monarch debug`, tests/test_script_debugger.py) cannot start."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, wait_for

SCRIPT = textwrap.dedent(
    """
    import monarch
    from monarch.actor import this_host

    @monarch.remote
    def debug_me():
        x = monarch.current_rank()["gpu"] * 7
        breakpoint()
        return x

    @monarch.remote
    def ask():
        return input("name? ")

    mesh = this_host().spawn_procs({"gpu": 2})
    print("RESULT", debug_me.on(mesh)().values(), flush=True)
    print("NAMES", sorted(ask.on(mesh)().values()), flush=True)
    mesh.exit()
    """
)


@pytest.mark.timeout(60)
def test_pdb_and_input_use_the_terminal_in_a_script_whose_debugger_cannot_start(tmp_path):
    script = tmp_path / "debug_script.py"
    script.write_text(SCRIPT)
    # the debugger's directory is open to others: refused, and the terminal serves pdb instead
    (tmp_path / "run" / "monarch").mkdir(parents=True)
    os.chmod(tmp_path / "run" / "monarch", 0o755)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "run"))
    # each rank's pdb session: "p x + 1000", then "c"; then each rank's input(): a name
    answers = "p x + 1000\nc\np x + 1000\nc\nalice\nbob\n"
    out = subprocess.run(
        [sys.executable, str(script)], input=answers, capture_output=True, text=True, cwd=REPO, timeout=50, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("the script debugger cannot start") == 1, out.stderr
    assert "has mode 0o755: others can reach it; make it private (chmod 700" in out.stderr
    text = out.stdout
    assert "RESULT [0, 7]" in text and "NAMES ['alice', 'bob']" in text, text
    # prompts are labelled with the rank, and a rank's pdb session ends before the other's starts
    order = re.findall(r"\[(gpu=\d)\] \(Pdb\) ", text)
    assert len(order) == 4 and order[0] == order[1] and order[2] == order[3] != order[0], text
    assert "[gpu=0] 1000" in text and "[gpu=1] 1007" in text
    assert text.count("name? ") == 2


@pytest.mark.timeout(60)
def test_two_waiting_threads_serve_one_prompt_at_a_time():
    """Two threads wait on calls that each ask for input: the prompts are answered one after the
    other, as a terminal or a notebook input box can only take one."""
    import threading

    import monarch
    from monarch.actor import this_host
    from monarch.runtime.controller import get_controller

    @monarch.remote
    def ask():
        return input("value? ")

    m1, m2 = this_host().spawn_procs({"gpu": 1}), this_host().spawn_procs({"gpu": 1})
    ctl = get_controller()
    saved = ctl.stdin.prompt
    open_now, most, lock, typed = [0], [0], threading.Lock(), []

    def one_box(req):
        with lock:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
        if not typed:  # the user typing, until the other call asks too (a box it opened meanwhile would count)
            wait_for(lambda: ctl.stdin.waiting(), what="the other call's prompt, queued")
        with lock:
            open_now[0] -= 1
            typed.append(req.rank)
        return "typed"

    ctl.stdin.prompt = one_box
    try:
        got = []
        ths = [threading.Thread(target=lambda m=m: got.append(ask.on(m)().values())) for m in (m1, m2)]
        [t.start() for t in ths]
        [t.join(30) for t in ths]
        assert got == [["typed"], ["typed"]] and most[0] == 1
    finally:
        ctl.stdin.prompt = saved
        m1.exit()
        m2.exit()
