"""`monarch.show`: a tensor's value on one worker, as a TensorView in a notebook, printed elsewhere."""

from __future__ import annotations

from typing import Any


def show(t: Any, **coords: int) -> None:
    """Display `t`'s value on the worker at `coords` (default: the first)."""
    from monarch.runtime.tensor.values import inspect

    value = inspect(t, **coords)
    try:
        from IPython import get_ipython
    except ImportError:
        print(value)
        return
    ip = get_ipython()
    if ip is None or getattr(ip, "kernel", None) is None:
        print(value)
        return
    from IPython.display import display

    from monarch.runtime.remote import ValueMesh
    from monarch.runtime.shape import Shape
    from monarch.widgets.value_mesh import TensorView

    where = ",".join(f"{k}={v}" for k, v in coords.items()) or "the first rank"
    view = TensorView(ValueMesh(Shape.from_sizes({"rank": 1}), [value]), title=f"value at {where}")
    view.labels = [where]
    display(view)
