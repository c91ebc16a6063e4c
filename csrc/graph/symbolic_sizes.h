#pragma once
// A Graph's symbolic sizes (issue #25, dynamic shapes): which input dims are size symbols, what is known about the
// symbols, each value's sizes, strides and storage offset as expressions over them, and the relations (guards) and
// specialisations the graph relies on.
//
// The table sits beside the Graph (Graph::symbolic) rather than in Value, so that graph.h stays small and code that
// never looks at symbols compiles and behaves as before. Every value keeps its concrete TensorMeta: it is the
// example ("hint") of the symbolic meta, which must evaluate to it at the symbols' hints (Graph::verify checks).
// A graph without symbols has a null table and prints, serialises and hashes exactly as it did before symbols.
//
// Symbols come only from input dims (mark_symbolic_dims, graph/propagate_symbolic_sizes.h), so at run time each is
// read from its origin; an equality a rule assumed between two symbols keeps both origins and becomes a guard.
//
// Size placeholders are the tracer's names for sizes of intermediate values it reads before propagation has computed
// them (`h = x @ w; n = h.shape[0]`): symbols of their own id range, p0, p1, ..., which propagation replaces by the
// value's size expression. They are trace-time bookkeeping: no meta, assumption or specialisation names one after
// propagation, and neither they nor pending trace assumptions are serialised (propagate before storing a graph).
#include <optional>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "graph/shape_rules.h"
#include "graph/sym_expr.h"
#include "graph/sym_facts.h"

namespace kiln::graph {

/// A size symbol and where its value comes from at run time: size `dim` of graph input `input_index`.
struct SymbolOrigin {
  sym::Expr symbol;
  int32_t input_index = -1;
  int32_t dim = -1;
  int64_t hint = 0;  // the size the graph was captured with
};

/// Input size symbols are s<k> with id k (SizeFacts::new_symbol's names); placeholders p<k> with id
/// kFirstPlaceholderId + k, so that the two never meet, whichever order a tracer makes them in.
constexpr sym::SymbolId kFirstPlaceholderId = sym::SymbolId{1} << 30;
/// The k-th input size symbol, s<k>: for a tracer that makes input symbols while it traces, in order, before the
/// graph exists (it passes them to mark_symbolic_dims).
sym::Expr input_size_symbol(int32_t k);
/// The k-th size placeholder, p<k> (for add_size_placeholder).
sym::Expr size_placeholder_symbol(int32_t k);
/// Whether `e` is a symbol of the placeholders' id range.
bool is_size_placeholder(const sym::Expr& e);

/// Size `dim` of graph value `value`, named by the tracer before propagation knew it. propagate_symbolic_sizes sets
/// `resolved`: the size's expression over input symbols (a constant where that size is concrete).
struct SizePlaceholder {
  sym::Expr symbol;
  ValueId value = -1;
  int32_t dim = -1;
  std::optional<sym::Expr> resolved;
};

/// A symbol pinned to its hint: the graph holds only for that value (a node without a rule read it, or a rule
/// assumed it equal to a constant).
struct Specialisation {
  sym::Expr symbol;
  int64_t value = 0;
  std::string reason;  // "node 4 (aten::cumsum.default): no rule for aten::cumsum.default"
};

/// A node's int argument that stands for a size expression: a tracer that knows an int came from x.shape[0] marks it
/// (mark_symbolic_int_arg; its value may name placeholders until propagation), and propagation adds the ones it
/// infers for sizes ATen's composites computed (view's [B*S, K] inside linear). After propagation each value is
/// over input symbols.
struct SymbolicIntArg {
  NodeIndex node = -1;
  int32_t arg = -1;      // index into Node::args: an int, or an int list
  int32_t element = -1;  // the element of an int list; -1 for an int
  sym::Expr value;
};

struct SymbolicSizes {
  sym::SizeFacts facts;
  std::vector<SymbolOrigin> symbols;  // every symbol, in the order made
  /// By ValueId; nullopt (or past the end, for values added later) where every size is concrete.
  std::vector<std::optional<shape::SymTensorMeta>> metas;
  std::vector<SymbolicIntArg> int_args;
  /// Arguments ATen's schema types as sizes (SymInt), as (node, argument): add_size_argument.
  std::vector<std::pair<NodeIndex, int32_t>> size_args;
  /// The relations the rules assumed, each a guard the graph needs; reasons name the node.
  std::vector<shape::Assumption> assumptions;
  std::vector<Specialisation> specialisations;
  /// The tracer's placeholders (add_size_placeholder), resolved by propagation.
  std::vector<SizePlaceholder> placeholders;
  /// Relations the trace relied on (add_trace_assumption), over input symbols and placeholders; propagation moves
  /// each into `assumptions` once its placeholders are resolved.
  std::vector<shape::Assumption> trace_assumptions;

  /// Each input symbol's hint.
  sym::Bindings hints() const;
  /// hints() and each unresolved placeholder's hint (its value's concrete size), for the graph `g` of this table.
  sym::Bindings hints_with_placeholders(const Graph& g) const;
  const SizePlaceholder* placeholder(sym::SymbolId id) const;
  const SymbolOrigin* origin(sym::SymbolId id) const;
  const shape::SymTensorMeta* meta(ValueId id) const;
};

/// g's table, made when absent and copied first when another graph shares it.
SymbolicSizes& mutable_symbolic(Graph& g);
/// True when g has a symbolic table.
inline bool has_symbolic_sizes(const Graph& g) { return g.symbolic != nullptr; }
/// A concrete meta as constant expressions.
shape::SymTensorMeta constant_meta(const TensorMeta& meta);
/// A value's meta as expressions: its symbolic meta, else its concrete one.
shape::SymTensorMeta symbolic_meta(const Graph& g, ValueId id);
/// meta_to_string's form with expressions: `f32[s0, 64]`, `f32[64, s0](1, 64)`; strides print when they are not
/// the contiguous ones of the sizes. `concrete` gives the device and requires_grad.
std::string symbolic_meta_to_string(const shape::SymTensorMeta& meta, const TensorMeta& concrete);
/// The concrete meta of value `id` at other symbol values (every symbol its meta names must be bound).
TensorMeta evaluate_meta(const Graph& g, ValueId id, const sym::Bindings& bindings);
/// Graph::verify's part for symbols: ranks and dtypes agree with the concrete metas, every symbolic meta evaluates
/// to the concrete one at the hints, every symbol has an origin, assumptions hold at the hints; placeholders appear
/// only in int arguments and trace assumptions, and only until resolved. Throws an internal error naming the value or
/// assumption.
void verify_symbolic_sizes(const Graph& g);
/// Comment lines for Graph::to_string: one per symbol, assumption and specialisation.
std::string symbolic_sizes_to_string(const SymbolicSizes& s);

}  // namespace kiln::graph
