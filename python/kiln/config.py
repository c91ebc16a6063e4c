"""kiln's settings: the one option table.

| switch (environment) | meaning |
|---|---|
| KILN_LOGS       | comma list of log categories: graph_breaks, recompiles, guards, graph, output_code, passes, perf, bytecode, trace, fallbacks, progress, or `all` |
| KILN_DEBUG_DIR  | directory where graphs and generated sources are kept (used by the compiler backends) |
| KILN_CACHE_DIR  | on-disk cache of compiled kernels and graphs (default ~/.cache/kiln, without HOME $TMPDIR/kiln-<uid>); unused, with one warning, if others can write to it |
| KILN_DISABLE    | `1`: kiln.compile returns functions that run eagerly |
| KILN_NVRTC_PATH | libnvrtc.so (or its folder) for CUDA kernels; searched before /usr/local/cuda/lib64, the nvidia-cuda-nvrtc wheel, the loader path |
| KILN_VERIFY     | `1`: run the graph verifier after every pass and the loop-IR verifier on every kernel (kiln backend) |
| CXX             | the C++ compiler of the kiln backend (default `c++`); if it fails, graphs run on the eager interpreter |

Python-level settings (this module's attributes):
- recompile_limit: cache entries per code object before new inputs run eagerly (default 8). Entries of a
  module's forward (a frame whose `self` is an nn.Module) count per instance: 8 per instance.
- module_instance_limit: distinct nn.Module instances one forward (or its resume functions) is compiled
  for before further instances run eagerly (default 64). Identical layers (12 blocks of a ModuleList whose
  forward has a graph break) are compiled once each without reaching recompile_limit; read on each such miss.
- progress_after_s: seconds a frame has been compiling before a one-line progress display (graph, stage,
  seconds so far) appears on stderr; shown when stderr is a terminal (rewritten in place, cleared when the
  compile ends) or with KILN_LOGS=progress (plain lines); default 1.0, None turns it off. Read on each compile.
- set_compiled_autograd(on): compiled forward + backward for graphs that need grad (default on).
"""
import os

recompile_limit = 8
module_instance_limit = 64
progress_after_s = 1.0


def set_compiled_autograd(on=True):
    """Graphs that need grad: compile forward and backward ahead of time behind one autograd node (True, the
    default), or run them on the eager interpreter, op by op with eager's autograd (False). Graphs autodiff
    does not cover keep the eager interpreter either way. Process-wide; applies to graphs compiled after."""
    from kiln import _C
    _C.set_compiled_autograd(bool(on))


def disabled():
    return os.environ.get("KILN_DISABLE", "") not in ("", "0")


def debug_dir():
    return os.environ.get("KILN_DEBUG_DIR") or None


def cache_dir():
    """The disk cache's folder, as kiln's C++ side chooses it (cache_root in csrc/cache/kernel_cache.h)."""
    if os.environ.get("KILN_CACHE_DIR"):
        return os.environ["KILN_CACHE_DIR"]
    if os.environ.get("HOME"):
        return os.path.join(os.environ["HOME"], ".cache", "kiln")
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"kiln-{os.geteuid()}")


def set_logs(spec):
    """Same as KILN_LOGS=spec, from Python."""
    from kiln import _C
    _C.configure_logs(spec)
