// TracedRaise: an exception traced code raises at trace time (traced_raise.h).
#include "trace/traced_raise.h"

#include "common/error.h"

namespace kiln::trace {

TracedRaise::TracedRaise(VarPtr exception, std::string context)
    : exception_(std::move(exception)), context_(std::move(context)) {}

std::string TracedRaise::describe() const {
  PyObject* instance = exception_->value;
  std::string text = context_ + ": " + Py_TYPE(instance)->tp_name;
  PyObject* message = PyObject_Str(instance);
  if (message) {
    const char* utf8 = PyUnicode_AsUTF8(message);
    if (utf8 && *utf8) text += std::string(": ") + utf8;
    Py_DECREF(message);
  }
  PyErr_Clear();
  return text;
}

bool plain_exception_class(PyObject* cls) {
  if (!PyExceptionClass_Check(cls)) return false;
  for (const char* slot : {"__init__", "__new__"}) {
    PyObject* method = PyObject_GetAttrString(cls, slot);
    if (!method) {
      PyErr_Clear();
      return false;
    }
    const bool python = PyFunction_Check(method) || PyMethod_Check(method);
    Py_DECREF(method);
    if (python) return false;
  }
  return true;
}

VarPtr exception_var(PyObject* instance) {
  PyObject* args = PyObject_GetAttrString(instance, "args");
  if (!args || !PyTuple_Check(args) || !plain_exception_class((PyObject*)Py_TYPE(instance))) {
    Py_XDECREF(args);
    PyErr_Clear();
    return make_const(instance);
  }
  std::vector<VarPtr> items;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) items.push_back(make_const(PyTuple_GET_ITEM(args, i)));
  VarPtr v = make_object(instance, std::move(items), {}, args);
  Py_DECREF(args);
  return v;
}

void raise_pending(const std::string& context) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  KILN_ASSERT(type) << "raise_pending with no Python error set (" << context << ")";
  PyErr_NormalizeException(&type, &value, &traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  if (!value) KILN_UNSUPPORTED() << context << " raised an exception kiln could not read";
  VarPtr exception = exception_var(value);
  Py_DECREF(value);
  throw TracedRaise(std::move(exception), context);
}

}  // namespace kiln::trace
