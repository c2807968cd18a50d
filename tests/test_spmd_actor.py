"""`monarch.spmd.SPMDActor`: a script written for torchrun, run on a mesh's processes as Monarch's spmd_ddp example
runs it, gives what the same script gives under torchrun (the same losses for DDP and FSDP2, the same
environment), runs again on the same processes, fails with the failing rank's traceback without leaving the
others in a collective, and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

import monarch
from monarch.actor import this_host
from monarch.spmd import SPMDActor, setup_torch_elastic_env, setup_torch_elastic_env_async

from conftest import REPO, wait_gone, worker_pids

SCRIPT = os.path.join(REPO, "tests", "helpers", "spmd_train.py")
COMPARED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE")  # fmt: skip
"""torchrun's variables SPMDActor sets as torchrun does (its ROLE_NAME is Monarch's "rank", not "default")."""


@pytest.fixture(scope="module")
def procs():
    """Two workers, started in the checkout (as `torchrun` is run below: `-m` finds `examples`) with one thread
    each, as torchrun gives its processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        mp.setenv("OMP_NUM_THREADS", "1")
        mesh = this_host().spawn_procs(per_host={"gpus": 2})
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


@pytest.fixture(scope="module")
def actors(procs):
    return procs.spawn("_SPMDActor", SPMDActor)


TEARDOWN_ABORT = "terminate called without an active exception"
"""What gloo's threads say when a peer's connection closes under them as torch's process group is destroyed: seen
once under torchrun on a loaded machine, after every rank had written its results."""


def torchrun(
    args: list[str], nproc: int = 2, timeout: float = 120, written: list | None = None
) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N ...` from the checkout, one thread per process. With
    `written` (the files that say each rank finished its work), a rank aborted by gloo at teardown after they were
    all written still counts as the reference run it is (the comparison is of what they hold)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    torn_down = written is not None and TEARDOWN_ABORT in done.stdout + done.stderr and all(f.exists() for f in written)
    assert done.returncode == 0 or torn_down, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def read(out, n: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def run_main(actors, procs, script_args: list[str]):
    """Monarch's spmd_ddp.py, as it is: the first point's host and port, then `main` on every actor."""
    first_values = dict.fromkeys(procs._labels, 0)
    master_addr, master_port = actors.slice(**first_values).get_host_port.call_one(None).get()
    return actors.main.call(master_addr, master_port, script_args).get().values()


def test_ddp_and_fsdp2_give_torchruns_losses_and_environment_and_run_again(procs, actors, tmp_path):
    (tmp_path / "torchrun").mkdir()
    out = tmp_path / "torchrun"
    torchrun([SCRIPT, "--out", str(out)], written=[out / f"rank{r}.json" for r in range(2)])
    expected = read(tmp_path / "torchrun")

    (tmp_path / "spmd").mkdir()
    assert run_main(actors, procs, [SCRIPT, "--out", str(tmp_path / "spmd")]) == [True, True]
    got = read(tmp_path / "spmd")
    for mine, theirs in zip(got, expected):
        assert mine["ddp"] == theirs["ddp"] and mine["fsdp"] == theirs["fsdp"]  # bit for bit
        assert {k: mine["env"][k] for k in COMPARED} == {k: theirs["env"][k] for k in COMPARED}
        assert mine["env"]["ROLE_NAME"] == "rank" and mine["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert mine["name"] == theirs["name"] == "__main__"
        assert mine["argv"] == [SCRIPT, "--out", str(tmp_path / "spmd")] and theirs["argv"][:2] == [SCRIPT, "--out"]
    assert got[0]["ddp"] != got[1]["ddp"]  # (each rank trains on its own data: a swap would show)
    assert len({g["env"]["MASTER_PORT"] for g in got}) == 1

    # again on the same processes, the script as a module this time (`python -m` under torchrun)
    (tmp_path / "again").mkdir()
    assert run_main(actors, procs, ["-m", "helpers.spmd_train", "--out", str(tmp_path / "again")]) == [True] * 2
    again = read(tmp_path / "again")
    assert [g["ddp"] for g in again] == [g["ddp"] for g in expected]
    assert [g["fsdp"] for g in again] == [g["fsdp"] for g in expected]
    assert again[0]["argv"] == [SCRIPT, "--out", str(tmp_path / "again")]  # argv[0]: the module's file, as -m


@pytest.mark.parametrize("where", ["start", "step"])
def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_others_are_released(
    procs, actors, tmp_path, where
):
    """The others wait for the failed rank in DDP's constructor (`start`) or in its backward (`step`: in C++,
    no torch.distributed frame on their stack): released all the same, as torchrun ends them."""
    with pytest.raises(monarch.RemoteError) as e:
        run_main(actors, procs, [SCRIPT, "--out", str(tmp_path), "--fail-rank", "1", "--fail-at", where])
    text = str(e.value)
    assert "rank 1 (gpus=1): ValueError: rank 1 fails on purpose" in text, text
    assert f'File "{SCRIPT}", line' in text and "in main" in text  # the script's own frames
    assert "runpy" not in text  # (not the plumbing's)
    assert e.value.ranks == [1] and [r.rank for r in e.value.released] == [0], text
    assert "rank 0 was released from the script's collectives at" in text, text
    assert run_main(actors, procs, [SCRIPT, "--out", str(tmp_path)]) == [True, True]  # and it runs again
    assert len(read(tmp_path)) == 2


def test_sys_exit_zero_is_success_and_another_status_fails(procs, actors, tmp_path):
    assert run_main(actors, procs, [SCRIPT, "--out", str(tmp_path), "--exit", "0"]) == [True, True]
    with pytest.raises(monarch.RemoteError, match=r"ranks 0-1: RuntimeError: .*spmd_train.py exited with status 3"):
        run_main(actors, procs, [SCRIPT, "--out", str(tmp_path), "--exit", "3"])


def test_bad_script_arguments_say_what_is_expected(procs, actors):
    with pytest.raises(monarch.RemoteError, match=r"ValueError: script_args=\[\]: no script or module specified"):
        actors.main.call("127.0.0.1", 29500, []).get()
    with pytest.raises(monarch.RemoteError, match=r"FileNotFoundError: no script 'nope.py' on host"):
        actors.main.call("127.0.0.1", 29500, ["nope.py"]).get()
    with pytest.raises(monarch.RemoteError, match=r"TypeError: script_args must be a list of strings"):
        actors.main.call("127.0.0.1", 29500, "train.py").get()
    with pytest.raises(monarch.RemoteError, match=r"ValueError: master_port must be a port number"):
        actors.main.call("127.0.0.1", "29500", [SCRIPT]).get()
    with pytest.raises(monarch.RemoteError, match=r"ValueError: use_ipaddr='IPv5'"):
        actors.slice(gpus=0).get_host_port.call_one("IPv5").get()


def test_nanogpt_unchanged_gives_torchruns_losses(procs, actors, tmp_path):
    """examples/nanogpt/train.py, a karpathy-style script for torchrun, as a module, a few steps."""
    args = ["-m", "examples.nanogpt.train", "--config", "tiny", "--max_iters", "4", "--eval_interval", "4",
            "--eval_iters", "1", "--batch_size", "8", "--log_interval", "0"]  # fmt: skip
    torchrun([*args, "--json", str(tmp_path / "torchrun.json")])
    assert run_main(actors, procs, [*args, "--json", str(tmp_path / "spmd.json")]) == [True, True]
    theirs, mine = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("torchrun", "spmd"))
    assert mine["mode"] == theirs["mode"] == "torchrun" and mine["world"] == 2 and mine["steps"] == 4
    assert (mine["loss"], mine["train_loss"], mine["val_loss"]) == (
        theirs["loss"], theirs["train_loss"], theirs["val_loss"])  # fmt: skip


def test_setup_torch_elastic_env_takes_monarchs_arguments_and_hands_the_groups_over():
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    pids = worker_pids(mesh)
    try:
        with pytest.raises(ValueError, match=r"master_addr='h', master_port=None: give both"):
            setup_torch_elastic_env(mesh, "h")
        envs = asyncio.run(setup_torch_elastic_env_async(mesh))
        assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
            ("0", "0", "2", "0"), ("1", "1", "2", "0")]  # fmt: skip
        envs = setup_torch_elastic_env(mesh, "127.0.0.1", 29511)
        assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", "29511")}

        @monarch.remote
        def environment():
            return os.environ["MASTER_PORT"], os.environ["RANK"]

        assert environment.on(mesh)().values() == [("29511", "0"), ("29511", "1")]
        with pytest.raises(monarch.RemoteError, match=r"handed over to torchrun-style code"):
            monarch.remote(lambda g: g).on(mesh)(mesh.process_group("gpus"))
        with pytest.raises(TypeError, match=r"setup_torch_elastic_env\(\) needs a ProcMesh"):
            setup_torch_elastic_env("mesh")
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
