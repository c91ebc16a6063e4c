// Derivative rules beyond the seed models' ops: math, masks, shapes, losses, norms, statistics, interpolation and
// activations with an ATen backward. As in derivative_rules.cpp, each mirrors the formula eager autograd uses
// (tools/autograd/derivatives.yaml), so gradients agree to rounding; the OpInfo gradient sweep
// (tests/python/test_opinfo_grad_sweep.py) checks them against eager.
#include <set>

#include "autodiff/derivative_rule_helpers.h"
#include "common/error.h"

namespace kiln::autodiff::detail {

Reduced reduced_dims(RuleCall& c, size_t dims_arg) {
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  Reduced r;
  std::vector<int64_t> dims = c.is_none(dims_arg) ? std::vector<int64_t>{} : c.ints_arg(dims_arg);
  std::set<int64_t> set;
  for (int64_t d : dims) set.insert(normalize_dim(d, sizes.size()));
  r.kept_sizes = sizes;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (set.empty() || set.count(static_cast<int64_t>(i))) {
      r.dims.push_back(static_cast<int64_t>(i));
      r.kept_sizes[i] = 1;
      r.count *= sizes[i];
    }
  return r;
}
ValueId kept(RuleCall& c, ValueId v, const Reduced& r, bool keepdim) { return keepdim ? v : c.b.reshape(v, r.kept_sizes); }

namespace {

// ---- more pointwise math (formulas of derivatives.yaml) -----------------------------------------------
void rule_copy(RuleCall& c) {  // copy(self, src, non_blocking): self is overwritten, src gets the gradient
  if (c.needs(1)) c.set(1, c.grad());
}
void rule_abs(RuleCall& c) {  // grad * sgn(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::sgn", {tensor(c.input(0))})));
}
void rule_sqrt(RuleCall& c) {  // grad / (2 * result)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), c.b.mul(c.result(0), 2.0)));
}
void rule_rsqrt(RuleCall& c) {  // -0.5 * grad * result^3
  if (c.needs(0))
    c.set(0, c.b.mul(c.grad(), c.b.mul(op(c, "aten::pow", {tensor(c.result(0)), 3.0}, "Tensor_Scalar"), -0.5)));
}
void rule_log(RuleCall& c) {  // grad / self
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), c.input(0)));
}
void rule_log1p(RuleCall& c) {  // grad / (self + 1)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), op(c, "aten::add", {tensor(c.input(0)), 1.0, int64_t{1}}, "Scalar")));
}
void rule_expm1(RuleCall& c) {  // grad * (result + 1)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::add", {tensor(c.result(0)), 1.0, int64_t{1}}, "Scalar")));
}
void rule_reciprocal(RuleCall& c) {  // -grad * result^2
  if (c.needs(0)) c.set(0, c.b.mul(c.b.neg(c.grad()), c.b.mul(c.result(0), c.result(0))));
}
void rule_sin(RuleCall& c) {  // grad * cos(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::cos", {tensor(c.input(0))})));
}
void rule_cos(RuleCall& c) {  // grad * -sin(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.b.neg(op(c, "aten::sin", {tensor(c.input(0))}))));
}
void rule_erf(RuleCall& c) {  // 2/sqrt(pi) * exp(-self^2) * grad
  if (!c.needs(0)) return;
  ValueId x = c.input(0);
  ValueId e = op(c, "aten::exp", {tensor(c.b.neg(c.b.mul(x, x)))});
  c.set(0, c.b.mul(c.b.mul(e, 1.1283791670955126), c.grad()));
}
void rule_zero_gradient(RuleCall& c) {  // floor, ceil, round, trunc, sign: piecewise constant
  if (c.needs(0)) c.set(0, zeros_like(c, c.grad()));
}
void rule_where(RuleCall& c) {  // where(condition, self, other)
  ValueId condition = c.input(0);
  if (c.needs(1)) c.set(1, keep_where(c, condition, c.grad()));
  if (c.needs(2)) c.set(2, op(c, "aten::masked_fill", {tensor(c.grad()), tensor(condition), 0.0}, "Scalar"));
}
void rule_masked_fill_scalar(RuleCall& c) {  // masked_fill(self, mask, value): the filled places get nothing
  if (c.needs(0)) c.set(0, op(c, "aten::masked_fill", {tensor(c.grad()), tensor(c.input(1)), 0.0}, "Scalar"));
}
void rule_clamp_min(RuleCall& c) {  // where(self >= min, grad, 0)
  if (!c.needs(0)) return;
  if (c.is_tensor(1)) KILN_UNSUPPORTED() << "clamp_min with a tensor bound";
  c.set(0, keep_where(c, op(c, "aten::ge", {tensor(c.input(0)), c.arg(1)}, "Scalar"), c.grad()));
}
void rule_clamp_max(RuleCall& c) {  // where(self <= max, grad, 0)
  if (!c.needs(0)) return;
  if (c.is_tensor(1)) KILN_UNSUPPORTED() << "clamp_max with a tensor bound";
  c.set(0, keep_where(c, op(c, "aten::le", {tensor(c.input(0)), c.arg(1)}, "Scalar"), c.grad()));
}
void rule_clamp(RuleCall& c) {  // where(self >= min & self <= max, grad, 0); an absent bound always holds
  if (!c.needs(0)) return;
  std::optional<ValueId> keep;
  if (!c.is_none(1)) keep = op(c, "aten::ge", {tensor(c.input(0)), c.arg(1)}, "Scalar");
  if (!c.is_none(2)) {
    ValueId below = op(c, "aten::le", {tensor(c.input(0)), c.arg(2)}, "Scalar");
    keep = keep ? op(c, "aten::logical_and", {tensor(*keep), tensor(below)}) : below;
  }
  c.set(0, keep ? keep_where(c, *keep, c.grad()) : c.grad());
}
void rule_hardtanh(RuleCall& c) {  // hardtanh(self, min_val, max_val)
  if (c.needs(0))
    c.set(0, op(c, "aten::hardtanh_backward", {tensor(c.grad()), tensor(c.input(0)), c.arg(1), c.arg(2)}));
}
void rule_leaky_relu(RuleCall& c) {  // leaky_relu(self, negative_slope)
  if (c.needs(0))
    c.set(0, op(c, "aten::leaky_relu_backward", {tensor(c.grad()), tensor(c.input(0)), c.arg(1), false}));
}
void rule_elu(RuleCall& c) {  // elu(self, alpha, scale, input_scale)
  if (c.needs(0))
    c.set(0, op(c, "aten::elu_backward", {tensor(c.grad()), c.arg(1), c.arg(2), c.arg(3), false, tensor(c.input(0))}));
}
// maximum / minimum: the larger (smaller) operand gets the gradient, ties split it in half.
void max_min_back(RuleCall& c, bool maximum) {
  ValueId a = c.input(0), b = c.input(1);
  ValueId tie = op(c, "aten::eq", {tensor(a), tensor(b)}, "Tensor");
  ValueId shared = op(c, "aten::where", {tensor(tie), tensor(c.b.mul(c.grad(), 0.5)), tensor(c.grad())}, "self");
  const char* a_loses = maximum ? "aten::lt" : "aten::gt";
  const char* b_loses = maximum ? "aten::gt" : "aten::lt";
  if (c.needs(0)) c.set(0, op(c, "aten::masked_fill", {tensor(shared), tensor(op(c, a_loses, {tensor(a), tensor(b)}, "Tensor")), 0.0}, "Scalar"));
  if (c.needs(1)) c.set(1, op(c, "aten::masked_fill", {tensor(shared), tensor(op(c, b_loses, {tensor(a), tensor(b)}, "Tensor")), 0.0}, "Scalar"));
}
void rule_maximum(RuleCall& c) { max_min_back(c, true); }
void rule_minimum(RuleCall& c) { max_min_back(c, false); }
void rule_flip(RuleCall& c) {  // flip(self, dims)
  if (c.needs(0)) c.set(0, op(c, "aten::flip", {tensor(c.grad()), c.arg(1)}));
}
void rule_roll(RuleCall& c) {  // roll(self, shifts, dims): rolled back
  if (!c.needs(0)) return;
  std::vector<int64_t> back = c.ints_arg(1);
  for (int64_t& s : back) s = -s;
  c.set(0, op(c, "aten::roll", {tensor(c.grad()), back, c.arg(2)}));
}
void rule_constant_pad_nd(RuleCall& c) {  // constant_pad_nd(self, pad, value): the padding cut off again
  if (!c.needs(0)) return;
  std::vector<int64_t> back = c.ints_arg(1);
  for (int64_t& p : back) p = -p;
  c.set(0, op(c, "aten::constant_pad_nd", {tensor(c.grad()), back, 0.0}));
}
void rule_stack(RuleCall& c) {  // stack(tensors, dim): item i gets select(grad, dim, i)
  const std::vector<ValueId> items = c.forward_items(0);
  const int64_t rank = static_cast<int64_t>(c.b.forward_meta(items.at(0)).sizes.size()) + 1;
  const int64_t dim = normalize_dim(c.int_arg(1), rank);
  for (size_t i = 0; i < items.size(); ++i) {
    const graph::TensorMeta& meta = c.b.forward_meta(items[i]);
    if (meta.requires_grad && graph::is_floating_or_complex(meta.dtype))
      c.set_item(0, i, op(c, "aten::select", {tensor(c.grad()), dim, static_cast<int64_t>(i)}, "int"));
  }
}
void rule_gather(RuleCall& c) {  // gather(self, dim, index, sparse_grad): scattered back, summed where repeated
  if (!c.needs(0)) return;
  ValueId zeros = op(c, "aten::new_zeros", {tensor(c.grad()), c.input_meta(0).sizes, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}});
  c.set(0, op(c, "aten::scatter_add", {tensor(zeros), c.arg(1), tensor(c.input(2)), tensor(c.grad())}));
}
void rule_index_select(RuleCall& c) {  // index_select(self, dim, index)
  if (c.needs(0))
    c.set(0, op(c, "aten::index_select_backward", {tensor(c.grad()), c.input_meta(0).sizes, c.arg(1), tensor(c.input(2))}));
}
void rule_cumsum(RuleCall& c) {  // cumsum(self, dim, dtype): the reversed cumulative sum of the gradient
  if (!c.needs(0)) return;
  if (!c.is_none(2)) KILN_UNSUPPORTED() << "cumsum with a dtype";
  const std::vector<int64_t> dims = {c.int_arg(1)};
  ValueId flipped = op(c, "aten::flip", {tensor(c.grad()), dims});
  ValueId summed = op(c, "aten::cumsum", {tensor(flipped), c.arg(1), graph::NoneArg{}});
  c.set(0, op(c, "aten::flip", {tensor(summed), dims}));
}
// nll_loss_forward(self, target, weight, reduction, ignore_index) -> (output, total_weight)
void rule_nll_loss(RuleCall& c) {
  if (!c.needs(0)) return;
  if (c.needs(2)) KILN_UNSUPPORTED() << "nll_loss with a weight that requires grad";
  c.set(0, op(c, "aten::nll_loss_backward", {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)),
                                                c.is_none(2) ? Arg{graph::NoneArg{}} : Arg{tensor(c.input(2))}, c.arg(3), c.arg(4),
                                                tensor(c.result(1))}));
}
// log_sigmoid_forward(self) -> (output, buffer): d/dx log(sigmoid(x)) = sigmoid(-x). The buffer is not read: on
// CUDA the forward returns it empty, so saving it for ATen's log_sigmoid_backward failed the saved layout check.
void rule_log_sigmoid(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::sigmoid", {tensor(c.b.neg(c.input(0)))})));
}
// native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)
// ATen's group norm backward kernels read the gradient as laid out like the input (on the CPU its suggested memory
// format, elsewhere contiguous), which eager's formula makes it: a gradient in another layout (a LayerNorm2d's
// permute after the group norm, MetaFormer's blocks) was read element for element in the wrong order. It is made
// so here too.
void rule_native_group_norm(RuleCall& c) {
  const std::vector<bool> mask = {c.needs(0), c.needs(1), c.needs(2)};
  const graph::TensorMeta& input = c.input_meta(0);
  ValueId grad = c.grad();
  const size_t rank = input.sizes.size();
  const bool channels_last = input.device.type == graph::DeviceType::CPU && (rank == 4 || rank == 5) &&
                             input.sizes[1] > 1 && laid_out_as(input, channels_innermost_strides(input.sizes)) &&
                             !laid_out_as(input, graph::contiguous_strides(input.sizes));
  const std::vector<int64_t> wanted =
      channels_last ? channels_innermost_strides(input.sizes) : graph::contiguous_strides(input.sizes);
  if (!laid_out_as(c.b.meta(grad), wanted))
    grad = c.b.emit("aten::clone", "default",
                    {tensor(grad), graph::MemoryFormatArg{static_cast<int8_t>(channels_last ? (rank == 4 ? 2 : 3) : 0)}});
  auto grads = c.b.emit_all("aten::native_group_norm_backward", "default",
                            {tensor(grad), tensor(c.input(0)), tensor(c.result(1)), tensor(c.result(2)),
                             c.is_none(1) ? Arg{graph::NoneArg{}} : Arg{tensor(c.input(1))}, c.arg(3), c.arg(4), c.arg(5),
                             c.arg(6), mask});
  set_masked(c, grads, {0, 1, 2}, mask);
}

// ---- losses, norms, statistics, interpolation ----------------------------------------------------------
// (self, target, reduction, ...) losses with an ATen backward for self; the target's gradient is its negation.
void loss_back(RuleCall& c, const char* backward, std::vector<Arg> extra) {
  if (!c.needs(0) && !c.needs(1)) return;
  std::vector<Arg> args = {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), c.arg(2)};
  args.insert(args.end(), extra.begin(), extra.end());
  ValueId g = c.b.emit(backward, "default", std::move(args));
  if (c.needs(0)) c.set(0, g);
  if (c.needs(1)) c.set(1, c.b.neg(g));
}
void rule_mse_loss(RuleCall& c) { loss_back(c, "aten::mse_loss_backward", {}); }
void rule_smooth_l1_loss(RuleCall& c) { loss_back(c, "aten::smooth_l1_loss_backward", {c.arg(3)}); }
void rule_huber_loss(RuleCall& c) { loss_back(c, "aten::huber_loss_backward", {c.arg(3)}); }

// binary_cross_entropy_with_logits(self, target, weight?, pos_weight?, reduction):
// d/dself = (sigmoid(self) - target) * grad [* weight] [/ numel for the mean].
void rule_bce_with_logits(RuleCall& c) {
  if (c.needs(1) || c.needs(2) || !c.is_none(3)) KILN_UNSUPPORTED() << "binary_cross_entropy_with_logits with pos_weight or a target or weight gradient";
  if (!c.needs(0)) return;
  ValueId g = c.b.mul(c.grad(), c.b.emit("aten::sub", "Tensor", {tensor(op(c, "aten::sigmoid", {tensor(c.input(0))})), tensor(c.input(1)), int64_t{1}}));
  if (c.is_tensor(2)) g = c.b.mul(g, c.input(2));
  if (c.int_arg(4) == 1) {
    int64_t numel = 1;
    for (int64_t size : c.input_meta(0).sizes) numel *= size;
    g = c.b.mul(g, 1.0 / static_cast<double>(numel));
  }
  c.set(0, g);
}

// var.correction / std.correction(self, dim?, *, correction?, keepdim):
// var: grad * 2 (x - mean) / (N - correction); std: the same with grad / (2 std), 0 where std is 0.
void variance_back(RuleCall& c, bool std_dev) {
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  const bool keepdim = c.bool_arg(3);
  const double correction = c.is_none(2) ? 1.0 : c.number_arg(2);
  ValueId g = kept(c, c.grad(), r, keepdim);
  if (std_dev) {
    ValueId sd = kept(c, c.result(0), r, keepdim);
    g = c.b.div(g, c.b.mul(sd, 2.0));
    g = op(c, "aten::masked_fill", {tensor(g), tensor(op(c, "aten::eq", {tensor(sd), 0.0}, "Scalar")), 0.0}, "Scalar");
  }
  ValueId mean = c.b.emit("aten::mean", "dim", {tensor(c.input(0)), r.dims, true, graph::NoneArg{}});
  ValueId centred = c.b.emit("aten::sub", "Tensor", {tensor(c.input(0)), tensor(mean), int64_t{1}});
  c.set(0, c.b.mul(c.b.mul(centred, 2.0 / (static_cast<double>(r.count) - correction)), g));
}
void rule_var(RuleCall& c) { variance_back(c, false); }
void rule_std(RuleCall& c) { variance_back(c, true); }

// amax / amin(self, dim, keepdim): the gradient shared evenly among the elements equal to the result.
void rule_amax_amin(RuleCall& c) {
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  const bool keepdim = c.bool_arg(2);
  ValueId hits = op(c, "aten::eq", {tensor(c.input(0)), tensor(kept(c, c.result(0), r, keepdim))}, "Tensor");
  ValueId mask = op(c, "aten::_to_copy", {tensor(hits), graph::ScalarTypeArg{c.input_meta(0).dtype}, graph::NoneArg{},
                                             graph::NoneArg{}, graph::NoneArg{}, false, graph::NoneArg{}});
  ValueId count = c.b.emit("aten::sum", "dim_IntList", {tensor(mask), r.dims, true, graph::NoneArg{}});
  c.set(0, c.b.mul(mask, c.b.div(kept(c, c.grad(), r, keepdim), count)));
}

// Activations with an ATen backward(grad, self, <the forward's other arguments>...).
void activation_back(RuleCall& c, const char* backward, std::initializer_list<size_t> extra_args) {
  if (!c.needs(0)) return;
  std::vector<Arg> args = {tensor(c.grad()), tensor(c.input(0))};
  for (size_t a : extra_args) args.push_back(c.arg(a));
  c.set(0, c.b.emit(backward, "default", std::move(args)));
}
void rule_softplus(RuleCall& c) { activation_back(c, "aten::softplus_backward", {1, 2}); }
void rule_hardswish(RuleCall& c) { activation_back(c, "aten::hardswish_backward", {}); }
void rule_hardsigmoid(RuleCall& c) { activation_back(c, "aten::hardsigmoid_backward", {}); }
void rule_mish(RuleCall& c) { activation_back(c, "aten::mish_backward", {}); }
void rule_glu(RuleCall& c) { activation_back(c, "aten::glu_backward", {1}); }
// upsample_*(self, output_size, <rest>) -> upsample_*_backward(grad, output_size, input_size, <rest>).
void upsample_back(RuleCall& c, const char* backward, size_t rest_from, size_t rest_to) {
  if (!c.needs(0)) return;
  std::vector<Arg> args = {tensor(c.grad()), c.arg(1), c.input_meta(0).sizes};
  for (size_t a = rest_from; a < rest_to; ++a) args.push_back(c.arg(a));
  c.set(0, c.b.emit(backward, "default", std::move(args)));
}
void rule_upsample_nearest1d(RuleCall& c) { upsample_back(c, "aten::upsample_nearest1d_backward", 2, 3); }
void rule_upsample_nearest2d(RuleCall& c) { upsample_back(c, "aten::upsample_nearest2d_backward", 2, 4); }
void rule_upsample_bilinear2d(RuleCall& c) { upsample_back(c, "aten::upsample_bilinear2d_backward", 2, 5); }
void rule_upsample_nearest3d(RuleCall& c) { upsample_back(c, "aten::upsample_nearest3d_backward", 2, 5); }
void rule_upsample_linear1d(RuleCall& c) { upsample_back(c, "aten::upsample_linear1d_backward", 2, 4); }
void rule_upsample_bicubic2d(RuleCall& c) { upsample_back(c, "aten::upsample_bicubic2d_backward", 2, 5); }
void rule_upsample_trilinear3d(RuleCall& c) { upsample_back(c, "aten::upsample_trilinear3d_backward", 2, 6); }
void rule_tril(RuleCall& c) {
  if (c.needs(0)) c.set(0, op(c, "aten::tril", {tensor(c.grad()), c.arg(1)}));
}
void rule_triu(RuleCall& c) {
  if (c.needs(0)) c.set(0, op(c, "aten::triu", {tensor(c.grad()), c.arg(1)}));
}
// logsumexp(self, dim, keepdim): grad * exp(self - result)
void rule_logsumexp(RuleCall& c) {
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  const bool keepdim = c.bool_arg(2);
  ValueId shifted = c.b.emit("aten::sub", "Tensor", {tensor(c.input(0)), tensor(kept(c, c.result(0), r, keepdim)), int64_t{1}});
  c.set(0, c.b.mul(kept(c, c.grad(), r, keepdim), op(c, "aten::exp", {tensor(shifted)})));
}
void rule_dot(RuleCall& c) {  // dot(self, tensor)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.input(1)));
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.input(0)));
}
void rule_mv(RuleCall& c) {  // mv(self [m, n], vec [n])
  if (c.needs(0)) c.set(0, c.b.mul(c.b.reshape(c.grad(), {c.input_meta(0).sizes.at(0), 1}), c.input(1)));
  if (c.needs(1)) c.set(1, op(c, "aten::mv", {tensor(t(c, c.input(0))), tensor(c.grad())}));
}
void rule_baddbmm(RuleCall& c) {  // baddbmm(self, batch1, batch2, *, beta, alpha)
  const double beta = c.number_arg(3), alpha = c.number_arg(4);
  if (c.needs(0)) c.set(0, beta == 1.0 ? c.grad() : c.b.mul(c.grad(), beta));
  if (c.needs(1)) {
    ValueId g = op(c, "aten::bmm", {tensor(c.grad()), tensor(op(c, "aten::transpose", {tensor(c.input(2)), int64_t{1}, int64_t{2}}, "int"))});
    c.set(1, alpha == 1.0 ? g : c.b.mul(g, alpha));
  }
  if (c.needs(2)) {
    ValueId g = op(c, "aten::bmm", {tensor(op(c, "aten::transpose", {tensor(c.input(1)), int64_t{1}, int64_t{2}}, "int")), tensor(c.grad())});
    c.set(2, alpha == 1.0 ? g : c.b.mul(g, alpha));
  }
}

}  // namespace

void add_more_rules(std::map<std::string, DerivativeRule>& t) {
  const std::map<std::string, DerivativeRule> more = {
      {"aten::copy.default", {rule_copy}},
      {"aten::abs.default", {rule_abs}},
      {"aten::sqrt.default", {rule_sqrt}},
      {"aten::rsqrt.default", {rule_rsqrt}},
      {"aten::log.default", {rule_log}},
      {"aten::log1p.default", {rule_log1p}},
      {"aten::expm1.default", {rule_expm1}},
      {"aten::reciprocal.default", {rule_reciprocal}},
      {"aten::sin.default", {rule_sin}},
      {"aten::cos.default", {rule_cos}},
      {"aten::erf.default", {rule_erf}},
      {"aten::floor.default", {rule_zero_gradient}},
      {"aten::ceil.default", {rule_zero_gradient}},
      {"aten::round.default", {rule_zero_gradient}},
      {"aten::trunc.default", {rule_zero_gradient}},
      {"aten::sign.default", {rule_zero_gradient}},
      // zero(self): zero_ made functional (torchvision's Swin V2 zeroes the key third of a cloned qkv bias)
      {"aten::zero.default", {rule_zero_gradient}},
      {"aten::where.self", {rule_where}},
      {"aten::masked_fill.Scalar", {rule_masked_fill_scalar}},
      {"aten::clamp_min.default", {rule_clamp_min}},
      {"aten::clamp_max.default", {rule_clamp_max}},
      {"aten::clamp.default", {rule_clamp}},
      {"aten::hardtanh.default", {rule_hardtanh}},
      {"aten::leaky_relu.default", {rule_leaky_relu}},
      {"aten::elu.default", {rule_elu}},
      {"aten::maximum.default", {rule_maximum}},
      {"aten::minimum.default", {rule_minimum}},
      {"aten::flip.default", {rule_flip}},
      {"aten::roll.default", {rule_roll}},
      {"aten::constant_pad_nd.default", {rule_constant_pad_nd}},
      {"aten::stack.default", {rule_stack}},
      {"aten::gather.default", {rule_gather}},
      {"aten::index_select.default", {rule_index_select}},
      {"aten::cumsum.default", {rule_cumsum}},
      {"aten::nll_loss_forward.default", {rule_nll_loss}},
      {"aten::log_sigmoid_forward.default", {rule_log_sigmoid}},
      {"aten::native_group_norm.default", {rule_native_group_norm}},
      {"aten::mse_loss.default", {rule_mse_loss}},
      {"aten::smooth_l1_loss.default", {rule_smooth_l1_loss}},
      {"aten::huber_loss.default", {rule_huber_loss}},
      {"aten::binary_cross_entropy_with_logits.default", {rule_bce_with_logits}},
      {"aten::var.correction", {rule_var}},
      {"aten::std.correction", {rule_std}},
      {"aten::amax.default", {rule_amax_amin}},
      {"aten::amin.default", {rule_amax_amin}},
      {"aten::upsample_bilinear2d.default", {rule_upsample_bilinear2d}},
      {"aten::upsample_nearest2d.default", {rule_upsample_nearest2d}},
      {"aten::softplus.default", {rule_softplus}},
      {"aten::hardswish.default", {rule_hardswish}},
      {"aten::hardsigmoid.default", {rule_hardsigmoid}},
      {"aten::mish.default", {rule_mish}},
      {"aten::glu.default", {rule_glu}},
      {"aten::upsample_nearest1d.default", {rule_upsample_nearest1d}},
      {"aten::upsample_nearest3d.default", {rule_upsample_nearest3d}},
      {"aten::upsample_linear1d.default", {rule_upsample_linear1d}},
      {"aten::upsample_bicubic2d.default", {rule_upsample_bicubic2d}},
      {"aten::upsample_trilinear3d.default", {rule_upsample_trilinear3d}},
      {"aten::tril.default", {rule_tril}},
      {"aten::triu.default", {rule_triu}},
      {"aten::logsumexp.default", {rule_logsumexp}},
      {"aten::dot.default", {rule_dot}},
      {"aten::mv.default", {rule_mv}},
      {"aten::baddbmm.default", {rule_baddbmm}},
  };
  t.insert(more.begin(), more.end());
}

}  // namespace kiln::autodiff::detail
