"""A program that has not imported torch (actors only, as Monarch's examples are) gets workers that have not
either: they answer at once (one that made a live function gets them with torch, as one that imported it). The first thing that needs torch (a live function, a tensor command) has every
worker of the mesh set it up, as a mesh of a program with torch does at start; the actors go on meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_for, wait_gone

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from monarch.actor import Actor, endpoint, this_host
    import monarch

    class Probe(Actor):
        @endpoint
        def torch_here(self) -> bool:
            return "torch" in sys.modules

    procs = this_host().spawn_procs({"gpu": 4})  # (before any live function: one made first means torch)
    out = {"pids": [r["pid"] for r in procs.to_table(with_memory=False).rows]}
    probes = procs.spawn("probe", Probe)
    out["before"] = probes.torch_here.call().get().values()
    out["controller_torch"] = "torch" in sys.modules

    @monarch.remote
    def first_torch_use():
        import torch.distributed as dist
        return dist.is_initialized() and dist.get_world_size()  # every rank's group, though one rank runs this

    @monarch.remote
    def set_up():
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        return torch.initial_seed(), torch.get_num_threads(), t.item()

    out["slice_alone"] = first_torch_use.on(procs.slice(gpu=0))().values()
    out["after"] = set_up.on(procs)().values()
    out["actors_after"] = probes.torch_here.call().get().values()
    import torch
    with procs.activate():
        t = torch.ones(3) * 2
        out["engine"] = monarch.inspect(t.sum()).tolist()
    more = this_host().spawn_procs({"gpu": 2})  # a program with live functions (and torch): set up at start
    out["more"] = more.spawn("probe", Probe).torch_here.call().get().values()
    print(json.dumps(out), flush=True)
    more.stop().get()
    procs.stop().get()
    """
)


def test_a_program_without_torch_gets_workers_without_it_until_something_needs_it(tmp_path):
    script = tmp_path / "actors_only.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = p.communicate(timeout=150)
    assert p.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["controller_torch"] is False
    assert out["before"] == [False] * 4  # the actors answered from workers that never imported torch
    assert out["slice_alone"] == [4]  # set up on every rank, though one rank ran the first torch code
    seeds = {seed for seed, _, _ in out["after"]}
    assert len(seeds) == 4  # each worker its own RNG, as at start
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 4))  # as at start
    assert [(n, total) for _, n, total in out["after"]] == [(threads, 4.0)] * 4
    assert out["actors_after"] == [True] * 4
    assert out["engine"] == 6.0
    assert out["more"] == [True, True]
    assert wait_gone(out["pids"]) == []
    wait_for(lambda: not servers_of(p.pid), what="the fork server's exit")


def servers_of(controller: int) -> list[str]:
    """The fork servers (by their titles) a controller left running."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if title.startswith("monarch fork server") and f"(controller {controller})" in title:
            found.append(title)
    return found


TORCHRUN_STYLE = textwrap.dedent(
    """
    import json, sys
    from monarch.actor import Actor, endpoint, this_host
    from monarch.spmd import setup_torch_elastic_env
    import monarch

    class Trainer(Actor):
        @endpoint
        def train(self) -> float:
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")  # from the environment, as under torchrun
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return t.item()

    procs = this_host().spawn_procs({"gpu": 3})
    trainers = procs.spawn("trainers", Trainer)
    setup_torch_elastic_env(trainers)
    out = {"train": trainers.train.call().get().values(), "controller_torch": "torch" in sys.modules}
    out["size"] = monarch.remote(lambda: __import__("torch.distributed").distributed.get_world_size()).on(procs)().values()
    try:
        monarch.remote(lambda g: g).on(procs)(procs.process_group("gpu"))
    except monarch.RemoteError as e:
        out["mesh_group"] = " ".join(str(e).split())
    print(json.dumps(out), flush=True)
    procs.stop().get()
    """
)


def test_torchrun_style_actors_keep_their_group_when_torch_is_set_up_later(tmp_path):
    """Code that made its own default group before the mesh set torch up keeps it; the mesh's groups say
    they were handed over, as on a mesh that set torch up at start."""
    script = tmp_path / "torchrun_style.py"
    script.write_text(TORCHRUN_STYLE)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["controller_torch"] is False and out["train"] == [3.0] * 3
    assert out["size"] == [3] * 3  # the script's own default group, kept
    assert "handed over to torchrun-style code" in out["mesh_group"]


LIVE_FIRST = textwrap.dedent(
    """
    import json, sys
    import monarch
    from monarch.actor import Actor, endpoint, this_host

    class Probe(Actor):
        @endpoint
        def torch_here(self) -> bool:
            return "torch" in sys.modules

    @monarch.remote
    def rank():
        import torch.distributed as dist
        return dist.get_rank()

    procs = this_host().spawn_procs({"gpu": 2})
    out = {"controller_torch": "torch" in sys.modules, "actors": procs.spawn("p", Probe).torch_here.call().get().values()}
    out["ranks"] = rank.on(procs)().values()
    print(json.dumps(out), flush=True)
    procs.stop().get()
    """
)


def test_a_program_of_live_functions_gets_workers_with_torch_set_up_at_start(tmp_path):
    script = tmp_path / "live_first.py"
    script.write_text(LIVE_FIRST)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"controller_torch": False, "actors": [True, True], "ranks": [0, 1]}
