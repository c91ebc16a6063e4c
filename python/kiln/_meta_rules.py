"""Output metadata of the commonest ATen ops, computed by kiln instead of by torch's meta kernels.

Nearly every ATen op's Meta kernel is Python (torch._meta_registrations shadows the C++ ones), and the
elementwise ones start with torch._prims_common.elementwise_dtypes, whose first call imports sympy: a
quarter of a second of every new process's first trace, for results that need only sizes, strides and a
dtype. The rules here produce what ATen's own kernels produce for the cases they accept:

- pointwise ops: the broadcast shape, the inputs' dtype (bool for comparisons) and TensorIterator's
  output layout (its fast paths for operands of one shape, else its stride-ordered permutation);
- addmm / mm / bmm, reductions over dims, softmax, layer norm, convolution of contiguous inputs and
  _unsafe_view of contiguous ones: contiguous outputs.

Any other case returns None and runs torch's meta kernel as before. tests/python/test_meta_rules.py
compares every rule with eager on random shapes, layouts and dtypes.
"""
import torch

aten = torch.ops.aten

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _contiguous_strides(shape):
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return strides


def _non_overlapping_and_dense(t):
    """c10's is_non_overlapping_and_dense: the non-trivial dims, sorted by stride, tile memory exactly."""
    dims = sorted((d for d in range(t.dim()) if t.shape[d] >= 2), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _broadcast_shape(shapes):
    ndim = max(len(s) for s in shapes)
    shape = [1] * ndim
    for s in shapes:
        offset = ndim - len(s)
        for i, size in enumerate(s):
            d = offset + i
            if size != 1:
                if shape[d] != 1 and shape[d] != size:
                    return None  # not broadcastable: torch's kernel raises the error users expect
                shape[d] = size
    return shape


def pointwise_strides(shape, operands):
    """The strides TensorIterator gives the output of a pointwise op over `operands` broadcast to `shape`."""
    ndim = len(shape)
    if ndim == 0:
        return []
    if all(list(t.shape) == shape for t in operands):
        if all(t.is_contiguous() for t in operands):
            return _contiguous_strides(shape)
        if ndim == 4 and all(t.is_contiguous(memory_format=torch.channels_last) for t in operands):
            return list(torch.empty(shape, device="meta", memory_format=torch.channels_last).stride())
        if all(_non_overlapping_and_dense(t) for t in operands) and \
                all(t.stride() == operands[0].stride() for t in operands):
            return list(operands[0].stride())
    # Each operand's strides over the broadcast shape: broadcast dims (missing or size 1 against a larger
    # size) have stride 0 and never decide the order.
    operand_strides = []
    for t in operands:
        offset = ndim - t.dim()
        strides = [0] * ndim
        for i in range(t.dim()):
            if not (t.shape[i] == 1 and shape[offset + i] != 1):
                strides[offset + i] = t.stride(i)
        operand_strides.append(strides)

    def should_swap(dim0, dim1):
        for strides in operand_strides:
            s0, s1 = strides[dim0], strides[dim1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))  # fastest dim first
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    strides, acc = [0] * ndim, 1
    for d in perm:
        strides[d] = acc
        acc *= shape[d]
    return strides


def _empty(shape, strides, dtype):
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def _contiguous(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")  # (a C++ factory: no Python meta kernel)


# Pointwise overloads whose result dtype is their floating inputs' dtype, and those that return bool.
_SAME_DTYPE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.maximum.default,
    aten.minimum.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.exp.default,
    aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.neg.default, aten.abs.default,
    aten.reciprocal.default, aten.erf.default, aten.sin.default, aten.cos.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
    aten.leaky_relu.default, aten.elu.default, aten.softplus.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.mish.default, aten.gelu_backward.default, aten.threshold_backward.default,
    aten.sigmoid_backward.default, aten.tanh_backward.default, aten.silu_backward.default,
}
_SAME_SHAPE = {  # derivative ops: operands of one shape (broadcasting ones are left to torch)
    aten.gelu_backward.default, aten.threshold_backward.default, aten.sigmoid_backward.default,
    aten.tanh_backward.default, aten.silu_backward.default,
}
_BOOL_RESULT = {
    aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
    aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
}


def _plain_number(value):
    return isinstance(value, (bool, int, float))


def _pointwise(func, args, kwargs):
    tensors = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, str):
            if value not in ("none", "tanh"):  # gelu's approximate; anything else is the kernel's error to raise
                return None
        elif value is not None and not _plain_number(value):
            return None
    dims = [t for t in tensors if t.dim() > 0]
    if not dims:
        return None
    dtype = dims[0].dtype
    if dtype not in _FLOATING or any(t.dtype != dtype for t in dims):
        return None
    # Zero-dim tensors and Python numbers take part in promotion only from a higher category: a float
    # tensor's dtype wins over any real number.
    if any(t.dtype.is_complex for t in tensors if t.dim() == 0):
        return None
    if func in _SAME_SHAPE and any(t.shape != tensors[0].shape for t in tensors):
        return None
    shape = _broadcast_shape([t.shape for t in tensors])
    if shape is None or 0 in shape:
        return None
    result = torch.bool if func in _BOOL_RESULT else dtype
    return _empty(shape, pointwise_strides(shape, tensors), result)


def _matmul(func, args, kwargs):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs.get("out_dtype") is not None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    dtype = tensors[0].dtype
    if dtype not in _FLOATING or any(t.dtype != dtype for t in tensors):
        return None
    if func is aten.addmm.default:
        bias, a, b = tensors[:3]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or bias.dim() > 2:
            return None
        shape = [a.shape[0], b.shape[1]]
        if _broadcast_shape([bias.shape, shape]) != shape:
            return None
    elif func is aten.mm.default:
        a, b = tensors
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            return None
        shape = [a.shape[0], b.shape[1]]
    else:  # bmm
        a, b = tensors
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            return None
        shape = [a.shape[0], a.shape[1], b.shape[2]]
    return _contiguous(shape, dtype)


def _reduction(func, args, kwargs):
    x = args[0]
    if kwargs.get("dtype") is not None or len(args) > 3 or x.dtype not in _FLOATING or x.dim() == 0:
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None or len(dim) == 0:
        dims = set(range(x.dim()))
    else:
        dims = set()
        for d in dim:
            if not -x.dim() <= d < x.dim():
                return None
            dims.add(d % x.dim())
        if len(dims) != len(dim):
            return None
    if any(x.shape[d] == 0 for d in dims):
        return None
    shape = [1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims]
    return _contiguous(shape, x.dtype)


def _softmax(func, args, kwargs):
    x, dim, half_to_float = args
    if x.dtype not in (torch.float32, torch.float64) or half_to_float or x.dim() == 0:
        return None
    if not -x.dim() <= dim < x.dim():
        return None
    return _contiguous(x.shape, x.dtype)


def _layer_norm(func, args, kwargs):
    x, normalized_shape, weight, bias = args[:4]
    if x.dtype not in (torch.float32, torch.float64) or kwargs:
        return None
    if any(t is not None and (t.dtype != x.dtype or list(t.shape) != list(normalized_shape)) for t in (weight, bias)):
        return None
    axis = x.dim() - len(normalized_shape)
    if axis < 0 or list(x.shape[axis:]) != list(normalized_shape) or 0 in x.shape:
        return None
    shape = list(x.shape)
    stat = shape[:axis] + [1] * len(normalized_shape)
    return _contiguous(shape, x.dtype), _contiguous(stat, x.dtype), _contiguous(stat, x.dtype)


_RULES = {op: _pointwise for op in _SAME_DTYPE | _BOOL_RESULT}
_RULES.update({aten.addmm.default: _matmul, aten.mm.default: _matmul, aten.bmm.default: _matmul,
               aten.mean.dim: _reduction, aten.sum.dim_IntList: _reduction, aten.amax.default: _reduction,
               aten.amin.default: _reduction, aten._softmax.default: _softmax,
               aten.native_layer_norm.default: _layer_norm})


def infer(func, args, kwargs):
    """func's result on meta tensors `args` / `kwargs` as ATen would produce it, or None where kiln has no
    rule for this op or these arguments (torch's meta kernel then runs)."""
    rule = _RULES.get(func)
    if rule is None:
        return None
    try:
        return rule(func, args, kwargs)
    except (TypeError, ValueError, IndexError, AttributeError):
        return None  # an unexpected argument form: the meta kernel decides


def _convolution(func, args, kwargs):
    """Convolutions of contiguous inputs give contiguous outputs (what torch's meta kernel records on every
    torch kiln supports; kiln's channels-last pass chooses the run's layout later). Transposed ones, other
    layouts and unusual arguments are left to torch."""
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if kwargs or transposed or x.dtype not in _FLOATING or weight.dtype != x.dtype:
        return None
    if bias is not None and (bias.dtype != x.dtype or list(bias.shape) != [weight.shape[0]]):
        return None
    spatial = x.dim() - 2
    if spatial < 1 or weight.dim() != x.dim() or not all(len(v) == spatial for v in (stride, padding, dilation)):
        return None
    if not x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return None
    if groups < 1 or x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups or 0 in x.shape:
        return None
    shape = [x.shape[0], weight.shape[0]]
    for i in range(spatial):
        size = (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (weight.shape[2 + i] - 1) - 1) // stride[i] + 1
        if size <= 0 or stride[i] <= 0 or dilation[i] <= 0 or padding[i] < 0:
            return None
        shape.append(size)
    return _contiguous(shape, x.dtype)


_RULES[aten.convolution.default] = _convolution


def _unsafe_view(func, args, kwargs):
    """reshape's copy-free case on a contiguous input: a contiguous tensor of the new size (-1 inferred)."""
    x, size = args[0], list(args[1])
    if kwargs or not x.is_contiguous() or size.count(-1) > 1 or any(d < -1 for d in size):
        return None
    known = 1
    for d in size:
        if d != -1:
            known *= d
    if -1 in size:
        if known == 0 or x.numel() % known:
            return None
        size[size.index(-1)] = x.numel() // known
    elif known != x.numel():
        return None
    return _contiguous(size, x.dtype)


_RULES[aten._unsafe_view.default] = _unsafe_view
