"""Code written for torchrun, on a mesh (Monarch's `monarch.spmd`).

    from monarch.spmd import SPMDActor, setup_torch_elastic_env

    actors = procs.spawn("_SPMDActor", SPMDActor)
    first = dict.fromkeys(procs._labels, 0)
    addr, port = actors.slice(**first).get_host_port.call_one(None).get()
    actors.main.call(addr, port, ["train.py", "--lr", "0.1"]).get()     # the script on every process

    setup_torch_elastic_env(procs)    # only torchrun's environment, for actors that call init_process_group()

A whole job from a torchrun command line: `monarch.job.spmd.serve`. See docs/features/spmd.md.
"""

from monarch.runtime.actors.spmd import setup_torch_elastic_env, setup_torch_elastic_env_async
from monarch.runtime.common.spmd import SPMDActor

__all__ = ["SPMDActor", "setup_torch_elastic_env", "setup_torch_elastic_env_async"]
