// Symbolic forms of the sizes ATen's composites record as concrete ints (graph/infer_recorded_sizes.h).
//
// Design note: everything here decides on hints, then hands expressions to the shape rules, which prove or assume
// the element count over them as they do for any size argument; a wrong grouping can only add a guard.
#include "graph/infer_recorded_sizes.h"

#include "graph/symbolic_sizes.h"

#include <cmath>
#include <functional>
#include <map>
#include <optional>

namespace kiln::graph {

using sym::Expr;

namespace {

// A product of factors: coefficient * atom_1**e_1 * ...; nullopt for a sum of several terms.
struct Monomial {
  int64_t coefficient = 1;
  std::vector<Expr::Factor> factors;
};

Expr product_of(const Monomial& m) {
  Expr e = m.coefficient;
  for (const Expr::Factor& f : m.factors)
    for (int64_t k = 0; k < f.exponent; ++k) e = e * f.atom;
  return e;
}

std::optional<Monomial> as_monomial(const Expr& e) {
  switch (e.kind()) {
    case sym::ExprKind::kConstant: return Monomial{e.constant_value(), {}};
    case sym::ExprKind::kSum:
      if (e.terms().size() != 1 || e.sum_constant() != 0) return std::nullopt;
      return Monomial{e.terms()[0].coefficient, e.terms()[0].factors};
    default: return Monomial{1, {{e, 1}}};
  }
}

// Input dims [in_begin, in_end) hold as many elements as output dims `outputs` at the hints.
struct Group {
  size_t in_begin = 0, in_end = 0;
  std::vector<size_t> outputs;
};

// Groups the dims of size >= 2 by equal running products of their hints; nullopt when the products never meet.
std::optional<std::vector<Group>> group_dims(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<size_t> in_dims, out_dims;
  for (size_t d = 0; d < in.size(); ++d)
    if (in[d] != 1) in_dims.push_back(d);
  for (size_t d = 0; d < out.size(); ++d)
    if (out[d] != 1) out_dims.push_back(d);
  std::vector<Group> groups;
  size_t i = 0, o = 0;
  while (i < in_dims.size()) {
    Group g;
    g.in_begin = in_dims[i];
    int64_t in_product = in[in_dims[i++]], out_product = 1;
    while (in_product != out_product) {
      if (out_product < in_product) {
        if (o == out_dims.size()) return std::nullopt;
        g.outputs.push_back(out_dims[o]);
        out_product *= out[out_dims[o++]];
      } else {
        if (i == in_dims.size()) return std::nullopt;
        in_product *= in[in_dims[i++]];
      }
    }
    g.in_end = in_dims[i - 1] + 1;
    groups.push_back(std::move(g));
  }
  if (o != out_dims.size()) return std::nullopt;
  return groups;
}

// Fills the inferable outputs of one group from the product of its input sizes.
bool infer_group_by_factors(const Group& g, const RecordedSizes& r, std::vector<Expr>& sizes) {
  auto hint = [&](const Expr& e) { return e.evaluate(*r.hints); };
  Expr product = 1;
  for (size_t d = g.in_begin; d < g.in_end; ++d) product = product * r.input->sizes[d];
  auto is_minus_one = [&](size_t k) { return sizes[k].is_constant() && sizes[k].constant_value() == -1; };
  if (g.outputs.size() == 1) {
    if (r.inferable[g.outputs[0]] && !is_minus_one(g.outputs[0])) sizes[g.outputs[0]] = product;
    return true;
  }
  // Several output dims share the group's product: match each to the one factor of the product its hint names.
  std::optional<Monomial> rest = as_monomial(product);
  bool has_minus_one = false;
  for (size_t k : g.outputs) has_minus_one = has_minus_one || is_minus_one(k);
  for (size_t j = 0; rest && j < g.outputs.size(); ++j) {
    const size_t k = g.outputs[j];
    if (is_minus_one(k)) continue;  // (the rule gives it what the others leave)
    Expr taken;
    if (!r.inferable[k]) {
      taken = sizes[k];
    } else if (j + 1 == g.outputs.size() && !has_minus_one) {
      taken = product_of(*rest);  // the last output is what the others leave (its hint agrees: the products are equal)
    } else {
      // A factor of the product whose hint is the size: a symbol's wins over a part of the constant coefficient
      // (composites fold whole dims: batch times heads, not parts of the heads); two symbols of that hint are
      // ambiguous, and the rest of the group stays concrete.
      const int64_t value = r.output_hints[k];
      std::vector<Expr> atoms;
      for (const Expr::Factor& f : rest->factors)
        if (hint(f.atom) == value) atoms.push_back(f.atom);
      if (atoms.size() > 1 || (atoms.empty() && rest->coefficient % value != 0)) return false;
      taken = atoms.empty() ? Expr(value) : atoms[0];
    }
    std::optional<Expr> quotient = shape::exact_quotient(product_of(*rest), taken);
    if (!quotient || hint(taken) != r.output_hints[k]) return false;
    sizes[k] = taken;
    rest = as_monomial(*quotient);
  }
  return rest.has_value();
}

// The group's other outputs keep their recorded sizes and one output takes the whole symbolic rest: the attention
// output folded back, [s1, s0*8, 64] -> [296, 512], where 296 is s1*s0 (no single factor) and 512 = 8*64. Only when
// exactly one output can (an exact quotient whose hint is its size): otherwise the group stays concrete.
bool infer_group_by_one_rest(const Group& g, const RecordedSizes& r, std::vector<Expr>& sizes) {
  Expr product = 1;
  for (size_t d = g.in_begin; d < g.in_end; ++d) product = product * r.input->sizes[d];
  if (product.is_constant()) return false;
  std::optional<size_t> chosen;
  Expr chosen_size;
  for (size_t k : g.outputs) {
    if (!r.inferable[k] || (sizes[k].is_constant() && sizes[k].constant_value() == -1)) continue;
    Expr others = 1;
    for (size_t j : g.outputs)
      if (j != k) others = others * sizes[j];
    std::optional<Expr> quotient = shape::exact_quotient(product, others);
    if (!quotient || quotient->is_constant() || quotient->evaluate(*r.hints) != r.output_hints[k]) continue;
    if (chosen) return false;  // (two could: ambiguous)
    chosen = k;
    chosen_size = *quotient;
  }
  if (!chosen) return false;
  sizes[*chosen] = chosen_size;
  return true;
}

void infer_group(const Group& g, const RecordedSizes& r, std::vector<Expr>& sizes) {
  std::vector<Expr> by_factors = sizes;
  if (infer_group_by_factors(g, r, by_factors)) {
    sizes = std::move(by_factors);
    return;
  }
  infer_group_by_one_rest(g, r, sizes);
}

std::vector<Expr> view_sizes(const RecordedSizes& r) {
  std::vector<Expr> sizes = r.sizes;
  for (int64_t h : r.input_hints)
    if (h == 0) return sizes;  // (an empty tensor: every grouping fits)
  for (size_t d = 0; d < r.input_hints.size(); ++d)
    if (r.input_hints[d] == 1 && !r.input->sizes[d].is_constant()) return sizes;
  std::optional<std::vector<Group>> groups = group_dims(r.input_hints, r.output_hints);
  if (!groups) return sizes;
  for (const Group& g : *groups) infer_group(g, r, sizes);
  return sizes;
}

// The one input size symbol whose hint is `value` (the lowest id where symbols tied by a guarded equality share it).
std::optional<Expr> symbol_of_hint(const RecordedSizes& r, int64_t value) {
  if (!r.hints || value < 2) return std::nullopt;
  std::optional<sym::SymbolId> found;
  for (const auto& [id, hint] : *r.hints)
    if (hint == value && id < kFirstPlaceholderId && (!found || id < *found)) found = id;
  if (!found) return std::nullopt;
  return input_size_symbol(*found);
}

// expand: a concrete target equal to the (non-1) input size it lines up with is that size. A size-1 (or new leading)
// dim broadcast to a concrete size inside a composite (matmul's batch broadcast of a 2-d weight) took that size from
// another operand, so it is the input symbol of that hint where there is one: the op that consumes the expanded
// tensor (bmm's batch) then proves or guards that it matches its other operand, so a wrong guess only adds a guard.
std::vector<Expr> expand_sizes(const RecordedSizes& r) {
  std::vector<Expr> sizes = r.sizes;
  if (sizes.size() < r.input_hints.size()) return sizes;
  const size_t lead = sizes.size() - r.input_hints.size();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!r.inferable[i]) continue;
    const bool broadcast = i < lead || r.input_hints[i - lead] == 1;
    if (!broadcast && r.output_hints[i] == r.input_hints[i - lead]) {
      sizes[i] = r.input->sizes[i - lead];
    } else if (broadcast && sizes[i].is_constant()) {
      if (std::optional<Expr> symbol = symbol_of_hint(r, r.output_hints[i])) sizes[i] = *symbol;
    }
  }
  return sizes;
}

// The fraction p/q (q <= 64) that `scale` is exactly, or nullopt.
std::optional<std::pair<int64_t, int64_t>> small_fraction(double scale) {
  if (!(scale > 0) || scale > 1e6) return std::nullopt;
  for (int64_t q = 1; q <= 64; ++q) {
    const double p = scale * static_cast<double>(q);
    if (p == std::floor(p) && static_cast<double>(static_cast<int64_t>(p)) / static_cast<double>(q) == scale)
      return std::make_pair(static_cast<int64_t>(p), q);
  }
  return std::nullopt;
}

// upsample_*(input, output_size, ..., scales...): each output size entry (the trailing dims) as the input size times
// its scale, floored, where the scale is a small fraction (see the design note).
std::vector<Expr> upsample_sizes(const RecordedSizes& r) {
  std::vector<Expr> sizes = r.sizes;
  if (r.scales.size() != sizes.size() || r.input_hints.size() < sizes.size()) return sizes;
  const size_t lead = r.input_hints.size() - sizes.size();
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (!r.inferable[k] || !r.scales[k]) continue;
    const std::optional<std::pair<int64_t, int64_t>> f = small_fraction(*r.scales[k]);
    if (!f) continue;
    const Expr& input = r.input->sizes[lead + k];
    if (sym::int_floordiv(r.input_hints[lead + k] * f->first, f->second) == r.output_hints[k])
      sizes[k] = floordiv(input * Expr(f->first), Expr(f->second));
  }
  return sizes;
}

// Adaptive pooling's output_size (the trailing dims): an entry the composite filled in from the input's size (None
// in F.adaptive_avg_pool2d(x, (3, None))) equals that size at the hints, and is that size.
std::vector<Expr> kept_input_sizes(const RecordedSizes& r) {
  std::vector<Expr> sizes = r.sizes;
  if (r.input_hints.size() < sizes.size()) return sizes;
  const size_t lead = r.input_hints.size() - sizes.size();
  for (size_t k = 0; k < sizes.size(); ++k)
    if (r.inferable[k] && r.output_hints[k] == r.input_hints[lead + k]) sizes[k] = r.input->sizes[lead + k];
  return sizes;
}

using Inferrer = std::function<std::vector<Expr>(const RecordedSizes&)>;

const std::map<std::string, std::pair<RecordedSizeArgs, Inferrer>>& table() {
  static const std::map<std::string, std::pair<RecordedSizeArgs, Inferrer>> t = {
      {"aten::view.default", {{0, 1}, view_sizes}},
      {"aten::_unsafe_view.default", {{0, 1}, view_sizes}},
      {"aten::reshape.default", {{0, 1}, view_sizes}},
      {"aten::expand.default", {{0, 1}, expand_sizes}},
      {"aten::upsample_nearest2d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_bilinear2d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_nearest1d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_upsample_nearest_exact1d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_linear1d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_bicubic2d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_upsample_nearest_exact2d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_upsample_bilinear2d_aa.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_upsample_bicubic2d_aa.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_nearest3d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_upsample_nearest_exact3d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::upsample_trilinear3d.default", {{0, 1, false}, upsample_sizes}},
      {"aten::_adaptive_avg_pool2d.default", {{0, 1, false}, kept_input_sizes}},
      {"aten::adaptive_max_pool2d.default", {{0, 1, false}, kept_input_sizes}},
      {"aten::_adaptive_avg_pool3d.default", {{0, 1, false}, kept_input_sizes}},
  };
  return t;
}

}  // namespace

std::optional<RecordedSizeArgs> recorded_size_args(const std::string& op) {
  auto it = table().find(op);
  if (it == table().end()) return std::nullopt;
  return it->second.first;
}

const ScalarSizeForms* scalar_size_forms(const std::string& op) {
  using Sizes = std::vector<Expr>;
  auto batch = [](const Sizes& s) { return s.at(0); };
  auto channels = [](const Sizes& s) { return s.at(1); };
  auto spatial = [](const Sizes& s) {
    Expr p(1);
    for (size_t d = 2; d < s.size(); ++d) p = p * s[d];
    return p;
  };
  static const std::map<std::string, ScalarSizeForms> t = {
      {"aten::native_group_norm.default", {0, {{3, batch}, {4, channels}, {5, spatial}}}},
      {"aten::native_group_norm_backward.default", {1, {{5, batch}, {6, channels}, {7, spatial}}}},
  };
  auto it = t.find(op);
  return it == t.end() ? nullptr : &it->second;
}

std::vector<Expr> infer_recorded_sizes(const std::string& op, const RecordedSizes& r) {
  if (r.sizes.size() != r.output_hints.size() || r.inferable.size() != r.sizes.size() ||
      r.input->sizes.size() != r.input_hints.size())
    return r.sizes;
  std::vector<Expr> sizes = table().at(op).second(r);
  for (size_t k = 0; k < sizes.size(); ++k)  // (each form must be its entry at the hints; keep the entry otherwise)
    if (sizes[k] != r.sizes[k] && sizes[k].evaluate(*r.hints) != r.output_hints[k]) sizes[k] = r.sizes[k];
  return sizes;
}

}  // namespace kiln::graph
