"""kiln: torch.compile rebuilt in C++.

    import kiln
    model = kiln.compile(model)        # or @kiln.compile on a function
    kiln.export(model, (x,)).save(path); kiln.load(path)(x)   # one graph, saved to one file

The torch-free core (kiln._core: bytecode and frame hook) imports without torch; everything else
needs torch, imported before kiln's compiler extension kiln._C.
"""
import gc as _gc

from kiln import _core

# Finalizers the collector runs interrupt whatever frame is running; the hook leaves them alone (csrc/frame/frame.h).
if _core.frame.gc_phase not in _gc.callbacks:
    _gc.callbacks.append(_core.frame.gc_phase)

try:
    import torch  # noqa: F401  (loads LibTorch before kiln._C)
except ImportError:  # the torch-free core alone (tests of bytecode/ and frame/ on other Pythons)
    torch = None

if torch is not None:
    from kiln.api import compile, disable, explain, mark_dynamic, mark_static, reset, stats  # noqa: F401,A004
    from kiln import config, errors  # noqa: F401
    from kiln.export import ExportedProgram, export, load  # noqa: F401

__version__ = "0.1.0"
