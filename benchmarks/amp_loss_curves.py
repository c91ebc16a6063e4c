"""Loss curves under mixed precision (issue #30): eager, kiln (and torch.compile) trained side by side.

Usage: PYTHONPATH=python python3 amp_loss_curves.py [--models transformer6_train,resnet50_train,bert_train]
       [--amp bf16,fp16] [--systems eager,kiln,inductor] [--steps 50] [--device cuda|cpu] [--batch N] [--lr 1e-4]
       [--no-dropout]
Each model comes from seed_models.make (seed 0); for each amp dtype every system trains a deep copy of it on the
same input (on the CPU its first 4 samples unless --batch says otherwise: float16 matmuls are slow there) with
AdamW, one seed_models.step_fn step at a time: forward and seed_models.training_loss under torch.autocast, backward
and optimizer step outside it; fp16 steps go through torch.amp.GradScaler (scale(loss).backward(), step, update).
The random generator is seeded the same way before each system's steps (dropout masks).
Prints one JSON line per (model, amp, system): the loss of every step, for fp16 the scale after every step and the
skipped steps (those whose gradients overflowed: the scale dropped), against eager's curve the largest relative
deviation (and whether the scales are eager's), for kiln the graphs that ran on its eager interpreter; then a table.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_models  # noqa: E402

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def train_curve(system, base, x, amp, args):
    """args.steps steps of `system` from a copy of `base`: the row's measurements."""
    model = copy.deepcopy(base).train()
    if args.no_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    kiln = None
    if system.startswith("kiln"):
        import kiln
        kiln._C.reset_compiler_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(args.device) if amp == "fp16" else None
    step = seed_models.step_fn(seed_models.compile_with(system, model, "default"), opt, True, AMP_DTYPES[amp], scaler)
    scales = [scaler.get_scale()] if scaler is not None else []  # the initial scale, then one after every step
    losses, seconds = [], []
    torch.manual_seed(1)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = step(x)
        losses.append(float(seed_models.training_loss(out.detach())))  # synchronises, so the time is the step's
        seconds.append(time.perf_counter() - t0)
        if scaler is not None:
            scales.append(scaler.get_scale())
    row = {"losses": [float(f"{loss:.7g}") for loss in losses], "final_loss": losses[-1],
           "first_step_s": round(seconds[0], 3)}
    if len(seconds) > 1:
        row["step_ms"] = round(sorted(seconds[1:])[(len(seconds) - 1) // 2] * 1e3, 2)
    if scaler is not None:
        row["scales"] = scales[1:]
        row["skipped_steps"] = sum(after < before for before, after in zip(scales, scales[1:]))
    if kiln is not None:  # graphs kiln cannot differentiate run on its eager interpreter, op by op as eager runs them
        stats = kiln._C.compiler_stats()
        row["graphs_compiled"], row["graphs_fallback"] = stats["graphs_compiled"], stats["graphs_fallback"]
        if stats["graphs_fallback"]:
            row["fallback_reason"] = stats["last_fallback_reason"][:200]
    return row


def compare_with_eager(row, eager):
    if "losses" not in row or "losses" not in eager:
        return
    row["max_rel_dev"] = max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(row["losses"], eager["losses"]))
    if "scales" in row:
        row["scales_match"] = row["scales"] == eager["scales"]


def print_table(rows):
    columns = ("model", "amp", "system", "max_rel_dev", "final_loss", "skipped_steps", "scales_match",
               "graphs_fallback", "error")
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column, "")
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value)[:80])
        print("| " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="transformer6_train,resnet50_train,bert_train")
    ap.add_argument("--amp", default="bf16,fp16")
    ap.add_argument("--systems", default="eager,kiln", help="eager is always run first: the reference curve")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=None,
                    help="the first N samples of seed_models' input (default: 4 on the CPU, all of them on CUDA)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-dropout", action="store_true",
                    help="p=0 in every nn.Dropout (bert_train's are 0.1): kiln runs attention with dropout on its "
                         "eager interpreter on the CPU")
    args = ap.parse_args()
    seed_models.DEVICE[0] = args.device  # the autocast device of seed_models.step_fn
    systems = ["eager"] + [s for s in args.systems.split(",") if s != "eager"]
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name in args.models.split(","):
        try:
            torch.manual_seed(0)
            base, x, _ = seed_models.make(name, args.device)
            batch = args.batch or (4 if args.device == "cpu" else None)
            base, x = base.to(args.device), x[:batch].to(args.device)
        except Exception as e:  # a model whose package is missing
            emit({"model": name, "error": repr(e)[:200]})
            continue
        for amp in args.amp.split(","):
            eager = None
            for system in systems:
                row = {"model": name, "amp": amp, "system": system, "device": args.device, "batch": x.shape[0],
                       "steps": args.steps}
                try:
                    row.update(train_curve(system, base, x, amp, args))
                except Exception as e:  # e.g. an autocast dtype or GradScaler the device does not support
                    row["error"] = repr(e)[:300]
                if eager is None:
                    eager = row
                else:
                    compare_with_eager(row, eager)
                emit(row)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    print_table(rows)


if __name__ == "__main__":
    main()
