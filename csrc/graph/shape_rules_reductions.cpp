// Shape rules of the statistics and the reductions beyond sum/mean/amax/amin (shape_rules_nn.cpp): var, std,
// var_mean, prod, max/min (with and without dim), argmax/argmin, any/all, logsumexp, vector norms, the cumulative
// ops, topk, sort and bucketize.
//
// Design note: every one allocates contiguous outputs of reduced_sizes (shape_rules.cpp), sort's laid out as its
// input (empty_like); what differs is the dtype,
// taken as ATen's: int64 for indices and for sums/products of integers, bool for any/all (uint8 stays uint8), the
// default float dtype for logsumexp of integers. topk's k may be symbolic: it only has to fit in its dim.
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

// The dims argument at `i`: None or an int list (an int where the schema has `int dim`).
std::vector<int64_t> dims_arg(RuleCall& call, size_t i) {
  return call.is_none(i) ? std::vector<int64_t>{} : call.const_int_list(i);
}

void add_reduced(RuleCall& call, const SymTensorMeta& x, const std::vector<int64_t>& dims, bool keepdim,
                 ScalarType dtype) {
  call.add_output(contiguous_meta(reduced_sizes(call, x, dims, keepdim), dtype, x.device));
}

// var.correction / std.correction (self, dim, correction, keepdim) and var_mean.correction: floating inputs.
void variance_rule(RuleCall& call, int outputs) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(is_floating(x.dtype), "a non-floating input");
  call.check(call.is_none(2) || call.number(2).has_value(), "correction");
  for (int i = 0; i < outputs; ++i) add_reduced(call, x, dims_arg(call, 1), call.bool_arg(3), x.dtype);
}

// The dtype of a sum or product: the argument's, else int64 for integers and bool, else the input's.
ScalarType accumulated_dtype(RuleCall& call, const SymTensorMeta& x, size_t dtype_arg) {
  call.check(is_floating(x.dtype) || is_integral(x.dtype) || x.dtype == ScalarType::Bool, "a complex input");
  return call.optional_dtype(dtype_arg).value_or(is_floating(x.dtype) ? x.dtype : ScalarType::Long);
}

// prod.dim_int(self, dim, keepdim, dtype) and prod.default(self, dtype).
void prod_rule(RuleCall& call, bool with_dim) {
  const SymTensorMeta& x = call.tensor(0);
  if (with_dim) {
    add_reduced(call, x, {call.const_int(1)}, call.bool_arg(2), accumulated_dtype(call, x, 3));
  } else {
    add_reduced(call, x, {}, false, accumulated_dtype(call, x, 1));
  }
}

// cumsum / cumprod(self, dim, dtype): self's sizes, contiguous.
void cumulative_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  wrap_dim(call, call.const_int(1), x.dim());
  ScalarType dtype = accumulated_dtype(call, x, 2);
  call.add_output(contiguous_meta(allocated_sizes(call, x.sizes), dtype, x.device));
}

void check_ordered(RuleCall& call, const SymTensorMeta& x) {
  call.check(is_floating(x.dtype) || is_integral(x.dtype), "a bool or complex input");
}

// max.dim / min.dim(self, dim, keepdim): values and int64 indices.
void max_dim_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  check_ordered(call, x);
  std::vector<int64_t> dims = {call.const_int(1)};
  add_reduced(call, x, dims, call.bool_arg(2), x.dtype);
  add_reduced(call, x, dims, call.bool_arg(2), ScalarType::Long);
}

// max.default / min.default(self): 0-d of a non-empty input.
void max_all_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  check_ordered(call, x);
  add_reduced(call, x, {}, false, x.dtype);
}

// argmax / argmin(self, dim, keepdim): int64; no dim flattens (keepdim then keeps every dim as 1).
void arg_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  check_ordered(call, x);
  add_reduced(call, x, dims_arg(call, 1), call.bool_arg(2), ScalarType::Long);
}

// any / all: .default(self), .dim(self, dim, keepdim), .dims(self, dim, keepdim): bool (uint8 for uint8).
void any_all_rule(RuleCall& call, bool with_dim) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(is_floating(x.dtype) || is_integral(x.dtype) || x.dtype == ScalarType::Bool, "a complex input");
  ScalarType dtype = x.dtype == ScalarType::Byte ? ScalarType::Byte : ScalarType::Bool;
  std::vector<int64_t> dims = with_dim ? dims_arg(call, 1) : std::vector<int64_t>{};
  call.check(!with_dim || call.is_none(1) || !dims.empty() || x.dim() == 0, "an empty dim list");
  add_reduced(call, x, dims, with_dim && call.bool_arg(2), dtype);
}

// logsumexp(self, dim, keepdim): integers give the default float dtype.
void logsumexp_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(is_floating(x.dtype) || is_integral(x.dtype) || x.dtype == ScalarType::Bool, "a complex input");
  add_reduced(call, x, dims_arg(call, 1), call.bool_arg(2), is_floating(x.dtype) ? x.dtype : kDefaultDtype);
}

// linalg_vector_norm(self, ord, dim, keepdim, dtype): floating inputs, the dtype argument or self's.
void vector_norm_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(is_floating(x.dtype) && call.number(1).has_value(), "a non-floating input or ord");
  ScalarType dtype = call.optional_dtype(4).value_or(x.dtype);
  call.check(is_floating(dtype), "dtype");
  add_reduced(call, x, dims_arg(call, 2), call.bool_arg(3), dtype);
}

// topk(self, k, dim, largest, sorted): values and int64 indices with dim's size k (k <= that size).
void topk_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  check_ordered(call, x);
  Expr k = call.simplify(call.int_arg(1));
  const int64_t dim = wrap_dim(call, call.const_int(2), x.dim());
  call.require_le(0, k, "topk's k");
  call.require_le(k, x.dim() == 0 ? Expr(1) : x.sizes[dim], "topk's k against its dim");
  std::vector<Expr> sizes = x.sizes;
  if (x.dim() > 0) sizes[dim] = k;
  sizes = allocated_sizes(call, sizes);
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
  call.add_output(contiguous_meta(sizes, ScalarType::Long, x.device));
}

// sort(self, dim, descending) / sort.stable(self, stable, dim, descending): values and int64 indices laid out as
// empty_like(self) (the meta kernel's).
void sort_rule(RuleCall& call, size_t dim_arg) {
  const SymTensorMeta& x = call.tensor(0);
  check_ordered(call, x);
  call.check(x.dim() > 0, "a 0-d input");
  wrap_dim(call, call.const_int(dim_arg), x.dim());
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  const std::vector<Expr> strides = empty_like_strides(call, x, std::nullopt);
  call.add_output(make_meta(x.sizes, strides, x.dtype, x.device));
  call.add_output(make_meta(x.sizes, strides, ScalarType::Long, x.device));
}

// bucketize(self, boundaries, out_int32, right): self's shape, contiguous, int64 (int32 when asked).
void bucketize_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  const SymTensorMeta& boundaries = call.tensor(1);
  check_ordered(call, x);
  call.check(boundaries.dim() == 1 && boundaries.dtype == x.dtype, "boundaries of another rank or dtype");
  call.check(x.dim() > 0, "a 0-d input");
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  call.add_output(contiguous_meta(x.sizes, call.bool_arg(2) ? ScalarType::Int : ScalarType::Long, x.device));
}

}  // namespace

void register_reduction_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  add("var.correction", [](RuleCall& call) { variance_rule(call, 1); });
  add("std.correction", [](RuleCall& call) { variance_rule(call, 1); });
  add("var_mean.correction", [](RuleCall& call) { variance_rule(call, 2); });
  add("std_mean.correction", [](RuleCall& call) { variance_rule(call, 2); });
  add("prod.dim_int", [](RuleCall& call) { prod_rule(call, true); });
  add("prod.default", [](RuleCall& call) { prod_rule(call, false); });
  add("cumsum.default", cumulative_rule);
  add("cumprod.default", cumulative_rule);
  add("max.dim", max_dim_rule);
  add("min.dim", max_dim_rule);
  add("max.default", max_all_rule);
  add("min.default", max_all_rule);
  add("argmax.default", arg_rule);
  add("argmin.default", arg_rule);
  add("any.default", [](RuleCall& call) { any_all_rule(call, false); });
  add("all.default", [](RuleCall& call) { any_all_rule(call, false); });
  for (const char* op : {"any.dim", "any.dims", "all.dim", "all.dims"})
    add(op, [](RuleCall& call) { any_all_rule(call, true); });
  add("logsumexp.default", logsumexp_rule);
  add("linalg_vector_norm.default", vector_norm_rule);
  add("topk.default", topk_rule);
  add("sort.default", [](RuleCall& call) { sort_rule(call, 1); });
  add("sort.stable", [](RuleCall& call) { sort_rule(call, 2); });
  add("bucketize.Tensor", bucketize_rule);
}

}  // namespace kiln::graph::shape
