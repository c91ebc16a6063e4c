"""Code whose meaning lives outside the ops it calls: torch.func transforms, tensor subclasses, grad-mode switches made
by torch's own Python. kiln must give eager's answers (running eagerly where it cannot capture), never crash.

Each test compares with eager over several calls with fresh inputs.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrizations as parametrizations

import kiln
from kiln.testing import random_tensor


pytestmark = pytest.mark.usefixtures("fresh_kiln")  # conftest.py: kiln reset around each test


def test_functions_called_by_torch_func_transforms_run_eagerly_inside_them():
    # The function vmap calls sees functorch's batched wrappers, which have no storage: compiled, it raised
    # "Cannot access data pointer of Tensor that doesn't have storage" where eager works.
    def body(r):
        return r.sin() * r.sum()

    def f(x):
        return torch.func.vmap(body)(x), torch.func.grad(lambda r: (r.sin() ** 2).sum())(x)

    compiled, compiled_body = kiln.compile(f), kiln.compile(body)
    for _ in range(3):
        x = random_tensor(4, 5)
        for got, want in zip(compiled(x), f(x)):
            torch.testing.assert_close(got, want)
        # A function compiled outside a transform keeps serving calls outside it, and runs eagerly inside one
        # (its compiled entry is guarded on the transform state).
        torch.testing.assert_close(compiled_body(x), body(x))
        torch.testing.assert_close(torch.func.vmap(compiled_body)(x), torch.func.vmap(body)(x))
        torch.testing.assert_close(torch.func.jacrev(compiled_body)(x[0]), torch.func.jacrev(body)(x[0]))
        torch.testing.assert_close(compiled_body(x), body(x))
    assert kiln.stats()["recompiles"] == 0


class Tagged(torch.Tensor):
    """A subclass with torch's default __torch_function__: every op's result is a Tagged again."""


def test_tensor_subclass_inputs_keep_their_type_through_ops():
    # Compiled, the ops on a subclass input returned plain tensors: type checks downstream saw another answer.
    def f(x):
        y = x * 2 + 1
        return y, type(y).__name__, isinstance(y.sum(), Tagged)

    def g(x):
        return f(x.as_subclass(Tagged))

    for fn in (f, g):
        compiled = kiln.compile(fn)
        for _ in range(3):
            x = random_tensor(3, 4).as_subclass(Tagged) if fn is f else random_tensor(3, 4)
            got, want = compiled(x), fn(x)
            assert type(got[0]) is type(want[0]) is Tagged
            assert got[1:] == want[1:] == ("Tagged", True)
            torch.testing.assert_close(got[0].as_subclass(torch.Tensor), want[0].as_subclass(torch.Tensor))
        kiln.reset()


def test_parameters_and_their_subclasses_without_overrides_are_still_captured():
    class Plain(nn.Parameter):
        pass

    lin = nn.Linear(4, 3)
    lin.weight = Plain(lin.weight.detach().clone())
    compiled = kiln.compile(lin)
    for _ in range(3):
        x = random_tensor(2, 4)
        torch.testing.assert_close(compiled(x), lin(x))
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["graph_breaks"] == 0


def test_grad_mode_switched_by_torch_code_that_runs_on_the_fakes_is_replayed():
    # Spectral norm's power iteration is a @torch.no_grad() method reached through a parametrization (torch's own
    # code, run for real on the recorder's fakes): its switch was not recorded, so the compiled graph ran its
    # in-place `out=` update with grad on and raised where eager works.
    torch.manual_seed(0)
    eager = parametrizations.spectral_norm(nn.Linear(4, 4))
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for _ in range(3):
        x = random_tensor(3, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want, got = eager(x), compiled(x2)
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)
        torch.testing.assert_close(mine.parametrizations.weight.original.grad,
                                   eager.parametrizations.weight.original.grad)
        torch.testing.assert_close(mine.parametrizations.weight[0]._u, eager.parametrizations.weight[0]._u)
    assert kiln.stats()["graph_breaks"] == 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["input", "weight", "both"])
@pytest.mark.parametrize("dims", [2, 3])
def test_convolution_outputs_have_eager_s_strides_for_channels_last_operands(device, layout, dims):
    # torch's meta kernel leaves convolution results contiguous (meta tensors have no device); ATen gives channels-last
    # ones for channels-last operands, and the compiled graph's outputs had other strides than eager's.
    torch.manual_seed(0)
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    conv_type, bn_type = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)
    model = nn.Sequential(conv_type(3, 4, 3), bn_type(4), nn.ReLU()).to(device)
    if layout in ("weight", "both"):
        model = model.to(memory_format=fmt)
    mine = copy.deepcopy(model)
    compiled = kiln.compile(lambda x: (mine(x), mine[0](x)))

    def eager(x):
        return model(x), model[0](x)

    for _ in range(2):
        x = random_tensor((2, 3) + (6,) * dims, device=device)
        if layout in ("input", "both"):
            x = x.contiguous(memory_format=fmt)
        x2 = x.detach().clone().requires_grad_()
        x.requires_grad_()
        want, got = eager(x), compiled(x2)
        for w, g in zip(want, got):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        want[0].sum().backward()
        got[0].sum().backward()
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine[0].weight.grad, model[0].weight.grad, rtol=1e-4, atol=1e-4)
