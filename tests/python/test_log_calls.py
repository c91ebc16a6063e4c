"""Logging calls in compiled code: `logger.warning(...)` and a library's level wrappers (`warning_once`) leave no graph
break. The compiled frame makes each call after its graph, in program order, on every call, so the logger decides as in
eager whether a line appears (level, handlers, a once-only cache); calls that read the stack of the moment
(logger.exception, exc_info=, stack_info=) stay graph breaks. Each case compares outputs with eager and the log lines
with eager's, call by call.
"""
import functools
import logging
import sys

import pytest
import torch

import kiln
from kiln.testing import assert_same_as_eager, random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}:{record.getMessage()}")


class OnceLogger(logging.Logger):
    """A logger class with a cached level wrapper, as transformers sets warning_once on logging.Logger."""

    @functools.lru_cache(None)
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)


def make_logger(name, cls=None):
    logger = cls(name) if cls else logging.getLogger(name)  # getLogger's: setLevel clears its level cache
    logger.propagate = False
    handler = Lines()
    logger.addHandler(handler)
    return logger, handler


log, lines = make_logger("kiln.test.log_calls")
once_log, once_lines = make_logger("kiln.test.log_calls.once", OnceLogger)


def explain(fn, *args):
    result = kiln.explain(fn)(*args)
    kiln.reset()
    return result


def test_level_methods_log_after_the_graph_in_order():
    def fn(x):
        y = x.sin()
        log.warning("first %d", 1)
        log.info("not shown at WARNING")
        log.error("second %s", "two")
        log.log(logging.WARNING, "third")
        return y * 2

    log.setLevel(logging.WARNING)
    x = random_tensor(4)
    e = explain(fn, x)
    assert e.graph_break_count == 0 and e.graph_count == 1, e.break_reasons
    lines.lines.clear()
    fn(x)
    eager = list(lines.lines)
    assert eager == ["WARNING:first 1", "ERROR:second two", "WARNING:third"]
    lines.lines.clear()
    compiled = kiln.compile(fn)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x.sin() * 2)
    assert lines.lines == eager * 3


def test_the_level_is_read_on_every_call():
    def fn(x):
        log.info("info line")
        return x.cos()

    compiled = kiln.compile(fn)
    x = random_tensor(3)
    log.setLevel(logging.WARNING)
    lines.lines.clear()
    compiled(x)
    assert lines.lines == []
    log.setLevel(logging.INFO)
    compiled(x)
    assert lines.lines == ["INFO:info line"]
    assert kiln.stats()["frames_compiled"] == 1
    log.setLevel(logging.WARNING)


def test_a_cached_wrapper_logs_once_as_in_eager():
    def fn(x, n):
        once_log.warning_once(f"loss type {n} unrecognized")
        return x * n

    x = random_tensor(5)
    e = explain(fn, x, 7)
    assert e.graph_break_count == 0, e.break_reasons
    OnceLogger.warning_once.cache_clear()
    once_lines.lines.clear()
    compiled = kiln.compile(fn)
    for _ in range(3):
        assert_same_as_eager(fn, x, 7, compiled=compiled)
    assert once_lines.lines == ["WARNING:loss type 7 unrecognized"]
    assert_same_as_eager(fn, x, 8, compiled=compiled)
    assert once_lines.lines == ["WARNING:loss type 7 unrecognized", "WARNING:loss type 8 unrecognized"]


def test_lines_around_a_graph_break_keep_eager_order(capsys):
    logger, _ = make_logger("kiln.test.log_calls.stdout")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(stream)

    def fn(x):
        y = x + 1
        logger.warning("before")
        print("break")
        logger.warning("after")
        return y.exp()

    x = random_tensor(4)
    fn(x)
    eager = capsys.readouterr().out
    assert eager == "before\nbreak\nafter\n"
    compiled = kiln.compile(fn)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), (x + 1).exp())
        assert capsys.readouterr().out == eager


def test_a_tensor_argument_is_the_real_tensor():
    def fn(x):
        y = x.long()
        log.warning("values %s", y)
        return y + 1

    log.setLevel(logging.WARNING)
    x = torch.arange(4.0)
    lines.lines.clear()
    fn(x)
    eager = list(lines.lines)
    lines.lines.clear()
    out = kiln.compile(fn)(x)
    assert torch.equal(out, x.long() + 1)
    assert lines.lines == eager


@pytest.mark.parametrize("how", ["exception", "exc_info", "stack_info"])
def test_calls_that_read_the_stack_stay_graph_breaks(how):
    def fn(x):
        if how == "exception":
            log.exception("failed")
        elif how == "exc_info":
            log.error("failed", exc_info=True)
        else:
            log.warning("here", stack_info=True)
        return x.tanh()

    x = random_tensor(3)
    e = explain(fn, x)
    assert e.graph_break_count >= 1, "a call reading the stack of the moment was deferred"
    lines.lines.clear()
    fn(x)
    eager = list(lines.lines)
    lines.lines.clear()
    assert_same_as_eager(fn, x)
    assert lines.lines[-1:] == eager


def test_warnings_warn_is_made_after_the_graph():
    import warnings

    def f(x):
        y = x * 2
        if y.shape[0] > 2:
            warnings.warn("the input has more than two rows", UserWarning)
        return y + 1

    x = random_tensor(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = kiln.explain(f)(x)
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    kiln.reset()
    compiled = kiln.compile(f)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.testing.assert_close(compiled(x), f(x))
        assert [str(w.message) for w in caught] == ["the input has more than two rows"] * 2


def test_a_warning_the_filters_make_an_error_raises_where_it_is_made():
    import warnings

    def f(x):
        warnings.warn("stop here", UserWarning)
        return x + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="stop here"):
            kiln.compile(f)(random_tensor(3))
