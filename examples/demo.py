"""A tour of the runtime on a local mesh (CPU workers when there is no GPU): ./run demo"""

import time

import torch
import torch.distributed as dist

import monarch
from monarch.actor import this_host


@monarch.remote
def where_am_i():
    info = monarch.current_rank()
    print(f"hello from {info}")
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@monarch.remote
def all_reduce(group):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return t.item()


def main() -> None:
    t0 = time.perf_counter()
    mesh = this_host().spawn_procs({"host": 2, "gpu": 4})
    print(f"spawned 8 workers in {time.perf_counter() - t0:.2f} s")
    print(mesh.to_table())
    print(where_am_i.on(mesh)())
    print("sum of ranks along gpu:", all_reduce.on(mesh)(mesh.process_group("gpu")))
    stages = mesh.split(host=("dp", "pp"), gpu=("tp",), pp=2)
    print("pp=1 stage:", stages.slice(pp=1).to_table())
    try:
        monarch.remote(lambda: 1 / 0).on(mesh)()
    except monarch.RemoteError as e:
        print("a remote error, shown once for all ranks:\n", e)
    mesh.exit()


if __name__ == "__main__":
    main()
