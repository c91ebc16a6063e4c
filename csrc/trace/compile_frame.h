#pragma once
// The frame hook's Compiler for kiln.compile: on a cache miss, trace the frame, compile its graph with
// the chosen backend, and hand back a cache entry (guards + transformed code). Failures fall back to
// running the frame eagerly, counted and logged once; under fullgraph=True they raise instead.
#include <Python.h>

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "bytecode/bytecode.h"
#include "compile/options.h"
#include "frame/frame.h"
#include "guards/guard_tree.h"
#include "trace/symbolic_ints.h"

namespace kiln::trace {

struct BreakPlan;

struct CompileOptions {
  std::string backend = "kiln";
  PyObject* user_backend = nullptr;  ///< owned; a callable backend
  bool fullgraph = false;
  int recompile_limit = 8;
  PyObject* explain_sink = nullptr;  ///< owned list: kiln.explain collects one record per event
  std::unordered_set<PyObject*> entry_codes;  ///< owned: traced even when their file is skipped
  /// Test-only: trace every frame the hook offers, standard library and torch included (kiln's own
  /// Python excepted), to show that tracing and falling back never change what a program does.
  bool trace_all = false;
  /// kiln.compile's mode, dynamic and options, for the pipeline (compile/options.h).
  compile::CompileOptions compile;
};

/// Counters behind kiln.stats().
struct Stats {
  long long frames_compiled = 0, recompiles = 0, graph_breaks = 0, fallbacks = 0, guard_failures = 0;
};
Stats& stats();

/// The KilnCompiler whose compiled function is running on this thread (set with the frame hook's
/// compiler). Cache entries match only their own compiler: the same function compiled twice with
/// different backends or options keeps separate entries.
void set_active_compiler(const class KilnCompiler* compiler);

/// Seconds taken by `iterations` evaluations of the guards of `code`'s most recent cache entry, with
/// `locals` as the frame's leading local slots (the positional arguments). For benchmarks only.
double time_guards(PyCodeObject* code, PyObject* globals, PyObject* closure, std::vector<PyObject*> locals,
                   long iterations);

class KilnCompiler : public frame::Compiler {
 public:
  explicit KilnCompiler(CompileOptions options);
  ~KilnCompiler() override;
  frame::MissResult on_miss(const frame::FrameView& frame, const std::vector<const frame::CacheEntry*>& entries) override;
  const CompileOptions& options() const { return options_; }
  /// Unique per compiler of the process: entries tell their compiler from a later one at the same address.
  unsigned long long serial() const { return serial_; }
  /// True while the compiler with this serial exists.
  static bool alive(unsigned long long serial);

 private:
  frame::MissResult fall_back(const frame::FrameView& frame, const std::string& reason,
                              std::shared_ptr<guards::GuardTree> partial_guards);
  /// An entry of this compiler's that runs `frame`'s code as written under `guards`, labelled with `why`.
  frame::MissResult eager_entry(const frame::FrameView& frame, std::shared_ptr<guards::GuardTree> guards,
                                const std::string& why);
  /// An entry without guards that runs `frame`'s code as written, for a function not worth tracing again.
  frame::MissResult eager_for_every_input(const frame::FrameView& frame, const std::string& why);
  void explain(const char* kind, PyObject* record);
  /// The transformed code of a graph break, with one resume function per successor (graph_break.h).
  PyObject* break_code(const frame::FrameView& frame, const bytecode::CodeInstructions& decoded,
                       const BreakPlan& plan, PyObject* program);
  void record_break(PyCodeObject* code, const bytecode::CodeInstructions& decoded, const BreakPlan& plan,
                    const std::string& reason);
  CompileOptions options_;
  unsigned long long serial_;
  std::unordered_set<PyObject*> warned_limit_;  ///< codes whose recompile-limit warning was given
  std::unordered_set<PyObject*> warned_functorch_;  ///< codes logged as running eagerly inside a torch.func transform
  /// Per code object (borrowed: only compared): what its traces saw of each input's sizes (automatic dynamic
  /// shapes, trace/symbolic_ints.h).
  std::unordered_map<PyObject*, DynamicPolicy> dynamic_;
  /// While a miss is compiled again with every size specialised (retry_specialised).
  bool force_static_ = false;
  frame::MissResult retry_specialised(const frame::FrameView& frame, const std::vector<const frame::CacheEntry*>& entries,
                                      const std::string& why);
};

}  // namespace kiln::trace
