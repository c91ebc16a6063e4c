"""kiln's settings: the one option table.

| switch (environment) | meaning |
|---|---|
| KILN_LOGS       | comma list of log categories: graph_breaks, recompiles, guards, graph, output_code, perf, bytecode, trace, fallbacks, or `all` |
| KILN_DEBUG_DIR  | directory where graphs and generated sources are kept (used by the compiler backends) |
| KILN_CACHE_DIR  | on-disk cache of compiled kernels and graphs (default ~/.cache/kiln) |
| KILN_DISABLE    | `1`: kiln.compile returns functions that run eagerly |

Python-level settings (this module's attributes):
- recompile_limit: cache entries per code object before new inputs run eagerly (default 8).
"""
import os

recompile_limit = 8


def disabled():
    return os.environ.get("KILN_DISABLE", "") not in ("", "0")


def debug_dir():
    return os.environ.get("KILN_DEBUG_DIR") or None


def cache_dir():
    return os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")


def set_logs(spec):
    """Same as KILN_LOGS=spec, from Python."""
    from kiln import _C
    _C.configure_logs(spec)
