"""CPU training step of the seed transformer6 (6 TransformerBlocks, AdamW): eager vs torch.compile vs kiln.

Usage: python benchmarks/train_cpu.py [--batch 4 --seq 32 --d-model 512 --blocks 6] [--systems eager,inductor,kiln]
  [--steps 10] [--cold]
  systems: eager, inductor (torch.compile), kiln (compiled autograd, the default: forward and backward graphs
  compiled ahead of time), kiln-eager-autograd (kiln's forward on the eager interpreter with eager's autograd:
  kiln.config.set_compiled_autograd(False)).
Every system gets its own copy of the same initial weights. After each system's first call (compile + one step)
and a few warm-up steps, the timed steps run round-robin, one step of each system in turn, so that load from
other processes on a shared machine falls on all systems alike. Prints one JSON line per system: first call
seconds, median steady step ms and the median of its forward / backward / optimizer phases, the loss after
the timed steps relative to eager's, and the step time relative to eager's. torch.compile is skipped with its
error when it fails.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_models  # noqa: E402  (the copy beside this script)

PHASES = ("forward_ms", "backward_ms", "optimizer_ms", "step_ms")


def make_step(system, model):
    if system == "eager":
        run = model
    elif system == "inductor":
        run = torch.compile(model)
    elif system in ("kiln", "kiln-eager-autograd"):
        import kiln
        run = kiln.compile(model)
    else:
        raise SystemExit(f"unknown system {system}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, times=None):
        if system.startswith("kiln"):
            import kiln  # the switch applies to graphs compiled after it: set it before each system's calls
            kiln.config.set_compiled_autograd(system == "kiln")
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = run(x).float().pow(2).mean()
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        value = loss.item()
        end = time.perf_counter()
        if times is not None:
            for name, seconds in zip(PHASES, (forward_done - start, backward_done - forward_done, end - backward_done,
                                              end - start)):
                times[name].append(seconds * 1e3)
        return value
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", default="eager,inductor,kiln")
    parser.add_argument("--cold", action="store_true", help="first calls with empty kiln, Inductor and Triton caches")
    args = parser.parse_args()
    if args.cold:
        seed_models.use_empty_caches()
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[seed_models.TransformerBlock(args.d_model, 8, 4 * args.d_model)
                                 for _ in range(args.blocks)])
    x = torch.randn(args.batch, args.seq, args.d_model)
    steps, first_call = {}, {}
    for system in args.systems.split(","):
        try:
            step = make_step(system, copy.deepcopy(base))
            start = time.perf_counter()
            step(x)
            first_call[system] = time.perf_counter() - start
            for _ in range(args.warmup):
                step(x)
        except Exception as e:  # torch.compile may be unavailable on this machine
            print(json.dumps({"system": system, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        steps[system] = step
    times = {system: {name: [] for name in PHASES} for system in steps}
    losses = {}
    for _ in range(args.steps):
        for system, step in steps.items():
            losses[system] = step(x, times[system])
    eager_ms = statistics.median(times["eager"]["step_ms"]) if "eager" in times else None
    for system in steps:
        record = {"system": system, "shape": [args.batch, args.seq, args.d_model], "blocks": args.blocks,
                  "first_call_s": round(first_call[system], 3)}
        record.update({name: round(statistics.median(times[system][name]), 2) for name in PHASES})
        record["loss"] = losses[system]
        if "eager" in losses:
            record["loss_rel_diff_vs_eager"] = abs(losses[system] - losses["eager"]) / max(abs(losses["eager"]), 1e-12)
            record["speed_vs_eager"] = round(eager_ms / record["step_ms"], 3)
        if system.startswith("kiln"):
            import kiln
            record["kiln_compiler_stats"] = {k: v for k, v in kiln._C.compiler_stats().items()
                                             if k in ("graphs_compiled", "graphs_autograd", "graphs_fallback",
                                                      "last_fallback_reason")}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
