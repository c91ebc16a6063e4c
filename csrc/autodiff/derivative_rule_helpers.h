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

/// Adds the rules of derivative_rules_more.cpp.
void add_more_rules(std::map<std::string, DerivativeRule>& table);

}  // namespace kiln::autodiff::detail
