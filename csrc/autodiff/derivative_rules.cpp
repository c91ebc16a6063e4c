// Derivative rules for the ATen ops the tracer records with grad on (seed models: MLP, Conv+ReLU,
// TransformerBlock, ResNet). Each rule mirrors the formula eager autograd uses for that op
// (tools/autograd/derivatives.yaml in PyTorch), so gradients agree to rounding: same backward ops
// (threshold_backward, _softmax_backward_data, native_layer_norm_backward ...), same operand order.
#include "autodiff/derivative_rules.h"

#include "autodiff/derivative_rule_helpers.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>

#include "common/error.h"
#include "decomp/decompositions.h"

namespace kiln::autodiff {

// ---- RuleCall --------------------------------------------------------------------------------------
bool RuleCall::is_tensor(size_t index) const { return std::holds_alternative<graph::TensorArg>(node_.args.at(index)); }
bool RuleCall::is_none(size_t index) const { return std::holds_alternative<graph::NoneArg>(node_.args.at(index)); }

bool RuleCall::needs(size_t index) const {
  if (!is_tensor(index)) return false;
  const graph::Value& v = forward_.value(std::get<graph::TensorArg>(node_.args[index]).id);
  return v.meta.requires_grad && graph::is_floating_or_complex(v.meta.dtype);
}

ValueId RuleCall::input(size_t index) {
  KILN_ASSERT(is_tensor(index)) << node_.qualified_name() << " argument " << index << " is not a tensor";
  return b.forward_value(std::get<graph::TensorArg>(node_.args[index]).id);
}

ValueId RuleCall::result(size_t index) { return b.forward_value(node_.outputs.at(index)); }

const graph::TensorMeta& RuleCall::input_meta(size_t index) const {
  KILN_ASSERT(is_tensor(index)) << node_.qualified_name() << " argument " << index << " is not a tensor";
  return forward_.value(std::get<graph::TensorArg>(node_.args[index]).id).meta;
}

int64_t RuleCall::int_arg(size_t index) const {
  const auto* v = std::get_if<int64_t>(&node_.args.at(index));
  KILN_ASSERT(v) << node_.qualified_name() << " argument " << index << " is not an int";
  return *v;
}

double RuleCall::number_arg(size_t index) const {
  const graph::ArgValue& a = node_.args.at(index);
  if (const auto* d = std::get_if<double>(&a)) return *d;
  if (const auto* i = std::get_if<int64_t>(&a)) return static_cast<double>(*i);
  if (const auto* flag = std::get_if<bool>(&a)) return *flag ? 1.0 : 0.0;
  KILN_UNSUPPORTED() << node_.qualified_name() << " argument " << index << " is not a real number";
}

bool RuleCall::bool_arg(size_t index) const {
  const auto* v = std::get_if<bool>(&node_.args.at(index));
  KILN_ASSERT(v) << node_.qualified_name() << " argument " << index << " is not a bool";
  return *v;
}

std::vector<int64_t> RuleCall::ints_arg(size_t index) const {
  const graph::ArgValue& a = node_.args.at(index);
  if (const auto* v = std::get_if<std::vector<int64_t>>(&a)) return *v;
  if (const auto* i = std::get_if<int64_t>(&a)) return {*i};
  if (std::holds_alternative<graph::NoneArg>(a)) return {};
  KILN_ASSERT(false) << node_.qualified_name() << " argument " << index << " is not an int list";
  return {};
}

std::vector<ValueId> RuleCall::forward_items(size_t index) const {
  const auto* list = std::get_if<graph::TensorListArg>(&node_.args.at(index));
  KILN_ASSERT(list) << node_.qualified_name() << " argument " << index << " is not a tensor list";
  std::vector<ValueId> items;
  for (const auto& id : list->ids) {
    KILN_ASSERT(id.has_value()) << node_.qualified_name() << ": a None inside a tensor list";
    items.push_back(*id);
  }
  return items;
}

void RuleCall::set(size_t index, ValueId grad) {
  auto it = grads_.find(index);
  grads_[index] = it == grads_.end() ? grad : b.add(it->second, grad);
}

// ---- helpers shared with derivative_rules_more.cpp (derivative_rule_helpers.h) ------------------------
namespace detail {

int64_t normalize_dim(int64_t dim, size_t rank) { return dim < 0 ? dim + static_cast<int64_t>(rank) : dim; }
ValueId t(RuleCall& c, ValueId v) { return c.b.emit("aten::t", "default", {tensor(v)}); }
graph::ArgValue optional_tensor(RuleCall& c, size_t index) {
  return c.is_tensor(index) ? tensor(c.input(index)) : graph::ArgValue{graph::NoneArg{}};
}
void set_masked(RuleCall& c, const std::vector<ValueId>& grads, const std::vector<size_t>& args, const std::vector<bool>& mask) {
  for (size_t i = 0; i < args.size(); ++i)
    if (mask[i]) c.set(args[i], grads.at(i));
}
std::vector<int64_t> channels_innermost_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  strides[1] = stride;
  stride *= sizes[1];
  for (size_t d = sizes.size(); d-- > 2;) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  strides[0] = stride;
  return strides;
}
bool laid_out_as(const graph::TensorMeta& m, const std::vector<int64_t>& strides) {
  if (m.storage_offset != 0 || m.strides.size() != strides.size()) return false;
  for (size_t d = 0; d < strides.size(); ++d)
    if (m.sizes[d] > 1 && m.strides[d] != strides[d]) return false;
  return true;
}

}  // namespace detail

namespace {

using namespace detail;

// ---- linear algebra ----------------------------------------------------------------------------------
ValueId mm(RuleCall& c, ValueId a, ValueId b) { return c.b.emit("aten::mm", "default", {tensor(a), tensor(b)}); }

bool is_column_major(const graph::TensorMeta& m) {
  return m.sizes.size() == 2 && m.strides[0] == 1 && m.strides[1] == m.sizes[0];
}

// The gradient of a matrix operand comes out in the operand's own layout, as eager's mm_mat1_backward /
// mm_mat2_backward do: a Linear weight enters as w.t() (column-major), so its gradient is computed as
// (grad^T @ mat1)^T and the final t() of the weight's rule makes it contiguous again. Otherwise the
// parameter's gradient would be a transposed view that AccumulateGrad must copy into the weight's layout.
ValueId mm_mat1_grad(RuleCall& c, size_t mat1, size_t mat2) {
  if (is_column_major(c.input_meta(mat1))) return t(c, mm(c, c.input(mat2), t(c, c.grad())));
  return mm(c, c.grad(), t(c, c.input(mat2)));
}
ValueId mm_mat2_grad(RuleCall& c, size_t mat1, size_t mat2) {
  if (is_column_major(c.input_meta(mat2))) return t(c, mm(c, t(c, c.grad()), c.input(mat1)));
  return mm(c, t(c, c.input(mat1)), c.grad());
}

void rule_mm(RuleCall& c) {
  if (c.needs(0)) c.set(0, mm_mat1_grad(c, 0, 1));
  if (c.needs(1)) c.set(1, mm_mat2_grad(c, 0, 1));
}

void rule_addmm(RuleCall& c) {  // addmm(self, mat1, mat2, *, beta, alpha)
  const double beta = c.number_arg(3), alpha = c.number_arg(4);
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), beta));
  if (c.needs(1)) c.set(1, c.b.mul(mm_mat1_grad(c, 1, 2), alpha));
  if (c.needs(2)) c.set(2, c.b.mul(mm_mat2_grad(c, 1, 2), alpha));
}

// A batch of matrices laid out transposed (its rows are the innermost dim): attention's k.transpose(-2, -1).
bool is_transposed_batch(const graph::TensorMeta& m) {
  return m.sizes.size() == 3 && m.sizes[1] > 1 && m.sizes[2] > 1 && m.strides[1] == 1 && m.strides[2] != 1;
}

// As for mm, each operand's gradient comes out in the operand's own layout: for a transposed operand, the
// transposed product is computed and viewed back, so the gradient that flows on (k's) is dense where it was
// strided across its innermost dim.
void rule_bmm(RuleCall& c) {
  auto bmm = [&](ValueId a, ValueId b) { return c.b.emit("aten::bmm", "default", {tensor(a), tensor(b)}); };
  auto tr = [&](ValueId a) { return c.b.transpose(a, 1, 2); };
  if (c.needs(0))
    c.set(0, is_transposed_batch(c.input_meta(0)) ? tr(bmm(c.input(1), tr(c.grad()))) : bmm(c.grad(), tr(c.input(1))));
  if (c.needs(1))
    c.set(1, is_transposed_batch(c.input_meta(1)) ? tr(bmm(tr(c.grad()), c.input(0))) : bmm(tr(c.input(0)), c.grad()));
}

// ---- pointwise -------------------------------------------------------------------------------------
void rule_add_tensor(RuleCall& c) {  // add.Tensor(self, other, *, alpha); other may be a number
  if (c.needs(0)) c.set(0, c.grad());
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.number_arg(2)));
}

void rule_sub_tensor(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.grad());
  if (c.needs(1)) {
    const double alpha = c.number_arg(2);
    c.set(1, alpha == 1.0 ? c.b.neg(c.grad()) : c.b.mul(c.grad(), -alpha));
  }
}

void rule_identity(RuleCall& c) {  // add.Scalar, sub.Scalar, clone, alias, _to_copy, expand (grad_for reduces)
  if (c.needs(0)) c.set(0, c.grad());
}

void rule_mul_tensor(RuleCall& c) {
  if (!c.is_tensor(1)) {
    if (c.needs(0)) c.set(0, c.b.emit("aten::mul", "Tensor", {tensor(c.grad()), c.arg(1)}));
    return;
  }
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.input(1)));
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.input(0)));
}

void rule_mul_scalar(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::mul", "Scalar", {tensor(c.grad()), c.arg(1)}));
}

void rule_div_tensor(RuleCall& c) {
  if (!c.is_tensor(1)) {
    if (c.needs(0)) c.set(0, c.b.emit("aten::div", "Tensor", {tensor(c.grad()), c.arg(1)}));
    return;
  }
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), c.input(1)));
  if (c.needs(1)) {
    // d(a/b)/db = -grad * a / (b * b), as eager's div_tensor_other_backward
    ValueId other = c.input(1);
    c.set(1, c.b.mul(c.b.neg(c.grad()), c.b.div(c.b.div(c.input(0), other), other)));
  }
}

void rule_div_scalar(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::div", "Scalar", {tensor(c.grad()), c.arg(1)}));
}

void rule_neg(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.neg(c.grad()));
}
void rule_exp(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.result(0)));
}
void rule_tanh(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::tanh_backward", "default", {tensor(c.grad()), tensor(c.result(0))}));
}
void rule_sigmoid(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::sigmoid_backward", "default", {tensor(c.grad()), tensor(c.result(0))}));
}
void rule_relu(RuleCall& c) {
  if (c.needs(0))
    c.set(0, c.b.emit("aten::threshold_backward", "default", {tensor(c.grad()), tensor(c.result(0)), int64_t{0}}));
}
void rule_gelu(RuleCall& c) {  // gelu(self, *, approximate)
  if (c.needs(0)) c.set(0, c.b.emit("aten::gelu_backward", "default", {tensor(c.grad()), tensor(c.input(0)), c.arg(1)}));
}
void rule_silu(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::silu_backward", "default", {tensor(c.grad()), tensor(c.input(0))}));
}
void rule_pow_tensor_scalar(RuleCall& c) {  // grad * e * self^(e-1)
  if (!c.needs(0)) return;
  const double e = c.number_arg(1);
  if (e == 0.0) KILN_UNSUPPORTED() << "pow with exponent 0";
  ValueId power = e == 2.0 ? c.input(0) : c.b.emit("aten::pow", "Tensor_Scalar", {tensor(c.input(0)), e - 1.0});
  c.set(0, c.b.mul(c.b.mul(c.grad(), e), power));
}

// ---- shapes and views --------------------------------------------------------------------------------
void rule_reshape_back(RuleCall& c) {  // view, _unsafe_view, reshape, squeeze*, unsqueeze
  if (c.needs(0)) c.set(0, c.b.reshape(c.grad(), c.input_meta(0).sizes));
}
// as_strided(self, size, stride, storage_offset) that keeps every element where it was: the same sizes and offset,
// strides changed only on dims of size 1 (ATen's adaptive_avg_pool2d to 1x1 restrides its mean to channels-last
// this way). Any other as_strided can overlap or skip elements: no rule.
void rule_as_strided(RuleCall& c) {
  if (!c.needs(0)) return;
  const graph::TensorMeta& in = c.input_meta(0);
  const std::vector<int64_t> sizes = c.ints_arg(1);
  const std::vector<int64_t> strides = c.ints_arg(2);
  bool same = sizes == in.sizes && strides.size() == in.strides.size() &&
              (c.is_none(3) || c.int_arg(3) == in.storage_offset);
  for (size_t d = 0; same && d < sizes.size(); ++d) same = sizes[d] == 1 || strides[d] == in.strides[d];
  if (!same) KILN_UNSUPPORTED() << "as_strided that moves elements (only a restride of size-1 dims has a rule)";
  c.set(0, c.grad());
}
void rule_t(RuleCall& c) {
  if (c.needs(0)) c.set(0, t(c, c.grad()));
}
void rule_transpose(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.transpose(c.grad(), c.int_arg(1), c.int_arg(2)));
}
void rule_permute(RuleCall& c) {
  if (!c.needs(0)) return;
  const std::vector<int64_t> dims = c.ints_arg(1);
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[normalize_dim(dims[i], dims.size())] = static_cast<int64_t>(i);
  c.set(0, c.b.emit("aten::permute", "default", {tensor(c.grad()), inverse}));
}
void rule_select(RuleCall& c) {  // select.int(self, dim, index)
  if (c.needs(0))
    c.set(0, c.b.emit("aten::select_backward", "default",
                      {tensor(c.grad()), c.input_meta(0).sizes, c.int_arg(1), c.int_arg(2)}));
}
void rule_slice(RuleCall& c) {  // slice.Tensor(self, dim, start?, end?, step)
  if (!c.needs(0)) return;
  const int64_t start = c.is_none(2) ? 0 : c.int_arg(2);
  const int64_t end = c.is_none(3) ? std::numeric_limits<int64_t>::max() : c.int_arg(3);
  c.set(0, c.b.emit("aten::slice_backward", "default",
                    {tensor(c.grad()), c.input_meta(0).sizes, c.int_arg(1), start, end, c.int_arg(4)}));
}

// ---- reductions ------------------------------------------------------------------------------------
// grad of a reduction over `dims` (empty: all) back to the input's shape, scaled by `scale`.
void reduction_back(RuleCall& c, const std::vector<int64_t>& dims, bool keepdim, bool mean) {
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  std::vector<int64_t> kept = sizes;
  int64_t count = 1;
  std::set<int64_t> reduced;
  for (int64_t d : dims) reduced.insert(normalize_dim(d, sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (dims.empty() || reduced.count(static_cast<int64_t>(i))) {
      kept[i] = 1;
      count *= sizes[i];
    }
  }
  ValueId g = c.grad();
  if (!keepdim) g = c.b.reshape(g, kept);
  g = c.b.expand(g, sizes);
  if (mean) g = c.b.emit("aten::div", "Tensor", {tensor(g), count});
  c.set(0, g);
}
void rule_sum(RuleCall& c) { reduction_back(c, {}, false, false); }
void rule_sum_dim(RuleCall& c) { reduction_back(c, c.ints_arg(1), c.bool_arg(2), false); }
void rule_mean(RuleCall& c) { reduction_back(c, {}, false, true); }
void rule_mean_dim(RuleCall& c) { reduction_back(c, c.ints_arg(1), c.bool_arg(2), true); }

// ---- neural network ops ------------------------------------------------------------------------------
void rule_softmax(RuleCall& c) {  // _softmax(self, dim, half_to_float)
  if (c.needs(0))
    c.set(0, c.b.emit("aten::_softmax_backward_data", "default",
                      {tensor(c.grad()), tensor(c.result(0)), c.int_arg(1), graph::ScalarTypeArg{c.input_meta(0).dtype}}));
}
void rule_log_softmax(RuleCall& c) {
  if (c.needs(0))
    c.set(0, c.b.emit("aten::_log_softmax_backward_data", "default",
                      {tensor(c.grad()), tensor(c.result(0)), c.int_arg(1), graph::ScalarTypeArg{c.input_meta(0).dtype}}));
}



// Layer norm's input gradient in float32/float64 as plain ops, so that it fuses: one row-reduction kernel with
// the gradient arithmetic around it (the residual branch's add). With x_hat = (x - mean) * rstd, gw = grad * weight:
//   dx = rstd / N * (N * gw - sum(gw) - x_hat * sum(gw * x_hat))
// (sums over the N normalized elements of a row). Half and bfloat16 keep ATen's kernel, which accumulates them
// in float.
// Whether `v` of the backward graph is a tensor before any generated kernel computes with it: an input (the
// incoming gradient) or an extern call's result, through views.
bool materialised(const graph::Graph& g, ValueId v) {
  for (;;) {
    const graph::NodeIndex p = g.value(v).producer;
    if (p < 0) return true;
    const graph::Node& n = g.nodes[p];
    if (!n.is_view) return decomp::find_decomposition(g, n) == nullptr;
    v = std::get<graph::TensorArg>(n.args.at(0)).id;
  }
}

void layer_norm_back_decomposed(RuleCall& c) {
  const graph::TensorMeta& in = c.input_meta(0);
  const auto rank = static_cast<int64_t>(in.sizes.size());
  const auto k = static_cast<int64_t>(c.ints_arg(1).size());
  std::vector<int64_t> row_dims;
  int64_t n = 1;
  for (int64_t d = rank - k; d < rank; ++d) {
    row_dims.push_back(d);
    n *= in.sizes[d];
  }
  auto sum = [&](ValueId v, const std::vector<int64_t>& dims, bool keepdim) {
    return c.b.emit("aten::sum", "dim_IntList", {tensor(v), dims, keepdim, graph::NoneArg{}});
  };
  auto sub = [&](ValueId a, ValueId b) { return c.b.emit("aten::sub", "Tensor", {tensor(a), tensor(b), int64_t{1}}); };
  ValueId g = c.grad();
  // Weight and bias on CUDA, where the incoming gradient is a tensor already (a matmul's result: pre-norm
  // transformers; a gradient summed from several readers, a post-norm residual's, would be computed in the sums'
  // kernel, and the input gradient's chain with it, stored for the input gradient's kernel): column sums over
  // the leading dims, emitted before the input gradient, with x_hat
  // written as (x + -1 * mean) * rstd so that common-subexpression elimination keeps it apart from the input
  // gradient's. Fusion then gives the two sums a kernel of their own that recomputes x_hat from x, mean and rstd
  // (the input gradient's kernel reduces rows, and would have to store g * x_hat for them). ViT-base's layer norms
  // spent 28 us each in ATen's kernel on an H200 (6304 x 768 rows).
  std::vector<int64_t> lead;
  for (int64_t d = 0; d < rank - k; ++d) lead.push_back(d);
  bool column_sums = in.device.type == graph::DeviceType::CUDA && !lead.empty() && materialised(c.b.graph(), g);
  for (size_t arg : {2, 3})
    column_sums = column_sums && (!c.is_tensor(arg) || c.input_meta(arg).dtype == in.dtype);
  if (column_sums && c.needs(2)) {
    ValueId centred = c.b.emit("aten::add", "Tensor", {tensor(c.input(0)), tensor(c.result(1)), int64_t{-1}});
    c.set(2, sum(c.b.mul(g, c.b.mul(centred, c.result(2))), lead, false));
  }
  if (column_sums && c.needs(3)) c.set(3, sum(g, lead, false));
  if (c.needs(0)) {
    ValueId x_hat = c.b.mul(sub(c.input(0), c.result(1)), c.result(2));
    ValueId gw = c.is_tensor(2) ? c.b.mul(g, c.input(2)) : g;
    ValueId centred = sub(sub(c.b.mul(gw, static_cast<double>(n)), sum(gw, row_dims, true)),
                          c.b.mul(x_hat, sum(c.b.mul(gw, x_hat), row_dims, true)));
    c.set(0, c.b.mul(c.b.mul(c.result(2), 1.0 / static_cast<double>(n)), centred));
  }
  // Weight and bias elsewhere (CPU): ATen's kernel with the input gradient masked off.
  if (!column_sums && (c.needs(2) || c.needs(3))) {
    const std::vector<bool> mask = {false, c.needs(2), c.needs(3)};
    auto grads = c.b.emit_all("aten::native_layer_norm_backward", "default",
                              {tensor(g), tensor(c.input(0)), c.arg(1), tensor(c.result(1)), tensor(c.result(2)),
                               optional_tensor(c, 2), optional_tensor(c, 3), mask});
    set_masked(c, grads, {0, 2, 3}, mask);
  }
}

void rule_native_layer_norm(RuleCall& c) {  // (input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
  const graph::ScalarType dtype = c.input_meta(0).dtype;
  if ((dtype == graph::ScalarType::Float || dtype == graph::ScalarType::Double) && c.ints_arg(1).size() > 0 &&
      c.b.forward_meta(c.node().outputs.at(1)).dtype == dtype) {
    layer_norm_back_decomposed(c);
    return;
  }
  // ATen's CPU kernel keeps mean and rstd of a half/bfloat16 input in that dtype unless weight or bias is of
  // another dtype (its mixed-type path keeps them in float), where the meta (the graph's) always says float: the
  // saved statistics then arrive as float copies (exact), and its backward wants them in the input's dtype
  // ("expected scalar type BFloat16 but found Float").
  ValueId mean = c.result(1), rstd = c.result(2);
  bool mixed = false;
  for (size_t arg : {2, 3})
    mixed = mixed || (c.is_tensor(arg) && c.input_meta(arg).dtype != dtype);
  const bool cpu_half = c.input_meta(0).device.type == graph::DeviceType::CPU &&
                        (dtype == graph::ScalarType::Half || dtype == graph::ScalarType::BFloat16) && !mixed &&
                        c.b.forward_meta(c.node().outputs.at(1)).dtype != dtype;
  if (cpu_half) {
    auto cast = [&](ValueId v) {
      return c.b.emit("aten::_to_copy", "default", {tensor(v), graph::ScalarTypeArg{dtype}, graph::NoneArg{}, graph::NoneArg{},
                                                    graph::NoneArg{}, false, graph::NoneArg{}});
    };
    mean = cast(mean);
    rstd = cast(rstd);
  }
  const std::vector<bool> mask = {c.needs(0), c.needs(2), c.needs(3)};
  auto grads = c.b.emit_all("aten::native_layer_norm_backward", "default",
                            {tensor(c.grad()), tensor(c.input(0)), c.arg(1), tensor(mean), tensor(rstd),
                             optional_tensor(c, 2), optional_tensor(c, 3), mask});
  set_masked(c, grads, {0, 2, 3}, mask);
}

void rule_convolution(RuleCall& c) {  // (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
  const std::vector<bool> mask = {c.needs(0), c.needs(1), c.needs(2)};
  graph::ArgValue bias_sizes = graph::NoneArg{};
  if (c.is_tensor(2)) bias_sizes = c.input_meta(2).sizes;
  auto grads = c.b.emit_all("aten::convolution_backward", "default",
                            {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), bias_sizes, c.arg(3), c.arg(4),
                             c.arg(5), c.arg(6), c.arg(7), c.arg(8), mask});
  set_masked(c, grads, {0, 1, 2}, mask);
}

// native_batch_norm_backward(grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?,
//                            train, eps, output_mask)
// Outside training the backward reads the running statistics. ATen's CUDA kernel still asserts that the saved
// ones are defined (the forward's empty results), while its CPU kernel takes defined ones as the batch's (their
// recorded size is 0): CUDA gets the results, CPU none.
graph::ArgValue saved_statistic(RuleCall& c, size_t result, bool train) {
  const bool cuda = c.input_meta(0).device.type == graph::DeviceType::CUDA;
  return train || cuda ? tensor(c.result(result)) : graph::ArgValue{graph::NoneArg{}};
}

// ATen's batch norm backward has channels-last kernels for an input and a gradient both laid out so (the input of a
// convolution chain passes/channels_last.h relaid); with a gradient in the default layout it takes a slow path of its
// own and returns a layout its meta kernel does not say. So such a gradient is laid out as the input first: a copy
// that fusion writes from the kernel making the gradient.
ValueId gradient_in_input_layout(RuleCall& c) {
  ValueId grad = c.grad();
  if (dense_channels_last(c.input_meta(0)) && !dense_channels_last(c.b.meta(grad)))
    grad = c.b.emit("aten::clone", "default", {tensor(grad), graph::MemoryFormatArg{2}});
  return grad;
}

void batch_norm_back(RuleCall& c, bool train, double eps) {
  const std::vector<bool> mask = {c.needs(0), c.needs(1), c.needs(2)};
  auto grads = c.b.emit_all("aten::native_batch_norm_backward", "default",
                            {tensor(gradient_in_input_layout(c)), tensor(c.input(0)), optional_tensor(c, 1),
                             optional_tensor(c, 3), optional_tensor(c, 4), saved_statistic(c, 1, train),
                             saved_statistic(c, 2, train), train, eps, mask});
  set_masked(c, grads, {0, 1, 2}, mask);
}
// native_batch_norm / _native_batch_norm_legit(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
void rule_batch_norm(RuleCall& c) { batch_norm_back(c, c.bool_arg(5), c.number_arg(7)); }
// _native_batch_norm_legit_no_training(input, weight?, bias?, running_mean, running_var, momentum, eps)
void rule_batch_norm_no_training(RuleCall& c) { batch_norm_back(c, false, c.number_arg(6)); }
// cudnn_batch_norm(input, weight, bias?, running_mean?, running_var?, training, factor, eps)
//   -> (out, save_mean, save_invstd, workspace): passes/use_cudnn_batch_norm.h makes these of training-mode
// native_batch_norm. Eager's formula: the backward takes the gradient dense in the input's layout, and reads the
// forward's workspace (cuDNN's reserve).
void rule_cudnn_batch_norm(RuleCall& c) {
  const graph::TensorMeta& input = c.input_meta(0);
  ValueId grad = c.grad();
  const bool channels_last = input.sizes.size() == 4 && input.sizes[1] > 1 && input.strides[1] == 1;
  const graph::TensorMeta& grad_meta = c.b.meta(grad);
  if (grad_meta.strides != input.strides || grad_meta.storage_offset != 0)
    grad = c.b.emit("aten::clone", "default", {tensor(grad), graph::MemoryFormatArg{static_cast<int8_t>(channels_last ? 2 : 0)}});
  auto grads = c.b.emit_all("aten::cudnn_batch_norm_backward", "default",
                            {tensor(c.input(0)), tensor(grad), tensor(c.input(1)), optional_tensor(c, 3),
                             optional_tensor(c, 4), tensor(c.result(1)), tensor(c.result(2)), c.number_arg(7),
                             tensor(c.result(3))});
  set_masked(c, grads, {0, 1, 2}, {c.needs(0), c.needs(1), c.needs(2)});
}

void rule_native_dropout(RuleCall& c) {  // native_dropout(input, p, train?) -> (out, mask)
  if (!c.needs(0)) return;
  const double p = c.number_arg(1);
  const bool train = !c.is_none(2) && c.bool_arg(2);
  const double scale = !train ? 1.0 : (p == 1.0 ? 0.0 : 1.0 / (1.0 - p));
  c.set(0, c.b.emit("aten::native_dropout_backward", "default", {tensor(c.grad()), tensor(c.result(1)), scale}));
}

void rule_embedding(RuleCall& c) {  // embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
  if (!c.needs(0)) return;
  if (c.bool_arg(4)) KILN_UNSUPPORTED() << "embedding with sparse=True";
  c.set(0, c.b.emit("aten::embedding_dense_backward", "default",
                    {tensor(c.grad()), tensor(c.input(1)), c.input_meta(0).sizes.at(0), c.arg(2), c.arg(3)}));
}

// ---- pooling ------------------------------------------------------------------------------------------
// max_pool2d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode) -> (out, indices): the
// gradient scatters through the indices the forward chose (saved, never recomputed: ties would resolve the
// same way, but the partitioner treats multi-result ops as not recomputable anyway).
void rule_max_pool2d_with_indices(RuleCall& c) {
  if (c.needs(0))
    c.set(0, c.b.emit("aten::max_pool2d_with_indices_backward", "default",
                      {tensor(c.grad()), tensor(c.input(0)), c.arg(1), c.arg(2), c.arg(3), c.arg(4), c.arg(5),
                       tensor(c.result(1))}));
}
// avg_pool2d(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
// avg_pool2d(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
// ATen's CUDA backward of a channels-last input with padding is wrong before torch 2.12 (its NHWC kernel drops the
// padding offset: pytorch#188344), and kiln lays CUDA convolution outputs out channels-last where eager does not
// (passes/channels_last.h): such a backward gets its input in the default layout, which picks ATen's NCHW kernel.
void rule_avg_pool2d(RuleCall& c) {
  if (!c.needs(0)) return;
  ValueId input = c.input(0);
  const graph::TensorMeta& meta = c.input_meta(0);
  bool padded = false;
  for (int64_t p : c.ints_arg(3)) padded = padded || p > 0;
  if (padded && meta.device.type == graph::DeviceType::CUDA && meta.sizes.size() == 4 && meta.sizes[1] > 1 &&
      meta.strides[1] == 1)
    input = contiguous(c, input);
  c.set(0, c.b.emit("aten::avg_pool2d_backward", "default",
                    {tensor(c.grad()), tensor(input), c.arg(1), c.arg(2), c.arg(3), c.arg(4), c.arg(5), c.arg(6)}));
}
// _adaptive_avg_pool2d(self, output_size)
void rule_adaptive_avg_pool2d(RuleCall& c) {
  if (c.needs(0))
    c.set(0, c.b.emit("aten::_adaptive_avg_pool2d_backward", "default", {tensor(c.grad()), tensor(c.input(0))}));
}

// ---- ops returning several views (all differentiable) ----------------------------------------------------
// The gradients of every piece, zeros for pieces no gradient reached, in result order.
std::vector<std::optional<ValueId>> piece_grads(RuleCall& c) {
  ValueId some = 0;
  for (size_t i = 0; i < c.num_results(); ++i)
    if (c.grad_at(i)) some = *c.grad_at(i);
  std::vector<std::optional<ValueId>> pieces;
  for (size_t i = 0; i < c.num_results(); ++i) {
    if (c.grad_at(i)) {
      pieces.push_back(*c.grad_at(i));
      continue;
    }
    const graph::TensorMeta& meta = c.b.forward_meta(c.node().outputs[i]);
    pieces.push_back(c.b.emit("aten::new_zeros", "default",
                              {tensor(some), meta.sizes, graph::ScalarTypeArg{meta.dtype}, graph::NoneArg{},
                               graph::NoneArg{}, graph::NoneArg{}}));
  }
  return pieces;
}
// split.Tensor(self, split_size, dim) / split_with_sizes(self, split_sizes, dim) -> Tensor[]: cat of the pieces.
void rule_split(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.emit("aten::cat", "default", {graph::TensorListArg{piece_grads(c)}, c.arg(2)}));
}
// unbind.int(self, dim) -> Tensor[]: stack of the pieces.
// When self is a permute (timm's qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)), the pieces are
// stacked in the permute's base order and the stack permuted: the permute's own rule then turns that back
// into a contiguous tensor of the base's shape, and the reshape before it (the packed projection's gradient)
// is a view instead of a second copy.
void rule_unbind(RuleCall& c) {
  if (!c.needs(0)) return;
  std::vector<std::optional<ValueId>> pieces = piece_grads(c);
  const graph::Graph& f = c.forward();
  const graph::Value& self = f.value(std::get<graph::TensorArg>(c.node().args.at(0)).id);
  const auto rank = static_cast<int64_t>(self.meta.sizes.size());
  const int64_t d = normalize_dim(c.int_arg(1), rank);
  const graph::Node* permute = self.producer >= 0 ? &f.nodes[self.producer] : nullptr;
  if (permute && permute->qualified_name() == "aten::permute.default") {
    const auto* dims = std::get_if<std::vector<int64_t>>(&permute->args.at(1));
    if (dims && static_cast<int64_t>(dims->size()) == rank) {
      std::vector<int64_t> order(rank);  // self's dims in the base's memory order: self dim j is base dim dims[j]
      for (int64_t j = 0; j < rank; ++j) order[normalize_dim((*dims)[j], rank)] = j;
      c.set(0, c.b.stack_in_order(graph::TensorListArg{pieces}, d, order));
      return;
    }
  }
  c.set(0, c.b.emit("aten::stack", "default", {graph::TensorListArg{pieces}, c.arg(1)}));
}

// cat(tensors, dim): each item's gradient is its slice of the output's.
void rule_cat(RuleCall& c) {
  const std::vector<ValueId> items = c.forward_items(0);
  int64_t start = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const graph::TensorMeta& meta = c.b.forward_meta(items[i]);
    if (meta.sizes.size() == 1 && meta.sizes[0] == 0 && c.b.forward_meta(c.node().outputs[0]).sizes.size() != 1)
      continue;  // a legacy empty 1-d item, skipped by cat
    const int64_t dim = normalize_dim(c.int_arg(1), meta.sizes.size());
    const int64_t length = meta.sizes.at(dim);
    if (meta.requires_grad && graph::is_floating_or_complex(meta.dtype))
      c.set_item(0, i, c.b.emit("aten::slice", "Tensor", {tensor(c.grad()), dim, start, start + length, int64_t{1}}));
    start += length;
  }
}

const std::map<std::string, DerivativeRule>& rule_table() {
  static const std::map<std::string, DerivativeRule> table = [] {
    std::map<std::string, DerivativeRule> t = {
      {"aten::mm.default", {rule_mm}},
      {"aten::addmm.default", {rule_addmm}},
      {"aten::bmm.default", {rule_bmm}},
      {"aten::add.Tensor", {rule_add_tensor}},
      {"aten::add.Scalar", {rule_identity}},
      {"aten::sub.Tensor", {rule_sub_tensor}},
      {"aten::sub.Scalar", {rule_identity}},
      {"aten::mul.Tensor", {rule_mul_tensor}},
      {"aten::mul.Scalar", {rule_mul_scalar}},
      {"aten::div.Tensor", {rule_div_tensor}},
      {"aten::div.Scalar", {rule_div_scalar}},
      {"aten::neg.default", {rule_neg}},
      {"aten::exp.default", {rule_exp}},
      {"aten::tanh.default", {rule_tanh}},
      {"aten::sigmoid.default", {rule_sigmoid}},
      {"aten::relu.default", {rule_relu}},
      {"aten::gelu.default", {rule_gelu}},
      {"aten::silu.default", {rule_silu}},
      {"aten::pow.Tensor_Scalar", {rule_pow_tensor_scalar}},
      {"aten::clone.default", {rule_identity}},
      {"aten::alias.default", {rule_identity}},
      {"aten::_to_copy.default", {rule_identity}},
      {"aten::expand.default", {rule_identity}},
      {"aten::view.default", {rule_reshape_back}},
      {"aten::_unsafe_view.default", {rule_reshape_back}},
      {"aten::reshape.default", {rule_reshape_back}},
      {"aten::unsqueeze.default", {rule_reshape_back}},
      {"aten::squeeze.dim", {rule_reshape_back}},
      {"aten::squeeze.dims", {rule_reshape_back}},
      {"aten::squeeze.default", {rule_reshape_back}},
      {"aten::t.default", {rule_t}},
      {"aten::transpose.int", {rule_transpose}},
      {"aten::permute.default", {rule_permute}},
      {"aten::as_strided.default", {rule_as_strided}},
      {"aten::select.int", {rule_select}},
      {"aten::slice.Tensor", {rule_slice}},
      {"aten::sum.default", {rule_sum}},
      {"aten::sum.dim_IntList", {rule_sum_dim}},
      {"aten::mean.default", {rule_mean}},
      {"aten::mean.dim", {rule_mean_dim}},
      {"aten::_softmax.default", {rule_softmax}},
      // _safe_softmax(self, dim, dtype): softmax with 0 for rows of -inf (attention's math path); its rows of 0 get
      // gradient 0 from the same formula. The meta rule admits only dtype None or the input's.
      {"aten::_safe_softmax.default", {rule_softmax}},
      {"aten::_log_softmax.default", {rule_log_softmax}},
      {"aten::native_layer_norm.default", {rule_native_layer_norm}},
      {"aten::convolution.default", {rule_convolution}},
      {"aten::native_batch_norm.default", {rule_batch_norm}},
      {"aten::_native_batch_norm_legit.default", {rule_batch_norm}},
      {"aten::_native_batch_norm_legit_no_training.default", {rule_batch_norm_no_training}},
      {"aten::cudnn_batch_norm.default", {rule_cudnn_batch_norm}},
      {"aten::native_dropout.default", {rule_native_dropout}},
      {"aten::embedding.default", {rule_embedding}},
      {"aten::max_pool2d_with_indices.default", {rule_max_pool2d_with_indices}},
      {"aten::avg_pool2d.default", {rule_avg_pool2d}},
      {"aten::_adaptive_avg_pool2d.default", {rule_adaptive_avg_pool2d}},
      {"aten::cat.default", {rule_cat}},
      {"aten::split.Tensor", {.emit = rule_split, .all_results = true}},
      {"aten::split_with_sizes.default", {.emit = rule_split, .all_results = true}},
      {"aten::unbind.int", {.emit = rule_unbind, .all_results = true}},
    };
    detail::add_more_rules(t);
    detail::add_math_rules(t);
    detail::add_linalg_rules(t);
    detail::add_attention_rules(t);
    detail::add_indexing_rules(t);
    return t;
  }();
  return table;
}

}  // namespace

const DerivativeRule* find_derivative_rule(const std::string& qualified_name) {
  const auto& table = rule_table();
  auto it = table.find(qualified_name);
  return it == table.end() ? nullptr : &it->second;
}

bool is_non_differentiable_op(const std::string& qualified_name) {
  // Factories: their values do not depend on their tensor argument's values (a base that writes through views
  // then fill, `torch.empty(n).copy_(x)` made functional, reaches one with a gradient that stops there).
  static const std::set<std::string> ops = {"aten::detach.default",    "aten::ones_like.default",
                                            "aten::zeros_like.default", "aten::empty_like.default",
                                            "aten::full_like.default",  "aten::new_empty.default",
                                            "aten::new_zeros.default",  "aten::new_ones.default",
                                            "aten::new_full.default",   "aten::new_empty_strided.default"};
  return ops.count(qualified_name) > 0;
}

std::vector<std::string> differentiable_ops() {
  std::vector<std::string> names;
  for (const auto& [name, rule] : rule_table()) names.push_back(name);
  return names;
}

}  // namespace kiln::autodiff
