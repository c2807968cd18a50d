"""`python -m monarch.runtime.agent --job-dir DIR`: a host agent, as Slurm's `srun` starts one per host.

It finds its index in the job from Slurm (`SLURM_NODEID`), listens on this host's address (`--bind ADDR`, or
that of `--interface IF`, or else the first interface that is up and not loopback), writes itself down in
the job's directory, and serves until the job ends (SIGTERM: its workers are killed, its record removed).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from monarch.runtime.common.net import interface_addr


def pick_address(bind: str | None, interface: str | None) -> tuple[str, str]:
    """(address, interface) to listen on: as given, or the first interface that has an IPv4 address and is
    not loopback. Never all interfaces."""
    if bind:
        for _, name in socket.if_nameindex():
            if interface_addr(name) == bind:
                return bind, name
        return bind, interface or ""
    names = [interface] if interface else [n for _, n in socket.if_nameindex() if n != "lo"]
    for name in names:
        addr = interface_addr(name)
        if addr and not addr.startswith("127."):
            return addr, name
    raise SystemExit(f"monarch agent: no network interface with an IPv4 address among {names} (give --bind ADDR)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m monarch.runtime.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--job-dir", required=True, help="the job's directory (holds its secret; shared with controllers)")
    ap.add_argument("--index", type=int, help="this host's index in the job (default: $SLURM_NODEID)")
    ap.add_argument("--bind", help="the address to listen on (default: that of --interface or the first one up)")
    ap.add_argument("--interface", help="the network interface to listen on and to give workers' gloo/NCCL")
    ap.add_argument("--workspace", default="", help="this host's copy of the job's workspace ('auto': one in /tmp)")
    args = ap.parse_args(argv)
    index = args.index if args.index is not None else int(os.environ.get("SLURM_NODEID", "0"))
    addr, iface = pick_address(args.bind, args.interface)

    from monarch.runtime.agent.agent import Agent, AgentConfig
    from monarch.runtime.common.config import settings

    workspace = args.workspace
    if workspace == "auto":  # this host's own copy (hosts that share a disk still get one each)
        import tempfile

        name = os.path.basename(os.path.normpath(args.job_dir))
        workspace = os.path.join(tempfile.gettempdir(), f"monarch-ws-{name}-{socket.gethostname()}")
    if workspace:
        os.makedirs(workspace, mode=0o700, exist_ok=True)
    agent = Agent(AgentConfig(args.job_dir, index, addr, iface, workspace), settings())

    def stop(signum, frame) -> None:
        agent.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    agent.register()
    print(f"monarch agent {index} on {agent.record.host} listens on {addr} ({iface})", file=sys.stderr, flush=True)
    agent.serve()
