"""benchmarks/chart.py: seed_models.py's rows read back from a saved log and drawn, or skipped with one line when
matplotlib is missing. The chart's numbers are the benchmark's; only that they are read and drawn is checked here."""
import json
import os
import sys

import pytest

import chart  # benchmarks/, put on sys.path by conftest.py

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")

LOG = [
    "[setup] done",
    json.dumps({"model": "mlp", "system": "eager", "ms": 0.2, "first_call_s": 0.01}),
    json.dumps({"model": "mlp", "system": "kiln", "ms": 0.1, "first_call_s": 0.08, "speedup_vs_eager": 2.0}),
    json.dumps({"model": "bert", "error": "ModuleNotFoundError('transformers')"}),
    json.dumps({"model": "pointwise", "system": "inductor", "error": "RuntimeError('x')"}),
    "{not json",
]


def test_rows_are_read_from_a_log_and_the_rest_skipped():
    rows = chart.read_rows(LOG)
    assert [(row["model"], row["system"]) for row in rows] == [("mlp", "eager"), ("mlp", "kiln")]


def test_a_png_is_drawn_and_its_path_printed(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "chart.png"
    assert chart.draw(chart.read_rows(LOG), str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"chart written to {path}\n"


def test_without_matplotlib_one_line_and_no_chart(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "chart.png"
    assert chart.draw(chart.read_rows(LOG), str(path)) is False
    assert not path.exists()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "matplotlib is not installed" in out, out


def test_the_committed_h100_rows_are_docs_results_tables():
    # every time in docs/seed_models_h100.jsonl is the cell of its model's row in docs/results.md
    with open(os.path.join(DOCS, "seed_models_h100.jsonl")) as f:
        rows = chart.read_rows(f)
    with open(os.path.join(DOCS, "results.md")) as f:
        tables = {}
        for line in f:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if line.startswith("| ") and cells[0] not in tables:  # the first table that has the model
                tables[cells[0]] = cells
    redraw = "docs/results.md's H100 seed-model tables changed: write their rows to docs/seed_models_h100.jsonl and " \
             "draw docs/seed_models_h100.png again (the command is under those tables)"
    assert len(rows) == 36
    column = {"eager": 1, "inductor": 2, "kiln": 3}
    for row in rows:
        cells = tables[row["model"]]
        assert float(cells[column[row["system"]]]) == row["ms"], (row, redraw)
        if row["system"] != "eager":
            assert float(cells[column[row["system"]] + 3]) == row["first_call_s"], (row, redraw)
