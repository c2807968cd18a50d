"""The rules a handle must follow, checked on the controller before anything is sent: the mesh it is
used on, the stream it belongs to and its borrows; and the user's line that issued an op (named in
errors raised later, on a worker)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from monarch.runtime.common.errors import cell_frame
from monarch.runtime.tensor.streams import Stream

_RUNTIME = os.path.dirname(os.path.dirname(__file__))
_TORCH = os.path.dirname(torch.__file__)
_rejected = threading.local()


def rejected() -> TypeError | None:
    """The TypeError `reject` made last on this thread (torch turns TypeErrors in operators into
    NotImplemented; the handle's operators raise it again)."""
    return getattr(_rejected, "err", None)


def clear_rejected() -> None:
    _rejected.err = None


def reject(message: str) -> TypeError:
    """A TypeError for illegal use; remembered, because torch turns TypeErrors in operators into NotImplemented."""
    err = TypeError(message)
    _rejected.err = err
    return err


def where() -> str:
    """The user's line that issued an op: the first frame outside torch and monarch (a notebook cell is
    named as IPython names it, `Cell In[5], line 2`). On a thread that issues ops for a user's line (the
    backward pass of grad_generator), that line."""
    f = sys._getframe(2)
    while f is not None:  # (every op asks: what is known of a file is kept, by its name, whose hash is kept)
        code = f.f_code
        filename = code.co_filename
        theirs = _THEIRS.get(filename)
        if theirs is None:
            if len(_THEIRS) > _KEEP:
                _THEIRS.clear()
            theirs = _THEIRS[filename] = filename.startswith(_NOT_USERS) or "contextlib" in filename
        if not theirs:
            break
        f = f.f_back
    if f is None:
        return getattr(issuer, "where", "?")
    func, lineno = code.co_name, f.f_lineno
    line = (filename, lineno, func)
    text = _LINES.get(line)
    if text is None:
        cell = cell_frame(filename, lineno, func) if "ipykernel_" in filename else None
        text = cell or f"{filename}:{lineno} in {func}"
        if len(_LINES) > _KEEP:
            _LINES.clear()
        _LINES[line] = text
    return text


_NOT_USERS = (_RUNTIME, _TORCH, threading.__file__)
_THEIRS: dict[str, bool] = {}
"""File name -> whether it is torch's or ours (skipped by `where`)."""
_LINES: dict[tuple[str, int, str], str] = {}
"""(file, line, function) -> how `where` names it."""
_KEEP = 4096
issuer = threading.local()
"""`.where`: set on threads whose ops are issued on behalf of one user line."""


def check_same_mesh(what: Any, t: Any, mesh) -> None:
    """`t` used inside `mesh.activate()`: it must be on that mesh (the same workers of one spawned mesh)."""
    if t._mesh is not mesh and (t._mesh.spawned is not mesh.spawned or t._mesh._shape.ranks != mesh._shape.ranks):
        raise reject(
            f"{what}: a tensor on mesh {name_view(t._mesh, mesh)} used inside {name_view(mesh, t._mesh)}"
            ".activate(); a tensor is used only on the mesh that made it (move it there with t.to_mesh(that_mesh))"
        )


def name_view(view, other) -> str:
    """A mesh view's shape, and what tells it from `other` where the shapes read the same: its ranks
    (two slices of one mesh), or its spawn number (two spawned meshes)."""
    text = view._shape.describe()
    if text == other._shape.describe():
        if view.spawned is not other.spawned:
            return f"{text} (spawned mesh #{view.spawned.mesh_id})"
        ranks = view._shape.ranks
        if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
            return f"{text} (ranks {ranks[0]}-{ranks[-1]})"
        return f"{text} (ranks {', '.join(map(str, ranks))})"
    return text


def check_alive(what, spawned) -> None:
    if spawned.failure is not None:
        raise spawned.failure
    raise reject(
        f"{what}: mesh {spawned.shape.describe()} is {spawned.state}, and its tensors went with its workers; "
        "make new tensors on a running mesh (mesh.respawn() starts one of the same shape)"
    )


def check_stream(func, x: Any, stream: Stream, mutating: bool = False) -> None:
    """The borrow rules; a TypeError that says which rule and where the borrow was made."""
    what = str(func)
    root = x._root if x._root is not None else x
    b = root._borrow
    if b is not None and b.dropped:
        raise reject(
            f"{what}: a borrowed tensor used after its borrow was dropped (borrowed at {b.where}, dropped at "
            f"{b.dropped_at}); use the original tensor on stream {b.from_stream.name!r} instead"
        )
    if b is not None and mutating and not b.mutable:
        raise reject(
            f"{what}: this tensor is {b.describe()}, so it may not be changed there "
            "(borrow with mutable=True to change it on the borrowing stream)"
        )
    if x._stream is not stream:
        raise reject(
            f"{what}: a tensor of stream {x._stream.name!r} used on stream {stream.name!r}; a stream uses only its "
            f"own tensors: lend it with {stream.name}.borrow(t) (see monarch.Stream.borrow)"
        )
    for lent in root._lent:
        if lent.mutable:
            raise reject(
                f"{what}: this tensor is {lent.describe()}; its stream {x._stream.name!r} may use it again only "
                "after borrow.drop()"
            )
        if mutating:
            raise reject(
                f"{what}: this tensor is {lent.describe()}, so it may not be changed until borrow.drop() "
                "(borrow with mutable=True to change it on the borrowing stream)"
            )
