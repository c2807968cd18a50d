"""Imported once by the fork server of a program that has not imported torch: the worker without torch, which
runs actors at once (torch is imported when something needs it: `WorkerStart.torch`)."""

import atexit
import gc
import os

from monarch.runtime.worker import actors, worker  # noqa: F401
from monarch.runtime.worker.main import name_process

name_process(f"monarch fork server, no torch (controller {os.getppid()})", "monarch forksrv")
gc.collect()  # (as preload's: no worker's collection walks what is preloaded)
gc.freeze()
atexit.register(os._exit, 0)  # (as preload's: nothing to clean up)
