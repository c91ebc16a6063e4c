#pragma once
// What is known about size symbols, and what follows from it: kiln's counterpart of PyTorch's ShapeEnv, without
// sympy or Python.
//
// A symbol has an inclusive range [lo, hi] (either end may be infinite) and may be known to be a multiple of a
// positive constant. Queries answer with a Truth; kTrue and kFalse are proofs over every binding the facts allow,
// kUnknown is the answer whenever no proof was found, so a caller must treat it as "could be either".
//
// How proofs are found: a symbol known to be a multiple of d is replaced by d * t for a fresh symbol t (whose range
// is the symbol's divided by d), the difference of the two sides is put in canonical form (graph/sym_expr.h),
// and its bounds come from interval arithmetic: each monomial's bounds from its atoms' (signs and even powers
// handled), floordiv, mod, min and max from their arguments'. The same variable in two terms is treated as two
// independent ones, which makes bounds wider, never wrong.
#include <cstdint>
#include <limits>
#include <map>
#include <string>

#include "graph/sym_expr.h"

namespace kiln::graph::sym {

/// The outcome of a query: proven true for every allowed binding, proven false for every one, or not known.
enum class Truth : uint8_t { kFalse, kTrue, kUnknown };

const char* truth_name(Truth t);

/// An inclusive range of int64 values; kNegInf / kPosInf (the int64 extremes) stand for unbounded ends.
struct Range {
  static constexpr int64_t kNegInf = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kPosInf = std::numeric_limits<int64_t>::max();
  int64_t lo = kNegInf;
  int64_t hi = kPosInf;

  bool is_constant() const { return lo == hi && lo != kNegInf && hi != kPosInf; }
  bool contains(int64_t v) const { return (lo == kNegInf || lo <= v) && (hi == kPosInf || v <= hi); }
  std::string to_string() const;  // "[2, inf)", "[0, 15]"
  friend bool operator==(const Range& a, const Range& b) { return a.lo == b.lo && a.hi == b.hi; }
};

/// The facts about a set of symbols, and the prover over them. A symbol never declared is unconstrained.
class SizeFacts {
 public:
  /// The range of a dynamic size: 0 and 1 stay specialised, so a symbolic size is at least 2.
  static constexpr Range kDynamicSizeRange{2, Range::kPosInf};

  /// A fresh symbol named s<id> (ids counting up from 0, past any declared), with the given range.
  Expr new_symbol(Range range = kDynamicSizeRange);
  /// Records (or replaces) the range of `symbol`; lo <= hi, both may be infinite.
  void set_range(const Expr& symbol, Range range);
  /// Records that `symbol` is a multiple of k > 0 (added to what was known: multiples of 4 and of 6 are of 12).
  void add_divisor(const Expr& symbol, int64_t k);
  /// What is recorded: the range as given (not narrowed to the divisor), and the divisor (1 when none).
  Range range(SymbolId id) const;
  int64_t divisor(SymbolId id) const;

  /// Bounds of e over every binding the facts allow (sound, not always tight).
  Range bounds(const Expr& e) const;
  Truth prove_eq(const Expr& a, const Expr& b) const;
  Truth prove_lt(const Expr& a, const Expr& b) const;
  Truth prove_le(const Expr& a, const Expr& b) const;
  Truth prove_nonneg(const Expr& a) const;
  /// Whether a is a multiple of k (k != 0).
  Truth prove_divisible(const Expr& a, int64_t k) const;
  /// (The queries answer kUnknown, and bounds() everything, where building the expressions they compare fails:
  /// a divisor the facts make 0 for every binding, an int64 overflow.)
  /// e with each floordiv, mod, min and max that the facts decide replaced (min(s0, 16) -> 16 when s0 >= 16,
  /// mod(s0, 8) -> 0 when 8 divides s0, floordiv(s0, 64) -> 0 when s0 < 64), and any atom of constant bounds
  /// folded.
  Expr simplify(const Expr& e) const;

  /// Whether a binding satisfies the facts (every declared symbol bound, in range, divisible).
  bool allows(const Bindings& bindings) const;

 private:
  struct SymbolFacts {
    std::string name;
    Range range = {};
    int64_t divisor = 1;
  };
  // Replaces each symbol known to be a multiple of d > 1 by d * t, t a symbol of id -1 - id.
  Expr expand_divisors(const Expr& e) const;
  Range symbol_range(SymbolId id) const;
  Range bounds_of_expanded(const Expr& e) const;

  std::map<SymbolId, SymbolFacts> symbols_;
  SymbolId next_id_ = 0;

#ifdef KILN_SYM_HAVE_JSON
  friend void to_json(nlohmann::json& j, const SizeFacts& facts);
  friend void from_json(const nlohmann::json& j, SizeFacts& facts);
#endif
};

/// Bounds of e from its own structure alone (every symbol unconstrained): what the canonical form uses.
Range bounds(const Expr& e);

#ifdef KILN_SYM_HAVE_JSON
/// {"symbols": [{"id", "name", "lo", "hi", "divisor"}, ...]}, infinite ends as null (sym_text.cpp).
void to_json(nlohmann::json& j, const SizeFacts& facts);
void from_json(const nlohmann::json& j, SizeFacts& facts);
#endif

}  // namespace kiln::graph::sym
