"""The worker's half of `SPMDActor` (`monarch.runtime.common.spmd`, which names this module): torchrun's
environment set in this process, the worker's own process groups handed over to the script, and the script run
as ``python script.py`` or ``python -m module`` would run it, here."""

from __future__ import annotations

import os
import runpy
import socket
import sys
from typing import Any

from monarch.runtime.common.net import interface_addr
from monarch.runtime.worker import groups

ADDR_TYPES = ("Default", "IPv4", "IPv6")
"""Monarch's `monarch.tools.network.AddrType` members, by name (its enum, or the name, is accepted)."""


def host_port(use_ipaddr: Any = None) -> tuple[str, int]:
    """(address, free port) for a rendezvous on this worker's host (`SPMDActor.get_host_port`)."""
    if use_ipaddr is None:
        addr = rendezvous_addr()
    else:
        kind = getattr(use_ipaddr, "name", use_ipaddr)
        if kind not in ADDR_TYPES:
            raise ValueError(f"use_ipaddr={use_ipaddr!r}: give None, or an AddrType (or its name): {ADDR_TYPES}")
        addr = resolve(socket.gethostname(), kind)
    return addr, free_port(addr)


def rendezvous_addr() -> str:
    """The address of the interface this worker's process groups use (a job's host: its agent's interface,
    `GLOO_SOCKET_IFNAME`), which the other hosts reach; loopback for a mesh on this one machine."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    return (interface_addr(interface) if interface else None) or "127.0.0.1"


def resolve(hostname: str, kind: str) -> str:
    """`hostname` as an IPv6 (or, for "Default", IPv4 if there is none) or IPv4 address, not link-local."""
    import ipaddress

    families = {"IPv4": [socket.AF_INET], "IPv6": [socket.AF_INET6]}.get(kind, [socket.AF_INET6, socket.AF_INET])
    for family in families:
        try:
            found = socket.getaddrinfo(hostname, None, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        for *_, sockaddr in found:
            if not ipaddress.ip_address(sockaddr[0]).is_link_local:
                return str(sockaddr[0])
    raise RuntimeError(f"host {hostname!r} resolves to no {kind} address (use_ipaddr=None takes the mesh's own)")


def free_port(addr: str) -> int:
    """A port free on `addr` now (the script's rank 0 serves its TCPStore there soon after, as in Monarch)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def set_env(env: dict[str, str]) -> dict[str, str]:
    """Set torchrun's variables `env` in this process and hand the worker's own process groups over (torch
    allows one default group: the next `init_process_group()` here makes it from `env`); returns `env`."""
    os.environ.update(env)
    hand_over()
    return env


def hand_over() -> None:
    """Give the worker's own groups up, once; the mesh's groups (`mesh.process_group`, the tensor engine's)
    then say they were handed over."""
    if groups.current is None:  # (torch not set up here yet: the groups set up later start handed over)
        groups.handed_over = True
    elif not groups.current.handed_over:
        groups.current.hand_over()


def drop_script_groups() -> None:
    """Destroy the process groups a script left behind (its default group and those made from it), as its
    process's exit would under torchrun, waiting at most a few seconds (a group broken by a failure may never
    let go)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if groups.current is not None:
        groups.current.destroy()
    else:
        dist.destroy_process_group()


def check_script_args(script_args: Any) -> list[str]:
    """`script_args` as `SPMDActor.main` takes it (``[path, *args]`` or ``["-m", module, *args]``), or a
    ValueError saying what is wrong."""
    if isinstance(script_args, str) or not isinstance(script_args, (list, tuple)):
        raise TypeError(f"script_args must be a list of strings, got {type(script_args).__name__}: {script_args!r}")
    args = list(script_args)
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise TypeError(f"script_args must be a list of strings; {bad[0]!r} is a {type(bad[0]).__name__}")
    if not args or args == ["-m"]:
        raise ValueError(
            f"script_args={args!r}: no script or module specified; give [path, *args] or ['-m', module, *args], "
            "e.g. ['train.py', '--lr', '0.1'] or ['-m', 'pkg.train']"
        )
    if args[0] != "-m" and not os.path.isfile(args[0]):
        raise FileNotFoundError(
            f"no script {args[0]!r} on host {socket.gethostname()} (this process's working directory: "
            f"{os.getcwd()}); give a path that exists on every host of the mesh, or ['-m', module]"
        )
    return args


def run_script(script_args: list[str]) -> None:
    """Run the script as torchrun's ``python`` would: ``["-m", module, *args]`` as ``python -m module args``
    (the working directory importable), ``[path, *args]`` as ``python path args`` (the script's folder
    importable), with ``__name__ == "__main__"`` and `sys.argv` set; `sys.argv` and `sys.path` are put back
    afterwards. A group the script left behind is destroyed when it returns, or before the next run if it
    failed (destroying it now would cut the other ranks off before they are released from their collective)."""
    drop_script_groups()  # (a failed run's, kept until now)
    releasable()
    argv, path = sys.argv, list(sys.path)
    try:
        if script_args[0] == "-m":
            module = script_args[1]
            sys.argv = [module, *script_args[2:]]  # (runpy puts the module's file in argv[0], as python -m)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            sys.modules.pop(module, None)  # (a fresh copy each run, as `python -m` runs: an edit shows)
            _run(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), module)
        else:
            script = script_args[0]
            sys.argv = list(script_args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            _run(lambda: runpy.run_path(script, run_name="__main__"), script)
    finally:
        sys.argv = argv
        sys.path[:] = path
    drop_script_groups()


def releasable() -> None:
    """Let the controller release the running call from wherever it is when another rank fails (not only from
    a torch.distributed function on the stack: DDP's collectives wait in C++ under `backward()`), as torchrun
    ends every rank when one fails: its connections to the other ranks are shut, so what it waits in raises."""
    from monarch.runtime.worker import control
    from monarch.runtime.worker import worker as process

    if process.current is not None and process.current.call_id is not None:
        control.anywhere = (process.current.call_id, "the script's collectives")


def _run(start: Any, what: str) -> None:
    """Run `start()`; `SystemExit` with status 0 (or None) is success, another status a RuntimeError."""
    try:
        start()
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return
        raise RuntimeError(f"{what} exited with status {e.code!r} (sys.exit)") from script_error(e)


def script_error(e: BaseException) -> BaseException:
    """`e` with the frames of this module, of `SPMDActor` and of runpy left out of its traceback: it starts at
    the script's own frame (`SPMDActor.main` raises it again from there)."""
    tb = e.__traceback__
    while tb is not None and _plumbing(tb.tb_frame):
        tb = tb.tb_next
    if e.__cause__ is not None:
        script_error(e.__cause__)
    return e.with_traceback(tb)


def _plumbing(frame: Any) -> bool:
    return frame.f_globals.get("__name__") in ("runpy", __name__, "monarch.runtime.common.spmd")
