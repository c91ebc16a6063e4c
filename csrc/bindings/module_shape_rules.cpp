// kiln._C.shape_rule: evaluates one of graph/shape_rules.h's symbolic rules on inputs described in Python, for
// tests/python/test_shape_rules.py (graph/propagate_symbolic_sizes is their other caller). kiln._C._meta_from_rules:
// the same rules at concrete sizes for the recorder (python/kiln/_fake.py), what an op returns on its fakes.
// kiln._C._give_fake_history: the recorder's other need from LibTorch, autograd history for a fake made below autograd.
//
// Sizes, strides, offsets and int arguments are given as ints or as expression text over the named symbols
// ("s0*s1*2 + 3", "floordiv(s0, 2)", "min(s0, 4)"); the results come back both as text and evaluated at the
// symbols' given values.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unordered_map>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include "bindings/module_register.h"
#include "common/error.h"
#include "compile/meta_oracle.h"
#include "graph/py_records.h"
#include "graph/shape_rules.h"
#include "runtime/python_bridge.h"

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
// How an op's results relate to its arguments, from its schema: the rules answer ops that return new tensors, and
// in-place ops (their results are their receivers); views must alias their input's storage, so torch makes them.
struct ReturnForm {
  bool answerable = false;
  bool returns_list = false;
  std::vector<int> receiver;  // per return: the argument it returns, or -1 for a new tensor
};

const ReturnForm& return_form(const std::string& op) {
  static std::unordered_map<std::string, ReturnForm> forms;  // (callers hold the GIL)
  auto it = forms.find(op);
  if (it != forms.end()) return it->second;
  ReturnForm form;
  const size_t dot = op.find('.', op.find("::") + 2);
  const std::string overload = dot == std::string::npos ? "" : op.substr(dot + 1);
  auto handle = c10::Dispatcher::singleton().findSchema(
      {op.substr(0, dot), overload == "default" ? "" : overload});
  if (handle) {
    const c10::FunctionSchema& schema = handle->schema();
    form.answerable = true;
    for (const c10::Argument& r : schema.returns()) {
      form.returns_list = form.returns_list || r.type()->kind() == c10::TypeKind::ListType;
      int receiver = -1;
      if (const c10::AliasInfo* alias = r.alias_info()) {
        for (size_t i = 0; i < schema.arguments().size(); ++i) {
          const c10::AliasInfo* a = schema.arguments()[i].alias_info();
          if (a && a->isWrite() && a->beforeSets() == alias->beforeSets()) receiver = static_cast<int>(i);
        }
        form.answerable = form.answerable && alias->isWrite() && receiver >= 0;
      }
      form.receiver.push_back(receiver);
    }
  }
  return forms.emplace(op, std::move(form)).first->second;
}

graph::TensorMeta meta_of_tensor(const at::Tensor& t) {
  graph::TensorMeta meta;
  meta.sizes = t.sizes().vec();
  meta.strides = t.strides().vec();
  meta.storage_offset = t.storage_offset();
  meta.dtype = static_cast<graph::ScalarType>(t.scalar_type());
  meta.device = {static_cast<graph::DeviceType>(t.device().type()), t.device().index()};
  return meta;
}

py::object tensor_or_none(const at::Tensor& t) {
  return t.defined() ? py::reinterpret_steal<py::object>(runtime::tensor_to_python(t)) : py::none();
}

// `records`: the node's argument records (graph/py_records.h); `run_values`: the values the op would run with, the
// fakes for its tensor arguments. What the op returns on them (a tensor, a tuple, a list), or None where no rule
// answers.
py::object meta_from_rules(const std::string& op, py::handle records, py::sequence run_values) {
  const ReturnForm& form = return_form(op);
  if (!form.answerable || !graph::shape::has_shape_rule(op)) return py::none();
  const std::vector<graph::ArgValue> args = graph::args_from_records(records.ptr(), op);
  if (args.size() != run_values.size()) return py::none();
  std::unordered_map<graph::ValueId, graph::TensorMeta> metas;
  auto take = [&](graph::ValueId id, py::handle value) {
    at::Tensor t;
    if (!runtime::tensor_or_none_from_python(value.ptr(), t) || !t.defined()) return false;
    metas[id] = meta_of_tensor(t);
    return true;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    if (auto* tensor = std::get_if<graph::TensorArg>(&args[i])) {
      if (!take(tensor->id, run_values[i])) return py::none();
    } else if (auto* list = std::get_if<graph::TensorListArg>(&args[i])) {
      py::sequence items = run_values[i].cast<py::sequence>();
      if (items.size() != list->ids.size()) return py::none();
      for (size_t k = 0; k < list->ids.size(); ++k)
        if (list->ids[k] && !take(*list->ids[k], items[k])) return py::none();
    }
  }
  std::vector<at::Tensor> outputs;
  auto meta_of = [&](graph::ValueId id) -> const graph::TensorMeta& { return metas.at(id); };
  if (!compile::meta_outputs_from_rules(op, args, meta_of, outputs)) return py::none();
  if (form.returns_list) {
    py::list result;
    for (const at::Tensor& t : outputs) result.append(tensor_or_none(t));
    return result;
  }
  if (outputs.size() != form.receiver.size()) return py::none();
  py::tuple result(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i)
    result[i] = form.receiver[i] >= 0 ? py::object(run_values[form.receiver[i]]) : tensor_or_none(outputs[i]);
  if (result.size() == 1) return result[0];
  return result;
}

// An autograd node that must never run, of whichever pointer type this torch's edges hold (std::shared_ptr before
// torch 2.12, c10::intrusive_ptr after).
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename P>
struct ErrorNode;
template <typename T>
struct ErrorNode<std::shared_ptr<T>> {
  static std::shared_ptr<T> make(std::string msg) { return std::make_shared<torch::autograd::Error>(std::move(msg)); }
};
template <typename T>
struct ErrorNode<c10::intrusive_ptr<T>> {
  static c10::intrusive_ptr<T> make(std::string msg) {
    return c10::make_intrusive<torch::autograd::Error>(std::move(msg));
  }
};

// Makes `fake` (a meta tensor that does not require grad) the non-leaf result of an autograd node, as the value it
// stands for is in eager: it then requires grad, and in-place ops on it pass autograd's leaf check. Under autocast
// the recorder's ops run on device proxies, so autograd's history lands on the proxies and not on the fakes
// (kiln/_fake.py). A fake is never differentiated; its node raises if it ever were.
void give_fake_history(py::handle fake) {
  at::Tensor t;
  if (!runtime::tensor_or_none_from_python(fake.ptr(), t) || !t.defined())
    throw py::type_error("_give_fake_history takes a tensor");
  KILN_ASSERT(!t.requires_grad()) << "a fake that requires grad already";
  torch::autograd::create_gradient_edge(t,
                                        ErrorNode<NodePtr>::make("kiln: a fake tensor's history was differentiated"));
}

}  // namespace

void register_shape_rules(py::module_& m) {
  m.def("shape_rule", &shape_rule, py::arg("op"), py::arg("args"), py::arg("symbols") = py::dict(),
        "evaluate kiln's symbolic shape rule of `op` ('aten::add.Tensor') on `args` (schema order, defaults filled; "
        "tensors as {'sizes', 'strides', 'offset', 'dtype', 'device'} with ints or expression text over `symbols`, "
        "{'expr': text} for a symbolic int): {'has_rule', 'reason', 'outputs', 'assumptions'}, each output's "
        "sizes, strides and offset as text and evaluated at the symbols' values");
  m.def("shape_rule_ops", &graph::shape::shape_rule_ops, "the ops kiln has a symbolic shape rule for");
  m.def("_meta_from_rules", &meta_from_rules, py::arg("op"), py::arg("records"), py::arg("run_values"),
        "the recorder's (kiln/_fake.py) answer from kiln's shape rules at concrete sizes: what `op` returns on the fakes "
        "`run_values` (its records' tensors), or None where no rule answers and torch's meta kernel must run");
  m.def("_give_fake_history", &give_fake_history, py::arg("fake"),
        "makes a fake that does not require grad the non-leaf result of an autograd node (one that raises if run), "
        "for the recorder (kiln/_fake.py): the fake then requires grad and is not a leaf, as in eager");
}

}  // namespace kiln::bindings
