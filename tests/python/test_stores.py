"""Attribute and global assignments inside compiled code (`self.cache = h`, `self.ema = ...`, `global n`).

They are traced without a graph break: later reads in the trace see the new value, and the compiled frame
makes the same assignments right after its graph, so every reader outside (the caller, the code at a
break) sees what eager shows. Assignments whose effect the trace cannot follow (a property setter, a
built-in torch module's attribute) stay graph breaks. Each case runs a compiled copy and an eager copy of
the same state side by side on fresh random inputs.
"""
import copy

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import random_tensor, tolerance

PRINTED = []


@kiln.disable
def record(*values):
    PRINTED.append(values)


def close(a, b):
    rtol, atol = tolerance(a.dtype)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


class RunningState(nn.Module):
    """A tensor attribute, a replaced buffer (an EMA written without in-place ops) and a step count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.last = None

    def forward(self, x):
        h = self.lin(x)
        self.last = h
        self.ema = self.ema * 0.9 + h.mean(0) * 0.1
        self.steps = self.steps + 1
        return torch.relu(h) * self.ema  # reads the new EMA, as eager does


def test_module_attributes_and_buffers_are_assigned_without_a_break(fresh_kiln):
    eager = RunningState()
    model = copy.deepcopy(eager)
    compiled = kiln.compile(model)
    for _ in range(3):
        x = random_tensor(4, 8)
        out, ref = compiled(x), eager(x)
        close(out, ref)
        close(model.ema, eager.ema)
        close(model.last, eager.last)
        assert int(model.steps) == int(eager.steps)
        assert "ema" in model._buffers and "last" not in model._buffers
    stats = kiln.stats()
    assert stats["graph_breaks"] == 0 and stats["fallbacks"] == 0, stats
    # One recompile: after the first call the EMA carries the Linear's autograd history (requires_grad), as
    # in eager; from then on the entry serves.
    assert stats["frames_compiled"] == 2 and stats["cache_hits"] == 1, stats
    assert kiln.explain(model)(random_tensor(4, 8)).graph_count == 1


def test_gradients_flow_through_assigned_tensors(fresh_kiln):
    eager = RunningState()
    model = copy.deepcopy(eager)
    compiled = kiln.compile(model)
    x = random_tensor(4, 8)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    assert model.last.grad_fn is not None
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        close(p.grad, q.grad)


class KeepsOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = None

    def forward(self, x):
        y = self.lin(x).sin()
        self.cache = y
        return y


def test_a_stored_output_is_the_returned_object(fresh_kiln):
    model = KeepsOutput()
    compiled = kiln.compile(model)
    x = random_tensor(3, 4)
    out = compiled(x)
    assert model.cache is out
    close(out, torch.sin(model.lin(x)))
    assert kiln.stats()["graph_breaks"] == 0


def test_store_before_a_break_is_seen_by_the_break(fresh_kiln):
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 1.5
            self.seen = None

        def forward(self, x):
            h = x.cos()
            self.seen = h
            self.scale = 2.5
            record(self.seen, self.scale)  # a graph break: the assignments are made before it
            return h * self.scale

    PRINTED.clear()
    model = Breaks()
    compiled = kiln.compile(model)
    x = random_tensor(5)
    out = compiled(x)
    close(out, x.cos() * 2.5)
    seen, scale = PRINTED[-1]
    assert seen is model.seen and scale == 2.5
    close(seen, x.cos())
    assert kiln.stats()["graph_breaks"] == 1


CALLS = 0
TOTAL = None


def _bump(x):
    global CALLS, TOTAL
    CALLS += 1
    TOTAL = x.sum() if TOTAL is None else TOTAL + x.sum()
    return x * CALLS


def counts_globals(x):
    y = _bump(x)  # an inlined helper assigns this module's globals
    return y + CALLS  # and the caller reads the new value


def test_globals_assigned_in_inlined_code(fresh_kiln):
    global CALLS, TOTAL
    CALLS, TOTAL = 0, None
    compiled = kiln.compile(counts_globals)
    x = random_tensor(6)
    out = compiled(x)
    close(out, x * 1 + 1)
    assert CALLS == 1
    close(TOTAL, x.sum())
    out = compiled(x)  # CALLS is now 2: a guard on its value recompiles
    close(out, x * 2 + 2)
    assert CALLS == 2
    close(TOTAL, 2 * x.sum())
    assert kiln.stats()["graph_breaks"] == 0


class State:
    def __init__(self):
        self.value = None


def test_attribute_of_a_plain_object_argument(fresh_kiln):
    def update(state, x):
        state.value = x * 2
        return state.value + 1

    compiled = kiln.compile(update)
    a, b = State(), State()
    x = random_tensor(3, 3)
    close(compiled(a, x), update(b, x))
    close(a.value, b.value)
    assert kiln.stats()["graph_breaks"] == 0


class WithProperty(nn.Module):
    def __init__(self):
        super().__init__()
        self._factor = 1.0
        self.drop = nn.Dropout(0.5)

    @property
    def factor(self):
        return self._factor

    @factor.setter
    def factor(self, value):
        self._factor = value * 10  # code the trace does not run: a graph break at the store

    def forward(self, x):
        self.factor = 0.5
        self.drop.p = 0.0  # a built-in module called as a whole: a graph break at the store
        return self.drop(x) * self.factor


def test_stores_the_trace_cannot_follow_break_and_match_eager(fresh_kiln):
    model = WithProperty()
    compiled = kiln.compile(model)
    x = random_tensor(4)
    out = compiled(x)
    close(out, x * 5.0)
    assert model.factor == 5.0 and model.drop.p == 0.0
    assert kiln.stats()["graph_breaks"] == 2


def test_assigning_a_plain_tensor_to_a_parameter_raises_as_eager(fresh_kiln):
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            self.w = x * 2  # eager: TypeError (a parameter must be assigned a Parameter)
            return x

    with pytest.raises(TypeError, match="cannot assign"):
        Bad()(torch.ones(3))
    with pytest.raises(TypeError, match="cannot assign"):
        kiln.compile(Bad())(torch.ones(3))
