// Shape rules of the network ops: reductions, softmax, layer and batch norm, matrix products, embedding,
// convolution, 2-d pooling, the negative log likelihood loss, and the fused attention kernels
// scaled_dot_product_attention lowers to (forward and backward).
//
// Design note: these kernels allocate their outputs (contiguous, or in the input's suggested memory format), so
// the rules compute sizes: reduced dims, matrix dims (inner sizes must agree: an assumption where unproven),
// convolution and pooling sizes as floordiv expressions (shape_rules.cpp). The dtypes are concrete.
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

// sum.dim_IntList / mean.dim (self, dim, keepdim, dtype) and amax / amin (self, dim, keepdim).
void reduction_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(call.num_args() < 4 || call.is_none(3), "a dtype argument");
  call.check(is_floating(x.dtype) && x.dim() > 0, "a non-floating or 0-d input");
  std::vector<int64_t> listed = call.is_none(1) ? std::vector<int64_t>{} : call.const_int_list(1);
  bool keepdim = call.num_args() > 2 && call.bool_arg(2);
  call.add_output(contiguous_meta(reduced_sizes(call, x, listed, keepdim), x.dtype, x.device));
}

// _softmax / _log_softmax (self, dim, half_to_float) and _safe_softmax (self, dim, dtype).
void softmax_rule(RuleCall& call, bool safe) {
  const SymTensorMeta& x = call.tensor(0);
  if (safe) {
    auto dtype = call.optional_dtype(2);
    call.check(is_floating(x.dtype) && (!dtype || *dtype == x.dtype), "dtype");
  } else {
    call.check(x.dtype == ScalarType::Float || x.dtype == ScalarType::Double, "dtype");
    call.check(!call.bool_arg(2), "half_to_float");
  }
  call.check(x.dim() > 0, "a 0-d input");
  wrap_dim(call, call.const_int(1), x.dim());
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
}

// native_layer_norm(input, normalized_shape, weight, bias, eps): output, mean and rstd.
void layer_norm_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> normalized = call.int_list(1);
  call.check(x.dtype == ScalarType::Float || x.dtype == ScalarType::Double, "dtype");
  int64_t axis = x.dim() - static_cast<int64_t>(normalized.size());
  call.check(axis >= 0, "normalized_shape longer than the input");
  for (size_t i = 0; i < normalized.size(); ++i)
    call.require_eq(x.sizes[axis + i], normalized[i], "normalized_shape");
  for (size_t i : {2, 3}) {
    const SymTensorMeta* p = call.optional_tensor(i);
    if (!p) continue;
    call.check(p->dtype == x.dtype && p->dim() == static_cast<int64_t>(normalized.size()), "weight or bias");
    for (size_t d = 0; d < normalized.size(); ++d) call.require_eq(p->sizes[d], normalized[d], "weight or bias size");
  }
  no_empty(call, x.sizes);
  std::vector<Expr> stat(x.sizes.begin(), x.sizes.begin() + axis);
  stat.resize(x.sizes.size(), Expr(1));
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
  call.add_output(contiguous_meta(stat, x.dtype, x.device));
  call.add_output(contiguous_meta(stat, x.dtype, x.device));
}

// native_group_norm(input, weight, bias, N, C, HxW, group, eps) of a contiguous input: output, mean and rstd
// ([N, group]). N, C and HxW must be the input's batch, channels and spatial product (the composite computes them
// from its sizes: graph/infer_recorded_sizes.h gives their forms).
// A 16-bit input with float32 weight and bias (CPU autocast runs group norm so) is ATen's mixed type: the statistics
// are float32 (torch's meta kernel says the input's dtype).
void group_norm_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  const bool low = x.dtype == ScalarType::BFloat16 || x.dtype == ScalarType::Half;
  call.check((low || x.dtype == ScalarType::Float || x.dtype == ScalarType::Double) && x.dim() >= 2, "dtype or rank");
  call.check(is_contiguous(call, x), "a non-contiguous input");
  const int64_t group = call.const_int(6);
  call.check(group >= 1, "group");
  call.require_eq(call.int_arg(3), x.sizes[0], "N");
  call.require_eq(call.int_arg(4), x.sizes[1], "C");
  call.require_eq(call.int_arg(5), product({x.sizes.begin() + 2, x.sizes.end()}), "HxW");
  call.require_divisible(x.sizes[1], group, "channels by groups");
  bool mixed = false;
  for (size_t i : {1, 2}) {
    const SymTensorMeta* p = call.optional_tensor(i);
    if (!p) continue;
    mixed = mixed || p->dtype != x.dtype;
    call.check((p->dtype == x.dtype || (low && p->dtype == ScalarType::Float)) && p->dim() == 1, "weight or bias");
    call.require_eq(p->sizes[0], x.sizes[1], "weight or bias size");
  }
  if (mixed)  // ATen requires both parameters float32 then
    for (size_t i : {1, 2})
      if (const SymTensorMeta* p = call.optional_tensor(i)) call.check(p->dtype == ScalarType::Float, "weight and bias dtypes");
  no_empty(call, x.sizes);
  const ScalarType stats = mixed ? ScalarType::Float : x.dtype;
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
  call.add_output(contiguous_meta({x.sizes[0], Expr(group)}, stats, x.device));
  call.add_output(contiguous_meta({x.sizes[0], Expr(group)}, stats, x.device));
}

void same_floating(RuleCall& call, const std::vector<const SymTensorMeta*>& tensors) {
  for (const SymTensorMeta* t : tensors)
    call.check(t->dtype == tensors[0]->dtype && is_floating(t->dtype), "operands of different or non-floating dtypes");
}

void mm_rule(RuleCall& call) {
  const SymTensorMeta &a = call.tensor(0), &b = call.tensor(1);
  same_floating(call, {&a, &b});
  call.check(a.dim() == 2 && b.dim() == 2, "mm of non-matrices");
  call.require_eq(a.sizes[1], b.sizes[0], "mm's inner dim");
  call.add_output(contiguous_meta({a.sizes[0], b.sizes[1]}, a.dtype, a.device));
}

// addmm(self, mat1, mat2, beta, alpha): self broadcasts to the product's shape.
void addmm_rule(RuleCall& call) {
  const SymTensorMeta &bias = call.tensor(0), &a = call.tensor(1), &b = call.tensor(2);
  same_floating(call, {&bias, &a, &b});
  call.check(a.dim() == 2 && b.dim() == 2 && bias.dim() <= 2, "addmm's ranks");
  call.require_eq(a.sizes[1], b.sizes[0], "addmm's inner dim");
  std::vector<Expr> shape = {a.sizes[0], b.sizes[1]};
  std::vector<Expr> broadcast = broadcast_shape(call, {bias.sizes, shape});
  for (size_t d = 0; d < 2; ++d) call.require_eq(broadcast[d], shape[d], "addmm's bias size");
  call.add_output(contiguous_meta(shape, a.dtype, a.device));
}

void bmm_rule(RuleCall& call) {
  const SymTensorMeta &a = call.tensor(0), &b = call.tensor(1);
  same_floating(call, {&a, &b});
  call.check(a.dim() == 3 && b.dim() == 3, "bmm of non-3-d tensors");
  call.require_eq(a.sizes[0], b.sizes[0], "bmm's batch");
  call.require_eq(a.sizes[2], b.sizes[1], "bmm's inner dim");
  call.add_output(contiguous_meta({a.sizes[0], a.sizes[1], b.sizes[2]}, a.dtype, a.device));
}

// matmul where ATen computes it as one mm / bmm viewed back (contiguous): a vector or matrix second operand, or
// both batched. (A matrix times a batch folds into a transposed result: left to torch.)
void matmul_rule(RuleCall& call) {
  const SymTensorMeta &a = call.tensor(0), &b = call.tensor(1);
  same_floating(call, {&a, &b});
  call.check(a.dim() >= 1 && b.dim() >= 1, "matmul of 0-d tensors");
  call.check(b.dim() <= 2 || a.dim() >= 3, "a matrix times a batch");
  std::vector<Expr> sizes;
  if (b.dim() == 1) {
    call.require_eq(a.sizes.back(), b.sizes[0], "matmul's inner dim");
    sizes.assign(a.sizes.begin(), a.sizes.end() - 1);
  } else if (a.dim() == 1) {
    call.require_eq(a.sizes[0], b.sizes[0], "matmul's inner dim");
    sizes = {b.sizes[1]};
  } else {
    call.require_eq(a.sizes.back(), b.sizes[b.dim() - 2], "matmul's inner dim");
    std::vector<Expr> batch_a(a.sizes.begin(), a.sizes.end() - 2), batch_b(b.sizes.begin(), b.sizes.end() - 2);
    sizes = broadcast_shape(call, {batch_a, batch_b});
    sizes.push_back(a.sizes[a.dim() - 2]);
    sizes.push_back(b.sizes.back());
  }
  no_empty(call, sizes);
  call.add_output(contiguous_meta(sizes, a.dtype, a.device));
}

// linear(input, weight, bias): input's leading dims and weight's rows.
void linear_rule(RuleCall& call) {
  const SymTensorMeta &x = call.tensor(0), &w = call.tensor(1);
  const SymTensorMeta* bias = call.optional_tensor(2);
  same_floating(call, bias ? std::vector<const SymTensorMeta*>{&x, &w, bias} : std::vector<const SymTensorMeta*>{&x, &w});
  call.check(x.dim() >= 2 && w.dim() == 2, "linear's ranks");
  call.require_eq(x.sizes.back(), w.sizes[1], "linear's inner dim");
  std::vector<Expr> sizes(x.sizes.begin(), x.sizes.end() - 1);
  sizes.push_back(w.sizes[0]);
  if (bias) {
    std::vector<Expr> broadcast = broadcast_shape(call, {bias->sizes, sizes});
    call.check(broadcast.size() == sizes.size(), "a bias of more dims");
  }
  no_empty(call, sizes);
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

void embedding_rule(RuleCall& call) {
  const SymTensorMeta &weight = call.tensor(0), &indices = call.tensor(1);
  call.check(weight.dim() == 2 && is_floating(weight.dtype), "weight");
  call.check(indices.dtype == ScalarType::Long || indices.dtype == ScalarType::Int, "indices' dtype");
  std::vector<Expr> sizes = indices.sizes;
  sizes.push_back(weight.sizes[1]);
  call.add_output(contiguous_meta(sizes, weight.dtype, weight.device));
}

// convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups) of contiguous
// inputs (not channels-last-looking): contiguous outputs of conv_output_size. A transposed convolution's weight is
// [in, out / groups, kernel...] and its output (size - 1) * stride - 2 * padding + dilation * (kernel - 1) +
// output_padding + 1.
void convolution_rule(RuleCall& call) {
  const SymTensorMeta &x = call.tensor(0), &w = call.tensor(1);
  const SymTensorMeta* bias = call.optional_tensor(2);
  std::vector<int64_t> stride = call.const_int_list(3), padding = call.const_int_list(4),
                       dilation = call.const_int_list(5);
  const bool transposed = call.bool_arg(6);
  std::vector<int64_t> output_padding = transposed ? call.const_int_list(7) : std::vector<int64_t>{};
  int64_t groups = call.const_int(8);
  same_floating(call, {&x, &w});
  const int64_t spatial = x.dim() - 2;
  call.check(spatial >= 1 && w.dim() == x.dim(), "ranks");
  for (const auto* v : {&stride, &padding, &dilation})
    call.check(static_cast<int64_t>(v->size()) == spatial, "stride, padding or dilation of the wrong length");
  call.check(!transposed || static_cast<int64_t>(output_padding.size()) == spatial, "output_padding of the wrong length");
  no_empty(call, x.sizes);
  call.check(is_contiguous(call, x), "a non-contiguous input");
  call.check(!(x.dim() == 4 && is_channels_last_contiguous(call, x)), "an input that is channels-last as well");
  call.check(!strides_like_channels_last(call, w), "a channels-last weight");
  call.check(groups >= 1, "groups");
  const Expr out_channels = transposed ? w.sizes[1] * groups : w.sizes[0];
  if (transposed) {
    call.require_eq(x.sizes[1], w.sizes[0], "input channels");
    call.require_divisible(w.sizes[0], groups, "input channels by groups");
  } else {
    call.require_eq(x.sizes[1], w.sizes[1] * groups, "input channels");
    call.require_divisible(w.sizes[0], groups, "output channels by groups");
  }
  if (bias) {
    call.check(bias->dtype == x.dtype && bias->dim() == 1, "bias");
    call.require_eq(bias->sizes[0], out_channels, "bias size");
  }
  std::vector<Expr> sizes = {x.sizes[0], out_channels};
  for (int64_t i = 0; i < spatial; ++i) {
    call.check(stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0, "stride, padding or dilation");
    Expr size = transposed ? (x.sizes[2 + i] - 1) * stride[i] - 2 * padding[i] +
                                 dilation[i] * (w.sizes[2 + i] - 1) + output_padding[i] + 1
                           : conv_output_size(x.sizes[2 + i], w.sizes[2 + i], stride[i], padding[i], dilation[i]);
    call.require_le(1, size, "convolution output size");
    sizes.push_back(size);
  }
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

// A tensor of `sizes` in like.suggest_memory_format() (channels-last for 4-d inputs whose strides read so).
std::vector<Expr> suggested_strides(RuleCall& call, const std::vector<Expr>& sizes, const SymTensorMeta& like) {
  if (like.dim() == 4 && strides_like_channels_last(call, like)) return channels_last_strides(sizes);
  return contiguous_strides(sizes);
}

std::vector<int64_t> pair(RuleCall& call, std::vector<int64_t> v) {
  call.check(v.size() == 1 || v.size() == 2, "a pooling parameter of the wrong length");
  if (v.size() == 1) v.push_back(v[0]);
  return v;
}

// max_pool2d_with_indices(self, kernel, stride, padding, dilation, ceil_mode) and avg_pool2d(self, kernel, stride,
// padding, ceil_mode, count_include_pad, divisor_override).
void pool2d_rule(RuleCall& call, bool max) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<int64_t> kernel = pair(call, call.const_int_list(1));
  std::vector<int64_t> stride = call.const_int_list(2);
  stride = stride.empty() ? kernel : pair(call, stride);
  std::vector<int64_t> padding = pair(call, call.const_int_list(3));
  std::vector<int64_t> dilation = max ? pair(call, call.const_int_list(4)) : std::vector<int64_t>{1, 1};
  bool ceil_mode = call.bool_arg(max ? 5 : 4);
  if (!max) {
    call.bool_arg(5);
    call.check(call.is_none(6) || call.const_int(6) != 0, "divisor_override 0");
  }
  call.check((x.dim() == 3 || x.dim() == 4) && is_floating(x.dtype), "rank or dtype");
  no_empty(call, x.sizes);
  std::vector<Expr> sizes(x.sizes.begin(), x.sizes.end() - 2);
  for (int i = 0; i < 2; ++i) {
    int64_t k = kernel[i], s = stride[i], p = padding[i], d = dilation[i];
    call.check(k > 0 && s > 0 && d > 0 && p >= 0 && p <= k / 2, "kernel, stride, padding or dilation");
    Expr size = pool_output_size(x.sizes[x.dim() - 2 + i], k, s, p, d, ceil_mode);
    call.require_le(1, size, "pooling output size");
    sizes.push_back(size);
  }
  std::vector<Expr> strides = suggested_strides(call, sizes, x);
  call.add_output(make_meta(sizes, strides, x.dtype, x.device));
  if (max) call.add_output(make_meta(sizes, strides, ScalarType::Long, x.device));
}

void adaptive_avg_pool2d_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> output_size = call.int_list(1);
  call.check(output_size.size() == 2, "output_size of the wrong length");
  call.check((x.dim() == 3 || x.dim() == 4) && is_floating(x.dtype), "rank or dtype");
  no_empty(call, x.sizes);
  std::vector<Expr> sizes(x.sizes.begin(), x.sizes.end() - 2);
  for (const Expr& s : output_size) {
    call.check(call.le(1, s, "an output size"), "an output size below 1");
    sizes.push_back(s);
  }
  call.add_output(make_meta(sizes, suggested_strides(call, sizes, x), x.dtype, x.device));
}

enum class BatchNorm { kNative, kLegit, kLegitNoStats, kLegitNoTraining, kLegitFunctional, kCudnn };

// native_batch_norm and its _native_batch_norm_legit* and cudnn forms: the output laid out as every backend lays it
// out (contiguous, or channels-last for channels-last-contiguous 4-d inputs), statistics of [C] in the accumulation
// dtype as torch's meta kernel gives them.
void batch_norm_rule(RuleCall& call, BatchNorm kind) {
  const SymTensorMeta& x = call.tensor(0);
  const SymTensorMeta *weight = call.optional_tensor(1), *bias = call.optional_tensor(2);
  const SymTensorMeta *running_mean = nullptr, *running_var = nullptr;
  bool training;
  if (kind == BatchNorm::kLegitNoStats) {
    training = call.bool_arg(3);
  } else {
    running_mean = call.optional_tensor(3);
    running_var = call.optional_tensor(4);
    training = kind == BatchNorm::kLegitNoTraining ? false : call.bool_arg(5);
  }
  call.check(x.dim() >= 2, "rank");
  no_empty(call, x.sizes);
  const Expr& channels = x.sizes[1];
  std::vector<const SymTensorMeta*> params;
  for (const SymTensorMeta* p : {weight, bias, running_mean, running_var})
    if (p) params.push_back(p);
  for (const SymTensorMeta* p : params) {
    call.check(p->dim() == 1, "a parameter that is not 1-d");
    call.require_eq(p->sizes[0], channels, "a parameter's size");
  }
  call.check((running_mean == nullptr) == (running_var == nullptr), "one running statistic");
  call.check(training || running_mean != nullptr, "eval mode without running statistics");
  if (training) {
    std::vector<Expr> others = x.sizes;
    others.erase(others.begin() + 1);
    call.require_lt(1, product(others), "values per channel");
  }
  bool cudnn = kind == BatchNorm::kCudnn;
  call.check(!cudnn || (weight && bias), "cudnn without weight and bias");
  ScalarType param_dtype = params.empty() ? x.dtype : params[0]->dtype;
  for (const SymTensorMeta* p : params) call.check(p->dtype == param_dtype, "parameters of two dtypes");
  ScalarType stat_dtype;
  bool full = x.dtype == ScalarType::Float || (!cudnn && x.dtype == ScalarType::Double);
  if (full && param_dtype == x.dtype) {
    stat_dtype = x.dtype;
  } else if ((x.dtype == ScalarType::Half || x.dtype == ScalarType::BFloat16) && param_dtype == ScalarType::Float &&
             !params.empty()) {
    stat_dtype = ScalarType::Float;
  } else {
    call.refuse("a dtype combination whose statistics differ between CPU and CUDA");
  }
  bool like_channels_last = strides_like_channels_last(call, x);
  std::vector<Expr> strides;
  if (!like_channels_last && is_contiguous(call, x)) {
    strides = contiguous_strides(x.sizes);
  } else if (x.dim() == 4 && like_channels_last && !is_contiguous(call, x) && is_channels_last_contiguous(call, x)) {
    strides = channels_last_strides(x.sizes);
  } else {
    call.refuse("an input layout backends treat differently");
  }
  call.add_output(make_meta(x.sizes, strides, x.dtype, x.device));
  std::vector<Expr> stat = cudnn && !training ? std::vector<Expr>{0} : std::vector<Expr>{channels};
  call.add_output(contiguous_meta(stat, stat_dtype, x.device));
  call.add_output(contiguous_meta(stat, stat_dtype, x.device));
  if (cudnn) call.add_output(contiguous_meta({0}, ScalarType::Byte, x.device));
  if (kind == BatchNorm::kLegitFunctional) {
    call.add_output(contiguous_meta({channels}, param_dtype, x.device));
    call.add_output(contiguous_meta({channels}, param_dtype, x.device));
  }
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight, reduction, ignore_index): the loss (the batch's sizes
// for reduction none, else 0-d) and total_weight (0-d), in self's dtype. self is (N, C) or (C) for nll_loss,
// (N, C, H, W) for nll_loss2d; target the same without C.
void nll_loss_rule(RuleCall& call, bool two_d) {
  const SymTensorMeta &x = call.tensor(0), &target = call.tensor(1);
  call.check(is_floating(x.dtype) && target.dtype == ScalarType::Long, "dtypes");
  call.check(two_d ? x.dim() == 4 : x.dim() == 1 || x.dim() == 2, "rank");
  call.check(target.dim() == x.dim() - 1, "the target's rank");
  no_empty(call, x.sizes);
  std::vector<Expr> batch = x.sizes;  // (N), (N, H, W) or () for an input of one row
  const Expr classes = x.dim() == 1 ? x.sizes[0] : x.sizes[1];
  batch.erase(batch.begin() + (x.dim() == 1 ? 0 : 1));
  for (size_t d = 0; d < batch.size(); ++d) call.require_eq(target.sizes[d], batch[d], "the target's size");
  if (const SymTensorMeta* weight = call.optional_tensor(2)) {
    call.check(weight->dim() == 1 && weight->dtype == x.dtype, "weight");
    call.require_eq(weight->sizes[0], classes, "weight's size");
  }
  const int64_t reduction = call.const_int(3);
  call.check(reduction >= 0 && reduction <= 2, "reduction");
  call.add_output(contiguous_meta(reduction == 0 ? batch : std::vector<Expr>{}, x.dtype, x.device));
  call.add_output(contiguous_meta({}, x.dtype, x.device));
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
// the gradient of self, contiguous.
void nll_loss_backward_rule(RuleCall& call, bool two_d) {
  const SymTensorMeta &grad = call.tensor(0), &x = call.tensor(1), &target = call.tensor(2);
  call.check(is_floating(x.dtype) && grad.dtype == x.dtype && target.dtype == ScalarType::Long, "dtypes");
  call.check(two_d ? x.dim() == 4 : x.dim() == 1 || x.dim() == 2, "rank");
  call.check(target.dim() == x.dim() - 1, "the target's rank");
  no_empty(call, x.sizes);
  if (call.const_int(4) == 0) {
    call.check(grad.dim() == target.dim(), "the gradient's rank");
    for (int64_t d = 0; d < grad.dim(); ++d) call.require_eq(grad.sizes[d], target.sizes[d], "the gradient's size");
  } else {
    for (const Expr& s : grad.sizes) call.check(call.size_is(s, 1), "a reduced loss's gradient of more elements");
  }
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
}

// query, key, value: 4-d, one dtype, key and value of query's batch and heads, key of its head dim. With
// `grouped_heads` (enable_gqa), key and value have a number of heads that divides query's: the heads are pinned
// (grouped-query attention in generation: only the cache's length varies).
void attention_operands(RuleCall& call, const SymTensorMeta& q, const SymTensorMeta& k, const SymTensorMeta& v,
                        bool grouped_heads = false) {
  for (const SymTensorMeta* t : {&q, &k, &v}) {
    call.check(t->dim() == 4 && t->dtype == q.dtype && is_floating(q.dtype), "rank or dtype");
    no_empty(call, t->sizes);
  }
  call.require_eq(k.sizes[0], q.sizes[0], "key's batch");
  call.require_eq(v.sizes[0], q.sizes[0], "value's batch");
  if (grouped_heads) {
    const int64_t heads = call.pinned(q.sizes[1], "query's heads (grouped-query attention)").constant_value();
    const int64_t groups = call.pinned(k.sizes[1], "key's heads (grouped-query attention)").constant_value();
    call.require_eq(v.sizes[1], k.sizes[1], "value's heads");
    call.check(groups > 0 && heads % groups == 0, "key's heads that do not divide query's");
  } else {
    call.require_eq(k.sizes[1], q.sizes[1], "key's heads");
    call.require_eq(v.sizes[1], q.sizes[1], "value's heads");
  }
  call.require_eq(v.sizes[2], k.sizes[2], "value's length");
  call.require_eq(k.sizes[3], q.sizes[3], "key's head dim");
}

// The fused kernels' layout: (batch, length, heads, dim) allocated contiguous, transposed to (batch, heads, length, dim).
SymTensorMeta heads_transposed(const std::vector<Expr>& sizes, ScalarType dtype, const Device& device) {
  const Expr &heads = sizes[1], &length = sizes[2], &dim = sizes[3];
  return make_meta(sizes, {length * heads * dim, dim, heads * dim, 1}, dtype, device);
}

// A mask broadcasts to the scores (batch, heads, length, key length).
void attention_mask(RuleCall& call, const SymTensorMeta& mask, const SymTensorMeta& q, const SymTensorMeta& k) {
  std::vector<Expr> scores = {q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
  std::vector<Expr> b = broadcast_shape(call, {mask.sizes, scores});
  call.check(b.size() == 4, "a mask of more dims");
  for (int d = 0; d < 4; ++d) call.require_eq(b[d], scores[d], "the mask's size");
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask, scale): the output in
// query's layout, logsumexp (batch, length, heads) transposed to (batch, heads, length).
void flash_attention_cpu_rule(RuleCall& call) {
  const SymTensorMeta &q = call.tensor(0), &k = call.tensor(1), &v = call.tensor(2);
  attention_operands(call, q, k, v);
  auto dropout = call.number(3);
  call.check(dropout && *dropout == 0, "dropout");
  bool causal = call.bool_arg(4);
  call.require_eq(v.sizes[3], q.sizes[3], "value's head dim");
  call.check(is_non_overlapping_and_dense(call, q), "a non-dense query");
  if (const SymTensorMeta* mask = call.optional_tensor(5)) {
    call.check(!causal && mask->dtype == q.dtype, "a mask with is_causal or of another dtype");
    attention_mask(call, *mask, q, k);
  }
  call.check(call.is_none(6) || call.number(6).has_value(), "scale");
  ScalarType lse = q.dtype == ScalarType::Half || q.dtype == ScalarType::BFloat16 ? ScalarType::Float : q.dtype;
  const Expr &length = q.sizes[2], &heads = q.sizes[1];
  call.add_output(make_meta(q.sizes, q.strides, q.dtype, q.device));
  call.add_output(make_meta({q.sizes[0], heads, length}, {length * heads, 1, heads}, lse, q.device));
}

// scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa), recorded whole: the
// output (batch, heads, length, v_dim) in the layout python/kiln/_fake.py records (_fused_attention_layout): the fused
// kernels' (batch, length, heads, v_dim) transposed when q, k and v have unit stride in the head dim, a dtype of
// f32/f16/bf16, a head dim that is a multiple of 8 up to 256, and no boolean mask; contiguous otherwise.
void attention_rule(RuleCall& call) {
  const SymTensorMeta &q = call.tensor(0), &k = call.tensor(1), &v = call.tensor(2);
  attention_operands(call, q, k, v, !call.is_none(7) && call.bool_arg(7));
  const SymTensorMeta* mask = call.optional_tensor(3);
  if (mask) attention_mask(call, *mask, q, k);
  // The fused kernels' choice depends on the head dim's value: it is pinned (a guard) rather than decided per size.
  const Expr head_dim = call.pinned(q.sizes[3], "the head dim (it picks the attention kernel)");
  bool fused = !(mask && mask->dtype == ScalarType::Bool) &&
               (q.dtype == ScalarType::Float || q.dtype == ScalarType::Half || q.dtype == ScalarType::BFloat16) &&
               head_dim.constant_value() % 8 == 0 && head_dim.constant_value() <= 256 &&
               call.eq(v.sizes[3], head_dim, "value's head dim");
  for (const SymTensorMeta* t : {&q, &k, &v}) fused = fused && call.eq(t->strides[3], 1, "the head dim's stride");
  std::vector<Expr> sizes = {q.sizes[0], q.sizes[1], q.sizes[2], v.sizes[3]};
  // _fake.py makes that layout as `transpose(1, 2).contiguous().transpose(1, 2)`: with one head or one query row (a
  // generation step) the transposed tensor is contiguous already, and the math path's layout stays.
  fused = fused && !call.size_is(q.sizes[1], 1) && !call.size_is(q.sizes[2], 1);
  call.add_output(fused ? heads_transposed(sizes, q.dtype, q.device) : contiguous_meta(sizes, q.dtype, q.device));
}

// _scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale):
// the output (batch, length, heads, v_dim) transposed, logsumexp rounded up to 32 rows, seed and offset.
void efficient_attention_rule(RuleCall& call) {
  const SymTensorMeta &q = call.tensor(0), &k = call.tensor(1), &v = call.tensor(2);
  attention_operands(call, q, k, v);
  call.check(q.dtype != ScalarType::Double, "dtype");
  bool lse = call.bool_arg(4);
  call.check(call.is_none(7) || call.number(7).has_value(), "scale");
  const Expr &batch = q.sizes[0], &heads = q.sizes[1], &length = q.sizes[2];
  call.add_output(heads_transposed({batch, heads, length, v.sizes[3]}, q.dtype, q.device));
  Expr rows = lse ? sym::floordiv(length + 31, 32) * 32 : Expr(0);
  call.add_output(contiguous_meta({batch, heads, rows}, ScalarType::Float, q.device));
  call.add_output(contiguous_meta({}, ScalarType::Long, q.device));
  call.add_output(contiguous_meta({}, ScalarType::Long, q.device));
}

// The gradients of query, key and value of the fused kernels' backward ops, each in the fused layout; grad_out is
// the output's (batch, heads, length, v_dim).
void attention_gradients(RuleCall& call, const SymTensorMeta& grad, const SymTensorMeta& q, const SymTensorMeta& k,
                         const SymTensorMeta& v) {
  attention_operands(call, q, k, v);
  call.check(grad.dim() == 4 && grad.dtype == q.dtype, "the gradient's rank or dtype");
  for (int d = 0; d < 3; ++d) call.require_eq(grad.sizes[d], q.sizes[d], "the gradient's size");
  call.require_eq(grad.sizes[3], v.sizes[3], "the gradient's size");
  for (const SymTensorMeta* t : {&q, &k, &v}) call.add_output(heads_transposed(t->sizes, q.dtype, q.device));
}

// _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal,
// attn_mask, scale).
void flash_attention_cpu_backward_rule(RuleCall& call) {
  const SymTensorMeta &q = call.tensor(1), &k = call.tensor(2), &v = call.tensor(3);
  auto dropout = call.number(6);
  call.check(dropout && *dropout == 0, "dropout");
  call.require_eq(v.sizes[3], q.sizes[3], "value's head dim");
  if (const SymTensorMeta* mask = call.optional_tensor(8)) {
    call.check(!call.bool_arg(7) && mask->dtype == q.dtype, "a mask with is_causal or of another dtype");
    attention_mask(call, *mask, q, k);
  }
  attention_gradients(call, call.tensor(0), q, k, v);
}

// _scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, attn_bias, out, logsumexp, philox_seed,
// philox_offset, dropout_p, grad_input_mask, is_causal, scale): the three gradients and no bias gradient.
void efficient_attention_backward_rule(RuleCall& call) {
  std::vector<bool> mask = call.bool_list(10);
  call.check(mask.size() == 4 && (call.is_none(4) || !mask[3]), "a bias gradient");
  attention_gradients(call, call.tensor(0), call.tensor(1), call.tensor(2), call.tensor(3));
  call.add_none_output();
}

}  // namespace

// _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
// mask, need_weights, average_attn_weights, mask_type): nn.MultiheadAttention's inference fast path (batch first).
// Query, key and value of one shape and floating dtype (ATen raises otherwise), the projections' parameters of the
// embedding dim. The output has the query's sizes, contiguous; the weights are (batch, length, key length), per head
// without averaging, or an empty tensor when not asked for (torch's meta kernel's; eager returns None).
void native_multi_head_attention_rule(RuleCall& call) {
  const SymTensorMeta &q = call.tensor(0), &k = call.tensor(1), &v = call.tensor(2);
  call.check(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "batch-first 3-d query, key and value");
  call.check(is_floating(q.dtype) && k.dtype == q.dtype && v.dtype == q.dtype, "query, key and value dtypes");
  for (int64_t d = 0; d < 3; ++d) {
    call.require_eq(k.sizes[d], q.sizes[d], "key and query sizes");
    call.require_eq(v.sizes[d], q.sizes[d], "value and query sizes");
    call.check(!call.size_is(q.sizes[d], 0), "an empty query");
  }
  const Expr dim = q.sizes[2];
  call.require_eq(call.int_arg(3), dim, "embed_dim");
  const int64_t heads = call.const_int(4);
  call.check(heads >= 1, "num_head");
  call.require_divisible(dim, heads, "embed_dim by num_head");
  const std::vector<std::vector<Expr>> param_sizes = {{dim * 3, dim}, {dim * 3}, {dim, dim}, {dim}};
  for (size_t i = 0; i < param_sizes.size(); ++i) {
    const SymTensorMeta& param = call.tensor(5 + i);
    call.check(param.dtype == q.dtype && param.dim() == static_cast<int64_t>(param_sizes[i].size()), "a parameter");
    for (size_t d = 0; d < param_sizes[i].size(); ++d) call.require_eq(param.sizes[d], param_sizes[i][d], "parameter size");
  }
  call.add_output(contiguous_meta(q.sizes, q.dtype, q.device));
  const bool need_weights = call.is_none(10) || call.bool_arg(10);
  const bool average = call.is_none(11) || call.bool_arg(11);
  if (!need_weights) {
    call.add_output(contiguous_meta({Expr(0)}, q.dtype, q.device));
  } else if (average) {
    call.add_output(contiguous_meta({q.sizes[0], q.sizes[1], k.sizes[1]}, q.dtype, q.device));
  } else {
    call.add_output(contiguous_meta({q.sizes[0], Expr(call.const_int(4)), q.sizes[1], k.sizes[1]}, q.dtype, q.device));
  }
}

void register_nn_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  for (const char* op : {"sum.dim_IntList", "mean.dim", "amax.default", "amin.default"}) add(op, reduction_rule);
  for (const char* op : {"sum.default", "mean.default"})  // (self, dtype): a 0-d result
    add(op, [](RuleCall& call) {
      const SymTensorMeta& x = call.tensor(0);
      call.check(call.is_none(1) && is_floating(x.dtype), "a dtype argument or a non-floating input");
      call.add_output(contiguous_meta({}, x.dtype, x.device));
    });
  add("_softmax.default", [](RuleCall& call) { softmax_rule(call, false); });
  add("_log_softmax.default", [](RuleCall& call) { softmax_rule(call, false); });
  add("_safe_softmax.default", [](RuleCall& call) { softmax_rule(call, true); });
  add("native_layer_norm.default", layer_norm_rule);
  add("native_group_norm.default", group_norm_rule);
  add("mm.default", mm_rule);
  add("addmm.default", addmm_rule);
  add("bmm.default", bmm_rule);
  add("matmul.default", matmul_rule);
  add("linear.default", linear_rule);
  add("embedding.default", embedding_rule);
  add("convolution.default", convolution_rule);
  add("max_pool2d_with_indices.default", [](RuleCall& call) { pool2d_rule(call, true); });
  add("avg_pool2d.default", [](RuleCall& call) { pool2d_rule(call, false); });
  add("_adaptive_avg_pool2d.default", adaptive_avg_pool2d_rule);
  const std::pair<const char*, BatchNorm> batch_norms[] = {
      {"native_batch_norm.default", BatchNorm::kNative},
      {"_native_batch_norm_legit.default", BatchNorm::kLegit},
      {"_native_batch_norm_legit.no_stats", BatchNorm::kLegitNoStats},
      {"_native_batch_norm_legit_no_training.default", BatchNorm::kLegitNoTraining},
      {"_native_batch_norm_legit_functional.default", BatchNorm::kLegitFunctional},
      {"cudnn_batch_norm.default", BatchNorm::kCudnn}};
  for (const auto& [op, kind] : batch_norms) {
    BatchNorm k = kind;
    add(op, [k](RuleCall& call) { batch_norm_rule(call, k); });
  }
  add("scaled_dot_product_attention.default", attention_rule);
  add("_scaled_dot_product_flash_attention_for_cpu.default", flash_attention_cpu_rule);
  add("_scaled_dot_product_efficient_attention.default", efficient_attention_rule);
  add("_scaled_dot_product_flash_attention_for_cpu_backward.default", flash_attention_cpu_backward_rule);
  add("_scaled_dot_product_efficient_attention_backward.default", efficient_attention_backward_rule);
  add("_native_multi_head_attention.default", native_multi_head_attention_rule);
  add("nll_loss_forward.default", [](RuleCall& call) { nll_loss_rule(call, false); });
  add("nll_loss2d_forward.default", [](RuleCall& call) { nll_loss_rule(call, true); });
  add("nll_loss_backward.default", [](RuleCall& call) { nll_loss_backward_rule(call, false); });
  add("nll_loss2d_backward.default", [](RuleCall& call) { nll_loss_backward_rule(call, true); });
}

}  // namespace kiln::graph::shape
