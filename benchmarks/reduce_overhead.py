"""mode="reduce-overhead" on a launch-bound model: the MLP 256-512-512-10 (batch 16, no_grad) on CUDA, eager vs kiln
(default and reduce-overhead) vs torch.compile reduce-overhead, side by side in one process.

    python benchmarks/reduce_overhead.py [--calls 2000] [--systems eager,kiln,kiln-ro,inductor-ro]

Per system, in us per call: `without sync` (--calls calls back to back, then one synchronisation: what a loop that
does not wait for each result pays), `with sync` (the median of 200 calls, each followed by a synchronisation).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))


def timings(fn, x, calls):
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - start) / calls * 1e6
        synced = []
        for _ in range(200):
            start = time.perf_counter()
            fn(x)
            torch.cuda.synchronize()
            synced.append(time.perf_counter() - start)
    synced.sort()
    return pipelined, synced[len(synced) // 2] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--systems", default="eager,kiln,kiln-ro,inductor-ro")
    args = ap.parse_args()
    import kiln
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    x = torch.randn(16, 256, device="cuda")
    make = {"eager": lambda: model, "kiln": lambda: kiln.compile(model),
            "kiln-ro": lambda: kiln.compile(model, mode="reduce-overhead"),
            "inductor-ro": lambda: torch.compile(model, mode="reduce-overhead")}
    base = None
    for system in args.systems.split(","):
        pipelined, synced = timings(make[system](), x, args.calls)
        base = base or (pipelined, synced)
        print(f"{system:12s} without sync {pipelined:7.1f} us ({pipelined / base[0]:.2f}x eager)   "
              f"with sync {synced:7.1f} us ({synced / base[1]:.2f}x eager)", flush=True)


if __name__ == "__main__":
    main()
