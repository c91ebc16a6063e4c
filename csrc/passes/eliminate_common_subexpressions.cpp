// CSE over the ATen graph: a node's key is its op and its arguments printed exactly (tensor arguments by
// their value id after earlier replacements), so equal keys mean equal results for pure ops.
#include "passes/eliminate_common_subexpressions.h"

#include <sstream>
#include <unordered_map>

#include "passes/remove_dead_nodes.h"

namespace kiln::passes {

namespace {

struct ArgPrinter {
  std::ostream& out;
  void operator()(const graph::NoneArg&) const { out << "None"; }
  void operator()(const graph::TensorArg& t) const { out << '%' << t.id; }
  void operator()(const graph::TensorListArg& l) const {
    out << '[';
    for (const auto& id : l.ids) out << (id ? '%' + std::to_string(*id) : std::string("None")) << ',';
    out << ']';
  }
  void operator()(bool b) const { out << "b" << b; }
  void operator()(int64_t i) const { out << "i" << i; }
  void operator()(double d) const { out << "d" << d; }
  void operator()(const std::complex<double>& c) const { out << "c" << c.real() << "," << c.imag(); }
  void operator()(const std::string& s) const { out << "s'" << s << "'"; }
  void operator()(const std::vector<int64_t>& v) const {
    out << "I[";
    for (auto x : v) out << x << ',';
    out << ']';
  }
  void operator()(const std::vector<double>& v) const {
    out << "D[";
    for (auto x : v) out << x << ',';
    out << ']';
  }
  void operator()(const std::vector<bool>& v) const {
    out << "B[";
    for (bool x : v) out << x << ',';
    out << ']';
  }
  void operator()(const graph::ScalarTypeArg& t) const { out << "dt" << static_cast<int>(t.type); }
  void operator()(const graph::LayoutArg& l) const { out << "l" << static_cast<int>(l.code); }
  void operator()(const graph::MemoryFormatArg& m) const { out << "mf" << static_cast<int>(m.code); }
  void operator()(const graph::Device& d) const { out << "dev" << static_cast<int>(d.type) << ':' << static_cast<int>(d.index); }
};

void replace_ids(graph::ArgValue& arg, const std::vector<graph::ValueId>& replacement) {
  graph::remap_tensors(arg, [&](graph::ValueId id) { return replacement[id]; });
}

}  // namespace

void eliminate_common_subexpressions(graph::Graph& g) {
  std::vector<graph::ValueId> replacement(g.values.size());
  for (size_t i = 0; i < replacement.size(); ++i) replacement[i] = static_cast<graph::ValueId>(i);
  // Graph outputs are never merged: eager returns distinct tensors for `x + 1, x + 1`.
  std::vector<bool> is_output(g.values.size(), false);
  for (graph::ValueId out : g.outputs) is_output[out] = true;
  std::unordered_map<std::string, graph::NodeIndex> seen;
  for (graph::NodeIndex n = 0; n < static_cast<graph::NodeIndex>(g.nodes.size()); ++n) {
    graph::Node& node = g.nodes[n];
    for (graph::ArgValue& arg : node.args) replace_ids(arg, replacement);
    if (!is_pure_node(g, node)) continue;
    bool returned = false;
    for (graph::ValueId out : node.outputs) returned = returned || is_output[out];
    if (returned) continue;
    std::ostringstream key;
    key.precision(17);
    key << node.qualified_name() << '(';
    for (const graph::ArgValue& arg : node.args) {
      std::visit(ArgPrinter{key}, arg);
      key << ';';
    }
    key << ')';
    for (graph::ValueId out : node.outputs) key << graph::meta_to_string(g.values[out].meta) << g.values[out].meta.storage_offset;
    auto [it, inserted] = seen.emplace(key.str(), n);
    if (inserted) continue;
    const graph::Node& first = g.nodes[it->second];
    for (size_t i = 0; i < node.outputs.size(); ++i) replacement[node.outputs[i]] = first.outputs[i];
  }
  for (graph::ValueId& out : g.outputs) out = replacement[out];
}

}  // namespace kiln::passes
