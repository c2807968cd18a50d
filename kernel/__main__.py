"""``python -m monarch.kernel -f CONNECTION_FILE`` runs the kernel; ``python -m monarch.kernel install`` registers it."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "install":
        from monarch.kernel.install import main as install

        install(sys.argv[2:])
        return
    from ipykernel.kernelapp import IPKernelApp

    from monarch.kernel.kernel import MonarchKernel

    IPKernelApp.launch_instance(kernel_class=MonarchKernel)


if __name__ == "__main__":
    main()
