"""Recurrent layers and cells, eager against kiln in one process: ms per call (eval under no_grad) and per training
step (forward, then `out.sum().backward()`), the mean of --iters calls after 3 warm-ups.

    PYTHONPATH=python python3 benchmarks/recurrent.py --device cuda
    PYTHONPATH=python .venv/bin/python benchmarks/recurrent.py --device cpu --hidden 128 --input 64 --batch 16 --steps 32
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import kiln  # noqa: E402


def cell_loop(cell, hidden):
    def run(x):
        h = torch.zeros(x.shape[0], hidden, device=x.device)
        state = (h, h) if isinstance(cell, nn.LSTMCell) else h
        outs = []
        for t in range(x.shape[1]):
            state = cell(x[:, t], state)
            outs.append(state[0] if isinstance(cell, nn.LSTMCell) else state)
        return torch.stack(outs, 1)
    return run


def timed(fn, x, train, iters, sync):
    def step():
        if train:
            out = fn(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        else:
            with torch.no_grad():
                fn(x)
    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--input", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", default="LSTM,GRU,GRUCell", help="comma list of LSTM, GRU, LSTMCell, GRUCell")
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.steps, args.input, device=args.device)
    print(f"{args.device}, torch {torch.__version__}, input {args.input}, hidden {args.hidden}, batch {args.batch} x "
          f"{args.steps} steps")
    print("| model | mode | eager ms | kiln ms | eager / kiln |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        kind = getattr(nn, name)
        if name.endswith("Cell"):
            fn = cell_loop(kind(args.input, args.hidden).to(args.device), args.hidden)
        else:
            fn = kind(args.input, args.hidden, num_layers=2, batch_first=True).to(args.device)
        compiled = kiln.compile(fn)
        for train in (False, True):
            eager_ms = timed(fn, x, train, args.iters, sync)
            kiln_ms = timed(compiled, x, train, args.iters, sync)
            print(f"| {name} | {'train' if train else 'eval'} | {eager_ms:.3f} | {kiln_ms:.3f} | {eager_ms / kiln_ms:.2f}x |")
    s = kiln.stats()
    print(f"kiln: {s['frames_compiled']} frames, {s['graph_breaks']} graph breaks, "
          f"{s['graphs_on_eager_interpreter']} graphs on the eager interpreter")


if __name__ == "__main__":
    main()
