"""Settings: every MONARCH_* knob read once, bad values named with what is allowed."""

import os
import pathlib

import pytest

from monarch.runtime.common.config import Settings, from_env


def test_defaults_and_values_read_from_the_environment():
    assert from_env({}) == Settings()
    s = from_env({"MONARCH_TRANSPORT": "tcp", "MONARCH_BIND_ADDR": "10.0.0.2", "MONARCH_SPIN_US": "250",
                  "MONARCH_SEND_HWM": "64", "MONARCH_GROUP_TIMEOUT": "30"})  # fmt: skip
    assert (s.transport, s.bind_addr, s.spin, s.send_hwm, s.group_timeout) == ("tcp", "10.0.0.2", 0.00025, 64, 30.0)
    assert Settings().prewarm is True and from_env({"MONARCH_PREWARM": "0"}).prewarm is False
    assert Settings().lanes is True and from_env({"MONARCH_LANES": "no"}).lanes is False
    assert Settings().worker_nice == 0 and from_env({"MONARCH_WORKER_NICE": "10"}).worker_nice == 10
    assert Settings().worker_spin == 0.0005 and from_env({"MONARCH_WORKER_SPIN_US": "50"}).worker_spin == 0.00005
    assert from_env({"MONARCH_WORKER_SPIN_US": "0"}).worker_spin == 0
    assert Settings().bundle_wait == 0.002 and from_env({"MONARCH_BUNDLE_WAIT_US": "0"}).bundle_wait == 0
    assert Settings().bundle_above == 64 and from_env({"MONARCH_BUNDLE_ABOVE": "0"}).bundle_above == 0
    assert Settings().heartbeat_timeout == 6 and from_env({"MONARCH_HEARTBEAT_TIMEOUT": "60"}).heartbeat_timeout == 60
    assert Settings().rack_above == 64 and from_env({"MONARCH_RACK_ABOVE": "0"}).rack_above == 0
    assert Settings().rack_size == 16 and from_env({"MONARCH_RACK_SIZE": "4"}).rack_size == 4


NICE = "give an integer from 0 (the controller's priority) to 19"


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("MONARCH_TRANSPORT", "udp", "MONARCH_TRANSPORT='udp'; use 'ipc' (one machine) or 'tcp' (across hosts)"),
        ("MONARCH_SPAWN_TIMEOUT", "soon", "MONARCH_SPAWN_TIMEOUT='soon' is not a number; give a number >= 1"),
        ("MONARCH_SEND_HWM", "0", "MONARCH_SEND_HWM='0' is too small; give an integer >= 1"),
        ("MONARCH_FROZEN_AFTER", "-1", "MONARCH_FROZEN_AFTER='-1' is too small; give a number >= 0"),
        ("MONARCH_WORKER_SPIN_US", "-5", "MONARCH_WORKER_SPIN_US='-5' is too small; give a number >= 0"),
        ("MONARCH_WORKER_SPIN_US", "long", "MONARCH_WORKER_SPIN_US='long' is not a number; give a number >= 0"),
        ("MONARCH_PREWARM", "maybe", "MONARCH_PREWARM='maybe'; use 1 (start the fork server with the kernel) or 0"),
        ("MONARCH_WORKER_NICE", "20", f"MONARCH_WORKER_NICE='20'; {NICE}"),
        ("MONARCH_WORKER_NICE", "-5", f"MONARCH_WORKER_NICE='-5'; {NICE}"),
        ("MONARCH_WORKER_NICE", "low", f"MONARCH_WORKER_NICE='low'; {NICE}"),
        ("MONARCH_LANES", "2", "MONARCH_LANES='2'; use 1 (local workers talk over Unix stream connections) or 0"),
        ("MONARCH_HEARTBEAT_TIMEOUT", "0", "MONARCH_HEARTBEAT_TIMEOUT='0' is too small; give a number >= 1"),
        ("MONARCH_RACK_SIZE", "1", "MONARCH_RACK_SIZE='1' is too small; give an integer >= 2"),
        ("MONARCH_RACK_ABOVE", "many", "MONARCH_RACK_ABOVE='many' is not an integer; give an integer >= 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_allowed(var, value, message):
    with pytest.raises(ValueError) as e:
        from_env({var: value})
    assert str(e.value) == message


def test_every_knob_is_read_in_config_py_alone():
    """No module but `common/config.py` reads a `MONARCH_*` variable from the environment."""
    import ast

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for top in ("runtime", "kernel", "extension", "widgets", "monarch"):
        for d, _, files in os.walk(os.path.join(repo, top)):
            for f in files:
                path = os.path.join(d, f)
                if not f.endswith(".py") or os.path.relpath(path, repo) == os.path.join(
                    "runtime", "common", "config.py"
                ):
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    # os.environ.get("MONARCH_X"), os.getenv("MONARCH_X"), os.environ["MONARCH_X"]
                    if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
                        arg = node.args[0]
                        if node.func.attr in ("get", "getenv") and isinstance(arg, ast.Constant):
                            if str(arg.value).startswith("MONARCH_"):
                                found.append(f"{path}:{node.lineno}")
                    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                        if str(node.slice.value).startswith("MONARCH_") and isinstance(node.ctx, ast.Load):
                            found.append(f"{path}:{node.lineno}")
    assert found == []


def test_the_knobs_read_when_used_follow_the_environment(monkeypatch, tmp_path):
    from monarch.runtime.common import config

    monkeypatch.setenv("MONARCH_JOBS_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("MONARCH_SIM_PROFILES", str(tmp_path / "sim"))
    monkeypatch.setenv("MONARCH_LOG", " INFO ")
    assert (config.jobs_dir(), config.sim_profiles_dir(), config.log_level_name()) == (
        tmp_path / "jobs", tmp_path / "sim", "info",
    )  # fmt: skip
    monkeypatch.delenv("MONARCH_JOBS_DIR")
    assert config.jobs_dir() == pathlib.Path.home() / ".monarch" / "jobs"


def test_a_link_pings_three_times_a_timeout_and_tells_its_peer_the_timeout():
    """`heartbeat` sets ZeroMQ's heartbeats from the timeout: a ping every third of it (a silent peer is noticed
    within a ping's interval plus the timeout), and the timeout the peer applies to us (TTL)."""
    import zmq

    from monarch.runtime.wire.links import heartbeat

    ctx = zmq.Context()
    try:
        for timeout, ivl in ((6.0, 2000), (60.0, 20000), (1.5, 500)):
            sock = ctx.socket(zmq.DEALER)
            heartbeat(sock, timeout)
            got = [sock.getsockopt(o) for o in (zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL)]
            sock.close(0)
            assert got == [ivl, int(timeout * 1000), int(timeout * 1000)]
    finally:
        ctx.term()
