// Shape rules of the derivative ops kiln's autodiff emits (compile/'s MetaOracle asks them first): gradients of the
// forward inputs' sizes, contiguous; None where an output_mask leaves one out. Inputs that look channels-last,
// whose gradient format torch versions choose differently, refuse.
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

bool not_channels_last(RuleCall& call, const SymTensorMeta& t) {
  return t.dim() < 4 || !strides_like_channels_last(call, t);
}

void require_same_sizes(RuleCall& call, const SymTensorMeta& a, const SymTensorMeta& b, const std::string& what) {
  call.check(a.dim() == b.dim(), what + " of another rank");
  for (int64_t d = 0; d < a.dim(); ++d) call.require_eq(a.sizes[d], b.sizes[d], what);
}

// native_layer_norm_backward(grad, input, normalized_shape, mean, rstd, weight, bias, output_mask).
void layer_norm_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1);
  std::vector<Expr> normalized = call.int_list(2);
  std::vector<bool> mask = call.bool_list(7);
  call.check(mask.size() == 3, "output_mask");
  call.check((x.dtype == ScalarType::Float || x.dtype == ScalarType::Double) && grad.dtype == x.dtype, "dtype");
  require_same_sizes(call, grad, x, "the gradient");
  int64_t axis = x.dim() - static_cast<int64_t>(normalized.size());
  call.check(axis >= 0, "normalized_shape longer than the input");
  for (size_t i = 0; i < normalized.size(); ++i) call.require_eq(x.sizes[axis + i], normalized[i], "normalized_shape");
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  if (mask[0]) {
    call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
  } else {
    call.add_none_output();
  }
  for (size_t i : {5, 6}) {
    if (!mask[i - 4]) {
      call.add_none_output();
      continue;
    }
    const SymTensorMeta* p = call.optional_tensor(i);
    call.check(p && p->dtype == x.dtype && p->dim() == static_cast<int64_t>(normalized.size()), "weight or bias");
    for (size_t d = 0; d < normalized.size(); ++d) call.require_eq(p->sizes[d], normalized[d], "weight or bias size");
    call.add_output(contiguous_meta(p->sizes, x.dtype, x.device));
  }
}

// native_group_norm_backward(grad, input, mean, rstd, weight, N, C, HxW, group, output_mask), contiguous operands.
// The input's gradient has the input's dtype, the parameters' the weight's (float32 for a 16-bit input in ATen's
// mixed type; torch's meta kernel says float32 for the input's gradient too).
void group_norm_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1);
  const SymTensorMeta* weight = call.optional_tensor(4);
  std::vector<bool> mask = call.bool_list(9);
  call.check(mask.size() == 3, "output_mask");
  const bool low = x.dtype == ScalarType::BFloat16 || x.dtype == ScalarType::Half;
  call.check((low || x.dtype == ScalarType::Float || x.dtype == ScalarType::Double) && grad.dtype == x.dtype &&
                 x.dim() >= 2, "dtype or rank");
  call.check(!weight || weight->dtype == x.dtype || (low && weight->dtype == ScalarType::Float), "weight dtype");
  call.check(weight || (!mask[1] && !mask[2]), "parameter gradients without a weight");
  const ScalarType params = weight ? weight->dtype : x.dtype;
  call.check(is_contiguous(call, x) && is_contiguous(call, grad), "non-contiguous operands");
  require_same_sizes(call, grad, x, "the gradient");
  call.require_eq(call.int_arg(5), x.sizes[0], "N");
  call.require_eq(call.int_arg(6), x.sizes[1], "C");
  call.require_eq(call.int_arg(7), product({x.sizes.begin() + 2, x.sizes.end()}), "HxW");
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  if (mask[0]) {
    call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
  } else {
    call.add_none_output();
  }
  for (size_t i : {1, 2}) {
    if (mask[i]) {
      call.add_output(contiguous_meta({x.sizes[1]}, params, x.device));
    } else {
      call.add_none_output();
    }
  }
}

// _softmax_backward_data / _log_softmax_backward_data(grad, output, dim, input_dtype).
void softmax_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &out = call.tensor(1);
  auto input_dtype = call.optional_dtype(3);
  call.check(grad.dtype == ScalarType::Float || grad.dtype == ScalarType::Double, "dtype");
  call.check(input_dtype == grad.dtype && out.dtype == grad.dtype && grad.dim() > 0, "dtypes or rank");
  require_same_sizes(call, out, grad, "the output");
  wrap_dim(call, call.const_int(2), grad.dim());
  call.add_output(contiguous_meta(grad.sizes, grad.dtype, grad.device));
}

// select_backward(grad, input_sizes, dim, index): zeros of the input's sizes.
void select_backward_rule(RuleCall& call) {
  const SymTensorMeta& grad = call.tensor(0);
  std::vector<Expr> sizes = call.int_list(1);
  call.check(is_floating(grad.dtype) && static_cast<int64_t>(sizes.size()) == grad.dim() + 1, "dtype or rank");
  int64_t dim = wrap_dim(call, call.const_int(2), static_cast<int64_t>(sizes.size()));
  for (int64_t d = 0, g = 0; d < static_cast<int64_t>(sizes.size()); ++d)
    if (d != dim) call.require_eq(sizes[d], grad.sizes[g++], "the gradient's size");
  Expr index = call.simplify(call.int_arg(3));
  if (call.lt(index, 0, "the index's sign")) {
    call.require_le(-sizes[dim], index, "select's index in range");
  } else {
    call.require_lt(index, sizes[dim], "select's index in range");
  }
  call.add_output(contiguous_meta(sizes, grad.dtype, grad.device));
}

// convolution_backward(grad, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
// groups, output_mask). The input and weight gradients are contiguous, or on CUDA channels-last where cuDNN's suggested
// memory format is (cudnn_conv_suggest_memory_format: a 4-d input or weight whose strides read channels-last, not
// float64), which is what cuDNN returns; torch's meta kernel said contiguous there before torch 2.12. Channels-last
// on the CPU, and grouped convolutions (CUDA's depthwise kernels), are left to torch's meta kernel.
void convolution_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1), &w = call.tensor(2);
  std::vector<bool> mask = call.bool_list(10);
  call.check(mask.size() == 3, "output_mask");
  call.check(is_floating(x.dtype) && grad.dtype == x.dtype && w.dtype == x.dtype, "dtypes");
  call.check(x.dim() == w.dim() && x.dim() >= 3, "ranks");
  const bool channels_last = !not_channels_last(call, x) || !not_channels_last(call, w);
  if (channels_last)
    call.check(x.device.type == DeviceType::CUDA && x.dim() == 4 && x.dtype != ScalarType::Double &&
                   !call.bool_arg(7) && call.const_int(9) == 1,
               "a channels-last-looking input outside cuDNN's ungrouped 2-d convolutions");
  call.check(!mask[2] || !call.is_none(3), "a bias gradient without bias_sizes");
  auto in_format = [&](const std::vector<Expr>& sizes) {
    return channels_last ? make_meta(sizes, channels_last_strides(sizes), x.dtype, x.device)
                         : contiguous_meta(sizes, x.dtype, x.device);
  };
  if (mask[0]) {
    call.add_output(in_format(x.sizes));
  } else {
    call.add_none_output();
  }
  if (mask[1]) {
    call.add_output(in_format(w.sizes));
  } else {
    call.add_none_output();
  }
  if (mask[2]) {
    call.add_output(contiguous_meta(call.int_list(3), x.dtype, x.device));
  } else {
    call.add_none_output();
  }
}

// max_pool2d_with_indices_backward(grad, self, ...) and _adaptive_avg_pool2d_backward(grad, self): the input's
// sizes, contiguous.
void pool_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1);
  call.check(is_floating(x.dtype) && grad.dtype == x.dtype && (x.dim() == 3 || x.dim() == 4), "dtype or rank");
  call.check(grad.dim() == x.dim() && not_channels_last(call, x), "rank or a channels-last-looking input");
  for (int64_t d = 0; d < x.dim() - 2; ++d) call.require_eq(grad.sizes[d], x.sizes[d], "the gradient's batch dims");
  for (const Expr& s : grad.sizes) call.check(!call.size_is(s, 0), "an empty gradient");
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
}

// native_batch_norm_backward(grad, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
// output_mask) of contiguous operands.
void batch_norm_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1);
  const SymTensorMeta* weight = call.optional_tensor(2);
  std::vector<bool> mask = call.bool_list(9);
  call.check(mask.size() == 3, "output_mask");
  call.check((x.dtype == ScalarType::Float || x.dtype == ScalarType::Double) && grad.dtype == x.dtype, "dtype");
  call.check(x.dim() >= 2 && is_contiguous(call, x) && is_contiguous(call, grad), "rank or a non-contiguous operand");
  require_same_sizes(call, grad, x, "the gradient");
  call.check(weight && weight->dtype == x.dtype && weight->dim() == 1, "weight");
  call.require_eq(weight->sizes[0], x.sizes[1], "weight size");
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
  for (int i : {1, 2}) {
    if (mask[i]) {
      call.add_output(contiguous_meta({x.sizes[1]}, x.dtype, x.device));
    } else {
      call.add_none_output();
    }
  }
}

}  // namespace

void register_backward_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  add("native_layer_norm_backward.default", layer_norm_backward_rule);
  add("native_group_norm_backward.default", group_norm_backward_rule);
  add("_softmax_backward_data.default", softmax_backward_rule);
  add("_log_softmax_backward_data.default", softmax_backward_rule);
  add("select_backward.default", select_backward_rule);
  add("convolution_backward.default", convolution_backward_rule);
  add("max_pool2d_with_indices_backward.default", pool_backward_rule);
  add("_adaptive_avg_pool2d_backward.default", pool_backward_rule);
  add("native_batch_norm_backward.default", batch_norm_backward_rule);
}

}  // namespace kiln::graph::shape
