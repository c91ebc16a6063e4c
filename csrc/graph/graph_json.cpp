// Graph::to_json: a machine-readable dump for KILN_DEBUG_DIR, tools and kiln.export's files (python/kiln/export.py
// reads it back, and so does graph_from_json for the C++ loader, csrc/export). Each argument is an object {"name", "kind", "value"} so readers need no schema; constants appear
// by meta only (their data stays in Python; export saves them with the weights). A graph with symbolic sizes adds
// "symbolic" to the values that have them ({"sizes", "strides", "storage_offset"} as sym::Expr JSON) and a top-level
// "symbolic" object (symbols with origins and hints, facts, symbolic int arguments, assumptions, specialisations).
#include <algorithm>
#include <cmath>
#include <optional>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/symbolic_sizes.h"

#if __has_include(<nlohmann/json.hpp>)
#include <nlohmann/json.hpp>
#define KILN_HAVE_JSON 1
#endif

namespace kiln::graph {

#ifdef KILN_HAVE_JSON
namespace {
using json = nlohmann::json;

// JSON has no NaN or infinity: those doubles are written as the strings "nan", "inf" and "-inf" (what Python's
// float() reads back), every other double as a number that reads back to the same bits.
json real_json(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  return d;
}

json device_json(const Device& d) { return {{"type", device_type_name(d.type)}, {"index", d.index}}; }

json meta_json(const TensorMeta& m) {
  return {{"sizes", m.sizes},
          {"strides", m.strides},
          {"storage_offset", m.storage_offset},
          {"dtype", scalar_type_name(m.dtype)},
          {"dtype_code", static_cast<int>(m.dtype)},
          {"device", device_json(m.device)},
          {"requires_grad", m.requires_grad}};
}

// (kind, value) per ArgValue alternative.
struct ArgJson {
  json operator()(const NoneArg&) const { return {{"kind", "none"}, {"value", nullptr}}; }
  json operator()(const TensorArg& t) const { return {{"kind", "tensor"}, {"value", t.id}}; }
  json operator()(const TensorListArg& list) const {
    json ids = json::array();
    for (const auto& id : list.ids) ids.push_back(id ? json(*id) : json(nullptr));
    return {{"kind", "tensor_list"}, {"value", ids}};
  }
  json operator()(bool b) const { return {{"kind", "bool"}, {"value", b}}; }
  json operator()(int64_t i) const { return {{"kind", "int"}, {"value", i}}; }
  json operator()(double d) const { return {{"kind", "float"}, {"value", real_json(d)}}; }
  json operator()(const std::complex<double>& c) const {
    return {{"kind", "complex"}, {"value", {real_json(c.real()), real_json(c.imag())}}};
  }
  json operator()(const std::string& s) const { return {{"kind", "str"}, {"value", s}}; }
  json operator()(const std::vector<int64_t>& v) const { return {{"kind", "int_list"}, {"value", v}}; }
  json operator()(const std::vector<double>& v) const {
    json reals = json::array();
    for (double d : v) reals.push_back(real_json(d));
    return {{"kind", "float_list"}, {"value", reals}};
  }
  json operator()(const std::vector<bool>& v) const { return {{"kind", "bool_list"}, {"value", v}}; }
  json operator()(const ScalarTypeArg& t) const {
    return {{"kind", "dtype"}, {"value", scalar_type_name(t.type)}, {"code", static_cast<int>(t.type)}};
  }
  json operator()(const LayoutArg& l) const { return {{"kind", "layout"}, {"value", l.code}}; }
  json operator()(const MemoryFormatArg& m) const { return {{"kind", "memory_format"}, {"value", m.code}}; }
  json operator()(const Device& d) const { return {{"kind", "device"}, {"value", device_json(d)}}; }
};

// ---- symbolic sizes ---------------------------------------------------------------------------------------------
constexpr const char* kAssumptionKinds[] = {"eq", "ne", "lt", "le", "divisible"};  // Assumption::Kind's order

json sym_meta_json(const shape::SymTensorMeta& m) {
  return {{"sizes", m.sizes}, {"strides", m.strides}, {"storage_offset", m.storage_offset}};
}

json symbolic_json(const SymbolicSizes& s) {
  json symbols = json::array(), int_args = json::array(), assumptions = json::array(), pins = json::array();
  for (const SymbolOrigin& o : s.symbols)
    symbols.push_back({{"symbol", o.symbol}, {"input_index", o.input_index}, {"dim", o.dim}, {"hint", o.hint}});
  for (const SymbolicIntArg& a : s.int_args)
    int_args.push_back({{"node", a.node}, {"arg", a.arg}, {"element", a.element}, {"value", a.value}});
  for (const shape::Assumption& a : s.assumptions)
    assumptions.push_back({{"kind", kAssumptionKinds[static_cast<int>(a.kind)]}, {"lhs", a.lhs}, {"rhs", a.rhs},
                           {"reason", a.reason}, {"text", a.to_string()}});
  for (const Specialisation& sp : s.specialisations)
    pins.push_back({{"symbol", sp.symbol}, {"value", sp.value}, {"reason", sp.reason}});
  return {{"symbols", symbols}, {"facts", s.facts}, {"int_args", int_args}, {"assumptions", assumptions},
          {"specialisations", pins}};
}

sym::Expr symbol_from_json(const json& j) {
  sym::Expr e = j.get<sym::Expr>();
  KILN_CHECK(e.is_symbol()) << "graph JSON: " << e.to_string() << " where a size symbol belongs";
  return e;
}

// The top-level "symbolic" object and the values' "symbolic" metas, into g.
void symbolic_from_json(const json& doc, Graph& g) {
  const json& j = doc.at("symbolic");
  SymbolicSizes& s = mutable_symbolic(g);
  s.facts = j.at("facts").get<sym::SizeFacts>();
  for (const json& o : j.at("symbols"))
    s.symbols.push_back({symbol_from_json(o.at("symbol")), o.at("input_index").get<int32_t>(), o.at("dim").get<int32_t>(),
                         o.at("hint").get<int64_t>()});
  for (const json& a : j.at("int_args"))
    s.int_args.push_back({a.at("node").get<NodeIndex>(), a.at("arg").get<int32_t>(), a.at("element").get<int32_t>(),
                          a.at("value").get<sym::Expr>()});
  for (const json& a : j.at("assumptions")) {
    shape::Assumption assumption;
    const std::string& kind = a.at("kind").get_ref<const std::string&>();
    auto it = std::find(std::begin(kAssumptionKinds), std::end(kAssumptionKinds), kind);
    KILN_CHECK(it != std::end(kAssumptionKinds)) << "graph JSON: unknown assumption kind '" << kind << "'";
    assumption.kind = static_cast<shape::Assumption::Kind>(it - std::begin(kAssumptionKinds));
    assumption.lhs = a.at("lhs").get<sym::Expr>();
    assumption.rhs = a.at("rhs").get<sym::Expr>();
    assumption.reason = a.at("reason").get<std::string>();
    s.assumptions.push_back(std::move(assumption));
  }
  for (const json& sp : j.at("specialisations"))
    s.specialisations.push_back(
        {symbol_from_json(sp.at("symbol")), sp.at("value").get<int64_t>(), sp.at("reason").get<std::string>()});
  const json& values = doc.at("values");
  s.metas.resize(g.values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (!values[i].contains("symbolic")) continue;
    const json& m = values[i]["symbolic"];
    shape::SymTensorMeta meta;
    meta.sizes = m.at("sizes").get<std::vector<sym::Expr>>();
    meta.strides = m.at("strides").get<std::vector<sym::Expr>>();
    meta.storage_offset = m.at("storage_offset").get<sym::Expr>();
    meta.dtype = g.values[i].meta.dtype;
    meta.device = g.values[i].meta.device;
    KILN_CHECK(meta.sizes.size() == meta.strides.size())
        << "graph JSON: value " << i << " has " << meta.sizes.size() << " symbolic sizes and " << meta.strides.size()
        << " strides";
    s.metas[i] = std::move(meta);
  }
}

// ---- reading back (graph_from_json) ---------------------------------------------------------------------------
double real_from_json(const json& j) {
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    if (s == "nan") return std::nan("");
    if (s == "inf") return INFINITY;
    if (s == "-inf") return -INFINITY;
    KILN_CHECK(false) << "graph JSON: '" << s << "' is not a number";
  }
  return j.get<double>();
}

Device device_from_json(const json& j) {
  const std::string& name = j.at("type").get_ref<const std::string&>();
  Device d;
  d.index = j.at("index").get<int8_t>();
  for (DeviceType type : {DeviceType::CPU, DeviceType::CUDA, DeviceType::HIP, DeviceType::XLA, DeviceType::XPU,
                          DeviceType::MPS, DeviceType::Meta}) {
    if (device_type_name(type) == name) {
      d.type = type;
      return d;
    }
  }
  KILN_CHECK(false) << "graph JSON: unknown device type '" << name << "'";
  return d;
}

TensorMeta meta_from_json(const json& j) {
  TensorMeta m;
  m.sizes = j.at("sizes").get<std::vector<int64_t>>();
  m.strides = j.at("strides").get<std::vector<int64_t>>();
  KILN_CHECK(m.sizes.size() == m.strides.size()) << "graph JSON: a value has " << m.sizes.size() << " sizes and "
                                                  << m.strides.size() << " strides";
  m.storage_offset = j.at("storage_offset").get<int64_t>();
  m.dtype = static_cast<ScalarType>(j.at("dtype_code").get<int8_t>());
  m.device = device_from_json(j.at("device"));
  m.requires_grad = j.at("requires_grad").get<bool>();
  return m;
}

// The inverse of ArgJson, by the "kind" it wrote.
ArgValue arg_from_json(const json& a) {
  const std::string& kind = a.at("kind").get_ref<const std::string&>();
  const json& v = a.at("value");
  if (kind == "none") return NoneArg{};
  if (kind == "tensor") return TensorArg{v.get<ValueId>()};
  if (kind == "tensor_list") {
    TensorListArg list;
    for (const json& id : v) list.ids.push_back(id.is_null() ? std::nullopt : std::optional<ValueId>(id.get<ValueId>()));
    return list;
  }
  if (kind == "bool") return v.get<bool>();
  if (kind == "int") return v.get<int64_t>();
  if (kind == "float") return real_from_json(v);
  if (kind == "complex") return std::complex<double>(real_from_json(v.at(0)), real_from_json(v.at(1)));
  if (kind == "str") return v.get<std::string>();
  if (kind == "int_list") return v.get<std::vector<int64_t>>();
  if (kind == "float_list") {
    std::vector<double> reals;
    for (const json& d : v) reals.push_back(real_from_json(d));
    return reals;
  }
  if (kind == "bool_list") return v.get<std::vector<bool>>();
  if (kind == "dtype") return ScalarTypeArg{static_cast<ScalarType>(a.at("code").get<int8_t>())};
  if (kind == "layout") return LayoutArg{v.get<int8_t>()};
  if (kind == "memory_format") return MemoryFormatArg{v.get<int8_t>()};
  if (kind == "device") return device_from_json(v);
  KILN_CHECK(false) << "graph JSON: unknown argument kind '" << kind << "'";
  return NoneArg{};
}

Graph graph_from_document(const json& doc) {
  Graph g;
  const json& values = doc.at("values");
  g.values.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const json& entry = values[i];
    Value& v = g.values[i];
    v.id = static_cast<ValueId>(i);
    KILN_CHECK(entry.at("id").get<ValueId>() == v.id) << "graph JSON: value " << i << " has id " << entry.at("id");
    v.meta = meta_from_json(entry.at("meta"));
    if (entry.contains("input_index")) {
      v.is_input = true;
      v.input_index = entry["input_index"].get<int32_t>();
    }
    v.is_constant = entry.value("constant", false);
    v.producer = entry.value("producer", -1);
  }
  g.inputs = doc.at("inputs").get<std::vector<ValueId>>();
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    const ValueId id = g.inputs[i];
    KILN_CHECK(id >= 0 && static_cast<size_t>(id) < g.values.size() && g.values[id].input_index == static_cast<int32_t>(i))
        << "graph JSON: input " << i << " names value " << id << ", which is not that input";
  }
  for (const json& n : doc.at("nodes")) {
    Node node;
    node.op = n.at("op").get<std::string>();
    node.overload = n.at("overload").get<std::string>();
    node.num_positional = 0;
    bool keyword_seen = false;
    for (const json& a : n.at("args")) {
      node.args.push_back(arg_from_json(a));
      node.arg_names.push_back(a.at("name").get<std::string>());
      if (a.at("kwarg_only").get<bool>()) keyword_seen = true;
      else if (!keyword_seen) ++node.num_positional;
    }
    node.outputs = n.at("outputs").get<std::vector<ValueId>>();
    node.returns_list = n.at("returns_list").get<bool>();
    node.mutates_args = n.at("mutates_args").get<bool>();
    node.is_view = n.at("is_view").get<bool>();
    for (ValueId out : node.outputs)
      KILN_CHECK(out >= 0 && static_cast<size_t>(out) < g.values.size() &&
                 g.values[out].producer == static_cast<NodeIndex>(g.nodes.size()))
          << "graph JSON: node " << g.nodes.size() << " (" << node.qualified_name() << ") defines value " << out
          << ", which names another producer";
    g.nodes.push_back(std::move(node));
  }
  g.outputs = doc.at("outputs").get<std::vector<ValueId>>();
  if (doc.contains("symbolic")) symbolic_from_json(doc, g);
  return g;
}
}  // namespace

Graph graph_from_json(const std::string& text) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    KILN_CHECK(false) << "graph JSON does not parse: " << e.what();
  }
  try {
    return graph_from_document(doc);
  } catch (const json::exception& e) {
    KILN_CHECK(false) << "graph JSON is malformed: " << e.what();
  }
  return {};
}

std::string Graph::to_json(int indent) const {
  json values_json = json::array();
  for (const Value& v : values) {
    json entry = {{"id", v.id}, {"meta", meta_json(v.meta)}};
    if (v.is_input) entry["input_index"] = v.input_index;
    if (v.is_constant) entry["constant"] = true;
    if (v.producer >= 0) entry["producer"] = v.producer;
    if (symbolic)
      if (const shape::SymTensorMeta* m = symbolic->meta(v.id)) entry["symbolic"] = sym_meta_json(*m);
    values_json.push_back(std::move(entry));
  }
  json nodes_json = json::array();
  for (const Node& node : nodes) {
    json args = json::array();
    for (size_t i = 0; i < node.args.size(); ++i) {
      json arg = std::visit(ArgJson{}, node.args[i]);
      arg["name"] = node.arg_names[i];
      arg["kwarg_only"] = static_cast<int32_t>(i) >= node.num_positional;
      args.push_back(std::move(arg));
    }
    nodes_json.push_back({{"op", node.op},
                          {"overload", node.overload},
                          {"args", std::move(args)},
                          {"outputs", node.outputs},
                          {"returns_list", node.returns_list},
                          {"mutates_args", node.mutates_args},
                          {"is_view", node.is_view}});
  }
  json doc = {{"values", std::move(values_json)},
              {"inputs", inputs},
              {"nodes", std::move(nodes_json)},
              {"outputs", outputs}};
  if (symbolic) doc["symbolic"] = symbolic_json(*symbolic);
  return doc.dump(indent);
}
#else
std::string Graph::to_json(int) const {
  KILN_CHECK(false) << "kiln was built without nlohmann_json: install it (apt install nlohmann-json3-dev) "
                       "and rebuild to get Graph.to_json()";
  return {};
}

Graph graph_from_json(const std::string&) {
  KILN_CHECK(false) << "kiln was built without nlohmann_json: install it (apt install nlohmann-json3-dev) "
                       "and rebuild to read graph JSON";
  return {};
}
#endif

}  // namespace kiln::graph
