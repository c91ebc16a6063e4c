#pragma once
// The PEP 523 frame hook: what the rest of kiln sees of it.
//
// The hook is installed (process-wide, per interpreter) only while at least one thread has a
// compiler set; the compiler itself is thread-local. For each frame the hook sees while its thread
// has a compiler, it looks up the code object's ExtraState (co_extra) and walks the MRU list of
// CacheEntry: the first entry whose guard passes runs its transformed code in a shadow frame that
// takes over the frame's arguments and free variables. On a miss it calls Compiler::on_miss (with the
// hook disabled on this thread, so frames the compiler runs take the default path), which returns a
// new entry, "run default this time", or "skip this code for good".
//
// The hook never sees: generators/coroutines (their code flags), frames already started (lasti),
// throwflag frames, module and class bodies (no CO_OPTIMIZED), frames while sys.settrace/profile
// tracing is active. Those run on the default evaluator.
#include <Python.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kiln::frame {

/// A read-only view of an intercepted frame, valid only during the call that receives it.
struct FrameView {
  PyCodeObject* code = nullptr;
  PyObject* function = nullptr;  ///< the function object being called (borrowed)
  PyObject* globals = nullptr;   ///< borrowed
  PyObject* builtins = nullptr;  ///< borrowed
  /// localsplus as the hook receives it: arguments bound, other locals NULL, an argument that is
  /// also a cell holds its raw value, free-variable slots NULL (read free vars from `closure`).
  PyObject* const* localsplus = nullptr;
  int nlocalsplus = 0;
  PyObject* closure = nullptr;  ///< the function's closure tuple of cells, or NULL (borrowed)

  /// Local slot `i` (borrowed, may be NULL). For a free variable slot, the cell's content.
  PyObject* local(int i) const {
    if (i < 0 || i >= nlocalsplus) return nullptr;
    int first_free = nlocalsplus - code->co_nfreevars;
    if (i < first_free) return localsplus[i];
    if (closure == nullptr) return nullptr;
    return PyCell_GET(PyTuple_GET_ITEM(closure, i - first_free));
  }
};

/// A guard over a frame: true when the cache entry may run. Implementations must not raise; on
/// an internal error they return false (and may log).
class GuardCheck {
 public:
  virtual ~GuardCheck() = default;
  virtual bool check(const FrameView& frame) const = 0;
  /// Why the last failing check failed, for recompile logs ("x.size()[0] == 8, got 16").
  virtual std::string describe_failure(const FrameView& frame) const { return "guard failed"; }
  virtual std::string describe() const { return "<guards>"; }
  /// True when the check can never pass again (an object it compares by identity was freed): the hook
  /// drops such entries on the code's next miss, with whatever they keep alive.
  virtual bool expired() const { return false; }
};

/// One compiled version of a code object.
struct CacheEntry {
  PyObject* code = nullptr;  ///< transformed code object (new reference, released on destruction)
  std::unique_ptr<GuardCheck> guard;
  std::shared_ptr<void> payload;  ///< whatever the compiler keeps alive with the entry
  std::string label;              ///< for logs and kiln.explain
  ~CacheEntry() { Py_XDECREF(code); }
  CacheEntry() = default;
  CacheEntry(const CacheEntry&) = delete;
  CacheEntry& operator=(const CacheEntry&) = delete;
};

enum class MissAction {
  kAddEntry,    ///< `entry` is filled: add it (MRU front) and run it
  kRunDefault,  ///< run the original code this time; ask again next call
  kSkipCode,    ///< never intercept this code object again (its nested calls still are)
  kRunSuspended,  ///< run the original code this time with the hook suspended for every frame it starts (a
                  ///< function that switches compilers off for what it calls); ask again next call
  kError,       ///< a Python error is set: propagate it from the frame
};

struct MissResult {
  MissAction action = MissAction::kRunDefault;
  std::unique_ptr<CacheEntry> entry;
};

/// What a thread installs to be called on cache misses.
class Compiler {
 public:
  virtual ~Compiler() = default;
  /// Called with the hook disabled on this thread. `entries` are the code's existing entries,
  /// none of whose guards passed (for recompile reasons and limits).
  virtual MissResult on_miss(const FrameView& frame, const std::vector<const CacheEntry*>& entries) = 0;
  /// When true, a miss never compiles: existing entries serve, new inputs run the original code.
  virtual bool run_only() const { return false; }
};

/// Sets this thread's compiler (nullptr: none) and returns the previous one. Installs the hook
/// process-wide while any thread has one. The caller keeps ownership and must keep it alive while set.
/// Needs the GIL.
Compiler* set_thread_compiler(Compiler* compiler);
/// This thread's compiler; nullptr while it runs guards or Compiler::on_miss.
Compiler* thread_compiler();

/// Called by Python's collector as it starts and stops (gc.callbacks, kiln/__init__.py): the finalizers it runs
/// (`__del__`, weakref callbacks) interrupt whatever frame was running, and are never compiled. Needs the GIL.
void garbage_collection(bool started);

/// True while kiln's hook is the interpreter's frame evaluator.
bool hook_installed();
/// Called once at interpreter exit: uninstalls the hook for good (compilers may already be gone).
void uninstall_for_shutdown();

/// Cache entries of a code object, MRU first (for kiln.explain and tests).
std::vector<const CacheEntry*> entries_of(PyCodeObject* code);
/// True when a compiler asked never to intercept this code again (until reset_all()).
bool is_skipped(PyCodeObject* code);
/// Drops every cache entry and skip mark of every code object seen so far, and zeroes the
/// counters (kiln.reset()).
void reset_all();
/// Counters since the last reset: hits, misses, skipped frames.
struct Counters {
  long long hits = 0, misses = 0, default_runs = 0;
};
Counters counters();

/// One hook per process: the hook's state lives in kiln._core only. kiln._C reaches these functions
/// through this table, published by kiln._core as the capsule "kiln._core.frame_api"
/// (csrc/bindings/module_frame_client.cpp defines kiln._C's forwarding versions).
constexpr int kFrameApiVersion = 1;
struct FrameApi {
  int version;
  Compiler* (*set_thread_compiler)(Compiler*);
  Compiler* (*thread_compiler)();
  bool (*hook_installed)();
  std::vector<const CacheEntry*> (*entries_of)(PyCodeObject*);
  bool (*is_skipped)(PyCodeObject*);
  void (*reset_all)();
  Counters (*counters)();
};
const FrameApi* frame_api();

}  // namespace kiln::frame
