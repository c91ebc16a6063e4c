"""Sets, `yield from` and next()/iter() in traced code.

nn.Module's own iterators (children, modules, named_modules, parameters, named_parameters) keep a memo set and
delegate with `yield from`; a model that walks them in forward (timm's RegNet stages, `next(self.parameters())`)
broke the graph at every call. Each test compares with eager on fresh inputs and asserts one graph, no break.
Set iteration order depends on the set's history in CPython; kiln keeps the real set, so loops over a set visit
its items in eager's order.
"""
import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

NAMES = {"first", "second"}


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def graphs_and_breaks(fn, *args):
    e = kiln.explain(fn)(*args)
    kiln.reset()  # explain's entries and counts stay out of the test's own
    return e.graph_count, e.graph_break_count, e.break_reasons


class Stages(nn.Module):
    """timm's RegStage: `for block in self.children(): x = block(x)`."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.ReLU(), nn.Linear(8, 8))
        self.c = nn.Linear(8, 4)
        self.use = {"a", "c"}

    def forward(self, x):
        for block in self.children():
            x = block(x)
        for name, module in self.named_children():
            if name in self.use:
                x = x + module.weight.sum()
        return x


class WalksItsParameters(Stages):
    def forward(self, x):
        first = next(self.parameters())
        count = sum(p.numel() for p in self.parameters())
        seen = set()
        for m in self.modules():
            if m not in seen:
                seen.add(m)
        norms = sum(p.pow(2).sum() for name, p in self.named_parameters() if name.endswith("weight"))
        linears = len([m for _, m in self.named_modules() if isinstance(m, nn.Linear)])
        return x.to(first.dtype) * count / 1000 + len(seen) + norms * linears


@pytest.mark.parametrize("cls", [Stages, WalksItsParameters])
def test_a_module_walking_its_own_children_and_parameters_is_one_graph(cls):
    model = cls()
    x = random_tensor(3, 8)
    graphs, breaks, reasons = graphs_and_breaks(model, x)
    assert (graphs, breaks) == (1, 0), reasons
    assert_same_as_eager(model, x)  # gradients of the parameters too


def test_set_literals_comprehensions_and_methods():
    def f(x):
        s = {1, 2, 3}
        s.add(4)
        s.discard(1)
        t = {i % 3 for i in range(7)} | {7}
        u = t.copy()
        u.update([1, 2], (3,))
        u.difference_update({1})
        u &= {2, 3, 7, 9}
        u -= {9}
        u |= {10}
        u ^= {10, 11}
        both = s & t
        return x * (len(s) + sum(t) + sum(u) + max(both) + len(s - t) + len(s ^ t) + s.isdisjoint({99}) +
                    s.issubset(range(10)) + t.issuperset([0, 1]) + (5 in s) + (4 in s))

    x = random_tensor(5)
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)


def test_sets_of_strings_built_from_iterables_and_compared():
    def f(x):
        letters = set("hello") | set({"k": 1})
        more = {*letters, "z"}
        frozen = frozenset(letters)
        same = frozenset(frozen) is frozen
        ordered = sorted(c for c in more if c != "z")
        return x * (len(more) + len(ordered) + same + (letters <= more) + (letters < more) + (more > letters) +
                    (letters == {"h", "e", "l", "o", "k"}) + (frozen != letters) + len(frozen | {"q"}))

    x = random_tensor(5)
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)


def test_iteration_follows_the_sets_history_as_in_eager():
    # After removals a set keeps its larger table, so the order of 8, 18, 19, 33, 40 is not their order in a set
    # built from them afresh: a loop that weights each item by its position sees eager's order.
    def f(x):
        s = set(range(20))
        for i in range(18):
            s.discard(i)
        s.add(40)
        s.add(8)
        s.add(33)
        return x * sum(i * k for k, i in enumerate(s)) + list(s)[0]

    x = random_tensor(3)
    fresh_order = list(set([18, 19, 40, 8, 33]))
    s = set(range(20))
    for i in range(18):
        s.discard(i)
    s.update([40, 8, 33])
    assert list(s) != fresh_order  # the case the test is about
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)


def test_sets_of_tensors_and_modules_hash_by_identity():
    lin = nn.Linear(3, 3)

    def f(x, y):
        tensors = {x, y, x}
        modules = {lin, lin}
        return x * len(tensors) + (y in tensors) + sum(t.sum() for t in tensors) + len(modules) + (lin in modules)

    x, y = random_tensor(3), random_tensor(3)
    assert graphs_and_breaks(f, x, y)[:2] == (1, 0)
    assert_same_as_eager(f, x, y)


def test_set_errors_are_raised_and_caught_as_in_eager():
    def f(x):
        s = {1}
        try:
            s.remove(5)
        except KeyError:
            x = x + 1
        try:
            s.add([1])
        except TypeError:
            x = x * 3
        s.add(2)
        popped = s.pop()
        return x + popped + len(s)

    x = random_tensor(3)
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)


def test_dict_views_are_set_like():
    # `a.keys() & b.keys()` raised TypeError (the views were traced as lists), where eager gives a set.
    def f(x):
        a = {"a": 1, "b": 2, "c": 3}
        b = {"b": 0, "c": 1, "d": 2}
        both = a.keys() & b.keys()
        only = a.keys() - b.keys()
        pairs = a.items() - {("a", 1)}
        return (x * len(both) + len(only), sorted(both), sorted(pairs), a.keys() == {"a", "b", "c"},
                a.keys() == ["a", "b", "c"], type(a.keys()).__name__, isinstance(a.keys(), list), [k for k in a.keys()])

    assert graphs_and_breaks(f, random_tensor(3))[:2] == (1, 0)
    assert_same_as_eager(f, random_tensor(3))

    def subscripted(x):
        return x * {"a": 1}.keys()[0]

    with pytest.raises(TypeError, match="not subscriptable"):
        kiln.compile(subscripted)(random_tensor(3))


def test_a_returned_set_is_a_new_set_on_every_call():
    compiled = kiln.compile(lambda x: (x + 1, {1, 2}, frozenset({3})))
    first = compiled(torch.ones(2))
    first[1].add(5)
    second = compiled(torch.ones(2))
    assert second[1] == {1, 2} and type(second[1]) is set
    assert second[2] == frozenset({3}) and type(second[2]) is frozenset


def test_a_set_alive_at_a_graph_break_is_the_same_set_after_it():
    @kiln.disable
    def outside(s):
        s.add(100)

    def f(x):
        s = {1, 2}
        alias = s
        x = x * 2
        outside(s)
        return x + len(alias) + (100 in alias)

    x = random_tensor(3)
    assert_same_as_eager(f, x)


def test_a_global_set_is_guarded_by_its_contents():
    def f(x):
        return x * (2 if "third" in NAMES else 1) + len(NAMES)

    compiled = kiln.compile(f)
    x = random_tensor(3)
    torch.testing.assert_close(compiled(x), f(x))
    NAMES.add("third")
    try:
        torch.testing.assert_close(compiled(x), f(x))
    finally:
        NAMES.discard("third")
    torch.testing.assert_close(compiled(x), f(x))


def test_a_module_set_changed_in_place_recompiles():
    # Its module's __dict__ is unchanged, so the guard on the set's contents must not be answered from a snapshot
    # of the dicts alone.
    model = Stages()
    compiled = kiln.compile(model)
    x = random_tensor(3, 8)
    for change in [None, lambda: model.use.discard("c"), lambda: model.use.clear(), lambda: model.use.update("ac")]:
        if change:
            change()
        torch.testing.assert_close(compiled(x), model(x))


def test_changing_a_set_from_outside_the_trace_is_replayed_by_running_eagerly():
    seen = set()

    def f(x):
        seen.add("called")  # a set the frame does not own: the call runs eagerly, and the change is made
        return x + 1

    x = random_tensor(3)
    torch.testing.assert_close(kiln.compile(f)(x), x + 1)
    assert seen == {"called"}


def test_yield_from_generators_and_iterables():
    def inner():
        yield 1
        yield 2
        return 10

    def outer():
        result = yield from inner()
        yield result
        yield from [5, 6]
        yield from (i * i for i in range(3))

    def f(x):
        return x * sum(outer())

    x = random_tensor(3)
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)


def test_next_and_iter_on_generators():
    def gen(n):
        for i in range(n):
            yield i * 2

    def f(x):
        g = gen(3)
        a = next(g)
        b = next(g)
        it = iter([7, 8])
        c = next(it)
        d = next(gen(0), 5)
        try:
            next(gen(0))
        except StopIteration:
            x = x + 100
        return x * (a + b + c + d) + max(gen(4)) + min(i for i in [3, 1, 2])

    x = random_tensor(3)
    assert graphs_and_breaks(f, x)[:2] == (1, 0)
    assert_same_as_eager(f, x)
