"""Double backward and custom autograd functions, eager against torch.compile and kiln in one process: ms per
training step of a physics-informed loss (u and du/dx of an MLP, `create_graph=True`) and of a WGAN gradient penalty,
and ms per call of a Bloom-style block whose GELU is a custom `torch.autograd.Function`, under no_grad. The mean of
--iters steps after 3 warm-ups; a compiler that raises is reported with its error.

    PYTHONPATH=python python3 benchmarks/second_order.py --device cuda
    PYTHONPATH=python .venv/bin/python benchmarks/second_order.py --device cpu --points 512
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import kiln  # noqa: E402


def mlp(width, inputs, outputs):
    return nn.Sequential(nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, outputs))


def pinn_step(model, points):
    def step():
        x = points.clone().requires_grad_(True)
        u = model(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        ((du ** 2).mean() + u.pow(2).mean()).backward()
    return step


def penalty_step(critic, real, fake):
    def step():
        a = torch.rand(real.shape[0], 1, device=real.device)
        mixed = (a * real + (1 - a) * fake).requires_grad_(True)
        out = critic(mixed)
        (g,) = torch.autograd.grad(out, mixed, grad_outputs=torch.ones_like(out), create_graph=True)
        (critic(fake).mean() - critic(real).mean() + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()).backward()
    return step


class Gelu(torch.autograd.Function):
    """Bloom's GELU: a tanh approximation with a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(Gelu.apply(self.up(self.norm(x))))


def timed(step, iters, sync):
    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--points", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cases = []
    net = mlp(args.width, 2, 1).to(dev)
    points = torch.randn(args.points, 2, device=dev)
    cases.append(("PINN step (du/dx in the loss)", net, lambda m: pinn_step(m, points)))
    critic = mlp(args.width, 64, 1).to(dev)
    real, fake = torch.randn(256, 64, device=dev), torch.randn(256, 64, device=dev)
    cases.append(("gradient penalty step", critic, lambda m: penalty_step(m, real, fake)))
    blocks = nn.Sequential(*[Block(args.width) for _ in range(4)]).to(dev).eval()
    tokens = torch.randn(8, 128, args.width, device=dev)

    def infer(m):
        def step():
            with torch.no_grad():
                m(tokens)
        return step
    cases.append(("custom-Function GELU blocks, no_grad", blocks, infer))
    print(f"device {dev}, torch {torch.__version__}; ms per step")
    print("| case | eager | torch.compile | kiln | eager / kiln |")
    print("|---|---|---|---|---|")
    for name, model, make in cases:
        eager = timed(make(model), args.iters, sync)
        try:
            torch._dynamo.reset()
            inductor = f"{timed(make(torch.compile(model)), args.iters, sync):.3f}"
        except Exception as e:  # noqa: BLE001  (reported, not hidden)
            inductor = "raises " + type(e).__name__
        kiln.reset()
        ours = timed(make(kiln.compile(model)), args.iters, sync)
        print(f"| {name} | {eager:.3f} | {inductor} | {ours:.3f} | {eager / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
