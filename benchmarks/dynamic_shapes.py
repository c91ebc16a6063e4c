"""Dynamic shapes (issue #25): eager, torch.compile and kiln over many input sizes, side by side in one process.

    python3 benchmarks/dynamic_shapes.py [--device cuda|cpu] [--workloads transformer,bert,gpt2,train,resnet50,warm_process]
        [--systems eager,inductor,inductor_dynamic,kiln,kiln_dynamic,kiln_static] [--iters 10] [--quick]
        [--recompile-limit N] [--isolate] [--json PATH]

Systems: eager; inductor / inductor_dynamic: torch.compile(dynamic=None / True); kiln / kiln_dynamic:
kiln.compile(dynamic=None / True); kiln_static: kiln.compile(dynamic=False) with kiln.config.recompile_limit raised
to the number of sizes, a reference row for the sweep workloads only (transformer, resnet50): the steady time of
one static graph per size, which the issue asks kiln's dynamic graphs to come within 5% of.
Every system starts from empty caches: KILN_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into a new
folder per system, after torch._dynamo.reset() and kiln.reset(). kiln's in-process library cache survives
kiln.reset(), so a kiln system may reuse kernels an earlier one compiled (`memory_hits` in its row); --isolate runs
each system in a process of its own instead.
Per (workload, system) one JSON line: compiles, the first pass's seconds (every call of the workload once, cold,
synchronised), the steady pass's ms per call or step (sweeps: the mean over sizes of each size's median of --iters
calls; bert, gpt2 and train: the median of a second pass over the same calls, with its mean and total), max abs error
against eager (training: outputs and the loss of every step), calls that ran eagerly past the recompile limit,
kiln's fallbacks; then a table per workload.
--quick: tiny models and 3 sizes, for a 2-core CPU. Needs transformers for bert and gpt2; without torchvision resnet50 is
built here (torchvision's architecture).
"""
import argparse
import copy
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.append(os.path.join(REPO_ROOT, "python"))  # after PYTHONPATH and an installed kiln
import seed_models  # noqa: E402  (TransformerBlock, transformer6, use_empty_caches)

ALL_SYSTEMS = "eager,inductor,inductor_dynamic,kiln,kiln_dynamic,kiln_static"
ALL_WORKLOADS = "transformer,bert,gpt2,train,resnet50,warm_process"
# system -> (compiler, dynamic=)
SYSTEMS = {"eager": (None, None), "inductor": ("torch", None), "inductor_dynamic": ("torch", True),
           "kiln": ("kiln", None), "kiln_dynamic": ("kiln", True), "kiln_static": ("kiln", False)}
TRANSFORMER_LENGTHS = [37, 45, 57, 71, 89, 107, 131, 157, 185, 213, 249, 289, 333, 385, 445, 511]  # none a multiple of 8
RESNET_BATCHES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


# ---- resnet50 without torchvision (torchvision's architecture: bottlenecks, stride on the 3x3 convolution) ----

class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, n in enumerate(layers):
            for j in range(n):
                blocks.append(Bottleneck(cin, width * 2**i, 2 if i > 0 and j == 0 else 1))
                cin = width * 2**i * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def resnet50():
    try:
        import torchvision.models as tvm  # what seed_models.make("resnet50") builds
        return tvm.resnet50()
    except ImportError:
        return ResNet()


# ---- workloads: a model and its calls, the same for every system ----

class Workload:
    def __init__(self, name, model, calls, train=False, sweep=False):
        self.name, self.model, self.train, self.sweep = name, model, train, sweep
        self.calls = calls  # [(size label, args, kwargs)]; sweep: one call per distinct size


def build(name, dev, quick):
    torch.manual_seed(0)
    rng = random.Random(0)
    if name == "transformer":
        d, heads, ff, batch = (64, 4, 128, 2) if quick else (512, 8, 2048, 8)
        model = nn.Sequential(*[seed_models.TransformerBlock(d, heads, ff) for _ in range(2)])
        lengths = [37, 53, 77] if quick else TRANSFORMER_LENGTHS
        return Workload(name, model, [(n, (torch.randn(batch, n, d),), {}) for n in lengths], sweep=True)
    if name == "resnet50":
        model = ResNet((1, 1, 1, 1), width=8, classes=10) if quick else resnet50()
        side = 32 if quick else 224
        batches = [1, 3, 5] if quick else RESNET_BATCHES
        return Workload(name, model, [(b, (torch.randn(b, 3, side, side),), {}) for b in batches], sweep=True)
    if name == "bert":
        from transformers import BertConfig, BertModel
        config = (BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             vocab_size=1000) if quick else BertConfig())
        model = BertModel(config)
        model.config.return_dict = False
        if quick:
            pool = [rng.randint(16, 64) for _ in range(3)]
            lengths = [rng.choice(pool) for _ in range(6)]
        else:
            lengths = [rng.randint(16, 512) for _ in range(100)]
        calls = [(n, (), dict(input_ids=torch.randint(0, config.vocab_size, (8, n)),
                              attention_mask=torch.ones(8, n, dtype=torch.long))) for n in lengths]
        return Workload(name, model, calls)
    if name == "gpt2":
        # GPT-2 small's language-model head (transformers' Conv1D layers build their output shapes from
        # `x.size()[:-1] + (nf,)`), batch 8, lengths drawn from 16..512, without the key/value cache.
        from transformers import GPT2Config, GPT2LMHeadModel
        config = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0,
                             eos_token_id=0) if quick else GPT2Config())
        model = GPT2LMHeadModel(config)
        lengths = [rng.randint(16, 64) for _ in range(6)] if quick else [rng.randint(16, 512) for _ in range(60)]
        calls = [(n, (), dict(input_ids=torch.randint(0, config.vocab_size, (8, n)), use_cache=False))
                 for n in lengths]
        return Workload(name, model, calls)
    if name == "train":
        if quick:
            model = nn.Sequential(*[seed_models.TransformerBlock(64, 4, 128) for _ in range(6)])
            pool, d, batch = [rng.randint(16, 64) for _ in range(3)], 64, 2
            lengths = [rng.choice(pool) for _ in range(6)]
        else:
            model, _, _ = seed_models.make("transformer6_train", dev)
            d, batch = 512, 32 if dev == "cuda" else 8
            lengths = [rng.randint(64, 256) for _ in range(50)]
        return Workload(name, model, [(n, (torch.randn(batch, n, d),), {}) for n in lengths], train=True)
    raise SystemExit(f"unknown workload {name!r} (known: {ALL_WORKLOADS})")


def to_device(workload, dev):
    workload.model = workload.model.to(dev)
    moved = lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v  # noqa: E731  (use_cache=False stays)
    workload.calls = [(size, tuple(moved(a) for a in args), {k: moved(v) for k, v in kwargs.items()})
                      for size, args, kwargs in workload.calls]
    return workload


# ---- running one system ----

def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    for name in ("last_hidden_state", "logits"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out


def compile_with(system, model, limit):
    compiler, dynamic = SYSTEMS[system]
    if compiler is None:
        return model
    if compiler == "torch":
        return torch.compile(model, dynamic=dynamic)
    import kiln
    if limit:
        kiln.config.recompile_limit = limit
    return kiln.compile(model, dynamic=dynamic)


def counters(system):
    """Cumulative counters this system's compiles move (differences are taken around the run)."""
    compiler = SYSTEMS[system][0]
    if compiler == "torch":
        from torch._dynamo.utils import counters as dynamo
        return {"unique_graphs": dynamo["stats"]["unique_graphs"], "frames_ok": dynamo["frames"]["ok"]}
    if compiler == "kiln":
        import kiln
        backend = kiln._C.compiler_stats()
        found = {k: v for k, v in kiln.stats().items() if isinstance(v, int)}
        found.update({k: backend[k] for k in ("graphs_compiled", "kernels_compiled", "memory_hits", "graph_cache_hits")})
        return found
    return {}


def reset_compilers():
    torch._dynamo.reset()
    clear = getattr(sys.modules.get("torch._inductor.utils"), "clear_caches", None)
    if clear:  # Inductor's in-memory caches (loaded modules, kernels)
        clear()
    if "kiln" in sys.modules:
        sys.modules["kiln"].reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ran_eagerly(system, before):
    """A kiln call that neither compiled nor hit a cache entry ran eagerly (past the recompile limit)."""
    if SYSTEMS[system][0] != "kiln":
        return False
    import kiln
    now = kiln.stats()
    return now["frames_compiled"] == before["frames_compiled"] and now["cache_hits"] == before["cache_hits"]


def kiln_stats_or_empty(system):
    return sys.modules["kiln"].stats() if SYSTEMS[system][0] == "kiln" else None


def median(values):
    return sorted(values)[len(values) // 2]


def steady_pass(row, times):
    """A second pass over the workload's calls: the median call (robust to a slow moment of a shared machine), the mean
    and the whole pass."""
    row["steady_ms"] = round(median(times), 4)
    row["steady_mean_ms"] = round(sum(times) / len(times), 4)
    row["steady_pass_s"] = round(sum(times) / 1e3, 4)


def run_inference(system, wl, dev, iters, limit, row):
    fn = compile_with(system, copy.deepcopy(wl.model).eval(), limit)
    eager_calls = 0
    with torch.no_grad():
        start = time.perf_counter()
        for _, args, kwargs in wl.calls:
            before = kiln_stats_or_empty(system)
            fn(*args, **kwargs)
            sync(dev)
            eager_calls += ran_eagerly(system, before)
        row["first_pass_s"] = round(time.perf_counter() - start, 3)
        after_first = counters(system)
        per_size = {}
        for _ in range(iters if wl.sweep else 1):  # sweep: every size `iters` times, round robin; else the calls once
            for size, args, kwargs in wl.calls:
                start = time.perf_counter()
                fn(*args, **kwargs)
                sync(dev)
                per_size.setdefault(size, []).append((time.perf_counter() - start) * 1e3)
        if wl.sweep:  # the mean over sizes of each size's median
            medians = {size: median(t) for size, t in per_size.items()}
            row["per_size_ms"] = {str(size): round(ms, 4) for size, ms in medians.items()}
            row["steady_ms"] = round(sum(medians.values()) / len(medians), 4)
            row["steady_pass_s"] = round(sum(medians.values()) / 1e3, 4)
        else:
            steady_pass(row, [ms for t in per_size.values() for ms in t])
        err = 0.0
        for _, args, kwargs in wl.calls:  # untimed: each output against the eager model's
            got, want = first_tensor(fn(*args, **kwargs)), first_tensor(wl.model.eval()(*args, **kwargs))
            err = max(err, float((got.float() - want.float()).abs().max()))
        row["max_err"] = err
    row["eager_calls"] = eager_calls
    return after_first


def run_training(system, wl, dev, limit, row, reference):
    model = copy.deepcopy(wl.model).train()
    fn = compile_with(system, model, limit)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(args):
        optimizer.zero_grad(set_to_none=True)
        out = first_tensor(fn(*args))
        loss = out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        return out.detach(), loss.detach()

    outputs, losses, eager_calls = [], [], 0
    start = time.perf_counter()
    for _, args, _ in wl.calls:
        before = kiln_stats_or_empty(system)
        out, loss = step(args)
        sync(dev)
        outputs.append(out)
        losses.append(loss)
        eager_calls += ran_eagerly(system, before)
    row["first_pass_s"] = round(time.perf_counter() - start, 3)
    after_first = counters(system)
    times = []
    for _, args, _ in wl.calls:  # the same lengths again, training on
        start = time.perf_counter()
        _, loss = step(args)
        sync(dev)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss)
    steady_pass(row, times)
    losses = [float(v) for v in losses]
    row["loss_first"], row["loss_last"] = round(losses[0], 6), round(losses[-1], 6)
    row["eager_calls"] = eager_calls
    if reference is not None:  # every step's output and loss against eager's, from the same weights and data
        ref_outputs, ref_losses = reference
        row["max_err"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs, ref_outputs))
        row["loss_max_dev"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        row["loss_max_rel_dev"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    return after_first, (outputs, losses)


def measure(system, wl, dev, iters, limit, reference=None):
    """One row: the system's compile counters, first and steady pass, errors; an error row if anything raises."""
    row = {"workload": wl.name, "system": system, "device": dev, "calls": len(wl.calls)}
    seed_models.use_empty_caches()
    reset_compilers()
    saved_limit, saved_torch_limit = None, getattr(torch._dynamo.config, "recompile_limit", None)
    trace = None
    try:
        if SYSTEMS[system][0] == "kiln":
            import kiln
            saved_limit = kiln.config.recompile_limit
            if system == "kiln_static":  # one static graph per size: none may run eagerly
                limit = max(limit or saved_limit, len({size for size, _, _ in wl.calls}) + 1)
            limit = limit or saved_limit
        elif limit and SYSTEMS[system][0] == "torch":
            torch._dynamo.config.recompile_limit = limit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = counters(system)
            if wl.train:
                after, trace = run_training(system, wl, dev, limit, row, reference)
            else:
                after = run_inference(system, wl, dev, iters, limit, row)
        moved = {k: v - before.get(k, 0) for k, v in after.items()}
        if SYSTEMS[system][0] == "kiln":
            row["compiles"] = moved["frames_compiled"]
            for key in ("recompiles", "dynamic_specialisations", "fallbacks", "graph_breaks", "graphs_compiled",
                        "kernels_compiled", "memory_hits"):
                if key in moved:
                    row[key] = moved[key]
        elif SYSTEMS[system][0] == "torch":
            row["compiles"], row["frames_compiled"] = moved["unique_graphs"], moved["frames_ok"]
        notes = sorted({str(w.message).splitlines()[0][:160] for w in caught if "kiln" in str(w.message)[:40]})
        if notes:
            row["kiln_warnings"] = notes
    except Exception as e:  # one failing system must not hide the others
        row["error"] = repr(e)[:300]
    finally:
        if saved_limit is not None:
            sys.modules["kiln"].config.recompile_limit = saved_limit
        if saved_torch_limit is not None:
            torch._dynamo.config.recompile_limit = saved_torch_limit
        reset_compilers()
    return row, trace


def last_line(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


# ---- warm_process: a new process, the disk cache filled by another, a length never seen ----

WARM_CHILD = r"""
import json, os, sys, time, torch
sys.path.insert(0, {here!r})
import dynamic_shapes as ds
wl = ds.to_device(ds.build("transformer", {dev!r}, {quick!r}), {dev!r})
model = wl.model.eval()
batch, _, d = wl.calls[0][1][0].shape
probe = torch.randn(batch, {probe_len}, d, device={dev!r})
with torch.no_grad():
    model(probe); ds.sync({dev!r})  # torch's own lazy set-up (cuBLAS, cuDNN) is no system's first call
    fn = ds.compile_with({system!r}, model, None)
    before = ds.counters({system!r})
    row = {{}}
    if {phase!r} == "fill":  # the workload's sizes, cold: the disk cache the probe reads
        start = time.perf_counter()
        for _, args, _ in wl.calls:
            fn(*args); ds.sync({dev!r})
        row["fill_s"] = time.perf_counter() - start
    else:
        start = time.perf_counter(); fn(probe); ds.sync({dev!r}); row["first_call_s"] = time.perf_counter() - start
        start = time.perf_counter(); fn(probe); ds.sync({dev!r}); row["second_call_s"] = time.perf_counter() - start
    row["counters"] = {{k: v - before.get(k, 0) for k, v in ds.counters({system!r}).items()}}
    if {dev!r} == "cuda" and "kiln" in {system!r}:
        import kiln
        row["nvrtc_compiled"] = kiln._C.cuda.program_cache_stats().get("compiled", 0)
print(json.dumps(row))
"""


def warm_process(system, dev, quick):
    """Two new processes share fresh caches: the first runs the transformer workload's sizes, the second one length
    neither has seen. Its compiles: kiln's graphs not read from the disk cache (graphs_compiled - graph_cache_hits),
    torch.compile's Dynamo graphs."""
    probe_len = 45 if quick else 301
    row = {"workload": "warm_process", "system": system, "device": dev, "probe_length": probe_len}
    with tempfile.TemporaryDirectory(prefix="dynamic_shapes_warm_") as cache:
        # One job (torch.compiler.config.job_id): both systems keep their automatic-dynamic profile across its
        # processes only within a job, so the probe starts with the dims the fill process found dynamic.
        env = dict(os.environ, KILN_CACHE_DIR=os.path.join(cache, "kiln"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TORCH_COMPILE_JOB_ID="dynamic_shapes_warm_process")
        got = {}
        for phase in ("fill", "probe"):
            code = WARM_CHILD.format(here=HERE, dev=dev, quick=quick, probe_len=probe_len, system=system, phase=phase)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=580)
            if out.returncode != 0:
                row["error"] = f"{phase} process: " + last_line(out.stderr)
                return row
            got[phase] = json.loads(out.stdout.strip().splitlines()[-1])
    moved = got["probe"]["counters"]
    if "graphs_compiled" in moved:
        row["compiles"] = moved["graphs_compiled"] - moved["graph_cache_hits"]
        row.update({k: moved[k] for k in ("frames_compiled", "graph_cache_hits", "kernels_compiled") if k in moved})
        if "nvrtc_compiled" in got["probe"]:
            row["nvrtc_compiled"] = got["probe"]["nvrtc_compiled"]
    else:
        row["compiles"] = moved.get("unique_graphs", 0)
    row["fill_s"] = round(got["fill"]["fill_s"], 3)
    row["fill_compiles"] = got["fill"]["counters"].get("frames_compiled", got["fill"]["counters"].get("unique_graphs"))
    row["first_call_s"] = round(got["probe"]["first_call_s"], 3)
    row["second_call_s"] = round(got["probe"]["second_call_s"], 4)
    return row


# ---- --isolate: each system in a process of its own ----

def isolated(system, workload, args):
    with tempfile.NamedTemporaryFile(suffix=".json") as rows:
        cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--workloads", workload, "--systems",
               system, "--iters", str(args.iters), "--json", rows.name] + (["--quick"] if args.quick else [])
        if args.recompile_limit:
            cmd += ["--recompile-limit", str(args.recompile_limit)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            return [{"workload": workload, "system": system, "error": last_line(out.stderr)}]
        return json.load(open(rows.name))["rows"]


# ---- the tables ----

def cell(row, key, fmt="{}"):
    return fmt.format(row[key]) if key in row else "-"


def print_table(name, rows):
    rows = [r for r in rows if r["workload"] == name]
    if not rows:
        return
    print(f"\n{name}")
    if name == "warm_process":
        print("| system | fill s (its compiles) | probe compiles | probe first call s | second call s | notes |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            notes = r.get("error", f"kernels compiled {r['kernels_compiled']}" if "kernels_compiled" in r else "")
            print(f"| {r['system']} | {cell(r, 'fill_s')} ({cell(r, 'fill_compiles')}) | {cell(r, 'compiles')} | "
                  f"{cell(r, 'first_call_s')} | {cell(r, 'second_call_s')} | {notes} |")
        return
    unit = "ms/step" if any("loss_last" in r for r in rows) else "ms/call"
    others = [r["steady_ms"] for r in rows if SYSTEMS.get(r["system"], ("kiln",))[0] != "kiln" and "steady_ms" in r]
    static = next((r["steady_ms"] for r in rows if r["system"] == "kiln_static" and "steady_ms" in r), None)
    print(f"| system | compiles | first pass s | steady {unit} | steady pass s | max err | kiln vs the faster | "
          f"vs kiln_static | eager calls | notes |")
    print("|---" * 10 + "|")
    for r in rows:
        kiln_row = r["system"].startswith("kiln") and "steady_ms" in r
        ratio = f"{min(others) / r['steady_ms']:.3f}x" if kiln_row and others else "-"
        vs_static = f"{r['steady_ms'] / static:.3f}" if kiln_row and static and r["system"] != "kiln_static" else "-"
        err = f"{r['max_err']:.2e}" if "max_err" in r else "-"
        if "loss_max_dev" in r:
            err += f" (loss {r['loss_max_dev']:.1e})"
        notes = [r["error"]] if "error" in r else []
        if r["system"] == "kiln_static":
            notes.append("reference: one static graph per size")
        notes += [f"{k} {r[k]}" for k in ("recompiles", "dynamic_specialisations", "fallbacks", "memory_hits") if r.get(k)]
        if any("recompile limit" in w for w in r.get("kiln_warnings", [])):
            notes.append("recompile limit reached")
        if any("does not compile symbolic sizes" in w for w in r.get("kiln_warnings", [])):
            notes.append("kiln warns: dynamic=True still specialises")
        print(f"| {r['system']} | {cell(r, 'compiles')} | {cell(r, 'first_pass_s')} | {cell(r, 'steady_ms')} | "
              f"{cell(r, 'steady_pass_s')} | {err} | {ratio} | {vs_static} | {cell(r, 'eager_calls')} | "
              f"{'; '.join(notes)} |")
    sized = [r for r in rows if "per_size_ms" in r]
    if sized:
        print(f"\n{name}: steady ms per size")
        print("| size | " + " | ".join(r["system"] for r in sized) + " |")
        print("|---" * (len(sized) + 1) + "|")
        for size in sized[0]["per_size_ms"]:
            print(f"| {size} | " + " | ".join(str(r["per_size_ms"].get(size, "-")) for r in sized) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--systems", default=ALL_SYSTEMS)
    ap.add_argument("--workloads", default=ALL_WORKLOADS)
    ap.add_argument("--iters", type=int, default=None,
                    help="sweep workloads: timed calls per size in the steady pass, median per size (default 10, "
                         "--quick 5)")
    ap.add_argument("--quick", action="store_true", help="tiny models and 3 sizes (a 2-core CPU: under a minute each)")
    ap.add_argument("--recompile-limit", type=int, default=None,
                    help="kiln.config.recompile_limit and torch._dynamo.config.recompile_limit (default: theirs, 8)")
    ap.add_argument("--isolate", action="store_true",
                    help="each (workload, system) in a new process: no kernel compiled by another system is reused")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every row to PATH as one JSON document")
    args = ap.parse_args()
    args.iters = args.iters or (5 if args.quick else 10)
    systems = args.systems.split(",")
    for system in systems:
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r} (known: {ALL_SYSTEMS})")
    dev = args.device
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name in args.workloads.split(","):
        if name == "warm_process":
            for system in systems:
                if system not in ("eager", "kiln_static"):
                    emit(warm_process(system, dev, args.quick))
            continue
        if args.isolate:
            for system in systems:
                for row in isolated(system, name, args):
                    emit(row)
            continue
        try:
            wl = to_device(build(name, dev, args.quick), dev)
            _, warm_args, warm_kwargs = wl.calls[0]
            with torch.no_grad():
                wl.model.eval()(*warm_args, **warm_kwargs)  # torch's lazy set-up is no system's first pass
            sync(dev)
        except Exception as e:  # a missing package (transformers)
            emit({"workload": name, "system": "-", "error": repr(e)[:300]})
            continue
        reference = None
        if wl.train:  # eager's outputs and losses, step by step, for every system to be compared with
            row, reference = measure("eager", wl, dev, args.iters, args.recompile_limit)
            if "eager" in systems:
                emit(row)
        for system in systems:
            if (system == "eager" and wl.train) or (system == "kiln_static" and not wl.sweep):
                continue
            emit(measure(system, wl, dev, args.iters, args.recompile_limit, reference)[0])
        del wl, reference
        reset_compilers()
    for name in args.workloads.split(","):
        print_table(name, rows)
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads",
                "torch": torch.__version__, "argv": sys.argv[1:]}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
