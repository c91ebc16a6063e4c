// graph/sym_expr + sym_facts: canonical form, simplification rules, Python integer semantics, the prover, C and
// JSON text. The main checks are randomized: expression trees evaluated directly (the reference, written here with
// 128-bit arithmetic and the definition of floor division) against the canonical Expr built from them.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <random>

#include "common/error.h"
#include "graph/sym_expr.h"
#include "graph/sym_facts.h"

#ifdef KILN_SYM_HAVE_JSON
#include <nlohmann/json.hpp>
#endif

using namespace kiln::graph::sym;

namespace Catch {
template <>
struct StringMaker<Expr> {
  static std::string convert(const Expr& e) { return e.to_string(); }
};
}  // namespace Catch

namespace {

const Expr s0 = Expr::symbol(0, "s0");
const Expr s1 = Expr::symbol(1, "s1");
const Expr s2 = Expr::symbol(2, "s2");

// ---- the reference: Python's // and % from their definition, in 128 bits ----

using Wide = __int128;

// The q with b*q <= a < b*q + b (b > 0), or b*q >= a > b*q + b (b < 0): searched next to C's truncated quotient.
Wide reference_floordiv(Wide a, Wide b) {
  Wide truncated = a / b;
  for (Wide q = truncated - 1; q <= truncated + 1; ++q) {
    Wide rest = a - b * q;
    if (b > 0 ? (rest >= 0 && rest < b) : (rest <= 0 && rest > b)) return q;
  }
  FAIL("no floor quotient");
  return 0;
}

Wide reference_mod(Wide a, Wide b) { return a - b * reference_floordiv(a, b); }

// An expression tree as written, before any canonicalisation.
struct Tree {
  enum Op { kConst, kSym, kAdd, kSub, kMul, kFloorDiv, kMod, kMin, kMax } op;
  int64_t value = 0;  // kConst: the value; kSym: the symbol id
  std::vector<Tree> kids;
};

bool fits(Wide v) { return v >= INT64_MIN && v <= INT64_MAX; }

// Direct evaluation; nullopt where Python would raise (division by zero) or int64 would overflow.
std::optional<Wide> reference_eval(const Tree& t, const Bindings& b) {
  if (t.op == Tree::kConst) return t.value;
  if (t.op == Tree::kSym) return b.at(static_cast<SymbolId>(t.value));
  std::vector<Wide> v;
  for (const Tree& k : t.kids) {
    auto x = reference_eval(k, b);
    if (!x) return std::nullopt;
    v.push_back(*x);
  }
  Wide r = 0;
  switch (t.op) {
    case Tree::kAdd: r = v[0] + v[1]; break;
    case Tree::kSub: r = v[0] - v[1]; break;
    case Tree::kMul: r = v[0] * v[1]; break;
    case Tree::kFloorDiv:
      if (v[1] == 0) return std::nullopt;
      r = reference_floordiv(v[0], v[1]);
      break;
    case Tree::kMod:
      if (v[1] == 0) return std::nullopt;
      r = reference_mod(v[0], v[1]);
      break;
    case Tree::kMin: r = std::min(v[0], v[1]); break;
    case Tree::kMax: r = std::max(v[0], v[1]); break;
    default: break;
  }
  if (!fits(r)) return std::nullopt;
  return r;
}

Expr build(const Tree& t) {
  switch (t.op) {
    case Tree::kConst: return t.value;
    case Tree::kSym: return Expr::symbol(static_cast<SymbolId>(t.value), "s" + std::to_string(t.value));
    case Tree::kAdd: return build(t.kids[0]) + build(t.kids[1]);
    case Tree::kSub: return build(t.kids[0]) - build(t.kids[1]);
    case Tree::kMul: return build(t.kids[0]) * build(t.kids[1]);
    case Tree::kFloorDiv: return floordiv(build(t.kids[0]), build(t.kids[1]));
    case Tree::kMod: return mod(build(t.kids[0]), build(t.kids[1]));
    case Tree::kMin: return min(build(t.kids[0]), build(t.kids[1]));
    case Tree::kMax: return max(build(t.kids[0]), build(t.kids[1]));
  }
  return 0;
}

// A random tree whose divisors never fold to the constant 0 (building one that does throws, as it should).
struct Sample {
  Tree tree;
  Expr expr;
};

// Random trees of depth <= max_depth over symbols 0..num_symbols-1. Divisors are mostly nonzero constants (of
// either sign, multiples of other constants in the tree so that the rules fire), sometimes whole subtrees.
struct TreeMaker {
  std::mt19937_64 rng;
  int num_symbols = 3;
  bool polynomial = false;  // + - * only

  int64_t pick(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

  Tree leaf() {
    if (pick(0, 2) == 0) return {Tree::kConst, pick(-6, 6), {}};
    return {Tree::kSym, pick(0, num_symbols - 1), {}};
  }

  Tree divisor(int depth) {
    if (pick(0, 3) == 0) return make(depth);
    static const int64_t kDivisors[] = {1, 2, 3, 4, 6, 8, -1, -2, -3, -4, 16};
    return {Tree::kConst, kDivisors[pick(0, 10)], {}};
  }

  Tree make(int depth) {
    if (depth <= 1 || pick(0, 4) == 0) return leaf();
    auto op = static_cast<Tree::Op>(pick(Tree::kAdd, polynomial ? Tree::kMul : Tree::kMax));
    if (op == Tree::kFloorDiv || op == Tree::kMod) return {op, 0, {make(depth - 1), divisor(depth - 1)}};
    if (op == Tree::kMul && pick(0, 1) == 0) return {op, 0, {make(depth - 1), {Tree::kConst, pick(-4, 4), {}}}};
    return {op, 0, {make(depth - 1), make(depth - 1)}};
  }

  Sample sample(int depth) {
    for (;;) {
      Tree t = make(depth);
      try {
        Expr e = build(t);
        return {std::move(t), std::move(e)};
      } catch (const kiln::Error&) {
        // a divisor that is 0 for every binding
      }
    }
  }
};

Bindings random_bindings(std::mt19937_64& rng, int num_symbols, int64_t lo, int64_t hi) {
  Bindings b;
  for (SymbolId i = 0; i < num_symbols; ++i) b[i] = std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  return b;
}

std::optional<int64_t> try_evaluate(const Expr& e, const Bindings& b) {
  try {
    return e.evaluate(b);
  } catch (const kiln::Error&) {
    return std::nullopt;
  }
}

}  // namespace

// ---- canonical form ----

TEST_CASE("equivalent forms are structurally equal, with equal hashes", "[sym]") {
  auto same = [](const Expr& a, const Expr& b) {
    CHECK(a == b);
    CHECK(a.hash() == b.hash());
    CHECK(compare(a, b) == 0);
    CHECK(a.to_string() == b.to_string());
  };
  same(s0 + s1, s1 + s0);
  same((s0 + 1) * (s0 - 1), s0 * s0 - 1);
  same(2 * (s0 + s1) - s1, s1 + s0 * 2);
  same(s0 * s1 * 3, 3 * s1 * s0);
  same(s0 - s0, Expr(0));
  same((s0 + s1) * (s0 + s1) - s0 * s0 - s1 * s1, 2 * s0 * s1);
  same(floordiv(s0 * 4 + s1 * 4, 2), (s0 + s1) * 2);
  same(min(s0, s1), min(s1, s0));
  same(max(max(s0, s1), s2), max(s0, max(s2, s1)));
  same(floordiv(s0 + s1, 4), floordiv(s1 + s0, 4));
  same(floordiv(5 * s0 + 3, 4), s0 + floordiv(s0 + 3, 4));
  same(mod(s0 - 1, 4), mod(s0 + 3, 4));
  same(-(-s0), s0);
  CHECK(s0 != s1);
  CHECK(s0 + 1 != s0);
  CHECK(Expr::symbol(0, "s0") == s0);
  CHECK(Expr::symbol(0, "x") != s0);  // a symbol is its id and its name
  CHECK(s0 * s0 == s0 * s0);
  CHECK(floordiv(s0, 2) != floordiv(s0, 3));
  CHECK(Expr(7) == 7);
}

TEST_CASE("readable strings", "[sym]") {
  CHECK((s0 * 4 + 2).to_string() == "s0*4 + 2");
  CHECK(floordiv(s1, 2).to_string() == "floordiv(s1, 2)");
  CHECK(min(s0, 16).to_string() == "min(s0, 16)");
  CHECK(max(16, s0).to_string() == "max(s0, 16)");
  CHECK((s0 - s1 * 2 - 3).to_string() == "s0 - s1*2 - 3");
  CHECK((-s0 + 1).to_string() == "-s0 + 1");
  CHECK((s0 * s0 * s1).to_string() == "s0**2*s1");
  CHECK(mod(s0 + s1, 8).to_string() == "mod(s0 + s1, 8)");
  CHECK(min({s0, s1, s2}).to_string() == "min(s0, s1, s2)");
  CHECK(Expr(-5).to_string() == "-5");
  CHECK((s0 * floordiv(s1, 4)).to_string() == "s0*floordiv(s1, 4)");
}

TEST_CASE("accessors and free symbols", "[sym]") {
  Expr e = s1 * 3 + floordiv(s0 * s2, 5) + 7;
  REQUIRE(e.kind() == ExprKind::kSum);
  CHECK(e.sum_constant() == 7);
  CHECK(e.terms().size() == 2);
  std::vector<Expr> free = e.free_symbols();
  REQUIRE(free.size() == 3);
  CHECK(free[0] == s0);
  CHECK(free[1] == s1);
  CHECK(free[2] == s2);
  CHECK(Expr(4).is_constant());
  CHECK(Expr(4).constant_value() == 4);
  CHECK_FALSE(s0.is_constant());
  CHECK(s0.is_symbol());
  CHECK(s0.symbol_id() == 0);
  CHECK(s0.symbol_name() == "s0");
  CHECK_THROWS_AS(s0.constant_value(), kiln::Error);
  CHECK(Expr(3).free_symbols().empty());
}

// ---- simplification rules ----

TEST_CASE("floordiv and mod rules", "[sym]") {
  CHECK(floordiv(s0 * 8, 8) == s0);
  CHECK(floordiv(s0 * 8 + s1 * 8, 8) == s0 + s1);
  CHECK(floordiv(s0 * 8 + 3, 8) == s0);  // 3 // 8 == 0 once s0*8 is taken out
  CHECK(floordiv(s0 * 8 + 12, 8) == s0 + 1);
  CHECK(mod(s0 * 8, 8) == 0);
  CHECK(mod(s0 * 8 + s1 * 16, 8) == 0);
  CHECK(mod(s0 * 8 + 3, 8) == 3);
  CHECK(mod(s0 * 8 + s1, 8) == mod(s1, 8));
  CHECK(floordiv(Expr(17), 5) == 3);
  CHECK(floordiv(Expr(-17), 5) == -4);
  CHECK(mod(Expr(-17), 5) == 3);
  CHECK(mod(Expr(17), -5) == -3);
  CHECK(floordiv(s0, 1) == s0);
  CHECK(mod(s0, 1) == 0);
  CHECK(mod(s0, -1) == 0);
  CHECK(floordiv(s0, -1) == -s0);
  CHECK(floordiv(floordiv(s0, 4), 8) == floordiv(s0, 32));
  CHECK(floordiv(floordiv(s0 + s1, 2), 3) == floordiv(s0 + s1, 6));
  CHECK(floordiv(floordiv(s0 * 3 + s1, 3), 4) == floordiv(s0 * 3 + s1, 12));  // s0 + floordiv(s1, 3) inside
  CHECK(mod(mod(s0, 12) * 5 + s1, 4) == mod(s0 + s1, 4));
  CHECK(mod(mod(s0, 12), 4) == mod(s0, 4));
  CHECK(mod(mod(s0, 4), 8) == mod(s0, 4));  // already in [0, 4)
  CHECK(floordiv(mod(s0, 4), 4) == 0);
  CHECK(floordiv(s0 * 6 + 4, 4) == s0 + floordiv(s0 + 2, 2));  // 6 = 4 + 2, then 2*s0 + 4 over 4: gcd 2
  CHECK(floordiv(s0 * 2, 4) == floordiv(s0, 2));
  CHECK(floordiv(s0 * 3 + 7, 12) == floordiv(s0 + 2, 4));  // 3*(s0 + 2) + 1 over 12
  CHECK(mod(s0 * 3 + 7, 12) == mod(s0 + 2, 4) * 3 + 1);
  CHECK(floordiv(s0 * 2 + mod(s1, 2), 4) == floordiv(s0, 2));
  CHECK(mod(s0 * 2 + mod(s1, 2), 4) == mod(s0, 2) * 2 + mod(s1, 2));
  CHECK(mod(s0 * 2, 4) == 2 * mod(s0, 2));
  CHECK(floordiv(s0, s0) == 1);
  CHECK(mod(s0, s0) == 0);
  CHECK(floordiv(Expr(0), s1) == 0);
  CHECK(floordiv(s0, s1).kind() == ExprKind::kFloorDiv);
  CHECK_THROWS_AS(floordiv(s0, 0), kiln::Error);
  CHECK_THROWS_AS(mod(s0, 0), kiln::Error);
}

TEST_CASE("min and max rules", "[sym]") {
  CHECK(min(s0, s0) == s0);
  CHECK(max(s0, s0) == s0);
  CHECK(min(Expr(3), Expr(9)) == 3);
  CHECK(max(Expr(3), Expr(9)) == 9);
  CHECK(min(min(s0, s1), min(s2, 4)) == min({s0, s1, s2, 4}));
  CHECK(min(min(s0, s1), min(s2, 4)).args().size() == 4);
  CHECK(max(max(s0, 3), 7) == max(s0, 7));
  CHECK(min(s0, s0 + 1) == s0);
  CHECK(max(s0, s0 + 1) == s0 + 1);
  CHECK(min(mod(s0, 4), 8) == mod(s0, 4));
  CHECK(min({s0, s1, s0 - 2}) == min(s0 - 2, s1));
  CHECK(min(s0, 16).kind() == ExprKind::kMin);
}

// ---- Python semantics ----

TEST_CASE("floor division and modulo follow Python for every sign", "[sym]") {
  for (int64_t a = -40; a <= 40; ++a) {
    for (int64_t b = -9; b <= 9; ++b) {
      if (b == 0) continue;
      // Python: a // b == floor(a / b) (exact in double for these sizes), a % b == a - b * (a // b).
      auto q = static_cast<int64_t>(std::floor(static_cast<double>(a) / static_cast<double>(b)));
      INFO(a << " // " << b);
      CHECK(int_floordiv(a, b) == q);
      CHECK(int_mod(a, b) == a - b * q);
      CHECK(floordiv(Expr(a), b) == q);
      CHECK(mod(Expr(a), b) == a - b * q);
      Bindings x{{0, a}};
      CHECK(floordiv(s0, b).evaluate(x) == q);
      CHECK(mod(s0, b).evaluate(x) == a - b * q);
      CHECK(floordiv(s0 * 3 + 5, b).evaluate(x) == static_cast<int64_t>(reference_floordiv(3 * a + 5, b)));
      CHECK(mod(s0 * 3 + 5, b).evaluate(x) == static_cast<int64_t>(reference_mod(3 * a + 5, b)));
    }
  }
  CHECK(int_floordiv(INT64_MIN, 1) == INT64_MIN);
  CHECK(int_mod(INT64_MIN, -1) == 0);
  CHECK_THROWS_AS(int_floordiv(INT64_MIN, -1), kiln::Error);
  CHECK_THROWS_AS(int_floordiv(3, 0), kiln::Error);
}

TEST_CASE("evaluate names unbound symbols, division by zero and overflow", "[sym]") {
  try {
    (s0 + s1).evaluate({{0, 1}});
    FAIL("no error");
  } catch (const kiln::Error& e) {
    CHECK(std::string(e.what()).find("s1") != std::string::npos);
  }
  CHECK_THROWS_AS(floordiv(s0, s1).evaluate({{0, 1}, {1, 0}}), kiln::Error);
  CHECK_THROWS_AS((s0 * s0).evaluate({{0, int64_t{1} << 40}}), kiln::Error);
  CHECK((s0 * 4 + 2).evaluate({{0, 5}}) == 22);
}

TEST_CASE("random trees: the canonical form evaluates like the tree", "[sym]") {
  TreeMaker maker{std::mt19937_64(20250325)};
  std::mt19937_64 rng(7);
  int compared = 0;
  for (int i = 0; i < 4000; ++i) {
    auto [tree, e] = maker.sample(1 + i % 4);
    INFO("expression " << e.to_string());
    // Canonical again when rebuilt; substitution by nothing is the identity.
    CHECK(rewrite_atoms(e, [](const Expr& a) { return a; }) == e);
    for (int j = 0; j < 40; ++j) {
      Bindings b = random_bindings(rng, 3, j < 20 ? -9 : 0, 9);
      auto expected = reference_eval(tree, b);
      if (!expected) continue;
      auto got = try_evaluate(e, b);
      INFO("s0 = " << b[0] << ", s1 = " << b[1] << ", s2 = " << b[2]);
      REQUIRE(got.has_value());
      REQUIRE(*got == static_cast<int64_t>(*expected));
      ++compared;
    }
  }
  CHECK(compared > 100000);
}

TEST_CASE("substitution replaces each symbol once", "[sym]") {
  // floordiv(s1*2, 2) is s1 again, which must not be replaced a second time.
  CHECK(max(s1, floordiv(s1, 2)).substitute({{1, s1 * 2}}) == max(s1 * 2, s1));
  CHECK((s0 + s1).substitute({{0, s1}, {1, s0}}) == s0 + s1);
  CHECK((s0 * s1).substitute({{1, Expr(3)}}) == s0 * 3);
  CHECK(floordiv(s0, s1).substitute({{1, Expr(4)}}) == floordiv(s0, 4));
  CHECK_THROWS_AS(floordiv(s0, s1).substitute({{1, Expr(0)}}), kiln::Error);
}

TEST_CASE("random trees: substitution commutes with evaluation", "[sym]") {
  TreeMaker maker{std::mt19937_64(99)};
  std::mt19937_64 rng(3);
  for (int i = 0; i < 1500; ++i) {
    auto [tree, e] = maker.sample(4);
    auto [replacement, r] = maker.sample(2);  // s1 := a tree over s0..s2
    Expr substituted;
    try {
      substituted = e.substitute({{1, r}});
    } catch (const kiln::Error&) {
      continue;  // a divisor became the constant 0
    }
    INFO(e.to_string() << " with s1 := " << r.to_string() << " is " << substituted.to_string());
    for (int j = 0; j < 20; ++j) {
      Bindings b = random_bindings(rng, 3, -6, 6);
      auto r_value = reference_eval(replacement, b);
      if (!r_value) continue;
      Bindings inner = b;
      inner[1] = static_cast<int64_t>(*r_value);
      auto expected = reference_eval(tree, inner);
      if (!expected) continue;
      auto got = try_evaluate(substituted, b);
      REQUIRE(got.has_value());
      REQUIRE(*got == static_cast<int64_t>(*expected));
    }
  }
}

TEST_CASE("random trees: algebraic identities hold structurally", "[sym]") {
  TreeMaker maker{std::mt19937_64(5)};
  for (int i = 0; i < 1500; ++i) {
    Expr a = maker.sample(3).expr, b = maker.sample(3).expr, c = maker.sample(3).expr;
    INFO(a.to_string() << " | " << b.to_string() << " | " << c.to_string());
    CHECK(a + b == b + a);
    CHECK((a + b) + c == a + (b + c));
    CHECK(a * b == b * a);
    CHECK((a * b) * c == a * (b * c));
    CHECK(a * (b + c) == a * b + a * c);
    CHECK(a - a == 0);
    CHECK(a + b - b == a);
    CHECK(min(a, b) == min(b, a));
    CHECK(max(max(a, b), c) == max(a, max(b, c)));
    CHECK(min(a, a) == a);
    CHECK(floordiv(a * 6, 6) == a);
    CHECK(floordiv(a * 6 + b * 12, 6) == a + b * 2);
    CHECK(mod(a * 6 + b * 12, 6) == 0);
    CHECK(mod(a * 5 + 3, 5) == 3);
  }
  TreeMaker polynomials{std::mt19937_64(6), 3, true};
  for (int i = 0; i < 1500; ++i) {
    Expr p = polynomials.sample(4).expr;
    INFO(p.to_string());
    CHECK(floordiv(floordiv(p, 3), 4) == floordiv(p, 12));
    CHECK(floordiv(floordiv(p, -3), 4) == floordiv(p, -12));
    CHECK(mod(mod(p, 12), 4) == mod(p, 4));
    CHECK(mod(mod(p, 12) * 5 + p, 4) == mod(p * 6, 4));
  }
}

// ---- SizeFacts ----

TEST_CASE("size facts: ranges, divisors and bounds", "[sym]") {
  SizeFacts facts;
  Expr a = facts.new_symbol();  // s0 in [2, inf)
  Expr b = facts.new_symbol();  // s1
  Expr c = facts.new_symbol({0, 15});
  CHECK(a == s0);
  CHECK(b == s1);
  CHECK(c.symbol_name() == "s2");
  CHECK(facts.range(0) == SizeFacts::kDynamicSizeRange);
  CHECK(facts.range(7) == Range{});  // never declared: unconstrained
  CHECK(facts.bounds(c * 2 + 1) == Range{1, 31});
  CHECK(facts.bounds(-c) == Range{-15, 0});
  CHECK(facts.bounds(floordiv(c, 4)) == Range{0, 3});
  CHECK(facts.bounds(mod(a, 8)) == Range{0, 7});
  CHECK(facts.bounds(mod(c, 32)) == Range{0, 15});
  CHECK(facts.bounds(a * b) == Range{4, Range::kPosInf});
  CHECK(facts.bounds(min(a, 16)) == Range{2, 16});
  CHECK(facts.bounds(max(c, a)) == Range{2, Range::kPosInf});
  CHECK(facts.bounds(c - 20) == Range{-20, -5});
  CHECK(facts.bounds(floordiv(c - 20, 3)) == Range{-7, -2});
  CHECK(facts.bounds(floordiv(c, a)) == Range{0, 7});
  CHECK(facts.bounds(s0 * s0 - 10) == Range{-6, Range::kPosInf});
  CHECK(bounds(s0 * s0) == Range{0, Range::kPosInf});
  CHECK(bounds(s0 * s0 * s0) == Range{});
  CHECK(bounds(mod(s0, -4)) == Range{-3, 0});
  CHECK(Range{2, Range::kPosInf}.to_string() == "[2, inf)");
  CHECK(Range{}.to_string() == "(-inf, inf)");
  facts.add_divisor(b, 4);
  facts.add_divisor(b, 6);
  CHECK(facts.divisor(1) == 12);
  CHECK(facts.bounds(b) == Range{12, Range::kPosInf});
  CHECK(facts.allows({{0, 2}, {1, 24}, {2, 15}}));
  CHECK_FALSE(facts.allows({{0, 2}, {1, 20}, {2, 15}}));
  CHECK_FALSE(facts.allows({{0, 1}, {1, 24}, {2, 15}}));
  CHECK_FALSE(facts.allows({{0, 2}, {1, 24}}));
  CHECK_THROWS_AS(facts.set_range(s0 + 1, {}), kiln::Error);
  CHECK_THROWS_AS(facts.set_range(s0, {5, 4}), kiln::Error);
  CHECK_THROWS_AS(facts.add_divisor(s0, 0), kiln::Error);
}

TEST_CASE("size facts: what the prover shows", "[sym]") {
  SizeFacts facts;
  Expr a = facts.new_symbol();           // s0 >= 2
  Expr b = facts.new_symbol();           // s1 >= 2, a multiple of 8
  Expr c = facts.new_symbol({0, 15});    // s2 in [0, 15]
  facts.add_divisor(b, 8);
  using T = Truth;
  CHECK(facts.prove_le(a, a * b) == T::kTrue);
  CHECK(facts.prove_lt(a, a * 2) == T::kTrue);
  CHECK(facts.prove_nonneg(a - 2) == T::kTrue);
  CHECK(facts.prove_lt(a, 2) == T::kFalse);
  CHECK(facts.prove_le(a, 2) == T::kUnknown);
  CHECK(facts.prove_eq(a, 1) == T::kFalse);
  CHECK(facts.prove_eq(a, b) == T::kUnknown);
  CHECK(facts.prove_eq(a + b, b + a) == T::kTrue);
  CHECK(facts.prove_le(min(a, 16), a) == T::kTrue);
  CHECK(facts.prove_le(min(a, 16), 16) == T::kTrue);
  CHECK(facts.prove_le(a, max(a, c)) == T::kTrue);
  CHECK(facts.prove_lt(c, 16) == T::kTrue);
  CHECK(facts.prove_lt(c, a) == T::kUnknown);
  CHECK(facts.prove_lt(c, b) == T::kUnknown);   // b is a multiple of 8, so >= 8; c may be 15
  CHECK(facts.prove_lt(c, b * 2) == T::kTrue);
  CHECK(facts.prove_divisible(b, 4) == T::kTrue);
  CHECK(facts.prove_divisible(b * 3 + 4, 4) == T::kTrue);
  CHECK(facts.prove_divisible(b + 2, 4) == T::kFalse);
  CHECK(facts.prove_divisible(a, 2) == T::kUnknown);
  CHECK(facts.prove_divisible(a * 6, -3) == T::kTrue);
  CHECK(facts.prove_divisible(a * b, 8) == T::kTrue);
  CHECK(facts.prove_eq(mod(b, 8), 0) == T::kTrue);
  CHECK(facts.prove_eq(floordiv(b, 8) * 8, b) == T::kTrue);
  CHECK(facts.prove_eq(a * 2, c * 2 + 1) == T::kFalse);  // even != odd
  CHECK(facts.prove_eq(b, a * 8 + 4) == T::kFalse);
  CHECK(facts.bounds(b) == Range{8, Range::kPosInf});
  CHECK_THROWS_AS(facts.prove_divisible(a, 0), kiln::Error);
  // A symbol with a negative id (reserved) is not read as SizeFacts' own -1 - 2 (which would be c, in [0, 15]).
  Expr reserved = Expr::symbol(-3, "r");
  CHECK(facts.prove_lt(reserved, 16) == T::kUnknown);
  CHECK(facts.bounds(reserved) == Range{});
  CHECK(std::string(truth_name(T::kUnknown)) == "unknown");
}

TEST_CASE("size facts: simplify decides atoms", "[sym]") {
  SizeFacts facts;
  Expr big = facts.new_symbol({16, Range::kPosInf});
  Expr m8 = facts.new_symbol();
  facts.add_divisor(m8, 8);
  Expr small = facts.new_symbol({0, 15});
  CHECK(facts.simplify(min(big, 16)) == 16);
  CHECK(facts.simplify(max(big, 16)) == big);
  CHECK(facts.simplify(mod(m8, 8)) == 0);
  CHECK(facts.simplify(mod(m8 * 3 + 2, 4)) == 2);
  CHECK(facts.simplify(floordiv(small, 16)) == 0);
  CHECK(facts.simplify(mod(small, 16)) == small);
  CHECK(facts.simplify(mod(small, big)) == small);
  CHECK(facts.simplify(floordiv(small, big)) == 0);
  CHECK(facts.simplify(min({big, small, m8})) == min(small, m8));
  CHECK(facts.simplify(big + min(small, 20) * 2) == big + small * 2);
  CHECK(facts.simplify(min(big, m8)) == min(big, m8));
  CHECK(facts.simplify(floordiv(min(small, 20) + 16, 16)) == 1);
}

TEST_CASE("random facts: proofs, bounds and simplify never contradict evaluation", "[sym]") {
  std::mt19937_64 rng(11);
  TreeMaker maker{std::mt19937_64(12)};
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int proven = 0, disproven = 0, checked = 0;
  for (int round = 0; round < 400; ++round) {
    SizeFacts facts;
    std::vector<std::vector<int64_t>> allowed(3);  // the values sampled per symbol: within [-30, 30]
    for (SymbolId id = 0; id < 3; ++id) {
      int64_t lo = pick(0, 6) == 0 ? Range::kNegInf : (pick(0, 2) == 0 ? 2 : pick(-6, 6));
      int64_t hi = pick(0, 2) == 0 ? Range::kPosInf : (lo == Range::kNegInf ? pick(-6, 6) : lo + pick(0, 14));
      static const int64_t kDivisors[] = {1, 1, 1, 2, 3, 4, 8};
      int64_t d = kDivisors[pick(0, 6)];
      Expr s = Expr::symbol(id, "s" + std::to_string(id));
      facts.set_range(s, {lo, hi});
      if (d > 1) facts.add_divisor(s, d);
      for (int64_t v = -30; v <= 30; ++v)
        if (Range{lo, hi}.contains(v) && v % d == 0) allowed[id].push_back(v);
    }
    if (std::any_of(allowed.begin(), allowed.end(), [](const auto& v) { return v.empty(); })) continue;
    std::vector<Bindings> samples;
    for (int i = 0; i < 120; ++i) {
      Bindings b;
      for (SymbolId id = 0; id < 3; ++id) b[id] = allowed[id][pick(0, static_cast<int64_t>(allowed[id].size()) - 1)];
      samples.push_back(b);
    }
    for (int pair = 0; pair < 12; ++pair) {
      Sample x = maker.sample(1 + pair % 4), y = maker.sample(1 + (pair / 4) % 3);
      int64_t k = pick(2, 6);
      Truth le = facts.prove_le(x.expr, y.expr), lt = facts.prove_lt(x.expr, y.expr);
      Truth eq = facts.prove_eq(x.expr, y.expr), nonneg = facts.prove_nonneg(x.expr);
      Truth divisible = facts.prove_divisible(x.expr, k);
      Range range = facts.bounds(x.expr);
      Expr simple = x.expr;
      try {
        simple = facts.simplify(x.expr);
      } catch (const kiln::Error&) {
        // a divisor the facts show to be 0
      }
      INFO("x = " << x.expr.to_string() << ", y = " << y.expr.to_string() << ", k = " << k << ", x simplified "
                  << simple.to_string() << ", bounds " << range.to_string());
      for (Truth t : {le, lt, eq, nonneg, divisible}) {
        proven += t == Truth::kTrue;
        disproven += t == Truth::kFalse;
      }
      for (const Bindings& b : samples) {
        auto vx = reference_eval(x.tree, b), vy = reference_eval(y.tree, b);
        if (!vx) continue;
        INFO("s0 = " << b.at(0) << ", s1 = " << b.at(1) << ", s2 = " << b.at(2));
        REQUIRE(range.contains(static_cast<int64_t>(*vx)));
        REQUIRE(try_evaluate(simple, b) == std::optional<int64_t>(static_cast<int64_t>(*vx)));
        if (nonneg != Truth::kUnknown) REQUIRE((nonneg == Truth::kTrue) == (*vx >= 0));
        if (divisible != Truth::kUnknown) REQUIRE((divisible == Truth::kTrue) == (*vx % k == 0));
        ++checked;
        if (!vy) continue;
        if (le != Truth::kUnknown) REQUIRE((le == Truth::kTrue) == (*vx <= *vy));
        if (lt != Truth::kUnknown) REQUIRE((lt == Truth::kTrue) == (*vx < *vy));
        if (eq != Truth::kUnknown) REQUIRE((eq == Truth::kTrue) == (*vx == *vy));
      }
    }
  }
  CHECK(checked > 100000);
  CHECK(proven > 1000);
  CHECK(disproven > 500);
}

// ---- C and JSON ----

TEST_CASE("to_c spells helpers, and plain / and % where the dividend is provably >= 0", "[sym]") {
  SizeFacts facts;
  facts.new_symbol();
  facts.new_symbol();
  CHECK(to_c(s0 * 4 + 2) == "s0*4 + 2");
  CHECK(to_c(floordiv(s0, 2)) == "kiln_floordiv(s0, 2)");
  CHECK(to_c(floordiv(s0, 2), nullptr, &facts) == "s0 / 2");
  CHECK(to_c(mod(s0 + s1, 8), nullptr, &facts) == "(s0 + s1) % 8");
  CHECK(to_c(mod(s0 - s1, 8), nullptr, &facts) == "(s0 + s1*7) % 8");  // the canonical dividend is >= 0
  CHECK(to_c(mod(s0 + s2, 8), nullptr, &facts) == "kiln_mod(s0 + s2, 8)");  // s2 is unconstrained
  CHECK(to_c(s1 * floordiv(s0, 2) * 3, nullptr, &facts) == "s1*(s0 / 2)*3");
  CHECK(to_c(s1 - floordiv(s0, 2), nullptr, &facts) == "s1 - (s0 / 2)");
  CHECK(to_c(floordiv(s0, 2) + 1, nullptr, &facts) == "s0 / 2 + 1");
  CHECK(to_c(floordiv(s0 * s0, 3)) == "s0*s0 / 3");  // an even power is >= 0 without facts
  CHECK(to_c(floordiv(s0, s1), nullptr, &facts) == "kiln_floordiv(s0, s1)");
  CHECK(to_c(min({s0, s1, 16})) == "kiln_min(s0, kiln_min(s1, 16))");
  CHECK(to_c(max(s0, 1)) == "kiln_max(s0, 1)");
  CHECK(to_c(s0 * s0 * 3 - 1) == "s0*s0*3 - 1");
  CHECK(to_c(s0 + 5000000000) == "s0 + 5000000000LL");
  CHECK(to_c(s0 * -5000000000) == "-s0*5000000000LL");
  CHECK(to_c(Expr(INT64_MIN)) == "(-9223372036854775807LL - 1)");
  CHECK(to_c(-s0 - 1) == "-s0 - 1");
  CHECK(to_c(s0 * 4 + 2, [](const Expr& s) { return "size[" + std::to_string(s.symbol_id()) + "]"; }) ==
        "size[0]*4 + 2");
  CHECK((s0 * -5000000000).to_string() == "-s0*5000000000");
}

#ifdef KILN_SYM_HAVE_JSON
TEST_CASE("JSON round-trips expressions and facts exactly", "[sym]") {
  TreeMaker maker{std::mt19937_64(21)};
  for (int i = 0; i < 2000; ++i) {
    Expr e = maker.sample(1 + i % 4).expr;
    nlohmann::json j = e;
    Expr back = nlohmann::json::parse(j.dump()).get<Expr>();
    INFO(j.dump());
    REQUIRE(back == e);
    REQUIRE(back.to_string() == e.to_string());
  }
  nlohmann::json j = std::vector<Expr>{s0 * 2, floordiv(s1, 4), 7};
  CHECK(j.dump() ==
        R"([{"constant":0,"sum":[[2,[[{"name":"s0","symbol":0},1]]]]},{"floordiv":[{"name":"s1","symbol":1},4]},7])");
  CHECK(j.get<std::vector<Expr>>() == std::vector<Expr>{s0 * 2, floordiv(s1, 4), 7});

  SizeFacts facts;
  Expr a = facts.new_symbol();
  Expr b = facts.new_symbol({Range::kNegInf, 40});
  facts.add_divisor(a, 8);
  SizeFacts read = nlohmann::json::parse(nlohmann::json(facts).dump()).get<SizeFacts>();
  CHECK(read.range(0) == facts.range(0));
  CHECK(read.range(1) == Range{Range::kNegInf, 40});
  CHECK(read.divisor(0) == 8);
  CHECK(read.prove_divisible(a * 3, 8) == Truth::kTrue);
  CHECK(read.new_symbol() == Expr::symbol(2, "s2"));

  for (const char* bad : {R"({"foo": 1})", R"({"symbol": "x", "name": "s0"})", R"({"floordiv": [1]})",
                          R"({"floordiv": [{"symbol": 0, "name": "s0"}, 0]})", R"("s0")", "18446744073709551615",
                          R"({"sum": [[1, [[3, 0]]]], "constant": 0})"}) {
    INFO(bad);
    CHECK_THROWS_AS(nlohmann::json::parse(bad).get<Expr>(), kiln::Error);
  }
  CHECK_THROWS_AS(nlohmann::json::parse(R"({"symbols": [{"id": 0}]})").get<SizeFacts>(), kiln::Error);
}
#endif
