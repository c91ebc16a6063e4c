"""kiln demo: the seed models, eager vs kiln, in one table.

    python benchmarks/demo.py [--device cpu|cuda] [--models mlp,convrelu,pointwise,transformer6,resnet_small]
                              [--chart build/demo/seed_models.png]

For each model (inference, torch.no_grad): the first kiln call's seconds (trace + compile + run),
the max abs error against eager and whether it is within kiln.testing's tolerance, the median ms per
call of eager and of kiln and their ratio, then kiln.stats(). Exits 1 if any model failed or differed.
The table is also drawn as a chart (benchmarks/chart.py; needs matplotlib), by default to
build/demo/seed_models.png (ignored by git), with its rows as seed_models.py's JSON lines beside it
(seed_models.jsonl, for chart.py); --chart '' draws none.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
# Run from a source checkout: the kiln package next to this folder (python/kiln, with the
# extension modules a development build writes there) comes before any installed one.
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))


def _import_seed_models():
    """The seed models: ../shared/bench/seed_models.py beside the repo when there, else the copy here."""
    shared = os.path.join(os.path.dirname(REPO_ROOT), "shared", "bench")
    for folder in (shared, HERE):
        if os.path.exists(os.path.join(folder, "seed_models.py")):
            sys.path.insert(0, folder)
            try:
                import seed_models
            finally:
                sys.path.remove(folder)
            return seed_models
    raise SystemExit("seed_models.py not found in ../shared/bench or benchmarks/")


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the (projected when the shape changes) input, then relu."""

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style net small enough for CPU tests: stem, two residual blocks, pool, classifier.

    BatchNorm running statistics start random rather than 0/1, so in eval mode the normalisation
    actually changes values and a compiler that drops it cannot pass a comparison.
    """

    def __init__(self, width=16, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = BasicBlock(width, width)
        self.block2 = BasicBlock(width, 2 * width, stride=2)
        self.head = nn.Linear(2 * width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                with torch.no_grad():
                    module.running_mean.normal_(0, 0.1)
                    module.running_var.uniform_(0.5, 1.5)
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.normal_(0, 0.1)

    def forward(self, x):
        x = self.block2(self.block1(self.stem(x)))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.head(x)


def make_models(device):
    """{name: (model, input)}: CPU-sized inputs on CPU, the seed documents' sizes on CUDA."""
    seeds = _import_seed_models()
    on_gpu = device == "cuda"
    models = {}
    for name in ("mlp", "convrelu", "pointwise"):
        model, example, _ = seeds.make(name, device)
        models[name] = (model, example)
    transformer = nn.Sequential(*[seeds.TransformerBlock() for _ in range(6)])
    models["transformer6"] = (transformer, torch.randn((32, 128, 512) if on_gpu else (4, 32, 512)))
    models["resnet_small"] = (SmallResNet(), torch.randn((32, 3, 64, 64) if on_gpu else (8, 3, 32, 32)))
    return {name: (model.to(device).eval(), example.to(device)) for name, (model, example) in models.items()}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms_side_by_side(fns, example, device, min_seconds=0.5, min_rounds=5, max_rounds=200):
    """Median wall time of one call of each fn, in ms. Calls alternate between the fns round by round,
    so a busy machine slows them alike rather than whichever happened to run during the noise."""
    for fn in fns:
        for _ in range(2):
            fn(example)
    sync(device)
    times = [[] for _ in fns]
    started = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - started < min_seconds):
        for fn, samples in zip(fns, times):
            t0 = time.perf_counter()
            fn(example)
            sync(device)
            samples.append(time.perf_counter() - t0)
        rounds += 1
    return [sorted(samples)[len(samples) // 2] * 1e3 for samples in times]


def run_model(kiln, name, model, example, device):
    """One row of the table: compile, compare with eager, time both."""
    from kiln.testing import tolerance
    row = {"model": name}
    reference = copy.deepcopy(model)
    with torch.no_grad():
        expected = reference(example)
        try:
            compiled = kiln.compile(model)
            t0 = time.perf_counter()
            actual = compiled(example)
            sync(device)
            row["first_call_s"] = time.perf_counter() - t0
            error = (actual.double() - expected.double()).abs().max().item()
            rtol, atol = tolerance(expected.dtype)
            row["max_abs_err"] = error
            row["matches"] = bool(torch.allclose(actual, expected, rtol=rtol, atol=atol))
            row["eager_ms"], row["kiln_ms"] = median_ms_side_by_side([reference, compiled], example, device)
            row["speedup"] = row["eager_ms"] / row["kiln_ms"]
        except Exception as error:  # the demo shows every model, failures included
            row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:160]
    return row


def format_table(rows):
    columns = [("model", "{}"), ("first_call_s", "{:.3f}"), ("max_abs_err", "{:.2e}"), ("matches", "{}"),
               ("eager_ms", "{:.3f}"), ("kiln_ms", "{:.3f}"), ("speedup", "{:.2f}x")]
    header = ["model", "first call s", "max abs err", "matches", "eager ms", "kiln ms", "eager/kiln"]
    body = []
    for row in rows:
        cells = [fmt.format(row[key]) if key in row else "-" for key, fmt in columns]
        body.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    for row, cells in zip(rows, body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
        if "error" in row:
            lines.append(f"    error: {row['error']}")
    return "\n".join(lines)


def save_chart(rows, path, device):
    """The table as seed_models.py's JSON rows (eager and kiln ms, kiln's first call) in a .jsonl file beside `path`,
    drawn by benchmarks/chart.py to `path`; without matplotlib one line says so and only the rows are saved."""
    import chart
    seed_rows = []
    for row in rows:
        if "kiln_ms" not in row:
            continue
        common = {"model": row["model"], "device": device, "train": False}
        seed_rows.append({**common, "system": "eager", "ms": round(row["eager_ms"], 4)})
        seed_rows.append({**common, "system": "kiln", "first_call_s": round(row["first_call_s"], 3),
                          "ms": round(row["kiln_ms"], 4), "max_err": row["max_abs_err"],
                          "speedup_vs_eager": round(row["speedup"], 3)})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.splitext(path)[0] + ".jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in seed_rows)
    machine = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    chart.draw(seed_rows, path, f"kiln demo: {machine}, torch {torch.__version__}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="mlp,convrelu,pointwise,transformer6,resnet_small")
    parser.add_argument("--chart", default=os.path.join(REPO_ROOT, "build", "demo", "seed_models.png"), metavar="PATH",
                        help="the PNG chart of the table (default: build/demo/seed_models.png; '' for none)")
    args = parser.parse_args()
    import kiln

    torch.manual_seed(0)
    models = make_models(args.device)
    unknown = [name for name in args.models.split(",") if name not in models]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(models)}")
    print(f"kiln demo on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} threads)", flush=True)
    rows = []
    for name in args.models.split(","):
        model, example = models[name]
        row = run_model(kiln, name, model, example, args.device)
        print(f"  {name}: {'error' if 'error' in row else 'done'}", flush=True)
        rows.append(row)
    print()
    print(format_table(rows))
    print()
    print("kiln.stats():", kiln.stats())
    if args.chart:
        save_chart(rows, args.chart, args.device)
    ok = all(row.get("matches") for row in rows)
    print("all models match eager" if ok else "SOME MODELS FAILED OR DIFFER FROM EAGER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
