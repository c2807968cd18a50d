"""Register the kernelspec: ``python -m monarch.kernel install [--user | --sys-prefix | --prefix P] [--name N]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from monarch.kernel import DISPLAY_NAME, KERNEL_NAME


def kernel_json(python: str = sys.executable, display_name: str = DISPLAY_NAME) -> dict:
    """The kernelspec, launching this interpreter (an absolute path, so any Jupyter can start it)."""
    return {
        "argv": [python, "-m", "monarch.kernel", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": False},
    }


def install(
    user: bool = False, prefix: str | None = None, name: str = KERNEL_NAME, display_name: str | None = None
) -> str:
    """Write the kernelspec where Jupyter looks; returns the directory written."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as d:
        shown = display_name or (DISPLAY_NAME if name == KERNEL_NAME else f"{DISPLAY_NAME} [{name}]")
        with open(os.path.join(d, "kernel.json"), "w") as f:
            json.dump(kernel_json(display_name=shown), f, indent=1)
        return KernelSpecManager().install_kernel_spec(d, name, user=user, prefix=prefix)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m monarch.kernel install", description="Register the Monarch kernel.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help=f"in this Python's prefix ({sys.prefix})")
    where.add_argument("--prefix", help="under PREFIX/share/jupyter/kernels")
    p.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default {KERNEL_NAME!r})")
    p.add_argument("--display-name", help=f"name shown in Jupyter (default {DISPLAY_NAME!r})")
    args = p.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix, name=args.name, display_name=args.display_name)
    print(f"Installed kernelspec {args.name} in {path}")
