// The Python side of the runtime (python_bridge.h): tensor list conversions, constant arguments as Python values
// and c10's enum codes for the recorder. This is the one runtime file that includes torch's Python headers
// (python_variable.h and friends are expensive to compile: keep them here).
#include "runtime/python_bridge.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include "common/error.h"

namespace py = pybind11;

namespace kiln::runtime {

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
