"""Pooling and padding as generated code: max_pool2d, avg_pool2d and constant_pad_nd decompose into guarded
(padded) loads and window reductions (csrc/decomp/decompose_window.cpp, csrc/fusion/window_reads.h).

Graphs are captured, compiled with `kiln._C.compile_graph(graph, "kiln", inputs)` and compared with eager
(values, dtypes, shapes, strides) on fresh random inputs; then the same function runs through kiln.compile on
new inputs. The autouse fixture in conftest.py also compiles every graph's CUDA C to PTX.
"""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing import assert_same_as_eager, capture_graphs, random_tensor
# kiln_cache_dir: test_compiler_cpu's autouse fixture, one temporary KILN_CACHE_DIR for this module too
from test_compiler_cpu import assert_matches, compile_kiln, kiln_cache_dir  # noqa: F401


def fresh_like(t):
    """Same shape, dtype and strides, new random values (never all zeros)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(values(t.shape, t.dtype))


def values(shape, dtype=torch.float32):
    if dtype == torch.bool:
        return torch.rand(tuple(shape)) > 0.5
    if not dtype.is_floating_point:  # a narrow range, so windows hold ties
        return torch.randint(0 if dtype == torch.uint8 else -20, 20, tuple(shape), dtype=dtype)
    return random_tensor(*shape, dtype=dtype)


def check(fn, *inputs, kind="general", generated=(), extern=()):
    """Compiles fn's graph, asserts that the ops named in `generated` are kernels and those in `extern` extern
    calls, compares with eager on the example inputs and through kiln.compile on fresh ones."""
    compiled, summary, example_inputs = compile_kiln(fn, *inputs)
    assert summary["backend"] == "kiln", summary["fallback_reason"]
    for op in generated:
        assert not any(op in e for e in summary["externs"]), summary
        assert any(op in k for k in summary["kernels"]), summary
    for op in extern:
        assert any(op in e for e in summary["externs"]), summary
    with torch.no_grad():
        assert_matches(compiled(example_inputs), fn(*inputs), kind)
        fresh = [fresh_like(t) for t in inputs]
        kiln.reset()
        assert_matches(kiln.compile(fn)(*fresh), fn(*fresh), kind)
    kiln.reset()
    return summary


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


# ---- max pooling -----------------------------------------------------------------------------------------
# (kernel, stride, padding, dilation, ceil_mode)
MAX_POOL_CASES = [
    (3, 2, 1, 1, False),
    (2, 2, 0, 1, False),
    (3, 1, 1, 1, False),
    ((3, 2), (2, 1), (1, 0), 1, False),
    (3, 2, 1, 2, False),
    ((2, 3), 2, (1, 1), (2, 1), False),
    (3, 2, 1, 1, True),
    (2, 3, 1, 1, True),
    (3, 3, 0, 1, True),
    (4, 3, 2, 1, True),
]


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "unbatched"])
@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", MAX_POOL_CASES)
def test_max_pool2d_matches_eager(kernel, stride, padding, dilation, ceil_mode, layout):
    x = values((2, 5, 11, 10)) if layout != "unbatched" else values((5, 11, 10))
    if layout == "channels_last":
        x = channels_last(x)
    check(lambda t: F.max_pool2d(t, kernel, stride, padding, dilation, ceil_mode), x, generated=["max_pool2d"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_max_pool2d_dtypes(dtype, layout):
    x = values((2, 6, 9, 9), dtype)
    if layout == "channels_last":
        x = channels_last(x)
    check(lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True), x, generated=["max_pool2d"])


def test_max_pool2d_of_the_lowest_int64_in_padded_windows():
    # The padding's fill is the dtype's lowest value, which the input holds too: the result must be it, not a
    # wrapped or rounded literal.
    x = torch.full((1, 2, 5, 5), torch.iinfo(torch.int64).min, dtype=torch.int64)
    x[0, 1, 2, 2] = 7
    check(lambda t: F.max_pool2d(t, 3, 2, 1), x, generated=["max_pool2d"])


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_max_pool2d_propagates_nan_and_keeps_minus_infinity(layout):
    x = values((2, 3, 8, 8))
    x[0, 0, 0, 0] = float("nan")  # in a padded corner window
    x[0, 1, 3, 4] = float("nan")
    x[1, 2] = float("-inf")  # whole windows of -inf
    x[1, 0, 2:5, 2:5] = float("-inf")
    if layout == "channels_last":
        x = channels_last(x)
    compiled, summary, example_inputs = compile_kiln(lambda t: F.max_pool2d(t, 3, 2, 1), x)
    assert not any("max_pool" in e for e in summary["externs"]), summary
    with torch.no_grad():
        actual, expected = compiled(example_inputs), F.max_pool2d(x, 3, 2, 1)
    actual = actual[0] if isinstance(actual, (list, tuple)) else actual
    assert torch.isnan(expected).any() and torch.isneginf(expected).any()
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)
    assert actual.stride() == expected.stride()


def test_pointwise_after_the_pool_joins_its_kernel():
    summary = check(lambda t: torch.relu(F.max_pool2d(t, 2)) * 3 - 1, values((2, 4, 8, 8)), generated=["max_pool2d"])
    assert len(summary["kernels"]) == 1, summary


# ---- a ResNet stem: BatchNorm (eval) + ReLU + max pool -----------------------------------------------------
def stem_parts(channels, device="cpu"):
    bn = torch.nn.BatchNorm2d(channels).to(device).eval().requires_grad_(False)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return bn


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_batch_norm_relu_max_pool_is_one_generated_kernel(layout):
    bn = stem_parts(16)

    def stem(x):
        return F.max_pool2d(F.relu(bn(x)), 3, 2, 1)

    x = values((2, 16, 14, 14))
    if layout == "channels_last":
        x = channels_last(x)
    with torch.no_grad():
        summary = check(stem, x, generated=["max_pool2d"])
    # The ReLU's result is recomputed per window element inside the pool's kernel, never written out.
    assert len(summary["kernels"]) == 1, summary
    assert not any("batch_norm" in e or "relu" in e for e in summary["externs"]), summary


def test_a_producer_that_is_also_returned_is_stored_once_and_the_pool_still_generated():
    bn = stem_parts(8)

    def f(x):
        y = F.relu(bn(x))
        return y, F.max_pool2d(y, 3, 2, 1)

    with torch.no_grad():
        summary = check(f, channels_last(values((2, 8, 10, 10))), generated=["max_pool2d"])
    assert len(summary["kernels"]) <= 2, summary


def test_resnet_stem_on_device(device):
    conv = torch.nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False).to(device).requires_grad_(False)
    bn = stem_parts(16, device)

    def stem(x):
        return F.max_pool2d(F.relu(bn(conv(x))), 3, 2, 1)

    x = random_tensor(2, 3, 32, 32, device=device)
    with torch.no_grad():
        compiled, summary, example_inputs = compile_kiln(stem, x)
        assert summary["backend"] == "kiln", summary["fallback_reason"]
        assert not any("max_pool" in e for e in summary["externs"]), summary
        if device == "cuda":
            assert "thread_per_row" in summary["strategies"], summary
        assert_matches(compiled(example_inputs), stem(x), "general")
        assert_same_as_eager(stem, random_tensor(2, 3, 32, 32, device=device))


# ---- training keeps ATen's pooling (the backward reads the indices) -------------------------------------------
def test_returned_indices_keep_the_extern_call():
    x = values((2, 3, 9, 9))
    summary = check(lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), x, extern=["max_pool2d_with_indices"])
    assert not any("max_pool" in k for k in summary["kernels"]), summary


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_training_gives_eager_gradients(compiled_autograd):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(8, 4, 1))
    kiln.reset()
    kiln.config.set_compiled_autograd(compiled_autograd)
    try:
        assert_same_as_eager(model, random_tensor(2, 3, 12, 12, requires_grad=True))
        assert_same_as_eager(lambda t: F.max_pool2d(t * 2, 3, 2, 1, ceil_mode=True).sum(-1),
                             random_tensor(2, 3, 10, 9, requires_grad=True))
    finally:
        kiln.config.set_compiled_autograd(False)
        kiln.reset()


# ---- average pooling ---------------------------------------------------------------------------------------
# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_POOL_CASES = [
    (3, 2, 1, False, True, None),
    (3, 2, 1, False, False, None),
    (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None),
    ((3, 2), (2, 1), (1, 1), True, True, None),
    (2, 2, 0, False, True, None),
    (3, 2, 1, False, True, 4),
    (4, 3, 2, True, False, 7),
]


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,count_include_pad,divisor", AVG_POOL_CASES)
def test_avg_pool2d_matches_eager(kernel, stride, padding, ceil_mode, count_include_pad, divisor, layout):
    x = values((2, 5, 11, 10))
    if layout == "channels_last":
        x = channels_last(x)
    check(lambda t: F.avg_pool2d(t, kernel, stride, padding, ceil_mode, count_include_pad, divisor), x,
          generated=["avg_pool2d"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_avg_pool2d_dtypes(dtype):
    check(lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False), values((2, 4, 9, 8), dtype),
          generated=["avg_pool2d"])


# ---- constant padding --------------------------------------------------------------------------------------
PAD_CASES = [
    ((1, 2), 0.0),
    ((1, 2, 0, 3), 0.5),
    ((2, 2, 2, 2, 1, 0), -1.5),
    ((-1, 2, 0, -2), 3.0),  # negative pads crop
    ((0, 0, 1, 1), float("-inf")),
]


@pytest.mark.parametrize("pad,value", PAD_CASES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_constant_pad_matches_eager(pad, value, layout):
    x = values((2, 3, 6, 7))
    if layout == "channels_last":
        x = channels_last(x)
    check(lambda t: F.pad(t, pad, value=value), x, kind="pointwise", generated=["constant_pad_nd"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool])
def test_constant_pad_dtypes(dtype):
    x = values((3, 5), dtype)
    check(lambda t: F.pad(t, (2, 1, 1, 0), value=1), x, generated=["constant_pad_nd"])


def test_pad_of_a_pointwise_producer_then_pool_is_one_kernel():
    def f(x):
        return F.max_pool2d(F.pad(torch.tanh(x) * 2, (1, 1, 2, 0), value=-0.25), 3, 2)

    summary = check(f, values((2, 3, 9, 9)), generated=["max_pool2d"])
    assert len(summary["kernels"]) == 1, summary


def test_pad_of_a_view_and_a_consumer():
    def f(x):
        return F.pad(x.transpose(2, 3)[:, :, 1:], (1, 1, 1, 1), value=2.0).exp() + 1

    summary = check(f, values((2, 3, 5, 6)), generated=["constant_pad_nd"])
    assert len(summary["kernels"]) == 1, summary


def test_max_pool2d_recorded_under_inference_mode_is_generated():
    x = values((2, 4, 9, 9))

    def f(t):
        return F.max_pool2d(t, 3, 2, 1, ceil_mode=True)

    with torch.inference_mode():
        graphs, _ = capture_graphs(f, x, fullgraph=True)
        graph, example_inputs = graphs[0]
        compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
        summary = kiln._C.compiled_graph_summary(compiled)
        assert summary["kernels"] == ["kernel_0_max_pool2d"], summary
        assert_matches(compiled(example_inputs), f(x), "general")


@pytest.mark.parametrize("pool", ["avg_include_pad", "avg_exclude_pad", "max_dilated"])
def test_windows_larger_than_their_input_loop_over_the_input(pool):
    """transformers' EfficientNet pools its last 2x2 map with `AvgPool2d(2560, ceil_mode=True)`: the generated loop ran
    over all 2560x2560 window positions per output (minutes on the CPU). The window dims are cut to the positions that
    can read inside the (padded) input, which changes no sum, count or maximum."""
    fns = {
        "avg_include_pad": lambda x: F.avg_pool2d(x, (2560, 9), ceil_mode=True) + F.avg_pool2d(x, 7, 3, 3, ceil_mode=True)[..., :1, :1],
        "avg_exclude_pad": lambda x: F.avg_pool2d(x, 9, 4, 4, ceil_mode=True, count_include_pad=False)[..., :1, :1],
        "max_dilated": lambda x: F.max_pool2d(x, 999, ceil_mode=True) + F.max_pool2d(x, (3, 2), 1, 1, (2, 1), ceil_mode=True)[..., :1, :1],
    }
    summary = check(fns[pool], values((2, 8, 3, 2)), generated=("pool2d",))
    assert summary["backend"] == "kiln"
