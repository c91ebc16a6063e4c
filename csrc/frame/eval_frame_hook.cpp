// The PEP 523 hook: decides per frame whether to run a cached entry, ask the compiler, or let
// CPython's evaluator run the frame as usual (see frame.h for the contract).
//
// State and threads: the hook is per interpreter, the compiler per thread (thread_local). The
// count of threads with a compiler, the counters and every ExtraState are only touched with the
// GIL held, which is what makes them safe without locks.
#include <exception>
#include <memory>
#include <vector>

#include "common/log.h"
#include "frame/cpython_shim.h"
#include "frame/extra_state.h"
#include "frame/frame.h"

namespace kiln::frame {
namespace {

thread_local Compiler* tls_compiler = nullptr;
// > 0 while this thread runs guards or the compiler: their own frames take the default path.
thread_local int tls_suspended = 0;

int g_threads_with_compiler = 0;  // GIL
bool g_shut_down = false;         // GIL; set at interpreter exit, never cleared
Counters g_counters;              // GIL
// What ran frames before kiln installed itself (CPython's evaluator, or another PEP 523 hook).
_PyFrameEvalFunction g_previous_eval = _PyEval_EvalFrameDefault;

constexpr int kNeverIntercepted = CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR | CO_ITERABLE_COROUTINE;

class CompilerSuspended {
 public:
  CompilerSuspended() { ++tls_suspended; }
  ~CompilerSuspended() { --tls_suspended; }
  CompilerSuspended(const CompilerSuspended&) = delete;
  CompilerSuspended& operator=(const CompilerSuspended&) = delete;
};

/// Runs `body`; a C++ exception escaping it becomes a Python RuntimeError (the hook is called
/// from C and must never let one through). Returns false when that happened.
template <typename Body>
bool without_cpp_exceptions(const char* what, Body&& body) {
  try {
    body();
    return true;
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "kiln frame hook: %s failed: %s", what, e.what());
    return false;
  } catch (...) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "kiln frame hook: %s failed", what);
    return false;
  }
}

PyObject* run_default(PyThreadState* tstate, _PyInterpreterFrame* frame, int throwflag) {
  return g_previous_eval(tstate, frame, throwflag);
}

/// Frames the hook never offers to a compiler (frame.h lists them).
bool interceptable(const KilnFrameFacts& facts, PyThreadState* tstate) {
  if (facts.code == nullptr || facts.function == nullptr) return false;
  if (!facts.not_started || facts.has_locals_mapping) return false;
  int flags = facts.code->co_flags;
  if (!(flags & CO_OPTIMIZED) || (flags & kNeverIntercepted)) return false;
  return !kiln_shim_tracing_active(tstate);
}

FrameView view_of(const KilnFrameFacts& facts) {
  FrameView view;
  view.code = facts.code;
  view.function = facts.function;
  view.globals = facts.globals;
  view.builtins = facts.builtins;
  view.localsplus = facts.localsplus;
  view.nlocalsplus = facts.nlocalsplus;
  view.closure = reinterpret_cast<PyFunctionObject*>(facts.function)->func_closure;
  return view;
}

/// The first entry whose guard passes (moved to the front), or null. Runs with the compiler
/// suspended. A guard that changes this code's entries (reentrant compile or reset) ends the
/// walk: the indices no longer mean anything.
std::shared_ptr<EntrySlot> find_passing_entry(ExtraState& state, const FrameView& view) {
  CompilerSuspended suspended;
  for (size_t i = 0; i < state.entries.size(); ++i) {
    std::shared_ptr<EntrySlot> slot = state.entries[i];
    unsigned long long version = state.version;
    const GuardCheck* guard = slot->entry->guard.get();
    bool passed = guard == nullptr || guard->check(view);
    if (state.version != version) {
      if (!passed) return nullptr;
      for (size_t k = 0; k < state.entries.size(); ++k)
        if (state.entries[k] == slot) state.move_to_front(k);
      return slot;
    }
    if (passed) {
      state.move_to_front(i);
      return slot;
    }
  }
  return nullptr;
}

/// A function object carrying the entry's code with the original's globals and closure: the
/// shadow frame needs one (COPY_FREE_VARS reads its closure, generators are built from it).
/// Reused for closure-free functions with the same globals; a closure is never kept alive by
/// the cache, since it may hold large objects (tensors) of a call long gone.
PyObject* shadow_function_for(EntrySlot& slot, PyObject* original_function) {
  auto* original = reinterpret_cast<PyFunctionObject*>(original_function);
  if (slot.shadow_function != nullptr && original->func_closure == nullptr &&
      reinterpret_cast<PyFunctionObject*>(slot.shadow_function)->func_globals == original->func_globals)
    return Py_NewRef(slot.shadow_function);
  PyObject* function = PyFunction_New(slot.entry->code, original->func_globals);
  if (function == nullptr) return nullptr;
  if (original->func_closure != nullptr) {
    if (PyFunction_SetClosure(function, original->func_closure) < 0) {
      Py_DECREF(function);
      return nullptr;
    }
  } else {
    Py_XSETREF(slot.shadow_function, Py_NewRef(function));
  }
  return function;
}

PyObject* run_entry(PyThreadState* tstate, _PyInterpreterFrame* frame, EntrySlot& slot,
                    PyObject* original_function) {
  PyObject* function = shadow_function_for(slot, original_function);
  if (function == nullptr) {
    kiln_shim_release_unrun_frame(tstate, frame);
    return nullptr;
  }
  PyObject* result = kiln_shim_run_shadow_frame(tstate, frame, function);
  Py_DECREF(function);
  return result;
}

/// The shadow frame takes over the original's argument and free-variable slots one for one, so
/// the transformed code must bind exactly the same ones. Sets TypeError when it does not.
bool shadow_layout_matches(PyCodeObject* original, PyObject* transformed_object) {
  if (!PyCode_Check(transformed_object)) {
    PyErr_Format(PyExc_TypeError, "kiln: a cache entry's code must be a code object, not %s",
                 Py_TYPE(transformed_object)->tp_name);
    return false;
  }
  auto* transformed = reinterpret_cast<PyCodeObject*>(transformed_object);
  constexpr int kBindingFlags = CO_VARARGS | CO_VARKEYWORDS;
  bool same = original->co_argcount == transformed->co_argcount &&
              original->co_kwonlyargcount == transformed->co_kwonlyargcount &&
              (original->co_flags & kBindingFlags) == (transformed->co_flags & kBindingFlags) &&
              !(transformed->co_flags & kNeverIntercepted);
  if (same) {
    PyObject* original_free = PyCode_GetFreevars(original);
    PyObject* transformed_free = PyCode_GetFreevars(transformed);
    int equal = original_free && transformed_free
                    ? PyObject_RichCompareBool(original_free, transformed_free, Py_EQ)
                    : -1;
    Py_XDECREF(original_free);
    Py_XDECREF(transformed_free);
    if (equal < 0) return false;
    same = equal == 1;
  }
  if (!same) {
    PyErr_Format(PyExc_TypeError,
                 "kiln: the transformed code for %R must take the same arguments and free variables "
                 "as the original and must not be a generator or coroutine (it may only add locals)",
                 original->co_qualname);
  }
  return same;
}

/// The compiler decides what to do with a frame no entry accepted.
PyObject* handle_miss(PyThreadState* tstate, _PyInterpreterFrame* frame, int throwflag,
                      const KilnFrameFacts& facts, const FrameView& view, ExtraState* state,
                      Compiler* compiler) {
  ++g_counters.misses;
  // Entries whose guards can never pass again (their model or class was freed) go first: they would hold
  // compiled graphs and count toward the recompile limit for nothing.
  if (state != nullptr) state->take_expired_entries().clear();
  MissResult result;
  bool ok = without_cpp_exceptions("the compiler", [&] {
    std::vector<const CacheEntry*> existing;
    if (state != nullptr)
      for (const auto& slot : state->entries) existing.push_back(slot->entry.get());
    CompilerSuspended suspended;
    result = compiler->on_miss(view, existing);
  });
  if (!ok || PyErr_Occurred()) result.action = MissAction::kError;

  switch (result.action) {
    case MissAction::kAddEntry: {
      if (result.entry == nullptr || result.entry->code == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "kiln: the compiler asked to add an entry without code");
        break;
      }
      if (!shadow_layout_matches(facts.code, result.entry->code)) break;
      ExtraState* target = ensure_extra_state(facts.code);
      if (target == nullptr) break;
      if (!without_cpp_exceptions("adding a cache entry", [&] { target->add_front(std::move(result.entry)); }))
        break;
      std::shared_ptr<EntrySlot> slot = target->entries.front();
      return run_entry(tstate, frame, *slot, facts.function);
    }
    case MissAction::kSkipCode: {
      ExtraState* target = ensure_extra_state(facts.code);
      if (target == nullptr) break;
      target->skip = true;
      ++g_counters.default_runs;
      return run_default(tstate, frame, throwflag);
    }
    case MissAction::kRunDefault:
      ++g_counters.default_runs;
      return run_default(tstate, frame, throwflag);
    case MissAction::kRunSuspended: {
      ++g_counters.default_runs;
      CompilerSuspended suspended;
      return run_default(tstate, frame, throwflag);
    }
    case MissAction::kError:
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "kiln: the compiler failed without an error");
      break;
  }
  // Every path that reaches here has a Python error set and has not run the frame.
  KILN_LOG(fallbacks) << "frame hook: error while handling a miss for "
                      << PyUnicode_AsUTF8(facts.code->co_qualname);
  kiln_shim_release_unrun_frame(tstate, frame);
  return nullptr;
}

bool is_resume_code(PyCodeObject* code, ExtraState* state) {
  if (state == nullptr) return kiln_shim_is_resume_code(code) != 0;
  if (state->resume < 0) state->resume = static_cast<int8_t>(kiln_shim_is_resume_code(code) != 0);
  return state->resume != 0;
}

PyObject* intercept_frame(PyThreadState* tstate, _PyInterpreterFrame* frame, int throwflag, Compiler* compiler,
                          const KilnFrameFacts& facts, ExtraState* state);

PyObject* eval_frame_hook(PyThreadState* tstate, _PyInterpreterFrame* frame, int throwflag) {
  Compiler* compiler = tls_compiler;
  if (compiler == nullptr || tls_suspended > 0 || throwflag) return run_default(tstate, frame, throwflag);

  KilnFrameFacts facts;
  kiln_shim_read_frame(frame, &facts);
  bool intercept = interceptable(facts, tstate);
  ExtraState* state = intercept ? extra_state_of(facts.code) : nullptr;
  if (!intercept || (state != nullptr && state->skip)) {
    ++g_counters.default_runs;
    return run_default(tstate, frame, throwflag);
  }
  // A resume function's frame is the rest of its function's frame (trace/break_code.h): eager has one frame
  // there, so this one runs with a level of recursion headroom added (CPython's recursion tests set limits a
  // few frames above their own depth).
  const bool resume = is_resume_code(facts.code, state);
  if (resume) kiln_shim_add_recursion_headroom(tstate, 1);
  PyObject* result = intercept_frame(tstate, frame, throwflag, compiler, facts, state);
  if (resume) kiln_shim_add_recursion_headroom(tstate, -1);
  return result;
}

PyObject* intercept_frame(PyThreadState* tstate, _PyInterpreterFrame* frame, int throwflag, Compiler* compiler,
                          const KilnFrameFacts& facts, ExtraState* state) {

  FrameView view = view_of(facts);
  if (state != nullptr && !state->entries.empty()) {
    std::shared_ptr<EntrySlot> slot;
    if (!without_cpp_exceptions("guard evaluation", [&] { slot = find_passing_entry(*state, view); })) {
      kiln_shim_release_unrun_frame(tstate, frame);
      return nullptr;
    }
    if (slot != nullptr) {
      ++g_counters.hits;
      return run_entry(tstate, frame, *slot, facts.function);
    }
  }
  if (compiler->run_only()) {
    ++g_counters.default_runs;
    return run_default(tstate, frame, throwflag);
  }
  return handle_miss(tstate, frame, throwflag, facts, view, state, compiler);
}

/// Installs the hook while some thread has a compiler, restores what was there before otherwise.
void update_hook_installation() {
  PyInterpreterState* interp = PyInterpreterState_Get();
  _PyFrameEvalFunction current = _PyInterpreterState_GetEvalFrameFunc(interp);
  bool wanted = g_threads_with_compiler > 0 && !g_shut_down;
  if (wanted && current != eval_frame_hook) {
    g_previous_eval = current;
    _PyInterpreterState_SetEvalFrameFunc(interp, eval_frame_hook);
  } else if (!wanted && current == eval_frame_hook) {
    _PyInterpreterState_SetEvalFrameFunc(interp, g_previous_eval);
    g_previous_eval = _PyEval_EvalFrameDefault;
  }
}

}  // namespace

Compiler* set_thread_compiler(Compiler* compiler) {
  Compiler* previous = tls_compiler;
  tls_compiler = compiler;
  if (previous == nullptr && compiler != nullptr) ++g_threads_with_compiler;
  if (previous != nullptr && compiler == nullptr) --g_threads_with_compiler;
  update_hook_installation();
  return previous;
}

Compiler* thread_compiler() { return tls_suspended > 0 ? nullptr : tls_compiler; }

void garbage_collection(bool started) {
  if (started) {
    ++tls_suspended;
  } else if (tls_suspended > 0) {
    --tls_suspended;
  }
}

bool hook_installed() {
  return _PyInterpreterState_GetEvalFrameFunc(PyInterpreterState_Get()) == eval_frame_hook;
}

void uninstall_for_shutdown() {
  g_shut_down = true;
  update_hook_installation();
}

std::vector<const CacheEntry*> entries_of(PyCodeObject* code) {
  std::vector<const CacheEntry*> result;
  if (ExtraState* state = extra_state_of(code))
    for (const auto& slot : state->entries) result.push_back(slot->entry.get());
  return result;
}

bool is_skipped(PyCodeObject* code) {
  ExtraState* state = extra_state_of(code);
  return state != nullptr && state->skip;
}

void reset_all() {
  reset_all_extra_states();
  g_counters = Counters{};
}

Counters counters() { return g_counters; }

const FrameApi* frame_api() {
  static const FrameApi api = {
      kFrameApiVersion, &set_thread_compiler, &thread_compiler, &hook_installed, &entries_of, &is_skipped, &reset_all,
      &counters,
  };
  return &api;
}

}  // namespace kiln::frame
