"""The actor sections of Monarch's getting-started guide, as its users write them, on our runtime.

    python -m examples.actors.getting_started              # the host mesh is this machine
    MONARCH_HOSTS=myjob python -m examples.actors.getting_started   # a reserved Slurm job's hosts

Only where the host mesh comes from differs (Monarch's guide builds one from a config helper; here it is a
job reserved with `python -m monarch.notebook reserve`, or this machine). `tests/test_actors_hosts.py` runs it
on two fake Slurm hosts and checks what it prints.
"""

import asyncio
import os

import monarch.actor
from monarch.actor import Actor, Future, HostMesh, MeshFailure, ProcMesh, context, endpoint, this_host, this_proc


# -- an actor in this very process ------------------------------------------------------------------
class Counter(Actor):
    def __init__(self, initial_value: int):
        self.value = initial_value

    @endpoint
    def increment(self) -> None:
        self.value += 1

    @endpoint
    def get_value(self) -> int:
        return self.value


counter: Counter = this_proc().spawn("counter", Counter, initial_value=0)
fut: Future[int] = counter.get_value.call_one()
print(f"Counter value: {fut.get()}")

# -- a mesh of actors: broadcast, slices, call ------------------------------------------------------
procs: ProcMesh = this_host().spawn_procs(per_host={"gpus": 8})
counters: Counter = procs.spawn("counters", Counter, 0)
counters.increment.broadcast()
counters.slice(gpus=slice(0, 4)).increment.broadcast()
print("values:", counters.get_value.call().get().values())  # in the order sent: 2 on gpus 0-3, 1 on 4-7


# -- several hosts ------------------------------------------------------------------------------------
def host_mesh():
    """The one line that differs from Monarch's guide: where the hosts come from."""
    job = os.environ.get("MONARCH_HOSTS")
    if job:
        import monarch.notebook

        return monarch.notebook.job(job)
    return this_host()


hosts: HostMesh = host_mesh()
print("hosts:", hosts.extent)


class Trainer(Actor):
    @endpoint
    def step(self):
        my_point = context().message_rank
        return f"Trainer {my_point} taking a step."


trainer_procs: ProcMesh = hosts.spawn_procs(per_host={"gpus": 4})
print(f"Process mesh extent: {trainer_procs.extent}")
trainers = trainer_procs.spawn("trainer", Trainer)
print(trainers.step.call().get())

# -- logging: lines that repeat across processes, collapsed ---------------------------------------
asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=3))


# -- actor references: data loaders handed to trainers ---------------------------------------------
class DataLoader(Actor):
    def __init__(self):
        self.i = 0

    @endpoint
    def example(self):
        self.i += 1
        return f"<fake data {self.i}>"


class Trainer(Actor):  # (a new Trainer, as the guide writes it)
    def __init__(self, dataloader: DataLoader):
        my_rank = context().actor_instance.rank
        self.dataloader = dataloader.slice(**my_rank)  # the loader on this trainer's own point

    @endpoint
    def step(self, input=None):
        data = self.dataloader.example.call_one().get()
        return f"Step with data {data} and input = {input}"


dataloaders = trainer_procs.spawn("dataloader", DataLoader)
dtrainers = trainer_procs.spawn("dtrainers", Trainer, dataloaders)
print(dtrainers.step.call().get())


# -- supervision --------------------------------------------------------------------------------------
class Errorful(Actor):
    @endpoint
    def say_hello(self):
        raise Exception("I don't want to")


e = this_proc().spawn("errorful", Errorful)
try:
    e.say_hello.call_one().get()
except Exception:
    print("It didn't say hello")


class SupervisorActor(Actor):
    def __supervise__(self, failure: MeshFailure):
        print(f"Failure received: {failure}")
        return True


def my_unhandled_fault_hook(failure: MeshFailure) -> None:
    print(f"Mesh failure was not handled: {failure}")


monarch.actor.unhandled_fault_hook = my_unhandled_fault_hook
print("done")
