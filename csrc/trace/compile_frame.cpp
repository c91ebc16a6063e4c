#include "trace/compile_frame.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "common/error.h"
#include "common/log.h"
#include "common/progress.h"
#include "compile/backends.h"
#include "runtime/frame_program.h"
#include "trace/code_layout.h"
#include "trace/data_parallel_buckets.h"
#include "trace/graph_break.h"
#include "trace/tracer.h"
#include "trace/transform_code.h"

namespace kiln::trace {

Stats& stats() {
  static Stats s;
  return s;
}

namespace {
thread_local const KilnCompiler* tls_active = nullptr;
}  // namespace

void set_active_compiler(const KilnCompiler* compiler) { tls_active = compiler; }

namespace {

SourceRoots roots_of(const frame::FrameView& frame) {
  SourceRoots roots;
  roots.locals = frame.localsplus;
  roots.nlocals = frame.nlocalsplus;
  roots.closure = frame.closure;
  roots.globals = frame.globals;
  roots.builtins = frame.builtins;
  return roots;
}

// The frame hook's view of a GuardTree.
class FrameGuard : public frame::GuardCheck {
 public:
  FrameGuard(std::shared_ptr<guards::GuardTree> tree, const KilnCompiler* owner)
      : tree_(std::move(tree)), serial_(owner->serial()) {}
  bool check(const frame::FrameView& frame) const override {
    return owns(tls_active) && tree_->check(roots_of(frame));
  }
  std::string describe_failure(const frame::FrameView& frame) const override {
    if (!owns(tls_active)) return "compiled by another kiln.compile call (other backend or options)";
    return tree_->explain_failure(roots_of(frame));
  }
  bool owns(const KilnCompiler* compiler) const { return compiler && compiler->serial() == serial_; }
  bool expired() const override { return !KilnCompiler::alive(serial_) || tree_->expired(); }
  std::string describe() const override {
    std::string out;
    for (const std::string& line : tree_->describe()) out += line + "\n";
    return out;
  }
  const guards::GuardTree& tree() const { return *tree_; }

 private:
  std::shared_ptr<guards::GuardTree> tree_;
  unsigned long long serial_;  // the owning compiler's (it may have been freed; a new one never reuses it)
};

// What a cache entry keeps alive besides its code: the program object (also in co_consts) and the graph.
struct EntryPayload {
  PyObject* program = nullptr;
  PyObject* graph = nullptr;
  ~EntryPayload() {
    Py_XDECREF(program);
    Py_XDECREF(graph);
  }
};

std::string where(PyCodeObject* code) {
  return std::string(PyUnicode_AsUTF8(code->co_qualname)) + " at " + PyUnicode_AsUTF8(code->co_filename) + ":" +
         std::to_string(code->co_firstlineno);
}

// Python's cyclic garbage collector paused while a frame compiles (and switched back on only if it was on):
// tracing and the backend allocate many short-lived Python objects, and each collection they trigger walks a heap
// that holds all of torch. transformer6_train's first call spent 0.13 s in 141 collections on the development
// machine.
class GcPaused {
 public:
  GcPaused() : was_enabled_(PyGC_Disable()) {}
  ~GcPaused() {
    if (was_enabled_) PyGC_Enable();
  }
  GcPaused(const GcPaused&) = delete;
  GcPaused& operator=(const GcPaused&) = delete;

 private:
  int was_enabled_;
};

PyObject* string_list(const std::vector<std::string>& lines) {
  PyObject* list = PyList_New(lines.size());
  for (size_t i = 0; i < lines.size(); ++i) PyList_SET_ITEM(list, i, PyUnicode_FromString(lines[i].c_str()));
  return list;
}

// A Python callable answering the compiled graph's cudagraph_status() when called (kiln.explain reads it after the
// calls it made), or None once the graph is gone.
PyObject* cudagraph_status_callable(const std::shared_ptr<runtime::CompiledGraph>& compiled) {
  using Weak = std::weak_ptr<runtime::CompiledGraph>;
  PyObject* capsule = PyCapsule_New(new Weak(compiled), "kiln.cudagraph_status", [](PyObject* c) {
    delete static_cast<Weak*>(PyCapsule_GetPointer(c, "kiln.cudagraph_status"));
  });
  if (!capsule) return nullptr;
  static PyMethodDef method = {
      "cudagraph_status",
      [](PyObject* self, PyObject*) -> PyObject* {
        auto graph = static_cast<Weak*>(PyCapsule_GetPointer(self, "kiln.cudagraph_status"))->lock();
        if (!graph) Py_RETURN_NONE;
        return PyUnicode_FromString(graph->cudagraph_status().c_str());
      },
      METH_NOARGS, nullptr};
  PyObject* fn = PyCFunction_New(&method, capsule);
  Py_DECREF(capsule);
  return fn;
}

// Whether the calling thread is inside an import (a frame of importlib's bootstrap on its stack). A module's top level
// and everything it calls while it imports run once, as the library wrote them: compiling them buys nothing, and a
// lazy import of a large library reached from eager code between graphs (sympy, imported by torch on first use of
// torch.utils.checkpoint) made thousands of frames compile, break and recompile. Walked on misses only.
bool running_an_import() {
  PyFrameObject* f = PyThreadState_GetFrame(PyThreadState_Get());
  bool found = false;
  for (int depth = 0; f && depth < 256 && !found; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(f);
    found = PyUnicode_Check(code->co_filename) &&
            PyUnicode_CompareWithASCIIString(code->co_filename, "<frozen importlib._bootstrap>") == 0;
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  return found;
}

// Whether `code` is FSDP1's FullyShardedDataParallel.forward (once torch.distributed.fsdp is imported). Its unit runs
// with kiln suspended, the modules it wraps included: FSDP1 swaps its flat parameters' views into the wrapped modules
// around each forward and hooks their gradients' accumulation, and a wrapped layer compiled by kiln left a flat
// parameter with a gradient its post-backward hook never saw (FSDP's "should use _saved_grad_shard" assertion in the
// first backward). FSDP2's fully_shard is compiled around (a graph break per sharded module).
bool is_fsdp1_forward(PyCodeObject* code) {
  static PyObject* forward_code = nullptr;  // kept for the process once found
  if (!forward_code) {
    PyObject* module = PyDict_GetItemString(PyImport_GetModuleDict(), "torch.distributed.fsdp.fully_sharded_data_parallel");
    if (!module) return false;
    PyObject* cls = PyObject_GetAttrString(module, "FullyShardedDataParallel");
    PyObject* forward = cls ? PyObject_GetAttrString(cls, "forward") : nullptr;
    forward_code = forward ? PyObject_GetAttrString(forward, "__code__") : nullptr;
    Py_XDECREF(forward);
    Py_XDECREF(cls);
    PyErr_Clear();
    if (!forward_code) return false;
  }
  return (PyObject*)code == forward_code;
}

// kiln._tracing.skip_reason(filename): frames of torch, kiln and the standard library are not traced
// (with trace_all, only kiln's own).
bool skipped_file(PyCodeObject* code, bool trace_all) {
  static PyObject* fn = [] {
    PyObject* m = PyImport_ImportModule("kiln._tracing");
    PyObject* f = m ? PyObject_GetAttrString(m, "skip_reason") : nullptr;
    Py_XDECREF(m);
    return f;
  }();
  if (!fn) {
    PyErr_Clear();
    return false;
  }
  PyObject* r = PyObject_CallOneArg(fn, code->co_filename);
  if (!r) {
    PyErr_Clear();
    return false;
  }
  bool skip = r != Py_None && (!trace_all || (PyUnicode_Check(r) && PyUnicode_CompareWithASCIIString(r, "kiln itself") == 0));
  Py_DECREF(r);
  return skip;
}

// kiln.config.module_instance_limit, read on the misses that need it (a new instance of a module).
int module_instance_limit() {
  constexpr int kDefault = 64;
  PyObject* config = PyImport_ImportModule("kiln.config");
  PyObject* limit = config ? PyObject_GetAttrString(config, "module_instance_limit") : nullptr;
  Py_XDECREF(config);
  long value = limit && PyLong_Check(limit) ? PyLong_AsLong(limit) : kDefault;
  Py_XDECREF(limit);
  PyErr_Clear();
  return (int)value;
}

// kiln.config.progress_after_s: seconds a frame compiles before the progress display shows it; None turns the display
// off. Read on each compile while the display is wanted (common/progress.h).
std::optional<double> progress_after_s() {
  constexpr double kDefault = 1.0;
  PyObject* config = PyImport_ImportModule("kiln.config");
  PyObject* after = config ? PyObject_GetAttrString(config, "progress_after_s") : nullptr;
  Py_XDECREF(config);
  std::optional<double> value = kDefault;
  if (after == Py_None) value = std::nullopt;
  else if (after && (PyFloat_Check(after) || PyLong_Check(after))) value = PyFloat_AsDouble(after);
  Py_XDECREF(after);
  PyErr_Clear();
  return value;
}

// "Block.forward (model.py:12)": the progress display's name of a frame, short enough for one terminal line.
std::string short_where(PyCodeObject* code) {
  std::string file = PyUnicode_AsUTF8(code->co_filename);
  if (const size_t slash = file.rfind('/'); slash != std::string::npos) file = file.substr(slash + 1);
  return std::string(PyUnicode_AsUTF8(code->co_qualname)) + " (" + file + ":" + std::to_string(code->co_firstlineno) + ")";
}

// How many of a code object's entries count toward which limit on this miss. Entries traced for one
// nn.Module instance (`self`) are counted per instance: 12 identical layers whose forward is compiled on
// its own (a graph break in it) are 12 instances of one entry each, not 12 recompiles of one frame.
struct EntryCount {
  int entries = 0;
  int limit = 0;
  std::string what;
};

EntryCount count_entries(const frame::FrameView& frame, const std::vector<const frame::CacheEntry*>& own,
                         int recompile_limit) {
  EntryCount count{(int)own.size(), recompile_limit, "recompile limit"};
  // A loop's resume function is traced once per iteration (the items differ): those are not recompiles.
  if (is_loop_resume_code((PyObject*)frame.code)) {
    count.limit = module_instance_limit();
    count.what = "limit of a loop's resume function, one entry per iteration (kiln.config.module_instance_limit)";
    return count;
  }
  std::vector<PyObject*> instances;
  for (const frame::CacheEntry* e : own) {
    const guards::GuardTree& tree = static_cast<const FrameGuard*>(e->guard.get())->tree();
    if (!tree.instance()) return count;  // entries not tied to an instance: one limit for all
    instances.push_back(tree.instance());
  }
  const auto& source = static_cast<const FrameGuard*>(own.front()->guard.get())->tree().instance_source();
  PyObject* self = source->resolve(roots_of(frame));
  if (!self) {
    PyErr_Clear();
    return count;
  }
  Py_DECREF(self);  // only compared by address, while the frame holds it
  int same = (int)std::count(instances.begin(), instances.end(), self);
  if (same > 0) {
    count.entries = same;
    count.what = "recompile limit for one module instance";
    return count;
  }
  std::sort(instances.begin(), instances.end());
  count.entries = (int)(std::unique(instances.begin(), instances.end()) - instances.begin());
  count.limit = module_instance_limit();
  count.what = "module instance limit (kiln.config.module_instance_limit)";
  return count;
}

}  // namespace

double time_guards(PyCodeObject* code, PyObject* globals, PyObject* closure, std::vector<PyObject*> locals,
                   long iterations) {
  std::vector<const frame::CacheEntry*> entries = frame::entries_of(code);
  const FrameGuard* guard = nullptr;
  for (const frame::CacheEntry* e : entries)
    if ((guard = dynamic_cast<const FrameGuard*>(e->guard.get()))) break;
  KILN_CHECK(guard) << "no compiled entry for " << PyUnicode_AsUTF8(code->co_qualname) << ": call it compiled first";
  SourceRoots roots;
  locals.resize(code->co_nlocalsplus, nullptr);
  roots.locals = locals.data();
  roots.nlocals = (int)locals.size();
  roots.closure = closure;
  roots.globals = globals;
  PyObject* builtins = PyDict_GetItemString(globals, "__builtins__");
  roots.builtins = builtins && PyModule_Check(builtins) ? PyModule_GetDict(builtins) : builtins;
  KILN_CHECK(guard->tree().check(roots)) << "the guards fail for these arguments: "
                                         << guard->tree().explain_failure(roots);
  auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < iterations; ++i) guard->tree().check(roots);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

namespace {

// One graph-break record for kiln.explain: {type, context, explanation, hints, file, line, reason}.
PyObject* break_record(const std::string& type, const std::string& context, const std::string& explanation,
                       const std::string& file, int line, const std::string& hint) {
  return Py_BuildValue("{s:s,s:s,s:s,s:[s],s:s,s:i,s:s}", "type", type.c_str(), "context", context.c_str(),
                       "explanation", explanation.c_str(), "hints", hint.c_str(), "file", file.c_str(), "line", line,
                       "reason", explanation.c_str());
}

// Break kinds by the instruction that ran eagerly, with the hint shown to the user.
struct BreakKind {
  const char* type;
  const char* hint;
};
BreakKind break_kind(const std::string& instruction) {
  static const std::pair<const char*, BreakKind> table[] = {
      {"CALL", {"call", "the call runs eagerly and the code around it stays compiled; move it out of the compiled "
                        "function (or wrap it in kiln.disable) to make the split explicit"}},
      {"POP_JUMP", {"data-dependent branch", "a branch on a tensor's value runs eagerly; use torch.where, or "
                                             "compute the condition outside the compiled function"}},
      {"JUMP_IF", {"data-dependent branch", "a branch on a tensor's value runs eagerly; use torch.where"}},
      {"TO_BOOL", {"data-dependent branch", "bool(tensor) runs eagerly; use torch.where"}},
      {"RAISE", {"raise", "raising from compiled code runs eagerly"}},
      {"BEFORE_WITH", {"with", "__enter__ of this context manager runs eagerly; the block resumes compiled, and "
                               "__exit__ is called as the original calls it"}},
  };
  for (const auto& [prefix, kind] : table)
    if (instruction.rfind(prefix, 0) == 0) return kind;
  return {"unsupported bytecode", "this bytecode runs eagerly; the code before and after it stays compiled"};
}

}  // namespace

PyObject* KilnCompiler::break_code(const frame::FrameView& frame, const bytecode::CodeInstructions& decoded,
                                   const BreakPlan& plan, PyObject* program) {
  std::vector<PyObject*> functions;
  struct Release {
    std::vector<PyObject*>& functions;
    ~Release() {
      for (PyObject* f : functions) Py_DECREF(f);
    }
  } release{functions};
  for (const BreakSuccessor& successor : plan.successors) {
    PyObject* code = resume_code(frame.code, decoded, plan, successor);
    // Resume functions are traced like the entry function, whatever the skip rules say about their file.
    if (options_.entry_codes.insert(code).second) Py_INCREF(code);
    if (resume_needs_closure(frame.code)) {  // made at run time around the frame's cells (graph_break.h)
      functions.push_back(Py_NewRef(code));
      continue;
    }
    PyObject* fn = PyFunction_NewWithQualName(code, frame.globals, ((PyCodeObject*)code)->co_qualname);
    KILN_ASSERT(fn) << "creating a resume function for " << where(frame.code);
    functions.push_back(fn);
  }
  return make_break_code(frame.code, decoded, plan, program, functions);
}

void KilnCompiler::record_break(PyCodeObject* code, const bytecode::CodeInstructions& decoded, const BreakPlan& plan,
                                const std::string& reason) {
  stats().graph_breaks++;
  const auto& at = decoded.instructions[plan.pc].pos;
  std::string file = PyUnicode_AsUTF8(code->co_filename);
  BreakKind kind = break_kind(plan.instruction);
  std::string explanation = reason;
  if (plan.in_loop)
    explanation += " (inside a loop: the resume function breaks here again on every iteration, one cache entry "
                   "per iteration, counted against kiln.config.module_instance_limit; the limit reached or the "
                   "stack too deep, the loop goes on eagerly)";
  if (plan.handler_entry >= 0)
    explanation += " (inside a try body or a with block: an exception from it goes to the original handler)";
  KILN_LOG(graph_breaks) << "graph break (" << kind.type << ") in " << where(code) << " at " << file << ":" << at.line
                         << ": " << explanation << "\n  hint: " << kind.hint;
  explain("break", break_record(kind.type, file + ":" + std::to_string(at.line) + " in " +
                                               PyUnicode_AsUTF8(code->co_qualname),
                                explanation, file, at.line, kind.hint));
}

namespace {
unsigned long long g_compiler_serials = 0;
std::unordered_set<unsigned long long>& live_compilers() {
  static auto* live = new std::unordered_set<unsigned long long>();
  return *live;
}
}  // namespace

KilnCompiler::KilnCompiler(CompileOptions options) : options_(std::move(options)), serial_(++g_compiler_serials) {
  live_compilers().insert(serial_);
}

bool KilnCompiler::alive(unsigned long long serial) { return live_compilers().count(serial) > 0; }

KilnCompiler::~KilnCompiler() {
  live_compilers().erase(serial_);
  Py_XDECREF(options_.user_backend);
  Py_XDECREF(options_.explain_sink);
  for (PyObject* c : options_.entry_codes) Py_DECREF(c);
}

void KilnCompiler::explain(const char* kind, PyObject* record) {
  if (options_.explain_sink && record) {
    PyObject* item = Py_BuildValue("(sO)", kind, record);
    PyList_Append(options_.explain_sink, item);
    Py_XDECREF(item);
  }
  Py_XDECREF(record);
}

static frame::MissResult raise_kiln_error(const std::string& text) {
  PyObject* errors = PyImport_ImportModule("kiln.errors");
  PyObject* type = errors ? PyObject_GetAttrString(errors, "KilnError") : nullptr;
  Py_XDECREF(errors);
  PyErr_SetString(type ? type : PyExc_RuntimeError, text.c_str());
  Py_XDECREF(type);
  frame::MissResult result;
  result.action = frame::MissAction::kError;
  return result;
}

frame::MissResult KilnCompiler::fall_back(const frame::FrameView& frame, const std::string& reason,
                                          std::shared_ptr<guards::GuardTree> partial_guards) {
  frame::MissResult result;
  stats().fallbacks++;
  std::string message = "running " + where(frame.code) + " eagerly: " + reason;
  KILN_LOG(fallbacks) << message;
  KILN_LOG(graph_breaks) << message;
  explain("break", break_record("fallback", where(frame.code), reason, PyUnicode_AsUTF8(frame.code->co_filename),
                                 frame.code->co_firstlineno,
                                 "the whole frame runs eagerly; kiln.explain and KILN_LOGS=graph_breaks name the construct"));
  if (options_.fullgraph) {
    PyObject* errors = PyImport_ImportModule("kiln.errors");
    PyObject* type = errors ? PyObject_GetAttrString(errors, "GraphBreakError") : nullptr;
    Py_XDECREF(errors);
    std::string text = "fullgraph=True but " + where(frame.code) + " cannot be captured in one graph: " + reason +
                       ". Hint: remove the construct from the compiled function, or compile without fullgraph=True.";
    PyErr_SetString(type ? type : PyExc_RuntimeError, text.c_str());
    Py_XDECREF(type);
    result.action = frame::MissAction::kError;
    return result;
  }
  if (!partial_guards) {
    result.action = frame::MissAction::kRunDefault;
    return result;
  }
  // The same inputs run eagerly at the cost of a guard check, other inputs are traced afresh.
  return eager_entry(frame, std::move(partial_guards), "eager: " + reason.substr(0, 80));
}

frame::MissResult KilnCompiler::eager_entry(const frame::FrameView& frame, std::shared_ptr<guards::GuardTree> guards,
                                            const std::string& why) {
  frame::MissResult result;
  auto entry = std::make_unique<frame::CacheEntry>();
  Py_INCREF(frame.code);
  entry->code = (PyObject*)frame.code;
  entry->guard = std::make_unique<FrameGuard>(std::move(guards), this);
  entry->label = where(frame.code) + " (" + why + ")";
  result.action = frame::MissAction::kAddEntry;
  result.entry = std::move(entry);
  return result;
}

frame::MissResult KilnCompiler::eager_for_every_input(const frame::FrameView& frame, const std::string& why) {
  // An entry of this compiler's, without guards: unlike a skip mark on the code object (which every kiln.compile
  // would see), a later kiln.compile of this very function still compiles it. The functions it calls are still
  // offered.
  // (whatever the grad mode: an entry that checked the default state missed on every call under no_grad, and each
  // miss traced the frame again)
  auto guards = std::make_shared<guards::GuardTree>();
  guards->accept_any_global_state();
  return eager_entry(frame, std::move(guards), "eager for every input: " + why);
}

frame::MissResult KilnCompiler::on_miss(const frame::FrameView& frame,
                                        const std::vector<const frame::CacheEntry*>& entries) {
  frame::MissResult result;
  // A kiln.disable wrapper runs as written (it switches kiln off for what it calls). A torch.compiler.disable (or
  // torch._dynamo.disable) wrapper switches only torch's own frame evaluator off: kiln's hook is suspended for
  // everything it calls, as torch.compile's is (a non-recursive one, recursive=False, leaves the functions its
  // function calls to the compiler).
  if (frame.function && PyFunction_Check(frame.function)) {
    PyObject* dict = ((PyFunctionObject*)frame.function)->func_dict;
    if (dict && PyDict_GetItemString(dict, "_kiln_disabled")) {
      result.action = frame::MissAction::kRunDefault;
      return result;
    }
    PyObject* torch_disabled = dict ? PyDict_GetItemString(dict, "_torchdynamo_disable") : nullptr;
    if (torch_disabled && PyObject_IsTrue(torch_disabled) == 1) {
      PyObject* recursive = PyDict_GetItemString(dict, "_torchdynamo_disable_recursive");
      result.action = recursive && PyObject_IsTrue(recursive) == 0 ? frame::MissAction::kRunDefault
                                                                   : frame::MissAction::kRunSuspended;
      return result;
    }
  }
  if (is_fsdp1_forward(frame.code)) {
    static bool said = false;
    if (!said) {
      said = true;
      KILN_LOG(graph_breaks) << "FullyShardedDataParallel (FSDP1) units run eagerly, the modules they wrap included; "
                             << "FSDP2's fully_shard is compiled around";
    }
    result.action = frame::MissAction::kRunSuspended;
    return result;
  }
  bool entry_code = options_.entry_codes.count((PyObject*)frame.code) > 0;
  if (!entry_code && skipped_file(frame.code, options_.trace_all)) {
    result.action = frame::MissAction::kSkipCode;
    return result;
  }
  if (guards::GlobalState::current().functorch) {
    // Inside torch.func.vmap / grad / jacrev (run eagerly: the transform's own frames are torch's): the
    // function it transforms sees functorch's wrapper tensors. This call runs eagerly; the entries compiled
    // outside the transform keep serving calls outside it (their guards include the transform state).
    if (warned_functorch_.insert((PyObject*)frame.code).second)
      KILN_LOG(graph_breaks) << where(frame.code) << " runs eagerly inside a torch.func transform (vmap, grad, "
                             << "jacrev): kiln does not compile functions a transform calls";
    result.action = frame::MissAction::kRunDefault;
    return result;
  }
  // This call only (the code may be called again after the import, from code worth compiling).
  if (!entry_code && !is_resume_code((PyObject*)frame.code) && running_an_import()) {
    result.action = frame::MissAction::kRunDefault;
    return result;
  }
  // Only this compiler's entries count: another kiln.compile of the same function keeps its own.
  std::vector<const frame::CacheEntry*> own;
  for (const frame::CacheEntry* e : entries) {
    auto* g = dynamic_cast<const FrameGuard*>(e->guard.get());
    if (g && g->owns(this)) own.push_back(e);
  }
  // A size outside the range kiln.mark_dynamic declared raises (torch.compile's constraint violation), rather than
  // compiling a graph for sizes the user said never come.
  std::vector<std::string> failures;
  for (const frame::CacheEntry* e : own) {
    failures.push_back(e->guard->describe_failure(frame));
    if (failures.back().find(kDeclaredRange) != std::string::npos) return raise_kiln_error(failures.back());
  }
  if (!own.empty()) {
    const std::string& reason = failures.front();
    EntryCount count = count_entries(frame, own, options_.recompile_limit);
    if (count.entries >= count.limit) {
      // A function kiln was not asked to compile, reached from code running eagerly, that fell back on every
      // input so far (a config class's __getattribute__, once per attribute name): no longer intercepted, as
      // the warning would only report work that bought nothing.
      const bool all_eager = std::all_of(own.begin(), own.end(), [](const frame::CacheEntry* e) { return !e->payload; });
      if (all_eager && !entry_code && !is_resume_code((PyObject*)frame.code)) {
        KILN_LOG(recompiles) << where(frame.code) << " ran eagerly for " << count.entries
                             << " different inputs: it runs eagerly from now on, without its guards. Last: " << reason;
        return eager_for_every_input(frame, "fell back on every input");
      }
      if (warned_limit_.insert((PyObject*)frame.code).second) {
        std::string text = "kiln: " + count.what + " (" + std::to_string(count.limit) + ") reached for " +
                           where(frame.code) + "; new inputs run eagerly. Last failing guard: " + reason;
        if (PyErr_WarnEx(PyExc_RuntimeWarning, text.c_str(), 1) < 0) PyErr_Clear();
      }
      result.action = frame::MissAction::kRunDefault;
      return result;
    }
    stats().recompiles++;
    KILN_LOG(recompiles) << "recompiling " << where(frame.code) << ": " << reason;
    explain("recompile", PyUnicode_FromString(reason.c_str()));
  }

  FrameInput input{frame.code, frame.function, frame.globals, frame.builtins, frame.closure, frame.localsplus,
                   frame.nlocalsplus};
  std::unique_ptr<Tracer> tracer;
  std::shared_ptr<guards::GuardTree> tree;  // the guards, once the trace succeeded
  auto guards_so_far = [&]() -> std::shared_ptr<guards::GuardTree> {
    if (tree) return tree;
    return tracer ? std::shared_ptr<guards::GuardTree>(tracer->take_guards()) : nullptr;
  };
  const GcPaused gc_paused;
  const log::Stopwatch started;
  std::optional<progress::Compile> progress_line;  // shown once the compile has run kiln.config.progress_after_s
  if (progress::wanted())
    if (const std::optional<double> after = progress_after_s()) progress_line.emplace(short_where(frame.code), *after);
  progress::stage("trace");
  try {
    // Dynamic shapes: dynamic=False specialises every size; True makes every dim of the arguments symbolic from the
    // first call; None (automatic) the dims whose size changed since an earlier trace of this code.
    auto [slot, first_trace] = dynamic_.try_emplace((PyObject*)frame.code);
    DynamicPolicy& memory = slot->second;
    memory.mode = force_static_ ? compile::Dynamic::kStatic : options_.compile.dynamic;
    if (first_trace && memory.mode == compile::Dynamic::kAutomatic) memory.load_profile((PyObject*)frame.code);
    tracer = std::make_unique<Tracer>(input, memory);
    std::optional<BreakPlan> plan;
    bytecode::CodeInstructions decoded;
    VarPtr returned;
    std::string break_reason;
    try {
      returned = tracer->trace_root();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Unsupported || options_.fullgraph || tracer->failed_root_step() < 0) throw;
      // A graph break: trace again, stopping right before the root instruction that failed (a
      // second trace, so nothing of the failed instruction leaks into the graph or the guards).
      break_reason = e.what();
      decoded = bytecode::decode(frame.code);
      auto retrace = std::make_unique<Tracer>(input, memory);
      retrace->stop_before_step(tracer->failed_root_step());
      VarPtr none = retrace->trace_root();
      KILN_ASSERT(!none && retrace->break_state() && retrace->break_state()->pc == tracer->failed_root_pc())
          << "the second trace of " << where(frame.code) << " did not stop at the graph break";
      plan = plan_break(frame.code, decoded, *retrace->break_state());
      const int generator_step = retrace->first_live_generator_step();
      if (!plan->why_not.empty() && generator_step > 0 && generator_step < tracer->failed_root_step()) {
        // A generator of the trace is alive at the break (a @contextmanager block whose body breaks): break before
        // the step that made it instead, where nothing of it exists yet.
        auto earlier = std::make_unique<Tracer>(input, memory);
        earlier->stop_before_step(generator_step);
        KILN_ASSERT(!earlier->trace_root() && earlier->break_state())
            << "the third trace of " << where(frame.code) << " did not stop before the generator was made";
        std::optional<BreakPlan> before = plan_break(frame.code, decoded, *earlier->break_state());
        if (before->why_not.empty()) {
          plan = std::move(before);
          retrace = std::move(earlier);
          break_reason += " (the break moves before the generator alive there was made)";
        }
      }
      if (!plan->why_not.empty()) throw Error(ErrorKind::Unsupported, break_reason + " (no graph break: " + plan->why_not + ")");
      tracer = std::move(retrace);
    }
    TraceResult traced = plan ? tracer->finish(break_values(*plan, *tracer->break_state()), true)
                              : tracer->finish(returned);
    tree = std::shared_ptr<guards::GuardTree>(std::move(traced.guards));
    if (SymbolicInts* symbolic = tracer->symbolic_ints(); symbolic && !symbolic->range_violation().empty())
      return raise_kiln_error(symbolic->range_violation());
    if (memory.remember(traced.input_sources, traced.example_inputs) && memory.mode == compile::Dynamic::kAutomatic)
      memory.store_profile();
    const std::vector<std::string> dynamic_lines = tracer->dynamic_summary();
    if (!plan && traced.num_ops == 0 && !entry_code && !is_resume_code((PyObject*)frame.code)) {
      // A function called from code running eagerly that does no tensor work: nothing to compile, and its
      // guards would only cost (Dynamo skips such frames too). Its own calls are still intercepted.
      KILN_LOG(graph_breaks) << where(frame.code) << " does no tensor work: it runs eagerly from now on";
      return eager_for_every_input(frame, "no tensor work");
    }

    runtime::FrameProgramSpec spec;
    spec.inputs = traced.input_sources;
    spec.output = std::move(traced.output);
    spec.globals = frame.globals;
    spec.builtins = frame.builtins;
    spec.name = PyUnicode_AsUTF8(frame.code->co_qualname);
    const double trace_ms = started.ms();
    const log::Stopwatch backend_started;
    compile::CompileOptions compile_options = options_.compile;
    compile_options.parameter_buckets = data_parallel_buckets(traced.example_inputs);  // inside a DDP forward
    auto compiled = compile::compile_graph_object(traced.graph, options_.backend, traced.example_inputs,
                                                  options_.user_backend, compile_options);
    const double backend_ms = backend_started.ms();
    PyObject* cudagraphs = options_.explain_sink ? cudagraph_status_callable(compiled) : nullptr;
    // The program is created before the code that calls it; the code passes arguments then free vars.
    PyObject* program = nullptr;
    {
      spec.num_locals_passed = argument_slots(frame.code);
      spec.num_freevars_passed = frame.code->co_nfreevars;
      program = runtime::make_frame_program(std::move(spec), std::move(compiled));
      KILN_ASSERT(program) << "creating the compiled frame";
    }
    PyObject* entry_code = nullptr;
    if (plan) {
      try {
        entry_code = break_code(frame, decoded, *plan, program);
      } catch (...) {
        Py_DECREF(program);
        throw;
      }
      record_break(frame.code, decoded, *plan, break_reason);
    } else {
      entry_code = make_call_code(frame.code, program).code;
    }

    auto entry = std::make_unique<frame::CacheEntry>();
    entry->code = entry_code;
    auto guard = std::make_unique<FrameGuard>(tree, this);
    auto payload = std::make_shared<EntryPayload>();
    payload->program = program;
    Py_INCREF(traced.graph);
    payload->graph = traced.graph;
    entry->payload = payload;
    entry->label = where(frame.code) + " #" + std::to_string(own.size());

    stats().frames_compiled++;
    KILN_LOG(perf) << "compiled " << entry->label << " in " << log::whole_ms(started.ms()) << " ms: trace "
                   << log::whole_ms(trace_ms) << " ms (" << traced.num_ops << " ops), backend '" << options_.backend
                   << "' " << log::whole_ms(backend_ms) << " ms";
    if (log::enabled(log::Category::graph)) {
      PyObject* text = PyObject_Str(traced.graph);
      KILN_LOG(graph) << "graph for " << entry->label << " (" << traced.num_ops << " ops)\n"
                      << (text ? PyUnicode_AsUTF8(text) : "?");
      Py_XDECREF(text);
      PyErr_Clear();
    }
    KILN_LOG(guards) << "guards for " << entry->label << " (" << tree->num_checks() << " checks)\n"
                     << guard->describe();
    if (options_.explain_sink) {
      PyObject* ops = PyObject_CallMethod(traced.graph, "ops", nullptr);
      if (!ops) {
        PyErr_Clear();
        ops = PyList_New(0);
      }
      if (!cudagraphs) {
        PyErr_Clear();
        cudagraphs = Py_NewRef(Py_None);
      }
      // "graph": the captured graph itself, with its symbolic sizes (a user backend sees each binding's concrete
      // graph); kiln.export reads it.
      explain("graph", Py_BuildValue("{s:N,s:N,s:s,s:N,s:N,s:O}", "ops", ops, "guards", string_list(tree->describe()),
                                     "where", entry->label.c_str(), "cudagraphs", cudagraphs, "dynamic",
                                     string_list(dynamic_lines), "graph", traced.graph));
    }
    entry->guard = std::move(guard);
    result.action = frame::MissAction::kAddEntry;
    result.entry = std::move(entry);
    return result;
  } catch (const Error& e) {
    PyErr_Clear();
    if (e.kind() == ErrorKind::Internal) KILN_LOG(fallbacks) << e.what();
    // A trace or compile with size symbols that failed for a reason of its own (not a construct the trace cannot
    // capture) is tried again with every size specialised, which is what this frame would have done without them.
    if (e.kind() != ErrorKind::Unsupported && tracer && tracer->symbolic() && !force_static_)
      return retry_specialised(frame, entries, e.what());
    return fall_back(frame, e.what(), guards_so_far());
  } catch (const std::exception& e) {
    PyErr_Clear();
    if (tracer && tracer->symbolic() && !force_static_) return retry_specialised(frame, entries, e.what());
    return fall_back(frame, std::string("backend failed: ") + e.what(), guards_so_far());
  }
}

frame::MissResult KilnCompiler::retry_specialised(const frame::FrameView& frame,
                                                  const std::vector<const frame::CacheEntry*>& entries,
                                                  const std::string& why) {
  KILN_LOG(dynamic) << where(frame.code) << ": compiling with size symbols failed (" << why
                    << "); compiling it again with every size specialised";
  force_static_ = true;
  frame::MissResult result;
  try {
    result = on_miss(frame, entries);
  } catch (...) {
    force_static_ = false;
    throw;
  }
  force_static_ = false;
  return result;
}

}  // namespace kiln::trace
