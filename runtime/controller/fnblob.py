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
from collections.abc import Callable, Iterable
from typing import Any

try:
    from cloudpickle.cloudpickle import _extract_code_globals, _should_pickle_by_reference
except ImportError:  # an older cloudpickle: no fingerprints, pickle at every call
    _extract_code_globals = _should_pickle_by_reference = None

MAX_DEPTH = 4
"""How deep fingerprints follow by-value functions that call by-value functions."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_kept: weakref.WeakKeyDictionary[Callable[..., Any], tuple[object, bytes]] = weakref.WeakKeyDictionary()
"""function -> (fingerprint, pickle), or (_REFERENCE, pickle of its importable reference)."""
_REFERENCE = object()


class _Uncacheable(Exception):
    pass


def function_blob(fn: Callable[..., Any], reference: Callable[[], Any | None], pickle: Callable[[Any], bytes]) -> bytes:
    """The pickle of `fn`, reusing a kept one when it is still right.

    `reference()` gives an importable reference to `fn` (pickled instead of it), or None when
    `fn` must travel by value; `pickle` pickles either.
    """
    try:
        kept = _kept.get(fn)
    except TypeError:  # cannot be weakly referenced (a builtin): nothing to keep
        return pickle(reference() or fn)
    if kept is not None and kept[0] is not _REFERENCE:
        fp = fingerprint(fn)  # a function once found by value stays by value
        if fp is not None and fp == kept[0]:
            return kept[1]
    else:
        ref = reference()  # again each time: a reloaded module may no longer hold this very function
        if ref is not None:
            if kept is None:
                kept = _kept[fn] = (_REFERENCE, pickle(ref))
            return kept[1]
        fp = fingerprint(fn)
    blob = pickle(fn)
    if fp is not None and fingerprint(fn) == fp:  # nothing changed while it was pickled (another thread)
        _kept[fn] = (fp, blob)
    return blob


def fingerprint(fn: Callable[..., Any]) -> list[Any] | None:
    """What a by-value pickle of `fn` captures, or None when some of it could change unseen."""
    if _extract_code_globals is None or not isinstance(fn, types.FunctionType):
        return None
    try:
        return _function_fp(fn, fn, 0)
    except (_Uncacheable, RecursionError):
        return None


def _function_fp(fn: types.FunctionType, root: types.FunctionType, depth: int) -> list[Any]:
    if depth > MAX_DEPTH or fn.__dict__:
        raise _Uncacheable
    code = fn.__code__
    glb = fn.__globals__
    get = glb.get  # cloudpickle ships these four (repr: a snapshot of a package's `__path__` list)
    fp: list[Any] = [_Same(code), fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__, repr(get("__package__"))]
    fp += (repr(get("__name__")), repr(get("__path__")), repr(get("__file__")))  # (no generator: checked per call)
    modules = False
    for name in _extract_code_globals(code):  # cached by cloudpickle, same order every time
        if name in glb:
            v = glb[name]
            fp += (name, _value_fp(v, root, depth))
            modules = modules or type(v) is types.ModuleType
    fp.append("|")  # "|" is no identifier and no value's fingerprint: the parts cannot run together
    for cell in fn.__closure__ or ():
        v = _cell(cell)
        fp.append(_value_fp(v, root, depth))
        modules = modules or type(v) is types.ModuleType
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
        fp.append(_modules_version())
    return fp


def _cell(cell: types.CellType) -> Any:
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
    if t is types.ModuleType:
        if not _should_pickle_by_reference(v):
            raise _Uncacheable  # a module pickled by value: its whole namespace travels
        return _Same(v)
    if t is types.BuiltinFunctionType:
        owner = getattr(v, "__self__", None)
        if not (owner is None or (type(owner) is types.ModuleType and _should_pickle_by_reference(owner))):
            raise _Uncacheable  # a bound builtin method (`d.get`) pickles its object by value
        return _Same(v)
    if t is types.FunctionType:
        if _should_pickle_by_reference(v):
            return _Same(v)
        return (_Same(v), _function_fp(v, root, depth + 1))
    if isinstance(v, type) and _should_pickle_by_reference(v):
        return _Same(v)
    raise _Uncacheable  # mutable, or pickled by value with state we do not follow


class _Same:
    """Compares by identity: the captured object must be the very same one. Holds it weakly where it
    can, so a kept fingerprint never keeps a function (and so its own cache entry) alive."""

    __slots__ = ("ref",)

    def __init__(self, obj: Any):
        try:
            self.ref: Callable[[], Any] = weakref.ref(obj)
        except TypeError:  # builtins, code objects: they live as long as their module anyway
            self.ref = lambda: obj

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return False
        mine = self.ref()
        return mine is not None and mine is other.ref()

    __hash__ = None  # type: ignore[assignment]


def _modules_version() -> tuple[int, str | None]:
    """Changes whenever a module is imported: the count, and the newest name (dicts keep order)."""
    return (len(sys.modules), next(reversed(sys.modules), None))


# -- cloudpickle's submodule scan, remembered -------------------------------------------------------
def _remember_submodule_scan() -> None:
    holder: Any = next(  # the module whose _function_getstate calls it (cloudpickle_fast in 2.x; in 3.x a shim)
        (m for m in (sys.modules.get("cloudpickle.cloudpickle_fast"), sys.modules.get("cloudpickle.cloudpickle"))
         if m is not None and "_function_getstate" in vars(m) and "_find_imported_submodules" in vars(m)),
        None,
    )  # fmt: skip
    if holder is None or getattr(holder._find_imported_submodules, "_monarch", False):
        return
    scan = holder._find_imported_submodules
    seen: dict[tuple[Any, ...], list[Any]] = {}

    def find_imported_submodules(code: types.CodeType, top_level_dependencies: Iterable[Any]) -> list[Any]:
        deps = list(top_level_dependencies)
        packages = tuple(
            d.__name__ for d in deps if isinstance(d, types.ModuleType) and getattr(d, "__package__", None)
        )
        if not packages:
            return []
        key = (code, packages, _modules_version())
        found = seen.get(key)
        if found is None:
            if len(seen) > 4096:
                seen.clear()
            found = seen[key] = scan(code, deps)
        return list(found)

    holder._find_imported_submodules = find_imported_submodules
    holder._find_imported_submodules._monarch = True


_remember_submodule_scan()
