#pragma once
// Internal to the shape_rules*.cpp files: the call a rule receives (argument access, decisions over the facts,
// assumptions, outputs) and the layout helpers several families share (TensorIterator's output layout, contiguity,
// memory formats). A rule refuses by throwing NoRule, which infer_shapes turns into a "no rule" result.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "graph/shape_rules.h"

namespace kiln::graph::shape {

using sym::Truth;

/// Thrown inside a rule: the case is not one kiln's rules decide (the caller falls back to torch's meta kernel).
struct NoRule {
  std::string reason;
};

class RuleCall {
 public:
  RuleCall(const std::vector<RuleArg>& args, sym::SizeFacts& facts, const sym::Bindings* hints = nullptr)
      : args_(args), facts_(facts), hints_(hints) {}

  // ---- arguments: a wrong kind or a missing argument refuses ----
  size_t num_args() const { return args_.size(); }
  const RuleArg& arg(size_t i) const;
  bool is_none(size_t i) const;
  const SymTensorMeta& tensor(size_t i) const;
  const SymTensorMeta* optional_tensor(size_t i) const;  // nullptr for None
  std::vector<SymTensorMeta> tensor_list(size_t i) const;  // every element set
  Expr int_arg(size_t i) const;
  int64_t const_int(size_t i) const;  // a symbolic value refuses
  std::vector<Expr> int_list(size_t i) const;  // an int where a list is expected repeats nothing: [int]
  std::vector<int64_t> const_int_list(size_t i) const;
  bool bool_arg(size_t i) const;
  std::vector<bool> bool_list(size_t i) const;
  std::optional<ScalarType> optional_dtype(size_t i) const;
  std::optional<int8_t> optional_memory_format(size_t i) const;  // c10::MemoryFormat code
  /// The value of a Python number argument (bool, int, float) or nullopt for anything else.
  std::optional<double> number(size_t i) const;
  bool is_number_arg(size_t i) const;

  // ---- decisions: kUnknown refuses, naming `what` ----
  sym::SizeFacts& facts() { return facts_; }
  bool decide(Truth t, const std::string& what) const;
  /// Proofs over the facts, with this call's assumed equalities substituted; products compared by their ratio.
  bool eq(const Expr& a, const Expr& b, const std::string& what) const;
  bool lt(const Expr& a, const Expr& b, const std::string& what) const;
  bool le(const Expr& a, const Expr& b, const std::string& what) const;
  /// `e` as a constant: itself when constant, else its value at the hints with `e == value` kept as an assumption (the
  /// symbols in it are specialised); refuses without hints.
  Expr pinned(const Expr& e, const std::string& what) const;
  /// eq/lt/le where the facts cannot decide: the answer at the hints, the relation kept as an assumption (infer_shapes).
  bool at_hints(Assumption::Kind kind, const Expr& a, const Expr& b, const std::string& what) const;
  Truth prove_eq(const Expr& a, const Expr& b) const;
  Truth prove_lt(const Expr& a, const Expr& b) const;
  Truth prove_le(const Expr& a, const Expr& b) const;
  /// A size that may be a symbol: its relation to a constant (sizes are never negative).
  bool size_is(const Expr& size, int64_t value) const { return eq(size, value, "size == " + std::to_string(value)); }
  /// Proven, or assumed (recorded, and used by later proofs of this call); proven false refuses (eager raises).
  void require_eq(const Expr& a, const Expr& b, const std::string& what);
  void require_lt(const Expr& a, const Expr& b, const std::string& what);
  void require_le(const Expr& a, const Expr& b, const std::string& what);
  void require_divisible(const Expr& a, const Expr& k, const std::string& what);
  Expr simplify(const Expr& e) const;

  [[noreturn]] void refuse(const std::string& reason) const;
  void check(bool cond, const std::string& reason) const {
    if (!cond) refuse(reason);
  }

  // ---- results ----
  void add_output(SymTensorMeta meta);
  void add_none_output() { outputs_.emplace_back(std::nullopt); }
  std::vector<std::optional<SymTensorMeta>>& outputs() { return outputs_; }
  std::vector<Assumption>& assumptions() { return assumptions_; }

 private:
  Expr substituted(const Expr& e) const;
  void assume(Assumption::Kind kind, const Expr& a, const Expr& b, const std::string& what);

  const std::vector<RuleArg>& args_;
  sym::SizeFacts& facts_;
  std::vector<std::optional<SymTensorMeta>> outputs_;
  const sym::Bindings* hints_ = nullptr;
  mutable std::vector<Assumption> assumptions_;  // (at_hints adds to it from const deciders)
  sym::Substitution equalities_;  // symbol -> what an assumed equality makes it
};

using Rule = std::function<void(RuleCall&)>;
using RuleTable = std::map<std::string, Rule>;

// Each family file registers its rules (shape_rules_pointwise.cpp, _views.cpp, _nn.cpp, _backward.cpp, ...).
void register_pointwise_rules(RuleTable& table);
void register_view_rules(RuleTable& table);
void register_nn_rules(RuleTable& table);
void register_backward_rules(RuleTable& table);
void register_factory_rules(RuleTable& table);
void register_indexing_rules(RuleTable& table);
void register_reduction_rules(RuleTable& table);
void register_copy_rules(RuleTable& table);
void register_resample_rules(RuleTable& table);

// ---- shared helpers (shape_rules.cpp) ----
bool is_floating(ScalarType t);  // f32, f64, f16, bf16
bool is_integral(ScalarType t);  // i64, i32, i16, i8, u8 (not bool)
/// The dtype of a tensor made without one: torch's default (kiln captures under float32; guards check it).
constexpr ScalarType kDefaultDtype = ScalarType::Float;
/// A factory's (dtype, layout, device, pin_memory) arguments from index `first`: the dtype (`dtype` when None), a
/// strided layout, the device (`device` when None), no pinned memory; anything else refuses.
struct TensorOptions {
  ScalarType dtype;
  Device device;
};
TensorOptions tensor_options(RuleCall& call, size_t first, ScalarType dtype, const Device& device);
/// A list of sizes a factory or a copy allocates: each nonnegative, and a symbolic one at least 1 (dense strides
/// skip sizes 0, so a size that could be 0 would make them wrong).
std::vector<Expr> allocated_sizes(RuleCall& call, const std::vector<Expr>& sizes);
Expr product(const std::vector<Expr>& sizes);
/// A dim in [-ndim, ndim) wrapped to [0, ndim); anything else refuses. ndim 0 wraps as 1 (ATen's scalar rule).
int64_t wrap_dim(RuleCall& call, int64_t dim, int64_t ndim);
SymTensorMeta make_meta(std::vector<Expr> sizes, std::vector<Expr> strides, ScalarType dtype, const Device& device,
                        Expr storage_offset = 0);
SymTensorMeta contiguous_meta(std::vector<Expr> sizes, ScalarType dtype, const Device& device);
/// The sizes of a reduction of `x` over `dims` (every dim when empty; each wrapped, none repeated, none empty):
/// reduced dims dropped, or kept as 1 with `keepdim`.
std::vector<Expr> reduced_sizes(RuleCall& call, const SymTensorMeta& x, const std::vector<int64_t>& dims, bool keepdim);
/// The broadcast shape of `shapes` (dims aligned right); unequal symbolic sizes are assumed equal.
std::vector<Expr> broadcast_shape(RuleCall& call, const std::vector<std::vector<Expr>>& shapes);
/// Refuses where a size may be 0 (a symbolic size never is; an empty tensor's layout is torch's to decide).
void no_empty(RuleCall& call, const std::vector<Expr>& sizes);
/// Strides of `sizes` in like.suggest_memory_format(): channels-last (3d) where like's strides read so.
std::vector<Expr> suggested_format_strides(RuleCall& call, const std::vector<Expr>& sizes, const SymTensorMeta& like);
/// c10's is_contiguous / is_contiguous(channels_last) / is_non_overlapping_and_dense, decided.
bool is_contiguous(RuleCall& call, const SymTensorMeta& t);
bool is_channels_last_contiguous(RuleCall& call, const SymTensorMeta& t);
bool is_non_overlapping_and_dense(RuleCall& call, const SymTensorMeta& t);
/// c10's is_channels_last_strides_2d / _3d, which suggest_memory_format asks (false for other ranks).
bool strides_like_channels_last(RuleCall& call, const SymTensorMeta& t);
/// The strides TensorIterator gives the output of a pointwise op over `operands` broadcast to `shape`.
std::vector<Expr> pointwise_strides(RuleCall& call, const std::vector<Expr>& shape,
                                    const std::vector<const SymTensorMeta*>& operands);
/// The general case of pointwise_strides (TensorIterator's reorder_dimensions): dense strides of `shape` in the
/// order the operands' strides (over `shape`, 0 where broadcast) give its dims, the last dim fastest on ties.
std::vector<Expr> strides_in_operand_order(RuleCall& call, const std::vector<Expr>& shape,
                                           const std::vector<std::vector<Expr>>& operand_strides);
/// empty_like(x, memory_format)'s strides (code: c10::MemoryFormat; nullopt = preserve).
std::vector<Expr> empty_like_strides(RuleCall& call, const SymTensorMeta& x, std::optional<int8_t> memory_format);

// c10::MemoryFormat codes.
constexpr int8_t kContiguousFormat = 0;
constexpr int8_t kPreserveFormat = 1;
constexpr int8_t kChannelsLast = 2;
constexpr int8_t kChannelsLast3d = 3;

}  // namespace kiln::graph::shape
