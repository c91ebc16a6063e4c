"""Output metadata of the derivative ops kiln's autodiff emits, for its MetaOracle (compile/meta_oracle.cpp,
through _meta_rules.oracle_infer): what torch's meta kernels give, without their first call's sympy import.

Layer norm, softmax and select backward and stack; for inputs that do not look channels-last, convolution, max-pool,
adaptive-avg-pool and batch-norm backward (torch versions choose channels-last formats differently: those stay
with torch's meta kernels). Registered into _meta_rules._RULES when that module is imported.
"""
import torch

from kiln._meta_rules import _FLOATING, _RULES, _contiguous, _strides_like_channels_last

aten = torch.ops.aten


def _layer_norm_backward(func, args, kwargs):
    """native_layer_norm_backward: contiguous gradients of the input, weight and bias (ATen's empty_like with the
    contiguous format), None where output_mask leaves one out."""
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    if kwargs or x.dtype not in (torch.float32, torch.float64) or grad.dtype != x.dtype or list(grad.shape) != list(x.shape):
        return None
    axis = x.dim() - len(normalized_shape)
    if axis < 0 or list(x.shape[axis:]) != list(normalized_shape) or 0 in x.shape:
        return None
    results = [_contiguous(x.shape, x.dtype) if mask[0] else None]
    for param, wanted in ((weight, mask[1]), (bias, mask[2])):
        if not wanted:
            results.append(None)
        elif param is None or param.dtype != x.dtype or list(param.shape) != list(normalized_shape):
            return None
        else:
            results.append(_contiguous(param.shape, x.dtype))
    return tuple(results)


def _softmax_backward_data(func, args, kwargs):
    grad, output, dim, input_dtype = args
    if kwargs or grad.dtype not in (torch.float32, torch.float64) or input_dtype != grad.dtype:
        return None
    if output.dtype != grad.dtype or list(output.shape) != list(grad.shape) or grad.dim() == 0:
        return None
    if not -grad.dim() <= dim < grad.dim():
        return None
    return _contiguous(grad.shape, grad.dtype)


def _select_backward(func, args, kwargs):
    """The gradient of x.select(dim, index): zeros of x's sizes (contiguous) with the slice written."""
    grad, input_sizes, dim, index = args
    if kwargs or grad.dtype not in _FLOATING or len(input_sizes) != grad.dim() + 1:
        return None
    if not -len(input_sizes) <= dim < len(input_sizes):
        return None
    dim %= len(input_sizes)
    if [s for d, s in enumerate(input_sizes) if d != dim] != list(grad.shape):
        return None
    if not -input_sizes[dim] <= index < input_sizes[dim]:
        return None
    return _contiguous(list(input_sizes), grad.dtype)


def _stack(func, args, kwargs):
    """stack of tensors of one shape and dtype, as ATen makes it: a cat of the tensors along `dim` viewed with the new
    dim (or, stacking after the last dim, a cat of their unsqueezed views). Contiguous unless what is concatenated
    suggests a channels-last format (4-d and 5-d tensors whose strides read so: left to torch)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if len(tensors) < 2 or any(k != "dim" for k in kwargs):  # (one tensor may keep its own layout)
        return None
    first = tensors[0]
    if first.dtype not in _FLOATING or any(t.dtype != first.dtype or t.shape != first.shape for t in tensors):
        return None
    if 0 in first.shape or not -(first.dim() + 1) <= dim <= first.dim():
        return None
    dim %= first.dim() + 1
    if any(_strides_like_channels_last(t if dim < first.dim() else t.unsqueeze(dim)) for t in tensors):
        return None
    shape = list(first.shape)
    shape.insert(dim, len(tensors))
    return _contiguous(shape, first.dtype)


_RULES.update({aten.native_layer_norm_backward.default: _layer_norm_backward,
               aten._softmax_backward_data.default: _softmax_backward_data,
               aten.select_backward.default: _select_backward, aten.stack.default: _stack})

def _dense_not_channels_last(*tensors):
    return all(t.dim() < 4 or not _strides_like_channels_last(t) for t in tensors)


def _convolution_backward(func, args, kwargs):
    """convolution_backward of inputs that do not look channels-last: contiguous gradients of the input's, the
    weight's and the bias's sizes, None where output_mask leaves one out (torch's meta kernel; channels-last inputs,
    whose format torch versions choose differently, are left to it)."""
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    if kwargs or x.dtype not in _FLOATING or grad.dtype != x.dtype or weight.dtype != x.dtype:
        return None
    if x.dim() != weight.dim() or x.dim() < 3 or not _dense_not_channels_last(x, weight):
        return None
    if mask[2] and bias_sizes is None:
        return None
    return (_contiguous(x.shape, x.dtype) if mask[0] else None,
            _contiguous(weight.shape, x.dtype) if mask[1] else None,
            _contiguous(list(bias_sizes), x.dtype) if mask[2] else None)


def _max_pool2d_backward(func, args, kwargs):
    """max_pool2d_with_indices_backward: the input's shape in its suggested format (contiguous here: channels-last
    inputs are left to torch)."""
    grad, x = args[0], args[1]
    if kwargs or x.dtype not in _FLOATING or grad.dtype != x.dtype or x.dim() not in (3, 4):
        return None
    if not _dense_not_channels_last(x) or grad.dim() != x.dim() or grad.shape[:-2] != x.shape[:-2]:
        return None
    return _contiguous(x.shape, x.dtype)


def _batch_norm_backward(func, args, kwargs):
    """native_batch_norm_backward as torch's meta kernel (its decomposition) gives it for contiguous operands: the
    input's gradient always, contiguous; the weight's and bias's as [C] where output_mask asks."""
    grad, x, weight = args[0], args[1], args[2]
    mask = args[9]
    if kwargs or x.dtype not in (torch.float32, torch.float64) or grad.dtype != x.dtype or x.dim() < 2:
        return None
    if not (x.is_contiguous() and grad.is_contiguous()) or list(grad.shape) != list(x.shape):
        return None
    if weight is None or weight.dtype != x.dtype or list(weight.shape) != [x.shape[1]]:
        return None
    channels = [x.shape[1]]
    return (_contiguous(x.shape, x.dtype), _contiguous(channels, x.dtype) if mask[1] else None,
            _contiguous(channels, x.dtype) if mask[2] else None)


def _adaptive_avg_pool2d_backward(func, args, kwargs):
    """_adaptive_avg_pool2d_backward: the input's shape, contiguous (channels-last inputs are left to torch)."""
    grad, x = args
    if kwargs or x.dtype not in _FLOATING or grad.dtype != x.dtype or x.dim() not in (3, 4) or grad.dim() != x.dim():
        return None
    if not _dense_not_channels_last(x) or 0 in grad.shape[1:]:
        return None
    return _contiguous(x.shape, x.dtype)


_RULES.update({aten._adaptive_avg_pool2d_backward.default: _adaptive_avg_pool2d_backward,
               aten.convolution_backward.default: _convolution_backward,
               aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
               aten.native_batch_norm_backward.default: _batch_norm_backward})
