#pragma once
// Helpers shared by the call tracer's two files (calls.cpp: torch calls, inlining, builtins;
// calls_python.cpp: the Python constructs of real models).
#include <string>
#include <vector>

#include "trace/tracer.h"
#include "trace/variables.h"

namespace kiln::trace::calls {

inline bool contains(PyObject* set, PyObject* item) {
  int r = PySet_Contains(set, item);
  if (r < 0) PyErr_Clear();  // unhashable
  return r == 1;
}

// A callable's qualified name for messages ("Tensor.register_hook"), else its type's name.
inline std::string name_of(PyObject* fn) {
  PyObject* n = PyObject_GetAttrString(fn, "__qualname__");
  if (!n) {
    PyErr_Clear();
    n = PyObject_GetAttrString(fn, "__name__");
  }
  if (!n || !PyUnicode_Check(n)) {
    PyErr_Clear();
    Py_XDECREF(n);
    return Py_TYPE(fn)->tp_name;
  }
  std::string s = PyUnicode_AsUTF8(n);
  Py_DECREF(n);
  return s;
}

inline PyObject* builtin(const char* name) { return PyDict_GetItemString(PyEval_GetBuiltins(), name); }

// An object pinned only by its type (tracer.cpp: Tracer::wrap) may be another instance on the next call.
inline bool holds_object_pinned_by_type(const VarPtr& v) {
  if (v->by_type) return true;
  for (const VarPtr& item : v->items)
    if (item && holds_object_pinned_by_type(item)) return true;
  return false;
}

// f(*args, **kwargs) for real on the Vars' trace-time values (constants): new reference, or NULL with the error set.
inline PyObject* call_on_values(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  PyObject* py_args = to_python(make_sequence(VarKind::kTuple, args));
  PyObject* py_kwargs = kwargs.empty() ? nullptr : PyDict_New();
  for (const auto& [k, v] : kwargs) {
    PyObject* pv = to_python(v);
    PyDict_SetItem(py_kwargs, k, pv);
    Py_DECREF(pv);
  }
  PyObject* r = PyObject_Call(f, py_args, py_kwargs);
  Py_DECREF(py_args);
  Py_XDECREF(py_kwargs);
  return r;
}

}  // namespace kiln::trace::calls
