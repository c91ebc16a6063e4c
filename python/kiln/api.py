"""kiln's user API, shaped like torch.compile's so habits carry over."""
import functools
import types
import warnings

import torch
import torch.nn as nn

from kiln import _C, _tracing, config
from kiln.errors import KilnError

_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# options={...}: every key kiln knows, its type and what it does (README.md's option table).
_OPTIONS = {
    "debug_dir": (str, "directory where this compile's graphs and generated sources are written, as KILN_DEBUG_DIR "
                       "does for every compile"),
    "cudagraphs": (bool, "replay compiled CUDA graphs as CUDA graphs, as mode='reduce-overhead' does"),
    "autotune": (bool, "time the candidate schedules of each generated CUDA kernel and the BLAS library of each matmul "
                       "at the first call, keep the fastest (remembered in the disk cache), and let cuDNN search its "
                       "convolution algorithms, as mode='max-autotune-no-cudagraphs' does"),
}


def _check_compile_arguments(mode, dynamic, options):
    """Refuses what kiln cannot honour: an argument kiln accepts does what torch.compile's does, or raises."""
    if mode is not None and options:
        raise KilnError("kiln.compile: pass either mode or options, not both (as torch.compile)")
    mode = "default" if mode is None else mode
    if mode not in _MODES:
        raise KilnError(f"unknown mode {mode!r}; choose one of {', '.join(_MODES)}")
    if dynamic not in (None, True, False):
        raise KilnError(f"dynamic must be None, True or False, got {dynamic!r}")
    if options is None:
        return
    if not isinstance(options, dict):
        raise KilnError(f"options must be a dict, got {type(options).__name__}")
    known = ", ".join(sorted(_OPTIONS))
    for key, value in options.items():
        if key not in _OPTIONS:
            raise KilnError(f"unknown option {key!r}; known options: {known}")
        kind, _ = _OPTIONS[key]
        if not isinstance(value, kind):
            raise KilnError(f"option {key!r} takes a {kind.__name__}, got {type(value).__name__}")


def _entry_codes(target):
    """The code objects whose frames kiln traces for `target` (a function or an nn.Module), even where the skip rules
    would not (a built-in torch.nn module compiled on its own)."""
    if isinstance(target, nn.Module):
        if _tracing.forward_runs_untraced(type(target)):
            # DDP(model): its forward runs eagerly; the module it wraps (its child) is compiled, a built-in
            # nn.Sequential as much as a user's model.
            return [code for child in target.children() for code in _entry_codes(child)]
        forward = type(target).forward
        code = getattr(forward, "__code__", None)
        return [code] if code is not None else []
    fn = target.__func__ if isinstance(target, types.MethodType) else target
    code = getattr(fn, "__code__", None)
    return [code] if code is not None else []


def _make_compiler(target, backend, fullgraph, explain_sink=None, mode=None, dynamic=None, options=None):
    user_backend = None
    if callable(backend):
        user_backend, backend = backend, getattr(backend, "__name__", "user backend")
    elif not isinstance(backend, str):
        raise KilnError(f"backend must be a name or a callable, got {type(backend).__name__}")
    elif backend not in _C.backend_names():
        raise KilnError(f"unknown backend {backend!r}; known backends: {', '.join(_C.backend_names())}, "
                        "or pass a callable(graph, example_inputs)")
    return _C.Compiler(backend, user_backend, bool(fullgraph), int(config.recompile_limit), _entry_codes(target),
                       explain_sink, mode=mode or "default", dynamic=dynamic,
                       options=dict(options or {}))


def _run_compiled(compiler, fn, args, kwargs):
    previous = _C.set_compiler(compiler)
    try:
        return fn(*args, **kwargs)
    finally:
        _C.set_compiler(previous)


def _compiled_module(module, compiler):
    """A module sharing the original's __dict__ (parameters, buffers, submodules, flags), whose calls run
    under kiln: state_dict keys, attribute access and .train()/.eval() behave as on the original, and
    isinstance(compiled, type(module)) holds. A call runs the original module itself, so the module's own code
    sees no wrapper: `type(self)`, `self.__class__` and class-keyed lookups inside forward are as in eager."""
    module = _original_module(module)
    cls = type(module)
    call_impl = cls.__call__

    def __call__(self, *args, **kwargs):
        return _run_compiled(compiler, call_impl, (self._kiln_module,) + args, kwargs)

    compiled_cls = type(f"Compiled{cls.__name__}", (cls,), {
        # The original module, outside the shared __dict__ (so state_dict and named_modules do not see it).
        "__slots__": ("_kiln_module",),
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": f"Compiled{cls.__qualname__}",
        "_kiln_compiler": compiler,
        # Pickling or deep-copying a compiled module gives (a copy of) the plain original. Through `self`,
        # not a closure over `module`: guards hold this class, and must not keep the model alive.
        "__reduce_ex__": lambda self, protocol: (_new_plain, (cls,), self.__dict__),
    })
    compiled = object.__new__(compiled_cls)
    object.__setattr__(compiled, "__dict__", module.__dict__)
    object.__setattr__(compiled, "_kiln_module", module)
    return compiled


def _original_module(module):
    """The plain module behind a module kiln.compile returned (compiling it again compiles the original)."""
    while True:
        try:
            module = object.__getattribute__(module, "_kiln_module")
        except AttributeError:
            return module


def _new_plain(cls):
    """An empty instance of the original module class; pickle and deepcopy then set its state."""
    return cls.__new__(cls)


def compile(model=None, *, mode=None, dynamic=None, fullgraph=False, backend="kiln", options=None, disable=False):
    """Compile a function or an nn.Module. Also usable as @kiln.compile or @kiln.compile(...).

    The arguments are torch.compile's: `mode` (None, "default", "reduce-overhead", which replays CUDA graphs,
    "max-autotune", which also times kernel schedules and library choices at the first call, or
    "max-autotune-no-cudagraphs"),
    `dynamic` (None: a dim whose size changes between calls becomes symbolic on the second distinct size; True: every
    dim of the arguments is symbolic from the first call; False: every size is specialised), `fullgraph`
    (a graph break raises), `backend` (a registered name or a callable(graph, example_inputs)), `options` (a dict
    of the keys in kiln.api._OPTIONS) and `disable` (return `model` unchanged)."""
    if model is None:
        return lambda m: compile(m, mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend,
                                 options=options, disable=disable)
    _check_compile_arguments(mode, dynamic, options)
    if not callable(model):
        raise KilnError(f"kiln.compile expects a function or an nn.Module, got {type(model).__name__}")
    if disable or config.disabled():  # KILN_DISABLE=1: compile is the identity
        return model
    compiler = _make_compiler(model, backend, fullgraph, mode=mode, dynamic=dynamic, options=options)
    if isinstance(model, nn.Module):
        return _compiled_module(model, compiler)

    @functools.wraps(model)
    def compiled_fn(*args, **kwargs):
        return _run_compiled(compiler, model, args, kwargs)

    compiled_fn._kiln_compiler = compiler
    compiled_fn._kiln_original = model
    return compiled_fn


def reset():
    """Drops every compiled entry (all functions) and zeroes kiln.stats()."""
    _C.reset()


def stats():
    """Counters since the last reset: frames_compiled, cache_hits, recompiles, graph_breaks, fallbacks,
    guard_snapshot_hits (guard checks answered by a snapshot of the module tree's dicts), guard_snapshots_stale
    (snapshots dropped because one of those dicts changed), dynamic_specialisations and dynamic_hits (a graph with
    size symbols lowered for a new set of sizes, or a call that reused one), and under CUDA graphs (mode="reduce-overhead"):
    cudagraph_recordings, cudagraph_replays, cudagraph_unrecorded_runs (calls of a recorded graph that ran unrecorded
    because memory it writes was still referenced), cudagraph_declined (graphs never recorded) and
    cudagraph_last_decline_reason; graphs_on_eager_interpreter (captured graphs the compiler could not lower, run op
    by op on kiln's eager interpreter at eager's speed) and last_eager_interpreter_reason."""
    return dict(_C.stats())


class ExplainOutput:
    """What kiln did with one call: graphs, their ops and guards, and why anything ran eagerly."""

    def __init__(self, records):
        graphs = [r for kind, r in records if kind == "graph"]
        self.graph_count = len(graphs)
        self.ops_per_graph = [list(g["ops"]) for g in graphs]
        self.guards = [line for g in graphs for line in g["guards"]]
        # One record per graph break or eager frame: {type, context, explanation, hints, file, line, reason}.
        self.breaks = [r if isinstance(r, dict) else {"type": "fallback", "reason": r, "explanation": r}
                       for kind, r in records if kind == "break"]
        self.break_reasons = [r["reason"] for r in self.breaks]
        self.graph_break_count = len(self.break_reasons)
        self.recompile_reasons = [r for kind, r in records if kind == "recompile"]
        self._cudagraph_status = [g.get("cudagraphs") for g in graphs]
        # Per graph: its size symbols ("s0 = x.size(1)") and the size relations it relies on (its size guards).
        self.dynamic = [list(g.get("dynamic", ())) for g in graphs]

    @property
    def cudagraphs(self):
        """Per graph, under CUDA graphs (mode="reduce-overhead"): whether it replays as a CUDA graph, as it stands now
        ("waiting for its warm-up call", "recorded (...)", "declined: <why>"); "" when CUDA graphs were not asked for."""
        return [(status() or "") if status is not None else "" for status in self._cudagraph_status]

    def __repr__(self):
        lines = [f"graphs: {self.graph_count}, graph breaks: {self.graph_break_count}"]
        for i, ops in enumerate(self.ops_per_graph):
            lines.append(f"graph {i}: {len(ops)} ops")
        for reason in self.break_reasons:
            lines.append(f"break: {reason}")
        return "\n".join(lines)


def explain(fn, *, backend="eager", mode=None, options=None):
    """kiln.explain(fn)(*args) -> ExplainOutput. Compiles afresh, runs once, reports. `mode` and `options` are
    kiln.compile's (with mode="reduce-overhead", ExplainOutput.cudagraphs says what became of each graph's CUDA graph
    when it is read)."""
    _check_compile_arguments(mode, None, options)
    if isinstance(fn, nn.Module):
        fn = _original_module(fn)

    def run(*args, **kwargs):
        records = []
        compiler = _make_compiler(fn, backend, False, explain_sink=records, mode=mode, options=options)
        target = type(fn).__call__ if isinstance(fn, nn.Module) else fn
        call_args = (fn,) + args if isinstance(fn, nn.Module) else args
        _run_compiled(compiler, target, call_args, kwargs)
        return ExplainOutput(records)
    return run


def disable(fn=None):
    """Runs `fn` (or the `with` block) without kiln, even when called from compiled code."""
    if fn is None:
        return _Disabled()

    @functools.wraps(fn)
    def disabled(*args, **kwargs):
        previous = _C.set_compiler(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _C.set_compiler(previous)

    disabled._kiln_disabled = True  # the tracer stops here instead of inlining the wrapper
    return disabled


class _Disabled:
    def __enter__(self):
        self._previous = _C.set_compiler(None)
        return self

    def __exit__(self, *exc):
        _C.set_compiler(self._previous)
        return False


def _marked_dims(tensor, index, what):
    """`index` (an int or a list of ints) as non-negative dims of `tensor`, or KilnError naming the bad one."""
    if not isinstance(tensor, torch.Tensor):
        raise KilnError(f"{what} expects a tensor, got {type(tensor).__name__}")
    dims = list(index) if isinstance(index, (list, tuple)) else [index]
    rank = max(tensor.dim(), 1)
    for dim in dims:
        if not isinstance(dim, int) or not -rank <= dim < rank:
            raise KilnError(f"{what}: dimension {dim!r} out of range for a {tensor.dim()}-d tensor")
    return [dim % rank for dim in dims]


def mark_dynamic(tensor, index, *, min=None, max=None):  # noqa: A002 (torch's keyword names)
    """torch.compile's mark_dynamic: dims `index` (an int or a list) of `tensor` are symbolic from the first compile
    of a function it is passed to (unless compiled with dynamic=False), optionally within [min, max]: a call with a
    size outside the range raises KilnError naming the argument and the dim."""
    dims = _marked_dims(tensor, index, "mark_dynamic")
    for bound, name in ((min, "min"), (max, "max")):
        if bound is not None and (not isinstance(bound, int) or bound < 0):
            raise KilnError(f"mark_dynamic: {name} must be a non-negative int, got {bound!r}")
    if min is not None and max is not None and min > max:
        raise KilnError(f"mark_dynamic: min {min} is larger than max {max}")
    marked = dict(getattr(tensor, "_kiln_dynamic_dims", {}))
    for dim in dims:
        marked[dim] = (min, max)
    tensor._kiln_dynamic_dims = marked


def mark_static(tensor, index=None):
    """torch.compile's mark_static: dims `index` (an int, a list, or None for every dim) of `tensor` keep their size
    under every policy (and a mark_dynamic on those dims is cleared)."""
    dims = list(range(tensor.dim())) if index is None and isinstance(tensor, torch.Tensor) else \
        _marked_dims(tensor, index, "mark_static")
    marked = dict(getattr(tensor, "_kiln_dynamic_dims", {}))
    for dim in dims:
        marked.pop(dim, None)
    tensor._kiln_dynamic_dims = marked
    tensor._kiln_static_dims = set(getattr(tensor, "_kiln_static_dims", set())) | set(dims)
