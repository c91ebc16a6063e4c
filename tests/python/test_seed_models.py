"""The seed models compiled with kiln: same outputs and gradients as eager, cache hits, recompiles.

Models: the seed MLP, Conv2d+ReLU, TransformerBlock (nn.MultiheadAttention, batch_first; eval and
train mode, which has no dropout: MultiheadAttention's default dropout is 0) and a small ResNet-style
net with BatchNorm in eval mode. Every input is fresh random data.
"""
import pytest
import torch

import seed_models  # benchmarks/, put on sys.path by conftest.py
from demo import SmallResNet
from kiln.testing import assert_same_as_eager, random_tensor

COUNTERS = ("frames_compiled", "cache_hits", "recompiles", "graph_breaks", "fallbacks")


def make_mlp():
    return seed_models.MLP(), (32, 100)


def make_convrelu():
    return seed_models.ConvReLU(), (2, 3, 16, 16)


def make_transformer_eval():
    return seed_models.TransformerBlock(d_model=64, nhead=4, dim_feedforward=128).eval(), (2, 8, 64)


def make_transformer_train():
    return seed_models.TransformerBlock(d_model=64, nhead=4, dim_feedforward=128).train(), (2, 8, 64)


def make_resnet_eval():
    return SmallResNet(width=8).eval(), (2, 3, 16, 16)


# name -> factory returning (model, input shape)
SEED_MODELS = {
    "mlp": make_mlp,
    "convrelu": make_convrelu,
    "transformer_eval": make_transformer_eval,
    "transformer_train": make_transformer_train,
    "resnet_eval": make_resnet_eval,
}


def build(name, device):
    torch.manual_seed(0)
    model, shape = SEED_MODELS[name]()
    return model.to(device), shape


def counters(kiln):
    stats = kiln.stats()
    return {key: stats[key] for key in COUNTERS}


@pytest.mark.parametrize("name", SEED_MODELS)
def test_matches_eager_with_gradients(fresh_kiln, name, device):
    model, shape = build(name, device)
    assert_same_as_eager(model, random_tensor(shape, device=device))
    # And with an input that requires grad: its gradient is compared too.
    assert_same_as_eager(model, random_tensor(shape, device=device, requires_grad=True))


@pytest.mark.parametrize("name", SEED_MODELS)
def test_matches_eager_under_no_grad(fresh_kiln, name, device):
    # Inference is the common case; eval-mode MultiheadAttention takes its fused fast path here.
    model, shape = build(name, device)
    compiled = fresh_kiln.compile(model)
    with torch.no_grad():
        out = assert_same_as_eager(model, random_tensor(shape, device=device), compiled=compiled)
    assert not out.requires_grad


@pytest.mark.parametrize("name", SEED_MODELS)
def test_second_call_is_cache_hit(fresh_kiln, name, device):
    model, shape = build(name, device)
    compiled = fresh_kiln.compile(model)
    assert_same_as_eager(model, random_tensor(shape, device=device), compiled=compiled)
    first = counters(fresh_kiln)
    assert first["frames_compiled"] >= 1, f"the first call compiled nothing: {first}"

    assert_same_as_eager(model, random_tensor(shape, device=device), compiled=compiled)
    second = counters(fresh_kiln)
    assert second["frames_compiled"] == first["frames_compiled"], f"second call compiled again: {first} -> {second}"
    assert second["cache_hits"] > first["cache_hits"], f"second call was not a cache hit: {first} -> {second}"
    assert second["recompiles"] == first["recompiles"]


def change_shape(model, x):
    """A different batch size."""
    return model, random_tensor((x.shape[0] + 3,) + tuple(x.shape[1:]), device=x.device)


def change_dtype(model, x):
    """float64: the module's parameters and buffers are converted too (same Parameter objects)."""
    return model.double(), x.double()


def change_requires_grad(model, x):
    return model, x.detach().clone().requires_grad_(True)


def undo_dtype(model):
    model.float()


CHANGES = {"shape": change_shape, "dtype": change_dtype, "requires_grad": change_requires_grad}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", SEED_MODELS)
def test_changed_input_recompiles_once(fresh_kiln, name, change, device):
    model, shape = build(name, device)
    compiled = fresh_kiln.compile(model)
    first_input = random_tensor(shape, device=device)
    assert_same_as_eager(model, first_input, compiled=compiled)
    before = counters(fresh_kiln)

    model, changed_input = CHANGES[change](model, first_input)
    assert_same_as_eager(model, changed_input, compiled=compiled)
    after = counters(fresh_kiln)
    assert after["recompiles"] == before["recompiles"] + 1, f"{change} change: {before} -> {after}"
    assert after["frames_compiled"] > before["frames_compiled"], f"{change} change compiled nothing: {after}"

    # Back to the first kind of input: the first entry still serves it.
    if change == "dtype":
        undo_dtype(model)
    assert_same_as_eager(model, first_input, compiled=compiled)
    again = counters(fresh_kiln)
    assert again["frames_compiled"] == after["frames_compiled"], f"first input compiled again: {after} -> {again}"
    assert again["recompiles"] == after["recompiles"]
    assert again["cache_hits"] > after["cache_hits"], f"first input was not a cache hit: {after} -> {again}"


def test_eval_attention_on_cpu_records_eagers_fast_path(fresh_kiln):
    """Under no_grad in eval mode eager runs nn.MultiheadAttention's fused fast path on CPU; kiln traces the
    module's forward (not a leaf call on meta fakes, where the fast path declines) and records the same op."""
    from kiln.testing import capture_graphs
    model, shape = build("transformer_eval", "cpu")
    (graph, _), = capture_graphs(model, random_tensor(shape))[0]
    assert "aten::_native_multi_head_attention.default" in graph.ops(), graph.ops()
    with torch.no_grad():
        assert_same_as_eager(model, random_tensor(shape))
    model.train()  # training mode: the general path, as eager
    (graph, _), = capture_graphs(model, random_tensor(shape))[0]
    assert "aten::_native_multi_head_attention.default" not in graph.ops()
