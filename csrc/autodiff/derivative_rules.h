#pragma once
// The table of derivative rules, keyed by "aten::op.overload" (STYLE.md 3: tables, not if-chains).
//
// A rule sees one forward node and the backward values of the gradients that reach its outputs, and
// emits backward nodes through a BackwardBuilder; it sets the gradient of each tensor argument that
// needs one. Gradients it sets may still carry broadcast dimensions or a promoted dtype: the joint
// builder reduces and casts them to the argument's meta (BackwardBuilder::grad_for).
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "autodiff/backward_builder.h"

namespace kiln::autodiff {

class RuleCall {
 public:
  RuleCall(BackwardBuilder& builder, const graph::Graph& forward, const graph::Node& node,
           std::vector<std::optional<ValueId>> grad_outputs)
      : b(builder), forward_(forward), node_(node), grad_outputs_(std::move(grad_outputs)) {}

  BackwardBuilder& b;

  /// The gradient reaching result 0 (rules run only when some result has one: others get zeros
  /// from the joint builder before the rule runs).
  ValueId grad() const { return *grad_outputs_.at(0); }
  /// The gradient reaching result `index`, if any (rules with several differentiable results).
  std::optional<ValueId> grad_at(size_t index) const { return grad_outputs_.at(index); }
  size_t num_results() const { return grad_outputs_.size(); }
  /// True when argument `index` is a tensor whose forward value requires grad.
  bool needs(size_t index) const;
  /// The backward value of forward tensor argument `index` / of forward result `index`.
  ValueId input(size_t index);
  ValueId result(size_t index);
  const graph::TensorMeta& input_meta(size_t index) const;
  bool is_tensor(size_t index) const;
  bool is_none(size_t index) const;
  int64_t int_arg(size_t index) const;
  double number_arg(size_t index) const;  // Scalar / float / int
  bool bool_arg(size_t index) const;
  std::vector<int64_t> ints_arg(size_t index) const;
  const graph::ArgValue& arg(size_t index) const { return node_.args.at(index); }
  const graph::Node& node() const { return node_; }
  const graph::Graph& forward() const { return forward_; }

  /// Records `grad` as (a contribution to) the gradient of tensor argument `index`.
  void set(size_t index, ValueId grad);
  const std::map<size_t, ValueId>& grads() const { return grads_; }
  /// Tensor-list arguments (cat's tensors): the forward values of the items, and their gradients.
  std::vector<ValueId> forward_items(size_t index) const;
  void set_item(size_t index, size_t item, ValueId grad) { item_grads_[{index, item}] = grad; }
  const std::map<std::pair<size_t, size_t>, ValueId>& item_grads() const { return item_grads_; }

 private:
  const graph::Graph& forward_;
  const graph::Node& node_;
  std::vector<std::optional<ValueId>> grad_outputs_;
  std::map<size_t, ValueId> grads_;
  std::map<std::pair<size_t, size_t>, ValueId> item_grads_;
};

struct DerivativeRule {
  void (*emit)(RuleCall&);
  /// How many leading results are differentiable (a gradient reaching a later one, such as layer
  /// norm's saved mean, makes the graph unsupported).
  size_t differentiable_results = 1;
  /// Set for ops whose every result is differentiable (split, unbind): the rule runs when any result has a
  /// gradient and makes zeros for the others itself.
  bool all_results = false;
};

/// The rule for "aten::op.overload", or nullptr. (Ops that write only buffers, such as BatchNorm's running
/// statistics, say so in the op table: graph::OpFacts::mutates_only_buffers.)
const DerivativeRule* find_derivative_rule(const std::string& qualified_name);
/// Ops whose results never carry gradient (detach, integer-valued ops): the joint builder skips them.
bool is_non_differentiable_op(const std::string& qualified_name);
/// Every op overload with a rule, sorted (for tests and kiln.explain-style listings).
std::vector<std::string> differentiable_ops();

}  // namespace kiln::autodiff
