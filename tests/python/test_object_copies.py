"""id(), copy.deepcopy and classes with their own __getattribute__/__setattr__/__delattr__ in compiled code.

id() of an object read from the frame is a constant of the trace (the object is pinned by identity). copy.deepcopy of
constants, containers and plain objects (made in the trace, or read from the frame, whose class copies by the default
protocol) is rebuilt on the trace's values: the copy is a new object of the class, made for real only if it leaves the
trace. Objects whose class overrides attribute access in Python (aliases, validation on assignment) have the override
traced. Each case compares with eager on fresh random inputs and checks that no graph break is left.
"""
import copy

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def assert_no_break(fn, *args):
    result = kiln.explain(fn)(*args)
    kiln.reset()
    assert result.graph_break_count == 0, list(result.break_reasons)
    assert result.graph_count == 1


class Settings:
    def __init__(self, scale, names):
        self.scale = scale
        self.names = names
        self.extra = {"shift": 1.5, "tags": ("a", "b")}


class AliasedSettings:
    """Reads and writes of `factor` go to `scale`; writes are validated (a strict dataclass's hook, in small)."""

    aliases = {"factor": "scale"}

    def __init__(self, scale):
        self.scale = scale
        self.layers = 2

    def __getattribute__(self, key):
        if key != "aliases" and key in super().__getattribute__("aliases"):
            key = super().__getattribute__("aliases")[key]
        return super().__getattribute__(key)

    def __setattr__(self, key, value):
        if key in type(self).aliases:
            key = type(self).aliases[key]
        if key == "scale" and not isinstance(value, (int, float)):
            raise TypeError("scale must be a number")
        super().__setattr__(key, value)

    def __delattr__(self, key):
        if key == "scale":
            raise AttributeError("scale is required")
        super().__delattr__(key)


SETTINGS = Settings(2.0, ["x", "y"])
ALIASED = AliasedSettings(3.0)


def test_id_of_an_object_from_the_frame_is_a_constant():
    def fn(x, obj):
        seen = {id(obj): obj}
        return x * seen[id(obj)].scale if id(obj) in seen else x

    x = random_tensor(4)
    assert_no_break(fn, x, SETTINGS)
    compiled = kiln.compile(fn)
    assert_same_as_eager(fn, x, SETTINGS, compiled=compiled)
    assert_same_as_eager(fn, x, Settings(5.0, []), compiled=compiled)  # another object: guarded, traced again


def test_id_of_an_object_made_in_the_trace_stays_a_break():
    def fn(x):
        obj = Settings(1.0, [])
        return x + (id(obj) > 0)

    assert kiln.explain(fn)(random_tensor(3)).graph_break_count >= 1
    kiln.reset()
    assert_same_as_eager(fn, random_tensor(3))


def test_deepcopy_of_containers_is_a_new_container():
    def fn(x, config):
        mine = copy.deepcopy(config)
        mine["sizes"].append(3)
        mine["pair"] = (mine["pair"][0] * 2, mine["pair"][1])
        return x * len(mine["sizes"]) + mine["pair"][0], config

    x = random_tensor(4)
    config = {"sizes": [1, 2], "pair": (1.5, "b")}
    assert_no_break(fn, x, config)
    assert_same_as_eager(fn, x, config)
    assert config == {"sizes": [1, 2], "pair": (1.5, "b")}


def test_deepcopy_of_an_object_from_the_frame():
    def fn(x, settings):
        mine = copy.deepcopy(settings)
        mine.scale = mine.scale + 1
        mine.names.append("z")
        mine.extra["shift"] = 0.5
        return x * mine.scale + mine.extra["shift"] * len(mine.names)

    x = random_tensor(4)
    assert_no_break(fn, x, SETTINGS)
    compiled = kiln.compile(fn)
    for _ in range(2):
        assert_same_as_eager(fn, x, SETTINGS, compiled=compiled)
    assert SETTINGS.scale == 2.0 and SETTINGS.names == ["x", "y"] and SETTINGS.extra["shift"] == 1.5


def test_a_returned_deepcopy_is_a_new_object_of_its_class():
    def fn(x, settings):
        mine = copy.deepcopy(settings)
        mine.names.append("w")
        return x + 1, mine

    out, mine = kiln.compile(fn)(random_tensor(2), SETTINGS)
    assert type(mine) is Settings and mine is not SETTINGS
    assert mine.names == ["x", "y", "w"] and mine.names is not SETTINGS.names
    assert mine.extra == SETTINGS.extra and mine.extra is not SETTINGS.extra


def test_deepcopy_follows_a_change_of_the_original():
    def fn(x, settings):
        return x * copy.deepcopy(settings).scale

    settings = Settings(2.0, [])
    compiled = kiln.compile(fn)
    x = random_tensor(3)
    assert_same_as_eager(fn, x, settings, compiled=compiled)
    settings.scale = 7.0
    assert_same_as_eager(fn, x, settings, compiled=compiled)


def test_deepcopy_of_a_tensor_or_module_stays_a_break():
    def fn(x, layer):
        return copy.deepcopy(layer)(x) + copy.deepcopy(x)

    layer = nn.Linear(4, 4)
    assert kiln.explain(fn)(random_tensor(2, 4), layer).graph_break_count >= 1
    kiln.reset()
    assert_same_as_eager(fn, random_tensor(2, 4), layer)


def test_aliased_object_copied_read_written_and_deleted():
    def fn(x, settings):
        mine = copy.deepcopy(settings)
        mine.factor = mine.factor * 2  # the alias, through both overrides
        setattr(mine, "bias", 0.25)
        delattr(mine, "layers")
        return x * mine.scale + getattr(mine, "bias") + hasattr(mine, "layers")

    x = random_tensor(4)
    assert_no_break(fn, x, ALIASED)
    assert_same_as_eager(fn, x, ALIASED)
    assert ALIASED.scale == 3.0 and ALIASED.layers == 2


def test_aliased_object_made_in_the_trace_is_rebuilt():
    def fn(x):
        made = AliasedSettings(1.5)
        made.factor = 4.0
        return x * made.factor, made

    x = random_tensor(3)
    assert_no_break(fn, x)
    out, made = kiln.compile(fn)(x)
    torch.testing.assert_close(out, x * 4.0)
    assert type(made) is AliasedSettings and made.scale == 4.0 and "factor" not in vars(made)


@pytest.mark.parametrize("bad", ["setattr", "delattr"])
def test_errors_of_the_overrides_are_eagers(bad):
    def fn(x):
        made = AliasedSettings(1.5)
        try:
            if bad == "setattr":
                made.factor = "big"
            else:
                del made.scale
        except (TypeError, AttributeError) as e:
            return x - 1, str(e)
        return x + 1, ""

    assert_same_as_eager(fn, random_tensor(3))
