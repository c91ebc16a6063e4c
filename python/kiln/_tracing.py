"""Python-side helpers of kiln's C++ tracer (csrc/trace).

The symbolic interpreter is C++; a few questions are far simpler to answer with Python's own
machinery (argument binding, module hooks, what counts as a torch function). They run only while a
frame is traced, never on a cache hit.
"""
import abc as _abc
import contextlib as _contextlib
import enum
import functools as _functools
import itertools as _itertools
import inspect
import operator
import os
import sys
import types

import torch
import torch.nn as nn

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_KILN_DIR = os.path.dirname(__file__) + os.sep
_STDLIB_SKIP = (os.path.dirname(os.__file__) + os.sep,)
# typing_extensions (a dependency of torch) is the standard library's typing, backported: typing calls into it when a
# process first builds an annotation such as Optional[str] (torch.autograd.profiler.record_function's, on DDP's first
# forward), and it does no tensor work.
_STDLIB_BACKPORTS = tuple(m.__file__ for m in (sys.modules.get("typing_extensions"),) if getattr(m, "__file__", None))


def skip_reason(filename):
    """Why frames of `filename` are never traced (run by CPython, their callees still intercepted)."""
    if filename.startswith(_TORCH_DIR):
        return "torch internals"
    if filename.startswith(_KILN_DIR):
        return "kiln itself"
    if filename.startswith(_STDLIB_SKIP) or filename.startswith("<frozen ") or filename in _STDLIB_BACKPORTS:
        return "standard library"  # frozen modules (importlib's bootstrap, codecs, ...) are the standard library too
    return None


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def bind_arguments(fn, nargs, kwnames):
    """Binds `nargs` positional and `kwnames` keyword placeholders to `fn`'s parameters.

    Returns one entry per argument slot of fn.__code__, in co_varnames order (positional,
    keyword-only, *args, **kwargs): ("slot", i) for the i-th call argument, ("const", value) for a
    default, ("tuple", [i...]) for *args, ("dict", [(name, i)...]) for **kwargs. Raises TypeError
    exactly when the real call would.
    """
    slots = [_Slot(i) for i in range(nargs + len(kwnames))]
    sig = inspect.signature(fn, follow_wrapped=False)
    bound = sig.bind(*slots[:nargs], **{k: slots[nargs + j] for j, k in enumerate(kwnames)})
    bound.apply_defaults()
    by_name = {}
    for name, param in sig.parameters.items():
        value = bound.arguments[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            by_name[name] = ("tuple", [s.index for s in value])
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            by_name[name] = ("dict", [(k, s.index) for k, s in value.items()])
        elif isinstance(value, _Slot):
            by_name[name] = ("slot", value.index)
        else:
            by_name[name] = ("const", value)
    code = fn.__code__
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) \
        + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return [by_name[name] for name in code.co_varnames[:count]]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

# torch's wrappers whose forward is bookkeeping around communication (DistributedDataParallel, DataParallel, FSDP1's
# FullyShardedDataParallel): what it does must happen eagerly on every call (the reducer's per-iteration state, its
# autograd hooks, collectives), so it is neither traced nor run on fakes. It runs as CPython runs it, and the module
# it wraps, called from there, is compiled as its own frame: torch.compile's contract for DDP too (its forward is
# skipped, Dynamo compiles the inner module).
_UNTRACED_FORWARD_PACKAGES = ("torch.nn.parallel.", "torch.distributed.")


def forward_runs_untraced(cls):
    """Whether calls of modules of class `cls` run their forward untraced (a torch.distributed/parallel wrapper)."""
    forward = getattr(cls, "forward", None)
    module = getattr(forward, "__module__", None)
    return isinstance(module, str) and module.startswith(_UNTRACED_FORWARD_PACKAGES)


def data_parallel_buckets(example_inputs):
    """For a frame compiled while a DistributedDataParallel forward runs (DDP's forward runs untraced and calls the
    module it wraps: kiln.compile(DDP(m)) and DDP(kiln.compile(m)) alike): (indices of the graph inputs, the real
    tensors `example_inputs`, that are parameters DDP reduces, DDP's bucket_bytes_cap, the cap of its first bucket).
    None outside a DDP forward or when no input is one of its parameters. The pipeline cuts the graph at those
    buckets, so each bucket's all-reduce overlaps the rest of the backward (passes/split_at_parameter_buckets.h)."""
    distributed = sys.modules.get("torch.nn.parallel.distributed")  # never imported here: no DDP without it
    ddp_class = getattr(distributed, "DistributedDataParallel", None)
    active = getattr(ddp_class, "_active_ddp_module", None)  # set by DDP's _inside_ddp_forward
    if active is None or not isinstance(getattr(active, "bucket_bytes_cap", None), int):
        return None
    parameters = getattr(active, "_module_parameters", None)  # DDP's parameters, without those it ignores
    if parameters is None:
        parameters = list(active.module.parameters())
    reduced = {id(p) for p in parameters if p.requires_grad}
    indices = [i for i, t in enumerate(example_inputs) if id(t) in reduced]
    if not indices:
        return None
    cap = active.bucket_bytes_cap
    config = getattr(active, "_bucket_config", None)
    if config is not None:
        first = config.first_bucket_bytes_cap
    elif getattr(active, "bucket_bytes_cap_default", False):  # torch before _bucket_config: 1 MiB with the default cap
        first = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    else:
        first = cap
    return indices, int(cap), int(first)


def module_call_kind(module):
    """How the tracer treats a call of `module`: "hooks" (has hooks: cannot trace yet), "untraced" (a wrapper whose
    forward runs eagerly, forward_runs_untraced), "sequential", "leaf" (a built-in torch.nn module: called as a whole
    on fakes), or "inline" (trace its forward)."""
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or getattr(module, "_backward_pre_hooks", None)
            or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
            or nn.modules.module._global_backward_hooks
            or getattr(nn.modules.module, "_global_backward_pre_hooks", None)):
        return "hooks"
    if "forward" in module.__dict__:
        return "hooks"  # an instance-level forward override: treat as untraceable for now
    cls = type(module)
    if forward_runs_untraced(cls):
        return "untraced"
    if cls is nn.Sequential:
        return "sequential"
    if cls is nn.MultiheadAttention and _on_cpu(module):
        # Traced, so that its checks see the real device and eval-mode inference takes eager's fused fast path
        # (_native_multi_head_attention: 1142 against 1232 ms for the general path on a 2-core CPU, transformer6
        # at batch 32). As a leaf it runs on meta fakes, where the fast path declines. On CUDA the general path,
        # fused by kiln, is as fast as eager's fast path, and stays a leaf.
        return "inline"
    if cls.__module__.startswith("torch.nn.") and not isinstance(module, _CONTAINERS):
        return "leaf"
    return "inline"


def may_be_stateless_module(cls):
    """Whether `cls` is a built-in torch.nn module class (not a container) that make_stateless_module may build."""
    return (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__.startswith("torch.nn.")
            and not issubclass(cls, _CONTAINERS))


def make_stateless_module(cls, /, *args, **kwargs):
    """`nn.ReLU()`, `nn.Softmax(dim=-1)`, `nn.Dropout(0.1)` made inside traced code: a built-in torch.nn module
    class called with constant arguments is constructed at trace time, as eager constructs it at each call, and
    returned when it holds no parameter or buffer (so it draws no random numbers and has nothing to guard: the
    arguments, constants of the trace, fix it). `cls` is one may_be_stateless_module accepted (the tracer asks it
    first, before it makes the arguments). None when the instance holds state (the call is a graph break)."""
    # A class that turns out to hold parameters initialises them randomly: its construction here must not move
    # the generators that eager's own construction, after the graph break, draws from.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        module = cls(*args, **kwargs)
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()) or module._modules:
        return None
    return module


def _on_cpu(module):
    return all(p.device.type == "cpu" for p in module.parameters())


_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _is_simple(value):
    if isinstance(value, tuple):
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def leaf_module_state(module):
    """For a built-in module called as a whole: its tensors and the plain attributes its forward may read.

    Returns (tensors, constants): tensors = [(path, tensor)] where path is a list of
    ("_modules", name)... steps ending in ("_parameters"|"_buffers", name); constants = [(path, value)]
    where path is a list of ("_modules", name) steps ending in ("__dict__", attr). Python classes that are
    not simple values (functions, submodule-less objects) are not guarded: built-in modules keep them fixed.
    """
    tensors, constants = [], []

    def walk(mod, prefix):
        for name, p in mod._parameters.items():
            if p is not None:
                tensors.append((prefix + [("_parameters", name)], p))
        for name, b in mod._buffers.items():
            if b is not None:
                tensors.append((prefix + [("_buffers", name)], b))
        for attr, value in mod.__dict__.items():
            if attr.startswith("_") and attr not in ("_qkv_same_embed_dim",):
                continue
            if _is_simple(value):
                constants.append((prefix + [("__dict__", attr)], value))
        for name, sub in mod._modules.items():
            if sub is not None:
                walk(sub, prefix + [("_modules", name)])

    walk(module, [])
    return tensors, constants


def call_leaf_module(recorder, module, fakes_by_name, args, kwargs):
    with recorder.swapped_state(module, fakes_by_name):
        return recorder.call(type(module).forward, (module,) + tuple(args), kwargs)


_TENSOR_TYPES = (torch.Tensor,)


def is_torch_callable(fn):
    """True for functions the recorder may call as a whole on fakes: torch's own API."""
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        mod = getattr(fn, "__module__", None) or ""
        self_obj = getattr(fn, "__self__", None)
        if isinstance(self_obj, torch.Tensor):
            return True
        if mod.startswith("torch") or (self_obj is not None and getattr(self_obj, "__name__", "").startswith("torch")):
            return True
        return False
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType)):
        owner = getattr(fn, "__objclass__", None)
        if owner is None and isinstance(fn, types.MethodWrapperType):
            return isinstance(fn.__self__, torch.Tensor)
        return owner is not None and issubclass(owner, torch._C.TensorBase)
    if isinstance(fn, types.FunctionType):
        mod = fn.__module__ or ""
        return mod == "torch" or mod.startswith("torch.nn.functional") or mod.startswith("torch.functional") \
            or mod.startswith("torch._tensor") or mod.startswith("torch.nn.init") or mod.startswith("torch.overrides")
    if isinstance(fn, types.MethodType):
        return isinstance(fn.__self__, torch.Tensor) or is_torch_callable(fn.__func__)
    if fn in _OPERATOR_FUNCS:
        return True
    # torch.ops.<namespace>.<op>[.<overload>]: ATen's and custom ops (torch.library), recorded as calls of the op.
    return isinstance(fn, TORCH_OP_TYPES) or getattr(fn, "__module__", "") in ("torch._ops", "torch._ops.aten")


def is_allowed_in_graph(fn):
    """Whether torch.compiler.allow_in_graph(fn) (or torch._dynamo.allow_in_graph) was called for `fn`. The marks
    live in Dynamo's set of allowed callable ids; allow_in_graph imports torch._dynamo, so without it loaded no
    function is marked (and kiln does not import it)."""
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    allowed = getattr(trace_rules, "_allowed_callable_ids", None)
    if allowed is None:
        return False
    try:
        return id(fn) in allowed
    except Exception:  # a torch whose set looks different: nothing is marked
        return False


# Operator objects under torch.ops: each is made once and cached on its namespace (or packet), so a read through the
# same attribute path always gives the same object and the tracer pins them by identity.
TORCH_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
ENUM_TYPES = (enum.Enum,)
# functools.lru_cache / functools.cache wrappers: module-level objects made once, pinned by identity; a call is
# answered from the real cache when its arguments are constants, else traced through __wrapped__
# (Tracer::call_cached_function).
CACHED_FUNCTION_TYPES = (_functools._lru_cache_wrapper,)
# typing's special forms and aliases (List, Optional, List[int]): module-level values, pinned by identity, so a type
# expression in traced code (`torch.jit.annotate(List[Tensor], [])`) is computed at trace time.
import typing as _typing  # noqa: E402
TYPING_TYPES = (getattr(_typing, "_Final", type(_typing.List)), type(list[int]))


_GLOBAL_STATE_MODULES = ("torch.autograd.grad_mode", "torch.random", "torch.amp", "torch.cuda.random",
                         "torch.autograd.profiler")
_GLOBAL_STATE_NAMES = {"manual_seed", "seed", "initial_seed", "use_deterministic_algorithms", "set_rng_state",
                       "get_rng_state", "fork_rng"}


# torch.func's transforms (vmap, grad, jacrev, jvp, hessian, ...) and the functions they return (which carry the
# transformed function's __module__): they run the code they transform under functorch's interpreter stack, on
# wrapper tensors without storage. Known by the file their code is in.
_FUNCTION_TRANSFORM_FILES = tuple(os.path.join(_TORCH_DIR, "_functorch", name + ".py")
                                  for name in ("apis", "eager_transforms", "vmap", "pyfunctorch"))


def eager_only_reason(fn):
    """Why a call of torch function `fn` is a graph break (CPython runs it every time), or None.

    Functions that read or change global state (grad mode, RNG, defaults, threads): the recorder would run them
    once at trace time and never again on a cache hit. And torch.func's transforms, whose functions run eagerly
    (the frame hook leaves the code they call uncompiled).
    """
    if isinstance(getattr(fn, "__self__", None), torch.Tensor):
        return None
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return None
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_filename.startswith(_FUNCTION_TRANSFORM_FILES):
        return "a torch.func transform, which runs eagerly"
    module = getattr(fn, "__module__", None) or ""
    if not isinstance(module, str):
        return None
    global_state = "which reads or changes global state (grad mode, RNG, defaults)"
    if module.startswith(_GLOBAL_STATE_MODULES):
        return global_state
    if not (module == "torch" or module.startswith("torch.") or module.startswith("torch._C")):
        return None
    name = getattr(fn, "__name__", "") or ""
    return global_state if name.startswith(("set_", "_set_")) or name in _GLOBAL_STATE_NAMES else None


_OPERATOR_FUNCS = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")}

# BINARY_OP's argument indexes this table (CPython's NB_* order); the in-place forms follow at +13.
BINARY_OPS = [operator.add, operator.and_, operator.floordiv, operator.lshift, operator.matmul, operator.mul,
              operator.mod, operator.or_, operator.pow, operator.rshift, operator.sub, operator.truediv,
              operator.xor, operator.iadd, operator.iand, operator.ifloordiv, operator.ilshift, operator.imatmul,
              operator.imul, operator.imod, operator.ior, operator.ipow, operator.irshift, operator.isub,
              operator.itruediv, operator.ixor]
COMPARE_OPS = [operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge]

# ---- lazy iterators in traced code ------------------------------------------------------------------
# map(), filter(), itertools' chain, product and islice, and functools.reduce are C objects the tracer cannot step
# through. A call of one is traced as a call of its Python twin below (TRACED_REPLACEMENTS): a generator the tracer
# inlines, advanced item by item like any generator, so `function` runs when eager's iterator would run it.


def traced_map(function, *iterables):
    if len(iterables) == 1:
        for item in iterables[0]:
            yield function(item)
    else:
        for items in zip(*iterables):
            yield function(*items)


def traced_filter(function, iterable):
    for item in iterable:
        if (item if function is None else function(item)):
            yield item


def traced_chain(*iterables):
    for iterable in iterables:
        yield from iterable


def traced_chain_from_iterable(iterables):
    for iterable in iterables:
        yield from iterable


def traced_product(*iterables, repeat=1):
    pools = [tuple(pool) for pool in iterables] * repeat  # taken whole first, as itertools.product takes them
    results = [()]
    for pool in pools:
        results = [result + (item,) for result in results for item in pool]
    yield from results


def traced_islice(iterable, *bounds):
    bound = slice(*bounds)
    start, stop, step = bound.start or 0, bound.stop, bound.step or 1
    it = iter(iterable)
    index, next_index = 0, start
    while stop is None or index < stop:  # as islice: no item is taken past the stop
        try:
            item = next(it)
        except StopIteration:
            return
        if index == next_index:
            yield item
            next_index += step
        index += 1


def traced_count(start=0, step=1):
    value = start
    while True:
        yield value
        value += step


def traced_repeat(value, *times):
    if times:
        for _ in range(times[0]):
            yield value
        return
    while True:
        yield value


def traced_reduce(function, iterable, *initial):
    items = list(iterable)
    if initial:
        value = initial[0]
    elif not items:
        raise TypeError("reduce() of empty iterable with no initial value")
    else:
        value, items = items[0], items[1:]
    for item in items:
        value = function(value, item)
    return value


class TracedGeneratorContextManager:
    """What `with f(...):` makes of a @contextlib.contextmanager function f, as a plain class the tracer inlines
    (contextlib's _GeneratorContextManager, whose twin this is, is standard library and not traced): __enter__ runs the
    generator to its yield, __exit__ on the normal path runs it to its end. Where an instance leaves the trace (a
    graph break inside the block) it is a real context manager: the exceptional path is contextlib's own."""

    def __init__(self, func, args, kwds):
        self.gen = func(*args, **kwds)
        self.func, self.args, self.kwds = func, args, kwds

    def __enter__(self):
        try:
            return next(self.gen)
        except StopIteration:
            raise RuntimeError("generator didn't yield") from None

    def __exit__(self, typ, value, traceback):
        if typ is None:
            try:
                next(self.gen)
            except StopIteration:
                return False
            raise RuntimeError("generator didn't stop")
        return _contextlib._GeneratorContextManager.__exit__(self, typ, value, traceback)


TRACED_REPLACEMENTS = {map: traced_map, filter: traced_filter, _itertools.chain: traced_chain,
                       _itertools.chain.from_iterable: traced_chain_from_iterable, _itertools.product: traced_product,
                       _itertools.islice: traced_islice, _itertools.count: traced_count,
                       _itertools.repeat: traced_repeat,
                       _functools.reduce: traced_reduce,
                       _contextlib._GeneratorContextManager: TracedGeneratorContextManager}


def make_set(*items):
    """A set made in traced code, rebuilt from its items where it leaves the trace (frame_output.cpp)."""
    return set(items)


def make_mapping(cls, keys, *values):
    """A dict subclass instance (an OrderedDict) made in traced code, rebuilt from its keys and values."""
    return cls(zip(keys, values))


def make_frozenset(*items):
    return frozenset(items)


def make_iterator(*items):
    """An iterator made in traced code and returned: a fresh one over the items it had left."""
    return iter(items)


# Builtins that are pure functions of constant arguments: evaluated at trace time.
PURE_BUILTINS = {abs, all, any, bool, chr, divmod, float, format, frozenset, hash, int, isinstance, issubclass, len,
                 max, min, ord, pow, repr, round, sorted, str, sum, tuple, list, dict, set, range, enumerate, zip,
                 reversed, getattr, hasattr, type, slice, callable, iter, next}
import math as _math  # noqa: E402

PURE_BUILTINS |= {getattr(_math, n) for n in dir(_math) if callable(getattr(_math, n)) and not n.startswith("_")}
PURE_BUILTINS |= {f for f in _OPERATOR_FUNCS if callable(f)}
# torch.finfo(dtype) / torch.iinfo(dtype): immutable descriptions of a dtype (HF's masks read finfo(dtype).min).
PURE_BUILTINS |= {torch.finfo, torch.iinfo}
# torch.device("cuda", 0), torch.device(x.device), torch.Size([...]): immutable values of constant arguments.
PURE_BUILTINS |= {torch.device, torch.Size}


# ---- grad mode -----------------------------------------------------------------------------------
# Grad-mode switches are traced, not broken on: at trace time they run for real (so the fakes that follow
# get eager's requires_grad), and each change of the mode becomes a kiln::set_grad_enabled node that the
# runtime replays in graph order. Grad mode at any point of a trace is a function of the mode at frame
# entry (guarded) and of these calls' constant arguments (guarded), so replaying the recorded values is
# exact on every cache hit.
GRAD_MODE_CLASSES = (torch.no_grad, torch.enable_grad, torch.set_grad_enabled)
GRAD_MODE_CALLABLES = {torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.is_grad_enabled,
                       torch._C._set_grad_enabled, torch._C.is_grad_enabled}
# The methods of grad-mode context managers the tracer runs for real (bound to their object).
GRAD_MODE_METHODS = {getattr(cls, name) for cls in GRAD_MODE_CLASSES for name in ("__enter__", "__exit__")}
GRAD_MODE_ENTER_METHODS = {cls.__enter__ for cls in GRAD_MODE_CLASSES}
set_grad_enabled = torch._C._set_grad_enabled
grad_enabled = torch.is_grad_enabled

# torch.autocast blocks made in traced code are entered and left for real at trace time too: the recorder then
# records autocast's casts (kiln/_fake.py), so the graph holds them and nothing is replayed at run time
# (compiled graphs run with autocast's dispatch keys excluded). At a graph break inside such a block, the
# compiled frame enters the block for real after its graph (enter_autocast_like), so the
# break instruction and the resume function run under autocast as in eager, and the block's __exit__ leaves it.
AUTOCAST_CLASSES = tuple({torch.autocast, torch.amp.autocast, torch.cpu.amp.autocast, torch.cuda.amp.autocast})
GRAD_MODE_CALLABLES |= set(AUTOCAST_CLASSES)
AUTOCAST_METHODS = {getattr(cls, name) for cls in AUTOCAST_CLASSES for name in ("__enter__", "__exit__")}
GRAD_MODE_METHODS |= AUTOCAST_METHODS
GRAD_MODE_ENTER_METHODS |= {cls.__enter__ for cls in AUTOCAST_CLASSES}
_AUTOCAST_DEVICES = ("cpu", "cuda")

# contextlib.nullcontext (what code returns where it might have entered autocast or no_grad: transformers'
# maybe_autocast) has no state and does nothing: made, entered and left for real at trace time, recorded as nothing.
NULL_CONTEXT_CLASSES = (_contextlib.nullcontext,)
GRAD_MODE_CALLABLES |= set(NULL_CONTEXT_CLASSES)
GRAD_MODE_METHODS |= {getattr(cls, name) for cls in NULL_CONTEXT_CLASSES for name in ("__enter__", "__exit__")}


def enter_autocast_like(ctx, outer_exit=None):
    """At a graph break inside a `with torch.autocast(...)` made in traced code: enters a new manager with the
    same settings as `ctx` (the one made at trace time); returns its __exit__. `outer_exit` is the block around
    it, already entered again (built first, so nested blocks are entered outermost first)."""
    fresh = torch.autocast(device_type=ctx.device, dtype=ctx.fast_dtype, enabled=ctx._enabled,
                           cache_enabled=ctx._cache_enabled)
    fresh.__enter__()
    return fresh.__exit__


def is_grad_mode_context(obj):
    return type(obj) in GRAD_MODE_CLASSES


def is_autocast_context(obj):
    return type(obj) in AUTOCAST_CLASSES


def is_traced_context(obj):
    """Context managers whose `with` blocks are traced: grad-mode ones, torch.autocast and contextlib.nullcontext."""
    return is_grad_mode_context(obj) or is_autocast_context(obj) or type(obj) in NULL_CONTEXT_CLASSES


def _autocast_nesting():
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def autocast_state():
    """Everything a traced autocast block changes: per device on/off and dtype, the cast cache switch, nesting."""
    devices = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)
    return devices, torch.is_autocast_cache_enabled(), _autocast_nesting()


def restore_autocast_state(state):
    """Puts back autocast_state()'s result, however the trace ended (a failure inside an autocast block)."""
    devices, cache, nesting = state
    for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, devices):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(cache)
    now = _autocast_nesting()
    while now < nesting:
        now = torch.autocast_increment_nesting()
    while now > nesting:
        now = torch.autocast_decrement_nesting()


def grad_mode_call(fn, args, kwargs):
    """Runs a grad-mode callable for real at trace time: -> (its result, the new mode or None if unchanged)."""
    before = torch.is_grad_enabled()
    result = fn(*args, **kwargs)
    after = torch.is_grad_enabled()
    return result, (after if after != before else None)


# ---- structured values: namedtuples, structseqs (torch.return_types), dataclasses, ModelOutput -------------
import dataclasses as _dataclasses  # noqa: E402


def tuple_fields(cls):
    """Field names of a namedtuple or structseq class (torch.return_types.max: ('values', 'indices')),
    or None for plain tuples and other tuple subclasses (torch.Size): those are not rebuilt by field."""
    if not (isinstance(cls, type) and issubclass(cls, tuple)) or cls is tuple:
        return None
    if "n_sequence_fields" in cls.__dict__:  # a structseq: its visible fields, in order
        names = getattr(cls, "__match_args__", None)
        return tuple(names) if names is not None else None
    names = getattr(cls, "_fields", None)
    if not (isinstance(names, tuple) and all(isinstance(n, str) for n in names) and callable(getattr(cls, "_make", None))):
        return None
    # A subclass with its own __new__ or __init__ (inspect.Traceback sets an attribute there) is not made
    # from its fields alone.
    for klass in cls.__mro__:
        if "_fields" in klass.__dict__:
            return names
        if "__new__" in klass.__dict__ or "__init__" in klass.__dict__:
            return None
    return names


def record_class_kind(cls):
    """How the tracer builds an instance of `cls` called inside traced code: "tuple" (a namedtuple or
    structseq: kept as a typed tuple of its items), "object" (a dataclass, HuggingFace's ModelOutput
    included: built on the fakes to read its fields, rebuilt by calling cls again with the real values),
    or None (not a record class: calling it is not traced)."""
    if not isinstance(cls, type):
        return None
    if tuple_fields(cls) is not None:
        return "tuple"
    if _dataclasses.is_dataclass(cls):
        return "object"
    return None


class _PlainInstanceLayout:
    """An instance of the plainest Python class: the layout (size, __dict__) a traced user object's class must have."""


_PLAIN_SLOTS = {"__dict__", "__weakref__"}
# Library mixins a user class may inherit from: pure-Python classes without instance state of their own (empty
# __slots__), whose methods are traced like the user's.
_MIXIN_MODULES = ("abc", "typing", "_collections_abc", "collections.abc")


def user_class_refusal(cls):
    """Why calling `cls` in traced code is not traced as a plain user object (csrc/trace/user_objects.cpp), or None
    when it is. A plain user class: defined outside torch, kiln and the standard library (its library bases only the
    pure-Python mixins of abc, typing and collections.abc); metaclass type or abc.ABCMeta (neither overrides __call__);
    object's __new__, __setattr__, __delattr__ and __getattribute__, no __getattr__ and no __del__ (so an instance is
    its __dict__, filled by __init__ and plain stores, and is rebuilt as object.__new__(cls) plus that dict; Python
    overrides of the three are traced down to object's); an
    __init__ written in Python (or object's); the layout of a plain Python instance (no C base, no __slots__ beyond
    __dict__/__weakref__); not abstract."""
    if not isinstance(cls, type):
        return "not a class"
    if cls is TracedGeneratorContextManager or cls is InferenceFunctionContext:
        return None
    if type(cls) not in (type, _abc.ABCMeta):
        return f"its metaclass {type(cls).__name__} is not type or ABCMeta"
    for base in cls.__mro__[:-1]:
        module = base.__module__
        if module in _MIXIN_MODULES:
            if any(slot not in _PLAIN_SLOTS for slot in vars(base).get("__slots__", ("?",))):
                return f"its base {module}.{base.__qualname__} holds instance state"
            continue
        file = getattr(sys.modules.get(module), "__file__", None)
        reason = skip_reason(file) if file else ("a built-in class" if module == "builtins" else None)
        if reason:
            return f"its base {module}.{base.__qualname__} is {reason}"
        slots = vars(base).get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        if any(slot not in _PLAIN_SLOTS for slot in slots):
            return f"{base.__qualname__} has __slots__"
    if cls.__basicsize__ != _PlainInstanceLayout.__basicsize__ or not cls.__dictoffset__:
        return "its instances are not laid out as plain Python objects (a C base or __slots__)"
    if cls.__new__ is not object.__new__:
        return "it defines __new__"
    for name in ("__setattr__", "__delattr__", "__getattribute__"):  # overrides written in Python are traced
        if getattr(cls, name) is not getattr(object, name) and not isinstance(getattr(cls, name), types.FunctionType):
            return f"it defines {name} in C"
    for name in ("__getattr__", "__del__"):
        if hasattr(cls, name):
            return f"it defines {name}"
    if not (isinstance(cls.__init__, types.FunctionType) or cls.__init__ is object.__init__):
        return "its __init__ is not a Python function"
    if getattr(cls, "__abstractmethods__", None):
        return "it is abstract (abstract methods: " + ", ".join(sorted(cls.__abstractmethods__)) + ")"
    return None


# Custom autograd functions: where a gradient may flow, `MyFunction.apply(...)` runs eagerly at a graph break, so its
# own backward (which kiln's autodiff would not reproduce: a straight-through estimator differs from the forward's
# derivative) is what autograd calls. Where none can (grad off, or no tensor argument requires grad), apply is
# eager's forward under no_grad, which the tracer inlines (apply_without_grad).
AUTOGRAD_FUNCTION = torch.autograd.Function
AUTOGRAD_FUNCTION_APPLY = torch.autograd.Function.apply.__func__


def forward_is_traceable(cls):
    """Whether the forward of autograd.Function subclass `cls` is user code the tracer may inline (not torch's own
    functions, whose forwards keep state such as RNG snapshots for their backward)."""
    forward = getattr(cls, "forward", None)
    if not isinstance(forward, types.FunctionType):
        return False
    file = getattr(sys.modules.get(forward.__module__), "__file__", None)
    return bool(file) and skip_reason(file) is None


class InferenceFunctionContext:
    """The ctx an old-style autograd.Function forward gets where no gradient can flow: what it saves or marks is
    kept for the forward to read back and otherwise unused, as no backward will run."""

    def __init__(self, num_inputs):
        self.needs_input_grad = (False,) * num_inputs
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def apply_without_grad(cls, *args, **kwargs):
    """`cls.apply(*args, **kwargs)` where no gradient can flow: eager's apply runs the forward under no_grad (given a
    ctx where forward takes one) and returns what it returns."""
    with torch.no_grad():
        if cls.setup_context is not AUTOGRAD_FUNCTION.setup_context:  # forward takes no ctx
            return cls.forward(*args, **kwargs)
        return cls.forward(InferenceFunctionContext(len(args)), *args, **kwargs)


# Methods of record instances that only read them: called for real on the trace-time instance.

RECORD_READ_METHODS = {"keys", "values", "items", "get", "to_tuple", "__getitem__", "__len__", "__contains__",
                       "__iter__"}


def holds_meta_tensor(obj, _depth=0):
    """True when `obj` (a value about to leave a compiled frame as a constant) holds a meta tensor: a
    trace-time fake that escaped. Walks containers and dataclass fields a few levels deep."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "meta"
    if _depth > 6 or isinstance(obj, (str, bytes, int, float, type)):
        return False
    if isinstance(obj, dict):
        return any(holds_meta_tensor(v, _depth + 1) for v in obj.values())
    if isinstance(obj, (tuple, list, set, frozenset)):
        return any(holds_meta_tensor(v, _depth + 1) for v in obj)
    if _dataclasses.is_dataclass(obj):
        return any(holds_meta_tensor(getattr(obj, f.name, None), _depth + 1) for f in _dataclasses.fields(obj))
    return False


import sys as _sys  # noqa: E402

# Python frames below which a graph break inside a loop still resumes in a (nested) resume function; deeper,
# the loop goes on eagerly in the frame's own copy of its body (csrc/trace/break_code.cpp). Each iteration
# with a break nests one resume call, and every nested frame also costs C stack under the frame hook; the
# margin keeps room below the recursion limit for what eager itself would have called.
RESUME_NESTING_DEPTH = 200
RECURSION_MARGIN = 100


def resume_nesting_ok():
    """True while the Python stack is shallower than the resume nesting depth."""
    depth = min(RESUME_NESTING_DEPTH, _sys.getrecursionlimit() - RECURSION_MARGIN)
    if depth <= 0:
        return False
    try:
        _sys._getframe(depth)
    except ValueError:
        return True
    return False


def container_slot(module, index):
    """Where `module[index]` of a container lives: ("_modules" or "_parameters", key), or None when the container's
    own __getitem__ is not one of torch.nn's or the index is out of range. By position, not by identity: a module
    listed twice (layers[0] is layers[3]) is reached through the entry the index names."""
    kind = module_iteration(module)
    if type(index) is int and kind in ("children", "indexed"):
        n = len(module)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            return None
        if kind == "children":
            return "_modules", list(module._modules.keys())[i]
        key = str(i)  # ParameterList registers its i-th parameter under str(i)
        return ("_parameters", key) if key in module._parameters else None
    if type(index) is str and kind == "keys":
        for slot in ("_modules", "_parameters"):
            if index in getattr(module, slot):
                return slot, index
    return None


def contains_by_key(module):
    """Whether `key in module` is ModuleDict's or ParameterDict's own __contains__ (a lookup among its keys)."""
    return getattr(type(module), "__contains__", None) in (nn.ModuleDict.__contains__, nn.ParameterDict.__contains__)


def module_iteration(module):
    """How the tracer iterates `module`, as its container's __iter__ does: "children" (Sequential, ModuleList: the
    _modules values in order), "keys" (ModuleDict, ParameterDict), "indexed" (ParameterList: self[i] for each i), or
    None for a module with any other __iter__ (not traced: a graph break)."""
    iterate = getattr(type(module), "__iter__", None)
    if iterate in (nn.Sequential.__iter__, nn.ModuleList.__iter__):
        return "children"
    if iterate in (nn.ModuleDict.__iter__, nn.ParameterDict.__iter__):
        return "keys"
    if iterate is nn.ParameterList.__iter__:
        return "indexed"
    return None



# Questions about Python protocols the tracer rebuilds (logging calls, deep copies): in their own module.
from kiln._tracing_protocols import (  # noqa: E402,F401
    deepcopy_is_identity, deepcopy_refusal, is_deferrable_output_call, is_log_call, is_plain_constant)
from kiln._tracing_composites import SYMBOLIC_TWINS  # noqa: E402,F401
