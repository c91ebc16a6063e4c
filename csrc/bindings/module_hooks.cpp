// What the layers below ask of the Python interpreter they run in, injected here so that they link no CPython
// symbol themselves (the C++ loader of exported programs, kiln/export.h, runs them without Python): the GIL dropped
// while code loads (runtime/kernel_graph.h), and the NVRTC wheel's folders found with importlib
// (codegen/cuda/nvrtc_compiler.h).
#include <Python.h>

#include <string>
#include <vector>

#include "bindings/module_register.h"
#include "codegen/cuda/nvrtc_compiler.h"
#include "runtime/kernel_graph.h"

namespace kiln::bindings {
namespace {

void* release_gil() { return Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr; }

void restore_gil(void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }

// The wheel's lib folders, from `importlib.util.find_spec("nvidia").submodule_search_locations`. Empty after the
// interpreter finalised or when the package is absent.
std::vector<std::string> nvrtc_wheel_dirs() {
  std::vector<std::string> dirs;
  if (!Py_IsInitialized()) return dirs;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* util = PyImport_ImportModule("importlib.util");
  PyObject* spec = util ? PyObject_CallMethod(util, "find_spec", "s", "nvidia") : nullptr;
  PyObject* locations =
      (spec && spec != Py_None) ? PyObject_GetAttrString(spec, "submodule_search_locations") : nullptr;
  PyObject* iterator = (locations && locations != Py_None) ? PyObject_GetIter(locations) : nullptr;
  while (PyObject* item = iterator ? PyIter_Next(iterator) : nullptr) {
    if (const char* text = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : nullptr) {
      for (const char* sub : {"cu13/lib", "cuda_nvrtc/lib", "cu12/lib"}) dirs.push_back(std::string(text) + "/" + sub);
    }
    Py_DECREF(item);
  }
  Py_XDECREF(iterator);
  Py_XDECREF(locations);
  Py_XDECREF(spec);
  Py_XDECREF(util);
  PyErr_Clear();  // a missing package is an ordinary outcome of the search
  PyGILState_Release(gil);
  return dirs;
}

}  // namespace

void install_python_hooks() {
  runtime::set_load_unlock({release_gil, restore_gil});
  codegen::cuda::set_nvrtc_wheel_search(nvrtc_wheel_dirs);
  install_cuda_graph_api();
}

}  // namespace kiln::bindings
