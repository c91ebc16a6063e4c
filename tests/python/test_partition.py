"""The min-cut partitioner of compiled autograd (csrc/autodiff/partition.*): the forward saves the fewest bytes
from which the backward can rebuild what the derivative rules read, recomputing cheap pointwise chains.

Each test checks gradients against eager and kiln._C.compiler_stats()["autograd_saved_bytes"] (bytes of the saved
forward intermediates, graph inputs and returned outputs excluded) against a number computed here from the
shapes, next to what saving every value the rules read (the joint walk's own choice) would have kept."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.testing import assert_same_as_eager, random_tensor
from test_training import keep_summaries  # a backend that keeps each compiled graph's summary

seed_models = pytest.importorskip("seed_models")  # benchmarks/seed_models.py (conftest puts benchmarks/ on the path)

F32 = 4  # bytes per float32 element


@pytest.fixture(autouse=True)
def compiled_autograd(tmp_path, monkeypatch, fresh_kiln):  # fresh_kiln (conftest): kiln reset around the test
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    kiln._C.reset_compiler_stats()
    kiln.config.set_compiled_autograd(True)  # the default (see kiln.config); these tests are about it
    yield
    kiln.config.set_compiled_autograd(False)


def r(*shape, grad=True):
    return random_tensor(*shape, requires_grad=grad)


def partition_stats(expect_graphs=1):
    stats = kiln._C.compiler_stats()
    assert stats["graphs_fallback"] == 0, stats["last_fallback_reason"]
    assert stats["graphs_autograd"] == expect_graphs, stats
    return stats["autograd_saved_bytes"], stats["autograd_recomputed_nodes"]


def test_gelu_of_matmul_saves_the_gelu_input_only():
    # mm -> a = m + b -> g = gelu(a) -> g * y. gelu's rule reads a, mul's reads g: g is gelu(a), recomputed.
    n, k, m = 7, 9, 11
    assert_same_as_eager(lambda x, w, b, y: F.gelu(x @ w + b) * y, r(n, k), r(k, m), r(m), r(n, m))
    saved, recomputed = partition_stats()
    before = F32 * (n * m + n * m)  # a and g
    assert saved == F32 * n * m < before
    assert recomputed >= 1


def test_gelu_of_matmul_times_two_saves_one_activation():
    # y = gelu(x @ w + b) * 2 keeps exactly one (n, m) activation; neither gelu's output nor the product.
    n, k, m = 6, 5, 8
    assert_same_as_eager(lambda x, w, b: F.gelu(x @ w + b) * 2, r(n, k), r(k, m), r(m))
    saved, _ = partition_stats()
    assert saved == F32 * n * m


def test_layer_norm_gelu_linear_recomputes_the_gelu():
    # The transformer MLP: layer_norm -> linear -> gelu -> linear. The second linear's weight gradient reads
    # gelu's output; it is recomputed from the first linear's output, which gelu's own rule saves.
    n, d, hidden = 10, 16, 24
    fn = lambda x, lw, lb, w1, b1, w2, b2: F.linear(F.gelu(F.linear(F.layer_norm(x, (d,), lw, lb), w1, b1)), w2, b2)
    assert_same_as_eager(fn, r(n, d), r(d), r(d), r(hidden, d), r(hidden), r(d, hidden), r(d))
    saved, recomputed = partition_stats()
    layer_norm = n * d + 2 * n  # normalised output (the first linear's input), mean and rstd
    expected = F32 * (layer_norm + n * hidden)  # + the first linear's output (gelu's input)
    before = expected + F32 * n * hidden  # + gelu's output
    assert saved == expected < before
    assert recomputed >= 1


def test_softmax_then_pointwise_chain_is_recomputed_from_the_softmax():
    # softmax is saved (its rule reads it, and a reduction is never recomputed); tanh(softmax * 2), which the
    # last matmul reads, is two pointwise ops away from it.
    n, k, m, j = 5, 6, 7, 4
    fn = lambda x, w, v: torch.softmax(x @ w, dim=-1).mul(2).tanh() @ v
    assert_same_as_eager(fn, r(n, k), r(k, m), r(m, j))
    saved, recomputed = partition_stats()
    assert saved == F32 * n * m < F32 * 2 * n * m  # softmax only; before: softmax and tanh's output
    assert recomputed == 2  # mul, tanh


def test_pointwise_chain_from_inputs_saves_nothing():
    # exp's rule reads its result, mul's reads both operands: exp(x) is redone from the input x.
    fn = lambda x, y: torch.exp(x) * y
    assert_same_as_eager(fn, r(8, 9), r(8, 9))
    saved, recomputed = partition_stats()
    assert saved == 0
    assert recomputed == 1


def test_recomputation_chains_are_bounded():
    # tanh twelve times: each rule reads its result. Every result within 8 pointwise ops of the input is
    # redone from the input; the 9th is treated as not recomputable and saved, and the 10th and 11th are redone
    # from it (the 12th is the output). kMaxRecomputeDepth in partition.cpp is 8.
    def fn(x):
        for _ in range(12):
            x = torch.tanh(x)
        return x
    assert_same_as_eager(fn, r(6, 7))
    saved, recomputed = partition_stats()
    assert saved == F32 * 6 * 7
    assert recomputed == 8 + 2


def test_transformer_block_saves_less():
    torch.manual_seed(0)
    b, s, d, heads, hidden = 2, 6, 32, 4, 64
    model = seed_models.TransformerBlock(d, heads, hidden)
    assert_same_as_eager(model, random_tensor(b, s, d), rtol=1e-4, atol=1e-5)
    saved, recomputed = partition_stats()
    tokens = b * s
    expected = F32 * (
        tokens * hidden  # first FFN linear's output (gelu's input); gelu's output is recomputed
        + 2 * tokens * d  # norm2's output and the residual sum it normalises
        + tokens * d  # the attention output projection's input
        + 3 * tokens * d  # the packed q, k, v projection (q * scale is recomputed from it)
        + b * heads * s * s  # the attention weights (softmax)
        + tokens * d  # norm1's output, laid out for the in-projection
        + 4 * tokens  # mean and rstd of both layer norms
    )
    before = expected + F32 * (tokens * hidden + tokens * d)  # + gelu's output and q * scale
    assert saved == expected < before
    assert recomputed >= 2


class ResidualBlock(torch.nn.Module):
    def __init__(self, channels, activation):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.activation = activation
        # BatchNorm's num_batches_tracked.add_(1) is an in-place op on a buffer, which keeps the whole graph on
        # the eager interpreter today; without the counter, training mode updates the running statistics with
        # momentum 0.1 exactly as before, on the compiled path.
        self.bn1.num_batches_tracked = None
        self.bn2.num_batches_tracked = None

    def forward(self, x):
        y = self.activation(self.bn1(self.conv1(x)))
        return self.activation(self.bn2(self.conv2(y)) + x).sigmoid()


@pytest.mark.parametrize("activation", [torch.relu, F.silu], ids=["relu", "silu"])
def test_residual_conv_batchnorm_block_in_train_mode(activation):
    torch.manual_seed(0)
    n, c, h, w = 2, 4, 6, 6
    model = ResidualBlock(c, activation).train()
    assert_same_as_eager(model, random_tensor(n, c, h, w), rtol=1e-4, atol=1e-5)
    saved, recomputed = partition_stats()
    for bn in (model.bn1, model.bn2):
        assert bn.running_mean.abs().sum() > 0  # the compiled forward updated the statistics
    act = n * c * h * w
    # Saved either way: both convolutions' outputs (batch norm's inputs) and 2 statistics per batch norm, what
    # the first activation's rule reads and what the second one's reads (the sigmoid's result is the output).
    expected = F32 * (4 * act + 4 * c)
    if activation is torch.relu:
        # relu's rule reads its result, which conv2 reads too: one tensor serves both, nothing to recompute
        # (the same set eager autograd saves).
        assert saved == expected
    else:
        # silu's rule reads its input, conv2 its output: silu(y) is recomputed from y instead of saved.
        assert saved == expected < expected + F32 * act
        assert recomputed == 1


def test_dropout_is_never_recomputed():
    # u = dropout(x @ w); tanh(u) * sigmoid(u) @ w2. With grad on, F.dropout records bernoulli -> mask = b / (1 - p)
    # -> u = (x @ w) * mask. The rules read the mask, tanh's and sigmoid's results and their product: the last three
    # are redone from u, which is saved (bernoulli is random and never recomputed, and u is no cheaper to redo).
    n, k, m, j = 8, 16, 12, 5
    fn = lambda x, w, w2: (lambda u: (torch.tanh(u) * torch.sigmoid(u)) @ w2)(F.dropout(x @ w, 0.5, training=True))
    x, w, w2 = r(n, k), r(k, m), r(m, j)
    graphs = []
    compiled = kiln.compile(fn, backend=keep_summaries(graphs))
    torch.manual_seed(7)
    out = compiled(x, w, w2)
    grads = torch.autograd.grad(out.sum(), (x, w, w2))
    xe, we, w2e = (t.detach().clone().requires_grad_() for t in (x, w, w2))
    torch.manual_seed(7)
    expected = fn(xe, we, w2e)
    expected_grads = torch.autograd.grad(expected.sum(), (xe, we, w2e))
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    saved, recomputed = partition_stats()
    assert saved == F32 * 2 * n * m < F32 * 4 * n * m  # the mask and u; before: the mask, tanh, sigmoid, product
    assert recomputed == 3  # tanh, sigmoid, mul
    (summary,) = graphs
    backward = [k for k in summary["kernels"] + summary["externs"] if k.startswith("backward:")]
    assert not any(word in k for k in backward for word in ("dropout", "bernoulli", "rand")), backward


def test_training_curve_unchanged_with_recomputation():
    # A short AdamW run through two transformer blocks (gelu outputs recomputed): same losses as eager.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[seed_models.TransformerBlock(16, 2, 32) for _ in range(2)])
    reference = copy.deepcopy(model)
    inputs = [random_tensor(2, 5, 16) for _ in range(3)]

    def train(m, compiled):
        run = kiln.compile(m) if compiled else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for step in range(8):
            opt.zero_grad(set_to_none=True)
            loss = run(inputs[step % len(inputs)]).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.testing.assert_close(torch.tensor(train(model, True)), torch.tensor(train(reference, False)), rtol=1e-3, atol=1e-5)
    assert kiln._C.compiler_stats()["autograd_recomputed_nodes"] > 0
