"""kiln as a torch.compile backend (torch.compile(model, backend="kiln"): Dynamo captures, kiln records the FX graph
on its fakes and compiles it), and torch.compiler's switches (disable, allow_in_graph) under kiln.compile."""
import importlib
import importlib.metadata
import os
import tomllib
import warnings

import pytest
import torch
import torch.nn as nn
import torch._dynamo

import kiln
from kiln import dynamo_backend
from kiln.testing import assert_same_as_eager, random_tensor, tolerance
from seed_models import MLP  # benchmarks/ (tests/python/conftest.py)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo with no compiled code, the backend's and kiln's counters zeroed; "kiln" known to Dynamo through the
    installed entry point or, in a source tree, through register()."""
    dynamo_backend.register()
    torch._dynamo.reset()
    dynamo_backend.reset_stats()
    kiln._C.reset_compiler_stats()
    kiln.reset()
    yield
    torch._dynamo.reset()


def backend_compile(model, **kwargs):
    return torch.compile(model, backend="kiln", **kwargs)


def assert_ran_through_kiln(graphs=1, interpreter_reason=None):
    """Every graph Dynamo handed over was recorded by kiln and compiled by kiln's pipeline, none ran as Dynamo
    captured it. `interpreter_reason`: the pipeline ran them on kiln's eager interpreter, for this reason."""
    stats = dynamo_backend.stats()
    assert stats["graphs_compiled"] == graphs and stats["graphs_eager"] == 0, stats
    assert stats["calls_compiled"] >= 1 and stats["calls_eager"] == 0, stats
    pipeline = kiln._C.compiler_stats()
    if interpreter_reason is None:
        assert pipeline["graphs_compiled"] >= graphs and pipeline["graphs_fallback"] == 0, pipeline
    else:
        assert pipeline["graphs_fallback"] == graphs, pipeline
        assert interpreter_reason in pipeline["last_fallback_reason"], pipeline


def conv_bn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))


# ---- registration ----------------------------------------------------------------------------------------------
def test_entry_point_names_the_backend_function():
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        entry_points = tomllib.load(f)["project"]["entry-points"]["torch_dynamo_backends"]
    module, _, attribute = entry_points["kiln"].partition(":")
    assert getattr(importlib.import_module(module), attribute) is dynamo_backend.kiln_backend
    installed = [ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends") if ep.name == "kiln"]
    if installed:  # kiln installed with pip: Dynamo finds it without register()
        assert installed[0].load() is dynamo_backend.kiln_backend


def test_register_is_idempotent():
    dynamo_backend.register()
    dynamo_backend.register()
    assert "kiln" in torch._dynamo.list_backends(exclude_tags=())


# ---- outputs and gradients against eager -----------------------------------------------------------------------
def test_mlp_outputs_and_gradients():
    model = MLP()
    compiled = backend_compile(model)
    assert_same_as_eager(model, random_tensor(4, 100, requires_grad=True), compiled=compiled)
    assert_same_as_eager(model, random_tensor(4, 100), compiled=compiled)  # fresh input, same graph
    assert_ran_through_kiln(graphs=2)  # Dynamo compiles again for the input's requires_grad
    assert kiln._C.compiler_stats()["graphs_autograd"] >= 1  # the backward came from kiln's autodiff


def test_training_steps_match_eager():
    import copy

    model = conv_bn()
    reference = copy.deepcopy(model)
    compiled = backend_compile(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(4):
        x = random_tensor(2, 3, 8, 8)
        for run, optimizer in zip((compiled, reference), optimizers):
            optimizer.zero_grad()
            run(x).pow(2).mean().backward()
            optimizer.step()
    for (name, actual), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        rtol, atol = tolerance(expected.dtype)
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert_ran_through_kiln()


def test_mlp_inference_under_no_grad():
    model = MLP().eval()
    compiled = backend_compile(model)
    with torch.no_grad():
        assert_same_as_eager(model, random_tensor(4, 100), compiled=compiled)
    assert_ran_through_kiln()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_conv_bn_outputs_gradients_and_running_stats(train):
    model = conv_bn().train(train)
    compiled = backend_compile(model)
    for _ in range(2):  # the running statistics written back by the first call are read by the second
        assert_same_as_eager(model, random_tensor(2, 3, 8, 8), compiled=compiled)
    assert_ran_through_kiln()


def test_function_with_grad_mode_switch_and_several_outputs():
    def f(x, y):
        with torch.no_grad():
            scale = x.abs().amax()
        z = torch.tanh(x @ y) * scale
        return z, z.sum(0), x.shape[0]

    compiled = backend_compile(f)
    assert_same_as_eager(f, random_tensor(5, 6, requires_grad=True), random_tensor(6, 3, requires_grad=True),
                         compiled=compiled)
    # As for kiln.compile's graphs: a no_grad block in a graph that needs grad is differentiated as recorded.
    assert_ran_through_kiln()
    with torch.no_grad():
        assert_same_as_eager(f, random_tensor(5, 6), random_tensor(6, 3), compiled=compiled)
    assert kiln._C.compiler_stats()["graphs_compiled"] >= 1


def test_autocast_block_inside_the_graph():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float().relu()

    out = assert_same_as_eager(f, random_tensor(8, 16), random_tensor(16, 4), compiled=backend_compile(f))
    assert out.dtype == torch.float32
    assert_ran_through_kiln()


def test_mutated_input_is_written_back():
    def f(x, counter):
        counter.add_(1)
        return x * 2

    assert_same_as_eager(f, random_tensor(3), random_tensor(1), compiled=backend_compile(f))
    assert_ran_through_kiln()


def test_graph_module_with_call_module_and_get_attr_nodes():
    """The backend contract directly, with a GraphModule Dynamo does not make: torch.fx.symbolic_trace keeps
    built-in modules as call_module nodes and reads parameters through get_attr."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 4)
            self.scale = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return self.linear(x) * self.scale

    model = Model()
    gm = torch.fx.symbolic_trace(model)
    assert {n.op for n in gm.graph.nodes} >= {"call_module", "get_attr"}
    x = random_tensor(3, 6, requires_grad=True)
    compiled = dynamo_backend.kiln_backend(gm, [x])
    assert_same_as_eager(model, x, compiled=compiled)
    assert_ran_through_kiln()


@pytest.mark.cuda
def test_mlp_on_cuda():
    model = MLP().cuda()
    assert_same_as_eager(model, random_tensor(4, 100, device="cuda", requires_grad=True),
                         compiled=backend_compile(model))
    assert_ran_through_kiln()


# ---- symbolic sizes, fallbacks, options -------------------------------------------------------------------------
def test_symbolic_sizes_compile_per_signature():
    def f(x):
        return torch.sigmoid(x).sum(-1) * x.shape[0]

    compiled = backend_compile(f)
    for n in (3, 4, 5, 4):  # the second size makes Dynamo's graph symbolic
        assert_same_as_eager(f, random_tensor(n, 7, requires_grad=True), compiled=compiled)
    stats = dynamo_backend.stats()
    assert stats["graphs_eager"] == 0 and stats["calls_eager"] == 0, stats
    # Size 3 compiles from the example inputs; Dynamo's symbolic graph then compiles for 4 and again for 5 (a
    # recompile); 4 again finds its graph.
    assert stats["graphs_compiled"] == 3 and stats["recompiles"] == 1, stats


def test_symbolic_sizes_past_the_recompile_limit_run_eagerly(monkeypatch):
    monkeypatch.setattr(kiln.config, "recompile_limit", 1)

    def f(x):
        return x.cos() + 1

    compiled = backend_compile(f, dynamic=True)
    assert_same_as_eager(f, random_tensor(3), compiled=compiled)
    with pytest.warns(UserWarning, match="recompile_limit"):
        assert_same_as_eager(f, random_tensor(5), compiled=compiled)
    assert_same_as_eager(f, random_tensor(6), compiled=compiled)
    stats = dynamo_backend.stats()
    assert stats["graphs_compiled"] == 1 and stats["calls_eager"] == 2, stats


def test_list_arguments_of_fx_nodes_are_recorded():
    """FX keeps a list argument (torch.cat's tensors, a view's sizes) as an immutable_list of nodes."""
    def f(x, y):
        z = torch.cat([torch.sin(x), y * 2], dim=1)
        return torch.stack([z, z + 1]).view([2, -1]).relu()

    assert_same_as_eager(f, random_tensor(3, 4, requires_grad=True), random_tensor(3, 5, requires_grad=True),
                         compiled=backend_compile(f))
    assert_ran_through_kiln()


def test_unrecordable_node_runs_the_graph_eagerly_with_a_warning():
    # Activation checkpointing reaches the backend as a higher-order op with a subgraph, which kiln does not record.
    def block(x):
        return torch.sin(x) * 2

    def f(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum(0)

    compiled = backend_compile(f)
    with pytest.warns(UserWarning, match=r"kiln backend: running a graph Dynamo captured eagerly.*higher-order op"):
        assert_same_as_eager(f, random_tensor(4, 5, requires_grad=True), compiled=compiled)
    stats = dynamo_backend.stats()
    assert stats["graphs_eager"] == 1 and stats["calls_eager"] == 1 and stats["graphs_compiled"] == 0, stats


def test_options_reach_kiln(tmp_path):
    def f(x):
        return torch.relu(x) * 3

    compiled = backend_compile(f, options={"debug_dir": str(tmp_path)})
    assert_same_as_eager(f, random_tensor(8), compiled=compiled)
    assert any(name.endswith(".graph.txt") for name in os.listdir(tmp_path)), os.listdir(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    ({"options": {"unrolling": True}}, "unknown option 'unrolling'"),
    ({"mode": "fastest"}, "unknown mode 'fastest'"),
], ids=["unknown option", "unknown mode"])
def test_options_kiln_cannot_honour_raise(kwargs, message):
    def f(x):
        return x + 1

    with pytest.raises(Exception, match=message):
        backend_compile(f, **kwargs)(random_tensor(3))


# ---- torch.compiler.disable and allow_in_graph under kiln.compile ---------------------------------------------
@pytest.mark.parametrize("disable", [torch.compiler.disable, torch._dynamo.disable],
                         ids=["torch.compiler.disable", "torch._dynamo.disable"])
def test_disabled_function_body_runs_eagerly(disable):
    seen = []

    def inner(y):
        print("not traced")  # a graph break if kiln traced this frame
        return y * 3

    @disable
    def helper(y):
        seen.append(y)  # the real tensor, on every call
        return inner(y) + 1

    def f(x):
        return helper(x.sin()).cos()

    x = random_tensor(4)
    explained = kiln.explain(f)(x)
    assert explained.graph_break_count == 1, explained.break_reasons  # at the call; nothing inside the function
    assert "a function under torch.compiler.disable" in explained.break_reasons[0]
    assert explained.graph_count == 2  # before the call and its resume function
    seen.clear()
    compiled = kiln.compile(f)
    for _ in range(2):
        assert_same_as_eager(f, x, compiled=compiled, grads=False)
    assert len(seen) == 4 and all(type(y) is torch.Tensor and y.device.type == "cpu" for y in seen)
    torch.testing.assert_close(seen[1], x.sin())


def test_compiling_a_disabled_function_runs_it_eagerly():
    calls = []

    @torch.compiler.disable
    def f(x):
        calls.append(x)
        print("not traced")
        return x * 2

    x = random_tensor(3)
    torch.testing.assert_close(kiln.compile(f)(x), x * 2)
    assert calls[0] is x and kiln.stats()["frames_compiled"] == 0


@pytest.mark.parametrize("compiler", ["kiln.compile", "torch.compile(backend='kiln')"])
def test_allow_in_graph_records_the_call(compiler, capsys):
    def helper(y):
        print("helper runs")  # a graph break if the function were traced
        parts = [y[i] * (i + 1) for i in range(y.shape[0])]  # Python over sizes, on the fakes
        return torch.stack(parts).sin()

    torch.compiler.allow_in_graph(helper)

    def f(x):
        return helper(x + 1).sum(0)

    x = random_tensor(3, 4, requires_grad=True)
    if compiler == "kiln.compile":
        explained = kiln.explain(f)(x)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        assert "aten::sin.default" in explained.ops_per_graph[0]
        compiled = kiln.compile(f)
        traces = 1  # kiln's recorder runs it once, on fakes
    else:
        compiled = backend_compile(f, fullgraph=True)
        traces = 2  # Dynamo runs it on its fakes for the graph's metadata, then kiln's recorder on its own
    capsys.readouterr()
    assert_same_as_eager(f, x, compiled=compiled)
    assert capsys.readouterr().out.count("helper runs") == 1 + traces  # eager's call, then the trace-time calls
    assert_same_as_eager(f, random_tensor(3, 4, requires_grad=True), compiled=compiled)
    assert capsys.readouterr().out.count("helper runs") == 1  # eager's only: the compiled graph holds its ops
