"""The Monarch kernel: IPython with `%%mesh` preloaded and one controller for the kernel's lifetime."""

from __future__ import annotations

import inspect

from ipykernel.ipkernel import IPythonKernel

from monarch.kernel import DISPLAY_NAME

HISTORY_BATCH = 20
"""Cells of input history kept in memory before IPython writes them to its database."""


class MonarchKernel(IPythonKernel):
    """ipykernel's IPython kernel plus the monarch extension.

    Workers outlive cell errors and interrupts (the extension forwards interrupts to busy
    workers); shutdown and restart stop every worker; if this process is killed outright, the
    workers notice and exit by themselves.
    """

    implementation = "monarch"
    banner = f"{DISPLAY_NAME}: %%mesh gpu=N runs a cell on N workers"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shell.extension_manager.load_extension("monarch.extension")
        from monarch.runtime.controller import prewarm

        prewarm()  # the workers' fork server imports torch while the user writes the first cell
        history = self.shell.history_manager
        if history is not None and history.db_cache_size == 0:
            # Write input history in batches (and at shutdown), not once per cell: on a small
            # machine the per-cell SQLite write competes with the workers for the cores.
            history.db_cache_size = HISTORY_BATCH

    def do_complete(self, code: str, cursor_pos: int):
        """Inside a ``%%mesh`` cell, names from the workers' namespace; elsewhere IPython's completion."""
        from monarch.extension.complete import complete
        from monarch.extension.magics import magics_of

        magics = magics_of(self.shell)
        try:
            reply = complete(magics, code, cursor_pos) if magics is not None else None
        except Exception:  # completion must never break the kernel: fall back to IPython's
            reply = None
        return reply if reply is not None else super().do_complete(code, cursor_pos)

    async def do_shutdown(self, restart: bool):
        from monarch.runtime.controller import current

        controller = current()
        if controller is not None:
            controller.shutdown()
        reply = super().do_shutdown(restart)
        return await reply if inspect.isawaitable(reply) else reply
