"""`monarch.show`: a tensor's value on one worker, as a TensorView in a notebook, printed elsewhere."""

from __future__ import annotations

from typing import Any


def show(t: Any, **coords: int) -> None:
    """Display `t`'s value on the worker at `coords` (default: the first); in a notebook, a TensorView whose
    rank selector lists every rank of the tensor's mesh (all values are fetched, in one round trip)."""
    from monarch.runtime.fetch import inspect, inspect_all

    try:
        from IPython import get_ipython
    except ImportError:
        print(inspect(t, **coords))
        return
    ip = get_ipython()
    if ip is None or getattr(ip, "kernel", None) is None:
        print(inspect(t, **coords))
        return
    from IPython.display import display

    from monarch.widgets.value_mesh import TensorView

    values = inspect_all(t)
    points = list(values.items())
    at = next((i for i, (c, _) in enumerate(points) if all(c.get(k) == v for k, v in coords.items())), None)
    if at is None:
        where = ", ".join(f"{k}={v}" for k, v in coords.items())
        raise ValueError(f"show: no worker at {where}; the tensor is on mesh {values.describe()}")
    where = values.label(points[at][0]) or "the only rank"
    display(TensorView(values, title=f"tensor on {values.describe()}, showing {where}", selected=at))
