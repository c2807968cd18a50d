"""Mesh shape algebra: pure, no processes."""

import pytest

from monarch.runtime.common.shape import Shape, format_ranks

S = Shape.from_sizes({"host": 2, "gpu": 4})


def test_coords_and_index():
    assert len(S) == 8 and S.size("gpu") == 4 and S.size() == 8
    assert S.coords(5) == {"host": 1, "gpu": 1}
    assert S.index(host=1, gpu=1) == 5
    assert [r for _, r in S.points()] == list(range(8))


def test_rename():
    r = S.rename(host="dp", gpu="tp")
    assert r.names == ("dp", "tp") and r.ranks == S.ranks


def test_split_infers_one_size():
    s = S.split(host=("dp", "pp"), gpu=("tp",), pp=2)
    assert s.size_dict == {"dp": 1, "pp": 2, "tp": 4}
    assert s.ranks == S.ranks
    t = S.split(gpu=("a", "b"), b=2)
    assert t.size_dict == {"host": 2, "a": 2, "b": 2}
    assert t.coords(3) == {"host": 0, "a": 1, "b": 1}


def test_slice_int_drops_dim_range_keeps_it():
    assert S.slice(host=1).names == ("gpu",)
    assert S.slice(host=1).ranks == (4, 5, 6, 7)
    assert S.slice(gpu=range(1, 3)).ranks == (1, 2, 5, 6)
    assert S.slice(gpu=slice(0, 4, 2)).ranks == (0, 2, 4, 6)
    assert S.slice(host=0, gpu=3).ranks == (3,)


def test_flatten_and_partition():
    v = S.slice(gpu=slice(0, 4, 2)).flatten("all")
    assert v.size_dict == {"all": 4} and v.ranks == (0, 2, 4, 6)
    assert S.partition("gpu") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert S.partition("host") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert S.partition(("host", "gpu")) == [tuple(range(8))]


def test_format_ranks():
    assert format_ranks([5, 0, 1, 2, 7]) == "0-2, 5, 7"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: S.size("gpus"), "unknown mesh dimension 'gpus'; this mesh has dimensions ('host', 'gpu')"),
        (lambda: S.slice(gpu=4), "index gpu=4 is out of range; gpu has size 4"),
        (lambda: S.slice(gpu=range(2, 9)), "out of range; gpu has size 4"),
        (lambda: S.slice(cpu=0), "unknown mesh dimension 'cpu'"),
        (lambda: S.split(gpu=("a", "b"), a=3), "cannot split 'gpu' of size 4 into ('a', 'b'): 4 is not divisible by 3"),
        (lambda: S.split(gpu=("a", "b"), a=2, b=3), "their product is 6, not 4"),
        (lambda: S.split(gpu=("a", "b")), "leaves sizes of ['a', 'b'] unknown"),
        (lambda: S.split(gpu=("a",), z=2), "split size z=2 names no new dimension"),
        (lambda: S.rename(host="gpu"), "duplicate mesh dimensions"),
        (lambda: Shape.from_sizes({"gpu": 0}), "mesh dimension 'gpu' has size 0; sizes must be positive integers"),
        (lambda: Shape.from_sizes({"gpu": "8"}), "has size '8'"),
        (lambda: Shape.from_sizes({}), "non-empty dict"),
        (lambda: Shape.from_sizes({"my gpu": 2}), "invalid mesh dimension name 'my gpu'"),
        (lambda: S.index(host=0), "coordinate for mesh dimension 'gpu' missing"),
    ],
)
def test_bad_input_names_value_and_what_is_allowed(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)


def test_slice_type_error():
    with pytest.raises(TypeError, match="must be an int, range or slice, got 'a'"):
        S.slice(gpu="a")
