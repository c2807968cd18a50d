"""What every mesh has, declared once: its extent and the views made from it.

Proc meshes, host meshes, actor meshes (the controller's and the references actors hold) and value meshes are
all named dimensions over a set of points (`common/shape.py`, `Shape`). `MeshTrait` gives each of them the same
shape API from two things the class provides, its `_shape` and `_new_with_shape(shape)`:

    mesh.extent            # Extent {'host': 2, 'gpu': 4}: a Mapping, with .labels, .sizes, .nelements
    mesh.sizes             # {'host': 2, 'gpu': 4}
    mesh.size("gpu")       # 4 (a sequence of dimensions: their product; none: every point)
    mesh.slice(gpu=0)      # an int drops the dimension; a slice (or range) keeps it
    mesh.rename(gpu="tp"); mesh.split(host=("dp", "pp"), pp=2); mesh.flatten("all")

A `Point` is a place in a mesh, as Monarch's `current_rank()` gives it: a read-only mapping of dimension to
index, with `.rank` (the row-major index) and `.extent`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from monarch.runtime.common.shape import Shape

M = TypeVar("M", bound="MeshTrait")


class Extent(dict[str, int]):
    """A mesh's dimensions and their sizes, ``{'host': 2, 'gpu': 4}``: a dict, with Monarch's names for its
    parts. ``Extent(["host", "gpu"], [2, 4])`` (Monarch's signature) and ``Extent({"gpu": 4})`` both make one."""

    def __init__(self, labels: Sequence[str] | Mapping[str, int] = (), sizes: Sequence[int] | None = None) -> None:
        if sizes is None:
            super().__init__(labels)
            return
        if isinstance(labels, str) or len(labels) != len(sizes):
            raise ValueError(f"Extent(labels={labels!r}, sizes={sizes!r}): give one size per label")
        super().__init__(zip(labels, sizes))

    @property
    def labels(self) -> list[str]:
        """The dimension names, outermost first."""
        return list(self)

    @property
    def sizes(self) -> list[int]:
        return list(self.values())

    @property
    def nelements(self) -> int:
        """The number of points (processes, actors)."""
        return math.prod(self.values())

    nelem = nelements

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.items()) + "}"


class Point(Mapping[str, int]):
    """One point of a mesh: ``point["gpu"]`` is its index along ``gpu``; `rank` is its row-major index among
    the mesh's points and `extent` the mesh's extent. What `current_rank()` and `context().message_rank` give."""

    __slots__ = ("_rank", "_extent")

    def __init__(self, rank: int, extent: Mapping[str, int]) -> None:
        extent = extent if isinstance(extent, Extent) else Extent(dict(extent))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < max(1, extent.nelements):
            raise ValueError(f"Point(rank={rank!r}): a rank of extent {extent} is in range({extent.nelements})")
        self._rank = rank
        self._extent = extent

    @staticmethod
    def of(coords: Mapping[str, int], sizes: Mapping[str, int]) -> Point:
        """The point at `coords` of a mesh of `sizes`."""
        rank = 0
        for dim, size in sizes.items():
            rank = rank * size + coords[dim]
        return Point(rank, Extent(dict(sizes)))

    @property
    def rank(self) -> int:
        """The row-major index of this point among its mesh's points."""
        return self._rank

    @property
    def extent(self) -> Extent:
        return self._extent

    def size(self, label: str) -> int:
        """The size of dimension `label` of this point's mesh."""
        return self._extent[label]

    def _coords(self) -> dict[str, int]:
        out: dict[str, int] = {}
        index = self._rank
        for dim, size in reversed(self._extent.items()):
            index, out[dim] = divmod(index, size)
        return dict(reversed(out.items()))

    def __getitem__(self, label: str) -> int:
        if label not in self._extent:
            raise KeyError(label)
        return self._coords()[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._extent)

    def __len__(self) -> int:
        return len(self._extent)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._rank == other._rank and self._extent == other._extent
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __hash__(self) -> int:
        return hash((self._rank, tuple(self._extent.items())))

    def __repr__(self) -> str:
        coords = self._coords()
        return "{" + ", ".join(f"'{k}': {coords[k]}/{n}" for k, n in self._extent.items()) + "}"

    def __reduce__(self) -> tuple[Any, ...]:
        return Point, (self._rank, dict(self._extent))


class MeshTrait:
    """The shape API shared by every kind of mesh (see the module). A subclass provides `_shape` (an attribute
    or property: its `Shape`) and `_new_with_shape(shape)` (the same kind of mesh over a view of its points)."""

    _shape: Shape

    def _new_with_shape(self: M, shape: Shape) -> M:
        raise NotImplementedError(f"{type(self).__name__} makes no views")

    # -- what it is ----------------------------------------------------------------------------------
    @property
    def extent(self) -> Extent:
        """The mesh's dimensions and sizes: ``{'host': 2, 'gpu': 4}``."""
        return Extent(self._shape.size_dict)

    @property
    def sizes(self) -> dict[str, int]:
        """`{dimension: size}` in order, e.g. ``{"host": 2, "gpu": 4}``."""
        return self._shape.size_dict

    @property
    def names(self) -> tuple[str, ...]:
        """The dimension names, outermost first."""
        return self._shape.names

    @property
    def _labels(self) -> tuple[str, ...]:
        """The dimension names (Monarch's private name for them, read by its DDP example)."""
        return self._shape.names

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """The number of points along dimension `dim` (of several: their product); of all, without one."""
        if dim is None or isinstance(dim, str):
            return self._shape.size(dim)
        return math.prod(self._shape.size(d) for d in dim)

    def __len__(self) -> int:
        return len(self._shape)

    def describe(self) -> str:
        """The shape as text, e.g. ``{host: 2, gpu: 4}``."""
        return self._shape.describe()

    def label(self, coords: Mapping[str, int]) -> str:
        """A point's coordinates as text, e.g. ``host=0,gpu=3``."""
        return self._shape.label(coords)

    def _point(self, index: int) -> Point:
        """The point at row-major `index` of this mesh."""
        return Point(index, Extent(self._shape.size_dict))

    # -- views ---------------------------------------------------------------------------------------
    def slice(self: M, **index: int | range | slice) -> M:
        """`slice(gpu=0)` drops the dimension; `slice(gpu=slice(0, 4))` (or a `range`) keeps it, restricted.
        ``slice(**point)`` picks one point."""
        return self._new_with_shape(self._shape.slice(**index))

    def rename(self: M, **renames: str) -> M:
        """`rename(host="dp", gpu="tp")`: the same points under new dimension names."""
        return self._new_with_shape(self._shape.rename(**renames))

    def split(self: M, **spec: Any) -> M:
        """`split(host=("dp", "pp"), gpu=("tp",), pp=2)`: replace dimensions by several; one size may be
        inferred."""
        return self._new_with_shape(self._shape.split(**spec))

    def flatten(self: M, name: str) -> M:
        """Every point of this view along one dimension called `name`."""
        return self._new_with_shape(self._shape.flatten(name))
