"""Values the controller knows: small tensors that are the same on every worker.

A handle made by a deterministic op from constants or other known values (a step counter such as
`torch.optim.Adam`'s, a scalar built with `torch.tensor(0.0)`) also keeps its value on the controller,
so that `.item()`, `if t:` and the like answer at once instead of needing a round trip; everything
else stays on the workers. A known value is forgotten as soon as something the controller cannot
compute writes to it. (On GPU workers the value is computed on the controller's CPU: the last bit of
a float may differ from the workers'.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

MAX_ELEMENTS = 1
"""Largest result (elements) whose value the controller computes too: one element is what `.item()`
and `bool(t)` read; more would slow every op on small tensors (~10 µs each) for little use."""

_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential", "cauchy")
_RANDOM += ("geometric", "poisson", "empty")  # `empty`: whatever the memory held
_deterministic: dict[Any, bool] = {}


def deterministic(func) -> bool:
    """Whether `func` gives the same result on every worker for the same inputs."""
    ok = _deterministic.get(func)
    if ok is None:
        schema = getattr(func, "_schema", None)
        name = func.name() if hasattr(func, "name") else str(func)
        ok = schema is not None and not any(a.name == "generator" for a in schema.arguments)
        ok = ok and not any(r in name for r in _RANDOM)
        _deterministic[func] = ok
    return ok


def small(spec: Any) -> bool:
    """Whether every tensor in an op's output spec (shape, stride, dtype, device) is small."""
    if isinstance(spec, tuple) and type(spec).__name__ == "_Meta":
        return math.prod(spec[0]) <= MAX_ELEMENTS
    if isinstance(spec, tuple | list):
        return all(small(s) for s in spec)
    return True


class Known:
    """The controller's copy of one tensor's value on every worker; shared by the handles that are that
    tensor (the one that made it, and the results of in-place ops on it). `value` None: forgotten."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value: torch.Tensor | None = value


MAX_LOCAL_ELEMENTS = 16
"""Local tensors an op may take and still be computed here (they are copied for it)."""


def all_known(tensors: list, handle_type: type) -> bool:
    """Every handle among an op's tensors has a known value, and its local tensors are small."""
    for t in tensors:
        if isinstance(t, handle_type):
            if t._value is None or t._value.value is None:
                return False
        elif t.numel() > MAX_LOCAL_ELEMENTS:
            return False
    return True


def compute(func, args: tuple, kwargs: dict, handle_type: type) -> Any:
    """`func` on the known values (on the CPU): the value every worker computes. In-place ops update
    the known values; the user's local tensors are only read (copies are passed)."""

    def value(x):
        if isinstance(x, handle_type):
            return x._value.value
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if type(x) in (list, tuple):
            return type(x)(value(e) for e in x)
        return x

    a = [value(x) for x in args]
    k = {name: value(v) for name, v in kwargs.items()}
    if k.get("device") is not None:
        k["device"] = "cpu"
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):  # plain tensors, straight to the kernels
        return func(*a, **k)


_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def attach(out: Any, values: Any, handle_type: type, aliases: dict[int, Any], mutated: set[int]) -> None:
    """Give the handles in `out` their values: a new one for a fresh result; the very same for the result
    of an in-place op (it is the tensor written); none for a view (another value, same memory)."""
    if isinstance(out, handle_type):
        src = aliases.get(id(out))
        if src is None:
            if isinstance(values, torch.Tensor):
                out._value = Known(values.detach().clone())
        elif id(src) in mutated:
            out._value = src._value
    elif isinstance(out, tuple | list) and isinstance(values, tuple | list):
        for o, v in zip(out, values):
            attach(o, v, handle_type, aliases, mutated)


def forget(t: Any) -> None:
    """`t` (and so the tensor whose memory it shares) was written by something the controller did not
    compute: every handle of that tensor forgets the value."""
    for h in (t, t._root):
        if h is not None and h._value is not None:
            h._value.value = None
