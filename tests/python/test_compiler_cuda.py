"""The "kiln" backend on CUDA: the loop IR emitted as CUDA C, compiled by NVRTC, launched on torch's stream.

Graphs are captured with a user backend that keeps them, then compiled with
`kiln._C.compile_graph(graph, "kiln", inputs)`; `kiln._C.compiled_graph_summary(compiled)` says which
kernels (and per kernel which thread mapping) and extern calls it made. Every result is compared with eager
on fresh random inputs (tolerance table in kiln.testing). All tests need a GPU: they run on the GPU machine.
On machines without one, the conftest fixture `cuda_code_for_cpu_graphs` still compiles the CUDA C of every
CPU graph the suite makes to PTX.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing import assert_same_as_eager, capture_graphs, random_tensor, tolerance
from test_compiler_cpu import embedding_block, embedding_tables

pytestmark = pytest.mark.cuda
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def kiln_cache_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kiln_cuda_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(cache))
        yield str(cache)


def rand(*shape, dtype=torch.float32):
    if dtype == torch.bool:
        return torch.rand(shape, device="cuda") > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, dtype=dtype, device="cuda")
    return random_tensor(*shape, dtype=dtype, device="cuda")


def capture(fn, *inputs):
    """The graph kiln captures for fn(*inputs) (exactly one graph expected) and its example inputs."""
    graphs, _ = capture_graphs(fn, *inputs, fullgraph=True)
    assert len(graphs) == 1
    return graphs[0]


def assert_matches(actual, expected, kind):
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    actual = list(actual) if isinstance(actual, (tuple, list)) else [actual]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.device == e.device and a.dtype == e.dtype and a.shape == e.shape
        if e.numel() > 1:
            assert a.stride() == e.stride()
        rtol, atol = tolerance(e.dtype, kind)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)


def assert_as_close_as_eager(actual, expected, reference):
    """For 16-bit results of fused kernels: eager rounds to 16 bits after every op, kiln's fused kernel computes in
    float32 and rounds once (as Inductor does), so the two may differ by an ulp or two where a sum cancels. Checked
    instead: kiln's answer is no further from the float32 computation `reference` than eager's."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    kiln_error = (actual.float() - reference).abs().max().item()
    eager_error = (expected.float() - reference).abs().max().item()
    assert kiln_error <= eager_error * 1.25, (kiln_error, eager_error)


def check(fn, *inputs, kind="general", expect_kernels=None, expect_strategies=None, fresh=None):
    """Compiles fn's CUDA graph with the kiln backend, checks the summary and the outputs against eager, then
    runs fn through kiln.compile on fresh inputs of the same kind (`fresh(*shape, dtype=...)`, default rand)."""
    fresh_input = fresh or rand
    graph, example_inputs = capture(fn, *inputs)
    compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
    summary = kiln._C.compiled_graph_summary(compiled)
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    assert summary["device"].startswith("cuda")
    if expect_kernels is not None:
        assert len(summary["kernels"]) == expect_kernels, summary
    if expect_strategies is not None:
        assert summary["strategies"] == expect_strategies, summary
    with torch.no_grad():
        assert_matches(compiled(example_inputs), fn(*inputs), kind)
        new = [t.clone().copy_(fresh_input(*t.shape, dtype=t.dtype)) if t.is_contiguous() else t for t in inputs]
        kiln.reset()
        assert_matches(kiln.compile(fn)(*new), fn(*new), kind)
    kiln.reset()
    return summary


# ---- pointwise -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 33, 4096 + 3, 1 << 20])
def test_pointwise_chain_is_one_vectorised_kernel(n):
    summary = check(lambda x: torch.relu((x + 1) * 2), rand(n), kind="pointwise", expect_kernels=1)
    assert summary["externs"] == []
    if n > 1:  # a single element has no loop to vectorise
        assert summary["strategies"] == ["pointwise_vec4"]
        assert "kiln::vec<float, 4>" in summary["source"]
        # the grid covers the work: the grid-stride loops run about once per thread and are not unrolled (NVRTC time)
        assert summary["source"].count("#pragma unroll 1") == 3, summary["source"]  # vector loop, its tail, misaligned


def test_misaligned_view_takes_the_scalar_path():
    base = rand(4099)

    def f(x):
        return torch.sigmoid(x[1:] * 3) - 1

    check(f, base, kind="pointwise", expect_kernels=1)


def test_broadcast_and_transposed_operands():
    check(lambda x, b: torch.tanh(x + b), rand(64, 130), rand(130), kind="pointwise", expect_kernels=1)
    check(lambda x, y: x.t() * y, rand(40, 70), rand(70, 40), kind="pointwise", expect_kernels=1)
    check(lambda x, y: (x.unsqueeze(1) - y.unsqueeze(0)).abs(), rand(9, 5), rand(7, 5), kind="pointwise")


def test_bias_add_before_the_qkv_split_runs_in_the_copy():
    # nn.MultiheadAttention's general path on CUDA: bias add, views, one contiguous copy -> one kernel that
    # reads the product once and stores the copy (passes/sink_into_copies.h)
    from test_compiler_cpu import split_qkv
    E = 64
    summary = check(split_qkv, rand(4, 32, E), rand(3 * E, E), rand(3 * E))
    assert "kernel_0_add_clone" in summary["kernels"], summary["kernels"]
    assert not any(k.endswith("_add") for k in summary["kernels"]), summary["kernels"]


def test_a_causal_mask_and_a_position_table_are_folded_into_constants():
    # built on the device once, at compile time (passes/fold_constants.h): the kernel reads them
    def f(x):
        n = x.shape[-1]
        mask = torch.full((n, n), float("-inf"), device=x.device).triu(1)
        position = torch.arange(n, device=x.device).float() / n
        return torch.softmax(x + mask, -1) + position

    summary = check(f, rand(4, 8, 128, 128), expect_kernels=1)
    assert summary["externs"] == [] and len(summary["folded"]) == 2, summary


def test_empty_tensor():
    check(lambda x: x * 2 + 1, rand(0, 5), kind="pointwise")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_floating_dtypes_compute_like_eager(dtype):
    # (fused kernels keep float intermediates where eager rounds each op's output: a chain that cancels,
    # like `gelu(...) - x`, would differ by more than the table allows, for torch.compile too)
    check(lambda x, y: F.gelu(x * y + 1) * x, rand(513, dtype=dtype), rand(513, dtype=dtype), kind="pointwise",
          expect_kernels=1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_ops_and_comparisons(dtype):
    check(lambda a, b: (a * b + 3, a > b, torch.where(a > 0, a, b), torch.maximum(a, b)), rand(1000, dtype=dtype),
          rand(1000, dtype=dtype))


def test_bool_logic():
    check(lambda a, b: (a & b) | ~a, rand(777, dtype=torch.bool), rand(777, dtype=torch.bool))


def test_casts_between_dtypes():
    check(lambda x: (x.half() * 3).float() + x.to(torch.bfloat16).float(), rand(1031), kind="pointwise")


# ---- reductions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,strategy", [((8, 100), "warp_per_row_cached"), ((64, 1024), "block_per_row_cached"),
                                            ((3, 5000), "block_per_row_cached"), ((1000, 17), "warp_per_row")])
def test_softmax_is_one_kernel(shape, strategy):
    check(lambda x: torch.softmax(x, -1), rand(*shape), expect_kernels=1, expect_strategies=[strategy])


def test_log_softmax_over_a_middle_dim():
    check(lambda x: torch.log_softmax(x, 1), rand(4, 300, 6), expect_kernels=1)


@pytest.mark.parametrize("hidden", [96, 768, 1024, 4096])
def test_layer_norm_is_one_kernel(hidden):
    w, b = rand(hidden), rand(hidden)
    check(lambda x: F.layer_norm(x, (hidden,), w, b), rand(4, 5, hidden), expect_kernels=1)


@pytest.mark.parametrize("hidden,cached", [(100, True), (768, True), (4096, True), (5000, True), (16384, True),
                                           (65536, False)])
def test_layer_norm_rows_held_in_registers(hidden, cached):
    # Rows whose vector loads fit in registers are read once, before the passes (the `_cached` strategies);
    # 16384 columns take 1024 threads of four vectors each, 65536 would need 16 and do not fit. A misaligned
    # input takes the same kernel's scalar passes.
    w, b = rand(hidden), rand(hidden)
    fn = lambda x, r: F.layer_norm(x + r, (hidden,), w, b)  # noqa: E731
    summary = check(fn, rand(6, hidden), rand(6, hidden), expect_kernels=1)
    assert summary["strategies"][0].endswith("_cached") == cached, summary["strategies"]
    check(fn, rand(6 * hidden + 1)[1:].view(6, hidden), rand(6, hidden), expect_kernels=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_softmax_and_layer_norm(dtype):
    w, b = rand(256, dtype=dtype), rand(256, dtype=dtype)
    check(lambda x: torch.softmax(x, -1) + F.layer_norm(x, (256,), w, b), rand(32, 256, dtype=dtype))


def test_sums_means_and_extrema_over_any_dims():
    x = rand(33, 65, 7)
    check(lambda x: (x.sum(0), x.sum(-1), x.mean((0, 2)), x.amax(1), x.amin(-1, keepdim=True)), x)
    check(lambda x: x.sum(), rand(100_000))


def integral(*shape, dtype=torch.float32):
    """float32 values that are small integers: sums of them are exact in any order, so reductions of any
    length compare with eager's exactly, whatever the summation order."""
    return torch.randint(-9, 10, shape, device="cuda").to(dtype)


@pytest.mark.parametrize("shape", [(4096, 2048), (300, 70), (7, 33, 65), (2, 1000)])
def test_reductions_over_outer_dims_use_the_column_strategy(shape):
    # a bias gradient's shape: neighbouring outputs read neighbouring elements
    bias = integral(shape[-1])
    fn = lambda g: ((g * 2).sum(0), (g - bias).pow(2).sum(0), g.amax(0), g.mean(0))  # noqa: E731
    summary = check(fn, integral(*shape), fresh=integral)
    assert summary["strategies"] == ["column"], summary
    check(lambda g: g.sum((0, 1)), integral(*shape) if len(shape) == 3 else integral(3, *shape), fresh=integral)


@pytest.mark.parametrize("rows, columns", [(6304, 768), (6304, 3072), (1000, 8)])
def test_long_column_reductions_match_eager(rows, columns):
    """Bias and layer-norm weight gradients of a ViT's shape: each thread walks its column's rows in an unrolled
    loop. Sums of small integers are exact in any order; float sums and amax's NaNs are checked too."""
    fn = lambda g, x: (g.sum(0), (g * x).sum(0), g.amax(0), g.mean(0))  # noqa: E731
    summary = check(fn, integral(rows, columns), integral(rows, columns), fresh=integral)
    assert summary["strategies"] == ["column"], summary
    g, h = rand(rows, columns), rand(rows, columns)
    g[rows - 1, columns // 2] = float("nan")
    g[rows // 3, 0] = float("nan")
    graph, inputs = capture(lambda g, h: ((g * h).sum(0), g.amax(0)), g, h)
    compiled = kiln._C.compile_graph(graph, "kiln", inputs)
    for a, e in zip(compiled(inputs), ((g * h).sum(0), g.amax(0))):
        torch.testing.assert_close(a, e, equal_nan=True, rtol=1e-4, atol=1e-4 * rows ** 0.5)


@pytest.mark.parametrize("shape", [(32, 197, 768), (64, 40, 1024), (3, 37, 100), (2, 1000, 8)])
def test_bias_gradient_is_summed_by_the_kernel_that_computes_it(shape):
    """A Linear's bias gradient on a 3-d input, g.view(-1, C).sum(0): the kernel computing g stores it and sums
    each of its shape[0] blocks of rows in the same walk (the column strategy with stores; 64x40x1024 has enough
    outputs for four columns per thread, float4 accesses); a second kernel sums the partial rows. Integer-valued
    floats, so every summation order gives eager's result exactly."""
    fn = lambda x, y: (lambda g: (g, g.view(-1, g.shape[-1]).sum(0, keepdim=True)))(x * y + x)  # noqa: E731
    summary = check(fn, integral(*shape), integral(*shape), fresh=integral)
    assert summary["strategies"] == ["column", "column"], summary
    assert "mul" in summary["kernels"][0] and "sum" in summary["kernels"][0], summary["kernels"]
    x, y = rand(*shape), rand(*shape)
    graph, inputs = capture(fn, x, y)
    compiled = kiln._C.compile_graph(graph, "kiln", inputs)
    for a, e in zip(compiled(inputs), fn(x, y)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4 * (shape[0] * shape[1]) ** 0.5)


def test_column_nan_and_integer_reductions():
    x = rand(64, 96)
    x[5, 7] = float("nan")
    x[63, 95] = float("nan")
    graph, inputs = capture(lambda x: (x.amax(0), x.amin(0)), x)
    compiled = kiln._C.compile_graph(graph, "kiln", inputs)
    assert kiln._C.compiled_graph_summary(compiled)["strategies"] == ["column"]
    for a, e in zip(compiled(inputs), (x.amax(0), x.amin(0))):
        torch.testing.assert_close(a, e, equal_nan=True)
    check(lambda a: (a.sum(0), a.amax(0)), rand(300, 40, dtype=torch.int64), expect_strategies=["column"])


def test_amax_propagates_nan():
    x = rand(16, 300)
    x[3, 17] = float("nan")
    x[9, 0] = float("nan")
    graph, inputs = capture(lambda x: (x.amax(-1), x.amin(-1)), x)
    compiled = kiln._C.compile_graph(graph, "kiln", inputs)
    assert kiln._C.compiled_graph_summary(compiled)["backend"] == "kiln"
    for a, e in zip(compiled(inputs), (x.amax(-1), x.amin(-1))):
        torch.testing.assert_close(a, e, equal_nan=True)


def test_integer_sum():
    check(lambda a: (a.sum(-1), a.amax(0)), rand(40, 300, dtype=torch.int64))


# ---- externs, streams, the cache ---------------------------------------------------------------------------
def test_linear_bias_gelu_is_one_extern_and_at_most_one_kernel():
    w, b = rand(48, 32), rand(48)
    summary = check(lambda x: F.gelu(F.linear(x, w, b)), rand(16, 32))
    assert len(summary["kernels"]) <= 1
    assert len([op for op in summary["externs"] if "mm" in op]) == 1


def test_linear_bias_is_added_in_the_kernel_after_a_plain_matmul():
    # float32: addmm(b, x, w) runs as mm(x, w) with the bias add fused into the GELU kernel (passes/split_addmm)
    w, b = rand(48, 32), rand(48)
    summary = check(lambda x: F.gelu(F.linear(x, w, b)), rand(16, 32), expect_kernels=1)
    assert "aten::mm.default" in summary["externs"] and "aten::addmm.default" not in summary["externs"], summary
    # a 3-d input: the add runs after the view back to 3-d, in GELU's kernel
    w2, b2 = rand(1024, 256), rand(1024)
    summary = check(lambda x: F.gelu(F.linear(x, w2, b2)), rand(8, 512, 256), expect_kernels=1)
    assert "aten::addmm.default" not in summary["externs"], summary
    # large and read only by an extern: the bias stays in cuBLAS's epilogue
    summary = check(lambda x: F.linear(x, w2, b2).transpose(0, 1).contiguous().sum(), rand(8, 512, 256))
    assert "aten::addmm.default" in summary["externs"], summary
    # nothing to fuse with: the add is its own kernel, still eager's values and strides
    summary = check(lambda x: F.linear(x, w, b).t(), rand(16, 32), expect_kernels=1)
    assert "aten::addmm.default" not in summary["externs"], summary
    # half precision keeps cuBLAS's bias epilogue (one rounding, as eager)
    summary = check(lambda x: F.linear(x, w.half(), b.half()), rand(16, 32, dtype=torch.half), kind="general")
    assert "aten::addmm.default" in summary["externs"], summary


def test_kernels_reading_only_inputs_run_first_as_one_launch():
    # fusion/launch_groups: the transposing copy, the scaled vector and the permuted copy depend on nothing the
    # graph computes; they run as one grouped kernel before the matmul
    fn = lambda x, y, w: (x.t().contiguous(), y * 2 + 1, w.permute(0, 2, 3, 1).contiguous() - 1, (x @ x).relu())  # noqa: E731
    summary = check(fn, rand(64, 64), rand(1000), rand(8, 4, 3, 3))
    assert len(summary["kernels"]) == 4, summary
    assert "kernel_group_inputs(" in summary["source"], summary["source"][-2000:]


def test_many_distinct_kernels_compile_as_parallel_parts():
    # more than 4 distinct kernels: several NVRTC programs, compiled side by side, each kernel launched from
    # the part that defines it. Each output reads its own input of its own shape, so no two of them share a
    # kernel (reductions that read one input fuse horizontally).
    def fn(a, b, c, d, e, f):
        return (a.sum(0), torch.softmax(b, 1), c.amax(0), torch.log_softmax(d * 3, 1), (e + 1).mean(0),
                f.relu() - 1)

    summary = check(fn, rand(96, 160), rand(80, 70), rand(33, 65), rand(50, 300), rand(20, 40), rand(7, 9))
    assert len(summary["kernels"]) >= 5, summary
    assert "part 2 of" in summary["source"], summary["source"][:300]


def test_runs_on_a_side_stream_after_its_work():
    fn = kiln.compile(lambda x: torch.relu(x * 2 - 1).sum(-1))
    x = rand(256, 4096)
    expected = torch.relu(x * 2 - 1).sum(-1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 1.0  # queued on the side stream first: the kernel must run after it
        out = fn(y)
    torch.cuda.current_stream().wait_stream(side)
    rtol, atol = tolerance(torch.float32)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    kiln.reset()


@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_embeddings_are_read_inside_the_kernels_that_use_them(dtype, index_dtype):
    seq = 128
    tables = embedding_tables(3000, seq, 768, dtype, device="cuda")
    embed = embedding_block(*tables)
    # the same block in float32: the reference a 16-bit result is measured against
    in_float = embedding_block(*(t.float() if t.is_floating_point() else t for t in tables))

    def compare(actual, ids):
        expected = embed(ids)
        if dtype == torch.float32:
            return assert_matches(actual, expected, "general")
        # rounding the layer norm's input to 16 bits (eager's adds) moves an output by up to ~1.5 ulps
        assert_as_close_as_eager(actual, expected, in_float(ids))

    ids = torch.randint(0, 3000, (8, seq), dtype=index_dtype, device="cuda")
    graph, example_inputs = capture(embed, ids)
    compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
    summary = kiln._C.compiled_graph_summary(compiled)
    assert not any("embedding" in e or "gather" in e for e in summary["externs"]), summary["plan"]
    assert len(summary["kernels"]) == 3, summary["plan"]  # as test_compiler_cpu's: the first add joins the layer norm
    with torch.no_grad():
        (out,) = compiled(example_inputs)
        compare(out, ids)
        kiln.reset()
        fn = kiln.compile(embed)
        for _ in range(2):
            new = torch.randint(0, 3000, (8, seq), dtype=index_dtype, device="cuda")
            compare(fn(new), new)
    kiln.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cat_is_one_loop_with_its_producers_and_readers(dtype):
    # Llama's rotary embedding over a projection's strided view: negation, cat, multiply-adds in one kernel
    weight = rand(512, 256) / 16

    def rotary_with(weight):
        def rotary(x, cos, sin):
            q = (x @ weight.t()).view(4, 128, 8, 64).transpose(1, 2)
            rotated = torch.cat((-q[..., 32:], q[..., :32]), dim=-1)
            return q * cos + rotated * sin
        return rotary

    rotary, in_float = rotary_with(weight.to(dtype)), rotary_with(weight.to(dtype).float())
    angles = torch.rand(128, 64, device="cuda") * 6.3
    x, cos, sin = rand(4, 128, 256, dtype=dtype), angles.cos().to(dtype), angles.sin().to(dtype)
    graph, example_inputs = capture(rotary, x, cos, sin)
    summary = kiln._C.compiled_graph_summary(kiln._C.compile_graph(graph, "kiln", example_inputs))
    assert len(summary["kernels"]) == 1 and not any("cat" in e for e in summary["externs"]), summary["plan"]
    with torch.no_grad():
        for _ in range(2):
            actual, expected = kiln.compile(rotary)(x, cos, sin), rotary(x, cos, sin)
            if dtype == torch.float32:
                assert_matches(actual, expected, "general")
            else:
                assert_as_close_as_eager(actual, expected, in_float(x.float(), cos.float(), sin.float()))
            x = rand(4, 128, 256, dtype=dtype)
    kiln.reset()
    if dtype == torch.float32:
        assert_same_as_eager(rotary, x.clone().requires_grad_(), cos, sin.clone().requires_grad_())
        kiln.reset()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_and_gather_as_generated_code(dim):
    x = rand(6, 70, 33)
    size = x.shape[dim]
    index = torch.randint(0, size, (9,), device="cuda")
    where = torch.randint(0, size, tuple(4 if d == (dim % 3) else n for d, n in enumerate(x.shape)), device="cuda")

    def fn(x, index, where):
        return torch.index_select(x, dim, index) * 2 + 1, torch.gather(x, dim, where).relu()
    graph, example_inputs = capture(fn, x, index, where)
    compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
    summary = kiln._C.compiled_graph_summary(compiled)
    assert summary["externs"] == [], summary["plan"]
    with torch.no_grad():
        assert_matches(compiled(example_inputs), fn(x, index, where), "general")
    kiln.reset()


def test_an_index_out_of_range_fails_loudly_as_in_eager():
    # eager's device-side assert ends the CUDA context; kiln's kernel traps: so both are tried in child processes
    script = textwrap.dedent("""
        import sys, torch, kiln
        import torch.nn.functional as F
        word = torch.randn(50, 8, device="cuda")
        fn = (lambda f: f) if sys.argv[1] == "eager" else kiln.compile
        f = fn(lambda ids: F.embedding(ids, word) * 2)
        f(torch.tensor([[1, 2]], device="cuda"))
        torch.cuda.synchronize()
        try:
            f(torch.tensor([[1, 50]], device="cuda"))
            torch.cuda.synchronize()
            print("no error")
        except Exception as e:
            print("raised", type(e).__name__)
    """)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO_ROOT, "python"))
    for system in ("eager", "kiln"):
        done = subprocess.run([sys.executable, "-c", script, system], env=env, capture_output=True, text=True, timeout=300)
        assert "raised" in done.stdout, (system, done.stdout, done.stderr[-2000:])


def test_a_new_process_loads_kernels_from_the_disk_cache(kiln_cache_dir):
    script = textwrap.dedent("""
        import torch, kiln
        f = kiln.compile(lambda x: torch.softmax(x * 3, -1))
        x = torch.randn(64, 333, device="cuda")
        torch.testing.assert_close(f(x), torch.softmax(x * 3, -1))
        s = kiln._C.cuda.program_cache_stats()
        print(s["compiled"], s["disk_hits"], kiln._C.compiler_stats()["graph_cache_hits"])
    """)
    env = dict(os.environ, KILN_CACHE_DIR=kiln_cache_dir, PYTHONPATH=os.path.join(REPO_ROOT, "python"))
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = ([int(v) for v in r.stdout.split()] for r in runs)
    assert first[0] >= 1 and first[2] == 0
    assert second == [0, first[0], 1]  # the whole graph from its record, its images from disk: no NVRTC


def test_int64_indices_for_tensors_past_two_billion_elements():
    free, _ = torch.cuda.mem_get_info()
    n = (1 << 31) + 64
    if free < 3 * n:
        pytest.skip("needs about 6.5 GB of free GPU memory")
    x = torch.ones(n, dtype=torch.int8, device="cuda")
    graph, inputs = capture(lambda x: x * 2 + 1, x)
    compiled = kiln._C.compile_graph(graph, "kiln", inputs)
    summary = kiln._C.compiled_graph_summary(compiled)
    assert summary["backend"] == "kiln" and "typedef long long index_t" in summary["source"]
    out = compiled(inputs)[0]
    assert out.shape == x.shape and bool((out[-70:] == 3).all()) and bool((out[:70] == 3).all())
    del out, x
    torch.cuda.empty_cache()


def test_kernels_read_attention_output_in_its_real_layout():
    # SDPA is recorded whole; on CUDA its fused kernels return a different layout than the math path the
    # meta tensors took, so the kernel after it must not trust the recorded strides blindly.
    def f(q, k, v):
        b, h, s, d = q.shape
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h * d) * 2 + 1

    for dtype in (torch.float32, torch.float16):
        q, k, v = (rand(4, 8, 128, 64, dtype=dtype) for _ in range(3))
        check(f, q, k, v)


@pytest.mark.parametrize("length", [128, 100])
def test_a_boolean_attention_mask_becomes_one_bias_for_every_layer(length):
    # ATen converts a boolean mask to an additive bias at every call; kiln builds it once per graph (padded to the
    # memory-efficient kernels' alignment where the key length needs it) and every layer's attention reads it.
    def f(x, keep):
        mask = keep[:, None, None, :] & torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        b, s, _ = x.shape
        for _ in range(3):
            q = k = v = x.view(b, s, 4, 16).transpose(1, 2)
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 64) + x
        return x

    keep = torch.ones(4, length, dtype=torch.bool, device="cuda")
    keep[1, length // 2:] = False
    summary = check(f, rand(4, length, 64), keep, fresh=lambda *shape, dtype: rand(*shape, dtype=dtype)
                    if dtype != torch.bool else keep)
    assert summary["externs"].count("aten::scaled_dot_product_attention.default") == 3, summary["externs"]
    # one kernel builds the bias (named after its last op: the pad where the key length needs one)
    assert sum("masked_fill" in name or "constant_pad_nd" in name for name in summary["kernels"]) == 1, summary["kernels"]


def test_identical_kernels_are_compiled_once():
    # each block of a layer stack makes the same kernels: the program holds one copy of each
    # (a linear layer between the blocks keeps their kernels apart: one extern call each)
    norms = [torch.nn.LayerNorm(256).cuda().requires_grad_(False) for _ in range(4)]
    linears = [torch.nn.Linear(256, 256).cuda().requires_grad_(False) for _ in range(4)]

    def f(x):
        for norm, linear in zip(norms, linears):
            x = linear(F.gelu(norm(x)) * 2)
        return x

    summary = check(f, rand(8, 256))
    assert len(summary["kernels"]) >= 4
    assert summary["source"].count("__global__") < len(summary["kernels"])
    assert summary["source"].count("(the same code)") == len(summary["kernels"]) - summary["source"].count("__global__")


@pytest.fixture
def no_tf32():
    # cuDNN picks different algorithms for NCHW and NHWC; without TF32 both are float32-exact enough to compare
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = previous


def test_convolution_chains_run_channels_last_with_eager_strides_outside(no_tf32):
    conv1 = torch.nn.Conv2d(32, 64, 3, padding=1).cuda().requires_grad_(False)
    conv2 = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().requires_grad_(False)
    bn = torch.nn.BatchNorm2d(64).cuda().eval().requires_grad_(False)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)

    def f(x):
        y = F.relu(bn(conv1(x)))
        z = F.relu(conv2(y) + y)
        return F.max_pool2d(z, 2), z.mean((2, 3)), z.view(z.shape[0], -1)

    summary = check(f, rand(4, 32, 16, 16))
    assert any("clone" in k for k in summary["kernels"] + summary["externs"]), summary


def test_rgb_stem_convolution_keeps_its_layout(no_tf32):
    conv = torch.nn.Conv2d(3, 16, 3).cuda().requires_grad_(False)
    summary = check(lambda x: F.relu(conv(x)), rand(2, 3, 32, 32))
    assert not any("clone" in k for k in summary["kernels"] + summary["externs"]), summary


def test_rgb_stem_in_front_of_a_wider_chain_runs_channels_last(no_tf32):
    stem = torch.nn.Conv2d(3, 32, 7, stride=2, padding=3, bias=False).cuda().requires_grad_(False)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1).cuda().requires_grad_(False)
    bn = torch.nn.BatchNorm2d(32).cuda().eval().requires_grad_(False)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)

    def f(x):
        y = F.max_pool2d(F.relu(bn(stem(x))), 3, 2, 1)
        return F.relu(conv(y) + y)

    summary = check(f, rand(2, 3, 64, 64))
    assert any("clone" in k for k in summary["kernels"] + summary["externs"]), summary


def test_resnet_style_block_is_channels_last_with_fused_batch_norm(no_tf32):
    conv1 = torch.nn.Conv2d(32, 32, 3, padding=1, bias=False).cuda()
    conv2 = torch.nn.Conv2d(32, 32, 3, padding=1, bias=False).cuda()
    bn1, bn2 = torch.nn.BatchNorm2d(32).cuda().eval(), torch.nn.BatchNorm2d(32).cuda().eval()
    for bn in (bn1, bn2):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    relu = torch.nn.ReLU(inplace=True)

    def block(x):
        y = relu(bn1(conv1(x)))
        return relu(bn2(conv2(y)) + x)

    with torch.no_grad():
        summary = check(block, rand(4, 32, 16, 16))
    assert not any("batch_norm" in e for e in summary["externs"]), summary
    assert any("clone" in k for k in summary["kernels"] + summary["externs"]), summary
