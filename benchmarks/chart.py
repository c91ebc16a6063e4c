"""Draws seed_models.py's chart from the JSON lines it printed (a saved log), without running anything.

Usage: python benchmarks/chart.py LOG [LOG ...] -o seed_models.png [--title TEXT]

Lines of the logs that are not seed_models.py rows (other output, error rows, rows without `ms`) are skipped. Two
panels: (a) speed against eager per model and system (eager's ms over the system's; eager = 1.0), (b) the first call
per model and system, seconds on a log scale. seed_models.py --chart and demo.py draw through `draw` here.
Needs matplotlib; without it `draw` prints one line and returns False.
"""
import argparse
import json
import os
import sys

# Fixed colours for the usual systems, so every chart reads the same; others take the next free colour.
COLOURS = {"eager": "#9e9e9e", "inductor": "#4c72b0", "kiln": "#dd8452", "kiln-ca": "#c44e52", "kiln-ea": "#8172b3",
           "clone": "#55a868"}
SPARE_COLOURS = ["#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"]
LABELS = {"inductor": "torch.compile"}


def read_rows(lines):
    """The seed_models.py rows among `lines`: JSON objects with a model, a system and ms."""
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "model" in row and "system" in row and "ms" in row and "error" not in row:
            rows.append(row)
    return rows


def _in_order(values):
    seen = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen


def draw(rows, path, title=None):
    """Writes the two-panel chart of `rows` (seed_models.py's JSON rows) to `path` and prints one line saying where.
    Returns False, after printing one line, when matplotlib is missing or no row has times; never raises for that."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        print(f"chart: matplotlib is not installed, {path} not drawn (pip install matplotlib)", flush=True)
        return False
    rows = [row for row in rows if row.get("ms")]
    if not rows:
        print(f"chart: no rows with times, {path} not drawn", flush=True)
        return False
    models = _in_order(row["model"] for row in rows)
    systems = _in_order(row["system"] for row in rows)
    if "eager" in systems:  # eager first: the reference bar
        systems.insert(0, systems.pop(systems.index("eager")))
    by_key = {(row["model"], row["system"]): row for row in rows}
    spare = iter(SPARE_COLOURS * 4)
    colours = {system: COLOURS.get(system) or next(spare) for system in systems}

    width = 0.8 / len(systems)
    tallest, slowest, longest = 1.0, 1.0, 0.0  # for the axes' ranges: room above the bars for their value labels
    fig, (speed_ax, first_ax) = plt.subplots(2, 1, figsize=(max(7.0, 0.75 * len(models) + 2.5), 7.5))
    for i, system in enumerate(systems):
        offset = (i - (len(systems) - 1) / 2) * width
        speeds, first_calls = [], []
        for m, model in enumerate(models):
            row = by_key.get((model, system))
            eager = by_key.get((model, "eager"))
            if row and eager:
                speeds.append((m + offset, eager["ms"] / row["ms"]))
            if row and row.get("first_call_s"):
                first_calls.append((m + offset, row["first_call_s"]))
        label = LABELS.get(system, system)
        if speeds:
            bars = speed_ax.bar([x for x, _ in speeds], [v for _, v in speeds], width, label=label, color=colours[system])
            if system != "eager":
                speed_ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in speeds], fontsize=6, rotation=90, padding=2)
        if first_calls:
            bars = first_ax.bar([x for x, _ in first_calls], [v for _, v in first_calls], width, label=label,
                                color=colours[system])
            first_ax.bar_label(bars, labels=[f"{v:.3g}" for _, v in first_calls], fontsize=6, rotation=90, padding=2)
        tallest = max([tallest] + [v for _, v in speeds])
        slowest = min([slowest] + [v for _, v in speeds])
        longest = max([longest] + [v for _, v in first_calls])
    speed_ax.axhline(1.0, color="black", linewidth=0.6)
    # Linear unless the ratios span more than 10x (a 2-core machine's pointwise row), where the small ones would vanish.
    wide = tallest / slowest > 10
    if wide:
        speed_ax.set_yscale("log", base=2)
        speed_ax.set_ylim(slowest / 1.5, tallest * 2.5)
    else:
        speed_ax.set_ylim(0, tallest * 1.25)
    speed_ax.set_ylabel("speed vs eager" + (", log scale" if wide else "") + "\n(eager ms / system ms; higher is faster)")
    speed_ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
    speed_ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    speed_ax.set_title("(a) speed against eager (eager = 1.0)", fontsize=10, loc="left")
    first_ax.set_yscale("log")
    if longest:
        first_ax.set_ylim(top=longest * 6)
    first_ax.set_ylabel("first call, s (log scale)")
    first_ax.set_title("(b) first call: trace, compile and run (lower is better)", fontsize=10, loc="left")
    for ax in (speed_ax, first_ax):
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", linewidth=0.3, alpha=0.6)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, ncol=len(systems), loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"chart written to {path}", flush=True)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="files holding seed_models.py's output ('-': standard input)")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    lines = []
    for log in args.logs:
        if log == "-":
            lines += sys.stdin.read().splitlines()
        else:
            with open(log) as f:
                lines += f.read().splitlines()
    return 0 if draw(read_rows(lines), args.output, args.title) else 1


if __name__ == "__main__":
    sys.exit(main())
