"""Runs CPython's own regression suites with kiln tracing every frame (the graph-breaks issue's proof that
tracing and falling back never change what a program does). tests/python/test_cpython_suites.py runs each
suite through this script in its own process.

    PYTHONPATH=python .venv/bin/python -W ignore tests/cpython_suites.py [test.test_scope ...]
"""
import importlib
import io
import signal
import sys
import time
import unittest

import torch  # noqa: F401  (kiln._C needs LibTorch loaded)

from kiln import _C

SUITES = ["test.test_grammar", "test.test_scope", "test.test_with", "test.test_contextlib", "test.test_generators",
          "test.test_exceptions"]


def run(name):
    suite = unittest.defaultTestLoader.loadTestsFromModule(importlib.import_module(name))
    compiler = _C.Compiler("eager", None, False, 8, [], None, trace_all=True)
    start = time.time()
    before = _C.stats()
    previous = _C.set_compiler(compiler)
    try:
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    finally:
        _C.set_compiler(previous)
    after = _C.stats()
    traced = after["frames_compiled"] - before["frames_compiled"]
    breaks = after["graph_breaks"] - before["graph_breaks"]
    print(f"{name}: {result.testsRun} run, {len(result.failures)} failed, {len(result.errors)} errors, "
          f"{time.time() - start:.1f} s; kiln transformed {traced} frames with {breaks} graph breaks", flush=True)
    for test, trace in result.failures + result.errors:
        print(f"  {test}: {trace.strip().splitlines()[-1]}")
    return not (result.failures or result.errors)


if __name__ == "__main__":
    # A process started in the background by a non-interactive shell inherits SIGINT ignored; test_generators'
    # SignalAndYieldFromTest needs Python's KeyboardInterrupt handler, as in an interactive run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ok = all([run(name) for name in (sys.argv[1:] or SUITES)])
    sys.exit(0 if ok else 1)
