#pragma once
// A type's attribute dict across CPython versions: read by the tracer (attribute lookup along an MRO) and by
// runtime (telling a structseq from a namedtuple), neither of which should know the frame hook's shims.
#include <Python.h>

namespace kiln {

/// New reference to a type's own attribute dict. Python 3.12 keeps the dicts of static builtin types
/// (object, dict, tuple, ...) in the interpreter, leaving their tp_dict NULL.
inline PyObject* type_dict(PyTypeObject* type) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyType_GetDict(type);
#else
  Py_XINCREF(type->tp_dict);
  return type->tp_dict;
#endif
}

}  // namespace kiln
