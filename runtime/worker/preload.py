"""Imported once by the fork server, so that workers forked from it start in milliseconds: the worker, torch
and what sets torch up (`worker.setup_torch`)."""

import atexit
import gc
import os

import torch  # noqa: F401

from monarch.runtime.worker import groups, worker  # noqa: F401
from monarch.runtime.worker.engine import commands, streams  # noqa: F401
from monarch.runtime.worker.main import name_process

name_process(f"monarch fork server (controller {os.getppid()})", "monarch forksrv")

# Workers must never walk the preloaded objects in a garbage collection: a walk touches every page they sit on,
# and each page touched is copied (copy-on-write) in every worker. Whether a worker's first allocations set off a
# full collection depended on where the counters stood as the fork server finished loading (a second mesh of 8
# took 0.12 s or 0.55 s by that alone): the preloaded objects are moved out of the collector's sight.
gc.collect()
gc.freeze()

# The fork server exits when its controller is gone. Its interpreter shutdown with torch loaded takes
# seconds; nothing in it needs cleaning up, so the first exit handler ends it at once. (Workers forked
# from it inherit the handler but end with os._exit, which runs none.)
atexit.register(os._exit, 0)
