"""kiln from two source trees side by side on the seed rows: is a change (a refactor) neutral for speed?

    python3 benchmarks/compare_trees.py --before OLD_TREE --after . [--rounds 2] [--models a,b] [--device cuda]

Each tree must be built already (its python/kiln holds the extension modules: `scripts/setup.sh` in it). Runs this
tree's seed_models.py with `--systems eager,kiln --cold` once per tree and round, alternating the trees (before,
after, after, before, ...) so that a slow stretch of the machine falls on both, each in a new process importing kiln
from that tree. Prints one JSON line per run and row, then a table: per row the median kiln ms of each tree, their
ratio (before / after: >1 means the after tree is faster), and eager's ms as the machine's yardstick.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tree, args):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "python"))
    cmd = [sys.executable, os.path.join(HERE, "seed_models.py"), "--systems", "eager,kiln", "--cold",
           "--device", args.device, "--models", args.models, "--iters", str(args.iters)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            row["tree"] = tree
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=".")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--models", default="mlp,convrelu,pointwise,transformer6,transformer6_train,resnet18_train,"
                                        "resnet50,resnet50_train,bert,bert_train,vit,vit_train")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        order = (args.before, args.after) if r % 2 == 0 else (args.after, args.before)
        for tree in order:
            rows += run(tree, args)
    print(f"| row | kiln before ms | kiln after ms | before / after | eager ms | kiln first call before s | after s |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        def median(tree, system, key):
            values = [row[key] for row in rows
                      if row.get("model") == model and row.get("tree") == tree and row.get("system") == system
                      and key in row]
            return statistics.median(values) if values else float("nan")
        before, after = median(args.before, "kiln", "ms"), median(args.after, "kiln", "ms")
        eager = statistics.median([median(t, "eager", "ms") for t in (args.before, args.after)])
        print(f"| {model} | {before:.4f} | {after:.4f} | {before / after:.3f}x | {eager:.4f} | "
              f"{median(args.before, 'kiln', 'first_call_s'):.3f} | {median(args.after, 'kiln', 'first_call_s'):.3f} |")


if __name__ == "__main__":
    main()
