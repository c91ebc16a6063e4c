"""Per-call overhead of a cache hit: eager vs torch.compile (inductor) vs kiln, side by side.

    python benchmarks/overhead.py [--device cpu|cuda] [--calls 200] [--repeats 50]

Cases: the seed MLP (batch 32, under torch.no_grad) and f(x) = x + 1 on 8 floats. Each system is
warmed up (compiled) first; then `repeats` batches of `calls` back-to-back calls are timed and the
median per-call time is reported, in microseconds, with ratios to eager. If kiln._C exposes
guard_benchmark(compiled_fn_or_module, *args, iterations) -> total seconds for `iterations` guard
evaluations of its cache entry, a column shows guard time alone.
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
# Run from a source checkout: the kiln package next to this folder (python/kiln, with the
# extension modules a development build writes there) comes before any installed one.
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))


def add_one(x):
    return x + 1


def make_cases(device):
    sys.path.insert(0, HERE)
    import seed_models
    torch.manual_seed(0)
    mlp = seed_models.MLP().to(device).eval()
    return {
        "seed MLP, batch 32, no_grad": (mlp, torch.randn(32, 100, device=device)),
        "x + 1 on 8 floats": (add_one, torch.randn(8, device=device)),
    }


def compile_for(system, fn):
    """The callable to time, or raises if the system cannot compile fn."""
    if system == "eager":
        return fn
    if system == "torch.compile":
        return torch.compile(fn)
    import kiln
    return kiln.compile(fn)


def per_call_us(fn, x, device, calls, repeats):
    """Median over `repeats` of the mean time of `calls` back-to-back calls (timer cost amortised)."""
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        if device == "cuda":
            torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / calls)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def guard_us(compiled, x, iterations):
    """Guard evaluation alone, when kiln exposes a way to time it; else None. Takes the compiled
    object: a compiled module's frames see the wrapper (not the original) as `self`."""
    try:
        from kiln import _C
    except ImportError:
        return None
    benchmark = getattr(_C, "guard_benchmark", None)
    if benchmark is None:
        return None
    with torch.no_grad():
        compiled(x)  # make sure the entry exists
        return benchmark(compiled, x, iterations) / iterations * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    systems = ["eager", "torch.compile", "kiln"]
    rows = []
    for case, (fn, x) in make_cases(args.device).items():
        row = {"case": case}
        for system in systems:
            try:
                compiled = compile_for(system, fn)
                row[system] = per_call_us(compiled, x, args.device, args.calls, args.repeats)
            except Exception as error:  # a system that fails is shown as such, the others still run
                row[system] = None
                row[system + " error"] = f"{type(error).__name__}: {error}".splitlines()[0][:120]
                continue
            if system == "kiln":
                try:
                    row["guards"] = guard_us(compiled, x, 100000)
                except Exception as error:
                    row["guards"] = None
                    row["guards error"] = f"{type(error).__name__}: {error}".splitlines()[0][:120]
        rows.append(row)

    def us(value):
        return "-" if value is None else f"{value:.2f}"

    def ratio(value, eager):
        return "-" if value is None or not eager else f"{value / eager:.2f}x"

    header = ["case", "eager us", "torch.compile us", "(vs eager)", "kiln us", "(vs eager)",
              "kiln/torch.compile", "kiln guards us"]
    table = []
    for row in rows:
        eager, inductor, kiln_us = row.get("eager"), row.get("torch.compile"), row.get("kiln")
        table.append([row["case"], us(eager), us(inductor), ratio(inductor, eager), us(kiln_us), ratio(kiln_us, eager),
                      "-" if kiln_us is None or not inductor else f"{kiln_us / inductor:.2f}x", us(row.get("guards"))])
    if all(row.get("guards") is None for row in rows):  # guard_benchmark not exposed: no column
        header.pop()
        table = [cells[:-1] for cells in table]
    widths = [max(len(h), *(len(cells[i]) for cells in table)) for i, h in enumerate(header)]
    print(f"per-call time of a cache hit on {args.device}, median of {args.repeats} x {args.calls} calls "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads); ratios: time / eager's time")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for cells in table:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
    for row in rows:
        for key, value in row.items():
            if key.endswith(" error"):
                print(f"{row['case']}: {key}: {value}")


if __name__ == "__main__":
    main()
