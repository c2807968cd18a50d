"""Pickling live functions once, not at every call.

A function defined in a notebook travels by value (cloudpickle), and with it the globals and
closure values it uses, so it must be pickled again whenever one of those may have changed. Doing
that at every call costs from ~15 µs (a function that uses nothing) to ~500 µs (one that uses
``torch``: cloudpickle scans all of ``sys.modules`` for submodules it might reach). So:

- an importable function pickles to the same reference every time: kept;
- a by-value function is kept with a *fingerprint* of everything its pickle captured; when every
  captured value is immutable (numbers, strings, modules, importable functions and classes, other
  by-value functions with their own fingerprints, tuples of these) and still the same, the kept
  pickle is reused. A function that captures anything mutable (a list, a tensor, an instance, a
  class defined in the notebook) is pickled at every call, as before;
- cloudpickle's submodule scan is remembered per code object and set of modules while
  ``sys.modules`` keeps its size.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

try:
    from cloudpickle.cloudpickle import _extract_code_globals, _should_pickle_by_reference
except ImportError:  # an older cloudpickle: no fingerprints, pickle at every call
    _extract_code_globals = _should_pickle_by_reference = None

MAX_DEPTH = 4
"""How deep fingerprints follow by-value functions that call by-value functions."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""function -> (fingerprint, pickle), or (_REFERENCE, pickle of its importable reference)."""
_REFERENCE = object()


class _Uncacheable(Exception):
    pass


def function_blob(fn: Callable, reference: Callable[[], Any | None], pickle: Callable[[Any], bytes]) -> bytes:
    """The pickle of `fn`, reusing a kept one when it is still right.

    `reference()` gives an importable reference to `fn` (pickled instead of it), or None when
    `fn` must travel by value; `pickle` pickles either.
    """
    try:
        kept = _kept.get(fn)
    except TypeError:  # cannot be weakly referenced (a builtin): nothing to keep
        return pickle(reference() or fn)
    if kept is not None:
        if kept[0] is _REFERENCE:
            return kept[1]
        fp = fingerprint(fn)  # a function once found by value stays by value
        if fp is not None and fp == kept[0]:
            return kept[1]
    else:
        ref = reference()
        if ref is not None:
            blob = pickle(ref)
            _kept[fn] = (_REFERENCE, blob)
            return blob
        fp = fingerprint(fn)
    blob = pickle(fn)
    if fp is not None:
        _kept[fn] = (fp, blob)
    return blob


def fingerprint(fn: Callable) -> list | None:
    """What a by-value pickle of `fn` captures, or None when some of it could change unseen."""
    if _extract_code_globals is None or not isinstance(fn, types.FunctionType):
        return None
    try:
        return _function_fp(fn, fn, 0)
    except _Uncacheable:
        return None


def _function_fp(fn: types.FunctionType, root: types.FunctionType, depth: int) -> list:
    if depth > MAX_DEPTH or fn.__dict__:
        raise _Uncacheable
    code = fn.__code__
    glb = fn.__globals__
    fp: list = [code, fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__]
    modules = False
    for name in _extract_code_globals(code):  # cached by cloudpickle, same order every time
        if name in glb:
            v = glb[name]
            fp += (name, _value_fp(v, root, depth))
            modules = modules or type(v) is types.ModuleType
    fp.append("|")  # "|" is no identifier and no value's fingerprint: the parts cannot run together
    for cell in fn.__closure__ or ():
        fp.append(_value_fp(_cell(cell), root, depth))
    fp.append("|")
    for v in fn.__defaults__ or ():
        fp.append(_value_fp(v, root, depth))
    fp.append("|")
    for k, v in (fn.__kwdefaults__ or {}).items():
        fp += (k, _value_fp(v, root, depth))
    fp.append("|")
    for k, v in fn.__annotations__.items():
        fp += (k, _value_fp(v, root, depth))
    if modules:  # cloudpickle ships the submodules imported so far
        fp.append(len(sys.modules))
    return fp


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        raise _Uncacheable from None


def _value_fp(v: Any, root: types.FunctionType, depth: int) -> Any:
    t = type(v)
    if t in _SCALARS:
        if (t is str or t is bytes) and len(v) > 4096:
            raise _Uncacheable
        return (t, repr(v)) if t is float or t is complex else (t, v)  # repr: -0.0 == 0.0, nan != nan
    if t is tuple or t is frozenset:
        return (t, tuple(_value_fp(x, root, depth) for x in v))
    if v is root:
        return ("self",)  # recursion: no reference to the key, or the cache entry would never die
    if t is types.ModuleType or t is types.BuiltinFunctionType:
        return _Same(v)
    if t is types.FunctionType:
        if _should_pickle_by_reference(v):
            return _Same(v)
        return (_Same(v), _function_fp(v, root, depth + 1))
    if isinstance(v, type) and _should_pickle_by_reference(v):
        return _Same(v)
    raise _Uncacheable  # mutable, or pickled by value with state we do not follow


class _Same:
    """Compares by identity: the captured object must be the very same one."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


# -- cloudpickle's submodule scan, remembered -------------------------------------------------------
def _remember_submodule_scan() -> None:
    holder = next(
        (m for m in (sys.modules.get("cloudpickle.cloudpickle_fast"), sys.modules.get("cloudpickle.cloudpickle"))
         if m is not None and hasattr(m, "_function_getstate") and hasattr(m, "_find_imported_submodules")),
        None,
    )  # fmt: skip
    if holder is None or getattr(holder._find_imported_submodules, "_monarch", False):
        return
    scan = holder._find_imported_submodules
    seen: dict[tuple, list] = {}

    def find_imported_submodules(code, top_level_dependencies):
        deps = list(top_level_dependencies)
        packages = tuple(
            d.__name__ for d in deps if isinstance(d, types.ModuleType) and getattr(d, "__package__", None)
        )
        if not packages:
            return []
        key = (code, packages, len(sys.modules))
        found = seen.get(key)
        if found is None:
            if len(seen) > 4096:
                seen.clear()
            found = seen[key] = scan(code, deps)
        return list(found)

    find_imported_submodules._monarch = True
    holder._find_imported_submodules = find_imported_submodules


_remember_submodule_scan()
