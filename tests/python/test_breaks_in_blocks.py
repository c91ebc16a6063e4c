"""Graph breaks inside loops, try bodies and user context managers (issue 3).

The graph so far is compiled, the construct runs in Python, and a resume function that is itself traced
continues inside the loop, the try body or the with block (csrc/trace/graph_break.h). Each case is compared
with eager: outputs and gradients (kiln.testing.assert_same_as_eager), the order of the side effects it
records, the exception it raises; and each asserts its number of graphs and breaks.
"""
import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor


EVENTS = []


@kiln.disable
def record(*values):
    """An untraceable call whose effect the tests can see, in order."""
    EVENTS.append(values)


@kiln.disable
def fail_if(flag, message):
    if flag:
        raise RuntimeError(message)


def same_events_per_run(runs=2):
    """EVENTS holds `runs` runs (eager, then compiled): each run recorded the same events."""
    assert len(EVENTS) % runs == 0, EVENTS
    n = len(EVENTS) // runs
    for k in range(1, runs):
        assert EVENTS[k * n:(k + 1) * n] == EVENTS[:n], EVENTS
    return EVENTS[:n]


def check(fn, *args, graphs, breaks, fallbacks=0, calls=2, grads=True):
    """Compiled matches eager on `calls` calls (outputs, gradients, events in order); explain's counts match.
    Returns the events of one run."""
    kiln.reset()
    compiled = kiln.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a recompile-limit warning fails the test
        for _ in range(calls):
            EVENTS.clear()
            assert_same_as_eager(fn, *args, compiled=compiled, grads=grads)
            events = same_events_per_run()
    stats = kiln.stats()
    assert stats["graph_breaks"] == breaks, stats
    assert stats["fallbacks"] == fallbacks, stats
    result = kiln.explain(fn)(*args)
    assert result.graph_count == graphs, result
    assert result.graph_break_count == breaks + fallbacks, result
    return events


def check_raises(fn, *args, error, breaks):
    """Compiled raises what eager raises, after the same events, on two calls."""
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(2):
        EVENTS.clear()
        with pytest.raises(error) as eager_error:
            fn(*args)
        with pytest.raises(error) as kiln_error:
            compiled(*args)
        assert str(kiln_error.value) == str(eager_error.value)
        events = same_events_per_run()
    stats = kiln.stats()
    assert stats["graph_breaks"] == breaks and stats["fallbacks"] == 0, stats
    return events


# --- loops -----------------------------------------------------------------------------------------

def print_per_iteration(x):
    for i in range(4):
        x = x * 2 + i
        record("iteration", i)
    return x.sin()


def test_loop_with_a_print_per_iteration(fresh_kiln):
    # The frame's graph up to the first break, then one resume call per iteration: one code object.
    events = check(print_per_iteration, random_tensor(3, requires_grad=True), graphs=5, breaks=4)
    assert events == [("iteration", i) for i in range(4)]


class ItemBranchLayers(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if x.mean().item() > 0:  # .item() steers control flow: a break per layer
                x = x.relu()
            else:
                x = x.tanh()
        return x


def test_module_list_loop_with_an_item_branch(fresh_kiln):
    torch.manual_seed(0)
    check(ItemBranchLayers(), random_tensor(3, 6, requires_grad=True), graphs=5, breaks=4)


class TwelveLayersWithPrint(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x).relu()
            record("layer", i)
        return x.sum(-1)


def test_twelve_layers_with_a_print_stay_within_the_limits(fresh_kiln):
    model = TwelveLayersWithPrint()
    # One entry per layer on the loop's resume code: not recompiles of an unstable frame (check() turns the
    # recompile-limit warning into an error), and all of them hit on the second call.
    events = check(model, random_tensor(2, 8, requires_grad=True), graphs=13, breaks=12)
    assert events == [("layer", i) for i in range(12)]
    assert kiln.stats()["cache_hits"] > 0


def halve_until_small(x):
    steps = 0
    while True:
        x = x * 0.5
        steps += 1
        if x.abs().max() < 0.1:  # a data-dependent break out of the loop
            break
    return x * steps


def test_while_loop_with_a_data_dependent_break(fresh_kiln):
    check(halve_until_small, torch.tensor([3.0, -5.0, 1.0]), graphs=7, breaks=6)


def count_up(x):
    while x.sum() < 40:  # a tensor-valued loop condition (14 iterations from zeros)
        x = x + 1
    return x


def test_while_loop_on_a_tensor_condition_reuses_one_entry(fresh_kiln):
    # 3.12 compiles the condition twice (before the loop and at the bottom of the body): one more break site.
    graphs, breaks = (3, 2) if sys.version_info < (3, 12) else (4, 3)
    check(count_up, torch.zeros(3), graphs=graphs, breaks=breaks)
    # The body's resume code has one entry, hit on every later iteration.
    stats = kiln.stats()
    assert stats["recompiles"] == 0 and stats["cache_hits"] >= 2 * 12, stats  # 14 iterations per call


def nested_loops(x):
    for i in range(3):
        for j in range(2):
            x = x + i * j
            record(i, j)
        x = x * 1.5
    return x


def test_nested_loops(fresh_kiln):
    events = check(nested_loops, random_tensor(4, requires_grad=True), graphs=7, breaks=6)
    assert events == [(i, j) for i in range(3) for j in range(2)]


def zip_of_lists(x, scales, shifts):
    for k, (scale, shift) in enumerate(zip(scales, shifts)):
        x = x * scale + shift
        record("step", k, tuple(x.shape))
    return x


def test_loop_over_a_zip_of_argument_lists(fresh_kiln):
    scales = [random_tensor(3) for _ in range(3)]
    check(zip_of_lists, random_tensor(3, requires_grad=True), scales, [1.0, 2.0, 3.0], graphs=4, breaks=3)


def long_loop(x):
    for i in range(100):
        x = x + 1
        record(i)
    return x


def test_loop_with_too_many_iterations_left_runs_the_frame_eagerly(fresh_kiln):
    check(long_loop, random_tensor(3), graphs=0, breaks=0, fallbacks=1)


def test_deep_loop_goes_on_eagerly_below_the_recursion_limit(fresh_kiln):
    def deep(n, fn, x):
        return fn(x) if n == 0 else deep(n - 1, fn, x)

    compiled = kiln.compile(count_up)
    start = torch.zeros(3)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        # 14 iterations nested 14 resume calls deeper would exceed the nesting depth: the loop goes on eagerly instead.
        for n in (0, 60):
            torch.testing.assert_close(deep(n, compiled, start), count_up(start))
    finally:
        sys.setrecursionlimit(limit)


# --- try bodies ------------------------------------------------------------------------------------

def try_with_a_break(x, fail):
    y = x + 1
    try:
        record("try")
        fail_if(fail, "kiln test: failed in the try body")  # the break call itself raises
        y = y * 2
    except RuntimeError as error:
        record("except", str(error))
        y = y * 3
    finally:
        record("finally")
    return y.cos()


def test_break_in_a_try_body_without_an_exception(fresh_kiln):
    events = check(try_with_a_break, random_tensor(3, requires_grad=True), False, graphs=4, breaks=3)
    assert events == [("try",), ("finally",)]


def test_break_in_a_try_body_with_an_exception(fresh_kiln):
    # The handler (and what follows it) runs in Python: the exception left the traced code.
    events = check(try_with_a_break, random_tensor(3, requires_grad=True), True, graphs=2, breaks=2)
    assert events == [("try",), ("except", "kiln test: failed in the try body"), ("finally",)]


def raise_after_a_break(x, fail):
    y = x.sin()
    try:
        record("before")
        y = y + 1
        if fail:
            raise KeyError("kiln test")  # raised and caught in the resume function's trace
        y = y * 2
    except KeyError:
        record("caught")
        y = y - 1
    return y


def test_exception_raised_after_a_break_in_the_try_body(fresh_kiln):
    # The resume function's second break would be inside the except block, where the handled exception must stay
    # current (sys.exc_info(), a bare raise): that frame runs eagerly instead.
    events = check(raise_after_a_break, random_tensor(3, requires_grad=True), True, graphs=1, breaks=1, fallbacks=1)
    assert events == [("before",), ("caught",)]


def uncaught_in_try(x):
    try:
        record("try")
        fail_if(True, "kiln test: not caught")
    except KeyError:
        record("wrong handler")
    finally:
        record("finally")
    return x


def test_exception_passing_through_a_try_runs_its_finally(fresh_kiln):
    events = check_raises(uncaught_in_try, random_tensor(3), error=RuntimeError, breaks=2)
    assert events == [("try",), ("finally",)]


def try_in_a_loop(x):
    for i in range(4):
        try:
            fail_if(i % 2 == 1, "odd")
            x = x + i
        except RuntimeError:
            record("skip", i)
            continue
        x = x * 1.5
    return x


def test_try_inside_a_loop(fresh_kiln):
    # Iteration 0 resumes compiled; the first exception's handler runs in Python and the loop goes on there.
    events = check(try_in_a_loop, random_tensor(3, requires_grad=True), graphs=2, breaks=2)
    assert events == [("skip", 1), ("skip", 3)]


# --- user context managers -------------------------------------------------------------------------

class Tracked:
    """A user context manager that records its calls; suppresses exceptions when `suppress`."""

    def __init__(self, suppress=False):
        self.suppress = suppress

    @kiln.disable
    def __enter__(self):
        record("enter")
        return self

    @kiln.disable
    def __exit__(self, kind, value, traceback):
        record("exit", kind.__name__ if kind else None)
        return self.suppress


def break_in_user_block(x, manager):
    y = x * 2
    with manager:
        y = y + 1
        record("body")
        y = y * 3
    return y.sin()


def test_user_context_manager_with_a_break_in_its_block(fresh_kiln):
    events = check(break_in_user_block, random_tensor(3, requires_grad=True), Tracked(), graphs=4, breaks=3)
    assert events == [("enter",), ("body",), ("exit", None)]


def raise_in_user_block(x, manager):
    y = x * 2
    with manager:
        y = y + 1
        record("body")
        raise ValueError("kiln test: raised in the block")
    return y * 5


def test_exception_suppressed_by_a_user_context_manager(fresh_kiln):
    # Breaks: record() twice, and the raise (the exception is made in the trace; eager raises it into __exit__).
    events = check(raise_in_user_block, random_tensor(3, requires_grad=True), Tracked(suppress=True),
                   graphs=3, breaks=3)
    assert events == [("enter",), ("body",), ("exit", "ValueError")]


def test_exception_not_suppressed_by_a_user_context_manager(fresh_kiln):
    events = check_raises(raise_in_user_block, random_tensor(3), Tracked(), error=ValueError, breaks=3)
    assert events == [("enter",), ("body",), ("exit", "ValueError")]


@contextlib.contextmanager
def tagged(name):
    record("open", name)
    try:
        yield name.upper()
    finally:
        record("close", name)


def generator_context_manager(x):
    with tagged("block") as label:
        y = x.sin()
        record("inside", label)
    return y.cos()


def test_contextlib_contextmanager(fresh_kiln):
    events = check(generator_context_manager, random_tensor(3, requires_grad=True), graphs=5, breaks=4)
    assert events == [("open", "block"), ("inside", "BLOCK"), ("close", "block")]


def write_shape(x, path):
    y = x * 2
    with open(path, "a") as f:
        f.write(f"{tuple(y.shape)}\n")
        y = y + 1
    return y.relu()


def test_open_file_write_inside_a_compiled_function(fresh_kiln, tmp_path):
    path = str(tmp_path / "shapes.txt")
    # open, entering the block, f.write, __exit__ (the io and codecs frames run untraced: standard library)
    check(write_shape, random_tensor(2, 3, requires_grad=True), path, graphs=5, breaks=4)
    with open(path) as f:
        assert f.read() == "(2, 3)\n" * 5  # two eager and two compiled calls, then explain's run


def user_block_in_a_loop(x, manager):
    for i in range(3):
        with manager:
            x = x + i
            record("step", i)
    return x


def test_user_context_manager_inside_a_loop(fresh_kiln):
    events = check(user_block_in_a_loop, random_tensor(3, requires_grad=True), Tracked(), graphs=10, breaks=9)
    assert events == [e for i in range(3) for e in (("enter",), ("step", i), ("exit", None))]


def no_grad_inside_try(x):
    try:
        with torch.no_grad():
            y = x * 2
            fail_if(True, "kiln test: inside no_grad")
    except RuntimeError:
        record("grad enabled in handler", torch.is_grad_enabled())
        y = x * 3
    return y


def test_grad_mode_block_inside_a_try_body(fresh_kiln):
    events = check(no_grad_inside_try, random_tensor(3, requires_grad=True), graphs=1, breaks=1)
    assert events == [("grad enabled in handler", True)]
    assert torch.is_grad_enabled()


def loop_inside_no_grad(x, w):
    y = x * w
    with torch.no_grad():
        for i in range(3):
            y = y * 2 + i
            record("grad enabled", torch.is_grad_enabled())
    return x * w + y


def test_loop_inside_a_grad_mode_block(fresh_kiln):
    events = check(loop_inside_no_grad, random_tensor(3), random_tensor(3, requires_grad=True), graphs=4, breaks=3)
    assert events == [("grad enabled", False)] * 3
    assert torch.is_grad_enabled()


def test_break_records_say_where_the_break_is(fresh_kiln):
    result = kiln.explain(print_per_iteration)(random_tensor(3))
    assert all("inside a loop" in b["explanation"] for b in result.breaks), result.breaks
    result = kiln.explain(try_with_a_break)(random_tensor(3), False)
    assert any("try body" in b["explanation"] for b in result.breaks), result.breaks
    result = kiln.explain(break_in_user_block)(random_tensor(3), Tracked())
    assert [b["type"] for b in result.breaks][0] == "with", result.breaks
    assert os.path.basename(__file__) in result.breaks[0]["file"]


# --- torch.autocast: its casts recorded, never a silently wrong dtype ------------------------------------------------

def autocast_block(x, w):
    y = x.relu()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = y @ w  # bfloat16 under autocast
    return z, z.dtype


def test_autocast_block_is_traced_with_its_casts(fresh_kiln):
    # The block is entered and left at trace time: one graph, autocast's casts in it (test_autocast.py has more).
    check(autocast_block, random_tensor(4, 4, requires_grad=True), random_tensor(4, 4), graphs=1, breaks=0)
    assert kiln.compile(autocast_block)(random_tensor(4, 4), random_tensor(4, 4))[1] == torch.bfloat16
    ops = kiln.explain(autocast_block)(random_tensor(4, 4), random_tensor(4, 4)).ops_per_graph
    assert ops[0][-3:] == ["aten::_to_copy.default", "aten::_to_copy.default", "aten::mm.default"], ops
    assert not torch.is_autocast_enabled("cpu")


def plain_matmul(x, w):
    return (x @ w).relu()


def test_entries_do_not_mix_inside_and_outside_autocast(fresh_kiln):
    compiled = kiln.compile(plain_matmul)
    x, w = random_tensor(4, 4), random_tensor(4, 4)
    assert compiled(x, w).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = compiled(x, w)
        assert inside.dtype == plain_matmul(x, w).dtype == torch.bfloat16
    assert compiled(x, w).dtype == torch.float32
    stats = kiln.stats()  # one entry per autocast state, none eager
    assert stats["frames_compiled"] == 2 and stats["fallbacks"] == 0, stats
