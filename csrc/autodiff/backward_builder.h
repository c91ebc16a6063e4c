#pragma once
// Emitting backward ATen nodes into a graph::Graph (torch-free).
//
// Derivative rules (derivative_rules.cpp) call this builder; it owns the two things a rule must not
// care about: where forward values come from in the backward graph (saved by the forward, or
// recomputed there when they are views: a view costs nothing to redo and saves no bytes; which other
// values are recomputed instead of saved is decided after the walk, by partition.h), and the
// meta of every emitted node, which comes from PyTorch's own meta kernels through a graph::OpOracle that
// the caller supplies (DESIGN.md: shapes are never computed again by hand).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "graph/op_oracle.h"

namespace kiln::autodiff {

using graph::ValueId;

/// True for the view ops (one tensor argument, their base) that the backward recomputes from the base
/// instead of reading a saved aliasing tensor: the op table's OpCost::kView.
bool is_recomputed_view(const std::string& qualified_name);

/// Adds a copy of forward constant `constant` (sharing its tensor reference, requires_grad off) to `into`.
ValueId copy_constant(const graph::Value& constant, graph::Graph& into);

/// One argument of an emitted node: a backward value, or a constant of any other schema kind.
using Arg = graph::ArgValue;
inline Arg tensor(ValueId id) { return graph::TensorArg{id}; }

class BackwardBuilder {
 public:
  BackwardBuilder(const graph::Graph& forward, graph::Graph& backward, graph::OpOracle& oracle);

  // ---- forward values in the backward graph ----------------------------------------------------
  /// The backward value standing for forward value `forward_id`: a view node of the forward is
  /// recomputed from its (recursively resolved) base, anything else becomes a saved value (a backward
  /// input the forward provides). Repeated calls return the same value.
  ValueId forward_value(ValueId forward_id);
  const graph::TensorMeta& forward_meta(ValueId forward_id) const { return forward_.value(forward_id).meta; }
  /// Forward values that became backward inputs, in the order they were first used.
  const std::vector<ValueId>& saved_forward_values() const { return saved_order_; }

  // ---- emitting ----------------------------------------------------------------------------------
  /// Appends `op.overload(args...)` (full schema argument list) and returns its result values.
  std::vector<ValueId> emit_all(const std::string& op, const std::string& overload, std::vector<Arg> args);
  /// Like emit_all for ops with one result.
  ValueId emit(const std::string& op, const std::string& overload, std::vector<Arg> args);
  const graph::TensorMeta& meta(ValueId backward_id) const { return backward_.value(backward_id).meta; }
  /// The backward graph built so far.
  const graph::Graph& graph() const { return backward_; }

  // ---- helpers shared by many rules -------------------------------------------------------------
  ValueId add(ValueId a, ValueId b);
  ValueId mul(ValueId a, ValueId b);
  ValueId mul(ValueId a, double scalar);
  ValueId div(ValueId a, ValueId b);
  ValueId neg(ValueId a);
  ValueId transpose(ValueId a, int64_t dim0, int64_t dim1);
  /// view when `a` is contiguous, reshape otherwise.
  ValueId reshape(ValueId a, const std::vector<int64_t>& sizes);
  ValueId expand(ValueId a, const std::vector<int64_t>& sizes);
  /// stack(pieces, dim), written so that its memory holds the result's dims in `order` (outermost first) and
  /// permuted back to stack's shape: a later view chain that reads it in that order stays a view.
  ValueId stack_in_order(const graph::TensorListArg& pieces, int64_t dim, const std::vector<int64_t>& order);
  /// stack(pieces, position) when every piece is an `aten::reshape` of same-shaped values: those values are
  /// stacked through views instead (no reshape copies); nullopt when the shapes do not allow it.
  std::optional<ValueId> stack_through_reshapes(const graph::TensorListArg& pieces, int64_t position);
  /// Sums `grad` over the dimensions broadcasting added, back to `sizes` (no-op when they match).
  ValueId sum_to(ValueId grad, const std::vector<int64_t>& sizes);
  /// Casts `a` to `dtype` when it differs (type promotion in the forward).
  ValueId to_dtype(ValueId a, graph::ScalarType dtype);
  /// `grad` reduced and cast so that it is a gradient for forward value `forward_id`.
  ValueId grad_for(ValueId grad, ValueId forward_id);

 private:
  const graph::Graph& forward_;
  graph::Graph& backward_;
  graph::OpOracle& oracle_;
  std::map<ValueId, ValueId> forward_to_backward_;
  std::vector<ValueId> saved_order_;
};

}  // namespace kiln::autodiff
