#pragma once
// An embedded CPython for C++ tests that need the interpreter (opcode tables, code objects).
// Call kiln::testing::ensure_python() at the top of a test; the interpreter starts once per process
// and stays up (finalising and restarting CPython is not reliable with extension state around).
// The main thread keeps the GIL, and Catch2 runs every test on the main thread.
#include <Python.h>

#include <stdexcept>
#include <string>

namespace kiln::testing {

inline void ensure_python() {
  static const bool started = [] {
    if (!Py_IsInitialized()) Py_InitializeEx(0);  // 0: leave signal handlers to the test runner
    return true;
  }();
  (void)started;
}

/// Current Python error as text (and cleared), for test failure messages.
inline std::string python_error_text() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string text = "no Python error";
  if (value) {
    PyObject* s = PyObject_Str(value);
    if (s && PyUnicode_Check(s)) text = PyUnicode_AsUTF8(s);
    Py_XDECREF(s);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

/// Runs `source` in a fresh namespace and returns a new reference to the global `name` in it.
/// Throws std::runtime_error with the Python error when anything fails.
inline PyObject* run_and_get(const std::string& source, const char* name) {
  ensure_python();
  PyObject* globals = PyDict_New();
  PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins());
  PyObject* result = PyRun_String(source.c_str(), Py_file_input, globals, globals);
  if (!result) {
    Py_DECREF(globals);
    throw std::runtime_error("python snippet failed: " + python_error_text());
  }
  Py_DECREF(result);
  PyObject* value = PyDict_GetItemString(globals, name);
  Py_XINCREF(value);
  Py_DECREF(globals);
  if (!value) throw std::runtime_error(std::string("python snippet did not define ") + name);
  return value;
}

}  // namespace kiln::testing
