"""`with` blocks on user context managers: classes with Python __enter__/__exit__, and @contextlib.contextmanager
functions, traced without a graph break. The block's effects (a log list, an attribute) happen as in eager, call by
call; an exception inside the block, a graph break inside it and a generator body that cannot be traced keep eager's
behaviour. Each test compares with eager on fresh inputs.
"""
import contextlib

import pytest
import torch

import kiln
from kiln.testing import random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


class Scaled:
    def __init__(self, log, factor):
        self.log = log
        self.factor = factor

    def __enter__(self):
        self.log.append("enter")
        return self.factor

    def __exit__(self, kind, value, traceback):
        self.log.append("exit" if kind is None else f"exit {kind.__name__}")
        return False


@contextlib.contextmanager
def doubled(log, n):
    log.append(f"before {n}")
    try:
        yield n * 2
    finally:
        log.append(f"after {n}")


def graphs_and_breaks(fn, *args):
    e = kiln.explain(fn)(*args)
    kiln.reset()
    return e.graph_count, e.graph_break_count, e.break_reasons


def run_both(fn, *shapes, calls=3):
    """Eager and compiled on the same fresh inputs, each with its own log; returns the two logs."""
    compiled = kiln.compile(fn)
    logs = ([], [])
    for i in range(calls):
        args = [random_tensor(*s) for s in shapes]
        expected = fn(logs[0], *args)
        actual = compiled(logs[1], *args)
        torch.testing.assert_close(actual, expected)
    return logs


def test_a_class_with_python_enter_and_exit_is_traced():
    def f(log, x):
        with Scaled(log, 3.0) as s:
            y = x * s
        return y + len(log)

    assert graphs_and_breaks(f, [], random_tensor(3))[:2] == (1, 0)
    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log == ["enter", "exit"] * 3


SHARED = Scaled([], 2.0)


def test_a_context_manager_read_from_the_frame_is_traced():
    def f(log, x):
        SHARED.log = log
        with SHARED as s:
            return x * s

    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log == ["enter", "exit"] * 3


def test_a_contextmanager_function_is_traced():
    def f(log, x):
        with doubled(log, 3) as k:
            y = x * k
        with doubled(log, 1):
            y = y + 1
        return y

    assert graphs_and_breaks(f, [], random_tensor(3))[:2] == (1, 0)
    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log


def test_an_exception_inside_the_block_reaches_exit_as_in_eager():
    def f(log, x):
        try:
            with Scaled(log, 2.0):
                if x.shape[0] == 3:
                    raise KeyError("inside")
        except KeyError:
            x = x + 1
        try:
            with doubled(log, 5):
                raise ValueError("inside")
        except ValueError:
            x = x * 2
        return x

    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log
    assert eager_log[:5] == ["enter", "exit KeyError", "before 5", "after 5", "enter"]


def test_a_graph_break_inside_the_block_keeps_the_effects_in_order():
    def f(log, x):
        with Scaled(log, 2.0) as s:
            y = x * s
            log.append(f"rows {int(y.shape[0])}")
            torch._dynamo.graph_break() if False else print(end="")  # a graph break inside the block
            y = y + 1
        with doubled(log, 2) as k:
            print(end="")
            y = y * k
        return y

    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log


@contextlib.contextmanager
def untraceable(log):
    log.append(sorted({3, 1, 2}.__iter__()))  # set iterators: not traced inside a generator
    previous = torch.get_num_threads()  # reads process state: a break inside the generator
    yield previous
    log.append("done")


def test_a_generator_body_that_breaks_moves_the_break_before_the_with():
    def f(log, x):
        y = x + 1
        with untraceable(log) as n:
            y = y * (n > 0)
        return y

    graphs, breaks, reasons = graphs_and_breaks(f, [], random_tensor(3))
    assert graphs >= 1 and breaks >= 1, reasons
    eager_log, kiln_log = run_both(f, (3,))
    assert kiln_log == eager_log
