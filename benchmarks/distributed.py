"""Distributed training side by side (issue #31): eager, torch.compile and kiln under DDP and FSDP2 on 2 ranks.

    python3 benchmarks/distributed.py [--device cuda|cpu] [--workloads ddp_transformer6,ddp_resnet50,fsdp_gpt]
        [--systems eager,inductor,kiln] [--amp fp32,bf16] [--steps 20] [--profile] [--quick] [--json PATH]

The launcher starts 2 ranks of this script the way torchrun does (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK), NCCL on CUDA (one GPU per rank) and gloo on the CPU. Each rank runs every (workload, amp, system) in
turn from the same initial weights and per-rank data; rank 0 reports:
- first_step_s: the first training step, compile included;
- step_ms: the median of the other steps, each synchronised;
- peak_mb (CUDA): torch.cuda.max_memory_allocated over the steps;
- loss_max_dev: the largest difference of its losses from eager's, step by step (same amp);
- with --profile (CUDA): over two steady steps, the NCCL kernels' time and how much of it ran while a compute kernel
  of the same rank ran too (overlap_ms): gradient communication overlapping the backward; and gpu_busy_ms, the time
  per step during which any kernel ran (a step much longer than it waits on the host); --profile-table N also prints
  rank 0's N ops with the most self CUDA time and self CPU time.

Workloads:
- ddp_transformer6: the seed transformer6 (6 blocks, d 512, batch 32 x 128) under DistributedDataParallel, SGD;
- ddp_resnet50: resnet50 (torchvision's, or the same architecture built by benchmarks/dynamic_shapes.py), batch 32
  at 224x224, under DDP, SGD;
- fsdp_gpt: a GPT-style decoder of about 1.2B parameters (24 layers, d 2048, 16 heads, vocabulary 32000, batch 2 x
  1024 tokens) under FSDP2 (fully_shard per layer and on the root), AdamW; with --amp bf16 a MixedPrecisionPolicy
  (bfloat16 parameters, float32 reductions) instead of autocast.
--amp bf16 runs the DDP workloads under torch.autocast(bfloat16). --quick: tiny models and 4 steps, for a 2-core CPU.
"""
import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.append(os.path.join(REPO_ROOT, "python"))  # after PYTHONPATH and an installed kiln
import seed_models  # noqa: E402

WORLD_SIZE = 2
ALL_WORKLOADS = "ddp_transformer6,ddp_resnet50,fsdp_gpt"


class GPTLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, vocab, context):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.ModuleList(GPTLayer(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(workload, quick):
    """(model, make_batch(generator) -> (inputs, targets), loss(out, targets), optimizer kind)."""
    torch.manual_seed(0)
    if workload == "ddp_transformer6":
        d, blocks, shape = (64, 2, (4, 16)) if quick else (512, 6, (32, 128))
        model = nn.Sequential(*[seed_models.TransformerBlock(d, 4 if quick else 8, 2 * d if quick else 2048)
                                for _ in range(blocks)])
        return model, lambda g: (torch.randn(*shape, d, generator=g), None), \
            lambda out, _: out.float().pow(2).mean(), "sgd"
    if workload == "ddp_resnet50":
        import dynamic_shapes
        if quick:
            model, shape = dynamic_shapes.ResNet((1, 1, 1, 1), width=8, classes=10), (2, 3, 32, 32)
        else:
            try:
                import torchvision
                model = torchvision.models.resnet50()
            except ImportError:
                model = dynamic_shapes.resnet50()
            shape = (32, 3, 224, 224)
        return model, lambda g: (torch.randn(*shape, generator=g), None), \
            lambda out, _: out.float().pow(2).mean(), "sgd"
    if workload == "fsdp_gpt":
        layers, d, heads, vocab, batch, tokens = (2, 64, 4, 256, 2, 32) if quick else (24, 2048, 16, 32000, 2, 1024)
        model = GPT(layers, d, heads, vocab, tokens)
        return model, lambda g: ((ids := torch.randint(0, vocab, (batch, tokens + 1), generator=g))[:, :-1], ids[:, 1:]), \
            lambda out, target: F.cross_entropy(out.float().flatten(0, 1), target.flatten()), "adamw"
    raise SystemExit(f"unknown workload {workload!r} (known: {ALL_WORKLOADS})")


def wrap(workload, model, amp, device):
    import torch.distributed as dist
    if workload.startswith("ddp_"):
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp == "bf16" \
        else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overlap_of(prof):
    """(NCCL kernel ms, ms of it during which a compute kernel ran too) from a profile's CUDA kernels."""
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    compute = sorted((s, t) for s, t, nccl in kernels if not nccl)
    total = overlapped = 0.0
    for s, t, nccl in kernels:
        if not nccl:
            continue
        total += t - s
        for cs, ct in compute:
            if cs >= t:
                break
            overlapped += max(0.0, min(t, ct) - max(s, cs))
    return total / 1e3, overlapped / 1e3


def busy_of(prof):
    """Milliseconds during which at least one CUDA kernel ran (the union of their intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    total, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            total += t - s
            end = t
        elif t > end:
            total += t - end
            end = t
    return total / 1e3


def run_one(workload, system, amp, args, device):
    import torch.distributed as dist
    model, make_batch, loss_of, opt_kind = build(workload, args.quick)
    model = wrap(workload, model.to(device), amp, device)
    fn = seed_models.compile_with(system, model, None)  # eager, inductor (torch.compile) or kiln
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3) if opt_kind == "sgd" else torch.optim.AdamW(params, lr=1e-4)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) \
        if amp == "bf16" and workload.startswith("ddp_") else contextlib.nullcontext
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = [tuple(t.to(device) if t is not None else None for t in make_batch(g)) for _ in range(args.steps)]

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of(fn(inputs), targets)
        loss.backward()
        opt.step()
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for i, (inputs, targets) in enumerate(batches):
        sync(device)
        start = time.perf_counter()
        loss = step(inputs, targets)
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if i == 0:
            dist.barrier()  # compiles finish on every rank before the steady steps are timed
    row = {"workload": workload, "system": system, "amp": amp, "first_step_s": round(times[0], 3),
           "step_ms": round(sorted(times[1:])[len(times[1:]) // 2] * 1e3, 3), "losses": losses}
    if device.type == "cuda":
        row["peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.profile_table else [])
            with profile(activities=activities) as prof:
                for inputs, targets in batches[-2:]:
                    step(inputs, targets)
                sync(device)
            row["nccl_ms"], row["overlap_ms"] = (round(v, 3) for v in overlap_of(prof))
            row["gpu_busy_ms"] = round(busy_of(prof) / 2, 3)  # per step: time some kernel ran
            if args.profile_table and dist.get_rank() == 0:
                for key in ("self_cuda_time_total", "self_cpu_time_total"):
                    print(f"--- {workload} {amp} {system}: two steps by {key}\n"
                          + prof.key_averages().table(sort_by=key, row_limit=args.profile_table), file=sys.stderr)
    return row


def rank_main(args):
    import torch.distributed as dist
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rows = []
    for workload in args.workloads.split(","):
        for amp in args.amp.split(","):
            for system in args.systems.split(","):
                try:
                    row = run_one(workload, system, amp, args, device)
                except Exception as e:  # noqa: BLE001  (one failing system must not hide the others' rows)
                    row = {"workload": workload, "system": system, "amp": amp, "error": f"{type(e).__name__}: {e}"[:500]}
                rows.append(row)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def launch(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as rows_file:
        procs = []
        for rank in range(WORLD_SIZE):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD_SIZE))
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if args.device == "cpu":
                env.setdefault("OMP_NUM_THREADS", "1")
            cmd = [sys.executable, os.path.abspath(__file__), "--rank-worker", rows_file.name,
                   "--device", args.device, "--workloads", args.workloads, "--systems", args.systems,
                   "--amp", args.amp, "--steps", str(args.steps)] + (["--quick"] if args.quick else []) + \
                (["--profile"] if args.profile else []) + \
                (["--profile-table", str(args.profile_table)] if args.profile_table else [])
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        rows = json.load(open(rows_file.name))
    eager = {(r["workload"], r["amp"]): r["losses"] for r in rows if r["system"] == "eager" and "losses" in r}
    for r in rows:
        base = eager.get((r["workload"], r["amp"]))
        if base and "losses" in r:
            r["loss_max_dev"] = max(abs(a - b) for a, b in zip(r["losses"], base))
        print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    print("\n| workload | amp | system | first step s | step ms | vs the faster of eager and torch.compile | peak MB "
          "| loss dev | overlap ms / NCCL ms |")
    print("|---" * 9 + "|")
    for r in rows:
        others = [o["step_ms"] for o in rows if o["workload"] == r["workload"] and o["amp"] == r["amp"]
                  and o["system"] != "kiln" and "step_ms" in o]
        ratio = f"{min(others) / r['step_ms']:.3f}x" if r["system"] == "kiln" and others and "step_ms" in r else "-"
        overlap = f"{r['overlap_ms']} / {r['nccl_ms']}" if "nccl_ms" in r else "-"
        dev = f"{r['loss_max_dev']:.1e}" if "loss_max_dev" in r else "-"
        print(f"| {r['workload']} | {r['amp']} | {r['system']} | {r.get('first_step_s', '-')} | "
              f"{r.get('step_ms', r.get('error', '-'))} | {ratio} | {r.get('peak_mb', '-')} | {dev} | {overlap} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "argv": sys.argv[1:], "rows": rows}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default=ALL_WORKLOADS)
    ap.add_argument("--systems", default="eager,inductor,kiln")
    ap.add_argument("--amp", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=None, help="training steps per system (default 20, --quick 4)")
    ap.add_argument("--profile", action="store_true", help="CUDA: NCCL kernels overlapping compute kernels")
    ap.add_argument("--profile-table", type=int, default=0, metavar="N",
                    help="with --profile, rank 0 prints the N ops with the most self CUDA time and self CPU time")
    ap.add_argument("--quick", action="store_true", help="tiny models, for a 2-core CPU")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--rank-worker", dest="rows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.steps = args.steps or (4 if args.quick else 20)
    if args.rows:
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
