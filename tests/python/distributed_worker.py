"""One rank of tests/python/test_distributed.py, started the way torchrun starts a rank.

The environment names the rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); argv[1] is a JSON file
this rank writes its results to, argv[2:] the scenarios to run (all of SCENARIOS when none are named). Every
scenario trains a model for STEPS steps eagerly and under kiln from the same initial weights on the same
per-rank batches, and records the losses, the largest difference of the losses and parameters from eager's
(against kiln.testing.tolerance), and kiln's counters (graph breaks, fallbacks, recompiles after the first step).
Collectives go through gloo on the CPU.
"""
import contextlib
import copy
import faulthandler
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.testing import tolerance

STEPS = 5
DIM = 16


class MLP(nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        if unused:
            self.unused = nn.Linear(4, 4)  # never called: DDP's find_unused_parameters must find it

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class Layer(nn.Module):
    """A pre-norm transformer layer: attention (by hand, softmax over scaled scores) and an MLP, both residual."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has a zero gradient: AdamW would step on noise
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Block(nn.Module):
    """Transformer layers and a head on their mean over the sequence."""

    def __init__(self, layers=1):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


class DeepMLP(nn.Module):
    """Five Linear layers, 64 wide: about 140 KB of parameters, four DDP buckets of 0.01 MB (each hidden layer's
    weight alone fills one)."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(DIM, 64)
        self.hidden = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        x = torch.relu(self.fc_in(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.head(x)


MODELS = {"mlp": (MLP, (8, DIM)), "deep_mlp": (DeepMLP, (8, DIM)), "mlp_unused": (lambda: MLP(unused=True), (8, DIM)), "block": (Block, (4, 6, DIM)),
          "stack": (lambda: Block(layers=2), (4, 6, DIM)),
          "sequential": (lambda: nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 4)), (8, DIM))}


def batches(shape, rank, count):
    """Per-rank inputs and targets (ranks differ, so the all-reduces matter)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(*shape, generator=g), torch.randn(shape[0], 4, generator=g)) for _ in range(count)]


def make_model(name):
    torch.manual_seed(0)  # the same initial weights on every rank and for eager and kiln
    return MODELS[name][0]()


def make_optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def mse_of(model):
    # In float32, as mixed-precision training computes its loss: torch 2.11's mse_loss_backward refuses a bfloat16
    # output against a float32 target ("Found dtype Float but expected BFloat16").
    return lambda x, y: F.mse_loss(model(x).float(), y)


def backward_runs():
    return kiln._C.compiler_stats()["autograd_backward_runs"]


def train(model, optimizer, data, accumulate=1, loss_of=mse_of):
    """STEPS optimizer steps; with accumulate > 1, each step runs that many micro-batches, all but the last under
    model.no_sync(). Returns the losses and kiln's counters after the first step. A model with a RecordingHook
    (`_bucket_log`) gets ("backward", compiled backward graphs run so far) logged before each backward."""
    loss_fn = loss_of(model)
    losses, after_first = [], None
    data = iter(data)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = next(data)
            sync = micro == accumulate - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                loss = loss_fn(x, y) / accumulate
                if getattr(model, "_bucket_log", None) is not None:
                    model._bucket_log.append(("backward", backward_runs()))
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        if step == 0:
            after_first = kiln.stats()
    return losses, after_first


def full(tensor):
    """A parameter as one plain tensor (FSDP2's are DTensors sharded over the ranks)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# Scenarios computing in another dtype than float32, compared with that dtype's tolerance.
COMPUTE_DTYPE = {"fsdp2_mixed_precision": torch.bfloat16}


def compare(name, eager_losses, eager_model, kiln_losses, kiln_model):
    rtol, atol = tolerance(COMPUTE_DTYPE.get(name, torch.float32))
    worst, failures = 0.0, []
    pairs = [("loss", torch.tensor(eager_losses), torch.tensor(kiln_losses))]
    eager_params = dict(eager_model.named_parameters())
    for pname, p in kiln_model.named_parameters():
        pairs.append((pname, full(eager_params[pname].detach()), full(p.detach())))
    for what, expected, actual in pairs:
        if expected.numel() == 0:  # an FSDP1 rank's empty shard
            continue
        excess = ((actual - expected).abs() - (atol + rtol * expected.abs())).max().item()
        worst = max(worst, (actual - expected).abs().max().item())
        if excess > 0:
            failures.append(f"{name}: {what} differs from eager by {(actual - expected).abs().max().item():.3g}")
    return worst, failures


def ddp_with(bucket_cap_mb=1, record_buckets=False, **options):
    """DDP with these options; with record_buckets, a communication hook that logs ("bucket", index, compiled backward
    graphs run so far) when each bucket's all-reduce is launched, then all-reduces as DDP's default does."""
    def wrap(model):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **options)
        if record_buckets:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def hook(log, bucket):
                log.append(("bucket", bucket.index(), backward_runs()))
                return default_hooks.allreduce_hook(None, bucket)
            ddp._bucket_log = []
            ddp.register_comm_hook(ddp._bucket_log, hook)
        return ddp
    return wrap


def bucket_timing(log):
    """Per backward in `log` (bucket_log's entries): for each bucket's all-reduce in launch order, how many compiled
    backward graphs of that backward had run when it was launched."""
    steps = []
    for entry in log:
        if entry[0] == "backward":
            steps.append({"start": entry[1], "buckets": []})
        elif steps:
            steps[-1]["buckets"].append(entry[2] - steps[-1]["start"])
    return [s["buckets"] for s in steps]


ddp = ddp_with()


def fully_shard_each(kind):
    """FSDP2 as its users apply it: fully_shard on each module of class `kind`, then on the root."""
    def wrap(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # The ranks train on the CPU over gloo. Without a mesh, fully_shard makes one on CUDA's device type whenever
        # CUDA is available: then a rank whose LOCAL_RANK names no GPU fails while the others wait in new_group.
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, kind):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return wrap


def fsdp1_each(kind):
    """FSDP1 (FullyShardedDataParallel) on the CPU: each module of class `kind` a unit of its own, then the root."""
    def wrap(model):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({kind}), device_id=torch.device("cpu"),
                                        use_orig_params=True)
    return wrap


def fully_shard_mixed(kind):
    """FSDP2 with a mixed-precision policy: bfloat16 parameters in the forward and backward, float32 reductions."""
    def wrap(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, kind):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    return wrap


class CheckpointedBlock(Block):
    """Block with each layer under torch.utils.checkpoint (activation checkpointing)."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x.mean(dim=1))


MODELS["checkpointed"] = (lambda: CheckpointedBlock(layers=2), (4, 6, DIM))


# scenario -> (model, optimizer, how kiln wraps: "outer" = kiln.compile(WRAP(m)), "inner" = WRAP(kiln.compile(m)),
# "step" = a compiled loss function calling WRAP(m); wrapper, micro-batches per step)
SCENARIOS = {
    "ddp_outer_sequential": ("sequential", "sgd", "outer", ddp, 1),
    "ddp_outer_mlp": ("mlp", "sgd", "outer", ddp, 1),
    "ddp_inner_mlp": ("mlp", "adamw", "inner", ddp, 1),
    "ddp_outer_block": ("block", "adamw", "outer", ddp, 1),
    "ddp_inner_block": ("block", "sgd", "inner", ddp, 1),
    "ddp_step_mlp": ("mlp", "sgd", "step", ddp, 1),
    "ddp_no_sync": ("mlp", "sgd", "outer", ddp, 2),
    "ddp_find_unused": ("mlp_unused", "adamw", "outer", ddp_with(find_unused_parameters=True), 2),
    "ddp_static_graph": ("block", "sgd", "inner", ddp_with(static_graph=True), 1),
    "ddp_buckets_outer": ("deep_mlp", "sgd", "outer", ddp_with(bucket_cap_mb=0.01, record_buckets=True), 1),
    "ddp_buckets_inner": ("deep_mlp", "adamw", "inner", ddp_with(bucket_cap_mb=0.01, record_buckets=True), 1),
    "ddp_buckets_stack": ("stack", "adamw", "inner", ddp_with(bucket_cap_mb=0.002), 1),
    "fsdp2_mlp": ("mlp", "adamw", "outer", fully_shard_each(nn.Linear), 1),
    "fsdp2_block": ("block", "sgd", "outer", fully_shard_each(nn.Linear), 1),
    "fsdp2_layers": ("stack", "adamw", "outer", fully_shard_each(Layer), 1),
    "fsdp2_mixed_precision": ("stack", "sgd", "outer", fully_shard_mixed(Layer), 1),
    "fsdp1_layers": ("stack", "adamw", "outer", fsdp1_each(Layer), 1),
    "fsdp1_inner": ("mlp", "sgd", "inner", fsdp1_each(nn.Linear), 1),
    "ddp_checkpointed": ("checkpointed", "adamw", "outer", ddp, 1),
    "fsdp2_checkpointed": ("checkpointed", "sgd", "outer", fully_shard_each(Layer), 1),
}


def run(name):
    model_name, opt, how, wrap, accumulate = SCENARIOS[name]
    data = batches(MODELS[model_name][1], dist.get_rank(), STEPS * accumulate)
    # kiln first: the first scenario then meets what only a process's first DDP or FSDP call runs (lazy
    # initialisation, typing's caches filled), as a user's program does.
    kiln.reset()
    stats_before = kiln._C.compiler_stats()
    loss_of = mse_of
    if how == "outer":
        model = kiln.compile(wrap(make_model(model_name)))
    elif how == "inner":
        model = wrap(kiln.compile(make_model(model_name)))
    else:
        model = wrap(make_model(model_name))
        loss_of = lambda m: kiln.compile(mse_of(m))  # noqa: E731
    losses, after_first = train(model, make_optimizer(opt, model.parameters()), data, accumulate, loss_of)
    after = kiln.stats()
    stats_after = kiln._C.compiler_stats()
    bucket_log = getattr(model, "_bucket_log", None)
    eager = wrap(make_model(model_name))
    eager_losses, _ = train(eager, make_optimizer(opt, eager.parameters()), data, accumulate)
    worst, failures = compare(name, eager_losses, eager, losses, model)
    return {"losses": losses, "eager_losses": eager_losses, "worst_difference": worst, "failures": failures,
            "graph_breaks": after["graph_breaks"], "fallbacks": after["fallbacks"],
            "graphs_on_eager_interpreter": stats_after["graphs_fallback"] - stats_before["graphs_fallback"],
            "graphs_split": stats_after["graphs_split"] - stats_before["graphs_split"],
            "split_pieces": stats_after["split_pieces"] - stats_before["split_pieces"],
            "bucket_timing": bucket_timing(bucket_log) if bucket_log is not None else None,
            "frames_compiled": after["frames_compiled"], "cache_hits": after["cache_hits"],
            "recompiles_after_first_step": after["recompiles"] - after_first["recompiles"],
            "compiled_after_first_step": after["frames_compiled"] - after_first["frames_compiled"]}


def main():
    out_path, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    # A rank that hangs prints every thread's stack and exits before the launcher gives up on it, so the launcher's
    # failure shows where each rank was waiting.
    hang_s = float(os.environ.get("WORKER_TIMEOUT_S", "0"))
    if hang_s > 0:
        faulthandler.dump_traceback_later(hang_s, exit=True)
    print(f"rank {os.environ.get('RANK')}: joining the group", flush=True)
    dist.init_process_group("gloo")
    print(f"rank {os.environ.get('RANK')}: joined", flush=True)
    results = {}
    for name in names:
        print(f"rank {os.environ.get('RANK')}: {name}", flush=True)
        try:
            results[name] = run(name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()
    # Ended without the interpreter's finalization: torch keeps a Python object (autograd's contextvars context,
    # torch/autograd/graph.py) in the thread-local state that every collective launched during a backward captures, as
    # DDP's overlapped all-reduces are. When gloo's worker thread drops the last reference to such a work while the
    # interpreter finalizes, it cannot take the GIL and the process aborts ("terminate called without an active
    # exception"), about once in twenty runs of the bucket scenarios on the development machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
