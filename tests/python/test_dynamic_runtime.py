"""Graphs with symbolic sizes run at sizes they were not captured with, without a retrace (runtime/dynamic_graph.h).

Each test captures a function with kiln._fake.Recorder at one size (test_symbolic_graph.capture), marks dims of its
inputs symbolic, compiles the graph once with kiln._C.compile_graph and runs the compiled graph at other sizes (primes,
sizes not a multiple of 4 or 8, small and large), comparing with eager on fresh random inputs. Each new binding of
the symbols compiles one specialisation (kiln.stats()["dynamic_specialisations"]); a binding seen before is a hit
("dynamic_hits"). A binding the graph does not hold for raises kiln's error and runs nothing.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import _C
from kiln.errors import KilnError
from kiln.testing import random_tensor, tolerance
from test_symbolic_graph import capture

BACKENDS = ["kiln", "eager"]
pytestmark = pytest.mark.usefixtures("fresh_kiln")  # kiln.stats() counters from zero in each test


def counters():
    s = kiln.stats()
    return s["dynamic_specialisations"], s["dynamic_hits"]


def compile_dynamic(fn, inputs, dynamic, backend="kiln", int_args=()):
    """fn captured at `inputs`, the dims in `dynamic` ({input: [dims]}) made symbolic, compiled with `backend`."""
    graph = capture(fn, inputs)
    graph.propagate_symbolic_sizes(dynamic, list(int_args))
    return graph, _C.compile_graph(graph, backend, inputs)


def assert_same(actual, expected, kind):
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        rtol, atol = tolerance(e.dtype, kind)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def run_at_sizes(fn, make_inputs, sizes, dynamic, backend="kiln", kind="general", int_args=()):
    """Compiles fn at sizes[0] and runs it at every entry of `sizes` (each a tuple for make_inputs) on fresh inputs,
    comparing with eager. Returns the compiled graph."""
    _, compiled = compile_dynamic(fn, make_inputs(*sizes[0]), dynamic, backend, int_args)
    fallbacks = _C.compiler_stats()["graphs_fallback"]
    for size in sizes:
        inputs = make_inputs(*size)
        assert_same(compiled(inputs), fn(*inputs), kind)
        if backend == "kiln":  # the specialisation just run (the most recently used) is kiln's, not a fallback
            summary = _C.compiled_graph_summary(compiled)
            assert summary["backend"] == "kiln" and (summary["kernels"] or summary["externs"]), summary
    assert _C.compiler_stats()["graphs_fallback"] == fallbacks
    return compiled


def expected_counters(sizes):
    """(specialisations, hits) after running at each of `sizes` once compiled at sizes[0]: the first compiles at
    compile time, each new size once, each repeat (and the first call, at the hints) is a hit."""
    return len(set(sizes)), len(sizes) - len(set(sizes)) + 1


SIZES = [(4, 6), (5, 7), (13, 3), (2, 2), (31, 17), (5, 7), (97, 130), (4, 6), (2, 2)]


# ---- forward graphs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise_with_broadcasting(backend):
    fn = lambda x, y, b: (x * y + b).relu() - x.sigmoid()  # noqa: E731
    make = lambda n, t: [random_tensor(n, t, 8), random_tensor(n, 1, 8), random_tensor(8)]  # noqa: E731
    run_at_sizes(fn, make, SIZES, {0: [0, 1], 1: [0]}, backend, kind="pointwise")
    assert counters() == expected_counters(SIZES)


def test_reductions_over_dynamic_and_static_dims():
    fn = lambda x: (x.sum(0), x.sum(-1), x.mean(1, keepdim=True), x.amax(0), x.amax(2), x.mean((0, 1)))  # noqa
    make = lambda n, t: [random_tensor(n, t, 12)]  # noqa: E731
    run_at_sizes(fn, make, SIZES, {0: [0, 1]})
    assert counters() == expected_counters(SIZES)


def test_softmax_and_log_softmax():
    fn = lambda x: (F.softmax(x, -1), F.log_softmax(x, 1), F.softmax(x, 0))  # noqa: E731
    run_at_sizes(fn, lambda n, t: [random_tensor(n, t, 8) * 3], SIZES[:5], {0: [0, 1]})


def test_softmax_over_a_dynamic_last_dim():
    run_at_sizes(lambda x: F.softmax(x, -1), lambda n, t: [random_tensor(n, t)], SIZES[:5], {0: [0, 1]})


def test_layer_norm():
    fn = lambda x, w, b: F.layer_norm(x, (16,), w, b)  # noqa: E731
    make = lambda n, t: [random_tensor(n, t, 16), random_tensor(16), random_tensor(16)]  # noqa: E731
    run_at_sizes(fn, make, SIZES[:5], {0: [0, 1]})


def test_linear_2d():
    make = lambda n: [random_tensor(n, 8), random_tensor(16, 8), random_tensor(16)]  # noqa: E731
    run_at_sizes(F.linear, make, [(4,), (7,), (3,), (129,), (7,)], {0: [0]})
    assert counters() == (4, 2)


def test_linear_3d_with_its_view_sizes_marked():
    # The recorder writes view(x, [24, 8]) and view(out, [4, 6, 16]) with concrete ints; marked as size expressions
    # (as test_symbolic_graph does), the graph holds at every size.
    make = lambda n, t: [random_tensor(n, t, 8), random_tensor(16, 8), random_tensor(16)]  # noqa: E731
    int_args = [(0, 1, 0, "s0*s1"), (3, 1, 0, "s0"), (3, 1, 1, "s1")]
    run_at_sizes(F.linear, make, SIZES[:5], {0: [0, 1]}, int_args=int_args)


def test_bmm():
    make = lambda n, k: [random_tensor(n, 6, k), random_tensor(n, k, 5)]  # noqa: E731
    run_at_sizes(lambda a, b: torch.bmm(a, b).relu(), make, SIZES[:5], {0: [0, 2], 1: [0, 1]})


def test_matmul_3d_with_its_size_arguments_marked():
    # matmul records expand/view/bmm/_unsafe_view and, for the 2-D weight, view/mm/_unsafe_view with concrete ints:
    # marked as the size expressions a tracer would mark, they follow the batch (s0, s2) and inner (s1, s3) sizes.
    fn = lambda a, b: torch.matmul(a, b).relu() @ torch.ones(5, 3)  # noqa: E731
    make = lambda n, k: [random_tensor(n, 6, k), random_tensor(n, k, 5)]  # noqa: E731
    int_args = [(0, 1, 0, "s0"), (0, 1, 2, "s1"), (1, 1, 0, "s0"), (1, 1, 2, "s1"), (2, 1, 0, "s2"), (2, 1, 1, "s3"),
                (3, 1, 0, "s2"), (3, 1, 1, "s3"), (5, 1, 0, "s0"), (9, 1, 0, "s0*6"), (11, 1, 0, "s0")]
    run_at_sizes(fn, make, SIZES[:5], {0: [0, 2], 1: [0, 1]}, int_args=int_args)


def test_view_and_reshape():
    fn = lambda x: x.view(4, -1, 2, 4).transpose(1, 2).reshape(4, 2, -1) * 2  # noqa: E731
    # The view's -1 follows the sequence; the reshape of the transposed view copies, then views as [4, 2, 24] with
    # concrete ints: its last size marked as s0*4, as a tracer would.
    run_at_sizes(fn, lambda t: [random_tensor(4, t, 8)], [(6,), (7,), (13,), (2,), (100,)], {0: [1]},
                 int_args=[(3, 1, 2, "s0*4")])


def test_view_of_a_size_marked_as_an_int_argument():
    fn = lambda x: x.view(x.shape[0], -1, 2, 4).sum(1)  # noqa: E731
    run_at_sizes(fn, lambda n, t: [random_tensor(n, t, 8)], SIZES[:5], {0: [0, 1]}, int_args=[(0, 1, 0, "s0")])


# ---- training ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_gradients_match_eager_at_each_size(backend):
    def fn(x, w1, b1, w2):
        h = F.layer_norm(F.linear(x, w1, b1).relu(), (16,))
        return (F.linear(h, w2).softmax(-1) * x[:, :4]).sum()

    params = [random_tensor(16, 8, requires_grad=True), random_tensor(16, requires_grad=True),
              random_tensor(4, 16, requires_grad=True)]
    make = lambda n: [random_tensor(n, 8, requires_grad=True)] + params  # noqa: E731
    _, compiled = compile_dynamic(fn, make(6), {0: [0]}, backend)
    if backend == "kiln":
        assert _C.compiled_graph_summary(compiled)["backend"] == "kiln_autograd"  # forward + backward compiled
    sizes = [6, 11, 3, 64, 11]
    for n in sizes:
        inputs = make(n)
        expected = fn(*inputs)
        want = torch.autograd.grad(expected, inputs)
        (loss,) = compiled(inputs)
        got = torch.autograd.grad(loss, inputs)
        assert_same([loss], expected, "general")
        assert_same(got, want, "general")
    assert counters() == expected_counters(sizes)


def test_training_with_loss_backward_accumulates_grads():
    fn = lambda x, w: F.linear(x, w).tanh().mean()  # noqa: E731
    w = random_tensor(5, 8, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_(True)
    _, compiled = compile_dynamic(fn, [random_tensor(3, 8), w], {0: [0]})
    for n in (3, 17, 2):
        x = random_tensor(n, 8)
        compiled([x, w])[0].backward()
        fn(x, w_eager).backward()
        assert_same([w.grad], w_eager.grad, "general")


# ---- guards that fail, and what backends see --------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_broken_assumption_raises_and_runs_nothing(backend):
    fn = lambda x, y: x * y  # noqa: E731
    _, compiled = compile_dynamic(fn, [random_tensor(4, 6), random_tensor(4, 6)], {0: [0], 1: [0]}, backend)
    inputs = [random_tensor(5, 6), random_tensor(5, 6)]
    assert_same(compiled(inputs), fn(*inputs), "pointwise")
    with pytest.raises(KilnError, match=r"input 0 dim 0 = 5 \(s0\), input 1 dim 0 = 7 \(s1\): the graph needs "
                                        r"s0 == s1 \(node 0 \(aten::mul.Tensor\): broadcast dim 0\)"):
        compiled([random_tensor(5, 6), random_tensor(7, 6)])
    with pytest.raises(KilnError, match=r"input 0 dim 0 = 1 \(s0\): outside s0's range \[2, inf\) \(sizes 0 and 1"):
        compiled([random_tensor(1, 6), random_tensor(1, 6)])
    with pytest.raises(KilnError, match=r"input 1 of the compiled graph has sizes \[5, 3\]; at these values of its "
                                        r"size symbols the graph takes \[5, 6\]"):
        compiled([random_tensor(5, 6), random_tensor(5, 3)])  # a static dim changed
    assert counters() == (2, 0)  # nothing compiled or run for the failing sizes


def test_view_sizes_computed_inside_linear_follow_the_symbols():
    # F.linear on a 3-D input records view(x, [24, 8]) with ints ATen computed: propagation infers them as s0*s1, so
    # the graph serves (5, 7) and (3, 8) (where 3*8 == 4*6: an element-count guard alone would pass wrongly).
    make = lambda n, t: [random_tensor(n, t, 8), random_tensor(16, 8), random_tensor(16)]  # noqa: E731
    _, compiled = compile_dynamic(F.linear, make(4, 6), {0: [0, 1]})
    for n, t in [(5, 7), (3, 8)]:
        inputs = make(n, t)
        assert_same(compiled(inputs), F.linear(*inputs), "general")


def test_specialised_symbol_must_keep_its_value():
    fn = lambda x, y: (x + 1, torch.cummax(y, 1).values * 2)  # noqa: E731  (cummax: an op without a rule)
    _, compiled = compile_dynamic(fn, [random_tensor(4, 6), random_tensor(3, 5, 8)], {0: [0, 1], 1: [0, 1]})
    inputs = [random_tensor(7, 9), random_tensor(3, 5, 8)]  # x varies, y stays
    assert_same(compiled(inputs), fn(*inputs), "general")
    with pytest.raises(KilnError, match=r"input 1 dim 0 = 4 \(s2\): the graph was specialised to s2 == 3 \(node 1 "
                                        r"\(aten::cummax.default\): no rule") as failed:
        compiled([random_tensor(7, 9), random_tensor(4, 5, 8)])
    assert len(str(failed.value).splitlines()) == 2  # the heading and that line, not the symbol's range again


def test_user_backend_compiles_each_binding_with_its_concrete_graph():
    seen = []

    def backend(graph, example_inputs):
        seen.append((str(graph), [tuple(t.shape) for t in example_inputs]))
        return lambda inputs: _C.run_graph(graph, "eager", inputs)

    fn = lambda x: x.relu() * 2  # noqa: E731
    x = random_tensor(4, 6)
    _, compiled = compile_dynamic(fn, [x], {0: [0]}, backend)
    for n in (4, 9, 9):
        y = random_tensor(n, 6)
        assert_same(compiled([y]), fn(y), "pointwise")
    assert [shapes for _, shapes in seen] == [[(4, 6)], [(9, 6)]]
    assert "%0 : f32[9, 6]" in seen[1][0] and "s0" not in seen[1][0]


def test_cache_keeps_the_512_most_recently_used_bindings():
    fn = lambda x: x + 1  # noqa: E731
    _, compiled = compile_dynamic(fn, [random_tensor(2, 3)], {0: [0]}, "eager")
    for n in range(3, 515):  # 512 more bindings: the one at the hints (2) is dropped
        compiled([random_tensor(n, 3)])
    assert counters() == (513, 0)
    compiled([random_tensor(514, 3)])
    compiled([random_tensor(3, 3)])
    assert counters() == (513, 2)
    compiled([random_tensor(2, 3)])
    assert counters() == (514, 2)


def test_threads_share_the_specialisations():
    fn = lambda x: (x * 3).softmax(-1)  # noqa: E731
    _, compiled = compile_dynamic(fn, [random_tensor(4, 6)], {0: [0, 1]})
    sizes = [(5, 7), (11, 3), (4, 6), (2, 9)]

    def work(k):
        for i in range(12):
            x = random_tensor(*sizes[(i + k) % len(sizes)])
            assert_same(compiled([x]), fn(x), "general")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))  # re-raises a thread's failure here
    specialisations, hits = counters()
    # Two threads that miss on one binding at once may both compile it: at least one compile per binding.
    assert len(sizes) <= specialisations <= len(sizes) + 3 * (len(sizes) - 1) and specialisations + hits == 4 * 12 + 1


def test_unknown_backend_fails_at_compile_time():
    graph = capture(lambda x: x * 2, [random_tensor(4, 6)])
    graph.propagate_symbolic_sizes({0: [0]}, [])
    with pytest.raises(KilnError, match="unknown backend 'nope'"):
        _C.compile_graph(graph, "nope", [random_tensor(4, 6)])
    assert counters() == (0, 0)


# ---- specialise_sizes -------------------------------------------------------------------------------------------
def test_specialised_graph_equals_the_capture_at_those_sizes():
    fn = lambda x, w, b: F.layer_norm(F.linear(x, w), (16,), None, b).view(x.shape[0], -1, 2, 8).sum(2)  # noqa
    inputs = [random_tensor(4, 6, 8), random_tensor(16, 8), random_tensor(16)]
    graph = capture(fn, inputs)
    summary = graph.propagate_symbolic_sizes({0: [0, 1]}, [(1, 1, 0, "s0*s1"), (3, 1, 0, "s0"), (3, 1, 1, "s1"),
                                                         (5, 1, 0, "s0")])
    assert not summary["assumptions"] and not summary["specialisations"]
    # At the hints: exactly the capture (with its symbolic table gone).
    at_hints = _C._specialise_sizes(graph, {"s0": 4, "s1": 6})
    captured = capture(fn, inputs)
    assert str(at_hints) == str(captured) and at_hints.to_json() == captured.to_json()
    # Elsewhere: exactly what a capture at those sizes records.
    other = [random_tensor(7, 13, 8), inputs[1], inputs[2]]
    assert str(_C._specialise_sizes(graph, {"s0": 7, "s1": 13})) == str(capture(fn, other))
    with pytest.raises(KilnError, match="no value for size symbol s1"):
        _C._specialise_sizes(graph, {"s0": 7})
