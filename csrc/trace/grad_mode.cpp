// Grad-mode switches while tracing: torch.no_grad / enable_grad / set_grad_enabled (called, or entered and
// exited by a `with` statement), torch._C._set_grad_enabled and torch.is_grad_enabled; and torch.autocast
// blocks, entered and left for real the same way but recorded as nothing (kiln/_tracing.py: the recorder
// records autocast's casts themselves).
//
// Design: these calls run for real at trace time, so the recorder's fakes that follow are made under the
// mode eager would have (their requires_grad is eager's), and every change of the mode is recorded as a
// kiln::set_grad_enabled node that the runtime replays in graph order (runtime/node_call.cpp). The mode at
// any point of a trace depends only on the mode at frame entry (GlobalState guard) and on these calls'
// arguments, which must be constants (guarded where they came from the frame), so the recorded values hold
// on every cache hit. trace_root() puts the real mode back when the trace ends, however it ends.
#include "common/error.h"
#include "common/log.h"
#include "trace/interpreter.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

bool contains(PyObject* set, PyObject* item) {
  int r = PySet_Contains(set, item);
  if (r < 0) PyErr_Clear();  // unhashable
  return r == 1;
}

}  // namespace

bool Tracer::grad_enabled() {
  PyObject* r = PyObject_CallNoArgs(helper("grad_enabled"));
  if (!r) rethrow_python("torch.is_grad_enabled()");
  bool on = r == Py_True;
  Py_DECREF(r);
  return on;
}

void Tracer::set_real_grad_mode(bool enabled) {
  PyObject* r = PyObject_CallOneArg(helper("set_grad_enabled"), enabled ? Py_True : Py_False);
  if (!r) PyErr_Clear();  // cannot fail for a bool; never let a restore raise
  Py_XDECREF(r);
}

Tracer::TraceModeRestore::TraceModeRestore(Tracer& t)
    : tracer(t), saved(t.grad_enabled()), autocast(PyObject_CallNoArgs(t.helper("autocast_state"))) {
  if (!autocast) rethrow_python("reading the autocast state");
}
Tracer::TraceModeRestore::~TraceModeRestore() {
  // Runs while an exception may be propagating: keep any pending Python error intact.
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  tracer.set_real_grad_mode(saved);
  PyObject* r = PyObject_CallOneArg(tracer.helper("restore_autocast_state"), autocast);
  if (!r) PyErr_Clear();
  Py_XDECREF(r);
  Py_DECREF(autocast);
  PyErr_Restore(type, value, tb);
}

void Tracer::guard_grad_mode_context(PyObject* value, const SourcePtr& source) {
  int r = PySequence_Contains(helper("GRAD_MODE_CLASSES"), (PyObject*)Py_TYPE(value));
  if (r < 0) PyErr_Clear();
  if (r != 1) return;
  // What the manager's __exit__ restores (and what a break inside its block restores on an exception).
  PyObject* prev = PyObject_GetAttrString(value, "prev");
  if (!prev) {
    PyErr_Clear();  // never entered: it restores nothing yet
    return;
  }
  guards_->add_constant(Source::attr(source, "prev"), prev);
  Py_DECREF(prev);
}

VarPtr Tracer::call_grad_mode(PyObject* fn, const VarPtr& self, const std::vector<VarPtr>& args, const KwArgs& kwargs,
                              bool* handled) {
  *handled = false;
  if (self ? !contains(helper("GRAD_MODE_METHODS"), fn) : !contains(helper("GRAD_MODE_CALLABLES"), fn)) return nullptr;
  *handled = true;
  for (const VarPtr& a : args)
    if (!is_constant(a)) KILN_UNSUPPORTED() << "a grad-mode switch with a traced (non-constant) argument";
  for (const auto& kv : kwargs)
    if (!is_constant(kv.second)) KILN_UNSUPPORTED() << "a grad-mode switch with a traced (non-constant) argument";
  PyObject* callable = fn;
  Py_INCREF(callable);
  if (self) {
    if (!self->is(VarKind::kConst) || !self->value) KILN_UNSUPPORTED() << "a grad-mode method bound to a " << self->describe();
    // A context manager from the frame (a resume function's pending __exit__) restores its `prev`, which
    // wrap() guarded. Entering one from outside would mutate the caller's object on the first call only.
    if (self->source && contains(helper("GRAD_MODE_ENTER_METHODS"), fn))
      KILN_UNSUPPORTED() << "entering a grad-mode context manager that was created outside the compiled code";
    // Leaving an autocast block entered in Python (a resume function inside it) changes the thread's state at
    // run time, which no graph node replays: it runs in Python.
    if (self->source && contains(helper("AUTOCAST_METHODS"), fn))
      KILN_UNSUPPORTED() << "leaving a torch.autocast block that was entered outside the compiled code";
    Py_SETREF(callable, PyMethod_New(fn, self->value));
    if (!callable) rethrow_python("binding a grad-mode method");
  }
  PyObject* py_args = PyTuple_New(args.size());
  for (size_t i = 0; i < args.size(); ++i) PyTuple_SET_ITEM(py_args, i, to_python(args[i]));
  PyObject* py_kwargs = PyDict_New();
  for (const auto& [name, value] : kwargs) {
    PyObject* v = to_python(value);
    PyDict_SetItem(py_kwargs, name, v);
    Py_DECREF(v);
  }
  PyObject* r = PyObject_CallFunctionObjArgs(helper("grad_mode_call"), callable, py_args, py_kwargs, nullptr);
  Py_DECREF(callable);
  Py_DECREF(py_args);
  Py_DECREF(py_kwargs);
  if (!r) rethrow_python("running a grad-mode switch at trace time");
  PyObject* result = PyTuple_GET_ITEM(r, 0);
  PyObject* new_mode = PyTuple_GET_ITEM(r, 1);
  if (new_mode != Py_None) {
    PyObject* ok = PyObject_CallMethod(recorder_, "record_grad_mode", "O", new_mode);
    if (!ok) {
      Py_DECREF(r);
      rethrow_python("recording a grad-mode switch");
    }
    Py_DECREF(ok);
    KILN_LOG(graph) << "traced a grad-mode switch: grad " << (new_mode == Py_True ? "enabled" : "disabled");
  }
  // The result is a context manager (kept as a constant of the trace), None or a bool.
  VarPtr out = make_const(result);
  Py_DECREF(r);
  return out;
}

// BEFORE_WITH: [manager] -> [manager.__exit__, manager.__enter__()]. Only grad-mode, autocast and null managers
// made inside the traced code are entered; any other `with` is a graph break at this instruction (BEFORE_WITH runs in
// Python and the resume function starts inside the block: graph_break.h).
void InstructionTranslator::op_before_with(const bytecode::Instruction&) {
  VarPtr manager = peek();
  static PyObject* enter_name = PyUnicode_InternFromString("__enter__");
  static PyObject* exit_name = PyUnicode_InternFromString("__exit__");
  // A context manager whose class writes __enter__ and __exit__ in Python (an instance made here or read from the
  // frame): both are inlined like any method, __exit__ where the block ends. An exception raised inside the block
  // still breaks the graph (catch_raise), so eager's __exit__ sees it.
  if (manager->is(VarKind::kUserObject) || (manager->is(VarKind::kConst) && manager->value && !PyType_Check(manager->value))) {
    VarPtr enter = tracer_.python_special_method(manager, "__enter__");
    VarPtr exit = enter ? tracer_.python_special_method(manager, "__exit__") : nullptr;
    if (enter && exit) {
      pop();
      push(exit);
      push(tracer_.call(enter, {}, {}));
      return;
    }
  }
  bool grad_mode = false;
  if (manager->is(VarKind::kConst) && manager->value) {
    PyObject* r = PyObject_CallOneArg(tracer_.helper("is_traced_context"), manager->value);
    if (!r) PyErr_Clear();
    grad_mode = r == Py_True;
    Py_XDECREF(r);
  }
  if (!grad_mode) {
    const char* type = manager->value ? Py_TYPE(manager->value)->tp_name : "traced value";
    KILN_UNSUPPORTED() << "with statement on a " << type
                       << " context manager (only torch.no_grad/enable_grad/set_grad_enabled, torch.autocast and "
                          "contextlib.nullcontext blocks are traced)";
  }
  if (manager->source)
    KILN_UNSUPPORTED() << "with statement on a grad-mode or autocast context manager created outside the compiled code";
  pop();
  VarPtr exit = tracer_.get_attr(manager, exit_name);
  VarPtr enter = tracer_.get_attr(manager, enter_name);
  push(exit);
  push(tracer_.call(enter, {}, {}));
}

}  // namespace kiln::trace
