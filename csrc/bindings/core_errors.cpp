// Translates kiln::Error into kiln.errors' Python exception types (STYLE.md 5).
#include <pybind11/pybind11.h>

#include "bindings/core_register.h"
#include "common/error.h"

namespace py = pybind11;

namespace kiln::bindings {

void register_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      const char* name = "KilnError";
      switch (e.kind()) {
        case ErrorKind::User: name = "KilnError"; break;
        case ErrorKind::Internal: name = "InternalError"; break;
        case ErrorKind::Unsupported: name = "Unsupported"; break;
        case ErrorKind::GraphBreak: name = "GraphBreakError"; break;
      }
      PyObject* errors = PyImport_ImportModule("kiln.errors");
      PyObject* type = errors ? PyObject_GetAttrString(errors, name) : nullptr;
      Py_XDECREF(errors);
      if (!type) {
        PyErr_Clear();
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return;
      }
      PyErr_SetString(type, e.what());
      Py_DECREF(type);
    }
  });
}

}  // namespace kiln::bindings
