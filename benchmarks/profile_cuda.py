"""Where a seed model's GPU time goes: the top CUDA kernels per step under each system (torch.profiler).

Usage: python3 benchmarks/profile_cuda.py --models resnet50,bert [--systems eager,inductor,kiln] [--top 15] [--amp bf16]
       [--gaps N]
Prints, per (model, system): kernel launches and summed kernel time per step, then the top kernels by time
(name, launches per step, us per step). Kernel time is GPU busy time; the gap to the step's wall time is
launch overhead and host work. --gaps N adds the GPU's idle time per step (no kernel running, between the first
kernel and the last) and its N longest idle stretches with the kernels around them.
"""
import argparse
import copy
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_models  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--systems", default="eager,inductor,kiln")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--amp", choices=["bf16", "fp16"], default=None)
    ap.add_argument("--gaps", type=int, default=0, help="also list the N longest GPU idle gaps between kernels")
    args = ap.parse_args()
    seed_models.DEVICE[0] = "cuda"
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    for name in args.models.split(","):
        torch.manual_seed(0)
        base, x, train = seed_models.make(name, "cuda")
        base, x = base.cuda(), x.cuda()
        for system in args.systems.split(","):
            model = copy.deepcopy(base)
            model.train() if train else model.eval()
            fn = seed_models.step_fn(seed_models.compile_with(system, model, "default"),
                                     torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None, train, amp)
            for _ in range(3):
                fn(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    fn(x)
                torch.cuda.synchronize()
            kernels = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    k = kernels.setdefault(ev.name, [0, 0.0])
                    k[0] += 1
                    k[1] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            total = sum(v[1] for v in kernels.values()) / args.steps
            launches = sum(v[0] for v in kernels.values()) / args.steps
            row = {"model": name, "system": system, "kernels_per_step": launches, "kernel_us_per_step": round(total, 1)}
            gaps = idle_gaps(prof) if args.gaps else []
            if args.gaps:
                row["idle_us_per_step"] = round(sum(g[0] for g in gaps) / args.steps, 1)
            print(json.dumps(row), flush=True)
            for us, before, after in sorted(gaps, reverse=True)[:args.gaps]:
                print(f"    idle {us:8.1f} us  after {before[:70]}  before {after[:70]}", flush=True)
            for kname, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"    {us / args.steps:9.1f} us  {n / args.steps:6.1f}x  {kname[:150]}", flush=True)
            torch.cuda.empty_cache()


def idle_gaps(prof):
    """(microseconds, kernel before, kernel after) for every stretch in the profiled steps where no kernel ran
    on the GPU, between the first kernel and the last."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    gaps, busy_until, last = [], None, None
    for start, end, kname in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last, kname))
        if busy_until is None or end > busy_until:
            busy_until, last = end, kname
    return gaps


if __name__ == "__main__":
    main()
