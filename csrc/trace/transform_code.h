#pragma once
// The code object a cache entry runs instead of the original: same signature, same locals layout
// (arguments, cells, free variables in the original order, so the frame hook can hand it the
// intercepted frame's arguments), and a body that is `return program(<arguments>, <free variables>)`.
#include <Python.h>

namespace kiln::trace {

struct CallCode {
  PyObject* code = nullptr;  ///< new reference
  int num_locals_passed = 0;
  int num_freevars_passed = 0;
};

/// Builds the transformed code for `original` calling `program`. Throws kiln::Error on failure.
CallCode make_call_code(PyCodeObject* original, PyObject* program);

}  // namespace kiln::trace
