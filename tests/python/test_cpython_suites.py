"""CPython's own regression suites for generators, scopes, exceptions, with-statements, contextlib and grammar,
run from the installed Python with kiln tracing every frame (tests/cpython_suites.py: the standard library and
torch included). Proof that the frame hook, graph breaks and resume functions never change what a program
does. Each suite runs in its own process, as its tests change interpreter-wide state (recursion limits)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SUITES = ["test.test_grammar", "test.test_scope", "test.test_with", "test.test_contextlib", "test.test_generators",
          "test.test_exceptions"]


@pytest.mark.parametrize("suite", SUITES)
def test_cpython_suite_passes_with_every_frame_traced(suite):
    try:
        found = importlib.util.find_spec(suite) is not None
    except ImportError:
        found = False
    if not found:  # some installs leave out Lib/test (the GPU machine's); a copy on PYTHONPATH serves too
        pytest.skip(f"{suite} is not installed with this Python")
    path = [os.path.join(REPO_ROOT, "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-W", "ignore", os.path.join(REPO_ROOT, "tests", "cpython_suites.py"), suite],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    report = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, report
    # the runner's summary line: "<suite>: N run, 0 failed, 0 errors, T s; kiln transformed F frames with B graph breaks"
    summary = [line for line in done.stdout.splitlines() if line.startswith(suite + ":")]
    assert summary, report
    match = re.search(r": (\d+) run, 0 failed, 0 errors, .* transformed (\d+) frames with (\d+) graph breaks", summary[0])
    assert match, report
    tests_run, frames, breaks = (int(g) for g in match.groups())
    assert tests_run > 30 and frames > 100 and breaks > 10, summary[0]  # the suite ran, through kiln's hook
