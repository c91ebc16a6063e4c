// The text forms of symbolic sizes (graph/sym_expr.h): the readable one, the C one the code emitters paste into
// kernels, JSON for the disk cache, and the reader of the readable form (parse_expr). The readable and C forms share
// one writer; they differ in how atoms, powers and large constants are spelled.
#include <cctype>
#include <climits>
#include <functional>
#include <string>

#include "common/error.h"
#include "graph/sym_expr.h"
#include "graph/sym_facts.h"

#ifdef KILN_SYM_HAVE_JSON
#include <nlohmann/json.hpp>
#endif

namespace kiln::graph::sym {

namespace {

struct Style {
  bool c = false;                      // C syntax: kiln_* helpers, no **, LL literals
  const SymbolNamer* namer = nullptr;  // C: how symbols are named
  const SizeFacts* facts = nullptr;    // C: what proves a dividend non-negative
};

std::string literal(int64_t v, const Style& s) {
  if (!s.c) return std::to_string(v);
  if (v == LLONG_MIN) return "(-9223372036854775807LL - 1)";
  if (v < INT32_MIN || v > INT32_MAX) return std::to_string(v) + "LL";
  return std::to_string(v);
}

std::string write(const Expr& e, const Style& s);

std::string write_call(const std::string& name, const std::vector<Expr>& args, const Style& s) {
  std::string out = name + "(";
  for (size_t i = 0; i < args.size(); ++i) out += (i ? ", " : "") + write(args[i], s);
  return out + ")";
}

// An atom's text, and whether it is a / or % expression that needs parentheses inside a product.
std::pair<std::string, bool> write_atom(const Expr& e, const Style& s) {
  switch (e.kind()) {
    case ExprKind::kSymbol: return {s.namer && *s.namer ? (*s.namer)(e) : e.symbol_name(), false};
    case ExprKind::kFloorDiv:
    case ExprKind::kMod: {
      const char* name = e.kind() == ExprKind::kFloorDiv ? "floordiv" : "mod";
      if (!s.c) return {write_call(name, e.args(), s), false};
      const Expr& a = e.args()[0];
      const Expr& b = e.args()[1];
      bool nonneg = s.facts ? s.facts->prove_nonneg(a) == Truth::kTrue : bounds(a).lo >= 0;
      if (!(b.is_constant() && b.constant_value() > 0 && nonneg))
        return {write_call(std::string("kiln_") + name, e.args(), s), false};
      std::string dividend = write(a, s);
      // A lone product needs none: s0*4 / 3 is (s0*4) / 3 in C.
      bool lone_product = a.kind() != ExprKind::kSum || (a.terms().size() == 1 && a.sum_constant() == 0);
      if (!lone_product) dividend = "(" + dividend + ")";
      return {dividend + (e.kind() == ExprKind::kFloorDiv ? " / " : " % ") + literal(b.constant_value(), s), true};
    }
    case ExprKind::kMin:
    case ExprKind::kMax: {
      const char* name = e.kind() == ExprKind::kMin ? "min" : "max";
      if (!s.c) return {write_call(name, e.args(), s), false};
      // kiln_min/kiln_max take two arguments: min(a, b, c) -> kiln_min(a, kiln_min(b, c)).
      std::string out = write(e.args().back(), s);
      for (size_t i = e.args().size() - 1; i-- > 0;)
        out = std::string("kiln_") + name + "(" + write(e.args()[i], s) + ", " + out + ")";
      return {out, false};
    }
    default: break;
  }
  KILN_ASSERT(false) << "not an atom: kind " << static_cast<int>(e.kind());
}

// |coefficient| * factors, as `s0*s1**2*4` (`s0*s1*s1*4` in C).
std::string write_term(const Expr::Term& t, int64_t magnitude, const Style& s) {
  bool lone = t.factors.size() == 1 && t.factors[0].exponent == 1 && magnitude == 1 && t.coefficient > 0;
  std::string out;
  for (const Expr::Factor& f : t.factors) {
    auto [text, is_operator] = write_atom(f.atom, s);
    if (is_operator && !lone) text = "(" + text + ")";
    int64_t copies = s.c ? f.exponent : 1;
    for (int64_t i = 0; i < copies; ++i) {
      if (!out.empty()) out += "*";
      out += text;
    }
    if (!s.c && f.exponent > 1) out.append("**").append(std::to_string(f.exponent));
  }
  if (magnitude != 1) out.append("*").append(literal(magnitude, s));
  return out;
}

std::string write(const Expr& e, const Style& s) {
  if (e.is_constant()) return literal(e.constant_value(), s);
  if (e.kind() != ExprKind::kSum) return write_atom(e, s).first;
  std::string out;
  // Terms are written with their sign in front; LLONG_MIN has no magnitude, so it keeps a + and its literal.
  auto append = [&](int64_t value, const std::function<std::string(int64_t)>& text) {
    bool minus = value < 0 && value != LLONG_MIN;
    int64_t magnitude = minus ? -value : value;
    out += out.empty() ? (minus ? "-" : "") : (minus ? " - " : " + ");
    out += text(magnitude);
  };
  for (const Expr::Term& t : e.terms())
    append(t.coefficient, [&](int64_t magnitude) { return write_term(t, magnitude, s); });
  if (e.sum_constant() != 0) append(e.sum_constant(), [&](int64_t magnitude) { return literal(magnitude, s); });
  return out;
}

}  // namespace

std::string Expr::to_string() const { return write(*this, Style{}); }

std::string to_c(const Expr& e, const SymbolNamer& name_symbol, const SizeFacts* facts) {
  return write(e, Style{true, &name_symbol, facts});
}

namespace {
// parse_expr's reader, recursive descent of expression text: sums of products of atoms, // and % bind as *, unary minus,
// parentheses, and the calls floordiv, mod, min and max.
class ExprReader {
 public:
  ExprReader(const std::string& text, const std::map<std::string, Expr>& symbols) : text_(text), symbols_(symbols) {}

  Expr read() {
    Expr e = sum();
    skip_space();
    KILN_CHECK(pos_ == text_.size()) << "unexpected '" << text_.substr(pos_) << "' in expression '" << text_ << "'";
    return e;
  }

 private:
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool take(const std::string& token) {
    skip_space();
    if (text_.compare(pos_, token.size(), token) != 0) return false;
    pos_ += token.size();
    return true;
  }
  Expr sum() {
    Expr e = product();
    while (true) {
      if (take("+")) {
        e = e + product();
      } else if (take("-")) {
        e = e - product();
      } else {
        return e;
      }
    }
  }
  Expr product() {
    Expr e = unary();
    while (true) {
      if (take("**")) {
        Expr p = unary();
        KILN_CHECK(p.is_constant() && p.constant_value() >= 0) << "a non-constant power in '" << text_ << "'";
        Expr base = e;
        e = 1;
        for (int64_t i = 0; i < p.constant_value(); ++i) e = e * base;
      } else if (take("*")) {
        e = e * unary();
      } else if (take("//")) {
        e = floordiv(e, unary());
      } else if (take("%")) {
        e = mod(e, unary());
      } else {
        return e;
      }
    }
  }
  Expr unary() {
    if (take("-")) return -unary();
    return atom();
  }
  std::vector<Expr> call_args() {
    KILN_CHECK(take("(")) << "'(' expected in '" << text_ << "'";
    std::vector<Expr> args = {sum()};
    while (take(",")) args.push_back(sum());
    KILN_CHECK(take(")")) << "')' expected in '" << text_ << "'";
    return args;
  }
  Expr atom() {
    skip_space();
    KILN_CHECK(pos_ < text_.size()) << "expression '" << text_ << "' ends early";
    if (take("(")) {
      Expr e = sum();
      KILN_CHECK(take(")")) << "')' expected in '" << text_ << "'";
      return e;
    }
    size_t start = pos_;
    if (std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
      return Expr(static_cast<int64_t>(std::stoll(text_.substr(start, pos_ - start))));
    }
    while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) ++pos_;
    std::string name = text_.substr(start, pos_ - start);
    KILN_CHECK(!name.empty()) << "unexpected '" << text_.substr(pos_) << "' in '" << text_ << "'";
    if (name == "floordiv" || name == "mod" || name == "min" || name == "max") {
      std::vector<Expr> args = call_args();
      if (name == "min") return min(args);
      if (name == "max") return max(args);
      KILN_CHECK(args.size() == 2) << name << " takes two arguments in '" << text_ << "'";
      return name == "floordiv" ? floordiv(args[0], args[1]) : mod(args[0], args[1]);
    }
    auto it = symbols_.find(name);
    KILN_CHECK(it != symbols_.end()) << "unknown symbol '" << name << "' in '" << text_ << "'";
    return it->second;
  }

  const std::string& text_;
  const std::map<std::string, Expr>& symbols_;
  size_t pos_ = 0;
};

}  // namespace

Expr parse_expr(const std::string& text, const std::map<std::string, Expr>& symbols) {
  return ExprReader(text, symbols).read();
}

#ifdef KILN_SYM_HAVE_JSON

void to_json(nlohmann::json& j, const Expr& e) {
  switch (e.kind()) {
    case ExprKind::kConstant: j = e.constant_value(); return;
    case ExprKind::kSymbol: j = {{"symbol", e.symbol_id()}, {"name", e.symbol_name()}}; return;
    case ExprKind::kSum: {
      nlohmann::json terms = nlohmann::json::array();
      for (const Expr::Term& t : e.terms()) {
        nlohmann::json factors = nlohmann::json::array();
        for (const Expr::Factor& f : t.factors) factors.push_back({f.atom, f.exponent});
        terms.push_back({t.coefficient, factors});
      }
      j = {{"sum", terms}, {"constant", e.sum_constant()}};
      return;
    }
    case ExprKind::kFloorDiv: j = {{"floordiv", e.args()}}; return;
    case ExprKind::kMod: j = {{"mod", e.args()}}; return;
    case ExprKind::kMin: j = {{"min", e.args()}}; return;
    case ExprKind::kMax: j = {{"max", e.args()}}; return;
  }
}

void from_json(const nlohmann::json& j, Expr& e) {
  try {
    if (j.is_number_integer()) {
      KILN_CHECK(!(j.is_number_unsigned() && j.get<uint64_t>() > INT64_MAX))
          << "symbolic size constant out of int64 range: " << j.dump();
      e = j.get<int64_t>();
      return;
    }
    KILN_CHECK(j.is_object() && j.size() <= 2) << "not a symbolic size expression: " << j.dump();
    if (j.contains("symbol")) {
      e = Expr::symbol(j.at("symbol").get<SymbolId>(), j.at("name").get<std::string>());
    } else if (j.contains("sum")) {
      Expr total = j.at("constant").get<int64_t>();
      for (const nlohmann::json& term : j.at("sum")) {
        Expr product = term.at(0).get<int64_t>();
        for (const nlohmann::json& factor : term.at(1)) {
          Expr atom = factor.at(0).get<Expr>();
          int64_t exponent = factor.at(1).get<int64_t>();
          KILN_CHECK(exponent >= 1 && exponent <= 64) << "bad exponent in symbolic size JSON: " << j.dump();
          for (int64_t i = 0; i < exponent; ++i) product = product * atom;
        }
        total = total + product;
      }
      e = total;
    } else {
      KILN_CHECK(j.size() == 1) << "not a symbolic size expression: " << j.dump();
      const std::string& op = j.begin().key();
      std::vector<Expr> args = j.begin().value().get<std::vector<Expr>>();
      bool binary = op == "floordiv" || op == "mod";
      KILN_CHECK(binary ? args.size() == 2 : (op == "min" || op == "max") && !args.empty())
          << "not a symbolic size expression: " << j.dump();
      e = op == "floordiv" ? floordiv(args[0], args[1])
          : op == "mod"    ? mod(args[0], args[1])
          : op == "min"    ? min(args)
                           : max(args);
    }
  } catch (const nlohmann::json::exception& ex) {
    KILN_CHECK(false) << "malformed symbolic size JSON (" << ex.what() << "): " << j.dump();
  }
}

void to_json(nlohmann::json& j, const SizeFacts& facts) {
  auto end = [](int64_t v) { return Range{}.lo == v || Range{}.hi == v ? nlohmann::json() : nlohmann::json(v); };
  nlohmann::json symbols = nlohmann::json::array();
  for (const auto& [id, f] : facts.symbols_)
    symbols.push_back({{"id", id}, {"name", f.name}, {"lo", end(f.range.lo)}, {"hi", end(f.range.hi)},
                       {"divisor", f.divisor}});
  j = {{"symbols", symbols}};
}

void from_json(const nlohmann::json& j, SizeFacts& facts) {
  try {
    facts = SizeFacts();
    for (const nlohmann::json& s : j.at("symbols")) {
      Expr symbol = Expr::symbol(s.at("id").get<SymbolId>(), s.at("name").get<std::string>());
      Range r;
      if (!s.at("lo").is_null()) r.lo = s.at("lo").get<int64_t>();
      if (!s.at("hi").is_null()) r.hi = s.at("hi").get<int64_t>();
      facts.set_range(symbol, r);
      facts.add_divisor(symbol, s.at("divisor").get<int64_t>());
    }
  } catch (const nlohmann::json::exception& ex) {
    KILN_CHECK(false) << "malformed size facts JSON (" << ex.what() << "): " << j.dump();
  }
}

#endif

}  // namespace kiln::graph::sym
