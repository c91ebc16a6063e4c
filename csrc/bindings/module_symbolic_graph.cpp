// Symbolic sizes of captured graphs, from Python (tests/python/test_symbolic_graph.py): kiln._C.Graph methods that
// mark input dims symbolic and run graph/propagate_symbolic_sizes, read each value's sizes as text, evaluate them at
// other symbol values, and a round trip through graph bytes or JSON. Nothing in kiln's pipeline calls these yet.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>

#include "bindings/module_register.h"
#include "common/error.h"
#include "graph/graph_bytes.h"
#include "graph/propagate_symbolic_sizes.h"

namespace py = pybind11;

namespace kiln::bindings {

namespace {
using graph::Graph;
namespace sym = graph::sym;

std::map<std::string, sym::Expr> symbols_by_name(const Graph& g) {
  std::map<std::string, sym::Expr> out;
  if (g.symbolic) {
    for (const graph::SymbolOrigin& o : g.symbolic->symbols) out.emplace(o.symbol.symbol_name(), o.symbol);
    for (const graph::SizePlaceholder& p : g.symbolic->placeholders) out.emplace(p.symbol.symbol_name(), p.symbol);
  }
  return out;
}

// "lhs OP rhs" with OP one of == != < <= > >=, over the graph's symbols and placeholders.
graph::shape::Assumption parse_relation(const std::string& text, const std::string& reason,
                                        const std::map<std::string, sym::Expr>& symbols) {
  using Kind = graph::shape::Assumption::Kind;
  static const std::pair<const char*, Kind> ops[] = {{"==", Kind::kEq}, {"!=", Kind::kNe}, {"<=", Kind::kLe},
                                                     {">=", Kind::kLe}, {"<", Kind::kLt},  {">", Kind::kLt}};
  for (const auto& [op, kind] : ops) {
    const size_t at = text.find(op);
    if (at == std::string::npos) continue;
    sym::Expr lhs = sym::parse_expr(text.substr(0, at), symbols);
    sym::Expr rhs = sym::parse_expr(text.substr(at + std::string(op).size()), symbols);
    if (op[0] == '>') std::swap(lhs, rhs);
    return {kind, lhs, rhs, reason};
  }
  KILN_CHECK(false) << "'" << text << "' is no relation (==, !=, <, <=, >, >=)";
  return {};
}

py::dict summary(const Graph& g) {
  py::dict out;
  py::list symbols, values, assumptions, specialisations, placeholders, int_args;
  if (g.symbolic) {
    const graph::SymbolicSizes& s = *g.symbolic;
    for (const graph::SymbolOrigin& o : s.symbols) {
      py::dict d;
      d["name"] = o.symbol.symbol_name();
      d["input"] = o.input_index;
      d["dim"] = o.dim;
      d["hint"] = o.hint;
      d["range"] = s.facts.range(o.symbol.symbol_id()).to_string();
      symbols.append(d);
    }
    for (const graph::shape::Assumption& a : s.assumptions) {
      py::dict d;
      d["text"] = a.to_string();
      d["reason"] = a.reason;
      assumptions.append(d);
    }
    for (const graph::Specialisation& sp : s.specialisations) {
      py::dict d;
      d["symbol"] = sp.symbol.symbol_name();
      d["value"] = sp.value;
      d["reason"] = sp.reason;
      specialisations.append(d);
    }
    for (const graph::SizePlaceholder& p : s.placeholders) {
      py::dict d;
      d["name"] = p.symbol.symbol_name();
      d["value"] = p.value;
      d["dim"] = p.dim;
      d["resolved"] = p.resolved ? py::cast(p.resolved->to_string()) : py::none();
      placeholders.append(d);
    }
    for (const graph::SymbolicIntArg& a : s.int_args)
      int_args.append(py::make_tuple(a.node, a.arg, a.element, a.value.to_string()));
  }
  for (const graph::Value& v : g.values) {
    const graph::shape::SymTensorMeta m = graph::symbolic_meta(g, v.id);
    py::list sizes;
    for (const sym::Expr& e : m.sizes) sizes.append(e.to_string());
    values.append(sizes);
  }
  out["symbols"] = symbols;
  out["values"] = values;
  out["assumptions"] = assumptions;
  out["specialisations"] = specialisations;
  out["placeholders"] = placeholders;
  out["int_args"] = int_args;
  return out;
}

using IntArgs = std::vector<std::tuple<int32_t, int32_t, int32_t, std::string>>;
using Placeholders = std::vector<std::tuple<graph::ValueId, int32_t>>;
using Relations = std::vector<std::tuple<std::string, std::string>>;

py::dict propagate(Graph& g, const std::map<int32_t, std::vector<int64_t>>& dynamic, const IntArgs& int_args,
                   const Placeholders& placeholders, const Relations& trace_assumptions) {
  KILN_CHECK(!g.symbolic) << "this graph's symbolic sizes were propagated already";
  try {
    for (const auto& [input, dims] : dynamic) graph::mark_symbolic_dims(g, input, dims);
    for (size_t i = 0; i < placeholders.size(); ++i) {
      const auto& [value, dim] = placeholders[i];
      graph::add_size_placeholder(g, {graph::size_placeholder_symbol(static_cast<int32_t>(i)), value, dim, {}});
    }
    const auto symbols = symbols_by_name(g);
    for (const auto& [node, arg, element, text] : int_args)
      graph::mark_symbolic_int_arg(g, {node, arg, element, sym::parse_expr(text, symbols)});
    for (const auto& [text, reason] : trace_assumptions)
      graph::add_trace_assumption(g, parse_relation(text, reason, symbols));
    graph::propagate_symbolic_sizes(g);
    g.verify(false);
  } catch (...) {
    g.symbolic = nullptr;  // the graph as it was: a failed call marks nothing
    throw;
  }
  return summary(g);
}

py::dict evaluate(const Graph& g, const std::map<std::string, int64_t>& values) {
  const auto symbols = symbols_by_name(g);
  sym::Bindings bindings;
  for (const auto& [name, value] : values) {
    auto it = symbols.find(name);
    KILN_CHECK(it != symbols.end()) << "the graph has no symbol " << name;
    bindings[it->second.symbol_id()] = value;
  }
  py::list metas, failed;
  for (const graph::Value& v : g.values) {
    graph::TensorMeta m = graph::evaluate_meta(g, v.id, bindings);
    metas.append(py::make_tuple(m.sizes, m.strides, m.storage_offset));
  }
  // A specialised symbol is a guard too: the graph holds only at its value.
  if (g.symbolic) {
    for (const graph::shape::Assumption& a : g.symbolic->assumptions)
      if (!a.holds(bindings)) failed.append(a.to_string());
    for (const graph::Specialisation& sp : g.symbolic->specialisations) {
      auto it = bindings.find(sp.symbol.symbol_id());
      if (it != bindings.end() && it->second != sp.value)
        failed.append(sp.symbol.symbol_name() + " == " + std::to_string(sp.value));
    }
  }
  py::dict out;
  out["metas"] = metas;
  out["failed_assumptions"] = failed;
  return out;
}

std::shared_ptr<Graph> round_trip(const Graph& g, const std::string& format) {
  if (format == "json") return std::make_shared<Graph>(graph::graph_from_json(g.to_json()));
  KILN_CHECK(format == "bytes") << "format is 'bytes' or 'json', not '" << format << "'";
  graph::ByteWriter w;
  graph::write_graph(w, g);
  const std::string bytes = w.take();
  graph::ByteReader r(bytes);
  auto out = std::make_shared<Graph>(graph::read_graph(r));
  KILN_CHECK(r.at_end()) << "graph bytes: trailing bytes after the graph";
  return out;
}
// A copy of `g` (built from records, its constants holding tensors) with the symbolic table of `graph_json`, the JSON
// of the same graph (Graph::to_json): kiln.load's way back to a dynamic program.
std::shared_ptr<Graph> with_symbolic_sizes(const Graph& g, const std::string& graph_json) {
  const Graph parsed = graph::graph_from_json(graph_json);
  KILN_CHECK(parsed.values.size() == g.values.size() && parsed.inputs == g.inputs)
      << "the graph JSON describes another graph (" << parsed.values.size() << " values, " << g.values.size()
      << " expected)";
  auto out = std::make_shared<Graph>(g);
  out->symbolic = parsed.symbolic;
  out->verify();
  return out;
}
}  // namespace

void register_symbolic_graph(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<Graph, std::shared_ptr<Graph>>>(m.attr("Graph"));
  cls.def("propagate_symbolic_sizes", &propagate, py::arg("dynamic"), py::arg("int_args") = IntArgs{},
          py::arg("placeholders") = Placeholders{}, py::arg("trace_assumptions") = Relations{},
          "mark dims of inputs symbolic ({input index: [dims]}), name sizes of values by placeholders p0, p1, ... "
          "([(value, dim)], in order), mark int arguments as size expressions ([(node, arg, element or -1, "
          "expression text over the symbols and placeholders)]), add the trace's relations ([(text such as "
          "'p0 > 16', reason)]), and propagate sizes through the graph's shape rules: {'symbols', 'values' (each "
          "value's sizes as text), 'assumptions', 'specialisations', 'placeholders' ({'name', 'value', 'dim', "
          "'resolved'}), 'int_args' (the symbolic int arguments after propagation, inferred ones included)}");
  cls.def("symbolic_summary", &summary, "what propagate_symbolic_sizes returned");
  cls.def("evaluate_sizes", &evaluate, py::arg("symbols"),
          "each value's (sizes, strides, storage offset) at the given symbol values ({'s0': 12}), and the "
          "assumptions and specialisations that fail there (the graph would recompile): {'metas', 'failed_assumptions'}");
  m.def("_graph_with_symbolic_sizes", &with_symbolic_sizes, py::arg("graph"), py::arg("graph_json"),
        "`graph` with the symbolic table of `graph_json` (Graph.to_json of the same graph), for kiln.load");
  m.def("_graph_round_trip", &round_trip, py::arg("graph"), py::arg("format"),
        "the graph written as 'bytes' (the graph cache's form) or 'json' and read back (constants without tensors)");
}

}  // namespace kiln::bindings
