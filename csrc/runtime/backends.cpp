// The backend table and the Python side of the runtime: user backend callables, tensor list
// conversions and c10's enum codes for the recorder. This is the one runtime file that includes
// torch's Python headers (python_variable.h and friends are expensive to compile: keep them here).
#include "runtime/backends.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <functional>
#include <map>

#include "common/error.h"
#include "runtime/eager_interpreter.h"
#include "runtime/kernel_graph.h"
#include "runtime/python_bridge.h"

namespace py = pybind11;

namespace kiln::runtime {

namespace {

using BackendFactory =
    std::function<std::shared_ptr<CompiledGraph>(std::shared_ptr<const graph::Graph>, PyObject* example_inputs)>;

std::vector<at::Tensor> constant_tensors(const graph::Graph& g) {
  std::vector<at::Tensor> constants(g.values.size());
  for (const graph::Value& v : g.values) {
    if (!v.is_constant) continue;
    PyObject* obj = v.constant.get();
    KILN_ASSERT(obj && THPVariable_Check(obj)) << "constant %" << v.id << " is not a tensor";
    constants[v.id] = THPVariable_Unpack(obj);
  }
  return constants;
}

std::shared_ptr<CompiledGraph> compile_eager(std::shared_ptr<const graph::Graph> g, PyObject*) {
  std::vector<at::Tensor> constants = constant_tensors(*g);
  return make_eager_interpreter(std::move(g), std::move(constants));
}

std::shared_ptr<CompiledGraph> compile_kiln(std::shared_ptr<const graph::Graph> g, PyObject*) {
  return compile_kiln_graph(std::move(g), constant_tensors);
}

const std::map<std::string, BackendFactory>& backend_table() {
  static const std::map<std::string, BackendFactory> table = {
      {"eager", compile_eager},
      // "aot_eager" (ahead-of-time autodiff, then eager) is the op-by-op interpreter until autodiff/
      // lands; the name exists so that callers can already choose it.
      {"aot_eager", compile_eager},
      {"kiln", compile_kiln},
  };
  return table;
}

// A user backend's compiled callable, called back with the GIL for every run.
class PythonCallableGraph final : public CompiledGraph {
 public:
  PythonCallableGraph(py::object fn, std::string backend_name)
      : fn_(std::move(fn)), backend_name_(std::move(backend_name)) {}
  ~PythonCallableGraph() override {
    if (!Py_IsInitialized()) {  // interpreter gone: leak rather than touch it
      fn_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  bool reenters_python() const override { return true; }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    py::gil_scoped_acquire gil;
    py::object args = py::reinterpret_steal<py::object>(tensors_to_python(inputs));
    py::object result = fn_(args);
    if (THPVariable_Check(result.ptr())) return {THPVariable_Unpack(result.ptr())};
    return tensors_from_python(result.ptr(), ("the result of backend " + backend_name_).c_str());
  }

 private:
  py::object fn_;
  std::string backend_name_;
};

std::shared_ptr<CompiledGraph> compile_with_callable(std::shared_ptr<const graph::Graph> g,
                                                     const std::string& name, PyObject* user_backend,
                                                     PyObject* example_inputs) {
  py::object graph_obj = py::cast(std::const_pointer_cast<graph::Graph>(g));
  py::object examples = example_inputs ? py::reinterpret_borrow<py::object>(example_inputs)
                                       : py::reinterpret_steal<py::object>(PyList_New(0));
  py::object compiled = py::reinterpret_borrow<py::object>(user_backend)(graph_obj, examples);
  KILN_CHECK(PyCallable_Check(compiled.ptr()))
      << "backend " << name << " returned " << py::str(py::type::of(compiled)).cast<std::string>()
      << ", not a callable: a backend must return a function taking a list of tensors";
  return std::make_shared<PythonCallableGraph>(std::move(compiled), name);
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : backend_table()) names.push_back(name);
  return names;
}

std::shared_ptr<CompiledGraph> compile_graph(std::shared_ptr<const graph::Graph> g, const std::string& backend,
                                             PyObject* example_inputs, PyObject* user_backend) {
  KILN_ASSERT(g != nullptr) << "compile_graph without a graph";
  if (user_backend) return compile_with_callable(std::move(g), backend, user_backend, example_inputs);
  const auto& table = backend_table();
  auto it = table.find(backend);
  if (it == table.end()) {
    std::string known;
    for (const auto& name : backend_names()) known += (known.empty() ? "" : ", ") + name;
    KILN_CHECK(false) << "unknown backend '" << backend << "': known backends are " << known
                      << ", or pass a callable (graph, example_inputs) -> callable";
  }
  return it->second(std::move(g), example_inputs);
}

// ---- python_bridge.h ---------------------------------------------------------------------------------
std::vector<at::Tensor> tensors_from_python(PyObject* sequence, const char* what) {
  KILN_CHECK(PyList_Check(sequence) || PyTuple_Check(sequence))
      << what << " must be a list or tuple of tensors, got " << Py_TYPE(sequence)->tp_name;
  py::sequence seq = py::reinterpret_borrow<py::sequence>(sequence);
  std::vector<at::Tensor> tensors;
  tensors.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object item = seq[i];
    KILN_CHECK(THPVariable_Check(item.ptr()))
        << what << ": item " << i << " is a " << Py_TYPE(item.ptr())->tp_name << ", not a tensor";
    tensors.push_back(THPVariable_Unpack(item.ptr()));
  }
  return tensors;
}

PyObject* tensor_to_python(const at::Tensor& tensor) { return THPVariable_Wrap(tensor); }

PyObject* tensors_to_python(const std::vector<at::Tensor>& tensors) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(tensors.size()));
  if (!list) throw py::error_already_set();
  for (size_t i = 0; i < tensors.size(); ++i)
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), THPVariable_Wrap(tensors[i]));
  return list;
}

PyObject* argument_to_python(const c10::IValue& v, const c10::Type& type) {
  if (v.isNone()) return Py_NewRef(Py_None);
  if (v.isTensor()) return THPVariable_Wrap(v.toTensor());
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) {
    const c10::Type* t = &type;
    if (auto optional = type.castRaw<c10::OptionalType>()) t = optional->getElementType().get();
    if (t->kind() == c10::TypeKind::ScalarTypeType)
      return Py_NewRef(reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
    if (t->kind() == c10::TypeKind::LayoutType || t->kind() == c10::TypeKind::MemoryFormatType) return nullptr;
    return PyLong_FromLongLong(v.toInt());  // an int, SymInt or Scalar
  }
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isString()) return PyUnicode_FromString(v.toStringRef().c_str());
  if (v.isList()) {
    const c10::List<c10::IValue> items = v.toList();
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
    const c10::Type* element = &type;
    if (auto optional = type.castRaw<c10::OptionalType>()) element = optional->getElementType().get();
    auto list_type = element->castRaw<c10::ListType>();
    for (size_t i = 0; i < items.size(); ++i) {
      PyObject* item = list_type ? argument_to_python(items.get(i), *list_type->getElementType()) : nullptr;
      if (!item) {
        Py_DECREF(list);
        return nullptr;
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
    }
    return list;
  }
  return nullptr;
}

bool tensor_or_none_from_python(PyObject* item, at::Tensor& out) {
  if (item == Py_None) {
    out.reset();
    return true;
  }
  if (!THPVariable_Check(item)) return false;
  out = THPVariable_Unpack(item);
  return true;
}

PyObject* enum_codes_for_python() {
  py::dict dtypes, layouts, memory_formats, device_types;
  for (int code = 0; code < static_cast<int>(at::ScalarType::NumOptions); ++code) {
    try {
      auto* dtype = torch::getTHPDtype(static_cast<at::ScalarType>(code));
      if (dtype) dtypes[py::handle(reinterpret_cast<PyObject*>(dtype))] = code;
    } catch (const std::exception&) {
      // dtypes without a Python object (Bits*, QUInt4x2 ...) have no code to export
    }
  }
  for (int code = 0; code < static_cast<int>(at::Layout::NumOptions); ++code) {
    try {
      auto* layout = torch::getTHPLayout(static_cast<at::Layout>(code));
      if (layout) layouts[py::handle(reinterpret_cast<PyObject*>(layout))] = code;
    } catch (const std::exception&) {
    }
  }
  for (int code = 0; code < static_cast<int>(at::MemoryFormat::NumOptions); ++code) {
    PyObject* format = torch::utils::getTHPMemoryFormat(static_cast<at::MemoryFormat>(code));
    if (format) memory_formats[py::handle(format)] = code;
  }
  for (int code = 0; code < static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES); ++code) {
    const auto type = static_cast<c10::DeviceType>(code);
    if (c10::isValidDeviceType(type)) device_types[py::str(c10::DeviceTypeName(type, /*lower_case=*/true))] = code;
  }
  py::dict codes;
  codes["dtypes"] = dtypes;
  codes["layouts"] = layouts;
  codes["memory_formats"] = memory_formats;
  codes["device_types"] = device_types;
  return codes.release().ptr();
}

}  // namespace kiln::runtime
