// Tracer: sizes read at calls under dynamic shapes (`x.shape`, `x.size(d)`, `len(x)`, `x.numel()` as symbolic ints,
// symbolic_ints.h), and the recorder's node count the calls' ints are matched against. The rest of the calls are in
// calls.cpp.
#include "common/error.h"
#include "trace/call_helpers.h"
#include "trace/tracer.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

using calls::builtin;
using detail::check;
using detail::str_of;

int Tracer::recorded_nodes() {
  PyObject* n = check(PyObject_GetAttrString(recorder_, "num_nodes"), "recorder.num_nodes");
  const int count = (int)PyLong_AsLong(n);
  Py_DECREF(n);
  return count;
}

VarPtr Tracer::symbolic_size_call(PyObject* fn, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  if (args.empty() || !args[0]->is(VarKind::kTensor)) return nullptr;
  static PyObject* tensor_base = [] {
    PyObject* c = PyImport_ImportModule("torch._C");
    PyObject* t = c ? PyObject_GetAttrString(c, "TensorBase") : nullptr;
    Py_XDECREF(c);
    return t;
  }();
  static PyObject* size_method = tensor_base ? PyObject_GetAttrString(tensor_base, "size") : nullptr;
  static PyObject* numel_method = tensor_base ? PyObject_GetAttrString(tensor_base, "numel") : nullptr;
  static PyObject* nelement_method = tensor_base ? PyObject_GetAttrString(tensor_base, "nelement") : nullptr;
  static PyObject* size_type = [] {
    PyObject* torch = PyImport_ImportModule("torch");
    PyObject* t = torch ? PyObject_GetAttrString(torch, "Size") : nullptr;
    Py_XDECREF(torch);
    return t;
  }();
  PyErr_Clear();
  PyObject* fake = args[0]->value;
  PyObject* shape = PyObject_GetAttrString(fake, "shape");
  if (!shape) rethrow_python("tensor.shape");
  std::vector<int64_t> sizes;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
  Py_DECREF(shape);
  PyObject* vid = check(PyObject_CallMethod(recorder_, "value_id", "O", fake), "recorder.value_id");
  const int64_t value = vid == Py_None ? -1 : PyLong_AsLongLong(vid);
  Py_DECREF(vid);
  auto dim_var = [&](int64_t d) { return symbolic_->size(fake, value, d, sizes[d]); };
  auto whole_shape = [&] {
    std::vector<VarPtr> items;
    for (size_t d = 0; d < sizes.size(); ++d) items.push_back(dim_var((int64_t)d));
    VarPtr out = make_sequence(VarKind::kTuple, std::move(items));
    out->real_type = (PyTypeObject*)size_type;
    return out;
  };
  const bool getattr_shape = fn == builtin("getattr") && args.size() == 2 &&
                             args[1]->is(VarKind::kConst) && PyUnicode_Check(args[1]->value) &&
                             str_of(args[1]->value) == "shape";
  if (getattr_shape) return whole_shape();
  if (fn == builtin("len")) {
    if (sizes.empty()) return nullptr;  // (len() of a 0-d tensor raises: the recorder says so)
    return dim_var(0);
  }
  if (fn == size_method) {
    VarPtr dim = args.size() == 2 ? args[1] : nullptr;
    for (const auto& [name, v] : kwargs)
      if (str_of(name) == "dim") dim = v;
    if (args.size() > 2 || kwargs.size() > (dim && args.size() < 2 ? 1u : 0u)) return nullptr;
    if (!dim || (dim->is(VarKind::kConst) && dim->value == Py_None)) return whole_shape();
    if (!dim->is(VarKind::kConst) || !PyLong_CheckExact(dim->value)) return nullptr;
    int64_t d = PyLong_AsLongLong(dim->value);
    if (d < 0) d += (int64_t)sizes.size();
    if (d < 0 || d >= (int64_t)sizes.size()) return nullptr;  // (the recorder raises eager's IndexError)
    return dim_var(d);
  }
  if ((fn == numel_method || fn == nelement_method) && args.size() == 1 && kwargs.empty()) {
    VarPtr product = make_const_steal(PyLong_FromLong(1));
    static PyObject* mul = PyObject_GetAttrString(PyImport_AddModule("operator"), "mul");
    for (size_t d = 0; d < sizes.size(); ++d) product = symbolic_->binary(mul, product, dim_var((int64_t)d));
    return product;
  }
  return nullptr;
}

}  // namespace kiln::trace
