"""Helpers for tests that compare kiln with eager PyTorch.

    from kiln.testing import assert_same_as_eager
    out = assert_same_as_eager(model, x)            # outputs and gradients, dtype tolerances
    out = assert_same_as_eager(fn, x, y, grads=False)

Every kiln test checks correctness through `assert_same_as_eager`, so the tolerance table below is
the one place that says how close "the same" is.
"""
import copy
import enum
import numbers

import torch

__all__ = ["assert_same_as_eager", "tolerance", "random_like", "random_tensor", "random_class_targets"]

# (rtol, atol) by dtype. "general" covers reductions and matmul, whose summation order may
# legitimately differ from eager's; "pointwise" is for kernels that compute each element the
# same way eager does. Integers and bools must match exactly.
_GENERAL_TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    # float16 has ~1e-3 relative spacing: a fused chain computed in float and rounded once differs from
    # eager's op-by-op rounding by a few ulps (seen: 2 ulps on a 4-op chain), hence 5e-3.
    torch.float16: (5e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
_POINTWISE_TOLERANCE = {**_GENERAL_TOLERANCE, torch.float32: (1.3e-6, 1e-5), torch.complex64: (1.3e-6, 1e-5)}
_TOLERANCE_TABLES = {"general": _GENERAL_TOLERANCE, "pointwise": _POINTWISE_TOLERANCE}
# 8-bit floats have fewer mantissa bits than bfloat16: compare them as loosely as one ulp allows.
_FLOAT8_TOLERANCE = (1.25e-1, 1e-1)
# float32 on CUDA while cuDNN may use TF32 (torch.backends.cudnn.allow_tf32, on by default): convolutions keep
# 10 mantissa bits, so a different but equally valid kernel choice (kiln runs convolution chains channels-last)
# moves results by TF32's precision, not float32's (seen: 3.7e-5 on a stem weight's gradient).
_CUDA_TF32_TOLERANCE = (1e-3, 1e-4)


def tolerance(dtype, kind="general"):
    """(rtol, atol) for comparing a kiln result of `dtype` with eager's.

    kind: "general" (default; reductions, matmul, whole models) or "pointwise" (tighter float32).
    Integer and bool dtypes give (0, 0): exact.
    """
    if kind not in _TOLERANCE_TABLES:
        raise ValueError(f"tolerance kind must be one of {sorted(_TOLERANCE_TABLES)}, not {kind!r}")
    table = _TOLERANCE_TABLES[kind]
    if dtype in table:
        return table[dtype]
    if dtype.is_floating_point:
        return _FLOAT8_TOLERANCE
    return (0.0, 0.0)


def random_tensor(*shape, dtype=torch.float32, device="cpu", requires_grad=False, generator=None):
    """Fresh random values, never zeros, so a kernel that writes nothing cannot pass a comparison.

    Floating/complex: standard normal; integers: uniform in [-9, 9] without 0 (unsigned: [1, 9]);
    bool: random True/False.
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    shape = tuple(shape)
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(shape, generator=generator, dtype=torch.float64 if dtype.is_floating_point
                             else torch.complex128).to(dtype)
    elif dtype == torch.bool:
        values = torch.randint(0, 2, shape, generator=generator).bool()
    else:
        signed = dtype != torch.uint8
        magnitude = torch.randint(1, 10, shape, generator=generator)
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1 if signed else 1
        values = (magnitude * sign).to(dtype)
    values = values.to(device)
    if requires_grad:
        values.requires_grad_(True)
    return values


def random_like(tensor, *, dtype=None, device=None, requires_grad=None, generator=None):
    """A random tensor with `tensor`'s shape, dtype, device and requires_grad (each can be overridden)."""
    return random_tensor(
        tuple(tensor.shape),
        dtype=tensor.dtype if dtype is None else dtype,
        device=tensor.device if device is None else device,
        requires_grad=tensor.requires_grad if requires_grad is None else requires_grad,
        generator=generator)


def random_class_targets(rows, classes, ignored="none", ignore_index=-100, device="cpu"):
    """Class indices for a classification loss: `rows` of them in [0, classes), int64.

    ignored: "none"; "some" (every third row is `ignore_index`) or "all" (every row is).
    """
    targets = torch.randint(0, classes, (rows,))
    if ignored == "some":
        targets[::3] = ignore_index
    elif ignored == "all":
        targets[:] = ignore_index
    elif ignored != "none":
        raise ValueError(f"ignored must be 'none', 'some' or 'all', not {ignored!r}")
    return targets.to(device)


def _map_tensors(fn, value, memo=None):
    """Applies fn to every tensor inside nested tuples/lists/dicts; other values pass through.

    A tensor that appears twice maps to one result, so aliasing between arguments is kept.
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = fn(value)
        return memo[id(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(fn, v, memo) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v, memo) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(fn, v, memo)) for k, v in value.items())
    return value


def _flatten(value, path="output", _depth=0):
    """[(path, leaf)] for every leaf of nested tuples/lists/dicts, in order. Instances of user classes (a KV
    cache object, a dataclass) are compared by their class and their attributes, recursively."""
    if _depth > 8:
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{path}[{i}]", _depth + 1)]
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(v, f"{path}[{k!r}]", _depth + 1)]
    if _is_plain_object(value):
        return [(f"type({path})", type(value))] + [
            item for k, v in vars(value).items() for item in _flatten(v, f"{path}.{k}", _depth + 1)]
    return [(path, value)]


def _is_plain_object(value):
    """An instance of a user-defined class holding data (not a tensor, module, function, class or enum)."""
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, torch.nn.Module, type, enum.Enum))
            and not callable(value) and type(value).__module__ not in ("builtins", "torch"))


def _fresh_copy(tensor):
    """A leaf copy with the same values, strides where possible, and requires_grad flag.

    Each run gets its own copy so an in-place op in one cannot change the other's input.
    """
    copied = tensor.detach().clone()
    if tensor.requires_grad:
        copied.requires_grad_(True)
    return copied


def _parameters(fn):
    return list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []


def _compare(actual, expected, what, rtol, atol):
    """Asserts one pair of leaves match: tensors by the tolerance table, other values by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: eager gave a tensor, kiln gave {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager's {expected.dtype}"
        assert actual.device == expected.device, f"{what}: device {actual.device} != eager's {expected.device}"
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager's {tuple(expected.shape)}"
        default_rtol, default_atol = tolerance(expected.dtype)
        if expected.is_cuda and expected.dtype == torch.float32 and torch.backends.cudnn.allow_tf32:
            default_rtol, default_atol = _CUDA_TF32_TOLERANCE
        torch.testing.assert_close(
            actual.detach(), expected.detach(),
            rtol=default_rtol if rtol is None else rtol, atol=default_atol if atol is None else atol,
            check_stride=False, equal_nan=True, msg=lambda m: f"{what} differs from eager:\n{m}")
    elif isinstance(expected, float) and isinstance(actual, numbers.Real):
        # Python floats are float64: compare them with float64's tolerance.
        tol_r, tol_a = tolerance(torch.float64)
        tol_r, tol_a = (tol_r if rtol is None else rtol), (tol_a if atol is None else atol)
        assert abs(actual - expected) <= tol_a + tol_r * abs(expected), f"{what}: {actual} != eager's {expected}"
    else:
        assert type(actual) is type(expected), \
            f"{what}: kiln gave {type(actual).__name__}, eager gave {type(expected).__name__}"
        assert actual == expected, f"{what}: {actual!r} != eager's {expected!r}"


def _compare_all(actual, expected, what, rtol, atol):
    actual_leaves, expected_leaves = _flatten(actual, what), _flatten(expected, what)
    assert [p for p, _ in actual_leaves] == [p for p, _ in expected_leaves], \
        f"{what}: structure {[p for p, _ in actual_leaves]} != eager's {[p for p, _ in expected_leaves]}"
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves):
        _compare(a, e, path, rtol, atol)


def _differentiable_outputs(outputs):
    return [leaf for _, leaf in _flatten(outputs)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
            and (leaf.dtype.is_floating_point or leaf.dtype.is_complex)]


def _backward_grads(outputs, cotangents, inputs, params):
    """Runs backward of sum(out * cotangent) and returns the .grad of inputs and params.

    Parameter .grad fields are cleared for the backward and restored afterwards, so the caller's
    module keeps the gradients it had.
    """
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss = sum((out * cot).sum().real if out.is_complex() else (out * cot).sum()
                   for out, cot in zip(outputs, cotangents))
        loss.backward()
        return [t.grad for t in inputs], [p.grad for p in params]
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def assert_same_as_eager(fn_or_module, *args, compiled=None, grads=True, rtol=None, atol=None, **kwargs):
    """Runs `fn_or_module` eagerly and compiled with kiln on the same arguments and asserts they agree.

    compiled: the compiled callable to check (default: kiln.compile(fn_or_module)). For a module the
        eager reference is a deep copy, so state the compiled run mutates (BatchNorm running stats,
        in-place buffers) cannot leak into the reference, and the copy's parameters are its own.
    grads: when some output requires grad, also compare the gradients of inputs and parameters
        after backward of sum(output * cotangent) over all float outputs (one fixed random
        cotangent per output, the same for both runs).
    rtol/atol: override the dtype table (tolerance()) for every comparison.
    Tensor arguments are copied for each run (same values and requires_grad) so in-place ops in one
    run cannot reach the other. Returns the compiled run's outputs.
    """
    if compiled is None:
        import kiln
        compiled = kiln.compile(fn_or_module)
    reference = copy.deepcopy(fn_or_module) if isinstance(fn_or_module, torch.nn.Module) else fn_or_module

    eager_args, eager_kwargs = _map_tensors(_fresh_copy, (args, kwargs))
    kiln_args, kiln_kwargs = _map_tensors(_fresh_copy, (args, kwargs))
    expected = reference(*eager_args, **eager_kwargs)
    actual = compiled(*kiln_args, **kiln_kwargs)
    _compare_all(actual, expected, "output", rtol, atol)
    # Arguments and module buffers that the function mutates must end up the same too.
    for (path, after_kiln), (_, after_eager) in zip(_flatten((kiln_args, kiln_kwargs), "arguments"),
                                                    _flatten((eager_args, eager_kwargs), "arguments")):
        if isinstance(after_eager, torch.Tensor):
            _compare(after_kiln, after_eager, f"{path} after the call", rtol, atol)
    if isinstance(fn_or_module, torch.nn.Module):
        _compare_all(dict(fn_or_module.named_buffers()), dict(reference.named_buffers()), "buffer", rtol, atol)

    expected_diff = _differentiable_outputs(expected)
    actual_diff = _differentiable_outputs(actual)
    if not grads or not expected_diff:
        return actual
    assert len(actual_diff) == len(expected_diff), (
        f"{len(expected_diff)} eager outputs require grad but {len(actual_diff)} of kiln's do")
    generator = torch.Generator().manual_seed(1234)
    cotangents = [random_tensor(tuple(out.shape), dtype=out.dtype, generator=generator).to(out.device)
                  for out in expected_diff]

    def leaves(tree):
        return [t for _, t in _flatten(tree) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]

    expected_input_grads, expected_param_grads = _backward_grads(
        expected_diff, cotangents, leaves((eager_args, eager_kwargs)), _parameters(reference))
    actual_input_grads, actual_param_grads = _backward_grads(
        actual_diff, cotangents, leaves((kiln_args, kiln_kwargs)), _parameters(fn_or_module))
    _compare_all(actual_input_grads, expected_input_grads, "input grad", rtol, atol)
    names = [name for name, _ in fn_or_module.named_parameters()] if isinstance(fn_or_module, torch.nn.Module) else []
    for name, a, e in zip(names, actual_param_grads, expected_param_grads):
        assert (a is None) == (e is None), \
            f"grad of parameter {name}: {'only eager' if a is None else 'only kiln'} computed one"
        if e is not None:
            _compare(a, e, f"grad of parameter {name}", rtol, atol)
    return actual


def capture_graphs(fn, *inputs, fullgraph=False):
    """The graphs kiln captures for fn(*inputs) under no_grad, with their example inputs: [(graph, inputs)],
    and the number of graph breaks and eager fallbacks on the way. Each graph is replayed by the eager
    interpreter during the capture; kiln is reset before and after."""
    import kiln

    graphs = []

    def keep(graph, example_inputs):
        graphs.append((graph, list(example_inputs)))
        return lambda xs: kiln._C.run_graph(graph, "eager", xs)

    kiln.reset()
    with torch.no_grad():
        kiln.compile(fn, backend=keep, fullgraph=fullgraph)(*inputs)
    stats = kiln.stats()
    breaks = stats["graph_breaks"] + stats["fallbacks"]
    kiln.reset()
    return graphs, breaks
