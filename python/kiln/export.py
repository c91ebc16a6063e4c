"""kiln.export, ExportedProgram.save and kiln.load: a model's whole forward as one graph, saved to one file and run
in another process without the model's source.

    program = kiln.export(model, (x,))       # one graph, fullgraph: a graph break raises GraphBreakError
    program.save("model.kiln")
    program = kiln.load("model.kiln")       # in a new process: no model code needed
    out = program(x)                        # or program.module()(x), an nn.Module

Export traces in eval mode under torch.no_grad (inference): the program computes no gradients. Dtypes, devices,
non-tensor arguments and sizes are specialised, except the dims `dynamic_shapes` declares dynamic (torch.export's spec
format, read by kiln/export_shapes.py): those are size symbols of the graph, checked against their ranges on each call.
A call that differs raises KilnError naming the argument.

The graph is kiln's own capture (the frame hook and tracer, as kiln.compile(fullgraph=True) runs them); running it
goes through the same pipeline and runtime as kiln.compile (kiln._C.compile_graph with the "kiln" backend).

File format (a zip, every entry stored uncompressed so that a small reader can find entries by offset):
    manifest.json         format name and version, kiln, torch, CUDA and GPU architecture, and per entry its size
                          and SHA-256
    graph.json            the graph (kiln._C.Graph.to_json: values with meta, nodes with named arguments, and for a
                          dynamic program its symbolic table: size symbols, their origins, symbolic metas, relations)
    program.json          how to call it: the input and output trees, the tensor specs (with the dims declared
                          dynamic, format version 2), and what feeds each graph input (a call argument or a named
                          state tensor)
    weights.safetensors   the state tensors ("state.<name>") and the graph's constants ("constant.<value id>"), in the
                          safetensors layout (8-byte header length, JSON header, raw little-endian data)
    kernels/<kind>/<key><suffix>
                          the compiled code for the exporting machine, as kiln's disk cache holds it: the compiled
                          graph record (graphs/), the C++ library (cpp/) or CUDA images (cuda/). kiln.load puts them
                          into the disk cache when torch, kiln's build and the GPU architecture match, so the first
                          call runs no compiler; otherwise the saved graph is compiled (logged under recompiles)

The same files load from C++ without Python: include/kiln/export.h (csrc/export reads this format; keep both in step).
"""
import hashlib
import json
import os
import re
import struct
import tempfile
import zipfile

import torch
import torch.nn as nn

from kiln import _C
from kiln import export_shapes
from kiln.errors import GraphBreakError, KilnError

FORMAT_NAME = "kiln.export"
# 2: program.json's input tensors carry "name" and "dynamic", graph.json may hold a symbolic table. Version 1 files
# (every size static) still load.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_ENTRIES = ("graph.json", "program.json", "weights.safetensors")
# Bundled compiled code, by the disk cache's folder, key and suffix (the names become paths in the cache: no others).
_KERNEL_ENTRY = re.compile(r"kernels/(graphs|cpp|cuda)/([0-9a-f]{64})(\.[a-z]{1,8})")
_EXPORT_HINT = ("kiln.export captures the whole forward as one graph: move the construct out of forward, or write it "
                "without Python control flow on tensor values (compute both sides and pick with torch.where); "
                "kiln does not trace torch.cond yet")


# ---- trees of arguments and results ------------------------------------------------------------------------------
def _flatten(value, leaf, where):
    """The JSON spec of `value`'s tree, with `leaf(tensor)` as the spec of each tensor. Tuples, lists and dicts with
    str or int keys are containers; None, bools, ints, floats and strings are specialised constants."""
    if isinstance(value, torch.Tensor):
        return leaf(value)
    if type(value) in (tuple, list):
        return {"kind": type(value).__name__, "items": [_flatten(v, leaf, f"{where}[{i}]")
                                                        for i, v in enumerate(value)]}
    if type(value) is dict:
        for key in value:
            if type(key) not in (str, int):
                raise KilnError(f"kiln.export: {where} is a dict with a {type(key).__name__} key; only str and int "
                                "keys can be saved")
        return {"kind": "dict", "keys": list(value), "items": [_flatten(v, leaf, f"{where}[{k!r}]")
                                                               for k, v in value.items()]}
    if value is None or type(value) in (bool, int, float, str):
        return {"kind": "constant", "value": value}
    raise KilnError(f"kiln.export: {where} is a {type(value).__name__}; exported programs take and return tensors, "
                    "tuples, lists, dicts (str or int keys), None, bools, ints, floats and strings")


def _unflatten(spec, leaf):
    """The tree `spec` describes, with `leaf(spec)` for each tensor leaf."""
    kind = spec["kind"]
    if kind == "constant":
        return spec["value"]
    if kind in ("tuple", "list"):
        items = [_unflatten(s, leaf) for s in spec["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _unflatten(s, leaf) for k, s in zip(spec["keys"], spec["items"])}
    return leaf(spec)


def _tensor_spec(t):
    return {"dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device), "sizes": list(t.shape),
            "strides": list(t.stride())}


def _check_tree(spec, value, where, tensor_specs, leaves, named):
    """Appends `value`'s tensors to `leaves` in spec order, raising KilnError at the first difference from `spec`
    (`named`: the size of each Dim met so far in this call)."""
    kind = spec["kind"]
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            raise KilnError(f"{where}: expected a tensor, got {type(value).__name__}")
        expected = tensor_specs[spec["index"]]
        for field in ("dtype", "device"):
            got = str(value.dtype).removeprefix("torch.") if field == "dtype" else str(value.device)
            if got != expected[field]:
                raise KilnError(f"{where}: expected {field} {expected[field]}, got {got}")
        problem = export_shapes.check_sizes(where, list(value.shape), expected, named)
        if problem:
            raise KilnError(problem)
        leaves.append(value)
    elif kind == "constant":
        if type(value) is not type(spec["value"]) or value != spec["value"]:
            raise KilnError(f"{where}: the program was exported with {spec['value']!r} here (non-tensor arguments "
                            f"are specialised), got {value!r}")
    elif kind in ("tuple", "list"):
        if type(value) is not (tuple if kind == "tuple" else list) or len(value) != len(spec["items"]):
            got = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
            raise KilnError(f"{where}: expected a {kind} of {len(spec['items'])}, got {got}")
        for i, (s, v) in enumerate(zip(spec["items"], value)):
            _check_tree(s, v, f"{where}[{i}]", tensor_specs, leaves, named)
    elif kind == "dict":
        if type(value) is not dict or list(value) != spec["keys"]:
            got = f"keys {list(value)}" if isinstance(value, dict) else f"a {type(value).__name__}"
            raise KilnError(f"{where}: expected a dict with keys {spec['keys']}, got {got}")
        for key, s in zip(spec["keys"], spec["items"]):
            _check_tree(s, value[key], f"{where}[{key!r}]", tensor_specs, leaves, named)


def _with_strides(t, spec):
    """`t`, or a copy laid out with the strides the graph was compiled for (kiln specialises strides too; at other
    sizes of dynamic dims, the example's dim order laid out densely)."""
    strides = export_shapes.dense_strides(t, spec)
    if list(t.stride()) == strides or t.numel() == 0:
        return t
    return torch.empty_strided(tuple(t.shape), tuple(strides), dtype=t.dtype, device=t.device).copy_(t)


# ---- capture -----------------------------------------------------------------------------------------------------
def _capture(module, args, kwargs):
    """(graph, example_inputs, graph outputs of the capture run, the forward's result), tracing module(*args,
    **kwargs) with kiln's tracer under fullgraph semantics."""
    from kiln.api import _make_compiler, _run_compiled

    graphs, records = [], []

    def keep(graph, example_inputs):
        replay = _C.compile_graph(graph, "eager")

        def run(inputs):
            outputs = replay(inputs)
            graphs[-1][2] = outputs
            return outputs
        graphs.append([graph, list(example_inputs), None])
        return run

    keep.__name__ = "kiln.export"
    compiler = _make_compiler(module, keep, True, explain_sink=records)
    try:
        result = _run_compiled(compiler, type(module).__call__, (module,) + tuple(args), kwargs)
    except GraphBreakError as e:
        message = str(e).replace(", or compile without fullgraph=True", "")
        raise GraphBreakError(f"kiln.export: {message} {_EXPORT_HINT}") from None
    if len(graphs) != 1:
        reasons = [r if isinstance(r, str) else r.get("reason", str(r)) for kind, r in records if kind == "break"]
        why = f" ({'; '.join(reasons)})" if reasons else ""
        raise KilnError(f"kiln.export: forward was captured as {len(graphs)} graphs, not one{why}. Modules with hooks "
                        "and functions kiln does not trace run eagerly; export needs every tensor operation in one "
                        "graph")
    graph, example_inputs, outputs = graphs[0]
    # The backend got the graph specialised to the example's sizes; the record holds the captured one, with the size
    # symbols of the dims marked dynamic.
    captured = [r["graph"] for kind, r in records if kind == "graph" and isinstance(r, dict) and "graph" in r]
    return (captured[0] if len(captured) == 1 else graph), example_inputs, outputs, result


def _state_names(module):
    """{id(tensor): (name, "parameter" | "buffer")} for the module's parameters and buffers."""
    names = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), (name, "parameter"))
    for name, b in module.named_buffers():
        names.setdefault(id(b), (name, "buffer"))
    return names


def export(model, args, kwargs=None, *, dynamic_shapes=None):
    """Captures `model(*args, **kwargs)` (an nn.Module) as one graph and returns an ExportedProgram.

    Traced in eval mode under torch.no_grad; the module's training flag is restored afterwards. A graph break raises
    kiln.errors.GraphBreakError naming the construct and file:line. `dynamic_shapes` (torch.export's format: a dict
    by argument name or a tuple/list by position; per tensor {dim: torch.export.Dim(...)} or one entry per dim;
    Dim.DYNAMIC/Dim.AUTO, None/Dim.STATIC) declares the dims whose size may vary: the program runs at any size in
    their ranges, and export raises KilnError when the forward's code fixes such a dim. Other sizes are specialised."""
    from kiln.api import _original_module

    if not isinstance(model, nn.Module):
        raise KilnError(f"kiln.export expects an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise KilnError(f"kiln.export: args must be a tuple of positional arguments, got {type(args).__name__}")
    kwargs = {} if kwargs is None else kwargs
    if type(kwargs) is not dict:
        raise KilnError(f"kiln.export: kwargs must be a dict, got {type(kwargs).__name__}")
    module = _original_module(model)
    shapes = export_shapes.parse(module.forward, args, kwargs, dynamic_shapes)
    input_leaves = []

    def input_leaf(t):
        input_leaves.append(t)
        return {"kind": "tensor", "index": len(input_leaves) - 1}

    input_spec = _flatten((args, kwargs), input_leaf, "inputs")
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), export_shapes.marked(shapes):
            graph, example_inputs, graph_outputs, result = _capture(module, args, kwargs)
    finally:
        module.train(training)

    leaf_index = {id(t): i for i, t in enumerate(input_leaves)}
    state_names = _state_names(module)
    bindings, state, state_kinds = [], {}, {}
    for i, t in enumerate(example_inputs):
        if id(t) in leaf_index:
            bindings.append({"kind": "input", "index": leaf_index[id(t)]})
            continue
        # Anything else the graph reads is named state: parameters and buffers by their names, other tensors the
        # forward reaches (a plain tensor attribute, a global) by their graph input index.
        name, kind = state_names.get(id(t), (f"_tensor_input{i}", "tensor"))
        state[name] = t.detach()
        state_kinds[name] = kind
        bindings.append({"kind": "state", "name": name})

    output_index = {id(t): j for j, t in enumerate(graph_outputs or [])}

    def output_leaf(t):
        if id(t) in output_index:
            return {"kind": "graph_output", "index": output_index[id(t)]}
        if id(t) in leaf_index:
            return {"kind": "input", "index": leaf_index[id(t)]}
        raise KilnError("kiln.export: forward returns a tensor the captured graph does not produce (a state tensor "
                        "returned as is?); return a computed value instead")

    output_spec = _flatten(result, output_leaf, "the result")
    export_shapes.check_capture(graph, bindings, shapes)
    tensor_specs = [{**_tensor_spec(t), **extra} for t, extra in zip(input_leaves, export_shapes.stored(shapes))]
    return ExportedProgram(graph, state, state_kinds, graph.constants(), bindings, input_spec, tensor_specs,
                           output_spec)


# ---- the program -------------------------------------------------------------------------------------------------
class ExportedProgram:
    """A captured forward: `graph` (a kiln._C.Graph: print it), `state_dict` (the named tensors it reads), the input
    specification, and how outputs are rebuilt. Calling it (or `module()`) checks the inputs and runs the graph
    compiled by kiln's pipeline; `save(path)` writes one file that `kiln.load` reads."""

    def __init__(self, graph, state, state_kinds, constants, bindings, input_spec, tensor_specs, output_spec):
        self.graph = graph
        self.state_dict = state
        self._state_kinds = state_kinds
        self._constants = constants
        self._bindings = bindings
        self._input_spec = input_spec
        self._tensor_specs = tensor_specs
        self._output_spec = output_spec
        self._input_metas = [v["meta"] for v in _graph_input_metas(graph)]
        self._compiled = None
        self._ready_state = {}  # state name -> the tensor last found in the graph's layout (_run)

    def __repr__(self):
        lines = [f"ExportedProgram: {len(self._tensor_specs)} input tensors, {len(self.state_dict)} state tensors, "
                 f"{self.graph.num_nodes} nodes"]
        for i, spec in enumerate(self._tensor_specs):
            dynamic = {d["dim"]: d for d in spec.get("dynamic", [])}
            sizes = [f"{dynamic[d]['name'] or '*'} in {export_shapes.range_text(dynamic[d]['min'], dynamic[d]['max'])}"
                     if d in dynamic else str(s) for d, s in enumerate(spec["sizes"])]
            lines.append(f"  input {i}: {spec['dtype']}[{', '.join(sizes)}] on {spec['device']}")
        return "\n".join(lines) + "\n" + str(self.graph)

    def module(self):
        """An nn.Module whose parameters and buffers are this program's state (shared), and whose calls run it."""
        return ExportedModule(self)

    def __call__(self, *args, **kwargs):
        return self._run(args, kwargs, self.state_dict)

    def _compiled_graph(self):
        if self._compiled is None:
            with torch.no_grad():
                self._compiled = _C.compile_graph(self.graph, "kiln")
        return self._compiled

    def _run(self, args, kwargs, state):
        leaves = []
        _check_tree(self._input_spec, (args, kwargs), "inputs", self._tensor_specs, leaves, {})
        inputs = []
        ready = self._ready_state
        for binding, meta in zip(self._bindings, self._input_metas):
            if binding["kind"] == "input":
                inputs.append(_with_strides(leaves[binding["index"]], meta))
                continue
            # State tensors already in the graph's layout are checked once per tensor object, not at every call
            # (a model holds hundreds): a cached entry is the tensor itself, so updates in place show through.
            name = binding["name"]
            t = state[name]
            if ready.get(name) is not t:
                laid_out = _with_strides(t, meta)
                if laid_out is t:
                    ready[name] = t
                inputs.append(laid_out)
                continue
            inputs.append(t)
        compiled = self._compiled_graph()
        with torch.no_grad():
            outputs = compiled(inputs)
        return _unflatten(self._output_spec,
                          lambda s: outputs[s["index"]] if s["kind"] == "graph_output" else leaves[s["index"]])

    def save(self, path):
        """Writes the program to `path` (one zip file; see this module's docstring), atomically."""
        _save(self, os.fspath(path))


def _graph_input_metas(graph):
    doc = json.loads(graph.to_json(indent=-1))
    return [doc["values"][i] for i in doc["inputs"]]


class ExportedModule(nn.Module):
    """ExportedProgram.module(): the program's state as parameters and buffers under their original names (sharing
    storage with the program's state_dict), and a forward that runs the compiled graph. Inference only."""

    def __init__(self, program):
        super().__init__()
        self._program = program
        self._paths = {}
        for name, t in program.state_dict.items():
            owner, _, leaf = name.rpartition(".")
            parent = self
            for part in owner.split(".") if owner else []:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            if program._state_kinds.get(name) == "parameter":
                parent.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
            else:
                parent.register_buffer(leaf, t)
            self._paths[name] = (parent, leaf)
        self._state = None

    def _apply(self, fn, *args, **kwargs):
        self._state = None  # tensors may be replaced (.to(), .half()): read them again on the next call
        return super()._apply(fn, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._state is None:
            self._state = {name: getattr(parent, leaf) for name, (parent, leaf) in self._paths.items()}
        return self._program._run(args, kwargs, self._state)


# ---- the file ----------------------------------------------------------------------------------------------------
# safetensors' dtype names (https://github.com/huggingface/safetensors: the format's specification).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
_DTYPES_BY_SAFETENSORS_NAME = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def _safetensors_bytes(tensors):
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise KilnError(f"ExportedProgram.save: tensor {name} has dtype {t.dtype}, which the weights format "
                            "(safetensors) cannot hold")
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _tensors_from_safetensors(data):
    """{name: CPU tensor} from safetensors bytes; a malformed buffer raises ValueError."""
    if len(data) < 8:
        raise ValueError("shorter than its header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ValueError("header longer than the entry")
    header = json.loads(data[8:8 + length])
    body = memoryview(data)[8 + length:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES_BY_SAFETENSORS_NAME.get(info["dtype"])
        begin, end = info["data_offsets"]
        if dtype is None or not 0 <= begin <= end <= len(body):
            raise ValueError(f"tensor {name}: bad dtype or offsets")
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8) if end > begin else \
            torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(info["shape"])
    return tensors


def _environment(program):
    """What compiled code depends on beyond kiln's format: recorded in the manifest, compared on load."""
    devices = {spec["device"] for spec in program._tensor_specs} | {str(t.device) for t in program.state_dict.values()}
    cuda = sorted(d for d in devices if d.startswith("cuda"))
    arch = None
    if cuda and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(torch.device(cuda[0]))
        arch = f"sm_{major}{minor}"
    return {"torch_version": torch.__version__, "cuda_version": torch.version.cuda if cuda else None,
            "gpu_arch": arch, "devices": sorted(devices)}


def _save(program, path):
    state_tensors = {f"state.{name}": t for name, t in program.state_dict.items()}
    constant_tensors = {f"constant.{vid}": t for vid, t in program._constants.items()}
    program_doc = {
        "inputs": program._input_spec,
        "input_tensors": program._tensor_specs,
        "outputs": program._output_spec,
        "graph_inputs": program._bindings,
        "state": [{"name": name, "kind": program._state_kinds[name], "device": str(t.device)}
                  for name, t in program.state_dict.items()],
        "constants": [{"value": int(vid), "device": str(t.device)} for vid, t in program._constants.items()],
    }
    entries = {
        "graph.json": program.graph.to_json(indent=1).encode(),
        "program.json": json.dumps(program_doc, indent=1).encode(),
        "weights.safetensors": _safetensors_bytes({**state_tensors, **constant_tensors}),
    }
    kernels = _compiled_code(program)
    entries.update(kernels)
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "kiln_version": _kiln_version(),
                "kiln_build": _C._kiln_build(), **_environment(program), "kernels": sorted(kernels),
                "entries": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                            for name, data in entries.items()}}
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".kiln-export-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as archive:
            archive.writestr("manifest.json", json.dumps(manifest, indent=1))
            for name, data in entries.items():
                archive.writestr(name, data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _compiled_code(program):
    """{"kernels/<kind>/<key><suffix>": bytes}: the disk-cache entries one compile of the graph uses (the compiled
    graph record, the C++ library or the CUDA images), recorded by kiln's cache journal (cache/cache_journal.h).
    Empty when the disk cache is off or the graph runs on the eager interpreter."""
    _C._open_cache_journal()
    try:
        with torch.no_grad():
            _C.compile_graph(program.graph, "kiln")
    finally:
        used = _C._close_cache_journal()
    # The generated C++ source is kept next to its library for debugging; loading needs only the library.
    return {f"kernels/{kind}/{key}{suffix}": content for kind, key, suffix, content in used if suffix != ".cpp"}


def _kiln_version():
    import kiln
    return kiln.__version__


def _read_entries(path):
    """{entry: bytes} and the manifest, every entry checked against the manifest's hash; KilnError otherwise."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if "manifest.json" not in names:
                raise KilnError(f"kiln.load: {path} has no manifest.json: not a file ExportedProgram.save wrote")
            manifest = json.loads(archive.read("manifest.json"))
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
                raise KilnError(f"kiln.load: {path} is not a kiln export (manifest format "
                                f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
            if manifest.get("format_version") not in _READABLE_VERSIONS:
                raise KilnError(f"kiln.load: {path} has format version {manifest.get('format_version')!r}; this kiln "
                                f"reads versions {', '.join(map(str, _READABLE_VERSIONS))}: export the model again "
                                "with this kiln")
            entries = {}
            kernels = manifest.get("kernels", [])
            if not isinstance(kernels, list) or not all(isinstance(k, str) and _KERNEL_ENTRY.fullmatch(k)
                                                        for k in kernels):
                raise KilnError(f"kiln.load: {path} lists malformed kernel entries in its manifest")
            for name in _ENTRIES + tuple(kernels):
                listed = manifest.get("entries", {}).get(name)
                if name not in names or not isinstance(listed, dict):
                    raise KilnError(f"kiln.load: {path} lacks the entry {name}: the file is incomplete")
                data = archive.read(name)
                if hashlib.sha256(data).hexdigest() != listed.get("sha256"):
                    raise KilnError(f"kiln.load: entry {name} of {path} does not match its SHA-256 in the manifest: "
                                    "the file is corrupted")
                entries[name] = data
            return manifest, entries
    except KilnError:
        raise
    except FileNotFoundError:
        raise KilnError(f"kiln.load: no file {path}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, KeyError) as e:
        # ValueError covers bad JSON in the manifest; zlib and CRC failures come as BadZipFile.
        raise KilnError(f"kiln.load: {path} is not a readable kiln export ({type(e).__name__}: {e}): the file is "
                        "truncated or corrupted") from None


def _graph_from_json(doc, constants):
    """A kiln._C.Graph from Graph.to_json's document, with `constants` ({value id: tensor}) attached."""
    device_codes = _C._enum_codes()["device_types"]

    def real(v):
        return float(v) if isinstance(v, str) else v  # "nan", "inf", "-inf"

    def meta(m):
        return (m["sizes"], m["strides"], m["storage_offset"], m["dtype_code"], device_codes[m["device"]["type"]],
                m["device"]["index"], m["requires_grad"])

    def arg(a):
        kind, value = a["kind"], a["value"]
        if kind == "float":
            return ("float", real(value))
        if kind == "float_list":
            return ("floats", [real(v) for v in value])
        if kind == "complex":
            return ("complex", complex(real(value[0]), real(value[1])))
        if kind == "dtype":
            return ("dtype", a["code"])
        if kind == "device":
            return ("device", (device_codes[value["type"]], value["index"]))
        tags = {"tensor_list": "tensors", "int_list": "ints", "bool_list": "bools"}
        return (tags.get(kind, kind), value)

    values = []
    for v in doc["values"]:
        if "input_index" in v:
            values.append(("input", meta(v["meta"]), v["input_index"]))
        elif v.get("constant"):
            values.append(("constant", meta(v["meta"]), constants[v["id"]]))
        else:
            values.append(("node", meta(v["meta"]), v["producer"]))
    nodes = []
    for n in doc["nodes"]:
        positional = sum(1 for a in n["args"] if not a["kwarg_only"])
        nodes.append((n["op"], n["overload"], [arg(a) for a in n["args"]], [a["name"] for a in n["args"]],
                      positional, n["outputs"], n["returns_list"], n["mutates_args"], n["is_view"]))
    graph = _C._graph_from_records(values, nodes, doc["outputs"])
    if "symbolic" in doc:  # a dynamic program: the size symbols, their origins and the relations the graph needs
        graph = _C._graph_with_symbolic_sizes(graph, json.dumps(doc))
    return graph


def load(path, *, recompile=True):
    """Reads a file ExportedProgram.save wrote and returns the ExportedProgram (no model source needed).

    When torch, kiln's build and the GPU architecture match the file's, its compiled code goes into kiln's disk cache
    and the first call runs no compiler. Otherwise the saved graph is compiled here on the first call, with the reason
    logged (KILN_LOGS=recompiles); with recompile=False such a mismatch raises KilnError instead. A truncated or
    corrupted file raises KilnError."""
    path = os.fspath(path)
    manifest, entries = _read_entries(path)
    _use_compiled_code(path, manifest, entries, recompile)
    try:
        graph_doc = json.loads(entries["graph.json"])
        program_doc = json.loads(entries["program.json"])
        weights = _tensors_from_safetensors(entries["weights.safetensors"])
        constants = {c["value"]: weights[f"constant.{c['value']}"].to(c["device"]) for c in program_doc["constants"]}
        graph = _graph_from_json(graph_doc, constants)
        state = {s["name"]: weights[f"state.{s['name']}"].to(s["device"]) for s in program_doc["state"]}
        kinds = {s["name"]: s["kind"] for s in program_doc["state"]}
        program = ExportedProgram(graph, state, kinds, constants, program_doc["graph_inputs"], program_doc["inputs"],
                                  program_doc["input_tensors"], program_doc["outputs"])
    except KilnError as e:
        raise KilnError(f"kiln.load: {path}: the graph does not read back ({e})") from None
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise KilnError(f"kiln.load: {path} holds a malformed program ({type(e).__name__}: {e})") from None
    return program


def _use_compiled_code(path, manifest, entries, recompile):
    """Puts the file's compiled code into kiln's disk cache, where the first call's compile finds it (no compiler
    runs), or logs why the graph will be compiled here instead (raises with recompile=False)."""
    if manifest.get("cuda_version") and not torch.cuda.is_available():
        raise KilnError(f"kiln.load: {path} holds a CUDA program (saved with CUDA {manifest['cuda_version']}, "
                        f"{manifest.get('gpu_arch')}) and this process has no CUDA device")
    here = {"torch_version": torch.__version__, "gpu_arch": None, "kiln_build": _C._kiln_build()}
    if manifest.get("gpu_arch") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        here["gpu_arch"] = f"sm_{major}{minor}"
    reasons = [f"{key} {manifest.get(key)} in the file, {here[key]} here" for key in here
               if manifest.get(key) != here[key]]
    kernels = manifest.get("kernels", [])
    if not reasons:
        for name in kernels:
            kind, key, suffix = _KERNEL_ENTRY.fullmatch(name).groups()
            if not _C._publish_cache_entry(kind, key, suffix, entries[name]):
                reasons = ["kiln's disk cache is off (see KILN_CACHE_DIR), so the file's compiled code cannot be used"]
                break
    if not reasons:
        return
    if not recompile:
        raise KilnError(f"kiln.load: {path} was saved for another environment ({'; '.join(reasons)}) and "
                        "recompile=False; load with recompile=True to compile the saved graph here")
    _C.log("recompiles", f"kiln.load: {path}: compiling the saved graph for this machine: {'; '.join(reasons)}")
