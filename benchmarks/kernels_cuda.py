"""kiln's generated CUDA kernels (kiln.compile, default backend) against eager and torch.compile, side by side:
the kernel kinds the CUDA code generator emits, with a copy_ of the pointwise case's bytes as the bandwidth limit.

    python benchmarks/kernels_cuda.py [--repeats 50] [--no-inductor]

Median of CUDA-event timings per call after a warm-up (the whole call: Python, guards, launch), ratios are
speed-ups of kiln (the other's time / kiln's time). Each kiln result is checked against eager first.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))
sys.path.insert(0, HERE)
from micro_cuda import median_ms  # noqa: E402  (CUDA-event timing, shared with the hand-written kernel's benchmark)


def cases():
    big = torch.randn(64 * 1024 * 1024, device="cuda")
    rows = torch.randn(4096, 1024, device="cuda")
    short_rows = torch.randn(32 * 8 * 128, 128, device="cuda")
    w, b = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    half_rows = rows.half()
    return [
        ("relu((x+1)*2), 64M f32", lambda x: torch.relu((x + 1) * 2), big),
        ("softmax 4096x1024 f32", lambda x: torch.softmax(x, -1), rows),
        ("softmax 32768x128 f32 (attention rows)", lambda x: torch.softmax(x, -1), short_rows),
        ("layer_norm 4096x1024 f32", lambda x: F.layer_norm(x, (1024,), w, b), rows),
        ("layer_norm 4096x1024 f16", lambda x: F.layer_norm(x, (1024,), w.half(), b.half()), half_rows),
        ("x.sum(-1) 4096x1024 f32", lambda x: x.sum(-1), rows),
        ("gelu(x) * y 4096x1024 f32", lambda x: F.gelu(x) * x.flip(0), rows),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_cuda.py needs a CUDA device")
    import kiln
    big = cases()[0][2]
    copy_target = torch.empty_like(big)
    copy_ms = median_ms(lambda: copy_target.copy_(big), args.repeats)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  median of {args.repeats}")
    print(f"copy_ of 64M f32 (256 MiB each way): {copy_ms:.3f} ms, {2 * big.numel() * 4 / copy_ms / 1e9:.2f} TB/s")
    print(f"| case | eager ms | torch.compile ms | kiln ms | kiln vs eager | kiln vs torch.compile | kiln kernels |")
    print(f"|---|---|---|---|---|---|---|")
    for name, fn, x in cases():
        compiled = kiln.compile(fn)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), fn(x), rtol=2e-3, atol=2e-3)
        eager_ms = median_ms(lambda: fn(x), args.repeats)
        kiln_ms = median_ms(lambda: compiled(x), args.repeats)
        inductor = "-"
        vs_inductor = "-"
        if not args.no_inductor:
            tc = torch.compile(fn)
            tc(x)
            tc_ms = median_ms(lambda: tc(x), args.repeats)
            inductor = f"{tc_ms:.3f}"
            vs_inductor = f"{tc_ms / kiln_ms:.2f}x"
        print(f"| {name} | {eager_ms:.3f} | {inductor} | {kiln_ms:.3f} | {eager_ms / kiln_ms:.2f}x | {vs_inductor} | "
              f"{kiln._C.compiler_stats().get('graphs_compiled', '?')} graphs so far |", flush=True)


if __name__ == "__main__":
    main()
