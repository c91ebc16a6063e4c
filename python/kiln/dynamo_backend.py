"""kiln as a torch.compile backend: `torch.compile(model, backend="kiln")`.

Dynamo captures an FX GraphModule and hands it over with example inputs. kiln records it into its own ATen graph
by running each node's target on kiln's fakes through the recorder (kiln/_fake.py), exactly as its tracer records
the torch calls it meets, and compiles that graph with kiln's pipeline (autodiff, fusion, code generation, the disk
cache): the path kiln.compile's graphs take. AOTAutograd, Inductor, FakeTensor and make_fx are not involved.

Sizes are compiled as concrete values. A graph whose sizes Dynamo made symbolic (automatic dynamic shapes,
mark_dynamic) is recorded and compiled again for each new set of input sizes, up to kiln.config.recompile_limit,
then runs eagerly with one warning. A graph with a node kiln cannot record runs as Dynamo captured it (gm.forward),
with a warning naming the node.

Installed kiln registers the name through the `torch_dynamo_backends` entry point (pyproject.toml); in a source
tree that is not installed, `kiln.dynamo_backend.register()` does it.
"""
import operator
import warnings

import torch

from kiln import _C, _fake, _tracing, config, errors

__all__ = ["kiln_backend", "register", "stats", "reset_stats"]

_STAT_NAMES = ("graphs_compiled", "graphs_eager", "recompiles", "calls_compiled", "calls_eager")
_stats = dict.fromkeys(_STAT_NAMES, 0)

# Tensor types recorded as plain tensors; subclasses (DTensor, user __torch_function__ types) run eagerly.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def stats():
    """Counters since the last reset_stats(): graphs_compiled (FX graphs recorded and compiled by kiln, one per
    size signature), graphs_eager (FX graphs or signatures that run as Dynamo captured them), recompiles (new size
    signatures of graphs with symbolic sizes), calls_compiled and calls_eager (calls of the callables returned to
    Dynamo, by how they ran)."""
    return dict(_stats)


def reset_stats():
    for name in _STAT_NAMES:
        _stats[name] = 0


def register():
    """Makes `torch.compile(..., backend="kiln")` work where the entry point is not installed (a source tree on
    PYTHONPATH). Does nothing when Dynamo already knows the name (the entry point, or an earlier call)."""
    import torch._dynamo

    if "kiln" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(kiln_backend, name="kiln")


def kiln_backend(gm, example_inputs, mode=None, options=None):
    """The backend Dynamo calls: `gm` (a torch.fx.GraphModule) and its example inputs in placeholder order -> a
    callable taking the same inputs. `mode` and `options` are torch.compile's, checked as kiln.compile checks them."""
    from kiln.api import _check_compile_arguments

    _check_compile_arguments(mode, None, options)
    program = _FxProgram(gm, mode or "default", dict(options or {}))
    if program.static and all(type(x) in _PLAIN_TENSOR_TYPES for x in example_inputs):
        program.compile_static(list(example_inputs))
    return program


class _CannotRecord(Exception):
    def __init__(self, node, error):
        super().__init__(f"node {node.name} ({node.op} {_target_name(node.target)}): {error}")


class _Compiled:
    """One recorded and compiled graph: how to gather its inputs and rebuild the FX graph's output."""

    __slots__ = ("graph", "input_sources", "arg_indices", "output_spec")

    def __init__(self, graph, input_sources, output_spec):
        self.graph = graph
        self.input_sources = input_sources  # per graph input: an int (the call's argument) or an attribute path of gm
        self.arg_indices = input_sources if all(isinstance(s, int) for s in input_sources) else None
        self.output_spec = output_spec

    def __call__(self, gm, args):
        if self.arg_indices is not None:
            inputs = [args[i] for i in self.arg_indices]
        else:
            inputs = _inputs_of(gm, args, self.input_sources)
        return _rebuild(self.output_spec, self.graph(inputs))


class _FxProgram:
    """The callable handed back to Dynamo. Static graphs compile once, from the example inputs; graphs with symbolic
    sizes (or non-tensor inputs) compile on their first call for each signature of the inputs (sizes, strides,
    dtypes, devices, requires_grad, integer values, aliasing, grad mode and autocast state)."""

    def __init__(self, gm, mode, options):
        self.gm = gm
        self.mode = mode
        self.options = options
        self.static = not _has_symbolic_sizes(gm)
        self.compiled = None          # the static graph's _Compiled, or None
        self.by_signature = {}        # signature -> _Compiled, or None for "runs eagerly"
        self.limit_warned = False

    # ---- compiling -------------------------------------------------------------------------------------
    def compile_static(self, example_inputs):
        self.compiled = self._compile(example_inputs)

    def _compile(self, args):
        """Records the FX graph on fakes of `args` and compiles it with kiln; None (after one warning) when a node
        cannot be recorded: then every call runs eagerly, without recording again."""
        try:
            graph, input_sources, output_spec = _record(self.gm, args)
            compiled = _C.compile_graph(graph, "kiln", _inputs_of(self.gm, args, input_sources), mode=self.mode,
                                        options=self.options)
        except Exception as e:
            # kiln's pipeline runs what it cannot lower on its eager interpreter by itself; what reaches here is a
            # node the recorder refused or a graph kiln cannot build, and runs as Dynamo captured it.
            what = f"record {e}" if isinstance(e, _CannotRecord) else f"compile the graph: {e}"
            warnings.warn(f"kiln backend: running a graph Dynamo captured eagerly, as kiln cannot {what}",
                          stacklevel=3)
            _stats["graphs_eager"] += 1
            self.by_signature = _AlwaysEager()
            return None
        _stats["graphs_compiled"] += 1
        return _Compiled(compiled, input_sources, output_spec)

    # ---- calling ---------------------------------------------------------------------------------------
    def __call__(self, *args):
        compiled = self.compiled
        if compiled is None:
            compiled = self._for_signature(args)
            if compiled is None:
                _stats["calls_eager"] += 1
                return self.gm.forward(*args)
        _stats["calls_compiled"] += 1
        return compiled(self.gm, args)

    def _for_signature(self, args):
        key = _signature(args)
        try:
            return self.by_signature[key]
        except KeyError:
            pass
        except TypeError:  # an argument that cannot be part of a key: nothing compiled can be matched to it
            return None
        if len(self.by_signature) >= config.recompile_limit:
            if not self.limit_warned:
                self.limit_warned = True
                warnings.warn(f"kiln backend: a graph with symbolic sizes was compiled for {len(self.by_signature)} "
                              "signatures (kiln.config.recompile_limit); further ones run eagerly", stacklevel=3)
            _stats["graphs_eager"] += 1
            compiled = None
        else:
            if self.by_signature:
                _stats["recompiles"] += 1
            compiled = self._compile(list(args))
        self.by_signature[key] = compiled
        return compiled


class _AlwaysEager(dict):
    """by_signature of a graph kiln cannot record: every signature runs eagerly, without recording again."""

    def __getitem__(self, key):
        return None


# ---- recording ---------------------------------------------------------------------------------------------
def _record(gm, args):
    """Runs gm's nodes on kiln's fakes -> (kiln._C.Graph, input sources, output spec). Grad mode and autocast state,
    which grad-mode and autocast nodes switch for real, are restored however it ends."""
    recorder = _fake.Recorder()
    fakes = {}             # id(real tensor) -> its fake (a tensor reached twice is one graph input)
    input_sources = []
    grad_mode = torch.is_grad_enabled()
    autocast = _tracing.autocast_state()

    def graph_input(tensor, source):
        if type(tensor) not in _PLAIN_TENSOR_TYPES:
            raise errors.Unsupported(f"a {type(tensor).__name__} (a tensor subclass) is recorded as a plain tensor")
        fake = fakes.get(id(tensor))
        if fake is None:
            fake = fakes[id(tensor)] = recorder.add_input(tensor)
            input_sources.append(source)
        return fake

    env = {}
    placeholders = 0
    try:
        for node in gm.graph.nodes:
            try:
                if node.op == "placeholder":
                    value = args[placeholders]
                    env[node] = graph_input(value, placeholders) if isinstance(value, torch.Tensor) else value
                    placeholders += 1
                elif node.op == "get_attr":
                    value = _fetch_attr(gm, node.target)
                    env[node] = graph_input(value, node.target) if isinstance(value, torch.Tensor) else value
                elif node.op == "output":
                    graph, output_spec = _finish(recorder, _load(node.args[0], env))
                    return graph, input_sources, output_spec
                else:
                    env[node] = _run_node(gm, node, recorder, graph_input, _load(node.args, env),
                                          _load(node.kwargs, env))
            except Exception as e:  # a refusal, or an error of the user's code that eager will raise itself
                raise _CannotRecord(node, e) from e
        raise _CannotRecord(node, "the graph has no output node")
    finally:
        torch._C._set_grad_enabled(grad_mode)
        _tracing.restore_autocast_state(autocast)


def _run_node(gm, node, recorder, graph_input, args, kwargs):
    """One call_function / call_method / call_module node on fakes."""
    if node.op == "call_function":
        target = node.target
        if target is torch._C._set_grad_enabled:
            # Switched for real (the fakes after it see eager's requires_grad) and replayed by the runtime in order.
            torch._C._set_grad_enabled(*args, **kwargs)
            recorder.record_grad_mode(torch.is_grad_enabled())
            return None
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise errors.Unsupported(f"higher-order op {target.name()} (its subgraphs are not recorded)")
        return recorder.call(target, args, kwargs)
    if node.op == "call_method":
        owner, rest = args[0], args[1:]
        return recorder.call(getattr(owner, node.target), rest, kwargs)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        state = {name: graph_input(t, f"{node.target}.{name}")
                 for name, t in list(module.named_parameters()) + list(module.named_buffers())}
        return _tracing.call_leaf_module(recorder, module, state, args, kwargs)
    raise errors.Unsupported(f"FX node kind {node.op!r}")


def _finish(recorder, output):
    """The kiln graph returning every fake among `output`'s leaves, and the spec that rebuilds `output`."""
    tensors = []

    def spec_of(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("out", len(tensors) - 1)
        if type(value) in (tuple, list):
            return (type(value), [spec_of(v) for v in value])
        if type(value) is dict:
            return (dict, {k: spec_of(v) for k, v in value.items()})
        if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device,
                                               torch.Size)):
            return ("const", value)
        raise errors.Unsupported(f"the graph returns a {type(value).__name__}")

    spec = spec_of(output)
    return recorder.finish(tensors), spec


def _rebuild(spec, outputs):
    kind, payload = spec
    if kind == "out":
        return outputs[payload]
    if kind == "const":
        return payload
    if kind is dict:
        return {k: _rebuild(v, outputs) for k, v in payload.items()}
    return kind(_rebuild(v, outputs) for v in payload)


def _load(value, env):
    """An FX argument with each node replaced by its value in env."""
    if isinstance(value, torch.fx.Node):
        return env[value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_load(v, env) for v in value))
    # FX keeps list arguments as immutable_list (a list subclass): `torch.cat([a, b])` reaches here as one.
    if isinstance(value, list):
        return [_load(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_load(v, env) for v in value)
    if type(value) is dict or isinstance(value, torch.fx.immutable_collections.immutable_dict):
        return {k: _load(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_load(value.start, env), _load(value.stop, env), _load(value.step, env))
    return value


# ---- helpers -----------------------------------------------------------------------------------------------
def _fetch_attr(gm, target):
    """gm's attribute at a dotted path: read on every call, so a parameter replaced on the module is seen."""
    return operator.attrgetter(target)(gm)


def _inputs_of(gm, args, input_sources):
    return [args[s] if isinstance(s, int) else _fetch_attr(gm, s) for s in input_sources]


def _has_symbolic_sizes(gm):
    """Whether Dynamo made any size of the graph symbolic: a SymInt placeholder, or a placeholder whose example
    value has a symbolic size or stride."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        example = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(example, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in tuple(example.shape) + tuple(example.stride())):
                return True
    return False


def _signature(args):
    """What a compiled graph is specialised on, for graphs with symbolic sizes."""
    first_index = {}
    parts = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            parts.append((type(a), tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device,
                          a.requires_grad, first_index.setdefault(id(a), i)))
        else:
            parts.append((type(a), a))
    return (tuple(parts), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def _target_name(target):
    if isinstance(target, str):
        return target
    return _fake._describe(target)
