"""`ValueMesh`: one value per point of a mesh view, what a call returns. In `common`, since both sides make
them: the controller for its calls, a worker for its actors' calls to other actors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from monarch.runtime.common.shape import Shape

T = TypeVar("T")


class ValueMesh(Generic[T]):
    """One value per point of the mesh view a call ran on.

    `item(gpu=3)` picks a value by coordinates; iterating yields values in rank order;
    `items()` yields ``(coordinates, value)``.
    """

    def __init__(self, shape: Shape, values: list[T]):
        self._shape = shape
        self._values = values

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.size_dict

    def item(self, **coords: int) -> T:
        """The value at `coords`; every dimension of size > 1 must be given."""
        return self._values[self._shape.index(**coords)]

    def items(self) -> Iterator[tuple[dict[str, int], T]]:
        for i, v in enumerate(self._values):
            yield self._shape.coords(i), v

    def values(self) -> list[T]:
        return list(self._values)

    def __iter__(self) -> Iterator[T]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def describe(self) -> str:
        """The shape of the view the values came from, e.g. ``{host: 2, gpu: 4}``."""
        return self._shape.describe()

    def label(self, coords: dict[str, int]) -> str:
        """A point's coordinates as text, e.g. ``host=0,gpu=3``."""
        return self._shape.label(coords)

    def to_table(self) -> str:
        rows = [(self._shape.label(c), repr(v)) for c, v in self.items()]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)

    def __repr__(self) -> str:
        return f"ValueMesh {self._shape.describe()}:\n{self.to_table()}"
