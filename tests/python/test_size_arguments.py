"""Kernels of dynamic graphs read their sizes at run time (CompileOptions::size_arguments, codegen/size_arguments.h).

A graph with symbolic sizes (runtime/dynamic_graph.h) compiles one concrete graph per binding of its size symbols. Its
kernels take their sizes, strides and offsets as run-time values, so a later binding generates the same C++ translation
unit (and the same CUDA programs) as the first and finds it in the kernel caches: each test compiles a graph with
symbolic dims, runs it at several sizes (primes, 2, 3, sizes not a multiple of 4 or 8, large), compares with eager on
fresh random inputs, and checks that only the first binding ran the C++ compiler (or read a library from disk). The
autouse PTX check (conftest.py) compiles the same schedules as CUDA C with size arguments through NVRTC; the tests also
read that source from the output_code log and check that every binding made the same one. CUDA graphs run on the GPU
machine, counted by the CUDA program cache.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import _C
from kiln.testing import random_tensor
from test_dynamic_runtime import assert_same
from test_symbolic_graph import capture

pytestmark = pytest.mark.usefixtures("fresh_kiln")

PTX_SOURCE = re.compile(r"PTX check of the same schedule as CUDA C:\n(.*?)(?=^\[kiln:)", re.S | re.M)


def cpp_compiles():
    """C++ compiler runs and libraries read from KILN_CACHE_DIR: both mean a source not seen in this process."""
    s = _C.compiler_stats()
    return s["kernels_compiled"] + s["cache_hits"]


def assert_reused(later, sizes, device):
    """CPU: the later bindings compile nothing (one translation unit for every size). CUDA: a later binding compiles
    a program only where the scheduler decides differently for its sizes (a vector width, a block shape), so fewer
    than one per binding. (The first binding may find its sources compiled by an earlier test of the process.)"""
    if device == "cpu":
        assert later == 0
    else:
        assert later < len(set(sizes)) - 1, (later, sizes)


def run_bindings(fn, make_inputs, sizes, dynamic, kind="general", device="cpu"):
    """Compiles fn with the dims in `dynamic` symbolic at sizes[0], runs it at every entry of `sizes` against eager.
    Returns (programs compiled by the first binding, by the later ones): C++ libraries on the CPU, CUDA programs."""
    counter = cpp_compiles if device == "cpu" else lambda: _C.cuda.program_cache_stats()["compiled"]
    before, specialisations = counter(), kiln.stats()["dynamic_specialisations"]
    inputs = make_inputs(*sizes[0])
    graph = capture(fn, inputs)
    graph.propagate_symbolic_sizes(dynamic, [])
    compiled = _C.compile_graph(graph, "kiln", inputs)
    first = counter() - before
    fallbacks = _C.compiler_stats()["graphs_fallback"]
    for size in sizes:
        inputs = make_inputs(*size)
        assert_same(compiled(inputs), fn(*inputs), kind)
        summary = _C.compiled_graph_summary(compiled)
        assert summary["backend"] == "kiln" and summary["kernels"], summary
    assert _C.compiler_stats()["graphs_fallback"] == fallbacks
    # every binding was lowered ...
    assert kiln.stats()["dynamic_specialisations"] - specialisations == len(set(sizes))
    return first, counter() - before - first  # ... but compiled nothing new


def cuda_sources(capfd, run):
    """The CUDA C of each graph the PTX check compiled while `run()` ran (output_code log)."""
    kiln.config.set_logs("output_code")
    try:
        capfd.readouterr()
        run()
        err = capfd.readouterr().err
    finally:
        kiln.config.set_logs("")
    return PTX_SOURCE.findall(err + "[kiln:")


def on(device):
    return lambda *shape, **kw: random_tensor(*shape, device=device, **kw)


POINTWISE_SIZES = [(5,), (2,), (3,), (7,), (13,), (31,), (1000,), (5,)]


def test_pointwise_with_broadcasting_compiles_once(device):
    t = on(device)
    fn = lambda x, y: torch.relu(x * y + 1.5) - torch.sigmoid(y)  # noqa: E731
    first, later = run_bindings(fn, lambda n: [t(n, 50), t(50)], POINTWISE_SIZES, {0: [0]}, "pointwise", device)
    assert_reused(later, POINTWISE_SIZES, device)


def test_two_dynamic_dims_and_a_broadcast_input_compile_once(device):
    t = on(device)
    fn = lambda x, y: (x + y).exp() * 0.5  # noqa: E731
    sizes = [(6, 10), (2, 3), (3, 17), (11, 9), (67, 130), (257, 129)]
    first, later = run_bindings(fn, lambda a, b: [t(a, b), t(1, b)], sizes, {0: [0, 1], 1: [1]}, "pointwise", device)
    assert_reused(later, sizes, device)


@pytest.mark.parametrize("dim", [-1, 0])
def test_sum_over_a_dynamic_or_static_dim_compiles_once(device, dim):
    t = on(device)
    fn = lambda x: x.sum(dim) * 2  # noqa: E731
    sizes = [(9,), (2,), (3,), (17,), (30,), (301,)]
    first, later = run_bindings(fn, lambda n: [t(n, 24)], sizes, {0: [0]}, device=device)
    assert_reused(later, sizes, device)
    first, later = run_bindings(fn, lambda n: [t(24, n)], sizes, {0: [1]}, device=device)
    assert later == 0


def test_softmax_over_a_dynamic_row_compiles_once(device):
    t = on(device)
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    sizes = [(4, 10), (2, 3), (5, 7), (3, 97), (33, 1001)]
    first, later = run_bindings(fn, lambda r, c: [t(r, c)], sizes, {0: [0, 1]}, device=device)
    assert_reused(later, sizes, device)


def test_layer_norm_with_a_dynamic_batch_compiles_once(device):
    t = on(device)
    fn = lambda x, w, b: F.layer_norm(x, (64,), w, b)  # noqa: E731
    sizes = [(4, 6), (2, 3), (3, 7), (13, 11), (40, 50)]
    first, later = run_bindings(fn, lambda b, s: [t(b, s, 64), t(64), t(64)], sizes, {0: [0, 1]}, device=device)
    assert_reused(later, sizes, device)


def test_mean_over_a_dynamic_dim_compiles_once(device):
    # mean's divisor is the reduced size: an integer constant of the loop IR, a size slot too. (Not 3 here: a binding
    # at 3 would share its constant with mean's divisor, and the graph's structure would differ.)
    t = on(device)
    fn = lambda x: x.mean(0) * 2.5 + x.sum(0)  # noqa: E731
    sizes = [(6,), (2,), (3,), (7,), (41,), (300,)]
    first, later = run_bindings(fn, lambda n: [t(n, 20)], sizes, {0: [0]}, device=device)
    assert_reused(later, sizes, device)


def test_views_fused_into_one_graph_compile_once(device):
    t = on(device)

    def fn(x, y):
        a = x.transpose(0, 1)[1:, :5] * 3  # a strided view with an offset
        return (a.exp() + y[:, :5]).sum(-1), x.reshape(-1) * 2

    sizes = [(8,), (6,), (7,), (13,), (100,)]
    first, later = run_bindings(fn, lambda n: [t(n, 12), t(11, 8)], sizes, {0: [0]}, device=device)
    assert_reused(later, sizes, device)


def test_padded_pooling_windows_compile_once(device):
    # guarded loads: the bounds' extents are size slots too
    t = on(device)
    fn = lambda x: F.max_pool2d(x, 3, 2, 1) * 2  # noqa: E731
    sizes = [(17, 16), (9, 10), (33, 20), (64, 64)]
    first, later = run_bindings(fn, lambda h, w: [t(2, 3, h, w)], sizes, {0: [2, 3]}, device=device)
    assert_reused(later, sizes, device)


def test_gathered_rows_compile_once(device):
    t = on(device)
    fn = lambda w, i: F.embedding(i, w) * 2  # noqa: E731
    sizes = [(5,), (2,), (3,), (17,), (300,)]

    def make(n):
        return [t(40, 16), torch.randint(0, 40, (n,), device=device)]

    first, later = run_bindings(fn, make, sizes, {1: [0]}, device=device)
    assert_reused(later, sizes, device)


def decisions(source):
    """What the CUDA schedulers decided for a program, as its source says it: strategies, block sizes, index widths."""
    return tuple(re.findall(r"// strategy: \S+|__launch_bounds__\(\d+\)|typedef (?:int|long long) index_t", source))


def test_every_binding_makes_the_same_cuda_source(capfd):
    """The PTX check's CUDA C (compiled by NVRTC: a failure fails the test through conftest.py) is the same source for
    every binding whose schedule decisions agree: only a strategy, block shape or index width makes another."""
    if not _C.cuda.nvrtc_available():
        pytest.skip("needs NVRTC")
    cases = [
        # warp_per_row up to 512 elements a row, block_per_row past it: two sources for six bindings
        (lambda x: torch.softmax(x, -1), lambda r, c: [random_tensor(r, c)],
         [(4, 10), (3, 7), (5, 97), (13, 300), (33, 1001), (7, 2001)], {0: [0, 1]}, True),
        (lambda x, y: (x.t() * y).relu(), lambda n: [random_tensor(n, 9), random_tensor(9, 1)], [(5,), (3,), (13,), (40,)],
         {0: [0]}, True),
        # the column kind's threads along the rows follow the row count: a block shape per binding here
        (lambda x: x.sum(0), lambda n: [random_tensor(n, 24)], [(9,), (2,), (17,), (301,)], {0: [0]}, False),
    ]
    for fn, make, sizes, dynamic, shared in cases:
        kiln.reset()
        sources = cuda_sources(capfd, lambda: run_bindings(fn, make, sizes, dynamic))
        assert len(sources) == len(sizes)
        assert "kiln_sizes<" in sources[0]
        by_decisions = {}
        for source in sources:
            by_decisions.setdefault(decisions(source), set()).add(source)
        for same in by_decisions.values():
            assert len(same) == 1, "\n\n".join(sorted(same))
        assert not shared or len(by_decisions) < len(set(sizes))


def test_static_graphs_keep_literal_sizes(capfd):
    """Without symbolic sizes nothing changes: literals, the one-parameter C++ signature, no size slots."""
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    kiln.config.set_logs("output_code")
    try:
        capfd.readouterr()
        x = random_tensor(6, 33)
        compiled = _C.compile_graph(capture(fn, [x]), "kiln", [x])
        assert_same(compiled([x]), fn(x), "general")
        err = capfd.readouterr().err
    finally:
        kiln.config.set_logs("")
    assert "(void* const* buffers) {" in err and "const int64_t* sizes" not in err and "kiln_sizes<" not in err


def test_max_autotune_variants_compile_with_nvrtc(capfd):
    """mode="max-autotune" emits every CUDA kernel's tuning variants beside it (codegen/cuda/tune_candidates.cpp), as
    functions `<kernel>_t<i>`: the PTX check compiles the whole tuned program through NVRTC (a failure fails the test
    through conftest.py), for a kernel of every kind, with literal sizes and with size arguments."""
    if not _C.cuda.nvrtc_available():
        pytest.skip("needs NVRTC")
    cases = [
        (lambda x: (x * 2 + 1).relu(), [random_tensor(1000, 64)], None),  # pointwise
        (lambda x: torch.softmax(x, -1), [random_tensor(33, 100)], None),  # warp_per_row
        (lambda x: F.layer_norm(x, (1024,)), [random_tensor(8, 1024)], None),  # block_per_row, cached rows
        (lambda x: x.sum(0), [random_tensor(300, 40)], None),  # column
        (lambda x: F.max_pool2d(x, 3, 2), [random_tensor(2, 4, 9, 9)], None),  # thread_per_row
        (lambda x: torch.softmax(x, -1), [random_tensor(13, 300)], {0: [0, 1]}),  # size arguments
    ]
    for fn, inputs, dynamic in cases:
        kiln.reset()

        def run():
            graph = capture(fn, inputs)
            if dynamic:
                graph.propagate_symbolic_sizes(dynamic, [])
            compiled = _C.compile_graph(graph, "kiln", inputs, mode="max-autotune")
            assert_same(compiled(inputs), fn(*inputs), "general")

        sources = cuda_sources(capfd, run)
        assert len(sources) == 1
        assert ("kiln_sizes<" in sources[0]) == bool(dynamic)
        kernels = re.findall(r"__launch_bounds__\(\d+\) (\w+)\(", sources[0])
        variants = [name for name in kernels if re.search(r"_t\d+$", name)]
        assert variants and len(set(kernels)) == len(kernels), kernels
        assert {re.sub(r"_t\d+$", "", name) for name in variants} <= set(kernels)
