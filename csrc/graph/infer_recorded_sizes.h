#pragma once
// Symbolic forms of the size arguments ATen's composite ops compute and the recorder writes as concrete ints:
// F.linear on x [B, S, K] records view(x, [B*S, K]) and view(out, [B, S, N]); matmul of batched operands expand,
// view and _unsafe_view with the folded batch; flatten a view. Without these forms every such view would assume
// `s0*s1*K == 192` and the graph would hold for one batch and sequence length only.
//
// Why inferring them is sound: eager's view raises unless the sizes' product is the input's element count, so when
// that count is symbolic, a concrete size list that worked can only have been computed from the input's sizes, and
// ATen's composites compute them by folding and unfolding runs of adjacent dims. The rule below recovers those runs
// from the hints: input and output dims group by equal running products (as c10's computeStride groups them); a
// group's only output dim (size-1 dims aside) is the product of the group's input sizes; in a group of several output
// dims (matmul unfolding B*H back into B, H) each takes the symbol among the product's factors whose hint it equals
// (before a part of the constant coefficient: composites fold whole dims), else that part of the constant, and the
// last one what the others leave. Where the hints cannot tell (two symbols of that hint, a size no factor explains),
// the rest of the group stays concrete and the rule's element-count requirement becomes a guard: the graph is
// specialised there, never wrong at the sizes it accepts.
// The view rule checks the element count again over the inferred sizes, so a group the hints mismatch can only add
// a guard.
//
// Only ints a tracer did not annotate are inferred: an int the user wrote (`x.view(4, -1)`) must reach the graph
// annotated (mark_symbolic_int_arg, a constant Expr when it is no size), or a literal that happens to equal a
// symbol's hint would be read as that symbol.
//
// Upsampling (F.interpolate / nn.Upsample with a scale_factor): ATen's composite computes each output size as the
// input size times the scale, truncated, and passes the scale on to the kernel (scales_h, scales_w). A scale that is
// a fraction p/q with a small q (2.0, 0.5, 1.5) gives floordiv(size*p, q), which is that product's floor for any
// size the graph will see (the product's distance to an integer is at least 1/q, far above a double's rounding).
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "graph/graph.h"
#include "graph/shape_rules.h"
#include "graph/sym_expr.h"

namespace kiln::graph {

/// Which arguments of a node with inferable recorded sizes: the tensor and its size list.
struct RecordedSizeArgs {
  int32_t tensor = 0;
  int32_t sizes = 1;
  /// Whether the op's shape rule checks the sizes against its input (a view's element count), so an entry left
  /// concrete can only add a guard. Upsampling's cannot: an entry no form explains specialises its node instead.
  bool checked_by_rule = true;
};

/// The arguments of `op` ("aten::view.default") whose sizes infer_recorded_sizes can infer; nullopt for other ops.
std::optional<RecordedSizeArgs> recorded_size_args(const std::string& op);

/// What infer_recorded_sizes reads: the node's tensor argument (symbolic meta and concrete sizes), its size list as
/// the rule would receive it, which entries may be inferred (concrete in the record and not annotated), the
/// recorded output sizes, and the symbols' hints.
struct RecordedSizes {
  const shape::SymTensorMeta* input = nullptr;
  std::vector<int64_t> input_hints;
  std::vector<sym::Expr> sizes;
  std::vector<bool> inferable;
  std::vector<int64_t> output_hints;
  const sym::Bindings* hints = nullptr;
  /// Upsampling: the scale each size entry was computed with (scales_h, scales_w), nullopt where none was given.
  std::vector<std::optional<double>> scales;
};

/// Single int size arguments a composite computed from one tensor's sizes (group norm's N, C and HxW): the tensor
/// argument, and per int argument its form over that tensor's symbolic sizes. Used where the form evaluates to the
/// recorded int at the hints; an int no form matches specialises the node.
struct ScalarSizeForms {
  int32_t tensor = 0;
  std::vector<std::pair<int32_t, std::function<sym::Expr(const std::vector<sym::Expr>&)>>> forms;
};

/// The scalar size forms of `op`, or nullopt for ops without any.
const ScalarSizeForms* scalar_size_forms(const std::string& op);

/// `r.sizes` with each inferable entry replaced by the expression over the input's sizes it was computed from,
/// where one is found (see the design note); entries -1, 0 and 1 stay as they are. Each expression evaluates to the
/// entry at the hints. `op` must have recorded_size_args.
std::vector<sym::Expr> infer_recorded_sizes(const std::string& op, const RecordedSizes& r);

}  // namespace kiln::graph
