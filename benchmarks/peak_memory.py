"""What is alive at a training step's peak of CUDA memory, eager against kiln.

    python benchmarks/peak_memory.py --models resnet18_train,bert_train [--systems eager,kiln] [--top 25]

For each system: three warm-up steps, then one step with torch's allocator history recorded. The history is
replayed to find the moment of the step's highest allocated total; the tensors allocated during the step and
still alive then are grouped by size (with the Python line that allocated the first of each group), and
printed beside the memory that was already allocated when the step began (parameters, gradients, optimizer
state), and the blocks still allocated after the step (what the next step starts with) are counted by size. Tensor sizes identify the activations (batch x channels x ...), so the two lists show what one system
keeps that the other does not.
"""
import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_models  # noqa: E402


def _frame_text(frames):
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "peak_memory.py" not in name:
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(trace):
    """(peak bytes above the step's start, {addr: (size, frames)} alive then, events before the peak)."""
    live, current, peak, peak_live, peak_index = {}, 0, 0, {}, 0
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []), i)
            current += event["size"]
            if current > peak:
                peak, peak_live, peak_index = current, dict(live), i
        elif action == "free_requested":
            entry = live.pop(event["addr"], None)
            if entry is not None:
                current -= entry[0]
    return peak, peak_live, peak_index


def rounding_by_owner(snapshot, model, opt):
    """Blocks held after the step, by owner (parameters, their gradients, optimizer state, the rest): the bytes
    the tensors asked for and the bytes of the blocks that hold them. max_memory_allocated counts blocks, so a
    tensor placed in a larger free block that could not be split counts the whole block."""
    owners = {}
    for p in model.parameters():
        owners[p.untyped_storage().data_ptr()] = "param"
        if p.grad is not None:
            owners[p.grad.untyped_storage().data_ptr()] = "grad"
        for value in (opt.state.get(p, {}) if opt is not None else {}).values():
            if torch.is_tensor(value) and value.is_cuda:
                owners[value.untyped_storage().data_ptr()] = "optimizer_state"
    totals = collections.defaultdict(lambda: [0, 0, 0])
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                t = totals[owners.get(address, "other")]
                t[0] += 1
                t[1] += block.get("requested_size", block["size"])
                t[2] += block["size"]
            address += block["size"]
    return {owner: {"blocks": n, "requested_mb": round(req / 2**20, 2), "block_mb": round(size / 2**20, 2),
                    "rounding_mb": round((size - req) / 2**20, 2)}
            for owner, (n, req, size) in sorted(totals.items())}


def measure(name, system, top):
    torch.manual_seed(0)
    seed_models.DEVICE[0] = "cuda"
    model, x, train = seed_models.make(name, "cuda")
    model = model.cuda()
    x = x.cuda()
    model.train(train)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None  # as seed_models.py
    fn = seed_models.step_fn(seed_models.compile_with(system, model, "default"), opt, train)
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    fn(x)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [e for dev in snapshot["device_traces"] for e in dev]
    peak, peak_live, peak_index = live_at_peak(trace)
    groups = collections.defaultdict(lambda: [0, 0, None])
    for size, frames, _ in peak_live.values():
        g = groups[size]
        g[0] += 1
        g[1] += size
        if g[2] is None:
            g[2] = _frame_text(frames)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    print(json.dumps({"model": name, "system": system, "base_mb": round(base / 2**20, 1),
                      "step_peak_above_base_mb": round(peak / 2**20, 1),
                      "max_memory_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                      "events": len(trace), "peak_at_event": peak_index}), flush=True)
    for size, (count, total, where) in rows:
        print(f"   {total / 2**20:9.1f} MB  {count:4d} x {size:>11d} B  {where}")
    # What stays allocated after the step (the next step's base): parameters, optimizer state, and anything a
    # system keeps between steps.
    held = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                held[block["size"]] += 1
    print("   held after the step (block size x count, largest totals first):",
          ", ".join(f"{size}x{count}" for size, count in sorted(held.items(), key=lambda kv: -kv[0] * kv[1])[:24]))
    print("   " + json.dumps(rounding_by_owner(snapshot, model, opt)), flush=True)
    del model, opt, fn
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18_train,bert_train")
    parser.add_argument("--systems", default="eager,kiln")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for name in args.models.split(","):
        for system in args.systems.split(","):
            measure(name, system, args.top)


if __name__ == "__main__":
    main()
