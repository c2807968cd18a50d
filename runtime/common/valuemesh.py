"""`ValueMesh`: one value per point of a mesh view, what a call returns. In `common`, since both sides make
them: the controller for its calls, a worker for its actors' calls to other actors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from monarch.runtime.common.mesh_trait import MeshTrait, Point
from monarch.runtime.common.shape import Shape

T = TypeVar("T")


class ValueMesh(MeshTrait, Generic[T]):
    """One value per point of the mesh view a call ran on.

    `item(gpu=3)` picks a value by coordinates; `values()` lists them in rank order; iterating (and `items()`)
    yields ``(point, value)``, the point a `Point` (``point["gpu"]``, ``point.rank``), as Monarch's does. It
    slices like the mesh: ``values.slice(host=0)``."""

    def __init__(self, shape: Shape, values: list[T]):
        if len(values) != len(shape):
            raise ValueError(f"ValueMesh: {len(values)} values for a mesh of {len(shape)} points")
        self._shape = shape
        self._values = values

    def _new_with_shape(self, shape: Shape) -> ValueMesh[T]:
        index = {rank: i for i, rank in enumerate(self._shape.ranks)}
        return ValueMesh(shape, [self._values[index[rank]] for rank in shape.ranks])

    def item(self, **coords: int) -> T:
        """The value at `coords`; every dimension of size > 1 must be given."""
        return self._values[self._shape.index(**coords)]

    def get(self, index: int) -> T:
        """The value of the point at row-major `index`."""
        return self._values[index]

    def items(self) -> Iterator[tuple[Point, T]]:
        """``(point, value)`` of each point, in rank order."""
        for i, v in enumerate(self._values):
            yield self._point(i), v

    def values(self) -> list[T]:
        """The values, in rank order."""
        return list(self._values)

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return self.items()

    def to_table(self) -> str:
        rows = [(self._shape.label(self._shape.coords(i)), repr(v)) for i, v in enumerate(self._values)]
        w = max((len(r[0]) for r in rows), default=0)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)

    def __reduce__(self) -> tuple[Any, ...]:
        return ValueMesh, (self._shape, self._values)

    def __repr__(self) -> str:
        return f"ValueMesh {self._shape.describe()}:\n{self.to_table()}"
