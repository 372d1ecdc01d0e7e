import pytest

from oci_gpu_hook.frozen import Frozen


class Point(Frozen):
    __slots__ = ("x", "y")
    _defaults = {"y": 0}


class Tagged(Point):
    __slots__ = ("tags",)
    _defaults = {"y": 0, "tags": ()}


def test_construction_defaults_and_equality():
    assert Point(1) == Point(x=1, y=0) != Point(1, 2)
    assert Point(1, 2) != Tagged(1, 2)
    assert hash(Point(1, 2)) == hash(Point(x=1, y=2))
    assert repr(Tagged(1, tags=("a",))) == "Tagged(x=1, y=0, tags=('a',))"


def test_frozen_and_replace():
    p = Point(1, 2)
    with pytest.raises(AttributeError):
        p.x = 3
    assert p.replace(y=5) == Point(1, 5) and p == Point(1, 2)


@pytest.mark.parametrize("args, kwargs", [((1, 2, 3), {}), ((1,), {"x": 2}), ((), {}), ((1,), {"z": 1})])
def test_bad_construction(args, kwargs):
    with pytest.raises(TypeError):
        Point(*args, **kwargs)


def test_to_json_nests():
    assert Tagged(Point(1), tags=(Point(2, 3),)).to_json() == {
        "x": {"x": 1, "y": 0},
        "y": 0,
        "tags": [{"x": 2, "y": 3}],
    }
