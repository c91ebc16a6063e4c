#pragma once
// Symbolic sizes: integer expressions over size symbols (s0, s1, ...), kiln's small replacement for sympy.
//
// An Expr is an immutable value over int64 with Python's integer semantics (floordiv rounds towards minus
// infinity, mod takes the divisor's sign). Every constructor returns the canonical form, so expressions that the
// rules below can show equal are equal structurally: operator== and hash() need no solver.
//
// The canonical form is a sum of monomials with nonzero integer coefficients plus a constant. A monomial is a
// product of atoms raised to positive powers; an atom is a symbol, or a floordiv, mod, min or max node whose
// arguments are canonical themselves. Terms, factors and min/max arguments are kept in one fixed structural order.
//
// Rules applied by the constructors (k a positive constant):
//   constants fold, like terms combine, products expand over sums;
//   floordiv(q*k + r, k) -> q + floordiv(r, k) and mod(q*k + r, k) -> mod(r, k), for any polynomial q:
//     so x*k // k -> x, (a*k + b*k) // k -> a + b, x*k % k -> 0, and the coefficients left in r lie in [0, k);
//   a common factor g of r and k cancels: floordiv(g*r, g*k) -> floordiv(r, k), mod(g*r, g*k) -> g*mod(r, k);
//   floordiv(x, 1) -> x, mod(x, 1) -> 0, a negative constant divisor turns positive;
//   floordiv(floordiv(x, a), b) -> floordiv(x, a*b) and mod(mod(x, a), b) -> mod(x, b) when b divides a;
//   floordiv/mod whose dividend has constant bounds over one period of k fold (mod(x, 4) // 4 -> 0);
//   min/max: nested ones flatten, constants fold, duplicates go, and an argument that differs from another by
//   something of known sign goes (min(s0, s0 + 1) -> s0).
// Facts about symbols (ranges, divisibility) are not used here: SizeFacts (graph/sym_facts.h) proves with them.
//
// Torch-free and Python-free: graph/ builds symbolic meta with it; code generators render it with to_c.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#if __has_include(<nlohmann/json_fwd.hpp>)
#include <nlohmann/json_fwd.hpp>
#define KILN_SYM_HAVE_JSON 1
#endif

namespace kiln::graph::sym {

/// Identifies a symbol. User symbols have ids >= 0; SizeFacts keeps negative ids for its own use.
using SymbolId = int32_t;

/// The node kinds. The order is the structural order of atoms (constants last, so min(s0, 16) reads naturally).
enum class ExprKind : uint8_t { kSymbol, kSum, kFloorDiv, kMod, kMin, kMax, kConstant };

class Expr;
class SizeFacts;

/// A symbol's value for evaluate().
using Bindings = std::unordered_map<SymbolId, int64_t>;
/// What substitute() puts in place of each symbol.
using Substitution = std::unordered_map<SymbolId, Expr>;

/// An immutable, cheap to copy (one shared pointer) canonical expression.
class Expr {
 public:
  /// The constant 0.
  Expr();
  /// A constant; implicit so that int64 values mix with expressions in +, -, *, ==.
  Expr(int64_t value);  // NOLINT(google-explicit-constructor)
  /// The symbol `id`, printed as `name`. Two symbols are the same when both id and name agree.
  static Expr symbol(SymbolId id, std::string name);

  ExprKind kind() const;
  bool is_constant() const { return kind() == ExprKind::kConstant; }
  bool is_symbol() const { return kind() == ExprKind::kSymbol; }
  /// The value of a constant; throws kiln::Error (internal) on any other kind.
  int64_t constant_value() const;
  /// The id and name of a symbol; throws on any other kind.
  SymbolId symbol_id() const;
  const std::string& symbol_name() const;

  /// One factor of a monomial: atom**exponent, exponent >= 1.
  struct Factor;
  /// coefficient * the product of the factors; coefficient != 0, at least one factor.
  struct Term;
  /// A kSum's terms in canonical order and its constant (empty and 0 for other kinds).
  const std::vector<Term>& terms() const;
  int64_t sum_constant() const;
  /// The arguments of floordiv/mod (dividend, divisor) and of min/max (two or more, canonical order).
  const std::vector<Expr>& args() const;

  /// Structural hash, stable within a process (not meant for disk: store to_json instead).
  size_t hash() const;
  /// Readable form: `s0*4 + 2`, `floordiv(s1, 2)`, `min(s0, 16)`, `s0**2`.
  std::string to_string() const;  // (sym_text.cpp)
  /// The value for the given symbol values. Throws kiln::Error naming the symbol when one is unbound, and on
  /// division by zero or int64 overflow.
  int64_t evaluate(const Bindings& bindings) const;
  /// This expression with each mapped symbol replaced, canonicalised again.
  Expr substitute(const Substitution& replacements) const;
  /// The distinct symbols, ordered by id.
  std::vector<Expr> free_symbols() const;

  friend bool operator==(const Expr& a, const Expr& b);
  friend bool operator!=(const Expr& a, const Expr& b) { return !(a == b); }
  /// A total structural order (negative, 0, positive); the canonical form sorts by it.
  friend int compare(const Expr& a, const Expr& b);

  struct Node;

 private:
  explicit Expr(std::shared_ptr<const Node> node) : node_(std::move(node)) {}
  friend struct Build;
  std::shared_ptr<const Node> node_;
};

struct Expr::Factor {
  Expr atom;
  int64_t exponent;
};

struct Expr::Term {
  int64_t coefficient;
  std::vector<Factor> factors;
};

Expr operator+(const Expr& a, const Expr& b);
Expr operator-(const Expr& a, const Expr& b);
Expr operator*(const Expr& a, const Expr& b);
Expr operator-(const Expr& a);
/// Python's a // b: rounds towards minus infinity. Throws kiln::Error when b is the constant 0.
Expr floordiv(const Expr& a, const Expr& b);
/// Python's a % b: a - b * (a // b), so the result has b's sign. Throws kiln::Error when b is the constant 0.
Expr mod(const Expr& a, const Expr& b);
Expr min(const Expr& a, const Expr& b);
Expr max(const Expr& a, const Expr& b);
/// min/max of one or more expressions.
Expr min(const std::vector<Expr>& args);
Expr max(const std::vector<Expr>& args);

/// e rebuilt bottom-up through the constructors, `rewrite` applied to each symbol of e and to each floordiv, mod,
/// min and max once its arguments are rebuilt, if the constructor still made one of the same kind of them (a
/// symbol the constructor returns, as floordiv(s1*2, 2) -> s1, is not rewritten twice). substitute() and
/// SizeFacts::simplify() are this with different rewrites.
Expr rewrite_atoms(const Expr& e, const std::function<Expr(const Expr& atom)>& rewrite);

/// Python's // and % on int64 (b != 0; the one overflowing case, INT64_MIN // -1, throws kiln::Error).
int64_t int_floordiv(int64_t a, int64_t b);
int64_t int_mod(int64_t a, int64_t b);

/// How to_c names a symbol in the generated code (by default its own name).
using SymbolNamer = std::function<std::string(const Expr& symbol)>;

/// A C, C++ and CUDA int64 expression (sym_text.cpp). Sums and products use the operators; floordiv, mod, min and
/// max are calls of kiln_floordiv(a, b), kiln_mod(a, b), kiln_min(a, b) and kiln_max(a, b) (min/max of more
/// arguments nest), which each code emitter defines with Python's semantics on int64_t. A floordiv or mod by a
/// positive constant whose dividend is provably >= 0 (by `facts` when given, else by the expression alone)
/// becomes plain / or %, which agree with Python there. Constants outside int32 carry the LL suffix.
std::string to_c(const Expr& e, const SymbolNamer& name_symbol = nullptr, const SizeFacts* facts = nullptr);

/// The readable form back (sym_text.cpp): sums, products, unary minus, parentheses, `**` with a constant power,
/// `//` and `%` (binding as `*` does), and the calls floordiv, mod, min and max; names are looked up in `symbols`.
/// Throws kiln::Error (a user error) naming the text on anything else.
Expr parse_expr(const std::string& text, const std::map<std::string, Expr>& symbols);

#ifdef KILN_SYM_HAVE_JSON
/// JSON for the disk cache (sym_text.cpp; nlohmann's ADL hooks, so std::vector<Expr> converts as well).
/// A constant is a JSON integer; a symbol {"symbol": id, "name": name}; a sum {"sum": [[coefficient,
/// [[atom, exponent], ...]], ...], "constant": c}; the others {"floordiv"|"mod"|"min"|"max": [args...]}.
/// from_json rebuilds through the constructors, so what it reads is canonical again (and equal to what was
/// written); malformed JSON throws kiln::Error.
void to_json(nlohmann::json& j, const Expr& e);
void from_json(const nlohmann::json& j, Expr& e);
#endif

}  // namespace kiln::graph::sym

template <>
struct std::hash<kiln::graph::sym::Expr> {
  size_t operator()(const kiln::graph::sym::Expr& e) const { return e.hash(); }
};
