// kiln._C.shape_rule: evaluates one of graph/shape_rules.h's symbolic rules on inputs described in Python, for
// tests/python/test_shape_rules.py (graph/propagate_symbolic_sizes is their other caller).
//
// Sizes, strides, offsets and int arguments are given as ints or as expression text over the named symbols
// ("s0*s1*2 + 3", "floordiv(s0, 2)", "min(s0, 4)"); the results come back both as text and evaluated at the
// symbols' given values.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/module_register.h"
#include "common/error.h"
#include "graph/shape_rules.h"

namespace py = pybind11;

namespace kiln::bindings {

namespace {
using graph::shape::Expr;
namespace shape = graph::shape;
namespace sym = graph::sym;

struct Converter {
  std::map<std::string, Expr> symbols;

  Expr expr(py::handle h) const {
    if (py::isinstance<py::bool_>(h)) throw py::type_error("a bool where a size is expected");
    if (py::isinstance<py::int_>(h)) return Expr(h.cast<int64_t>());
    if (py::isinstance<py::str>(h)) return sym::parse_expr(h.cast<std::string>(), symbols);
    throw py::type_error("a size is an int or expression text, got " + std::string(py::str(py::type::of(h))));
  }
  std::vector<Expr> exprs(py::handle h) const {
    std::vector<Expr> out;
    for (py::handle item : h) out.push_back(expr(item));
    return out;
  }
  shape::SymTensorMeta tensor(const py::dict& d) const {
    shape::SymTensorMeta t;
    t.sizes = exprs(d["sizes"]);
    t.strides = exprs(d["strides"]);
    KILN_CHECK(t.sizes.size() == t.strides.size()) << "a tensor's sizes and strides differ in length";
    t.storage_offset = d.contains("offset") ? expr(d["offset"]) : Expr(0);
    t.dtype = static_cast<graph::ScalarType>(d["dtype"].cast<int>());
    if (d.contains("device")) t.device.type = static_cast<graph::DeviceType>(d["device"].cast<int>());
    return t;
  }
  static bool is_tensor(py::handle h) { return py::isinstance<py::dict>(h) && h.cast<py::dict>().contains("sizes"); }

  shape::RuleArg arg(py::handle h) const {
    if (h.is_none()) return graph::NoneArg{};
    if (py::isinstance<py::bool_>(h)) return h.cast<bool>();
    if (py::isinstance<py::int_>(h)) return Expr(h.cast<int64_t>());
    if (py::isinstance<py::float_>(h)) return h.cast<double>();
    if (py::isinstance<py::str>(h)) return h.cast<std::string>();
    if (py::isinstance<py::dict>(h)) {
      py::dict d = h.cast<py::dict>();
      if (d.contains("sizes")) return tensor(d);
      if (d.contains("expr")) return expr(d["expr"]);
      if (d.contains("dtype")) return graph::ScalarTypeArg{static_cast<graph::ScalarType>(d["dtype"].cast<int>())};
      if (d.contains("memory_format")) return graph::MemoryFormatArg{d["memory_format"].cast<int8_t>()};
      if (d.contains("layout")) return graph::LayoutArg{d["layout"].cast<int8_t>()};
      if (d.contains("device")) return graph::Device{static_cast<graph::DeviceType>(d["device"].cast<int>()), -1};
      throw py::value_error("an argument dict needs one of sizes, expr, dtype, memory_format, layout, device");
    }
    if (py::isinstance<py::list>(h) || py::isinstance<py::tuple>(h)) {
      py::sequence seq = h.cast<py::sequence>();
      bool tensors = false, bools = true, floats = false;
      for (py::handle item : seq) {
        tensors = tensors || is_tensor(item);
        bools = bools && py::isinstance<py::bool_>(item);
        floats = floats || py::isinstance<py::float_>(item);
      }
      if (tensors) {
        shape::SymTensorList list;
        for (py::handle item : seq)
          list.items.push_back(item.is_none() ? std::nullopt : std::optional(tensor(item.cast<py::dict>())));
        return list;
      }
      if (seq.size() > 0 && bools) return seq.cast<std::vector<bool>>();
      if (floats) return seq.cast<std::vector<double>>();
      std::vector<Expr> ints;
      for (py::handle item : seq)
        ints.push_back(py::isinstance<py::dict>(item) ? expr(item.cast<py::dict>()["expr"]) : expr(item));
      return ints;
    }
    throw py::type_error("unsupported argument type " + std::string(py::str(py::type::of(h))));
  }
};

py::list texts(const std::vector<Expr>& exprs) {
  py::list out;
  for (const Expr& e : exprs) out.append(e.to_string());
  return out;
}

py::list values(const std::vector<Expr>& exprs, const sym::Bindings& bindings) {
  py::list out;
  for (const Expr& e : exprs) out.append(e.evaluate(bindings));
  return out;
}

py::dict shape_rule(const std::string& op, py::sequence args, py::dict symbols) {
  sym::SizeFacts facts;
  Converter convert;
  sym::Bindings bindings;
  for (auto [name, value] : symbols) {
    Expr s = facts.new_symbol();
    s = Expr::symbol(s.symbol_id(), name.cast<std::string>());
    convert.symbols.emplace(name.cast<std::string>(), s);
    bindings[s.symbol_id()] = value.cast<int64_t>();
  }
  std::vector<shape::RuleArg> rule_args;
  for (py::handle a : args) rule_args.push_back(convert.arg(a));
  shape::RuleResult result = shape::infer_shapes(op, rule_args, facts);
  py::dict out;
  out["has_rule"] = result.has_rule;
  out["reason"] = result.reason;
  py::list outputs;
  for (const auto& meta : result.outputs) {
    if (!meta) {
      outputs.append(py::none());
      continue;
    }
    py::dict m;
    m["sizes"] = texts(meta->sizes);
    m["strides"] = texts(meta->strides);
    m["offset"] = meta->storage_offset.to_string();
    m["dtype"] = static_cast<int>(meta->dtype);
    m["device"] = static_cast<int>(meta->device.type);
    m["text"] = meta->to_string();
    m["sizes_value"] = values(meta->sizes, bindings);
    m["strides_value"] = values(meta->strides, bindings);
    m["offset_value"] = meta->storage_offset.evaluate(bindings);
    outputs.append(m);
  }
  out["outputs"] = outputs;
  py::list assumptions;
  for (const shape::Assumption& a : result.assumptions) {
    py::dict d;
    d["text"] = a.to_string();
    d["reason"] = a.reason;
    d["holds"] = a.holds(bindings);
    assumptions.append(d);
  }
  out["assumptions"] = assumptions;
  return out;
}
}  // namespace

void register_shape_rules(py::module_& m) {
  m.def("shape_rule", &shape_rule, py::arg("op"), py::arg("args"), py::arg("symbols") = py::dict(),
        "evaluate kiln's symbolic shape rule of `op` ('aten::add.Tensor') on `args` (schema order, defaults filled; "
        "tensors as {'sizes', 'strides', 'offset', 'dtype', 'device'} with ints or expression text over `symbols`, "
        "{'expr': text} for a symbolic int): {'has_rule', 'reason', 'outputs', 'assumptions'}, each output's "
        "sizes, strides and offset as text and evaluated at the symbols' values");
  m.def("shape_rule_ops", &graph::shape::shape_rule_ops, "the ops kiln has a symbolic shape rule for");
}

}  // namespace kiln::bindings
