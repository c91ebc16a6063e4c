"""CPU training step of the seed transformer6 (6 TransformerBlocks, AdamW): eager vs torch.compile vs kiln.

Usage: python benchmarks/train_cpu.py [--batch 4 --seq 32 --d-model 512 --blocks 6] [--systems eager,inductor,kiln]
Prints one JSON line per system: first call seconds (compile + one step), median steady step ms, and the
loss after the timed steps relative to eager's (same initial weights and inputs). torch.compile is skipped
with its error when it fails.
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


def make_step(system, model):
    if system == "eager":
        run = model
    elif system == "inductor":
        run = torch.compile(model)
    elif system == "kiln":
        import kiln
        run = kiln.compile(model)
    else:
        raise SystemExit(f"unknown system {system}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x):
        optimizer.zero_grad(set_to_none=True)
        loss = run(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--systems", default="eager,inductor,kiln")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[seed_models.TransformerBlock(args.d_model, 8, 4 * args.d_model)
                                 for _ in range(args.blocks)])
    x = torch.randn(args.batch, args.seq, args.d_model)
    eager_loss = None
    for system in args.systems.split(","):
        model = copy.deepcopy(base)
        try:
            step = make_step(system, model)
            start = time.perf_counter()
            step(x)
            first = time.perf_counter() - start
            times, loss = [], None
            for _ in range(args.steps):
                start = time.perf_counter()
                loss = step(x)
                times.append((time.perf_counter() - start) * 1e3)
        except Exception as e:  # torch.compile may be unavailable on this machine
            print(json.dumps({"system": system, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        if system == "eager":
            eager_loss = loss
        record = {"system": system, "shape": [args.batch, args.seq, args.d_model], "blocks": args.blocks,
                  "first_call_s": round(first, 3), "step_ms": round(statistics.median(times), 2), "loss": loss}
        if eager_loss is not None:
            record["loss_rel_diff_vs_eager"] = abs(loss - eager_loss) / max(abs(eager_loss), 1e-12)
        if system == "kiln":
            import kiln
            record["kiln_compiler_stats"] = {k: v for k, v in kiln._C.compiler_stats().items()
                                             if k in ("graphs_compiled", "graphs_fallback", "last_fallback_reason")}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
