#pragma once
// Dynamic shapes in the tracer (issue #25): which input dims are size symbols, and Python ints computed from sizes.
//
// When some input dims are dynamic, every size the traced code reads (`x.shape`, `x.size(1)`, `len(x)`,
// `x.numel()`) is a kSymInt Var: its value is the size at trace time (the hint) and its expression says what it is
// over the size symbols. Input dims have their symbol (or are constants when static); a size of a tensor made in the
// trace gets a *placeholder* symbol, resolved to that value's symbolic size once graph/propagate_symbolic_sizes has
// reached it. Arithmetic (+ - * // %, unary -, min, max) stays symbolic; comparisons and truth tests answer as eager
// does at the hints and record the relation they relied on (a guard); a symbolic int handed to a torch call becomes
// the symbolic argument of the node it reaches (value matched, see finish()); anything else that turns it into a
// Python value (range(n), a dict key, an attribute store, a graph output, a float) pins its expression to the hint.
// So a graph is never run at sizes that would have changed what the trace did: what it relied on is guarded.
//
// Sizes 0 and 1 stay specialised, as torch.compile does. Parameters and buffers (tensors reached through a module)
// are static unless marked with kiln.mark_dynamic.
#include <Python.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/source.h"
#include "compile/options.h"
#include "graph/shape_rules.h"
#include "graph/sym_expr.h"
#include "graph/symbolic_sizes.h"
#include "guards/guard_tree.h"
#include "trace/variables.h"

namespace kiln::trace {

namespace sym = graph::sym;

/// An int handed to a recorder call: its value, and its expression where it is a symbolic int.
struct PassedInt {
  int64_t value;
  std::optional<sym::Expr> expr;
};
/// The ints inside `v` (containers and slices included), appended in order.
void collect_passed_ints(const VarPtr& v, std::vector<PassedInt>& out);

/// What decides the dynamic dims of a trace (compile_frame.cpp fills it per miss).
struct DynamicPolicy {
  compile::Dynamic mode = compile::Dynamic::kAutomatic;
  /// kAutomatic, per source (Source::describe()): the sizes the code's earlier traces saw there, and the dims whose
  /// size already differed between them. A dim is dynamic when its size now differs from the one seen, or differed
  /// before (torch.compile's automatic dynamic shapes: the second distinct size recompiles once, symbolically).
  std::map<std::string, std::vector<int64_t>> seen;
  std::map<std::string, std::set<int64_t>> changed;

  /// After a trace of the code: remembers each input's sizes (`inputs`: real tensors, in `sources` order), and which
  /// dims changed. True when `changed` grew.
  bool remember(const std::vector<SourcePtr>& sources, PyObject* inputs);

  /// The code's profile in the disk cache (kind "dynamic"; trace/dynamic_profile.cpp): `changed` as earlier processes
  /// of the same job (torch.compiler.config.job_id) left it, so that a new process traces those dims symbolically from
  /// its first call and finds the kernels they compiled with size arguments, instead of compiling a static graph for
  /// the first size it meets and a symbolic one at the second (torch.compile's profile-guided automatic dynamic
  /// shapes). Read once per code object in automatic mode; written when remember() grows `changed`. Nothing is read
  /// or written without a job id, or while the disk cache is off.
  void load_profile(PyObject* code);
  void store_profile() const;
  std::string profile_key;  // the code's identity (file, qualified name, first line, bytecode); "" until loaded
  std::string profile_where;  // "fn at file:line", for logs
};

/// Recorder.size_arguments() of the recorder `recorder` (kiln._fake): (node, argument) for each argument its op's
/// schema types SymInt.
std::vector<std::pair<int32_t, int32_t>> recorded_size_arguments(PyObject* recorder);

/// The symbolic ints of one trace. Made by the Tracer; active() once an input dim is a symbol.
class SymbolicInts {
 public:
  explicit SymbolicInts(DynamicPolicy policy) : policy_(std::move(policy)) {}

  /// A new graph input: makes symbols for its dynamic dims (policy, kiln.mark_dynamic / mark_static marks on the
  /// real tensor; sizes 0 and 1 never). `real` is the user's tensor, `fake` the recorder's stand-in.
  void add_input(PyObject* real, PyObject* fake, const SourcePtr& source, int input_index);
  bool active() const { return !symbols_.empty(); }

  /// Size `dim` of fake tensor `fake` (graph value `value`, -1 when not recorded) as a Var: a constant, an input
  /// symbol or a placeholder.
  VarPtr size(PyObject* fake, int64_t value, int64_t dim, int64_t hint);

  /// `op(a, b)` where one side is a kSymInt: the symbolic result, or nullptr when the op is not one kept symbolic
  /// (the caller then folds it on Python values, which pins).
  VarPtr binary(PyObject* op, const VarPtr& a, const VarPtr& b);
  VarPtr negate(const VarPtr& a);
  /// min/max of ints, some symbolic: nullptr when not all are ints.
  VarPtr min_max(bool is_max, const std::vector<VarPtr>& args);
  /// Python truth of a kSymInt (n != 0), with the relation recorded.
  bool truthy(const VarPtr& v);
  /// `op(a, b)` for op == or != of two tuples holding kSymInts, element by element (torch.Size comparisons); nullptr
  /// for other ops, or when they are not both tuples of ints.
  VarPtr compare_tuples(PyObject* op, const VarPtr& a, const VarPtr& b);

  /// The int a kSymInt stands for leaves symbolic land: its expression must equal the hint from now on.
  void pin(const VarPtr& v, const std::string& why);
  /// Records that `lhs kind rhs` held at trace time and was relied on.
  void assume(graph::shape::Assumption::Kind kind, const sym::Expr& lhs, const sym::Expr& rhs, std::string why);

  /// A recorder call that was handed ints (`passed`, in argument order) recorded nodes [first_node, end_node);
  /// finish() finds them there. `returned_number`: it answered with a Python number, computed from them at trace
  /// time, so its symbolic ints are pinned instead.
  void note_call(int first_node, int end_node, std::vector<PassedInt> passed, std::string what, bool returned_number);

  /// After the recorder built `graph` (a kiln._C.Graph): gives it its symbolic sizes (input symbols, placeholders,
  /// the nodes' symbolic int arguments matched by value, the relations relied on), propagates them, and sets the
  /// guards: dynamic dims on the inputs' tensor checks and the size relations. `input_sources` in graph input order;
  /// `size_arguments` the (node, argument) pairs of the arguments ATen types SymInt (recorded_size_arguments).
  void finish(PyObject* graph, const std::vector<std::pair<int32_t, int32_t>>& size_arguments,
              guards::GuardTree& guards, const std::vector<SourcePtr>& input_sources);

  /// For kiln.explain and KILN_LOGS=dynamic: one line per symbol and per relation, after finish().
  const std::vector<std::string>& summary() const { return summary_; }
  /// A size outside the range kiln.mark_dynamic declared for its dim (the message of the KilnError the call raises),
  /// or "".
  const std::string& range_violation() const { return range_violation_; }

 private:
  struct InputDims {
    int input_index;
    SourcePtr source;
    std::vector<int64_t> dims;   // the symbolic ones
    std::vector<sym::Expr> symbols;
    std::vector<std::pair<int64_t, int64_t>> ranges;  // per symbolic dim: mark_dynamic's min and max, -1 when none
  };
  struct Call {
    int first_node, end_node;
    std::vector<PassedInt> passed;
    std::string what;
  };
  void match_call(graph::Graph& g, const Call& c);
  VarPtr make(int64_t hint, sym::Expr e);
  /// The dims of `real` that are symbolic, with the range mark_dynamic declared for each (-1: none).
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> dynamic_dims(PyObject* real, const SourcePtr& source) const;

  DynamicPolicy policy_;
  std::vector<InputDims> inputs_;
  std::map<PyObject*, std::vector<sym::Expr>> input_fakes_;  // fake -> per dim: symbol or constant (borrowed keys:
                                                              // the tracer's input Vars hold the fakes)
  std::vector<sym::Expr> symbols_;
  std::map<std::pair<int64_t, int64_t>, sym::Expr> placeholder_of_;  // (value, dim) -> placeholder
  std::vector<graph::SizePlaceholder> placeholders_;
  std::vector<int64_t> symbol_hints_;  // each of symbols_' traced size
  std::vector<Call> calls_;
  std::vector<graph::shape::Assumption> assumptions_;
  std::vector<std::string> summary_;
  std::string range_violation_;
};

/// The marker of a size guard kiln.mark_dynamic's range made: a call that fails it raises instead of recompiling.
constexpr const char* kDeclaredRange = "the range kiln.mark_dynamic declared";

/// While a trace with symbolic ints runs: converting a kSymInt to a Python value (variables.cpp to_python) pins it,
/// except inside a PinScope that hands the values to the recorder (whose nodes are matched instead).
SymbolicInts* active_symbolic_ints();
class SymbolicIntsScope {
 public:
  explicit SymbolicIntsScope(SymbolicInts* s);
  ~SymbolicIntsScope();
 private:
  SymbolicInts* saved_;
};
class NoPinScope {
 public:
  NoPinScope();
  ~NoPinScope();
};
bool pins_suppressed();

}  // namespace kiln::trace
