"""A worker that crashes (SIGABRT, SIGSEGV) says where: its cause of death names the function and line its failing
thread was in, from the stacks Python's faulthandler wrote to a file of its own as it died (its stderr pipe died
with it)."""

from __future__ import annotations

import glob
import os
import textwrap

import pytest

import monarch
from monarch.actor import this_host
from monarch.runtime.common import last_words
from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.controller import get_controller

from conftest import wait_gone, worker_pids

pytestmark = pytest.mark.timeout(120)


def crash_here():
    os.abort()  # (the line the cause names)


@monarch.remote
def crash_on_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        crash_here()
    return 1


def test_a_worker_that_aborts_is_reported_with_the_line_it_died_at():
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    try:
        with pytest.raises(WorkerDiedError) as e:
            crash_on_one.on(mesh)()
        line = crash_here.__code__.co_firstlineno + 1
        assert (
            f"rank 1 (gpu=1) of mesh {{gpu: 2}} aborted (SIGABRT) in crash_here ({__file__}, line {line})"
            in " ".join(str(e.value).split())
        ), str(e.value)
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
    procs = get_controller().backend.procs
    assert glob.glob(os.path.join(procs.dir, f"last-words-{mesh.spawned.mesh_id}-*")) == []  # (not left behind)


def test_the_words_name_the_innermost_place_and_the_users_own(tmp_path):
    """The failing thread's innermost frame (here a library's), then the innermost frame of the user's code."""
    (tmp_path / "last-words-3-1").write_text(
        textwrap.dedent(
            """\
            Fatal Python error: Aborted

            Thread 0x00007f0000000001 (most recent call first):
              File "/usr/lib/python3.11/threading.py", line 320 in wait

            Current thread 0x00007f0000000002 (most recent call first):
              File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2087 in destroy_process_group
              File "/v/lib/python3.11/site-packages/monarch/runtime/worker/groups.py", line 99 in destroy
              File "/home/me/train.py", line 12 in step
              File "/home/me/train.py", line 30 in main

            Extension modules: numpy (total: 1)
            """
        )
    )
    words = last_words.read(str(tmp_path), 3, 1)
    assert words == (
        " in destroy_process_group (distributed_c10d.py, line 2087), called from step (/home/me/train.py, line 12)"
    )
    assert last_words.read(str(tmp_path), 3, 2) == ""  # (nothing written: it did not crash in Python)
    named = last_words.read(
        str(tmp_path), 3, 1, lambda f, n, fn: f"Cell In[4], line {n}, in {fn}" if "me" in f else None
    )
    assert named.endswith("called from Cell In[4], line 12, in step")
