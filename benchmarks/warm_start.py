"""First call of a kiln-compiled seed model in a fresh process, with an empty kiln cache (cold) and again
with the cache the first process filled (warm start: no C++ compiler / NVRTC run).

    python benchmarks/warm_start.py [--models resnet50,transformer6] [--device cuda]

Each measurement is its own process (imports and torch's lazy set-up included in neither number: the model
is built and moved to the device, and one eager call made, before the timed kiln call). Prints one JSON line
per model with cold_s, warm_s, the warm process's second call (second_call_s: the model's own time, and
warm_minus_second_s: what the first call added to it) and the kernel caches' counters of the warm process.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)

CHILD = r"""
import sys, time, json
sys.path.insert(0, {here!r})
import torch, seed_models, kiln
model, x, _ = seed_models.make({name!r}, {device!r})
model = model.to({device!r}).eval(); x = x.to({device!r})
with torch.no_grad():
    model(x)  # torch's own lazy set-up (cuDNN/cuBLAS handles) is not kiln's first call
    if {device!r} == "cuda": torch.cuda.synchronize()
    compiled = kiln.compile(model)
    start = time.perf_counter()
    compiled(x)
    if {device!r} == "cuda": torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    compiled(x)  # the same call again: what the model itself takes, so that kiln's part shows
    if {device!r} == "cuda": torch.cuda.synchronize()
    again = time.perf_counter() - start
stats = kiln._C.compiler_stats()
cuda = kiln._C.cuda.program_cache_stats() if {device!r} == "cuda" else {{}}
print(json.dumps({{"seconds": seconds, "again_s": again, "sympy_imported": "sympy" in sys.modules, "cpp_compiled": stats["kernels_compiled"], "cpp_cache_hits": stats["cache_hits"], "graph_cache_hits": stats["graph_cache_hits"],
                  "nvrtc_compiled": cuda.get("compiled", 0), "cubin_cache_hits": cuda.get("disk_hits", 0)}}))
"""


def run(name, device, cache_dir):
    env = dict(os.environ, KILN_CACHE_DIR=cache_dir)
    if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
        env["PYTHONPATH"] = os.path.join(REPO_ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE, name=name, device=device)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,transformer6")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = run(name, args.device, cache_dir)
            warm = run(name, args.device, cache_dir)
        print(json.dumps({"model": name, "device": args.device, "cold_s": round(cold["seconds"], 3),
                          "warm_s": round(warm["seconds"], 3), "second_call_s": round(warm["again_s"], 4),
                          "warm_minus_second_s": round(warm["seconds"] - warm["again_s"], 3),
                          "warm_process": warm}), flush=True)


if __name__ == "__main__":
    main()
