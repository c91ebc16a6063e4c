#pragma once
// Helpers shared by the files that fill the derivative-rule table (derivative_rules.cpp for the seed models'
// ops, derivative_rules_more.cpp for math, masks, shapes, losses, norms, statistics and interpolation).
// Internal to autodiff/.
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

/// Adds the rules of derivative_rules_more.cpp.
void add_more_rules(std::map<std::string, DerivativeRule>& table);
/// Adds the rules of derivative_rules_math.cpp (after the others: the *_copy ops take their view op's rule).
void add_math_rules(std::map<std::string, DerivativeRule>& table);

}  // namespace kiln::autodiff::detail
