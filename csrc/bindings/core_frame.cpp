// kiln._core.frame: the frame hook driven from Python, for tests and the regression-test mode.
//
// A Python callback plays the compiler: callback(frame_info) -> None | "skip" | "suspend" | (code, guard).
// PythonCompiler and PythonGuard below are also the template for the real compiler: a Compiler
// subclass turning a miss into a CacheEntry, a GuardCheck subclass deciding hits.
#include <pybind11/pybind11.h>

#include <memory>

#include "bindings/core_register.h"
#include "frame/frame.h"

namespace py = pybind11;

namespace kiln::bindings {
namespace {

using frame::CacheEntry;
using frame::FrameView;
using frame::MissAction;
using frame::MissResult;

py::object borrow(PyObject* object) {
  return object ? py::reinterpret_borrow<py::object>(object) : py::none();
}

/// The dict both callbacks receive: code, function, globals, entries, and the frame's bound
/// locals by name (arguments, and free variables' cell contents), read without a frame object.
py::dict frame_info(const FrameView& view, size_t entry_count) {
  py::dict locals;
  PyObject* names = view.code->co_localsplusnames;
  for (int i = 0; i < view.nlocalsplus; ++i) {
    if (PyObject* value = view.local(i)) locals[PyTuple_GET_ITEM(names, i)] = borrow(value);
  }
  py::dict info;
  info["code"] = borrow(reinterpret_cast<PyObject*>(view.code));
  info["function"] = borrow(view.function);
  info["globals"] = borrow(view.globals);
  info["locals"] = locals;
  info["entries"] = entry_count;
  return info;
}

class PythonGuard : public frame::GuardCheck {
 public:
  explicit PythonGuard(py::object check) : check_(std::move(check)) {}
  // Entries are destroyed with code objects or by reset(): always with the GIL held.

  bool check(const FrameView& view) const override {
    try {
      py::dict info = frame_info(view, frame::entries_of(view.code).size());
      return py::bool_(check_(info));
    } catch (py::error_already_set& error) {
      error.restore();
    } catch (py::builtin_exception& error) {
      error.set_error();
    }
    // GuardCheck must not raise: report it like an exception in a __del__ and treat as failed.
    PyErr_WriteUnraisable(check_.ptr());
    return false;
  }
  std::string describe() const override { return py::str(py::repr(check_)); }

 private:
  py::object check_;
};

class PythonCompiler : public frame::Compiler, public std::enable_shared_from_this<PythonCompiler> {
 public:
  explicit PythonCompiler(py::object callback) : callback_(std::move(callback)) {}
  const py::object& callback() const { return callback_; }

  MissResult on_miss(const FrameView& view, const std::vector<const CacheEntry*>& entries) override {
    // The callback may replace this thread's compiler (dropping the last owner of `this`).
    std::shared_ptr<PythonCompiler> keep_alive = shared_from_this();
    MissResult result;
    try {
      py::object decision = callback_(frame_info(view, entries.size()));
      result = interpret(decision);
    } catch (py::error_already_set& error) {
      error.restore();
      result.action = MissAction::kError;
    } catch (py::builtin_exception& error) {
      error.set_error();
      result.action = MissAction::kError;
    }
    return result;
  }

 private:
  static MissResult interpret(const py::object& decision) {
    MissResult result;
    if (decision.is_none()) {
      result.action = MissAction::kRunDefault;
    } else if (py::isinstance<py::str>(decision) && decision.cast<std::string>() == "skip") {
      result.action = MissAction::kSkipCode;
    } else if (py::isinstance<py::str>(decision) && decision.cast<std::string>() == "suspend") {
      result.action = MissAction::kRunSuspended;
    } else if (py::isinstance<py::tuple>(decision) && py::len(decision) == 2) {
      py::tuple pair = decision;
      if (!PyCode_Check(pair[0].ptr()))
        throw py::type_error("kiln frame callback: the first item of (code, guard) must be a code object");
      if (!pair[1].is_none() && !PyCallable_Check(pair[1].ptr()))
        throw py::type_error("kiln frame callback: guard must be callable or None");
      auto entry = std::make_unique<CacheEntry>();
      entry->code = py::object(pair[0]).release().ptr();
      if (!pair[1].is_none()) entry->guard = std::make_unique<PythonGuard>(pair[1]);
      entry->label = py::str(pair[0].attr("co_qualname"));
      result.action = MissAction::kAddEntry;
      result.entry = std::move(entry);
    } else {
      throw py::type_error("kiln frame callback must return None, \"skip\", \"suspend\" or a (code, guard) tuple, got " +
                           std::string(py::str(py::repr(decision))));
    }
    return result;
  }

  py::object callback_;
};

// The Python compiler this thread installed. A heap slot that is never destroyed automatically:
// a thread_local with a destructor would drop Python references at thread exit without the GIL.
thread_local std::shared_ptr<PythonCompiler>* tls_python_compiler = nullptr;

std::shared_ptr<PythonCompiler> take_python_slot() {
  if (tls_python_compiler == nullptr) return nullptr;
  std::shared_ptr<PythonCompiler> held = std::move(*tls_python_compiler);
  delete tls_python_compiler;
  tls_python_compiler = nullptr;
  return held;
}

void put_python_slot(std::shared_ptr<PythonCompiler> compiler) {
  if (compiler == nullptr) return;
  tls_python_compiler = new std::shared_ptr<PythonCompiler>(std::move(compiler));
}

/// What a thread had installed before: restored by run_with_compiler.
struct SavedCompiler {
  frame::Compiler* installed = nullptr;
  std::shared_ptr<PythonCompiler> python;
};

SavedCompiler swap_compiler(std::shared_ptr<PythonCompiler> next) {
  SavedCompiler saved;
  saved.installed = frame::set_thread_compiler(next.get());
  saved.python = take_python_slot();
  put_python_slot(std::move(next));
  return saved;
}

void restore_compiler(SavedCompiler saved) {
  frame::set_thread_compiler(saved.installed);
  std::shared_ptr<PythonCompiler> replaced = take_python_slot();
  put_python_slot(std::move(saved.python));
  replaced.reset();  // may drop the callback: after the slot is consistent again
}

std::shared_ptr<PythonCompiler> compiler_for(const py::object& callback) {
  if (callback.is_none()) return nullptr;
  if (!PyCallable_Check(callback.ptr())) throw py::type_error("set_compiler expects a callable or None");
  return std::make_shared<PythonCompiler>(callback);
}

PyCodeObject* code_of(const py::object& code_or_function) {
  py::object code = code_or_function;
  if (!PyCode_Check(code.ptr()) && py::hasattr(code, "__code__")) code = code.attr("__code__");
  if (!PyCode_Check(code.ptr())) throw py::type_error("expected a code object or a function");
  return reinterpret_cast<PyCodeObject*>(code.ptr());
}

}  // namespace

void register_frame(py::module_& m) {
  py::module_ f = m.def_submodule("frame", "The PEP 523 frame hook (kiln/csrc/frame), driven from Python");

  f.def(
      "set_compiler",
      [](py::object callback) -> py::object {
        SavedCompiler saved = swap_compiler(compiler_for(callback));
        bool was_python = saved.python != nullptr && saved.installed == saved.python.get();
        return was_python ? saved.python->callback() : py::none();
      },
      py::arg("callback"),
      "Sets this thread's compiler callback (None: none); returns the previous callback.\n"
      "callback(frame_info) -> None (run normally this time) | 'skip' (never intercept this code)\n"
      "| 'suspend' (run normally this time, and intercept nothing it calls)\n"
      "| (code, guard): run `code` instead, now and whenever guard(frame_info) is true (None: always).");

  f.def(
      "run_with_compiler",
      [](py::object callback, py::object fn, py::args args, py::kwargs kwargs) -> py::object {
        SavedCompiler saved = swap_compiler(compiler_for(callback));
        try {
          py::object result = fn(*args, **kwargs);
          restore_compiler(std::move(saved));
          return result;
        } catch (...) {
          restore_compiler(std::move(saved));
          throw;
        }
      },
      py::arg("callback"), py::arg("fn"), "Calls fn(*args, **kwargs) with `callback` as this thread's compiler.");

  f.def(
      "entries", [](py::object code) { return frame::entries_of(code_of(code)).size(); }, py::arg("code"),
      "Number of cache entries of a code object (or a function's code).");
  f.def(
      "entry_labels",
      [](py::object code) {
        py::list labels;
        for (const CacheEntry* entry : frame::entries_of(code_of(code))) labels.append(entry->label);
        return labels;
      },
      py::arg("code"), "Labels of a code object's entries, most recently used first.");
  f.def(
      "is_skipped", [](py::object code) { return frame::is_skipped(code_of(code)); }, py::arg("code"));
  f.def("reset", &frame::reset_all, "Drops every cache entry and skip mark; zeroes the counters.");
  f.def("counters", [] {
    frame::Counters c = frame::counters();
    py::dict d;
    d["hits"] = c.hits;
    d["misses"] = c.misses;
    d["default_runs"] = c.default_runs;
    return d;
  });
  f.def("hook_installed", &frame::hook_installed);
  f.def(
      "gc_phase", [](const std::string& phase, py::object) { frame::garbage_collection(phase == "start"); },
      py::arg("phase"), py::arg("info"), "A gc.callbacks entry: suspends the hook while the collector runs finalizers.");

  // At exit the callbacks' modules are being torn down: stop intercepting before that starts.
  // kiln._C drives this module's hook (one hook per process) through the function table.
  m.attr("frame_api") = py::capsule(static_cast<const void*>(frame::frame_api()), "kiln._core.frame_api");
  py::module_::import("atexit").attr("register")(py::cpp_function([] { frame::uninstall_for_shutdown(); }));
}

}  // namespace kiln::bindings
