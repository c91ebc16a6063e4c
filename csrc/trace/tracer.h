#pragma once
// The tracer: symbolic execution of one intercepted frame (and the functions it inlines) that turns
// its tensor work into a graph and records the guards under which that graph stays valid.
//
// Tracer holds what is shared by the root frame and every inlined call: the recorder (python/kiln/
// _fake.py, which runs tensor ops on meta tensors and records the ATen ops), the guard tree, the graph
// inputs and their sources. InstructionTranslator (interpreter.h) runs one code object's bytecode.
// Anything the tracer cannot capture throws kiln::Error(Unsupported): the caller falls back to eager.
#include <Python.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/source.h"
#include "guards/guard_tree.h"
#include "runtime/frame_program.h"
#include "trace/symbolic_ints.h"
#include "trace/variables.h"

namespace kiln::trace {

struct FrameInput {
  PyCodeObject* code = nullptr;
  PyObject* function = nullptr;
  PyObject* globals = nullptr;
  PyObject* builtins = nullptr;
  PyObject* closure = nullptr;
  PyObject* const* localsplus = nullptr;
  int nlocalsplus = 0;
};

struct TraceResult {
  std::unique_ptr<guards::GuardTree> guards;
  std::vector<SourcePtr> input_sources;
  PyObject* graph = nullptr;           ///< kiln._C.Graph (owned)
  PyObject* example_inputs = nullptr;  ///< list of the real input tensors (owned)
  runtime::OutputSpec output;
  int num_ops = 0;
  TraceResult() = default;
  TraceResult(TraceResult&&) = default;
  ~TraceResult();
};

using KwArgs = std::vector<std::pair<PyObject*, VarPtr>>;  // borrowed names (interned strings from code)

/// The root frame's symbolic state just before an instruction the trace stopped at (a graph break).
struct BreakState {
  int pc = -1;                  ///< index of the root instruction that was not executed
  std::vector<VarPtr> stack;    ///< the root's symbolic stack, bottom first (kNull entries included)
  std::vector<VarPtr> locals;   ///< the root's localsplus (nullptr = unbound)
  PyObject* kwnames = nullptr;  ///< a pending KW_NAMES tuple (borrowed from co_consts), else nullptr
  /// Inside an except block: an exception is being handled (sys.exc_info(), a bare `raise`, logger.exception read
  /// it), which the code after a break would not have.
  bool handling_exception = false;
};

/// Turns the pending Python exception into kiln's Unsupported error (a graph break), naming `context` and the
/// exception; clears it. For failures of Python calls the tracer makes on the user's objects.
[[noreturn]] void rethrow_python(const std::string& context);

class Tracer {
 public:
  /// `dynamic`: which input dims are size symbols (none: every size is specialised, as without dynamic shapes).
  explicit Tracer(const FrameInput& frame, DynamicPolicy dynamic = {compile::Dynamic::kStatic, {}});
  ~Tracer();
  /// Traces the frame to its return. Throws kiln::Error(Unsupported) with the reason and location.
  TraceResult run() { return finish(trace_root()); }
  /// Traces the root frame to its return and returns the returned Var; or, when stop_before_step()
  /// was set and reached, stops there, fills break_state() and returns nullptr.
  VarPtr trace_root();
  /// Builds the graph whose outputs are the tensors inside `output` and the spec that rebuilds it.
  /// `break_output` (a graph break's live values): values that came from the frame are re-read through
  /// their sources and repeated tensors share one graph output, so identities are kept.
  TraceResult finish(const VarPtr& output, bool break_output = false);
  /// Makes the next trace_root() stop before the root frame's `step`-th instruction (1-based).
  void stop_before_step(int step) { break_step_ = step; }
  const BreakState* break_state() const { return broke_ ? &break_state_ : nullptr; }
  /// After a trace that failed with Unsupported: the root step (1-based) and instruction index at which
  /// the failure surfaced in the root frame (-1 when it did not reach the root).
  int failed_root_step() const { return failed_step_; }
  int failed_root_pc() const { return failed_pc_; }
  /// The root step (1-based) during which the first generator still running (made, not finished) was made, or -1:
  /// a break that cannot happen while a generator of the trace is alive can happen before that step.
  int first_live_generator_step() const;
  /// After a failed run(): the guards recorded up to the failure. Everything the trace read before it
  /// failed is guarded, so the same failure recurs exactly when these guards pass.
  std::unique_ptr<guards::GuardTree> take_guards() { return std::move(guards_); }

  // ---- services for the interpreter ----------------------------------------------------------
  /// A value entering the trace from `source`: records its guards and returns its Var.
  VarPtr wrap(PyObject* value, SourcePtr source);
  /// obj.name
  VarPtr get_attr(const VarPtr& obj, PyObject* name);
  /// An attribute the program set on a tensor read from the frame (not one of its class's): read from the real
  /// tensor through its source, guarded; *found = false (its absence guarded) when it has none.
  VarPtr tensor_instance_attr(const VarPtr& tensor, PyObject* name, bool* found);
  /// fn(*args, **kwargs)
  VarPtr call(const VarPtr& fn, std::vector<VarPtr> args, KwArgs kwargs);
  /// Runs `fn` (a torch callable) on fakes through the recorder and wraps what it returns.
  VarPtr call_recorded(PyObject* fn, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// Raises Unsupported when `v` holds an object pinned by its type only whose data a recorded call would read.
  void refuse_unguarded_data(const VarPtr& v, PyObject* fn);
  /// Whether `f` was passed to torch.compiler.allow_in_graph and its arguments can go to the recorder as they are:
  /// then the call is recorded whole (call_recorded) instead of inlined.
  bool allowed_in_graph(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// A Python value produced at trace time (by the recorder or by constant folding).
  VarPtr wrap_result(PyObject* value);
  /// `operator.<op>(a, b)` on Vars: tensors go to the recorder, constants are folded.
  VarPtr binary(PyObject* op, const VarPtr& a, const VarPtr& b);
  /// `obj[index]`
  VarPtr subscript(const VarPtr& obj, const VarPtr& index);
  /// Python truthiness of a Var known at trace time; Unsupported for tensors.
  bool truthy(const VarPtr& v);
  /// The items a for-loop over `v` visits.
  std::vector<VarPtr> iterate(const VarPtr& v);
  /// A container module's iteration kind ("children", "keys", "indexed"; module_iteration), with what its
  /// items depend on guarded (its key dict's keys or ParameterList's _size). Unsupported for other modules.
  std::string guard_container_items(const VarPtr& v);

  PyObject* helper(const char* name);  ///< borrowed attribute of kiln._tracing
  /// Grad-mode switches (grad_mode.cpp): `fn` (bound to `self` when set) is run for real when it is a
  /// grad-mode callable, recording a kiln::set_grad_enabled node if the mode changed; else *handled = false.
  VarPtr call_grad_mode(PyObject* fn, const VarPtr& self, const std::vector<VarPtr>& args, const KwArgs& kwargs,
                        bool* handled);
  int depth() const { return depth_; }
  const FrameInput& root() const { return root_; }
  /// Source root for the globals dict `globals` (the root frame's or another module's).
  SourcePtr global_source(PyObject* globals, PyObject* name);
  SourcePtr builtin_source(PyObject* builtins, PyObject* name);

 private:
  friend class InstructionTranslator;
  VarPtr wrap_tensor(PyObject* tensor, SourcePtr source);
  /// True when `source` reaches a value through a local of the root frame, itself a resume function.
  bool from_resume_frame(const SourcePtr& source) const;
  VarPtr call_module(const VarPtr& module, std::vector<VarPtr> args, KwArgs kwargs);
  /// `source`: where the trace read `function` (its closure's cells are then read through it, so an equal
  /// function made anew on each call, guarded by its code, reads that call's cells).
  VarPtr inline_function(PyObject* function, std::vector<VarPtr> args, KwArgs kwargs, SourcePtr source = nullptr);
  VarPtr call_container_method(const VarPtr& self, const std::string& name, std::vector<VarPtr> args);
  /// list.sort(key=, reverse=) on a list the trace owns.
  VarPtr sort_list(const VarPtr& list, const KwArgs& kwargs);
  /// enumerate(it[, start]), zip(...[, strict]) and reversed(it) over values the trace holds, as lists; null otherwise.
  VarPtr iteration_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// `d.update(other, k=v, ...)` on a dict the trace holds.
  VarPtr update_dict_with_keywords(const VarPtr& self, std::vector<VarPtr> args, const KwArgs& kwargs);
  /// A call of a functools.lru_cache / functools.cache function: answered by the real cache (a call eager makes too)
  /// when the arguments are constants and the answer is one; otherwise its __wrapped__ function inlined.
  VarPtr call_cached_function(PyObject* f, std::vector<VarPtr> args, KwArgs kwargs);
  /// `ref()` of a weak reference the frame reads: its referent, wrapped with the source `ref()`.
  VarPtr wrap_referent(const VarPtr& ref);
  /// sorted/min/max with `key=`: the keys computed in the trace, the order Python's on them; nullptr without a key.
  VarPtr sort_by_key(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// `self.new_tensor(data, **kwargs)` as torch.tensor with self's dtype and device unless given.
  VarPtr new_tensor(const VarPtr& self, const VarPtr& data, KwArgs kwargs);
  /// object.__getattribute__, the slot wrapper a class's own __getattribute__ reaches through super().
  static PyObject* object_getattribute();
  /// object.__getattribute__(obj, name): an ordinary attribute read where the class's override agrees.
  VarPtr generic_getattr(const VarPtr& obj, const VarPtr& name);
  /// `cls(*args)` of an exception class with the built-in constructor, on constants: the exception object.
  VarPtr construct_exception(PyObject* cls, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  VarPtr call_builtin(PyObject* fn, const std::vector<VarPtr>& args, const KwArgs& kwargs, bool* handled);
  VarPtr module_attr(const VarPtr& module, PyObject* name);
  // Records: namedtuples, structseqs (torch.return_types), dataclasses and ModelOutput (records.cpp).
  /// Field names of a namedtuple/structseq type (new reference), or nullptr for other types.
  PyObject* tuple_fields(PyTypeObject* type);
  /// `cls(*args, **kwargs)` of a record class called in traced code; *handled = false for other callables.
  VarPtr construct_record(PyObject* cls, std::vector<VarPtr> args, const KwArgs& kwargs, bool* handled);
  /// `obj.name` of a typed tuple (its field) or of a kObject (its attribute, mapped back to a Var).
  VarPtr record_attr(const VarPtr& obj, PyObject* name);
  /// A read-only method of a kObject (keys, to_tuple, __getitem__...), run on its trace-time instance.
  VarPtr call_record_method(const VarPtr& obj, PyObject* name, const std::vector<VarPtr>& args);
  /// A Python value read off a kObject's trace-time instance, as a Var: the constructor's own argument
  /// Vars where the value is one of them, else as a trace-time result.
  VarPtr record_value(const VarPtr& obj, PyObject* value);
  /// `obj[index]` of a dict-like record read from the frame (a ModelOutput a graph break handed over):
  /// the item, reached through the key it is stored under with the keys guarded; nullptr when the item
  /// is not stored under a string key.
  VarPtr frame_record_item(const VarPtr& obj, PyObject* index);
  runtime::OutputSpec output_spec(const VarPtr& v, std::vector<PyObject*>& graph_outputs, bool break_output);
  /// A new dict of `v`'s keys and items (a kDict Var), whatever its source.
  runtime::OutputSpec dict_spec(const VarPtr& v, std::vector<PyObject*>& graph_outputs, bool break_output);
  /// Gives `v` its memo slot in `spec` (one object however often it is reached); true, with `spec` a kRepeat,
  /// when it already had one.
  bool repeated(const VarPtr& v, runtime::OutputSpec& spec);
 public:
  // Python constructs of real models: super() and imports (interpreter_loads.cpp); str and dict methods,
  // type(), functools.partial, ContextVars (calls.cpp).
  VarPtr super_attr(const VarPtr& super, PyObject* name);
  VarPtr import_module(PyObject* name, PyObject* fromlist, int level, PyObject* globals);
  VarPtr import_from(const VarPtr& module, PyObject* name);
  VarPtr namedtuple_replace(const VarPtr& fn, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  VarPtr call_python_construct(const VarPtr& fn, std::vector<VarPtr>& args, KwArgs& kwargs, bool* handled);
  // Plain user objects made in traced code (kUserObject, user_objects.cpp).
  /// `cls(*args, **kwargs)` of a class with a Python __init__ or object's: a kUserObject when the class is plain
  /// (kiln._tracing.user_class_refusal), its __init__ inlined; Unsupported, naming the reason, for other classes.
  /// `class_source`: where the trace read `cls`.
  VarPtr construct_user_object(PyObject* cls, const SourcePtr& class_source, std::vector<VarPtr> args, KwArgs kwargs);
  /// `obj.name` of a kUserObject, as object.__getattribute__ finds it: a data descriptor of the class (a property's
  /// getter, inlined), else the attribute table, else the class attribute (a function bound as a method, a static or
  /// class method, a value read through the class's source). A missing name raises AttributeError in the trace, or,
  /// with `found`, sets *found = false and returns nullptr.
  VarPtr user_object_attr(const VarPtr& obj, PyObject* name, bool* found = nullptr);
  /// object.__getattribute__, object.__setattr__ and object.__delattr__ of a kUserObject (what the public three do for
  /// a class that does not override them in Python, and what an override reaches through super()).
  VarPtr raw_user_object_attr(const VarPtr& obj, PyObject* name, bool* found = nullptr);
  void raw_store_user_object_attr(const VarPtr& obj, PyObject* name, const VarPtr& value);
  void raw_delete_attribute(const VarPtr& obj, PyObject* name);
  /// A real instance of a kUserObject's class whose __dict__ holds its attributes' trace-time values (fakes for
  /// tensors; objects made in the trace, and containers of them, likewise), for Python code the trace runs for real
  /// that only reads it (a record's __post_init__). New reference; it must never leave the trace.
  PyObject* user_object_standin(const VarPtr& obj);
  /// len(), getattr() and hasattr() of a kUserObject, and len() of a plain object from the frame whose __len__ is
  /// written in Python (traced); nullptr for other calls.
  VarPtr user_object_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// `obj.name = value` of a kUserObject: a property's setter (inlined), else the attribute table.
  void store_user_object_attr(const VarPtr& obj, PyObject* name, const VarPtr& value);
  /// `del obj.name` (DELETE_ATTR): of a kUserObject (a property's deleter, else the table); Unsupported for others.
  void delete_attribute(const VarPtr& obj, PyObject* name);
  /// `fn(*args)` where fn is a kUserObject (its class's Python __call__) or one of object's C slots bound to one
  /// (super().__init__() reaching object.__init__, object.__setattr__(self, ...)).
  VarPtr call_user_object(const VarPtr& fn, std::vector<VarPtr> args, KwArgs kwargs);
  /// The special method `name` (__len__, __getitem__...) of the class of a kUserObject or of a plain object from the
  /// frame, when written in Python, bound to the object's Var so that its body is traced (its reads then carry guards
  /// of their own); nullptr otherwise.
  VarPtr python_special_method(const VarPtr& obj, const char* name);
  /// os.environ.get(key[, default]), os.environ[key] and `key in os.environ` (through __contains__) with a constant
  /// key: the variable's value at trace time, guarded (os.environ.get(key) read again on every call); nullptr
  /// for any other call. An absent key read by subscript stays a graph break (eager raises KeyError).
  VarPtr call_environ_method(const VarPtr& self, const char* name, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// `nn.ReLU()` in traced code: a built-in stateless torch.nn module made with constant arguments (nullptr when
  /// the class or the instance does not qualify: _tracing.make_stateless_module).
  VarPtr construct_stateless_module(PyObject* cls, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// True when traced code may mutate the list or dict `v` in place: it was made in the trace, or it is the
  /// root frame's **kwargs (a fresh dict per call, which then is rebuilt from its items like one made here).
  bool claim_container(const VarPtr& v);
  VarPtr inline_with_cells(PyObject* function, std::vector<VarPtr> args, KwArgs kwargs, const std::vector<VarPtr>* cells,
                           SourcePtr source = nullptr);
  /// The next item of a kGenerator (its body runs to the next yield), or nullptr when it is exhausted.
  VarPtr generator_next(const VarPtr& generator);
  void bind_arguments(PyObject* function, std::vector<VarPtr> args, const KwArgs& kwargs, std::vector<VarPtr>& locals);
  // Sets (kSet, sets.cpp).
  /// A set (or frozenset) of `items`, deduplicated and ordered as eager's set of them is.
  VarPtr make_set(PyTypeObject* type, const std::vector<VarPtr>& items);
  /// A set or frozenset of constants read from the frame at `source` (`name in self.skip`): a kSet the trace never
  /// changes, guarded equal to this one. nullptr when an element is not a plain constant.
  VarPtr frame_set(PyObject* value, const SourcePtr& source);
  /// Adds `items` to the kSet `set` the trace owns (SET_ADD, SET_UPDATE).
  void set_add(const VarPtr& set, const std::vector<VarPtr>& items);
  /// `set(...)` or `frozenset(...)` as a kSet; nullptr when `f` is neither or the call has other arguments.
  VarPtr set_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// `item in set`.
  bool set_contains(const VarPtr& set, const VarPtr& item);
  /// A method of a kSet (add, discard, update, union, issubset, ...), run on its real set.
  VarPtr set_method(const VarPtr& self, const std::string& name, const std::vector<VarPtr>& args);
  /// `operator.<op>(a, b)` where a or b is a kSet (| & - ^, their in-place forms, comparisons); nullptr otherwise.
  VarPtr set_binary(PyObject* op, const VarPtr& a, const VarPtr& b);
  /// dict.pop/setdefault/update/clear/__setitem__ on a dict Var the trace owns; nullptr for other names.
  VarPtr mutate_dict(const VarPtr& dict, const std::string& name, const std::vector<VarPtr>& args);
  /// The items of a dict (subclass) instance from the frame as a dict Var, its keys guarded.
  VarPtr snapshot_dict(const VarPtr& obj);
  /// `obj.name = value` (STORE_ATTR) on a user module or a plain object read from the frame: later reads in
  /// the trace see `value`, and the compiled frame makes the same assignment after its graph (stores.cpp).
  /// Unsupported (a graph break at the store) for anything else.
  void store_attribute(const VarPtr& obj, PyObject* name, const VarPtr& value);
  /// `global name; name = value` in code whose globals dict is `globals`: likewise replayed.
  void store_global(PyObject* globals, PyObject* name, const VarPtr& value);
  /// An assignment to the root frame's free variable `index` (its cell `cell`): a nonlocal, or a resume
  /// function's cell of the frame it continues.
  void store_cell(int index, PyObject* cell, const VarPtr& value);
  static PyObject* cell_contents_name() {
    static PyObject* name = PyUnicode_InternFromString("cell_contents");
    return name;
  }
  /// The value a store traced earlier gave `owner`'s attribute (or `owner`'s item, for a globals dict)
  /// `name`, or nullptr.
  VarPtr stored_value(PyObject* owner, PyObject* name) const;
  /// A ContextVar read from the frame by type only becomes pinned by identity (its state is per object);
  /// false for other values.
  bool pin_context_var(const VarPtr& v);
  /// inspect.signature(f) of a function pinned by identity or a method of one: a constant.
  VarPtr fold_signature(const VarPtr& target, const KwArgs& kwargs);
  /// id(x) and copy.deepcopy(x) with one argument (object_copies.cpp); nullptr for other calls.
  VarPtr call_identity_or_copy(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// A deep copy of `v` as copy.deepcopy makes it, on Vars; `memo` maps copied Vars to their copies.
  VarPtr deep_copy(const VarPtr& v, std::unordered_map<const Var*, VarPtr>& memo);
  /// `logger.warning(...)` and the other level methods of a logging.Logger (log_calls.cpp): the call is recorded with
  /// the traced assignments and made for real after the graph, in program order; returns None's Var. nullptr for any
  /// other call.
  VarPtr defer_log_call(const VarPtr& fn, const std::vector<VarPtr>& args, const KwArgs& kwargs);

 private:
  /// Attribute and global stores traced so far, in program order (one entry per owner and name: a later
  /// store to the same place replaces the value and keeps the position). Replayed after the graph.
  struct PendingStore {
    VarPtr target;     ///< the object (kModule or kConst with a source); nullptr for a globals dict
    PyObject* owner;   ///< the object or the globals dict (owned)
    PyObject* name;    ///< owned
    VarPtr value;
    bool item = false;  ///< owner[name] = value (a globals dict) rather than setattr
    int free_index = -1;  ///< an assignment to the root frame's free variable (owner = its cell at trace time)
    /// owner (a dict or list from the frame, `target`'s built_from) takes the items `value` (that same Var) holds when
    /// the graph ends: the traced code changed it (d[k] = v, d.pop(k), l.append(x)); name is None.
    bool contents = false;
    /// A call made after the graph (a deferred log call, log_calls.cpp): value = (callable, args tuple, kwargs dict);
    /// owner and name are None. Never a place: stored_value does not see it, and each call is its own entry.
    bool call = false;
  };
  std::vector<PendingStore> stores_;
  PendingStore* find_store(PyObject* owner, PyObject* name) const;
  /// Appends `store` (owner and name borrowed; references taken) or updates the earlier one to the same place.
  void record_store(PendingStore store);
  /// Appends the stores to `spec` (OutputSpec::kStores around the frame's own output).
  runtime::OutputSpec with_stores(runtime::OutputSpec output, std::vector<PyObject*>& graph_outputs);
  /// ContextVar.set calls traced and not yet reset (their tokens, innermost last); see calls.cpp.
  std::vector<VarPtr> context_var_sets_;
  /// The exceptions traced `except` blocks are handling, innermost last (CPython's exc_info, as PUSH_EXC_INFO
  /// and POP_EXCEPT keep it): what a bare `raise` re-raises.
  std::vector<VarPtr> handled_exceptions_;

  /// A grad-mode context manager read from the frame: guards the mode its __exit__ restores.
  void guard_grad_mode_context(PyObject* value, const SourcePtr& source);
  // The real grad mode (grad_mode.cpp): read and set through torch, restored when a trace ends.
  bool grad_enabled();
  void set_real_grad_mode(bool enabled);
  struct TraceModeRestore {  // grad mode and autocast state: traced blocks switch both for real
    Tracer& tracer;
    bool saved;
    PyObject* autocast;  // owned: kiln._tracing.autocast_state() when the trace began
    explicit TraceModeRestore(Tracer& t);
    ~TraceModeRestore();
  };

  FrameInput root_;
  PyObject* helpers_ = nullptr;   // kiln._tracing
  PyObject* recorder_ = nullptr;  // kiln._fake.Recorder()
  std::unique_ptr<guards::GuardTree> guards_;
  std::vector<SourcePtr> input_sources_;
  PyObject* example_inputs_ = nullptr;                 // list of real tensors
  std::unordered_map<PyObject*, VarPtr> tensor_vars_;  // real tensor -> its Var (one input per tensor)
  std::unordered_map<PyObject*, SourcePtr> tensor_first_source_;
  int depth_ = 0;
  // graph breaks (root frame only)
  int break_step_ = -1;
  bool broke_ = false;
  BreakState break_state_;
  int failed_step_ = -1, failed_pc_ = -1;
  /// The root frame's current step and instruction (the call an inlined frame runs under).
  int root_step_ = 0, root_pc_ = -1;
  /// Exceptions that left an inlined frame, with the root step and instruction of the call they left (the first
  /// time): eager's traceback holds that frame, which a later re-raise would show, so a re-raise of one breaks the
  /// graph at that call instead (failed_override_), where eager then raises it for real.
  std::unordered_map<VarPtr, std::pair<int, int>> exceptions_from_calls_;
  std::pair<int, int> failed_override_{-1, -1};
  /// Generators made in the trace, with the root step they were made in (first_live_generator_step).
  std::vector<std::pair<std::weak_ptr<Var>, int>> generator_steps_;
  /// The stand-ins user_object_standin made (owned): one reaching wrap_result would leave the trace as a constant.
  std::unordered_set<PyObject*> standins_;
  std::unordered_map<const Var*, int> memo_slots_;
  /// Dicts and lists read from the frame, by identity (each Var's built_from): one Var per container, so a change made
  /// through one path is seen through every other, and its items are written back once (PendingStore::contents).
  std::unordered_map<PyObject*, VarPtr> containers_from_frame_;  // finish(break_output): list/dict -> memo slot
  /// Dynamic shapes (symbolic_ints.h); null when every size is specialised.
  std::unique_ptr<SymbolicInts> symbolic_;
  /// `x.shape`, `x.size(d)`, `x.numel()`, `len(x)` of a tensor under dynamic shapes: symbolic ints; nullptr for
  /// other calls.
  VarPtr symbolic_size_call(PyObject* fn, const std::vector<VarPtr>& args, const KwArgs& kwargs);
  /// How many nodes the recorder holds (calls_symbolic.cpp).
  int recorded_nodes();
 public:
  SymbolicInts* symbolic() const { return symbolic_ && symbolic_->active() ? symbolic_.get() : nullptr; }
  /// The trace's symbolic ints whether or not a symbol was made (range_violation()); null under dynamic=False.
  SymbolicInts* symbolic_ints() const { return symbolic_.get(); }
  /// The lines kiln.explain and KILN_LOGS=dynamic show for the graph's dynamic dims and size guards.
  std::vector<std::string> dynamic_summary() const { return symbolic_ ? symbolic_->summary() : std::vector<std::string>{}; }
};

}  // namespace kiln::trace
