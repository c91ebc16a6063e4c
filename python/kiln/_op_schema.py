"""What kiln's recorder (kiln._fake) reads from an ATen op overload's schema, computed once per overload: argument
kinds and names, which arguments are sizes (SymInt), what the op writes or views, and why it cannot be captured."""
import torch

# Ops whose result depends on tensor data, with the reason users see. Ops tagged dynamic_output_shape
# or data_dependent_output are tried on meta (index.Tensor with integer indices works, with a bool mask
# it cannot), and any failure of theirs is reported as data-dependent.
_DATA_DEPENDENT = {
    "aten::_local_scalar_dense": "it reads a tensor's value into Python (item(), bool(), int(), float(), tolist())",
    "aten::is_nonzero": "it reads a tensor's value into Python (bool(tensor))",
    "aten::equal": "it returns a Python bool computed from tensor data",
    "aten::nonzero": "its output shape depends on tensor data",
    "aten::masked_select": "its output shape depends on tensor data",
    "aten::unique_consecutive": "its output shape depends on tensor data",
    "aten::_unique2": "its output shape depends on tensor data",
    "aten::_assert_async": "it checks tensor data",
}
_DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


class OpInfo:
    """What the recorder needs from one op overload's schema, computed once per overload."""

    __slots__ = ("op", "overload", "qualified", "arguments", "names", "num_positional", "float_args",
                 "device_args", "list_kinds", "has_tensor_args", "mutates_args", "is_view", "returns_list",
                 "num_returns", "written_args", "refusal", "data_dependent", "python_meta", "size_args",
                 "functional_twin")

    def __init__(self, func):
        schema = func._schema
        self.op = schema.name
        self.overload = func._overloadname
        self.qualified = f"{self.op}.{self.overload}"
        self.arguments = list(schema.arguments)
        self.names = [a.name for a in self.arguments]
        self.num_positional = sum(1 for a in self.arguments if not a.kwarg_only)
        type_names = [str(a.type) for a in self.arguments]
        self.float_args = {i for i, t in enumerate(type_names) if t in ("float", "Optional[float]")}
        self.device_args = {i for i, t in enumerate(type_names) if t in ("Device", "Optional[Device]")}
        self.list_kinds = {i: list_kind(t) for i, t in enumerate(type_names) if "List[" in t}
        self.has_tensor_args = any("Tensor" in t for t in type_names)
        self.size_args = size_argument_indices(str(schema), len(self.arguments))
        self.written_args = [i for i, a in enumerate(self.arguments) if a.alias_info is not None and a.alias_info.is_write]
        self.mutates_args = bool(self.written_args)
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        return_types = [str(r.type) for r in schema.returns]
        self.returns_list = return_types == ["List[Tensor]"]
        self.num_returns = len(return_types)
        self.python_meta = None   # whether its Meta kernel is Python (_torch_meta.has_python_meta), on first need
        self.refusal = _DATA_DEPENDENT.get(self.op)
        self.data_dependent = any(tag in func.tags for tag in _DATA_DEPENDENT_TAGS)
        if self.refusal is None and not self.returns_list and any(t != "Tensor" for t in return_types):
            self.refusal = f"it returns {', '.join(return_types)}, not tensors"
        self.functional_twin = _functional_twin(func, schema, self.written_args)


def _functional_twin(func, schema, written_args):
    """For an out= overload writing one kwarg-only `out` (`div.out(self, other, *, out)`): the overload of the same op
    taking the other arguments, with their names and types, and writing nothing (`div.Tensor`); else None."""
    if len(written_args) != 1 or not schema.arguments[written_args[0]].kwarg_only or len(schema.returns) != 1:
        return None
    wanted = [(a.name, str(a.type), a.kwarg_only) for i, a in enumerate(schema.arguments) if i != written_args[0]]
    packet = func._overloadpacket
    for name in packet.overloads():
        twin = getattr(packet, name)
        arguments = twin._schema.arguments
        if (twin is not func and [(a.name, str(a.type), a.kwarg_only) for a in arguments] == wanted
                and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments)
                and len(twin._schema.returns) == 1):
            return twin
    return None


def size_argument_indices(schema_text, num_arguments):
    """Indexes of the arguments a schema declares SymInt (the Python bindings show them as int): read from its text,
    `aten::narrow(Tensor(a) self, int dim, SymInt start, SymInt length) -> Tensor(a)`."""
    inside = schema_text[schema_text.index("(") + 1:]
    depth, start, declarations = 0, 0, []
    for i, ch in enumerate(inside):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                declarations.append(inside[start:i])
                break
            depth -= 1
        elif ch == "," and depth == 0:
            declarations.append(inside[start:i])
            start = i + 1
    declarations = [d.strip() for d in declarations if d.strip() and d.strip() != "*"]
    if len(declarations) != num_arguments:
        return ()
    return tuple(i for i, d in enumerate(declarations) if d.startswith("SymInt"))


def list_kind(type_name):
    if "Tensor" in type_name:
        return "tensors"
    if "float" in type_name or "number" in type_name:
        return "floats"
    if "bool" in type_name:
        return "bools"
    return "ints"
