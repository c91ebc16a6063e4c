"""Idioms of library model code (transformers, timm) that once split graphs: list indices, partials kept on modules.

Each test compares with eager over several calls with fresh inputs and asserts the code is captured whole.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.testing import random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def test_list_indices_are_read_as_tensors_of_their_values():
    # x[..., [-2], :] (Falcon's multi-query heads) made its index tensor on the fake's meta device, where the values
    # were lost: every such subscript was a graph break.
    def f(x, y):
        y = y.clone()
        y[[0, 2]] = x[[1, 1]]
        y[:, [3, 0]] *= 2
        return y, x[..., [-2], :] * 2, x[:, [0, 2]], x[([0, 1], [1, 0])]

    compiled = kiln.compile(f)
    for _ in range(3):
        x, y = random_tensor(3, 4, 5), random_tensor(3, 4, 5)
        for got, want in zip(compiled(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1


def test_a_boolean_list_index_inside_a_tuple_runs_eagerly():
    # A mask index has a size that depends on its data: a break, with eager's answer.
    def f(x):
        return x[:, [True, False, True, False]] + 1, x[[True, False, True]]

    compiled = kiln.compile(f)
    x = random_tensor(3, 4)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want)


def _scaled(x, k, scale=1.0):
    return x * k * scale


SHARED = functools.partial(torch.add, alpha=2)


class WithPartials(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = functools.partial(F.gelu, approximate="tanh")  # transformers' GELUTanh
        self.scaled = functools.partial(_scaled, k=3)

    def forward(self, x):
        return self.act(x) + self.scaled(x, scale=0.5) + SHARED(x, x)


def test_partials_kept_on_a_module_are_called_in_the_graph_and_guarded():
    m = WithPartials()
    compiled = kiln.compile(m)
    for _ in range(2):
        x = random_tensor(4, 6)
        torch.testing.assert_close(compiled(x), m(x))
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1
    # A new partial, and a changed keyword of the same partial, are seen on the next call.
    m.scaled = functools.partial(_scaled, k=5)
    x = random_tensor(4, 6)
    torch.testing.assert_close(compiled(x), m(x))
    m.scaled.keywords["k"] = 7
    torch.testing.assert_close(compiled(x), m(x))
    m.act = functools.partial(F.gelu, approximate="none")
    torch.testing.assert_close(compiled(x), m(x))
