#pragma once
// Helpers shared by the files that fill the derivative-rule table: derivative_rules.cpp (the seed models' ops),
// derivative_rules_more.cpp (math, masks, shapes, losses, norms, statistics, interpolation),
// derivative_rules_math.cpp (the rest of the elementwise math, binary ops with tensor operands, reductions),
// derivative_rules_linalg.cpp (products, linear algebra), derivative_rules_attention.cpp (attention) and
// derivative_rules_indexing.cpp (scatter and index updates, shape ops, losses, pooling, padding, sampling, *_copy
// views). Internal to autodiff/.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "autodiff/derivative_rules.h"

namespace kiln::autodiff::detail {

int64_t normalize_dim(int64_t dim, size_t rank);
/// aten::t of `v`.
ValueId t(RuleCall& c, ValueId v);
/// Argument `index` as a tensor argument of the backward, or None.
graph::ArgValue optional_tensor(RuleCall& c, size_t index);
/// Sets the grads of `args` from a backward op that returns (grad_input, grad_weight, grad_bias) under a mask.
void set_masked(RuleCall& c, const std::vector<ValueId>& grads, const std::vector<size_t>& args,
                const std::vector<bool>& mask);
/// Strides of `sizes` dense with the channels (dim 1) innermost: channels-last for 4-d, channels-last-3d for 5-d.
std::vector<int64_t> channels_innermost_strides(const std::vector<int64_t>& sizes);
/// Whether `m` starts at offset 0 with `strides`, those of size-1 dims aside (ATen's contiguity tests ignore them).
bool laid_out_as(const graph::TensorMeta& m, const std::vector<int64_t>& strides);
/// A 4-d tensor of 2 or more channels, dense channels-last.
inline bool dense_channels_last(const graph::TensorMeta& m) {
  return m.sizes.size() == 4 && m.sizes[1] > 1 && laid_out_as(m, channels_innermost_strides(m.sizes));
}

/// The reduced dims of a (self, dims?, keepdim) reduction whose dims are argument `dims_arg` (None or empty:
/// all), their element count, and self's sizes with them kept as 1.
struct Reduced {
  std::vector<int64_t> dims;
  int64_t count = 1;
  std::vector<int64_t> kept_sizes;
};
Reduced reduced_dims(RuleCall& c, size_t dims_arg);
/// `v` (a result of the reduction or its gradient) viewed with the reduced dims kept as size 1, so that it
/// broadcasts against self; `v` itself when the reduction kept them.
ValueId kept(RuleCall& c, ValueId v, const Reduced& r, bool keepdim);

// ---- emitting, for the rule files ----------------------------------------------------------------------
/// `name.overload(args...)` (the full schema argument list) in the backward graph.
inline ValueId op(RuleCall& c, const char* name, std::vector<Arg> args, const char* overload = "default") {
  return c.b.emit(name, overload, std::move(args));
}
/// Tensor argument `index` as an operand of an emitted op: its backward value, or the Python number it holds.
inline Arg operand(RuleCall& c, size_t index) { return c.is_tensor(index) ? tensor(c.input(index)) : c.arg(index); }
inline ValueId plus(RuleCall& c, ValueId a, double s) { return op(c, "aten::add", {tensor(a), s, int64_t{1}}, "Scalar"); }
inline ValueId square(RuleCall& c, ValueId a) { return c.b.mul(a, a); }
/// `v` with 0 where `mask` holds (eager's where(mask, 0, v)).
inline ValueId zero_where(RuleCall& c, ValueId mask, ValueId v) {
  return op(c, "aten::masked_fill", {tensor(v), tensor(mask), 0.0}, "Scalar");
}
/// `v` where `mask` holds, 0 elsewhere (eager's where(mask, v, 0)).
inline ValueId keep_where(RuleCall& c, ValueId mask, ValueId v) {
  return zero_where(c, op(c, "aten::logical_not", {tensor(mask)}), v);
}
/// name.Tensor(a, b): a comparison; b may be a backward value or a number.
inline ValueId compare(RuleCall& c, const char* name, ValueId a, Arg b) { return op(c, name, {tensor(a), std::move(b)}, "Tensor"); }
inline ValueId logical(RuleCall& c, const char* name, ValueId a, ValueId b) { return op(c, name, {tensor(a), tensor(b)}); }
inline ValueId zeros_like(RuleCall& c, ValueId like) {
  return op(c, "aten::zeros_like", {tensor(like), graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}});
}
inline ValueId ones_like(RuleCall& c, ValueId like) {
  return op(c, "aten::ones_like", {tensor(like), graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}});
}
inline ValueId new_zeros(RuleCall& c, ValueId like, const std::vector<int64_t>& sizes) {
  return op(c, "aten::new_zeros", {tensor(like), sizes, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}});
}
inline ValueId contiguous(RuleCall& c, ValueId a) { return op(c, "aten::clone", {tensor(a), graph::MemoryFormatArg{0}}); }
inline bool is_complex(graph::ScalarType t) {
  return t == graph::ScalarType::ComplexHalf || t == graph::ScalarType::ComplexFloat || t == graph::ScalarType::ComplexDouble;
}
inline void set_if(RuleCall& c, size_t index, ValueId grad) {
  if (c.needs(index)) c.set(index, grad);
}

/// Adds the rules of derivative_rules_more.cpp.
void add_more_rules(std::map<std::string, DerivativeRule>& table);
/// Adds the rules of derivative_rules_math.cpp.
void add_math_rules(std::map<std::string, DerivativeRule>& table);
/// Adds the rules of derivative_rules_linalg.cpp.
void add_linalg_rules(std::map<std::string, DerivativeRule>& table);
/// Adds the rules of derivative_rules_attention.cpp.
void add_attention_rules(std::map<std::string, DerivativeRule>& table);
/// Adds the rules of derivative_rules_indexing.cpp (after the others: the *_copy ops take their view op's rule).
void add_indexing_rules(std::map<std::string, DerivativeRule>& table);

}  // namespace kiln::autodiff::detail
