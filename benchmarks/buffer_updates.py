"""Models that write their buffers or keep channels-last layouts, eager against torch.compile and kiln in one process:
ms per training step of an SN-GAN discriminator (spectral norm on every layer: a power iteration written into a buffer
each step), of a model keeping counters and running values in slices of its buffers, and ms per call of a
channels-last convolution stack under no_grad. The mean of --iters steps after 3 warm-ups.

    PYTHONPATH=python python3 benchmarks/buffer_updates.py --device cuda
    PYTHONPATH=python .venv/bin/python benchmarks/buffer_updates.py --device cpu --batch 8
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.utils.parametrizations import spectral_norm  # noqa: E402

import kiln  # noqa: E402
from second_order import timed  # noqa: E402


def sn_discriminator(width):
    """SN-GAN's 32x32 discriminator: strided convolutions and a linear head, each spectrally normalised."""
    def conv(cin, cout, k, s):
        return spectral_norm(nn.Conv2d(cin, cout, k, s, padding=1))
    return nn.Sequential(conv(3, width, 3, 1), nn.LeakyReLU(0.1), conv(width, width, 4, 2), nn.LeakyReLU(0.1),
                         conv(width, 2 * width, 3, 1), nn.LeakyReLU(0.1), conv(2 * width, 2 * width, 4, 2),
                         nn.LeakyReLU(0.1), conv(2 * width, 4 * width, 3, 1), nn.LeakyReLU(0.1), nn.Flatten(),
                         spectral_norm(nn.Linear(4 * width * 8 * 8, 1)))


class SliceStatistics(nn.Module):
    """An MLP that counts its calls and keeps per-layer running means in rows of one buffer."""

    def __init__(self, width, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("calls", torch.zeros(1))
        self.register_buffer("means", torch.zeros(depth, width))

    def forward(self, x):
        self.calls[0] += 1
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            self.means[i] = 0.9 * self.means[i] + 0.1 * x.detach().mean(0)
        return x


def train_step(model, x):
    def step():
        model(x).square().mean().backward()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, 32, 32, device=dev)
    features = torch.randn(args.batch * 4, 8 * args.width, device=dev)
    stack = nn.Sequential(*[layer for cin, cout in ((3, 64), (64, 64), (64, 128), (128, 128))
                            for layer in (nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())])
    stack = stack.to(dev).eval().to(memory_format=torch.channels_last)
    last = images.contiguous(memory_format=torch.channels_last)

    def infer(m):
        def step():
            with torch.no_grad():
                m(last)
        return step
    cases = [("SN-GAN discriminator step", sn_discriminator(args.width).to(dev), lambda m: train_step(m, images)),
             ("buffer-slice statistics step", SliceStatistics(8 * args.width).to(dev),
              lambda m: train_step(m, features)),
             ("channels-last conv stack, no_grad", stack, infer)]
    print(f"device {dev}, torch {torch.__version__}; ms per step")
    print("| case | eager | torch.compile | kiln | eager / kiln | torch.compile / kiln |")
    print("|---|---|---|---|---|---|")
    for name, model, make in cases:
        eager = timed(make(model), args.iters, sync)
        try:
            torch._dynamo.reset()
            inductor = timed(make(torch.compile(model)), args.iters, sync)
            versus = f"{inductor:.3f}"
        except Exception as e:  # noqa: BLE001  (reported, not hidden)
            inductor, versus = None, "raises " + type(e).__name__
        kiln.reset()
        ours = timed(make(kiln.compile(model)), args.iters, sync)
        ratio = f"{inductor / ours:.2f}x" if inductor else "-"
        print(f"| {name} | {eager:.3f} | {versus} | {ours:.3f} | {eager / ours:.2f}x | {ratio} |", flush=True)
        print(f"    kiln: {kiln.stats()['graphs_on_eager_interpreter']} graphs on the eager interpreter", flush=True)


if __name__ == "__main__":
    main()
