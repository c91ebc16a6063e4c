"""Graph capture with kiln._fake.Recorder and replay through the backend table (kiln._C.run_graph).

Each test records torch calls on fakes of one set of random inputs, then replays the graph on a fresh
set and compares with eager on that same fresh set: outputs, mutated inputs and gradients.
"""
import json
import operator

import pytest
import torch
import torch.nn.functional as F

from kiln import _C, errors
from kiln._fake import Recorder


def capture(fn, inputs, kwargs=None):
    """Records fn(*fakes, **kwargs) and returns (graph, recorder); outputs are the tensors fn returns."""
    rec = Recorder()
    fakes = [rec.add_input(t) for t in inputs]
    out = rec.call(fn, tuple(fakes), kwargs or {})
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return rec.finish(outs), rec


def replay(graph, inputs, backend="eager"):
    return _C.run_graph(graph, backend, list(inputs))


def check(fn, make_inputs, kwargs=None, backend="eager", rtol=None, atol=None):
    """Capture on one draw of inputs, replay on another, compare with eager on the second."""
    graph, _ = capture(fn, make_inputs(), kwargs)
    fresh = make_inputs()
    eager_inputs = [t.clone() for t in fresh]
    expected = fn(*eager_inputs, **(kwargs or {}))
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    got = replay(graph, fresh, backend)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.device == e.device
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)
    for g, e in zip(fresh, eager_inputs):  # inputs mutated exactly like eager
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    return graph


def randn(*shape, **kw):
    return lambda: [torch.randn(*s, **kw) for s in shape]


# ---- pointwise, linear algebra, nn functions --------------------------------------------------------
def test_pointwise_chain_op_by_op_like_the_tracer():
    rec = Recorder()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    fx, fy = rec.add_input(x), rec.add_input(y)
    assert rec.add_input(x) is fx  # the same tensor twice -> the same fake
    a = rec.call(operator.add, (fx, 1.0), {})
    b = rec.call(operator.mul, (a, fy), {})
    c = rec.call(torch.relu, (b,), {})
    d = rec.call(torch.Tensor.sigmoid, (c,), {})
    e = rec.call(operator.sub, (d, rec.call(torch.exp, (fx,), {})), {})
    assert rec.is_fake(e) and not rec.is_fake(x)
    graph = rec.finish([e])
    assert graph.ops() == ["aten::add.Tensor", "aten::mul.Tensor", "aten::relu.default",
                           "aten::sigmoid.default", "aten::exp.default", "aten::sub.Tensor"]
    assert graph.inputs == 2 and graph.outputs == 1 and graph.num_nodes == 6
    x2, y2 = torch.randn(8, 16), torch.randn(8, 16)
    (got,) = replay(graph, [x2, y2])
    torch.testing.assert_close(got, torch.sigmoid(torch.relu((x2 + 1.0) * y2)) - torch.exp(x2))


def test_linear_with_bias_records_addmm():
    graph = check(F.linear, randn((32, 10), (50, 10), (50,)))
    assert "aten::addmm.default" in graph.ops()
    text = str(graph)
    assert "aten::addmm.default(" in text and "f32[32, 50]" in text and "beta=1" in text


def test_conv2d():
    check(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), randn((2, 3, 16, 16), (8, 3, 3, 3), (8,)))


def test_batch_norm_eval():
    def bn(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, training=False, eps=1e-5)

    def inputs():
        return [torch.randn(4, 6, 5, 5), torch.randn(6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(6)]

    check(bn, inputs)


def test_layer_norm_and_softmax():
    check(lambda x, w, b: F.layer_norm(x, (32,), w, b).softmax(-1), randn((4, 7, 32), (32,), (32,)))
    check(lambda x: F.log_softmax(x, dim=1) + torch.softmax(x, 0), randn((6, 9)))


def test_matmul_and_bmm():
    check(torch.matmul, randn((3, 4, 5), (5, 6)))
    check(torch.bmm, randn((3, 4, 5), (3, 5, 2)))
    check(operator.matmul, randn((7, 5), (5,)))


def test_views_and_getitem():
    def views(x):
        a = x.view(4, 6, 5).transpose(0, 1)
        b = a.reshape(6, 20).permute(1, 0)
        c = operator.getitem(x, (slice(1, None), 2, slice(None, None, 2)))
        d = x[None, ..., -1]
        return b.contiguous(), c, d, x.t() if x.dim() == 2 else x.flatten()

    graph = check(views, randn((4, 6, 5)))
    assert "aten::view.default" in graph.ops() and "aten::slice.Tensor" in graph.ops()


def test_cat_split_chunk_return_lists():
    def pieces(x, y):
        parts = torch.split(torch.cat([x, y], dim=0), 3, dim=0)
        a, b = torch.chunk(parts[0], 2, dim=1)
        return parts[0], parts[-1], a * 2, b.unbind(0)[1]

    graph = check(pieces, randn((5, 4), (4, 4)))
    assert {"aten::cat.default", "aten::split.Tensor"} <= set(graph.ops())
    assert "# list" in str(graph)


# ---- mutation -------------------------------------------------------------------------------------
def test_inplace_on_intermediates():
    def f(x):
        y = x * 2
        y.add_(1)
        y.relu_()
        torch.mul(y, 3, out=y)
        return y

    graph = check(f, randn((5, 5)))
    # out= is recorded as the functional op and a copy into `out`, which functionalization makes a fresh value
    assert "aten::add_.Tensor" in graph.ops() and "aten::mul.out" not in graph.ops()
    assert graph.ops()[-2:] == ["aten::mul.Tensor", "aten::copy_.default"]


def test_inplace_on_inputs_mutates_like_eager():
    def f(x, y):
        x.add_(y)
        x.mul_(2)
        return x + 1

    check(f, randn((3, 4), (3, 4)))


# ---- factories, constants, casts --------------------------------------------------------------------
def test_factory_ops_record_their_device():
    def f(x):
        zeros = torch.zeros_like(x)
        ramp = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        ones = torch.ones(x.shape[1])
        return zeros + ramp + ones * x, torch.full((2, 2), 3.0)

    graph = check(f, randn((3, 5)))
    assert "aten::arange.start_step" in graph.ops() or "aten::arange.default" in graph.ops()
    parsed = json.loads(graph.to_json())
    devices = [arg["value"] for node in parsed["nodes"] for arg in node["args"] if arg["kind"] == "device"]
    assert devices and all(d["type"] == "cpu" for d in devices)  # the real device, not meta


def test_torch_tensor_constant_is_held_by_reference():
    def f(x):
        return x * torch.tensor([1.0, 2.0, 3.0])

    graph = check(f, randn((4, 3)))
    assert "= constant" in str(graph)

    weight = torch.randn(3)  # a real tensor the tracer did not register
    graph, _ = capture(lambda x: x * weight, [torch.randn(2, 3)])
    x = torch.randn(2, 3)
    weight.mul_(10)  # held by reference: the replay sees the new values
    torch.testing.assert_close(replay(graph, [x])[0], x * weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_dtype_casts(dtype):
    def f(x):
        y = x.to(dtype)
        return y, (y.float() * 2 if dtype != torch.bool else y.logical_not())

    graph = check(f, randn((4, 4)))
    assert "aten::_to_copy.default" in graph.ops()


# ---- modules and autograd ---------------------------------------------------------------------------
def test_multi_head_attention_module_under_swapped_state():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    names = [n for n, _ in mha.named_parameters()]
    params = [p for _, p in mha.named_parameters()]
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)

    rec = Recorder()
    fq, fk, fv = (rec.add_input(t) for t in (q, k, v))
    fakes = {n: rec.add_input(p) for n, p in zip(names, params)}
    assert all(f.requires_grad and f.device.type == "meta" for f in fakes.values())
    with rec.swapped_state(mha, fakes):
        assert mha.in_proj_weight is fakes["in_proj_weight"]
        out, weights = rec.call(mha, (fq, fk, fv), {"need_weights": True})
    assert mha.in_proj_weight is params[0]  # restored
    graph = rec.finish([out, weights])
    q2, k2, v2 = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    got = replay(graph, [q2, k2, v2] + params)
    expected = mha(q2, k2, v2, need_weights=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_swapped_state_restores_on_error():
    lin = torch.nn.Linear(3, 3)
    rec = Recorder()
    fake_weight = rec.add_input(lin.weight)
    with pytest.raises(ValueError):
        with rec.swapped_state(lin, {"weight": fake_weight}):
            raise ValueError("boom")
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.device.type == "cpu"


def test_gradients_match_eager():
    def f(x, w, b):
        return torch.tanh(F.linear(x, w, b)).pow(2).sum(dim=1)

    def inputs():
        return [torch.randn(6, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True),
                torch.randn(3, requires_grad=True)]

    graph, _ = capture(f, inputs())
    fresh = inputs()
    eager = [t.detach().clone().requires_grad_(True) for t in fresh]
    (got,) = replay(graph, fresh)
    expected = f(*eager)
    assert got.requires_grad and got.grad_fn is not None
    torch.testing.assert_close(got, expected)
    seed = torch.randn_like(expected)
    got.backward(seed)
    expected.backward(seed)
    for g, e in zip(fresh, eager):
        torch.testing.assert_close(g.grad, e.grad)
    assert "grad" in str(graph)  # requires_grad shows in the printed meta


# ---- what cannot be captured ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    lambda t: t.sum().item(),
    lambda t: torch.nonzero(t),
    lambda t: bool(t.sum() > 0),
    lambda t: t.tolist(),
    lambda t: t.numpy(),
    lambda t: t[t > 0],
], ids=["item", "nonzero", "bool", "tolist", "numpy", "bool_mask"])
def test_unsupported_raise_and_leave_the_recorder_usable(bad):
    rec = Recorder()
    x = torch.randn(3, 4)
    fx = rec.add_input(x)
    y = rec.call(torch.relu, (fx,), {})
    with pytest.raises(errors.Unsupported):
        rec.call(bad, (y,), {})
    assert rec.num_nodes == 1  # the failed call left no nodes
    z = rec.call(operator.add, (y, 1), {})
    graph = rec.finish([z])
    assert graph.ops() == ["aten::relu.default", "aten::add.Tensor"]
    x2 = torch.randn(3, 4)
    torch.testing.assert_close(replay(graph, [x2])[0], torch.relu(x2) + 1)


def test_unsupported_method_message_names_the_method():
    rec = Recorder()
    fx = rec.add_input(torch.randn(2))
    with pytest.raises(errors.Unsupported, match="numpy"):
        rec.call(fx.numpy, (), {})
    with pytest.raises(errors.Unsupported, match="_local_scalar_dense"):
        rec.call(lambda t: t.sum().item(), (fx,), {})


# ---- backends and the Graph object ------------------------------------------------------------------
def test_user_backend_receives_graph_and_example_inputs():
    seen = {}

    def my_backend(graph, example_inputs):
        seen["graph"], seen["examples"] = graph, example_inputs
        return lambda inputs: [inputs[0] * 10]

    graph, _ = capture(torch.sin, [torch.randn(3)])
    x = torch.randn(3)
    (got,) = _C.run_graph(graph, my_backend, [x])
    assert isinstance(seen["graph"], _C.Graph) and seen["graph"].ops() == ["aten::sin.default"]
    assert len(seen["examples"]) == 1 and seen["examples"][0] is x
    torch.testing.assert_close(got, x * 10)


def test_builtin_backend_names_and_unknown_backend():
    assert {"eager", "aot_eager", "kiln"} <= set(_C.backend_names())
    graph, _ = capture(torch.cos, [torch.randn(3)])
    x = torch.randn(3)
    for name in ("aot_eager", "kiln"):
        torch.testing.assert_close(replay(graph, [x], name)[0], torch.cos(x))
    with pytest.raises(errors.KilnError, match="unknown backend 'nope'.*aot_eager, eager, kiln"):
        replay(graph, [x], "nope")
    compiled = _C.compile_graph(graph, "eager")
    torch.testing.assert_close(compiled([x])[0], torch.cos(x))
    with pytest.raises(errors.KilnError, match="expects 1 input"):
        compiled([x, x])


def test_outputs_may_be_inputs_or_constants():
    const = torch.randn(2)
    rec = Recorder()
    fx = rec.add_input(torch.randn(2))
    graph = rec.finish([fx, const])
    x = torch.randn(2)
    got = replay(graph, [x])
    assert got[0] is x or got[0].data_ptr() == x.data_ptr()
    torch.testing.assert_close(got[1], const)


def test_graph_printing_and_json():
    graph, _ = capture(lambda x, w: torch.relu(x @ w).view(-1), [torch.randn(4, 3), torch.randn(3, 5)])
    text = str(graph)
    assert text.startswith("graph(%0 : f32[4, 3], %1 : f32[3, 5]):")
    assert "aten::mm.default(%0, %1)" in text and "aten::relu.default" in text and "f32[20]" in text
    assert "return (%" in text
    parsed = json.loads(graph.to_json())
    assert [n["op"] for n in parsed["nodes"]] == ["aten::mm", "aten::relu", "aten::view"]
    assert parsed["values"][0]["meta"]["sizes"] == [4, 3]
    assert parsed["values"][0]["meta"]["dtype"] == "f32"
    graph.verify()


def test_genuine_errors_propagate_and_leave_no_nodes():
    rec = Recorder()
    fx = rec.add_input(torch.randn(3))
    with pytest.raises(RuntimeError) as info:
        rec.call(lambda a: torch.relu(a) + torch.randn(4), (fx,), {})
    assert not isinstance(info.value, errors.KilnError)  # a shape mismatch is the user's error, as in eager
    assert rec.num_nodes == 0
    with pytest.raises(errors.Unsupported, match="Generator"):
        rec.call(torch.randn, (3,), {"generator": torch.Generator()})
    with pytest.raises(errors.Unsupported, match="torch.tensor"):
        rec.call(lambda a: torch.tensor([1.0, 2.0, 3.0]).add_(a), (fx,), {})
    assert rec.num_nodes == 0


def test_module_buffers_and_logical_device():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    state = dict(bn.named_parameters())
    state.update({n: b for n, b in bn.named_buffers() if n != "num_batches_tracked"})
    x = torch.randn(2, 4, 3, 3)
    rec = Recorder()
    fx = rec.add_input(x)
    fakes = {n: rec.add_input(t) for n, t in state.items()}
    assert rec.device_of(fx) == torch.device("cpu") and rec.logical_device == torch.device("cpu")
    with rec.swapped_state(bn, fakes):
        out = rec.call(bn, (fx,), {})
    assert bn.running_mean.device.type == "cpu"
    graph = rec.finish([out])
    x2 = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(replay(graph, [x2] + list(state.values()))[0], bn(x2))


def test_dead_nodes_are_kept():
    graph, _ = capture(lambda x: (torch.sin(x), x.cos())[1], [torch.randn(3)])
    assert graph.ops() == ["aten::sin.default", "aten::cos.default"]


def test_argument_kinds():
    def f(x, idx, w):
        a = x[idx]                                              # Tensor?[] (aten::index.Tensor)
        b = x[torch.tensor([0, 2])]                             # a torch.tensor constant as an index
        c = F.gelu(x, approximate="tanh")                       # str
        d = torch.sum(x, dim=None, dtype=torch.float64)         # int[]? None, ScalarType
        e = w.contiguous(memory_format=torch.channels_last)     # MemoryFormat
        g = torch.empty_like(x, layout=torch.strided).fill_(2)  # Layout, Scalar
        h = torch.clamp(x, min=-0.5)                            # Scalar? with None
        i = torch.nn.functional.interpolate(w, scale_factor=2.0, mode="nearest")  # float[]?
        torch._foreach_add_([g, h], 1.5)                        # Tensor[] mutated, returns nothing
        return a, b, c, d, e.relu(), g, h, i

    def inputs():
        return [torch.randn(4, 5), torch.tensor([3, 1, 1]), torch.randn(2, 3, 4, 4)]

    graph = check(f, inputs)
    ops = set(graph.ops())
    assert {"aten::index.Tensor", "aten::gelu.default", "aten::_foreach_add_.Scalar"} <= ops
    text = str(graph)
    assert "approximate='tanh'" in text and "memory_format=channels_last" in text and "f64" in text


# ---- composite ops recorded whole ---------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("variant", ["plain", "causal", "mask", "scale"])
def test_scaled_dot_product_attention_is_one_node(device, variant):
    # On meta tensors ATen can only take SDPA's math path; recorded whole, the run picks the fused kernels
    # (flash / memory-efficient on CUDA, the CPU flash kernel) as eager does.
    kwargs = {"causal": {"is_causal": True}, "scale": {"scale": 0.3},
              "mask": {"attn_mask": torch.randn(16, 16, device=device)}}.get(variant, {})
    graph = check(F.scaled_dot_product_attention, randn((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), device=device),
                  kwargs, rtol=1e-4, atol=1e-4)
    assert graph.ops() == ["aten::scaled_dot_product_attention.default"]


def test_traced_attention_records_one_sdpa_node():
    import kiln
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return lambda xs: _C.run_graph(graph, "eager", xs)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q * 2, k, v, is_causal=True).transpose(1, 2)

    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    kiln.reset()
    torch.testing.assert_close(kiln.compile(attention, backend=keep, fullgraph=True)(q, k, v), attention(q, k, v))
    kiln.reset()
    assert graphs[0].ops() == ["aten::mul.Tensor", "aten::scaled_dot_product_attention.default", "aten::transpose.int"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_attention_output_recorded_in_the_fused_kernels_layout(device):
    # ViT's attention: heads packed in one projection, the output transposed back and flattened. The fused
    # kernels return (batch, length, heads, head_dim) memory; recorded so, the flatten is a view, not a copy.
    # Outputs and gradients as eager's through kiln.compile (the run checks the recorded layout).
    import kiln

    def attention(x, w):
        b, n, c = x.shape
        q, k, v = (x @ w).reshape(b, n, 3, 4, c // 4).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c) * 2

    x = torch.randn(2, 16, 64, device=device, requires_grad=True)
    w = torch.randn(64, 192, device=device) / 8
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return lambda xs: _C.run_graph(graph, "eager", xs)

    kiln.reset()
    with torch.no_grad():
        kiln.compile(attention, backend=keep, fullgraph=True)(x, w)
    ops = graphs[0].ops()
    assert ops[ops.index("aten::scaled_dot_product_attention.default") + 1:] == [
        "aten::transpose.int", "aten::view.default", "aten::mul.Tensor"], ops
    kiln.reset()
    compiled = kiln.compile(attention)
    out = compiled(x, w)
    (grad,) = torch.autograd.grad(out.square().sum(), [x])
    expected = attention(x, w)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), [x])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), attention(x, w), rtol=1e-4, atol=1e-4)
    kiln.reset()


def test_scaled_dot_product_attention_gradients_flow_through_the_node():
    q, k, v = (torch.randn(2, 3, 10, 8, requires_grad=True) for _ in range(3))
    graph, _ = capture(F.scaled_dot_product_attention, [q, k, v], {"is_causal": True})
    out = replay(graph, [q, k, v])[0]
    grads = torch.autograd.grad(out.square().sum(), [q, k, v])
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected_grads = torch.autograd.grad(expected.square().sum(), [q, k, v])
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
