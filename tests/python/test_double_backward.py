"""Double backward through compiled graphs: a backward under create_graph=True (physics-informed losses, gradient
penalties, MAML, Hessian-vector products) replays the captured graph with autograd recording (runtime/double_backward.h).

Each test runs the same training computation on the eager module and on the compiled one, from the same seed and
inputs, and compares the losses and every parameter's gradient.
"""
import pytest
import torch
import torch.nn as nn

import kiln


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def same_as_eager(step, model, device, calls=2):
    model = model.to(device)
    compiled = kiln.compile(model)
    for call in range(calls):
        torch.manual_seed(100 + call)
        want = step(model, device)
        torch.manual_seed(100 + call)
        got = step(compiled, device)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def gradients(model, loss):
    loss.backward()
    result = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return result


def pinn_step(model, device):
    # u(x) and its first and second derivatives in x, in the loss.
    x = torch.randn(16, 2, device=device, requires_grad=True)
    u = model(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (d2,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    return gradients(model, (du ** 2).mean() + (d2 ** 2).mean() + u.pow(2).mean())


def test_a_physics_informed_loss_of_second_derivatives(device):
    mlp = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    same_as_eager(pinn_step, mlp, device, calls=3)
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["graph_breaks"] == 0


def test_a_gradient_penalty(device):
    def step(critic, device):
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        a = torch.rand(4, 1, device=device)
        mixed = (a * real + (1 - a) * fake).requires_grad_(True)
        out = critic(mixed)
        (g,) = torch.autograd.grad(out, mixed, grad_outputs=torch.ones_like(out), create_graph=True)
        penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
        return gradients(critic, critic(fake).mean() - critic(real).mean() + 10 * penalty)

    same_as_eager(step, nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)), device)


def test_gradients_of_parameter_gradients_and_hessian_vector_products(device):
    def meta_step(net, device):
        x, y = torch.randn(5, 4, device=device), torch.randn(5, 2, device=device)
        grads = torch.autograd.grad(((net(x) - y) ** 2).mean(), list(net.parameters()), create_graph=True)
        return gradients(net, sum((g ** 2).sum() for g in grads))

    def hvp_step(net, device):
        params = tuple(net.parameters())
        v = tuple(torch.randn_like(p) for p in params)
        g = torch.autograd.grad(net(torch.randn(3, 4, device=device)).pow(2).sum(), params, create_graph=True)
        return list(torch.autograd.grad(g, params, grad_outputs=v))

    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    same_as_eager(meta_step, net, device)
    same_as_eager(hvp_step, net, device)


def test_create_graph_inside_the_compiled_forward():
    class GradientNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            x = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.tanh(x @ self.w).sum(), x, create_graph=True)
            return (g * g).sum()

    same_as_eager(lambda m, device: gradients(m, m(torch.randn(3, 4))), GradientNorm(), "cpu")


def test_graphs_a_replay_cannot_reproduce_raise_saying_why():
    def step(model, device):
        x = torch.randn(6, 4, requires_grad=True)
        (du,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        return du

    dropout = kiln.compile(nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)))
    with pytest.raises(kiln.errors.KilnError, match="draws random numbers"):
        step(dropout, "cpu")
    batch_norm = kiln.compile(nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)))
    with pytest.raises(kiln.errors.KilnError, match="updates its inputs in place"):
        step(batch_norm, "cpu")


def test_an_input_changed_in_place_since_the_forward_raises_as_in_eager():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled = kiln.compile(model)
    for m in (model, compiled):
        x = torch.randn(6, 4, requires_grad=True)
        h = x * 1
        u = m(h)
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(u.sum(), x, create_graph=True)


def test_a_second_backward_after_the_saved_values_were_freed_raises_as_in_eager():
    compiled = kiln.compile(lambda a: torch.tanh(a) * a)
    x = torch.randn(3, 4, requires_grad=True)
    out = compiled(x).sum()
    torch.autograd.grad(out, x)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, x, create_graph=True)
