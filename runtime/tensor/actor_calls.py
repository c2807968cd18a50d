"""Actors and the tensor engine together: `actors.endpoint.rref(t)`, an endpoint run by every worker of the
tensor engine's mesh on its own tensors, its result a `monarch.Tensor` (whose metadata the endpoint's
`propagate` function gives, run on fake tensors here). The call is a tensor command (`CallActor`), in order
with the ops around it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from monarch.runtime.common.actors import options_of
from monarch.runtime.tensor.checks import check_same_mesh, reject, where
from monarch.runtime.tensor.engine import engine_for
from monarch.runtime.tensor.handles import Tensor, _build, _ids_like, _spec, _walk
from monarch.runtime.tensor.streams import get_active_stream
from monarch.runtime.wire import protocol as P


def rref(procs: Any, actor: str, cls: type, endpoint: str, args: tuple, kwargs: dict) -> Any:
    """`endpoint.rref(*args, **kwargs)` on the actors named `actor` (of class `cls`) living on `procs`."""
    method = getattr(cls, endpoint, None)
    options = options_of(method)
    propagate = options.propagate if options is not None else None
    what = f"{actor}.{endpoint}.rref()"
    if not callable(propagate):
        raise ValueError(
            f"{what}: the endpoint says nothing of its result's shape; declare it with "
            f"@endpoint(propagate=fn), fn taking the endpoint's arguments as (fake) tensors and returning tensors of "
            f"the shapes it returns (got propagate={propagate!r}; 'cached', 'inspect' and 'mocked' are Monarch's "
            "own ways, not supported here)"
        )
    spawned = procs.spawned
    engine = engine_for(spawned)
    handles: list[torch.Tensor] = []
    wire_args = _walk(args, handles, [])
    wire_kwargs = _walk(kwargs, handles, [])
    for h in handles:
        if isinstance(h, Tensor) and h._mesh.spawned is not spawned:
            check_same_mesh(what, h, procs)

    def fake(x: Any) -> Any:
        return x._get_fake() if isinstance(x, Tensor) else x

    fake_args, fake_kwargs = tree_map(fake, (args, kwargs))
    with engine.lock, torch.utils._python_dispatch._disable_current_modes(), engine.fake:
        try:
            spec = _spec(propagate(*fake_args, **fake_kwargs))
        except Exception as e:
            raise reject(f"{what}: its propagate function failed on the arguments' metadata: {e}") from e
    stream = get_active_stream()
    out = _build(spec, engine, procs, stream)
    ids = out._ref if isinstance(out, Tensor) else _ids_like(out)
    engine.push(procs._shape.ranks, P.CallActor(actor, endpoint, wire_args, wire_kwargs, ids, where()), stream)
    return out
