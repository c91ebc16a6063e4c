"""Builtins and standard-library helpers that model code iterates with, traced without a graph break.

map, filter, itertools' chain, product, islice, count and repeat, and functools.reduce are traced as Python twins
(kiln._tracing.TRACED_REPLACEMENTS), generators advanced item by item as eager's iterators are; sorted, min and
max with `key=`, list.sort/reverse/remove/clear/copy/count, zip(strict=True), operator functions, enum members
compared by identity, and `x.new_tensor(data)`. Each test compares with eager on fresh inputs and asserts one
graph and no break; the error cases raise what eager raises.
"""
import enum
import functools
import itertools
import operator

import pytest
import torch

import kiln
from kiln.testing import assert_same_as_eager, random_tensor


class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def traces_whole(fn, *args):
    e = kiln.explain(fn)(*args)
    kiln.reset()  # explain's entries and counts stay out of the test's own
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    assert_same_as_eager(fn, *args)


def test_map_filter_and_itertools():
    calls = []

    def scale(t):
        calls.append(1)  # a side effect: map runs it item by item, as eager does
        return t * 2

    def f(x, y):
        total = sum(map(scale, [x, y]))
        total = total + sum(map(operator.mul, [x, y], (y, x)))
        total = total + sum(filter(None, [0, 1, 2])) + sum(filter(lambda v: v > 1, (1, 2, 3)))
        for a, b in itertools.product(range(2), (3, 4)):
            total = total + a * b
        for i, t in enumerate(itertools.chain([x], (y,), itertools.chain.from_iterable([[x, y]]))):
            total = total + t * i
        total = total + sum(itertools.repeat(x, 3)) + sum(itertools.islice(itertools.repeat(y), 2))
        return total + sum(itertools.islice(itertools.count(5, 2), 1, 4)) + sum(itertools.islice((x, y, x), 2))

    traces_whole(f, random_tensor(3), random_tensor(3))


def test_reduce_and_operator_functions():
    def f(x):
        return (functools.reduce(operator.add, [x, x * 2, x * 3]) + functools.reduce(lambda a, b: a * b, [1, 2, 3], 2)
                + operator.mul(x, 3) + operator.truediv(x, 2) + operator.lt(1, 2))

    traces_whole(f, random_tensor(3))


def test_reduce_of_nothing_raises_as_in_eager():
    # The TypeError leaves the inlined twin: a graph break, and the call runs eagerly.
    def f(x):
        try:
            functools.reduce(operator.add, [])
        except TypeError:
            x = x + 1
        return x

    assert_same_as_eager(f, random_tensor(3))


def test_sorted_min_and_max_with_a_key():
    def f(x):
        sizes = {"b": 2, "a": 3, "c": 1}
        by_size = sorted(sizes, key=lambda k: sizes[k])
        newest = sorted(sizes, key=sizes.get, reverse=True)
        tensors = [x * 3, x, x * 2]
        ordered = sorted(tensors, key=lambda t: len(tensors))  # equal keys: stable, the items' own order
        biggest = max(sizes.items(), key=lambda kv: kv[1])
        first = min([x, x + 1], key=lambda t: 0)  # the first of equals, as eager picks
        shortest = min("abc", "de", "f", key=len)
        empty = max([], key=len, default=7)
        return (x * len(by_size[0]) + sizes[newest[0]] + biggest[1] + ordered[0] + first + len(shortest) + empty)

    traces_whole(f, random_tensor(3))


def test_list_methods():
    def f(x):
        items = [3, 1, 2, 1]
        items.sort()
        items.reverse()
        items.remove(2)
        counted = items.count(1)
        copied = items.copy()
        copied.sort(key=lambda v: -v, reverse=True)
        names = ["bb", "a", "ccc"]
        names.sort(key=len)
        emptied = [x, x]
        emptied.clear()
        return x * (items[0] + counted + copied[0] + len(names[0]) + len(emptied))

    traces_whole(f, random_tensor(3))


def test_list_remove_of_a_missing_item_raises_as_in_eager():
    def f(x):
        items = [1, 2]
        try:
            items.remove(5)
        except ValueError:
            x = x * 2
        return x + len(items)

    traces_whole(f, random_tensor(3))


def test_enumerate_with_a_start():
    # enumerate(it, start=k) once ignored its keyword: every index was off by k, with no break.
    def f(x):
        a = [x * i for i, _ in enumerate(range(2), start=5)]
        b = [x + i for i, _ in enumerate([1, 2], 3)]
        return a, b

    traces_whole(f, random_tensor(3))


def test_keywords_that_are_not_strings_raise_as_in_eager():
    # `str("x", **{b"foo": 1})` (CPython's test_grammar) reached enumerate's keyword check with a bytes name: a crash.
    def f(x):
        try:
            str("x", **{b"foo": 1})
        except TypeError:
            x = x + 1
        try:
            enumerate([1], **{b"start": 1})
        except TypeError:
            x = x * 2
        return x

    assert_same_as_eager(f, random_tensor(3), grads=False)


def test_zip_strict():
    def f(x):
        total = x
        for a, b in zip([1, 2], (3, 4), strict=True):
            total = total + a * b
        try:
            list(zip([1, 2], [3], strict=True))
        except ValueError:
            total = total + 100
        return total

    traces_whole(f, random_tensor(3))


def test_enum_members_compare_by_identity():
    def f(x, mode=Mode.EVAL):
        if mode is Mode.TRAIN:
            return x * 2
        return x * mode.value + (Mode.EVAL is mode) + len(Mode)

    traces_whole(f, random_tensor(3))
    compiled = kiln.compile(f)
    x = random_tensor(3)
    torch.testing.assert_close(compiled(x, Mode.TRAIN), f(x, Mode.TRAIN))
    torch.testing.assert_close(compiled(x, Mode.EVAL), f(x, Mode.EVAL))


def test_new_tensor_is_a_graph_constant():
    def f(x):
        weights = x.new_tensor([1.0, 2.0, 3.0])
        ints = x.new_tensor([1, 2, 3], dtype=torch.int64)
        return x * weights + ints + torch.tensor(x.shape).sum()

    traces_whole(f, random_tensor(3))
    x64 = random_tensor(3, dtype=torch.float64)  # new_tensor takes x's dtype: a new graph for float64
    torch.testing.assert_close(kiln.compile(f)(x64), f(x64))


def test_a_returned_iterator_keeps_what_it_has_left():
    def f(x):
        it = iter([x, x * 2, x * 3])
        first = next(it)
        return first, it

    compiled = kiln.compile(f)
    for _ in range(2):
        x = random_tensor(3)
        first, rest = compiled(x)
        torch.testing.assert_close(first, x)
        left = list(rest)
        assert len(left) == 2
        torch.testing.assert_close(left[1], x * 3)
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["fallbacks"] == 0, kiln.stats()
