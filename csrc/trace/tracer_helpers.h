#pragma once
// Small helpers over Python objects shared by the tracer's files (tracer.cpp, tracer_operators.cpp).
#include <Python.h>

#include <string>

#include "trace/tracer.h"  // rethrow_python

namespace kiln::trace::detail {

/// `o`, or kiln's Unsupported naming `context` and the pending Python error when `o` is null.
inline PyObject* check(PyObject* o, const std::string& context) {
  if (!o) rethrow_python(context);
  return o;
}

/// module.name, imported once and kept for the process.
inline PyObject* lookup_once(const char* module, const char* name) {
  PyObject* m = check(PyImport_ImportModule(module), std::string("import ") + module);
  PyObject* attr = check(PyObject_GetAttrString(m, name), std::string(module) + "." + name);
  Py_DECREF(m);
  return attr;
}

inline bool is_instance_of(PyObject* o, PyObject* type) {
  int r = PyObject_IsInstance(o, type);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

inline bool is_tensor(PyObject* o) {
  static PyObject* tensor_type = lookup_once("torch", "Tensor");
  return is_instance_of(o, tensor_type);
}

inline bool is_module(PyObject* o) {
  static PyObject* module_type = lookup_once("torch.nn", "Module");
  return is_instance_of(o, module_type);
}

/// collections.defaultdict.
inline PyTypeObject* default_dict_type() {
  static PyObject* type = lookup_once("collections", "defaultdict");
  return (PyTypeObject*)type;
}

inline bool is_module_list(PyObject* o) {
  static PyObject* module_list = lookup_once("torch.nn", "ModuleList");
  return (PyObject*)Py_TYPE(o) == module_list;
}

inline std::string str_of(PyObject* name) { return PyUnicode_AsUTF8(name); }

}  // namespace kiln::trace::detail
