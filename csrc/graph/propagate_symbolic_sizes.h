#pragma once
// Symbolic sizes for a recorded graph: mark input dims dynamic, then compute every value's sizes, strides and
// storage offset as expressions with kiln's shape rules (graph/shape_rules.h), node by node.
//
// A tracer that carries ints read from sizes (`n = x.shape[1] // 2`) symbolically uses the API in this order, once
// the recorder has made the graph:
//   1. while tracing it names input sizes s0, s1, ... (input_size_symbol(k), in the order it reads them) and sizes
//      of intermediate values p0, p1, ... (size_placeholder_symbol(k)), each with its concrete size as hint, and
//      builds expressions over both;
//   2. mark_symbolic_dims(g, input, dims, symbols) for each input, add_size_placeholder for each placeholder;
//   3. mark_symbolic_int_arg for each int it passed to an op (a constant Expr for an int that is not a size: every
//      annotated int is taken as given, see below), add_trace_assumption for each relation it relied on;
//   4. propagate_symbolic_sizes, then read each placeholder's `resolved` expression and the guards.
#include <cstdint>
#include <vector>

#include "graph/symbolic_sizes.h"

namespace kiln::graph {

/// Makes a fresh symbol for each of `dims` of graph input `input_index` (negative dims count from the end) whose size
/// is not 0 or 1 (those stay concrete: broadcasting and empty tensors decide on them), with range [2, inf) and the
/// concrete size as hint; the input's meta becomes symbolic. Dense strides (contiguous in some dim order) become
/// expressions over the sizes; any other strides stay concrete (a guard on them). Returns the symbols made. One
/// symbol per (input, dim): equal sizes are tied only by the equalities the rules assume. Call before
/// propagate_symbolic_sizes; a user error when the input or dim does not exist.
std::vector<sym::Expr> mark_symbolic_dims(Graph& g, int32_t input_index, const std::vector<int64_t>& dims);

/// The same with the symbols to use, for a tracer that made them while it traced: symbols[i] stands for dims[i]. Each
/// must be an input size symbol (not a placeholder) that no other dim of g uses, and its dim's size must be >= 2
/// (sizes 0 and 1 stay concrete: make no symbol for them). A user error otherwise.
void mark_symbolic_dims(Graph& g, int32_t input_index, const std::vector<int64_t>& dims,
                        const std::vector<sym::Expr>& symbols);

/// Names size `dim` of value `value` (negative dims count from the end) by a placeholder symbol, whose hint is that
/// size. Propagation replaces it by the size's expression as soon as the value's meta is known, before any later
/// node's rule runs. A user error when the symbol is no placeholder or is named twice, or the value or dim does not
/// exist.
void add_size_placeholder(Graph& g, SizePlaceholder placeholder);

/// A relation the trace relied on (a branch `if n > 16`, an `assert a == b`, `n == 8` where an int left for Python),
/// over input symbols and placeholders; `reason` names the source line ("model.py:42"). Propagation treats it as a
/// rule's assumption once its placeholders are resolved: an equality of a symbol with another expression substitutes
/// it, with a constant specialises it, anything else stays a guard (a relation that folds to true is dropped). A user
/// error when it names an unknown symbol or does not hold at the hints.
void add_trace_assumption(Graph& g, shape::Assumption assumption);

/// Records that an int argument of a node stands for a size expression (`value`, over input symbols and placeholders
/// already added): the hook for a tracer that knows an int came from a size. The propagation then passes it to the
/// rule as that expression. A user error when the argument is not an int (or int list element) equal to `value` at
/// the hints.
void mark_symbolic_int_arg(Graph& g, const SymbolicIntArg& arg);

/// Records that argument `arg` of node `node` is a size in ATen's schema (SymInt, SymInt[], SymInt?). Propagation
/// checks it: a value no tracer marked (mark_symbolic_int_arg) was computed where the tracer could not see, inside a
/// composite op recorded whole (F.interpolate's output_size, torch.diff's narrow length), possibly from sizes; where
/// the node reads symbols and no inference covers the argument, those symbols are pinned (the graph is specialised
/// there, never wrong). Configuration sizes (a convolution's stride, padding, dilation and groups, layer norm's
/// normalized_shape, padding_idx, ignore_index, a diagonal, a select's index) are taken as given.
void add_size_argument(Graph& g, NodeIndex node, int32_t arg);

/// Needs: the dims that may vary marked, the tracer's placeholders, int arguments and assumptions added (nothing
/// marked or added: nothing to do, the graph stays without symbols).
/// Guarantees: each value's symbolic meta (Graph::symbolic->metas) evaluates to its concrete meta at the hints (a
/// rule that disagrees is a bug: internal error naming the op and both metas); the rules' assumptions are on the
/// graph, with the node in each reason; an equality of a symbol with another expression replaces the symbol by it
/// everywhere (the assumption stays, as the guard), and equality with a constant specialises it. A node without a
/// rule, or whose rule refuses, specialises: every symbol its tensor and int arguments name is pinned to its hint,
/// with the op and the rule's reason, and its outputs are concrete. Run once, after the graph is built.
///
/// Sizes ATen computed: a composite op (linear, matmul, flatten, attention's math) records the views and expands it
/// makes with concrete ints computed from its inputs' sizes (`view(x, [24, 8])` for x [4, 6, 8]). Where such an int
/// list entry is neither marked (mark_symbolic_int_arg: an annotated int always wins) nor -1, and the node's input
/// has a symbolic element count, infer_recorded_sizes (graph/infer_recorded_sizes.h) gives it the expression of the
/// input's sizes it was computed from; each one found is added to the graph's symbolic int arguments. Propagation
/// also resolves each placeholder (SizePlaceholder::resolved) and moves the trace assumptions into the assumptions;
/// afterwards no placeholder remains in any meta, int argument or assumption.
void propagate_symbolic_sizes(Graph& g);

}  // namespace kiln::graph
