// The CUDA graph recording API that runtime/cuda_graphs.h asks for, through torch's Python CUDA graph object
// (kiln/_cuda_graphs.py). Each function takes the GIL itself: the autograd engine calls a backward's runner from a
// thread that does not hold it.
#include <Python.h>

#include <string>

#include "bindings/module_register.h"
#include "frame/frame.h"
#include "runtime/cuda_graphs.h"

namespace kiln::bindings {
namespace {

// The Python error as text (cleared), for the runtime's reasons.
std::string take_python_error() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  std::string text = "unknown error";
  if (value) {
    if (PyObject* s = PyObject_Str(value)) {
      if (const char* utf8 = PyUnicode_AsUTF8(s)) text = utf8;
      Py_DECREF(s);
    }
  }
  if (type) text = std::string(((PyTypeObject*)type)->tp_name) + ": " + text;
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  PyErr_Clear();
  return text;
}

// The GIL, and the thread's frame-hook compiler suspended: torch's Python that records a graph runs as plain Python,
// never traced (a compiled call records its graph from inside the compiled frame).
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()), compiler_(frame::set_thread_compiler(nullptr)) {}
  ~Gil() {
    frame::set_thread_compiler(compiler_);
    PyGILState_Release(state_);
  }

 private:
  PyGILState_STATE state_;
  frame::Compiler* compiler_;
};

PyObject* helpers() {
  static PyObject* module = PyImport_ImportModule("kiln._cuda_graphs");
  return module;
}

void* new_pool(int device, std::string* error) {
  Gil gil;
  PyObject* pool = helpers() ? PyObject_CallMethod(helpers(), "Pool", "i", device) : nullptr;
  if (!pool) *error = take_python_error();
  return pool;
}

void* begin(void* pool, std::string* error) {
  Gil gil;
  PyObject* recording =
      helpers() ? PyObject_CallMethod(helpers(), "Recording", "O", static_cast<PyObject*>(pool)) : nullptr;
  if (!recording) *error = take_python_error();
  return recording;
}

void* end(void* capture, std::string* error) {
  Gil gil;
  auto* recording = static_cast<PyObject*>(capture);
  PyObject* graph = PyObject_CallMethod(recording, "end", nullptr);
  if (!graph) *error = take_python_error();
  Py_DECREF(recording);
  if (!graph) return nullptr;
  // The bound replay method, so a replay is one call.
  PyObject* replay = PyObject_GetAttrString(graph, "replay");
  Py_DECREF(graph);
  if (!replay) *error = take_python_error();
  return replay;
}

bool replay(void* graph, std::string* error) {
  // torch's replay is C++ behind a pybind method: no Python frame to keep the hook from.
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* result = PyObject_CallNoArgs(static_cast<PyObject*>(graph));
  if (!result) {
    *error = take_python_error();
    PyGILState_Release(gil);
    return false;
  }
  Py_DECREF(result);
  PyGILState_Release(gil);
  return true;
}

void release(void* handle) {
#if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return;  // torch's objects are gone with the interpreter
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif  // torch's objects are gone with the interpreter
  Gil gil;
  Py_DECREF(static_cast<PyObject*>(handle));
}

}  // namespace

void install_cuda_graph_api() { runtime::set_cuda_graph_api({new_pool, begin, end, replay, release}); }

}  // namespace kiln::bindings
