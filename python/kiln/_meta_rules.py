"""Output metadata of the commonest ATen ops, computed by kiln instead of by torch's meta kernels.

Nearly every ATen op's Meta kernel is Python (torch._meta_registrations shadows the C++ ones), and the
elementwise ones start with torch._prims_common.elementwise_dtypes, whose first call imports sympy: a
quarter of a second of every new process's first trace, for results that need only sizes, strides and a
dtype. The rules here produce what ATen's own kernels produce for the cases they accept:

- pointwise ops: the broadcast shape, the inputs' dtype (bool for comparisons) and TensorIterator's
  output layout (its fast paths for operands of one shape, else its stride-ordered permutation);
- addmm / mm / bmm, reductions over dims, softmax, layer norm, convolution of contiguous inputs and
  _unsafe_view of contiguous ones: contiguous outputs;
- in-place pointwise ops and bernoulli_: the receiver; empty_like, training-mode native_dropout, embedding;
- max / avg / adaptive-avg 2-d pooling: the input's suggested memory format; batch norm of dense inputs
  (statistics as torch's meta kernel and CUDA give them);
- the derivative ops kiln's autodiff emits, asked through oracle_infer by its MetaOracle (their rules are in
  _meta_rules_backward.py).

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
# Bitwise ops of bool or integer operands of one dtype (attention masks combined): that dtype, TensorIterator's layout.
_BITWISE = {aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor}
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
    if func in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex or any(t.dtype != dtype for t in tensors) or \
                len(tensors) != len(list(args) + list(kwargs.values())):
            return None
        shape = _broadcast_shape([t.shape for t in tensors])
        if shape is None or 0 in shape:
            return None
        return _empty(shape, pointwise_strides(shape, tensors), dtype)
    # Comparisons give bool whatever their operands' dtype, so any one real dtype takes TensorIterator's layout (an
    # attention mask's int64 or bool compares); other ops only floating ones (promotion is not modelled here).
    real = dtype not in (torch.complex64, torch.complex128) and dtype != torch.bool
    if any(t.dtype != dtype for t in dims) or not (dtype in _FLOATING or (func in _BOOL_RESULT and real)):
        return None
    if func in _BOOL_RESULT and dtype not in _FLOATING and any(
            not (t.dtype == dtype or (t.dim() == 0 and not t.dtype.is_floating_point)) for t in tensors):
        return None  # (a floating zero-dim operand would promote)
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


_RULES = {op: _pointwise for op in _SAME_DTYPE | _BOOL_RESULT | _BITWISE}
_RULES.update({aten.addmm.default: _matmul, aten.mm.default: _matmul, aten.bmm.default: _matmul,
               aten.mean.dim: _reduction, aten.sum.dim_IntList: _reduction, aten.amax.default: _reduction,
               aten.amin.default: _reduction, aten._softmax.default: _softmax,
               aten.native_layer_norm.default: _layer_norm})


_OVERLOADS = {}


def oracle_infer(qualified, args, kwargs):
    """infer() for an op named as the graph names it ("aten::mm.default"): how kiln's autodiff learns its backward
    ops' output metadata (MetaOracle in compile/meta_oracle.cpp) without torch's Python meta kernels, the first
    of which imports sympy (0.15-0.25 s of a training step's first call). None: the meta kernel decides."""
    func = _OVERLOADS.get(qualified)
    if func is None:
        namespace, _, rest = qualified.partition("::")
        name, _, overload = rest.partition(".")
        try:
            func = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        except AttributeError:
            func = False
        _OVERLOADS[qualified] = func
    return infer(func, args, kwargs) if func else None


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


# ---- in-place pointwise ops: the receiver itself, where the out-of-place rule gives its shape and dtype ----
_INPLACE = {
    aten.relu_.default: aten.relu.default, aten.sigmoid_.default: aten.sigmoid.default,
    aten.tanh_.default: aten.tanh.default, aten.silu_.default: aten.silu.default,
    aten.gelu_.default: aten.gelu.default, aten.hardtanh_.default: aten.hardtanh.default,
    aten.hardswish_.default: aten.hardswish.default, aten.leaky_relu_.default: aten.leaky_relu.default,
    aten.clamp_.default: aten.clamp.default, aten.clamp_min_.default: aten.clamp_min.default,
    aten.clamp_max_.default: aten.clamp_max.default, aten.add_.Tensor: aten.add.Tensor,
    aten.sub_.Tensor: aten.sub.Tensor, aten.mul_.Tensor: aten.mul.Tensor, aten.div_.Tensor: aten.div.Tensor,
    aten.add_.Scalar: aten.add.Scalar, aten.sub_.Scalar: aten.sub.Scalar, aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Scalar: aten.div.Scalar,
}
_INTEGER_INPLACE = {aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.add_.Scalar, aten.sub_.Scalar,
                    aten.mul_.Scalar}
_INTEGRAL = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _inplace(func, args, kwargs):
    """`self`, as torch's kernels return it. Floating receivers: the operands _pointwise accepts, broadcast to
    self's shape. Integer receivers (BatchNorm's num_batches_tracked.add_(1)): add/sub/mul by Python ints.
    A receiver with internal overlap (eager raises) is left to torch."""
    x = args[0]
    if any(size > 1 and stride == 0 for size, stride in zip(x.shape, x.stride())):
        return None
    if x.dtype in _FLOATING:
        out = _pointwise(_INPLACE[func], args, kwargs)
        if out is None or out.shape != x.shape or out.dtype != x.dtype:
            return None
        return x
    if x.dtype in _INTEGRAL and func in _INTEGER_INPLACE:
        others = list(args[1:]) + list(kwargs.values())
        if all(type(v) is int for v in others):
            return x
    return None


def _bernoulli_(func, args, kwargs):
    x, p = args[0], args[1] if len(args) > 1 else 0.5
    if x.dtype not in _FLOATING or not _plain_number(p) or not 0 <= p <= 1 or kwargs.get("generator") is not None:
        return None
    return x


for _op in _INPLACE:
    _RULES[_op] = _inplace
_RULES[aten.bernoulli_.float] = _bernoulli_


def _empty_like(func, args, kwargs):
    """ATen's empty_like: preserve_format keeps a dense input's strides and gives others the dense strides of
    their dimension order (infer_dense_strides, TensorIterator's permutation for one operand)."""
    x = args[0]
    dtype, layout, device = kwargs.get("dtype"), kwargs.get("layout"), kwargs.get("device")
    pin, memory_format = kwargs.get("pin_memory"), kwargs.get("memory_format")
    dtype = x.dtype if dtype is None else dtype
    if dtype not in _FLOATING + _INTEGRAL + (torch.bool,) or layout not in (None, torch.strided) or pin:
        return None
    if device is not None and torch.device(device).type != "meta":
        return None
    if x.numel() == 0:
        return None
    if memory_format is torch.contiguous_format:
        return _contiguous(x.shape, dtype)
    if memory_format not in (None, torch.preserve_format):
        return None
    if _non_overlapping_and_dense(x):
        return _empty(x.shape, x.stride(), dtype)
    return _empty(x.shape, pointwise_strides(list(x.shape), [x]), dtype)


_RULES[aten.empty_like.default] = _empty_like


def _native_dropout(func, args, kwargs):
    """Training-mode dropout of a dense input: output and bool mask laid out like the input. CUDA allocates both
    with empty_like, CPU's output is TensorIterator's (other strides for size-1 dims): inputs where the two
    differ, eval mode and p == 0 (torch's meta kernel returns the input itself) are left to torch."""
    x, p, train = args[0], args[1], args[2]
    if kwargs or train is not True or not _plain_number(p) or not 0 < p < 1 or x.dtype not in _FLOATING:
        return None
    if x.numel() == 0 or not _non_overlapping_and_dense(x) or list(x.stride()) != pointwise_strides(list(x.shape), [x]):
        return None
    return _empty(x.shape, x.stride(), x.dtype), _empty(x.shape, x.stride(), torch.bool)


_RULES[aten.native_dropout.default] = _native_dropout


def _safe_softmax(func, args, kwargs):
    """softmax that gives 0 for rows of -inf (attention's math path): a contiguous result, as _softmax."""
    x, dim = args[0], args[1]
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if x.dtype not in _FLOATING or (dtype is not None and dtype != x.dtype) or x.dim() == 0:
        return None
    if not -x.dim() <= dim < x.dim():
        return None
    return _contiguous(x.shape, x.dtype)


_RULES[aten._safe_softmax.default] = _safe_softmax


def _embedding(func, args, kwargs):
    """weight's rows gathered by index_select: contiguous, indices' shape plus the embedding dim."""
    weight, indices = args[0], args[1]
    if kwargs or weight.dim() != 2 or weight.dtype not in _FLOATING or indices.dtype not in (torch.int64, torch.int32):
        return None
    return _contiguous(list(indices.shape) + [weight.shape[1]], weight.dtype)


_RULES[aten.embedding.default] = _embedding


# ---- memory formats ------------------------------------------------------------------------------------
def _strides_like_channels_last(t):
    """c10's is_channels_last_strides_2d / _3d, which Tensor.suggest_memory_format() asks for 4-d / 5-d
    tensors: dims ordered C, W, H, (D,) N by stride, ambiguous cases read as contiguous."""
    shape, strides = t.shape, t.stride()
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(t.dim())
    if order is None or strides[1] == 0:
        return False
    smallest = 0
    for d in order:
        if shape[d] == 0 or strides[d] < smallest:
            return False
        if d == 0 and smallest == strides[1]:
            return False
        smallest = strides[d] * shape[d]
    return True


def _empty_suggested(shape, dtype, like):
    """A tensor of `shape` in like.suggest_memory_format() (channels-last for 4-d inputs whose strides say so)."""
    if like.dim() == 4 and _strides_like_channels_last(like):
        return torch.empty(shape, dtype=dtype, device="meta", memory_format=torch.channels_last)
    return _contiguous(shape, dtype)


# ---- pooling ---------------------------------------------------------------------------------------------
def _pair(value):
    if type(value) is int:
        return [value, value]
    value = list(value)
    if len(value) not in (1, 2) or any(type(v) is not int for v in value):
        return None
    return value * 2 if len(value) == 1 else value


def _pooled_size(size, kernel, stride, pad, dilation, ceil_mode):
    """ATen's pooling_output_shape."""
    out = (size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _pool2d(func, args, kwargs):
    """max_pool2d_with_indices and avg_pool2d on 3-d / 4-d inputs: pooling_output_shape sizes, the input's
    suggested memory format (their shared structured meta functions); indices are int64."""
    x = args[0]
    if func is aten.max_pool2d_with_indices.default:
        kernel, stride, padding, dilation, ceil_mode = args[1:6]
    else:
        kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = args[1:7]
        dilation = [1]
        if divisor_override == 0 or not isinstance(count_include_pad, bool):
            return None
    if kwargs or x.dim() not in (3, 4) or 0 in x.shape or x.dtype not in _FLOATING or not isinstance(ceil_mode, bool):
        return None
    kernel = _pair(kernel)
    stride = kernel if isinstance(stride, (list, tuple)) and len(stride) == 0 else _pair(stride)
    padding, dilation = _pair(padding), _pair(dilation)
    if None in (kernel, stride, padding, dilation):
        return None
    shape = list(x.shape[:-2])
    for i in range(2):
        k, s, p, d = kernel[i], stride[i], padding[i], dilation[i]
        if k <= 0 or s <= 0 or d <= 0 or p < 0 or p > k // 2:
            return None
        size = _pooled_size(x.shape[i - 2], k, s, p, d, ceil_mode)
        if size < 1:
            return None
        shape.append(size)
    out = _empty_suggested(shape, x.dtype, x)
    if func is aten.max_pool2d_with_indices.default:
        return out, _empty(shape, out.stride(), torch.int64)
    return out


def _adaptive_avg_pool2d(func, args, kwargs):
    x, output_size = args[0], _pair(args[1])
    if kwargs or x.dim() not in (3, 4) or 0 in x.shape or x.dtype not in _FLOATING:
        return None
    if output_size is None or len(args[1]) != 2 or min(output_size) < 1:
        return None
    return _empty_suggested(list(x.shape[:-2]) + output_size, x.dtype, x)


_RULES.update({aten.max_pool2d_with_indices.default: _pool2d, aten.avg_pool2d.default: _pool2d,
               aten._adaptive_avg_pool2d.default: _adaptive_avg_pool2d})


# ---- batch norm ------------------------------------------------------------------------------------------
def _batch_norm_output(x):
    """batch norm's output where eager CPU (contiguous unless channels-last contiguous), CUDA and cuDNN (the
    suggested memory format) and torch's meta kernel (TensorIterator) lay it out alike; else None."""
    like_channels_last = _strides_like_channels_last(x)
    if x.is_contiguous() and not like_channels_last:
        return _contiguous(x.shape, x.dtype)
    if x.dim() == 4 and like_channels_last and not x.is_contiguous() and \
            x.is_contiguous(memory_format=torch.channels_last):
        return torch.empty(x.shape, dtype=x.dtype, device="meta", memory_format=torch.channels_last)
    return None


def _batch_norm(func, args, kwargs):
    """native_batch_norm, its _native_batch_norm_legit* forms and cudnn_batch_norm.

    The statistics follow torch's meta kernel, which is CUDA's: save_mean / save_invstd of [C] in the
    accumulation dtype (float32 for half / bfloat16 inputs), in eval mode too, where CPU gives [0];
    cudnn_batch_norm's are [0] in eval mode, with a [0] uint8 workspace. Dtype combinations whose statistics
    differ between CPU and CUDA (half / bfloat16 parameters) are left to torch."""
    cudnn = func is aten.cudnn_batch_norm.default
    if func is aten._native_batch_norm_legit.no_stats:
        x, weight, bias, training = args[:4]
        running_mean = running_var = None
    elif func is aten._native_batch_norm_legit_no_training.default:
        x, weight, bias, running_mean, running_var = args[:5]
        training = False
    else:
        x, weight, bias, running_mean, running_var, training = args[:6]
    if kwargs or not isinstance(training, bool) or x.dim() < 2 or 0 in x.shape:
        return None
    channels = x.shape[1]
    params = [t for t in (weight, bias, running_mean, running_var) if t is not None]
    if any(list(t.shape) != [channels] for t in params) or (running_mean is None) != (running_var is None):
        return None
    if not training and running_mean is None:
        return None
    if training and x.numel() // channels <= 1:
        return None  # torch's meta kernel divides by n - 1
    if cudnn and (weight is None or bias is None):
        return None
    param_dtype = params[0].dtype if params else x.dtype
    if any(t.dtype != param_dtype for t in params):
        return None
    if x.dtype in ((torch.float32,) if cudnn else (torch.float32, torch.float64)) and param_dtype == x.dtype:
        stat_dtype = x.dtype
    elif x.dtype in (torch.float16, torch.bfloat16) and param_dtype == torch.float32 and params:
        stat_dtype = torch.float32
    else:
        return None
    out = _batch_norm_output(x)
    if out is None:
        return None
    stat_shape = [0] if cudnn and not training else [channels]
    results = (out, _contiguous(stat_shape, stat_dtype), _contiguous(stat_shape, stat_dtype))
    if cudnn:
        return results + (_contiguous([0], torch.uint8),)
    if func is aten._native_batch_norm_legit_functional.default:
        return results + (_contiguous([channels], param_dtype), _contiguous([channels], param_dtype))
    return results


for _op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
            aten._native_batch_norm_legit_functional.default, aten.cudnn_batch_norm.default):
    _RULES[_op] = _batch_norm


def _native_multi_head_attention(func, args, kwargs):
    """nn.MultiheadAttention's inference fast path (self-attention, need_weights): a contiguous (B, T, E)
    output and the attention weights, (B, T, T) averaged over heads or (B, heads, T, T). Without need_weights
    eager returns no weights tensor, unlike torch's meta kernel: left to torch."""
    query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias = args[:9]
    need_weights, average = args[10], args[11]
    if kwargs or need_weights is not True or not isinstance(average, bool) or query.dtype not in _FLOATING:
        return None
    if query.dim() != 3 or key.shape != query.shape or value.shape != query.shape or 0 in query.shape:
        return None
    batch, length, dim = query.shape
    if dim != embed_dim or num_head < 1 or dim % num_head:
        return None
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    params = ((qkv_weight, [3 * dim, dim]), (qkv_bias, [3 * dim]), (proj_weight, [dim, dim]), (proj_bias, [dim]))
    for t, shape in params:
        if t.dtype != query.dtype or list(t.shape) != shape:
            return None
    weights = [batch, length, length] if average else [batch, num_head, length, length]
    return _contiguous([batch, length, dim], query.dtype), _contiguous(weights, query.dtype)


_RULES[aten._native_multi_head_attention.default] = _native_multi_head_attention


# ---- fused attention kernels (recorded when autocast's device proxies make scaled_dot_product_attention pick
# them): results as their kernels allocate them ----------------------------------------------------------------
def _attention_operands(query, key, value, dtypes):
    """(batch, heads, q_length, head_dim) of 4-d query / key / value of one dtype and matching dims, or None."""
    if any(t.dim() != 4 or t.dtype != query.dtype or 0 in t.shape for t in (query, key, value)):
        return None
    if query.dtype not in dtypes or key.shape[:3] != value.shape[:3]:
        return None
    batch, heads, length, head_dim = query.shape
    if key.shape[0] != batch or key.shape[1] != heads or key.shape[3] != head_dim:
        return None
    return batch, heads, length, head_dim


def _flash_attention_for_cpu(func, args, kwargs):
    """CPU's flash kernel: the output in query's layout (empty_like), logsumexp (batch, length, heads)
    transposed to (batch, heads, length) in the accumulation dtype."""
    query, key, value, dropout_p, is_causal = args[:5]
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    dims = _attention_operands(query, key, value, _FLOATING)
    if dims is None or set(kwargs) - {"attn_mask", "scale"} or dropout_p != 0 or value.shape[3] != query.shape[3] or \
            not _non_overlapping_and_dense(query) or (scale is not None and not _plain_number(scale)):
        return None
    batch, heads, length, _ = dims
    scores = [batch, heads, length, key.shape[2]]
    if not isinstance(is_causal, bool) or (mask is not None and (
            is_causal or mask.dtype != query.dtype or _broadcast_shape([mask.shape, scores]) != scores)):
        return None  # (the kernel takes a mask of query's dtype only, and not with is_causal)
    lse_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    return _empty(query.shape, query.stride(), query.dtype), _empty([batch, heads, length], [length * heads, 1, heads],
                                                                    lse_dtype)


def _efficient_attention(func, args, kwargs):
    """CUDA's memory-efficient kernel (torch's meta kernel states it): the output (batch, length, heads, v_dim)
    transposed to (batch, heads, length, v_dim), logsumexp (batch, heads, length rounded up to 32, or 0) in
    float32, and 0-dim int64 seed and offset. ROCm's logsumexp differs: left to torch."""
    query, key, value, attn_bias, compute_log_sumexp = args[:5]
    scale = kwargs.get("scale")
    dims = _attention_operands(query, key, value, (torch.float32, torch.float16, torch.bfloat16))
    if dims is None or set(kwargs) - {"scale"} or (scale is not None and not _plain_number(scale)) or \
            torch.version.hip or not isinstance(compute_log_sumexp, bool):
        return None
    batch, heads, length, _ = dims
    v_dim = value.shape[3]
    lse = [batch, heads, -(-length // 32) * 32 if compute_log_sumexp else 0]
    seed, offset = _contiguous([], torch.int64), _contiguous([], torch.int64)
    return (_empty([batch, heads, length, v_dim], [length * heads * v_dim, v_dim, heads * v_dim, 1], query.dtype),
            _contiguous(lse, torch.float32), seed, offset)


_RULES.update({aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_for_cpu,
               aten._scaled_dot_product_efficient_attention.default: _efficient_attention})


# The derivative ops' rules (their own file, for kiln's autodiff): registered into _RULES on import.
from kiln import _meta_rules_backward  # noqa: E402,F401
