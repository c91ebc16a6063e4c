"""kiln.export's dynamic_shapes: torch.export's spec format read into one entry per input tensor, the marks that make
the tracer turn those dims into size symbols, the check that the captured graph kept them symbolic over their whole
range, and the run-time check of a call's sizes.

A spec follows the forward's arguments: a dict keyed by argument names, or a tuple/list in argument order (positional,
then keyword). Each tensor's entry is a dict {dim: spec} or a tuple/list with one spec per dim; containers nest as the
arguments do. A dim spec is torch.export.Dim("name", min=, max=) (only its name and range are read),
Dim.DYNAMIC / Dim.AUTO (dynamic, no name), or None / Dim.STATIC / an int (static). Dims that share a Dim (by name) are
one size: the check at run time says so when they differ.

What the program stores per input tensor (program.json's input_tensors[i]): "name" (the argument path, `x`,
`xs[1]`) and "dynamic": [{"dim", "name" (the Dim's, or null), "min", "max" (null: unbounded)}].
"""
import contextlib
import inspect

import torch

from kiln.errors import KilnError

_MIN_SYMBOLIC = 2  # sizes 0 and 1 are always specialised (they change broadcasting and empty tensors)
# Sizes at which every relation the graph needs is tried, besides each range's ends and the example's neighbours.
_PROBES = (2, 3, 7, 13, 37, 97, 1021)


# ---- reading the spec --------------------------------------------------------------------------------------------
def _is_dim_hint(spec):
    return type(spec).__name__ == "_DimHint" and hasattr(spec, "type")


def _dim_spec(spec, where, size):
    """{"name", "min", "max"} for a dim `spec` declares dynamic, None for a static one; KilnError if malformed."""
    from torch.export import Dim

    if spec is None:
        return None
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec != size:
            raise KilnError(f"kiln.export: dynamic_shapes gives {where} the static size {spec}, but the example's "
                            f"size is {size}")
        return None
    if _is_dim_hint(spec):
        if spec.type.name == "STATIC":
            return None
        name, low, high = None, spec.min, spec.max
    elif isinstance(spec, Dim):
        if hasattr(spec, "root") or hasattr(spec, "fn"):
            raise KilnError(f"kiln.export: {where} is declared as {spec.__name__}, a derived Dim; kiln.export takes "
                            "only plain Dims: declare the dim with a Dim of its own")
        if hasattr(spec, "value"):  # torch's _StaticDim
            return _dim_spec(int(spec.value), where, size)
        name, low, high = spec.__name__, spec.min, spec.max
    else:
        raise KilnError(f"kiln.export: {where} has the dynamic_shapes entry {spec!r}; a dim's entry is "
                        "torch.export.Dim('name', min=, max=), Dim.DYNAMIC, Dim.AUTO, Dim.STATIC, an int or None")
    low = low if isinstance(low, int) and low > 0 else None
    high = high if isinstance(high, int) else None  # torch's unbounded max is int_oo, not an int
    if low is not None and high is not None and low > high:
        raise KilnError(f"kiln.export: {where}: the declared range has min {low} > max {high}")
    label = f"{where} (Dim {name!r})" if name else where
    if size < _MIN_SYMBOLIC:
        raise KilnError(f"kiln.export: {label} is declared dynamic, but the example's size is {size}: kiln, like "
                        "torch.export, specialises sizes 0 and 1; export with an example of size 2 or more there")
    if (low is not None and size < low) or (high is not None and size > high):
        raise KilnError(f"kiln.export: {label} is {size} in the example, outside its declared range "
                        f"{range_text(low, high)}")
    return {"name": name, "min": low, "max": high}


def range_text(low, high):
    """`[2, 64]`, or `[2, inf)` without a max: as the graph printer writes a symbol's range."""
    low = max(low or _MIN_SYMBOLIC, _MIN_SYMBOLIC)
    return f"[{low}, inf)" if high is None else f"[{low}, {high}]"


def _tensor_dims(t, spec, where):
    """{dim: dim spec} of the dims `spec` declares dynamic for tensor `t`."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        items = []
        for dim, s in spec.items():
            if type(dim) is not int:
                raise KilnError(f"kiln.export: {where}'s dynamic_shapes entry is a dict keyed by {dim!r}; its keys "
                                "are dims (ints)")
            if not -t.dim() <= dim < t.dim():
                raise KilnError(f"kiln.export: {where}'s dynamic_shapes entry names dim {dim}, out of range for a "
                                f"{t.dim()}-d tensor")
            items.append((dim % t.dim(), s))
    elif type(spec) in (tuple, list):
        if len(spec) != t.dim():
            raise KilnError(f"kiln.export: {where} is a {t.dim()}-d tensor, and its dynamic_shapes entry has "
                            f"{len(spec)} dims; give one per dim (None for a static one) or a dict {{dim: Dim}}")
        items = list(enumerate(spec))
    else:
        raise KilnError(f"kiln.export: {where} is a tensor; its dynamic_shapes entry must be a dict {{dim: Dim}}, a "
                        f"tuple/list with one entry per dim, or None, got {type(spec).__name__}")
    dims = {}
    for dim, s in items:
        parsed = _dim_spec(s, f"{where} dim {dim}", t.shape[dim])
        if parsed is not None:
            dims[dim] = parsed
    return dims


def _walk(value, spec, where, tensors):
    """Appends (where, tensor, {dim: dim spec}) for each tensor of `value`, in the order export flattens them."""
    if isinstance(value, torch.Tensor):
        tensors.append((where, value, _tensor_dims(value, spec, where)))
    elif type(value) in (tuple, list):
        if spec is not None and (type(spec) not in (tuple, list) or len(spec) != len(value)):
            raise KilnError(f"kiln.export: {where} is a {type(value).__name__} of {len(value)}; its dynamic_shapes "
                            f"entry must be None or a tuple/list of {len(value)} entries, got {spec!r}")
        for i, item in enumerate(value):
            _walk(item, None if spec is None else spec[i], f"{where}[{i}]", tensors)
    elif type(value) is dict:
        if spec is not None and (not isinstance(spec, dict) or set(spec) - set(value)):
            raise KilnError(f"kiln.export: {where} is a dict with keys {list(value)}; its dynamic_shapes entry must "
                            f"be None or a dict with some of those keys, got {spec!r}")
        for key, item in value.items():
            _walk(item, None if spec is None else spec.get(key), f"{where}[{key!r}]", tensors)
    elif spec is not None:
        raise KilnError(f"kiln.export: {where} is a {type(value).__name__}, not a tensor: its dynamic_shapes entry "
                        f"must be None, got {spec!r}")


def _argument_specs(forward, args, kwargs, dynamic_shapes):
    """[(name, value, spec)] for the positional then keyword arguments."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    kinds = inspect.Parameter
    positional = [p.name for p in parameters.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    names = [positional[i] if i < len(positional) else f"args[{i}]" for i in range(len(args))] + list(kwargs)
    values = list(args) + list(kwargs.values())
    if type(dynamic_shapes) in (tuple, list):
        if len(dynamic_shapes) not in (len(args), len(values)):
            raise KilnError(f"kiln.export: dynamic_shapes is a {type(dynamic_shapes).__name__} of "
                            f"{len(dynamic_shapes)} entries; give one per argument ({len(values)}: "
                            f"{', '.join(names)}), or a dict keyed by argument name")
        specs = list(dynamic_shapes) + [None] * (len(values) - len(dynamic_shapes))
        return list(zip(names, values, specs))
    if not isinstance(dynamic_shapes, dict):
        raise KilnError(f"kiln.export: dynamic_shapes must be a dict keyed by argument name, a tuple/list with one "
                        f"entry per argument, or None, got {type(dynamic_shapes).__name__}")
    var_positional = next((p.name for p in parameters.values() if p.kind is kinds.VAR_POSITIONAL), None)
    specs = [None] * len(values)
    for key, spec in dynamic_shapes.items():
        if key in names:
            specs[names.index(key)] = spec
        elif key == var_positional and len(args) > len(positional):
            extra = len(args) - len(positional)
            if spec is not None and (type(spec) not in (tuple, list) or len(spec) != extra):
                raise KilnError(f"kiln.export: dynamic_shapes[{key!r}] must be a tuple/list of {extra} entries, one "
                                f"per argument *{key} receives")
            for i in range(extra):
                specs[len(positional) + i] = None if spec is None else spec[i]
        elif key in parameters:
            if spec is not None:
                raise KilnError(f"kiln.export: dynamic_shapes names {key!r}, an argument the example call does not "
                                "pass")
        else:
            raise KilnError(f"kiln.export: dynamic_shapes names {key!r}, which is not an argument of forward (its "
                            f"arguments: {', '.join(parameters) or 'none'})")
    return list(zip(names, values, specs))


def parse(forward, args, kwargs, dynamic_shapes):
    """Per input tensor, in export's flattening order: (argument path, tensor, {dim: {"name", "min", "max"}})."""
    tensors = []
    if dynamic_shapes is None:
        _walk((args, kwargs), None, "inputs", tensors)
        return tensors
    for name, value, spec in _argument_specs(forward, args, kwargs, dynamic_shapes):
        _walk(value, spec, name, tensors)
    _check_shared_dims(tensors)
    return tensors


def _check_shared_dims(tensors):
    """Dims that share a Dim must have equal example sizes and one range."""
    first = {}
    for where, t, dims in tensors:
        for dim, spec in dims.items():
            if spec["name"] is None:
                continue
            seen = first.setdefault(spec["name"], (where, dim, t.shape[dim], spec))
            other_where, other_dim, size, other = seen
            if (other["min"], other["max"]) != (spec["min"], spec["max"]):
                raise KilnError(f"kiln.export: two Dims are named {spec['name']!r} with different ranges "
                                f"({other_where} dim {other_dim}, {where} dim {dim}); one name is one Dim")
            if size != t.shape[dim]:
                raise KilnError(f"kiln.export: {other_where} dim {other_dim} and {where} dim {dim} share Dim "
                                f"{spec['name']!r}, so they must be equal, but the example's sizes are {size} and "
                                f"{t.shape[dim]}")


def stored(tensors):
    """Each input tensor's entries for program.json: {"name", "dynamic"}."""
    return [{"name": where, "dynamic": [{"dim": d, **spec} for d, spec in sorted(dims.items())]}
            for where, _, dims in tensors]


# ---- capture -----------------------------------------------------------------------------------------------------
_MISSING = object()


@contextlib.contextmanager
def marked(tensors):
    """The tensors marked as kiln.mark_dynamic marks them (their other dims static) while the forward is traced; the
    user's own marks are back afterwards."""
    saved = {}
    try:
        for _, t, dims in tensors:
            if id(t) not in saved:
                saved[id(t)] = (t, getattr(t, "_kiln_dynamic_dims", _MISSING),
                                getattr(t, "_kiln_static_dims", _MISSING))
                t._kiln_dynamic_dims = {}
            t._kiln_dynamic_dims = {**t._kiln_dynamic_dims, **{d: (s["min"], s["max"]) for d, s in dims.items()}}
            t._kiln_static_dims = set(range(t.dim())) - set(t._kiln_dynamic_dims)
        yield
    finally:
        for t, dynamic, static in saved.values():
            for attribute, value in (("_kiln_dynamic_dims", dynamic), ("_kiln_static_dims", static)):
                if value is _MISSING:
                    t.__dict__.pop(attribute, None)
                else:
                    setattr(t, attribute, value)


def check_capture(graph, bindings, tensors):
    """Raises KilnError (a constraint violation, as torch.export names it) when the graph does not hold at every size
    the spec allows: a dynamic dim that never became a size symbol or was pinned to its example size, or a relation
    the code relies on (a branch on the size, a reshape that needs a multiple, two dims taken as equal) that fails
    somewhere in a dim's range. Relations are tried at each range's ends, the example's neighbours and a few primes,
    one group of equal dims (a named Dim, or one unnamed dim) moved at a time."""
    summary = graph.symbolic_summary() if hasattr(graph, "symbolic_summary") else {"symbols": []}
    symbols = {(s["input"], s["dim"]): s for s in summary["symbols"]}
    pinned = {p["symbol"]: p for p in summary.get("specialisations", [])}
    reasons = {a["text"]: a["reason"] for a in summary.get("assumptions", [])}
    violations, groups = [], {}
    for j, binding in enumerate(bindings):
        if binding["kind"] != "input":
            continue
        where, t, dims = tensors[binding["index"]]
        for dim, spec in dims.items():
            label = f"{where} dim {dim}" + (f" (Dim {spec['name']!r})" if spec["name"] else "")
            symbol = symbols.get((j, dim))
            if symbol is None:
                violations.append(f"{label}: the trace specialised it to {t.shape[dim]} (the code uses its size as a "
                                  "constant: KILN_LOGS=dynamic says where)")
            elif symbol["name"] in pinned:
                violations.append(f"{label}: the graph was specialised to {symbol['name']} == "
                                  f"{pinned[symbol['name']]['value']} ({pinned[symbol['name']]['reason']})")
            else:
                key = spec["name"] or (where, dim)
                groups.setdefault(key, {"label": label, "spec": spec, "hint": t.shape[dim], "symbols": []})
                groups[key]["symbols"].append(symbol["name"])
    hints = {s["name"]: s["hint"] for s in summary["symbols"]}
    for group in groups.values():
        low, high = max(group["spec"]["min"] or _MIN_SYMBOLIC, _MIN_SYMBOLIC), group["spec"]["max"]
        hint = group["hint"]
        probes = {low, low + 1, hint - 1, hint + 1, 2 * hint + 1, *_PROBES} | ({high - 1, high} if high else set())
        for value in sorted(p for p in probes if p >= low and (high is None or p <= high)):
            failed = _failed_relations(graph, {**hints, **{name: value for name in group["symbols"]}})
            if failed:
                why = "; ".join(f"{text} ({reasons.get(text, 'specialised')})" for text in failed)
                violations.append(f"{group['label']}, range {range_text(group['spec']['min'], high)}: the graph "
                                  f"needs {why}, which fails at size {value}")
                break
    if violations:
        duck = any("duck sizing" in v for v in violations)
        raise KilnError("kiln.export: the forward does not hold for every size dynamic_shapes allows (a constraint "
                        "violation):\n  " + "\n  ".join(violations) + "\n" +
                        ("Dims of equal size in the example are taken as one size: give the example different sizes "
                         "in dims that vary apart, or one Dim to dims that are always equal. " if duck else "") +
                        "Declare such a dim static (None), narrow its range, or change the code so that it does not "
                        "depend on the size")


def _failed_relations(graph, values):
    try:
        return list(graph.evaluate_sizes(values)["failed_assumptions"])
    except KilnError as e:  # an expression the sizes make undefined (a division by zero): the graph does not hold
        return [str(e)]


# ---- calls -------------------------------------------------------------------------------------------------------
def check_sizes(where, got, spec, named):
    """A message when sizes `got` do not fit tensor spec `spec` (static dims equal, dynamic dims in their range, dims
    sharing a Dim equal to what `named` recorded for that Dim in this call), else None."""
    expected = spec["sizes"]
    dynamic = {d["dim"]: d for d in spec.get("dynamic", [])}
    shown = tuple(dynamic[d]["name"] or "*" if d in dynamic else s for d, s in enumerate(expected)) if dynamic \
        else tuple(expected)
    if len(got) != len(expected):
        return f"{where}: expected a {len(expected)}-d tensor of shape {_shape(shown)}, got shape {tuple(got)}"
    for d, (size, want) in enumerate(zip(got, expected)):
        if d not in dynamic:
            if size != want:
                hint = (f"dim {d} was exported static: declare it in dynamic_shapes to vary it" if dynamic
                        else "kiln.export specialises sizes unless dynamic_shapes declares the dim dynamic")
                return f"{where}: expected shape {_shape(shown)}, got {tuple(got)}: {hint}"
            continue
        d_spec = dynamic[d]
        argument = f" ({spec['name']})" if spec.get("name") and spec["name"] != where else ""
        label = f"{where}{argument} dim {d}" + (f" (Dim {d_spec['name']!r})" if d_spec["name"] else "")
        low, high = max(d_spec["min"] or _MIN_SYMBOLIC, _MIN_SYMBOLIC), d_spec["max"]
        if size < low or (high is not None and size > high):
            extra = " (sizes 0 and 1 are specialised)" if size < _MIN_SYMBOLIC else ""
            return f"{label} is {size}, outside its range {range_text(d_spec['min'], high)}{extra}"
        if d_spec["name"]:
            first = named.setdefault(d_spec["name"], (label, size))
            if first[1] != size:
                return (f"{first[0]} is {first[1]} and {label} is {size}: dims that share Dim {d_spec['name']!r} "
                        "must be equal")
    return None


def _shape(sizes):
    return "(" + ", ".join(str(s) for s in sizes) + ("," if len(sizes) == 1 else "") + ")"


def dense_strides(t, spec):
    """The strides the graph takes for `t` whose dynamic dims differ from the example: the example's dim order laid
    out densely at `t`'s sizes (the example's strides when the sizes are the example's)."""
    if list(t.shape) == spec["sizes"]:
        return spec["strides"]
    order = sorted(range(t.dim()), key=lambda d: (-spec["strides"][d], d))
    strides, step = [0] * t.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(t.shape[d], 1)
    return strides
