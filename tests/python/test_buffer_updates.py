"""Buffers (inputs that need no grad) written in place inside compiled code: through slices and selects, with out=,
in training and in eval. The compiled graph makes the writes functional and copies the last value back, so the
buffer ends as eager's and the graph stays on kiln's kernels; a buffer a graph output aliases keeps eager's aliasing.

Each test compares outputs, gradients and buffers with eager over several calls with fresh inputs.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrizations as parametrizations

import kiln
from kiln.testing import random_tensor


pytestmark = pytest.mark.usefixtures("fresh_kiln")  # conftest.py: kiln reset around each test


class SliceWrites(nn.Module):
    """Counters and running values kept in slices of buffers, read before and after the writes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("counts", torch.zeros(3), persistent=False)
        self.register_buffer("stats", torch.zeros(2, 4))

    def forward(self, x):
        before = self.stats[1].clone()
        self.counts[0] += 1
        self.counts[1:] = self.counts[1:] + x.detach().mean()
        y = self.lin(x)
        self.stats[0] = y.detach().mean(0)
        self.stats[1].mul_(0.5)
        return y * self.counts[0] + self.stats.sum() + before.sum()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def compare_training(eager, device, calls=3):
    eager = eager.to(device)
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for _ in range(calls):
        x = random_tensor(5, 4, device=device)
        want, got = eager(x), compiled(x)
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, a), b in zip(mine.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=name)
        for (name, a), b in zip(mine.named_buffers(), eager.buffers()):
            torch.testing.assert_close(a, b, msg=name)
    return kiln.stats()


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_writes_through_slices_in_a_training_step_are_compiled(device):
    torch.manual_seed(0)
    stats = compare_training(SliceWrites(), device)
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
    assert stats["frames_compiled"] == 1 and stats["graph_breaks"] == 0, stats


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_writes_through_slices_in_eval_are_compiled(device):
    torch.manual_seed(0)
    eager = SliceWrites().eval().to(device)
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    with torch.no_grad():
        for _ in range(3):
            x = random_tensor(5, 4, device=device)
            torch.testing.assert_close(compiled(x), eager(x))
            torch.testing.assert_close(mine.counts, eager.counts)
            torch.testing.assert_close(mine.stats, eager.stats)
    stats = kiln.stats()
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_norm_training_is_compiled_with_its_power_iteration_written_back(device):
    # F.normalize(..., out=u) under no_grad: the out= call is recorded as the functional op and a copy into u.
    torch.manual_seed(0)
    stats = compare_training(nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 4)), nn.Tanh()), device)
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
    assert stats["frames_compiled"] == 1 and stats["graph_breaks"] == 0, stats


def out_arguments(x, buf):
    fresh = torch.empty(4, 4)
    torch.mul(x, 2, out=fresh)
    torch.add(x, fresh, out=buf)
    return fresh.sin(), buf * 2


def test_out_arguments_into_fresh_tensors_and_inputs():
    compiled = kiln.compile(out_arguments)
    for _ in range(3):
        x = random_tensor(4, 4)
        buf_eager, buf_mine = torch.zeros(4, 4), torch.zeros(4, 4)
        want, got = out_arguments(x, buf_eager), compiled(x, buf_mine)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(buf_mine, buf_eager)


def returns_a_view_of_a_written_buffer(x, buf):
    buf[0] += x.sum()
    return buf[0], buf[1:] * 2


def test_a_returned_view_of_a_written_buffer_aliases_it_as_in_eager():
    compiled = kiln.compile(returns_a_view_of_a_written_buffer)
    for _ in range(3):
        x = random_tensor(3)
        buf_eager, buf_mine = torch.ones(3, 2), torch.ones(3, 2)
        want, got = returns_a_view_of_a_written_buffer(x, buf_eager), compiled(x, buf_mine)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(buf_mine, buf_eager)
        buf_mine.add_(1)  # the returned view still shares the buffer's storage
        buf_eager.add_(1)
        torch.testing.assert_close(got[0], want[0])


def reads_a_view_across_a_write(buf):
    first = buf[0]
    buf.add_(1)  # `first` sees this write in eager
    return first * 1, buf.sum()


def same_on_a_buffer(fn, compiled):
    """fn and its compiled twin on equal copies of a fresh buffer: outputs and buffers compared; returns both runs'
    (outputs, buffer) for the caller's aliasing checks."""
    start = random_tensor(3, 2)
    buf_eager, buf_mine = start.clone(), start.clone()
    want, got = fn(buf_eager), compiled(buf_mine)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(buf_mine, buf_eager)
    return (want, buf_eager), (got, buf_mine)


def test_a_view_read_after_the_buffer_is_written_sees_the_write():
    compiled = kiln.compile(reads_a_view_across_a_write)
    for _ in range(3):
        same_on_a_buffer(reads_a_view_across_a_write, compiled)


def returns_a_view_made_after_the_write(buf):
    buf.add_(1)
    return buf[0], buf[1:].sum()


def test_a_view_returned_after_the_buffer_is_written_aliases_it():
    compiled = kiln.compile(returns_a_view_made_after_the_write)
    for _ in range(3):
        (want, buf_eager), (got, buf_mine) = same_on_a_buffer(returns_a_view_made_after_the_write, compiled)
        buf_mine.mul_(3)  # the returned view shares the buffer's storage, as eager's does
        buf_eager.mul_(3)
        torch.testing.assert_close(got[0], want[0])
