"""Mesh shapes: named dimensions over a set of worker ranks.

A `Shape` is an n-dimensional, row-major arrangement of *global ranks* (the ranks of the workers in
the mesh that was spawned). Views made by `rename`, `split`, `slice` and `flatten` are new shapes
over the same ranks, so they share workers. The vocabulary is fixed: a mesh *dimension* (``"gpu"``)
is never a tensor dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


def _check_name(name: object, what: str = "mesh dimension name") -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"invalid {what} {name!r}: names must be Python identifiers like 'gpu' or 'host'")
    return name


def check_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    """Validate a `{"dim": size}` mapping given by a user and return it as a dict."""
    if not isinstance(sizes, Mapping) or not sizes:
        raise ValueError(f"mesh sizes must be a non-empty dict like {{'gpu': 8}}, got {sizes!r}")
    out: dict[str, int] = {}
    for name, size in sizes.items():
        _check_name(name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh dimension {name!r} has size {size!r}; sizes must be positive integers")
        out[name] = size
    return out


def format_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2, 5"`."""
    ranks = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class Shape:
    """Named dimensions and the global rank at each point, in row-major order."""

    names: tuple[str, ...]
    """Dimension names, outermost first."""
    sizes: tuple[int, ...]
    """Size of each dimension."""
    ranks: tuple[int, ...]
    """Global rank of the worker at each point (row-major); `len(ranks) == prod(sizes)`."""

    @staticmethod
    def from_sizes(sizes: Mapping[str, int]) -> Shape:
        sizes = check_sizes(sizes)
        return Shape(tuple(sizes), tuple(sizes.values()), tuple(range(math.prod(sizes.values()))))

    def __post_init__(self) -> None:
        assert len(self.names) == len(self.sizes)
        assert len(self.ranks) == math.prod(self.sizes)

    # -- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def size_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def dim_index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown mesh dimension {name!r}; this mesh has dimensions {self.names}") from None

    def size(self, name: str | None = None) -> int:
        """Size of one dimension, or the number of workers when `name` is None."""
        return len(self.ranks) if name is None else self.sizes[self.dim_index(name)]

    def coords(self, index: int) -> dict[str, int]:
        """Coordinates of the point at row-major position `index`."""
        out: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.sizes)):
            index, out[name] = divmod(index, size)
        return dict(reversed(out.items()))

    def points(self) -> Iterator[tuple[dict[str, int], int]]:
        """Yield `(coordinates, global_rank)` for each point in row-major order."""
        for i, rank in enumerate(self.ranks):
            yield self.coords(i), rank

    def index(self, **coords: int) -> int:
        """Row-major position of the point at `coords`; every dimension of size > 1 must be given."""
        for name in coords:
            self.dim_index(name)
        flat = 0
        for name, size in zip(self.names, self.sizes):
            if name not in coords:
                if size != 1:
                    raise ValueError(f"coordinate for mesh dimension {name!r} missing; give all of {self.names}")
                c = 0
            else:
                c = coords[name]
                if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
                    raise ValueError(f"coordinate {name}={c!r} is out of range; {name} has size {size}")
            flat = flat * size + c
        return flat

    def local_index(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def label(self, coords: Mapping[str, int]) -> str:
        return ",".join(f"{k}={v}" for k, v in coords.items())

    def describe(self) -> str:
        return "{" + ", ".join(f"{n}: {s}" for n, s in zip(self.names, self.sizes)) + "}"

    # -- views -----------------------------------------------------------------------------------
    def rename(self, **renames: str) -> Shape:
        for old, new in renames.items():
            self.dim_index(old)
            _check_name(new, "new mesh dimension name")
        names = tuple(renames.get(n, n) for n in self.names)
        if len(set(names)) != len(names):
            raise ValueError(f"rename {renames} would give duplicate mesh dimensions {names}")
        return Shape(names, self.sizes, self.ranks)

    def slice(self, **index: int | range | slice) -> Shape:
        """An int removes the dimension; a `range` or `slice` keeps it with the selected points."""
        picks: list[range] = []
        keep: list[bool] = []
        for name in index:
            self.dim_index(name)
        for name, size in zip(self.names, self.sizes):
            sel = index.get(name, slice(None))
            if isinstance(sel, bool):
                raise TypeError(f"slice index for {name!r} must be an int, range or slice, got {sel!r}")
            if isinstance(sel, int):
                if not -size <= sel < size:
                    raise ValueError(f"index {name}={sel} is out of range; {name} has size {size}")
                picks.append(range(sel % size, sel % size + 1))
                keep.append(False)
            elif isinstance(sel, (range, slice)):
                r = range(size)[sel] if isinstance(sel, slice) else sel
                if len(r) == 0 or any(not 0 <= i < size for i in (r[0], r[-1])):
                    raise ValueError(f"selection {name}={sel!r} is empty or out of range; {name} has size {size}")
                picks.append(r)
                keep.append(True)
            else:
                raise TypeError(f"slice index for {name!r} must be an int, range or slice, got {sel!r}")
        ranks = tuple(self.ranks[self._flat(point)] for point in itertools.product(*picks))
        names = tuple(n for n, k in zip(self.names, keep) if k)
        sizes = tuple(len(p) for p, k in zip(picks, keep) if k)
        return Shape(names, sizes, ranks)

    def _flat(self, point: tuple[int, ...]) -> int:
        flat = 0
        for c, size in zip(point, self.sizes):
            flat = flat * size + c
        return flat

    def split(self, **spec: tuple[str, ...] | list[str] | int) -> Shape:
        """`split(host=("dp", "pp"), gpu=("tp",), pp=2)`: replace each named dimension by new ones.

        Keyword arguments whose value is a tuple name an existing dimension and the dimensions it
        becomes; integer keyword arguments give sizes of new dimensions. Per split dimension, at
        most one new size may be left out and is inferred.
        """
        groups = {k: tuple(v) for k, v in spec.items() if isinstance(v, (tuple, list))}
        given = {k: v for k, v in spec.items() if k not in groups}
        for name in groups:
            self.dim_index(name)
        new_names_all = [n for parts in groups.values() for n in parts]
        for name, size in given.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"split size {name}={size!r} must be a positive integer")
            if name not in new_names_all:
                raise ValueError(f"split size {name}={size} names no new dimension; new dimensions are {new_names_all}")
        names: list[str] = []
        sizes: list[int] = []
        for name, size in zip(self.names, self.sizes):
            if name not in groups:
                names.append(name)
                sizes.append(size)
                continue
            parts = groups[name]
            if not parts:
                raise ValueError(f"split of {name!r} names no new dimensions")
            for p in parts:
                _check_name(p, "new mesh dimension name")
            unknown = [p for p in parts if p not in given]
            known = math.prod(given[p] for p in parts if p in given)
            if len(unknown) > 1:
                raise ValueError(
                    f"split of {name!r} (size {size}) into {parts} leaves sizes of {unknown} unknown; "
                    f"give all but one of them, e.g. {unknown[0]}=..."
                )
            if unknown:
                if size % known:
                    raise ValueError(
                        f"cannot split {name!r} of size {size} into {parts}: {size} is not divisible by {known}"
                    )
                given[unknown[0]] = size // known
            elif known != size:
                raise ValueError(
                    f"cannot split {name!r} of size {size} into {parts} with sizes "
                    f"{[given[p] for p in parts]}: their product is {known}, not {size}"
                )
            names.extend(parts)
            sizes.extend(given[p] for p in parts)
        if len(set(names)) != len(names):
            raise ValueError(f"split would give duplicate mesh dimensions {tuple(names)}")
        # Row-major splitting keeps the rank order, so the ranks tuple is unchanged.
        return Shape(tuple(names), tuple(sizes), self.ranks)

    def flatten(self, name: str) -> Shape:
        _check_name(name)
        return Shape((name,), (len(self.ranks),), self.ranks)

    def partition(self, dims: str | tuple[str, ...] | list[str]) -> list[tuple[int, ...]]:
        """Global-rank groups along `dims`: one group per combination of the other dimensions."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not dims:
            raise ValueError("give at least one mesh dimension")
        idx = [self.dim_index(d) for d in dims]
        if len(set(idx)) != len(idx):
            raise ValueError(f"mesh dimensions {dims} repeat")
        others = [i for i in range(self.ndim) if i not in idx]
        groups: list[tuple[int, ...]] = []
        for outer in itertools.product(*(range(self.sizes[i]) for i in others)):
            members = []
            for inner in itertools.product(*(range(self.sizes[i]) for i in idx)):
                point = [0] * self.ndim
                for i, c in zip(others, outer):
                    point[i] = c
                for i, c in zip(idx, inner):
                    point[i] = c
                members.append(self.ranks[self._flat(tuple(point))])
            groups.append(tuple(sorted(members)))
        return groups
