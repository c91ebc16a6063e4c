"""Mixed-precision loss curves (issue #30): 50 AdamW steps under torch.autocast, kiln against eager from the same
weights and batches, on small versions of the seed training rows: a 2-layer transformer encoder (transformer6_train),
a convolution + BatchNorm + residual net (resnet50_train) and a tiny BERT (bert_train; skipped without transformers).
The steps follow seed_models.step_fn's recipe: forward and loss under autocast, backward and optimizer step outside
it. On the CPU and on CUDA: bfloat16, and float16 through torch.amp.GradScaler, whose scale must follow eager's step
for step (CPU float16 matmuls run in software, but these models are small enough). benchmarks/amp_loss_curves.py
draws the same curves for the full-size models.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.testing import random_tensor, tolerance

seed_models = pytest.importorskip("seed_models")  # benchmarks/seed_models.py (conftest puts benchmarks/ on the path)

STEPS = 50
LR = 2e-3


class ConvNet(nn.Module):
    """resnet50_train in small: a convolution stem and one residual block, each convolution with batch norm."""

    def __init__(self, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.block(x) + x)
        return self.head(x.mean((2, 3)))


def mean_square_loss(run, x):
    return seed_models.training_loss(run(x))


def classifier_loss(run, x, labels):
    return F.cross_entropy(run(x), labels)


def masked_lm_loss(run, ids):
    return run(input_ids=ids, labels=ids)[0]


def model_and_batches(kind, device):
    """A model with seed 0's weights, four batches (cycled through the steps) and the loss of a call on one batch."""
    torch.manual_seed(0)
    if kind == "transformer":  # transformer6_train's loss
        model = nn.Sequential(*[seed_models.TransformerBlock(32, 4, 64) for _ in range(2)])
        batches = [(random_tensor(4, 16, 32),) for _ in range(4)]
        loss = mean_square_loss
    elif kind == "conv":  # a classifier's loss: the seed rows' mean square of the logits would drive them to zero
        model = ConvNet()
        batches = [(random_tensor(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(4)]
        loss = classifier_loss
    else:
        transformers = pytest.importorskip("transformers")
        # The masked-LM loss the model computes from labels, as users train it (BertModel's own output is a
        # LayerNorm's, whose mean square does not depend on anything before that LayerNorm). No dropout: kiln runs
        # attention with dropout on its eager interpreter (CPU), which would not test kiln's code.
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        model.config.return_dict = False
        batches = [(torch.randint(0, 100, (4, 16)),) for _ in range(4)]
        loss = masked_lm_loss
    return model.to(device).train(), [[t.to(device) for t in batch] for batch in batches], loss


def train(model, batches, loss_of, device, dtype, run=None):
    """STEPS AdamW steps of the AMP recipe; float16 steps go through a GradScaler as eager users write it.
    Returns (losses, scales after each step)."""
    run = run or model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = None
    if dtype == torch.float16:
        # The scale grows after every 5 clean steps, so it keeps overflowing the gradients and backing off: skipped
        # steps and growth both occur, on each model. Whether a step overflows is a threshold on its largest
        # gradient, where kiln's and eager's, rounded differently, may fall on either side when both are within
        # rounding of float16's limit; steps of 16 rather than 2 land them there less often (seen with steps of 2: one
        # element of eager's gradient overflowed at a step where kiln's largest was 58528).
        scaler = torch.amp.GradScaler(device, init_scale=2.0**24, growth_factor=16.0, backoff_factor=1 / 16,
                                      growth_interval=5)
    losses, scales = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = loss_of(run, *batches[step % len(batches)])
        seed_models.backward_and_step(loss, opt, scaler)
        if scaler is not None:
            scales.append(scaler.get_scale())
        losses.append(loss.item())
    return losses, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-grad_scaler"])
@pytest.mark.parametrize("kind", ["transformer", "conv", "bert"])
def test_amp_loss_curve_follows_eager(fresh_kiln, kind, device, dtype):
    model, batches, loss_of = model_and_batches(kind, device)
    reference = copy.deepcopy(model)
    kiln._C.reset_compiler_stats()
    losses, scales = train(model, batches, loss_of, device, dtype, run=kiln.compile(model))
    stats = {**kiln.stats(), **kiln._C.compiler_stats()}
    eager_losses, eager_scales = train(reference, batches, loss_of, device, dtype)
    # DESIGN.md's tolerance table, the row of the autocast dtype (kiln.testing.tolerance: bfloat16 1.6e-2, float16 5e-3
    # relative), bounds every step's loss: the losses are float32 values computed from outputs in that dtype, where
    # kiln's fused kernels round once and eager rounds after each op, and 50 steps carry those roundings into the
    # weights. Measured on the CPU over 8-10 starting points: kiln's curves within 2e-3 of eager's in bfloat16 (about
    # as far as eager's own bfloat16 curve is from its float32 one) and 1e-3 in float16, while starting weights
    # perturbed by 20% move them by 1.5e-2 to 0.13, and a first layer left without gradient by 3e-2 or more. The
    # table's absolute part, meant for elements near zero, is left out: a loss is one value of the curve's own scale.
    rtol = tolerance(dtype)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=rtol, atol=0.0,
                               msg=lambda m: f"{kind}'s loss curve under {dtype} differs from eager's:\n{m}")
    assert scales == eager_scales, f"GradScaler's scales after each step: kiln {scales}, eager {eager_scales}"
    if dtype == torch.float16:  # the scaler skipped steps and grew again: the scale checks were exercised
        changes = list(zip([2.0**24] + scales, scales))
        assert any(b < a for a, b in changes) and any(b > a for a, b in changes), scales
    # The steps must run kiln's compiled forward and backward, whole, or the curves would compare eager with itself.
    assert stats["graph_breaks"] == 0 and stats["fallbacks"] == 0, stats
    assert stats["graphs_fallback"] == 0, stats["last_fallback_reason"]
    assert stats["graphs_autograd"] >= 1, stats
