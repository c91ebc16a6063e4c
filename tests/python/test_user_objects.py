"""Plain user objects in compiled code: instances of the user's own classes made, read, mutated and returned.

An object made in traced code (`cache = Cache()`) lives in the trace as its attribute table: its __init__ and methods
are inlined, properties and static/class methods resolve as CPython resolves them, and the object becomes a real one
only where it leaves the trace (returned, stored outside, live at a graph break), once per object. Objects passed in
have their attribute stores and list appends replayed after the graph. Each case compares with eager on fresh random
inputs, and kiln.explain shows that no graph break is left where these constructs used to break.
"""
import abc
import dataclasses

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


def explain(fn, *args, **kwargs):
    result = kiln.explain(fn)(*args, **kwargs)
    kiln.reset()
    return result


def assert_no_break(fn, *args, **kwargs):
    result = explain(fn, *args, **kwargs)
    assert result.graph_break_count == 0, list(result.break_reasons)
    assert result.graph_count == 1


# --- construction, methods, properties, static and class methods -----------------------------------------------


class Accumulator:
    scale = 2.0

    def __init__(self, x, steps=0):
        self.x = x
        self.steps = steps

    def add(self, y):
        self.x = self.x + y
        self.bump()
        return self

    def bump(self):
        self.steps += 1

    @property
    def doubled(self):
        return self.x * self.scale

    @property
    def total(self):
        return self._total

    @total.setter
    def total(self, value):
        self._total = value * 1

    @staticmethod
    def offset(t):
        return t + 1

    @classmethod
    def starting_at(cls, x):
        return cls(x, steps=10)


def uses_accumulator(a, b):
    acc = Accumulator.starting_at(a)
    acc.add(b).add(b)
    acc.total = acc.doubled
    return acc.total + Accumulator.offset(acc.x) + acc.steps


def test_methods_properties_static_and_class_methods():
    a, b = random_tensor(4, 3), random_tensor(4, 3)
    assert_same_as_eager(uses_accumulator, a, b)
    assert_no_break(uses_accumulator, a, b)


class Base:
    def __init__(self, width):
        super().__init__()  # object.__init__
        self.width = width

    def describe(self):
        return self.width


class Derived(Base):
    def __init__(self, width, t):
        super().__init__(width * 2)
        self.t = t

    def describe(self):
        return super().describe() + 1


def uses_inheritance(t):
    obj = Derived(3, t)
    return obj.t * obj.describe(), isinstance(obj, Base), type(obj) is Derived


def test_inheritance_with_super_init():
    t = random_tensor(5)
    assert_same_as_eager(uses_inheritance, t)
    assert_no_break(uses_inheritance, t)


class Flags:
    def __init__(self):
        self.a = 1


def attribute_protocol(t):
    f = Flags()
    out = t * (2 if hasattr(f, "a") else 3)
    out = out + getattr(f, "missing", 5)
    f.b = 4
    del f.a
    try:
        f.a
    except AttributeError:
        out = out - 1
    return out * f.b, hasattr(f, "a")


def test_hasattr_getattr_delete_and_attribute_error():
    t = random_tensor(3)
    assert_same_as_eager(attribute_protocol, t)
    assert_no_break(attribute_protocol, t)


# --- objects leaving the trace ---------------------------------------------------------------------------------


class Pair:
    def __init__(self, left, right):
        self.left = left
        self.right = right
        self.parts = [left, right]


def returns_objects(x):
    p = Pair(x.sin(), x.cos())
    holder = Pair(p, 3)
    return p, holder, p.parts


def test_returned_object_keeps_identity_type_and_attributes():
    x = random_tensor(4)
    assert_same_as_eager(returns_objects, x)
    p, holder, parts = kiln.compile(returns_objects)(x)
    assert type(p) is Pair and type(holder) is Pair
    assert holder.left is p, "one object per traced object, however many paths reach it"
    assert parts is p.parts
    assert list(vars(p)) == ["left", "right", "parts"]
    torch.testing.assert_close(p.left, x.sin())
    assert p.parts[0] is p.left


@kiln.disable
def opaque(p):
    return p.left * 2


def object_live_at_a_break(x):
    p = Pair(x + 1, x - 1)
    y = opaque(p)  # a graph break with `p` live: rebuilt before the break, the same object afterwards
    p.left = y
    return p, p.right * y


def test_object_live_at_a_graph_break():
    x = random_tensor(4)
    assert_same_as_eager(object_live_at_a_break, x)
    result = explain(object_live_at_a_break, x)
    assert result.graph_break_count == 1 and "kiln.disable" in result.break_reasons[0]


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        p = Pair(self.lin(x), x)
        self.last = p  # escapes through a store: the same object the call returns
        return p


def test_object_stored_on_a_module_is_the_returned_object():
    module = Holder()
    x = random_tensor(2, 4)
    out = kiln.compile(module)(x)
    assert module.last is out and type(out) is Pair
    torch.testing.assert_close(out.left, module.lin(x))


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    cache: object = None


def returns_a_record_holding_an_object(x):
    cache = KVCache()
    k, v = cache.update(x.unsqueeze(0), x.unsqueeze(0) * 2, 0)
    out = Output(hidden=k.sum(0), cache=cache)
    assert out.cache is cache  # the record's field reads back the traced object
    return out, cache


def test_record_holding_an_object_made_in_the_trace():
    x = random_tensor(2, 3)
    assert_same_as_eager(returns_a_record_holding_an_object, x)
    assert_no_break(returns_a_record_holding_an_object, x)
    out, cache = kiln.compile(returns_a_record_holding_an_object)(x)
    assert type(out) is Output and out.cache is cache and type(cache.layers[0]) is GrowingLayer


# --- objects from outside the trace, mutated ----------------------------------------------------------------------


class RunningState:
    def __init__(self, total):
        self.total = total
        self.history = []


def step(state, x):
    state.total = state.total + x
    state.history.append(x * 2)
    state.calls = len(state.history)
    return state.total.sum()


def test_object_holding_tensors_is_mutated_across_calls():
    compiled = kiln.compile(step)
    eager_state, kiln_state = RunningState(torch.zeros(3)), RunningState(torch.zeros(3))
    kiln_history = kiln_state.history
    for _ in range(3):
        x = random_tensor(3)
        torch.testing.assert_close(compiled(kiln_state, x), step(eager_state, x))
    assert kiln_state.history is kiln_history
    assert kiln_state.calls == eager_state.calls == 3
    torch.testing.assert_close(kiln_state.total, eager_state.total)
    for mine, theirs in zip(kiln_state.history, eager_state.history, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert_no_break(step, RunningState(torch.zeros(3)), random_tensor(3))


# --- a DynamicCache-like KV cache in an attention loop ---------------------------------------------------------------


class LayerCache(abc.ABC):
    is_sliding = False

    def __init__(self):
        self.keys = None
        self.values = None

    @abc.abstractmethod
    def update(self, k, v): ...


class GrowingLayer(LayerCache):
    def update(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def seq_length(self):
        return 0 if self.keys is None else self.keys.shape[-2]


class KVCache:
    def __init__(self, num_layers=0):
        self.layers = [GrowingLayer() for _ in range(num_layers)]

    def __len__(self):
        return len(self.layers)

    def update(self, k, v, layer_idx):
        while len(self.layers) <= layer_idx:
            self.layers.append(GrowingLayer())
        return self.layers[layer_idx].update(k, v)

    def get_seq_length(self, layer_idx=0):
        return self.layers[layer_idx].seq_length() if layer_idx < len(self) else 0


class TinyAttention(nn.Module):
    def __init__(self, layers=2, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x, cache=None):
        if cache is None:
            cache = KVCache()
        past = cache.get_seq_length()
        b, s, d = x.shape
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out)):
            q, k, v = qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            k, v = cache.update(k, v, i)
            attn = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
            x = x + out((attn @ v).transpose(1, 2).reshape(b, s, d))
        return x, cache, past


def test_kv_cache_made_in_forward_has_no_graph_break():
    model = TinyAttention().eval()
    x = random_tensor(2, 5, 16)
    with torch.no_grad():
        assert_same_as_eager(model, x)
        assert_no_break(model, x)
        y, cache, past = kiln.compile(model)(x)
    assert type(cache) is KVCache and past == 0
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, GrowingLayer]
    assert cache.layers[0].keys.shape == (2, 2, 5, 8)


def test_kv_cache_passed_back_in_grows_like_eager():
    model = TinyAttention().eval()
    compiled = kiln.compile(model)
    with torch.no_grad():
        eager_cache, kiln_cache = KVCache(), KVCache()
        for s in (5, 1, 1):
            x = random_tensor(2, s, 16)
            expected, _, expected_past = model(x, eager_cache)
            actual, returned, past = compiled(x, kiln_cache)
            assert returned is kiln_cache and past == expected_past
            torch.testing.assert_close(actual, expected)
        for mine, theirs in zip(kiln_cache.layers, eager_cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys)
            torch.testing.assert_close(mine.values, theirs.values)


def test_training_through_a_kv_cache_matches_eager_gradients():
    model = TinyAttention().train()
    x = random_tensor(2, 4, 16, requires_grad=True)
    assert_same_as_eager(model, x, grads=True)
    assert_no_break(model, x)


# --- what stays a graph break -----------------------------------------------------------------------------------------


class Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


class Abstract(abc.ABC):
    @abc.abstractmethod
    def f(self): ...


def makes_slotted(x):
    return Slotted(x * 2).t + 1


def makes_abstract(x):
    try:
        Abstract()
    except TypeError:
        return x + 1
    return x


@pytest.mark.parametrize("fn, reason", [(makes_slotted, "__slots__"), (makes_abstract, "abstract")])
def test_classes_outside_the_rules_break_with_a_reason(fn, reason):
    x = random_tensor(3)
    assert_same_as_eager(fn, x)
    result = explain(fn, x)
    assert result.graph_break_count >= 1
    assert any(reason in str(r) for r in result.break_reasons), list(result.break_reasons)
