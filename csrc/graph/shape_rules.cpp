// The shape-rule table, the call a rule receives, and the layout logic the families share.
//
// Design note: a rule is straight-line code over RuleCall. Every branch that depends on a size or stride goes
// through RuleCall's decisions, which ask SizeFacts for a proof and refuse when there is none; relations eager would
// raise on (two broadcast sizes that must agree) become assumptions instead. The layout helpers follow c10 and
// TensorIterator step by step, so that each comparison they make is one decision.
#include "graph/shape_rules_impl.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "common/error.h"

namespace kiln::graph::shape {

// ---- the table ---------------------------------------------------------------------------------------------
namespace {
const RuleTable& table() {
  static const RuleTable rules = [] {
    RuleTable t;
    register_pointwise_rules(t);
    register_view_rules(t);
    register_nn_rules(t);
    register_backward_rules(t);
    register_factory_rules(t);
    register_indexing_rules(t);
    register_reduction_rules(t);
    register_copy_rules(t);
    register_resample_rules(t);
    return t;
  }();
  return rules;
}

}  // namespace

RuleResult infer_shapes(const std::string& op, const std::vector<RuleArg>& args, sym::SizeFacts& facts,
                        const sym::Bindings* hints) {
  RuleResult result;
  auto it = table().find(op);
  if (it == table().end()) {
    result.reason = "no rule for " + op;
    return result;
  }
  RuleCall call(args, facts, hints);
  try {
    it->second(call);
  } catch (const NoRule& no) {
    result.reason = op + ": " + no.reason;
    return result;
  } catch (const kiln::Error& e) {  // an expression that overflows or divides by zero
    result.reason = op + ": " + e.what();
    return result;
  }
  result.has_rule = true;
  result.outputs = std::move(call.outputs());
  result.assumptions = std::move(call.assumptions());
  for (const Assumption& a : result.assumptions) record_assumption_in_facts(a, facts);
  return result;
}

void record_assumption_in_facts(const Assumption& a, sym::SizeFacts& facts) {
  if (a.kind == Assumption::Kind::kDivisible && a.lhs.is_symbol() && a.rhs.is_constant() && a.rhs.constant_value() > 0) {
    facts.add_divisor(a.lhs, a.rhs.constant_value());
    return;
  }
  if (a.kind != Assumption::Kind::kLt && a.kind != Assumption::Kind::kLe) return;
  int64_t strict = a.kind == Assumption::Kind::kLt ? 1 : 0;
  if (a.lhs.is_symbol() && a.rhs.is_constant()) {  // s < c
    sym::Range r = facts.range(a.lhs.symbol_id());
    int64_t hi = a.rhs.constant_value() - strict;
    if (hi < r.hi && hi >= r.lo) facts.set_range(a.lhs, {r.lo, hi});
  } else if (a.rhs.is_symbol() && a.lhs.is_constant()) {  // c < s
    sym::Range r = facts.range(a.rhs.symbol_id());
    int64_t lo = a.lhs.constant_value() + strict;
    if (lo > r.lo && lo <= r.hi) facts.set_range(a.rhs, {lo, r.hi});
  }
}

bool has_shape_rule(const std::string& op) { return table().count(op) != 0; }

std::vector<std::string> shape_rule_ops() {
  std::vector<std::string> names;
  for (const auto& [name, rule] : table()) names.push_back(name);
  return names;
}

// ---- text --------------------------------------------------------------------------------------------------
std::string SymTensorMeta::to_string() const {
  std::ostringstream out;
  out << scalar_type_name(dtype) << "[";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i].to_string();
  out << "](";
  for (size_t i = 0; i < strides.size(); ++i) out << (i ? ", " : "") << strides[i].to_string();
  out << ")";
  if (storage_offset != Expr(0)) out << "+" << storage_offset.to_string();
  return out.str();
}

std::string Assumption::to_string() const {
  switch (kind) {
    case Kind::kEq: return lhs.to_string() + " == " + rhs.to_string();
    case Kind::kNe: return lhs.to_string() + " != " + rhs.to_string();
    case Kind::kLt: return lhs.to_string() + " < " + rhs.to_string();
    case Kind::kLe: return lhs.to_string() + " <= " + rhs.to_string();
    case Kind::kDivisible: return lhs.to_string() + " % " + rhs.to_string() + " == 0";
  }
  return "?";
}

bool Assumption::holds(const sym::Bindings& bindings) const {
  int64_t a = lhs.evaluate(bindings), b = rhs.evaluate(bindings);
  switch (kind) {
    case Kind::kEq: return a == b;
    case Kind::kNe: return a != b;
    case Kind::kLt: return a < b;
    case Kind::kLe: return a <= b;
    case Kind::kDivisible: return b != 0 && sym::int_mod(a, b) == 0;
  }
  return false;
}

// ---- RuleCall: arguments -----------------------------------------------------------------------------------
const RuleArg& RuleCall::arg(size_t i) const {
  if (i >= args_.size()) refuse("argument " + std::to_string(i) + " is missing");
  return args_[i];
}

bool RuleCall::is_none(size_t i) const { return i >= args_.size() || std::holds_alternative<NoneArg>(args_[i]); }

const SymTensorMeta& RuleCall::tensor(size_t i) const {
  auto* t = std::get_if<SymTensorMeta>(&arg(i));
  if (!t) refuse("argument " + std::to_string(i) + " is not a tensor");
  return *t;
}

const SymTensorMeta* RuleCall::optional_tensor(size_t i) const { return is_none(i) ? nullptr : &tensor(i); }

std::vector<SymTensorMeta> RuleCall::tensor_list(size_t i) const {
  auto* list = std::get_if<SymTensorList>(&arg(i));
  if (!list) refuse("argument " + std::to_string(i) + " is not a tensor list");
  std::vector<SymTensorMeta> tensors;
  for (const auto& item : list->items) {
    if (!item) refuse("a tensor list holds None");
    tensors.push_back(*item);
  }
  return tensors;
}

Expr RuleCall::int_arg(size_t i) const {
  const RuleArg& a = arg(i);
  if (auto* e = std::get_if<Expr>(&a)) return *e;
  refuse("argument " + std::to_string(i) + " is not an int");
}

int64_t RuleCall::const_int(size_t i) const {
  Expr e = simplify(int_arg(i));
  if (!e.is_constant()) refuse("argument " + std::to_string(i) + " is symbolic");
  return e.constant_value();
}

std::vector<Expr> RuleCall::int_list(size_t i) const {
  const RuleArg& a = arg(i);
  if (auto* list = std::get_if<std::vector<Expr>>(&a)) return *list;
  if (auto* e = std::get_if<Expr>(&a)) return {*e};
  refuse("argument " + std::to_string(i) + " is not an int list");
}

std::vector<int64_t> RuleCall::const_int_list(size_t i) const {
  std::vector<int64_t> values;
  for (const Expr& e : int_list(i)) {
    Expr v = simplify(e);
    if (!v.is_constant()) refuse("argument " + std::to_string(i) + " holds a symbolic int");
    values.push_back(v.constant_value());
  }
  return values;
}

bool RuleCall::bool_arg(size_t i) const {
  auto* b = std::get_if<bool>(&arg(i));
  if (!b) refuse("argument " + std::to_string(i) + " is not a bool");
  return *b;
}

std::vector<bool> RuleCall::bool_list(size_t i) const {
  auto* b = std::get_if<std::vector<bool>>(&arg(i));
  if (!b) refuse("argument " + std::to_string(i) + " is not a bool list");
  return *b;
}

std::optional<ScalarType> RuleCall::optional_dtype(size_t i) const {
  if (is_none(i)) return std::nullopt;
  if (auto* t = std::get_if<ScalarTypeArg>(&arg(i))) return t->type;
  if (std::holds_alternative<Expr>(arg(i))) return static_cast<ScalarType>(const_int(i));  // (a schema default)
  refuse("argument " + std::to_string(i) + " is not a dtype");
}

std::optional<int8_t> RuleCall::optional_memory_format(size_t i) const {
  if (is_none(i)) return std::nullopt;
  if (auto* m = std::get_if<MemoryFormatArg>(&arg(i))) return m->code;
  if (std::holds_alternative<Expr>(arg(i))) return static_cast<int8_t>(const_int(i));  // (a schema default)
  refuse("argument " + std::to_string(i) + " is not a memory format");
}

std::optional<double> RuleCall::number(size_t i) const {
  if (i >= args_.size()) return std::nullopt;
  const RuleArg& a = args_[i];
  if (auto* b = std::get_if<bool>(&a)) return *b ? 1.0 : 0.0;
  if (auto* d = std::get_if<double>(&a)) return *d;
  if (auto* e = std::get_if<Expr>(&a)) {
    Expr v = simplify(*e);
    if (v.is_constant()) return static_cast<double>(v.constant_value());
  }
  return std::nullopt;
}

bool RuleCall::is_number_arg(size_t i) const {
  if (i >= args_.size()) return false;
  const RuleArg& a = args_[i];
  return std::holds_alternative<bool>(a) || std::holds_alternative<double>(a) || std::holds_alternative<Expr>(a);
}

// ---- RuleCall: decisions -----------------------------------------------------------------------------------
void RuleCall::refuse(const std::string& reason) const { throw NoRule{reason}; }

Expr RuleCall::substituted(const Expr& e) const { return equalities_.empty() ? e : e.substitute(equalities_); }

Expr RuleCall::simplify(const Expr& e) const { return facts_.simplify(substituted(e)); }

bool RuleCall::decide(Truth t, const std::string& what) const {
  if (t == Truth::kUnknown) refuse("cannot decide " + what);
  return t == Truth::kTrue;
}

namespace {
// Strides are products of sizes, which interval arithmetic compares poorly (s0*s1 against s1: each variable is
// bounded on its own). Where one side is a monomial multiple q of the other and that other is positive, comparing
// q with 1 decides: s0*s1 > s1 because s0 >= 2.
enum class Relation { kEq, kLt, kLe };
Truth by_ratio(const sym::SizeFacts& facts, const Expr& a, const Expr& b, Relation relation) {
  auto against_one = [&](const Expr& q, bool flipped) {  // a = q*b (or b = q*a when flipped), and b > 0
    switch (relation) {
      case Relation::kEq: return facts.prove_eq(q, 1);
      case Relation::kLt: return flipped ? facts.prove_lt(1, q) : facts.prove_lt(q, 1);
      case Relation::kLe: return flipped ? facts.prove_le(1, q) : facts.prove_le(q, 1);
    }
    return Truth::kUnknown;
  };
  if (facts.prove_lt(0, b) == Truth::kTrue)
    if (auto q = exact_quotient(a, b)) return against_one(*q, false);
  if (facts.prove_lt(0, a) == Truth::kTrue)
    if (auto q = exact_quotient(b, a)) return against_one(*q, true);
  return Truth::kUnknown;
}
}  // namespace

Truth RuleCall::prove_eq(const Expr& a, const Expr& b) const {
  Expr x = substituted(a), y = substituted(b);
  Truth t = facts_.prove_eq(x, y);
  return t != Truth::kUnknown ? t : by_ratio(facts_, x, y, Relation::kEq);
}

Truth RuleCall::prove_lt(const Expr& a, const Expr& b) const {
  Expr x = substituted(a), y = substituted(b);
  Truth t = facts_.prove_lt(x, y);
  return t != Truth::kUnknown ? t : by_ratio(facts_, x, y, Relation::kLt);
}

Truth RuleCall::prove_le(const Expr& a, const Expr& b) const {
  Expr x = substituted(a), y = substituted(b);
  Truth t = facts_.prove_le(x, y);
  return t != Truth::kUnknown ? t : by_ratio(facts_, x, y, Relation::kLe);
}

bool RuleCall::eq(const Expr& a, const Expr& b, const std::string& what) const {
  const Truth t = prove_eq(a, b);
  return t == Truth::kUnknown ? at_hints(Assumption::Kind::kEq, a, b, what) : t == Truth::kTrue;
}
bool RuleCall::lt(const Expr& a, const Expr& b, const std::string& what) const {
  const Truth t = prove_lt(a, b);
  return t == Truth::kUnknown ? at_hints(Assumption::Kind::kLt, a, b, what) : t == Truth::kTrue;
}
bool RuleCall::le(const Expr& a, const Expr& b, const std::string& what) const {
  const Truth t = prove_le(a, b);
  return t == Truth::kUnknown ? at_hints(Assumption::Kind::kLe, a, b, what) : t == Truth::kTrue;
}

Expr RuleCall::pinned(const Expr& e, const std::string& what) const {
  const Expr x = simplify(e);
  if (x.is_constant()) return x;
  if (!hints_) refuse("a symbolic " + what);
  int64_t value = 0;
  try {
    value = x.evaluate(*hints_);
  } catch (const kiln::Error&) {
    refuse("a symbolic " + what);
  }
  assumptions_.push_back(Assumption{Assumption::Kind::kEq, x, Expr(value), what});
  return Expr(value);
}

// What Dynamo's guard_bool does: the answer at the capture's sizes, with the relation it rests on (or its negation)
// kept as an assumption, so the graph is only used where the answer is the same.
bool RuleCall::at_hints(Assumption::Kind kind, const Expr& a, const Expr& b, const std::string& what) const {
  if (!hints_) refuse("cannot decide " + what);
  const Expr x = substituted(a), y = substituted(b);
  int64_t xv = 0, yv = 0;
  try {
    xv = x.evaluate(*hints_);
    yv = y.evaluate(*hints_);
  } catch (const kiln::Error&) {
    refuse("cannot decide " + what);
  }
  const bool holds = kind == Assumption::Kind::kEq ? xv == yv : kind == Assumption::Kind::kLt ? xv < yv : xv <= yv;
  if (holds)
    assumptions_.push_back(Assumption{kind, x, y, what});
  else if (kind == Assumption::Kind::kEq)
    assumptions_.push_back(Assumption{Assumption::Kind::kNe, x, y, "not " + what});
  else  // not (x < y) is y <= x; not (x <= y) is y < x
    assumptions_.push_back(Assumption{kind == Assumption::Kind::kLt ? Assumption::Kind::kLe : Assumption::Kind::kLt, y, x,
                                      "not " + what});
  return holds;
}

void RuleCall::assume(Assumption::Kind kind, const Expr& a, const Expr& b, const std::string& what) {
  assumptions_.push_back(Assumption{kind, substituted(a), substituted(b), what});
}

void RuleCall::require_eq(const Expr& a, const Expr& b, const std::string& what) {
  Expr x = substituted(a), y = substituted(b);
  Truth t = prove_eq(x, y);
  if (t == Truth::kFalse) refuse(what + ": " + x.to_string() + " != " + y.to_string());
  if (t == Truth::kTrue) return;
  assume(Assumption::Kind::kEq, x, y, what);
  // Later proofs of this call see the equality: the symbol of higher id takes the other side's value.
  if (x.is_symbol() && (!y.is_symbol() || y.symbol_id() < x.symbol_id())) {
    equalities_.emplace(x.symbol_id(), y);
  } else if (y.is_symbol()) {
    equalities_.emplace(y.symbol_id(), x);
  }
}

void RuleCall::require_lt(const Expr& a, const Expr& b, const std::string& what) {
  Truth t = prove_lt(a, b);
  if (t == Truth::kFalse) refuse(what + ": not " + a.to_string() + " < " + b.to_string());
  if (t == Truth::kUnknown) assume(Assumption::Kind::kLt, a, b, what);
}

void RuleCall::require_le(const Expr& a, const Expr& b, const std::string& what) {
  Truth t = prove_le(a, b);
  if (t == Truth::kFalse) refuse(what + ": not " + a.to_string() + " <= " + b.to_string());
  if (t == Truth::kUnknown) assume(Assumption::Kind::kLe, a, b, what);
}

void RuleCall::require_divisible(const Expr& a, const Expr& k, const std::string& what) {
  Expr x = simplify(a), d = simplify(k);
  if (d.is_constant()) {
    check(d.constant_value() != 0, what + ": division by zero");
    Truth t = facts_.prove_divisible(x, d.constant_value());
    if (t == Truth::kFalse) refuse(what + ": " + x.to_string() + " is not a multiple of " + d.to_string());
    if (t == Truth::kTrue) return;
  } else if (exact_quotient(x, d)) {
    return;
  }
  assume(Assumption::Kind::kDivisible, x, d, what);
}

void RuleCall::add_output(SymTensorMeta meta) {
  for (Expr& e : meta.sizes) e = simplify(e);
  for (Expr& e : meta.strides) e = simplify(e);
  meta.storage_offset = simplify(meta.storage_offset);
  outputs_.emplace_back(std::move(meta));
}

// ---- expression helpers ------------------------------------------------------------------------------------
bool is_floating(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half || t == ScalarType::BFloat16;
}

bool is_integral(ScalarType t) {
  return t == ScalarType::Long || t == ScalarType::Int || t == ScalarType::Short || t == ScalarType::Char ||
         t == ScalarType::Byte;
}

TensorOptions tensor_options(RuleCall& call, size_t first, ScalarType dtype, const Device& device) {
  TensorOptions options{call.optional_dtype(first).value_or(dtype), device};
  call.check(is_floating(options.dtype) || is_integral(options.dtype) || options.dtype == ScalarType::Bool, "dtype");
  if (!call.is_none(first + 1)) {
    auto* layout = std::get_if<LayoutArg>(&call.arg(first + 1));
    call.check(layout && layout->code == 0, "a layout other than strided");
  }
  if (!call.is_none(first + 2)) {
    auto* d = std::get_if<Device>(&call.arg(first + 2));
    call.check(d != nullptr, "device");
    options.device = *d;
  }
  call.check(call.is_none(first + 3) || !call.bool_arg(first + 3), "pin_memory");
  return options;
}

std::vector<Expr> allocated_sizes(RuleCall& call, const std::vector<Expr>& sizes) {
  std::vector<Expr> out;
  for (const Expr& size : sizes) {
    Expr s = call.simplify(size);
    if (s.is_constant()) {
      call.check(s.constant_value() >= 0, "a negative size");
    } else {
      call.require_le(1, s, "an allocated size");
    }
    out.push_back(s);
  }
  return out;
}

Expr product(const std::vector<Expr>& sizes) {
  Expr p = 1;
  for (const Expr& s : sizes) p = p * s;
  return p;
}

std::vector<Expr> contiguous_strides(const std::vector<Expr>& sizes) {
  std::vector<Expr> strides(sizes.size());
  Expr acc = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = acc;
    // c10 multiplies by max(size, 1); sizes are constant 0 or provably >= 1 otherwise.
    acc = acc * (sizes[d].is_constant() && sizes[d].constant_value() == 0 ? Expr(1) : sizes[d]);
  }
  return strides;
}

std::vector<Expr> channels_last_strides(const std::vector<Expr>& sizes) {
  KILN_ASSERT(sizes.size() == 4 || sizes.size() == 5) << "channels-last strides of a " << sizes.size() << "-d tensor";
  auto one_if_zero = [](const Expr& s) { return s.is_constant() && s.constant_value() == 0 ? Expr(1) : s; };
  std::vector<Expr> strides(sizes.size());
  Expr acc = 1;
  std::vector<size_t> order = {1};  // C fastest, then W, H, (D,) N
  for (size_t d = sizes.size() - 1; d >= 2; --d) order.push_back(d);
  order.push_back(0);
  for (size_t d : order) {
    strides[d] = acc;
    acc = acc * one_if_zero(sizes[d]);
  }
  return strides;
}

namespace {
// A monomial: coefficient * product of atom**exponent, keyed by the atom's text (atoms are canonical).
struct Monomial {
  int64_t coefficient = 1;
  std::map<std::string, std::pair<Expr, int64_t>> factors;
};

std::optional<Monomial> as_monomial(const Expr& e) {
  Monomial m;
  if (e.is_constant()) {
    m.coefficient = e.constant_value();
    return m;
  }
  if (e.kind() != sym::ExprKind::kSum) {
    m.factors.emplace(e.to_string(), std::make_pair(e, 1));
    return m;
  }
  if (e.terms().size() != 1 || e.sum_constant() != 0) return std::nullopt;
  const Expr::Term& term = e.terms()[0];
  m.coefficient = term.coefficient;
  for (const Expr::Factor& f : term.factors) m.factors.emplace(f.atom.to_string(), std::make_pair(f.atom, f.exponent));
  return m;
}
}  // namespace

std::optional<Expr> exact_quotient(const Expr& a, const Expr& b) {
  auto x = as_monomial(a), y = as_monomial(b);
  if (!x || !y || y->coefficient == 0 || x->coefficient % y->coefficient != 0) return std::nullopt;
  Expr q = x->coefficient / y->coefficient;
  for (const auto& [key, factor] : y->factors) {
    auto it = x->factors.find(key);
    if (it == x->factors.end() || it->second.second < factor.second) return std::nullopt;
    it->second.second -= factor.second;
  }
  for (const auto& [key, factor] : x->factors)
    for (int64_t i = 0; i < factor.second; ++i) q = q * factor.first;
  return q;
}

Expr conv_output_size(const Expr& size, const Expr& kernel, int64_t stride, int64_t padding, int64_t dilation) {
  return sym::floordiv(size + 2 * padding - dilation * (kernel - 1) - 1, stride) + 1;
}

Expr pool_output_size(const Expr& size, int64_t kernel, int64_t stride, int64_t padding, int64_t dilation,
                      bool ceil_mode) {
  Expr raw = sym::floordiv(size + 2 * padding - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0), stride) + 1;
  if (!ceil_mode) return raw;
  // ATen drops the last window when it would start inside the right padding: (out - 1) * stride >= size + padding.
  // That is out - 1 >= ceil((size + padding) / stride), and out - 1 never exceeds it while padding <= kernel / 2,
  // so the corrected size is min(out, ceil((size + padding) / stride)).
  return sym::min(raw, sym::floordiv(size + padding + stride - 1, stride));
}

int64_t wrap_dim(RuleCall& call, int64_t dim, int64_t ndim) {
  int64_t n = std::max<int64_t>(ndim, 1);
  call.check(dim >= -n && dim < n, "dim " + std::to_string(dim) + " out of range for " + std::to_string(ndim) + " dims");
  return dim < 0 ? dim + n : dim;
}

SymTensorMeta make_meta(std::vector<Expr> sizes, std::vector<Expr> strides, ScalarType dtype, const Device& device,
                        Expr storage_offset) {
  SymTensorMeta m;
  m.sizes = std::move(sizes);
  m.strides = std::move(strides);
  m.storage_offset = std::move(storage_offset);
  m.dtype = dtype;
  m.device = device;
  return m;
}

SymTensorMeta contiguous_meta(std::vector<Expr> sizes, ScalarType dtype, const Device& device) {
  std::vector<Expr> strides = contiguous_strides(sizes);
  return make_meta(std::move(sizes), std::move(strides), dtype, device);
}

std::vector<Expr> reduced_sizes(RuleCall& call, const SymTensorMeta& x, const std::vector<int64_t>& dims, bool keepdim) {
  std::set<int64_t> reduced;
  for (int64_t d : dims) reduced.insert(wrap_dim(call, d, x.dim()));
  call.check(reduced.size() == dims.size(), "a repeated dim");
  if (dims.empty())
    for (int64_t d = 0; d < x.dim(); ++d) reduced.insert(d);
  std::vector<Expr> sizes;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (reduced.count(d) == 0) {
      sizes.push_back(x.sizes[d]);
      continue;
    }
    call.check(!call.size_is(x.sizes[d], 0), "a reduction over an empty dim");
    if (keepdim) sizes.push_back(1);
  }
  return sizes;
}

std::vector<Expr> broadcast_shape(RuleCall& call, const std::vector<std::vector<Expr>>& shapes) {
  size_t ndim = 0;
  for (const auto& s : shapes) ndim = std::max(ndim, s.size());
  std::vector<Expr> shape(ndim, Expr(1));
  for (const auto& s : shapes) {
    size_t offset = ndim - s.size();
    for (size_t i = 0; i < s.size(); ++i) {
      Expr& out = shape[offset + i];
      if (call.size_is(s[i], 1)) continue;
      if (call.size_is(out, 1)) {
        out = s[i];
      } else {
        call.require_eq(out, s[i], "broadcast dim " + std::to_string(offset + i));
      }
    }
  }
  return shape;
}

// ---- layouts -----------------------------------------------------------------------------------------------
bool is_contiguous(RuleCall& call, const SymTensorMeta& t) {
  Expr expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (call.size_is(t.sizes[d], 1)) continue;
    if (call.size_is(t.sizes[d], 0)) return true;
    if (!call.eq(t.strides[d], expected, "a stride against the contiguous one")) return false;
    expected = expected * t.sizes[d];
  }
  return true;
}

bool is_channels_last_contiguous(RuleCall& call, const SymTensorMeta& t) {
  if (t.dim() != 4) return false;
  Expr expected = 1;
  for (int64_t d : {1, 3, 2, 0}) {
    if (call.size_is(t.sizes[d], 1)) continue;
    if (call.size_is(t.sizes[d], 0)) return true;
    if (!call.eq(t.strides[d], expected, "a stride against the channels-last one")) return false;
    expected = expected * t.sizes[d];
  }
  return true;
}

bool is_non_overlapping_and_dense(RuleCall& call, const SymTensorMeta& t) {
  if (t.dim() == 1) return call.size_is(t.sizes[0], 1) || call.eq(t.strides[0], 1, "a 1-d stride");
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (!call.size_is(t.sizes[d], 1) && !call.size_is(t.sizes[d], 0)) dims.push_back(d);
  // Insertion sort by stride (stable, as c10's), each comparison decided.
  for (size_t i = 1; i < dims.size(); ++i)
    for (size_t j = i; j > 0 && call.lt(t.strides[dims[j]], t.strides[dims[j - 1]], "the order of two strides"); --j)
      std::swap(dims[j], dims[j - 1]);
  Expr expected = 1;
  for (int64_t d : dims) {
    if (!call.eq(t.strides[d], expected, "a stride against the dense one")) return false;
    expected = expected * t.sizes[d];
  }
  return true;
}

bool strides_like_channels_last(RuleCall& call, const SymTensorMeta& t) {
  std::vector<int64_t> order;
  if (t.dim() == 4) {
    order = {1, 3, 2, 0};
  } else if (t.dim() == 5) {
    order = {1, 4, 3, 2, 0};
  } else {
    return false;
  }
  if (call.eq(t.strides[1], 0, "a channel stride of 0")) return false;
  Expr smallest = 0;
  for (int64_t d : order) {
    if (call.size_is(t.sizes[d], 0)) return false;
    if (call.lt(t.strides[d], smallest, "channels-last stride order")) return false;
    // (N's stride equal to C's: ambiguous, read as contiguous)
    if (d == 0 && call.eq(smallest, t.strides[1], "batch stride against channel stride")) return false;
    smallest = t.strides[d] * t.sizes[d];
  }
  return true;
}

void no_empty(RuleCall& call, const std::vector<Expr>& sizes) {
  for (const Expr& s : sizes) call.check(!call.size_is(s, 0), "an empty tensor");
}

std::vector<Expr> suggested_format_strides(RuleCall& call, const std::vector<Expr>& sizes, const SymTensorMeta& like) {
  if ((like.dim() == 4 || like.dim() == 5) && strides_like_channels_last(call, like)) return channels_last_strides(sizes);
  return contiguous_strides(sizes);
}

std::vector<Expr> pointwise_strides(RuleCall& call, const std::vector<Expr>& shape,
                                    const std::vector<const SymTensorMeta*>& operands) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  if (ndim == 0) return {};
  auto same_shape = [&](const SymTensorMeta* t) {
    if (t->dim() != ndim) return false;
    for (int64_t d = 0; d < ndim; ++d)
      if (!call.eq(t->sizes[d], shape[d], "an operand's size against the broadcast one")) return false;
    return true;
  };
  if (std::all_of(operands.begin(), operands.end(), same_shape)) {
    auto all = [&](auto pred) { return std::all_of(operands.begin(), operands.end(), pred); };
    if (all([&](const SymTensorMeta* t) { return is_contiguous(call, *t); })) return contiguous_strides(shape);
    if (ndim == 4 && all([&](const SymTensorMeta* t) { return is_channels_last_contiguous(call, *t); }))
      return channels_last_strides(shape);
    if (all([&](const SymTensorMeta* t) { return is_non_overlapping_and_dense(call, *t); }) &&
        all([&](const SymTensorMeta* t) {
          for (int64_t d = 0; d < ndim; ++d)
            if (!call.eq(t->strides[d], operands[0]->strides[d], "two operands' strides")) return false;
          return true;
        }))
      return operands[0]->strides;
  }
  // Each operand's strides over the broadcast shape: broadcast dims have stride 0 and never decide the order.
  std::vector<std::vector<Expr>> operand_strides;
  for (const SymTensorMeta* t : operands) {
    int64_t offset = ndim - t->dim();
    std::vector<Expr> strides(ndim, Expr(0));
    for (int64_t i = 0; i < t->dim(); ++i)
      if (!(call.size_is(t->sizes[i], 1) && !call.size_is(shape[offset + i], 1))) strides[offset + i] = t->strides[i];
    operand_strides.push_back(std::move(strides));
  }
  return strides_in_operand_order(call, shape, operand_strides);
}

std::vector<Expr> strides_in_operand_order(RuleCall& call, const std::vector<Expr>& shape,
                                           const std::vector<std::vector<Expr>>& operand_strides) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  auto should_swap = [&](int64_t dim0, int64_t dim1) {
    for (const auto& strides : operand_strides) {
      const Expr &s0 = strides[dim0], &s1 = strides[dim1];
      if (call.eq(s0, 0, "a stride of 0") || call.eq(s1, 0, "a stride of 0")) continue;
      if (call.lt(s0, s1, "the order of two strides")) return -1;
      if (call.lt(s1, s0, "the order of two strides")) return 1;
      if (call.lt(shape[dim1], shape[dim0], "the order of two sizes")) return 1;
    }
    return 0;
  };
  std::vector<int64_t> perm(ndim);
  for (int64_t i = 0; i < ndim; ++i) perm[i] = ndim - 1 - i;  // fastest dim first
  for (int64_t i = 1; i < ndim; ++i) {
    int64_t dim1 = i;
    for (int64_t dim0 = i - 1; dim0 >= 0; --dim0) {
      int comparison = should_swap(perm[dim0], perm[dim1]);
      if (comparison > 0) {
        std::swap(perm[dim0], perm[dim1]);
        dim1 = dim0;
      } else if (comparison < 0) {
        break;
      }
    }
  }
  std::vector<Expr> strides(ndim);
  Expr acc = 1;
  for (int64_t d : perm) {
    strides[d] = acc;
    acc = acc * shape[d];
  }
  return strides;
}

std::vector<Expr> empty_like_strides(RuleCall& call, const SymTensorMeta& x, std::optional<int8_t> memory_format) {
  int8_t format = memory_format.value_or(kPreserveFormat);
  if (format == kContiguousFormat) return contiguous_strides(x.sizes);
  if (format == kChannelsLast) {
    call.check(x.dim() == 4, "channels_last needs a 4-d tensor");
    return channels_last_strides(x.sizes);
  }
  if (format == kChannelsLast3d) {
    call.check(x.dim() == 5, "channels_last_3d needs a 5-d tensor");
    return channels_last_strides(x.sizes);
  }
  call.check(format == kPreserveFormat, "unknown memory format");
  if (is_non_overlapping_and_dense(call, x)) return x.strides;
  return pointwise_strides(call, x.sizes, {&x});
}

}  // namespace kiln::graph::shape
