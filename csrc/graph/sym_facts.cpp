// Bounds and proofs over symbolic sizes (graph/sym_facts.h).
//
// Interval arithmetic on the canonical form. The int64 extremes stand for the infinities; every finite result is
// computed in 128 bits and widened to an infinity when it leaves int64, which only ever loosens a bound. Values
// whose evaluation would overflow int64 are outside what the prover speaks about (evaluate() throws there).
#include "graph/sym_facts.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <numeric>

#include "common/error.h"

namespace kiln::graph::sym {

namespace {

using Wide = __int128;
constexpr int64_t kNegInf = Range::kNegInf;
constexpr int64_t kPosInf = Range::kPosInf;
constexpr Range kEverything{};

bool is_infinite(int64_t v) { return v == kNegInf || v == kPosInf; }

int64_t widen(Wide v) { return v <= kNegInf ? kNegInf : (v >= kPosInf ? kPosInf : static_cast<int64_t>(v)); }

int64_t negate(int64_t v) { return v == kNegInf ? kPosInf : (v == kPosInf ? kNegInf : -v); }

// The sum of two lower (or two upper) bounds: an infinite one decides.
int64_t add_lo(int64_t a, int64_t b) { return a == kNegInf || b == kNegInf ? kNegInf : widen(Wide(a) + b); }
int64_t add_hi(int64_t a, int64_t b) { return a == kPosInf || b == kPosInf ? kPosInf : widen(Wide(a) + b); }

// A product of bounds; 0 times an infinite bound is 0 because the value behind it is finite.
int64_t multiply(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (is_infinite(a) || is_infinite(b)) return (a < 0) == (b < 0) ? kPosInf : kNegInf;
  return widen(Wide(a) * b);
}

Range multiply(const Range& x, const Range& y) {
  int64_t c[] = {multiply(x.lo, y.lo), multiply(x.lo, y.hi), multiply(x.hi, y.lo), multiply(x.hi, y.hi)};
  return {*std::min_element(c, c + 4), *std::max_element(c, c + 4)};
}

Range power(const Range& x, int64_t exponent) {
  auto raise = [&](int64_t v) {
    int64_t r = 1;
    for (int64_t i = 0; i < exponent; ++i) r = multiply(r, v);
    return r;
  };
  if (exponent % 2 == 1 || x.lo >= 0) return {raise(x.lo), raise(x.hi)};
  if (x.hi <= 0) return {raise(x.hi), raise(x.lo)};
  return {0, std::max(raise(x.lo), raise(x.hi))};  // even power of a range around 0
}

Range hull(const std::optional<Range>& a, const Range& b) {
  return a ? Range{std::min(a->lo, b.lo), std::max(a->hi, b.hi)} : b;
}

// floor(x / y) for y > 0 finite or +inf, x finite or infinite; never both infinite (see floordiv_positive).
int64_t floordiv_bound(int64_t x, int64_t y) {
  if (is_infinite(x)) return x;
  if (y == kPosInf) return x >= 0 ? 0 : -1;
  return int_floordiv(x, y);
}

// Bounds of a // b for b in [b_lo, b_hi], 1 <= b_lo (finite).
Range floordiv_positive(const Range& a, int64_t b_lo, int64_t b_hi) {
  int64_t lo = a.lo >= 0 ? floordiv_bound(a.lo, b_hi) : floordiv_bound(a.lo, b_lo);
  int64_t hi = a.hi >= 0 ? floordiv_bound(a.hi, b_lo) : floordiv_bound(a.hi, b_hi);
  return {lo, hi};
}

Range floordiv_bounds(const Range& a, const Range& b) {
  std::optional<Range> out;
  if (b.hi >= 1) out = floordiv_positive(a, std::max<int64_t>(b.lo, 1), b.hi);
  if (b.lo <= -1)  // a // b == (-a) // (-b)
    out = hull(out, floordiv_positive({negate(a.hi), negate(a.lo)}, std::max<int64_t>(negate(b.hi), 1), negate(b.lo)));
  return out ? *out : kEverything;  // b == 0 everywhere: never defined
}

// Bounds of a % b for b in [b_lo, b_hi], 1 <= b_lo (finite): in [0, b - 1], and a itself when 0 <= a < b_lo.
Range mod_positive(const Range& a, int64_t b_lo, int64_t b_hi) {
  if (a.lo >= 0 && a.hi < b_lo) return a;
  if (b_lo == b_hi && !is_infinite(a.lo) && !is_infinite(a.hi) &&
      int_floordiv(a.lo, b_lo) == int_floordiv(a.hi, b_lo)) {
    Wide shift = Wide(int_floordiv(a.lo, b_lo)) * b_lo;
    return {widen(a.lo - shift), widen(a.hi - shift)};
  }
  int64_t hi = b_hi == kPosInf ? kPosInf : b_hi - 1;
  if (a.lo >= 0) hi = std::min(hi, a.hi);
  return {0, hi};
}

Range mod_bounds(const Range& a, const Range& b) {
  std::optional<Range> out;
  if (b.hi >= 1) out = mod_positive(a, std::max<int64_t>(b.lo, 1), b.hi);
  if (b.lo <= -1) {  // a % b == -((-a) % (-b))
    Range r = mod_positive({negate(a.hi), negate(a.lo)}, std::max<int64_t>(negate(b.hi), 1), negate(b.lo));
    out = hull(out, {negate(r.hi), negate(r.lo)});
  }
  return out ? *out : kEverything;
}

// Interval evaluation of an expression, symbols' ranges from `symbol_range`.
class Bounder {
 public:
  explicit Bounder(std::function<Range(SymbolId)> symbol_range) : symbol_range_(std::move(symbol_range)) {}

  Range of(const Expr& e) {
    switch (e.kind()) {
      case ExprKind::kConstant: return {e.constant_value(), e.constant_value()};
      case ExprKind::kSymbol: return symbol_range_(e.symbol_id());
      case ExprKind::kSum: return of_sum(e);
      case ExprKind::kFloorDiv: return floordiv_bounds(of(e.args()[0]), of(e.args()[1]));
      case ExprKind::kMod: return mod_bounds(of(e.args()[0]), of(e.args()[1]));
      case ExprKind::kMin:
      case ExprKind::kMax: {
        bool is_min = e.kind() == ExprKind::kMin;
        Range r = of(e.args()[0]);
        for (size_t i = 1; i < e.args().size(); ++i) {
          Range a = of(e.args()[i]);
          r = is_min ? Range{std::min(r.lo, a.lo), std::min(r.hi, a.hi)}
                     : Range{std::max(r.lo, a.lo), std::max(r.hi, a.hi)};
        }
        return r;
      }
    }
    KILN_ASSERT(false) << "unknown expression kind " << static_cast<int>(e.kind());
  }

 private:
  Range of_sum(const Expr& e) {
    // rest + min(x, y) == min(rest + x, rest + y) (and -min == max of the negations): moving the sum inside lets
    // rest cancel against the arguments (s0 - min(s0, 16) == max(0, s0 - 16) >= 0). Bounded, as it multiplies work.
    for (size_t i = 0; i < e.terms().size() && distributions_left_ > 0; ++i) {
      const Expr::Term& t = e.terms()[i];
      const Expr& atom = t.factors[0].atom;
      bool is_min_max = atom.kind() == ExprKind::kMin || atom.kind() == ExprKind::kMax;
      if (!is_min_max || t.factors.size() != 1 || t.factors[0].exponent != 1 ||
          (t.coefficient != 1 && t.coefficient != -1))
        continue;
      --distributions_left_;
      Expr rest = e - t.coefficient * atom;
      std::vector<Expr> moved;
      for (const Expr& a : atom.args()) moved.push_back(rest + t.coefficient * a);
      bool is_min = (atom.kind() == ExprKind::kMin) == (t.coefficient == 1);
      return of(is_min ? min(moved) : max(moved));
    }
    // c + x*q bounds tighter than the terms one by one (x*(a + b) lies within x*a + x*b): s0*s1 - s0 is
    // s0*(s1 - 1), >= 0 where s1 >= 1.
    if (std::optional<Expr> x = common_atom(e)) {
      Expr q = 0;
      for (const Expr::Term& t : e.terms()) {
        Expr product = t.coefficient;
        bool divided = false;
        for (const Expr::Factor& f : t.factors)
          for (int64_t i = 0; i < f.exponent; ++i) {
            if (!divided && f.atom == *x) divided = true;
            else product = product * f.atom;
          }
        q = q + product;
      }
      Range xq = multiply(of(*x), of(q));
      return {add_lo(e.sum_constant(), xq.lo), add_hi(e.sum_constant(), xq.hi)};
    }
    Range total{e.sum_constant(), e.sum_constant()};
    for (const Expr::Term& t : e.terms()) {
      Range product{t.coefficient, t.coefficient};
      for (const Expr::Factor& f : t.factors) product = multiply(product, power(of(f.atom), f.exponent));
      total = {add_lo(total.lo, product.lo), add_hi(total.hi, product.hi)};
    }
    return total;
  }

  // An atom that is a factor of every term of a sum of two or more terms.
  static std::optional<Expr> common_atom(const Expr& e) {
    if (e.terms().size() < 2) return std::nullopt;
    for (const Expr::Factor& f : e.terms()[0].factors) {
      bool everywhere = std::all_of(e.terms().begin() + 1, e.terms().end(), [&](const Expr::Term& t) {
        return std::any_of(t.factors.begin(), t.factors.end(), [&](const Expr::Factor& g) { return g.atom == f.atom; });
      });
      if (everywhere) return f.atom;
    }
    return std::nullopt;
  }

  std::function<Range(SymbolId)> symbol_range_;
  int distributions_left_ = 16;
};

Truth truth(bool b) { return b ? Truth::kTrue : Truth::kFalse; }

}  // namespace

const char* truth_name(Truth t) {
  switch (t) {
    case Truth::kTrue: return "true";
    case Truth::kFalse: return "false";
    case Truth::kUnknown: return "unknown";
  }
  return "?";
}

std::string Range::to_string() const {
  std::string out = lo == kNegInf ? "(-inf" : "[";
  if (lo != kNegInf) out += std::to_string(lo);
  out += ", ";
  out += hi == kPosInf ? "inf)" : std::to_string(hi) + "]";
  return out;
}

Range bounds(const Expr& e) {
  return Bounder([](SymbolId) { return kEverything; }).of(e);
}

// ---- SizeFacts ----

Expr SizeFacts::new_symbol(Range range) {
  std::string name = "s";
  name += std::to_string(next_id_);
  Expr s = Expr::symbol(next_id_, std::move(name));
  set_range(s, range);
  return s;
}

void SizeFacts::set_range(const Expr& symbol, Range range) {
  KILN_CHECK(symbol.is_symbol()) << "SizeFacts::set_range takes a symbol, not " << symbol.to_string();
  KILN_CHECK(symbol.symbol_id() >= 0) << "size symbol ids are >= 0 (negative ones are SizeFacts' own): "
                                     << symbol.symbol_id();
  KILN_CHECK(range.lo <= range.hi && range.lo != kPosInf && range.hi != kNegInf)
      << "empty range " << range.to_string() << " for size symbol " << symbol.symbol_name();
  SymbolFacts& f = symbols_[symbol.symbol_id()];
  f.name = symbol.symbol_name();
  f.range = range;
  next_id_ = std::max(next_id_, symbol.symbol_id() + 1);
}

void SizeFacts::add_divisor(const Expr& symbol, int64_t k) {
  KILN_CHECK(k > 0) << "a size symbol's divisor must be positive, not " << k;
  KILN_CHECK(symbol.is_symbol()) << "SizeFacts::add_divisor takes a symbol, not " << symbol.to_string();
  if (!symbols_.count(symbol.symbol_id())) set_range(symbol, kEverything);
  SymbolFacts& f = symbols_.at(symbol.symbol_id());
  f.divisor = std::lcm(f.divisor, k);
}

Range SizeFacts::range(SymbolId id) const {
  auto it = symbols_.find(id);
  return it == symbols_.end() ? kEverything : it->second.range;
}

int64_t SizeFacts::divisor(SymbolId id) const {
  auto it = symbols_.find(id);
  return it == symbols_.end() ? 1 : it->second.divisor;
}

Range SizeFacts::symbol_range(SymbolId id) const {
  if (id >= 0) return range(id);
  // t of s == d * t: s's range divided by d, rounded inwards.
  SymbolId original = -1 - id;
  Range r = range(original);
  int64_t d = divisor(original);
  int64_t lo = r.lo == kNegInf ? kNegInf : -int_floordiv(-r.lo, d);
  int64_t hi = r.hi == kPosInf ? kPosInf : int_floordiv(r.hi, d);
  return {lo, hi};
}

Expr SizeFacts::expand_divisors(const Expr& e) const {
  Substitution multiples;
  for (const Expr& s : e.free_symbols()) {
    // Negative ids are the t's below; a caller's symbol with one would be read as one of them (the queries then
    // answer unknown).
    KILN_CHECK(s.symbol_id() >= 0) << "size symbol ids are >= 0, not " << s.symbol_id() << " (" << s.symbol_name()
                                   << ")";
    int64_t d = divisor(s.symbol_id());
    if (d > 1)
      multiples[s.symbol_id()] = d * Expr::symbol(-1 - s.symbol_id(), s.symbol_name() + "/" + std::to_string(d));
  }
  return e.substitute(multiples);
}

Range SizeFacts::bounds_of_expanded(const Expr& e) const {
  return Bounder([this](SymbolId id) { return symbol_range(id); }).of(e);
}

namespace {
// Building the expressions a query looks at can fail (a divisor the facts make 0 everywhere, an int64 overflow):
// the query then knows nothing.
template <typename Query, typename Answer>
Answer or_unknown(const Query& query, Answer unknown) {
  try {
    return query();
  } catch (const kiln::Error&) {
    return unknown;
  }
}
}  // namespace

Range SizeFacts::bounds(const Expr& e) const {
  return or_unknown([&] { return bounds_of_expanded(expand_divisors(e)); }, kEverything);
}

Truth SizeFacts::prove_le(const Expr& a, const Expr& b) const {
  return or_unknown(
      [&] {
        Range d = bounds_of_expanded(expand_divisors(b - a));
        if (d.lo != kNegInf && d.lo >= 0) return Truth::kTrue;
        if (d.hi != kPosInf && d.hi < 0) return Truth::kFalse;
        return Truth::kUnknown;
      },
      Truth::kUnknown);
}

Truth SizeFacts::prove_lt(const Expr& a, const Expr& b) const {
  return or_unknown([&] { return prove_le(a + 1, b); }, Truth::kUnknown);
}

Truth SizeFacts::prove_nonneg(const Expr& a) const { return prove_le(0, a); }

Truth SizeFacts::prove_eq(const Expr& a, const Expr& b) const {
  return or_unknown(
      [&] {
        Expr d = expand_divisors(a - b);
        if (d.is_constant()) return truth(d.constant_value() == 0);
        // Integer monomials: when g divides every coefficient but not the constant, d is never 0.
        int64_t g = 0;
        for (const Expr::Term& t : d.terms()) g = std::gcd(g, t.coefficient);
        if (g > 1 && d.sum_constant() % g != 0) return Truth::kFalse;
        Range r = bounds_of_expanded(d);
        if ((r.lo != kNegInf && r.lo > 0) || (r.hi != kPosInf && r.hi < 0)) return Truth::kFalse;
        if (r.lo == 0 && r.hi == 0) return Truth::kTrue;
        return Truth::kUnknown;
      },
      Truth::kUnknown);
}

Truth SizeFacts::prove_divisible(const Expr& a, int64_t k) const {
  KILN_CHECK(k != 0) << "prove_divisible(" << a.to_string() << ", 0): divisibility by zero";
  if (k == 1 || k == -1) return Truth::kTrue;
  return or_unknown(
      [&] {
        Expr remainder = mod(expand_divisors(a), k < 0 ? -k : k);
        if (remainder.is_constant()) return truth(remainder.constant_value() == 0);
        Range r = bounds_of_expanded(remainder);
        if (r.lo >= 1) return Truth::kFalse;
        if (r.lo == 0 && r.hi == 0) return Truth::kTrue;
        return Truth::kUnknown;
      },
      Truth::kUnknown);
}

Expr SizeFacts::simplify(const Expr& e) const {
  auto decide = [this](const Expr& x) -> Expr {
    switch (x.kind()) {
      case ExprKind::kFloorDiv:  // 0 <= a < b
        if (prove_le(0, x.args()[0]) == Truth::kTrue && prove_lt(x.args()[0], x.args()[1]) == Truth::kTrue) return 0;
        break;
      case ExprKind::kMod:
        if (x.args()[1].is_constant() && prove_divisible(x.args()[0], x.args()[1].constant_value()) == Truth::kTrue)
          return 0;
        if (prove_le(0, x.args()[0]) == Truth::kTrue && prove_lt(x.args()[0], x.args()[1]) == Truth::kTrue)
          return x.args()[0];
        break;
      case ExprKind::kMin:
      case ExprKind::kMax: {
        // Keeps the arguments no other one is proven to beat (for min: <= them).
        bool is_min = x.kind() == ExprKind::kMin;
        std::vector<Expr> kept;
        for (const Expr& a : x.args()) {
          bool beaten = std::any_of(kept.begin(), kept.end(), [&](const Expr& k) {
            return (is_min ? prove_le(k, a) : prove_le(a, k)) == Truth::kTrue;
          });
          if (beaten) continue;
          kept.erase(std::remove_if(kept.begin(), kept.end(),
                                    [&](const Expr& k) {
                                      return (is_min ? prove_le(a, k) : prove_le(k, a)) == Truth::kTrue;
                                    }),
                     kept.end());
          kept.push_back(a);
        }
        if (kept.size() < x.args().size()) return is_min ? min(kept) : max(kept);
        break;
      }
      default: break;
    }
    if (x.kind() != ExprKind::kSymbol && x.kind() != ExprKind::kSum && x.kind() != ExprKind::kConstant) {
      Range r = bounds(x);
      if (r.is_constant()) return r.lo;
    }
    return x;
  };
  // A constructor can turn a decided atom's parent into a sum with new atoms (floordiv(s2 + 16, 16) -> 1 +
  // floordiv(s2, 16)), which the next round decides.
  Expr out = e;
  for (int round = 0; round < 4; ++round) {
    Expr next = rewrite_atoms(out, decide);
    if (next == out) break;
    out = next;
  }
  return out;
}

bool SizeFacts::allows(const Bindings& bindings) const {
  for (const auto& [id, f] : symbols_) {
    auto it = bindings.find(id);
    if (it == bindings.end() || !f.range.contains(it->second) || it->second % f.divisor != 0) return false;
  }
  return true;
}

}  // namespace kiln::graph::sym
