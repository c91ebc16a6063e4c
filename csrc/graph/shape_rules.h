#pragma once
// kiln's own output-metadata rules over symbolic sizes (DESIGN.md "Graph IR is ATen-level"): for an ATen overload
// and its inputs' symbolic metas, the outputs' sizes, strides, storage offset and dtype as sym::Expr.
//
// PyTorch computes symbolic shapes only through its Python ShapeEnv and sympy; these rules are kiln's, in C++, over
// graph/sym_expr.h. Each rule produces what ATen's own kernels produce for the cases it accepts, and says "no rule"
// (with a reason) for every other case: the caller then runs torch's meta kernel on concrete sizes and specialises.
//
// A rule never guesses. A decision the facts cannot prove either becomes an Assumption on the result (a guard the
// caller installs: broadcasting s0 against s1 needs s0 == s1, eager would raise otherwise) or makes the rule
// refuse (the order of two symbolic strides decides an output layout: no rule). Sizes 0 and 1 are concrete
// (dynamic symbols range over [2, inf)), which keeps broadcasting decidable.
//
// The same rules at concrete sizes (infer_concrete_metas) give the recorder and compile/'s MetaOracle their output
// metas without torch's meta kernels, nearly all of which are Python (the first one imports sympy).
//
// Torch-free, like the rest of graph/: dtypes are graph.h's ScalarType codes (dtypes are never symbolic).
// tests/python/test_shape_rules.py checks every rule against PyTorch on concrete sizes and random layouts, through
// kiln._C.shape_rule; tests/python/test_meta_rules.py checks the concrete answers against eager.
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "graph/graph.h"
#include "graph/sym_expr.h"
#include "graph/sym_facts.h"

namespace kiln::graph::shape {

using sym::Expr;

/// A tensor's meta with symbolic sizes, strides and storage offset.
struct SymTensorMeta {
  std::vector<Expr> sizes;
  std::vector<Expr> strides;
  Expr storage_offset;
  ScalarType dtype = ScalarType::Float;
  Device device;

  int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
  /// `f32[s0, 4](4, 1)+s1`: sizes, strides, and the storage offset when it is not 0.
  std::string to_string() const;
};

/// A Tensor[] or Tensor?[] argument (nullopt for a None element).
struct SymTensorList {
  std::vector<std::optional<SymTensorMeta>> items;
};

/// One schema argument of the node, in schema order with defaults filled (as Node::args holds them). Tensors carry
/// their symbolic meta; int and SymInt arguments are an Expr (constant or symbolic), int lists a vector of them;
/// a Python number in a Tensor or Scalar position is bool, Expr (int) or double.
using RuleArg = std::variant<NoneArg, SymTensorMeta, SymTensorList, bool, Expr, double, std::vector<Expr>,
                             std::vector<double>, std::vector<bool>, std::string, ScalarTypeArg, LayoutArg,
                             MemoryFormatArg, Device>;

/// A relation a rule assumed: the caller must guard on it (or specialise) before using the outputs.
struct Assumption {
  enum class Kind : uint8_t { kEq, kNe, kLt, kLe, kDivisible };  // lhs == rhs, !=, <, <=, lhs % rhs == 0
  Kind kind;
  Expr lhs;
  Expr rhs;
  std::string reason;  // what needed it: "broadcast dim 1", "view's -1"

  /// `s0 == s1`, `s0*s1 % 4 == 0`.
  std::string to_string() const;
  /// Whether it holds for these symbol values (throws kiln::Error when a symbol is unbound).
  bool holds(const sym::Bindings& bindings) const;
};

/// What a rule answered: the outputs (nullopt where the op returns None, as an output_mask leaves a gradient out)
/// and its assumptions, or no rule and why.
struct RuleResult {
  bool has_rule = false;
  std::string reason;  // when !has_rule: "no rule for aten::foo.default", "input 0 is not float", ...
  std::vector<std::optional<SymTensorMeta>> outputs;
  std::vector<Assumption> assumptions;
};

/// Evaluates the rule of `op` ("aten::add.Tensor": the op and its overload, "default" for the unnamed one) on `args`.
/// Proofs use `facts`; on success, the assumptions SizeFacts can hold (a symbol's divisibility by a constant, its
/// bounds against a constant) are also recorded into `facts`. Never throws for a malformed argument list: that is
/// a "no rule" answer.
/// With `hints` (every symbol's value at capture), a comparison the facts cannot decide (is a size 1, which stride is
/// smaller) is decided at the hints and the relation relied on becomes an assumption (a guard), where without hints
/// the rule refuses (and the caller specialises).
RuleResult infer_shapes(const std::string& op, const std::vector<RuleArg>& args, sym::SizeFacts& facts,
                        const sym::Bindings* hints = nullptr);
/// Records into `facts` what SizeFacts can hold of an assumption (a symbol's divisibility by a constant, its bounds
/// against a constant); anything else it leaves. infer_shapes does this with each rule's assumptions.
void record_assumption_in_facts(const Assumption& a, sym::SizeFacts& facts);
/// A node's arguments (Node::args) in the rules' form: each tensor's meta from `tensor`, each int from `int_arg` (its
/// argument index, its element in an int list or -1, its recorded value). nullopt for an argument the rules have no
/// form for (a complex number).
using TensorMetaOf = std::function<SymTensorMeta(ValueId)>;
using IntArgOf = std::function<Expr(size_t arg, int32_t element, int64_t value)>;
std::optional<std::vector<RuleArg>> rule_args(const std::vector<ArgValue>& args, const TensorMetaOf& tensor,
                                              const IntArgOf& int_arg);
/// The rule of `op` at concrete sizes: the outputs' metas (nullopt for an output the op returns as None), or nullopt
/// where no rule answers or an assumption of the rule is false at these sizes (torch's meta kernel then decides, and
/// raises eager's error). `meta_of` gives each tensor argument's meta.
std::optional<std::vector<std::optional<TensorMeta>>> infer_concrete_metas(
    const std::string& op, const std::vector<ArgValue>& args, const std::function<const TensorMeta&(ValueId)>& meta_of);
/// Whether `op` has a rule (which may still refuse given arguments).
bool has_shape_rule(const std::string& op);
/// The ops with a rule, sorted.
std::vector<std::string> shape_rule_ops();

// ---- the expression logic of the rules, exposed for tests and for code that needs one piece ----------------

/// Row-major contiguous strides of `sizes` (a size 0 counts as 1, as c10 does).
std::vector<Expr> contiguous_strides(const std::vector<Expr>& sizes);
/// Channels-last strides of a 4-d (NHWC) or 5-d (NDHWC) tensor.
std::vector<Expr> channels_last_strides(const std::vector<Expr>& sizes);
/// The exact quotient a / b when both are monomials (a coefficient times powers of atoms) and b's factors divide
/// a's: s0*s1*4 / (s1*2) -> s0*2. nullopt otherwise.
std::optional<Expr> exact_quotient(const Expr& a, const Expr& b);
/// ATen's convolution output size: (size + 2*padding - dilation*(kernel - 1) - 1) // stride + 1.
Expr conv_output_size(const Expr& size, const Expr& kernel, int64_t stride, int64_t padding, int64_t dilation);
/// ATen's pooling_output_shape, ceil_mode's correction written as a min (exact while padding <= kernel / 2).
Expr pool_output_size(const Expr& size, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation,
                      bool ceil_mode);

}  // namespace kiln::graph::shape
