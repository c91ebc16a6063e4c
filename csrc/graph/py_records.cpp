// The recorder's Python tuples -> Graph (format in py_records.h), and PyObjectRef's GIL-safe release.
// Kept apart from the rest of graph/ so that only this file needs Python.h.
#include "graph/py_records.h"

#include <Python.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>

#include "common/error.h"

namespace kiln::graph {

// ---- PyObjectRef -------------------------------------------------------------------------------
namespace {
void release_reference(PyObject* obj) {
  // Graphs may be destroyed without the GIL (a compiled graph dropped from C++), and after the
  // interpreter finalised: then the object is leaked on purpose rather than touched.
  if (!Py_IsInitialized()) return;
  PyGILState_STATE state = PyGILState_Ensure();
  Py_DECREF(obj);
  PyGILState_Release(state);
}
}  // namespace

PyObjectRef PyObjectRef::steal(PyObject* obj) {
  PyObjectRef ref;
  if (obj) {
    ref.holder_ = std::make_shared<Holder>();
    ref.holder_->obj = obj;
    ref.holder_->release = release_reference;
  }
  return ref;
}

namespace {

// A borrowed view of a list or tuple with bounds-checked access.
class Seq {
 public:
  Seq(PyObject* obj, const char* what) : what_(what) {
    fast_ = PySequence_Fast(obj, what);
    if (!fast_) {
      PyErr_Clear();
      KILN_ASSERT(false) << "recorder output: " << what << " is not a sequence";
    }
  }
  ~Seq() { Py_XDECREF(fast_); }
  Seq(const Seq&) = delete;
  Seq& operator=(const Seq&) = delete;
  Py_ssize_t size() const { return PySequence_Fast_GET_SIZE(fast_); }
  PyObject* operator[](Py_ssize_t i) const {
    KILN_ASSERT(i >= 0 && i < size()) << "recorder output: " << what_ << " has no item " << i;
    return PySequence_Fast_GET_ITEM(fast_, i);
  }

 private:
  PyObject* fast_ = nullptr;
  const char* what_;
};

int64_t to_int(PyObject* obj, const char* what) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    KILN_ASSERT(false) << "recorder output: " << what << " is not an int";
  }
  return v;
}

double to_double(PyObject* obj, const char* what) {
  const double v = PyFloat_AsDouble(obj);
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    KILN_ASSERT(false) << "recorder output: " << what << " is not a float";
  }
  return v;
}

bool to_bool(PyObject* obj, const char* what) {
  const int v = PyObject_IsTrue(obj);
  if (v < 0) {
    PyErr_Clear();
    KILN_ASSERT(false) << "recorder output: " << what << " is not a bool";
  }
  return v != 0;
}

std::string to_string(PyObject* obj, const char* what) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &size) : nullptr;
  if (!data) {
    PyErr_Clear();
    KILN_ASSERT(false) << "recorder output: " << what << " is not a str";
  }
  return std::string(data, size);
}

template <typename T, typename Convert>
std::vector<T> to_vector(PyObject* obj, const char* what, Convert convert) {
  Seq seq(obj, what);
  std::vector<T> out;
  out.reserve(seq.size());
  for (Py_ssize_t i = 0; i < seq.size(); ++i) out.push_back(convert(seq[i], what));
  return out;
}

std::vector<int64_t> to_ints(PyObject* obj, const char* what) { return to_vector<int64_t>(obj, what, to_int); }

Device to_device(PyObject* obj) {
  Seq pair(obj, "device");
  return Device{static_cast<DeviceType>(to_int(pair[0], "device type")),
                static_cast<int8_t>(to_int(pair[1], "device index"))};
}

TensorMeta to_meta(PyObject* obj) {
  Seq m(obj, "meta");
  KILN_ASSERT_EQ(m.size(), 7) << "recorder output: meta tuple";
  TensorMeta meta;
  meta.sizes = to_ints(m[0], "sizes");
  meta.strides = to_ints(m[1], "strides");
  meta.storage_offset = to_int(m[2], "storage_offset");
  meta.dtype = static_cast<ScalarType>(to_int(m[3], "dtype code"));
  meta.device = Device{static_cast<DeviceType>(to_int(m[4], "device type")),
                       static_cast<int8_t>(to_int(m[5], "device index"))};
  meta.requires_grad = to_bool(m[6], "requires_grad");
  return meta;
}

// ---- argument tags -> ArgValue ---------------------------------------------------------------------
using ArgParser = std::function<ArgValue(PyObject* payload)>;

const std::unordered_map<std::string, ArgParser>& arg_parsers() {
  static const std::unordered_map<std::string, ArgParser> table = {
      {"none", [](PyObject*) -> ArgValue { return NoneArg{}; }},
      {"tensor", [](PyObject* p) -> ArgValue { return TensorArg{static_cast<ValueId>(to_int(p, "tensor id"))}; }},
      {"tensors",
       [](PyObject* p) -> ArgValue {
         Seq seq(p, "tensor list");
         TensorListArg list;
         for (Py_ssize_t i = 0; i < seq.size(); ++i) {
           if (seq[i] == Py_None)
             list.ids.push_back(std::nullopt);
           else
             list.ids.push_back(static_cast<ValueId>(to_int(seq[i], "tensor list id")));
         }
         return list;
       }},
      {"bool", [](PyObject* p) -> ArgValue { return to_bool(p, "bool arg"); }},
      {"int", [](PyObject* p) -> ArgValue { return to_int(p, "int arg"); }},
      {"float", [](PyObject* p) -> ArgValue { return to_double(p, "float arg"); }},
      {"complex",
       [](PyObject* p) -> ArgValue {
         return std::complex<double>(PyComplex_RealAsDouble(p), PyComplex_ImagAsDouble(p));
       }},
      {"str", [](PyObject* p) -> ArgValue { return to_string(p, "str arg"); }},
      {"ints", [](PyObject* p) -> ArgValue { return to_ints(p, "int list arg"); }},
      {"floats", [](PyObject* p) -> ArgValue { return to_vector<double>(p, "float list arg", to_double); }},
      {"bools", [](PyObject* p) -> ArgValue { return to_vector<bool>(p, "bool list arg", to_bool); }},
      {"dtype",
       [](PyObject* p) -> ArgValue { return ScalarTypeArg{static_cast<ScalarType>(to_int(p, "dtype code"))}; }},
      {"layout", [](PyObject* p) -> ArgValue { return LayoutArg{static_cast<int8_t>(to_int(p, "layout"))}; }},
      {"memory_format",
       [](PyObject* p) -> ArgValue { return MemoryFormatArg{static_cast<int8_t>(to_int(p, "memory format"))}; }},
      {"device", [](PyObject* p) -> ArgValue { return to_device(p); }},
  };
  return table;
}

ArgValue to_arg(PyObject* obj, const std::string& op) {
  Seq pair(obj, "argument");
  KILN_ASSERT_EQ(pair.size(), 2) << "recorder output: argument of " << op;
  const std::string tag = to_string(pair[0], "argument tag");
  const auto& parsers = arg_parsers();
  auto it = parsers.find(tag);
  KILN_ASSERT(it != parsers.end()) << "recorder output: unknown argument tag '" << tag << "' in " << op;
  return it->second(pair[1]);
}

}  // namespace

std::vector<ArgValue> args_from_records(PyObject* records, const std::string& op) {
  Seq args(records, "args");
  std::vector<ArgValue> out;
  out.reserve(args.size());
  for (Py_ssize_t i = 0; i < args.size(); ++i) out.push_back(to_arg(args[i], op));
  return out;
}

namespace {

Node to_node(PyObject* obj) {
  Seq rec(obj, "node");
  KILN_ASSERT_EQ(rec.size(), 9) << "recorder output: node tuple";
  Node node;
  node.op = to_string(rec[0], "op");
  node.overload = to_string(rec[1], "overload");
  node.args = args_from_records(rec[2], node.op);
  node.arg_names = to_vector<std::string>(rec[3], "arg names", to_string);
  node.num_positional = static_cast<int32_t>(to_int(rec[4], "num_positional"));
  for (int64_t id : to_ints(rec[5], "outputs")) node.outputs.push_back(static_cast<ValueId>(id));
  node.returns_list = to_bool(rec[6], "returns_list");
  node.mutates_args = to_bool(rec[7], "mutates_args");
  node.is_view = to_bool(rec[8], "is_view");
  return node;
}

}  // namespace

std::shared_ptr<Graph> graph_from_records(PyObject* values, PyObject* nodes, PyObject* outputs) {
  auto g = std::make_shared<Graph>();
  Seq value_records(values, "values");
  std::vector<std::pair<int64_t, ValueId>> inputs_by_index;
  for (Py_ssize_t i = 0; i < value_records.size(); ++i) {
    Seq rec(value_records[i], "value");
    KILN_ASSERT_EQ(rec.size(), 3) << "recorder output: value tuple";
    const std::string kind = to_string(rec[0], "value kind");
    Value v;
    v.id = static_cast<ValueId>(i);
    v.meta = to_meta(rec[1]);
    if (kind == "input") {
      v.is_input = true;
      v.input_index = static_cast<int32_t>(to_int(rec[2], "input index"));
      inputs_by_index.emplace_back(v.input_index, v.id);
    } else if (kind == "constant") {
      v.is_constant = true;
      Py_INCREF(rec[2]);
      v.constant = PyObjectRef::steal(rec[2]);
    } else {
      KILN_ASSERT(kind == "node") << "recorder output: unknown value kind '" << kind << "'";
      v.producer = static_cast<NodeIndex>(to_int(rec[2], "producer"));
    }
    g->values.push_back(std::move(v));
  }
  std::sort(inputs_by_index.begin(), inputs_by_index.end());
  for (const auto& [index, id] : inputs_by_index) g->inputs.push_back(id);

  Seq node_records(nodes, "nodes");
  for (Py_ssize_t i = 0; i < node_records.size(); ++i) g->nodes.push_back(to_node(node_records[i]));
  for (int64_t id : to_ints(outputs, "outputs")) g->outputs.push_back(static_cast<ValueId>(id));
  g->verify();
  return g;
}

}  // namespace kiln::graph
