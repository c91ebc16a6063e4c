// The symbolic size table of a Graph (graph/symbolic_sizes.h): access, evaluation, text, and its verifier.
#include "graph/symbolic_sizes.h"

#include <limits>
#include <sstream>

#include "common/error.h"

namespace kiln::graph {

using sym::Expr;

Expr input_size_symbol(int32_t k) {
  KILN_CHECK(k >= 0 && k < kFirstPlaceholderId) << "input size symbol index " << k << " out of range";
  std::string name = "s";  // (appended: GCC 12 warns about "s" + std::to_string)
  name += std::to_string(k);
  return Expr::symbol(k, std::move(name));
}

Expr size_placeholder_symbol(int32_t k) {
  KILN_CHECK(k >= 0 && k < std::numeric_limits<sym::SymbolId>::max() - kFirstPlaceholderId)
      << "size placeholder index " << k << " out of range";
  std::string name = "p";
  name += std::to_string(k);
  return Expr::symbol(kFirstPlaceholderId + k, std::move(name));
}

bool is_size_placeholder(const Expr& e) { return e.is_symbol() && e.symbol_id() >= kFirstPlaceholderId; }

sym::Bindings SymbolicSizes::hints() const {
  sym::Bindings bindings;
  for (const SymbolOrigin& o : symbols) bindings[o.symbol.symbol_id()] = o.hint;
  return bindings;
}

sym::Bindings SymbolicSizes::hints_with_placeholders(const Graph& g) const {
  sym::Bindings bindings = hints();
  for (const SizePlaceholder& p : placeholders) {
    if (p.resolved || p.value < 0 || static_cast<size_t>(p.value) >= g.values.size()) continue;
    const std::vector<int64_t>& sizes = g.values[p.value].meta.sizes;
    if (p.dim >= 0 && static_cast<size_t>(p.dim) < sizes.size()) bindings[p.symbol.symbol_id()] = sizes[p.dim];
  }
  return bindings;
}

const SizePlaceholder* SymbolicSizes::placeholder(sym::SymbolId id) const {
  for (const SizePlaceholder& p : placeholders)
    if (p.symbol.symbol_id() == id) return &p;
  return nullptr;
}

const SymbolOrigin* SymbolicSizes::origin(sym::SymbolId id) const {
  for (const SymbolOrigin& o : symbols)
    if (o.symbol.symbol_id() == id) return &o;
  return nullptr;
}

const shape::SymTensorMeta* SymbolicSizes::meta(ValueId id) const {
  if (id < 0 || static_cast<size_t>(id) >= metas.size() || !metas[id]) return nullptr;
  return &*metas[id];
}

SymbolicSizes& mutable_symbolic(Graph& g) {
  if (!g.symbolic)
    g.symbolic = std::make_shared<SymbolicSizes>();
  else if (g.symbolic.use_count() > 1)
    g.symbolic = std::make_shared<SymbolicSizes>(*g.symbolic);
  return *g.symbolic;
}

shape::SymTensorMeta constant_meta(const TensorMeta& meta) {
  shape::SymTensorMeta m;
  m.sizes.assign(meta.sizes.begin(), meta.sizes.end());
  m.strides.assign(meta.strides.begin(), meta.strides.end());
  m.storage_offset = meta.storage_offset;
  m.dtype = meta.dtype;
  m.device = meta.device;
  return m;
}

shape::SymTensorMeta symbolic_meta(const Graph& g, ValueId id) {
  if (g.symbolic)
    if (const shape::SymTensorMeta* m = g.symbolic->meta(id)) return *m;
  return constant_meta(g.value(id).meta);
}

std::string symbolic_meta_to_string(const shape::SymTensorMeta& meta, const TensorMeta& concrete) {
  auto list = [](std::ostream& os, const std::vector<Expr>& exprs) {
    for (size_t i = 0; i < exprs.size(); ++i) os << (i ? ", " : "") << exprs[i].to_string();
  };
  std::ostringstream os;
  os << scalar_type_name(meta.dtype) << "[";
  list(os, meta.sizes);
  os << "]";
  const bool offset = meta.storage_offset != Expr(0);
  if (meta.strides != shape::contiguous_strides(meta.sizes) || offset) {
    os << "(";
    list(os, meta.strides);
    if (offset) os << (meta.strides.empty() ? "" : ", ") << "offset=" << meta.storage_offset.to_string();
    os << ")";
  }
  // The device and grad suffixes as meta_to_string writes them.
  std::string tail = meta_to_string(TensorMeta{{}, {}, 0, concrete.dtype, concrete.device, concrete.requires_grad});
  os << tail.substr(tail.find(']') + 1);
  return os.str();
}

TensorMeta evaluate_meta(const Graph& g, ValueId id, const sym::Bindings& bindings) {
  TensorMeta out = g.value(id).meta;
  const shape::SymTensorMeta* m = g.symbolic ? g.symbolic->meta(id) : nullptr;
  if (!m) return out;
  out.sizes.clear();
  out.strides.clear();
  for (const Expr& e : m->sizes) out.sizes.push_back(e.evaluate(bindings));
  for (const Expr& e : m->strides) out.strides.push_back(e.evaluate(bindings));
  out.storage_offset = m->storage_offset.evaluate(bindings);
  return out;
}

void verify_symbolic_sizes(const Graph& g) {
  if (!g.symbolic) return;
  const SymbolicSizes& s = *g.symbolic;
  KILN_ASSERT(s.metas.size() <= g.values.size())
      << "graph verifier: symbolic metas for " << s.metas.size() << " values, the graph has " << g.values.size();
  const sym::Bindings hints = s.hints();
  for (const SymbolOrigin& o : s.symbols) {
    KILN_ASSERT(o.symbol.is_symbol() && !is_size_placeholder(o.symbol))
        << "graph verifier: " << o.symbol.to_string() << " is listed as an input symbol";
    KILN_ASSERT(o.input_index >= 0 && static_cast<size_t>(o.input_index) < g.inputs.size())
        << "graph verifier: symbol " << o.symbol.to_string() << " comes from input " << o.input_index
        << ", the graph has " << g.inputs.size();
    const TensorMeta& in = g.value(g.inputs[o.input_index]).meta;
    KILN_ASSERT(o.dim >= 0 && static_cast<size_t>(o.dim) < in.sizes.size() && in.sizes[o.dim] == o.hint)
        << "graph verifier: symbol " << o.symbol.to_string() << " (hint " << o.hint << ") names dim " << o.dim
        << " of input " << o.input_index << " " << meta_to_string(in);
  }
  for (const SizePlaceholder& p : s.placeholders) {
    KILN_ASSERT(is_size_placeholder(p.symbol)) << "graph verifier: placeholder " << p.symbol.to_string()
                                               << " is not of the placeholders' id range";
    KILN_ASSERT(p.value >= 0 && static_cast<size_t>(p.value) < g.values.size() && p.dim >= 0 &&
                static_cast<size_t>(p.dim) < g.values[p.value].meta.sizes.size())
        << "graph verifier: placeholder " << p.symbol.to_string() << " names dim " << p.dim << " of value %"
        << p.value;
  }
  // Placeholders may stand in int arguments and trace assumptions until propagation resolves them; nowhere else.
  const sym::Bindings pending = s.hints_with_placeholders(g);
  auto bound = [&](const Expr& e, const std::string& where, const sym::Bindings& allowed) {
    for (const Expr& symbol : e.free_symbols())
      KILN_ASSERT(allowed.count(symbol.symbol_id()))
          << "graph verifier: " << where << " names " << symbol.to_string()
          << (is_size_placeholder(symbol) ? ", a placeholder propagation has resolved or never knew"
                                          : ", which no input dim defines");
  };
  for (const SizePlaceholder& p : s.placeholders) {
    if (!p.resolved) continue;
    const std::string where = "placeholder " + p.symbol.to_string() + " = " + p.resolved->to_string();
    bound(*p.resolved, where, hints);
    KILN_ASSERT(p.resolved->evaluate(hints) == g.values[p.value].meta.sizes[p.dim])
        << "graph verifier: " << where << " is not size " << p.dim << " of value %" << p.value << " "
        << meta_to_string(g.values[p.value].meta) << " at the hints";
  }
  for (ValueId id = 0; static_cast<size_t>(id) < s.metas.size(); ++id) {
    if (!s.metas[id]) continue;
    const shape::SymTensorMeta& m = *s.metas[id];
    const TensorMeta& concrete = g.values[id].meta;
    const std::string where = "value %" + std::to_string(id) + " " + symbolic_meta_to_string(m, concrete);
    KILN_ASSERT(m.sizes.size() == concrete.sizes.size() && m.strides.size() == concrete.strides.size() &&
                m.dtype == concrete.dtype)
        << "graph verifier: " << where << " does not match its concrete meta " << meta_to_string(concrete);
    for (const Expr& e : m.sizes) bound(e, where, hints);
    for (const Expr& e : m.strides) bound(e, where, hints);
    bound(m.storage_offset, where, hints);
    const TensorMeta at_hints = evaluate_meta(g, id, hints);
    KILN_ASSERT(at_hints.sizes == concrete.sizes && at_hints.strides == concrete.strides &&
                at_hints.storage_offset == concrete.storage_offset)
        << "graph verifier: " << where << " is " << meta_to_string(at_hints) << " at the hints, not "
        << meta_to_string(concrete);
  }
  auto check_assumption = [&](const shape::Assumption& a, const sym::Bindings& allowed) {
    bound(a.lhs, "assumption " + a.to_string(), allowed);
    bound(a.rhs, "assumption " + a.to_string(), allowed);
    KILN_ASSERT(a.holds(allowed)) << "graph verifier: assumption " << a.to_string() << " (" << a.reason
                                  << ") fails at the hints";
  };
  for (const shape::Assumption& a : s.assumptions) check_assumption(a, hints);
  for (const shape::Assumption& a : s.trace_assumptions) check_assumption(a, pending);
  for (const Specialisation& sp : s.specialisations) bound(sp.symbol, "specialisation", hints);
  for (const SymbolicIntArg& a : s.int_args) {
    KILN_ASSERT(a.node >= 0 && static_cast<size_t>(a.node) < g.nodes.size() && a.arg >= 0 &&
                static_cast<size_t>(a.arg) < g.nodes[a.node].args.size())
        << "graph verifier: a symbolic int argument names node " << a.node << " argument " << a.arg;
    const ArgValue& arg = g.nodes[a.node].args[a.arg];
    std::optional<int64_t> value;
    if (auto* i = std::get_if<int64_t>(&arg); i && a.element < 0) value = *i;
    if (auto* list = std::get_if<std::vector<int64_t>>(&arg); list && a.element >= 0 &&
                                                              static_cast<size_t>(a.element) < list->size())
      value = (*list)[a.element];
    bound(a.value, "symbolic int argument " + a.value.to_string(), pending);
    KILN_ASSERT(value && *value == a.value.evaluate(pending))
        << "graph verifier: node " << a.node << " (" << g.nodes[a.node].qualified_name() << ") argument " << a.arg
        << (a.element >= 0 ? "[" + std::to_string(a.element) + "]" : "") << " is not an int equal to "
        << a.value.to_string() << " at the hints";
  }
}

std::string symbolic_sizes_to_string(const SymbolicSizes& s) {
  std::ostringstream os;
  for (const SymbolOrigin& o : s.symbols)
    os << "  # " << o.symbol.to_string() << ": input " << o.input_index << " dim " << o.dim << ", hint " << o.hint
       << ", range " << s.facts.range(o.symbol.symbol_id()).to_string()
       << (s.facts.divisor(o.symbol.symbol_id()) > 1 ? ", multiple of " + std::to_string(s.facts.divisor(o.symbol.symbol_id())) : "")
       << "\n";
  for (const shape::Assumption& a : s.assumptions) os << "  # guard " << a.to_string() << ": " << a.reason << "\n";
  for (const Specialisation& sp : s.specialisations)
    os << "  # specialised " << sp.symbol.to_string() << " = " << sp.value << ": " << sp.reason << "\n";
  return os.str();
}

}  // namespace kiln::graph
