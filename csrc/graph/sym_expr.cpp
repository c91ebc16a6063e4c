// The canonical form of symbolic size expressions (graph/sym_expr.h): construction, simplification, evaluation.
//
// Every expression is, or converts to, a Poly (constant + sorted terms). Sums and products are computed on Polys
// and turned back into the simplest Expr; floordiv, mod, min and max canonicalise their arguments' Polys and
// otherwise become atoms. Canonical order is structural (compare()), never by pointer, so printing, hashing and
// JSON do not depend on allocation order.
#include "graph/sym_expr.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <utility>

#include "common/error.h"
#include "graph/sym_facts.h"

namespace kiln::graph::sym {

struct Expr::Node {
  ExprKind kind;
  int64_t value = 0;            // kConstant: the value; kSymbol: the id; kSum: the constant term
  std::string name;             // kSymbol
  std::vector<Expr::Term> terms;  // kSum
  std::vector<Expr> args;       // kFloorDiv, kMod (dividend, divisor); kMin, kMax (two or more)
  size_t hash = 0;
};

namespace {

using Term = Expr::Term;
using Wide = __int128;
using Factor = Expr::Factor;

// ---- checked int64 arithmetic: overflow is the user's sizes being out of range, not a kiln bug ----

int64_t add_checked(int64_t a, int64_t b) {
  int64_t r;
  KILN_CHECK(!__builtin_add_overflow(a, b, &r)) << "symbolic size arithmetic overflows int64: " << a << " + " << b;
  return r;
}

int64_t mul_checked(int64_t a, int64_t b) {
  int64_t r;
  KILN_CHECK(!__builtin_mul_overflow(a, b, &r)) << "symbolic size arithmetic overflows int64: " << a << " * " << b;
  return r;
}

size_t mix(size_t h, size_t v) { return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2)); }

int compare_int(int64_t a, int64_t b) { return a < b ? -1 : (a > b ? 1 : 0); }

// Monomials order lexicographically by (atom, exponent), a prefix first.
int compare_factors(const std::vector<Factor>& a, const std::vector<Factor>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (int c = compare(a[i].atom, b[i].atom)) return c;
    if (int c = compare_int(a[i].exponent, b[i].exponent)) return c;
  }
  return compare_int(static_cast<int64_t>(a.size()), static_cast<int64_t>(b.size()));
}

// A polynomial under construction: terms sorted by factors, coefficients nonzero.
struct Poly {
  int64_t constant = 0;
  std::vector<Term> terms;
};

// Sorts terms and combines those with equal monomials, dropping zero coefficients.
std::vector<Term> normalise_terms(std::vector<Term> terms) {
  std::sort(terms.begin(), terms.end(),
            [](const Term& a, const Term& b) { return compare_factors(a.factors, b.factors) < 0; });
  std::vector<Term> out;
  for (Term& t : terms) {
    if (!out.empty() && compare_factors(out.back().factors, t.factors) == 0)
      out.back().coefficient = add_checked(out.back().coefficient, t.coefficient);
    else
      out.push_back(std::move(t));
    if (out.back().coefficient == 0) out.pop_back();
  }
  return out;
}

// The product of two monomials: the sorted merge of their factors, equal atoms adding exponents.
std::vector<Factor> multiply_factors(const std::vector<Factor>& a, const std::vector<Factor>& b) {
  std::vector<Factor> out;
  size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    int c = i == a.size() ? 1 : (j == b.size() ? -1 : compare(a[i].atom, b[j].atom));
    if (c < 0) {
      out.push_back(a[i++]);
    } else if (c > 0) {
      out.push_back(b[j++]);
    } else {
      out.push_back({a[i].atom, add_checked(a[i].exponent, b[j].exponent)});
      ++i, ++j;
    }
  }
  return out;
}

Poly add_polys(const Poly& a, const Poly& b, int64_t b_scale) {
  Poly out;
  out.constant = add_checked(a.constant, mul_checked(b.constant, b_scale));
  std::vector<Term> terms = a.terms;
  for (const Term& t : b.terms) terms.push_back({mul_checked(t.coefficient, b_scale), t.factors});
  out.terms = normalise_terms(std::move(terms));
  return out;
}

Poly multiply_polys(const Poly& a, const Poly& b) {
  Poly out;
  out.constant = mul_checked(a.constant, b.constant);
  std::vector<Term> terms;
  for (const Term& t : a.terms)
    if (b.constant != 0) terms.push_back({mul_checked(t.coefficient, b.constant), t.factors});
  for (const Term& t : b.terms)
    if (a.constant != 0) terms.push_back({mul_checked(t.coefficient, a.constant), t.factors});
  for (const Term& x : a.terms)
    for (const Term& y : b.terms)
      terms.push_back({mul_checked(x.coefficient, y.coefficient), multiply_factors(x.factors, y.factors)});
  out.terms = normalise_terms(std::move(terms));
  return out;
}

// The gcd of k and every coefficient and the constant of p (k > 0, so the result is >= 1).
int64_t content_gcd(const Poly& p, int64_t k) {
  int64_t g = std::gcd(k, p.constant);
  for (const Term& t : p.terms) g = std::gcd(g, t.coefficient);
  return g;
}

Poly divide_exact(Poly p, int64_t g) {
  p.constant /= g;
  for (Term& t : p.terms) t.coefficient /= g;
  return p;
}

// Splits p into q * k + r with every coefficient of r in [0, k).
std::pair<Poly, Poly> split_by(const Poly& p, int64_t k) {
  Poly q, r;
  q.constant = int_floordiv(p.constant, k);
  r.constant = int_mod(p.constant, k);
  for (const Term& t : p.terms) {
    if (int64_t c = int_floordiv(t.coefficient, k)) q.terms.push_back({c, t.factors});
    if (int64_t c = int_mod(t.coefficient, k)) r.terms.push_back({c, t.factors});
  }
  return {std::move(q), std::move(r)};
}

bool is_positive_constant(const Expr& e) { return e.is_constant() && e.constant_value() > 0; }

// floor(v / k) for finite bounds, as the period index the range-fold rules compare.
bool within_one_period(const Range& r, int64_t k, int64_t* period) {
  if (r.lo == Range::kNegInf || r.hi == Range::kPosInf) return false;
  *period = int_floordiv(r.lo, k);
  return *period == int_floordiv(r.hi, k);
}

}  // namespace

// Builds nodes; the only code that sees Expr's private constructor.
struct Build {
  static Expr make(Expr::Node node) {
    size_t h = mix(static_cast<size_t>(node.kind), std::hash<int64_t>()(node.value));
    if (node.kind == ExprKind::kSymbol) h = mix(h, std::hash<std::string>()(node.name));
    for (const Term& t : node.terms) {
      h = mix(h, std::hash<int64_t>()(t.coefficient));
      for (const Factor& f : t.factors) h = mix(mix(h, f.atom.hash()), std::hash<int64_t>()(f.exponent));
    }
    for (const Expr& a : node.args) h = mix(h, a.hash());
    node.hash = h;
    return Expr(std::make_shared<const Expr::Node>(std::move(node)));
  }
  static Expr atom(ExprKind kind, std::vector<Expr> args) {
    Expr::Node n{kind};
    n.args = std::move(args);
    return make(std::move(n));
  }
  static const Expr::Node& node(const Expr& e) { return *e.node_; }

  static Poly to_poly(const Expr& e) {
    Poly p;
    switch (e.kind()) {
      case ExprKind::kConstant: p.constant = e.constant_value(); break;
      case ExprKind::kSum: p.constant = e.node_->value, p.terms = e.node_->terms; break;
      default: p.terms.push_back({1, {{e, 1}}});
    }
    return p;
  }

  // The simplest Expr for p: a constant, a lone atom, or a sum node.
  static Expr from_poly(Poly p) {
    if (p.terms.empty()) return Expr(p.constant);
    if (p.constant == 0 && p.terms.size() == 1 && p.terms[0].coefficient == 1 && p.terms[0].factors.size() == 1 &&
        p.terms[0].factors[0].exponent == 1)
      return p.terms[0].factors[0].atom;
    Expr::Node n{ExprKind::kSum};
    n.value = p.constant;
    n.terms = std::move(p.terms);
    return make(std::move(n));
  }
};

namespace {

// r split as g*u + delta, where g > 1 divides k and every coefficient of r's terms of unbounded value, and delta,
// the rest of r minus a multiple of g that u absorbs, lies in [0, g). Then
//   floordiv(r, k) == floordiv(u, k/g)  and  mod(r, k) == g*mod(u, k/g) + delta
// (g*u <= r < g*u + g). So floordiv(s0*3 + 7, 12) -> floordiv(s0 + 2, 4), floordiv(s0*2 + mod(s1, 2), 4) ->
// floordiv(s0, 2).
struct SmallPart {
  int64_t g = 1;
  Poly u;
  Expr delta;
};

std::optional<SmallPart> split_small_part(const Poly& r, int64_t k) {
  Poly big, small;
  small.constant = r.constant;
  int64_t g = k;
  for (const Term& t : r.terms) {
    Range b = bounds(Build::from_poly(Poly{0, {t}}));
    if (b.lo != Range::kNegInf && b.hi != Range::kPosInf) {
      small.terms.push_back(t);
    } else {
      big.terms.push_back(t);
      g = std::gcd(g, t.coefficient);
    }
  }
  int64_t period;
  if (g == 1 || big.terms.empty()) return std::nullopt;
  Expr small_part = Build::from_poly(std::move(small));
  if (!within_one_period(bounds(small_part), g, &period)) return std::nullopt;
  return SmallPart{g, add_polys(divide_exact(std::move(big), g), Poly{period, {}}, 1), small_part - period * g};
}

// floordiv(r, k) where r's coefficients lie in [0, k), k > 0.
Expr floordiv_remainder(Poly r, int64_t k) {
  if (r.terms.empty()) return int_floordiv(r.constant, k);
  int64_t g = content_gcd(r, k);
  r = divide_exact(std::move(r), g);
  k /= g;
  if (auto part = split_small_part(r, k)) return floordiv(Build::from_poly(std::move(part->u)), k / part->g);
  // p + floordiv(y, c) == floordiv(p*c + y, c) for c > 0, so an inner floordiv term joins the outer one:
  // floordiv(p + floordiv(y, c), k) -> floordiv(p*c + y, c*k). Only for a polynomial p (symbols alone), so that
  // the choice of the term to join is unique and p's own atoms are not multiplied into the dividend.
  int atom_terms = 0;
  for (const Term& t : r.terms)
    atom_terms += std::any_of(t.factors.begin(), t.factors.end(), [](const Factor& f) { return !f.atom.is_symbol(); });
  for (size_t i = 0; i < r.terms.size() && atom_terms == 1; ++i) {
    const Term& t = r.terms[i];
    const Expr& inner = t.factors[0].atom;
    if (t.coefficient != 1 || t.factors.size() != 1 || t.factors[0].exponent != 1 ||
        inner.kind() != ExprKind::kFloorDiv || !is_positive_constant(inner.args()[1]))
      continue;
    int64_t c = inner.args()[1].constant_value(), outer;
    if (__builtin_mul_overflow(c, k, &outer)) continue;
    Expr y = inner.args()[0];
    Poly p = r;
    p.terms.erase(p.terms.begin() + static_cast<std::ptrdiff_t>(i));
    return floordiv(Build::from_poly(std::move(p)) * c + y, outer);
  }
  Expr x = Build::from_poly(std::move(r));
  int64_t period;
  if (within_one_period(bounds(x), k, &period)) return period;
  return Build::atom(ExprKind::kFloorDiv, {x, k});
}

// mod(r, k) where r's coefficients lie in [0, k), k > 0.
Expr mod_remainder(Poly r, int64_t k) {
  if (r.terms.empty()) return int_mod(r.constant, k);
  int64_t g = content_gcd(r, k);
  if (g > 1) return g * mod_remainder(divide_exact(std::move(r), g), k / g);
  if (auto part = split_small_part(r, k))
    return part->g * mod(Build::from_poly(std::move(part->u)), k / part->g) + part->delta;
  // mod(y, c) == y - c*floordiv(y, c): when k divides a*c, a term a*mod(y, c) counts as a*y modulo k.
  Poly unwrapped;
  bool changed = false;
  unwrapped.constant = r.constant;
  for (const Term& t : r.terms) {
    const Expr& inner = t.factors[0].atom;
    if (t.factors.size() == 1 && t.factors[0].exponent == 1 && inner.kind() == ExprKind::kMod &&
        is_positive_constant(inner.args()[1]) && Wide(t.coefficient) * inner.args()[1].constant_value() % k == 0) {
      unwrapped = add_polys(unwrapped, Build::to_poly(inner.args()[0]), t.coefficient);
      changed = true;
    } else {
      unwrapped = add_polys(unwrapped, Poly{0, {t}}, 1);
    }
  }
  if (changed) return mod(Build::from_poly(std::move(unwrapped)), k);
  Expr x = Build::from_poly(std::move(r));
  int64_t period;
  if (within_one_period(bounds(x), k, &period)) return x - mul_checked(period, k);
  return Build::atom(ExprKind::kMod, {x, k});
}

Expr min_or_max(ExprKind kind, const std::vector<Expr>& in) {
  KILN_ASSERT(!in.empty());
  bool is_min = kind == ExprKind::kMin;
  std::vector<Expr> args;
  std::optional<int64_t> constant;
  for (const Expr& a : in) {
    for (const Expr& b : a.kind() == kind ? a.args() : std::vector<Expr>{a}) {
      if (!b.is_constant()) {
        args.push_back(b);
        continue;
      }
      int64_t v = b.constant_value();
      constant = !constant ? v : (is_min ? std::min(*constant, v) : std::max(*constant, v));
    }
  }
  if (constant) args.push_back(*constant);
  std::sort(args.begin(), args.end(), [](const Expr& a, const Expr& b) { return compare(a, b) < 0; });
  args.erase(std::unique(args.begin(), args.end()), args.end());
  // Drops each argument that another one bounds on the kept side (for min: one that is provably >= another).
  std::vector<Expr> kept;
  for (const Expr& a : args) {
    bool redundant = false;
    for (size_t i = 0; i < kept.size() && !redundant;) {
      Range d = bounds(is_min ? a - kept[i] : kept[i] - a);  // >= 0: a is redundant; <= 0: kept[i] is
      if (d.lo != Range::kNegInf && d.lo >= 0)
        redundant = true;
      else if (d.hi != Range::kPosInf && d.hi <= 0)
        kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
      else
        ++i;
    }
    if (!redundant) kept.push_back(a);
  }
  if (kept.size() == 1) return kept[0];
  return Build::atom(kind, std::move(kept));
}

}  // namespace

// ---- Expr ----

Expr::Expr() : Expr(int64_t{0}) {}

Expr::Expr(int64_t value) {
  Node n{ExprKind::kConstant};
  n.value = value;
  *this = Build::make(std::move(n));
}

Expr Expr::symbol(SymbolId id, std::string name) {
  KILN_CHECK(!name.empty()) << "a size symbol needs a name (id " << id << ")";
  Node n{ExprKind::kSymbol};
  n.value = id;
  n.name = std::move(name);
  return Build::make(std::move(n));
}

ExprKind Expr::kind() const { return node_->kind; }

int64_t Expr::constant_value() const {
  KILN_ASSERT(is_constant()) << to_string() << " is not a constant";
  return node_->value;
}

SymbolId Expr::symbol_id() const {
  KILN_ASSERT(is_symbol()) << to_string() << " is not a symbol";
  return static_cast<SymbolId>(node_->value);
}

const std::string& Expr::symbol_name() const {
  KILN_ASSERT(is_symbol()) << to_string() << " is not a symbol";
  return node_->name;
}

const std::vector<Expr::Term>& Expr::terms() const { return node_->terms; }
int64_t Expr::sum_constant() const { return kind() == ExprKind::kSum ? node_->value : 0; }
const std::vector<Expr>& Expr::args() const { return node_->args; }
size_t Expr::hash() const { return node_->hash; }

bool operator==(const Expr& a, const Expr& b) {
  return a.node_ == b.node_ || (a.hash() == b.hash() && compare(a, b) == 0);
}

int compare(const Expr& a, const Expr& b) {
  if (a.node_ == b.node_) return 0;
  const Expr::Node& x = *a.node_;
  const Expr::Node& y = *b.node_;
  if (x.kind != y.kind) return x.kind < y.kind ? -1 : 1;
  if (x.kind == ExprKind::kSymbol && x.value == y.value) return x.name.compare(y.name);
  if (x.kind != ExprKind::kSum)
    if (int c = compare_int(x.value, y.value)) return c;
  for (size_t i = 0; i < x.terms.size() && i < y.terms.size(); ++i) {
    if (int c = compare_factors(x.terms[i].factors, y.terms[i].factors)) return c;
    if (int c = compare_int(x.terms[i].coefficient, y.terms[i].coefficient)) return c;
  }
  if (x.terms.size() != y.terms.size()) return x.terms.size() < y.terms.size() ? -1 : 1;
  if (x.kind == ExprKind::kSum) return compare_int(x.value, y.value);
  for (size_t i = 0; i < x.args.size() && i < y.args.size(); ++i)
    if (int c = compare(x.args[i], y.args[i])) return c;
  return compare_int(static_cast<int64_t>(x.args.size()), static_cast<int64_t>(y.args.size()));
}

// ---- arithmetic ----

Expr operator+(const Expr& a, const Expr& b) {
  if (a.is_constant() && b.is_constant()) return add_checked(a.constant_value(), b.constant_value());
  return Build::from_poly(add_polys(Build::to_poly(a), Build::to_poly(b), 1));
}

Expr operator-(const Expr& a, const Expr& b) {
  if (a.is_constant() && b.is_constant()) return add_checked(a.constant_value(), mul_checked(b.constant_value(), -1));
  return Build::from_poly(add_polys(Build::to_poly(a), Build::to_poly(b), -1));
}

Expr operator-(const Expr& a) { return Expr(0) - a; }

Expr operator*(const Expr& a, const Expr& b) {
  if (a.is_constant() && b.is_constant()) return mul_checked(a.constant_value(), b.constant_value());
  return Build::from_poly(multiply_polys(Build::to_poly(a), Build::to_poly(b)));
}

int64_t int_floordiv(int64_t a, int64_t b) {
  KILN_CHECK(b != 0) << "integer division by zero in a symbolic size: " << a << " // 0";
  KILN_CHECK(!(a == Range::kNegInf && b == -1)) << "symbolic size arithmetic overflows int64: " << a << " // -1";
  int64_t q = a / b;
  if (a % b != 0 && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t int_mod(int64_t a, int64_t b) {
  KILN_CHECK(b != 0) << "integer modulo by zero in a symbolic size: " << a << " % 0";
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

Expr floordiv(const Expr& a, const Expr& b) {
  if (b.is_constant()) {
    int64_t k = b.constant_value();
    KILN_CHECK(k != 0) << "symbolic size divided by zero: floordiv(" << a.to_string() << ", 0)";
    if (a.is_constant()) return int_floordiv(a.constant_value(), k);
    if (k < 0) return floordiv(-a, mul_checked(k, -1));  // a // k == (-a) // (-k)
    auto [q, r] = split_by(Build::to_poly(a), k);
    return Build::from_poly(std::move(q)) + floordiv_remainder(std::move(r), k);
  }
  // b is nonzero wherever the result is defined.
  if (a == Expr(0)) return 0;
  if (a == b) return 1;
  return Build::atom(ExprKind::kFloorDiv, {a, b});
}

Expr mod(const Expr& a, const Expr& b) {
  if (b.is_constant()) {
    int64_t k = b.constant_value();
    KILN_CHECK(k != 0) << "symbolic size taken modulo zero: mod(" << a.to_string() << ", 0)";
    if (a.is_constant()) return int_mod(a.constant_value(), k);
    if (k < 0) return -mod(-a, mul_checked(k, -1));  // a % k == -((-a) % (-k))
    return mod_remainder(split_by(Build::to_poly(a), k).second, k);
  }
  if (a == Expr(0) || a == b) return 0;
  return Build::atom(ExprKind::kMod, {a, b});
}

Expr min(const Expr& a, const Expr& b) { return min_or_max(ExprKind::kMin, {a, b}); }
Expr max(const Expr& a, const Expr& b) { return min_or_max(ExprKind::kMax, {a, b}); }
Expr min(const std::vector<Expr>& args) { return min_or_max(ExprKind::kMin, args); }
Expr max(const std::vector<Expr>& args) { return min_or_max(ExprKind::kMax, args); }

// ---- evaluation and rewriting ----

namespace {

int64_t power_checked(int64_t base, int64_t exponent) {
  int64_t r = 1;
  for (int64_t i = 0; i < exponent; ++i) r = mul_checked(r, base);
  return r;
}

}  // namespace

int64_t Expr::evaluate(const Bindings& bindings) const {
  switch (kind()) {
    case ExprKind::kConstant: return node_->value;
    case ExprKind::kSymbol: {
      auto it = bindings.find(symbol_id());
      KILN_CHECK(it != bindings.end()) << "size symbol " << node_->name << " (id " << node_->value
                                       << ") has no value: bind every symbol that free_symbols() lists";
      return it->second;
    }
    case ExprKind::kSum: {
      int64_t total = node_->value;
      for (const Term& t : node_->terms) {
        int64_t product = t.coefficient;
        for (const Factor& f : t.factors)
          product = mul_checked(product, power_checked(f.atom.evaluate(bindings), f.exponent));
        total = add_checked(total, product);
      }
      return total;
    }
    case ExprKind::kFloorDiv: return int_floordiv(args()[0].evaluate(bindings), args()[1].evaluate(bindings));
    case ExprKind::kMod: return int_mod(args()[0].evaluate(bindings), args()[1].evaluate(bindings));
    case ExprKind::kMin:
    case ExprKind::kMax: {
      int64_t best = args()[0].evaluate(bindings);
      for (size_t i = 1; i < args().size(); ++i) {
        int64_t v = args()[i].evaluate(bindings);
        best = kind() == ExprKind::kMin ? std::min(best, v) : std::max(best, v);
      }
      return best;
    }
  }
  KILN_ASSERT(false) << "unknown expression kind " << static_cast<int>(kind());
}

Expr rewrite_atoms(const Expr& e, const std::function<Expr(const Expr& atom)>& rewrite) {
  // What the constructors make of the rebuilt arguments is rewritten only while it is still such an atom: a
  // symbol they return (floordiv(s1*2, 2) -> s1) was rewritten already, as a leaf.
  auto rewrite_rebuilt = [&](const Expr& rebuilt) { return rebuilt.kind() == e.kind() ? rewrite(rebuilt) : rebuilt; };
  switch (e.kind()) {
    case ExprKind::kConstant: return e;
    case ExprKind::kSymbol: return rewrite(e);
    case ExprKind::kSum: {
      Expr total = e.sum_constant();
      for (const Term& t : e.terms()) {
        Expr product = t.coefficient;
        for (const Factor& f : t.factors) {
          Expr atom = rewrite_atoms(f.atom, rewrite);
          for (int64_t i = 0; i < f.exponent; ++i) product = product * atom;
        }
        total = total + product;
      }
      return total;
    }
    case ExprKind::kFloorDiv:
      return rewrite_rebuilt(floordiv(rewrite_atoms(e.args()[0], rewrite), rewrite_atoms(e.args()[1], rewrite)));
    case ExprKind::kMod:
      return rewrite_rebuilt(mod(rewrite_atoms(e.args()[0], rewrite), rewrite_atoms(e.args()[1], rewrite)));
    case ExprKind::kMin:
    case ExprKind::kMax: {
      std::vector<Expr> args;
      for (const Expr& a : e.args()) args.push_back(rewrite_atoms(a, rewrite));
      return rewrite_rebuilt(min_or_max(e.kind(), args));
    }
  }
  KILN_ASSERT(false) << "unknown expression kind " << static_cast<int>(e.kind());
}

Expr Expr::substitute(const Substitution& replacements) const {
  if (replacements.empty()) return *this;
  return rewrite_atoms(*this, [&](const Expr& atom) {
    if (!atom.is_symbol()) return atom;
    auto it = replacements.find(atom.symbol_id());
    return it == replacements.end() ? atom : it->second;
  });
}

namespace {
void collect_symbols(const Expr& e, std::vector<Expr>& out) {
  if (e.is_symbol()) out.push_back(e);
  for (const Term& t : e.terms())
    for (const Factor& f : t.factors) collect_symbols(f.atom, out);
  for (const Expr& a : e.args()) collect_symbols(a, out);
}
}  // namespace

std::vector<Expr> Expr::free_symbols() const {
  std::vector<Expr> out;
  collect_symbols(*this, out);
  std::sort(out.begin(), out.end(), [](const Expr& a, const Expr& b) { return compare(a, b) < 0; });
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace kiln::graph::sym
