"""Graph breaks: what kiln cannot trace runs as CPython would, and the rest is still compiled.

Each case is compared with eager (outputs, and gradients where inputs require grad) and asserts how
many graphs and breaks kiln.explain reports, and that kiln.stats() counted the breaks (and no frame
fell back to eager as a whole unless the case says so).
"""
import functools
import sys

import weakref

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

PRINTED = []


@kiln.disable
def record(*values):
    """A stand-in for print: an untraceable call whose effect the tests can see (print would also be
    seen by pytest's capture code, whose Python frames kiln compiles too)."""
    PRINTED.append(values)


def check(fn, *args, graphs, breaks, fallbacks=0, calls=2, grads=True):
    """Compiled matches eager on `calls` calls (a cache hit after the first); explain's counts match."""
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(calls):
        assert_same_as_eager(fn, *args, compiled=compiled, grads=grads)
    stats = kiln.stats()
    assert stats["graph_breaks"] == breaks, stats
    assert stats["fallbacks"] == fallbacks, stats
    result = kiln.explain(fn)(*args)
    assert result.graph_count == graphs, result
    assert result.graph_break_count == breaks + fallbacks, result
    assert len(result.breaks) == result.graph_break_count
    for record_ in result.breaks:
        assert {"type", "context", "explanation", "hints", "reason"} <= set(record_), record_
    return result


# --- priority 1: breaks in the root frame -----------------------------------------------------------

@kiln.disable
def opaque_scale(t):
    return t * 3


def print_between(x):
    y = x.sin()
    print("kiln graph-break test:", tuple(y.shape))
    return y.cos() + 1


def test_print_splits_the_frame(fresh_kiln, capsys):
    compiled = kiln.compile(print_between)
    for _ in range(2):
        assert_same_as_eager(print_between, random_tensor(4, 3, requires_grad=True), compiled=compiled)
    assert capsys.readouterr().out.count("kiln graph-break test: (4, 3)") == 4
    result = kiln.explain(print_between)(random_tensor(4, 3))
    # print's own callees (pytest's capture, written in Python) are compiled too: count this frame's.
    own = [b for b in result.breaks if "print_between" in b["context"]]
    assert len(own) == 1 and own[0]["type"] == "call", result.breaks
    assert own[0]["file"].endswith("test_graph_breaks.py") and own[0]["line"] > 0


def disabled_call_between(x):
    y = torch.sin(x)
    z = opaque_scale(y)
    return torch.cos(z) * 2


def test_call_of_a_disabled_function(fresh_kiln):
    result = check(disabled_call_between, random_tensor(5, requires_grad=True), graphs=2, breaks=1)
    assert "kiln.disable" in result.break_reasons[0]


def item_used_later(x):
    s = x.sum().item()
    return x * s + 1


def test_item_used_later(fresh_kiln):
    check(item_used_later, random_tensor(6), graphs=2, breaks=1)


def tolist_used_later(x):
    values = (x * 2).tolist()
    return x + len(values) + values[0]


def test_tolist_used_later(fresh_kiln):
    check(tolist_used_later, random_tensor(3), graphs=2, breaks=1)


def branch_on_value(x):
    y = x * 2
    if y.sum() > 0:
        return y + 1
    return y - 1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_data_dependent_branch(fresh_kiln, sign):
    x = random_tensor(8).abs() * sign
    result = check(branch_on_value, x, graphs=2, breaks=1)
    assert result.breaks[0]["type"] == "data-dependent branch"


def test_data_dependent_branch_takes_both_ways(fresh_kiln):
    compiled = kiln.compile(branch_on_value)
    for sign in (1.0, -1.0, 1.0, -1.0):
        x = random_tensor(8).abs() * sign
        assert_same_as_eager(branch_on_value, x, compiled=compiled)
    assert kiln.stats()["graph_breaks"] == 1
    assert kiln.stats()["fallbacks"] == 0


def bool_of_tensor(x):
    y = x.relu()
    flag = bool((y > 1).any())
    return y * 2 if flag else y * 3


def test_bool_of_tensor(fresh_kiln):
    check(bool_of_tensor, random_tensor(10) * 3, graphs=2, breaks=1)


def several_breaks(x):
    a = x + 1
    record("first", a.shape)
    b = a * 2
    record("second")
    return a, b.sin()


def test_several_breaks_chain_resume_functions(fresh_kiln):
    PRINTED.clear()
    check(several_breaks, random_tensor(3, requires_grad=True), graphs=3, breaks=2)
    assert PRINTED[:2] == [("first", torch.Size([3])), ("second",)]


def keeps_locals_and_stack(x, scale):
    items = [x, x * scale]
    total = x.sum() + (record("middle", len(items)) is None)
    mapping = {"a": items[1], "b": scale}
    return items[0] + mapping["a"] * mapping["b"], total


def test_locals_and_stack_survive_the_break(fresh_kiln):
    check(keeps_locals_and_stack, random_tensor(4, requires_grad=True), 3.0, graphs=2, breaks=1)


def returns_an_input_after_a_break(x, y):
    record(x.shape)
    return x, y + 1


def test_inputs_keep_their_identity(fresh_kiln):
    x, y = random_tensor(2), random_tensor(2)
    compiled = kiln.compile(returns_an_input_after_a_break)
    for _ in range(2):
        out = compiled(x, y)
        assert out[0] is x
        torch.testing.assert_close(out[1], y + 1)


def list_mutated_by_eager_code(x):
    out = [x * 2]
    out.append(x + 1)
    opaque_append(out, x)
    return out[0] + out[1] + out[2]


@kiln.disable
def opaque_append(lst, t):
    lst.append(t * 5)


def test_list_mutated_by_the_break_instruction(fresh_kiln):
    check(list_mutated_by_eager_code, random_tensor(3, requires_grad=True), graphs=2, breaks=1)


def keyword_call_break(x):
    y = x.exp()
    z = opaque_kw(y, scale=2.0, shift=1.0)
    return z.log()


@kiln.disable
def opaque_kw(t, *, scale, shift):
    return t * scale + shift


def test_break_at_a_keyword_call(fresh_kiln):
    check(keyword_call_break, random_tensor(4, requires_grad=True), graphs=2, breaks=1)


def nested_call_break(x):
    return torch.relu(opaque_scale(x.sin()) + 1).sum(dim=0)


def test_break_under_pending_calls(fresh_kiln):
    # The stack at the break holds other calls' callables and NULLs.
    check(nested_call_break, random_tensor(3, 2, requires_grad=True), graphs=2, breaks=1)


def raises_after_work(x):
    y = x * 2
    if y.shape[0] == 3:
        raise ValueError("kiln test: shape 3")
    return y


def test_raise_runs_eagerly(fresh_kiln):
    compiled = kiln.compile(raises_after_work)
    with pytest.raises(ValueError, match="kiln test: shape 3"):
        compiled(random_tensor(3))
    assert_same_as_eager(raises_after_work, random_tensor(4), compiled=compiled)


def test_break_in_a_closure(fresh_kiln):
    scale = 2.5
    layer = nn.Linear(3, 3)

    def closure(x):
        y = layer(x) * scale
        record("closure")
        return y.relu() + scale

    check(closure, random_tensor(2, 3, requires_grad=True), graphs=2, breaks=1)


def test_closure_break_in_both_branches(fresh_kiln):
    offset = 1.0

    def closure_branch(x):
        y = x * 2
        if y.sum() > 0:
            return y + offset
        return y - offset

    compiled = kiln.compile(closure_branch)
    for sign in (1.0, -1.0, 1.0):
        assert_same_as_eager(closure_branch, random_tensor(4).abs() * sign, compiled=compiled)
    assert kiln.stats()["graph_breaks"] == 1 and kiln.stats()["fallbacks"] == 0, kiln.stats()


# --- priority 2: breaks inside inlined calls -----------------------------------------------------

def helper_with_print(t):
    record("inside helper")
    return t * 3


def calls_helper(x):
    y = x.sin()
    z = helper_with_print(y)
    return z.cos()


def test_break_inside_an_inlined_function(fresh_kiln):
    # The root breaks at the call; the helper is compiled on its own and breaks at its print:
    # graphs: root before, helper before (empty), helper after, root after.
    check(calls_helper, random_tensor(5, requires_grad=True), graphs=4, breaks=2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        record("block", h.shape)
        return torch.relu(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = Block()
        self.out = nn.Linear(4, 2)

    def scale(self, x):
        return self.helper(x) * 2

    def helper(self, x):
        return x + 1

    def forward(self, x):
        x = self.scale(self.inp(x))
        x = self.block(x)
        return self.out(x)


def test_module_with_a_break_in_a_submodule(fresh_kiln):
    torch.manual_seed(0)
    model = Net()
    compiled = kiln.compile(model)
    for _ in range(2):
        assert_same_as_eager(model, random_tensor(3, 4, requires_grad=True), compiled=compiled)
    stats = kiln.stats()
    assert stats["graph_breaks"] == 2, stats
    assert stats["fallbacks"] == 0, stats


def method_with_print(self_like, x):
    return self_like.run(x)


class Runner:
    def run(self, x):
        y = x * 2
        record("runner")
        return y + 1


def test_break_in_a_method_of_a_plain_object(fresh_kiln):
    runner = Runner()
    check(method_with_print, runner, random_tensor(3), graphs=4, breaks=2)


# --- with blocks, loops, try (tests/python/test_breaks_in_blocks.py has the full set) ----------------

def no_grad_block(x):
    y = x * 2
    with torch.no_grad():
        z = y * 3
    return y + z


def test_no_grad_block(fresh_kiln):
    compiled = kiln.compile(no_grad_block)
    for _ in range(3):
        out = assert_same_as_eager(no_grad_block, random_tensor(3, requires_grad=True), compiled=compiled)
        assert out.requires_grad
    # Grad-mode blocks are traced (tests/python/test_grad_mode_blocks.py has the full set): one graph.
    stats = kiln.stats()
    assert stats["fallbacks"] == 0 and stats["recompiles"] == 0 and stats["frames_compiled"] == 1


def break_in_loop(x):
    for i in range(3):
        x = x * 2
        record("loop", i)
    return x + 1


def test_break_inside_a_loop_resumes_in_the_loop(fresh_kiln):
    PRINTED.clear()
    # The frame's graph, then one resume function per iteration (one code object, three entries).
    check(break_in_loop, random_tensor(3), graphs=4, breaks=3)
    assert [p for p in PRINTED if p[0] == "loop"][:3] == [("loop", 0), ("loop", 1), ("loop", 2)]


def break_in_try(x):
    y = x + 1
    try:
        record("try")
        y = y * 2
    except RuntimeError:
        y = y * 3
    return y


def test_break_inside_try_resumes_in_the_try_body(fresh_kiln):
    check(break_in_try, random_tensor(3), graphs=2, breaks=1)


class _Noted:
    """A user context manager: entering it is a graph break, the block resumes in a resume function."""

    def __enter__(self):
        record("enter")
        return self

    def __exit__(self, *exc):
        record("exit")


def raises_after_breaks(x):
    y = x * 2
    record("before")
    with _Noted():
        y = y + 1
        record("inside")
        y = y / 0 if y.sum() > 1e9 else y.new_tensor([1.0]).item() / 0
    return y


def _frames_of(fn, x):
    """(function name, line relative to its first line) of each traceback frame of this file's `fn`."""
    with pytest.raises(ZeroDivisionError) as info:
        fn(x)
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == __file__ and code.co_name == raises_after_breaks.__name__:
            frames.append((code.co_name, tb.tb_lineno - code.co_firstlineno))
        tb = tb.tb_next
    return frames


def test_tracebacks_through_resume_functions_read_as_eager(fresh_kiln):
    # Each break runs the rest of the function in a resume function called from the compiled frame; the
    # traceback keeps one frame for the function, with the line eager reports.
    x = random_tensor(3)
    eager = _frames_of(raises_after_breaks, x)
    assert eager == [("raises_after_breaks", 6)], eager
    compiled = kiln.compile(raises_after_breaks)
    for _ in range(2):  # the first call compiles, the second runs the cached entries
        assert _frames_of(compiled, x) == eager
    assert kiln.stats()["graph_breaks"] >= 2, kiln.stats()


class _Marker:
    pass


def recurses_through_breaks(x, depth, refs):
    # Two breaks per call (the marker class and the list append run in Python), then recursion from inside the
    # resume function: every level's traceback entry must stay, holding its locals as eager's frames do.
    marker = _Marker()
    refs.append(weakref.ref(marker))
    y = torch.sin(x) + depth
    if depth == 0:
        raise ZeroDivisionError("bottom")
    return recurses_through_breaks(y, depth - 1, refs) + marker.__class__.__name__.__len__()


def _recursion_traceback(fn, x, depth):
    refs = []
    with pytest.raises(ZeroDivisionError) as info:
        fn(x, depth, refs)
    names, tb = [], info.value.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == __file__ and tb.tb_frame.f_code.co_name == "recurses_through_breaks":
            names.append(tb.tb_lineno - tb.tb_frame.f_code.co_firstlineno)
        tb = tb.tb_next
    alive = sum(ref() is not None for ref in refs)  # the traceback's frames keep their markers
    return names, alive


def test_tracebacks_through_recursive_resume_functions_keep_every_level(fresh_kiln):
    # A resume function that calls its own function again: the levels below belong to other calls and must not
    # be taken for this call's resume frames (the traceback once lost every level but the last).
    x = random_tensor(3)
    eager = _recursion_traceback(recurses_through_breaks, x, 6)
    assert eager == ([8] * 6 + [7], 7), eager
    compiled = kiln.compile(recurses_through_breaks)
    for _ in range(2):
        assert _recursion_traceback(compiled, x, 6) == eager
    assert kiln.stats()["graph_breaks"] >= 2, kiln.stats()


class _Counted:
    made = 0

    @kiln.disable  # counts in plain Python (traced, each count would be a new guard value and a recompile)
    def __init__(self):
        type(self).made += 1


def recurses_forever(x):
    marker = _Counted()
    return recurses_forever(torch.sin(x) + marker.__class__.__name__.__len__())


def test_resume_functions_do_not_count_against_the_recursion_limit(fresh_kiln):
    # Eager reaches a depth set by the recursion limit; the resume frame kiln adds per call must not make it
    # shallower (CPython's own recursion tests set limits a few frames above their depth).
    import sys

    def depth_reached(fn):
        _Counted.made = 0
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(150)
        try:
            with pytest.raises(RecursionError):
                fn(random_tensor(3))
        finally:
            sys.setrecursionlimit(limit)
        return _Counted.made

    eager = depth_reached(recurses_forever)
    compiled = depth_reached(kiln.compile(recurses_forever))
    assert eager > 50 and abs(compiled - eager) <= 3, (eager, compiled)
    assert kiln.stats()["graph_breaks"] >= 1 and kiln.stats()["recompiles"] == 0, kiln.stats()


def test_fullgraph_raises_at_the_first_break(fresh_kiln):
    compiled = kiln.compile(print_between, fullgraph=True)
    with pytest.raises(kiln.errors.GraphBreakError) as info:
        compiled(random_tensor(3))
    assert "test_graph_breaks.py" in str(info.value)


def test_logs_name_the_break(fresh_kiln):
    import os
    import subprocess
    import sys
    script = (
        "import torch, kiln\n"
        "def f(x):\n"
        "    y = x + 1\n"
        "    print('mid')\n"
        "    return y * 2\n"
        "kiln.compile(f)(torch.ones(2))\n"
    )
    env = dict(os.environ, KILN_LOGS="graph_breaks")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.path.join(root, "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "graph break (call)" in proc.stderr + proc.stdout, proc.stderr


class MLPWithBreaks(nn.Module):
    """A seed-style MLP written with a helper function, a print-like call and a data-dependent branch."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def hidden(self, x):
        return torch.relu(self.fc1(x))

    def forward(self, x):
        h = self.hidden(x)
        record("hidden", h.shape)
        if h.mean() > 0.1:
            h = h * 2
        return self.fc2(h)


def test_mlp_with_helper_print_and_branch(fresh_kiln):
    torch.manual_seed(0)
    model = MLPWithBreaks()
    compiled = kiln.compile(model)
    for _ in range(3):
        assert_same_as_eager(model, random_tensor(5, 8, requires_grad=True), compiled=compiled)
    stats = kiln.stats()
    assert stats["graph_breaks"] == 2 and stats["fallbacks"] == 0, stats
    result = kiln.explain(model)(random_tensor(5, 8))
    assert result.graph_count == 3 and result.graph_break_count == 2, result


# --- frames with cells: variables captured by nested functions ---------------------------------------

class HelperInForward(nn.Module):
    """A helper defined inside forward closes over `self`; a lambda closes over a local assigned after the
    break; both live across breaks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.scale = 1.5

    def forward(self, x):
        def act(t, k=1.0):
            return torch.nn.functional.gelu(t) * self.scale * k

        h = act(self.a(x))
        record("first", h.shape)
        offset = 0.25
        shift = lambda t: t + offset  # noqa: E731
        out = shift(act(self.b(h), k=0.5))
        record("second")
        offset = 2.0  # the lambda sees the new value, as in eager
        return shift(out)


def test_break_in_a_frame_with_cells(fresh_kiln):
    torch.manual_seed(0)
    check(HelperInForward(), random_tensor(3, 6, requires_grad=True), graphs=3, breaks=2, calls=3)
    # The helpers are made anew on every call: guarded by their code, they do not recompile.
    assert kiln.stats()["recompiles"] == 0, kiln.stats()


def cell_argument(x, n):
    def times():
        return x * n

    y = times()
    record("between")
    n = n + 1  # an argument captured by the closure, reassigned after the break
    return times() + y


def test_captured_argument_reassigned_after_a_break(fresh_kiln):
    compiled = kiln.compile(cell_argument)
    for n in (2, 2, 3):
        x = random_tensor(4)
        torch.testing.assert_close(compiled(x, n), cell_argument(x, n))
    # n is a guarded constant: n=3 compiles the frame (and its break) a second time.
    assert kiln.stats()["graph_breaks"] == 2 and kiln.stats()["fallbacks"] == 0, kiln.stats()


def counter_factory():
    count = 0

    def bump(x):
        nonlocal count
        peek = lambda: count  # noqa: E731  (a closure made here shares the outer cell)
        count = count + 1
        return x * peek()

    return bump, lambda: count


def test_nonlocal_assignment_reaches_the_enclosing_function(fresh_kiln):
    bump, read = counter_factory()
    compiled = kiln.compile(bump)
    x = random_tensor(3)
    torch.testing.assert_close(compiled(x), x * 1)
    assert read() == 1
    torch.testing.assert_close(compiled(x), x * 2)
    assert read() == 2


def _raise_value_error(*args):
    raise ValueError("from a callback")


def reraises_after_a_break(callbacks, *details):
    # ExitStack.__exit__'s shape: a break inside a try body inside a loop, the exception caught and raised
    # again later in the same frame.
    pending = None
    while callbacks:  # a deque: its truth is guarded by its length
        callback = callbacks.pop()
        try:
            callback(*details)
        except ValueError as e:
            pending = e
    if pending is not None:
        raise pending


def test_exception_raised_again_in_the_same_frame_keeps_both_traceback_entries(fresh_kiln):
    import collections
    import traceback

    def entries(fn):
        try:
            fn(collections.deque([_raise_value_error, _raise_value_error]), None)
        except ValueError as e:
            names = ("reraises_after_a_break", "_raise_value_error")  # not the test's or kiln's wrapper frames
            return [(f.name, f.line) for f in traceback.extract_tb(e.__traceback__) if f.name in names]
        raise AssertionError("no exception")

    expected = entries(reraises_after_a_break)
    assert [name for name, _ in expected] == ["reraises_after_a_break", "reraises_after_a_break", "_raise_value_error"]
    compiled = kiln.compile(reraises_after_a_break)
    for _ in range(2):
        assert entries(compiled) == expected
    assert kiln.stats()["graph_breaks"] >= 1 and kiln.stats()["fallbacks"] == 0, kiln.stats()


# --- functions reached from code that runs eagerly ---------------------------------------------------------

class _Settings:
    """A config-like class with its own __getattribute__ (as transformers' configs have)."""

    def __init__(self):
        for i in range(12):
            object.__setattr__(self, f"a{i}", i)

    def __getattribute__(self, key):
        return super().__getattribute__(key)


_attribute_reads = set()


class _CountingSettings(_Settings):
    """Its __getattribute__ adds to a module-level set: a mutation the trace refuses, so it falls back."""

    def __getattribute__(self, key):
        _attribute_reads.add(key)
        return super().__getattribute__(key)


class _Note(Exception):
    """Constructing a user exception class is a graph break: __init__ runs from the break, eagerly."""

    def __init__(self, settings):
        total = 0
        for i in range(12):
            total += getattr(settings, f"a{i}")
        self.total = total


def _with_note(x, settings):
    y = x.sin()
    note = _Note(settings)
    return y * note.total


def test_a_function_without_tensor_work_reached_from_eager_code_is_not_compiled(fresh_kiln):
    # _Note.__init__ does no tensor work: kiln leaves it to the interpreter for good (one entry without guards),
    # as Dynamo skips such frames. Its own calls are still offered (the settings' __getattribute__ below).
    settings = _Settings()
    x = random_tensor(4)
    compiled = kiln.compile(_with_note)
    for _ in range(2):
        torch.testing.assert_close(compiled(x, settings), _with_note(x, settings))
    labels = kiln._C.cache_entries(_Note.__init__.__code__)
    assert len(labels) == 1 and "eager for every input: no tensor work" in labels[0], labels
    # That entry holds under no_grad and autocast too: it used to check the default grad mode, so every call of a
    # generation loop (under no_grad) missed it and traced the frame again, up to the recompile limit.
    recompiles = kiln.stats()["recompiles"]
    for _ in range(10):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(x, settings)
    labels = kiln._C.cache_entries(_Note.__init__.__code__)
    assert len(labels) == 1 and "eager for every input: no tensor work" in labels[0], labels
    assert kiln.stats()["recompiles"] - recompiles <= 2, kiln.stats()  # _with_note and its resume, once each
    # An entry of that kiln.compile's alone: compiling the function itself still compiles it.
    note = _Note.__new__(_Note)
    kiln.compile(_Note.__init__)(note, _Settings())
    assert note.total == 66
    labels = kiln._C.cache_entries(_Note.__init__.__code__)
    assert len(labels) == 2 and labels[0].endswith("#0"), labels


def test_a_function_that_falls_back_on_every_input_stops_being_traced_without_a_warning(fresh_kiln):
    # The settings' __getattribute__, called by _Note.__init__ running eagerly, is traced once per attribute name
    # and falls back each time. At the recompile limit (8) it runs eagerly from then on; the recompile-limit
    # warning is for functions that compiled something.
    import warnings

    settings = _CountingSettings()
    x = random_tensor(4)
    compiled = kiln.compile(_with_note)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            torch.testing.assert_close(compiled(x, settings), _with_note(x, settings))
    code = _CountingSettings.__getattribute__.__code__
    labels = kiln._C.cache_entries(code)
    assert len(labels) == 9 and "eager for every input: fell back" in labels[0], labels
    assert all("(eager: " in label for label in labels[1:]), labels


def _wrapped_forward(cls):
    """As transformers' GradientCheckpointingLayer wraps its subclasses' forward: the wrapper names itself."""
    forward = cls.forward

    @functools.wraps(forward)
    def forward_with_wrapper(self, *args, **kwargs):
        outermost = type(self).forward is forward_with_wrapper
        out = forward(self, *args, **kwargs)
        return out if outermost else out * 1.0

    cls.forward = forward_with_wrapper
    return cls


@_wrapped_forward
class _WrappedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _WrappedStack(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(_WrappedLayer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            record(x.shape[0])  # a break in the loop: a resume function per iteration
        return x


def test_a_wrapper_that_names_itself_keeps_a_short_source_across_layers(fresh_kiln):
    # Each call of the wrapper used to reach it again one step deeper through its own closure
    # (forward.__closure__[1].cell_contents.__closure__[1]...), until the 256-step limit broke the loop.
    torch.manual_seed(0)
    model = _WrappedStack(40)
    x = random_tensor(2, 8)
    compiled = kiln.compile(model)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    reasons = kiln.explain(model)(x).break_reasons
    assert not any("attribute or item steps" in r for r in reasons), [r for r in reasons if "steps" in r][:1]


class _StraightThrough(torch.autograd.Function):
    """Rounds in the forward; its backward is not the forward's derivative (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


def test_custom_autograd_function_runs_eagerly_with_its_own_backward(fresh_kiln):
    def f(x):
        return _StraightThrough.apply(torch.sin(x)).sum() * 2

    x = torch.randn(6, requires_grad=True)
    explained = kiln.explain(f)(x)
    assert explained.graph_break_count == 1, explained.break_reasons
    assert "_StraightThrough.apply, a custom torch.autograd.Function" in explained.break_reasons[0]
    assert "test_graph_breaks.py" in explained.breaks[0]["file"]
    compiled = kiln.compile(f)
    for _ in range(2):
        assert_same_as_eager(f, torch.randn(6, requires_grad=True), compiled=compiled)


def test_code_an_import_runs_is_not_compiled(fresh_kiln, tmp_path, monkeypatch):
    """A module imported from eager code inside a compiled call (between graphs, or by a library's lazy import: torch
    imports sympy on the first torch.utils.checkpoint call) runs its top level and what it calls as written: before,
    each of those frames was intercepted, and a function the import called with 30 different ints compiled until the
    recompile limit warned about the library's own code."""
    import importlib
    import warnings
    name = f"kiln_lazy_module_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def helper(i):\n"
        "    return torch.ones(2) * i + 1\n"
        "VALUES = [helper(i) for i in range(30)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def f(x):
        return x + importlib.import_module(name).VALUES[3]

    x = random_tensor(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recompile-limit warning of the library's helper
        out = kiln.compile(f)(x)
    torch.testing.assert_close(out, x + 4)
    assert kiln.stats()["frames_compiled"] <= 2, kiln.stats()  # f and the code after its break, not helper


def test_activation_checkpointing_inside_a_compiled_model_matches_eager(fresh_kiln):
    """torch.utils.checkpoint inside a compiled forward (both implementations): a break at each checkpoint call, the
    checkpointed layer compiled as its own frame and recomputed in the backward; losses and gradients equal eager's."""
    from torch.utils.checkpoint import checkpoint

    from kiln.testing import tolerance
    rtol, atol = tolerance(torch.float32)
    assert_close = functools.partial(torch.testing.assert_close, rtol=rtol, atol=atol)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.blocks, self.reentrant = nn.ModuleList(Block() for _ in range(3)), reentrant

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
            return x.square().mean()

    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Model(reentrant)
        reference = Model(reentrant)
        reference.load_state_dict(model.state_dict())
        compiled = kiln.compile(model)
        for _ in range(3):
            x = random_tensor(4, 16)
            got, want = compiled(x.clone().requires_grad_()), reference(x.clone().requires_grad_())
            got.backward()
            want.backward()
            assert_close(got, want)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_close(p.grad, q.grad)
    # per implementation: the forward, its resume after the break, and the block (recompiled for its second instance,
    # then within kiln.config.module_instance_limit)
    assert kiln.stats()["frames_compiled"] <= 8, kiln.stats()
