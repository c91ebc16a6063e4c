"""Export side by side: kiln.export + save + kiln.load in a new process, against AOTInductor's package
(torch.export + aoti_compile_and_package, aoti_load_package in a new process), and kiln.compile's steady speed.

Usage: python3 benchmarks/export_models.py [--models resnet50,bert,transformer6] [--device cuda] [--iters 50]
       [--systems kiln,aoti] [--cpp PATH]    # PATH: the built examples/export_cpp program, timed on each kiln file

Prints one JSON line per (model, system):
- kiln: compile_ms (kiln.compile's steady ms per call, this process), export_save_s (kiln.export + save, empty
  cache), load_s / first_call_s / steady_ms / max_err (a new process: kiln.load, its first call, then the median of
  --iters calls; max_err against the original model's output), file_mb; with --cpp, cpp_load_ms / cpp_first_ms /
  cpp_steady_ms from the C++ program.
- aoti: export_save_s (torch.export + aoti_compile_and_package), load_s / first_call_s / steady_ms / max_err in a
  new process.
Every cache (kiln's, Inductor's, Triton's) starts empty, in a temporary folder removed at exit.
"""
import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_models  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a new process: load a saved program, call it once, then time it; print one JSON line.
_CHILD = r"""
import json, sys, time, torch
kind, path, inputs_path, device, iters = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
saved = torch.load(inputs_path)
x, expected = saved["x"].to(device), saved["out"].to(device)
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
start = time.perf_counter()
if kind == "kiln":
    import kiln
    program = kiln.load(path)
else:
    import torch._inductor
    program = torch._inductor.aoti_load_package(path)
sync()
load_s = time.perf_counter() - start
start = time.perf_counter()
with torch.no_grad():
    out = program(x)
    sync()
    first_call_s = time.perf_counter() - start
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        program(x)
        sync()
        times.append(time.perf_counter() - t)
while isinstance(out, (tuple, list)):
    out = out[0]
times.sort()
print(json.dumps({"load_s": round(load_s, 3), "first_call_s": round(first_call_s, 3),
                  "steady_ms": round(times[len(times) // 2] * 1e3, 4),
                  "max_err": float((out.float() - expected.float()).abs().max())}))
"""


def child(kind, path, inputs_path, device, iters, env):
    result = subprocess.run([sys.executable, "-c", _CHILD, kind, path, inputs_path, device, str(iters)],
                            capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"error": f"exit {result.returncode}: " + (result.stderr or result.stdout or "no output")[-2000:]}
    return json.loads(lines[-1])


def cpp_timing(program, path, device):
    result = subprocess.run([program, path, "--iterations", "50"], capture_output=True, text=True, timeout=900)
    text = result.stdout
    grab = lambda pattern: float(m.group(1)) if (m := re.search(pattern, text)) else None  # noqa: E731
    return {"cpp_load_ms": grab(r"loaded .* in ([0-9.]+) ms"), "cpp_first_ms": grab(r"first call: ([0-9.]+) ms"),
            "cpp_steady_ms": grab(r"steady: median ([0-9.]+) ms"),
            "cpp_backend": (m.group(1) if (m := re.search(r"backend (\S+)", text)) else None)}


def steady_ms(fn, x, device, iters):
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(x)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert,transformer6")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--systems", default="kiln,aoti")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cpp", default=None, help="the built examples/export_cpp program")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="export_models_")
    try:
        env = dict(os.environ)
        for var, sub in (("KILN_CACHE_DIR", "kiln"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("TRITON_CACHE_DIR", "triton")):
            env[var] = os.environ[var] = os.path.join(work, sub)
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python"), env.get("PYTHONPATH", "")])
        import kiln
        seed_models.DEVICE[0] = args.device
        for name in args.models.split(","):
            torch.manual_seed(0)
            model, x, _ = seed_models.make(name, args.device)
            model, x = model.to(args.device).eval(), x.to(args.device)
            with torch.no_grad():
                out = seed_models.first(model(x))
            inputs_path = os.path.join(work, f"{name}_inputs.pt")
            torch.save({"x": x.cpu(), "out": out.cpu()}, inputs_path)
            for system in args.systems.split(","):
                row = {"model": name, "system": system, "device": args.device}
                path = os.path.join(work, f"{name}.{'kiln' if system == 'kiln' else 'pt2'}")
                if system == "kiln":
                    compiled = kiln.compile(model)
                    row["compile_ms"] = round(steady_ms(lambda t: compiled(t), x, args.device, args.iters), 4)
                    kiln.reset()
                    shutil.rmtree(os.environ["KILN_CACHE_DIR"], ignore_errors=True)
                    start = time.perf_counter()
                    kiln.export(model, (x,)).save(path)
                    row["export_save_s"] = round(time.perf_counter() - start, 3)
                    shutil.rmtree(os.environ["KILN_CACHE_DIR"], ignore_errors=True)  # the file alone carries the code
                else:
                    inductor = importlib.import_module("torch._inductor")
                    start = time.perf_counter()
                    exported = torch.export.export(model, (x,))
                    inductor.aoti_compile_and_package(exported, package_path=path)
                    row["export_save_s"] = round(time.perf_counter() - start, 3)
                row["file_mb"] = round(os.path.getsize(path) / 2**20, 1)
                row.update(child(system, path, inputs_path, args.device, args.iters, env))
                if system == "kiln" and args.cpp:
                    row.update(cpp_timing(args.cpp, path, args.device))
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
