"""The "kiln" backend on CPU: decompositions, fusion, C++/OpenMP code generation, the on-disk cache.

Graphs are captured with a user backend that keeps them, then compiled with
`kiln._C.compile_graph(graph, "kiln", inputs)`; `kiln._C.compiled_graph_summary(compiled)` says which
kernels and extern calls it made. Every result is compared with eager on fresh random inputs.
All tests share one temporary KILN_CACHE_DIR (cleared at the start) so that identical kernels compile once.
"""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kiln
import seed_models
from kiln.testing import assert_same_as_eager, capture_graphs, random_class_targets, random_tensor, tolerance

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def kiln_cache_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kiln_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(cache))
        yield str(cache)


def capture(fn, *inputs):
    """The graph kiln captures for fn(*inputs) (exactly one graph expected) and its example inputs."""
    graphs, _ = capture_graphs(fn, *inputs, fullgraph=True)
    assert len(graphs) == 1
    return graphs[0]


def compile_kiln(fn, *inputs):
    graph, example_inputs = capture(fn, *inputs)
    compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
    return compiled, kiln._C.compiled_graph_summary(compiled), example_inputs


def assert_matches(actual, expected, kind):
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    actual = list(actual) if isinstance(actual, (tuple, list)) else [actual]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if e.numel() > 1:
            assert a.stride() == e.stride()
        rtol, atol = tolerance(e.dtype, kind)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)


def check(fn, *inputs, kind="general", expect_kernels=None, expect_backend="kiln"):
    """Compiles fn's graph with the kiln backend and checks its summary and its outputs on the example
    inputs; then runs fn through kiln.compile (the default backend, guards and all) on fresh inputs of the
    same kind. Both are compared with eager: values, dtypes, shapes, strides."""
    compiled, summary, example_inputs = compile_kiln(fn, *inputs)
    assert summary["backend"] == expect_backend, summary["fallback_reason"]
    if expect_kernels is not None:
        assert len(summary["kernels"]) == expect_kernels, summary
    with torch.no_grad():
        expected = fn(*inputs)
        actual = compiled(example_inputs)
    if isinstance(expected, (tuple, list)) and len(actual) == len(expected):
        assert_matches(actual, expected, kind)
    fresh = [fresh_like(t) for t in inputs]
    kiln.reset()
    with torch.no_grad():
        assert_matches(kiln.compile(fn)(*fresh), fn(*fresh), kind)
    kiln.reset()
    return summary


def check_made(fn, make_inputs, kind="general", fresh_calls=1):
    """check() for arguments fresh_like cannot remake (valid class or scatter indices): each call's come from
    `make_inputs()`. Compares fn's graph compiled with the kiln backend on the first, then kiln.compile (guards and
    all) on `fresh_calls` more, with eager; returns the compiled graph's summary."""
    example = make_inputs()
    compiled, summary, example_inputs = compile_kiln(fn, *example)
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    with torch.no_grad():
        assert_matches(compiled(example_inputs), fn(*example), kind)
        kiln.reset()
        compiled_fn = kiln.compile(fn)
        for _ in range(fresh_calls):
            new = make_inputs()
            assert_matches(compiled_fn(*new), fn(*new), kind)
    kiln.reset()
    return summary


def fresh_like(t):
    """Same shape, dtype and strides, new random values (never all zeros)."""
    base = random_tensor(*t.shape, dtype=t.dtype) if t.dtype != torch.bool else torch.rand(t.shape) > 0.5
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(base)


def rand(*shape, dtype=torch.float32):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, dtype=dtype)
    return random_tensor(*shape, dtype=dtype)


# ---- kernel counts ---------------------------------------------------------------------------------------
def test_pointwise_chain_is_one_kernel():
    summary = check(lambda x: torch.relu((x + 1) * 2), rand(37, 53), kind="pointwise", expect_kernels=1)
    assert summary["externs"] == []
    assert "kernel_0_add_mul_relu" in summary["source"]
    assert "#pragma omp" in summary["source"]


def test_softmax_is_one_kernel():
    check(lambda x: torch.softmax(x, -1), rand(33, 129), expect_kernels=1)


def test_log_softmax_is_one_kernel():
    check(lambda x: torch.log_softmax(x, -1), rand(7, 65), expect_kernels=1)


def test_layer_norm_is_one_kernel():
    w, b = rand(96), rand(96)
    check(lambda x: F.layer_norm(x, (96,), w, b), rand(4, 5, 96), expect_kernels=1)


def test_transposed_copy_of_a_layer_norm_is_its_kernel_store():
    # nn.MultiheadAttention(batch_first=True) transposes the normalised input and copies it contiguous: the layer
    # norm kernel stores its result in that layout itself (no kernel that reads it back).
    def f(x, w, b):
        return torch.nn.functional.layer_norm(x, (16,), w, b).transpose(0, 1).contiguous()

    def g(x, w, b):  # the copy's result also used in the same layout as the norm's: both stores
        y = torch.nn.functional.layer_norm(x, (16,), w, b)
        return y.transpose(0, 1).contiguous(), y + 1

    check(f, rand(4, 6, 16), rand(16), rand(16), expect_kernels=1)
    check(g, rand(4, 6, 16), rand(16), rand(16), expect_kernels=1)


def test_exact_identities_are_removed():
    # x * 1, x / 1, x - 0 and x ** 1 are x bit for bit (passes/simplify_algebra.h): the chain leaves one kernel with
    # the add and the returned `* 1` (a graph output stays a new tensor, as in eager).
    def chain(x, y):
        return ((((x * 1) / 1.0 - 0).pow(1)) + y) * 1

    x = torch.tensor([float("nan"), float("inf"), -0.0, 1.5, -2.0, 0.0])
    summary = check(chain, x, rand(6))
    assert summary["kernels"] == ["kernel_0_add_mul"], summary["kernels"]
    out = kiln.compile(lambda x: x * 1)(x)
    assert out.data_ptr() != x.data_ptr() and torch.equal(out.isnan(), x.isnan())
    kiln.reset()
    # left alone: a dtype promotion (bool * 1 is int64); a graph that writes its operand in place later
    check(lambda b: (b * 1) + 2, torch.rand(5) > 0.5)

    def written_later(x):
        y = x * 1
        x.add_(1)
        return y + 0.5

    expected = written_later(x.clone())
    torch.testing.assert_close(kiln.compile(written_later)(x.clone()), expected, equal_nan=True)
    kiln.reset()


def split_qkv(x, w, b):
    """nn.MultiheadAttention's general path: the in-projection's bias add, then q, k and v split off by views and
    one contiguous copy (test_compiler_cuda uses it too)."""
    proj = x @ w.t() + b
    proj = proj.unflatten(-1, (3, w.shape[1])).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    return proj[0] * 2, proj[1], proj[2]


def test_pointwise_op_before_a_permuting_copy_computes_in_the_copy():
    # The add runs in the copy's kernel, which stores only the copy.
    E = 16
    summary = check(split_qkv, rand(4, 8, E), rand(3 * E, E), rand(3 * E))
    assert "kernel_0_add_clone" in summary["kernels"], summary["kernels"]
    assert not any(k.endswith("_add") for k in summary["kernels"]), summary["kernels"]
    # a broadcast operand along a permuted dim, a scalar operand, and an offset view of the result's storage
    check(lambda x, y: (x * y).permute(2, 0, 1).contiguous(), rand(3, 5, 7), rand(1, 5, 1), expect_kernels=1)
    check(lambda x: (x - 1.5).transpose(0, 1).contiguous(), rand(6, 9), expect_kernels=1)
    check(lambda x, y: (x / y)[1].t().contiguous(), rand(3, 4, 6), rand(6))
    # an operand at an offset of its storage: a slice inside the graph, and an input that is such a view
    def offset_operand(x, b):
        return (x[1:] + b).unflatten(-1, (3, 8)).transpose(0, 1).contiguous()

    check(offset_operand, rand(5, 24), rand(24), expect_kernels=1)
    check(offset_operand, rand(50 * 24 + 7)[7:].view(50, 24), rand(24), expect_kernels=1)
    # left alone: the sum is used twice; the view slices (not dense)
    check(lambda x, y: ((x + y).t().contiguous(), (x + y).sum()), rand(5, 6), rand(6))
    check(lambda x, y: (x + y)[:, 2:5].t().contiguous(), rand(5, 6), rand(6))


def test_transposing_kernel_writes_register_transposed_tiles():
    # A channels-last value written back in the default layout (after a channels-last convolution): whole 16 x 16
    # tiles go through the prelude's register transpose, the edge tiles (19 channels, 37 x 41 pixels) through
    # the element-wise loops. Two outputs, a second input in the default layout, and a float64 kernel (always
    # element-wise) alongside.
    x = rand(2, 19, 37, 41).contiguous(memory_format=torch.channels_last)
    y = rand(2, 19, 37, 41)
    summary = check(lambda x: torch.relu(x).contiguous(), x, kind="pointwise", expect_kernels=1)
    assert "kiln_store_transposed16x16(tile0" in summary["source"]
    summary = check(lambda x, y: ((x * 2 + 1).contiguous(), torch.sigmoid(x).contiguous() - y), x, y,
                    kind="pointwise", expect_kernels=1)
    assert "kiln_store_transposed16x16(tile1" in summary["source"]
    summary = check(lambda x: torch.relu(x).contiguous(), x.double(), kind="pointwise", expect_kernels=1)
    assert "kiln_store_transposed16x16(tile" not in summary["source"]


def test_pointwise_kernel_writes_into_a_dying_intermediate():
    # relu(x @ w) * 2 + b: the kernel's output takes the matmul result's storage (its last use, nothing else
    # holds it). Run twice through kiln.compile too, on fresh inputs.
    def f(x, w, b):
        return torch.relu(x @ w) * 2 + b

    summary = check(f, rand(33, 20), rand(20, 17), rand(17), kind="pointwise", expect_kernels=1)
    assert len(summary["in_place"]) == 1, summary
    # At run time: one large allocation per call (the matmul's), counted by the host buffer cache.
    x, w, b = rand(512, 256), rand(256, 512), rand(512)
    compiled = kiln.compile(f)
    with torch.no_grad():
        compiled(x, w, b)
        before = kiln._C.host_buffer_stats()
        out = compiled(x, w, b)
        after = kiln._C.host_buffer_stats()
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 1
    torch.testing.assert_close(out, f(x, w, b))
    kiln.reset()


def test_in_place_output_skips_shared_storage():
    # The matmul result is also returned as a transposed view, and as itself: its storage is held by the caller,
    # so the kernels must write elsewhere (the plan offers it; the run checks who holds it).
    def f(x, w):
        a = x @ w
        return torch.relu(a) + 1, a.t()

    def g(x, w):
        a = x @ w
        return a, torch.sigmoid(a) * 3

    x, w = rand(16, 8), rand(8, 12)
    check(f, x, w, kind="pointwise")
    summary = check(g, x, w, kind="pointwise")
    assert summary["in_place"] == [], summary
    compiled = kiln.compile(f)
    with torch.no_grad():
        out, view = compiled(x, w)
        assert out.data_ptr() != view.data_ptr()
        torch.testing.assert_close(view, (x @ w).t())


def test_kernels_with_the_same_code_are_compiled_once():
    # Two layer norms with their own weights over values of one shape (a layer stack): two kernels, one
    # function in the C++ source, both results right.
    def f(x, w1, b1, w2, b2):
        y = torch.nn.functional.layer_norm(x, (16,), w1, b1)
        return torch.nn.functional.layer_norm(torch.relu(y @ y.t()) @ y, (16,), w2, b2)

    summary = check(f, rand(8, 16), rand(16), rand(16), rand(16), rand(16))
    norms = [k for k in summary["kernels"] if "layer_norm" in k]
    assert len(norms) == 2, summary["kernels"]
    assert summary["source"].count('extern "C" void') == len(summary["kernels"]) - 1
    assert "(the same code)" in summary["source"]


def test_linear_bias_gelu_is_one_extern_and_at_most_one_kernel():
    w, b = rand(48, 32), rand(48)
    summary = check(lambda x: F.gelu(F.linear(x, w, b)), rand(16, 32))
    assert len(summary["kernels"]) <= 1
    assert [op for op in summary["externs"] if op in ("aten::addmm.default", "aten::mm.default")] == summary["externs"][-1:]
    assert len([op for op in summary["externs"] if "mm" in op]) == 1


def test_reduction_with_epilogue_stays_in_one_kernel():
    check(lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1) * 2, rand(9, 31), expect_kernels=1)


def test_row_sum_of_a_flattened_value_is_summed_where_it_is_computed():
    # A Linear's bias gradient on a 3-d input, x.view(-1, C).sum(0): the kernel computing x also stores it and sums
    # each of its [6] blocks of rows; a second kernel sums those 6 partial rows.
    def f(x, y):
        g = F.gelu(x) * y
        return g, g.view(-1, g.shape[-1]).sum(0, keepdim=True), g.reshape(-1, g.shape[-1]).sum(0)

    summary = check(f, rand(6, 40, 72), rand(6, 40, 72))
    fused = [k for k in summary["kernels"] if "gelu" in k]
    assert len(fused) == 1 and "sum" in fused[0], summary["kernels"]
    # the producer + one kernel for both second stages (the first stages are the same sum: CSE merged them)
    assert len(summary["kernels"]) == 2, summary["kernels"]
    # 65536 outputs in the first stage: the CUDA source (compiled to PTX by this suite) takes four columns per thread
    summary = check(f, rand(64, 20, 1024), rand(64, 20, 1024))
    assert len(summary["kernels"]) == 2, summary["kernels"]
    # bfloat16: one sum over both leading dims (one rounding, as eager's), still in the producer's kernel. The terms
    # are positive: kiln sums them unrounded, eager rounds each to bfloat16 first, which a cancelling sum would
    # magnify beyond the table's tolerance.
    def h(x, y):
        g = F.gelu(x.abs()) * y.abs()
        return g, g.view(-1, g.shape[-1]).sum(0, keepdim=True)

    check(h, rand(6, 40, 72, dtype=torch.bfloat16), rand(6, 40, 72, dtype=torch.bfloat16), expect_kernels=1)


def test_horizontal_fusion_of_independent_pointwise_ops():
    check(lambda x, y: (x.exp(), y.abs() + 1), rand(10, 10), rand(10, 10), kind="pointwise", expect_kernels=1)


# ---- op coverage ------------------------------------------------------------------------------------------
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

UNARY_OPS = {
    "relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "log": lambda x: torch.log(x.abs() + 0.5),
    "neg": torch.neg, "abs": torch.abs, "sqrt": lambda x: torch.sqrt(x.abs()), "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1),
    "pow2": lambda x: x ** 2, "pow3": lambda x: x.pow(3), "pow_half": lambda x: x.abs() ** 0.5, "pow_odd": lambda x: x.abs() ** 1.7,
    "clamp": lambda x: x.clamp(-0.5, 0.7), "clamp_min": lambda x: x.clamp_min(0.1), "clamp_max": lambda x: x.clamp(max=0.2),
    "where": lambda x: torch.where(x > 0, x, x * 0.1), "erf": torch.erf,
}


UNARY_OP_LIST = list(UNARY_OPS.values())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_unary_ops(dtype):
    # All unary ops of one dtype in one graph: one compile per dtype keeps this test fast.
    def f(x):
        out = []
        for op in UNARY_OP_LIST:
            out.append(op(x))
        return tuple(out)
    check(f, rand(13, 17, dtype=dtype), kind="pointwise")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int64], ids=str)
def test_binary_ops_with_broadcast_and_scalars(dtype):
    def f(x, y, z):
        out = (x + y, x - y, x * z, torch.add(x, y, alpha=2), torch.sub(x, z, alpha=3), x + 3, 2 - x, x * 4,
               torch.maximum(x, y), torch.minimum(x, z), x > y, x <= 1, x == x, torch.where(x > 0, y, z))
        if dtype.is_floating_point:
            out += (x / (y.abs() + 1), x / 3, x.to(torch.float64), x.to(torch.float32))
        else:
            out += (x.to(torch.float32), x.clamp(-3, 5), x.abs(), -x)
        return out
    # half/bfloat16: fused chains keep intermediates in float (eager rounds after every op), so compare
    # with the general table there.
    kind = "general" if dtype in (torch.float16, torch.bfloat16) else "pointwise"
    check(f, rand(6, 1, 9, dtype=dtype), rand(5, 1, dtype=dtype), rand(9, dtype=dtype), kind=kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_reductions(dtype):
    w, b = rand(24, dtype=dtype), rand(24, dtype=dtype)

    def f(x):
        return (x.sum(-1), x.sum((0, 2)), x.mean(1), x.mean(-1, keepdim=True), x.amax(-1), x.amax(0), x.sum(),
                torch.softmax(x, -1), torch.softmax(x, 1), torch.log_softmax(x, -1),
                F.layer_norm(x, (24,), w, b), F.layer_norm(x, (5, 24)))
    check(f, rand(3, 5, 24, dtype=dtype))


@pytest.mark.parametrize("shape,dims", [((1, 1 << 20), (1,)), ((8, 64, 56, 56), (0, 2, 3)), ((3, 50_000), (-1,)),
                                        ((4096, 1024), (0,)), ((64, 200, 96), (0, 1))])
def test_long_float_sums_are_as_accurate_as_eager(shape, dims):
    # Sums in float blocks (1024 elements of a row, 256 rows of a column sum) added in double: a million-element
    # sum in one float accumulator was 35x further from the exact sum than eager's cascade sum, a bias gradient's
    # column sum over 4096 rows 12x.
    torch.manual_seed(0)
    x = torch.randn(shape) + 0.3
    fn = lambda x: (x * 1.5).sum(dims)  # noqa: E731
    exact = (x.double() * 1.5).sum(dims)
    kiln_error = (kiln.compile(fn)(x).double() - exact).abs().max().item()
    eager_error = (fn(x).double() - exact).abs().max().item()
    assert kiln_error <= 1.5 * eager_error + 1e-7 * exact.abs().max().item(), (kiln_error, eager_error)


def test_integer_sum_and_amax():
    check(lambda x: (x.sum(-1), x.amax(1), x.sum()), rand(4, 7, dtype=torch.int64))


def test_views_as_index_expressions():
    def f(x, y):
        a = x.t() * 2                      # transposed read, transposed output strides
        b = x[1:, ::2] + 1                 # slice with step
        c = x.unsqueeze(0).expand(3, 6, 8) * y.view(3, 1, 1)
        d = x.reshape(48).relu()
        e = x.permute(1, 0)[2] - 1         # select after permute
        return a, b, c, d, e, x.t()        # a view as an output stays a view (extern)
    summary = check(f, rand(6, 8), rand(3), kind="pointwise")
    assert summary["externs"] == ["aten::t.default"]


def test_non_contiguous_and_broadcast_inputs():
    x = rand(8, 10).t()  # non-contiguous input
    y = rand(1, 8)
    check(lambda x, y: torch.relu(x * y + 1), x, y, kind="pointwise")


def test_zero_dim_and_empty_tensors():
    check(lambda x, y: (x * 2 + 1, x.exp()), rand(), rand(3), kind="pointwise")
    check(lambda x: (x + 1, x.sum(-1), torch.softmax(x, -1)), torch.empty(0, 5))


def test_odd_sizes_parallel_path():
    # Big enough for the OpenMP-parallel path (>= 32768 elements), odd sizes everywhere.
    check(lambda x: (torch.relu((x + 1) * 2), torch.softmax(x, -1), x.sum(0)), rand(257, 263))


def test_views_returned_by_a_compiled_graph_alias_like_eager():
    # Views a compiled graph returns (extern calls on inputs and on a kernel's result) share their base's storage,
    # with eager's sizes, strides and offsets, and see later writes to it.
    def f(x, w):
        return w.t(), x[1:, ::2], (x * 2).view(-1), w.unsqueeze(0).expand(3, *w.shape), x.transpose(0, 1)[2:]

    x, w = rand(6, 8), rand(4, 5)
    with torch.no_grad():
        expected = f(x, w)
        actual = kiln.compile(f)(x, w)
        for a, e in zip(actual, expected):
            assert a.shape == e.shape and a.stride() == e.stride() and a.storage_offset() == e.storage_offset()
            assert a._is_view() == e._is_view()
            torch.testing.assert_close(a, e)
        assert actual[0].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert actual[1].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        x.add_(1)
        torch.testing.assert_close(actual[1], x[1:, ::2])
        torch.testing.assert_close(actual[4], x.transpose(0, 1)[2:])
    kiln.reset()


def test_views_of_intermediates_are_materialised():
    check(lambda x: ((x + 1).t() * 2, (x * 3).reshape(-1).sum()), rand(5, 7))


def test_inplace_ops_on_intermediates_become_functional_and_fuse():
    def f(x):
        y = x * 2
        y.add_(1)
        y.relu_()
        return y
    summary = check(f, rand(4, 4), kind="pointwise", expect_kernels=1)
    assert summary["externs"] == []


def test_adaptive_average_pool_of_a_channels_last_input_is_compiled():
    # ATen's adaptive_avg_pool2d to 1x1 restrides its fresh mean in place (as_strided_), which kept the graph
    # (NesT's and CoAtNet's heads) on the eager interpreter.
    pool = torch.nn.AdaptiveAvgPool2d(1)

    def f(x):
        return torch.flatten(pool(x.permute(0, 3, 1, 2)), 1) * 2

    x = rand(2, 5, 5, 8)
    graph, example_inputs = capture(f, x)
    summary = kiln._C.compiled_graph_summary(kiln._C.compile_graph(graph, "kiln", example_inputs))
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    assert_same_as_eager(f, x)


def test_inplace_bitwise_views_and_random_fills_on_intermediates_become_functional():
    def f(a, b, x):
        m = a > 0
        m &= b > 0  # bitwise_and_
        y = x * 2
        y.t_()  # an in-place view of a fresh tensor
        z = (x + 1).uniform_(-1, 1)  # a random fill of a fresh tensor
        return m, y + 1, z

    a, b, x = torch.randn(6), torch.randn(6), torch.randn(3, 4)
    graph, example_inputs = capture(f, a, b, x)
    summary = kiln._C.compiled_graph_summary(kiln._C.compile_graph(graph, "kiln", example_inputs))
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    torch.manual_seed(7)
    expected = f(a, b, x)
    torch.manual_seed(7)
    actual = kiln.compile(f)(a, b, x)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want)  # the fill draws the same numbers under the same seed


def test_inplace_relu_module_compiles():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 4))
    model.requires_grad_(False)
    check(model, rand(5, 8))


def test_mutated_intermediate_returned_before_and_after():
    def f(x):
        y = x - 1
        z = y.mul_(3).clamp_(min=0)
        return y, z, z + 1
    check(f, rand(6, 3), kind="pointwise")


def test_inplace_update_of_an_input_is_compiled_and_written_back():
    # The update becomes functional inside the graph; its final value is copied into the caller's tensor.
    def f(x):
        return x.add_(1).relu()
    graph, example_inputs = capture(f, rand(4, 4))
    compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
    summary = kiln._C.compiled_graph_summary(compiled)
    assert summary["backend"] == "kiln", summary
    x = rand(4, 4)
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        torch.testing.assert_close(compiled([mine])[0], f(theirs))
    torch.testing.assert_close(mine, theirs)  # the input is mutated as in eager


def test_inplace_through_a_slice_of_an_intermediate_is_compiled():
    def f(x):
        y = x * 2
        y[0].mul_(3)  # writes through a view: y changes too (a select_scatter of the product into y)
        y[1:3, 1] += y[0, :2]
        return y
    check(f, rand(4, 4), expect_backend="kiln")


def test_inplace_through_a_whole_slice_of_an_intermediate_is_compiled():
    # `out[:, :n]` with n the full size is an alias in ATen (GhostNet's `x = out[:, :n]; x += shortcut`): it ran on the
    # eager interpreter.
    def f(a, b, s):
        out = torch.cat([a, b], dim=1)
        x = out[:, :6]
        x += s
        return x.relu(), out.sum(0)
    check(f, rand(2, 3, 4), rand(2, 3, 4), rand(2, 6, 4), expect_backend="kiln")


def test_inplace_on_a_viewed_intermediate_falls_back_to_eager():
    def f(x):
        y = x * 2
        flat = y.view(-1)
        y.relu_()  # flat sees it
        return flat + 0
    summary = check(f, rand(4, 4), expect_backend="eager")
    assert "in-place" in summary["fallback_reason"]


def test_inplace_with_a_wider_operand_keeps_the_narrow_dtype():
    def f(x, w):
        y = x.to(torch.bfloat16) * 1
        y.mul_(w)  # in place: computed in float32 and stored as bfloat16, which the functional mul and a cast do
        return y
    check(f, rand(8), rand(8))


def test_grad_mode_with_requires_grad_falls_back():
    # With compiled autograd off (kiln.config), a graph that needs grad replays on the eager interpreter, whose
    # autograd records each op (the conftest fixture restores the switch).
    kiln.config.set_compiled_autograd(False)
    x = rand(3, 3).requires_grad_()
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return lambda xs: kiln._C.run_graph(graph, "eager", xs)

    kiln.reset()
    kiln.compile(lambda t: (t + 1).relu(), backend=keep)(x)  # keep() stores (graph, example_inputs)
    kiln.reset()
    compiled = kiln._C.compile_graph(graphs[0], "kiln", [x])  # the single input
    summary = kiln._C.compiled_graph_summary(compiled)
    assert summary["backend"] == "eager" and "grad" in summary["fallback_reason"]
    (out,) = compiled([x])
    out.sum().backward()
    torch.testing.assert_close(x.grad, (x + 1 > 0).float())


# ---- gathered reads: embedding, gather, index_select (decomp/decompose_gather.cpp) --------------------------
def embedding_block(word, kinds, positions, weight, bias, kind_buffer):
    """BERT's embedding block over these tables: word + token type (through a gather of `kind_buffer`) + position,
    then layer norm."""
    position_ids = torch.arange(positions.shape[0], device=word.device).unsqueeze(0)

    def embed(ids):
        batch, length = ids.shape
        kind = torch.gather(kind_buffer.expand(batch, -1), 1, position_ids[:, :length].expand(batch, -1))
        x = F.embedding(ids, word) + F.embedding(kind, kinds) + F.embedding(position_ids[:, :length], positions)
        return F.layer_norm(x, (word.shape[1],), weight, bias)
    return embed


def embedding_tables(vocab, seq, hidden, dtype, device="cpu"):
    """Random tables for embedding_block."""
    word, kinds, positions = (random_tensor(n, hidden, dtype=dtype, device=device) for n in (vocab, 2, seq))
    weight, bias = (random_tensor(hidden, dtype=dtype, device=device) for _ in range(2))
    return word, kinds, positions, weight, bias, torch.randint(0, 2, (1, seq), device=device)


def embeddings_model(vocab=50, seq=16, hidden=32, dtype=torch.float32):
    return embedding_block(*embedding_tables(vocab, seq, hidden, dtype))


@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_embeddings_are_read_inside_the_kernels_that_use_them(dtype, index_dtype):
    embed = embeddings_model(dtype=dtype)
    ids = torch.randint(0, 50, (4, 16), dtype=index_dtype)
    compiled, summary, example_inputs = compile_kiln(embed, ids)
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    # no embedding or gather runs as an extern call: the gather, the position embedding (one row per position: its
    # own domain), then the first two embeddings with their add, the add and the layer norm in one kernel (the first
    # add moves down to its reader past the position embedding's kernel: passes/fuse_recomputation)
    assert not any("embedding" in e or "gather" in e for e in summary["externs"]), summary["plan"]
    assert len(summary["kernels"]) == 3, summary["plan"]
    with torch.no_grad():
        assert_matches(compiled(example_inputs), embed(ids), "general")
        kiln.reset()
        fn = kiln.compile(embed)
        for _ in range(2):  # fresh indices through the guarded entry
            new = torch.randint(0, 50, (4, 16), dtype=index_dtype)
            assert_matches(fn(new), embed(new), "general")
    kiln.reset()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_and_gather_as_generated_code(dim):
    x = rand(6, 7, 5)
    size = x.shape[dim]
    index = torch.randint(0, size, (9,))
    where = torch.randint(0, size, tuple(4 if d == (dim % 3) else n for d, n in enumerate(x.shape)))

    def fn(x, index, where):
        return torch.index_select(x, dim, index) * 2 + 1, torch.gather(x, dim, where).relu()
    compiled, summary, example_inputs = compile_kiln(fn, x, index, where)
    assert summary["externs"] == [], summary["plan"]
    assert any("index_select" in k for k in summary["kernels"]) and any("gather" in k for k in summary["kernels"])
    with torch.no_grad():
        assert_matches(compiled(example_inputs), fn(x, index, where), "general")
        kiln.reset()
        new = (rand(6, 7, 5), torch.randint(0, size, index.shape), torch.randint(0, size, where.shape))
        assert_matches(kiln.compile(fn)(*new), fn(*new), "general")
    kiln.reset()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_cat_is_one_loop_with_its_producers_and_readers():
    # Llama's rotary embedding: the negation is recomputed inside the cat's loop, and the multiply-adds and the sum
    # that read it join that loop, so the projection's output is read once and nothing in between is stored
    weight = random_tensor(128, 64)

    def rotary(x, cos, sin):
        q = (x @ weight.t()).view(2, 16, 4, 32).transpose(1, 2)
        return (q * cos + rotate_half(q) * sin).sum(-1)
    x, cos, sin = rand(2, 16, 64), rand(16, 32), rand(16, 32)
    summary = check(rotary, x, cos, sin)
    assert not any("cat" in e for e in summary["externs"]), summary["plan"]
    assert len(summary["kernels"]) == 1 and "cat" in summary["kernels"][0], summary["plan"]
    kiln.reset()
    assert_same_as_eager(rotary, rand(2, 16, 64).requires_grad_(), cos, sin.requires_grad_())
    kiln.reset()


CAT_CASES = {
    "dim0": (lambda a, b: torch.cat([a, b]) * 2, lambda: (rand(3, 5), rand(4, 5))),
    "middle_dim_three_operands": (lambda a, b, c: torch.cat([a, b.sin(), c], 1).relu(),
                                  lambda: (rand(2, 3, 4), rand(2, 1, 4), rand(2, 5, 4))),
    "an_empty_operand": (lambda a, b, c: torch.cat([a, b, c], -1) + 1, lambda: (rand(3, 5), rand(3, 0), rand(3, 2))),
    "promoted_dtypes": (lambda a, b: torch.cat([a, b], -1), lambda: (rand(3, 5), rand(3, 2, dtype=torch.float64))),
    "a_transposed_operand": (lambda a, b: torch.cat([a.exp(), b.t()]), lambda: (rand(3, 5), rand(5, 2))),
    "integers_and_bools": (lambda a, b: torch.cat([a, (b > 0).int()]) * 3,
                           lambda: (rand(2, 4, dtype=torch.int32), rand(3, 4))),
    # ATen skips a 1-d empty operand whatever the others' rank (a transformers cache's first update)
    "a_legacy_empty_operand": (lambda a, b: torch.cat([b, a], -2) * 2, lambda: (rand(2, 3, 4), rand(0))),
    "half_precision": (lambda a, b: torch.cat([a, b * 2], 1), lambda: (rand(2, 3, dtype=torch.bfloat16), rand(2, 5, dtype=torch.bfloat16))),
}


@pytest.mark.parametrize("case", list(CAT_CASES))
def test_cat_as_generated_code_matches_eager(case):
    fn, make = CAT_CASES[case]
    inputs = make()
    summary = check(fn, *inputs)
    assert not any("cat" in e for e in summary["externs"]), summary["plan"]


def test_cat_calls_generated_code_cannot_express_stay_aten_calls():
    many = [rand(2, 3) for _ in range(9)]  # more operands than one loop selects between
    summary = check(lambda *xs: torch.cat(xs) * 2, *many)
    assert "aten::cat.default" in summary["externs"], summary["plan"]


@pytest.mark.parametrize("dim,start,end", [(1, 2, 5), (-1, -3, 9), (0, 0, 2)])
def test_a_slice_gradient_is_a_padded_read(dim, start, end):
    def fn(g):
        return torch.ops.aten.slice_backward(g, [4, 6, 5], dim, start, end, 1) * 2 + 1
    sizes = [4, 6, 5]
    d = dim % 3
    lo = max(0, start + sizes[d] if start < 0 else start)
    hi = min(sizes[d], end)
    summary = check(fn, rand(*[hi - lo if i == d else n for i, n in enumerate(sizes)]), expect_kernels=1)
    assert summary["externs"] == [], summary["plan"]
    # a step other than 1 scatters every step-th element: an ATen call
    summary = check(lambda g: torch.ops.aten.slice_backward(g, [4, 6], 1, 0, 6, 2) * 2, rand(4, 3))
    assert "aten::slice_backward.default" in summary["externs"], summary["plan"]


def test_cat_gradients_match_eager():
    def fn(a, b):
        return torch.cat([a.tanh(), b, a * b[:, :3]], dim=1).square().sum()
    assert_same_as_eager(fn, rand(4, 3).requires_grad_(), rand(4, 6).requires_grad_())
    kiln.reset()


@pytest.mark.parametrize("bad", [50, -1])
def test_an_index_out_of_range_raises_index_error_as_in_eager(bad):
    word = rand(50, 8)
    fn = kiln.compile(lambda ids: F.embedding(ids, word) * 2)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(fn(ids), F.embedding(ids, word) * 2)
    with pytest.raises(IndexError, match="index out of range"):
        F.embedding(torch.tensor([[1, bad, 3]]), word)
    with pytest.raises(IndexError, match="index out of range"):
        fn(torch.tensor([[1, bad, 3]]))
    # the flag is cleared: the next call with good indices runs normally
    torch.testing.assert_close(fn(ids), F.embedding(ids, word) * 2)
    kiln.reset()


def test_threads_running_one_gathering_graph_see_only_their_own_index_errors():
    # The library's index-error flag is read under a lock with its kernel (the GIL is released while a graph
    # runs): a thread with good indices never raises, one with a bad index always does.
    import threading
    word = rand(4000, 64)
    fn = lambda ids: F.embedding(ids, word) * 2  # noqa: E731
    good = torch.randint(0, 4000, (256, 512))  # long enough (8M outputs) for the two threads' kernels to overlap
    bad = good.clone()
    bad[255, 511] = 4000
    compiled, summary, examples = compile_kiln(fn, good)
    assert summary["externs"] == [], summary
    expected = fn(good)
    wrong = []

    def run(ids, should_raise):
        inputs = [ids if t is good else t for t in examples]  # the table is an input of the graph too
        for _ in range(30):
            try:
                out = compiled(inputs)[0]
                if should_raise or not torch.equal(out, expected):
                    wrong.append("no error" if should_raise else "wrong values")
            except IndexError:
                if not should_raise:
                    wrong.append("another thread's error")
            except Exception as e:  # noqa: BLE001 (reported by the assertion below)
                wrong.append(repr(e))

    threads = [threading.Thread(target=run, args=(good, False)), threading.Thread(target=run, args=(bad, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [], wrong[:5]


# ---- scatters with one index per slice (decomp/decompose_gather.cpp) ----------------------------------------
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_with_one_index_per_slice_is_pointwise(dim):
    # scatter/scatter_add whose index has size 1 along dim write where(iota(dim) == index, ...) in one kernel with
    # what reads them; a larger index (several hits per slice, which scatter_add sums) stays an extern call.
    x = rand(6, 7, 5)
    slice_shape = tuple(1 if d == dim % 3 else n for d, n in enumerate(x.shape))

    def fn(x, index, src, wide):
        return (x.scatter_add(dim, index, src) * 2, x.scatter(dim, index, src).relu(), x.scatter(dim, index, 1.5) + 1,
                x.scatter_add(dim, wide, x))

    def inputs():
        size = x.shape[dim]
        return (rand(6, 7, 5), torch.randint(0, size, slice_shape), rand(*slice_shape),
                torch.randint(0, size, x.shape))
    summary = check_made(fn, inputs, "pointwise")
    assert summary["externs"] == ["aten::scatter_add.default"], summary["plan"]


@pytest.mark.parametrize("bad", [5, -1])
def test_a_scatter_index_out_of_range_raises_index_error_as_in_eager(bad):
    fn = lambda x, index: x.scatter(1, index, 2.0) * 3  # noqa: E731
    x, good = rand(4, 5), torch.tensor([[0], [4], [2], [1]])
    compiled = kiln.compile(fn)
    torch.testing.assert_close(compiled(x, good), fn(x, good))
    wrong = good.clone()
    wrong[2, 0] = bad
    with pytest.raises(RuntimeError, match="out of bounds"):
        fn(x, wrong)
    with pytest.raises(IndexError, match="index out of range"):
        compiled(x, wrong)
    torch.testing.assert_close(compiled(x, good), fn(x, good))
    kiln.reset()


# ---- cross entropy without its log_softmax (passes/lower_cross_entropy.h) -----------------------------------
def assert_no_log_softmax(summary):
    assert not any("nll_loss" in e or "log_softmax" in e for e in summary["externs"]), summary["plan"]
    assert not any("log_softmax" in k for k in summary["kernels"]), summary["plan"]


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_computes_no_log_softmax(reduction, ignored):
    # 37 classes: not a multiple of any vector width. All targets ignored: mean is nan (0 / 0), as eager's.
    fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
    summary = check_made(fn, lambda: (rand(13, 37), random_class_targets(13, 37, ignored)), fresh_calls=2)
    assert_no_log_softmax(summary)
    assert len(summary["kernels"]) == 2, summary["plan"]  # the row reduction (logsumexp), then the picks and sums


@pytest.mark.parametrize("case", ["float64", "ignore_index_in_range", "no_batch", "no_batch_ignored", "lm_head"])
def test_cross_entropy_variants_compute_no_log_softmax(case):
    head = torch.nn.Linear(16, 64).requires_grad_(False)  # an evaluation: test_training.py trains one
    fns = {
        "float64": (lambda x, t: F.cross_entropy(x, t),
                    lambda: (rand(9, 37, dtype=torch.float64), random_class_targets(9, 37, "some"))),
        "ignore_index_in_range": (lambda x, t: F.cross_entropy(x, t, ignore_index=2),
                                  lambda: (rand(9, 5), random_class_targets(9, 5, "none"))),
        "no_batch": (lambda x, t: [F.cross_entropy(x, t, reduction=r) for r in ("mean", "sum", "none")],
                     lambda: (rand(37), torch.randint(0, 37, ()))),
        "no_batch_ignored": (lambda x, t: [F.cross_entropy(x, t, reduction=r) for r in ("mean", "sum", "none")],
                             lambda: (rand(37), torch.tensor(-100))),
        # transformers' ForCausalLMLoss: logits.float(), flattened, summed and divided by the items in the batch
        "lm_head": (lambda h, t: F.cross_entropy(head(h).float().view(-1, 64), t.view(-1), ignore_index=-100,
                                                 reduction="sum") / (t != -100).sum(),
                    lambda: (rand(2, 6, 16), random_class_targets(12, 64, "some").view(2, 6))),
    }
    assert_no_log_softmax(check_made(*fns[case]))


@pytest.mark.parametrize("bad", [37, -5])
def test_a_cross_entropy_target_out_of_range_raises_index_error_as_in_eager(bad):
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    x, good = rand(4, 37), torch.tensor([0, 36, 5, -100])
    compiled = kiln.compile(fn)
    torch.testing.assert_close(compiled(x, good), fn(x, good))
    wrong = good.clone()
    wrong[1] = bad
    with pytest.raises(IndexError):
        fn(x, wrong)
    with pytest.raises(IndexError, match="index out of range"):
        compiled(x, wrong)
    kiln.reset()


@pytest.mark.parametrize("case", ["log_softmax_returned", "class_weights", "label_smoothing"])
def test_cross_entropy_the_lowering_leaves_alone_still_matches_eager(case):
    # a log_softmax another op reads too (label smoothing sums it), or class weights: ATen's nll_loss over it
    weights = torch.rand(37) + 0.5

    def log_softmax_returned(x, t):
        log_probs = F.log_softmax(x, 1)
        return F.nll_loss(log_probs, t), log_probs * 2
    fn = {"log_softmax_returned": log_softmax_returned,
          "class_weights": lambda x, t: F.cross_entropy(x, t, weight=weights),
          "label_smoothing": lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)}[case]
    summary = check_made(fn, lambda: (rand(13, 37), random_class_targets(13, 37, "some")))
    assert "aten::nll_loss_forward.default" in summary["externs"], summary["plan"]


# ---- constant folding (passes/fold_constants.h) -------------------------------------------------------------
def causal_scores(x):
    n = x.shape[-1]
    mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    position = torch.arange(n).float() * 0.5
    return torch.softmax(x + mask, -1) * weights.sum() + position[:, None]


def test_work_that_reads_no_input_is_folded_into_constants():
    summary = check(causal_scores, rand(6, 6), expect_kernels=1)
    assert summary["externs"] == []  # triu and arange ran once, at compile time
    assert [line.split(" from ")[1] for line in summary["folded"]] == ["aten::triu.default", "aten::mul.Tensor",
                                                                     "aten::sum.default"]


def test_a_mask_built_in_place_is_folded():
    def f(x):
        mask = torch.full((x.shape[-1], x.shape[-1]), float("-inf"))
        mask.triu_(1)
        return torch.softmax(x + mask, -1)

    summary = check(f, rand(5, 7, 7), expect_kernels=1)
    assert len(summary["folded"]) == 1 and summary["externs"] == []


def test_random_values_are_never_folded():
    def f(x):
        return x + torch.rand(x.shape[-1]) * torch.arange(x.shape[-1])

    compiled, summary, inputs = compile_kiln(f, rand(3, 8))
    assert [line.split(" from ")[1] for line in summary["folded"]] == ["aten::arange.default"]
    torch.manual_seed(7)
    first = compiled(inputs)[0]
    torch.manual_seed(7)
    assert torch.equal(compiled(inputs)[0], first)  # the generator's draws, per call
    torch.manual_seed(7)
    assert_matches(first, f(inputs[0]), "general")
    assert not torch.equal(compiled(inputs)[0], first)


def test_a_returned_tensor_is_never_a_folded_constant():
    def f(x):
        table = torch.arange(4).float() * 2
        return x * table, table[None], table.sum()

    compiled = kiln.compile(f)
    x = rand(3, 4)
    with torch.no_grad():
        _, row, total = compiled(x)
        row.add_(100)  # the caller owns what it was given
        total.add_(100)
        assert_matches(compiled(x), f(x), "general")
    kiln.reset()


def test_storage_written_in_place_is_not_folded_and_matches_eager():
    def f(x):
        acc = torch.zeros(x.shape[-1])
        before = acc.cumsum(0) + 1
        acc.add_(x[0])
        return x * before + acc

    check(f, rand(4, 9))


def test_a_constant_over_16_mib_stays_a_node():
    def f(x):
        n = x.shape[-1]
        return x + torch.triu(torch.full((n, n), -1.0), diagonal=1)

    assert check(f, rand(2100, 2100))["folded"] == []  # 17.6 MB
    assert len(check(f, rand(200, 200))["folded"]) == 1


def test_folded_constants_in_a_training_graph_give_eager_gradients():
    def f(x, w):
        n = x.shape[-1]
        mask = torch.tril(torch.ones(n, n)) * torch.arange(1.0, n + 1)
        return ((x @ w) * mask).sum()

    x, w = rand(7, 7), rand(7, 7)
    grads = []
    for fn in (f, kiln.compile(f)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xs, ws).backward()
        grads.append((xs.grad, ws.grad))
    kiln.reset()
    for actual, expected in zip(grads[1], grads[0]):
        assert_matches(actual, expected, "general")


# ---- whole models through kiln.compile (the default backend) ------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: (seed_models.MLP(), (32, 100)),
    lambda: (seed_models.ConvReLU(), (2, 3, 16, 16)),
    lambda: (seed_models.TransformerBlock(d_model=64, nhead=4, dim_feedforward=128).eval(), (2, 8, 64)),
], ids=["mlp", "convrelu", "transformer_eval"])
def test_seed_models_match_eager(make):
    model, shape = make()
    kiln.reset()
    before = kiln._C.compiler_stats()["graphs_compiled"]
    compiled = kiln.compile(model)
    with torch.no_grad():
        for _ in range(2):
            x = random_tensor(*shape)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert kiln._C.compiler_stats()["graphs_compiled"] > before
    kiln.reset()


def test_verify_switch_runs_clean(monkeypatch):
    monkeypatch.setenv("KILN_VERIFY", "1")
    check(lambda x: (torch.relu(x + 1) + torch.relu(x + 1)).sum(-1), rand(5, 6))


# ---- the cache and the compiler ---------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, torch, kiln
    torch.manual_seed(0)
    def f(x):
        return torch.softmax(x * 3 + 1, -1) * {tag}
    x = torch.randn(8, 16)
    with torch.no_grad():
        out = kiln.compile(f)(x)
    ok = torch.allclose(out, f(x), atol=1e-5)
    s = kiln._C.compiler_stats()
    print(ok, s["kernels_compiled"], s["cache_hits"], s["corrupt_entries"], s["graphs_fallback"], s["graph_cache_hits"])
""")


def run_child(cache_dir, tag, env_extra=None, background=False):
    env = dict(os.environ, KILN_CACHE_DIR=cache_dir, PYTHONPATH=os.path.join(REPO_ROOT, "python"))
    env.update(env_extra or {})
    args = [sys.executable, "-c", CHILD.format(tag=tag)]
    if background:
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_second_process_hits_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    assert run_child(cache, 2) == ["True", "1", "0", "0", "0", "0"]   # compiled once
    assert run_child(cache, 2) == ["True", "0", "1", "0", "0", "1"]   # graph and library loaded: no codegen, no compiler


def test_corrupt_entry_is_rebuilt(tmp_path):
    cache = str(tmp_path / "cache")
    assert run_child(cache, 3)[:2] == ["True", "1"]
    libraries = [os.path.join(cache, "cpp", n) for n in os.listdir(os.path.join(cache, "cpp")) if n.endswith(".so")]
    assert len(libraries) == 1
    with open(libraries[0], "r+b") as f:
        f.seek(100)
        f.write(b"garbage!")
    # the graph record is fine, the library it names is not: rebuilt from the record's source
    assert run_child(cache, 3) == ["True", "1", "0", "1", "0", "1"]
    assert run_child(cache, 3) == ["True", "0", "1", "0", "0", "1"]


def test_corrupt_graph_record_is_rebuilt(tmp_path):
    cache = str(tmp_path / "cache")
    assert run_child(cache, 5)[:2] == ["True", "1"]
    records = [os.path.join(cache, "graphs", n) for n in os.listdir(os.path.join(cache, "graphs")) if n.endswith(".kgraph")]
    assert len(records) == 1
    with open(records[0], "r+b") as f:
        f.seek(10)
        f.write(b"garbage!")
    # passes and code generation run again; the library is still found by its source
    assert run_child(cache, 5) == ["True", "0", "1", "1", "0", "0"]
    assert run_child(cache, 5) == ["True", "0", "1", "0", "0", "1"]


WARM_CHILD = textwrap.dedent('''
    import sys, torch, kiln
    sys.path.insert(0, {bench!r})
    import seed_models
    torch.manual_seed(0)
    SCALE = torch.randn(24)   # a module-level tensor the graph reads

    def block(x):
        h = torch.nn.functional.layer_norm(x, (24,)) * SCALE
        return torch.softmax(h @ h.transpose(-1, -2), -1) @ h + x

    def causal(x):  # a mask folded into a constant at compile time, and again in the second process
        mask = torch.full((x.shape[-1], x.shape[-1]), float("-inf")).triu(1)
        return torch.softmax(x + mask, -1)

    model = seed_models.TransformerBlock(d_model=32, nhead=4, dim_feedforward=64).eval()
    cases = [(block, torch.randn(2, 5, 24)), (model, torch.randn(2, 6, 32)), (causal, torch.randn(3, 7, 7))]
    ok = True
    with torch.no_grad():
        for fn, x in cases:
            ok = ok and torch.allclose(kiln.compile(fn)(x), fn(x), rtol=1e-4, atol=1e-4)
    s = kiln._C.compiler_stats()
    print(ok, s["graphs_compiled"], s["graph_cache_hits"], s["kernels_compiled"])
''')


def test_whole_graphs_with_externs_and_constants_come_back_from_the_cache(tmp_path):
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.path.join(REPO_ROOT, "python"))
    code = WARM_CHILD.format(bench=os.path.dirname(os.path.abspath(seed_models.__file__)))
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.split())
    ok, compiled, hits, built = outputs[0]
    assert ok == "True" and int(compiled) >= 3 and hits == "0" and int(built) >= 1
    ok, compiled2, hits, built = outputs[1]
    assert ok == "True" and compiled2 == compiled and hits == compiled and built == "0"


def test_two_processes_compiling_at_once_both_succeed(tmp_path):
    cache = str(tmp_path / "cache")
    children = [run_child(cache, 4, background=True) for _ in range(2)]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        assert out.split()[0] == "True" and out.split()[4] == "0"
    assert run_child(cache, 4)[2] == "1"


def test_broken_compiler_falls_back_to_eager(tmp_path):
    cache = str(tmp_path / "cache")
    ok, compiled, hits, corrupt, fallbacks, graph_hits = run_child(cache, 5, {"CXX": "/bin/false"})
    assert (ok, compiled, fallbacks) == ("True", "0", "1")


def test_debug_dir_keeps_graph_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DEBUG_DIR", str(tmp_path))
    check(lambda x: x.sigmoid() * 5, rand(3, 3), kind="pointwise")
    names = os.listdir(tmp_path)
    assert any(n.endswith(".cpp") for n in names) and any(n.endswith(".graph.txt") for n in names)


def test_decomposition_table_lists_the_required_ops():
    ops = set(kiln._C.decomposed_ops())
    for op in ("aten::add.Tensor", "aten::gelu.default", "aten::_softmax.default", "aten::native_layer_norm.default",
               "aten::sum.dim_IntList", "aten::amax.default", "aten::_to_copy.default", "aten::where.self"):
        assert op in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_keeps_exp_in_the_output_between_passes(dtype, dim):
    # The generated softmax stores exp(x - max) into its output during the sum and rescales it in place:
    # every reduced dim, masked (-inf) entries and a row of equal values must still match eager.
    x = rand(5, 7, 9, dtype=dtype)
    x[1, :, 2] = float("-inf")
    x[2, 3, :] = 0.5
    x[0, 0, 0] = float("-inf")
    compiled, summary, inputs = compile_kiln(lambda t: torch.softmax(t, dim), x)
    assert summary["backend"] == "kiln" and len(summary["kernels"]) == 1
    assert "kept for the store loop" in summary["source"]
    (out,) = compiled([x])
    torch.testing.assert_close(out, torch.softmax(x, dim), rtol=1e-5 if dtype == torch.float32 else 1e-7, atol=1e-6,
                               equal_nan=True)  # a row that is all -inf gives NaN, as in eager


def test_inference_batch_norm_fuses_with_its_activation():
    bn = torch.nn.BatchNorm2d(6).eval().requires_grad_(False)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-1, 1)
    summary = check(lambda x, r: F.relu(bn(x) + r), rand(2, 6, 5, 7), rand(2, 6, 5, 7), expect_kernels=1)
    assert not any("batch_norm" in e for e in summary["externs"]), summary


def test_training_batch_norm_is_not_lowered():
    bn = torch.nn.BatchNorm2d(4).train().requires_grad_(False)
    # the running statistics are updated inside the ATen op; num_batches_tracked's add_ is a buffer update
    summary = check(lambda x: bn(x.clone()) * 1, rand(3, 4, 5, 5), expect_backend="kiln")
    assert any("batch_norm" in e for e in summary["externs"]), summary


# ---- composite ops written in prims (decomp/decompose_composite.cpp) at their edge values -------------------
COMPOSITE_EDGES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 3.0, -7.0, 1e-30,
                   2.0, -3.0, 7.25, -0.75]


def composite_ops(x, y):
    return (torch.logaddexp(x, y), torch.logaddexp2(x, y), torch.logaddexp(x, x), torch.logaddexp2(x, x),
            torch.sinc(x), torch.special.entr(x), torch.special.xlog1py(x, y), torch.angle(x), torch.pow(x.abs(), y),
            torch.ldexp(x, y.clamp(-4, 4).round()), torch.round(x, decimals=2), torch.round(x * 1000, decimals=-2),
            torch.div(x, y, rounding_mode="floor"), torch.div(x, y, rounding_mode="trunc"), torch.floor_divide(x, y),
            F.celu(x, 0.7), F.prelu(x.view(1, -1), y[:1]), torch.count_nonzero(x), torch.nansum(x), torch.aminmax(y),
            torch.linalg.vector_norm(y, 3), torch.linalg.vector_norm(x, float("inf")), torch.dist(x, y, 1),
            F.mse_loss(x, y, reduction="none"), F.huber_loss(x, y, delta=2.0),
            F.smooth_l1_loss(x, y, beta=0.5, reduction="sum"), F.soft_margin_loss(x, y),
            torch.full_like(x, -2.5), torch.zeros_like(x) + y, F.logsigmoid(x), x.max(), y.min(),
            F.binary_cross_entropy_with_logits(x, y.sigmoid()),
            F.binary_cross_entropy_with_logits(x, y.sigmoid(), reduction="none"), torch.lgamma(x), torch.digamma(x),
            torch.polygamma(0, y), torch.erfinv(torch.tanh(x)), torch.erfinv(x / 8), torch.nextafter(x, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_composite_ops_match_eager_at_edge_values(dtype):
    x = torch.tensor(COMPOSITE_EDGES, dtype=dtype)
    y = torch.tensor(COMPOSITE_EDGES[::-1], dtype=dtype)
    y[y == 0] = 4.0  # the finite-only ops below get one of each sign; zero divisors are checked apart
    compiled, summary, inputs = compile_kiln(composite_ops, x, y)
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    written_in_prims = ("logaddexp", "sinc", "entr", "xlog1py", "angle", "pow", "ldexp", "round", "div", "floor_divide",
                        "celu", "prelu", "count_nonzero", "nansum", "aminmax", "vector_norm", "dist", "loss", "full",
                        "sigmoid", "max", "min", "gamma", "erfinv", "nextafter")
    assert not [e for e in summary["externs"] if any(name in e for name in written_in_prims)], summary["externs"]
    actual = compiled(inputs)
    expected = [t for r in composite_ops(x, y) for t in (r if isinstance(r, tuple) else (r,))]
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        rtol, atol = tolerance(e.dtype, "general")
        assert a.dtype == e.dtype and a.shape == e.shape, i
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"result {i}: {m}")


def test_floor_division_by_zero_and_signed_zeros():
    def divisions(a, b):
        return torch.floor_divide(a, b), torch.div(a, b, rounding_mode="trunc"), torch.div(-a, b, rounding_mode="floor")

    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 5.0, -5.0, float("nan"), float("inf"), -0.0, 0.0, 1.0])
    y = torch.tensor([0.0, 0.0, 0.0, -0.0, -0.0, 3.0, 2.0, -2.0, 3.0, -3.0, -4.0])
    check(divisions, x, y, expect_kernels=1)
    kiln.reset()
    with torch.no_grad():
        actual, expected = kiln.compile(divisions)(x, y), divisions(x, y)
    kiln.reset()
    for a, e in zip(actual, expected):  # assert_close does not tell -0.0 from 0.0 (a NaN's sign means nothing)
        numbers = ~e.isnan()
        assert torch.equal(a.signbit()[numbers], e.signbit()[numbers]), (a, e)


def test_train_mode_batch_norm_under_no_grad_compiles_with_its_buffer_updates():
    # BatchNorm in training mode run under no_grad (an evaluation loop that forgot model.eval()) updates
    # running_mean / running_var inside the op and num_batches_tracked with an in-place add_: the graph is
    # compiled with that add_ made functional and its value written back, as eager leaves it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).train()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    kiln._C.reset_compiler_stats()
    for _ in range(3):
        x = random_tensor(2, 3, 10, 10)
        with torch.no_grad():
            out = compiled(x)
            expected = reference(x)
        assert_matches(out, expected, "general")
    stats = kiln._C.compiler_stats()
    assert stats["graphs_fallback"] == 0 and stats["graphs_compiled"] >= 1, stats
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, msg=name)
    assert int(model[1].num_batches_tracked) == 3


def test_an_input_viewing_an_updated_input_sees_the_update():
    # y is a view of x: eager's x.add_ shows through y. The compiled graph reads its inputs as separate
    # buffers, so such a call runs on the eager interpreter instead (checked on every call).
    def f(x, y):
        x.add_(1)
        return y * 2

    compiled = kiln.compile(f)
    for make_y in (lambda t: t[0], lambda t: t.clone()):  # aliasing, then not
        base = random_tensor(4, 4)
        mine, theirs = base.clone(), base.clone()
        torch.testing.assert_close(compiled(mine, make_y(mine)), f(theirs, make_y(theirs)))
        torch.testing.assert_close(mine, theirs)


# ---- derivative ops as generated code (decomp/decompose_backward.cpp) ----------------------------------------
def _edge_inputs(dtype):
    # random values plus the points where the formulas switch branch (0, the thresholds) and large magnitudes
    x = rand(6, 33, dtype=dtype) * 3
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 6.0, -6.0, 20.0, -20.0], dtype=dtype)
    return rand(6, 33, dtype=dtype), x


BACKWARD_OPS = [
    ("threshold_backward", lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.0)),
    ("threshold_backward_nonzero", lambda g, x: torch.ops.aten.threshold_backward(g, x, 1.0)),
    ("tanh_backward", lambda g, x: torch.ops.aten.tanh_backward(g, torch.tanh(x))),
    ("sigmoid_backward", lambda g, x: torch.ops.aten.sigmoid_backward(g, torch.sigmoid(x))),
    ("silu_backward", lambda g, x: torch.ops.aten.silu_backward(g, x)),
    ("hardtanh_backward", lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -1.0, 1.0)),
    ("leaky_relu_backward", lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.02, False)),
    ("gelu_backward", lambda g, x: torch.ops.aten.gelu_backward(g, x)),
    ("gelu_backward_tanh", lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    ("dropout_backward", lambda g, x: torch.ops.aten.native_dropout_backward(g, x > 0.5, 1.25)),
    ("softmax_backward", lambda g, x: torch.ops.aten._softmax_backward_data(g, torch.softmax(x, 1), 1, x.dtype)),
    ("softmax_backward_dim0", lambda g, x: torch.ops.aten._softmax_backward_data(g, torch.softmax(x, 0), 0, x.dtype)),
    ("log_softmax_backward", lambda g, x: torch.ops.aten._log_softmax_backward_data(g, torch.log_softmax(x, 1), 1, x.dtype)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,fn", BACKWARD_OPS, ids=[c[0] for c in BACKWARD_OPS])
def test_derivative_ops_are_generated_code_and_match_eager(name, fn, dtype):
    summary = check(fn, *_edge_inputs(dtype), kind="pointwise" if "softmax" not in name else "general")
    if name == "log_softmax_backward" and dtype == torch.bfloat16:  # ATen rounds exp(output) first: kept extern
        assert summary["externs"] == ["aten::_log_softmax_backward_data.default"], summary["externs"]
        return
    assert summary["externs"] == [], (name, summary["externs"])


def test_tanh_is_within_two_ulps_of_the_exact_value_with_eager_edge_cases():
    # kiln_tanh is vectorisable arithmetic (std::tanh is a libm call that keeps a loop scalar); it must stay within
    # float32's pointwise tolerance everywhere and keep NaN, +-inf and -0 as eager does.
    x = torch.cat([torch.linspace(-12, 12, 200001), torch.logspace(-40, 2, 20001), -torch.logspace(-40, 2, 20001),
                   torch.tensor([0.625, -0.625, 0.62499, 44.0, 45.0, 1e4, 1e-45])])
    compiled, summary, inputs = compile_kiln(lambda v: torch.tanh(v), x)
    assert summary["backend"] == "kiln" and not summary["externs"], summary
    (got,) = compiled(inputs)
    exact = torch.tanh(x.double())
    ulp = (torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double()).abs()
    assert ((got.double() - exact).abs() / ulp).max() <= 2.0
    edges = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    compiled, _, inputs = compile_kiln(lambda v: torch.tanh(v), edges)
    (got,) = compiled(inputs)
    torch.testing.assert_close(got, torch.tanh(edges), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(got[3:]), torch.tensor([True, False]))
