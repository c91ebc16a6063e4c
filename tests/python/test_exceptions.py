"""Exceptions in traced code: raised and caught inside the trace (one graph, eager's branch), or raised out of it
(a graph break, and eager raises the very exception). Also object.__getattribute__ through a class's override.

Every test compares with eager on fresh random inputs and counts graphs, breaks and fallbacks.
"""
import collections.abc
import re
import traceback

import pytest
import torch

import kiln
from kiln.testing import assert_same_as_eager


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def whole(fn, *args):
    """fn traced as one graph with no break, and equal to eager on two calls of fresh inputs."""
    e = kiln.explain(fn)(*args)
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(2):
        assert_same_as_eager(fn, *[torch.randn_like(a) for a in args], compiled=compiled)
    s = kiln.stats()
    assert (s["frames_compiled"], s["cache_hits"], s["graph_breaks"], s["fallbacks"]) == (1, 1, 0, 0), s


def test_builtin_errors_on_constants_are_caught_in_the_trace():
    def f(x):
        try:
            v = int("not a number")
        except ValueError as e:
            v = len(str(e))
        try:
            w = {"a": 1}["b"]
        except KeyError:
            w = 3
        try:
            w += [1, 2][5]
        except IndexError:
            w += 4
        return x * v + w

    whole(f, torch.randn(4, 3))


def test_raise_and_except_with_a_tuple_finally_and_reraise():
    def f(x):
        y = x.sin()
        try:
            raise IndexError("boom")
        except (TypeError, IndexError) as e:
            y = y + len(e.args[0])
        try:
            try:
                raise ValueError
            finally:
                y = y * 2
        except ValueError:
            y = y - 1
        try:
            try:
                raise KeyError("k")
            except KeyError:
                raise RuntimeError("wrapped") from None
        except RuntimeError as e:
            assert e.__cause__ is None
            y = y.cos()
        return y

    whole(f, torch.randn(5))


def _inner(x):
    if x.shape[0] > 2:
        raise ValueError("too long")
    return x + 1


def test_exception_raised_out_of_an_inlined_call_breaks_at_the_call():
    # Eager's traceback holds the inlined frame: the root frame's except runs eagerly, after a graph break at the call.
    def f(x):
        try:
            y = _inner(x)
        except ValueError:
            y = x - 1
        return y.exp()

    e = kiln.explain(f)(torch.randn(4))
    assert "raised out of an inlined call" in e.break_reasons[0], e.break_reasons
    kiln.reset()
    compiled = kiln.compile(f)
    for n in (4, 2):
        assert_same_as_eager(f, torch.randn(n), compiled=compiled)


def _inner_or_fallback(x):
    try:
        return _inner(x)
    except ValueError:
        return x - 1


class _Items(collections.abc.Sequence):
    """A sequence whose iteration (Sequence.__iter__, a generator) ends at the IndexError its __getitem__ raises."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return i


def test_exception_from_an_inlined_call_is_caught_by_an_inlined_caller():
    # The inlined frame unwinds and its inlined caller's handler takes the exception, as in eager: the traceback it
    # carries is never seen, since a caught exception never leaves the trace.
    def f(x):
        y = _inner_or_fallback(x)
        for i in _Items(3):
            y = y + i
        return y.exp()

    e = kiln.explain(f)(torch.randn(4))
    assert e.graph_break_count == 0 and e.graph_count == 1, e.break_reasons
    kiln.reset()
    compiled = kiln.compile(f)
    for n in (4, 2):
        assert_same_as_eager(f, torch.randn(n), compiled=compiled)


def test_exception_from_an_inlined_call_raised_again_breaks_at_the_call():
    # Raised again, the exception would show the inlined frame in its traceback: the graph breaks at the call instead,
    # where eager raises it for real.
    def f(x):
        y = x.sin()
        try:
            _inner(x)
        except ValueError as e:
            caught = e
        raise caught

    compiled = kiln.compile(f)
    for _ in range(2):
        with pytest.raises(ValueError, match="too long") as info:
            compiled(torch.randn(4))
        assert "_inner" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]


def test_caught_exception_leaving_the_trace_runs_eagerly_with_eager_traceback():
    def f(x):
        try:
            int("x")
        except ValueError as e:
            caught = e
        return x + 1, caught

    out, caught = kiln.compile(f)(torch.randn(2))
    assert isinstance(caught, ValueError) and caught.__traceback__ is not None
    assert kiln.stats()["fallbacks"] + kiln.stats()["graph_breaks"] >= 1


def test_except_clause_that_does_not_match_lets_the_exception_through_to_eager():
    def f(x):
        y = x * 2
        try:
            raise KeyError("missing")
        except ValueError:
            y = y + 1
        return y

    compiled = kiln.compile(f)
    with pytest.raises(KeyError, match="missing"):
        compiled(torch.randn(3))
    with pytest.raises(KeyError, match="missing"):
        compiled(torch.randn(3))


def test_uncaught_raise_is_a_graph_break_and_eager_raises_it():
    def f(x):
        y = x.relu()
        if y.shape[0] == 3:
            raise ValueError(f"bad length {y.shape[0]}")
        return y

    e = kiln.explain(f)(torch.randn(4))
    assert (e.graph_count, e.graph_break_count) == (1, 0)
    kiln.reset()
    with pytest.raises(ValueError, match="bad length 3"):
        kiln.compile(f)(torch.randn(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the query raises only on a build without CUDA")
def test_query_that_raises_is_caught_and_guarded():
    with pytest.raises(Exception):
        torch.cuda.is_current_stream_capturing()

    def capturing():
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception:
            return False

    def f(x):
        if capturing():
            return x
        return x * 3

    whole(f, torch.randn(2, 2))
    e = kiln.explain(f)(torch.randn(2, 2))
    assert any("raises" in line for line in e.guards), e.guards


class Aliased:
    """A config-like class whose __getattribute__ maps aliases, then asks object's (as HF's configs do)."""
    attribute_map = {"width": "hidden"}

    def __init__(self):
        self.hidden = 3
        self.scale = 0.5

    def __getattribute__(self, key):
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)


def test_getattribute_override_reaching_object_getattribute_is_traced():
    config = Aliased()

    def f(x):
        return x * config.width + object.__getattribute__(config, "scale")

    whole(f, torch.randn(3))
    # The class's own __getattribute__, called from code running eagerly, does no tensor work: it is neither a
    # graph nor a break.
    kiln.reset()
    e = kiln.explain(lambda x: x * Aliased.__getattribute__(config, "width"))(torch.randn(3))
    assert e.graph_break_count == 0, e.break_reasons


class _Options:
    def __init__(self, **values):
        self.__dict__.update(values)


def test_missing_attribute_caught_as_attribute_error_is_traced_and_guarded():
    def f(x, options):
        try:
            scale = options.scale
        except AttributeError:
            scale = 0.5
        return x * scale

    options = _Options()
    whole(lambda x: f(x, options), torch.randn(3))
    kiln.reset()
    compiled = kiln.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x, _Options()), x * 0.5)
    torch.testing.assert_close(compiled(x, _Options(scale=3.0)), x * 3.0)  # the guard sees the attribute appear


def test_a_break_inside_an_except_block_keeps_the_exception_current(capsys):
    """Code after a graph break in an except block still sees the exception it handles: a bare `raise` raises it
    (not "No active exception to reraise") and sys.exc_info() names it, as in eager."""
    import sys

    def reraise(x):
        try:
            raise ValueError("bad input")
        except ValueError:
            y = x * 2
            print("handling")  # a graph break inside the handler
            raise

    def report(x):
        try:
            raise KeyError("k")
        except KeyError:
            y = torch.sin(x)
            print("handling")
            return y, sys.exc_info()[0]

    x = torch.randn(4)
    for fn in (kiln.compile(reraise), reraise):
        with pytest.raises(ValueError, match="bad input"):
            fn(x)
    out, kind = kiln.compile(report)(x)
    assert kind is KeyError
    torch.testing.assert_close(out, torch.sin(x))
    assert capsys.readouterr().out.count("handling") == 3


def test_aten_errors_keep_the_exception_types_eager_raises(fresh_kiln):
    """An op that fails inside a compiled graph raises what eager raises for it, not a plain RuntimeError: a kernel
    missing for a dtype is NotImplementedError, a singular matrix torch.linalg.LinAlgError (and CUDA's out-of-memory
    torch.OutOfMemoryError, which a batch-size search catches)."""
    ints = torch.ones(3, dtype=torch.int32)
    with pytest.raises(NotImplementedError) as eager:
        torch.frac(ints) + 1
    with pytest.raises(NotImplementedError, match=re.escape(str(eager.value).splitlines()[0])):
        kiln.compile(lambda t: torch.frac(t) + 1)(ints)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(torch.zeros(3, 3))
    with pytest.raises(torch.linalg.LinAlgError):
        kiln.compile(lambda a: torch.linalg.inv(a * 2) + 1)(torch.zeros(3, 3))
