// Graph::to_json: a machine-readable dump for KILN_DEBUG_DIR, tools and kiln.export's files (python/kiln/export.py
// reads it back). Each argument is an object {"name", "kind", "value"} so readers need no schema; constants appear
// by meta only (their data stays in Python; export saves them with the weights).
#include <cmath>

#include "common/error.h"
#include "graph/graph.h"

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
}  // namespace

std::string Graph::to_json(int indent) const {
  json values_json = json::array();
  for (const Value& v : values) {
    json entry = {{"id", v.id}, {"meta", meta_json(v.meta)}};
    if (v.is_input) entry["input_index"] = v.input_index;
    if (v.is_constant) entry["constant"] = true;
    if (v.producer >= 0) entry["producer"] = v.producer;
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
  return doc.dump(indent);
}
#else
std::string Graph::to_json(int) const {
  KILN_CHECK(false) << "kiln was built without nlohmann_json: install it (apt install nlohmann-json3-dev) "
                       "and rebuild to get Graph.to_json()";
  return {};
}
#endif

}  // namespace kiln::graph
