"""Getting values back from the workers: `monarch.inspect`, `monarch.fetch_shard`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from monarch.runtime.remote import RemoteFunction
from monarch.runtime.tensor.checks import check_alive
from monarch.runtime.tensor.handles import Tensor
from monarch.runtime.values import ValueMesh

_TABLE = "monarch.runtime.worker.engine.table"


def _rank_for(t: Tensor, coords: dict[str, int]) -> Any:
    view = t._mesh
    if coords:
        view = view.slice(**coords)
    return view.slice(**{d: 0 for d in view.names}) if view.names else view


def _fetcher(t: Tensor, coords: dict[str, int]) -> RemoteFunction:
    """The workers' `fetch` bound to the worker at `coords` of `t`'s mesh; for the first worker, made once per
    view (a view's workers never change: `inspect` in a loop skips slicing the mesh each time)."""
    derived = None if coords else t._mesh._derived
    fetch = None if derived is None else derived.get("fetch")
    if fetch is None:
        fetch = RemoteFunction.by_name(_TABLE, "fetch", _rank_for(t, coords))
        if derived is not None:
            derived["fetch"] = fetch
    return fetch


_NOTHING = contextlib.nullcontext()


def _no_modes() -> Any:
    """`_disable_current_modes()` where a dispatch mode is on (inside `mesh.activate()`, a tracer), else a
    context that does nothing (entering torch's costs an `inspect` some µs even with no mode to disable)."""
    if torch._C._len_torch_dispatch_stack() or torch._ops.mode_stack_state_for_pre_dispatch().count():
        return torch.utils._python_dispatch._disable_current_modes()
    return _NOTHING


def fetch_shard(t: Tensor, **coords: int):
    """A future for the value of `t` on the worker at `coords` (default: the first). A local tensor (what an
    actor computes with its own process's tensor engine, `context().actor_instance.proc_mesh`) is its own
    value: a done future of it."""
    if not isinstance(t, Tensor) and isinstance(t, torch.Tensor):
        from monarch.runtime.values import Done

        return Done(t)
    with _no_modes():
        return Shard(_fetch(t, "fetch_shard", _fetcher, coords))


def inspect_all(t: Tensor) -> ValueMesh:
    """The value of `t` on every worker of its mesh, as local tensors, in one round trip (for views that
    let the user pick a rank)."""
    with _no_modes():
        return _fetch(t, "inspect_all", _every_worker, {}).result()


def _every_worker(t: Tensor, coords: dict[str, int]) -> RemoteFunction:
    return RemoteFunction.by_name(_TABLE, "fetch", t._mesh)


def _fetch(
    t: Tensor, what: str, fetcher: Callable[[Tensor, dict[str, int]], RemoteFunction], coords: dict[str, int]
) -> Any:
    """The call that fetches `t` (from the workers `fetcher(t, coords)` names), started. Callers hold
    `_no_modes()` around it and its result (a dispatch mode would see the tensors made meanwhile)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: needs a monarch.Tensor, got {type(t).__name__}")
    if t._mesh.spawned.state != "running":
        check_alive("inspect", t._mesh.spawned)
    b = (t._root if t._root is not None else t)._borrow
    if b is not None and b.dropped:
        raise TypeError(
            f"inspect: a borrowed tensor used after its borrow was dropped (borrowed at {b.where}, dropped at "
            f"{b.dropped_at}); inspect the original tensor instead"
        )
    # (the tensor commands issued before are sent first: `start` sends what the mesh's engine holds)
    return fetcher(t, coords).start((t._ref,), {}, name="fetching a tensor")


class Shard:
    """One worker's value of a tensor, on its way: `result()` waits for it and returns a local tensor
    (or raises the worker's error); `await` works too."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def done(self) -> bool:
        return self._call.done()

    def result(self, timeout: float | None = None) -> torch.Tensor:
        with _no_modes():
            return self._call.result(timeout).values()[0]

    get = result

    def __await__(self):
        yield from self._call.__await__()
        return self.result()


def inspect(t: Tensor, **coords: int) -> torch.Tensor:
    """The value of `t` on the worker at `coords` (default: the first), as a local tensor."""
    with _no_modes():
        return _fetch(t, "inspect", _fetcher, coords).result().values()[0]
