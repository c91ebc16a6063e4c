"""mode="reduce-overhead" and options={"cudagraphs": True}: compiled graphs replayed as CUDA graphs
(runtime/cuda_graphs.h).

Every test compares with eager on fresh random inputs over several calls, so the warm-up call, the recording call and
replays are all checked. The CPU tests run everywhere (options, and the decline on CPU tensors); the rest are marked
`cuda`. kiln copies the outputs it hands back out of the graph's memory after each replay, so an output kept across
calls is never overwritten: tested with kept and with dropped outputs."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.errors import KilnError
from kiln.testing import assert_same_as_eager, random_tensor, tolerance


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def _close(actual, expected, what):
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---- options (everywhere) ----------------------------------------------------------------------------------------

def test_reduce_overhead_and_cudagraphs_option_are_accepted(fresh_kiln):
    model = _mlp()
    x = random_tensor(4, 32)
    for compiled in (kiln.compile(model, mode="reduce-overhead"), kiln.compile(model, options={"cudagraphs": True})):
        with torch.no_grad():
            for _ in range(3):
                _close(compiled(x), model(x), "output")


def test_cudagraph_options_are_validated():
    model = _mlp()
    with pytest.raises(KilnError, match="option 'cudagraphs' takes a bool"):
        kiln.compile(model, options={"cudagraphs": "yes"})
    with pytest.raises(KilnError, match="either mode or options"):
        kiln.compile(model, mode="reduce-overhead", options={"cudagraphs": True})
    with pytest.raises(KilnError, match="unknown option 'cuda_graphs'.*cudagraphs"):
        kiln.compile(model, options={"cuda_graphs": True})


def test_cpu_graphs_are_declined_with_the_reason(fresh_kiln):
    model = _mlp()
    x = random_tensor(4, 32)
    with torch.no_grad():
        explained = kiln.explain(model, backend="kiln", mode="reduce-overhead")(x)
    assert explained.cudagraphs == ["declined: its tensors are on the CPU (CUDA graphs replay CUDA work only)"]
    # Without CUDA graphs asked for, there is nothing to report.
    with torch.no_grad():
        assert kiln.explain(model, backend="kiln")(x).cudagraphs == [""]
    # Backends other than kiln's own run graphs op by op: nothing is recorded, and the status says why.
    with torch.no_grad():
        explained = kiln.explain(model, backend="eager", mode="reduce-overhead")(x)
    assert explained.cudagraphs == ["declined: backend 'eager' runs the graph op by op (CUDA graphs need "
                                    "backend='kiln')"]


# ---- CUDA --------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_inference_replays_and_matches_eager_on_fresh_inputs(fresh_kiln):
    model = _mlp().cuda()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(6):
            x = random_tensor(16, 32, device="cuda")
            _close(compiled(x), model(x), f"call {i}")
    stats = kiln.stats()
    assert stats["cudagraph_recordings"] >= 1 and stats["cudagraph_replays"] >= 4, stats
    assert stats["cudagraph_declined"] == 0, stats["cudagraph_last_decline_reason"]


@pytest.mark.cuda
def test_explain_reports_the_recording(fresh_kiln):
    model = _mlp().cuda()
    x = random_tensor(16, 32, device="cuda")
    with torch.no_grad():
        explained = kiln.explain(model, backend="kiln", mode="reduce-overhead")(x)
    assert explained.cudagraphs == ["waiting for its warm-up call"] or \
        explained.cudagraphs == ["to be recorded on its next call"], explained.cudagraphs


@pytest.mark.cuda
def test_kept_outputs_are_never_overwritten(fresh_kiln):
    model = _mlp().cuda()
    compiled = kiln.compile(model, mode="reduce-overhead")
    inputs = [random_tensor(16, 32, device="cuda") for _ in range(5)]
    with torch.no_grad():
        kept = [compiled(x) for x in inputs]  # every output held while later calls replay
        for i, (x, out) in enumerate(zip(inputs, kept)):
            _close(out, model(x), f"kept output {i}")
    assert kiln.stats()["cudagraph_replays"] >= 3


@pytest.mark.cuda
def test_dropped_outputs_and_in_place_use_of_an_output(fresh_kiln):
    model = _mlp().cuda()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(5):
            x = random_tensor(16, 32, device="cuda")
            out = compiled(x)
            expected = model(x)
            out.mul_(2)  # the caller owns its output: writing to it cannot reach the next replay
            _close(out, expected * 2, f"call {i}")
            del out


@pytest.mark.cuda
def test_an_input_that_moves_is_copied_after_recording_again(fresh_kiln):
    model = _mlp().cuda()
    compiled = kiln.compile(model, mode="reduce-overhead")
    x = random_tensor(16, 32, device="cuda")
    with torch.no_grad():
        _close(compiled(x), model(x), "warm-up")
        _close(compiled(x), model(x), "recorded with x in place")
        x.copy_(random_tensor(16, 32, device="cuda"))  # same address, new values: read in place
        _close(compiled(x), model(x), "replay after x changed")
        y = random_tensor(16, 32, device="cuda")
        _close(compiled(y), model(y), "a tensor at another address")
        for _ in range(3):
            z = random_tensor(16, 32, device="cuda")
            _close(compiled(z), model(z), "later inputs")
    assert kiln.stats()["cudagraph_declined"] == 0, kiln.stats()["cudagraph_last_decline_reason"]


class _Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


@pytest.mark.cuda
def test_training_steps_match_eager_with_forward_and_backward_recorded(fresh_kiln):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(64, 8)).cuda()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(6):
        x = random_tensor(4, 16, 64, device="cuda")
        target = random_tensor(4, 16, 8, device="cuda")
        loss = F.mse_loss(compiled(x), target)
        ref_loss = F.mse_loss(reference(x), target)
        _close(loss, ref_loss, f"loss at step {step}")
        loss.backward()
        ref_loss.backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            _close(p.grad, r.grad, f"grad of {name} at step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
    stats = kiln.stats()
    assert stats["cudagraph_recordings"] >= 2 and stats["cudagraph_replays"] >= 6, str(stats)


@pytest.mark.cuda
def test_two_forwards_before_their_backwards(fresh_kiln):
    """The first call's saved values are still held when the second forward runs: it must not overwrite them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).cuda()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model, mode="reduce-overhead")
    for step in range(4):
        a, b = random_tensor(8, 32, device="cuda"), random_tensor(8, 32, device="cuda")
        first, second = compiled(a).sum(), compiled(b).sum()
        (first * 2 + second).backward()
        (reference(a).sum() * 2 + reference(b).sum()).backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            _close(p.grad, r.grad, f"grad of {name} at step {step}")
    assert kiln.stats()["cudagraph_unrecorded_runs"] >= 1


@pytest.mark.cuda
def test_buffer_updates_and_random_ops(fresh_kiln):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU()).cuda()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(4):
            x = random_tensor(8, 16, device="cuda")
            _close(compiled(x), reference(x), f"call {i}")
    _close(model[1].running_mean, reference[1].running_mean, "running mean")
    _close(model[1].running_var, reference[1].running_var, "running var")

    dropout = kiln.compile(lambda t: F.dropout(t, 0.5, training=True), mode="reduce-overhead")
    x = torch.ones(4096, device="cuda")
    masks = [dropout(x) for _ in range(5)]
    for i in range(1, 5):  # a replay draws new random numbers, as eager does
        assert not torch.equal(masks[i], masks[i - 1]), f"call {i} repeated the previous call's dropout mask"
        kept = (masks[i] != 0).float().mean().item()
        assert 0.4 < kept < 0.6, kept


@pytest.mark.cuda
def test_a_graph_break_and_a_cpu_input(fresh_kiln):
    def f(x):
        y = torch.sin(x) * 2
        scale = y.sum().item()  # a graph break: the graphs around it are recorded separately
        return torch.cos(y) * scale

    compiled = kiln.compile(f, mode="reduce-overhead")
    for i in range(4):
        x = random_tensor(64, device="cuda")
        _close(compiled(x), f(x), f"call {i}")

    def mixed(x, cpu_scale):
        return x * cpu_scale.to(x.device) + 1

    explained = kiln.explain(mixed, backend="kiln", mode="reduce-overhead")(
        random_tensor(8, device="cuda"), random_tensor(1))
    assert all(status.startswith("declined:") or status.startswith("waiting") for status in explained.cudagraphs)
    compiled = kiln.compile(mixed, mode="reduce-overhead")
    for i in range(4):
        x, s = random_tensor(8, device="cuda"), random_tensor(1)
        _close(compiled(x, s), mixed(x, s), f"mixed call {i}")


@pytest.mark.cuda
def test_reduce_overhead_model_matches_eager_with_gradients(fresh_kiln):
    model = _Block().cuda()
    compiled = kiln.compile(model, mode="reduce-overhead")
    for _ in range(3):
        assert_same_as_eager(model, random_tensor(2, 8, 64, device="cuda", requires_grad=True), compiled=compiled)


@pytest.mark.cuda
def test_graphs_making_host_tensors_are_declined(fresh_kiln):
    """Efficient attention with dropout returns its random seed on the host; a replay would not recompute it."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2).sum(-1)

    q, k, v = (random_tensor(2, 4, 64, 32, device="cuda", requires_grad=True) for _ in range(3))
    compiled = kiln.compile(f, mode="reduce-overhead")
    for _ in range(3):
        out = compiled(q, k, v)
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    explained = kiln.explain(f, backend="kiln", mode="reduce-overhead")(q, k, v)
    assert any("on the host" in status or "on cpu" in status for status in explained.cudagraphs), explained.cudagraphs


@pytest.mark.cuda
def test_a_single_launch_is_not_recorded(fresh_kiln):
    """A graph of one kernel gains nothing from a replay and would pay for copying its output out of the pool."""
    def f(x):
        return torch.relu((x + 1) * 2)

    compiled = kiln.compile(f, mode="reduce-overhead")
    for i in range(3):
        x = random_tensor(1 << 20, device="cuda")
        _close(compiled(x), f(x), f"call {i}")
    explained = kiln.explain(f, backend="kiln", mode="reduce-overhead")(random_tensor(1 << 20, device="cuda"))
    assert explained.cudagraphs and all("single launch" in status for status in explained.cudagraphs), explained.cudagraphs
