"""Imported once by the fork server, so that workers forked from it start in milliseconds."""

import atexit
import os

from monarch.runtime.worker import worker  # noqa: F401  (imports torch and everything a worker runs)
from monarch.runtime.worker.main import name_process

name_process(f"monarch fork server (controller {os.getppid()})", "monarch forksrv")

# The fork server exits when its controller is gone. Its interpreter shutdown with torch loaded takes
# seconds; nothing in it needs cleaning up, so the first exit handler ends it at once. (Workers forked
# from it inherit the handler but end with os._exit, which runs none.)
atexit.register(os._exit, 0)
