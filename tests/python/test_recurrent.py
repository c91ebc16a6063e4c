"""Recurrent layers and cells: nn.LSTM, nn.GRU and nn.RNN recorded as one op each; LSTM and GRU cells compiled.

nn.LSTM/GRU/RNN call torch._VF.<op>, whose ATen kernel picks oneDNN's (CPU) or cuDNN's (CUDA) fused recurrent
implementation on the real device; decomposed on meta tensors it became one cell per time step and layer (1294 ops
for 2 layers over 32 steps, four times slower than eager). They are recorded whole. The cells (nn.LSTMCell,
nn.GRUCell) decompose into `gates.unsafe_chunk(...)` followed by in-place activations of the pieces, which once sent
every training graph with a cell to kiln's eager interpreter; the pieces of a fresh tensor are now made functional.
Each test compares outputs and gradients with eager on fresh inputs.
"""
import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def ops_of(module, *args):
    e = kiln.explain(module)(*args)
    kiln.reset()
    # RNNBase checks its weights through weak references (`ref() is weight`): traced, no break.
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    return [op for ops in e.ops_per_graph for op in ops]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_recurrent_layers_are_one_op(kind, device):
    torch.manual_seed(0)
    layer = getattr(nn, kind)(8, 6, num_layers=2, batch_first=True).to(device)
    x = random_tensor(3, 5, 8, device=device)
    name = {"LSTM": "aten::lstm.input", "GRU": "aten::gru.input", "RNN": "aten::rnn_tanh.input"}[kind]
    ops = ops_of(layer, x)
    assert ops.count(name) == 1 and not any("sigmoid" in op or "addmm" in op for op in ops), ops
    for _ in range(2):  # training: outputs, hidden states and every weight's gradient
        assert_same_as_eager(layer, random_tensor(3, 5, 8, device=device))
    layer.eval()
    with torch.no_grad():
        assert_same_as_eager(layer, random_tensor(3, 5, 8, device=device), grads=False)


def test_a_replaced_weight_is_seen_through_the_weak_references():
    torch.manual_seed(0)
    layer = nn.LSTM(8, 6, batch_first=True)
    compiled = kiln.compile(layer)
    x = random_tensor(3, 5, 8)
    torch.testing.assert_close(compiled(x), layer(x))
    layer.weight_ih_l0 = nn.Parameter(random_tensor(24, 8))  # the old weight's weak reference now differs
    with torch.no_grad():
        out, ref = compiled(x), layer(x)
    torch.testing.assert_close(out, ref)
    assert kiln.stats()["recompiles"] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_bidirectional_lstm_with_initial_states(device):
    torch.manual_seed(0)
    layer = nn.LSTM(8, 6, bidirectional=True).to(device)
    x = random_tensor(5, 3, 8, device=device)
    h0, c0 = random_tensor(2, 3, 6, device=device), random_tensor(2, 3, 6, device=device)
    assert_same_as_eager(layer, x, (h0, c0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_cells_in_a_python_loop_compile_their_training_graph(kind, device):
    torch.manual_seed(0)
    cell = getattr(nn, kind)(8, 6).to(device)

    def run(x):
        h = torch.zeros(x.shape[0], 6, device=x.device)
        state = (h, h) if kind == "LSTMCell" else h
        outs = []
        for t in range(x.shape[1]):
            state = cell(x[:, t], state)
            outs.append(state[0] if kind == "LSTMCell" else state)
        return torch.stack(outs, 1)

    for _ in range(2):
        assert_same_as_eager(run, random_tensor(3, 4, 8, device=device, requires_grad=True))
    stats = kiln.stats()
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
    assert stats["graph_breaks"] == 0 and stats["fallbacks"] == 0, stats


def test_in_place_ops_on_pieces_of_a_tensor_still_read_elsewhere_keep_eager_semantics():
    # A piece may be made functional only when nothing else reads the tensor it was cut from: here the base is read
    # after the piece changed, and must show the change, as in eager.
    def f(a, b):
        x = a @ b
        p, q = x.unsafe_split(2, 1)
        p.add_(q)
        return p.sigmoid_() * 2, x.sum(0)

    assert_same_as_eager(f, random_tensor(3, 4), random_tensor(4, 4), grads=False)
