"""CPU micro-benchmarks of the kiln backend's kernel kinds: eager vs torch.compile (inductor) vs kiln.

Cases: relu((x+1)*2) on 4M floats (pointwise), layer norm and softmax over 4096 x 1024 floats (reductions
with prologue/epilogue), and a plain copy of 4M floats as the memory-bandwidth reference. Prints the median
time per call of each system and kiln's ratio against eager and inductor (>1: kiln faster).

    .venv/bin/python benchmarks/micro_cpu.py [--repeat 30] [--systems eager,inductor,kiln]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import kiln  # noqa: E402


def pointwise(x):
    return torch.relu((x + 1) * 2)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def softmax(x):
    return torch.softmax(x, -1)


def copy(x, out):
    return out.copy_(x)


def cases():
    x4m = torch.randn(4 * 1024 * 1024)
    rows = torch.randn(4096, 1024)
    w, b = torch.randn(1024), torch.randn(1024)
    return [
        ("relu((x+1)*2) 4M f32", pointwise, (x4m,), 2 * x4m.numel() * 4),
        ("layer_norm 4096x1024 f32", layer_norm, (rows, w, b), 2 * rows.numel() * 4),
        ("softmax 4096x1024 f32", softmax, (rows,), 2 * rows.numel() * 4),
    ]


def median_time(fn, args, repeat):
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_call(make, args):
    start = time.perf_counter()
    with torch.no_grad():
        fn = make()
        fn(*args)
    return fn, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--systems", default="eager,inductor,kiln")
    args = parser.parse_args()
    systems = args.systems.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    x4m, out = torch.randn(4 * 1024 * 1024), torch.empty(4 * 1024 * 1024)
    t_copy = median_time(copy, (x4m, out), args.repeat)
    print(f"copy 4M f32 (bandwidth reference): {t_copy * 1e3:.3f} ms = {2 * x4m.numel() * 4 / t_copy / 1e9:.1f} GB/s")
    header = f"{'case':28s}" + "".join(f"{s + ' ms':>14s}" for s in systems) + f"{'kiln/eager':>12s}{'kiln/inductor':>15s}{'kiln GB/s':>11s}{'kiln 1st s':>11s}"
    print(header)
    for name, fn, inputs, bytes_moved in cases():
        times, first = {}, {}
        for system in systems:
            if system == "eager":
                compiled, first[system] = fn, 0.0
            elif system == "inductor":
                torch._dynamo.reset()
                compiled, first[system] = first_call(lambda: torch.compile(fn), inputs)
            else:
                kiln.reset()
                compiled, first[system] = first_call(lambda: kiln.compile(fn), inputs)
            times[system] = median_time(compiled, inputs, args.repeat)
        row = f"{name:28s}" + "".join(f"{times[s] * 1e3:14.3f}" for s in systems)
        if "kiln" in times:
            ratio_eager = times["eager"] / times["kiln"] if "eager" in times else float("nan")
            ratio_inductor = times["inductor"] / times["kiln"] if "inductor" in times else float("nan")
            row += f"{ratio_eager:12.2f}{ratio_inductor:15.2f}{bytes_moved / times['kiln'] / 1e9:11.1f}{first['kiln']:11.2f}"
        print(row)
    print("kiln compiler stats:", kiln._C.compiler_stats())


if __name__ == "__main__":
    main()
